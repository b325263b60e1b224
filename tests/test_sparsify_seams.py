"""sparsify / densify / the layers at the seams a bug bash found (2026-11-28): tied layers, subclasses of the Flax
layers, options the sparse layers cannot honour, stacked (scan-over-layers) kernels, wrong trailing axes."""

import math
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxsparse
from jaxsparse.layers import MaskedLinear
from jaxsparse.layers import SparsityPattern
from jaxsparse.layers import linen as sparse_linen


def _normal(seed, shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


class Tied(nnx.Module):
  """One nnx.Linear held at two attributes (weight tying) and in a list."""

  def __init__(self, rngs):
    self.a = nnx.Linear(64, 64, rngs=rngs)
    self.b = self.a
    self.blocks = nnx.List([self.a, nnx.Linear(64, 64, rngs=rngs)])

  def __call__(self, x):
    return self.blocks[1](self.b(jax.nn.relu(self.a(x))))


@pytest.mark.parametrize("spec", [jaxsparse.Unstructured(sparsity=0.5), jaxsparse.NM(2, 4),
                                  jaxsparse.BlockSparse(density=0.5, block_shape=(16, 16))])
def test_tied_layer_stays_tied(spec):
  model = Tied(nnx.Rngs(0))
  x = _normal(1, (3, 64))
  sparse, report = jaxsparse.sparsify(model, spec)
  assert sparse.a is sparse.b is sparse.blocks[0] and type(sparse.a) is not nnx.Linear
  assert [c.path for c in report.layers] == ["a", "blocks.1"]
  assert "tied: also at b, blocks.0" in report.layers[0].note
  dense = jaxsparse.densify(sparse)
  assert dense.a is dense.b is dense.blocks[0] and type(dense.a) is nnx.Linear
  np.testing.assert_allclose(sparse(x), dense(x), rtol=1e-5, atol=1e-5)
  pruned = dense.a
  expected = dense.blocks[1](pruned(jax.nn.relu(pruned(x))))
  np.testing.assert_allclose(sparse(x), expected, rtol=1e-5, atol=1e-5)


def test_tied_layer_matched_by_its_second_path_and_conflicting_rules():
  model = Tied(nnx.Rngs(0))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    sparse, _ = jaxsparse.sparsify(model, {"b": jaxsparse.NM(2, 4)})
  assert not [w for w in caught if "matched no" in str(w.message)]
  assert sparse.a is sparse.b and type(sparse.a).__name__ == "NMLinear" and type(sparse.blocks[1]) is nnx.Linear
  with pytest.raises(ValueError, match=r"a: one layer held at several paths .*a: .*2:4.*b: .*unstructured"):
    jaxsparse.sparsify(model, {"a": jaxsparse.NM(2, 4), "b": jaxsparse.Unstructured(sparsity=0.5)})


def test_densify_keeps_a_tied_sparse_layer_tied():
  class TiedSparse(nnx.Module):
    def __init__(self):
      self.a = MaskedLinear(64, 64, sparsity=0.5, rngs=nnx.Rngs(0))
      self.b = self.a

  model = TiedSparse()
  dense = jaxsparse.densify(model)
  assert dense.a is dense.b and type(dense.a) is nnx.Linear


def test_load_nnx_into_a_bare_layer_that_loads_sparse_says_why_and_writes_nothing():
  torch = pytest.importorskip("torch")
  from torch.nn.utils import prune  # noqa: PLC0415

  from jaxsparse import torch_interop  # noqa: PLC0415

  fc = torch.nn.Linear(8, 4)
  prune.l1_unstructured(fc, "weight", amount=0.5)
  layer = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
  before = np.asarray(layer.kernel[...])
  with pytest.raises(ValueError, match=r"model is itself the Linear .* loads as a MaskedLinear.*nnx.Sequential"):
    torch_interop.load_nnx(layer, fc.state_dict())
  np.testing.assert_array_equal(layer.kernel[...], before)
  model = nnx.Sequential(nnx.Linear(8, 4, rngs=nnx.Rngs(0)))  # the way the message gives
  torch_interop.load_nnx(model, {f"layers.0.{k}": v for k, v in fc.state_dict().items()})
  assert type(model.layers[0]).__name__ == "MaskedLinear"


def _scaled_dot(*args, **kwargs):  # stands for any custom product (quantized, scaled, instrumented)
  return 2.0 * jax.lax.dot_general(*args, **kwargs)


UNSTRUCTURED_AND_BLOCK = [jaxsparse.Unstructured(sparsity=0.5),
                          jaxsparse.BlockSparse(density=0.5, block_shape=(16, 16))]


@pytest.mark.parametrize("spec", UNSTRUCTURED_AND_BLOCK)
def test_options_the_sparse_layer_cannot_honour_raise_naming_the_layer(spec):
  lin = nnx.Linear(64, 64, dot_general=_scaled_dot, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"layers\.0: its dot_general is not Flax's default.*None, or use an NM rule"):
    jaxsparse.sparsify(nnx.Sequential(lin), spec)
  with pytest.raises(ValueError, match="cannot honour linear's dot_general"):
    (MaskedLinear.from_dense(lin, sparsity=0.5) if isinstance(spec, jaxsparse.Unstructured) else
     jaxsparse.layers.BlockSparseLinear.from_dense(lin, density=0.5, block_shape=(16, 16)))
  general = nnx.LinearGeneral((4, 16), 64, axis=(-2, -1), dot_general=_scaled_dot, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"layers\.0: its dot_general"):
    jaxsparse.sparsify(nnx.Sequential(general), spec)
  # NM keeps the option: the same function as the dense layer with the pruned weights.
  x = _normal(1, (2, 64))
  sparse, _ = jaxsparse.sparsify(nnx.Sequential(lin), jaxsparse.NM(2, 4))
  np.testing.assert_allclose(sparse(x), jaxsparse.densify(sparse)(x), rtol=1e-5, atol=1e-5)
  assert jaxsparse.densify(sparse).layers[0].dot_general is _scaled_dot

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(64, dot_general=_scaled_dot, name="d")(x)

  variables = Net().init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"d: its dot_general is not Flax's default"):
    jaxsparse.sparsify_linen(Net(), variables, spec, x)


