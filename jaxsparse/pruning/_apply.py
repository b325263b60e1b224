"""Zeroing pruned weights: :func:`apply_masks` on a parameter tree, Linen variables or an NNX model.

Besides the weights it narrows the sparse layers' own patterns where they can follow (a masked layer's mask, a Linen
``"sparsity"`` mask), and warns where they cannot (the static kept blocks of a block-sparse layer). The mask-tree
helpers here (:func:`is_none`, :func:`where_masked`) are also those of :mod:`jaxsparse.pruning._optax`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsparse import _utils
from jaxsparse._rules import flatten_with_paths
from jaxsparse._rules import path_str
from jaxsparse._rules import unwrap_variables
from jaxsparse.formats._base import is_concrete
from jaxsparse.formats._block_sparse import INDEX_FIELDS
from jaxsparse.formats._masks import split_like
from jaxsparse.layers._block_sparse import BlockSparseLinear
from jaxsparse.layers._common import SPARSITY
from jaxsparse.layers._common import bridged_block_pattern
from jaxsparse.layers._common import pattern_mask
from jaxsparse.layers._masked import MaskedConv
from jaxsparse.layers._masked import MaskedLinear

__all__ = ["apply_masks", "is_none", "where_masked"]


def is_none(x: Any) -> bool:
  """A leaf with no mask (``None``: the parameter is not pruned); ``is_leaf`` for mask trees."""
  return x is None


def where_masked(masks: Any, kept: Any, pruned: Callable[[Any], Any], tree: Any) -> Any:
  """``where(mask, kept_leaf, pruned(leaf))`` leaf by leaf; leaves without a mask take ``kept``'s."""

  def f(m, k, x):
    if m is None:
      return k
    return jnp.where(m, k, pruned(x).astype(jnp.result_type(k)))

  return jax.tree.map(f, masks, kept, tree, is_leaf=is_none)



