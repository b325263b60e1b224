"""Pallas GPU kernels for ``x @ W`` with a block-sparse ``W``: forward, ``dY @ Wᵀ`` and sampled ``xᵀ dY``.

The three products of a block-sparse layer (``W`` is ``(K, N)`` with kept ``(bk, bn)`` blocks, see
:class:`jaxsparse.BlockSparseMatrix`):

* ``forward``:  ``y = x @ W``. One program per ``(block_m, bn)`` output tile (at decode, per
  ``(block_m, sub_cols)`` slice of it: ``KernelConfig.sub_cols``); it walks the kept blocks of block
  column ``j`` (``col_offsets`` / ``transpose_order``) and accumulates ``x[:, i-th K slab] @ data[b]``.
* ``dx``:  ``dX = dY @ Wᵀ``. One program per ``(block_m, bk)`` tile; it walks the kept blocks of
  block row ``i`` (``row_offsets``), contracting ``dY[:, j-th N slab]`` with ``data[t]`` on ``bn``.
* ``dw``:  ``dW[t] = x[:, i slab]ᵀ @ dY[:, j slab]`` for each kept block ``t``: one program per kept
  block (or per ``sub_cols`` of its rows, or per ``group_blocks`` kept blocks of a block row), a reduction
  over ``M``.

The kernels are plain ``pl.pallas_call`` kernels lowered through Triton on CUDA GPUs (compute
capability 8.0 and later); the index arrays are ordinary inputs read inside the kernel and the loops
over kept blocks have data-dependent trip counts, so the same code also runs in Pallas interpret mode
on a CPU, which is how CI tests it. Work and memory traffic are proportional to the kept blocks; the
dense ``K x N`` weight is never built.

On Hopper GPUs (compute capability 9.x) the forward and ``dx`` products run instead on the Mosaic GPU
kernel of :mod:`jaxsparse.pallas._block_sparse_matmul_mgpu` (TMA + wgmma, persistent and
warp-specialised) for 16-bit operands with blocks of 64 or 128 at ``M >= 1024`` (1.1-1.6x faster than
these Triton kernels at ``M = 8192`` on an H100) and at the mid-size ``M`` where it measured faster
(blocks of 64 at 128-512 rows, of 128 from 512) and for float32 operands at DEFAULT precision (TF32
wgmma, as XLA's own float32 products; 4-7x faster than Triton's float32 tiles) from ``M = 128``; ``dw``
runs on :mod:`jaxsparse.pallas._block_sparse_sdd_mgpu` for float32 and for 16-bit 64 x 64 blocks.
Blocks of 32 compute ``dw`` as one dense ``xᵀ dY`` plus a gather, and all three products densely above
density 0.3, where the per-block kernels measured slower than dense; float32 forward / ``dx`` products
contracting over 16384 or more (K / N) with blocks of 32, or of 64 from density 0.4, also run on the
weight built dense (``forward_dense`` / ``dx_dense``), and ``dw`` of 64-blocks from density 0.4 is
the dense ``xᵀ dY`` plus a gather except on the Mosaic float32 kernel (the rules and their measurements:
:mod:`jaxsparse.pallas._block_sparse_config`).
Decode-sized ``M``, the rest of the 16-bit cases, ``Precision.HIGHEST`` and older GPUs keep the Triton
kernels.

Tile sizes live in :class:`BlockSparseMatmulConfig`; :meth:`BlockSparseMatmulConfig.get_default`
holds the measured winners and the one heuristic (``benchmarks/gpu_block_sparse.py --sweep`` and
``--mosaic-sweep``). Measured dispatch (``jaxsparse.ops.block_sparse_matmul`` on a GPU) times the configs of
:func:`candidates` (:mod:`._block_sparse_candidates`) per product and passes the winner as ``config``; with an
explicit config the Triton kernels also take blocks of ``WIDE_BLOCK_DIMS``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxsparse import _utils
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.pallas._block_sparse_candidates import candidates
from jaxsparse.pallas._block_sparse_config import BlockSparseMatmulConfig
from jaxsparse.pallas._block_sparse_config import mosaic_available
from jaxsparse.pallas._block_sparse_config import mosaic_unavailable_reason
from jaxsparse.pallas._common import PallasFallbackWarning
from jaxsparse.pallas._common import allows_tf32
from jaxsparse.pallas._common import available
from jaxsparse.pallas._common import check_pattern
from jaxsparse.pallas._common import chunk
from jaxsparse.pallas._common import dot
from jaxsparse.pallas._common import grouped_tile
from jaxsparse.pallas._common import items_of
from jaxsparse.pallas._common import unavailable_reason
from jaxsparse.pallas._common import whole_block
from jaxsparse.pallas._dense_route import dense_dx
from jaxsparse.pallas._dense_route import dense_forward
from jaxsparse.pallas._dense_route import dw_dense_then_gather
from jaxsparse.pallas._kernel_config import KernelConfig

try:  # Mosaic GPU (Hopper) variants of the forward, dx and dw kernels.
  from jaxsparse.pallas import _block_sparse_matmul_mgpu as mosaic
  from jaxsparse.pallas import _block_sparse_sdd_mgpu as mosaic_sdd
except ImportError:  # a jax without Mosaic GPU: the Triton kernels only.
  mosaic = mosaic_sdd = None

__all__ = [
    "BlockSparseMatmulConfig",
    "KernelConfig",
    "PallasFallbackWarning",
    "available",
    "backward",
    "candidates",
    "dense_dx",
    "dense_forward",
    "dw_dense_then_gather",
    "forward",
    "mosaic_available",
    "mosaic_unavailable_reason",
    "supports",
    "unavailable_reason",
    "unsupported_reason",
]

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
SUPPORTED_BLOCK_DIMS = (16, 32, 64, 128)
# Block dims the Triton kernels also take when a config is given explicitly (measured dispatch tries them against
# the supported sub-blocks; the shipped defaults never pick them).
WIDE_BLOCK_DIMS = (256,)


# -------------------------------------------------------------------------------------------------
# Availability and support.
# -------------------------------------------------------------------------------------------------


def _use_mosaic(mosaic_cfg, a, w, out_dtype, *, transpose: bool, interpret: bool, precision=None) -> bool:
  """Whether this product runs on the Mosaic GPU kernel (in its interpret mode with ``interpret``)."""
  if mosaic_cfg is None or mosaic is None or not (interpret or mosaic_available()):
    return False
  if jnp.dtype(a.dtype).itemsize == 4 and not allows_tf32(precision):
    return False  # the Mosaic kernel computes float32 in TF32
  return mosaic.supports(a, w, out_dtype, transpose=transpose)


def unsupported_reason(*args, block_dims: tuple[int, ...] = SUPPORTED_BLOCK_DIMS) -> str | None:
  """Why :func:`supports` is False for these operands, or ``None`` when they are supported."""
  *arrays, w = args
  if not isinstance(w, BlockSparseMatrix):
    return f"w must be a BlockSparseMatrix, got {type(w).__name__}"
  for a in (*arrays, w.data):
    if jnp.dtype(a.dtype) not in SUPPORTED_DTYPES:
      return f"dtype {a.dtype} is not one of {[str(d) for d in SUPPORTED_DTYPES]}"
  for a in arrays:
    if a.ndim != 2:
      return f"activations must be 2-D (M, features), got shape {a.shape}"
  bk, bn = w.block_shape
  if bk not in block_dims or bn not in block_dims:
    return f"block_shape={(bk, bn)}: each block dim must be one of {block_dims}"
  if arrays[0].shape[1] != w.shape[0]:
    return f"x has {arrays[0].shape[1]} features but W has K={w.shape[0]} rows"
  if len(arrays) == 2 and arrays[1].shape != (arrays[0].shape[0], w.shape[1]):
    return f"dy must have shape (M, N) = {(arrays[0].shape[0], w.shape[1])}, got {arrays[1].shape}"
  return None


def supports(*args) -> bool:
  """Whether the kernels handle these operands: ``(x2, w)`` (forward) or ``(x2, dy2, w)`` (backward).

  Supported: 2-D activations, dtypes bfloat16 / float16 / float32 (mixed dtypes compute in the
  promoted one), block dims in ``SUPPORTED_BLOCK_DIMS`` (and ``WIDE_BLOCK_DIMS`` with an explicit config).
  """
  return unsupported_reason(*args) is None


def _check_supported(*args, config=None) -> None:
  dims = SUPPORTED_BLOCK_DIMS if config is None else SUPPORTED_BLOCK_DIMS + WIDE_BLOCK_DIMS
  reason = unsupported_reason(*args, block_dims=dims)
  if reason is not None:
    raise ValueError(f"The Pallas block-sparse kernels do not support these operands: {reason}.")


# -------------------------------------------------------------------------------------------------
# Kernels.
# -------------------------------------------------------------------------------------------------


def _masked_window(ref, start, window: int):
  """``ref[start:start + window]`` of a 1-D index array, its entries past the end read as 0."""
  lane = lax.broadcasted_iota(jnp.int32, (window,), 0)
  return pltriton.load(ref.at[pl.ds(start, window)], mask=start + lane < ref.shape[0], other=0)


class _Rows:
  """The rows of one program's ``(block_m, ...)`` tile of ``x`` / ``dY`` and of the output.

  ``m`` (static) is the number of rows of the unpadded operands: a tile that reaches past it (decode, or ``M`` not a
  multiple of ``block_m``) loads zeros there and stores only its rows below ``m``, so that the wrapper neither pads
  the operands nor slices the result (each an extra kernel: 0.7-1.8 us at decode on an H200, as long as the
  product itself).
  """

  def __init__(self, tile_row, block_m: int, m: int):
    self.ragged = m % block_m != 0
    if self.ragged:
      self.ok = (tile_row * block_m + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)) < m

  def load(self, ref):
    return pltriton.load(ref, mask=self.ok, other=0) if self.ragged else ref[...]

  def store(self, ref, value):
    if self.ragged:
      pltriton.store(ref, value, mask=self.ok)
    else:
      ref[...] = value


def _split_range(start, end, split: int):
  """The part of ``[start, end)`` that split program ``pl.program_id(1)`` handles."""
  return chunk(start, end, pl.program_id(1) if split > 1 else 0, split)


class _BlockIndex:
  """Step ``t`` -> entries of the index arrays, for the kept blocks of one block row or column.

  With ``cfg.index_window`` the ``window`` entries starting at ``start`` (a power of two covering the
  row / column) are loaded once and step ``t`` picks its entry from registers; otherwise each step
  loads its entries from memory. The window's entries past the end of the arrays are masked (read as 0,
  never picked).
  """

  def __init__(self, refs, start, window: int, cfg: KernelConfig):
    self.refs, self.windowed = refs, cfg.index_window
    if self.windowed:
      self.start = start
      self.lane = lax.broadcasted_iota(jnp.int32, (window,), 0)
      self.vectors = [_masked_window(r, start, window) for r in refs]

  def __call__(self, t):
    if not self.windowed:
      return [r[t] for r in self.refs]
    hit = self.lane == t - self.start
    return [jnp.sum(jnp.where(hit, v, 0)) for v in self.vectors]


def _dsd_kernel(
    col_offsets_ref,
    order_ref,
    row_offsets_ref,
    rows_ref,
    x_ref,
    data_ref,
    y_ref,
    *,
    num_m,
    num_n,
    subs,
    window,
    m,
    cfg,
    dot,
):
  """``y[m tile, j] = sum over kept (i, j): x[m tile, i] @ data[(i, j)]``.

  ``order_ref`` lists the positions in ``data`` of the kept blocks in column-major order; column
  ``j`` owns entries ``col_offsets[j]:col_offsets[j + 1]``. The block row of position ``b`` is
  ``rows_ref[b]``, or, from registers, the number of block rows ``r >= 1`` that start at or before
  ``b`` (``row_offsets`` is sorted). With ``subs > 1`` programs own ``bn // subs`` columns of a
  block column (``data_ref`` holds just those columns of every block).
  """
  ii, jj = grouped_tile(pl.program_id(0), num_m, num_n * subs, cfg.group_m)
  rows = _Rows(ii, x_ref.shape[0], m)
  j = jj // subs
  bk = data_ref.shape[1]
  start, end = col_offsets_ref[j], col_offsets_ref[j + 1]
  index = _BlockIndex((order_ref,), start, window, cfg)
  if cfg.index_window:
    num_rows = x_ref.shape[1] // bk
    # window >= num_rows: the starts of all block rows.
    lane = lax.broadcasted_iota(jnp.int32, (window,), 0)
    starts = _masked_window(row_offsets_ref, 0, window)
    row_starts = jnp.where((lane >= 1) & (lane < num_rows), starts, jnp.iinfo(jnp.int32).max)
    block_row = lambda b: jnp.sum((row_starts <= b).astype(jnp.int32))
  else:
    block_row = lambda b: rows_ref[b]

  def step(t):
    (b,) = index(t)
    k0 = pl.multiple_of(block_row(b) * bk, bk)
    return dot(rows.load(x_ref.at[:, pl.ds(k0, bk)]), data_ref[b], ((1,), (0,)))

  acc = jnp.zeros(y_ref.shape, jnp.float32)
  acc = lax.fori_loop(*_split_range(start, end, cfg.split), lambda t, acc: acc + step(t), acc)
  rows.store(y_ref, acc.astype(y_ref.dtype))


def _dst_kernel(offsets_ref, cols_ref, dy_ref, data_ref, dx_ref, *, num_m, num_k, subs, window, m, cfg, dot):
  """``dx[m tile, i] = sum over kept (i, j): dy[m tile, j] @ data[(i, j)]ᵀ`` (``bk // subs`` columns
  of block row ``i`` per program, as in :func:`_dsd_kernel`)."""
  mm, ii = grouped_tile(pl.program_id(0), num_m, num_k * subs, cfg.group_m)
  rows = _Rows(mm, dy_ref.shape[0], m)
  i = ii // subs
  bn = data_ref.shape[2]
  start, end = offsets_ref[i], offsets_ref[i + 1]
  index = _BlockIndex((cols_ref,), start, window, cfg)

  def step(t):
    (j,) = index(t)
    n0 = pl.multiple_of(j * bn, bn)
    return dot(rows.load(dy_ref.at[:, pl.ds(n0, bn)]), data_ref[t], ((1,), (1,)))

  acc = jnp.zeros(dx_ref.shape, jnp.float32)
  acc = lax.fori_loop(*_split_range(start, end, cfg.split), lambda t, acc: acc + step(t), acc)
  rows.store(dx_ref, acc.astype(dx_ref.dtype))


def _slab(ref, r0, bm: int, cols, ragged: bool):
  """``ref[r0:r0 + bm, cols]``; with ``ragged`` its rows from ``ref.shape[0]`` on read as 0: ``dw``'s steps over
  ``M`` reach past the operands' rows where ``M`` is not a multiple of the rows a step (or of the split's steps), and
  masked loads cost less than padded copies of ``x`` and ``dY`` (each a pass over the operand before the kernel)."""
  if not ragged:
    return ref[pl.ds(r0, bm), cols]
  ok = r0 + lax.broadcasted_iota(jnp.int32, (bm, 1), 0) < ref.shape[0]
  return pltriton.load(ref.at[pl.ds(r0, bm), cols], mask=ok, other=0)


def _sdd_kernel(rows_ref, cols_ref, x_ref, dy_ref, ddata_ref, *, block_shape, steps, subs, ragged, cfg, dot):
  """``ddata[t] = x[:, i]ᵀ @ dy[:, j]`` for kept block ``t = (i, j)``, over this program's rows; with ``subs > 1``
  program ``(t, q)`` computes the block's rows ``q * sub`` to ``(q + 1) * sub`` (``KernelConfig.sub_cols``)."""
  t, q = pl.program_id(0) // subs, pl.program_id(0) % subs
  (bk, bn), bm = block_shape, cfg.block_m
  sub = bk // subs
  k0 = pl.multiple_of(rows_ref[t] * bk + q * sub, sub)
  n0 = pl.multiple_of(cols_ref[t] * bn, bn)
  first = pl.program_id(1) * steps if cfg.split > 1 else 0

  def body(s, acc):
    r0 = pl.multiple_of((first + s) * bm, bm)
    xs, dys = _slab(x_ref, r0, bm, pl.ds(k0, sub), ragged), _slab(dy_ref, r0, bm, pl.ds(n0, bn), ragged)
    return acc + dot(xs, dys, ((0,), (0,)))

  acc = lax.fori_loop(0, steps, body, jnp.zeros((sub, bn), jnp.float32))
  ddata_ref[...] = acc.astype(ddata_ref.dtype)


