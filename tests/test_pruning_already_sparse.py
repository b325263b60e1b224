"""The pruners on a model that is already sparse: they choose only weights its masked layers can carry.

Regression (each test below failed before its fix): an optimizer shows a pruner the parameters only, not a
``MaskedLinear``'s own mask. ``set_pruner`` drew its random mask and grew units outside that mask, on weights that can
never carry a value: target density 0.25 on a 50% ``MaskedLinear``, ``get_masks`` said 0.250 while the model kept
0.242 (``apply_masks`` narrowed the layer to 0.242). A rule looser than the layer (``magnitude_pruner`` at 25%
sparsity on the 50% layer) reported 0.75 while the model had 0.5. Now ``pruning.layer_masks(model)`` gives the
pruners (``layer_masks=``) the layers' masks: SET / RigL draw and grow inside them, magnitude pruning ranks inside
them, a looser rule keeps the layer's own weights and warns naming it, and where a pruner is not told the masks,
``wrap_optax`` warns when its first masks keep weights that are exactly zero.
"""

import itertools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxsparse
from jaxsparse import pruning
from jaxsparse.layers import MaskedLinear
from jaxsparse.layers.linen import MaskedDense

X = jax.random.normal(jax.random.key(1), (16, 32))
Y = jax.random.randint(jax.random.key(2), (16,), 0, 4)
RULES = {r"layers\.0": jaxsparse.Unstructured(sparsity=0.75), r".*": None}


def _model(sparsity=0.5, mask=None):
  first = (MaskedLinear(32, 32, sparsity=sparsity, rngs=nnx.Rngs(0)) if mask is None
           else MaskedLinear(32, 32, mask=mask, rngs=nnx.Rngs(0)))
  return nnx.Sequential(first, jax.nn.relu, nnx.Linear(32, 4, rngs=nnx.Rngs(1)))


