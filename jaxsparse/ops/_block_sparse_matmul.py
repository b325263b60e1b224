"""``block_sparse_matmul``: ``x @ W`` with a block-sparse ``W``, differentiable in ``x`` and ``W.data``.

One op, three products, five backends (:mod:`jaxsparse.ops._router`, in priority order):

* forward ``y = x @ W`` (dense x sparse),
* ``dX = dY @ Wᵀ`` (dense x sparse-transposed),
* ``dW = (xᵀ dY)`` sampled on the kept blocks only (an SDD product).

The XLA loop (``_Loop``) is both the reference implementation of those three products and the path of other
platforms: it walks the kept blocks in a ``lax.fori_loop`` whose body is one small ``dot_general`` on slabs that
stay in cache, so its work is proportional to the kept blocks and it never materialises a dense
``K x N`` weight or gradient, nor a gathered copy of ``x`` per block (on a 2-core CPU such gathers
cost more than the products themselves; see ``benchmarks/results/``). On CPU, C++ kernels (``_CpuKernel``:
:mod:`jaxsparse._cpu`, XLA FFI custom calls built on first use: register-blocked small GEMMs per kept block on all
cores) run instead when block sizes are multiples of 8 (one call computes both gradients), the loop otherwise or
when the kernels cannot be built; the dense route (``_Dense``) is measured against them on request.

On CUDA devices each of the three products runs on its GPU route (``_GpuRoute``): the Pallas kernels of
``jaxsparse.pallas`` with a tile config, or the dense route, chosen per product signature by measured dispatch
(:mod:`jaxsparse._tuning`: the candidates timed on the first trace, then cached) or, with tuning off, the shipped
default. Blocks the kernels do not take run as their supported sub-blocks (``split_blocks``), as they are on Triton
up to ``WIDE_BLOCK_DIMS``, or on the dense route; never on the XLA loop. The forward of at most 8 rows has one more
candidate on Hopper GPUs (``_CudaDecode``): jaxsparse's CUDA decode kernel (``jaxsparse._cuda._block_sparse_decode``,
16-bit operands, block dims multiples of 64), the shipped default where it runs but for sparse wide blocks
(``_shipped_default``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any
from typing import ClassVar
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsparse import _tuning
from jaxsparse import _utils
from jaxsparse._cpu import _build as _cpu_build
from jaxsparse._cpu import _kernels as _cpu_kernels
from jaxsparse._cuda import _block_sparse_decode as _decode
from jaxsparse._cuda import _kernels as _cuda_kernels
from jaxsparse._utils import FallbackWarning
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._block_sparse import merge_block_data
from jaxsparse.formats._block_sparse import split_blocks
from jaxsparse.ops import _bilinear
from jaxsparse.ops import _router
from jaxsparse.ops import _sharding
from jaxsparse.ops._block_sparse_loop import loop_backward
from jaxsparse.ops._block_sparse_loop import loop_forward
from jaxsparse.pallas._common import PallasFallbackWarning

__all__ = ["block_sparse_matmul", "block_sparse_matmul_reference", "Implementation"]

Implementation = Literal["xla", "pallas"]
Implementation.__doc__ = """The backends of :func:`jaxsparse.ops.block_sparse_matmul`: ``"xla"`` or ``"pallas"``.

A type alias for annotations (``implementation: Implementation | None``, where ``None`` picks one per product);
``"pallas"`` is the GPU route (Pallas kernels or the dense product), ``"xla"`` the block loop (C++ kernels on CPU).

