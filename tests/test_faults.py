"""The fault set: malformed inputs to formats, ops, layers and the native kernels.

Each case is one bad input and what it must do: raise an error whose message names the argument (and what
is allowed), or, where the input is legal but unusual, give the right numbers. Checkpoints and the command
line have their own file, tests/test_faults_checkpoints.py. Cases that could crash the process (the C++
kernels fed bad index arrays) run in a child interpreter, so a segfault fails them instead of killing pytest.
"""

import pytest

from tests._faults_util import missing_report
from tests._faults_util import run_child

# -------------------------------------------------------------------------------------------------
# Native CPU kernels: every entry point checks the index arrays it reads, and reads masks as `!= 0`.
# -------------------------------------------------------------------------------------------------

# case -> fragment of the error message (None: must succeed and match the dense reference)
NATIVE_CASES = {
    "masked_forward_mask_bytes_255": None,
    "masked_backward_mask_bytes_255": None,
    "csr_forward_col_offsets_decreasing": "col_offsets is not an offset array",
    "csr_forward_col_offsets_past_nnz": "col_offsets is not an offset array",
    "csr_forward_row_index_past_k": "transpose_row_indices has entries outside",
    "csr_forward_row_index_negative": "transpose_row_indices has entries outside",
    "csr_forward_order_past_nnz": "transpose_order has entries outside",
    "csr_backward_row_offsets_decreasing": "row_offsets is not an offset array",
    "csr_backward_row_offsets_first_not_zero": "row_offsets is not an offset array",
    "csr_backward_col_index_past_n": "col_indices has entries outside",
    "csr_backward_col_index_negative": "col_indices has entries outside",
    "block_forward_col_offsets_decreasing": "col_offsets is not an offset array",
    "block_forward_row_index_past_grid": "row_indices has entries outside",
    "block_forward_order_negative": "transpose_order has entries outside",
    "block_backward_row_offsets_past_nnz": "row_offsets is not an offset array",
    "block_backward_col_index_past_grid": "col_indices has entries outside",
}