def _train(model, pruner, steps=6):
  """``steps`` Adam steps of ``model`` under ``pruner``: the masks after init and after each step."""
  optimizer = nnx.Optimizer(model, pruning.wrap_optax(optax.adam(1e-2), pruner), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    grads = nnx.grad(lambda m: optax.softmax_cross_entropy_with_integer_labels(m(X), Y).mean())(model)
    optimizer.update(model, grads)

  seen = [np.asarray(pruning.get_masks(optimizer)["layers"][0]["kernel"])]
  for _ in range(steps):
    step(model, optimizer)
    seen.append(np.asarray(pruning.get_masks(optimizer)["layers"][0]["kernel"]))
  return optimizer, seen


@pytest.mark.parametrize("make", [pruning.set_pruner, pruning.rigl_pruner], ids=["set", "rigl"])
def test_dst_draws_and_grows_inside_the_layers_mask(make):
  model = _model()
  own = np.asarray(model.layers[0].mask[...])
  pruner = make(RULES, update_every=1, end_step=10, drop_fraction=0.5, layer_masks=pruning.layer_masks(model))
  optimizer, seen = _train(model, pruner)
  assert any((a != b).any() for a, b in itertools.pairwise(seen))  # units moved
  for mask in seen:  # reported = real, at the target, at every step
    assert mask.sum() == 256 and not (mask & ~own).any()
  pruning.apply_masks(model, pruning.get_masks(optimizer))
  assert model.layers[0].density == 0.25
  assert jaxsparse.summary(model).layers[0].density == 0.25


@pytest.mark.parametrize("make", [
    lambda lm: pruning.set_pruner({r"layers\.0": jaxsparse.Unstructured(0.25), r".*": None}, update_every=1,
                                  end_step=4, layer_masks=lm),
    lambda lm: pruning.magnitude_pruner({r"layers\.0": jaxsparse.Unstructured(0.25), r".*": None}, layer_masks=lm),
    lambda lm: pruning.magnitude_pruner({r"layers\.0": jaxsparse.Unstructured(0.25), r".*": None},
                                        pruning.gradual(begin_step=0, end_step=4, update_every=1), layer_masks=lm),
], ids=["set", "magnitude", "gradual"])
def test_a_rule_looser_than_the_layer_keeps_the_layer_and_warns(make):
  model = _model()
  own = np.asarray(model.layers[0].mask[...])
  with pytest.warns(UserWarning, match=r"layers\.0\.kernel: its layer's mask keeps 512 of its 1024 weights, the "
                                       r"rule \(unstructured 25%\) 768\. A pruner keeps no weight outside") as record:
    optimizer, seen = _train(model, make(pruning.layer_masks(model)), steps=4)
  assert sum("its layer's mask keeps" in str(w.message) for w in record) == 1  # once, at init
  np.testing.assert_array_equal(seen[-1], own)  # the real density, 0.5 (was 0.75)
  pruning.apply_masks(model, pruning.get_masks(optimizer))
  assert model.layers[0].density == 0.5


def test_without_layer_masks_wrap_optax_warns_where_the_first_masks_keep_zeros():
  model = _model()
  # The nnx.Optimizer's params mark the MaskedLinear's kernel: named exactly (tests/test_pruning_seams3.py).
  with pytest.warns(UserWarning, match=r"layers\.0\.kernel \(MaskedLinear\): the pruner's rules prune these kernels "
                                       r".*layer_masks=pruning\.layer_masks\(model\)"):
    nnx.Optimizer(model, pruning.wrap_optax(optax.sgd(0.1), pruning.set_pruner(RULES, update_every=1, end_step=4)),
                  wrt=nnx.Param)
  # Bare arrays do not: the first masks keeping zeros tell.
  with pytest.warns(UserWarning, match=r"layers\.0\.kernel \(\d+ of the 256 it keeps\): the pruner's first masks keep "
                                       r"weights that are exactly zero.*layer_masks=pruning\.layer_masks\(model\)"):
    pruning.wrap_optax(optax.sgd(0.1), pruning.set_pruner(RULES, update_every=1, end_step=4)).init(
        nnx.as_pure(nnx.state(_model(), nnx.Param)))
  with warnings.catch_warnings():  # a dense model, a tighter rule, or the layer's masks given: nothing to say
    warnings.simplefilter("error")
    for model, pruner in [
        (nnx.Sequential(nnx.Linear(32, 32, rngs=nnx.Rngs(0))), pruning.set_pruner(RULES, update_every=1, end_step=4)),
        (_model(), pruning.magnitude_pruner(RULES, layer_masks=pruning.layer_masks(_model()))),
        (_model(), pruning.set_pruner(RULES, update_every=1, end_step=4, layer_masks=pruning.layer_masks(_model()))),
    ]:
      nnx.Optimizer(model, pruning.wrap_optax(optax.sgd(0.1), pruner), wrt=nnx.Param)


@pytest.mark.parametrize("name", ["set", "rigl", "magnitude"])
def test_an_all_true_layer_mask_changes_nothing(name):
  """Dense models: the masks with a layer mask that keeps everything are those without one (bit for bit)."""
  def make(**kw):
    if name == "magnitude":
      return pruning.magnitude_pruner(RULES, pruning.gradual(begin_step=0, end_step=4, update_every=1), **kw)
    return getattr(pruning, f"{name}_pruner")(RULES, update_every=1, end_step=6, drop_fraction=0.5, **kw)

  dense = lambda: nnx.Sequential(nnx.Linear(32, 32, rngs=nnx.Rngs(0)), jax.nn.relu, nnx.Linear(32, 4, rngs=nnx.Rngs(1)))
  _, plain = _train(dense(), make())
  _, given = _train(dense(), make(layer_masks={"layers.0.kernel": np.ones((32, 32), bool)}))
  for a, b in zip(plain, given, strict=True):
    np.testing.assert_array_equal(a, b)
  assert any((a != b).any() for a, b in itertools.pairwise(plain))


def test_set_with_blocks_chooses_blocks_the_layer_keeps():
  grid = np.zeros((4, 4), bool)
  grid[:, :2] = True  # the layer keeps the left half, in 8x8 blocks
  model = _model(mask=np.repeat(np.repeat(grid, 8, 0), 8, 1))
  rules = {r"layers\.0": jaxsparse.BlockSparse(density=0.25, block_shape=(8, 8)), r".*": None}
  pruner = pruning.set_pruner(rules, update_every=1, end_step=10, drop_fraction=0.5,
                              layer_masks=pruning.layer_masks(model))
  _, seen = _train(model, pruner, steps=4)
  for mask in seen:
    blocks = mask[::8, ::8]
    assert blocks.sum() == 4 and not (blocks & ~grid).any()


def test_magnitude_masks_reads_an_nnx_models_own_masks_and_global_scope():
  model = nnx.Sequential(MaskedLinear(32, 32, sparsity=0.5, rngs=nnx.Rngs(0)),
                         MaskedLinear(32, 32, sparsity=0.875, rngs=nnx.Rngs(1)))
  own = [np.asarray(layer.mask[...]) for layer in model.layers]
  with pytest.warns(UserWarning, match=r"layers\.1\.kernel: its layer's mask keeps 128 of its 1024 weights, the rule "
                                       r"\(unstructured 75%\) 256"):
    masks = pruning.magnitude_masks(model, jaxsparse.Unstructured(0.75))
  np.testing.assert_array_equal(masks["layers"][1]["kernel"], own[1])  # was 256 kept, 128 of them zeros
  assert masks["layers"][0]["kernel"].sum() == 256 and not (masks["layers"][0]["kernel"] & ~own[0]).any()
  # scope="global": one count over both layers (512 of 2048), ranked inside the layers' masks
  state = nnx.state(model, nnx.Param)
  tx = pruning.wrap_optax(optax.sgd(0.0), pruning.magnitude_pruner(jaxsparse.Unstructured(0.75), scope="global",
                                                                    layer_masks=pruning.layer_masks(model)))
  got = pruning.get_masks(tx.init(state))
  kept = [np.asarray(got["layers"][i]["kernel"]) for i in (0, 1)]
  assert sum(k.sum() for k in kept) == 512 and not any((k & ~o).any() for k, o in zip(kept, own, strict=True))


def test_layer_masks_of_linen_variables():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4)(MaskedDense(32, sparsity=0.5)(x))

  variables = Net().init(jax.random.key(0), X)
  found = pruning.layer_masks(variables)
  assert list(found) == ["MaskedDense_0.kernel"]
  own = np.asarray(variables["sparsity"]["MaskedDense_0"]["mask"])
  np.testing.assert_array_equal(found["MaskedDense_0.kernel"], own)
  tx = pruning.wrap_optax(optax.sgd(0.1), pruning.set_pruner(
      {"MaskedDense_0": jaxsparse.Unstructured(0.75), ".*": None}, update_every=1, end_step=4, layer_masks=found))
  mask = np.asarray(pruning.get_masks(tx.init(variables["params"]))["MaskedDense_0"]["kernel"])
  assert mask.sum() == 256 and not (mask & ~own).any()


