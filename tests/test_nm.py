"""N:M sparsity: nm_mask, NMSparseMatrix, sr_ste and nm_matmul (XLA path) against NumPy / dense references."""

from __future__ import annotations

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from jax import lax

import jaxsparse
from jaxsparse import NMSparseMatrix
from jaxsparse import nm_mask
from jaxsparse.formats._nm import index_layout
from jaxsparse.ops import nm_matmul
from jaxsparse.ops import nm_matmul_reference
from jaxsparse.ops import sr_ste
from jaxsparse.pallas import _nm_matmul as kernels
from tests._util import SPLIT_EXAMPLES
from tests._util import assert_close

_HIGHEST = lax.Precision.HIGHEST
NM_PAIRS = [(1, 2), (1, 4), (2, 4), (3, 4), (2, 8), (4, 8), (1, 8), (3, 16)]


def _normal(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _np_nm_mask(w, n, m, axis):
  """NumPy reference: per group, a stable sort of -|w| keeps the first n (ties: lower index)."""
  a = np.moveaxis(np.abs(np.asarray(w, np.float64)), axis, -1)
  g = a.reshape(*a.shape[:-1], a.shape[-1] // m, m)
  order = np.argsort(-g, axis=-1, kind="stable")
  keep = np.zeros(g.shape, bool)
  np.put_along_axis(keep, order[..., :n], True, axis=-1)
  return np.moveaxis(keep.reshape(a.shape), -1, axis)


def _with_ties(w, seed):
  """Rounds about half the entries to a few values so that groups contain ties."""
  rng = np.random.default_rng(seed)
  w = np.asarray(w, np.float32)
  tie = rng.random(w.shape) < 0.5
  return np.where(tie, np.round(w), w).astype(np.float32)


# -------------------------------------------------------------------------------------------------
# nm_mask.
# -------------------------------------------------------------------------------------------------


@st.composite
def _mask_problems(draw):
  n, m = draw(st.sampled_from(NM_PAIRS))
  ndim = draw(st.integers(1, 3))
  axis = draw(st.integers(-ndim, ndim - 1))
  shape = [draw(st.integers(1, 5)) for _ in range(ndim)]
  shape[axis] = m * draw(st.integers(1, 4))
  return n, m, axis, tuple(shape), draw(st.integers(0, 2**16))


@SPLIT_EXAMPLES  # 13 examples in the fast set, 13 more with `make test-slow`
@settings(max_examples=13, deadline=None)
@given(_mask_problems())
def test_nm_mask_matches_numpy_reference(examples, problem):
  n, m, axis, shape, seed = problem
  w = _with_ties(_normal(seed, shape), seed)
  mask = np.asarray(nm_mask(w, n, m, axis=axis))
  assert mask.shape == shape and mask.dtype == np.bool_
  np.testing.assert_array_equal(mask, _np_nm_mask(w, n, m, axis))
  per_group = np.moveaxis(mask, axis, -1).reshape(-1, m).sum(-1)
  assert np.all(per_group == n)


@pytest.mark.parametrize(("n", "m"), [(2, 64), (5, 40), (32, 64)])
def test_nm_mask_large_groups_argsort_path(n, m):
  w = _with_ties(_normal(1, (2 * m, 3)), 1)
  np.testing.assert_array_equal(np.asarray(nm_mask(w, n, m)), _np_nm_mask(w, n, m, 0))


def test_nm_mask_ties_go_to_lower_index():
  w = jnp.array([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [-2.0, 2.0, 2.0, -2.0]])
  expected = [[True, True, False, False], [True, True, False, False], [True, True, False, False]]
  np.testing.assert_array_equal(np.asarray(nm_mask(w, 2, 4, axis=1)), expected)


def test_nm_mask_nan_counts_as_largest_and_keeps_exactly_n():
  w = jnp.array([[0.5, jnp.nan, 3.0, jnp.nan], [jnp.nan] * 4])
  np.testing.assert_array_equal(
      np.asarray(nm_mask(w, 2, 4, axis=-1)), [[False, True, False, True], [True, True, False, False]]
  )


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.uint8])
@pytest.mark.parametrize("m", [4, 64])  # m = 64: the sorting path of wide groups
def test_nm_mask_ranks_integer_extremes_by_magnitude(dtype, m):
  info = np.iinfo(dtype)
  # The minimum of a signed type (int8 -128) has the largest magnitude, although its abs wraps around.
  head = [info.min, info.max, 3, 0] if info.min < 0 else [0, info.max, 3, 1]
  w = np.array(head + [2] * (m - 4), dtype)[:, None]
  expected = _np_nm_mask(w, 2, m, 0)
  np.testing.assert_array_equal(np.asarray(nm_mask(w, 2, m)), expected)
  kept = np.asarray(NMSparseMatrix.from_dense(w, 2, m).to_dense())
  np.testing.assert_array_equal(kept, np.where(expected, w, 0))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.int32])
