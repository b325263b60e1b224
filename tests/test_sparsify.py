"""Tests for jaxsparse.sparsify / densify (NNX) and sparsify_linen / densify_linen on models built from Flax layers."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import jaxsparse
from jaxsparse import pruning
from jaxsparse.layers import MaskedConv
from jaxsparse.layers import MaskedLinear
from jaxsparse.layers import NMConv
from jaxsparse.layers import NMLinear
from jaxsparse.layers import SparsityPattern
from tests._util import assert_close


def _normal(seed, shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


# Models assembled from stock Flax layers (nnx.MultiHeadAttention, nnx.LayerNorm, nnx.Sequential, nnx.Conv):
# sparsify only sees their module trees.


class TransformerBlock(nnx.Module):
  def __init__(self, d, heads, *, rngs, param_dtype=jnp.float32):
    self.ln1 = nnx.LayerNorm(d, rngs=rngs, param_dtype=param_dtype)
    self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False, rngs=rngs,
                                       param_dtype=param_dtype)
    self.ln2 = nnx.LayerNorm(d, rngs=rngs, param_dtype=param_dtype)
    self.mlp = nnx.Sequential(nnx.Linear(d, 4 * d, rngs=rngs, param_dtype=param_dtype), jax.nn.gelu,
                              nnx.Linear(4 * d, d, rngs=rngs, param_dtype=param_dtype))

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.mlp(self.ln2(x))


class CNN(nnx.Module):
  def __init__(self, *, rngs):
    self.conv1 = nnx.Conv(4, 16, (3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(16, 16, (3, 3), strides=2, rngs=rngs)
    self.head = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x):
    x = jax.nn.relu(self.conv1(x))
    x = jax.nn.relu(self.conv2(x))
    return self.head(x.mean(axis=(1, 2)))


TRANSFORMER_RULES = {
    r".*attn.*": jaxsparse.NM(2, 4),
    r".*mlp.*": jaxsparse.BlockSparse(density=0.25, block_shape=(16, 16)),
    r".*": jaxsparse.Unstructured(sparsity=0.9),
}


@nnx.jit
def _apply(model, x):
  return model(x)


@nnx.jit
def _grad_x(model, x):
  return jax.grad(lambda x: jnp.sum(model(x) ** 2))(x)


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_transformer_block():
  model = TransformerBlock(32, 4, rngs=nnx.Rngs(0))
  x = _normal(1, (2, 8, 32))
  y_dense = _apply(model, x)
  sparse, report = jaxsparse.sparsify(model, TRANSFORMER_RULES)
  np.testing.assert_array_equal(_apply(model, x), y_dense)  # the original is untouched
  assert {c.path: c.replaced_by for c in report.layers} == {
      "attn.key": "SparseLinearGeneral", "attn.out": "SparseLinearGeneral", "attn.query": "SparseLinearGeneral",
      "attn.value": "SparseLinearGeneral", "mlp.layers.0": "BlockSparseLinear", "mlp.layers.2": "BlockSparseLinear",
  }
  assert isinstance(sparse.attn.query.layer, NMLinear)
  assert all(c.density == (0.5 if c.path.startswith("attn") else 0.25) for c in report.layers)
  mlp0 = next(c for c in report.layers if c.path == "mlp.layers.0")
  # f32 kernel and bias before; after: 4 of 16 blocks, the bias and 24 int32 block indices.
  assert (mlp0.bytes_before, mlp0.bytes_after) == (32 * 128 * 4 + 128 * 4, 4 * 16 * 16 * 4 + 128 * 4 + 24 * 4)
  # The sparse model computes the function of its dense twin with the pruned kernels, forward and backward.
  dense = jaxsparse.densify(sparse)
  assert all(type(n) in (nnx.Linear, nnx.LinearGeneral) for p, n in nnx.iter_modules(dense)
             if isinstance(n, (nnx.Linear, nnx.LinearGeneral)))
  assert_close(_apply(sparse, x), _apply(dense, x), jnp.float32, factor=2)
  assert_close(_grad_x(sparse, x), _grad_x(dense, x), jnp.float32, factor=4)
  # The MLP kernels are block-pruned by magnitude; the query kernel is 2:4 along its input features.
  kernel = np.asarray(dense.mlp.layers[0].kernel[...])
  expected = jaxsparse.block_magnitude_mask(model.mlp.layers[0].kernel[...], (16, 16), 0.25)
  np.testing.assert_array_equal(kernel.reshape(2, 16, 8, 16).any(axis=(1, 3)), expected)
  q = np.asarray(dense.attn.query.kernel[...]).reshape(32, 32)
  assert np.all((q.reshape(8, 4, 32) != 0).sum(axis=1) == 2)


def test_transformer_block_trains_with_nnx_optimizer():
  model, _ = jaxsparse.sparsify(TransformerBlock(32, 4, rngs=nnx.Rngs(0)), TRANSFORMER_RULES)
  patterns = jax.tree.map(np.asarray, nnx.state(model, SparsityPattern))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  x, target = _normal(1, (4, 8, 32)), _normal(2, (4, 8, 32))

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(8)]
  assert losses[-1] < losses[0]
  jax.tree.map(np.testing.assert_array_equal, nnx.state(model, SparsityPattern), patterns)


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_cnn():
  model = CNN(rngs=nnx.Rngs(0))
  x = _normal(1, (2, 8, 8, 4))
  sparse, report = jaxsparse.sparsify(model, {"conv1": jaxsparse.Unstructured(sparsity=0.5),
                                               "conv2": jaxsparse.NM(2, 4), "head": None})
  assert isinstance(sparse.conv1, MaskedConv) and isinstance(sparse.conv2, NMConv)
  assert type(sparse.head) is nnx.Linear
  assert [c.path for c in report.layers] == ["conv1", "conv2"]
  assert sparse.conv1.density == 0.5
  np.testing.assert_array_equal(
      sparse.conv1.mask[...], jaxsparse.magnitude_mask(model.conv1.kernel[...], 0.5)
  )
  assert isinstance(nnx.state(sparse.conv1, SparsityPattern)["mask"], SparsityPattern)
  dense = jaxsparse.densify(sparse)
  assert type(dense.conv1) is nnx.Conv and type(dense.conv2) is nnx.Conv
  assert dense.conv2.strides == 2
  assert_close(_apply(sparse, x), _apply(dense, x), jnp.float32)
  assert_close(_grad_x(sparse, x), _grad_x(dense, x), jnp.float32)
  # Pruned conv weights get no gradient.
  grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))(sparse)
  assert np.all(np.asarray(grads.conv1.kernel[...])[~np.asarray(sparse.conv1.mask[...])] == 0)


@pytest.mark.parametrize("param_dtype", [jnp.bfloat16])  # float32: test_transformer_block
def test_dtypes_are_kept(param_dtype):
  model = TransformerBlock(32, 4, rngs=nnx.Rngs(0), param_dtype=param_dtype)
  sparse, _ = jaxsparse.sparsify(model, TRANSFORMER_RULES)
  assert sparse.mlp.layers[0].kernel.dtype == param_dtype
  assert sparse.attn.query.layer.kernel.dtype == param_dtype
  x = _normal(1, (2, 8, 32))
  assert_close(_apply(sparse, x), _apply(jaxsparse.densify(sparse), x), param_dtype, factor=2)


def test_unstructured_linear_and_inplace():
  model = nnx.Sequential(nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.Linear(32, 8, rngs=nnx.Rngs(1)))
  original = model.layers[0]
  same, report = jaxsparse.sparsify(model, jaxsparse.Unstructured(sparsity=0.75), inplace=True)
  assert same is model and isinstance(model.layers[0], MaskedLinear)
  assert report.layers[0].density == 0.25
  np.testing.assert_array_equal(model.layers[0].mask[...], jaxsparse.magnitude_mask(original.kernel[...], 0.75))
  # A masked layer stores a dense kernel and a bool mask: more bytes, said honestly.
  assert report.layers[0].bytes_after == report.layers[0].bytes_before + 16 * 32
  dense = jaxsparse.densify(model)
  assert float(jnp.mean(dense.layers[0].kernel[...] == 0)) == 0.75


def test_a_bare_layer_is_replaced_and_back():
  layer = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
  sparse, report = jaxsparse.sparsify(layer, jaxsparse.NM(2, 4))
  assert isinstance(sparse, NMLinear) and report.layers[0].path == ""
  assert type(jaxsparse.densify(sparse)) is nnx.Linear


def test_given_masks_are_used():
  model = nnx.Sequential(nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.Linear(32, 8, rngs=nnx.Rngs(1)))
  random_mask = np.random.default_rng(0).random((16, 32)) < 0.3
  block = np.zeros((2, 4), bool)
  block[0, 1] = block[1, 3] = True
  masks = {"layers.0.kernel": random_mask, "layers.1.kernel": np.repeat(np.repeat(block, 16, 0), 2, 1)}
  rules = {r"layers\.0": jaxsparse.Unstructured(sparsity=0.9),
           r"layers\.1": jaxsparse.BlockSparse(density=0.5, block_shape=(16, 2))}
  # The masks win over the rules' densities (about 30% and 25% kept where the rules say 10% and 50%); a warning says so.
  kept0 = f"{random_mask.mean():.1%}".replace(".", r"\.")
  with pytest.warns(UserWarning, match=rf"at 2 layer\(s\) \(layers\.0: the given mask keeps {kept0} of the weights "
                    r"where the rule keeps 10\.0%; layers\.1: the given mask keeps 25\.0% of the blocks "
                    r"where the rule keeps 50\.0%\)"):
    sparse, report = jaxsparse.sparsify(model, rules, masks=masks)
  np.testing.assert_array_equal(sparse.layers[0].mask[...], random_mask)
  np.testing.assert_array_equal(sparse.layers[1].block_mask, block)
  assert report.layers[1].density == 2 / 8
  with pytest.raises(ValueError, match=r"layers\.1: the given mask is not constant over \(16, 2\) blocks"):
    jaxsparse.sparsify(model, rules, masks={"layers.1.kernel": np.random.default_rng(1).random((32, 8)) < 0.5})


def test_check_speed_keeps_a_layer_dense_unless_sparse_is_faster():
  model = nnx.Sequential(nnx.Linear(256, 256, rngs=nnx.Rngs(0)), jax.nn.relu, nnx.Linear(256, 256, rngs=nnx.Rngs(1)))
  x = _normal(0, (64, 256))
  rules = {r"layers\.0": jaxsparse.BlockSparse(density=1 / 16, block_shape=(64, 64)),
           r"layers\.2": jaxsparse.Unstructured(sparsity=0.5)}
  sparse, report = jaxsparse.sparsify(model, rules, check_speed="forward", example_input=x)
  for c in report.layers:
    assert c.dense_ms > 0 and c.sparse_ms > 0
    assert (c.replaced_by is None) == (c.sparse_ms >= c.dense_ms)
    layer = sparse.layers[int(c.path.split(".")[1])]
    assert (type(layer) is nnx.Linear) == (c.replaced_by is None)
    if c.replaced_by is None:
      assert c.density == 1.0 and "kept dense" in c.note
  np.testing.assert_array_equal(model(x).shape, sparse(x).shape)
  with pytest.raises(ValueError, match="check_speed needs example_input"):
    jaxsparse.sparsify(model, rules, check_speed=True)


def test_pruned_then_sparsified_model_keeps_its_accuracy_function():
  # Masks trained by pruning.wrap_optax come back exactly in the sparse layers.
  model = CNN(rngs=nnx.Rngs(0))
  rules = {"conv.*": jaxsparse.NM(2, 4), "head": jaxsparse.Unstructured(sparsity=0.5)}
  optimizer = nnx.Optimizer(model, pruning.wrap_optax(optax.sgd(1e-2), pruning.magnitude_pruner(rules)),
                            wrt=nnx.Param)
  x = _normal(1, (2, 8, 8, 4))
  nnx.jit(lambda m, o: o.update(m, nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m)))(model, optimizer)
  masks = pruning.get_masks(optimizer)
  sparse, _ = jaxsparse.sparsify(model, rules, masks=masks)
  np.testing.assert_array_equal(sparse.head.mask[...], masks["head"]["kernel"])
  np.testing.assert_array_equal(sparse.conv2.nm_mask, masks["conv2"]["kernel"])
  assert_close(_apply(sparse, x), _apply(model, x), jnp.float32)


# -------------------------------------------------------------------------------------------------
# Linen.
# -------------------------------------------------------------------------------------------------


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(64, name="fc1")(x))
    return nn.Dense(8, name="fc2")(x)


class LinenCNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(16, (3, 3), name="conv1")(x))
    x = nn.relu(nn.Conv(16, (3, 3), name="conv2")(x))
    return nn.Dense(10, name="head")(x.mean(axis=(1, 2)))


def test_linen_mlp_matches_densified_and_trains():
  model = LinenMLP()
  x = _normal(0, (4, 32))
  variables = model.init(jax.random.key(0), x)
  rules = {"fc1": jaxsparse.BlockSparse(density=0.25, block_shape=(16, 16)),
           "fc2": jaxsparse.Unstructured(sparsity=0.5)}
  sparse, sparse_vars, report = jaxsparse.sparsify_linen(model, variables, rules, x)
  assert [(c.path, c.replaced_by) for c in report.layers] == [("fc1", "BlockSparseDense"), ("fc2", "MaskedDense")]
  assert sparse_vars["params"]["fc1"]["kernel"].shape == (2, 16, 16)
  assert variables["params"]["fc1"]["kernel"].shape == (32, 64)  # input untouched
  module, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  assert "sparsity" not in dense_vars
  assert_close(sparse.apply(sparse_vars, x), module.apply(dense_vars, x), jnp.float32)
  # Same function as the NNX layers built from the same weights.
  expected = jaxsparse.block_magnitude_mask(variables["params"]["fc1"]["kernel"], (16, 16), 0.25)
  np.testing.assert_array_equal(np.asarray(dense_vars["params"]["fc1"]["kernel"]).reshape(2, 16, 4, 16).any((1, 3)),
                                expected)

  state = train_state.TrainState.create(apply_fn=sparse.apply, params=sparse_vars["params"], tx=optax.adam(1e-2))
  pattern = sparse_vars["sparsity"]
  target = _normal(1, (4, 8))

  @jax.jit
  def step(state):
    def loss_fn(p):
      return jnp.mean((state.apply_fn({"params": p, "sparsity": pattern}, x) - target) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss, grads

  losses = []
  for _ in range(5):
    state, loss, grads = step(state)
    losses.append(float(loss))
  assert losses[-1] < losses[0]
  mask = np.asarray(pattern["fc2"]["mask"])
  assert np.all(np.asarray(grads["fc2"]["kernel"])[~mask] == 0)
  assert np.all(np.asarray(state.params["fc2"]["kernel"])[~mask] == 0)


def test_linen_cnn():
  model = LinenCNN()
  x = _normal(0, (2, 8, 8, 4))
  variables = model.init(jax.random.key(0), x)
  rules = {"conv1": jaxsparse.Unstructured(sparsity=0.5), "conv2": jaxsparse.NM(2, 4)}
  sparse, sparse_vars, report = jaxsparse.sparsify_linen(model, variables, rules, x)
  # As summary names them (the unstructured conv is the nn.Conv given its mask: a masked conv, not a plain one).
  assert [c.replaced_by for c in report.layers] == ["MaskedConv", "NMConv"]
  assert [layer.kind for layer in jaxsparse.summary(sparse_vars, module=sparse).layers][:2] == ["MaskedConv", "NMConv"]
  module, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  assert_close(sparse.apply(sparse_vars, x), module.apply(dense_vars, x), jnp.float32)
  assert float(jnp.mean(dense_vars["params"]["conv1"]["kernel"] == 0)) == 0.5
  k2 = np.asarray(dense_vars["params"]["conv2"]["kernel"])
  assert np.all((k2.reshape(3, 3, 4, 4, 16) != 0).sum(axis=3) == 2)
  grad = jax.grad(lambda p: jnp.sum(sparse.apply({**sparse_vars, "params": p}, x) ** 2))(sparse_vars["params"])
  mask = np.asarray(sparse_vars["sparsity"]["conv1"]["mask"])
  assert np.all(np.asarray(grad["conv1"]["kernel"])[~mask] == 0)
  with pytest.raises(ValueError, match=r"conv1: BlockSparse does not apply to nn\.Conv"):
    jaxsparse.sparsify_linen(model, variables, {"conv1": jaxsparse.BlockSparse(density=0.5)}, x)


class _LinenEveryKind(nn.Module):
  """One layer of each planned kind: conv, dense, nn.DenseGeneral (to two features, then from two axes)."""

  @nn.compact
  def __call__(self, x):
    h = nn.Conv(8, (3,), name="conv")(x)
    h = nn.Dense(32, param_dtype=jnp.bfloat16, name="dense")(h)
    h = nn.DenseGeneral((4, 8), name="up")(h)
    h = nn.DenseGeneral(16, axis=(-2, -1), name="down")(h)
    return nn.Dense(16, use_bias=False, name="out")(h)


def test_densify_linen_of_abstract_variables_is_the_dense_restore_target():
  """``densify_linen`` of ``jax.eval_shape(sparse.init, ...)`` (``jax.ShapeDtypeStruct`` leaves, an orbax restore
  target) gives the abstract dense variables, those of the dense model's init, for every structure and after
  ``compress_linen``; it raised a TypeError (``jnp.asarray`` of a ShapeDtypeStruct)."""
  model = _LinenEveryKind()
  x = _normal(0, (2, 5, 8))
  variables = model.init(jax.random.key(0), x)
  rules = {"conv": jaxsparse.NM(2, 4), "dense": jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8)),
           "up": jaxsparse.NM(2, 4), "down": jaxsparse.Unstructured(sparsity=0.5), "out": jaxsparse.Unstructured(0.5)}
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, rules, x)
  expected = jax.eval_shape(model.init, jax.random.key(0), x)
  spec = jax.tree.map(lambda a: (a.shape, a.dtype), expected)
  assert spec["params"]["dense"]["kernel"] == ((8, 32), jnp.bfloat16)
  assert spec["params"]["up"]["kernel"] == ((32, 4, 8), jnp.float32)
  for module, abstract in [(sparse, jax.eval_shape(sparse.init, jax.random.key(0), x)),
                           jaxsparse.compress_linen(sparse, jax.eval_shape(sparse.init, jax.random.key(0), x))]:
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(abstract))
    dense_module, target = jaxsparse.densify_linen(module, abstract)
    assert dense_module is model
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(target))
    assert jax.tree.structure(target) == jax.tree.structure(expected)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), target) == spec
  # The concrete densify_linen has the same shapes and dtypes.
  _, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), dense_vars) == spec


# -------------------------------------------------------------------------------------------------
# Bad input.
# -------------------------------------------------------------------------------------------------


def test_rule_matching_nothing_warns_with_paths():
  with pytest.warns(UserWarning, match=r"rule\(s\) \['mlp'\] matched no .*available paths: conv1, conv2, head"):
    jaxsparse.sparsify(CNN(rngs=nnx.Rngs(0)), {"mlp": jaxsparse.NM(2, 4)})


def test_nm_that_cannot_apply_names_the_layer():
  with pytest.raises(ValueError, match=r"conv1: N:M sparsity 2:8 needs m=8 to divide the input size 4"):
    jaxsparse.sparsify(CNN(rngs=nnx.Rngs(0)), {"conv1": jaxsparse.NM(2, 8)})
  with pytest.raises(ValueError, match=r"head: N:M sparsity 2:3 needs m=3 to divide the input size 16"):
    jaxsparse.sparsify(CNN(rngs=nnx.Rngs(0)), {"head": jaxsparse.NM(2, 3)})


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_transposable_nm_rules_nnx_linen_and_where_they_do_not_apply():
  # NM(2, 4, transposable=True): the SR-STE layers prune 2:4 along the inputs and the outputs.
  spec = jaxsparse.NM(2, 4, transposable=True)
  assert repr(spec) == "NM(n=2, m=4, transposable=True)" and spec.describe() == "2:4 transposable"
  model = CNN(rngs=nnx.Rngs(0))
  x = _normal(1, (2, 8, 8, 4))
  sparse, report = jaxsparse.sparsify(model, {"conv.*": spec, "head": None})
  assert isinstance(sparse.conv1, NMConv) and sparse.conv1.transposable and sparse.conv2.transposable
  assert "| conv1 | Conv(4->16, (3, 3)) | 2:4 transposable | NMConv |" in str(report)
  mask = np.asarray(sparse.conv2.nm_mask)  # (3, 3, 16, 16)
  assert (mask.reshape(3, 3, 4, 4, 16).sum(3) == 2).all() and (mask.reshape(3, 3, 16, 4, 4).sum(4) == 2).all()
  assert_close(sparse(x), jaxsparse.densify(sparse)(x), jnp.float32)
  # Linen: NMDense with the transposable mask, and densify_linen keeps it.
  dense = nn.Dense(8)
  xl = _normal(2, (2, 16))
  variables = dense.init(jax.random.key(0), xl)
  linen_sparse, linen_vars, _ = jaxsparse.sparsify_linen(dense, variables, spec, xl)
  module, dense_vars = jaxsparse.densify_linen(linen_sparse, linen_vars)
  kernel = np.asarray(dense_vars["params"]["kernel"])
  np.testing.assert_array_equal(kernel != 0, np.asarray(jaxsparse.nm_mask(variables["params"]["kernel"], 2, 4,
                                                                          transposable=True)))
  assert_close(module.apply(dense_vars, xl), linen_sparse.apply(linen_vars, xl), jnp.float32)
  # Where it cannot apply: 10 outputs, m > 4, and the pruning algorithms (plain N:M masks only).
  with pytest.raises(ValueError, match=r"head: transposable N:M sparsity 2:4 needs m=4 to divide the output size 10"):
    jaxsparse.sparsify(CNN(rngs=nnx.Rngs(0)), {"head": spec})
  with pytest.raises(ValueError, match=r"NM\(transposable=True\) needs n < m <= 4, got n=4, m=8"):
    jaxsparse.NM(4, 8, transposable=True)
  with pytest.raises(TypeError, match="transposable must be a bool"):
    jaxsparse.NM(2, 4, transposable=1)
  pruner = pruning.magnitude_pruner(spec, pruning.gradual(begin_step=0, end_step=10, update_every=1))
  with pytest.raises(ValueError, match=r"w: jaxsparse.pruning computes plain N:M masks, got NM\(n=2, m=4, trans"):
    pruner.init({"w": jnp.ones((8, 8))}, jax.random.key(0))
  with pytest.raises(ValueError, match=r"layers\.0: calibrated pruning computes plain N:M masks"):
    pruning.calibrated_prune(nnx.Sequential(nnx.Linear(16, 8, rngs=nnx.Rngs(0))), spec, [jnp.ones((4, 16))])


def test_block_sparse_conv_and_bad_blocks_name_the_layer():
  with pytest.raises(ValueError, match=r"conv2: BlockSparse does not apply to nnx.Conv layers"):
    jaxsparse.sparsify(CNN(rngs=nnx.Rngs(0)), {"conv2": jaxsparse.BlockSparse(density=0.5)})
  with pytest.raises(ValueError, match=r"head: block_shape=\(32, 32\) does not divide"):
    jaxsparse.sparsify(CNN(rngs=nnx.Rngs(0)), {"head": jaxsparse.BlockSparse(density=0.5)})


def test_bad_arguments():
  with pytest.raises(TypeError, match=r"model must be a flax\.nnx\.Module"):
    jaxsparse.sparsify({"params": {}}, jaxsparse.NM(2, 4))
  with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\), got sparsity=1.0"):
    jaxsparse.sparsify(CNN(rngs=nnx.Rngs(0)), {"head": jaxsparse.Unstructured(sparsity=1.0)})
  with pytest.raises(ValueError, match="check_speed must be False, True, 'train' or 'forward'"):
    jaxsparse.sparsify(CNN(rngs=nnx.Rngs(0)), jaxsparse.NM(2, 4), check_speed="fast", example_input=1)
  general = nnx.LinearGeneral((4, 8), 16, axis=(-1, -2), rngs=nnx.Rngs(0))
  holder = nnx.Sequential(general)
  with pytest.raises(ValueError, match=r"layers\.0: nnx.LinearGeneral with axis=\(-1, -2\)"):
    jaxsparse.sparsify(holder, jaxsparse.Unstructured(sparsity=0.5))


def test_report_table():
  _, report = jaxsparse.sparsify(CNN(rngs=nnx.Rngs(0)), {"conv.*": jaxsparse.NM(2, 4)})
  text = str(report)
  assert "| conv1 | Conv(4->16, (3, 3)) | 2:4 | NMConv | 0.500 |" in text
  assert "2 of 2 layers sparse" in text


class _Tied(nnx.Module):
  def __init__(self, rngs):
    self.a = NMLinear(32, 32, rngs=rngs)
    self.b = self.a  # tied: one layer at two paths
    self.c = NMLinear(32, 16, rngs=rngs, dot_general=jax.lax.dot_general)

  def __call__(self, x):
    return self.c(self.b(self.a(x)))


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_compress_turns_nm_layers_into_their_inference_form():
  model = TransformerBlock(32, 4, rngs=nnx.Rngs(0))
  x = _normal(2, (2, 8, 32))
  sparse, _ = jaxsparse.sparsify(model, {r".*attn.*": jaxsparse.NM(2, 4), r".*mlp.*": jaxsparse.NM(2, 4)})
  small = jaxsparse.compress(sparse)
  assert isinstance(sparse.attn.query.layer, NMLinear)  # the original is untouched
  kinds = {type(n).__name__ for _, n in nnx.iter_modules(small)}
  assert "NMLinear" not in kinds and "CompressedNMLinear" in kinds
  assert isinstance(small.attn.query, jaxsparse.layers.SparseLinearGeneral)  # compressed inside the wrapper
  assert small.mlp.layers[0].kernel.shape == (16, 128)  # the kept half of a (32, 128) kernel
  assert_close(_apply(small, x), _apply(sparse, x), jnp.float32, factor=2)
  # Tied layers stay tied; in place; a bare layer; a CNN's NMConv stays as it is.
  tied = _Tied(nnx.Rngs(1))
  y = tied(x)
  assert jaxsparse.compress(tied, inplace=True) is tied and tied.a is tied.b
  assert isinstance(tied.a, jaxsparse.layers.CompressedNMLinear)
  assert_close(tied(x), y, jnp.float32, factor=2)
  bare = NMLinear(32, 8, rngs=nnx.Rngs(2))
  assert_close(jaxsparse.compress(bare)(x), bare(x), jnp.float32, factor=2)
  cnn, _ = jaxsparse.sparsify(CNN(rngs=nnx.Rngs(3)), {r"conv1": jaxsparse.NM(2, 4)})
  assert isinstance(jaxsparse.compress(cnn).conv1, NMConv)


def test_compress_names_a_layer_it_cannot_compress_and_changes_nothing():
  tied = _Tied(nnx.Rngs(1))
  tied.c = NMLinear(32, 16, rngs=nnx.Rngs(4), dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k))
  with pytest.raises(ValueError, match=r"^c: to_compressed cannot keep this layer's custom dot_general"):
    jaxsparse.compress(tied, inplace=True)
  assert isinstance(tied.a, NMLinear) and isinstance(tied.c, NMLinear)
  with pytest.raises(TypeError, match=r"model must be a flax\.nnx\.Module, got dict"):
    jaxsparse.compress({})


def test_compress_checks_its_arguments_on_any_model():
  """A bad ``storage`` / ``cusparselt_copy`` is named even where no layer would read it (no NMLinear, or a model
  already compressed), not silently ignored."""
  dense = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)))
  small = jaxsparse.compress(jaxsparse.sparsify(dense, jaxsparse.NM(2, 4))[0])
  for model in (dense, small):
    with pytest.raises(ValueError, match=r"storage must be 'values', 'cusparselt' or 'auto', got storage='buffer'"):
      jaxsparse.compress(model, storage="buffer")
    with pytest.raises(TypeError, match=r"cusparselt_copy must be True or False, got cusparselt_copy='no'"):
      jaxsparse.compress(model, cusparselt_copy="no")
  x = _normal(1, (2, 8))
  assert_close(jaxsparse.compress(small, storage="values")(x), small(x), jnp.float32)


class _SharedStep(nn.Module):
  @nn.compact
  def __call__(self, c, _):
    return jnp.tanh(nn.Dense(32)(c)), None


class _SharedScan(nn.Module):
  """Three steps of one shared ``nn.Dense`` (``variable_broadcast``), carrying ``extra`` collections too."""
  extra: tuple = ()

  @nn.compact
  def __call__(self, x):
    step = nn.scan(_SharedStep, variable_broadcast=["params", *self.extra], split_rngs={"params": False}, length=3)
    return step()(x, None)[0]


class _SharedBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.tanh(nn.Dense(32)(x))


class _SharedVmap(nn.Module):
  """One ``nn.Dense`` shared by every row of a leading axis (``variable_axes={"params": None}``)."""
  extra: tuple = ()

  @nn.compact
  def __call__(self, x):
    axes = {"params": None, **dict.fromkeys(self.extra, None)}
    return nn.vmap(_SharedBlock, variable_axes=axes, split_rngs={"params": False}, in_axes=0)()(x)


@pytest.mark.parametrize("rule", [jaxsparse.Unstructured(0.5), jaxsparse.BlockSparse(0.5, (8, 8))],
                         ids=["unstructured", "block_sparse"])
@pytest.mark.parametrize("model, x", [(_SharedScan, (4, 32)), (_SharedVmap, (3, 4, 32))], ids=["scan", "vmap"])
def test_sparsify_linen_shared_params_without_sparsity_axis_raises_there(rule, model, x):
  # A model whose nn.vmap / nn.scan shares its params (variable_axes={"params": None} / variable_broadcast="params")
  # without the "sparsity" collection: sparsify_linen succeeded and the first apply failed ("MaskedDense has no
  # 'sparsity' collection"). sparsify_linen now raises, saying what the model needs; with "sparsity" carried beside
  # "params" (as the message says) the sparse model runs and equals the plain-jnp reference on the masked kernel.
  x = _normal(1, x)
  params_only = model()
  with pytest.raises(ValueError, match=r"sparsify_linen: .*lifted transform.*'sparsity'.*variable_broadcast="
                                       r"\['params', 'sparsity'\]"):
    jaxsparse.sparsify_linen(params_only, params_only.init(jax.random.key(0), x), rule, x)
  both = model(extra=("sparsity",))
  sparse, sparse_vars, report = jaxsparse.sparsify_linen(both, both.init(jax.random.key(0), x), rule, x)
  assert len(report.layers) == 1
  path = report.layers[0].path.split(".")
  p, pattern = (sparse_vars[c][path[0]][path[1]] for c in ("params", "sparsity"))
  if "mask" in pattern:
    w = jnp.where(pattern["mask"], p["kernel"], 0.0)
  else:  # the kept (8, 8) blocks at (row_indices, col_indices)
    w = jnp.zeros((32, 32))
    for b, (i, j) in enumerate(zip(np.asarray(pattern["row_indices"]), np.asarray(pattern["col_indices"]),
                                   strict=True)):
      w = w.at[i * 8:(i + 1) * 8, j * 8:(j + 1) * 8].set(p["kernel"][b])
  assert float(jnp.mean(w == 0)) == pytest.approx(0.5, abs=0.05)
  h = x
  for _ in range(3 if model is _SharedScan else 1):
    h = jnp.tanh(h @ w + p["bias"])
  assert_close(sparse.apply(sparse_vars, x), h, jnp.float32)


def test_compress_keeps_partitioning_names():
  """``compress`` carries an ``NMLinear``'s partitioning names: the kept values take the kernel's, the packed
  positions its columns', the bias its own (they were dropped: every spec ``P()``)."""
  mesh = jax.make_mesh((1, 1), ("embed", "mlp"))
  with jax.set_mesh(mesh):
    layer = NMLinear(
        16, 8, n=2, m=4, rngs=nnx.Rngs(0),
        kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp")),
        bias_init=nnx.with_partitioning(nnx.initializers.normal(), ("mlp",)),
    )
  x = jax.random.normal(jax.random.key(1), (3, 16))
  want = layer(x)
  for model in (layer, nnx.Sequential(layer)):
    compressed = jaxsparse.compress(model)
    fc = compressed if isinstance(compressed, nnx.Module) and not isinstance(compressed, nnx.Sequential) else (
        compressed.layers[0])
    names = {p[-1]: v.get_metadata().get("out_sharding") for p, v in nnx.iter_graph(fc) if isinstance(v, nnx.Variable)}
    assert names == {"kernel": ("embed", "mlp"), "kernel_positions": (None, "mlp"), "bias": ("mlp",)}, names
    assert_close(fc(x), want, jnp.float32)