def _sdd_grouped_kernel(num_ref, rows_ref, blocks_ref, cols_ref, x_ref, dy_ref, ddata_ref, *, block_shape, steps,
                        ragged, cfg, dot):
  """:func:`_sdd_kernel` for the up to ``group_blocks`` kept blocks of item ``p`` (one block row ``i``): each step
  loads the ``x[:, i slab]`` rows once for all of them (``KernelConfig.group_blocks``)."""
  p, part, group = pl.program_id(0), pl.program_id(1), cfg.group_blocks
  (bk, bn), bm = block_shape, cfg.block_m
  first = part * steps if cfg.split > 1 else 0

  @pl.when(p < num_ref[0])  # items past num_items are padding
  def _():
    k0 = pl.multiple_of(rows_ref[p] * bk, bk)
    n0s = [pl.multiple_of(cols_ref[p * group + j] * bn, bn) for j in range(group)]

    def body(s, accs):
      r0 = pl.multiple_of((first + s) * bm, bm)
      xs = _slab(x_ref, r0, bm, pl.ds(k0, bk), ragged)
      return tuple(acc + dot(xs, _slab(dy_ref, r0, bm, pl.ds(n0, bn), ragged), ((0,), (0,)))
                   for acc, n0 in zip(accs, n0s, strict=True))

    accs = lax.fori_loop(0, steps, body, tuple(jnp.zeros((bk, bn), jnp.float32) for _ in range(group)))
    # A short item repeats its last block: that block is written again, with the same sums.
    for j, acc in enumerate(accs):
      b = blocks_ref[p * group + j]
      if cfg.split > 1:
        ddata_ref[part, b] = acc.astype(ddata_ref.dtype)
      else:
        ddata_ref[b] = acc.astype(ddata_ref.dtype)


