"""Training workflows around ``pruning.wrap_optax``: optax combinators (chain, MultiSteps, inject_hyperparams,
apply_if_finite, masked / multi_transform, schedule-free), orbax checkpoints mid-training, SET / RigL under ``jit``
with donated state, gradient accumulation by hand, bfloat16 parameters and weight decay; NNX and Linen.

Each run is compared with a reference where one exists: the same optimizer without the wrapper, on gradients with
the masks applied, or an uninterrupted run."""

from __future__ import annotations

import functools
import itertools
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
from tests.test_pruning import _loss
from tests.test_pruning import _normal
from tests.test_pruning import _params

# ~50 s on 2 cores in all (one test 13-20 s): `make test-slow` runs them, keeping `make test` within its 15 minutes.
pytestmark = pytest.mark.slow

_XS = [_normal(100 + i, (4, 16)) for i in range(12)]


def _pruning_state(state):
  (found,) = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, pruning.PruningState))
              if isinstance(x, pruning.PruningState)]
  return found


def _train(tx, params, steps, *, grads_hook=None):
  """A raw optax loop under ``jit``; returns the parameters and the state after each step."""
  state = tx.init(params)

  @jax.jit
  def step(params, state, x, poison):
    grads = jax.grad(_loss)(params, x)
    grads = jax.tree.map(lambda g: jnp.where(poison, jnp.nan, g), grads)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  history = []
  for i in range(steps):
    poison = jnp.asarray(grads_hook is not None and grads_hook(i))
    params, state = step(params, state, _XS[i % len(_XS)], poison)
    history.append((params, state))
  return history


def _reference(opt, params, masks, steps, *, micro=1):
  """``opt`` without the wrapper on the mean of ``micro`` gradients with ``masks`` applied."""
  state = opt.init(params)
  for i in range(steps):
    grads = [jax.grad(_loss)(params, _XS[(i * micro + j) % len(_XS)]) for j in range(micro)]
    grads = pruning.apply_masks(jax.tree.map(lambda *g: sum(g) / micro, *grads), masks)
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


def _assert_close(a, b, atol=1e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=0, atol=atol)


def _assert_pruned_zero(params, masks):
  for path, mask in pruning.masks_to_dict(masks).items():
    leaf = params
    for key in path.split("."):
      leaf = leaf[key]
    assert not np.asarray(leaf, np.float32)[~mask].any(), path


_RULES = jaxsparse.Unstructured(sparsity=0.75)


def _sparse_start():
  """Parameters already pruned by one-shot magnitude masks, and the masks: with ``magnitude_pruner(_RULES)`` the
  wrapper keeps these masks, so a plain optimizer on masked gradients is its exact reference."""
  masks = pruning.magnitude_masks(_params(), _RULES)
  return pruning.apply_masks(_params(), masks), masks


# -------------------------------------------------------------------------------------------------
# optax combinators.
# -------------------------------------------------------------------------------------------------


def test_clipping_before_the_wrapper_clips_the_dense_gradient_inside_it_the_sparse_one():
  params, masks = _sparse_start()
  pruner = pruning.magnitude_pruner(_RULES)
  clip, adam = optax.clip_by_global_norm(0.05), optax.adam(1e-2)
  inside = _train(pruning.wrap_optax(optax.chain(clip, adam), pruner), params, 6)[-1][0]
  before = _train(optax.chain(clip, pruning.wrap_optax(adam, pruner)), params, 6)[-1][0]
  _assert_pruned_zero(inside, masks)
  _assert_pruned_zero(before, masks)
  _assert_close(inside, _reference(optax.chain(clip, adam), params, masks, 6))  # norm of the kept weights' gradient
  # Before the wrapper the norm counts the pruned weights' gradients too: the same kept weights as clipping the dense
  # gradient, then masking it.
  ref, state, clip_state = params, adam.init(params), clip.init(params)
  for i in range(6):
    grads, clip_state = clip.update(jax.grad(_loss)(ref, _XS[i]), clip_state)
    updates, state = adam.update(pruning.apply_masks(grads, masks), state, ref)
    ref = optax.apply_updates(ref, updates)
  _assert_close(before, ref)
  leaves = zip(jax.tree.leaves(inside), jax.tree.leaves(before), strict=True)
  assert max(float(jnp.abs(a - b).max()) for a, b in leaves) > 1e-4


