"""``nm_matmul``: ``x @ W`` for a compressed N:M-sparse ``W``, differentiable in ``x`` and the kept values.

Backends for the forward product:

* XLA: expand ``W`` to dense (one fused pass over the compressed bytes) and run a dense ``dot``.
  This is the reference, the CPU path, and on a GPU the faster choice for many rows, where the
  product is bound by arithmetic and the dense tensor-core ``dot`` wins.
* Pallas (CUDA GPUs, few rows): :mod:`jaxsparse.pallas._nm_matmul` reads the compressed weight
  (56% of the dense bytes for 2:4 bf16) and expands it on chip. The expansion, not memory, limits
  it: 0.79-1.0x the dense time at M = 16 on an H100, 3-4x faster than expanding in XLA first
  (``benchmarks/results/gpu_nm_2026-11-21.md``).
* cuSPARSELt (CUDA GPUs, 2:4, bfloat16): the sparse tensor cores multiply by the weight in
  cuSPARSELt's own compressed layout: 0.70-0.73x the dense time at M = 8192 on an H100 with the
  buffer built once (:func:`cusparselt_compress`, kept by :class:`jaxsparse.layers.CompressedNMLinear`),
  0.78-0.82x when XLA rebuilds it from ``w`` in every call (one pass over the compressed bytes, where
  ``jaxsparse._cuda._layout`` knows the layout) (``benchmarks/results/gpu_nm_2026-11-23.md``). Its
  decode kernels are slower than the Pallas kernel, so "auto" takes it for more than
  ``MAX_FUSED_ROWS`` rows.
* Our CUDA kernel on ``mma.sp`` (Hopper, 2:4 bfloat16, ``M <= 32``, ``N >= NM24_MIN_COLS`` (2048);
  :mod:`jaxsparse._cuda._kernels`): reads ``w`` as stored, on the sparse tensor cores: 0.61-0.84x the
  dense time at M = 1-16 and 0.73-0.95x at M = 32 for K = 4096, N = 4096-16384, weights from device
  memory (``benchmarks/results/gpu_nm_decode_2026-11-24_h100.md``). "auto" takes it where it applies.
  Given ``cusparselt_weight`` in the layout ``jaxsparse._cuda._layout`` writes, it reads that buffer instead
  (the same values, the positions from cuSPARSELt's metadata), so a layer may keep the buffer alone.

The backward pass (both backends) is ``dX = dY @ Wᵀ`` and ``dvalues = (xᵀ dY)`` sampled at the
kept positions, both through XLA.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsparse import _tuning
from jaxsparse import _utils
from jaxsparse._cuda import _build as _cuda_build
from jaxsparse._cuda import _cusparselt as cslt
from jaxsparse._cuda import _kernels as cuda_kernels
from jaxsparse._cuda import _layout
from jaxsparse.formats import _nm
from jaxsparse.formats._base import is_concrete
from jaxsparse.formats._nm import NMSparseMatrix
from jaxsparse.ops import _router
from jaxsparse.ops import _sharding
from jaxsparse.pallas._common import PallasFallbackWarning

__all__ = ["cusparselt_available", "cusparselt_compress", "nm_matmul", "nm_matmul_reference"]

NMImplementation = Literal["xla", "pallas", "cusparselt"]
NMImplementation.__doc__ = """The backends of :func:`jaxsparse.ops.nm_matmul`: ``"xla"``, ``"pallas"`` or cuSPARSELt.

A type alias for annotations; ``None`` picks one per product (see :func:`jaxsparse.ops.nm_matmul`).

