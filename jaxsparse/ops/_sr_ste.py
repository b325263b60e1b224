"""``sr_ste``: N:M pruning with the sparse-refined straight-through estimator (SR-STE).

Forward: ``w * nm_mask(w)``. Backward: the output cotangent passes straight through to the dense
``w`` (the straight-through estimator), plus ``decay * (1 - mask) * w`` on the pruned entries,
which pulls pruned weights towards zero so that the mask settles (Zhou et al., 2021).

``sr_ste_matmul`` is ``x @ sr_ste(w)`` as one op, so that on CUDA GPUs the forward product of a 2:4
weight can run on sparse tensor cores (cuSPARSELt): each call prunes the dense weight and writes it
compressed in one pass (``jaxsparse/_cuda/nm24_prune.cu``: the pruned kernel, each group's mask bits and
cuSPARSELt's buffer), and multiplies. The backward pass is the reference's VJP with the forward's pruned
kernel and mask, so the gradients are exactly those of ``x @ sr_ste(w)``: both backward products (``dY Wᵀ``
and ``xᵀ dY``) stay dense, since neither reduces along the axis the 2:4 groups run along.

``transposable=True`` prunes with a mask that is N:M along the output axis too (:func:`jaxsparse.nm_mask`),
so that ``Wᵀ`` is N:M along the axis ``dY Wᵀ`` reduces over and that product runs on sparse tensor cores as
well (the mask costs about 4 points of kept magnitude; on digits it trains as well as the plain one,
``examples/sr_ste_digits.py``). On a CUDA GPU a kernel of ours prunes the weight in one pass
(``jaxsparse/_cuda/nm24_prune.cu``) and writes it straight into cuSPARSELt's compressed buffers of
``W`` (for the forward) and ``Wᵀ`` (for ``dY Wᵀ``) where it knows their layout (K, N multiples of 64,
``_layout.matches()``; else cuSPARSELt compresses the kernel's pruned weight); only ``xᵀ dY`` stays dense:
two of the step's three products on sparse tensor cores. Below ``TRANSPOSABLE_SPARSE_CORE_MIN_ROWS`` rows the
kernel still prunes, for the dense products.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxsparse import _tuning
from jaxsparse import _utils
from jaxsparse._cuda import _cusparselt as cslt
from jaxsparse._cuda import _kernels as cuda_kernels
from jaxsparse.formats import _nm_masks
from jaxsparse.ops import _router
from jaxsparse.ops import _sharding

__all__ = ["sr_ste", "sr_ste_matmul"]

# "auto" runs the forward on sparse tensor cores from this many rows of x (below, our pruning kernel with dense
# products). Each call prunes and compresses the weight in one pass (our kernel, `_kernels.nm24_prune`, which also
# keeps the pruned kernel and the mask bits for the backward pass) and the sparse product saves about 0.25 of the
# dense one. Measured on an H200 (benchmarks/results/gpu_sr_ste_step_loss_2026-11-29_h200.md, `gpu_nm.py --tuned
# --parts sr_ste_optax`): one layer's whole step with an optax.adamw update (float32 master weights, bf16 compute,
# dY = y), sparse tensor cores / the pruning kernel's route, over the dense layer's step, 2048 x 5632, 4096 x 4096 and
# 5632 x 2048 weights: 4096 rows: 0.92-0.93 / 0.99-1.00; 2048 rows: 0.95-0.97 / 0.99-1.00; 1024 rows: 1.02-1.07 /
# 1.00-1.01; 256 rows: 1.11-1.22 / 0.99-1.02.
SPARSE_CORE_MIN_ROWS = 2048
# The same for transposable masks, whose backward dY Wᵀ runs on sparse tensor cores too; against our kernel's
# pruning with dense products (`--transposable`, the same results file): 4096 rows: 0.86-0.90 / 1.01-1.02; 2048:
# 0.94-0.97 / 1.04-1.06; 1024: 1.02-1.17 / 1.07-1.09; 256: 1.22-1.28 / 1.10-1.11.
TRANSPOSABLE_SPARSE_CORE_MIN_ROWS = 2048


def _mask(w: jax.Array, n: int, m: int, axis: int, transposable: bool) -> jax.Array:
  """``nm_mask(w, n, m, axis=axis, transposable=transposable)``; a transposable 2:4 mask by our kernel on CUDA
  GPUs where it runs (one pass instead of XLA's search over the 90 patterns of every tile)."""
  if not transposable:
    return _nm_masks.nm_mask(w, n, m, axis=axis)
  # The tiles run over (axis, last axis); the other axes flatten into rows of whole tiles.
  moved = jnp.moveaxis(w, axis, -2)
  w2 = moved.reshape(-1, moved.shape[-1])
  product = _router.Product("sr_ste", "mask", (w2,), {"shape": w2.shape, "nm": (n, m), "dtype": str(w.dtype)},
                            lambda: (_tuning.random_operand(w2.shape, w2.dtype),))
  xla = _router.Reference("xla", "the XLA path", lambda w2: _nm_masks.transposable_pattern(w2, n, m).astype(jnp.uint8))
  (pattern,) = _router.route([product], [_PruneKernel(n, m, w.dtype), xla])
  mask = _nm_masks.tile_mask(pattern, n, m)
  return jnp.moveaxis(mask.reshape(moved.shape), -2, axis)


@dataclasses.dataclass(frozen=True)
class _PruneKernel:
  """CUDA: our 2:4 pruning kernel (``nm24_prune.cu``): each 4 x 4 tile's transposable pattern in one pass."""

  n: int
  m: int
  dtype: Any  # the pruned kernel's
  name: ClassVar[str] = "prune_kernel"
  title: ClassVar[str] = "jaxsparse's CUDA pruning kernel"
  platforms: ClassVar[tuple[str, ...]] = ("cuda",)
  fallback_warning: ClassVar[type[Warning]] = cuda_kernels.CudaKernelFallbackWarning

  def unsupported_reason(self, p: _router.Product) -> _router.Unsupported | None:
    w = p.args[-1]
    reason = _prune_kernel_unsupported_reason(w.shape, w.dtype, self.n, self.m, self.dtype)
    return _router.Unsupported(reason, warn=(self.n, self.m) == (2, 4)) if reason else None

  def candidates(self, p: _router.Product) -> list[_tuning.Candidate]:
    return [_tuning.Candidate(self.name, lambda w2: cuda_kernels.nm24_transposable(w2)[1])]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _sr_ste(w: jax.Array, n: int, m: int, axis: int, decay: float, transposable: bool) -> jax.Array:
  return jnp.where(_mask(w, n, m, axis, transposable), w, jnp.zeros((), w.dtype))


def _sr_ste_fwd(w, n, m, axis, decay, transposable):
  mask = _mask(w, n, m, axis, transposable)
  residuals = (w, mask) if decay else (None, None)
  return jnp.where(mask, w, jnp.zeros((), w.dtype)), residuals


def _sr_ste_bwd(n, m, axis, decay, transposable, res, g):
  w, mask = res
  if not decay:
    return (g,)
  # g + decay * (1 - mask) * w, computed in the cotangent's dtype.
  return (g + jnp.where(mask, jnp.zeros((), g.dtype), (decay * w).astype(g.dtype)),)


_sr_ste.defvjp(_sr_ste_fwd, _sr_ste_bwd)


def sr_ste(
    w: jax.typing.ArrayLike, n: int, m: int, *, decay: float = 2e-4, axis: int = 0, transposable: bool = False
) -> jax.Array:
  """N:M-prunes ``w`` in the forward pass; passes gradients to the dense ``w`` (SR-STE).

  The forward value is ``w`` with all but the ``n`` largest-magnitude entries of every ``m``
  consecutive ones along ``axis`` set to zero (:func:`jaxsparse.nm_mask`). The gradient is

  ``dL/dw = g + decay * (1 - mask) * w``

  where ``g`` is the gradient with respect to the pruned weight: every dense weight keeps learning,
  so the mask, recomputed each step, can change, and the ``decay`` term shrinks pruned weights so
  that it settles. ``decay=0`` is the plain straight-through estimator. The paper's default is
  ``decay=2e-4``; the term is in gradient units, so the optimizer's learning rate scales it.

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> w = jnp.array([[1.0], [-4.0], [0.5], [3.0]])
  >>> jaxsparse.ops.sr_ste(w, 2, 4).ravel()
  Array([ 0., -4.,  0.,  3.], dtype=float32)
  >>> jax.grad(lambda w: jaxsparse.ops.sr_ste(w, 2, 4, decay=0.1).sum())(w).ravel()
  Array([1.1 , 1.  , 1.05, 1.  ], dtype=float32)

  References:
    Zhou et al., "Learning N:M Fine-grained Structured Sparse Neural Networks From Scratch",
    ICLR 2021.

  Args:
    w: dense weights; ``w.shape[axis]`` a multiple of ``m``.
    n, m: keep ``n`` of every ``m`` consecutive entries, ``0 < n < m``.
    decay: SR-STE's ``lambda_W``, a finite float ``>= 0`` (a concrete NumPy / JAX scalar is converted; it is
      static, so not a traced value); ``0`` gives plain STE.
    axis: the axis the groups run along (0: input features of a Dense kernel; -2: ``cin`` of a
      Conv kernel).
    transposable: prune with a mask that is N:M along the last axis too (``nm_mask(...,
      transposable=True)``), so that ``Wᵀ`` is N:M along its contraction axis as well. For 2:4 float32 /
      bfloat16 weights on a CUDA GPU a kernel of ours computes it in one pass (the same mask except where
      two patterns' totals agree to within float32 rounding; see :func:`sr_ste_matmul`).

  Returns:
    The N:M-pruned ``w``, same shape and dtype.

  Raises:
    TypeError: ``n``, ``m`` or ``axis`` is not an int; ``transposable`` is not a bool; ``w`` does not have a
      floating dtype.
    ValueError: not ``0 < n < m`` (``m >= 2``); ``axis`` out of range for ``w.ndim``; ``decay`` is not a
      finite number ``>= 0``, or is traced; ``m`` does not divide ``w.shape[axis]``; ``transposable=True``
      with ``m > 4``, a 1-D ``w``, groups along the last axis, or ``m`` not dividing
      ``w.shape[-1]``.
  """
  w = _utils.as_array(w, name="w")
  n, m = _nm_masks.check_nm(n, m)
  axis = _nm_masks.check_axis(axis, w.ndim)
  decay = _utils.check_decay(decay)
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise TypeError(f"w must have a floating dtype to be trained, got {w.dtype}.")
  _nm_masks.check_groups(w.shape, axis, m)
  transposable = _nm_masks.check_transposable(transposable, w.shape, m, axis)
  return _sr_ste(w, n, m, axis, decay, transposable)


@dataclasses.dataclass(frozen=True)
class _MatmulConfig:
  n: int
  m: int
  decay: float
  dtype: Any  # the dtype the pruned kernel is cast to before the product
  precision: Any
  preferred_element_type: Any
  transposable: bool = False


def _product(cfg: _MatmulConfig, x, kernel):
  kwargs = {} if cfg.preferred_element_type is None else {"preferred_element_type": cfg.preferred_element_type}
  return lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=cfg.precision, **kwargs)


