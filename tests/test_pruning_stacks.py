"""The pruners on stacks of layers, Linen params kept boxed, and tied layers reached through an NNX optimizer.

Regressions (each test below failed before its fix):

* A stack of ``L`` layers (``nnx.vmap`` over split rngs, Linen ``nn.scan``) holds a kernel ``(L, K, N)``; the pruners
  ranked it as one parameter, so a layer-wise target was met by the stack as a whole (the layer of largest weights
  kept dense, the others emptied). Each layer now reaches its rule's target (unstructured, blocks, N:M; one-shot,
  the optax wrapper, SET / RigL), its mask that of the layer pruned alone.
* Linen params kept boxed (``nn.with_partitioning``) in a ``TrainState``: the rules matched nothing (a warning, no
  pruning). They are read through the boxes, and the results keep the boxes' names.
* A tied layer reached through an ``nnx.ModelAndOptimizer``: its two paths were two parameters (a rule conflict
  missed, the one array given two masks) and the optimizer's moments were pruned as if parameters.
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
from flax.training import train_state

import jaxsparse
from jaxsparse import pruning

L, K, N = 3, 16, 8
SPECS = [jaxsparse.Unstructured(sparsity=0.75), jaxsparse.BlockSparse(density=0.25, block_shape=(4, 4)),
         jaxsparse.NM(2, 4)]
SEED = int(np.random.SeedSequence().entropy % 2**31)  # fresh data each run; the failing seed is in the messages


def _stacked_kernel(rng, shape=(L, K, N)):
  """Random weights, layer ``i`` scaled by ``10 ** i``: a ranking across the stack would keep the last layer dense."""
  scale = (10.0 ** np.arange(shape[0])).reshape(-1, *(1,) * (len(shape) - 1))
  return rng.standard_normal(shape).astype(np.float32) * scale.astype(np.float32)


def _reference(w: np.ndarray, spec) -> np.ndarray:
  """One ``(K, N)`` layer's mask, in NumPy: its largest weights, blocks (Frobenius norm) or ``n`` of every ``m``."""
  a = np.abs(w.astype(np.float64))
  k, n = a.shape
  if isinstance(spec, jaxsparse.NM):
    g = a.reshape(k // spec.m, spec.m, n)
    ranks = np.argsort(np.argsort(-g, axis=1, kind="stable"), axis=1, kind="stable")
    return (ranks < spec.n).reshape(k, n)
  if isinstance(spec, jaxsparse.BlockSparse):
    bk, bn = spec.block_shape
    norms = np.sqrt((a**2).reshape(k // bk, bk, n // bn, bn).sum(axis=(1, 3)))
    keep = np.zeros(norms.size, bool)
    keep[np.argsort(-norms.reshape(-1), kind="stable")[: round(spec.density * norms.size)]] = True
    return np.repeat(np.repeat(keep.reshape(norms.shape), bk, 0), bn, 1)
  keep = np.zeros(a.size, bool)
  keep[np.argsort(-a.reshape(-1), kind="stable")[: a.size - round(spec.sparsity * a.size)]] = True
  return keep.reshape(k, n)


def _nnx_stack(make, layers=L):
  @nnx.split_rngs(splits=layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs):
    return make(rngs)

  return create(nnx.Rngs(0))


def _assert_per_layer(mask, kernel, spec):
  mask, kernel = np.asarray(mask), np.asarray(kernel)
  assert mask.shape == kernel.shape
  for i in range(kernel.shape[0]):
    np.testing.assert_array_equal(mask[i], _reference(kernel[i], spec), err_msg=f"layer {i}, {spec}, seed {SEED}")


# -------------------------------------------------------------------------------------------------
# 1. Stacks of layers.
# -------------------------------------------------------------------------------------------------


def test_magnitude_masks_prune_each_layer_of_an_nnx_stack():
  # Regression: before, layer 0 (the smallest weights) was emptied and layer 2 kept dense.
  rng = np.random.default_rng(SEED)
  stack = _nnx_stack(lambda rngs: nnx.Linear(K, N, rngs=rngs))
  stack.kernel[...] = jnp.asarray(_stacked_kernel(rng))
  _assert_per_layer(pruning.magnitude_masks(stack, SPECS[0])["kernel"], stack.kernel[...], SPECS[0])
  assert pruning.layer_stacks(stack) == {"kernel": 1}


@pytest.mark.slow
def test_magnitude_masks_of_stacked_parameters_every_structure():
  # Regression, each structure; and the same parameters without their model, which do not tell their stack: given
  # stacks=, or a warning naming the kernel.
  rng = np.random.default_rng(SEED + 6)
  stack = _nnx_stack(lambda rngs: nnx.Linear(K, N, rngs=rngs))
  stack.kernel[...] = jnp.asarray(_stacked_kernel(rng))
  params = nnx.state(stack, nnx.Param)
  for spec in SPECS:
    _assert_per_layer(pruning.magnitude_masks(stack, spec)["kernel"], stack.kernel[...], spec)
    _assert_per_layer(pruning.magnitude_masks(params, spec, stacks={"kernel": 1})["kernel"], stack.kernel[...], spec)
  with pytest.warns(UserWarning, match=r"kernel \(3, 16, 8\) beside a bias \(3, 8\).*looks like a stack"):
    pruning.magnitude_masks(params, SPECS[0])


@pytest.mark.slow
def test_wrap_optax_prunes_each_layer_of_an_nnx_stack():
  # Regression (the optax path): an nnx.Optimizer hands the pruner bare parameters; with layer_stacks of the model each
  # layer of a MaskedLinear stack (named kernel, its stack axis named by transform_metadata) reaches the target.
  rng = np.random.default_rng(SEED + 1)
  init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
  mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))

  @nnx.split_rngs(splits=L)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def create(rngs):
    return jaxsparse.layers.MaskedLinear(K, N, sparsity=0.5, kernel_init=init, rngs=rngs)

  with jax.set_mesh(mesh):
    stack = create(nnx.Rngs(0))
    kernel = _stacked_kernel(rng)
    stack.kernel[...] = jnp.asarray(kernel)
    spec = jaxsparse.Unstructured(sparsity=0.75)
    pruner = pruning.magnitude_pruner(spec, stacks=pruning.layer_stacks(stack))
    optimizer = nnx.Optimizer(stack, pruning.wrap_optax(optax.sgd(0.0), pruner), wrt=nnx.Param)
    optimizer.update(stack, jax.tree.map(jnp.zeros_like, nnx.state(stack, nnx.Param)))
  _assert_per_layer(pruning.get_masks(optimizer)["kernel"], kernel, spec)
  np.testing.assert_array_equal(np.asarray(stack.kernel[...]) != 0, _reference_stack(kernel, spec))


def _reference_stack(kernel, spec):
  return np.stack([_reference(k, spec) for k in kernel])


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: type(s).__name__)
def test_gradual_pruning_reaches_each_layers_target_in_a_stack(spec):
  # Regression: gradual magnitude pruning (N:M through 3:4 to 2:4) of a stack through wrap_optax, every layer at its
  # target at the end (no training: the masks are those of the weights), and each step's masks nested.
  rng = np.random.default_rng(SEED + 2)
  params = {"blocks": {"fc": {"kernel": jnp.asarray(_stacked_kernel(rng)), "bias": jnp.zeros((L, N))}}}
  schedule = pruning.gradual(begin_step=0, end_step=4, update_every=2)
  tx = pruning.wrap_optax(optax.sgd(0.0), pruning.magnitude_pruner(spec, schedule, stacks={"blocks.fc": 1}))
  state, kept = tx.init(params), []
  for _ in range(6):
    updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), state, params)
    params = optax.apply_updates(params, updates)
    kept.append(np.asarray(pruning.get_masks(state)["blocks"]["fc"]["kernel"]))
  assert all((later <= earlier).all() for earlier, later in itertools.pairwise(kept))
  masks = pruning.get_masks(state)["blocks"]["fc"]["kernel"]
  kernel = np.asarray(_stacked_kernel(np.random.default_rng(SEED + 2)))
  _assert_per_layer(masks, kernel, spec)


