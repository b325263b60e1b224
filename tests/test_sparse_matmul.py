"""Unstructured sparse products on the C++ CPU kernels: CSRMatrix, sparse_matmul, masked_matmul, MaskedLinear.

Every check compares forward and gradients against autodiff of the dense reference computed in
float32 on the same (rounded) inputs.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import jaxsparse
from jaxsparse._cpu import _build
from jaxsparse._cpu import _kernels
from jaxsparse.layers import MaskedLinear
from jaxsparse.layers.linen import MaskedDense
from jaxsparse.ops import CpuKernelFallbackWarning
from jaxsparse.ops import _masked_matmul
from jaxsparse.ops import masked_matmul
from jaxsparse.ops import sparse_matmul
from jaxsparse.ops import sparse_matmul_reference
from tests._util import SPLIT_EXAMPLES
from tests._util import assert_close

ALLOWED = r"implementation must be one of \(None, 'xla', 'cpu'\)"
SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# The products' hypothesis tests: 4 examples in the fast set, 4 more with `make test-slow` (SPLIT_EXAMPLES).
PRODUCT_SETTINGS = settings(SETTINGS, max_examples=4)

# Masks with the corner cases the kernels must get right.
MASKS = {
    "random": lambda rng, s: rng.random(s) < 0.15,
    "empty_rows_and_cols": lambda rng, s: (rng.random(s) < 0.5) & (np.arange(s[0])[:, None] % 3 != 0)
    & (np.arange(s[1]) % 4 != 1),
    "single": lambda rng, s: np.arange(s[0] * s[1]).reshape(s) == (s[0] * s[1]) // 2,
    "all_zero": lambda rng, s: np.zeros(s, bool),
    "all_one": lambda rng, s: np.ones(s, bool),
}


@pytest.fixture(autouse=True, scope="module")
def _on_the_cpu():
  """These are tests of the CPU routes: on a machine with a GPU they run on its CPU device."""
  with jax.default_device(jax.devices("cpu")[0]):
    yield


def test_forced_cpu_kernels_lowered_for_a_gpu_say_so():
  """``implementation="cpu"`` lowered for a GPU names the kernels and the platform (XLA said "no FFI handler")."""
  w = jaxsparse.formats.CSRMatrix.from_dense(np.eye(32, 16, dtype=np.float32))
  x = jnp.ones((4, 32))
  for f in (lambda x: sparse_matmul(x, w, implementation="cpu"),
            lambda x: masked_matmul(x, np.eye(32, 16, dtype=np.float32), np.eye(32, 16) != 0, implementation="cpu")):
    np.testing.assert_allclose(jax.jit(f)(x), x @ np.eye(32, 16), rtol=1e-6)
    with pytest.raises(ValueError, match=r"C\+\+ CPU kernels run only when lowered for 'cpu', and this call is "
                       r"lowered for cuda\. Use implementation=None"):
      jax.export.export(jax.jit(f), platforms=["cuda"])(x)
    with pytest.raises(ValueError, match="lowered for cuda"):
      jax.export.export(jax.jit(jax.grad(lambda x, f=f: f(x).sum())), platforms=["cuda"])(x)


# Where the CPU is not the default backend (a GPU machine), the C++ kernels run only when forced (implementation=
# "cpu"), and their fallbacks do not warn: tests of the CPU backend's route choices run where it is the default.
CPU_DEFAULT = jax.default_backend() == "cpu"
cpu_backend_only = pytest.mark.skipif(not CPU_DEFAULT, reason="tests the CPU backend's route choices")


def _cpu_hlo(f, *args) -> str:
  """The HLO of ``jit(f)(*args)`` lowered for CPUs (on any machine)."""
  return jax.jit(f).trace(*args).lower(lowering_platforms=("cpu",)).as_text()


def test_kernels_build_here():
  """The C++ kernels compile on this machine; the other tests would silently test XLA otherwise."""
  assert _build.load(), _build.unavailable_reason()


def _data(seed, b, k, n, mask_fn, dtype=jnp.float32, lead=None):
  rng = np.random.default_rng(seed)
  mask = np.asarray(mask_fn(rng, (k, n)), bool)
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (*(lead or (b,)), k), jnp.float32).astype(dtype)
  w = jax.random.normal(kw, (k, n), jnp.float32).astype(dtype)
  return x, w, mask


def _cotangent(shape):
  return jax.random.normal(jax.random.key(99), shape, jnp.float32)


def _reference(x, w_dense, ct):
  """Forward and the two input cotangents of ``x @ w_dense`` in float64 NumPy: (y, dx, dw_dense)."""
  x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  w64 = np.asarray(jnp.asarray(w_dense, jnp.float32), np.float64)
  ct64 = np.asarray(ct, np.float64)
  x2, ct2 = x64.reshape(-1, x64.shape[-1]), ct64.reshape(-1, ct64.shape[-1])
  return x64 @ w64, ct64 @ w64.T, x2.T @ ct2


def _run(op, x, v, ct):
  """``op(x, v)`` and its VJP with cotangent ``ct``, in one jitted function."""

  def fwd_bwd(x, v):
    y, vjp = jax.vjp(op, x, v)
    return (y, *vjp(ct.astype(y.dtype)))

  return jax.jit(fwd_bwd)(x, v)


def _check_sparse_matmul(x, w, mask, dtype, implementation="cpu"):
  ws = jaxsparse.CSRMatrix.from_dense(w, mask=mask)
  ct = _cotangent((*x.shape[:-1], w.shape[1]))
  op = lambda a, d: sparse_matmul(a, ws.with_data(d), implementation=implementation)
  y, gx, gd = _run(op, x, ws.data, ct)
  y_ref, gx_ref, gw_ref = _reference(x, ws.to_dense(), ct)
  assert y.dtype == dtype and y.shape == (*x.shape[:-1], w.shape[1])
  assert gx.dtype == x.dtype and gd.dtype == ws.data.dtype and gd.shape == (ws.nnz,)
  assert_close(y, y_ref, dtype)
  assert_close(gx, gx_ref, dtype)
  if ws.nnz:
    assert_close(gd, gw_ref[np.asarray(ws.row_indices), np.asarray(ws.col_indices)], dtype)


def _check_masked_matmul(x, w, mask, dtype, implementation="cpu"):
  ct = _cotangent((*x.shape[:-1], w.shape[1]))
  op = lambda a, b: masked_matmul(a, b, mask, implementation=implementation)
  y, gx, gw = _run(op, x, w, ct)
  y_ref, gx_ref, gw_ref = _reference(x, jnp.where(mask, w, 0), ct)
  assert y.dtype == dtype and y.shape == (*x.shape[:-1], w.shape[1])
  assert gx.dtype == x.dtype and gw.dtype == w.dtype
  assert_close(y, y_ref, dtype)
  assert_close(gx, gx_ref, dtype)
  assert not np.any(np.asarray(gw, np.float32)[~mask]), "pruned weights got a gradient"
  if mask.any():
    assert_close(gw, np.where(mask, gw_ref, 0), dtype)


# -------------------------------------------------------------------------------------------------
# CSRMatrix.
# -------------------------------------------------------------------------------------------------


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
@SETTINGS
@given(seed=st.integers(0, 2**16), k=st.integers(1, 40), n=st.integers(1, 40), p=st.floats(0.0, 1.0))
def test_csr_from_dense_roundtrip_and_indices(seed, k, n, p):
  rng = np.random.default_rng(seed)
  mask = rng.random((k, n)) < p
  w = rng.standard_normal((k, n)).astype(np.float32)
  ws = jaxsparse.CSRMatrix.from_dense(w, mask=mask)
  assert ws.shape == (k, n) and ws.nnz == mask.sum() and ws.density == pytest.approx(mask.mean())
  np.testing.assert_array_equal(ws.mask, mask)
  np.testing.assert_array_equal(ws.to_dense(), np.where(mask, w, 0))
  rows, cols = np.nonzero(mask)
  np.testing.assert_array_equal(ws.row_indices, rows)
  np.testing.assert_array_equal(ws.col_indices, cols)
  np.testing.assert_array_equal(ws.row_offsets, np.r_[0, np.cumsum(mask.sum(1))])
  np.testing.assert_array_equal(ws.col_offsets, np.r_[0, np.cumsum(mask.sum(0))])
  t = np.asarray(ws.transpose_order)
  assert sorted(t.tolist()) == list(range(ws.nnz))
  assert np.all(np.diff(cols[t] * k + rows[t]) > 0)  # column-major
  np.testing.assert_array_equal(ws.transpose_row_indices, rows[t])
  # Without a mask, from_dense keeps exactly the nonzeros.
  np.testing.assert_array_equal(jaxsparse.CSRMatrix.from_dense(ws.to_dense()).mask, mask & (w != 0))


def test_csr_pytree_jit_and_constructors():
  w = jax.random.normal(jax.random.key(0), (24, 16))
  mask = np.asarray(jax.random.uniform(jax.random.key(1), (24, 16)) < 0.3)
  ws = jaxsparse.CSRMatrix.from_dense(w, mask=mask)
  assert len(jax.tree_util.tree_leaves(ws)) == 1 + len(jaxsparse.formats._csr.INDEX_FIELDS)
  np.testing.assert_allclose(jax.jit(lambda m: m.with_data(m.data * 2).to_dense())(ws), 2 * ws.to_dense())
  again = jaxsparse.CSRMatrix.from_index_arrays(ws.data, ws.index_arrays(), shape=ws.shape)
  np.testing.assert_array_equal(again.to_dense(), ws.to_dense())
  np.testing.assert_array_equal(jaxsparse.CSRMatrix.from_mask(mask, ws.data).to_dense(), ws.to_dense())
  # from_dense accepts a traced w when the mask is concrete, and a traced mask with its static nnz.
  np.testing.assert_array_equal(jax.jit(lambda w: jaxsparse.CSRMatrix.from_dense(w, mask=mask).data)(w), ws.data)
  traced = jax.jit(lambda w, m: jaxsparse.CSRMatrix.from_dense(w, mask=m, nnz=ws.nnz))(w, mask)
  for f in jaxsparse.formats._csr.INDEX_FIELDS:
    np.testing.assert_array_equal(getattr(traced, f), getattr(ws, f), err_msg=f)
  np.testing.assert_array_equal(jax.jit(jaxsparse.CSRMatrix.from_mask)(mask, ws.data).to_dense(), ws.to_dense())
  assert repr(ws) == f"CSRMatrix(shape=(24, 16), nnz={ws.nnz}, density={ws.density:.3f}, dtype=float32)"


def test_csr_bad_input():
  w = jnp.ones((4, 6))
  with pytest.raises(TypeError, match="mask must be a boolean array, got dtype float32"):
    jaxsparse.CSRMatrix.from_dense(w, mask=np.ones((4, 6), np.float32))
  with pytest.raises(ValueError, match=r"mask must have the shape of w \(4, 6\), got \(6, 4\)"):
    jaxsparse.CSRMatrix.from_dense(w, mask=np.ones((6, 4), bool))
  with pytest.raises(ValueError, match=r"mask must be 2-D \(K, N\), got shape \(24,\)"):
    jaxsparse.CSRMatrix.from_mask(np.ones(24, bool), jnp.ones(24))
  with pytest.raises(ValueError, match=r"data must have shape \(nnz,\) = \(24,\) for this mask, got \(3,\)"):
    jaxsparse.CSRMatrix.from_mask(np.ones((4, 6), bool), jnp.ones(3))
  with pytest.raises(ValueError, match=r"mask is traced .* pass its count as a static int \(nnz="):
    jax.jit(lambda m: jaxsparse.CSRMatrix.from_dense(w, mask=m).data)(np.ones((4, 6), bool))
  with pytest.raises(ValueError, match=r"mask keeps 24 entries but nnz=3 was given"):
    jaxsparse.CSRMatrix.from_dense(w, mask=np.ones((4, 6), bool), nnz=3)
  ws = jaxsparse.CSRMatrix.from_dense(w)
  with pytest.raises(ValueError, match=r"data must have shape \(nnz,\) = \(24,\), got \(2, 12\)"):
    ws.with_data(jnp.ones((2, 12)))
  with pytest.raises(ValueError, match=r"index_arrays is missing \['transpose_order'\]"):
    jaxsparse.CSRMatrix.from_index_arrays(
        ws.data, {f: v for f, v in ws.index_arrays().items() if f != "transpose_order"}, shape=(4, 6)
    )


def test_csr_bad_nnz_and_traced_from_mask_data_name_the_argument():
  # A traced mask's count is unknown, so nnz is checked for what it can be: an int in [0, K * N].
  w, mask = jnp.ones((4, 6)), np.ones((4, 6), bool)
  build = lambda nnz: jax.jit(lambda m: jaxsparse.CSRMatrix.from_dense(w, mask=m, nnz=nnz).data)(mask)
  for nnz in (-1, 2.5, 25, True):
    with pytest.raises(ValueError, match=rf"nnz must be an int in \[0, 24\] .*got nnz={nnz!r}"):
      build(nnz)
  np.testing.assert_array_equal(build(np.int64(24)), np.ones(24))  # a NumPy int is an int
  # from_mask with a traced mask and data that is not 1-D: the shape is named (it was a ConcretizationTypeError).
  with pytest.raises(ValueError, match=r"data must have shape \(nnz,\) \(1-D.*got \(4, 6\)"):
    jax.jit(jaxsparse.CSRMatrix.from_mask)(mask, jnp.ones((4, 6)))


# -------------------------------------------------------------------------------------------------
# sparse_matmul and masked_matmul against the dense reference.
# -------------------------------------------------------------------------------------------------


@SPLIT_EXAMPLES
@PRODUCT_SETTINGS
@given(
    seed=st.integers(0, 2**16),
    b=st.integers(1, 70),
    k=st.integers(1, 60),
    n=st.integers(1, 60),
    p=st.floats(0.0, 1.0),
)
def test_sparse_matmul_matches_dense_f32(examples, seed, b, k, n, p):
  x, w, mask = _data(seed, b, k, n, lambda rng, s: rng.random(s) < p)
  _check_sparse_matmul(x, w, mask, jnp.float32)
  _check_sparse_matmul(x, w, mask, jnp.float32, implementation=None)  # the dense route above 30% density


@SPLIT_EXAMPLES
@PRODUCT_SETTINGS
@given(
    seed=st.integers(0, 2**16),
    b=st.integers(1, 70),
    k=st.integers(1, 60),
    n=st.integers(1, 60),
    p=st.floats(0.0, 1.0),
)
def test_masked_matmul_matches_dense_f32(examples, seed, b, k, n, p):
  x, w, mask = _data(seed, b, k, n, lambda rng, s: rng.random(s) < p)
  _check_masked_matmul(x, w, mask, jnp.float32)


# In the fast set: float32 on the empty rows and columns (random masks in float32: the hypothesis tests above), each
# 16-bit dtype once.
MASK_DTYPES_FAST = {
    ("empty_rows_and_cols", jnp.float32), ("random", jnp.bfloat16), ("empty_rows_and_cols", jnp.float16),
}


@pytest.mark.parametrize(("name", "dtype"), [
    (name, dtype) if (name, dtype) in MASK_DTYPES_FAST
    # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
    else pytest.param(name, dtype, marks=pytest.mark.slow)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16) for name in MASKS
])
def test_masks_and_dtypes(name, dtype):
  x, w, mask = _data(1, 0, 48, 40, MASKS[name], dtype, lead=(3, 7))
  _check_sparse_matmul(x, w, mask, dtype)
  _check_masked_matmul(x, w, mask, dtype)


def test_many_row_blocks_and_batch_tiles():
  """K and N beyond one cache block (1024 rows) and a batch of two full tiles plus a partial one."""
  x, w, mask = _data(2, 150, 2100, 1100, lambda rng, s: rng.random(s) < 0.02)
  _check_sparse_matmul(x, w, mask, jnp.float32)
  _check_masked_matmul(x, w, mask, jnp.float32)


@pytest.mark.parametrize("p", [0.6, 0.3, 0.12, 0.03])
def test_forward_row_blocks_follow_the_density(p):
  """The forward's row blocks shrink with the density (128 rows at 0.6, 256 at 0.3, 640 at 0.12, 1024 at 0.03): K
  of 700 ends each on a partial block, N of 300 on a partial column chunk, 37 rows on a partial 16-float vector."""
  x, w, mask = _data(7, 37, 700, 300, lambda rng, s: rng.random(s) < p)
  _check_sparse_matmul(x, w, mask, jnp.float32)
  _check_masked_matmul(x, w, mask, jnp.float32)


@pytest.mark.parametrize("op", ["sparse", "masked"])
def test_vmap(op):
  x, w, mask = _data(3, 0, 40, 24, MASKS["random"], lead=(4, 5))
  ws = jaxsparse.CSRMatrix.from_dense(w, mask=mask)
  wm = jnp.where(mask, w, 0)
  if op == "sparse":
    f = lambda x, data: sparse_matmul(x, ws.with_data(data), implementation="cpu")
    args = (x, ws.data)
  else:
    f = lambda x, w: masked_matmul(x, w, mask, implementation="cpu")
    args = (x, w)
  # Mapped activations fold into the batch; a mapped weight runs one kernel call per element.
  assert_close(jax.vmap(f, in_axes=(0, None))(*args), x @ wm, jnp.float32)
  assert_close(jax.jit(jax.vmap(f, in_axes=(1, None), out_axes=1))(*args), x @ wm, jnp.float32)
  ws2 = jnp.stack([args[1], 2 * args[1]])
  out = jax.vmap(f, in_axes=(None, 0))(x[0], ws2)
  assert_close(out, jnp.stack([x[0] @ wm, 2 * (x[0] @ wm)]), jnp.float32)
  # Per-example gradients (the weight gradient is per example under vmap).
  loss = lambda x, v: jnp.sum(jnp.sin(f(x, v)))
  gx = jax.vmap(jax.grad(loss), in_axes=(0, None))(x, args[1])
  assert_close(gx, jax.vmap(jax.grad(lambda xi: jnp.sum(jnp.sin(xi @ wm))))(x), jnp.float32)
  gv = jax.vmap(jax.grad(loss, argnums=1), in_axes=(0, None))(x, args[1])
  gv_ref = jax.vmap(lambda xi: jax.grad(lambda v: jnp.sum(jnp.sin(xi @ _dense(op, ws, mask, v))))(args[1]))(x)
  assert gv.shape == (4, *args[1].shape)
  assert_close(gv, gv_ref, jnp.float32)


@pytest.mark.parametrize("op", ["sparse", "masked"])
def test_vmap_of_numpy_inputs_matches_jax_inputs(op):
  # vmap hands NumPy inputs to the kernels' batching rule as NumPy; a per-element rule must still slice them.
  x, w, mask = _data(4, 0, 16, 24, MASKS["random"], lead=(2, 3))
  ws = jaxsparse.CSRMatrix.from_dense(w, mask=mask)
  if op == "sparse":
    f = lambda x, data: sparse_matmul(x, ws.with_data(data), implementation="cpu")
    v = ws.data
  else:
    f = lambda x, w: masked_matmul(x, w, w > 0, implementation="cpu")
    v = w
  xs, vs = np.asarray(x), np.stack([np.asarray(v)] * 2)
  assert_close(jax.vmap(f)(xs, vs), jax.vmap(f)(jnp.asarray(xs), jnp.asarray(vs)), jnp.float32)
  per_example_grad = jax.vmap(jax.grad(lambda x, v: jnp.sum(f(x, v) ** 2), argnums=(0, 1)), in_axes=(0, None))
  for got, want in zip(per_example_grad(xs, np.asarray(v)), per_example_grad(jnp.asarray(xs), v), strict=True):
    assert_close(got, want, jnp.float32)


def _dense(op, ws, mask, v):
  return ws.with_data(v).to_dense() if op == "sparse" else jnp.where(mask, v, 0)


def test_xla_implementation_matches_kernels():
  x, w, mask = _data(9, 0, 40, 24, MASKS["random"], lead=(2, 3))
  ws = jaxsparse.CSRMatrix.from_dense(w, mask=mask)
  expected = sparse_matmul_reference(x, ws)
  assert_close(sparse_matmul(x, ws, implementation="xla"), expected, jnp.float32)
  assert_close(sparse_matmul(x, ws), expected, jnp.float32)
  assert_close(masked_matmul(x, w, mask, implementation="xla"), expected, jnp.float32)


@cpu_backend_only
def test_masked_matmul_auto_picks_kernels_by_density():
  """implementation=None runs the kernels for sparse masks and dense routes for dense ones; both agree. The forward
  decides inside its one kernel call (no reduction or conditional in XLA before it), told apart by a NaN in x that
  meets only pruned weights: the sparse kernel skips them, the GEMM multiplies their zeros."""
  x, w, _ = _data(4, 9, 64, 48, MASKS["random"])
  for p, sparse in [(0.1, True), (0.9, False)]:
    mask = np.random.default_rng(0).random(w.shape) < p
    assert bool(jaxsparse.ops._masked_matmul._sparse_enough(mask)) == sparse
    hlo = _cpu_hlo(lambda x, w, m: masked_matmul(x, w, m), x, w, mask)
    assert hlo.count("stablehlo.custom_call") == 1 and "stablehlo.reduce" not in hlo, hlo
    mask[0] = False
    assert bool(jnp.isnan(masked_matmul(x.at[0, 0].set(jnp.nan), w, mask)[0]).any()) != sparse
    # ... also with the rows of a mapped x folded into the call (9 x 2 rows: not a few-rows product).
    y = jax.vmap(masked_matmul, in_axes=(0, None, None))(jnp.stack([x, x.at[0, 0].set(jnp.nan)]), w, mask)
    assert bool(jnp.isnan(y[1, 0]).any()) != sparse and not bool(jnp.isnan(y[0]).any())
    _check_masked_matmul(x, w, mask, jnp.float32, implementation=None)
    assert_close(masked_matmul(x, w, mask), masked_matmul(x, w, mask, implementation="xla"), jnp.float32)
  # Between the two thresholds the forward and the gradients take different routes; they still agree.
  low, high = sorted((_masked_matmul.CPU_MAX_DENSITY, _masked_matmul.CPU_FORWARD_MAX_DENSITY))
  assert low < high
  mask = np.zeros(w.shape, bool)
  mask[:, :int(48 * (low + high) / 2)] = True  # the same density in every row the estimate samples
  assert bool(_masked_matmul._sparse_enough(mask, high)) and not bool(_masked_matmul._sparse_enough(mask, low))
  _check_masked_matmul(x, w, mask, jnp.float32, implementation=None)


@cpu_backend_only
@pytest.mark.parametrize("rows, max_density", [(127, 0.15), (128, _masked_matmul.CPU_FORWARD_MAX_DENSITY)])
def test_masked_matmul_forward_threshold_by_rows(rows, max_density):
  """The forward's density threshold: CPU_FORWARD_MAX_DENSITY, 0.15 for fewer than 128 rows (the sparse kernel shares
  its work per kept weight over fewer rows). Just under it the sparse kernel runs, just over it the GEMM: told apart
  by a NaN in x that meets only pruned weights (the sparse kernel skips them, the GEMM multiplies their zeros)."""
  x, w, _ = _data(rows, rows, 64, 100, MASKS["random"])
  x = x.at[0, 0].set(jnp.nan)
  for density, sparse in [(max_density - 0.02, True), (max_density + 0.02, False)]:
    mask = np.zeros(w.shape, bool)
    mask[1:, :round(100 * density)] = True  # weight row 0, which x[:, 0] meets, is pruned
    y = masked_matmul(x, w, mask)
    assert bool(jnp.isnan(y[0]).any()) != sparse, (rows, density)
    assert_close(y[1:], x[1:] @ jnp.where(mask, w, 0), jnp.float32)


@cpu_backend_only
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_masked_matmul_few_rows_run_the_dense_gemm(rows):
  """At most CPU_FEW_ROWS rows (leading dims folded) the forward runs the dense GEMM at every density, with the
  masked dense routes' NaN semantics; its gradients still follow the density."""
  x, w, _ = _data(rows, 1, 64, 48, MASKS["random"], lead=(1, rows))
  assert rows <= _masked_matmul.CPU_FEW_ROWS
  for p in (0.05, 0.9):
    mask = np.random.default_rng(rows).random(w.shape) < p
    _check_masked_matmul(x, w, mask, jnp.float32, implementation=None)
    mask[0] = False  # a NaN in x[..., 0] meets only pruned weights: the GEMM multiplies their zeros
    assert bool(jnp.isnan(masked_matmul(x.at[0, 0, 0].set(jnp.nan), w, mask)[0, 0]).all())
  bad = x.at[0, 0, 0].set(jnp.nan)
  mask = np.zeros(w.shape, bool)
  mask[1:] = True  # the NaN meets only pruned weights
  assert bool(jnp.isnan(masked_matmul(bad, w, mask)[0, 0]).all())  # as x @ where(mask, w, 0)
  assert not bool(jnp.isnan(masked_matmul(bad, w, mask, implementation="cpu")).any())  # the sparse kernels skip them


