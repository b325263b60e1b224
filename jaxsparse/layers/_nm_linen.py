"""N:M-sparse Flax Linen layers trained with SR-STE: ``NMDense`` and ``NMConv``.

Linen twins of :class:`jaxsparse.layers.NMLinear` / :class:`jaxsparse.layers.NMConv`. Each wraps
``nn.Dense`` / ``nn.Conv`` in its own scope (``nn.share_scope``), so the variables are exactly those
of the Flax layer, ``{"params": {"kernel", "bias"}}``, and the only change is the SR-STE pruning of
the kernel through Flax's ``promote_dtype`` hook (:class:`jaxsparse.layers._common.NMPromote`).
Given the same parameters, NNX and Linen layers compute identical outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype as linen_promote_dtype
from flax.linen.linear import default_kernel_init
from flax.typing import Dtype
from flax.typing import Initializer
from flax.typing import PaddingLike
from jax import lax

from jaxsparse import _utils
from jaxsparse import ops
from jaxsparse.formats import _nm_masks
from jaxsparse.layers._checks import check_conv_steps
from jaxsparse.layers._checks import check_dtypes
from jaxsparse.layers._checks import check_feature_groups
from jaxsparse.layers._checks import check_in_features
from jaxsparse.layers._checks import check_input
from jaxsparse.layers._checks import check_kernel_size
from jaxsparse.layers._checks import check_padding
from jaxsparse.layers._checks import check_trained_dtype
from jaxsparse.layers._checks import check_transposable_layer
from jaxsparse.layers._checks import check_use_bias
from jaxsparse.layers._common import NMPromote
from jaxsparse.layers._common import check_known_in_features
from jaxsparse.layers._common import existing_shape

__all__ = ["NMConv", "NMDense"]


def _check_fields(module: nn.Module) -> None:
  _nm_masks.check_nm(module.n, module.m)
  _utils.check_positive_int(module.features, name="features")
  check_use_bias(module.use_bias)
  _utils.check_decay(module.sr_ste_decay, name="sr_ste_decay")
  check_transposable_layer(module.transposable, module.features, module.m, name="features")
  check_dtypes(type(module), dtype=module.dtype, param_dtype=module.param_dtype,
               inexact=module.promote_dtype is linen_promote_dtype)
  check_trained_dtype(type(module), param_dtype=module.param_dtype)  # SR-STE trains it: float weights
  _utils.check_precision(module.precision, owner=type(module).__name__)


def _wrap(module: nn.Module, cls: type[nn.Module], *, axis: int) -> nn.Module:
  """``cls`` built from ``module``'s fields of the same names, its ``promote_dtype`` N:M-pruning first."""
  names = {f.name for f in dataclasses.fields(cls) if f.init} - {"parent", "name", "promote_dtype"}
  options = {f.name: getattr(module, f.name) for f in dataclasses.fields(module) if f.name in names}
  if "kernel_size" in options:  # nn.Conv takes a Python int or a sequence, not a NumPy int
    options["kernel_size"] = check_kernel_size(options["kernel_size"])
    options["padding"] = check_padding(type(module), options["padding"], len(options["kernel_size"]))  # ints, tuples
  promote = NMPromote(
      module.n, module.m, float(module.sr_ste_decay), axis, module.promote_dtype, linen=True,
      transposable=module.transposable,
  )
  return cls(**options, promote_dtype=promote)


