"""Helpers of the fault-set tests: run code that might crash the process in a child interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(extra: dict | None = None) -> dict:
  env = {**os.environ, **(extra or {})}
  env["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [env.get("PYTHONPATH")])])
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env


def run_child(
    script: str, *args: str, timeout: float = 240, env: dict | None = None
) -> tuple[dict, subprocess.CompletedProcess]:
  """Runs ``script`` in a fresh interpreter (``env`` added to the environment); it prints one JSON object per
  case: ``{"case", ...}``."""
  proc = subprocess.run(
      [sys.executable, "-c", textwrap.dedent(script), *args],
      capture_output=True, text=True, timeout=timeout, env=child_env(env), check=False,
  )
  results = {}
  for line in proc.stdout.splitlines():
    if line.startswith("{"):
      entry = json.loads(line)
      results[entry["case"]] = entry
  return results, proc


def missing_report(results: dict, case: str, proc: subprocess.CompletedProcess) -> str:
  return (f"case {case!r} reported nothing: the child process exited with {proc.returncode} (a negative code is a "
          f"signal, e.g. -11 a segfault) while running it.\nstderr tail:\n{proc.stderr[-3000:]}")
