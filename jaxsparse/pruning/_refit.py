"""Least-squares refit of a pruned layer's kept weights for its final mask, by masked conjugate gradient.

SparseGPT fixes the input features one at a time and never revisits a feature once fixed, so its
weights are not the least-squares optimum for the mask it ends with; Wanda and magnitude pruning do
not update the weights at all. For a fixed ``(K, N)`` mask ``M`` the optimum of
``||X w - X ŵ||² + λ||w - ŵ||²`` (``λ`` SparseGPT's damping) over weights ``ŵ`` zero outside ``M``
solves, for every output ``n`` with kept inputs ``S = M[:, n]``,
``H_SS ŵ_S = (H w)_S`` with ``H = XᵀX + λI``. All outputs are solved at once by conjugate gradient
on the operator ``V -> M ⊙ (H V)`` (one ``(K, K) x (K, N)`` product per iteration), with per-output
step sizes and a Jacobi (diagonal) preconditioner.

References:
  Boža, "Fast and Optimal Weight Update for Pruned Large Language Models", 2024,
  https://arxiv.org/abs/2401.02938 (solves the same problem with ADMM).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxsparse import _utils
from jaxsparse.pruning._calibration import check_damp
from jaxsparse.pruning._calibration import check_kernel_and_gram

__all__ = ["refit_layer"]

_HIGHEST = jax.lax.Precision.HIGHEST


def refit_layer(
    kernel: jax.typing.ArrayLike,
    gram: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike,
    *,
    start: jax.typing.ArrayLike | None = None,
    damp: float = 0.01,
    iterations: int = 50,
    path: str = "kernel",
) -> jax.Array:
  """Least-squares weights of a pruned layer for a fixed mask: ``argmin ||X w - X ŵ||`` with ``ŵ = 0`` off ``mask``.

  >>> import jax, jaxsparse
  >>> from jaxsparse import pruning
  >>> x = jax.random.normal(jax.random.key(0), (256, 16))
  >>> w = jax.random.normal(jax.random.key(1), (16, 8))
  >>> mask = pruning.wanda_layer(w, (x ** 2).sum(0), jaxsparse.NM(2, 4))
  >>> refit = pruning.refit_layer(w, x.T @ x, mask)
  >>> bool(((refit != 0) <= mask).all())
  True
  >>> err = lambda w_hat: float(pruning.reconstruction_error(w, w_hat, x.T @ x))
  >>> err(refit) < err(w * mask)
  True

  Args:
    kernel: ``(K, N)`` dense weights (the 2-D view of a ``LinearGeneral`` or conv kernel).
    gram: ``(K, K)`` ``XᵀX`` of the layer's calibration inputs (any positive scale).
    mask: ``(K, N)`` bool, True where kept.
    start: ``(K, N)`` initial pruned weights (e.g. SparseGPT's); default ``kernel * mask``. Outputs
      whose error the refit would not lower keep these weights.
    damp: ``λ`` added to the Hessian's diagonal as a fraction of its mean diagonal, as SparseGPT's.
    iterations: conjugate-gradient iterations (exact after ``max(kept per output)`` in exact
      arithmetic; in float32 the error stops falling well before that).
    path: the layer's name, for error messages.

  Returns:
    The refitted ``(K, N)`` weights, zero where ``mask`` is False, in ``kernel``'s dtype (computed in
    float32, or float64 when ``kernel``, ``gram`` or ``start`` is float64, with ``HIGHEST`` precision
    products). Each output's reconstruction error on ``gram`` is never above ``start``'s.

  Raises:
    ValueError: ``kernel`` is not 2-D; ``gram`` is not ``(K, K)``; ``mask`` is not a bool array of shape
      ``(K, N)``; ``start`` is not ``(K, N)``; ``damp`` is not a finite float ``>= 0``; ``iterations`` is not a
      positive int. The message names ``path``.
  """
  kernel, gram = check_kernel_and_gram(kernel, gram, path=path)
  mask = jnp.asarray(mask)
  k, n = kernel.shape
  if mask.shape != (k, n) or mask.dtype != jnp.bool_:
    raise ValueError(f"{path}: mask must be a bool array of shape {(k, n)}, got {mask.dtype} {mask.shape}.")
  start = kernel * mask if start is None else jnp.asarray(start)
  if start.shape != (k, n):
    raise ValueError(f"{path}: start must have the kernel's shape {(k, n)}, got {start.shape}.")
  damp = check_damp(damp)
  iterations = _utils.check_positive_int(iterations, name="iterations")
  return _refit(kernel, gram, mask, start, damp, iterations).astype(kernel.dtype)


@functools.partial(jax.jit, static_argnames=("iterations",))
def _refit(kernel, gram, mask, start, damp, iterations):
  acc = _utils.accumulation_dtype(kernel.dtype, gram.dtype, start.dtype)  # float32, float64 for float64 inputs
  w = kernel.astype(acc)
  g = gram.astype(acc)
  k = g.shape[0]
  diag = jnp.diagonal(g)
  # Dead inputs (always zero) get H_kk = 1 as in SparseGPT: their kept weights go back to the dense ones.
  h = g + jnp.diag(jnp.where(diag == 0, 1.0, 0.0).astype(acc))
  h = h + jnp.eye(k, dtype=acc) * (damp * jnp.mean(jnp.diagonal(h)))
  inv_d = 1.0 / jnp.diagonal(h)
  m = mask.astype(acc)

  def apply(v):
    return m * jnp.matmul(h, v, precision=_HIGHEST)

  x0 = m * start.astype(acc)
  r0 = m * jnp.matmul(h, w - x0, precision=_HIGHEST)  # M ⊙ (H w - H x0)
  z0 = inv_d[:, None] * r0
  rz0 = jnp.sum(r0 * z0, axis=0)

  def step(_, carry):
    x, r, p, rz = carry
    ap = apply(p)
    pap = jnp.sum(p * ap, axis=0)
    alpha = jnp.where(pap > 0, rz / jnp.where(pap > 0, pap, 1.0), 0.0)  # converged outputs stop
    x = x + alpha * p
    r = r - alpha * ap
    z = inv_d[:, None] * r
    rz_new = jnp.sum(r * z, axis=0)
    beta = jnp.where(rz > 0, rz_new / jnp.where(rz > 0, rz, 1.0), 0.0)
    return x, r, z + beta * p, rz_new

  x, *_ = jax.lax.fori_loop(0, iterations, step, (x0, r0, z0, rz0))

  def column_errors(v):
    d = w - v
    return jnp.sum(d * jnp.matmul(g, d, precision=_HIGHEST), axis=0)

  # Conjugate gradient lowers the damped objective at every step in exact arithmetic; in float32 an
  # output may still end worse on the undamped error, so it keeps its start.
  better = column_errors(x) <= column_errors(x0)
  return jnp.where(better[None, :], x, x0)