@cpu_backend_only
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_sparse_matmul_few_rows_stream_the_entries(rows):
  """At most 8 rows (leading dims folded) the forward streams the entries in row order at every density, for None
  and "cpu"; values and gradients as the dense reference; under vmap the mapped rows count (folded into the rows)."""
  x, w, _ = _data(rows, 1, 96, 40, MASKS["random"], lead=(1, rows))
  for p in (0.1, 0.9):
    mask = np.random.default_rng(rows).random(w.shape) < p
    ws = jaxsparse.CSRMatrix.from_dense(w, mask=mask)
    for impl in (None, "cpu"):
      hlo = _cpu_hlo(lambda x, d, impl=impl, ws=ws: sparse_matmul(x, ws.with_data(d), implementation=impl), x, ws.data)
      assert "jaxsparse_csr_few_rows_forward" in hlo and "jaxsparse_csr_forward" not in hlo, impl
      assert "jaxsparse_csr_to_dense" not in hlo, impl
      _check_sparse_matmul(x, w, mask, jnp.float32, implementation=impl)
  ws = jaxsparse.CSRMatrix.from_dense(w, mask=mask)
  f = jax.vmap(lambda a: sparse_matmul(a, ws))
  for n in (1, 2, 5):
    xs = jnp.stack([x[0] * (i + 1) for i in range(n)])
    assert ("jaxsparse_csr_few_rows_forward" in _cpu_hlo(f, xs)) == (n * rows <= 8)
    assert_close(f(xs), xs @ ws.to_dense(), jnp.float32)


