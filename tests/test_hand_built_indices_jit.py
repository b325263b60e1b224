"""Hand-built sparse formats whose index arrays never met ``validate()``: never a finite wrong number.

Index arrays get into the ops unchecked when they are traced (a matrix built inside a ``jit`` from traced arrays, or
passed as a ``jit`` argument), or when a matrix is rebuilt without its constructor (``jax.tree_util.tree_unflatten``,
``jax.tree.map`` over a model, a restored checkpoint). Gathers and scatters clamp or drop such indices; now
``to_dense`` of such a matrix (and so the XLA routes of ``sparse_matmul`` and ``nm_matmul``, those of
``block_sparse_matmul`` on the CPU, and their gradients) is NaN, an N:M matrix's only in the groups whose positions are
invalid. Valid hand-built matrices still match the dense
reference, forward and gradient, in float32. (The block-sparse Pallas kernels and the CSR C++ kernels do not run the
whole check: it would cost a decode-size product as much again, or 4x on the CPU. The block-sparse C++ kernels check
that the index arrays they read agree with the others, in one pass over the kept blocks.)
"""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsparse
from jaxsparse import _tuning
from jaxsparse import ops
from jaxsparse._tuning import _cache
from jaxsparse._tuning import _measure
from jaxsparse.formats import _nm as nm_format
from tests._util import assert_close


@pytest.fixture(autouse=True)
def _quiet_fallbacks_on_the_cpu():
  """The CPU routes (the C++ kernels, the XLA paths this file is about) at full float32 precision, also on a machine
  whose default device is a GPU (whose N:M kernels read the positions themselves)."""
  with warnings.catch_warnings(), jax.default_device(jax.devices("cpu")[0]), jax.default_matmul_precision("highest"):
    warnings.simplefilter("ignore", jaxsparse.FallbackWarning)
    yield


def _rng():
  return np.random.default_rng()  # fresh data on every run


def _spoil(idx: dict, field: str, how: str, rng) -> dict:
  """A copy of ``idx`` with ``field`` made invalid: ``how`` is ``"past"`` (one entry past the grid), ``"negative"``,
  ``"swap"`` (two entries swapped: unsorted, or a wrong permutation), ``"repeat"`` (an entry repeated)."""
  out = {k: np.array(v) for k, v in idx.items()}
  a = out[field]
  # An entry whose next one differs, so that every spoil changes the array (an offset repeated inside a run of
  # empty rows would not).
  i = int(rng.choice(np.flatnonzero(a[1:] != a[:-1])))
  if how == "past":
    a[i] = a.max() + 1 + int(rng.integers(0, 40))
  elif how == "negative":
    a[i] = -1 - int(rng.integers(0, 3))
  elif how == "swap":
    j = next(j for j in range(a.shape[0]) if a[j] != a[i])
    a[i], a[j] = a[j], a[i]
  else:
    a[i + 1] = a[i]
  return out


def _assert_nan_or_error(run, *, everywhere=True):
  """``run()`` raises an error naming a bad index array, or its float results are NaN (``everywhere``, else at least
  one NaN in each: ``dX`` is zero where ``x`` meets no stored entry, as for a valid matrix): never finite numbers."""
  try:
    results = jax.block_until_ready(run())
  except Exception as e:  # the C++ kernels' own run-time checks (XlaRuntimeError)
    named = ("has entries outside", "is not an offset array", "is not a permutation", "put block",
             "does not list its blocks")
    assert any(m in str(e) for m in named), e
    return
  for r in jax.tree.leaves(results):
    nan = np.isnan(np.asarray(r))
    assert nan.all() if everywhere else nan.any(), np.asarray(r)


def _leaves(w, idx):
  """``w`` rebuilt with ``tree_unflatten`` from its data and the index arrays ``idx`` (as a checkpoint restore does)."""
  return jax.tree_util.tree_unflatten(jax.tree.structure(w), [w.data] + [jnp.asarray(idx[f]) for f in w.INDEX_FIELDS])


# -------------------------------------------------------------------------------------------------
# BlockSparseMatrix: to_dense of 4 x 4 and 8 x 8 blocks.
# -------------------------------------------------------------------------------------------------

