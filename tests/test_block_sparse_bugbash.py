"""BlockSparseMatrix edge cases found in a bug bash: matrices with no block, and the static nnz_blocks count."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsparse
from jaxsparse.ops import block_sparse_matmul


@pytest.mark.parametrize("shape", [(64, 0), (0, 32)])
def test_matrix_without_blocks_has_density_and_repr(shape):
  # K or N zero leaves a (kb, 0) / (0, nb) block grid: density divided by zero, so even repr() raised.
  w = jaxsparse.BlockSparseMatrix.from_dense(jnp.zeros(shape), (16, 16))
  assert w.nnz_blocks == 0 and w.density == 0.0
  assert repr(w) == (f"BlockSparseMatrix(shape={shape}, block_shape=(16, 16), nnz_blocks=0, density=0.000, "
                     "dtype=float32)")
  if shape[0]:  # N = 0: the product is an empty (..., 0) array
    assert block_sparse_matmul(jnp.ones((3, shape[0])), w).shape == (3, 0)


def _from_traced_mask(w, nnz_blocks):
  """``from_dense`` inside ``jit`` with a traced magnitude mask keeping 4 of the 8 blocks."""

  def build(w):
    mask = jaxsparse.block_magnitude_mask(w, (16, 16), 0.5)
    return jaxsparse.BlockSparseMatrix.from_dense(w, (16, 16), mask, nnz_blocks=nnz_blocks).to_dense()

  return jax.jit(build)(w)


@pytest.mark.parametrize("traced", [True, False])
@pytest.mark.parametrize("nnz_blocks", [-1, 9, 100, True, "4", 2.5])
def test_from_dense_checks_nnz_blocks(traced, nnz_blocks):
  # Under jit a negative or non-int count failed inside jnp.nonzero without naming nnz_blocks, and one above the
  # grid's 8 blocks (or True, taken as 1) gave an all-NaN matrix; a string '4' was printed as 4 ("keeps 4 entries
  # but nnz=4 was given").
  w = jax.random.normal(jax.random.key(0), (64, 32))
  match = r"nnz_blocks must be an int in \[0, 8\] \(the blocks of the 4 x 2 block grid\), got nnz_blocks="
  with pytest.raises(ValueError, match=match + re.escape(repr(nnz_blocks))):
    if traced:
      _from_traced_mask(w, nnz_blocks)
    else:
      jaxsparse.BlockSparseMatrix.from_dense(w, (16, 16), jaxsparse.block_magnitude_mask(w, (16, 16), 0.5),
                                             nnz_blocks=nnz_blocks)


def test_from_dense_nnz_blocks_integral_values_still_work():
  w = jax.random.normal(jax.random.key(1), (64, 32))
  mask = np.asarray(jaxsparse.block_magnitude_mask(w, (16, 16), 0.5))
  expected = np.where(np.repeat(np.repeat(mask, 16, 0), 16, 1), np.asarray(w), 0.0)
  for nnz in (4, np.int64(4), 4.0):
    np.testing.assert_array_equal(np.asarray(_from_traced_mask(w, nnz)), expected)


def test_from_block_mask_traced_with_more_blocks_than_the_grid():
  # A traced mask's count is unknown under jit, but data with more blocks than the mask has cannot match it: it gave
  # an all-NaN matrix instead of an error.
  data = jnp.ones((9, 16, 16))
  with pytest.raises(ValueError, match=r"data holds 9 blocks but block_mask \(4, 2\) has only 8"):
    jax.jit(lambda m: jaxsparse.BlockSparseMatrix.from_block_mask(m, data).data)(jnp.ones((4, 2), bool))


def test_stacked_matrix_without_vmap_says_to_map_over_it():
  ws = [jaxsparse.BlockSparseMatrix.from_dense(jnp.ones((32, 16)).at[:16].set(0), (16, 16)) for _ in range(2)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *ws)
  with pytest.raises(ValueError, match=r"got \(2, 1, 16, 16\) \(one axis more .*jax.vmap the op over the stacked"):
    block_sparse_matmul(jnp.ones((2, 32)), stacked)
  got = jax.vmap(lambda w: block_sparse_matmul(jnp.ones((2, 32)), w))(stacked)
  np.testing.assert_array_equal(np.asarray(got), np.full((2, 2, 16), 16.0))
