"""Sending jaxsparse models back to PyTorch: masks, masked state dicts, BSR and 2:4 weights.

Every exporter reads a Flax NNX model or Linen variables (``{"params": ..., "sparsity": ...}``) and
writes torch names and layouts: Flax module path -> torch module path through ``torch_names`` (the
``LoadReport.torch_names`` of :func:`load_nnx`, a dict, a callable, or ``None`` for the same names),
``kernel (in, out)`` -> ``weight (out, in)``, Conv ``(*k, I, O)`` -> ``(O, I, *k)``, an ``nn.DenseGeneral`` /
``nnx.LinearGeneral`` kernel ``(*in_dims, *features)`` -> the torch Linear's ``weight (prod(features),
prod(in_dims))`` and its bias flattened. In Linen variables an ``nn.DenseGeneral`` is known by its bias of ndim >= 2
(its ``features``) or by the plan of ``module=``; a kernel of ndim >= 3 with a 1-D bias or none is otherwise a conv's.
A conv's own Flax weight ``mask`` (``nnx.Conv`` / ``nn.Conv`` / ``NMConv``, which multiply the kernel by it) is
multiplied into the exported weight, as a torch conv has none: the torch layer computes the Flax forward pass.
A block-sparse layer's index arrays are read flat (``BlockSparseDense``) or under ``"pattern"`` (an NNX
``BlockSparseLinear`` under ``nnx.bridge.ToLinen``); Linen variables the exporter cannot read (a bias that is not
``(out,)``, a ``"sparsity"`` entry that is no layer's pattern) are refused, naming the layer. Linen variables in
sharding boxes (``nn.with_partitioning`` kernels and the patterns named like them, ``sparsify_linen``'s carried boxes,
a bridged layer's ``NNXMeta``) are read through them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsparse import layers as jsl
from jaxsparse.formats._block_sparse import INDEX_FIELDS
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._nm import NMSparseMatrix
from jaxsparse.formats._specs import NM
from jaxsparse.formats._specs import matrix_shape
from jaxsparse.layers._common import bridged_block_pattern
from jaxsparse.layers._common import nm_kept_mask
from jaxsparse.layers._common import pattern_mask
from jaxsparse.layers._nm import kept_mask
from jaxsparse.torch_interop._conv1d import check_conv1d
from jaxsparse.torch_interop._load import CheckpointError
from jaxsparse.torch_interop._load import import_torch
from jaxsparse.torch_interop._load import to_torch
from jaxsparse.torch_interop._patterns import detect_pattern
from jaxsparse.torch_interop._patterns import torch_layout

__all__ = ["EXPORT_FORMATS", "TorchNames", "apply_masks", "export_masks", "export_state_dict"]

TorchNames = Mapping[str, str] | Callable[[str], str] | None
EXPORT_FORMATS = ("dense", "prune", "ao", "bsr", "semi_structured")


@dataclasses.dataclass
class _Entry:
  """One torch parameter to write: values in torch layout and, for sparse weights, the mask."""

  flax_path: str
  name: str  # torch parameter name inside the module: "weight", "bias", "running_mean", ...
  value: np.ndarray
  mask: np.ndarray | None = None
  block_shape: tuple[int, int] | None = None  # torch layout (rows, cols) for block-sparse layers
  nm: tuple[int, int] | None = None


def _np(x: Any) -> np.ndarray:
  return np.asarray(x)


def _masked(k: np.ndarray, mask: np.ndarray) -> np.ndarray:
  return np.where(mask, k, np.zeros((), k.dtype))


def _weight_masked(k: np.ndarray, kept: np.ndarray, weight_mask: Any) -> np.ndarray:
  """The kernel a Flax conv with a weight ``mask`` (``nnx.Conv`` / ``nn.Conv``, which multiply their kernel by it)
  runs, zero where not ``kept``: a torch layer has no weight mask, so its weight must hold the product."""
  if weight_mask is not None:
    k = (k * _np(weight_mask)).astype(k.dtype)
  return _masked(k, kept)


def _nnx_entries(model: nnx.Module) -> list[_Entry]:
  nm_linear, nm_conv = getattr(jsl, "NMLinear", None), getattr(jsl, "NMConv", None)
  compressed = getattr(jsl, "CompressedNMLinear", None)
  entries, seen = [], set()
  nodes = [(tuple(path), node) for path, node in nnx.iter_graph(model)]
  # A SparseLinearGeneral's 2-D layer is the torch Linear of the SparseLinearGeneral's own path: its weight is the
  # kernel's 2-D view (matrix_shape) in torch layout, as a torch attention projection holds it.
  general = {path for path, node in nodes if isinstance(node, jsl.SparseLinearGeneral)}
  for path, node in nodes:
    if not isinstance(node, nnx.Module) or id(node) in seen:
      continue
    if not any(isinstance(v, nnx.Variable) for v in vars(node).values()):
      continue
    seen.add(id(node))
    if path[:-1] in general and path[-1:] == ("layer",):
      path = path[:-1]
    fp = ".".join(str(p) for p in path)
    bias = getattr(node, "bias", None)
    bias = None if not isinstance(bias, nnx.Variable) else _np(bias[...])
    if nm_linear is not None and isinstance(node, nm_linear | nm_conv):
      mask = _np(kept_mask(node))  # an NMConv's own Flax weight mask too, as its forward pass applies it
      own = node.mask if isinstance(node, nm_conv) else None  # NMLinear.mask is its N:M pattern
      k = _weight_masked(_np(node.kernel[...]), mask, own)
      entries.append(_Entry(fp, "weight", torch_layout(k), torch_layout(mask), nm=(node.n, node.m)))
    elif isinstance(node, jsl.CompressedNMEmbed) or (compressed is not None and isinstance(node, compressed)):
      w = node.weight  # (in, out); an embedding's is its table transposed, as torch_layout turns it back
      entries.append(_Entry(fp, "weight", torch_layout(_np(w.to_dense())), torch_layout(_np(w.mask())), nm=(w.n, w.m)))
    elif isinstance(node, jsl.MaskedLinear):
      mask = _np(node.mask[...])
      entries.append(_Entry(fp, "weight", torch_layout(_masked(_np(node.kernel[...]), mask)), torch_layout(mask)))
    elif isinstance(node, jsl.BlockSparseLinear):
      bk, bn = node.block_shape
      bm = _np(node.block_mask)
      mask = np.repeat(np.repeat(bm, bk, 0), bn, 1)
      dense = _np(node.sparse_kernel.to_dense())
      entries.append(_Entry(fp, "weight", torch_layout(dense), torch_layout(mask), block_shape=(bn, bk)))
    elif isinstance(node, nnx.Conv) and getattr(node, "mask", None) is not None:  # Flax / jaxsparse masked conv
      own = _np(node.mask[...])  # Flax's weight mask multiplies the kernel: 0.5 scales the weight, 0 prunes it
      mask = np.broadcast_to(own != 0, node.kernel.shape)
      k = _weight_masked(_np(node.kernel[...]), mask, None if own.dtype == np.bool_ else own)
      entries.append(_Entry(fp, "weight", torch_layout(k), torch_layout(mask)))
    elif isinstance(node, nnx.Linear | nnx.Conv):
      entries.append(_Entry(fp, "weight", torch_layout(_np(node.kernel[...]))))
    elif isinstance(node, nnx.LinearGeneral):  # a torch Linear on the kernel's 2-D view
      k = _np(node.kernel[...])
      entries.append(_Entry(fp, "weight", torch_layout(k.reshape(matrix_shape(k.shape, len(node.in_features))))))
      bias = None if bias is None else bias.reshape(-1)
    elif isinstance(node, nnx.Embed):
      entries.append(_Entry(fp, "weight", _np(node.embedding[...])))
    elif isinstance(node, nnx.BatchNorm):
      for flax_name, torch_name in (("scale", "weight"), ("mean", "running_mean"), ("var", "running_var")):
        var = getattr(node, flax_name, None)
        if isinstance(var, nnx.Variable):
          entries.append(_Entry(fp, torch_name, _np(var[...])))
    elif isinstance(node, nnx.LayerNorm | nnx.RMSNorm | nnx.GroupNorm):
      if isinstance(getattr(node, "scale", None), nnx.Variable):
        entries.append(_Entry(fp, "weight", _np(node.scale[...])))
    else:
      for name, var in vars(node).items():
        if isinstance(var, nnx.Param) and name != "bias":
          entries.append(_Entry(fp, name, _np(var[...])))
    if bias is not None:
      entries.append(_Entry(fp, "bias", bias))
  return entries


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


def _linen_plan(module: Any) -> dict[str, Any]:
  """``{path: plan}`` of the layers of a ``SparsifiedLinen``: a plan's ``kind`` is ``"dense"``, ``"general"``
  (``nn.DenseGeneral``, with ``in_dims`` and ``features``) or ``"conv"``, its ``spec`` the layer's structure (an
  ``NM``'s ``n``, ``m``, ``transposable``: N:M masks follow the kernels, no variable), its ``module`` the original
  layer."""
  if module is None:
    return {}
  found = getattr(module, "layers", None)
  if not isinstance(found, Mapping):
    raise TypeError(f"module must be the SparsifiedLinen that jaxsparse.sparsify_linen returned, got {module!r}.")
  return {".".join(path): layer for path, layer in found.items()}


def _dense_general_in_ndim(fp: str, leaves: Mapping, sp: Mapping, plan: Any) -> int | None:
  """How many leading axes of the dense kernel in ``leaves`` an ``nn.DenseGeneral`` contracts (it is the torch Linear
  on the kernel's 2-D view, as ``nnx.LinearGeneral`` is); ``None`` for other layers (a kernel of ndim >= 3 then is a
  conv's ``(*kernel_size, in, out)``).

  Known from the layer's ``plan`` (``module=``), else from a bias of ndim >= 2 (an ``nn.DenseGeneral``'s is its
  ``features``, a conv's 1-D).
  """
  kernel, bias = leaves.get("kernel"), leaves.get("bias")
  if kernel is None or np.ndim(kernel) < 3 or "kernel_positions" in sp or any(f in sp for f in INDEX_FIELDS):
    return None  # not a dense kernel of ndim >= 3 (block-sparse blocks, compressed N:M values)
  shape = tuple(np.shape(kernel))
  if plan is not None:
    return len(plan.in_dims) if plan.kind == "general" and shape == (*plan.in_dims, *plan.features) else None
  if bias is None or np.ndim(bias) < 2:
    return None
  features = tuple(np.shape(bias))
  if shape[-len(features):] != features or len(features) >= len(shape):
    raise ValueError(
        f"{fp or '(the variables)'}: its kernel has shape {shape} and its bias {features}: neither an nn.DenseGeneral "
        "(kernel (*in_dims, *features), bias features) nor a conv (bias (out,)); pass module= (the SparsifiedLinen "
        "of jaxsparse.sparsify_linen) or export variables of Flax layers."
    )
  return len(shape) - len(features)


def _linen_nm_weight(kernel: np.ndarray, layer: Any) -> tuple[np.ndarray, np.ndarray]:
  """``(weight, mask)`` of an ``NMDense`` / ``NMConv``: the kernel its forward pass runs and the mask it is pruned
  with, a conv's own Flax weight mask multiplied in first, then the N:M pattern (transposable where the rule is)
  along the input features, as ``densify_linen`` prunes it."""
  spec = layer.spec
  own = getattr(layer.module, "mask", None)
  mask = _np(nm_kept_mask(kernel, spec.n, spec.m, transposable=spec.transposable, weight_mask=own))
  return _weight_masked(kernel, mask, own), mask


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


def _linen_entries(variables: Mapping, module: Any = None) -> list[_Entry]:
  plans = _linen_plan(module)
  nm = {fp: layer for fp, layer in plans.items() if isinstance(layer.spec, NM)}
  if "params" not in variables:
    raise TypeError(f"variables must hold a 'params' collection (Linen variables), got {sorted(variables)}.")
  if "masks" in variables:  # to_linen_variables(target=...): masks for sparsify_linen, which no Linen layer reads
    raise ValueError(
        "variables hold a 'masks' entry (to_linen_variables(..., target=...) writes the pruned kernels dense with "
        "their masks there): it is not a Linen collection and its masks would be left out. Pop it and pass it as "
        "masks= to jaxsparse.sparsify_linen, then export the sparse variables with module= the SparsifiedLinen."
    )
  variables = unboxed(variables)
  params = _flatten(variables["params"])
  sparsity = _flatten(variables.get("sparsity", {}))
  stats = _flatten(variables.get("batch_stats", {}))
  entries, read = [], set()
  for fp, leaves in params.items():
    sp, source = _linen_pattern(sparsity, params, fp)
    if source is not None and _reads_pattern(leaves, sp):
      read.add(source)
    if "mask" in sp and "kernel" in leaves:
      # checked as the forward pass and densify_linen check it (0.5 or 2 would scale the kept weights in nn.Conv)
      sp = {**sp, "mask": _np(pattern_mask(sp["mask"], np.shape(leaves["kernel"]), path=fp))}
    in_ndim = _dense_general_in_ndim(fp, leaves, sp, plans.get(fp))
    if in_ndim is not None:  # an nn.DenseGeneral: the torch Linear on the 2-D view of its kernel and bias
      leaves = {k: (_np(v).reshape(matrix_shape(np.shape(v), in_ndim)) if k == "kernel" else _np(v).reshape(-1))
                   if k in ("kernel", "bias") else v for k, v in leaves.items()}
      if "mask" in sp:
        sp = {**sp, "mask": sp["mask"].reshape(leaves["kernel"].shape)}
    _check_bias(fp, leaves, sp)
    for name, value in leaves.items():
      value = _np(value)
      if name == "kernel" and "mask" in sp:
        mask = sp["mask"]
        entries.append(_Entry(fp, "weight", torch_layout(_masked(value, mask)), torch_layout(mask)))
      elif name == "kernel" and all(f in sp for f in INDEX_FIELDS):
        _, bk, bn = value.shape
        shape = ((len(sp["row_offsets"]) - 1) * bk, (len(sp["col_offsets"]) - 1) * bn)
        idx = {f: jnp.asarray(sp[f]) for f in INDEX_FIELDS}
        mat = BlockSparseMatrix.from_index_arrays(value, idx, shape=shape, block_shape=(bk, bn))
        mask = np.repeat(np.repeat(_np(mat.block_mask), bk, 0), bn, 1)
        entries.append(_Entry(fp, "weight", torch_layout(_np(mat.to_dense())), torch_layout(mask),
                              block_shape=(bn, bk)))
      elif name in ("kernel", "embedding") and f"{name}_positions" in sp:
        # Kept N:M values: a CompressedNMDense's kernel (compress_linen) or a CompressedNMEmbed's table (transposed).
        if fp not in nm:
          what, maker = (("kernel (CompressedNMDense)", "compress_linen") if name == "kernel" else
                         ("embedding (CompressedNMEmbed)", "sparsify_linen"))
          raise TypeError(f"{fp or '(the variables)'} holds a compressed N:M {what}, whose n:m only its module knows: "
                          f"pass module= (the SparsifiedLinen that jaxsparse.{maker} returned).")
        n, m = nm[fp].spec.n, nm[fp].spec.m
        mat = NMSparseMatrix(value, _np(sp[f"{name}_positions"]), shape=(value.shape[0] * m // n, value.shape[1]),
                             n=n, m=m)
        entries.append(_Entry(fp, "weight", torch_layout(_np(mat.to_dense())), torch_layout(_np(mat.mask())),
                              nm=(n, m)))
      elif name == "kernel" and fp in nm:  # NMDense / NMConv of sparsify_linen: the N:M mask of the kernel
        weight, mask = _linen_nm_weight(value, nm[fp])
        entries.append(_Entry(fp, "weight", torch_layout(weight), torch_layout(mask),
                              nm=(nm[fp].spec.n, nm[fp].spec.m)))
      elif name == "kernel":
        entries.append(_Entry(fp, "weight", torch_layout(value)))
      elif name in ("embedding", "scale"):
        entries.append(_Entry(fp, "weight", value))
      else:
        entries.append(_Entry(fp, name, value))
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
      entries.append(_Entry(fp, f"running_{name}" if name in ("mean", "var") else name, _np(value)))
  return entries


def _entries(model: Any, module: Any = None) -> list[_Entry]:
  if isinstance(model, nnx.Module):
    if module is not None:
      raise TypeError("module= is for Linen variables (the SparsifiedLinen of sparsify_linen), not an NNX model.")
    return _nnx_entries(model)
  if isinstance(model, Mapping):
    return _linen_entries(model, module)
  raise TypeError(f"model must be a flax.nnx.Module or Linen variables (a dict), got {type(model).__name__}.")


def _torch_module(torch_names: TorchNames, flax_path: str) -> str:
  if torch_names is None:
    return flax_path
  if callable(torch_names):
    return torch_names(flax_path)
  if flax_path not in torch_names:
    raise CheckpointError(
        f"torch_names has no entry for the Flax module {flax_path!r}; give every exported module a torch name "
        f"(known: {sorted(torch_names)[:8]}...)."
    )
  return torch_names[flax_path]


def _mask_tensor(mask: np.ndarray):
  """A bool torch tensor with its own, writable memory: ``mask`` may be a view of a JAX array's (read-only) buffer,
  which ``torch.from_numpy`` would share, so writing to the exported mask would change the model's."""
  return import_torch().from_numpy(np.array(mask, dtype=bool, order="C", copy=True))


def _fqn(mod: str, name: str) -> str:
  return f"{mod}.{name}" if mod else name


def _as_conv1d(e: _Entry, mod: str, conv1d: str | None) -> _Entry:
  """``e`` in the ``(in, out)`` layout of transformers' ``Conv1D`` if ``conv1d`` matches its torch module path."""
  if conv1d is None or e.name != "weight" or e.value.ndim != 2 or not re.search(conv1d, mod):
    return e
  return dataclasses.replace(e, value=e.value.T, mask=None if e.mask is None else e.mask.T,
                             block_shape=None if e.block_shape is None else e.block_shape[::-1])


def export_masks(
    model: Any, *, torch_names: TorchNames = None, dtype: Any = None, module: Any = None, conv1d: str | None = None
) -> dict[str, Any]:
  """The masks of a jaxsparse model as ``{"{torch module}.weight_mask": tensor}`` in torch layout.

  Covers ``MaskedLinear``, ``BlockSparseLinear`` (its blocks expanded), ``NMLinear``/``NMConv`` (the
  current N:M mask) and the Linen ``MaskedDense``/``BlockSparseDense`` variables (and those of a ``BlockSparseLinear``
  under ``nnx.bridge.ToLinen``, its index arrays under ``"pattern"``).

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxsparse import torch_interop
  >>> from jaxsparse.layers import MaskedLinear
  >>> layer = MaskedLinear(8, 4, mask=jnp.eye(8, 4, dtype=bool), rngs=nnx.Rngs(0))
  >>> {k: tuple(v.shape) for k, v in torch_interop.export_masks(layer, torch_names={"": "fc"}).items()}
  {'fc.weight_mask': (4, 8)}

  Args:
    model: a Flax NNX model or Linen variables.
    torch_names: Flax module path -> torch module path: ``LoadReport.torch_names``, a dict, a callable,
      or ``None`` (same dotted names).
    dtype: torch dtype of the masks; ``None`` gives bool (``torch.nn.utils.prune`` stores masks in the
      weight's dtype: pass ``torch.float32`` to match its ``weight_mask`` bit for bit).
    module: for Linen variables from :func:`jaxsparse.sparsify_linen`, the ``SparsifiedLinen`` it returned: its
      ``NMDense`` / ``NMConv`` layers keep no mask variable (the mask follows the kernel), so without it they are
      written as dense weights; its plan also tells its ``nn.DenseGeneral`` layers from convs (in the variables
      of :func:`jaxsparse.densify_linen` too, whose kernels have their ``(*in_dims, *features)`` shapes).

  Returns:
    ``{name: torch.Tensor}``, ready for :func:`apply_masks`.

  Raises:
    ValueError: as :func:`export_state_dict`.
    TypeError: as :func:`export_state_dict`.
  """
  import_torch()
  check_conv1d(conv1d)
  out = {}
  for e in _entries(model, module):
    if e.mask is None:
      continue
    mod = _torch_module(torch_names, e.flax_path)
    t = _mask_tensor(_as_conv1d(e, mod, conv1d).mask)
    out[_fqn(mod, e.name) + "_mask"] = t if dtype is None else t.to(dtype)
  return out


def apply_masks(torch_module: Any, masks: Mapping[str, Any], *, strict: bool = True) -> Any:
  """Prunes a torch module with ``masks`` through ``torch.nn.utils.prune.custom_from_mask``.

  Each ``"{module}.{param}_mask"`` entry prunes ``param`` of ``torch_module.get_submodule(module)``,
  which then holds ``{param}_orig`` and ``{param}_mask`` like any ``torch.nn.utils.prune`` model (an
  already pruned parameter gets the product of both masks, as in torch). Every mask is checked first,
  so a bad entry leaves the module unchanged.

  >>> import torch
  >>> from jaxsparse import torch_interop
  >>> fc = torch_interop.apply_masks(torch.nn.Linear(8, 4), {"weight_mask": torch.eye(4, 8, dtype=torch.bool)})
  >>> int((fc.weight != 0).sum())
  4

  Args:
    torch_module: the ``torch.nn.Module`` to prune (in place).
    masks: ``{"{module}.{param}_mask": tensor}`` with 0/1 or bool values in the parameter's shape, e.g.
      from :func:`export_masks`.
    strict: raise on keys that do not end in ``_mask``.

  Returns:
    ``torch_module``.

  Raises:
    TypeError: ``torch_module`` is not a ``torch.nn.Module``.
    CheckpointError: (a ``ValueError``; raised before anything is pruned) with ``strict``, a key that does not
      end in ``_mask``; a key naming a module or parameter ``torch_module`` lacks; a mask that is not a tensor
      or array, has another shape than its parameter, or holds values other than 0 and 1.
    ImportError: PyTorch is not installed.
  """
  torch = import_torch()
  import torch.nn.utils.prune as prune  # noqa: PLC0415 -- optional dependency

  if not isinstance(torch_module, torch.nn.Module):
    raise TypeError(f"torch_module must be a torch.nn.Module, got {type(torch_module).__name__}.")
  todo = []
  for key, mask in masks.items():
    if not key.endswith("_mask"):
      if strict:
        raise CheckpointError(f"mask key {key!r} must end in '_mask' ('{{module}}.{{param}}_mask').")
      continue
    fqn = key[: -len("_mask")]
    mod_path, _, pname = fqn.rpartition(".")
    try:
      sub = torch_module.get_submodule(mod_path)
    except AttributeError as e:
      raise CheckpointError(f"mask {key!r}: the torch model has no module {mod_path!r}.") from e
    current = getattr(sub, pname, None)
    if not isinstance(current, torch.Tensor):
      raise CheckpointError(f"mask {key!r}: module {mod_path!r} ({type(sub).__name__}) has no parameter {pname!r}.")
    m = to_torch(mask, key=key)
    if tuple(m.shape) != tuple(current.shape):
      raise CheckpointError(f"mask {key!r} has shape {tuple(m.shape)} but {fqn!r} has shape {tuple(current.shape)}.")
    if m.dtype != torch.bool and not bool(((m == 0) | (m == 1)).all()):
      raise CheckpointError(f"mask {key!r} must hold only 0 and 1.")
    todo.append((sub, pname, m.to(device=current.device)))
  for sub, pname, m in todo:
    prune.custom_from_mask(sub, pname, m)
  return torch_module


def _check_nm_24(e: _Entry, fqn: str) -> None:
  pattern = detect_pattern(e.mask)
  if e.value.ndim != 2 or pattern.kind != "nm" or (pattern.n, pattern.m) not in ((2, 4), (1, 2)):
    raise CheckpointError(
        f"{fqn}: format='semi_structured' needs 2-D 2:4 weights (2 kept of every 4 input features), but this "
        f"layer's mask is {pattern} with shape {e.value.shape}."
    )


def export_state_dict(
    model: Any,
    *,
    format: str = "dense",
    torch_names: TorchNames = None,
    dtype: Any = None,
    module: Any = None,
    conv1d: str | None = None,
) -> dict[str, Any]:
  """A torch state dict of a whole jaxsparse model, its sparse layers written in ``format``.

  Formats for the sparse weights (everything else is written densely):

  * ``"dense"``: ``weight`` with zeros where pruned (a plain ``model.load_state_dict`` input);
  * ``"prune"``: ``weight_orig`` + ``weight_mask`` (mask in the weight's dtype), what a model pruned with
    ``torch.nn.utils.prune`` holds;
  * ``"ao"``: ``parametrizations.weight.original`` + ``parametrizations.weight.0.mask`` (bool), the
    layout of a model prepared by a ``torch.ao.pruning`` sparsifier;
  * ``"bsr"``: block-sparse weights as ``torch.sparse_bsr`` tensors with the layer's blocks (transposed to
    torch layout), other masked weights dense;
  * ``"semi_structured"``: like ``"dense"``, but every sparse weight must be 2:4 along the input features,
    the pattern ``torch.sparse.to_sparse_semi_structured(w.half().cuda())`` needs (checked here; its
    shape and dtype limits, e.g. dimensions that are multiples of 64, are left to torch).

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxsparse import torch_interop
  >>> from jaxsparse.layers import MaskedLinear
  >>> layer = MaskedLinear(8, 4, mask=jnp.eye(8, 4, dtype=bool), rngs=nnx.Rngs(0))
  >>> sorted(torch_interop.export_state_dict(layer, format="prune"))
  ['bias', 'weight_mask', 'weight_orig']

  Args:
    model: a Flax NNX model or Linen variables.
    format: one of ``"dense"``, ``"prune"``, ``"ao"``, ``"bsr"``, ``"semi_structured"``.
    torch_names: Flax module path -> torch module path (see :func:`export_masks`).
    dtype: torch dtype for floating-point tensors (e.g. ``torch.float16``); ``None`` keeps them.
    module: for Linen variables, the ``SparsifiedLinen`` of :func:`jaxsparse.sparsify_linen` (see
      :func:`export_masks`).
    conv1d: regex of the torch module paths that are transformers ``Conv1D`` modules, whose weights (and masks,
      BSR blocks) are written ``(in, out)`` (see :func:`export_masks`); ``format="semi_structured"`` checks their
      2:4 pattern along the input features, as the Linear layout has it.

  Returns:
    ``{name: torch.Tensor}``.

  Raises:
    ValueError: an unknown ``format``; Linen variables holding a ``"masks"`` entry (from
      ``to_linen_variables(..., target=...)``); a Linen kernel of ndim >= 3 whose bias (ndim >= 2) is not its
      trailing axes, neither an ``nn.DenseGeneral`` nor a conv (naming the path); a Linen ``"sparsity"`` mask not of
      its kernel's shape (naming the path); a Linen bias that is not ``(out,)`` of its kernel (its Linear's, conv's or
      block-sparse layer's), or a ``"sparsity"`` entry that is not the pattern of the layer beside it (a mask, the
      block index arrays, flat or under ``"pattern"``, or N:M positions): variables of a layout the exporter cannot
      read, refused (naming the path) rather than written wrong.
    TypeError: ``model`` is neither an NNX module nor Linen variables, or Linen variables without
      ``"params"``; ``module`` given with an NNX model or not a ``SparsifiedLinen``; Linen variables with a
      compressed N:M kernel or embedding (``CompressedNMDense``, ``CompressedNMEmbed``) and no ``module``; a Linen
      ``"sparsity"`` mask that is not boolean (naming the layer and the dtype; the layer's forward refuses it too).
    CheckpointError: (a ``ValueError``) ``format="semi_structured"`` with a sparse weight that is not 2-D and
      2:4 (or 1:2) along the input features; a ``torch_names`` dict without an entry for an exported module.
    ImportError: PyTorch is not installed.
  """
  torch = import_torch()
  if format not in EXPORT_FORMATS:
    raise ValueError(f"format must be one of {EXPORT_FORMATS}, got format={format!r}.")
  check_conv1d(conv1d)

  def t(x: np.ndarray):
    out = to_torch(np.ascontiguousarray(x), key="export")
    return out.to(dtype) if dtype is not None and out.is_floating_point() else out

  out = {}
  for e in _entries(model, module):
    mod = _torch_module(torch_names, e.flax_path)
    fqn = _fqn(mod, e.name)
    if format == "semi_structured" and e.mask is not None:
      _check_nm_24(e, fqn)
    e = _as_conv1d(e, mod, conv1d)
    if e.mask is None or format in ("dense", "semi_structured"):
      out[fqn] = t(e.value)
    elif format == "prune":
      value = t(e.value)
      out[fqn + "_orig"] = value
      out[fqn + "_mask"] = _mask_tensor(e.mask).to(value.dtype)
    elif format == "ao":
      out[_fqn(mod, f"parametrizations.{e.name}.original")] = t(e.value)
      out[_fqn(mod, f"parametrizations.{e.name}.0.mask")] = _mask_tensor(e.mask)
    elif e.block_shape is not None:  # bsr
      b0, b1 = e.block_shape
      rows, cols = e.value.shape
      block_mask = e.mask[::b0, ::b1]
      r, c = np.nonzero(block_mask)
      crow = np.concatenate([[0], np.cumsum(block_mask.sum(1))]).astype(np.int64)
      blocks = e.value.reshape(rows // b0, b0, cols // b1, b1).transpose(0, 2, 1, 3)[r, c]
      out[fqn] = torch.sparse_bsr_tensor(
          torch.from_numpy(crow), torch.from_numpy(c.astype(np.int64)), t(blocks), size=(rows, cols)
      )
    else:
      out[fqn] = t(e.value)
  return out
