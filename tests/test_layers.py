"""Tests for jaxsparse.layers: NNX vs Linen, dense equivalence, training, initialisation, bad input."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import jaxsparse
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import MaskedLinear
from jaxsparse.layers import SparsityPattern
from jaxsparse.layers.linen import BlockSparseDense
from jaxsparse.layers.linen import MaskedDense

K, N = 64, 96


def _normal(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype)


def _expand(block_mask, block_shape):
  bk, bn = block_shape
  return jnp.repeat(jnp.repeat(block_mask, bk, axis=0), bn, axis=1)


def _randomize_bias(layer, seed):
  if layer.bias is not None:
    layer.bias[...] = _normal(seed, layer.bias.shape, layer.bias.dtype)


def _dense_linear(seed=0, k=K, n=N):
  lin = nnx.Linear(k, n, rngs=nnx.Rngs(seed))
  _randomize_bias(lin, seed + 100)
  return lin


def _paths(state):
  return {path for path, _ in nnx.to_flat_state(state)}


def _assert_tree_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


# -------------------------------------------------------------------------------------------------
# NNX vs Linen.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("use_bias", [True, False])
def test_block_sparse_nnx_matches_linen(dtype, use_bias):
  kwargs = dict(density=0.5, block_shape=(16, 32), use_bias=use_bias, dtype=dtype)
  layer = BlockSparseLinear(K, N, **kwargs, rngs=nnx.Rngs(0))
  _randomize_bias(layer, 1)
  model = BlockSparseDense(N, **kwargs)
  x = _normal(2, (3, 5, K))
  variables = layer.to_linen_variables()
  # The NNX layer's variables have the structure, shapes and dtypes Linen's init creates.
  ref = model.init(jax.random.key(3), x)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), ref) == jax.tree.map(lambda a: (a.shape, a.dtype), variables)

  y_nnx = nnx.jit(lambda m, x: m(x))(layer, x)
  y_linen = jax.jit(model.apply)(variables, x)
  assert y_nnx.dtype == y_linen.dtype == dtype
  assert y_nnx.shape == (3, 5, N)
  np.testing.assert_array_equal(np.asarray(y_nnx, np.float32), np.asarray(y_linen, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_masked_nnx_matches_linen(dtype):
  layer = MaskedLinear(K, N, sparsity=0.7, dtype=dtype, rngs=nnx.Rngs(0))
  _randomize_bias(layer, 1)
  model = MaskedDense(N, sparsity=0.7, dtype=dtype)
  x = _normal(2, (4, K))
  variables = layer.to_linen_variables()
  ref = model.init(jax.random.key(3), x)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), ref) == jax.tree.map(lambda a: (a.shape, a.dtype), variables)

  y_nnx = nnx.jit(lambda m, x: m(x))(layer, x)
  y_linen = jax.jit(model.apply)(variables, x)
  assert y_nnx.dtype == y_linen.dtype == dtype
  np.testing.assert_array_equal(np.asarray(y_nnx, np.float32), np.asarray(y_linen, np.float32))


def test_linen_init_keeps_exact_counts():
  x = _normal(0, (2, K))
  v = BlockSparseDense(N, density=0.5, block_shape=(16, 32)).init(jax.random.key(0), x)
  assert v["params"]["kernel"].shape == (6, 16, 32)  # round(0.5 * 4 * 3)
  w = jaxsparse.BlockSparseMatrix.from_index_arrays(
      v["params"]["kernel"], v["sparsity"], shape=(K, N), block_shape=(16, 32)
  )
  assert int(w.block_mask.sum()) == 6
  m = MaskedDense(N, sparsity=0.75).init(jax.random.key(0), x)
  mask = m["sparsity"]["mask"]
  assert mask.dtype == jnp.bool_ and int(mask.sum()) == K * N // 4
  assert not jnp.any(jnp.where(mask, 0.0, m["params"]["kernel"]))


# -------------------------------------------------------------------------------------------------
# Dense equivalence: from_dense / to_dense.
# -------------------------------------------------------------------------------------------------


def test_block_sparse_from_dense_full_density_equals_linear():
  lin = _dense_linear()
  layer = BlockSparseLinear.from_dense(lin, density=1.0, block_shape=(16, 32))
  x = _normal(1, (7, K))
  np.testing.assert_allclose(layer(x), lin(x), rtol=1e-5, atol=1e-5)
  assert layer.kernel.dtype == lin.kernel.dtype and layer.density == 1.0


def test_block_sparse_from_dense_keeps_largest_blocks_and_round_trips():
  lin = _dense_linear()
  layer = BlockSparseLinear.from_dense(lin, density=0.5, block_shape=(32, 32))
  kernel, bias = lin.kernel[...], lin.bias[...]
  mask = jaxsparse.block_magnitude_mask(kernel, (32, 32), 0.5)
  _assert_tree_equal(layer.block_mask, mask)
  x = _normal(1, (2, 3, K))
  expected = x @ (kernel * _expand(mask, (32, 32))) + bias
  np.testing.assert_allclose(layer(x), expected, rtol=1e-5, atol=1e-5)

  dense = layer.to_dense()
  assert isinstance(dense, nnx.Linear)
  assert dense.kernel.dtype == kernel.dtype and dense.dtype == lin.dtype
  np.testing.assert_array_equal(dense.kernel[...], kernel * _expand(mask, (32, 32)))
  np.testing.assert_array_equal(dense.bias[...], bias)
  np.testing.assert_allclose(dense(x), layer(x), rtol=1e-5, atol=1e-5)
  again = BlockSparseLinear.from_dense(dense, density=layer.density, block_shape=(32, 32))
  _assert_tree_equal(nnx.state(again), nnx.state(layer))


def test_masked_from_dense_and_round_trip():
  lin = _dense_linear()
  x = _normal(1, (5, K))
  np.testing.assert_allclose(MaskedLinear.from_dense(lin, sparsity=0.0)(x), lin(x), rtol=1e-5, atol=1e-5)

  layer = MaskedLinear.from_dense(lin, sparsity=0.5)
  kernel, bias = lin.kernel[...], lin.bias[...]
  mask = jaxsparse.magnitude_mask(kernel, 0.5)
  _assert_tree_equal(layer.mask[...], mask)
  assert layer.sparsity == 0.5
  np.testing.assert_allclose(layer(x), x @ (kernel * mask) + bias, rtol=1e-5, atol=1e-5)

  dense = layer.to_dense()
  np.testing.assert_array_equal(dense.kernel[...], kernel * mask)
  np.testing.assert_allclose(dense(x), layer(x), rtol=1e-5, atol=1e-5)
  again = MaskedLinear.from_dense(dense, sparsity=0.5)
  _assert_tree_equal(nnx.state(again), nnx.state(layer))


def test_no_bias_and_param_dtype():
  layer = BlockSparseLinear(K, N, density=0.5, block_shape=(32, 32), use_bias=False,
                            param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  assert layer.bias is None and layer.kernel.dtype == jnp.bfloat16
  x = _normal(1, (2, K))
  assert layer(x).dtype == jnp.float32  # promoted like nnx.Linear
  dense = layer.to_dense()
  assert dense.bias is None and dense.kernel.dtype == jnp.bfloat16
  np.testing.assert_allclose(dense(x), layer(x), rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------------------------
# Variables: the pattern is separate, non-trainable state.
# -------------------------------------------------------------------------------------------------


def test_split_separates_params_and_pattern():
  layer = BlockSparseLinear(K, N, density=0.5, block_shape=(32, 32), rngs=nnx.Rngs(0))
  graphdef, params, pattern = nnx.split(layer, nnx.Param, SparsityPattern)
  assert _paths(params) == {("kernel",), ("bias",)}
  assert _paths(pattern) == {("pattern", f) for f in layer.sparse_kernel.index_arrays()}
  merged = nnx.merge(graphdef, params, pattern)
  x = _normal(1, (2, K))
  np.testing.assert_array_equal(merged(x), layer(x))

  masked = MaskedLinear(K, N, sparsity=0.5, rngs=nnx.Rngs(0))
  _, params, pattern = nnx.split(masked, nnx.Param, SparsityPattern)
  assert _paths(params) == {("kernel",), ("bias",)}
  assert _paths(pattern) == {("mask",)}


def test_gradients_match_dense_layer_on_kept_weights():
  layer = BlockSparseLinear(K, N, density=0.5, block_shape=(16, 32), rngs=nnx.Rngs(0))
  masked = MaskedLinear(K, N, sparsity=0.5, rngs=nnx.Rngs(0))
  x = _normal(1, (8, K))
  loss = lambda m: jnp.sum(jnp.sin(m(x)))
  for sparse, kept in [(layer, _expand(layer.block_mask, (16, 32))), (masked, masked.mask[...])]:
    grads = nnx.grad(loss)(sparse)
    dense_grads = nnx.grad(loss)(sparse.to_dense())
    np.testing.assert_allclose(grads["bias"][...], dense_grads["bias"][...], rtol=1e-5, atol=1e-5)
    dense_kernel_grad = jnp.where(kept, dense_grads["kernel"][...], 0.0)
    if sparse is layer:
      expected = jaxsparse.BlockSparseMatrix.from_dense(dense_kernel_grad, (16, 32), block_mask=layer.block_mask).data
    else:
      expected = dense_kernel_grad
    np.testing.assert_allclose(grads["kernel"][...], expected, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------------------------
# Training.
# -------------------------------------------------------------------------------------------------


def _train_nnx(model, steps=5):
  x = _normal(10, (32, K))
  y = x @ _normal(11, (K, N)) * 0.2
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(steps)]
  assert losses[-1] < losses[0]


def test_nnx_training_block_sparse_keeps_pattern():
  model = BlockSparseLinear(K, N, density=0.5, block_shape=(16, 32), rngs=nnx.Rngs(0))
  pattern = jax.tree.map(jnp.copy, nnx.state(model, SparsityPattern))
  kernel = jnp.copy(model.kernel[...])
  _train_nnx(model)
  _assert_tree_equal(nnx.state(model, SparsityPattern), pattern)
  assert not np.array_equal(model.kernel[...], kernel)
  pruned = ~_expand(model.block_mask, (16, 32))
  assert not jnp.any(jnp.where(pruned, model.to_dense().kernel[...], 0.0))


def test_nnx_training_masked_keeps_pruned_weights_zero():
  model = MaskedLinear(K, N, sparsity=0.8, rngs=nnx.Rngs(0))
  mask = jnp.copy(model.mask[...])
  _train_nnx(model)
  np.testing.assert_array_equal(model.mask[...], mask)
  assert not jnp.any(jnp.where(mask, 0.0, model.kernel[...]))
  assert not jnp.any(jnp.where(mask, 0.0, model.to_dense().kernel[...]))


@pytest.mark.parametrize(
    "model", [BlockSparseDense(N, density=0.5, block_shape=(16, 32)), MaskedDense(N, sparsity=0.8)], ids=type
)
def test_linen_training_updates_params_only(model):
  x = _normal(10, (32, K))
  y = x @ _normal(11, (K, N)) * 0.2
  variables = model.init(jax.random.key(0), x)
  params, sparsity = variables["params"], variables["sparsity"]
  tx = optax.adam(1e-2)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state):
    loss_fn = lambda p: jnp.mean((model.apply({"params": p, "sparsity": sparsity}, x) - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for _ in range(5):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  assert losses[-1] < losses[0]
  _assert_tree_equal(sparsity, variables["sparsity"])
  assert not np.array_equal(params["kernel"], variables["params"]["kernel"])


# -------------------------------------------------------------------------------------------------
# Shapes, batch dims, vmap (property-based).
# -------------------------------------------------------------------------------------------------


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
@settings(max_examples=5, deadline=None)
@given(
    kb=st.integers(1, 3),
    nb=st.integers(1, 2),
    block_shape=st.sampled_from([(8, 8), (16, 8)]),
    keep=st.floats(0.0, 1.0),
    lead=st.lists(st.integers(1, 3), max_size=2),
    seed=st.integers(0, 2**16),
)
def test_block_sparse_shapes_and_vmap(kb, nb, block_shape, keep, lead, seed):
  blocks = kb * nb
  nnz = 1 + int(keep * (blocks - 1))
  k, n = kb * block_shape[0], nb * block_shape[1]
  layer = BlockSparseLinear(k, n, density=nnz / blocks, block_shape=block_shape, rngs=nnx.Rngs(seed))
  _randomize_bias(layer, seed + 1)
  assert layer.nnz_blocks == nnz and layer.kernel.shape == (nnz, *block_shape)
  x = _normal(seed + 2, (2, *lead, k))

  @nnx.jit
  def run(layer, x):
    dense = layer.to_dense()
    return layer(x), jax.vmap(layer)(x), x @ dense.kernel[...] + dense.bias[...], layer.block_mask

  y, y_vmap, expected, block_mask = run(layer, x)
  assert y.shape == (2, *lead, n) and int(block_mask.sum()) == nnz
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(y_vmap, y, rtol=1e-6, atol=1e-6)


def test_masked_vmap_and_batch_dims():
  layer = MaskedLinear(K, N, sparsity=0.5, rngs=nnx.Rngs(0))
  xs = _normal(1, (2, 3, K))
  np.testing.assert_allclose(jax.vmap(layer)(xs), layer(xs), rtol=1e-6, atol=1e-6)
  assert layer(xs).shape == (2, 3, N)


# -------------------------------------------------------------------------------------------------
# Initialisation keeps the dense layer's output variance.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda rngs: BlockSparseLinear(256, 256, density=0.25, block_shape=(32, 32), rngs=rngs),
        lambda rngs: MaskedLinear(256, 256, sparsity=0.75, rngs=rngs),
    ],
    ids=["block_sparse", "masked"],
)
def test_default_init_matches_dense_output_variance(make):
  x = _normal(0, (256, 256))
  dense_var = float(jnp.var(nnx.Linear(256, 256, rngs=nnx.Rngs(1))(x)))
  sparse_var = float(jnp.var(make(nnx.Rngs(2))(x)))
  # lecun_normal gives the dense layer unit output variance; naive fan-in scaling would give 0.25.
  assert abs(dense_var - 1.0) < 0.1
  assert abs(sparse_var / dense_var - 1.0) < 0.1


# -------------------------------------------------------------------------------------------------
# Bad input.
# -------------------------------------------------------------------------------------------------


def test_sparsity_and_density_take_real_scalars():
  """A NumPy / JAX scalar sparsity (jnp.float32(0.5)) was refused with "must be a float"; real scalars and concrete
  0-d arrays are now taken, bools, arrays and traced values still refused, naming the argument."""
  from jaxsparse import _utils  # noqa: PLC0415

  assert MaskedLinear(8, 4, sparsity=jnp.float32(0.5), rngs=nnx.Rngs(0)).density == 0.5
  assert MaskedDense(4, sparsity=np.float32(0.75)).sparsity == np.float32(0.75)
  for value in (np.float32(0.25), jnp.float32(0.25), np.array(0.25), jnp.asarray(0.25, jnp.bfloat16), 0.25):
    assert _utils.check_sparsity(value) == 0.25 and _utils.check_density(value, name="d") == 0.25
    assert type(_utils.check_sparsity(value)) is float
  for value, shown in ((True, "True, of type bool"), (np.bool_(False), "an array of shape () and dtype bool"),
                       (jnp.array([0.5]), r"an array of shape (1,) and dtype float32"), ("0.5", "of type str")):
    with pytest.raises(TypeError, match=r"sparsity must be a float in \[0, 1\), got .*" + re.escape(shown)):
      _utils.check_sparsity(value)
  with pytest.raises(TypeError, match=r"density must be a concrete float in \(0, 1\], got the traced"):
    jax.jit(_utils.check_density)(0.5)
  with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\), got sparsity=1.0"):
    _utils.check_sparsity(jnp.float32(1.0))


def _bsl(**kwargs):
  kwargs = {"density": 0.5, "block_shape": (32, 32), "rngs": nnx.Rngs(0), **kwargs}
  return BlockSparseLinear(kwargs.pop("in_features", K), kwargs.pop("out_features", N), **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(out_features=100), ValueError, r"block_shape=\(32, 32\) must divide the matrix shape \(64, 100\)"),
        (dict(block_shape=32), TypeError, r"block_shape must be a pair of positive ints.*32"),
        (dict(density=0.0), ValueError, r"density must be in \(0, 1\], got density=0.0"),
        (dict(density=1.5), ValueError, r"density must be in \(0, 1\], got density=1.5"),
        (dict(density="half"), TypeError, r"density must be a float in \(0, 1\], got 'half'"),
        (dict(density=0.01), ValueError, r"density=0.01 keeps 0 of 6 blocks"),
        (dict(density=None), ValueError, r"exactly one of density= and block_mask="),
        (dict(block_mask=np.ones((2, 3), bool)), ValueError, r"exactly one of density= and block_mask="),
        (dict(density=None, block_mask=np.ones((3, 2), bool)), ValueError,
         r"block_mask must have shape \(in_features // bk, out_features // bn\) = \(2, 3\), got \(3, 2\)"),
        (dict(density=None, block_mask=np.ones((2, 3))), TypeError, r"block_mask must be a boolean array.*float"),
        (dict(density=None, block_mask=np.zeros((2, 3), bool)), ValueError, r"block_mask keeps no block"),
        (dict(implementation="cuda"), ValueError, r"implementation must be one of .*got implementation='cuda'"),
        (dict(in_features=0), ValueError, r"in_features must be a positive int, got 0"),
    ],
)
def test_block_sparse_bad_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    _bsl(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(sparsity=1.0), ValueError, r"sparsity must be in \[0, 1\), got sparsity=1.0"),
        (dict(sparsity=-0.1), ValueError, r"sparsity must be in \[0, 1\), got sparsity=-0.1"),
        (dict(sparsity=0.5, mask=np.ones((K, N), bool)), ValueError, r"exactly one of sparsity= and mask="),
        (dict(), ValueError, r"exactly one of sparsity= and mask="),
        (dict(mask=np.ones((N, K), bool)), ValueError, r"mask must have the weight's shape \(64, 96\), got \(96, 64\)"),
        (dict(mask=np.ones((K, N), np.int32)), TypeError, r"mask must be a boolean array, got dtype int32"),
    ],
)
def test_masked_bad_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    MaskedLinear(K, N, **kwargs, rngs=nnx.Rngs(0))


def test_bad_call_and_from_dense_arguments():
  x = jnp.ones((2, K + 1))
  with pytest.raises(ValueError, match=r"BlockSparseLinear has in_features=64: inputs must have shape \(\.\.\., 64\), "
                     r"got inputs.shape=\(2, 65\)"):
    _bsl()(x)
  with pytest.raises(ValueError, match=r"MaskedLinear has in_features=64: inputs must have shape \(\.\.\., 64\), got "
                     r"inputs.shape=\(2, 65\)"):
    MaskedLinear(K, N, sparsity=0.5, rngs=nnx.Rngs(0))(x)
  with pytest.raises(TypeError, match=r"linear must be a flax.nnx.Linear, got MaskedLinear"):
    BlockSparseLinear.from_dense(MaskedLinear(K, N, sparsity=0.5, rngs=nnx.Rngs(0)), density=0.5)
  with pytest.raises(ValueError, match=r"density must be in \(0, 1\]"):
    BlockSparseLinear.from_dense(_dense_linear(), density=2.0, block_shape=(32, 32))
  with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
    MaskedLinear.from_dense(_dense_linear(), sparsity=1.0)


def test_linen_bad_arguments():
  x = jnp.ones((2, K))
  with pytest.raises(ValueError, match=r"density must be in \(0, 1\], got density=2.0"):
    BlockSparseDense(N, density=2.0)
  with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\), got sparsity=1.0"):
    MaskedDense(N, sparsity=1.0)
  with pytest.raises(ValueError, match=r"implementation must be one of"):
    BlockSparseDense(N, density=0.5, implementation="cuda")
  with pytest.raises(ValueError, match=r"block_shape=\(32, 32\) must divide the matrix shape \(64, 100\)"):
    BlockSparseDense(100, density=0.5).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., in_features\), got x.shape=\(\)"):
    MaskedDense(N, sparsity=0.5).init(jax.random.key(0), jnp.ones(()))
  model = BlockSparseDense(N, density=0.5)
  variables = model.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"no 'sparsity' collection"):
    model.apply({"params": variables["params"]}, x)
  with pytest.raises(ValueError, match=rf"BlockSparseDense holds variables for {K} input features, but "
                     rf"x.shape\[-1\] = {2 * K}"):
    model.apply(variables, jnp.ones((2, 2 * K)))
  masked = MaskedDense(N, sparsity=0.5)
  with pytest.raises(ValueError, match=r"no 'sparsity' collection"):
    masked.apply({"params": masked.init(jax.random.key(0), x)["params"]}, x)
  # A mask of another shape failed inside the kernel initializer: "Incompatible shapes for broadcasting".
  params = masked.init(jax.random.key(0), x)["params"]
  with pytest.raises(ValueError, match=rf"MaskedDense at \(top level\): its 'sparsity' collection's mask must have "
                     rf"the weight's shape \({K}, {N}\), got \({N}, {K}\)"):
    masked.apply({"params": params, "sparsity": {"mask": jnp.ones((N, K), bool)}}, x)


def test_sparse_linear_general_takes_int_features_and_names_bad_ones():
  inner = MaskedLinear(16, 8, sparsity=0.5, rngs=nnx.Rngs(0))
  x = _normal(1, (3, 16))
  # An int is one axis, as in nnx.LinearGeneral (it was "TypeError: 'int' object is not iterable").
  layer = jaxsparse.layers.SparseLinearGeneral(inner, in_features=16, out_features=8)
  assert (layer.in_features, layer.out_features) == ((16,), (8,))
  np.testing.assert_allclose(layer(x), x @ jnp.where(inner.mask[...], inner.kernel[...], 0) + inner.bias[...],
                             rtol=1e-5, atol=1e-5)
  # Negative axes multiplying to the right size were accepted.
  with pytest.raises(ValueError, match=r"in_features must be a sequence of ints >= 1, got \(-4, -4\)"):
    jaxsparse.layers.SparseLinearGeneral(inner, in_features=(-4, -4), out_features=(8,))
  with pytest.raises(ValueError, match=r"out_features must be a sequence of ints, got \('8',\) \('8' is not"):
    jaxsparse.layers.SparseLinearGeneral(inner, in_features=(16,), out_features=("8",))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_sparse_linear_general_to_dense_computes_like_the_product(dtype):
  # The product computes in the wrapped layer's dtype; to_dense used the wrapper's own dtype=None (float32 here),
  # so the "dense equivalent" silently differed from the sparse layer by the rounding of a bf16 / fp16 product.
  inner = MaskedLinear(16, 8, sparsity=0.5, dtype=dtype, rngs=nnx.Rngs(0))
  layer = jaxsparse.layers.SparseLinearGeneral(inner, in_features=(4, 4), out_features=(2, 4))
  x = _normal(2, (5, 4, 4))
  y, y_dense = layer(x), layer.to_dense()(x)
  assert y.dtype == y_dense.dtype == dtype
  kernel = jnp.where(inner.mask[...], inner.kernel[...], 0).astype(dtype).reshape(4, 4, 2, 4)
  ref = jnp.einsum("bij,ijkl->bkl", x.astype(dtype), kernel, preferred_element_type=jnp.float32)
  ref = ref + inner.bias[...].reshape(2, 4)
  np.testing.assert_allclose(np.asarray(y_dense, np.float32), np.asarray(y, np.float32), rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(np.asarray(y_dense, np.float32), ref, rtol=2e-2, atol=2e-2)
  # A dtype other than the wrapped layer's cannot be honoured by the product: it is refused, naming both.
  with pytest.raises(ValueError, match=r"dtype=.*float32.* differs from the wrapped layer's dtype="):
    jaxsparse.layers.SparseLinearGeneral(inner, in_features=(16,), out_features=(8,), dtype=jnp.float32)


def test_masked_conv_feature_groups_must_divide_the_features():
  # nnx.Conv accepts these and fails at the first call with a bare AssertionError; the drawn mask had 4 // 3 = 1
  # input feature per group.
  for in_features, out_features in ((4, 6), (6, 4)):
    with pytest.raises(ValueError, match=rf"feature_group_count=3 must divide in_features={in_features} and "
                       rf"out_features={out_features}"):
      jaxsparse.layers.MaskedConv(in_features, out_features, (3, 3), sparsity=0.5, feature_group_count=3,
                                  rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"feature_group_count must be a positive int, got 0"):
    jaxsparse.layers.MaskedConv(4, 6, (3, 3), sparsity=0.5, feature_group_count=0, rngs=nnx.Rngs(0))
  mask = np.random.default_rng(0).random((3, 3, 2, 6)) < 0.5
  conv = jaxsparse.layers.MaskedConv(4, 6, (3, 3), mask=mask, feature_group_count=2, strides=(2, 1),
                                     kernel_dilation=(1, 2), rngs=nnx.Rngs(0))
  x = _normal(3, (2, 9, 8, 4))
  kernel = jnp.where(conv.mask[...], conv.kernel[...], 0)
  ref = jax.lax.conv_general_dilated(x, kernel, (2, 1), "SAME", rhs_dilation=(1, 2), feature_group_count=2,
                                     dimension_numbers=("NHWC", "HWIO", "NHWC")) + conv.bias[...]
  np.testing.assert_allclose(conv(x), ref, rtol=1e-5, atol=1e-5)


def test_traced_user_block_mask_explains():
  # A traced mask's block count (the kernel's shape) is unknown; density= works under jit instead.
  with pytest.raises(ValueError, match=r"block_mask is traced .* pass density="):
    nnx.jit(lambda m: BlockSparseLinear(K, N, block_mask=m, block_shape=(32, 32), rngs=nnx.Rngs(0)))(
        np.ones((K // 32, N // 32), bool)
    )


def test_public_modules():
  assert jaxsparse.layers.linen.BlockSparseDense is BlockSparseDense
  assert issubclass(BlockSparseDense, nn.Module) and issubclass(MaskedDense, nn.Module)
  assert {"BlockSparseLinear", "MaskedLinear", "SparsityPattern", "linen"} <= set(jaxsparse.layers.__all__)


def test_numpy_bool_mask_with_bytes_other_than_one():
  # A NumPy bool array viewing uint8 data holds bytes 2, 3, ...: XLA's select read them as False, its sums as 1.
  raw = (np.arange(K * N).reshape(K, N) % 3).astype(np.uint8)
  want = raw != 0
  layer = MaskedLinear(K, N, mask=raw.view(bool), rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(np.asarray(layer.mask[...]).view(np.uint8), want.view(np.uint8))
  assert int(jnp.sum(layer.mask[...])) == want.sum() and layer.density == pytest.approx(want.mean())
  np.testing.assert_array_equal(np.asarray(layer.kernel[...]) != 0, want)  # the kept weights were zeroed at init
  x = jax.random.normal(jax.random.key(1), (3, K))
  ref = x @ jnp.where(want, layer.kernel[...], 0) + layer.bias[...]
  np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make", [
    lambda dtype, init: MaskedLinear(K, N, sparsity=0.5, param_dtype=dtype, kernel_init=init, rngs=nnx.Rngs(0)),
    lambda dtype, init: BlockSparseLinear(K, N, density=0.5, param_dtype=dtype, kernel_init=init, rngs=nnx.Rngs(0)),
    lambda dtype, init: MaskedDense(N, sparsity=0.5, param_dtype=dtype, kernel_init=init),
    lambda dtype, init: BlockSparseDense(N, density=0.5, param_dtype=dtype, kernel_init=init),
])
def test_integer_param_dtype_needs_a_kernel_init(make):
  # The default initializer draws a normal: it failed inside JAX's sampler ("dtype argument to `uniform` ...").
  for dtype in (jnp.int32, jnp.bool_):
    message = rf"default kernel_init .* got param_dtype={jnp.dtype(dtype)}\. .* kernel_init="
    with pytest.raises(TypeError, match=message):
      make(dtype, None)
  layer = make(jnp.int32, nn.initializers.ones)
  x = jnp.asarray(np.random.default_rng(0).integers(-3, 4, (2, K)), jnp.float32)
  if isinstance(layer, nn.Module):
    variables = layer.init(jax.random.key(0), x)
    kernel = variables["params"]["kernel"]
    if "mask" in variables["sparsity"]:
      w = np.asarray(variables["sparsity"]["mask"], np.float64)
    else:
      w = np.asarray(jaxsparse.BlockSparseMatrix.from_index_arrays(
          kernel.astype(jnp.float32), variables["sparsity"], shape=(K, N), block_shape=(32, 32)).to_dense())
    y = layer.apply(variables, x)
  else:
    kernel = layer.kernel[...]
    w = np.asarray(layer.to_dense().kernel[...], np.float64)
    y = layer(x)
  assert kernel.dtype == jnp.int32 and 0 < np.mean(w != 0) < 1
  np.testing.assert_allclose(y, np.asarray(x, np.float64) @ w, rtol=1e-6, atol=1e-4)  # zero bias, weights 1 kept


# -------------------------------------------------------------------------------------------------
# to_dense keeps the partitioning names.
# -------------------------------------------------------------------------------------------------


def _named(*names):
  return nnx.with_partitioning(nnx.initializers.normal(), names)


def _sparsified(dense, rule):
  sparse, _ = jaxsparse.sparsify(dense, rule)
  return sparse


# Each sparse layer kind, built with partitioned weights as a user does (directly, or by sparsify / compress /
# from_dense of a named dense layer), and the names its dense twin must have: (kernel or table, bias).
_NAMED_LAYERS = {
    "MaskedLinear": (lambda: MaskedLinear(16, 16, sparsity=0.5, kernel_init=_named("x", "y"), bias_init=_named("y"),
                                          rngs=nnx.Rngs(0)), (("x", "y"), ("y",))),
    "MaskedConv": (lambda: jaxsparse.layers.MaskedConv(8, 8, (2, 2), sparsity=0.5, bias_init=_named("y"),
                                                       kernel_init=_named(None, "x", None, "y"), rngs=nnx.Rngs(0)),
                   ((None, "x", None, "y"), ("y",))),
    "NMLinear": (lambda: jaxsparse.layers.NMLinear(16, 16, kernel_init=_named("y", "x"), bias_init=_named("x"),
                                                   rngs=nnx.Rngs(0)), (("y", "x"), ("x",))),
    "NMConv": (lambda: jaxsparse.layers.NMConv(8, 8, (2, 2), kernel_init=_named(None, None, "x", "y"),
                                               bias_init=_named("y"), rngs=nnx.Rngs(0)),
               ((None, None, "x", "y"), ("y",))),
    "CompressedNMLinear": (lambda: jaxsparse.compress(jaxsparse.layers.NMLinear(
        16, 16, kernel_init=_named("x", "y"), bias_init=_named("y"), rngs=nnx.Rngs(0))), (("x", "y"), ("y",))),
    # Block-sparse and LinearGeneral kernels lose their dense names in the sparse layer: sparsify records them.
    "BlockSparseLinear": (lambda: _sparsified(
        nnx.Linear(16, 16, kernel_init=_named("y", "x"), bias_init=_named("x"), rngs=nnx.Rngs(0)),
        jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8))), (("y", "x"), ("x",))),
    "SparseLinearGeneral": (lambda: _sparsified(
        nnx.LinearGeneral((2, 8), (2, 8), axis=(-2, -1), kernel_init=_named(None, "x", "y", None),
                          bias_init=_named(None, "y"), rngs=nnx.Rngs(0)),
        jaxsparse.Unstructured(sparsity=0.5)), ((None, "x", "y", None), (None, "y"))),
    # Built directly around a named (K, N) layer: each name back on the leading dim of its group.
    "SparseLinearGeneral(direct)": (lambda: jaxsparse.layers.SparseLinearGeneral(
        MaskedLinear(16, 16, sparsity=0.5, kernel_init=_named("x", "y"), bias_init=_named("y"), rngs=nnx.Rngs(0)),
        in_features=(2, 8), out_features=(4, 4)), (("x", None, "y", None), ("y", None))),
    # Its weight only in cuSPARSELt's buffer: no kernel names to carry, the bias's come back.
    "CompressedNMLinear(cusparselt)": (lambda: jaxsparse.compress(jaxsparse.layers.NMLinear(
        64, 64, param_dtype=jnp.bfloat16, bias_init=_named("y"), rngs=nnx.Rngs(0)), storage="cusparselt"),
                                       (None, ("y",))),
    "CompressedNMEmbed": (lambda: jaxsparse.layers.CompressedNMEmbed.from_dense(
        nnx.Embed(8, 16, embedding_init=_named("y", "x"), rngs=nnx.Rngs(0)), 2, 4), (("y", "x"), None)),
}


# long: one layer of each kind in the fast set (make test <= 15 min on 2 cores); CI runs the others. The embedding
# is the one whose dense weight is a table and that has no bias.
_NAMED_FAST = ("MaskedLinear", "NMLinear", "BlockSparseLinear", "CompressedNMEmbed")


@pytest.mark.parametrize(
    "kind", [k if k in _NAMED_FAST else pytest.param(k, marks=pytest.mark.slow) for k in _NAMED_LAYERS])
def test_to_dense_keeps_the_partitioning_names(kind):
  """A layer's own ``to_dense()`` dropped the partitioning names (``nnx.with_partitioning``) of kernel and bias,
  which only ``jaxsparse.densify`` carried back: a sharded model turned dense by hand silently lost its sharding.
  ``to_dense()`` now gives the names ``densify`` gives, and the same dense layer."""
  make, (kernel_names, bias_names) = _NAMED_LAYERS[kind]
  mesh = jax.make_mesh((1, 1), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    layer = make()
  dense = layer.to_dense()
  weight = dense.embedding if isinstance(dense, nnx.Embed) else dense.kernel
  assert weight.get_metadata().get("out_sharding") == kernel_names
  if bias_names is not None:
    assert dense.bias.get_metadata().get("out_sharding") == bias_names
  specs = lambda model: jax.tree.map(lambda v: tuple(v.get_value()), nnx.get_partition_spec(nnx.state(model)),
                                     is_leaf=lambda v: isinstance(v, nnx.Variable))
  via_densify = jaxsparse.densify(layer)  # the same dense layer, names and all
  assert type(via_densify) is type(dense) and specs(via_densify) == specs(dense)
  _assert_tree_equal(nnx.state(via_densify), nnx.state(dense))


def _specs(model):
  """``{path: partition names}`` of every variable of ``model`` (``()`` where unnamed)."""
  return nnx.to_pure_dict(jax.tree.map(lambda v: tuple(v.get_value()), nnx.get_partition_spec(nnx.state(model)),
                                       is_leaf=lambda v: isinstance(v, nnx.Variable)))


def _named_linear():
  return nnx.Linear(16, 16, kernel_init=_named("y", "x"), bias_init=_named("x"), rngs=nnx.Rngs(1))


def _named_conv():
  return nnx.Conv(8, 8, (2, 2), kernel_init=_named(None, None, "x", "y"), bias_init=_named("y"), rngs=nnx.Rngs(1))


# Each layer's from_dense: (the named dense layer it takes, from_dense, the sparsify rule building the same layer).
_FROM_DENSE = {
    "MaskedLinear": (_named_linear, lambda d: MaskedLinear.from_dense(d, sparsity=0.5),
                     jaxsparse.Unstructured(sparsity=0.5)),
    "NMLinear": (_named_linear, lambda d: jaxsparse.layers.NMLinear.from_dense(d, n=2, m=4), jaxsparse.NM(2, 4)),
    "BlockSparseLinear": (_named_linear, lambda d: BlockSparseLinear.from_dense(d, density=0.5, block_shape=(8, 8)),
                          jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8))),
    "MaskedConv": (_named_conv, lambda d: jaxsparse.layers.MaskedConv.from_dense(d, sparsity=0.5),
                   jaxsparse.Unstructured(sparsity=0.5)),
    "NMConv": (_named_conv, lambda d: jaxsparse.layers.NMConv.from_dense(d, n=2, m=4), jaxsparse.NM(2, 4)),
}


@pytest.mark.parametrize("kind", list(_FROM_DENSE))
def test_from_dense_keeps_the_partitioning_names(kind):
  """``Layer.from_dense`` dropped the dense layer's partitioning names (``nnx.with_partitioning``) of kernel and bias,
  which only ``jaxsparse.sparsify`` carried over: a sharded model sparsified by hand lost its sharding, and its
  ``to_dense()`` came back unnamed. ``from_dense`` now carries them as ``sparsify`` does, and ``to_dense()`` gives
  the dense layer's names back. (The placement on a mesh: tests/multidevice/md_flax.py.)"""
  make, from_dense, rule = _FROM_DENSE[kind]
  mesh = jax.make_mesh((1, 1), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    dense = make()
  want = _specs(dense)
  assert want["kernel"] in (("y", "x"), (None, None, "x", "y")) and want["bias"] in (("x",), ("y",))
  sparse = from_dense(dense)
  assert _specs(sparse) == _specs(_sparsified(dense, rule))  # the names sparsify gives (block-sparse: replicated)
  if kind != "BlockSparseLinear":  # block-sparse values are replicated: (None, None, None), the names recorded
    assert sparse.kernel.get_metadata().get("out_sharding") == want["kernel"]
  assert sparse.bias.get_metadata().get("out_sharding") == want["bias"]
  back = sparse.to_dense()
  assert type(back) is type(dense) and _specs(back) == want
  x = _normal(2, (3, 16) if kind.endswith("Linear") else (2, 5, 5, 8))
  np.testing.assert_allclose(back(x), sparse(x), rtol=1e-5, atol=1e-5)


def test_to_compressed_keeps_the_partitioning_names():
  """``NMLinear.to_compressed()`` dropped the partitioning names (``nnx.with_partitioning``) of kernel and bias, which
  only ``jaxsparse.compress`` carried over. The method now carries them (``compress`` calls it): the kept values take
  the kernel's names, the packed positions its columns', the bias its own; ``to_dense()`` gives them back."""
  mesh = jax.make_mesh((1, 1), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    layer = jaxsparse.layers.NMLinear(16, 16, kernel_init=_named("y", "x"), bias_init=_named("x"), rngs=nnx.Rngs(0))
  small = layer.to_compressed()
  assert _specs(small) == {"kernel": ("y", "x"), "kernel_positions": (None, "x"), "bias": ("x",)}
  assert _specs(small) == _specs(jaxsparse.compress(layer))
  assert _specs(small.to_dense()) == _specs(layer.to_dense()) == {"kernel": ("y", "x"), "bias": ("x",)}
  x = _normal(1, (3, 16))
  np.testing.assert_allclose(small(x), layer(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make", [
    lambda cin, cout, ks: jaxsparse.layers.MaskedConv(cin, cout, ks, sparsity=0.5, rngs=nnx.Rngs(0)),
    lambda cin, cout, ks: jaxsparse.layers.NMConv(cin, cout, ks, rngs=nnx.Rngs(0)),
])
def test_conv_sizes_are_checked(make):
  # A 0 kernel size failed on a ZeroDivisionError, a negative one in XLA, a NumPy int as "not iterable", a bool built a
  # layer; MaskedConv took any in/out features (a float one failed on "Shapes must be 1D sequences ...").
  for ks in (0, -3, (0, 3), True, (True, 3), 3.0, "3", None):
    with pytest.raises(ValueError, match=r"kernel_size must be a positive int or a sequence of positive ints"):
      make(4, 4, ks)
  for cin, cout, name in ((4.0, 4, "in_features"), (4, -4, "out_features"), (True, 4, "in_features")):
    with pytest.raises(ValueError, match=rf"{name} must be a positive int, got"):
      make(cin, cout, 3)
  conv = make(np.int64(4), np.int64(4), np.int64(3))
  assert conv.kernel_size == (3,)
  assert conv(jnp.ones((1, 5, 4))).shape == (1, 5, 4)


def test_masked_conv_integer_param_dtype_needs_a_kernel_init():
  # Failed inside JAX's sampler: "dtype argument to `uniform` must be a float dtype, got int8".
  with pytest.raises(TypeError, match=r"MaskedConv's default kernel_init .* got param_dtype=int8\. .* kernel_init="):
    jaxsparse.layers.MaskedConv(4, 4, 3, sparsity=0.5, param_dtype=jnp.int8, rngs=nnx.Rngs(0))
  conv = jaxsparse.layers.MaskedConv(4, 4, 3, sparsity=0.5, param_dtype=jnp.int8, kernel_init=nn.initializers.ones,
                                     rngs=nnx.Rngs(0))
  assert conv.kernel[...].dtype == jnp.int8


@pytest.mark.parametrize("make", [
    lambda b: BlockSparseLinear(K, N, density=0.5, use_bias=b, rngs=nnx.Rngs(0)),
    lambda b: MaskedLinear(K, N, sparsity=0.5, use_bias=b, rngs=nnx.Rngs(0)),
    lambda b: jaxsparse.layers.NMLinear(K, N, use_bias=b, rngs=nnx.Rngs(0)),
    lambda b: jaxsparse.layers.NMConv(4, 4, 3, use_bias=b, rngs=nnx.Rngs(0)),
    lambda b: jaxsparse.layers.MaskedConv(4, 4, 3, sparsity=0.5, use_bias=b, rngs=nnx.Rngs(0)),
    lambda b: BlockSparseDense(N, density=0.5, use_bias=b),
    lambda b: MaskedDense(N, sparsity=0.5, use_bias=b),
    lambda b: jaxsparse.layers.linen.NMDense(N, use_bias=b),
    lambda b: jaxsparse.layers.linen.NMConv(4, 3, use_bias=b),
    lambda b: jaxsparse.layers.linen.CompressedNMDense(N, use_bias=b),
])
def test_use_bias_must_be_a_bool(make):
  # Was taken by truthiness: use_bias="False" built a layer with a bias, use_bias=None one without.
  for value in ("False", None, 0, 1):
    with pytest.raises(TypeError, match=rf"use_bias must be a bool, got use_bias={value!r} of type"):
      make(value)
  make(np.bool_(False))