@cpu_backend_only
@pytest.mark.parametrize("p", [0.1, 0.9])
def test_sparse_matmul_auto_picks_the_dense_route_by_density(p):
  """implementation=None runs dense-ish CSR patterns on the dense route (the entries written dense by a kernel,
  XLA's matmuls, dW taken at the entries by a kernel), sparse ones on the sparse kernels; "cpu" always the latter."""
  x, w, _ = _data(4, 9, 64, 48, MASKS["random"])
  mask = np.random.default_rng(0).random(w.shape) < p
  ws = jaxsparse.CSRMatrix.from_dense(w, mask=mask)
  dense = ws.density > jaxsparse.ops._sparse_matmul.CPU_DENSE_FORWARD_MIN_DENSITY
  assert dense == (p > 0.5) and dense == (ws.density > jaxsparse.ops._sparse_matmul.CPU_DENSE_BACKWARD_MIN_DENSITY)
  loss = lambda x, d, impl=None: jnp.sum(jnp.sin(sparse_matmul(x, ws.with_data(d), implementation=impl)))
  hlo = _cpu_hlo(jax.grad(loss, argnums=(0, 1)), x, ws.data)
  routes = ("jaxsparse_csr_to_dense", "jaxsparse_csr_take"), ("jaxsparse_csr_forward", "jaxsparse_csr_backward")
  assert all(t in hlo for t in routes[not dense]) and not any(t in hlo for t in routes[dense])
  hlo = _cpu_hlo(jax.grad(lambda x, d: loss(x, d, "cpu"), argnums=(0, 1)), x, ws.data)
  assert all(t in hlo for t in routes[1]) and not any(t in hlo for t in routes[0])
  _check_sparse_matmul(x, w, mask, jnp.float32, implementation=None)
  # grad of grad on the dense route against autodiff of the dense product.
  ref = lambda x, d: jnp.sum(jnp.sin(x @ ws.with_data(d).to_dense()))
  hvp = lambda f: jax.grad(lambda x: jnp.sum(jax.grad(f, argnums=1)(x, ws.data) ** 2))(x)
  assert_close(hvp(loss), hvp(ref), jnp.float32)