>>> import typing, jaxsparse
>>> typing.get_args(jaxsparse.ops.NMImplementation)
('xla', 'pallas', 'cusparselt')
"""
_IMPLEMENTATIONS = (None, "xla", "pallas", "cusparselt")
# "auto" multiplies by a cuSPARSELt weight above this many rows, and uses the Pallas kernel up to it
# (cuSPARSELt's decode kernels ran 1.1-1.6x dense at M <= 16 on an H100, the Pallas kernel 0.8-1.0x).
MAX_FUSED_ROWS = 64
# Measured dispatch ("auto") does not time the Pallas kernel above this many rows: at 2048 rows it took 2.3-2.8x the
# XLA path's time and 2.5-3.4x cuSPARSELt's in all six Llama-3-8B projections measured (H100,
# benchmarks/results/llm_decode_fused_2026-11-27_h100.md), and compiling and timing it lengthens the first trace.
PALLAS_MAX_TUNED_ROWS = 512
# "auto" with tuning off takes the sparse tensor-core decode kernel (M <= 32) for W at least this wide (H100,
# benchmarks/results/gpu_nm_decode_2026-11-24_h100.md: N = 4096-16384). From 2048 (was 4096): on an H200 its
# defaults ran the TinyLlama-1.1B products of 2048-2560 columns at 0.27-0.90 of dense at 1-8 rows, and the 1.1B model,
# tuning off, decoded 2:4 at 1.60x / 1.09x dense at batch 1 / 8 where the Pallas kernel on the narrower ones gave
# 0.89x / 0.62x (benchmarks/results/llm_decode_nm24_buffer_2026-12-01_h200.md).
NM24_MIN_COLS = 2048


def nm_matmul_reference(
    x: jax.typing.ArrayLike,
    w: NMSparseMatrix,
    *,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
) -> jax.Array:
  """Dense oracle and XLA path: ``x @ w.to_dense()``.

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> w = jaxsparse.NMSparseMatrix.from_dense(jnp.arange(8.0).reshape(4, 2), 2, 4)
  >>> jaxsparse.ops.nm_matmul_reference(jnp.ones((1, 4)), w)
  Array([[10., 12.]], dtype=float32)

  Args:
    x: ``(..., K)`` activations.
    w: a :class:`jaxsparse.NMSparseMatrix` of shape ``(K, N)``.
    precision: passed to ``jnp.matmul``.
    preferred_element_type: output dtype, a floating dtype; defaults to ``result_type(x, w.values)``.

  Returns:
    ``(..., N)`` array of ``preferred_element_type``, equal to :func:`nm_matmul`'s result up to rounding.

  Raises:
    TypeError: ``w`` is not a :class:`jaxsparse.NMSparseMatrix`, or ``x`` is not an array of numbers.
    ValueError: ``x`` is not ``(..., K)`` with ``K = w.shape[0]``.
  """
  return _utils.dense_reference(x, w, kind=NMSparseMatrix, precision=precision,
                               preferred_element_type=preferred_element_type)


def _pallas_ops():
  """The Pallas kernel module, or ``None`` when it cannot be imported here."""
  return _router.import_kernels("_nm_matmul")


@dataclasses.dataclass(frozen=True)
class _Config(_router.Config):
  buffer_only: bool = False  # ``w`` is unpacked from the buffer (``nm_matmul_buffer``): routes that read ``w`` unpack


def _unpacked(cfg: _Config, w: NMSparseMatrix, blob: jax.Array | None) -> NMSparseMatrix:
  """``w`` for a route that reads it: unpacked from ``blob`` in the route itself when the caller keeps the buffer
  alone (so that measured dispatch times the unpacking with the route that needs it)."""
  return from_buffer(blob, w.shape, w.dtype) if cfg.buffer_only else w


def _xla_forward(cfg: _Config, x2, w):
  # The product in the output dtype: bfloat16 operands with ``preferred_element_type=float32`` keep float32's digits
  # (a product in the operands' dtype, cast after, would be rounded to bfloat16 first).
  return nm_matmul_reference(x2, w, precision=cfg.precision, preferred_element_type=cfg.out_dtype)


def cusparselt_available() -> bool:
  """True when the 2:4 product on sparse tensor cores (cuSPARSELt) can run on the default device.

  It needs a CUDA GPU of compute capability 8.0 or later with cuSPARSELt, and builds jaxsparse's custom calls on
  first use (at most once per process); on a machine without a CUDA GPU it is ``False``.

  >>> import jaxsparse
  >>> isinstance(jaxsparse.ops.cusparselt_available(), bool)
  True

  Args:
    None.

  Returns:
    A ``bool``, whether :func:`cusparselt_compress` and ``nm_matmul(..., implementation="cusparselt")`` can run.
  """
  return cslt.available()


def cusparselt_unsupported_reason(w: NMSparseMatrix, dtype=None) -> str:
  """Why ``x @ w`` with ``x`` of ``dtype`` cannot run on cuSPARSELt here, or ``""``."""
  if not cslt.available():
    return cslt.unavailable_reason()
  if w.ndim != 2:
    return f"w must be 2-D, got shape {w.shape}"
  if dtype is not None and jnp.dtype(dtype) != w.dtype:
    return f"x ({jnp.dtype(dtype)}) and w ({w.dtype}) must have the same dtype"
  return cslt.unsupported_reason(w.shape[0], w.shape[1], w.dtype, n_keep=w.n, m=w.m, axis=w.axis)


def warn_cusparselt_fallback(op: str, reason: str) -> None:
  """Warns with :class:`CusparseLtFallbackWarning` that ``op`` skips sparse tensor cores, on CUDA machines only."""
  if _cuda_build.has_cuda_device():
    _utils.warn_at_caller(
        f"{op}: the 2:4 product on sparse tensor cores cannot run ({reason}); using the other paths.",
        cslt.CusparseLtFallbackWarning,
    )


def cusparselt_compress(w: NMSparseMatrix) -> jax.Array:
  """``w`` in cuSPARSELt's compressed layout (an opaque ``uint8`` array), built on the GPU.

  Pass it to :func:`nm_matmul` as ``cusparselt_weight`` to multiply on sparse tensor cores without
  re-compressing on every call. It is a copy: rebuild it after changing ``w.values``. Needs a CUDA
  GPU with cuSPARSELt (:func:`cusparselt_available`), a 2:4 ``(K, N)`` bfloat16 ``w``
  with groups along ``K`` and ``K``, ``N`` multiples of 16. The example needs such a GPU, so it is skipped in the
  doctests (which run on CPU).

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(jax.random.key(0), (64, 32), jnp.bfloat16), 2, 4)
  >>> blob = jaxsparse.ops.cusparselt_compress(w)  # doctest: +SKIP
  >>> blob.dtype  # doctest: +SKIP
  dtype('uint8')
  >>> y = jaxsparse.ops.nm_matmul(jnp.ones((8, 64), jnp.bfloat16), w, cusparselt_weight=blob)  # doctest: +SKIP
  >>> y.shape, y.dtype  # doctest: +SKIP
  ((8, 32), dtype(bfloat16))

  Args:
    w: a 2:4 :class:`jaxsparse.NMSparseMatrix` of shape ``(K, N)``, bfloat16, groups along ``K`` (``axis=0``).

  Returns:
    A 1-D ``uint8`` array, the compressed weight and its metadata in cuSPARSELt's layout (its size is
    cuSPARSELt's, about ``K * N`` bytes for bfloat16).

  Raises:
    TypeError: ``w`` is not a :class:`jaxsparse.NMSparseMatrix` (a dense array: ``NMSparseMatrix.from_dense`` first).
    ValueError: cuSPARSELt cannot run here or does not support ``w`` (the message says why).
  """
  _utils.check_weight_type(w, NMSparseMatrix)
  reason = cusparselt_unsupported_reason(w)
  if reason:
    raise ValueError(f"cusparselt_compress cannot run for {w!r}: {reason}.")
  return _compress(w)


def _compress(w: NMSparseMatrix) -> jax.Array:
  # Where XLA knows cuSPARSELt's layout the buffer is our values plus re-ordered positions.
  if cslt.fast_compress(*w.shape, w.dtype):
    return _layout.compress_values(w.values, w.positions())
  return cslt.compress(w.to_dense())


# -------------------------------------------------------------------------------------------------
# One buffer for a 2:4 weight: values, then cuSPARSELt's metadata, as jaxsparse._cuda._layout writes it on any
# device. Where cuSPARSELt's layout is that one (``buffer_is_cusparselt``), cuSPARSELt and the ``mma.sp`` kernel
# both read it, so a layer can keep it alone (CompressedNMLinear(storage="cusparselt")).
# -------------------------------------------------------------------------------------------------


def buffer_unsupported_reason(w: NMSparseMatrix) -> str:
  """Why ``w`` cannot be kept as one buffer (:func:`to_buffer`), or ``""``."""
  if w.ndim != 2 or (w.n, w.m, w.axis) != (2, 4, 0):
    return f"it needs a 2-D 2:4 weight with groups along K (axis=0), got {w.ndim}-D {w.n}:{w.m}, axis={w.axis}"
  if not _layout.supports(*w.shape):
    return f"it needs K a multiple of 32 and N of 64, got (K, N) = {w.shape}"
  return ""


# A float16 weight's buffer ends with these 16 bytes. Without them it has the size of the bfloat16 buffer of the same
# weight shape: a checkpoint of one restored into a layer of the other would be read in the wrong dtype, unnoticed.
# (bfloat16 buffers, the ones cuSPARSELt reads, stay exactly values + metadata; float32's differ in size anyway.)
_FLOAT16_TAG = np.frombuffer(b"jaxsparse:fp16\0\0", np.uint8)


def _tag(dtype) -> np.ndarray:
  return _FLOAT16_TAG if jnp.dtype(dtype) == jnp.float16 else _FLOAT16_TAG[:0]


def buffer_bytes(k: int, n: int, dtype) -> int:
  """Bytes of :func:`to_buffer`'s buffer of a ``(k, n)`` 2:4 weight of ``dtype``: ``K N / 2 * itemsize`` of values,
  ``K N / 8`` of metadata, and for float16 16 bytes that mark the dtype."""
  return k * n // 2 * jnp.dtype(dtype).itemsize + k * n // 8 + _tag(dtype).size


def to_buffer(w: NMSparseMatrix) -> jax.Array:
  """The ``(buffer_bytes(K, N, dtype),)`` uint8 buffer of ``w`` (:func:`buffer_unsupported_reason` is ``""``)."""
  buffer = _layout.compress_values(w.values, w.positions())
  tag = _tag(w.dtype)
  return jnp.concatenate([buffer, jnp.asarray(tag)]) if tag.size else buffer


def from_buffer(buffer: jax.Array, shape: tuple[int, int], dtype) -> NMSparseMatrix:
  """Inverse of :func:`to_buffer` for a ``shape`` weight of ``dtype`` values.

  Raises:
    ValueError: ``buffer`` is not ``(buffer_bytes(K, N, dtype),)`` uint8, or (when concrete) a float16 buffer lacks
      the bytes that mark float16.
  """
  k, n = shape
  tag = _tag(dtype)
  if tag.size:
    want = buffer_bytes(k, n, dtype)
    if tuple(buffer.shape) != (want,) or buffer.dtype != jnp.uint8:
      raise ValueError(f"a 2:4 float16 ({k}, {n}) weight's buffer is ({want},) uint8 (its last 16 bytes mark float16), "
                       f"got {buffer.dtype} {tuple(buffer.shape)}.")
    if is_concrete(buffer) and not np.array_equal(np.asarray(buffer[-tag.size :]), tag):
      raise ValueError(f"this ({want},) uint8 buffer does not end with the bytes that mark a float16 weight's buffer "
                       f"(to_buffer writes {tag.tobytes()!r}): not a float16 buffer.")
    buffer = buffer[: -tag.size]
  values, positions = _layout.decompress(buffer, k, n, dtype)
  return NMSparseMatrix(values, _nm._pack(positions.reshape(k // 4, 2, n), 2, 4), shape=shape, n=2, m=4,
                        axis=0, validate=False)


def buffer_is_cusparselt(k: int, n: int, dtype) -> bool:
  """Whether cuSPARSELt here reads :func:`to_buffer`'s buffer of a ``(k, n)`` weight of ``dtype`` as its own."""
  return cslt.fast_compress(k, n, dtype)


