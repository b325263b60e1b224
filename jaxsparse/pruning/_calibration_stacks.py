"""Stacks of layers in calibration: a layer held as ``L`` stacked copies (``nnx.vmap`` over split rngs, Linen
``nn.scan`` / ``nn.vmap``: a kernel ``(L, K, N)``) that the model applies one layer at a time under a transform over
its layer axis (``nnx.scan`` / ``nn.scan``, the "scan over layers"; or ``nnx.vmap`` / ``nn.vmap``).

The calibration hooks see such a layer once, when the transform traces its body: with one step's input ``(..., K)``
and one layer's kernel ``(K, N)``, never with the layer's index, and an input recorded there is a tracer of the
body that cannot leave it. So a stack's statistics are summed inside the body, into accumulators with the kernel's
leading layer axes that the transform slices and stacks back as it does the kernel: the variables of a
:class:`StackProbe` that stands in for the NNX layer (of the kernel's variable type, so ``nnx.StateAxes`` give them
the kernel's axis), entries of the Linen layer's ``params`` (:data:`LINEN_ACCUMULATOR`; ``nn.scan``'s
``variable_axes={"params": 0}`` slices them). Layer ``l``'s statistics are those of its own inputs.

Pruning then takes each layer of the stack as a layer of its own (:func:`layer_slices`): solved on its ``(K, N)``
slice with its own statistics, reported as ``"blocks.fc[3]"``, and in sequential mode put in the group of the block
of the path it would have unstacked (``"blocks.3.fc"``: with the other layers of block 3), the layers of a stack
taken in ascending order (a scan with ``reverse=True`` runs them the other way; pass ``sequential=False`` or your own
groups for it). Each group's calibration pass gathers the statistics of every layer of the stacks it prunes (a Gram
matrix per layer; XLA cannot drop the rest of a scan as it drops the layers after an unstacked group). A stack of
embedding tables, or a stack the model calls with its layer axes unsliced, is refused with an error naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx

LINEN_ACCUMULATOR = "jaxsparse_calibration_{}"  # the params entry of a Linen stack's statistic while calibrating
STATS_FIELDS = ("sq_norms", "gram", "tokens")


def nnx_layer_ndim(node: nnx.Module, name: str) -> int | None:
  """The rank of the parameter ``name`` of one layer ``node``, from its fields; ``None`` where they do not say."""
  if name == "embedding" and hasattr(node, "num_embeddings"):
    return 2
  if name != "kernel":
    return None
  if getattr(type(node), "_kernel_layout", None) == "blocks":  # BlockSparseLinear: kept blocks (nnz, bk, bn)
    return 3
  if hasattr(node, "kernel_size"):  # the convs: (*window, in_features // groups, out_features)
    size = node.kernel_size
    return (len(size) if isinstance(size, Sequence) else 1) + 2
  if isinstance(node, nnx.LinearGeneral):
    return len(node.batch_axis) + len(node.in_features) + len(node.out_features)
  if isinstance(node, nnx.Einsum):
    return len(node.kernel_shape)
  if isinstance(getattr(node, "in_features", None), int) and isinstance(getattr(node, "out_features", None), int):
    return 2
  return None


def stack_root(shapes: Iterable[tuple[tuple, tuple[int, ...]]], key: tuple, stack: tuple[int, ...]) -> int:
  """How many parts of the layer path ``key`` lie above the stack: the shortest prefix of ``key`` under which every
  array (``shapes``: ``(path, shape)`` of the model's arrays) has the leading axes ``stack``, the module that
  ``nnx.vmap`` / ``nn.scan`` made (``("blocks", "mlp", "fc1")`` of ``Model.blocks``: 1). Layer ``l`` of the stack
  would have the path ``key[:root] + (l,) + key[root:]`` unstacked (``"blocks.3.mlp.fc1"``)."""
  shapes = [(tuple(p), tuple(s)) for p, s in shapes]
  for i in range(len(key) + 1):
    under = [s for p, s in shapes if p[:i] == tuple(key[:i])]
    if under and all(s[: len(stack)] == tuple(stack) for s in under):
      return i
  return len(key)


def whole_stack_message(path: str, stack: tuple[int, ...], kernel_shape: tuple[int, ...], seen: tuple[int, ...],
                        k: int, how: str) -> str:
  """The error for a stacked layer that the model calls with its layer axes unsliced."""
  return (f"{path or '(model)'}: a stack of {int(np.prod(stack))} layers (kernel {(*stack, *kernel_shape)}, leading "
          f"layer axes {stack}) is called with its layer axes unsliced (its statistics are {seen} inside the call, "
          f"not ({k},)). Calibration takes a stack applied one layer at a time, {how}. Unstack it into separate "
          "layers, exclude it with a None rule, or prune it by magnitude, which prunes each layer of a stack "
          "(pruning.magnitude_masks, or a pruner with stacks=pruning.layer_stacks(...)).")


class StackProbe(nnx.Module):
  """Stands in for a stacked NNX layer: adds each call's input to its statistics, NNX variables with the kernel's
  leading layer axes that the model's ``nnx.scan`` / ``nnx.vmap`` slices per layer and stacks back.

  ``update(stats, x) -> stats`` adds one call's input ``x`` to one layer's ``(sq_norms, gram, tokens)`` (``gram``
  ``None`` when not collected); ``check(shape)`` raises unless ``shape`` is one layer's ``sq_norms`` shape.
  """

  def __init__(self, inner: nnx.Module, stats: tuple, variable_type: type, update: Callable, check: Callable):
    self.inner = inner
    self.sq_norms, self.gram, self.tokens = (None if a is None else variable_type(a) for a in stats)
    self.update = update
    self.check = check

  def stats(self) -> tuple:
    """The stack's statistics so far: ``(sq_norms, gram, tokens)``, with its leading layer axes."""
    return tuple(None if v is None else v.get_value() for v in (self.sq_norms, self.gram, self.tokens))

  def __call__(self, x, *args, **kwargs):
    self.check(self.sq_norms.shape)
    for v, new in zip((self.sq_norms, self.gram, self.tokens), self.update(self.stats(), x), strict=True):
      if v is not None:
        v.set_value(new)
    return self.inner(x, *args, **kwargs)


def with_linen_accumulators(params: Mapping, key: tuple, stats: tuple) -> dict:
  """A copy of ``params`` whose module at ``key`` also holds ``stats`` (``(sq_norms, gram, tokens)``, stacked) as
  :data:`LINEN_ACCUMULATOR` entries; only the dicts along ``key`` are copied."""
  out = dict(params)
  node = out
  for k in key:
    node[k] = dict(node[k])
    node = node[k]
  for name, a in zip(STATS_FIELDS, stats, strict=True):
    if a is not None:
      node[LINEN_ACCUMULATOR.format(name)] = a
  return out


def linen_accumulators(params: Mapping, key: tuple, gram: bool) -> tuple:
  """The stacked ``(sq_norms, gram, tokens)`` that :func:`with_linen_accumulators` put at ``key`` in ``params``."""
  for k in key:
    params = params[k]
  return tuple(params[LINEN_ACCUMULATOR.format(name)] if name != "gram" or gram else None for name in STATS_FIELDS)


def layer_slices(layers: Sequence[Any]) -> list[Any]:
  """Every layer of ``layers`` (in the order the model calls them) with each stacked one as its layers, a copy each
  with ``index`` set, in the order the model runs them: a stack's layer 0 of every stacked layer called in its body,
  then its layer 1, ... (a scan over layers in ascending order), where the stack's first layer is called.

  A stack is known by where it sits (``key[:root]``) and its layer axes ``stack``.
  """
  first: dict[tuple, int] = {}
  for pos, layer in enumerate(layers):
    if layer.stack:
      first.setdefault((layer.key[: layer.root], layer.stack), pos)
  keyed = []
  for pos, layer in enumerate(layers):
    if not layer.stack:
      keyed.append(((pos, ()), pos, layer))
      continue
    start = first[(layer.key[: layer.root], layer.stack)]
    keyed += [((start, index), pos, dataclasses.replace(layer, index=index)) for index in np.ndindex(*layer.stack)]
  return [layer for *_, layer in sorted(keyed, key=lambda t: t[:2])]
