"""2:4 on sparse tensor cores (cuSPARSELt custom calls) and the ops and layers that use it.

CPU tests cover the fallbacks, warnings, the build's error paths and the custom-VJP plumbing (whose
GPU branch is replaced by the reference off CUDA). Tests marked ``gpu`` run the custom calls against
the dense reference on a CUDA GPU (``pytest -m gpu tests/test_cusparselt.py`` on the device machine,
see ``benchmarks/sweeps/gpu_cusparselt.py``); they skip elsewhere.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import jaxsparse
from jaxsparse import ops
from jaxsparse._cuda import _build
from jaxsparse._cuda import _cusparselt as cslt
from jaxsparse._cuda import _layout
from jaxsparse._tuning import _measure
from jaxsparse.formats import _nm_masks
from jaxsparse.layers import CompressedNMLinear
from jaxsparse.layers import NMLinear
from jaxsparse.ops import _nm_matmul
from jaxsparse.ops import _sr_ste

needs_gpu = pytest.mark.skipif(not cslt.available(), reason=cslt.unavailable_reason() or "cuSPARSELt available")
on_cpu = pytest.mark.skipif(cslt.available(), reason="checks the behaviour without cuSPARSELt")


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _sr_reference(x, w, decay, dtype):
  return x @ ops.sr_ste(w, 2, 4, decay=decay).astype(dtype)


# -------------------------------------------------------------------------------------------------
# CPU: support checks, fallbacks, warnings, build errors.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("k", "n", "dtype", "nm", "axis", "expect"),
    [
        (64, 32, jnp.bfloat16, (2, 4), 0, ""),
        (64, 32, jnp.bfloat16, (1, 4), 0, "2:4 only"),
        (64, 32, jnp.bfloat16, (2, 4), 1, "along K"),
        (64, 32, jnp.float32, (2, 4), 0, "dtype must be"),
        (72, 32, jnp.bfloat16, (2, 4), 0, "multiples of 16"),
        (64, 40, jnp.bfloat16, (2, 4), 0, "multiples of 16"),
    ],
)
def test_unsupported_reason(k, n, dtype, nm, axis, expect):
  reason = cslt.unsupported_reason(k, n, dtype, n_keep=nm[0], m=nm[1], axis=axis)
  assert (expect in reason) if expect else reason == ""


@on_cpu
def test_without_gpu_nothing_is_built_and_forced_backend_raises():
  assert not ops.cusparselt_available()
  assert "CUDA" in cslt.unavailable_reason()
  w = jaxsparse.NMSparseMatrix.from_dense(jnp.ones((32, 16), jnp.bfloat16), 2, 4)
  with pytest.raises(RuntimeError, match="cusparselt"):
    ops.nm_matmul(jnp.ones((2, 32), jnp.bfloat16), w, implementation="cusparselt")
  with pytest.raises(RuntimeError, match="cusparselt"):
    ops.sr_ste_matmul(jnp.ones((2, 32)), jnp.ones((32, 16)), 2, 4, implementation="cusparselt")
  with pytest.raises(ValueError, match="cusparselt_compress"):
    ops.cusparselt_compress(w)


def test_build_reports_why(monkeypatch):
  monkeypatch.setenv("JAXSPARSE_CUSPARSELT", "0")
  assert _build._build() == (None, "disabled by JAXSPARSE_CUSPARSELT=0")
  monkeypatch.setenv("JAXSPARSE_CUSPARSELT", "1")
  monkeypatch.setattr(_build, "has_cuda_device", lambda: True)
  monkeypatch.setattr(_build, "_cusparselt_dir", lambda: None)
  lib, reason = _build._build()
  assert lib is None and "cuSPARSELt not found" in reason


def test_header_search_finds_split_toolkit(tmp_path, monkeypatch):
  a, b = tmp_path / "a" / "include", tmp_path / "b" / "include"
  (a / "crt").mkdir(parents=True)
  b.mkdir(parents=True)
  for f in ("cusparse.h",):
    (b / f).write_text("")
  for f in ("driver_types.h", "library_types.h", "crt/host_defines.h"):
    (a / f).write_text("")
  monkeypatch.setattr(_build, "_cuda_include_dirs", lambda: [a, b])
  dirs, reason = _build._header_dirs()
  assert reason == "" and set(dirs) == {a, b}
  (b / "cusparse.h").unlink()
  dirs, reason = _build._header_dirs()
  assert dirs == [] and "cusparse.h" in reason


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sr_ste_matmul_is_the_reference(dtype):
  kx, kw = jax.random.split(jax.random.key(1))
  w = jax.random.normal(kw, (64, 48))  # float32 master weights
  x = jax.random.normal(kx, (5, 64)).astype(dtype)
  f = jax.jit(lambda x, w: ops.sr_ste_matmul(x, w, 2, 4, decay=0.1, dtype=dtype))
  g = jax.jit(lambda x, w: _sr_reference(x, w, 0.1, dtype))
  np.testing.assert_array_equal(f(x, w), g(x, w))
  loss = lambda fn: lambda x, w: (fn(x, w).astype(jnp.float32) ** 2).sum()
  got = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, w)
  want = jax.jit(jax.grad(loss(g), argnums=(0, 1)))(x, w)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("w_dtype", "dtype"), [(jnp.float32, jnp.bfloat16), (jnp.float32, jnp.float32),
                                                (jnp.bfloat16, jnp.bfloat16)])
def test_sr_ste_matmul_custom_vjp_gives_the_reference_gradients(w_dtype, dtype, monkeypatch):
  # The custom VJPs that wrap the sparse-core forward (residuals: the pruned kernel and the group mask bits), with
  # XLA stand-ins for the CUDA parts (prune and compress: the pruned kernel stands for its buffer; multiply): its value
  # and gradients are the reference's, bit for bit. (The GPU tests below run the real ones.)
  def xla_prune(cfg, sparse, w):
    pruned, bits = _sr_ste._p_prune_xla(cfg, w)
    return pruned, bits, pruned if sparse else None

  monkeypatch.setattr(_sr_ste, "_p_prune", xla_prune)
  monkeypatch.setattr(_sr_ste.cslt, "matmul", lambda x2, blob, n: x2 @ blob)
  kx, kw, kg = jax.random.split(jax.random.key(2), 3)
  w = jax.random.normal(kw, (32, 16)).astype(w_dtype)
  x = jax.random.normal(kx, (3, 7, 32)).astype(dtype)
  dy = jax.random.normal(kg, (3, 7, 16)).astype(dtype)
  cfg = _sr_ste._MatmulConfig(2, 4, 0.3, jnp.dtype(dtype), None, None)
  y, vjp = jax.vjp(lambda x, w: _sr_ste._sr_ste_matmul(cfg, True, x, w), x, w)
  y_ref, vjp_ref = jax.vjp(lambda x, w: _sr_reference(x, w, 0.3, dtype), x, w)
  np.testing.assert_array_equal(y, y_ref)
  for a, b in zip(vjp(dy), vjp_ref(dy), strict=True):
    np.testing.assert_array_equal(a, b)
  if w_dtype != jnp.float32:  # a bfloat16 difference of two gradients would lose the decay term in rounding
    return
  # The decay term is there: pruned weights get decay * w on top of the straight-through gradient.
  _, dw = vjp(dy)
  cfg0 = _sr_ste._MatmulConfig(2, 4, 0.0, cfg.dtype, None, None)
  _, dw0 = jax.vjp(lambda x, w: _sr_ste._sr_ste_matmul(cfg0, True, x, w), x, w)[1](dy)
  mask = jaxsparse.nm_mask(w, 2, 4)
  np.testing.assert_allclose(dw - dw0, np.where(mask, 0.0, 0.3 * w), rtol=1e-5, atol=1e-6)


def _sr_t_reference(x, w, decay, dtype):
  return x @ ops.sr_ste(w, 2, 4, decay=decay, transposable=True).astype(dtype)


@pytest.mark.parametrize(("w_dtype", "dtype"), [(jnp.float32, jnp.bfloat16), (jnp.float32, jnp.float32),
                                                (jnp.bfloat16, jnp.bfloat16)])
def test_transposable_custom_vjp_gives_the_reference_gradients(w_dtype, dtype, monkeypatch):
  # The custom VJP of the transposable path with our pruning kernel and dense products, the kernel replaced by an XLA
  # stand-in: value and gradients are the reference's, bit for bit. (The GPU tests run the real kernel, and the
  # products on sparse tensor cores.)
  def xla_prune(w, dtype=None):  # nm24_transposable's signature (the mask search on a GPU passes w alone)
    dtype = w.dtype if dtype is None else dtype
    pattern = _nm_masks.transposable_pattern(w, 2, 4).astype(jnp.uint8)
    return jnp.where(_nm_masks.tile_mask(pattern, 2, 4), w, jnp.zeros((), w.dtype)).astype(dtype), pattern

  monkeypatch.setattr(_sr_ste.cuda_kernels, "nm24_transposable", xla_prune)
  blob_bytes = 0
  kx, kw, kg = jax.random.split(jax.random.key(blob_bytes + 3), 3)
  w = jax.random.normal(kw, (32, 16)).astype(w_dtype)
  x = jax.random.normal(kx, (3, 7, 32)).astype(dtype)
  dy = jax.random.normal(kg, (3, 7, 16)).astype(dtype)
  cfg = _sr_ste._MatmulConfig(2, 4, 0.3, jnp.dtype(dtype), None, None, transposable=True)
  f = lambda x, w: jax.vjp(lambda x, w: _sr_ste._sr_ste_matmul_t(cfg, blob_bytes, x, w), x, w)[1](dy)
  ref = lambda x, w: jax.vjp(lambda x, w: _sr_t_reference(x, w, 0.3, dtype), x, w)[1](dy)
  np.testing.assert_array_equal(_sr_ste._sr_ste_matmul_t(cfg, blob_bytes, x, w), _sr_t_reference(x, w, 0.3, dtype))
  for a, b in zip(f(x, w), ref(x, w), strict=True):
    np.testing.assert_array_equal(a, b)
  # The decay is there, on the entries the transposable mask prunes (not the plain mask's). With float32 w:
  # a bfloat16 difference of two gradients would lose the decay term in rounding.
  if w_dtype != jnp.float32:
    return
  cfg0 = dataclasses.replace(cfg, decay=0.0)
  dw0 = jax.vjp(lambda w: _sr_ste._sr_ste_matmul_t(cfg0, blob_bytes, x, w), w)[1](dy)[0]
  mask = jaxsparse.nm_mask(w, 2, 4, transposable=True)
  assert (mask != jaxsparse.nm_mask(w, 2, 4)).any()
  np.testing.assert_allclose(np.asarray(f(x, w)[1] - dw0, np.float32),
                             np.where(mask, 0.0, np.asarray(0.3 * w, np.float32)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_nmlinear_fast_path_matches_flax_path(dtype):
  layer = NMLinear(64, 32, dtype=dtype, sr_ste_decay=0.05, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(3), (4, 64))

  def loss(model, x, slow):
    y = nnx.Linear.__call__(model, x) if slow else model(x)
    return (y.astype(jnp.float32) ** 2).sum()

  fast = nnx.grad(lambda m: loss(m, x, False))(layer)
  slow = nnx.grad(lambda m: loss(m, x, True))(layer)
  np.testing.assert_array_equal(layer(x), nnx.Linear.__call__(layer, x))
  np.testing.assert_array_equal(fast.kernel[...], slow.kernel[...])
  np.testing.assert_array_equal(fast.bias[...], slow.bias[...])


@on_cpu
def test_nm_matmul_ignores_cusparselt_weight_off_gpu_and_differentiates():
  w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(jax.random.key(4), (32, 16)), 2, 4)
  x = jax.random.normal(jax.random.key(5), (80, 32))  # more rows than the Pallas limit
  fake = jnp.zeros((100,), jnp.uint8)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no CUDA device: no fallback warning either
    y = ops.nm_matmul(x, w, cusparselt_weight=fake)
  np.testing.assert_allclose(y, x @ w.to_dense(), rtol=1e-5, atol=1e-5)
  g = jax.grad(lambda v: ops.nm_matmul(x, w.with_values(v), cusparselt_weight=fake).sum())(w.values)
  g_ref = jax.grad(lambda v: (x @ w.with_values(v).to_dense()).sum())(w.values)
  np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-5)
  with pytest.raises(TypeError, match="cusparselt_weight"):
    ops.nm_matmul(x, w, cusparselt_weight=jnp.zeros((4, 4), jnp.uint8))


def test_fallback_warning_on_a_cuda_machine_without_cusparselt(monkeypatch):
  monkeypatch.setattr(_measure, "_has_device", lambda platform: platform == "cuda")  # the router's view of a GPU
  monkeypatch.setattr(cslt, "available", lambda: False)
  monkeypatch.setattr(cslt, "unavailable_reason", lambda: "no library (test)")
  x, w = jnp.ones((_sr_ste.SPARSE_CORE_MIN_ROWS, 32), jnp.bfloat16), jnp.ones((32, 16))
  with pytest.warns(ops.CusparseLtFallbackWarning, match="no library"):
    ops.sr_ste_matmul(x, w, 2, 4, dtype=jnp.bfloat16)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    ops.sr_ste_matmul(x, w, 1, 4, dtype=jnp.bfloat16)  # other N:M are not expected on sparse tensor cores
    ops.sr_ste_matmul(x[:64], w, 2, 4, dtype=jnp.bfloat16)  # few rows stay dense by choice


def test_compressed_layer_warns_on_a_cuda_machine_without_cusparselt(monkeypatch):
  monkeypatch.setattr(_build, "has_cuda_device", lambda: True)
  monkeypatch.setattr(cslt, "available", lambda: False)
  monkeypatch.setattr(cslt, "unavailable_reason", lambda: "no library (test)")
  layer = NMLinear(64, 32, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
  with pytest.warns(ops.CusparseLtFallbackWarning, match="CompressedNMLinear.*no library"):
    comp = layer.to_compressed()
  assert comp.kernel_cusparselt is None
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # 1:4 is not expected on sparse tensor cores
    NMLinear(64, 32, n=1, m=4, rngs=nnx.Rngs(0)).to_compressed()


@on_cpu
def test_compressed_layer_has_no_cusparselt_copy_off_gpu():
  layer = NMLinear(64, 32, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16).to_compressed()
  assert layer.kernel_cusparselt is None and not layer.update_cusparselt()
  with pytest.raises(ValueError, match="implementation"):
    CompressedNMLinear(layer.weight, implementation="triton")


def test_compressed_layer_without_copy_never_builds_one(monkeypatch):
  # A machine where the copy could be built: cusparselt_copy=False must not build (or compress) anything.
  built = []
  monkeypatch.setattr(_nm_matmul, "cusparselt_unsupported_reason", lambda w: "")
  monkeypatch.setattr(ops, "cusparselt_compress", lambda w: built.append(w) or jnp.zeros((8,), jnp.uint8))
  layer = NMLinear(64, 32, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
  assert layer.to_compressed().kernel_cusparselt is not None and len(built) == 1  # the default keeps a copy
  comp = layer.to_compressed(cusparselt_copy=False)
  assert comp.kernel_cusparselt is None and not comp.update_cusparselt() and len(built) == 1
  state = nnx.state(comp)
  assert sum(x.nbytes for x in jax.tree.leaves(state)) == 64 * 32 * 2 * 9 // 16 + 32 * 2  # values, positions, bias
  monkeypatch.undo()
  x = jax.random.normal(jax.random.key(1), (3, 64), jnp.bfloat16)
  np.testing.assert_allclose(np.asarray(comp(x), np.float32), np.asarray(comp.to_dense()(x), np.float32),
                             rtol=2e-2, atol=2e-2)  # bfloat16 outputs of the same products
  with pytest.raises(TypeError, match=r"cusparselt_copy must be True or False, got cusparselt_copy='no'"):
    CompressedNMLinear(comp.weight, cusparselt_copy="no")


def _layout_model(w: np.ndarray) -> np.ndarray:
  """A NumPy model of cuSPARSELt's buffer for a bf16 ``(K, N)`` 2:4 weight (see ``_layout``), loop by loop."""
  k, n = w.shape
  g_count = k // 4
  wg = w.reshape(g_count, 4, n)
  values = np.zeros((g_count, 2, n), w.dtype)
  meta = np.zeros(k * n // 8, np.uint8)
  bit = lambda v, b: (v >> b) & 1
  for g in range(g_count):
    for c in range(n):
      kept = [i for i in range(4) if wg[g, i, c] != 0]
      kept = (kept + [i for i in range(4) if i not in kept])[:2]  # zeros kept: lowest free positions
      p0, p1 = sorted(kept)
      values[g, :, c] = wg[g, [p0, p1], c]
      within = (bit(c, 3) | bit(g, 2) << 1 | bit(g, 0) << 2 | bit(g, 1) << 3 | bit(c, 0) << 4 | bit(c, 1) << 5
                | bit(c, 2) << 6 | bit(c, 4) << 7 | bit(c, 5) << 8)
      j = ((c >> 6) * (g_count // 8) + (g >> 3)) * 512 + within
      meta[j // 2] |= (p0 | p1 << 2) << (4 * (j % 2))
  return np.concatenate([values.reshape(k // 2, n).view(np.uint8).reshape(-1), meta])


# long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it (64 x 128, 96 x 192)
@pytest.mark.parametrize(("k", "n"), [(32, 64), pytest.param(64, 128, marks=pytest.mark.slow),
                                    pytest.param(96, 192, marks=pytest.mark.slow)])
def test_layout_matches_the_numpy_model(k, n):
  w = jax.random.normal(jax.random.key(k + n), (k, n), jnp.float32).astype(jnp.bfloat16)
  pruned = np.asarray(jnp.where(jaxsparse.nm_mask(w, 2, 4), w, jnp.zeros((), w.dtype)))
  want = _layout_model(pruned)
  np.testing.assert_array_equal(np.asarray(_layout.compress_dense(w)), want)
  ws = jaxsparse.NMSparseMatrix.from_dense(w, 2, 4)
  np.testing.assert_array_equal(np.asarray(_layout.compress_values(ws.values, ws.positions())), want)
  # float32 master weights: the mask is taken before the cast, as sr_ste(w).astype(bf16) does.
  w32 = jax.random.normal(jax.random.key(k), (k, n), jnp.float32)
  pruned32 = jnp.where(jaxsparse.nm_mask(w32, 2, 4), w32, 0.0).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(_layout.compress_dense(w32, dtype=jnp.bfloat16)),
                                _layout_model(np.asarray(pruned32)))
  assert _layout.supports(k, n) and not _layout.supports(k + 16, n) and not _layout.supports(k, n + 32)


# -------------------------------------------------------------------------------------------------
# GPU: the custom calls against the dense reference.
# -------------------------------------------------------------------------------------------------


def _pruned(key, k, n, dtype=jnp.bfloat16):
  w = jax.random.normal(key, (k, n), jnp.float32).astype(dtype)
  return jnp.where(jaxsparse.nm_mask(w, 2, 4), w, jnp.zeros((), dtype))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("layout", [cslt.LAYOUT_KN, cslt.LAYOUT_NK])
@pytest.mark.parametrize(("rows", "k", "n"), [(1, 64, 128), (16, 256, 512), (100, 512, 256), (1024, 1024, 2048)])
def test_gpu_matmul_matches_dense(layout, rows, k, n):
  kx, kw = jax.random.split(jax.random.key(rows + k + n + layout))
  w = _pruned(kw, k, n)
  x = jax.random.normal(kx, (rows, k), jnp.float32).astype(jnp.bfloat16)
  stored = w if layout == cslt.LAYOUT_KN else w.T
  y = jax.jit(lambda x, s: cslt.matmul(x, cslt.compress(s, layout=layout), n, layout=layout))(x, stored)
  assert y.shape == (rows, n) and y.dtype == jnp.bfloat16
  assert bool(jnp.isfinite(y.astype(jnp.float32)).all())
  assert _rel(y, jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))) < 1e-2


@pytest.mark.gpu
@needs_gpu
def test_gpu_nm_matmul_with_cusparselt_weight():
  w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(jax.random.key(6), (512, 384)).astype(jnp.bfloat16), 2, 4)
  blob = ops.cusparselt_compress(w)
  x = jax.random.normal(jax.random.key(7), (300, 512)).astype(jnp.bfloat16)
  f = jax.jit(lambda x, v, b: ops.nm_matmul(x, w.with_values(v), cusparselt_weight=b))
  assert "jaxsparse_cusparselt_matmul" in f.lower(x, w.values, blob).as_text()
  ref = jnp.dot(x.astype(jnp.float32), w.to_dense().astype(jnp.float32))
  assert _rel(f(x, w.values, blob), ref) < 1e-2
  assert _rel(ops.nm_matmul(x, w, implementation="cusparselt"), ref) < 1e-2
  g = jax.grad(lambda v: f(x, v, blob).astype(jnp.float32).sum())(w.values)
  g_ref = jax.grad(lambda v: ops.nm_matmul(x, w.with_values(v), implementation="xla").astype(jnp.float32).sum())(
      w.values)
  np.testing.assert_array_equal(g, g_ref)  # the same backward (XLA) for both
  # Decode rows stay on the Pallas kernel.
  assert "jaxsparse_cusparselt_matmul" not in f.lower(x[:16], w.values, blob).as_text()


def _sr_ste_problem(shape, w_dtype, seed):
  """``(x, w, dy)``: (4, 64, K) bf16 activations, (K, N) master weights of ``w_dtype``, (4, 64, N) bf16 cotangent."""
  k, n = shape
  kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
  w = jax.random.normal(kw, shape).astype(w_dtype)
  x = jax.random.normal(kx, (4, 64, k)).astype(jnp.bfloat16)
  dy = jax.random.normal(kg, (4, 64, n)).astype(jnp.bfloat16)
  return x, w, dy


def _value_and_grads(fn):
  """Jitted ``(x, w, dy) -> (fn(x, w), dX, dW)``."""
  return jax.jit(lambda x, w, dy: (lambda y, vjp: (y, *vjp(dy)))(*jax.vjp(fn, x, w)))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(512, 256), (528, 272)])  # buffer written by our kernel / by cuSPARSELt
def test_gpu_sr_ste_matmul_forward_on_sparse_cores_and_exact_gradients(shape, w_dtype):
  # The backward pass takes the pruned kernel and the mask bits from the forward's pruning kernel.
  x, w, dy = _sr_ste_problem(shape, w_dtype, seed=8)
  f = lambda x, w: ops.sr_ste_matmul(x, w, 2, 4, decay=0.01, dtype=jnp.bfloat16, implementation="cusparselt")
  assert "jaxsparse_cusparselt_matmul" in jax.jit(f).lower(x, w).as_text()
  auto = lambda x, w: ops.sr_ste_matmul(x, w, 2, 4, dtype=jnp.bfloat16)
  assert "jaxsparse_cusparselt_matmul" not in jax.jit(auto).lower(x, w).as_text()  # 256 rows: dense
  big = jnp.zeros((_sr_ste.SPARSE_CORE_MIN_ROWS, shape[0]), jnp.bfloat16)
  assert "jaxsparse_cusparselt_matmul" in jax.jit(auto).lower(big, w).as_text()
  y, dx, dw = _value_and_grads(f)(x, w, dy)
  y_ref, dx_ref, dw_ref = _value_and_grads(lambda x, w: _sr_reference(x, w, 0.01, jnp.bfloat16))(x, w, dy)
  assert _rel(y, y_ref) < 1e-2
  np.testing.assert_array_equal(dx, dx_ref)
  np.testing.assert_array_equal(dw, dw_ref)
  # vmap over the leading dim of x (the pruning and the product run once per slice).
  assert _rel(jax.jit(jax.vmap(f, in_axes=(0, None)))(x, w), y_ref) < 1e-2


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(512, 256), (528, 272)])  # buffers written by our kernel / by cuSPARSELt
def test_gpu_sr_ste_matmul_transposable_on_sparse_cores(shape, w_dtype):
  # Forward and dY Wᵀ on sparse tensor cores, pruned by our kernel: the value and gradients of
  # x @ sr_ste(w, transposable=True) with the kernel's mask (the same as nm_mask's but for near-ties, which
  # random normal weights of this size do not have: checked).
  from jaxsparse._cuda import _kernels as ck  # noqa: PLC0415

  k, n = shape
  assert _sr_ste._direct_compress(k, n) == (shape == (512, 256))
  x, w, dy = _sr_ste_problem(shape, w_dtype, seed=11)
  np.testing.assert_array_equal(ck.nm24_transposable(w)[1], jaxsparse.formats._nm_masks.transposable_pattern(w, 2, 4))
  f = lambda x, w: ops.sr_ste_matmul(x, w, 2, 4, decay=0.01, dtype=jnp.bfloat16, transposable=True,
                                     implementation="cusparselt")
  hlo = _value_and_grads(f).lower(x, w, dy).as_text()  # the forward and dY Wᵀ
  assert hlo.count("jaxsparse_cusparselt_matmul") == 2 and "jaxsparse_nm24_transposable" in hlo
  auto = lambda x, w: ops.sr_ste_matmul(x, w, 2, 4, dtype=jnp.bfloat16, transposable=True)
  small = jax.jit(auto).lower(x, w).as_text()  # 256 rows: pruned by the kernel, dense products
  assert "jaxsparse_cusparselt_matmul" not in small and "jaxsparse_nm24_transposable" in small
  big = jnp.zeros((_sr_ste.TRANSPOSABLE_SPARSE_CORE_MIN_ROWS, k), jnp.bfloat16)
  assert "jaxsparse_cusparselt_matmul" in jax.jit(auto).lower(big, w).as_text()
  y, dx, dw = _value_and_grads(f)(x, w, dy)
  y_ref, dx_ref, dw_ref = _value_and_grads(lambda x, w: _sr_t_reference(x, w, 0.01, jnp.bfloat16))(x, w, dy)
  assert _rel(y, y_ref) < 1e-2 and _rel(dx, dx_ref) < 1e-2
  np.testing.assert_array_equal(dw, dw_ref)
  # The kernel-pruned dense path gives the reference bit for bit.
  kernel_pruned = lambda x, w: ops.sr_ste_matmul(x, w, 2, 4, decay=0.01, dtype=jnp.bfloat16, transposable=True)
  y2, dx2, dw2 = _value_and_grads(kernel_pruned)(x, w, dy)
  for a, b in ((y2, y_ref), (dx2, dx_ref), (dw2, dw_ref)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
@needs_gpu
def test_gpu_sr_ste_matmul_transposable_vmap_and_layer():
  # vmap over x (the weight shared) and over x and w (one weight per example), and NMLinear(transposable=True)
  # under nnx.jit: the sparse-core path where it has enough rows, with the values of the reference.
  kx, kw = jax.random.split(jax.random.key(12))
  w = jax.random.normal(kw, (3, 256, 128))
  x = jax.random.normal(kx, (3, 64, 256)).astype(jnp.bfloat16)
  f = lambda x, w: ops.sr_ste_matmul(x, w, 2, 4, dtype=jnp.bfloat16, transposable=True, implementation="cusparselt")
  ref = lambda x, w: _sr_t_reference(x, w, 2e-4, jnp.bfloat16)
  assert _rel(jax.jit(jax.vmap(f, in_axes=(0, None)))(x, w[0]), jax.vmap(ref, in_axes=(0, None))(x, w[0])) < 1e-2
  assert _rel(jax.jit(jax.vmap(f))(x, w), jax.vmap(ref)(x, w)) < 1e-2
  layer = NMLinear(256, 128, dtype=jnp.bfloat16, transposable=True, rngs=nnx.Rngs(0))
  rows = jnp.ones((_sr_ste.TRANSPOSABLE_SPARSE_CORE_MIN_ROWS, 256), jnp.bfloat16)
  assert "jaxsparse_cusparselt_matmul" in jax.jit(lambda x: layer(x)).lower(rows).as_text()
  y = nnx.jit(lambda m, x: m(x))(layer, rows)
  want = rows @ ops.sr_ste(layer.kernel[...], 2, 4, transposable=True).astype(jnp.bfloat16) + layer.bias[...]
  assert _rel(y, want) < 1e-2


def test_differentiated_forward_reads_the_values_not_the_cusparselt_copy(monkeypatch):
  """Under grad the forward multiplies ``w``: a training step changes ``w``, not a layer's cuSPARSELt copy."""
  seen = []
  forward = _nm_matmul._forward
  monkeypatch.setattr(_nm_matmul, "_forward", lambda cfg, x, w, blob: seen.append(blob) or forward(cfg, x, w, blob))
  w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(jax.random.key(6), (64, 64)), 2, 4)
  x = jax.random.normal(jax.random.key(7), (8, 64))
  fake = jnp.zeros((100,), jnp.uint8)
  ops.nm_matmul(x, w, cusparselt_weight=fake)
  assert seen[-1] is not None  # inference reads the copy
  jax.grad(lambda v: ops.nm_matmul(x, w.with_values(v), cusparselt_weight=fake).sum())(w.values)
  assert seen[-1] is None
  # A weight unpacked from the buffer (storage="cusparselt") is the buffer: the differentiated forward keeps it.
  monkeypatch.setattr(_nm_matmul, "buffer_is_cusparselt", lambda *args: True)  # as on a GPU with cuSPARSELt
  buf = _nm_matmul.to_buffer(w.with_values(w.values.astype(jnp.bfloat16)))
  _nm_matmul.nm_matmul_buffer(x.astype(jnp.bfloat16), buf, _nm_matmul.from_buffer(buf, w.shape, jnp.bfloat16))
  assert seen[-1] is not None
  jax.grad(lambda x: _nm_matmul.nm_matmul_buffer(
      x, buf, _nm_matmul.from_buffer(buf, w.shape, jnp.bfloat16)).astype(jnp.float32).sum())(x.astype(jnp.bfloat16))
  assert seen[-1] is not None