def test_csr_dense_route_kernels():
  """csr_to_dense / csr_take against NumPy, and their index checks at run time."""
  assert _build.load(), _build.unavailable_reason()  # registers the kernels' FFI targets
  _, w, mask = _data(7, 1, 40, 24, MASKS["random"])
  ws = jaxsparse.CSRMatrix.from_dense(w, mask=mask)
  np.testing.assert_array_equal(_kernels.csr_to_dense(ws.data, ws.row_offsets, ws.col_indices, 24), ws.to_dense())
  rows, cols = np.asarray(ws.row_indices), np.asarray(ws.col_indices)
  np.testing.assert_array_equal(_kernels.csr_take(w, ws.row_offsets, ws.col_indices), np.asarray(w)[rows, cols])
  with pytest.raises(Exception, match=r"col_indices has entries outside \[0, 24\)"):
    jax.block_until_ready(_kernels.csr_take(w, ws.row_offsets, ws.col_indices + 24))
  with pytest.raises(Exception, match="row_offsets is not an offset array"):
    jax.block_until_ready(_kernels.csr_to_dense(ws.data, ws.row_offsets[::-1], ws.col_indices, 24))


def _gemm(x, w, mask):
  return _kernels.masked_forward(x, w, mask, route="gemm")


@pytest.mark.parametrize("seed", range(6))
def test_packed_gemm_kernels(seed):
  """The masked forward's GEMM route against a float64 NumPy product on shapes around the micro-tile, column chunk and
  contraction block edges (12 / 6 rows, 32 / 16 and 128 / 64 columns, 512 contractions), one or several row groups,
  fresh random data."""
  assert _build.load(), _build.unavailable_reason()
  rng = np.random.default_rng(seed)
  sizes = ([1, 5, 12, 13, 31, 64], [1, 7, 300, 511, 512, 513, 1030], [1, 16, 33, 128, 200])
  m, k, n = (int(rng.choice(c)) for c in sizes)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  mask = rng.random((k, n)) < rng.uniform(0.2, 0.9)
  w[~mask & (rng.random((k, n)) < 0.1)] = np.nan  # pruned NaNs are zeros, as in where(mask, w, 0)
  ref = x.astype(np.float64) @ np.where(mask, w, 0).astype(np.float64)
  tol = dict(rtol=1e-5, atol=1e-5 * np.sqrt(k))
  np.testing.assert_allclose(_gemm(x, w, mask), ref, **tol)
  # Mask bytes other than 1 count as kept (a bool array viewed from other bytes), as in the sparse kernels.
  np.testing.assert_allclose(_gemm(x, w, (mask.view(np.uint8) * 255).view(bool)), ref, **tol)
  # vmap over x folds into the batch.
  xs = rng.standard_normal((2, m, k)).astype(np.float32)
  np.testing.assert_allclose(jax.vmap(lambda a: _gemm(a, w, mask))(xs), xs @ np.where(mask, w, 0),
                             **tol)