class NMDense(nn.Module):
  """Linen ``nn.Dense`` with an N:M-sparse kernel trained by SR-STE (twin of ``NMLinear``).

  >>> import jax, jax.numpy as jnp
  >>> from jaxsparse.layers.linen import NMDense
  >>> model = NMDense(32, n=2, m=4)
  >>> variables = model.init(jax.random.key(0), jnp.ones((1, 64)))
  >>> jax.tree.map(jnp.shape, variables)
  {'params': {'bias': (32,), 'kernel': (64, 32)}}
  >>> model.apply(variables, jnp.ones((8, 64))).shape
  (8, 32)

  Attributes:
    features: output size; the input size ``x.shape[-1]`` must be a multiple of ``m``.
    n, m: keep ``n`` of every ``m`` input features, ``0 < n < m``.
    sr_ste_decay: SR-STE's decay of the pruned weights, ``>= 0``; ``0`` gives plain STE.
    transposable: prune with a mask that is N:M along the output features too (see ``NMLinear``).
    use_bias, dtype, param_dtype, precision, kernel_init, bias_init, dot_general,
      dot_general_cls: as ``nn.Dense``; ``param_dtype`` a real floating dtype (a complex one raises
      ``TypeError``: SR-STE prunes by magnitude), while ``dtype`` and the inputs may be complex.
    promote_dtype: as ``nn.Dense``; it runs after the N:M pruning.
  """

  features: int
  _: dataclasses.KW_ONLY
  n: int = 2
  m: int = 4
  sr_ste_decay: float = 2e-4
  transposable: bool = False
  use_bias: bool = True
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  precision: lax.PrecisionLike = None
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = nn.initializers.zeros_init()
  promote_dtype: Callable[..., Any] = linen_promote_dtype
  dot_general: Callable[..., jax.Array] | None = None
  dot_general_cls: Any = None

  def __post_init__(self):
    _check_fields(self)
    super().__post_init__()

  def setup(self):
    self.dense = _wrap(self, nn.Dense, axis=0)
    nn.share_scope(self, self.dense)

  def __call__(self, x: jax.Array) -> jax.Array:
    """Applies the layer to ``x`` of shape ``(..., in_features)``; returns ``(..., features)``.

    For 2:4 with Flax's default ``dot_general`` and ``promote_dtype`` the product goes through
    :func:`jaxsparse.ops.sr_ste_matmul`, as ``NMLinear``'s does: the same value and gradients, with the
    forward product on cuSPARSELt where it can run.

    Args:
      x: ``(..., in_features)``, ``in_features`` a multiple of ``m``.

    Returns:
      ``(..., features)``, in ``dtype`` if set, else the promoted dtype of ``x`` and the parameters.

    Raises:
      ValueError: ``x`` a scalar, ``in_features`` not a multiple of ``m``, or another ``in_features`` than the
        variables hold.

    >>> import jax, jax.numpy as jnp
    >>> from jaxsparse import nm_mask
    >>> from jaxsparse.layers.linen import NMDense
    >>> x = jnp.ones((2, 8))
    >>> variables = NMDense(4).init(jax.random.key(0), x)
    >>> kernel, bias = variables["params"]["kernel"], variables["params"]["bias"]
    >>> bool(jnp.allclose(NMDense(4).apply(variables, x), x @ (kernel * nm_mask(kernel, 2, 4)) + bias, atol=1e-6))
    True
    """
    x = check_input(self, x)
    kernel_shape = existing_shape(self, "params", "kernel")
    check_known_in_features(self, jnp.shape(x), None if kernel_shape is None else kernel_shape[0])
    check_in_features(jnp.shape(x)[-1], self.m, name="x.shape[-1]")
    fast = (self.n, self.m) == (2, 4) and self.promote_dtype is linen_promote_dtype
    if not fast or self.dot_general is not None or self.dot_general_cls is not None or self.is_initializing():
      return self.dense(x)
    kernel = nn.meta.unbox(self.get_variable("params", "kernel"))  # nn.with_partitioning boxes
    bias = nn.meta.unbox(self.get_variable("params", "bias")) if self.use_bias else None
    # The compute dtypes as Flax's promotion gives them; the kernel is pruned before its cast.
    x, cast_kernel, bias = self.promote_dtype(x, kernel, bias, dtype=self.dtype)
    y = ops.sr_ste_matmul(x, kernel, 2, 4, decay=float(self.sr_ste_decay), dtype=cast_kernel.dtype,
                          precision=self.precision, transposable=self.transposable)
    if bias is not None:
      y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