def test_nm_mask_other_dtypes(dtype):
  w = _normal(3, (16, 8)) * 10
  mask = nm_mask(w.astype(dtype), 2, 4)
  np.testing.assert_array_equal(np.asarray(mask), _np_nm_mask(np.asarray(w.astype(dtype).astype(jnp.float32)), 2, 4, 0))


def test_nm_mask_under_jit_and_vmap():
  w = _normal(4, (3, 16, 8))
  f = jax.jit(nm_mask, static_argnums=(1, 2), static_argnames="axis")
  np.testing.assert_array_equal(np.asarray(f(w, 2, 4, axis=1)), _np_nm_mask(w, 2, 4, 1))
  v = jax.vmap(lambda a: nm_mask(a, 1, 4, axis=0))(w)
  np.testing.assert_array_equal(np.asarray(v), _np_nm_mask(w, 1, 4, 1))


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((2, 2), {}, ValueError, r"n=2 with m=2"),
        ((3, 2), {}, ValueError, r"n=3 with m=2"),
        ((0, 4), {}, ValueError, r"n=0 with m=4"),
        ((-1, 4), {}, ValueError, r"n=-1"),
        ((1, 1), {}, ValueError, r"m=1"),
        ((2, 3), {}, ValueError, r"m=3 must divide w.shape\[0\]=8"),
        ((2.0, 4), {}, TypeError, r"n must be an int, got n=2.0"),
        ((2, 4.0), {}, TypeError, r"m must be an int, got m=4.0"),
        ((True, 4), {}, TypeError, r"n must be an int, got n=True"),
        ((2, 4), {"axis": 2}, ValueError, r"axis=2 is out of range"),
        ((2, 4), {"axis": -3}, ValueError, r"axis=-3 is out of range"),
        ((2, 4), {"axis": 1.0}, TypeError, r"axis must be an int"),
    ],
)
def test_nm_mask_bad_arguments(args, kwargs, error, match):
  with pytest.raises(error, match=match):
    nm_mask(jnp.ones((8, 4)), *args, **kwargs)


def test_nm_mask_rejects_non_numeric():
  with pytest.raises(TypeError, match="numeric"):
    nm_mask(jnp.ones((8, 4), bool), 2, 4)


def test_scalar_w_is_named_0d_not_given_an_empty_range():
  # Was: "axis=0 is out of range for 0-D w (allowed: 0..-1)", a range with no value in it.
  for make in (lambda: nm_mask(jnp.float32(1.0), 2, 4), lambda: NMSparseMatrix.from_dense(jnp.float32(1.0), 2, 4)):
    with pytest.raises(ValueError, match=r"^w is 0-D \(a scalar\); N:M groups run along an axis of w, which needs at "
                                         r"least 1 \(got axis=0\)\.$"):
      make()


# -------------------------------------------------------------------------------------------------
# NMSparseMatrix.
# -------------------------------------------------------------------------------------------------


@functools.cache
def _np_doubly_nm_tiles(n: int, m: int) -> np.ndarray:
  """Brute force over all ``2^(m*m)`` 0/1 tiles: those with ``n`` per row and per column, ``(P, m, m)``."""
  bits = (np.arange(1 << (m * m))[:, None] >> np.arange(m * m)) & 1
  tiles = bits.astype(bool).reshape(-1, m, m)
  return tiles[(tiles.sum(1) == n).all(1) & (tiles.sum(2) == n).all(1)]


def _np_transposable_best(tile: np.ndarray, n: int) -> float:
  """The largest kept ``sum |w|`` of a tile over every pattern with ``n`` per row and per column."""
  return float((np.abs(tile)[None] * _np_doubly_nm_tiles(n, tile.shape[0])).sum((1, 2)).max())


@SPLIT_EXAMPLES  # 5 examples in the fast set, 5 more with `make test-slow`
@settings(max_examples=5, deadline=None)
@given(
    nm=st.sampled_from([(2, 4), (1, 4), (3, 4), (1, 2)]),
    tiles=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    axis=st.sampled_from([0, -2]),
    seed=st.integers(0, 2**16),
)
def test_transposable_mask_is_nm_both_ways_and_keeps_the_most(examples, nm, tiles, axis, seed):
  (n, m), (rows, cols) = nm, tiles
  lead = (2,) if axis == -2 else ()
  w = _normal(seed, (*lead, rows * m, cols * m))
  mask = np.asarray(nm_mask(w, n, m, axis=axis, transposable=True))
  assert mask.shape == w.shape
  t = mask.reshape(*lead, rows, m, cols, m)
  assert (t.sum(-3) == n).all() and (t.sum(-1) == n).all()  # n per group along axis and along the last axis
  a = np.abs(np.asarray(w, np.float64)).reshape(*lead, rows, m, cols, m)
  for idx in np.ndindex(*lead, rows, cols):
    *b, i, j = idx
    kept = float(a[(*b, i, slice(None), j, slice(None))][t[(*b, i, slice(None), j, slice(None))]].sum())
    best = _np_transposable_best(a[(*b, i, slice(None), j, slice(None))], n)
    np.testing.assert_allclose(kept, best, rtol=1e-6)
  # It is also a plain N:M mask along axis (what the compressed format and the forward's sparse cores need),
  # and never keeps more magnitude than the unconstrained plain mask.
  plain = np.asarray(nm_mask(w, n, m, axis=axis))
  assert np.abs(np.asarray(w))[mask].sum() <= np.abs(np.asarray(w))[plain].sum() * (1 + 1e-6)