def test_packed_gemm_edge_cases():
  """Empty products; a NaN in a kept weight propagates to its column only."""
  assert _build.load(), _build.unavailable_reason()
  x = np.ones((3, 4), np.float32)
  assert _gemm(np.ones((0, 4), np.float32), np.ones((4, 5), np.float32), np.ones((4, 5), bool)).shape \
      == (0, 5)
  empty = _gemm(np.ones((3, 0), np.float32), np.ones((0, 5), np.float32), np.ones((0, 5), bool))
  np.testing.assert_array_equal(empty, np.zeros((3, 5)))
  # ... also under vmap, folded into the batch (reshape(-1, 0) has no row count to infer).
  empty = jax.vmap(lambda a: _gemm(a, np.ones((0, 5), np.float32), np.ones((0, 5), bool)))(
      np.ones((2, 3, 0), np.float32))
  np.testing.assert_array_equal(empty, np.zeros((2, 3, 5)))
  none = jaxsparse.CSRMatrix.from_dense(np.ones((0, 5), np.float32))
  empty = jax.vmap(lambda a: _kernels.csr_few_rows_forward(a, none.data, none.row_offsets, none.col_indices, 5))(
      np.ones((2, 3, 0), np.float32))
  np.testing.assert_array_equal(empty, np.zeros((2, 3, 5)))
  w = np.ones((4, 5), np.float32)
  w[1, 2] = np.nan
  y = np.asarray(_gemm(x, w, np.ones((4, 5), bool)))
  assert np.isnan(y[:, 2]).all() and np.isfinite(np.delete(y, 2, axis=1)).all()
  # Enough column chunks for every thread: one row group, each item packing its own strips as it goes (the random
  # shapes above take the other path, the weight packed once for several row groups).
  rng = np.random.default_rng(0)
  x, w, mask = rng.standard_normal((40, 300)), rng.standard_normal((300, 1030)), rng.random((300, 1030)) < 0.5
  x, w = x.astype(np.float32), w.astype(np.float32)
  np.testing.assert_allclose(_gemm(x, w, mask), x.astype(np.float64) @ np.where(mask, w, 0),
                             rtol=1e-5, atol=1e-4)
  # Contractions around the 512-deep packed blocks, both packing paths (one row group: 40 x 1030 columns; several:
  # 13 x 33).
  for m, k, n in [(40, 511, 1030), (40, 513, 1030), (13, 512, 33), (13, 1025, 33)]:
    x, w, mask = rng.standard_normal((m, k)), rng.standard_normal((k, n)), rng.random((k, n)) < 0.5
    x, w = x.astype(np.float32), w.astype(np.float32)
    np.testing.assert_allclose(_gemm(x, w, mask), x.astype(np.float64) @ np.where(mask, w, 0), rtol=1e-5, atol=1e-4)
  # Few rows, few weight rows and many columns: the streaming kernel splits the columns too (alone, and with the rows).
  for m, k, n in [(3, 16, 5000), (5, 300, 3001)]:
    x, w, mask = rng.standard_normal((m, k)), rng.standard_normal((k, n)), rng.random((k, n)) < 0.5
    x, w = x.astype(np.float32), w.astype(np.float32)
    np.testing.assert_allclose(_gemm(x, w, mask), x.astype(np.float64) @ np.where(mask, w, 0),
                               rtol=1e-5, atol=1e-4)