def _reference(cfg: _MatmulConfig, x, w):
  return _product(cfg, x, _sr_ste(w, cfg.n, cfg.m, 0, cfg.decay, cfg.transposable).astype(cfg.dtype))


# The fused routes (CUDA-only backends) prune (and compress) the weight with our kernels and multiply, as two custom
# VJPs in the reference's order: `_weight` on w alone (w passes through; the pruned operands of the product come
# along, and its VJP adds the decay of the entries the mask prunes), then `_st_product` on (x, w, operands), whose
# VJP passes xᵀ dY straight to w. The decay is thus added once per pruning of w, as `_sr_ste` adds it: one custom VJP
# over both added it once per element of a jax.vmap over x that shares w (jax.vmap(layer)(x), a batch of 256 took 256
# times the decay), as JAX sums the mapped weight gradients. The residuals: x, w, the mask bits (for the decay) and
# what dY Wᵀ multiplies by (the pruned kernel in the compute dtype, or the compressed Wᵀ): the backward pass neither
# prunes again nor builds the kernel again.
#
# `route` is the candidate's static choice: for plain 2:4 `sparse` (the forward product on sparse tensor cores), for
# transposable 2:4 `blob_bytes` (the size of the compressed Wᵀ; 0: dense products).


def _p_prune_xla(cfg: _MatmulConfig, w):
  bits = _nm_masks.nm_group_bits(w, cfg.n, cfg.m)
  return jnp.where(_nm_masks.group_mask(bits, cfg.m), w, jnp.zeros((), w.dtype)).astype(cfg.dtype), bits