@pytest.mark.gpu
@needs_gpu
def test_gpu_training_a_compressed_layer_with_its_copy_computes_with_the_new_weights():
  comp = NMLinear(256, 128, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(3)).to_compressed()
  assert comp.kernel_cusparselt is not None
  x = jax.random.normal(jax.random.key(10), (200, 256), jnp.bfloat16)
  opt = nnx.Optimizer(comp, optax.sgd(1.0), wrt=nnx.Param)
  loss = lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2)

  @nnx.jit
  def step(m, opt):
    value, grads = nnx.value_and_grad(loss)(m)
    opt.update(m, grads)
    return value

  step(comp, opt)
  want = loss(comp.to_dense())  # the updated kernel, through a dense layer
  got = step(comp, opt)  # its loss as the layer's differentiated forward computes it (before: the copy's old weight)
  assert _rel(got, want) < 2e-2
  # Inference after training reads the copy: update_cusparselt brings it up to date (the layer docs say so).
  assert comp.update_cusparselt()
  assert _rel(comp(x), comp.to_dense()(x)) < 1e-2


@pytest.mark.gpu
@needs_gpu
def test_gpu_nmlinear_and_compressed_layer_use_sparse_cores():
  layer = NMLinear(256, 128, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(9), (_sr_ste.SPARSE_CORE_MIN_ROWS, 256))
  f = nnx.jit(lambda m, x: m(x))
  graphdef, state = nnx.split(layer)
  hlo = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x)).lower(state, x).as_text()
  assert "jaxsparse_cusparselt_matmul" in hlo
  assert _rel(f(layer, x), nnx.Linear.__call__(layer, x)) < 1e-2
  x = x[:200]
  comp = NMLinear(256, 128, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(1)).to_compressed()
  assert comp.kernel_cusparselt is not None
  xb = x.astype(jnp.bfloat16)
  assert _rel(comp(xb), comp.to_dense()(xb)) < 1e-2
  # After fine-tuning the kernel, update_cusparselt brings the copy up to date.
  comp.kernel[...] = comp.kernel[...] * 2
  assert comp.update_cusparselt()
  assert _rel(comp(xb), comp.to_dense()(xb)) < 1e-2
  # Without the copy (memory 0.5625x of dense), many rows still multiply correctly.
  small = NMLinear(256, 128, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(2)).to_compressed(cusparselt_copy=False)
  assert small.kernel_cusparselt is None
  assert _rel(small(xb), small.to_dense()(xb)) < 1e-2