@pytest.mark.slow
@pytest.mark.parametrize("grow", ["set", "rigl"])
def test_dst_keeps_each_layers_count_in_a_stack(grow):
  # Regression: SET / RigL drew one random mask over the stack and moved units across its layers; each layer now
  # keeps its own count, and RigL grows each layer where its own gradient is largest.
  rng = np.random.default_rng(SEED + 3)
  spec = jaxsparse.BlockSparse(density=0.25, block_shape=(4, 4))
  make = pruning.set_pruner if grow == "set" else pruning.rigl_pruner
  tx = pruning.wrap_optax(optax.sgd(0.0), make(spec, update_every=1, end_step=10, drop_fraction=0.5,
                                               stacks={"w": 1}))
  params = params0 = {"w": jnp.asarray(_stacked_kernel(rng))}
  state = tx.init(params)
  blocks = lambda m: np.asarray(m).reshape(L, K // 4, 4, N // 4, 4).any(axis=(2, 4)).reshape(L, -1)
  first = blocks(pruning.get_masks(state)["w"])
  assert first.sum(axis=1).tolist() == [2] * L  # 2 of each layer's 8 blocks
  grads = jnp.asarray(rng.standard_normal((L, K, N)), jnp.float32)
  for _ in range(3):
    updates, state = tx.update({"w": grads}, state, params)
    params = optax.apply_updates(params, updates)
    now = blocks(pruning.get_masks(state)["w"])
    assert now.sum(axis=1).tolist() == [2] * L, (now.sum(axis=1), SEED)
  if grow == "rigl":  # grown where the gradient's block norms are largest among each layer's pruned blocks
    norms = np.sqrt((np.asarray(grads) ** 2).reshape(L, K // 4, 4, N // 4, 4).sum(axis=(2, 4))).reshape(L, -1)
    _, state = tx.update({"w": grads}, tx.init(params0), params0)
    grown = blocks(pruning.get_masks(state)["w"]) & ~first
    for i in range(L):
      best = np.argsort(-np.where(first[i], -np.inf, norms[i]), kind="stable")[: grown[i].sum()]
      assert set(np.flatnonzero(grown[i])) == set(best), (i, SEED)


@pytest.mark.slow
def test_stacks_of_other_layers_and_scopes():
  # New coverage: layer_stacks of jaxsparse's layers and of convs / LinearGeneral, a stacked LinearGeneral with its
  # view, global scope (every layer of the stack ranked together, by design), and bad stacks named in the errors.
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.conv = nnx.Conv(4, 8, (3,), rngs=rngs)
      self.qkv = nnx.LinearGeneral(K, (2, 4), use_bias=False, rngs=rngs)
      self.nm = jaxsparse.layers.NMLinear(K, N, n=2, m=4, rngs=rngs)
      self.blocks = jaxsparse.layers.BlockSparseLinear(K, N, density=0.5, block_shape=(4, 4), rngs=rngs)

  stack = _nnx_stack(Block)
  assert pruning.layer_stacks(stack) == {"blocks.kernel": 1, "conv.kernel": 1, "nm.kernel": 1, "qkv.kernel": 1}
  rng = np.random.default_rng(SEED + 4)
  kernel = _stacked_kernel(rng, (L, K, 2, 4))
  stack.qkv.kernel[...] = jnp.asarray(kernel)
  spec = jaxsparse.NM(2, 4)
  masks = pruning.magnitude_masks(stack, {"qkv": spec, ".*": None}, views={"qkv": 1})
  _assert_per_layer(np.asarray(masks["qkv"]["kernel"]).reshape(L, K, 8), kernel.reshape(L, K, 8), spec)
  spec = jaxsparse.Unstructured(sparsity=0.75)
  masks = pruning.magnitude_masks(stack, {"qkv": spec, ".*": None}, scope="global")
  flat = np.abs(kernel).reshape(-1)
  ref = np.zeros(flat.size, bool)
  ref[np.argsort(-flat, kind="stable")[: flat.size // 4]] = True
  np.testing.assert_array_equal(np.asarray(masks["qkv"]["kernel"]).reshape(-1), ref)  # the last layer keeps most
  with pytest.raises(ValueError, match=r"qkv.kernel: 3 leading layer axes \(stacks\) leave its \(3, 16, 2, 4\) "
                                       r"parameter fewer than 2 axes per layer; give it 0 to 2"):
    pruning.magnitude_masks(stack, {"qkv": spec, ".*": None}, stacks={"qkv": 3})
  with pytest.raises(TypeError, match=r"stacks\['qkv'\] must be an int >= 0.*got -1"):
    pruning.magnitude_pruner(spec, stacks={"qkv": -1})


# -------------------------------------------------------------------------------------------------
# 2. Linen params kept boxed (nn.Partitioned) in a TrainState; Linen stacks (nn.scan).
# -------------------------------------------------------------------------------------------------


class _Step(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    return nn.Dense(K, kernel_init=init, name="fc")(h), None


class _Stack(nn.Module):
  @nn.compact
  def __call__(self, x):
    scan = nn.scan(_Step, variable_axes={"params": 0}, split_rngs={"params": True}, length=L,
                   metadata_params={nn.PARTITION_NAME: "layers"})
    h = scan(name="s")(x, None)[0]
    return nn.Dense(N, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None)),
                    name="head")(h)


class _Boxed(nn.Module):
  @nn.compact
  def __call__(self, x):
    init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    return nn.Dense(N, kernel_init=init, name="fc")(x)


def test_wrap_optax_prunes_boxed_linen_params_of_a_train_state():
  # Regression: boxed params in a TrainState matched no rule (a warning, nothing pruned). The rules now match through
  # the boxes, and params and state masks keep the boxes' names.
  rng = np.random.default_rng(SEED + 5)
  x = jnp.asarray(rng.standard_normal((2, K)), jnp.float32)
  params = _Boxed().init(jax.random.key(0), x)["params"]
  kernel = np.asarray(params["fc"]["kernel"].unbox())
  spec = jaxsparse.Unstructured(sparsity=0.75)
  tx = pruning.wrap_optax(optax.sgd(1e-3), pruning.magnitude_pruner({"fc": spec}))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no "matched no parameter" warning
    state = train_state.TrainState.create(apply_fn=_Boxed().apply, params=params, tx=tx)
  state = state.apply_gradients(grads=jax.tree.map(jnp.ones_like, state.params))
  fc = state.params["fc"]["kernel"]
  assert isinstance(fc, nn.Partitioned) and fc.names == (None, "model")
  mask = np.asarray(pruning.get_masks(state)["fc"]["kernel"])
  np.testing.assert_array_equal(mask, _reference(kernel, spec))
  np.testing.assert_array_equal(np.asarray(fc.unbox()) != 0, mask)
  assert state.opt_state.masks["fc"]["kernel"].names == (None, "model")  # sharded like its kernel


@pytest.mark.slow
def test_wrap_optax_prunes_each_layer_of_a_boxed_linen_scan():
  # Regression (items 1 and 2 together): an nn.scan stack kept boxed in a TrainState, pruned per layer with the
  # stacks layer_stacks reads off the module; apply_masks of boxed params gives boxed params.
  rng = np.random.default_rng(SEED + 7)
  x = jnp.asarray(rng.standard_normal((2, K)), jnp.float32)
  variables = _Stack().init(jax.random.key(0), x)
  kernel = _stacked_kernel(rng, (L, K, K))
  params = jax.tree.map(lambda a: a, variables["params"])
  params["s"]["fc"]["kernel"] = params["s"]["fc"]["kernel"].replace_boxed(jnp.asarray(kernel))
  spec = jaxsparse.Unstructured(sparsity=0.75)
  stacks = pruning.layer_stacks(_Stack(), variables, x)
  assert stacks == {"s.fc.kernel": 1}
  tx = pruning.wrap_optax(optax.sgd(1e-3), pruning.magnitude_pruner({"s.fc": spec, "head": spec}, stacks=stacks))
  state = train_state.TrainState.create(apply_fn=_Stack().apply, params=params, tx=tx)
  grads = jax.grad(lambda p: jnp.sum(state.apply_fn({"params": p}, x) ** 2))(state.params)
  state = state.apply_gradients(grads=grads)
  fc = state.params["s"]["fc"]["kernel"]
  assert isinstance(fc, nn.Partitioned) and fc.names == ("layers", None, "model")
  masks = pruning.get_masks(state)
  _assert_per_layer(masks["s"]["fc"]["kernel"], kernel, spec)
  np.testing.assert_array_equal(np.asarray(masks["head"]["kernel"]),
                                _reference(np.asarray(params["head"]["kernel"].unbox()), spec))
  assert masks["s"]["fc"]["bias"] is None
  np.testing.assert_array_equal(np.asarray(fc.unbox()) != 0, np.asarray(masks["s"]["fc"]["kernel"]))
  assert state.opt_state.masks["s"]["fc"]["kernel"].names == ("layers", None, "model")
  pruned = pruning.apply_masks(params, masks)
  assert pruned["head"]["kernel"].names == ("model", None)
  np.testing.assert_array_equal(np.asarray(pruned["s"]["fc"]["kernel"].unbox()) != 0,
                                np.asarray(masks["s"]["fc"]["kernel"]))


# -------------------------------------------------------------------------------------------------
# 3. Tied layers through an NNX optimizer.
# -------------------------------------------------------------------------------------------------


class _Tied(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Linear(K, K, rngs=rngs)
    self.mid = nnx.Linear(K, K, rngs=rngs)
    self.head = self.embed  # tied


def test_ties_through_an_nnx_optimizer():
  # Regression: magnitude_masks of an nnx.ModelAndOptimizer flattened it as a pytree: the tied kernel came out at two
  # paths (two masks for one array; rules giving its paths different structures passed), and the optimizer's
  # moments (opt_state...mu / nu) were pruned as parameters. A plain nnx.Optimizer (no model) pruned its moments.
  model = _Tied(nnx.Rngs(SEED % 1000))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # ModelAndOptimizer is deprecated, still in use
    both = nnx.ModelAndOptimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  spec = jaxsparse.Unstructured(sparsity=0.5)
  with pytest.raises(ValueError, match=r"model.embed.kernel: one layer held at several paths \(tied\)"):
    pruning.magnitude_masks(both, {"model.embed": jaxsparse.NM(2, 4), "model.head": spec, ".*": None})
  masks = pruning.masks_to_dict(pruning.magnitude_masks(both, spec))
  assert sorted(masks) == ["model.embed.kernel", "model.mid.kernel"]
  np.testing.assert_array_equal(masks["model.embed.kernel"], _reference(np.asarray(model.embed.kernel[...]), spec))
  # A state that holds the optimizer's moments too: only the nnx.Param leaves are pruned.
  masks = pruning.masks_to_dict(pruning.magnitude_masks(nnx.state(both), spec))
  assert sorted(masks) == ["model.embed.kernel", "model.mid.kernel"]
  with pytest.raises(TypeError, match=r"params is an nnx.Optimizer, which holds no nnx.Param"):
    pruning.magnitude_masks(nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param), spec)
