"""JAX wrappers of the C++ CPU kernels: ``jax.ffi.ffi_call`` plus a batching rule each.

All take and return float32 arrays with a single batch dimension (``x`` is ``(B, K)``); callers cast
and flatten. Under ``vmap`` the forward kernels fold the mapped axis into the batch dimension when
only the activations are mapped (one kernel call for the whole batch), and otherwise run one call
per mapped element (``lax.map``). The backward kernels always run per mapped element: a mapped
backward must return one weight gradient per element (so ``vmap`` over examples inside a loss
costs one backward call per example; batch dimensions of ``x`` itself are flattened into one call).

Call :func:`jaxsparse._cpu._build.load` before lowering any of these: it registers the FFI targets.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsparse import _utils

__all__ = [
    "MASKED_ROUTES",
    "block_backward",
    "block_forward",
    "csr_backward",
    "csr_few_rows_forward",
    "csr_forward",
    "csr_take",
    "csr_to_dense",
    "masked_backward",
    "masked_forward",
]

_F32 = jnp.float32
FEW_ROWS = 8  # the few-row kernels' rows, at most (kFewRows in common.h): csr_few_rows_forward, masked_forward "auto"


def _sequential(fn, axis_size, in_batched, args):
  """``fn`` applied to each element of the mapped axis (axis 0 of the batched ``args``), stacked.

  ``lax.map`` slices the mapped args itself: ``vmap`` hands a NumPy input to the rule as it is, and a NumPy array
  cannot be indexed with a traced loop index.
  """
  del axis_size  # the mapped args' leading axis
  mapped = [a for a, b in zip(args, in_batched, strict=True) if b]

  def one(elems):
    it = iter(elems)
    return fn(*[next(it) if b else a for a, b in zip(args, in_batched, strict=True)])

  return lax.map(one, mapped)


def _folded(x: jax.Array) -> jax.Array:
  """A mapped ``x (axis, B, K)`` as one batch ``(axis * B, K)`` (not ``reshape(-1, K)``: no row count for ``K = 0``)."""
  return x.reshape(x.shape[0] * x.shape[1], x.shape[2])


def _fold_or_map(fn, n_folded: int, max_rows: int | None = None):
  """A batching rule: fold the mapped axis into the batch when only the first ``n_folded`` args are mapped (and the
  folded rows are at most ``max_rows``, where the kernel takes no more)."""

  def rule(axis_size, in_batched, *args):
    folded, rest = in_batched[:n_folded], in_batched[n_folded:]
    if all(folded) and not any(rest) and (max_rows is None or axis_size * args[0].shape[1] <= max_rows):
      x = args[0]
      y = fn(_folded(x), *args[1:])
      return y.reshape(axis_size, x.shape[1], y.shape[-1]), True
    return _sequential(fn, axis_size, in_batched, args), True

  return rule


def _map_all(fn, n_out: int):
  def rule(axis_size, in_batched, *args):
    return _sequential(fn, axis_size, in_batched, args), (True,) * n_out

  return rule


def _ffi(target: str, shapes: tuple | list, *args, **attrs):
  """``jax.ffi.ffi_call(target)`` on ``args`` with float32 results of ``shapes`` (one shape, or a list of them).

  Inside ``jax.shard_map(check_vma=True)`` the operands are cast to vary alike and the results vary as they do.
  """
  args = _utils.vary_alike(*args)
  out = [_utils.result_struct(s, _F32, *args) for s in (shapes if isinstance(shapes, list) else [shapes])]
  result = jax.ffi.ffi_call(target, out if isinstance(shapes, list) else out[0], vmap_method="sequential")(
      *args, **attrs)
  return tuple(result) if isinstance(shapes, list) else result


MASKED_ROUTES = ("auto", "sparse", "gemm")  # masked_forward's routes (MaskedRoute in sparse_matmul.cc)


def masked_forward(x: jax.Array, w: jax.Array, mask: jax.Array, *, route: str = "sparse", max_density: float = 1.0,
                   small_rows: int = 0, small_max_density: float = 1.0, sample_step: int = 1) -> jax.Array:
  """``x (B, K) @ where(mask, w, 0)`` -> ``(B, N)``.

  ``route``: ``"sparse"`` the sparse kernel (work proportional to the kept weights); ``"gemm"`` the dense GEMM that
  applies the mask while it packs ``w`` (packed_gemm.cc); ``"auto"`` chooses in the call, on the rows it multiplies
  (a mapped ``x`` folded in): the GEMM for at most ``FEW_ROWS`` rows, else the sparse kernel where the density
  of ``mask``'s rows ``0, sample_step, 2 * sample_step, ...`` is at most ``max_density`` (``small_max_density`` for
  fewer than ``small_rows`` rows), else the GEMM.
  """
  return _masked_forward(MASKED_ROUTES.index(route), float(max_density), int(small_rows), float(small_max_density),
                         int(sample_step))(x, w, mask)


@functools.cache
def _masked_forward(route: int, max_density: float, small_rows: int, small_max_density: float, sample_step: int):
  @jax.custom_batching.custom_vmap
  def call(x, w, mask):
    return _ffi(
        "jaxsparse_masked_forward", (x.shape[0], w.shape[1]), x, w, mask, route=np.int32(route),
        max_density=np.float32(max_density), small_rows=np.int64(small_rows),
        small_max_density=np.float32(small_max_density), sample_step=np.int64(sample_step))

  call.def_vmap(_fold_or_map(call, 1))
  return call


@jax.custom_batching.custom_vmap
def masked_backward(x: jax.Array, w: jax.Array, mask: jax.Array, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(dy @ where(mask, w, 0).T, where(mask, x.T @ dy, 0))``."""
  return _ffi("jaxsparse_masked_backward", [x.shape, w.shape], x, w, mask, dy)


