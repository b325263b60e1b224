"""Stacks of layers (built by ``nnx.vmap``, run by ``nnx.scan``: Flax's "scan over layers") in
:func:`jaxsparse.sparsify` and :func:`jaxsparse.densify`.

A stack of ``nnx.Linear`` layers holds its kernel ``(*layers, K, N)`` while its ``in_features`` / ``out_features``
say ``(K, N)``: the leading extra axes are the layer axes. ``sparsify`` builds each layer's sparse layer on its own
(eagerly: a block-sparse layer's kept-block count fixes its kernel's shape, which ``nnx.vmap`` cannot trace) and
stacks their state, as ``nnx.vmap`` would have built the stack (its partitioning names get the stack's axis names
back); ``densify`` maps each layer's ``to_dense`` under one ``nnx.vmap`` per layer axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import spmd

from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import SparseLinearGeneral
from jaxsparse.layers._common import _one_layer_leaf

__all__ = ["dense_stack", "linear_stack", "sparse_stack", "stack_error"]


def linear_stack(node: nnx.Module) -> tuple[int, ...]:
  """The layer axes of a stack of ``nnx.Linear`` layers (kernel ``(*layers, in_features, out_features)``); ``()`` for
  one layer, a subclass, another layer type, or a kernel whose trailing axes are not its features'."""
  if type(node) is not nnx.Linear:
    return ()
  shape = tuple(node.kernel.shape)
  if len(shape) > 2 and shape[-2:] == (node.in_features, node.out_features):
    return shape[:-2]
  return ()


def stack_error(node: nnx.Module, expected: tuple[int, ...], path: str) -> str:
  """Why sparsify refuses ``node``, whose kernel's shape is not the ``expected`` of its features: a stack of a layer
  type it does not take stacked, or layer axes that do not lead."""
  shape = tuple(node.kernel.shape)
  kind = f"nnx.{type(node).__name__}"
  if len(shape) > len(expected) and shape[-len(expected):] == expected:
    return (f"{path}: its kernel has shape {shape}, a stack of {shape[:-len(expected)]} {kind} layers of kernel "
            f"{expected} (nnx.vmap, scan over layers). sparsify takes stacks of nnx.Linear only; map this path to "
            f"None, or sparsify the {kind} layers one at a time before stacking them.")
  return (f"{path}: its kernel has shape {shape}, not the {expected} its features give nor a stack of them with the "
          f"layer axes leading (*layers, {', '.join(map(str, expected))}): a stack built with nnx.vmap out_axes other "
          "than 0? sparsify takes one layer or a stack whose layer axes lead; map this path to None.")


def _stack_names(variable: nnx.Variable, n_layer_axes: int) -> tuple | None:
  """The partitioning names of ``variable``'s leading ``n_layer_axes`` (the stack's), where it names every axis."""
  names = variable.get_metadata().get("out_sharding")
  if names and len(names) == len(variable.shape):
    return tuple(names[:n_layer_axes])
  return None


def _one_layer(node: nnx.Linear, index: tuple[int, ...]) -> nnx.Linear:
  """Layer ``index`` of a stack of ``nnx.Linear`` layers: its options, weights and partitioning names (those of the
  stack's layer axes taken off)."""
  graphdef, state = nnx.split(node)
  layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[index], state))
  for name in ("kernel", "bias"):
    variable = getattr(layer, name)
    if variable is None:
      continue
    names = variable.get_metadata().get("out_sharding")
    if names and len(names) == len(variable.shape) + len(index):
      variable.set_metadata(out_sharding=tuple(names[len(index):]))
  return layer


