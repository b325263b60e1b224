"""``sparsify``: turn the dense layers of an existing Flax model into sparse ones (back: ``_nnx_convert.densify``).

NNX: every ``nnx.Linear``, ``nnx.Conv`` and ``nnx.LinearGeneral`` (trailing contracting axes, as in
``nnx.MultiHeadAttention``) whose dotted path matches a rule is replaced by the sparse layer the
rule names, initialised from its dense weights by magnitude (or from given masks):

============================  ===========================  ======================  ==========================
rule                          ``nnx.Linear``               ``nnx.Conv``            ``nnx.LinearGeneral``
============================  ===========================  ======================  ==========================
``BlockSparse(density, bs)``  ``BlockSparseLinear``        error                   ``SparseLinearGeneral``
``NM(n, m)``                  ``NMLinear`` (SR-STE)        ``NMConv`` (SR-STE)     ``SparseLinearGeneral``
``Unstructured(sparsity)``    ``MaskedLinear``             ``MaskedConv``          ``SparseLinearGeneral``
============================  ===========================  ======================  ==========================

A stack of ``nnx.Linear`` layers (built by ``nnx.vmap``, run by ``nnx.scan``: kernel ``(*layers, K, N)``) becomes the
stack of its layers' sparse layers (``_stacks.py``).

An ``nnx.Embed`` takes a rule only when the rule names it (matches no layer above): ``NM(n, m)`` stores its table as a
``CompressedNMEmbed`` (``n`` of every ``m`` features of each row kept); other structures raise. Catch-all rules leave
embeddings dense.
"""


from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsparse import _utils
from jaxsparse._rules import Probe
from jaxsparse._rules import check_distinct_tree_paths
from jaxsparse._rules import embedding_rule
from jaxsparse._rules import embeddings_kept_dense
from jaxsparse._rules import linear_general_unsupported
from jaxsparse._rules import match_rules
from jaxsparse._rules import module_paths
from jaxsparse._rules import path_str
from jaxsparse._rules import replace_module
from jaxsparse._rules import resolve_rules
from jaxsparse._rules import walk_graph
from jaxsparse._rules import warn_unmatched
from jaxsparse._sparsify._masks import block_mask_of
from jaxsparse._sparsify._masks import check_general_mask_view
from jaxsparse._sparsify._masks import check_masks_used
from jaxsparse._sparsify._masks import check_nm_mask
from jaxsparse._sparsify._masks import mask_density_note
from jaxsparse._sparsify._masks import masks_dict
from jaxsparse._sparsify._masks import nm_density
from jaxsparse._sparsify._masks import nm_table_density
from jaxsparse._sparsify._masks import warn_mask_densities
from jaxsparse._sparsify._nnx_convert import SPARSE_NNX
from jaxsparse._sparsify._nnx_convert import bridged_linen
from jaxsparse._sparsify._nnx_convert import holds_dense_layers
from jaxsparse._sparsify._nnx_convert import is_abstract
from jaxsparse._sparsify._report import LayerChange
from jaxsparse._sparsify._report import SparsifyReport
from jaxsparse._sparsify._report import check_speed_mode
from jaxsparse._sparsify._report import random_input
from jaxsparse._sparsify._report import state_bytes
from jaxsparse._sparsify._report import time_nnx_layer
from jaxsparse._sparsify._report import unsupported_change
from jaxsparse._sparsify._stacks import linear_stack
from jaxsparse._sparsify._stacks import sparse_stack
from jaxsparse._sparsify._stacks import stack_error
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._masks import replicated
from jaxsparse.formats._specs import NM
from jaxsparse.formats._specs import BlockSparse
from jaxsparse.formats._specs import Spec
from jaxsparse.formats._specs import Unstructured
from jaxsparse.formats._specs import check_spec_applies
from jaxsparse.formats._specs import matrix_shape
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import CompressedNMEmbed
from jaxsparse.layers import MaskedConv
from jaxsparse.layers import MaskedLinear
from jaxsparse.layers import NMConv
from jaxsparse.layers import NMLinear
from jaxsparse.layers import SparseLinearGeneral
from jaxsparse.layers._common import copy_bias
from jaxsparse.layers._common import custom_options
from jaxsparse.layers._common import eager_if_concrete
from jaxsparse.layers._partitioning import carry_nnx