>>> import typing, jaxsparse
>>> typing.get_args(jaxsparse.ops.Implementation)
('xla', 'pallas')
"""
_IMPLEMENTATIONS = (None, "xla", "pallas")


def block_sparse_matmul_reference(
    x: jax.typing.ArrayLike,
    w: BlockSparseMatrix,
    *,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
) -> jax.Array:
  """Dense oracle: ``x @ w.to_dense()``. For tests; it builds the dense ``K x N`` weight.

  >>> import jax.numpy as jnp, jaxsparse
  >>> w = jaxsparse.BlockSparseMatrix.from_dense(jnp.ones((4, 4)), (2, 2),
  ...                                            block_mask=jnp.array([[True, False], [False, True]]))
  >>> jaxsparse.ops.block_sparse_matmul_reference(jnp.ones((1, 4)), w)
  Array([[2., 2., 2., 2.]], dtype=float32)

  Args:
    x: ``(..., K)`` activations.
    w: a :class:`jaxsparse.BlockSparseMatrix` of shape ``(K, N)``.
    precision: passed to ``jnp.matmul``.
    preferred_element_type: output dtype, a floating dtype; defaults to ``result_type(x, w.data)``.

  Returns:
    ``(..., N)`` array of ``preferred_element_type``, equal to :func:`block_sparse_matmul`'s result up to
    rounding.

  Raises:
    TypeError: ``w`` is not a :class:`jaxsparse.BlockSparseMatrix`, or ``x`` is not an array of numbers.
    ValueError: ``x`` is not ``(..., K)`` with ``K = w.shape[0]``.
  """
  return _utils.dense_reference(x, w, kind=BlockSparseMatrix, precision=precision,
                               preferred_element_type=preferred_element_type)


def _wider_than_f32(out_dtype) -> bool:
  """Whether a result of ``out_dtype`` (a float64 one of float32 operands) needs more than the float32 accumulation
  of the kernels: only the XLA block loop and the dense route accumulate in it."""
  return _utils.accumulation_dtype(out_dtype) != jnp.dtype(jnp.float32)


_CPU_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _cpu_kernel_forward(x2, w: BlockSparseMatrix, out_dtype):
  f32 = jnp.float32
  y = _cpu_kernels.block_forward(x2.astype(f32), w.data.astype(f32), w.row_indices, w.col_offsets, w.transpose_order,
                                 w.col_indices, w.row_offsets)
  return y.astype(out_dtype)


def _cpu_kernel_backward(x2, dy2, w: BlockSparseMatrix):
  f32 = jnp.float32
  dx, ddata = _cpu_kernels.block_backward(
      x2.astype(f32), w.data.astype(f32), w.row_offsets, w.col_indices, w.row_indices, dy2.astype(f32)
  )
  return dx.astype(x2.dtype), ddata.astype(w.dtype)


# -------------------------------------------------------------------------------------------------
# Backend choice and the custom VJP.
# -------------------------------------------------------------------------------------------------


_Config = _router.Config


def _pallas_ops():
  """The Pallas kernels module, or ``None`` when it cannot be imported here."""
  return _router.import_kernels("_block_sparse_matmul")


def _kernel_block_shape(kernels, block_shape: tuple[int, int]) -> tuple[int, int] | None:
  """The largest sub-block shape the GPU kernels run that divides ``block_shape`` (itself if supported), or
  ``None`` where no supported dim divides one of its dims (those blocks run on the dense route)."""
  dims = sorted(kernels.SUPPORTED_BLOCK_DIMS, reverse=True)
  sub = tuple(next((d for d in dims if b % d == 0), None) for b in block_shape)
  return None if None in sub else sub


def _signature(x2, w: BlockSparseMatrix, result_dtype, precision) -> dict:
  """The fields of a product's tuning key besides op, direction and device: rows, shapes, density, dtypes."""
  return {
      "rows": _utils.row_bucket(x2.shape[0]),
      "shape": w.shape,
      "block": w.block_shape,
      "density": round(w.nnz_blocks / max(1, math.prod(w.grid_shape)) * 50) / 50,
      "dtypes": (str(x2.dtype), str(w.dtype), str(jnp.dtype(result_dtype))),
      "precision": precision,
  }


def _random_weight(w: BlockSparseMatrix, seed: int = 0) -> BlockSparseMatrix:
  """A random matrix with the shape, block shape, block count and dtype of ``w`` (for timing its products)."""
  rng = np.random.default_rng(seed)
  kb, nb = w.grid_shape
  mask = np.zeros(kb * nb, bool)
  mask[rng.choice(kb * nb, w.nnz_blocks, replace=False)] = True
  return BlockSparseMatrix.from_block_mask(mask.reshape(kb, nb), _tuning.random_operand(w.data.shape, w.dtype, seed))


