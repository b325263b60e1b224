"""The XLA path of :func:`jaxsparse.ops.block_sparse_matmul`: a loop over the kept blocks, one block product a step.

Activations are handled transposed and split into block slabs: ``xT[i]`` is the ``(bk, M)`` slab of block row ``i``,
so each loop step reads one contiguous slab instead of gathering strided columns. The route of last resort (every
platform, every block shape, float64 accumulation) and the reference the kernels were first checked against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxsparse import _utils
from jaxsparse.formats._block_sparse import BlockSparseMatrix

__all__ = ["loop_backward", "loop_forward"]


def _slabs(a2: jax.Array, block: int) -> jax.Array:
  """``(M, D)`` -> ``(D // block, block, M)``."""
  m, d = a2.shape
  return a2.T.reshape(d // block, block, m)


def _unslab(aT: jax.Array) -> jax.Array:
  """``(D // block, block, M)`` -> ``(M, D)``."""
  nb, b, m = aT.shape
  return aT.reshape(nb * b, m).T


def _dot(a, b, contract, precision, acc):
  return lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=acc)


def loop_forward(x2: jax.Array, w: BlockSparseMatrix, *, precision=None, out_dtype=None) -> jax.Array:
  """``x2 (M, K) @ W -> (M, N)`` walking the kept blocks; reference for the Pallas forward kernel."""
  (bk, bn), (_, nb) = w.block_shape, w.grid_shape
  acc = _utils.accumulation_dtype(x2.dtype, w.dtype)
  if out_dtype is not None and jnp.issubdtype(out_dtype, jnp.floating):
    acc = _utils.accumulation_dtype(acc, out_dtype)  # a float64 result of float32 operands accumulates in float64
  xT = _slabs(x2, bk)
  data, rows, cols, order = w.data, w.row_indices, w.col_indices, w.transpose_order

  def body(t, yT):
    # Column-major order: consecutive steps accumulate into the same output slab.
    b = order[t]
    contrib = _dot(data[b], xT[rows[b]], ((0,), (0,)), precision, acc)  # (bn, M)
    j = cols[b]
    return lax.dynamic_update_index_in_dim(yT, yT[j] + contrib, j, 0)

  yT = _utils.vary(jnp.zeros((nb, bn, x2.shape[0]), acc), _utils.varying_axes(x2, w))  # the carry varies as x
  if w.nnz_blocks:  # An empty pattern has no block to index (and contributes nothing).
    yT = lax.fori_loop(0, w.nnz_blocks, body, yT)
  return _unslab(yT).astype(out_dtype or acc)


def loop_backward(
    x2: jax.Array, dy2: jax.Array, w: BlockSparseMatrix, *, precision=None, need_dx=True, need_dw=True
) -> tuple[jax.Array | None, jax.Array | None]:
  """``dX = dY @ Wᵀ`` and ``dW = (xᵀ dY)`` on the kept blocks, in one pass over the blocks."""
  (bk, bn), (kb, _) = w.block_shape, w.grid_shape
  acc = _utils.accumulation_dtype(x2.dtype, dy2.dtype, w.dtype)
  dyT = _slabs(dy2, bn)
  xT = _slabs(x2, bk) if need_dw else None
  data, rows, cols = w.data, w.row_indices, w.col_indices

  def body(t, carry):
    dxT, ddata = carry
    i, dyj = rows[t], dyT[cols[t]]
    if need_dx:
      contrib = _dot(data[t], dyj, ((1,), (0,)), precision, acc)  # (bk, M)
      dxT = lax.dynamic_update_index_in_dim(dxT, dxT[i] + contrib, i, 0)
    if need_dw:
      blk = _dot(xT[i], dyj, ((1,), (1,)), precision, acc)  # (bk, bn)
      ddata = lax.dynamic_update_index_in_dim(ddata, blk.astype(ddata.dtype), t, 0)
    return dxT, ddata

  dxT0 = jnp.zeros((kb, bk, x2.shape[0]), acc) if need_dx else None
  ddata0 = jnp.zeros(w.data.shape, w.dtype) if need_dw else None
  dxT0, ddata0 = _utils.vary((dxT0, ddata0), _utils.varying_axes(x2, dy2, w))  # the carries vary as the operands
  dxT, ddata = lax.fori_loop(0, w.nnz_blocks, body, (dxT0, ddata0)) if w.nnz_blocks else (dxT0, ddata0)
  dx = _unslab(dxT).astype(x2.dtype) if need_dx else None
  return dx, ddata
