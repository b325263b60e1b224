"""CUDA kernels of our own, compiled at run time with NVRTC and launched as XLA FFI custom calls.

Pallas cannot reach every instruction of the GPU: the sparse tensor cores of Hopper (``mma.sp``,
``wgmma.sp``) are one. The kernels here are CUDA C++ sources next to this file (``*.cu``, including no system
headers; ``copies.cuh``, the helpers two of them share, is handed to NVRTC), compiled on first use by NVRTC —
``libnvrtc`` from the ``nvidia-cuda-nvrtc`` wheel (the ``jaxsparse[cuda13]`` / ``[cuda12]`` extras install it; CUDA
installs of jax or torch usually have it already), or from a CUDA toolkit — into a cubin for the GPU at hand (cached
on disk by source, headers, options, NVRTC version and architecture), and launched by ``kernel_launch.cc``, host
C++ built with the system compiler like the other custom calls (it opens the CUDA driver with ``dlopen``; no CUDA
headers are needed).

Kernels:

* :func:`nm24_decode`: ``x @ W`` for a 2:4 bfloat16 ``W`` (``NMSparseMatrix`` values and packed
  positions, as stored) and ``M <= 32`` rows, on the sparse tensor cores (``nm24_decode.cu``).
* :func:`jaxsparse._cuda._block_sparse_decode.block_sparse_decode`: ``x @ W`` for a block-sparse ``W``
  (``BlockSparseMatrix``, block dims multiples of 64) and ``M <= 8`` rows, its blocks streamed by bulk tensor copies
  (``block_sparse_decode.cu``).
* :func:`nm24_transposable`: transposable 2:4 pruning of a ``(K, N)`` weight in one pass, the pruned
  weight and each ``4 x 4`` tile's pattern (``nm24_prune.cu``); :func:`nm24_transposable_compress`
  writes it as cuSPARSELt's compressed buffers of ``W`` and ``Wᵀ`` instead; :func:`nm24_prune`, plain 2:4
  pruning (the pruned weight, each group's mask bits, optionally cuSPARSELt's buffer of ``W``).

When NVRTC, the driver, a compiler or a Hopper-class GPU is missing, or ``JAXSPARSE_CUDA_KERNELS=0``
is set, :func:`available` is False and :func:`unavailable_reason` says why; callers keep their other
kernels, with a :class:`CudaKernelFallbackWarning` (once per reason) where a GPU that could run them is
present but something else is missing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import os
import re
import sys
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxsparse import _utils
from jaxsparse._cpu._build import build_cached
from jaxsparse._cpu._build import cache_dir
from jaxsparse._cpu._build import compiler
from jaxsparse._cuda._nm24_config import NM24_LOADS
from jaxsparse._cuda._nm24_config import NM24_SPANS
from jaxsparse._cuda._nm24_config import NM24_X_LOADS
from jaxsparse._cuda._nm24_config import Nm24DecodeConfig
from jaxsparse._cuda._nm24_config import nm24_candidate_configs
from jaxsparse._utils import FallbackWarning

__all__ = [
    "TARGETS",
    "CudaKernelFallbackWarning",
    "Nm24DecodeConfig",
    "available",
    "kernel_id",
    "nm24_candidate_configs",
    "nm24_decode",
    "nm24_decode_buffer",
    "nm24_prepare",
    "nm24_prune",
    "nm24_transposable",
    "nm24_transposable_compress",
    "nm24_prune_unsupported_reason",
    "nm24_unsupported_reason",
    "unavailable_reason",
    "warn_fallback",
]

# XLA FFI target name -> the launcher library's handler symbol.
TARGETS = {
    "jaxsparse_nm24_decode": "JaxsparseNm24Decode",
    "jaxsparse_nm24_decode_buffer": "JaxsparseNm24DecodeBuffer",
    "jaxsparse_nm24_decode_buffer_tma": "JaxsparseNm24DecodeBufferTma",
    "jaxsparse_block_sparse_decode": "JaxsparseBlockSparseDecode",
    "jaxsparse_nm24_transposable": "JaxsparseNm24Transposable",
    "jaxsparse_nm24_transposable_compress": "JaxsparseNm24TransposableCompress",
    "jaxsparse_nm24_prune": "JaxsparseNm24Prune",
}

_HERE = Path(__file__).parent
_LAUNCHER = "kernel_launch.cc"
_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-w")
# Compute capability the kernels need: mma.sp::ordered_metadata and thread block clusters (9.0).
_MIN_CAPABILITY = (9, 0)
_NO_NVRTC = "libnvrtc not found (pip install 'jaxsparse[cuda13]' or '[cuda12]', or set $CUDA_HOME to a CUDA toolkit)"
NM24_MAX_ROWS = 32
MAX_DIM = 1 << 30  # the kernels take K and N as int
_MAX_GRID_X = (1 << 31) - 1


class CudaKernelFallbackWarning(FallbackWarning):
  """A jaxsparse CUDA kernel cannot be built or run on this GPU; the op takes its other path.

  Issued on CUDA machines only. To make it an error (in a benchmark, say):

  >>> import warnings, jaxsparse
  >>> with warnings.catch_warnings():
  ...   warnings.simplefilter("error", jaxsparse.ops.CudaKernelFallbackWarning)
  >>> issubclass(jaxsparse.ops.CudaKernelFallbackWarning, jaxsparse.FallbackWarning)
  True
  """


def _disabled() -> bool:
  return os.environ.get("JAXSPARSE_CUDA_KERNELS", "1").strip().lower() in ("0", "false", "off", "no")


def _capability() -> tuple[int, int] | None:
  try:
    devices = jax.devices("cuda")
  except RuntimeError:
    return None
  if not devices:
    return None
  cc = getattr(devices[0], "compute_capability", None)
  if not cc:
    return None
  major, minor = str(cc).split(".")
  return int(major), int(minor)


def _is_nvrtc(path: Path) -> bool:
  return "builtins" not in path.name and ".alt." not in path.name


def _nvrtc_candidates() -> list[str]:
  found = []
  for p in sys.path:
    nvidia = Path(p) / "nvidia" if p else None
    if nvidia is not None and nvidia.is_dir():
      found += [str(f) for f in sorted(nvidia.glob("*/lib/libnvrtc.so*")) if _is_nvrtc(f)]
  for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
    if root:
      found += [str(f) for f in sorted(Path(root, "lib64").glob("libnvrtc.so*")) if _is_nvrtc(f)]
  name = ctypes.util.find_library("nvrtc")
  if name:
    found.append(name)
  return found


@functools.cache
def _nvrtc() -> ctypes.CDLL | None:
  for path in _nvrtc_candidates():
    try:
      return ctypes.CDLL(path)
    except OSError:
      continue
  return None


def _nvrtc_version(lib: ctypes.CDLL) -> str:
  major, minor = ctypes.c_int(), ctypes.c_int()
  lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
  return f"{major.value}.{minor.value}"


def _headers(source: str) -> dict[str, str]:
  """The files next to this one that ``source`` includes (``#include "name"``), by name: NVRTC gets them as headers."""
  names = re.findall(r'^#include "([\w.]+)"', source, flags=re.MULTILINE)
  return {n: (_HERE / n).read_text() for n in names}


def _compile_cubin(source: str, name: str, options: list[str]) -> tuple[bytes | None, str]:
  """NVRTC: ``source`` (and the headers it includes, :func:`_headers`) -> ``(cubin, "")`` or ``(None, log)``, cached
  on disk."""
  lib = _nvrtc()
  if lib is None:
    return None, _NO_NVRTC
  headers = _headers(source)
  parts = [source, *(f"{n}\0{t}" for n, t in headers.items()), name, *options, _nvrtc_version(lib)]
  key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]
  path = cache_dir() / f"jaxsparse_{name}-{key}.cubin"
  if path.exists():
    return path.read_bytes(), ""
  prog = ctypes.c_void_p()
  check = lambda r, what: None if r == 0 else f"{what} failed with NVRTC error {r}"
  texts = (ctypes.c_char_p * len(headers))(*[t.encode() for t in headers.values()])
  names = (ctypes.c_char_p * len(headers))(*[n.encode() for n in headers])
  created = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), len(headers), texts,
                                   names)
  err = check(created, "nvrtcCreateProgram")
  if err:
    return None, err
  try:
    opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    result = lib.nvrtcCompileProgram(prog, len(options), opts)
    if result != 0:
      size = ctypes.c_size_t()
      lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
      log = ctypes.create_string_buffer(size.value)
      lib.nvrtcGetProgramLog(prog, log)
      text = log.value.decode(errors="replace")[-3000:]
      return None, f"NVRTC could not compile {name}.cu ({' '.join(options)}):\n{text}"
    size = ctypes.c_size_t()
    err = check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
    if err:
      return None, err
    cubin = ctypes.create_string_buffer(size.value)
    err = check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    if err:
      return None, err
  finally:
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
  data = cubin.raw
  tmp = None
  try:  # write atomically (a concurrent process may write the same file); an unwritable cache only costs time
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.replace(tmp, path)
  except OSError:
    if tmp is not None and os.path.exists(tmp):
      os.remove(tmp)
  return data, ""