def test_subclasses_of_the_flax_layers_are_not_rebuilt_as_them():
  lora = nnx.LoRALinear(64, 64, lora_rank=4, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"layers\.0: LoRALinear is a subclass of nnx\.Linear.*Map this path to None"):
    jaxsparse.sparsify(nnx.Sequential(lora), jaxsparse.Unstructured(sparsity=0.5))
  sparse, report = jaxsparse.sparsify(nnx.Sequential(lora, nnx.Linear(64, 8, rngs=nnx.Rngs(1))),
                                      {r"layers\.0": None, ".*": jaxsparse.Unstructured(sparsity=0.5)})
  assert type(sparse.layers[0]) is nnx.LoRALinear and [c.path for c in report.layers] == ["layers.1"]
  nm = jaxsparse.layers.NMLinear(64, 64, rngs=nnx.Rngs(0))  # its dense kernel is not what it computes with
  for build in (lambda: MaskedLinear.from_dense(nm, sparsity=0.5),
                lambda: jaxsparse.layers.BlockSparseLinear.from_dense(nm, density=0.5, block_shape=(16, 16)),
                lambda: jaxsparse.layers.NMLinear.from_dense(lora, n=1, m=4)):
    with pytest.raises(TypeError, match=r"got (NMLinear|LoRALinear) \(a subclass of nnx\.Linear.*\.to_dense\(\)"):
      build()


@pytest.mark.parametrize("spec", [*UNSTRUCTURED_AND_BLOCK, jaxsparse.NM(2, 4)])
def test_stacked_scan_over_layers_kernels_nnx_and_linen_sparsified(spec):
  @nnx.vmap(in_axes=0, out_axes=0)
  def stacked(key):
    return nnx.Linear(64, 64, rngs=nnx.Rngs(key))

  model = nnx.Sequential(stacked(jax.random.split(jax.random.key(0), 3)))
  # NNX stacks of nnx.Linear become stacks of sparse layers, layer by layer (tests/test_sparsify_stacks.py).
  sparse, report = jaxsparse.sparsify(model, spec)
  assert report.layers[0].layer == "3 x Linear(64->64)" and sparse.layers[0].bias.shape == (3, 64)

  class Block(nn.Module):
    @nn.compact
    def __call__(self, c, _):
      return nn.Dense(64, name="fc")(c), None

  class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)(name="scan")(x,
                                                                                                             None)[0]

  x = jnp.ones((2, 64))
  variables = Scanned().init(jax.random.key(0), x)
  # Linen nn.scan stacks too (tests/test_sparsify_linen_scan.py); the patterns of masked and block-sparse layers need
  # the "sparsity" collection in the scan's variable_axes, which this one lacks: the error says so.
  if isinstance(spec, jaxsparse.NM):
    _, _, report = jaxsparse.sparsify_linen(Scanned(), variables, spec, x)
    assert report.layers[0].layer == "3 x Dense((64, 64))"
  else:
    with pytest.raises(ValueError, match=r"variable_axes=\{'params': 0, 'sparsity': 0\}"):
      jaxsparse.sparsify_linen(Scanned(), variables, spec, x)


@pytest.mark.parametrize("spec", [jaxsparse.Unstructured(sparsity=0.5), jaxsparse.NM(2, 4)])
def test_general_layers_check_their_trailing_axes(spec):
  model = nnx.Sequential(nnx.LinearGeneral((4, 16), 8, axis=(-2, -1), rngs=nnx.Rngs(0)))
  sparse, _ = jaxsparse.sparsify(model, spec)
  for bad in [(2, 16, 4), (64,)]:
    with pytest.raises(ValueError, match=r"inputs must have shape \(\.\.\., 4, 16\)"):
      sparse(jnp.ones(bad))
  with pytest.raises(ValueError, match=r"must multiply to the wrapped layer's"):
    jaxsparse.layers.SparseLinearGeneral(MaskedLinear(64, 32, sparsity=0.5, rngs=nnx.Rngs(0)), in_features=(8, 4),
                                         out_features=(4, 4))

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.DenseGeneral(8, axis=(-2, -1), name="g")(x)

  x = _normal(2, (2, 4, 16))
  variables = Net().init(jax.random.key(0), x)
  module, sparse_vars, _ = jaxsparse.sparsify_linen(Net(), variables, spec, x)
  assert module.apply(sparse_vars, x).shape == (2, 8)
  with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., 4, 16\)"):
    module.apply(sparse_vars, jnp.ones((2, 16, 4)))


def _conv_with_weight_mask(mask0):
  """A Linen model of one ``nn.Conv`` (8 -> 16 channels, width 3) with the Flax weight mask ``mask0``, an input and
  its variables."""

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Conv(16, (3,), mask=mask0, name="conv")(x)

  x = _normal(1, (2, 5, 8))
  return Net, x, Net().init(jax.random.key(0), x)


def test_linen_conv_with_its_own_weight_mask():
  mask0 = np.random.default_rng(0).random((3, 8, 16)) > 0.5

  Net, x, variables = _conv_with_weight_mask(mask0)
  with pytest.raises(ValueError, match=r"conv: this nn\.Conv already has a Flax weight mask"):
    jaxsparse.sparsify_linen(Net(), variables, jaxsparse.Unstructured(sparsity=0.5), x)
  module, sparse_vars, _ = jaxsparse.sparsify_linen(Net(), variables, jaxsparse.NM(2, 4), x)
  dense_module, dense_vars = jaxsparse.densify_linen(module, sparse_vars)
  np.testing.assert_allclose(module.apply(sparse_vars, x), dense_module.apply(dense_vars, x), rtol=1e-5, atol=1e-5)

  class MadeInCall(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Conv(16, (3,), mask=jnp.asarray(mask0), name="conv")(x)

  variables = MadeInCall().init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"conv: this nn\.Conv's weight mask is made inside the model's call"):
    jaxsparse.sparsify_linen(MadeInCall(), variables, jaxsparse.NM(2, 4), x)


