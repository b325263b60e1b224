"""Pytree plumbing and pattern indexing shared by the index-array formats (``BlockSparseMatrix``, ``CSRMatrix``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import _utils
from jaxsparse.formats._masks import replicated

__all__ = ["IndexedSparseMatrix", "check_pattern_mask", "is_concrete", "mask_pattern_indices", "nan_unless",
           "poison_miscounted", "trusted", "trusted_like"]


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


def mask_pattern_indices(mask: Any, nnz: int | None, *, name: str, count_name: str = "nnz") -> dict[str, Any]:
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
      raise ValueError(f"{name} keeps {int(m.sum())} entries but {count_name}={nnz} was given; they must agree.")
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


def poison_miscounted(data: jax.Array, mask: Any, nnz: int) -> jax.Array:
  """``data``, or all NaN when a traced ``mask`` keeps other than ``nnz`` entries.

  Under ``jit`` the count of a traced mask is not known when the static ``nnz`` fixes the shapes, so a wrong
  ``nnz`` cannot raise: the index arrays would silently drop (or repeat) entries. Its values are made NaN instead,
  so every product with the matrix is NaN rather than a plausible wrong number. A concrete mask was checked (and
  raised) already; integer data, which has no NaN, is returned as it is.
  """
  if is_concrete(mask) or not jnp.issubdtype(data.dtype, jnp.inexact):
    return data
  return jnp.where(jnp.sum(mask, dtype=jnp.int32) == nnz, data, jnp.nan)


def nan_unless(y: jax.Array, ok: jax.Array) -> jax.Array:
  """``y``, NaN where the bool ``ok`` (a scalar, or an array broadcasting against ``y``) is False (integer ``y``, which
  has no NaN, as it is).

  Multiplied in (``y * 1`` or ``y * NaN``), not selected: cotangents flowing back through it are NaN too, so the
  gradients of a product with an invalid matrix are NaN rather than zeros. XLA fuses it into ``y``'s consumer.
  """
  if not jnp.issubdtype(y.dtype, jnp.inexact):
    return y
  return y * jnp.where(ok, 1, jnp.nan).astype(y.dtype)


def trusted(matrix):
  """Marks ``matrix`` (an :class:`IndexedSparseMatrix`) as holding index arrays that
  :meth:`~IndexedSparseMatrix.validate` passed or that a constructor built from a mask (valid by construction, also
  traced): its ``to_dense`` then skips the check. The mark is not part of the pytree: ``tree_unflatten`` (a ``jit``
  argument, a checkpoint, a ``jax.tree.map``) gives an unmarked matrix, as does setting an index array."""
  object.__setattr__(matrix, "_trusted", True)
  return matrix


def trusted_like(source, matrix):
  """``matrix`` marked as :func:`trusted` where ``source`` is (index arrays derived from ``source``'s)."""
  return trusted(matrix) if getattr(source, "_trusted", False) else matrix


def _offsets_ok(offsets: jax.Array, keys: jax.Array, nnz: int) -> jax.Array:
  """Whether ``offsets`` (``(len + 1,)``) are the CSR offsets of ``keys`` (``(nnz,)``, nondecreasing, in range).

  The offsets must run from 0 to ``nnz`` without decreasing, and each nonempty run ``offsets[i]:offsets[i + 1]``
  start and end on key ``i``: as the keys are sorted and the runs cover every entry, that leaves one choice, the
  offsets that counting the keys gives. O(len) gathers, no pass over the entries.
  """
  start, end = offsets[:-1], offsets[1:]
  ok = (offsets[0] == 0) & (offsets[-1] == nnz) & jnp.all(end >= start)
  if nnz == 0:
    return ok
  i = jnp.arange(start.shape[0], dtype=jnp.int32)
  first, last = keys[jnp.clip(start, 0, nnz - 1)], keys[jnp.clip(end - 1, 0, nnz - 1)]
  return ok & jnp.all((end == start) | ((first == i) & (last == i)))


@jax.jit
def _indices_ok_traced(matrix: IndexedSparseMatrix) -> jax.Array:
  """The value checks of :meth:`IndexedSparseMatrix.validate` as one traced bool, in O(nnz + rows + cols).

  Without its sort: ``transpose_order`` is the stable argsort of ``col_indices`` exactly when it is in range and
  lists the entries by (column, position) strictly increasing, and offsets are checked by :func:`_offsets_ok`.
  """
  rows, cols = matrix.grid_shape
  r, c, o = (replicated(getattr(matrix, f)) for f in ("row_indices", "col_indices", "transpose_order"))
  nnz = r.shape[0]
  ok = jnp.all((r >= 0) & (r < rows) & (c >= 0) & (c < cols) & (o >= 0) & (o < nnz))
  oc = jnp.clip(o, 0, max(nnz - 1, 0))
  cc = c[oc]  # the column of each entry, in transpose order
  if nnz > 1:
    ok &= jnp.all((r[1:] > r[:-1]) | ((r[1:] == r[:-1]) & (c[1:] > c[:-1])))
    ok &= jnp.all((cc[1:] > cc[:-1]) | ((cc[1:] == cc[:-1]) & (o[1:] > o[:-1])))
  ok &= _offsets_ok(replicated(matrix.row_offsets), r, nnz) & _offsets_ok(replicated(matrix.col_offsets), cc, nnz)
  if "transpose_row_indices" in matrix.INDEX_FIELDS:
    ok &= jnp.all(replicated(matrix.transpose_row_indices) == r[oc])
  return ok


def _first_false(ok: np.ndarray) -> int:
  return int(np.flatnonzero(~ok)[0])


class IndexedSparseMatrix:
  """A sparse matrix held as ``data`` plus integer index arrays (children) and static int tuples (aux).

  Subclasses name their index arrays in ``INDEX_FIELDS`` and their static metadata (tuples of ints,
  e.g. ``shape``) in ``STATIC_FIELDS``, give the ``(rows, cols)`` the indices address as ``grid_shape``
  and the shape ``data`` must have in ``_data_shape``, and register themselves as pytree node classes.
  """

  INDEX_FIELDS: ClassVar[tuple[str, ...]] = ()
  STATIC_FIELDS: ClassVar[tuple[str, ...]] = ("shape",)

  def __init__(self, data: jax.Array, *, validate: bool = True, **fields: Any):
    """Assembles a matrix from its parts; use the ``from_*`` constructors instead.

    With ``validate=True`` (the default) the parts are checked by :meth:`validate` when the index arrays are
    concrete (also beside a traced ``data``); for traced index arrays only their shapes and dtypes are (the value
    checks need ``checkify``: call :meth:`validate`).
    """
    expected = set(self.INDEX_FIELDS) | set(self.STATIC_FIELDS)
    if set(fields) != expected:
      raise TypeError(f"{type(self).__name__} takes data and exactly {sorted(expected)}, got {sorted(fields)}.")
    self.data = data
    for f in self.INDEX_FIELDS:
      setattr(self, f, fields[f])
    for f in self.STATIC_FIELDS:  # (rows, cols) pairs: shape may hold zeros, block shapes may not
      value = _utils.check_dims(fields[f], name=f"{type(self).__name__}.{f}", ndim=2, minimum=0 if f == "shape" else 1)
      setattr(self, f, value)
    # The index arrays alone decide: concrete ones are checked even beside traced data (constants closed over in a
    # jit), which would otherwise reach the products unchecked; the check runs once, when the function is traced.
    if validate and all(is_concrete(getattr(self, f)) for f in self.INDEX_FIELDS):
      self.validate()
      trusted(self)
    elif validate:
      self._check_static()

  def __setattr__(self, name: str, value: Any) -> None:
    if name in self.INDEX_FIELDS:  # new index arrays: no longer the ones validate() or a constructor vouched for
      object.__setattr__(self, "_trusted", False)
    object.__setattr__(self, name, value)

  # -- validation -----------------------------------------------------------------------------------
  @property
  def grid_shape(self) -> tuple[int, int]:
    """``(rows, cols)`` of the grid the indices address."""
    raise NotImplementedError

  def _data_shape(self, nnz: int) -> tuple[int, ...]:
    raise NotImplementedError

  def _check_static(self) -> int:
    """Checks the shapes and dtypes of data and the index arrays (static, so also under ``jit``); returns nnz.

    The ops run it on every call: a matrix rebuilt with ``jax.tree_util.tree_unflatten`` (a restored checkpoint,
    ``tree_map``) skips the constructor, and a wrong-length or wrong-dtype index array would otherwise reach the
    kernels, whose errors cannot name the field.
    """
    name = type(self).__name__
    for f in self.STATIC_FIELDS:  # a matrix from tree_unflatten (hand-built aux data) skipped the constructor's check
      _utils.check_dims(getattr(self, f), name=f"{name}.{f}", ndim=2, minimum=0 if f == "shape" else 1)
    data = self.data
    if getattr(data, "ndim", 0) < 1:
      raise ValueError(f"{name}.data must be an array with a leading nnz axis, got {type(data).__name__}.")
    nnz = int(data.shape[0])
    if tuple(data.shape) != self._data_shape(nnz):
      stacked = (data.ndim == len(self._data_shape(nnz)) + 1
                 and " (one axis more than a matrix holds: a stack of matrices? jax.vmap the op over the stacked axis)")
      raise ValueError(f"{name}.data must have shape {self._data_shape(nnz)} for shape={self.shape}, got "
                       f"{tuple(data.shape)}{stacked or ''}.")
    rows, cols = self.grid_shape
    lengths = {"row_offsets": rows + 1, "col_offsets": cols + 1}
    # The per-entry index arrays agree with each other but not with data: data is the one to blame.
    per_entry = {tuple(getattr(getattr(self, f), "shape", ())) for f in self.INDEX_FIELDS if f not in lengths}
    if len(per_entry) == 1 and per_entry != {(nnz,)} and len(next(iter(per_entry))) == 1:
      raise ValueError(f"{name}.data holds {nnz} entries (shape {tuple(data.shape)}) but the index arrays have shape "
                       f"{per_entry.pop()}; data must hold one entry per stored index.")
    for f in self.INDEX_FIELDS:
      a = getattr(self, f)
      want = (lengths.get(f, nnz),)
      if tuple(getattr(a, "shape", ())) != want or np.dtype(getattr(a, "dtype", None)) != np.int32:
        raise ValueError(
            f"{name}.{f} must be an int32 array of shape {want} (nnz={nnz}, grid {self.grid_shape}), got "
            f"{getattr(a, 'dtype', type(a).__name__)} {tuple(getattr(a, 'shape', ()))}."
        )
    return nnz

  def _checks(self, xp) -> list[tuple[str, Any, str, Any]]:
    """``[(field, ok, what is allowed, values)]``, elementwise ``ok`` over ``values``, computed with ``xp``.

    The pattern is fully determined by ``row_indices`` / ``col_indices`` in row-major order: every
    derived array must equal the one computed from them.
    """
    rows, cols = self.grid_shape
    r, c = xp.asarray(self.row_indices), xp.asarray(self.col_indices)
    nnz = r.shape[0]
    i32 = xp.int32
    checks = [
        ("row_indices", (r >= 0) & (r < rows), f"values in [0, {rows})", r),
        ("col_indices", (c >= 0) & (c < cols), f"values in [0, {cols})", c),
    ]
    if nnz > 1:
      ordered = (r[1:] > r[:-1]) | ((r[1:] == r[:-1]) & (c[1:] > c[:-1]))
      checks.append(("row_indices/col_indices", ordered, "entries in row-major order (by row, then column), each "
                     "stored once; the value is the (row, col) after the previous entry", xp.stack([r[1:], c[1:]], -1)))
    rc, cc = xp.clip(r, 0, rows), xp.clip(c, 0, cols)
    if xp is np:
      row_offsets = np.concatenate([[0], np.cumsum(np.bincount(rc, minlength=rows + 1)[:rows])]).astype(i32)
      col_offsets = np.concatenate([[0], np.cumsum(np.bincount(cc, minlength=cols + 1)[:cols])]).astype(i32)
      order = np.argsort(c, kind="stable").astype(i32)
    else:
      row_offsets = jnp.concatenate([jnp.zeros(1, i32), jnp.cumsum(jnp.zeros(rows + 1, i32).at[rc].add(1)[:rows])])
      col_offsets = jnp.concatenate([jnp.zeros(1, i32), jnp.cumsum(jnp.zeros(cols + 1, i32).at[cc].add(1)[:cols])])
      order = jnp.argsort(c, stable=True).astype(i32)
    derived = {"row_offsets": row_offsets, "col_offsets": col_offsets, "transpose_order": order}
    if "transpose_row_indices" in self.INDEX_FIELDS:
      derived["transpose_row_indices"] = r[order]
    for f, want in derived.items():
      got = xp.asarray(getattr(self, f))
      checks.append((f, got == want, f"the {f} that row_indices/col_indices imply ({want[:8].tolist()}...)"
                     if xp is np else f"the {f} that row_indices/col_indices imply", got))
    return checks

  def validate(self):
    """Checks the index arrays against the shape and each other; returns ``self``, or raises ``ValueError``.

    Checks: shapes and int32 dtypes; ``row_indices`` / ``col_indices`` in range, in row-major order
    with no entry twice; ``row_offsets``, ``col_offsets``, ``transpose_order`` (and, for
    :class:`CSRMatrix`, ``transpose_row_indices``) equal to those the indices imply. A matrix that
    passes gives the same product on every backend and in both directions.

    Cost: a device-to-host copy of the index arrays and O(nnz log nnz + rows + cols) NumPy work on
    one CPU core (a sort of the column indices dominates). Constructors run it on concrete index arrays, NumPy
    constants closed over in a ``jit`` included (pass ``validate=False`` on hot paths; the ``from_dense`` /
    ``from_mask`` / ``from_block_mask`` constructors build valid arrays and skip it). Traced index arrays (arguments
    of a ``jit``) cannot be checked while tracing: the shape checks
    still run, and the value checks are ``jax.experimental.checkify`` checks: call it inside a function
    wrapped in ``checkify.checkify`` (without one, JAX refuses to stage the checks). Without it, ``to_dense`` of a
    matrix that fails them is NaN: the same checks run there without the sort.

    >>> import numpy as np, jaxsparse
    >>> w = jaxsparse.CSRMatrix.from_dense(np.eye(3, dtype=np.float32))
    >>> idx = {k: np.array(v) for k, v in w.index_arrays().items()}
    >>> idx["col_indices"][1] = 7
    >>> jaxsparse.CSRMatrix.from_index_arrays(w.data, idx, shape=(3, 3))
    Traceback (most recent call last):
    ValueError: CSRMatrix.col_indices is invalid at position 1 (value 7; 1 bad): expected values in [0, 3).
    """
    name = type(self).__name__
    self._check_static()
    arrays = [getattr(self, f) for f in self.INDEX_FIELDS]
    if all(is_concrete(a) for a in arrays):
      for field, ok, allowed, values in self._checks(np):
        ok = np.asarray(ok)
        if not ok.all():
          i = _first_false(ok)
          raise ValueError(
              f"{name}.{field} is invalid at position {i} (value {np.asarray(values)[i].tolist()}; "
              f"{int((~ok).sum())} bad): expected {allowed}."
          )
      return self
    from jax.experimental import checkify  # noqa: PLC0415 -- only for traced matrices

    for field, ok, allowed, _ in self._checks(jnp):
      checkify.check(jnp.all(ok), f"{name}.{field} is invalid: expected {allowed}.")
    return self

  def _nan_unless_valid(self, y: jax.Array) -> jax.Array:
    """``y``, all NaN where the index arrays fail :meth:`validate`'s value checks; checked only for a matrix no
    constructor vouched for (rebuilt by ``tree_unflatten``: under ``jit``, from a checkpoint, by ``jax.tree.map``;
    or assembled with ``validate=False``)."""
    return y if getattr(self, "_trusted", False) else nan_unless(y, self._indices_ok())

  def _indices_ok(self) -> jax.Array:
    """A bool scalar (traced under ``jit``): whether the index arrays pass :meth:`validate`'s value checks.

    O(nnz + rows + cols) compares and gathers, no sort and no host copy: ``to_dense`` runs it on every call and makes
    its result NaN where it is False (:func:`nan_unless`), since under ``jit`` nothing can raise.
    """
    self._check_static()
    return _indices_ok_traced(self)

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
  def from_index_arrays(
      cls, data: jax.typing.ArrayLike, index_arrays: dict[str, jax.Array], *, validate: bool = True, **static: Any
  ):
    """Reassembles a matrix from ``data`` and the dict returned by :meth:`index_arrays`.

    Layers keep the index arrays as non-trainable state and rebuild the matrix on each call with
    this (with ``validate=False``); nothing is recomputed. ``static`` gives the subclass's
    ``STATIC_FIELDS`` (``shape=...``). Concrete arrays are checked by :meth:`validate` unless
    ``validate=False``. Concrete integer arrays of another width (NumPy's default int64, with or without
    ``jax_enable_x64``) are cast to int32 once their values are checked to fit; traced ones must be int32.
    """
    if not isinstance(index_arrays, Mapping):
      raise TypeError(f"index_arrays must be a dict of the index arrays keyed by {cls.INDEX_FIELDS} (what "
                      f"index_arrays() returns), got {type(index_arrays).__name__}.")
    missing = set(cls.INDEX_FIELDS) - set(index_arrays)
    if missing:
      raise ValueError(f"index_arrays is missing {sorted(missing)}; expected the keys {cls.INDEX_FIELDS}.")
    fields = {}
    for f in cls.INDEX_FIELDS:  # a cast to int32 wraps wider integers: check them first
      a = index_arrays[f]
      if is_concrete(a) and not isinstance(a, jax.Array):
        a = np.asarray(a)
      if is_concrete(a) and jnp.issubdtype(a.dtype, jnp.integer) and a.dtype != np.int32:
        if a.size:
          lo, hi, i32 = int(a.min()), int(a.max()), np.iinfo(np.int32)
          if lo < i32.min or hi > i32.max:
            raise ValueError(f"index_arrays[{f!r}] holds values in [{lo}, {hi}], outside int32: not an index of "
                             f"this {cls.__name__}.")
        a = a.astype(np.int32)
      fields[f] = a
    data = _utils.as_array(data, name="data")
    concrete = all(is_concrete(a) for a in fields.values())
    if validate and concrete:  # checked as given: under jit, jnp.asarray turns even a NumPy constant into a tracer
      cls(data, **fields, **static)
    out = cls(data, validate=validate and not concrete, **{f: jnp.asarray(a) for f, a in fields.items()}, **static)
    return trusted(out) if validate and concrete else out

  def index_arrays(self) -> dict[str, jax.Array]:
    """The integer index arrays of the pattern, keyed by ``INDEX_FIELDS`` names."""
    return {f: getattr(self, f) for f in self.INDEX_FIELDS}

  def _scatter(self, grid: tuple[int, int], values: jax.Array) -> jax.Array:
    """``(*grid, *values.shape[1:])`` zeros with ``values[i]`` at ``(row_indices[i], col_indices[i])``.

    Values or indices split over explicit mesh axes (e.g. block values sharded FSDP-style) are gathered first: JAX
    cannot type a scatter of split updates into the unsplit zeros.
    """
    out = jnp.zeros((*grid, *values.shape[1:]), values.dtype)
    return out.at[replicated(self.row_indices), replicated(self.col_indices)].set(replicated(values))

  def _with_checked_data(self, data: jax.Array):
    static = {f: getattr(self, f) for f in self.STATIC_FIELDS}
    return trusted_like(self, type(self)(data, validate=False, **self.index_arrays(), **static))

  @property
  def dtype(self):
    return self.data.dtype
