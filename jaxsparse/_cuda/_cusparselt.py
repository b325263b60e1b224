"""JAX wrappers of the cuSPARSELt custom calls: compress a pruned 2:4 weight, multiply by it.

``y = x @ W`` with ``x`` ``(M, K)`` and ``W`` ``(K, N)`` 2:4-sparse along ``K`` (Flax kernel layout),
bfloat16 (float16 only with ``JAXSPARSE_CUSPARSELT_F16=1``, see ``SUPPORTED_DTYPES``), float32
accumulation, on the sparse tensor cores of compute capability 8.0+ GPUs. :func:`compress` turns
the pruned dense ``W`` (at most 2 nonzeros in every 4 consecutive entries along ``K``) into
cuSPARSELt's compressed buffer on the device: an opaque ``uint8`` array of about 56% of the dense
bytes (values plus 2-bit metadata, laid out for the tensor cores). :func:`matmul` multiplies by that
buffer. Both lower to XLA FFI custom calls for the CUDA platform (``cusparselt_matmul.cc``); call
them only when :func:`available` is True.

Layouts (``layout``): ``LAYOUT_KN`` reads ``W`` as stored, ``(K, N)``; ``LAYOUT_NK`` reads ``Wᵀ``
stored ``(N, K)`` (PyTorch's ``Linear.weight``). A buffer is only valid with the layout it was
compressed in.
"""

from __future__ import annotations

import ctypes
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import _utils
from jaxsparse._cuda import _build
from jaxsparse._cuda._build import CusparseLtFallbackWarning

__all__ = [
    "LAYOUT_KN",
    "fast_compress",
    "LAYOUT_NK",
    "CusparseLtFallbackWarning",
    "available",
    "compress",
    "compressed_bytes",
    "matmul",
    "unavailable_reason",
    "unsupported_reason",
]

LAYOUT_KN = 0
LAYOUT_NK = 1
# The custom call handles float16 too, but on an H100 with cuSPARSELt 0.8.0 float16 products hit
# CUDA_ERROR_ILLEGAL_INSTRUCTION (2026-11-23, benchmarks/gpu_cusparselt.py --dtypes float16), which
# poisons the whole CUDA context; float16 stays on the other paths unless JAXSPARSE_CUSPARSELT_F16=1.
_DTYPE_CODES = {jnp.dtype(jnp.bfloat16): 0, jnp.dtype(jnp.float16): 1}
_F16 = os.environ.get("JAXSPARSE_CUSPARSELT_F16") == "1"
SUPPORTED_DTYPES = tuple(d for d in _DTYPE_CODES if d == jnp.bfloat16 or _F16)
# K and N must be multiples of this; M is padded up to one.
ALIGN = 16


def available() -> bool:
  """True when the custom calls are built and cuSPARSELt runs on the default CUDA device."""
  return _build.load()


def unavailable_reason() -> str:
  return _build.unavailable_reason()


def unsupported_reason(k: int, n: int, dtype, *, n_keep: int = 2, m: int = 4, axis: int = 0) -> str:
  """Why ``x @ W`` for a ``(k, n)`` ``n_keep:m`` ``W`` (groups along ``axis``) cannot run here, or ``""``."""
  if (n_keep, m) != (2, 4):
    return f"sparse tensor cores run 2:4 only, got {n_keep}:{m}"
  if axis != 0:
    return f"the 2:4 groups must run along K (axis 0 of the (K, N) weight), got axis={axis}"
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    names = " or ".join(d.name for d in SUPPORTED_DTYPES)
    return f"dtype must be {names} (with the same output dtype), got {jnp.dtype(dtype)}"
  if k % ALIGN or n % ALIGN:
    return f"K={k} and N={n} must be multiples of {ALIGN}"
  return ""


def _check_layout(layout) -> int:
  if isinstance(layout, bool) or not isinstance(layout, (int, np.integer)) or layout not in (LAYOUT_KN, LAYOUT_NK):
    raise ValueError(f"layout must be LAYOUT_KN ({LAYOUT_KN}) or LAYOUT_NK ({LAYOUT_NK}), got layout={layout!r}.")
  return int(layout)


def _check_weight(op: str, k, n, dtype) -> None:
  """The structured operand's sizes and dtype, before they reach the custom calls (``launch_checks.h`` again)."""
  for name, v in (("K", k), ("N", n)):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < ALIGN or v % ALIGN or v > 1 << 30:
      raise ValueError(f"{op}: {name} must be a positive multiple of {ALIGN} up to 2**30, got {name}={v!r}.")
  if jnp.dtype(dtype) not in _DTYPE_CODES:
    names = " or ".join(d.name for d in _DTYPE_CODES)
    raise ValueError(f"{op}: the weight's dtype must be {names}, got {jnp.dtype(dtype)}.")