def _p_prune(cfg: _MatmulConfig, sparse: bool, w):
  """``(pruned, bits, blob)``: ``w`` pruned by our kernel where it runs (else XLA's mask), and with ``sparse`` the
  pruned weight compressed for cuSPARSELt (in the same pass where the kernel knows its layout), else ``None``."""
  k, n = w.shape
  if _prune_kernel_unsupported_reason(w.shape, w.dtype, cfg.n, cfg.m, cfg.dtype):
    pruned, bits = _p_prune_xla(cfg, w)
    return pruned, bits, cslt.compress(pruned) if sparse else None
  direct = sparse and k % 32 == 0 and n % 64 == 0 and cslt.fast_compress(k, n, cfg.dtype)
  pruned, bits, blob = cuda_kernels.nm24_prune(w, cfg.dtype, compress=direct)
  if sparse and not direct:
    blob = cslt.compress(pruned)
  return pruned, bits, blob if sparse else None


def _direct_compress(k: int, n: int) -> bool:
  """Whether our kernel can write cuSPARSELt's buffers of a ``(k, n)`` weight and of its transpose itself."""
  size = k * n // 8 * 9
  return (k % 64 == 0 and n % 64 == 0 and k <= cuda_kernels.TRANSPOSABLE_COMPRESS_MAX_K and
          cslt.fast_compress(k, n, jnp.bfloat16) and
          cslt.fast_compress(n, k, jnp.bfloat16) and cslt.compressed_bytes(n, k, jnp.bfloat16) == size and
          cslt.compressed_bytes(k, n, jnp.bfloat16) == size)


