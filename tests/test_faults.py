"""The fault set: malformed inputs to formats, ops, layers and the native kernels.

Each case is one bad input and what it must do: raise an error whose message names the argument (and what
is allowed), or, where the input is legal but unusual, give the right numbers. Checkpoints and the command
line have their own file, tests/test_faults_checkpoints.py. Cases that could crash the process (the C++
kernels fed bad index arrays) run in a child interpreter, so a segfault fails them instead of killing pytest.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

import jaxsparse
from jaxsparse import BlockSparseMatrix
from jaxsparse import CSRMatrix
from jaxsparse import NMSparseMatrix
from jaxsparse import layers
from jaxsparse import ops
from jaxsparse.formats import _nm as nm_format
from jaxsparse.layers import linen as jl
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
    # Index arrays in range that describe another matrix than to_dense's (which is NaN for them): the kernels check
    # that the arrays they read agree with the rest (a permutation, the same columns / rows, no block twice).
    "block_forward_order_repeated": "transpose_order is not a permutation",
    "block_forward_order_rows_decreasing": "does not list its blocks in increasing block rows",
    "block_forward_row_index_disagrees": "row_offsets put block",
    "block_forward_col_index_disagrees": "transpose_order / col_offsets put block",
    "block_backward_row_index_disagrees": "row_offsets put block",
    "csr_few_rows_forward_row_offsets_decreasing": "row_offsets is not an offset array",
    "csr_few_rows_forward_col_index_past_n": "col_indices has entries outside",
    "csr_few_rows_forward_col_index_negative": "col_indices has entries outside",
    # The few-rows forward with one row (its scalar loop), and a bad last entry in the last of several work items.
    "csr_few_rows_forward_one_row_col_index_past_n": "col_indices has entries outside",
    "csr_few_rows_forward_last_item_col_index_negative": "col_indices has entries outside",
    # The dense route's conversions check each work item's rows (128 a item) as they go: bad entries in the first
    # and the last of three items.
    "csr_to_dense_row_offsets_negative_last_item": "row_offsets is not an offset array",
    "csr_to_dense_col_index_past_n_last_item": "col_indices has entries outside",
    "csr_take_row_offsets_past_nnz_first_item": "row_offsets is not an offset array",
    "csr_take_col_index_negative_first_item": "col_indices has entries outside",
    # Columns in range listed twice or out of order within a row (to_dense is NaN for them; a kernel would add an
    # entry twice): the kernels that read col_indices by rows check that each row's columns increase.
    "csr_few_rows_forward_col_repeated": "columns out of order or twice",
    "csr_backward_col_out_of_order": "columns out of order or twice",
    "csr_to_dense_col_repeated_last_item": "columns out of order or twice",
    "csr_take_col_out_of_order_first_item": "columns out of order or twice",
    "valid_shapes_sweep": None,  # every kernel on edge shapes against NumPy (under ASan: no stray access)
}
# In the fast set: a case of each kernel, and the CSR forward's transpose order. The others, the sweep the longest
# (about half the child's time), are long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs them.
FAST_NATIVE_CASES = {
    "masked_forward_mask_bytes_255", "masked_backward_mask_bytes_255", "csr_forward_col_offsets_decreasing",
    "csr_forward_order_past_nnz", "csr_backward_col_index_past_n", "block_forward_row_index_past_grid",
    "block_backward_row_offsets_past_nnz", "csr_few_rows_forward_col_index_negative",
    "block_forward_order_repeated", "block_backward_row_index_disagrees",
    "csr_few_rows_forward_one_row_col_index_past_n", "csr_few_rows_forward_last_item_col_index_negative",
    "csr_to_dense_row_offsets_negative_last_item", "csr_take_col_index_negative_first_item",
    "csr_few_rows_forward_col_repeated", "csr_to_dense_col_repeated_last_item",
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
    err = max(np.abs(np.asarray(_kernels.masked_forward(x, w, mask)) - x @ np.where(keep, w, 0)).max(),
              np.abs(np.asarray(_kernels.masked_forward(x, w, mask, route="gemm")) - x @ np.where(keep, w, 0)).max())
  else:
    dx, dw = _kernels.masked_backward(x, w, mask, dy)
    err = max(np.abs(np.asarray(dx) - dy @ np.where(keep, w, 0).T).max(),
              np.abs(np.asarray(dw) - np.where(keep, x.T @ dy, 0)).max())
  return {"error": None, "max_err": float(err)}

def csr_parts():
  mask = rng.random((16, 24)) < 0.3
  return CSRMatrix.from_dense(f32(16, 24), mask=mask)

def block_parts():
  grid = rng.random((4, 6)) < 0.5
  grid[:, 5] = False  # so a row's last block can move one column right (block_forward_col_index_disagrees)
  grid[0, 0] = True
  return BlockSparseMatrix.from_dense(f32(32, 48), (8, 8), block_mask=grid)

def spoil(arr, where, value):
  arr = np.array(arr)
  arr[where] = value
  return arr

def spoil_row(offsets, cols, rows, how):
  # The first row in `rows` with two entries or more: its second column the first's ("repeated"), or the two swapped.
  cols = np.array(cols)
  r = next(r for r in rows if offsets[r + 1] - offsets[r] >= 2)
  e = offsets[r]
  cols[e], cols[e + 1] = (cols[e], cols[e]) if how == "repeated" else (cols[e + 1], cols[e])
  return cols

def sweep():
  err = 0.0
  for b, k, n, density in [(1, 3, 5, 0.5), (7, 40, 9, 0.2), (70, 16, 300, 0.1), (9, 1100, 24, 0.05), (2, 8, 1, 1.0),
                           (3, 12, 7, 0.0)]:
    x, w, dy = f32(b, k), f32(k, n), f32(b, n)
    mask = rng.random((k, n)) < density
    wm = np.where(mask, w, 0)
    err = max(err, np.abs(np.asarray(_kernels.masked_forward(x, w, mask)) - x @ wm).max(),
              np.abs(np.asarray(_kernels.masked_forward(x, w, mask, route="gemm")) - x @ wm).max())
    dx, dw = _kernels.masked_backward(x, w, mask, dy)
    err = max(err, np.abs(np.asarray(dx) - dy @ wm.T).max(), np.abs(np.asarray(dw) - np.where(mask, x.T @ dy, 0)).max())
    c = CSRMatrix.from_dense(w, mask=mask)
    y = _kernels.csr_forward(x, c.data, c.col_offsets, c.transpose_order, c.transpose_row_indices)
    if b <= 8:
      y2 = _kernels.csr_few_rows_forward(x, c.data, c.row_offsets, c.col_indices, n)
      err = max(err, np.abs(np.asarray(y2) - x @ wm).max())
    dx, dd = _kernels.csr_backward(x, c.data, c.row_offsets, c.col_indices, dy)
    err = max(err, np.abs(np.asarray(y) - x @ wm).max(), np.abs(np.asarray(dx) - dy @ wm.T).max(),
              np.abs(np.asarray(dd) - (x.T @ dy)[mask]).max(initial=0))
    err = max(err, np.abs(np.asarray(_kernels.csr_to_dense(c.data, c.row_offsets, c.col_indices, n)) - wm).max(),
              np.abs(np.asarray(_kernels.csr_take(w, c.row_offsets, c.col_indices)) - w[mask]).max(initial=0))
  for b, kb, nb, bs in [(1, 1, 1, 8), (5, 3, 2, 8), (70, 2, 3, 16), (3, 4, 4, 8)]:
    k, n = kb * bs, nb * bs
    x, dy = f32(b, k), f32(b, n)
    grid = rng.random((kb, nb)) < 0.5
    w = BlockSparseMatrix.from_dense(f32(k, n), (bs, bs), block_mask=grid)
    dense = np.asarray(w.to_dense())
    y = _kernels.block_forward(x, w.data, w.row_indices, w.col_offsets, w.transpose_order, w.col_indices,
                               w.row_offsets)
    dx, dd = _kernels.block_backward(x, w.data, w.row_offsets, w.col_indices, w.row_indices, dy)
    full = (x.T @ dy).reshape(kb, bs, nb, bs).transpose(0, 2, 1, 3)[grid]
    err = max(err, np.abs(np.asarray(y) - x @ dense).max(), np.abs(np.asarray(dx) - dy @ dense.T).max(),
              np.abs(np.asarray(dd) - full).max(initial=0))
  return {"error": None, "max_err": float(err)}

def finish(y):
  try:
    jax.block_until_ready(y)
  except Exception as e:
    return {"error": type(e).__name__, "message": str(e)}
  return {"error": None, "message": ""}

def few_rows_spoiled(case):
  one = "one_row" in case
  k, n = (16, 24) if one else (512, 256)
  w = csr_parts() if one else CSRMatrix.from_dense(f32(k, n), mask=rng.random((k, n)) < 0.5)
  cols = np.array(w.col_indices)
  cols[-1] = n if one else -5
  x = f32(1 if one else 2, k)
  return finish(_kernels.csr_few_rows_forward(x, np.asarray(w.data), np.asarray(w.row_offsets), cols, n))

def conversion_spoiled(case):
  k, n = 300, 40  # three work items of 128 rows
  w = CSRMatrix.from_dense(f32(k, n), mask=rng.random((k, n)) < 0.5)
  offsets, cols = np.array(w.row_offsets), np.array(w.col_indices)
  if case == "csr_to_dense_row_offsets_negative_last_item":
    offsets[290] = -7
  elif case == "csr_to_dense_col_index_past_n_last_item":
    cols[-1] = n
  elif case == "csr_take_row_offsets_past_nnz_first_item":
    offsets[3] = w.nnz + 10
  elif case == "csr_take_col_index_negative_first_item":
    cols[0] = -1
  elif case == "csr_to_dense_col_repeated_last_item":
    cols = spoil_row(offsets, cols, range(256, k), "repeated")
  elif case == "csr_take_col_out_of_order_first_item":
    cols = spoil_row(offsets, cols, range(k), "swapped")
  if case.startswith("csr_to_dense_"):
    return finish(_kernels.csr_to_dense(np.asarray(w.data), offsets, cols, n))
  return finish(_kernels.csr_take(f32(k, n), offsets, cols))

def run(case):
  if case.startswith("masked_"):
    return masked("backward" in case)
  if case == "valid_shapes_sweep":
    return sweep()
  if case.startswith(("csr_few_rows_forward_one_row", "csr_few_rows_forward_last_item")):
    return few_rows_spoiled(case)
  if case.startswith(("csr_to_dense_", "csr_take_")):
    return conversion_spoiled(case)
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
    elif case in ("csr_backward_col_index_negative", "csr_few_rows_forward_col_index_negative"):
      a["col_indices"] = spoil(a["col_indices"], 0, -1)
    elif case == "csr_few_rows_forward_row_offsets_decreasing":
      a["row_offsets"] = spoil(a["row_offsets"], 4, 0)
    elif case == "csr_few_rows_forward_col_index_past_n":
      a["col_indices"] = spoil(a["col_indices"], 0, 24)
    elif case == "csr_few_rows_forward_col_repeated":
      a["col_indices"] = spoil_row(a["row_offsets"], a["col_indices"], range(16), "repeated")
    elif case == "csr_backward_col_out_of_order":
      a["col_indices"] = spoil_row(a["row_offsets"], a["col_indices"], range(16), "swapped")
    data = np.asarray(w.data)
    if case.startswith("csr_few_rows_"):
      y = _kernels.csr_few_rows_forward(x, data, a["row_offsets"], a["col_indices"], 24)
    elif "_forward_" in case:
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
    elif case == "block_forward_order_repeated":
      a["transpose_order"] = spoil(a["transpose_order"], 1, a["transpose_order"][0])
    elif case == "block_forward_order_rows_decreasing":  # the first two blocks of a column listed the other way round
      t = a["transpose_order"]
      j = next(j for j in range(len(a["col_offsets"]) - 1) if a["col_offsets"][j + 1] - a["col_offsets"][j] >= 2)
      first = a["col_offsets"][j]
      t = spoil(t, first, t[first + 1])
      a["transpose_order"] = spoil(t, first + 1, a["transpose_order"][first])
    elif case == "block_forward_row_index_disagrees":  # the forward reads row_indices; row_offsets says otherwise
      a["row_indices"] = spoil(a["row_indices"], 0, (a["row_indices"][0] + 1) % 4)
    elif case == "block_forward_col_index_disagrees":  # the rows' arrays agree; the column order does not
      last = a["row_offsets"][1] - 1  # block row 0's last block, moved one column right
      a["col_indices"] = spoil(a["col_indices"], last, a["col_indices"][last] + 1)
    elif case == "block_backward_row_index_disagrees":
      a["row_indices"] = spoil(a["row_indices"], 0, (a["row_indices"][0] + 1) % 4)
    data = np.asarray(w.data)
    if "_forward_" in case:
      y = _kernels.block_forward(x, data, a["row_indices"], a["col_offsets"], a["transpose_order"], a["col_indices"],
                                 a["row_offsets"])
    else:
      y = _kernels.block_backward(x, data, a["row_offsets"], a["col_indices"], a["row_indices"], f32(4, 48))[0]
  return finish(y)

for case in sys.argv[1].split(","):
  try:
    result = run(case)
  except Exception as e:
    result = {"error": type(e).__name__, "message": str(e)}
  print(json.dumps({"case": case, **result}), flush=True)
"""


