"""``CSRMatrix``: an unstructured sparse ``(K, N)`` matrix that stores only its nonzeros, as a pytree.

The layout mirrors :class:`jaxsparse.BlockSparseMatrix` with ``1 x 1`` blocks: values in row-major
order (CSR) plus the index arrays that the forward product ``x @ W`` (by column), the transposed
product ``dY @ Wᵀ`` and the sampled gradient ``xᵀ dY`` (by row) need. They are computed once when the
matrix is built (on the host for a concrete mask, with ``jnp`` under ``jit``) and travel with it as
pytree leaves; the shape is static aux data.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import _utils
from jaxsparse.formats._base import IndexedSparseMatrix
from jaxsparse.formats._base import check_pattern_mask
from jaxsparse.formats._base import is_concrete
from jaxsparse.formats._base import mask_pattern_indices
from jaxsparse.formats._base import poison_miscounted
from jaxsparse.formats._base import trusted

__all__ = ["INDEX_FIELDS", "CSRMatrix", "csr_pattern_indices"]

INDEX_FIELDS = (
    "row_indices",
    "col_indices",
    "row_offsets",
    "col_offsets",
    "transpose_order",
    "transpose_row_indices",
)


def csr_pattern_indices(mask: Any, *, nnz: int | None = None) -> dict[str, Any]:
  """Index arrays for a boolean ``(K, N)`` mask; entries are numbered in row-major order.

  A concrete mask is indexed on the host (NumPy arrays); a traced one (under ``jit`` or
  ``nnx.eval_shape``) with ``jnp``, which needs the static count ``nnz`` of its True entries. Both give
  the same arrays.

  Returns:
    A dict of int32 arrays:
      ``row_indices``, ``col_indices``: ``(nnz,)`` row and column of each stored value.
      ``row_offsets``: ``(K + 1,)`` CSR offsets: row ``i`` holds entries
        ``row_offsets[i]:row_offsets[i + 1]``.
      ``col_offsets``: ``(N + 1,)`` offsets into ``transpose_order`` per column.
      ``transpose_order``: ``(nnz,)`` positions in the values listed in column-major order.
      ``transpose_row_indices``: ``(nnz,)`` the row of each entry in column-major order, i.e.
        ``row_indices[transpose_order]`` (the forward product reads it sequentially).
  """
  m = check_pattern_mask(mask, name="mask", layout="(K, N)")
  if m.size >= 2**31:
    raise ValueError(f"mask has {m.size} entries; CSRMatrix indexes with int32 and holds fewer than 2**31.")
  if nnz is not None:  # a static count: also a NumPy int or a concrete 0-d integer array, as nnz_blocks takes
    count = _utils._integral(nnz)
    if count is None or not 0 <= count <= m.size:
      raise ValueError(f"nnz must be an int in [0, {m.size}] (the entries the {m.shape} mask keeps), got nnz={nnz!r}.")
    nnz = count
  idx = mask_pattern_indices(m, nnz, name="mask")
  idx["transpose_row_indices"] = idx["row_indices"][idx["transpose_order"]]
  return idx


@jax.tree_util.register_pytree_node_class
class CSRMatrix(IndexedSparseMatrix):
  """An unstructured sparse ``(K, N)`` matrix holding only its nonzeros (CSR, plus the CSC order).

  Layout follows Flax kernels (``K`` in-features, ``N`` out-features); the product with ``x`` of
  shape ``(..., K)`` is ``x @ W`` of shape ``(..., N)`` (see :func:`jaxsparse.ops.sparse_matmul`).
  Memory is ``nnz`` values plus ``4 nnz + K + N + 2`` int32 indices.

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> w = jax.random.normal(jax.random.key(0), (64, 96))
  >>> ws = jaxsparse.CSRMatrix.from_dense(w, mask=jaxsparse.magnitude_mask(w, sparsity=0.9))
  >>> ws.shape, ws.nnz, ws.data.shape
  ((64, 96), 614, (614,))
  >>> bool(jnp.all(ws.to_dense() == jnp.where(ws.mask, w, 0)))
  True

  Index arrays are validated when concrete (the constructors, ``from_index_arrays``). Under ``jit`` (index arrays
  traced) or after ``jax.tree_util.tree_unflatten`` / ``jax.tree.map`` (a restored checkpoint) no constructor checks
  them: :meth:`to_dense` does (and so the XLA route of :func:`jaxsparse.ops.sparse_matmul`), in O(nnz + rows + cols)
  compares and gathers, and gives all NaN (and NaN in the gradients) for index arrays :meth:`validate` would refuse (out
  of range, out of order, an entry twice, derived arrays that disagree). The C++ CPU kernels of
  :func:`jaxsparse.ops.sparse_matmul` raise on an index out of range, and those that read ``col_indices`` by rows (the
  backward, the forward of at most 8 rows, the dense route's conversions) on a row whose columns do not increase (an
  entry twice), but do not compare the derived arrays with the others (the check would make a decode-size product 4x
  slower, and took up to 1.6x the time of a forward of 9 to 256 rows even as a keyed hash of the arrays read in order):
  call :meth:`validate` on a restored matrix, or under ``jit`` inside ``checkify``, which names the bad field.

  Attributes:
    data: ``(nnz,)`` values in row-major order.
    row_indices, col_indices: ``(nnz,)`` int32 coordinates of each value.
    row_offsets: ``(K + 1,)`` int32 CSR offsets of each row into ``data``.
    col_offsets: ``(N + 1,)`` int32 offsets of each column into ``transpose_order``.
    transpose_order: ``(nnz,)`` int32 positions in ``data`` in column-major order.
    transpose_row_indices: ``(nnz,)`` int32 row of each entry in column-major order.
    shape: static ``(K, N)``.
  """

  INDEX_FIELDS = INDEX_FIELDS

  # -- construction ---------------------------------------------------------------------------------
  @classmethod
  def from_mask(cls, mask: Any, data: jax.typing.ArrayLike) -> CSRMatrix:
    """Builds a matrix from a bool ``(K, N)`` mask and its ``(nnz,)`` kept values in row-major order.

    The mask may be traced: ``nnz`` is then taken from ``data``'s static shape (and the values are all NaN if the
    mask keeps another count).

    Args:
      mask: bool ``(K, N)``, True at the entries to store.
      data: ``(nnz,)`` values of the kept entries in row-major order (any dtype), ``nnz = mask.sum()``.

    Returns:
      A ``CSRMatrix`` of shape ``(K, N)`` and ``data``'s dtype.

    Raises:
      ValueError: a mask that is not a 2-D bool array, or ``data`` not of shape ``(nnz,)``.

    >>> import jax.numpy as jnp, jaxsparse
    >>> ws = jaxsparse.CSRMatrix.from_mask(jnp.array([[True, False], [False, True]]), jnp.array([3.0, 4.0]))
    >>> ws.nnz, ws.to_dense()
    (2, Array([[3., 0.],
           [0., 4.]], dtype=float32))
    """
    data = _utils.as_array(data, name="data")
    m = check_pattern_mask(mask, name="mask", layout="(K, N)")
    if is_concrete(m) and (data.ndim != 1 or data.shape[0] != int(m.sum())):
      raise ValueError(f"data must have shape (nnz,) = ({int(m.sum())},) for this mask, got {data.shape}.")
    if data.ndim != 1:  # a traced mask's count is unknown: name the shape, not the count
      raise ValueError(f"data must have shape (nnz,) (1-D: the kept values in row-major order), got {data.shape}.")
    idx = csr_pattern_indices(m, nnz=data.shape[0])
    data = poison_miscounted(data, m, data.shape[0])
    return trusted(cls(data, validate=False, shape=m.shape, **{k: jnp.asarray(v) for k, v in idx.items()}))

  @classmethod
  def from_dense(cls, w: jax.typing.ArrayLike, mask: Any = None, *, nnz: int | None = None) -> CSRMatrix:
    """Keeps the entries of ``w`` that ``mask`` selects (or, without a mask, its nonzeros).

    Args:
      w: ``(K, N)`` dense matrix. May be traced when ``mask`` is given.
      mask: optional bool ``(K, N)``; ``None`` keeps the nonzero entries of ``w`` (which must then be
        concrete). A traced mask needs ``nnz``.
      nnz: the number of entries ``mask`` keeps, a static int; needed only when the mask is traced. A traced mask
        that keeps another count cannot raise under ``jit``: the values are then all NaN.

    Returns:
      A ``CSRMatrix`` of ``w``'s shape and dtype with ``to_dense() == where(mask, w, 0)``.

    Raises:
      ValueError: ``w`` not 2-D, a mask of another shape, a traced ``w`` without ``mask``, or a bad ``nnz``.

    >>> import jax.numpy as jnp, jaxsparse
    >>> ws = jaxsparse.CSRMatrix.from_dense(jnp.array([[0.0, 2.0], [5.0, 0.0]]))
    >>> ws.nnz, ws.data, ws.row_indices, ws.col_indices
    (2, Array([2., 5.], dtype=float32), Array([0, 1], dtype=int32), Array([1, 0], dtype=int32))
    """
    w = _utils.as_array(w, name="w")
    _utils.check_ndim(w.shape, 2, name="w")
    if mask is None:
      if not is_concrete(w):
        raise ValueError(
            "CSRMatrix.from_dense(w) without mask needs a concrete w to find its nonzeros; pass mask= when w is traced."
        )
      mask = np.asarray(w) != 0
    m = check_pattern_mask(mask, name="mask", layout="(K, N)")
    if m.shape != w.shape:
      raise ValueError(f"mask must have the shape of w {w.shape}, got {m.shape}.")
    idx = csr_pattern_indices(m, nnz=nnz)
    data = poison_miscounted(w[idx["row_indices"], idx["col_indices"]], m, nnz)
    return trusted(cls(data, validate=False, shape=w.shape, **{k: jnp.asarray(v) for k, v in idx.items()}))

  def with_data(self, data: jax.typing.ArrayLike) -> CSRMatrix:
    """The same pattern with new values.

    Args:
      data: ``(nnz,)`` new values in row-major order (any dtype).

    Returns:
      A ``CSRMatrix`` sharing the index arrays and ``shape`` with ``self``.

    Raises:
      ValueError: ``data`` of another shape.

    >>> import jax.numpy as jnp, jaxsparse
    >>> ws = jaxsparse.CSRMatrix.from_dense(jnp.array([[0.0, 2.0], [5.0, 0.0]]))
    >>> ws.with_data(jnp.array([1.0, 1.0])).to_dense()
    Array([[0., 1.],
           [1., 0.]], dtype=float32)
    """
    data = _utils.as_array(data, name="data")
    if data.shape != (self.nnz,):
      raise ValueError(f"data must have shape (nnz,) = ({self.nnz},), got {data.shape}.")
    return self._with_checked_data(data)

  # -- properties -----------------------------------------------------------------------------------
  @property
  def grid_shape(self) -> tuple[int, int]:
    """``(K, N)``: the grid the indices address, the shape itself."""
    return self.shape

  def _data_shape(self, nnz: int) -> tuple[int, ...]:
    return (nnz,)

  @property
  def nnz(self) -> int:
    """Number of stored values."""
    return int(self.data.shape[0])

  @property
  def density(self) -> float:
    """Fraction of entries stored."""
    return self.nnz / max(self.shape[0] * self.shape[1], 1)

  @property
  def mask(self) -> jax.Array:
    """Bool ``(K, N)``, True where a value is stored."""
    return self._scatter(self.shape, jnp.ones(self.row_indices.shape, bool))

  def to_dense(self) -> jax.Array:
    """The dense ``(K, N)`` matrix, zeros elsewhere (for tests, export and the XLA fallback).

    Returns:
      Array of :attr:`shape` and the dtype of :attr:`data`; all NaN (float ``data``) when the index arrays are
      invalid, as only a matrix built under ``jit`` or rebuilt without the constructor can be (see the class
      docstring).

    >>> import jax.numpy as jnp, jaxsparse
    >>> w = jnp.array([[0.0, 2.0], [5.0, 0.0]])
    >>> bool((jaxsparse.CSRMatrix.from_dense(w).to_dense() == w).all())
    True
    """
    return self._nan_unless_valid(self._scatter(self.shape, self.data))  # a scatter drops bad indices

  def __repr__(self) -> str:
    return f"CSRMatrix(shape={self.shape}, nnz={self.nnz}, density={self.density:.3f}, dtype={self.data.dtype})"
