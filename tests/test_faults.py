"""The fault set: malformed inputs that must fail with a clear error, never crash, hang or compute garbage.

Each case is one bad input and the error it must raise; the message must name the argument or key. Inputs
that could crash the process (crafted torch sparse tensors, native kernels) run in a child process, so a
segfault fails the cases it hits instead of killing pytest.
"""

import functools
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child_env() -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [env.get("PYTHONPATH")])])
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env


def _run_child(script: str, *args: str, timeout: float = 240) -> tuple[dict, subprocess.CompletedProcess]:
  """Runs ``script`` in a fresh interpreter; it prints one JSON object per case: ``{"case", ...}``."""
  proc = subprocess.run(
      [sys.executable, "-c", textwrap.dedent(script), *args],
      capture_output=True, text=True, timeout=timeout, env=_child_env(), check=False,
  )
  results = {}
  for line in proc.stdout.splitlines():
    if line.startswith("{"):
      entry = json.loads(line)
      results[entry["case"]] = entry
  return results, proc


def _missing(results: dict, case: str, proc: subprocess.CompletedProcess) -> str:
  return (f"case {case!r} reported nothing: the child process exited with {proc.returncode} (a negative code is a "
          f"signal, e.g. -11 a segfault) while running it.\nstderr tail:\n{proc.stderr[-3000:]}")


# -------------------------------------------------------------------------------------------------
# Untrusted torch checkpoints: crafted sparse tensors (torch.load does not check their invariants, and
# torch's to_dense() trusts them). Each is saved to a file and read by every entry point.
# -------------------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")


def _coo(indices, values, size):
  return torch.sparse_coo_tensor(torch.tensor(indices), values, size, check_invariants=False)


def _compressed(layout, compressed, plain, values, size):
  return torch.sparse_compressed_tensor(torch.tensor(compressed), torch.tensor(plain), values, size,
                                        layout=getattr(torch, layout), check_invariants=False)


ones = torch.ones
_csr = functools.partial(_compressed, "sparse_csr")
_csc = functools.partial(_compressed, "sparse_csc")
_bsr = functools.partial(_compressed, "sparse_bsr")
_bsc = functools.partial(_compressed, "sparse_bsc")


def _w(t):
  return {"fc.weight": t}


