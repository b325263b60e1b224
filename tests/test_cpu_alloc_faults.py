"""The native CPU kernels when their scratch memory cannot be allocated: an error, never a crash.

Each case runs a kernel under an address-space limit (``RLIMIT_AS``) that leaves room for its inputs and outputs
but not for the scratch it needs (packed or transposed operands, or the per-thread entry lists that pool tasks
build), and must raise a runtime error that names the kernel and the bytes it could not allocate. The child
process then lifts the limit and checks that every kernel still gives the right numbers: a scratch buffer that
failed to grow keeps its old state. A segfault or abort fails the cases the child did not report.
"""

import re
import sys

import pytest

from tests._faults_util import missing_report
from tests._faults_util import run_child

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status for the address space in use")

# case -> the kernel named in the error message
CASES = {
    "block_forward_packed_x": "block-sparse forward",
    "block_backward_packed_x": "block-sparse backward",
    "csr_forward_transposed_x": "csr forward",
    "masked_forward_sparse_transposed_x": "masked forward",
    "masked_forward_gemm_packed_w": "masked forward",
    "masked_backward_task_entries": "masked backward",
    "masked_matmul_public_op": "masked forward",
}

_CHILD = """
import ctypes, gc, json, resource, sys
import numpy as np
import jax
import jaxsparse
from jaxsparse._cpu import _build, _kernels

if not _build.load():
  print(json.dumps({"case": "unavailable", "reason": _build.unavailable_reason()}))
  sys.exit(0)
MiB = 1 << 20
rng = np.random.default_rng(0)
f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
big = lambda *s: rng.random(s, dtype=np.float32)  # no float64 temporary
i32 = lambda v: np.asarray(v, np.int32)
try:
  malloc_trim = ctypes.CDLL(None).malloc_trim  # glibc
except AttributeError:
  malloc_trim = lambda pad: None

def mapped_bytes():
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))

def under_limit(fn, args, room):
  # Compiled and on the device before the limit: only the call itself (its outputs, its scratch) needs memory.
  # Memory freed under the limit would make room: the case before deletes its buffers, and its garbage is collected.
  # malloc_trim: free memory at the top of the heap would serve an allocation without new address space. Every
  # scratch below is at least 128 MiB, twice what glibc leaves untrimmed at most.
  args = jax.block_until_ready(jax.device_put(args))
  compiled = jax.jit(fn).lower(*args).compile()
  gc.collect()
  malloc_trim(0)
  soft, hard = resource.getrlimit(resource.RLIMIT_AS)
  resource.setrlimit(resource.RLIMIT_AS, (mapped_bytes() + room, hard))
  try:
    jax.block_until_ready(compiled(*args))
  except Exception as e:
    return {"error": type(e).__name__, "message": str(e)}
  finally:
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    for a in args:
      a.delete()
  return {"error": None, "message": ""}

def one_block(k, bk=8, bn=8):
  # W (k, bn) with a single kept block in block row 0.
  data = f32(1, bk, bn)
  return data, i32([0]), i32([0, 1]), i32([0]), i32([0] + [1] * (k // bk))

def run(case):
  b, k, n = 64, 1 << 19, 8  # x: 128 MiB, the output y: 2 KiB
  if case == "block_forward_packed_x":  # x packed slab by slab
    data, row_indices, col_offsets, order, row_offsets = one_block(k)
    return under_limit(_kernels.block_forward, (big(b, k), data, row_indices, col_offsets, order, i32([0]),
                                                row_offsets), 32 * MiB)
  if case == "block_backward_packed_x":  # dx (128 MiB) fits, x packed (128 MiB more) does not
    data, _, _, _, row_offsets = one_block(k)
    return under_limit(_kernels.block_backward, (big(b, k), data, row_offsets, i32([0]), i32([0]), f32(b, n)),
                       160 * MiB)
  if case == "csr_forward_transposed_x":  # x transposed into batch tiles
    mask = np.zeros((k, n), bool)
    mask[:4] = True
    c = jaxsparse.CSRMatrix.from_dense(f32(k, n), mask=mask)
    args = (big(b, k), c.data, c.col_offsets, c.transpose_order, c.transpose_row_indices)
    return under_limit(_kernels.csr_forward, args, 32 * MiB)
  if case == "masked_forward_sparse_transposed_x":
    fn = lambda x, w, m: _kernels.masked_forward(x, w, m, route="sparse")
    return under_limit(fn, (big(b, k), f32(k, n), rng.random((k, n)) < 0.1), 32 * MiB)
  if case == "masked_forward_gemm_packed_w":  # w packed for the GEMM: k x 64 or 128 floats (n padded to a chunk)
    fn = lambda x, w, m: _kernels.masked_forward(x, w, m, route="gemm")
    return under_limit(fn, (big(96, k), f32(k, n), rng.random((k, n)) < 0.5), 32 * MiB)
  if case == "masked_matmul_public_op":  # the op's CPU kernels: the sparse route, x transposed
    fn = lambda x, w, m: jaxsparse.ops.masked_matmul(x, w, m, implementation="cpu")
    return under_limit(fn, (big(b, k), f32(k, n), rng.random((k, n)) < 0.1), 32 * MiB)
  if case == "masked_backward_task_entries":  # dw (256 MiB) fits; each pool task's list of its rows' entries does not
    b, k, n = 8, 256, 1 << 18  # 128 rows of 2^18 candidate entries: 128 MiB of indices per task
    fn = lambda x, w, m, dy: _kernels.masked_backward(x, w, m, dy)
    args = (f32(b, k), np.ones((k, n), np.float32), np.ones((k, n), bool), f32(b, n))
    return under_limit(fn, args, 256 * MiB + 8 * MiB + 32 * MiB)
  raise ValueError(case)

def recovered():
  # Every kernel, small and large, after the failures: the scratch caches must still hold valid buffers.
  err = 0.0
  for b, k, n in [(9, 40, 24), (96, 1 << 12, 64), (3, 16, 8)]:
    x, w, dy = f32(b, k), f32(k, n), f32(b, n)
    mask = rng.random((k, n)) < 0.3
    wm = np.where(mask, w, 0)
    for route in ("sparse", "gemm"):
      err = max(err, np.abs(np.asarray(_kernels.masked_forward(x, w, mask, route=route)) - x @ wm).max())
    dx, dw = _kernels.masked_backward(x, w, mask, dy)
    err = max(err, np.abs(np.asarray(dx) - dy @ wm.T).max(), np.abs(np.asarray(dw) - np.where(mask, x.T @ dy, 0)).max())
    c = jaxsparse.CSRMatrix.from_dense(w, mask=mask)
    y = _kernels.csr_forward(x, c.data, c.col_offsets, c.transpose_order, c.transpose_row_indices)
    err = max(err, np.abs(np.asarray(y) - x @ wm).max())
    blk = jaxsparse.BlockSparseMatrix.from_dense(w, (8, 8), block_mask=rng.random((k // 8, n // 8)) < 0.5)
    dense = np.asarray(blk.to_dense())
    y = _kernels.block_forward(x, blk.data, blk.row_indices, blk.col_offsets, blk.transpose_order, blk.col_indices,
                               blk.row_offsets)
    dx, _ = _kernels.block_backward(x, blk.data, blk.row_offsets, blk.col_indices, blk.row_indices, dy)
    err = max(err, np.abs(np.asarray(y) - x @ dense).max(), np.abs(np.asarray(dx) - dy @ dense.T).max())
  return {"error": None, "max_err": float(err)}

# Warm up every kernel on small shapes first: the pool threads exist and the scratch caches hold small buffers.
recovered()
for case in sys.argv[1].split(","):
  try:
    result = recovered() if case == "recovered" else run(case)
  except Exception as e:
    result = {"error": type(e).__name__, "message": str(e)}
  print(json.dumps({"case": case, **result}), flush=True)
"""


@pytest.fixture(scope="module")
def alloc_results():
  results, proc = run_child(_CHILD, ",".join([*CASES, "recovered"]), timeout=600)
  if "unavailable" in results:
    pytest.skip(f"C++ CPU kernels unavailable: {results['unavailable']['reason']}")
  return results, proc


@pytest.mark.parametrize("case", list(CASES))
def test_scratch_allocation_failure_is_an_error(alloc_results, case):
  results, proc = alloc_results
  r = results.get(case)
  assert r is not None, missing_report(results, case, proc)
  assert r["error"] is not None, f"{case} did not run out of memory: the limit leaves too much room"
  assert re.search(rf"RESOURCE_EXHAUSTED: {CASES[case]}: could not allocate \d+ bytes", r["message"]), r


def test_kernels_work_after_allocation_failures(alloc_results):
  results, proc = alloc_results
  r = results.get("recovered")
  assert r is not None, missing_report(results, "recovered", proc)
  assert r["error"] is None and r["max_err"] < 1e-3, r