def test_transposable_mask_ties_nan_dtypes_and_jit():
  # Ties: a constant tile keeps the first pattern of the fixed order, whatever the dtype or jit.
  first = np.asarray(nm_mask(jnp.ones((4, 4)), 2, 4, transposable=True))
  for w in (jnp.ones((4, 4), jnp.bfloat16), 3 * jnp.ones((4, 4), jnp.int32)):
    np.testing.assert_array_equal(np.asarray(nm_mask(w, 2, 4, transposable=True)), first)
  jitted = jax.jit(lambda w: nm_mask(w, 2, 4, transposable=True))
  np.testing.assert_array_equal(np.asarray(jitted(jnp.ones((4, 4)))), first)
  # NaN counts as the largest magnitude; the tile still keeps exactly 2 per row and column.
  w = np.array(_normal(3, (4, 8)))
  w[1, 6] = np.nan
  w[2, 0] = np.inf
  mask = np.asarray(nm_mask(jnp.asarray(w), 2, 4, transposable=True))
  assert mask[1, 6] and mask[2, 0]
  assert (mask.reshape(4, 2, 4).sum(-1) == 2).all() and (mask.sum(0) == 2).all()
  # vmap over a leading axis equals the mask of each slice.
  ws = _normal(4, (3, 8, 8))
  np.testing.assert_array_equal(
      np.asarray(jax.vmap(lambda w: nm_mask(w, 2, 4, transposable=True))(ws)),
      np.stack([np.asarray(nm_mask(w, 2, 4, transposable=True)) for w in ws]),
  )


@pytest.mark.parametrize(
    ("shape", "kwargs", "error", "match"),
    [
        ((16, 10), {}, ValueError, "divide w.shape\\[-1\\]=10"),
        ((16, 16), {"axis": 1}, ValueError, "second axis"),
        ((16,), {}, ValueError, "second axis"),
        ((16, 16), {"m": 8, "n": 4}, ValueError, "m <= 4"),
        ((16, 16), {"transposable": 1}, TypeError, "transposable must be a bool"),
    ],
)
def test_transposable_mask_bad_arguments(shape, kwargs, error, match):
  args = {"n": 2, "m": 4, "transposable": True, **kwargs}
  with pytest.raises(error, match=match):
    nm_mask(jnp.ones(shape), args.pop("n"), args.pop("m"), **args)


@st.composite
def _format_problems(draw):
  n, m = draw(st.sampled_from([*NM_PAIRS, (8, 16), (2, 64)]))
  ndim = draw(st.integers(1, 3))
  axis = draw(st.integers(0, ndim - 1))
  shape = [draw(st.integers(1, 4)) for _ in range(ndim)]
  shape[axis] = m * draw(st.integers(1, 6))
  return n, m, axis, tuple(shape), draw(st.integers(0, 2**16))


@SPLIT_EXAMPLES  # 5 examples in the fast set, 5 more with `make test-slow`
@settings(max_examples=5, deadline=None)
@given(_format_problems())
def test_format_round_trip(examples, problem):
  n, m, axis, shape, seed = problem
  w = _with_ties(_normal(seed, shape), seed)
  ws = NMSparseMatrix.from_dense(w, n, m, axis=axis)
  mask = _np_nm_mask(w, n, m, axis)
  np.testing.assert_array_equal(np.asarray(ws.to_dense()), np.where(mask, w, 0))
  np.testing.assert_array_equal(np.asarray(ws.mask()), mask)
  # Values: the kept entries of each group in increasing position; positions: where they sat.
  wm, km = np.moveaxis(w, axis, -1), np.moveaxis(mask, axis, -1)
  groups = wm.reshape(-1, m)
  keep = km.reshape(-1, m)
  kept_vals = np.stack([g[k] for g, k in zip(groups, keep, strict=True)])
  kept_pos = np.stack([np.nonzero(k)[0] for k in keep])
  vals = np.moveaxis(np.asarray(ws.values), axis, -1).reshape(-1, n)
  pos = np.moveaxis(np.asarray(ws.positions()), axis, -1).reshape(-1, n)
  np.testing.assert_array_equal(vals, kept_vals)
  np.testing.assert_array_equal(pos, kept_pos)
  assert ws.shape == shape and ws.values.shape[axis] == shape[axis] * n // m