# case -> (state dict builder, the key the message must name, regex the message must match)
SPARSE_CASES = {
    "coo_index_past_shape": (lambda: _w(_coo([[0, 1, 1000000], [0, 2, 3]], ones(3), (64, 64))),
                             "fc.weight", r"outside \[0, 64\)"),
    "coo_negative_index": (lambda: _w(_coo([[0, -5], [0, 1]], ones(2), (8, 8))),
                           "fc.weight", r"outside \[0, 8\)"),
    "coo_index_past_dim1": (lambda: _w(_coo([[0, 1], [0, 8]], ones(2), (8, 8))),
                            "fc.weight", r"dim 1.*outside \[0, 8\)"),
    "coo_huge_shape": (lambda: _w(_coo([[0], [0]], ones(1), (2**30, 2**30))),
                       "fc.weight", "does not fit in memory"),
    "csr_col_past_shape": (lambda: _w(_csr([0, 1, 2, 3], [0, 5, 99], ones(3), (3, 8))),
                           "fc.weight", r"col_indices.*outside \[0, 8\)"),
    "csr_negative_col": (lambda: _w(_csr([0, 1, 2, 3], [0, -1, 2], ones(3), (3, 8))),
                         "fc.weight", r"col_indices.*outside"),
    "csr_crow_not_monotone": (lambda: _w(_csr([0, 2, 1, 3], [0, 1, 2], ones(3), (3, 8))),
                              "fc.weight", "crow_indices.*non-decreasing"),
    "csr_crow_wrong_length": (lambda: _w(_csr([0, 1, 3], [0, 1, 2], ones(3), (3, 8))),
                              "fc.weight", r"crow_indices must have 4 entries"),
    "csr_crow_past_nnz": (lambda: _w(_csr([0, 1, 2, 50], [0, 1, 2], ones(3), (3, 8))),
                          "fc.weight", "crow_indices.*non-decreasing offsets from 0"),
    "csr_crow_first_not_zero": (lambda: _w(_csr([1, 1, 2, 3], [0, 1, 2], ones(3), (3, 8))),
                                "fc.weight", "crow_indices.*from 0"),
    "csr_duplicate_entry": (lambda: _w(_csr([0, 2, 2, 3], [1, 1, 0], ones(3), (3, 8))),
                            "fc.weight", "stored twice"),
    "csr_values_count": (lambda: _w(_csr([0, 1, 2, 3], [0, 1, 2], ones(2), (3, 8))),
                         "fc.weight", r"values must have shape"),
    "csr_col_count": (lambda: _w(_csr([0, 1, 2, 3], [0, 1], ones(3), (3, 8))),
                      "fc.weight", r"values must have shape"),
    "csr_float_indices": (lambda: _w(_csr([0.0, 1, 2, 3], [0.0, 1, 2], ones(3), (3, 8))),
                          "fc.weight", "must be an integer tensor"),
    "csr_batch_mismatch": (lambda: _w(_csr([[0, 1, 2, 3]], [[0, 1, 2], [0, 1, 2]], ones(2, 3), (2, 3, 8))),
                           "fc.weight", "do not describe a sparse_csr tensor"),
    "csr_batched_bad_col": (lambda: _w(_csr([[0, 1, 2, 3]] * 2, [[0, 1, 2], [0, 1, 9]], ones(2, 3), (2, 3, 8))),
                            "fc.weight", r"col_indices of batch 1.*outside"),
    "csc_row_past_shape": (lambda: _w(_csc([0, 1, 2, 3], [0, 1, 70], ones(3), (8, 3))),
                           "fc.weight", r"row_indices.*outside \[0, 8\)"),
    "csc_ccol_not_monotone": (lambda: _w(_csc([0, 3, 1, 3], [0, 1, 2], ones(3), (8, 3))),
                              "fc.weight", "ccol_indices.*non-decreasing"),
    "bsr_col_past_grid": (lambda: _w(_bsr([0, 1, 2], [0, 7], ones(2, 2, 2), (4, 4))),
                          "fc.weight", r"col_indices.*outside \[0, 2\)"),
    "bsr_block_not_dividing": (lambda: _w(_bsr([0, 1, 2], [0, 0], ones(2, 3, 3), (4, 4))),
                               "fc.weight", "blocks dividing"),
    "bsr_crow_wrong_length": (lambda: _w(_bsr([0, 1, 2, 2], [0, 1], ones(2, 2, 2), (4, 4))),
                              "fc.weight", "crow_indices must have 3 entries"),
    "bsc_row_past_grid": (lambda: _w(_bsc([0, 1, 2], [0, 3], ones(2, 2, 2), (4, 4))),
                          "fc.weight", r"row_indices.*outside \[0, 2\)"),
    "prune_sparse_mask": (lambda: {"fc.weight_orig": ones(4, 4),
                                   "fc.weight_mask": _coo([[0, 1, 1000000], [0, 2, 3]], ones(3), (4, 4))},
                          "fc.weight_mask", "expected a dense"),
    "prune_crafted_orig": (lambda: {"fc.weight_orig": _coo([[0, 1, 1000000], [0, 2, 3]], ones(3), (4, 4)),
                                    "fc.weight_mask": ones(4, 4)},
                           "fc.weight_orig", r"outside \[0, 4\)"),
    "apex_crafted_weight": (lambda: {"fc.weight": _csr([0, 1, 2, 3, 4], [0, 1, 2, 99], ones(4), (4, 4)),
                                     "fc.__weight_mma_mask": ones(4, 4)},
                            "fc.weight", r"col_indices.*outside \[0, 4\)"),
}

PATHS = ("decode", "load_nnx", "inspect", "convert")

