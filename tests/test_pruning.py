"""Tests for jaxsparse.pruning: scores and masks, schedules, the optax wrapper, SET/RigL, NNX and Linen loops."""

import importlib.util
import itertools
import pathlib
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import jaxsparse
from jaxsparse import pruning
from jaxsparse.pruning._scores import rank_mask


def _normal(seed, shape, dtype=jnp.float32):
  # NumPy draws: no compilation per new shape, which keeps this file fast on 2 cores.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _params(seed=0):
  return {
      "fc1": {"kernel": _normal(seed, (16, 32)), "bias": _normal(seed + 1, (32,))},
      "fc2": {"kernel": _normal(seed + 2, (32, 8)), "bias": _normal(seed + 3, (8,))},
  }


def _expand(block_mask, block_shape):
  return np.repeat(np.repeat(np.asarray(block_mask), block_shape[0], 0), block_shape[1], 1)


# -------------------------------------------------------------------------------------------------
# Scores and masks.
# -------------------------------------------------------------------------------------------------


def test_magnitude_masks_layerwise_match_magnitude_mask():
  params = _params()
  masks = pruning.magnitude_masks(params, jaxsparse.Unstructured(sparsity=0.75))
  assert masks["fc1"]["bias"] is None and masks["fc2"]["bias"] is None
  for name in ("fc1", "fc2"):
    w = params[name]["kernel"]
    np.testing.assert_array_equal(masks[name]["kernel"], jaxsparse.magnitude_mask(w, 0.75))
    assert int(masks[name]["kernel"].sum()) == w.size // 4


def test_block_magnitude_masks_match_block_magnitude_mask():
  params = _params()
  masks = pruning.magnitude_masks(params, {"fc1": jaxsparse.BlockSparse(density=0.25, block_shape=(4, 8))})
  assert masks["fc2"]["kernel"] is None
  expected = _expand(jaxsparse.block_magnitude_mask(params["fc1"]["kernel"], (4, 8), 0.25), (4, 8))
  np.testing.assert_array_equal(masks["fc1"]["kernel"], expected)
  np.testing.assert_allclose(
      pruning.block_magnitude_scores(params["fc1"]["kernel"], (4, 8))[0, 0],
      np.linalg.norm(np.asarray(params["fc1"]["kernel"])[:4, :8]),
      rtol=1e-6,
  )


@pytest.mark.parametrize("shape,axis", [((16, 8), 0), ((3, 3, 8, 4), -2)])
def test_nm_masks_match_nm_mask(shape, axis):
  w = _normal(0, shape)
  masks = pruning.magnitude_masks({"w": w}, jaxsparse.NM(2, 4))
  np.testing.assert_array_equal(masks["w"], jaxsparse.nm_mask(w, 2, 4, axis=axis))


def test_global_threshold_is_one_threshold_over_layers():
  params = _params()
  params["fc2"]["kernel"] = params["fc2"]["kernel"] * 3.0  # a layer of larger weights keeps more of them
  masks = pruning.magnitude_masks(params, jaxsparse.Unstructured(sparsity=0.8), scope="global")
  ws = [np.abs(np.asarray(params[n]["kernel"])).ravel() for n in ("fc1", "fc2")]
  ms = [np.asarray(masks[n]["kernel"]).ravel() for n in ("fc1", "fc2")]
  w, m = np.concatenate(ws), np.concatenate(ms)
  assert m.sum() == w.size - round(0.8 * w.size)
  assert w[m].min() >= w[~m].max()
  assert ms[1].mean() > 2 * ms[0].mean()


def test_global_block_threshold():
  params = _params()
  rules = jaxsparse.BlockSparse(density=0.25, block_shape=(8, 8))
  masks = pruning.magnitude_masks(params, rules, scope="global")
  norms = np.concatenate([np.asarray(pruning.block_magnitude_scores(params[n]["kernel"], (8, 8))).ravel()
                          for n in ("fc1", "fc2")])
  kept = np.concatenate([np.asarray(masks[n]["kernel"])[::8, ::8].ravel() for n in ("fc1", "fc2")])
  assert kept.sum() == round(0.25 * kept.size)
  assert norms[kept].min() >= norms[~kept].max()


def test_custom_scores_replace_magnitude():
  params = {"w": _normal(0, (8, 8))}
  scores = {"w": -jnp.abs(params["w"])}  # keep the smallest weights instead
  masks = pruning.magnitude_masks(params, jaxsparse.Unstructured(sparsity=0.5), scores=scores)
  np.testing.assert_array_equal(masks["w"], ~jaxsparse.magnitude_mask(params["w"], 0.5))


def test_masks_of_nnx_module_follow_its_param_paths():
  model = nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.Linear(16, 4, rngs=nnx.Rngs(1)))
  masks = pruning.magnitude_masks(model, {r"layers\.0": jaxsparse.Unstructured(sparsity=0.5)})
  assert list(pruning.masks_to_dict(masks)) == ["layers.0.kernel"]


def test_scores_and_masks_must_have_their_parameters_shape():
  params = {"fc": {"kernel": _normal(0, (8, 4))}}
  score, rule = np.abs(np.asarray(params["fc"]["kernel"])), jaxsparse.Unstructured(sparsity=0.5)
  # A transposed score ((out, in), torch's layout) used to be reshaped silently into a wrong mask.
  with pytest.raises(ValueError, match=r"fc\.kernel: scores must have the parameter's shape; got scores of shape "
                     r"\(4, 8\) for a parameter of shape \(8, 4\) \(transposed\?"):
    pruning.magnitude_masks(params, rule, scores={"fc": {"kernel": score.T}})
  with pytest.raises(ValueError, match=r"fc\.kernel: scores must have the parameter's shape; .*\(4, 3\)"):
    pruning.magnitude_masks(params, rule, scores={"fc": {"kernel": np.ones((4, 3))}})
  with pytest.raises(ValueError, match=r"the same paths\): missing \['fc\.kernel'\], extra \['gc\.kernel'\]"):
    pruning.magnitude_masks(params, rule, scores={"gc": {"kernel": score}})
  # apply_masks used to broadcast a (1, 4) mask over the (8, 4) kernel.
  with pytest.raises(ValueError, match=r"fc\.kernel: the mask has shape \(1, 4\), the parameter \(8, 4\)"):
    pruning.apply_masks(params, {"fc": {"kernel": np.array([[False, True, True, True]])}})
  model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"kernel: the mask has shape \(4, 8\), the parameter \(8, 4\)"):
    pruning.apply_masks(model, {"kernel": np.ones((4, 8), bool), "bias": None})


def test_apply_masks_narrows_the_masks_of_masked_layers():
  """wrap_optax pruning a MaskedLinear further zeroed kernel weights that the layer's own mask, density and summary
  still counted as kept; apply_masks(model, get_masks(optimizer)) now makes the layer's mask follow."""
  old = np.random.default_rng(0).permutation(512).reshape(16, 32) < 128
  model = nnx.Sequential(jaxsparse.layers.MaskedLinear(16, 32, mask=old, rngs=nnx.Rngs(0)))
  layer = model.layers[0]
  tx = pruning.wrap_optax(optax.sgd(0.0), pruning.magnitude_pruner(jaxsparse.Unstructured(0.9)))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  optimizer.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param)))
  kept = float(np.mean(np.asarray(layer.kernel[...]) != 0))
  assert kept < 0.11 and layer.density == 0.25
  assert pruning.apply_masks(model, pruning.get_masks(optimizer)) is model
  mask = np.asarray(layer.mask[...])
  assert layer.density == kept and not (mask & ~old).any()  # only narrowed
  np.testing.assert_array_equal(mask, np.asarray(layer.kernel[...]) != 0)
  assert [row.density for row in jaxsparse.summary(model).layers] == [kept]


def test_apply_masks_refuses_masks_that_are_not_boolean():
  """A float mask (0.5) or an int one (2) was read by jnp.where as "kept" wherever it is nonzero, and a NumPy bool
  mask holding bytes other than 0 / 1 (a view of uint8 data) as False at byte 2: the weights came back silently
  other than the mask says."""
  params = {"fc": {"kernel": _normal(0, (4, 4)), "bias": _normal(1, (4,))}}
  model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
  for bad in (np.full((4, 4), 0.5, np.float32), 2 * np.eye(4, dtype=np.int32)):
    with pytest.raises(TypeError, match=rf"masks\['fc\.kernel'\] must be a boolean array, got dtype {bad.dtype}"):
      pruning.apply_masks(params, {"fc": {"kernel": bad, "bias": None}})
    with pytest.raises(TypeError, match=rf"masks\['kernel'\] must be a boolean array, got dtype {bad.dtype}"):
      pruning.apply_masks(model, {"kernel": bad, "bias": None})
  raw = np.random.default_rng(0).choice(np.array([0, 1, 2], np.uint8), size=(4, 4))
  out = pruning.apply_masks(params, {"fc": {"kernel": raw.view(bool), "bias": None}})
  expected = np.where(raw != 0, np.asarray(params["fc"]["kernel"]), 0.0)
  np.testing.assert_array_equal(np.asarray(out["fc"]["kernel"]), expected)


