"""Unstructured masked layers: NNX ``MaskedLinear`` / ``MaskedConv`` and Linen ``MaskedDense``, over
:func:`jaxsparse.ops.masked_matmul` (and Flax's own weight-masked convolution).

The boolean mask is fixed at construction (NNX) or ``init`` (Linen) and kept as non-trainable state:
a :class:`SparsityPattern` variable in NNX, the ``"sparsity"`` collection in Linen.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.typing import Dtype
from flax.typing import Initializer
from jax import lax

from jaxsparse import _utils
from jaxsparse import ops
from jaxsparse._utils import check_mask
from jaxsparse.formats._masks import magnitude_mask
from jaxsparse.layers._checks import check_conv_steps
from jaxsparse.layers._checks import check_dtypes
from jaxsparse.layers._checks import check_feature_groups
from jaxsparse.layers._checks import check_init_dtype
from jaxsparse.layers._checks import check_input
from jaxsparse.layers._checks import check_kernel_size
from jaxsparse.layers._checks import check_masked_implementation
from jaxsparse.layers._checks import check_one_of
from jaxsparse.layers._checks import check_padding
from jaxsparse.layers._checks import check_passthrough_kwargs
from jaxsparse.layers._checks import check_use_bias
from jaxsparse.layers._common import SPARSITY
from jaxsparse.layers._common import SparsityPattern
from jaxsparse.layers._common import bias_of
from jaxsparse.layers._common import check_called_on_one_layer
from jaxsparse.layers._common import check_known_in_features
from jaxsparse.layers._common import check_layer_inputs
from jaxsparse.layers._common import check_linear
from jaxsparse.layers._common import check_one_layer
from jaxsparse.layers._common import check_pattern
from jaxsparse.layers._common import conv_options
from jaxsparse.layers._common import default_bias_init
from jaxsparse.layers._common import dense_linear
from jaxsparse.layers._common import eager_if_concrete
from jaxsparse.layers._common import existing_shape
from jaxsparse.layers._common import init_linear_attributes
from jaxsparse.layers._common import kept_weights
from jaxsparse.layers._common import map_boxed
from jaxsparse.layers._common import masked_kept_count
from jaxsparse.layers._common import pattern_variable
from jaxsparse.layers._common import random_mask
from jaxsparse.layers._common import with_weights
from jaxsparse.layers._partitioning import box_structure
from jaxsparse.layers._partitioning import carry_back_nnx
from jaxsparse.layers._partitioning import carry_nnx

__all__ = ["OWN_MASK", "MaskedConv", "MaskedDense", "MaskedLinear"]

OWN_MASK = "own_mask"
"""Metadata key of the kernel ``nnx.Param`` of a layer with a mask of its own (``MaskedLinear``, ``MaskedConv``); its
value is the layer's class name. Like ``COMPRESSED_VALUES`` (``layers/_common.py``) it travels with the kernel where
the parameters go without the layer (``nnx.state(model, nnx.Param)``, what ``nnx.Optimizer`` hands its optimizer),
so that a pruner given those parameters without the layers' masks (``pruning.layer_masks``) can name the kernels."""


def masked_kernel_init(kept: int | jax.Array, size: int) -> Initializer:
  """Truncated normal for ``(in, out)`` with variance ``1 / (density * in_features)``, ``density = kept / size``."""
  return nnx.initializers.variance_scaling(size / jnp.maximum(kept, 1), "fan_in", "truncated_normal")


def _mask_density(mask: SparsityPattern) -> float | None:
  """The kept fraction of a layer's mask variable; ``None`` when it holds no values (traced or abstract)."""
  kept = masked_kept_count(mask.get_value())
  return None if kept is None else kept / math.prod(mask.shape)


def masked_apply(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array,
    *,
    dtype: Dtype | None,
    precision: lax.PrecisionLike,
    implementation: str | None = None,
) -> jax.Array:
  x, kernel, bias = dtypes.promote_dtype((x, kernel, bias), dtype=dtype)
  y = ops.masked_matmul(x, kernel, mask, implementation=implementation, precision=precision)
  return y if bias is None else y + bias