# -------------------------------------------------------------------------------------------------
# Wrappers.
# -------------------------------------------------------------------------------------------------


def _sub_cols(cfg: KernelConfig, block_dim: int) -> tuple[int, int]:
  """``(columns per program, programs per block column)`` for output blocks ``block_dim`` wide."""
  sub = min(cfg.sub_cols or block_dim, block_dim)
  return sub, block_dim // sub


def _params(cfg: KernelConfig) -> pltriton.CompilerParams:
  return pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _config_for(config, x2, w) -> BlockSparseMatmulConfig:
  if config is not None:
    return config
  return BlockSparseMatmulConfig.get_default(x2.shape[0], w.shape, w.block_shape, w.nnz_blocks, w.dtype)


def forward(
    x2: jax.Array,
    w: BlockSparseMatrix,
    *,
    precision: lax.PrecisionLike = None,
    out_dtype: jax.typing.DTypeLike | None = None,
    config: BlockSparseMatmulConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
  """``x2 (M, K) @ W (K, N) -> (M, N)``, accumulated in float32.

  Args:
    x2: ``(M, K)`` activations.
    w: block-sparse ``(K, N)`` weight.
    precision: passed to the in-kernel dots (float32 inputs: ``None`` means full float32).
    out_dtype: output dtype; defaults to ``result_type(x2, w.data)``.
    config: tile config; defaults to :meth:`BlockSparseMatmulConfig.get_default`.
    interpret: run in Pallas interpret mode (any backend, slow; for tests).

  Returns:
    ``(M, N)`` array of ``out_dtype``.
  """
  _check_supported(x2, w, config=config)
  check_pattern(w, op="block_sparse_matmul forward")
  (m, _), (_, n) = x2.shape, w.shape
  (bk, bn), (_, nb) = w.block_shape, w.grid_shape
  compute_dtype = jnp.result_type(x2.dtype, w.dtype)
  out_dtype = jnp.dtype(out_dtype or compute_dtype)
  if w.nnz_blocks == 0:
    return jnp.zeros((m, n), out_dtype)
  configs = _config_for(config, x2, w)
  if (configs.dense or configs.forward_dense) and not interpret:
    return dense_forward(x2, w, precision=precision, out_dtype=out_dtype)
  if _use_mosaic(configs.mosaic_forward, x2, w, out_dtype, transpose=False, interpret=interpret, precision=precision):
    return mosaic.dense_sparse_matmul(x2, w, out_dtype=out_dtype, config=configs.mosaic_forward, interpret=interpret)
  cfg = configs.forward
  # The kernel reads `window` entries of the index arrays at a time (masked past their ends).
  window = pl.next_power_of_2(w.grid_shape[0])
  num_m = pl.cdiv(m, cfg.block_m)  # the last row tile is masked where M is not a multiple (_Rows)
  sub, subs = _sub_cols(cfg, bn)
  tile = functools.partial(grouped_tile, num_m=num_m, num_n=nb * subs, group_m=cfg.group_m)
  grid = (num_m * nb * subs, cfg.split)
  x_spec = pl.BlockSpec((cfg.block_m, x2.shape[1]), lambda p, s: (tile(p)[0], 0))
  data_spec = pl.BlockSpec((w.nnz_blocks, bk, sub), lambda p, s: (0, 0, tile(p)[1] % subs))
  if cfg.split == 1:
    out_shape = _utils.result_struct((m, n), out_dtype, x2, w)
    out_spec = pl.BlockSpec((cfg.block_m, sub), lambda p, s: tile(p))
  else:
    out_shape = _utils.result_struct((cfg.split, m, n), jnp.float32, x2, w)
    out_spec = pl.BlockSpec((None, cfg.block_m, sub), lambda p, s: (s, *tile(p)))
  kernel = functools.partial(
      _dsd_kernel,
      num_m=num_m,
      num_n=nb,
      subs=subs,
      window=window,
      m=m,
      cfg=cfg,
      dot=functools.partial(dot, compute_dtype=compute_dtype, precision=precision),
  )
  y = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=grid,
      in_specs=[
          whole_block(w.col_offsets.shape, 2),
          whole_block(w.transpose_order.shape, 2),
          whole_block(w.row_offsets.shape, 2),
          whole_block(w.row_indices.shape, 2),
          x_spec,
          data_spec,
      ],
      out_specs=out_spec,
      compiler_params=_params(cfg),
      interpret=interpret,
      name=f"block_sparse_dsd_{bk}x{bn}",
  )(w.col_offsets, w.transpose_order, w.row_offsets, w.row_indices, x2, w.data)
  if cfg.split > 1:
    y = y.sum(axis=0).astype(out_dtype)
  return y