def _gpu_routes(kernels, direction: str, x2, w: BlockSparseMatrix, *, precision, out_dtype):
  """``[(name, (sub, config))]`` for one direction of ``x2 @ w`` on the GPU, the shipped default first.

  ``sub`` is the block shape the kernels run ``w`` as (``split_blocks``), or ``None`` for ``w`` as it is: blocks the
  kernels take run as they are; multiples of those run as their sub-blocks (the default), or, up to
  ``WIDE_BLOCK_DIMS``, as they are on the Triton kernels (names ``"native:..."``); other blocks, and results wider
  than the kernels' float32 accumulation (``preferred_element_type=float64``), on the dense route.
  """
  sub = _kernel_block_shape(kernels, w.block_shape)
  if sub is None or w.nnz_blocks == 0 or _wider_than_f32(out_dtype):
    return [("dense", (None, None))]
  same = sub == w.block_shape
  routes = [
      (name, (None, None)) if name == "dense" else (name if same else f"split:{name}", (None if same else sub, cfg))
      for name, cfg in kernels.candidates(direction, x2, split_blocks(w, sub), out_dtype=out_dtype, precision=precision)
  ]
  wide = kernels.SUPPORTED_BLOCK_DIMS + kernels.WIDE_BLOCK_DIMS
  if not same and set(w.block_shape) <= set(wide):
    # Wide blocks as they are (no per-call copy into sub-blocks) won most cases measured (H100, 2026-11-26:
    # benchmarks/results/gpu_unseen_shapes_2026-11-26_h100_tuned.md); of the sub-block routes, the default, the
    # dense route and the first of each kernel family (Triton, Mosaic GPU) are kept, to bound the tuning time.
    native = kernels.candidates(direction, x2, w, out_dtype=out_dtype, precision=precision)
    native = [(f"native:{name}", (None, cfg)) for name, cfg in native if name != "dense"]
    families, kept = set(), []
    for name, route in routes:
      family = name.removeprefix("split:").split("/")[0]
      if family not in families:
        families.add(family)
        kept.append((name, route))
    # The default: as they are for decode-size forward / dX products, where the copy into sub-blocks costs as much
    # as the product (H100: 256 x 128 bf16 at M = 2, 0.60 of dense against 2.33; 256 x 256 float32 at M = 48,
    # 0.50 / 0.85 against 1.62 / 2.86); sub-blocks elsewhere.
    native_first = x2.shape[0] <= 64 and direction != "dw"
    routes = native + kept if native_first else kept + native
  return routes


def _gpu_run(kernels, direction: str, route, *, precision, out_dtype):
  """``(operands) -> result`` of one direction on one route of :func:`_gpu_routes`."""
  sub, cfg = route

  def weight(b):
    return b if sub is None else split_blocks(b, sub)

  if cfg is None:  # the dense route (any block shape)
    if direction == "fwd":
      return lambda a, b: kernels.dense_forward(a, b, precision=precision, out_dtype=out_dtype)
    if direction == "dx":
      return lambda a, dy, b: kernels.dense_dx(dy, b, precision=precision, out_dtype=a.dtype)
    compute = lambda *v: jnp.result_type(*(u.dtype for u in v))
    return lambda a, dy, b: kernels.dw_dense_then_gather(
        a.astype(compute(a, dy, b)), dy.astype(compute(a, dy, b)), b, precision=precision
    )
  if direction == "fwd":
    return lambda a, b: kernels.forward(a, weight(b), precision=precision, out_dtype=out_dtype, config=cfg)
  if direction == "dx":
    return lambda a, dy, b: kernels.backward(a, dy, weight(b), precision=precision, config=cfg, need_dw=False)[0]

  def dw(a, dy, b):
    ddata = kernels.backward(a, dy, weight(b), precision=precision, config=cfg, need_dx=False)[1]
    return ddata if sub is None else merge_block_data(ddata, b, sub)

  return dw


def _product(direction: str, args: tuple, result_dtype, precision) -> _router.Product:
  """One direction as the router sees it: ``args`` are ``(x2, w)`` for ``"fwd"``, ``(x2, dy2, w)`` otherwise."""
  x2, w = args[0], args[-1]
  m, (k, n) = x2.shape[0], w.shape
  dy_dtype = args[1].dtype if direction != "fwd" else None

  def make_args():
    a, wr = _tuning.random_operand((m, k), x2.dtype, 1), _random_weight(w)
    return (a, wr) if direction == "fwd" else (a, _tuning.random_operand((m, n), dy_dtype, 2), wr)

  fields = _signature(x2, w, result_dtype, precision)
  dense = {  # a dense layer's product of this direction
      "fwd": _tuning.DenseProduct((m, k), (k, n), (x2.dtype, w.dtype)),
      "dx": _tuning.DenseProduct((m, n), (n, k), (dy_dtype, w.dtype)),
      "dw": _tuning.DenseProduct((k, m), (m, n), (x2.dtype, dy_dtype)),
  }[direction]
  return _router.Product("block_sparse_matmul", direction, tuple(args), fields, make_args, dense)


