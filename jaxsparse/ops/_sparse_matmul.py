"""``sparse_matmul``: ``x @ W`` with an unstructured sparse ``W`` (:class:`jaxsparse.CSRMatrix`).

One op, three products, two backends:

* forward ``y = x @ W``; ``dX = dY @ Wᵀ``; ``dW = (xᵀ dY)`` at the stored entries only.
* ``"cpu"``: C++ kernels (XLA FFI custom calls, built on first use by :mod:`jaxsparse._cpu`) whose
  work is proportional to the nonzeros, on both cores: per nonzero, an axpy of a 64-wide batch
  tile held in registers. Chosen by default on CPU, except that patterns denser than
  ``CPU_DENSE_FORWARD_MIN_DENSITY`` (``CPU_DENSE_BACKWARD_MIN_DENSITY`` for the backward) run on the
  dense route: a C++ kernel writes the entries into a dense weight, XLA multiplies, and ``dW`` is taken at the
  entries by another kernel. Forwards of at most 8 rows (a decode step) stream the entries once in row order at
  every density, on either choice.
* ``"xla"``: ``x @ W.to_dense()`` with autodiff. It builds the dense ``K x N`` weight, which on
  accelerators (and on CPU without a C++ compiler) is still the fastest XLA formulation: gather /
  segment-sum versions measured 5-10x slower than dense on CPU.

The helpers below the op also serve :func:`jaxsparse.ops.masked_matmul`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import ClassVar
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsparse import _tuning
from jaxsparse import _utils
from jaxsparse._cpu import _build
from jaxsparse._cpu import _kernels
from jaxsparse.formats._csr import CSRMatrix
from jaxsparse.ops import _bilinear
from jaxsparse.ops import _router
from jaxsparse.ops import _sharding

__all__ = [
    "CPU_DENSE_BACKWARD_MIN_DENSITY",
    "CPU_DENSE_FORWARD_MIN_DENSITY",
    "CpuImplementation",
    "sparse_matmul",
    "sparse_matmul_reference",
]

CpuImplementation = Literal["xla", "cpu"]
CpuImplementation.__doc__ = """The backends of :func:`jaxsparse.ops.sparse_matmul` and of ``masked_matmul``.

A type alias for annotations: ``"cpu"`` runs the C++ CPU kernels, ``"xla"`` the dense XLA path; ``None`` picks
``"cpu"`` when the default backend is the CPU.

