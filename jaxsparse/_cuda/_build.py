"""Builds the cuSPARSELt FFI custom calls on first use and registers them with XLA for CUDA.

``cusparselt_matmul.cc`` next to this file is host C++ that calls the cuSPARSELt API; it is compiled
with the system C++ compiler (``$CXX``, else ``g++``, ``c++``, ``clang++``; no ``nvcc``) against
the headers of cuSPARSELt and of the CUDA runtime and linked against ``libcusparseLt.so.0``, into
the same per-user cache directory as the CPU kernels (:func:`jaxsparse._cpu._build.cache_dir`), one
library per source hash, compiler, flags, jaxlib version and cuSPARSELt location.

Where things are looked for:

* cuSPARSELt: ``$JAXSPARSE_CUSPARSELT_DIR`` (with ``include/cusparseLt.h`` and ``lib/``), else the
  ``nvidia/cusparselt`` folder of the ``nvidia-cusparselt-cu12`` / ``-cu13`` wheel
  (``pip install jaxsparse[cuda12]`` or ``[cuda13]``) on ``sys.path``.
* CUDA headers (``cusparse.h``, ``driver_types.h``, ``library_types.h``): ``$CUDA_HOME`` /
  ``$CUDA_PATH``, the folder of ``nvcc``, ``/usr/local/cuda``, and the NVIDIA wheels on ``sys.path``.

Nothing is built unless JAX sees a CUDA device. When any of this is missing, or
``JAXSPARSE_CUSPARSELT=0`` is set, :func:`load` returns ``False``, :func:`unavailable_reason` says
why, and the ops keep their other GPU paths (with a :class:`CusparseLtFallbackWarning` where the
2:4 product was the default).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
import threading
from pathlib import Path

import jax
import jaxlib

from jaxsparse._cpu._build import build_cached
from jaxsparse._cpu._build import compiler
from jaxsparse._utils import FallbackWarning

__all__ = ["TARGETS", "CusparseLtFallbackWarning", "has_cuda_device", "library", "load", "unavailable_reason"]

_SOURCE = "cusparselt_matmul.cc"
# XLA FFI target name -> exported handler symbol.
TARGETS = {
    "jaxsparse_cusparselt_compress": "JaxsparseCsltCompress",
    "jaxsparse_cusparselt_matmul": "JaxsparseCsltMatmul",
}
_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden")
_HEADERS = ("cusparse.h", "driver_types.h", "library_types.h")
_COMPILE_TIMEOUT_S = 300


class CusparseLtFallbackWarning(FallbackWarning):
  """The 2:4 product on sparse tensor cores (cuSPARSELt) cannot run for these operands or on this machine.

  Issued on CUDA machines only, when a product that could use cuSPARSELt takes another path. To silence it:

  >>> import warnings, jaxsparse
  >>> with warnings.catch_warnings():
  ...   warnings.simplefilter("ignore", jaxsparse.ops.CusparseLtFallbackWarning)
  >>> issubclass(jaxsparse.ops.CusparseLtFallbackWarning, jaxsparse.FallbackWarning)
  True
  """


def has_cuda_device() -> bool:
  try:
    return bool(jax.devices("cuda"))
  except RuntimeError:
    return False


def _site_dirs() -> list[Path]:
  return [Path(p) for p in sys.path if p and Path(p).is_dir()]


def _cusparselt_dir() -> tuple[Path, Path] | None:
  """``(include dir, lib dir)`` of cuSPARSELt, or None."""
  candidates = []
  if os.environ.get("JAXSPARSE_CUSPARSELT_DIR"):
    candidates.append(Path(os.environ["JAXSPARSE_CUSPARSELT_DIR"]))
  candidates += [site / "nvidia" / "cusparselt" for site in _site_dirs()]
  for root in candidates:
    if (root / "include" / "cusparseLt.h").exists() and (root / "lib" / "libcusparseLt.so.0").exists():
      return root / "include", root / "lib"
  return None


def _cuda_include_dirs() -> list[Path]:
  """Folders holding the CUDA headers that ``cusparseLt.h`` includes, most specific first."""
  roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
  nvcc = shutil.which("nvcc")
  if nvcc:
    roots.append(str(Path(nvcc).resolve().parent.parent))
  roots.append("/usr/local/cuda")
  dirs = [Path(r) / "include" for r in roots if r]
  for site in _site_dirs():
    nvidia = site / "nvidia"
    if nvidia.is_dir():
      dirs += sorted(nvidia.glob("*/include"))
  return [d for d in dirs if d.is_dir()]


def _header_dirs() -> tuple[list[Path], str]:
  """The include folders that together hold every header in ``_HEADERS``, or ``([], what is missing)``."""
  found: dict[str, Path] = {}
  for d in _cuda_include_dirs():
    for h in _HEADERS:
      if h not in found and (d / h).exists():
        found[h] = d
  missing = [h for h in _HEADERS if h not in found]
  if missing:
    return [], f"CUDA headers {missing} not found (set $CUDA_HOME or install the CUDA toolkit headers)"
  dirs = list(dict.fromkeys(found.values()))
  # driver_types.h includes crt/host_defines.h, which the toolkit keeps beside it or in a sibling wheel.
  if not any((d / "crt" / "host_defines.h").exists() for d in dirs):
    extra = [d for d in _cuda_include_dirs() if (d / "crt" / "host_defines.h").exists()]
    if not extra:
      return [], "crt/host_defines.h (CUDA toolkit headers) not found"
    dirs.append(extra[0])
  return dirs, ""


def _build() -> tuple[Path | None, str]:
  if os.environ.get("JAXSPARSE_CUSPARSELT", "1").strip().lower() in ("0", "false", "off", "no"):
    return None, "disabled by JAXSPARSE_CUSPARSELT=0"
  if not has_cuda_device():
    return None, "JAX sees no CUDA device"
  cslt = _cusparselt_dir()
  if cslt is None:
    return None, (
        "cuSPARSELt not found (pip install 'jaxsparse[cuda13]' or '[cuda12]', or set $JAXSPARSE_CUSPARSELT_DIR)"
    )
  dirs, reason = _header_dirs()
  if not dirs:
    return None, reason

  cxx = compiler()
  if cxx is None:
    return None, "no C++ compiler found (set $CXX or install g++)"
  include_dir, lib_dir = cslt
  compile_flags = ["-I", str(include_dir), *(f"-I{d}" for d in dirs)]
  link_flags = [f"-L{lib_dir}", "-l:libcusparseLt.so.0", f"-Wl,-rpath,{lib_dir}"]
  src = Path(__file__).parent / _SOURCE
  checks = (src.parent / "launch_checks.h").read_bytes()
  parts = (src.read_bytes(), checks, " ".join(_FLAGS + tuple(compile_flags) + tuple(link_flags)), jaxlib.__version__,
           cxx)
  lib, error = build_cached("jaxsparse_cusparselt", parts, cxx, [src], [*_FLAGS, *compile_flags], libraries=link_flags)
  if lib is not None:
    return lib, ""
  return None, "compiling the cuSPARSELt custom calls failed: " + error


_LOCK = threading.Lock()
_RESULT: list = []  # set once: [reason, library or None]


def _load() -> list:
  with _LOCK:
    if not _RESULT:
      _RESULT.extend(_build_and_register())
    return _RESULT


def _build_and_register() -> tuple[str, ctypes.CDLL | None]:
  lib_path, reason = _build()
  if lib_path is None:
    return reason, None
  try:
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    for target, symbol in TARGETS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="CUDA")
    size = lib.JaxsparseCsltCompressedSize
    size.restype = ctypes.c_int64
    size.argtypes = [ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_char_p]
  except (OSError, AttributeError) as e:
    return f"loading {lib_path} failed: {e}", None
  # A first query checks that cuSPARSELt runs on this GPU (it needs compute capability 8.0 or later).
  error = ctypes.create_string_buffer(512)
  if size(-1, 64, 64, 0, 0, error) < 0:
    return f"cuSPARSELt cannot run here: {error.value.decode(errors='replace')}", None
  return "", lib


def load() -> bool:
  """Builds (at most once per process) and registers the custom calls; True when they can run."""
  return not _load()[0]


def unavailable_reason() -> str:
  """Why :func:`load` returns False; empty when the custom calls are available."""
  return _load()[0]


def library() -> ctypes.CDLL:
  """The loaded library (after :func:`load` returned True)."""
  return _load()[1]
