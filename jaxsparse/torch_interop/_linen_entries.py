"""What the torch export writes for Linen variables (``{"params": ..., "sparsity": ...}``): one
:class:`~._entries.Entry` per torch parameter, in torch layout.

An ``nn.DenseGeneral`` is known by its bias of ndim >= 2 (its ``features``) or by ``module=``; a kernel of ndim >= 3
with a 1-D bias or none is otherwise a conv's. What the variables alone do not say (an ``NMDense``'s N:M mask, a
compressed layer's ``n:m``, a stack of layers) comes from the module (:mod:`._linen_layers`); without one, the kernels
read by their shapes alone are listed in a warning. A block-sparse layer's index arrays are read flat
(``BlockSparseDense``) or under ``"pattern"`` (an NNX ``BlockSparseLinear`` under ``nnx.bridge.ToLinen``); variables the
exporter cannot read (a bias that is not ``(out,)``, a ``"sparsity"`` entry that is no layer's pattern) are refused,
naming the layer. Variables in sharding boxes (``nn.with_partitioning`` kernels and the patterns named like them,
``sparsify_linen``'s carried boxes, a bridged layer's ``NNXMeta``) are read through them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse._utils import warn_at_caller
from jaxsparse.formats._block_sparse import INDEX_FIELDS
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._nm import NMSparseMatrix
from jaxsparse.formats._specs import matrix_shape
from jaxsparse.layers._common import bridged_block_pattern
from jaxsparse.layers._common import nm_kept_mask
from jaxsparse.layers._common import pattern_mask
from jaxsparse.torch_interop._entries import Entry
from jaxsparse.torch_interop._entries import as_array
from jaxsparse.torch_interop._entries import masked
from jaxsparse.torch_interop._entries import weight_masked
from jaxsparse.torch_interop._linen_layers import LinenLayer
from jaxsparse.torch_interop._linen_layers import check_one_layer
from jaxsparse.torch_interop._linen_layers import linen_layers
from jaxsparse.torch_interop._patterns import torch_layout

__all__ = ["linen_entries", "unboxed"]


def unboxed(variables: Mapping) -> Any:
  """Linen variables without their sharding boxes (``nn.Partitioned``, ``nn.LogicallyPartitioned``, a bridged
  layer's ``nnx.bridge.NNXMeta``): each box's value as it is, no sharding constraint (the export only reads them).

  Layers built with ``nn.with_partitioning`` kernels box their ``"sparsity"`` variables like the kernel, and
  :func:`jaxsparse.sparsify_linen` carries the dense layers' boxes over: read boxed, a kernel had shape ``()`` and a
  mask no length."""
  def value(x: Any) -> Any:
    if isinstance(x, nn.Partitioned):
      return x.unbox(apply_constraint=False)
    return x.unbox() if isinstance(x, nn.meta.AxisMetadata) else x

  return jax.tree.map(value, variables, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, dict]:
  """``{module path: {leaf name: array}}`` of a nested variables dict."""
  out: dict[str, dict] = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      for mod, leaves in _flatten(v, f"{prefix}.{k}" if prefix else str(k)).items():
        out.setdefault(mod, {}).update(leaves)
    else:
      out.setdefault(prefix, {})[str(k)] = v
  return out


def _dense_general_in_ndim(fp: str, leaves: Mapping, sp: Mapping, layer: LinenLayer | None) -> int | None:
  """How many leading axes of the dense kernel in ``leaves`` an ``nn.DenseGeneral`` contracts (it is the torch Linear
  on the kernel's 2-D view, as ``nnx.LinearGeneral`` is); ``None`` for other layers (a kernel of ndim >= 3 then is a
  conv's ``(*kernel_size, in, out)``).

  Known from the ``layer`` that ``module=`` says is at ``fp``, else from a bias of ndim >= 2 (an ``nn.DenseGeneral``'s
  is its ``features``, a conv's 1-D).
  """
  kernel, bias = leaves.get("kernel"), leaves.get("bias")
  if kernel is None or np.ndim(kernel) < 3 or "kernel_positions" in sp or any(f in sp for f in INDEX_FIELDS):
    return None  # not a dense kernel of ndim >= 3 (block-sparse blocks, compressed N:M values)
  shape = tuple(np.shape(kernel))
  if layer is not None:
    general = layer.kind == "general" and len(shape) == layer.in_ndim + len(layer.features)
    return layer.in_ndim if general and shape[layer.in_ndim:] == layer.features else None
  if bias is None or np.ndim(bias) < 2:
    return None
  features = tuple(np.shape(bias))
  if shape[-len(features):] != features or len(features) >= len(shape):
    raise ValueError(
        f"{fp or '(the variables)'}: its kernel has shape {shape} and its bias {features}: neither an nn.DenseGeneral "
        "(kernel (*in_dims, *features), bias features) nor a conv (bias (out,)); pass module= (the Linen module, "
        "with example inputs, or the SparsifiedLinen of jaxsparse.sparsify_linen) or export variables of Flax layers."
    )
  return len(shape) - len(features)


def _linen_nm_weight(kernel: np.ndarray, layer: LinenLayer) -> tuple[np.ndarray, np.ndarray]:
  """``(weight, mask)`` of an ``NMDense`` / ``NMConv``: the kernel its forward pass runs and the mask it is pruned
  with, a conv's own Flax weight mask multiplied in first, then the N:M pattern (transposable where the rule is)
  along the input features, as ``densify_linen`` prunes it."""
  spec, own = layer.nm, layer.weight_mask
  mask = as_array(nm_kept_mask(kernel, spec.n, spec.m, transposable=spec.transposable, weight_mask=own))
  return weight_masked(kernel, mask, own), mask


def _one_level(flat: Mapping[str, dict], fp: str) -> dict:
  """The entry of the layer at ``fp`` in a :func:`_flatten` ed collection with its ``"pattern"`` child nested back,
  as :func:`jaxsparse.layers._common.bridged_block_pattern` reads one layer's variables."""
  nested = f"{fp}.pattern" if fp else "pattern"
  return {**flat.get(fp, {}), **({"pattern": flat[nested]} if nested in flat else {})}


def _linen_pattern(sparsity: Mapping[str, dict], params: Mapping[str, dict], fp: str) -> tuple[dict, str | None]:
  """The ``"sparsity"`` leaves of the layer at ``fp`` and the module path they came from (``None`` if none): its own,
  or, for an NNX ``BlockSparseLinear`` under ``nnx.bridge.ToLinen``, its ``pattern`` dict of index arrays one level
  down (``{"pattern": {"row_indices": ...}}``, where a ``BlockSparseDense`` keeps them flat)."""
  index = bridged_block_pattern(_one_level(sparsity, fp), _one_level(params, fp))
  if index is not None:
    return dict(index), f"{fp}.pattern" if fp else "pattern"
  return dict(sparsity.get(fp, {})), fp if fp in sparsity else None


def _check_bias(fp: str, leaves: Mapping, sp: Mapping) -> None:
  """A layer's bias must be ``(out,)``: the last axis of a Linear's or conv's kernel ``(..., out)``, the columns of a
  block-sparse layer's. A kernel this exporter cannot read (a layer's own layout) would otherwise go out as a weight
  of the wrong shape, or of the right shape with wrong values."""
  kernel, bias = leaves.get("kernel"), leaves.get("bias")
  if kernel is None or bias is None or "kernel_positions" in sp:  # a compressed kernel is (kept values, out)
    return
  out = np.shape(kernel)[-1:]
  if all(f in sp for f in INDEX_FIELDS) and np.ndim(kernel) == 3:  # (nnz, bk, bn) blocks
    out = ((len(sp["col_offsets"]) - 1) * np.shape(kernel)[-1],)
  if np.shape(bias) != out:
    raise ValueError(
        f"{fp or '(the variables)'}: its kernel has shape {tuple(np.shape(kernel))} and its bias "
        f"{tuple(np.shape(bias))}, not the (out,) = {out} bias of a Linear or conv: a layout this exporter cannot "
        "read (an NNX layer under nnx.bridge.ToLinen keeps its own; layers stacked by nn.scan have a layer axis). "
        "Export the NNX model itself, or the variables of one layer at a time."
    )


def _reads_pattern(leaves: Mapping, sp: Mapping) -> bool:
  """Whether ``sp`` is the whole ``"sparsity"`` entry of a jaxsparse Linen layer with these params: a kernel's mask
  (``MaskedDense``, masked ``nn.Conv``), its block index arrays (``BlockSparseDense``) or kept N:M positions
  (``CompressedNMDense``); an embedding's positions (``CompressedNMEmbed``)."""
  if "kernel" in leaves:
    return frozenset(sp) in (frozenset({"mask"}), frozenset(INDEX_FIELDS), frozenset({"kernel_positions"}))
  return "embedding" in leaves and frozenset(sp) == frozenset({"embedding_positions"})


def linen_entries(variables: Mapping, module: Any, inputs: tuple, caller: str) -> list[Entry]:
  """The torch parameters of Linen ``variables``; ``module`` and ``inputs`` as :func:`~._linen_layers.linen_layers`
  takes them, ``caller`` the public function, for messages."""
  if "params" not in variables:
    raise TypeError(f"variables must hold a 'params' collection (Linen variables), got {sorted(variables)}.")
  if "masks" in variables:  # to_linen_variables(target=...): masks for sparsify_linen, which no Linen layer reads
    raise ValueError(
        "variables hold a 'masks' entry (to_linen_variables(..., target=...) writes the pruned kernels dense with "
        "their masks there): it is not a Linen collection and its masks would be left out. Pop it and pass it as "
        "masks= to jaxsparse.sparsify_linen, then export the sparse variables with module= the SparsifiedLinen."
    )
  layers = linen_layers(module, variables, inputs, caller=caller)
  nm = {fp: layer for fp, layer in layers.items() if layer.nm is not None}
  variables = unboxed(variables)
  params = _flatten(variables["params"])
  sparsity = _flatten(variables.get("sparsity", {}))
  stats = _flatten(variables.get("batch_stats", {}))
  entries, read, by_shape = [], set(), []
  for fp, leaves in params.items():
    check_one_layer(fp, layers.get(fp), leaves)
    sp, source = _linen_pattern(sparsity, params, fp)
    if source is not None and _reads_pattern(leaves, sp):
      read.add(source)
    if "mask" in sp and "kernel" in leaves:
      # checked as the forward pass and densify_linen check it (0.5 or 2 would scale the kept weights in nn.Conv)
      sp = {**sp, "mask": as_array(pattern_mask(sp["mask"], np.shape(leaves["kernel"]), path=fp))}
    in_ndim = _dense_general_in_ndim(fp, leaves, sp, layers.get(fp))
    if fp not in layers and "kernel" in leaves and in_ndim is None and not _read_alone(leaves["kernel"], sp):
      by_shape.append(fp or "(the variables)")
    if in_ndim is not None:  # an nn.DenseGeneral: the torch Linear on the 2-D view of its kernel and bias
      kernel = as_array(leaves["kernel"])
      leaves = {**leaves, "kernel": kernel.reshape(matrix_shape(kernel.shape, in_ndim)),
                **({"bias": as_array(leaves["bias"]).reshape(-1)} if "bias" in leaves else {})}
      if "mask" in sp:
        sp = {**sp, "mask": sp["mask"].reshape(leaves["kernel"].shape)}
    _check_bias(fp, leaves, sp)
    for name, value in leaves.items():
      value = as_array(value)
      if name == "kernel" and "mask" in sp:
        mask = sp["mask"]
        entries.append(Entry(fp, "weight", torch_layout(masked(value, mask)), torch_layout(mask)))
      elif name == "kernel" and all(f in sp for f in INDEX_FIELDS):
        _, bk, bn = value.shape
        shape = ((len(sp["row_offsets"]) - 1) * bk, (len(sp["col_offsets"]) - 1) * bn)
        idx = {f: jnp.asarray(sp[f]) for f in INDEX_FIELDS}
        mat = BlockSparseMatrix.from_index_arrays(value, idx, shape=shape, block_shape=(bk, bn))
        mask = np.repeat(np.repeat(as_array(mat.block_mask), bk, 0), bn, 1)
        entries.append(Entry(fp, "weight", torch_layout(as_array(mat.to_dense())), torch_layout(mask),
                             block_shape=(bn, bk)))
      elif name in ("kernel", "embedding") and f"{name}_positions" in sp:
        # Kept N:M values: a CompressedNMDense's kernel (compress_linen) or a CompressedNMEmbed's table (transposed).
        if fp not in nm:
          layer, maker = (("CompressedNMDense", "compress_linen") if name == "kernel" else
                          ("CompressedNMEmbed", "sparsify_linen"))
          fix = (f"pass module= (the Linen module, with example inputs: {caller}(variables, x, module=model); or the "
                 f"SparsifiedLinen that jaxsparse.{maker} returned)" if module is None else
                 f"module.apply on the example inputs called no {layer} there: pass inputs that reach it")
          raise TypeError(f"{fp or '(the variables)'} holds a compressed N:M {name} ({layer}), whose n:m only its "
                          f"module knows: {fix}.")
        n, m = nm[fp].nm.n, nm[fp].nm.m
        mat = NMSparseMatrix(value, as_array(sp[f"{name}_positions"]), shape=(value.shape[0] * m // n, value.shape[1]),
                             n=n, m=m)
        entries.append(Entry(fp, "weight", torch_layout(as_array(mat.to_dense())), torch_layout(as_array(mat.mask())),
                             nm=(n, m)))
      elif name == "kernel" and fp in nm:  # an NMDense / NMConv (module= says it): the N:M mask of the kernel
        weight, mask = _linen_nm_weight(value, nm[fp])
        entries.append(Entry(fp, "weight", torch_layout(weight), torch_layout(mask), nm=(nm[fp].nm.n, nm[fp].nm.m)))
      elif name == "kernel":
        entries.append(Entry(fp, "weight", torch_layout(value)))
      elif name in ("embedding", "scale"):
        entries.append(Entry(fp, "weight", value))
      else:
        entries.append(Entry(fp, name, value))
  unread = {fp: sorted(sparsity[fp]) for fp in sparsity if fp not in read}
  if unread:  # a pattern the exporter did not apply: the weights it wrote would be those of another layer
    fp, names = next(iter(unread.items()))
    raise ValueError(
        f"{fp or '(the variables)'}: its 'sparsity' variables {names} are not the pattern of a layer this exporter "
        f"reads (a mask, the block-sparse index arrays {list(INDEX_FIELDS)}, or N:M positions, beside the layer's "
        "kernel or embedding): refusing to export weights without them. Export the NNX model itself, or pass "
        "variables of jaxsparse's Linen layers."
    )
  for fp, leaves in stats.items():
    for name, value in leaves.items():
      entries.append(Entry(fp, f"running_{name}" if name in ("mean", "var") else name, as_array(value)))
  if by_shape:
    _warn_read_by_shape(by_shape, module, caller)
  return entries


def _read_alone(kernel: Any, sp: Mapping) -> bool:
  """Whether Linen variables alone say what the layer of ``kernel`` computes: a ``MaskedDense``'s 2-D kernel and
  mask, a ``BlockSparseDense``'s blocks, a ``CompressedNMDense``'s kept values (its n:m is checked apart)."""
  return (("mask" in sp and np.ndim(kernel) == 2) or all(f in sp for f in INDEX_FIELDS)
          or "kernel_positions" in sp)


def _warn_read_by_shape(paths: list[str], module: Any, caller: str) -> None:
  listing = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
  why = ("without module=" if module is None else
         f"not called by module.apply on the example inputs, or of a layer {caller} does not know")
  warn_at_caller(
      f"{caller}: {len(paths)} Linen kernel(s), {why}, were read by their shapes alone: {listing}. A kernel with no "
      "'sparsity' pattern is written as it is, as an NMDense / NMConv's would be (they keep none: their N:M mask "
      "follows the kernel), and one of ndim >= 3 as a conv's, as a stack of layers' (nn.scan) would be. If any is "
      f"one, pass module= and example inputs ({caller}(variables, x, module=model); a SparsifiedLinen needs none), "
      "so that each layer is written as it computes.",
      UserWarning,
  )