def _dx(dy2, w, *, compute_dtype, out_dtype, precision, cfg: KernelConfig, interpret):
  m = dy2.shape[0]
  (bk, bn), (kb, _) = w.block_shape, w.grid_shape
  window = pl.next_power_of_2(w.grid_shape[1])
  num_m = pl.cdiv(m, cfg.block_m)
  sub, subs = _sub_cols(cfg, bk)
  tile = functools.partial(grouped_tile, num_m=num_m, num_n=kb * subs, group_m=cfg.group_m)
  if cfg.split == 1:
    out_shape = _utils.result_struct((m, w.shape[0]), out_dtype, dy2, w)
    out_spec = pl.BlockSpec((cfg.block_m, sub), lambda p, s: tile(p))
  else:
    out_shape = _utils.result_struct((cfg.split, m, w.shape[0]), jnp.float32, dy2, w)
    out_spec = pl.BlockSpec((None, cfg.block_m, sub), lambda p, s: (s, *tile(p)))
  kernel = functools.partial(
      _dst_kernel,
      num_m=num_m,
      num_k=kb,
      subs=subs,
      window=window,
      m=m,
      cfg=cfg,
      dot=functools.partial(dot, compute_dtype=compute_dtype, precision=precision),
  )
  dx = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(num_m * kb * subs, cfg.split),
      in_specs=[
          whole_block(w.row_offsets.shape, 2),
          whole_block(w.col_indices.shape, 2),
          pl.BlockSpec((cfg.block_m, dy2.shape[1]), lambda p, s: (tile(p)[0], 0)),
          pl.BlockSpec((w.nnz_blocks, sub, bn), lambda p, s: (0, tile(p)[1] % subs, 0)),
      ],
      out_specs=out_spec,
      compiler_params=_params(cfg),
      interpret=interpret,
      name=f"block_sparse_dst_{bk}x{bn}",
  )(w.row_offsets, w.col_indices, dy2, w.data)
  if cfg.split > 1:
    dx = dx.sum(axis=0).astype(out_dtype)
  return dx


