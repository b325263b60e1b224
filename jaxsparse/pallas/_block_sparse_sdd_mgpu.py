"""Mosaic GPU (Hopper) kernel for the sampled ``dW = xᵀ dY`` of a block-sparse ``W`` (the SDD product).

``ddata[t] = x[:, i-slab]ᵀ @ dY[:, j-slab]`` for every kept block ``t = (i, j)``: a reduction over
the ``M`` rows. Each kept block needs its ``M x bk`` slab of ``x`` and its ``M x bn`` slab of ``dY``;
streaming both per block reads two slabs per block from L2. Here one work item takes ``group``
consecutive kept blocks of one block row (blocks are stored row-major, so they are consecutive in
``data``): the ``x`` slab is read once for all of them, ``1 + group`` slabs for ``group`` blocks.

The kernel is persistent and warp-specialised like the forward kernel
(:mod:`jaxsparse.pallas._block_sparse_matmul_mgpu`): one memory warpgroup streams, per ``tile_m``
rows, the ``x`` tile and the ``group`` ``dY`` tiles of the current item into a ring of shared-memory
slots with TMA; two compute warpgroups each own ``group / 2`` of the item's blocks and accumulate
``x_tileᵀ @ dY_tile`` with wgmma (``x`` viewed transposed in shared memory) into float32 registers.
A row whose kept-block count is not a multiple of ``group`` ends with a short item, padded by
repeating its last block: the repeat computes and stores the same values again (a little wasted
work, no conditional code). Items all cost the same, so a static round-robin over ``num_ctas``
thread blocks balances them.

Float32 runs on TF32 wgmma (the precision of XLA's float32 products at DEFAULT precision on a GPU),
which reads both operands K-major only: the wrapper transposes ``x`` and ``dY`` to ``(K, M)`` and
``(N, M)`` first (one pass over each, :mod:`jaxsparse.pallas._transpose`) and the kernel loads
``(bk, tile_m)`` / ``(bn, tile_m)`` tiles of those. 16-bit inputs are read as they are, wgmma viewing
the ``x`` tile transposed.

Needs ``bk`` of 64 or 128 (the wgmma M dimension is a multiple of 64) and, for 16-bit inputs, ``bn``
of 64 or 128 (both operands need the same 128-byte swizzle; float32 also takes ``bn = 32``); blocks
with ``bk = 32`` and pre-Hopper GPUs use the Triton SDD kernel. The item logic is plain ``jnp``
(:func:`jaxsparse.pallas._common.items_of`), checked on a CPU.
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
from jaxsparse.pallas import _transpose
from jaxsparse.pallas._common import check_pattern
from jaxsparse.pallas._common import items_of
from jaxsparse.pallas._common import pad_rows
from jaxsparse.pallas._mosaic_common import interpret_params
from jaxsparse.pallas._mosaic_common import launch
from jaxsparse.pallas._mosaic_common import num_sms
from jaxsparse.pallas._mosaic_common import smem_transforms
from jaxsparse.pallas._mosaic_common import tma_rows
from jaxsparse.pallas._mosaic_common import transposed

__all__ = ["MosaicSddConfig", "sampled_dw", "supports", "unsupported_reason"]

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
SUPPORTED_BK = (64, 128)
# 16-bit: bn of 32 would give the dY tiles a 64-byte swizzle against the x tiles' 128 (wgmma needs
# one). Float32 tiles are tile_m = 32 wide (128 bytes) whatever the block.
SUPPORTED_BN = {2: (64, 128), 4: (32, 64, 128)}
_EPI_N = 64
# float32 accumulator elements per compute warpgroup: 128 registers per thread.
_MAX_ACC_ELEMS = 128 * 128
_NUM_COMPUTE_WGS = 2
_MEMORY_REGISTERS = 40
_COMPUTE_REGISTERS = 232
_SMEM_BYTES = 227 * 1024
# The deepest ring the default configs take: 6 slots against 4 took 5-8% off 64-blocks, 8 was slower than 6
# (H200, M = 8192; benchmarks/results/gpu_mosaic_stages_2026-11-26_h200.md).
MAX_STAGES = 6
_ORDERS = ("auto", "rows", "cols")


@dataclasses.dataclass(frozen=True)
class MosaicSddConfig:
  """Tiling of the Mosaic GPU sampled ``xᵀ dY`` kernel.

  Attributes:
    group: kept blocks of one block row per work item (sharing one read of the ``x`` slab); even,
      half of them per compute warpgroup.
    tile_m: rows of ``x`` / ``dY`` per pipeline step (the wgmma contraction depth): 64 or 128 for
      16-bit inputs, 32 for float32 (one 128-byte swizzle row).
    num_stages: shared-memory slots in the load ring.
    num_ctas: thread blocks of the persistent grid; ``None`` means one per streaming multiprocessor.
    order: the order in which the thread blocks take the items: ``"rows"`` (by block row, the items
      in flight share few ``x`` slabs and many ``dY`` slabs), ``"cols"`` (by the block column of an
      item's first block: few ``dY`` slabs, many ``x`` slabs), or ``"auto"``: by columns where
      ``N >= K``. Every wave of items streams all ``M`` rows of the slabs it touches, and a slab left
      out of L2 is read again by the next wave that needs it, so the side with more slabs should be
      the one the wave shares. H100, M = 8192, K = 4096, 64 x 64 blocks, ratio to the dense ``xᵀ dY``,
      rows -> cols (``benchmarks/gpu_product_routes.py --variants``): N = 16384 bf16 d = 0.25 0.91 ->
      0.59, d = 0.5 2.01 -> 1.07, float32 0.67 -> 0.52, 1.43 -> 0.85; N = 4096 0.64-0.66 -> 0.64-0.68
      at d = 0.25, 1.02-1.16 -> 0.97-1.07 at d = 0.5.

  Used as ``mosaic_dw`` of a :class:`~jaxsparse.pallas.BlockSparseMatmulConfig`; the kernel needs a Hopper
  GPU, the config does not:

  >>> from jaxsparse import pallas
  >>> cfg = pallas.MosaicSddConfig(group=4, order="cols")
  >>> cfg.group, cfg.tile_m, cfg.order
  (4, 64, 'cols')
  >>> pallas.MosaicSddConfig(group=3)
  Traceback (most recent call last):
  ...
  ValueError: group must be even and >= 2 (half per compute warpgroup), got group=3.
  """

  group: int = 2
  tile_m: int = 64
  num_stages: int = 4
  num_ctas: int | None = None
  order: str = "auto"

  def __post_init__(self):
    if self.group < 2 or self.group % 2:
      raise ValueError(f"group must be even and >= 2 (half per compute warpgroup), got group={self.group}.")
    if self.tile_m not in (32, 64, 128):
      raise ValueError(f"tile_m must be 32, 64 or 128, got tile_m={self.tile_m}.")
    if self.num_stages < 1:
      raise ValueError(f"num_stages must be >= 1, got num_stages={self.num_stages}.")
    if self.num_ctas is not None and self.num_ctas < 1:
      raise ValueError(f"num_ctas must be None or positive, got num_ctas={self.num_ctas}.")
    if self.order not in _ORDERS:
      raise ValueError(f"order must be one of {_ORDERS}, got order={self.order!r}.")

  def smem_bytes(self, block_shape: tuple[int, int], itemsize: int) -> int:
    """Shared memory the kernel allocates for ``block_shape`` blocks.

    Args:
      block_shape: ``(bk, bn)`` of the weight's blocks.
      itemsize: bytes per element of ``x`` and ``dY``.

    Returns:
      The bytes (an int): the load ring (``num_stages`` slots of one ``x`` slab and ``group`` ``dY`` slabs) plus
      the epilogue's staging tiles.

    >>> from jaxsparse import pallas
    >>> pallas.MosaicSddConfig().smem_bytes((64, 64), 2)  # bf16 blocks of 64
    114688
    """
    bk, bn = block_shape
    ring = self.num_stages * self.tile_m * (bk + self.group * bn) * itemsize
    return ring + _NUM_COMPUTE_WGS * bk * min(bn, _EPI_N) * itemsize

  @classmethod
  def get_default(cls, block_shape: tuple[int, int], dtype) -> MosaicSddConfig:
    """Two blocks per item (one per compute warpgroup), one 128-byte row of ``M`` per step, and the
    deepest ring that fits.

    Measured on an H100 (M = 8192, K = N = 4096, d = 0.25, ``benchmarks/gpu_block_sparse.py
    --dw-sweep``): for 64 x 64 blocks, 2 blocks per item took 0.203 ms (bf16) / 0.585 ms (f32)
    against 0.229 / 0.637 with 4 and 0.301 / 0.793 with 8: fewer, longer items balance worse over
    the 132 thread blocks than the shared ``x`` reads save. The ring: up to :data:`MAX_STAGES` slots (H200,
    ``benchmarks/gpu_mosaic_stages.py --products dw``: bf16 64-blocks 0.56 -> 0.52 of the dense ``xᵀ dY`` at
    d = 0.25 and 0.90 -> 0.85 at d = 0.5 with 6 slots against 4; 8 slots 0.56 / 0.89).

    Args:
      block_shape: ``(bk, bn)`` of the weight's blocks.
      dtype: the dtype of ``x`` and ``dY`` (float32: 32 rows a step; 16-bit: 64).

    Returns:
      A ``MosaicSddConfig`` with ``group=2``, ``order="auto"`` and the deepest ring that fits 227 KiB of shared
      memory; 2 slots where not even those fit (check :meth:`smem_bytes` then).

    >>> import jax.numpy as jnp
    >>> from jaxsparse import pallas
    >>> cfg = pallas.MosaicSddConfig.get_default((64, 64), jnp.bfloat16)
    >>> cfg.group, cfg.tile_m, cfg.num_stages
    (2, 64, 6)
    """
    itemsize = jnp.dtype(dtype).itemsize
    tile_m = 128 // itemsize if itemsize == 4 else 64
    for stages in range(MAX_STAGES, 1, -1):
      cfg = cls(group=2, tile_m=tile_m, num_stages=stages)
      if cfg.smem_bytes(block_shape, itemsize) <= _SMEM_BYTES:
        return cfg
    return cfg


def unsupported_reason(x2, dy2, w, config: MosaicSddConfig | None = None) -> str | None:
  """Why :func:`sampled_dw` cannot compute these operands, or ``None``."""
  if not isinstance(w, BlockSparseMatrix):
    return f"w must be a BlockSparseMatrix, got {type(w).__name__}"
  dtype = jnp.dtype(x2.dtype)
  if dtype not in SUPPORTED_DTYPES or dy2.dtype != dtype or w.dtype != dtype:
    names = [str(d) for d in SUPPORTED_DTYPES]
    return f"needs inputs of one dtype in {names}, got {x2.dtype}, {dy2.dtype}, {w.dtype}"
  bk, bn = w.block_shape
  bns = SUPPORTED_BN[dtype.itemsize]
  if bk not in SUPPORTED_BK or bn not in bns:
    return f"block_shape={(bk, bn)}: needs bk in {SUPPORTED_BK} and bn in {bns} for {dtype}"
  if x2.ndim != 2 or dy2.ndim != 2 or x2.shape[1] != w.shape[0] or dy2.shape != (x2.shape[0], w.shape[1]):
    return f"needs x (M, {w.shape[0]}) and dy (M, {w.shape[1]}), got {x2.shape} and {dy2.shape}"
  if config is not None and config.smem_bytes(w.block_shape, dtype.itemsize) > _SMEM_BYTES:
    return f"{config} needs more than {_SMEM_BYTES} bytes of shared memory"
  if config is not None and config.group // _NUM_COMPUTE_WGS * bk * bn > _MAX_ACC_ELEMS:
    per_wg = config.group // _NUM_COMPUTE_WGS
    return f"{config}: {per_wg} float32 {bk}x{bn} accumulators per warpgroup exceed its registers"
  if config is not None and (config.tile_m == 32) != (dtype.itemsize == 4):
    return f"{config}: tile_m=32 is the float32 (TF32) tile and only it"
  return None


def supports(x2, dy2, w, config: MosaicSddConfig | None = None) -> bool:
  """Whether :func:`sampled_dw` handles these operands (see :func:`unsupported_reason`)."""
  return unsupported_reason(x2, dy2, w, config) is None


def _kernel(
    num_items_ref,
    rows_ref,
    blocks_ref,
    cols_ref,
    x_ref,
    dy_ref,
    out_ref,
    *,
    cfg: MosaicSddConfig,
    block_shape: tuple[int, int],
    num_steps: int,
    num_ctas: int,
    k_major: bool,
):
  """One thread block: warpgroups 0 and 1 compute half of each item's blocks, warpgroup 2 loads.

  With ``k_major`` (float32) ``x_ref`` / ``dy_ref`` hold ``xᵀ (K, M)`` / ``dYᵀ (N, M)``, else
  ``x (M, K)`` / ``dY (M, N)``.
  """
  bk, bn = block_shape
  epi_n = min(bn, _EPI_N)
  tm, stages, group = cfg.tile_m, cfg.num_stages, cfg.group
  per_wg = group // _NUM_COMPUTE_WGS
  dtype = x_ref.dtype
  cta = lax.axis_index("cta")
  wg = lax.axis_index("wg")
  my_items = (num_items_ref[0] - cta + num_ctas - 1) // num_ctas
  x_tile = (stages, bk, tm) if k_major else (stages, tm, bk)
  dy_tile = (stages, group, bn, tm) if k_major else (stages, group, tm, bn)

  @functools.partial(
      pl.run_scoped,
      x_smem=plgpu.SMEM(x_tile, dtype, transforms=smem_transforms(x_tile[-1], dtype)),
      dy_smem=plgpu.SMEM(dy_tile, dtype, transforms=smem_transforms(dy_tile[-1], dtype)),
      o_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, bk, epi_n), dtype, transforms=smem_transforms(epi_n, dtype)),
      ready=plgpu.Barrier(num_arrivals=1 + group, num_barriers=stages),
      consumed=plgpu.Barrier(num_arrivals=_NUM_COMPUTE_WGS, num_barriers=stages),
      collective_axes="wg",
  )
  def _scope(x_smem, dy_smem, o_smem, ready, consumed):
    @pl.when(wg == _NUM_COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

      def item_body(n, g):
        it = cta + n * num_ctas
        k0 = rows_ref[it] * bk
        n0 = [cols_ref[it * group + q] * bn for q in range(group)]

        def step(s, g):
          slot = lax.rem(g, stages)

          @pl.when(g >= stages)
          def _():
            plgpu.barrier_wait(consumed.at[slot])

          r = pl.ds(s * tm, tm)
          x_src = x_ref.at[pl.ds(k0, bk), r] if k_major else x_ref.at[r, pl.ds(k0, bk)]
          plgpu.copy_gmem_to_smem(x_src, x_smem.at[slot], ready.at[slot])
          for q in range(group):
            dy_src = dy_ref.at[pl.ds(n0[q], bn), r] if k_major else dy_ref.at[r, pl.ds(n0[q], bn)]
            plgpu.copy_gmem_to_smem(dy_src, dy_smem.at[slot, q], ready.at[slot])
          return g + 1

        return lax.fori_loop(0, num_steps, step, g)

      steps = lax.fori_loop(0, my_items, item_body, jnp.int32(0))

      # Observe the last releases too, so that every barrier ends in a consistent phase.
      @pl.loop(jnp.maximum(steps - stages, 0), steps)
      def _(g):
        plgpu.barrier_wait(consumed.at[lax.rem(g, stages)])

    @pl.when(wg < _NUM_COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")

      def item_body(n, g):
        it = cta + n * num_ctas

        def acc_scope(*acc_refs):
          def step(s, g):
            slot = lax.rem(g, stages)
            plgpu.barrier_wait(ready.at[slot])
            # A = xᵀ (bk, tm), B = dY (tm, bn): the K-major tiles as they are and the dY tile viewed
            # transposed, else the x tile viewed transposed.
            a = x_smem.at[slot] if k_major else transposed(x_smem.at[slot])
            for q in range(per_wg):
              b = dy_smem.at[slot, wg * per_wg + q]
              plgpu.wgmma(acc_refs[q], a, transposed(b) if k_major else b)
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(consumed.at[slot])
            return g + 1

          g_end = lax.fori_loop(0, num_steps, step, g)
          return g_end, [acc[...] for acc in acc_refs]

        g_end, accs = pl.run_scoped(acc_scope, *[plgpu.ACC((bk, bn), jnp.float32) for _ in range(per_wg)])
        for q in range(per_wg):
          blk = blocks_ref[it * group + wg * per_wg + q]
          for e in range(bn // epi_n):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_smem[wg] = accs[q][:, e * epi_n : (e + 1) * epi_n].astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[wg], out_ref.at[blk, :, pl.ds(e * epi_n, epi_n)])
        return g_end

      lax.fori_loop(0, my_items, item_body, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def sampled_dw(
    x2: jax.Array,
    dy2: jax.Array,
    w: BlockSparseMatrix,
    *,
    config: MosaicSddConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
  """``ddata[t] = x2[:, i]ᵀ @ dy2[:, j]`` for each kept block ``t = (i, j)``, accumulated in float32.

  Args:
    x2: ``(M, K)`` forward activations, of ``w``'s dtype (bf16, fp16, or float32 computed in TF32).
    dy2: ``(M, N)`` output cotangent, same dtype.
    w: block-sparse ``(K, N)`` weight (only its pattern is read).
    config: tiling; defaults to :meth:`MosaicSddConfig.get_default`.
    interpret: run in Mosaic GPU interpret mode (on a CPU, slow; for tests).

  Returns:
    ``(nnz_blocks, bk, bn)`` array of ``w.dtype``.
  """
  config = config or MosaicSddConfig.get_default(w.block_shape, w.dtype)
  reason = unsupported_reason(x2, dy2, w, config)
  if reason is not None:
    raise ValueError(f"The Mosaic GPU sampled xᵀdY kernel does not support these operands: {reason}.")
  check_pattern(w, op="Mosaic GPU sampled dw")
  if w.nnz_blocks == 0:
    return jnp.zeros(w.data.shape, w.dtype)
  m, tm = x2.shape[0], config.tile_m
  k_major = x2.dtype.itemsize == 4
  # Zero rows add nothing to xᵀ dY. 16-bit: the last step reads past row m, zero-filled by TMA
  # (`tma_rows`). Float32 pads before its transposes, after which M is the minor dimension.
  x2, dy2 = (pad_rows(x2, tm), pad_rows(dy2, tm)) if k_major else tma_rows(x2, dy2, tile_m=tm)
  order = config.order if config.order != "auto" else ("cols" if w.shape[1] >= w.shape[0] else "rows")
  num_items, rows, blocks, cols = items_of(w, config.group, order)
  num_ctas = min(config.num_ctas or num_sms(), rows.shape[0])
  num_steps = -(-m // tm)
  if k_major:
    # TF32 wgmma reads K-major operands only.
    x2, dy2 = _transpose.transpose(x2), _transpose.transpose(dy2)
  kernel = functools.partial(
      _kernel,
      cfg=config,
      block_shape=w.block_shape,
      num_steps=num_steps,
      num_ctas=num_ctas,
      k_major=k_major,
  )
  params = {"interpret": interpret_params("zero")} if interpret else {}
  out_type = _utils.result_struct(w.data.shape, w.dtype, x2, dy2, w)
  out = launch(kernel, (num_items, rows, blocks, cols, x2, dy2), out_type, num_ctas, params,
               num_threads=_NUM_COMPUTE_WGS + 1)
  return _utils.vary(out, _utils.varying_axes(x2, dy2, w))  # plgpu.kernel (jax 0.11) drops the type's varying axes
