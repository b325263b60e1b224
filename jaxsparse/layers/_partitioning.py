"""Sharding annotations survive ``sparsify`` and ``from_dense``: a dense layer's partitioning goes to its sparse
replacement.

A dense kernel annotated with ``nnx.with_partitioning(init, names)`` (NNX ``out_sharding``
metadata) or ``nn.with_partitioning`` (Linen ``nn.Partitioned`` boxes) passes its names on:

* parameters and masks of the kernel's shape (``MaskedLinear``, ``MaskedConv``, ``NMLinear``,
  ``NMConv``) take the kernel's names, dim by dim; the bias keeps its own;
* ``SparseLinearGeneral`` (and the sparse layer of a Linen ``nn.DenseGeneral``) folds the kernel
  to ``(K, N)`` and the bias to ``(N,)``: a group of dims keeps the name of its leading dim when
  that is the only named one (the merged dim splits the same way), else none;
* an embedding's compressed table (``CompressedNMEmbed``, NNX and Linen, transposed) takes the table's names,
  swapped;
* the packed positions of a compressed N:M kernel or table (``*_positions``) take only the name of its last dim
  (the outputs, the vocabulary): their few rows of packed words are replicated, as a split of the kept dim need not
  divide them;
* block-sparse values ``(nnz_blocks, bk, bn)`` and their index arrays are replicated, ``(None, ...)``:
  the data-parallel layout every op partitions over. Splitting a block-sparse weight over devices
  is tensor parallelism, a layout with per-shard indices (:mod:`jaxsparse.sharding`).

Where the dense kernel's value was already placed on a mesh, the new arrays are placed likewise.

A sparse layer built directly with a named kernel (``kernel_init=nnx.with_partitioning(...)`` /
``nn.with_partitioning(...)``, an ``nnx`` ``kernel_metadata``) names its sparsity state the same way
(:func:`structure_metadata`, :func:`box_structure`, after :func:`structure_names`): the mask takes the kernel's names,
packed positions their last dim's, block index arrays ``(None,)``. Every such array then has names, which is what lets
Flax's stacking transforms annotate it: ``nnx.vmap`` / ``nnx.scan`` with ``transform_metadata={nnx.PARTITION_NAME:
"layers"}`` and Linen's ``nn.scan`` / ``nn.vmap`` with ``metadata_params={nn.PARTITION_NAME: "layers"}`` insert the
stack axis into the names of a variable only where it has some; an unnamed pattern stayed unannotated (its spec
``P()``: the whole stack's patterns replicated on every device).

Each layer's ``to_dense()`` (and so ``densify``, which calls it) carries the names back (:func:`carry_back_nnx`): the
dense kernel (table) and bias take the names their sparse twins hold, unfolded or swapped back. Where the sparse names
cannot tell the dense ones (block-sparse values, replicated; a ``LinearGeneral`` kernel or bias folded to 2-D / 1-D),
:func:`carry_nnx` records the dense names in the sparse variable's ``dense_out_sharding`` metadata, which
``to_dense()`` (and ``compress``, carrying it on) reads. A sparse layer built directly, without them, gives its folded
names back on the leading dim of each group.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from flax.core import spmd as core_spmd
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsparse import _utils
from jaxsparse.formats._base import is_concrete

__all__ = ["DENSE_NAMES", "box_structure", "carry_back_nnx", "carry_linen", "carry_nnx", "structure_metadata",
           "structure_names"]

Names = tuple[Any, ...]

DENSE_NAMES = "dense_out_sharding"
"""Metadata key of a sparse kernel (bias) whose own names cannot give back the dense layer's: the dense names."""

BLOCKS, FOLDED = "blocks", "folded"
"""The ``_kernel_layout`` class attribute of ``BlockSparseLinear`` and ``SparseLinearGeneral`` (see :func:`_layout`)."""


def _layout(layer: Any) -> str | None:
  """How a sparse layer's kernel stands for the dense one, from its class's ``_kernel_layout``: :data:`BLOCKS` (kept
  blocks ``(nnz_blocks, bk, bn)``, no dense dims: ``BlockSparseLinear``), :data:`FOLDED` (a wrapped ``(K, N)`` layer
  of a kernel folded from ``(*in_features, *out_features)``: ``SparseLinearGeneral``), else ``None`` (the dense
  kernel's dims, or a table's swapped). A class attribute, not ``isinstance``: the layers import these helpers (their
  ``to_dense()`` carries the names back), so the helpers cannot import the layers."""
  return getattr(type(layer), "_kernel_layout", None)