def test_multisteps_around_the_wrapper_counts_optimizer_steps_inside_it_micro_steps():
  schedule = pruning.gradual(begin_step=0, end_step=6, update_every=2)
  pruner = pruning.magnitude_pruner(_RULES, schedule)
  k = 3
  history = _train(optax.MultiSteps(pruning.wrap_optax(optax.adam(1e-2), pruner), k), _params(), 8 * k)
  for micro, (params, state) in enumerate(history):
    count = int(_pruning_state(state).count)
    assert count == (micro + 1) // k  # the pruner's step is the optimizer step
    last_update = max(t for t in range(count) if schedule.is_update_step(t)) if count else None
    mask = np.asarray(pruning.get_masks(state)["fc2"]["kernel"])
    expected = 0 if last_update is None else int(np.floor(np.float32(schedule.sparsity(last_update, 0.75)) * 256 + .5))
    assert int((~mask).sum()) == expected, micro
    _assert_pruned_zero(params, pruning.get_masks(state))
  assert int((~mask).sum()) == 192
  # With fixed masks: the optimizer on the mean of k micro-batch gradients, masked.
  params, masks = _sparse_start()
  fixed = pruning.magnitude_pruner(_RULES)
  accumulated = _train(optax.MultiSteps(pruning.wrap_optax(optax.adam(1e-2), fixed), k), params, 4 * k)[-1][0]
  _assert_close(accumulated, _reference(optax.adam(1e-2), params, masks, 4, micro=k))
  # Inside the wrapper the schedule counts micro-steps (documented), the kept weights follow the same updates.
  history = _train(pruning.wrap_optax(optax.MultiSteps(optax.adam(1e-2), k).gradient_transformation(), pruner),
                   _params(), 3)
  assert int(history[-1][1].count) == 3 and int((~pruning.get_masks(history[-1][1])["fc2"]["kernel"]).sum()) > 0
  inner = _train(pruning.wrap_optax(optax.MultiSteps(optax.adam(1e-2), k).gradient_transformation(), fixed),
                 params, 4 * k)[-1][0]
  _assert_close(inner, accumulated)


def test_inject_hyperparams_learning_rate_change_mid_run_on_either_side_of_the_wrapper():
  params, masks = _sparse_start()
  pruner = pruning.magnitude_pruner(_RULES)
  def make_adam(learning_rate):  # b1, b2 stay Python floats, as in the wrapped run
    return optax.adam(learning_rate)

  runs = {
      "around": optax.inject_hyperparams(lambda learning_rate: pruning.wrap_optax(optax.adam(learning_rate), pruner))(
          learning_rate=1e-2),
      "inside": pruning.wrap_optax(optax.inject_hyperparams(make_adam)(learning_rate=1e-2), pruner),
      "reference": optax.inject_hyperparams(make_adam)(learning_rate=1e-2),
  }
  results = {}
  for name, tx in runs.items():
    p, state = params, tx.init(params)
    for i in range(6):
      if i == 3:
        hyper = state.inner_state.hyperparams if name == "inside" else state.hyperparams
        hyper["learning_rate"] = jnp.asarray(1e-3, jnp.float32)
      grads = jax.grad(_loss)(p, _XS[i])
      grads = pruning.apply_masks(grads, masks) if name == "reference" else grads
      updates, state = tx.update(grads, state, p)
      p = optax.apply_updates(p, updates)
    results[name] = p
  _assert_pruned_zero(results["around"], masks)
  _assert_close(results["around"], results["reference"])
  _assert_close(results["inside"], results["reference"])