@dataclasses.dataclass(frozen=True)
class _GpuRoute:
  """CUDA GPUs: the Pallas kernels (Triton, Mosaic GPU) with their tile configs, on the blocks as they are or
  re-tiled into sub-blocks, and the dense route (:func:`_gpu_routes`)."""

  precision: Any
  out_dtype: Any  # the forward's
  name: ClassVar[str] = "pallas"
  title: ClassVar[str] = "the Pallas GPU kernels"
  platforms: ClassVar[tuple[str, ...]] = ("cuda",)
  fallback_warning: ClassVar[type[Warning]] = PallasFallbackWarning

  def unsupported_reason(self, p: _router.Product) -> _router.Unsupported | None:
    kernels = _pallas_ops()
    if kernels is None:
      return _router.Unsupported("jaxsparse.pallas could not be imported")
    # The kernels' checks, except that any block shape runs (blocks the kernels do not take are cut into ones
    # they do, or run on the dense route).
    w = p.args[-1]
    block_dims = tuple(w.block_shape) if isinstance(w, BlockSparseMatrix) else ()
    reason = kernels.unsupported_reason(*p.args, block_dims=block_dims)
    return None if reason is None else _router.Unsupported(reason, warn=True)

  def candidates(self, p: _router.Product) -> list[_tuning.Candidate]:
    kernels, x2, w = _pallas_ops(), p.args[0], p.args[-1]
    out_dtype = self.out_dtype if p.direction == "fwd" else x2.dtype
    routes = _gpu_routes(kernels, p.direction, x2, w, precision=self.precision, out_dtype=out_dtype)
    run = functools.partial(_gpu_run, kernels, p.direction, precision=self.precision, out_dtype=out_dtype)
    return [_tuning.Candidate(name, _cast(run(r), p.direction, x2, w, out_dtype), r, always_timed=r[1] is None)
            for name, r in routes]


@dataclasses.dataclass(frozen=True)
class _CudaDecode:
  """CUDA (Hopper): our decode kernel (``jaxsparse/_cuda/block_sparse_decode.cu``): the forward product of at most
  8 rows, 16-bit operands, block dims multiples of 64 up to 256; its default config as ``cuda_decode``, the others
  as ``cuda_decode/<config name>``."""

  out_dtype: Any
  name: ClassVar[str] = "cuda_decode"
  title: ClassVar[str] = "jaxsparse's CUDA decode kernel"
  platforms: ClassVar[tuple[str, ...]] = ("cuda",)
  fallback_warning: ClassVar[type[Warning]] = _cuda_kernels.CudaKernelFallbackWarning

  def _shape(self, p: _router.Product) -> tuple:
    x2, w = p.args[0], p.args[-1]
    return (x2.shape[0], *w.shape, w.block_shape, w.nnz_blocks)

  def unsupported_reason(self, p: _router.Product) -> _router.Unsupported | None:
    x2, w = p.args[0], p.args[-1]
    if p.direction != "fwd":
      return _router.Unsupported("it runs the forward product only")
    if x2.dtype != w.dtype:
      return _router.Unsupported(f"x and w must share a dtype, got {x2.dtype} and {w.dtype}")
    reason = _decode.block_sparse_decode_unsupported_reason(*self._shape(p)[:4], x2.dtype, self.out_dtype)
    if not reason:
      reason = _cuda_kernels.unavailable_reason()
      if not reason:  # builds the default kernel (once per shape class): a GPU that fails to build it says so
        reason = _decode.block_sparse_decode_prepare(*self._shape(p), x2.dtype, self.out_dtype)
        return _router.Unsupported(reason, warn=True) if reason else None
    return _router.Unsupported(reason) if reason else None

  def candidates(self, p: _router.Product) -> list[_tuning.Candidate]:
    x2 = p.args[0]
    configs = _decode.block_sparse_decode_candidates(*self._shape(p))
    return [
        _tuning.Candidate(self.name if i == 0 else f"{self.name}/{c.name}",
                          functools.partial(_cuda_decode_run, c, self.out_dtype), c,
                          prepare=functools.partial(_decode.block_sparse_decode_prepare, *self._shape(p), x2.dtype,
                                                    self.out_dtype, c))
        for i, c in enumerate(configs)
    ]


