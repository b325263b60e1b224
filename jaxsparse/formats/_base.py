"""Pytree plumbing shared by the index-array formats (``BlockSparseMatrix``, ``CSRMatrix``)."""

from __future__ import annotations

from typing import Any
from typing import ClassVar

import jax
import jax.numpy as jnp

__all__ = ["IndexedSparseMatrix"]


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

  def _with_checked_data(self, data: jax.Array):
    return type(self)(data, **self.index_arrays(), **{f: getattr(self, f) for f in self.STATIC_FIELDS})

  @property
  def dtype(self):
    return self.data.dtype
