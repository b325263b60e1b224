"""Seams between layers and the model-wide tools: a ``TensorParallelBlockSparseLinear`` in ``summary`` / ``densify`` /
the pruners, the pruners on block-sparse layers' kept blocks, ``compress`` of a stack of ``NMLinear`` layers, and
``get_masks`` after training went non-finite.

Each test says what the code did before (the audit scripts that found it: ``a20_tp``, ``a22_prune_sparse_model``,
``a23_prune_block_layer``, ``a12_compress_stack``, ``a06_nan_train``).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxsparse
from jaxsparse import pruning
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import CompressedNMLinear
from jaxsparse.layers import MaskedLinear
from jaxsparse.layers import NMLinear
from jaxsparse.layers import linen as sparse_linen
from jaxsparse.sharding import TensorParallelBlockSparseLinear

ROOT = pathlib.Path(__file__).resolve().parent.parent
REFUSED = r"this {kind} is block-sparse: its \({shape}\) kernel holds the values of its kept {bk}x{bn} blocks"
FIX = r"densify it .*prune the dense layer .*sparsify it again; or map this path to None"


# --- TensorParallelBlockSparseLinear -----------------------------------------------------------------------------


def _tp(split, mesh=None):
  base = BlockSparseLinear(32, 48, density=0.4, block_shape=(8, 8), rngs=nnx.Rngs(3))
  mesh = mesh or jax.make_mesh((1,), ("model",))
  return base, TensorParallelBlockSparseLinear(base, mesh, "model", split=split)


@pytest.mark.parametrize("split", ["columns", "rows"])
def test_tensor_parallel_layer_is_summarized_densified_and_refused_by_the_pruners(split):
  """Was: summary "no sparse layers", densify left the layer as it was, and magnitude_masks pruned its
  (shards, blocks_per_shard, bk, bn) kernel as a dense weight."""
  base, tp = _tp(split)
  model, ref = nnx.Sequential(tp, jax.nn.relu), nnx.Sequential(base, jax.nn.relu)
  row, want = jaxsparse.summary(model).layers[0], jaxsparse.summary(ref).layers[0]
  assert row.kind == "TensorParallelBlockSparseLinear" and row.path == "layers.0"
  for field in ("shape", "pattern", "density", "forward_flops", "backward_flops", "dense_forward_flops",
                "dense_bytes"):
    assert getattr(row, field) == getattr(want, field), field
  x = jax.random.normal(jax.random.key(1), (3, 32))
  dense = jaxsparse.densify(model)
  assert type(dense.layers[0]) is nnx.Linear
  np.testing.assert_array_equal(dense.layers[0].kernel[...], base.sparse_kernel.to_dense())
  np.testing.assert_array_equal(dense.layers[0].bias[...], base.bias[...])
  np.testing.assert_allclose(dense(x), model(x), rtol=1e-5, atol=1e-6)
  mesh = jax.make_mesh((1,), ("model",))  # a restore target: its pattern closed over, concrete
  abstract = jaxsparse.densify(nnx.eval_shape(lambda: TensorParallelBlockSparseLinear(base, mesh, "model",
                                                                                      split=split)))
  assert abstract.kernel.get_value().shape == (32, 48)
  for rule in (jaxsparse.Unstructured(0.5), jaxsparse.NM(2, 4)):
    with pytest.raises(ValueError, match=REFUSED.format(kind="TensorParallelBlockSparseLinear",
                                                        shape=r"1, \d+, 8, 8", bk=8, bn=8)):
      pruning.magnitude_masks(model, rule)
    with pytest.raises(ValueError, match=REFUSED.format(kind="TensorParallelBlockSparseLinear",
                                                        shape=r"1, \d+, 8, 8", bk=8, bn=8)):
      nnx.Optimizer(model, pruning.wrap_optax(optax.sgd(0.1), pruning.magnitude_pruner(rule)), wrt=nnx.Param)
  assert pruning.masks_to_dict(pruning.magnitude_masks(model, {r"layers\.0": None})) == {}


TWO_DEVICES = """
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import AxisType
import jaxsparse
from jaxsparse import pruning
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.sharding import TensorParallelBlockSparseLinear
assert jax.device_count() == 2, jax.devices()
x = jax.random.normal(jax.random.key(1), (4, 32))
for axis_type in (AxisType.Auto, AxisType.Explicit):
  mesh = jax.make_mesh((2,), ("model",), axis_types=(axis_type,))
  for split in ("columns", "rows"):
    base = BlockSparseLinear(32, 48, density=0.4, block_shape=(8, 8), rngs=nnx.Rngs(3))
    with jax.set_mesh(mesh):
      tp = TensorParallelBlockSparseLinear(base, mesh, "model", split=split)
      source = np.asarray(tp.source[...])
      if split == "columns":
        assert (source < 0).any()  # this pattern pads a shard with zero blocks
      kernel = np.array(tp.kernel[...])
      kernel[source < 0] = 7.0  # which the products leave out: so must densify
      tp.kernel[...] = jnp.asarray(kernel)
      row = jaxsparse.summary(tp).layers[0]
      assert (row.shape, row.pattern, row.forward_flops) == ((32, 48), "block 8x8", 2 * base.kernel.size), row
      assert row.density == base.density
      dense = jaxsparse.densify(tp)
      assert type(dense) is nnx.Linear
      np.testing.assert_array_equal(np.asarray(dense.kernel[...]), np.asarray(base.sparse_kernel.to_dense()))
      np.testing.assert_allclose(np.asarray(dense(x)), np.asarray(base(x)), rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(np.asarray(dense(x)), np.asarray(tp(x)), rtol=1e-5, atol=1e-5)
      jitted = nnx.jit(lambda m: jaxsparse.densify(m).kernel[...])(tp)
      np.testing.assert_array_equal(np.asarray(jitted), np.asarray(base.sparse_kernel.to_dense()))
      try:
        pruning.magnitude_masks(nnx.Sequential(tp), jaxsparse.Unstructured(0.5))
        raise AssertionError("pruned the kept blocks of a TensorParallelBlockSparseLinear")
      except ValueError as e:
        assert "layers.0.kernel: this TensorParallelBlockSparseLinear is block-sparse" in str(e), e
print("done")
"""


@pytest.mark.slow  # a 2-device subprocess (about 14 s on 2 cores); the 1-device mesh test above is in the fast set
def test_tensor_parallel_layer_on_two_devices_densifies_without_its_padding_blocks():
  """On two devices (the shards of a column split padded with zero blocks, here set to nonzero values, which its
  products leave out), auto and explicit axes: densify gives the unsplit weight, under jit too; summary counts the
  unsplit layer's blocks; the pruners refuse the kernel. Was: "no sparse layers", the layer left as it was, the
  kernel pruned as a dense weight."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
  proc = subprocess.run([sys.executable, "-c", textwrap.dedent(TWO_DEVICES)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("done"), proc.stderr[-4000:]


# --- The pruners and the kept blocks of block-sparse layers ----------------------------------------------------------


def _mixed(block_shape):
  return nnx.Sequential(
      BlockSparseLinear(48, 64, density=0.5, block_shape=block_shape, rngs=nnx.Rngs(0)), jax.nn.relu,
      NMLinear(64, 32, n=2, m=4, rngs=nnx.Rngs(1)), jax.nn.relu, MaskedLinear(32, 8, sparsity=0.5, rngs=nnx.Rngs(2)))


SPECS = [jaxsparse.NM(2, 4), jaxsparse.Unstructured(0.75), jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8))]


@pytest.mark.parametrize("block_shape", [(8, 8), (6, 8)])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_pruners_refuse_the_kept_blocks_of_a_block_sparse_layer(spec, block_shape):
  """Was: a catch-all rule pruned the stored (nnz, bk, bn) blocks as a dense 3-D weight: with 6x8 blocks under NM(2,
  4) an error about "the input size 6 of its (32, 6, 8) kernel"; with 8x8 blocks the weights inside kept blocks were
  zeroed while the layer's density and summary stayed at 0.5. Now every way in refuses them, naming the path, and a
  None rule for the layer prunes the others."""
  model = _mixed(block_shape)
  nnz = model.layers[0].nnz_blocks
  match = "layers.0.kernel: " + REFUSED.format(kind="BlockSparseLinear", shape=f"{nnz}, {block_shape[0]}, 8",
                                               bk=block_shape[0], bn=8) + ".*" + FIX
  with pytest.raises(ValueError, match=match):
    nnx.Optimizer(model, pruning.wrap_optax(optax.sgd(0.1), pruning.magnitude_pruner(spec)), wrt=nnx.Param)
  for target in (model, nnx.state(model, nnx.Param)):  # the layers, or the params carrying the kernel's mark
    with pytest.raises(ValueError, match=match):
      pruning.magnitude_masks(target, spec)
  with pytest.raises(ValueError, match=match):
    nnx.Optimizer(model, pruning.wrap_optax(optax.sgd(0.1), pruning.rigl_pruner(jaxsparse.Unstructured(0.75),
                                                                                 update_every=1, end_step=4)),
                  wrt=nnx.Param)
  if isinstance(spec, jaxsparse.Unstructured):
    # A pruner of one's own sees plain arrays: its masks on the blocks are refused after its init.
    everything = pruning.Pruner(init=lambda p, k: jax.tree.map(lambda a: jnp.abs(a) > 0.1, p),
                                update=lambda m, p, g, s, k: m, is_update_step=lambda s: jnp.asarray(False))
    with pytest.raises(ValueError, match=match.replace("rule", "the pruner")):
      nnx.Optimizer(model, pruning.wrap_optax(optax.sgd(0.1), everything), wrt=nnx.Param)
  masks = pruning.masks_to_dict(pruning.magnitude_masks(model, {r"layers\.0": None, r".*": spec}))
  assert sorted(masks) == ["layers.2.kernel", "layers.4.kernel"]


def test_pruners_refuse_the_kept_blocks_of_linen_and_bridged_layers():
  """Linen variables show a block-sparse layer by its "sparsity" index arrays beside "params" (a BlockSparseDense's
  flat, a bridged BlockSparseLinear's under "pattern", whose kernel also keeps its mark in an NNXMeta box)."""
  x = jnp.ones((2, 32))

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = sparse_linen.BlockSparseDense(32, density=0.5, block_shape=(8, 8), name="fc")(x)
      return nnx.bridge.ToLinen(BlockSparseLinear, args=(32, 16), kwargs={"density": 0.5, "block_shape": (8, 8)},
                                name="bridged")(x)

  variables = Net().init(jax.random.key(0), x)
  for path, kind in (("fc", "BlockSparseDense"), ("bridged", "BlockSparseLinear")):
    rule = rf"params\.{path}"
    with pytest.raises(ValueError, match=rf"params\.{path}\.kernel: this {kind} is block-sparse"):
      pruning.magnitude_masks(variables, {rule: jaxsparse.Unstructured(0.5), ".*": None})
    with pytest.raises(ValueError, match=rf"params\.{path}\.kernel: this {kind} is block-sparse"):
      pruning.wrap_optax(optax.sgd(0.1), pruning.magnitude_pruner({rule: jaxsparse.NM(2, 4), ".*": None})).init(
          variables)


def test_densify_prune_and_sparsify_again_narrows_a_block_sparse_layer():
  """The way the refusal names: densify, prune the dense layer to fewer blocks, sparsify with the masks. The new
  layer keeps a subset of the old blocks, and its density is what it computes."""
  model = _mixed((8, 8))
  dense = jaxsparse.densify(model)
  rules = {r"layers\.0": jaxsparse.BlockSparse(density=0.25, block_shape=(8, 8)), r".*": None}
  sparse, _ = jaxsparse.sparsify(dense, rules, masks=pruning.magnitude_masks(dense, rules))
  old, new = np.asarray(model.layers[0].block_mask), np.asarray(sparse.layers[0].block_mask)
  assert new.sum() == old.size // 4 and not (new & ~old).any()
  assert sparse.layers[0].density == 0.25 and jaxsparse.summary(sparse).layers[0].density == 0.25
  x = jax.random.normal(jax.random.key(1), (2, 48))
  w = np.asarray(model.layers[0].sparse_kernel.to_dense()) * np.kron(new, np.ones((8, 8)))
  np.testing.assert_allclose(sparse.layers[0](x), x @ w + model.layers[0].bias[...], rtol=1e-5, atol=1e-5)


# --- compress of a stack of NMLinear layers --------------------------------------------------------------------------


class _Stack(nnx.Module):
  def __init__(self, layers, rngs, *, named=False):
    metadata = {"transform_metadata": {nnx.PARTITION_NAME: "layers"}} if named else {}
    init = nnx.initializers.lecun_normal()
    if named:
      init = nnx.with_partitioning(init, ("embed", "mlp"), eager_sharding=False)

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, **metadata)
    def make(rngs):
      return NMLinear(64, 64, n=2, m=4, kernel_init=init, rngs=rngs)

    self.stack = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(h, layer):
      return jnp.tanh(layer(h))

    return run(x, self.stack)