BLOCK_SPOILS = [("row_indices", "past"), ("col_indices", "negative"), ("transpose_order", "past"),
                ("row_indices", "repeat"), ("col_indices", "swap"), ("transpose_order", "swap"),
                ("row_offsets", "swap"), ("col_offsets", "repeat")]


def _block(rng, block):
  kb, nb = 4, 5
  mask = rng.random((kb, nb)) < 0.6
  mask[0, :2] = mask[1, 0] = mask[2, 1] = True  # a few blocks in a row and in a column whatever the draw
  w = rng.standard_normal((kb * block, nb * block)).astype(np.float32)
  return jaxsparse.BlockSparseMatrix.from_dense(w, (block, block), block_mask=mask)


@pytest.mark.parametrize("block", [4, 8])
def test_block_sparse_to_dense_of_bad_indices_gives_nan(block):
  """``to_dense`` of index arrays that never met ``validate()``: NaN, not a matrix with blocks clamped or dropped.
  (The products do not check them under ``jit``: the check costs more than a decode product; see ``validate``.)"""
  rng = _rng()
  w = _block(rng, block)
  shape = dict(shape=w.shape, block_shape=w.block_shape)
  # Built inside a jit from traced index arrays (from_index_arrays checks only shapes and dtypes there).
  built_in_jit = jax.jit(lambda data, idx: jaxsparse.BlockSparseMatrix.from_index_arrays(data, idx, **shape).to_dense())
  to_dense = jax.jit(lambda m: m.to_dense())
  for field, how in BLOCK_SPOILS:  # one pattern: each function compiles once
    bad = _spoil(w.index_arrays(), field, how, rng)
    _assert_nan_or_error(lambda bad=bad: built_in_jit(w.data, bad))
    # Rebuilt without the constructor (a restored checkpoint), as a jit argument.
    _assert_nan_or_error(lambda bad=bad: to_dense(_leaves(w, bad)))


def test_block_sparse_tree_map_replacing_leaves_gives_nan():
  """``jax.tree.map`` over a matrix replaces its index leaves too (here: shifted by one block row)."""
  rng = _rng()
  w = _block(rng, 4)
  shifted = jax.tree.map(lambda a: a + 1 if a.dtype == jnp.int32 else a, w)
  assert np.isnan(np.asarray(jax.jit(lambda m: m.to_dense())(shifted))).all()


# -------------------------------------------------------------------------------------------------
# CSRMatrix: to_dense.
# -------------------------------------------------------------------------------------------------

CSR_SPOILS = [("row_indices", "negative"), ("col_indices", "past"), ("col_indices", "swap"),
              ("row_indices", "repeat"), ("transpose_order", "swap"), ("transpose_row_indices", "swap"),
              ("row_offsets", "repeat"), ("col_offsets", "swap")]


def _csr(rng, density=0.3):
  w = rng.standard_normal((16, 24)).astype(np.float32)
  return jaxsparse.CSRMatrix.from_dense(w, mask=rng.random(w.shape) < density)


def test_csr_to_dense_of_bad_indices_gives_nan():
  rng = _rng()
  w = _csr(rng)
  built_in_jit = jax.jit(lambda data, idx: jaxsparse.CSRMatrix.from_index_arrays(data, idx, shape=w.shape).to_dense())
  to_dense = jax.jit(lambda m: m.to_dense())
  for field, how in CSR_SPOILS:
    bad = _spoil(w.index_arrays(), field, how, rng)
    _assert_nan_or_error(lambda bad=bad: built_in_jit(w.data, bad))
    _assert_nan_or_error(lambda bad=bad: to_dense(_leaves(w, bad)))


# -------------------------------------------------------------------------------------------------
# NMSparseMatrix: positions past m - 1 (m not a power of two) and repeated / unsorted positions.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "m", "how"), [(1, 3, "past"), (2, 3, "past"), (2, 4, "repeat"), (2, 4, "swap"),
                                             (3, 8, "repeat")])
