"""The block-sparse decode kernel (``jaxsparse/_cuda/block_sparse_decode.cu``): ``x @ W`` for at most 8 rows and a
``BlockSparseMatrix`` with block dims multiples of 64, and its route in ``block_sparse_matmul``.

CPU tests cover the config, the default and candidates, the argument checks, NVRTC builds for sm_90 and the op off
CUDA. Tests marked ``gpu`` run the kernel (every candidate config) against a float32 dense product of the same 16-bit
operands on a GPU of compute capability 9.0+; they skip elsewhere. Tolerance: the output's 16-bit rounding on top of
float32 accumulation in another order (relative Frobenius error near 2e-3); we allow 5e-3 (float32 output: 1e-4 on
top of the inputs' rounding, which both sides share).
"""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsparse
from jaxsparse import _tuning
from jaxsparse._cuda import _block_sparse_decode as bsd
from jaxsparse._cuda import _kernels as ck
from jaxsparse.ops import _block_sparse_matmul as bsm

needs_gpu = pytest.mark.skipif(not ck.available(), reason=ck.unavailable_reason() or "CUDA kernels available")
Config = bsd.BlockSparseDecodeConfig


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _problem(seed, m, k, n, block, density=0.4, dtype=jnp.bfloat16, empty_cols=False):
  kw, km, kx = jax.random.split(jax.random.key(seed), 3)
  mask = np.array(jaxsparse.random_block_mask(km, (k, n), block, density))
  if empty_cols:  # block columns that keep nothing: their outputs are zeros
    mask[:, ::3] = False
  w = jax.random.normal(kw, (k, n), jnp.float32).astype(dtype)
  w = jaxsparse.BlockSparseMatrix.from_dense(w, block, block_mask=jnp.asarray(mask))
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
  ref = jnp.dot(x.astype(jnp.float32), w.to_dense().astype(jnp.float32))
  return x, w, ref


def _weight(k, n, block, density, seed=0):
  """A weight of ``density`` kept blocks, its values zeros (for the routing and checks, which read shapes only)."""
  grid = (k // block[0], n // block[1])
  mask = np.random.default_rng(seed).random(grid) < density
  return jaxsparse.BlockSparseMatrix.from_block_mask(mask, np.zeros((int(mask.sum()), *block), jnp.bfloat16))


def _run(x, w, config=None, out_dtype=None):
  return bsd.block_sparse_decode(x, w.data, w.col_offsets, w.transpose_order, w.row_indices, w.shape[1],
                                 config=config, out_dtype=out_dtype)


# -------------------------------------------------------------------------------------------------
# CPU.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"warps": 0}, "warps must be 1-8, got 0"),
    ({"warps": 9}, "warps must be 1-8, got 9"),
    ({"split": 3}, r"split must be one of \(1, 2, 4, 8\), got 3"),
    ({"stages": 5}, "stages must be 2, 3 or 4, got 5"),
    ({"warps": 8, "stages": 3}, "warps=8 x stages=3 need 222208 bytes of shared memory, at most 204800"),
])
def test_config_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Config(**kwargs)


def test_config_checks_the_block_and_names_itself():
  assert Config(warps=4, split=2, stages=3).name == "w4s2lt3"
  Config(warps=4).check((128, 256))
  with pytest.raises(ValueError, match=r"warps=4 must be a multiple of bn / 64 = 3 for blocks \(64, 192\)"):
    Config(warps=4).check((64, 192))


def test_shared_bytes_is_the_launchers():
  """The Python size of a build's rings is launch_checks.h's (the launcher allows and checks that many bytes)."""
  checks = (ck._HERE / "launch_checks.h").read_text()
  assert "return warps * stages * 9216 + 1024;" in checks
  assert "constexpr int64_t kMaxBlockSparseDecodeSharedBytes = 200 * 1024;" in checks
  assert bsd._MAX_SHARED_BYTES == 200 * 1024
  assert [bsd.block_sparse_decode_shared_bytes(w, s) for w, s in [(4, 2), (2, 4), (8, 2)]] == [74752, 74752, 148480]


def _candidate_cases():
  for n, block, density, k in itertools.product([128, 1024, 4096, 28672], [(64, 64), (128, 128), (64, 192),
                                                                            (256, 64), (64, 256)],
                                                [0.05, 0.5, 1.0], [256, 4096, 14336]):
    if n % block[1] == 0 and k % block[0] == 0:
      yield n, block, density, k