@pytest.fixture(scope="module")
def native_results(request):
  # One child runs the cases this session selected (the fast set: FAST_NATIVE_CASES alone).
  cases = [item.callspec.params["case"] for item in request.session.items
           if getattr(item, "module", None) is request.module and item.originalname == "test_native_kernel_faults"]
  results, proc = run_child(_NATIVE_CHILD, ",".join(cases or NATIVE_CASES))
  if "unavailable" in results:
    pytest.skip(f"C++ CPU kernels unavailable: {results['unavailable']['reason']}")
  return results, proc


@pytest.mark.parametrize("case", [
    case if case in FAST_NATIVE_CASES else pytest.param(case, marks=pytest.mark.slow) for case in NATIVE_CASES
])
def test_native_kernel_faults(native_results, case):
  results, proc = native_results
  r = results.get(case)
  assert r is not None, missing_report(results, case, proc)
  fragment = NATIVE_CASES[case]
  if fragment is None:
    assert r["error"] is None and r["max_err"] < 1e-3, r
  else:
    assert r["error"] is not None and fragment in r["message"], r


# -------------------------------------------------------------------------------------------------
# Hand-built formats: validate() on concrete arrays in the constructors, checkify under jit.
# -------------------------------------------------------------------------------------------------

def _csr():
  rng = np.random.default_rng(1)
  mask = rng.random((6, 10)) < 0.4
  mask[0, :2] = True  # entries 0 and 1 share row 0
  return CSRMatrix.from_dense(rng.standard_normal((6, 10)).astype(np.float32), mask=mask)


