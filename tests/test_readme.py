"""The README stays short and every command in it runs as written."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def python_blocks(text: str) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_readme_is_short():
  assert len(README.splitlines()) <= 150


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_readme_python_runs(tmp_path):
  blocks = python_blocks(README)
  assert blocks
  script = tmp_path / "readme.py"
  script.write_text("\n\n".join(blocks))
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0, result.stderr[-5000:]


def test_readme_make_commands_are_targets():
  targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
  named = set(re.findall(r"\bmake ([\w-]+)", README))
  assert named and named <= targets, named - targets


def test_readme_links_exist():
  for link in re.findall(r"\]\(([^)#]+)\)", README):
    if not link.startswith("http"):
      assert (ROOT / link).exists(), link
