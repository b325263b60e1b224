"""The Pallas N:M kernel against the dense reference.

On a CPU the kernel runs in Pallas interpret mode on tiny shapes. Tests marked ``gpu`` compile it for
a CUDA GPU (``pytest -m gpu tests/test_pallas_nm.py`` on the device machine, see
``benchmarks/gpu_nm.py``); they skip elsewhere.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxsparse import NMSparseMatrix
from jaxsparse.ops import nm_matmul
from jaxsparse.pallas import NMMatmulConfig
from jaxsparse.pallas import _nm_matmul as kernels

# ‖out - ref‖ / ‖ref‖ against float32 products of the same (rounded) inputs: float32 dots run in
# full float32 in interpret mode and with precision=HIGHEST on the GPU; 16-bit outputs are rounded.
RTOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2, jnp.float16: 3e-3}
# On the GPU a float32 dot at default precision uses TF32 tensor cores, as XLA's own dots do there.
RTOL_TF32 = 1e-3

needs_gpu = pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable_reason())


@pytest.fixture(autouse=True)
def _quiet_triton_deprecation():
  # jax 0.11 warns at each lowering that the Pallas Triton backend is deprecated.
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    yield


def _problem(rows, k, cols, n, m, dtype, seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  w = NMSparseMatrix.from_dense(jax.random.normal(k1, (k, cols), jnp.float32).astype(dtype), n, m)
  x = jax.random.normal(k2, (rows, k), jnp.float32).astype(dtype)
  return x, w


def _reference(x, w):
  f32 = lambda a: a.astype(jnp.float32)
  return jnp.matmul(f32(x), f32(w.to_dense()), precision=lax.Precision.HIGHEST)


def _assert_close(out, ref, rtol):
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  assert out.shape == ref.shape, (out.shape, ref.shape)
  assert np.all(np.isfinite(out)), "non-finite values"
  err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
  assert err <= rtol, f"relative error {err:.2e} > {rtol:.0e}"


# -------------------------------------------------------------------------------------------------
# Interpret mode (CPU CI): tiny shapes.
# -------------------------------------------------------------------------------------------------

INTERPRET_CASES = [
    # (rows, k, cols, n, m, dtype, config)
    (5, 128, 32, 2, 4, jnp.float32, NMMatmulConfig(block_n=32, block_groups=16)),
    (20, 128, 32, 2, 4, jnp.bfloat16, NMMatmulConfig(block_n=16, block_groups=8, split_k=2)),
    (3, 256, 32, 1, 4, jnp.float32, NMMatmulConfig(block_n=32, block_groups=16)),
    (16, 128, 48, 4, 8, jnp.float32, NMMatmulConfig(block_n=32, block_groups=8)),  # block_n shrinks to 16
    (7, 256, 16, 1, 2, jnp.bfloat16, NMMatmulConfig(block_n=16, block_groups=8)),
    (2, 128, 16, 3, 16, jnp.float32, NMMatmulConfig(block_n=16, block_groups=4, split_k=2)),
]


@pytest.mark.parametrize(("rows", "k", "cols", "n", "m", "dtype", "config"), INTERPRET_CASES)
def test_interpret_matches_dense(rows, k, cols, n, m, dtype, config):
  x, w = _problem(rows, k, cols, n, m, dtype, seed=rows)
  y = kernels.forward(x, w, config=config, interpret=True, precision=lax.Precision.HIGHEST)
  assert y.dtype == dtype
  _assert_close(y, _reference(x, w), RTOL[dtype])


def test_interpret_default_config_and_mixed_dtypes():
  x, w = _problem(4, 128, 64, 2, 4, jnp.float32, seed=9)
  y = kernels.forward(x.astype(jnp.bfloat16), w, interpret=True, precision=lax.Precision.HIGHEST)
  assert y.dtype == jnp.float32
  _assert_close(y, _reference(x.astype(jnp.bfloat16), w), RTOL[jnp.float32])


def test_supports_and_reasons():
  x, w = _problem(4, 64, 32, 2, 4, jnp.bfloat16)
  assert kernels.supports(x, w)
  odd_m = NMSparseMatrix.from_dense(jnp.ones((48, 32)), 1, 3)
  assert "m=3" in kernels.unsupported_reason(jnp.ones((4, 48)), odd_m)
  by_cols = NMSparseMatrix.from_dense(jnp.ones((64, 32)), 2, 4, axis=1)
  assert "axis 0" in kernels.unsupported_reason(jnp.ones((4, 64)), by_cols)
  narrow = NMSparseMatrix.from_dense(jnp.ones((64, 24)), 2, 4)
  assert "multiple of 16" in kernels.unsupported_reason(jnp.ones((4, 64)), narrow)
  short = NMSparseMatrix.from_dense(jnp.ones((8, 32)), 2, 4)
  assert "K=8" in kernels.unsupported_reason(jnp.ones((4, 8)), short)
  assert "dtype int32" in kernels.unsupported_reason(x.astype(jnp.int32), w)
  assert "2-D" in kernels.unsupported_reason(jnp.ones((2, 2, 64)), w)
  with pytest.raises(ValueError, match="does not support these operands: m=3"):
    kernels.forward(jnp.ones((4, 48)), odd_m, interpret=True)


def test_config_validation_and_defaults():
  with pytest.raises(ValueError, match="block_m must be a power of two >= 16, got block_m=24"):
    NMMatmulConfig(block_m=24)
  with pytest.raises(ValueError, match="block_groups must be a power of two, got block_groups=3"):
    NMMatmulConfig(block_groups=3)
  with pytest.raises(ValueError, match="split_k must be >= 1"):
    NMMatmulConfig(split_k=0)
  # Decode: 128 columns per program, K split until about 512 programs run.
  decode = NMMatmulConfig.get_default(16, (4096, 4096), 2, 4, jnp.bfloat16)
  assert (decode.block_m, decode.block_n, decode.block_groups, decode.split_k) == (16, 128, 8, 8)
  wide = NMMatmulConfig.get_default(16, (4096, 16384), 2, 4, jnp.bfloat16)
  assert (wide.block_n, wide.split_k) == (128, 4)
  assert NMMatmulConfig.get_default(16, (4096, 4096), 2, 4, jnp.float32).block_groups == 4  # fits shared memory
  assert NMMatmulConfig.get_default(8192, (4096, 4096), 2, 4, jnp.bfloat16).block_m == 128
  assert kernels.preferred(jnp.ones((16, 64)), _problem(1, 64, 32, 2, 4, jnp.float32)[1])


# -------------------------------------------------------------------------------------------------
# GPU (run on the device machine, see benchmarks/gpu_nm.py).
# -------------------------------------------------------------------------------------------------

GPU_CASES = [
    (rows, k, cols, n, m, dtype)
    for (rows, k, cols) in [(16, 4096, 4096), (5, 1024, 768), (1, 512, 256), (300, 1024, 512)]
    for (n, m) in [(2, 4), (1, 4), (4, 8), (1, 2), (2, 8)]
    for dtype in [jnp.bfloat16, jnp.float16, jnp.float32]
    if (n, m) == (2, 4) or dtype == jnp.bfloat16
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("rows", "k", "cols", "n", "m", "dtype"), GPU_CASES)
def test_gpu_matches_dense(rows, k, cols, n, m, dtype):
  x, w = _problem(rows, k, cols, n, m, dtype, seed=rows + k)
  y = jax.jit(kernels.forward)(x, w)
  rtol = RTOL_TF32 if dtype == jnp.float32 else RTOL[dtype]
  _assert_close(y, _reference(x, w), rtol)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    "config",
    [
        NMMatmulConfig(block_n=32, block_groups=64, num_stages=4),
        NMMatmulConfig(block_n=64, block_groups=32, split_k=4),
        NMMatmulConfig(block_n=128, block_groups=16, num_warps=8),
        NMMatmulConfig(block_n=128, block_groups=8, num_stages=4, split_k=8),
        NMMatmulConfig(block_m=64, block_n=128, block_groups=16, num_warps=8, group_m=4),
    ],
)
def test_gpu_configs(config):
  x, w = _problem(40, 2048, 1024, 2, 4, jnp.bfloat16, seed=3)
  y = jax.jit(functools.partial(kernels.forward, config=config))(x, w)
  _assert_close(y, _reference(x, w), RTOL[jnp.bfloat16])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("cols", [4096, 16384])
def test_gpu_decode_default_config(rows, cols):
  # The default decode tiling at the benchmarked shapes (K = 4096), rows below the 16-row tile,
  # and through the op with leading batch dims on x.
  x, w = _problem(rows, 4096, cols, 2, 4, jnp.bfloat16, seed=rows + cols)
  _assert_close(jax.jit(kernels.forward)(x, w), _reference(x, w), RTOL[jnp.bfloat16])
  y = jax.jit(nm_matmul)(x.reshape(rows, 1, 4096), w)
  _assert_close(y.reshape(rows, cols), _reference(x, w), RTOL[jnp.bfloat16])


@pytest.mark.gpu
@needs_gpu
def test_gpu_float32_highest_precision():
  x, w = _problem(16, 1024, 256, 2, 4, jnp.float32, seed=4)
  y = jax.jit(functools.partial(kernels.forward, precision=lax.Precision.HIGHEST))(x, w)
  _assert_close(y, _reference(x, w), RTOL[jnp.float32] * 5)


@pytest.mark.gpu
@needs_gpu
def test_gpu_float32_result_of_bfloat16_operands_is_not_rounded():
  # The Pallas route cast the kernel's bfloat16 result to float32: the float32 result had bfloat16's digits.
  x, w = _problem(16, 1024, 512, 2, 4, jnp.bfloat16, seed=7)
  y = jax.jit(lambda x, w: nm_matmul(x, w, implementation="pallas", preferred_element_type=jnp.float32))(x, w)
  assert y.dtype == jnp.float32
  _assert_close(y, _reference(x, w), RTOL[jnp.float32] * 5)


@pytest.mark.gpu
@needs_gpu
def test_gpu_nm_matmul_uses_kernel_for_decode_and_differentiates():
  x, w = _problem(16, 1024, 512, 2, 4, jnp.bfloat16, seed=5)
  f = jax.jit(lambda x, v: nm_matmul(x, w.with_values(v)))
  assert "triton" in f.lower(x, w.values).compile().as_text().lower()
  dy = jax.random.normal(jax.random.key(6), (16, 512), jnp.float32).astype(jnp.bfloat16)
  y, vjp = jax.vjp(f, x, w.values)
  dx, dv = vjp(dy)

  def dense(x, v):
    return jnp.matmul(x, w.with_values(v).to_dense().astype(jnp.float32), precision=lax.Precision.HIGHEST)

  y_ref, vjp_ref = jax.vjp(dense, x.astype(jnp.float32), w.values.astype(jnp.float32))
  dx_ref, dv_ref = vjp_ref(dy.astype(jnp.float32))
  for out, ref in ((y, y_ref), (dx, dx_ref), (dv, dv_ref)):
    _assert_close(out, ref, RTOL[jnp.bfloat16])


@pytest.mark.gpu
@needs_gpu
def test_gpu_many_rows_use_dense_product():
  x, w = _problem(512, 1024, 512, 2, 4, jnp.bfloat16, seed=7)
  y = jax.jit(nm_matmul)(x, w)
  _assert_close(y, _reference(x, w), RTOL[jnp.bfloat16])
  y_kernel = jax.jit(kernels.forward)(x, w)
  _assert_close(y_kernel, _reference(x, w), RTOL[jnp.bfloat16])