def test_bad_layer_masks_are_named():
  with pytest.raises(TypeError, match=r"layer_masks must be a mapping \{parameter path: bool mask\}"):
    pruning.set_pruner(RULES, update_every=1, end_step=4, layer_masks=[np.ones((32, 32), bool)])
  with pytest.raises(TypeError, match=r"layer_masks\['layers\.0\.kernel'\] must be a boolean array .*got dtype "
                                      r"float32"):
    pruning.magnitude_pruner(RULES, layer_masks={"layers.0.kernel": np.ones((32, 32), np.float32)})
  with pytest.raises(TypeError, match=r"model must be an NNX object"):
    pruning.layer_masks([1, 2])
  model = _model()
  tx = pruning.wrap_optax(optax.sgd(0.1), pruning.rigl_pruner(
      RULES, update_every=1, end_step=4, layer_masks={"layers.0.kernel": np.ones((32, 16), bool)}))
  with pytest.raises(ValueError, match=r"layers\.0\.kernel: layer_masks\['layers\.0\.kernel'\] has shape \(32, 16\), "
                                       r"the parameter \(32, 32\)"):
    nnx.Optimizer(model, tx, wrt=nnx.Param)
  tx = pruning.wrap_optax(optax.sgd(0.1), pruning.magnitude_pruner(
      RULES, layer_masks={"layers.9.kernel": np.ones((32, 32), bool)}))
  with pytest.warns(UserWarning, match=r"layer_masks names layers\.9\.kernel, which the parameters do not hold"):
    nnx.Optimizer(_model(), tx, wrt=nnx.Param)


def test_exact_zeros_of_a_dense_bf16_layer_do_not_warn():
  """A fresh bfloat16 nnx.Linear holds exact zeros (its initializer draws some); SET's random first masks keep a few
  and wrap_optax warned of layers with masks of their own, which the model does not have: an nnx.Optimizer's params
  mark those layers' kernels, so the zero heuristic is for bare params only."""
  model = nnx.Linear(32, 64, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  assert int((model.kernel[...] == 0).sum()) > 0  # the case: zeros from the initializer
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    nnx.Optimizer(model, pruning.wrap_optax(optax.adam(1e-2), pruning.set_pruner(
        jaxsparse.Unstructured(sparsity=0.5), update_every=2, end_step=8)), wrt=nnx.Param)