def _cslt_forward(cfg: _Config, x2, w, blob):
  if blob is None:
    blob = _compress(w)
  return cslt.matmul(x2, blob, w.shape[1]).astype(cfg.out_dtype)


# -------------------------------------------------------------------------------------------------
# The forward product's backends (ops/_router.py), in priority order.
# -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _SparseMma:
  """CUDA (Hopper): our decode kernel on the sparse tensor cores (``mma.sp``): 2:4 bfloat16, ``M <= 32``."""

  cfg: _Config
  name: ClassVar[str] = "mma_sp"
  title: ClassVar[str] = "jaxsparse's CUDA kernel (mma.sp)"
  platforms: ClassVar[tuple[str, ...]] = ("cuda",)
  fallback_warning: ClassVar[type[Warning]] = cuda_kernels.CudaKernelFallbackWarning

  def unsupported_reason(self, p: _router.Product) -> _router.Unsupported | None:
    x2, w, _ = p.args
    if (w.n, w.m, w.axis) != (2, 4, 0):
      return _router.Unsupported(f"the kernel takes 2:4 with groups along K, got {w.n}:{w.m}, axis={w.axis}")
    if not (x2.dtype == w.dtype == self.cfg.out_dtype == jnp.bfloat16):
      return _router.Unsupported("x, w and the output must be bfloat16")
    k, n = w.shape
    reason = cuda_kernels.nm24_unsupported_reason(x2.shape[0], k, n, x2.dtype)
    if reason:
      return _router.Unsupported(reason)
    reason = cuda_kernels.unavailable_reason()
    if not reason and (n >= NM24_MIN_COLS or _tuning.will_measure("cuda")):
      # Builds the kernel (once per shape class) where it may run: a GPU that fails to build it says so.
      reason = cuda_kernels.nm24_prepare(x2.shape[0], k, n, buffer=_reads_buffer(w, p.args[2]))
      return _router.Unsupported(reason, warn=True) if reason else None
    return _router.Unsupported(reason) if reason else None

  def candidates(self, p: _router.Product) -> list[_tuning.Candidate]:
    """The default config as ``mma_sp`` (what runs with tuning off), its neighbours as ``mma_sp/<config name>``
    (``Nm24DecodeConfig.name``; :func:`jaxsparse._cuda._nm24_config.nm24_candidate_configs`)."""
    x2, w, blob = p.args
    buffer = _reads_buffer(w, blob)
    configs = cuda_kernels.nm24_candidate_configs(x2.shape[0], *w.shape, buffer=buffer)
    return [
        _tuning.Candidate(self.name if i == 0 else f"{self.name}/{c.name}",
                          functools.partial(_sparse_mma_run, c), c,
                          prepare=functools.partial(cuda_kernels.nm24_prepare, x2.shape[0], *w.shape, c,
                                                    buffer=buffer))
        for i, c in enumerate(configs)
    ]


