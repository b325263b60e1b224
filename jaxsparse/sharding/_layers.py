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
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import SparsityPattern
from jaxsparse.sharding._tensor_parallel import BatchAxes
from jaxsparse.sharding._tensor_parallel import ShardedBlockSparseMatrix
from jaxsparse.sharding._tensor_parallel import Split
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
    shards = BlockSparseMatrix.from_index_arrays(
        self.kernel[...], {f: v[...] for f, v in self.pattern.items()}, shape=self.local_shape,
        block_shape=self.block_shape, validate=False,  # stacked per-shard patterns
    )
    return ShardedBlockSparseMatrix(
        shards, self.source[...], mesh=self.mesh, axis=self.axis, split=self.split,
        shape=(self.in_features, self.out_features), nnz_blocks=self.nnz_blocks,
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    """``(..., in_features)`` -> ``(..., out_features)``."""
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
    """The unsplit :class:`jaxsparse.layers.BlockSparseLinear` (values gathered)."""
    w = self.sharded_kernel.to_block_sparse()
    layer = BlockSparseLinear(
        self.in_features, self.out_features, block_shape=self.block_shape, block_mask=w.block_mask,
        use_bias=self.bias is not None, dtype=self.dtype, param_dtype=w.dtype,
        kernel_init=nnx.initializers.zeros_init(), implementation=self.implementation, precision=self.precision,
        rngs=nnx.Rngs(0),
    )
    layer.kernel[...] = w.data
    if self.bias is not None:
      layer.bias[...] = self.bias[...]
    return layer