def _cuda_decode_run(config, out_dtype, x2, w: BlockSparseMatrix) -> jax.Array:
  return _decode.block_sparse_decode(x2, w.data, w.col_offsets, w.transpose_order, w.row_indices, w.shape[1],
                                     config=config, out_dtype=out_dtype)


@dataclasses.dataclass(frozen=True)
class _CpuKernel:
  """CPU: the C++ kernels of :mod:`jaxsparse._cpu` (block dims multiples of 8; float32 / bfloat16 / float16)."""

  out_dtype: Any
  name: ClassVar[str] = "cpu_kernel"
  title: ClassVar[str] = "the C++ CPU kernels"
  platforms: ClassVar[tuple[str, ...]] = ("cpu",)
  fallback_warning: ClassVar[type[Warning]] = _cpu_build.CpuKernelFallbackWarning

  def unsupported_reason(self, p: _router.Product) -> _router.Unsupported | None:
    w = p.args[-1]
    if jax.default_backend() != "cpu":
      return _router.Unsupported("the default backend is not the CPU")
    if w.block_shape[0] % 8 or w.block_shape[1] % 8:
      return _router.Unsupported(f"block dims must be multiples of 8, got {w.block_shape}")
    if any(jnp.dtype(a.dtype) not in _CPU_KERNEL_DTYPES for a in (*p.args[:-1], w.data)):
      return _router.Unsupported(f"dtypes must be among {[str(d) for d in _CPU_KERNEL_DTYPES]}")
    if _wider_than_f32(self.out_dtype):
      return _router.Unsupported(f"they accumulate in float32, not in the requested {jnp.dtype(self.out_dtype)}")
    if not _cpu_build.load():
      return _router.Unsupported(f"unavailable: {_cpu_build.unavailable_reason().splitlines()[0]}", warn=True)
    return None

  def candidates(self, p: _router.Product) -> list[_tuning.Candidate]:
    if p.direction == "fwd":
      return [_tuning.Candidate(self.name, lambda a, b: _cpu_kernel_forward(a, b, self.out_dtype))]
    i = ("dx", "dw").index(p.direction)
    # dX and dW come from one kernel call when both directions choose it.
    return [_tuning.Candidate(self.name, lambda a, dy, b: _cpu_kernel_backward(a, dy, b)[i],
                              _router.Joint(_cpu_kernel_backward, i))]


@dataclasses.dataclass(frozen=True)
class _Loop:
  """Every platform: the XLA loop over the kept blocks (the reference of the kernels' products)."""

  precision: Any
  out_dtype: Any
  name: ClassVar[str] = "loop"
  title: ClassVar[str] = "the XLA block loop"
  platforms: ClassVar[tuple[str, ...]] = ("cpu", "default")
  fallback_warning: ClassVar[type[Warning]] = FallbackWarning
  takes_symbolic_rows: ClassVar[bool] = True

  def unsupported_reason(self, p: _router.Product) -> None:
    return None

  def candidates(self, p: _router.Product) -> list[_tuning.Candidate]:
    prec = self.precision
    run = {
        "fwd": lambda a, b: loop_forward(a, b, precision=prec, out_dtype=self.out_dtype),
        "dx": lambda a, dy, b: loop_backward(a, dy, b, precision=prec, need_dw=False)[0],
        "dw": lambda a, dy, b: loop_backward(a, dy, b, precision=prec, need_dx=False)[1],
    }[p.direction]
    joint = _checked(lambda a, dy, b: loop_backward(a, dy, b, precision=prec))
    value = None if p.direction == "fwd" else _router.Joint(joint, ("dx", "dw").index(p.direction))
    return [_tuning.Candidate(self.name, _checked(run), value)]