def _reads_buffer(w: NMSparseMatrix, blob: jax.Array | None) -> bool:
  """Whether the ``mma.sp`` kernel reads ``blob`` (cuSPARSELt's buffer of ``w``) instead of ``w``'s arrays: where the
  buffer is in the layout ``jaxsparse._cuda._layout`` writes (cuSPARSELt here writes it byte for byte), a layer that
  keeps the buffer alone needs no other copy of its values."""
  return blob is not None and cslt.fast_compress(*w.shape, w.dtype)


def _sparse_mma_run(config, x2, w, blob):
  if _reads_buffer(w, blob):
    return cuda_kernels.nm24_decode_buffer(x2, blob, w.shape[1], config=config)
  return cuda_kernels.nm24_decode(x2, w.values, w.indices, config=config)


@dataclasses.dataclass(frozen=True)
class _CuSparseLt:
  """CUDA: cuSPARSELt's 2:4 product on the sparse tensor cores, on ``cusparselt_weight`` or a buffer written from
  ``w`` in the call (where XLA knows cuSPARSELt's layout, or when forced)."""

  cfg: _Config
  name: ClassVar[str] = "cusparselt"
  title: ClassVar[str] = "the 2:4 product on sparse tensor cores"
  platforms: ClassVar[tuple[str, ...]] = ("cuda",)
  fallback_warning: ClassVar[type[Warning]] = cslt.CusparseLtFallbackWarning

  def unsupported_reason(self, p: _router.Product) -> _router.Unsupported | None:
    x2, w, blob = p.args
    reason = cusparselt_unsupported_reason(w, x2.dtype)
    if not reason and self.cfg.out_dtype != x2.dtype:
      reason = f"the output dtype ({self.cfg.out_dtype}) must be that of x ({x2.dtype})"
    if reason:  # a cuSPARSELt weight that cannot be used: say so
      return _router.Unsupported(reason, warn=blob is not None)
    forced = self.cfg.implementation == "cusparselt"
    if blob is None and not forced and not cslt.fast_compress(*w.shape, w.dtype):
      return _router.Unsupported("compressing w with cuSPARSELt in every call costs more than it saves")
    return None

  def candidates(self, p: _router.Product) -> list[_tuning.Candidate]:
    return [_tuning.Candidate(self.name, functools.partial(_cslt_forward, self.cfg))]