class _LinenPruned(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(32, name="fc")(x)
    h = nn.Conv(16, (3,), name="conv")(h[:, None, :].repeat(4, axis=1)).mean(axis=1)
    return nn.Dense(8, name="out")(h)


@pytest.mark.parametrize("keyed_like", ["params", "variables"])
def test_apply_masks_narrows_the_sparsity_masks_of_linen_variables(keyed_like):
  """wrap_optax pruning sparsify_linen's masked layers further changed only "params": the "sparsity" masks kept the
  denser pattern, which summary and the torch export reported, and apply_masks refused Linen variables ("a mask at
  'fc.kernel', where the parameters have none"). It now prunes the parameters and narrows those masks."""
  x = _normal(0, (2, 16))
  rules = {"fc|conv": jaxsparse.Unstructured(sparsity=0.5)}
  sparse, variables, _ = jaxsparse.sparsify_linen(_LinenPruned(), _LinenPruned().init(jax.random.key(0), x), rules, x)
  tx = pruning.wrap_optax(optax.sgd(0.0), pruning.magnitude_pruner({"fc|conv": jaxsparse.Unstructured(0.75)}))
  state = train_state.TrainState.create(apply_fn=sparse.apply, params=variables["params"], tx=tx)
  state = state.apply_gradients(grads=jax.tree.map(jnp.zeros_like, state.params))
  masks = pruning.get_masks(state)
  trained = {**variables, "params": state.params}
  out = pruning.apply_masks(trained, masks if keyed_like == "params" else {"params": masks})
  for path in ("fc", "conv"):
    kernel, mask = np.asarray(out["params"][path]["kernel"]), np.asarray(out["sparsity"][path]["mask"])
    old = np.asarray(variables["sparsity"][path]["mask"])
    assert mask.dtype == np.bool_ and not (mask & ~old).any()  # only narrowed
    np.testing.assert_array_equal(mask, np.asarray(masks[path]["kernel"]) & old)
    np.testing.assert_array_equal(mask, kernel != 0)
    assert mask.mean() == 0.25
  np.testing.assert_array_equal(out["params"]["out"]["kernel"], variables["params"]["out"]["kernel"])
  np.testing.assert_allclose(sparse.apply(out, x), sparse.apply(trained, x), rtol=1e-6, atol=1e-6)
  assert {row.path: row.density for row in jaxsparse.summary(out, module=sparse).layers} == {"conv": 0.25, "fc": 0.25}
  pytest.importorskip("torch")
  from jaxsparse import torch_interop  # noqa: PLC0415 -- optional dependency

  exported = torch_interop.export_masks(out, module=sparse)
  weights = torch_interop.export_state_dict(out, module=sparse)
  for path in ("fc", "conv"):
    mask = exported[f"{path}.weight_mask"].numpy()
    assert mask.mean() == 0.25
    np.testing.assert_array_equal(mask, weights[f"{path}.weight"].numpy() != 0)


def _block_kernel_mask(seed, nnz, emptied, block_shape=(8, 8)):
  """A random kernel mask ``(nnz, bk, bn)`` of a block-sparse layer: about 70% of each block kept, except the
  ``emptied`` blocks, pruned entirely; every other block keeps some weights and prunes some."""
  mask = np.array(jax.random.bernoulli(jax.random.key(seed), 0.7, (nnz, *block_shape)))
  mask[:, 0, 0], mask[:, 0, 1] = True, False
  mask[list(emptied)] = False
  return mask


class _LinenBlockNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jaxsparse.layers.linen.BlockSparseDense(32, density=0.5, block_shape=(8, 8), name="fc")(x)


class _BridgedBlockNet(nn.Module):  # an NNX BlockSparseLinear in Linen: its index arrays under "sparsity/fc/pattern"
  @nn.compact
  def __call__(self, x):
    return nnx.bridge.ToLinen(jaxsparse.layers.BlockSparseLinear, args=(32, 32),
                              kwargs={"density": 0.5, "block_shape": (8, 8)}, name="fc")(x)


def _block_sparse_target(framework, x):
  """``apply(mask)`` of a model with one 32x32 block-sparse layer (8 of its 16 8x8 blocks kept): ``(kernel, pattern,
  bias, model_output)`` after ``pruning.apply_masks`` with ``mask`` on that layer's kernel."""
  if framework == "nnx":
    model = nnx.Sequential(jaxsparse.layers.BlockSparseLinear(32, 32, density=0.5, block_shape=(8, 8),
                                                              rngs=nnx.Rngs(1)))
    masks = {"layers": {0: {"kernel": None, "bias": None}}}  # the pruners refuse kept blocks: masks made by hand

    def apply(mask):
      masks["layers"][0]["kernel"] = mask
      target = pruning.apply_masks(nnx.clone(model), masks)
      layer = target.layers[0]
      return layer.kernel[...], {k: v[...] for k, v in layer.pattern.items()}, layer.bias[...], target(x)

    return apply
  model = _LinenBlockNet() if framework == "linen" else _BridgedBlockNet()
  variables = model.init(jax.random.key(1), x)

  def apply(mask):
    out = pruning.apply_masks(variables, {"fc": {"kernel": mask, "bias": None}})
    pattern = out["sparsity"]["fc"] if framework == "linen" else out["sparsity"]["fc"]["pattern"]
    kernel = nn.meta.unbox(out["params"]["fc"]["kernel"])  # bridged: in the NNXMeta box of its BLOCK_VALUES mark
    return kernel, pattern, out["params"]["fc"]["bias"], model.apply(out, x)

  return apply


@pytest.mark.parametrize("framework", ["nnx", "linen", "bridged"])
def test_apply_masks_on_block_sparse_layers_warns_of_the_blocks_it_empties(framework):
  """apply_masks zeroed a block-sparse layer's weights and left its pattern as it was, silently: blocks the masks
  prune entirely still counted as kept in its density, summary and products. Its kept blocks are static (the
  kernel's shape follows them), so it keeps them, as zero blocks, and now warns, naming the layer and how to rebuild
  it without them; blocks pruned in part stay kept, holding the zeroed weights, without a warning. "bridged": the
  Linen variables of nnx.bridge.ToLinen(BlockSparseLinear), whose index arrays are one level down ("pattern"), got
  no warning at all (the layer was not found)."""
  x = _normal(0, (3, 32))
  apply = _block_sparse_target(framework, x)
  kernel, pattern, bias, _ = apply(np.ones((8, 8, 8), bool))
  partial = _block_kernel_mask(2, 8, emptied=())
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # blocks pruned in part: no warning
    got, got_pattern, _, _ = apply(partial)
  np.testing.assert_array_equal(got, np.where(partial, kernel, 0))
  jax.tree.map(np.testing.assert_array_equal, got_pattern, pattern)

  emptying = _block_kernel_mask(3, 8, emptied=(1, 6))
  nnx_fix = r"BlockSparseLinear\.from_dense\(layer\.to_dense\(\), density=6/16, block_shape=\(8, 8\)\)"
  linen_fix = r"BlockSparseDense\(\.\.\., density=6/16\)"
  where, fix = ("layers.0", nnx_fix) if framework == "nnx" else ("fc", linen_fix)
  with pytest.warns(UserWarning, match=rf"the masks zero 2 of the 8 kept 8x8 blocks of the .* at '{where}' entirely"
                    rf"\. .*still count them.* {fix}"):
    got, got_pattern, _, y = apply(emptying)
  np.testing.assert_array_equal(got, np.where(emptying, kernel, 0))
  jax.tree.map(np.testing.assert_array_equal, got_pattern, pattern)  # static: kept as it was
  # The outputs are the pruned function; the rebuild the warning names keeps the 6 blocks left and computes it too.
  w = jaxsparse.BlockSparseMatrix.from_index_arrays(got, got_pattern, shape=(32, 32), block_shape=(8, 8)).to_dense()
  np.testing.assert_allclose(y, x @ w + bias, rtol=1e-5, atol=1e-5)
  if framework == "nnx":
    dense = nnx.Linear(32, 32, rngs=nnx.Rngs(0))
    dense.kernel[...], dense.bias[...] = w, bias
    rebuilt = jaxsparse.layers.BlockSparseLinear.from_dense(dense, density=6 / 16, block_shape=(8, 8))
    assert rebuilt.nnz_blocks == 6
    y_rebuilt = rebuilt(x)
  else:
    blocks = jaxsparse.BlockSparseMatrix.from_dense(w, (8, 8))
    assert blocks.nnz_blocks == 6
    y_rebuilt = jaxsparse.layers.linen.BlockSparseDense(32, density=6 / 16, block_shape=(8, 8)).apply(
        {"params": {"kernel": blocks.data, "bias": bias}, "sparsity": blocks.index_arrays()}, x)
  np.testing.assert_allclose(y_rebuilt, y, rtol=1e-5, atol=1e-5)


class _EmbedNet(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(16, 8, rngs=rngs)
    self.pos = nnx.Param(jax.random.normal(rngs.params(), (5, 8)))
    self.fc = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, ids):
    return self.fc(self.embed(ids) + self.pos[...])


def test_catch_all_rule_passes_embeddings_and_other_params_by_as_sparsify_does():
  model, ids = _EmbedNet(nnx.Rngs(0)), jnp.arange(10).reshape(2, 5)
  rules = {r".*": jaxsparse.Unstructured(sparsity=0.5)}
  tx = pruning.wrap_optax(optax.sgd(1e-2), pruning.magnitude_pruner(rules))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  optimizer.update(model, nnx.grad(lambda m: jnp.mean(m(ids) ** 2))(model))
  masks = pruning.get_masks(optimizer)
  assert list(pruning.masks_to_dict(masks)) == ["fc.kernel"]  # used to mask embed.embedding and pos too
  sparse, _ = jaxsparse.sparsify(model, rules, masks=masks)  # used to refuse the embed.embedding and pos masks
  assert isinstance(sparse.fc, jaxsparse.layers.MaskedLinear) and isinstance(sparse.embed, nnx.Embed)
  np.testing.assert_allclose(sparse(ids), model(ids), rtol=1e-6, atol=1e-6)
  # A rule naming a non-kernel parameter still prunes it; so does any rule when the tree holds no kernel.
  named = pruning.magnitude_masks(model, {"embed|pos": jaxsparse.Unstructured(sparsity=0.5), ".*": None})
  assert sorted(pruning.masks_to_dict(named)) == ["embed.embedding", "pos"]
  raw = pruning.magnitude_masks({"w": _normal(0, (8, 8)), "pos": _normal(1, (5, 8))}, jaxsparse.Unstructured(0.5))
  assert sorted(pruning.masks_to_dict(raw)) == ["pos", "w"]


def test_nm_pruned_embedding_has_the_groups_sparsify_keeps():
  """An NM rule naming an embedding pruned n of every m table *rows* (the groups of a kernel's input axis), so
  sparsify refused the pruner's mask ("the given mask is not 2:4 along the features") and a vocabulary that m does
  not divide raised; now the groups run along the features, as sparsify's CompressedNMEmbed keeps them (NNX and
  Linen tables alike: both are leaves named embedding)."""
  model, ids = _EmbedNet(nnx.Rngs(0)), jnp.arange(10).reshape(2, 5)
  model.embed = nnx.Embed(18, 8, rngs=nnx.Rngs(1))  # 18 rows: no 2:4 groups along the vocabulary
  rules = {"embed": jaxsparse.NM(2, 4), "fc": jaxsparse.NM(2, 4)}
  tx = pruning.wrap_optax(optax.sgd(1e-2), pruning.magnitude_pruner(rules))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  optimizer.update(model, nnx.grad(lambda m: jnp.mean(m(ids) ** 2))(model))
  masks = pruning.get_masks(optimizer)
  table_mask = pruning.masks_to_dict(masks)["embed.embedding"]
  np.testing.assert_array_equal(table_mask, jaxsparse.nm_mask(model.embed.embedding[...], 2, 4, axis=1))
  sparse, report = jaxsparse.sparsify(model, rules, masks=masks)
  assert isinstance(sparse.embed, jaxsparse.layers.CompressedNMEmbed) and report.layers[0].density == 0.5
  np.testing.assert_allclose(sparse(ids), model(ids), rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match=r"embed.embedding: N:M sparsity 2:3 needs m=3 to divide the features 8 of "
                     r"its \(18, 8\) embedding table"):
    pruning.magnitude_masks(model, {"embed": jaxsparse.NM(2, 3)})


def test_rules_on_already_compressed_layers_raise():
  """A rule naming a CompressedNMEmbed (or CompressedNMLinear) of a model pruned its stored values as if they were the
  dense table: the (4, 16) kept values of a 2:4 table taken as a 16-feature table, 2 of every 4 "features" (ids)
  kept, so {"embed": NM(2, 4)} on the model sparsify made halved what it keeps, silently. Now it raises naming the
  layer; catch-all rules pass the table by, as before."""
  model = _EmbedNet(nnx.Rngs(0))
  sparse, _ = jaxsparse.sparsify(model, {"embed": jaxsparse.NM(2, 4), "fc": jaxsparse.NM(2, 4)})
  small = jaxsparse.compress(sparse)
  for rules, path, kind in (({"embed": jaxsparse.NM(2, 4)}, "embed.embedding", "CompressedNMEmbed"),
                            ({"embed": jaxsparse.Unstructured(0.5)}, "embed.embedding", "CompressedNMEmbed"),
                            (jaxsparse.NM(2, 4), "fc.kernel", "CompressedNMLinear")):
    with pytest.raises(ValueError, match=rf"{path}: this {kind} is already N:M-compressed: .*map this path to None"):
      pruning.magnitude_masks(small, rules)
  masks = pruning.magnitude_masks(small, {"embed": None, "fc": None, ".*": jaxsparse.NM(2, 4)})
  assert all(m is None for m in jax.tree.leaves(masks, is_leaf=lambda m: m is None))


def test_global_block_pruning_keeps_a_block_in_every_layer():
  params = _params()
  params["fc1"]["kernel"] = params["fc1"]["kernel"] * 10.0  # every fc1 block outscores every fc2 block
  rule = jaxsparse.BlockSparse(density=0.25, block_shape=(8, 8))  # 3 of the 8 + 4 blocks
  masks = pruning.magnitude_masks(params, rule, scope="global")
  norms = {n: np.asarray(pruning.block_magnitude_scores(params[n]["kernel"], (8, 8))).ravel() for n in ("fc1", "fc2")}
  kept = {n: np.asarray(masks[n]["kernel"])[::8, ::8].ravel() for n in ("fc1", "fc2")}
  assert int(kept["fc1"].sum()) == 2 and int(kept["fc2"].sum()) == 1  # fc2 used to keep no block
  assert kept["fc2"][np.argmax(norms["fc2"])] and norms["fc1"][kept["fc1"]].min() >= norms["fc1"][~kept["fc1"]].max()
  # Gradual pruning in the optimizer keeps one too, and sparsify builds the layers from its masks.
  pruner = pruning.magnitude_pruner(rule, pruning.gradual(begin_step=0, end_step=4, update_every=2), scope="global")
  history = _run(pruning.wrap_optax(optax.sgd(1e-3), pruner), params, 5)
  assert all(int(pruning.get_masks(state)["fc2"]["kernel"].sum()) >= 64 for _, state in history)
  params, state = history[-1]
  final = pruning.get_masks(state)
  assert int(final["fc1"]["kernel"].sum()) + int(final["fc2"]["kernel"].sum()) == 3 * 64
  model = nnx.Sequential(nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.Linear(32, 8, rngs=nnx.Rngs(1)))
  model.layers[0].kernel[...] = params["fc1"]["kernel"]
  model.layers[1].kernel[...] = params["fc2"]["kernel"]
  sparse, _ = jaxsparse.sparsify(model, rule, masks={"layers.0.kernel": final["fc1"]["kernel"],
                                                    "layers.1.kernel": final["fc2"]["kernel"]})
  assert [int(layer.block_mask.sum()) for layer in sparse.layers] == [2, 1]
  # A rule over more layers than it keeps blocks (2 of 3 x 4 here) keeps one block in each.
  small = {n: {"kernel": _normal(i, (16, 16))} for i, n in enumerate("abc")}
  masks = pruning.magnitude_masks(small, jaxsparse.BlockSparse(density=0.125, block_shape=(8, 8)), scope="global")
  assert [int(masks[n]["kernel"].sum()) for n in "abc"] == [64, 64, 64]


@pytest.mark.parametrize("spec", [jaxsparse.Unstructured(sparsity=0.0), jaxsparse.Unstructured(sparsity=0.5),
                                  jaxsparse.BlockSparse(density=1.0, block_shape=(2, 2))])
def test_empty_kernels_are_named_empty_not_told_to_lower_the_sparsity(spec):
  # Was: "sparsity=0.0 prunes all 0 weights of its (0, 4) kernel; lower the sparsity" (and "raise the density" at
  # density 1.0): advice no value could follow.
  params = {"empty": {"kernel": jnp.zeros((0, 4))}, "fc": {"kernel": _normal(0, (4, 4))}}
  for make in (lambda: pruning.magnitude_masks(params, spec),
               lambda: pruning.wrap_optax(optax.sgd(0.1), pruning.magnitude_pruner(spec)).init(params)):
    with pytest.raises(ValueError, match=r"^empty\.kernel: its \(0, 4\) kernel is empty \(no weights\), so .* cannot "
                                         r"keep any; give this path another rule \(None keeps it as it is\)\."):
      make()
  masks = pruning.magnitude_masks(params, {r"empty": None, r".*": spec})  # the way out the message gives
  assert masks["empty"]["kernel"] is None and masks["fc"]["kernel"].shape == (4, 4)


@settings(max_examples=6, deadline=None)
@given(
    k=st.integers(1, 12), n=st.integers(2, 12), sparsity=st.floats(0.0, 0.95), seed=st.integers(0, 2**16)
)
def test_unstructured_mask_count_and_threshold(k, n, sparsity, seed):
  w = _normal(seed, (k, n))
  kept = w.size - int(sparsity * w.size + 0.5)
  if kept == 0:
    with pytest.raises(ValueError, match="prunes all"):
      pruning.magnitude_masks({"w": w}, jaxsparse.Unstructured(sparsity=sparsity))
    return
  m = np.asarray(pruning.magnitude_masks({"w": w}, jaxsparse.Unstructured(sparsity=sparsity))["w"])
  a = np.abs(np.asarray(w))
  assert m.sum() == kept
  if kept < w.size:
    assert a[m].min() >= a[~m].max()


def test_rank_mask_with_traced_count_keeps_k_largest_lower_index_first():
  scores = np.array([3.0, 1.0, 3.0, 2.0, 0.5, 2.0], np.float32)
  order = np.argsort(-scores, kind="stable")  # ties: lower index first, like jaxsparse.magnitude_mask
  masked = jax.jit(rank_mask)
  for k in range(7):
    expected = np.zeros(6, bool)
    expected[order[:k]] = True
    np.testing.assert_array_equal(masked(jnp.asarray(scores), jnp.int32(k)), expected)


def test_nan_weights_are_kept_as_by_magnitude_mask_and_nm_mask():
  # A diverged (NaN) weight counts as the largest, as in jaxsparse.magnitude_mask / nm_mask: it used to be pruned
  # first (argsort puts NaN last), which hid the divergence and disagreed with the format-level masks.
  w = _normal(0, (8, 4)).at[0, 0].set(jnp.nan).at[5, 2].set(jnp.nan)
  m = pruning.magnitude_masks({"w": w}, jaxsparse.Unstructured(sparsity=0.75))["w"]
  np.testing.assert_array_equal(m, jaxsparse.magnitude_mask(w, 0.75))
  assert bool(m[0, 0]) and bool(m[5, 2]) and int(m.sum()) == 8
  m = pruning.magnitude_masks({"w": w}, jaxsparse.NM(2, 4))["w"]
  np.testing.assert_array_equal(m, jaxsparse.nm_mask(w, 2, 4, axis=0))
  assert bool(m[0, 0]) and bool(m[5, 2])
  np.testing.assert_array_equal(np.asarray(m).reshape(2, 4, 4).sum(axis=1), 2)


def test_wanda_nm_mask_with_a_nan_weight_keeps_n_of_every_m():
  # keep_largest_in_groups ranked by comparisons, which a NaN fails both ways: its group kept 3 of 4 (not 2:4).
  w = _normal(1, (8, 4)).at[0, 0].set(jnp.nan)
  m = np.asarray(pruning.wanda_layer(w, jnp.ones(8), jaxsparse.NM(2, 4)))
  np.testing.assert_array_equal(m.reshape(2, 4, 4).sum(axis=1), 2)
  np.testing.assert_array_equal(m, jaxsparse.nm_mask(w, 2, 4, axis=0))  # unit norms: Wanda's scores are |w|


# -------------------------------------------------------------------------------------------------
# Schedules.
# -------------------------------------------------------------------------------------------------


def test_gradual_schedule_is_zhu_gupta():
  s = pruning.gradual(begin_step=10, end_step=110, update_every=20, initial_sparsity=0.1)
  for t in [0, 9, 10, 30, 50, 77, 110, 500]:
    if t < 10:
      expected = 0.0
    else:
      expected = 0.9 + (0.1 - 0.9) * (1 - min((t - 10) / 100, 1.0)) ** 3
    np.testing.assert_allclose(float(s.sparsity(t, 0.9)), expected, rtol=1e-6, atol=1e-7)
  updates = [t for t in range(200) if s.is_update_step(t)]
  assert updates == [10, 30, 50, 70, 90, 110]
  assert float(s.sparsity(110, 0.9)) == np.float32(0.9)


def test_gradual_with_begin_equal_to_end_prunes_to_the_target_at_that_step():
  s = pruning.gradual(begin_step=5, end_step=5, update_every=1, initial_sparsity=0.2)
  assert [float(s.sparsity(t, 0.9)) for t in (4, 5, 6)] == [0.0, np.float32(0.9), np.float32(0.9)]  # 5 gave 0.2
  assert [t for t in range(12) if s.is_update_step(t)] == [5]
  assert float(pruning.polynomial_sparsity(0, final_sparsity=0.5, begin_step=0, end_step=0)) == 0.5
  tx = pruning.wrap_optax(optax.sgd(1e-2), pruning.magnitude_pruner(
      jaxsparse.Unstructured(sparsity=0.75), pruning.gradual(begin_step=0, end_step=0, update_every=1)))
  ((params, state),) = _run(tx, _params(), 1)
  mask = np.asarray(pruning.get_masks(state)["fc2"]["kernel"])
  assert mask.sum() == 64 and not np.asarray(params["fc2"]["kernel"])[~mask].any()  # used to stay dense


def test_one_shot_and_periodic_schedules():
  s = pruning.one_shot(step=3)
  assert [bool(s.is_update_step(t)) for t in range(5)] == [False, False, False, True, False]
  s = pruning.periodic(update_every=4, begin_step=2, end_step=10)
  assert [t for t in range(20) if s.is_update_step(t)] == [2, 6, 10]
  assert float(s.sparsity(1, 0.5)) == 0.0 and float(s.sparsity(2, 0.5)) == 0.5


def test_schedule_steps_take_concrete_integer_arrays_and_gradual_a_traced_target():
  # Was: "end_step must be an int >= 0, got end_step=Array(10, dtype=int32)" for a step read back from an optimizer
  # state (int(state.count) worked, state.count did not), and gradual's sparsity raised TracerBoolConversionError
  # (Python's min) for a target sparsity computed under jit.
  ints = pruning.gradual(begin_step=jnp.int32(2), end_step=np.int64(10), update_every=jnp.uint8(4))
  plain = pruning.gradual(begin_step=2, end_step=10, update_every=4)
  for t in range(12):
    assert bool(ints.is_update_step(t)) == bool(plain.is_update_step(t))
    assert float(ints.sparsity(t, 0.9)) == float(plain.sparsity(t, 0.9))
  assert [t for t in range(6) if pruning.one_shot(step=jnp.int32(3)).is_update_step(t)] == [3]
  assert [t for t in range(9) if pruning.periodic(update_every=jnp.int32(4), end_step=jnp.int32(8)).is_update_step(t)
          ] == [0, 4, 8]
  for bad in (jnp.float32(3), jnp.bool_(True), jnp.array([3])):
    with pytest.raises(ValueError, match=r"step must be an int >= 0, got step="):
      pruning.one_shot(step=bad)
  with pytest.raises(ValueError, match=r"step must be an int >= 0, got step=.*Tracer"):
    jax.jit(lambda s: pruning.one_shot(step=s))(3)
  s = pruning.gradual(begin_step=0, end_step=10, update_every=1, initial_sparsity=0.5)
  for final in (0.3, 0.9):  # initial_sparsity capped at the target, traced or not
    for t in (0, 4, 10):
      np.testing.assert_allclose(float(jax.jit(s.sparsity)(t, final)), float(s.sparsity(t, final)), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(begin_step=10, end_step=5, update_every=1), "end_step must be >= begin_step"),
        (dict(begin_step=0, end_step=5, update_every=0), "update_every must be an int >= 1"),
        (dict(begin_step=0, end_step=5, update_every=1, initial_sparsity=1.0), r"initial_sparsity must be in \[0, 1\)"),
        (dict(begin_step=-1, end_step=5, update_every=1), "begin_step must be an int >= 0"),
    ],
)
def test_schedule_bad_input(kwargs, match):
  with pytest.raises(ValueError, match=match):
    pruning.gradual(**kwargs)