def _block():
  rng = np.random.default_rng(2)
  mask = rng.random((4, 5)) < 0.5
  mask[0, :2] = True
  return BlockSparseMatrix.from_dense(rng.standard_normal((32, 40)).astype(np.float32), (8, 8), block_mask=mask)


def _set(field, i, value):
  def edit(idx):
    idx[field][i] = value(idx) if callable(value) else value
  return edit


def _replace(field, fn):
  def edit(idx):
    idx[field] = np.asarray(fn(idx), np.int32)
  return edit


def _swap_first_two(idx):
  for f in ("row_indices", "col_indices"):
    idx[f][[0, 1]] = idx[f][[1, 0]]


# case -> (edit of the index dict, message fragment); each applies to both CSRMatrix and BlockSparseMatrix
INDEX_CASES = {
    "row_index_past_grid": (_set("row_indices", 0, 10**6), "row_indices is invalid at position 0 (value 1000000"),
    "row_index_negative": (_set("row_indices", 2, -1), "row_indices is invalid at position 2 (value -1"),
    "col_index_past_grid": (_set("col_indices", 1, 99), "col_indices is invalid at position 1 (value 99"),
    "col_index_negative": (_set("col_indices", 0, -7), "col_indices is invalid at position 0"),
    "duplicate_entry": (_set("col_indices", 1, lambda idx: idx["col_indices"][0]), "each stored once"),
    "unsorted_entries": (_swap_first_two, "row-major order"),
    "row_offsets_decreasing": (_set("row_offsets", 1, lambda idx: idx["row_offsets"][-1]), "row_offsets is invalid"),
    "row_offsets_wrong_total": (_set("row_offsets", -1, 10**5), "row_offsets is invalid"),
    "col_offsets_shifted": (_replace("col_offsets", lambda idx: np.maximum(idx["col_offsets"] - 1, 0)),
                            "col_offsets is invalid"),
    "transpose_order_reversed": (_replace("transpose_order", lambda idx: idx["transpose_order"][::-1]),
                                 "transpose_order is invalid"),
    "transpose_order_past_nnz": (_set("transpose_order", 0, 10**6), "transpose_order is invalid"),
    "row_offsets_too_short": (_replace("row_offsets", lambda idx: idx["row_offsets"][:-1]),
                              "row_offsets must be an int32 array of shape"),
    "col_indices_float": (lambda idx: idx.__setitem__("col_indices", idx["col_indices"].astype(np.float32)),
                          "col_indices must be an int32 array"),
    "col_indices_too_long": (_replace("col_indices", lambda idx: np.append(idx["col_indices"], 0)),
                             "col_indices must be an int32 array of shape"),
}
CSR_ONLY_CASES = {
    "transpose_row_indices_inconsistent": (_set("transpose_row_indices", 0, lambda idx: idx["transpose_row_indices"][0]
                                                + 1), "transpose_row_indices is invalid at position 0"),
}
FORMATS = {"csr": _csr, "block": _block}