class _Named(nnx.Module):
  """Every layer kind sparsify makes, each dense kernel (table) and bias named with nnx.with_partitioning."""

  def __init__(self, rngs):
    named = lambda *names: nnx.with_partitioning(nnx.initializers.normal(), names)
    self.masked = nnx.Linear(16, 16, kernel_init=named("x", "y"), bias_init=named("y"), rngs=rngs)
    self.nm = nnx.Linear(16, 16, kernel_init=named("y", "x"), rngs=rngs)
    self.packed = nnx.Linear(16, 16, kernel_init=named("y", "x"), rngs=rngs)  # compressed below
    self.block = nnx.Linear(16, 16, kernel_init=named("y", "x"), bias_init=named("x"), rngs=rngs)
    self.nm_conv = nnx.Conv(8, 8, (2, 2), kernel_init=named(None, None, "x", "y"), rngs=rngs)
    self.masked_conv = nnx.Conv(8, 8, (2, 2), kernel_init=named(None, "x", None, "y"), rngs=rngs)
    self.embed = nnx.Embed(8, 16, embedding_init=named("y", "x"), rngs=rngs)
    # The LinearGeneral kernels' names are not on the leading dim of their groups: folding loses them.
    self.general = nnx.LinearGeneral((2, 8), (2, 8), axis=(-2, -1), kernel_init=named(None, "x", "y", None),
                                     bias_init=named(None, "y"), rngs=rngs)
    self.general_block = nnx.LinearGeneral((2, 8), (2, 8), axis=(-2, -1), kernel_init=named("x", None, None, "y"),
                                           rngs=rngs)


