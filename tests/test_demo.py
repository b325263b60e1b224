"""The README's main demo runs end to end (tiny step counts) and writes its plot."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

DEMO = pathlib.Path(__file__).parent.parent / "examples" / "demo.py"


@pytest.mark.slow  # ~50 s on 2 cores
def test_demo_runs(tmp_path):
  spec = importlib.util.spec_from_file_location("jaxsparse_demo", DEMO)
  demo = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(demo)
  plot = tmp_path / "demo.png"
  rows = demo.main(["--steps", "30", "--finetune", "5", "--plot", str(plot)])
  assert plot.stat().st_size > 10_000
  assert rows[0]["name"] == "dense" and len(rows) == 1 + len(demo.VARIANTS)
  dense, block = rows[0], rows[1]
  assert block["bytes"] < 0.2 * dense["bytes"]  # 10% of the hidden blocks kept
  assert all(0.0 <= r["acc"] <= 1.0 for r in rows)
  assert dense["acc"] > 0.5  # 30 steps of adam learn digits well past chance (0.1)
