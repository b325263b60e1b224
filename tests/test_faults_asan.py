"""The native-kernel fault set (tests/test_faults.py) again, with the C++ kernels built under AddressSanitizer.

Every bad index array must be refused before it is read, and every valid shape must stay inside its
buffers: ASan aborts the child process on the first stray access, which fails the cases it did not report.
Skipped where the compiler has no ASan runtime. The ASan build is cached like the normal one (first run:
about half a minute to compile).
"""

import os
import shutil
import subprocess

import pytest

from tests import test_faults
from tests._faults_util import missing_report
from tests._faults_util import run_child


def _asan_runtime() -> list[str]:
  cxx = os.environ.get("CXX") or shutil.which("g++")
  if not cxx:
    return []
  libs = []
  for name in ("libasan.so", "libstdc++.so.6"):  # libstdc++ too: jaxlib throws C++ exceptions through ASan
    try:
      found = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
      return []
    path = found.stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
      return []
    libs.append(path)
  return libs


@pytest.fixture(scope="module")
def asan_results():
  runtime = _asan_runtime()
  if not runtime:
    pytest.skip("no AddressSanitizer runtime for the C++ compiler")
  env = {"JAXSPARSE_CPU_SANITIZE": "address", "LD_PRELOAD": " ".join(runtime), "JAX_PLATFORMS": "cpu",
         "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1"}
  results, proc = run_child(test_faults._NATIVE_CHILD, ",".join(test_faults.NATIVE_CASES), env=env, timeout=600)
  if "unavailable" in results:
    pytest.skip(f"C++ kernels unavailable under ASan: {results['unavailable']['reason']}")
  return results, proc


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
@pytest.mark.parametrize("case", list(test_faults.NATIVE_CASES))
def test_native_kernel_faults_under_asan(asan_results, case):
  results, proc = asan_results
  r = results.get(case)
  assert r is not None, missing_report(results, case, proc)
  fragment = test_faults.NATIVE_CASES[case]
  if fragment is None:
    assert r["error"] is None and r["max_err"] < 1e-3, r
  else:
    assert r["error"] is not None and fragment in r["message"], r
  assert "AddressSanitizer" not in proc.stderr, proc.stderr[-3000:]
