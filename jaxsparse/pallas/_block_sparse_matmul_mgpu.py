"""Mosaic GPU (Hopper: TMA + wgmma) kernels for ``x @ W`` and ``dY @ Wᵀ`` with a block-sparse ``W``.

Both products are one "dense x sparse" kernel (:func:`dense_sparse_matmul`): output tile ``(tile_m, ob)``
at row tile ``mi`` and output block column ``c`` sums ``a[mi rows, a-block of step t] @ B_t`` over the
steps ``t`` of column ``c``, ``offsets[c] <= t < offsets[c + 1]``:

* forward ``y = x @ W``: ``a = x``, column ``c`` = block column ``j`` of ``W``; its steps are its kept
  blocks in column-major order (``col_offsets``), ``B_t = data[transpose_order[t]]`` and the ``x``
  block is block row ``row_indices[transpose_order[t]]``.
* ``dX = dY @ Wᵀ``: ``a = dY``, column ``c`` = block row ``i`` of ``W``; its steps are its kept blocks
  in row-major order (``row_offsets``), ``B_t = data[t]ᵀ`` and the ``dY`` block is ``col_indices[t]``.

The kernel is persistent and warp-specialised: each of ``num_ctas`` thread blocks walks its share of
the output tiles (every ``num_ctas``-th tile of a grouped order that keeps ``group_m`` row tiles of
``a`` hot in L2; with ``MosaicKernelConfig.balance`` the order is sorted by steps in windows, :func:`tile_order`;
with ``MosaicKernelConfig.dynamic`` each thread block takes the next tile of the order from an atomic counter
instead, :func:`._mosaic_common.request_position`),
one memory warpgroup streams the ``a`` tile and the ``B`` block of every step through
a ring of ``num_stages`` shared-memory slots with TMA, continuing across tile boundaries, and two
compute warpgroups (``tile_m / 2`` rows each) accumulate with wgmma in float32 and store their half
of the tile with TMA. The loops over steps have data-dependent trip counts; work and traffic are
proportional to the kept blocks. With ``MosaicKernelConfig.split = S > 1`` each output tile's steps are cut
into ``S`` parts (:func:`jaxsparse.pallas._common.chunk`), each a tile of the grid of its own that stores a
float32 partial sum, added by one XLA pass afterwards: more tiles for outputs with too few to fill the GPU.

With ``MosaicKernelConfig.group_cols = G > 1`` an output tile spans ``G`` neighbouring output block columns
(``G`` float32 accumulators): its steps are the union of the ``a`` blocks its columns keep a block in
(:func:`steps_of`), each step loads the ``a`` tile once and the ``B`` tile of every column that keeps one,
and runs each column's wgmma only there. Small blocks re-read ``a`` once per kept block otherwise (an
``M x 32`` slab per 32 x 32 block); a group reads it once per union entry, ``1 - (1 - d)^G`` of the
``a`` blocks against ``G d`` (d = 0.25, G = 8: 0.90 against 2.0), with no MMA on absent blocks.

Float32 inputs run on TF32 wgmma, the precision of XLA's own float32 ``dot`` at DEFAULT precision on a
GPU (callers keep ``Precision.HIGHEST`` on the exact Triton kernels). TF32 wgmma reads both operands
K-major only, so the float32 forward takes its ``B`` blocks from a transposed copy of ``data``
(``(nnz, bn, bk)``, one pass over the kept weights) and views them transposed in shared memory, as
``dX`` does with ``data`` itself.

Needs a Hopper GPU (compute capability 9.x: wgmma), inputs of one dtype (bf16, fp16 or f32) and blocks
of 32, 64 or 128; :func:`unsupported_reason` says why not otherwise, and :mod:`jaxsparse.pallas._block_sparse_matmul`
falls back to its Triton kernels. The tile-order and step-order logic is plain ``jnp`` (``_common.grouped_tile``,
:func:`steps_of`) so that CPU tests can check it against the dense product; the kernel itself also runs
in Mosaic GPU interpret mode on a CPU (``interpret=True``): the forward with jax 0.10 (CI), the
transposed ``dX`` product only from jax 0.11 (0.10's interpreter lacks transposed wgmma operands).
Measured on an H100 (``benchmarks/results/gpu_block_sparse_2026-11-21_h100.md``): at ``M = 8192`` and
density 0.25, 0.31 of the dense time for 128 x 128 blocks, 0.50 for 64 x 64 blocks (bound by reading
each kept block's ``M x 64`` slab of ``x`` from L2).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxsparse import _utils
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._block_sparse import block_slots
from jaxsparse.pallas._common import balanced_order
from jaxsparse.pallas._common import check_pattern
from jaxsparse.pallas._common import chunk
from jaxsparse.pallas._common import dealt
from jaxsparse.pallas._common import dealt_count
from jaxsparse.pallas._common import grouped_tile
from jaxsparse.pallas._mosaic_common import interpret_params
from jaxsparse.pallas._mosaic_common import launch
from jaxsparse.pallas._mosaic_common import num_sms
from jaxsparse.pallas._mosaic_common import publish_position
from jaxsparse.pallas._mosaic_common import request_position
from jaxsparse.pallas._mosaic_common import smem_transforms
from jaxsparse.pallas._mosaic_common import tma_rows
from jaxsparse.pallas._mosaic_common import transposed
from jaxsparse.pallas._mosaic_config import MAX_ACC_ELEMENTS
from jaxsparse.pallas._mosaic_config import MAX_STAGES
from jaxsparse.pallas._mosaic_config import NUM_COMPUTE_WGS
from jaxsparse.pallas._mosaic_config import OUT_DTYPES
from jaxsparse.pallas._mosaic_config import SMEM_BYTES
from jaxsparse.pallas._mosaic_config import SUPPORTED_BLOCK_DIMS
from jaxsparse.pallas._mosaic_config import SUPPORTED_DTYPES
from jaxsparse.pallas._mosaic_config import MosaicBlockSparseMatmulConfig
from jaxsparse.pallas._mosaic_config import MosaicKernelConfig

# Registers per thread: the memory warpgroup gives most of its share to the two compute warpgroups,
# whose float32 accumulators take up to 128 per thread (a 128 x 128 tile).
_MEMORY_REGISTERS = 40
_COMPUTE_REGISTERS = 232
# Tile positions the dynamic schedule's memory warpgroup may publish ahead of the compute warpgroups.
_TILE_RING = 4

__all__ = [
    "MosaicBlockSparseMatmulConfig",
    "MAX_ACC_ELEMENTS",
    "MAX_STAGES",
    "MosaicKernelConfig",
    "dense_sparse_matmul",
    "dx",
    "forward",
    "num_sms",
    "resolve_config",
    "steps_of",
    "supports",
    "tile_grid",
    "tile_order",
    "unsupported_reason",
]

# -------------------------------------------------------------------------------------------------
# Schedule: which blocks each output column sums (which output tile a thread block handles is
# `_common.grouped_tile`). Plain jnp, shared by the kernel and the CPU tests.
# -------------------------------------------------------------------------------------------------


def steps_of(w: BlockSparseMatrix, *, transpose: bool, group: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-tile-column step lists of ``x @ W`` (``transpose=False``) or ``dY @ Wᵀ`` (``True``).

  Tile column ``c`` covers the ``group`` output block columns ``c * group + j`` (block columns of ``W``,
  block rows for ``dY @ Wᵀ``), ``0 <= j < group``.

  Returns:
    ``(offsets, blocks, a_blocks)``: tile column ``c`` sums steps ``offsets[c]:offsets[c + 1]``; step
    ``t`` multiplies block ``a_blocks[t]`` (a block column of ``x`` or of ``dY``) of the dense operand
    with ``data[blocks[t, j]]`` (transposed for ``dY @ Wᵀ``) into output block column ``c * group + j``
    wherever ``blocks[t, j] >= 0`` (``-1``: that column keeps no block there). ``blocks`` is
    ``(steps, group)``; with ``group = 1`` the steps are exactly the kept blocks, else the union of
    the kept blocks' ``a`` blocks over the group's columns (padded to a static length).
  """
  if group == 1:
    if transpose:
      return w.row_offsets, jnp.arange(w.nnz_blocks, dtype=jnp.int32)[:, None], w.col_indices
    return w.col_offsets, w.transpose_order[:, None], w.row_indices[w.transpose_order]
  kb, nb = w.grid_shape
  num_out, num_a = (kb, nb) if transpose else (nb, kb)
  num_tc = -(-num_out // group)
  slot = block_slots(w)
  by_out = jnp.pad(slot if transpose else slot.T, ((0, num_tc * group - num_out), (0, 0)), constant_values=-1)
  grouped = by_out.reshape(num_tc, group, num_a).transpose(0, 2, 1).reshape(num_tc * num_a, group)
  # Compaction with one running count: step i (of the tile columns' a blocks in order) goes to position
  # count[i] - 1 where some column keeps a block; the count at each tile column's end is its offset.
  present = jnp.any(grouped >= 0, axis=1)
  count = jnp.cumsum(present, dtype=jnp.int32)
  offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), count[num_a - 1 :: num_a]])
  size = num_tc * num_a
  steps = jnp.zeros(size, jnp.int32).at[jnp.where(present, count - 1, size)].set(jnp.arange(size), mode="drop")
  return offsets, grouped[steps], steps % num_a