def test_format_packs_two_2to4_groups_per_byte():
  ws = NMSparseMatrix.from_dense(_normal(0, (4096, 64), jnp.bfloat16), 2, 4)
  assert ws.values.shape == (2048, 64) and ws.indices.shape == (512, 64) and ws.indices.dtype == jnp.uint8
  # 2 bytes of value and 2 bits of position per kept weight: 56.25% of the dense bytes.
  assert ws.nbytes / (4096 * 64 * 2) == pytest.approx(0.5625)
  assert index_layout(2, 4, 1024) == (jnp.dtype(jnp.uint8), 2)
  assert index_layout(4, 8, 8) == (jnp.dtype(jnp.uint16), 1)
  assert index_layout(1, 4, 6) == (jnp.dtype(jnp.uint8), 3)  # 4 groups fit a byte; 3 divides 6


def test_format_bit_layout():
  # Word r packs groups r and r + 2 (4 groups, 2 per byte); position j of slot s at bit (s*n + j)*2.
  w = jnp.array(
      [[0, 5, 0, 6], [7, 0, 0, 8], [0, 0, 9, 1], [2, 3, 0, 0]],
      jnp.float32,
  ).reshape(16, 1)
  ws = NMSparseMatrix.from_dense(w, 2, 4)
  pos = [(1, 3), (0, 3), (2, 3), (0, 1)]
  word = lambda a, b: a[0] | a[1] << 2 | b[0] << 4 | b[1] << 6
  np.testing.assert_array_equal(np.asarray(ws.indices).ravel(), [word(pos[0], pos[2]), word(pos[1], pos[3])])
  np.testing.assert_array_equal(np.asarray(ws.values).ravel(), [5, 6, 7, 8, 9, 1, 2, 3])


def test_format_jit_pytree_and_with_values():
  w = _normal(1, (32, 8))
  ws = jax.jit(lambda a: NMSparseMatrix.from_dense(a, 2, 4))(w)
  leaves, tree = jax.tree_util.tree_flatten(ws)
  assert len(leaves) == 2
  back = jax.tree_util.tree_unflatten(tree, leaves)
  assert (back.shape, back.n, back.m, back.axis) == ((32, 8), 2, 4, 0)
  new = ws.with_values(ws.values * 2)
  np.testing.assert_array_equal(np.asarray(new.to_dense()), 2 * np.asarray(ws.to_dense()))
  assert ws.density == 0.5 and ws.dtype == jnp.float32 and "2:4" in repr(ws)


def test_format_to_dense_is_differentiable_in_values():
  ws = NMSparseMatrix.from_dense(_normal(2, (16, 4)), 2, 4)
  c = _normal(3, (16, 4))
  g = jax.grad(lambda v: jnp.sum(ws.with_values(v).to_dense() * c))(ws.values)
  c, mask = np.asarray(c), np.asarray(ws.mask())
  expected = np.stack([c[mask[:, j], j] for j in range(4)], axis=1)  # kept rows of each column, in order
  np.testing.assert_array_equal(np.asarray(g), expected)


def test_format_bad_arguments():
  w = jnp.ones((8, 4))
  ws = NMSparseMatrix.from_dense(w, 2, 4)
  with pytest.raises(ValueError, match=r"values must have shape \(4, 4\)"):
    NMSparseMatrix(jnp.ones((3, 4)), ws.indices, shape=(8, 4), n=2, m=4)
  with pytest.raises(ValueError, match="indices must be uint8"):
    NMSparseMatrix(ws.values, ws.indices.astype(jnp.int32), shape=(8, 4), n=2, m=4)
  with pytest.raises(ValueError, match=r"m=4 must divide shape.shape\[0\]=6|m=4 must divide"):
    NMSparseMatrix(ws.values, ws.indices, shape=(6, 4), n=2, m=4)
  with pytest.raises(ValueError, match=r"values must have shape"):
    ws.with_values(jnp.ones((8, 4)))
  with pytest.raises(ValueError, match="n=4 with m=4"):
    NMSparseMatrix.from_dense(w, 4, 4)
  with pytest.raises(ValueError, match="at most 32"):
    NMSparseMatrix.from_dense(jnp.ones((64, 2)), 12, 64)


# -------------------------------------------------------------------------------------------------
# sr_ste.
# -------------------------------------------------------------------------------------------------


