"""The dense routes of a block-sparse product: the weight built dense and one XLA product.

Chosen by the rules of :mod:`._block_sparse_config` (``DenseRules``) where small blocks, dense patterns or long
contractions make the per-block kernels slower than the dense product.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxsparse import _utils
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._block_sparse import block_slots
from jaxsparse.pallas._common import available
from jaxsparse.pallas._common import whole_block

# The build kernel's programs: a tile of at most this many elements of one block (the whole block where it fits), a
# few tiles wide, at most this many columns wide, on this many warps. The fastest of five settings on 12 shapes (H200,
# 2026-11-29; 4096 / 256 / 4 and 8192 / 512 / 4 within 3%, 16384 / 512 / 8 10-60% slower:
# benchmarks/results/gpu_dense_route_build_2026-11-29_h200.md). Blocks of more elements are cut into tiles of whole
# rows: one 256 x 256 float32 block a program (2 warps holding 256 KB) built at 0.4 TB/s.
_BUILD_PROGRAM_ELEMENTS = 2048
_BUILD_MAX_WIDTH = 256
_BUILD_NUM_WARPS = 2
# Block dims the kernel takes: 8-wide blocks build faster in XLA's gather (67 against 122 us for 90 MB).
BUILD_BLOCK_DIMS = (16, 32, 64, 128, 256)


def build_tile(block_shape: tuple[int, int]) -> tuple[int, int]:
  """The ``(rows, cols)`` of a block one program of :func:`_build_kernel` writes at a time: the whole block where it
  has at most ``_BUILD_PROGRAM_ELEMENTS`` elements, else ``_BUILD_MAX_WIDTH`` columns at most and as many whole rows
  (a power of two) as fit."""
  bk, bn = block_shape
  tn = min(bn, _BUILD_MAX_WIDTH)
  tk = bk
  while tk > 1 and tk * tn > _BUILD_PROGRAM_ELEMENTS:
    tk //= 2
  return tk, tn


def _build_group(tile: tuple[int, int], tiles_n: int) -> int:
  """Tiles per program of :func:`_build_kernel`: a power of two dividing ``tiles_n`` (the tiles across ``N``),
  ``group * tn`` at most ``_BUILD_MAX_WIDTH`` and ``tk * group * tn`` at most ``_BUILD_PROGRAM_ELEMENTS`` (or 1)."""
  tk, tn = tile
  group = 1
  while (
      tiles_n % (2 * group) == 0
      and 2 * group * tn <= _BUILD_MAX_WIDTH
      and tk * 2 * group * tn <= _BUILD_PROGRAM_ELEMENTS
  ):
    group *= 2
  return group


def build_kernel_supports(w: BlockSparseMatrix) -> bool:
  """Whether :func:`dense_weight` builds ``w`` with its Pallas kernel: block dims in ``BUILD_BLOCK_DIMS``."""
  return all(d in BUILD_BLOCK_DIMS for d in w.block_shape)


def _build_kernel(slot_ref, data_ref, o_ref, *, tile: tuple[int, int], group: int):
  """Output tile row ``i``, tile columns ``j * group + g``: that tile of the kept block ``data[slot[...]]`` or zeros."""
  i, j = pl.program_id(0), pl.program_id(1)
  tk, tn = tile
  bk, bn = data_ref.shape[1:]
  per_k, per_n = bk // tk, bn // tn  # tiles of a block along K and N
  r0 = (i % per_k) * tk
  for g in range(group):
    t = j * group + g
    s = slot_ref[i // per_k, t // per_n]
    kept = jnp.full((tk, tn), s >= 0)
    block = pltriton.load(data_ref.at[jnp.maximum(s, 0), pl.ds(r0, tk), pl.ds((t % per_n) * tn, tn)], mask=kept,
                          other=0)
    o_ref[:, pl.ds(g * tn, tn)] = block.astype(o_ref.dtype)


def dense_weight(w: BlockSparseMatrix, dtype, *, interpret: bool = False, kernel: bool | None = None) -> jax.Array:
  """The dense ``(K, N)`` weight of ``w`` in ``dtype``, built in one pass for the dense-product route.

  On a GPU (or with ``interpret``), for block dims in ``BUILD_BLOCK_DIMS`` (16 to 256), a Pallas kernel writes
  each output block row a few blocks at a time (large blocks a tile of rows at a time, :func:`build_tile`), loading
  only the kept blocks: 10-35% faster than XLA's gather on an H200 (34 MB of 32 x 32 blocks in 15.7 us against
  23.6). Otherwise one XLA gather of each output block from
  ``w.data`` (a zero block where none is kept), transposed into ``(K, N)`` order in the same fusion.
  :meth:`BlockSparseMatrix.to_dense` instead zero-fills, scatters and then transposes (three passes over the
  ``K x N`` output).

  Args:
    w: the block-sparse ``(K, N)`` weight.
    dtype: the dtype of the result.
    interpret: run the kernel in Pallas interpret mode (any backend; for tests).
    kernel: ``False`` takes the XLA gather for any blocks (benchmarks compare the two); ``None`` the kernel where
      it builds ``w``.

  Returns:
    ``(K, N)`` array of ``dtype``.
  """
  (bk, bn), (kb, nb) = w.block_shape, w.grid_shape
  dtype = jnp.dtype(dtype)
  if w.nnz_blocks == 0:
    return jnp.zeros(w.shape, dtype)
  slots = block_slots(w)
  if kernel is not False and build_kernel_supports(w) and (interpret or available()):
    tk, tn = build_tile((bk, bn))
    tiles_k, tiles_n = w.shape[0] // tk, w.shape[1] // tn
    group = _build_group((tk, tn), tiles_n)
    return pl.pallas_call(
        functools.partial(_build_kernel, tile=(tk, tn), group=group),
        out_shape=_utils.result_struct(w.shape, dtype, w),
        grid=(tiles_k, tiles_n // group),
        in_specs=[whole_block((kb, nb), 2), whole_block(w.data.shape, 2)],
        out_specs=pl.BlockSpec((tk, group * tn), lambda i, j: (i, j)),
        compiler_params=pltriton.CompilerParams(num_warps=_BUILD_NUM_WARPS, num_stages=1),
        interpret=interpret,
        name=f"block_sparse_dense_weight_{bk}x{bn}",
    )(slots, w.data)
  data = jnp.concatenate([w.data.astype(dtype), jnp.zeros((1, bk, bn), dtype)])  # position nnz: the zero block
  return data[jnp.where(slots < 0, w.nnz_blocks, slots)].transpose(0, 2, 1, 3).reshape(w.shape)


def dense_product_dtype(operand_dtype, out_dtype) -> jnp.dtype:
  """The result dtype of a dense-route product whose result is cast to ``out_dtype``.

  ``out_dtype`` itself where the operands have it: XLA's GPU products accumulate in float32 and round
  once in their epilogue, as a float32 result cast afterwards would, but write half the bytes (at
  M = 256, K = N = 4096 the ``K x N`` float32 result of the dense ``dW``, 64 MB, is 1.8x the bytes of
  its 16-bit inputs and 16-bit output together). Float32 where the operands are wider than ``out_dtype``.
  """
  return jnp.dtype(out_dtype) if jnp.dtype(operand_dtype) == jnp.dtype(out_dtype) else jnp.dtype(jnp.float32)


def dense_forward(x2, w: BlockSparseMatrix, *, precision, out_dtype) -> jax.Array:
  """The dense route of ``x2 @ W``: the weight built dense (:func:`dense_weight`) and one XLA product."""
  compute = jnp.result_type(x2.dtype, w.dtype)
  return _utils.matmul(x2.astype(compute), dense_weight(w, compute), precision=precision,
                       preferred_element_type=out_dtype)


def dense_dx(dy2, w: BlockSparseMatrix, *, precision, out_dtype) -> jax.Array:
  """The dense route of ``dX = dY @ Wᵀ``, in ``out_dtype``."""
  compute = jnp.result_type(dy2.dtype, w.dtype)
  acc = dense_product_dtype(compute, out_dtype)
  dx = jnp.matmul(dy2.astype(compute), dense_weight(w, compute).T, precision=precision, preferred_element_type=acc)
  return dx.astype(out_dtype)


def dw_dense_then_gather(x2, dy2, w, *, precision):
  """``dW`` as the dense ``x2ᵀ dy2`` with the kept blocks gathered: faster than per-block products
  where blocks are small and many."""
  (bk, bn), (kb, nb) = w.block_shape, w.grid_shape
  acc = dense_product_dtype(jnp.result_type(x2, dy2), w.dtype)
  full = lax.dot_general(x2, dy2, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=acc)
  return full.reshape(kb, bk, nb, bn)[w.row_indices, :, w.col_indices, :].astype(w.dtype)