@pytest.mark.parametrize("layers", [3, 4])
def test_compress_of_a_stack_compresses_each_layer(layers):
  """Was: TypeError "weight must be a 2-D jaxsparse.NMSparseMatrix" (4 layers) or "m=4 must divide w.shape[0]=3" (3
  layers: the layer axis taken for the axis of the N:M groups). Now the stack of the layers' compressed forms, which
  the model's scan runs as it ran the stack."""
  model = _Stack(layers, nnx.Rngs(0))
  small = jaxsparse.compress(model)
  assert type(small.stack) is CompressedNMLinear and small.stack.kernel.shape == (layers, 32, 64)
  x = jax.random.normal(jax.random.key(1), (8, 64))
  np.testing.assert_allclose(small(x), model(x), rtol=1e-5, atol=1e-5)
  state = nnx.state(model.stack)
  for i in range(layers):  # each layer as compressing it alone gives it
    layer = nnx.merge(nnx.graphdef(model.stack), jax.tree.map(lambda a, i=i: a[i], state))
    np.testing.assert_array_equal(small.stack.kernel[...][i], layer.to_compressed().kernel[...])
  assert jaxsparse.summary(small).layers[0].shape == (layers, 64, 64)
  alone = jaxsparse.compress(model.stack)  # the stack itself
  np.testing.assert_array_equal(alone.kernel[...], small.stack.kernel[...])