def test_polynomial_sparsity_is_exactly_initial_sparsity_at_begin_step():
  # s_f + (s_i - s_f) in float32 missed s_i: gradual(initial_sparsity=0.55) then pruned 5 of 10 weights, not 6.
  for si, sf in [(0.55, 0.96), (0.01, 0.05), (0.3, 0.9)]:
    got = pruning.polynomial_sparsity(7, final_sparsity=sf, begin_step=7, end_step=20, initial_sparsity=si)
    assert float(got) == float(np.float32(si))
  schedule = pruning.gradual(begin_step=0, end_step=10, update_every=5, initial_sparsity=0.55)
  tx = pruning.wrap_optax(optax.sgd(0.0), pruning.magnitude_pruner(jaxsparse.Unstructured(sparsity=0.9), schedule))
  state = tx.init({"w": _normal(0, (2, 5))})
  _, state = tx.update({"w": jnp.zeros((2, 5))}, state, {"w": _normal(0, (2, 5))})
  assert int(pruning.get_masks(state)["w"].sum()) == 10 - int(0.55 * 10 + 0.5)


def _zhu_gupta_f64(t, *, final, initial, begin, end, power):
  """The docstring's formula in float64 (exact for these ints): 0 before begin, s_f from end on."""
  if t < begin:
    return 0.0
  if t >= end:
    return final
  frac = np.float64(min(max(t, begin), end) - begin) / np.float64(end - begin)
  return final + (initial - final) * (1.0 - frac) ** power