def _index_dict(w):
  return {k: np.array(v) for k, v in w.index_arrays().items()}


def _rebuild(w, idx, **kw):
  static = {f: getattr(w, f) for f in w.STATIC_FIELDS}
  return type(w).from_index_arrays(w.data, idx, **static, **kw)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("case", list(INDEX_CASES) + list(CSR_ONLY_CASES))
def test_hand_built_index_arrays_are_validated(fmt, case):
  if case in CSR_ONLY_CASES and fmt != "csr":
    pytest.skip("CSRMatrix only")
  edit, fragment = {**INDEX_CASES, **CSR_ONLY_CASES}[case]
  w = FORMATS[fmt]()
  idx = _index_dict(w)
  edit(idx)
  with pytest.raises(ValueError, match=type(w).__name__) as e:
    _rebuild(w, idx)
  assert fragment in str(e.value)
  # The raw constructor validates as well; validate=False is the explicit opt-out for hot paths.
  with pytest.raises(ValueError, match=re.escape(fragment)):
    type(w)(w.data, **idx, **{f: getattr(w, f) for f in w.STATIC_FIELDS})
  if "int32 array" not in fragment:
    assert _rebuild(w, idx, validate=False) is not None
    # Under jit the arrays are traced: validate() stages checkify checks that report the field.
    jitted = jax.jit(lambda data, idx: _rebuild(w, {**idx}, validate=False).validate().data.sum())
    err, _ = checkify.checkify(jitted)(w.data, idx)
    field = fragment.split(" ")[0]
    assert err.get() is not None and field.split("/")[0] in err.get(), err.get()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_valid_formats_pass_validation_everywhere(fmt):
  w = FORMATS[fmt]()
  assert w.validate() is w
  idx = _index_dict(w)
  assert _rebuild(w, idx).nnz == w.data.shape[0] if fmt == "csr" else True
  err, _ = checkify.checkify(jax.jit(lambda d, i: _rebuild(w, i, validate=False).validate().data.sum()))(w.data, idx)
  assert err.get() is None
  # traced index arrays skip the value checks in the constructor (no host sync under jit)
  assert jax.jit(lambda d, i: _rebuild(w, i).data.sum())(w.data, idx).shape == ()