def _t_prune(cfg: _MatmulConfig, blob_bytes: int, w):
  """``(pattern, forward, backward)``: the transposable mask's 4 x 4 tile patterns and what the products multiply
  by: the pruned kernel for both (dense products), or the compressed ``W`` and ``Wᵀ``."""
  if not blob_bytes:
    pruned, pattern = cuda_kernels.nm24_transposable(w, cfg.dtype)
    return pattern, pruned, pruned
  if _direct_compress(*w.shape):
    return cuda_kernels.nm24_transposable_compress(w)
  # Prune with the kernel, compress with cuSPARSELt (Wᵀ as a (N, K) weight in LAYOUT_KN).
  pruned, pattern = cuda_kernels.nm24_transposable(w, cfg.dtype)
  return pattern, cslt.compress(pruned), cslt.compress(pruned.T)


def _pruned_operands(cfg: _MatmulConfig, route, w):
  """``((forward, backward), bits)``: the operands the product multiplies by (``backward``: in dY Wᵀ) and the mask's
  bits."""
  if cfg.transposable:
    pattern, forward, backward = _t_prune(cfg, route, w)
    return (forward, backward), pattern
  pruned, bits, blob = _p_prune(cfg, route, w)
  return (pruned if blob is None else blob, pruned), bits


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _weight(cfg: _MatmulConfig, route, w):
  """``(w, operands)``: ``w`` itself, the path of its straight-through gradient, and the operands of the pruned
  weight (:func:`_pruned_operands`), which get none."""
  return w, _pruned_operands(cfg, route, w)[0]


def _weight_fwd(cfg, route, w):
  operands, bits = _pruned_operands(cfg, route, w)
  return (w, operands), (w, bits) if cfg.decay else None


def _weight_bwd(cfg, route, res, cotangents):
  g = cotangents[0]
  if res is not None:  # g + decay * (1 - mask) * w, as `_sr_ste` adds it, in the cotangent's dtype
    w, bits = res
    mask = _nm_masks.tile_mask(bits, cfg.n, cfg.m) if cfg.transposable else _nm_masks.group_mask(bits, cfg.m)
    g = g + jnp.where(mask, jnp.zeros((), g.dtype), (cfg.decay * w).astype(g.dtype))
  return (g,)