def test_csr_few_rows_kernel():
  """csr_few_rows_forward against float64 NumPy on fresh random shapes of 0-8 rows, its checks at run time."""
  assert _build.load(), _build.unavailable_reason()
  rng = np.random.default_rng()
  for _ in range(6):
    m, k, n = int(rng.integers(0, 9)), int(rng.integers(1, 700)), int(rng.integers(1, 300))
    x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    mask = rng.random((k, n)) < rng.uniform(0.01, 0.9)
    ws = jaxsparse.CSRMatrix.from_dense(w, mask=mask)
    y = _kernels.csr_few_rows_forward(x, ws.data, ws.row_offsets, ws.col_indices, n)
    np.testing.assert_allclose(y, x.astype(np.float64) @ np.where(mask, w, 0), rtol=1e-5, atol=1e-5 * np.sqrt(k))
  # The checks on a fixed matrix: the last random one may have no column index past 3 (n <= 3, or few entries).
  ws = jaxsparse.CSRMatrix.from_dense(np.ones((16, 24), np.float32))
  with pytest.raises(Exception, match="takes at most 8 rows, got 9"):
    jax.block_until_ready(_kernels.csr_few_rows_forward(np.ones((9, 16), np.float32), ws.data, ws.row_offsets,
                                                        ws.col_indices, 24))
  with pytest.raises(Exception, match=r"col_indices has entries outside \[0, 3\)"):
    jax.block_until_ready(_kernels.csr_few_rows_forward(np.ones((2, 16), np.float32), ws.data, ws.row_offsets,
                                                        ws.col_indices, 3))


def test_mask_may_change_inside_jit():
  """The kernels read the mask on every call: new masks (and new nnz) need no rebuild."""
  x, w, _ = _data(5, 16, 64, 32, MASKS["random"])
  f = jax.jit(lambda x, w, m: masked_matmul(x, w, m, implementation="cpu"))
  for p in (0.05, 0.2, 0.0):
    mask = np.random.default_rng(int(p * 100)).random(w.shape) < p
    assert_close(f(x, w, mask), x @ jnp.where(mask, w, 0), jnp.float32)


@cpu_backend_only
def test_invalid_csr_indices_fail_at_run_time():
  x, w, mask = _data(6, 12, 16, 8, MASKS["random"])  # more than 8 rows: the forward reads the transposed arrays
  ws = jaxsparse.CSRMatrix.from_dense(w, mask=mask)
  bad = dict(ws.index_arrays(), transpose_row_indices=ws.transpose_row_indices + 16)
  with pytest.raises(Exception, match=r"transpose_row_indices has entries outside \[0, 16\)"):
    # validate=False: past the constructor's check (tests/test_faults.py), the kernel's own check at run time.
    csr = jaxsparse.CSRMatrix.from_index_arrays(ws.data, bad, shape=ws.shape, validate=False)
    jax.block_until_ready(sparse_matmul(x, csr, implementation="cpu"))
  bad = dict(ws.index_arrays(), col_indices=ws.col_indices - 100)
  grad = jax.grad(lambda d: jnp.sum(
      sparse_matmul(x, jaxsparse.CSRMatrix.from_index_arrays(d, bad, shape=ws.shape, validate=False))))
  with pytest.raises(Exception, match=r"col_indices has entries outside \[0, 8\)"):
    jax.block_until_ready(grad(ws.data))


def test_bad_arguments():
  x, w, mask = _data(7, 2, 16, 8, MASKS["random"])
  ws = jaxsparse.CSRMatrix.from_dense(w, mask=mask)
  with pytest.raises(ValueError, match=ALLOWED + r", got implementation='gpu'"):
    sparse_matmul(x, ws, implementation="gpu")
  with pytest.raises(ValueError, match=ALLOWED + r", got implementation='pallas'"):
    masked_matmul(x, w, mask, implementation="pallas")
  with pytest.raises(TypeError, match=r"w must be a jaxsparse\.CSRMatrix, got ArrayImpl"):
    sparse_matmul(x, w)
  with pytest.raises(ValueError, match=r"with K = w.shape\[0\] = 16, got x.shape=\(2, 8\)"):
    sparse_matmul(jnp.ones((2, 8)), ws)
  with pytest.raises(TypeError, match="x must have a floating dtype, got int32"):
    sparse_matmul(jnp.ones((2, 16), jnp.int32), ws)
  with pytest.raises(TypeError, match=r"w\.data must have a real dtype, got complex64; .*masked_matmul"):
    sparse_matmul(x, ws.with_data(ws.data.astype(jnp.complex64)))  # was: "preferred_element_type must be ..."
  with pytest.raises(TypeError, match="implementation='cpu' supports float32, bfloat16 and float16, got float32 and "
                                     "int32"):
    masked_matmul(jnp.ones((2, 16)), w.astype(jnp.int32), mask, implementation="cpu")
  # An integer x multiplied in integers (int x int gave an int product; no gradient); refused as the other ops do.
  for impl in (None, "xla", "cpu"):
    with pytest.raises(TypeError, match=r"^x must have a floating or complex dtype, got int32\.$"):
      masked_matmul(jnp.ones((2, 16), jnp.int32), w, mask, implementation=impl)


