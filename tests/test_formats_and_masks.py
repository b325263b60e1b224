"""BlockSparseMatrix construction, pytree behaviour and the mask functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import jaxsparse
from jaxsparse.formats import _nm_masks
from jaxsparse.formats._block_sparse import block_pattern_indices
from jaxsparse.ops import masked_matmul
from tests._util import SPLIT_EXAMPLES
from tests._util import assert_close


def _expand(mask, block_shape):
  return np.repeat(np.repeat(np.asarray(mask), block_shape[0], 0), block_shape[1], 1)


@SPLIT_EXAMPLES  # 13 examples in the fast set, 13 more with `make test-slow`
@settings(max_examples=13, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    kb=st.integers(1, 6),
    nb=st.integers(1, 6),
    bk=st.sampled_from([8, 16, 32]),
    bn=st.sampled_from([8, 16, 32]),
    p=st.floats(0.0, 1.0),
)
def test_from_dense_roundtrip_and_indices(examples, seed, kb, nb, bk, bn, p):
  rng = np.random.default_rng(seed)
  mask = rng.random((kb, nb)) < p
  w = rng.standard_normal((kb * bk, nb * bn)).astype(np.float32)
  ws = jaxsparse.BlockSparseMatrix.from_dense(w, (bk, bn), block_mask=mask)
  assert ws.shape == w.shape and ws.block_shape == (bk, bn)
  assert ws.nnz_blocks == mask.sum() and ws.data.shape == (mask.sum(), bk, bn)
  assert ws.density == pytest.approx(mask.mean())
  np.testing.assert_array_equal(ws.block_mask, mask)
  np.testing.assert_array_equal(ws.to_dense(), np.where(_expand(mask, (bk, bn)), w, 0))
  # Index invariants: row-major data order, CSR/CSC offsets, transpose order is column-major.
  rows, cols = np.asarray(ws.row_indices), np.asarray(ws.col_indices)
  np.testing.assert_array_equal(np.asarray(ws.row_offsets), np.r_[0, np.cumsum(mask.sum(1))])
  np.testing.assert_array_equal(np.asarray(ws.col_offsets), np.r_[0, np.cumsum(mask.sum(0))])
  t = np.asarray(ws.transpose_order)
  assert sorted(t.tolist()) == list(range(ws.nnz_blocks))
  assert np.all(np.diff(cols[t] * kb + rows[t]) > 0) if ws.nnz_blocks > 1 else True
  # Without a mask, from_dense keeps exactly the nonzero blocks.
  ws2 = jaxsparse.BlockSparseMatrix.from_dense(ws.to_dense(), (bk, bn))
  np.testing.assert_array_equal(ws2.block_mask, mask & np.any(w.reshape(kb, bk, nb, bn) != 0, axis=(1, 3)))


def test_pytree_jit_and_with_data():
  w = jax.random.normal(jax.random.key(0), (64, 32))
  ws = jaxsparse.BlockSparseMatrix.from_dense(w, (16, 16), block_mask=np.array([[1, 0]] * 2 + [[0, 1]] * 2, bool))
  leaves, _tree = jax.tree_util.tree_flatten(ws)
  assert len(leaves) == 1 + len(jaxsparse.formats._block_sparse.INDEX_FIELDS)
  out = jax.jit(lambda m: m.with_data(m.data * 2).to_dense())(ws)
  np.testing.assert_allclose(out, 2 * ws.to_dense())
  rebuilt = jaxsparse.BlockSparseMatrix.from_index_arrays(
      ws.data, ws.index_arrays(), shape=ws.shape, block_shape=ws.block_shape
  )
  np.testing.assert_array_equal(rebuilt.to_dense(), ws.to_dense())
  # from_dense inside jit with a concrete mask.
  mask = np.array([[True, False]] * 4)
  d = jax.jit(lambda w: jaxsparse.BlockSparseMatrix.from_dense(w, (16, 16), block_mask=mask).data)(w)
  assert d.shape == (4, 16, 16)
  assert "BlockSparseMatrix(shape=(64, 32)" in repr(ws)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda w: jaxsparse.BlockSparseMatrix.from_dense(w, (24, 16)), ValueError, r"\(24, 16\) must divide"),
        (lambda w: jaxsparse.BlockSparseMatrix.from_dense(w, (0, 16)), ValueError, "block_shape must be positive"),
        (lambda w: jaxsparse.BlockSparseMatrix.from_dense(w, 16), TypeError, "block_shape must be a pair"),
        (lambda w: jaxsparse.BlockSparseMatrix.from_dense(w[0], (16, 16)), ValueError, "w must be 2-D"),
        (
            lambda w: jaxsparse.BlockSparseMatrix.from_dense(w, (16, 16), block_mask=np.ones((3, 2), bool)),
            ValueError,
            r"block_mask must have shape \(K // bk, N // bn\) = \(4, 2\)",
        ),
        (
            lambda w: jaxsparse.BlockSparseMatrix.from_dense(w, (16, 16), block_mask=np.ones((4, 2))),
            TypeError,
            "block_mask must be a boolean array",
        ),
        (
            lambda w: jaxsparse.BlockSparseMatrix.from_dense(w, (16, 16)).with_data(jnp.ones((1, 16, 16))),
            ValueError,
            "data must have shape",
        ),
        (lambda w: jaxsparse.block_magnitude_mask(w, (16, 16), 0.0), ValueError, "density must be in"),
        (lambda w: jaxsparse.block_magnitude_mask(w, (16, 16), 1.5), ValueError, "density must be in"),
        (lambda w: jaxsparse.magnitude_mask(w, 1.0), ValueError, r"sparsity must be in \[0, 1\)"),
        (lambda w: jaxsparse.magnitude_mask(w, "0.5"), TypeError, "sparsity must be a float"),
    ],
)
def test_bad_input(call, exc, match):
  w = jax.random.normal(jax.random.key(1), (64, 32))
  with pytest.raises(exc, match=match):
    call(w)


@pytest.mark.parametrize(
    "static,match",
    [
        ({"shape": (16.9, 24.2)}, r"BlockSparseMatrix.shape must be 2 ints, got \(16.9, 24.2\) \(16.9 is not an int"),
        ({"block_shape": (8.9, 8)}, r"BlockSparseMatrix.block_shape must be 2 ints, got \(8.9, 8\)"),
        ({"shape": (16, 24, 1)}, r"BlockSparseMatrix.shape must be 2 ints, got \(16, 24, 1\)"),
        ({"shape": 16}, r"BlockSparseMatrix.shape must be 2 ints, got 16"),
        ({"shape": (-16, 24)}, r"BlockSparseMatrix.shape must be 2 ints >= 0, got \(-16, 24\)"),
        ({"block_shape": (0, 8)}, r"BlockSparseMatrix.block_shape must be 2 ints >= 1, got \(0, 8\)"),
        ({"block_shape": (True, 8)}, r"BlockSparseMatrix.block_shape must be 2 ints, got \(True, 8\)"),
    ],
)
def test_static_fields_are_checked_not_truncated(static, match):
  w = jaxsparse.BlockSparseMatrix.from_dense(np.ones((16, 24), np.float32), (8, 8))
  with pytest.raises(ValueError, match=match):
    jaxsparse.BlockSparseMatrix.from_index_arrays(w.data, w.index_arrays(), **{"shape": (16, 24), "block_shape": (8, 8),
                                                                               **static})
  # Integral values of any integer type (and integral floats) are taken as ints.
  same = jaxsparse.BlockSparseMatrix.from_index_arrays(
      w.data, w.index_arrays(), shape=(np.int64(16), 24.0), block_shape=(jnp.int32(8), 8)
  )
  assert same.shape == (16, 24) and same.block_shape == (8, 8) and all(type(d) is int for d in same.shape)


def _rebuilt(m, **change):
  """``m`` with some leaves replaced through ``tree_unflatten`` (as a restored checkpoint is: no constructor)."""
  leaves = [change.get(f, getattr(m, f)) for f in ("data", *type(m).INDEX_FIELDS)]
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(m), leaves)


def _nm_unflatten(aux):
  return jaxsparse.NMSparseMatrix.tree_unflatten(aux, (jnp.ones((4, 4)), jnp.zeros((1, 4), jnp.uint8)))


@pytest.mark.parametrize(("build", "run", "message"), [
    (lambda: _nm_unflatten(((8, 4), 2, 0, 0)),
     "to_dense", r"m must be an int >= 2 \(the group size\), got m=0"),
    (lambda: _nm_unflatten(((8, 4), 2, 0, 0)),
     "nm_matmul", r"m must be an int >= 2"),
    (lambda: _nm_unflatten(((8, 4), 2, 4, 5)),
     "to_dense", r"axis=5 is out of range"),
    (lambda: jaxsparse.BlockSparseMatrix.tree_unflatten(((16, 16), (0, 8)), jax.tree.leaves(
        jaxsparse.BlockSparseMatrix.from_dense(np.ones((16, 16), np.float32), (8, 8)))),
     "to_dense", r"BlockSparseMatrix\.block_shape must be 2 ints >= 1, got \(0, 8\)"),
    (lambda: jaxsparse.BlockSparseMatrix.tree_unflatten(((16, 16), (0, 8)), jax.tree.leaves(
        jaxsparse.BlockSparseMatrix.from_dense(np.ones((16, 16), np.float32), (8, 8)))),
     "block_sparse_matmul", r"BlockSparseMatrix\.block_shape must be 2 ints >= 1"),
    (lambda: jaxsparse.CSRMatrix.tree_unflatten(((4, 4, 4),), jax.tree.leaves(
        jaxsparse.CSRMatrix.from_dense(np.eye(4, dtype=np.float32)))),
     "sparse_matmul", r"CSRMatrix\.shape must be 2 ints, got \(4, 4, 4\)"),
])
def test_static_fields_of_a_hand_built_matrix_are_checked_with_a_named_error(build, run, message):
  """A matrix from tree_unflatten with hand-built aux data skips the constructor: its static fields gave bare
  ZeroDivisionError / IndexError / unpacking errors naming no field."""
  w = build()
  ops = {"nm_matmul": jaxsparse.ops.nm_matmul, "block_sparse_matmul": jaxsparse.ops.block_sparse_matmul,
         "sparse_matmul": jaxsparse.ops.sparse_matmul}
  with pytest.raises(ValueError, match=message):
    if run == "to_dense":
      w.to_dense()
    else:
      ops[run](jnp.ones((2, w.shape[0] if len(w.shape) == 2 else 4)), w)


_W9 = jaxsparse.BlockSparseMatrix.from_dense(np.ones((16, 24), np.float32), (8, 8),
                                             block_mask=np.array([[1, 0, 1], [0, 1, 1]], bool))
_C9 = jaxsparse.CSRMatrix.from_dense(np.eye(16, 24, dtype=np.float32))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda x: jaxsparse.ops.block_sparse_matmul(x, _rebuilt(_W9, col_offsets=_W9.col_offsets[:-1])),
         r"BlockSparseMatrix.col_offsets must be an int32 array of shape \(4,\).*got int32 \(3,\)"),
        (lambda x: jaxsparse.ops.block_sparse_matmul(x, _rebuilt(_W9, row_indices=_W9.row_indices[:-1])),
         r"BlockSparseMatrix.row_indices must be an int32 array of shape \(4,\)"),
        (lambda x: jaxsparse.ops.block_sparse_matmul(x, _rebuilt(_W9, row_indices=_W9.row_indices.astype(jnp.int16))),
         r"BlockSparseMatrix.row_indices must be an int32 array .*got int16"),
        (lambda x: jax.grad(lambda x: jaxsparse.ops.block_sparse_matmul(
            x, _rebuilt(_W9, row_offsets=_W9.row_offsets[:-1])).sum())(x),
         r"BlockSparseMatrix.row_offsets must be an int32 array of shape \(3,\)"),
        (lambda x: jaxsparse.ops.sparse_matmul(x, _rebuilt(_C9, data=_C9.data[:-1])),
         r"CSRMatrix.data holds 15 entries .* but the index arrays have shape \(16,\)"),
        (lambda x: jax.jit(lambda d, r: jaxsparse.ops.block_sparse_matmul(x, jaxsparse.BlockSparseMatrix(
            d, **{**_W9.index_arrays(), "row_indices": r}, shape=(16, 24), block_shape=(8, 8))))(
                _W9.data, _W9.row_indices[:3]),
         r"BlockSparseMatrix.row_indices must be an int32 array of shape \(4,\)"),
    ],
    ids=["col_offsets-short", "row_indices-short", "row_indices-int16", "grad-row_offsets-short", "csr-data-short",
         "built-under-jit"],
)
def test_malformed_index_arrays_reaching_the_ops_name_the_field(call, match):
  with pytest.raises(ValueError, match=match):
    call(np.ones((4, 16), np.float32))


def test_zero_size_blocks_and_bad_nm_shapes_are_rejected():
  with pytest.raises(ValueError, match=r"data must be 3-D \(nnz_blocks, bk, bn\) with bk, bn >= 1, got shape \(6, 0,"):
    jaxsparse.BlockSparseMatrix.from_block_mask(np.ones((2, 3), bool), np.ones((6, 0, 8), np.float32))
  c = jaxsparse.CSRMatrix.from_dense(np.eye(4, dtype=np.float32))
  with pytest.raises(ValueError, match=r"CSRMatrix.shape must be 2 ints, got \(4.5, 4\)"):
    jaxsparse.CSRMatrix.from_index_arrays(c.data, c.index_arrays(), shape=(4.5, 4))
  nm = jaxsparse.NMSparseMatrix.from_dense(np.ones((8, 4), np.float32), 2, 4)
  with pytest.raises(ValueError, match=r"shape must be a sequence of ints, got \(8.5, 4\)"):
    jaxsparse.NMSparseMatrix(nm.values, nm.indices, shape=(8.5, 4), n=2, m=4)


@SPLIT_EXAMPLES  # 13 examples in the fast set, 13 more with `make test-slow`
@settings(max_examples=13, deadline=None)
@given(seed=st.integers(0, 2**16), kb=st.integers(1, 7), nb=st.integers(1, 7), p=st.floats(0.0, 1.0))
def test_traced_block_indices_equal_host_indices(examples, seed, kb, nb, p):
  # The jnp path (traced mask, static count) must give exactly the host's NumPy index arrays.
  mask = np.random.default_rng(seed).random((kb, nb)) < p
  host = block_pattern_indices(mask)
  traced = jax.jit(lambda m: block_pattern_indices(m, nnz_blocks=int(mask.sum())))(mask)
  assert set(traced) == set(host) == set(jaxsparse.formats._block_sparse.INDEX_FIELDS)
  for f, v in host.items():
    assert v.dtype == np.int32 and traced[f].dtype == jnp.int32
    np.testing.assert_array_equal(traced[f], v, err_msg=f)


def test_from_dense_traced_mask_needs_count():
  w = jax.random.normal(jax.random.key(0), (64, 48))
  mask = jaxsparse.block_magnitude_mask(w, (16, 16), 0.5)
  ref = jaxsparse.BlockSparseMatrix.from_dense(w, (16, 16), block_mask=mask)

  def build(w, nnz_blocks):
    m = jaxsparse.block_magnitude_mask(w, (16, 16), 0.5)
    return jaxsparse.BlockSparseMatrix.from_dense(w, (16, 16), m, nnz_blocks=nnz_blocks)

  with pytest.raises(ValueError, match=r"block_mask is traced .* pass its count as a static int"):
    jax.jit(build, static_argnums=1)(w, None)
  got = jax.jit(build, static_argnums=1)(w, 6)
  assert got.shape == ref.shape and got.block_shape == ref.block_shape
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
    np.testing.assert_array_equal(a, b)
  # from_block_mask takes the count from data's static shape.
  again = jax.jit(jaxsparse.BlockSparseMatrix.from_block_mask)(mask, ref.data)
  np.testing.assert_array_equal(again.transpose_order, ref.transpose_order)
  with pytest.raises(ValueError, match=r"data holds 5 blocks but block_mask keeps 6"):
    jaxsparse.BlockSparseMatrix.from_block_mask(mask, ref.data[:5])


@pytest.mark.parametrize("nnz", [5, 7])
def test_traced_mask_with_another_count_gives_nan_values(nnz):
  # Under jit a wrong static count cannot raise; the index arrays then drop or repeat entries, so the values are NaN
  # and the products hold NaN instead of plausible wrong numbers (6 blocks are kept). The C++ kernels check the
  # offsets and raise; the XLA routes take the NaN values.
  w = jax.random.normal(jax.random.key(0), (64, 48))
  x = jax.random.normal(jax.random.key(1), (3, 64))
  mask = jaxsparse.block_magnitude_mask(w, (16, 16), 0.5)
  emask = jnp.repeat(jnp.repeat(mask, 16, 0), 16, 1) & (jnp.abs(w) > 1.4)
  count = int(emask.sum())

  @jax.jit
  def block(w, m):
    ws = jaxsparse.BlockSparseMatrix.from_dense(w, (16, 16), m, nnz_blocks=nnz)
    again = jaxsparse.BlockSparseMatrix.from_block_mask(m, ws.data[:1].repeat(nnz, 0))
    return ws.to_dense(), again.to_dense()

  @jax.jit
  def csr(w, m):
    ws = jaxsparse.CSRMatrix.from_dense(w, m, nnz=count + nnz - 6)
    again = jaxsparse.CSRMatrix.from_mask(m, ws.data)
    return ws.to_dense(), again.to_dense(), jaxsparse.ops.sparse_matmul(x, ws, implementation="xla")

  for got in (*block(w, mask), *csr(w, emask)):
    assert np.isnan(np.asarray(got)).any()
  product = jax.jit(lambda w, m: jaxsparse.ops.block_sparse_matmul(
      x, jaxsparse.BlockSparseMatrix.from_dense(w, (16, 16), m, nnz_blocks=nnz)))
  try:
    assert np.isnan(np.asarray(product(w, mask))).any()
  except jax.errors.JaxRuntimeError as e:  # the C++ kernels (CPU)
    assert "is not an offset array" in str(e)
  right = jax.jit(lambda w, m: jaxsparse.CSRMatrix.from_dense(w, m, nnz=count).to_dense())(w, emask)
  np.testing.assert_array_equal(right, jnp.where(emask, w, 0))


def test_from_dense_traced_without_mask_explains():
  with pytest.raises(ValueError, match="pass block_mask= when w is traced"):
    jax.jit(lambda w: jaxsparse.BlockSparseMatrix.from_dense(w, (16, 16)).data)(jnp.ones((32, 32)))


@SPLIT_EXAMPLES  # 10 examples in the fast set, 10 more with `make test-slow`
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), kb=st.integers(1, 8), nb=st.integers(1, 8), density=st.floats(0.01, 1.0))
def test_block_magnitude_mask_keeps_largest_blocks(examples, seed, kb, nb, density):
  rng = np.random.default_rng(seed)
  w = rng.standard_normal((kb * 8, nb * 4)).astype(np.float32)
  mask = np.asarray(jaxsparse.block_magnitude_mask(w, (8, 4), density))
  n_keep = int(density * kb * nb + 0.5)
  assert mask.shape == (kb, nb) and mask.sum() == n_keep
  norms = (w.reshape(kb, 8, nb, 4) ** 2).sum(axis=(1, 3))
  if 0 < n_keep < kb * nb:
    assert norms[mask].min() >= norms[~mask].max()


def test_masks_are_deterministic_on_ties():
  w = jnp.ones((4, 4))
  m1 = jaxsparse.magnitude_mask(w, 0.5)
  np.testing.assert_array_equal(m1, jaxsparse.magnitude_mask(w, 0.5))
  # Ties are broken by flat index: the first half of the entries are kept.
  np.testing.assert_array_equal(np.asarray(m1).reshape(-1), np.arange(16) < 8)
  bm = jaxsparse.block_magnitude_mask(jnp.ones((32, 32)), (16, 16), 0.5)
  np.testing.assert_array_equal(bm, [[True, True], [False, False]])


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
@SPLIT_EXAMPLES  # 10 examples in the fast set, 10 more with `make test-slow`
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), size=st.integers(1, 300), sparsity=st.floats(0.0, 0.99))
def test_magnitude_mask_exact_count(examples, seed, size, sparsity):
  w = np.random.default_rng(seed).standard_normal(size).astype(np.float32)
  mask = np.asarray(jaxsparse.magnitude_mask(w, sparsity))
  kept = size - int(sparsity * size + 0.5)
  assert mask.sum() == kept
  if 0 < kept < size:
    assert np.abs(w[mask]).min() >= np.abs(w[~mask]).max()


def test_nan_weights_count_as_largest_in_every_mask():
  w = np.array([[np.nan, 1.0], [2.0, 3.0]], np.float32)
  expected = [[True, False], [False, True]]  # NaN first, then the largest |w|
  np.testing.assert_array_equal(np.asarray(jaxsparse.magnitude_mask(w, 0.5)), expected)
  np.testing.assert_array_equal(np.asarray(jaxsparse.block_magnitude_mask(w, (1, 1), 0.5)), expected)
  np.testing.assert_array_equal(np.asarray(jaxsparse.nm_mask(w.reshape(4), 2, 4)).reshape(2, 2), expected)
  np.testing.assert_array_equal(np.asarray(jaxsparse.magnitude_mask(jnp.asarray(w, jnp.bfloat16), 0.5)), expected)
  # A block holding a NaN is kept whole; so is a NaN among larger weights.
  wb = np.ones((4, 4), np.float32) * np.arange(1, 5, dtype=np.float32)
  wb[0, 0] = np.nan
  kept_blocks = jaxsparse.block_magnitude_mask(wb, (2, 2), 0.5)
  np.testing.assert_array_equal(np.asarray(kept_blocks), [[True, True], [False, False]])
  ws = jaxsparse.CSRMatrix.from_dense(w, mask=jaxsparse.magnitude_mask(w, 0.5))
  assert np.isnan(np.asarray(ws.data)).any()  # the divergence stays visible


def test_random_block_mask():
  m1 = jaxsparse.random_block_mask(jax.random.key(0), (128, 64), (16, 16), 0.3)
  m2 = jaxsparse.random_block_mask(jax.random.key(1), (128, 64), (16, 16), 0.3)
  assert m1.shape == (8, 4) and int(m1.sum()) == int(m2.sum()) == 10
  assert not np.array_equal(m1, m2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_masked_matmul(dtype):
  kx, kw, km = jax.random.split(jax.random.key(2), 3)
  x = jax.random.normal(kx, (3, 5, 48)).astype(dtype)
  w = jax.random.normal(kw, (48, 40)).astype(dtype)
  mask = jax.random.bernoulli(km, 0.3, (48, 40))
  y = jax.jit(masked_matmul)(x, w, mask)
  wm = jnp.where(mask, w, 0).astype(jnp.float32)
  assert_close(y, x.astype(jnp.float32) @ wm, dtype)
  gx, gw = jax.grad(lambda a, b: jnp.sum(jnp.sin(masked_matmul(a, b, mask).astype(jnp.float32))), argnums=(0, 1))(x, w)
  assert not np.any(np.asarray(gw)[~np.asarray(mask)])
  gx_ref, gw_ref = jax.grad(lambda a, b: jnp.sum(jnp.sin(a @ jnp.where(mask, b, 0))), argnums=(0, 1))(
      x.astype(jnp.float32), w.astype(jnp.float32)
  )
  assert_close(gx, gx_ref, dtype)
  assert_close(gw, gw_ref, dtype)
  yv = jax.vmap(lambda xi: masked_matmul(xi, w, mask))(x)
  assert_close(yv, y, dtype, factor=0.01)


@pytest.mark.parametrize(
    "mask,exc,match",
    [
        (np.ones((48, 40), np.float32), TypeError, "mask must be a boolean array"),
        (np.ones((40, 48), bool), ValueError, r"mask must have the weight's shape \(48, 40\)"),
    ],
)
def test_masked_matmul_bad_mask(mask, exc, match):
  with pytest.raises(exc, match=match):
    masked_matmul(jnp.ones((2, 48)), jnp.ones((48, 40)), mask)


def test_from_index_arrays_accepts_numpy_index_arrays():
  # Saved variables often come back as NumPy arrays; the op must still trace (loop indices are traced).
  w = jax.random.normal(jax.random.key(3), (64, 64))
  m = jaxsparse.BlockSparseMatrix.from_dense(w, block_shape=(32, 32))
  idx = {k: np.asarray(v) for k, v in m.index_arrays().items()}
  rebuilt = jaxsparse.BlockSparseMatrix.from_index_arrays(m.data, idx, shape=m.shape, block_shape=m.block_shape)
  x = jax.random.normal(jax.random.key(4), (5, 64))
  out = jax.jit(lambda x, d: jaxsparse.ops.block_sparse_matmul(x, rebuilt.with_data(d)))(x, m.data)
  np.testing.assert_allclose(out, x @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["csr", "block"])
def test_from_index_arrays_refuses_wider_integers_that_would_wrap(fmt):
  # Without 64-bit mode jnp.asarray wraps int64 into int32: an index of 2**32 + i became i and passed validation.
  if fmt == "csr":
    w = jaxsparse.CSRMatrix.from_dense(jnp.eye(4))
    static = {"shape": (4, 4)}
  else:
    w = jaxsparse.BlockSparseMatrix.from_dense(jnp.eye(4), (2, 2))
    static = {"shape": (4, 4), "block_shape": (2, 2)}
  index = {k: np.asarray(v).astype(np.int64) for k, v in w.index_arrays().items()}
  again = type(w).from_index_arrays(w.data, index, **static)  # in range: taken
  np.testing.assert_array_equal(again.to_dense(), w.to_dense())
  index["col_indices"] = index["col_indices"] + (1 << 32)
  with pytest.raises(ValueError, match=r"index_arrays\['col_indices'\] holds values in \[4294967296, .*outside int32"):
    type(w).from_index_arrays(w.data, index, **static)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_nm_group_bits_is_the_bits_of_nm_mask(n):
  """``nm_group_bits`` (SR-STE's one-pass mask words) packs exactly ``nm_mask``'s groups, ties and NaN included."""
  w = np.random.default_rng(n).integers(-2, 3, (64, 24)).astype(np.float32)  # many ties
  w[5, 3], w[9, 0] = np.nan, -np.inf
  bits = _nm_masks.nm_group_bits(jnp.asarray(w), n, 4)
  assert bits.shape == (16, 24) and bits.dtype == jnp.uint8
  np.testing.assert_array_equal(np.asarray(_nm_masks.group_mask(bits, 4)), np.asarray(jaxsparse.nm_mask(w, n, 4)))


def test_csr_nnz_takes_the_integral_counts_nnz_blocks_takes_and_mismatches_name_the_argument():
  # Was: CSRMatrix refused nnz=jnp.int32(24) ("nnz must be an int ..., got nnz=Array(24, dtype=int32)") where
  # BlockSparseMatrix took nnz_blocks=jnp.int32(...); and a wrong nnz_blocks for a concrete mask was called "nnz".
  rng = np.random.default_rng(0)
  w = rng.standard_normal((4, 6)).astype(np.float32)
  mask = rng.random((4, 6)) < 0.5
  for nnz in (jnp.int32(mask.sum()), np.int64(mask.sum()), float(mask.sum())):
    c = jaxsparse.CSRMatrix.from_dense(w, mask=mask, nnz=nnz)
    np.testing.assert_array_equal(np.asarray(c.to_dense()), np.where(mask, w, 0))
  block_mask = np.array([[True, False], [True, True]])
  with pytest.raises(ValueError, match=r"^block_mask keeps 3 entries but nnz_blocks=2 was given; they must agree\.$"):
    jaxsparse.BlockSparseMatrix.from_dense(np.ones((4, 6), np.float32), (2, 3), block_mask, nnz_blocks=2)
  with pytest.raises(ValueError, match=rf"^mask keeps {mask.sum()} entries but nnz=2 was given; they must agree\.$"):
    jaxsparse.CSRMatrix.from_dense(w, mask=mask, nnz=2)


@pytest.mark.parametrize("cls", [jaxsparse.CSRMatrix, jaxsparse.BlockSparseMatrix])
def test_from_index_arrays_names_index_arrays_that_are_not_a_dict(cls):
  # Was: TypeError: unhashable type: 'numpy.ndarray' (a list of the arrays, in INDEX_FIELDS order).
  w = cls.from_dense(np.eye(4, dtype=np.float32)) if cls is jaxsparse.CSRMatrix else cls.from_dense(
      np.eye(4, dtype=np.float32), (2, 2))
  static = {"shape": (4, 4)} if cls is jaxsparse.CSRMatrix else {"shape": (4, 4), "block_shape": (2, 2)}
  with pytest.raises(TypeError, match=r"^index_arrays must be a dict of the index arrays keyed by \('row_indices', "
                                      r".*\(what index_arrays\(\) returns\), got list\.$"):
    cls.from_index_arrays(w.data, [np.asarray(a) for a in w.index_arrays().values()], **static)
  assert cls.from_index_arrays(w.data, w.index_arrays(), **static).to_dense().tolist() == np.eye(4).tolist()
