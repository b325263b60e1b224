"""N:M structured sparsity: the masks (which ``n`` of every ``m`` entries are kept) and their checks.

In N:M sparsity every group of ``m`` consecutive weights along one axis keeps ``n`` of them. For a
Flax kernel the groups run along the input features: axis 0 of a ``(in, out)`` Dense kernel and
the ``cin`` axis (-2) of a ``(kh, kw, cin, cout)`` Conv kernel. That is the grouping of PyTorch's
input dimension in apex ASP and ``torch.sparse.to_sparse_semi_structured`` (2:4).

What lives here: the argument checks (:func:`check_nm`, :func:`check_axis`, :func:`check_groups`,
:func:`check_transposable`), the magnitude mask :func:`nm_mask`, the transposable tile patterns
(:func:`transposable_pattern`, :func:`tile_mask`) and a group's kept entries as one word of bits
(:func:`nm_group_bits`, :func:`group_bits`, :func:`group_mask`, which SR-STE's pruning shares with its
kernels). The compressed format :class:`~jaxsparse.NMSparseMatrix` and its position packing are in
``jaxsparse/formats/_nm.py``.
"""

from __future__ import annotations

import functools
import itertools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsparse import _utils

__all__ = [
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
  if ndim == 0:
    raise ValueError(f"w is 0-D (a scalar); N:M groups run along an axis of w, which needs at least 1 "
                     f"(got {name}={axis}).")
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
  w = _utils.as_array(w, name="w")
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
