"""``jaxsparse.sparsify_linen`` / ``densify_linen`` / ``compress_linen`` of Linen stacks of layers: ``nn.scan`` over a
block of ``nn.Dense`` layers (``variable_axes={"params": 0}``, kernels ``(L, K, N)``), checked against the same blocks
unstacked and against the pruned dense model.

Regression: sparsify_linen refused every stacked kernel ("its kernel has shape (3, 16, 32), not the (16, 32) its call
multiplies by: a stacked (nn.scan over layers) kernel? ... map this path to None"), also with the masks of
``pruning.calibrated_prune_linen``, which prunes such stacks layer by layer. Each layer of the stack now becomes its
own sparse layer (ranked on its own weights, or its slice of the mask), stacked on axis 0 as ``nn.scan`` stacks
variables, so the model's own scan runs the sparse layers.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsparse
from jaxsparse import pruning

L, D, H = 3, 16, 32
SPECS = {
    "2:4": jaxsparse.NM(2, 4),
    "unstructured 50%": jaxsparse.Unstructured(sparsity=0.5),
    "block 8x8": jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8)),
}
LAYER = {"2:4": "NMDense", "unstructured 50%": "MaskedDense", "block 8x8": "BlockSparseDense"}
SCAN = dict(variable_axes={"params": 0, "sparsity": 0}, split_rngs={"params": True}, length=L)


# long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it. The fast set keeps one case of each
# parametrized test, the kinds spread over them: block-sparse in the equivalence with the layers unstacked, unstructured
# in the gradients, 2:4 in the calibrated masks and the boxed stack.
slow = pytest.mark.slow


def _one_fast(fast):
  """The names of ``SPECS`` for a parametrize list: ``fast`` in the fast set, the others marked ``slow``."""
  return [name if name == fast else pytest.param(name, marks=slow) for name in SPECS]


def _rules(spec):
  return {r"blocks.*": spec, ".*": None}


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _=None):
    return x + nn.Dense(D, name="fc2")(nn.gelu(nn.Dense(H, name="fc1")(x))), None


class Scanned(nn.Module):
  """Flax's scan over layers; ``"sparsity"`` beside ``"params"`` in ``variable_axes`` (the patterns' axis)."""

  variable_axes: tuple = (("params", 0), ("sparsity", 0))

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(D, name="inp")(x)
    scan = nn.scan(Block, variable_axes=dict(self.variable_axes), split_rngs={"params": True}, length=L)
    return scan(name="blocks")(x, None)[0]


class Unstacked(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(D, name="inp")(x)
    for i in range(L):
      x, _ = Block(name=f"blocks_{i}")(x)
    return x


def _x():
  return jax.random.normal(jax.random.key(1), (5, D))


def _pair():
  """The stacked model's variables and the same weights unstacked (``blocks_i`` = layer ``i``)."""
  variables = jax.tree.map(np.asarray, Scanned().init(jax.random.key(0), _x()))
  params = variables["params"]
  # Layers of different scales: ranking the stack as one matrix (not layer by layer) would show.
  scale = (2.0 ** np.arange(L)).reshape(L, 1, 1).astype(np.float32)
  params["blocks"]["fc1"]["kernel"] = params["blocks"]["fc1"]["kernel"] * scale
  flat = {"inp": params["inp"]}
  for i in range(L):
    flat[f"blocks_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["blocks"])
  return {"params": params}, {"params": flat}


def _layer(tree, i):
  """Layer ``i`` of the stacked variables (the ``blocks`` subtrees sliced), as the unstacked model holds it."""
  out = {}
  for col, sub in tree.items():
    out[col] = {k: v for k, v in sub.items() if k != "blocks"}
    out[col][f"blocks_{i}"] = jax.tree.map(lambda a: a[i], sub["blocks"])
  return out


def _close(a, b):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", _one_fast("block 8x8"))
def test_a_scan_stack_is_sparsified_as_its_layers_unstacked(name):
  spec, x = SPECS[name], _x()
  variables, flat_vars = _pair()
  sparse, sparse_vars, report = jaxsparse.sparsify_linen(Scanned(), variables, _rules(spec), x)
  flat, flat_sparse, flat_report = jaxsparse.sparsify_linen(Unstacked(), flat_vars, _rules(spec), x)
  # Each layer's sparse variables are those of the same layer unstacked, stacked on axis 0 as nn.scan stacks them.
  assert set(sparse_vars) == set(flat_sparse)
  for i in range(L):
    for col, sub in _layer(sparse_vars, i).items():
      jax.tree.map(np.testing.assert_array_equal, sub[f"blocks_{i}"], flat_sparse[col][f"blocks_{i}"])
  assert sparse.layers[("blocks", "fc1")].stack == (L,)
  rows = {r.path: r for r in report.layers}
  assert rows["blocks.fc1"].layer == f"{L} x Dense(({D}, {H}))" and rows["blocks.fc1"].replaced_by == LAYER[name]
  flat_rows = {r.path: r for r in flat_report.layers}
  for fc in ("fc1", "fc2"):  # the stack's density: its layers', all of one size
    np.testing.assert_allclose(rows[f"blocks.{fc}"].density,
                               np.mean([flat_rows[f"blocks_{i}.{fc}"].density for i in range(L)]))
  # The model's own nn.scan runs the sparse layers: the unstacked sparse model's function, under jit.
  out = jax.jit(sparse.apply)(sparse_vars, x)
  _close(out, flat.apply(flat_sparse, x))
  # ... which is the pruned dense model's (densify_linen: the dense stack, zeros where pruned).
  module, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  assert jax.tree.map(np.shape, dense_vars) == jax.tree.map(np.shape, variables)
  _close(module.apply(dense_vars, x), out)
  _, flat_dense = jaxsparse.densify_linen(flat, flat_sparse)
  for i in range(L):
    jax.tree.map(np.testing.assert_array_equal, _layer(dense_vars, i)["params"][f"blocks_{i}"],
                 flat_dense["params"][f"blocks_{i}"])


@pytest.mark.parametrize("name", _one_fast("unstructured 50%"))
def test_gradients_through_the_scan_are_those_of_the_layers_unstacked(name):
  spec, x = SPECS[name], _x()
  variables, flat_vars = _pair()
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(Scanned(), variables, _rules(spec), x)
  flat, flat_sparse, _ = jaxsparse.sparsify_linen(Unstacked(), flat_vars, _rules(spec), x)

  def loss(model, v):
    return jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.tanh(model.apply({**v, "params": p}, x))), argnums=(0, 1)))

  (g_params, g_x) = loss(sparse, sparse_vars)(sparse_vars["params"], x)
  (flat_params, flat_x) = loss(flat, flat_sparse)(flat_sparse["params"], x)
  _close(g_x, flat_x)
  for i in range(L):
    jax.tree.map(_close, _layer({"params": g_params}, i)["params"][f"blocks_{i}"], flat_params[f"blocks_{i}"])