def _rigl_cosine_f64(t, *, alpha, begin, end):
  """``alpha / 2 (1 + cos(pi (t - t0) / (t1 - t0)))``, clipped to [0, 1], 0 after ``end``, in float64."""
  if t > end:
    return 0.0
  frac = np.clip(np.float64(t - begin) / np.float64(max(end - begin, 1)), 0.0, 1.0)
  return alpha / 2 * (1 + np.cos(np.pi * frac))


_BIG_STEP_KINDS = {
    "python int": int,
    "numpy int64": np.int64,
    "numpy int32": np.int32,
    "jnp int32": jnp.int32,
    "traced int32": lambda t: jax.jit(lambda s: s)(jnp.int32(t)),  # the step as state.count under jit
}


@pytest.mark.parametrize("kind", list(_BIG_STEP_KINDS))
@pytest.mark.parametrize("begin, end", [(2**24, 2**24 + 4), (2**24 - 3, 2**24 + 5), (2**31 - 11, 2**31 - 1),
                                        (0, 2**31 - 1), (1000, 2**31 - 1)])
def test_schedules_are_exact_for_integer_steps_past_2_24(kind, begin, end):
  # Was: the step went to float32 before the arithmetic, which holds integers exactly only up to 2**24: step
  # 2**24 + 1 was read as 2**24 (gradual then held initial_sparsity 0.1 where the ramp was at 0.56), steps near
  # 2**31 - 1 all rounded to 2**31 (the ramp jumped straight to its end), and 1 - frac cancelled near the end.
  convert = _BIG_STEP_KINDS[kind]
  gradual = pruning.gradual(begin_step=begin, end_step=end, update_every=1, initial_sparsity=0.1)
  steps = {begin - 1, begin, begin + 1, begin + 2, (begin + end) // 2, end - 2, end - 1, end, min(end + 1, 2**31 - 1)}
  for t in sorted(steps):
    for power in (3.0, 0.5):
      got = pruning.polynomial_sparsity(convert(t), final_sparsity=0.9, begin_step=begin, end_step=end,
                                        initial_sparsity=0.1, power=power)
      want = _zhu_gupta_f64(t, final=0.9, initial=0.1, begin=begin, end=end, power=power)
      assert got.dtype == jnp.float32
      np.testing.assert_allclose(float(got), want, rtol=2e-6, atol=1e-7, err_msg=f"step {t}, power {power}")
    want = _zhu_gupta_f64(t, final=0.9, initial=0.1, begin=begin, end=end, power=3.0)
    np.testing.assert_allclose(float(gradual.sparsity(convert(t), 0.9)), want, rtol=2e-6, atol=1e-7)
    got = pruning.cosine_drop_fraction(convert(t), drop_fraction=0.3, begin_step=begin, end_step=end)
    want = _rigl_cosine_f64(t, alpha=0.3, begin=begin, end=end)
    np.testing.assert_allclose(float(got), want, rtol=2e-6, atol=1e-9, err_msg=f"step {t}")
    for schedule in (pruning.one_shot(step=begin), pruning.periodic(update_every=7, begin_step=begin)):
      assert float(schedule.sparsity(convert(t), 0.5)) == (0.0 if t < begin else 0.5)


def test_schedules_take_integer_steps_past_int32_and_int64_arrays():
  # Python ints past int32 are taken as ints (jnp.asarray would overflow), and so are int64 arrays under x64.
  big = 2**40
  got = pruning.polynomial_sparsity(big + 1, final_sparsity=0.9, begin_step=big, end_step=big + 4)
  np.testing.assert_allclose(float(got), _zhu_gupta_f64(big + 1, final=0.9, initial=0.0, begin=big, end=big + 4,
                                                        power=3.0), rtol=2e-6)
  for t in (2**31 - 2, 2**31 - 1):  # bounds past an int32 step's range: the step is before the ramp
    assert float(pruning.polynomial_sparsity(jnp.int32(t), final_sparsity=0.9, begin_step=big, end_step=big)) == 0.0
    assert float(pruning.cosine_drop_fraction(jnp.int32(t), drop_fraction=0.3, begin_step=big, end_step=big + 8)) == (
        np.float32(0.3))
  with jax.enable_x64(True):
    for t in (big, big + 1, big + 3, big + 4):
      step = jax.jit(lambda s: s)(jnp.asarray(t, jnp.int64))
      assert step.dtype == jnp.int64
      got = pruning.polynomial_sparsity(step, final_sparsity=0.9, begin_step=big, end_step=big + 4)
      want = _zhu_gupta_f64(t, final=0.9, initial=0.0, begin=big, end=big + 4, power=3.0)
      np.testing.assert_allclose(float(got), want, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize(
    "fn,kwargs,match",
    [
        ("polynomial_sparsity", dict(final_sparsity=0.9, begin_step=100, end_step=50),
         "end_step must be >= begin_step, got begin_step=100, end_step=50"),
        ("polynomial_sparsity", dict(final_sparsity=1.5, begin_step=0, end_step=50),
         r"final_sparsity must be in \[0, 1\]"),
        ("polynomial_sparsity", dict(final_sparsity=float("nan"), begin_step=0, end_step=50), "final_sparsity"),
        ("polynomial_sparsity", dict(final_sparsity=0.5, initial_sparsity=-0.1, begin_step=0, end_step=5),
         "initial_sparsity must be in"),
        ("polynomial_sparsity", dict(final_sparsity=0.5, begin_step=0, end_step=5, power=0.0), "power must be"),
        ("cosine_drop_fraction", dict(drop_fraction=0.3, begin_step=10, end_step=5), "end_step must be >= begin_step"),
        ("cosine_drop_fraction", dict(drop_fraction=-3.0, begin_step=0, end_step=5),
         r"drop_fraction must be in \(0, 1\]"),
        ("cosine_drop_fraction", dict(drop_fraction=0.3, begin_step=1.5, end_step=5), "begin_step must be an int"),
    ],
)
def test_schedule_functions_name_bad_arguments(fn, kwargs, match):
  # They used to return a value: begin_step > end_step acted as a jump at begin_step, sparsity 1.5 came back as is.
  with pytest.raises(ValueError, match=match):
    getattr(pruning, fn)(0, **kwargs)


# -------------------------------------------------------------------------------------------------
# The optax wrapper.
# -------------------------------------------------------------------------------------------------


def _loss(params, x):
  h = jax.nn.relu(x @ params["fc1"]["kernel"] + params["fc1"]["bias"])
  return jnp.mean((h @ params["fc2"]["kernel"] + params["fc2"]["bias"]) ** 2)


def _run(tx, params, steps, *, seed=0):
  state = tx.init(params)

  @jax.jit
  def step(params, state, x):
    grads = jax.grad(_loss)(params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  history = []
  for i in range(steps):
    params, state = step(params, state, _normal(seed + 100 + i, (4, 16)))
    history.append((params, state))
  return history


def test_momentum_never_resurrects_a_pruned_weight():
  # Dense training builds momentum for every weight; the pruning step at 5 zeroes 90% of them.
  rules = jaxsparse.Unstructured(sparsity=0.9)
  tx = pruning.wrap_optax(optax.sgd(0.05, momentum=0.9), pruning.magnitude_pruner(rules, pruning.one_shot(step=5)))
  history = _run(tx, _params(), 15)
  for params, state in history[5:]:
    masks = pruning.get_masks(state)
    for name in ("fc1", "fc2"):
      np.testing.assert_array_equal(np.asarray(params[name]["kernel"])[~np.asarray(masks[name]["kernel"])], 0.0)
  # The inner momentum of pruned weights was reset, so it cannot push them once they are gone.
  _, state = history[5]
  trace = state.inner_state[0].trace
  assert float(jnp.abs(jnp.where(pruning.get_masks(state)["fc1"]["kernel"], 0.0, trace["fc1"]["kernel"])).max()) == 0

  # Control: pruning once and masking the gradients is not enough; the momentum resurrects pruned weights.
  sgd = optax.sgd(0.05, momentum=0.9)

  @jax.jit
  def step(params, state, x, mask):
    params["fc1"]["kernel"] = jnp.where(mask, params["fc1"]["kernel"], 0.0)
    grads = jax.grad(_loss)(params, x)
    grads["fc1"]["kernel"] = jnp.where(mask, grads["fc1"]["kernel"], 0.0)
    updates, state = sgd.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = _params()
  state = sgd.init(params)
  dense = jnp.ones((16, 32), bool)
  for i in range(7):
    if i == 5:
      mask = jaxsparse.magnitude_mask(params["fc1"]["kernel"], 0.9)
    params, state = step(params, state, _normal(100 + i, (4, 16)), dense if i < 5 else mask)
  assert float(jnp.abs(jnp.where(mask, 0.0, params["fc1"]["kernel"])).max()) > 1e-4


def test_kept_weights_follow_the_inner_optimizer_on_masked_gradients():
  rules = jaxsparse.Unstructured(sparsity=0.5)
  masks = pruning.magnitude_masks(_params(), rules)
  params = pruning.apply_masks(_params(), masks)  # sparse from the first step on
  tx = pruning.wrap_optax(optax.adam(1e-2), pruning.magnitude_pruner(rules))
  history = _run(tx, params, 3)
  jax.tree.map(np.testing.assert_array_equal, pruning.get_masks(history[-1][1]), masks)
  # Reference: plain adam on gradients multiplied by the masks.
  ref_params = params
  adam = optax.adam(1e-2)

  @jax.jit
  def step(params, state, x):
    grads = pruning.apply_masks(jax.grad(_loss)(params, x), masks)
    updates, state = adam.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  ref_state = adam.init(ref_params)
  for i in range(3):
    ref_params, ref_state = step(ref_params, ref_state, _normal(100 + i, (4, 16)))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), history[-1][0], ref_params)


def test_gradual_pruning_follows_schedule_and_only_removes():
  schedule = pruning.gradual(begin_step=2, end_step=12, update_every=2)
  rules = {"fc1": jaxsparse.BlockSparse(density=0.25, block_shape=(4, 8)), "fc2": jaxsparse.Unstructured(sparsity=0.9)}
  tx = pruning.wrap_optax(optax.adam(1e-2), pruning.magnitude_pruner(rules, schedule))
  history = _run(tx, _params(), 14)
  previous = None
  for step, (params, state) in enumerate(history):
    masks = pruning.get_masks(state)
    last_update = max([t for t in range(step + 1) if schedule.is_update_step(t)], default=0)
    s = np.float32(schedule.sparsity(last_update, 0.9))
    assert int((~masks["fc2"]["kernel"]).sum()) == int(np.floor(s * np.float32(256) + np.float32(0.5)))
    if step >= 2:
      blocks = np.asarray(masks["fc1"]["kernel"]).reshape(4, 4, 4, 8).any(axis=(1, 3))
      np.testing.assert_array_equal(_expand(blocks, (4, 8)), masks["fc1"]["kernel"])  # block-constant
    if previous is not None:
      for name in ("fc1", "fc2"):
        assert not np.any(np.asarray(masks[name]["kernel"]) & ~np.asarray(previous[name]["kernel"]))
    previous = masks
    np.testing.assert_array_equal(np.asarray(params["fc2"]["kernel"])[~np.asarray(masks["fc2"]["kernel"])], 0.0)
  final = pruning.get_masks(history[-1][1])
  assert float(final["fc1"]["kernel"].mean()) == 0.25
  assert int(final["fc2"]["kernel"].sum()) == 256 - round(0.9 * 256)


def test_global_scope_in_the_optimizer():
  pruner = pruning.magnitude_pruner(jaxsparse.Unstructured(sparsity=0.8), scope="global")
  ((_, state),) = _run(pruning.wrap_optax(optax.sgd(0.1), pruner), _params(), 1)
  kept = [int(pruning.get_masks(state)[n]["kernel"].sum()) for n in ("fc1", "fc2")]
  assert sum(kept) == 768 - round(0.8 * 768) and kept[0] != 512 - round(0.8 * 512)


def test_gradual_nm_goes_through_coarser_patterns():
  schedule = pruning.gradual(begin_step=0, end_step=4, update_every=2)
  tx = pruning.wrap_optax(optax.sgd(1e-2), pruning.magnitude_pruner({"fc1": jaxsparse.NM(1, 4)}, schedule))
  history = _run(tx, _params(), 5)
  kept_per_group = [int(pruning.get_masks(s)["fc1"]["kernel"].reshape(4, 4, 32).sum(axis=1).max()) for _, s in history]
  assert kept_per_group[0] == 4 and kept_per_group[-1] == 1
  assert kept_per_group == sorted(kept_per_group, reverse=True)
  mask = pruning.get_masks(history[-1][1])["fc1"]["kernel"]
  np.testing.assert_array_equal(mask.reshape(4, 4, 32).sum(axis=1), 1)


def test_wrapper_inside_chain_and_without_params():
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   pruning.wrap_optax(optax.sgd(0.1), pruning.magnitude_pruner(jaxsparse.Unstructured(sparsity=0.5))))
  history = _run(tx, _params(), 2)
  assert int(pruning.get_masks(history[-1][1])["fc1"]["kernel"].sum()) == 256
  with pytest.raises(ValueError, match="needs params"):
    tx.update(_params(), tx.init(_params()))
  with pytest.raises(ValueError, match=r"exactly one pruning\.PruningState"):
    pruning.get_masks(optax.sgd(0.1).init(_params()))


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_wrapper_must_be_outermost_and_a_transformation_after_it_is_caught():
  pruner = pruning.magnitude_pruner(jaxsparse.Unstructured(sparsity=0.75))
  # Wrong: the learning rate after the wrapper scales its -param updates, so pruned weights stay (and grow).
  wrong = optax.chain(pruning.wrap_optax(optax.scale_by_adam(), pruner), optax.scale_by_learning_rate(1e-2))
  params, state = _run(wrong, _params(), 3)[-1]
  masks = pruning.get_masks(state, check=False)
  assert np.asarray(params["fc1"]["kernel"])[~np.asarray(masks["fc1"]["kernel"])].all()
  assert int(jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, pruning.PruningState))[0].pruned_nonzero) == 2
  with pytest.raises(ValueError, match=r"2 of 3 updates of pruning\.wrap_optax found weights that its masks prune "
                     r"not zero.*wrap_optax must be the last transformation"):
    pruning.get_masks(state)  # used to hand out masks that do not describe the trained weights
  # Right: the whole chain inside the wrapper.
  right = pruning.wrap_optax(optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(1e-2)), pruner)
  params, state = _run(right, _params(), 3)[-1]
  masks = pruning.get_masks(state)
  assert int(state.pruned_nonzero) == 0
  for name in ("fc1", "fc2"):
    np.testing.assert_array_equal(np.asarray(params[name]["kernel"])[~np.asarray(masks[name]["kernel"])], 0.0)
  # The nnx.Optimizer path reports it too.
  model, x = nnx.Linear(16, 8, rngs=nnx.Rngs(0)), _normal(0, (4, 16))
  optimizer = nnx.Optimizer(model, wrong, wrt=nnx.Param)
  for _ in range(2):
    optimizer.update(model, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))
  with pytest.raises(ValueError, match="1 of 2 updates"):
    pruning.get_masks(optimizer)