@pytest.mark.parametrize("axis", [0, 1])
def test_nm_bad_positions_give_nan_in_their_group(n, m, how, axis):
  rng = _rng()
  shape = (4 * m, 8) if axis == 0 else (8, 4 * m)
  w = jaxsparse.NMSparseMatrix.from_dense(rng.standard_normal(shape).astype(np.float32), n, m, axis=axis)
  pos = np.moveaxis(np.array(w.positions()), axis, 0).reshape(4, n, -1)  # (groups, n, other axis)
  g, o = int(rng.integers(0, 4)), int(rng.integers(0, pos.shape[2]))
  if how == "past":
    pos[g, n - 1, o] = m  # fits the ceil(log2 m) bits: m = 3 has 2
  elif how == "repeat":
    pos[g, 1, o] = pos[g, 0, o]
  else:
    pos[g, 0, o], pos[g, 1, o] = pos[g, 1, o], pos[g, 0, o]
  bad = jax.tree_util.tree_unflatten(jax.tree.structure(w),
                                     [w.values, jnp.moveaxis(nm_format._pack(jnp.asarray(pos), n, m), 0, axis)])
  dense = np.array(jax.jit(lambda a: a.to_dense())(bad))
  group = (slice(g * m, (g + 1) * m), o) if axis == 0 else (o, slice(g * m, (g + 1) * m))
  assert np.isnan(dense[group]).all()
  dense[group] = 0
  ref = np.array(w.to_dense())
  ref[group] = 0
  np.testing.assert_array_equal(dense, ref)  # the other groups are untouched
  if axis == 0:  # the product (K, N): the bad group's output column is NaN, the others exact
    x = rng.standard_normal((5, shape[0])).astype(np.float32)
    y = np.asarray(jax.jit(ops.nm_matmul)(x, bad))
    assert np.isnan(y[:, o]).all()
    np.testing.assert_allclose(np.delete(y, o, 1), np.delete(x @ ref, o, 1), rtol=1e-5, atol=1e-5)
    dx, dv = jax.jit(jax.grad(lambda x, v: jnp.sum(ops.nm_matmul(x, bad.with_values(v)) ** 2), (0, 1)))(x, w.values)
    assert np.isnan(np.asarray(dx)).all() and np.isnan(np.asarray(dv)).any()


# -------------------------------------------------------------------------------------------------
# Valid hand-built matrices under jit: the dense reference, forward and gradient, in float32.
# -------------------------------------------------------------------------------------------------


def _check_against_dense(op, x, w, make, *, implementation=None):
  """``op`` on ``make(data, index arrays)`` built inside a ``jit`` against ``x @ w.to_dense()``, forward and grads.

  The whole output is compared (a scalar loss such as ``sum(sin(y))`` cancels, and its relative error is not the
  product's), and the gradients are those of ``sum(y * g)`` for a random cotangent ``g``.
  """
  idx = w.index_arrays()
  kw = {} if implementation == "default" else {"implementation": implementation}
  apply = jax.jit(lambda x, d, i: op(x, make(d, i), **kw))
  ref = lambda x, d: x @ w.with_data(d).to_dense()
  assert_close(apply(x, w.data, idx), ref(x, w.data), jnp.float32)
  g = np.random.default_rng().standard_normal((x.shape[0], w.shape[1])).astype(np.float32)
  loss = jax.jit(lambda x, d, i: jnp.sum(apply(x, d, i) * g))
  for got, want in zip(jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w.data, idx),
                       jax.grad(lambda x, d: jnp.sum(ref(x, d) * g), argnums=(0, 1))(x, w.data), strict=True):
    assert_close(got, want, jnp.float32)


@pytest.mark.parametrize("block", [4, 8])
@pytest.mark.parametrize("implementation", ["default", pytest.param("xla", marks=pytest.mark.slow)])
def test_valid_block_sparse_built_in_jit_matches_dense(block, implementation):
  rng = _rng()
  w = _block(rng, block)
  x = rng.standard_normal((7, w.shape[0])).astype(np.float32)
  make = lambda d, i: jaxsparse.BlockSparseMatrix.from_index_arrays(d, i, shape=w.shape, block_shape=w.block_shape)
  _check_against_dense(ops.block_sparse_matmul, x, w, make, implementation=implementation)
  # vmap over a stack of matrices of one pattern.
  datas = jnp.stack([w.data, 2 * w.data])
  ys = jax.jit(jax.vmap(lambda d: ops.block_sparse_matmul(x, w.with_data(d))))(datas)
  assert_close(ys[1], 2 * (x @ w.to_dense()), jnp.float32)


