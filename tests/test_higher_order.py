"""Second- and third-order reverse-mode derivatives of the sparse products (grad of grad) against dense autodiff.

The products' backward passes run kernels JAX cannot differentiate (the C++ FFI kernels here, Pallas on a GPU);
``ops._bilinear`` makes each backward pass a custom VJP too. Checked: Hessian-vector products in ``x``, mixed
second derivatives in ``x`` and the kept values, a third derivative, under ``jit`` and ``vmap``, float32 and
bfloat16, on the default (kernel) path of each op. Forward mode stays unsupported and says so.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import jaxsparse
from jaxsparse import ops
from tests._util import assert_close
from tests._util import rel_err

SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
OPS = ("block", "block_xla", "csr", "masked", "masked_dense", "nm")


def _problem(op: str, seed: int, m: int, k: int, n: int, block: tuple[int, int], density: float, dtype):
  """``(f, f_ref, x, values)``: the op and its dense reference on the same pattern (a plain product, of an optional
  ``precision``) as functions of ``x`` and the kept values."""
  mm = lambda x, wd, precision: jnp.matmul(x, wd, precision=precision)
  rng = np.random.default_rng(seed)
  kw, kx = jax.random.split(jax.random.key(seed))
  w = jax.random.normal(kw, (k, n), jnp.float32).astype(dtype)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
  if op.startswith("block"):
    mask = rng.random((k // block[0], n // block[1])) < density
    ws = jaxsparse.BlockSparseMatrix.from_dense(w, block, block_mask=mask)
    impl = "xla" if op == "block_xla" else None
    f = lambda x, v: ops.block_sparse_matmul(x, ws.with_data(v), implementation=impl)
    return f, lambda x, v, precision=None: mm(x, ws.with_data(v).to_dense(), precision), x, ws.data
  if op == "csr":
    ws = jaxsparse.CSRMatrix.from_dense(w, mask=rng.random((k, n)) < density)
    f = lambda x, v: ops.sparse_matmul(x, ws.with_data(v))
    return f, lambda x, v, precision=None: mm(x, ws.with_data(v).to_dense(), precision), x, ws.data
  if op == "nm":
    ws = jaxsparse.NMSparseMatrix.from_dense(w, 2, 4)
    f = lambda x, v: ops.nm_matmul(x, ws.with_values(v))
    return f, lambda x, v, precision=None: mm(x, ws.with_values(v).to_dense(), precision), x, ws.values
  # masked: the C++ kernels below CPU_MAX_DENSITY, the masked dense branch above it.
  mask = jnp.asarray(rng.random((k, n)) < (0.1 if op == "masked" else 0.6))
  f = lambda x, v: ops.masked_matmul(x, v, mask)
  return f, lambda x, v, precision=None: mm(x, jnp.where(mask, v, 0), precision), x, w


def _second_order(f, x, v, u, t):
  """Derivatives of ``L = sum(tanh(f(x, v)))``: the Hessian-vector products ``d<dL/dx, u>/d(x, v)`` and
  ``d<dL/dv, t>/d(x, v)``."""
  loss = lambda x, v: jnp.sum(jnp.tanh(f(x, v).astype(jnp.float32)))
  gx = lambda x, v: jnp.vdot(jax.grad(loss, 0)(x, v).astype(jnp.float32), u)
  gv = lambda x, v: jnp.vdot(jax.grad(loss, 1)(x, v).astype(jnp.float32), t)
  return jax.grad(gx, (0, 1))(x, v) + jax.grad(gv, (0, 1))(x, v)


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
@SETTINGS
@given(
    seed=st.integers(0, 2**16),
    m=st.integers(1, 9),
    kb=st.integers(1, 4),
    nb=st.integers(1, 4),
    block=st.sampled_from([(8, 8), (16, 8), (8, 32)]),
    density=st.floats(0.2, 1.0),
    op=st.sampled_from(OPS),
)
def test_second_order_matches_dense(seed, m, kb, nb, block, density, op):
  f, f_ref, x, v = _problem(op, seed, m, kb * block[0], nb * block[1], block, density, jnp.float32)
  ku, kt = jax.random.split(jax.random.key(seed + 1))
  u, t = jax.random.normal(ku, x.shape), jax.random.normal(kt, v.shape)
  got = jax.jit(_second_order, static_argnums=0)(f, x, v, u, t)
  want = _second_order(f_ref, x, v, u, t)
  for g, r, like in zip(got, want, (x, v, x, v), strict=True):
    assert g.dtype == like.dtype and g.shape == like.shape
    assert_close(g, r, jnp.float32, factor=10)


# long: masked and csr moved out of the fast set (make test <= 15 min on 2 cores); CI runs them
@pytest.mark.parametrize(
    "op", ["block", pytest.param("masked", marks=pytest.mark.slow), pytest.param("csr", marks=pytest.mark.slow), "nm"]
)
def test_second_order_bfloat16(op):
  f, f_ref, x, v = _problem(op, 3, 6, 64, 96, (32, 32), 0.5, jnp.bfloat16)
  u = jax.random.normal(jax.random.key(4), x.shape)
  t = jax.random.normal(jax.random.key(5), v.shape)
  got = jax.jit(_second_order, static_argnums=0)(f, x, v, u, t)
  # The reference: dense autodiff in float32 on the bf16 inputs (the same pattern).
  want = _second_order(f_ref, x.astype(jnp.float32), v.astype(jnp.float32), u, t)
  for g, r, like in zip(got, want, (x, v, x, v), strict=True):
    assert g.dtype == like.dtype
    assert_close(g, r, jnp.bfloat16, factor=3)


@pytest.mark.parametrize("op", ["block", "masked", "csr"])
def test_third_order_and_vmap(op):
  f, f_ref, x, v = _problem(op, 11, 4, 32, 48, (16, 16), 0.5, jnp.float32)
  u = jax.random.normal(jax.random.key(12), x.shape)

  def third(f, x, v):
    # d/dx < d/dx < dL/dx, u >, u > of L = sum(sin(f(x, v))): nonzero third derivative.
    loss = lambda x: jnp.sum(jnp.sin(f(x, v)))
    d1 = lambda x: jnp.vdot(jax.grad(loss)(x), u)
    return jax.grad(lambda x: jnp.vdot(jax.grad(d1)(x), u))(x)

  assert_close(jax.jit(third, static_argnums=0)(f, x, v), third(f_ref, x, v), jnp.float32, factor=10)
  xs = jnp.stack([x, 2 * x, -x])
  hvp = lambda f: jax.vmap(lambda x: jax.grad(lambda x: jnp.vdot(jax.grad(lambda x: jnp.sum(f(x, v) ** 3))(x), u))(x))
  assert_close(jax.jit(hvp(f))(xs), hvp(f_ref)(xs), jnp.float32, factor=10)


def test_forward_mode_is_refused_with_jax_message():
  f, f_ref, x, v = _problem("block", 0, 4, 32, 32, (16, 16), 0.5, jnp.float32)
  with pytest.raises(TypeError, match="forward-mode"):
    jax.jvp(lambda x: f(x, v), (x,), (x,))
  # jacrev of jacrev gives the Hessian where jax.hessian (forward over reverse) cannot.
  h = jax.jacrev(jax.jacrev(lambda x: jnp.sum(f(x, v) ** 2)))(x[:1])
  assert_close(h, jax.hessian(lambda x: jnp.sum(f_ref(x, v) ** 2))(x[:1]), jnp.float32, factor=10)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 256])
# The N:M GPU kernels take 16-bit inputs only (float32 runs XLA, covered on the CPU).
@pytest.mark.parametrize(("op", "dtype"), [("block", jnp.float32), ("block", jnp.bfloat16), ("nm", jnp.bfloat16)])
def test_gpu_second_order(op, dtype, m):
  # The GPU kernels (Pallas Mosaic GPU / Triton, cuSPARSELt, mma.sp, by the default dispatch) in every derivative.
  f, f_ref, x, v = _problem(op, 5, m, 256, 384, (64, 64), 0.4, dtype)
  u = jax.random.normal(jax.random.key(6), x.shape)
  t = jax.random.normal(jax.random.key(7), v.shape)
  got = jax.jit(_second_order, static_argnums=0)(f, x, v, u, t)
  # References in float32 on the same inputs and pattern (an N:M pattern from float32 weights could differ).
  x32, v32 = x.astype(jnp.float32), v.astype(jnp.float32)
  want = _second_order(lambda x, v: f_ref(x, v, jax.lax.Precision.HIGHEST), x32, v32, u, t)
  # float32 runs at DEFAULT precision on the GPU (TF32, 10 mantissa bits), as XLA's own float32 products: as
  # accurate as the dense products at DEFAULT precision, against HIGHEST, within 3x; bf16 to its rounding.
  dense = _second_order(f_ref, x32, v32, u, t)
  for g, r, d in zip(got, want, dense, strict=True):
    if dtype == jnp.float32:
      assert rel_err(g, r) <= max(3 * rel_err(d, r), 1e-5), (rel_err(g, r), rel_err(d, r))
    else:
      assert_close(g, r, dtype, factor=3)