def _build_launcher() -> tuple[Path | None, str]:
  cxx = compiler()
  if cxx is None:
    return None, "no C++ compiler found (set $CXX or install g++)"
  src = _HERE / _LAUNCHER
  parts = (src.read_bytes(), (_HERE / "launch_checks.h").read_bytes(), " ".join(_FLAGS), jaxlib.__version__, cxx)
  lib, error = build_cached("jaxsparse_kernel_launch", parts, cxx, [src], _FLAGS, libraries=["-ldl"])
  if lib is not None:
    return lib, ""
  return None, "compiling the kernel launcher failed: " + error


_LOCK = threading.Lock()
_STATE: dict = {}


def _load() -> dict:
  with _LOCK:
    if not _STATE:
      _STATE.update(_setup())
    return _STATE


def _setup() -> dict:
  if _disabled():
    return {"reason": "disabled by JAXSPARSE_CUDA_KERNELS=0"}
  cc = _capability()
  if cc is None:
    return {"reason": "JAX sees no CUDA device"}
  if cc < _MIN_CAPABILITY:
    need = ".".join(map(str, _MIN_CAPABILITY))
    return {"reason": f"the kernels need compute capability >= {need}, got {cc[0]}.{cc[1]}"}
  if _nvrtc() is None:
    return {"reason": _NO_NVRTC}
  path, reason = _build_launcher()
  if path is None:
    return {"reason": reason}
  try:
    lib = ctypes.CDLL(str(path))
    register = lib.JaxsparseKernelRegister
    register.restype = ctypes.c_int64
    register.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int64, ctypes.c_char_p]
    for target, symbol in TARGETS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="CUDA")
  except (OSError, AttributeError) as e:
    return {"reason": f"loading {path} failed: {e}"}
  return {"reason": "", "lib": lib, "register": register, "arch": f"sm_{cc[0]}{cc[1]}", "kernels": {}}


