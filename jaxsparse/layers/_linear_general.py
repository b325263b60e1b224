"""``SparseLinearGeneral``: ``nnx.LinearGeneral`` (e.g. attention projections) over a 2-D sparse layer."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsparse import _utils
from jaxsparse.formats._masks import replicated
from jaxsparse.layers._checks import check_dtypes
from jaxsparse.layers._common import check_one_layer
from jaxsparse.layers._common import with_weights
from jaxsparse.layers._partitioning import FOLDED
from jaxsparse.layers._partitioning import carry_back_nnx

__all__ = ["SparseLinearGeneral"]


def _features(value: Any, *, name: str) -> tuple[int, ...]:
  """``in_features`` / ``out_features`` as a tuple of positive ints (an int is one axis, as in nnx.LinearGeneral)."""
  return _utils.check_dims((value,) if isinstance(value, numbers.Integral) else value, name=name, minimum=1)


def _same(name: str, a: Any, b: Any) -> bool:
  if name == "dtype" and a is not None and b is not None:
    return jnp.dtype(a) == jnp.dtype(b)
  return a == b


class SparseLinearGeneral(nnx.Module):
  """An ``nnx.LinearGeneral`` over trailing axes, computed by a 2-D sparse layer on flattened features.

  ``x`` of shape ``(..., *in_features)`` is reshaped to ``(..., prod(in_features))``, multiplied by
  ``layer`` and reshaped to ``(..., *out_features)``: the attention projections of
  ``nnx.MultiHeadAttention`` (``(d,) -> (heads, head_dim)`` and back) become sparse layers.

  Attributes:
    layer: the 2-D sparse layer (``BlockSparseLinear``, ``MaskedLinear`` or ``NMLinear``).
    in_features, out_features: tuples, as in ``nnx.LinearGeneral``.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxsparse.layers import MaskedLinear, SparseLinearGeneral
  >>> inner = MaskedLinear(16, 8, sparsity=0.5, rngs=nnx.Rngs(0))  # (16,) -> (2, 4): two heads of 4
  >>> layer = SparseLinearGeneral(inner, in_features=(16,), out_features=(2, 4))
  >>> layer(jnp.ones((3, 16))).shape
  (3, 2, 4)
  >>> dense = layer.to_dense()
  >>> type(dense).__name__, dense.kernel.shape
  ('LinearGeneral', (16, 2, 4))

  Args:
    layer: the 2-D sparse layer, ``(prod(in_features), prod(out_features))``.
    in_features, out_features: ints or tuples of positive ints: the trailing input axes and the output axes.
    dtype, precision: the wrapped layer's, which compute the product and which :meth:`to_dense` keeps; ``None``
      takes them from ``layer``, another value than ``layer``'s raises ``ValueError``.
  """

  _kernel_layout = FOLDED  # its wrapped (K, N) kernel is the dense one folded (partitioning names, _partitioning)

  def __init__(self, layer: nnx.Module, *, in_features: int | tuple[int, ...], out_features: int | tuple[int, ...],
               dtype: Any = None, precision: Any = None):
    self.layer = layer
    self.in_features = _features(in_features, name="in_features")
    self.out_features = _features(out_features, name="out_features")
    inner = (getattr(layer, "in_features", None), getattr(layer, "out_features", None))
    if inner != (math.prod(self.in_features), math.prod(self.out_features)):
      raise ValueError(
          f"in_features={self.in_features} and out_features={self.out_features} must multiply to the wrapped "
          f"layer's (in_features, out_features)={inner}."
      )
    # The product is the wrapped layer's: so are its dtype and precision, which to_dense must reproduce.
    check_dtypes(SparseLinearGeneral, dtype=dtype, inexact=False)  # it must be the wrapped layer's, checked there
    for name, given in (("dtype", dtype), ("precision", precision)):
      inner_value = getattr(layer, name, None)
      if given is not None and not _same(name, given, inner_value):
        raise ValueError(
            f"{name}={given!r} differs from the wrapped layer's {name}={inner_value!r}, which computes the product; "
            f"leave {name}=None (it then takes the wrapped layer's) or build the wrapped layer with it."
        )
    self.dtype = getattr(layer, "dtype", None) if dtype is None else dtype
    self.precision = getattr(layer, "precision", None) if precision is None else precision

  def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
    """Flattens the trailing ``in_features`` axes, applies :attr:`layer`, and splits the ``out_features`` axes.

    Args:
      inputs: ``(..., *in_features)`` (named as ``nnx.LinearGeneral``'s).
      out_sharding: not supported; must be ``None``.

    Returns:
      ``(..., *out_features)``, in the wrapped layer's compute dtype.

    Raises:
      ValueError: ``inputs`` whose trailing axes are not ``in_features``.
      NotImplementedError: an ``out_sharding``.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import MaskedLinear, SparseLinearGeneral
    >>> layer = SparseLinearGeneral(MaskedLinear(8, 6, sparsity=0.5, rngs=nnx.Rngs(0)), in_features=(2, 4),
    ...                             out_features=(3, 2))
    >>> x = jnp.ones((5, 2, 4))
    >>> y = layer(x)
    >>> y.shape, bool(jnp.allclose(y, layer.layer(x.reshape(5, 8)).reshape(5, 3, 2)))
    ((5, 3, 2), True)
    """
    if out_sharding is not None:
      raise NotImplementedError("SparseLinearGeneral does not take out_sharding.")
    x = inputs  # named as nnx.LinearGeneral's
    n_in = len(self.in_features)
    if tuple(jnp.shape(x)[-n_in:]) != self.in_features or jnp.ndim(x) < n_in:
      raise ValueError(f"inputs must have shape (..., {', '.join(map(str, self.in_features))}) (trailing axes "
                       f"in_features), got inputs.shape={tuple(jnp.shape(x))}.")
    batch = x.shape[: x.ndim - n_in]
    y = self.layer(x.reshape(*batch, math.prod(self.in_features)))
    return y.reshape(*batch, *self.out_features)

  def to_dense(self) -> nnx.LinearGeneral:
    """The ``nnx.LinearGeneral`` holding the pruned kernel, reshaped to ``(*in_features, *out_features)``.

    Returns:
      An ``nnx.LinearGeneral`` over the trailing ``in_features`` axes, with the wrapped layer's bias (reshaped to
      ``out_features``), ``dtype`` and ``precision``: the same function as this layer. Partitioning names
      (``nnx.with_partitioning``) of kernel and bias come back (and their placement on a mesh), as
      :func:`jaxsparse.densify` gives them: those :func:`jaxsparse.sparsify` recorded, else the wrapped layer's
      unfolded, each name on the leading dim of its group.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import MaskedLinear, SparseLinearGeneral
    >>> layer = SparseLinearGeneral(MaskedLinear(8, 6, sparsity=0.5, rngs=nnx.Rngs(0)), in_features=(2, 4),
    ...                             out_features=(3, 2))
    >>> x = jnp.ones((5, 2, 4))
    >>> bool(jnp.allclose(layer.to_dense()(x), layer(x), atol=1e-6))
    True

    Raises:
      ValueError: this layer is a stack of layers (built by ``nnx.vmap``); call it per layer:
        ``nnx.vmap(lambda layer: layer.to_dense(), in_axes=0, out_axes=0)(stack)``.
    """
    check_one_layer(self.layer, what="to_dense()", owner=self)
    lin = self.layer.to_dense()
    # Weights split over explicit mesh axes are gathered to be unfolded (explicit axes refuse most reshapes of a split
    # dim); carry_back_nnx splits the dense ones by their names.
    kernel = replicated(lin.kernel[...]).reshape(*self.in_features, *self.out_features)
    dense = with_weights(
        nnx.LinearGeneral,
        kernel,
        None if lin.bias is None else replicated(lin.bias[...]).reshape(self.out_features),
        self.in_features,
        self.out_features,
        axis=tuple(range(-len(self.in_features), 0)),
        use_bias=lin.bias is not None,
        dtype=self.dtype,
        precision=self.precision,
        rngs=nnx.Rngs(0),
    )
    return carry_back_nnx(self, dense)  # the partitioning names and placement