# -------------------------------------------------------------------------------------------------
# Build and fallback.
# -------------------------------------------------------------------------------------------------


@cpu_backend_only
def test_fallback_when_kernels_are_unavailable(monkeypatch):
  monkeypatch.setattr(_build, "_load", lambda: "no C++ compiler found (test)")
  x, w, mask = _data(8, 3, 16, 8, MASKS["random"])
  unavailable = r"masked_matmul: the C\+\+ CPU kernels cannot run these operands \(unavailable: no C"
  with pytest.warns(CpuKernelFallbackWarning, match=unavailable):
    y = masked_matmul(x, w, mask)
  assert_close(y, x @ jnp.where(mask, w, 0), jnp.float32)
  with pytest.warns(CpuKernelFallbackWarning, match="sparse_matmul"):
    y = sparse_matmul(x, jaxsparse.CSRMatrix.from_dense(w, mask=mask))
  assert_close(y, x @ jnp.where(mask, w, 0), jnp.float32)
  with pytest.raises(RuntimeError, match=r"implementation='cpu' was requested but cannot run: no C\+\+ compiler"):
    masked_matmul(x, w, mask, implementation="cpu")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    masked_matmul(x, w, mask, implementation="xla")  # an explicit XLA request does not warn


def test_build_reports_compiler_failure(monkeypatch, tmp_path):
  monkeypatch.setenv("CXX", "false")
  monkeypatch.setenv("JAXSPARSE_CACHE_DIR", str(tmp_path))
  lib, reason = _build._build()
  assert lib is None and "compiling the CPU kernels failed" in reason and "-march=native" in reason
  assert not list(tmp_path.iterdir()), "a failed build left files behind"
  monkeypatch.setenv("JAXSPARSE_CPU_KERNELS", "0")
  assert _build._build() == (None, "disabled by JAXSPARSE_CPU_KERNELS=0")


def test_build_cached_reuses_and_falls_back(monkeypatch, tmp_path):
  """One cached library per key; an unwritable cache falls back to the temporary directory."""
  src = tmp_path / "k.cc"
  src.write_text('extern "C" int jaxsparse_test_answer() { return 42; }\n')
  monkeypatch.setenv("JAXSPARSE_CACHE_DIR", str(tmp_path / "cache"))
  cxx = _build.compiler()
  if cxx is None:
    pytest.skip("no C++ compiler")
  flags = ["-O1", "-shared", "-fPIC"]
  lib, error = _build.build_cached("jaxsparse_test", ("v1",), cxx, [src], flags)
  assert error == "" and lib.parent == tmp_path / "cache" and lib.exists()
  mtime = lib.stat().st_mtime_ns
  assert _build.build_cached("jaxsparse_test", ("v1",), cxx, [src], flags) == (lib, "")
  assert lib.stat().st_mtime_ns == mtime  # not rebuilt
  other, _ = _build.build_cached("jaxsparse_test", ("v2",), cxx, [src], flags)
  assert other != lib
  (tmp_path / "file").write_text("")
  monkeypatch.setenv("JAXSPARSE_CACHE_DIR", str(tmp_path / "file" / "sub"))  # cannot be created
  monkeypatch.setattr(_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
  fallback, error = _build.build_cached("jaxsparse_test", ("v3",), cxx, [src], flags)
  assert error == "" and fallback.is_relative_to(tmp_path / "tmp")
  src.write_text("not C++")
  failed, error = _build.build_cached("jaxsparse_test", ("v4",), cxx, [src], flags)
  assert failed is None and "failed" in error


def test_build_cache_dir(monkeypatch, tmp_path):
  monkeypatch.setenv("JAXSPARSE_CACHE_DIR", str(tmp_path / "c"))
  assert _build.cache_dir() == tmp_path / "c"
  monkeypatch.delenv("JAXSPARSE_CACHE_DIR")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert _build.cache_dir() == tmp_path / "jaxsparse"


# -------------------------------------------------------------------------------------------------
# Layers.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_masked_linear_cpu_matches_xla(dtype):
  kwargs = dict(sparsity=0.9, dtype=dtype, param_dtype=dtype)
  cpu = MaskedLinear(64, 48, **kwargs, implementation="cpu", rngs=nnx.Rngs(0))
  xla = MaskedLinear(64, 48, **kwargs, implementation="xla", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 9, 64)).astype(dtype)
  assert_close(nnx.jit(lambda m, x: m(x))(cpu, x), xla(x), dtype)
  loss = lambda m, x: jnp.sum(jnp.sin(m(x).astype(jnp.float32)))
  g_cpu = nnx.grad(loss)(cpu, x)
  g_xla = nnx.grad(loss)(xla, x)
  assert_close(g_cpu["kernel"][...], g_xla["kernel"][...], dtype)
  assert_close(g_cpu["bias"][...], g_xla["bias"][...], dtype)
  model = MaskedDense(48, sparsity=0.9, implementation="cpu")
  variables = cpu.to_linen_variables()
  assert_close(jax.jit(model.apply)(variables, x), xla(x), dtype)


def test_masked_linear_mask_update_in_a_jitted_step():
  """What pruning does: replace the mask (here with a different number of kept weights) between steps."""
  layer = MaskedLinear(64, 32, sparsity=0.9, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (8, 64))
  step = nnx.jit(lambda m, x: m(x))
  new_mask = jax.random.uniform(jax.random.key(2), (64, 32)) < 0.05
  layer.mask[...] = new_mask
  layer.kernel[...] = jnp.where(new_mask, 1.0, 0.0)
  assert_close(step(layer, x), x @ jnp.where(new_mask, 1.0, 0.0) + layer.bias[...], jnp.float32)


def test_masked_layer_bad_implementation():
  with pytest.raises(ValueError, match=ALLOWED + r", got implementation='pallas'"):
    MaskedLinear(8, 8, sparsity=0.5, implementation="pallas", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=ALLOWED + r", got implementation='x'"):
    MaskedDense(8, sparsity=0.5, implementation="x")


# -------------------------------------------------------------------------------------------------
# Block-sparse products on the C++ kernels (block_sparse_matmul's CPU path).
# -------------------------------------------------------------------------------------------------


