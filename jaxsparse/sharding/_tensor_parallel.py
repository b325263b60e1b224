"""Tensor parallelism for block-sparse weights: a ``BlockSparseMatrix`` split over one mesh axis.

A column split (``split="columns"``) gives each of the ``S`` devices on ``axis`` the block columns
``[s N/S, (s+1) N/S)``: ``y = x @ W`` is then computed with no communication and comes out sharded on
``N`` (column-parallel). A row split gives each device the block rows ``[s K/S, (s+1) K/S)`` and
expects ``x`` sharded on ``K``: each device computes a partial ``y``, reduced with one ``psum`` (or
``psum_scatter``) over ``axis`` (row-parallel). A Megatron MLP is column- then row-parallel, with one
reduction in the forward pass and one in the backward pass.

Each shard is a :class:`jaxsparse.BlockSparseMatrix` of its own, with index arrays built once on the
host by :func:`shard_block_sparse`. Shards keep different numbers of blocks, so every shard is padded
to the largest count with zero blocks at free positions of its grid; padding blocks stay zero (their
gradient is zero) and :meth:`ShardedBlockSparseMatrix.to_block_sparse` drops them.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import export
from jax import lax
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsparse import _utils
from jaxsparse.formats._base import is_concrete
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._block_sparse import block_pattern_indices
from jaxsparse.formats._masks import replicated
from jaxsparse.ops._block_sparse_matmul import Implementation
from jaxsparse.ops._block_sparse_matmul import block_sparse_matmul
from jaxsparse.ops._sharding import _like
from jaxsparse.ops._sharding import check_reduced
from jaxsparse.sharding._mesh_data import mesh_from_plain
from jaxsparse.sharding._mesh_data import mesh_to_plain

__all__ = [
    "ShardedBlockSparseMatrix",
    "column_parallel_matmul",
    "megatron_mlp",
    "row_parallel_matmul",
    "shard_block_sparse",
]

Split = Literal["columns", "rows"]
BatchAxes = str | tuple[str | tuple[str, ...] | None, ...] | None


@jax.tree_util.register_pytree_node_class
class ShardedBlockSparseMatrix:
  """A ``(K, N)`` block-sparse matrix split by block columns or block rows over one mesh axis.

  Build it with :func:`shard_block_sparse`; multiply with :func:`column_parallel_matmul` (column
  split) or :func:`row_parallel_matmul` (row split).

  Attributes:
    shards: a :class:`jaxsparse.BlockSparseMatrix` whose array leaves carry a leading shard dimension
      ``S`` (``data`` is ``(S, nnz_per_shard, bk, bn)``), sharded over ``axis``; its static ``shape``
      is one shard's ``(K, N / S)`` or ``(K / S, N)``.
    source: int32 ``(S, nnz_per_shard)``: the position of each shard block in the unsplit matrix's
      ``data``, ``-1`` for padding.
    mesh, axis, split: the layout (static).
    shape: static ``(K, N)`` of the whole matrix.
    nnz_blocks: static number of blocks of the whole matrix (padding excluded); ``None`` counts them from
      ``source`` when it is concrete. With it, :meth:`global_data` also runs under ``jit``.

  The constructor takes the attributes, as ``ShardedBlockSparseMatrix(shards, source, *, mesh, axis, split, shape,
  nnz_blocks=None)``, unchecked: :func:`shard_block_sparse` builds a consistent one.

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> from jaxsparse import sharding
  >>> mesh = jax.make_mesh((1,), ("model",))  # one device here; a "model" axis of S devices on a multi-GPU host
  >>> w = jaxsparse.BlockSparseMatrix.from_dense(jnp.ones((64, 128)), (16, 16))
  >>> ws = sharding.shard_block_sparse(w, mesh, "model", split="rows")
  >>> ws.shape, ws.split, ws.axis, ws.source.shape, ws.source.dtype, ws.dtype
  ((64, 128), 'rows', 'model', (1, 32), dtype('int32'), dtype('float32'))
  >>> bool((ws.to_block_sparse().to_dense() == w.to_dense()).all())
  True
  """

  def __init__(
      self, shards: BlockSparseMatrix, source: jax.Array, *, mesh: Mesh, axis: str, split: Split, shape,
      nnz_blocks: int | None = None,
  ):
    self.shards, self.source = shards, source
    self.mesh, self.axis, self.split, self.shape = mesh, axis, split, tuple(shape)
    if nnz_blocks is None and isinstance(source, np.ndarray | jax.Array) and is_concrete(source):
      nnz_blocks = int(np.count_nonzero(np.asarray(source) >= 0))
    self.nnz_blocks = nnz_blocks

  def tree_flatten(self):
    """JAX pytree protocol: ``((shards, source), (mesh, axis, split, shape, nnz_blocks))``."""
    return (self.shards, self.source), (self.mesh, self.axis, self.split, self.shape, self.nnz_blocks)

  @classmethod
  def tree_unflatten(cls, aux, children):
    """JAX pytree protocol: the matrix back from :meth:`tree_flatten`'s parts."""
    mesh, axis, split, shape, nnz_blocks = aux
    return cls(*children, mesh=mesh, axis=axis, split=split, shape=shape, nnz_blocks=nnz_blocks)

  @property
  def data(self) -> jax.Array:
    """``(S, nnz_per_shard, bk, bn)`` block values, sharded over ``axis``."""
    return self.shards.data

  @property
  def dtype(self) -> jnp.dtype:
    """The dtype of the block values (as :attr:`jaxsparse.BlockSparseMatrix.dtype`)."""
    return self.shards.dtype

  @property
  def num_shards(self) -> int:
    """``S``: the size of the mesh axis the matrix is split over."""
    return self.mesh.shape[self.axis]

  def with_data(self, data: jax.typing.ArrayLike) -> ShardedBlockSparseMatrix:
    """The same layout with new block values (e.g. a traced parameter inside a loss).

    Args:
      data: ``(S, nnz_per_shard, bk, bn)`` new block values, the shape of :attr:`data` (padding blocks included).

    Returns:
      A ``ShardedBlockSparseMatrix`` sharing the pattern, mesh and layout with ``self``.

    Raises:
      ValueError: ``data`` of another shape.

    >>> import jax, jax.numpy as jnp, jaxsparse
    >>> from jaxsparse import sharding
    >>> mesh = jax.make_mesh((1,), ("model",))
    >>> ws = sharding.shard_block_sparse(jaxsparse.BlockSparseMatrix.from_dense(jnp.ones((32, 32)), (16, 16)), mesh,
    ...                                  "model", split="columns")
    >>> ws.with_data(2 * ws.data).to_block_sparse().to_dense()[0, 0].item()
    2.0
    """
    data = jnp.asarray(data)
    if data.shape != self.data.shape:
      raise ValueError(f"data must have shape {self.data.shape} (shards, blocks, bk, bn), got {data.shape}.")
    children, treedef = jax.tree.flatten(self.shards)
    shards = jax.tree.unflatten(treedef, [data, *children[1:]])
    return ShardedBlockSparseMatrix(
        shards, self.source, mesh=self.mesh, axis=self.axis, split=self.split, shape=self.shape,
        nnz_blocks=self.nnz_blocks,
    )

  def global_data(self, data: jax.typing.ArrayLike | None = None) -> jax.Array:
    """``data`` (default: the matrix's own) in the unsplit matrix's block order, padding dropped.

    Also maps a gradient with respect to :attr:`data` to the gradient of the unsplit matrix. Runs under
    ``jit`` (``source`` traced) when :attr:`nnz_blocks` is known, as it is from :func:`shard_block_sparse`.

    Args:
      data: optional ``(S, nnz_per_shard, bk, bn)`` values laid out as :attr:`data`; ``None`` takes :attr:`data`.

    Returns:
      ``(nnz_blocks, bk, bn)`` in ``data``'s dtype: the ``data`` of the unsplit :class:`jaxsparse.BlockSparseMatrix`.

    Raises:
      ValueError: ``data`` of another shape, or an unknown :attr:`nnz_blocks`.

    >>> import jax, jax.numpy as jnp, jaxsparse
    >>> from jaxsparse import sharding
    >>> mesh = jax.make_mesh((1,), ("model",))
    >>> w = jaxsparse.BlockSparseMatrix.from_dense(jnp.arange(32.0 * 32).reshape(32, 32), (16, 16))
    >>> ws = sharding.shard_block_sparse(w, mesh, "model", split="rows")
    >>> ws.global_data().shape, bool((ws.global_data() == w.data).all())
    ((4, 16, 16), True)
    """
    data = _to_spec(self.data if data is None else jnp.asarray(data), P())
    if data.shape != self.data.shape:
      raise ValueError(f"data must have shape {self.data.shape} (shards, blocks, bk, bn), got {data.shape}.")
    if self.nnz_blocks is None:
      raise ValueError(
          "global_data needs the block count of the unsplit matrix: source is traced and nnz_blocks is None; "
          "build the matrix with shard_block_sparse (or pass nnz_blocks=) outside jit."
      )
    source = _to_spec(jnp.asarray(self.source), P()).reshape(-1)
    source = jnp.where(source >= 0, source, self.nnz_blocks)  # padding: out of range, dropped
    flat = data.reshape(-1, *data.shape[2:])
    return jnp.zeros((self.nnz_blocks, *data.shape[2:]), data.dtype).at[source].set(flat, mode="drop")

  def to_block_sparse(self) -> BlockSparseMatrix:
    """The unsplit :class:`jaxsparse.BlockSparseMatrix` (gathered onto one device); call it outside ``jit``.

    Returns:
      A ``BlockSparseMatrix`` of :attr:`shape` with the blocks of the matrix that was split, in its order.

    Raises:
      ValueError: a traced pattern (under ``jit``).

    >>> import jax, jax.numpy as jnp, jaxsparse
    >>> from jaxsparse import sharding
    >>> mesh = jax.make_mesh((1,), ("model",))
    >>> w = jaxsparse.BlockSparseMatrix.from_dense(jnp.ones((32, 64)), (16, 16))
    >>> sharding.shard_block_sparse(w, mesh, "model", split="columns").to_block_sparse().shape
    (32, 64)
    """
    if not all(is_concrete(a) for a in (self.source, self.shards.row_indices, self.shards.col_indices)):
      raise ValueError(
          "to_block_sparse needs the pattern (source and index arrays) to be concrete, as the unsplit block mask "
          "is built on the host; call it outside jit (global_data maps the values under jit)."
      )
    kb, nb = self.shape[0] // self.shards.block_shape[0], self.shape[1] // self.shards.block_shape[1]
    mask = np.zeros((kb, nb), bool)
    rows, cols = self._global_coords()
    mask[rows, cols] = True
    return BlockSparseMatrix.from_block_mask(mask, self.global_data(), shape=self.shape)

  def _global_coords(self) -> tuple[np.ndarray, np.ndarray]:
    """Block coordinates in the unsplit matrix of the real (non-padding) blocks, in its ``data`` order."""
    source = np.asarray(self.source)
    rows, cols = np.asarray(self.shards.row_indices), np.asarray(self.shards.col_indices)
    kb_local, nb_local = self.shards.grid_shape
    shard = np.broadcast_to(np.arange(source.shape[0])[:, None], source.shape)
    if self.split == "columns":
      cols = cols + shard * nb_local
    else:
      rows = rows + shard * kb_local
    keep = source >= 0
    order = np.argsort(source[keep])
    return rows[keep][order], cols[keep][order]

  def __repr__(self) -> str:
    return (
        f"ShardedBlockSparseMatrix(shape={self.shape}, block_shape={self.shards.block_shape}, "
        f"split={self.split!r}, axis={self.axis!r}, shards={self.num_shards}, "
        f"blocks_per_shard={self.data.shape[1]})"
    )


