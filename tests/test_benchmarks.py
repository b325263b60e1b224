"""The benchmark scripts run (tiny sizes, CPU) and write their tables; no timing is asserted."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_train_step_benchmark_runs(tmp_path):
  out = tmp_path / "table.md"
  cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_train_step.py"), "--tiny", "--model", "transformer",
         "--sparse-attention", "--kinds", "block32,unstructured,nm2:4t", "--precisions", "f32", "--out", str(out)]
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [r for r in out.read_text().splitlines() if r.startswith("| ") and "layer kind" not in r]
  assert [r.split("|")[1].strip() for r in rows] == ["block32", "unstructured", "nm2:4t"]
  assert all("failed" not in r for r in rows), rows


def test_train_step_fused_attention_matches_nnx_attention():
  # The benchmark's --attention fused core against nnx's default one, in a transformer block (CPU: XLA's path).
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import gpu_train_step as ts  # noqa: PLC0415
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  x = jax.random.normal(jax.random.key(3), (2, 16, 32))
  blocks = {a: ts.TransformerBlock(32, 64, 4, rngs=nnx.Rngs(0), attention=a) for a in ts.ATTENTION}
  np.testing.assert_allclose(blocks["fused"](x), blocks["einsum"](x), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_calibrated_pruning_benchmark_runs(tmp_path):
  out = tmp_path / "table.md"
  cmd = [sys.executable, str(ROOT / "benchmarks" / "calibrated_pruning.py"), "--quick", "--out", str(out)]
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [r for r in out.read_text().splitlines() if r.startswith("| ") and "method" not in r]
  assert {r.split("|")[3].strip() for r in rows} == {"magnitude", "wanda", "sparsegpt"}, rows


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_ncu_block_sparse_script_runs():
  cmd = [sys.executable, str(ROOT / "benchmarks" / "sweeps" / "gpu_ncu_block_sparse.py"), "--m", "64", "--k", "128",
         "--n", "128", "--blocks", "32,64"]
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.splitlines() == ["block 32: 4 kept blocks, done", "block 64: 1 kept blocks, done", "dense: done"]


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_dense_route_script_runs():
  cmd = [sys.executable, str(ROOT / "benchmarks" / "sweeps" / "gpu_dense_route.py"), "--shapes",
         "64x128x96:16x16:0.5:bfloat16,32x64x64:8x8:0.3:float32", "--iterations", "1"]
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [r.split("|") for r in proc.stdout.splitlines()[-2:]]
  assert [r[2].strip() for r in rows] == ["16x16", "8x8"], proc.stdout
  assert all(float(r[-2]) < 1e-2 and "WRONG" not in r[9] for r in rows), proc.stdout


@pytest.mark.slow  # ~20 s on 2 cores (interpret mode)
def test_dw_routes_script_runs():
  cmd = [sys.executable, str(ROOT / "benchmarks" / "sweeps" / "gpu_dw_routes.py"), "--shapes",
         "40x256x192:128x32:0.5:float32,24x512x256:256x128:0.5:bfloat16", "--iterations", "1"]
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [r.split("|") for r in proc.stdout.splitlines()[-2:]]
  assert [r[2].strip() for r in rows] == ["128x32", "256x128"], proc.stdout
  assert "native:triton/sub64" in proc.stdout and "rel. err against the first 0.0e+00" in proc.stdout, proc.stdout
  assert all(float(r[-2]) > 0 for r in rows), proc.stdout


@pytest.mark.slow  # ~35 s on 2 cores
def test_product_routes_script_runs():
  cmd = [sys.executable, str(ROOT / "benchmarks" / "sweeps" / "gpu_product_routes.py"), "--m", "64", "--k", "128,256",
         "--ns", "128", "--blocks", "32,64x32", "--densities", "0.5", "--dtypes", "float32", "--iterations", "1",
         "--variants"]
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [r.split("|") for r in proc.stdout.splitlines() if r.startswith("| float32")]
  routes = {(r[3].strip(), r[4].strip(), r[6].strip()) for r in rows if len(r) > 12}  # M = 64: no dense route
  variants = {r[6].strip() for r in rows if len(r) <= 12}
  assert routes == {(kn, b, "kernels") for kn in ("128x128", "256x128") for b in ("32x32", "64x32")}, proc.stdout
  expected = {f"{p} Triton group_m={g}" for p in ("fwd", "dX") for g in (1, 2, 4, 16)} | {"dW Triton order=cols"}
  assert variants == expected, proc.stdout


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
@pytest.mark.parametrize("extra", [[], ["--space", "wide", "--modes", "off,tune"], ["--cold"]])
def test_unseen_shapes_script_runs(tmp_path, extra):
  out = tmp_path / "table.md"
  cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_unseen_shapes.py"), "--tiny", "--cases", "3",
         "--iterations", "1", "--out", str(out), *extra]
  env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path)}
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [r for r in out.read_text().splitlines() if r.startswith("| ") and "route" not in r]
  assert len(rows) == 3 and all("failed" not in r for r in rows), rows


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_cpu_draw_script_runs(tmp_path):
  out = tmp_path / "table.md"
  cmd = [sys.executable, str(ROOT / "benchmarks" / "cpu_block_sparse.py"), "--draw", "1", "--quick", "--cases", "3",
         "--repeats", "1", "--out", str(out)]
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [r.split("|") for r in out.read_text().splitlines() if r.startswith("| ") and "route" not in r]
  assert [r[2].strip() for r in rows] == ["block", "csr", "masked"], rows


@pytest.mark.slow  # ~30 s on 2 cores
def test_split_sweep_script_runs():
  # On the CPU: the Triton variants in interpret mode (no Mosaic GPU here), each checked against dense.
  cmd = [sys.executable, str(ROOT / "benchmarks" / "sweeps" / "gpu_split_sweep.py"), "--cases",
         "float32:80x256x128:64x32:0.5,bfloat16:70x128x256:32x32:0.5", "--iterations", "1"]
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [r.split("|") for r in proc.stdout.splitlines() if r.startswith("| float32:") or r.startswith("| bfloat16:")]
  assert [(r[1].strip().split(":")[0], r[2].strip()) for r in rows] == [
      ("float32", "fwd"), ("float32", "dX"), ("bfloat16", "fwd"), ("bfloat16", "dX")], proc.stdout
  assert all("triton" in r[5] and float(r[7]) < 2e-2 for r in rows), proc.stdout
  assert "FAILED" not in proc.stdout, proc.stdout


# One script per question a user asks (benchmarks/README.md); tuning sweeps live in benchmarks/sweeps/.
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))


def test_benchmarks_folder_stays_curated():
  assert len(SCRIPTS) + len(list((ROOT / "benchmarks").glob("*.sh"))) <= 10, [p.name for p in SCRIPTS]
  readme = (ROOT / "benchmarks" / "README.md").read_text()
  assert all(f"`{p.name}`" in readme for p in SCRIPTS), "benchmarks/README.md lists every script"


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_benchmark_script_help(script):
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, env=env, timeout=300)
  assert result.returncode == 0 and "usage:" in result.stdout, result.stderr[-3000:]


def _collected(*args: str) -> tuple[list[str], subprocess.CompletedProcess]:
  cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         "-m", "gpu", "tests/test_cuda_kernels.py", *args]
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
  return [line for line in proc.stdout.splitlines() if "::" in line], proc


@pytest.mark.slow  # 10-19 s on 2 cores: out of the fast set (make test <= 15 min); CI runs it
def test_gpu_suite_splits_into_shards():
  # benchmarks/run_gpu.sh passes `--shard I/N` (conftest.py) to split a suite over device calls: the shards are
  # disjoint, interleaved in node-id order and together the whole collection, in every process (pytest's own order of
  # parametrized tests is not); a malformed spec is a usage error naming it.
  whole = sorted(_collected()[0])
  shards = [sorted(_collected("--shard", f"{i}/3")[0]) for i in (1, 2, 3)]
  assert len(whole) > 30
  assert shards == [whole[0::3], whole[1::3], whole[2::3]]
  _, bad = _collected("--shard", "4/3")
  assert bad.returncode == 4 and "--shard I/N needs 1 <= I <= N, got '4/3'" in bad.stderr


def test_nm24_candidates_sweep_row():
  # GPU only to run; on the CPU its table row from made-up timings: the default, the best of each build, the default
  # before the bulk-copy build (the first of the other builds' candidates).
  sys.path.insert(0, str(ROOT / "benchmarks" / "sweeps"))
  import gpu_nm24_candidates as sweep  # noqa: PLC0415

  from jaxsparse._cuda import _kernels as ck  # noqa: PLC0415

  configs = ck.nm24_candidate_configs(1, 4096, 4096, buffer=True)
  us = {c: 30.0 - i for i, c in enumerate(configs)}  # the last candidate (a non-tma one) fastest
  r = {"dense": 40.0, "us": us, "err": dict.fromkeys(configs, 1e-3), "default_err": 4e-3}
  cells = [c.strip() for c in sweep.row(1, 4096, 4096, r).split("|")]
  tma = [c for c in configs if c.loads == "tma"]
  before = configs[len(tma)]
  assert cells[1:4] == ["1x4096x4096", "40.00", f"30.00 ({configs[0].name})"]
  assert cells[4] == f"{us[tma[-1]]:.2f} ({tma[-1].name})" and cells[5] == f"{us[before]:.2f} ({before.name})"
  assert cells[6] == f"{us[configs[-1]]:.2f} ({configs[-1].name})" and cells[-2] == "4.0e-03"
  assert cells[7] == f"{30.0 / us[before]:.3f}" and cells[9] == "0.75"


def test_block_decode_sweep_row_and_products():
  # GPU only to run; on the CPU its product specs and its table row from a made-up tuner entry.
  sys.path.insert(0, str(ROOT / "benchmarks" / "sweeps"))
  import gpu_block_decode as sweep  # noqa: PLC0415

  assert sweep.product("8x14336x4096:128:0.5") == (8, 14336, 4096, 128, 0.5)
  assert len(sweep.DEFAULT_PRODUCTS.split(",")) == 40
  entry = {"dense_us": 20.0, "choice": "cuda_decode/w8s1lt2",
           "times_us": {"cuda_decode": 10.0, "cuda_decode/w8s1lt2": 8.0, "default": 12.0, "triton/s4": 11.0,
                        "dense": 30.0}}
  cells = [c.strip() for c in sweep.row("1x4096x4096:64:0.5", entry, 2e-3).split("|")]
  assert cells[1:-1] == ["1x4096x4096:64:0.5", "20.00", "10.00", "8.00 (w8s1lt2)", "12.00", "11.00 (triton/s4)",
                         "0.727", "0.40", "cuda_decode/w8s1lt2", "2.0e-03"]


def test_block_decode_limits_sweep_masks_configs_and_row():
  # GPU only to run; on the CPU its masks, config names and table row.
  sys.path.insert(0, str(ROOT / "benchmarks" / "sweeps"))
  import gpu_block_decode_limits as sweep  # noqa: PLC0415

  from jaxsparse._cuda import _block_sparse_decode as bsd  # noqa: PLC0415

  assert sweep.config("w2s1lt3") == bsd.BlockSparseDecodeConfig(warps=2, split=1, stages=3)
  assert all(sweep.config(name) for name in sweep.DEFAULT_CONFIGS.split(",")[1:])
  assert sweep.product("1x4096x25344:64:0.5") == (1, 4096, 25344, 64, 0.5)
  made = sweep.masks(512, 768, 64, 0.375, ["random", "balanced"])
  assert made["random"].shape == made["balanced"].shape == (8, 12)
  assert made["random"].sum() == made["balanced"].sum() == 36
  assert (made["balanced"].sum(0) == 3).all()  # every block column the same count
  cells = [c.strip() for c in sweep.row("1x4096x4096:64:0.5", "balanced", made["balanced"].sum(0), 10.0, 33_554_432,
                                        16_777_216, {"default": 8.0, "w8s1lt2": 7.0}, "w4s2lt2").split("|")]
  assert cells[1:-1] == ["1x4096x4096:64:0.5", "balanced", "3 / 3.0", "10.00 (3.36)", "8.00 (2.10)", "7.00 (2.40)",
                         "w8s1lt2", "w4s2lt2"]


def test_nm24_config_sweep_lists_and_scores_configs(capsys):
  # GPU only to run; on the CPU its config space and its table row (from recorded timings).
  sys.path.insert(0, str(ROOT / "benchmarks" / "sweeps"))
  import gpu_nm24_configs as sweep  # noqa: PLC0415

  from jaxsparse._cuda import _kernels as ck  # noqa: PLC0415

  configs = sweep.all_configs(32, 2048, 2560)
  assert len(configs) == len(set(configs)) == 88  # K = 2048: 32 step pairs, so split x warps <= 32
  assert all(2048 // 64 >= c.split * c.warps for c in configs)
  # Every candidate of measured dispatch but the two-blocks-per-multiprocessor build, each load order's among that
  # order's configs.
  candidates = {c for c in ck.nm24_candidate_configs(32, 2048, 2560) if c.blocks_per_sm == 1}
  assert {c for c in candidates if c.loads == "step"} <= set(configs) and {c.loads for c in configs} == {"step"}
  # The bulk-copy build only on the buffer up to 8 rows: 2-4 stages where the shared memory fits.
  tma = [c for c in sweep.all_configs(1, 4096, 4096, loads=("tma",), buffer=True)]
  assert tma and all(c.loads == "tma" and c.x_load == "ldmatrix" for c in tma)
  assert {c for c in ck.nm24_candidate_configs(1, 4096, 4096, buffer=True) if c.loads == "tma"} <= set(tma)
  assert not sweep.all_configs(1, 4096, 4096, loads=("tma",)) and not sweep.all_configs(9, 4096, 4096, loads=("tma",),
                                                                                        buffer=True)
  every = sweep.all_configs(32, 2048, 2560, loads=ck.NM24_LOADS)
  assert len(every) == 3 * 88 and candidates <= set(every)
  assert not any(c.token_split == 2 for c in sweep.all_configs(8, 4096, 4096))  # one token tile: no split
  both = sweep.all_configs(1, 4096, 4096, blocks=(1, 2))  # with two blocks per multiprocessor: every candidate
  assert len(both) == 2 * len(sweep.all_configs(1, 4096, 4096)) and set(ck.nm24_candidate_configs(1, 4096, 4096)) <= \
      set(both)
  timings = {c.name: {"us": 10.0 + i, "rel_err": 1e-3} for i, c in enumerate(every)}
  best = ck.Nm24DecodeConfig.get_default(32, 2048, 2560, buffer=True).name  # the buffer's default
  timings[best]["us"] = 5.0
  row = sweep.row({"m": 32, "k": 2048, "n": 2560, "layout": "buffer", "dense_us": 8.0, "configs": timings}).split("|")
  assert row[1].strip() == "32 x 2048 x 2560" and row[2].strip() == "buffer"
  assert row[4].strip() == f"5.00 ({best})" and row[7].strip() == "0.62"
  assert row[-3].strip() == "264" and row[-2].strip() == "0"
  # Timings of the configs before the load orders (--loads step): the default's cell says it was not swept.
  old = sweep.row({"m": 32, "k": 2048, "n": 2560, "layout": "buffer", "dense_us": 8.0,
                   "configs": {c.name: timings[c.name] for c in configs}}).split("|")
  assert old[4].strip() == f"- ({best})" and old[7].strip() == "-"
  # The command line takes 1-4 blocks per multiprocessor and names what it takes otherwise.
  rows, shapes, _, blocks, loads, _ = sweep.parse_args(["--rows", "1,8", "--shapes", "14336x4096", "--blocks", "1,3,4"])
  assert (rows, shapes, blocks, loads) == ([1, 8], [(14336, 4096)], (1, 3, 4), ck.NM24_LOADS)
  with pytest.raises(SystemExit):
    sweep.parse_args(["--blocks", "5"])
  assert "--blocks 1-4" in capsys.readouterr().err
