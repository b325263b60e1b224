"""The masks of a model's own masked layers, for the pruners that see parameters without their layers.

A ``MaskedLinear`` / ``MaskedConv`` (Linen ``MaskedDense``, the masked convs of ``sparsify_linen``) holds a fixed mask
of its own: its kernel is zero outside it and gets no gradient there, so a weight outside it never carries a value.
An optimizer hands a pruner the parameters only, not that mask. Told it (``layer_masks=``), the pruners choose only
among the units the layer can carry: SET / RigL draw their first mask and grow inside it, magnitude pruning ranks
inside it, and a rule looser than the layer keeps the layer's own units (warned once). The density of a mask is still
counted over the whole weight, as ``MaskedLinear.density`` and :func:`jaxsparse.summary` count it.

Given the model itself (``pruner.init(model, key)``, ``magnitude_masks(model, ...)``) the pruners read its layers'
masks on their own (``layer_masks=`` wins path by path). Given parameters that mark a masked layer's kernel (the
``nnx.State`` that ``nnx.Optimizer`` hands ``wrap_optax``: ``OWN_MASK`` metadata) but not its mask, they warn once,
naming the kernels and ``layer_masks=``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsparse import _utils
from jaxsparse._rules import flatten_with_paths
from jaxsparse._rules import path_str
from jaxsparse.formats._base import is_concrete
from jaxsparse.formats._specs import NM
from jaxsparse.formats._specs import BlockSparse
from jaxsparse.layers._common import SPARSITY
from jaxsparse.layers._masked import OWN_MASK
from jaxsparse.layers._masked import MaskedConv
from jaxsparse.layers._masked import MaskedLinear
from jaxsparse.pruning._apply import is_box

__all__ = ["layer_masks"]

LayerMasks = Mapping[str, jax.typing.ArrayLike]


def layer_masks(model: Any) -> dict[str, jax.Array]:
  """The own masks of a model's masked layers, by kernel path, for the pruners' ``layer_masks=``.

  A model that is already sparse (``MaskedLinear``, ``MaskedConv``, Linen ``MaskedDense``) cannot carry a weight
  outside its layers' masks. An optimizer shows the pruner the parameters only: without these masks, SET draws and
  grows weights the layer cannot carry (the model then keeps fewer than :func:`get_masks` reports) and a rule looser
  than the layer reports weights it does not have; the pruner's ``init`` then warns, naming the layers' kernels (the
  parameters of an ``nnx.Optimizer`` mark them). With them the pruners choose inside the layers' masks:

  >>> import jax, optax, jaxsparse
  >>> from flax import nnx
  >>> from jaxsparse import pruning
  >>> model = nnx.Sequential(jaxsparse.layers.MaskedLinear(32, 32, sparsity=0.5, rngs=nnx.Rngs(0)))
  >>> {path: mask.shape for path, mask in pruning.layer_masks(model).items()}
  {'layers.0.kernel': (32, 32)}
  >>> pruner = pruning.set_pruner(jaxsparse.Unstructured(sparsity=0.75), update_every=1, end_step=10,
  ...                             layer_masks=pruning.layer_masks(model))
  >>> optimizer = nnx.Optimizer(model, pruning.wrap_optax(optax.sgd(0.1), pruner), wrt=nnx.Param)
  >>> mask = pruning.get_masks(optimizer)["layers"][0]["kernel"]
  >>> float(mask.mean()), bool((mask & ~model.layers[0].mask[...]).any())  # a quarter, all inside the layer's mask
  (0.25, False)

  Args:
    model: an NNX object (an ``nnx.Module``, an ``nnx.ModelAndOptimizer``), or Linen variables
      (``{"params": ..., "sparsity": ...}``: the masks of their ``"sparsity"`` collection).

  Returns:
    ``{kernel path: bool mask of the kernel's shape}``, sorted by path: each ``MaskedLinear`` / ``MaskedConv``'s
    ``mask`` at the path ``nnx.state(model, nnx.Param)`` holds its kernel at (a layer held at several paths, tied,
    at its first), a stack of layers' masks with their layer axes; for Linen, each ``"mask"`` of the ``"sparsity"``
    collection at its kernel's path in ``variables["params"]`` (``"MaskedDense_0.kernel"``), unboxed. ``{}`` when the
    model has no masked layer.

  Raises:
    TypeError: ``model`` is neither an NNX object nor Linen variables holding ``"params"``.
  """
  if isinstance(model, nnx.Pytree):
    return dict(sorted(nnx_layer_masks(model).items()))
  if isinstance(model, Mapping) and isinstance(model.get("params"), Mapping):
    return dict(sorted(_linen_layer_masks(model.get(SPARSITY, {}), ()).items()))
  raise TypeError(
      f"model must be an NNX object (an nnx.Module) or Linen variables ({{'params': ..., {SPARSITY!r}: ...}}), got "
      f"{type(model).__name__}."
  )


def nnx_layer_masks(model: Any) -> dict[str, jax.Array]:
  """``{kernel path: mask}`` of every ``MaskedLinear`` / ``MaskedConv`` of an NNX object, at its first path; ``{}``
  for another tree."""
  if not isinstance(model, nnx.Pytree):
    return {}
  return {path_str((*path, "kernel")): node.mask[...] for path, node in nnx.iter_graph(model)
          if isinstance(node, MaskedLinear | MaskedConv)}


def _linen_layer_masks(sparsity: Mapping, prefix: tuple[str, ...]) -> dict[str, jax.Array]:
  out = {}
  for key, value in sparsity.items():
    if isinstance(value, Mapping):
      out.update(_linen_layer_masks(value, (*prefix, str(key))))
    elif key == "mask":
      out[path_str((*prefix, "kernel"))] = jnp.asarray(nn.meta.unbox(value))
  return out


def _own_mark(leaf: Any) -> str | None:
  """The layer class a kernel's metadata marks as having a mask of its own (``OWN_MASK``), read from an ``nnx.Param``
  or a Linen box (``nnx.bridge.ToLinen``'s ``NNXMeta``); ``None`` for an unmarked leaf."""
  if isinstance(leaf, nnx.Param):
    metadata = leaf.get_metadata()
  else:
    metadata = getattr(leaf, "metadata", None) if is_box(leaf) else None
  mark = metadata.get(OWN_MASK) if isinstance(metadata, Mapping) else None
  return None if not mark else str(mark)


def own_mask_paths(tree: Any) -> dict[str, str]:
  """``{kernel path: layer class name}`` of the kernels of layers with a mask of their own that ``tree`` shows: an NNX
  object's ``MaskedLinear`` / ``MaskedConv`` (at their first path), the kernels that parameters mark (``OWN_MASK``
  metadata of an ``nnx.Param`` in an ``nnx.State``, what ``nnx.Optimizer`` hands its optimizer's ``init``), and those
  :func:`own_masks_known` names (read by ``pruning.wrap_optax`` before it unwraps the parameters)."""
  known = _KNOWN.get()
  out = dict(known.paths) if known is not None else {}
  if isinstance(tree, nnx.Pytree):
    out.update({path_str((*path, "kernel")): type(node).__name__ for path, node in nnx.iter_graph(tree)
                if isinstance(node, MaskedLinear | MaskedConv)})
    return out
  pairs = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable) or is_box(x))[0]
  for key_path, leaf in pairs:
    mark = _own_mark(leaf)
    if mark:
      out.setdefault(path_str(key_path), mark)
  return out