def _block_case(seed, lead, k, n, block_shape, density, dtype=jnp.float32):
  kx, kw, km = jax.random.split(jax.random.key(seed), 3)
  mask = jaxsparse.random_block_mask(km, (k, n), block_shape, density)
  ws = jaxsparse.BlockSparseMatrix.from_dense(jax.random.normal(kw, (k, n)).astype(dtype), block_shape, mask)
  return jax.random.normal(kx, (*lead, k)).astype(dtype), ws


# In the fast set: wide blocks at 0.3 and every block (density 1) in float32, narrow ones in bfloat16.
BLOCK_CASES_FAST = {((8, 16), 0.3, jnp.float32), ((16, 64), 1.0, jnp.float32), ((32, 8), 0.2, jnp.bfloat16)}


@pytest.mark.parametrize(("block_shape", "density", "dtype"), [
    (block_shape, density, dtype) if (block_shape, density, dtype) in BLOCK_CASES_FAST
    # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
    else pytest.param(block_shape, density, dtype, marks=pytest.mark.slow)
    for dtype in (jnp.float32, jnp.bfloat16)
    for block_shape, density in [((8, 16), 0.3), ((32, 32), 0.5), ((16, 64), 1.0), ((32, 8), 0.2)]
])
def test_block_sparse_cpu_kernels_match_dense(dtype, block_shape, density):
  x, ws = _block_case(10, (3, 13), 128, 128, block_shape, density, dtype)
  op = lambda x, data: jaxsparse.ops.block_sparse_matmul(x, ws.with_data(data), implementation="xla")
  assert ("jaxsparse_block_forward" in _cpu_hlo(op, x, ws.data)) == CPU_DEFAULT  # a GPU machine's CPU: the loop
  ref = lambda x, data: x @ ws.with_data(data).to_dense()
  ct = _cotangent((3, 13, 128))
  loss = lambda f: lambda x, d: jnp.sum(f(x, d).astype(jnp.float32) * ct)
  x32, d32 = x.astype(jnp.float32), ws.data.astype(jnp.float32)
  assert_close(jax.jit(op)(x, ws.data), ref(x32, d32), dtype)
  g = jax.jit(jax.grad(loss(op), argnums=(0, 1)))(x, ws.data)
  g_ref = jax.grad(loss(ref), argnums=(0, 1))(x32, d32)
  assert g[0].dtype == dtype and g[1].dtype == dtype
  assert_close(g[0], g_ref[0], dtype)
  assert_close(g[1], g_ref[1], dtype)


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_block_sparse_cpu_kernels_vmap_and_fallback():
  x, ws = _block_case(11, (4, 5), 64, 96, (16, 32), 0.5)
  op = lambda x, data: jaxsparse.ops.block_sparse_matmul(x, ws.with_data(data))
  dense = ws.to_dense()
  assert_close(jax.vmap(op, in_axes=(0, None))(x, ws.data), x @ dense, jnp.float32)
  two = jnp.stack([ws.data, -ws.data])
  assert_close(jax.vmap(op, in_axes=(None, 0))(x[0], two), jnp.stack([x[0] @ dense, -(x[0] @ dense)]), jnp.float32)
  g = jax.vmap(jax.grad(lambda xi, d: jnp.sum(jnp.sin(op(xi, d))), argnums=1), in_axes=(0, None))(x, ws.data)
  g_ref = jax.vmap(jax.grad(lambda xi, d: jnp.sum(jnp.sin(xi @ ws.with_data(d).to_dense())), argnums=1), (0, None))(
      x, ws.data
  )
  assert_close(g, g_ref, jnp.float32)
  # Blocks whose sizes are not multiples of 8 run the XLA loop.
  x, ws = _block_case(12, (5,), 24, 20, (12, 4), 0.5)
  hlo = _cpu_hlo(lambda x: jaxsparse.ops.block_sparse_matmul(x, ws), x)
  assert "jaxsparse_block_forward" not in hlo
  assert_close(jaxsparse.ops.block_sparse_matmul(x, ws), x @ ws.to_dense(), jnp.float32)


@cpu_backend_only
def test_block_sparse_falls_back_to_the_loop_without_kernels(monkeypatch):
  monkeypatch.setattr(_build, "_load", lambda: "no C++ compiler found (test)")
  x, ws = _block_case(13, (5,), 64, 64, (16, 16), 0.5)
  with pytest.warns(CpuKernelFallbackWarning, match="block_sparse_matmul: the C"):
    y = jaxsparse.ops.block_sparse_matmul(x, ws)
  assert_close(y, x @ ws.to_dense(), jnp.float32)


_BAD_PREFERRED = [("fp32", "not a dtype: str"), (jnp.int32, "dtype int32"), (3, "not a dtype: int"),
                  (object(), "not a dtype: object"), ("complex64", "dtype complex64")]


@pytest.mark.parametrize(("value", "what"), _BAD_PREFERRED)
@pytest.mark.parametrize("op", ["sparse_matmul", "sparse_matmul_reference", "masked_matmul"])
def test_bad_preferred_element_type_names_the_argument(op, value, what):
  """A string that is no dtype failed deep in jnp.dtype; an int dtype computed in ints (masked_matmul of 0.4 * w gave
  truncated integers, silently)."""
  x, w, mask = _data(3, 2, 16, 8, MASKS["random"])
  run = {"sparse_matmul": lambda **kw: sparse_matmul(x, jaxsparse.CSRMatrix.from_dense(w, mask=mask), **kw),
         "sparse_matmul_reference": lambda **kw: sparse_matmul_reference(
             x, jaxsparse.CSRMatrix.from_dense(w, mask=mask), **kw),
         "masked_matmul": lambda **kw: masked_matmul(x, w, mask, **kw)}[op]
  with pytest.raises(TypeError, match=rf"preferred_element_type must be a floating dtype .* or None .*, got "
                                      rf"preferred_element_type={re.escape(repr(value))} \({what}\)"):
    run(preferred_element_type=value)


@pytest.mark.parametrize("value", ["float32", np.dtype("float32"), jnp.float32])
def test_preferred_element_type_any_spelling_of_a_floating_dtype(value):
  """Every spelling of a floating dtype is taken: bfloat16 operands give a float32 product."""
  x, w, mask = _data(4, 3, 16, 8, MASKS["random"], dtype=jnp.bfloat16)
  expected = x.astype(jnp.float32) @ jnp.where(mask, w, 0).astype(jnp.float32)
  for y in (masked_matmul(x, w, mask, preferred_element_type=value),
            sparse_matmul(x, jaxsparse.CSRMatrix.from_dense(w, mask=mask), preferred_element_type=value)):
    assert y.dtype == jnp.float32
    assert_close(y, expected, jnp.bfloat16)