__all__ = ["at_path", "sparsify"]


def _general_as_linear(layer: nnx.LinearGeneral, path: str) -> nnx.Linear:
  reason = linear_general_unsupported(layer)
  if reason:
    raise ValueError(f"{path}: {reason}.")
  k, n = matrix_shape(layer.kernel.shape, len(layer.in_features))
  # Weights split over explicit mesh axes are gathered to be folded (explicit axes refuse most reshapes of a split
  # dim); carry_nnx splits the sparse layer's by the folded names.
  bias = None if layer.bias is None else replicated(layer.bias[...]).reshape(n)
  kernel = layer.kernel[...]
  with eager_if_concrete(kernel):  # concrete weights stay so under a trace (nnx.eval_shape): masks from them counted
    kernel = replicated(kernel).reshape(k, n)
  return _linear(kernel, bias, dtype=layer.dtype, precision=layer.precision)


def _linear(kernel: jax.Array, bias: jax.Array | None, *, dtype: Any, precision: Any) -> nnx.Linear:
  lin = nnx.Linear(
      kernel.shape[0], kernel.shape[1], use_bias=bias is not None, dtype=dtype, param_dtype=kernel.dtype,
      precision=precision, kernel_init=lambda *_: kernel, rngs=nnx.Rngs(0),
  )
  if bias is not None:
    copy_bias(lin, bias)
  return lin


def _sparse_linear(lin: nnx.Linear, spec: Spec, mask: np.ndarray | None, path: str) -> nnx.Module:
  """The sparse layer of ``lin``, with its partitioning names and placement: ``from_dense`` carries them, and so does
  this function where a given ``mask`` builds the layer another way."""
  kernel = lin.kernel[...]
  if isinstance(spec, BlockSparse):
    if mask is None:
      return BlockSparseLinear.from_dense(lin, density=spec.density, block_shape=spec.block_shape)
    block_mask = block_mask_of(mask, spec.block_shape, path)
    layer = BlockSparseLinear(
        lin.in_features, lin.out_features, block_shape=spec.block_shape, block_mask=block_mask,
        use_bias=lin.bias is not None, dtype=lin.dtype, param_dtype=kernel.dtype,
        kernel_init=nnx.initializers.zeros_init(), precision=lin.precision, rngs=nnx.Rngs(0),
    )
    layer.kernel[...] = BlockSparseMatrix.from_dense(kernel, spec.block_shape, block_mask=block_mask).data
    if lin.bias is not None:
      copy_bias(layer, lin.bias[...])
    return carry_nnx(lin, layer)
  if isinstance(spec, NM):
    if mask is None:
      return NMLinear.from_dense(lin, n=spec.n, m=spec.m, transposable=spec.transposable)
    check_nm_mask(mask, spec, 0, path)
    # The N:M pattern follows the weights: zero the pruned ones so it is the given mask. That linear has no names.
    pruned = _linear(jnp.where(mask, kernel, jnp.zeros((), kernel.dtype)), None if lin.bias is None else lin.bias[...],
                     dtype=lin.dtype, precision=lin.precision)
    return carry_nnx(lin, NMLinear.from_dense(pruned, n=spec.n, m=spec.m, transposable=spec.transposable))
  if mask is None:
    return MaskedLinear.from_dense(lin, sparsity=spec.sparsity)
  layer = MaskedLinear(
      lin.in_features, lin.out_features, mask=mask, use_bias=lin.bias is not None, dtype=lin.dtype,
      param_dtype=kernel.dtype, kernel_init=lambda *_: kernel, precision=lin.precision, rngs=nnx.Rngs(0),
  )
  if lin.bias is not None:
    copy_bias(layer, lin.bias[...])
  return carry_nnx(lin, layer)