def apply_masks(target: Any, masks: Any) -> Any:
  """Zeroes the pruned weights: of a parameter tree or Linen variables (returns new ones) or of an NNX model (in place).

  >>> import jax.numpy as jnp
  >>> from jaxsparse import pruning
  >>> pruning.apply_masks({"w": jnp.ones((2, 2)), "b": jnp.ones(2)}, {"w": jnp.eye(2, dtype=bool), "b": None})
  {'b': Array([1., 1.], dtype=float32), 'w': Array([[1., 0.],
         [0., 1.]], dtype=float32)}

  Call it after ``init`` when a model must be sparse before its first optimizer step (the wrapped
  optimizer zeroes pruned weights at its first update).

  On an NNX model, the layers with a mask of their own (``MaskedLinear``, ``MaskedConv``) keep only the weights
  both masks keep: their ``mask``, ``density`` and :func:`jaxsparse.summary` then tell the truth. An optimizer
  sees only the parameters, so after :func:`wrap_optax` pruned such a layer further, call
  ``apply_masks(model, get_masks(optimizer))`` (the layer's outputs were already right; its mask was not):

  >>> import jax.numpy as jnp, optax, jaxsparse
  >>> from flax import nnx
  >>> layer = jaxsparse.layers.MaskedLinear(16, 8, sparsity=0.75, rngs=nnx.Rngs(0))
  >>> optimizer = nnx.Optimizer(layer, pruning.wrap_optax(optax.sgd(0.0), pruning.magnitude_pruner(
  ...     jaxsparse.Unstructured(0.875))), wrt=nnx.Param)
  >>> _ = optimizer.update(layer, nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 16)))))(layer))
  >>> layer.density, float(jnp.mean(layer.kernel[...] != 0))
  (0.25, 0.125)
  >>> _ = pruning.apply_masks(layer, pruning.get_masks(optimizer))
  >>> layer.density
  0.125

  Linen variables (``{"params": ..., "sparsity": ..., ...}``) keep such masks in their ``"sparsity"`` collection
  (``MaskedDense``, the masked convs of :func:`jaxsparse.sparsify_linen`): pass the variables and the masks of their
  ``"params"`` (``get_masks`` of a ``TrainState``, paths like ``"Dense_0.kernel"``), and the result holds the pruned
  parameters and each ``"sparsity"`` mask narrowed to the weights both keep, so :func:`jaxsparse.summary` and the
  torch export report the new pattern (the other collections are kept as they are).

  Block-sparse layers (``BlockSparseLinear``, ``BlockSparseDense`` and the block-sparse layers of
  :func:`jaxsparse.sparsify_linen`) keep their pattern: a block the masks zero in part stays kept, holding the zeroed
  weights, and one they zero entirely stays kept too, as a zero block, which their density, :func:`jaxsparse.summary`
  and products still count; ``apply_masks`` then warns (a ``UserWarning``), naming the layer, the blocks and how to
  rebuild it without them. It does not drop such blocks itself: a block-sparse layer's kept blocks are static index
  arrays, which the kernel's shape ``(nnz_blocks, bk, bn)`` follows, so dropping blocks would change that shape under
  the optimizer state (its moments, :func:`wrap_optax`'s masks), under a stack of layers (one block count for all)
  and, in Linen, against ``BlockSparseDense``, whose kernel's shape follows its ``density``. Its outputs are right
  either way (the zeroed weights are zero); rebuild it once training is over. Masks traced under ``jit`` are not
  checked.

  Args:
    target: a parameter tree with the masks' structure, Linen variables whose ``"params"`` have it, or an
      ``nnx.Module`` whose ``nnx.Param`` state has it (an ``nnx.State``, or plain nested dicts with its keys:
      ``{"linear": {"kernel": mask, "bias": None}}``).
    masks: from :func:`get_masks` or :func:`magnitude_masks`: a bool array of its parameter's exact shape (never
      broadcast) or ``None`` per leaf. Masks saved as NumPy arrays do too: where explicit mesh axes split a parameter
      (a kernel named with ``nnx.with_partitioning``), its mask is split like it.

  Returns:
    For a parameter tree, a new tree with the pruned entries set to zero (same shapes and dtypes; a leaf
    whose mask is ``None`` is kept as it is; parameters in Linen boxes, ``nn.Partitioned``, stay in them); for Linen
    variables, a new dict with those parameters and narrowed ``"sparsity"`` masks; for an ``nnx.Module``,
    ``target`` itself, updated in place (its parameters, and the masks of its masked layers).

  Raises:
    ValueError: naming the path, for a mask whose shape is not its parameter's, or one where the parameters have
      none; a Linen ``"sparsity"`` mask not of its kernel's shape; masks of an NNX model that leave out some of its
      parameters (give ``None`` for those not pruned).
    TypeError: naming the path, for a mask that is not boolean (a float 0.5 or an int 2 would be read as "kept");
      a Linen ``"sparsity"`` mask that is not boolean (the layer's forward refuses it too).
  """
  if isinstance(target, nnx.Module):
    params = nnx.as_pure(nnx.state(target, nnx.Param))
    masks = _like_params(_checked_masks(masks, params), params)
    nnx.update(target, where_masked(masks, params, jnp.zeros_like, params))
    _narrow_layer_masks(target, masks)
    _warn_emptied_blocks(_nnx_block_masks(target, masks), linen=False)
    return target
  params_masks = _linen_params_masks(target, masks)
  if params_masks is not None:
    boxed = target["params"]
    params = nn.meta.unbox(boxed)  # nn.Partitioned boxes (sparsify_linen carries the dense layers' over)
    params_masks = _checked_masks(nn.meta.unbox(params_masks), params)
    out = dict(target)
    out["params"] = rebox(boxed, where_masked(params_masks, params, jnp.zeros_like, params))
    if SPARSITY in target:
      out[SPARSITY] = _narrow_linen_masks(target[SPARSITY], params_masks)
      _warn_emptied_blocks(_linen_block_masks(target[SPARSITY], params, params_masks), linen=True)
    return out
  plain = nn.meta.unbox(target)  # parameters kept boxed (a TrainState's nn.Partitioned ones) come back boxed
  masks = _checked_masks(nn.meta.unbox(masks), plain)
  return rebox(target, where_masked(masks, plain, jnp.zeros_like, plain))


def _linen_params_masks(target: Any, masks: Any) -> Any:
  """The masks of ``target["params"]`` when ``target`` is Linen variables and ``masks`` are keyed like their
  ``"params"`` (as ``get_masks`` of a ``TrainState`` gives them) or are ``{"params": masks}``; else ``None`` (a
  parameter tree with the masks' own structure)."""
  if not (isinstance(target, Mapping) and isinstance(target.get("params"), Mapping)):
    return None
  if not (isinstance(masks, Mapping) and "params" in masks):
    return masks
  if set(masks) == {"params"} and set(target) != {"params"}:
    return masks["params"]
  return None


def is_box(x: Any) -> bool:
  """A Linen metadata box (``nn.Partitioned``, ``nn.LogicallyPartitioned``: ``nn.meta.AxisMetadata``)."""
  return isinstance(x, nn.meta.AxisMetadata)


def rebox(boxed: Any, values: Any) -> Any:
  """``values`` (a tree with the structure of ``nn.meta.unbox(boxed)``: an unboxed copy, or masks) in ``boxed``'s
  boxes, each keeping its metadata (names, mesh); a value that is no array (a ``None`` mask) stays unboxed."""
  return jax.tree.map(lambda b, v: b.replace_boxed(v) if is_box(b) and hasattr(v, "shape") else v, boxed, values,
                      is_leaf=is_box)


