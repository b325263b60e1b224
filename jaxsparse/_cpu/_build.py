"""Builds the C++ CPU kernels on first use and registers them with XLA as FFI targets.

The kernels (``*.cc`` and ``common.h`` next to this file) are compiled with the system C++ compiler (``$CXX``, else
``g++``, ``c++`` or ``clang++``) for the host CPU (``-march=native``) into a per-user cache directory
(``$JAXSPARSE_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxsparse``, else ``~/.cache/jaxsparse``), one
shared library per source hash, compiler, flags, jaxlib version and CPU, so a rebuild happens only
when one of those changes. Compilation takes a few seconds once; later imports load the cached
library. Concurrent processes may build at the same time: each writes a private temporary file and
renames it into place.

``JAXSPARSE_CPU_SANITIZE=address`` builds them with AddressSanitizer (a separate cached library) for
tests that run them on bad inputs; the process must then preload the ASan runtime
(``LD_PRELOAD=$(g++ -print-file-name=libasan.so)``, see ``tests/test_faults.py``).

When no compiler is found, compilation fails or ``JAXSPARSE_CPU_KERNELS=0`` is set, :func:`load`
returns ``False`` and :func:`unavailable_reason` says why; the ops then run their pure-XLA path and
emit a :class:`CpuKernelFallbackWarning`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import jax
import jaxlib

from jaxsparse._utils import FallbackWarning

__all__ = ["TARGETS", "CpuKernelFallbackWarning", "cache_dir", "load", "unavailable_reason"]

_SOURCES = ("sparse_matmul.cc", "csr_rows.cc", "block_sparse_matmul.cc", "packed_gemm.cc")
_HEADERS = ("common.h",)
# XLA FFI target name -> exported handler symbol.
TARGETS = {
    "jaxsparse_masked_forward": "JaxsparseMaskedForward",
    "jaxsparse_masked_backward": "JaxsparseMaskedBackward",
    "jaxsparse_csr_forward": "JaxsparseCsrForward",
    "jaxsparse_csr_few_rows_forward": "JaxsparseCsrFewRowsForward",
    "jaxsparse_csr_backward": "JaxsparseCsrBackward",
    "jaxsparse_csr_to_dense": "JaxsparseCsrToDense",
    "jaxsparse_csr_take": "JaxsparseCsrTake",
    "jaxsparse_block_forward": "JaxsparseBlockForward",
    "jaxsparse_block_backward": "JaxsparseBlockBackward",
}
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-fno-math-errno")
_ARCH_FLAGS = (("-march=native",), ())  # the second is tried when the compiler rejects the first
_COMPILE_TIMEOUT_S = 300


class CpuKernelFallbackWarning(FallbackWarning):
  """The C++ CPU kernels are unavailable (no compiler, build failure or disabled); XLA runs instead.

  Issued on a CPU backend when a product with ``implementation=None`` cannot use the kernels. To make it an error
  (in a benchmark, say):

  >>> import warnings, jaxsparse
  >>> with warnings.catch_warnings():
  ...   warnings.simplefilter("error", jaxsparse.ops.CpuKernelFallbackWarning)
  >>> issubclass(jaxsparse.ops.CpuKernelFallbackWarning, jaxsparse.FallbackWarning)
  True
  """


def cache_dir() -> Path:
  """Where compiled kernels are kept: ``$JAXSPARSE_CACHE_DIR`` or the user cache directory."""
  if os.environ.get("JAXSPARSE_CACHE_DIR"):
    return Path(os.environ["JAXSPARSE_CACHE_DIR"])
  base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
  return Path(base) / "jaxsparse"


def compiler() -> str | None:
  for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


def _cpu_signature() -> str:
  """The host's CPU model and feature flags: ``-march=native`` code is only valid on such a CPU."""
  try:
    with open("/proc/cpuinfo") as f:
      lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
    return "".join(sorted(set(lines)))
  except OSError:
    return platform.processor() or platform.machine()


def _compiler_version(cxx: str) -> str:
  try:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
  except (OSError, subprocess.SubprocessError):
    return ""


