"""Helpers shared by the layer modules: the pattern variable, masks and kept counts, option copying, the checks of a
call's inputs and of a Linen layer's pattern (the constructors' argument checks: :mod:`._checks`).

Every NNX layer keeps its pattern in a :class:`SparsityPattern` variable; every Linen layer keeps it in
the :data:`SPARSITY` collection. The checks raise errors that name the argument and the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import typing
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import reprlib
from flax.nnx.nn import dtypes

from jaxsparse import _utils
from jaxsparse import ops
from jaxsparse.formats import _nm_masks
from jaxsparse.formats._base import is_concrete
from jaxsparse.formats._block_sparse import INDEX_FIELDS
from jaxsparse.formats._masks import replicated
from jaxsparse.formats._masks import top_k_mask
from jaxsparse.layers._checks import NM_LAYOUT
from jaxsparse.layers._checks import check_kept
from jaxsparse.layers._checks import check_positions
from jaxsparse.layers._checks import check_use_bias
from jaxsparse.layers._checks import layer_array
from jaxsparse.layers._partitioning import structure_metadata

__all__ = [
    "COMPRESSED_VALUES",
    "MissingPatternError",
    "NMPromote",
    "SPARSITY",
    "SparsityPattern",
    "base_promote",
    "bias_of",
    "bridged_block_pattern",
    "check_called_on_one_layer",
    "check_layer_inputs",
    "check_linear",
    "check_one_layer",
    "check_pattern",
    "compressed_kept_count",
    "conv_options",
    "copy_bias",
    "custom_options",
    "default_bias_init",
    "dense_linear",
    "eager_if_concrete",
    "init_linear_attributes",
    "kept_fraction",
    "kept_weights",
    "linear_options",
    "map_boxed",
    "masked_kept_count",
    "missing_pattern",
    "nm_kept_count",
    "nm_kept_mask",
    "pattern_mask",
    "pattern_variable",
    "random_mask",
    "unbox_init",
    "with_weights",
]

SPARSITY = "sparsity"

COMPRESSED_VALUES = "nm_compressed"
"""Metadata key of the ``nnx.Param`` that holds an N:M-compressed layer's kept values (``CompressedNMLinear.kernel``,
``CompressedNMEmbed.embedding``); its value is the layer's class name. It travels with the variable wherever the
layer's parameters go without the layer (``nnx.state(model, nnx.Param)``, what ``nnx.Optimizer`` hands its optimizer),
so that the pruners refuse to prune the values as if they were a dense weight. Checkpoints hold the arrays only: they
restore across layers with and without the mark. Metadata, not an ``nnx.Param`` subclass: under
``nnx.bridge.ToLinen`` a subclass would be a collection of its own, out of ``"params"`` (Flax names collections by
variable type); metadata puts the values in an ``NNXMeta`` box in ``"params"``, as it does a named kernel."""
default_bias_init = nnx.initializers.zeros_init()


class SparsityPattern(nnx.Variable):
  """Non-trainable sparsity structure of a layer: block index arrays or a boolean mask.

  Being neither an ``nnx.Param`` nor differentiable (integer or bool values), it is left alone by
  ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` and by ``nnx.grad``; filter it with
  ``nnx.split(model, nnx.Param, SparsityPattern)`` or ``nnx.state(model, SparsityPattern)``.
  Its ``repr`` shows shape and dtype, not the index values (see :func:`jaxsparse.summary` for the
  pattern in words). It is the NNX side of the Linen layers' ``"sparsity"`` collection: ``flax.nnx.bridge.ToNNX``
  holds that collection as ``SparsityPattern`` variables, and ``ToLinen`` puts them in it.

  >>> from flax import nnx
  >>> from jaxsparse.layers import MaskedLinear, SparsityPattern
  >>> layer = MaskedLinear(8, 4, sparsity=0.5, rngs=nnx.Rngs(0))
  >>> isinstance(layer.mask, SparsityPattern), layer.mask[...].dtype
  (True, dtype('bool'))
  >>> sorted(nnx.state(layer, SparsityPattern).keys()), sorted(nnx.state(layer, nnx.Param).keys())
  (['mask'], ['bias', 'kernel'])
  """

  # A compressed N:M layer's positions carry their layout (metadata ``nm_layout``, a ``_checks.NMLayout``): concrete
  # positions set into them are checked here, where a restore or an update sets them, not in the (jitted) forward.
  # Not in the pytree unflatten: every jit's outputs pass there, a new array per call.

  def set_value(self, value: Any, **kwargs: Any) -> None:
    """As ``nnx.Variable.set_value``; a compressed N:M layer's positions (``nm_layout`` metadata) are checked, and
    left as they were when the new ones are not valid for the layer's n:m."""
    layout = self.get_metadata(NM_LAYOUT, None)
    if layout is None:
      return super().set_value(value, **kwargs)
    old = self.get_raw_value()
    super().set_value(value, **kwargs)
    try:
      if self.get_raw_value() is not old:
        check_positions(layout, self.get_raw_value())
    except ValueError:
      self.set_raw_value(old)
      raise
    return None

  def set_raw_value(self, value: Any, **kwargs: Any) -> None:
    """As ``nnx.Variable.set_raw_value``; a compressed N:M layer's positions set by ``nnx.update`` from a plain array
    (a pure dict: ``to_pure_dict()``, orbax without a target) are checked as :meth:`update_from_state` checks a
    state's, and left as they were when not valid for the layer's n:m."""
    layout = self.get_metadata(NM_LAYOUT, None)
    # Flax's nnx.update sets a raw value with _unsafe_bypass_check=True, and only there: the transforms write their
    # outputs back without it (a new array per call), which stay unchecked as in update_from_state's comment.
    if layout is None or not kwargs.get("_unsafe_bypass_check", False) or value is self.get_raw_value():
      return super().set_raw_value(value, **kwargs)
    check_positions(layout, value)
    return super().set_raw_value(value, **kwargs)

  def update_from_state(self, variable_state: nnx.Variable) -> None:
    """As ``nnx.Variable.update_from_state`` (what ``nnx.update`` calls); a compressed N:M layer's positions are
    checked first, and keep the layer's layout whatever the state's metadata says (a state built without it)."""
    layout = self.get_metadata(NM_LAYOUT, None)
    if layout is None:
      return super().update_from_state(variable_state)
    value = variable_state.get_raw_value()
    if value is not self.get_raw_value():  # a transform writing back what it was given sets nothing new
      check_positions(layout, value)
    super().update_from_state(variable_state)
    if self.get_metadata(NM_LAYOUT, None) != layout:
      self.set_metadata(NM_LAYOUT, layout)
    return None

  def __nnx_repr__(self):
    for item in super().__nnx_repr__():
      if (isinstance(item, reprlib.Attr) and item.key == "value" and isinstance(item.value, (jax.Array, np.ndarray))
          and item.value.size > 1):
        item = reprlib.Attr("value", _ArrayRepr(tuple(jnp.shape(item.value)), jnp.result_type(item.value)))
      yield item


def pattern_variable(value: Any, kernel: nnx.Variable | None, name: str, *, blocks: bool = False) -> SparsityPattern:
  """A :class:`SparsityPattern` holding ``value`` (the array ``name`` of a layer's pattern), named from the layer's
  ``kernel`` variable where that is named (:func:`jaxsparse.layers._partitioning.structure_metadata`: a mask the
  kernel's names, block index arrays ``(None,)``), so that a stacking transform's ``transform_metadata`` gives it the
  stack axis, and placed as the kernel is (Flax's eager sharding). A concrete ``value`` stays concrete under a trace
  (``nnx.eval_shape``, ``nnx.jit``): the sharding constraint would make it a traced value, its kept count unknown.

  >>> import jax
  >>> from flax import nnx
  >>> from jaxsparse.layers import MaskedLinear
  >>> init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
  >>> with jax.set_mesh(jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))):
  ...   named = MaskedLinear(8, 4, sparsity=0.5, kernel_init=init, rngs=nnx.Rngs(0))
  >>> unnamed = MaskedLinear(8, 4, sparsity=0.5, rngs=nnx.Rngs(0))
  >>> named.mask.get_metadata()["out_sharding"], "out_sharding" in unnamed.mask.get_metadata()
  ((None, 'model'), False)
  """
  metadata = structure_metadata(kernel, name, jnp.ndim(value), blocks=blocks)
  with eager_if_concrete(value) if metadata else contextlib.nullcontext():
    return SparsityPattern(value, **metadata)


# The Linen collection of SparsityPattern, for flax.nnx.bridge: ToNNX turns a Linen layer's "sparsity" collection into
# SparsityPattern variables (else an anonymous "sparsity" Variable type that the SparsityPattern filter misses), and
# ToLinen puts an NNX layer's pattern in "sparsity" (else a "SparsityPattern" collection), as the Linen layers keep it.
# A name someone registered first is left as it is (flax raises a ValueError for it).
try:
  nnx.register_variable_name(SPARSITY, SparsityPattern)
except ValueError:
  pass


@dataclasses.dataclass(frozen=True, repr=False)
class _ArrayRepr(reprlib.Representable):
  shape: tuple[int, ...]
  dtype: Any

  def __nnx_repr__(self):
    yield reprlib.Object(type="Array", same_line=True)
    yield reprlib.Attr("shape", self.shape)
    yield reprlib.Attr("dtype", self.dtype)


def random_mask(key: jax.Array, shape: tuple[int, ...], kept: int) -> jax.Array:
  """A uniformly random bool mask of ``shape`` keeping exactly ``kept`` entries."""
  return top_k_mask(jax.random.uniform(key, shape), kept)


def kept_weights(sparsity: object, shape: tuple[int, ...]) -> int:
  """How many of the weights of ``shape`` a mask pruning ``round(sparsity * size)`` keeps (at least one)."""
  sparsity = _utils.check_sparsity(sparsity)
  size = math.prod(shape)
  kept = size - _utils.kept_count(sparsity, size)
  check_kept(kept, size, name="sparsity", value=sparsity, what="weights")
  return kept


def custom_options(layer: nnx.Module) -> list[str]:
  """The product options of an ``nnx.Linear`` / ``LinearGeneral`` set away from Flax's defaults (``dot_general``,
  ``promote_dtype``, ``preferred_element_type``): a layer that computes its product itself cannot honour them."""
  defaults = inspect.signature(type(layer).__init__).parameters
  return [name for name in ("dot_general", "promote_dtype", "preferred_element_type")
          if name in defaults and hasattr(layer, name) and getattr(layer, name) is not defaults[name].default]


def check_linear(linear: object, layer: str, *, options: bool = True) -> nnx.Linear:
  """``linear`` if ``layer`` (a class name) can be built from it: exactly an ``nnx.Linear``, with Flax's default
  product options unless ``options=False`` (``layer`` keeps them); else a ``TypeError`` / ``ValueError`` saying
  why."""
  if type(linear) is not nnx.Linear:
    what = type(linear).__name__
    if isinstance(linear, nnx.Linear):
      what += (" (a subclass of nnx.Linear: its call may add to the product of its kernel and bias, which "
               f"{layer} would drop; for a jaxsparse layer take .to_dense() first)")
    raise TypeError(f"linear must be a flax.nnx.Linear, got {what}.")
  custom = custom_options(linear) if options else []
  if custom:
    raise ValueError(f"{layer} cannot honour linear's {', '.join(custom)} (not Flax's default): it would compute "
                     "another product. Keep this layer dense, or use NMLinear, which keeps them.")
  return linear


def unbox_init(value: Any) -> Any:
  """An initializer's result out of the sharding box it may come in (see :func:`map_boxed`)."""
  if isinstance(value, nnx.VariableMetadata):
    return value.raw_value
  return value.unbox() if isinstance(value, nn.meta.AxisMetadata) else value


def map_boxed(value: Any, f: Callable[[jax.Array], jax.Array]) -> Any:
  """``f`` applied to an initializer's result inside the sharding box it may come in, which is kept:
  ``nnx.with_partitioning`` gives an ``nnx.VariableMetadata``, ``nn.with_partitioning`` an ``nn.Partitioned``."""
  if isinstance(value, nnx.VariableMetadata):
    return dataclasses.replace(value, raw_value=f(value.raw_value))
  if isinstance(value, nn.meta.AxisMetadata):
    return value.replace_boxed(f(value.unbox()))
  return f(value)


M = typing.TypeVar("M")


def with_weights(build: Callable[..., M], kernel: jax.Array, bias: jax.Array | None, /, *args: Any, **options) -> M:
  """``build(*args, **options)`` holding ``kernel`` (its dtype as ``param_dtype``) and, if given, ``bias`` (in its
  own dtype).

  Works on concrete and traced weights (under ``jit`` / ``nnx.eval_shape``): the kernel is passed as
  the initializer's result and the bias copied in.
  """
  layer = build(*args, param_dtype=kernel.dtype, kernel_init=lambda *_: kernel, **options)
  if bias is not None:
    copy_bias(layer, bias)
  return layer


def copy_bias(layer: nnx.Module, bias: jax.Array) -> None:
  """Sets ``layer.bias`` to ``bias`` in ``bias``'s own dtype: a dense layer whose bias has another dtype than its
  kernel (a float32 bias beside a bfloat16 kernel) computes with it, so its sparse twin must too (assigning with
  ``layer.bias[...] = bias`` would cast it to the layer's ``param_dtype``).

  A bias split over explicit mesh axes is gathered first, as the new layer's own bias is not split (explicit axes
  refuse the assignment); the partitioning names carried after it (``carry_nnx``, ``carry_back_nnx``) split it again.
  """
  bias = replicated(bias)
  if jnp.result_type(bias) == layer.bias[...].dtype:
    layer.bias[...] = bias
  else:
    layer.bias.set_value(jnp.asarray(bias))


def bridged_block_pattern(sparsity: Any, params: Any) -> Mapping | None:
  """The block index arrays of an NNX ``BlockSparseLinear`` under ``nnx.bridge.ToLinen``, read from one Linen layer's
  ``"sparsity"`` entry and its ``"params"``; ``None`` for any other layout.

  ``ToLinen`` puts the layer's ``pattern`` dict in ``"sparsity"`` one level down, ``{"pattern": {"row_indices": ...,
  ...}}``, where a ``BlockSparseDense`` keeps the same arrays flat. The one home of that layout for the readers of
  Linen variables (the torch export, ``summary``, ``plot_pattern``, ``pruning.apply_masks``): it is the bridged layout
  only when ``sparsity`` holds nothing but a ``"pattern"`` dict of exactly the index arrays
  (``INDEX_FIELDS``) and ``params`` no submodule named ``pattern``.
  """
  if not isinstance(sparsity, Mapping) or not isinstance(params, Mapping):
    return None
  nested = sparsity.get("pattern")
  if not isinstance(nested, Mapping) or set(sparsity) != {"pattern"} or isinstance(params.get("pattern"), Mapping):
    return None
  return nested if set(nested) == set(INDEX_FIELDS) else None


def pattern_mask(mask: Any, shape: tuple[int, ...], *, path: str | None = None) -> jax.Array:
  """The bool mask of an unstructured Linen layer's ``"sparsity"`` collection (unboxed), checked against its kernel's
  ``shape`` (``_utils.check_mask``; errors say which collection, and start with the layer's ``path`` where given:
  ``""`` is the variables themselves).

  ``nn.Conv`` multiplies its kernel by a weight mask: a mask of other values (0.5, an int 2) would scale the kept
  weights in the forward while :func:`jaxsparse.densify_linen` keeps them as they are, so the forward, densify,
  summary, pruning and the torch export all refuse it, as ``MaskedDense`` does.
  """
  try:
    return _utils.check_mask(mask, shape)
  except (TypeError, ValueError) as e:
    where = "" if path is None else f"{path or '(the variables)'}: "
    raise type(e)(f"{where}its {SPARSITY!r} collection's {e}") from None


def _one_layer_leaf(layer: nnx.Module) -> tuple[str, int]:
  """The array attribute whose axes tell one layer from a stack of layers, and its number of axes for one layer."""
  if getattr(layer, "storage", None) == "cusparselt":
    return "kernel_buffer", 1  # CompressedNMLinear's one buffer
  if hasattr(layer, "embedding"):
    return "embedding", 2  # CompressedNMEmbed's kept values (features * n // m, num_embeddings)
  if hasattr(layer, "kernel_size"):
    return "kernel", len(layer.kernel_size) + 2  # (*kernel_size, cin, cout)
  if hasattr(layer, "block_shape"):
    return "kernel", 3  # BlockSparseLinear's kept blocks (nnz_blocks, bk, bn)
  return "kernel", 2


def check_one_layer(layer: nnx.Module, *, what: str, owner: nnx.Module | None = None) -> None:
  """Raises a ``ValueError`` when ``layer`` is a stack of layers (built by ``nnx.vmap``: its kernel has leading layer
  axes) where ``what`` needs one layer, naming the kernel's shape and the per-layer call that works.

  Args:
    layer: a sparse layer (``MaskedLinear``, ``BlockSparseLinear``, ``NMConv``, ``CompressedNMLinear``, ...).
    what: the method or property called, as the message names it (``"to_dense()"``, ``"sparse_kernel"``).
    owner: the layer the user called ``what`` on, where it wraps ``layer`` (``SparseLinearGeneral``).
  """
  leaf, ndim = _one_layer_leaf(layer)
  shape = tuple(jnp.shape(getattr(layer, leaf)[...]))
  if len(shape) != ndim:
    name = type(owner if owner is not None else layer).__name__
    raise ValueError(
        f"{name}.{what} works on one layer, but this {name} holds a stack of layers: its {leaf} has shape {shape}, "
        f"{len(shape) - ndim} leading axis/axes more than one layer's {ndim} (made with nnx.vmap?). "
        f"Call it per layer under the same transform, e.g. nnx.vmap(lambda layer: layer.{what}, in_axes=0, "
        "out_axes=0)(stack) for a stack built with in_axes=0, out_axes=0."
    )


# CompressedNMLinear's 1-D cuSPARSELt buffers (layers/_nm_compressed.py, which imports this module).
_BUFFER_VARIABLES = ("CusparseLtWeight", "CusparseLtKernel")


def dict_items(d: nnx.Dict) -> list[tuple[str, nnx.Variable]]:
  """The variables of an ``nnx.Dict`` (a layer's ``pattern``) read from its attributes, not through its ``Mapping``
  methods: ``nnx.tabulate`` wraps the methods of every module it summarises, and calling one inside a layer's
  ``__call__`` recursed there (``RecursionError``, and the model's class kept the wrapper)."""
  entries = [(k, v) for k, v in vars(d).items() if isinstance(v, nnx.Variable)]  # not the bookkeeping tabulate adds
  return entries or [(k, v) for k, v in d.items() if isinstance(v, nnx.Variable)]  # entries kept elsewhere


def _structure_variables(layer: nnx.Module, leaf_ndim: int):
  """``(name, variable, axes for one layer)`` of ``layer``'s non-trainable structure: its :class:`SparsityPattern`
  variables (block index arrays are 1-D, masks and packed positions have the kernel's axes) and the 1-D cuSPARSELt
  buffers of a ``CompressedNMLinear``."""
  for attr, value in vars(layer).items():
    items = dict_items(value) if isinstance(value, nnx.Dict) else [(None, value)]
    for key, var in items:
      name = attr if key is None else f"{attr}[{key!r}]"
      if isinstance(var, SparsityPattern):
        yield name, var, 1 if hasattr(layer, "block_shape") else leaf_ndim
      elif isinstance(var, nnx.Variable) and type(var).__name__ in _BUFFER_VARIABLES:
        yield name, var, 1


def check_called_on_one_layer(layer: nnx.Module) -> None:
  """Raises a ``ValueError`` when ``layer`` is called with the variables of a stack of layers (built by ``nnx.vmap``)
  where one layer's belong: called outside ``nnx.scan`` / ``nnx.vmap``, or inside one whose ``nnx.StateAxes`` split
  the parameters but handed every layer the whole stack's patterns (``nnx.StateAxes({nnx.Param: 0, ...: None})``).
  The products failed on an array's shape ("w must be 2-D", "Mask needs to have the same shape as weights",
  "BlockSparseMatrix.row_indices must be ... of shape (8,)"), naming neither the stack nor the fix.

  Args:
    layer: an NNX sparse layer (``BlockSparseLinear``, ``MaskedLinear``, ``MaskedConv``, ``NMLinear``, ``NMConv``,
      ``CompressedNMLinear``, ``CompressedNMEmbed``), checked where it is called.
  """
  leaf, ndim = _one_layer_leaf(layer)
  shape = tuple(jnp.shape(getattr(layer, leaf)[...]))
  name = type(layer).__name__
  if len(shape) != ndim:
    raise ValueError(
        f"{name} was called with the variables of a stack of layers: its {leaf} has shape {shape}, "
        f"{len(shape) - ndim} leading axis/axes more than one layer's {ndim} (made with nnx.vmap?). Call its layers "
        "one at a time, inside nnx.scan or nnx.vmap over the stack's axis, e.g. nnx.scan(lambda h, layer: "
        "(layer(h), None), in_axes=(nnx.Carry, 0))(x, stack) or nnx.vmap(lambda layer, x: layer(x), in_axes=(0, "
        "None))(stack, x); an nnx.StateAxes there must give that axis to every variable of the layers."
    )
  for attr, var, var_ndim in _structure_variables(layer, ndim):
    var_shape = tuple(jnp.shape(var[...]))
    if len(var_shape) > var_ndim:
      kind = type(var).__name__
      raise ValueError(
          f"{name}'s {kind} {attr} has shape {var_shape}, {len(var_shape) - var_ndim} leading axis/axes more than "
          f"one layer's {var_ndim}, while its {leaf} {shape} is one layer's: the variables of a stack of layers "
          f"were split over the stack's axis unevenly. An nnx.StateAxes({{nnx.Param: 0, ...: None}}) in nnx.scan / "
          f"nnx.vmap hands every layer the whole stack's {kind} variables; give them the parameters' axis, e.g. "
          f"nnx.StateAxes({{(nnx.Param, {kind}): 0, ...: None}}) ({kind} from jaxsparse.layers)."
      )


def dense_linear(kernel: jax.Array, bias: jax.Array | None, *, dtype, precision) -> nnx.Linear:
  """An ``nnx.Linear`` holding the ``(in, out)`` ``kernel`` and ``bias``."""
  return with_weights(
      nnx.Linear, kernel, bias, *kernel.shape, use_bias=bias is not None, dtype=dtype, precision=precision,
      rngs=nnx.Rngs(0),
  )


def init_linear_attributes(
    layer: nnx.Module,
    in_features: int,
    out_features: int,
    *,
    use_bias: bool,
    bias_init: Any,
    dtype: Any,
    param_dtype: Any,
    precision: Any,
    rngs: nnx.Rngs,
) -> None:
  """Sets the bias parameter (drawn from ``rngs.params()``) and the options every sparse linear layer keeps."""
  use_bias = check_use_bias(use_bias)
  layer.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype)) if use_bias else nnx.data(None)
  layer.in_features = in_features
  layer.out_features = out_features
  layer.use_bias = use_bias
  layer.dtype = dtype
  layer.param_dtype = param_dtype
  layer.precision = precision


@dataclasses.dataclass(frozen=True)
class NMPromote:
  """A Flax ``promote_dtype`` that first N:M-prunes the kernel with :func:`jaxsparse.ops.sr_ste`.

  Flax layers call ``promote_dtype`` on ``(inputs, kernel, bias)`` (after a Conv's own weight
  mask) right before the product; this applies SR-STE to the kernel in its parameter dtype and then
  calls ``base``, the layer's original promotion. Frozen and compared by value, so it can sit in an
  NNX graph definition or a Linen module field.

  Attributes:
    n, m: keep ``n`` of every ``m``.
    decay: SR-STE decay on the pruned weights (0: plain STE).
    axis: kernel axis of the groups (0 for Dense, -2 for Conv).
    base: the promotion to run afterwards.
    linen: Linen calls ``promote_dtype(*arrays, dtype=...)``, NNX ``promote_dtype(arrays, dtype=...)``.
    transposable: prune with the transposable mask (N:M along the output features too).
  """

  n: int
  m: int
  decay: float
  axis: int
  base: Callable[..., Any] = dtypes.promote_dtype
  linen: bool = False
  transposable: bool = False

  def __call__(self, *args, dtype=None):
    inputs, kernel, bias = args if self.linen else args[0]
    kernel = ops.sr_ste(kernel, self.n, self.m, decay=self.decay, axis=self.axis, transposable=self.transposable)
    if self.linen:
      return self.base(inputs, kernel, bias, dtype=dtype)
    return self.base((inputs, kernel, bias), dtype=dtype)


def base_promote(layer: nnx.Module) -> Callable[..., Any]:
  p = layer.promote_dtype
  return p.base if isinstance(p, NMPromote) else p


def _shared_options(layer: nnx.Linear | nnx.Conv) -> dict[str, Any]:
  return dict(
      use_bias=layer.bias is not None,
      dtype=layer.dtype,
      precision=layer.precision,
      promote_dtype=base_promote(layer),
      preferred_element_type=layer.preferred_element_type,
      rngs=nnx.Rngs(0),
  )


def linear_options(linear: nnx.Linear) -> dict[str, Any]:
  """Keyword arguments that rebuild ``linear``'s options (all but sizes, kernel and N:M settings)."""
  return dict(_shared_options(linear), dot_general=linear.dot_general)


def conv_options(conv: nnx.Conv) -> dict[str, Any]:
  """Keyword arguments that rebuild ``conv``'s options (all but sizes, kernel and N:M settings)."""
  return dict(
      _shared_options(conv),
      strides=conv.strides,
      padding=conv.padding,
      input_dilation=conv.input_dilation,
      kernel_dilation=conv.kernel_dilation,
      feature_group_count=conv.feature_group_count,
      mask=conv.mask,
      conv_general_dilated=conv.conv_general_dilated,
  )


def bias_of(layer: nnx.Module) -> jax.Array | None:
  """The value of ``layer.bias``, or ``None`` for a layer without bias."""
  return None if layer.bias is None else layer.bias[...]


def nm_kept_mask(
    kernel: jax.Array, n: int, m: int, *, transposable: bool = False, weight_mask: jax.typing.ArrayLike | None = None
) -> jax.Array:
  """Bool mask of the weights an N:M layer keeps of ``kernel``, its groups along axis -2 (the input features): those
  its N:M pattern keeps that are nonzero.

  The layers keep no mask (the pattern is the kernel's ``n`` largest of every ``m``), so a group that an optimizer
  pruned further (``pruning.wrap_optax`` at a higher sparsity, a mask of fewer than ``n``) "keeps" zeros: they are not
  counted (nor exported as kept), as they are not in a masked layer's mask. With a conv's own Flax ``weight_mask``
  (which ``nnx.Conv`` / ``nn.Conv`` multiply into the kernel before the N:M pruning) the product is ranked and counted.
  """
  w = kernel if weight_mask is None else kernel * weight_mask
  return _nm_masks.nm_mask(w, n, m, axis=-2, transposable=transposable) & (w != 0)


def nm_kept_count(
    kernel: jax.Array, n: int, m: int, *, transposable: bool = False, weight_mask: jax.typing.ArrayLike | None = None
) -> int | None:
  """How many weights :func:`nm_kept_mask` keeps, counted eagerly where the values are concrete (also under a trace:
  ``nnx.eval_shape`` of ``sparsify``); for a traced kernel the most it can keep, ``n`` of every ``m``, or ``None``
  with a ``weight_mask`` (unknown)."""
  if not (is_concrete(kernel) and (weight_mask is None or is_concrete(weight_mask))):
    return math.prod(kernel.shape) * n // m if weight_mask is None else None
  with jax.ensure_compile_time_eval():
    return int(jnp.sum(nm_kept_mask(kernel, n, m, transposable=transposable, weight_mask=weight_mask)))


def eager_if_concrete(*arrays: Any) -> contextlib.AbstractContextManager:
  """``jax.ensure_compile_time_eval()`` where all of ``arrays`` hold values, also under a trace (``jit``,
  ``nnx.eval_shape``), else a no-op: a mask checked or ranked from them keeps its values (a NumPy array would become a
  traced value at its first ``jnp`` op), so counts read from it stay known (:func:`masked_kept_count`)."""
  return jax.ensure_compile_time_eval() if all(is_concrete(a) for a in arrays) else contextlib.nullcontext()


def masked_kept_count(mask: Any) -> int | None:
  """How many weights an unstructured mask keeps, counted eagerly where it holds values (also under a trace);
  ``None`` for a traced or abstract (``jax.ShapeDtypeStruct``) mask: unknown, as :func:`nm_kept_count` says of a
  traced weight mask."""
  return int(np.count_nonzero(np.asarray(mask))) if is_concrete(mask) else None


def compressed_kept_count(values: Any) -> int:
  """How many weights a compressed N:M kernel or table keeps: its stored ``values`` (``n`` of every ``m`` along the
  grouped dim) that are nonzero, as :func:`nm_kept_count` counts a dense kernel's (a group pruned further, by a mask
  or an optimizer, stores zeros); counted where they hold values, else (traced, abstract) the most they keep, all of
  them."""
  return int(np.count_nonzero(np.asarray(values))) if is_concrete(values) else math.prod(values.shape)


def kept_fraction(kept: int | None, size: int) -> float | None:
  """``kept`` weights of ``size`` as a fraction (a density); ``None`` where ``kept`` is unknown, 0.0 for an empty
  (zero-size) kernel or table, which keeps nothing: the one rule of the densities in ``summary``, the ``sparsify``
  reports and the layer signatures.

  >>> kept_fraction(3, 4), kept_fraction(0, 0), kept_fraction(None, 4)
  (0.75, 0.0, None)
  """
  if kept is None:
    return None
  return kept / size if size else 0.0


def check_layer_inputs(layer: nnx.Module, inputs: jax.typing.ArrayLike) -> jax.Array:
  """``inputs`` as an array; raises, naming both counts, when ``inputs`` of an NNX layer built for
  ``layer.in_features`` has another last axis (the op's error would name its own ``x``, not the layer), and when the
  layer holds a stack of layers' variables (:func:`check_called_on_one_layer`)."""
  check_called_on_one_layer(layer)
  if not isinstance(inputs, jax.Array | np.ndarray | np.generic):  # a nested list too, as nnx.Linear takes
    inputs = layer_array(layer, inputs, "inputs")
  shape = jnp.shape(inputs)
  if not shape or shape[-1] != layer.in_features:
    raise ValueError(
        f"{type(layer).__name__} has in_features={layer.in_features}: inputs must have shape (..., "
        f"{layer.in_features}), got inputs.shape={tuple(shape)}."
    )
  return inputs


_LIFTED_HINT = (
    f"under nn.scan / nn.vmap list the {SPARSITY!r} collection in variable_axes with the axis 'params' has, e.g. "
    f"variable_axes={{'params': 0, {SPARSITY!r}: 0}} (per-step parameters) or {{'params': None, {SPARSITY!r}: None}} "
    "(parameters shared by every step; nn.scan takes those as variable_broadcast=['params', "
    f"{SPARSITY!r}])"
)


class MissingPatternError(ValueError):
  """A Linen sparse layer applied without its :data:`SPARSITY` collection (:func:`missing_pattern`)."""


def missing_pattern(module: nn.Module) -> ValueError:
  return MissingPatternError(
      f"{type(module).__name__} has no {SPARSITY!r} collection: pass the variables that `init` returned, "
      f"e.g. `apply({{'params': ..., {SPARSITY!r}: ...}}, x)`; {_LIFTED_HINT}."
  )


def check_pattern(module: nn.Module, name: str) -> None:
  """Raises, saying how to pass it, unless a Linen layer holds its pattern variable ``name`` or may create it now
  (``init`` with the :data:`SPARSITY` collection mutable)."""
  if module.has_variable(SPARSITY, name):
    return
  if not module.is_initializing():
    raise missing_pattern(module)
  if not module.is_mutable_collection(SPARSITY):
    raise ValueError(
        f"{type(module).__name__} cannot create its pattern: the {SPARSITY!r} collection is not mutable here. "
        f"Let `init` create it (no `mutable=` leaving it out); {_LIFTED_HINT}."
    )


def existing_shape(module: nn.Module, collection: str, name: str) -> tuple[int, ...] | None:
  """The shape of a Linen variable the module already holds (``None`` while it is being created)."""
  if not module.has_variable(collection, name):
    return None
  return tuple(jnp.shape(nn.meta.unbox(module.get_variable(collection, name))))


def check_known_in_features(module: nn.Module, x_shape: tuple[int, ...], expected: int | None) -> None:
  """Raises, naming both counts, when a Linen layer built for ``expected`` input features gets another (or a
  scalar)."""
  if not x_shape:
    raise ValueError(f"{type(module).__name__}: x must have shape (..., in_features), got x.shape=().")
  if expected is not None and x_shape[-1] != expected:
    raise ValueError(
        f"{type(module).__name__}{f' {module.name!r}' if module.name else ''} holds variables for {expected} input "
        f"features, but "
        f"x.shape[-1] = {x_shape[-1]} (x.shape={tuple(x_shape)}); pass inputs of shape (..., {expected})."
    )
