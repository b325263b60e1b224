"""Stacks of Linen layers (``nn.scan`` / ``nn.vmap`` over layers, ``variable_axes={"params": 0}``) in
:func:`~jaxsparse.sparsify_linen`, :func:`~jaxsparse.densify_linen` and :func:`~jaxsparse.compress_linen`.

A layer under a lifted transform over layers is called with one layer's kernel ``(K, N)`` while its ``params`` hold
the stack ``(*layers, K, N)``: the leading extra axes are the layer axes (Flax's recipe stacks on axis 0). Each
layer's sparse variables are made from its own slice, as for a layer of its own, and stacked on the same leading
axes, so the model's transform slices them per layer as it slices the dense ones (the ``"sparsity"`` collection
listed in its ``variable_axes`` beside ``"params"``). What lives here does not depend on the plan: the layer axes of
a kernel (:func:`layer_axes`), a function mapped over the layers of a stack and its results stacked
(:func:`map_layers`), and the partitioning boxes of stacked variables (:func:`carry_stack`).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse.layers._common import eager_if_concrete
from jaxsparse.layers._partitioning import carry_linen

__all__ = ["block_counts_message", "carry_stack", "layer_axes", "map_layers", "stack_error"]


def layer_axes(kernel_shape: tuple[int, ...], expected: tuple[int, ...], bias_shape: tuple[int, ...] | None,
               features: tuple[int, ...]) -> tuple[int, ...] | None:
  """The leading layer axes of a kernel ``kernel_shape`` whose layer multiplies by ``expected``: ``()`` for one
  layer, ``(L, ...)`` for a stack whose bias (if any) is ``(L, ..., *features)`` too, ``None`` for anything else (the
  layer axes elsewhere, ``variable_axes={"params": 1}``)."""
  kernel_shape, expected = tuple(kernel_shape), tuple(expected)
  if kernel_shape == expected:
    return ()
  n = len(kernel_shape) - len(expected)
  if n <= 0 or kernel_shape[n:] != expected:
    return None
  stack = kernel_shape[:n]
  if bias_shape is not None and tuple(bias_shape) != (*stack, *features):
    return None
  return stack


def stack_error(kind: str, kernel_shape: tuple[int, ...], expected: tuple[int, ...], path: str) -> str:
  """Why sparsify_linen refuses a kernel that is neither its layer's ``expected`` nor a stack of it on leading axes."""
  return (f"{path}: its kernel has shape {tuple(kernel_shape)}, not the {tuple(expected)} its call multiplies by nor "
          f"a stack of them with the layer axes leading (*layers, {', '.join(map(str, expected))}): an nn.scan / "
          f"nn.vmap with variable_axes other than {{'params': 0}}? sparsify_linen takes one {kind} or a stack whose "
          "layer axes lead (Flax's scan over layers); map this path to None.")


def _shapes(tree: Any) -> Any:
  return jax.tree.map(lambda a: (tuple(jnp.shape(a)), jnp.result_type(a)), tree)


def map_layers(fn: Callable[..., Any], stack: tuple[int, ...], trees: tuple, path: str,
               differ: Callable[[list], str]) -> tuple[Any, list]:
  """``fn(*slices, where)`` for each layer of a stack, the results stacked on the leading ``stack`` axes.

  Args:
    fn: ``fn(*trees_of_one_layer, where) -> pytree of arrays``; ``where`` is ``f"{path}[i]"``.
    stack: the layer axes, ``(L, ...)``.
    trees: pytrees (or ``None``) whose arrays have the leading ``stack`` axes; layer ``i`` gets each sliced at ``i``.
    path: the stack's dotted path, for messages.
    differ: ``differ(results) -> message`` of the ``ValueError`` raised when the layers' results differ in structure,
      shapes or dtypes (a block-sparse layer's kept blocks fix its kernel's shape).

  Returns:
    ``(stacked, results)``: the stacked pytree (concrete where every layer's arrays are) and each layer's result, in
    the order of ``np.ndindex(*stack)``.
  """
  results = []
  for index in np.ndindex(*stack):
    where = f"{path}[{', '.join(map(str, index))}]"
    slices = [None if t is None else jax.tree.map(lambda a, index=index: a[index], t) for t in trees]
    results.append(fn(*slices, where))
  first = _shapes(results[0])
  if any(jax.tree.structure(r) != jax.tree.structure(results[0]) or _shapes(r) != first for r in results[1:]):
    raise ValueError(differ(results))

  def stacked(*leaves):
    with eager_if_concrete(*leaves):  # concrete patterns stay so (their kept counts known) under a trace
      return jnp.stack(leaves).reshape(*stack, *jnp.shape(leaves[0]))

  return jax.tree.map(stacked, *results), results


def block_counts_message(path: str, counts: list[int], stack: tuple[int, ...], total: int) -> str:
  """The error of a block-sparse stack whose layers keep different numbers of blocks (``counts``, of ``total``)."""
  counts = np.asarray(counts).reshape(stack).tolist()
  return (f"{path}: a block-sparse stack needs the same number of kept blocks in every layer (it fixes the kernel's "
          f"shape), but its layers keep {counts} of {total} blocks. Prune every layer to the same density "
          "(pruning.calibrated_prune_linen, or pruning.magnitude_masks with stacks=pruning.layer_stacks(...), with a "
          "BlockSparse structure do), or use an Unstructured rule (a mask of those blocks), or map this path to None.")


def carry_stack(boxed_params: Mapping, layer_vars: dict, stack: tuple[int, ...], *, in_ndim: int | None = None) -> dict:
  """:func:`~jaxsparse.layers._partitioning.carry_linen` of a stack's variables (leading ``stack`` axes): each
  variable boxed as one layer's would be, its leading axes named as the dense kernel's (or bias's) are, which the
  transform's ``metadata_params`` (``{nn.PARTITION_NAME: "layers"}``) takes off inside and puts back."""
  n = len(stack)
  if not n:
    return carry_linen(boxed_params, layer_vars, in_ndim=in_ndim)
  boxes = [boxed_params[k] for k in ("kernel", "bias") if isinstance(boxed_params.get(k), nn.Partitioned)]
  if not boxes:
    return layer_vars
  names = tuple(boxes[0].names)
  lead = names[:n] if len(names) == len(jnp.shape(boxes[0].value)) else (None,) * n
  one = {k: v.replace(names=tuple(v.names)[n:]) if isinstance(v, nn.Partitioned) else v
         for k, v in boxed_params.items()}
  carried = carry_linen(one, jax.tree.map(lambda a: a[(0,) * n], layer_vars), in_ndim=in_ndim)

  def restack(box: Any, value: Any) -> Any:
    return box.replace(value=value, names=(*lead, *box.names)) if isinstance(box, nn.Partitioned) else value

  return jax.tree.map(restack, carried, layer_vars, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