@pytest.mark.parametrize("name", ["2:4", pytest.param("block 8x8", marks=slow)])
def test_the_masks_of_calibrated_pruning_make_the_pruned_stack(name):
  # calibrated_prune_linen prunes a stack layer by layer (masks (L, K, N)); sparsify_linen takes those masks.
  spec, x = SPECS[name], _x()
  variables, _ = _pair()
  batches = [x, jax.random.normal(jax.random.key(2), x.shape)]
  pruned, masks, _ = pruning.calibrated_prune_linen(Scanned(), variables, _rules(spec), batches, method="wanda",
                                                    progress=False)
  assert masks["blocks.fc1.kernel"].shape == (L, D, H)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(Scanned(), pruned, _rules(spec), x, masks=masks)
  for batch in batches:
    _close(sparse.apply(sparse_vars, batch), Scanned().apply(pruned, batch))
  _, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  for fc in ("fc1", "fc2"):
    kernel = pruned["params"]["blocks"][fc]["kernel"]
    np.testing.assert_array_equal(dense_vars["params"]["blocks"][fc]["kernel"],
                                  np.where(masks[f"blocks.{fc}.kernel"], kernel, 0))


def test_an_nm_stack_runs_under_a_scan_of_params_alone_the_others_name_the_missing_collection():
  # N:M layers keep no pattern: the model's nn.scan(variable_axes={"params": 0}) runs them as it is. Masked and
  # block-sparse layers read theirs from "sparsity", which that scan does not pass in: a clear error says what to add.
  x = _x()
  model = Scanned(variable_axes=(("params", 0),))
  variables = model.init(jax.random.key(0), x)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, _rules(jaxsparse.NM(2, 4)), x)
  module, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  _close(sparse.apply(sparse_vars, x), module.apply(dense_vars, x))
  for name in ("unstructured 50%", "block 8x8"):
    with pytest.raises(ValueError, match=re.escape("variable_axes={'params': 0, 'sparsity': 0}")):
      jaxsparse.sparsify_linen(model, variables, _rules(SPECS[name]), x)


