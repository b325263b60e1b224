"""The data-parallel wrapper of the ops (ops/_sharding.py) on one device: transparent to jit, vmap, grad.

The multi-device behaviour is tested in tests/multidevice (run by tests/test_multidevice.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxsparse
from jaxsparse import ops
from tests._util import assert_close

KEYS = jax.random.split(jax.random.key(3), 3)
W = jax.random.normal(KEYS[0], (32, 24))
NMW = jaxsparse.NMSparseMatrix.from_dense(W, 2, 4)
BLOCK_MASK = jaxsparse.random_block_mask(KEYS[1], (32, 24), (8, 8), 0.5)
BSM = jaxsparse.BlockSparseMatrix.from_dense(W, (8, 8), block_mask=BLOCK_MASK)


def test_gradient_of_a_gradient_through_nm_matmul():
  x = jax.random.normal(KEYS[2], (4, 32))
  g = lambda f: jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(jnp.sin(f(x))))(x) ** 2))
  assert_close(g(lambda x: ops.nm_matmul(x, NMW))(x), g(lambda x: x @ NMW.to_dense())(x), jnp.float32)


def test_vmap_folds_rows_and_maps_per_example_gradients():
  x = jax.random.normal(KEYS[2], (3, 5, 32))
  f = lambda x, d: ops.block_sparse_matmul(x, BSM.with_data(d))
  ref = lambda x, d: x @ BSM.with_data(d).to_dense()
  assert_close(jax.jit(jax.vmap(f, in_axes=(0, None)))(x, BSM.data), ref(x, BSM.data), jnp.float32)
  per_example = lambda f: jax.vmap(jax.grad(lambda x, d: jnp.sum(jnp.sin(f(x, d))), argnums=1), in_axes=(0, None))
  assert_close(jax.jit(per_example(f))(x, BSM.data), per_example(ref)(x, BSM.data), jnp.float32)


def test_one_dimensional_x():
  x = jax.random.normal(KEYS[2], (32,))
  y = ops.nm_matmul(x, NMW)
  assert y.shape == (24,)
  assert_close(y, x @ NMW.to_dense(), jnp.float32)
  assert_close(jax.grad(lambda x: jnp.sum(ops.nm_matmul(x, NMW)))(x), NMW.to_dense().sum(1), jnp.float32)
