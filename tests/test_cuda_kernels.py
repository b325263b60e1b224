"""Our own CUDA kernels (NVRTC-compiled, ``jaxsparse/_cuda/_kernels.py``): the 2:4 decode product on sparse
tensor cores.

CPU tests cover the argument checks, the config and the dispatch of ``nm_matmul`` off CUDA. Tests marked
``gpu`` run the kernel against a float32 dense product of the same bf16 operands on a GPU of compute
capability 9.0+ (``pytest -m gpu tests/test_cuda_kernels.py`` on the device machine); they skip elsewhere.
Tolerance: bf16 output rounding (relative 2^-8 per element) on top of float32 accumulation in another
order, so the relative Frobenius error of the whole output stays near 1.7e-3; we allow 5e-3.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import jaxsparse
from jaxsparse import _tuning
from jaxsparse._cuda import _kernels as ck
from jaxsparse.formats import _nm_masks
from jaxsparse.ops import _nm_matmul

needs_gpu = pytest.mark.skipif(not ck.available(), reason=ck.unavailable_reason() or "CUDA kernels available")
on_cpu = pytest.mark.skipif(ck.available(), reason="checks the behaviour without the CUDA kernels")
TOL = 5e-3


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _problem(seed, m, k, n, empty_cols=False):
  kx, kw = jax.random.split(jax.random.key(seed))
  w = jax.random.normal(kw, (k, n), jnp.float32)
  if empty_cols:  # whole columns of zeros: every group keeps two zeros there
    w = w.at[:, : n // 4].set(0.0)
  w = jaxsparse.NMSparseMatrix.from_dense(w.astype(jnp.bfloat16), 2, 4)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  ref = jnp.dot(x.astype(jnp.float32), w.to_dense().astype(jnp.float32))
  return x, w, ref


# -------------------------------------------------------------------------------------------------
# CPU.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("m", "k", "n", "dtype", "expect"),
    [
        (16, 4096, 4096, jnp.bfloat16, ""),
        (1, 64, 128, jnp.bfloat16, ""),
        (32, 4096, 192, jnp.bfloat16, ""),
        (33, 4096, 4096, jnp.bfloat16, "M must be between 1 and 32"),
        (0, 4096, 4096, jnp.bfloat16, "M must be between 1 and 32"),
        (4, 96, 128, jnp.bfloat16, "K must be a multiple of 64"),
        (4, 128, 160, jnp.bfloat16, "N of 64"),
        (4, 128, 128, jnp.float16, "dtype must be bfloat16"),
    ],
)
def test_nm24_unsupported_reason(m, k, n, dtype, expect):
  reason = ck.nm24_unsupported_reason(m, k, n, dtype)
  assert (expect in reason) if expect else reason == ""


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"split": 3}, "split must be 1, 2, 4 or 8, got split=3"),
        ({"token_split": 4}, "token_split must be 1 or 2, got token_split=4"),
        ({"warps": 16}, "warps must be 2, 4 or 8, got warps=16"),
        ({"span": 32}, r"span must be one of \(128, 64\), got span=32"),
        ({"blocks_per_sm": 5}, "blocks_per_sm must be 1, 2, 3 or 4, got blocks_per_sm=5"),
        ({"x_load": "ldg"}, r"x_load must be one of \('shuffle', 'ldmatrix'\), got x_load='ldg'"),
        ({"loads": "all"}, r"loads must be one of \('step', 'pair', 'stages', 'tma'\), got loads='all'"),
        ({"stages": 3}, "stages applies to loads='tma' only \\(keep 2\\), got stages=3 with loads='step'"),
        ({"loads": "tma"}, "needs x_load='ldmatrix' and token_split=1, got x_load='shuffle', token_split=1"),
        ({"loads": "tma", "x_load": "ldmatrix", "stages": 5}, "stages must be 2, 3 or 4, got stages=5"),
        ({"loads": "tma", "x_load": "ldmatrix", "token_split": 2},
         "token_split=1, got x_load='ldmatrix', token_split=2"),
        ({"loads": "tma", "x_load": "ldmatrix", "warps": 8, "span": 128, "stages": 3},
         "warps=8, span=128, stages=3 needs 246784 bytes of shared memory, at most 204800"),
    ],
)
def test_nm24_config_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ck.Nm24DecodeConfig(**kwargs)


@pytest.mark.parametrize(
    ("k", "n"), [(4096, 4096), (4096, 16384), (11008, 4096), (64, 128), (4096, 128), (4096, 8192), (2048, 11008)]
)
@pytest.mark.parametrize("m", [1, 16, 17, 32])
def test_nm24_default_config_fits(m, k, n):
  cfg = ck.Nm24DecodeConfig.get_default(m, k, n)
  # Every block of a cluster gets at least one step pair per warp.
  assert (k // 64) // cfg.split >= 1
  assert n % cfg.span == 0 and cfg.span in ck.NM24_SPANS


def _candidate_cases():
  """Every (m, k, n) of the candidate check. The fast set runs 4096 x 4096 at M of 1, 8, 16 and 32 and each other
  shape once (M = 17 on 4096 x 28672, M = 32 on 2048 x 2048: a default of three blocks a multiprocessor); the other
  29 cases are long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs them."""
  fast = {(1, 4096, 4096), (8, 4096, 4096), (16, 4096, 4096), (32, 4096, 4096), (16, 4096, 6144), (17, 4096, 28672),
          (1, 14336, 4096), (8, 2048, 2560), (1, 64, 128), (1, 4096, 4160), (32, 2048, 2048)}
  for m in [1, 8, 16, 17, 32]:
    for k, n in [(4096, 4096), (4096, 6144), (4096, 28672), (14336, 4096), (2048, 2560), (64, 128), (4096, 4160),
                 (2048, 2048)]:
      yield (m, k, n) if (m, k, n) in fast else pytest.param(m, k, n, marks=pytest.mark.slow)


@pytest.mark.parametrize(("m", "k", "n"), list(_candidate_cases()))
def test_nm24_candidate_configs_are_distinct_runnable_and_default_first(m, k, n):
  configs = ck.nm24_candidate_configs(m, k, n)
  assert configs[0] == ck.Nm24DecodeConfig.get_default(m, k, n) and len(set(configs)) == len(configs) <= 15
  # A default of three blocks a multiprocessor (from 25 rows at 32 warps a span) is followed by its one-block build,
  # of which the neighbours and variants are.
  d = dataclasses.replace(configs[0], blocks_per_sm=1)
  assert configs[0].blocks_per_sm == 1 or (configs[0].blocks_per_sm == 3 and configs[1] == d)
  other_load = "shuffle" if d.x_load == "ldmatrix" else "ldmatrix"
  extra = [dataclasses.replace(d, blocks_per_sm=2)]
  thirds = []  # above 16 rows: the 4-warp shapes with three blocks a multiprocessor, last
  if m > 8:
    extra += [dataclasses.replace(d, token_split=2), dataclasses.replace(d, x_load=other_load)]
    extra += [dataclasses.replace(d, loads=loads) for loads in ck.NM24_LOADS if loads not in (d.loads, "tma")]
    if m > 16:
      shaped = configs[:configs.index(extra[0])]
      thirds = [dataclasses.replace(c, blocks_per_sm=3, x_load="ldmatrix") for c in shaped if c.warps == 4]
      thirds = [c for c in dict.fromkeys(thirds) if c not in shaped]
      assert thirds or d.warps != 4
      extra += thirds
  else:  # the default's other x load, and ldmatrix on 64-column spans with its warps per span and in all
    loads = [dataclasses.replace(d, x_load=other_load)]
    if d.span == 128:
      loads.append(dataclasses.replace(d, span=64, x_load="ldmatrix"))
      loads += [dataclasses.replace(d, span=64, warps=d.warps // 2, x_load="ldmatrix")] if d.warps > 2 else []
    extra += [c for c in loads if c.warps == d.warps or (k // 64) >= c.split * c.warps]
  assert configs[-len(extra):] == extra
  # Reading cuSPARSELt's buffer: above 16 rows each with both steps' loads first (the buffer's default there); up to
  # 8 rows the same configs, but from 768 warps in all the default (and so its neighbours) with x through ldmatrix
  # and the other x load shuffles.
  buffer_configs = ck.nm24_candidate_configs(m, k, n, buffer=True)
  assert buffer_configs[0] == ck.Nm24DecodeConfig.get_default(m, k, n, buffer=True)
  if m > 16:
    assert (d.loads, buffer_configs[0]) == ("step", dataclasses.replace(configs[0], loads="pair"))
    swap = {"step": "pair", "pair": "step", "stages": "stages"}
    swapped = [dataclasses.replace(c, loads=swap[c.loads]) for c in configs]
    cut = len(configs) - len(thirds)  # the two other loads of the default just before the thirds
    assert buffer_configs[:cut - 2] == swapped[:cut - 2] and buffer_configs[cut:] == swapped[cut:]
    assert set(buffer_configs[cut - 2:cut]) == set(swapped[cut - 2:cut])
  elif m > 8:
    assert buffer_configs == configs
  else:  # the bulk-copy builds first (the default and its neighbours), then the other builds' candidates
    tma = [c for c in buffer_configs if c.loads == "tma"]
    assert buffer_configs[:len(tma)] == tma and len(buffer_configs) <= 15
    t = tma[0]
    assert (t.span, t.stages, t.x_load) == (64, 2, "ldmatrix") and tma[1] == dataclasses.replace(t, stages=3)
    steps = {(t.split // 2, t.warps), (t.split * 2, t.warps), (t.split, t.warps // 2), (t.split, t.warps * 2)}
    for c in tma[2:]:  # half or twice the split or the warps, or another warp count at the same warps per span
      assert c.stages == 2 and (k // 64) >= c.split * c.warps
      assert (c.split, c.warps) in steps or c.split * c.warps == t.split * t.warps
    buffer_configs = buffer_configs[len(tma):]
    many = (n // d.span) * d.split * d.warps >= 768
    assert buffer_configs[0] == (dataclasses.replace(d, x_load="ldmatrix") if many else d)
    b = buffer_configs[0]
    shaped = len(configs) - len(extra) + 1  # the default, its neighbours and with two blocks a multiprocessor
    swapped = [dataclasses.replace(c, x_load=b.x_load) for c in configs[:shaped]]
    swapped += [dataclasses.replace(b, x_load="ldmatrix" if b.x_load == "shuffle" else "shuffle")]
    swapped += configs[shaped + 1:]  # ldmatrix on 64-column spans
    assert buffer_configs == list(dict.fromkeys(swapped))
  neighbours = configs[1:-len(extra)]
  for c in neighbours:  # every warp of every block gets a step pair; the span divides N
    assert (k // 64) >= c.split * c.warps and n % c.span == 0
    assert (c.x_load, c.loads) == (d.x_load, d.loads) and (c.blocks_per_sm, c.token_split) == (1, 1)
  if m > 16:  # one config on 128-column spans at most: the default's warps in all (twice as many per span)
    wide = [c for c in neighbours if c.span == 128]
    assert len(wide) <= 1 and all(c.split * c.warps == 2 * configs[0].split * configs[0].warps for c in wide)
  # The backend offers them all: the default under the name the shipped rules pick, the others named by config.
  bf16 = jnp.dtype(jnp.bfloat16)
  cfg = _nm_matmul._Config(implementation="auto", precision=None, out_dtype=bf16)
  x = jnp.zeros((m, k), jnp.bfloat16)
  w = jaxsparse.NMSparseMatrix.from_dense(jnp.ones((k, n), jnp.bfloat16), 2, 4)
  cands = _nm_matmul._SparseMma(cfg).candidates(_nm_matmul._product(cfg, x, w, None))
  assert [c.value for c in cands] == configs and cands[0].name == "mma_sp"
  assert [c.name for c in cands[1:]] == [f"mma_sp/{c.name}" for c in configs[1:]]
  assert len({c.name for c in cands}) == len(cands)


def test_nm24_default_spans_by_rows():
  # The measured winners (benchmarks/results/gpu_nm_decode_2026-11-24_h100.md).
  # x_load: shuffles for one token tile, ldmatrix above (benchmarks/results/llm_decode_x_loads_2026-11-27_h100.md).
  lm = "ldmatrix"
  assert ck.Nm24DecodeConfig.get_default(8, 4096, 4096) == ck.Nm24DecodeConfig(split=8, warps=4, span=128)
  assert ck.Nm24DecodeConfig.get_default(1, 4096, 16384) == ck.Nm24DecodeConfig(split=1, warps=8, span=128)
  assert ck.Nm24DecodeConfig.get_default(16, 4096, 4096) == ck.Nm24DecodeConfig(8, 4, 64, x_load=lm)
  assert ck.Nm24DecodeConfig.get_default(16, 4096, 16384) == ck.Nm24DecodeConfig(1, 8, 64, x_load=lm)
  assert ck.Nm24DecodeConfig.get_default(32, 4096, 4096) == ck.Nm24DecodeConfig(2, 8, 64, x_load=lm)
  assert ck.Nm24DecodeConfig.get_default(32, 4096, 16384) == ck.Nm24DecodeConfig(1, 4, 64, x_load=lm)
  # Above 16 rows: about 768 warps (benchmarks/results/llm_decode_nm32_configs_2026-11-28_h100.md); 32 warps a span
  # (N = 2048) in clusters of 8 blocks of 4 warps, 64 (N = 768) in clusters of 8 blocks of 8 reading x by shuffles
  # from 25 rows.
  assert ck.Nm24DecodeConfig.get_default(24, 2048, 2048) == ck.Nm24DecodeConfig(8, 4, 64, x_load=lm)
  # (8 blocks of 4 warps a cluster, three blocks a multiprocessor and ldmatrix at 32 warps a span from 25 rows:
  # benchmarks/results/llm_decode_nm24_buffer_2026-12-01_h200.md).
  assert ck.Nm24DecodeConfig.get_default(32, 2048, 2048) == ck.Nm24DecodeConfig(8, 4, 64, 3, x_load=lm)
  assert ck.Nm24DecodeConfig.get_default(32, 4096, 768) == ck.Nm24DecodeConfig(8, 8, 64, x_load="shuffle")  # 64 a span
  assert ck.Nm24DecodeConfig.get_default(20, 4096, 28672) == ck.Nm24DecodeConfig(1, 2, 64, x_load=lm)
  assert ck.Nm24DecodeConfig.get_default(32, 2048, 5632) == ck.Nm24DecodeConfig(1, 8, 64, x_load=lm)
  assert ck.Nm24DecodeConfig.get_default(20, 2048, 5632) == ck.Nm24DecodeConfig(2, 4, 64, x_load=lm)
  # Each step's loads just before its products; reading cuSPARSELt's buffer above 16 rows, both steps' of a pair
  # before either's (benchmarks/results/llm_decode_nm24_loads_2026-12-01_h200.md).
  for m in (1, 8, 16, 17, 24, 32):
    d = ck.Nm24DecodeConfig.get_default(m, 4096, 4096)
    assert d.loads == "step"
    assert ck.Nm24DecodeConfig.get_default(m, 4096, 4096, buffer=True) == (
        dataclasses.replace(d, loads="pair") if m > 16 else d if m > 8 else
        ck.Nm24DecodeConfig(2, 8, 64, x_load=lm, loads="tma"))
  # N a multiple of 64 but not of 128: spans of 64 at every M.
  assert ck.Nm24DecodeConfig.get_default(1, 4096, 4160).span == 64


@pytest.mark.parametrize(
    ("k", "n", "split", "warps"),
    [(14336, 4096, 2, 8), (4096, 4096, 2, 8), (4096, 6144, 1, 8), (4096, 28672, 1, 2), (5632, 2048, 4, 8),
     (2048, 11264, 1, 4), (2048, 2048, 2, 8), (128, 256, 1, 2), (64, 64, 1, 2), (256, 64, 1, 2), (2048, 128, 2, 8),
     (4096, 128256, 1, 4), (4096, 65536, 1, 4), (4096, 65472, 1, 2), (128, 65536, 1, 4)],
)
def test_nm24_tma_default(k, n, split, warps):
  """Reading cuSPARSELt's buffer up to 8 rows: bulk copies into two stages on 64-column spans, the warps in all
  nearest 768 with two pairs of steps a warp (benchmarks/results/llm_decode_nm24_tma_2026-12-01_h200.md)."""
  for m in (1, 8):
    cfg = ck.Nm24DecodeConfig.get_default(m, k, n, buffer=True)
    assert cfg == ck.Nm24DecodeConfig(split, warps, 64, x_load="ldmatrix", loads="tma")
    assert (k // 64) >= 2 * cfg.split * cfg.warps or (cfg.split, cfg.warps) == (1, 2 if n < 65536 else 4)
  assert ck.Nm24DecodeConfig.get_default(9, k, n, buffer=True).loads != "tma"  # one token tile only
  assert ck.Nm24DecodeConfig.get_default(1, k, n).loads == "step"  # NMSparseMatrix indices: no bulk copies


def test_nm24_tma_shared_bytes_is_the_launchers():
  """The Python size of a build's rings is launch_checks.h's (the launcher allows and checks that many bytes)."""
  from jaxsparse._cuda import _nm24_config  # noqa: PLC0415

  checks = (ck._HERE / "launch_checks.h").read_text()
  assert "constexpr int64_t kMaxNm24TmaSharedBytes = 200 * 1024;" in checks
  assert _nm24_config.NM24_MAX_TMA_SHARED_BYTES == 200 * 1024
  # 64-column spans: stages of 4096 + 1024 bytes and 512 of metadata, rounded up to KB per warp, and 1 KB of slack.
  assert _nm24_config.nm24_tma_shared_bytes(8, 64, 2) == 8 * 11264 + 1024
  assert _nm24_config.nm24_tma_shared_bytes(4, 64, 3) == 4 * 17408 + 1024
  assert _nm24_config.nm24_tma_shared_bytes(2, 128, 4) == 2 * 40960 + 1024


def test_nm24_tma_config_needs_the_buffer_and_one_token_tile():
  cfg = ck.Nm24DecodeConfig(2, 4, 64, x_load="ldmatrix", loads="tma")
  assert cfg.name == "s2w4c64b1xmlt2" and dataclasses.replace(cfg, stages=4).name == "s2w4c64b1xmlt4"
  x = jnp.zeros((1, 256), jnp.bfloat16)
  w = jaxsparse.NMSparseMatrix.from_dense(jnp.ones((256, 128), jnp.bfloat16), 2, 4)
  with pytest.raises(ValueError, match=r"loads='tma'.* cuSPARSELt's buffer at up to 8 rows only .*NMSparseMatrix"):
    ck.nm24_decode(x, w.values, w.indices, config=cfg)
  with pytest.raises(ValueError, match=r"up to 8 rows only .*got 9 rows"):
    ck.nm24_decode_buffer(jnp.zeros((9, 256), jnp.bfloat16), jnp.zeros((256 * 128 // 8 * 9,), jnp.uint8), 128,
                          config=cfg)


def _decode_variants():
  """Every (rows, span, split, warps, token_split, x_load) of the decode kernel: rows of 1-4 token tiles. The fast
  set builds each (rows, span) once and each (token_split, x_load) at least once (split 2, 4 warps); the other 175
  builds are long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs them."""
  fast = {(1, 128, 1, "shuffle"), (16, 128, 1, "ldmatrix"), (16, 64, 2, "ldmatrix"), (24, 64, 1, "ldmatrix"),
          (32, 64, 1, "shuffle")}
  for rows, span in [(1, 128), (16, 128), (16, 64), (24, 64), (32, 64)]:
    for split, warps, (token_split, x_load) in itertools.product(
        [1, 2, 4, 8], [2, 4, 8], [(1, "shuffle"), (1, "ldmatrix"), (2, "ldmatrix")]):
      case = (rows, span, split, warps, token_split, x_load)
      in_fast_set = (split, warps) == (2, 4) and (rows, span, token_split, x_load) in fast
      yield case if in_fast_set else pytest.param(*case, marks=pytest.mark.slow)


@pytest.mark.parametrize(("rows", "span", "split", "warps", "token_split", "x_load"), list(_decode_variants()))
def test_nm24_source_compiles_for_hopper(rows, span, split, warps, token_split, x_load, monkeypatch, tmp_path):
  """NVRTC (the dev extra's nvidia-cuda-nvrtc; no GPU needed) compiles every variant of the kernel for sm_90."""
  assert ck._nvrtc() is not None, "libnvrtc not found: install the dev extra (nvidia-cuda-nvrtc)"
  monkeypatch.setenv("JAXSPARSE_CACHE_DIR", str(tmp_path))
  source = (ck._HERE / "nm24_decode.cu").read_text()
  cfg = ck.Nm24DecodeConfig(split, warps, span, token_split=token_split, x_load=x_load)
  options = ck._nvrtc_options("sm_90", ck._nm24_defines(rows, cfg))
  cubin, log = ck._compile_cubin(source, "nm24_decode", options)
  assert cubin is not None, log
  assert cubin[:4] == b"\x7fELF"
  assert ck._compile_cubin(source, "nm24_decode", options) == (cubin, "")  # from the disk cache


@pytest.mark.parametrize(("rows", "span"), [(1, 128), (16, 128), (16, 64), (32, 64)])
@pytest.mark.parametrize(("token_split", "x_load"), [(1, "shuffle"), (2, "ldmatrix")])
def test_nm24_buffer_source_compiles_for_hopper(rows, span, token_split, x_load, monkeypatch, tmp_path):
  """The build that reads cuSPARSELt's metadata (NM_META 1, nm24_decode_buffer) compiles for both lane widths."""
  assert ck._nvrtc() is not None, "libnvrtc not found: install the dev extra (nvidia-cuda-nvrtc)"
  monkeypatch.setenv("JAXSPARSE_CACHE_DIR", str(tmp_path))
  source = (ck._HERE / "nm24_decode.cu").read_text()
  cfg = ck.Nm24DecodeConfig(2, 8, span, token_split=token_split, x_load=x_load)
  defines = ck._nm24_defines(rows, cfg, buffer=True)
  assert ("NM_META", 1) in defines and ("NM_META", 0) in ck._nm24_defines(rows, cfg)
  cubin, log = ck._compile_cubin(source, "nm24_decode", ck._nvrtc_options("sm_90", defines))
  assert cubin is not None, log


@pytest.mark.parametrize(("rows", "span", "loads", "buffer"),
                         [(32, 64, "pair", True), pytest.param(32, 64, "stages", False, marks=pytest.mark.slow),
                          pytest.param(1, 128, "stages", True, marks=pytest.mark.slow),
                          pytest.param(16, 128, "pair", False, marks=pytest.mark.slow)])
def test_nm24_loads_source_compiles_for_hopper(rows, span, loads, buffer, monkeypatch, tmp_path):
  """The builds that load a pair of steps at once (NM_LOADS 1) and two pairs in turn (NM_LOADS 2) compile, for both
  lane widths and both layouts of the positions (the fast set builds the buffer's default above 16 rows; the other
  three builds are long: CI runs them)."""
  assert ck._nvrtc() is not None, "libnvrtc not found: install the dev extra (nvidia-cuda-nvrtc)"
  monkeypatch.setenv("JAXSPARSE_CACHE_DIR", str(tmp_path))
  cfg = ck.Nm24DecodeConfig(2, 4, span, x_load="ldmatrix", loads=loads)
  defines = ck._nm24_defines(rows, cfg, buffer=buffer)
  assert ("NM_LOADS", ck.NM24_LOADS.index(loads)) in defines
  cubin, log = ck._compile_cubin((ck._HERE / "nm24_decode.cu").read_text(), "nm24_decode",
                                 ck._nvrtc_options("sm_90", defines))
  assert cubin is not None, log


@pytest.mark.parametrize(("rows", "span", "stages"), [(1, 64, 2), pytest.param(8, 128, 3, marks=pytest.mark.slow),
                                                     pytest.param(5, 64, 4, marks=pytest.mark.slow)])
def test_nm24_tma_source_compiles_for_hopper(rows, span, stages, monkeypatch, tmp_path):
  """The build that streams the buffer by bulk tensor copies (NM_LOADS 3) compiles for both lane widths (the fast
  set builds the default's; the other two are long: CI runs them)."""
  assert ck._nvrtc() is not None, "libnvrtc not found: install the dev extra (nvidia-cuda-nvrtc)"
  monkeypatch.setenv("JAXSPARSE_CACHE_DIR", str(tmp_path))
  cfg = ck.Nm24DecodeConfig(2, 4, span, x_load="ldmatrix", loads="tma", stages=stages)
  defines = ck._nm24_defines(rows, cfg, buffer=True)
  assert ("NM_LOADS", 3) in defines and ("NM_STAGES", stages) in defines
  step = dataclasses.replace(cfg, loads="step", stages=2)
  assert all(name != "NM_STAGES" for name, _ in ck._nm24_defines(rows, step, buffer=True))
  cubin, log = ck._compile_cubin((ck._HERE / "nm24_decode.cu").read_text(), "nm24_decode",
                                 ck._nvrtc_options("sm_90", defines))
  assert cubin is not None, log


def test_nvrtc_gets_the_shared_header(monkeypatch, tmp_path):
  """Both decode kernels include copies.cuh, which NVRTC gets as a header; a change to it is a new build (cache key)."""
  for source in ("nm24_decode.cu", "block_sparse_decode.cu"):
    assert list(ck._headers((ck._HERE / source).read_text())) == ["copies.cuh"]
  assert ck._nvrtc() is not None, "libnvrtc not found: install the dev extra (nvidia-cuda-nvrtc)"
  monkeypatch.setenv("JAXSPARSE_CACHE_DIR", str(tmp_path))
  source = ('#include "copies.cuh"\n'
            'extern "C" __global__ void f(unsigned* o) { __shared__ int s; *o = smem_addr(&s); }\n')
  cubin, log = ck._compile_cubin(source, "uses_header", ["--gpu-architecture=sm_90"])
  assert cubin is not None, log
  monkeypatch.setattr(ck, "_headers", lambda src: {"copies.cuh": (ck._HERE / "copies.cuh").read_text() + "\n// new"})
  ck._compile_cubin(source, "uses_header", ["--gpu-architecture=sm_90"])
  assert len(list(tmp_path.glob("jaxsparse_uses_header-*.cubin"))) == 2


def test_nvrtc_errors_are_reported(monkeypatch, tmp_path):
  monkeypatch.setenv("JAXSPARSE_CACHE_DIR", str(tmp_path))
  cubin, log = ck._compile_cubin("this is not CUDA", "broken", ["--gpu-architecture=sm_90"])
  assert cubin is None and "NVRTC could not compile broken.cu" in log and "error" in log
  assert not list(tmp_path.iterdir())


def test_nm24_rejects_bad_operands():
  x, w, _ = _problem(0, 4, 128, 128)
  with pytest.raises(ValueError, match="M must be between 1 and 32"):
    ck.nm24_decode(jnp.zeros((33, 128), jnp.bfloat16), w.values, w.indices)
  w192 = jaxsparse.NMSparseMatrix.from_dense(jnp.ones((128, 192), jnp.bfloat16), 2, 4)
  with pytest.raises(ValueError, match="N=192 is not a multiple of the config's span=128"):
    ck.nm24_decode(x, w192.values, w192.indices, config=ck.Nm24DecodeConfig(span=128))
  with pytest.raises(ValueError, match=r"indices \(16, 128\) uint8"):
    ck.nm24_decode(x, w.values, w.indices.astype(jnp.uint16))


@on_cpu
def test_unavailable_off_cuda_and_nm_matmul_unchanged():
  assert not ck.available() and ck.unavailable_reason()
  x, w, ref = _problem(1, 5, 256, 128)
  y = jax.jit(jaxsparse.ops.nm_matmul)(x, w)
  assert y.dtype == jnp.bfloat16 and _rel(y, ref) < TOL
  assert "jaxsparse_nm24_decode" not in str(jax.jit(jaxsparse.ops.nm_matmul).lower(x, w).as_text())


@on_cpu
def test_no_fallback_warning_without_a_gpu_that_could_run_it(recwarn):
  assert ck.nm24_prepare(16, 256, 4096) == ck.unavailable_reason()
  ck.warn_fallback("nm_matmul", "some reason")
  assert not [w for w in recwarn if issubclass(w.category, ck.CudaKernelFallbackWarning)]


def test_sparse_mma_backend_and_default_rules():
  """Where the mma.sp backend may run (the kernel's availability aside), and where it is the shipped default."""
  bf16 = jnp.dtype(jnp.bfloat16)
  cfg = _nm_matmul._Config(implementation="auto", precision=None, out_dtype=bf16)
  x, w, _ = _problem(2, 16, 256, 4096)
  supported = lambda x2, w, c=cfg: _nm_matmul._SparseMma(c).unsupported_reason(_nm_matmul._product(c, x2, w, None))
  assert (supported(x, w) is None) == ck.available()
  assert "M must be" in supported(jnp.zeros((33, 256), jnp.bfloat16), w).reason  # too many rows
  f32 = _nm_matmul._Config(implementation="auto", precision=None, out_dtype=jnp.dtype(jnp.float32))
  assert "bfloat16" in supported(x, w, f32).reason
  w14 = jaxsparse.NMSparseMatrix.from_dense(jnp.ones((256, 4096), jnp.bfloat16), 1, 4)
  assert "2:4" in supported(x, w14).reason
  assert [b.name for b in _nm_matmul._BACKENDS["pallas"]] == ["pallas"]  # a forced backend never takes mma.sp
  # The default takes it for a wide W only; a narrower one is a candidate that tuning may pick.
  cands = lambda names: [_tuning.Candidate(n, None) for n in names]
  product = _nm_matmul._product(cfg, x, w, None)
  assert _nm_matmul._shipped_default(product, cands(["mma_sp", "pallas", "xla"])) == "mma_sp"
  for width, route in [(2048, "mma_sp"), (1024, "pallas")]:  # from 2048 columns (the TinyLlama products)
    narrow = jaxsparse.NMSparseMatrix.from_dense(jnp.ones((256, width), jnp.bfloat16), 2, 4)
    assert _nm_matmul._shipped_default(_nm_matmul._product(cfg, x, narrow, None),
                                       cands(["mma_sp", "pallas", "xla"])) == route
  many = jnp.zeros((128, 256), jnp.bfloat16)
  assert _nm_matmul._shipped_default(_nm_matmul._product(cfg, many, w, None),
                                     cands(["cusparselt", "pallas", "xla"])) == "cusparselt"
  assert _nm_matmul._shipped_default(_nm_matmul._product(cfg, many, w, None), cands(["pallas", "xla"])) == "xla"


def test_sr_ste_matmul_default_rules():
  """SR-STE's shipped default: sparse tensor cores from SPARSE_CORE_MIN_ROWS rows, our pruning kernel below (plain 2:4
  as transposable), the reference where neither is a candidate."""
  from jaxsparse.ops import _sr_ste  # noqa: PLC0415

  cands = lambda names: [_tuning.Candidate(n, None) for n in names]
  w = jnp.zeros((64, 32))
  for transposable in (False, True):
    cfg = _sr_ste._MatmulConfig(2, 4, 2e-4, jnp.dtype(jnp.bfloat16), None, None, transposable)
    few = _sr_ste._routed(cfg, jnp.zeros((256, 64), jnp.bfloat16), w)
    many = _sr_ste._routed(cfg, jnp.zeros((_sr_ste._min_rows(cfg), 64), jnp.bfloat16), w)
    assert _sr_ste._shipped_default(few, cands(["cusparselt", "prune_kernel", "xla"])) == "prune_kernel"
    assert _sr_ste._shipped_default(many, cands(["cusparselt", "prune_kernel", "xla"])) == "cusparselt"
    assert _sr_ste._shipped_default(many, cands(["prune_kernel", "xla"])) == "prune_kernel"
    assert _sr_ste._shipped_default(few, cands(["xla"])) == "xla"


def test_pallas_is_not_tuned_for_many_rows_unless_forced():
  """Measured dispatch leaves the Pallas N:M kernel out above PALLAS_MAX_TUNED_ROWS (slower than the XLA path there);
  implementation="pallas" still takes it."""
  w = jaxsparse.NMSparseMatrix.from_dense(jnp.ones((256, 256), jnp.bfloat16), 2, 4)
  many = jnp.zeros((_nm_matmul.PALLAS_MAX_TUNED_ROWS + 1, 256), jnp.bfloat16)

  def reason(impl, x):
    cfg = _nm_matmul._Config(impl, None, jnp.dtype(jnp.bfloat16))
    return _nm_matmul._Pallas(cfg).unsupported_reason(_nm_matmul._product(cfg, x, w, None))

  out = reason("auto", many)
  assert out is not None and "slower than the XLA path" in out.reason and not out.warn
  forced = reason("pallas", many)
  assert forced is None or "slower than the XLA path" not in forced.reason
  few = reason("auto", many[:_nm_matmul.PALLAS_MAX_TUNED_ROWS])
  assert few is None or "slower than the XLA path" not in few.reason


# -------------------------------------------------------------------------------------------------
# GPU.
# -------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [
        (16, 4096, 4096), (1, 4096, 4096), (5, 256, 384), (9, 128, 128), (16, 4096, 16384), (8, 1024, 2048),
        (3, 11008, 512), (32, 4096, 4096), (25, 1024, 640), (24, 4096, 16384), (17, 256, 192),
    ],
)
@pytest.mark.parametrize(
    "config",
    [
        None, ck.Nm24DecodeConfig(1, 8), ck.Nm24DecodeConfig(2, 8), ck.Nm24DecodeConfig(2, 4),
        ck.Nm24DecodeConfig(8, 8), ck.Nm24DecodeConfig(4, 2), ck.Nm24DecodeConfig(1, 4, 64),
        ck.Nm24DecodeConfig(8, 2, 64), ck.Nm24DecodeConfig(4, 8, 64), ck.Nm24DecodeConfig(2, 8, 64),
        ck.Nm24DecodeConfig(4, 8, 64, token_split=2), ck.Nm24DecodeConfig(8, 2, 64, token_split=2),
        ck.Nm24DecodeConfig(1, 4, 128, token_split=2), ck.Nm24DecodeConfig(1, 8, x_load="ldmatrix"),
        ck.Nm24DecodeConfig(2, 8, 64, x_load="ldmatrix"), ck.Nm24DecodeConfig(8, 2, 64, x_load="ldmatrix"),
        ck.Nm24DecodeConfig(4, 8, 64, token_split=2, x_load="ldmatrix"),
    ],
)
def test_gpu_nm24_decode(m, k, n, config):
  x, w, ref = _problem(m * 7 + n, m, k, n, empty_cols=(m == 5))
  if n % (config or ck.Nm24DecodeConfig.get_default(m, k, n)).span:
    with pytest.raises(ValueError, match="is not a multiple of the config's span"):
      ck.nm24_decode(x, w.values, w.indices, config=config)
    return
  y = jax.jit(lambda x, v, i: ck.nm24_decode(x, v, i, config=config))(x, w.values, w.indices)
  assert y.shape == (m, n) and y.dtype == jnp.bfloat16
  assert _rel(y, ref) < TOL


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    ("m", "k", "n"), [(1, 4096, 4096), (16, 4096, 6144), (5, 256, 384), (32, 1024, 2560), (3, 14336, 512), (8, 64, 128)]
)
@pytest.mark.parametrize(
    "config",
    [
        None, ck.Nm24DecodeConfig(1, 8), ck.Nm24DecodeConfig(8, 4), ck.Nm24DecodeConfig(1, 4, 64),
        ck.Nm24DecodeConfig(4, 8, 64), ck.Nm24DecodeConfig(4, 8, 64, token_split=2, x_load="ldmatrix"),
        ck.Nm24DecodeConfig(2, 2, 128, x_load="ldmatrix"),
    ],
)
def test_gpu_nm24_decode_buffer(m, k, n, config):
  """The kernel on cuSPARSELt's buffer (positions from its metadata) equals the reference and the kernel on
  NMSparseMatrix's arrays, for spans of 64 and 128 (the two ways a lane's columns meet the metadata bytes)."""
  from jaxsparse._cuda import _layout  # noqa: PLC0415

  x, w, ref = _problem(m * 5 + n, m, k, n, empty_cols=(m == 5))
  cfg = config or ck.Nm24DecodeConfig.get_default(m, k, n)
  if n % cfg.span or k // 64 < 1:
    return
  buffer = _layout.compress_values(w.values, w.positions())
  y = jax.jit(lambda x, b: ck.nm24_decode_buffer(x, b, n, config=config))(x, buffer)
  assert y.shape == (m, n) and y.dtype == jnp.bfloat16
  assert _rel(y, ref) < TOL
  on_indices = ck.nm24_decode(x, w.values, w.indices, config=config)
  if config is None and m <= 8:  # the buffer's default streams by bulk copies (another split: another sum order)
    assert _rel(y, on_indices.astype(jnp.float32)) < TOL
  else:
    np.testing.assert_array_equal(y, on_indices)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [(1, 4096, 4096), (8, 2048, 11264), (5, 256, 384), (3, 14336, 512), (8, 64, 128), (2, 192, 640), (7, 1024, 4096)],
)
@pytest.mark.parametrize(
    "config",
    [
        None, ck.Nm24DecodeConfig(2, 8, 64, x_load="ldmatrix", loads="tma"),
        ck.Nm24DecodeConfig(1, 2, 64, x_load="ldmatrix", loads="tma", stages=3),
        ck.Nm24DecodeConfig(8, 4, 64, x_load="ldmatrix", loads="tma", stages=4),
        ck.Nm24DecodeConfig(2, 4, 128, x_load="ldmatrix", loads="tma"),
        ck.Nm24DecodeConfig(1, 8, 128, x_load="ldmatrix", loads="tma"),
    ],
)
def test_gpu_nm24_decode_buffer_tma(m, k, n, config):
  """The bulk-copy build (NM_LOADS 3) equals the reference: 1-8 rows (rows past M are the tensor copy's zero fill),
  both span widths, 2-4 stages, K of one pair of steps, pairs that do not divide among the split's blocks, and more
  stages than a warp has pairs."""
  from jaxsparse._cuda import _layout  # noqa: PLC0415

  x, w, ref = _problem(m * 3 + k + n, m, k, n, empty_cols=(m == 5))
  cfg = config or ck.Nm24DecodeConfig.get_default(m, k, n, buffer=True)
  assert cfg.loads == "tma"
  if n % cfg.span:
    return
  buffer = _layout.compress_values(w.values, w.positions())
  f = jax.jit(lambda x, b: ck.nm24_decode_buffer(x, b, n, config=config))
  y = f(x, buffer)
  assert y.shape == (m, n) and y.dtype == jnp.bfloat16
  assert _rel(y, ref) < TOL
  # A second x (the tensor map of x is made per call) and the same again: the same kernel, the same bits.
  x2 = x[::-1] * 2
  np.testing.assert_array_equal(f(x2, buffer), jax.jit(lambda x, b: ck.nm24_decode_buffer(x, b, n, config=cfg))(
      x2, buffer))
  assert _rel(f(x2, buffer), (x2.astype(jnp.float32) @ w.to_dense().astype(jnp.float32))) < TOL


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("m", "k", "n"), [(1, 4096, 6144), (8, 2048, 11264), (24, 1024, 2560), (3, 14336, 512)])
def test_gpu_nm24_decode_every_candidate_config(m, k, n):
  """What measured dispatch may pick: each candidate config equals the reference (fused q/k/v and gate/up sizes), on
  NMSparseMatrix's arrays and on cuSPARSELt's buffer (its own candidates)."""
  from jaxsparse._cuda import _layout  # noqa: PLC0415

  x, w, ref = _problem(m + k + n, m, k, n)
  for cfg in ck.nm24_candidate_configs(m, k, n):
    y = jax.jit(lambda x, v, i, c=cfg: ck.nm24_decode(x, v, i, config=c))(x, w.values, w.indices)
    assert _rel(y, ref) < TOL, cfg
  buffer = _layout.compress_values(w.values, w.positions())
  for cfg in ck.nm24_candidate_configs(m, k, n, buffer=True):
    y = jax.jit(lambda x, b, c=cfg: ck.nm24_decode_buffer(x, b, n, config=c))(x, buffer)
    assert _rel(y, ref) < TOL, ("buffer", cfg)