# -------------------------------------------------------------------------------------------------
# CompressedNMLinear(storage="cusparselt"): the weight kept once, as the buffer.
# -------------------------------------------------------------------------------------------------


@pytest.mark.slow  # long (19 s on 2 cores): moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
@settings(max_examples=12, deadline=None)
@given(k=st.integers(1, 6).map(lambda i: 32 * i), n=st.integers(1, 4).map(lambda i: 64 * i),
       dtype=st.sampled_from([jnp.bfloat16, jnp.float32, jnp.float16]), seed=st.integers(0, 2**31 - 1))
def test_layout_decompress_inverts_compress(k, n, dtype, seed):
  w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(jax.random.key(seed), (k, n)).astype(dtype), 2, 4)
  buffer = _layout.compress_values(w.values, w.positions())
  assert buffer.shape == (k * n // 2 * jnp.dtype(dtype).itemsize + k * n // 8,), seed
  values, positions = _layout.decompress(buffer, k, n, dtype)
  np.testing.assert_array_equal(values, w.values, err_msg=f"seed {seed}")
  np.testing.assert_array_equal(positions, w.positions(), err_msg=f"seed {seed}")
  # The op's buffer: the layout's, and for float16 16 bytes more that mark the dtype.
  tagged = _nm_matmul.to_buffer(w)
  np.testing.assert_array_equal(tagged[: buffer.shape[0]], buffer)
  assert tagged.shape == (_nm_matmul.buffer_bytes(k, n, dtype),) == (buffer.shape[0] + 16 * (dtype == jnp.float16),)
  back = _nm_matmul.from_buffer(tagged, (k, n), dtype)
  np.testing.assert_array_equal(back.indices, w.indices, err_msg=f"seed {seed}")
  with pytest.raises(ValueError, match=r"buffer is \(\d+,\) uint8"):
    _layout.decompress(buffer[1:], k, n, dtype)


@pytest.mark.parametrize("use_bias", [True, False])
def test_buffer_storage_layer_equals_values_layer(use_bias):
  lin = NMLinear(64, 128, use_bias=use_bias, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
  if use_bias:
    lin.bias[...] = jax.random.normal(jax.random.key(4), (128,), jnp.bfloat16)
  values = lin.to_compressed(cusparselt_copy=False)
  layer = lin.to_compressed(storage="cusparselt")
  assert layer.storage == "cusparselt" and layer.kernel is None and layer.kernel_cusparselt is None
  assert sorted(nnx.state(layer).keys()) == (["bias"] if use_bias else []) + ["kernel_buffer"]
  assert isinstance(layer.kernel_buffer, jaxsparse.layers.CusparseLtKernel)
  assert layer.kernel_buffer[...].nbytes == values.weight.nbytes  # 0.5625x the dense kernel, no second copy
  np.testing.assert_array_equal(layer.weight.values, values.weight.values)
  np.testing.assert_array_equal(layer.weight.indices, values.weight.indices)
  x = jax.random.normal(jax.random.key(5), (2, 3, 64), jnp.bfloat16)
  want = values(x)
  np.testing.assert_array_equal(layer(x), want)
  np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x))(layer, x), want)
  np.testing.assert_array_equal(layer.to_dense()(x), values.to_dense()(x))
  assert layer(x.astype(jnp.float32)).dtype == jnp.float32  # promoted: the unpacked weight, no buffer route
  gx = jax.grad(lambda x: layer(x).astype(jnp.float32).sum())(x)
  np.testing.assert_array_equal(gx, jax.grad(lambda x: values(x).astype(jnp.float32).sum())(x))
  row = jaxsparse.summary(layer).layers[0]
  assert (row.kind, row.pattern) == ("CompressedNMLinear", "2:4 compressed")
  assert row.bytes == values.weight.nbytes + (256 if use_bias else 0) == jaxsparse.summary(values).layers[0].bytes
  assert jaxsparse.layer_signature(layer) == jaxsparse.layer_signature(values)
  abstract = nnx.eval_shape(lambda: lin.to_compressed(storage="cusparselt"))
  assert nnx.state(abstract)["kernel_buffer"].shape == layer.kernel_buffer[...].shape


