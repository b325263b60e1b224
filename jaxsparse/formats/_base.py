"""Pytree plumbing and pattern indexing shared by the index-array formats (``BlockSparseMatrix``, ``CSRMatrix``)."""

from __future__ import annotations

from typing import Any
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["IndexedSparseMatrix", "check_pattern_mask", "is_concrete", "mask_pattern_indices"]


def is_concrete(x: Any) -> bool:
  """True when ``x`` holds values (NumPy, a committed JAX array), False for a tracer or ``ShapeDtypeStruct``."""
  return not isinstance(x, jax.core.Tracer | jax.ShapeDtypeStruct)


def check_pattern_mask(mask: Any, *, name: str, layout: str) -> np.ndarray | jax.Array:
  """``mask`` as a NumPy array when concrete, else as the traced array, after checking it is a 2-D bool array.

  ``layout`` names the axes in the error message, e.g. ``"(K // bk, N // bn)"``.
  """
  mask = np.asarray(mask) if is_concrete(mask) else mask
  if mask.ndim != 2:
    raise ValueError(f"{name} must be 2-D {layout}, got shape {mask.shape}.")
  if mask.dtype != np.bool_:
    raise TypeError(
        f"{name} must be a boolean array, got dtype {mask.dtype}; convert 0/1 masks with `.astype(bool)`."
    )
  return mask


def mask_pattern_indices(mask: Any, nnz: int | None, *, name: str) -> dict[str, Any]:
  """Row-major coordinates and CSR/CSC offsets of the True entries of a 2-D bool ``mask``.

  A concrete mask is indexed on the host with NumPy. A traced mask (under ``jit``, ``nnx.eval_shape``
  or a Linen ``init`` in ``jit``) is indexed with ``jnp`` and needs the static count ``nnz`` of its True
  entries, since array shapes must be known when tracing; both paths give identical arrays.

  Returns:
    int32 arrays ``row_indices``, ``col_indices`` (``(nnz,)``, row-major order), ``row_offsets``
    (``(rows + 1,)``), ``col_offsets`` (``(cols + 1,)``) and ``transpose_order`` (``(nnz,)``: positions
    in row-major order listed in column-major order).
  """
  if is_concrete(mask):
    m = np.asarray(mask)
    if nnz is not None and int(m.sum()) != nnz:
      raise ValueError(f"{name} keeps {int(m.sum())} entries but nnz={nnz} was given; they must agree.")
    xp, (rows, cols) = np, np.nonzero(m)
  else:
    if nnz is None:
      raise ValueError(
          f"{name} is traced (built under jit or eval_shape), so the number of entries it keeps is not known "
          "while shapes are fixed: pass its count as a static int (nnz= / nnz_blocks=), or pass a concrete mask."
      )
    m = mask
    xp, (rows, cols) = jnp, jnp.nonzero(mask, size=nnz)
  i32 = xp.int32
  return {
      "row_indices": rows.astype(i32),
      "col_indices": cols.astype(i32),
      "row_offsets": xp.concatenate([xp.zeros(1, i32), xp.cumsum(m.sum(axis=1)).astype(i32)]),
      "col_offsets": xp.concatenate([xp.zeros(1, i32), xp.cumsum(m.sum(axis=0)).astype(i32)]),
      # Row-major entries sorted stably by column: rows stay ascending within a column.
      "transpose_order": (np.argsort(cols, kind="stable") if xp is np else jnp.argsort(cols, stable=True)).astype(i32),
  }


class IndexedSparseMatrix:
  """A sparse matrix held as ``data`` plus integer index arrays (children) and static int tuples (aux).

  Subclasses name their index arrays in ``INDEX_FIELDS`` and their static metadata (tuples of ints,
  e.g. ``shape``) in ``STATIC_FIELDS``, and register themselves as pytree node classes.
  """

  INDEX_FIELDS: ClassVar[tuple[str, ...]] = ()
  STATIC_FIELDS: ClassVar[tuple[str, ...]] = ("shape",)

  def __init__(self, data: jax.Array, **fields: Any):
    """Assembles a matrix from its parts; use the ``from_*`` constructors instead."""
    expected = set(self.INDEX_FIELDS) | set(self.STATIC_FIELDS)
    if set(fields) != expected:
      raise TypeError(f"{type(self).__name__} takes data and exactly {sorted(expected)}, got {sorted(fields)}.")
    self.data = data
    for f in self.INDEX_FIELDS:
      setattr(self, f, fields[f])
    for f in self.STATIC_FIELDS:
      setattr(self, f, tuple(int(v) for v in fields[f]))

  def tree_flatten(self):
    children = (self.data, *(getattr(self, f) for f in self.INDEX_FIELDS))
    return children, tuple(getattr(self, f) for f in self.STATIC_FIELDS)

  @classmethod
  def tree_unflatten(cls, aux, children):
    obj = object.__new__(cls)
    obj.data = children[0]
    for f, c in zip(cls.INDEX_FIELDS, children[1:], strict=True):
      setattr(obj, f, c)
    for f, a in zip(cls.STATIC_FIELDS, aux, strict=True):
      setattr(obj, f, a)
    return obj

  @classmethod
  def from_index_arrays(cls, data: jax.typing.ArrayLike, index_arrays: dict[str, jax.Array], **static: Any):
    """Reassembles a matrix from ``data`` and the dict returned by :meth:`index_arrays`.

    Layers keep the index arrays as non-trainable state and rebuild the matrix on each call with
    this; nothing is recomputed. ``static`` gives the subclass's ``STATIC_FIELDS`` (``shape=...``).
    """
    missing = set(cls.INDEX_FIELDS) - set(index_arrays)
    if missing:
      raise ValueError(f"index_arrays is missing {sorted(missing)}; expected the keys {cls.INDEX_FIELDS}.")
    return cls(jnp.asarray(data), **{f: jnp.asarray(index_arrays[f]) for f in cls.INDEX_FIELDS}, **static)

  def index_arrays(self) -> dict[str, jax.Array]:
    """The integer index arrays of the pattern, keyed by ``INDEX_FIELDS`` names."""
    return {f: getattr(self, f) for f in self.INDEX_FIELDS}

  def _scatter(self, grid: tuple[int, int], values: jax.Array) -> jax.Array:
    """``(*grid, *values.shape[1:])`` zeros with ``values[i]`` at ``(row_indices[i], col_indices[i])``."""
    out = jnp.zeros((*grid, *values.shape[1:]), values.dtype)
    return out.at[self.row_indices, self.col_indices].set(values)

  def _with_checked_data(self, data: jax.Array):
    return type(self)(data, **self.index_arrays(), **{f: getattr(self, f) for f in self.STATIC_FIELDS})

  @property
  def dtype(self):
    return self.data.dtype
