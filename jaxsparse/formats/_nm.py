"""N:M structured sparsity: the mask, and :class:`NMSparseMatrix`, the compressed format.

In N:M sparsity every group of ``m`` consecutive weights along one axis keeps ``n`` of them. For a
Flax kernel the groups run along the input features: axis 0 of a ``(in, out)`` Dense kernel and
the ``cin`` axis (-2) of a ``(kh, kw, cin, cout)`` Conv kernel. That is the grouping of PyTorch's
input dimension in apex ASP and ``torch.sparse.to_sparse_semi_structured`` (2:4).

``NMSparseMatrix`` stores the kept values, the grouped axis shrunk by ``n / m``, and the position of
each kept value inside its group as ``ceil(log2 m)``-bit fields packed into unsigned ints. For 2:4
in bfloat16 that is 2 bytes of values and 2 bits of positions per kept weight: 56.25% of the dense
bytes, the same as the cuSPARSELt layout.
"""

from __future__ import annotations

import functools
import itertools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsparse import _utils
from jaxsparse.formats._base import is_concrete

__all__ = [
    "NMSparseMatrix",
    "check_nm",
    "check_transposable",
    "check_transposable_flag",
    "nm_mask",
    "tile_mask",
    "transposable_pattern",
]

# Above this group size the mask ranks entries with a stable argsort instead of pairwise comparisons.
_PAIRWISE_MAX_M = 32


def _check_int(value: object, name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an int, got {name}={value!r} of type {type(value).__name__}.")
  return int(value)


def check_nm(n: object, m: object) -> tuple[int, int]:
  """Returns ``(n, m)`` as ints with ``0 < n < m``; raises naming the bad argument otherwise."""
  n, m = _check_int(n, "n"), _check_int(m, "m")
  if m < 2:
    raise ValueError(f"m must be an int >= 2 (the group size), got m={m}.")
  if not 0 < n < m:
    raise ValueError(f"n must satisfy 0 < n < m (keep n of every m), got n={n} with m={m}.")
  return n, m


def check_axis(axis: object, ndim: int, *, name: str = "axis") -> int:
  """Returns ``axis`` normalised to ``[0, ndim)``."""
  axis = _check_int(axis, name)
  if not -ndim <= axis < ndim:
    raise ValueError(f"{name}={axis} is out of range for {ndim}-D w (allowed: {-ndim}..{ndim - 1}).")
  return axis % ndim


def check_groups(shape: tuple[int, ...], axis: int, m: int, *, name: str = "w") -> int:
  size = shape[axis]
  if size % m:
    raise ValueError(
        f"m={m} must divide {name}.shape[{axis}]={size} (the axis the groups run along); "
        f"{name}.shape={shape}. Pick an m that divides it or pad the axis."
    )
  return size // m


def _scores(w: jax.Array) -> jax.Array:
  """``|w|`` with NaN counted as the largest value, so every group still keeps exactly ``n``.

  Signed integers score in the unsigned type of their width: ``abs`` wraps their minimum (int8 -128) to itself,
  which as unsigned is its magnitude (128), so no value overflows.
  """
  a = jnp.abs(w)
  if jnp.issubdtype(a.dtype, jnp.signedinteger):
    return lax.bitcast_convert_type(a, getattr(jnp, f"uint{jnp.iinfo(a.dtype).bits}"))
  if jnp.issubdtype(a.dtype, jnp.inexact):
    a = jnp.where(jnp.isnan(a), jnp.inf, a)
  return a


def _grouped(a: jax.Array, axis: int, m: int) -> jax.Array:
  """``a`` with ``axis`` moved to the front and split into ``(groups, m, *rest)``."""
  a = jnp.moveaxis(a, axis, 0)
  return a.reshape(a.shape[0] // m, m, *a.shape[1:])


def _ungrouped(a: jax.Array, axis: int) -> jax.Array:
  """Inverse of :func:`_grouped` for ``(groups, k, *rest)``: merges the first two axes and moves them back."""
  a = a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])
  return jnp.moveaxis(a, 0, axis)