# -------------------------------------------------------------------------------------------------
# Support.
# -------------------------------------------------------------------------------------------------


def unsupported_reason(a: jax.Array, w: BlockSparseMatrix, out_dtype=None, config=None, *, transpose=False):
  """Why the Mosaic GPU kernel cannot compute ``a @ W`` (or ``a @ Wᵀ``), or ``None``."""
  if not isinstance(w, BlockSparseMatrix):
    return f"w must be a BlockSparseMatrix, got {type(w).__name__}"
  if jnp.dtype(a.dtype) not in SUPPORTED_DTYPES or a.dtype != w.dtype:
    return f"needs inputs of one dtype in {[str(d) for d in SUPPORTED_DTYPES]}, got {a.dtype} and {w.dtype}"
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  if out_dtype not in OUT_DTYPES:
    return f"out_dtype {out_dtype} is not one of {[str(d) for d in OUT_DTYPES]}"
  if a.ndim != 2:
    return f"activations must be 2-D, got shape {a.shape}"
  bk, bn = w.block_shape
  if bk not in SUPPORTED_BLOCK_DIMS or bn not in SUPPORTED_BLOCK_DIMS:
    return f"block_shape={(bk, bn)}: each block dim must be one of {SUPPORTED_BLOCK_DIMS}"
  features = w.shape[1] if transpose else w.shape[0]
  if a.shape[1] != features:
    return f"the activations have {a.shape[1]} features but W needs {features}"
  ob, cb = (bk, bn) if transpose else (bn, bk)
  if config is not None:
    if cb % config.tile_k or ob % min(config.epi_n, ob):
      return f"{config} does not tile blocks {w.block_shape}"
    if a.dtype.itemsize == 4 and config.tile_k != 32:
      return f"{config}: float32 (TF32 wgmma) needs tile_k=32"
    if a.dtype.itemsize == 2 and not transpose and min(config.tile_k, ob) == 32 and config.tile_k != ob:
      # Mosaic GPU's layout inference fails on 16-bit B tiles 32 on one side only (H100, jax 0.11.2).
      return f"{config}: 16-bit blocks {w.block_shape} need B tiles of tile_k x {ob} with both 32 or neither"
    if config.smem_bytes(ob, a.dtype.itemsize, out_dtype.itemsize) > SMEM_BYTES:
      return f"{config} needs more than {SMEM_BYTES} bytes of shared memory"
    if config.acc_elements(ob) > MAX_ACC_ELEMENTS:
      return (
          f"{config}: (tile_m / 2) x group_cols x {ob} = {config.acc_elements(ob)} float32 accumulator elements per"
          f" warpgroup, more than {MAX_ACC_ELEMENTS} (128 registers a thread)"
      )
  return None


