"""N:M-sparse Flax NNX layers trained with SR-STE: ``NMLinear`` and ``NMConv``.

Both are the Flax layer they extend (``nnx.Linear``, ``nnx.Conv``) with one change: before the
kernel meets the inputs it goes through :func:`jaxsparse.ops.sr_ste`, which keeps the ``n``
largest-magnitude weights of every ``m`` consecutive input features and passes the gradient to all
of them. The kernel stays a dense ``nnx.Param``; the mask is recomputed from it on every call, so it
follows the weights as they train. Every other option of the Flax layer works unchanged, because
the hook is Flax's own ``promote_dtype`` argument (see :class:`NMPromote`).

Note that ``isinstance(layer, nnx.Linear)`` is True for an ``NMLinear`` (as for Flax's
``LoRALinear``): code that walks a model and treats ``nnx.Linear`` kernels as dense should test for
``NMLinear`` / ``NMConv`` first, or read :attr:`NMLinear.nm_mask`.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.nnx.nn.linear import default_kernel_init
from flax.typing import Dtype
from flax.typing import Initializer
from flax.typing import PaddingLike
from jax import lax

from jaxsparse import _utils
from jaxsparse import ops
from jaxsparse.formats import _nm_masks
from jaxsparse.formats._nm import NMSparseMatrix
from jaxsparse.layers._checks import check_conv_steps
from jaxsparse.layers._checks import check_dtypes
from jaxsparse.layers._checks import check_feature_groups
from jaxsparse.layers._checks import check_in_features
from jaxsparse.layers._checks import check_kernel_size
from jaxsparse.layers._checks import check_padding
from jaxsparse.layers._checks import check_passthrough_kwargs
from jaxsparse.layers._checks import check_trained_dtype
from jaxsparse.layers._checks import check_transposable_layer
from jaxsparse.layers._checks import check_use_bias
from jaxsparse.layers._common import NMPromote
from jaxsparse.layers._common import base_promote
from jaxsparse.layers._common import bias_of
from jaxsparse.layers._common import check_layer_inputs
from jaxsparse.layers._common import check_linear
from jaxsparse.layers._common import check_one_layer
from jaxsparse.layers._common import conv_options
from jaxsparse.layers._common import default_bias_init
from jaxsparse.layers._common import linear_options
from jaxsparse.layers._common import nm_kept_mask
from jaxsparse.layers._common import with_weights
from jaxsparse.layers._nm_compressed import CompressedNMLinear
from jaxsparse.layers._partitioning import carry_back_nnx
from jaxsparse.layers._partitioning import carry_nnx

__all__ = ["NMConv", "NMLinear"]


class _NMMixin:
  """Read-only N:M settings and the current mask, shared by the NNX layers."""

  promote_dtype: NMPromote
  kernel: nnx.Param

  @property
  def n(self) -> int:
    return self.promote_dtype.n

  @property
  def m(self) -> int:
    return self.promote_dtype.m

  @property
  def sr_ste_decay(self) -> float:
    return self.promote_dtype.decay

  @property
  def transposable(self) -> bool:
    return self.promote_dtype.transposable

  def _masked_input_kernel(self) -> jax.Array:
    return self.kernel[...]

  @property
  def nm_mask(self) -> jax.Array:
    """Bool mask of the kernel's shape: the N:M pattern the next call will use (each layer's, for a stack of
    layers built by ``nnx.vmap``)."""
    # The groups run along the input features, axis -2 of both kernels, (in, out) and (..., cin, cout); counted
    # from the end it stays that axis in a stack's kernel, which has leading layer axes.
    return _nm_masks.nm_mask(self._masked_input_kernel(), self.n, self.m, axis=-2, transposable=self.transposable)

  def pruned_kernel(self) -> jax.Array:
    """The kernel as the forward pass sees it: zero outside :attr:`nm_mask`."""
    k = self._masked_input_kernel()
    return jnp.where(self.nm_mask, k, jnp.zeros((), k.dtype))


def kept_mask(layer: NMLinear | NMConv) -> jax.Array:
  """The weights ``layer``'s forward pass keeps nonzero: :attr:`~NMLinear.nm_mask` where the kernel (for an ``NMConv``
  with a Flax weight ``mask``, the kernel times that mask) is nonzero; a group that holds fewer than ``n`` nonzero
  weights (pruned further by an optimizer, or by the conv's mask) "keeps" zeros, which are not counted."""
  own = layer.mask if isinstance(layer, NMConv) else None
  return nm_kept_mask(layer.kernel[...], layer.n, layer.m, transposable=layer.transposable, weight_mask=own)


class NMLinear(_NMMixin, nnx.Linear):
  """``nnx.Linear`` with an N:M-sparse kernel trained from scratch by SR-STE.

  Every call keeps the ``n`` largest-magnitude weights in each group of ``m`` consecutive input
  features (axis 0 of the ``(in, out)`` kernel) and multiplies by that pruned kernel; the gradient
  reaches every dense weight, plus ``sr_ste_decay * w`` on the pruned ones
  (:func:`jaxsparse.ops.sr_ste`).

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxsparse.layers import NMLinear
  >>> layer = NMLinear(64, 32, n=2, m=4, rngs=nnx.Rngs(0))
  >>> layer.kernel.shape, int(layer.mask.sum()), layer(jnp.ones((8, 64))).shape
  ((64, 32), 1024, (8, 32))

  After training, :meth:`to_compressed` gives a :class:`CompressedNMLinear` that stores and
  multiplies the compressed weight, and :meth:`to_dense` an ``nnx.Linear`` with the pruned kernel.

  Args:
    in_features: input size, a multiple of ``m``.
    out_features: output size.
    n, m: keep ``n`` of every ``m`` input features, ``0 < n < m`` (2:4 by default).
    sr_ste_decay: SR-STE's decay of the pruned weights, ``>= 0``; ``0`` gives plain STE.
    transposable: prune with a mask that is N:M along the output features too (``m <= 4``,
      ``out_features`` a multiple of ``m``; :func:`jaxsparse.nm_mask`), so that the backward ``dY Wᵀ``
      runs on 2:4 sparse tensor cores too (see :func:`jaxsparse.ops.sr_ste_matmul`).
    use_bias, dtype, param_dtype, precision, kernel_init, bias_init, dot_general,
      preferred_element_type, rngs: as ``nnx.Linear``; ``param_dtype`` a real floating dtype (a complex one
      raises ``TypeError``: SR-STE prunes by magnitude), while ``dtype`` and the inputs may be complex.
    promote_dtype: as ``nnx.Linear``; it runs after the N:M pruning.
    **kwargs: other ``nnx.Linear`` keyword arguments (e.g. ``kernel_metadata``).
  """

  def __init__(
      self,
      in_features: int,
      out_features: int,
      *,
      n: int = 2,
      m: int = 4,
      sr_ste_decay: float = 2e-4,
      transposable: bool = False,
      use_bias: bool = True,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      precision: lax.PrecisionLike = None,
      kernel_init: Initializer = default_kernel_init,
      bias_init: Initializer = default_bias_init,
      dot_general: Callable[..., jax.Array] = lax.dot_general,
      promote_dtype: Callable[..., Any] = dtypes.promote_dtype,
      preferred_element_type: Dtype | None = None,
      rngs: nnx.Rngs,
      **kwargs: Any,
  ):
    check_passthrough_kwargs(type(self), nnx.Linear, kwargs)
    n, m = _nm_masks.check_nm(n, m)
    check_in_features(in_features, m)
    _utils.check_positive_int(out_features, name="out_features")
    use_bias = check_use_bias(use_bias)
    transposable = check_transposable_layer(transposable, out_features, m)
    decay = _utils.check_decay(sr_ste_decay, name="sr_ste_decay")
    check_dtypes(type(self), dtype=dtype, param_dtype=param_dtype, inexact=promote_dtype is dtypes.promote_dtype)
    check_trained_dtype(type(self), param_dtype=param_dtype)  # SR-STE trains it: float weights
    _utils.check_precision(precision, owner=type(self).__name__)
    nm_promote = NMPromote(n, m, decay, 0, promote_dtype, transposable=transposable)
    super().__init__(
        in_features,
        out_features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        precision=precision,
        kernel_init=kernel_init,
        bias_init=bias_init,
        dot_general=dot_general,
        promote_dtype=nm_promote,
        preferred_element_type=preferred_element_type,
        rngs=rngs,
        **kwargs,
    )

  @property
  def mask(self) -> jax.Array:
    """Bool ``(in_features, out_features)``: the current N:M mask (same as :attr:`nm_mask`)."""
    return self.nm_mask

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    """``nnx.Linear``'s forward with the SR-STE-pruned kernel; 2:4 runs on sparse tensor cores on GPUs.

    For 2:4 with Flax's default ``dot_general`` and ``promote_dtype`` the product goes through
    :func:`jaxsparse.ops.sr_ste_matmul`: the same value and gradients, with the forward product (and
    with ``transposable=True`` also ``dY Wᵀ``) on cuSPARSELt where it can run (bfloat16 compute, see there).

    Args:
      inputs: ``(..., in_features)`` (named as ``nnx.Linear``'s).
      out_sharding: as ``nnx.Linear``'s (it takes Flax's own product).

    Returns:
      ``(..., out_features)``, in ``dtype`` if set, else the promoted dtype of ``inputs`` and the parameters.

    Raises:
      ValueError: ``inputs`` whose last axis is not ``in_features``.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import NMLinear
    >>> layer = NMLinear(8, 4, n=2, m=4, rngs=nnx.Rngs(0))
    >>> x = jnp.ones((3, 8))
    >>> y = layer(x)
    >>> y.shape, bool(jnp.allclose(y, x @ (layer.kernel[...] * layer.mask) + layer.bias[...], atol=1e-6))
    ((3, 4), True)
    """
    check_layer_inputs(self, inputs)
    p = self.promote_dtype
    fast = (p.n, p.m, p.axis) == (2, 4, 0) and p.base is dtypes.promote_dtype and self.dot_general is lax.dot_general
    if not fast or out_sharding is not None:
      return super().__call__(inputs, out_sharding=out_sharding)
    kernel = self.kernel[...]
    bias = self.bias[...] if self.bias is not None else None
    # The compute dtypes as Flax's promotion gives them; the kernel is pruned before its cast.
    inputs, cast_kernel, bias = p.base((inputs, kernel, bias), dtype=self.dtype)
    y = ops.sr_ste_matmul(
        inputs,
        kernel,
        p.n,
        p.m,
        decay=p.decay,
        dtype=cast_kernel.dtype,
        precision=self.precision,
        preferred_element_type=self.preferred_element_type,
        transposable=p.transposable,
    )
    if bias is not None:
      y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y

  @classmethod
  def from_dense(
      cls, linear: nnx.Linear, *, n: int = 2, m: int = 4, sr_ste_decay: float = 2e-4, transposable: bool = False
  ) -> NMLinear:
    """An ``NMLinear`` with ``linear``'s dense kernel, bias and options, ready to train with SR-STE.

    Args:
      linear: an ``nnx.Linear`` (not changed; not a subclass, except an ``NMLinear``, whose dense kernel is
        taken); its kernel, bias and options (``dtype``, ``precision``, ``dot_general``...) carry over, and so do
        the partitioning names (``nnx.with_partitioning``) of kernel and bias and their placement on a mesh, as
        :func:`jaxsparse.sparsify` gives them.
      n, m: keep ``n`` of every ``m`` input features; ``m`` must divide ``in_features``.
      sr_ste_decay, transposable: as in the constructor.

    Returns:
      An ``NMLinear`` holding ``linear``'s dense kernel and bias; its forward pass prunes the kernel.

    Raises:
      TypeError: ``linear`` is not an ``nnx.Linear``.
      ValueError: bad ``n``, ``m``, ``sr_ste_decay`` or ``transposable`` for this kernel.

    >>> from flax import nnx
    >>> from jaxsparse.layers import NMLinear
    >>> dense = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
    >>> layer = NMLinear.from_dense(dense)
    >>> bool((layer.pruned_kernel() == dense.kernel[...] * layer.mask).all())
    True
    """
    if not isinstance(linear, NMLinear):  # an NMLinear's kernel is its dense SR-STE weight: pruned again here
      linear = check_linear(linear, cls.__name__, options=False)
    layer = with_weights(
        cls, linear.kernel[...], bias_of(linear), linear.in_features, linear.out_features, n=n, m=m,
        sr_ste_decay=sr_ste_decay, transposable=transposable, **linear_options(linear),
    )
    return carry_nnx(linear, layer)  # the partitioning names and placement

  def to_dense(self) -> nnx.Linear:
    """An ``nnx.Linear`` holding the pruned kernel: the same function as this layer's forward pass.

    Returns:
      An ``nnx.Linear`` with kernel :meth:`pruned_kernel`, this layer's bias and options. Partitioning names
      (``nnx.with_partitioning``) of kernel and bias carry over (and their placement on a mesh), as
      :func:`jaxsparse.densify` gives them.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import NMLinear
    >>> layer = NMLinear(8, 4, rngs=nnx.Rngs(0))
    >>> dense = layer.to_dense()
    >>> type(dense).__name__, bool(jnp.allclose(dense(jnp.ones((2, 8))), layer(jnp.ones((2, 8))), atol=1e-6))
    ('Linear', True)

    Raises:
      ValueError: this layer is a stack of layers (built by ``nnx.vmap``); call it per layer:
        ``nnx.vmap(lambda layer: layer.to_dense(), in_axes=0, out_axes=0)(stack)``.
    """
    check_one_layer(self, what="to_dense()")
    dense = with_weights(
        nnx.Linear, self.pruned_kernel(), bias_of(self), self.in_features, self.out_features, **linear_options(self)
    )
    return carry_back_nnx(self, dense)  # the partitioning names and placement

  def to_compressed(self, *, implementation: ops.NMImplementation | None = None,
                    cusparselt_copy: bool = True,
                    storage: typing.Literal["values", "cusparselt", "auto"] = "values") -> CompressedNMLinear:
    """An inference layer storing the compressed kernel and multiplying with :func:`jaxsparse.ops.nm_matmul`.

    A layer with a custom ``dot_general`` cannot be compressed (the compressed product is
    :func:`jaxsparse.ops.nm_matmul`, which would drop it); :meth:`to_dense` keeps it.

    Args:
      implementation, cusparselt_copy, storage: as in :class:`CompressedNMLinear`.

    Returns:
      A :class:`CompressedNMLinear` holding :meth:`pruned_kernel` compressed, this layer's bias, ``dtype``,
      ``precision`` and ``preferred_element_type``: the same function as this layer's forward pass. Partitioning
      names (``nnx.with_partitioning``) carry over (and their placement on a mesh), as :func:`jaxsparse.compress`
      gives them: the kept values take the kernel's, the packed positions its columns', the bias its own.

    Raises:
      ValueError: a custom ``dot_general``, or a ``storage`` the weight cannot take (see
        :class:`CompressedNMLinear`).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import NMLinear
    >>> layer = NMLinear(64, 32, rngs=nnx.Rngs(0))
    >>> small = layer.to_compressed()
    >>> small.weight.values.shape, bool(jnp.allclose(small(jnp.ones((2, 64))), layer(jnp.ones((2, 64))), atol=1e-5))
    ((32, 32), True)
    """
    if self.dot_general is not lax.dot_general:
      raise ValueError(
          f"to_compressed cannot keep this layer's custom dot_general={self.dot_general!r}: CompressedNMLinear "
          "multiplies with jaxsparse.ops.nm_matmul and would compute another function. Use to_dense() (which keeps "
          "it), or build the NMLinear with Flax's default dot_general (jax.lax.dot_general)."
      )
    weight = NMSparseMatrix.from_dense(self.pruned_kernel(), self.n, self.m, axis=0)
    bias = bias_of(self)
    compressed = CompressedNMLinear(
        weight,
        bias,
        dtype=self.dtype,
        precision=self.precision,
        promote_dtype=base_promote(self),
        preferred_element_type=self.preferred_element_type,
        implementation=implementation,
        cusparselt_copy=cusparselt_copy,
        storage=storage,
    )
    return carry_nnx(self, compressed)  # the partitioning names and placement

  def to_linen_variables(self) -> dict[str, dict[str, jax.Array]]:
    """Variables for :class:`jaxsparse.layers.linen.NMDense` with the same settings, holding these weights.

    Returns:
      ``{"params": {"kernel", "bias"?}}``: the dense ``(in_features, out_features)`` kernel (pruned in the
      forward pass) and the ``(out_features,)`` bias when the layer has one.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import NMLinear
    >>> from jaxsparse.layers.linen import NMDense
    >>> layer = NMLinear(8, 4, rngs=nnx.Rngs(0))
    >>> y = NMDense(4).apply(layer.to_linen_variables(), jnp.ones((2, 8)))
    >>> bool(jnp.allclose(y, layer(jnp.ones((2, 8))), atol=1e-6))
    True
    """
    params = {"kernel": self.kernel[...]}
    if self.bias is not None:
      params["bias"] = self.bias[...]
    return {"params": params}


class NMConv(_NMMixin, nnx.Conv):
  """``nnx.Conv`` with an N:M-sparse kernel trained from scratch by SR-STE.

  The groups of ``m`` run along the input channels: axis -2 (``cin``) of the ``(*kernel_size, cin,
  cout)`` kernel, the grouping of NVIDIA's and PyTorch's 2:4 convolutions. Every ``nnx.Conv``
  option works (strides, padding modes, dilations, feature groups, the weight ``mask``, which is
  applied before the N:M pruning). The N:M pattern is :attr:`nm_mask`; ``mask`` stays the Flax
  weight mask.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxsparse.layers import NMConv
  >>> conv = NMConv(8, 16, (3, 3), n=2, m=4, rngs=nnx.Rngs(0))
  >>> conv.kernel.shape, int(conv.nm_mask.sum()), conv(jnp.ones((2, 6, 6, 8))).shape
  ((3, 3, 8, 16), 576, (2, 6, 6, 16))

  Args:
    in_features: input channels; ``in_features // feature_group_count`` a multiple of ``m``.
    out_features, kernel_size, strides, padding, input_dilation, kernel_dilation,
      feature_group_count, use_bias, mask, dtype, param_dtype, precision, kernel_init, bias_init,
      conv_general_dilated, preferred_element_type, rngs: as ``nnx.Conv``; ``param_dtype`` a real floating
      dtype (a complex one raises ``TypeError``), while ``dtype`` and the inputs may be complex.
    n, m: keep ``n`` of every ``m`` input channels, ``0 < n < m``.
    sr_ste_decay: SR-STE's decay of the pruned weights, ``>= 0``; ``0`` gives plain STE.
    transposable: prune with a mask that is N:M along the output channels too (``m <= 4``,
      ``out_features`` a multiple of ``m``; see :class:`NMLinear`).
    promote_dtype: as ``nnx.Conv``; it runs after the N:M pruning.
    **kwargs: other ``nnx.Conv`` keyword arguments (e.g. ``kernel_metadata``).
  """

  def __init__(
      self,
      in_features: int,
      out_features: int,
      kernel_size: int | tuple[int, ...],
      strides: int | tuple[int, ...] | None = 1,
      *,
      n: int = 2,
      m: int = 4,
      sr_ste_decay: float = 2e-4,
      transposable: bool = False,
      padding: PaddingLike = "SAME",
      input_dilation: int | tuple[int, ...] | None = 1,
      kernel_dilation: int | tuple[int, ...] | None = 1,
      feature_group_count: int = 1,
      use_bias: bool = True,
      mask: jax.Array | None = None,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      precision: lax.PrecisionLike = None,
      kernel_init: Initializer = default_kernel_init,
      bias_init: Initializer = default_bias_init,
      conv_general_dilated: Callable[..., jax.Array] = lax.conv_general_dilated,
      promote_dtype: Callable[..., Any] = dtypes.promote_dtype,
      preferred_element_type: Dtype | None = None,
      rngs: nnx.Rngs,
      **kwargs: Any,
  ):
    check_passthrough_kwargs(type(self), nnx.Conv, kwargs)
    n, m = _nm_masks.check_nm(n, m)
    _utils.check_positive_int(in_features, name="in_features")
    _utils.check_positive_int(out_features, name="out_features")
    kernel_size = check_kernel_size(kernel_size)
    steps = check_conv_steps(strides=strides, input_dilation=input_dilation, kernel_dilation=kernel_dilation)
    padding = check_padding(type(self), padding, len(kernel_size))
    use_bias = check_use_bias(use_bias)
    feature_group_count = check_feature_groups(feature_group_count, in_features, out_features)
    check_in_features(in_features // feature_group_count, m, name="in_features // feature_group_count")
    transposable = check_transposable_layer(transposable, out_features, m)
    decay = _utils.check_decay(sr_ste_decay, name="sr_ste_decay")
    check_dtypes(type(self), dtype=dtype, param_dtype=param_dtype, inexact=promote_dtype is dtypes.promote_dtype)
    check_trained_dtype(type(self), param_dtype=param_dtype)  # SR-STE trains it: float weights
    _utils.check_precision(precision, owner=type(self).__name__)
    nm_promote = NMPromote(n, m, decay, -2, promote_dtype, transposable=transposable)
    super().__init__(
        in_features,
        out_features,
        kernel_size,
        steps["strides"],
        padding=padding,
        input_dilation=steps["input_dilation"],
        kernel_dilation=steps["kernel_dilation"],
        feature_group_count=feature_group_count,
        use_bias=use_bias,
        mask=mask,
        dtype=dtype,
        param_dtype=param_dtype,
        precision=precision,
        kernel_init=kernel_init,
        bias_init=bias_init,
        conv_general_dilated=conv_general_dilated,
        promote_dtype=nm_promote,
        preferred_element_type=preferred_element_type,
        rngs=rngs,
        **kwargs,
    )

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    """``nnx.Conv``'s forward with the SR-STE-pruned kernel.

    Args:
      inputs: channels-last ``(..., *spatial, in_features)``, as ``nnx.Conv`` takes them.
      out_sharding: as ``nnx.Conv``'s.

    Returns:
      ``(..., *out_spatial, out_features)``, as ``nnx.Conv`` returns it, in ``dtype`` if set.

    Raises:
      ValueError: ``inputs`` whose last axis is not ``in_features``.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import NMConv
    >>> conv = NMConv(8, 16, (3, 3), rngs=nnx.Rngs(0))
    >>> x = jnp.ones((2, 6, 6, 8))
    >>> bool(jnp.allclose(conv(x), conv.to_dense()(x), atol=1e-5))
    True
    """
    check_layer_inputs(self, inputs)
    return super().__call__(inputs, out_sharding=out_sharding)

  def _masked_input_kernel(self) -> jax.Array:
    k = self.kernel[...]
    return k if self.mask is None else k * self.mask

  @classmethod
  def from_dense(
      cls, conv: nnx.Conv, *, n: int = 2, m: int = 4, sr_ste_decay: float = 2e-4, transposable: bool = False
  ) -> NMConv:
    """An ``NMConv`` with ``conv``'s dense kernel, bias and every option, ready to train with SR-STE.

    Args:
      conv: an ``nnx.Conv`` (not changed); the partitioning names (``nnx.with_partitioning``) of its kernel and
        bias carry over, and their placement on a mesh, as :func:`jaxsparse.sparsify` gives them.
      n, m: keep ``n`` of every ``m`` input channels; ``m`` must divide ``in_features // feature_group_count``.
      sr_ste_decay, transposable: as in the constructor.

    Returns:
      An ``NMConv`` holding ``conv``'s dense kernel and bias; its forward pass prunes the kernel.

    Raises:
      TypeError: ``conv`` is not an ``nnx.Conv``.
      ValueError: bad ``n``, ``m``, ``sr_ste_decay`` or ``transposable`` for this kernel.

    >>> from flax import nnx
    >>> from jaxsparse.layers import NMConv
    >>> NMConv.from_dense(nnx.Conv(8, 16, (3, 3), rngs=nnx.Rngs(0)), n=1, m=4).nm_mask.mean()
    Array(0.25, dtype=float32)
    """
    if not isinstance(conv, nnx.Conv):
      raise TypeError(f"conv must be a flax.nnx.Conv, got {type(conv).__name__}.")
    layer = with_weights(
        cls, conv.kernel[...], bias_of(conv), conv.in_features, conv.out_features, conv.kernel_size, n=n, m=m,
        sr_ste_decay=sr_ste_decay, transposable=transposable, **conv_options(conv),
    )
    return carry_nnx(conv, layer)  # the partitioning names and placement

  def to_dense(self) -> nnx.Conv:
    """An ``nnx.Conv`` holding the pruned kernel: the same function as this layer's forward pass.

    Returns:
      An ``nnx.Conv`` with kernel :meth:`pruned_kernel`, this layer's bias and every option. Partitioning names
      (``nnx.with_partitioning``) of kernel and bias carry over (and their placement on a mesh), as
      :func:`jaxsparse.densify` gives them.

    >>> from flax import nnx
    >>> from jaxsparse.layers import NMConv
    >>> conv = NMConv(8, 16, (3, 3), rngs=nnx.Rngs(0))
    >>> bool((conv.to_dense().kernel[...] == conv.pruned_kernel()).all())
    True

    Raises:
      ValueError: this layer is a stack of layers (built by ``nnx.vmap``); call it per layer:
        ``nnx.vmap(lambda layer: layer.to_dense(), in_axes=0, out_axes=0)(stack)``.
    """
    check_one_layer(self, what="to_dense()")
    dense = with_weights(
        nnx.Conv, self.pruned_kernel(), bias_of(self), self.in_features, self.out_features, self.kernel_size,
        **conv_options(self),
    )
    return carry_back_nnx(self, dense)  # the partitioning names and placement

  def to_compressed(self) -> NMSparseMatrix:
    """The pruned kernel compressed along ``cin`` (for storage and export; compute with :meth:`to_dense`).

    Returns:
      An :class:`jaxsparse.NMSparseMatrix` of the kernel's shape ``(*kernel_size, cin, cout)`` and dtype, grouped
      along axis ``ndim - 2``.

    >>> from flax import nnx
    >>> from jaxsparse.layers import NMConv
    >>> w = NMConv(8, 16, (3, 3), rngs=nnx.Rngs(0)).to_compressed()
    >>> w.shape, w.values.shape, w.axis
    ((3, 3, 8, 16), (3, 3, 4, 16), 2)
    """
    return NMSparseMatrix.from_dense(self.pruned_kernel(), self.n, self.m, axis=-2)

  def to_linen_variables(self) -> dict[str, dict[str, jax.Array]]:
    """Variables for :class:`jaxsparse.layers.linen.NMConv` with the same settings, holding these weights.

    Returns:
      ``{"params": {"kernel", "bias"?}}``: the dense ``(*kernel_size, cin, cout)`` kernel (pruned in the
      forward pass) and the ``(cout,)`` bias when the layer has one.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import NMConv
    >>> from jaxsparse.layers import linen
    >>> conv = NMConv(8, 16, (3, 3), rngs=nnx.Rngs(0))
    >>> x = jnp.ones((2, 6, 6, 8))
    >>> y = linen.NMConv(16, (3, 3)).apply(conv.to_linen_variables(), x)
    >>> bool(jnp.allclose(y, conv(x), atol=1e-5))
    True
    """
    params = {"kernel": self.kernel[...]}
    if self.bias is not None:
      params["bias"] = self.bias[...]
    return {"params": params}