class MaskedLinear(nnx.Module):
  """A linear layer ``y = x @ (W * mask) + b`` with an unstructured, fixed boolean ``mask``.

  The kernel is stored dense (its pruned entries are zero and get zero gradient, so optimizers
  without weight decay keep them zero); the product is :func:`jaxsparse.ops.masked_matmul`. On CPU
  that runs sparse C++ kernels (forward and both gradients, work proportional to the kept weights)
  which read the kept entries from ``mask`` on every call: replacing ``mask`` (pruning, RigL) needs
  no rebuild, inside ``jit`` or out, and the number of kept weights may change freely. Masks keeping
  more than a third of the weights run their forward as a dense C++ GEMM that masks the weight as it packs it (as
  do inputs of at most 8 rows, a decode step, at any density), and more than a quarter their gradients masked dense:
  faster there (:func:`jaxsparse.ops.masked_matmul` has the thresholds).

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxsparse.layers import MaskedLinear
  >>> layer = MaskedLinear(64, 96, sparsity=0.75, rngs=nnx.Rngs(0))
  >>> layer.kernel.shape, int(layer.mask[...].sum()), layer.density
  ((64, 96), 1536, 0.25)
  >>> layer(jnp.ones((4, 64))).shape
  (4, 96)

  Initialisation: by default a truncated normal with variance ``1 / (density * in_features)``, where
  ``density`` is the kept fraction; each output sums ``density * in_features`` nonzero terms on
  average, so outputs keep the variance ``nnx.Linear``'s ``lecun_normal`` gives the dense layer.
  The layer can be built under ``nnx.jit`` / ``nnx.eval_shape``, giving the same layer as an eager
  build with the same seed.

  Attributes:
    kernel: ``nnx.Param`` ``(in_features, out_features)``, zero where ``mask`` is False.
    bias: ``nnx.Param`` ``(out_features,)`` or ``None``.
    mask: :class:`SparsityPattern` bool ``(in_features, out_features)``.

  Args:
    in_features: input size.
    out_features: output size.
    sparsity: fraction of weights pruned, in [0, 1): a uniformly random mask pruning exactly
      ``round(sparsity * size)`` weights, drawn from ``rngs.params()``. Give exactly one of
      ``sparsity`` and ``mask``.
    mask: bool ``(in_features, out_features)``, True where a weight is kept.
    use_bias: whether to add a bias.
    dtype: computation dtype; ``None`` infers it like ``nnx.Linear``.
    param_dtype: storage dtype of kernel and bias; an integer or bool one needs ``kernel_init`` (the default draws
      a truncated normal: without it a ``TypeError`` names ``param_dtype``).
    kernel_init: called as ``kernel_init(key, (in_features, out_features), param_dtype)``; ``None``
      uses the variance-preserving default above.
    bias_init: called as ``bias_init(key, (out_features,), param_dtype)``.
    precision: passed to the matmul.
    implementation: backend of :func:`jaxsparse.ops.masked_matmul`: ``None`` (sparse C++ kernels on
      CPU for sparse masks, masked dense elsewhere), ``"cpu"`` or ``"xla"`` (masked dense).
    rngs: ``nnx.Rngs``; the ``params`` stream draws the mask, kernel and bias.
  """

  def __init__(
      self,
      in_features: int,
      out_features: int,
      *,
      sparsity: float | None = None,
      mask: jax.typing.ArrayLike | None = None,
      use_bias: bool = True,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      kernel_init: Initializer | None = None,
      bias_init: Initializer = default_bias_init,
      precision: lax.PrecisionLike = None,
      implementation: ops.CpuImplementation | None = None,
      rngs: nnx.Rngs,
  ):
    in_features = _utils.check_positive_int(in_features, name="in_features")
    out_features = _utils.check_positive_int(out_features, name="out_features")
    shape = (in_features, out_features)
    size = in_features * out_features
    self.implementation = check_masked_implementation(implementation)
    check_dtypes(MaskedLinear, dtype=dtype, param_dtype=param_dtype)
    _utils.check_precision(precision, owner="MaskedLinear")
    check_init_dtype(MaskedLinear, param_dtype, kernel_init)
    check_one_of("sparsity", sparsity, "mask", mask)
    if mask is None:
      kept = kept_weights(sparsity, shape)
      mask = random_mask(rngs.params(), shape, kept)
    else:
      with eager_if_concrete(mask):  # a given mask keeps its values under a trace (nnx.eval_shape): density known
        mask = check_mask(mask, shape, name="mask")
      kept = jnp.sum(mask)
    if kernel_init is None:
      kernel_init = masked_kernel_init(kept, size)
    kernel = kernel_init(rngs.params(), shape, param_dtype)  # maybe boxed (nnx.with_partitioning): kept
    self.kernel = nnx.Param(map_boxed(kernel, lambda k: jnp.where(mask, k, jnp.zeros((), k.dtype))),
                            **{OWN_MASK: type(self).__name__})
    self.mask = pattern_variable(mask, self.kernel, "mask")  # named as the kernel is (nnx.with_partitioning)
    init_linear_attributes(
        self, in_features, out_features, use_bias=use_bias, bias_init=bias_init, dtype=dtype,
        param_dtype=param_dtype, precision=precision, rngs=rngs,
    )

  def __call__(self, inputs: jax.Array) -> jax.Array:
    """``inputs @ (kernel * mask) + bias``, as ``nnx.Linear`` computes it with the pruned kernel.

    Args:
      inputs: ``(..., in_features)`` (named as ``nnx.Linear``'s).

    Returns:
      ``(..., out_features)``, in ``dtype`` if set, else the promoted dtype of ``inputs`` and the parameters.

    Raises:
      ValueError: ``inputs`` whose last axis is not ``in_features``.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import MaskedLinear
    >>> layer = MaskedLinear(16, 8, sparsity=0.5, rngs=nnx.Rngs(0))
    >>> x = jnp.ones((4, 16))
    >>> y = layer(x)
    >>> y.shape, y.dtype, bool(jnp.allclose(y, x @ (layer.kernel[...] * layer.mask[...]) + layer.bias[...]))
    ((4, 8), dtype('float32'), True)
    """
    check_layer_inputs(self, inputs)
    return masked_apply(
        inputs,
        self.kernel[...],
        bias_of(self),
        self.mask[...],
        dtype=self.dtype,
        precision=self.precision,
        implementation=self.implementation,
    )

  @property
  def density(self) -> float | None:
    """Fraction of weights kept; ``None`` (unknown) when the mask holds no values: a traced mask (under ``nnx.jit``),
    an abstract layer's (``nnx.eval_shape``). A mask given or computed from concrete weights is counted, also when
    the layer is built under a trace."""
    return _mask_density(self.mask)

  @property
  def sparsity(self) -> float | None:
    """Fraction of weights pruned, ``1 - density``; ``None`` when the density is unknown."""
    density = self.density
    return None if density is None else 1.0 - density

  @classmethod
  def from_dense(
      cls, linear: nnx.Linear, *, sparsity: float, implementation: ops.CpuImplementation | None = None
  ) -> MaskedLinear:
    """Prunes an ``nnx.Linear`` to its largest-magnitude weights, pruning ``round(sparsity * size)``.

    Args:
      linear: a plain ``nnx.Linear`` with Flax's default product options (not changed); its kernel, bias,
        ``dtype`` and ``precision`` carry over, and so do the partitioning names (``nnx.with_partitioning``) of
        kernel and bias (the mask takes the kernel's) and their placement on a mesh, as :func:`jaxsparse.sparsify`
        gives them.
      sparsity: fraction of the weights pruned, in ``[0, 1)``.
      implementation: as in the constructor.

    Returns:
      A ``MaskedLinear`` with ``linear``'s kernel, zero at the pruned weights, and its bias.

    Raises:
      TypeError: ``linear`` is not an ``nnx.Linear`` (a subclass included).
      ValueError: ``linear`` has options the layer cannot honour (a custom ``dot_general``...), or a bad
        ``sparsity`` or ``implementation``.

    >>> from flax import nnx
    >>> from jaxsparse.layers import MaskedLinear
    >>> dense = nnx.Linear(64, 96, rngs=nnx.Rngs(0))
    >>> MaskedLinear.from_dense(dense, sparsity=0.75).density
    0.25
    """
    linear = check_linear(linear, "MaskedLinear")
    kernel = linear.kernel[...]
    with eager_if_concrete(kernel):  # ranked eagerly from concrete weights, also under a trace: the density is known
      mask = magnitude_mask(kernel, sparsity)
    layer = with_weights(
        cls,
        kernel,
        bias_of(linear),
        linear.in_features,
        linear.out_features,
        mask=mask,
        use_bias=linear.bias is not None,
        dtype=linear.dtype,
        precision=linear.precision,
        implementation=implementation,
        rngs=nnx.Rngs(0),
    )
    return carry_nnx(linear, layer)  # the partitioning names and placement

  def to_dense(self) -> nnx.Linear:
    """An ``nnx.Linear`` with kernel ``kernel * mask`` and the same bias, ``dtype`` and ``precision``.

    Returns:
      An ``nnx.Linear`` computing the same function as this layer. Partitioning names (``nnx.with_partitioning``)
      of kernel and bias carry over (and their placement on a mesh), as :func:`jaxsparse.densify` gives them.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import MaskedLinear
    >>> layer = MaskedLinear(16, 8, sparsity=0.5, rngs=nnx.Rngs(0))
    >>> bool(jnp.allclose(layer.to_dense()(jnp.ones((2, 16))), layer(jnp.ones((2, 16))), atol=1e-6))
    True

    Raises:
      ValueError: this layer is a stack of layers (built by ``nnx.vmap``, its kernel ``(layers, in, out)``); call
        ``to_dense`` per layer: ``nnx.vmap(lambda layer: layer.to_dense(), in_axes=0, out_axes=0)(stack)``.
    """
    check_one_layer(self, what="to_dense()")
    kernel = self.kernel[...]
    dense = dense_linear(
        jnp.where(self.mask[...], kernel, jnp.zeros((), kernel.dtype)),
        bias_of(self),
        dtype=self.dtype,
        precision=self.precision,
    )
    return carry_back_nnx(self, dense)  # the partitioning names and placement

  def to_linen_variables(self) -> dict[str, dict[str, jax.Array]]:
    """Variables for :class:`jaxsparse.layers.linen.MaskedDense` holding these weights and mask.

    Returns:
      ``{"params": {"kernel", "bias"?}, "sparsity": {"mask"}}``: the ``(in_features, out_features)`` kernel
      and bool mask, the ``(out_features,)`` bias (when the layer has one).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import MaskedLinear
    >>> from jaxsparse.layers.linen import MaskedDense
    >>> layer = MaskedLinear(16, 8, sparsity=0.5, rngs=nnx.Rngs(0))
    >>> variables = layer.to_linen_variables()
    >>> y = MaskedDense(8, sparsity=0.5).apply(variables, jnp.ones((2, 16)))
    >>> bool(jnp.allclose(y, layer(jnp.ones((2, 16))), atol=1e-6))
    True
    """
    params = {"kernel": self.kernel[...]}
    if self.bias is not None:
      params["bias"] = self.bias[...]
    return {"params": params, "sparsity": {"mask": self.mask[...]}}