@dataclasses.dataclass(frozen=True)
class _Pallas:
  """CUDA: the Pallas kernel that expands the compressed weight on chip (:mod:`jaxsparse.pallas._nm_matmul`)."""

  cfg: _Config
  name: ClassVar[str] = "pallas"
  title: ClassVar[str] = "the Pallas GPU kernels"
  platforms: ClassVar[tuple[str, ...]] = ("cuda",)
  fallback_warning: ClassVar[type[Warning]] = PallasFallbackWarning

  def unsupported_reason(self, p: _router.Product) -> _router.Unsupported | None:
    x2, w, _ = p.args
    if self.cfg.implementation == "auto" and x2.shape[0] > PALLAS_MAX_TUNED_ROWS:
      return _router.Unsupported(f"{x2.shape[0]} rows: above {PALLAS_MAX_TUNED_ROWS} the kernel is slower than the "
                                 "XLA path (it expands W on chip for every row tile)")
    kernels = _pallas_ops()
    if kernels is None:
      return _router.Unsupported("jaxsparse.pallas could not be imported")
    if x2.shape[0] == 0 or w.shape[1] == 0:
      return _router.Unsupported("an empty output: nothing for a kernel to tile")
    reason = kernels.unsupported_reason(x2, w)
    return None if reason is None else _router.Unsupported(reason, warn=True)

  def candidates(self, p: _router.Product) -> list[_tuning.Candidate]:
    kernels, cfg = _pallas_ops(), self.cfg
    # The kernel writes out_dtype from its float32 accumulator: a float32 result of 16-bit operands is not rounded.
    run = lambda x2, w, blob: kernels.forward(x2, _unpacked(cfg, w, blob), precision=cfg.precision,
                                              out_dtype=cfg.out_dtype)
    return [_tuning.Candidate(self.name, run)]