masked_backward.def_vmap(_map_all(masked_backward, 2))


@jax.custom_batching.custom_vmap
def csr_forward(x, data, col_offsets, transpose_order, transpose_row_indices):
  """``x (B, K) @ W`` -> ``(B, N)`` for W in the layout of :class:`jaxsparse.CSRMatrix`."""
  shape = (x.shape[0], col_offsets.shape[0] - 1)
  return _ffi("jaxsparse_csr_forward", shape, x, data, col_offsets, transpose_order, transpose_row_indices)


csr_forward.def_vmap(_fold_or_map(csr_forward, 1))


def csr_few_rows_forward(x, data, row_offsets, col_indices, n: int) -> jax.Array:
  """``x (B, K) @ W`` -> ``(B, N)`` for ``B <= 8`` rows, from a :class:`jaxsparse.CSRMatrix`'s row-major arrays."""
  return _csr_few_rows_forward(n)(x, data, row_offsets, col_indices)


@functools.cache
def _csr_few_rows_forward(n: int):
  @jax.custom_batching.custom_vmap
  def call(x, data, row_offsets, col_indices):
    return _ffi("jaxsparse_csr_few_rows_forward", (x.shape[0], n), x, data, row_offsets, col_indices)

  call.def_vmap(_fold_or_map(call, 1, max_rows=FEW_ROWS))
  return call


@jax.custom_batching.custom_vmap
def csr_backward(x, data, row_offsets, col_indices, dy):
  """``(dy @ W.T, (x.T @ dy)`` at the nonzeros ``)`` for W in the layout of :class:`jaxsparse.CSRMatrix`."""
  return _ffi("jaxsparse_csr_backward", [x.shape, data.shape], x, data, row_offsets, col_indices, dy)


csr_backward.def_vmap(_map_all(csr_backward, 2))


def csr_to_dense(data, row_offsets, col_indices, n: int) -> jax.Array:
  """The ``(K, N)`` dense matrix of a :class:`jaxsparse.CSRMatrix`'s entries (``K = len(row_offsets) - 1``)."""
  return _ffi("jaxsparse_csr_to_dense", (row_offsets.shape[0] - 1, n), data, row_offsets, col_indices)


def csr_take(w, row_offsets, col_indices) -> jax.Array:
  """``(nnz,)``: the dense ``w (K, N)`` at the entries of a :class:`jaxsparse.CSRMatrix`'s pattern."""
  return _ffi("jaxsparse_csr_take", col_indices.shape, w, row_offsets, col_indices)


@jax.custom_batching.custom_vmap
def block_forward(x, data, row_indices, col_offsets, transpose_order, col_indices, row_offsets):
  """``x (B, K) @ W`` -> ``(B, N)`` for W in the layout of :class:`jaxsparse.BlockSparseMatrix` (``col_indices`` and
  ``row_offsets``: checked against the column order and ``row_indices``, which the product reads)."""
  n = (col_offsets.shape[0] - 1) * data.shape[2]
  return _ffi("jaxsparse_block_forward", (x.shape[0], n), x, data, row_indices, col_offsets, transpose_order,
              col_indices, row_offsets)


block_forward.def_vmap(_fold_or_map(block_forward, 1))


@jax.custom_batching.custom_vmap
def block_backward(x, data, row_offsets, col_indices, row_indices, dy):
  """``(dy @ W.T, x.T @ dy`` on the kept blocks ``)`` for W in the layout of :class:`jaxsparse.BlockSparseMatrix`
  (``row_indices``: checked against ``row_offsets``, which the products read)."""
  return _ffi("jaxsparse_block_backward", [x.shape, data.shape], x, data, row_offsets, col_indices, row_indices, dy)


block_backward.def_vmap(_map_all(block_backward, 2))
