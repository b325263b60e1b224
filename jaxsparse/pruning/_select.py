"""Exact top-k masks without sorting: a bisection on the float bits of nonnegative scores.

Sorting millions of scores is slow on CPUs (and a large share of a layer solve); the ``k``-th largest
of nonnegative float32 scores is found instead by 31 counting passes of a bisection over their bit
patterns, which order like the floats (float64 scores: 63 passes over their 64-bit patterns). Ties at
the threshold go to the lower index, so the masks are those of a stable descending sort (as
:func:`jaxsparse.magnitude_mask` and :func:`jaxsparse.nm_mask`).
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


def keep_largest(scores: jax.Array, kept: jax.typing.ArrayLike, *, axis: int | None = None) -> jax.Array:
  """Bool mask of the ``kept`` largest ``scores`` (all of them, or along ``axis``; ties: lower index first).

  Args:
    scores: nonnegative float scores (NaN counts as the largest); compared in float32, float64 ones in float64.
    kept: how many to keep: an int, or with ``axis`` an int array of the shape of ``scores`` without
      ``axis`` (one count per slice). May be traced.
    axis: ``None`` for one count over the whole array, else the axis the counts run along.

  Returns:
    Bool array of ``scores.shape``.
  """
  if axis is None:
    return keep_largest(scores.reshape(-1), kept, axis=0).reshape(scores.shape)
  axis = axis % scores.ndim
  s = scores.astype(_utils.accumulation_dtype(scores.dtype))  # float32 (bfloat16, float16 widened), float64 kept
  int_type, inf_bits, passes = _BITS[s.dtype]
  bits = jax.lax.bitcast_convert_type(jnp.where(jnp.isnan(s), jnp.inf, jnp.maximum(s, 0.0)), int_type)
  kept = jnp.expand_dims(jnp.asarray(kept, jnp.int32), axis)

  def count_at_least(t):
    return jnp.sum(bits >= t, axis=axis, keepdims=True, dtype=jnp.int32)

  def step(_, bounds):
    lo, hi = bounds  # invariant: count(bits >= lo) >= kept > count(bits >= hi)
    mid = lo + (hi - lo) // 2
    ok = count_at_least(mid) >= kept
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  shape = kept.shape
  lo, _ = jax.lax.fori_loop(0, passes, step, (jnp.zeros(shape, int_type), jnp.full(shape, inf_bits + 1, int_type)))
  greater = bits > lo
  equal = bits == lo
  need = kept - jnp.sum(greater, axis=axis, keepdims=True, dtype=jnp.int32)
  keep = greater | (equal & (jnp.cumsum(equal, axis=axis, dtype=jnp.int32) <= need))
  return keep & (kept > 0)


def keep_largest_in_groups(scores: jax.Array, n: int, *, axis: int) -> jax.Array:
  """Keeps the ``n`` largest of every group along ``axis`` (a small axis: one pass per member; ties: lower index).

  NaN counts as the largest, as in :func:`keep_largest` (a NaN compares false both ways, so it would otherwise not
  count against the others and a group would keep ``n + 1``).
  """
  axis = axis % scores.ndim
  scores = jnp.where(jnp.isnan(scores), jnp.inf, scores)
  m = scores.shape[axis]
  rank = jnp.zeros(scores.shape, jnp.int32)
  pos = jnp.arange(m).reshape([m if i == axis else 1 for i in range(scores.ndim)])
  for k in range(m):
    sk = jax.lax.slice_in_dim(scores, k, k + 1, axis=axis)
    rank = rank + ((sk > scores) | ((sk == scores) & (k < pos))).astype(jnp.int32)
  return rank < n