@functools.cache
def compressed_bytes(n: int, k: int, dtype, layout: int = LAYOUT_KN) -> int:
  """Bytes of the compressed buffer of a ``(k, n)`` 2:4 weight (asks cuSPARSELt)."""
  layout = _check_layout(layout)
  _check_weight("compressed_bytes", k, n, dtype)
  if not available():
    raise RuntimeError(f"cuSPARSELt is unavailable: {unavailable_reason()}")
  code = _DTYPE_CODES[jnp.dtype(dtype)]
  error = ctypes.create_string_buffer(512)
  size = _build.library().JaxsparseCsltCompressedSize(-1, n, k, layout, code, error)
  if size < 0:
    raise RuntimeError(f"cuSPARSELt rejected a ({k}, {n}) {jnp.dtype(dtype)} weight: {error.value.decode()}")
  return int(size)


def compress(w: jax.Array, *, layout: int = LAYOUT_KN) -> jax.Array:
  """cuSPARSELt's compressed buffer (``uint8``) of a pruned dense 2:4 weight, computed on the device.

  Args:
    w: ``(K, N)`` (``LAYOUT_KN``) or ``(N, K)`` (``LAYOUT_NK``) bfloat16 / float16 array with at most
      2 nonzeros in every 4 consecutive entries along ``K``; other entries are not checked (cuSPARSELt
      keeps 2 of each 4 by position, so a weight that is not 2:4 gives wrong products).
    layout: how ``w`` is stored.
  """
  layout = _check_layout(layout)
  if getattr(w, "ndim", None) != 2:
    raise ValueError(f"compress: w must be a 2-D weight, got shape {getattr(w, 'shape', type(w).__name__)}.")
  k, n = w.shape if layout == LAYOUT_KN else w.shape[::-1]
  _check_weight("compress", k, n, w.dtype)
  out = _utils.result_struct((compressed_bytes(n, k, w.dtype, layout),), jnp.uint8, w)
  return jax.ffi.ffi_call("jaxsparse_cusparselt_compress", out, vmap_method="sequential")(w, layout=np.int64(layout))


def matmul(x: jax.Array, compressed: jax.Array, n: int, *, layout: int = LAYOUT_KN, search: bool = True) -> jax.Array:
  """``x (M, K) @ W`` -> ``(M, N)`` in ``x.dtype`` for ``W`` given by its :func:`compress` buffer.

  ``M`` is padded to a multiple of 16 (cuSPARSELt's granularity) and the padding sliced off.
  ``search=True`` picks the fastest cuSPARSELt algorithm for the shape on its first call (timed on
  the device, then cached for the process); ``False`` takes cuSPARSELt's default.
  """
  layout = _check_layout(layout)
  if getattr(x, "ndim", None) != 2:
    raise ValueError(f"matmul: x must be 2-D (M, K), got shape {getattr(x, 'shape', type(x).__name__)}.")
  if getattr(compressed, "ndim", None) != 1 or jnp.dtype(compressed.dtype) != jnp.uint8:
    raise ValueError(
        "matmul: compressed must be the 1-D uint8 buffer of compress(), got "
        f"{getattr(compressed, 'dtype', type(compressed).__name__)} {getattr(compressed, 'shape', '')}."
    )
  _check_weight("matmul", x.shape[1], n, x.dtype)
  rows = x.shape[0]
  padded = max(ALIGN, -(-rows // ALIGN) * ALIGN)
  if padded != rows:
    x = jnp.pad(x, ((0, padded - rows), (0, 0)))
  x, compressed = _utils.vary_alike(x, compressed)  # an FFI call takes operands that vary alike (shard_map)
  out = _utils.result_struct((padded, n), x.dtype, x, compressed)
  y = jax.ffi.ffi_call("jaxsparse_cusparselt_matmul", out, vmap_method="sequential")(
      x, compressed, layout=np.int64(layout), search=np.int64(bool(search))
  )
  return y if padded == rows else y[:rows]


def fast_compress(k: int, n: int, dtype) -> bool:
  """Whether XLA can write the compressed buffer itself (``_layout``), checked against cuSPARSELt here."""
  from jaxsparse._cuda import _layout  # noqa: PLC0415 (imports this module)

  return jnp.dtype(dtype) == jnp.bfloat16 and _layout.supports(k, n) and available() and _layout.matches()