_SR_STE_CONFIGS = [(2, 4, 0, (16, 8)), (1, 4, -2, (3, 3, 8, 5)), (4, 8, 1, (5, 16))]  # (n, m, axis, shape)
# The fast set has every config, every decay (0: the plain STE, no residuals; 2e-4: the default; 0.3: a decay term
# above bfloat16's rounding) and both dtypes; make test-slow runs the other decays of each config (long: moved out
# of the fast set, make test <= 15 min on 2 cores).
_SR_STE_FAST = {(2, 4, 0, (16, 8), 2e-4), (1, 4, -2, (3, 3, 8, 5), 0.3), (4, 8, 1, (5, 16), 0.0)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("n", "m", "axis", "shape", "decay"), [
    (*c, d) if (*c, d) in _SR_STE_FAST else pytest.param(*c, d, marks=pytest.mark.slow)
    for c, d in itertools.product(_SR_STE_CONFIGS, [0.0, 2e-4, 0.3])
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else None)
def test_sr_ste_forward_and_gradient_formula(dtype, n, m, axis, shape, decay):
  w = _normal(5, shape, dtype)
  c = _normal(6, shape, dtype)
  mask = nm_mask(w, n, m, axis=axis)
  out = sr_ste(w, n, m, decay=decay, axis=axis)
  assert out.dtype == dtype
  np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.where(mask, w, 0)))
  g = jax.grad(lambda w: jnp.sum(sr_ste(w, n, m, decay=decay, axis=axis).astype(jnp.float32) * c))(w)
  expected = c.astype(jnp.float32) + decay * (~mask) * w.astype(jnp.float32)
  assert g.dtype == dtype
  assert_close(g, expected, dtype)
  # Kept entries see exactly the straight-through gradient.
  np.testing.assert_array_equal(np.asarray(g)[np.asarray(mask)], np.asarray(c)[np.asarray(mask)])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sr_ste_transposable_forward_gradient_and_matmul(dtype):
  w = _normal(5, (16, 12), dtype)
  x = _normal(6, (2, 3, 16), dtype)
  mask = nm_mask(w, 2, 4, transposable=True)
  pruned = jnp.where(mask, w, jnp.zeros((), dtype))
  np.testing.assert_array_equal(np.asarray(sr_ste(w, 2, 4, transposable=True)), np.asarray(pruned))
  g = jax.grad(lambda w: jnp.sum(sr_ste(w, 2, 4, decay=0.1, transposable=True).astype(jnp.float32) ** 2))(w)
  expect = (2 * pruned.astype(jnp.float32) + jnp.where(mask, 0.0, 0.1 * w.astype(jnp.float32))).astype(dtype)
  assert_close(g, expect, dtype)
  # sr_ste_matmul: the value and gradients of x @ sr_ste(w, transposable=True), on the dense product.
  def ref(x, w):
    return jnp.sum(jnp.matmul(x, sr_ste(w, 2, 4, transposable=True)).astype(jnp.float32) ** 2)

  def fast(x, w):
    return jnp.sum(jaxsparse.ops.sr_ste_matmul(x, w, 2, 4, transposable=True).astype(jnp.float32) ** 2)

  for got, want in zip(jax.grad(fast, (0, 1))(x, w), jax.grad(ref, (0, 1))(x, w), strict=True):
    assert_close(got, want, dtype)
  if jax.default_backend() == "cpu":
    with pytest.raises(RuntimeError, match="'cusparselt' was requested but cannot run: JAX sees no CUDA device"):
      jaxsparse.ops.sr_ste_matmul(x, w, 2, 4, transposable=True, implementation="cusparselt")
    with pytest.raises(RuntimeError, match="'prune_kernel' was requested but cannot run"):
      jaxsparse.ops.sr_ste_matmul(x, w, 2, 4, implementation="prune_kernel")
  with pytest.raises(RuntimeError, match="'prune_kernel' was requested but cannot run: the pruning kernel takes 2:4"):
    jaxsparse.ops.sr_ste_matmul(x, w, 1, 4, implementation="prune_kernel")
  with pytest.raises(ValueError, match=r"implementation must be one of .*'prune_kernel'.*got implementation='cuda'"):
    jaxsparse.ops.sr_ste_matmul(x, w, 2, 4, implementation="cuda")
  with pytest.raises(ValueError, match=r"divide w\.shape"):
    sr_ste(jnp.ones((16, 10)), 2, 4, transposable=True)