def _group_words(scores: jax.Array, n: int) -> jax.Array:
  """``(G, m, *rest)`` scores (``m <= _PAIRWISE_MAX_M``) -> ``(G, *rest)`` words whose bit ``i`` keeps entry ``i``.

  Entry ``i`` is kept where fewer than ``n`` entries of its group beat it (larger, or equal and earlier): ``m^2``
  comparisons per group, each entry read once, so XLA computes the words in one pass over the scores. Comparing the
  ``(G, m, *rest)`` array with each broadcast slice instead made XLA's GPU backend write the slices first (H200, a
  4096 x 4096 float32 2:4 mask: 78 us in two passes, a third of an SR-STE train step at 256 rows).
  """
  m = scores.shape[1]
  word = jnp.uint8 if m <= 8 else jnp.uint16 if m <= 16 else jnp.uint32
  entries = [scores[:, k] for k in range(m)]
  words = jnp.zeros(entries[0].shape, word)
  for i, si in enumerate(entries):
    rank = sum(((sk >= si) if k < i else (sk > si)).astype(jnp.int32) for k, sk in enumerate(entries) if k != i)
    words = words | ((rank < n).astype(word) << i)
  return words


def _word_mask(words: jax.Array, m: int) -> jax.Array:
  """Inverse of :func:`_group_words`' packing: ``(G, *rest)`` words -> ``(G, m, *rest)`` bool. Elementwise after a
  broadcast, so XLA fuses it into its consumer."""
  lanes = jnp.arange(m, dtype=words.dtype).reshape((1, m) + (1,) * (words.ndim - 1))
  return ((words[:, None] >> lanes) & 1).astype(bool)


def _group_mask(scores: jax.Array, n: int) -> jax.Array:
  """``(G, m, *rest)`` scores -> bool mask keeping the ``n`` largest per group, lower index first on ties."""
  m = scores.shape[1]
  if m <= _PAIRWISE_MAX_M:
    return _word_mask(_group_words(scores, n), m)
  # A stable sort of -score keeps equal scores in index order (~score reverses unsigned scores without wrapping).
  descending = ~scores if jnp.issubdtype(scores.dtype, jnp.unsignedinteger) else -scores
  order = jnp.argsort(descending, axis=1, stable=True)
  rank = jnp.argsort(order, axis=1, stable=True)
  return rank < n


def _check_operand(w: jax.typing.ArrayLike, n: object, m: object, axis: object) -> tuple[jax.Array, int, int, int]:
  """``(w, n, m, axis)`` checked for an N:M pattern along ``axis`` of a numeric ``w``."""
  w = jnp.asarray(w)
  n, m = check_nm(n, m)
  axis = check_axis(axis, w.ndim)
  check_groups(w.shape, axis, m)
  if not jnp.issubdtype(w.dtype, jnp.number):
    raise TypeError(f"w must be a numeric array, got dtype {w.dtype}.")
  return w, n, m, axis