def test_apply_if_finite_around_the_wrapper_skips_a_step_without_touching_masks_or_schedule():
  schedule = pruning.gradual(begin_step=0, end_step=6, update_every=2)
  pruner = pruning.magnitude_pruner(_RULES, schedule)
  skipped = {2, 3}  # step 2 is a mask-update step of the schedule
  history = _train(optax.apply_if_finite(pruning.wrap_optax(optax.adam(1e-2), pruner), 5), _params(), 8,
                   grads_hook=lambda i: i in skipped)
  clean = _train(pruning.wrap_optax(optax.adam(1e-2), pruner), _params(), 8)
  for i, (params, state) in enumerate(history):
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(params))
    if i in skipped:  # nothing moved: parameters, masks, the pruner's step
      _assert_close(params, history[1][0], atol=0)
      jax.tree.map(np.testing.assert_array_equal, pruning.get_masks(state), pruning.get_masks(history[1][1]))
    assert int(_pruning_state(state).count) == i + 1 - len([s for s in skipped if s <= i])
    _assert_pruned_zero(params, pruning.get_masks(state))
  # The skipped steps only delay the run: its last state is the clean run's two steps earlier, with those batches
  # shifted; the sparsity is the schedule's at the pruner's own step.
  final = pruning.get_masks(history[-1][1])
  assert int((~final["fc2"]["kernel"]).sum()) == int((~pruning.get_masks(clean[5][1])["fc2"]["kernel"]).sum())
  # Inside the wrapper, a skipped step still counts as a pruner step (documented).
  inside = _train(pruning.wrap_optax(optax.apply_if_finite(optax.adam(1e-2), 5), pruner), _params(), 4,
                  grads_hook=lambda i: i in skipped)
  assert int(inside[-1][1].count) == 4


def test_wrapper_around_multi_transform_with_a_frozen_group_resets_the_trained_groups_state():
  # Was: init raised "wrap_optax(reset_state=True) cannot find the per-parameter state of the inner optimizer" (the
  # MaskedNode of the frozen group in optax.multi_transform's state), and told the user to turn the reset off.
  labels = {"fc1": {"kernel": "train", "bias": "train"}, "fc2": {"kernel": "frozen", "bias": "frozen"}}
  inner = optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels)
  rules = {"fc1": _RULES}  # the rules, not the labels, say what is pruned: the frozen group has no rule
  tx = pruning.wrap_optax(inner, pruning.magnitude_pruner(rules, pruning.one_shot(step=2)))
  history = _train(tx, _params(), 5)
  params, state = history[-1]
  masks = pruning.get_masks(state)
  assert masks["fc2"]["kernel"] is None and float(masks["fc1"]["kernel"].mean()) == 0.25
  _assert_pruned_zero(params, masks)
  _assert_close(params["fc2"], _params()["fc2"], atol=0)  # frozen
  # The pruning step reset the trained group's moments at the weights it pruned (two dense steps had built them).
  mu = history[2][1].inner_state.inner_states["train"].inner_state[0].mu["fc1"]["kernel"]
  assert not np.asarray(mu)[~np.asarray(masks["fc1"]["kernel"])].any()
  assert np.asarray(mu)[np.asarray(masks["fc1"]["kernel"])].all()


@pytest.mark.skipif(not hasattr(optax.contrib, "muon"), reason="optax.contrib.muon is not in this optax")
def test_wrapper_around_muon_whose_state_is_a_multi_transform():
  # optax.contrib.muon trains 2-D weights with Muon and the rest with Adam, through optax.multi_transform: its state
  # holds MaskedNodes, and init failed as above.
  rigl = pruning.rigl_pruner(_RULES, update_every=1, end_step=10, drop_fraction=0.5)
  params, state = _train(pruning.wrap_optax(optax.contrib.muon(1e-2), rigl), _params(), 3)[-1]
  masks = pruning.get_masks(state)
  assert int(masks["fc1"]["kernel"].sum()) == 128 and int(masks["fc2"]["kernel"].sum()) == 64
  _assert_pruned_zero(params, masks)