def test_state_of_shapes_prints_and_scalar_inputs_get_a_clear_error():
  for layer in (MaskedLinear(8, 4, sparsity=0.5, rngs=nnx.Rngs(0)),
                jaxsparse.layers.BlockSparseLinear(32, 32, density=0.5, block_shape=(16, 16), rngs=nnx.Rngs(0))):
    assert "(8, 4)" in repr(jax.tree.map(jnp.shape, nnx.state(layer))) or isinstance(
        layer, jaxsparse.layers.BlockSparseLinear)
    repr(jax.tree.map(jnp.shape, nnx.state(layer)))  # raised TypeError before
  for module in (jaxsparse.layers.linen.NMDense(8), jaxsparse.layers.linen.NMConv(8, (3,))):
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., in_features\), got x\.shape=\(\)"):
      module.init(jax.random.key(0), jnp.float32(1.0))


def test_nm_conv_with_its_own_weight_mask_reports_what_it_keeps():
  mask0 = jnp.asarray(np.random.default_rng(0).random((3, 8, 16)) > 0.5)
  conv = nnx.Conv(8, 16, (3,), mask=mask0, rngs=nnx.Rngs(0))
  sparse, report = jaxsparse.sparsify(nnx.Sequential(conv), jaxsparse.NM(2, 4))
  layer = sparse.layers[0]
  kept = float(jnp.mean(layer.pruned_kernel() != 0))
  assert kept < 0.5
  assert report.layers[0].density == pytest.approx(kept)
  assert jaxsparse.summary(sparse).layers[0].density == pytest.approx(kept)


