"""The pruners refuse the stored values of already N:M-compressed layers wherever they see them.

Regression (each test below failed before its fix): a ``CompressedNMLinear`` / ``CompressedNMEmbed`` keeps only the
kept values of its weight (``(K * n / m, N)``, the table transposed) in an ``nnx.Param`` named like the dense layer's.
``pruning.magnitude_masks(model, rules)`` raised for them, but wherever the pruners saw the parameters without the
layers they ranked and zeroed those values as a dense weight: 3 Adam steps of ``nnx.Optimizer(model,
wrap_optax(optax.adam(1e-3), magnitude_pruner({"embed": NM(2, 4), "fc": NM(2, 4)})))`` on a compressed 2:4 model
zeroed half of each layer's stored values (nonzero fraction 1.0 -> 0.5; the layers 1:4) and moved its outputs by up
to 0.5 (plain Adam: 0.013), silently; ``magnitude_pruner`` / ``set_pruner`` / ``rigl_pruner`` given
``nnx.state(model, nnx.Param)`` masked half of them (a gradual schedule from its first pruning step), as did
a Linen ``TrainState`` over a bridged ``nnx.bridge.ToLinen(CompressedNMLinear)``. Now each raises a ``ValueError``
naming the path, and the way out (prune the dense model, or map the path to None).
"""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state

import jaxsparse
from jaxsparse import pruning
from jaxsparse.layers import CompressedNMEmbed
from jaxsparse.layers import CompressedNMLinear
from jaxsparse.layers.linen import CompressedNMDense

NM = jaxsparse.NM(2, 4)
REFUSED = r"{path}: this {kind} is already N:M-compressed: .*Prune the dense model .*map this path to None\."
CASES = [({"embed": NM}, "embed.embedding", "CompressedNMEmbed"),
         ({"fc": jaxsparse.Unstructured(0.5)}, "fc.kernel", "CompressedNMLinear")]


class _Net(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(32, 16, rngs=rngs)
    self.fc = nnx.Linear(16, 8, rngs=rngs)

  def __call__(self, ids):
    return self.fc(self.embed(ids))


def _compressed(seed=0):
  """``_Net`` with its table and kernel 2:4-compressed, as ``compress(sparsify(...))`` makes it."""
  model = _Net(nnx.Rngs(seed))
  model.embed = CompressedNMEmbed.from_dense(model.embed, 2, 4)
  model.fc = CompressedNMLinear(jaxsparse.NMSparseMatrix.from_dense(model.fc.kernel[...], 2, 4), model.fc.bias[...])
  return model


def _values(model):
  return [np.asarray(model.embed.embedding[...]), np.asarray(model.fc.kernel[...])]


@pytest.mark.parametrize("make", [nnx.Optimizer, nnx.ModelAndOptimizer], ids=["Optimizer", "ModelAndOptimizer"])
@pytest.mark.parametrize(("rules", "path", "kind"), CASES, ids=["embed", "fc"])
def test_an_nnx_optimizer_refuses_to_prune_compressed_values(make, rules, path, kind):
  model = _compressed()
  before = _values(model)
  tx = pruning.wrap_optax(optax.adam(1e-3), pruning.magnitude_pruner(rules))
  with pytest.raises(ValueError, match=REFUSED.format(path=path, kind=kind)):
    make(model, tx, wrt=nnx.Param)
  assert all(np.array_equal(a, b) for a, b in zip(before, _values(model), strict=True))
  # Mapped to None (the way out the message gives), they are left alone.
  tx = pruning.wrap_optax(optax.adam(1e-3), pruning.magnitude_pruner({"embed": None, "fc": None, ".*": NM}))
  optimizer = make(model, tx, wrt=nnx.Param)
  assert all(m is None for m in jax.tree.leaves(pruning.get_masks(optimizer), is_leaf=lambda m: m is None))


@pytest.mark.parametrize(("rules", "path", "kind"), CASES, ids=["embed", "fc"])
def test_every_pruner_refuses_compressed_values_in_an_nnx_state(rules, path, kind):
  state, key = nnx.state(_compressed(), nnx.Param), jax.random.key(0)
  dst, unstructured = {"update_every": 2, "end_step": 4}, dict.fromkeys(rules, jaxsparse.Unstructured(0.5))
  gradual = pruning.gradual(begin_step=2, end_step=4, update_every=2)  # the first pruning step is 2: not at init
  for init in (lambda: pruning.magnitude_masks(state, rules),
               lambda: pruning.magnitude_pruner(rules).init(state, key),
               lambda: pruning.magnitude_pruner(rules, gradual).init(state, key),
               lambda: pruning.set_pruner(unstructured, **dst).init(state, key),
               lambda: pruning.rigl_pruner(unstructured, **dst).init(state, key)):
    with pytest.raises(ValueError, match=REFUSED.format(path=path, kind=kind) + "$"):
      init()
  # A stack of compressed layers (nnx.vmap) is refused too.
  @nnx.vmap(in_axes=0, out_axes=0)
  def stack(key):
    return CompressedNMLinear(jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(key, (16, 8)), 2, 4))

  stacked = nnx.state(stack(jax.random.split(key, 3)), nnx.Param)
  with pytest.raises(ValueError, match=REFUSED.format(path="kernel", kind="CompressedNMLinear")):
    pruning.magnitude_masks(stacked, NM, stacks={"kernel": 1})