def nm_mask(w: jax.typing.ArrayLike, n: int, m: int, *, axis: int = 0, transposable: bool = False) -> jax.Array:
  """Bool mask keeping the ``n`` largest-magnitude entries of every ``m`` consecutive ones along ``axis``.

  Groups are ``w[..., g*m:(g+1)*m, ...]`` along ``axis``. Ties go to the lower index, so the mask is
  deterministic; NaN counts as the largest magnitude (as in :func:`jaxsparse.magnitude_mask`, so a diverged weight
  stays visible), and a signed integer's minimum (int8 -128) as larger than its maximum. Works under ``jit`` with
  static ``n``, ``m``, ``axis``; every group keeps exactly ``n`` entries.

  With ``transposable=True`` the mask is N:M along the last axis too (the output features of a
  kernel): in every ``m x m`` tile of ``(axis, last axis)`` each row and each column keeps ``n``
  entries, the pattern of largest total magnitude among all such (90 for 2:4; ties to the first in a
  fixed order). Both ``W`` and ``Wᵀ`` are then N:M along their contraction axis, so the backward product
  ``dY Wᵀ`` can run on 2:4 sparse tensor cores as the forward does (Hubara et al., "Accelerated Sparse
  Neural Training: A Provable and Efficient Method to Find N:M Transposable Masks", NeurIPS 2021). It
  keeps less magnitude than the plain mask (2:4 of Gaussian weights: 70% against 74% of ``sum |w|``).
  It scores every pattern of every tile with one product: a float32 intermediate of 90 / 16 = 5.6 times
  the weight's float32 bytes for 2:4. (On CUDA GPUs ``ops.sr_ste_matmul`` and the SR-STE layers prune
  with a kernel of ours in one pass instead.)

  >>> import jax.numpy as jnp, jaxsparse
  >>> w = jnp.array([[0.1, -3.0, 2.0, 0.5], [1.0, 1.0, 1.0, 1.0]])
  >>> jaxsparse.nm_mask(w, 2, 4, axis=1)
  Array([[False,  True,  True, False],
         [ True,  True, False, False]], dtype=bool)

  Args:
    w: weights of any shape; ``w.shape[axis]`` must be a multiple of ``m``.
    n: entries kept per group, ``0 < n < m``.
    m: group size.
    axis: the axis the groups run along: 0 (input features) for a ``(in, out)`` Dense kernel, -2
      (``cin``) for a ``(kh, kw, cin, cout)`` Conv kernel.
    transposable: also N:M along the last axis (``w.ndim >= 2``, ``axis`` not the last axis, ``m``
      dividing ``w.shape[-1]``, ``m <= 4``).

  Returns:
    Bool array of ``w.shape`` with ``n`` True per group.
  """
  w, n, m, axis = _check_operand(w, n, m, axis)
  if check_transposable(transposable, w.shape, m, axis):
    return _transposable_mask(w, n, m, axis)
  return _nm_mask(w, n, m, axis)


# Transposable masks enumerate the m x m tiles with n per row and column: 90 for 2:4, 24 for 1:4 and 3:4;
# beyond m = 4 there are far too many (1.2e11 for 4:8).
TRANSPOSABLE_MAX_M = 4


def check_transposable_flag(transposable: object, m: int) -> bool:
  """``transposable`` as a bool; raises where it is not one, or is True for groups larger than enumerable."""
  if transposable is not False and transposable is not True:
    raise TypeError(f"transposable must be a bool, got transposable={transposable!r}.")
  if transposable and m > TRANSPOSABLE_MAX_M:
    raise ValueError(f"transposable=True needs m <= {TRANSPOSABLE_MAX_M}, got m={m}.")
  return transposable


def check_transposable(transposable: object, shape: tuple[int, ...], m: int, axis: int, *, name: str = "w") -> bool:
  """``transposable`` as a bool; raises naming the argument where it is True and cannot apply to ``shape``."""
  if not check_transposable_flag(transposable, m):
    return False
  if len(shape) < 2 or axis % len(shape) == len(shape) - 1:
    raise ValueError(
        f"transposable=True needs a second axis besides the grouped one: the last axis of {name}, got "
        f"{name}.shape={shape} grouped along axis={axis}."
    )
  if shape[-1] % m:
    raise ValueError(
        f"transposable=True needs m={m} to divide {name}.shape[-1]={shape[-1]} (the groups of the transposed "
        f"weight); {name}.shape={shape}."
    )
  return True


@functools.cache
def _tile_patterns(n: int, m: int) -> np.ndarray:
  """``(P, m, m)`` bool: every ``m x m`` pattern with ``n`` True per row and per column, in a fixed order."""
  rows = list(itertools.combinations(range(m), n))
  patterns = []
  for choice in itertools.product(rows, repeat=m):
    tile = np.zeros((m, m), bool)
    for r, cols in enumerate(choice):
      tile[r, list(cols)] = True
    if (tile.sum(axis=0) == n).all():
      patterns.append(tile)
  return np.stack(patterns)