def _differ(path: str, layers: list[nnx.Module], stack: tuple[int, ...]) -> str:
  if isinstance(layers[0], BlockSparseLinear):
    counts = np.asarray([layer.kernel.shape[0] for layer in layers]).reshape(stack).tolist()
    total = (layers[0].in_features // layers[0].block_shape[0]) * (layers[0].out_features // layers[0].block_shape[1])
    return (f"{path}: a block-sparse stack needs the same number of kept blocks in every layer (it fixes the "
            f"kernel's shape), but its layers keep {counts} of {total} blocks. Prune every layer to the same density "
            "(jaxsparse.pruning.magnitude_masks / calibrated_prune with a BlockSparse structure do), or use an "
            "Unstructured rule (a mask of those blocks), or map this path to None.")
  return f"{path}: the sparse layers of this stack differ in their structure or shapes; map this path to None."


def sparse_stack(
    node: nnx.Linear,
    mask: np.ndarray | None,
    path: str,
    build: Callable[[nnx.Linear, np.ndarray | None, str], nnx.Module],
) -> tuple[nnx.Module, list[tuple[nnx.Module, np.ndarray | None]]]:
  """The stack of the sparse layers of a stack of ``nnx.Linear`` layers (:func:`linear_stack`).

  Args:
    node: the dense stack, kernel ``(*layers, K, N)``.
    mask: its kernel's mask ``(*layers, K, N)``, or ``None``.
    path: the stack's dotted path; layer ``i`` is ``f"{path}[{i}]"`` in errors.
    build: ``build(layer, mask, path)``: the sparse layer of one dense layer.

  Returns:
    ``(stack, layers)``: the sparse stack (every variable with the leading layer axes, as ``nnx.vmap`` builds it:
    ``nnx.scan`` / ``nnx.vmap`` over axis 0 call it as they called the dense stack) and each layer's sparse layer with
    its mask, in the order of the stack.

  Raises:
    ValueError: the layers' sparse layers differ in shape (a block-sparse stack whose layers keep different numbers
      of blocks), naming the path, the counts and what to do.
  """
  stack = linear_stack(node)
  layers = []
  for index in np.ndindex(*stack):
    where = f"{path}[{', '.join(map(str, index))}]"
    layers.append((build(_one_layer(node, index), None if mask is None else mask[index], where),
                   None if mask is None else mask[index]))
  graphdef, first = nnx.split(layers[0][0])
  shapes = jax.tree.map(jnp.shape, first)
  for layer, _ in layers[1:]:
    if nnx.graphdef(layer) != graphdef or jax.tree.map(jnp.shape, nnx.state(layer)) != shapes:
      raise ValueError(_differ(path, [layer for layer, _ in layers], stack))
  state = jax.tree.map(lambda *a: jnp.stack(a).reshape(*stack, *jnp.shape(a[0])),
                       *[nnx.state(layer) for layer, _ in layers])
  names = _stack_names(node.kernel, len(stack))
  if names is not None:  # as nnx.vmap's transform_metadata adds the stack's axis to the names, innermost first
    for name in reversed(names):
      state = spmd.add_axis(state, 0, {nnx.PARTITION_NAME: name})
  return nnx.merge(graphdef, state), layers


def _layer_axes(node: nnx.Module) -> tuple[tuple[int, ...], nnx.Variable]:
  inner = node.layer if isinstance(node, SparseLinearGeneral) else node
  leaf, ndim = _one_layer_leaf(inner)
  variable = getattr(inner, leaf)
  shape = tuple(jnp.shape(variable[...]))
  return shape[:len(shape) - ndim], variable


def dense_stack(node: nnx.Module, dense_of: Callable[[nnx.Module], nnx.Module]) -> nnx.Module:
  """``dense_of(node)``; for a stack of sparse layers (``nnx.vmap``: leading layer axes), the stack of each layer's,
  under one ``nnx.vmap`` per layer axis, the stack's partitioning names (its axis names) taken off inside and put back
  outside, as they were when the stack was built."""
  stack, variable = _layer_axes(node)
  if not stack:
    return dense_of(node)
  names = _stack_names(variable, len(stack))
  f: Any = dense_of
  for axis in reversed(range(len(stack))):  # the outermost vmap takes the first layer axis
    metadata = {} if names is None else {"transform_metadata": {nnx.PARTITION_NAME: names[axis]}}
    f = nnx.vmap(f, in_axes=0, out_axes=0, **metadata)
  return f(node)