@pytest.mark.gpu
@needs_gpu
def test_gpu_nm24_candidates_build_in_threads_then_run(monkeypatch, tmp_path):
  """What measured dispatch does before tracing: every candidate's kernel built at once (NVRTC in threads)."""
  monkeypatch.setenv("JAXSPARSE_CACHE_DIR", str(tmp_path))  # compile for real, not from the disk cache
  m, k, n = 24, 2048, 2560
  configs = ck.nm24_candidate_configs(m, k, n)
  with concurrent.futures.ThreadPoolExecutor(len(configs)) as pool:
    assert list(pool.map(lambda c: ck.nm24_prepare(m, k, n, c), configs)) == [""] * len(configs)
  assert {ck._nm24_defines(m, c) for c in configs} <= {key[2] for key in ck._load()["kernels"]}
  x, w, ref = _problem(5, m, k, n)
  for cfg in configs:
    assert _rel(ck.nm24_decode(x, w.values, w.indices, config=cfg), ref) < TOL, cfg


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=20, deadline=None)
@given(
    m=st.integers(1, 32),
    k=st.sampled_from([64, 192, 1024]),
    n=st.sampled_from([128, 256, 640]),
    split=st.sampled_from([1, 2, 4, 8]),
    span=st.sampled_from(ck.NM24_SPANS),
    token_split=st.sampled_from([1, 2]),
    x_load=st.sampled_from(ck.NM24_X_LOADS),
    seed=st.integers(0, 2**16),
)
def test_gpu_nm24_decode_random(m, k, n, split, span, token_split, x_load, seed):
  x, w, ref = _problem(seed, m, k, n)
  cfg = ck.Nm24DecodeConfig(split=split, warps=4, span=span, token_split=token_split, x_load=x_load)
  y = ck.nm24_decode(x, w.values, w.indices, config=cfg)
  assert _rel(y, ref) < TOL