def test_masks_save_and_load(tmp_path):
  masks = pruning.magnitude_masks(_params(), jaxsparse.Unstructured(sparsity=0.5))
  flat = pruning.masks_to_dict(masks)
  assert sorted(flat) == ["fc1.kernel", "fc2.kernel"]
  np.savez(tmp_path / "masks.npz", **flat)
  loaded = dict(np.load(tmp_path / "masks.npz"))
  for k, v in flat.items():
    np.testing.assert_array_equal(loaded[k], v)
    assert loaded[k].dtype == np.bool_


def test_wrapper_around_adafactor_and_sm3():
  # adafactor's factored second moments have another shape than their parameter: the reset broadcast the mask
  # into them and the update failed with "cond branches must have equal output types".
  params = {"w": _normal(0, (32, 32))}
  pruner = pruning.magnitude_pruner(jaxsparse.Unstructured(sparsity=0.5), pruning.gradual(begin_step=0, end_step=2,
                                                                                           update_every=1))
  for opt in (optax.adafactor(1e-2, min_dim_size_to_factor=16), optax.adafactor(1e-2, momentum=0.9)):
    tx = pruning.wrap_optax(opt, pruner)
    p, state = params, tx.init(params)
    for i in range(3):
      updates, state = jax.jit(tx.update)({"w": _normal(10 + i, (32, 32))}, state, p)
      p = optax.apply_updates(p, updates)
    mask = np.asarray(pruning.get_masks(state)["w"])
    assert mask.sum() == 512 and not np.asarray(p["w"])[~mask].any()
    for leaf in jax.tree.leaves(state.inner_state):
      if leaf.shape == (32, 32):  # per-weight state (unfactored moments, momentum) was reset at pruned weights
        assert np.abs(np.asarray(leaf)[~mask]).max() < 1e-20  # adafactor adds eps1=1e-30 to squared gradients
        assert np.abs(np.asarray(leaf)[mask]).min() > 1e-6
  # sm3 keeps a list of accumulators per parameter, which the reset cannot map: a clear error at init.
  with pytest.raises(ValueError, match=r"cannot find the per-parameter state.*pass reset_state=False"):
    pruning.wrap_optax(optax.sm3(1e-2), pruner).init(params)
  tx = pruning.wrap_optax(optax.sm3(1e-2), pruner, reset_state=False)
  _, state = tx.update({"w": _normal(1, (32, 32))}, tx.init(params), params)
  assert int(pruning.get_masks(state)["w"].sum()) == 1024 - int(float(np.float32(pruning.polynomial_sparsity(
      0, final_sparsity=0.5, begin_step=0, end_step=2))) * 1024 + 0.5)


