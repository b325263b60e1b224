"""``densify`` and ``compress``: an NNX model's sparse layers turned back into dense Flax layers, or its N:M layers into
their inference form (the Linen twins: :func:`~jaxsparse.densify_linen`, :func:`~jaxsparse.compress_linen`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import bridge

from jaxsparse import _utils
from jaxsparse._rules import path_str
from jaxsparse._rules import replace_module
from jaxsparse._sparsify._stacks import dense_stack
from jaxsparse.formats._masks import replicated
from jaxsparse.formats._specs import NM
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import CompressedNMEmbed
from jaxsparse.layers import CompressedNMLinear
from jaxsparse.layers import MaskedConv
from jaxsparse.layers import MaskedLinear
from jaxsparse.layers import NMConv
from jaxsparse.layers import NMLinear
from jaxsparse.layers import SparseLinearGeneral
from jaxsparse.layers import SparsityPattern
from jaxsparse.layers._common import dense_linear
from jaxsparse.sharding import TensorParallelBlockSparseLinear

__all__ = ["SPARSE_NNX", "bridged_linen", "compress", "densify", "holds_dense_layers", "is_abstract"]

SPARSE_NNX = (BlockSparseLinear, MaskedLinear, NMLinear, NMConv, CompressedNMLinear, MaskedConv, SparseLinearGeneral,
              CompressedNMEmbed, TensorParallelBlockSparseLinear)
"""The NNX layer classes of jaxsparse that :func:`densify` turns back into dense Flax layers."""


def _tensor_parallel_dense(layer: TensorParallelBlockSparseLinear) -> nnx.Linear:
  """The ``nnx.Linear`` of a ``TensorParallelBlockSparseLinear``'s unsplit weight and bias: each shard's blocks made
  dense (without the zero blocks that pad the shards to one count) and laid side by side along the split.

  On the values as they are, also traced (an abstract model, under ``jit``), where ``to_block_sparse_linear`` builds
  the unsplit block mask on the host. Values split over explicit mesh axes are gathered; the dense layer has no
  partitioning names (the split layer's name no dim of the dense kernel, only the axis of its shards).
  """
  w = layer.sharded_kernel  # raises, naming both sizes, for a state laid out for another size of the mesh axis
  shards = jax.tree.map(replicated, w.shards)
  valid = replicated(w.source) >= 0
  data = jnp.where(valid[..., None, None], shards.data, jnp.zeros((), shards.dtype))
  local = jax.vmap(lambda shard, d: shard.with_data(d).to_dense())(shards, data)  # (shards, *one shard's shape)
  k, n = w.shape
  kernel = local.transpose(1, 0, 2).reshape(k, n) if w.split == "columns" else local.reshape(k, n)
  bias = None if layer.bias is None else replicated(layer.bias[...])
  return dense_linear(kernel, bias, dtype=layer.dtype, precision=layer.precision)


def _dense_of(node: nnx.Module) -> nnx.Module:
  """The dense Flax layer of a jaxsparse layer (one of :data:`SPARSE_NNX`): its ``to_dense()``, which carries the
  partitioning names back; of a stack of layers (``nnx.vmap``), the stack of each layer's."""
  if isinstance(node, TensorParallelBlockSparseLinear):
    return _tensor_parallel_dense(node)
  return dense_stack(node, lambda layer: layer.to_dense())


def is_abstract(model: Any) -> bool:
  """Whether ``model`` (an ``nnx.Module``, or Linen variables) has abstract variables (``jax.ShapeDtypeStruct``, from
  ``nnx.eval_shape`` / ``jax.eval_shape``)."""
  tree = nnx.state(model) if isinstance(model, nnx.Module) else model
  return any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(tree))


