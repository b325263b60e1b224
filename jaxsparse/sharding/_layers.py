"""``TensorParallelBlockSparseLinear``: a ``BlockSparseLinear`` split over a mesh axis (NNX)."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsparse.formats._base import is_concrete
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._masks import replicated
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import SparsityPattern
from jaxsparse.layers._block_sparse import BLOCK_VALUES
from jaxsparse.layers._common import dict_items
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

  That state is laid out for the size of ``axis``. A state saved from a layer on a mesh whose axis had another size
  (``nnx.state`` / ``nnx.update``, or an orbax restore of the shapes it was saved with) is re-split over this layer's
  axis by :meth:`resplit`; until then calling the layer raises, naming both sizes (it used to fail inside
  ``shard_map`` or on an index array's shape). An orbax restore into the abstract target of another size is refused by
  orbax itself (the shapes differ): restore into a target of the saved size, ``nnx.update`` this layer with it and
  call :meth:`resplit`.

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
    self.kernel = nnx.Param(w.data, **shard(4), **{BLOCK_VALUES: type(self).__name__})  # the pruners refuse it
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

  def _check_layout(self) -> None:
    """Raises, naming the sizes, where the state is not laid out for this layer's mesh axis and shapes (a state saved
    from another tensor-parallel size and restored into it); shapes only, so under ``jit`` too."""
    saved, target = self.kernel.shape[0], self.mesh.shape[self.axis]
    if saved != target:
      raise ValueError(
          f"TensorParallelBlockSparseLinear: its state holds {saved} shards (kernel {tuple(self.kernel.shape)}), "
          f"laid out for a {self.axis!r} axis of {saved} devices, but its mesh's {self.axis!r} axis has {target}: a "
          f"state saved from another tensor-parallel size was restored into it (saved axis size {saved}, target "
          f"axis size {target}). Call layer.resplit() outside jit to lay it out over the {target} devices (the state "
          "keeps every block's position, so the values carry over), or restore onto a mesh whose axis has "
          f"{saved} devices."
      )
    expected = self._layout_shapes(saved, self.local_shape, self.kernel.shape[1])
    got = self._state_shapes()
    if got != expected:
      raise ValueError(
          f"TensorParallelBlockSparseLinear: its state {got} does not fit the layer ({self.in_features} -> "
          f"{self.out_features}, blocks {self.block_shape}, split by {self.split} over {target} devices), which "
          f"needs {expected}: a state of another layer was restored into it."
      )

  def _state_shapes(self) -> dict[str, tuple[int, ...]]:
    shapes = {"kernel": tuple(self.kernel.shape), "source": tuple(self.source.shape)}
    return shapes | {f"pattern.{f}": tuple(v.shape) for f, v in sorted(dict_items(self.pattern))}

  def _layout_shapes(self, shards: int, local_shape: tuple[int, int], per_shard: int) -> dict[str, tuple[int, ...]]:
    """The state's shapes for ``shards`` shards of ``local_shape`` with ``per_shard`` blocks each."""
    (bk, bn), (k, n) = self.block_shape, local_shape
    shapes = {"kernel": (shards, per_shard, bk, bn), "source": (shards, per_shard)}
    index = {"col_indices": per_shard, "col_offsets": n // bn + 1, "row_indices": per_shard,
             "row_offsets": k // bk + 1, "transpose_order": per_shard}
    return shapes | {f"pattern.{f}": (shards, size) for f, size in sorted(index.items())}

  def resplit(self) -> None:
    """Lays the layer's state out over its own mesh axis: after restoring a state saved from another tensor-parallel
    size (a mesh whose axis had another number of devices).

    The saved state keeps each block's position in its shard (the per-shard index arrays) and in the unsplit matrix
    (``source``), so the unsplit matrix is rebuilt from it and split again over ``axis`` of ``mesh``, as the
    constructor splits a layer; the bias is placed on the mesh again. Its values and outputs are those of the layer
    that was saved. On a state already laid out for the mesh it changes nothing but the placement. Host work on
    concrete values (as :meth:`to_block_sparse_linear`): call it outside ``jit``, before making an optimizer (the
    kernel's shape changes).

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import BlockSparseLinear
    >>> from jaxsparse.sharding import TensorParallelBlockSparseLinear
    >>> layer = BlockSparseLinear(64, 128, density=0.5, block_shape=(16, 16), rngs=nnx.Rngs(0))
    >>> tp = TensorParallelBlockSparseLinear(layer, jax.make_mesh((1,), ("model",)), "model", split="columns")
    >>> saved = nnx.state(tp)  # on a host with more devices: a layer of another mesh size
    >>> nnx.update(tp, saved)
    >>> tp.resplit()
    >>> bool(jnp.allclose(tp(jnp.ones((2, 64))), layer(jnp.ones((2, 64))), atol=1e-5))
    True

    Raises:
      ValueError: a traced state (under ``jit``); a state whose shapes are not those of this layer split over any
        number of shards (another layer's); a block count along the split that the axis size does not divide (as the
        constructor raises).
    """
    arrays = {"kernel": self.kernel[...], "source": self.source[...],
              **{f: v[...] for f, v in dict_items(self.pattern)}}
    if not all(is_concrete(a) for a in arrays.values()):
      raise ValueError("resplit needs the layer's state to be concrete (it rebuilds the pattern on the host); call it "
                       "outside jit.")
    saved, per_shard = self.kernel.shape[:2]
    kb, nb = self.in_features // self.block_shape[0], self.out_features // self.block_shape[1]
    along = nb if self.split == "columns" else kb
    local = None
    if saved > 0 and along % saved == 0:
      local = ((self.in_features, self.out_features // saved) if self.split == "columns" else
               (self.in_features // saved, self.out_features))
    if local is None or self._state_shapes() != self._layout_shapes(saved, local, per_shard):
      raise ValueError(
          f"resplit: the state {self._state_shapes()} is not that of this layer ({self.in_features} -> "
          f"{self.out_features}, blocks {self.block_shape}, split by {self.split}) over any number of shards; it was "
          "saved from another layer."
      )
    host = {k: jnp.asarray(np.asarray(replicated(v))) for k, v in arrays.items()}  # gathered, on one device
    shards = BlockSparseMatrix.from_index_arrays(
        host["kernel"], {f: host[f] for f in self.pattern}, shape=local, block_shape=self.block_shape,
        validate=False,  # stacked per-shard patterns
    )
    saved_matrix = ShardedBlockSparseMatrix(
        shards, np.asarray(host["source"]), mesh=self.mesh, axis=self.axis, split=self.split,
        shape=(self.in_features, self.out_features),
    )
    w = shard_block_sparse(saved_matrix.to_block_sparse(), self.mesh, self.axis, split=self.split)
    self.kernel.set_value(w.data)
    for f, v in w.shards.index_arrays().items():
      self.pattern[f].set_value(v)
    self.source.set_value(w.source)
    if self.bias is not None:
      names = (self.axis,) if self.split == "columns" else (None,)
      bias = jnp.asarray(np.asarray(replicated(self.bias[...])))
      self.bias.set_value(jax.device_put(bias, NamedSharding(self.mesh, P(*names))))
    self.local_shape, self.nnz_blocks = w.shards.shape, w.nnz_blocks

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

    Raises:
      ValueError: a state laid out for another size of the mesh axis (restored from a layer of another
        tensor-parallel size: :meth:`resplit` lays it out again), or of other shapes.
    """
    self._check_layout()
    shards = BlockSparseMatrix.from_index_arrays(
        self.kernel[...], {f: v[...] for f, v in dict_items(self.pattern)}, shape=self.local_shape,
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
      ValueError: ``x`` not ``(..., in_features)``, ``batch_axes`` that do not fit ``x`` or the mesh, or a state laid
        out for another size of the mesh axis (see :meth:`resplit`).

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

    Raises:
      ValueError: a traced pattern (under ``jit``); a state restored from a layer of another tensor-parallel size
        or pattern (:meth:`resplit` lays it out for this layer first).

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
    source = self.source[...]
    if is_concrete(source) and int(np.count_nonzero(np.asarray(source) >= 0)) != self.nnz_blocks:
      raise ValueError(
          f"to_block_sparse_linear: the layer's source holds {int(np.count_nonzero(np.asarray(source) >= 0))} "
          f"blocks, its nnz_blocks says {self.nnz_blocks}: a state of another pattern was restored into it; call "
          "layer.resplit() first."
      )
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