@pytest.mark.gpu
@needs_gpu
def test_gpu_nm_matmul_takes_sparse_mma_at_decode():
  """``nm_matmul`` ("auto") with leading batch dims and its gradients, on the sparse tensor-core kernel."""
  _, w, _ = _problem(3, 1, 4096, 4096)
  x = jax.random.normal(jax.random.key(4), (2, 3, 4096), jnp.float32).astype(jnp.bfloat16)
  f = jax.jit(lambda x, w: jaxsparse.ops.nm_matmul(x, w))
  assert "jaxsparse_nm24_decode" in f.lower(x, w).as_text()
  y = f(x, w)
  ref = jnp.einsum("abk,kn->abn", x.astype(jnp.float32), w.to_dense().astype(jnp.float32))
  assert y.shape == (2, 3, 4096) and _rel(y, ref) < TOL
  # The backward is the XLA one; the forward kernel only has to be differentiable through the custom VJP.
  gx = jax.grad(lambda x: jaxsparse.ops.nm_matmul(x, w).astype(jnp.float32).sum())(x)
  gref = jnp.broadcast_to(w.to_dense().astype(jnp.float32).sum(axis=1), x.shape)
  assert _rel(gx, gref) < TOL


_LOOP_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
import jaxsparse
from jaxsparse._cuda import _kernels as ck
m, k, n, steps = 4, 1024, 4096, 6
w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(jax.random.key(0), (k, n)).astype(jnp.bfloat16), 2, 4)
x0 = jax.random.normal(jax.random.key(1), (m, k)).astype(jnp.bfloat16)