@pytest.mark.parametrize("implementation", ["default", pytest.param("xla", marks=pytest.mark.slow), "cpu"])
@pytest.mark.parametrize("rows", [3, 12])
def test_valid_csr_built_in_jit_matches_dense(implementation, rows):
  rng = _rng()
  w = _csr(rng)
  x = rng.standard_normal((rows, 16)).astype(np.float32)
  make = lambda d, i: jaxsparse.CSRMatrix.from_index_arrays(d, i, shape=w.shape)
  _check_against_dense(ops.sparse_matmul, x, w, make, implementation=None if implementation == "default"
                       else implementation)


def test_valid_edge_patterns_are_not_poisoned():
  """Empty rows / columns at both ends, one entry, no entry, every entry: the checks accept them."""
  rng = _rng()
  masks = [np.zeros((6, 5), bool), np.ones((6, 5), bool), np.eye(6, 5, k=2, dtype=bool)]
  one = np.zeros((6, 5), bool)
  one[5, 4] = True
  for mask in [*masks, one]:
    wd = rng.standard_normal(mask.shape).astype(np.float32)
    w = jaxsparse.CSRMatrix.from_dense(wd, mask=mask)
    got = jax.jit(lambda m: m.to_dense())(_leaves(w, w.index_arrays()))
    np.testing.assert_array_equal(got, np.where(mask, wd, 0))
    b = jaxsparse.BlockSparseMatrix.from_dense(np.kron(wd, np.ones((2, 2), np.float32)), (2, 2), block_mask=mask)
    x = rng.standard_normal((3, 12)).astype(np.float32)
    y = jax.jit(ops.block_sparse_matmul)(x, _leaves(b, b.index_arrays()))
    np.testing.assert_allclose(y, x @ np.asarray(b.to_dense()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("n", "m"), [(2, 4), (1, 3)])
def test_valid_nm_built_in_jit_matches_dense(n, m):
  rng = _rng()
  w = jaxsparse.NMSparseMatrix.from_dense(rng.standard_normal((8 * m, 12)).astype(np.float32), n, m)
  x = rng.standard_normal((5, 8 * m)).astype(np.float32)
  # The whole product, and the gradients of a random cotangent (a scalar such as sum(sin(y)) cancels).
  apply = jax.jit(lambda x, v, i: ops.nm_matmul(x, jaxsparse.NMSparseMatrix(v, i, shape=w.shape, n=n, m=m)))
  ref = lambda x, v: x @ w.with_values(v).to_dense()
  assert_close(apply(x, w.values, w.indices), ref(x, w.values), jnp.float32)
  g = rng.standard_normal((x.shape[0], w.shape[1])).astype(np.float32)
  got = jax.jit(jax.grad(lambda x, v, i: jnp.sum(apply(x, v, i) * g), argnums=(0, 1)))(x, w.values, w.indices)
  want = jax.grad(lambda x, v: jnp.sum(ref(x, v) * g), argnums=(0, 1))(x, w.values)
  for a, b in zip(got, want, strict=True):
    assert_close(a, b, jnp.float32)


def test_constructors_vouch_for_their_index_arrays_and_only_they():
  """A matrix a constructor validated or built from a mask skips the check (``to_dense`` as fast as before); one
  rebuilt by ``tree_unflatten`` (a jit argument, a checkpoint) or given new index arrays is checked."""
  rng = _rng()
  w = _block(rng, 4)
  assert w._trusted and w.with_data(w.data * 2)._trusted
  assert jaxsparse.BlockSparseMatrix.from_index_arrays(w.data, w.index_arrays(), shape=w.shape,
                                                       block_shape=w.block_shape)._trusted
  assert not jaxsparse.BlockSparseMatrix.from_index_arrays(w.data, w.index_arrays(), shape=w.shape,
                                                           block_shape=w.block_shape, validate=False)._trusted
  rebuilt = _leaves(w, w.index_arrays())
  assert not getattr(rebuilt, "_trusted", False)
  np.testing.assert_array_equal(rebuilt.to_dense(), w.to_dense())  # valid: the same matrix, checked
  spoiled = _leaves(w, w.index_arrays())
  spoiled.row_indices = spoiled.row_indices.at[0].set(99)
  assert np.isnan(np.asarray(spoiled.to_dense())).all()
  w.col_indices = w.col_indices.at[0].set(-1)  # a trusted matrix given new index arrays is checked again
  assert not w._trusted and np.isnan(np.asarray(w.to_dense())).all()
  assert jaxsparse.CSRMatrix.from_dense(rng.standard_normal((4, 6)).astype(np.float32))._trusted


@pytest.mark.parametrize("field", ["transpose_order", "row_indices", "col_indices"])
@pytest.mark.parametrize("how", ["swap", "repeat"])
def test_block_sparse_cpu_kernels_refuse_index_arrays_that_disagree(field, how):
  """In-range index arrays that describe another matrix than to_dense's (a repeated transpose_order entry, a block
  moved to another row or column) gave finite, wrong products and gradients on the C++ kernels (8 x 8 blocks): each
  kernel reads some of the arrays; it now checks them against the others (one pass over the kept blocks)."""
  rng = _rng()
  w = _block(rng, 8)
  bad = _leaves(w, _spoil(w.index_arrays(), field, how, rng))
  x = jnp.asarray(rng.standard_normal((3, w.shape[0])), jnp.float32)
  ref = np.asarray(bad.to_dense())
  if not np.isnan(ref).any():  # the spoiled arrays happen to describe a valid matrix: it must be that one
    np.testing.assert_allclose(np.asarray(ops.block_sparse_matmul(x, bad)), np.asarray(x) @ ref,
                               rtol=1e-5, atol=1e-5)
    return
  for run in (lambda: ops.block_sparse_matmul(x, bad),
              lambda: jax.grad(lambda x, d: jnp.sum(ops.block_sparse_matmul(x, bad.with_data(d))
                                                    ** 2), (0, 1))(x, bad.data)):
    with pytest.raises(Exception, match=r"is not a permutation|put block|does not list its blocks"):
      jax.block_until_ready(run())


@pytest.mark.parametrize("route", ["loop", "dense"])
def test_block_sparse_cpu_xla_routes_give_nan_for_bad_index_arrays(route, monkeypatch, tmp_path):
  """The CPU's XLA routes of ``block_sparse_matmul`` (the block loop, the dense route) read the index arrays as they
  are: a bad one gave finite wrong products and gradients there while the C++ kernels raised, and which of them ran
  was a timing decision. Both now give NaN, as ``to_dense``; a valid matrix still gives the dense reference."""
  monkeypatch.setenv(_cache.ENV_PATH, str(tmp_path / "autotune.json"))
  _cache.clear_memo()
  # Every direction takes `route`, as a measurement that timed it fastest would (also where the CPU is not the
  # default backend, which a real measurement requires: this file runs on the CPU device everywhere).
  monkeypatch.setattr(_measure, "_measure", lambda cands, *a: {c.name: 1.0 if c.name == route else 2.0 for c in cands})
  monkeypatch.setattr(_measure, "_has_device", lambda platform: platform == "cpu")
  rng = _rng()
  w = _block(rng, 8)  # 8 x 8 blocks: the C++ kernels could run them too; the timing says otherwise
  x = jnp.asarray(rng.standard_normal((3, w.shape[0])), jnp.float32)

  def step(x, w):
    return jax.value_and_grad(lambda x, d: jnp.sum(ops.block_sparse_matmul(x, w.with_data(d)) ** 2), (0, 1))(x, w.data)

  try:
    with _tuning.autotune_mode("tune"):
      run = jax.jit(step)
      value, (dx, _) = run(x, w)
      dense = np.asarray(w.to_dense())
      ref = np.asarray(x) @ dense
      assert_close(value, np.sum(ref**2), jnp.float32)
      assert_close(dx, 2 * ref @ dense.T, jnp.float32)
      chosen = {e["choice"] for e in json.loads(_cache.cache_path().read_text())["entries"].values()}
      assert chosen == {route}, chosen
      for field, how in BLOCK_SPOILS:
        bad = _leaves(w, _spoil(w.index_arrays(), field, how, rng))
        if not np.isnan(np.asarray(bad.to_dense())).any():  # the spoiled arrays happen to describe a valid matrix
          continue
        _assert_nan_or_error(lambda bad=bad: run(x, bad))
  finally:
    _cache.clear_memo()
