"""Flax Linen layers: ``BlockSparseDense`` and ``MaskedDense``, the Linen twins of the NNX layers.

The sparsity pattern lives in the ``"sparsity"`` collection, next to ``"params"``: ``init`` creates
it, drawing it from the ``"params"`` rng, and ``apply`` needs it back but never changes it. Train
only ``variables["params"]`` and pass ``variables["sparsity"]`` through unchanged.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.typing import Dtype
from flax.typing import Initializer
from jax import lax

from jaxsparse import _utils
from jaxsparse import ops
from jaxsparse.formats._block_sparse import INDEX_FIELDS
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._masks import random_block_mask
from jaxsparse.layers import _block_sparse as _nnx

__all__ = ["SPARSITY", "BlockSparseDense", "MaskedDense"]

SPARSITY = "sparsity"


def _missing_pattern(module: nn.Module) -> ValueError:
  return ValueError(
      f"{type(module).__name__} has no {SPARSITY!r} collection: pass the variables that `init` returned, "
      f"e.g. `apply({{'params': ..., {SPARSITY!r}: ...}}, x)`."
  )


def _check_input(x: jax.typing.ArrayLike) -> jax.Array:
  x = jnp.asarray(x)
  if x.ndim < 1:
    raise ValueError(f"x must have shape (..., in_features), got x.shape={x.shape}.")
  return x


class BlockSparseDense(nn.Module):
  """Linen version of :class:`jaxsparse.layers.BlockSparseLinear`: ``y = x @ W + b``, ``W`` block-sparse.

  ``init`` draws ``round(density * blocks)`` blocks uniformly at random from the ``"params"`` rng
  and stores their index arrays in the ``"sparsity"`` collection (keyed like
  :meth:`jaxsparse.BlockSparseMatrix.index_arrays`); the ``"params"`` kernel holds only the kept
  blocks, shape ``(nnz_blocks, bk, bn)``. ``init`` must run outside ``jit`` (the block indices are
  computed on the host). Default initialisation and dtypes follow ``BlockSparseLinear``; its
  :meth:`~jaxsparse.layers.BlockSparseLinear.to_linen_variables` gives variables for this module.

  >>> import jax, jax.numpy as jnp
  >>> from jaxsparse.layers.linen import BlockSparseDense
  >>> model = BlockSparseDense(96, density=0.5, block_shape=(32, 32))
  >>> variables = model.init(jax.random.key(0), jnp.ones((1, 64)))
  >>> variables["params"]["kernel"].shape, sorted(variables)
  ((3, 32, 32), ['params', 'sparsity'])
  >>> model.apply(variables, jnp.ones((4, 64))).shape
  (4, 96)

  Attributes:
    features: output size ``N``; the input size is ``x.shape[-1]``.
    density: fraction of blocks kept, in (0, 1].
    block_shape: ``(bk, bn)`` dividing ``(in_features, features)``.
    use_bias: whether to add a bias.
    dtype: computation dtype (``None``: inferred from input and params).
    param_dtype: storage dtype of kernel and bias.
    kernel_init: called as ``kernel_init(key, (nnz_blocks, bk, bn), param_dtype)``; ``None`` draws a
      truncated normal of variance ``1 / (density * in_features)``.
    bias_init: bias initializer.
    implementation: backend of :func:`jaxsparse.ops.block_sparse_matmul`.
    precision: passed to the products.
  """

  features: int
  _: dataclasses.KW_ONLY
  density: float
  block_shape: tuple[int, int] = (32, 32)
  use_bias: bool = True
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer | None = None
  bias_init: Initializer = _nnx.default_bias_init
  implementation: ops.Implementation | None = None
  precision: lax.PrecisionLike = None

  def __post_init__(self):
    _utils.check_positive_int(self.features, name="features")
    _utils.check_density(self.density)
    _nnx.check_implementation(self.implementation)
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """Applies the layer to ``x`` of shape ``(..., in_features)``; returns ``(..., features)``."""
    x = _check_input(x)
    shape = (x.shape[-1], self.features)
    bk, bn = _utils.check_block_shape(self.block_shape, shape)
    grid = (shape[0] // bk, shape[1] // bn)
    nnz = _utils.kept_count(self.density, grid[0] * grid[1])
    _nnx.check_kept(nnz, grid[0] * grid[1], name="density", value=self.density, what="blocks")
    kernel_init = self.kernel_init or _nnx.block_sparse_kernel_init(nnz, grid)
    kernel = self.param("kernel", kernel_init, (nnz, bk, bn), self.param_dtype)
    bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
    if self.has_variable(SPARSITY, INDEX_FIELDS[0]):
      index_arrays = {f: self.get_variable(SPARSITY, f) for f in INDEX_FIELDS}
    elif self.is_initializing():
      mask = random_block_mask(self.make_rng("params"), shape, (bk, bn), self.density)
      index_arrays = BlockSparseMatrix.from_block_mask(_nnx.concrete(mask, name="block_mask"), kernel).index_arrays()
      for f, v in index_arrays.items():
        self.put_variable(SPARSITY, f, v)
    else:
      raise _missing_pattern(self)
    return _nnx.block_sparse_apply(
        x,
        kernel,
        bias,
        index_arrays,
        shape=shape,
        block_shape=(bk, bn),
        dtype=self.dtype,
        implementation=self.implementation,
        precision=self.precision,
    )


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
    param_dtype: storage dtype of kernel and bias.
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
  bias_init: Initializer = _nnx.default_bias_init
  precision: lax.PrecisionLike = None
  implementation: ops.CpuImplementation | None = None

  def __post_init__(self):
    _utils.check_positive_int(self.features, name="features")
    _utils.check_sparsity(self.sparsity)
    _nnx.check_masked_implementation(self.implementation)
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """Applies the layer to ``x`` of shape ``(..., in_features)``; returns ``(..., features)``."""
    x = _check_input(x)
    shape = (x.shape[-1], self.features)
    size = shape[0] * shape[1]
    kept = size - _utils.kept_count(self.sparsity, size)
    _nnx.check_kept(kept, size, name="sparsity", value=self.sparsity, what="weights")
    if not (self.has_variable(SPARSITY, "mask") or self.is_initializing()):
      raise _missing_pattern(self)
    mask = self.variable(SPARSITY, "mask", lambda: _nnx.random_mask(self.make_rng("params"), shape, kept)).value
    kernel_init = self.kernel_init or _nnx.masked_kernel_init(kept, size)

    def masked_init(key, shape, dtype):
      return jnp.where(mask, kernel_init(key, shape, dtype), jnp.zeros((), dtype))

    kernel = self.param("kernel", masked_init, shape, self.param_dtype)
    bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
    return _nnx.masked_apply(
        x, kernel, bias, mask, dtype=self.dtype, precision=self.precision, implementation=self.implementation
    )