# -------------------------------------------------------------------------------------------------
# SET and RigL.
# -------------------------------------------------------------------------------------------------


def _dst_step(pruner, params, grads, *, steps=1):
  tx = pruning.wrap_optax(optax.sgd(0.0), pruner)
  state = tx.init(params)
  before = pruning.get_masks(state)
  for _ in range(steps):
    _, state = jax.jit(tx.update)(grads, state, params)
  return before, pruning.get_masks(state), state


def test_rigl_drops_smallest_and_grows_largest_gradient():
  params = {"w": _normal(0, (16, 16))}
  grads = {"w": _normal(1, (16, 16))}
  pruner = pruning.rigl_pruner(jaxsparse.Unstructured(sparsity=0.75), update_every=1, end_step=100,
                               drop_fraction=0.5)
  before, after, _ = _dst_step(pruner, params, grads)
  b, a = np.asarray(before["w"]), np.asarray(after["w"])
  w, g = np.abs(np.asarray(params["w"])), np.abs(np.asarray(grads["w"]))
  dropped, grown, stayed = b & ~a, a & ~b, b & a
  assert a.sum() == b.sum() == 64
  assert dropped.sum() == grown.sum() == 32  # floor(0.5 * 64)
  assert w[dropped].max() <= w[stayed].min()
  assert g[grown].min() >= g[~b & ~a].max()


def test_set_grows_at_random_and_keeps_counts_over_many_updates():
  params = {"w": _normal(0, (16, 16))}
  pruner = pruning.set_pruner(jaxsparse.Unstructured(sparsity=0.9), update_every=1, end_step=4, drop_fraction=0.3)
  tx = pruning.wrap_optax(optax.sgd(0.1), pruner)
  state = tx.init(params)
  update = jax.jit(tx.update)
  masks = [pruning.get_masks(state)["w"]]
  for i in range(6):
    updates, state = update({"w": _normal(10 + i, (16, 16))}, state, params)
    params = optax.apply_updates(params, updates)
    masks.append(pruning.get_masks(state)["w"])
    np.testing.assert_array_equal(np.asarray(params["w"])[~np.asarray(masks[-1])], 0.0)
  kept = 256 - round(0.9 * 256)
  assert all(int(m.sum()) == kept for m in masks)
  moved = [int((m1 & ~m0).sum()) for m0, m1 in itertools.pairwise(masks)]
  expected = [int(np.floor(float(pruning.cosine_drop_fraction(t, drop_fraction=0.3, begin_step=0, end_step=4)) * kept))
              for t in range(6)]
  assert moved == expected
  assert moved[0] > 0 and moved[-1] == 0  # no updates after end_step


def test_dst_block_masks_stay_block_masks():
  params = {"w": _normal(0, (32, 32))}
  rules = jaxsparse.BlockSparse(density=0.25, block_shape=(8, 8))
  for make in (pruning.set_pruner, pruning.rigl_pruner):
    before, after, _ = _dst_step(make(rules, update_every=1, end_step=10, drop_fraction=0.5), params,
                                 {"w": _normal(2, (32, 32))})
    for m in (before, after):
      blocks = np.asarray(m["w"])[::8, ::8]
      np.testing.assert_array_equal(_expand(blocks, (8, 8)), m["w"])
      assert blocks.sum() == 4
    assert not np.array_equal(before["w"], after["w"])


def test_grown_weights_start_at_zero_with_fresh_optimizer_state():
  params = {"w": _normal(0, (16, 16))}
  pruner = pruning.rigl_pruner(jaxsparse.Unstructured(sparsity=0.75), update_every=2, end_step=100, drop_fraction=0.5)
  tx = pruning.wrap_optax(optax.adam(1e-2), pruner)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for i in range(3):  # updates at steps 0 and 2; the step in between builds Adam moments on kept weights
    old = pruning.get_masks(state)["w"]
    updates, state = update({"w": _normal(20 + i, (16, 16))}, state, params)
    params = optax.apply_updates(params, updates)
  new = pruning.get_masks(state)["w"]
  changed = np.asarray(new) != np.asarray(old)
  assert changed.any()
  mu = np.asarray(state.inner_state[0].mu["w"])
  nu = np.asarray(state.inner_state[0].nu["w"])
  # Grown weights: their moments hold only this step's gradient (they were reset first).
  g = np.asarray(_normal(22, (16, 16)))
  grown = np.asarray(new) & ~np.asarray(old)
  np.testing.assert_allclose(mu[grown], 0.1 * g[grown], rtol=1e-5)
  np.testing.assert_allclose(nu[grown], 0.001 * g[grown] ** 2, rtol=1e-5)
  assert np.all(mu[~np.asarray(new)] == 0) and np.all(nu[~np.asarray(new)] == 0)


def test_dst_keeps_the_count_with_nan_gradients_and_non_finite_weights():
  # A NaN gradient (a step optax.apply_if_finite skips) made RigL drop units but grow none (64 -> 32 kept); a
  # kept NaN / inf weight tied with the pruned units and SET grew one more than it dropped (128 -> 129).
  params = {"w": _normal(0, (16, 16))}
  rigl = pruning.rigl_pruner(jaxsparse.Unstructured(sparsity=0.75), update_every=1, end_step=100, drop_fraction=0.5)
  for grads in ({"w": jnp.full((16, 16), jnp.nan)}, {"w": _normal(1, (16, 16)).at[::2].set(jnp.nan)}):
    tx = pruning.wrap_optax(optax.apply_if_finite(optax.sgd(0.1), 5), rigl)
    state = tx.init(params)
    before = np.asarray(pruning.get_masks(state)["w"])
    _, state = jax.jit(tx.update)(grads, state, params)
    after = np.asarray(pruning.get_masks(state)["w"])
    assert before.sum() == after.sum() == 64 and (after & ~before).sum() == 32  # floor(0.5 * 64) moved
  bad = _normal(0, (16, 16)).at[0].set(jnp.nan).at[1].set(jnp.inf)
  set_ = pruning.set_pruner(jaxsparse.Unstructured(sparsity=0.5), update_every=1, end_step=100, drop_fraction=0.95)
  before, after, _ = _dst_step(set_, {"w": bad}, {"w": jnp.ones((16, 16))})
  b, a, finite = np.asarray(before["w"]), np.asarray(after["w"]), np.isfinite(np.asarray(bad))
  n_swap = int(np.floor(np.float32(0.95) * 128))
  assert (b & finite).sum() < n_swap  # so some non-finite kept weights must go too
  assert b.sum() == a.sum() == 128 and (b & ~a).sum() == (a & ~b).sum() == n_swap
  assert not (b & a & finite).any()  # non-finite weights are dropped last: every finite kept one went first


@pytest.mark.parametrize("factory", [pruning.set_pruner, pruning.rigl_pruner])
def test_dst_rejects_nm_rules_where_the_pruner_is_built(factory):
  """An NM rule was refused only at tx.init, far from the set_pruner / rigl_pruner call."""
  with pytest.raises(ValueError, match=r"rule 'fc1': SET and RigL support Unstructured and BlockSparse rules, got NM"):
    factory({"fc1": jaxsparse.NM(2, 4), "fc2": jaxsparse.Unstructured(0.5)}, update_every=1, end_step=10)
  with pytest.raises(ValueError, match=r"rule '\.\*': SET and RigL support"):
    factory(jaxsparse.NM(2, 4), update_every=1, end_step=10)


# -------------------------------------------------------------------------------------------------
# NNX and Linen training loops.
# -------------------------------------------------------------------------------------------------