_weight.defvjp(_weight_fwd, _weight_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _st_product(cfg: _MatmulConfig, route, x, w, operands):
  """``x @ pruned``, the pruned weight given by ``operands``; the forward product on sparse tensor cores where the
  route says so. Its VJP gives ``dY prunedᵀ`` to ``x`` and ``xᵀ dY`` (through the cast to the compute dtype) to the
  dense ``w``."""
  forward, _ = operands
  if not route:  # on sparse tensor cores where `sparse` (plain) or `blob_bytes` (transposable) says so
    return _product(cfg, x, forward)
  # Data parallel: each device multiplies its rows of x by the (replicated) compressed weight.
  local = lambda x2, b: (cslt.matmul(x2, b, w.shape[1]),)
  return _sharding.row_parallel(local, (x,), forward)[0]


def _st_product_fwd(cfg, route, x, w, operands):
  return _st_product(cfg, route, x, w, operands), (x, w, operands[1])


def _st_product_bwd(cfg, route, res, dy):
  x, w, backward = res
  if cfg.transposable and route:  # dY Wᵀ on sparse tensor cores, on the compressed Wᵀ
    local = lambda dy2, b: (cslt.matmul(dy2, b, w.shape[0]),)
    dx = _sharding.row_parallel(local, (dy,), backward, like={0: x})[0]
    kernel = w.astype(cfg.dtype)  # xᵀ dY's product below reads its shape and dtype only
  else:
    kernel = backward  # the pruned kernel in the compute dtype, as the reference's product multiplies by it
    dx = jax.vjp(lambda x: _product(cfg, x, kernel), x)[1](dy)[0]
  dkernel = jax.vjp(lambda k: _product(cfg, x, k), kernel)[1](dy)[0]
  return dx, dkernel.astype(w.dtype), None


_st_product.defvjp(_st_product_fwd, _st_product_bwd)


def _sr_ste_matmul(cfg: _MatmulConfig, sparse: bool, x, w):
  """``x @ sr_ste(w)`` (2:4) pruned by our kernel (CUDA); the forward product on sparse tensor cores with
  ``sparse``."""
  w, operands = _weight(cfg, sparse, w)
  return _st_product(cfg, sparse, x, w, operands)


def _sr_ste_matmul_t(cfg: _MatmulConfig, blob_bytes: int, x, w):
  """``x @ sr_ste(w, transposable=True)`` pruned by our kernel (CUDA); products on sparse tensor cores when
  ``blob_bytes`` (the size of the compressed ``Wᵀ``) is not 0."""
  w, operands = _weight(cfg, blob_bytes, w)
  return _st_product(cfg, blob_bytes, x, w, operands)


# -------------------------------------------------------------------------------------------------
# The backends of sr_ste_matmul (ops/_router.py). Each candidate is a whole differentiable op (its own custom VJP),
# timed as a train step's products: the forward and both gradients.
# -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _SparseCores:
  """CUDA: the forward product (and for transposable masks ``dY Wᵀ``) on cuSPARSELt's sparse tensor cores, the
  weight pruned and compressed in every call."""

  cfg: _MatmulConfig
  name: ClassVar[str] = "cusparselt"
  title: ClassVar[str] = "the 2:4 products on sparse tensor cores"
  platforms: ClassVar[tuple[str, ...]] = ("cuda",)
  fallback_warning: ClassVar[type[Warning]] = cslt.CusparseLtFallbackWarning

  def unsupported_reason(self, p: _router.Product) -> _router.Unsupported | None:
    x, w = p.args
    cfg = self.cfg
    if cfg.transposable:
      reason = _prune_kernel_unsupported_reason(w.shape, w.dtype, cfg.n, cfg.m, cfg.dtype)
      if reason:
        return _router.Unsupported(reason)  # the pruning kernel's backend says so
    out_dtype = cfg.preferred_element_type or jnp.result_type(x.dtype, cfg.dtype)
    reason = sparse_core_unsupported_reason(x.shape, x.dtype, w.shape, cfg.n, cfg.m, cfg.dtype, out_dtype)
    # Where the shipped default would take it (enough rows) and it cannot run on a CUDA GPU, say so.
    warn = (cfg.n, cfg.m) == (2, 4) and _rows(p) >= _min_rows(cfg)
    return _router.Unsupported(reason, warn=warn) if reason else None

  def candidates(self, p: _router.Product) -> list[_tuning.Candidate]:
    cfg = self.cfg
    if cfg.transposable:
      # The buffer of Wᵀ, an (N, K) weight read in LAYOUT_KN (compressed_bytes takes the output size first).
      blob_bytes = cslt.compressed_bytes(p.args[1].shape[0], p.args[1].shape[1], cfg.dtype)
      run = functools.partial(_sr_ste_matmul_t, cfg, blob_bytes)
    else:
      run = functools.partial(_sr_ste_matmul, cfg, True)
    return [_tuning.Candidate(self.name, run, measure=_tuning.train_step(run))]


@dataclasses.dataclass(frozen=True)
class _PruneThenDense:
  """CUDA, 2:4: our kernel prunes in one pass (the transposable mask, or the plain one and its bits); the products
  are dense."""

  cfg: _MatmulConfig
  name: ClassVar[str] = "prune_kernel"
  title: ClassVar[str] = "jaxsparse's CUDA pruning kernel"
  platforms: ClassVar[tuple[str, ...]] = ("cuda",)
  fallback_warning: ClassVar[type[Warning]] = cuda_kernels.CudaKernelFallbackWarning

  def unsupported_reason(self, p: _router.Product) -> _router.Unsupported | None:
    cfg, w = self.cfg, p.args[1]
    reason = _prune_kernel_unsupported_reason(w.shape, w.dtype, cfg.n, cfg.m, cfg.dtype)
    # Transposable masks have no other fast way to prune on the GPU: say so where it cannot run.
    return _router.Unsupported(reason, warn=cfg.transposable and (cfg.n, cfg.m) == (2, 4)) if reason else None

  def candidates(self, p: _router.Product) -> list[_tuning.Candidate]:
    cfg = self.cfg
    run = functools.partial(_sr_ste_matmul_t, cfg, 0) if cfg.transposable else functools.partial(_sr_ste_matmul, cfg,
                                                                                                  False)
    return [_tuning.Candidate(self.name, run, measure=_tuning.train_step(run))]


def _reference_backend(cfg: _MatmulConfig) -> _router.Reference:
  """Every platform: ``x @ sr_ste(w).astype(dtype)`` with XLA's dense products."""
  run = functools.partial(_reference, cfg)
  return _router.Reference("xla", "the dense product", run, measure=_tuning.train_step(run))


def _rows(p: _router.Product) -> int:
  return math.prod(p.args[0].shape[:-1])


def _min_rows(cfg: _MatmulConfig) -> int:
  return TRANSPOSABLE_SPARSE_CORE_MIN_ROWS if cfg.transposable else SPARSE_CORE_MIN_ROWS


def _shipped_default(p: _router.Product, cands: list[_tuning.Candidate]) -> str:
  """With tuning off: sparse tensor cores from ``SPARSE_CORE_MIN_ROWS`` rows (measured, see above), below that our
  pruning kernel with dense products where it runs, else the dense product.

  Below ``SPARSE_CORE_MIN_ROWS`` the pruning kernel's route costs what the dense layer's step costs: the kernel reads
  the float32 weight once and writes the pruned bf16 kernel and the mask bits, where the dense step casts the weight
  (the same bytes but the bits); XLA's route computes the mask in a pass of its own. The whole step with an
  ``optax.adamw`` update against the dense layer's (H200, 256 / 1024 rows of 2048 x 5632, 4096 x 4096 and
  5632 x 2048 weights; benchmarks/results/gpu_sr_ste_step_loss_2026-11-29_h200.md): 1.00-1.02 against XLA's
  1.07-1.11.
  """
  names, cfg = [c.name for c in cands], p.fields["cfg"]
  if "cusparselt" in names and _rows(p) >= _min_rows(cfg):
    return "cusparselt"
  return "prune_kernel" if "prune_kernel" in names else names[-1]


def sparse_core_unsupported_reason(x_shape, x_dtype, w_shape, n, m, dtype, out_dtype) -> str:
  """Why ``sr_ste_matmul`` cannot run its forward on cuSPARSELt for these operands, or ``""``."""
  if not cslt.available():
    return cslt.unavailable_reason()
  if len(w_shape) != 2:
    return f"w must be 2-D (K, N), got shape {tuple(w_shape)}"
  if jnp.dtype(x_dtype) != jnp.dtype(dtype) or jnp.dtype(out_dtype) != jnp.dtype(dtype):
    return f"x, the kernel and the output must share one dtype, got {jnp.dtype(x_dtype)}, {jnp.dtype(dtype)}, " \
           f"{jnp.dtype(out_dtype)}"
  return cslt.unsupported_reason(w_shape[0], w_shape[1], dtype, n_keep=n, m=m)


def _prune_kernel_unsupported_reason(w_shape, w_dtype, n, m, dtype) -> str:
  """Why our kernels cannot prune ``w`` (2:4, plain or transposable) into ``dtype`` here, or ``""``."""
  if (n, m) != (2, 4):
    return f"the pruning kernel takes 2:4 only, got {n}:{m}"
  return cuda_kernels.unavailable_reason() or cuda_kernels.nm24_prune_unsupported_reason(w_shape, w_dtype, dtype)


def sr_ste_matmul(
    x: jax.typing.ArrayLike,
    w: jax.typing.ArrayLike,
    n: int,
    m: int,
    *,
    decay: float = 2e-4,
    dtype: jax.typing.DTypeLike | None = None,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    implementation: str | None = None,
    transposable: bool = False,
) -> jax.Array:
  """``x @ sr_ste(w, n, m, decay=decay).astype(dtype)``, on 2:4 sparse tensor cores where it can.

  The value and the gradients (to ``x`` and to the dense ``w``, SR-STE decay included) are those of

  ``lax.dot_general(x, sr_ste(w, n, m, decay=decay).astype(dtype), contract x's last axis with w's 0)``

  which is what :class:`jaxsparse.layers.NMLinear` computes. On a CUDA GPU, ``implementation=None`` takes
  the way measured fastest for the whole train step's products (:func:`jaxsparse.set_autotune_mode`) among:
  the forward product on sparse tensor cores (cuSPARSELt; 2:4, bfloat16 ``x`` and kernel (and output),
  ``K``, ``N`` multiples of 16: the pruned weight is compressed on the device in every call, so the mask
  follows ``w`` as it trains, and multiplied; the backward products stay dense, see the module docstring),
  our 2:4 pruning kernel with dense products, and the reference. With tuning off, sparse tensor cores from
  ``SPARSE_CORE_MIN_ROWS`` (2048) rows of ``x``, below that the pruning kernel where it runs (a train step as
  fast as the dense layer's), else the reference. Elsewhere it is the reference, with a
  :class:`jaxsparse.ops.CusparseLtFallbackWarning` when a 2:4 product with enough rows cannot run on a CUDA
  GPU.

  Sharded operands: the leading dims of ``x`` keep their split; ``w`` is replicated, gathered if it arrives split
  (also under explicit mesh axes, on every route: its mask is then that of the whole ``w``), and the gradients come
  back split like ``x`` and ``w``.

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> w = jax.random.normal(jax.random.key(0), (64, 32))
  >>> x = jnp.ones((3, 64))
  >>> y = jaxsparse.ops.sr_ste_matmul(x, w, 2, 4)
  >>> bool(jnp.allclose(y, x @ jaxsparse.ops.sr_ste(w, 2, 4), atol=1e-5))
  True

  Args:
    x: ``(..., K)`` activations, a floating (or complex) dtype, already in the compute dtype.
    w: ``(K, N)`` dense weights (e.g. float32 master weights); groups of ``m`` along ``K``.
    n, m: keep ``n`` of every ``m``.
    decay: SR-STE's decay of the pruned weights, a static finite float ``>= 0`` (as in :func:`sr_ste`).
    dtype: the kernel's compute dtype, a floating (or complex) dtype (defaults to ``w.dtype``); the mask is
      computed on ``w`` before the cast, as ``sr_ste`` followed by a cast does.
    precision, preferred_element_type: passed to the product (``preferred_element_type`` a floating dtype or
      ``None``).
    implementation: ``None`` (auto, see above), ``"xla"`` (the reference), ``"cusparselt"`` (sparse tensor
      cores at any number of rows) or ``"prune_kernel"`` (our 2:4 pruning kernel with dense products; a CUDA GPU
      of compute capability 9.0+, float32 / bfloat16 ``w`` and kernel); the last two raise where they cannot run.
    transposable: prune with the transposable mask (``sr_ste(..., transposable=True)``). For 2:4 on a
      CUDA GPU of compute capability 9.0+ with float32 / bfloat16 ``w`` and kernel, our kernel prunes ``w``
      in one pass, and from ``TRANSPOSABLE_SPARSE_CORE_MIN_ROWS`` rows (or with
      ``implementation="cusparselt"``) both the forward and ``dY Wᵀ`` run on sparse tensor cores (the
      conditions above); ``xᵀ dY`` stays dense. The kernel's mask is ``nm_mask``'s except where two
      patterns' totals agree to within float32 rounding (it adds in another order), and the gradients are
      those of ``x @ sr_ste(w, transposable=True)`` with that mask.

  Returns:
    ``(..., N)`` array.

  Raises:
    TypeError: ``preferred_element_type`` is not a floating dtype or ``None``; ``dtype`` is not a floating (or
      complex) dtype or ``None``; ``n`` or ``m`` is not an int; ``transposable`` is not a bool; ``x`` does not have
      a floating (or complex) dtype; ``w`` does not have a floating dtype; ``x`` and ``dtype`` (the
      kernel's compute dtype) two float dtypes where one is an 8-bit float, without ``preferred_element_type``
      (cast one, or pass it, as ``jnp.matmul`` wants).
    ValueError: not ``0 < n < m`` (``m >= 2``); ``decay`` is not a finite number ``>= 0``, or is traced; an
      unknown ``implementation``; ``w`` is not 2-D or ``x`` not ``(..., K)`` with ``K = w.shape[0]``; ``m``
      does not divide ``K``; ``transposable=True`` with ``m > 4`` or not dividing
      ``N``; a ``precision`` ``lax.dot_general`` does not take.
    RuntimeError: ``implementation="cusparselt"`` where sparse tensor cores cannot run these operands (no
      CUDA GPU, as on a CPU; not 2:4 bfloat16; ``K`` or ``N`` not a multiple of 16; the message says why), or
      ``"prune_kernel"`` where the pruning kernel cannot (the message says why).
  """
  x, w = _utils.as_array(x, name="x"), _utils.as_array(w, name="w")
  n, m = _nm_masks.check_nm(n, m)
  decay = _utils.check_decay(decay)
  if implementation not in _IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {_IMPLEMENTATIONS}, got implementation={implementation!r}.")
  if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"x must be (..., K) and w (K, N) with the same K, got x.shape={x.shape}, w.shape={w.shape}.")
  _utils.check_activation_dtype(x, complex_ok=True)  # NMLinear computes in complex dtypes as nnx.Linear does
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise TypeError(f"w must have a floating dtype to be trained, got {w.dtype}.")
  _nm_masks.check_groups(w.shape, 0, m)
  transposable = _nm_masks.check_transposable(transposable, w.shape, m, 0)
  dtype = _check_compute_dtype(dtype, w.dtype)
  pet = _utils.check_preferred_element_type(preferred_element_type)
  precision = _utils.check_precision(precision)
  _utils.result_dtype(x.dtype, dtype, pet, names=("x.dtype", "dtype (w's compute dtype)"))
  cfg = _MatmulConfig(n, m, decay, dtype, precision, pet, transposable)
  # Under explicit mesh axes: x's rows split, w gathered (its mask then computed whole), on every route.
  x, (w,) = _sharding.rows_and_replicated_weights(x, (w,))
  if implementation == "xla":
    return _reference(cfg, x, w)
  backends = [_SparseCores(cfg), _PruneThenDense(cfg), _reference_backend(cfg)]
  if implementation == "cusparselt":
    out_dtype = pet or jnp.result_type(x.dtype, dtype)
    reason = sparse_core_unsupported_reason(x.shape, x.dtype, w.shape, n, m, dtype, out_dtype)
    if transposable:
      reason = _prune_kernel_unsupported_reason(w.shape, w.dtype, n, m, dtype) or reason
    if reason:
      raise RuntimeError(f"implementation='cusparselt' was requested but cannot run: {reason}.")
    backends = backends[:1]
  elif implementation == "prune_kernel":
    reason = _prune_kernel_unsupported_reason(w.shape, w.dtype, n, m, dtype)
    if reason:
      raise RuntimeError(f"implementation='prune_kernel' was requested but cannot run: {reason}.")
    backends = backends[1:2]
  return _router.route([_routed(cfg, x, w)], backends, default=_shipped_default)[0]