class MaskedDense(nn.Module):
  """Linen version of :class:`jaxsparse.layers.MaskedLinear`: ``y = x @ (W * mask) + b``.

  ``init`` draws a uniformly random bool mask pruning exactly ``round(sparsity * size)`` weights
  from the ``"params"`` rng and stores it as ``"mask"`` in the ``"sparsity"`` collection; the
  ``"params"`` kernel is dense ``(in_features, features)`` and zero where the mask is False.
  Default initialisation, dtypes and the sparse CPU kernels (which read the mask on every call, so
  it may be replaced between calls) follow ``MaskedLinear``.

  >>> import jax, jax.numpy as jnp
  >>> from jaxsparse.layers.linen import MaskedDense
  >>> model = MaskedDense(96, sparsity=0.75)
  >>> variables = model.init(jax.random.key(0), jnp.ones((1, 64)))
  >>> variables["params"]["kernel"].shape, int(variables["sparsity"]["mask"].sum())
  ((64, 96), 1536)

  Attributes:
    features: output size; the input size is ``x.shape[-1]``.
    sparsity: fraction of weights pruned, in [0, 1).
    use_bias: whether to add a bias.
    dtype: computation dtype (``None``: inferred from input and params).
    param_dtype: storage dtype of kernel and bias; an integer or bool one needs ``kernel_init`` (the default draws
      a truncated normal: without it a ``TypeError`` at construction names ``param_dtype``).
    kernel_init: called as ``kernel_init(key, (in_features, features), param_dtype)``; ``None``
      draws a truncated normal of variance ``1 / ((1 - sparsity) * in_features)``.
    bias_init: bias initializer.
    precision: passed to the matmul.
    implementation: backend of :func:`jaxsparse.ops.masked_matmul`: ``None``, ``"cpu"`` or ``"xla"``.
  """

  features: int
  _: dataclasses.KW_ONLY
  sparsity: float
  use_bias: bool = True
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer | None = None
  bias_init: Initializer = default_bias_init
  precision: lax.PrecisionLike = None
  implementation: ops.CpuImplementation | None = None

  def __post_init__(self):
    _utils.check_positive_int(self.features, name="features")
    _utils.check_sparsity(self.sparsity)
    check_use_bias(self.use_bias)
    check_masked_implementation(self.implementation)
    check_dtypes(type(self), dtype=self.dtype, param_dtype=self.param_dtype)
    _utils.check_precision(self.precision, owner=type(self).__name__)
    check_init_dtype(type(self), self.param_dtype, self.kernel_init)
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """``x @ (kernel * mask) + bias``; ``init`` draws the mask (see the class).

    Args:
      x: ``(..., in_features)``.

    Returns:
      ``(..., features)``, in ``dtype`` if set, else the promoted dtype of ``x`` and the parameters.

    Raises:
      ValueError: ``x`` a scalar, another ``in_features`` than the variables hold, or variables without the
        ``"sparsity"`` collection.

    >>> import jax, jax.numpy as jnp
    >>> from jaxsparse.layers.linen import MaskedDense
    >>> x = jnp.ones((2, 16))
    >>> variables = MaskedDense(8, sparsity=0.5).init(jax.random.key(0), x)
    >>> w = variables["params"]["kernel"] * variables["sparsity"]["mask"]
    >>> y = MaskedDense(8, sparsity=0.5).apply(variables, x)
    >>> y.shape, bool(jnp.allclose(y, x @ w + variables["params"]["bias"], atol=1e-6))
    ((2, 8), True)
    """
    x = check_input(self, x)
    kernel_shape = existing_shape(self, "params", "kernel")
    check_known_in_features(self, x.shape, None if kernel_shape is None else kernel_shape[0])
    shape = (x.shape[-1], self.features)
    size = shape[0] * shape[1]
    kept = kept_weights(self.sparsity, shape)
    check_pattern(self, "mask")
    drawn = not self.has_variable(SPARSITY, "mask")
    mask = self.variable(SPARSITY, "mask", lambda: random_mask(self.make_rng("params"), shape, kept)).value
    try:  # a given mask is checked here, not left to fail inside the kernel initializer (Flax traces it for shapes)
      mask = check_mask(mask, shape)
    except (TypeError, ValueError) as e:
      raise type(e)(f"{type(self).__name__} at {'/'.join(self.scope.path) or '(top level)'}: its "
                    f"{SPARSITY!r} collection's {e}") from None
    kernel_init = self.kernel_init or masked_kernel_init(kept, size)

    def masked_init(key, shape, dtype):
      return map_boxed(kernel_init(key, shape, dtype), lambda k: jnp.where(mask, k, jnp.zeros((), dtype)))

    kernel = self.param("kernel", masked_init, shape, self.param_dtype)
    if drawn:  # boxed as the kernel is (nn.with_partitioning): nn.scan's metadata_params add the stack axis to boxes
      self.put_variable(SPARSITY, "mask", box_structure(self.get_variable("params", "kernel"), mask, "mask"))
    bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
    return masked_apply(
        x, kernel, bias, mask, dtype=self.dtype, precision=self.precision, implementation=self.implementation
    )