def test_sr_ste_decay_zero_is_plain_ste_and_jit_vmap():
  w = _normal(7, (4, 16, 8))
  g = jax.jit(jax.vmap(jax.grad(lambda w: jnp.sum(sr_ste(w, 2, 4, decay=0.0) ** 2))))(w)
  mask = nm_mask(w, 2, 4, axis=1)
  np.testing.assert_allclose(np.asarray(g), np.asarray(2 * jnp.where(mask, w, 0)), rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"decay": -1.0}, ValueError, r"decay must be a float >= 0.*decay=-1.0"),
        ({"decay": True}, ValueError, r"decay=True"),
        ({"decay": float("inf")}, ValueError, r"decay must be a float >= 0 and finite.*decay=inf"),
        ({"decay": float("nan")}, ValueError, r"and finite.*decay=nan"),
        ({"decay": np.array([0.1])}, ValueError, r"decay=array\(\[0.1\]\)"),
        ({"decay": "0.1"}, ValueError, r"decay='0.1'"),
        ({"axis": 5}, ValueError, r"axis=5 is out of range"),
    ],
)
def test_sr_ste_bad_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    sr_ste(jnp.ones((8, 4)), 2, 4, **kwargs)


@pytest.mark.parametrize("decay", [jnp.float32(0.1), jnp.asarray(0.1), np.float64(0.1), np.array(0.1, np.float32)])
def test_sr_ste_decay_accepts_concrete_scalars_and_names_traced_ones(decay):
  w = _normal(8, (8, 4))
  want = jax.grad(lambda w: sr_ste(w, 2, 4, decay=0.1).sum())(w)
  np.testing.assert_allclose(jax.grad(lambda w: sr_ste(w, 2, 4, decay=decay).sum())(w), want, rtol=1e-6)
  x = jnp.ones((2, 8))
  got = jax.grad(lambda w: jaxsparse.ops.sr_ste_matmul(x, w, 2, 4, decay=decay).sum())(w)
  want = jax.grad(lambda w: jaxsparse.ops.sr_ste_matmul(x, w, 2, 4, decay=0.1).sum())(w)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  with pytest.raises(ValueError, match=r"decay must be a concrete number.*traced.*static"):
    jax.jit(lambda w, d: jaxsparse.ops.sr_ste_matmul(x, w, 2, 4, decay=d))(w, decay)
  with pytest.raises(ValueError, match="decay must be a concrete number"):
    jax.jit(lambda w, d: sr_ste(w, 2, 4, decay=d))(w, decay)


def test_sr_ste_rejects_integer_weights_and_bad_groups():
  with pytest.raises(TypeError, match="floating"):
    sr_ste(jnp.ones((8, 4), jnp.int32), 2, 4)
  with pytest.raises(ValueError, match=r"m=4 must divide w.shape\[0\]=6"):
    sr_ste(jnp.ones((6, 4)), 2, 4)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.bool_, "int32", "fp32"])
def test_sr_ste_matmul_refuses_a_non_floating_compute_dtype(dtype):
  # Was: an integer / bool dtype cast the pruned kernel to it (the product off x @ sr_ste(w) by up to 6.8 here) and
  # the gradient to w was all zeros, silently; a misspelt one failed in jnp.dtype without naming dtype=.
  w, x = _normal(0, (64, 32)), jnp.ones((3, 64))
  with pytest.raises(TypeError, match=rf"^dtype \(the pruned kernel's compute dtype\) must be a floating dtype .* "
                                      rf"got dtype={re.escape(repr(dtype))} "):
    jaxsparse.ops.sr_ste_matmul(x, w, 2, 4, dtype=dtype)
  y = jaxsparse.ops.sr_ste_matmul(x, w, 2, 4, dtype="bfloat16")  # floats, in any spelling, as before
  assert y.dtype == jnp.float32
  assert_close(y, x @ sr_ste(w, 2, 4).astype(jnp.bfloat16).astype(jnp.float32), jnp.bfloat16)


@pytest.mark.parametrize("x_dtype", [jnp.int32, jnp.int8, jnp.bool_])
def test_sr_ste_matmul_refuses_non_floating_x_as_the_other_products(x_dtype):
  # Was: an integer x was taken (nm_matmul, block_sparse_matmul, sparse_matmul and masked_matmul refuse it).
  w = _normal(0, (8, 4))
  with pytest.raises(TypeError, match=rf"^x must have a floating or complex dtype, got {jnp.dtype(x_dtype).name}\.$"):
    jaxsparse.ops.sr_ste_matmul(jnp.ones((2, 8), x_dtype), w, 2, 4)
  # Complex x and dtype stay supported (NMLinear computes in them as nnx.Linear does; tests/test_dtypes.py).
  x = jnp.ones((2, 8), jnp.complex64) * (1 + 2j)
  y = jaxsparse.ops.sr_ste_matmul(x, w, 2, 4, dtype=jnp.complex64)
  np.testing.assert_allclose(y, x @ sr_ste(w, 2, 4).astype(jnp.complex64), rtol=1e-6)


# -------------------------------------------------------------------------------------------------
# nm_matmul (XLA path; the Pallas kernel is tested in test_pallas_nm.py).
# -------------------------------------------------------------------------------------------------


