"""``CompressedNMEmbed`` (Linen): an ``nn.Embed`` whose table is kept N:M-compressed along its features.

The Linen twin of :class:`jaxsparse.layers.CompressedNMEmbed`, with its stored layout: the table is kept as the kernel
of its :meth:`~CompressedNMEmbed.attend` product, ``params.embedding`` ``(features * n // m, num_embeddings)`` (the
kept values) and ``sparsity.embedding_positions`` (their packed positions). :func:`jaxsparse.sparsify_linen` gives an
``nn.Embed`` these variables under an ``NM`` rule naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype as linen_promote_dtype
from flax.linen.linear import PromoteDtypeFn
from flax.linen.linear import default_embed_init
from flax.typing import Dtype
from flax.typing import Initializer
from jax import lax

from jaxsparse import _utils
from jaxsparse import ops
from jaxsparse.formats import _nm_masks
from jaxsparse.formats._nm import NMSparseMatrix
from jaxsparse.layers._checks import check_dtypes
from jaxsparse.layers._checks import check_init_dtype
from jaxsparse.layers._checks import check_loaded_positions
from jaxsparse.layers._checks import linen_positions_name
from jaxsparse.layers._common import SPARSITY
from jaxsparse.layers._common import check_pattern
from jaxsparse.layers._common import missing_pattern
from jaxsparse.layers._embed import attend_table
from jaxsparse.layers._embed import check_ids
from jaxsparse.layers._embed import check_query
from jaxsparse.layers._embed import compress_table
from jaxsparse.layers._embed import lookup
from jaxsparse.layers._nm_compressed import check_nm_implementation

__all__ = ["CompressedNMEmbed"]


def _transposed_box(drawn: Any, value: jax.Array, *, positions: bool = False) -> Any:
  """``value`` (a transposed, compressed table) in the sharding box the drawn table ``(vocab, features)`` came in,
  its names swapped as the dims are. The ``positions``' packed words (``features / 8`` rows for 2:4) are replicated:
  a split of the features need not divide them."""
  if isinstance(drawn, nn.Partitioned):
    vocab, features = drawn.names
    return drawn.replace(value=value, names=(None if positions else features, vocab))
  if isinstance(drawn, nn.meta.AxisMetadata):
    return drawn.replace_boxed(value)
  return value


class CompressedNMEmbed(nn.Module):
  """Linen ``nn.Embed`` whose ``(num_embeddings, features)`` table is stored N:M-compressed along ``features``.

  The Linen twin of :class:`jaxsparse.layers.CompressedNMEmbed`: of every ``m`` consecutive features of a row, ``n``
  are kept. The table is stored transposed, as the kernel of :meth:`attend`'s product (the layout of
  :class:`~jaxsparse.layers.linen.CompressedNMDense`'s kernel): ``params.embedding`` holds the kept values,
  ``(features * n // m, num_embeddings)``, and ``sparsity.embedding_positions`` their packed positions, laid out as in
  :class:`jaxsparse.NMSparseMatrix` with ``axis=0``. A 2:4 bfloat16 table takes 0.5625x the dense table's bytes.
  ``init`` draws a dense table with ``embedding_init`` and keeps the ``n`` largest magnitudes of every ``m`` features
  of each row (it works under ``jax.eval_shape``); the kept values are trainable, the positions are not.

  A lookup returns the rows of the pruned table, zeros at the pruned features, as ``nn.Embed`` does on the pruned
  dense table (out-of-range ids give NaN rows in floating dtypes, as there). :meth:`attend` (tied input and output
  embeddings) is :func:`jaxsparse.ops.nm_matmul` on the stored arrays, no copy of the table.
  :func:`jaxsparse.sparsify_linen` turns an ``nn.Embed`` of a model into this layer (an ``NM`` rule naming it) and
  :func:`jaxsparse.densify_linen` back.

  >>> import jax, jax.numpy as jnp
  >>> from jaxsparse.layers.linen import CompressedNMEmbed
  >>> embed = CompressedNMEmbed(100, 64, n=2, m=4)
  >>> ids = jnp.array([[3, 14, 15]])
  >>> variables = embed.init(jax.random.key(0), ids)
  >>> jax.tree.map(jnp.shape, variables)
  {'params': {'embedding': (32, 100)}, 'sparsity': {'embedding_positions': (8, 100)}}
  >>> rows = embed.apply(variables, ids)
  >>> rows.shape, float(jnp.mean(rows == 0))
  ((1, 3, 64), 0.5)
  >>> embed.apply(variables, jnp.ones((2, 64)), method="attend").shape
  (2, 100)

  Attributes:
    num_embeddings: number of embeddings (vocabulary size), ``>= 0`` as ``nn.Embed``'s (an empty table looks up
      no ids; its :meth:`attend` gives ``(..., 0)`` logits).
    features: size of each embedding; a multiple of ``m``, ``>= 0`` (no features: empty rows, zero logits).
    n, m: ``n`` kept of every ``m`` features, ``0 < n < m``.
    dtype, param_dtype, embedding_init, promote_dtype: as ``nn.Embed``'s: ``dtype`` is that of the lookups and of
      :meth:`attend` (``None``: the table's for lookups, the promoted dtype of query and table for :meth:`attend`);
      ``embedding_init`` draws the dense ``(num_embeddings, features)`` table that ``init`` prunes (an
      ``nn.with_partitioning`` box keeps its names, swapped as the stored table is transposed; the positions take
      only the vocabulary's name, their few rows of packed words are replicated).
    implementation: backend of :func:`jaxsparse.ops.nm_matmul` in :meth:`attend`: ``None`` (it picks), ``"xla"``,
      ``"pallas"`` or ``"cusparselt"``.
  """

  num_embeddings: int
  features: int
  _: dataclasses.KW_ONLY
  n: int = 2
  m: int = 4
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  embedding_init: Initializer = default_embed_init
  promote_dtype: PromoteDtypeFn = linen_promote_dtype
  implementation: ops.NMImplementation | None = None

  def __post_init__(self):
    # Empty tables (0 rows or 0 features) are taken, as by nn.Embed and the NNX CompressedNMEmbed.
    _utils.check_nonnegative_int(self.num_embeddings, name="num_embeddings")
    _utils.check_nonnegative_int(self.features, name="features")
    _, m = _nm_masks.check_nm(self.n, self.m)
    if self.features % m:
      raise ValueError(f"m={m} must divide features={self.features} (the groups run along the features).")
    check_nm_implementation(self.implementation)
    check_dtypes(type(self), dtype=self.dtype, param_dtype=self.param_dtype, inexact=False, numeric_params=True)
    default_init = self.embedding_init is default_embed_init
    check_init_dtype(type(self), self.param_dtype, None if default_init else self.embedding_init, name="embedding_init")
    super().__post_init__()

  def setup(self):
    # Flax runs `setup` once on an empty, non-initializing scope before a lifted transform (nn.remat, nn.jit):
    # a missing pattern is reported when the table is used, not here.
    has_pattern = self.has_variable(SPARSITY, "embedding_positions")
    if self.is_initializing():
      check_pattern(self, "embedding_positions")
    shape = (self.num_embeddings, self.features)
    drawn: dict[str, NMSparseMatrix] = {}  # the pruned table drawn at init: its values and positions

    def init_values(key: jax.Array) -> Any:
      table = self.embedding_init(key, shape, self.param_dtype)
      drawn["w"] = compress_table(nn.meta.unbox(table), self.n, self.m)
      drawn["box"] = table
      return _transposed_box(table, drawn["w"].values)

    self.embedding = self.param("embedding", init_values)
    self.embedding_positions = self.variable(
        SPARSITY, "embedding_positions", lambda: _transposed_box(drawn["box"], drawn["w"].indices, positions=True),
    ) if has_pattern or self.is_initializing() else None

  def _weight(self, values: jax.Array) -> NMSparseMatrix:
    """The compressed table ``(features, num_embeddings)`` holding ``values`` (the stored ones, promoted)."""
    if self.embedding_positions is None:
      raise missing_pattern(self)
    w = NMSparseMatrix(values, nn.meta.unbox(self.embedding_positions.value),
                       shape=(self.features, self.num_embeddings), n=self.n, m=self.m, axis=0, validate=False)
    return check_loaded_positions(linen_positions_name(self, "embedding_positions"), w)

  def __call__(self, inputs: jax.Array) -> jax.Array:
    """Looks up the rows of the pruned table, as ``nn.Embed`` does.

    Args:
      inputs: integer token ids of any shape; negative ids count from the end and out-of-range ids give rows of
        ``jnp.take``'s fill value (NaN for floating tables), as ``nn.Embed``'s ``jnp.take``.

    Returns:
      ``(*inputs.shape, features)`` in ``dtype`` if set, else the table's dtype; zeros at the pruned features.

    Raises:
      ValueError: ``inputs`` that are not integers; variables without the ``"sparsity"`` collection.
      IndexError: ids looked up in an empty table (``num_embeddings=0``), as ``nn.Embed``'s ``jnp.take`` raises.

    >>> import jax, jax.numpy as jnp
    >>> from jaxsparse.layers.linen import CompressedNMEmbed
    >>> embed = CompressedNMEmbed(10, 8)
    >>> variables = embed.init(jax.random.key(0), jnp.arange(3))
    >>> rows = embed.apply(variables, jnp.array([[1, 2, 3]]))
    >>> rows.shape, (rows != 0).sum(-1).tolist()
    ((1, 3, 8), [[4, 4, 4]])
    """
    inputs = check_ids(inputs)
    (values,) = self.promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
    return lookup(self._weight(values), inputs)

  def attend(self, query: jax.Array, *, precision: lax.PrecisionLike = None) -> jax.Array:
    """``query @ table.T`` with the pruned table (tied output logits), as ``nn.Embed.attend``.

    Args:
      query: ``(..., features)``.
      precision: of the product, as in :func:`jaxsparse.ops.nm_matmul`.

    Returns:
      ``(..., num_embeddings)`` logits in ``dtype`` if set, else the promoted dtype of ``query`` and the table, as
      ``nn.Embed.attend``.

    Raises:
      ValueError: ``query`` whose last axis is not ``features``.
      TypeError: a complex ``query``.

    >>> import jax, jax.numpy as jnp
    >>> from jaxsparse.layers.linen import CompressedNMEmbed
    >>> embed = CompressedNMEmbed(10, 8)
    >>> variables = embed.init(jax.random.key(0), jnp.arange(3))
    >>> embed.apply(variables, jnp.ones((2, 8)), method="attend").shape
    (2, 10)
    """
    check_query(query, self.features)
    query, values = self.promote_dtype(query, self.embedding, dtype=self.dtype)
    return attend_table(query, self._weight(values), implementation=self.implementation, precision=precision)