@dataclasses.dataclass
class _Known:
  paths: dict[str, str]
  seen: set[str] = dataclasses.field(default_factory=set)  # the marked paths a pruner ranked (told or warned)


# The marked kernels of the parameters that pruning.wrap_optax's init hands its pruner as plain arrays (which do not
# carry the marks), read by the pruners while that call traces.
_KNOWN: contextvars.ContextVar[_Known | None] = contextvars.ContextVar("own_masks", default=None)


@contextlib.contextmanager
def own_masks_known(paths: Mapping[str, str]) -> Iterator[set[str]]:
  """Within it, :func:`own_mask_paths` also gives ``paths`` (those of the parameters a pruner gets as plain arrays);
  yields the set of those paths that a jaxsparse pruner matched (it warned about them or was told their masks)."""
  known = _Known(dict(paths))
  token = _KNOWN.set(known)
  try:
    yield known.seen
  finally:
    _KNOWN.reset(token)


def resolve_layer_masks(
    tree: Any, layer_masks: Mapping[str, Any] | None, targets: Sequence[Any], *, warn: bool
) -> dict[str, Any] | None:
  """The layer masks a pruner ranks ``tree``'s targets inside: those of the NNX object's own masked layers (the model
  is at hand: read from it), with ``layer_masks`` (given to the pruner) over them path by path; ``None`` when there
  are none of either.

  With ``warn``, warns once, naming them, about the targets whose kernel is marked as a masked layer's
  (:func:`own_mask_paths`: parameters without their layers, an ``nnx.State``) and whose mask neither gives: the
  pruner would rank, draw and grow over the whole kernel and report weights the layer cannot carry. Not for ``NM``
  rules, which keep ``n`` of every ``m`` whatever the layer keeps.
  """
  own = nnx_layer_masks(tree)
  merged = {**own, **(layer_masks or {})}
  if warn:
    marked = own_mask_paths(tree)
    matched = [t.path for t in targets if t.path in marked and not isinstance(t.spec, NM)]
    known = _KNOWN.get()
    if known is not None:
      known.seen.update(matched)
    missing = [f"{path} ({marked[path]})" for path in matched if path not in merged]
    if missing:
      _utils.warn_at_caller(
          f"{', '.join(missing)}: the pruner's rules prune these kernels of layers with a mask of their own, but it "
          "was given their parameters only, not those masks (an optimizer hands it no more), so it ranks (SET and "
          "RigL: draws and grows) over the whole kernel: its masks may keep weights the layers cannot carry, and "
          "get_masks then reports more than the model keeps. Pass layer_masks=pruning.layer_masks(model) to the "
          "pruner (magnitude_pruner, set_pruner, rigl_pruner; magnitude_masks also reads them from the model "
          "itself).", UserWarning)
  return merged if own or layer_masks is not None else None