def _conv_options(conv: nnx.Conv) -> dict[str, Any]:
  """``conv``'s options for rebuilding it; the caller sets the mask and rngs."""
  options = conv_options(conv)
  del options["mask"], options["rngs"]
  return options


class MaskedConv(nnx.Conv):
  """``nnx.Conv`` with a fixed unstructured weight ``mask`` held as a :class:`SparsityPattern`.

  It is Flax's own weight-masked convolution (``nnx.Conv(mask=...)``) with the mask stored as
  non-trainable state, so it can be read, saved and filtered like the other layers' patterns.
  Pruned weights are zero and get zero gradient.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxsparse.layers import MaskedConv
  >>> conv = MaskedConv.from_dense(nnx.Conv(8, 16, (3, 3), rngs=nnx.Rngs(0)), sparsity=0.75)
  >>> conv.density, conv(jnp.ones((2, 6, 6, 8))).shape
  (0.25, (2, 6, 6, 16))
  >>> MaskedConv(8, 16, (3, 3), sparsity=0.5, rngs=nnx.Rngs(0)).density
  0.5

  Args:
    in_features, out_features, kernel_size, rngs, **kwargs: as ``nnx.Conv``.
    sparsity: fraction of weights pruned, in [0, 1): a uniformly random mask pruning exactly
      ``round(sparsity * size)`` weights, drawn from ``rngs.params()`` before the kernel. Give exactly
      one of ``sparsity`` and ``mask``.
    mask: bool of the kernel's shape ``(*kernel_size, in_features // feature_group_count, out_features)``.
  """

  def __init__(
      self,
      in_features: int,
      out_features: int,
      kernel_size,
      *,
      sparsity: float | None = None,
      mask: Any = None,
      rngs: nnx.Rngs,
      **kwargs,
  ):
    check_passthrough_kwargs(MaskedConv, nnx.Conv, kwargs)
    check_one_of("sparsity", sparsity, "mask", mask)
    in_features = _utils.check_positive_int(in_features, name="in_features")
    out_features = _utils.check_positive_int(out_features, name="out_features")
    kernel_size = check_kernel_size(kernel_size)
    kwargs.update(check_conv_steps(**{k: kwargs[k] for k in ("strides", "input_dilation", "kernel_dilation")
                                      if k in kwargs}))
    if "padding" in kwargs:
      kwargs["padding"] = check_padding(MaskedConv, kwargs["padding"], len(kernel_size))
    check_use_bias(kwargs.get("use_bias", True))
    check_dtypes(MaskedConv, dtype=kwargs.get("dtype"), param_dtype=kwargs.get("param_dtype", jnp.float32),
                 inexact=kwargs.get("promote_dtype", dtypes.promote_dtype) is dtypes.promote_dtype)
    check_init_dtype(MaskedConv, kwargs.get("param_dtype", jnp.float32), kwargs.get("kernel_init"))
    _utils.check_precision(kwargs.get("precision"), owner="MaskedConv")
    # nnx.Conv accepts groups that do not divide the features and fails at the first call on a bare assert.
    groups = check_feature_groups(kwargs.get("feature_group_count", 1), in_features, out_features)
    if mask is None:
      # nnx.Conv's kernel shape; the mask is drawn before nnx.Conv draws the kernel, as in MaskedLinear.
      shape = (*kernel_size, in_features // groups, out_features)
      mask = random_mask(rngs.params(), shape, kept_weights(sparsity, shape))
    super().__init__(in_features, out_features, kernel_size, rngs=rngs, **kwargs)
    with eager_if_concrete(mask):  # a given mask keeps its values under a trace (nnx.eval_shape): density known
      mask = check_mask(mask, self.kernel_shape, name="mask")
    k = self.kernel[...]
    self.kernel[...] = jnp.where(mask, k, jnp.zeros((), k.dtype))
    self.kernel.set_metadata(OWN_MASK, type(self).__name__)
    self.mask = nnx.data(pattern_variable(mask, self.kernel, "mask"))  # named as the kernel is

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    """``nnx.Conv``'s forward with the masked kernel; raises, saying how to call it, on a stack of layers (as
    :meth:`MaskedLinear.__call__`)."""
    check_called_on_one_layer(self)
    return super().__call__(inputs, out_sharding=out_sharding)

  @property
  def density(self) -> float | None:
    """Fraction of weights kept; ``None`` (unknown) when the mask holds no values, as :attr:`MaskedLinear.density`."""
    return _mask_density(self.mask)

  @classmethod
  def from_dense(cls, conv: nnx.Conv, *, sparsity: float | None = None, mask: Any = None) -> MaskedConv:
    """Prunes ``conv`` to its largest-magnitude weights (``sparsity``) or to ``mask``; copies every option.

    Args:
      conv: an ``nnx.Conv`` without a weight ``mask`` (not changed); the partitioning names
        (``nnx.with_partitioning``) of its kernel and bias carry over (the mask takes the kernel's), and their
        placement on a mesh, as :func:`jaxsparse.sparsify` gives them.
      sparsity: fraction of the weights pruned, in ``[0, 1)``; give it or ``mask``, not both.
      mask: bool array of ``conv``'s kernel shape ``(*kernel_size, in_features // feature_group_count,
        out_features)``, True at the weights kept.

    Returns:
      A ``MaskedConv`` with ``conv``'s kernel, zero at the pruned weights, its bias and options.

    Raises:
      TypeError: ``conv`` is not an ``nnx.Conv``.
      ValueError: ``conv`` already has a weight mask, neither or both of ``sparsity`` and ``mask`` are given, or
        a bad ``sparsity`` or ``mask``.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import MaskedConv
    >>> conv = nnx.Conv(4, 8, (3, 3), rngs=nnx.Rngs(0))
    >>> layer = MaskedConv.from_dense(conv, sparsity=0.75)
    >>> layer.density, layer(jnp.ones((1, 5, 5, 4))).shape
    (0.25, (1, 5, 5, 8))
    """
    if not isinstance(conv, nnx.Conv):
      raise TypeError(f"conv must be a flax.nnx.Conv, got {type(conv).__name__}.")
    if conv.mask is not None:
      raise ValueError("conv already has a weight mask; densify it first.")
    kernel = conv.kernel[...]
    check_one_of("sparsity", sparsity, "mask", mask)
    if mask is None:
      with eager_if_concrete(kernel):  # as in MaskedLinear.from_dense
        mask = magnitude_mask(kernel, sparsity)
    layer = with_weights(
        cls, kernel, bias_of(conv), conv.in_features, conv.out_features,
        conv.kernel_size, mask=mask, rngs=nnx.Rngs(0), **_conv_options(conv),
    )
    return carry_nnx(conv, layer)  # the partitioning names and placement

  def to_dense(self) -> nnx.Conv:
    """An ``nnx.Conv`` with kernel ``kernel * mask`` and the same options and bias.

    Returns:
      An ``nnx.Conv`` computing the same function as this layer. Partitioning names (``nnx.with_partitioning``) of
      kernel and bias carry over (and their placement on a mesh), as :func:`jaxsparse.densify` gives them.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import MaskedConv
    >>> layer = MaskedConv(4, 8, (3, 3), sparsity=0.5, rngs=nnx.Rngs(0))
    >>> x = jnp.ones((1, 5, 5, 4))
    >>> bool(jnp.allclose(layer.to_dense()(x), layer(x), atol=1e-6))
    True

    Raises:
      ValueError: this layer is a stack of layers (built by ``nnx.vmap``); call ``to_dense`` per layer, as for
        :meth:`MaskedLinear.to_dense`.
    """
    check_one_layer(self, what="to_dense()")
    kernel = jnp.where(self.mask[...], self.kernel[...], jnp.zeros((), self.kernel.dtype))
    dense = with_weights(
        nnx.Conv, kernel, bias_of(self), self.in_features, self.out_features,
        self.kernel_size, rngs=nnx.Rngs(0), **_conv_options(self),
    )
    return carry_back_nnx(self, dense)  # the partitioning names and placement