def densify(model: nnx.Module, *, inplace: bool = False) -> nnx.Module:
  """Replaces every jaxsparse layer of an NNX model by the dense Flax layer computing the same function.

  ``BlockSparseLinear`` / ``MaskedLinear`` / ``NMLinear`` / ``CompressedNMLinear`` become ``nnx.Linear``,
  ``NMConv`` / ``MaskedConv`` become ``nnx.Conv``, ``SparseLinearGeneral`` becomes ``nnx.LinearGeneral``,
  ``CompressedNMEmbed`` becomes ``nnx.Embed``; pruned weights are zeros in the dense kernels (tables). A
  :class:`jaxsparse.sharding.TensorParallelBlockSparseLinear` becomes the ``nnx.Linear`` of its unsplit weight and
  bias (the zero blocks that pad its shards left out), without partitioning names: the dense layer is not split.

  Each layer becomes its own ``to_dense()``, which gives the partitioning names (``nnx.with_partitioning``) back: each
  dense kernel (table) and bias takes the names the dense layer had before :func:`sparsify` (and :func:`compress`),
  kept in the sparse variables' metadata where their own names cannot tell them (block-sparse values, a
  ``LinearGeneral`` kernel folded to 2-D), and is placed on the mesh like the sparse value it comes from (a
  block-sparse kernel, replicated there, is split by its names). A ``SparseLinearGeneral`` built directly gives each
  of its names back on the leading dim of its group; a ``BlockSparseLinear`` built directly gives none (its
  ``(blocks, bk, bn)`` names do not map onto ``(K, N)``).

  A stack of sparse layers (built by ``nnx.vmap``, or by :func:`sparsify` from a stack of ``nnx.Linear``: leading layer
  axes) becomes the stack of their dense layers, each layer's ``to_dense()`` under one ``nnx.vmap`` per layer axis (the
  stack's axis names, ``transform_metadata``, taken off inside and put back on), which ``nnx.scan`` / ``nnx.vmap``
  call as they called the sparse stack.

  >>> import jax.numpy as jnp, jaxsparse
  >>> from flax import nnx
  >>> model = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)))
  >>> sparse, _ = jaxsparse.sparsify(model, jaxsparse.Unstructured(sparsity=0.5))
  >>> dense = jaxsparse.densify(sparse)
  >>> type(dense.layers[0]).__name__, float(jnp.mean(dense.layers[0].kernel[...] == 0))
  ('Linear', 0.5)

  Args:
    model: an ``nnx.Module``: a jaxsparse layer itself or a model containing some.
    inplace: replace the layers of ``model`` itself instead of a copy (``nnx.clone``). A ``model`` that is
      itself a jaxsparse layer cannot be replaced in place: its dense twin is returned either way.

  Returns:
    The model with dense layers (``model`` itself with ``inplace``, else a copy); the kernels have the dense
    layers' shapes and the sparse layers' dtypes, with zeros at the pruned weights. An abstract model (from
    ``nnx.eval_shape``, an orbax restore target) gives the abstract dense model, always a new one.

  Raises:
    TypeError: ``model`` is not an ``nnx.Module``.
    ValueError: ``model`` holds a ``flax.nnx.bridge.ToNNX`` with jaxsparse Linen layers (a ``"sparsity"`` collection,
      or a :func:`jaxsparse.sparsify_linen` model), which densify cannot reach; :func:`jaxsparse.densify_linen` them
      before wrapping. A ``TensorParallelBlockSparseLinear`` whose state was laid out for another size of its mesh
      axis (its ``resplit()`` lays it out again).
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}.")
  from jaxsparse._sparsify._linen import SparsifiedLinen  # noqa: PLC0415 (it imports this module)

  bridged = bridged_linen(model, lambda node: holds_variable(node, SparsityPattern) or (
      isinstance(node.to_nnx__module, SparsifiedLinen) and bool(node.to_nnx__module.layers)))
  if bridged:  # they would stay sparse, without a word
    raise ValueError(
        f"densify cannot densify the jaxsparse Linen layers inside flax.nnx.bridge.ToNNX: {', '.join(bridged)}. "
        "Densify them on the Linen side before wrapping the module: module, variables = "
        "jaxsparse.densify_linen(sparse, variables) for a model from jaxsparse.sparsify_linen."
    )
  if is_abstract(model):
    # Abstract variables (the layers' to_dense read their arrays): the same conversion, traced for shapes only.
    return nnx.eval_shape(lambda m: densify(m, inplace=True), model)
  if not inplace:
    model = nnx.clone(model)
  if isinstance(model, SPARSE_NNX):
    return _dense_of(model)
  found = {tuple(path) for path, node in nnx.iter_modules(model) if path and isinstance(node, SPARSE_NNX)}
  outermost = [p for p in found if not any(p[:i] in found for i in range(1, len(p)))]
  modules = {tuple(p): m for p, m in nnx.iter_modules(model)}
  for path in outermost:
    replace_module(model, path, _dense_of(modules[path]))
  return model


def bridged_linen(model: nnx.Module, holds: Callable[[bridge.ToNNX], bool]) -> list[str]:
  """Each ``flax.nnx.bridge.ToNNX`` inside ``model`` (``model`` itself included) that ``holds`` is true of, as
  ``"path (wrapping <Linen module class>)"``: Linen layers, which the NNX conversions (:func:`densify`,
  :func:`compress`, :func:`jaxsparse.sparsify`) do not see."""
  return [f"{path_str(path) or '(the model itself)'} (wrapping {type(node.to_nnx__module).__name__})"
          for path, node in nnx.iter_modules(model) if isinstance(node, bridge.ToNNX) and holds(node)]


def holds_variable(node: nnx.Module, variable: type[nnx.Variable], names: tuple[str, ...] | None = None) -> bool:
  """Whether ``node`` holds a ``variable`` (named one of ``names``, if given)."""
  return any(names is None or key[-1] in names for key, _ in nnx.to_flat_state(nnx.state(node, variable)))


def holds_dense_layers(node: nnx.Module) -> bool:
  """Whether ``node`` holds a ``kernel`` or ``embedding`` parameter: layers :func:`jaxsparse.sparsify` would take."""
  return holds_variable(node, nnx.Param, ("kernel", "embedding"))


def compress(model: nnx.Module, *, storage: str = "values", cusparselt_copy: bool = True,
             inplace: bool = False) -> nnx.Module:
  """Replaces every ``NMLinear`` of an NNX model by its :class:`~jaxsparse.layers.CompressedNMLinear`.

  The inference step of N:M training: :func:`sparsify` (or ``NMLinear`` built directly) gives layers that keep the
  dense kernel and prune it with SR-STE in every call; their compressed form stores only the kept values and their
  positions (2:4 in 16-bit: 0.5625x the dense bytes) and multiplies them on the N:M kernels (sparse tensor cores on
  a GPU). The outputs stay the same (up to the products' rounding). Layers held at several paths (tied) stay tied;
  an ``NMLinear`` inside a :class:`~jaxsparse.layers.SparseLinearGeneral` is compressed there. ``NMConv`` layers stay
  as they are (there is no compressed convolution), and so do layers already compressed (a second ``compress`` does
  not change their ``storage``: build those with :meth:`NMLinear.to_compressed`). Partitioning names
  (``nnx.with_partitioning``) carry over: the kept values take the kernel's, the packed positions its columns'. A stack
  of ``NMLinear`` layers (built by ``nnx.vmap``: kernel ``(*layers, K, N)``) becomes the stack of their compressed
  layers, each compressed on its own under ``nnx.vmap`` over the stack's leading axes (named as the kernel names them,
  ``transform_metadata``), which ``nnx.scan`` / ``nnx.vmap`` call as they called the stack.

  >>> import jax.numpy as jnp, jaxsparse
  >>> from flax import nnx
  >>> model = nnx.Sequential(nnx.Linear(64, 32, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(32, 8, rngs=nnx.Rngs(1)))
  >>> sparse, _ = jaxsparse.sparsify(model, jaxsparse.NM(2, 4))
  >>> small = jaxsparse.compress(sparse)
  >>> [type(layer).__name__ for layer in small.layers[::2]], small.layers[0].kernel.shape
  (['CompressedNMLinear', 'CompressedNMLinear'], (32, 32))
  >>> x = jnp.ones((4, 64))
  >>> bool(jnp.allclose(small(x), sparse(x), atol=1e-5))
  True

  Args:
    model: an ``nnx.Module``: an ``NMLinear`` itself or a model holding some.
    storage: how each layer keeps its kernel, as :meth:`NMLinear.to_compressed`'s ``storage``: ``"values"``
      (trainable values and positions), ``"cusparselt"`` or ``"auto"`` (one cuSPARSELt buffer where the GPU reads
      it; inference only).
    cusparselt_copy: with ``storage="values"``, also keep a cuSPARSELt copy of 2:4 bfloat16 kernels on a GPU
      (faster products of many rows, about twice the kernel's memory), as :meth:`NMLinear.to_compressed`'s.
    inplace: replace the layers of ``model`` itself instead of a copy (``nnx.clone``). A ``model`` that is itself an
      ``NMLinear`` cannot be replaced in place: its compressed form is returned either way.

  Returns:
    The model with ``CompressedNMLinear`` layers (``model`` itself with ``inplace``, else a copy).

  Raises:
    TypeError: ``model`` is not an ``nnx.Module``, or ``cusparselt_copy`` not a bool.
    ValueError: an unknown ``storage``; a layer that cannot be compressed (a custom ``dot_general``, a ``storage``
      its kernel does not fit; a stack whose kernel's trailing axes are not ``(in_features, out_features)``), naming
      its path; nothing is replaced then.
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}.")
  if storage not in ("values", "cusparselt", "auto"):  # checked here too: a model without NMLinear layers
    raise ValueError(f"storage must be 'values', 'cusparselt' or 'auto', got storage={storage!r}.")
  if not isinstance(cusparselt_copy, bool):
    raise TypeError(f"cusparselt_copy must be True or False, got cusparselt_copy={cusparselt_copy!r}.")
  from jaxsparse._sparsify._linen import SparsifiedLinen  # noqa: PLC0415 (it imports this module)

  bridged = bridged_linen(model, lambda node: isinstance(node.to_nnx__module, SparsifiedLinen) and any(
      layer.kind in ("dense", "general") and isinstance(layer.spec, NM) and not layer.compressed
      for layer in node.to_nnx__module.layers.values()))
  if bridged:
    _utils.warn_at_caller(
        f"compress does not see inside flax.nnx.bridge.ToNNX: the Linen layers of {', '.join(bridged)} stay as they "
        "are. Compress the Linen module before wrapping it: jaxsparse.compress_linen(sparse, variables).", UserWarning)
  if is_abstract(model):
    # Abstract variables (nnx.eval_shape; to_compressed reads the kernels' values): the same conversion, traced for
    # shapes only, as sparsify does for an abstract model.
    return nnx.eval_shape(lambda m: compress(m, storage=storage, cusparselt_copy=cusparselt_copy, inplace=True), model)
  if not inplace:
    model = nnx.clone(model)
  # to_compressed carries the kernel's and bias's partitioning names over (the kept values keep the kernel's, the
  # positions its columns').
  compressed_of = lambda node: node.to_compressed(storage=storage, cusparselt_copy=cusparselt_copy)
  if isinstance(model, NMLinear):
    return _compressed_stack(model, compressed_of)
  found = [(tuple(path), node) for path, node in nnx.iter_modules(model) if path and isinstance(node, NMLinear)]
  compressed = []
  for path, node in found:  # every layer first: an error leaves the model as it was
    try:
      compressed.append((path, _compressed_stack(node, compressed_of)))
    except ValueError as e:
      raise ValueError(f"{path_str(path)}: {e}") from e
  for path, new in compressed:
    replace_module(model, path, new)
  return model


def _compressed_stack(
    layer: NMLinear, compressed_of: Callable[[NMLinear], CompressedNMLinear]
) -> CompressedNMLinear:
  """``compressed_of(layer)``; for a stack of layers (``nnx.vmap``: kernel ``(*layers, K, N)``), the stack of each
  layer's, under one ``nnx.vmap`` per leading axis. The names of a named kernel's leading axes (the stack's axis
  name, ``transform_metadata``) come off inside and back on outside, as they did when the stack was built. Compressing
  the stack whole took its layer axis for the axis of the N:M groups (or refused a 3-D weight)."""
  shape = tuple(layer.kernel.shape)
  stack = shape[:-2]
  if not stack:
    return compressed_of(layer)
  if shape[-2:] != (layer.in_features, layer.out_features):
    raise ValueError(
        f"this NMLinear holds a kernel of shape {shape}, whose trailing axes are not the ({layer.in_features}, "
        f"{layer.out_features}) of its features: a stack of layers whose layer axes do not lead (nnx.vmap with "
        "out_axes other than 0)? Compress its layers one at a time under the transform that built it, e.g. "
        "nnx.vmap(lambda layer: layer.to_compressed(), in_axes=1, out_axes=1)(stack)."
    )
  names = layer.kernel.get_metadata().get("out_sharding")
  names = tuple(names) if names and len(names) == len(shape) else None  # named per layer: the stack axes are not
  f = compressed_of
  for axis in reversed(range(len(stack))):  # the outermost vmap takes the first layer axis
    metadata = {} if names is None else {"transform_metadata": {nnx.PARTITION_NAME: names[axis]}}
    f = nnx.vmap(f, in_axes=0, out_axes=0, **metadata)
  return f(layer)