_IMPLEMENTATIONS = (None, "xla", "cusparselt", "prune_kernel")


def _check_compute_dtype(dtype: object, w_dtype: jnp.dtype) -> jnp.dtype:
  """``sr_ste_matmul``'s ``dtype`` (the pruned kernel's compute dtype) as a dtype, ``w_dtype`` for ``None``: a floating
  (or complex) dtype, since an integer or bool kernel truncates the pruned weights and passes no gradient to ``w``."""
  checked = _utils.check_dtype_argument(dtype, "dtype", what="dtype (the pruned kernel's compute dtype)",
                                        none="w's dtype", complex_ok=True)
  return jnp.dtype(w_dtype) if checked is None else checked


def _routed(cfg: _MatmulConfig, x: jax.Array, w: jax.Array) -> _router.Product:
  """The product as the router sees it: one train step's products of ``x @ sr_ste(w)``."""

  def make_args():
    return _tuning.random_operand(x.shape, x.dtype, 1), _tuning.random_operand(w.shape, w.dtype, 2)

  fields = {
      "rows": _utils.row_bucket(math.prod(x.shape[:-1])),
      "shape": w.shape,
      "cfg": cfg,
      "dtypes": (str(x.dtype), str(w.dtype)),
  }
  dense = _tuning.DenseProduct(x.shape, w.shape, (x.dtype, w.dtype), step=True)
  return _router.Product("sr_ste_matmul", "step", (x, w), fields, make_args, dense)