def _check_rebuildable(node: nnx.Module, spec: Spec, path: str) -> None:
  """Raises where the sparse layer for ``node`` would compute another function: a subclass of the Flax layer (its
  call may add to the product), product options the sparse layer cannot honour, a kernel whose shape is not its
  features' (a stack of ``nnx.Conv`` / ``nnx.LinearGeneral`` layers, layer axes that do not lead); a stack of
  ``nnx.Linear`` layers passes."""
  base = next(t for t in (nnx.Conv, nnx.LinearGeneral, nnx.Linear) if isinstance(node, t))
  if type(node) is not base:
    raise TypeError(
        f"{path}: {type(node).__name__} is a subclass of nnx.{base.__name__}; sparsify rebuilds a layer from its "
        "kernel and bias and would drop what the subclass adds (an adapter, another call). Map this path to None."
    )
  custom = [] if base is nnx.Conv or (base is nnx.Linear and isinstance(spec, NM)) else custom_options(node)
  if custom:
    raise ValueError(
        f"{path}: its {', '.join(custom)} is not Flax's default, which {spec.describe()} cannot honour here (it "
        "would compute another product). Map this path to None" + (", or use an NM rule, which keeps them."
                                                                   if base is nnx.Linear else ".")
    )
  if base is nnx.Conv:
    expected = tuple(node.kernel_shape)
  elif base is nnx.LinearGeneral:
    reason = linear_general_unsupported(node)  # before the shape check: a batch_axis kernel is not a stack
    if reason:
      raise ValueError(f"{path}: {reason}.")
    expected = (*node.in_features, *node.out_features)
  else:
    expected = (node.in_features, node.out_features)
  if tuple(node.kernel.shape) != expected and not linear_stack(node):
    raise ValueError(stack_error(node, expected, path))


def at_path(where: str, build: Callable[..., Any], *args: Any) -> Any:
  """``build(*args)``, a plain ``TypeError`` / ``ValueError`` of the sparse layer's own checks (a dtype it refuses,
  say) prefixed with the layer's path where the message does not start with it."""
  try:
    return build(*args)
  except (TypeError, ValueError) as e:
    if type(e) not in (TypeError, ValueError) or str(e).startswith(where):
      raise
    raise type(e)(f"{where}: {e}") from e


def _to_sparse(node: nnx.Module, spec: Spec, mask: np.ndarray | None, path: str) -> nnx.Module:
  """The sparse layer replacing ``node``, with its partitioning names and placement (carried by the layers'
  ``from_dense``, or here where a layer is built another way)."""
  _check_rebuildable(node, spec, path)
  kernel_shape = tuple(node.kernel.shape)
  if mask is not None and mask.shape != kernel_shape:
    raise ValueError(f"{path}: the given mask has shape {mask.shape}, the kernel {kernel_shape}.")
  if linear_stack(node):
    stack, _ = sparse_stack(node, mask, path, lambda layer, m, where: _to_sparse(layer, spec, m, where))
    return stack
  if isinstance(node, nnx.Conv):
    if isinstance(spec, BlockSparse):
      raise ValueError(
          f"{path}: BlockSparse does not apply to nnx.Conv layers; use jaxsparse.NM(...) or "
          "jaxsparse.Unstructured(...) for this path, or exclude it with a None rule."
      )
    check_spec_applies(spec, kernel_shape, path=path)
    if node.mask is not None and isinstance(spec, Unstructured):
      raise ValueError(f"{path}: this nnx.Conv already has a Flax weight mask, which an Unstructured "
                       "structure would replace; map this path to None (its mask prunes it) or use an NM rule.")
    if isinstance(spec, NM):
      conv = node
      if mask is not None:
        check_nm_mask(mask, spec, mask.ndim - 2, path)
        conv = MaskedConv.from_dense(node, mask=mask).to_dense()  # both carry the names and placement
      return NMConv.from_dense(conv, n=spec.n, m=spec.m, transposable=spec.transposable)
    return MaskedConv.from_dense(node, sparsity=None if mask is not None else spec.sparsity, mask=mask)
  if isinstance(node, nnx.LinearGeneral):
    lin = _general_as_linear(node, path)
    check_spec_applies(spec, lin.kernel.shape, path=path)
    if mask is not None:
      check_general_mask_view(mask, spec, len(node.in_features), path)
    mask2 = None if mask is None else mask.reshape(lin.kernel.shape)
    layer = SparseLinearGeneral(
        _sparse_linear(lin, spec, mask2, path), in_features=node.in_features, out_features=node.out_features,
        dtype=node.dtype, precision=node.precision,
    )
    return carry_nnx(node, layer)  # the (K, N) linear has no names: node's, folded
  check_spec_applies(spec, kernel_shape, path=path)
  return _sparse_linear(node, spec, mask, path)


