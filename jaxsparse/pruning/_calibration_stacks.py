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
taken in the order the model runs them. That order is read from the model's jaxpr (:func:`scan_axes`, on the trace
that finds the call order): the stack's kernel is followed from the model's inputs to the ``scan`` that slices its
layer axis (``nnx.scan`` / ``nn.scan`` call ``jax.lax.scan``), whose ``reverse`` says whether layer ``L - 1`` runs
first; a stack the model flips itself (``kernel[::-1]``) before a scan counts as reversed. A layer axis that no scan
slices (``nnx.vmap`` / ``nn.vmap``: the layers run side by side, none on another's outputs) is taken in ascending
order, which any order equals. Without batches (magnitude pruning) there is no trace: the layers are taken in
ascending order, which the masks do not depend on. Each group's calibration pass gathers the statistics of every
layer of the stacks it prunes (a Gram matrix per layer; XLA cannot drop the rest of a scan as it drops the layers
after an unstacked group). A stack of embedding tables, or a stack the model calls with its layer axes unsliced, is
refused with an error naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx

from jaxsparse.pruning._calibration_tables import inner_jaxprs

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
  with ``index`` set, in the order the model runs them: where the stack's first layer is called, the first layer the
  model's scan over the stack runs of every stacked layer called in its body, then the next, ... (layer ``0, 1, ...``
  of a forward scan, ``L - 1, L - 2, ...`` of one with ``reverse=True``; ``Layer.scans``).

  A stack is known by where it sits (``key[:root]``) and its layer axes ``stack``; its layers run in one scan, the
  first it was found in (``Layer.scans`` of its first layer that has them).
  """
  first: dict[tuple, int] = {}
  scans: dict[tuple, tuple] = {}
  for pos, layer in enumerate(layers):
    if layer.stack:
      first.setdefault((layer.key[: layer.root], layer.stack), pos)
      if layer.scans:
        scans.setdefault((layer.key[: layer.root], layer.stack), layer.scans)
  keyed = []
  for pos, layer in enumerate(layers):
    if not layer.stack:
      keyed.append(((pos, ()), pos, layer))
      continue
    stack = (layer.key[: layer.root], layer.stack)
    keyed += [((first[stack], run_rank(index, layer.stack, scans.get(stack, ()))), pos,
               dataclasses.replace(layer, index=index)) for index in np.ndindex(*layer.stack)]
  return [layer for *_, layer in sorted(keyed, key=lambda t: t[:2])]


def run_rank(index: tuple[int, ...], stack: tuple[int, ...], scans: Sequence[tuple[int, bool]]) -> tuple[int, ...]:
  """Where layer ``index`` of a stack with layer axes ``stack`` runs, as a sort key: its step in each scan of
  ``scans`` (``(axis, reverse)``, outermost first), then its index on the other axes (run side by side: any order)."""
  scanned = {axis for axis, _ in scans}
  steps = [stack[axis] - 1 - index[axis] if reverse else index[axis] for axis, reverse in scans]
  return (*steps, *(index[axis] for axis in range(len(stack)) if axis not in scanned))


# The equations that pass an array on unchanged but for its dtype or placement: a stack's kernel stays one.
_PASS_THROUGH = frozenset({"convert_element_type", "copy", "copy_p", "sharding_constraint", "reduce_precision",
                           "optimization_barrier"})


def scan_axes(closed_jaxpr: Any, tracked: Mapping[int, tuple[Hashable, int]]) -> dict[Hashable, tuple]:
  """How the model runs the layers of its stacks: ``{key: ((axis, reverse), ...)}`` for the jaxpr inputs ``tracked``
  (``{invar index: (key, number of layer axes)}``, a stack's kernel), each layer axis that a ``scan`` slices (the
  ``xs`` of ``jax.lax.scan``, which ``nnx.scan`` / ``nn.scan`` call) with whether the layers run from the last to the
  first (the scan's ``reverse``, flipped when the model reverses the axis itself, ``kernel[::-1]``), outermost scan
  first; the first scan over an axis (in program order) counts, as a layer's first call sets its place in sequential
  pruning.

  The kernel is followed into the jaxprs of calls (``jit``, ``checkpoint``, ``scan``, ``cond``, ``while``, custom
  derivatives), through transposes of the layer axes (``nnx.vmap`` / ``nn.vmap`` around a scan over the next axis),
  ``rev`` and casts; an axis it is not followed to a scan over (a vmap over the layers, which runs them side by
  side) is left out, and the layers on it are taken in ascending order.
  """
  jaxpr = closed_jaxpr.jaxpr
  found: dict[Hashable, dict[int, bool]] = {}
  start = {id(jaxpr.invars[i]): (key, tuple((axis, False) for axis in range(ndim))) for i, (key, ndim)
           in tracked.items()}
  _follow(jaxpr, start, found)
  return {key: tuple(axes.items()) for key, axes in found.items()}


def _follow(jaxpr: Any, tags: dict[int, tuple], found: dict[Hashable, dict[int, bool]]) -> list:
  """Follows the tagged variables of ``jaxpr`` (``{id(var): (key, ((stack axis, flipped), ...))}``, the layer axes
  still leading the array, in its order) through its equations, recording in ``found`` each scan over a layer axis;
  returns the tags of the jaxpr's outputs."""
  tags = dict(tags)
  for eqn in jaxpr.eqns:
    ins = [tags.get(id(v)) for v in eqn.invars]
    if not any(ins):
      continue
    name = eqn.primitive.name
    if name in _PASS_THROUGH:
      tags.update({id(o): t for o, t in zip(eqn.outvars, ins, strict=False) if t is not None})
    elif name == "transpose":  # the layer axes that still lead, in their new order
      (key, axes), perm = ins[0], eqn.params["permutation"]
      lead = [axes[p] for p in perm[: next((i for i, p in enumerate(perm) if p >= len(axes)), len(perm))]]
      if lead:
        tags[id(eqn.outvars[0])] = (key, tuple(lead))
    elif name == "rev":
      (key, axes), flip = ins[0], set(eqn.params["dimensions"])
      tags[id(eqn.outvars[0])] = (key, tuple((a, r != (i in flip)) for i, (a, r) in enumerate(axes)))
    elif name == "scan":  # its xs (after the consts and the carry) are sliced along their leading axis
      body = getattr(eqn.params["jaxpr"], "jaxpr", eqn.params["jaxpr"])  # a ClosedJaxpr (jax < 0.11) or a Jaxpr
      inner = {}
      for var, outer, tag in zip(body.invars, eqn.invars, ins, strict=True):
        if tag is None:
          continue
        key, axes = tag
        if len(outer.aval.shape) > len(var.aval.shape):  # an xs operand (the consts and the carry keep their shape)
          (axis, flipped), axes = axes[0], axes[1:]
          found.setdefault(key, {}).setdefault(axis, bool(eqn.params["reverse"]) != flipped)
        if axes:
          inner[id(var)] = (key, axes)
      _follow(body, inner, found)
    else:
      for sub, invars in inner_jaxprs(eqn):
        if invars is None:
          continue
        out = _follow(sub, {id(s): tags[id(v)] for s, v in zip(sub.invars, invars, strict=True) if id(v) in tags},
                      found)
        if name != "while" and len(out) == len(eqn.outvars):  # a call's outputs (a while's are its carry)
          tags.update({id(o): t for o, t in zip(eqn.outvars, out, strict=True) if t is not None})
  return [tags.get(id(v)) for v in jaxpr.outvars]
