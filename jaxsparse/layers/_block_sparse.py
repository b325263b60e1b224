"""Flax NNX layers over :mod:`jaxsparse.ops`: ``BlockSparseLinear`` and ``MaskedLinear``.

Both layers choose their sparsity pattern once, at construction, and keep it as non-trainable
:class:`SparsityPattern` variables next to the trainable ``nnx.Param`` kernel and bias, so
``nnx.Optimizer(model, tx, wrt=nnx.Param)`` never updates it and ``nnx.split(model, nnx.Param,
SparsityPattern)`` separates it.

The module-level helpers below the imports are shared with the Linen modules in ``_linen.py``, so
both front ends run the same computation.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes
from flax.typing import Dtype
from flax.typing import Initializer
from jax import lax

from jaxsparse import _utils
from jaxsparse import ops
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._masks import block_magnitude_mask
from jaxsparse.formats._masks import magnitude_mask
from jaxsparse.formats._masks import random_block_mask
from jaxsparse.formats._masks import top_k_mask
from jaxsparse.ops._masked_matmul import check_mask

__all__ = ["BlockSparseLinear", "MaskedLinear", "SparsityPattern"]

_IMPLEMENTATIONS = (None, *typing.get_args(ops.Implementation))
default_bias_init = nnx.initializers.zeros_init()


class SparsityPattern(nnx.Variable):
  """Non-trainable sparsity structure of a layer: block index arrays or a boolean mask.

  Being neither an ``nnx.Param`` nor differentiable (integer or bool values), it is left alone by
  ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` and by ``nnx.grad``; filter it with
  ``nnx.split(model, nnx.Param, SparsityPattern)`` or ``nnx.state(model, SparsityPattern)``.
  """


# -------------------------------------------------------------------------------------------------
# Shared with the Linen modules.
# -------------------------------------------------------------------------------------------------


def check_implementation(implementation: object) -> str | None:
  if implementation not in _IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {_IMPLEMENTATIONS}, got implementation={implementation!r}.")
  return implementation


def check_masked_implementation(implementation: object) -> str | None:
  """``implementation`` of :func:`jaxsparse.ops.masked_matmul`: ``None``, ``"xla"`` or ``"cpu"``."""
  allowed = (None, *typing.get_args(ops.CpuImplementation))
  if implementation not in allowed:
    raise ValueError(f"implementation must be one of {allowed}, got implementation={implementation!r}.")
  return implementation


def check_kept(kept: int, total: int, *, name: str, value: float, what: str) -> None:
  if kept == 0:
    raise ValueError(f"{name}={value} keeps 0 of {total} {what}; choose a {name} that keeps at least one.")


def concrete(mask: Any, *, name: str) -> np.ndarray:
  """``mask`` as a NumPy array; the pattern of a layer is fixed on the host when it is built."""
  try:
    return np.asarray(mask)
  except jax.errors.TracerArrayConversionError as e:
    raise ValueError(
        f"{name} must be concrete: sparse layers fix their pattern on the host when they are built, "
        "so build (or Linen-`init`) them outside `jit`."
    ) from e


def check_block_mask(block_mask: Any, grid: tuple[int, int]) -> np.ndarray:
  mask = concrete(block_mask, name="block_mask")
  if mask.shape != grid:
    raise ValueError(
        f"block_mask must have shape (in_features // bk, out_features // bn) = {grid}, got {mask.shape}."
    )
  return np.asarray(check_mask(mask, grid, name="block_mask"))


def block_sparse_kernel_init(nnz_blocks: int, grid: tuple[int, int]) -> Initializer:
  """Truncated normal for ``(nnz_blocks, bk, bn)`` with variance ``1 / (density * in_features)``.

  With ``density = nnz_blocks / (kb * nb)`` and ``in_features = kb * bk``: ``variance_scaling`` with
  the block axis as a batch axis has ``fan_in = bk``, so ``scale = nb / nnz_blocks``. An output unit
  sums over ``density * in_features`` kept inputs on average, so outputs keep the variance that
  ``lecun_normal`` gives a dense layer.
  """
  return nnx.initializers.variance_scaling(
      grid[1] / nnz_blocks, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=0
  )


def random_mask(key: jax.Array, shape: tuple[int, int], kept: int) -> jax.Array:
  """A uniformly random bool mask of ``shape`` keeping exactly ``kept`` entries."""
  return top_k_mask(jax.random.uniform(key, shape), kept)


def masked_kernel_init(kept: int | jax.Array, size: int) -> Initializer:
  """Truncated normal for ``(in, out)`` with variance ``1 / (density * in_features)``, ``density = kept / size``."""
  return nnx.initializers.variance_scaling(size / jnp.maximum(kept, 1), "fan_in", "truncated_normal")


def block_sparse_apply(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    index_arrays: Mapping[str, jax.Array],
    *,
    shape: tuple[int, int],
    block_shape: tuple[int, int],
    dtype: Dtype | None,
    implementation: str | None,
    precision: lax.PrecisionLike,
) -> jax.Array:
  x, kernel, bias = dtypes.promote_dtype((x, kernel, bias), dtype=dtype)
  w = BlockSparseMatrix.from_index_arrays(kernel, dict(index_arrays), shape=shape, block_shape=block_shape)
  y = ops.block_sparse_matmul(x, w, implementation=implementation, precision=precision)
  return y if bias is None else y + bias


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


def _check_linear(linear: object) -> nnx.Linear:
  if not isinstance(linear, nnx.Linear):
    raise TypeError(f"linear must be a flax.nnx.Linear, got {type(linear).__name__}.")
  return linear


def _dense_linear(kernel: jax.Array, bias: jax.Array | None, *, dtype, precision) -> nnx.Linear:
  linear = nnx.Linear(
      kernel.shape[0],
      kernel.shape[1],
      use_bias=bias is not None,
      dtype=dtype,
      param_dtype=kernel.dtype,
      precision=precision,
      kernel_init=nnx.initializers.zeros_init(),
      rngs=nnx.Rngs(0),
  )
  linear.kernel[...] = kernel
  if bias is not None:
    linear.bias[...] = bias
  return linear


# -------------------------------------------------------------------------------------------------
# Layers.
# -------------------------------------------------------------------------------------------------


class BlockSparseLinear(nnx.Module):
  """A linear layer ``y = x @ W + b`` whose ``W`` keeps only some ``(bk, bn)`` blocks.

  The pattern is fixed when the layer is built: ``round(density * blocks)`` blocks chosen uniformly
  at random from ``rngs.params()`` (or the blocks of ``block_mask``). Only the kept blocks are
  parameters, and the product runs through :func:`jaxsparse.ops.block_sparse_matmul`, which never
  builds the dense ``(in_features, out_features)`` weight.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxsparse.layers import BlockSparseLinear
  >>> layer = BlockSparseLinear(64, 96, density=0.5, block_shape=(32, 32), rngs=nnx.Rngs(0))
  >>> layer.kernel.shape, layer.block_mask.shape, layer.density
  ((3, 32, 32), (2, 3), 0.5)
  >>> layer(jnp.ones((4, 64))).shape
  (4, 96)

  Initialisation: by default the kept blocks are drawn from a truncated normal with variance
  ``1 / (density * in_features)``. Each output sums ``density * in_features`` nonzero terms on
  average, so its variance matches what ``nnx.Linear``'s default ``lecun_normal`` (variance
  ``1 / in_features``) gives the dense layer this one replaces.

  Attributes:
    kernel: ``nnx.Param`` of shape ``(nnz_blocks, bk, bn)``, the kept blocks in row-major block
      order (by block row, then block column).
    bias: ``nnx.Param`` of shape ``(out_features,)``, or ``None``.
    pattern: ``nnx.Dict`` of :class:`SparsityPattern` int32 arrays, keyed like
      :meth:`jaxsparse.BlockSparseMatrix.index_arrays`.

  Args:
    in_features: input size ``K``.
    out_features: output size ``N``.
    density: fraction of blocks kept, in (0, 1]. Give exactly one of ``density`` and
      ``block_mask``.
    block_shape: ``(bk, bn)`` dividing ``(in_features, out_features)``.
    use_bias: whether to add a bias.
    dtype: computation dtype; ``None`` infers it from the input and parameters, like ``nnx.Linear``.
    param_dtype: storage dtype of kernel and bias.
    kernel_init: called as ``kernel_init(key, (nnz_blocks, bk, bn), param_dtype)``; ``None`` uses the
      variance-preserving default above.
    bias_init: called as ``bias_init(key, (out_features,), param_dtype)``.
    implementation: backend of :func:`jaxsparse.ops.block_sparse_matmul`: ``None`` (best for the
      platform), ``"xla"`` or ``"pallas"``.
    precision: passed to the products.
    block_mask: concrete bool ``(in_features // bk, out_features // bn)`` choosing the blocks.
    rngs: ``nnx.Rngs``; the ``params`` stream draws the pattern, kernel and bias.
  """

  def __init__(
      self,
      in_features: int,
      out_features: int,
      *,
      density: float | None = None,
      block_shape: tuple[int, int] = (32, 32),
      use_bias: bool = True,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      kernel_init: Initializer | None = None,
      bias_init: Initializer = default_bias_init,
      implementation: ops.Implementation | None = None,
      precision: lax.PrecisionLike = None,
      block_mask: Any = None,
      rngs: nnx.Rngs,
  ):
    in_features = _utils.check_positive_int(in_features, name="in_features")
    out_features = _utils.check_positive_int(out_features, name="out_features")
    bk, bn = _utils.check_block_shape(block_shape, (in_features, out_features))
    grid = (in_features // bk, out_features // bn)
    self.implementation = check_implementation(implementation)
    if (density is None) == (block_mask is None):
      raise ValueError(
          f"Pass exactly one of density= and block_mask=, got density={density!r} and "
          f"block_mask={'None' if block_mask is None else 'an array'}."
      )
    if block_mask is None:
      density = _utils.check_density(density)
      blocks = grid[0] * grid[1]
      check_kept(_utils.kept_count(density, blocks), blocks, name="density", value=density, what="blocks")
      block_mask = random_block_mask(rngs.params(), (in_features, out_features), (bk, bn), density)
      block_mask = concrete(block_mask, name="block_mask")
    else:
      block_mask = check_block_mask(block_mask, grid)
    nnz = int(np.count_nonzero(block_mask))
    if nnz == 0:
      raise ValueError("block_mask keeps no block; keep at least one.")
    if kernel_init is None:
      kernel_init = block_sparse_kernel_init(nnz, grid)
    kernel = kernel_init(rngs.params(), (nnz, bk, bn), param_dtype)
    w = BlockSparseMatrix.from_block_mask(block_mask, kernel)
    self.kernel = nnx.Param(w.data)
    self.pattern = nnx.Dict({f: SparsityPattern(v) for f, v in w.index_arrays().items()})
    self.bias: nnx.Param[jax.Array] | None
    if use_bias:
      self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))
    else:
      self.bias = nnx.data(None)
    self.in_features = in_features
    self.out_features = out_features
    self.block_shape = (bk, bn)
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision

  def __call__(self, x: jax.Array) -> jax.Array:
    """Applies the layer to ``x`` of shape ``(..., in_features)``; returns ``(..., out_features)``."""
    return block_sparse_apply(
        x,
        self.kernel[...],
        None if self.bias is None else self.bias[...],
        {f: v[...] for f, v in self.pattern.items()},
        shape=(self.in_features, self.out_features),
        block_shape=self.block_shape,
        dtype=self.dtype,
        implementation=self.implementation,
        precision=self.precision,
    )

  @property
  def sparse_kernel(self) -> BlockSparseMatrix:
    """The kernel as a :class:`jaxsparse.BlockSparseMatrix` of shape ``(in_features, out_features)``."""
    return BlockSparseMatrix.from_index_arrays(
        self.kernel[...],
        {f: v[...] for f, v in self.pattern.items()},
        shape=(self.in_features, self.out_features),
        block_shape=self.block_shape,
    )

  @property
  def nnz_blocks(self) -> int:
    return int(self.kernel.shape[0])

  @property
  def density(self) -> float:
    """Fraction of blocks kept."""
    bk, bn = self.block_shape
    return self.nnz_blocks / ((self.in_features // bk) * (self.out_features // bn))

  @property
  def sparsity(self) -> float:
    """Fraction of blocks pruned, ``1 - density``."""
    return 1.0 - self.density

  @property
  def block_mask(self) -> jax.Array:
    """Bool ``(in_features // bk, out_features // bn)``, True where a block is kept."""
    return self.sparse_kernel.block_mask

  @classmethod
  def from_dense(
      cls,
      linear: nnx.Linear,
      *,
      density: float,
      block_shape: tuple[int, int] = (32, 32),
      implementation: ops.Implementation | None = None,
  ) -> BlockSparseLinear:
    """Prunes an ``nnx.Linear`` to its ``round(density * blocks)`` largest-norm blocks.

    The kept blocks and the bias are copied; ``dtype``, ``precision`` and the storage dtype follow
    ``linear``. With ``density=1.0`` the result computes the same function as ``linear``.

    >>> from flax import nnx
    >>> from jaxsparse.layers import BlockSparseLinear
    >>> dense = nnx.Linear(64, 96, rngs=nnx.Rngs(0))
    >>> BlockSparseLinear.from_dense(dense, density=0.5, block_shape=(32, 32)).kernel.shape
    (3, 32, 32)
    """
    linear = _check_linear(linear)
    kernel = linear.kernel[...]
    mask = block_magnitude_mask(kernel, block_shape, density)
    layer = cls(
        linear.in_features,
        linear.out_features,
        block_shape=block_shape,
        block_mask=mask,
        use_bias=linear.bias is not None,
        dtype=linear.dtype,
        param_dtype=kernel.dtype,
        kernel_init=nnx.initializers.zeros_init(),
        implementation=implementation,
        precision=linear.precision,
        rngs=nnx.Rngs(0),
    )
    layer.kernel[...] = BlockSparseMatrix.from_dense(kernel, block_shape, block_mask=mask).data
    if linear.bias is not None:
      layer.bias[...] = linear.bias[...]
    return layer

  def to_dense(self) -> nnx.Linear:
    """An ``nnx.Linear`` with the dense kernel (zeros outside the kept blocks) and the same bias."""
    return _dense_linear(
        self.sparse_kernel.to_dense(),
        None if self.bias is None else self.bias[...],
        dtype=self.dtype,
        precision=self.precision,
    )

  def to_linen_variables(self) -> dict[str, dict[str, jax.Array]]:
    """Variables for :class:`jaxsparse.layers.linen.BlockSparseDense` holding these weights and pattern.

    Returns:
      ``{"params": {"kernel", "bias"?}, "sparsity": {index arrays}}``; pass it to ``apply`` of a
      ``BlockSparseDense(out_features, block_shape=...)`` with the same settings.
    """
    params = {"kernel": self.kernel[...]}
    if self.bias is not None:
      params["bias"] = self.bias[...]
    return {"params": params, "sparsity": {f: v[...] for f, v in self.pattern.items()}}


class MaskedLinear(nnx.Module):
  """A linear layer ``y = x @ (W * mask) + b`` with an unstructured, fixed boolean ``mask``.

  The kernel is stored dense (its pruned entries are zero and get zero gradient, so optimizers
  without weight decay keep them zero); the product is :func:`jaxsparse.ops.masked_matmul`. On CPU
  that runs sparse C++ kernels (forward and both gradients, work proportional to the kept weights)
  which read the kept entries from ``mask`` on every call: replacing ``mask`` (pruning, RigL) needs
  no rebuild, inside ``jit`` or out, and the number of kept weights may change freely. Masks keeping
  more than 25% of the weights run masked dense, which is faster there.

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
    param_dtype: storage dtype of kernel and bias.
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
    if (sparsity is None) == (mask is None):
      raise ValueError(
          f"Pass exactly one of sparsity= and mask=, got sparsity={sparsity!r} and "
          f"mask={'None' if mask is None else 'an array'}."
      )
    if mask is None:
      sparsity = _utils.check_sparsity(sparsity)
      kept = size - _utils.kept_count(sparsity, size)
      check_kept(kept, size, name="sparsity", value=sparsity, what="weights")
      mask = random_mask(rngs.params(), shape, kept)
    else:
      mask = check_mask(mask, shape, name="mask")
      kept = jnp.sum(mask)
    if kernel_init is None:
      kernel_init = masked_kernel_init(kept, size)
    kernel = kernel_init(rngs.params(), shape, param_dtype)
    self.kernel = nnx.Param(jnp.where(mask, kernel, jnp.zeros((), kernel.dtype)))
    self.mask = SparsityPattern(mask)
    self.bias: nnx.Param[jax.Array] | None
    if use_bias:
      self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))
    else:
      self.bias = nnx.data(None)
    self.in_features = in_features
    self.out_features = out_features
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision

  def __call__(self, x: jax.Array) -> jax.Array:
    """Applies the layer to ``x`` of shape ``(..., in_features)``; returns ``(..., out_features)``."""
    return masked_apply(
        x,
        self.kernel[...],
        None if self.bias is None else self.bias[...],
        self.mask[...],
        dtype=self.dtype,
        precision=self.precision,
        implementation=self.implementation,
    )

  @property
  def density(self) -> float:
    """Fraction of weights kept."""
    return float(np.mean(concrete(self.mask[...], name="mask")))

  @property
  def sparsity(self) -> float:
    """Fraction of weights pruned, ``1 - density``."""
    return 1.0 - self.density

  @classmethod
  def from_dense(
      cls, linear: nnx.Linear, *, sparsity: float, implementation: ops.CpuImplementation | None = None
  ) -> MaskedLinear:
    """Prunes an ``nnx.Linear`` to its largest-magnitude weights, pruning ``round(sparsity * size)``.

    >>> from flax import nnx
    >>> from jaxsparse.layers import MaskedLinear
    >>> dense = nnx.Linear(64, 96, rngs=nnx.Rngs(0))
    >>> MaskedLinear.from_dense(dense, sparsity=0.75).density
    0.25
    """
    linear = _check_linear(linear)
    kernel = linear.kernel[...]
    mask = magnitude_mask(kernel, sparsity)
    layer = cls(
        linear.in_features,
        linear.out_features,
        mask=mask,
        use_bias=linear.bias is not None,
        dtype=linear.dtype,
        param_dtype=kernel.dtype,
        kernel_init=lambda *_: kernel,
        precision=linear.precision,
        implementation=implementation,
        rngs=nnx.Rngs(0),
    )
    if linear.bias is not None:
      layer.bias[...] = linear.bias[...]
    return layer

  def to_dense(self) -> nnx.Linear:
    """An ``nnx.Linear`` with kernel ``kernel * mask`` and the same bias."""
    kernel = self.kernel[...]
    return _dense_linear(
        jnp.where(self.mask[...], kernel, jnp.zeros((), kernel.dtype)),
        None if self.bias is None else self.bias[...],
        dtype=self.dtype,
        precision=self.precision,
    )

  def to_linen_variables(self) -> dict[str, dict[str, jax.Array]]:
    """Variables for :class:`jaxsparse.layers.linen.MaskedDense` holding these weights and mask.

    Returns:
      ``{"params": {"kernel", "bias"?}, "sparsity": {"mask"}}``.
    """
    params = {"kernel": self.kernel[...]}
    if self.bias is not None:
      params["bias"] = self.bias[...]
    return {"params": params, "sparsity": {"mask": self.mask[...]}}