_NATIVE_CHILD = """
import json, sys
import numpy as np
import jax, jax.numpy as jnp
from jaxsparse._cpu import _build, _kernels
from jaxsparse.formats import BlockSparseMatrix, CSRMatrix

if not _build.load():
  print(json.dumps({"case": "unavailable", "reason": _build.unavailable_reason()}))
  sys.exit(0)
rng = np.random.default_rng(0)
f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
i32 = lambda v: np.asarray(v, np.int32)

def masked(backward):
  # Earlier, larger calls leave the scratch of every pool thread full of stale entries.
  k, n = 512, 2048
  for _ in range(4):
    _kernels.masked_forward(f32(8, k), f32(k, n), rng.random((k, n)) < 0.5).block_until_ready()
  k, n = 64, 32
  x, w, dy = f32(8, k), f32(k, n), f32(8, n)
  raw = (rng.random((k, n)) < 0.1).astype(np.uint8) * 255  # bool bytes other than 0/1
  raw[0, 0] = 7
  mask = raw.view(bool)
  keep = raw != 0
  if not backward:
    err = np.abs(np.asarray(_kernels.masked_forward(x, w, mask)) - x @ np.where(keep, w, 0)).max()
  else:
    dx, dw = _kernels.masked_backward(x, w, mask, dy)
    err = max(np.abs(np.asarray(dx) - dy @ np.where(keep, w, 0).T).max(),
              np.abs(np.asarray(dw) - np.where(keep, x.T @ dy, 0)).max())
  return {"error": None, "max_err": float(err)}

def csr_parts():
  mask = rng.random((16, 24)) < 0.3
  return CSRMatrix.from_dense(f32(16, 24), mask=mask)

def block_parts():
  return BlockSparseMatrix.from_dense(f32(32, 48), (8, 8), block_mask=rng.random((4, 6)) < 0.5)

def spoil(arr, where, value):
  arr = np.array(arr)
  arr[where] = value
  return arr

def run(case):
  if case.startswith("masked_"):
    return masked("backward" in case)
  x = f32(4, 16)
  if case.startswith("csr_"):
    w = csr_parts()
    a = {f: np.asarray(getattr(w, f)) for f in w.INDEX_FIELDS}
    nnz = w.nnz
    if case == "csr_forward_col_offsets_decreasing":
      a["col_offsets"] = spoil(a["col_offsets"], 3, a["col_offsets"][5] + 1)
    elif case == "csr_forward_col_offsets_past_nnz":
      a["col_offsets"] = spoil(a["col_offsets"], -1, nnz + 100)
    elif case == "csr_forward_row_index_past_k":
      a["transpose_row_indices"] = spoil(a["transpose_row_indices"], 0, 10**6)
    elif case == "csr_forward_row_index_negative":
      a["transpose_row_indices"] = spoil(a["transpose_row_indices"], 1, -3)
    elif case == "csr_forward_order_past_nnz":
      a["transpose_order"] = spoil(a["transpose_order"], 2, nnz + 5)
    elif case == "csr_backward_row_offsets_decreasing":
      a["row_offsets"] = spoil(a["row_offsets"], 4, 0)
    elif case == "csr_backward_row_offsets_first_not_zero":
      a["row_offsets"] = spoil(a["row_offsets"], 0, 2)
    elif case == "csr_backward_col_index_past_n":
      a["col_indices"] = spoil(a["col_indices"], 0, 24)
    elif case == "csr_backward_col_index_negative":
      a["col_indices"] = spoil(a["col_indices"], 0, -1)
    data = np.asarray(w.data)
    if "_forward_" in case:
      y = _kernels.csr_forward(x, data, a["col_offsets"], a["transpose_order"], a["transpose_row_indices"])
    else:
      y = _kernels.csr_backward(x, data, a["row_offsets"], a["col_indices"], f32(4, 24))[0]
  else:
    w = block_parts()
    x = f32(4, 32)
    a = {f: np.asarray(getattr(w, f)) for f in w.INDEX_FIELDS}
    nnz = w.nnz_blocks
    if case == "block_forward_col_offsets_decreasing":
      a["col_offsets"] = spoil(a["col_offsets"], 2, nnz)
      a["col_offsets"] = spoil(a["col_offsets"], 3, 0)
    elif case == "block_forward_row_index_past_grid":
      a["row_indices"] = spoil(a["row_indices"], 0, 4)
    elif case == "block_forward_order_negative":
      a["transpose_order"] = spoil(a["transpose_order"], 0, -(2**31))
    elif case == "block_backward_row_offsets_past_nnz":
      a["row_offsets"] = spoil(a["row_offsets"], -1, nnz + 1)
    elif case == "block_backward_col_index_past_grid":
      a["col_indices"] = spoil(a["col_indices"], 1, 6)
    data = np.asarray(w.data)
    if "_forward_" in case:
      y = _kernels.block_forward(x, data, a["row_indices"], a["col_offsets"], a["transpose_order"])
    else:
      y = _kernels.block_backward(x, data, a["row_offsets"], a["col_indices"], f32(4, 48))[0]
  try:
    jax.block_until_ready(y)
  except Exception as e:
    return {"error": type(e).__name__, "message": str(e)}
  return {"error": None, "message": ""}

for case in sys.argv[1].split(","):
  try:
    result = run(case)
  except Exception as e:
    result = {"error": type(e).__name__, "message": str(e)}
  print(json.dumps({"case": case, **result}), flush=True)
"""


@pytest.fixture(scope="module")
def native_results():
  results, proc = run_child(_NATIVE_CHILD, ",".join(NATIVE_CASES))
  if "unavailable" in results:
    pytest.skip(f"C++ CPU kernels unavailable: {results['unavailable']['reason']}")
  return results, proc


@pytest.mark.parametrize("case", list(NATIVE_CASES))
def test_native_kernel_faults(native_results, case):
  results, proc = native_results
  r = results.get(case)
  assert r is not None, missing_report(results, case, proc)
  fragment = NATIVE_CASES[case]
  if fragment is None:
    assert r["error"] is None and r["max_err"] < 1e-4, r
  else:
    assert r["error"] is not None and fragment in r["message"], r