def test_buffer_storage_errors_and_auto():
  w = jaxsparse.NMSparseMatrix.from_dense(jnp.ones((48, 64), jnp.bfloat16), 2, 4)
  with pytest.raises(ValueError, match=r"storage='cusparselt': it needs K a multiple of 32 and N of 64, got \(K, N\) = "
                                       r"\(48, 64\)"):
    CompressedNMLinear(w, storage="cusparselt")
  w14 = jaxsparse.NMSparseMatrix.from_dense(jnp.ones((64, 64), jnp.bfloat16), 1, 4)
  with pytest.raises(ValueError, match="2:4 weight with groups along K"):
    CompressedNMLinear(w14, storage="cusparselt")
  with pytest.raises(ValueError, match="storage must be 'values', 'cusparselt' or 'auto', got storage='buffer'"):
    CompressedNMLinear(w, storage="buffer")
  ok = jaxsparse.NMSparseMatrix.from_dense(jnp.ones((64, 128), jnp.bfloat16), 2, 4)
  # "auto": the buffer only where cuSPARSELt here reads it; never for an unsupported shape or another compute dtype.
  assert CompressedNMLinear(w, storage="auto").storage == "values"
  assert CompressedNMLinear(ok, storage="auto", dtype=jnp.float32).storage == "values"
  assert CompressedNMLinear(ok, storage="auto", implementation="xla").storage == "values"  # would unpack every call
  assert CompressedNMLinear(ok, storage="auto").storage == ("cusparselt" if _layout_is_cusparselts() else "values")