_NAMED_RULES = {"masked": jaxsparse.Unstructured(sparsity=0.5), "embed": jaxsparse.NM(2, 4),
                "nm|packed|nm_conv|general": jaxsparse.NM(2, 4),
                "block|general_block": jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8)),
                "masked_conv": jaxsparse.Unstructured(sparsity=0.5)}


@pytest.mark.slow  # 5-6 s on 2 cores (nine layer kinds compiled once each, and the abstract model)
def test_densify_gives_back_the_partitioning_names():
  """densify gives every dense kernel (table) and bias the names the dense model had before sparsify (and compress):
  they were dropped (every spec ``P()``), and block-sparse and LinearGeneral kernels lose them in the sparse model."""
  mesh = jax.make_mesh((1, 1), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  specs = lambda model: jax.tree.map(lambda v: tuple(v.get_value()), nnx.get_partition_spec(nnx.state(model)),
                                     is_leaf=lambda v: isinstance(v, nnx.Variable))
  with jax.set_mesh(mesh):
    model = _Named(nnx.Rngs(0))
  want = specs(model)
  assert want["general"]["kernel"] == (None, "x", "y", None) and want["block"]["bias"] == ("x",)

  def sparse_of(model):
    sparse, _ = jaxsparse.sparsify(model, _NAMED_RULES)
    packed = jaxsparse.compress(nnx.Sequential(sparse.packed)).layers[0]  # a CompressedNMLinear
    sparse.packed = packed
    return sparse

  sparse = sparse_of(model)
  assert type(sparse.packed).__name__ == "CompressedNMLinear" and specs(sparse)["block"]["kernel"] == (None,) * 3
  dense = jaxsparse.densify(sparse)
  assert specs(dense) == want
  for name in ("masked", "packed", "block", "general", "embed"):  # the kernels (tables) densify gives
    kind = "embedding" if name == "embed" else "kernel"
    np.testing.assert_array_equal(getattr(dense, name).__dict__[kind][...],
                                  getattr(sparse, name).to_dense().__dict__[kind][...])
  # The abstract model (an orbax restore target) too.
  with jax.set_mesh(mesh):
    abstract = nnx.eval_shape(lambda: sparse_of(_Named(nnx.Rngs(0))))
  assert specs(jaxsparse.densify(abstract)) == want


@pytest.mark.slow  # 5-6 s on 2 cores (nine layer kinds, sparsified twice)
def test_sparsify_with_masks_keeps_the_partitioning_names():
  """With given masks sparsify builds some layers another way than their ``from_dense`` (which carries the names and
  placement): a block-sparse or masked layer built around the mask, an N:M layer of a pruned copy of the dense layer.
  They take the partitioning names as the layers built without masks do, and densify gives the dense ones back."""
  mesh = jax.make_mesh((1, 1), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  specs = lambda model: nnx.to_pure_dict(jax.tree.map(lambda v: tuple(v.get_value()),
                                                      nnx.get_partition_spec(nnx.state(model)),
                                                      is_leaf=lambda v: isinstance(v, nnx.Variable)))
  with jax.set_mesh(mesh):
    model = _Named(nnx.Rngs(0))
  sparse, _ = jaxsparse.sparsify(model, _NAMED_RULES)
  pruned = jaxsparse.densify(sparse)  # its kept weights (nonzero): masks each layer's structure takes
  weight = lambda layer: layer.embedding if isinstance(layer, nnx.Embed) else layer.kernel
  masks = {f"{name}.{'embedding' if name == 'embed' else 'kernel'}": np.asarray(weight(getattr(pruned, name))[...] != 0)
           for name in vars(model) if isinstance(getattr(model, name), nnx.Module)}
  assert len(masks) == 9 and all(0 < m.mean() < 1 for m in masks.values())
  with_masks, _ = jaxsparse.sparsify(model, _NAMED_RULES, masks=masks)
  assert specs(with_masks) == specs(sparse)
  assert specs(jaxsparse.densify(with_masks)) == specs(model)


def test_densify_of_a_buffer_storage_layer_with_a_partitioned_bias():
  # A CompressedNMLinear keeping its weight only as cuSPARSELt's buffer has no kernel Variable: densify's carry of the
  # partitioning names read its metadata (AttributeError on None). The bias's names still come back.
  layer = NMLinear(64, 64, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)).to_compressed(storage="cusparselt")
  layer.bias.set_metadata(out_sharding=("model",))
  x = jax.random.normal(jax.random.key(1), (3, 64)).astype(jnp.bfloat16)
  want = layer(x)
  dense = jaxsparse.densify(layer)
  assert isinstance(dense, nnx.Linear) and dense.bias.get_metadata().get("out_sharding") == ("model",)
  assert_close(dense(x), want, jnp.bfloat16)
