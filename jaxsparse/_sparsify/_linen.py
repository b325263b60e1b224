"""``sparsify_linen`` / ``densify_linen``: the Linen side of :func:`jaxsparse.sparsify`.

Linen: :func:`sparsify_linen` rewrites the variables (sparse parameters, patterns in the
``"sparsity"`` collection) and returns a :class:`SparsifiedLinen` whose ``apply`` runs the user's
unchanged module with its ``nn.Dense`` / ``nn.DenseGeneral`` / ``nn.Conv`` calls redirected
(``nn.intercept_methods``) to the Linen sparse layers:

============================  ====================  ======================  ==================================
rule                          ``nn.Dense``          ``nn.Conv``             ``nn.DenseGeneral``
============================  ====================  ======================  ==================================
``BlockSparse(density, bs)``  ``BlockSparseDense``  error                   ``BlockSparseDense`` on ``(K, N)``
``NM(n, m)``                  ``NMDense`` (SR-STE)  ``NMConv`` (SR-STE)     ``NMDense`` on ``(K, N)``
``Unstructured(sparsity)``    ``MaskedDense``       masked ``nn.Conv``      ``MaskedDense`` on ``(K, N)``
============================  ====================  ======================  ==================================

An ``nn.DenseGeneral`` contracting its input's trailing axes in order, without ``batch_dims`` (the
projections of ``nn.MultiHeadDotProductAttention``: ``(d,) -> (heads, head_dim)`` and back), is the
2-D layer on flattened features, as ``SparseLinearGeneral`` is in NNX: its kernel
``(*in_dims, *features)`` is viewed as ``(K, N) = (prod(in_dims), prod(features))``, the input
``(..., *in_dims)`` as ``(..., K)`` and the output ``(..., N)`` as ``(..., *features)``. Its sparse
variables are those of the 2-D layer (kernel ``(K, N)`` or block values, bias ``(N,)``, mask
``(K, N)``); :func:`densify_linen` gives back the ``nn.DenseGeneral`` shapes.

An ``nn.Embed`` takes a rule only when the rule names it (matches no layer above), as in :func:`jaxsparse.sparsify`:
``NM(n, m)`` runs its lookups and ``attend`` as a :class:`~jaxsparse.layers.linen.CompressedNMEmbed` (``n`` of every
``m`` features of each row kept; ``params.embedding`` the kept values ``(features * n // m, num_embeddings)``,
``sparsity.embedding_positions``); other structures raise. Catch-all rules leave embeddings dense.

A layer under an ``nn.scan`` / ``nn.vmap`` over layers (``variable_axes={"params": 0}``: kernel ``(*layers, K, N)``)
becomes the stack of its layers' sparse layers, each made from its own slice and stacked on the same leading axes,
which the model's transform slices as it sliced the dense ones (``jaxsparse/_sparsify/_linen_stacks.py``).

What lives here: finding the layers a model calls (``_linen_layers``), matching them to rules and checking
that their sparse layer computes the same function, :class:`SparsifiedLinen` (the interceptor that redirects the
calls) and :func:`sparsify_linen` / :func:`densify_linen`. What follows from one layer's plan alone (the sparse
module that runs it, its variables sparse and dense) is in ``jaxsparse/_sparsify/_linen_plan.py``.
"""


from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from jaxsparse._rules import check_distinct_tree_paths
from jaxsparse._rules import check_unsupported
from jaxsparse._rules import dense_general_dims
from jaxsparse._rules import embedding_rule
from jaxsparse._rules import embeddings_kept_dense
from jaxsparse._rules import match_rules
from jaxsparse._rules import resolve_rules
from jaxsparse._rules import warn_unmatched
from jaxsparse._sparsify._linen_plan import _LinenLayer
from jaxsparse._sparsify._linen_plan import _nested_get
from jaxsparse._sparsify._linen_plan import _nested_set
from jaxsparse._sparsify._linen_plan import _to_dict
from jaxsparse._sparsify._linen_plan import apply_sparse_layer
from jaxsparse._sparsify._linen_plan import compressed_variables
from jaxsparse._sparsify._linen_plan import densify_layers
from jaxsparse._sparsify._linen_plan import embed_variables
from jaxsparse._sparsify._linen_plan import kept_blocks
from jaxsparse._sparsify._linen_plan import layer_density
from jaxsparse._sparsify._linen_plan import sparse_layer_name
from jaxsparse._sparsify._linen_plan import sparse_module_of
from jaxsparse._sparsify._linen_plan import sparse_variables
from jaxsparse._sparsify._linen_stacks import carry_stack
from jaxsparse._sparsify._linen_stacks import layer_axes
from jaxsparse._sparsify._linen_stacks import stack_error
from jaxsparse._sparsify._masks import check_masks_used
from jaxsparse._sparsify._masks import check_nm_mask
from jaxsparse._sparsify._masks import mask_density_note
from jaxsparse._sparsify._masks import masks_dict
from jaxsparse._sparsify._masks import nm_table_density
from jaxsparse._sparsify._masks import warn_mask_densities
from jaxsparse._sparsify._nnx import at_path
from jaxsparse._sparsify._nnx_convert import is_abstract
from jaxsparse._sparsify._report import LayerChange
from jaxsparse._sparsify._report import SparsifyReport
from jaxsparse._sparsify._report import check_speed_mode
from jaxsparse._sparsify._report import nbytes
from jaxsparse._sparsify._report import random_input
from jaxsparse._sparsify._report import timed
from jaxsparse._sparsify._report import unsupported_change
from jaxsparse.formats._nm import NMSparseMatrix
from jaxsparse.formats._specs import NM
from jaxsparse.formats._specs import BlockSparse
from jaxsparse.formats._specs import Spec
from jaxsparse.formats._specs import Unstructured
from jaxsparse.layers import linen as sparse_linen
from jaxsparse.layers._common import MissingPatternError