def test_a_block_sparse_stack_keeping_different_block_counts_is_refused():
  x = _x()
  variables, _ = _pair()
  masks = pruning.magnitude_masks(variables["params"], _rules(SPECS["block 8x8"]),
                                  stacks=pruning.layer_stacks(Scanned(), variables, x))
  masks = {"blocks.fc1.kernel": np.asarray(masks["blocks"]["fc1"]["kernel"]).copy()}
  masks["blocks.fc1.kernel"][1, :8, :8] = True  # layer 1 keeps one block more
  kept = int(masks["blocks.fc1.kernel"][0].sum()) // 64
  with pytest.raises(ValueError, match=re.escape(f"blocks.fc1: a block-sparse stack needs the same number of kept "
                                                 f"blocks in every layer (it fixes the kernel's shape), but its layers "
                                                 f"keep [{kept}, {kept + 1}, {kept}] of 8 blocks")):
    jaxsparse.sparsify_linen(Scanned(), variables, {"blocks.fc1": SPECS["block 8x8"], ".*": None}, x, masks=masks)


def test_layer_axes_that_do_not_lead_are_refused():
  # variable_axes={"params": 1}: the kernel (K, L, N), no stack sparsify_linen can slice as the scan does.
  x = _x()
  model = Scanned(variable_axes=(("params", 1), ("sparsity", 1)))
  variables = model.init(jax.random.key(0), x)
  assert variables["params"]["blocks"]["fc1"]["kernel"].shape == (D, L, H)
  with pytest.raises(ValueError, match=re.escape(f"blocks.fc1: its kernel has shape ({D}, {L}, {H}), not the ({D}, "
                                                 f"{H}) its call multiplies by nor a stack of them with the layer axes "
                                                 "leading")):
    jaxsparse.sparsify_linen(model, variables, _rules(jaxsparse.NM(2, 4)), x)


class BoxedBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _=None):
    kernel = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    bias = nn.with_partitioning(nn.initializers.zeros_init(), ("model",))
    return jnp.tanh(nn.Dense(D, kernel_init=kernel, bias_init=bias, name="fc")(x)), None


class BoxedScan(nn.Module):
  @nn.compact
  def __call__(self, x):
    scan = nn.scan(BoxedBlock, **SCAN, metadata_params={nn.PARTITION_NAME: "layers"})
    return scan(name="blocks")(x, None)[0]


def _names(tree):
  return jax.tree.map(lambda b: b.names if isinstance(b, nn.Partitioned) else None, tree,
                      is_leaf=lambda b: isinstance(b, nn.Partitioned))


@pytest.mark.parametrize(("name", "want"), [
    ("2:4", None),
    pytest.param("unstructured 50%", {"mask": ("layers", None, "model")}, marks=slow),
    pytest.param("block 8x8", {k: ("layers", None) for k in ("col_indices", "col_offsets", "row_indices", "row_offsets",
                                                             "transpose_order")}, marks=slow),
])
def test_a_boxed_stack_keeps_its_layer_axis_name(name, want):
  # nn.scan's metadata_params takes the stack's axis name off inside and puts it back: the sparse variables need it.
  x = jnp.ones((2, D))
  model = BoxedScan()
  variables = model.init(jax.random.key(0), x)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, SPECS[name], x)
  assert _names(sparse_vars).get("sparsity", {}).get("blocks", {}).get("fc") == want
  assert _names(sparse_vars)["params"]["blocks"]["fc"]["bias"] == ("layers", "model")
  assert _names(sparse.init(jax.random.key(0), x)) == _names(sparse_vars)
  out = sparse.apply(sparse_vars, x)
  module, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  assert _names(dense_vars) == _names(variables)
  _close(module.apply(dense_vars, x), out)
  if name == "2:4":  # compressed layer by layer: the kept values take the kernel's names, the positions its columns'
    small, small_vars = jaxsparse.compress_linen(sparse, sparse_vars)
    assert _names(small_vars)["params"]["blocks"]["fc"]["kernel"] == ("layers", None, "model")
    assert _names(small_vars)["sparsity"]["blocks"]["fc"] == {"kernel_positions": ("layers", None, "model")}
    _close(small.apply(small_vars, x), out)