class _NNXMLP(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(16, 32, rngs=rngs)
    self.fc2 = nnx.Linear(32, 4, rngs=rngs)

  def __call__(self, x):
    return self.fc2(jax.nn.relu(self.fc1(x)))


def _data(n=64):
  x = _normal(7, (n, 16))
  y = (x[:, 0] > 0).astype(jnp.int32) + 2 * (x[:, 1] > 0).astype(jnp.int32)
  return x, y


def test_nnx_optimizer_loop():
  model = _NNXMLP(nnx.Rngs(0))
  rules = {"fc1": jaxsparse.BlockSparse(density=0.25, block_shape=(8, 8)), "fc2": jaxsparse.Unstructured(sparsity=0.5)}
  pruner = pruning.magnitude_pruner(rules, pruning.gradual(begin_step=0, end_step=20, update_every=5))
  optimizer = nnx.Optimizer(model, pruning.wrap_optax(optax.adam(1e-2), pruner), wrt=nnx.Param)
  x, y = _data()

  @nnx.jit
  def step(model, optimizer):
    def loss_fn(model):
      return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(40)]
  assert losses[-1] < losses[0]
  masks = pruning.get_masks(optimizer)
  assert float(masks["fc1"]["kernel"].mean()) == 0.25 and float(masks["fc2"]["kernel"].mean()) == 0.5
  np.testing.assert_array_equal(np.asarray(model.fc1.kernel[...])[~np.asarray(masks["fc1"]["kernel"])], 0.0)
  # The trained masks turn the dense model into sparse layers computing the same function.
  sparse, _ = jaxsparse.sparsify(model, rules, masks=masks)
  assert isinstance(sparse.fc1, jaxsparse.layers.BlockSparseLinear)
  np.testing.assert_allclose(sparse(x), model(x), rtol=1e-5, atol=1e-5)


def test_apply_masks_on_nnx_module():
  model = _NNXMLP(nnx.Rngs(0))
  masks = pruning.magnitude_masks(model, jaxsparse.Unstructured(sparsity=0.5))
  pruning.apply_masks(model, masks)
  assert float(jnp.mean(model.fc1.kernel[...] == 0)) == 0.5
  assert float(jnp.mean(model.fc1.bias[...] == 0)) == 1.0  # zeros from init, untouched


def test_apply_masks_on_nnx_module_takes_masks_as_plain_nested_dicts():
  # Was: masks written by hand as plain dicts (not an nnx.State) failed inside jax.tree.map with "pytree structure
  # error: different types at key path ... dict ... State", which did not say what to pass.
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(16, 8, rngs=rngs)
      self.masked = jaxsparse.layers.MaskedLinear(8, 8, sparsity=0.5, rngs=rngs)
      self.blocks = nnx.List([nnx.Linear(8, 8, rngs=rngs)])

  keys = jax.random.split(jax.random.key(5), 3)
  kernel_mask = np.asarray(jax.random.bernoulli(keys[0], 0.5, (16, 8)))
  masked_mask = np.asarray(jax.random.bernoulli(keys[1], 0.5, (8, 8)))
  block_mask = np.asarray(jax.random.bernoulli(keys[2], 0.5, (8, 8)))
  plain = {"linear": {"kernel": kernel_mask, "bias": None}, "masked": {"kernel": masked_mask, "bias": None},
           "blocks": {0: {"kernel": block_mask, "bias": None}}}
  model, twin = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
  as_state = jax.tree.map(lambda p, m: m, nnx.as_pure(nnx.state(twin, nnx.Param)), nnx.State(plain),
                          is_leaf=lambda x: x is None)
  assert pruning.apply_masks(model, plain) is model
  pruning.apply_masks(twin, as_state)  # the nnx.State the plain dicts stand for: the same result
  for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(twin)), strict=True):
    np.testing.assert_array_equal(a, b)
  kernel = np.asarray(model.linear.kernel[...])
  assert np.all(kernel[~kernel_mask] == 0) and np.all(kernel[kernel_mask] != 0)
  assert np.all(np.asarray(model.blocks[0].kernel[...])[~block_mask] == 0)
  np.testing.assert_array_equal(model.masked.mask[...], masked_mask & np.asarray(Net(nnx.Rngs(0)).masked.mask[...]))
  # String keys for the list's indices name the same paths.
  other = Net(nnx.Rngs(0))
  pruning.apply_masks(other, {**plain, "blocks": {"0": plain["blocks"][0]}})
  np.testing.assert_array_equal(other.blocks[0].kernel[...], model.blocks[0].kernel[...])

  # Masks that leave out a parameter, or add one, are named with the parameters' paths.
  missing = {"linear": {"kernel": kernel_mask}, "masked": plain["masked"], "blocks": plain["blocks"]}
  with pytest.raises(ValueError, match=r"structure of the model's nnx.state\(model, nnx.Param\).*blocks\.0\.bias, "
                                       r"blocks\.0\.kernel.*; masks lack linear\.bias \(give None"):
    pruning.apply_masks(Net(nnx.Rngs(0)), missing)
  with pytest.raises(ValueError, match=r"masks have extra\.kernel, which the parameters do not"):
    pruning.apply_masks(Net(nnx.Rngs(0)), {**plain, "extra": {"kernel": None}})
  with pytest.raises(ValueError, match=r"masks has a mask at 'extra.kernel', where the parameters have none"):
    pruning.apply_masks(Net(nnx.Rngs(0)), {**plain, "extra": {"kernel": kernel_mask}})


class _LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(32, name="fc1")(x))
    return nn.Dense(4, name="fc2")(h)


def test_linen_train_state_loop():
  model = _LinenMLP()
  x, y = _data()
  params = model.init(jax.random.key(0), x)["params"]
  pruner = pruning.rigl_pruner(jaxsparse.Unstructured(sparsity=0.8), update_every=5, end_step=30)
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=pruning.wrap_optax(optax.adam(1e-2), pruner))

  @jax.jit
  def step(state):
    def loss_fn(p):
      return optax.softmax_cross_entropy_with_integer_labels(state.apply_fn({"params": p}, x), y).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  first_masks = pruning.get_masks(state)
  losses = []
  for _ in range(40):
    state, loss = step(state)
    losses.append(float(loss))
  assert losses[-1] < losses[0]
  masks = pruning.get_masks(state)
  for name in ("fc1", "fc2"):
    m = np.asarray(masks[name]["kernel"])
    assert m.sum() == m.size - round(0.8 * m.size)
    np.testing.assert_array_equal(np.asarray(state.params[name]["kernel"])[~m], 0.0)
  assert not np.array_equal(first_masks["fc1"]["kernel"], masks["fc1"]["kernel"])


# -------------------------------------------------------------------------------------------------
# Bad input.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sparsity", [1.0, -0.1, 1.5])
def test_sparsity_outside_range(sparsity):
  with pytest.raises(ValueError, match=rf"sparsity must be in \[0, 1\), got sparsity={sparsity}"):
    jaxsparse.Unstructured(sparsity=sparsity)


def test_bad_structures():
  with pytest.raises(ValueError, match=r"density must be in \(0, 1\], got density=0.0"):
    jaxsparse.BlockSparse(density=0.0)
  with pytest.raises(ValueError, match="NM needs n <= m, got n=3, m=2"):
    jaxsparse.NM(3, 2)
  with pytest.raises(TypeError, match="block_shape must be a pair of positive ints"):
    jaxsparse.BlockSparse(density=0.5, block_shape=(8,))


def test_structure_that_cannot_apply_names_the_path():
  with pytest.raises(ValueError, match=r"fc1.kernel: N:M sparsity 2:3 needs m=3 to divide the input size 16"):
    pruning.magnitude_masks(_params(), {"fc1": jaxsparse.NM(2, 3)})
  with pytest.raises(ValueError, match=r"fc2.kernel: block_shape=\(5, 8\) does not divide"):
    pruning.magnitude_masks(_params(), {"fc2": jaxsparse.BlockSparse(density=0.5, block_shape=(5, 8))})


def test_rules_matching_nothing_warn_with_paths():
  with pytest.warns(UserWarning, match=r"rule\(s\) \['attn.\*'\] matched no .*available paths: fc1, fc1.kernel"):
    pruning.magnitude_masks(_params(), {"attn.*": jaxsparse.NM(2, 4), ".*": jaxsparse.Unstructured(sparsity=0.5)})


def test_bad_rules_and_scope():
  with pytest.raises(TypeError, match=r"rule 'fc1' maps to 0\.5"):
    pruning.magnitude_masks(_params(), {"fc1": 0.5})
  with pytest.raises(TypeError, match="rules must be a sparsity structure"):
    pruning.magnitude_masks(_params(), 0.5)
  with pytest.raises(ValueError, match="scope must be 'layer' or 'global', got scope='all'"):
    pruning.magnitude_masks(_params(), jaxsparse.Unstructured(sparsity=0.5), scope="all")
  with pytest.raises(ValueError, match="drop_fraction must be in"):
    pruning.set_pruner(jaxsparse.Unstructured(sparsity=0.5), update_every=1, end_step=10, drop_fraction=0.0)


@pytest.mark.parametrize("factory", [
    pruning.magnitude_pruner,
    lambda rules: pruning.set_pruner(rules, update_every=1, end_step=10),
    lambda rules: pruning.rigl_pruner(rules, update_every=1, end_step=10),
], ids=["magnitude", "set", "rigl"])
def test_pruner_factories_check_rules_where_they_are_built(factory):
  """A bad rule surfaced only at the wrapped optimizer's init (tx.init), far from the call that built the pruner."""
  cases = [
      ({"fc1": 0.5}, TypeError, r"rule 'fc1' maps to 0\.5; use jaxsparse\.Unstructured"),
      ({"fc1": "2:4"}, TypeError, r"rule 'fc1' maps to '2:4'"),
      ({"fc[": jaxsparse.Unstructured(0.5)}, ValueError, r"rule 'fc\[' is not a valid regular expression"),
      ({1: jaxsparse.Unstructured(0.5)}, TypeError, r"rule keys must be regex strings, got 1"),
      ({}, ValueError, r"rules is empty"),
      (0.5, TypeError, r"rules must be a sparsity structure .* got float"),
  ]
  for rules, error, match in cases:
    with pytest.raises(error, match=match):
      factory(rules)