def _dw(x2, dy2, w, *, compute_dtype, precision, cfg: KernelConfig, interpret):
  bm, m = cfg.block_m, x2.shape[0]
  total_steps = pl.cdiv(m, bm)
  split = min(cfg.split, total_steps)
  # Every split program runs the same number of steps; the rows past M read as zeros.
  steps = pl.cdiv(total_steps, split)
  ragged = steps * split * bm != m
  cfg = dataclasses.replace(cfg, split=split)
  nnz, (bk, bn) = w.nnz_blocks, w.block_shape
  dot_ = functools.partial(dot, compute_dtype=compute_dtype, precision=precision)
  if cfg.group_blocks > 1:
    if _sub_cols(cfg, bk)[1] > 1:
      raise ValueError(f"dw programs take several kept blocks (group_blocks={cfg.group_blocks}) or row slices of one "
                       f"(sub_cols={cfg.sub_cols} of {bk} rows), not both.")
    return _dw_grouped(x2, dy2, w, steps=steps, ragged=ragged, cfg=cfg, dot=dot_, interpret=interpret)
  rows, cols = w.row_indices, w.col_indices
  if cfg.block_order == "cols":  # program t computes block transpose_order[t]; un-permuted below
    rows, cols = rows[w.transpose_order], cols[w.transpose_order]
  # Programs of one block's row slices are neighbours: they share its dY slab.
  sub, subs = _sub_cols(cfg, bk)
  if split == 1:
    out_shape = _utils.result_struct(w.data.shape, w.dtype, x2, dy2, w)
    out_spec = pl.BlockSpec((None, sub, bn), lambda p, s: (p // subs, p % subs, 0))
  else:
    out_shape = _utils.result_struct((split, *w.data.shape), jnp.float32, x2, dy2, w)
    out_spec = pl.BlockSpec((None, None, sub, bn), lambda p, s: (s, p // subs, p % subs, 0))
  kernel = functools.partial(
      _sdd_kernel,
      block_shape=(bk, bn),
      steps=steps,
      subs=subs,
      ragged=ragged,
      cfg=cfg,
      dot=dot_,
  )
  ddata = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(nnz * subs, split),
      in_specs=[
          whole_block(rows.shape, 2),
          whole_block(cols.shape, 2),
          whole_block(x2.shape, 2),
          whole_block(dy2.shape, 2),
      ],
      out_specs=out_spec,
      compiler_params=_params(cfg),
      interpret=interpret,
      name=f"block_sparse_sdd_{bk}x{bn}",
  )(rows, cols, x2, dy2)
  if cfg.block_order == "cols":
    inverse = jnp.zeros_like(w.transpose_order).at[w.transpose_order].set(jnp.arange(nnz, dtype=jnp.int32))
    ddata = ddata[..., inverse, :, :]
  if split > 1:
    ddata = ddata.sum(axis=0).astype(w.dtype)
  return ddata


def _dw_grouped(x2, dy2, w, *, steps, ragged, cfg: KernelConfig, dot, interpret):
  """:func:`_dw` with ``cfg.group_blocks`` kept blocks of a block row a program."""
  nnz, (bk, bn), split = w.nnz_blocks, w.block_shape, cfg.split
  num_items, rows, blocks, cols = items_of(w, cfg.group_blocks, cfg.block_order)
  shape, dtype = ((nnz, bk, bn), w.dtype) if split == 1 else ((split, nnz, bk, bn), jnp.float32)
  kernel = functools.partial(_sdd_grouped_kernel, block_shape=(bk, bn), steps=steps, ragged=ragged, cfg=cfg, dot=dot)
  ddata = pl.pallas_call(
      kernel,
      out_shape=_utils.result_struct(shape, dtype, x2, dy2, w),
      grid=(rows.shape[0], split),
      in_specs=[whole_block(a.shape, 2) for a in (num_items, rows, blocks, cols, x2, dy2)],
      out_specs=whole_block(shape, 2),
      compiler_params=_params(cfg),
      interpret=interpret,
      name=f"block_sparse_sdd_{bk}x{bn}_g{cfg.group_blocks}",
  )(num_items, rows, blocks, cols, x2, dy2)
  return ddata if split == 1 else ddata.sum(axis=0).astype(w.dtype)


def backward(
    x2: jax.Array,
    dy2: jax.Array,
    w: BlockSparseMatrix,
    *,
    precision: lax.PrecisionLike = None,
    config: BlockSparseMatmulConfig | None = None,
    interpret: bool = False,
    need_dx: bool = True,
    need_dw: bool = True,
) -> tuple[jax.Array | None, jax.Array | None]:
  """``dX = dY @ Wᵀ`` and ``dW = xᵀ dY`` on the kept blocks.

  Args:
    x2: ``(M, K)`` forward activations.
    dy2: ``(M, N)`` output cotangent.
    w: block-sparse ``(K, N)`` weight.
    precision, config, interpret: as in :func:`forward`.
    need_dx, need_dw: skip a product whose result is not needed (it is returned as ``None``).

  Returns:
    ``(dx, ddata)``: ``dx`` ``(M, K)`` of ``x2.dtype``, ``ddata`` ``(nnz_blocks, bk, bn)`` of
    ``w.dtype``.
  """
  _check_supported(x2, dy2, w, config=config)
  check_pattern(w, op="block_sparse_matmul backward")
  compute_dtype = jnp.result_type(x2.dtype, dy2.dtype, w.dtype)
  if w.nnz_blocks == 0:
    return (jnp.zeros(x2.shape, x2.dtype) if need_dx else None), (w.data if need_dw else None)
  cfg = _config_for(config, x2, w)
  dx = ddata = None
  # The dense routes are XLA products: interpret mode (CPU tests of the kernels) keeps the kernels.
  route_dense_dx = (cfg.dense or cfg.dx_dense) and not interpret
  route_dense_dw = (cfg.dense or cfg.dw_dense) and not interpret
  mosaic_dx = _use_mosaic(cfg.mosaic_dx, dy2, w, x2.dtype, transpose=True, interpret=interpret, precision=precision)
  if need_dx and route_dense_dx:
    dx = dense_dx(dy2, w, precision=precision, out_dtype=x2.dtype)
  elif need_dx and mosaic_dx:
    dx = mosaic.dense_sparse_matmul(
        dy2, w, transpose=True, out_dtype=x2.dtype, config=cfg.mosaic_dx, interpret=interpret
    )
  elif need_dx:
    dx = _dx(
        dy2, w, compute_dtype=compute_dtype, out_dtype=x2.dtype, precision=precision, cfg=cfg.dx, interpret=interpret
    )
  use_mosaic_dw = (
      cfg.mosaic_dw is not None
      and mosaic_sdd is not None
      and (interpret or mosaic_available())
      and (jnp.dtype(x2.dtype).itemsize != 4 or allows_tf32(precision))
      and mosaic_sdd.supports(x2, dy2, w, cfg.mosaic_dw)
  )
  if need_dw and route_dense_dw:
    ddata = dw_dense_then_gather(x2.astype(compute_dtype), dy2.astype(compute_dtype), w, precision=precision)
  elif need_dw and use_mosaic_dw:
    ddata = mosaic_sdd.sampled_dw(x2, dy2, w, config=cfg.mosaic_dw, interpret=interpret)
  elif need_dw:
    ddata = _dw(x2, dy2, w, compute_dtype=compute_dtype, precision=precision, cfg=cfg.dw, interpret=interpret)
  return dx, ddata

