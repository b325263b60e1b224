"""SparseGPT (Frantar & Alistarh, 2023): one layer pruned by optimal-brain-surgeon updates.

For a layer ``y = x @ w`` (``w`` of shape ``(K, N)``, the Flax layout) and calibration inputs ``X``
(``(T, K)``), SparseGPT minimises ``||X w - X ŵ||²`` over ``ŵ`` with the requested sparsity pattern.
It walks the input features ``k = 0 .. K-1`` in order; when feature ``k`` is fixed (its pruned
weights set to zero), the error is spread over the features not yet fixed, ``k+1 ..``, by the OBS
update with the inverse Hessian ``H⁻¹ = (XᵀX + λI)⁻¹`` of those features. The row ``k`` of the upper
Cholesky factor ``U`` of ``H⁻¹`` (``H⁻¹ = UᵀU``) holds that update for every ``k`` at once, so one
Cholesky factorisation serves all steps. Updates are applied lazily: inside a batch of
``block_size`` features exactly, to the rest once per batch as one matrix product.

Masks are chosen with the OBS saliency ``ŵ² / U[k, k]²`` (the squared weight over the diagonal of
the inverse Hessian of the features not yet fixed):

* unstructured: per batch of ``block_size`` features over all outputs, from the weights updated so
  far ("adaptive mask selection"), with per-batch counts that add up exactly to the layer count of
  :class:`jaxsparse.Unstructured`;
* N:M: per group of ``m`` input features of every output, when the group is reached;
* blocks ``(bk, bn)``: once, before the first update, by the saliency summed over each block, keeping
  ``round(density * blocks)`` as :class:`jaxsparse.BlockSparse` does.

References:
  Frantar & Alistarh, "SparseGPT: Massive Language Models Can Be Accurately Pruned in One-Shot",
  ICML 2023, https://arxiv.org/abs/2301.00774.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxsparse import _utils
from jaxsparse.formats._specs import NM
from jaxsparse.formats._specs import BlockSparse
from jaxsparse.formats._specs import Unstructured
from jaxsparse.pruning._calibration import check_damp
from jaxsparse.pruning._calibration import check_kernel_and_gram
from jaxsparse.pruning._calibration import check_layer_spec
from jaxsparse.pruning._select import keep_largest
from jaxsparse.pruning._select import keep_largest_in_groups

__all__ = ["SparseGPTResult", "sparsegpt_layer"]

_HIGHEST = jax.lax.Precision.HIGHEST
_UNROLL = 8  # features fixed per loop iteration (a multiple of m for N:M)
DEFAULT_BLOCK_SIZE = 128  # input features per lazy update (SparseGPT's B)


class SparseGPTResult(NamedTuple):
  """What :func:`sparsegpt_layer` returns.

  Attributes:
    kernel: the updated weights, zero where pruned, shape and dtype of the input kernel.
    mask: bool, shape of the kernel, True where kept.

  >>> import jax.numpy as jnp, jaxsparse
  >>> from jaxsparse import pruning
  >>> out = pruning.sparsegpt_layer(jnp.ones((4, 2)), jnp.eye(4), jaxsparse.NM(2, 4))
  >>> isinstance(out, pruning.SparseGPTResult), out.kernel.shape, out.kernel.dtype, out.mask.dtype
  (True, (4, 2), dtype('float32'), dtype('bool'))
  >>> kernel, mask = out  # a NamedTuple
  >>> mask.sum(axis=0).tolist()
  [2, 2]
  """

  kernel: jax.Array
  mask: jax.Array


def sparsegpt_layer(
    kernel: jax.typing.ArrayLike,
    gram: jax.typing.ArrayLike,
    spec: Unstructured | NM | BlockSparse,
    *,
    damp: float = 0.01,
    block_size: int | None = None,
    mask: jax.typing.ArrayLike | None = None,
    path: str = "kernel",
) -> SparseGPTResult:
  """Prunes one layer's kernel with SparseGPT, given the Gram matrix of its calibration inputs.

  >>> import jax, jaxsparse
  >>> from jaxsparse import pruning
  >>> x = jax.random.normal(jax.random.key(0), (256, 16))
  >>> w = jax.random.normal(jax.random.key(1), (16, 8))
  >>> out = pruning.sparsegpt_layer(w, x.T @ x, jaxsparse.NM(2, 4))
  >>> out.kernel.shape, out.mask.reshape(4, 4, 8).sum(axis=1).min().item()
  ((16, 8), 2)
  >>> bool(((out.kernel != 0) == out.mask).all())
  True

  Args:
    kernel: ``(K, N)`` weights (or ``(*in_axes, *out_axes)`` of a ``LinearGeneral`` together with
      a ``gram`` over the flattened inputs: give the 2-D view, ``kernel.reshape(K, N)``).
    gram: ``(K, K)`` ``XᵀX`` of the layer's calibration inputs (any positive scale: the result does
      not depend on it), e.g. ``LayerStats.gram`` from :func:`jaxsparse.pruning.calibrate`. The weights of
      inputs that are always zero (``gram[k, k] == 0``) are set to zero; an all-zero ``gram`` (no information)
      keeps every weight and ranks them by magnitude, with no updates.
    spec: ``jaxsparse.Unstructured(sparsity)``, ``jaxsparse.NM(n, m)`` (groups along the ``K`` input
      features) or ``jaxsparse.BlockSparse(density, block_shape)``.
    damp: ``λ`` added to the Hessian's diagonal, as a fraction of its mean diagonal; 0 needs a
      positive definite ``gram`` (more calibration tokens than inputs, no collinear features).
    block_size: input features updated exactly before the lazy update of the rest; a multiple of
      ``m`` for N:M. ``None``: 128, for N:M rounded down to a multiple of ``m`` (at least ``m``; the result does not
      depend on it, the speed does), as :func:`calibrated_prune` rounds its ``block_size``.
    mask: optional fixed ``(K, N)`` bool mask (True = kept): only update the weights for it (e.g.
      SparseGPT's weight update on a Wanda mask); ``spec`` is then used for its checks only.
    path: the layer's name, for error messages.

  Returns:
    A :class:`SparseGPTResult`: the updated kernel (computed in float32, or in float64 when ``kernel`` or
    ``gram`` is float64; cast back to the kernel's dtype) and its mask.

  Raises:
    ValueError: on shapes that do not fit, ``damp < 0``, or a Hessian that is not positive definite
      (with ``damp=0`` or data with NaNs).
  """
  args, static = solve_inputs(kernel, gram, spec, damp=damp, block_size=block_size, mask=mask, path=path)
  new, kept, ok = _solve(*args, **static)
  k = args[0].shape[0]
  if not bool(ok):
    raise ValueError(
        f"{path}: the Hessian XᵀX + damp * mean(diag) * I (damp={damp}) is not positive definite, so its "
        "Cholesky factorisation failed: the calibration inputs span fewer than all input features (fewer tokens "
        f"than K={k}, or collinear features) or contain NaN/inf. Use damp > 0 (0.01 is usual) or more data."
    )
  return SparseGPTResult(new, kept)


def solve_inputs(kernel, gram, spec, *, damp: float, block_size: int | None, mask=None, path: str = "kernel"):
  """Checks :func:`sparsegpt_layer`'s arguments; returns ``(args, static)`` of its jitted solve ``_solve``."""
  kernel, gram = check_kernel_and_gram(kernel, gram, path=path)
  k, n = kernel.shape
  check_layer_spec(spec, (k, n), path=path)
  damp = check_damp(damp)
  if block_size is None:  # the default fits every m (NM(1, 3) too), not only those that divide 128
    block_size = DEFAULT_BLOCK_SIZE if not isinstance(spec, NM) else max(spec.m, DEFAULT_BLOCK_SIZE // spec.m * spec.m)
  block_size = _utils.check_positive_int(block_size, name="block_size")
  if isinstance(spec, NM) and block_size % spec.m:
    raise ValueError(f"block_size={block_size} must be a multiple of m={spec.m} for N:M sparsity.")
  counts = jnp.zeros((-(-k // block_size),), jnp.int32)
  if mask is not None:
    mask = jnp.asarray(mask)
    if mask.shape != (k, n) or mask.dtype != jnp.bool_:
      raise ValueError(f"{path}: mask must be a bool array of shape {(k, n)}, got {mask.dtype} {mask.shape}.")
    kind, options = "fixed", ()
  elif isinstance(spec, Unstructured):
    kind, options = "unstructured", ()
    counts = jnp.asarray(_unstructured_prune_counts(spec.sparsity, k, n, block_size), jnp.int32)
  elif isinstance(spec, NM):
    kind, options = "nm", (spec.n, spec.m)
  else:
    kind, options = "block", (spec.block_shape, _utils.kept_count(spec.density, (k // spec.block_shape[0]) * (
        n // spec.block_shape[1])))
  static = dict(kind=kind, options=options, block_size=block_size)
  return (kernel, gram, mask, float(damp), counts), static


def _unstructured_prune_counts(sparsity: float, k: int, n: int, block_size: int) -> tuple[int, ...]:
  """Weights pruned per batch of input features: cumulative rounding, so they add up to the layer count."""
  edges = [*range(0, k, block_size), k]
  pruned_until = [int(sparsity * (n * e) + 0.5) for e in edges]  # kept_count() of the first e features
  return tuple(b - a for a, b in itertools.pairwise(pruned_until))


def hessian_factor(gram: jax.Array, damp: float, dtype: jax.typing.DTypeLike) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(U, dead, ok)``: upper Cholesky factor of ``(H + λI)⁻¹`` with dead inputs given ``H_kk = 1``, in ``dtype``.

  ``dead`` marks input features that were always zero (``H_kk == 0``); ``ok`` is False when a
  Cholesky factorisation failed (not positive definite).
  """
  h = gram.astype(dtype)
  k = h.shape[0]
  diag = jnp.diagonal(h)
  dead = diag == 0
  eye = jnp.eye(k, dtype=dtype)
  h = h + eye * jnp.where(dead, 1.0, 0.0)
  h = h + eye * (damp * jnp.mean(jnp.diagonal(h)))
  # With P the reversal permutation and P H P = L Lᵀ, U = P L⁻¹ P is upper triangular and UᵀU = H⁻¹:
  # one Cholesky factorisation and one triangular inverse, instead of factorising H and then H⁻¹.
  lower = jnp.linalg.cholesky(h[::-1, ::-1])
  upper = jax.scipy.linalg.solve_triangular(lower, eye, lower=True)[::-1, ::-1]
  ok = jnp.all(jnp.isfinite(lower)) & jnp.all(jnp.isfinite(upper))
  return upper, dead, ok


@functools.partial(jax.jit, static_argnames=("kind", "options", "block_size"))
def _solve(kernel, gram, fixed_mask, damp, prune_counts, *, kind, options, block_size):
  # The full batches run in one lax.scan (the compiled program does not grow with K / block_size); a last
  # partial batch, if any, runs once after it with its own static width.
  k, n = kernel.shape
  acc = _utils.accumulation_dtype(kernel.dtype, gram.dtype)  # float32, float64 for float64 kernels or Hessians
  upper, dead, ok = hessian_factor(gram, damp, acc)
  d = jnp.diagonal(upper)
  # Weights of dead inputs are zeroed (any value gives the same outputs). When every input is dead there is nothing
  # to fit: the weights stay, and with H = I the saliencies rank them by magnitude, with no updates.
  dead_weights = dead & ~jnp.all(dead)
  wt = jnp.where(dead_weights[None, :], 0.0, kernel.astype(acc).T)  # (N, K): features along the columns
  if kind == "fixed":
    mask_t = fixed_mask.T
  elif kind == "block":
    (bk, bn), kept = options
    saliency = (wt / d[None, :]) ** 2  # (N, K)
    block_scores = saliency.T.reshape(k // bk, bk, n // bn, bn).sum(axis=(1, 3))
    blocks = keep_largest(block_scores, kept)
    mask_t = jnp.repeat(jnp.repeat(blocks, bk, axis=0), bn, axis=1).T
  else:
    mask_t = jnp.zeros((n, k), bool)  # chosen batch by batch below
  group = options[1] if kind == "nm" else 1
  full, tail = divmod(k, block_size)
  columns = jnp.arange(k)

  def one_batch(wt, mask_t, i1, width, pruned):
    w1 = jax.lax.dynamic_slice_in_dim(wt, i1, width, axis=1)
    u1 = jax.lax.dynamic_slice(upper, (i1, i1), (width, width))
    if kind == "unstructured":
      d1 = jax.lax.dynamic_slice_in_dim(d, i1, width)
      m1 = keep_largest((w1 / d1[None, :]) ** 2, n * width - pruned)
    else:
      m1 = jax.lax.dynamic_slice_in_dim(mask_t, i1, width, axis=1)
    w1, m1, err1 = _batch(w1, u1, m1, kind=kind, options=options, group=group)
    return w1, m1, err1

  def scan_step(carry, xs):
    wt, mask_t = carry
    b, pruned = xs
    i1 = b * block_size
    w1, m1, err1 = one_batch(wt, mask_t, i1, block_size, pruned)
    # Lazy update of the features after the batch, over the full width: U is upper triangular, so the
    # rows i1..i2 of U are zero left of i1, and the batch's own columns i1..i2 are masked out.
    rows = jax.lax.dynamic_slice_in_dim(upper, i1, block_size, axis=0) * (columns >= i1 + block_size)
    wt = wt - jnp.matmul(err1, rows, precision=_HIGHEST)
    wt = jax.lax.dynamic_update_slice_in_dim(wt, w1, i1, axis=1)
    mask_t = jax.lax.dynamic_update_slice_in_dim(mask_t, m1, i1, axis=1)
    return (wt, mask_t), None

  if full:
    (wt, mask_t), _ = jax.lax.scan(scan_step, (wt, mask_t), (jnp.arange(full), prune_counts[:full]))
  if tail:
    i1 = full * block_size
    w1, m1, _ = one_batch(wt, mask_t, i1, tail, prune_counts[full])
    wt = wt.at[:, i1:].set(w1)
    mask_t = mask_t.at[:, i1:].set(m1)
  return wt.T.astype(kernel.dtype), mask_t.T, ok


def _batch(w1: jax.Array, u1: jax.Array, m1: jax.Array, *, kind: str, options: Any, group: int):
  """Fixes the features of one batch in order; returns (weights, mask, scaled errors) of the batch."""
  width = w1.shape[1]
  d1 = jnp.diagonal(u1)
  # Several features per loop iteration: fewer iterations, fewer copies of the loop carry on CPU.
  step = next(s for s in (group * max(1, _UNROLL // group), group) if width % s == 0)

  def fix(it, carry):
    w1, m1, err1 = carry
    start = it * step
    for j in range(step):
      i = start + j
      if kind == "nm" and j % group == 0:  # the group's mask, from the weights updated so far
        wg = jax.lax.dynamic_slice_in_dim(w1, i, group, axis=1)
        dg = jax.lax.dynamic_slice_in_dim(d1, i, group)
        keep = keep_largest_in_groups((wg / dg[None, :]) ** 2, options[0], axis=1)
        m1 = jax.lax.dynamic_update_slice_in_dim(m1, keep, i, axis=1)
      w = jax.lax.dynamic_index_in_dim(w1, i, axis=1, keepdims=False)
      q = jnp.where(jax.lax.dynamic_index_in_dim(m1, i, axis=1, keepdims=False), w, 0.0)
      e = (w - q) / d1[i]
      # U is upper triangular: row i is zero left of i, so this touches only features i.. of the batch
      w1 = w1 - e[:, None] * jax.lax.dynamic_index_in_dim(u1, i, axis=0, keepdims=True)
      w1 = jax.lax.dynamic_update_index_in_dim(w1, q, i, axis=1)
      err1 = jax.lax.dynamic_update_index_in_dim(err1, e, i, axis=1)
    return w1, m1, err1

  return jax.lax.fori_loop(0, width // step, fix, (w1, m1, jnp.zeros_like(w1)))


def reconstruction_error(kernel: jax.typing.ArrayLike, pruned: jax.typing.ArrayLike, gram: jax.typing.ArrayLike):
  """``||X w - X ŵ|| / ||X w||`` (Frobenius) from the Gram matrix ``XᵀX``, in float32 (float64 for float64 inputs).

  >>> import jax.numpy as jnp
  >>> from jaxsparse import pruning
  >>> x, w = jnp.eye(3), jnp.ones((3, 2))
  >>> round(float(pruning.reconstruction_error(w, w.at[0].set(0.0), x.T @ x)), 4)
  0.5774

  Args:
    kernel: ``(K, N)`` dense weights.
    pruned: ``(K, N)`` pruned (and updated) weights.
    gram: ``(K, K)`` ``XᵀX``.

  Returns:
    A float32 scalar; float64 when any of the arrays is float64. 0 when ``X ŵ = X w`` (also when both are zero:
    all-zero inputs give an error of 0, not NaN); ``inf`` when only ``X w`` is zero.
  """
  return _relative_error(jnp.asarray(kernel), jnp.asarray(pruned), jnp.asarray(gram))


@jax.jit
def _relative_error(w, w_hat, gram):
  acc = _utils.accumulation_dtype(w.dtype, w_hat.dtype, gram.dtype)
  w = w.astype(acc)
  delta = w - w_hat.astype(acc)
  g = gram.astype(acc)
  num = jnp.maximum(jnp.sum(jnp.matmul(g, delta, precision=_HIGHEST) * delta), 0.0)
  den = jnp.sum(jnp.matmul(g, w, precision=_HIGHEST) * w)
  # 0 / 0 (inputs all zero, or weights the inputs never reach): both outputs are zero, the error is 0, not NaN.
  return jnp.where(num > 0, jnp.sqrt(num / den), jnp.zeros((), acc))