__all__ = [
    "SparsifiedLinen",
    "densify_linen",
    "sparsify_linen",
]


_IN_SPARSE_LAYER: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxsparse_in_sparse_layer", default=False)
_INTERCEPTED = ("__call__", "attend", "setup")  # attend and setup: of an nn.Embed


@dataclasses.dataclass(frozen=True, eq=False)
class SparsifiedLinen:
  """A Linen module whose matched ``nn.Dense`` / ``nn.DenseGeneral`` / ``nn.Conv`` calls run as sparse layers.

  ``apply(variables, *args, **kwargs)`` is ``module.apply`` with those calls redirected
  (``nn.intercept_methods``) to ``BlockSparseDense``, ``MaskedDense``, ``NMDense`` (on flattened
  features for ``nn.DenseGeneral``; ``CompressedNMDense`` after :func:`jaxsparse.compress_linen`), ``NMConv``, a
  masked ``nn.Conv`` or, for an ``nn.Embed``'s lookups and ``attend``, ``CompressedNMEmbed``, on the variables of the
  same scope. Use it as ``apply_fn`` of a ``TrainState``.

  It is not an ``nn.Module`` (it has ``apply``, ``init`` and ``init_with_output`` only): for a table of its layers
  (bytes, density, which layers are sparse) use ``jaxsparse.summary(variables, *inputs, module=sparse)`` where
  ``nn.Module.tabulate`` would be used.

  Attributes:
    module: the user's Linen module, unchanged.
    layers: ``{module path: plan}`` of the redirected layers.
    dense_layers: ``{module path: unbound module}`` of the ``nn.Dense`` / ``nn.DenseGeneral`` / ``nn.Conv`` /
      ``nn.Embed`` layers the example inputs called that run as they are (no rule, or routed back to dense), for
      the torch export (an ``nn.DenseGeneral``'s kernel of ndim >= 3 does not say its contracted axes).
  """

  module: nn.Module
  layers: Mapping[tuple, _LinenLayer]
  dense_layers: Mapping[tuple, nn.Module] = dataclasses.field(default_factory=dict)

  def _intercept(self, next_fun, args, kwargs, context):
    method = context.method_name
    layer = self.layers.get(tuple(context.module.path)) if method in _INTERCEPTED else None
    if layer is None or _IN_SPARSE_LAYER.get() or type(context.module) is not type(layer.module) or (
        method != "__call__" and layer.kind != "embed"):
      return next_fun(*args, **kwargs)
    if method == "setup":  # nn.Embed's would declare the dense table (another shape): the sparse layer holds it
      # A model reading the table itself (``self.embed.embedding``) reads the pruned one: unused, jit drops it.
      variables = nn.meta.unbox(context.module.variables)
      if sparse_linen.SPARSITY in variables:  # else the lookup raises, naming the collection
        context.module.embedding = NMSparseMatrix(
            variables["params"]["embedding"], variables[sparse_linen.SPARSITY]["embedding_positions"],
            shape=(*layer.in_dims, *layer.features), n=layer.spec.n, m=layer.spec.m, validate=False).to_dense().T
      return None
    x = _layer_input(args, kwargs, name="query" if method == "attend" else "inputs")
    if x is None:
      raise TypeError(f"{'.'.join(context.module.path)}: sparse layers take one input, positional or "
                      f"{'query' if method == 'attend' else 'inputs'}=, got {len(args)} positional and keywords "
                      f"{sorted(kwargs)}.")
    token = _IN_SPARSE_LAYER.set(True)  # the sparse layer's own nn.Dense / nn.Conv must run as is
    try:  # its errors (a bad input, a bad pattern) name the layer's path
      return at_path(".".join(context.module.path) or "(the model itself)",
                 lambda: apply_sparse_layer(layer, context.module.variables, x, method=method))
    finally:
      _IN_SPARSE_LAYER.reset(token)

  def apply(self, variables: Mapping, *args: Any, **kwargs: Any) -> Any:
    """``module.apply(variables, *args, **kwargs)`` with the sparse layers in place."""
    with nn.intercept_methods(self._intercept):
      return self.module.apply(variables, *args, **kwargs)

  def init(self, rngs: Any, *args: Any, **kwargs: Any) -> dict:
    """Fresh sparse variables: ``module.init(rngs, *args, **kwargs)``, each planned layer then pruned by
    magnitude to its structure, as :func:`sparsify_linen` does (given masks are not part of the plan).

    Works under ``jax.eval_shape``, so a checkpoint of the sparse variables restores into an abstract
    target with no dense model in memory::

        abstract = jax.eval_shape(sparse.init, jax.random.key(0), x)
        variables = ocp.StandardCheckpointer().restore(path, abstract)
    """
    variables = _to_dict(self.module.init(rngs, *args, **kwargs))
    params = variables.setdefault("params", {})
    for path, layer in self.layers.items():
      boxed_params = _nested_get(params, path)
      if layer.kind == "embed":
        _store(variables, path, layer, boxed_params, embed_variables(layer.spec, nn.meta.unbox(boxed_params)))
        continue
      layer_vars, _ = sparse_variables(layer, nn.meta.unbox(boxed_params), None, ".".join(path))
      if layer.compressed:
        layer_vars = compressed_variables(layer, layer_vars)
      _store(variables, path, layer, boxed_params, layer_vars)
    return variables

  def init_with_output(self, rngs: Any, *args: Any, **kwargs: Any) -> tuple[Any, dict]:
    """``(output, variables)``, as ``nn.Module.init_with_output`` returns them: :meth:`init`'s variables and the
    output :meth:`apply` gives on them. ``flax.nnx.bridge.ToNNX`` initialises the module it wraps with it, so
    ``nnx.bridge.ToNNX(sparse, rngs=nnx.Rngs(0)).lazy_init(x)`` holds fresh sparse variables.

    The output is the sparse model's, computed with every collection mutable as Linen's ``init`` does (a
    ``BatchNorm`` in training mode runs); its updates are dropped, the variables are :meth:`init`'s.
    """
    variables = self.init(rngs, *args, **kwargs)
    rngs = dict(rngs) if isinstance(rngs, Mapping) else {"params": rngs}
    kwargs = {k: v for k, v in kwargs.items() if k not in ("mutable", "capture_intermediates")}
    out, _ = self.apply(variables, *args, rngs=rngs, mutable=True, **kwargs)
    return out, variables