def test_get_masks_inside_masked_or_multi_transform_are_none_outside_the_wrappers_group():
  # Was: get_masks gave optax.MaskedNode leaves for the other group, which apply_masks refused ("masks lack
  # fc2.bias, fc2.kernel ... pruning.get_masks / magnitude_masks give them so").
  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.fc1 = nnx.Linear(16, 32, rngs=rngs)
      self.fc2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
      return self.fc2(jax.nn.relu(self.fc1(x)))

  def train(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: "fc1" in jax.tree_util.keystr(path), params)

  pruner = pruning.magnitude_pruner(_RULES)
  wrapped = pruning.wrap_optax(optax.adam(1e-2), pruner)
  def frozen(params):
    return jax.tree.map(lambda t: not t, train(params))

  def labels(params):
    return jax.tree.map(lambda t: "train" if t else "frozen", train(params))

  x = _normal(3, (4, 16))
  for tx in (optax.chain(optax.masked(wrapped, train), optax.masked(optax.set_to_zero(), frozen)),
             optax.multi_transform({"train": wrapped, "frozen": optax.set_to_zero()}, labels)):
    model = MLP(nnx.Rngs(0))
    fc2 = np.asarray(model.fc2.kernel[...])
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    optimizer.update(model, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))
    masks = pruning.get_masks(optimizer)
    assert masks["fc2"]["kernel"] is None and masks["fc2"]["bias"] is None and masks["fc1"]["bias"] is None
    assert float(jnp.mean(model.fc1.kernel[...] == 0)) == 0.75
    np.testing.assert_array_equal(model.fc2.kernel[...], fc2)
    assert pruning.apply_masks(model, masks) is model
    sparse, _ = jaxsparse.sparsify(model, {"fc1": _RULES}, masks=masks)
    np.testing.assert_allclose(sparse(x), model(x), rtol=1e-5, atol=1e-6)


def test_get_masks_with_a_wrapper_in_each_group_names_the_alternative():
  labels = {"fc1": {"kernel": "a", "bias": "a"}, "fc2": {"kernel": "b", "bias": "b"}}
  pruner = pruning.magnitude_pruner(_RULES)
  tx = optax.multi_transform({"a": pruning.wrap_optax(optax.adam(1e-2), pruner),
                              "b": pruning.wrap_optax(optax.sgd(1e-2), pruner)}, labels)
  with pytest.raises(ValueError, match=r"found 2: one pruning\.wrap_optax in each group of an optax\.multi_transform.*"
                                       r"not supported\. Wrap the whole optimizer once instead"):
    pruning.get_masks(tx.init(_params()))
  # The alternative: one wrapper around the multi_transform, one pruner for both groups.
  tx = pruning.wrap_optax(optax.multi_transform({"a": optax.adam(1e-2), "b": optax.sgd(1e-2)}, labels), pruner)
  params, state = _train(tx, _params(), 2)[-1]
  _assert_pruned_zero(params, pruning.get_masks(state))


def test_lookahead_around_the_wrapper_is_refused_by_name():
  # Unsupported: the slow weights stay dense and replace the fast ones at each sync. get_masks said only that "a
  # transformation after wrap_optax changed its updates", which a lookahead user does not see in their code.
  tx = optax.lookahead(pruning.wrap_optax(optax.adam(1e-2), pruning.magnitude_pruner(_RULES)), sync_period=2,
                       slow_step_size=0.5)
  params = optax.LookaheadParams.init_synced(_params())
  state = tx.init(params)
  for x in _XS[:4]:
    updates, state = tx.update(jax.grad(_loss)(params.fast, x), state, params)
    params = optax.apply_updates(params, updates)
  with pytest.raises(ValueError, match=r"updates of pruning\.wrap_optax found weights that its masks prune not zero.*"
                                       r"such as optax\.lookahead, which is not supported"):
    pruning.get_masks(state)


def test_schedule_free_eval_params_stay_pruned():
  schedule_free = getattr(optax.contrib, "schedule_free_adamw", None)
  if schedule_free is None:
    pytest.skip("optax.contrib.schedule_free_adamw is not in this optax")
  pruner = pruning.magnitude_pruner(_RULES, pruning.gradual(begin_step=0, end_step=4, update_every=2))
  params, state = _train(pruning.wrap_optax(schedule_free(1e-2, warmup_steps=2), pruner), _params(), 6)[-1]
  masks = pruning.get_masks(state)
  _assert_pruned_zero(params, masks)
  # The evaluation weights (x, from the state's z) are pruned too: the reset zeroed z where the masks prune.
  _assert_pruned_zero(optax.contrib.schedule_free_eval_params(state.inner_state, params), masks)