class NMConv(nn.Module):
  """Linen ``nn.Conv`` with an N:M-sparse kernel trained by SR-STE (twin of the NNX ``NMConv``).

  The groups of ``m`` run along the input channels (axis -2 of the kernel). All ``nn.Conv``
  options are passed through; ``mask`` is Flax's weight mask, applied before the N:M pruning.

  >>> import jax, jax.numpy as jnp
  >>> from jaxsparse.layers.linen import NMConv
  >>> model = NMConv(16, (3, 3), n=2, m=4)
  >>> variables = model.init(jax.random.key(0), jnp.ones((1, 6, 6, 8)))
  >>> variables["params"]["kernel"].shape, model.apply(variables, jnp.ones((2, 6, 6, 8))).shape
  ((3, 3, 8, 16), (2, 6, 6, 16))

  Attributes:
    features, kernel_size, strides, padding, input_dilation, kernel_dilation, feature_group_count,
      use_bias, mask, dtype, param_dtype, precision, kernel_init, bias_init, conv_general_dilated,
      conv_general_dilated_cls: as ``nn.Conv``; ``param_dtype`` real (a complex one raises ``TypeError``).
    n, m: keep ``n`` of every ``m`` input channels; ``in_channels // feature_group_count`` must be
      a multiple of ``m``.
    sr_ste_decay: SR-STE's decay of the pruned weights, ``>= 0``; ``0`` gives plain STE.
    transposable: prune with a mask that is N:M along the output channels too (see ``NMLinear``).
    promote_dtype: as ``nn.Conv``; it runs after the N:M pruning.
  """

  features: int
  kernel_size: int | Sequence[int]
  _: dataclasses.KW_ONLY
  n: int = 2
  m: int = 4
  sr_ste_decay: float = 2e-4
  transposable: bool = False
  strides: int | Sequence[int] | None = 1
  padding: PaddingLike = "SAME"
  input_dilation: int | Sequence[int] | None = 1
  kernel_dilation: int | Sequence[int] | None = 1
  feature_group_count: int = 1
  use_bias: bool = True
  mask: jax.Array | None = None
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  precision: lax.PrecisionLike = None
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = nn.initializers.zeros_init()
  promote_dtype: Callable[..., Any] = linen_promote_dtype
  conv_general_dilated: Callable[..., jax.Array] | None = None
  conv_general_dilated_cls: Any = None

  def __post_init__(self):
    _check_fields(self)
    rank = len(check_kernel_size(self.kernel_size))
    check_conv_steps(strides=self.strides, input_dilation=self.input_dilation, kernel_dilation=self.kernel_dilation)
    check_padding(type(self), self.padding, rank)
    super().__post_init__()

  def setup(self):
    self.conv = _wrap(self, nn.Conv, axis=-2)
    nn.share_scope(self, self.conv)

  def __call__(self, x: jax.Array) -> jax.Array:
    """Applies the convolution with the SR-STE-pruned kernel, as ``nn.Conv`` does.

    Args:
      x: channels-last ``(..., *spatial, in_channels)``, ``in_channels // feature_group_count`` a multiple of
        ``m``.

    Returns:
      ``(..., *out_spatial, features)``, as ``nn.Conv`` returns it.

    Raises:
      ValueError: ``x`` a scalar, channels not grouped by ``m``, or another channel count than the variables hold.

    >>> import jax, jax.numpy as jnp
    >>> from jaxsparse.layers.linen import NMConv
    >>> x = jnp.ones((1, 6, 6, 8))
    >>> variables = NMConv(16, (3, 3)).init(jax.random.key(0), x)
    >>> NMConv(16, (3, 3)).apply(variables, x).shape
    (1, 6, 6, 16)
    """
    x = check_input(self, x)
    kernel_shape = existing_shape(self, "params", "kernel")
    expected = None if kernel_shape is None else kernel_shape[-2] * self.feature_group_count
    check_known_in_features(self, jnp.shape(x), expected)
    cin = jnp.shape(x)[-1]
    check_feature_groups(self.feature_group_count, cin, self.features, in_name="in_channels (x.shape[-1])",
                         out_name="features")
    check_in_features(cin // self.feature_group_count, self.m, name="in_channels // feature_group_count")
    return self.conv(x)