def test_init_compress_and_route_of_a_stack():
  x = _x()
  variables, _ = _pair()
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(Scanned(), variables, _rules(jaxsparse.NM(2, 4)), x)
  shapes = jax.tree.map(np.shape, sparse_vars)
  assert jax.tree.map(np.shape, sparse.init(jax.random.key(0), x)) == shapes
  abstract = jax.eval_shape(sparse.init, jax.random.key(0), x)
  assert jax.tree.map(np.shape, abstract) == shapes
  assert jax.tree.map(np.shape, jaxsparse.densify_linen(sparse, abstract)[1]) == jax.tree.map(np.shape, variables)
  # compress_linen: each layer compressed on its own, stacked; the same function, and densify_linen undoes it.
  small, small_vars = jaxsparse.compress_linen(sparse, sparse_vars)
  assert small_vars["params"]["blocks"]["fc1"]["kernel"].shape == (L, D // 2, H)
  assert small_vars["sparsity"]["blocks"]["fc1"]["kernel_positions"].shape[0] == L
  _close(small.apply(small_vars, x), sparse.apply(sparse_vars, x))
  _, dense_again = jaxsparse.densify_linen(small, small_vars)
  jax.tree.map(np.testing.assert_array_equal, dense_again, jaxsparse.densify_linen(sparse, sparse_vars)[1])
  _, small_abstract = jaxsparse.compress_linen(sparse, abstract)
  assert jax.tree.map(np.shape, small_abstract) == jax.tree.map(np.shape, small_vars)
  # route_slower_to_dense_linen times layers alone: a stack's run inside the scan, and it stays as it is.
  routed, _, timings = jaxsparse.route_slower_to_dense_linen(sparse, sparse_vars, 4, timer=lambda *a: 1.0)
  assert timings == () and set(routed.layers) == set(sparse.layers)


class AttentionBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _=None):
    return x + nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(x), None


class ConvBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _=None):
    return x + nn.Conv(8, (3, 3), name="conv")(x), None


@pytest.mark.parametrize(("block", "shape", "spec"), [
    (AttentionBlock, (2, 4, D), jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8))),
    pytest.param(AttentionBlock, (2, 4, D), jaxsparse.Unstructured(sparsity=0.5), marks=slow),
    pytest.param(ConvBlock, (2, 6, 6, 8), jaxsparse.NM(2, 4), marks=slow),
    (ConvBlock, (2, 6, 6, 8), jaxsparse.Unstructured(sparsity=0.5)),
], ids=["attention-block", "attention-unstructured", "conv-2:4", "conv-unstructured"])
def test_stacks_of_dense_general_and_conv_layers(block, shape, spec):
  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.scan(block, **SCAN)(name="blocks")(x, None)[0]

  x = jax.random.normal(jax.random.key(3), shape)
  variables = Stack().init(jax.random.key(0), x)
  sparse, sparse_vars, report = jaxsparse.sparsify_linen(Stack(), variables, spec, x)
  assert all(r.layer.startswith(f"{L} x ") for r in report.layers)
  module, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  assert jax.tree.map(np.shape, dense_vars) == jax.tree.map(np.shape, variables)
  _close(sparse.apply(sparse_vars, x), module.apply(dense_vars, x))
  # Each layer pruned on its own, to the rule's density.
  assert all(r.density == pytest.approx(0.5) for r in report.layers)
  kernels = [a for kp, a in jax.tree_util.tree_flatten_with_path(dense_vars)[0] if kp[-1].key == "kernel"]
  assert kernels and all(np.mean(np.asarray(k[i]) != 0) == 0.5 for k in kernels for i in range(L))


def test_a_stack_exported_to_torch_is_refused():
  # Without a bias to give it away, the stacked kernel (L, K, N) was written as a conv's weight.
  torch_interop = pytest.importorskip("jaxsparse.torch_interop")

  class NoBias(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
      return nn.Dense(D, use_bias=False, name="fc")(x), None

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.scan(NoBias, **SCAN)(name="blocks")(x, None)[0]

  x = _x()
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(Stack(), Stack().init(jax.random.key(0), x), jaxsparse.NM(2, 4), x)
  with pytest.raises(ValueError, match=r"blocks.fc: this Dense's kernel has shape \(3, 16, 16\), 1 leading axis"):
    torch_interop.export_state_dict(sparse_vars, module=sparse)