def test_block_data_shape_is_checked():
  w = _block()
  with pytest.raises(ValueError, match=r"BlockSparseMatrix.data must have shape \(\d+, 8, 8\)"):
    BlockSparseMatrix.from_index_arrays(w.data[:, :4], _index_dict(w), shape=w.shape, block_shape=(8, 8))
  with pytest.raises(ValueError, match=r"block_shape=.* must divide shape"):
    BlockSparseMatrix.from_index_arrays(w.data, _index_dict(w), shape=(30, 40), block_shape=(8, 8))
  c = _csr()
  with pytest.raises(ValueError, match=r"CSRMatrix.data must have shape \(\d+,\)"):
    CSRMatrix.from_index_arrays(c.data[:, None], _index_dict(c), shape=c.shape)
  # The index arrays agree with each other: data is the array of the wrong length.
  with pytest.raises(ValueError, match=r"CSRMatrix.data holds \d+ entries .* but the index arrays have shape \(\d+,\)"):
    CSRMatrix.from_index_arrays(c.data[:-1], _index_dict(c), shape=c.shape)
  bad = {**_index_dict(c), "col_indices": _index_dict(c)["col_indices"][:-1]}
  with pytest.raises(ValueError, match=r"CSRMatrix.col_indices must be an int32 array of shape \(\d+,\)"):
    CSRMatrix.from_index_arrays(c.data, bad, shape=c.shape)


def _nm(shape=(16, 6), n=2, m=4, axis=0):
  w = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
  return NMSparseMatrix.from_dense(w, n, m, axis=axis)


def _nm_positions(w, edit):
  """``w``'s indices re-packed after ``edit(positions)`` of its ``(G, n, *rest)`` positions."""
  pos = np.array(nm_format._positions(w.indices, w.n, w.m, w.axis, w.groups))
  edit(pos)
  return np.moveaxis(np.asarray(nm_format._pack(jnp.asarray(pos), w.n, w.m)), 0, w.axis)


NM_CASES = {
    "duplicate_position": (dict(), lambda p: p.__setitem__((0, 1, 0), p[0, 0, 0]), "no position twice"),
    "decreasing_positions": (dict(), lambda p: p.__setitem__((1, slice(None), 2), [3, 1]), "strictly increasing"),
    "position_past_m": (dict(n=1, m=3, shape=(12, 4)), lambda p: p.__setitem__((2, 0, 1), 3), "positions in [0, 3)"),
    "all_positions_equal": (dict(n=4, m=8, shape=(16, 8)), lambda p: p.__setitem__((0, slice(None), 0), 5),
                            "no position twice"),
    "duplicate_axis1": (dict(shape=(6, 16), axis=1), lambda p: p.__setitem__((3, 1, 4), p[3, 0, 4]),
                        "group 3 along axis 1"),
}


@pytest.mark.parametrize("case", list(NM_CASES))
def test_nm_positions_are_validated(case):
  kw, edit, fragment = NM_CASES[case]
  w = _nm(**kw)
  bad = _nm_positions(w, edit)
  with pytest.raises(ValueError, match=r"NMSparseMatrix\.positions is invalid") as e:
    NMSparseMatrix(w.values, bad, shape=w.shape, n=w.n, m=w.m, axis=w.axis)
  assert fragment in str(e.value)
  # Under jit (traced indices) the checks are staged with checkify.
  build = lambda v, i: NMSparseMatrix(v, i, shape=w.shape, n=w.n, m=w.m, axis=w.axis)
  err, _ = checkify.checkify(jax.jit(lambda v, i: build(v, i).validate().values.sum()))(w.values, bad)
  assert err.get() is not None and "NMSparseMatrix.positions" in err.get()
  err, _ = checkify.checkify(jax.jit(lambda v, i: build(v, i).validate().values.sum()))(w.values, w.indices)
  assert err.get() is None


def test_nm_spare_bits_and_valid_matrices():
  w = _nm(n=1, m=4, shape=(12, 4))  # 3 groups of 2 bits: uint8 words with spare bits
  words = np.array(w.indices)
  words[0, 0] |= 0x80
  with pytest.raises(ValueError, match=r"NMSparseMatrix.indices is invalid in word \(0, 0\)"):
    NMSparseMatrix(w.values, words, shape=w.shape, n=1, m=4)
  for kw in (dict(), dict(n=1, m=3, shape=(12, 4)), dict(n=4, m=8, shape=(16, 8)), dict(shape=(6, 16), axis=1)):
    v = _nm(**kw)
    assert NMSparseMatrix(v.values, v.indices, shape=v.shape, n=v.n, m=v.m, axis=v.axis).validate() is not None


# -------------------------------------------------------------------------------------------------
# Ops on empty shapes; layers with bad sizes.
# -------------------------------------------------------------------------------------------------