def _expand(cfg: _Config) -> _router.Reference:
  """Every platform: ``W`` expanded to dense in one fused pass and one dense product (the reference)."""
  return _router.Reference("xla", "the XLA path", lambda x2, w, blob: _xla_forward(cfg, x2, _unpacked(cfg, w, blob)))


# ``implementation=`` -> its backends, in priority order.
_BACKENDS = {
    "auto": (_SparseMma, _CuSparseLt, _Pallas, _expand),
    "pallas": (_Pallas,),
    "cusparselt": (_CuSparseLt,),
    "xla": (_expand,),
}


def _shipped_default(p: _router.Product, cands: list[_tuning.Candidate]) -> str:
  """The route with tuning off (measurements in the module docstring): the ``mma.sp`` kernel for few rows of a wide
  ``W``, cuSPARSELt for many rows, the Pallas kernel for few, else the XLA path."""
  x2, w, _ = p.args
  names, rows = {c.name for c in cands}, x2.shape[0]
  if "mma_sp" in names and w.shape[1] >= NM24_MIN_COLS:
    return "mma_sp"
  if "cusparselt" in names and rows > MAX_FUSED_ROWS:
    return "cusparselt"
  if "pallas" in names and rows <= MAX_FUSED_ROWS:
    return "pallas"
  return "xla" if "xla" in names else cands[0].name


def _product(cfg: _Config, x2: jax.Array, w: NMSparseMatrix, blob: jax.Array | None) -> _router.Product:
  (m, k), n = x2.shape, w.shape[1]

  def make_args():
    x = _tuning.random_operand((m, k), x2.dtype, 1)
    wr = NMSparseMatrix.from_dense(_tuning.random_operand(w.shape, w.dtype, 2), w.n, w.m, axis=w.axis)
    return x, wr, None if blob is None else _compress(wr)

  fields = {
      "rows": _utils.row_bucket(m),
      "shape": (k, n),
      "nm": (w.n, w.m, w.axis),
      "dtypes": (str(x2.dtype), str(w.dtype), str(cfg.out_dtype)),
      "precision": cfg.precision,
      "weight": "buffer" if cfg.buffer_only else "values" if blob is None else "cusparselt",
  }
  dense = _tuning.DenseProduct((m, k), (k, n), (x2.dtype, w.dtype))
  return _router.Product("nm_matmul", "fwd", (x2, w, blob), fields, make_args, dense)


def _local_forward(cfg: _Config, x2: jax.Array, w: NMSparseMatrix, blob: jax.Array | None = None) -> jax.Array:
  """The forward product on 2-D rows; ``blob`` is the cuSPARSELt buffer of ``w`` when the caller has one."""
  backends = [b(cfg) for b in _BACKENDS[cfg.implementation]]
  return _router.route([_product(cfg, x2, w, blob)], backends, default=_shipped_default)[0]


def _forward(cfg: _Config, x: jax.Array, w: NMSparseMatrix, blob: jax.Array | None) -> jax.Array:
  # Data parallel: each device multiplies its rows of x (ops/_sharding.py).
  local = lambda x2, rest: (_local_forward(cfg, x2, *rest),)
  return _sharding.row_parallel(local, (x,), (w, blob))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _nm_matmul(cfg: _Config, x: jax.Array, w: NMSparseMatrix, blob: jax.Array | None) -> jax.Array:
  return _forward(cfg, x, w, blob)


def _nm_matmul_fwd(cfg, x, w, blob):
  # `_nm_matmul`, not `_forward`: differentiating this rule (grad of grad) then meets the custom VJP again, not
  # the kernels (the backward pass is plain XLA, differentiable as it is).
  # A forward that is differentiated reads `w`, not a separate cuSPARSELt copy: a training step changes `w` and
  # not the copy (a CompressedNMLinear's `kernel_cusparselt`), whose products would then be a stale weight's
  # while the gradients are `w`'s. A buffer that `w` is unpacked from (`nm_matmul_buffer`) is `w` itself: kept.
  return _nm_matmul(cfg, x, w, blob if cfg.buffer_only else None), (x, w)


