"""``jaxsparse.sparsify`` / ``jaxsparse.densify`` of stacks of layers: an ``nnx.vmap`` stack of ``nnx.Linear`` layers
(kernel ``(L, K, N)``) run by ``nnx.scan`` (Flax's "scan over layers"), checked against the pruned dense stack.

Regression: ``sparsify`` refused every stacked kernel ("a stacked (scan-over-layers, nnx.vmap) layer? ... map this
path to None") and ``densify`` raised on a stack of sparse layers, so a dense scan stack pruned per layer
(``pruning.calibrated_prune``, ``magnitude_masks``) could not become a sparse stack. Each layer of the stack now
becomes its own sparse layer (ranked on its own weights), stacked as ``nnx.vmap`` builds a stack, and ``densify``
gives the dense stack back.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsparse
from jaxsparse import pruning
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import MaskedLinear
from jaxsparse.layers import NMLinear
from jaxsparse.layers import SparsityPattern

L, D, H = 3, 16, 32
SPECS = {
    "2:4": (jaxsparse.NM(2, 4), NMLinear),
    "unstructured 50%": (jaxsparse.Unstructured(sparsity=0.5), MaskedLinear),
    "block 8x8": (jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8)), BlockSparseLinear),
}
RULES = lambda spec: {r"blocks\..*": spec, ".*": None}


class Block(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(D, H, rngs=rngs)
    self.fc2 = nnx.Linear(H, D, rngs=rngs)

  def __call__(self, x):
    return x + self.fc2(jax.nn.gelu(self.fc1(x)))


class Scanned(nnx.Module):
  """The Flax NNX scan over layers: an ``nnx.vmap`` stack of blocks run by ``nnx.scan``."""

  def __init__(self, rngs, *, state_axes=False):
    self.state_axes = state_axes
    self.inp = nnx.Linear(D, D, rngs=rngs)

    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return Block(rngs)

    self.blocks = create(rngs)

  def __call__(self, x):
    # The guide's StateAxes: the sparsity patterns take the parameters' axis.
    axes = nnx.StateAxes({(nnx.Param, SparsityPattern): 0, ...: None}) if self.state_axes else 0

    @nnx.scan(in_axes=(nnx.Carry, axes), out_axes=nnx.Carry)
    def forward(h, block):
      return block(h)

    return forward(self.inp(x), self.blocks)


def _scanned(**kwargs):
  model = Scanned(nnx.Rngs(0), **kwargs)
  # Layers of different scales: ranking the stack as one matrix (not layer by layer) would show.
  scale = (4.0 ** np.arange(L)).reshape(L, 1, 1).astype(np.float32)
  model.blocks.fc1.kernel[...] = model.blocks.fc1.kernel[...] * scale / 4
  return model


def _x():
  return jax.random.normal(jax.random.key(1), (5, D))


def _masked_dense(model, masks):
  """The dense model with each kernel times its mask: the function the sparse model must compute."""
  dense = nnx.clone(model)
  for name in ("fc1", "fc2"):
    layer = getattr(dense.blocks, name)
    layer.kernel[...] = layer.kernel[...] * masks[f"blocks.{name}.kernel"]
  return dense


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("given_masks", [False, True], ids=["by magnitude", "masks given"])
def test_stack_becomes_the_stack_of_its_sparse_layers(name, given_masks):
  # Regression: ValueError "a stacked (scan-over-layers, nnx.vmap) layer? ... map this path to None" before.
  spec, cls = SPECS[name]
  model = _scanned()
  masks = _flat(pruning.magnitude_masks(model, RULES(spec)))  # per layer of the stack
  assert masks["blocks.fc1.kernel"].shape == (L, D, H)
  sparse, report = jaxsparse.sparsify(model, RULES(spec), masks=masks if given_masks else None)
  assert type(sparse.blocks.fc1) is cls and type(sparse.blocks.fc2) is cls and type(sparse.inp) is nnx.Linear
  assert type(model.blocks.fc1) is nnx.Linear  # a copy
  x = _x()
  want = _masked_dense(model, masks)(x)
  np.testing.assert_allclose(sparse(x), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(sparse, x), want, rtol=1e-5, atol=1e-5)
  # One report row per stack, naming its layers.
  rows = {r.path: r for r in report.layers}
  assert sorted(rows) == ["blocks.fc1", "blocks.fc2"]
  assert rows["blocks.fc1"].layer == f"{L} x Linear({D}->{H})" and rows["blocks.fc1"].replaced_by == cls.__name__
  assert rows["blocks.fc1"].density == pytest.approx(float(masks["blocks.fc1.kernel"].mean()))
  # densify: the dense stack back, pruned weights zero, the same function.
  dense = jaxsparse.densify(sparse)
  assert type(dense.blocks.fc1) is nnx.Linear and dense.blocks.fc1.kernel.shape == (L, D, H)
  np.testing.assert_array_equal(dense.blocks.fc1.kernel[...] != 0, masks["blocks.fc1.kernel"])
  np.testing.assert_allclose(dense(x), want, rtol=1e-5, atol=1e-5)


def _flat(masks):
  """``{"path.kernel": mask}`` of the masks ``pruning.magnitude_masks`` gives for a model (an ``nnx.State``)."""
  return {".".join(map(str, path)): np.array(v) for path, v in nnx.to_flat_state(masks) if v is not None}


def test_the_guides_state_axes_run_the_sparse_stack():
  spec, _ = SPECS["block 8x8"]
  model = _scanned(state_axes=True)
  sparse, _ = jaxsparse.sparsify(model, RULES(spec))
  dense = jaxsparse.densify(sparse)
  x = _x()
  np.testing.assert_allclose(sparse(x), dense(x), rtol=1e-5, atol=1e-5)
  assert jaxsparse.summary(sparse).layers[0].density == 0.5


def test_block_sparse_stack_with_unequal_counts_raises_naming_them():
  spec, _ = SPECS["block 8x8"]
  model = _scanned()
  masks = _flat(pruning.magnitude_masks(model, RULES(spec)))
  masks["blocks.fc2.kernel"][1] = True  # layer 1 keeps all 8 blocks, the others 4
  with pytest.raises(ValueError, match=r"blocks\.fc2: a block-sparse stack needs the same number of kept blocks in "
                                       r"every layer .* keep \[4, 8, 4\] of 8 blocks\. Prune every layer to the same"):
    jaxsparse.sparsify(model, RULES(spec), masks=masks)


def test_calibrated_prune_then_sparsify_a_scanned_model():
  # The workflow: prune the dense scan stack with calibration data, then make it sparse with those masks.
  model, x = _scanned(), _x()
  batches = [jax.random.normal(jax.random.key(10 + i), (32, D)) for i in range(2)]
  spec, _ = SPECS["2:4"]
  pruned, masks, _ = pruning.calibrated_prune(model, RULES(spec), batches, method="sparsegpt", progress=False)
  assert masks["blocks.fc1.kernel"].shape == (L, D, H)
  sparse, report = jaxsparse.sparsify(pruned, RULES(spec), masks=masks)
  assert type(sparse.blocks.fc1) is NMLinear and [r.density for r in report.layers] == [0.5, 0.5]
  np.testing.assert_allclose(sparse(x), pruned(x), rtol=1e-5, atol=1e-5)
  small = jaxsparse.compress(sparse)  # and on to inference
  np.testing.assert_allclose(small(x), pruned(x), rtol=1e-4, atol=1e-4)


def test_two_layer_axes_and_the_stack_as_the_model():
  @nnx.split_rngs(splits=6)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return nnx.Linear(D, H, rngs=rngs)

  stack = make(nnx.Rngs(3))
  stack.kernel.set_value(stack.kernel[...].reshape(2, 3, D, H))  # layers (2, 3)
  stack.bias.set_value(jax.random.normal(jax.random.key(4), (2, 3, H)))
  sparse, report = jaxsparse.sparsify(stack, jaxsparse.NM(2, 4))
  assert sparse.kernel.shape == (2, 3, D, H) and report.layers[0].layer == f"2x3 x Linear({D}->{H})"
  x = _x()
  call = nnx.vmap(nnx.vmap(lambda layer, x: layer(x), in_axes=(0, None)), in_axes=(0, None))
  w = np.asarray(stack.kernel[...])
  want = []
  for i in range(2):
    for j in range(3):
      kept = np.asarray(pruning.magnitude_layer(jnp.asarray(w[i, j]), jaxsparse.NM(2, 4)))
      want.append(x @ (w[i, j] * kept) + stack.bias[i, j])
  np.testing.assert_allclose(call(sparse, x).reshape(6, 5, H), np.stack(want), rtol=1e-5, atol=1e-5)
  dense = jaxsparse.densify(sparse)
  assert type(dense) is nnx.Linear and dense.kernel.shape == (2, 3, D, H)
  np.testing.assert_allclose(call(dense, x), call(sparse, x), rtol=1e-5, atol=1e-5)


def test_named_stack_keeps_its_partitioning_names():
  init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"), eager_sharding=False)
  bias_init = nnx.with_partitioning(nnx.initializers.zeros_init(), ("mlp",), eager_sharding=False)

  @nnx.split_rngs(splits=L)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def make(rngs):
    return nnx.Linear(D, H, kernel_init=init, bias_init=bias_init, rngs=rngs)

  stack = make(nnx.Rngs(0))
  assert stack.kernel.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")
  for spec, _ in SPECS.values():
    sparse, _ = jaxsparse.sparsify(stack, spec)
    assert sparse.bias.get_metadata()["out_sharding"] == ("layers", "mlp"), spec
    dense = jaxsparse.densify(sparse)
    assert dense.kernel.get_metadata()["out_sharding"] == ("layers", "embed", "mlp"), spec
    assert dense.bias.get_metadata()["out_sharding"] == ("layers", "mlp"), spec
  sparse, _ = jaxsparse.sparsify(stack, jaxsparse.NM(2, 4))
  assert sparse.kernel.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")


def test_abstract_stack_gives_the_abstract_sparse_stack():
  spec, _ = SPECS["block 8x8"]
  abstract = nnx.eval_shape(lambda: _scanned())
  sparse, report = jaxsparse.sparsify(abstract, RULES(spec))
  concrete, _ = jaxsparse.sparsify(_scanned(), RULES(spec))
  shapes = lambda m: jax.tree.map(lambda a: (a.shape, a.dtype), nnx.state(m))
  assert shapes(sparse) == shapes(concrete)
  assert [r.density for r in report.layers] == [0.5, 0.5]


def test_stacks_sparsify_does_not_take_raise_naming_them():
  spec = jaxsparse.NM(2, 4)

  @nnx.split_rngs(splits=L)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def convs(rngs):
    return nnx.Conv(D, D, (3,), rngs=rngs)

  with pytest.raises(ValueError, match=r"layers\.0: its kernel has shape \(3, 3, 16, 16\), a stack of \(3,\) "
                                       r"nnx\.Conv layers .* sparsify takes stacks of nnx\.Linear only"):
    jaxsparse.sparsify(nnx.Sequential(convs(nnx.Rngs(0))), spec)

  @nnx.split_rngs(splits=L)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def generals(rngs):
    return nnx.LinearGeneral(D, (2, 8), rngs=rngs)

  with pytest.raises(ValueError, match=r"a stack of \(3,\) nnx\.LinearGeneral layers"):
    jaxsparse.sparsify(nnx.Sequential(generals(nnx.Rngs(0))), spec)

  @nnx.split_rngs(splits=L)
  @nnx.vmap(in_axes=(0,), out_axes=1)  # the layer axis second: kernel (K, L, N)
  def second(rngs):
    return nnx.Linear(D, H, rngs=rngs)

  with pytest.raises(ValueError, match=r"layers\.0: its kernel has shape \(16, 3, 32\), not the \(16, 32\) .* "
                                       r"layer axes leading"):
    jaxsparse.sparsify(nnx.Sequential(second(nnx.Rngs(0))), spec)


def test_linen_scan_is_taken_too():
  # sparsify_linen refused nn.scan stacks; it now takes them as sparsify takes nnx.vmap stacks
  # (tests/test_sparsify_linen_scan.py).
  class Step(nn.Module):
    @nn.compact
    def __call__(self, c, _):
      return nn.Dense(D, name="fc")(c), None

  class LinenScanned(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.scan(Step, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)(name="scan")(x, None)[0]

  x = _x()
  variables = LinenScanned().init(jax.random.key(0), x)
  sparse, sparse_vars, report = jaxsparse.sparsify_linen(LinenScanned(), variables, jaxsparse.NM(2, 4), x)
  assert report.layers[0].layer == f"{L} x Dense(({D}, {D}))" and report.layers[0].replaced_by == "NMDense"
  module, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  np.testing.assert_allclose(sparse.apply(sparse_vars, x), module.apply(dense_vars, x), rtol=1e-5, atol=1e-5)