>>> import typing, jaxsparse
>>> typing.get_args(jaxsparse.ops.CpuImplementation)
('xla', 'cpu')
"""
_IMPLEMENTATIONS = (None, "xla", "cpu")
# The C++ kernels compute in float32; these input dtypes are converted to it and back.
_CPU_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def sparse_matmul_reference(
    x: jax.typing.ArrayLike,
    w: CSRMatrix,
    *,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
) -> jax.Array:
  """Dense oracle and XLA path: ``x @ w.to_dense()``. It builds the dense ``K x N`` weight.

  >>> import jax.numpy as jnp, jaxsparse
  >>> w = jaxsparse.CSRMatrix.from_dense(jnp.array([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]]))
  >>> w.nnz
  3
  >>> jaxsparse.ops.sparse_matmul_reference(jnp.ones((1, 3)), w)
  Array([[4., 2.]], dtype=float32)

  Args:
    x: ``(..., K)`` activations.
    w: a :class:`jaxsparse.CSRMatrix` of shape ``(K, N)``.
    precision: passed to ``jnp.matmul``.
    preferred_element_type: output dtype, a floating dtype; defaults to ``result_type(x, w.data)``.

  Returns:
    ``(..., N)`` array of ``preferred_element_type``, equal to :func:`sparse_matmul`'s result up to rounding.

  Raises:
    TypeError: ``w`` is not a :class:`jaxsparse.CSRMatrix`, or ``x`` is not an array of numbers.
    ValueError: ``x`` is not ``(..., K)`` with ``K = w.shape[0]``.
  """
  return _utils.dense_reference(x, w, kind=CSRMatrix, precision=precision,
                               preferred_element_type=preferred_element_type)


# -------------------------------------------------------------------------------------------------
# Choosing the backend (shared with masked_matmul).
# -------------------------------------------------------------------------------------------------


def check_cpu_implementation(implementation: object, *, op: str) -> str:
  """``implementation`` checked: ``"auto"`` for ``None``, else ``"xla"`` or ``"cpu"`` (which must be able to run)."""
  if implementation not in _IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {_IMPLEMENTATIONS}, got implementation={implementation!r}.")
  if implementation == "cpu" and not _build.load():
    raise RuntimeError(f"{op}: implementation='cpu' was requested but cannot run: {_build.unavailable_reason()}")
  return implementation or "auto"


@dataclasses.dataclass(frozen=True)
class CpuKernels:
  """CPU: the op's C++ kernels, as one differentiable candidate ``run(x, w)`` (its own custom VJP); a backend of
  :mod:`jaxsparse.ops._router` shared by ``sparse_matmul`` and ``masked_matmul``."""

  run: Callable[..., jax.Array]
  forced: bool = False
  name: ClassVar[str] = "cpu_kernel"
  title: ClassVar[str] = "the C++ CPU kernels"
  platforms: ClassVar[tuple[str, ...]] = ("cpu",)
  fallback_warning: ClassVar[type[Warning]] = _build.CpuKernelFallbackWarning

  def unsupported_reason(self, p: _router.Product) -> _router.Unsupported | None:
    if not self.forced and jax.default_backend() != "cpu":
      return _router.Unsupported("the default backend is not the CPU")
    if not cpu_supports(*p.fields["dtypes"]):
      return _router.Unsupported(f"the kernels take float32, bfloat16 and float16, got {p.fields['dtypes']}")
    if not _build.load():
      return _router.Unsupported(f"unavailable: {_build.unavailable_reason().splitlines()[0]}", warn=True)
    return None

  def candidates(self, p: _router.Product) -> list[_tuning.Candidate]:
    return [_tuning.Candidate(self.name, self.run, measure=_tuning.train_step(self.run))]


def route(op: str, implementation: str, x: jax.Array, w, cpu_run, xla_run, make_w) -> jax.Array:
  """Runs ``op`` on the C++ kernels (``cpu_run``) or the XLA path (``xla_run``, every platform: plain autodiff, the
  dense weight built in the call), each ``(x, w) -> y``: by ``implementation``, or per platform, measured
  (:mod:`jaxsparse._tuning`) on request on CPU."""
  xla = _router.Reference("xla", "the XLA path", xla_run, measure=_tuning.train_step(xla_run))
  backends = {
      "auto": [CpuKernels(cpu_run), xla],
      "cpu": [CpuKernels(cpu_run, forced=True)],
      "xla": [xla],
  }[implementation]
  leaves = [leaf for leaf in jax.tree_util.tree_leaves(w) if jnp.issubdtype(leaf.dtype, jnp.inexact)]

  def make_args():
    return _tuning.random_operand(x.shape, x.dtype, 1), make_w(np.random.default_rng(1))

  fields = {
      "rows": _utils.row_bucket(math.prod(x.shape[:-1])),
      "shape": tuple(jax.tree_util.tree_leaves(w)[0].shape) if not isinstance(w, CSRMatrix) else w.shape,
      "density": round(_density(w) * 50) / 50,
      "dtypes": (str(x.dtype), *(str(leaf.dtype) for leaf in leaves)),
  }
  dense = _tuning.DenseProduct(x.shape, fields["shape"], (x.dtype, leaves[0].dtype if leaves else x.dtype), step=True)
  return _router.route([_router.Product(op, "step", (x, w), fields, make_args, dense)], backends)[0]


def _density(w) -> float:
  if isinstance(w, CSRMatrix):
    return w.density
  return 0.0  # a traced mask has no static density: one decision for all


def cpu_supports(*dtypes) -> bool:
  return all(jnp.dtype(d) in _CPU_DTYPES for d in dtypes)


def check_cpu_output(implementation: str, out_dtype: np.dtype) -> str:
  """``implementation`` (checked) for a result of ``out_dtype``: the C++ kernels accumulate in float32, so a wider
  result (``preferred_element_type=float64`` of float32 operands) runs on the XLA path by default, which accumulates
  in it as ``jnp.matmul`` does, and ``"cpu"`` refuses it (the kernels' float32 sums cast to float64 were silently
  float32-accurate)."""
  if _utils.accumulation_dtype(jax.dtypes.canonicalize_dtype(out_dtype)) == jnp.float32:
    return implementation
  if implementation == "cpu":
    raise TypeError(
        f"implementation='cpu' accumulates in float32 and cannot give a {jnp.dtype(out_dtype)} result, got "
        f"preferred_element_type={jnp.dtype(out_dtype)}; use implementation=None or 'xla' (the XLA path accumulates "
        "in it), or a float32 or narrower preferred_element_type."
    )
  return "xla"


def f32(a: jax.Array) -> jax.Array:
  return a.astype(jnp.float32)


# -------------------------------------------------------------------------------------------------
# The custom VJP over the C++ kernels.
# -------------------------------------------------------------------------------------------------


# Above these fractions of stored entries the default (implementation=None) runs a direction on the dense route:
# the entries written into a dense weight by a C++ kernel, then XLA's matmuls, which beat the sparse kernels
# there (2-core CPU, random shapes: benchmarks/results/cpu_random_shapes_2026-11-26.md). (A packed GEMM adding the
# entries into its packed weight, as masked_matmul's forward does with its mask, took 1.15-1.66x dense at 36-50%
# density against 0.96-1.44x for this route: benchmarks/results/cpu_random_shapes_2026-11-29.md.)
CPU_DENSE_FORWARD_MIN_DENSITY = 0.3
CPU_DENSE_BACKWARD_MIN_DENSITY = 0.3


@dataclasses.dataclass(frozen=True)
class _Config:
  out_dtype: jnp.dtype
  precision: lax.PrecisionLike = None
  dense_forward: bool = False  # the dense route (see CPU_DENSE_FORWARD_MIN_DENSITY)
  dense_backward: bool = False


def _dense_weight(w: CSRMatrix) -> jax.Array:
  return _kernels.csr_to_dense(f32(w.data), w.row_offsets, w.col_indices, w.shape[1]).astype(w.dtype)


def _csr_forward(cfg: _Config, x: jax.Array, w: CSRMatrix) -> jax.Array:
  def fwd(x2, b):
    if x2.shape[0] <= _kernels.FEW_ROWS:  # a decode step: at every density (cpu_random_shapes_2026-11-29.md)
      y = _kernels.csr_few_rows_forward(f32(x2), f32(b.data), b.row_offsets, b.col_indices, b.shape[1])
      return (y.astype(cfg.out_dtype),)
    if cfg.dense_forward:
      return (jnp.matmul(x2, _dense_weight(b), precision=cfg.precision, preferred_element_type=cfg.out_dtype),)
    y = _kernels.csr_forward(f32(x2), f32(b.data), b.col_offsets, b.transpose_order, b.transpose_row_indices)
    return (y.astype(cfg.out_dtype),)

  # Data parallel: each device multiplies its rows of x (ops/_sharding.py).
  return _sharding.row_parallel(fwd, (x,), w)[0]


def _csr_backward(cfg: _Config, x: jax.Array, dy: jax.Array, w: CSRMatrix) -> tuple[jax.Array, jax.Array]:
  def bwd(x2, dy2, b):
    if not cfg.dense_backward:
      return _kernels.csr_backward(f32(x2), f32(b.data), b.row_offsets, b.col_indices, f32(dy2))
    acc = _utils.accumulation_dtype(x2.dtype, dy2.dtype, b.dtype)
    dx = jnp.matmul(dy2, _dense_weight(b).T, precision=cfg.precision, preferred_element_type=acc)
    dw = jnp.matmul(x2.T, dy2, precision=cfg.precision, preferred_element_type=acc)
    return dx, _kernels.csr_take(f32(dw), b.row_offsets, b.col_indices)

  # Data parallel: dX keeps the rows' sharding, dW is summed over the row shards.
  dx, ddata = _sharding.row_parallel(bwd, (x, dy), w, summed=(1,), like={0: x, 1: w.data})
  return dx.astype(x.dtype), ddata.astype(w.dtype)


# The custom VJP over the kernels, differentiable again (grad of grad); the index leaves get no cotangent.
_sparse_matmul_cpu = _bilinear.bilinear_product(_csr_forward, _csr_backward)


def sparse_matmul(
    x: jax.typing.ArrayLike,
    w: CSRMatrix,
    *,
    implementation: CpuImplementation | None = None,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
) -> jax.Array:
  """Computes ``x @ w`` for an unstructured sparse ``w``, with a sparse backward pass on CPU.

  Equal to ``x @ w.to_dense()``. On CPU (``implementation`` ``None`` or ``"cpu"``) the forward
  product, ``dX = dY @ Wᵀ`` and ``dW = xᵀ dY`` at the stored entries run in C++ kernels whose work
  and memory are proportional to ``w.nnz``, split over the cores. Differentiable with respect to
  ``x`` and ``w.data`` in reverse mode, to any order (``grad`` of ``grad``); works under ``jit`` and
  ``vmap`` (a mapped ``x`` folds into the batch dimension; a mapped backward runs once per mapped
  element), and inside ``jax.shard_map`` as :func:`jaxsparse.ops.block_sparse_matmul`. Float32, and bfloat16 /
  float16 converted to float32 and back.

  Non-finite values: NaN / inf in ``w.data``, or in ``x`` meeting a stored entry, propagate on every route. A NaN /
  inf in ``x`` meets the entries that are not stored as zeros only on the dense routes, where ``inf * 0`` makes
  NaN as in ``x @ w.to_dense()``: ``implementation="xla"``, and the default's dense route for patterns storing
  more than 30% of the entries (forwards of more than 8 rows). The sparse kernels (``"cpu"``, and the default
  elsewhere) skip entries that are not stored, so such an ``x`` can give finite outputs: test ``x`` with
  ``jnp.isfinite`` where NaN detection matters, rather than relying on the product to carry it.

  Sharded operands (:mod:`jaxsparse.ops`' data parallelism): the leading dims of ``x`` keep their split; ``w``'s
  arrays are replicated, gathered if they arrive split (also under explicit mesh axes, on every route), and the
  gradients come back split like ``x`` and ``w.data``.

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> w = jax.random.normal(jax.random.key(0), (64, 128))
  >>> ws = jaxsparse.CSRMatrix.from_dense(w, mask=jaxsparse.magnitude_mask(w, sparsity=0.9))
  >>> x = jnp.ones((2, 3, 64))
  >>> y = jaxsparse.ops.sparse_matmul(x, ws)
  >>> y.shape, bool(jnp.allclose(y, x @ ws.to_dense(), atol=1e-4))
  ((2, 3, 128), True)

  Args:
    x: ``(..., K)`` activations.
    w: a :class:`jaxsparse.CSRMatrix` of shape ``(K, N)``.
    implementation: ``None`` runs the C++ kernels when the default backend is the CPU (building
      them on first use; if that is impossible it warns with
      :class:`jaxsparse.ops.CpuKernelFallbackWarning` and runs the XLA path), the dense route on
      them for patterns storing more than 30% of the entries, the XLA path elsewhere;
      ``"cpu"`` (always the sparse kernels) or ``"xla"`` force one, and a forced backend that cannot run raises.
    precision: passed to the XLA path's matmul (the C++ kernels always compute in float32).
    preferred_element_type: output dtype, a floating dtype; defaults to ``result_type(x, w.data)``.

  Returns:
    ``(..., N)`` array.

  Raises:
    TypeError: ``preferred_element_type`` is not a floating dtype or ``None``;
      ``w`` is not a :class:`jaxsparse.CSRMatrix`; ``x`` does not have a floating dtype; ``w.data`` is complex;
      ``implementation="cpu"`` with dtypes other than float32, bfloat16 and float16, or a result wider than float32
      (``preferred_element_type=float64``: the kernels accumulate in float32; the default then runs the XLA path);
      float operands of two dtypes where one is an 8-bit float (``float8_e4m3fn``, ``float8_e5m2``)
      without ``preferred_element_type`` (cast one, or pass it, as ``jnp.matmul`` wants; float8 operands of one
      dtype multiply as in ``jnp.matmul``, in float32).
    ValueError: ``x`` is not ``(..., K)`` with ``K = w.shape[0]``, or ``K == 0``; ``w.data`` or an index array
      has the wrong shape or dtype (e.g. a matrix rebuilt with ``tree_unflatten``); an unknown
      ``implementation``; a ``precision`` ``lax.dot_general`` does not take.
    RuntimeError: ``implementation="cpu"`` where the C++ kernels cannot be built or loaded, or the product is
      lowered for a platform other than the CPU.
  """
  _utils.check_weight_type(w, CSRMatrix)
  w._check_static()  # index arrays' shapes and dtypes, also of a matrix from tree_unflatten (no constructor)
  x = _utils.check_activations(x, w.shape[0])
  if jnp.issubdtype(w.dtype, jnp.complexfloating):  # not left to name a preferred_element_type nobody passed
    raise TypeError(f"w.data must have a real dtype, got {w.dtype}; for complex weights use "
                    "jaxsparse.ops.masked_matmul (a dense w and its mask).")
  impl = check_cpu_implementation(implementation, op="sparse_matmul")
  precision = _utils.check_precision(precision)  # the C++ kernels ignore it: checked here, not only by lax
  # Under explicit mesh axes: x's rows split, w's leaves gathered, on every route (the XLA path's autodiff cannot
  # place dW = xᵀ dY when x's rows are split; ops/_sharding.py).
  leaves, treedef = jax.tree.flatten(w)
  x, leaves = _sharding.rows_and_replicated_weights(x, leaves)
  w = jax.tree.unflatten(treedef, leaves)
  out_dtype = _utils.result_dtype(x.dtype, w.dtype, preferred_element_type)
  if impl == "cpu" and not cpu_supports(x.dtype, w.dtype):
    raise TypeError(f"implementation='cpu' supports float32, bfloat16 and float16, got {x.dtype} and {w.dtype}.")
  impl = check_cpu_output(impl, out_dtype)
  # The default runs dense-ish patterns on the dense route; implementation="cpu" always runs the sparse kernels.
  dense = lambda min_density: implementation is None and w.density > min_density
  cfg = _Config(out_dtype, precision, dense(CPU_DENSE_FORWARD_MIN_DENSITY), dense(CPU_DENSE_BACKWARD_MIN_DENSITY))
  cpu_run = functools.partial(_sparse_matmul_cpu, cfg)
  xla_run = functools.partial(sparse_matmul_reference, precision=precision, preferred_element_type=out_dtype)

  def make_w(rng):
    keep = rng.random(w.shape) < max(w.density, 1 / math.prod(w.shape))
    values = _tuning.random_operand(w.shape, w.dtype, 2)
    return CSRMatrix.from_dense(values, mask=jnp.asarray(keep))

  return route("sparse_matmul", impl, x, w, cpu_run, xla_run, make_w)