# -------------------------------------------------------------------------------------------------
# Gradient accumulation by hand, bfloat16 parameters, weight decay.
# -------------------------------------------------------------------------------------------------


def test_scan_accumulation_bf16_params_float32_moments_and_adamw():
  masks = pruning.magnitude_masks(jax.tree.map(lambda a: a.astype(jnp.bfloat16), _params()), _RULES)
  params = pruning.apply_masks(jax.tree.map(lambda a: a.astype(jnp.bfloat16), _params()), masks)
  opt = optax.adamw(1e-2, weight_decay=0.5, mu_dtype=jnp.float32)
  tx = pruning.wrap_optax(opt, pruning.magnitude_pruner(_RULES))
  xs = jnp.stack(_XS[:8]).reshape(2, 4, 4, 16)  # 2 steps of 4 micro-batches

  @jax.jit
  def step(params, state, xs):
    def micro(acc, x):
      return jax.tree.map(jnp.add, acc, jax.grad(_loss)(params, x)), None

    grads, _ = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, params), xs)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  ref, ref_state = params, opt.init(params)
  for i in range(2):
    params, state = step(params, state, xs[i])
    grads = jax.tree.map(lambda *g: sum(g[1:], g[0]), *[jax.grad(_loss)(ref, x) for x in xs[i]])
    updates, ref_state = opt.update(pruning.apply_masks(grads, masks), ref_state, ref)
    ref = optax.apply_updates(ref, updates)
  assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  assert state.inner_state[0].mu["fc1"]["kernel"].dtype == jnp.float32
  _assert_pruned_zero(params, pruning.get_masks(state))  # weight decay never regrows a pruned weight
  jax.tree.map(np.testing.assert_array_equal, pruning.get_masks(state), masks)
  _assert_close(params, ref, atol=1e-2)  # bfloat16: a scan's sum and a Python sum round differently


# -------------------------------------------------------------------------------------------------
# Checkpoints mid-training and SET / RigL under jit with donated state.
# -------------------------------------------------------------------------------------------------


class _MLP(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(16, 32, rngs=rngs)
    self.fc2 = nnx.Linear(32, 4, rngs=rngs)

  def __call__(self, x):
    return self.fc2(jax.nn.relu(self.fc1(x)))


class _LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="fc2")(nn.relu(nn.Dense(32, name="fc1")(x)))


def _batch(i):
  rng = np.random.default_rng(i)
  return jnp.asarray(rng.standard_normal((8, 16)), jnp.float32), jnp.asarray(rng.integers(0, 4, 8))


def _tx(kind, seed=0):
  rules = {"fc1": jaxsparse.BlockSparse(density=0.25, block_shape=(8, 8)), "fc2": jaxsparse.Unstructured(0.75)}
  if kind == "gradual":
    pruner = pruning.magnitude_pruner(rules, pruning.gradual(begin_step=0, end_step=10, update_every=2))
  else:
    pruner = (pruning.rigl_pruner if kind == "rigl" else pruning.set_pruner)(
        rules, update_every=2, end_step=12, drop_fraction=0.5)
  inner = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1)
  return optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0), pruning.wrap_optax(inner, pruner, seed=seed)), 2)


def _save(path, tree):
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.fspath(path), tree)
  checkpointer.wait_until_finished()


@functools.partial(nnx.jit, donate_argnums=(0, 1))
def _nnx_step(model, optimizer, x, y):
  grads = nnx.grad(lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean())(model)
  optimizer.update(model, grads)