def _layout_is_cusparselts() -> bool:
  return cslt.available() and _layout.matches()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [1, 8, 32, 48, 512])
def test_gpu_buffer_storage_layer(rows):
  """On the H100 the buffer is cuSPARSELt's own: decode rows on the mma.sp kernel reading it, many rows on
  cuSPARSELt reading it, the rest unpacking it in the route; every route equals the layer with values."""
  assert _layout.matches()
  lin = NMLinear(1024, 4096, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(rows))
  values = lin.to_compressed(cusparselt_copy=False)
  layer = lin.to_compressed(storage="auto")
  assert layer.storage == "cusparselt"
  x = jax.random.normal(jax.random.key(rows), (rows, 1024), jnp.bfloat16)
  want = x.astype(jnp.float32) @ values.weight.to_dense().astype(jnp.float32)
  assert _rel(nnx.jit(lambda m, x: m(x))(layer, x), want) < 1e-2
  graphdef, state = nnx.split(layer)
  hlo = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, x).as_text()
  if rows <= 32:
    assert "jaxsparse_nm24_decode_buffer" in hlo
  if rows == 512:
    assert "jaxsparse_cusparselt_matmul" in hlo
  for implementation in ("xla", "pallas", "cusparselt"):
    if implementation == "pallas" and rows > _nm_matmul.PALLAS_MAX_TUNED_ROWS:
      continue
    forced = lin.to_compressed(storage="cusparselt", implementation=implementation)
    assert _rel(forced(x), want) < 1e-2, implementation


