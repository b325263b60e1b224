"""Executes every notebook in ``notebooks/`` (CPU, small sizes) and fails on any cell error.

The notebooks are stored with their outputs (``make notebooks``), which the docs site renders without running them.
"""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_notebooks_exist():
  assert len(NOTEBOOKS) >= 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_stored_outputs(path):
  # The stored outputs are what the docs show: every code cell ran, none failed, and no output is huge.
  nb = nbformat.read(path, as_version=4)
  code = [cell for cell in nb.cells if cell.cell_type == "code"]
  assert all(cell.get("execution_count") for cell in code), f"{path.name}: run `make notebooks` to store its outputs"
  assert not [o for cell in code for o in cell.outputs if o.output_type == "error"], path.name
  assert path.stat().st_size < 2_000_000, f"{path.name} is {path.stat().st_size} bytes"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
  nb = nbformat.read(path, as_version=4)
  NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
  errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
  assert not errors, errors
