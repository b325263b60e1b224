"""block_sparse_matmul against its dense reference: forward and gradients, jit, vmap, f32/bf16."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import jaxsparse
from jaxsparse._cpu import _build as _cpu_build
from jaxsparse.ops import block_sparse_matmul
from jaxsparse.ops import block_sparse_matmul_reference
from tests._util import SPLIT_EXAMPLES
from tests._util import assert_close

SETTINGS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _make(seed, k, n, block_shape, mask_fn, dtype=jnp.float32, lead=(5,)):
  kw, kx = jax.random.split(jax.random.key(seed))
  kb, nb = k // block_shape[0], n // block_shape[1]
  mask = np.asarray(mask_fn(np.random.default_rng(seed), (kb, nb)), dtype=bool)
  w = jax.random.normal(kw, (k, n), jnp.float32).astype(dtype)
  ws = jaxsparse.BlockSparseMatrix.from_dense(w, block_shape, block_mask=mask)
  x = jax.random.normal(kx, (*lead, k), jnp.float32).astype(dtype)
  return x, ws


def _random_mask(density):
  return lambda rng, shape: rng.random(shape) < density


def _check_all(x, ws, dtype):
  """Forward, dX and dData against autodiff of the dense reference, under jit."""
  x32, d32 = x.astype(jnp.float32), ws.data.astype(jnp.float32)
  ct = jax.random.normal(jax.random.key(7), (*x.shape[:-1], ws.shape[1]), jnp.float32)

  def loss(fn, x, data):
    return jnp.sum(fn(x, ws.with_data(data)).astype(jnp.float32) * ct)

  # A GPU's float32 products at the default precision run on TF32 tensor cores (the op's kernels and the reference's
  # XLA dot alike, each rounding its own way): 1e-3 there, as in test_pallas_nm.py.
  factor = 100.0 if dtype == jnp.float32 and jax.default_backend() != "cpu" else 1.0
  y = jax.jit(block_sparse_matmul)(x, ws)
  assert y.dtype == dtype and y.shape == (*x.shape[:-1], ws.shape[1])
  assert_close(y, block_sparse_matmul_reference(x32, ws.with_data(d32)), dtype, factor=factor)
  g = jax.jit(jax.grad(lambda a, b: loss(block_sparse_matmul, a, b), argnums=(0, 1)))(x, ws.data)
  g_ref = jax.grad(lambda a, b: loss(block_sparse_matmul_reference, a, b), argnums=(0, 1))(x32, d32)
  assert g[0].dtype == x.dtype and g[1].dtype == ws.data.dtype
  assert_close(g[0], g_ref[0], dtype, factor=factor)
  assert_close(g[1], g_ref[1], dtype, factor=factor)


@SPLIT_EXAMPLES  # 6 examples in the fast set, 6 more with `make test-slow`
@SETTINGS
@given(
    seed=st.integers(0, 2**16),
    kb=st.integers(1, 5),
    nb=st.integers(1, 5),
    bk=st.sampled_from([8, 16, 32]),
    bn=st.sampled_from([8, 16, 32]),
    density=st.floats(0.05, 1.0),
    m=st.integers(1, 9),
)
def test_matches_dense_reference_f32(examples, seed, kb, nb, bk, bn, density, m):
  x, ws = _make(seed, kb * bk, nb * bn, (bk, bn), _random_mask(density), lead=(m,))
  _check_all(x, ws, jnp.float32)


PATTERNS = {
    "random": _random_mask(0.4),
    "dense": lambda rng, s: np.ones(s, bool),
    "single_block": lambda rng, s: np.eye(*s, dtype=bool) & (np.arange(s[0])[:, None] == 1),
    "empty_row_and_col": lambda rng, s: np.pad(np.ones((s[0] - 1, s[1] - 1), bool), ((1, 0), (0, 1))),
    "empty": lambda rng, s: np.zeros(s, bool),
}


# Every pattern in float32; the 16-bit dtypes on the random and empty-row-and-column patterns in the fast set.
@pytest.mark.parametrize(("name", "dtype"), [
    (name, dtype) if dtype == jnp.float32 or name in ("random", "empty_row_and_col")
    # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
    else pytest.param(name, dtype, marks=pytest.mark.slow)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16) for name in PATTERNS
])
def test_patterns_and_dtypes(name, dtype):
  mask_fn = PATTERNS[name]
  x, ws = _make(3, 96, 64, (32, 16), mask_fn, dtype=dtype, lead=(2, 3))
  _check_all(x, ws, dtype)


@pytest.mark.parametrize("block_shape", [
    (8, 8),
    # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it. (Rectangular blocks: also
    # test_patterns_and_dtypes and the hypothesis test.)
    pytest.param((16, 64), marks=pytest.mark.slow),
    pytest.param((64, 16), marks=pytest.mark.slow),
    (128, 128),
    (256, 256),
])
def test_block_sizes(block_shape):
  x, ws = _make(1, 256, 256, block_shape, _random_mask(0.5), lead=(4,))
  _check_all(x, ws, jnp.float32)


def test_vmap_over_x_and_data():
  x, ws = _make(4, 64, 96, (16, 32), _random_mask(0.5), lead=(3, 4))
  y = jax.vmap(lambda xi: block_sparse_matmul(xi, ws))(x)
  assert_close(y, block_sparse_matmul_reference(x, ws), jnp.float32)
  datas = jnp.stack([ws.data, 2.0 * ws.data + 1.0])
  yb = jax.jit(jax.vmap(lambda d: block_sparse_matmul(x, ws.with_data(d))))(datas)
  for b in range(2):
    assert_close(yb[b], block_sparse_matmul_reference(x, ws.with_data(datas[b])), jnp.float32)
  # Gradients through vmap.
  g = jax.grad(lambda d: jnp.sum(jnp.sin(jax.vmap(lambda xi: block_sparse_matmul(xi, ws.with_data(d)))(x))))(
      ws.data
  )
  g_ref = jax.grad(lambda d: jnp.sum(jnp.sin(x @ ws.with_data(d).to_dense())))(ws.data)
  assert_close(g, g_ref, jnp.float32)


def test_vmap_of_numpy_inputs_matches_jax_inputs():
  # vmap hands NumPy inputs to the kernels' batching rule as NumPy; a per-element rule must still slice them.
  x, ws = _make(6, 16, 24, (8, 8), _random_mask(0.7), lead=(2, 3))
  xs = np.asarray(x)
  per_example_grad = jax.vmap(jax.grad(lambda xi: (block_sparse_matmul(xi, ws) ** 2).sum()))
  assert_close(per_example_grad(xs), per_example_grad(jnp.asarray(xs)), jnp.float32)
  stacked = jax.tree_util.tree_map(lambda a: np.stack([np.asarray(a)] * 2), ws)
  y = jax.vmap(block_sparse_matmul)(xs, stacked)
  assert_close(y, block_sparse_matmul_reference(x, ws), jnp.float32)
  per_example_dw = jax.vmap(jax.grad(lambda d, xi: block_sparse_matmul(xi, ws.with_data(d)).sum()), in_axes=(None, 0))
  assert_close(per_example_dw(np.asarray(ws.data), xs), per_example_dw(ws.data, x), jnp.float32)


def test_grad_through_pytree_and_second_use():
  x, ws = _make(5, 64, 64, (16, 16), _random_mask(0.5))
  gw = jax.grad(lambda w: jnp.sum(block_sparse_matmul(x, w) ** 2), allow_int=True)(ws)
  assert isinstance(gw, jaxsparse.BlockSparseMatrix)
  g_ref = jax.grad(lambda d: jnp.sum((x @ ws.with_data(d).to_dense()) ** 2))(ws.data)
  assert_close(gw.data, g_ref, jnp.float32)


def test_preferred_element_type_and_mixed_dtypes():
  x, ws = _make(6, 64, 32, (16, 16), _random_mask(0.6), dtype=jnp.bfloat16)
  y = block_sparse_matmul(x, ws, preferred_element_type=jnp.float32)
  assert y.dtype == jnp.float32
  assert_close(y, block_sparse_matmul_reference(x.astype(jnp.float32), ws.with_data(ws.data.astype(jnp.float32))),
               jnp.float32, factor=10.0)
  y2 = block_sparse_matmul(x.astype(jnp.float32), ws)
  assert y2.dtype == jnp.float32


def test_xla_implementation_explicit_and_pallas_unavailable_on_cpu():
  x, ws = _make(8, 32, 32, (16, 16), _random_mask(0.5))
  y = block_sparse_matmul(x, ws, implementation="xla")
  assert_close(y, block_sparse_matmul_reference(x, ws), jnp.float32)
  if jax.default_backend() == "cpu":
    with pytest.raises(RuntimeError, match="implementation='pallas'"):
      block_sparse_matmul(x, ws, implementation="pallas")


def test_no_dense_weight_in_program():
  """Neither the forward nor the backward program holds a K x N array."""
  k, n = 512, 384
  x, ws = _make(9, k, n, (32, 32), _random_mask(0.2), lead=(8,))

  def loss(x, d):
    return jnp.sum(block_sparse_matmul(x, ws.with_data(d)))

  hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, ws.data).as_text()
  assert f"{k},{n}]" not in hlo and f"{n},{k}]" not in hlo


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"implementation": "cuda"}, ValueError, "implementation must be one of"),
        ({"x_shape": (4, 33)}, ValueError, r"x must have shape \(\.\.\., K\) with K = w.shape\[0\] = 32"),
        ({"x_dtype": jnp.int32}, TypeError, "x must have a floating dtype"),
        ({"w": "dense"}, TypeError, "w must be a jaxsparse.BlockSparseMatrix"),
    ],
)
def test_bad_input(kwargs, exc, match):
  x, ws = _make(0, 32, 32, (16, 16), _random_mask(0.5))
  x = jnp.ones(kwargs.get("x_shape", x.shape), kwargs.get("x_dtype", jnp.float32))
  w = ws.to_dense() if kwargs.get("w") == "dense" else ws
  with pytest.raises(exc, match=match):
    block_sparse_matmul(x, w, implementation=kwargs.get("implementation"))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the C++ CPU kernels' fallback: a GPU runs its own route")
@pytest.mark.parametrize("wrap", ["eager", "jit", "grad"])
def test_fallback_warnings_point_at_the_callers_line(monkeypatch, wrap):
  # One base class for every fallback, and the warning names the user's line however deep the op was called from.
  monkeypatch.setattr(_cpu_build, "load", lambda: False)
  monkeypatch.setattr(_cpu_build, "unavailable_reason", lambda: "disabled by the test")
  w = jaxsparse.BlockSparseMatrix.from_dense(jnp.ones((32, 32)), (16, 16))
  f = lambda x: block_sparse_matmul(x, w).sum()
  g = {"eager": f, "jit": jax.jit(f), "grad": jax.jit(jax.grad(f))}[wrap]
  with pytest.warns(jaxsparse.FallbackWarning) as record:
    g(jnp.ones((2, 32)))
  assert all(isinstance(r.message, _cpu_build.CpuKernelFallbackWarning) for r in record)
  assert {r.filename for r in record} == {__file__}, [(r.filename, r.lineno) for r in record]


def test_vmap_over_an_empty_batch():
  # vmap of a zero-size batch hands the products the whole (empty) batch at once: the products got M = 0 rows,
  # which no kernel tiles (ZeroDivisionError choosing the GPU tiles, even on CPU where every platform is lowered).
  x, ws = _make(10, 64, 32, (16, 16), _random_mask(0.6), lead=(0, 3))
  f = jax.vmap(lambda xi, d: block_sparse_matmul(xi, ws.with_data(d)), in_axes=(0, None))
  y = f(x, ws.data)
  assert y.shape == (0, 3, 32) and y.dtype == jnp.float32
  gx, gd = jax.grad(lambda a, d: jnp.sum(f(a, d) ** 2), argnums=(0, 1))(x, ws.data)
  assert gx.shape == x.shape and gd.shape == ws.data.shape and not np.asarray(gd).any()
  gg = jax.grad(lambda a: jnp.sum(jax.grad(lambda b: jnp.sum(f(b, ws.data) ** 3))(a)))(x)
  assert gg.shape == x.shape
  # A non-empty batch through the same function still matches the dense product.
  x3, _ = _make(10, 64, 32, (16, 16), _random_mask(0.6), lead=(2, 3))
  assert_close(f(x3, ws.data), x3 @ ws.to_dense(), jnp.float32)


# On a GPU the float32 operands' products run at the default precision's TF32 there, as x @ w.to_dense()'s do; the
# route that takes float64 results there is checked by test_float64_result_takes_the_dense_route_on_gpus.
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's float32 products are exact in float64")
@pytest.mark.parametrize("block_shape", [(32, 32), (4, 8)])  # the C++ kernels' blocks, and the XLA loop's
@pytest.mark.parametrize("implementation", [None, "xla"])
def test_float64_result_of_float32_operands_accumulates_in_float64(block_shape, implementation):
  # preferred_element_type=float64 asks for x @ W accumulated in float64 (as jnp.matmul does); the kernels and the
  # loop accumulated in float32 and cast the sum, a 1e-4 error against float64 where the reference is exact to 1e-12.
  rng = np.random.default_rng(0)
  k = 2048
  w = rng.standard_normal((k, 64)).astype(np.float32)
  x = rng.standard_normal((4, k)).astype(np.float32)
  mask = rng.random((k // block_shape[0], 64 // block_shape[1])) < 0.7
  with jax.enable_x64(True):
    ws = jaxsparse.BlockSparseMatrix.from_dense(jnp.asarray(w), block_shape, block_mask=mask)
    exact = x.astype(np.float64) @ np.asarray(ws.to_dense(), np.float64)
    y = block_sparse_matmul(jnp.asarray(x), ws, preferred_element_type=jnp.float64, implementation=implementation)
    assert y.dtype == jnp.float64
    # float64 products of float32 values summed over K = 2048: rounding ~1e-13 (float32 accumulation: ~1e-4).
    np.testing.assert_allclose(np.asarray(y), exact, rtol=0, atol=1e-9)
    g = jax.grad(lambda d: jnp.sum(block_sparse_matmul(jnp.asarray(x), ws.with_data(d),
                                                       preferred_element_type=jnp.float64) ** 2))(ws.data)
    g_ref = jax.grad(lambda d: jnp.sum(block_sparse_matmul_reference(
        jnp.asarray(x), ws.with_data(d), preferred_element_type=jnp.float64) ** 2))(ws.data)
    assert g.dtype == jnp.float32
    assert_close(g, g_ref, jnp.float32)


def test_float64_result_takes_the_dense_route_on_gpus():
  # The Pallas kernels accumulate in float32 too: a float64 result of float32 operands runs on the dense route.
  from jaxsparse.ops import _block_sparse_matmul as bsm_module  # noqa: PLC0415 -- internals of the GPU routing

  kernels = bsm_module._pallas_ops()
  if kernels is None:
    pytest.skip("jaxsparse.pallas cannot be imported here")
  x, ws = _make(11, 256, 256, (128, 128), _random_mask(0.5), lead=(8,))
  x2 = x.reshape(-1, 256)
  for out_dtype, dense_only in ((jnp.float32, False), (jnp.bfloat16, False), (np.dtype("float64"), True)):
    names = [n for n, _ in bsm_module._gpu_routes(kernels, "fwd", x2, ws, precision=None, out_dtype=out_dtype)]
    assert (names == ["dense"]) == dense_only, (out_dtype, names)


_BAD_PREFERRED = [("fp32", "not a dtype: str"), (jnp.int32, "dtype int32"), (3, "not a dtype: int"),
                  (object(), "not a dtype: object"), ("bool", "dtype bool")]


@pytest.mark.parametrize(("value", "what"), _BAD_PREFERRED)
@pytest.mark.parametrize("op", [block_sparse_matmul, block_sparse_matmul_reference])
def test_bad_preferred_element_type_names_the_argument(op, value, what):
  """A string that is no dtype failed deep in jnp.dtype; an int dtype computed in ints (truncating every output)."""
  x, ws = _make(0, 32, 32, (16, 16), _random_mask(0.5))
  with pytest.raises(TypeError, match=rf"preferred_element_type must be a floating dtype .* or None .*, got "
                                      rf"preferred_element_type={re.escape(repr(value))} \({what}\)"):
    op(x, ws, preferred_element_type=value)


@pytest.mark.parametrize("value", ["float32", np.dtype("float32"), jnp.float32])
def test_preferred_element_type_any_spelling_of_a_floating_dtype(value):
  """Every spelling of a floating dtype is taken: bfloat16 operands give a float32 product."""
  x, ws = _make(1, 32, 32, (16, 16), _random_mask(0.5), dtype=jnp.bfloat16)
  y = block_sparse_matmul(x, ws, preferred_element_type=value)
  expected = jnp.matmul(x.astype(jnp.float32), ws.to_dense().astype(jnp.float32))
  assert y.dtype == jnp.float32
  assert_close(y, expected, jnp.bfloat16)