def check_layer_masks(layer_masks: Any) -> dict[str, Any] | None:
  """``layer_masks`` (``{parameter path: bool mask}`` or ``None``) checked where a pruner is built, and copied."""
  if layer_masks is None:
    return None
  if not isinstance(layer_masks, Mapping):
    raise TypeError(
        "layer_masks must be a mapping {parameter path: bool mask} (pruning.layer_masks(model)) or None, got "
        f"{type(layer_masks).__name__}."
    )
  out = {}
  for path, mask in layer_masks.items():
    if not isinstance(path, str):
      raise TypeError(f"layer_masks keys must be parameter paths (strings, 'layers.0.kernel'), got {path!r}.")
    dtype = getattr(mask, "dtype", None) if hasattr(mask, "shape") else np.asarray(mask).dtype
    if dtype != np.bool_:
      raise TypeError(
          f"layer_masks[{path!r}] must be a boolean array (True where the layer can carry a weight), got dtype "
          f"{dtype}; pruning.layer_masks(model) gives the layers' masks."
      )
    out[path] = mask
  return out


def allowed_units(
    targets: Sequence[Any], layer_masks: Mapping[str, Any] | None, paths: Sequence[str], *, scope: str = "layer",
    warn: bool = False,
) -> list[jax.Array | None] | None:
  """Per target (:class:`~jaxsparse.pruning._scores.Target`), the units its layer can carry, ``(layers, units)`` bool
  (a block: one the layer's mask keeps a weight of), or ``None`` where ``layer_masks`` has no mask for it or the rule
  is ``NM`` (an N:M pattern keeps ``n`` of every ``m`` whatever the layer keeps); ``None`` for no ``layer_masks``.

  Raises a ``ValueError`` naming the path for a mask not of its parameter's shape. With ``warn``: a warning naming
  the paths of ``layer_masks`` that are no parameter of ``paths``, and one naming the layers whose own mask keeps
  fewer units than their rule (``scope``: per layer, or per rule over its layers): those keep their layer's units.
  """
  if layer_masks is None:
    return None
  out: list[jax.Array | None] = []
  for t in targets:
    mask = layer_masks.get(t.path)
    if mask is None or isinstance(t.spec, NM):
      out.append(None)
      continue
    if tuple(np.shape(mask)) != t.shape:
      raise ValueError(
          f"{t.path}: layer_masks[{t.path!r}] has shape {tuple(np.shape(mask))}, the parameter {t.shape}; give each "
          "path the mask of its layer (pruning.layer_masks(model))."
      )
    with jax.ensure_compile_time_eval():  # a concrete mask stays concrete inside the pruner's trace: counted below
      out.append(t.unit_mask(jnp.asarray(mask)))
  if warn:
    unknown = sorted(set(layer_masks) - set(paths))
    if unknown:
      _utils.warn_at_caller(
          f"layer_masks names {', '.join(unknown)}, which the parameters do not hold (they hold "
          f"{', '.join(list(paths)[:6])}{', ...' if len(paths) > 6 else ''}): no layer mask applies there. Pass "
          "pruning.layer_masks(model) of the model whose parameters the pruner gets.", UserWarning)
    _warn_looser(targets, out, scope)
  return out