def _chosen_embeds(
    model: nnx.Module, resolved: list, linear_paths: list[str], paths_of: dict[int, list[tuple]],
) -> list[tuple[tuple, nnx.Embed, NM, list[str]]]:
  """The ``nnx.Embed`` layers a rule aimed at embeddings maps to an ``NM`` structure: ``(path, layer, spec, paths)``.

  An embedding takes the first rule that fully matches its path only when that rule matches no ``nnx.Linear`` /
  ``Conv`` / ``LinearGeneral`` (a rule naming it, like ``"embed"``): catch-all rules leave embeddings dense, since
  pruning a lookup table saves memory, not time, and costs accuracy. Such a rule must be an ``NM`` one. A table held
  at several paths (tied: ``self.head = self.embed``, ``paths_of`` from :func:`~jaxsparse._rules.module_paths`) is
  matched at each, as a tied linear layer is, and the rules must give its paths one structure; ``paths`` lists them.
  """
  out = []
  for path, node in nnx.iter_modules(model):
    if isinstance(node, nnx.Embed):
      paths = [path_str(q) for q in paths_of.get(id(node), [path])]
      specs = {q: embedding_rule(resolved, q, linear_paths, kind=f"nnx.{type(node).__name__}",
                                 layers="nnx.Linear, nnx.LinearGeneral (trailing axes), nnx.Conv",
                                 features=node.features) for q in paths}
      specs = {q: spec for q, spec in specs.items() if spec is not None}
      if len(set(specs.values())) > 1:
        raise ValueError(f"{path_str(path)}: one embedding held at several paths (tied) gets different structures "
                         f"from the rules: {', '.join(f'{q}: {v.describe()}' for q, v in specs.items())}. Give its "
                         "paths one structure.")
      if specs:
        _check_table_rebuildable(node, path_str(path) or "(the model itself)")
        out.append((tuple(path), node, next(iter(specs.values())), paths))
  return out


def _check_table_rebuildable(node: nnx.Embed, path: str) -> None:
  """Raises where a ``CompressedNMEmbed`` of ``node``'s table would compute another function: a subclass of
  ``nnx.Embed`` (its lookups may scale or add to the rows), a stacked (``nnx.vmap``) table."""
  if type(node) is not nnx.Embed:
    raise TypeError(
        f"{path}: {type(node).__name__} is a subclass of nnx.Embed; sparsify stores its table as a CompressedNMEmbed "
        "and would drop what the subclass adds (a scale, another lookup or attend). Map this path to None."
    )
  expected = (node.num_embeddings, node.features)
  if tuple(node.embedding.shape) != expected:
    raise ValueError(
        f"{path}: its table has shape {tuple(node.embedding.shape)}, not the {expected} of its num_embeddings and "
        "features: a stacked (scan-over-layers, nnx.vmap) table? sparsify takes layers holding one table each; map "
        "this path to None."
    )


def _sparse_embed(node: nnx.Embed, spec: NM, mask: np.ndarray | None, path: str) -> CompressedNMEmbed:
  if mask is not None:
    if mask.shape != tuple(node.embedding.shape):
      raise ValueError(f"{path}: the given mask has shape {mask.shape}, the embedding {tuple(node.embedding.shape)}.")
    check_nm_mask(mask, spec, 1, path, what="the features")
  return CompressedNMEmbed.from_dense(node, spec.n, spec.m, mask=mask)


def _density(layer: nnx.Module, mask: np.ndarray | None = None) -> float | None:
  """The kept fraction of a new layer's kernel (``mask``: the one given for it); ``None`` where it depends on values
  that a trace hides."""
  if isinstance(layer, SparseLinearGeneral):
    return _density(layer.layer, mask)
  if isinstance(layer, (NMLinear, NMConv)):  # the nonzero weights the pattern keeps: a group may keep fewer than n
    return nm_density(layer.kernel.get_value(), layer.n, layer.m, transposable=layer.transposable,
                      weight_mask=layer.mask if isinstance(layer, NMConv) else None, mask=mask)
  # A masked layer's mask is counted where it holds values: given, or ranked from concrete weights, also under
  # nnx.eval_shape; a mask ranked from traced weights is unknown (None).
  density = layer.density
  return None if density is None else float(density)


