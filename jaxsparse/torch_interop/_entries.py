"""What the torch export writes for a Flax NNX model: one :class:`Entry` per torch parameter, in torch layout.

``kernel (in, out)`` -> ``weight (out, in)``, Conv ``(*k, I, O)`` -> ``(O, I, *k)``, an ``nnx.LinearGeneral`` kernel
``(*in_dims, *features)`` -> the torch Linear's ``weight (prod(features), prod(in_dims))`` and its bias flattened. A
sparse layer's weight is written as it computes (zero where pruned) with its mask; a conv's own Flax weight ``mask``
(``nnx.Conv`` / ``NMConv``, which multiply the kernel by it) is multiplied into the weight, as a torch conv has none. A
``TensorParallelBlockSparseLinear`` is the torch Linear of the ``BlockSparseLinear`` it splits. A stack of layers
(``nnx.vmap``: leading layer axes) has no torch form and is refused, naming the layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from flax import nnx

from jaxsparse import layers as jsl
from jaxsparse.formats._specs import matrix_shape
from jaxsparse.layers._common import _one_layer_leaf as one_layer_leaf
from jaxsparse.layers._nm import kept_mask
from jaxsparse.sharding import TensorParallelBlockSparseLinear
from jaxsparse.torch_interop._patterns import torch_layout

__all__ = ["Entry", "as_array", "masked", "nnx_entries", "weight_masked"]


@dataclasses.dataclass
class Entry:
  """One torch parameter to write: values in torch layout and, for sparse weights, the mask."""

  flax_path: str
  name: str  # torch parameter name inside the module: "weight", "bias", "running_mean", ...
  value: np.ndarray
  mask: np.ndarray | None = None
  block_shape: tuple[int, int] | None = None  # torch layout (rows, cols) for block-sparse layers
  nm: tuple[int, int] | None = None


def as_array(x: Any) -> np.ndarray:
  return np.asarray(x)


def masked(k: np.ndarray, mask: np.ndarray) -> np.ndarray:
  return np.where(mask, k, np.zeros((), k.dtype))


def weight_masked(k: np.ndarray, kept: np.ndarray, weight_mask: Any) -> np.ndarray:
  """The kernel a Flax conv with a weight ``mask`` (``nnx.Conv`` / ``nn.Conv``, which multiply their kernel by it)
  runs, zero where not ``kept``: a torch layer has no weight mask, so its weight must hold the product."""
  if weight_mask is not None:
    k = (k * as_array(weight_mask)).astype(k.dtype)
  return masked(k, kept)


def _one_layer_ndim(node: nnx.Module) -> tuple[str, int] | None:
  """``(leaf, ndim)``: the array attribute of ``node`` whose axes tell one layer from a stack, and its number of axes
  for one layer; ``None`` for layers the exporter writes parameter by parameter."""
  if isinstance(node, jsl.MaskedLinear | jsl.BlockSparseLinear | jsl.NMLinear | jsl.NMConv | jsl.CompressedNMLinear
                | jsl.CompressedNMEmbed):
    return one_layer_leaf(node)
  if isinstance(node, nnx.Linear | nnx.Embed):
    return ("kernel" if isinstance(node, nnx.Linear) else "embedding"), 2
  if isinstance(node, nnx.Conv):
    return "kernel", len(node.kernel_size) + 2
  if isinstance(node, nnx.LinearGeneral):
    return "kernel", len(node.batch_axis) + len(node.in_features) + len(node.out_features)
  if isinstance(node, nnx.BatchNorm | nnx.LayerNorm | nnx.RMSNorm | nnx.GroupNorm):
    return ("scale", 1) if isinstance(getattr(node, "scale", None), nnx.Variable) else None
  return None


def _check_one_nnx_layer(fp: str, node: nnx.Module) -> None:
  """Raises a ``ValueError`` when ``node`` holds a stack of layers (``nnx.vmap``: leading layer axes), for which a
  torch state dict has no form, saying how to export its layers one at a time."""
  found = _one_layer_ndim(node)
  if found is None:
    return
  leaf, ndim = found
  shape = tuple(np.shape(getattr(node, leaf)[...]))
  if len(shape) <= ndim:
    return
  stack = shape[: len(shape) - ndim]
  raise ValueError(
      f"{fp or '(the model)'}: this {type(node).__name__} holds a stack of {math.prod(stack)} layers (made with "
      f"nnx.vmap?): its {leaf} has shape {shape}, {len(stack)} leading axis/axes more than one layer's {ndim}. A torch "
      "state dict has no form for a stack: export one layer at a time. With graphdef, state = nnx.split(stack) (the "
      "stacked module: this layer or a module above it), layer i is nnx.merge(graphdef, jax.tree.map(lambda a: a[i], "
      "state)) for a stack built with in_axes=0; export it with torch_names= naming its torch module."
  )


def nnx_entries(model: nnx.Module) -> list[Entry]:
  nm_linear, nm_conv = getattr(jsl, "NMLinear", None), getattr(jsl, "NMConv", None)
  compressed = getattr(jsl, "CompressedNMLinear", None)
  entries, seen = [], set()
  nodes = [(tuple(path), node) for path, node in nnx.iter_graph(model)]
  # A SparseLinearGeneral's 2-D layer is the torch Linear of the SparseLinearGeneral's own path: its weight is the
  # kernel's 2-D view (matrix_shape) in torch layout, as a torch attention projection holds it.
  general = {path for path, node in nodes if isinstance(node, jsl.SparseLinearGeneral)}
  # A TensorParallelBlockSparseLinear is the torch Linear of the BlockSparseLinear it splits; its variables (per-shard
  # blocks and index arrays) are no torch layer's.
  split = {path for path, node in nodes if isinstance(node, TensorParallelBlockSparseLinear)}
  for path, node in nodes:
    if not isinstance(node, nnx.Module) or id(node) in seen:
      continue
    if not any(isinstance(v, nnx.Variable) for v in vars(node).values()):
      continue
    if any(path[:len(p)] == p and path != p for p in split):
      continue
    seen.add(id(node))
    if path[:-1] in general and path[-1:] == ("layer",):
      path = path[:-1]
    fp = ".".join(str(p) for p in path)
    if path in split:
      node = node.to_block_sparse_linear()  # its blocks gathered from the shards
    _check_one_nnx_layer(fp, node)
    bias = getattr(node, "bias", None)
    bias = None if not isinstance(bias, nnx.Variable) else as_array(bias[...])
    if nm_linear is not None and isinstance(node, nm_linear | nm_conv):
      mask = as_array(kept_mask(node))  # an NMConv's own Flax weight mask too, as its forward pass applies it
      own = node.mask if isinstance(node, nm_conv) else None  # NMLinear.mask is its N:M pattern
      k = weight_masked(as_array(node.kernel[...]), mask, own)
      entries.append(Entry(fp, "weight", torch_layout(k), torch_layout(mask), nm=(node.n, node.m)))
    elif isinstance(node, jsl.CompressedNMEmbed) or (compressed is not None and isinstance(node, compressed)):
      w = node.weight  # (in, out); an embedding's is its table transposed, as torch_layout turns it back
      entries.append(Entry(fp, "weight", torch_layout(as_array(w.to_dense())), torch_layout(as_array(w.mask())),
                           nm=(w.n, w.m)))
    elif isinstance(node, jsl.MaskedLinear):
      mask = as_array(node.mask[...])
      entries.append(Entry(fp, "weight", torch_layout(masked(as_array(node.kernel[...]), mask)), torch_layout(mask)))
    elif isinstance(node, jsl.BlockSparseLinear):
      bk, bn = node.block_shape
      bm = as_array(node.block_mask)
      mask = np.repeat(np.repeat(bm, bk, 0), bn, 1)
      dense = as_array(node.sparse_kernel.to_dense())
      entries.append(Entry(fp, "weight", torch_layout(dense), torch_layout(mask), block_shape=(bn, bk)))
    elif isinstance(node, nnx.Conv) and getattr(node, "mask", None) is not None:  # Flax / jaxsparse masked conv
      own = as_array(node.mask[...])  # Flax's weight mask multiplies the kernel: 0.5 scales the weight, 0 prunes it
      mask = np.broadcast_to(own != 0, node.kernel.shape)
      k = weight_masked(as_array(node.kernel[...]), mask, None if own.dtype == np.bool_ else own)
      entries.append(Entry(fp, "weight", torch_layout(k), torch_layout(mask)))
    elif isinstance(node, nnx.Linear | nnx.Conv):
      entries.append(Entry(fp, "weight", torch_layout(as_array(node.kernel[...]))))
    elif isinstance(node, nnx.LinearGeneral):  # a torch Linear on the kernel's 2-D view
      k = as_array(node.kernel[...])
      entries.append(Entry(fp, "weight", torch_layout(k.reshape(matrix_shape(k.shape, len(node.in_features))))))
      bias = None if bias is None else bias.reshape(-1)
    elif isinstance(node, nnx.Embed):
      entries.append(Entry(fp, "weight", as_array(node.embedding[...])))
    elif isinstance(node, nnx.BatchNorm):
      for flax_name, torch_name in (("scale", "weight"), ("mean", "running_mean"), ("var", "running_var")):
        var = getattr(node, flax_name, None)
        if isinstance(var, nnx.Variable):
          entries.append(Entry(fp, torch_name, as_array(var[...])))
    elif isinstance(node, nnx.LayerNorm | nnx.RMSNorm | nnx.GroupNorm):
      if isinstance(getattr(node, "scale", None), nnx.Variable):
        entries.append(Entry(fp, "weight", as_array(node.scale[...])))
    else:
      for name, var in vars(node).items():
        if isinstance(var, nnx.Param) and name != "bias":
          entries.append(Entry(fp, name, as_array(var[...])))
    if bias is not None:
      entries.append(Entry(fp, "bias", bias))
  return entries