def _warn_looser(targets: Sequence[Any], allowed: Sequence[jax.Array | None], scope: str) -> None:
  """Warns once, naming them, about the layers whose own mask keeps fewer units than their rule."""
  counts = [None if a is None or not is_concrete(a) else np.asarray(a).sum(axis=1) for a in allowed]
  found = []
  if scope == "layer":
    for t, c in zip(targets, counts, strict=True):
      if c is not None and int(c.min()) < t.kept_final:
        found.append(f"{t.path}: its layer's mask keeps {int(c.min())} of its {t.units} {_unit_name(t.spec)}"
                     f"{' (its sparsest layer)' if t.layers > 1 else ''}, the rule ({t.spec.describe()}) "
                     f"{t.kept_final}")
  else:
    by_rule: dict[int, list[int]] = {}
    for j, t in enumerate(targets):
      if not isinstance(t.spec, NM):
        by_rule.setdefault(t.rule, []).append(j)
    for members in by_rule.values():
      if all(counts[j] is None for j in members):
        continue
      spec = targets[members[0]].spec
      total = sum(targets[j].layers * targets[j].units for j in members)
      kept = (_utils.kept_count(spec.density, total) if isinstance(spec, BlockSparse)
              else total - _utils.kept_count(spec.sparsity, total))
      can = sum(targets[j].layers * targets[j].units if counts[j] is None else int(counts[j].sum()) for j in members)
      if can < kept:
        found.append(f"{', '.join(targets[j].path for j in members)}: their layers' masks keep {can} of their "
                     f"{total} {_unit_name(spec)}, the rule ({spec.describe()}, scope='global') {kept}")
  if found:
    _utils.warn_at_caller(
        f"{'; '.join(found)}. A pruner keeps no weight outside its layer's own mask (layer_masks: such a weight never "
        "carries a value), so these keep their layers' weights and get_masks reports that density, not the rule's. "
        "Give them a rule at least as sparse as their layers to prune them further.", UserWarning)


def _unit_name(spec: Any) -> str:
  return "blocks" if isinstance(spec, BlockSparse) else "weights"


def warn_zeros_kept(masks: Any, params: Any, *, skip: Any = ()) -> None:
  """Warns, naming them, where the masks a pruner starts from keep weights that are exactly zero in a kernel that
  holds nonzero ones and that they do not keep whole: the mark of a layer with a mask of its own (``MaskedLinear``,
  ``MaskedDense``) that the pruner was not told of (``layer_masks=``). Nothing is read back under a trace. The paths
  in ``skip`` (marked kernels a pruner has already dealt with: :func:`own_masks_known`) are passed by."""
  leaves = jax.tree.leaves(masks)
  if not leaves or not all(is_concrete(m) for m in leaves):
    return

  def count(m, p):
    if m is None:
      return None
    m, zero = jnp.asarray(m).astype(bool), jnp.asarray(p) == 0
    return jnp.stack([jnp.sum(m & zero), jnp.sum(m), jnp.sum(~zero)])

  counts = jax.jit(lambda m, p: jax.tree.map(count, m, p, is_leaf=lambda x: x is None))(masks, params)
  paths, count_leaves, _ = flatten_with_paths(jax.device_get(counts))
  sizes = [math.prod(np.shape(m)) for m in leaves]  # the masks' leaves, in the same order
  found = [f"{path} ({int(c[0])} of the {int(c[1])} it keeps)" for path, c, size in zip(paths, count_leaves, sizes,
                                                                                         strict=True)
           if c[0] and c[2] and c[1] < size and path not in skip]
  if found:
    _utils.warn_at_caller(
        f"{', '.join(found)}: the pruner's first masks keep weights that are exactly zero, in kernels that also hold "
        "nonzero ones. If their layers have masks of their own (MaskedLinear, MaskedConv, Linen MaskedDense: a model "
        "that is already sparse), the pruner does not see them in the parameters and counts weights the layers "
        "cannot carry, so get_masks reports more than the model keeps (SET and RigL also draw and grow there): pass "
        "layer_masks=pruning.layer_masks(model) (Linen: of its variables) to the pruner. Zeros of a dense layer "
        "(pruned before) are weights it can grow back: then there is nothing to fix.", UserWarning)