def _fold(names: Names, groups: tuple[int, ...]) -> Names:
  """Names of dims folded into ``len(groups)`` dims of ``groups[i]`` consecutive dims each."""
  out, start = [], 0
  for size in groups:
    group = names[start : start + size]
    start += size
    named = [n for n in group if n is not None]
    out.append(group[0] if len(named) == 1 and group[0] is not None else None)
  return tuple(out)


def _unfold(names: Names, groups: tuple[int, ...]) -> Names:
  """Names of ``len(names)`` dims unfolded into groups of ``groups[i]`` dims: each name on its group's leading dim,
  the inverse of :func:`_fold` where it kept a name."""
  return tuple(n for name, size in zip(names, groups, strict=True) for n in (name, *(None,) * (size - 1)))


def _positions_names(kernel_names: Names) -> Names:
  """Names of the packed N:M positions ``(words, N)`` of a compressed kernel ``(K, N)`` named ``kernel_names``: only
  ``N``'s; their few rows of packed words (``K / 8`` for 2:4) are replicated, as a split of ``K`` need not divide
  them."""
  return (None, kernel_names[-1])


def structure_names(kernel_names: Names, name: str, ndim: int, *, blocks: bool = False) -> Names:
  """The partitioning names of an array ``name`` of ``ndim`` dims of a layer whose kernel (stored table) is named
  ``kernel_names``: an array of the kernel's rank (the kernel itself, a mask) takes them, packed positions
  (``*_positions``) only the last dim's (:func:`_positions_names`), and a block-sparse layer's arrays (``blocks``:
  kept blocks, index arrays) or one of another rank (a cuSPARSELt buffer) ``None`` on every dim, replicated.

  Never ``()`` for an array of dims: Flax's stacking transforms (``nnx.vmap`` / ``nnx.scan`` ``transform_metadata``,
  Linen ``metadata_params``) insert the stack axis only into names a variable has.

  >>> structure_names(("embed", "mlp"), "mask", 2), structure_names(("embed", "mlp"), "kernel_positions", 2)
  (('embed', 'mlp'), (None, 'mlp'))
  >>> structure_names((None, None, "mlp"), "row_indices", 1, blocks=True)
  (None,)
  """
  kernel_names = tuple(kernel_names)
  if blocks or ndim != len(kernel_names):
    return (None,) * ndim
  if name.endswith("_positions"):
    return _positions_names(kernel_names)
  return kernel_names


def _sharding_extra(var: nnx.Variable) -> dict[str, Any]:
  """The metadata besides the names that tells a variable's sharding (``sharding_rules``, ``mesh``), where set."""
  return {k: v for k, v in var.get_metadata().items() if k in ("sharding_rules", "mesh") and v is not None}


def structure_metadata(kernel: Any, name: str, ndim: int, *, blocks: bool = False) -> dict[str, Any]:
  """The metadata of an NNX layer's sparsity-state variable ``name`` (a :class:`SparsityPattern`, a cuSPARSELt
  buffer) of ``ndim`` dims, built beside the layer's ``kernel`` variable: where the kernel is named (``out_sharding``,
  from ``nnx.with_partitioning`` or ``kernel_metadata``), ``out_sharding`` of :func:`structure_names` and the kernel's
  ``sharding_rules`` / ``mesh`` / ``eager_sharding``; else ``{}`` (an unannotated layer keeps an unannotated state).

  Passed to the variable's constructor, so that it is placed as the kernel is (Flax's eager sharding, where the
  kernel's is on), and so that ``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: "layers"})`` gives a stack's
  patterns the stack axis the kernel gets.
  """
  names = _nnx_names(kernel) if isinstance(kernel, nnx.Variable) else None
  if names is None:
    return {}
  eager = kernel.get_metadata().get("eager_sharding")
  return {"out_sharding": structure_names(names, name, ndim, blocks=blocks), **_sharding_extra(kernel),
          **({"eager_sharding": eager} if eager is not None else {})}


def box_structure(kernel_box: Any, value: Any, name: str, *, blocks: bool = False) -> Any:
  """A Linen layer's sparsity-state array ``value`` (the ``"sparsity"`` collection's ``name``) in a box of the class
  of its kernel's ``kernel_box`` (``nn.Partitioned``, ``nn.LogicallyPartitioned`` with its rules; its mesh), named by
  :func:`structure_names`; ``value`` itself where the kernel is not boxed so.

  ``nn.scan`` / ``nn.vmap`` with ``metadata_params={nn.PARTITION_NAME: "layers"}`` add the stack axis to boxes only.
  """
  if not isinstance(kernel_box, nn.Partitioned):
    return value
  return kernel_box.replace(value=value, names=structure_names(kernel_box.names, name, len(value.shape), blocks=blocks))


