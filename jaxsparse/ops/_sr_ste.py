"""``sr_ste``: N:M pruning with the sparse-refined straight-through estimator (SR-STE).

Forward: ``w * nm_mask(w)``. Backward: the output cotangent passes straight through to the dense
``w`` (the straight-through estimator), plus ``decay * (1 - mask) * w`` on the pruned entries,
which pulls pruned weights towards zero so that the mask settles (Zhou et al., 2021).
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp

from jaxsparse.formats import _nm

__all__ = ["sr_ste"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _sr_ste(w: jax.Array, n: int, m: int, axis: int, decay: float) -> jax.Array:
  return jnp.where(_nm.nm_mask(w, n, m, axis=axis), w, jnp.zeros((), w.dtype))


def _sr_ste_fwd(w, n, m, axis, decay):
  mask = _nm.nm_mask(w, n, m, axis=axis)
  residuals = (w, mask) if decay else (None, None)
  return jnp.where(mask, w, jnp.zeros((), w.dtype)), residuals


def _sr_ste_bwd(n, m, axis, decay, res, g):
  w, mask = res
  if not decay:
    return (g,)
  # g + decay * (1 - mask) * w, computed in the cotangent's dtype.
  return (g + jnp.where(mask, jnp.zeros((), g.dtype), (decay * w).astype(g.dtype)),)


_sr_ste.defvjp(_sr_ste_fwd, _sr_ste_bwd)


def sr_ste(w: jax.typing.ArrayLike, n: int, m: int, *, decay: float = 2e-4, axis: int = 0) -> jax.Array:
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
    decay: SR-STE's ``lambda_W`` (>= 0); ``0`` gives plain STE.
    axis: the axis the groups run along (0: input features of a Dense kernel; -2: ``cin`` of a
      Conv kernel).

  Returns:
    The N:M-pruned ``w``, same shape and dtype.
  """
  w = jnp.asarray(w)
  n, m = _nm.check_nm(n, m)
  axis = _nm.check_axis(axis, w.ndim)
  if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not decay >= 0:
    raise ValueError(f"decay must be a float >= 0 (0 gives plain STE), got decay={decay!r}.")
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise TypeError(f"w must have a floating dtype to be trained, got {w.dtype}.")
  _nm.check_groups(w.shape, axis, m)
  return _sr_ste(w, n, m, axis, float(decay))