def _dense_products(x, dy, ws):
  """``y``, ``dX`` and ``dvalues`` by autodiff of ``x @ ws.to_dense()`` in float32."""
  f32 = lambda a: a.astype(jnp.float32)

  def dense(x, v):
    return jnp.matmul(x, ws.with_values(v).to_dense(), precision=_HIGHEST)

  y, vjp = jax.vjp(dense, f32(x), f32(ws.values))
  return (y, *vjp(f32(dy)))


@st.composite
def _matmul_problems(draw):
  n, m = draw(st.sampled_from([(2, 4), (1, 4), (4, 8), (1, 2)]))
  k = m * draw(st.integers(1, 6))
  return n, m, draw(st.integers(1, 9)), k, draw(st.integers(1, 12)), draw(st.integers(0, 2**16))


@jax.jit
def _nm_matmul_and_reference(x, dy, ws):
  y, vjp = jax.vjp(lambda x, v: nm_matmul(x, ws.with_values(v), implementation="xla", precision=_HIGHEST), x,
                   ws.values)
  return (y, *vjp(dy)), _dense_products(x, dy, ws)


# bfloat16: long, moved out of the fast set (make test <= 15 min on 2 cores); CI runs it.
@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
@settings(max_examples=4, deadline=None)
@given(problem=_matmul_problems())
def test_nm_matmul_forward_and_gradients_match_dense(dtype, problem):
  n, m, rows, k, cols, seed = problem
  ws = NMSparseMatrix.from_dense(_normal(seed, (k, cols), dtype), n, m)
  x, dy = _normal(seed + 1, (rows, k), dtype), _normal(seed + 2, (rows, cols), dtype)
  (y, dx, dv), (y_ref, dx_ref, dv_ref) = _nm_matmul_and_reference(x, dy, ws)
  assert y.dtype == dx.dtype == dv.dtype == dtype
  assert_close(y, y_ref, dtype)
  assert_close(dx, dx_ref, dtype)
  assert_close(dv, dv_ref, dtype)


def test_nm_matmul_default_implementation_batch_dims_and_vmap():
  ws = NMSparseMatrix.from_dense(_normal(0, (32, 24)), 2, 4)
  x = _normal(1, (3, 5, 32))
  y = nm_matmul(x, ws, precision=_HIGHEST)  # a GPU's default float32 product rounds its inputs
  assert y.shape == (3, 5, 24)
  assert_close(y, nm_matmul_reference(x, ws, precision=_HIGHEST), jnp.float32)
  yv = jax.vmap(lambda a: nm_matmul(a, ws, precision=_HIGHEST))(x)
  assert_close(yv, y, jnp.float32)
  g = jax.vmap(jax.grad(lambda a: nm_matmul(a, ws, precision=_HIGHEST).sum()))(x)
  assert_close(g, jnp.broadcast_to(ws.to_dense().sum(1), x.shape), jnp.float32)


def test_nm_matmul_groups_along_columns_and_output_dtype():
  ws = NMSparseMatrix.from_dense(_normal(0, (12, 16)), 1, 4, axis=1)
  x = _normal(1, (4, 12), jnp.bfloat16)
  y = nm_matmul(x, ws, preferred_element_type=jnp.float32)
  assert y.dtype == jnp.float32
  assert_close(y, x.astype(jnp.float32) @ ws.to_dense(), jnp.bfloat16)


@pytest.mark.skipif(kernels.available(), reason="checks the CPU-only behaviour")
def test_nm_matmul_pallas_raises_without_gpu():
  ws = NMSparseMatrix.from_dense(_normal(0, (64, 32)), 2, 4)
  with pytest.raises(RuntimeError, match="implementation='pallas'"):
    nm_matmul(jnp.ones((2, 64)), ws, implementation="pallas")


@pytest.mark.parametrize(
    ("x", "w", "kwargs", "error", "match"),
    [
        (jnp.ones((2, 8)), jnp.ones((8, 4)), {}, TypeError, "w must be a jaxsparse.NMSparseMatrix, got ArrayImpl"),
        (jnp.ones((2, 8)), "3d", {}, ValueError, r"2-D \(K, N\)"),
        (jnp.ones((2, 12)), "2d", {}, ValueError, r"x must have shape \(..., K\) with K = w.shape\[0\] = 8"),
        (jnp.ones((2, 8), jnp.int32), "2d", {}, TypeError, "floating"),
        (jnp.ones((2, 8)), "2d", {"implementation": "cuda"}, ValueError, "implementation must be one of"),
    ],
)
def test_nm_matmul_bad_arguments(x, w, kwargs, error, match):
  if w == "2d":
    w = NMSparseMatrix.from_dense(jnp.ones((8, 4)), 2, 4)
  elif w == "3d":
    w = NMSparseMatrix.from_dense(jnp.ones((2, 8, 4)), 2, 4, axis=1)
  with pytest.raises(error, match=match):
    nm_matmul(x, w, **kwargs)


