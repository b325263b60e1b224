"""The input axes of a model's multi-axis kernels, for the pruners that see parameters without their layers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx

from jaxsparse.pruning._calibration_linen import linen_candidates
from jaxsparse.pruning._calibration_nnx import nnx_candidates

__all__ = ["kernel_views"]


def kernel_views(
    model: Any, variables: Mapping | None = None, example_input: Any = None, *,
    apply_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, int]:
  r"""The number of input axes of every ``LinearGeneral`` / ``DenseGeneral`` kernel of a model, for ``views=``.

  The pruners (:func:`magnitude_pruner`, :func:`set_pruner`, :func:`rigl_pruner`, :func:`magnitude_masks`)
  see parameters without their layers, so they read a kernel's output axes off its layer's bias; a
  bias-free ``nnx.MultiHeadAttention(use_bias=False)`` (or Linen ``nn.MultiHeadDotProductAttention``)
  leaves its q/k/v kernels ``(in, heads, head_dim)`` ambiguous. Passing these views makes the pruners take
  blocks and N:M groups on the view :func:`jaxsparse.sparsify` uses (``(in, heads * head_dim)``; the out
  kernel ``(heads, head_dim, out)`` as ``(heads * head_dim, out)``), so their masks fit the sparse layers.

  >>> import jaxsparse
  >>> from flax import nnx
  >>> from jaxsparse import pruning
  >>> model = nnx.MultiHeadAttention(2, 32, qkv_features=32, use_bias=False, decode=False, rngs=nnx.Rngs(0))
  >>> views = pruning.kernel_views(model)
  >>> views
  {'key.kernel': 1, 'out.kernel': 2, 'query.kernel': 1, 'value.kernel': 1}
  >>> rules = {r"query|key|value|out": jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8))}
  >>> masks = pruning.magnitude_masks(model, rules, views=views)
  >>> sparse, _ = jaxsparse.sparsify(model, rules, masks=masks)
  >>> type(sparse.query).__name__
  'SparseLinearGeneral'

  Args:
    model: an ``nnx.Module``, or a Linen ``nn.Module`` (then ``variables`` and ``example_input`` too).
    variables: the Linen module's variables; ``None`` for NNX.
    example_input: an input (a tuple of positional inputs, or a mapping of keyword inputs) for
      ``module.apply``, on which the Linen layers are found; ``None`` for NNX.
    apply_kwargs: more keyword arguments for ``module.apply`` (``{"deterministic": True}``).

  Returns:
    ``{kernel path: input axes}`` (``"blocks.0.attn.query.kernel": 1``), sorted by path, for the kernel of
    every ``nnx.LinearGeneral`` / ``nn.DenseGeneral`` with more than 2 axes that contracts its input's
    trailing axes (the ones sparsify takes; the other kernels' default view is sparsify's already);
    a path is a regex that matches itself, as ``views=`` wants. Paths are those of ``nnx.state(model,
    nnx.Param)`` (NNX) or of ``variables["params"]`` (Linen), as the pruners see them.

  Raises:
    TypeError: ``variables`` or ``example_input`` given with an NNX model, or missing for a Linen one;
      ``model`` is neither an ``nnx.Module`` nor a Linen ``nn.Module``.
  """
  if isinstance(model, nnx.Module):
    if variables is not None or example_input is not None:
      raise TypeError("kernel_views of an nnx.Module takes the model only; variables and example_input are for "
                      "Linen modules.")
    candidates = [c for c in nnx_candidates(model) if len(c.kernel_shape) > 2 and c.patches is None]
  else:
    if variables is None or example_input is None:
      raise TypeError(f"kernel_views of a Linen module ({type(model).__name__}) needs its variables and an "
                      "example_input, to find its nn.DenseGeneral calls.")
    candidates = [c for c in linen_candidates(model, variables, example_input, dict(apply_kwargs or {}))
                  if len(c.kernel_shape) > 2 and c.patches is None]
  return dict(sorted((".".join(str(k) for k in (*c.key, "kernel")), c.n_in) for c in candidates
                     if c.unsupported is None))
