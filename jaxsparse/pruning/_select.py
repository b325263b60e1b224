"""Exact top-k masks without sorting: a bisection on the float bits of nonnegative scores.

Sorting millions of scores is slow on CPUs (and a large share of a layer solve); the ``k``-th largest
of nonnegative float32 scores is found instead by 31 counting passes of a bisection over their bit
patterns, which order like the floats (float64 scores: 63 passes over their 64-bit patterns). Ties at
the threshold go to the lower index, so the masks are those of a stable descending sort (as
:func:`jaxsparse.magnitude_mask` and :func:`jaxsparse.nm_mask`); with a ``tiebreak`` (Wanda's: ``|w|``), to the
largest ``tiebreak`` first, found by a second bisection among the tied ones, then to the lower index.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxsparse import _utils

# Per score dtype: the int type of its bit pattern, the pattern of +inf (above every finite nonnegative value) and
# the bisection passes that narrow [0, inf + 1] down to one pattern.
_BITS = {
    jnp.dtype(jnp.float32): (jnp.int32, 0x7F800000, 31),
    jnp.dtype(jnp.float64): (jnp.int64, 0x7FF0000000000000, 63),
}


def keep_largest(
    scores: jax.Array, kept: jax.typing.ArrayLike, *, axis: int | None = None, tiebreak: jax.Array | None = None
) -> jax.Array:
  """Bool mask of the ``kept`` largest ``scores`` (all of them, or along ``axis``; ties: lower index first).

  Args:
    scores: nonnegative float scores (NaN counts as the largest); compared in float32, float64 ones in float64.
    kept: how many to keep: an int, or with ``axis`` an int array of the shape of ``scores`` without
      ``axis`` (one count per slice). May be traced.
    axis: ``None`` for one count over the whole array, else the axis the counts run along.
    tiebreak: nonnegative float array of ``scores.shape`` (NaN the largest): among the scores tied at the threshold,
      the largest ``tiebreak`` are kept first (then the lower index).

  Returns:
    Bool array of ``scores.shape``.
  """
  if axis is None:
    flat_tiebreak = None if tiebreak is None else tiebreak.reshape(-1)
    return keep_largest(scores.reshape(-1), kept, axis=0, tiebreak=flat_tiebreak).reshape(scores.shape)
  axis = axis % scores.ndim
  kept = jnp.expand_dims(jnp.asarray(kept, jnp.int32), axis)
  bits = _bits(scores)
  if tiebreak is None:
    return _select(bits, kept, axis)
  # The scores tied at the threshold compete again, on ``tiebreak``, for the places the larger scores leave.
  greater, equal = _threshold(bits, kept, axis)
  need = kept - jnp.sum(greater, axis=axis, keepdims=True, dtype=jnp.int32)
  tied = jnp.where(equal, _bits(tiebreak), -1)  # -1: below every pattern the bisection counts (all >= 0)
  return (greater | (_select(tied, need, axis) & equal)) & (kept > 0)


def _bits(scores: jax.Array) -> jax.Array:
  """The bit patterns of nonnegative scores (NaN as +inf, negatives as 0), which order like the floats."""
  s = scores.astype(_utils.accumulation_dtype(scores.dtype))  # float32 (bfloat16, float16 widened), float64 kept
  int_type = _BITS[s.dtype][0]
  return jax.lax.bitcast_convert_type(jnp.where(jnp.isnan(s), jnp.inf, jnp.maximum(s, 0.0)), int_type)


def _select(bits: jax.Array, kept: jax.Array, axis: int) -> jax.Array:
  """The ``kept`` largest ``bits`` along ``axis`` (ties: lower index first)."""
  greater, equal = _threshold(bits, kept, axis)
  need = kept - jnp.sum(greater, axis=axis, keepdims=True, dtype=jnp.int32)
  return (greater | (equal & (jnp.cumsum(equal, axis=axis, dtype=jnp.int32) <= need))) & (kept > 0)


def _threshold(bits: jax.Array, kept: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """``(greater, equal)``: the patterns above the ``kept``-th largest along ``axis`` and those equal to it (negative
  patterns are never counted)."""
  int_type = bits.dtype
  inf_bits, passes = next((b, p) for t, b, p in _BITS.values() if jnp.dtype(t) == int_type)

  def count_at_least(t):
    return jnp.sum(bits >= t, axis=axis, keepdims=True, dtype=jnp.int32)

  def step(_, bounds):
    lo, hi = bounds  # invariant: count(bits >= lo) >= kept > count(bits >= hi)
    mid = lo + (hi - lo) // 2
    ok = count_at_least(mid) >= kept
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  shape = kept.shape
  lo, _ = jax.lax.fori_loop(0, passes, step, (jnp.zeros(shape, int_type), jnp.full(shape, inf_bits + 1, int_type)))
  return bits > lo, bits == lo


def keep_largest_in_groups(
    scores: jax.Array, n: int, *, axis: int, tiebreak: jax.Array | None = None
) -> jax.Array:
  """Keeps the ``n`` largest of every group along ``axis`` (a small axis: one pass per member; ties: the larger
  ``tiebreak`` first, of ``scores.shape``, where given; then the lower index).

  NaN counts as the largest, as in :func:`keep_largest` (a NaN compares false both ways, so it would otherwise not
  count against the others and a group would keep ``n + 1``); so in ``tiebreak``.
  """
  axis = axis % scores.ndim
  scores = jnp.where(jnp.isnan(scores), jnp.inf, scores)
  tiebreak = jnp.zeros_like(scores) if tiebreak is None else jnp.where(jnp.isnan(tiebreak), jnp.inf, tiebreak)
  m = scores.shape[axis]
  rank = jnp.zeros(scores.shape, jnp.int32)
  pos = jnp.arange(m).reshape([m if i == axis else 1 for i in range(scores.ndim)])
  for k in range(m):
    sk = jax.lax.slice_in_dim(scores, k, k + 1, axis=axis)
    tk = jax.lax.slice_in_dim(tiebreak, k, k + 1, axis=axis)
    ahead = (sk > scores) | ((sk == scores) & ((tk > tiebreak) | ((tk == tiebreak) & (k < pos))))
    rank = rank + ahead.astype(jnp.int32)
  return rank < n
