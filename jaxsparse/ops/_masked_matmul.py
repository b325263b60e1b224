"""``masked_matmul``: ``x @ (w * mask)`` for unstructured sparsity, with the gradient to ``w`` masked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["masked_matmul", "check_mask"]


def check_mask(mask: jax.typing.ArrayLike, shape: tuple[int, ...], *, name: str = "mask") -> jax.Array:
  """Returns ``mask`` as a bool array after checking its shape and dtype."""
  mask = jnp.asarray(mask)
  if mask.dtype != jnp.bool_:
    raise TypeError(
        f"{name} must be a boolean array, got dtype {mask.dtype}; convert 0/1 masks with "
        f"`{name}.astype(bool)`."
    )
  if mask.shape != tuple(shape):
    raise ValueError(f"{name} must have the weight's shape {tuple(shape)}, got {mask.shape}.")
  return mask


def masked_matmul(
    x: jax.typing.ArrayLike,
    w: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike,
    *,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
) -> jax.Array:
  """Computes ``x @ (w * mask)``; the gradient with respect to ``w`` is zero where ``mask`` is False.

  >>> import jax.numpy as jnp, jaxsparse
  >>> w = jnp.arange(6.0).reshape(3, 2)
  >>> mask = jnp.array([[True, False], [False, True], [True, True]])
  >>> jaxsparse.ops.masked_matmul(jnp.ones((1, 3)), w, mask)
  Array([[4., 8.]], dtype=float32)

  Args:
    x: ``(..., K)`` activations.
    w: ``(K, N)`` dense weights (Flax kernel layout).
    mask: bool ``(K, N)``; pruned entries contribute nothing and receive no gradient.
    precision: passed to the matmul.
    preferred_element_type: output dtype; defaults to ``result_type(x, w)``.

  Returns:
    ``(..., N)`` array.
  """
  x, w = jnp.asarray(x), jnp.asarray(w)
  if w.ndim != 2:
    raise ValueError(f"w must be 2-D (K, N), got shape {w.shape}.")
  if x.ndim < 1 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"x must have shape (..., K) with K = w.shape[0] = {w.shape[0]}, got x.shape={x.shape}.")
  mask = check_mask(mask, w.shape)
  out_dtype = preferred_element_type or jnp.result_type(x.dtype, w.dtype)
  # d(w * mask)/dw = mask, so autodiff already masks the weight gradient.
  w_eff = jnp.where(mask, w, jnp.zeros((), w.dtype))
  return jnp.matmul(x, w_eff, precision=precision, preferred_element_type=out_dtype)