def _store(variables: dict, path: tuple, layer: _LinenLayer, boxed_params: Mapping, layer_vars: dict) -> None:
  """Puts a sparse layer's variables at ``path``, with the dense parameters' partitioning boxes."""
  boxed = carry_stack(boxed_params, layer_vars, layer.stack,
                      in_ndim=len(layer.in_dims) if layer.kind == "general" else None)
  _nested_set(variables["params"], path, boxed["params"])
  if sparse_linen.SPARSITY in boxed:
    _nested_set(variables.setdefault(sparse_linen.SPARSITY, {}), path, boxed[sparse_linen.SPARSITY])


_LINEN_KINDS = {nn.Dense: "dense", nn.DenseGeneral: "general", nn.Conv: "conv"}


@dataclasses.dataclass(frozen=True)
class _Found:
  """A layer call found on the example input."""

  kind: str
  module: nn.Module  # unbound
  x: jax.ShapeDtypeStruct | None  # None for an nn.Embed (its lookups are not timed)
  in_dims: tuple[int, ...]
  features: tuple[int, ...]
  unsupported: str = ""  # why a rule may not select it


def _found(m: nn.Module, x: jax.Array) -> _Found:
  kind = _LINEN_KINDS[type(m)]
  spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
  if kind != "general":
    return _Found(kind, m.clone(parent=None), spec, (int(x.shape[-1]),), (int(m.features),))
  in_dims, features, unsupported = dense_general_dims(m, x.shape)
  unsupported = unsupported and unsupported + "."
  return _Found(kind, m.clone(parent=None), spec, in_dims, features, unsupported)