def _op(kind, w, mask):
  """``x -> op(x, weight)`` for one op kind on a dense ``w`` / ``mask``, and the weight's differentiable leaf."""
  if kind == "masked":
    return (lambda x, d: ops.masked_matmul(x, d, mask)), w
  if kind == "csr":
    mat = CSRMatrix.from_dense(w, mask=mask)
    return (lambda x, d: ops.sparse_matmul(x, mat.with_data(d))), mat.data
  if kind == "nm":
    mat = NMSparseMatrix.from_dense(w, 2, 4)
    return (lambda x, d: ops.nm_matmul(x, mat.with_values(d))), mat.values
  b = 32 if kind == "block32" else 8  # blocks of 32: ones the GPU kernels take (their tilings need a row)
  grid = (w.shape[0] // b, w.shape[1] // b)
  mat = BlockSparseMatrix.from_dense(w, (b, b), block_mask=np.ones(grid, bool))
  return (lambda x, d: ops.block_sparse_matmul(x, mat.with_data(d))), mat.data


OP_KINDS = ("masked", "csr", "nm", "block")


@pytest.mark.parametrize("kind", OP_KINDS)
def test_empty_contraction_is_a_clear_error(kind):
  f, d = _op(kind, jnp.ones((0, 8)), jnp.ones((0, 8), bool))
  with pytest.raises(ValueError, match=r"the contraction is empty: w has K = w.shape\[0\] = 0"):
    f(jnp.ones((3, 0)), d)


@pytest.mark.parametrize("kind", [*OP_KINDS, "block32"])
@pytest.mark.parametrize("shape", [(0, 8, 8), (3, 8, 0)], ids=["no_rows", "no_outputs"])
def test_empty_outputs_are_empty_with_gradients(kind, shape):
  b, k, n = shape
  if kind == "block32":
    k, n = 4 * k, 4 * n
  f, d = _op(kind, jnp.ones((k, n)), jnp.ones((k, n), bool))
  x = jnp.ones((b, k))
  assert f(x, d).shape == (b, n)
  gx, gd = jax.grad(lambda x, d: f(x, d).sum(), argnums=(0, 1))(x, d)
  assert gx.shape == x.shape and gd.shape == d.shape
  assert not np.asarray(gx).any() and not np.asarray(gd).any()


LAYER_CASES = {
    "NMLinear(0, 8)": (lambda: layers.NMLinear(0, 8, rngs=nnx.Rngs(0)), "in_features must be a positive int, got 0"),
    "NMLinear(8, 0)": (lambda: layers.NMLinear(8, 0, rngs=nnx.Rngs(0)), "out_features must be a positive int, got 0"),
    "NMConv(0, 8)": (lambda: layers.NMConv(0, 8, (3, 3), rngs=nnx.Rngs(0)), "in_features must be a positive int"),
    "NMConv(8, 0)": (lambda: layers.NMConv(8, 0, (3, 3), rngs=nnx.Rngs(0)), "out_features must be a positive int"),
    "NMLinear(-4, 8)": (lambda: layers.NMLinear(-4, 8, rngs=nnx.Rngs(0)), "in_features must be a positive int, got -4"),
    "CompressedNMLinear bias": (
        lambda: layers.CompressedNMLinear(NMSparseMatrix.from_dense(jnp.ones((8, 4)), 2, 4), jnp.ones(5)),
        "bias must have shape (out_features,) = (4,) for weight of shape (8, 4), got (5,)"),
    "CompressedNMLinear bias 2-D": (
        lambda: layers.CompressedNMLinear(NMSparseMatrix.from_dense(jnp.ones((8, 4)), 2, 4), jnp.ones((1, 4))),
        "got (1, 4)"),
    "NMDense(0)": (lambda: jl.NMDense(0).init(jax.random.key(0), jnp.ones((2, 8))), "features must be a positive int"),
    "NMDense on 0 features": (lambda: jl.NMDense(4).init(jax.random.key(0), jnp.ones((2, 0))),
                              "x.shape[-1] must be a positive int, got 0"),
}


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_sizes_are_checked(case):
  build, fragment = LAYER_CASES[case]
  with pytest.raises(ValueError) as e:
    build()
  assert fragment in str(e.value)


LINEN_LAYERS = {
    "BlockSparseDense": (lambda: jl.BlockSparseDense(32, density=0.5, block_shape=(8, 8)), (2, 64), (2, 32)),
    "MaskedDense": (lambda: jl.MaskedDense(32, sparsity=0.5), (2, 64), (2, 32)),
    "NMDense": (lambda: jl.NMDense(32), (2, 64), (2, 32)),
    "NMConv": (lambda: jl.NMConv(16, (3, 3)), (1, 6, 6, 8), (1, 6, 6, 16)),
}


@pytest.mark.parametrize("name", list(LINEN_LAYERS))
def test_linen_layer_called_with_other_feature_count(name):
  build, good, bad = LINEN_LAYERS[name]
  module = build()
  variables = module.init(jax.random.key(0), jnp.ones(good))
  with pytest.raises(ValueError, match=rf"{name} holds variables for {good[-1]} input features, but "
                     rf"x.shape\[-1\] = {bad[-1]}"):
    module.apply(variables, jnp.ones(bad))
  assert module.apply(variables, jnp.ones(good)).shape[-1] in (16, 32)


# -------------------------------------------------------------------------------------------------
# sparsify: masks that match nothing or do not fit the rule say so.
# -------------------------------------------------------------------------------------------------


class _Net(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(16, 32, rngs=rngs)
    self.down = nnx.Linear(32, 16, rngs=rngs)
    self.conv = nnx.Conv(8, 8, (3, 3), rngs=rngs)


def _nm24(shape, axis=0):
  return np.asarray(jaxsparse.nm_mask(np.random.default_rng(4).standard_normal(shape), 2, 4, axis=axis))


def _random_mask(shape, p=0.6):
  return np.random.default_rng(5).random(shape) < p


SPARSIFY_MASK_CASES = {
    "key_without_kernel": ({"up": jaxsparse.Unstructured(0.5)}, {"up": _random_mask((16, 32))},
                           "masks has key(s) ['up'] that match no layer the rules sparsify"),
    "key_of_dense_layer": ({"up": jaxsparse.NM(2, 4), "down": None}, {"up.kernel": _nm24((16, 32)),
                                                                      "down.kernel": _random_mask((32, 16))},
                           "masks has key(s) ['down.kernel']"),
    "key_of_unmatched_layer": ({"up": jaxsparse.NM(2, 4)}, {"up.kernel": _nm24((16, 32)), "upp.kernel": True},
                               "['upp.kernel']"),
    "nm_rule_random_mask": ({"up": jaxsparse.NM(2, 4)}, {"up.kernel": _random_mask((16, 32))},
                            "up: the given mask is not 2:4 along the input features (axis 0)"),
    "nm_rule_mask_along_outputs": ({"up": jaxsparse.NM(2, 4)}, {"up.kernel": _nm24((16, 32), axis=1)},
                                   "up: the given mask is not 2:4"),
    "nm_rule_conv_random_mask": ({"conv": jaxsparse.NM(2, 4)}, {"conv.kernel": _random_mask((3, 3, 8, 8))},
                                 "conv: the given mask is not 2:4 along the input features (axis 2)"),
    "transposable_rule_plain_mask": ({"up": jaxsparse.NM(2, 4, transposable=True)}, {"up.kernel": _nm24((16, 32))},
                                     "not 2:4 along the output features (transposable)"),
}


@pytest.mark.parametrize("case", list(SPARSIFY_MASK_CASES))
def test_sparsify_masks_that_do_not_fit(case):
  rules, masks, fragment = SPARSIFY_MASK_CASES[case]
  model = _Net(nnx.Rngs(0))
  with pytest.raises(ValueError) as e:
    jaxsparse.sparsify(model, rules, masks=masks)
  assert fragment in str(e.value)


def test_sparsify_keeps_masks_that_fit():
  model = _Net(nnx.Rngs(0))
  fewer = _nm24((16, 32)) & _random_mask((16, 32), 0.7)  # at most 2 of 4: kept as given
  sparse, _ = jaxsparse.sparsify(model, {"up": jaxsparse.NM(2, 4)}, masks={"up.kernel": fewer})
  kept = np.asarray(sparse.up.nm_mask) & (np.asarray(sparse.up.kernel[...]) != 0)
  np.testing.assert_array_equal(kept, fewer & (np.asarray(model.up.kernel[...]) != 0))


def test_sparsify_linen_masks_that_do_not_fit():
  import flax.linen as nn  # noqa: PLC0415

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(16, name="down")(nn.Dense(32, name="up")(x))

  x = jnp.ones((2, 16))
  variables = Mlp().init(jax.random.key(0), x)
  rules = {"up": jaxsparse.NM(2, 4)}
  with pytest.raises(ValueError, match=re.escape("masks has key(s) ['up'] that match no layer")):
    jaxsparse.sparsify_linen(Mlp(), variables, rules, x, masks={"up": _nm24((16, 32))})
  with pytest.raises(ValueError, match=re.escape("up: the given mask is not 2:4")):
    jaxsparse.sparsify_linen(Mlp(), variables, rules, x, masks={"up.kernel": _random_mask((16, 32))})
  assert jaxsparse.sparsify_linen(Mlp(), variables, rules, x, masks={"up.kernel": _nm24((16, 32))})[1]


@pytest.mark.parametrize("spec", [jaxsparse.Unstructured(0.8), jaxsparse.NM(2, 4),
                                  jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8))], ids=str)
