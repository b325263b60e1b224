"""Sparsity masks: which blocks or weights to keep.

All masks keep an exact count (``round(density * total)``, rounded half up) and break ties
deterministically: among equal scores the entry with the lower flat index wins. A NaN score (a NaN weight, or a
block holding one) counts as the largest, as in :func:`jaxsparse.nm_mask`: a diverged weight is kept, so the
divergence stays visible instead of being pruned away.

Weights split over explicit mesh axes (``jax.set_mesh`` with ``AxisType.Explicit``, e.g. kernels made with
``nnx.with_partitioning``) are gathered for the ranking, which sorts over all entries: the masks are the same as
those of the unsplit weights. A mask of ``w``'s (or ``scores``') shape comes back split like it; a block mask
replicated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsparse import _utils

__all__ = ["block_magnitude_mask", "random_block_mask", "magnitude_mask", "top_k_mask"]


def _explicit_split(a: jax.Array) -> NamedSharding | None:
  """``a``'s sharding when its type splits it over explicit mesh axes, else ``None``."""
  if _utils.explicit_mesh(a) is None:
    return None
  sharding = jax.typeof(a).sharding
  return sharding if any(entry is not None for entry in sharding.spec) else None


def replicated(a: jax.Array) -> jax.Array:
  """``a`` gathered onto every device when explicit mesh axes split it: under explicit axes JAX refuses to sort over,
  or reshape, a split dim. A no-op otherwise (auto axes leave that to the compiler)."""
  sharding = _explicit_split(a)
  return a if sharding is None else jax.reshard(a, NamedSharding(sharding.mesh, P()))


def split_like(a: jax.Array, like: jax.Array) -> jax.Array:
  """``a`` (of ``like``'s shape, e.g. its mask made from gathered values) split like ``like`` where explicit mesh axes
  split it; a no-op otherwise."""
  split = _explicit_split(like)
  if split is None or jax.typeof(a).sharding.spec == split.spec:
    return a
  return jax.reshard(a, NamedSharding(split.mesh, split.spec))


def top_k_mask(scores: jax.Array, k: int) -> jax.Array:
  """Bool mask of ``scores.shape`` keeping the ``k`` largest scores (ties: lower flat index first; NaN largest).

  Scores split over explicit mesh axes are gathered for the sort; the mask comes back split like them.
  """
  return split_like(_top_k(replicated(scores), k), scores)


def _top_k(scores: jax.Array, k: int) -> jax.Array:
  flat = scores.reshape(-1)
  if jnp.issubdtype(flat.dtype, jnp.inexact):
    flat = jnp.where(jnp.isnan(flat), jnp.inf, flat)  # argsort would put NaN last
  # A stable sort of -score keeps equal scores in index order, so the result is deterministic.
  order = jnp.argsort(-flat, stable=True)
  keep = jnp.zeros(flat.shape, dtype=bool).at[order[:k]].set(True)
  return keep.reshape(scores.shape)


def _block_norms(w: jax.Array, block_shape: tuple[int, int]) -> jax.Array:
  k, n = w.shape
  bk, bn = block_shape
  blocks = replicated(w).astype(_utils.accumulation_dtype(w.dtype)).reshape(k // bk, bk, n // bn, bn)
  return jnp.sum(blocks * blocks, axis=(1, 3))


def block_magnitude_mask(w: jax.typing.ArrayLike, block_shape: tuple[int, int], density: float) -> jax.Array:
  """Keeps the ``round(density * blocks)`` blocks of ``w`` with the largest Frobenius norm.

  A block holding a NaN counts as the largest (it is kept), as in :func:`jaxsparse.nm_mask`. Norms are computed in
  float32, or in float64 for float64 weights (so blocks a float32 norm rounds to a tie still rank by their own).

  >>> import jax, jaxsparse
  >>> w = jax.random.normal(jax.random.key(0), (128, 64))
  >>> m = jaxsparse.block_magnitude_mask(w, (32, 32), density=0.25)
  >>> m.shape, int(m.sum())
  ((4, 2), 2)

  Args:
    w: ``(K, N)`` weights.
    block_shape: ``(bk, bn)`` dividing ``(K, N)``.
    density: fraction of blocks kept, in (0, 1].

  Returns:
    Bool ``(K // bk, N // bn)``.
  """
  w = _utils.as_array(w, name="w")
  _utils.check_ndim(w.shape, 2, name="w")
  block_shape = _utils.check_block_shape(block_shape, w.shape)
  density = _utils.check_density(density)
  norms = _block_norms(w, block_shape)
  return top_k_mask(norms, _utils.kept_count(density, norms.size))


def random_block_mask(
    key: jax.Array, shape: tuple[int, int], block_shape: tuple[int, int], density: float
) -> jax.Array:
  """A uniformly random block mask keeping exactly ``round(density * blocks)`` blocks.

  >>> import jax, jaxsparse
  >>> m = jaxsparse.random_block_mask(jax.random.key(0), (256, 128), (32, 32), 0.5)
  >>> m.shape, int(m.sum())
  ((8, 4), 16)

  Args:
    key: a JAX PRNG key.
    shape: ``(K, N)`` of the matrix.
    block_shape: ``(bk, bn)`` dividing ``shape``.
    density: fraction of blocks kept, in (0, 1].

  Returns:
    Bool ``(K // bk, N // bn)``.
  """
  shape = _utils.check_dims(shape, name="shape", ndim=2)  # ints >= 0: a negative size failed inside XLA
  bk, bn = _utils.check_block_shape(block_shape, shape)
  density = _utils.check_density(density)
  grid = (shape[0] // bk, shape[1] // bn)
  scores = jax.random.uniform(key, grid)
  return top_k_mask(scores, _utils.kept_count(density, grid[0] * grid[1]))


def magnitude_mask(w: jax.typing.ArrayLike, sparsity: float) -> jax.Array:
  """Unstructured mask keeping the ``size - round(sparsity * size)`` largest ``|w|``.

  NaN counts as the largest magnitude (it is kept), as in :func:`jaxsparse.nm_mask`; ties go to the lower flat
  index. Magnitudes are compared in float32, or in float64 for float64 weights (as :func:`jaxsparse.nm_mask` compares
  them in ``w``'s dtype: float64 values that round to one float32 are no tie).

  >>> import jax.numpy as jnp, jaxsparse
  >>> jaxsparse.magnitude_mask(jnp.array([[0.5, -2.0], [1.0, 0.1]]), sparsity=0.5)
  Array([[False,  True],
         [ True, False]], dtype=bool)

  Args:
    w: weights of any shape.
    sparsity: fraction of entries pruned, in [0, 1).

  Returns:
    Bool mask of ``w.shape``.
  """
  w = _utils.as_array(w, name="w")
  sparsity = _utils.check_sparsity(sparsity)
  kept = w.size - _utils.kept_count(sparsity, w.size)
  return top_k_mask(jnp.abs(w.astype(_utils.accumulation_dtype(w.dtype))), kept)