def supports(a, w, out_dtype=None, config=None, *, transpose=False) -> bool:
  """Whether :func:`dense_sparse_matmul` handles these operands (see :func:`unsupported_reason`)."""
  return unsupported_reason(a, w, out_dtype, config, transpose=transpose) is None


def resolve_config(a, w, out_dtype=None, config=None, *, transpose=False) -> MosaicKernelConfig:
  """The config :func:`dense_sparse_matmul` runs for these operands.

  ``config`` (by default :meth:`MosaicBlockSparseMatmulConfig.get_default`) with ring slots given up,
  down to 2, until the epilogue buffer of a wider output (float32 of 16-bit inputs) fits shared memory.
  :func:`unsupported_reason` with the result says whether the kernel can run it.
  """
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  if not isinstance(w, BlockSparseMatrix):
    return config or MosaicKernelConfig()
  if config is None:
    default = MosaicBlockSparseMatmulConfig.get_default(a.shape[0], w.block_shape, a.dtype, out_dtype)
    config = default.dx if transpose else default.forward
  ob = w.block_shape[0] if transpose else w.block_shape[1]
  while config.num_stages > 2 and config.smem_bytes(ob, a.dtype.itemsize, out_dtype.itemsize) > SMEM_BYTES:
    config = dataclasses.replace(config, num_stages=config.num_stages - 1)
  return config