def test_magnitude_pruner_keeps_the_rules_it_was_built_with():
  """The rules are copied when the pruner is built (and checked then): changing the caller's dict afterwards, to a
  rule that would have been refused, changes nothing."""
  rules = {"fc1": jaxsparse.Unstructured(sparsity=0.5)}
  tx = pruning.wrap_optax(optax.sgd(0.1), pruning.magnitude_pruner(rules))
  rules["fc1"] = 0.5
  rules["fc2"] = jaxsparse.Unstructured(sparsity=0.75)
  params = _params()
  masks = pruning.get_masks(tx.init(params))
  expected = pruning.magnitude_masks(params, {"fc1": jaxsparse.Unstructured(sparsity=0.5)})
  assert masks["fc2"]["kernel"] is None and expected["fc2"]["kernel"] is None
  np.testing.assert_array_equal(np.asarray(masks["fc1"]["kernel"]), np.asarray(expected["fc1"]["kernel"]))
  assert float(np.mean(np.asarray(masks["fc1"]["kernel"]))) == 0.5


# -------------------------------------------------------------------------------------------------
# Views of multi-axis kernels (issue 36): the pruner takes the 2-D view sparsify uses.
# -------------------------------------------------------------------------------------------------


class _LinenAttention(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.MultiHeadDotProductAttention(2, qkv_features=16, use_bias=False, name="attn")(x)


def test_kernel_views_of_nnx_and_linen_attention():
  model = nnx.Sequential(nnx.Linear(16, 16, rngs=nnx.Rngs(0)),
                         nnx.MultiHeadAttention(2, 16, decode=False, use_bias=False, rngs=nnx.Rngs(1)))
  assert pruning.kernel_views(model) == {f"layers.1.{p}.kernel": 2 if p == "out" else 1
                                         for p in ("key", "out", "query", "value")}
  x = jnp.ones((1, 3, 16))
  module = _LinenAttention()
  variables = module.init(jax.random.key(0), x)
  assert pruning.kernel_views(module, variables, x) == {f"attn.{p}.kernel": 2 if p == "out" else 1
                                                        for p in ("key", "out", "query", "value")}
  with pytest.raises(TypeError, match="needs its variables and an example_input"):
    pruning.kernel_views(module)
  with pytest.raises(TypeError, match="takes the model only"):
    pruning.kernel_views(model, variables)


def test_views_set_the_blocks_and_groups_and_win_over_the_bias():
  w = _normal(0, (8, 2, 4))  # (in, heads, head_dim): (8, 8) with one input axis, (16, 4) in the conv layout
  block = jaxsparse.BlockSparse(density=0.5, block_shape=(4, 4))
  for bias, views, view in [(None, None, (16, 4)), ((2, 4), None, (8, 8)), (None, {"q": 1}, (8, 8)),
                            ((2, 4), {r"q\.kernel": 2}, (16, 4))]:
    params = {"q": {"kernel": w} | ({} if bias is None else {"bias": jnp.zeros(bias)})}
    mask = np.asarray(pruning.magnitude_masks(params, {"q": block}, views=views)["q"]["kernel"]).reshape(view)
    blocks = mask.reshape(view[0] // 4, 4, view[1] // 4, 4)
    np.testing.assert_array_equal(blocks.all(axis=(1, 3)), blocks.any(axis=(1, 3)), err_msg=str(views))
  nm = pruning.magnitude_masks({"q": {"kernel": w}}, {"q": jaxsparse.NM(2, 4)}, views={"q": 1})["q"]["kernel"]
  assert np.asarray(nm).reshape(2, 4, 8).sum(axis=1).tolist() == [[2] * 8] * 2  # groups along the 8 inputs


def test_bad_views_name_the_path_or_the_argument():
  params = {"q": {"kernel": _normal(0, (8, 2, 4))}}
  rules = {"q": jaxsparse.Unstructured(sparsity=0.5)}
  with pytest.raises(ValueError, match=r"q\.kernel: views\['q'\] = 3 input axes do not fit its \(8, 2, 4\) kernel.*"
                     r"1 to 2 here"):
    pruning.magnitude_masks(params, rules, views={"q": 3})
  with pytest.raises(TypeError, match=r"views\['q'\] must be a positive int"):
    pruning.magnitude_pruner(rules, views={"q": 0})
  with pytest.raises(TypeError, match="views must be a mapping from regex"):
    pruning.set_pruner(rules, update_every=1, end_step=2, views=[1])
  with pytest.raises(ValueError, match=r"views key '\(' is not a valid regular expression"):
    pruning.rigl_pruner(rules, update_every=1, end_step=2, views={"(": 1})
  with pytest.warns(UserWarning, match=r"view\(s\) \['attn'\] matched no .*available paths: q, q.kernel"):
    pruning.magnitude_masks(params, rules, views={"attn": 1})


# -------------------------------------------------------------------------------------------------
# The digits demonstration, reduced.
# -------------------------------------------------------------------------------------------------


def _load_example(name):
  path = pathlib.Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"_example_{name}", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_pruning_digits_reduced():
  results = {r.name: r for r in _load_example("pruning_digits").run(steps=300, hidden=64, batch=64, lr=3e-3)}
  dense = results.pop("dense")
  assert dense.accuracy >= 0.93
  expected_sparsity = {"90% unstructured": 0.9, "75% block 16x16": 0.75}
  assert len(results) == 3
  for name, r in results.items():
    assert r.sparsity == pytest.approx(next(v for k, v in expected_sparsity.items() if k in name), abs=2e-4)
    assert r.accuracy >= dense.accuracy - 0.06, (name, r.accuracy, dense.accuracy)
    assert abs(r.sparse_accuracy - r.accuracy) <= 1 / 450  # the sparse layers compute the same model


class _Tied(nnx.Module):
  """One Linear held at two paths (``b`` is ``a``), and another."""

  def __init__(self):
    self.a = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
    self.b = self.a
    self.c = nnx.Linear(16, 8, rngs=nnx.Rngs(1))

  def __call__(self, x):
    return self.c(self.b(self.a(x)))


def test_pruner_refuses_different_rules_for_a_tied_layer_as_sparsify_does():
  """A layer at two paths whose rules differ: sparsify raised, the pruner pruned it by the first path's rule and only
  warned that the second matched no parameter. Both now raise; one structure at both paths prunes it once."""
  rules = {"a": jaxsparse.Unstructured(sparsity=0.5), "b": jaxsparse.NM(2, 4), "c": None}
  msg = r"^a\.kernel: one layer held at several paths \(tied\) gets different structures from the rules: a\.kernel: "
  with pytest.raises(ValueError, match=r"^a: one layer held at several paths \(tied\)"):
    jaxsparse.sparsify(_Tied(), rules)
  with pytest.raises(ValueError, match=msg + r"unstructured 50%, b\.kernel: 2:4\. Give its paths one structure\."):
    pruning.magnitude_masks(_Tied(), rules)
  dst_rules = {**rules, "b": jaxsparse.Unstructured(sparsity=0.75)}  # SET / RigL take no NM
  for pruner in (pruning.magnitude_pruner(rules), pruning.set_pruner(dst_rules, update_every=1, end_step=2)):
    with pytest.raises(ValueError, match=msg):
      pruner.init(_Tied(), jax.random.key(0))
  # One structure at both paths (or at one, the other left to None) works, with no "matched no parameter" warning.
  want = pruning.magnitude_masks(_Tied(), {"a": jaxsparse.NM(2, 4), "c": None})
  for same in ({"a": jaxsparse.NM(2, 4), "b": jaxsparse.NM(2, 4), "c": None},
               {"a": None, "b": jaxsparse.NM(2, 4), "c": None}, {"b": jaxsparse.NM(2, 4), "c": None}):
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      masks = pruning.magnitude_masks(_Tied(), same)
    assert masks["c"]["kernel"] is None and bool(jnp.array_equal(masks["a"]["kernel"], want["a"]["kernel"]))
    sparse, _ = jaxsparse.sparsify(_Tied(), same, masks=masks)
    assert type(sparse.b).__name__ == "NMLinear" and sparse.a is sparse.b
  # An optimizer's parameters (an nnx.State) hold the layer once: the other path's rule can only be warned about.
  with pytest.warns(UserWarning, match=r"rule\(s\) \['b'\] matched no parameter .*if it names another path of a "
                    r"layer held at several paths \(tied\).*pruning\.magnitude_masks\(model, rules\)"):
    pruning.magnitude_masks(nnx.state(_Tied(), nnx.Param), rules)


class _DottedKeys(nnx.Module):
  """Two layers whose paths render one dotted name: ``d["a.b"]`` and ``d["a"]["b"]``."""

  def __init__(self):
    self.d = nnx.Dict({"a.b": nnx.Linear(8, 8, rngs=nnx.Rngs(0)),
                       "a": nnx.Dict({"b": nnx.Linear(8, 8, rngs=nnx.Rngs(1))})})

  def __call__(self, x):
    return self.d["a"]["b"](self.d["a.b"](x))


@pytest.mark.parametrize("entry", ["calibrated_prune", "magnitude_masks", "sparsify", "masks_to_dict",
                                   "sparsify_linen"])
def test_two_parameters_with_one_dotted_name_are_refused(entry):
  """A dict key holding a '.' beside a nested dict gave two layers one dotted name: calibrated_prune returned one mask
  for both and sparsify put the second layer's mask on the first (wrong outputs, no error)."""
  x = jax.random.normal(jax.random.key(0), (2, 8))
  model = _DottedKeys()
  spec = jaxsparse.Unstructured(0.5)
  names = r"(d\.a\.b\.(kernel|bias)|a\.b\.kernel|params\.a\.kernel)"
  with pytest.raises(ValueError, match=f"two entries have the dotted name '{names}'"):
    if entry == "calibrated_prune":
      pruning.calibrated_prune(model, spec, [x], method="magnitude", progress=False)
    elif entry == "magnitude_masks":
      pruning.magnitude_masks(model, spec)
    elif entry == "sparsify":
      jaxsparse.sparsify(model, spec)
    elif entry == "masks_to_dict":
      pruning.masks_to_dict({"a.b": {"kernel": np.ones((2, 2), bool)}, "a": {"b": {"kernel": np.ones((2, 2), bool)}}})
    else:
      class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
          return nn.Dense(8, name="a")(x)

      variables = {"params": {"a": {"kernel": jnp.ones((8, 8)), "bias": jnp.zeros(8)},
                              "a.kernel": jnp.ones((8, 8))}}
      jaxsparse.sparsify_linen(Net(), variables, spec, x)
  # Dotted keys that do not collide are names like any other.
  single = nnx.Dict({"a.b": nnx.Linear(8, 8, rngs=nnx.Rngs(0))})
  sparse, _ = jaxsparse.sparsify(single, spec)
  assert type(sparse["a.b"]).__name__ == "MaskedLinear"