@pytest.mark.gpu
@needs_gpu
def test_gpu_unsupported_shape_falls_back_with_warning():
  x = jnp.ones((_sr_ste.SPARSE_CORE_MIN_ROWS, 72), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(10), (72, 32))
  with pytest.warns(ops.CusparseLtFallbackWarning, match="multiples of 16"):
    y = ops.sr_ste_matmul(x, w, 2, 4, dtype=jnp.bfloat16)
  np.testing.assert_array_equal(y, _sr_reference(x, w, 2e-4, jnp.bfloat16))
  with pytest.raises(RuntimeError, match="multiples of 16"):
    ops.sr_ste_matmul(x, w, 2, 4, dtype=jnp.bfloat16, implementation="cusparselt")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("k", "n"), [(1024, 2048), (2048, 512), (4096, 4096)])
def test_gpu_xla_layout_is_cusparselts(k, n):
  assert _layout.matches()
  w = jax.random.normal(jax.random.key(k * 3 + n), (k, n), jnp.float32)
  ours = jax.jit(lambda w: _layout.compress_dense(w, dtype=jnp.bfloat16))(w)
  pruned = jnp.where(jaxsparse.nm_mask(w, 2, 4), w, 0.0).astype(jnp.bfloat16)
  np.testing.assert_array_equal(ours, jax.jit(cslt.compress)(pruned))
