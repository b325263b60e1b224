"""N:M structured sparsity: :class:`NMSparseMatrix`, the compressed format, and its position packing.

``NMSparseMatrix`` stores the kept values, the grouped axis shrunk by ``n / m``, and the position of
each kept value inside its group as ``ceil(log2 m)``-bit fields packed into unsigned ints. For 2:4
in bfloat16 that is 2 bytes of values and 2 bits of positions per kept weight: 56.25% of the dense
bytes, the same as the cuSPARSELt layout.

The N:M mask that picks the kept values (:func:`~jaxsparse.nm_mask`), its argument checks and the transposable
patterns are in ``jaxsparse/formats/_nm_masks.py``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsparse import _utils
from jaxsparse.formats._base import is_concrete
from jaxsparse.formats._base import nan_unless
from jaxsparse.formats._nm_masks import _check_operand
from jaxsparse.formats._nm_masks import _group_mask
from jaxsparse.formats._nm_masks import _grouped
from jaxsparse.formats._nm_masks import _scores
from jaxsparse.formats._nm_masks import _ungrouped
from jaxsparse.formats._nm_masks import check_axis
from jaxsparse.formats._nm_masks import check_groups
from jaxsparse.formats._nm_masks import check_nm

__all__ = ["NMSparseMatrix", "decompress"]


# -------------------------------------------------------------------------------------------------
# Position packing.
# -------------------------------------------------------------------------------------------------


def position_bits(m: int) -> int:
  """Bits of one position inside a group of ``m``."""
  return max(1, (m - 1).bit_length())


def index_layout(n: int, m: int, groups: int) -> tuple[jnp.dtype, int]:
  """``(word dtype, groups per word)`` of the packed positions for ``groups`` groups of ``n`` of ``m``.

  One group takes ``n * position_bits(m)`` bits. Words are the smallest of uint8/16/32 that hold a
  group; a word holds as many whole groups as fit, reduced to a divisor of ``groups``. Word ``r``
  packs groups ``r + s * (groups // per_word)`` for ``s < per_word``: each packed slot covers a
  contiguous run of groups, which is what the GPU kernel loads.
  """
  bits = n * position_bits(m)
  for dtype in (jnp.uint8, jnp.uint16, jnp.uint32):
    word = jnp.iinfo(dtype).bits
    if bits <= word:
      per_word = word // bits
      while groups % per_word:
        per_word -= 1
      return jnp.dtype(dtype), per_word
  raise ValueError(
      f"n={n} positions of {position_bits(m)} bits (m={m}) need {bits} bits per group; the compressed "
      "format packs at most 32. Use a smaller n or m."
  )


def _pack(positions: jax.Array, n: int, m: int) -> jax.Array:
  """``(G, n, *rest)`` positions -> ``(G // per_word, *rest)`` packed words."""
  groups = positions.shape[0]
  dtype, per_word = index_layout(n, m, groups)
  b = position_bits(m)
  rows = groups // per_word
  p = positions.astype(jnp.uint32).reshape(per_word, rows, n, *positions.shape[2:])
  words = jnp.zeros((rows, *positions.shape[2:]), jnp.uint32)
  for s in range(per_word):
    for j in range(n):
      words = words | (p[s, :, j] << ((s * n + j) * b))
  return words.astype(dtype)


def _unpack(words: jax.Array, n: int, m: int, groups: int, xp=jnp) -> jax.Array:
  """Inverse of :func:`_pack`: ``(G // per_word, *rest)`` words -> ``(G, n, *rest)`` uint8 positions."""
  _, per_word = index_layout(n, m, groups)
  b = position_bits(m)
  w32 = words.astype(xp.uint32)
  field = xp.uint32((1 << b) - 1)
  planes = [xp.stack([(w32 >> ((s * n + j) * b)) & field for j in range(n)], axis=1) for s in range(per_word)]
  return xp.concatenate(planes, axis=0).astype(xp.uint8)


def _whole_groups(w: jax.Array, axis: int) -> jax.Array:
  """``w`` gathered along ``axis`` where explicit mesh axes split it (a no-op otherwise): JAX refuses the packing's
  reshape and slices of a split dim. Its other dims keep their split."""
  if _utils.explicit_mesh(w) is None:
    return w
  sharding = jax.typeof(w).sharding
  spec = list(sharding.spec) + [None] * (w.ndim - len(sharding.spec))
  if spec[axis] is None:
    return w
  spec[axis] = None
  return jax.reshard(w, NamedSharding(sharding.mesh, P(*spec)))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _compress(w: jax.Array, n: int, m: int, axis: int) -> tuple[jax.Array, jax.Array]:
  wg = _grouped(w, axis, m)  # (G, m, *rest)
  keep = _group_mask(_grouped(_scores(w), axis, m), n)
  slot = jnp.cumsum(keep, axis=1, dtype=jnp.int32) - 1  # index of each kept entry among the kept
  # pos[:, j] = the position of the j-th kept entry (exactly one kept entry has slot j).
  pos = jnp.stack([jnp.argmax(keep & (slot == j), axis=1) for j in range(n)], axis=1)
  values = jnp.take_along_axis(wg, pos, axis=1)
  return _ungrouped(values, axis), jnp.moveaxis(_pack(pos, n, m), 0, axis)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _positions(indices: jax.Array, n: int, m: int, axis: int, groups: int) -> jax.Array:
  """``(G, n, *rest)`` positions from the packed ``indices`` (``axis`` of the packed words)."""
  return _unpack(jnp.moveaxis(indices, axis, 0), n, m, groups)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def decompress(values: jax.Array, indices: jax.Array, n: int, m: int, axis: int) -> jax.Array:
  """The dense array of an N:M matrix's ``values`` and ``indices`` (:meth:`NMSparseMatrix.to_dense` without the
  static shape: its other dims may be symbolic, as a lookup's ids under ``jax.export``)."""
  vals = jnp.moveaxis(values, axis, 0)
  groups = vals.shape[0] // n
  vals = vals.reshape(groups, n, *vals.shape[1:])
  pos = _positions(indices, n, m, axis, groups)
  lane = jnp.arange(m, dtype=pos.dtype).reshape((1, m) + (1,) * (pos.ndim - 2))
  dense = jnp.zeros((groups, m, *vals.shape[2:]), vals.dtype)
  for j in range(n):
    dense = jnp.where(pos[:, j : j + 1] == lane, vals[:, j : j + 1], dense)
  # Positions that never met validate() (traced, or from tree_unflatten): one past m - 1 (m not a power of two) or
  # one repeated would drop a value. Its group is NaN instead (in the gradients too), fused into this pass.
  ok = pos[:, n - 1 : n] < m
  for j in range(n - 1):
    ok &= pos[:, j + 1 : j + 2] > pos[:, j : j + 1]
  return _ungrouped(nan_unless(dense, ok), axis)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _kept(indices: jax.Array, n: int, m: int, axis: int, groups: int) -> jax.Array:
  pos = _positions(indices, n, m, axis, groups)
  lane = jnp.arange(m, dtype=pos.dtype).reshape((1, m) + (1,) * (pos.ndim - 2))
  keep = jnp.zeros((groups, m, *pos.shape[2:]), bool)
  for j in range(n):
    keep = keep | (pos[:, j : j + 1] == lane)
  return _ungrouped(keep, axis)


# -------------------------------------------------------------------------------------------------
# The compressed format.
# -------------------------------------------------------------------------------------------------


@jax.tree_util.register_pytree_node_class
class NMSparseMatrix:
  """An N:M-sparse array stored compressed: kept values plus packed in-group positions.

  ``values`` has the dense shape with ``axis`` shrunk by ``n / m``: entries ``g*n .. g*n + n - 1``
  along ``axis`` are the kept entries of group ``g`` in increasing position. ``indices`` holds their
  positions inside the group (``ceil(log2 m)`` bits each), packed into unsigned words as laid out
  by :func:`index_layout`; :meth:`positions` unpacks them. Any rank works for storage; the product
  :func:`jaxsparse.ops.nm_matmul` takes a 2-D ``(K, N)`` matrix in Flax kernel layout.

  >>> import jax, jaxsparse
  >>> w = jax.random.normal(jax.random.key(0), (64, 32))
  >>> ws = jaxsparse.NMSparseMatrix.from_dense(w, 2, 4)
  >>> ws.shape, ws.values.shape, ws.indices.shape, ws.indices.dtype
  ((64, 32), (32, 32), (8, 32), dtype('uint8'))
  >>> bool((ws.to_dense() == w * jaxsparse.nm_mask(w, 2, 4)).all())
  True

  The constructor assembles a matrix from its parts (use :meth:`from_dense` to compress an array); shapes and
  dtypes are always checked, and with ``validate=True`` concrete ``indices`` also by :meth:`validate`.
  Under ``jit`` (``indices`` traced) or after ``jax.tree_util.tree_unflatten`` / ``jax.tree.map`` (a restored
  checkpoint) positions cannot raise: :meth:`to_dense`, and so the XLA path of :func:`jaxsparse.ops.nm_matmul` and
  its gradients, give NaN in each group whose positions :meth:`validate` would refuse (one past ``m - 1``, possible
  when ``m`` is not a power of two, or not strictly increasing), at no extra pass (the check is fused into the
  unpacking).

  Args:
    values: kept values, of the dense dtype.
    indices: packed positions, of the unsigned dtype :func:`index_layout` gives for ``n``, ``m`` and the groups.
    shape: the dense shape.
    n, m: ``n`` kept of every ``m``, ``0 < n < m``; ``shape[axis]`` a multiple of ``m``.
    axis: the axis the groups run along (negative counts from the end).
    validate: check concrete ``indices`` (also NumPy constants inside a ``jit``) with :meth:`validate` (skipped for
      traced arrays: call :meth:`validate` under ``checkify``).

  Raises:
    ValueError: a bad ``n``, ``m``, ``axis`` or ``shape``, ``values`` or ``indices`` of the wrong shape or dtype,
      or (``validate=True``) invalid positions.

  Attributes:
    values: kept values, ``shape`` with ``shape[axis]`` replaced by ``shape[axis] * n // m``.
    indices: packed positions, ``shape`` with ``shape[axis]`` replaced by ``groups // per_word``.
    shape: static dense shape.
    n, m: static: ``n`` kept of every ``m``.
    axis: static, non-negative axis the groups run along.
  """

  def __init__(
      self,
      values: jax.Array,
      indices: jax.Array,
      *,
      shape: tuple[int, ...],
      n: int,
      m: int,
      axis: int = 0,
      validate: bool = True,
  ):
    """Assembles a matrix from its parts; use :meth:`from_dense` to compress an array.

    Shapes and dtypes are always checked; with ``validate=True`` (the default) concrete ``indices`` are
    also checked by :meth:`validate` (skipped for traced arrays).
    """
    n, m = check_nm(n, m)
    shape = _utils.check_dims(shape, name="shape")
    axis = check_axis(axis, len(shape))
    groups = check_groups(shape, axis, m, name="shape")
    index_layout(n, m, groups)  # Fails when the positions do not fit 32 bits.
    # Checked as given: under jit, jnp.asarray turns even a NumPy constant into a tracer, which skips validate.
    given = (indices if isinstance(indices, jax.Array) or not is_concrete(indices) else
             _utils.as_host_array(indices, name="indices"))
    self.values, self.indices = _utils.as_array(values, name="values"), given
    self.shape, self.n, self.m, self.axis = shape, n, m, axis
    self._check_static(prefix="")
    if validate and is_concrete(given):
      self.validate()
    self.indices = jnp.asarray(given)

  def _check_static(self, *, prefix: str = "NMSparseMatrix.") -> NMSparseMatrix:
    """Checks the shapes of :attr:`values` and :attr:`indices` and the dtype of :attr:`indices` (static, so also
    under ``jit``); returns ``self``.

    The constructor runs it, and so do the methods that read the positions and :func:`jaxsparse.ops.nm_matmul`: a
    matrix rebuilt by ``jax.tree_util.tree_unflatten`` (``jax.tree.map`` over a model, a restored checkpoint) skips
    the constructor, and positions cast to another dtype (``tree.map(lambda a: a.astype(jnp.bfloat16), params)``)
    or re-shaped would otherwise be read silently wrong.
    """
    # The constructor's checks of the static fields: a matrix from tree_unflatten (hand-built aux data) skipped them.
    n, m = check_nm(self.n, self.m)
    shape = _utils.check_dims(self.shape, name=f"{prefix}shape")
    axis = check_axis(self.axis, len(shape))
    check_groups(shape, axis, m, name=f"{prefix}shape")
    dtype, per_word = index_layout(n, m, self.groups)
    want_v = (*shape[:axis], self.groups * n, *shape[axis + 1:])
    want_i = (*shape[:axis], self.groups // per_word, *shape[axis + 1:])
    values_shape, indices_shape = tuple(jnp.shape(self.values)), tuple(jnp.shape(self.indices))
    if values_shape != want_v:
      raise ValueError(f"{prefix}values must have shape {want_v} for shape={shape}, {n}:{m}, axis={axis}; got "
                       f"{values_shape}.")
    indices_dtype = jnp.result_type(self.indices)
    if indices_shape != want_i or indices_dtype != dtype:
      raise ValueError(
          f"{prefix}indices must be {dtype} of shape {want_i} for shape={shape}, {n}:{m}, axis={axis}; "
          f"got {indices_dtype} {indices_shape}"
          + ("." if indices_dtype == dtype else
             " (were the positions cast, e.g. by a jax.tree.map over the model? Cast only the values).")
      )
    return self

  def _checks(self, xp) -> list[tuple[str, Any, str, Any]]:
    """``[(what, ok, what is allowed, values)]``: elementwise ``ok`` over ``values``, computed with ``xp``."""
    n, m = self.n, self.m
    words = xp.asarray(self.indices)
    _, per_word = index_layout(n, m, self.groups)
    used_bits = per_word * n * position_bits(m)
    checks = []
    if used_bits < words.dtype.itemsize * 8:  # bits past the packed fields must be zero
      spare = words.astype(xp.uint32) >> used_bits
      checks.append(("indices", spare == 0, f"the bits from {used_bits} up of each word zero", words))
    # NumPy on the host for concrete indices (also inside an outer jit, where a jitted unpack would trace).
    pos = _unpack(xp.moveaxis(words, self.axis, 0), n, m, self.groups, xp=xp)
    pos = xp.moveaxis(pos, 1, -1)  # (G, *rest, n)
    checks.append(("positions", pos < m, f"positions in [0, {m})", pos))
    if n > 1:
      checks.append(("positions", pos[..., 1:] > pos[..., :-1],
                     "positions strictly increasing within each group (no position twice)", pos))
    return checks

  def validate(self) -> NMSparseMatrix:
    """Checks the packed positions; returns ``self``, or raises ``ValueError`` naming the bad group.

    Every position must be in ``[0, m)``, the ``n`` positions of a group strictly increasing (so no
    two kept values claim one entry), and the spare bits of each packed word zero. Cost: a device-to-host
    copy of ``indices`` and one NumPy unpack of them (O(size of ``values``)). The constructor runs it on
    concrete indices (``validate=False`` skips it; :meth:`from_dense` builds valid positions). Under
    ``jit`` the checks are ``jax.experimental.checkify`` checks: call it inside a function wrapped in
    ``checkify.checkify`` (without one, JAX refuses to stage the checks).

    Returns:
      ``self``.

    Raises:
      ValueError: ``values`` or ``indices`` of the wrong shape or dtype, or (concrete ``indices``) a bad position
        or nonzero spare bits.

    >>> import jax.numpy as jnp, jaxsparse
    >>> ws = jaxsparse.NMSparseMatrix.from_dense(jnp.arange(8.0).reshape(8, 1), 2, 4)
    >>> ws.validate() is ws
    True
    >>> bad = jaxsparse.NMSparseMatrix(ws.values, ws.indices.at[0, 0].set(0), shape=(8, 1), n=2, m=4,
    ...                                validate=False)
    >>> bad.validate()
    Traceback (most recent call last):
      ...
    ValueError: NMSparseMatrix.positions is invalid in group 0 along axis 0 at (0,): got [0, 0] (2 bad); expected
    positions strictly increasing within each group (no position twice) for 2:4.
    """
    self._check_static()
    if is_concrete(self.indices):
      for what, ok, allowed, values in self._checks(np):
        ok = np.asarray(ok)
        if not ok.all():
          where = tuple(int(i) for i in np.argwhere(~ok)[0])
          if what == "indices":
            at, got = f"word {where}", np.asarray(values)[where].item()
          else:  # (group, *other axes, slot)
            at = f"group {where[0]} along axis {self.axis}" + (f" at {where[1:-1]}" if len(where) > 2 else "")
            got = np.asarray(values)[where[:-1]].tolist()
          raise ValueError(
              f"NMSparseMatrix.{what} is invalid in {at}: got {got} ({int((~ok).sum())} bad); expected {allowed} "
              f"for {self.n}:{self.m}."
          )
      return self
    from jax.experimental import checkify  # noqa: PLC0415 -- only for traced matrices

    for what, ok, allowed, _ in self._checks(jnp):
      checkify.check(jnp.all(ok), f"NMSparseMatrix.{what} is invalid: expected {allowed} for {self.n}:{self.m}.")
    return self

  # -- pytree ---------------------------------------------------------------------------------------
  def tree_flatten(self):
    """JAX pytree protocol: ``((values, indices), (shape, n, m, axis))``; the children are the arrays."""
    return (self.values, self.indices), (self.shape, self.n, self.m, self.axis)

  @classmethod
  def tree_unflatten(cls, aux, children):
    """JAX pytree protocol: the matrix back from :meth:`tree_flatten`'s parts, without the constructor's checks.

    The methods that read the positions check their shape and dtype again (:meth:`positions`, :meth:`mask`,
    :meth:`to_dense`, :func:`jaxsparse.ops.nm_matmul`).
    """
    obj = object.__new__(cls)
    obj.values, obj.indices = children
    obj.shape, obj.n, obj.m, obj.axis = aux
    return obj

  # -- construction ---------------------------------------------------------------------------------
  @classmethod
  def from_dense(cls, w: jax.typing.ArrayLike, n: int, m: int, *, axis: int = 0) -> NMSparseMatrix:
    """Prunes ``w`` to N:M with :func:`jaxsparse.nm_mask` and compresses it (works under ``jit``).

    Args:
      w: dense array; ``w.shape[axis]`` a multiple of ``m``.
      n, m: keep ``n`` of every ``m``, ``0 < n < m``.
      axis: the axis the groups run along.

    Returns:
      An ``NMSparseMatrix`` of ``w``'s shape and dtype with ``to_dense() == where(nm_mask(w, n, m, axis=axis), w,
      0)``. Under explicit mesh axes (``jax.set_mesh``) a ``w`` split along ``axis`` is gathered along it for the
      packing: the values and positions keep the split of ``w``'s other dims, ``axis`` whole.

    Raises:
      ValueError: a bad ``n``, ``m`` or ``axis``, or ``w.shape[axis]`` not a multiple of ``m``.

    >>> import jax.numpy as jnp, jaxsparse
    >>> ws = jaxsparse.NMSparseMatrix.from_dense(jnp.array([[1.0, -4.0, 3.0, 2.0]]), 2, 4, axis=1)
    >>> ws.values, ws.positions()
    (Array([[-4.,  3.]], dtype=float32), Array([[1, 2]], dtype=uint8))
    """
    w, n, m, axis = _check_operand(w, n, m, axis)
    index_layout(n, m, w.shape[axis] // m)  # Fails early when the positions do not fit 32 bits.
    values, indices = _compress(_whole_groups(w, axis), n, m, axis)
    return cls(values, indices, shape=w.shape, n=n, m=m, axis=axis, validate=False)

  def with_values(self, values: jax.typing.ArrayLike) -> NMSparseMatrix:
    """The same positions with new kept ``values``.

    Args:
      values: new kept values, of shape ``self.values.shape`` (any dtype).

    Returns:
      An ``NMSparseMatrix`` sharing ``indices``, ``shape``, ``n``, ``m`` and ``axis`` with ``self``.

    Raises:
      ValueError: ``values`` of another shape.

    >>> import jax.numpy as jnp, jaxsparse
    >>> ws = jaxsparse.NMSparseMatrix.from_dense(jnp.array([[1.0, -4.0, 3.0, 2.0]]), 2, 4, axis=1)
    >>> ws.with_values(2 * ws.values).to_dense()
    Array([[ 0., -8.,  6.,  0.]], dtype=float32)
    """
    values = _utils.as_array(values, name="values")
    if values.shape != self.values.shape:
      raise ValueError(f"values must have shape {self.values.shape}, got {values.shape}.")
    return NMSparseMatrix(values, self.indices, shape=self.shape, n=self.n, m=self.m, axis=self.axis, validate=False)

  def gather(self, dense: jax.typing.ArrayLike) -> NMSparseMatrix:
    """This pattern over another dense array: the same positions, holding ``dense``'s entries there.

    Args:
      dense: array of :attr:`shape` (any dtype), e.g. new dense weights for a compressed layer that keeps its
        pattern.

    Returns:
      An ``NMSparseMatrix`` sharing ``indices``, ``shape``, ``n``, ``m`` and ``axis`` with ``self``, its values
      ``dense``'s entries at the kept positions (``dense``'s dtype).

    Raises:
      ValueError: ``dense`` of another shape.

    >>> import jax.numpy as jnp, jaxsparse
    >>> ws = jaxsparse.NMSparseMatrix.from_dense(jnp.array([[1.0, -4.0, 3.0, 2.0]]), 2, 4, axis=1)
    >>> ws.gather(jnp.array([[10.0, 20.0, 30.0, 40.0]])).to_dense()
    Array([[ 0., 20., 30.,  0.]], dtype=float32)
    """
    dense = _utils.as_array(dense, name="dense")
    if dense.shape != self.shape:
      raise ValueError(f"dense must have the matrix's shape {self.shape}, got {dense.shape}.")
    self._check_static()
    positions = _positions(self.indices, self.n, self.m, self.axis, self.groups).astype(jnp.int32)  # (G, n, *rest)
    kept = jnp.take_along_axis(_grouped(dense, self.axis, self.m), positions, axis=1)
    return self.with_values(_ungrouped(kept, self.axis))

  # -- views ----------------------------------------------------------------------------------------
  @property
  def dtype(self):
    """The dtype of :attr:`values` (the dense dtype)."""
    return self.values.dtype

  @property
  def ndim(self) -> int:
    """The number of dense dimensions, ``len(shape)``."""
    return len(self.shape)

  @property
  def groups(self) -> int:
    """Number of groups along :attr:`axis`."""
    return self.shape[self.axis] // self.m

  @property
  def density(self) -> float:
    """Fraction of entries kept, ``n / m``."""
    return self.n / self.m

  @property
  def nbytes(self) -> int:
    """Bytes stored: values plus packed positions."""
    return int(self.values.size * self.values.dtype.itemsize + self.indices.size * self.indices.dtype.itemsize)

  def positions(self) -> jax.Array:
    """The position of each kept value inside its group, unpacked from :attr:`indices`.

    Returns:
      ``uint8`` array shaped like :attr:`values`, each entry in ``[0, m)``.

    >>> import jax.numpy as jnp, jaxsparse
    >>> jaxsparse.NMSparseMatrix.from_dense(jnp.array([[5.0], [0.0], [0.0], [-7.0]]), 2, 4).positions()[:, 0]
    Array([0, 3], dtype=uint8)
    """
    self._check_static()
    return _ungrouped(_positions(self.indices, self.n, self.m, self.axis, self.groups), self.axis)

  def mask(self) -> jax.Array:
    """The kept entries.

    Returns:
      ``bool`` array of :attr:`shape`, True at the kept entries (``n`` in each group of ``m``).

    >>> import jax.numpy as jnp, jaxsparse
    >>> jaxsparse.NMSparseMatrix.from_dense(jnp.array([[5.0, 0.0, 0.0, -7.0]]), 2, 4, axis=1).mask()
    Array([[ True, False, False,  True]], dtype=bool)
    """
    self._check_static()
    return _kept(self.indices, self.n, self.m, self.axis, self.groups)

  def to_dense(self) -> jax.Array:
    """The dense array, zeros at the pruned entries (differentiable in :attr:`values`).

    Returns:
      Array of :attr:`shape` and :attr:`dtype`.

    >>> import jax.numpy as jnp, jaxsparse
    >>> jaxsparse.NMSparseMatrix.from_dense(jnp.array([[1.0, -4.0, 3.0, 2.0]]), 2, 4, axis=1).to_dense()
    Array([[ 0., -4.,  3.,  0.]], dtype=float32)
    """
    self._check_static()
    return decompress(self.values, self.indices, self.n, self.m, self.axis)

  def __repr__(self) -> str:
    return (
        f"NMSparseMatrix(shape={self.shape}, {self.n}:{self.m}, axis={self.axis}, dtype={self.values.dtype}, "
        f"indices={self.indices.dtype}{tuple(self.indices.shape)})"
    )