def _local_backward(cfg: _Config, x2, dy2, w):
  acc = _utils.accumulation_dtype(x2.dtype, dy2.dtype, w.dtype)
  # 16-bit operands cast to acc on a CPU (an ensemble's xᵀ dY crashed XLA's CPU runtime: _utils.cpu_dot_operands).
  xc, dyc, wd = _utils.cpu_dot_operands(acc, x2, dy2, w.to_dense())
  dx = lax.dot_general(dyc, wd, (((1,), (1,)), ((), ())), precision=cfg.precision, preferred_element_type=acc)
  dw = lax.dot_general(xc, dyc, (((0,), (0,)), ((), ())), precision=cfg.precision, preferred_element_type=acc)
  # The gradient of the kept values is dW at the kept positions: the VJP of w.to_dense().
  _, to_dense_vjp = jax.vjp(lambda v: w.with_values(v).to_dense(), w.values)
  (dvalues,) = to_dense_vjp(dw.astype(w.dtype))
  return dx.astype(x2.dtype), dvalues


def _nm_matmul_bwd(cfg, res, dy):
  x, w = res
  # Data parallel: dX keeps the rows' sharding, dvalues is summed over the row shards.
  local = functools.partial(_local_backward, cfg)
  dx, dvalues = _sharding.row_parallel(local, (x, dy), w, summed=(1,), like={0: x, 1: w.values})
  dw_tree = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(w), [dvalues, None])
  return dx, dw_tree, None


_nm_matmul.defvjp(_nm_matmul_fwd, _nm_matmul_bwd)


def _check_implementation(implementation) -> str:
  if implementation == "cusparselt":
    if not cslt.available():
      raise RuntimeError(f"implementation='cusparselt' was requested but cannot run here: {cslt.unavailable_reason()}.")
    return implementation
  kernels = _pallas_ops() if implementation == "pallas" else None
  return _router.check_implementation(implementation, _IMPLEMENTATIONS, kernels)


def nm_matmul(
    x: jax.typing.ArrayLike,
    w: NMSparseMatrix,
    *,
    implementation: NMImplementation | None = None,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    cusparselt_weight: jax.Array | None = None,
) -> jax.Array:
  """Computes ``x @ w`` for an N:M-sparse ``w`` stored compressed.

  Equal to ``x @ w.to_dense()``. Differentiable with respect to ``x`` and ``w.values`` (the
  positions are integers and get no gradient); works under ``jit``, ``vmap`` and ``grad``, and inside
  ``jax.shard_map`` as :func:`jaxsparse.ops.block_sparse_matmul`.

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(jax.random.key(0), (64, 32)), 2, 4)
  >>> x = jnp.ones((2, 3, 64))
  >>> y = jaxsparse.ops.nm_matmul(x, w)
  >>> y.shape, bool(jnp.allclose(y, x @ w.to_dense(), atol=1e-5))
  ((2, 3, 32), True)

  Args:
    x: ``(..., K)`` activations.
    w: a 2-D :class:`jaxsparse.NMSparseMatrix` of shape ``(K, N)``; groups along ``K`` (axis 0)
      for the GPU kernel, either axis on the XLA path.
    implementation: ``None`` picks at lowering time, on CUDA GPUs among every backend that supports the
      operands (our ``mma.sp`` decode kernel, cuSPARSELt, the Pallas kernel, the XLA path) the one measured
      fastest for this product (:func:`jaxsparse.set_autotune_mode`), or with tuning off the shipped rule:
      the ``mma.sp`` kernel for ``M <= 32`` rows of a 2:4 bfloat16 ``W`` of at least 2048 columns, the
      Pallas kernel for few rows (``M <= 64``), cuSPARSELt's sparse tensor cores for more rows (2:4
      bfloat16, with ``cusparselt_weight`` or, where XLA can write cuSPARSELt's layout, a buffer built in the
      call), the XLA path otherwise; elsewhere the XLA path; ``"xla"``, ``"pallas"`` or
      ``"cusparselt"`` force one (``"cusparselt"`` compresses ``w`` on every call when no
      ``cusparselt_weight`` is given), and a forced backend that cannot run raises.
    precision: passed to the products.
    preferred_element_type: output dtype, a floating dtype; defaults to ``result_type(x, w.values)``. Products
      accumulate in at least float32.
    cusparselt_weight: ``cusparselt_compress(w)``, the same weight in cuSPARSELt's layout (2:4,
      bfloat16, ``x`` and the output of the same dtype). The forward product reads it
      instead of ``w``; gradients still come from ``w``, and a differentiated forward (``jax.grad``, ``jax.vjp``) reads
      ``w`` too, so that a training step that changes ``w`` but not this copy computes with the new weight. When it
      cannot be used on a CUDA GPU,
      "auto" warns with :class:`jaxsparse.ops.CusparseLtFallbackWarning`.

  Returns:
    ``(..., N)`` array.

  Raises:
    TypeError: ``preferred_element_type`` is not a floating dtype or ``None``;
      ``w`` is not a :class:`jaxsparse.NMSparseMatrix`; ``x`` does not have a floating dtype; ``w.values`` is complex;
      ``cusparselt_weight`` is not a 1-D uint8 array;
      float operands of two dtypes where one is an 8-bit float (``float8_e4m3fn``, ``float8_e5m2``)
      without ``preferred_element_type`` (cast one, or pass it, as ``jnp.matmul`` wants; float8 operands of one
      dtype multiply as in ``jnp.matmul``, in float32).
    ValueError: ``w`` is not 2-D, or its ``values`` / positions have the wrong shape or dtype (e.g. a matrix
      rebuilt with ``tree_unflatten``); ``x`` is not ``(..., K)`` with ``K = w.shape[0]``, or ``K == 0``; an
      unknown ``implementation``; ``implementation="cusparselt"`` with operands cuSPARSELt does not take (not
      2:4 bfloat16 along ``K``, or an output dtype other than ``x``'s; the message says which); a ``precision``
      ``lax.dot_general`` does not take.
    RuntimeError: ``implementation="pallas"`` or ``"cusparselt"`` where that backend cannot run (no CUDA GPU,
      as on a CPU; no cuSPARSELt library), or for operands no route of it takes.
  """
  _utils.check_weight_type(w, NMSparseMatrix)
  if w.ndim != 2:
    raise ValueError(f"w must be a 2-D (K, N) NMSparseMatrix, got shape {w.shape}.")
  w._check_static(prefix="w.")  # a tree-mapped w skips the constructor's checks
  return _call(x, w, implementation, precision, preferred_element_type, cusparselt_weight)