def test_nm_matmul_and_format_reject_positions_cast_by_a_tree_map():
  # A 4:8 weight with K = 24 packs its positions in uint16 words up to 4095; casting every leaf of a model to
  # bfloat16 rounds them (4012 -> 4000). No kernel path checks such a K, so the product was silently wrong.
  w = _normal(0, (24, 16))
  ws = NMSparseMatrix.from_dense(w, 4, 8)
  assert ws.indices.dtype == jnp.uint16 and int(ws.indices.max()) > 256
  cast = jax.tree.map(lambda a: a.astype(jnp.bfloat16), ws)  # skips the constructor's checks
  x = _normal(1, (3, 24))
  for f in (lambda: nm_matmul(x, cast), lambda: jax.jit(nm_matmul)(x, cast)):
    with pytest.raises(ValueError, match=r"w\.indices must be uint16 .* got bfloat16 .*were the positions cast"):
      f()
  for method in (cast.to_dense, cast.mask, cast.positions, cast.validate):
    with pytest.raises(ValueError, match=r"NMSparseMatrix\.indices must be uint16 .* got bfloat16"):
      method()
  # Casting only the values is the supported way, and gives the dense product of the cast weight.
  good = ws.with_values(ws.values.astype(jnp.bfloat16))
  dense = np.asarray(ws.to_dense().astype(jnp.bfloat16), np.float32)
  assert_close(nm_matmul(x, good), np.asarray(x) @ dense, jnp.bfloat16)  # a GPU may multiply in bfloat16


def test_public_exports():
  assert jaxsparse.nm_mask is nm_mask and jaxsparse.NMSparseMatrix is NMSparseMatrix
  assert {"nm_matmul", "nm_matmul_reference", "sr_ste"} <= set(jaxsparse.ops.__all__)
  assert functools.reduce(lambda a, b: a and b, [callable(f) for f in (nm_matmul, sr_ste, nm_mask)])


_BAD_PREFERRED = [("fp32", "not a dtype: str"), (jnp.int32, "dtype int32"), (3, "not a dtype: int"),
                  (object(), "not a dtype: object"), ("uint8", "dtype uint8")]


@pytest.mark.parametrize(("value", "what"), _BAD_PREFERRED)
@pytest.mark.parametrize("op", ["nm_matmul", "nm_matmul_reference", "sr_ste_matmul"])
def test_bad_preferred_element_type_names_the_argument(op, value, what):
  """A string that is no dtype failed deep in jnp.dtype; an int dtype computed in ints (truncating every output)."""
  x, w = _normal(0, (2, 16)), _normal(1, (16, 8))
  run = {"nm_matmul": lambda **kw: nm_matmul(x, NMSparseMatrix.from_dense(w, 2, 4), **kw),
         "nm_matmul_reference": lambda **kw: nm_matmul_reference(x, NMSparseMatrix.from_dense(w, 2, 4), **kw),
         "sr_ste_matmul": lambda **kw: jaxsparse.ops.sr_ste_matmul(x, w, 2, 4, **kw)}[op]
  with pytest.raises(TypeError, match=rf"preferred_element_type must be a floating dtype .* or None .*, got "
                                      rf"preferred_element_type={re.escape(repr(value))} \({what}\)"):
    run(preferred_element_type=value)


@pytest.mark.parametrize("value", ["float32", np.dtype("float32"), jnp.float32])
def test_preferred_element_type_any_spelling_of_a_floating_dtype(value):
  """Every spelling of a floating dtype is taken: bfloat16 operands give a float32 product."""
  x, w = _normal(2, (3, 16), jnp.bfloat16), _normal(3, (16, 8), jnp.bfloat16)
  pruned = jnp.where(nm_mask(w, 2, 4), w, 0).astype(jnp.float32)
  for y in (nm_matmul(x, NMSparseMatrix.from_dense(w, 2, 4), preferred_element_type=value),
            jaxsparse.ops.sr_ste_matmul(x, w, 2, 4, preferred_element_type=value)):
    assert y.dtype == jnp.float32
    assert_close(y, x.astype(jnp.float32) @ pruned, jnp.bfloat16)


def test_nm_matmul_complex_values_raise_naming_w_values():
  # Was: "preferred_element_type must be a floating dtype ..., got preferred_element_type=dtype('complex64')", an
  # argument nobody passed (as sparse_matmul raised before it named w.data).
  w = NMSparseMatrix.from_dense(_normal(0, (16, 8)).astype(jnp.complex64), 2, 4)
  with pytest.raises(TypeError, match=r"w.values must have a real dtype, got complex64; .*masked_matmul"):
    nm_matmul(_normal(1, (2, 16)), w)