def _placed(value: jax.Array, names: Names, dense_value: Any, dense_names: Names) -> jax.Array:
  """``value`` put on the dense value's mesh, its dims split like the dense dims of the same name."""
  sharding = getattr(dense_value, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return value
  physical = dict(zip(dense_names, tuple(sharding.spec) + (None,) * len(dense_names), strict=False))
  spec = []
  for size, name in zip(value.shape, names, strict=True):
    axes = physical.get(name) if name is not None else None
    ways = math.prod(sharding.mesh.shape[a] for a in _utils.spec_axes(axes))
    spec.append(axes if axes is not None and size % ways == 0 else None)
  return jax.device_put(value, NamedSharding(sharding.mesh, P(*spec)))


def _placed_by_names(value: jax.Array, names: Names, source_value: Any, rules: Any) -> jax.Array:
  """``value`` put on the mesh of ``source_value`` (a replicated block-sparse value), its dims split over the mesh
  axes ``names`` give (through the variable's and the context's logical rules), those that divide them."""
  sharding = getattr(source_value, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return value
  mesh, spec = sharding.mesh, []
  for size, axes in zip(value.shape, core_spmd.apply_rules(P(*names), rules), strict=True):
    found = _utils.spec_axes(axes)
    ok = axes is not None and all(a in mesh.shape for a in found)
    ok = ok and size % math.prod(mesh.shape[a] for a in found) == 0
    spec.append(axes if ok else None)
  return jax.device_put(value, NamedSharding(mesh, P(*spec)))


def _nnx_names(var: nnx.Variable) -> Names | None:
  names = var.get_metadata().get("out_sharding")
  return tuple(names) if names else None


def carry_nnx(dense: nnx.Module, sparse: nnx.Module) -> nnx.Module:
  """Copies the partitioning metadata of ``dense``'s kernel (an ``nnx.Embed``'s table) and bias onto ``sparse``'s
  variables."""
  weight = dense.embedding if isinstance(dense, nnx.Embed) else dense.kernel
  kernel_names = _nnx_names(weight)
  if isinstance(dense, nnx.Embed) and kernel_names is not None:  # CompressedNMEmbed keeps the table transposed
    kernel_names = kernel_names[::-1]
  bias = getattr(dense, "bias", None)
  bias_names = _nnx_names(bias) if isinstance(bias, nnx.Variable) else None
  if kernel_names is None and bias_names is None:
    return sparse
  extra = _sharding_extra(weight)
  # The dense names, where the sparse ones lose them (block-sparse, folded); compress carries them on.
  dense_kernel_names = weight.get_metadata().get(DENSE_NAMES)
  dense_bias_names = bias.get_metadata().get(DENSE_NAMES) if isinstance(bias, nnx.Variable) else None
  layer = sparse
  if _layout(sparse) == FOLDED:
    dense_kernel_names, dense_bias_names = kernel_names, bias_names
  elif _layout(sparse) == BLOCKS:
    dense_kernel_names = kernel_names
  if _layout(sparse) == FOLDED:
    layer = sparse.layer
    n_in = len(sparse.in_features)
    if kernel_names is not None:
      kernel_names = _fold(kernel_names, (n_in, len(kernel_names) - n_in))
    if bias_names is not None:
      bias_names = _fold(bias_names, (len(bias_names),))
  for path, var in nnx.iter_graph(layer):
    if not isinstance(var, nnx.Variable) or not hasattr(var, "shape"):
      continue
    is_bias = bool(path) and path[-1] == "bias"
    if is_bias:
      names, source = bias_names, bias
    elif kernel_names is None:
      names, source = (None,) * var.ndim, weight
    else:
      names, source = structure_names(kernel_names, str(path[-1]), var.ndim, blocks=_layout(layer) == BLOCKS), weight
    if names is None:
      continue
    recorded = dense_bias_names if is_bias else dense_kernel_names if path and path[-1] == "kernel" else None
    var.set_metadata(out_sharding=names, **extra, **({DENSE_NAMES: recorded} if recorded is not None else {}))
    var.set_value(_placed(var[...], names, source[...], _nnx_names(source) or ()))  # a split value: a new type
  return sparse


def carry_back_nnx(sparse: nnx.Module, dense: nnx.Module) -> nnx.Module:
  """Copies the partitioning names of ``sparse``'s kernel (table) and bias onto ``dense``, its ``to_dense()``: the
  inverse of :func:`carry_nnx`.

  The names recorded by :func:`carry_nnx` (``dense_out_sharding``) where there are some; else a kernel of the dense
  kernel's shape takes its own names, a ``CompressedNMEmbed``'s transposed table its names swapped, a
  ``SparseLinearGeneral``'s ``(K, N)`` kernel and ``(N,)`` bias theirs unfolded (each on its group's leading dim).
  Block-sparse values without recorded names give none, nor does a kernel kept only as cuSPARSELt's buffer. Where
  the sparse value is placed on a mesh, the dense value is placed likewise (dims of the same name split the same way).
  """
  embed = isinstance(dense, nnx.Embed)
  folded = _layout(sparse) == FOLDED
  layer = sparse.layer if folded else sparse
  weight = layer.embedding if embed else layer.kernel
  bias = getattr(layer, "bias", None)

  def derived(var: nnx.Variable | None, kind: str) -> Names | None:
    if not isinstance(var, nnx.Variable):
      return None
    recorded = var.get_metadata().get(DENSE_NAMES)
    if recorded is not None:
      return tuple(recorded)
    names = _nnx_names(var)
    if names is None or (kind == "kernel" and _layout(layer) == BLOCKS):
      return None
    if embed:
      return names[::-1]
    if folded:
      n_in, n_out = len(sparse.in_features), len(sparse.out_features)
      groups = (n_in, n_out) if kind == "kernel" else (n_out,)
      return _unfold(names, groups) if len(names) == len(groups) else None
    return names

  targets = []
  if isinstance(weight, nnx.Variable):  # not a weight kept only as cuSPARSELt's buffer (storage="cusparselt")
    targets.append((dense.embedding if embed else dense.kernel, weight, derived(weight, "kernel")))
  if isinstance(getattr(dense, "bias", None), nnx.Variable):
    targets.append((dense.bias, bias, derived(bias, "bias")))
  for var, source, names in targets:
    if names is None or len(names) != var.ndim:
      continue
    extra = _sharding_extra(source)
    var.set_metadata(out_sharding=names, **extra)
    if not (is_concrete(var[...]) and is_concrete(source[...])):
      continue
    if source.get_metadata().get(DENSE_NAMES) is not None:  # the sparse value's split does not tell the dense one's
      var.set_value(_placed_by_names(var[...], names, source[...], extra.get("sharding_rules")))
    else:
      var.set_value(_placed(var[...], names, source[...], _nnx_names(source) or ()))
  return dense


def carry_linen(dense_params: Mapping, layer_vars: dict, *, in_ndim: int | None = None) -> dict:
  """Boxes ``layer_vars`` (``{"params": ..., "sparsity": ...}``) in ``nn.Partitioned`` like ``dense_params``.

  The boxes are of the dense kernel's class (``nn.LogicallyPartitioned`` from ``nn.with_logical_partitioning``
  stays logical, with its rules) and on its mesh.

  ``in_ndim``: for an ``nn.DenseGeneral`` whose kernel ``(*in_dims, *features)`` the sparse layer
  holds as ``(K, N)``, ``len(in_dims)``; its names are folded as ``SparseLinearGeneral``'s are.

  An ``nn.Embed``'s ``dense_params`` (``{"embedding": table}``): the compressed table, stored transposed, takes the
  table's names swapped. Packed N:M positions take only the name of the kernel's (the swapped table's) last dim.
  """
  embed = "embedding" in dense_params
  kernel, bias = dense_params["embedding" if embed else "kernel"], dense_params.get("bias")
  if not isinstance(kernel, nn.Partitioned) and not isinstance(bias, nn.Partitioned):
    return layer_vars
  kernel_names = tuple(kernel.names) if isinstance(kernel, nn.Partitioned) else None
  if embed and kernel_names is not None:  # CompressedNMEmbed keeps the table transposed
    kernel_names = kernel_names[::-1]
  bias_names = tuple(bias.names) if isinstance(bias, nn.Partitioned) else None
  if in_ndim is not None:
    if kernel_names is not None:
      kernel_names = _fold(kernel_names, (in_ndim, len(kernel_names) - in_ndim))
    if bias_names is not None:
      bias_names = _fold(bias_names, (len(bias_names),))
  # The dense box is the template: an ``nn.LogicallyPartitioned`` stays one (its names are logical, its rules kept).
  template = kernel if isinstance(kernel, nn.Partitioned) else bias
  block_sparse = "row_indices" in layer_vars.get("sparsity", {})

  def box(name: str, value):
    if name == "bias":
      return bias.replace(value=value, names=bias_names) if isinstance(bias, nn.Partitioned) else value
    if kernel_names is None:
      names = (None,) * value.ndim
    else:
      names = structure_names(kernel_names, name, value.ndim, blocks=block_sparse)
    return template.replace(value=value, names=names)

  return {col: {k: box(k, v) for k, v in tree.items()} for col, tree in layer_vars.items()}
