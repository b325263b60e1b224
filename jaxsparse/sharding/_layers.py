"""``TensorParallelBlockSparseLinear``: a ``BlockSparseLinear`` split over a mesh axis (NNX)."""

from __future__ import annotations

from typing import Literal

import jax
from flax import nnx
from flax.nnx.nn import dtypes
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._masks import replicated
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import SparsityPattern
from jaxsparse.sharding._tensor_parallel import BatchAxes
from jaxsparse.sharding._tensor_parallel import ShardedBlockSparseMatrix
from jaxsparse.sharding._tensor_parallel import Split
from jaxsparse.sharding._tensor_parallel import _check_batch_axes
from jaxsparse.sharding._tensor_parallel import column_parallel_matmul
from jaxsparse.sharding._tensor_parallel import row_parallel_matmul
from jaxsparse.sharding._tensor_parallel import shard_block_sparse

__all__ = ["TensorParallelBlockSparseLinear"]


class TensorParallelBlockSparseLinear(nnx.Module):
  """A :class:`jaxsparse.layers.BlockSparseLinear` whose blocks are split over one mesh axis.

  ``split="columns"``: each device holds the block columns of its slice of ``out_features`` and the
  output comes out sharded on them (no communication). ``split="rows"``: each device holds the block
  rows of its slice of ``in_features``, takes ``x`` sharded on them (the output of a column-split
  layer) and the partial outputs are summed over the axis (``reduce="psum"``, or ``"scatter"`` to
  leave the output sharded on ``out_features``). A column-split layer, an elementwise function and a
  row-split layer make a Megatron MLP: one all-reduce forward, one backward.

  The kernel is an ``nnx.Param`` of shape ``(shards, blocks_per_shard, bk, bn)`` annotated with
  ``out_sharding=(axis, None, None, None)`` (so ``nnx.get_partition_spec`` and ``jit`` with
  ``out_shardings`` see the layout); the per-shard index arrays are :class:`SparsityPattern` state.

  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxsparse.layers import BlockSparseLinear
  >>> from jaxsparse.sharding import TensorParallelBlockSparseLinear
  >>> dense_layer = BlockSparseLinear(64, 128, density=0.5, block_shape=(16, 16), rngs=nnx.Rngs(0))
  >>> mesh = jax.make_mesh((1,), ("model",))
  >>> tp = TensorParallelBlockSparseLinear(dense_layer, mesh, "model", split="columns")
  >>> tp.kernel.shape, bool(jnp.allclose(tp(jnp.ones((2, 64))), dense_layer(jnp.ones((2, 64))), atol=1e-5))
  ((1, 16, 16, 16), True)

  Args:
    layer: the layer to split; its values are copied.
    mesh, axis: the mesh and the axis to split over.
    split: ``"columns"`` or ``"rows"``.
    batch_axes: mesh axes of the input's leading dims (data parallel), see
      :func:`jaxsparse.sharding.column_parallel_matmul`.
    reduce: for ``split="rows"``: ``"psum"`` or ``"scatter"``.

  Raises:
    TypeError: ``layer`` is not a :class:`jaxsparse.layers.BlockSparseLinear`, or ``mesh`` or ``axis`` of another
      type (as :func:`jaxsparse.sharding.shard_block_sparse` raises).
    ValueError: as :func:`jaxsparse.sharding.shard_block_sparse` raises (a bad ``split`` or ``axis``, or a block
      count along the split that the axis size does not divide), an unknown ``reduce``, or ``batch_axes`` that name
      axes not of ``mesh``, ``axis`` itself or an axis twice.
  """

  def __init__(
      self,
      layer: BlockSparseLinear,
      mesh: Mesh,
      axis: str,
      *,
      split: Split,
      batch_axes: BatchAxes = None,
      reduce: Literal["psum", "scatter"] = "psum",
  ):
    if not isinstance(layer, BlockSparseLinear):
      raise TypeError(f"layer must be a jaxsparse.layers.BlockSparseLinear, got {type(layer).__name__}.")
    w = shard_block_sparse(layer.sparse_kernel, mesh, axis, split=split)
    if reduce not in ("psum", "scatter"):
      raise ValueError(f"reduce must be 'psum' or 'scatter', got reduce={reduce!r}.")
    _check_batch_axes(batch_axes, mesh, axis)
    shard = lambda ndim: {"out_sharding": (axis,) + (None,) * (ndim - 1), "mesh": mesh}
    self.kernel = nnx.Param(w.data, **shard(4))
    self.pattern = nnx.Dict({f: SparsityPattern(v, **shard(2)) for f, v in w.shards.index_arrays().items()})
    self.source = SparsityPattern(w.source, **shard(2))
    self.bias: nnx.Param[jax.Array] | None = nnx.data(None)
    if layer.bias is not None:
      names = (axis,) if split == "columns" else (None,)
      bias = jax.device_put(layer.bias[...], NamedSharding(mesh, P(*names)))
      self.bias = nnx.Param(bias, out_sharding=names, mesh=mesh)
    self.mesh, self.axis, self.split = mesh, axis, split
    self.batch_axes, self.reduce = batch_axes, reduce
    self.in_features, self.out_features = layer.in_features, layer.out_features
    self.block_shape, self.local_shape, self.nnz_blocks = layer.block_shape, w.shards.shape, w.nnz_blocks
    self.dtype, self.precision, self.implementation = layer.dtype, layer.precision, layer.implementation

  @property
  def sharded_kernel(self) -> ShardedBlockSparseMatrix:
    """The kernel as a :class:`jaxsparse.sharding.ShardedBlockSparseMatrix` over the layer's mesh axis.

    >>> import jax
    >>> from flax import nnx
    >>> from jaxsparse.layers import BlockSparseLinear
    >>> from jaxsparse.sharding import TensorParallelBlockSparseLinear
    >>> layer = BlockSparseLinear(64, 128, density=0.5, block_shape=(16, 16), rngs=nnx.Rngs(0))
    >>> tp = TensorParallelBlockSparseLinear(layer, jax.make_mesh((1,), ("model",)), "model", split="rows")
    >>> w = tp.sharded_kernel
    >>> w.shape, w.split, w.data.shape
    ((64, 128), 'rows', (1, 16, 16, 16))
    """
    shards = BlockSparseMatrix.from_index_arrays(
        self.kernel[...], {f: v[...] for f, v in self.pattern.items()}, shape=self.local_shape,
        block_shape=self.block_shape, validate=False,  # stacked per-shard patterns
    )
    return ShardedBlockSparseMatrix(
        shards, self.source[...], mesh=self.mesh, axis=self.axis, split=self.split,
        shape=(self.in_features, self.out_features), nnz_blocks=self.nnz_blocks,
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x @ kernel + bias`` with the kernel split over the mesh axis.

    Args:
      x: ``(..., in_features)``; for ``split="rows"`` sharded (or shardable) on ``in_features`` over the axis.

    Returns:
      ``(..., out_features)`` in ``dtype`` if set, else the promoted dtype of ``x`` and the parameters;
      sharded on ``out_features`` (``split="columns"``, or ``reduce="scatter"``) or replicated over the axis.

    Raises:
      ValueError: ``x`` not ``(..., in_features)``, or ``batch_axes`` that do not fit ``x`` or the mesh.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import BlockSparseLinear
    >>> from jaxsparse.sharding import TensorParallelBlockSparseLinear
    >>> layer = BlockSparseLinear(64, 128, density=0.5, block_shape=(16, 16), rngs=nnx.Rngs(0))
    >>> tp = TensorParallelBlockSparseLinear(layer, jax.make_mesh((1,), ("model",)), "model", split="columns")
    >>> x = jnp.ones((2, 64))
    >>> y = tp(x)
    >>> y.shape, y.dtype, bool(jnp.allclose(y, layer(x), atol=1e-5))
    ((2, 128), dtype('float32'), True)
    """
    w = self.sharded_kernel
    bias = None if self.bias is None else self.bias[...]
    x, data, bias = dtypes.promote_dtype((x, w.data, bias), dtype=self.dtype)
    w = w.with_data(data)
    options = {"batch_axes": self.batch_axes, "implementation": self.implementation, "precision": self.precision}
    if self.split == "columns":
      y = column_parallel_matmul(x, w, **options)
    else:
      y = row_parallel_matmul(x, w, reduce=self.reduce, **options)
    return y if bias is None else y + bias

  def to_block_sparse_linear(self) -> BlockSparseLinear:
    """The unsplit :class:`jaxsparse.layers.BlockSparseLinear` (values gathered); call it outside ``jit``.

    Returns:
      A ``BlockSparseLinear`` with the same blocks, bias, ``dtype``, ``precision`` and ``implementation``.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import BlockSparseLinear
    >>> from jaxsparse.sharding import TensorParallelBlockSparseLinear
    >>> layer = BlockSparseLinear(64, 128, density=0.5, block_shape=(16, 16), rngs=nnx.Rngs(0))
    >>> tp = TensorParallelBlockSparseLinear(layer, jax.make_mesh((1,), ("model",)), "model", split="rows")
    >>> back = tp.to_block_sparse_linear()
    >>> bool((back.sparse_kernel.to_dense() == layer.sparse_kernel.to_dense()).all())
    True
    """
    w = self.sharded_kernel.to_block_sparse()
    layer = BlockSparseLinear(
        self.in_features, self.out_features, block_shape=self.block_shape, block_mask=w.block_mask,
        use_bias=self.bias is not None, dtype=self.dtype, param_dtype=w.dtype,
        kernel_init=nnx.initializers.zeros_init(), implementation=self.implementation, precision=self.precision,
        rngs=nnx.Rngs(0),
    )
    layer.kernel[...] = replicated(w.data)  # values split over explicit mesh axes, as the new layer's are not
    if self.bias is not None:
      layer.bias[...] = replicated(self.bias[...])
    return layer