def _describe(node: nnx.Module) -> str:
  if isinstance(node, nnx.Conv):
    return f"Conv({node.in_features}->{node.out_features}, {tuple(node.kernel_size)})"
  if isinstance(node, nnx.LinearGeneral):
    return f"LinearGeneral({node.in_features}->{node.out_features})"
  stack = linear_stack(node)  # a stack of layers (nnx.vmap): one row for the stack, e.g. "3 x Linear(16->32)"
  return f"{'x'.join(map(str, stack))} x " * bool(stack) + f"Linear({node.in_features}->{node.out_features})"


def _dense_layers(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
  out = []
  for path, node in nnx.iter_modules(model):
    if isinstance(node, SPARSE_NNX):
      continue
    if isinstance(node, (nnx.Linear, nnx.Conv, nnx.LinearGeneral)):
      out.append((tuple(path), node))
  return out


def _variable_holders(model: nnx.Module) -> dict[int, list[tuple[tuple, int]]]:
  """Every reference to each ``nnx.Variable`` inside ``model``, by ``id``: ``(path, id of the module holding it)``
  (:func:`~jaxsparse._rules.walk_graph`). A variable of a tied layer (``self.b = self.a``) has one holder; one held
  by two modules (``b.kernel = a.kernel``, or a module keeping ``self.table = embed.embedding``) has two."""
  out: dict[int, list[tuple[tuple, int]]] = {}
  for path, node, holder in walk_graph(model):
    if isinstance(node, nnx.Variable):
      out.setdefault(id(node), []).append((path, holder))
  return out


def _check_not_shared(node: nnx.Module, path: tuple, holders: dict[int, list[tuple[tuple, int]]]) -> None:
  """Raises where a variable of ``node`` (its kernel, bias, table) is also held by another module: its sparse layer
  gets variables of its own, so the other holder would keep the dense one (weights tied at the variable, untied)."""
  for name, variable in vars(node).items():
    if not isinstance(variable, nnx.Variable):
      continue
    others = sorted({path_str(p) for p, holder in holders.get(id(variable), []) if holder != id(node)})
    if others:
      where = path_str(path) or "(the model itself)"
      raise ValueError(
          f"{where}: its {name} is also held at {', '.join(others)} (one nnx.{type(variable).__name__} in two "
          f"modules: weights tied at the variable, not at the layer); the sparse layer replacing {where} holds "
          "variables of its own, so this would untie them. Tie the layers instead (self.b = self.a: one layer, "
          "replaced at each of its paths), or keep the layers that hold it dense (map their paths to None)."
      )


def _unsupported_changes(model: nnx.Module, resolved: list) -> list[LayerChange]:
  """Report rows of the modules with a ``kernel`` param that a rule selects but sparsify does not take (``nnx.Einsum``,
  ``nnx.ConvTranspose``, a module of one's own): left dense, named in the report."""
  rows = []
  for path, node in nnx.iter_modules(model):
    kernel = vars(node).get("kernel")
    if (not isinstance(kernel, nnx.Param) or type(node).__module__.startswith("jaxsparse.")
        or isinstance(node, (nnx.Linear, nnx.Conv, nnx.LinearGeneral, nnx.Embed))):
      continue
    p = path_str(path)
    r = match_rules(resolved, p)
    if r is not None and resolved[r][2] is not None:
      rows.append(unsupported_change(p or "(the model itself)", f"{type(node).__name__}({tuple(kernel.shape)})",
                                     resolved[r][2], state_bytes(node), takes=_TAKES))
  return rows


_TAKES = "nnx.Linear, nnx.LinearGeneral (trailing axes), nnx.Conv, nnx.Embed (NM, a rule naming it)"


def _record_inputs(model: nnx.Module, layers: list[tuple[tuple, nnx.Module]], example_input: Any) -> dict:
  shapes: dict[tuple, jax.ShapeDtypeStruct] = {}

  def recorder(path):
    def record(x):
      shapes.setdefault(path, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return record

  args = example_input if isinstance(example_input, tuple) else (example_input,)
  if any(not path for path, _ in layers):  # the model is the layer
    recorder(())(args[0])
    return shapes
  for path, node in layers:
    replace_module(model, path, Probe(node, recorder(path)))
  try:
    nnx.eval_shape(lambda m, *a: m(*a), model, *args)
  finally:
    for path, node in layers:
      replace_module(model, path, node)
  return shapes


def sparsify(
    model: nnx.Module,
    rules: Any,
    *,
    masks: Any = None,
    check_speed: bool | str = False,
    example_input: Any = None,
    inplace: bool = False,
) -> tuple[nnx.Module, SparsifyReport]:
  """Replaces the dense layers of an NNX model that match ``rules`` by sparse layers.

  Every ``nnx.Linear``, ``nnx.Conv`` and ``nnx.LinearGeneral`` (trailing contracting axes, as in
  ``nnx.MultiHeadAttention``) takes the structure of the first rule whose regex fully matches its
  dotted path; its sparse replacement keeps the largest-magnitude weights (blocks by Frobenius norm,
  N of every M) and copies the bias and options. See the module docstring for which layer each
  structure gives. An ``nnx.Embed`` is taken only by a rule that matches no other layer (one naming it, as
  ``{"embed": jaxsparse.NM(2, 4)}``), and only with ``NM``: it becomes a
  :class:`~jaxsparse.layers.CompressedNMEmbed` (the groups along the features, mask key ``"<path>.embedding"``).

  A stack of ``nnx.Linear`` layers (Flax's scan over layers: built by ``nnx.vmap``, kernel ``(*layers, K, N)`` with
  ``(K, N)`` its ``in_features`` / ``out_features``) becomes the stack of the sparse layers of its layers, each pruned
  on its own weights (or its slice of the mask ``(*layers, K, N)``) and stacked as ``nnx.vmap`` stacks them (with the
  stack's partitioning axis names), so the model's ``nnx.scan`` over the stack runs as it did (an ``nnx.StateAxes``
  there gives the patterns the parameters' axis: ``nnx.StateAxes({(nnx.Param, SparsityPattern): 0, ...: None})``). A
  block-sparse stack needs the same number of kept blocks in every layer. Its report row is the stack's (layer
  ``"3 x Linear(16->32)"``, the density of all its layers); ``check_speed`` does not time it.

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> from flax import nnx
  >>> class MLP(nnx.Module):
  ...   def __init__(self, rngs):
  ...     self.up = nnx.Linear(64, 128, rngs=rngs)
  ...     self.down = nnx.Linear(128, 64, rngs=rngs)
  ...   def __call__(self, x):
  ...     return self.down(jax.nn.relu(self.up(x)))
  >>> model = MLP(nnx.Rngs(0))
  >>> sparse, report = jaxsparse.sparsify(model, {r"up": jaxsparse.BlockSparse(density=0.25, block_shape=(32, 32)),
  ...                                            r".*": jaxsparse.NM(2, 4)})
  >>> type(sparse.up).__name__, type(sparse.down).__name__, type(model.up).__name__
  ('BlockSparseLinear', 'NMLinear', 'Linear')
  >>> [(c.path, c.kind, c.density) for c in report.layers]
  [('down', '2:4', 0.5), ('up', 'block 32x32 25% kept', 0.25)]
  >>> sparse(jnp.ones((2, 64))).shape
  (2, 64)

  Args:
    model: an ``nnx.Module``; it is copied unless ``inplace``.
    rules: a structure (``jaxsparse.BlockSparse(density=..., block_shape=...)``, ``jaxsparse.NM(n, m)``,
      ``jaxsparse.Unstructured(sparsity=...)``) for every layer, or ``{regex: structure or None}``;
      the first pattern that fully matches a layer's dotted path wins, ``None`` keeps it dense.
    masks: optional masks from training (:func:`jaxsparse.pruning.get_masks`, or
      ``{"path.kernel": mask}``): a layer with a mask for its kernel keeps exactly those weights
      (a ``BlockSparse`` layer needs a mask constant over its blocks) instead of pruning by magnitude.
    check_speed: ``True`` / ``"train"`` times forward+backward, ``"forward"`` the forward pass, of
      each dense layer and its sparse replacement on the input it gets from ``example_input``; a
      layer stays dense unless the sparse one is faster (SparseProp's swap rule).
    example_input: the model's input (an array, or a tuple of positional arguments) for ``check_speed``.
    inplace: modify ``model`` itself instead of a copy.

  Returns:
    ``(model, report)``: the sparse model and a :class:`SparsifyReport` (path, structure, density,
    parameter bytes before and after, times). A module with a ``kernel`` that a rule selects but sparsify does not
    take (``nnx.Einsum``, ``nnx.ConvTranspose``, one's own) stays dense, in a row with ``replaced_by=None``. An
    abstract model (from ``nnx.eval_shape``: an orbax restore target)
    gives the abstract sparse model, always a new one, with the state a concrete model's sparse model has (a
    checkpoint of it restores into it); its report's densities are those of the given masks, the rules' where they
    fix them (N:M, block counts), else ``None`` (unknown: no weights to rank).

  Raises:
    ValueError: naming the layer path, when a structure cannot apply (``m`` does not divide the
      input size, blocks do not divide the kernel, ``BlockSparse`` on a conv, a bad mask, a block-sparse stack whose
      layers keep different numbers of blocks, a stack of ``nnx.Conv`` / ``nnx.LinearGeneral`` layers or one whose
      layer axes do not lead, a layer whose kernel or bias (an embedding's table) another module holds too: tied at
      the variable, ``b.kernel = a.kernel``, which its sparse layer would untie); ``check_speed`` with an abstract
      model (no weights to time).
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}; for Linen use sparsify_linen.")
  check_distinct_tree_paths(nnx.state(model), what="model")
  resolved = resolve_rules(rules)
  abstract = is_abstract(model)
  mode = check_speed_mode(check_speed, example_input, abstract=abstract and "this model is abstract (nnx.eval_shape)")
  mask_dict = masks_dict(masks)
  if abstract:
    # Abstract variables (the layers' from_dense read their arrays): the same conversion, traced for shapes only. The
    # masks (NumPy) are closed over, so they keep their values; the report comes out of the trace.
    reports = []

    def build(m: nnx.Module) -> nnx.Module:
      sparse, report = sparsify(m, rules, masks=mask_dict or None, inplace=True)
      reports.append(report)
      return sparse

    return nnx.eval_shape(build, model), reports[0]
  if not inplace:
    model = nnx.clone(model)
  layers = _dense_layers(model)
  paths_of = module_paths(model)  # a layer held at several paths (tied) is matched at each, replaced at all
  chosen, all_paths = [], []
  for path, node in layers:
    specs = {}
    for q in paths_of.get(id(node), [path]):
      all_paths.append(path_str(q))
      r = match_rules(resolved, path_str(q))
      if r is not None and resolved[r][2] is not None:
        specs[path_str(q)] = resolved[r][2]
    if len(set(specs.values())) > 1:
      raise ValueError(f"{path_str(path)}: one layer held at several paths (tied) gets different structures from the "
                       f"rules: {', '.join(f'{q}: {v.describe()}' for q, v in specs.items())}. Give its paths one "
                       "structure.")
    if specs:
      chosen.append((path, node, next(iter(specs.values()))))
  embeds = _chosen_embeds(model, resolved, all_paths, paths_of)
  holders = _variable_holders(model)
  for path, node, *_ in [*chosen, *embeds]:
    _check_not_shared(node, path, holders)
  table_paths = [path_str(q) for path, node in nnx.iter_modules(model) if isinstance(node, nnx.Embed)
                 for q in paths_of.get(id(node), [path])]
  warn_unmatched(resolved, all_paths + [q for _, _, _, paths in embeds for q in paths]
                 + embeddings_kept_dense(resolved, table_paths, all_paths),
                 what="nnx.Linear / nnx.Conv / nnx.LinearGeneral / nnx.Embed (a rule naming it)", shadowed=True)
  bridged = bridged_linen(model, holds_dense_layers)
  if bridged:
    _utils.warn_at_caller(
        f"sparsify does not see inside flax.nnx.bridge.ToNNX: the Linen layers of {', '.join(bridged)} stay as they "
        "are. Sparsify the Linen module before wrapping it: sparse, variables, _ = jaxsparse.sparsify_linen(module, "
        "variables, rules, *inputs), then nnx.bridge.ToNNX(sparse, rngs=...).", UserWarning)
  kernel_keys = [f"{path_str(p)}.kernel" if p else "kernel" for p, _, _ in chosen]
  kernel_keys += [f"{path_str(p)}.embedding" if p else "embedding" for p, _, _, _ in embeds]
  check_masks_used(mask_dict, set(kernel_keys), kernel_keys)

  built = []
  for path, node, spec in chosen:
    p = path_str(path)
    mask = mask_dict.get(f"{p}.kernel" if p else "kernel")
    where = p or "(the model itself)"
    # With the partitioning names and placement (from_dense carries them, or _to_sparse where it builds otherwise)
    new = at_path(where, _to_sparse, node, spec, None if mask is None else np.asarray(mask), where)
    built.append((path, node, spec, new))

  # A stack's layers run inside the model's nnx.scan: not timed (check_speed times one layer against its sparse one).
  shapes = _record_inputs(model, [(p, n) for p, n, _, _ in built if not linear_stack(n)], example_input) if mode else {}
  changes = []
  for path, node, spec, paths in embeds:  # lookups, not products: nothing to time
    p = path_str(path)
    mask = mask_dict.get(f"{p}.embedding" if p else "embedding")
    # from_dense carries the table's partitioning names and placement
    where = p or "(the model itself)"
    new = at_path(where, _sparse_embed, node, spec, None if mask is None else np.asarray(mask), where)
    if path:
      replace_module(model, path, new)
    else:
      model = new
    changes.append(LayerChange(p, f"Embed({node.num_embeddings}x{node.features})", spec.describe(),
                               type(new).__name__, nm_table_density(node.embedding.get_value(), spec.n, spec.m,
                                                                   mask=None if mask is None else np.asarray(mask)),
                               state_bytes(node), state_bytes(new),
                               note=f"tied: also at {', '.join(paths[1:])}" if paths[1:] else ""))
  mask_notes = {}
  for path, node, spec, new in built:
    p = path_str(path)
    dense_ms = sparse_ms = None
    tied = [path_str(q) for q in paths_of.get(id(node), [])[1:]]
    note = f"tied: also at {', '.join(tied)}" if tied else ""
    keep_dense = False
    if mode:
      if linear_stack(node):
        note = "; ".join(filter(None, [note, "a stack of layers (nnx.vmap): not timed"]))
      elif path in shapes:
        x = random_input(shapes[path])
        dense_ms, sparse_ms = time_nnx_layer(node, x, mode), time_nnx_layer(new, x, mode)
        keep_dense = sparse_ms >= dense_ms
        if keep_dense:
          note = "; ".join(filter(None, [note, f"kept dense: sparse not faster ({mode})"]))
      else:
        note = "; ".join(filter(None, [note, "not called by example_input; not timed"]))
    if keep_dense:
      changes.append(LayerChange(p, _describe(node), spec.describe(), None, 1.0, state_bytes(node),
                                 state_bytes(node), dense_ms, sparse_ms, note))
      continue
    if path:
      replace_module(model, path, new)
    else:
      model = new
    mask = mask_dict.get(f"{p}.kernel" if p else "kernel")
    mask_notes[p] = mask_density_note(spec, mask)
    note = "; ".join(filter(None, [note, mask_notes[p]]))
    changes.append(LayerChange(p, _describe(node), spec.describe(), type(new).__name__, _density(new, mask),
                               state_bytes(node), state_bytes(new), dense_ms, sparse_ms, note))
  warn_mask_densities(mask_notes)
  changes += _unsupported_changes(model, resolved)
  changes.sort(key=lambda c: c.path)
  return model, SparsifyReport(tuple(changes))
