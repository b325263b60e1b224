"""``jaxsparse.summary``: per sparse layer its pattern, bytes and FLOPs against the dense layer it replaces.

FLOPs are those of the kernel product for one input row (one token; one output position of a
convolution), two per multiply-add, bias left out: the forward ``x @ W`` and the backward ``dX = dY @ Wᵀ``
plus ``dW = xᵀ dY``. A sparse layer needs them only for its kept weights, except the weight gradient of
the SR-STE layers (``NMLinear``, ``NMConv``), which reaches every dense weight by design. An embedding
table's lookups are no product (0 FLOPs); its ``attend`` (a tied LM head's logits ``x @ tableᵀ``) is the product of
the ``(features, num_embeddings)`` kernel, counted as a layer's when the summary sees the model call it (example
inputs: the model is traced, nothing computed). These are the arithmetic the pattern needs; how much of it a backend
turns into time is what ``jaxsparse bench`` measures.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from flax.nnx.bridge import variables as bridge_variables

from jaxsparse import _utils
from jaxsparse._summary_tables import linen_attended
from jaxsparse._summary_tables import nnx_attended
from jaxsparse._summary_tables import untraced_note
from jaxsparse.formats._base import is_concrete
from jaxsparse.layers import _nm_linen
from jaxsparse.layers._block_sparse import BlockSparseLinear
from jaxsparse.layers._common import SPARSITY
from jaxsparse.layers._common import bridged_block_pattern
from jaxsparse.layers._common import compressed_kept_count
from jaxsparse.layers._common import eager_if_concrete
from jaxsparse.layers._common import kept_fraction
from jaxsparse.layers._common import masked_kept_count
from jaxsparse.layers._common import nm_kept_count
from jaxsparse.layers._common import pattern_mask
from jaxsparse.layers._embed import CompressedNMEmbed
from jaxsparse.layers._embed_linen import CompressedNMEmbed as LinenCompressedNMEmbed
from jaxsparse.layers._linear_general import SparseLinearGeneral
from jaxsparse.layers._masked import MaskedConv
from jaxsparse.layers._masked import MaskedDense
from jaxsparse.layers._masked import MaskedLinear
from jaxsparse.layers._nm import NMConv
from jaxsparse.layers._nm import NMLinear
from jaxsparse.layers._nm_compressed import CompressedNMLinear
from jaxsparse.layers._nm_linen_compressed import CompressedNMDense
from jaxsparse.sharding._layers import TensorParallelBlockSparseLinear

__all__ = ["LayerSummary", "ModelSummary", "summary"]


@dataclasses.dataclass(frozen=True)
class LayerSummary:
  """One sparse layer in a :class:`ModelSummary`.

  Attributes:
    path: dotted path of the layer in the model (``"blocks.0.fc1"``).
    kind: class name of the layer (Linen layers found from their variables: ``"BlockSparseDense"``...);
      ``"MaskedDense or MaskedConv"`` for Linen variables alone whose masked kernel has ndim > 2 (a masked
      ``nn.Conv``'s, or a stacked ``nn.scan`` ``MaskedDense``'s): ``module=`` tells which.
    shape: shape of the dense kernel the layer stands for, ``(in, out)`` or ``(*kernel_size, cin, cout)``; an
      embedding's table, ``(num_embeddings, features)``; a stack of layers (``nnx.vmap``, ``nn.scan``) leads with
      its layer axes.
    pattern: the structure in words: ``"block 32x32"``, ``"2:4"``, ``"2:4 compressed"``, ``"unstructured"``.
    density: fraction of the kernel's weights kept; ``None`` when unknown (the mask of an abstract model); 0.0 for an
      empty (zero-size) kernel or table, whose byte and FLOP ratios read ``-``. An N:M layer's kept weights are those
      its pattern keeps that are nonzero: a group an optimizer pruned further (``pruning.wrap_optax`` at a higher
      sparsity) counts fewer than ``n``, and so do the kept values of a compressed layer or embedding stored as zeros
      (a sparser mask given to ``sparsify``), as the ``sparsify`` report counts them (an abstract kernel counts
      ``n / m``).
    bytes: bytes the layer stores: parameters and pattern (a ``TensorParallelBlockSparseLinear``'s over all its
      shards, the zero blocks that pad them to one count included).
    dense_bytes: bytes of the dense layer (kernel and bias, same dtype).
    forward_flops, backward_flops: per input row; ``None`` when the density is unknown. An embedding's are those of
      its ``attend`` product (a tied LM head) when the summary saw the model call it (example inputs), else 0 (a
      lookup, no product; :attr:`ModelSummary.notes` then says so).
    dense_forward_flops, dense_backward_flops: the same for the dense layer (an ``nnx.Embed`` / ``nn.Embed``'s
      ``attend`` for an attended table).

  >>> import jaxsparse
  >>> from flax import nnx
  >>> layer = jaxsparse.summary(jaxsparse.layers.NMLinear(8, 4, n=2, m=4, rngs=nnx.Rngs(0))).layers[0]
  >>> layer.kind, layer.shape, layer.pattern, layer.density
  ('NMLinear', (8, 4), '2:4', 0.5)
  >>> layer.forward_flops, layer.dense_forward_flops, layer.backward_flops, layer.dense_backward_flops
  (32, 64, 96, 128)
  """

  path: str
  kind: str
  shape: tuple[int, ...]
  pattern: str
  density: float | None
  bytes: int
  dense_bytes: int
  forward_flops: int | None
  backward_flops: int | None
  dense_forward_flops: int
  dense_backward_flops: int


def _ratio(a: int | None, b: int) -> str:
  return "?" if a is None else "-" if b == 0 else f"{a / b:.2f}x"


def _human(n: int | None) -> str:
  if n is None:
    return "?"
  for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
    if abs(n) >= size:
      return f"{n / size:.2f}{unit}"
  return str(n)


@dataclasses.dataclass(frozen=True)
class ModelSummary:
  """What :func:`summary` returns: one :class:`LayerSummary` per sparse layer; ``str()`` is a table.

  The properties (``bytes``, ``forward_flops``, ...) sum a field over the layers.

  >>> import jaxsparse
  >>> from flax import nnx
  >>> s = jaxsparse.summary(jaxsparse.layers.NMLinear(8, 4, n=2, m=4, rngs=nnx.Rngs(0)))
  >>> len(s.layers), s.forward_flops, s.dense_forward_flops, s.total("bytes") == s.bytes
  (1, 32, 64, True)
  >>> print(s)
  path     layer     shape  pattern  density  bytes (vs dense)  fwd FLOPs   bwd FLOPs
  (model)  NMLinear  8x4    2:4      0.500    144 (1.00x)       32 (0.50x)  96 (0.75x)
  total    1 layers                           144 (1.00x)       32 (0.50x)  96 (0.75x)
  FLOPs per input row (per output position for convolutions), bias excluded.

  Attributes:
    layers: a :class:`LayerSummary` per sparse layer of the model.
    notes: what the summary could not look into, and how to: an ``nnx.bridge.ToNNX`` around a Linen module (other
      than a ``SparsifiedLinen``), whose N:M layers only running it finds; the kernels of Linen variables summarized
      without ``module=``, which may be N:M layers (``NMDense`` / ``NMConv``, an NNX ``NMLinear`` / ``NMConv`` under
      ``nnx.bridge.ToLinen``: no pattern variable); the embedding tables whose ``attend`` (a tied LM head) was not
      looked for (no example inputs: their FLOPs are the lookups' 0). ``str()`` prints them below the table.
  """

  layers: tuple[LayerSummary, ...]
  notes: tuple[str, ...] = ()

  def total(self, field: str) -> int | None:
    """The sum of a :class:`LayerSummary` field over the layers; ``None`` if a layer's value is unknown.

    Args:
      field: the name of a numeric field of :class:`LayerSummary` (``"bytes"``, ``"forward_flops"``...).

    Returns:
      The sum as an ``int`` (0 without layers), or ``None`` if some layer's value is ``None``.

    Raises:
      AttributeError: ``field`` is not a field of :class:`LayerSummary`.

    >>> import jaxsparse
    >>> from flax import nnx
    >>> s = jaxsparse.summary(jaxsparse.layers.NMLinear(8, 4, n=2, m=4, rngs=nnx.Rngs(0)))
    >>> s.total("forward_flops"), s.total("dense_forward_flops")
    (32, 64)
    """
    values = [getattr(layer, field) for layer in self.layers]
    return None if any(v is None for v in values) else int(sum(values))

  bytes = property(lambda self: self.total("bytes"), doc="Bytes the sparse layers store.")
  dense_bytes = property(lambda self: self.total("dense_bytes"), doc="Bytes of the dense layers they replace.")
  forward_flops = property(lambda self: self.total("forward_flops"), doc="Forward FLOPs per input row.")
  backward_flops = property(lambda self: self.total("backward_flops"), doc="Backward FLOPs per input row.")
  dense_forward_flops = property(lambda self: self.total("dense_forward_flops"), doc="Dense forward FLOPs.")
  dense_backward_flops = property(lambda self: self.total("dense_backward_flops"), doc="Dense backward FLOPs.")

  def __str__(self) -> str:
    notes = "".join(f"\nnote: {note}" for note in self.notes)
    if not self.layers:
      return "no sparse layers" + (" found" if notes else "") + notes

    def cell(value: int | None, dense: int) -> str:
      return f"{_human(value)} ({_ratio(value, dense)})"

    rows = [("path", "layer", "shape", "pattern", "density", "bytes (vs dense)", "fwd FLOPs", "bwd FLOPs")]
    for s in self.layers:
      rows.append((
          s.path or "(model)", s.kind, "x".join(map(str, s.shape)), s.pattern,
          "?" if s.density is None else f"{s.density:.3f}", cell(s.bytes, s.dense_bytes),
          cell(s.forward_flops, s.dense_forward_flops), cell(s.backward_flops, s.dense_backward_flops),
      ))
    rows.append((
        "total", f"{len(self.layers)} layers", "", "", "", cell(self.bytes, self.dense_bytes),
        cell(self.forward_flops, self.dense_forward_flops), cell(self.backward_flops, self.dense_backward_flops),
    ))
    return (_utils.text_table(rows) + "\nFLOPs per input row (per output position for convolutions), bias excluded."
            + notes)


def _bytes(tree: Any) -> int:
  return int(sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in jax.tree.leaves(tree)))


def _layer(
    path: str,
    kind: str,
    shape: tuple[int, ...],
    pattern: str,
    kept: int | None,
    *,
    stored: Any,
    param_dtype: Any,
    bias_size: int,
    dense_weight_grad: bool = False,
) -> LayerSummary:
  """``kept`` weights of a ``shape`` kernel; ``dense_weight_grad`` for SR-STE, whose weight gradient is dense."""
  size = math.prod(shape)
  itemsize = np.dtype(param_dtype).itemsize
  forward = None if kept is None else 2 * kept
  backward = None if kept is None else 2 * kept + 2 * (size if dense_weight_grad else kept)
  return LayerSummary(
      path=path,
      kind=kind,
      shape=tuple(int(d) for d in shape),
      pattern=pattern,
      density=kept_fraction(kept, size),  # 0.0 for an empty kernel or table (its ratios read "-")
      bytes=_bytes(stored),
      dense_bytes=(size + bias_size) * itemsize,
      forward_flops=forward,
      backward_flops=backward,
      dense_forward_flops=2 * size,
      dense_backward_flops=4 * size,
  )


def _table(row: LayerSummary, attended: bool | None) -> LayerSummary:
  """An embedding table's row from :func:`_layer` on its ``attend`` kernel ``(features, num_embeddings)``: its FLOPs
  are that product's where the model calls ``attend`` (a tied LM head), as a compressed layer's (the backward's
  weight gradient at the kept values); a lookup is no product (0, its dense ``nnx.Embed`` / ``nn.Embed``'s too)."""
  if attended:
    return row
  return dataclasses.replace(row, forward_flops=0, backward_flops=0, dense_forward_flops=0, dense_backward_flops=0)


def _nnx_layer(path: str, node: nnx.Module, *, attended: bool | None = None) -> LayerSummary | None:
  """The row of a sparse NNX layer (``None`` for another module); ``attended``: whether the model calls a table's
  ``attend`` (``None``: not looked for)."""
  kind = type(node).__name__
  bias = 0 if getattr(node, "bias", None) is None else math.prod(node.bias.shape)
  common = dict(stored=nnx.state(node), bias_size=bias)
  if isinstance(node, BlockSparseLinear):
    bk, bn = node.block_shape
    stack = tuple(node.kernel.shape[:-3])  # a stack of layers (nnx.vmap): kernel (*layers, nnz_blocks, bk, bn)
    return _layer(path, kind, (*stack, node.in_features, node.out_features), f"block {bk}x{bn}",
                  math.prod(node.kernel.shape), param_dtype=node.kernel.dtype, **common)
  if isinstance(node, TensorParallelBlockSparseLinear):
    # Its kernel (shards, blocks_per_shard, bk, bn) pads the shards to one block count with zero blocks: stored (its
    # bytes), but not of the pattern (its density and FLOPs are those of the unsplit layer's nnz_blocks).
    bk, bn = node.block_shape
    return _layer(path, kind, (node.in_features, node.out_features), f"block {bk}x{bn}", node.nnz_blocks * bk * bn,
                  param_dtype=node.kernel.dtype, **common)
  if isinstance(node, MaskedLinear | MaskedConv):
    return _layer(path, kind, tuple(node.kernel.shape), "unstructured", masked_kept_count(node.mask.get_value()),
                  param_dtype=node.kernel.dtype, **common)
  if isinstance(node, NMLinear | NMConv):
    shape = tuple(node.kernel.shape)
    pattern = f"{node.n}:{node.m}" + (" transposable" if node.transposable else "")
    # The nonzero weights the pattern keeps: a group pruned further (by an optimizer, a conv's own weight mask) keeps
    # fewer than n.
    kept = nm_kept_count(node.kernel.get_value(), node.n, node.m, transposable=node.transposable,
                         weight_mask=node.mask if isinstance(node, NMConv) else None)
    return _layer(path, kind, shape, pattern, kept, param_dtype=node.kernel.dtype, dense_weight_grad=True, **common)
  if isinstance(node, CompressedNMEmbed):
    stack = tuple(node.embedding.shape[:-2])  # a stack of tables (nnx.vmap): values (*layers, features * n // m, V)
    shape = (*stack, node.num_embeddings, node.features)
    # Its nonzero kept values, as sparsify's report counts the table (nm_table_density): a sparser mask stores zeros.
    kept = compressed_kept_count(node.embedding.get_value())
    table = _layer(path, kind, shape, f"{node.n}:{node.m} compressed", kept, param_dtype=node.embedding.dtype, **common)
    return _table(table, attended)
  if isinstance(node, CompressedNMLinear):
    stack = () if node.kernel is None else tuple(node.kernel.shape[:-2])  # a stack of layers (nnx.vmap)
    shape = (*stack, node.in_features, node.out_features)
    # Its nonzero kept values, as its LayerSignature counts them; storage="cusparselt" keeps none to count: n of m.
    kept = (math.prod(shape) * node.n // node.m if node.kernel is None
            else compressed_kept_count(node.kernel.get_value()))
    return _layer(path, kind, shape, f"{node.n}:{node.m} compressed", kept, param_dtype=node.kernel_dtype, **common)
  return None


def _path(parts: Sequence[Any]) -> str:
  return ".".join(str(p) for p in parts)


# An N:M Linen layer as the summary needs it: (layer name, n, m, transposable, a conv's own Flax weight mask or None).
_NMInfo = tuple[str, int, int, bool, Any]


def _is_sparsified_linen(module: Any) -> bool:
  from jaxsparse._sparsify._linen import SparsifiedLinen  # noqa: PLC0415 -- _sparsify imports this module's peers

  return isinstance(module, SparsifiedLinen)


def _linen_module_layers(
    module: Any, variables: Mapping, inputs: Sequence[Any]
) -> tuple[dict[tuple[str, ...], _NMInfo], dict[tuple[str, ...], str], set[tuple[str, ...]] | None]:
  """The N:M Linen layers of ``module`` by scope path (their variables alone look like ``nn.Dense``'s), the kind
  (``"MaskedDense"`` / ``"MaskedConv"``) of the layers that may hold a mask (a stacked, ``nn.scan``, ``MaskedDense``'s
  kernel looks like a conv's), and the scope paths of the embedding tables whose ``attend`` the model calls (``None``
  when not looked for: a ``SparsifiedLinen`` without ``inputs``).

  For a :func:`jaxsparse.sparsify_linen` model they are the layers its plan maps to an ``NM`` or ``Unstructured`` rule;
  with ``inputs`` its ``apply`` is traced for the ``attend`` calls alone.
  """
  from jaxsparse._sparsify._linen_plan import sparse_layer_name  # noqa: PLC0415 -- as _is_sparsified_linen
  from jaxsparse.formats._specs import NM  # noqa: PLC0415
  from jaxsparse.formats._specs import Unstructured  # noqa: PLC0415

  if _is_sparsified_linen(module):
    names = {"conv": "NMConv", "dense": "NMDense", "general": "NMDense", "embed": "CompressedNMEmbed"}
    nm_layers = {
        tuple(str(p) for p in path): ("CompressedNMDense" if plan.compressed and plan.kind != "embed"
                                      else names[plan.kind], plan.spec.n, plan.spec.m, plan.spec.transposable,
                                      getattr(plan.module, "mask", None) if plan.kind == "conv" else None)
        for path, plan in module.layers.items() if isinstance(plan.spec, NM)
    }
    masked = {tuple(str(p) for p in path): sparse_layer_name(plan)
              for path, plan in module.layers.items() if isinstance(plan.spec, Unstructured)}
    return nm_layers, masked, (linen_attended(module, variables, inputs) if inputs else None)
  found: dict[tuple[str, ...], _NMInfo] = {}
  masked: dict[tuple[str, ...], str] = {}

  def record(next_fun, args, kwargs, context):
    m = context.module
    nm = isinstance(m, _nm_linen.NMDense | _nm_linen.NMConv | CompressedNMDense) and context.method_name == "__call__"
    embed = isinstance(m, LinenCompressedNMEmbed) and context.method_name in ("__call__", "attend")
    if nm or embed:
      found[tuple(m.scope.path)] = (type(m).__name__, m.n, m.m, getattr(m, "transposable", False),
                                    getattr(m, "mask", None))
    elif (isinstance(m, nnx.bridge.ToLinen) and context.method_name == "__call__" and isinstance(m.nnx_class, type)
          and issubclass(m.nnx_class, NMLinear | NMConv)):  # an NNX N:M layer: its variables are nn.Dense's too
      found[tuple(m.scope.path)] = _bridged_nm(m)
    elif isinstance(m, MaskedDense | nn.Conv) and context.method_name == "__call__":  # nn.Conv: given its mask
      masked[tuple(m.scope.path)] = "MaskedDense" if isinstance(m, MaskedDense) else "MaskedConv"
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    attended = linen_attended(module, variables, inputs)
  return found, masked, attended


def _bridged_nm(module: nnx.bridge.ToLinen) -> _NMInfo:
  """The N:M structure of the ``NMLinear`` / ``NMConv`` an ``nnx.bridge.ToLinen`` builds: its arguments, with the
  defaults of its constructor."""
  cls = module.nnx_class
  bound = inspect.signature(cls.__init__).bind_partial(None, *module.args, **module.kwargs)
  bound.apply_defaults()
  arg = bound.arguments
  return cls.__name__, arg["n"], arg["m"], arg["transposable"], arg.get("mask") if issubclass(cls, NMConv) else None


def _to_nnx_layers(path: str, node: nnx.bridge.ToNNX, attended: set[tuple[str, ...]] | None,
                   untraced: list[str]) -> tuple[list[LayerSummary], str | None]:
  """The sparse layers of the Linen module in an ``nnx.bridge.ToNNX`` at ``path``: a ``SparsifiedLinen``'s, found from
  its plan (``attended``: the Linen paths of the tables whose ``attend`` the model calls, ``None`` when not looked for;
  those tables' paths then go to ``untraced``); for another Linen module none, and a note why (only running it on
  example inputs finds its N:M layers, whose variables are ``nn.Dense``'s) and how to summarize it."""
  module = node.to_nnx__module
  if _is_sparsified_linen(module):
    variables = bridge_variables.nnx_attrs_to_linen_vars(dict(nnx.state(node, nnx.Not(nnx.RngState))))
    variables = nn.meta.unbox(variables)
    nm, masked, _ = _linen_module_layers(module, variables, ())
    tables: list[str] = []
    rows = _linen_layers(variables, nm, masked, attended, untraced=tables)
    untraced.extend(_path(p for p in (path, t) if p) for t in tables)
    return [dataclasses.replace(row, path=_path(p for p in (path, row.path) if p)) for row in rows], None
  return [], (
      f"{path or '(model)'} is an nnx.bridge.ToNNX of the Linen {type(module).__name__}, whose layers are not "
      "summarized here (its N:M layers keep no pattern variable: only running it finds them). Summarize its Linen "
      "variables: jaxsparse.summary(nnx.bridge.variables.nnx_attrs_to_linen_vars(dict(nnx.state(bridged, "
      "nnx.Not(nnx.RngState)))), *example_inputs, module=bridged.to_nnx__module)."
  )


# The kind of a masked Linen layer that its variables alone cannot tell: a kernel of ndim > 2 is a masked nn.Conv's or a
# stacked (nn.scan over layers) MaskedDense's.
_MASKED_UNKNOWN = "MaskedDense or MaskedConv"


def _linen_layers(
    variables: Mapping, nm_layers: Mapping[tuple[str, ...], _NMInfo], masked: Mapping[tuple[str, ...], str],
    attended: set[tuple[str, ...]] | None = None, *, unknown: list[str] | None = None,
    untraced: list[str] | None = None,
) -> list[LayerSummary]:
  """The sparse layers of Linen variables; the paths of the other kernels go to ``unknown``. ``attended``: the paths
  of the tables whose ``attend`` the model calls (``None``: not looked for; those tables' paths go to ``untraced``)."""
  out = []
  sparsity = variables.get(SPARSITY, {})

  def walk(params: Mapping, prefix: tuple[str, ...]):
    if "kernel" in params and not isinstance(params["kernel"], Mapping):
      kernel = params["kernel"]
      bias = math.prod(params["bias"].shape) if "bias" in params else 0
      pattern = sparsity
      for part in prefix:
        pattern = pattern.get(part, {}) if isinstance(pattern, Mapping) else {}
      stored = {"params": params, SPARSITY: pattern}
      common = dict(stored=stored, param_dtype=kernel.dtype, bias_size=bias)
      path = _path(prefix)
      # An NNX BlockSparseLinear under nnx.bridge.ToLinen keeps its index arrays in its "pattern" dict, one level down.
      index = pattern if "row_indices" in pattern else bridged_block_pattern(pattern, params)
      if index is not None:
        # A stack of layers (nn.scan / nn.vmap) has leading layer axes: kernel (*layers, nnz_blocks, bk, bn), offsets
        # (*layers, K // bk + 1).
        kb, nb = index["row_offsets"].shape[-1] - 1, index["col_offsets"].shape[-1] - 1
        *stack, _, bk, bn = kernel.shape
        name = "BlockSparseDense" if index is pattern else "BlockSparseLinear"
        out.append(_layer(path, name, (*stack, kb * bk, nb * bn), f"block {bk}x{bn}", math.prod(kernel.shape),
                          **common))
      elif "mask" in pattern:
        # Without module=, a kernel of ndim > 2 is a masked nn.Conv's (sparsify_linen, convert) or a stacked MaskedDense
        name = masked.get(prefix) or ("MaskedDense" if len(kernel.shape) == 2 else _MASKED_UNKNOWN)
        out.append(_layer(path, name, tuple(kernel.shape), "unstructured", _linen_kept(path, pattern, kernel),
                          **common))
      elif "kernel_positions" in pattern:  # a CompressedNMDense: its n:m is not in its variables
        if prefix not in nm_layers:
          raise ValueError(
              f"{path or '(the variables)'} holds a compressed N:M kernel (sparsity 'kernel_positions') whose n:m "
              "only its module knows: pass module= (the SparsifiedLinen that jaxsparse.compress_linen returned, or "
              "the Linen module and its example inputs)."
          )
        name, n, m, _, _ = nm_layers[prefix]
        *stack, kept_rows, features = kernel.shape  # a stack of layers (nn.scan / nn.vmap) has leading layer axes
        shape = (*stack, kept_rows * m // n, features)
        out.append(_layer(path, name, shape, f"{n}:{m} compressed", compressed_kept_count(kernel), **common))
      elif prefix in nm_layers:
        name, n, m, transposable, own = nm_layers[prefix]
        shape = tuple(kernel.shape)
        nm = f"{n}:{m}" + (" transposable" if transposable else "")
        kept = nm_kept_count(kernel, n, m, transposable=transposable, weight_mask=own)  # as in NNX
        out.append(_layer(path, name, shape, nm, kept, dense_weight_grad=True, **common))
      elif unknown is not None:
        unknown.append(path or "(the variables)")
    elif "embedding" in params and not isinstance(params["embedding"], Mapping):
      pattern = sparsity
      for part in prefix:
        pattern = pattern.get(part, {}) if isinstance(pattern, Mapping) else {}
      if "embedding_positions" in pattern:  # a Linen CompressedNMEmbed: its n:m is not in its variables
        out.append(_linen_embed(_path(prefix), params, pattern, nm_layers.get(prefix),
                                attended=None if attended is None else prefix in attended))
        if attended is None and untraced is not None:
          untraced.append(_path(prefix))
    for key, value in params.items():
      if isinstance(value, Mapping):
        walk(value, (*prefix, str(key)))

  walk(variables.get("params", {}), ())
  return out


def _linen_kept(path: str, pattern: Mapping, kernel: Any) -> int | None:
  """The weights a masked Linen layer keeps: its ``"sparsity"`` mask's count, checked as its forward pass checks it
  (bool, the kernel's shape: a mask of 0.5 or 2 runs nowhere); ``None`` for an abstract mask."""
  if not is_concrete(pattern["mask"]):
    return None
  with eager_if_concrete(pattern["mask"]):  # a NumPy mask stays concrete (counted) under a trace
    return masked_kept_count(pattern_mask(pattern["mask"], tuple(kernel.shape), path=path))


def _linen_embed(path: str, params: Mapping, pattern: Mapping, info: _NMInfo | None, *,
                 attended: bool | None) -> LayerSummary:
  """The row of a Linen ``CompressedNMEmbed``: its kept values ``(*layers, features * n // m, num_embeddings)``, its
  table ``(*layers, num_embeddings, features)`` (``layers``: the leading axes of a stack); FLOPs as :func:`_table`."""
  if info is None:
    raise ValueError(
        f"{path or '(the variables)'} holds a compressed N:M embedding (sparsity 'embedding_positions') whose n:m only "
        "its module knows: pass module= (the SparsifiedLinen that jaxsparse.sparsify_linen returned, or the Linen "
        "module and its example inputs)."
    )
  name, n, m, _, _ = info
  values = params["embedding"]
  *stack, kept_rows, num_embeddings = values.shape  # a stack of tables (nn.scan / nn.vmap) has leading layer axes
  shape = (*stack, num_embeddings, kept_rows * m // n)
  table = _layer(path, name, shape, f"{n}:{m} compressed", compressed_kept_count(values),  # as NNX
                 stored={"params": params, SPARSITY: pattern}, param_dtype=values.dtype, bias_size=0)
  return _table(table, attended)


def summary(model: nnx.Module | Mapping, /, *example_inputs: Any, module: nn.Module | None = None) -> ModelSummary:
  """Per sparse layer: path, kind, kernel shape, pattern, density, bytes and FLOPs against the dense layer.

  Works on concrete and abstract (``nnx.eval_shape``, ``jax.eval_shape``) models; an abstract masked
  layer's density is unknown (``?``) since its mask has no values yet.

  Bridged layers: an ``nnx.bridge.ToNNX`` around the ``SparsifiedLinen`` of :func:`jaxsparse.sparsify_linen` is
  summarized from its plan (paths ``"<its path>.<Linen path>"``); one around another Linen module is not (its N:M
  layers are found only by running it): a ``UserWarning`` and a note of the result (:attr:`ModelSummary.notes`) say
  so, and how to summarize its Linen variables. In Linen variables, an NNX ``BlockSparseLinear`` or ``MaskedLinear``
  under ``nnx.bridge.ToLinen`` is found from its ``"sparsity"`` variables, an ``NMLinear`` / ``NMConv`` with
  ``module=`` (as ``NMDense``); without ``module=``, a note lists the kernels not checked for N:M.

  Embedding tables (``CompressedNMEmbed``): a lookup is no product, but a tied LM head's ``attend`` is; which tables
  the model ``attend``-s only running it tells. With example inputs the summary traces the model (``model(*inputs)``,
  or ``module.apply``; nothing computed) and counts each attended table's ``attend`` product against the dense
  ``nnx.Embed`` / ``nn.Embed``'s; without them a table's FLOPs are 0 and a note says that its ``attend`` was not
  looked for.

  >>> import jax.numpy as jnp, jaxsparse
  >>> from flax import nnx
  >>> model = nnx.Sequential(
  ...     jaxsparse.layers.BlockSparseLinear(256, 512, density=0.25, block_shape=(32, 32), rngs=nnx.Rngs(0)),
  ...     jaxsparse.layers.NMLinear(512, 256, n=2, m=4, rngs=nnx.Rngs(0)))
  >>> s = jaxsparse.summary(model)
  >>> [(layer.path, layer.pattern, layer.forward_flops, layer.dense_forward_flops) for layer in s.layers]
  [('layers.0', 'block 32x32', 65536, 262144), ('layers.1', '2:4', 131072, 262144)]
  >>> print(s)
  path      layer              shape    pattern      density  bytes (vs dense)  fwd FLOPs        bwd FLOPs
  layers.0  BlockSparseLinear  256x512  block 32x32  0.250    133.61K (0.25x)   65.54K (0.25x)   131.07K (0.25x)
  layers.1  NMLinear           512x256  2:4          0.500    525.31K (1.00x)   131.07K (0.50x)  393.22K (0.75x)
  total     2 layers                                          658.92K (0.63x)   196.61K (0.38x)  524.29K (0.50x)
  FLOPs per input row (per output position for convolutions), bias excluded.

  Args:
    model: a Flax NNX module, or Linen variables (``{"params": ..., "sparsity": ...}``).
    *example_inputs: the inputs of ``model(*example_inputs)`` (NNX) or, with Linen variables and ``module``, of
      ``module.apply`` (arrays or ``jax.ShapeDtypeStruct``; only traced); optional for an NNX model and a
      ``SparsifiedLinen``, where they are only needed to count the ``attend`` of embedding tables.
    module: the Linen module of ``model``'s variables, or the ``SparsifiedLinen`` that
      :func:`jaxsparse.sparsify_linen` (or :func:`jaxsparse.compress_linen`) returned. Needed to find ``NMDense`` /
      ``NMConv``, whose variables are those of ``nn.Dense`` / ``nn.Conv``, and the ``n:m`` of a
      ``CompressedNMDense`` or ``CompressedNMEmbed``; block-sparse and masked Linen layers are found from the
      ``"sparsity"`` collection alone, but only ``module`` tells a masked ``nn.Conv`` from a stacked (``nn.scan``)
      ``MaskedDense`` (without it their kind is ``"MaskedDense or MaskedConv"``).

  Returns:
    A :class:`ModelSummary`; ``str()`` of it is a table with totals, then its notes.

  Raises:
    TypeError: ``model`` is neither, ``module`` comes with an NNX model, Linen example inputs without ``module``,
      or a ``module`` (other than a ``SparsifiedLinen``) without example inputs; a Linen ``"sparsity"``
      mask that is not boolean (naming the layer; its forward pass refuses it too).
    ValueError: Linen variables holding a ``CompressedNMDense``'s or ``CompressedNMEmbed``'s, without a ``module``
      that says its ``n:m``; a ``"sparsity"`` mask not of its kernel's shape (naming the layer).
  """
  if isinstance(model, nnx.Module):
    if module is not None:
      raise TypeError("module= is for Linen variables; an NNX model needs none (its example inputs, to count the "
                      "attend of its embedding tables, come positionally: jaxsparse.summary(model, *inputs)).")
    layers, notes, untraced = [], [], []
    modules = list(nnx.iter_modules(model))
    # The tables (and SparsifiedLinen bridges) whose attend calls only tracing the model on its inputs finds.
    watched = [tuple(path) for path, node in modules if isinstance(node, CompressedNMEmbed)
               or (isinstance(node, nnx.bridge.ToNNX) and _is_sparsified_linen(node.to_nnx__module))]
    attended, bridged_attended = nnx_attended(model, watched, example_inputs) if example_inputs else (None, {})
    # A SparseLinearGeneral is its 2-D layer, reported under the SparseLinearGeneral's own path (the layer the
    # model, sparsify, pruning masks and torch names know).
    general = {tuple(path) for path, node in modules if isinstance(node, SparseLinearGeneral)}
    for path, node in modules:
      path = tuple(path)
      if path[:-1] in general and path[-1:] == ("layer",):
        path = path[:-1]
      if isinstance(node, nnx.bridge.ToNNX):
        linen = None if attended is None else bridged_attended.get(path, set())
        bridged, note = _to_nnx_layers(_path(path), node, linen, untraced)
        layers.extend(bridged)
        if note is not None:
          warnings.warn(note, UserWarning, stacklevel=2)
          notes.append(note)
        continue
      layer = _nnx_layer(_path(path), node, attended=None if attended is None else path in attended)
      if layer is not None:
        layers.append(layer)
      if attended is None and isinstance(node, CompressedNMEmbed):
        untraced.append(_path(path))
    return ModelSummary(tuple(layers), (*notes, *untraced_note(untraced, "jaxsparse.summary(model, *inputs)")))
  if isinstance(model, Mapping):
    if module is None and example_inputs:
      raise TypeError("example inputs are for module.apply: pass module= (the Linen module of the variables) too, or "
                      "no inputs (N:M Linen layers are then not found).")
    if module is not None and not example_inputs and not _is_sparsified_linen(module):
      raise TypeError(f"module={type(module).__name__} needs the example inputs of its apply (arrays or "
                      "jax.ShapeDtypeStruct), to find its NMDense / NMConv layers.")
    model = nn.meta.unbox(model)  # nn.with_partitioning boxes, as sparsify_linen carries them over
    nm, masked, attended = ({}, {}, None) if module is None else _linen_module_layers(module, model, example_inputs)
    unknown: list[str] = []
    untraced: list[str] = []
    layers = tuple(_linen_layers(model, nm, masked, attended, unknown=unknown if module is None else None,
                                 untraced=untraced))
    notes = () if not unknown else (
        f"{len(unknown)} kernel(s) with no pattern variable were not checked for N:M ({', '.join(unknown[:4])}"
        f"{', ...' if len(unknown) > 4 else ''}): NMDense / NMConv and an NNX NMLinear / NMConv under "
        "nnx.bridge.ToLinen keep none; pass module= (and example inputs) to find them.",)
    how = "jaxsparse.summary(variables, *inputs, module=...)"
    return ModelSummary(layers, (*notes, *untraced_note(untraced, how)))
  raise TypeError(f"model must be a flax.nnx.Module or Linen variables (a dict), got {type(model).__name__}.")