def test_sparsify_under_eval_shape(spec):
  model = _Net(nnx.Rngs(0))
  rules = {"up|down": spec, "conv": None if isinstance(spec, jaxsparse.BlockSparse) else spec}
  abstract = nnx.eval_shape(lambda: jaxsparse.sparsify(model, rules)[0])
  concrete = jaxsparse.sparsify(model, rules)[0]
  shapes = lambda m: jax.tree.map(lambda a: (a.shape, a.dtype), nnx.state(m))
  assert shapes(abstract) == shapes(concrete)
  assert type(abstract.up) is type(concrete.up) and type(abstract.conv) is type(concrete.conv)


def test_summary_lists_the_layers_of_a_sparsify_linen_model():
  import flax.linen as nn  # noqa: PLC0415

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Conv(8, (3, 3), name="conv")(x).reshape(x.shape[0], -1)
      return nn.Dense(16, name="down")(nn.Dense(32, name="up")(h))

  x = jnp.ones((2, 4, 4, 8))
  variables = Net().init(jax.random.key(0), x)
  rules = {"up|down": jaxsparse.NM(2, 4), "conv": jaxsparse.Unstructured(0.5)}
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(Net(), variables, rules, x)
  rows = {layer.path: (layer.kind, layer.pattern) for layer in jaxsparse.summary(sparse_vars, x, module=sparse).layers}
  assert rows == {"conv": ("MaskedConv", "unstructured"), "up": ("NMDense", "2:4"), "down": ("NMDense", "2:4")}


@pytest.mark.parametrize("spec", [jaxsparse.Unstructured(0.75), jaxsparse.NM(2, 4),
                                  jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8))], ids=str)