def _narrow_linen_masks(sparsity: Mapping, masks: Any) -> dict:
  """The ``"sparsity"`` collection with each layer's ``"mask"`` narrowed to the weights it and its kernel's mask in
  ``masks`` both keep (other patterns, block-sparse indices or N:M positions, are kept as they are)."""
  paths, leaves, _ = flatten_with_paths(masks)
  by_path = dict(zip(paths, leaves, strict=True))

  def walk(tree: Mapping, prefix: tuple[str, ...]) -> dict:
    out = {}
    for key, value in tree.items():
      if isinstance(value, Mapping):
        out[key] = walk(value, (*prefix, str(key)))
        continue
      new = by_path.get(path_str((*prefix, "kernel"))) if key == "mask" else None
      if new is not None:
        old = pattern_mask(nn.meta.unbox(value), np.shape(new), path=path_str(prefix))
        value = rebox(value, old & new) if is_box(value) else old & new
      out[key] = value
    return out

  return walk(sparsity, ())


def _masks_by_path(masks: Any) -> dict[str, Any]:
  """``{dotted path: mask}`` of the masks of an NNX model's parameters (``None`` left out)."""
  pairs = jax.tree_util.tree_flatten_with_path(unwrap_variables(masks), is_leaf=is_none)[0]
  return {path_str(kp): m for kp, m in pairs if m is not None}


def _narrow_layer_masks(model: nnx.Module, masks: Any) -> None:
  """Sets the ``mask`` of each ``MaskedLinear`` / ``MaskedConv`` of ``model`` to the weights it and its kernel's
  mask in ``masks`` both keep (a weight either prunes is zero and gets no gradient)."""
  by_path = _masks_by_path(masks)
  for path, node in nnx.iter_modules(model):
    mask = by_path.get(path_str((*path, "kernel"))) if isinstance(node, MaskedLinear | MaskedConv) else None
    if mask is not None:
      old = node.mask[...]
      node.mask[...] = old & (split_like(mask, old) if isinstance(old, jax.Array) else mask)