def body(_, x):  # the kernel between XLA fusions: a sequence XLA may record as one CUDA graph
  y = ck.nm24_decode(x, w.values, w.indices)
  return jnp.tanh(y[:, :k].astype(jnp.float32) * 0.05).astype(jnp.bfloat16) + x * 0.5

def ref_body(_, x):
  y = jnp.dot(x.astype(jnp.float32), w.to_dense().astype(jnp.float32)).astype(jnp.bfloat16)
  return jnp.tanh(y[:, :k].astype(jnp.float32) * 0.05).astype(jnp.bfloat16) + x * 0.5

run = jax.jit(lambda x: jax.lax.fori_loop(0, steps, body, x))
ref = jax.jit(lambda x: jax.lax.fori_loop(0, steps, ref_body, x))
for i in range(3):  # the first call loads the kernel's module, maybe while XLA captures the stream
  y, r = np.asarray(run(x0), np.float32), np.asarray(ref(x0), np.float32)
  err = np.linalg.norm(y - r) / np.linalg.norm(r)
  assert err < 2e-2, (i, err)
print("ok", err)
"""


@pytest.mark.gpu
@needs_gpu
def test_gpu_nm24_decode_in_a_loop_of_a_fresh_process():
  """The kernel's handler is command-buffer compatible: in a jitted loop of a fresh process (its module loaded on the
  first call, possibly while XLA records a CUDA graph) it computes what the dense loop does, call after call."""
  proc = subprocess.run([sys.executable, "-c", _LOOP_SCRIPT], capture_output=True, text=True, timeout=300,
                        env={**os.environ, "JAXSPARSE_AUTOTUNE": "off"})
  assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.gpu
@needs_gpu
def test_gpu_nm_matmul_falls_back_with_a_warning_when_the_kernel_cannot_build(monkeypatch):
  def broken(*args, **kwargs):
    raise RuntimeError("NVRTC could not compile nm24_decode.cu (test)")

  monkeypatch.setattr(ck, "kernel_id", broken)
  monkeypatch.setattr(ck, "_WARNED", set())
  x, w, ref = _problem(5, 4, 4096, 4096)
  with pytest.warns(ck.CudaKernelFallbackWarning, match="NVRTC could not compile"):
    text = jax.jit(jaxsparse.ops.nm_matmul).lower(x, w).as_text()
  assert "jaxsparse_nm24_decode" not in text
  assert _rel(jaxsparse.ops.nm_matmul(x, w), ref) < TOL


# -------------------------------------------------------------------------------------------------
# Transposable 2:4 pruning (nm24_prune.cu).
# -------------------------------------------------------------------------------------------------


def test_transposable_kernel_pattern_table_is_tile_patterns():
  # The kernel's literal table of pairs of row pairs must give every pattern of _tile_patterns(2, 4) its index
  # there (the tie rule and the pattern indices the backward pass expands depend on it).
  import itertools  # noqa: PLC0415
  import re  # noqa: PLC0415

  src = (ck._HERE / "nm24_prune.cu").read_text()
  table = src[src.index("#define NM_ROW_PAIRS(P)") :].split("\n//")[0]
  entries = [tuple(map(int, e)) for e in re.findall(r"P\((\d+), (\d+), (\d+), (\d+), (\d+), (\d+)\)", table)]
  assert [(a, b) for a, b, *_ in entries] == [(a, b) for a in range(6) for b in range(6)]
  pairs = list(itertools.combinations(range(4), 2))
  counts = lambda a, b: tuple(int(j in pairs[a]) + int(j in pairs[b]) for j in range(4))
  states = {}
  for a, b, state, *_ in entries:  # one state number per column count
    assert states.setdefault(counts(a, b), state) == state
  assert sorted(states.values()) == list(range(19))
  tiles = np.zeros((90, 4, 4), bool)
  filled = []
  for a, b, _, complement, _, base in entries:
    assert states[tuple(2 - c for c in counts(a, b))] == complement
    for c, d, state, _, rank, _ in entries:
      if state == complement:
        filled.append(base + rank)
        for r, p in enumerate((a, b, c, d)):
          tiles[base + rank, r, list(pairs[p])] = True
  assert sorted(filled) == list(range(90))
  np.testing.assert_array_equal(tiles, _nm_masks._tile_patterns(2, 4))


@pytest.mark.parametrize(
    ("shape", "dtype", "out", "expect"),
    [
        ((64, 32), jnp.float32, jnp.bfloat16, ""),
        ((4, 4), jnp.bfloat16, jnp.float32, ""),
        ((64, 30), jnp.float32, jnp.bfloat16, "multiples of 4"),
        ((64, 32, 4), jnp.float32, jnp.bfloat16, "2-D"),
        ((64, 32), jnp.float16, jnp.float16, "float32 or bfloat16"),
    ],
)
def test_transposable_unsupported_reason(shape, dtype, out, expect):
  reason = ck.nm24_prune_unsupported_reason(shape, dtype, out)
  assert (expect in reason) if expect else reason == ""


def test_nm24_prune_says_what_it_cannot_do():
  with pytest.raises(ValueError, match="bfloat16, got out_dtype=float32"):
    ck.nm24_prune(jnp.zeros((64, 64)), jnp.float32, compress=True)
  with pytest.raises(ValueError, match=r"K a multiple of 32 and N of 64, got shape \(36, 64\)"):
    ck.nm24_prune(jnp.zeros((36, 64)), jnp.bfloat16, compress=True)
  with pytest.raises(ValueError, match="multiples of 4"):
    ck.nm24_prune(jnp.zeros((64, 30)))


def test_group_bits_round_trip():
  mask = jaxsparse.nm_mask(jax.random.normal(jax.random.key(0), (64, 24)), 2, 4)
  bits = _nm_masks.group_bits(mask, 4)
  assert bits.shape == (16, 24) and bits.dtype == jnp.uint8
  np.testing.assert_array_equal(bits, (np.asarray(mask).reshape(16, 4, 24) << np.arange(4)[:, None]).sum(1))
  np.testing.assert_array_equal(_nm_masks.group_mask(bits, 4), mask)


def _check_transposable(w, out_dtype):
  """The kernel's pruning of ``w`` against nm_mask(transposable=True): same pattern except near-ties."""


  pruned, pattern = jax.jit(lambda w: ck.nm24_transposable(w, out_dtype))(w)
  k, n = w.shape
  assert pruned.shape == (k, n) and pruned.dtype == out_dtype and pattern.shape == (k // 4, n // 4)
  mask = np.asarray(_nm_masks.tile_mask(pattern, 2, 4))
  # Whatever the pattern, it is one of the 90 and the values are w's kept entries, rounded once.
  np.testing.assert_array_equal(np.asarray(pruned), np.asarray(jnp.where(mask, w, 0).astype(out_dtype)))
  want = np.asarray(_nm_masks.transposable_pattern(w, 2, 4))
  differ = np.asarray(pattern) != want
  if differ.any():  # only where the two patterns' totals agree to float32 rounding
    scores = np.minimum(np.nan_to_num(np.abs(np.asarray(w, np.float32)), nan=np.inf), np.finfo(np.float32).max / 16)
    tiles = scores.reshape(k // 4, 4, n // 4, 4).swapaxes(1, 2).reshape(k // 4, n // 4, 16).astype(np.float64)
    flat = _nm_masks._tile_patterns(2, 4).reshape(90, 16)
    totals = tiles @ flat.T
    got = np.take_along_axis(totals, np.asarray(pattern, np.int64)[..., None], -1)[..., 0]
    best = totals.max(-1)
    np.testing.assert_allclose(got[differ], best[differ], rtol=1e-6)
  return differ.mean()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("w_dtype", "out_dtype"), [(jnp.float32, jnp.bfloat16), (jnp.float32, jnp.float32),
                                                    (jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32)])
@pytest.mark.parametrize("shape", [(4, 4), (64, 132), (1024, 2048)])
def test_gpu_nm24_transposable(shape, w_dtype, out_dtype):
  w = jax.random.normal(jax.random.key(shape[0] + shape[1]), shape).astype(w_dtype)
  assert _check_transposable(w, jnp.dtype(out_dtype)) < 1e-3


@pytest.mark.gpu
@needs_gpu
def test_gpu_nm24_transposable_ties_nan_inf_zeros():
  # Small integers (many exact ties: the first pattern in order must win, as in nm_mask), whole zero tiles,
  # NaN and inf (the largest scores).
  w = jax.random.randint(jax.random.key(5), (128, 256), -3, 4).astype(jnp.float32)
  w = w.at[:4, :4].set(0.0).at[8, 9].set(jnp.nan).at[17, 3].set(jnp.inf).at[18, 3].set(-jnp.inf)
  assert _check_transposable(w, jnp.dtype(jnp.float32)) == 0.0
  pruned, _ = ck.nm24_transposable(w, jnp.float32)
  assert np.isnan(np.asarray(pruned)[8, 9]) and np.isinf(np.asarray(pruned)[[17, 18], 3]).all()


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=10, deadline=None)
@given(k=st.integers(1, 40), n=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_gpu_nm24_transposable_random_shapes(k, n, seed):
  w = jax.random.normal(jax.random.key(seed), (4 * k, 4 * n)) * jax.random.uniform(jax.random.key(seed + 1), (1, 4 * n))
  assert _check_transposable(w, jnp.dtype(jnp.bfloat16)) < 1e-2


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(64, 64), (128, 320), (1024, 2048)])
def test_gpu_nm24_transposable_compress_writes_cusparselts_buffers(shape, w_dtype):
  # The kernel's buffers of W and Wᵀ are those of cuSPARSELt's layout (as _layout writes it, itself checked
  # against cuSPARSELt's own compression), and the products by them are those of the pruned weight.
  from jaxsparse._cuda import _cusparselt as cslt  # noqa: PLC0415
  from jaxsparse._cuda import _layout  # noqa: PLC0415


  if not _layout.matches():
    pytest.skip("cuSPARSELt's layout here is not the one _layout writes")
  k, n = shape
  w = jax.random.normal(jax.random.key(k + n), shape).astype(w_dtype)
  pattern, blob, blob_t = jax.jit(ck.nm24_transposable_compress)(w)
  np.testing.assert_array_equal(pattern, ck.nm24_transposable(w)[1])
  pruned = jnp.where(_nm_masks.tile_mask(pattern, 2, 4), w, 0).astype(jnp.bfloat16)
  np.testing.assert_array_equal(blob, _layout.compress_dense(pruned))
  np.testing.assert_array_equal(blob_t, _layout.compress_dense(pruned.T))
  x = jax.random.normal(jax.random.key(1), (48, k)).astype(jnp.bfloat16)
  dy = jax.random.normal(jax.random.key(2), (48, n)).astype(jnp.bfloat16)
  assert _rel(cslt.matmul(x, blob, n), jnp.dot(x, pruned, preferred_element_type=jnp.float32)) < TOL
  assert _rel(cslt.matmul(dy, blob_t, k), jnp.dot(dy, pruned.T, preferred_element_type=jnp.float32)) < TOL


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(32, 64), (96, 192), (1024, 2048)])
def test_gpu_nm24_prune_is_nm_mask_and_the_xla_layout(shape, w_dtype):
  # Plain 2:4 pruned by our kernel: exactly nm_mask's mask (its ties to the lower index, NaN the largest), the
  # pruned weight, its group bits, and the compressed buffer byte for byte the XLA pass's (which the _layout
  # tests check against cuSPARSELt).
  from jaxsparse._cuda import _layout  # noqa: PLC0415

  key = jax.random.key(shape[0])
  w = jax.random.normal(key, shape)
  ties = jax.random.randint(jax.random.fold_in(key, 1), shape, -2, 3).astype(jnp.float32)
  w = jnp.where(jnp.arange(shape[1]) % 3 == 0, ties, w).at[5, 7].set(jnp.nan).astype(w_dtype)
  mask = _nm_masks.nm_mask(w, 2, 4)
  for out_dtype in (jnp.float32, jnp.bfloat16):
    pruned, bits, blob = jax.jit(functools.partial(ck.nm24_prune, out_dtype=out_dtype))(w)
    np.testing.assert_array_equal(bits, _nm_masks.group_bits(mask, 4))
    # As float32: NumPy does not match bfloat16 NaNs as equal.
    np.testing.assert_array_equal(np.asarray(pruned, np.float32),
                                  np.asarray(jnp.where(mask, w, 0).astype(out_dtype), np.float32))
    assert pruned.dtype == out_dtype and blob.shape == (0,)
  if not _layout.matches():
    pytest.skip("cuSPARSELt's layout here is not the one _layout writes")
  pruned, bits, blob = jax.jit(functools.partial(ck.nm24_prune, out_dtype=jnp.bfloat16, compress=True))(w)
  np.testing.assert_array_equal(blob, _layout.compress_dense(w, dtype=jnp.bfloat16))
  np.testing.assert_array_equal(bits, _nm_masks.group_bits(mask, 4))


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=15, deadline=None)
@given(k4=st.integers(1, 40), n4=st.integers(1, 40), bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_gpu_nm24_prune_random_shapes(k4, n4, bf16, seed):
  # Any K, N multiple of 4 (a partial last thread block), uncompressed: nm_mask's mask exactly.
  w = jax.random.normal(jax.random.key(seed), (4 * k4, 4 * n4)).astype(jnp.bfloat16 if bf16 else jnp.float32)
  pruned, bits, _ = ck.nm24_prune(w)
  mask = _nm_masks.nm_mask(w, 2, 4)
  np.testing.assert_array_equal(pruned, jnp.where(mask, w, 0))
  np.testing.assert_array_equal(bits, _nm_masks.group_bits(mask, 4))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_sr_ste_matmul_prune_kernel_route_is_the_reference(w_dtype):
  # Below SPARSE_CORE_MIN_ROWS the shipped default of plain 2:4 is our pruning kernel with dense products (forced
  # here too): the value and both gradients those of the reference, decay included.
  from jaxsparse import ops  # noqa: PLC0415
  from jaxsparse.ops import _sr_ste  # noqa: PLC0415

  kx, kw, kg = jax.random.split(jax.random.key(4), 3)
  w = jax.random.normal(kw, (512, 384)).astype(w_dtype)
  x = jax.random.normal(kx, (3, 40, 512)).astype(jnp.bfloat16)
  dy = jax.random.normal(kg, (3, 40, 384)).astype(jnp.bfloat16)
  run = lambda impl: jax.jit(lambda x, w, dy: (lambda y, vjp: (y, *vjp(dy)))(*jax.vjp(
      lambda x, w: ops.sr_ste_matmul(x, w, 2, 4, decay=0.01, dtype=jnp.bfloat16, implementation=impl), x, w)))
  with jaxsparse.autotune_mode("off"):
    for impl in ("prune_kernel", None):
      assert "jaxsparse_nm24_prune" in run(impl).lower(x, w, dy).as_text()
    assert 40 * 3 < _sr_ste.SPARSE_CORE_MIN_ROWS
    got, want = run("prune_kernel")(x, w, dy), run("xla")(x, w, dy)
  for g, r in zip(got, want, strict=True):  # the same dense products of the same pruned bf16 kernel
    assert g.dtype == r.dtype and _rel(g, r) < 5e-3


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("shape", "axis"), [((256, 128), 0), ((3, 3, 64, 32), -2), ((32, 48, 8), 1)])
def test_gpu_sr_ste_transposable_mask_by_the_kernel(shape, axis):
  # ops.sr_ste (NMConv's and the Flax path's pruning) takes the transposable mask from our kernel on the GPU,
  # for any axis and leading dims: the mask of nm_mask (random normal weights have no near-ties), and the
  # SR-STE gradient with it.
  from jaxsparse import ops  # noqa: PLC0415

  w = jax.random.normal(jax.random.key(len(shape)), shape)
  f = jax.jit(lambda w: ops.sr_ste(w, 2, 4, axis=axis, decay=0.1, transposable=True))
  assert "jaxsparse_nm24_transposable" in f.lower(w).as_text()
  mask = jaxsparse.nm_mask(w, 2, 4, axis=axis, transposable=True)
  np.testing.assert_array_equal(f(w), jnp.where(mask, w, 0.0))
  g = jax.jit(jax.grad(lambda w: ops.sr_ste(w, 2, 4, axis=axis, decay=0.1, transposable=True).sum()))(w)
  np.testing.assert_allclose(g, 1.0 + np.where(mask, 0.0, 0.1 * np.asarray(w)), rtol=1e-6)