@functools.partial(jax.jit, static_argnums=(1, 2))
def transposable_pattern(w: jax.Array, n: int, m: int) -> jax.Array:
  """``(..., R m, C m)`` -> ``(..., R, C)``: each ``m x m`` tile's best pattern (index into :func:`_tile_patterns`)."""
  patterns = _tile_patterns(n, m)
  # Scores in float32, finite (NaN and inf the largest) so that a 0 / 1 product cannot make a NaN.
  big = np.float32(np.finfo(np.float32).max / (m * m))
  a = jnp.minimum(_scores(w).astype(jnp.float32), big)
  *lead, rows, cols = a.shape
  tiles = a.reshape(*lead, rows // m, m, cols // m, m)
  tiles = jnp.swapaxes(tiles, -3, -2).reshape(*lead, rows // m, cols // m, m * m)
  # Total kept magnitude of every pattern (exact selection sums: HIGHEST keeps TF32 out), then the best.
  totals = lax.dot_general(
      tiles, jnp.asarray(patterns.reshape(len(patterns), m * m), jnp.float32),
      (((tiles.ndim - 1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
  )
  return jnp.argmax(totals, axis=-1)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _transposable_mask(w: jax.Array, n: int, m: int, axis: int) -> jax.Array:
  return jnp.moveaxis(tile_mask(transposable_pattern(jnp.moveaxis(w, axis, -2), n, m), n, m), -2, axis)


@functools.cache
def _pattern_bits(n: int, m: int) -> np.ndarray:
  """:func:`_tile_patterns` as ``(P,)`` int32 bit masks: bit ``r m + c`` is entry ``(r, c)`` of the tile."""
  patterns = _tile_patterns(n, m)
  return (patterns.reshape(len(patterns), m * m) << np.arange(m * m)).sum(-1).astype(np.int32)


def tile_mask(pattern: jax.Array, n: int, m: int) -> jax.Array:
  """``(..., R, C)`` indices into :func:`_tile_patterns` ``(n, m)`` -> the ``(..., R m, C m)`` bool mask they pick.

  Broadcasts each tile's bit mask over its ``m x m`` entries and shifts: elementwise, so XLA fuses it into
  its consumer (no gathered ``(R, C, m, m)`` array and no transpose).
  """
  *lead, rows, cols = pattern.shape
  bits = jnp.asarray(_pattern_bits(n, m))[pattern]
  full = jnp.broadcast_to(bits[..., :, None, :, None], (*lead, rows, m, cols, m)).reshape(*lead, rows * m, cols * m)
  shift = (jnp.arange(rows * m) % m)[:, None] * m + (jnp.arange(cols * m) % m)[None, :]
  return ((full >> shift) & 1).astype(bool)


def nm_group_bits(w: jax.Array, n: int, m: int) -> jax.Array:
  """``group_bits(nm_mask(w, n, m, axis=0), m)`` of a 2-D ``w`` (``m <= 8``) in one pass over ``w``."""
  return _group_words(_grouped(_scores(w), 0, m), n)


def group_bits(mask: jax.Array, m: int) -> jax.Array:
  """``(R m, C)`` bool mask -> ``(R, C)`` uint8: bit ``r`` of entry ``(g, j)`` is ``mask[m g + r, j]`` (``m <= 8``)."""
  rows, cols = mask.shape
  grouped = mask.reshape(rows // m, m, cols).astype(jnp.uint8)
  return (grouped << jnp.arange(m, dtype=jnp.uint8)[:, None]).sum(1, dtype=jnp.uint8)


def group_mask(bits: jax.Array, m: int) -> jax.Array:
  """Inverse of :func:`group_bits`: ``(R, C)`` uint8 -> the ``(R m, C)`` bool mask. Elementwise after a
  broadcast, so XLA fuses it into its consumer."""
  rows, cols = bits.shape
  full = jnp.broadcast_to(bits[:, None, :], (rows, m, cols)).reshape(rows * m, cols)
  return ((full >> (jnp.arange(rows * m, dtype=jnp.uint8) % m)[:, None]) & 1).astype(bool)


# One compiled function per shape instead of many small eager ops (the pairwise ranking unrolls m
# passes); under an outer jit these inline.
@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _nm_mask(w: jax.Array, n: int, m: int, axis: int) -> jax.Array:
  return _ungrouped(_group_mask(_grouped(_scores(w), axis, m), n), axis)


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
def _decompress(values: jax.Array, indices: jax.Array, n: int, m: int, axis: int) -> jax.Array:
  vals = jnp.moveaxis(values, axis, 0)
  groups = vals.shape[0] // n
  vals = vals.reshape(groups, n, *vals.shape[1:])
  pos = _positions(indices, n, m, axis, groups)
  lane = jnp.arange(m, dtype=pos.dtype).reshape((1, m) + (1,) * (pos.ndim - 2))
  dense = jnp.zeros((groups, m, *vals.shape[2:]), vals.dtype)
  for j in range(n):
    dense = jnp.where(pos[:, j : j + 1] == lane, vals[:, j : j + 1], dense)
  return _ungrouped(dense, axis)


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

  Args:
    values: kept values, of the dense dtype.
    indices: packed positions, of the unsigned dtype :func:`index_layout` gives for ``n``, ``m`` and the groups.
    shape: the dense shape.
    n, m: ``n`` kept of every ``m``, ``0 < n < m``; ``shape[axis]`` a multiple of ``m``.
    axis: the axis the groups run along (negative counts from the end).
    validate: check concrete ``indices`` with :meth:`validate` (skipped for traced arrays).

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
    self.values, self.indices = jnp.asarray(values), jnp.asarray(indices)
    self.shape, self.n, self.m, self.axis = shape, n, m, axis
    self._check_static(prefix="")
    if validate and is_concrete(self.indices):
      self.validate()

  def _check_static(self, *, prefix: str = "NMSparseMatrix.") -> NMSparseMatrix:
    """Checks the shapes of :attr:`values` and :attr:`indices` and the dtype of :attr:`indices` (static, so also
    under ``jit``); returns ``self``.

    The constructor runs it, and so do the methods that read the positions and :func:`jaxsparse.ops.nm_matmul`: a
    matrix rebuilt by ``jax.tree_util.tree_unflatten`` (``jax.tree.map`` over a model, a restored checkpoint) skips
    the constructor, and positions cast to another dtype (``tree.map(lambda a: a.astype(jnp.bfloat16), params)``)
    or re-shaped would otherwise be read silently wrong.
    """
    shape, n, m, axis = self.shape, self.n, self.m, self.axis
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
      0)``.

    Raises:
      ValueError: a bad ``n``, ``m`` or ``axis``, or ``w.shape[axis]`` not a multiple of ``m``.

    >>> import jax.numpy as jnp, jaxsparse
    >>> ws = jaxsparse.NMSparseMatrix.from_dense(jnp.array([[1.0, -4.0, 3.0, 2.0]]), 2, 4, axis=1)
    >>> ws.values, ws.positions()
    (Array([[-4.,  3.]], dtype=float32), Array([[1, 2]], dtype=uint8))
    """
    w, n, m, axis = _check_operand(w, n, m, axis)
    index_layout(n, m, w.shape[axis] // m)  # Fails early when the positions do not fit 32 bits.
    values, indices = _compress(w, n, m, axis)
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
    values = jnp.asarray(values)
    if values.shape != self.values.shape:
      raise ValueError(f"values must have shape {self.values.shape}, got {values.shape}.")
    return NMSparseMatrix(values, self.indices, shape=self.shape, n=self.n, m=self.m, axis=self.axis, validate=False)

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
    return _decompress(self.values, self.indices, self.n, self.m, self.axis)

  def __repr__(self) -> str:
    return (
        f"NMSparseMatrix(shape={self.shape}, {self.n}:{self.m}, axis={self.axis}, dtype={self.values.dtype}, "
        f"indices={self.indices.dtype}{tuple(self.indices.shape)})"
    )