def test_sparsified_linen_init_and_abstract_init(spec):
  import flax.linen as nn  # noqa: PLC0415

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.DenseGeneral((2, 16), name="heads")(x).reshape(x.shape[0], -1)
      return nn.Dense(16, name="out")(nn.relu(h))

  x = jnp.ones((2, 32))
  variables = Net().init(jax.random.key(0), x)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(Net(), variables, {"heads|out": spec}, x)
  fresh = sparse.init(jax.random.key(0), x)
  abstract = jax.eval_shape(sparse.init, jax.random.key(1), x)
  shapes = lambda t: jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), t)
  assert shapes(abstract) == shapes(sparse_vars) == shapes(fresh)
  np.testing.assert_allclose(sparse.apply(fresh, x), sparse.apply(sparse_vars, x), rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------------------------
# Gradual pruning -> get_masks -> sparsify on attention (multi-axis kernels, 2-D biases).
# -------------------------------------------------------------------------------------------------


def _pruned_attention(rules, use_bias=True, with_views=False):
  import optax  # noqa: PLC0415

  from jaxsparse import pruning  # noqa: PLC0415

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.attn = nnx.MultiHeadAttention(4, 16, qkv_features=16, decode=False, use_bias=use_bias, rngs=rngs)

  model = Block(nnx.Rngs(0))
  views = pruning.kernel_views(model) if with_views else None
  pruner = pruning.magnitude_pruner(rules, views=views)
  opt = nnx.Optimizer(model, pruning.wrap_optax(optax.sgd(1e-3), pruner), wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(1), (2, 3, 16))
  opt.update(model, nnx.grad(lambda m: jnp.sum(m.attn(x) ** 2))(model))
  return model, pruning.get_masks(opt), x


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_pruner_never_prunes_biases_and_unstructured_masks_round_trip():
  rules = {r"attn\..*": jaxsparse.Unstructured(0.5)}
  model, masks, x = _pruned_attention(rules)
  flat = jaxsparse.pruning.masks_to_dict(masks)
  assert sorted(flat) == [f"attn.{p}.kernel" for p in ("key", "out", "query", "value")]  # (4, 16) biases skipped
  sparse, _ = jaxsparse.sparsify(model, rules, masks=masks)
  np.testing.assert_allclose(sparse.attn(x), model.attn(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", [jaxsparse.NM(2, 4), jaxsparse.BlockSparse(density=0.5, block_shape=(4, 4))],
                         ids=str)
def test_pruner_view_of_qkv_kernels_is_sparsifys(spec):
  # The pruner takes blocks and N:M groups on the view sparsify uses: q/k/v (16, 4, 4) as (16, 16), as the
  # layers' (4, 4) biases tell it (issue 36: block pruning of attention then sparsify raised "not constant").
  rules = {r"attn\.(query|key|value|out)": spec}
  model, masks, x = _pruned_attention(rules)
  sparse, _ = jaxsparse.sparsify(model, rules, masks=masks)
  np.testing.assert_allclose(sparse.attn(x), model.attn(x), rtol=1e-5, atol=1e-5)
  for name in ("query", "key", "value", "out"):
    np.testing.assert_array_equal(jaxsparse.densify(getattr(sparse.attn, name)).kernel[...] != 0,
                                  masks["attn"][name]["kernel"])


@pytest.mark.parametrize("spec", [jaxsparse.NM(2, 4), jaxsparse.BlockSparse(density=0.5, block_shape=(4, 4))],
                         ids=str)
def test_pruner_view_of_bias_free_qkv_kernels_is_explained(spec):
  # Without a bias the pruner cannot tell a q/k/v kernel's output axes: it takes the conv layout, and sparsify
  # says so.
  rules = {r"attn\.(query|key|value)": spec}
  model, masks, _ = _pruned_attention(rules, use_bias=False)
  with pytest.raises(ValueError, match=r"attn\.(query|key|value): the given mask fits .* in the conv-layout view "
                     r"of this \(16, 4, 4\) kernel \(every axis but the last an input: \(64, 4\)\).*bias.*"
                     r"views=jaxsparse\.pruning\.kernel_views\(model\)"):
    jaxsparse.sparsify(model, rules, masks=masks)


@pytest.mark.parametrize("spec", [jaxsparse.NM(2, 4), jaxsparse.BlockSparse(density=0.5, block_shape=(4, 4))],
                         ids=str)
def test_pruner_with_kernel_views_prunes_bias_free_qkv_kernels_as_sparsify_views_them(spec):
  # issue 36: with views=kernel_views(model) the pruner takes q/k/v (16, 4, 4) as (16, 16) without biases too.
  rules = {r"attn\.(query|key|value|out)": spec}
  model, masks, x = _pruned_attention(rules, use_bias=False, with_views=True)
  sparse, _ = jaxsparse.sparsify(model, rules, masks=masks)
  np.testing.assert_allclose(sparse.attn(x), model.attn(x), rtol=1e-5, atol=1e-5)
  for name in ("query", "key", "value", "out"):
    np.testing.assert_array_equal(jaxsparse.densify(getattr(sparse.attn, name)).kernel[...] != 0,
                                  masks["attn"][name]["kernel"])
