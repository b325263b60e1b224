"""``CompressedNMEmbed``: an embedding table kept N:M-compressed along its features.

The table is kept as the kernel of its :meth:`~CompressedNMEmbed.attend` product, ``(features, num_embeddings)``,
compressed along the features as a :class:`~jaxsparse.layers.CompressedNMLinear` kernel is: the tied-embedding logits
are :func:`jaxsparse.ops.nm_matmul` on the stored arrays, and a lookup gathers the columns of its ids and expands them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes
from flax.typing import Dtype
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsparse import _utils
from jaxsparse import ops
from jaxsparse.formats._masks import replicated
from jaxsparse.formats._nm import NMSparseMatrix
from jaxsparse.formats._nm import decompress
from jaxsparse.formats._nm_masks import check_nm
from jaxsparse.layers._checks import NM_LAYOUT
from jaxsparse.layers._checks import NMLayout
from jaxsparse.layers._checks import check_dtypes
from jaxsparse.layers._checks import check_loaded_positions
from jaxsparse.layers._common import COMPRESSED_VALUES
from jaxsparse.layers._common import SparsityPattern
from jaxsparse.layers._common import check_called_on_one_layer
from jaxsparse.layers._common import check_one_layer
from jaxsparse.layers._nm_compressed import NMPositionsLayer
from jaxsparse.layers._nm_compressed import check_nm_implementation
from jaxsparse.layers._partitioning import carry_back_nnx
from jaxsparse.layers._partitioning import carry_nnx

__all__ = ["CompressedNMEmbed", "attend_table", "check_ids", "check_query", "compress_table", "lookup"]


class CompressedNMEmbed(NMPositionsLayer, nnx.Module):
  """An ``nnx.Embed`` whose ``(num_embeddings, features)`` table is stored N:M-compressed along ``features``.

  The inference (and fixed-pattern fine-tuning) form of a pruned embedding: of every ``m`` consecutive features
  of a row, ``n`` are kept. The table is stored transposed, as the kernel of :meth:`attend`'s product (the
  layout of :class:`~jaxsparse.layers.CompressedNMLinear`'s kernel): ``embedding`` holds the kept values, an
  ``nnx.Param`` of shape ``(features * n // m, num_embeddings)``; ``embedding_positions`` their packed positions, a
  non-trainable :class:`SparsityPattern` of shape ``(groups // per_word, num_embeddings)``, laid out as in
  :class:`jaxsparse.NMSparseMatrix` with ``axis=0``. A 2:4 bfloat16 table takes 0.5625x the dense table's bytes.
  The ``embedding`` param carries the metadata ``nm_compressed="CompressedNMEmbed"``, so that the pruners
  (:mod:`jaxsparse.pruning`) refuse to prune the kept values as a dense table even where they see the parameters
  without the layer (``nnx.state(model, nnx.Param)``, an ``nnx.Optimizer``).

  A lookup gathers the columns of its ids and returns the dense rows, zeros at the pruned features, as ``nnx.Embed``
  does for the pruned dense table (out-of-range ids give NaN rows in floating dtypes, as there). :meth:`attend` (tied
  input and output embeddings) is :func:`jaxsparse.ops.nm_matmul` on the stored arrays, no copy of the table.

  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxsparse.layers import CompressedNMEmbed
  >>> dense = nnx.Embed(100, 64, rngs=nnx.Rngs(0))
  >>> sparse = CompressedNMEmbed.from_dense(dense, 2, 4)
  >>> ids = jnp.array([[3, 14, 15]])
  >>> sparse(ids).shape, sparse.embedding.shape, float(jnp.mean(sparse(ids) == 0))
  ((1, 3, 64), (32, 100), 0.5)
  >>> sparse.attend(jnp.ones((2, 64))).shape
  (2, 100)

  Args:
    weight: the transposed table, a 2-D :class:`jaxsparse.NMSparseMatrix` ``(features, num_embeddings)`` with
      ``axis=0`` (the groups run along the features); :meth:`from_dense` builds it from an ``nnx.Embed``.
    dtype: the dtype of the lookups and of :meth:`attend` (``None``: the table's), as ``nnx.Embed``'s (which
      also stores the table's dtype as ``dtype`` then).
    promote_dtype: as ``nnx.Embed``'s.
    implementation: backend of :func:`jaxsparse.ops.nm_matmul` in :meth:`attend`.
  """

  _positions_attr = "embedding_positions"

  def __init__(
      self,
      weight: NMSparseMatrix,
      *,
      dtype: Dtype | None = None,
      promote_dtype: Callable[..., Any] = dtypes.promote_dtype,
      implementation: ops.NMImplementation | None = None,
  ):
    if not isinstance(weight, NMSparseMatrix) or weight.ndim != 2 or weight.axis != 0:
      raise TypeError(
          "weight must be the transposed table, a 2-D jaxsparse.NMSparseMatrix of shape (features, num_embeddings) "
          f"compressed along the features (axis=0), got {weight!r}; CompressedNMEmbed.from_dense builds it."
      )
    check_dtypes(type(self), dtype=dtype, inexact=False)  # lookups take any dtype, as nnx.Embed's
    self.features, self.num_embeddings = weight.shape
    self.n, self.m = weight.n, weight.m
    self.embedding = nnx.Param(weight.values, **{COMPRESSED_VALUES: type(self).__name__})
    self.embedding_positions = SparsityPattern(weight.indices, **{NM_LAYOUT: self._positions_layout()})
    self.dtype = weight.dtype if dtype is None else dtype  # as nnx.Embed: attend too computes in the table's dtype
    self.promote_dtype = promote_dtype
    self.implementation = check_nm_implementation(implementation)

  def _positions_layout(self) -> NMLayout:
    """What ``embedding_positions`` must be valid for (one table's; a stack's have leading axes)."""
    return NMLayout("CompressedNMEmbed.embedding_positions", (self.features, self.num_embeddings), self.n, self.m, 0)

  @classmethod
  def from_dense(cls, embed: nnx.Embed, n: int = 2, m: int = 4, *, mask: Any = None,
                 implementation: ops.NMImplementation | None = None) -> CompressedNMEmbed:
    """Prunes an ``nnx.Embed`` to ``n`` of every ``m`` features of each row and compresses it.

    Args:
      embed: the dense layer (not changed); its ``dtype`` and ``promote_dtype`` carry over, and so do its table's
        partitioning names (``nnx.with_partitioning``), swapped as the table is, as :func:`jaxsparse.sparsify` does.
      n, m: keep ``n`` of every ``m`` consecutive features; ``m`` must divide ``features``.
      mask: optional bool ``(num_embeddings, features)``, at most ``n`` of every ``m`` features of a row True
        (a pruner's mask): the kept entries are exactly the mask's. ``None`` keeps the largest magnitudes.
      implementation: as in the constructor.

    Returns:
      A ``CompressedNMEmbed`` whose lookups equal ``embed``'s of the pruned table.

    Raises:
      TypeError: ``embed`` is not an ``nnx.Embed``.
      ValueError: ``m`` does not divide ``features``, or ``mask`` has another shape or keeps more than ``n`` of
        some group of ``m``.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import CompressedNMEmbed
    >>> embed = nnx.Embed(10, 8, rngs=nnx.Rngs(0))
    >>> small = CompressedNMEmbed.from_dense(embed, 2, 4)
    >>> small.embedding.shape, (small(jnp.array([3])) != 0).sum().item()
    ((4, 10), 4)
    """
    if not isinstance(embed, nnx.Embed):
      raise TypeError(f"embed must be a flax.nnx.Embed, got {type(embed).__name__}.")
    weight = compress_table(embed.embedding[...], n, m, mask=mask)
    sparse = cls(weight, dtype=embed.dtype, promote_dtype=embed.promote_dtype, implementation=implementation)
    return carry_nnx(embed, sparse)  # the table's partitioning names and placement

  @property
  def weight(self) -> NMSparseMatrix:
    """The compressed table, transposed: ``(features, num_embeddings)``, the groups along axis 0.

    >>> from flax import nnx
    >>> from jaxsparse.layers import CompressedNMEmbed
    >>> w = CompressedNMEmbed.from_dense(nnx.Embed(10, 8, rngs=nnx.Rngs(0)), 2, 4).weight
    >>> w.shape, w.axis, (w.n, w.m)
    ((8, 10), 0, (2, 4))

    Raises:
      ValueError: this layer is a stack of layers (built by ``nnx.vmap``); read it per layer:
        ``nnx.vmap(lambda layer: layer.weight, in_axes=0, out_axes=0)(stack)``. Or (outside ``jit``, checked once
        per positions array) ``embedding_positions`` that are not valid for the layer's n:m, such as a checkpoint
        of another n:m restored into it: the message names the n:m they fit.
    """
    check_one_layer(self, what="weight")
    w = NMSparseMatrix(self.embedding[...], self.embedding_positions[...],
                       shape=(self.features, self.num_embeddings), n=self.n, m=self.m, axis=0, validate=False)
    return check_loaded_positions("CompressedNMEmbed.embedding_positions", w)

  def __call__(self, inputs: jax.Array) -> jax.Array:
    """Looks up the rows of the pruned table, as ``nnx.Embed`` does.

    Args:
      inputs: integer token ids of any shape; negative ids count from the end and out-of-range ids give rows of
        ``jnp.take``'s fill value (NaN for floating tables), as ``nnx.Embed``'s ``jnp.take``.

    Returns:
      ``(*inputs.shape, features)`` in ``dtype`` if set, else the table's dtype; zeros at the pruned features.

    Raises:
      ValueError: ``inputs`` that are not integers.
      IndexError: ids looked up in an empty table (``num_embeddings=0``), as ``nnx.Embed``'s ``jnp.take`` raises.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import CompressedNMEmbed
    >>> small = CompressedNMEmbed.from_dense(nnx.Embed(10, 8, rngs=nnx.Rngs(0)), 2, 4)
    >>> ids = jnp.array([[1, 2, 3]])
    >>> small(ids).shape, bool((small(ids) == small.to_dense()(ids)).all())
    ((1, 3, 8), True)
    """
    check_called_on_one_layer(self)
    inputs = check_ids(inputs)
    (values,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
    return lookup(self.weight.with_values(values), inputs)

  def attend(self, query: jax.Array, *, precision: lax.PrecisionLike = None) -> jax.Array:
    """``query @ table.T`` with the pruned table (tied output logits), as ``nnx.Embed.attend``.

    Args:
      query: ``(..., features)``.
      precision: of the product, as in :func:`jaxsparse.ops.nm_matmul`.

    Returns:
      ``(..., num_embeddings)`` logits in ``dtype`` (the table's unless set), as ``nnx.Embed.attend``.

    Raises:
      ValueError: ``query`` whose last axis is not ``features``.
      TypeError: a complex ``query``.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxsparse.layers import CompressedNMEmbed
    >>> small = CompressedNMEmbed.from_dense(nnx.Embed(10, 8, rngs=nnx.Rngs(0)), 2, 4)
    >>> q = jnp.ones((2, 8))
    >>> small.attend(q).shape, bool(jnp.allclose(small.attend(q), small.to_dense().attend(q), atol=1e-6))
    ((2, 10), True)
    """
    check_called_on_one_layer(self)
    check_query(query, self.features)
    query, values = self.promote_dtype((query, self.embedding[...]), dtype=self.dtype)
    return attend_table(query, self.weight.with_values(values), implementation=self.implementation,
                        precision=precision)

  def to_dense(self) -> nnx.Embed:
    """An ``nnx.Embed`` holding the decompressed table (zeros at the pruned features), same ``dtype``.

    Returns:
      An ``nnx.Embed`` of ``(num_embeddings, features)`` whose lookups and :meth:`attend` equal this layer's. The
      table takes the partitioning names (``nnx.with_partitioning``) of the stored one, swapped back, and its
      placement on a mesh, as :func:`jaxsparse.densify` gives them.

    >>> from flax import nnx
    >>> from jaxsparse.layers import CompressedNMEmbed
    >>> dense = CompressedNMEmbed.from_dense(nnx.Embed(10, 8, rngs=nnx.Rngs(0)), 2, 4).to_dense()
    >>> dense.embedding.shape, (dense.embedding[...] != 0).sum().item()
    ((10, 8), 40)

    Raises:
      ValueError: this layer is a stack of layers (built by ``nnx.vmap``); call it per layer:
        ``nnx.vmap(lambda layer: layer.to_dense(), in_axes=0, out_axes=0)(stack)``.
    """
    check_one_layer(self, what="to_dense()")
    table = self.weight.to_dense().T
    dense = nnx.Embed(self.num_embeddings, self.features, dtype=self.dtype, param_dtype=table.dtype,
                      promote_dtype=self.promote_dtype, embedding_init=lambda *_: table, rngs=nnx.Rngs(0))
    return carry_back_nnx(self, dense)  # the partitioning names and placement


def compress_table(table: jax.Array, n: int, m: int, *, mask: Any = None) -> NMSparseMatrix:
  """A ``(num_embeddings, features)`` table pruned to ``n`` of every ``m`` features of each row, stored transposed.

  The one home of the pruning both ``CompressedNMEmbed`` layers (NNX and Linen) and ``sparsify`` / ``sparsify_linen``
  use; it also runs traced (``jax.eval_shape`` of an ``init``) when ``mask`` is ``None``.

  Args:
    table: ``(num_embeddings, features)``.
    n, m: keep ``n`` of every ``m`` consecutive features; ``m`` must divide ``features``.
    mask: optional bool ``(num_embeddings, features)``, at most ``n`` of every ``m`` features of a row True: the kept
      entries are exactly the mask's. ``None`` keeps the largest magnitudes.

  Returns:
    The transposed table ``(features, num_embeddings)`` as a :class:`jaxsparse.NMSparseMatrix` with ``axis=0``;
    replicated where explicit mesh axes split ``table`` (the sparsify functions place it by the table's names).

  Raises:
    ValueError: ``m`` does not divide ``features``, or ``mask`` has another shape or keeps more than ``n`` of some
      group of ``m``.

  >>> import jax.numpy as jnp
  >>> from jaxsparse.layers._embed import compress_table
  >>> w = compress_table(jnp.arange(16.0).reshape(2, 8), 2, 4)
  >>> w.shape, w.values.shape, w.to_dense().T[0].tolist()
  ((8, 2), (4, 2), [0.0, 0.0, 2.0, 3.0, 0.0, 0.0, 6.0, 7.0])
  """
  n, m = check_nm(n, m)
  if jnp.ndim(table) != 2:
    raise ValueError(f"table must be 2-D (num_embeddings, features), got shape {tuple(jnp.shape(table))}.")
  if table.shape[1] % m:
    raise ValueError(f"m={m} must divide the embedding's features={table.shape[1]} (the groups run along them).")
  # A table split over explicit mesh axes is compressed whole: JAX refuses to pack groups across a split dim.
  table = replicated(table)
  if mask is None:
    return NMSparseMatrix.from_dense(table.T, n, m, axis=0)
  mask = np.asarray(mask, bool)
  if mask.shape != table.shape:
    raise ValueError(f"mask must have the table's shape {tuple(table.shape)}, got {mask.shape}.")
  counts = mask.reshape(mask.shape[0], -1, m).sum(-1)
  if counts.max(initial=0) > n:
    row, group = np.unravel_index(np.argmax(counts), counts.shape)
    raise ValueError(
        f"mask keeps {int(counts.max())} of the {m} features of group {int(group)} in row {int(row)}; an {n}:{m} "
        f"table keeps at most {n} of every {m}."
    )
  table = jnp.where(mask, table, jnp.zeros((), table.dtype))
  # The mask's positions, not a magnitude choice among the table's zeros (an all-zero padding row would keep the
  # first features, and fine-tuning would train those); the values are the table's there.
  kept = NMSparseMatrix.from_dense(jnp.asarray(mask.T, jnp.uint8), n, m, axis=0)
  return kept.gather(table.T)


def check_ids(inputs: jax.typing.ArrayLike) -> jax.Array:
  """``inputs`` as an array of integer token ids; raises naming the dtype otherwise (``None`` or a string: a
  ``TypeError`` naming ``inputs``)."""
  inputs = _utils.as_array(inputs, name="inputs")
  if not jnp.issubdtype(inputs.dtype, jnp.integer):
    raise ValueError(f"inputs must be integer token ids, got dtype {inputs.dtype}.")
  return inputs


def check_query(query: jax.typing.ArrayLike, features: int) -> None:
  """Raises for an ``attend`` query whose last axis is not ``features``, naming both, or whose dtype is complex."""
  dtype = jnp.result_type(query)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    raise TypeError(f"CompressedNMEmbed.attend: query must be real (a floating, integer or bool array; the pruned "
                    f"table is real and its N:M product takes real inputs only), got query.dtype={dtype}. For a "
                    "complex query, attend its real and imaginary parts separately.")
  shape = jnp.shape(query)
  if not shape or shape[-1] != features:
    raise ValueError(f"CompressedNMEmbed has features={features}: query must have shape (..., {features}), got "
                     f"query.shape={tuple(shape)}.")


def attend_table(query: jax.Array, weight: NMSparseMatrix, *, implementation: ops.NMImplementation | None,
                 precision: lax.PrecisionLike) -> jax.Array:
  """``query @ weight``: the tied-embedding logits of both ``CompressedNMEmbed`` layers (NNX and Linen).

  Args:
    query: ``(..., features)``, promoted to the table's dtype.
    weight: the transposed table ``(features, num_embeddings)`` (``axis=0``), its values promoted.
    implementation, precision: of :func:`jaxsparse.ops.nm_matmul`.

  Returns:
    ``(..., num_embeddings)``. A table of no features gives zeros, as the Flax layers' ``jnp.dot`` does (the N:M
    ops need a contraction of at least one feature). Where explicit mesh axes split the stored table's vocabulary, the
    logits' last axis comes back split over the same axes, as a Flax ``Embed.attend`` of the table split so returns
    it (unless the query's leading axes use those axes, or they do not divide ``num_embeddings``); the product itself
    runs on the gathered table, as the ops run theirs.
  """
  features, num_embeddings = weight.shape
  if features == 0:
    return jnp.zeros((*jnp.shape(query)[:-1], num_embeddings), jnp.result_type(query, weight.values))
  logits = ops.nm_matmul(query, weight, implementation=implementation, precision=precision)
  return _split_last_like_table(logits, weight.values, axis=1)


def lookup(weight: NMSparseMatrix, inputs: jax.Array) -> jax.Array:
  """The rows of the pruned table at the integer ``inputs``, as a Flax ``Embed`` looks them up.

  Args:
    weight: the transposed table ``(features, num_embeddings)`` (``axis=0``), its values in the output dtype.
    inputs: integer ids of any shape; negative ids count from the end and out-of-range ids give rows of
      ``jnp.take``'s fill value (NaN for floating tables), as the Flax layers' ``jnp.take``.

  Returns:
    ``(*inputs.shape, features)``, zeros at the pruned features, split like ``inputs``. A table split over explicit
    mesh axes is gathered for the lookup, as the ops gather their weights (JAX cannot tell how a gather from a split
    table is split); where its features are split, the rows' features come back split over the same axes, as a Flax
    ``Embed``'s lookup of the table split so returns them (unless ``inputs`` use those axes, or they do not divide).
  """
  features, num_embeddings = weight.shape
  if num_embeddings == 0 and inputs.size:  # as the Flax layers' jnp.take, which names neither the table nor the ids
    raise IndexError(f"CompressedNMEmbed has num_embeddings=0: an empty table has no rows to look up, got ids of "
                     f"shape {tuple(inputs.shape)}.")
  if num_embeddings == 1:  # as the Flax layers: every id reads the one row
    return jnp.broadcast_to(weight.to_dense()[:, 0], (*inputs.shape, features))
  columns = decompress(  # jnp.take's index rule, as the Flax layers' (negative ids count from the end)
      _take(weight.values, inputs, axis=1), _take(weight.indices, inputs, axis=1), weight.n, weight.m, 0)
  rows = jnp.moveaxis(columns, 0, -1)
  # The Flax layers' jnp.take fills the rows of out-of-range ids with its fill value (NaN for floating tables, the
  # most negative integer for signed ones...); here only the kept entries would be.
  valid = _take(jnp.ones((num_embeddings,), bool), inputs, axis=0, mode="fill", fill_value=False)
  fill = jnp.take(jnp.zeros((1,), rows.dtype), 1, mode="fill")  # jnp.take's fill value for this dtype
  return _split_last_like_table(jnp.where(valid[..., None], rows, fill), weight.values, axis=0)


def _split_last_like_table(out: jax.Array, values: jax.Array, *, axis: int) -> jax.Array:
  """``out`` (split like the ids or query, last axis whole) with its last axis split over the explicit mesh axes that
  split axis ``axis`` of the stored ``values`` (0: the features, for lookups; 1: the vocabulary, for ``attend``),
  where the leading axes of ``out`` leave those axes free and they divide its last axis."""
  mesh = _utils.explicit_mesh(out)
  if mesh is None or _utils.explicit_mesh(values) != mesh:
    return out
  axes = _utils.spec_axes(*(tuple(jax.typeof(values).sharding.spec) + (None,) * values.ndim)[axis:axis + 1])
  spec = tuple(jax.typeof(out).sharding.spec) + (None,) * out.ndim
  used = set(_utils.spec_axes(*spec[: out.ndim - 1]))
  ways = math.prod(mesh.shape[a] for a in axes)
  if not axes or used & set(axes) or out.shape[-1] % ways:
    return out
  last = axes[0] if len(axes) == 1 else axes
  return jax.reshard(out, NamedSharding(mesh, P(*spec[: out.ndim - 1], last)))


def _take(a: jax.Array, inputs: jax.Array, *, axis: int, **kwargs: Any) -> jax.Array:
  """``jnp.take(a, inputs, axis=axis, **kwargs)``; under explicit mesh axes ``a`` is gathered and the result split
  like ``inputs`` (JAX cannot tell how a gather from a split array, or by split ids, is split)."""
  mesh = _utils.explicit_mesh(inputs) or _utils.explicit_mesh(a)
  if mesh is None:
    return jnp.take(a, inputs, axis=axis, **kwargs)
  spec = tuple(jax.typeof(inputs).sharding.spec) if _utils.explicit_mesh(inputs) == mesh else ()
  spec = (None,) * axis + spec + (None,) * (inputs.ndim - len(spec) + a.ndim - axis - 1)
  index = (slice(None),) * axis + (inputs,)
  return replicated(a).at[index].get(out_sharding=NamedSharding(mesh, P(*spec)), **kwargs)
