"""What the layers of Linen variables are, for the torch export: the variables alone do not always say it.

An ``NMDense`` / ``NMConv`` (and an NNX ``NMLinear`` / ``NMConv`` under ``nnx.bridge.ToLinen``) holds the variables of
an ``nn.Dense`` / ``nn.Conv`` (its N:M mask follows the kernel), the packed positions of a ``CompressedNMDense`` /
``CompressedNMEmbed`` do not say their ``n:m``, an ``nn.DenseGeneral``'s kernel of ndim >= 3 looks like a conv's, and
so does the kernel of a stack of ``MaskedDense`` layers (``nn.scan`` / ``nn.vmap``). The module says it: the plan of a
``SparsifiedLinen`` (:func:`jaxsparse.sparsify_linen`), or, for any other Linen module, its layers as
``module.apply(variables, *example_inputs)`` calls them (traced with ``jax.eval_shape``, as :func:`jaxsparse.summary`
finds them).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx

from jaxsparse import layers as jsl
from jaxsparse._sparsify._linen import SparsifiedLinen
from jaxsparse.formats._specs import NM
from jaxsparse.formats._specs import BlockSparse
from jaxsparse.layers import linen as sparse_linen

__all__ = ["LinenLayer", "check_one_layer", "linen_layers"]


@dataclasses.dataclass(frozen=True)
class LinenLayer:
  """One Linen layer as the exporter needs it.

  Attributes:
    name: the layer's class, for messages (``"NMDense"``, ``"nn.Conv"``, ...).
    kind: ``"dense"``, ``"general"`` (``nn.DenseGeneral``), ``"conv"``, ``"embed"`` or ``"other"``.
    nm: the ``NM`` rule of an N:M layer (its mask follows the kernel, or its positions are packed), else ``None``.
    in_ndim: a ``"general"`` layer's number of contracted (leading) kernel axes.
    features: a ``"general"`` layer's output dims (the kernel's trailing axes).
    weight_mask: a conv's own Flax weight mask (``nn.Conv`` / ``NMConv`` multiply the kernel by it), or ``None``.
    leaf: the variable whose axes tell one layer from a stack (``"kernel"``, ``"embedding"``), or ``None``.
    ndim: the number of axes of ``leaf`` for one layer.
  """

  name: str
  kind: str
  nm: NM | None = None
  in_ndim: int | None = None
  features: tuple[int, ...] = ()
  weight_mask: Any = None
  leaf: str | None = None
  ndim: int | None = None


def _sparsified_layers(module: Any) -> dict[str, LinenLayer]:
  """The layers of a ``SparsifiedLinen``: those of its plan, and those it runs as they are (an ``nn.DenseGeneral``'s
  kernel of ndim >= 3 would read as a conv's), by dotted path."""
  out = {}
  for path, m in module.dense_layers.items():
    layer = _layer_of(m)
    if layer is not None:
      out[".".join(str(p) for p in path)] = layer
  for path, plan in module.layers.items():
    conv = plan.kind == "conv"
    # The axes of one layer's stored kernel (table); a stack's (sparsify_linen of an nn.scan over layers) has more.
    # An nn.DenseGeneral's dense kernel (densify_linen's variables) keeps its (*in_dims, *features) axes.
    ndim = 3 if isinstance(plan.spec, BlockSparse) else 2
    if conv:
      ndim = _ndim(plan.module.kernel_size) + 2
    elif plan.kind == "general":
      ndim = max(ndim, len(plan.in_dims) + len(plan.features))
    leaf = "embedding" if plan.kind == "embed" else "kernel"
    out[".".join(str(p) for p in path)] = LinenLayer(
        type(plan.module).__name__, plan.kind, plan.spec if isinstance(plan.spec, NM) else None,
        in_ndim=len(plan.in_dims), features=tuple(plan.features),
        weight_mask=getattr(plan.module, "mask", None) if conv else None, leaf=leaf, ndim=ndim)
  return out


def _ndim(kernel_size: int | Sequence[int]) -> int:
  return 1 if isinstance(kernel_size, int) else len(kernel_size)


def _bridged(m: nnx.bridge.ToLinen) -> LinenLayer | None:
  """The N:M structure of the NNX ``NMLinear`` / ``NMConv`` an ``nnx.bridge.ToLinen`` builds (its arguments, with its
  constructor's defaults); ``None`` for other NNX layers (their ``"sparsity"`` variables say what they are)."""
  cls = m.nnx_class
  if not (isinstance(cls, type) and issubclass(cls, jsl.NMLinear | jsl.NMConv)):
    return None
  bound = inspect.signature(cls.__init__).bind_partial(None, *m.args, **m.kwargs)
  bound.apply_defaults()
  arg = bound.arguments
  nm = NM(arg["n"], arg["m"], transposable=arg["transposable"])
  if issubclass(cls, jsl.NMConv):
    return LinenLayer(cls.__name__, "conv", nm, weight_mask=arg.get("mask"))
  return LinenLayer(cls.__name__, "dense", nm)


def _layer_of(m: nn.Module) -> LinenLayer | None:
  """What ``m`` is, if the exporter needs to know; ``None`` for other modules."""
  name = type(m).__name__
  if isinstance(m, sparse_linen.NMDense | sparse_linen.CompressedNMDense):
    return LinenLayer(name, "dense", NM(m.n, m.m, transposable=getattr(m, "transposable", False)), leaf="kernel",
                      ndim=2)
  if isinstance(m, sparse_linen.NMConv):
    return LinenLayer(name, "conv", NM(m.n, m.m, transposable=m.transposable), weight_mask=m.mask, leaf="kernel",
                      ndim=_ndim(m.kernel_size) + 2)
  if isinstance(m, sparse_linen.CompressedNMEmbed):
    return LinenLayer(name, "embed", NM(m.n, m.m), leaf="embedding", ndim=2)
  if isinstance(m, nnx.bridge.ToLinen):
    return _bridged(m)
  if isinstance(m, nn.DenseGeneral):
    if m.batch_dims:  # no torch Linear form: read by its shapes, as without module=
      return None
    axis = (m.axis,) if isinstance(m.axis, int) else tuple(m.axis)
    features = (m.features,) if isinstance(m.features, int) else tuple(m.features)
    return LinenLayer("nn.DenseGeneral", "general", in_ndim=len(axis), features=features, leaf="kernel",
                      ndim=len(axis) + len(features))
  if isinstance(m, nn.Dense | sparse_linen.MaskedDense):
    return LinenLayer(name if isinstance(m, sparse_linen.MaskedDense) else "nn.Dense", "dense", leaf="kernel", ndim=2)
  if isinstance(m, sparse_linen.BlockSparseDense):
    return LinenLayer(name, "dense", leaf="kernel", ndim=3)  # its kept blocks (nnz_blocks, bk, bn)
  if isinstance(m, nn.Conv):
    return LinenLayer("nn.Conv", "conv", weight_mask=m.mask, leaf="kernel", ndim=_ndim(m.kernel_size) + 2)
  if isinstance(m, nn.Embed):
    return LinenLayer("nn.Embed", "embed", leaf="embedding", ndim=2)
  return None


def _traced_layers(module: nn.Module, variables: Mapping, inputs: Sequence[Any]) -> dict[str, LinenLayer]:
  """The layers ``module.apply(variables, *inputs)`` calls, by dotted scope path (traced: nothing is computed)."""
  found: dict[str, LinenLayer] = {}

  def record(next_fun, args, kwargs, context):
    if context.method_name in ("__call__", "attend"):
      layer = _layer_of(context.module)
      if layer is not None:
        found.setdefault(".".join(str(p) for p in context.module.scope.path), layer)
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    jax.eval_shape(lambda v, *a: module.apply(v, *a), dict(variables), *inputs)
  return found


def linen_layers(module: Any, variables: Mapping, inputs: Sequence[Any], *, caller: str) -> dict[str, LinenLayer]:
  """``{dotted path: LinenLayer}`` of the layers of ``module`` (``{}`` without one).

  Args:
    module: ``None``, the ``SparsifiedLinen`` of :func:`jaxsparse.sparsify_linen` / :func:`jaxsparse.compress_linen`
      (its plan), or any Linen module (traced on ``inputs``).
    variables: the Linen variables (boxed or not) ``module.apply`` takes.
    inputs: the example inputs of ``module.apply`` after the variables (arrays or ``jax.ShapeDtypeStruct``).
    caller: the public function, for messages.

  Raises:
    TypeError: ``module`` is not a Linen module; inputs without a module; a module other than a ``SparsifiedLinen``
      without inputs.
  """
  if module is None:
    if inputs:
      raise TypeError(f"{caller}: example inputs are for module.apply: pass module= (the Linen module of the "
                      "variables) too, or no inputs.")
    return {}
  if isinstance(module, SparsifiedLinen):
    return _sparsified_layers(module)
  if not isinstance(module, nn.Module):
    raise TypeError(f"{caller}: module must be the Linen module of the variables (or the SparsifiedLinen of "
                    f"jaxsparse.sparsify_linen), got {type(module).__name__}.")
  if not inputs:
    raise TypeError(
        f"{caller}: module={type(module).__name__} needs the example inputs of its apply (arrays or "
        f"jax.ShapeDtypeStruct, only traced) to find its N:M layers: {caller}(variables, x, module=model)."
    )
  return _traced_layers(module, variables, inputs)


def check_one_layer(fp: str, layer: LinenLayer | None, leaves: Mapping) -> None:
  """Raises a ``ValueError`` when the variables of the layer at ``fp`` hold a stack of layers (``nn.scan`` /
  ``nn.vmap``: leading layer axes), for which a torch state dict has no form."""
  if layer is None or layer.leaf not in leaves or layer.ndim is None:
    return
  shape = tuple(np.shape(leaves[layer.leaf]))
  if len(shape) > layer.ndim:
    extra = len(shape) - layer.ndim
    raise ValueError(
        f"{fp or '(the variables)'}: this {layer.name}'s {layer.leaf} has shape {shape}, {extra} leading axis/axes "
        f"more than one layer's {layer.ndim}: a stack of layers (nn.scan / nn.vmap), which a torch state dict has no "
        "form for. Export one layer at a time: the variables of layer i are jax.tree.map(lambda a: a[i], ...) of "
        "the stacked subtrees (with torch_names= naming its torch module)."
    )
