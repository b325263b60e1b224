"""The dense routes of a block-sparse product: the weight built dense and one XLA product.

Chosen by the rules of :mod:`._block_sparse_config` (``DenseRules``) where small blocks, dense patterns or long
contractions make the per-block kernels slower than the dense product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxsparse.formats._block_sparse import BlockSparseMatrix


def dense_weight(w: BlockSparseMatrix, dtype) -> jax.Array:
  """The dense ``(K, N)`` weight of ``w`` in ``dtype``, built in one pass for the dense-product route.

  A gather of each output block from ``w.data`` (a zero block where none is kept), transposed into
  ``(K, N)`` order in the same fusion; :meth:`BlockSparseMatrix.to_dense` instead zero-fills, scatters
  and then transposes (three passes over the ``K x N`` output).
  """
  (bk, bn), (kb, nb) = w.block_shape, w.grid_shape
  nnz = w.nnz_blocks
  slot = jnp.full((kb, nb), nnz, jnp.int32).at[w.row_indices, w.col_indices].set(jnp.arange(nnz, dtype=jnp.int32))
  data = jnp.concatenate([w.data.astype(dtype), jnp.zeros((1, bk, bn), dtype)])
  return data[slot].transpose(0, 2, 1, 3).reshape(w.shape)


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
  return jnp.matmul(x2.astype(compute), dense_weight(w, compute), precision=precision, preferred_element_type=out_dtype)


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