@pytest.mark.parametrize("kind", ["gradual", "rigl"])
def test_nnx_checkpoint_mid_training_resumes_bitwise(kind, tmp_path):
  # MultiSteps(2) around clipping and the wrapper around inject_hyperparams(adamw): the checkpoint falls mid
  # accumulation (7 micro-steps), after a learning-rate change, with the masks part way through their schedule.
  model = _MLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, _tx(kind), wrt=nnx.Param)
  for i in range(7):
    _nnx_step(model, optimizer, *_batch(i))
  _pruning_state(optimizer.opt_state).inner_state.hyperparams["learning_rate"][...] = 5e-3
  _save(tmp_path / "ckpt", nnx.state((model, optimizer)))
  saved_masks = jax.tree.map(np.array, pruning.get_masks(optimizer))  # copies: the next steps donate the state
  for i in range(7, 22):
    _nnx_step(model, optimizer, *_batch(i))

  def fresh():
    model = _MLP(nnx.Rngs(1))  # another init, seed 0 of the masks: the restore must overwrite all of it
    return model, nnx.Optimizer(model, _tx(kind), wrt=nnx.Param)

  graphdef, abstract = nnx.split(nnx.eval_shape(fresh))
  model2, optimizer2 = nnx.merge(graphdef, ocp.StandardCheckpointer().restore(tmp_path / "ckpt", abstract))
  state = _pruning_state(optimizer2.opt_state)
  assert int(state.count[...]) == 3 and int(optimizer2.opt_state.mini_step[...]) == 1
  assert float(state.inner_state.hyperparams["learning_rate"][...]) == np.float32(5e-3)
  jax.tree.map(np.testing.assert_array_equal, pruning.get_masks(optimizer2), saved_masks)
  for i in range(7, 22):
    _nnx_step(model2, optimizer2, *_batch(i))
  for a, b in zip(jax.tree.leaves(nnx.state((model, optimizer))), jax.tree.leaves(nnx.state((model2, optimizer2))),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  masks = pruning.get_masks(optimizer2)
  assert float(masks["fc1"]["kernel"].mean()) == 0.25 and int(masks["fc2"]["kernel"].sum()) == 32
  np.testing.assert_array_equal(np.asarray(model2.fc2.kernel[...])[~np.asarray(masks["fc2"]["kernel"])], 0.0)


def test_linen_train_state_checkpoint_and_dst_with_donated_state(tmp_path):
  module = _LinenMLP()

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, x, y):
    grads = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
        state.apply_fn({"params": p}, x), y).mean())(state.params)
    return state.apply_gradients(grads=grads)

  def create(kind, seed=0, init_seed=0):
    params = module.init(jax.random.key(init_seed), jnp.ones((1, 16)))["params"]
    return train_state.TrainState.create(apply_fn=module.apply, params=params, tx=_tx(kind, seed))

  for kind in ("rigl", "set"):
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("other_seed", 1)):
      state, history = create(kind, seed), []
      for i in range(24):
        state = step(state, *_batch(i))
        masks = pruning.get_masks(state)
        history.append(jax.tree.map(np.array, masks))
        assert int(masks["fc1"]["kernel"].sum()) == 128 and int(masks["fc2"]["kernel"].sum()) == 32
        if i:  # from the first optimizer step on (MultiSteps(2): the second micro-step)
          _assert_pruned_zero(state.params, masks)
        if name == "a" and i == 8:
          _save(tmp_path / kind, state)
      runs[name] = (state, history)
    (a, history), (b, _) = runs["a"], runs["b"]
    jax.tree.map(np.testing.assert_array_equal, a.params, b.params)  # reproducible from the seed
    assert any(not np.array_equal(m1["fc2"]["kernel"], m0["fc2"]["kernel"]) for m0, m1 in itertools.pairwise(history))
    assert not np.array_equal(pruning.get_masks(a)["fc2"]["kernel"],
                              pruning.get_masks(runs["other_seed"][0])["fc2"]["kernel"])
    # Restored into an abstract TrainState (another init), the run goes on as the uninterrupted one.
    abstract = jax.eval_shape(lambda kind=kind: create(kind, 0, init_seed=1))
    restored = ocp.StandardCheckpointer().restore(tmp_path / kind, abstract)
    assert isinstance(_pruning_state(restored.opt_state), pruning.PruningState)
    for i in range(9, 24):
      restored = step(restored, *_batch(i))
    jax.tree.map(np.testing.assert_array_equal, restored.params, a.params)
    jax.tree.map(np.testing.assert_array_equal, pruning.get_masks(restored), pruning.get_masks(a))