def test_layers_in_a_tuple_are_replaced():
  class Blocks(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.data((nnx.Linear(64, 64, rngs=rngs), nnx.Linear(64, 64, rngs=rngs)))

    def __call__(self, x):
      for block in self.blocks:
        x = block(x)
      return x

  model = Blocks(nnx.Rngs(0))
  x = _normal(1, (2, 64))
  sparse, _ = jaxsparse.sparsify(model, jaxsparse.Unstructured(sparsity=0.5))
  assert isinstance(sparse.blocks, tuple) and all(type(b) is MaskedLinear for b in sparse.blocks)
  dense = jaxsparse.densify(sparse)
  assert all(type(b) is nnx.Linear for b in dense.blocks)
  np.testing.assert_allclose(sparse(x), dense(x), rtol=1e-5, atol=1e-5)


def test_a_layer_tied_inside_tuples_and_dicts_stays_tied():
  class Nested(nnx.Module):
    def __init__(self, rngs):
      a = nnx.Linear(64, 64, rngs=rngs)
      self.pair = nnx.data((a, a))
      self.named = nnx.data({"first": a, "rest": [nnx.Linear(64, 64, rngs=rngs)]})
      self.b = a

    def __call__(self, x):
      return self.named["rest"][0](self.b(self.pair[1](self.pair[0](x))))

  model = Nested(nnx.Rngs(0))
  x = _normal(1, (2, 64))
  sparse, report = jaxsparse.sparsify(model, jaxsparse.Unstructured(sparsity=0.5))
  a = sparse.pair[0]
  assert type(a) is MaskedLinear and a is sparse.pair[1] is sparse.named["first"] is sparse.b
  assert type(sparse.named["rest"][0]) is MaskedLinear and len(report.layers) == 2
  dense = jaxsparse.densify(sparse)
  assert type(dense.b) is nnx.Linear and dense.b is dense.pair[0] is dense.pair[1] is dense.named["first"]
  np.testing.assert_allclose(sparse(x), dense(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", [*UNSTRUCTURED_AND_BLOCK, jaxsparse.NM(2, 4)])
def test_sparse_layers_take_the_flax_layers_keyword(spec):
  """A model calling ``self.fc(inputs=x)`` (nnx.Linear's name) keeps working after sparsify."""

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.fc = nnx.Linear(64, 32, rngs=rngs)
      self.general = nnx.LinearGeneral((4, 8), 16, axis=(-2, -1), rngs=rngs)

    def __call__(self, x):
      return self.fc(inputs=x), self.general(inputs=x.reshape(*x.shape[:-1], 4, 16)[..., :8])

  x = _normal(1, (2, 64))
  sparse, _ = jaxsparse.sparsify(Net(nnx.Rngs(0)), spec)
  dense = jaxsparse.densify(sparse)
  for a, b in zip(sparse(x), dense(x), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  compressed = jaxsparse.layers.NMLinear(64, 32, rngs=nnx.Rngs(0)).to_compressed()
  np.testing.assert_allclose(compressed(inputs=x), compressed(x))


def test_errors_for_a_model_that_is_the_layer_name_it():
  with pytest.raises(ValueError, match=r"^\(the model itself\): N:M sparsity 2:4"):
    jaxsparse.sparsify(nnx.Linear(6, 8, rngs=nnx.Rngs(0)), jaxsparse.NM(2, 4))


def test_linen_model_that_is_the_layer_takes_the_masks_of_get_masks():
  """A bare ``nn.Dense``: its mask key is ``"kernel"`` (as ``pruning.get_masks`` and NNX ``sparsify`` say), not
  ``".kernel"``, and errors name it as the model itself, not by an empty path."""
  x = _normal(1, (2, 8))
  variables = nn.Dense(8).init(jax.random.key(0), x)
  mask = np.zeros((8, 8), bool)
  mask[::2] = True
  sparse, sparse_vars, report = jaxsparse.sparsify_linen(nn.Dense(8), variables, jaxsparse.Unstructured(sparsity=0.5),
                                                         x, masks={"kernel": mask})
  np.testing.assert_array_equal(sparse_vars["sparsity"]["mask"], mask)
  assert report.layers[0].density == 0.5
  kernel = variables["params"]["kernel"]
  np.testing.assert_allclose(sparse.apply(sparse_vars, x), x @ jnp.where(mask, kernel, 0) + variables["params"]["bias"],
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match=r"^\(the model itself\): the given mask has shape \(4, 4\)"):
    jaxsparse.sparsify_linen(nn.Dense(8), variables, jaxsparse.NM(2, 4), x, masks={"kernel": np.ones((4, 4), bool)})
  with pytest.raises(ValueError, match=r"^\(the model itself\): N:M sparsity 2:4"):
    jaxsparse.sparsify_linen(nn.Dense(8), nn.Dense(8).init(jax.random.key(0), x[:, :6]), jaxsparse.NM(2, 4), x[:, :6])


def test_densify_keeps_a_bias_of_another_dtype():
  w = jaxsparse.NMSparseMatrix.from_dense(_normal(0, (64, 32), jnp.bfloat16), 2, 4)
  layer = jaxsparse.layers.CompressedNMLinear(w, _normal(3, (32,)))  # a float32 bias
  x = _normal(1, (2, 64), jnp.bfloat16)
  dense = jaxsparse.densify(layer)
  assert dense.bias[...].dtype == jnp.float32 and dense(x).dtype == layer(x).dtype == jnp.float32
  np.testing.assert_allclose(dense(x), layer(x), rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # 10-19 s on 2 cores: out of the fast set (make test <= 15 min); CI runs it
def test_partitioned_initializers_keep_their_names():
  """Flax's sharding idiom ``kernel_init=nnx.with_partitioning(...)`` / ``nn.with_partitioning(...)``."""
  named = lambda *names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)
  mesh = jax.make_mesh((1, 1), ("embed", "mlp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  x = _normal(1, (2, 64))
  with jax.set_mesh(mesh):
    masked = MaskedLinear(64, 64, sparsity=0.5, kernel_init=named("embed", "mlp"), rngs=nnx.Rngs(0))
    block = jaxsparse.layers.BlockSparseLinear(64, 64, density=0.5, block_shape=(16, 16),
                                               kernel_init=named(None, "embed", "mlp"), rngs=nnx.Rngs(0))
    for layer, spec in [(masked, ("embed", "mlp")), (block, (None, "embed", "mlp"))]:
      assert tuple(nnx.get_partition_spec(nnx.state(layer))["kernel"].get_value()) == spec
      np.testing.assert_allclose(layer(x), jaxsparse.densify(layer)(x), rtol=1e-5, atol=1e-5)
    assert float(jnp.mean(masked.kernel[...] == 0)) == 0.5
  part = nn.with_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
  for module in (jaxsparse.layers.linen.MaskedDense(64, sparsity=0.5, kernel_init=part),
                 jaxsparse.layers.linen.NMDense(64, kernel_init=part)):
    variables = module.init(jax.random.key(0), x)
    assert variables["params"]["kernel"].names == ("embed", "mlp")
    assert module.apply(variables, x).shape == (2, 64)


def test_summary_and_plot_of_boxed_linen_variables():
  matplotlib = pytest.importorskip("matplotlib")
  matplotlib.use("Agg")
  part = nn.with_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(64, kernel_init=part, name="b")(nn.Dense(64, kernel_init=part, name="a")(x))

  x = jnp.ones((2, 64))
  variables = Net().init(jax.random.key(0), x)
  rules = {"a": jaxsparse.BlockSparse(density=0.5, block_shape=(16, 16)), "b": jaxsparse.Unstructured(sparsity=0.5)}
  module, sparse_vars, _ = jaxsparse.sparsify_linen(Net(), variables, rules, x)
  assert isinstance(sparse_vars["params"]["a"]["kernel"], nn.Partitioned)
  assert [layer.path for layer in jaxsparse.summary(sparse_vars, x, module=module).layers] == ["a", "b"]
  for name in "ab":
    jaxsparse.plot_pattern({"params": sparse_vars["params"][name], "sparsity": sparse_vars["sparsity"][name]})


def test_linen_layers_called_with_inputs_keyword_are_found():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(32, name="fc")(inputs=x)

  x = _normal(1, (2, 64))
  variables = Net().init(jax.random.key(0), x)
  module, sparse_vars, report = jaxsparse.sparsify_linen(Net(), variables, jaxsparse.Unstructured(sparsity=0.5), x)
  assert [c.path for c in report.layers] == ["fc"] and "sparsity" in sparse_vars
  dense_module, dense_vars = jaxsparse.densify_linen(module, sparse_vars)
  y = module.apply(sparse_vars, x)
  np.testing.assert_allclose(y, dense_module.apply(dense_vars, x), rtol=1e-5, atol=1e-5)
  assert not np.allclose(y, Net().apply(variables, x))  # the pruned weights are gone


def test_a_rule_shadowed_by_an_earlier_one_warns():
  model = nnx.Sequential(nnx.Linear(64, 64, rngs=nnx.Rngs(0)), nnx.Linear(64, 8, rngs=nnx.Rngs(1)))
  shadowed = r"rule 'layers\\\.0' selects no .*layers\.0 -> '\.\*'.*more specific rule first"
  with pytest.warns(UserWarning, match=shadowed):
    jaxsparse.sparsify(model, {".*": None, r"layers\.0": jaxsparse.NM(2, 4)})
  with warnings.catch_warnings():  # a catch-all left with nothing (every layer taken by earlier rules) is fine
    warnings.simplefilter("error")
    jaxsparse.sparsify(model, {r"layers\.0": jaxsparse.NM(2, 4), r"layers\.1": None, ".*": jaxsparse.NM(2, 4)})

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8, name="b")(nn.Dense(64, name="a")(x))

  x = jnp.ones((2, 64))
  variables = Net().init(jax.random.key(0), x)
  with pytest.warns(UserWarning, match=r"rule 'a' selects no nn\.Dense"):
    jaxsparse.sparsify_linen(Net(), variables, {"a|b": jaxsparse.Unstructured(sparsity=0.5), "a": None}, x)


class _Mixed(nn.Module):
  """An nn.Dense, an nn.Conv and an nn.DenseGeneral: one of each kind sparsify_linen rebuilds."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(32, name="fc")(x)
    h = nn.Conv(32, (3,), name="conv")(h[:, None, :].repeat(4, axis=1)).mean(axis=1)
    return nn.DenseGeneral((2, 16), name="proj")(h)


@pytest.mark.parametrize("spec", [jaxsparse.Unstructured(sparsity=0.5), jaxsparse.NM(2, 4),
                                  {"conv": None, ".*": jaxsparse.BlockSparse(density=0.5, block_shape=(16, 16))}])
def test_sparsify_linen_under_eval_shape_gives_the_abstract_restore_target(spec):
  x = _normal(0, (2, 32))
  model = _Mixed()

  def make():
    _, sparse_vars, report = jaxsparse.sparsify_linen(model, model.init(jax.random.key(0), x), spec, x)
    densities.extend(c.density for c in report.layers)
    return sparse_vars

  densities = []
  abstract = jax.eval_shape(make)  # an Unstructured layer's report read the traced mask: TracerArrayConversionError
  _, concrete, report = jaxsparse.sparsify_linen(model, model.init(jax.random.key(0), x), spec, x)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(lambda a: (a.shape, a.dtype), concrete)
  # The kept count of a mask ranked from traced weights is unknown (None, as NNX sparsify reports it); structural ones
  # are the rule's.
  expected = [None if isinstance(spec, jaxsparse.Unstructured) else c.density for c in report.layers]
  assert densities == expected


@pytest.mark.parametrize("spec", [jaxsparse.NM(2, 4), jaxsparse.Unstructured(sparsity=0.5)], ids=str)
def test_sparsify_linen_under_eval_shape_of_concrete_variables(spec):
  # Variables made outside the traced function: the N:M report counted the kept weights with jnp under the trace and
  # float() of the traced count raised ConcretizationTypeError; they are concrete, so it is counted.
  x = _normal(0, (2, 32))
  model = _Mixed()
  variables = model.init(jax.random.key(0), x)
  densities = []

  def make():
    _, sparse_vars, report = jaxsparse.sparsify_linen(model, variables, spec, x)
    densities.extend(c.density for c in report.layers)
    return sparse_vars

  abstract = jax.eval_shape(make)
  _, concrete, report = jaxsparse.sparsify_linen(model, variables, spec, x)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(lambda a: (a.shape, a.dtype), concrete)
  # An unstructured mask is ranked from the concrete weights eagerly, also under the trace: its kept count is known
  # there too (it was NaN).
  assert None not in densities
  np.testing.assert_allclose(densities, [c.density for c in report.layers], rtol=1e-6)


def test_sparsify_linen_under_eval_shape_with_traced_masks_says_what_to_do():
  x = _normal(0, (2, 32))
  model = _Mixed()

  def make():
    variables = model.init(jax.random.key(0), x)
    masks = {"fc.kernel": jnp.abs(variables["params"]["fc"]["kernel"]) > 0.1}
    return jaxsparse.sparsify_linen(model, variables, {"fc": jaxsparse.Unstructured(sparsity=0.5)}, x,
                                    masks=masks)[1]

  with pytest.raises(ValueError, match=r"masks\['fc\.kernel'\] is traced .* Compute the masks outside"):
    jax.eval_shape(make)


def test_sparsify_under_nnx_eval_shape_with_traced_masks_says_what_to_do():
  """NNX sparsify read traced masks with np.asarray: a bare TracerArrayConversionError from inside masks_to_dict."""

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.fc = nnx.Linear(32, 32, rngs=rngs)

  def make():
    model = Net(nnx.Rngs(0))
    masks = {"fc.kernel": jnp.abs(model.fc.kernel[...]) > 0.1}
    return jaxsparse.sparsify(model, {"fc": jaxsparse.Unstructured(sparsity=0.5)}, masks=masks)[0]

  with pytest.raises(ValueError, match=r"masks\['fc\.kernel'\] is traced .* Compute the masks outside"):
    nnx.eval_shape(make)


def test_masks_given_as_shape_dtype_structs_are_called_abstract():
  """A jax.ShapeDtypeStruct mask was called "traced (computed inside jax.eval_shape / jax.jit)"."""
  abstract = {"fc.kernel": jax.ShapeDtypeStruct((32, 32), jnp.bool_)}
  with pytest.raises(ValueError, match=r"masks\['fc\.kernel'\] is abstract \(ShapeDtypeStruct: no values\): its "
                     "values are needed"):
    jaxsparse.pruning.masks_to_dict(abstract)

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.fc = nnx.Linear(32, 32, rngs=rngs)

  with pytest.raises(ValueError, match=r"masks\['fc\.kernel'\] is abstract \(ShapeDtypeStruct"):
    jaxsparse.sparsify(Net(nnx.Rngs(0)), {"fc": jaxsparse.Unstructured(sparsity=0.5)}, masks=abstract)


def test_sparsify_linen_of_an_integer_model():
  class Int(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(32, param_dtype=jnp.int32, kernel_init=nn.initializers.zeros_init(), name="fc")(x)

  x = jnp.asarray(np.random.default_rng(0).integers(-3, 4, (2, 32)), jnp.float32)
  rng = np.random.default_rng(1)
  variables = {"params": {"fc": {"kernel": jnp.asarray(rng.integers(-9, 10, (32, 32)), jnp.int32),
                                 "bias": jnp.asarray(rng.integers(-9, 10, (32,)), jnp.int32)}}}
  for spec in (jaxsparse.Unstructured(sparsity=0.5), jaxsparse.BlockSparse(density=0.5, block_shape=(16, 16))):
    # The sparse layer's default initializer (a normal) failed on int32: "dtype argument to `uniform` ...".
    sparse, sparse_vars, _ = jaxsparse.sparsify_linen(Int(), variables, spec, x)
    assert sparse_vars["params"]["fc"]["kernel"].dtype == jnp.int32
    dense_module, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
    kernel = np.asarray(dense_vars["params"]["fc"]["kernel"], np.float64)
    assert 0 < np.mean(kernel != 0) < 1
    expected = np.asarray(x, np.float64) @ kernel + np.asarray(variables["params"]["fc"]["bias"])
    np.testing.assert_allclose(sparse.apply(sparse_vars, x), expected, rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(dense_module.apply(dense_vars, x), expected, rtol=1e-6, atol=1e-4)
  # NMDense refuses it, now in sparsify_linen and naming the layer (before: at the first apply, without the path).
  with pytest.raises(TypeError, match=r"^fc: NMDense trains its kernel with SR-STE and needs a floating param_dtype"):
    jaxsparse.sparsify_linen(Int(), variables, jaxsparse.NM(2, 4), x)


def test_sparse_layer_errors_at_apply_name_the_layer():
  x = _normal(0, (2, 32))
  model = _Mixed()
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, model.init(jax.random.key(0), x), jaxsparse.NM(2, 4), x)
  bad = jax.tree.map(lambda a: a, sparse_vars)
  bad["params"]["fc"]["kernel"] = bad["params"]["fc"]["kernel"].astype(jnp.complex64)
  with pytest.raises(TypeError, match=r"^fc: "):
    sparse.apply(bad, x)


@pytest.mark.parametrize("scale", [0.5, 2])
def test_linen_masked_conv_refuses_a_mask_that_is_not_boolean(scale):
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Conv(8, (3,), name="conv")(x)

  x = _normal(0, (2, 8, 8))
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(Net(), Net().init(jax.random.key(0), x),
                                                    jaxsparse.Unstructured(sparsity=0.5), x)
  mask = sparse_vars["sparsity"]["conv"]["mask"]
  # nn.Conv multiplies its kernel by the mask (the forward scaled the kept weights) while densify_linen (and the
  # torch export) kept them as they are: the two silently differed.
  bad = {**sparse_vars, "sparsity": {"conv": {"mask": mask.astype(type(scale)) * scale}}}
  with pytest.raises(TypeError, match=r"^conv: its 'sparsity' collection's mask must be a boolean array, got dtype"):
    sparse.apply(bad, x)
  with pytest.raises(TypeError, match=r"^conv: its 'sparsity' collection's mask must be a boolean array, got dtype"):
    jaxsparse.densify_linen(sparse, bad)
  dense_module, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)  # a bool mask: the same function
  np.testing.assert_allclose(sparse.apply(sparse_vars, x), dense_module.apply(dense_vars, x), rtol=1e-5, atol=1e-5)


def test_densify_linen_of_an_nm_conv_with_a_weight_mask_of_other_values():
  # Flax multiplies the kernel by its weight mask before NMConv's N:M pruning ranks the weights: densify pruned by
  # the unscaled kernel, another N:M pattern than the forward's.
  mask0 = jnp.asarray(np.random.default_rng(0).choice([0.0, 0.1, 1.0], size=(3, 8, 16)), jnp.float32)

  Net, x, variables = _conv_with_weight_mask(mask0)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(Net(), variables, jaxsparse.NM(2, 4), x)
  dense_module, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  kernel = variables["params"]["conv"]["kernel"] * mask0  # the reference: nn.Conv's masked kernel, pruned 2:4
  groups = jnp.abs(kernel).reshape(3, 2, 4, 16)
  kept = (groups >= jnp.sort(groups, axis=2)[:, :, 2:3]).reshape(3, 8, 16)
  expected = jax.lax.conv_general_dilated(x, jnp.where(kept, kernel, 0.0), (1,), "SAME",
                                          dimension_numbers=("NWC", "WIO", "NWC")) + variables["params"]["conv"]["bias"]
  np.testing.assert_allclose(sparse.apply(sparse_vars, x), expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dense_module.apply(dense_vars, x), expected, rtol=1e-5, atol=1e-5)


# flax.nnx.bridge (a bug bash, 2026-11-29): ToNNX around jaxsparse Linen layers, ToLinen around the NNX ones.


class _LinenSparse(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = sparse_linen.MaskedDense(32, sparsity=0.5)(nn.Dense(32)(x))
    return sparse_linen.BlockSparseDense(16, density=0.5, block_shape=(8, 8))(x)


def test_bridge_to_nnx_keeps_the_linen_pattern_as_sparsity_patterns():
  # ToNNX made the "sparsity" collection an anonymous Variable type: nnx.state(model, SparsityPattern) was empty.
  x = _normal(0, (4, 32))
  model = nnx.bridge.ToNNX(_LinenSparse(), rngs=nnx.Rngs(0)).lazy_init(x)
  patterns = nnx.state(model, SparsityPattern)
  assert sorted(patterns) == ["BlockSparseDense_0", "MaskedDense_0"]
  assert patterns["MaskedDense_0"]["mask"][...].dtype == jnp.bool_
  _, params, _, rest = nnx.split(model, nnx.Param, SparsityPattern, ...)
  assert not any(isinstance(v, SparsityPattern) for v in jax.tree.leaves(rest, is_leaf=_is_variable))
  assert "mask" not in params["MaskedDense_0"]
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.5), wrt=nnx.Param)
  before = jax.tree.map(np.asarray, nnx.state(model, SparsityPattern))
  for _ in range(3):
    optimizer.update(model, nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model))
  after = jax.tree.map(np.asarray, nnx.state(model, SparsityPattern))
  jax.tree.map(np.testing.assert_array_equal, before, after)
  kernel = model.MaskedDense_0["kernel"][...]
  assert not jnp.any(jnp.where(model.MaskedDense_0["mask"][...], 0.0, kernel))  # pruned weights stay zero


def _is_variable(v):
  return isinstance(v, nnx.Variable)


def test_bridge_to_linen_puts_the_pattern_in_the_sparsity_collection():
  # ToLinen put an NNX layer's SparsityPattern in a "SparsityPattern" collection, unlike the Linen layers' "sparsity":
  # MaskedDense could not apply the variables, and summary found no sparse layer in them.
  x = _normal(0, (4, 32))
  bridged = nnx.bridge.ToLinen(MaskedLinear, args=(32, 16), kwargs={"sparsity": 0.5})
  variables = bridged.init(jax.random.key(0), x)
  assert sorted(variables) == ["params", "sparsity"] and variables["sparsity"]["mask"].shape == (32, 16)
  y = bridged.apply(variables, x)
  np.testing.assert_array_equal(sparse_linen.MaskedDense(16, sparsity=0.5).apply(variables, x), y)
  # The kernel comes boxed (an NNXMeta keeping the mark of a masked layer's kernel for the pruners): nn.unbox reads it.
  mask, params = variables["sparsity"]["mask"], nn.unbox(variables["params"])
  np.testing.assert_allclose(y, x @ jnp.where(mask, params["kernel"], 0.0) + params["bias"], rtol=1e-5, atol=1e-5)
  assert [(layer.kind, layer.density) for layer in jaxsparse.summary(variables).layers] == [("MaskedDense", 0.5)]


class _LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x, train=False):
    x = nn.BatchNorm(use_running_average=not train)(nn.Dense(32)(x))
    return nn.Dense(16)(nn.Dropout(0.5, deterministic=not train)(x))


@pytest.mark.parametrize("spec", [jaxsparse.Unstructured(sparsity=0.5), jaxsparse.NM(2, 4),
                                  jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8))])
def test_bridge_to_nnx_of_a_sparsify_linen_model(spec):
  # ToNNX initialises through init_with_output, which SparsifiedLinen lacked (an AttributeError in lazy_init).
  x = _normal(0, (4, 32))
  module = _LinenMLP()
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(module, module.init(jax.random.key(0), x), spec, x)
  rngs = {"params": jax.random.key(1), "dropout": jax.random.key(2)}
  out, variables = sparse.init_with_output(rngs, x, train=True)
  jax.tree.map(np.testing.assert_array_equal, variables, sparse.init(rngs, x, train=True))
  np.testing.assert_array_equal(out, sparse.apply(variables, x, train=True, rngs=rngs, mutable=True)[0])
  out, variables = sparse.init_with_output(jax.random.key(1), x)
  np.testing.assert_array_equal(out, sparse.apply(variables, x))
  assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, sparse_vars)

  model = nnx.bridge.ToNNX(sparse, rngs=nnx.Rngs(0)).lazy_init(x)
  assert model(x).shape == (4, 16)
  assert {k: v.shape for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))} == {
      tuple(k.key for k in path): v.shape for path, v in jax.tree_util.tree_leaves_with_path(sparse_vars["params"])}
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.5), wrt=nnx.Param)
  before = jax.tree.map(np.asarray, nnx.state(model, SparsityPattern))
  optimizer.update(model, nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model))
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, nnx.state(model, SparsityPattern)))


def test_nnx_conversions_name_the_linen_layers_inside_bridge_to_nnx():
  # sparsify, densify and compress walk NNX modules only: a ToNNX's Linen layers stayed as they were without a word
  # (densify returned a model that was still sparse).
  x = _normal(0, (4, 32))

  class Mixed(nnx.Module):
    def __init__(self, rngs):
      self.proj = nnx.Linear(32, 32, rngs=rngs)
      self.block = nnx.bridge.ToNNX(_LinenSparse(), rngs=rngs)

    def __call__(self, x):
      return self.block(self.proj(x))

  model = Mixed(nnx.Rngs(0))
  nnx.bridge.lazy_init(model, x)
  with pytest.warns(UserWarning, match=r"sparsify does not see inside flax.nnx.bridge.ToNNX: the Linen layers of "
                                       r"block \(wrapping _LinenSparse\) stay as they are. .*sparsify_linen"):
    sparse, report = jaxsparse.sparsify(model, jaxsparse.NM(2, 4))
  assert [c.path for c in report.layers] == ["proj"]
  with pytest.raises(ValueError, match=r"densify cannot densify the jaxsparse Linen layers inside "
                                       r"flax.nnx.bridge.ToNNX: block \(wrapping _LinenSparse\).*densify_linen"):
    jaxsparse.densify(sparse)
  densified = jaxsparse.densify(sparse.proj)  # the NNX layer alone converts as before
  assert type(densified) is nnx.Linear

  module = _LinenMLP()
  nm, _, _ = jaxsparse.sparsify_linen(module, module.init(jax.random.key(0), x), jaxsparse.NM(2, 4), x)
  bridged = nnx.bridge.ToNNX(nm, rngs=nnx.Rngs(0))
  bridged.lazy_init(x)
  with pytest.warns(UserWarning, match=r"compress does not see inside flax.nnx.bridge.ToNNX: the Linen layers of "
                                       r"\(the model itself\) \(wrapping SparsifiedLinen\).*compress_linen"):
    jaxsparse.compress(bridged)
  with pytest.raises(ValueError, match=r"\(the model itself\) \(wrapping SparsifiedLinen\)"):
    jaxsparse.densify(bridged)
  plain = nnx.bridge.ToNNX(nn.LayerNorm(), rngs=nnx.Rngs(0))  # no layer to convert: no word
  plain.lazy_init(x)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jaxsparse.sparsify(nnx.Sequential(nnx.Linear(32, 32, rngs=nnx.Rngs(0)), plain), jaxsparse.NM(2, 4))
    jaxsparse.compress(plain)
    jaxsparse.densify(plain)


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_a_none_rule_naming_an_embedding_is_no_unmatched_rule(api):
  """{"embed": None, ".*": NM(2, 4)} keeps the embedding dense, as documented, but warned that rule 'embed' matched
  no layer. A rule naming nothing still warns."""

  class NnxLM(nnx.Module):
    def __init__(self):
      self.embed = nnx.Embed(40, 32, rngs=nnx.Rngs(0))
      self.fc = nnx.Linear(32, 32, rngs=nnx.Rngs(1))

    def __call__(self, ids):
      return self.fc(self.embed(ids))

  class LinenLM(nn.Module):
    @nn.compact
    def __call__(self, ids):
      return nn.Dense(32, name="fc")(nn.Embed(40, 32, name="embed")(ids))

  ids = jnp.zeros((2, 3), jnp.int32)

  def run(rules):
    with warnings.catch_warnings(record=True) as rec:
      warnings.simplefilter("always")
      if api == "nnx":
        sparse, _ = jaxsparse.sparsify(NnxLM(), rules)
        kinds = type(sparse.embed).__name__, type(sparse.fc).__name__
      else:
        model = LinenLM()
        sparse, _, _ = jaxsparse.sparsify_linen(model, model.init(jax.random.key(0), ids), rules, ids)
        kinds = ("Embed" if "embed" not in sparse.layers else "sparse", type(sparse.layers[("fc",)].module).__name__)
    return kinds, [str(r.message) for r in rec if "matched no" in str(r.message)]

  kinds, warned = run({"embed": None, ".*": jaxsparse.NM(2, 4)})
  assert kinds[0] == "Embed" and not warned
  _, warned = run({"nothing_here": None, "embed": None, ".*": jaxsparse.NM(2, 4)})
  assert len(warned) == 1 and "'nothing_here'" in warned[0] and "'embed'" not in warned[0]


@pytest.mark.parametrize("spec", [jaxsparse.NM(2, 4), jaxsparse.Unstructured(0.5),
                                  jaxsparse.BlockSparse(density=0.5, block_shape=(4, 4))],
                         ids=["nm", "unstructured", "block"])
@pytest.mark.parametrize("scale", [1.0, 0.5, 2.0])
def test_sparsify_masks_must_be_boolean_for_every_structure(spec, scale):
  """NM and BlockSparse rules took float / int masks and read any nonzero as kept (0.5, 2), where Unstructured
  raised "mask must be a boolean array": one rule for all, naming the key."""
  layer = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
  kept = np.asarray(jaxsparse.nm_mask(layer.kernel[...], 2, 4)) if isinstance(spec, jaxsparse.NM) else (
      np.repeat(np.repeat(np.eye(2, dtype=bool), 4, 0), 4, 1))
  with pytest.raises(TypeError, match=r"masks\['fc\.kernel'\] must be a boolean array, got dtype float32"):
    jaxsparse.sparsify(nnx.Dict(fc=layer), spec, masks={"fc.kernel": kept.astype(np.float32) * scale})
  sparse, _ = jaxsparse.sparsify(nnx.Dict(fc=layer), spec, masks={"fc.kernel": kept})  # bool: taken
  x = jnp.ones((1, 8))
  np.testing.assert_allclose(np.asarray(sparse["fc"](x)), np.asarray(x @ (layer.kernel[...] * kept) + layer.bias[...]),
                             rtol=1e-5, atol=1e-5)


class _TwoDense(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(64)(x))  # Dense_0: (32, 64)
    return nn.Dense(32)(h)


@pytest.mark.parametrize("spec", UNSTRUCTURED_AND_BLOCK)
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_masks_of_another_density_than_the_rule_warn_and_say_so_in_the_report(spec, api):
  # The mask wins (its layer keeps exactly its weights): a gradual pruner's masks taken before end_step gave a layer
  # "block 16x16 25% kept" of density 1.0 with no word of it.
  rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
  want = spec.density if isinstance(spec, jaxsparse.BlockSparse) else 1 - spec.sparsity
  block = spec.block_shape if isinstance(spec, jaxsparse.BlockSparse) else (1, 1)
  grid = (32 // block[0], 64 // block[1])
  x = _normal(int(rng.integers(1 << 20)), (4, 32))

  def run(keep):  # a mask of `keep` random blocks (weights)
    flat = np.zeros(math.prod(grid), bool)
    flat[rng.permutation(flat.size)[:keep]] = True
    mask = np.kron(flat.reshape(grid), np.ones(block, bool))
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      if api == "nnx":
        model = nnx.Sequential(nnx.Linear(32, 64, rngs=nnx.Rngs(0)), nnx.Linear(64, 32, rngs=nnx.Rngs(1)))
        _, report = jaxsparse.sparsify(model, {"layers.0": spec}, masks={"layers.0.kernel": mask})
        path = "layers.0"
      else:
        variables = _TwoDense().init(jax.random.key(0), x)
        _, _, report = jaxsparse.sparsify_linen(_TwoDense(), variables, {"Dense_0": spec}, x,
                                                masks={"Dense_0.kernel": mask})
        path = "Dense_0"
    row = next(c for c in report.layers if c.path == path)
    said = [str(w.message) for w in caught if "masks= keep another fraction" in str(w.message)]
    return mask, row, said

  units = math.prod(grid)
  mask, row, said = run(round((want + 0.3) * units))  # a schedule stopped early, or a global ranking
  kept = mask.mean()
  assert abs(kept - want) > 0.2
  assert row.density == pytest.approx(kept)
  assert f"the given mask keeps {kept:.1%}" in row.note and f"where the rule keeps {want:.1%}" in row.note
  assert len(said) == 1 and f"{row.path}: the given mask keeps" in said[0]
  for keep in (round(want * units), round(want * units) + 1):  # the rule's count (a pruner given it), one more
    _, row, said = run(keep)
    assert said == [] and "the given mask" not in row.note


def test_masks_of_an_nm_rule_are_not_compared_to_a_fraction():
  # An N:M mask is checked group by group; a sparser one (1 of 4) is valid and not reported as another density.
  model = nnx.Sequential(nnx.Linear(32, 64, rngs=nnx.Rngs(0)))
  mask = np.zeros((32, 64), bool)
  mask[::4] = True  # 1:4
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _, report = jaxsparse.sparsify(model, jaxsparse.NM(2, 4), masks={"layers.0.kernel": mask})
  assert not [w for w in caught if "masks= keep another fraction" in str(w.message)]
  assert "the given mask" not in report.layers[0].note