def _serialize_aux(aux: tuple) -> bytes:
  # The mesh by its devices' ids: deserialized, the same (interned) Mesh, so that the exported function's in/out
  # trees equal those of the matrices it is called with.
  mesh, axis, split, shape, nnz_blocks = aux
  return json.dumps({"mesh": mesh_to_plain(mesh), "axis": axis, "split": split, "shape": list(shape),
                     "nnz_blocks": nnz_blocks}).encode()


def _deserialize_aux(data: bytes) -> tuple:
  aux = json.loads(data)
  mesh = mesh_from_plain(aux["mesh"], "ShardedBlockSparseMatrix")
  return mesh, aux["axis"], aux["split"], tuple(aux["shape"]), aux["nnz_blocks"]


# As an argument or result of an exported function (``Exported.serialize`` refuses pytree nodes it has no name for).
export.register_pytree_node_serialization(
    ShardedBlockSparseMatrix, serialized_name="jaxsparse.sharding.ShardedBlockSparseMatrix",
    serialize_auxdata=_serialize_aux, deserialize_auxdata=_deserialize_aux,
)


def shard_block_sparse(w: BlockSparseMatrix, mesh: Mesh, axis: str, *, split: Split) -> ShardedBlockSparseMatrix:
  """Lays ``w`` out over the mesh axis ``axis``, split by block columns or block rows.

  The per-shard index arrays are computed here, once, on the host.

  >>> import jax, jaxsparse
  >>> from jaxsparse.sharding import shard_block_sparse
  >>> k1, k2 = jax.random.split(jax.random.key(0))
  >>> w = jaxsparse.BlockSparseMatrix.from_dense(
  ...     jax.random.normal(k1, (64, 128)), (16, 16),
  ...     block_mask=jaxsparse.random_block_mask(k2, (64, 128), (16, 16), 0.5))
  >>> mesh = jax.make_mesh((1,), ("model",))
  >>> ws = shard_block_sparse(w, mesh, "model", split="columns")
  >>> ws.data.shape, bool((ws.to_block_sparse().to_dense() == w.to_dense()).all())
  ((1, 16, 16, 16), True)

  Args:
    w: the whole ``(K, N)`` matrix; its index arrays must be concrete.
    mesh: the device mesh.
    axis: the mesh axis to split over; ``N // bn`` (columns) or ``K // bk`` (rows) must divide by
      its size.
    split: ``"columns"`` for column-parallel (:func:`column_parallel_matmul`), ``"rows"`` for
      row-parallel (:func:`row_parallel_matmul`).

  Returns:
    A :class:`ShardedBlockSparseMatrix` with its leaves sharded over ``axis``; ``data`` is
    ``(S, nnz_per_shard, bk, bn)`` in ``w``'s dtype, shards with fewer blocks padded with zero blocks.

  Raises:
    TypeError: ``w`` is not a :class:`jaxsparse.BlockSparseMatrix`, ``mesh`` not a ``jax.sharding.Mesh`` or ``axis``
      not a ``str``.
    ValueError: a bad ``split``, an ``axis`` not of ``mesh``, a block count along the split that the axis size does
      not divide, or traced index arrays.
  """
  if not isinstance(w, BlockSparseMatrix):
    raise TypeError(f"w must be a jaxsparse.BlockSparseMatrix, got {type(w).__name__}.")
  if split not in ("columns", "rows"):
    raise ValueError(f"split must be 'columns' or 'rows', got split={split!r}.")
  if not isinstance(mesh, Mesh):
    raise TypeError(
        f"mesh must be a jax.sharding.Mesh (e.g. from jax.make_mesh), whose devices hold the shards, got "
        f"{type(mesh).__name__}."
    )
  if not isinstance(axis, str):
    raise TypeError(
        f"axis must be the name of one mesh axis (a str), got axis={axis!r}; the mesh's axes are {tuple(mesh.shape)}."
    )
  if axis not in mesh.shape:
    raise ValueError(f"axis={axis!r} is not an axis of the mesh, whose axes are {tuple(mesh.shape)}.")
  s = mesh.shape[axis]
  kb, nb = w.grid_shape
  along = nb if split == "columns" else kb
  if along % s:
    what = "block columns N // bn" if split == "columns" else "block rows K // bk"
    raise ValueError(f"{what} = {along} must divide by the {s} devices of mesh axis {axis!r}.")
  try:
    rows, cols = np.asarray(w.row_indices), np.asarray(w.col_indices)
  except jax.errors.TracerArrayConversionError as e:
    raise ValueError(
        "shard_block_sparse needs w's index arrays to be concrete (they fix each shard's block count, hence the "
        "shapes); call it outside jit / eval_shape. For an abstract restore target, close over a concrete layer or "
        "matrix: nnx.eval_shape(lambda: TensorParallelBlockSparseLinear(layer, mesh, axis, split=...))."
    ) from e
  position = np.full((kb, nb), -1, np.int32)
  position[rows, cols] = np.arange(rows.size, dtype=np.int32)
  if split == "columns":
    local = [position[:, i * (nb // s) : (i + 1) * (nb // s)] for i in range(s)]
  else:
    local = [position[i * (kb // s) : (i + 1) * (kb // s)] for i in range(s)]
  per_shard = max(int((p >= 0).sum()) for p in local)
  masks, sources = [], []
  for p in local:
    mask = p >= 0
    free = np.flatnonzero(~mask)[: per_shard - int(mask.sum())]
    mask.reshape(-1)[free] = True  # padding blocks, at free positions of this shard's grid
    masks.append(mask)
    sources.append(p[mask])  # row-major order, like BlockSparseMatrix.data; -1 marks padding
  source = np.stack(sources)
  index = {k: np.stack([block_pattern_indices(m)[k] for m in masks]) for k in block_pattern_indices(masks[0])}
  # Values split over explicit mesh axes (FSDP-style) are gathered: JAX cannot type a gather from a split operand.
  blocks = replicated(w.data)[np.maximum(source, 0)]
  data = jnp.where((source >= 0)[..., None, None], blocks, jnp.zeros((), w.dtype))
  local_shape = (w.shape[0], w.shape[1] // s) if split == "columns" else (w.shape[0] // s, w.shape[1])
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P(axis)))
  # One pattern per shard, stacked along a leading axis: the index arrays are 2-D, so no 2-D validation.
  shards = BlockSparseMatrix(put(data), validate=False, shape=local_shape, block_shape=w.block_shape,
                             **jax.tree.map(put, index))
  return ShardedBlockSparseMatrix(
      shards, put(source), mesh=mesh, axis=axis, split=split, shape=w.shape, nnz_blocks=int(rows.size)
  )


# -------------------------------------------------------------------------------------------------
# Products: shard_map over the whole mesh inside a custom VJP that places every reduction itself.
# -------------------------------------------------------------------------------------------------


def _check_batch_axes(batch_axes: BatchAxes, mesh: Mesh, axis: str) -> tuple:
  """``batch_axes`` as spec entries, one per leading dim, checked: axes of ``mesh`` other than ``axis``, each once."""
  if batch_axes is None:
    return ()
  if not isinstance(batch_axes, str | tuple | list):
    raise ValueError(
        f"batch_axes={batch_axes!r}: must be None, a mesh axis name, or a tuple with one entry per leading dim of x "
        f"(None, an axis name or a tuple of them), naming axes of the mesh {tuple(mesh.shape)}."
    )
  entries = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
  for e in entries:
    if not (e is None or isinstance(e, str) or (isinstance(e, tuple) and all(isinstance(a, str) for a in e))):
      raise ValueError(f"batch_axes={batch_axes!r}: each entry must be None, a mesh axis name or a tuple of them.")
  named = _utils.spec_axes(*entries)
  for a in named:
    if a not in mesh.shape:
      raise ValueError(f"batch_axes names {a!r}, which is not an axis of the mesh {tuple(mesh.shape)}.")
  if axis in named:
    raise ValueError(
        f"batch_axes={batch_axes!r} names {axis!r}, the mesh axis the weight is split over (tensor parallel); "
        f"the batch can only be split over the other axes of the mesh {tuple(mesh.shape)}."
    )
  if len(set(named)) != len(named):
    raise ValueError(f"batch_axes={batch_axes!r} names a mesh axis more than once.")
  return entries


def _batch_entries(x: jax.Array, batch_axes: BatchAxes, w: ShardedBlockSparseMatrix) -> tuple:
  """Spec entries of ``x``'s leading dims: ``batch_axes`` if given, else those of an explicit sharding.

  A leading dim that does not divide by its entry's number of devices gets ``None`` (gathered, as the data-parallel
  ops do: padding rows would add garbage to the weight gradient). Read from an explicit type, an entry naming
  ``w.axis`` also gets ``None``: ``x`` is replicated over the tensor-parallel axis (split on ``K`` for rows).
  """
  n_lead, mesh = x.ndim - 1, w.mesh
  if batch_axes is None:
    sharding = jax.typeof(x).sharding
    xmesh = getattr(sharding, "mesh", None)
    if xmesh is None or xmesh.empty or AxisType.Explicit not in xmesh.axis_types:
      return (None,) * n_lead
    check_reduced(sharding.spec)
    spec = tuple(sharding.spec) + (None,) * x.ndim
    entries = tuple(None if w.axis in _utils.spec_axes(e) else e for e in spec[:n_lead])
    if any(a not in mesh.shape for a in _utils.spec_axes(*entries)):
      raise ValueError(
          f"x is sharded as {sharding.spec} over a mesh of axes {tuple(xmesh.shape)}, w over one of axes "
          f"{tuple(mesh.shape)}: place x on w's mesh."
      )
  else:
    entries = _check_batch_axes(batch_axes, mesh, w.axis)
    if len(entries) > n_lead:
      raise ValueError(f"batch_axes={batch_axes!r} names more dims than the {n_lead} leading dims of x {x.shape}.")
    entries = entries + (None,) * (n_lead - len(entries))
  size = lambda e: math.prod(mesh.shape[a] for a in _utils.spec_axes(e))
  lead = zip(entries, x.shape[:n_lead], strict=True)
  return tuple(e if e is not None and d % size(e) == 0 else None for e, d in lead)


def _to_spec(x: jax.Array, spec: P, mesh: Mesh | None = None) -> jax.Array:
  """Reshards ``x`` to ``spec`` over ``mesh`` (default: ``x``'s own) when that mesh has explicit axes, so that
  ``shard_map`` accepts it, an array not yet placed on the mesh included; auto axes reshard by themselves."""
  mesh = getattr(jax.typeof(x).sharding, "mesh", None) if mesh is None else mesh
  if mesh is not None and not mesh.empty and AxisType.Explicit in mesh.axis_types:
    return jax.reshard(x, NamedSharding(mesh, spec))
  return x


def _placed(w: ShardedBlockSparseMatrix) -> ShardedBlockSparseMatrix:
  """``w``, every leaf split over ``w.axis`` under explicit axes (e.g. after ``with_data`` of an unplaced array)."""
  return jax.tree.map(lambda a: _to_spec(a, P(w.axis), w.mesh), w)


def _local_matrix(w_local: ShardedBlockSparseMatrix, data: jax.Array) -> tuple[BlockSparseMatrix, jax.Array]:
  """This device's shard, with padding blocks zeroed, and the mask of its real blocks."""
  shard = jax.tree.map(lambda a: a[0], w_local.shards)
  valid = w_local.source[0] >= 0
  return shard.with_data(jnp.where(valid[:, None, None], data[0], jnp.zeros((), data.dtype))), valid


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _tp_matmul(batch: tuple, reduce: str, options: tuple, x: jax.Array, w: ShardedBlockSparseMatrix) -> jax.Array:
  return _tp_fwd(batch, reduce, options, x, w)[0]


def _specs(w: ShardedBlockSparseMatrix, batch: tuple, reduce: str) -> tuple[P, P]:
  """``(x spec, y spec)``."""
  if w.split == "columns":
    return P(*batch, None), P(*batch, w.axis)
  return P(*batch, w.axis), P(*batch, w.axis if reduce == "scatter" else None)


def _smap(w: ShardedBlockSparseMatrix, fn: Callable, in_specs, out_specs) -> Callable:
  # The custom VJP places every reduction, so no autodiff runs through the map.
  return jax.shard_map(fn, mesh=w.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _local_matmul(options: tuple, x: jax.Array, w: BlockSparseMatrix) -> jax.Array:
  implementation, precision = options
  return block_sparse_matmul(x, w, implementation=implementation, precision=precision)


def _tp_fwd(batch, reduce, options, x, w):
  x_spec, y_spec = _specs(w, batch, reduce)

  def local(xl, wl):
    y = _local_matmul(options, xl, _local_matrix(wl, wl.data)[0])
    if w.split == "rows" and reduce == "scatter":
      return lax.psum_scatter(y, w.axis, scatter_dimension=y.ndim - 1, tiled=True)
    return lax.psum(y, w.axis) if w.split == "rows" else y

  y = _smap(w, local, (x_spec, P(w.axis)), y_spec)(_to_spec(x, x_spec, w.mesh), _placed(w))
  return y, (x, w)


def _tp_bwd(batch, reduce, options, res, dy):
  x, w = res
  x_spec, y_spec = _specs(w, batch, reduce)
  batch_axes = _utils.spec_axes(*batch)

  def local(xl, wl, dyl):
    if w.split == "rows" and reduce == "scatter":
      dyl = lax.all_gather(dyl, w.axis, axis=dyl.ndim - 1, tiled=True)
    shard, valid = _local_matrix(wl, wl.data)
    _, vjp = jax.vjp(lambda a, d: _local_matmul(options, a, shard.with_data(d)), xl, shard.data)
    dx, ddata = vjp(dyl)
    if w.split == "columns":  # x is replicated over the axis: its gradient sums the shards' parts
      dx = lax.psum(dx, w.axis)
    if batch_axes:
      ddata = lax.psum(ddata, batch_axes)
    return dx, jnp.where(valid[:, None, None], ddata, jnp.zeros((), ddata.dtype))[None]

  dx, ddata = _smap(w, local, (x_spec, P(w.axis), y_spec), (x_spec, P(w.axis)))(
      _to_spec(x, x_spec, w.mesh), _placed(w), _to_spec(dy, y_spec, w.mesh)
  )
  return _like(dx, x), _cotangent(w, _like(ddata, w.data))


def _cotangent(w: ShardedBlockSparseMatrix, ddata: jax.Array) -> ShardedBlockSparseMatrix:
  """The cotangent of ``w``: ``ddata`` for the block values, ``None`` for the integer index leaves."""
  leaves, treedef = jax.tree.flatten(w)
  return jax.tree.unflatten(treedef, [ddata] + [None] * (len(leaves) - 1))


_tp_matmul.defvjp(_tp_fwd, _tp_bwd)


def _check(x, w, split: Split, name: str):
  if not isinstance(w, ShardedBlockSparseMatrix):
    raise TypeError(f"{name}: w must be a ShardedBlockSparseMatrix (from shard_block_sparse), got {type(w).__name__}.")
  if w.split != split:
    raise ValueError(f"{name} needs w split by {split} (shard_block_sparse(..., split={split!r})), got {w.split!r}.")
  x = jnp.asarray(x)
  if x.ndim < 1 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"x must have shape (..., K) with K = w.shape[0] = {w.shape[0]}, got x.shape={x.shape}.")
  return x


def column_parallel_matmul(
    x: jax.typing.ArrayLike,
    w: ShardedBlockSparseMatrix,
    *,
    batch_axes: BatchAxes = None,
    implementation: Implementation | None = None,
    precision: lax.PrecisionLike = None,
):
  """``x @ w`` for ``w`` split by block columns: ``(..., K)`` -> ``(..., N)`` sharded on ``N``, no communication.

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> from jaxsparse import sharding
  >>> mesh = jax.make_mesh((1,), ("model",))  # one device here; a "model" axis of S devices on a multi-GPU host
  >>> w = jaxsparse.BlockSparseMatrix.from_dense(jnp.ones((64, 128)), (16, 16))
  >>> y = sharding.column_parallel_matmul(jnp.ones((2, 64)), sharding.shard_block_sparse(w, mesh, "model",
  ...                                                                                    split="columns"))
  >>> y.shape, y.dtype, bool(jnp.allclose(y, 64.0))
  ((2, 128), dtype('float32'), True)

  Args:
    x: ``(..., K)`` activations, replicated over ``w.axis``.
    w: from :func:`shard_block_sparse` with ``split="columns"``.
    batch_axes: mesh axes of ``x``'s leading dims (data parallel), one spec entry per leading dim,
      e.g. ``"data"`` or ``("data", None)``; ``None`` reads them from ``x``'s type under explicit
      axes (less ``w.axis``) and otherwise replicates the leading dims. ``w.axis`` cannot be one of them;
      a leading dim that does not divide by its number of devices is gathered (correct, slower).
    implementation, precision: for :func:`jaxsparse.ops.block_sparse_matmul` on each shard.

  Returns:
    ``(..., N)``, sharded on ``N`` over ``w.axis`` and on the leading dims as ``batch_axes``. The
    gradient of ``x`` is reduced over ``w.axis`` and that of ``w.data`` over ``batch_axes``.

  Raises:
    TypeError: ``w`` is not a :class:`ShardedBlockSparseMatrix`.
    ValueError: ``w`` split by rows, ``x`` not ``(..., K)``, or ``batch_axes`` that are not axes of the mesh, name
      ``w.axis`` or an axis twice, or name more dims than ``x``'s leading ones.
  """
  x = _check(x, w, "columns", "column_parallel_matmul")
  return _tp_matmul(_batch_entries(x, batch_axes, w), "psum", (implementation, precision), x, w)


def row_parallel_matmul(
    x: jax.typing.ArrayLike,
    w: ShardedBlockSparseMatrix,
    *,
    batch_axes: BatchAxes = None,
    reduce: Literal["psum", "scatter"] = "psum",
    implementation: Implementation | None = None,
    precision: lax.PrecisionLike = None,
):
  """``x @ w`` for ``w`` split by block rows: partial products reduced over ``w.axis``.

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> from jaxsparse import sharding
  >>> mesh = jax.make_mesh((1,), ("model",))  # one device here; a "model" axis of S devices on a multi-GPU host
  >>> w = jaxsparse.BlockSparseMatrix.from_dense(jnp.ones((64, 128)), (16, 16))
  >>> x = jax.device_put(jnp.ones((2, 64)), jax.NamedSharding(mesh, jax.P(None, "model")))  # sharded on K
  >>> y = sharding.row_parallel_matmul(x, sharding.shard_block_sparse(w, mesh, "model", split="rows"))
  >>> y.shape, y.dtype, bool(jnp.allclose(y, 64.0))
  ((2, 128), dtype('float32'), True)

  Args:
    x: ``(..., K)`` activations sharded on ``K`` over ``w.axis`` (the output of
      :func:`column_parallel_matmul`, after any elementwise function).
    w: from :func:`shard_block_sparse` with ``split="rows"``.
    batch_axes: as in :func:`column_parallel_matmul`.
    reduce: ``"psum"`` returns ``y`` replicated over ``w.axis`` (all-reduce); ``"scatter"`` returns
      it sharded on ``N`` over ``w.axis`` (reduce-scatter, half the traffic); ``N`` must divide by
      the axis size.
    implementation, precision: for :func:`jaxsparse.ops.block_sparse_matmul` on each shard.

  Returns:
    ``(..., N)``, replicated over ``w.axis`` (``"psum"``) or sharded on ``N`` over it (``"scatter"``).

  Raises:
    TypeError: ``w`` is not a :class:`ShardedBlockSparseMatrix`.
    ValueError: ``w`` split by columns, ``x`` not ``(..., K)``, bad ``batch_axes``, an unknown ``reduce``, or
      ``reduce="scatter"`` with ``N`` not divisible by the axis size.
  """
  x = _check(x, w, "rows", "row_parallel_matmul")
  if reduce not in ("psum", "scatter"):
    raise ValueError(f"reduce must be 'psum' or 'scatter', got reduce={reduce!r}.")
  if reduce == "scatter" and w.shape[1] % w.num_shards:
    raise ValueError(f"reduce='scatter' needs N = {w.shape[1]} to divide by the {w.num_shards} devices of {w.axis!r}.")
  return _tp_matmul(_batch_entries(x, batch_axes, w), reduce, (implementation, precision), x, w)


def megatron_mlp(
    x: jax.typing.ArrayLike,
    w_in: ShardedBlockSparseMatrix,
    w_out: ShardedBlockSparseMatrix,
    *,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
    batch_axes: BatchAxes = None,
) -> jax.Array:
  """``activation(x @ w_in) @ w_out`` with ``w_in`` column- and ``w_out`` row-parallel (Megatron-LM).

  The hidden activations stay sharded on the hidden dim; the forward pass runs one all-reduce (of
  ``y``) and the backward pass one (of ``dx``), plus the data-parallel reduction of the weight
  gradients over ``batch_axes``.

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> from jaxsparse import sharding
  >>> mesh = jax.make_mesh((1,), ("model",))  # one device here; a "model" axis of S devices on a multi-GPU host
  >>> w_in = jaxsparse.BlockSparseMatrix.from_dense(jnp.ones((32, 64)), (16, 16))
  >>> w_out = jaxsparse.BlockSparseMatrix.from_dense(jnp.ones((64, 32)), (16, 16))
  >>> y = sharding.megatron_mlp(jnp.ones((4, 32)), sharding.shard_block_sparse(w_in, mesh, "model", split="columns"),
  ...                           sharding.shard_block_sparse(w_out, mesh, "model", split="rows"),
  ...                           activation=jax.nn.relu)
  >>> y.shape, bool(jnp.allclose(y, 32.0 * 64.0))
  ((4, 32), True)

  Args:
    x: ``(..., d)``.
    w_in: ``(d, hidden)`` split by columns (:func:`shard_block_sparse` with ``split="columns"``).
    w_out: ``(hidden, d_out)`` split by rows, over the same mesh axis as ``w_in``.
    activation: elementwise function.
    batch_axes: as in :func:`column_parallel_matmul`.

  Returns:
    ``(..., d_out)``, replicated over the tensor-parallel axis.

  Raises:
    TypeError: ``w_in`` or ``w_out`` is not a :class:`ShardedBlockSparseMatrix`.
    ValueError: ``w_in`` and ``w_out`` split over different meshes or axes, of hidden dims that differ, or as the two
      products raise.
  """
  for name, w in (("w_in", w_in), ("w_out", w_out)):
    if not isinstance(w, ShardedBlockSparseMatrix):
      raise TypeError(f"{name} must be a ShardedBlockSparseMatrix (from shard_block_sparse), got {type(w).__name__}.")
  if w_in.axis != w_out.axis or w_in.mesh != w_out.mesh:
    raise ValueError(
        f"w_in and w_out must be split over the same axis of the same mesh, got {w_in.axis!r} of {w_in.mesh} and "
        f"{w_out.axis!r} of {w_out.mesh}."
    )
  if w_in.shape[1] != w_out.shape[0]:
    raise ValueError(
        f"w_in's output features must be w_out's input features (the hidden dim), got w_in.shape={w_in.shape} and "
        f"w_out.shape={w_out.shape}."
    )
  h = column_parallel_matmul(x, w_in, batch_axes=batch_axes)
  return row_parallel_matmul(activation(h), w_out, batch_axes=batch_axes)