@dataclasses.dataclass(frozen=True)
class _Dense:
  """CPU: the dense route (the weight built dense, one XLA product), measured against the others on request."""

  precision: Any
  out_dtype: Any
  name: ClassVar[str] = "dense"
  title: ClassVar[str] = "the dense product"
  platforms: ClassVar[tuple[str, ...]] = ("cpu",)
  fallback_warning: ClassVar[type[Warning]] = FallbackWarning

  def unsupported_reason(self, p: _router.Product) -> _router.Unsupported | None:
    return _router.Unsupported("jaxsparse.pallas could not be imported") if _pallas_ops() is None else None

  def candidates(self, p: _router.Product) -> list[_tuning.Candidate]:
    x2, w = p.args[0], p.args[-1]
    out_dtype = self.out_dtype if p.direction == "fwd" else x2.dtype
    run = _gpu_run(_pallas_ops(), p.direction, (None, None), precision=self.precision, out_dtype=out_dtype)
    return [_tuning.Candidate(self.name, _checked(_cast(run, p.direction, x2, w, out_dtype)), always_timed=True)]


def _checked(run: Callable) -> Callable:
  """``run(*args)`` with its outputs all NaN where the index arrays of the weight (``args[-1]``) fail
  :meth:`BlockSparseMatrix.validate`'s value checks, as :meth:`BlockSparseMatrix.to_dense` gives them.

  For the CPU's XLA routes (the dense route, the block loop), which read index arrays as they are: a hand-built or
  restored matrix's bad index gave finite wrong products there, while the C++ kernels raise, so which one a user got
  hung on a timing. O(blocks + block rows + block columns) compares and one multiply over the outputs; matrices a
  constructor checked are not checked again.
  """

  def checked(*args):
    return jax.tree.map(args[-1]._nan_unless_valid, run(*args))

  return checked


def _cast(run: Callable, direction: str, x2, w, out_dtype) -> Callable:
  """``run`` with its result in the op's dtype for ``direction`` (every platform's branch must agree)."""
  dtype = {"fwd": out_dtype, "dx": x2.dtype, "dw": w.dtype}[direction]
  return lambda *a: run(*a).astype(dtype)


# ``implementation=`` -> the backends it allows, in priority order.
_BACKENDS = {
    "auto": ("cuda_decode", "pallas", "cpu_kernel", "loop", "dense"),
    "pallas": ("pallas",),
    "xla": ("cpu_kernel", "loop"),
}


def _shipped_default(p: _router.Product, cands: list[_tuning.Candidate]) -> str:
  """The forward's route with tuning off: the CUDA decode kernel where it may run, but on blocks of 128 columns and
  more below density 0.25, where the Pallas default took 0.80-0.81 of its time on an H200 (4096 x 4096, 128-blocks
  at d = 0.2, 1 and 8 rows; elsewhere the kernel's default took 0.82-1.03 of the Pallas default's at 38 products of
  1-8 rows: ``benchmarks/results/llm_decode_block_decode_2026-12-02_h200.md``); the first candidate otherwise."""
  w = p.args[-1]
  names = [c.name for c in cands]
  sparse_wide = w.block_shape[1] >= 128 and w.nnz_blocks < 0.25 * math.prod(w.grid_shape)
  if "cuda_decode" in names and sparse_wide:
    return next((n for n in names if not n.startswith("cuda_decode")), names[0])
  return names[0]


def _backends(cfg: _Config, out_dtype) -> list[_router.Backend]:
  every = {
      "cuda_decode": _CudaDecode(out_dtype),
      "pallas": _GpuRoute(cfg.precision, out_dtype),
      "cpu_kernel": _CpuKernel(out_dtype),
      "loop": _Loop(cfg.precision, out_dtype),
      "dense": _Dense(cfg.precision, out_dtype),
  }
  return [every[name] for name in _BACKENDS[cfg.implementation]]


def _forward(cfg: _Config, x, w):
  def fwd(x2, b):
    if x2.shape[0] == 0:  # no rows (vmap over an empty batch gets here): nothing to multiply, no kernel tiles them
      return (jnp.zeros((0, b.shape[1]), cfg.out_dtype),)
    # The kernels write the output dtype themselves: a float32 result of 16-bit inputs is never rounded.
    product = _product("fwd", (x2, b), cfg.out_dtype, cfg.precision)
    if cfg.in_step:  # a train step's forward: its routes may be timed with the step's dX and dW
      product = dataclasses.replace(product, in_step=_router.InStep(
          functools.partial(_in_step, cfg), _weight_work, functools.partial(_backward_work, cfg, x2, b)))
    return _router.route([product], _backends(cfg, cfg.out_dtype), default=_shipped_default)

  # Data parallel: each device multiplies its rows of x (ops/_sharding.py).
  return _sharding.row_parallel(fwd, (x,), w)[0]