def _nnx_block_masks(model: nnx.Module, masks: Any) -> list[tuple[str, Any, int]]:
  """``(path, kernel mask, blocks of the grid)`` of each ``BlockSparseLinear`` of ``model`` that ``masks`` prune."""
  by_path = _masks_by_path(masks)
  found = []
  for path, node in nnx.iter_modules(model):
    mask = by_path.get(path_str((*path, "kernel"))) if isinstance(node, BlockSparseLinear) else None
    if mask is not None:
      (bk, bn), where = node.block_shape, path_str(path) or "(the model itself)"
      found.append((where, mask, (node.in_features // bk) * (node.out_features // bn)))
  return found


def _linen_block_masks(sparsity: Mapping, params: Mapping, masks: Any) -> list[tuple[str, Any, int]]:
  """``(path, kernel mask, blocks of the grid)`` of each block-sparse layer of Linen variables (its ``"sparsity"``
  index arrays, flat as a ``BlockSparseDense`` keeps them or one level down as a bridged
  ``ToLinen(BlockSparseLinear)`` does) that ``masks`` (of their ``"params"``) prune."""
  paths, leaves, _ = flatten_with_paths(masks)
  by_path = dict(zip(paths, leaves, strict=True))
  found = []

  def walk(tree: Mapping, layer_params: Any, prefix: tuple[str, ...]) -> None:
    index = tree if INDEX_FIELDS[0] in tree else bridged_block_pattern(tree, layer_params)
    mask = by_path.get(path_str((*prefix, "kernel"))) if index is not None else None
    if mask is not None:  # the grid from the offsets: (K // bk + 1,) and (N // bn + 1,)
      kb, nb = (np.shape(nn.meta.unbox(index[f]))[-1] - 1 for f in ("row_offsets", "col_offsets"))
      found.append((path_str(prefix) or "(the variables themselves)", mask, kb * nb))
    for key, value in tree.items():
      if isinstance(value, Mapping):
        walk(value, layer_params.get(key) if isinstance(layer_params, Mapping) else None, (*prefix, str(key)))

  walk(sparsity, params, ())
  return found


def _warn_emptied_blocks(found: list[tuple[str, Any, int]], *, linen: bool) -> None:
  """Warns, naming the layer, where a block-sparse kernel's mask (``(..., nnz_blocks, bk, bn)``) prunes whole kept
  blocks: the layer keeps them, as zero blocks (its kept blocks are static; see :func:`apply_masks`). Masks traced
  under ``jit`` are not checked."""
  for where, mask, blocks in found:
    if not is_concrete(mask):
      continue
    mask = np.asarray(mask)
    *stack, nnz, bk, bn = mask.shape
    emptied = int(np.sum(~mask.any(axis=(-2, -1))))
    if not emptied:
      continue
    layers = math.prod(stack)
    left = nnz - emptied if layers == 1 else None
    what = "block-sparse layer" if linen else "BlockSparseLinear"
    counted = f"{emptied} of the {nnz} kept" if layers == 1 else f"{emptied} of the {layers} x {nnz} kept"
    if left is None:
      fix = ("to drop them, rebuild the stack's layers from their weights (BlockSparseLinear.from_dense of each "
             "layer's to_dense(); a stack holds one block count for all its layers)")
    elif left == 0:
      fix = "every kept block is zero: remove the layer, or keep it as it is"
    elif linen:
      fix = (f"to drop them, rebuild the layer: BlockSparseDense(..., density={left}/{blocks}) with the variables of "
             f"w = jaxsparse.BlockSparseMatrix.from_dense(dense_kernel, ({bk}, {bn})), which keeps the nonzero blocks "
             "of its dense kernel: params kernel w.data, sparsity w.index_arrays()")
    else:
      fix = (f"to drop them, rebuild the layer from its weights: BlockSparseLinear.from_dense(layer.to_dense(), "
             f"density={left}/{blocks}, block_shape=({bk}, {bn})) keeps its {left} blocks of largest norm, the ones "
             "left")
    _utils.warn_at_caller(
        f"pruning.apply_masks: the masks zero {counted} {bk}x{bn} blocks of the {what} at {where!r} entirely. They "
        "stay kept, as zero blocks (a block-sparse layer's kept blocks are static index arrays, which its kernel's "
        "shape (nnz_blocks, bk, bn) follows), so its density, jaxsparse.summary and products still count them; its "
        f"outputs are right (the pruned weights are zero). {fix[0].upper()}{fix[1:]}.",
        UserWarning,
    )


def _like_params(masks: Any, params: Any) -> Any:
  """``masks`` (checked) in the structure of an NNX model's ``params`` (an ``nnx.State``): masks given as plain nested
  dicts (or lists) with the same keys are rebuilt by path; raises, naming them, for parameters they leave out or
  entries the parameters lack."""
  if jax.tree.structure(masks, is_leaf=is_none) == jax.tree.structure(params):
    return masks
  given = {path_str(kp): m for kp, m in jax.tree_util.tree_flatten_with_path(masks, is_leaf=is_none)[0]}
  param_paths = [path_str(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  missing = [p for p in param_paths if p not in given]
  extra = sorted(set(given) - set(param_paths))
  if missing or extra:
    listing = lambda paths: ", ".join(paths[:12]) + (" ..." if len(paths) > 12 else "")
    raise ValueError(
        "masks must have the structure of the model's nnx.state(model, nnx.Param): a mask or None for each of its "
        f"parameters {listing(param_paths)}"
        + (f"; masks lack {listing(missing)} (give None for parameters not pruned)" if missing else "")
        + (f"; masks have {listing(extra)}, which the parameters do not" if extra else "")
        + ". pruning.get_masks / magnitude_masks give them so."
    )
  return jax.tree_util.tree_map_with_path(lambda kp, _: given[path_str(kp)], params)


def _checked_masks(masks: Any, target: Any) -> Any:
  """``masks`` with every mask checked against its parameter in ``target``, naming the path: its exact shape (a
  mask is never broadcast) and a bool dtype (each returned as a bool array, ``_utils.check_mask``), split like its
  parameter where explicit mesh axes split that (masks read from a file or made on one device: explicit axes refuse
  ``jnp.where`` of a mask and a weight split differently)."""
  mask_paths, mask_leaves, treedef = flatten_with_paths(masks)
  target_paths, target_leaves, _ = flatten_with_paths(target)
  shapes = {p: tuple(np.shape(x)) for p, x in zip(target_paths, target_leaves, strict=True)}
  params = dict(zip(target_paths, target_leaves, strict=True))
  checked = []
  for path, m in zip(mask_paths, mask_leaves, strict=True):
    if path not in shapes:
      raise ValueError(f"masks has a mask at {path!r}, where the parameters have none; parameters: "
                       f"{', '.join(list(shapes)[:12])}{' ...' if len(shapes) > 12 else ''}.")
    if tuple(np.shape(m)) != shapes[path]:
      raise ValueError(
          f"{path}: the mask has shape {tuple(np.shape(m))}, the parameter {shapes[path]}; a mask must have its "
          "parameter's shape (it is not broadcast)."
      )
    m = _utils.check_mask(m, shapes[path], name=f"masks[{path!r}]")
    checked.append(split_like(m, params[path]) if isinstance(params[path], jax.Array) else m)
  return jax.tree_util.tree_unflatten(treedef, checked)