@pytest.mark.parametrize(("n", "block", "density", "k"), list(_candidate_cases()))
def test_default_and_candidates(n, block, density, k):
  """The default is valid for the block and first among distinct, valid candidates; it aims at about 512 warps."""
  nnz = max(1, int((k // block[0]) * (n // block[1]) * density))
  cands = bsd.block_sparse_decode_candidates(1, k, n, block, nnz)
  default = Config.get_default(1, k, n, block, nnz)
  assert cands[0] == default and len(set(cands)) == len(cands) <= 8
  for c in cands:
    c.check(block)  # raises if a warp count does not divide into the block's boxes
  columns = n // block[1]
  total = columns * default.warps * default.split
  assert total <= 512 or default.split == 1  # splits only while the warps in all stay within the target
  assert default.stages == 2 and any(c.stages == 3 for c in cands)


@pytest.mark.parametrize(("m", "k", "n", "block", "dtype", "out", "expect"), [
    (1, 4096, 4096, (64, 64), jnp.bfloat16, jnp.bfloat16, ""),
    (8, 4096, 4096, (128, 256), jnp.float16, jnp.float32, ""),
    (9, 4096, 4096, (64, 64), jnp.bfloat16, jnp.bfloat16, "M must be between 1 and 8, got M=9"),
    (1, 4096, 4096, (32, 64), jnp.bfloat16, jnp.bfloat16, r"block dims must be among 64, 128, 192, 256, got \(32"),
    (1, 4096, 4096, (64, 320), jnp.bfloat16, jnp.bfloat16, "block dims"),
    (1, 4096, 4096, (64, 64), jnp.float32, jnp.float32, "must be bfloat16 or float16, got float32"),
    (1, 4096, 4096, (64, 64), jnp.bfloat16, jnp.float16, "output must be bfloat16 or float32, got float16"),
])
def test_unsupported_reason(m, k, n, block, dtype, out, expect):
  got = bsd.block_sparse_decode_unsupported_reason(m, k, n, block, dtype, out)
  assert (re.search(expect, got) is not None) if expect else got == ""


def test_rejects_bad_operands():
  x, w = jnp.zeros((2, 256), jnp.bfloat16), _weight(256, 256, (64, 64), 0.5)
  with pytest.raises(ValueError, match="x must be 2-D and data 3-D"):
    _run(x[0], w)
  with pytest.raises(ValueError, match="M must be between 1 and 8, got M=9"):
    _run(jnp.zeros((9, 256), jnp.bfloat16), w)
  with pytest.raises(ValueError, match="data must be of x's dtype float16, got bfloat16"):
    _run(x.astype(jnp.float16), w)
  with pytest.raises(ValueError, match=r"int32 of shapes \(\(5,\), .*got \(\(4,\)"):
    bsd.block_sparse_decode(x, w.data, w.col_offsets[:-1], w.transpose_order, w.row_indices, 256)
  with pytest.raises(ValueError, match="int32 of shapes"):
    bsd.block_sparse_decode(x, w.data, w.col_offsets, w.transpose_order.astype(jnp.int16), w.row_indices, 256)
  with pytest.raises(ValueError, match=r"K and N must be multiples of the block \(64, 64\)"):
    bsd.block_sparse_decode(x, w.data, jnp.zeros((4,), jnp.int32), w.transpose_order, w.row_indices, 200)
  with pytest.raises(TypeError, match="config must be a BlockSparseDecodeConfig or None, got dict"):
    _run(x, w, config={"warps": 4})
  with pytest.raises(ValueError, match=r"warps=1 must be a multiple of bn / 64 = 2"):
    _run(x, _weight(256, 256, (128, 128), 0.5), config=Config(warps=1))


def test_nothing_kept_is_zeros_without_a_kernel():
  w = jaxsparse.BlockSparseMatrix.from_block_mask(np.zeros((2, 2), bool), jnp.zeros((0, 64, 64), jnp.bfloat16))
  y = _run(jnp.ones((3, 128), jnp.bfloat16), w, out_dtype=jnp.float32)
  assert y.shape == (3, 128) and y.dtype == jnp.float32 and not np.any(np.asarray(y))


@pytest.mark.parametrize(("block", "warps", "split", "stages", "f16", "out_f32"), [
    ((64, 64), 4, 2, 2, 0, 0),
    pytest.param((128, 128), 4, 8, 3, 1, 1, marks=pytest.mark.slow),
    pytest.param((256, 192), 3, 1, 4, 0, 1, marks=pytest.mark.slow),
    pytest.param((192, 256), 8, 4, 2, 1, 0, marks=pytest.mark.slow),
])
def test_source_compiles_for_hopper(block, warps, split, stages, f16, out_f32, monkeypatch, tmp_path):
  """NVRTC (the dev extra's nvidia-cuda-nvrtc; no GPU needed) compiles the kernel for sm_90 (the fast set builds the
  8B decode's; the other builds are long: CI runs them)."""
  assert ck._nvrtc() is not None, "libnvrtc not found: install the dev extra (nvidia-cuda-nvrtc)"
  monkeypatch.setenv("JAXSPARSE_CACHE_DIR", str(tmp_path))
  cfg = Config(warps=warps, split=split, stages=stages)
  defines = bsd._defines(block, cfg, jnp.float16 if f16 else jnp.bfloat16, jnp.float32 if out_f32 else None)
  assert ("BS_F16", f16) in defines and ("BS_OUT_F32", out_f32) in defines
  cubin, log = ck._compile_cubin((ck._HERE / "block_sparse_decode.cu").read_text(), "block_sparse_decode",
                                 ck._nvrtc_options("sm_90", defines))
  assert cubin is not None, log


def test_backend_refuses_what_it_cannot_run():
  """The route's reasons: the backward products, mixed dtypes, more rows; off CUDA it is not there at all."""
  backend = bsm._CudaDecode(jnp.bfloat16)
  x, w = jnp.zeros((4, 256), jnp.bfloat16), _weight(256, 256, (64, 64), 0.5)
  fwd = bsm._product("fwd", (x, w), jnp.bfloat16, None)
  dx = bsm._product("dx", (x, jnp.zeros((4, 256), jnp.bfloat16), w), jnp.bfloat16, None)
  assert "forward product only" in backend.unsupported_reason(dx).reason
  mixed = bsm._product("fwd", (x.astype(jnp.float16), w), jnp.bfloat16, None)
  assert "share a dtype" in backend.unsupported_reason(mixed).reason
  many = bsm._product("fwd", (jnp.zeros((16, 256), jnp.bfloat16), w), jnp.bfloat16, None)
  assert "M=16" in backend.unsupported_reason(many).reason
  reason = backend.unsupported_reason(fwd)
  assert (reason is None) == ck.available()
  if not ck.available():
    assert reason.reason == ck.unavailable_reason()
  names = [c.name for c in backend.candidates(fwd)]
  assert names[0] == "cuda_decode" and all(n.startswith("cuda_decode/w") for n in names[1:])


def test_op_unchanged_off_cuda():
  x, w, ref = _problem(2, 3, 256, 384, (64, 128))
  f = jax.jit(jaxsparse.ops.block_sparse_matmul)
  assert ck.available() or "block_sparse_decode" not in f.lower(x, w).as_text()
  assert _rel(f(x, w), ref) < 5e-3


# -------------------------------------------------------------------------------------------------
# GPU.
# -------------------------------------------------------------------------------------------------

_GPU_CASES = [
    (1, 512, 512, (64, 64), jnp.bfloat16, None),
    (3, 1024, 768, (128, 128), jnp.bfloat16, jnp.float32),
    (8, 768, 1024, (64, 128), jnp.float16, None),
    (5, 1024, 512, (128, 64), jnp.float16, jnp.float32),
    (2, 768, 768, (192, 64), jnp.bfloat16, None),
    (8, 1024, 1024, (256, 256), jnp.bfloat16, None),
    (7, 512, 1536, (64, 192), jnp.float16, None),
    (1, 4096, 4096, (64, 64), jnp.bfloat16, None),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("empty_cols", [False, True])
@pytest.mark.parametrize(("m", "k", "n", "block", "dtype", "out"), _GPU_CASES)
def test_gpu_every_candidate(m, k, n, block, dtype, out, empty_cols):
  x, w, ref = _problem(m + k, m, k, n, block, dtype=dtype, empty_cols=empty_cols)
  for cfg in bsd.block_sparse_decode_candidates(m, k, n, block, w.nnz_blocks):
    y = jax.jit(lambda x, w, cfg=cfg: _run(x, w, cfg, out))(x, w)
    assert y.dtype == (out or dtype) and y.shape == (m, n)
    tol = 1e-4 if out == jnp.float32 else 5e-3
    assert _rel(y, ref) < tol, cfg.name


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("seed", range(6))
def test_gpu_random_shapes(seed):
  rng = np.random.default_rng(seed)
  block = tuple(int(v) for v in rng.choice([64, 128, 192, 256], 2))
  m, k, n = int(rng.integers(1, 9)), block[0] * int(rng.integers(1, 12)), block[1] * int(rng.integers(1, 12))
  x, w, ref = _problem(seed, m, k, n, block, density=float(rng.uniform(0.05, 1.0)))
  assert _rel(_run(x, w), ref) < 5e-3


@pytest.mark.gpu
@needs_gpu
def test_gpu_bad_indices_read_zeros_not_memory():
  """Index values outside their arrays never fault: a bad block id or row reads zeros, offsets are clamped."""
  x, w, _ = _problem(5, 2, 512, 512, (64, 64), density=0.5)
  order = w.transpose_order.at[0].set(10**6)
  rows = w.row_indices.at[1].set(-7)
  offsets = w.col_offsets.at[1].set(10**8).at[2].set(-5)
  y = bsd.block_sparse_decode(x, w.data, offsets, order, rows, 512)
  assert np.all(np.isfinite(np.asarray(y, np.float32)))
  # Valid arrays after the bad call: the kernel still computes the product.
  assert _rel(_run(x, w), jnp.dot(x.astype(jnp.float32), w.to_dense().astype(jnp.float32))) < 5e-3


@pytest.mark.gpu
@needs_gpu
def test_gpu_block_sparse_matmul_takes_the_kernel_at_decode(monkeypatch):
  """With tuning off the op runs the kernel for up to 8 rows (leading batch dims, vmap), and differentiates."""
  monkeypatch.setenv("JAXSPARSE_AUTOTUNE", "off")
  _, w, _ = _problem(3, 1, 1024, 2048, (64, 64), density=0.5)
  x = jax.random.normal(jax.random.key(4), (2, 3, 1024), jnp.float32).astype(jnp.bfloat16)
  f = jax.jit(jaxsparse.ops.block_sparse_matmul)
  assert "jaxsparse_block_sparse_decode" in f.lower(x, w).as_text()
  ref = jnp.einsum("abk,kn->abn", x.astype(jnp.float32), w.to_dense().astype(jnp.float32))
  assert _rel(f(x, w), ref) < 5e-3
  yv = jax.vmap(lambda xi: jaxsparse.ops.block_sparse_matmul(xi, w))(x)
  assert _rel(yv, ref) < 5e-3
  gx = jax.grad(lambda x: jaxsparse.ops.block_sparse_matmul(x, w).astype(jnp.float32).sum())(x)
  gref = jnp.broadcast_to(w.to_dense().astype(jnp.float32).sum(axis=1), x.shape)
  assert _rel(gx, gref) < 5e-3
  # Nine rows and more take the other routes.
  x9 = jnp.ones((9, 1024), jnp.bfloat16)
  assert "jaxsparse_block_sparse_decode" not in f.lower(x9, w).as_text()


@pytest.mark.gpu
@needs_gpu
def test_gpu_tuning_picks_a_runnable_route(monkeypatch, tmp_path):
  monkeypatch.setenv("JAXSPARSE_AUTOTUNE_CACHE", str(tmp_path / "cache.json"))
  _tuning.set_autotune_mode("tune")
  try:
    for m, block in [(1, (64, 64)), (8, (128, 128))]:
      x, w, ref = _problem(7, m, 2048, 2560, block, density=0.5)
      assert _rel(jax.jit(jaxsparse.ops.block_sparse_matmul)(x, w), ref) < 5e-3
  finally:
    _tuning.set_autotune_mode(None)


def test_shipped_default_keeps_pallas_for_sparse_wide_blocks():
  """With tuning off the decode kernel leads, but on blocks of 128+ columns below density 0.25 (the Pallas default was
  faster there on an H200); products without it keep their first candidate."""
  cands = [_tuning.Candidate(n, None) for n in ("cuda_decode", "cuda_decode/w8s1lt2", "default", "triton/s4")]
  x = jnp.zeros((1, 1024), jnp.bfloat16)
  for block, density, want in [((64, 64), 0.2, "cuda_decode"), ((128, 128), 0.5, "cuda_decode"),
                               ((128, 128), 0.2, "default"), ((64, 128), 0.1, "default")]:
    w = _weight(1024, 1024, block, density)
    assert bsm._shipped_default(bsm._product("fwd", (x, w), jnp.bfloat16, None), cands) == want, (block, density)
  w = _weight(1024, 1024, (128, 128), 0.1)
  other = [_tuning.Candidate(n, None) for n in ("cpu_kernel", "loop")]
  assert bsm._shipped_default(bsm._product("fwd", (x, w), jnp.bfloat16, None), other) == "cpu_kernel"