def compile_library(
    cxx: str, sources: list[Path], flags: Sequence[str], out: Path, *, libraries: Sequence[str] = ()
) -> str | None:
  """Compiles ``sources`` with jaxlib's FFI headers into ``out`` atomically; the compiler's error on failure.

  Shared by the CPU kernels and the cuSPARSELt calls (``jaxsparse._cuda``). ``libraries`` (``-L`` / ``-l``
  flags) go after the sources: linkers with ``--as-needed`` drop libraries named before their users.
  """
  out.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.stem + ".", suffix=".tmp")
  os.close(fd)
  cmd = [cxx, *flags, "-I", jax.ffi.include_dir(), *map(str, sources), "-o", tmp, *libraries]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
    if proc.returncode != 0:
      return f"`{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}"
    os.replace(tmp, out)
    return None
  except (OSError, subprocess.SubprocessError) as e:
    return f"`{' '.join(cmd)}` could not run: {e}"
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def build_cached(
    stem: str, key_parts: Sequence[bytes | str], cxx: str, sources: list[Path], flags: Sequence[str], *,
    libraries: Sequence[str] = (),
) -> tuple[Path | None, str]:
  """``<cache>/<stem>-<hash of key_parts>.so``, compiled from ``sources`` unless it is there already.

  Shared by the CPU kernels and the CUDA custom calls. Tries the user cache directory, then a per-user
  folder in the temporary directory when the first is not writable; a compile error ends the search
  (it does not depend on the directory). Returns ``(path, "")`` or ``(None, the errors)``.
  """
  key = hashlib.sha256()
  for part in key_parts:
    key.update(part if isinstance(part, bytes) else part.encode())
    key.update(b"\0")
  errors = []
  for directory in (cache_dir(), Path(tempfile.gettempdir()) / f"jaxsparse-{os.getuid()}"):
    lib = directory / f"{stem}-{key.hexdigest()[:20]}.so"
    if lib.exists():
      return lib, ""
    try:
      error = compile_library(cxx, sources, flags, lib, libraries=libraries)
    except OSError as e:  # not writable: try the next directory
      errors.append(f"cannot write to {directory}: {e}")
      continue
    if error is None:
      return lib, ""
    errors.append(error)
    break
  return None, "\n".join(errors)


def _build() -> tuple[Path | None, str]:
  """Returns ``(library path, "")`` or ``(None, reason)``."""
  if os.environ.get("JAXSPARSE_CPU_KERNELS", "1").strip().lower() in ("0", "false", "off", "no"):
    return None, "disabled by JAXSPARSE_CPU_KERNELS=0"
  cxx = compiler()
  if cxx is None:
    return None, "no C++ compiler found (set $CXX or install g++)"
  here = Path(__file__).parent
  sources = [here / s for s in _SOURCES]
  errors = []
  cpu, version = _cpu_signature(), _compiler_version(cxx)
  sanitize = os.environ.get("JAXSPARSE_CPU_SANITIZE", "").strip()
  if sanitize not in ("", "address"):
    return None, f"JAXSPARSE_CPU_SANITIZE must be 'address' or empty, got {sanitize!r}"
  extra = ("-fsanitize=address", "-fno-omit-frame-pointer", "-g") if sanitize else ()
  for arch in _ARCH_FLAGS:
    flags = (*_FLAGS, *arch, *extra)
    texts = [f.read_bytes() for f in [*sources, *(here / h for h in _HEADERS)]]
    parts = (*texts, " ".join(flags), version, jaxlib.__version__, platform.machine(), cpu)
    lib, error = build_cached("jaxsparse_cpu", parts, cxx, sources, flags)
    if lib is not None:
      return lib, ""
    errors.append(error)
  return None, "compiling the CPU kernels failed: " + "\n".join(errors)


_LOCK = threading.Lock()
_RESULT: list[str] = []  # set once: "" when registered, else why not


def _load() -> str:
  """Builds, loads and registers the kernels once per process; returns "" or why not."""
  with _LOCK:
    if not _RESULT:
      _RESULT.append(_build_and_register())
    return _RESULT[0]


def _build_and_register() -> str:
  lib_path, reason = _build()
  if lib_path is None:
    return reason
  try:
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    for target, symbol in TARGETS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
  except (OSError, AttributeError) as e:
    return f"loading {lib_path} failed: {e}"
  return ""


def load() -> bool:
  """Builds (at most once per process) and registers the kernels; True when they can run."""
  return not _load()


def unavailable_reason() -> str:
  """Why :func:`load` returns False; empty when the kernels are available."""
  return _load()
