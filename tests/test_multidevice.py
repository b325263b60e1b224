"""Runs tests/multidevice/md_*.py in a subprocess with 4 host CPU devices (XLA_FLAGS must precede jax)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = sorted(p.name for p in (ROOT / "tests" / "multidevice").glob("md_*.py"))


@pytest.mark.slow  # 45-60 s each on 2 cores
@pytest.mark.parametrize("name", FILES)
def test_on_four_devices(name):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
  cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"tests/multidevice/{name}"]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
  assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def test_found_the_files():
  assert "md_data_parallel.py" in FILES


@pytest.mark.slow
def test_gpu_sharded_benchmark_runs_on_two_cpu_devices():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
  cmd = [sys.executable, "benchmarks/gpu_sharded.py", "--tiny", "--cpu-devices", "2", "--iterations", "1"]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
  assert "| 2 |" in proc.stdout and "0 all-gather" in proc.stdout, proc.stdout