def test_linen_variables_that_show_the_compressed_layers_are_refused():
  x = jnp.ones((2, 16))
  init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
  for layer in (CompressedNMDense(8), CompressedNMDense(8, kernel_init=init)):
    variables = layer.init(jax.random.key(0), x)  # the "sparsity" collection holds the positions beside the values
    for run in (pruning.magnitude_masks, lambda v, rules: pruning.magnitude_pruner(rules).init(v, jax.random.key(0))):
      with pytest.raises(ValueError, match=REFUSED.format(path=r"params\.kernel", kind="CompressedNMDense")):
        run(variables, {"params": NM})
  # nnx.bridge.ToLinen keeps the NNX layer's mark in its NNXMeta box: a TrainState over its params is refused.
  w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(jax.random.key(0), (16, 8)), 2, 4)
  bridged = nnx.bridge.ToLinen(CompressedNMLinear, args=(w,), skip_rng=True)
  variables = bridged.init(jax.random.key(0), x)
  np.testing.assert_allclose(bridged.apply(variables, x), CompressedNMLinear(w)(x), rtol=1e-6)
  tx = pruning.wrap_optax(optax.sgd(0.1), pruning.magnitude_pruner(NM))
  with pytest.raises(ValueError, match=REFUSED.format(path="kernel", kind="CompressedNMLinear")):
    train_state.TrainState.create(apply_fn=bridged.apply, params=variables["params"], tx=tx)


def test_the_mark_restores_across_checkpoints_and_densify_drops_it(tmp_path):
  """The mark is metadata, not in checkpoints (arrays only): a checkpoint of a layer without it (saved before the
  fix) restores into a new layer, abstract or not, which keeps it; densify gives plain, prunable params."""
  model, old = _compressed(1), _compressed(2)
  old.fc.kernel = nnx.Param(old.fc.kernel[...])  # a layer as built before the mark
  old.embed.embedding = nnx.Param(old.embed.embedding[...])
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.fspath(tmp_path / "old"), nnx.state(old))
  checkpointer.wait_until_finished()
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: _compressed(3)))
  restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "old", abstract))
  nnx.update(model, checkpointer.restore(tmp_path / "old", nnx.state(model)))
  for new in (restored, model):
    assert all(np.array_equal(a, b) for a, b in zip(_values(new), _values(old), strict=True))
    with pytest.raises(ValueError, match=REFUSED.format(path="fc.kernel", kind="CompressedNMLinear")):
      pruning.magnitude_masks(nnx.state(new, nnx.Param), {"fc": NM})
  dense = jaxsparse.densify(model)
  masks = pruning.magnitude_masks(nnx.state(dense, nnx.Param), {"embed": NM, "fc": NM})
  assert masks["fc"]["kernel"].shape == (16, 8) and masks["embed"]["embedding"].shape == (32, 16)