def _route_backward(cfg: _Config, x2, dy2, b):
  """``(dX, dW)`` of rows ``x2 (M, K)`` and ``dy2 (M, N)``, each on its route."""
  if x2.shape[0] == 0:  # no rows: no gradient flows
    return jnp.zeros(x2.shape, x2.dtype), jnp.zeros(b.data.shape, b.dtype)
  products = [_product(d, (x2, dy2, b), dy2.dtype, cfg.precision) for d in ("dx", "dw")]
  return _router.route(products, _backends(cfg, x2.dtype))


def _backward(cfg: _Config, x, dy, w):
  # Data parallel: dX keeps the rows' sharding, dW is summed over the row shards.
  bwd = functools.partial(_route_backward, cfg)
  return _sharding.row_parallel(bwd, (x, dy), w, summed=(1,), like={0: x, 1: w.data})


def _weight_work(name: str) -> str:
  """The per-call work on the weight of a route (by its name in :func:`_gpu_routes` and the CPU backends) that the
  routes of other directions may share: ``"split"`` (a copy of the kept blocks into sub-blocks), ``"dense"`` (the
  dense weight; ``dW``'s dense route builds none, but ``dX``'s does), ``""`` (none)."""
  return "split" if name.startswith("split:") else "dense" if name == "dense" else ""


def _backward_work(cfg: _Config, x2, b: BlockSparseMatrix, platform: str) -> set[str]:
  """The :func:`_weight_work` of the routes a train step's ``dX`` and ``dW`` of ``x2 @ b`` take on ``platform``,
  chosen now (measured where tuning may) as the backward pass will choose them."""
  spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  bwd_cfg = dataclasses.replace(cfg, in_step=False)
  dy = jax.ShapeDtypeStruct((x2.shape[0], b.shape[1]), cfg.out_dtype)
  x2, b = spec(x2), jax.tree.map(spec, b)
  jax.eval_shape(functools.partial(_route_backward, bwd_cfg), x2, dy, b)
  work = set()
  for d in ("dx", "dw"):
    product = _product(d, (x2, dy, b), dy.dtype, cfg.precision)
    choice, _ = _tuning.recorded_decision(product.op, d, platform, product.fields)
    work.add(_weight_work(choice or ""))
  return work


def _in_step(cfg: _Config, run: Callable) -> Callable:
  """``run`` (a forward route) as a train step runs it: its product, then ``dX`` and ``dW`` of the cotangent
  ``dY = y`` on the backward's routes. What tuning times a differentiated forward's routes on: in one jitted step XLA
  does the per-call work on the weight that routes share (a copy into sub-blocks, the dense weight) once."""
  bwd_cfg = dataclasses.replace(cfg, in_step=False)

  def step(x2, b):
    y = run(x2, b)
    return y, _route_backward(bwd_cfg, x2, y, b)

  return step


# The custom VJP, differentiable again (grad of grad) on the same kernels; the index leaves get no cotangent.
_block_sparse_matmul = _bilinear.bilinear_product(
    _forward, _backward, in_step=lambda cfg: dataclasses.replace(cfg, in_step=True))


def _check_implementation(implementation) -> str:
  kernels = _pallas_ops() if implementation == "pallas" else None
  return _router.check_implementation(implementation, _IMPLEMENTATIONS, kernels)