_CHECKPOINT_CHILD = """
import contextlib, io, json, os, sys, warnings
warnings.simplefilter("ignore")
from flax import nnx
from jaxsparse import torch_interop
from jaxsparse.torch_interop._cli import main

directory, cases, paths = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")

class Model(nnx.Module):
  def __init__(self):
    self.fc = nnx.Linear(8, 8, rngs=nnx.Rngs(0))

def run(case, path):
  src = os.path.join(directory, case + ".pt")
  out = os.path.join(directory, f"{case}.{path}.safetensors")
  err = io.StringIO()
  try:
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
      if path == "decode":
        torch_interop.decode_checkpoint(src)
      elif path == "load_nnx":
        torch_interop.load_nnx(Model(), src)
      elif path == "inspect":
        return {"rc": main(["inspect", src]), "message": err.getvalue()}
      else:
        rc = main(["convert", src, out])
        leftovers = [p for p in os.listdir(directory) if p.startswith(f"{case}.{path}") or p.endswith(".tmp")]
        return {"rc": rc, "message": err.getvalue(), "files": leftovers}
  except Exception as e:
    return {"error": type(e).__name__, "message": str(e)}
  return {"error": None, "message": ""}

for case in cases:
  for path in paths:
    print(json.dumps({"case": f"{case}/{path}", **run(case, path)}), flush=True)
"""


@pytest.fixture(scope="module")
def checkpoint_results(tmp_path_factory):
  directory = tmp_path_factory.mktemp("bad_checkpoints")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch warns that invariant checks are off: that is the point
    for case, (build, _, _) in SPARSE_CASES.items():
      torch.save(build(), directory / f"{case}.pt")
  results, proc = _run_child(_CHECKPOINT_CHILD, str(directory), ",".join(SPARSE_CASES), ",".join(PATHS))
  return results, proc


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_crafted_sparse_checkpoint(checkpoint_results, case, path):
  results, proc = checkpoint_results
  _, key, pattern = SPARSE_CASES[case]
  r = results.get(f"{case}/{path}")
  assert r is not None, _missing(results, f"{case}/{path}", proc)
  if path in ("inspect", "convert"):
    assert r["rc"] == 1, r
    assert "jaxsparse: error" in r["message"] or "could not be decoded" in r["message"], r
  else:
    assert r["error"] == "CheckpointError", r
  assert key in r["message"], r
  assert re.search(pattern, r["message"], re.S), r
  if path == "convert":
    assert r["files"] == [], f"convert left files behind: {r['files']}"


def test_valid_torch_sparse_layouts_match_torch():
  """The NumPy densification agrees with torch's own on valid tensors (batch, hybrid, blocked, duplicates)."""
  import numpy as np  # noqa: PLC0415

  from jaxsparse import torch_interop  # noqa: PLC0415

  g = torch.Generator().manual_seed(0)
  d = torch.randn(16, 32, generator=g) * (torch.rand(16, 32, generator=g) < 0.3)
  sd = {
      "coo": d.to_sparse(), "csr": d.to_sparse_csr(), "csc": d.to_sparse_csc(), "bsr": d.to_sparse_bsr((8, 8)),
      "bsc": d.to_sparse_bsc((4, 8)), "hybrid_coo": torch.randn(4, 6, 3, generator=g).to_sparse(2),
      "batched_csr": torch.stack([d, 2 * d]).to_sparse_csr(),
      "batched_bsr": torch.stack([d, 2 * d]).to_sparse_bsr((4, 8)),
      "hybrid_csr": torch.randn(4, 6, 3, generator=g).to_sparse_csr(dense_dim=1), "bf16": d.bfloat16().to_sparse_csr(),
      "empty": torch.zeros(3, 4).to_sparse(),
      "duplicates": torch.sparse_coo_tensor([[0, 0, 1], [1, 1, 2]], torch.tensor([1.0, 2.0, 3.0]), (4, 4),
                                          check_invariants=True),
  }
  params = torch_interop.decode_checkpoint(sd)
  for k, t in sd.items():
    np.testing.assert_array_equal(params[k].value.astype(np.float32), t.to_dense().float().numpy(), err_msg=k)
    ones_t = torch.sparse_coo_tensor(t.coalesce().indices(), torch.ones(t.coalesce().values().shape), t.shape) \
        if t.layout == torch.sparse_coo else None
    if ones_t is not None:
      np.testing.assert_array_equal(params[k].mask, ones_t.to_dense().numpy() != 0, err_msg=k)
  assert params["duplicates"].value[0, 1] == 3.0 and params["duplicates"].mask.sum() == 2
  assert params["bsr"].mask.sum() % 64 == 0 and params["bsr"].pattern.kind in ("block", "dense")
