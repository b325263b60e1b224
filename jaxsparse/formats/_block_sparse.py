"""Sparse weight formats, as JAX pytrees.

``BlockSparseMatrix`` is a ``(K, N)`` matrix in Flax kernel layout (``y = x @ W``, in-features first)
that stores only its kept ``(bk, bn)`` blocks. The integer block indices every product needs (forward
``x @ W``, transposed ``dY @ Wᵀ`` and the sampled gradient ``xᵀ dY``) are computed once when the matrix
is built (on the host for a concrete mask, with ``jnp`` under ``jit`` / ``nnx.eval_shape``) and travel
with it as pytree leaves; the shapes are static aux data.
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
from jaxsparse.formats._base import trusted_like
from jaxsparse.formats._masks import replicated

__all__ = ["INDEX_FIELDS", "BlockSparseMatrix", "block_pattern_indices", "block_slots", "merge_block_data",
           "split_blocks"]


def block_pattern_indices(block_mask: Any, *, nnz_blocks: int | None = None) -> dict[str, Any]:
  """Index arrays for a boolean block mask of shape ``(K // bk, N // bn)``.

  Blocks are numbered in row-major order (by block row, then block column); that is the order of
  ``BlockSparseMatrix.data``. A concrete mask is indexed on the host (NumPy arrays); a traced one
  (under ``jit`` or ``nnx.eval_shape``) with ``jnp``, which needs the static ``nnz_blocks`` it keeps.
  Both give the same arrays.

  >>> import numpy as np
  >>> from jaxsparse.formats._block_sparse import block_pattern_indices
  >>> idx = block_pattern_indices(np.array([[True, False], [True, True]]))
  >>> idx["row_indices"].tolist(), idx["col_indices"].tolist(), idx["transpose_order"].tolist()
  ([0, 1, 1], [0, 0, 1], [0, 1, 2])

  Returns:
    A dict of int32 arrays:
      ``row_indices``, ``col_indices``: ``(nnz,)`` block row / column of each stored block.
      ``row_offsets``: ``(K // bk + 1,)`` CSR offsets: the blocks of block row ``i`` are
        ``row_offsets[i]:row_offsets[i + 1]``.
      ``col_offsets``: ``(N // bn + 1,)`` offsets into ``transpose_order`` per block column.
      ``transpose_order``: ``(nnz,)`` positions in ``data`` listed in column-major order (by block
        column, then block row): the layout of the transposed product ``dY @ Wᵀ``.
  """
  mask = check_pattern_mask(block_mask, name="block_mask", layout="(K // bk, N // bn)")
  nnz_blocks = None if nnz_blocks is None else _check_block_count(nnz_blocks, mask.shape)
  return mask_pattern_indices(mask, nnz_blocks, name="block_mask", count_name="nnz_blocks")


def _check_block_count(nnz_blocks: Any, grid: tuple[int, int]) -> int:
  """``nnz_blocks`` as an int in ``[0, blocks of grid]``: a static count, checked here, since under ``jit`` a wrong
  one would otherwise fail in ``jnp`` without its name, or give all-NaN values."""
  n, total = _utils._integral(nnz_blocks), grid[0] * grid[1]
  if n is None or not 0 <= n <= total:
    raise ValueError(f"nnz_blocks must be an int in [0, {total}] (the blocks of the {grid[0]} x {grid[1]} block "
                     f"grid), got nnz_blocks={nnz_blocks!r}.")
  return n


INDEX_FIELDS = ("row_indices", "col_indices", "row_offsets", "col_offsets", "transpose_order")


@jax.tree_util.register_pytree_node_class
class BlockSparseMatrix(IndexedSparseMatrix):
  """A block-sparse ``(K, N)`` matrix holding only its kept ``(bk, bn)`` blocks.

  Layout follows Flax kernels: ``K`` is in-features, ``N`` out-features, and the product with
  ``x`` of shape ``(..., K)`` is ``x @ W`` of shape ``(..., N)``
  (see :func:`jaxsparse.ops.block_sparse_matmul`).

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> w = jax.random.normal(jax.random.key(0), (64, 96))
  >>> mask = jaxsparse.block_magnitude_mask(w, (32, 32), density=0.5)
  >>> ws = jaxsparse.BlockSparseMatrix.from_dense(w, (32, 32), block_mask=mask)
  >>> ws.shape, ws.block_shape, ws.nnz_blocks, ws.data.shape
  ((64, 96), (32, 32), 3, (3, 32, 32))
  >>> bool(jnp.all(ws.to_dense() == jnp.where(jnp.repeat(jnp.repeat(mask, 32, 0), 32, 1), w, 0)))
  True

  Index arrays are validated when concrete (the constructors, ``from_index_arrays``). Under ``jit`` (index arrays
  traced) or after ``jax.tree_util.tree_unflatten`` / ``jax.tree.map`` (a restored checkpoint) no constructor
  checks them: :meth:`to_dense` does, in O(nnz + rows + cols) compares and gathers, and gives all NaN (and NaN in
  the gradients) for index arrays :meth:`validate` would refuse (out of range, out of order, an entry twice, derived
  arrays that disagree). :func:`jaxsparse.ops.block_sparse_matmul` checks them on the CPU: its C++ kernels raise
  (an index out of range, or arrays that disagree: one pass over the kept blocks) and its XLA routes there (the dense
  route, the block loop) give all-NaN results, as :meth:`to_dense`. Its GPU routes read such arrays as they are (the
  check's small XLA kernels would cost a decode-size product as much again). Call
  :meth:`validate` on a restored matrix, or under ``jit`` inside ``checkify``, which names the bad field.

  Attributes:
    data: ``(nnz_blocks, bk, bn)`` values of the kept blocks in row-major block order.
    row_indices, col_indices: ``(nnz_blocks,)`` int32 block coordinates of each stored block.
    row_offsets: ``(K // bk + 1,)`` int32 CSR offsets of each block row into ``data``.
    col_offsets: ``(N // bn + 1,)`` int32 offsets of each block column into ``transpose_order``.
    transpose_order: ``(nnz_blocks,)`` int32 positions in ``data`` in column-major block order.
    shape: static ``(K, N)``.
    block_shape: static ``(bk, bn)``.
  """

  INDEX_FIELDS = INDEX_FIELDS
  STATIC_FIELDS = ("shape", "block_shape")

  # -- construction ---------------------------------------------------------------------------------
  @classmethod
  def from_block_mask(
      cls,
      block_mask: Any,
      data: jax.typing.ArrayLike,
      *,
      shape: tuple[int, int] | None = None,
  ) -> BlockSparseMatrix:
    """Builds a matrix from a block mask and the values of its kept blocks.

    >>> import numpy as np, jax.numpy as jnp, jaxsparse
    >>> mask = np.array([[True, False], [False, True]])
    >>> ws = jaxsparse.BlockSparseMatrix.from_block_mask(mask, jnp.arange(12.0).reshape(2, 2, 3))
    >>> ws.shape, ws.block_shape, ws.nnz_blocks
    ((4, 6), (2, 3), 2)
    >>> ws.to_dense()[2:, 3:].tolist()
    [[6.0, 7.0, 8.0], [9.0, 10.0, 11.0]]

    Args:
      block_mask: bool ``(K // bk, N // bn)``; concrete, or traced (the block count is then taken
        from ``data``'s static shape; the values are all NaN if the mask keeps another count).
      data: ``(nnz_blocks, bk, bn)``, the kept blocks in row-major block order; any dtype, kept as is.
      shape: optional ``(K, N)``; checked against ``block_mask.shape * block_shape`` if given.

    Returns:
      A ``BlockSparseMatrix`` of shape ``(K // bk * bk, N // bn * bn)`` and block shape ``(bk, bn)`` whose
      ``data`` is ``data`` (its ``dtype`` is ``data.dtype``).

    Raises:
      ValueError: ``data`` is not 3-D with ``bk, bn >= 1``; ``block_mask`` is not 2-D; a concrete
        ``block_mask`` keeps another number of blocks than ``data`` holds (a traced one, more blocks than
        it has); ``shape`` does not match the block grid times ``(bk, bn)``.
      TypeError: ``block_mask`` is not a boolean array.
    """
    data = _utils.as_array(data, name="data")
    if data.ndim != 3 or min(data.shape[1:]) < 1:
      raise ValueError(f"data must be 3-D (nnz_blocks, bk, bn) with bk, bn >= 1, got shape {data.shape}.")
    mask = check_pattern_mask(block_mask, name="block_mask", layout="(K // bk, N // bn)")
    nnz = data.shape[0]
    if is_concrete(mask) and int(mask.sum()) != nnz:
      raise ValueError(f"data holds {nnz} blocks but block_mask keeps {int(mask.sum())}.")
    if nnz > mask.size:  # a traced mask: its count is unknown, but it cannot keep more blocks than it has
      raise ValueError(f"data holds {nnz} blocks but block_mask {tuple(mask.shape)} has only {mask.size}.")
    idx = block_pattern_indices(mask, nnz_blocks=nnz)
    kb, nb = mask.shape
    full = (kb * data.shape[1], nb * data.shape[2])
    if shape is not None and tuple(shape) != full:
      raise ValueError(f"shape={tuple(shape)} does not match block_mask {(kb, nb)} x blocks {data.shape[1:]}.")
    idx = {k: jnp.asarray(v) for k, v in idx.items()}
    return trusted(cls(poison_miscounted(data, mask, nnz), validate=False, shape=full, block_shape=data.shape[1:],
                       **idx))

  @classmethod
  def from_dense(
      cls,
      w: jax.typing.ArrayLike,
      block_shape: tuple[int, int],
      block_mask: Any = None,
      *,
      nnz_blocks: int | None = None,
  ) -> BlockSparseMatrix:
    """Keeps the blocks of ``w`` that ``block_mask`` selects (or, without a mask, its nonzero blocks).

    Args:
      w: ``(K, N)`` dense matrix. May be traced when ``block_mask`` is given.
      block_shape: ``(bk, bn)`` dividing ``(K, N)``.
      block_mask: optional bool ``(K // bk, N // bn)``; ``None`` keeps every block of ``w`` that has a
        nonzero entry (``w`` must then be concrete). A traced mask needs ``nnz_blocks``.
      nnz_blocks: the number of blocks ``block_mask`` keeps, a static int in ``[0, blocks]``; needed only when the mask
        is traced (e.g. ``block_magnitude_mask(w, ...)`` of a traced ``w`` keeps
        ``round(density * blocks)``). A traced mask that keeps another count cannot raise under ``jit``: the
        values are then all NaN.

    Returns:
      A ``BlockSparseMatrix`` of ``w``'s shape and dtype with ``to_dense() == w * expanded(block_mask)``.

    Raises:
      ValueError: ``w`` is not 2-D; ``block_shape`` is not positive or does not divide ``w.shape``;
        ``block_mask`` is not 2-D or not of shape ``(K // bk, N // bn)``; ``block_mask`` is ``None`` and
        ``w`` is traced; ``nnz_blocks`` is not an int in ``[0, blocks]``, or disagrees with the count a
        concrete ``block_mask`` keeps; ``block_mask`` is traced and ``nnz_blocks`` is ``None``.
      TypeError: ``block_shape`` is not a pair of ints; ``block_mask`` is not a boolean array.

    >>> import jax.numpy as jnp, jaxsparse
    >>> w = jnp.zeros((4, 6)).at[0, 0].set(1.0).at[3, 5].set(2.0)
    >>> ws = jaxsparse.BlockSparseMatrix.from_dense(w, (2, 3))  # keeps the blocks holding a nonzero
    >>> ws.nnz_blocks, ws.block_mask.tolist()
    (2, [[True, False], [False, True]])
    >>> bool((ws.to_dense() == w).all())
    True
    """
    w = _utils.as_array(w, name="w")
    _utils.check_ndim(w.shape, 2, name="w")
    bk, bn = _utils.check_block_shape(block_shape, w.shape)
    kb, nb = w.shape[0] // bk, w.shape[1] // bn
    if block_mask is None:
      if not is_concrete(w):
        raise ValueError(
            "from_dense(w, block_shape) without block_mask needs a concrete w to find its nonzero "
            "blocks; pass block_mask= when w is traced."
        )
      block_mask = np.any(np.asarray(w).reshape(kb, bk, nb, bn) != 0, axis=(1, 3))
    mask = check_pattern_mask(block_mask, name="block_mask", layout="(K // bk, N // bn)")
    if mask.shape != (kb, nb):
      raise ValueError(
          f"block_mask must have shape (K // bk, N // bn) = {(kb, nb)} for w {w.shape} and "
          f"block_shape {(bk, bn)}, got {mask.shape}."
      )
    nnz_blocks = None if nnz_blocks is None else _check_block_count(nnz_blocks, (kb, nb))
    idx = block_pattern_indices(mask, nnz_blocks=nnz_blocks)
    blocks = replicated(w).reshape(kb, bk, nb, bn).transpose(0, 2, 1, 3)  # explicit axes refuse a split reshape
    data = poison_miscounted(blocks[idx["row_indices"], idx["col_indices"]], mask, nnz_blocks)
    idx = {k: jnp.asarray(v) for k, v in idx.items()}
    return trusted(cls(data, validate=False, shape=w.shape, block_shape=(bk, bn), **idx))

  def with_data(self, data: jax.typing.ArrayLike) -> BlockSparseMatrix:
    """The same pattern with new block values.

    >>> import jax.numpy as jnp, jaxsparse
    >>> ws = jaxsparse.BlockSparseMatrix.from_dense(jnp.eye(4), (2, 2))
    >>> w2 = ws.with_data(3 * ws.data)
    >>> w2.block_mask.tolist(), w2.to_dense().diagonal().tolist()
    ([[True, False], [False, True]], [3.0, 3.0, 3.0, 3.0])

    Args:
      data: ``(nnz_blocks, bk, bn)`` values, in the row-major block order of ``self.data``; any dtype, kept
        as is (so ``with_data`` also casts a matrix: ``w.with_data(w.data.astype(jnp.bfloat16))``).

    Returns:
      A ``BlockSparseMatrix`` with this matrix's shape, block shape and index arrays and ``data`` as values.

    Raises:
      ValueError: ``data`` does not have shape ``(nnz_blocks, bk, bn)``.
    """
    data = _utils.as_array(data, name="data")
    expected = (self.nnz_blocks, *self.block_shape)
    if data.shape != expected:
      raise ValueError(f"data must have shape (nnz_blocks, bk, bn) = {expected}, got {data.shape}.")
    return self._with_checked_data(data)

  # -- properties -----------------------------------------------------------------------------------
  @property
  def nnz_blocks(self) -> int:
    """The number of stored ``(bk, bn)`` blocks: ``data.shape[0]``, a static int (also under ``jit``)."""
    return int(self.data.shape[0])

  @property
  def grid_shape(self) -> tuple[int, int]:
    """``(K // bk, N // bn)``: the shape of :attr:`block_mask`."""
    return self.shape[0] // self.block_shape[0], self.shape[1] // self.block_shape[1]

  def _data_shape(self, nnz: int) -> tuple[int, ...]:
    bk, bn = self.block_shape
    if bk <= 0 or bn <= 0 or self.shape[0] % bk or self.shape[1] % bn:
      raise ValueError(f"BlockSparseMatrix.block_shape={self.block_shape} must divide shape={self.shape}.")
    return (nnz, bk, bn)

  @property
  def density(self) -> float:
    """Fraction of blocks kept; ``0.0`` for a matrix with no block (``K`` or ``N`` zero)."""
    kb, nb = self.grid_shape
    return self.nnz_blocks / (kb * nb) if kb * nb else 0.0

  @property
  def block_mask(self) -> jax.Array:
    """Bool ``(K // bk, N // bn)``, True where a block is stored."""
    return self._scatter(self.grid_shape, jnp.ones(self.row_indices.shape, bool))

  def to_dense(self) -> jax.Array:
    """The dense matrix, zeros outside the kept blocks (for tests and export, not hot paths).

    Returns:
      A ``(K, N)`` array of ``data``'s dtype; all NaN (float ``data``) when the index arrays are invalid, as only a
      matrix built under ``jit`` or rebuilt without the constructor can be (see the class docstring).
    """
    self._check_static()
    dense = self._scatter(self.grid_shape, self.data).transpose(0, 2, 1, 3).reshape(self.shape)
    return self._nan_unless_valid(dense)  # a scatter drops (or wraps) bad indices: no silent zeros

  def __repr__(self) -> str:
    return (
        f"BlockSparseMatrix(shape={self.shape}, block_shape={self.block_shape}, "
        f"nnz_blocks={self.nnz_blocks}, density={self.density:.3f}, dtype={self.data.dtype})"
    )


def block_slots(w: BlockSparseMatrix) -> jax.Array:
  """``(kb, nb)`` int32: the position in ``w.data`` of the block kept at each place of the grid, ``-1`` where none is
  (the kernels' schedules and the dense route's weight build read it)."""
  where = jnp.arange(w.nnz_blocks, dtype=jnp.int32)
  return jnp.full(w.grid_shape, -1, jnp.int32).at[w.row_indices, w.col_indices].set(where)


def _sub_indices(r: int, c: int) -> tuple[jax.Array, jax.Array]:
  """Sub-block row ``a`` and column ``b`` within a block, broadcastable against ``(nnz, 1, 1)``."""
  return jnp.arange(r, dtype=jnp.int32)[None, :, None], jnp.arange(c, dtype=jnp.int32)[None, None, :]


def _split_positions(w: BlockSparseMatrix, r: int, c: int) -> jax.Array:
  """Row-major position of sub-block ``(t, a, b)`` (flattened ``(nnz, r, c)``) among ``r x c`` sub-blocks.

  Sub-row ``rows[t] * r + a`` holds, in order, sub-blocks ``b`` of the kept blocks of block row ``rows[t]``.
  """
  start = w.row_offsets.astype(jnp.int32)
  rows = w.row_indices.astype(jnp.int32)
  rs, rn = start[rows][:, None, None], jnp.diff(start)[rows][:, None, None]
  t = jnp.arange(w.nnz_blocks, dtype=jnp.int32)[:, None, None]
  a, b = _sub_indices(r, c)
  return (rs * r * c + a * rn * c + (t - rs) * c + b).reshape(-1)


def split_blocks(w: BlockSparseMatrix, block_shape: tuple[int, int]) -> BlockSparseMatrix:
  """``w`` with each kept block cut into ``block_shape`` sub-blocks: the same matrix, finer blocks.

  Exact (``split_blocks(w, b).to_dense() == w.to_dense()``) and traceable: the sub-blocks' index arrays are
  closed-form functions of ``w``'s (a few elementwise passes over ``nnz_blocks * r * c`` entries, no sort), and
  the values are one gather of ``w.data``. The kernels run blocks they do not support natively (``256 x 128``)
  as their supported sub-blocks (``128 x 128``); :func:`merge_block_data` maps sub-block values back.

  >>> import jax, jaxsparse
  >>> from jaxsparse.formats._block_sparse import split_blocks
  >>> w = jaxsparse.BlockSparseMatrix.from_dense(jax.random.normal(jax.random.key(0), (8, 8)), (4, 8))
  >>> s = split_blocks(w, (2, 4))
  >>> s.block_shape, s.nnz_blocks, bool((s.to_dense() == w.to_dense()).all())
  ((2, 4), 8, True)

  Args:
    w: a ``(K, N)`` block-sparse matrix with ``(bk, bn)`` blocks.
    block_shape: ``(sbk, sbn)`` dividing ``(bk, bn)``.

  Returns:
    A ``BlockSparseMatrix`` of ``(sbk, sbn)`` blocks, ``nnz_blocks * (bk // sbk) * (bn // sbn)`` of them.
  """
  (bk, bn), (sbk, sbn) = w.block_shape, tuple(int(v) for v in block_shape)
  if sbk < 1 or sbn < 1 or bk % sbk or bn % sbn:
    raise ValueError(f"block_shape={block_shape} must divide the matrix's block shape {w.block_shape}.")
  if (sbk, sbn) == (bk, bn):
    return w
  r, c = bk // sbk, bn // sbn
  i32 = jnp.int32
  rows, cols = w.row_indices.astype(i32), w.col_indices.astype(i32)
  col_start = w.col_offsets.astype(i32)
  row_count, col_count = jnp.diff(w.row_offsets.astype(i32)), jnp.diff(col_start)
  t = jnp.arange(w.nnz_blocks, dtype=i32)
  a, b = _sub_indices(r, c)
  new_pos = _split_positions(w, r, c)
  # Column-major position: sub-column cols[t] * c + b holds sub-rows a of the kept blocks of block column
  # cols[t], those blocks in w's column-major order (rank s of t in transpose_order).
  rank = jnp.zeros(w.nnz_blocks, i32).at[w.transpose_order].set(t)
  cs, cn = col_start[cols][:, None, None], col_count[cols][:, None, None]
  t_pos = (cs * r * c + b * cn * r + (rank[:, None, None] - cs) * r + a).reshape(-1)
  nnz = w.nnz_blocks * r * c
  sub = w.data.reshape(w.nnz_blocks, r, sbk, c, sbn).transpose(0, 1, 3, 2, 4).reshape(nnz, sbk, sbn)
  by_pos = jnp.zeros(nnz, i32).at[new_pos].set(jnp.arange(nnz, dtype=i32))  # sub-block (t, a, b) at each position
  sub_rows = jnp.broadcast_to(rows[:, None, None] * r + a, (w.nnz_blocks, r, c)).reshape(-1)
  sub_cols = jnp.broadcast_to(cols[:, None, None] * c + b, (w.nnz_blocks, r, c)).reshape(-1)
  row_offsets = jnp.concatenate([jnp.zeros(1, i32), jnp.cumsum(jnp.repeat(row_count * c, r))]).astype(i32)
  col_offsets = jnp.concatenate([jnp.zeros(1, i32), jnp.cumsum(jnp.repeat(col_count * r, c))]).astype(i32)
  return trusted_like(w, BlockSparseMatrix(  # derived from w: no validation (this runs in every call of the GPU route)
      sub[by_pos],
      validate=False,
      row_indices=sub_rows[by_pos],
      col_indices=sub_cols[by_pos],
      row_offsets=row_offsets,
      col_offsets=col_offsets,
      transpose_order=jnp.zeros(nnz, i32).at[t_pos].set(new_pos),
      shape=w.shape,
      block_shape=(sbk, sbn),
  ))


def merge_block_data(sub_data: jax.Array, w: BlockSparseMatrix, block_shape: tuple[int, int]) -> jax.Array:
  """The inverse of :func:`split_blocks` on values: ``(nnz * r * c, sbk, sbn)`` -> ``(nnz, bk, bn)`` of ``w``.

  ``merge_block_data(split_blocks(w, b).data, w, b) == w.data``; the weight gradient of the kernels' sub-block
  product comes back to ``w``'s blocks this way.
  """
  (bk, bn), (sbk, sbn) = w.block_shape, tuple(block_shape)
  if (sbk, sbn) == (bk, bn):
    return sub_data
  r, c = bk // sbk, bn // sbn
  blocks = sub_data[_split_positions(w, r, c)].reshape(w.nnz_blocks, r, c, sbk, sbn)
  return blocks.transpose(0, 1, 3, 2, 4).reshape(w.nnz_blocks, bk, bn)
