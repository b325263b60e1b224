"""Block-sparse layers: NNX ``BlockSparseLinear`` and Linen ``BlockSparseDense``, over
:func:`jaxsparse.ops.block_sparse_matmul`.

The pattern is chosen once, at construction (NNX) or ``init`` (Linen), and kept as non-trainable
state next to the trainable kernel (the kept blocks only) and bias: a :class:`SparsityPattern` variable
in NNX, the ``"sparsity"`` collection in Linen. Both front ends share ``block_sparse_apply``, so they
compute the same thing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
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
from jaxsparse._utils import check_mask
from jaxsparse.formats._base import is_concrete
from jaxsparse.formats._block_sparse import INDEX_FIELDS
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._masks import block_magnitude_mask
from jaxsparse.formats._masks import random_block_mask
from jaxsparse.layers._checks import check_dtypes
from jaxsparse.layers._checks import check_implementation
from jaxsparse.layers._checks import check_init_dtype
from jaxsparse.layers._checks import check_input
from jaxsparse.layers._checks import check_kept
from jaxsparse.layers._checks import check_one_of
from jaxsparse.layers._checks import check_real_dtypes
from jaxsparse.layers._checks import check_use_bias
from jaxsparse.layers._common import SPARSITY
from jaxsparse.layers._common import bias_of
from jaxsparse.layers._common import check_known_in_features
from jaxsparse.layers._common import check_layer_inputs
from jaxsparse.layers._common import check_linear
from jaxsparse.layers._common import check_one_layer
from jaxsparse.layers._common import check_pattern
from jaxsparse.layers._common import copy_bias
from jaxsparse.layers._common import default_bias_init
from jaxsparse.layers._common import dense_linear
from jaxsparse.layers._common import dict_items
from jaxsparse.layers._common import existing_shape
from jaxsparse.layers._common import init_linear_attributes
from jaxsparse.layers._common import map_boxed
from jaxsparse.layers._common import pattern_variable
from jaxsparse.layers._common import unbox_init
from jaxsparse.layers._partitioning import BLOCKS
from jaxsparse.layers._partitioning import box_structure
from jaxsparse.layers._partitioning import carry_back_nnx
from jaxsparse.layers._partitioning import carry_nnx

__all__ = ["BLOCK_VALUES", "BlockSparseDense", "BlockSparseLinear"]

BLOCK_VALUES = "block_sparse_values"
"""Metadata key of the ``nnx.Param`` that holds a block-sparse layer's kept blocks (``BlockSparseLinear.kernel``,
``(nnz_blocks, bk, bn)``); its value is the layer's class name. Like ``COMPRESSED_VALUES`` (``layers/_common.py``) it
travels with the variable wherever the layer's parameters go without the layer (``nnx.state(model, nnx.Param)``, what
``nnx.Optimizer`` hands its optimizer), so that the pruners refuse to prune the kept blocks as if they were a dense
kernel (the layer's density, ``summary`` and products count whole blocks). Checkpoints hold the arrays only. Under
``nnx.bridge.ToLinen`` the mark puts the kernel in an ``NNXMeta`` box in ``"params"``, as a named kernel is."""


def check_block_mask(block_mask: Any, grid: tuple[int, int]) -> np.ndarray:
  """A user's block mask as a checked NumPy bool array of shape ``grid``."""
  if not is_concrete(block_mask):
    what = ("abstract (ShapeDtypeStruct: no values)" if isinstance(block_mask, jax.ShapeDtypeStruct)
            else "traced (built under jit, eval_shape or vmap)")
    raise ValueError(
        f"block_mask is {what}, so the number of blocks it keeps, which "
        "fixes the kernel's shape, is unknown: pass density= to draw the pattern from rngs under jit, or "
        "pass a concrete (NumPy) block_mask. For a stack of layers with given masks (each keeping as many blocks), "
        "build the layers eagerly and stack them: nnx.merge(nnx.graphdef(layers[0]), jax.tree.map(lambda *a: "
        "jnp.stack(a), *[nnx.state(layer) for layer in layers]))."
    )
  if np.shape(block_mask) != grid:
    raise ValueError(
        f"block_mask must have shape (in_features // bk, out_features // bn) = {grid}, got {np.shape(block_mask)}."
    )
  with jax.ensure_compile_time_eval():  # a NumPy mask stays concrete under jit / nnx.eval_shape (abstract restore)
    return np.asarray(check_mask(block_mask, grid, name="block_mask"))


def pattern_variables(w: BlockSparseMatrix, kernel: nnx.Variable | None = None) -> nnx.Dict:
  """``w``'s index arrays as :class:`SparsityPattern` variables (the ``pattern`` of a ``BlockSparseLinear``); beside
  a named ``kernel`` variable they are named ``(None,)``, replicated per layer (:func:`pattern_variable`), so that a
  stack's transform (``nnx.vmap`` ``transform_metadata``) adds its axis to them as to the kernel."""
  return nnx.Dict({f: pattern_variable(v, kernel, f, blocks=True) for f, v in w.index_arrays().items()})


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
  # The hot path: the layer built its own pattern, so it is not re-validated on every call.
  w = BlockSparseMatrix.from_index_arrays(kernel, dict(index_arrays), shape=shape, block_shape=block_shape,
                                          validate=False)
  y = ops.block_sparse_matmul(x, w, implementation=implementation, precision=precision)
  return y if bias is None else y + bias


class BlockSparseLinear(nnx.Module):
  """A linear layer ``y = x @ W + b`` whose ``W`` keeps only some ``(bk, bn)`` blocks.

  The pattern is fixed when the layer is built: ``round(density * blocks)`` blocks chosen uniformly
  at random from ``rngs.params()`` (or the blocks of ``block_mask``). With ``density`` the layer can be
  built under ``nnx.jit`` / ``nnx.eval_shape`` (the index arrays are then computed with ``jnp``) and is
  the same layer as one built eagerly with the same seed. Only the kept blocks are
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
      order (by block row, then block column). It carries the metadata
      ``block_sparse_values="BlockSparseLinear"``, so that the pruners (:mod:`jaxsparse.pruning`) refuse to prune the
      kept blocks as a dense kernel even where they see the parameters without the layer (an ``nnx.Optimizer``).
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
    dtype: computation dtype; ``None`` infers it from the input and parameters, like ``nnx.Linear``. Real
      dtypes only (float32, bfloat16, float16, float64, float8; integer inputs are promoted): complex ones raise,
      as do complex inputs (:class:`MaskedLinear` takes them).
    param_dtype: storage dtype of kernel and bias, real; an integer or bool one needs ``kernel_init`` (the default
      draws a truncated normal).
    kernel_init: called as ``kernel_init(key, (nnz_blocks, bk, bn), param_dtype)``; ``None`` uses the
      variance-preserving default above.
    bias_init: called as ``bias_init(key, (out_features,), param_dtype)``.
    implementation: backend of :func:`jaxsparse.ops.block_sparse_matmul`: ``None`` (best for the
      platform), ``"xla"`` or ``"pallas"``.
    precision: passed to the products.
    block_mask: concrete bool ``(in_features // bk, out_features // bn)`` choosing the blocks (its
      count fixes the kernel's shape, so it cannot be traced; use ``density`` under ``jit``).
    rngs: ``nnx.Rngs``; the ``params`` stream draws the pattern, kernel and bias.

  Raises:
    ValueError: ``in_features`` or ``out_features`` is not a positive int; ``block_shape`` is not positive or
      does not divide ``(in_features, out_features)``; neither or both of ``density`` and ``block_mask`` are
      given; ``density`` is not in (0, 1] or keeps no block; ``block_mask`` is traced, not of shape
      ``(in_features // bk, out_features // bn)`` or keeps no block; an unknown ``implementation``.
    TypeError: ``block_shape`` is not a pair of ints; ``density`` is not a real number; ``block_mask`` is not
      a boolean array; ``param_dtype`` or ``dtype`` is complex; ``param_dtype`` is not floating and no
      ``kernel_init`` is given.
  """

  _kernel_layout = BLOCKS  # its kept blocks have no dims of the dense kernel (partitioning names, _partitioning)

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
    check_dtypes(BlockSparseLinear, dtype=dtype, param_dtype=param_dtype)
    _utils.check_precision(precision, owner="BlockSparseLinear")
    check_real_dtypes(BlockSparseLinear, param_dtype=param_dtype, dtype=dtype)
    check_init_dtype(BlockSparseLinear, param_dtype, kernel_init)
    grid = (in_features // bk, out_features // bn)
    self.implementation = check_implementation(implementation)
    check_one_of("density", density, "block_mask", block_mask)
    if block_mask is None:
      density = _utils.check_density(density)
      blocks = grid[0] * grid[1]
      nnz = _utils.kept_count(density, blocks)
      check_kept(nnz, blocks, name="density", value=density, what="blocks")
      block_mask = random_block_mask(rngs.params(), (in_features, out_features), (bk, bn), density)
    else:
      block_mask = check_block_mask(block_mask, grid)
      nnz = int(np.count_nonzero(block_mask))
      if nnz == 0:
        raise ValueError("block_mask keeps no block; keep at least one.")
    if kernel_init is None:
      kernel_init = block_sparse_kernel_init(nnz, grid)
    kernel = kernel_init(rngs.params(), (nnz, bk, bn), param_dtype)  # maybe boxed (nnx.with_partitioning): kept
    w = BlockSparseMatrix.from_block_mask(block_mask, unbox_init(kernel))
    self.kernel = nnx.Param(map_boxed(kernel, lambda _: w.data), **{BLOCK_VALUES: type(self).__name__})
    self.pattern = pattern_variables(w, self.kernel)  # named where the kernel is (nnx.with_partitioning)
    self.block_shape = (bk, bn)
    init_linear_attributes(
        self, in_features, out_features, use_bias=use_bias, bias_init=bias_init, dtype=dtype,
        param_dtype=param_dtype, precision=precision, rngs=rngs,
    )

  def __call__(self, inputs: jax.Array) -> jax.Array:
    """``inputs @ W + bias`` through :func:`jaxsparse.ops.block_sparse_matmul`, never building the dense ``W``.

    Args:
      inputs: ``(..., in_features)`` (named as ``nnx.Linear``'s).

    Returns:
      ``(..., out_features)``, in ``dtype`` if set, else the promoted dtype of ``inputs`` and the parameters.

    Raises:
      ValueError: ``inputs`` whose last axis is not ``in_features`` (or a scalar).
      TypeError: complex ``inputs``.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import BlockSparseLinear
    >>> layer = BlockSparseLinear(64, 32, density=0.5, block_shape=(16, 16), rngs=nnx.Rngs(0))
    >>> x = jnp.ones((4, 64))
    >>> y = layer(x)
    >>> w = layer.sparse_kernel.to_dense()
    >>> y.shape, y.dtype, bool(jnp.allclose(y, x @ w + layer.bias[...], atol=1e-5))
    ((4, 32), dtype('float32'), True)
    """
    inputs = check_layer_inputs(self, inputs)
    check_real_dtypes(BlockSparseLinear, **{"inputs.dtype": jnp.result_type(inputs)})
    return block_sparse_apply(
        inputs,
        self.kernel[...],
        bias_of(self),
        {f: v[...] for f, v in dict_items(self.pattern)},
        shape=(self.in_features, self.out_features),
        block_shape=self.block_shape,
        dtype=self.dtype,
        implementation=self.implementation,
        precision=self.precision,
    )

  @property
  def sparse_kernel(self) -> BlockSparseMatrix:
    """The kernel as a :class:`jaxsparse.BlockSparseMatrix` of shape ``(in_features, out_features)``.

    Raises:
      ValueError: this layer is a stack of layers (built by ``nnx.vmap``); read it per layer:
        ``nnx.vmap(lambda layer: layer.sparse_kernel, in_axes=0, out_axes=0)(stack)``.
    """
    check_one_layer(self, what="sparse_kernel")
    return BlockSparseMatrix.from_index_arrays(
        self.kernel[...],
        {f: v[...] for f, v in dict_items(self.pattern)},
        shape=(self.in_features, self.out_features),
        block_shape=self.block_shape,
    )

  @property
  def nnz_blocks(self) -> int:
    """The number of kept ``(bk, bn)`` blocks: ``kernel.shape[-3]``, a static int (per layer in a stack of layers
    built by ``nnx.vmap``, whose kernel has a leading layer axis).

    >>> from flax import nnx
    >>> from jaxsparse.layers import BlockSparseLinear
    >>> BlockSparseLinear(64, 96, density=0.5, block_shape=(32, 32), rngs=nnx.Rngs(0)).nnz_blocks  # of 2 x 3
    3
    """
    return int(self.kernel.shape[-3])

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

    The kept blocks and the bias are copied (the bias in its own dtype); ``dtype``, ``precision`` and the storage
    dtype follow ``linear``. With ``density=1.0`` the result computes the same function as ``linear``.

    Args:
      linear: an ``nnx.Linear`` (exactly, not a subclass) with Flax's default product options; its kernel
        ``(in_features, out_features)`` may be traced (this works under ``nnx.jit``).
      density: fraction of blocks kept, in (0, 1]; the ``round(density * blocks)`` blocks of largest
        Frobenius norm are kept (see :func:`jaxsparse.block_magnitude_mask`).
      block_shape: ``(bk, bn)`` dividing ``(in_features, out_features)``.
      implementation: backend of :func:`jaxsparse.ops.block_sparse_matmul`: ``None``, ``"xla"`` or ``"pallas"``.

    Returns:
      A ``BlockSparseLinear`` with ``kernel`` ``(nnz_blocks, bk, bn)`` holding ``linear``'s kept blocks, and
      ``linear``'s bias (or none). Partitioning names (``nnx.with_partitioning``) carry over as
      :func:`jaxsparse.sparsify` gives them: the bias keeps its own; the kept blocks and their indices are
      replicated, and the kernel records the dense kernel's names for :meth:`to_dense`.

    Raises:
      TypeError: ``linear`` is not an ``nnx.Linear``; ``block_shape`` is not a pair of ints; ``density`` is not
        a real number.
      ValueError: ``linear`` has options the layer cannot honour (a custom ``dot_general``...); ``density`` is
        not in (0, 1] or keeps no block; ``block_shape`` is not positive or does not divide the kernel; an
        unknown ``implementation``.

    >>> from flax import nnx
    >>> from jaxsparse.layers import BlockSparseLinear
    >>> dense = nnx.Linear(64, 96, rngs=nnx.Rngs(0))
    >>> BlockSparseLinear.from_dense(dense, density=0.5, block_shape=(32, 32)).kernel.shape
    (3, 32, 32)
    """
    linear = check_linear(linear, "BlockSparseLinear")
    kernel = linear.kernel[...]
    layer = cls(
        linear.in_features,
        linear.out_features,
        density=density,
        block_shape=block_shape,
        use_bias=linear.bias is not None,
        dtype=linear.dtype,
        param_dtype=kernel.dtype,
        kernel_init=nnx.initializers.zeros_init(),
        implementation=implementation,
        precision=linear.precision,
        rngs=nnx.Rngs(0),
    )
    # The largest blocks replace the random pattern; their count is static, so this works under jit.
    mask = block_magnitude_mask(kernel, block_shape, density)
    w = BlockSparseMatrix.from_dense(kernel, block_shape, mask, nnz_blocks=layer.nnz_blocks)
    layer.kernel[...] = w.data
    layer.pattern = pattern_variables(w)
    if linear.bias is not None:
      # A bias of another dtype than the kernel keeps it, as linear computes with it (copy_bias; it also gathers a
      # bias split over explicit axes, which carry_nnx splits again).
      copy_bias(layer, linear.bias[...])
    return carry_nnx(linear, layer)  # the partitioning names and placement

  def to_dense(self) -> nnx.Linear:
    """An ``nnx.Linear`` with the dense kernel (zeros outside the kept blocks) and the same bias.

    Returns:
      An ``nnx.Linear(in_features, out_features)`` with kernel ``sparse_kernel.to_dense()`` (in the kernel's
      dtype), this layer's bias (or none), ``dtype`` and ``precision``: it computes the same function. Partitioning
      names (``nnx.with_partitioning``) come back as :func:`jaxsparse.densify` gives them: the bias keeps its own,
      the kernel takes the dense kernel's that :func:`jaxsparse.sparsify` recorded (a layer built directly has none:
      its ``(nnz_blocks, bk, bn)`` names do not map onto ``(in_features, out_features)``).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import BlockSparseLinear
    >>> layer = BlockSparseLinear(64, 32, density=0.5, block_shape=(16, 16), rngs=nnx.Rngs(0))
    >>> x = jnp.ones((2, 64))
    >>> bool(jnp.allclose(layer.to_dense()(x), layer(x), atol=1e-5))
    True

    Raises:
      ValueError: this layer is a stack of layers (built by ``nnx.vmap``); call it per layer:
        ``nnx.vmap(lambda layer: layer.to_dense(), in_axes=0, out_axes=0)(stack)``.
    """
    check_one_layer(self, what="to_dense()")
    dense = dense_linear(
        self.sparse_kernel.to_dense(),
        bias_of(self),
        dtype=self.dtype,
        precision=self.precision,
    )
    return carry_back_nnx(self, dense)  # the partitioning names and placement

  def to_linen_variables(self) -> dict[str, dict[str, jax.Array]]:
    """Variables for :class:`jaxsparse.layers.linen.BlockSparseDense` holding these weights and pattern.

    Returns:
      ``{"params": {"kernel", "bias"?}, "sparsity": {index arrays}}``; pass it to ``apply`` of a
      ``BlockSparseDense(out_features, block_shape=...)`` with the same settings.
    """
    params = {"kernel": self.kernel[...]}
    if self.bias is not None:
      params["bias"] = self.bias[...]
    return {"params": params, "sparsity": {f: v[...] for f, v in dict_items(self.pattern)}}


class BlockSparseDense(nn.Module):
  """Linen version of :class:`jaxsparse.layers.BlockSparseLinear`: ``y = x @ W + b``, ``W`` block-sparse.

  ``init`` draws ``round(density * blocks)`` blocks uniformly at random from the ``"params"`` rng
  and stores their index arrays in the ``"sparsity"`` collection (keyed like
  :meth:`jaxsparse.BlockSparseMatrix.index_arrays`); the ``"params"`` kernel holds only the kept
  blocks, shape ``(nnz_blocks, bk, bn)``. ``init`` may run inside ``jax.jit`` (the block indices are
  then computed with ``jnp``), giving the same variables as an eager ``init``. Default initialisation
  and dtypes follow ``BlockSparseLinear``; its
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
    dtype: computation dtype (``None``: inferred from input and params); real only, as ``param_dtype``.
    param_dtype: storage dtype of kernel and bias, real only (a complex one raises; :class:`MaskedDense` takes
      complex weights and inputs); an integer or bool one needs ``kernel_init`` (the default draws a truncated
      normal).
    kernel_init: called as ``kernel_init(key, (nnz_blocks, bk, bn), param_dtype)``; ``None`` draws a
      truncated normal of variance ``1 / (density * in_features)``.
    bias_init: bias initializer.
    implementation: backend of :func:`jaxsparse.ops.block_sparse_matmul`.
    precision: passed to the products.

  Raises:
    ValueError: at construction, ``features`` is not a positive int, ``density`` is not in (0, 1] or an
      unknown ``implementation``; when called, see :meth:`__call__`.
    TypeError: at construction, ``density`` is not a real number, ``param_dtype`` / ``dtype`` is complex or
      ``param_dtype`` is not floating without a ``kernel_init``; when called, ``block_shape`` is not a pair of ints,
      or ``x`` or the kernel is complex.
  """

  features: int
  _: dataclasses.KW_ONLY
  density: float
  block_shape: tuple[int, int] = (32, 32)
  use_bias: bool = True
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer | None = None
  bias_init: Initializer = default_bias_init
  implementation: ops.Implementation | None = None
  precision: lax.PrecisionLike = None

  def __post_init__(self):
    _utils.check_positive_int(self.features, name="features")
    _utils.check_density(self.density)
    check_use_bias(self.use_bias)
    check_implementation(self.implementation)
    check_dtypes(type(self), dtype=self.dtype, param_dtype=self.param_dtype)
    _utils.check_precision(self.precision, owner=type(self).__name__)
    check_real_dtypes(type(self), param_dtype=self.param_dtype, dtype=self.dtype)
    check_init_dtype(type(self), self.param_dtype, self.kernel_init)
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """``x @ W + bias`` through :func:`jaxsparse.ops.block_sparse_matmul`; ``init`` also draws the pattern.

    Args:
      x: ``(..., in_features)``; ``init`` takes ``in_features`` from ``x.shape[-1]``.

    Returns:
      ``(..., features)``, in ``dtype`` if set, else the promoted dtype of ``x`` and the parameters.

    Raises:
      ValueError: ``x`` is a scalar, or has another ``in_features`` than the variables hold; ``block_shape``
        is not positive or does not divide ``(in_features, features)``; ``density`` keeps no block; ``apply``
        with variables that lack the ``"sparsity"`` collection.
      TypeError: ``block_shape`` is not a pair of ints; a complex ``x`` or ``params['kernel']``.

    >>> import jax, jax.numpy as jnp
    >>> from jaxsparse.layers.linen import BlockSparseDense
    >>> from jaxsparse import BlockSparseMatrix
    >>> model = BlockSparseDense(32, density=0.5, block_shape=(16, 16))
    >>> x = jnp.ones((4, 64))
    >>> variables = model.init(jax.random.key(0), x)
    >>> w = BlockSparseMatrix.from_index_arrays(
    ...     variables["params"]["kernel"], variables["sparsity"], shape=(64, 32), block_shape=(16, 16))
    >>> y = model.apply(variables, x)
    >>> y.shape, bool(jnp.allclose(y, x @ w.to_dense() + variables["params"]["bias"], atol=1e-5))
    ((4, 32), True)
    """
    x = check_input(self, x)
    check_real_dtypes(type(self), **{"x.dtype": x.dtype})
    offsets = existing_shape(self, SPARSITY, "row_offsets")
    if offsets is not None and isinstance(self.block_shape, tuple | list) and len(self.block_shape) == 2:
      check_known_in_features(self, x.shape, (offsets[0] - 1) * int(self.block_shape[0]))
    shape = (x.shape[-1], self.features)
    bk, bn = _utils.check_block_shape(self.block_shape, shape)
    grid = (shape[0] // bk, shape[1] // bn)
    nnz = _utils.kept_count(self.density, grid[0] * grid[1])
    check_kept(nnz, grid[0] * grid[1], name="density", value=self.density, what="blocks")
    kernel_init = self.kernel_init or block_sparse_kernel_init(nnz, grid)
    kernel = self.param("kernel", kernel_init, (nnz, bk, bn), self.param_dtype)
    check_real_dtypes(type(self), **{"params['kernel'].dtype": jnp.result_type(kernel)})  # variables made elsewhere
    bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
    check_pattern(self, INDEX_FIELDS[0])
    if self.has_variable(SPARSITY, INDEX_FIELDS[0]):  # unboxed: nn.Partitioned boxes (sharding names) are taken
      index_arrays = {f: nn.meta.unbox(self.get_variable(SPARSITY, f)) for f in INDEX_FIELDS}
    else:
      mask = random_block_mask(self.make_rng("params"), shape, (bk, bn), self.density)
      index_arrays = BlockSparseMatrix.from_block_mask(mask, kernel).index_arrays()
      kernel_box = self.get_variable("params", "kernel")  # boxed as the kernel is (nn.with_partitioning), (None,)
      for f, v in index_arrays.items():
        self.put_variable(SPARSITY, f, box_structure(kernel_box, v, f, blocks=True))
    return block_sparse_apply(
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