# -------------------------------------------------------------------------------------------------
# Kernel.
# -------------------------------------------------------------------------------------------------


def _steps(start, end, step, g):
  """``lax.fori_loop(start, end, step, g)`` counted from 0.

  Inside ``jax.shard_map(check_vma=True)`` a bound read from a ref keeps the operands' manual-axis type while the
  loop index after one step has none (jax 0.11's ``plgpu.kernel`` traces its body with the check off), and a loop
  carry must keep its type: the index starts at a constant instead.
  """
  return lax.fori_loop(0, end - start, lambda i, g: step(start + i, g), g)


def tile_grid(m: int, num_out: int, cfg: MosaicKernelConfig) -> tuple[int, int]:
  """``(row tiles, tile columns)`` of an ``m``-row product with ``num_out`` output block columns; the kernel runs
  ``cfg.split`` times as many tiles."""
  return -(-m // cfg.tile_m), -(-num_out // cfg.group_cols)


def tile_order(offsets: jax.Array, num_m: int, num_c: int, cfg: MosaicKernelConfig, num_ctas: int) -> jax.Array:
  """The output tiles in the order the persistent thread blocks take them (:func:`._common.dealt`).

  A tile is coded ``(part * num_m + row_tile) * num_c + tile_column``. The grouped order
  (:func:`._common.grouped_tile`, every part of a split after the previous one), reordered by
  :func:`._common.balanced_order` in windows of ``cfg.balance`` rounds by each tile's steps.

  Args:
    offsets: ``(num_c + 1,)`` int32 step offsets of the tile columns (:func:`steps_of`).
    num_m: row tiles.
    num_c: tile columns.
    cfg: the kernel config (``group_m``, ``split``, ``balance``).
    num_ctas: thread blocks of the persistent grid.

  Returns:
    ``(cfg.split * num_m * num_c,)`` int32 tile codes.
  """
  mi, c = grouped_tile(jnp.arange(num_m * num_c, dtype=jnp.int32), num_m, num_c, cfg.group_m)
  part = jnp.repeat(jnp.arange(cfg.split, dtype=jnp.int32), num_m * num_c)
  mi, c = jnp.tile(mi, cfg.split), jnp.tile(c, cfg.split)
  codes = (part * num_m + mi) * num_c + c
  if cfg.balance == 0:
    return codes
  start, end = chunk(offsets[c], offsets[c + 1], part, cfg.split)
  return codes[balanced_order(end - start, num_ctas, cfg.balance)]


def _kernel(
    order_ref,
    offsets_ref,
    blocks_ref,
    a_blocks_ref,
    a_ref,
    data_ref,
    *refs,
    cfg: MosaicKernelConfig,
    transpose: bool,
    b_k_major: bool,
    num_m: int,
    num_c: int,
    num_out: int,
    num_ctas: int,
    interpret: bool,
):
  """One thread block: warpgroups 0 and 1 compute, warpgroup 2 streams the operands.

  ``data_ref`` holds ``(nnz, ob, cb)`` blocks with ``b_k_major`` (``dX``: ``data``; the float32
  forward: ``data`` transposed), else ``(nnz, cb, ob)`` (the 16-bit forward: ``data``). ``num_c`` tile
  columns of ``cfg.group_cols`` output block columns each cover the ``num_out`` output block columns
  (the last tile column may cover fewer). With ``cfg.dynamic`` on a GPU ``refs`` is ``(counter_ref, out_ref)``,
  the counter the thread blocks take tile positions from (:func:`._mosaic_common.request_position`), else
  ``(out_ref,)``.
  """
  counter_ref, out_ref = refs if cfg.dynamic and not interpret else (None, *refs)
  _, d1, d2 = data_ref.shape
  ob, cb = (d1, d2) if b_k_major else (d2, d1)
  tm, tk, stages, group = cfg.tile_m, cfg.tile_k, cfg.num_stages, cfg.group_cols
  half = tm // NUM_COMPUTE_WGS
  ksub = cb // tk
  epi_n = min(cfg.epi_n, ob)
  dtype, out_dtype = a_ref.dtype, out_ref.dtype

  cta = lax.axis_index("cta")
  wg = lax.axis_index("wg")
  split, snake = cfg.split, cfg.balance > 0
  num_tiles = num_m * num_c * split
  my_tiles = dealt_count(cta, num_tiles, num_ctas, snake)

  def tile(pos):
    code = order_ref[pos]  # see tile_order
    rest, c = divmod(code, num_c)
    s, mi = divmod(rest, num_m)
    return mi, c, s, *chunk(offsets_ref[c], offsets_ref[c + 1], s, split)

  def step_blocks(t):
    # The data index of each column's block at step t (-1: none; only where group > 1).
    if group == 1:
      return [t if transpose else blocks_ref[t]]
    return [blocks_ref[t, j] for j in range(group)]

  def when_kept(b, body):
    # Runs body() where the column keeps its block; unconditionally for one column (always kept).
    if group == 1:
      body()
    else:
      pl.when(b >= 0)(body)

  b_shape = (ob, tk) if b_k_major else (tk, ob)
  ring = _TILE_RING
  # The dynamic schedule's ring of published tile positions (a few words; see publish_position) and its barriers.
  schedule = {}
  if cfg.dynamic:
    schedule = dict(
        positions=plgpu.SMEM((ring,), jnp.int32),
        published=plgpu.Barrier(num_arrivals=1, num_barriers=ring),
        taken=plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=ring),
    )

  @functools.partial(
      pl.run_scoped,
      a_smem=plgpu.SMEM((stages, tm, tk), dtype, transforms=smem_transforms(tk, dtype)),
      # One B tile a slot (and column, where group > 1).
      b_smem=plgpu.SMEM(
          (stages, *b_shape) if group == 1 else (stages, group, *b_shape),
          dtype,
          transforms=smem_transforms(b_shape[1], dtype),
      ),
      o_smem=plgpu.SMEM((NUM_COMPUTE_WGS, half, epi_n), out_dtype, transforms=smem_transforms(epi_n, out_dtype)),
      # One arrival per copy: the a tile and each column's B tile (a column without a block arrives
      # without a copy).
      ready=plgpu.Barrier(num_arrivals=1 + group, num_barriers=stages),
      consumed=plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=stages),
      **schedule,
      collective_axes="wg",
  )
  def _scope(a_smem, b_smem, o_smem, ready, consumed, positions=None, published=None, taken=None):
    def b_tile(slot, j):
      return b_smem.at[slot] if group == 1 else b_smem.at[slot, j]

    def each_tile(body, g, *, memory: bool):
      """Runs ``g = body(pos, g)`` for the position (in ``order_ref``) of each tile this thread block takes.

      Static schedule: the positions :func:`dealt` gives the thread block. Dynamic: the memory warpgroup requests
      the next tile's position from the counter as it starts a tile's copies and publishes it in
      ``positions[n % ring]`` after them; the compute warpgroups read it there. Both loops end at the first
      position past the tiles (published too).
      """
      if not cfg.dynamic:
        return lax.fori_loop(0, my_tiles, lambda i, g: body(dealt(i, cta, num_ctas, snake), g), g)

      def next_position(n, requested=None):
        slot = lax.rem(n, ring)
        if memory:

          @pl.when(n >= ring)
          def _():
            plgpu.barrier_wait(taken.at[slot])

          pos = publish_position(requested, positions, slot, interpret=interpret)
          plgpu.barrier_arrive(published.at[slot])
        else:
          plgpu.barrier_wait(published.at[slot])
          pos = positions[slot]
          plgpu.barrier_arrive(taken.at[slot])
        return pos

      def request(n):
        return request_position(counter_ref, n, cta, num_ctas, interpret=interpret)

      def loop_body(carry):
        n, g, pos, requested = carry
        g = body(pos, g)  # the memory warpgroup's request for the next tile is in flight while it issues these copies
        if memory:
          return n + 1, g, next_position(n + 1, requested), request(n + 2)
        return n + 1, g, next_position(n + 1), requested

      n0 = jnp.int32(0)
      first = next_position(n0, request(n0)) if memory else next_position(n0)
      carry = (n0, g, first, request(n0 + 1) if memory else n0)
      n, g, _, _ = lax.while_loop(lambda c: c[2] < num_tiles, loop_body, carry)
      if memory:
        # Observe the last takes too, so that every barrier ends in a consistent phase.
        @pl.loop(jnp.maximum(n + 1 - ring, 0), n + 1)
        def _(k):
          plgpu.barrier_wait(taken.at[lax.rem(k, ring)])

      return g

    @pl.when(wg == NUM_COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

      def tile_body(pos, g):
        mi, _, _, start, end = tile(pos)

        def step(t, g):
          bs = step_blocks(t)
          a0 = a_blocks_ref[t] * cb
          for kk in range(ksub):
            slot = lax.rem(g, stages)

            @pl.when(g >= stages)
            def _(slot=slot):
              plgpu.barrier_wait(consumed.at[slot])

            plgpu.copy_gmem_to_smem(
                a_ref.at[pl.ds(mi * tm, tm), pl.ds(a0 + kk * tk, tk)], a_smem.at[slot], ready.at[slot]
            )
            for j, b in enumerate(bs):

              def copy_b(b=b, j=j, kk=kk, slot=slot):
                if b_k_major:
                  b_src = data_ref.at[b, :, pl.ds(kk * tk, tk)]
                else:
                  b_src = data_ref.at[b, pl.ds(kk * tk, tk), :]
                plgpu.copy_gmem_to_smem(b_src, b_tile(slot, j), ready.at[slot])

              when_kept(b, copy_b)
              if group > 1:

                @pl.when(b < 0)
                def _(slot=slot):
                  plgpu.barrier_arrive(ready.at[slot])

            g = g + 1
          return g

        return _steps(start, end, step, g)

      steps = each_tile(tile_body, jnp.int32(0), memory=True)

      # Observe the last releases too, so that every barrier ends in a consistent phase.
      @pl.loop(jnp.maximum(steps - stages, 0), steps)
      def _(g):
        plgpu.barrier_wait(consumed.at[lax.rem(g, stages)])

    @pl.when(wg < NUM_COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
      rows = pl.ds(wg * half, half)

      def tile_body(pos, g):
        mi, c, part, start, end = tile(pos)

        def acc_scope(*acc_refs):
          def step(t, g):
            bs = step_blocks(t) if group > 1 else [None]  # one column: always kept
            for _ in range(ksub):
              slot = lax.rem(g, stages)
              plgpu.barrier_wait(ready.at[slot])
              for j, (b, acc_ref) in enumerate(zip(bs, acc_refs, strict=True)):

                def mma(acc_ref=acc_ref, j=j, slot=slot):
                  b_ref = b_tile(slot, j)
                  plgpu.wgmma(acc_ref, a_smem.at[slot, rows], transposed(b_ref) if b_k_major else b_ref)

                when_kept(b, mma)
              plgpu.wgmma_wait(0)
              plgpu.barrier_arrive(consumed.at[slot])
              g = g + 1
            return g

          g_end = _steps(start, end, step, g)
          return g_end, [acc_ref[...] for acc_ref in acc_refs]

        g_end, accs = pl.run_scoped(acc_scope, *[plgpu.ACC((half, ob), jnp.float32) for _ in range(group)])
        out_rows = pl.ds(mi * tm + wg * half, half)
        for j, acc in enumerate(accs):
          col = c * group + j

          def store(acc=acc, col=col):
            for e in range(ob // epi_n):
              plgpu.wait_smem_to_gmem(0, wait_read_only=True)
              o_smem[wg] = acc[:, e * epi_n : (e + 1) * epi_n].astype(out_dtype)
              plgpu.commit_smem()
              cols = pl.ds(col * ob + e * epi_n, epi_n)
              dst = out_ref.at[out_rows, cols] if split == 1 else out_ref.at[part, out_rows, cols]
              plgpu.copy_smem_to_gmem(o_smem.at[wg], dst)

          if num_out % group and j >= num_out % group:
            pl.when(col < num_out)(store)  # the last tile column covers fewer output block columns
          else:
            store()
        return g_end

      each_tile(tile_body, jnp.int32(0), memory=False)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def dense_sparse_matmul(
    a: jax.Array,
    w: BlockSparseMatrix,
    *,
    transpose: bool = False,
    out_dtype: jax.typing.DTypeLike | None = None,
    config: MosaicKernelConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
  """``a (M, K) @ W (K, N)`` or, with ``transpose``, ``a (M, N) @ Wᵀ``, accumulated in float32.

  Args:
    a: ``(M, features)`` activations (``x`` or ``dY``), of ``w``'s dtype (bf16, fp16, or float32
      computed in TF32).
    w: block-sparse ``(K, N)`` weight.
    transpose: multiply by ``Wᵀ`` (the ``dX`` product) instead of ``W``.
    out_dtype: output dtype, ``a.dtype`` by default (float32 keeps the accumulator).
    config: tiling; defaults to :meth:`MosaicBlockSparseMatmulConfig.get_default`.
    interpret: run in Mosaic GPU interpret mode (on a CPU, slow; for tests).

  Returns:
    ``(M, N)`` (or ``(M, K)`` with ``transpose``) array of ``out_dtype``.
  """
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  config = resolve_config(a, w, out_dtype, config, transpose=transpose)
  reason = unsupported_reason(a, w, out_dtype, config, transpose=transpose)
  if reason is not None:
    raise ValueError(f"The Mosaic GPU block-sparse kernel does not support these operands: {reason}.")
  check_pattern(w, op="Mosaic GPU block-sparse " + ("dx" if transpose else "forward"))
  m = a.shape[0]
  (bk, bn), (kb, nb) = w.block_shape, w.grid_shape
  ob, num_out = (bk, kb) if transpose else (bn, nb)
  out_cols = num_out * ob
  if w.nnz_blocks == 0:
    return jnp.zeros((m, out_cols), out_dtype)
  (ap,) = tma_rows(a, tile_m=config.tile_m)
  num_m, num_c = tile_grid(m, num_out, config)
  num_tiles = num_m * num_c * config.split
  num_ctas = config.num_ctas
  num_ctas = num_tiles if num_ctas == 0 else min(num_tiles, num_ctas or num_sms())
  offsets, blocks, a_blocks = steps_of(w, transpose=transpose, group=config.group_cols)
  if config.group_cols == 1:
    blocks = blocks[:, 0]
  order = tile_order(offsets, num_m, num_c, config, num_ctas)
  b_k_major = transpose or a.dtype.itemsize == 4
  data = w.data if transpose or not b_k_major else jnp.swapaxes(w.data, 1, 2)
  kernel = functools.partial(
      _kernel,
      transpose=transpose,
      b_k_major=b_k_major,
      num_m=num_m,
      num_c=num_c,
      num_out=num_out,
      num_ctas=num_ctas,
      interpret=interpret,
  )
  params = {"interpret": interpret_params()} if interpret else {}
  # A split writes float32 partial sums, one (M, out_cols) slab a part.
  rows = num_m * config.tile_m  # the stores of the last row tile stay in bounds; sliced to m below
  out_shape = (rows, out_cols) if config.split == 1 else (config.split, rows, out_cols)
  out_type = _utils.result_struct(out_shape, out_dtype if config.split == 1 else jnp.float32, a, w)
  operands = (order, offsets, blocks, a_blocks, ap, data)
  static = functools.partial(kernel, cfg=dataclasses.replace(config, dynamic=False))
  dynamic = functools.partial(kernel, cfg=config) if config.dynamic else None
  out = launch(static, operands, out_type, num_ctas, params, num_threads=NUM_COMPUTE_WGS + 1, dynamic_kernel=dynamic)
  out = _utils.vary(out, _utils.varying_axes(a, w))  # plgpu.kernel (jax 0.11) drops the type's varying axes
  if config.split > 1:
    out = out.sum(axis=0).astype(out_dtype)
  return out[:m] if rows != m else out


def forward(x2, w, *, out_dtype=None, config: MosaicBlockSparseMatmulConfig | None = None, interpret=False):
  """``x2 (M, K) @ W -> (M, N)`` (see :func:`dense_sparse_matmul`)."""
  cfg = None if config is None else config.forward
  return dense_sparse_matmul(x2, w, out_dtype=out_dtype, config=cfg, interpret=interpret)


def dx(dy2, w, *, out_dtype=None, config: MosaicBlockSparseMatmulConfig | None = None, interpret=False):
  """``dY (M, N) @ Wᵀ -> (M, K)`` (see :func:`dense_sparse_matmul`)."""
  cfg = None if config is None else config.dx
  return dense_sparse_matmul(dy2, w, transpose=True, out_dtype=out_dtype, config=cfg, interpret=interpret)