def available() -> bool:
  """True when the kernels can be compiled and launched on the default CUDA device."""
  return not _load()["reason"]


def unavailable_reason() -> str:
  return _load()["reason"]


_WARNED: set[str] = set()


def warn_fallback(op: str, reason: str) -> None:
  """Warns once per ``reason`` that ``op`` skips our CUDA kernels, where a GPU that could run them is present."""
  cc = _capability()
  if _disabled() or cc is None or cc < _MIN_CAPABILITY or reason in _WARNED:
    return
  _WARNED.add(reason)
  _utils.warn_at_caller(f"{op}: jaxsparse's CUDA kernel cannot run ({reason}); using the other GPU path.",
                        CudaKernelFallbackWarning)


def _nvrtc_options(arch: str, defines: tuple[tuple[str, int], ...]) -> list[str]:
  return [f"--gpu-architecture={arch}", "-std=c++17", *(f"-D{k}={v}" for k, v in defines)]


def kernel_id(source_name: str, name: str, defines: tuple[tuple[str, int], ...]) -> int:
  """Compiles (once per process) and registers kernel ``name`` of ``source_name`` with ``defines``."""
  state = _load()
  if state["reason"]:
    raise RuntimeError(f"the CUDA kernels cannot run here: {state['reason']}")
  key = (source_name, name, defines)
  with _LOCK:
    if key in state["kernels"]:
      return state["kernels"][key]
  # NVRTC runs outside the lock (and without the GIL): kernels of several configs compile side by side
  # (measured dispatch prepares its candidates in threads). Two threads may compile one key; one registers it.
  cubin, log = _compile_cubin((_HERE / source_name).read_text(), name, _nvrtc_options(state["arch"], defines))
  if cubin is None:
    raise RuntimeError(log)
  with _LOCK:
    if key in state["kernels"]:
      return state["kernels"][key]
    error = ctypes.create_string_buffer(512)
    kid = state["register"](name.encode(), cubin, len(cubin), error)
    if kid < 0:
      raise RuntimeError(f"registering {name} failed: {error.value.decode(errors='replace')}")
    state["kernels"][key] = kid
    return kid