def test_compress_of_a_named_stack_keeps_the_stack_axis_name():
  small = jaxsparse.compress(_Stack(2, nnx.Rngs(0), named=True))
  names = lambda v: v.get_metadata().get("out_sharding")
  assert names(small.stack.kernel) == ("layers", "embed", "mlp")
  assert names(small.stack.kernel_positions) == ("layers", None, "mlp")


def test_compress_of_a_stack_whose_layer_axis_does_not_lead_names_it():
  @nnx.split_rngs(splits=3)
  @nnx.vmap(in_axes=(0,), out_axes=1)
  def make(rngs):
    return NMLinear(64, 32, n=2, m=4, rngs=rngs)

  model = nnx.Sequential(make(nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"layers\.0: this NMLinear holds a kernel of shape \(64, 3, 32\), whose "
                                       r"trailing axes are not the \(64, 32\) of its features.*in_axes=1, out_axes=1"):
    jaxsparse.compress(model)


# --- get_masks after training went non-finite ------------------------------------------------------------------------


def test_get_masks_says_the_weights_went_non_finite():
  """Was: one NaN example made the weights NaN (a pruned NaN weight stays NaN: NaN - NaN), and get_masks blamed "a
  transformation after wrap_optax ... or optax.lookahead"."""
  model = nnx.Sequential(nnx.Linear(16, 24, rngs=nnx.Rngs(0)), jax.nn.relu, nnx.Linear(24, 4, rngs=nnx.Rngs(1)))
  pruner = pruning.magnitude_pruner(jaxsparse.Unstructured(0.5), pruning.gradual(begin_step=0, end_step=4,
                                                                                 update_every=1))
  optimizer = nnx.Optimizer(model, pruning.wrap_optax(optax.sgd(1e-2), pruner), wrt=nnx.Param)
  x = jnp.ones((4, 16)).at[0, 0].set(jnp.nan)
  for _ in range(3):
    optimizer.update(model, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))
  state = jax.tree.leaves(optimizer.opt_state, is_leaf=lambda s: isinstance(s, pruning.PruningState))[0]
  assert int(state.pruned_nonfinite) > 0 and int(state.pruned_nonzero) == 0
  with pytest.raises(ValueError, match=r"found weights that its masks prune not finite \(NaN or inf\): the "
                                       r"parameters went non-finite in training") as info:
    pruning.get_masks(optimizer)
  assert "transformation after wrap_optax" not in str(info.value)
  assert pruning.get_masks(optimizer, check=False) is not None


def test_get_masks_still_blames_a_transformation_after_the_wrapper():
  params = {"w": jax.random.normal(jax.random.key(0), (8, 8))}
  tx = optax.chain(pruning.wrap_optax(optax.scale_by_adam(), pruning.magnitude_pruner(jaxsparse.Unstructured(0.5))),
                   optax.scale_by_learning_rate(0.1))
  state = tx.init(params)
  for _ in range(3):
    updates, state = tx.update({"w": jnp.ones((8, 8))}, state, params)
    params = optax.apply_updates(params, updates)
  with pytest.raises(ValueError, match=r"found weights that its masks prune not zero.*A transformation after "
                                       r"wrap_optax") as info:
    pruning.get_masks(state)
  assert "not finite" not in str(info.value)
