"""``masked_matmul``: ``x @ (w * mask)`` for unstructured sparsity, with the gradient to ``w`` masked.

``w`` stays a dense ``(K, N)`` array and ``mask`` a bool one, so masks can be read, replaced and
trained around freely (pruning, RigL). On CPU the product still runs sparse: the C++ kernels of
:mod:`jaxsparse._cpu` find the kept entries by scanning ``mask`` inside every call (16 MiB of mask
bytes for a 4096 x 4096 layer, a small fraction of the products), so nothing has to be rebuilt
when the mask changes and the number of kept entries need not be fixed. Their work is proportional
to the kept entries, plus one pass over ``w`` and ``mask`` per product and the dense ``(K, N)``
weight gradient that this dense storage implies. Densely masked weights run as masked dense products, which are
faster there: the forward above ``CPU_FORWARD_MAX_DENSITY`` as a dense C++ GEMM that selects the kept weights
while it packs them, the backward above ``CPU_MAX_DENSITY`` as XLA's ``dy @ where(mask, w, 0).T``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxsparse import _tuning
from jaxsparse import _utils
from jaxsparse._cpu import _kernels
from jaxsparse._utils import check_mask
from jaxsparse.ops import _bilinear
from jaxsparse.ops import _sharding
from jaxsparse.ops._sparse_matmul import CpuImplementation
from jaxsparse.ops._sparse_matmul import check_cpu_implementation
from jaxsparse.ops._sparse_matmul import check_cpu_output
from jaxsparse.ops._sparse_matmul import cpu_supports
from jaxsparse.ops._sparse_matmul import f32
from jaxsparse.ops._sparse_matmul import route

__all__ = ["CPU_FEW_ROWS", "CPU_FORWARD_MAX_DENSITY", "CPU_MAX_DENSITY", "masked_matmul"]

# Above this fraction of kept weights the masked dense backward beats the sparse kernels (measured on
# a 2-core AVX2 machine, 4096 x 4096, batch 256; see benchmarks/results/cpu_unstructured_*.md; on the 2-core
# AVX-512 Xeon at 30-35% density the kernels' forward + backward took 0.86-1.30x dense, masked dense 0.74-1.11x).
CPU_MAX_DENSITY = 0.25
# The same for the forward alone, against the C++ GEMM that masks the weight while it packs it (0.73-1.22x XLA's dense
# dot's time on two 2-core machines). In-process crossovers of the sparse kernel and the GEMM at six
# shapes, M 96-1024, K and N 256-2048: density 0.2-0.35 at 128 rows or more, 0.15-0.2 at 96 rows, on a Zen 5 EPYC
# and a Xeon (benchmarks/results/cpu_random_shapes_2026-11-30.md). So 0.2, and 0.15 for fewer than
# _FORWARD_SMALL_BATCH rows (the sparse kernel's work per stored weight is shared by fewer rows).
CPU_FORWARD_MAX_DENSITY = 0.2
_FORWARD_SMALL_BATCH = (128, 0.15)
# Forwards of at most this many rows run the dense GEMM at every density: it streams w and mask once, unpacked, at
# 0.7-2.2x the plain product's time for 1-8 rows, where the sparse kernels took 2.6-11x (their batch tiles are
# mostly padding) and XLA's masked dense 1.8-14x (2-core CPU: benchmarks/results/cpu_random_shapes_2026-11-29.md).
CPU_FEW_ROWS = _kernels.FEW_ROWS
_DENSITY_SAMPLE_ROWS = 64


def _masked_dense(x, w, mask, precision, out_dtype):
  w_eff = jnp.where(mask, w, jnp.zeros((), w.dtype))
  return _utils.matmul(x, w_eff, precision=precision, preferred_element_type=out_dtype)


# -------------------------------------------------------------------------------------------------
# CPU path: a custom VJP over the C++ kernels, with the masked dense product for dense masks.
# -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
  precision: lax.PrecisionLike
  out_dtype: jnp.dtype
  check_density: bool  # False when implementation="cpu" forces the kernels


def _sample_step(mask: jax.Array) -> int:
  """The density estimates read ``mask``'s rows ``0, step, 2 * step, ...``: about ``_DENSITY_SAMPLE_ROWS`` of them."""
  return max(1, mask.shape[0] // _DENSITY_SAMPLE_ROWS)


def _sparse_enough(mask: jax.Array, max_density: float = CPU_MAX_DENSITY) -> jax.Array:
  """Whether ``mask`` keeps at most ``max_density`` of the weights, estimated from evenly spaced rows."""
  return jnp.mean(mask[::_sample_step(mask)], dtype=jnp.float32) <= max_density


def _branch(cfg: _Config, mask, sparse, dense):
  """The backward's route: the sparse kernels up to ``CPU_MAX_DENSITY`` (the forward picks its own in its kernel)."""
  return lax.cond(_sparse_enough(mask), sparse, dense) if cfg.check_density else sparse()


def _local_forward(cfg: _Config, x2, w, mask):
  if not cfg.check_density:
    y = _kernels.masked_forward(f32(x2), f32(w), mask, route="sparse")
  else:  # the kernel picks the sparse kernel or the GEMM that masks w as it packs it, by the rows and the density
    rows, small_max = _FORWARD_SMALL_BATCH
    y = _kernels.masked_forward(f32(x2), f32(w), mask, route="auto", max_density=CPU_FORWARD_MAX_DENSITY,
                                small_rows=rows, small_max_density=small_max, sample_step=_sample_step(mask))
  return (y.astype(cfg.out_dtype),)


def _forward(cfg: _Config, x, wm):
  # Data parallel: each device multiplies its rows of x (ops/_sharding.py).
  return _sharding.row_parallel(lambda x2, wm: _local_forward(cfg, x2, *wm), (x,), wm)[0]


def _local_backward(cfg: _Config, x2, dy2, w, mask):
  def sparse():
    dx, dw = _kernels.masked_backward(f32(x2), f32(w), mask, f32(dy2))
    return dx.astype(x2.dtype), dw.astype(w.dtype)

  def dense():
    acc = _utils.accumulation_dtype(dy2.dtype)
    w_eff = jnp.where(mask, w, jnp.zeros((), w.dtype))
    dx = jnp.matmul(dy2, w_eff.T, precision=cfg.precision, preferred_element_type=acc)
    dw = jnp.matmul(x2.T, dy2, precision=cfg.precision, preferred_element_type=acc)
    return dx.astype(x2.dtype), jnp.where(mask, dw, 0).astype(w.dtype)

  return _branch(cfg, mask, sparse, dense)


def _backward(cfg: _Config, x, dy, wm):
  # Data parallel: dX keeps the rows' sharding, dW is summed over the row shards.
  bwd = lambda x2, dy2, wm: _local_backward(cfg, x2, dy2, *wm)
  return _sharding.row_parallel(bwd, (x, dy), wm, summed=(1,), like={0: x, 1: wm[0]})


# The custom VJP over the kernels, on the weight (w, mask), differentiable again (grad of grad); the mask gets
# no cotangent.
_masked_matmul_cpu = _bilinear.bilinear_product(_forward, _backward)


def masked_matmul(
    x: jax.typing.ArrayLike,
    w: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike,
    *,
    implementation: CpuImplementation | None = None,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
) -> jax.Array:
  """Computes ``x @ (w * mask)``; the gradient with respect to ``w`` is zero where ``mask`` is False.

  On CPU the product and both gradients run in sparse C++ kernels that read the kept entries from
  ``mask`` on every call, so ``mask`` may change between calls (also inside ``jit``) at no cost;
  masks keeping more than 20% of the weights (15% for fewer than 128 rows) run the forward as a masked dense product
  (as do products of at most 8 rows), and more than 25% the gradients.
  Works under ``jit``, ``grad`` (reverse mode, to any order) and ``vmap``: leading dimensions of ``x`` and a
  mapped ``x`` fold into one kernel call; a mapped backward runs once per mapped element. Inside ``jax.shard_map``
  as :func:`jaxsparse.ops.block_sparse_matmul`.

  Non-finite values: NaN / inf in the kept weights, or in ``x`` meeting a kept weight, propagate on every route;
  pruned weights never do (they are replaced by zeros, not multiplied by them). A NaN / inf in ``x`` meets the pruned
  entries as zeros only on the masked dense routes, where ``inf * 0`` makes NaN as in ``x @ where(mask, w, 0)``:
  ``implementation="xla"``, and the default for masks denser than 20% (a density estimated inside the call; 15% below
  128 rows) or forwards of at most 8 rows. The sparse kernels (``"cpu"``, and the default elsewhere) skip pruned
  entries, so such an ``x`` can give finite outputs: test ``x`` with ``jnp.isfinite`` where NaN detection matters.

  Sharded operands (:mod:`jaxsparse.ops`' data parallelism): the leading dims of ``x`` keep their split; ``w`` and
  ``mask`` are replicated, gathered if they arrive split (also under explicit mesh axes, on every route), and the
  gradients come back split like ``x`` and ``w``.

  >>> import jax.numpy as jnp, jaxsparse
  >>> w = jnp.arange(6.0).reshape(3, 2)
  >>> mask = jnp.array([[True, False], [False, True], [True, True]])
  >>> jaxsparse.ops.masked_matmul(jnp.ones((1, 3)), w, mask)
  Array([[4., 8.]], dtype=float32)

  Args:
    x: ``(..., K)`` activations, a floating or complex dtype (complex operands run on the XLA path).
    w: ``(K, N)`` dense weights (Flax kernel layout).
    mask: bool ``(K, N)``; pruned entries contribute nothing and receive no gradient.
    implementation: ``None`` uses the C++ kernels when the default backend is the CPU and the dtypes are float32,
      bfloat16 or float16: the sparse kernels for masks keeping at most 20% (forward; 15% below 128 rows) / 25%
      (gradients) of the weights, else a dense C++ GEMM that selects the kept weights as it packs them (forward; also
      at every density for at most 8 rows) and masked dense XLA (gradients); if the kernels cannot be built it warns
      with :class:`jaxsparse.ops.CpuKernelFallbackWarning` and runs XLA; ``"cpu"`` always runs the kernels (and raises
      if they are unavailable); ``"xla"`` always runs ``x @ where(mask, w, 0)`` with plain autodiff (the only choice
      supporting forward-mode differentiation).
    precision: passed to the XLA matmuls (the C++ kernels always compute in float32).
    preferred_element_type: output dtype, a floating dtype; defaults to ``result_type(x, w)``.

  Returns:
    ``(..., N)`` array.

  Raises:
    ValueError: ``w`` is not 2-D; ``x`` is not ``(..., K)`` with ``K = w.shape[0]``, or ``K == 0``; ``mask`` is
      not of ``w``'s shape; an unknown ``implementation``; a ``precision`` ``lax.dot_general`` does not take.
    TypeError: ``preferred_element_type`` is not a floating dtype or ``None``; ``x`` does not have a floating or
      complex dtype (cast integer activations first); ``mask`` is not a boolean array;
      ``implementation="cpu"`` with dtypes other than float32, bfloat16 and float16, or a result wider than float32
      (``preferred_element_type=float64``: the kernels accumulate in float32; the default then runs the XLA path);
      float operands of two dtypes where one is an 8-bit float (``float8_e4m3fn``, ``float8_e5m2``)
      without ``preferred_element_type`` (cast one, or pass it, as ``jnp.matmul`` wants; float8 operands of one
      dtype multiply as in ``jnp.matmul``, in float32).
    RuntimeError: ``implementation="cpu"`` where the C++ kernels cannot be built or loaded, or the product is
      lowered for a platform other than the CPU.
  """
  pet = _utils.check_preferred_element_type(preferred_element_type)
  precision = _utils.check_precision(precision)  # the C++ kernels ignore it: checked here, not only by lax
  x, w = _utils.as_array(x, name="x"), _utils.as_array(w, name="w")
  if w.ndim != 2:
    raise ValueError(f"w must be 2-D (K, N), got shape {w.shape}.")
  x = _utils.check_activations(x, w.shape[0], complex_ok=True)  # complex runs on the XLA path
  mask = check_mask(mask, w.shape)
  impl = check_cpu_implementation(implementation, op="masked_matmul")
  # Under explicit mesh axes: x's rows split, w and mask gathered, on every route (ops/_sharding.py).
  x, (w, mask) = _sharding.rows_and_replicated_weights(x, (w, mask))
  out_dtype = _utils.result_dtype(x.dtype, w.dtype, pet)
  if impl == "cpu" and not cpu_supports(x.dtype, w.dtype):
    raise TypeError(f"implementation='cpu' supports float32, bfloat16 and float16, got {x.dtype} and {w.dtype}.")
  impl = check_cpu_output(impl, out_dtype)
  cfg = _Config(precision, out_dtype, check_density=implementation is None)
  cpu_run = lambda x, wm: _masked_matmul_cpu(cfg, x, wm)
  # d(w * mask)/dw = mask, so autodiff already masks the weight gradient.
  xla_run = lambda x, wm: _masked_dense(x, *wm, precision, out_dtype)

  def make_w(rng):
    keep = mask if not isinstance(mask, jax.core.Tracer) else jnp.asarray(rng.random(w.shape) < CPU_MAX_DENSITY)
    return _tuning.random_operand(w.shape, w.dtype, 2), keep

  return route("masked_matmul", impl, x, (w, mask), cpu_run, xla_run, make_w)
