"""One planned layer of :func:`~jaxsparse.sparsify_linen`: its plan, the sparse module that runs it, its variables.

``_LinenLayer`` is the plan of one redirected ``nn.Dense`` / ``nn.DenseGeneral`` / ``nn.Conv`` / ``nn.Embed``.
What lives here is what follows from a plan alone, shared by ``sparsify_linen``, ``compress_linen`` and
``route_slower_to_dense_linen``: the Linen sparse layer that runs it (:func:`sparse_module_of`,
:func:`apply_sparse_layer`), its variables from the dense parameters (``_linen_variables``,
:func:`embed_variables`, :func:`compressed_variables` for the inference form), the dense parameters back from
them (:func:`dense_params`, :func:`densify_layers`, abstract variables included) and the nested-dict helpers they use.
A plan of a stack of layers (``_LinenLayer.stack``) does each of these layer by layer (``_linen_stacks.py``).
Finding the layers, the rules and ``SparsifiedLinen`` itself are in ``jaxsparse/_sparsify/_linen.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import _utils
from jaxsparse._sparsify._linen_stacks import block_counts_message
from jaxsparse._sparsify._linen_stacks import map_layers
from jaxsparse._sparsify._masks import block_mask_of
from jaxsparse._sparsify._masks import check_general_mask_view
from jaxsparse._sparsify._masks import check_nm_mask
from jaxsparse._sparsify._masks import nm_density
from jaxsparse._sparsify._nnx import at_path
from jaxsparse.formats._base import is_concrete
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._masks import block_magnitude_mask
from jaxsparse.formats._masks import magnitude_mask
from jaxsparse.formats._nm import NMSparseMatrix
from jaxsparse.formats._nm_masks import nm_mask
from jaxsparse.formats._specs import NM
from jaxsparse.formats._specs import BlockSparse
from jaxsparse.formats._specs import Spec
from jaxsparse.formats._specs import Unstructured
from jaxsparse.formats._specs import check_spec_applies
from jaxsparse.formats._specs import matrix_shape
from jaxsparse.layers import linen as sparse_linen
from jaxsparse.layers._common import eager_if_concrete
from jaxsparse.layers._common import masked_kept_count
from jaxsparse.layers._common import nm_kept_mask
from jaxsparse.layers._common import pattern_mask
from jaxsparse.layers._embed import compress_table

__all__ = [
    "apply_sparse_layer",
    "compressed_variables",
    "dense_params",
    "densify_layers",
    "embed_variables",
    "kept_blocks",
    "layer_density",
    "layer_variables",
    "linen_density",
    "sparse_layer_name",
    "sparse_module_of",
    "sparse_variables",
]


@dataclasses.dataclass(frozen=True)
class _LinenLayer:
  kind: str  # "dense", "general" (nn.DenseGeneral over trailing axes), "conv" or "embed" (nn.Embed)
  spec: Spec
  module: nn.Module  # the original layer, unbound (its configuration)
  in_dims: tuple[int, ...]  # the contracted input dims: (K,), or nn.DenseGeneral's (*in_dims); an embed's (features,)
  features: tuple[int, ...]  # (N,), or nn.DenseGeneral's (*features); an embed's (num_embeddings,)
  # The dense parameters' nn.Partitioned boxes (values dropped), which densify_linen puts back.
  boxes: Mapping[str, nn.meta.AxisMetadata] = dataclasses.field(default_factory=dict, compare=False)
  # An N:M dense / general layer in its inference form (jaxsparse.compress_linen): a CompressedNMDense; an
  # embedding is always compressed (a CompressedNMEmbed).
  compressed: bool = False
  implementation: str | None = None  # the CompressedNMDense's (CompressedNMEmbed's attend) nm_matmul backend
  # The leading layer axes of a stack of layers (nn.scan / nn.vmap over layers): every variable is each layer's,
  # stacked on them (_linen_stacks.py); () for one layer.
  stack: tuple[int, ...] = ()

  def one_layer(self) -> _LinenLayer:
    """The plan of one layer of a stack (boxes dropped: a stack's are put back on the stacked variables)."""
    return dataclasses.replace(self, stack=(), boxes={})

  @property
  def shape_2d(self) -> tuple[int, int]:
    """``(K, N)``: the kernel as the 2-D sparse layer holds it (dense and general layers)."""
    return matrix_shape((*self.in_dims, *self.features), len(self.in_dims))


def _nested_get(tree: Mapping, path: tuple) -> Any:
  for k in path:
    tree = tree[k]
  return tree


def _nested_set(tree: dict, path: tuple, value: Any) -> None:
  if not path:  # the root module is the layer
    tree.clear()
    tree.update(value)
    return
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def _to_dict(tree: Any) -> Any:
  if isinstance(tree, Mapping):
    return {k: _to_dict(v) for k, v in tree.items()}
  return tree


def sparse_module_of(layer: _LinenLayer, *, nnz: int | None = None) -> nn.Module:
  m, spec = layer.module, layer.spec
  # Its variables are always given (made from the dense layer's): the initializer only gives Flax the shape it
  # checks them against, and zeros take any shape and dtype (the default initializers divide by an empty table's
  # fan-in, and an integer model's dtype is refused by their normal).
  given = dict(kernel_init=nn.initializers.zeros_init())
  if layer.kind == "embed":  # parent=None: built inside nn.Embed's methods, which are not compact
    return sparse_linen.CompressedNMEmbed(m.num_embeddings, m.features, n=spec.n, m=spec.m, dtype=m.dtype,
                                          param_dtype=m.param_dtype, promote_dtype=m.promote_dtype,
                                          embedding_init=given["kernel_init"], implementation=layer.implementation,
                                          parent=None)
  if layer.kind in ("dense", "general"):
    k, n = layer.shape_2d
    # nn.Dense takes use_bias by truthiness; the sparse layers want a bool.
    common = dict(use_bias=bool(m.use_bias), dtype=m.dtype, param_dtype=m.param_dtype, precision=m.precision)
    if isinstance(spec, BlockSparse):
      blocks = (k // spec.block_shape[0]) * (n // spec.block_shape[1])
      density = spec.density if nnz is None else nnz / blocks
      return sparse_linen.BlockSparseDense(n, density=density, block_shape=spec.block_shape, **given, **common)
    if isinstance(spec, NM) and layer.compressed:
      return sparse_linen.CompressedNMDense(n, n=spec.n, m=spec.m, promote_dtype=m.promote_dtype,
                                            implementation=layer.implementation, **common)
    if isinstance(spec, NM):
      return sparse_linen.NMDense(n, n=spec.n, m=spec.m, transposable=spec.transposable, promote_dtype=m.promote_dtype,
                                  dot_general=m.dot_general, dot_general_cls=m.dot_general_cls, **common)
    return sparse_linen.MaskedDense(n, sparsity=spec.sparsity, **given, **common)
  if isinstance(spec, NM):
    fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(sparse_linen.NMConv)
              if f.name not in ("n", "m", "sr_ste_decay", "transposable", "parent", "name", "_") and hasattr(m, f.name)}
    return sparse_linen.NMConv(n=spec.n, m=spec.m, transposable=spec.transposable, **fields)
  return m  # unstructured conv: the original conv, given its mask at call time


def sparse_layer_name(layer: _LinenLayer, *, nnz: int | None = None) -> str:
  """The name of the layer that runs ``layer`` sparse (as ``summary`` names it): ``"MaskedConv"`` for an unstructured
  conv (the original ``nn.Conv`` given its mask), else the class of :func:`sparse_module_of`."""
  if layer.kind == "conv" and isinstance(layer.spec, Unstructured):
    return "MaskedConv"
  return type(sparse_module_of(layer, nnz=nnz)).__name__


def apply_sparse_layer(layer: _LinenLayer, variables: Mapping, x: jax.Array, *, method: str = "__call__") -> jax.Array:
  variables = nn.meta.unbox(variables)  # nn.Partitioned boxes (sharding annotations)
  if layer.kind == "embed":  # a lookup or attend
    return sparse_module_of(layer).apply(variables, x, method=method)
  if layer.kind == "conv" and isinstance(layer.spec, Unstructured):
    mask = pattern_mask(variables[sparse_linen.SPARSITY]["mask"], jnp.shape(variables["params"]["kernel"]))
    return layer.module.clone(parent=None, mask=mask).apply({"params": variables["params"]}, x)
  nnz = None
  if isinstance(layer.spec, BlockSparse):
    nnz = variables["params"]["kernel"].shape[0]
  module = sparse_module_of(layer, nnz=nnz)
  if layer.kind != "general":
    return module.apply(variables, x)
  n_in = len(layer.in_dims)
  if jnp.ndim(x) < n_in or tuple(jnp.shape(x)[-n_in:]) != tuple(layer.in_dims):
    raise ValueError(f"x must have shape (..., {', '.join(map(str, layer.in_dims))}) (the trailing axes this "
                     f"nn.DenseGeneral contracts), got x.shape={tuple(jnp.shape(x))}.")
  batch = x.shape[: x.ndim - n_in]
  y = module.apply(variables, x.reshape(*batch, layer.shape_2d[0]))
  return y.reshape(*batch, *layer.features)


def embed_variables(spec: NM, dense: Mapping, mask: np.ndarray | None = None) -> dict:
  """The (unboxed) variables of a ``CompressedNMEmbed`` from its ``nn.Embed``'s parameters: the table pruned to
  ``spec`` (or to ``mask``) and compressed, transposed. An abstract or traced table (``jax.eval_shape`` of
  ``SparsifiedLinen.init``) gives abstract or traced ones."""
  table = dense["embedding"]
  compress = functools.partial(compress_table, n=spec.n, m=spec.m, mask=mask)
  if isinstance(table, jax.ShapeDtypeStruct):
    compress = functools.partial(jax.eval_shape, compress)
  w = compress(table)
  return {"params": {"embedding": w.values}, sparse_linen.SPARSITY: {"embedding_positions": w.indices}}


def kept_blocks(layer_vars: Mapping, spec: Spec) -> int | None:
  """The kept blocks of a ``BlockSparse`` layer's variables (its ``BlockSparseDense``'s ``nnz``); else ``None``."""
  return layer_vars["params"]["kernel"].shape[0] if isinstance(spec, BlockSparse) else None


def linen_density(spec: Spec, layer_vars: Mapping, kernel_shape: tuple[int, ...], *,
                  weight_mask: Any = None, mask: np.ndarray | None = None) -> float | None:
  """The fraction of a ``(K, N)`` kernel that a sparse layer's (unboxed) variables keep; ``weight_mask``: an N:M
  conv's own Flax weight mask, after which groups may keep fewer than ``n``; ``mask``: the mask given for the layer.
  ``None`` (unknown) where that count depends on traced values (an N:M conv's traced weight mask, an unstructured mask
  ranked from traced weights), as under ``jax.eval_shape``; a mask with values is counted there too."""
  if isinstance(spec, NM):  # the nonzero weights the pattern keeps (a mask given may keep fewer than n of a group)
    return nm_density(layer_vars["params"]["kernel"], spec.n, spec.m, transposable=spec.transposable,
                      weight_mask=weight_mask, mask=mask)
  if isinstance(spec, BlockSparse):
    k, n = kernel_shape
    return layer_vars["params"]["kernel"].shape[0] / ((k // spec.block_shape[0]) * (n // spec.block_shape[1]))
  mask = layer_vars[sparse_linen.SPARSITY]["mask"]
  kept = masked_kept_count(mask)
  return None if kept is None else kept / math.prod(mask.shape)


def _linen_variables(spec: Spec, dense_params: Mapping, mask: np.ndarray | None, path: str) -> dict:
  kernel = jnp.asarray(dense_params["kernel"])
  bias = {"bias": dense_params["bias"]} if "bias" in dense_params else {}
  if isinstance(spec, BlockSparse):
    nnz_blocks = None
    if mask is None:
      block_mask = block_magnitude_mask(kernel, spec.block_shape, spec.density)
      if is_concrete(block_mask):
        block_mask = np.asarray(block_mask)
      else:  # traced (SparsifiedLinen.init under jax.eval_shape): the block count is the rule's
        kb, nb = kernel.shape[0] // spec.block_shape[0], kernel.shape[1] // spec.block_shape[1]
        nnz_blocks = _utils.kept_count(spec.density, kb * nb)
    else:
      block_mask = block_mask_of(mask, spec.block_shape, path)
    w = BlockSparseMatrix.from_dense(kernel, spec.block_shape, block_mask=block_mask, nnz_blocks=nnz_blocks)
    return {"params": {"kernel": w.data, **bias}, sparse_linen.SPARSITY: dict(w.index_arrays())}
  if isinstance(spec, NM):
    if mask is not None:
      check_nm_mask(mask, spec, mask.ndim - 2 if mask.ndim > 2 else 0, path)
      kernel = jnp.where(mask, kernel, jnp.zeros((), kernel.dtype))
    return {"params": {"kernel": kernel, **bias}}
  # A mask given, or ranked from concrete weights, keeps its values under a trace (jax.eval_shape): its count is known.
  with eager_if_concrete(dense_params["kernel"] if mask is None else mask):
    mask = jnp.asarray(magnitude_mask(dense_params["kernel"], spec.sparsity) if mask is None else mask)
  return {"params": {"kernel": jnp.where(mask, kernel, jnp.zeros((), kernel.dtype)), **bias},
          sparse_linen.SPARSITY: {"mask": mask}}


def _params_2d(layer: _LinenLayer, dense_params: Mapping) -> Mapping:
  """The parameters of the 2-D sparse layer: an ``nn.DenseGeneral``'s flattened to ``(K, N)`` and ``(N,)``."""
  if layer.kind != "general":
    return dense_params
  with eager_if_concrete(*dense_params.values()):  # concrete weights stay so under a trace: masks from them counted
    return {k: v.reshape(layer.shape_2d if k == "kernel" else -1) for k, v in dense_params.items()}


def sparse_variables(layer: _LinenLayer, dense_params: Mapping, mask: np.ndarray | None, where: str) -> tuple[
    dict, list[dict]]:
  """The (unboxed) variables of ``layer``'s sparse layer from its dense parameters, pruned to ``mask`` (the kernel's
  shape) or by magnitude, and each layer's: a stack's (``layer.stack``) layers each from its own slice (layer ``i``
  named ``f"{where}[i]"`` in errors), stacked; ``[variables]`` for one layer."""

  def one(params: Mapping, m: np.ndarray | None, w: str) -> dict:
    params_2d = _params_2d(layer, params)
    if layer.kind == "general" and m is not None:  # the 2-D layer on flattened features
      check_general_mask_view(m, layer.spec, len(layer.in_dims), w)
      m = m.reshape(layer.shape_2d)
    check_spec_applies(layer.spec, params_2d["kernel"].shape, path=w)
    return at_path(w, _linen_variables, layer.spec, params_2d, m, w)

  if not layer.stack:
    layer_vars = one(dense_params, mask, where)
    return layer_vars, [layer_vars]

  def differ(results: list[dict]) -> str:
    if isinstance(layer.spec, BlockSparse):
      (k, n), (bk, bn) = layer.shape_2d, layer.spec.block_shape
      return block_counts_message(where, [kept_blocks(r, layer.spec) for r in results], layer.stack,
                                  (k // bk) * (n // bn))
    return f"{where}: the sparse layers of this stack differ in their structure or shapes; map this path to None."

  return map_layers(one, layer.stack, (dense_params, mask), where, differ)


def layer_density(layer: _LinenLayer, per_layer: list[dict], mask: np.ndarray | None) -> float | None:
  """The fraction of the layer's kernel (of a stack's: of all its layers', ``per_layer`` their variables) that the
  sparse variables keep; ``None`` where a layer's is unknown."""
  densities = []
  for index, layer_vars in zip(np.ndindex(*layer.stack), per_layer, strict=True):
    m = None if mask is None else mask[index]
    if m is not None and layer.kind == "general":  # the mask of the 2-D layer on flattened features
      m = m.reshape(layer.shape_2d)
    densities.append(linen_density(layer.spec, layer_vars, layer.shape_2d,
                                   weight_mask=getattr(layer.module, "mask", None), mask=m))
  return None if any(d is None for d in densities) else float(np.mean(densities))


def layer_variables(variables: Mapping, path: tuple) -> dict:
  """The variables of the layer at ``path`` (its scope's ``params`` and ``"sparsity"`` entries), as the layer's own
  ``apply`` takes them."""
  out = {"params": _nested_get(variables["params"], path)}
  pattern = variables.get(sparse_linen.SPARSITY, {})
  try:
    out[sparse_linen.SPARSITY] = _nested_get(pattern, path)
  except KeyError:  # 2:4 layers keep no pattern
    pass
  return out


def dense_params(layer: _LinenLayer, layer_vars: Mapping) -> dict:
  """The dense parameters of a sparse layer (:func:`layer_variables`): its original layer's shapes, zeros where
  pruned, and the dense parameters' partitioning boxes. A stack's (``layer.stack``): each layer's, stacked."""
  if layer.stack:
    name = layer.module.name or type(layer.module).__name__
    p, _ = map_layers(lambda v, _: dense_params(layer.one_layer(), v), layer.stack, (nn.meta.unbox(layer_vars),),
                      name, lambda _: f"{name}: the layers of this stack differ in shapes.")
    return {k: layer.boxes[k].replace_boxed(v) if k in layer.boxes else v for k, v in p.items()}
  p = nn.meta.unbox(layer_vars["params"])
  if layer.kind == "embed":  # the table, back from its compressed transpose
    if sparse_linen.SPARSITY not in layer_vars:
      raise ValueError(f"{layer.module.name or type(layer.module).__name__}: a CompressedNMEmbed's variables need "
                       f"their {sparse_linen.SPARSITY!r} collection (embedding_positions); pass all the variables.")
    idx = nn.meta.unbox(layer_vars[sparse_linen.SPARSITY]["embedding_positions"])
    table = NMSparseMatrix(p["embedding"], idx, shape=(*layer.in_dims, *layer.features), n=layer.spec.n,
                           m=layer.spec.m, axis=0).to_dense().T
    return {"embedding": layer.boxes["embedding"].replace_boxed(table) if "embedding" in layer.boxes else table}
  kernel = p["kernel"]
  if isinstance(layer.spec, BlockSparse):
    idx = nn.meta.unbox(layer_vars[sparse_linen.SPARSITY])
    kernel = BlockSparseMatrix.from_index_arrays(kernel, dict(idx), shape=layer.shape_2d,
                                                 block_shape=layer.spec.block_shape).to_dense()
  elif layer.compressed:
    if sparse_linen.SPARSITY not in layer_vars:
      raise ValueError(f"{layer.module.name or type(layer.module).__name__}: a CompressedNMDense's variables need "
                       f"their {sparse_linen.SPARSITY!r} collection (kernel_positions); pass all the variables.")
    idx = nn.meta.unbox(layer_vars[sparse_linen.SPARSITY]["kernel_positions"])
    kernel = NMSparseMatrix(kernel, idx, shape=layer.shape_2d, n=layer.spec.n, m=layer.spec.m).to_dense()
  elif isinstance(layer.spec, NM):
    # The weights NMDense / NMConv keep: a conv's own weight mask multiplies the kernel before the N:M pruning (its
    # values, not just its zeros, rank the weights); the dense module, the same conv, multiplies by it again.
    spec = layer.spec
    mask = nm_kept_mask(kernel, spec.n, spec.m, transposable=spec.transposable,
                        weight_mask=getattr(layer.module, "mask", None))
    kernel = jnp.where(mask, kernel, jnp.zeros((), kernel.dtype))
  else:
    mask = pattern_mask(nn.meta.unbox(layer_vars[sparse_linen.SPARSITY]["mask"]), jnp.shape(kernel))
    kernel = jnp.where(mask, kernel, jnp.zeros((), kernel.dtype))
  p = {**p, "kernel": kernel}
  if layer.kind == "general":
    p = {k: v.reshape((*layer.in_dims, *layer.features) if k == "kernel" else layer.features) for k, v in p.items()}
  return {k: layer.boxes[k].replace_boxed(v) if k in layer.boxes else v for k, v in p.items()}


def compressed_variables(layer: _LinenLayer, layer_vars: Mapping) -> dict:
  """The (unboxed) variables of ``layer``'s ``CompressedNMDense`` from those of its ``NMDense``: the kernel pruned
  as ``NMDense`` prunes it, then compressed along the input features. An abstract kernel (``jax.ShapeDtypeStruct``,
  e.g. of ``jax.eval_shape(sparse.init, ...)``) gives abstract values and positions. A stack's: each layer's,
  stacked."""
  if layer.stack:
    name = layer.module.name or type(layer.module).__name__

    def each(v: Mapping) -> dict:
      return map_layers(lambda one, _: compressed_variables(layer.one_layer(), one), layer.stack, (v,), name,
                        lambda _: f"{name}: the layers of this stack differ.")[0]

    v = nn.meta.unbox(layer_vars)
    abstract = any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(v))
    return jax.eval_shape(each, v) if abstract else each(v)
  spec = layer.spec
  p = nn.meta.unbox(layer_vars["params"])
  compress = functools.partial(_compress_nm, n=spec.n, m=spec.m, transposable=spec.transposable)
  if isinstance(p["kernel"], jax.ShapeDtypeStruct):
    compress = functools.partial(jax.eval_shape, compress)
  values, positions = compress(p["kernel"])
  return {"params": {**p, "kernel": values}, sparse_linen.SPARSITY: {"kernel_positions": positions}}


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _compress_nm(kernel: jax.Array, n: int, m: int, transposable: bool) -> tuple[jax.Array, jax.Array]:
  """The kept values and packed positions of ``kernel`` pruned as ``NMDense`` prunes it (one compile per shape)."""
  mask = nm_mask(kernel, n, m, axis=0, transposable=transposable)
  w = NMSparseMatrix.from_dense(jnp.where(mask, kernel, jnp.zeros((), kernel.dtype)), n, m)
  return w.values, w.indices


def densify_layers(variables: Mapping, layers: Mapping[tuple, _LinenLayer]) -> dict:
  """New variables with the sparse layers of ``layers`` (some of a ``SparsifiedLinen``'s, by path) dense."""
  new_vars = _to_dict(variables)
  for path, layer in layers.items():
    layer_vars = layer_variables(new_vars, path)
    densify = functools.partial(dense_params, layer)
    if any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(layer_vars)):
      densify = functools.partial(jax.eval_shape, densify)  # abstract variables (a restore target): abstract result
    _nested_set(new_vars["params"], path, at_path(".".join(path) or "(the model itself)", densify, layer_vars))
    _drop(new_vars.get(sparse_linen.SPARSITY, {}), path)
  if sparse_linen.SPARSITY in new_vars and not jax.tree.leaves(new_vars[sparse_linen.SPARSITY]):
    del new_vars[sparse_linen.SPARSITY]
  return new_vars


def _drop(tree: dict, path: tuple) -> None:
  if not path:
    tree.clear()
    return
  node = tree
  for k in path[:-1]:
    node = node.get(k, {})
  node.pop(path[-1], None)
