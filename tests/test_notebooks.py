"""Executes every notebook in ``notebooks/`` (CPU, small sizes) and fails on any cell error."""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_notebooks_exist():
  assert len(NOTEBOOKS) >= 1


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
  nb = nbformat.read(path, as_version=4)
  assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), (
      f"{path.name} is stored with outputs; strip them before committing."
  )
  NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
  errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
  assert not errors, errors