def _check_rebuildable(f: _Found, spec: Spec, dense_params: Mapping, path: str) -> tuple[int, ...]:
  """The leading layer axes of ``f``'s kernel (``()`` for one layer; ``nn.scan`` / ``nn.vmap`` over layers); raises
  where the sparse layer for ``f`` would compute another function or could not run: a kernel stacked otherwise, a
  conv's own weight mask that the structure would replace or that the call made, product options the sparse layer
  cannot honour."""
  m = f.module
  if f.kind == "conv":
    ks = (m.kernel_size,) if isinstance(m.kernel_size, int) else tuple(m.kernel_size)
    expected = (*ks, f.in_dims[0] // m.feature_group_count, *f.features)
  else:
    expected = (*f.in_dims, *f.features)
  kernel_shape = tuple(dense_params["kernel"].shape)
  bias = dense_params.get("bias")
  stack = layer_axes(kernel_shape, expected, None if bias is None else tuple(bias.shape), f.features)
  if stack is None:
    raise ValueError(stack_error(f"nn.{type(m).__name__}", kernel_shape, expected, path))
  if f.kind == "conv" and m.mask is not None:
    if isinstance(m.mask, jax.core.Tracer):
      raise ValueError(f"{path}: this nn.Conv's weight mask is made inside the model's call; sparsify_linen needs it "
                       "as a concrete array set on the module (a field given outside the call).")
    if isinstance(spec, Unstructured):
      raise ValueError(f"{path}: this nn.Conv already has a Flax weight mask, which an "
                       "Unstructured structure would replace; map this path to None (its mask prunes it) or use an NM "
                       "rule.")
  if f.kind != "conv" and not isinstance(spec, NM):
    defaults = {field.name: field.default for field in dataclasses.fields(type(m))}
    custom = [name for name in ("promote_dtype", "dot_general", "dot_general_cls")
              if name in defaults and getattr(m, name) is not defaults[name]]
    if custom:
      raise ValueError(f"{path}: its {', '.join(custom)} is not Flax's default, which {spec.describe()} cannot "
                       "honour (it would compute another product). Map this path to None, or use an NM rule, which "
                       "keeps them.")
  return stack


def _layer_input(args: tuple, kwargs: Mapping, *, name: str = "inputs") -> Any:
  """The one input of a Flax layer's call, positional or ``inputs=`` (its name in ``nn.Dense`` / ``nn.Conv`` /
  ``nn.Embed``; ``name="query"`` for ``nn.Embed.attend``); ``None`` for any other call."""
  if len(args) == 1 and not kwargs:
    return args[0]
  if not args and set(kwargs) == {name}:
    return kwargs[name]
  return None


def _linen_layers(module: nn.Module, variables: Mapping, example_input: Any, kwargs: Mapping,
                  called: dict[str, type] | None = None) -> dict[tuple, _Found]:
  """The layers ``module`` calls on ``example_input`` that sparsify_linen takes, by path; ``called`` (if given) gets
  the type of every module called, by dotted path."""
  found: dict[tuple, _Found] = {}

  def interceptor(next_fun, args, kw, context):
    m = context.module
    x = _layer_input(args, kw)
    if called is not None:
      called.setdefault(".".join(m.path), type(m))
    if context.method_name == "__call__" and type(m) in _LINEN_KINDS and x is not None and tuple(m.path) not in found:
      found[tuple(m.path)] = _found(m, x)
    if context.method_name in ("__call__", "attend") and type(m) is nn.Embed and tuple(m.path) not in found:
      found[tuple(m.path)] = _Found("embed", m.clone(parent=None), None, (int(m.features),), (int(m.num_embeddings),))
    return next_fun(*args, **kw)

  args = example_input if isinstance(example_input, tuple) else (example_input,)
  with nn.intercept_methods(interceptor):
    jax.eval_shape(lambda v, *a: module.apply(v, *a, **kwargs), variables, *args)
  return found


def _check_patterns_reach(sparse: SparsifiedLinen, variables: Mapping, example_input: Any, kwargs: Mapping) -> None:
  """Raises when the sparse layers cannot read their patterns in ``sparse.apply`` (one abstract trace): a lifted
  transform of the model (``nn.vmap`` / ``nn.scan``) that does not carry the ``"sparsity"`` collection."""
  args = example_input if isinstance(example_input, tuple) else (example_input,)
  try:
    jax.eval_shape(lambda v, *a: sparse.apply(v, *a, **kwargs), variables, *args)
  except MissingPatternError as e:
    raise ValueError(
        f"sparsify_linen: the sparse model could not apply its own variables, as a lifted transform of the model "
        f"does not pass the {sparse_linen.SPARSITY!r} collection to its layers: {e} Change the model's transform "
        "and call sparsify_linen again (jaxsparse.NM layers need no such collection)."
    ) from None


def sparsify_linen(
    module: nn.Module,
    variables: Mapping,
    rules: Any,
    example_input: Any,
    *,
    masks: Any = None,
    check_speed: bool | str = False,
    apply_kwargs: Mapping[str, Any] | None = None,
) -> tuple[SparsifiedLinen, dict, SparsifyReport]:
  """Linen version of :func:`sparsify`: sparse variables plus a module that applies them.

  The ``nn.Dense``, ``nn.DenseGeneral`` and ``nn.Conv`` layers that ``module`` calls on
  ``example_input`` are found by path (``"Dense_0"``, ``"mlp.fc1"``, ``"attn.query"``); each one a
  rule matches gets the variables of the Linen sparse layer for its structure (``BlockSparseDense``,
  ``MaskedDense``, ``NMDense``, ``NMConv``, or a masked ``nn.Conv`` for unstructured convs; see the
  module docstring for ``nn.DenseGeneral``), pruned by magnitude from its dense kernel (or to
  ``masks``). Patterns go into the ``"sparsity"`` collection. An ``nn.Embed`` is taken only by a rule that matches no
  other layer (one naming it, as ``{"embed": jaxsparse.NM(2, 4)}``), and only with ``NM``: its lookups and ``attend``
  run as a :class:`~jaxsparse.layers.linen.CompressedNMEmbed` (mask key ``"<path>.embedding"``); a model that reads
  the table itself (``self.embed.embedding``) reads the pruned table, decompressed in the call.

  A layer of an ``nn.scan`` / ``nn.vmap`` over layers (``variable_axes={"params": 0}``, kernel ``(*layers, K, N)``)
  becomes a stack of sparse layers: each layer pruned on its own slice (or its slice of the mask), the variables
  stacked on the leading layer axes (named as the dense kernel's), one report row (``"3 x Dense((16, 32))"``, not
  timed by ``check_speed``). Masked and block-sparse layers need ``"sparsity"`` in the transform's ``variable_axes``
  too (``{"params": 0, "sparsity": 0}``); a block-sparse stack needs the same number of kept blocks in every layer.

  >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxsparse
  >>> class MLP(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     h = nn.relu(nn.Dense(64)(x))  # Dense_0: 32 -> 64
  ...     return nn.Dense(16)(h)  # Dense_1: 64 -> 16
  >>> model = MLP()
  >>> x = jnp.ones((4, 32))
  >>> variables = model.init(jax.random.key(0), x)
  >>> sparse, sparse_vars, report = jaxsparse.sparsify_linen(
  ...     model, variables, {"Dense_0": jaxsparse.BlockSparse(density=0.5, block_shape=(16, 16)),
  ...                        "Dense_1": jaxsparse.Unstructured(sparsity=0.75)}, x)
  >>> jax.tree.map(jnp.shape, sparse_vars["sparsity"])["Dense_1"]
  {'mask': (64, 16)}
  >>> sparse.apply(sparse_vars, x).shape
  (4, 16)

  Args:
    module: the dense Linen module (unchanged).
    variables: its variables (``{"params": ...}`` and any other collections).
    rules: as :func:`sparsify`, matched against Linen module paths such as ``"Dense_0"``.
    example_input: an input (or tuple of positional inputs) for ``module.apply``, used to find the
      layers and their input shapes.
    masks: as :func:`sparsify`, with paths like ``"Dense_0.kernel"`` (``get_masks`` of a
      ``TrainState`` trained with :func:`jaxsparse.pruning.wrap_optax`, or
      :func:`jaxsparse.pruning.calibrated_prune_linen`, gives them); each of the kernel's own shape,
      ``(*in_dims, *features)`` for an ``nn.DenseGeneral``.
    check_speed: as :func:`sparsify`.
    apply_kwargs: keyword arguments for ``module.apply`` (e.g. ``{"train": False}``).

  Returns:
    ``(sparse_module, sparse_variables, report)``: call ``sparse_module.apply(sparse_variables, x)``. Abstract
    ``variables`` (``jax.eval_shape(module.init, ...)``: an orbax restore target) give abstract sparse variables, those
    of ``jax.eval_shape(sparse_module.init, ...)``; the report's densities are then those of :func:`sparsify`'s for an
    abstract model. A module with a ``kernel`` param that a rule selects but sparsify_linen does not take
    (``nn.Einsum``, ``nn.ConvTranspose``, one's own, a layer ``example_input`` never calls) stays dense, in a row with
    ``replaced_by=None``.

  Raises:
    ValueError: naming the layer path, when a structure cannot apply (``m`` does not divide the
      input size, blocks do not divide the kernel, ``BlockSparse`` on a conv, an ``nn.DenseGeneral``
      over other than its input's trailing axes or with ``batch_dims``, a bad mask, a kernel stacked on other than
      its leading axes, a block-sparse stack whose layers keep different numbers of blocks); when an ``nn.vmap`` /
      ``nn.scan`` of the model does not carry the ``"sparsity"`` collection that ``Unstructured`` and
      ``BlockSparse`` layers read their patterns from (e.g. ``variable_axes={"params": None}`` without
      ``"sparsity": None``; ``nn.scan``'s ``variable_broadcast="params"`` without ``"sparsity"``): the model
      needs it beside ``"params"`` (checked by one abstract trace of the sparse model's ``apply``); ``check_speed``
      with abstract ``variables`` (no weights to time).
    TypeError: ``module`` is a ``SparsifiedLinen`` (sparsified already): :func:`densify_linen` it first.
  """
  if isinstance(module, SparsifiedLinen):  # its layers would be planned again on their sparse variables
    raise TypeError(
        "module is a SparsifiedLinen (from sparsify_linen or compress_linen): its layers are sparse already. To give "
        "them other structures, sparsify the dense module: module, variables = jaxsparse.densify_linen(sparse, "
        "variables), then jaxsparse.sparsify_linen(module, variables, rules, example_input)."
    )
  resolved = resolve_rules(rules)
  abstract = is_abstract(variables)
  mode = check_speed_mode(check_speed, example_input,
                          abstract=abstract and "these variables are abstract (jax.eval_shape)")
  mask_dict = masks_dict(masks)
  if abstract:
    # The same conversion traced for shapes only (the layers' variables are built from the kernels' values); the
    # masks (NumPy) are closed over, so they keep their values; the module and report come out of the trace.
    out = []

    def build(v: Mapping) -> dict:
      sparse, sparse_vars, report = sparsify_linen(module, v, rules, example_input, masks=mask_dict or None,
                                                   apply_kwargs=apply_kwargs)
      out.append((sparse, report))
      return sparse_vars

    abstract = jax.eval_shape(build, variables)
    return out[0][0], abstract, out[0][1]
  check_distinct_tree_paths(variables, what="variables")
  kwargs = dict(apply_kwargs or {})
  called: dict[str, type] = {}
  found = _linen_layers(module, variables, example_input, kwargs, called)
  called_embeds = {path: f for path, f in found.items() if f.kind == "embed"}
  found = {path: f for path, f in found.items() if f.kind != "embed"}
  new_vars = _to_dict(variables)
  params = new_vars.setdefault("params", {})
  layers, changes = {}, []
  dense_paths = [".".join(p) for p in found]
  embeds = _chosen_embeds(resolved, called_embeds, dense_paths)
  # Tables not called on the input, or held by a subclass of nn.Embed (whose lookups may add to the rows).
  others = {p: _other_table_kind(called.get(p)) for p, leaves in _param_groups(nn.meta.unbox(params)).items()
            if "embedding" in leaves and p not in {".".join(q) for q in called_embeds}}
  check_unsupported(resolved, dense_paths + [".".join(p) for p in called_embeds], others,
                    supported="nn.Dense, nn.DenseGeneral (trailing axes), nn.Conv, nn.Embed (NM, a rule naming it)")
  chosen = [path for path in found if (r := match_rules(resolved, ".".join(path))) is not None
            and resolved[r][2] is not None]
  kernel_keys = [_kernel_key(path) for path in chosen] + [_embed_key(path) for path, _ in embeds]
  check_masks_used(mask_dict, set(kernel_keys), kernel_keys)
  for path, spec in embeds:  # lookups, not products: nothing to time
    layer, layer_vars, change = at_path(".".join(path) or "(the model itself)", _sparse_embed, called_embeds[path],
                                        spec, params, mask_dict.get(_embed_key(path)), path)
    layers[path] = layer
    _store(new_vars, path, layer, _nested_get(params, path), layer_vars)
    changes.append(change)
  mask_notes = {}
  for path, f in found.items():
    kind, m = f.kind, f.module
    p = ".".join(path)
    where = p or "(the model itself)"  # in messages: a model that is itself the layer has no path
    r = match_rules(resolved, p)
    if r is None:
      continue
    spec = resolved[r][2]
    if spec is None:
      continue
    if f.unsupported:
      raise ValueError(f"{where}: {f.unsupported}")
    boxed_params = _nested_get(params, path)
    dense_params = nn.meta.unbox(boxed_params)  # nn.with_partitioning boxes, re-applied by carry_linen
    kernel = dense_params["kernel"]
    stack = _check_rebuildable(f, spec, dense_params, where)
    if kind == "conv" and isinstance(spec, BlockSparse):
      raise ValueError(
          f"{where}: BlockSparse does not apply to nn.Conv layers; use jaxsparse.NM or jaxsparse.Unstructured."
      )
    boxes = {k: v.replace_boxed(None) for k, v in boxed_params.items() if isinstance(v, nn.meta.AxisMetadata)}
    layer = _LinenLayer(kind, spec, m, f.in_dims, f.features, boxes, stack=stack)
    # A stack (nn.scan / nn.vmap over layers) is one row: "3 x Dense((16, 32))".
    described = f"{'x'.join(map(str, stack))} x " * bool(stack) + f"{type(m).__name__}({kernel.shape[len(stack):]})"
    mask = mask_dict.get(_kernel_key(path))
    mask = None if mask is None else np.asarray(mask)
    if mask is not None and mask.shape != kernel.shape:
      raise ValueError(f"{where}: the given mask has shape {mask.shape}, the kernel {kernel.shape}.")
    layer_vars, per_layer = sparse_variables(layer, dense_params, mask, where)
    nnz = kept_blocks(per_layer[0], spec)
    at_path(where, functools.partial(sparse_module_of, layer, nnz=nnz))  # its own checks (a dtype it refuses) now
    dense_ms = sparse_ms = None
    note = ""
    if mode and stack:  # its layers run inside the model's transform: not timed, as sparsify's nnx.vmap stacks
      note = "a stack of layers (nn.scan / nn.vmap): not timed"
    elif mode:
      x = random_input(f.x)
      rest = {k: v for k, v in layer_vars.items() if k != "params"}
      dense_ms = timed(lambda q, _, x, m=m: m.apply({"params": q}, x), dense_params, x, mode)
      sparse_ms = timed(lambda q, r, x, layer=layer: apply_sparse_layer(layer, {"params": q, **r}, x),
                        layer_vars["params"], x, mode, rest)
      if sparse_ms >= dense_ms:
        changes.append(LayerChange(p, described, spec.describe(), None, 1.0,
                                   nbytes(dense_params), nbytes(dense_params), dense_ms, sparse_ms,
                                   f"kept dense: sparse not faster ({mode})"))
        continue
    layers[path] = layer
    _store(new_vars, path, layer, boxed_params, layer_vars)
    density = layer_density(layer, per_layer, mask)
    mask_notes[p] = mask_density_note(spec, mask)
    note = "; ".join(filter(None, [note, mask_notes[p]]))
    changes.append(LayerChange(p, described, spec.describe(),
                               sparse_layer_name(layer, nnz=nnz),
                               density, nbytes(dense_params), nbytes(layer_vars), dense_ms, sparse_ms, note))
  warn_mask_densities(mask_notes)
  changes += _unsupported_changes(params, resolved, set(dense_paths) | {".".join(p) for p in called_embeds}, called)
  warn_unmatched(resolved, dense_paths + [".".join(p) for p, _ in embeds]
                 + embeddings_kept_dense(resolved, [".".join(p) for p in called_embeds], dense_paths),
                 what="nn.Dense / nn.DenseGeneral / nn.Conv / nn.Embed (a rule naming it)", shadowed=True)
  changes.sort(key=lambda c: c.path)
  dense_layers = {path: f.module for path, f in {**found, **called_embeds}.items() if path not in layers}
  sparse = SparsifiedLinen(module, layers, dense_layers)
  if sparse_linen.SPARSITY in new_vars:  # patterns the model's nn.vmap / nn.scan must carry to the layers
    _check_patterns_reach(sparse, new_vars, example_input, kwargs)
  return sparse, new_vars, SparsifyReport(tuple(changes))


def _kernel_key(path: tuple) -> str:
  """The ``masks`` key of a layer's kernel, as in :func:`jaxsparse.sparsify` and :func:`jaxsparse.pruning.get_masks`:
  ``"<path>.kernel"``, ``"kernel"`` for a model that is itself the layer."""
  return f"{'.'.join(path)}.kernel" if path else "kernel"


def _embed_key(path: tuple) -> str:
  """The ``masks`` key of an embedding's table, as in :func:`jaxsparse.sparsify`: ``"<path>.embedding"``."""
  return f"{'.'.join(path)}.embedding" if path else "embedding"


def _chosen_embeds(resolved: list, called: Mapping[tuple, _Found], dense_paths: list[str]) -> list[tuple[tuple, NM]]:
  """The ``nn.Embed`` layers a rule aimed at embeddings maps to an ``NM`` structure: ``(path, spec)``.

  As in :func:`jaxsparse.sparsify`: an embedding takes the first rule that fully matches its path only when that rule
  matches no ``nn.Dense`` / ``nn.DenseGeneral`` / ``nn.Conv`` (a rule naming it, like ``"embed"``); catch-all rules
  leave embeddings dense. Such a rule must be an ``NM`` one, not transposable.
  """
  out = []
  for path, f in called.items():
    p = ".".join(path)
    spec = embedding_rule(resolved, p, dense_paths, kind="nn.Embed",
                          layers="nn.Dense, nn.DenseGeneral (trailing axes), nn.Conv", features=f.module.features)
    if spec is not None:
      out.append((path, spec))
  return out


def _sparse_embed(f: _Found, spec: NM, params: Mapping, mask: Any, path: tuple) -> tuple[_LinenLayer, dict,
                                                                                          LayerChange]:
  """The plan, (unboxed) variables and report line of the ``CompressedNMEmbed`` of the ``nn.Embed`` at ``path``."""
  p = ".".join(path) or "(the model itself)"
  boxed_params = _nested_get(params, path)
  dense = nn.meta.unbox(boxed_params)
  shape = (f.module.num_embeddings, f.module.features)
  if tuple(dense["embedding"].shape) != shape:
    raise ValueError(f"{p}: its table has shape {tuple(dense['embedding'].shape)}, not the {shape} of its "
                     "num_embeddings and features: a stacked (nn.scan over layers) table? sparsify_linen takes "
                     "layers holding one table each; map this path to None.")
  if mask is not None:
    mask = np.asarray(mask)
    if mask.shape != shape:
      raise ValueError(f"{p}: the given mask has shape {mask.shape}, the embedding {shape}.")
    check_nm_mask(mask, spec, 1, p, what="the features")
  layer_vars = embed_variables(spec, dense, mask)
  boxes = {k: v.replace_boxed(None) for k, v in boxed_params.items() if isinstance(v, nn.meta.AxisMetadata)}
  layer = _LinenLayer("embed", spec, f.module, f.in_dims, f.features, boxes, compressed=True)
  change = LayerChange(".".join(path), f"Embed({shape[0]}x{shape[1]})", spec.describe(), "CompressedNMEmbed",
                       nm_table_density(dense["embedding"], spec.n, spec.m, mask=mask), nbytes(dense),
                       nbytes(layer_vars))
  return layer, layer_vars, change


def _unsupported_changes(params: Mapping, resolved: list, taken: set[str], called: Mapping[str, type]) -> list:
  """Report rows of the modules with a ``kernel`` param that a rule selects but sparsify_linen does not take
  (``nn.Einsum``, ``nn.ConvTranspose``, a module's own ``self.param("kernel", ...)``, a layer the example input never
  calls): left dense, named in the report."""
  rows = []
  for p, leaves in _param_groups(nn.meta.unbox(params)).items():
    kind = called.get(p)
    if "kernel" not in leaves or p in taken or (kind is not None and kind.__module__.startswith("jaxsparse.")):
      continue
    r = match_rules(resolved, p)
    if r is not None and resolved[r][2] is not None:
      group = nn.meta.unbox(_nested_get(params, tuple(p.split("."))) if p else params)
      group = {k: v for k, v in group.items() if not isinstance(v, Mapping)}  # its own leaves, not submodules'
      name = "not called by example_input" if kind is None else kind.__name__
      rows.append(unsupported_change(p or "(the model itself)", f"{name}({tuple(group['kernel'].shape)})",
                                     resolved[r][2], nbytes(group), takes=_TAKES))
  return rows


_TAKES = "nn.Dense, nn.DenseGeneral (trailing axes), nn.Conv, nn.Embed (NM, a rule naming it)"


def _other_table_kind(kind: type | None) -> str:
  """How :func:`~jaxsparse._rules.check_unsupported` names a table sparsify_linen does not take: ``"nn.Embed"`` (not
  called on the example input), or the class of a subclass of ``nn.Embed`` that is called (a ``CompressedNMEmbed``
  would drop what the subclass adds)."""
  if kind is not None and issubclass(kind, nn.Embed) and kind is not nn.Embed:
    return f"{kind.__name__}, a subclass of nn.Embed whose additions a CompressedNMEmbed would drop"
  return "nn.Embed"


def _param_groups(tree: Mapping, prefix: str = "") -> dict[str, set[str]]:
  """``{dotted module path: names of its leaves}`` of a nested params dict."""
  out: dict[str, set[str]] = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(_param_groups(v, f"{prefix}.{k}" if prefix else str(k)))
    else:
      out.setdefault(prefix, set()).add(str(k))
  return out


def densify_linen(sparse: SparsifiedLinen, variables: Mapping) -> tuple[nn.Module, dict]:
  """Inverse of :func:`sparsify_linen`: the original module and dense variables (zeros where pruned).

  An ``nn.DenseGeneral``'s kernel and bias get back their own shapes, ``(*in_dims, *features)`` and
  ``features``; a stack of layers (``nn.scan`` over layers) its stacked dense parameters, layer by layer; dense
  parameters that had ``nn.Partitioned`` boxes get them back. Abstract variables (``jax.ShapeDtypeStruct`` leaves,
  e.g. ``jax.eval_shape(sparse.init, key, x)``) give the abstract dense variables: the shapes and dtypes of the dense
  model's ``init``.

  >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxsparse
  >>> model = nn.Dense(8)
  >>> x = jnp.ones((2, 8))
  >>> variables = model.init(jax.random.key(0), x)
  >>> sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, jaxsparse.NM(2, 4), x)
  >>> module, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  >>> bool(jnp.allclose(module.apply(dense_vars, x), sparse.apply(sparse_vars, x)))
  True

  A ``MaskedDense`` / masked ``nn.Conv`` mask (``"sparsity"``) must be boolean, as their forward requires (a mask of
  other values raises ``TypeError`` naming the layer's path: ``nn.Conv`` would scale the kept weights by it).

  Training with :func:`jaxsparse.pruning.wrap_optax` prunes only ``params``: a weight it prunes further is zero here
  (the dense kernels are right), but the ``"sparsity"`` mask still keeps it, so :func:`jaxsparse.summary` of the
  sparse variables and their torch export (its ``weight_mask``) read the stale, denser pattern. For the pattern the
  optimizer holds, narrow the masks first: ``variables = pruning.apply_masks(variables, pruning.get_masks(state))``.

  Args:
    sparse: the ``SparsifiedLinen`` that :func:`sparsify_linen` returned.
    variables: its variables (``params`` and the ``"sparsity"`` collection), e.g. after training; not modified.

  Raises:
    TypeError: ``sparse`` is not a ``SparsifiedLinen``; naming the layer's path, a mask in ``"sparsity"`` that is
      not boolean.

  Returns:
    ``(module, variables)``: ``sparse.module``, the original Linen module, and a new dict of dense variables
    for it, the kernels with their own shapes and dtypes and zeros where pruned; the ``"sparsity"`` collection
    is dropped once empty.
  """
  if not isinstance(sparse, SparsifiedLinen):
    raise TypeError(f"sparse must be the SparsifiedLinen that jaxsparse.sparsify_linen returned, got "
                    f"{type(sparse).__name__}.")
  return sparse.module, densify_layers(variables, sparse.layers)