def nm_matmul_buffer(
    x: jax.Array,
    buffer: jax.Array,
    w: NMSparseMatrix,
    *,
    implementation: NMImplementation | None = None,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
) -> jax.Array:
  """:func:`nm_matmul` for a 2:4 weight kept only as :func:`to_buffer`'s buffer; ``w`` is ``from_buffer(buffer)``,
  the caller's unpacked view of it (under ``jit``, XLA drops it where no route reads it).

  Where cuSPARSELt here reads the buffer as its own (:func:`buffer_is_cusparselt`), the ``mma.sp`` kernel and
  cuSPARSELt read it as it is and the other routes unpack it inside the route (measured with the unpacking);
  elsewhere the op runs on ``w``. ``CompressedNMLinear(storage="cusparselt")`` calls it.
  """
  if not buffer_is_cusparselt(*w.shape, w.dtype):
    return _call(x, w, implementation, precision, preferred_element_type, None)
  return _call(x, w, implementation, precision, preferred_element_type, buffer, buffer_only=True)


def _call(x, w: NMSparseMatrix, implementation, precision, preferred_element_type, cusparselt_weight,
          buffer_only: bool = False) -> jax.Array:
  x = _utils.check_activations(x, w.shape[0])
  if jnp.issubdtype(w.dtype, jnp.complexfloating):  # not left to name a preferred_element_type nobody passed
    raise TypeError(f"w.values must have a real dtype, got {w.dtype}; for complex weights use "
                    "jaxsparse.ops.masked_matmul (a dense w and its mask: w.to_dense(), w.mask()).")
  impl = _check_implementation(implementation)
  precision = _utils.check_precision(precision)
  out_dtype = _utils.result_dtype(x.dtype, w.dtype, preferred_element_type)
  if impl == "cusparselt":
    reason = cusparselt_unsupported_reason(w, x.dtype)
    if not reason and out_dtype != x.dtype:
      reason = f"the output dtype ({out_dtype}) must be that of x ({x.dtype})"
    if reason:
      raise ValueError(f"implementation='cusparselt' cannot multiply these operands: {reason}.")
  if cusparselt_weight is not None:
    cusparselt_weight = jnp.asarray(cusparselt_weight)
    if cusparselt_weight.dtype != jnp.uint8 or cusparselt_weight.ndim != 1:
      raise TypeError(
          "cusparselt_weight must be the 1-D uint8 array of cusparselt_compress(w), got "
          f"{cusparselt_weight.dtype}{cusparselt_weight.shape}."
      )
  cfg = _Config(impl, precision, out_dtype, buffer_only=buffer_only)
  # Inside shard_map(check_vma=True): operands that vary alike (JAX sums a replicated w's cotangent).
  return _nm_matmul(cfg, *_utils.vary_alike(x, w, cusparselt_weight))
