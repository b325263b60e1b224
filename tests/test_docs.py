"""The docs site builds as `make docs` builds it: warnings and broken cross references fail it."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytest.importorskip("sphinx")
pytest.importorskip("myst_nb")


def test_docs_build(tmp_path):
  cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-n", "-W", "--keep-going", "-q", "-E",
         "-d", str(tmp_path / "doctrees"), str(ROOT / "docs"), str(tmp_path / "html")]
  result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-10000:]
  assert (tmp_path / "html" / "api" / "jaxsparse.html").exists()


def test_every_public_name_has_a_reference_entry():
  sys.path.insert(0, str(ROOT / "docs"))
  try:
    import _api  # noqa: PLC0415 -- docs/ is not a package
  finally:
    sys.path.remove(str(ROOT / "docs"))
  pages = _api.entries()
  for module in ("jaxsparse", "jaxsparse.layers", "jaxsparse.layers.linen", "jaxsparse.ops", "jaxsparse.formats",
                 "jaxsparse.pruning", "jaxsparse.sharding", "jaxsparse.torch_interop", "jaxsparse.pallas"):
    assert module in pages, module
  for module, rows in pages.items():
    names = {name for name, _, _ in rows}
    assert names == set(sys.modules[module].__all__), module
    for name, kind, owner in rows:
      assert kind == "module" or name in sys.modules[owner].__all__, (module, name, owner)
