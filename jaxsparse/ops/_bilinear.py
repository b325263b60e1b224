"""Custom VJPs of sparse products ``y = x @ W`` that are differentiable again, to any order in reverse mode.

A product's backward pass runs kernels (Pallas, the C++ FFI kernels) that JAX cannot differentiate, so a
plain ``custom_vjp`` makes ``grad`` of ``grad`` fail (Hessian-vector products, gradient penalties,
MAML). The product is bilinear in ``x`` and the weight's values ``v``, and so is its backward pass
``(dX, dv) = (B_xᵀ(dY, v), B_vᵀ(x, dY))``; the derivatives of that pair are again the same products. With
cotangents ``(gX, gv)`` of ``(dX, dv)``, by adjointness:

* ``x̄ = B_xᵀ(dY, gv)`` and ``v̄ = B_vᵀ(gX, dY)``: the backward pass of ``(gX, dY, gv)``;
* ``dȲ = B(gX, v) + B(x, gv)``: two forward products.

:func:`bilinear_product` builds the op from its forward and backward functions, each a ``custom_vjp``
whose rule calls the other, so every derivative runs on the same kernels. Forward mode (``jvp``) stays
unsupported, as for any ``custom_vjp``: ``jax.jacrev(jax.jacrev(f))`` gives a Hessian where
``jax.hessian`` cannot.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from jaxsparse import _utils

__all__ = ["bilinear_product"]


def _with_values(w: Any, values: Any) -> Any:
  """``w`` with its first leaf (the values; the other leaves are the integer / bool pattern) replaced."""
  leaves, tree = jax.tree_util.tree_flatten(w)
  return jax.tree_util.tree_unflatten(tree, [values, *leaves[1:]])


def _cotangent(w: Any, values: Any) -> Any:
  """The cotangent of ``w``: ``values`` for its values, ``None`` (no gradient) for its pattern leaves."""
  leaves, tree = jax.tree_util.tree_flatten(w)
  return jax.tree_util.tree_unflatten(tree, [values] + [None] * (len(leaves) - 1))


def bilinear_product(forward: Callable, backward: Callable, *,
                     in_step: Callable[[Any], Any] | None = None) -> Callable:
  """``apply(cfg, x, w)``: ``forward(cfg, x, w)`` with a VJP by ``backward`` that can be differentiated again.

  Args:
    forward: ``(cfg, x, w) -> y``, ``y`` of ``cfg.out_dtype``.
    backward: ``(cfg, x, dy, w) -> (dx, dv)``: ``dx`` of ``x``'s dtype, ``dv`` the gradient of the values.
    in_step: ``cfg -> cfg``, the forward's config where it runs in a differentiated call (the custom VJP's forward
      rule, followed by ``backward``): e.g. one whose routes are tuned in the train step. ``None``: ``cfg``.

    ``cfg`` is static (hashable) with an ``out_dtype`` field; ``w`` is a pytree whose first leaf holds the
    values and whose other leaves hold the pattern (no gradient).

  Returns:
    The differentiable ``apply``.
  """

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def apply(cfg, x, w):
    return forward(cfg, x, w)

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def grads(cfg, x, dy, w):
    return backward(cfg, x, dy, w)

  # The rules call `apply` / `grads`, not `forward` / `backward`: differentiating a rule (grad of grad) then
  # meets these custom VJPs again instead of the kernels.
  def apply_fwd(cfg, x, w):
    return apply(cfg if in_step is None else in_step(cfg), x, w), (x, w)

  def apply_bwd(cfg, res, dy):
    x, w = res
    dx, dv = grads(cfg, x, dy, w)
    return dx, _cotangent(w, dv)

  def grads_fwd(cfg, x, dy, w):
    return grads(cfg, x, dy, w), (x, dy, w)

  def grads_bwd(cfg, res, cotangents):
    x, dy, w = res
    gx, gv = cotangents
    wg = _with_values(w, gv)
    x_bar, v_bar = grads(cfg, gx, dy, wg)
    to_dy = dataclasses.replace(cfg, out_dtype=dy.dtype)
    dy_bar = apply(to_dy, gx, w) + apply(to_dy, x, wg)
    return x_bar, dy_bar, _cotangent(w, v_bar)

  apply.defvjp(apply_fwd, apply_bwd)
  grads.defvjp(grads_fwd, grads_bwd)

  def call(cfg, x, w):
    # Inside shard_map(check_vma=True): the kernels take operands that vary alike (a replicated w cast to vary as
    # x does, its cotangent then summed over those axes by JAX).
    return apply(cfg, *_utils.vary_alike(x, w))

  return call