def nm24_unsupported_reason(m: int, k: int, n: int, dtype) -> str:
  """Why :func:`nm24_decode` cannot take an ``(m, k) @ (k, n)`` product, or ``""``."""
  if jnp.dtype(dtype) != jnp.bfloat16:
    return f"dtype must be bfloat16, got {jnp.dtype(dtype)}"
  if not 1 <= m <= NM24_MAX_ROWS:
    return f"M must be between 1 and {NM24_MAX_ROWS}, got M={m}"
  if k % 64 or n % NM24_SPANS[-1]:
    return f"K must be a multiple of 64 and N of {NM24_SPANS[-1]}, got K={k}, N={n}"
  if k > MAX_DIM or n > MAX_DIM:
    return f"K and N must be at most 2**30, got K={k}, N={n}"
  return ""


def _nm24_defines(m: int, cfg: Nm24DecodeConfig, buffer: bool = False) -> tuple[tuple[str, int], ...]:
  tiles = -(-m // 8)
  tiles += tiles % cfg.token_split  # whole tiles per warp (rows past M are zeros)
  stages = (("NM_STAGES", cfg.stages),) if cfg.loads == "tma" else ()
  return (
      ("NM_MT", tiles),
      ("NM_CPL", cfg.span // 8),
      ("NM_SPLIT", cfg.split),
      ("NM_WARPS", cfg.warps),
      ("NM_MINB", cfg.blocks_per_sm),
      ("NM_TSPLIT", cfg.token_split),
      ("NM_XLOAD", NM24_X_LOADS.index(cfg.x_load) + 1),
      ("NM_META", int(buffer)),
      ("NM_LOADS", NM24_LOADS.index(cfg.loads)),
      *stages,
  )


def nm24_prepare(m: int, k: int, n: int, config: Nm24DecodeConfig | None = None, *, buffer: bool = False) -> str:
  """Builds the kernel of ``config`` (default: the default config) for an ``(m, k) @ (k, n)`` product (once per
  process; NVRTC's output is cached on disk), for :func:`nm24_decode_buffer` with ``buffer``; why it cannot run, or
  ``""``. Thread-safe: builds of several configs may run in threads at once."""
  reason = unavailable_reason() or nm24_unsupported_reason(m, k, n, jnp.bfloat16)
  if reason:
    return reason
  try:
    kernel_id("nm24_decode.cu", "nm24_decode",
              _nm24_defines(m, config or Nm24DecodeConfig.get_default(m, k, n, buffer=buffer), buffer))
  except RuntimeError as e:
    return str(e)
  return ""


def nm24_decode(
    x: jax.Array, values: jax.Array, indices: jax.Array, *, config: Nm24DecodeConfig | None = None
) -> jax.Array:
  """``x (M, K) @ W`` -> ``(M, N)`` bfloat16 for a 2:4 ``W`` given as stored by ``NMSparseMatrix``.

  Args:
    x: ``(M, K)`` bfloat16, ``M <= 32``.
    values: ``(K / 2, N)`` bfloat16 kept values (``NMSparseMatrix.values``).
    indices: ``(K / 8, N)`` uint8 packed positions (``NMSparseMatrix.indices``, 2:4 along ``K``).
    config: work split; default :meth:`Nm24DecodeConfig.get_default`.
  """
  for name, a in (("x", x), ("values", values), ("indices", indices)):
    if getattr(a, "ndim", None) != 2:
      raise ValueError(f"nm24_decode: {name} must be a 2-D array, got shape {getattr(a, 'shape', type(a).__name__)}.")
  k, n = x.shape[1], values.shape[1]
  want = ((k // 2, n), jnp.bfloat16, (k // 8, n), jnp.uint8)
  if (values.shape, values.dtype, indices.shape, indices.dtype) != want:
    raise ValueError(
        f"nm24_decode needs values ({k // 2}, {n}) bfloat16 and indices ({k // 8}, {n}) uint8, got values "
        f"{values.shape} {values.dtype} and indices {indices.shape} {indices.dtype}."
    )
  return _nm24_call("nm24_decode", x, (values, indices), n, config)


def nm24_decode_buffer(x: jax.Array, buffer: jax.Array, n: int, *, config: Nm24DecodeConfig | None = None
                       ) -> jax.Array:
  """``x (M, K) @ W`` -> ``(M, N)`` bfloat16 for a 2:4 ``W`` given as cuSPARSELt's compressed buffer.

  The buffer is the one :func:`jaxsparse._cuda._layout.compress_values` writes (and cuSPARSELt reads where
  ``_layout.matches()``): the ``(K / 2, N)`` bfloat16 values, then the metadata. The kernel is
  :func:`nm24_decode`'s, reading the positions from that metadata, so a layer that keeps only the buffer multiplies
  decode rows without a second copy of its values.

  Args:
    x: ``(M, K)`` bfloat16, ``M <= 32``.
    buffer: ``(K N 9 / 8,)`` uint8.
    n: ``N``, the columns of ``W``.
    config: work split; default :meth:`Nm24DecodeConfig.get_default` (``buffer=True``).
  """
  if getattr(x, "ndim", None) != 2:
    raise ValueError(f"nm24_decode_buffer: x must be a 2-D array, got shape {getattr(x, 'shape', type(x).__name__)}.")
  k = x.shape[1]
  if (getattr(buffer, "shape", None), getattr(buffer, "dtype", None)) != ((k * n // 8 * 9,), jnp.uint8):
    raise ValueError(f"nm24_decode_buffer needs a ({k * n // 8 * 9},) uint8 buffer for W ({k}, {n}), got "
                     f"{getattr(buffer, 'shape', type(buffer).__name__)} {getattr(buffer, 'dtype', '')}.")
  return _nm24_call("nm24_decode_buffer", x, (buffer,), n, config)


def _nm24_call(op: str, x: jax.Array, weight: tuple[jax.Array, ...], n: int, config) -> jax.Array:
  """The checks both decode entries share (after their own of ``x`` and ``W``), then the custom call (``weight``: the
  arrays after ``x``)."""
  if config is not None and not isinstance(config, Nm24DecodeConfig):
    raise TypeError(f"{op}: config must be an Nm24DecodeConfig or None, got {type(config).__name__}.")
  m, k = x.shape
  reason = nm24_unsupported_reason(m, k, n, x.dtype)
  if reason:
    raise ValueError(f"{op} cannot run for x {x.shape} and W ({k}, {n}): {reason}.")
  buffer = len(weight) == 1
  cfg = config or Nm24DecodeConfig.get_default(m, k, n, buffer=buffer)
  if n % cfg.span:
    raise ValueError(f"{op}: N={n} is not a multiple of the config's span={cfg.span}.")
  tma = cfg.loads == "tma"
  if tma and (not buffer or m > 8):
    raise ValueError(f"{op}: config {cfg.name} (loads='tma') reads cuSPARSELt's buffer at up to 8 rows only "
                     f"(nm24_decode_buffer), got {m} rows{'' if buffer else ' on NMSparseMatrix indices'}.")
  kid = kernel_id("nm24_decode.cu", "nm24_decode", _nm24_defines(m, cfg, buffer=buffer))
  x, weight = _utils.vary_alike(x, weight)  # an FFI call takes operands that vary alike (shard_map)
  out = _utils.result_struct((m, n), jnp.bfloat16, x, weight)
  attrs = dict(kernel=np.int64(kid), split=np.int64(cfg.split), warps=np.int64(cfg.warps), span=np.int64(cfg.span))
  if tma:
    op, attrs["stages"] = op + "_tma", np.int64(cfg.stages)
  return jax.ffi.ffi_call(f"jaxsparse_{op}", out, vmap_method="sequential")(x, *weight, **attrs)


PRUNE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
TRANSPOSABLE_COMPRESS_MAX_K = 64 * 65535  # a thread block per 64 rows, in the grid's y dimension


def nm24_prune_unsupported_reason(shape: tuple[int, ...], dtype, out_dtype) -> str:
  """Why the pruning kernels cannot prune a ``shape`` ``dtype`` weight into ``out_dtype``, or ``""`` (the
  compressing ones need more of the shape: see each)."""
  names = " or ".join(d.name for d in PRUNE_DTYPES)
  if jnp.dtype(dtype) not in PRUNE_DTYPES or jnp.dtype(out_dtype) not in PRUNE_DTYPES:
    return f"w and the output must be {names}, got {jnp.dtype(dtype)} and {jnp.dtype(out_dtype)}"
  if len(shape) != 2 or shape[0] % 4 or shape[1] % 4:
    return f"w must be 2-D (K, N) with K and N multiples of 4, got shape {tuple(shape)}"
  if max(shape) > MAX_DIM:
    return f"K and N must be at most 2**30, got shape {tuple(shape)}"
  if -(-(shape[0] // 4) * (shape[1] // 4) // 256) > _MAX_GRID_X:
    return f"w has more 4 x 4 tiles than one launch covers (256 * (2**31 - 1)), got shape {tuple(shape)}"
  return ""


def nm24_transposable(w: jax.Array, out_dtype=None) -> tuple[jax.Array, jax.Array]:
  """Transposable 2:4 pruning of ``w`` on the GPU: ``(pruned, pattern)``.

  The mask is :func:`jaxsparse.nm_mask` ``(w, 2, 4, transposable=True)``'s (2 kept entries in every row and
  every column of each ``4 x 4`` tile, the pattern of largest kept magnitude), up to float32 rounding: the
  kernel adds a pattern's scores in another order than XLA's product there, so where two patterns' totals
  agree to within rounding the two may keep different ones (of the same magnitude to that rounding).

  Args:
    w: ``(K, N)`` float32 or bfloat16 weight, ``K`` and ``N`` multiples of 4.
    out_dtype: the dtype of ``pruned`` (float32 or bfloat16; default ``w.dtype``), rounded to nearest even.

  Returns:
    ``pruned``: ``(K, N)`` ``where(mask, w, 0)`` in ``out_dtype``; ``pattern``: ``(K / 4, N / 4)`` uint8, each
    tile's index into ``jaxsparse.formats._nm_masks._tile_patterns(2, 4)``
    (:func:`jaxsparse.formats._nm_masks.tile_mask` expands it).
  """
  out_dtype = jnp.dtype(out_dtype or w.dtype)
  reason = nm24_prune_unsupported_reason(w.shape, w.dtype, out_dtype)
  if reason:
    raise ValueError(f"nm24_transposable cannot run: {reason}.")
  w_bf16, out_bf16 = w.dtype == jnp.bfloat16, out_dtype == jnp.bfloat16
  defines = (("NM_IN_BF16", int(w_bf16)), ("NM_OUT_BF16", int(out_bf16)))
  kid = kernel_id("nm24_prune.cu", "nm24_transposable", defines)
  k, n = w.shape
  out = (_utils.result_struct((k, n), out_dtype, w), _utils.result_struct((k // 4, n // 4), jnp.uint8, w))
  return jax.ffi.ffi_call("jaxsparse_nm24_transposable", out, vmap_method="sequential")(
      w, kernel=np.int64(kid), w_bf16=bool(w_bf16), out_bf16=bool(out_bf16)
  )


def nm24_transposable_compress(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """:func:`nm24_transposable` written as cuSPARSELt's compressed bfloat16 buffers: ``(pattern, blob, blob_t)``.

  ``blob`` is the buffer of the pruned ``W`` and ``blob_t`` that of ``Wᵀ`` (an ``(N, K)`` weight whose 2:4
  groups run along ``N``), both in cuSPARSELt's ``LAYOUT_KN`` form as :mod:`jaxsparse._cuda._layout` maps
  it: valid only where ``_layout.matches()`` (checked against cuSPARSELt on the device) is True.

  Args:
    w: ``(K, N)`` float32 or bfloat16 weight, ``K`` and ``N`` multiples of 64, ``K <= TRANSPOSABLE_COMPRESS_MAX_K``.

  Returns:
    ``pattern`` ``(K / 4, N / 4)`` uint8 as :func:`nm24_transposable`'s; ``blob`` and ``blob_t``, ``K N 9 / 8``
    bytes each (uint8): for ``cusparselt.matmul(x, blob, N)`` and ``cusparselt.matmul(dy, blob_t, K)``.
  """
  reason = nm24_prune_unsupported_reason(w.shape, w.dtype, jnp.bfloat16)
  k, n = w.shape if not reason else (0, 0)
  if not reason and (k % 64 or n % 64 or k > TRANSPOSABLE_COMPRESS_MAX_K):
    reason = f"K and N must be multiples of 64 and K at most {TRANSPOSABLE_COMPRESS_MAX_K}, got shape {(k, n)}"
  if reason:
    raise ValueError(f"nm24_transposable_compress cannot run: {reason}.")
  w_bf16 = w.dtype == jnp.bfloat16
  kid = kernel_id("nm24_prune.cu", "nm24_transposable_compress", (("NM_IN_BF16", int(w_bf16)),))
  buffer = _utils.result_struct((k * n // 8 * 9,), jnp.uint8, w)
  out = (_utils.result_struct((k // 4, n // 4), jnp.uint8, w), buffer, buffer)
  return jax.ffi.ffi_call("jaxsparse_nm24_transposable_compress", out, vmap_method="sequential")(
      w, kernel=np.int64(kid), w_bf16=bool(w_bf16)
  )


def nm24_prune(w: jax.Array, out_dtype=None, *, compress: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Plain 2:4 pruning of ``w`` along ``K`` on the GPU in one pass: ``(pruned, bits, blob)``.

  The mask is exactly :func:`jaxsparse.nm_mask` ``(w, 2, 4)``'s (comparisons only).

  Args:
    w: ``(K, N)`` float32 or bfloat16 weight, ``K`` and ``N`` multiples of 4.
    out_dtype: the dtype of ``pruned`` (float32 or bfloat16; default ``w.dtype``), rounded to nearest even.
    compress: also write cuSPARSELt's compressed buffer of the pruned weight (bfloat16 ``out_dtype``, ``K`` a
      multiple of 32 and ``N`` of 64), in its ``LAYOUT_KN`` form as :mod:`jaxsparse._cuda._layout` maps it
      (valid where ``_layout.matches()``).

  Returns:
    ``pruned``: ``(K, N)`` ``where(mask, w, 0)`` in ``out_dtype``; ``bits``: ``(K / 4, N)`` uint8, bit ``r`` of
    ``bits[g, j]`` set where ``w[4 g + r, j]`` is kept (:func:`jaxsparse.formats._nm_masks.group_mask` expands it);
    ``blob``: ``K N 9 / 8`` bytes (uint8) for ``cusparselt.matmul(x, blob, N)`` with ``compress``, else empty.
  """
  out_dtype = jnp.dtype(out_dtype or w.dtype)
  reason = nm24_prune_unsupported_reason(w.shape, w.dtype, out_dtype)
  if not reason and compress:
    k, n = w.shape
    if out_dtype != jnp.bfloat16:
      reason = f"the compressed buffer holds bfloat16, got out_dtype={out_dtype}"
    elif k % 32 or n % 64:
      reason = f"compressing needs K a multiple of 32 and N of 64, got shape {(k, n)}"
  if reason:
    raise ValueError(f"nm24_prune cannot run: {reason}.")
  w_bf16, out_bf16 = w.dtype == jnp.bfloat16, out_dtype == jnp.bfloat16
  kid = kernel_id("nm24_prune.cu", "nm24_prune", (("NM_IN_BF16", int(w_bf16)), ("NM_OUT_BF16", int(out_bf16))))
  k, n = w.shape
  out = (
      _utils.result_struct((k, n), out_dtype, w),
      _utils.result_struct((k // 4, n), jnp.uint8, w),
      _utils.result_struct((k * n // 8 * 9 if compress else 0,), jnp.uint8, w),
  )
  return jax.ffi.ffi_call("jaxsparse_nm24_prune", out, vmap_method="sequential")(
      w, kernel=np.int64(kid), w_bf16=bool(w_bf16), out_bf16=bool(out_bf16)
  )