def block_sparse_matmul(
    x: jax.typing.ArrayLike,
    w: BlockSparseMatrix,
    *,
    implementation: Implementation | None = None,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
) -> jax.Array:
  """Computes ``x @ w`` for a block-sparse ``w``, with a sparse backward pass.

  Equal to ``x @ w.to_dense()`` but neither the forward nor the backward builds the dense ``K x N``
  weight or its gradient: ``dX = dY @ Wᵀ`` runs on the sparse pattern and ``dW`` is ``xᵀ dY``
  evaluated on the kept blocks only. Differentiable with respect to ``x`` and ``w.data``; works under
  ``jit``, ``vmap`` and ``grad``, to any order in reverse mode (``grad`` of ``grad``: every derivative runs on
  the same kernels); forward mode (``jvp``, ``jax.hessian``) is not supported: use ``jax.jacrev`` twice. Under
  ``jax.sharding`` each device multiplies its rows of ``x``; inside ``jax.shard_map`` (``check_vma`` on or off) the
  product runs on each device's operands, a replicated ``w`` cast to vary as ``x`` does with ``check_vma=True``, so
  its gradient is summed over the map's axes as for ``x @ w``.

  Non-finite values: NaN / inf in ``w.data``, and in ``x`` where it meets a kept block (even a zero stored in one),
  propagate on every route. The blocks that are not kept meet ``x`` as zeros (``inf * 0`` making NaN, as in
  ``x @ w.to_dense()``) only on the dense route (on CUDA GPUs when tuning picks it, or for block shapes the
  kernels do not take; on CPU only when measured fastest on request); the C++ kernels, the XLA block loop and the
  Pallas kernels skip them, so NaN in the part of ``x`` that meets no kept block can give finite outputs. Test
  ``x`` with ``jnp.isfinite`` where NaN detection matters.

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> k1, k2 = jax.random.split(jax.random.key(0))
  >>> w = jaxsparse.BlockSparseMatrix.from_dense(
  ...     jax.random.normal(k1, (64, 128)), (32, 32),
  ...     block_mask=jaxsparse.random_block_mask(k2, (64, 128), (32, 32), 0.5))
  >>> x = jnp.ones((2, 3, 64))
  >>> jaxsparse.ops.block_sparse_matmul(x, w).shape
  (2, 3, 128)

  Args:
    x: ``(..., K)`` activations.
    w: a :class:`jaxsparse.BlockSparseMatrix` of shape ``(K, N)``.
    implementation: ``None`` picks the best backend for the platform at lowering time (on CUDA GPUs the
      route measured fastest for this product, among the Pallas kernels, the dense product and, for the forward
      of up to 8 rows of 16-bit operands in blocks whose dims are multiples of 64, jaxsparse's CUDA decode kernel: see
      :func:`jaxsparse.set_autotune_mode`; the XLA path elsewhere); ``"xla"`` or ``"pallas"`` force one (the
      latter: the GPU route), and a forced backend that cannot run raises.
    precision: passed to the underlying ``dot_general`` calls.
    preferred_element_type: output dtype, a floating dtype; defaults to ``result_type(x, w.data)``. Products
      accumulate in at least float32, and in ``preferred_element_type`` where it is wider (``float64``), as
      ``x @ w.to_dense()`` does.

  Returns:
    ``(..., N)`` array.

  Raises:
    TypeError: ``preferred_element_type`` is not a floating dtype or ``None``;
      ``w`` is not a :class:`jaxsparse.BlockSparseMatrix`; ``x`` does not have a floating dtype;
      float operands of two dtypes where one is an 8-bit float (``float8_e4m3fn``, ``float8_e5m2``)
      without ``preferred_element_type`` (cast one, or pass it, as ``jnp.matmul`` wants; float8 operands of one
      dtype multiply as in ``jnp.matmul``, in float32).
    ValueError: ``x`` is not ``(..., K)`` with ``K = w.shape[0]``, or ``K == 0``; ``w.data`` or an index array
      has the wrong shape or dtype (e.g. a matrix rebuilt with ``tree_unflatten``); an unknown
      ``implementation``; a ``precision`` ``lax.dot_general`` does not take.
    RuntimeError: ``implementation="pallas"`` where the Pallas kernels cannot run (no CUDA GPU, as on a CPU),
      or for operands no GPU route takes.
  """
  _utils.check_weight_type(w, BlockSparseMatrix)
  w._check_static()  # index arrays' shapes and dtypes, also of a matrix from tree_unflatten (no constructor)
  x = _utils.check_activations(x, w.shape[0])
  impl = _check_implementation(implementation)
  precision = _utils.check_precision(precision)
  out_dtype = _utils.result_dtype(x.dtype, w.dtype, preferred_element_type)
  if math.prod(x.shape[:-1]) == 0:  # no rows (an empty batch): nothing to multiply, and no kernel tiles zero rows
    return jnp.zeros((*x.shape[:-1], w.shape[1]), out_dtype)
  cfg = _Config(impl, precision, out_dtype)
  return _block_sparse_matmul(cfg, x, w)
