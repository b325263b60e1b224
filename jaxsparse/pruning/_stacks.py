"""Stacks of layers for the pruners: the leading layer axes of parameters stacked by ``nnx.vmap`` / ``nn.scan``.

A stack of ``L`` layers (``nnx.vmap`` over split rngs, Linen ``nn.scan`` / ``nn.vmap``: the "scan over layers" of
LLM code) holds each parameter once, with leading layer axes: a kernel ``(L, K, N)``. The pruners see parameters,
not layers, so they prune such a kernel per layer slice only where they know its layer axes: read off an
``nnx.Module`` (each layer knows its own kernel's rank), given by ``stacks=`` (``{regex: layer axes}``), or found by
:func:`layer_stacks` for a model whose parameters are handed over without it (``nnx.Optimizer``, a Linen
``TrainState``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx

from jaxsparse._rules import get_module
from jaxsparse._rules import match_rules
from jaxsparse._rules import module_paths
from jaxsparse._rules import path_str
from jaxsparse._rules import resolve_counts
from jaxsparse.pruning._calibration_linen import linen_args
from jaxsparse.pruning._calibration_stacks import nnx_layer_ndim

__all__ = ["layer_stacks"]

Stacks = Mapping[str, int]


def resolve_stacks(stacks: Any) -> list[tuple[str, Any, int]]:
  """``stacks`` (``{regex: leading layer axes}``, or ``None``) as ``[(pattern, compiled, axes)]``, checked."""
  return resolve_counts(stacks, "stacks", "a parameter's number of leading layer axes (as pruning.layer_stacks "
                        "returns it)", "an int >= 0 (the parameter's leading layer axes; 0: not a stack)", minimum=0)


def stack_of(resolved: list[tuple[str, Any, int]], found: Mapping[str, int], path: str, owner: str) -> int | None:
  """The leading layer axes of the parameter at ``path``: the first of ``resolved`` (``stacks=``) matching it (or its
  layer ``owner``), else those ``found`` on the model, else ``None`` (not known)."""
  r = match_rules(resolved, path, owner=owner)
  return resolved[r][2] if r is not None else found.get(path)


def nnx_stacks(model: Any) -> dict[str, int]:
  """``{parameter path: leading layer axes}`` of every stacked layer's ``kernel`` / ``embedding`` in an NNX graph (an
  ``nnx.Module``, an ``nnx.Optimizer`` holding one), at every path of a tied layer; ``{}`` for another tree."""
  if not isinstance(model, nnx.Pytree):
    return {}
  out = {}
  for paths in module_paths(model).values():
    node = get_module(model, paths[0])
    for name in ("kernel", "embedding"):
      var = getattr(node, name, None)
      own = nnx_layer_ndim(node, name) if isinstance(var, nnx.Variable) and hasattr(var, "shape") else None
      if own is not None and len(var.shape) > own:
        out.update({path_str((*p, name)): len(var.shape) - own for p in paths})
  return out


def linen_stacks(module: nn.Module, variables: Mapping, example_input: Any, apply_kwargs: Mapping) -> dict[str, int]:
  """``{parameter path: leading layer axes}`` of the parameters of Linen ``variables`` (of 2 or more axes per layer,
  those the pruners prune) whose layer sees them with fewer axes than they are stored with (``nn.scan`` /
  ``nn.vmap`` over layers): every layer called on ``example_input`` is intercepted and its own ``params`` read."""
  own: dict[str, int] = {}

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    params = context.module.variables.get("params", {}) if context.module.scope is not None else {}
    for name, value in params.items():
      if not isinstance(value, Mapping):
        own.setdefault(path_str((*context.module.path, name)), len(np.shape(nn.meta.unbox(value))))
    return out

  args, kwargs = linen_args(example_input)
  with nn.intercept_methods(interceptor):
    jax.eval_shape(lambda v, *a: module.apply(v, *a, **kwargs, **apply_kwargs), variables, *args)
  pairs = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(variables.get("params", {})))[0]
  stored = {path_str(kp): len(np.shape(leaf)) for kp, leaf in pairs}
  return {p: stored[p] - n for p, n in own.items() if n >= 2 and p in stored and stored[p] > n}


def layer_stacks(
    model: Any, variables: Mapping | None = None, example_input: Any = None, *,
    apply_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, int]:
  r"""The leading layer axes of every stacked parameter of a model (``nnx.vmap`` / ``nn.scan`` over layers), for
  ``stacks=``.

  A stack of ``L`` layers holds each parameter with a leading layer axis (a kernel ``(L, K, N)``). The pruners
  (:func:`magnitude_pruner`, :func:`set_pruner`, :func:`rigl_pruner`, :func:`magnitude_masks`) prune it per layer
  slice, each layer to its rule's sparsity, only where they know the layer axes: :func:`magnitude_masks` of an
  ``nnx.Module`` reads them off the model itself, but an optimizer (``nnx.Optimizer``, a Linen ``TrainState``)
  hands them bare parameters. Pass them these stacks. (Calibrated pruning, :func:`calibrated_prune` and
  :func:`calibrated_prune_linen`, finds the stacks on the model itself and prunes each layer on its own inputs.)

  >>> import jax, optax, jaxsparse
  >>> from flax import nnx
  >>> from jaxsparse import pruning
  >>> @nnx.split_rngs(splits=3)
  ... @nnx.vmap(in_axes=(0,), out_axes=0)
  ... def make(rngs):
  ...   return nnx.Linear(16, 8, rngs=rngs)
  >>> stack = make(nnx.Rngs(0))
  >>> pruning.layer_stacks(stack)
  {'kernel': 1}
  >>> pruner = pruning.magnitude_pruner(jaxsparse.Unstructured(0.75), stacks=pruning.layer_stacks(stack))
  >>> optimizer = nnx.Optimizer(stack, pruning.wrap_optax(optax.sgd(0.1), pruner), wrt=nnx.Param)
  >>> pruning.get_masks(optimizer)["kernel"].mean(axis=(1, 2)).tolist()  # each layer keeps a quarter
  [0.25, 0.25, 0.25]

  Args:
    model: an ``nnx.Module`` (or an ``nnx.Optimizer`` that holds one), or a Linen ``nn.Module`` (then
      ``variables`` and ``example_input`` too).
    variables: the Linen module's variables (boxed or not); ``None`` for NNX.
    example_input: an input (a tuple of positional inputs, or a mapping of keyword inputs) for ``module.apply``,
      on which the Linen layers are found; ``None`` for NNX.
    apply_kwargs: more keyword arguments for ``module.apply``.

  Returns:
    ``{parameter path: leading layer axes}`` (``"blocks.mlp.fc1.kernel": 1``), sorted by path, for every stacked
    parameter the pruners may prune: NNX: each ``kernel`` / ``embedding`` with more axes than its layer's fields give
    it (``nnx.Linear``: 2, ``nnx.Conv``: its window + 2, ``nnx.LinearGeneral``: its batch, input and output axes,
    jaxsparse's layers likewise); Linen: each parameter of 2 or more axes stored with more axes than its layer sees
    when called on ``example_input``. Paths are those the pruners see (``nnx.state(model, nnx.Param)``,
    ``variables["params"]``); a path is a regex that matches itself.

  Raises:
    TypeError: ``variables`` or ``example_input`` given with an NNX model, or missing for a Linen one; ``model`` is
      neither an NNX object nor a Linen ``nn.Module``.
  """
  if isinstance(model, nnx.Pytree):
    if variables is not None or example_input is not None:
      raise TypeError("layer_stacks of an nnx.Module takes the model only; variables and example_input are for "
                      "Linen modules.")
    return dict(sorted(nnx_stacks(model).items()))
  if not isinstance(model, nn.Module):
    raise TypeError(f"model must be an nnx.Module or a Linen nn.Module, got {type(model).__name__}.")
  if variables is None or example_input is None:
    raise TypeError(f"layer_stacks of a Linen module ({type(model).__name__}) needs its variables and an "
                    "example_input, to call its layers.")
  return dict(sorted(linen_stacks(model, variables, example_input, dict(apply_kwargs or {})).items()))
