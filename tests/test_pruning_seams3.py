"""Pruning seams: the pruners on models with masked layers they were not told of, and Wanda's ties.

Regressions (each failed before its fix):

* A pruner given the model itself (``pruner.init(model, key)``) ignored its ``MaskedLinear``'s own mask: SET drew
  139 of its 256 kept weights outside the layer's mask. Given the ``nnx.State`` that ``nnx.Optimizer`` hands
  ``wrap_optax`` (no masks), gradual magnitude pruning said nothing while ``get_masks`` reported a density of 1.0,
  then 0.566, for a layer that keeps 0.5; under ``nnx.jit`` SET said nothing either. Now the pruners read a model's
  masks themselves (``layer_masks=`` wins path by path) and, given parameters that mark a masked layer's kernel
  without its mask, warn once naming the kernel and ``layer_masks=``.
* Wanda broke equal scores by input index: the weights of features whose calibration inputs were always zero (all
  scoring 0) were kept lowest index first, whatever their ``|w|``, and permuting the features changed which were
  kept. Now equal scores go to the larger ``|w|`` (then the lower index).
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxsparse
from jaxsparse import pruning
from jaxsparse.layers import MaskedConv
from jaxsparse.layers import MaskedLinear

# 22 tests, about 80 s on 2 cores: run by test-slow (CI runs it), so that make test stays within its 15 minutes.
pytestmark = pytest.mark.slow

RULES = {r"layers\.0": jaxsparse.Unstructured(sparsity=0.75), r".*": None}
X = jax.random.normal(jax.random.key(11), (16, 32))
Y = jax.random.randint(jax.random.key(12), (16,), 0, 4)
MARK_WARNING = (r"layers\.0\.kernel \(MaskedLinear\): the pruner's rules prune these kernels of layers with a mask of "
                r"their own.*Pass layer_masks=pruning\.layer_masks\(model\) to the pruner")

PRUNERS = {
    "set": lambda **kw: pruning.set_pruner(RULES, update_every=1, end_step=10, drop_fraction=0.5, **kw),
    "rigl": lambda **kw: pruning.rigl_pruner(RULES, update_every=1, end_step=10, drop_fraction=0.5, **kw),
    "gradual": lambda **kw: pruning.magnitude_pruner(
        RULES, pruning.gradual(begin_step=0, end_step=4, update_every=1), **kw),
    "magnitude": lambda **kw: pruning.magnitude_pruner(RULES, **kw),
}


def _model(seed=3, sparsity=0.5):
  return nnx.Sequential(MaskedLinear(32, 32, sparsity=sparsity, rngs=nnx.Rngs(seed)), jax.nn.relu,
                        nnx.Linear(32, 4, rngs=nnx.Rngs(seed + 1)))


def _mark_warnings(record):
  return [w for w in record if issubclass(w.category, UserWarning) and "mask of their own" in str(w.message)]


# --- the pruners pick a model's own masks up --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["set", "rigl", "gradual", "magnitude"])
def test_pruner_init_given_the_model_keeps_inside_its_layers_masks(name):
  model = _model()
  own = np.asarray(model.layers[0].mask[...])
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the model tells its masks: nothing to warn about
    masks = PRUNERS[name]().init(model, jax.random.key(5))
  mask = np.asarray(masks["layers"][0]["kernel"])
  assert not (mask & ~own).any()
  # At step 0 gradual keeps everything the layer can carry; the others reach the rule's 256 kept weights.
  assert mask.sum() == (own.sum() if name == "gradual" else 256)
  assert masks["layers"][2]["kernel"] is None


def test_layer_masks_given_override_the_models_own_masks():
  model = _model()
  own = np.asarray(model.layers[0].mask[...])
  narrower = own & (np.random.default_rng(7).random(own.shape) < 0.6)  # about 300 weights, at least the rule's 256
  assert narrower.sum() >= 256
  for name in ("set", "magnitude"):
    masks = PRUNERS[name](layer_masks={"layers.0.kernel": narrower}).init(model, jax.random.key(1))
    mask = np.asarray(masks["layers"][0]["kernel"])
    assert mask.sum() == 256 and not (mask & ~narrower).any(), name


def test_magnitude_masks_of_a_state_warns_and_of_the_model_reads_the_masks():
  model = _model()
  own = np.asarray(model.layers[0].mask[...])
  rules = {r"layers\.0": jaxsparse.Unstructured(sparsity=0.25), r".*": None}  # looser than the layer's 0.5
  with pytest.warns(UserWarning, match=MARK_WARNING):
    masks = pruning.magnitude_masks(nnx.state(model, nnx.Param), rules)
  assert np.asarray(masks["layers"][0]["kernel"]).sum() == 768  # it cannot know better: 256 outside the layer
  with pytest.warns(UserWarning, match=r"its layer's mask keeps 512 of its 1024 weights"):  # the model: it knows
    masks = pruning.magnitude_masks(model, rules)
  mask = np.asarray(masks["layers"][0]["kernel"])
  np.testing.assert_array_equal(mask, own)


# --- through nnx.Optimizer: parameters only, the kernels marked -----------------------------------------------------


def _train(model, pruner, steps=4):
  optimizer = nnx.Optimizer(model, pruning.wrap_optax(optax.adamw(1e-2, weight_decay=0.1), pruner), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    grads = nnx.grad(lambda m: optax.softmax_cross_entropy_with_integer_labels(m(X), Y).mean())(model)
    optimizer.update(model, grads)

  seen = [np.asarray(pruning.get_masks(optimizer)["layers"][0]["kernel"])]
  for _ in range(steps):
    step(model, optimizer)
    seen.append(np.asarray(pruning.get_masks(optimizer)["layers"][0]["kernel"]))
  return optimizer, seen


@pytest.mark.parametrize("name", ["set", "rigl", "gradual", "magnitude"])
def test_nnx_optimizer_without_layer_masks_warns_once_naming_the_kernel(name):
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    _train(_model(), PRUNERS[name]())
  found = _mark_warnings(record)
  assert len(found) == 1, [str(w.message) for w in record]  # once, at init; not the zeros heuristic as well
  assert len(record) == 1, [str(w.message) for w in record]
  assert re.search(MARK_WARNING, str(found[0].message))
  assert found[0].filename == __file__  # attributed to the caller's line


def test_nnx_optimizer_built_under_jit_warns_too():
  model = _model()
  with pytest.warns(UserWarning, match=MARK_WARNING):
    nnx.jit(lambda m: nnx.Optimizer(m, pruning.wrap_optax(optax.sgd(0.1), PRUNERS["set"]()), wrt=nnx.Param))(model)


def test_masked_conv_kernels_are_named_too():
  # A given mask: MaskedConv(sparsity=...) first built takes 10+ s on a 2-core CPU (its random mask), here as before.
  mask = np.random.default_rng().permutation(3 * 3 * 4 * 8).reshape(3, 3, 4, 8) < 144
  model = nnx.Sequential(MaskedConv(4, 8, (3, 3), mask=mask, rngs=nnx.Rngs(2)))
  rules = jaxsparse.Unstructured(sparsity=0.75)
  with pytest.warns(UserWarning, match=r"layers\.0\.kernel \(MaskedConv\): the pruner's rules prune"):
    nnx.Optimizer(model, pruning.wrap_optax(optax.sgd(0.1), pruning.set_pruner(rules, update_every=1, end_step=4)),
                  wrt=nnx.Param)
  own = np.asarray(model.layers[0].mask[...])
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    optimizer = nnx.Optimizer(model, pruning.wrap_optax(optax.sgd(0.1), pruning.set_pruner(
        rules, update_every=1, end_step=4, layer_masks=pruning.layer_masks(model))), wrt=nnx.Param)
  mask = np.asarray(pruning.get_masks(optimizer)["layers"][0]["kernel"])
  assert not (mask & ~own).any() and mask.sum() == own.size // 4


@pytest.mark.parametrize("name", ["set", "rigl", "gradual"])
def test_with_layer_masks_reported_is_what_the_model_keeps_at_every_step(name):
  model = _model()
  own = np.asarray(model.layers[0].mask[...])
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # told: nothing to warn about
    _, seen = _train(model, PRUNERS[name](layer_masks=pruning.layer_masks(model)), steps=6)  # gradual: past its end
  for mask in seen:
    assert not (mask & ~own).any()
  kernel = np.asarray(model.layers[0].kernel[...])
  final = seen[-1]
  assert not kernel[~own].any()  # adamw's decay and momentum never wrote outside the layer's mask
  assert not kernel[~final].any()  # nor where the pruner prunes
  assert final.sum() == 256


def test_dense_models_and_bare_arrays_with_a_tighter_rule_say_nothing():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    dense = nnx.Sequential(nnx.Linear(32, 32, rngs=nnx.Rngs(0)))
    nnx.Optimizer(dense, pruning.wrap_optax(optax.sgd(0.1), PRUNERS["set"]()), wrt=nnx.Param)
    # Bare arrays carry no mark; a rule tighter than the layer keeps no zero there either.
    pruning.wrap_optax(optax.sgd(0.1), PRUNERS["magnitude"]()).init(nnx.as_pure(nnx.state(_model(), nnx.Param)))


# --- Wanda: equal scores go to the larger |w| ------------------------------------------------------------------------


ROWS16 = np.arange(16)


def _wanda_reference(w, sq_norms, kept_of_column):
  """Per output column: the ``kept`` weights of largest ``(|w| * norm, |w|)``, then lower index (a stable sort)."""
  a = np.abs(w).astype(np.float64)
  scores = a * np.sqrt(sq_norms.astype(np.float64))[:, None]
  out = np.zeros(w.shape, bool)
  for j in range(w.shape[1]):
    for rows, kept in kept_of_column(j):
      order = np.lexsort((rows, -a[rows, j], -scores[rows, j]))
      out[rows[order[:kept]], j] = True
  return out


def test_wanda_dead_features_keep_the_larger_weights_unstructured_and_2_4():
  # Features 0 and 1 never fired (norm 0); feature 3's weights are 0 (pruned before): those three score 0 in every
  # column, and the one place left among them goes to the larger |w| of the two dead features, wherever it sits.
  rng = np.random.default_rng()
  w = rng.normal(size=(4, 6)).astype(np.float32)
  w[3] = 0.0
  sq_norms = np.array([0.0, 0.0, rng.uniform(0.5, 2.0), rng.uniform(0.5, 2.0)], np.float32)
  larger = np.where(np.abs(w[0]) > np.abs(w[1]), 0, 1)
  for spec in (jaxsparse.Unstructured(sparsity=0.5), jaxsparse.NM(2, 4)):
    mask = np.asarray(pruning.wanda_layer(w, sq_norms, spec))
    assert mask[2].all() and not mask[3].any(), spec
    np.testing.assert_array_equal(mask[0], larger == 0, err_msg=str(spec))
    np.testing.assert_array_equal(mask[1], larger == 1, err_msg=str(spec))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_wanda_ties_match_a_stable_sort_on_score_then_magnitude(dtype):
  rng = np.random.default_rng()
  k, n = 16, 8
  with jax.enable_x64(dtype == np.float64):
    for _ in range(3):
      w = rng.normal(size=(k, n)).astype(dtype)
      sq_norms = rng.uniform(0.5, 2.0, k).astype(dtype)
      sq_norms[rng.choice(k, 10, replace=False)] = 0.0  # more dead features than either structure prunes
      got = np.asarray(pruning.wanda_layer(w, sq_norms, jaxsparse.Unstructured(sparsity=0.5)))
      np.testing.assert_array_equal(got, _wanda_reference(w, sq_norms, lambda j: [(ROWS16, 8)]))
      got = np.asarray(pruning.wanda_layer(w, sq_norms, jaxsparse.NM(2, 4)))
      np.testing.assert_array_equal(got, _wanda_reference(w, sq_norms, lambda j: [(ROWS16[g:g + 4], 2)
                                                                                   for g in range(0, k, 4)]))
      # One threshold over the layer: 64 kept of 128; the 80 dead weights all tie at 0 and fill the last places.
      got = np.asarray(pruning.wanda_layer(w, sq_norms, jaxsparse.Unstructured(sparsity=0.5), per_output=False))
      a = np.abs(w).astype(np.float64)
      flat = np.lexsort((np.arange(k * n), -a.reshape(-1), -(a * np.sqrt(sq_norms)[:, None]).reshape(-1)))
      want = np.zeros(k * n, bool)
      want[flat[:64]] = True
      np.testing.assert_array_equal(got, want.reshape(k, n))


def test_wanda_is_the_same_whatever_the_order_of_the_features():
  rng = np.random.default_rng()
  w = rng.normal(size=(16, 8)).astype(np.float32)
  sq_norms = rng.uniform(0.5, 2.0, 16).astype(np.float32)
  sq_norms[rng.choice(16, 10, replace=False)] = 0.0
  perm = rng.permutation(16)
  spec = jaxsparse.Unstructured(sparsity=0.5)
  mask = np.asarray(pruning.wanda_layer(w, sq_norms, spec))
  permuted = np.asarray(pruning.wanda_layer(w[perm], sq_norms[perm], spec))
  np.testing.assert_array_equal(permuted, mask[perm])


def test_wanda_blocks_of_dead_features_go_by_their_weights_norm():
  rng = np.random.default_rng()
  w = rng.normal(size=(12, 4)).astype(np.float32)
  w[8:] *= 3.0  # the last block of rows is the larger of the two dead ones
  sq_norms = np.concatenate([rng.uniform(0.5, 2.0, 4), np.zeros(8)]).astype(np.float32)
  mask = np.asarray(pruning.wanda_layer(w, sq_norms, jaxsparse.BlockSparse(density=2 / 3, block_shape=(4, 4))))
  assert mask[:4].all() and not mask[4:8].any() and mask[8:].all()


def test_wanda_pruning_of_a_model_prunes_dead_inputs_by_magnitude():
  model = nnx.Linear(8, 6, rngs=nnx.Rngs(4))
  kernel = np.asarray(model.kernel[...])
  rng = np.random.default_rng()
  x = rng.normal(size=(32, 8)).astype(np.float32)
  x[:, :6] = 0.0  # features 0..5 never fire: 2 of each output's 4 kept weights come from them, by |w|
  _, masks, _ = pruning.wanda(model, jaxsparse.Unstructured(sparsity=0.5), [jnp.asarray(x)], progress=False,
                              measure_error=False)
  mask = np.asarray(masks["kernel"])
  assert mask[6:].all()
  dead = np.abs(kernel[:6])
  np.testing.assert_array_equal(mask[:6], dead >= np.sort(dead, axis=0)[-2])
