"""sparsify_linen / densify_linen on nn.DenseGeneral: the projections of nn.MultiHeadDotProductAttention."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxsparse
from jaxsparse import pruning
from tests._util import assert_close

D = 32
SPECS = {
    "block 16x16": jaxsparse.BlockSparse(density=0.5, block_shape=(16, 16)),
    "2:4": jaxsparse.NM(2, 4),
    "unstructured 70%": jaxsparse.Unstructured(sparsity=0.7),
}
# Kernel of each layer and how many of its leading dims it contracts: its (K, N) view.
LAYERS = {"attention.query": 1, "attention.key": 1, "attention.value": 1, "attention.out": 2, "mlp_in": 1,
          "mlp_out": 1}


class Block(nn.Module):
  heads: int = 2

  @nn.compact
  def __call__(self, x):
    h = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, name="attention")(nn.LayerNorm(name="ln")(x))
    return h + nn.Dense(x.shape[-1], name="mlp_out")(nn.gelu(nn.Dense(2 * x.shape[-1], name="mlp_in")(h)))


def _rules(spec):
  return {r".*attention.*query": spec, r"attention\.(key|value|out)": spec, r"mlp_.*": spec}


def _get(tree, dotted):
  for part in dotted.split("."):
    tree = tree[part]
  return tree


def _shape_2d(shape, n_in):
  return math.prod(shape[:n_in]), math.prod(shape[n_in:])


def _mask_2d(spec, w):
  """The magnitude mask of a (K, N) kernel, computed independently of sparsify_linen."""
  if isinstance(spec, jaxsparse.BlockSparse):
    blocks = np.asarray(jaxsparse.block_magnitude_mask(w, spec.block_shape, spec.density))
    return np.kron(blocks, np.ones(spec.block_shape, bool)).astype(bool)
  if isinstance(spec, jaxsparse.NM):
    return np.asarray(jaxsparse.nm_mask(w, spec.n, spec.m, axis=0))
  return np.asarray(jaxsparse.magnitude_mask(w, spec.sparsity))


def _pruned_reference(variables, spec):
  """The dense variables with every selected kernel times its mask, and the (K, N) masks."""
  ref = jax.tree.map(lambda a: a, variables)
  masks = {}
  for path, n_in in LAYERS.items():
    layer = _get(ref["params"], path)
    kernel = np.asarray(layer["kernel"])
    masks[path] = _mask_2d(spec, kernel.reshape(_shape_2d(kernel.shape, n_in)))
    layer["kernel"] = jnp.asarray(kernel * masks[path].reshape(kernel.shape))
  return ref, masks


def _setup():
  x = jax.random.normal(jax.random.key(1), (2, 8, D))
  variables = jax.tree.map(lambda a: a, Block().init(jax.random.key(0), x))
  for i, path in enumerate(LAYERS):  # nonzero biases, so their reshapes are checked
    layer = _get(variables["params"], path)
    layer["bias"] = jax.random.normal(jax.random.key(10 + i), layer["bias"].shape)
  return x, variables


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
@pytest.mark.parametrize("name", list(SPECS))
def test_attention_block_matches_the_pruned_dense_block(name):
  spec = SPECS[name]
  x, variables = _setup()
  sparse, sparse_vars, report = jaxsparse.sparsify_linen(Block(), variables, _rules(spec), x)
  replaced = {"block 16x16": "BlockSparseDense", "2:4": "NMDense", "unstructured 70%": "MaskedDense"}[name]
  assert [(c.path, c.replaced_by) for c in report.layers] == [(p, replaced) for p in sorted(LAYERS)]
  row = next(c for c in report.layers if c.path == "attention.out")
  assert row.layer == "DenseGeneral((2, 16, 32))"
  assert row.density == pytest.approx({"block 16x16": 0.5, "2:4": 0.5, "unstructured 70%": 0.3}[name], abs=1e-3)
  ref_vars, masks = _pruned_reference(variables, spec)

  # Forward, eager and under jit.
  want = Block().apply(ref_vars, x)
  assert_close(sparse.apply(sparse_vars, x), want, jnp.float32)
  assert_close(jax.jit(sparse.apply)(sparse_vars, x), want, jnp.float32)

  # Gradients with respect to the sparse parameters are the dense ones on the kept weights.
  target = jax.random.normal(jax.random.key(2), x.shape)

  def loss(apply, params, rest):
    return jnp.mean((apply({**rest, "params": params}, x) - target) ** 2)

  # Absolute tolerance: some gradients are zero in exact arithmetic (a head whose values are all pruned
  # makes its query and key gradients vanish).
  close = lambda a, b: jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), a, b)
  grads = jax.jit(jax.grad(lambda p: loss(sparse.apply, p, sparse_vars)))(sparse_vars["params"])
  ref_grads = jax.grad(lambda p: loss(Block().apply, p, ref_vars))(ref_vars["params"])
  close(grads["ln"], ref_grads["ln"])
  for path, n_in in LAYERS.items():
    g, g_ref = _get(grads, path), _get(ref_grads, path)
    k, n = _shape_2d(g_ref["kernel"].shape, n_in)
    g_ref2 = g_ref["kernel"].reshape(k, n)
    mask = masks[path]
    close(g["bias"], g_ref["bias"].reshape(n))
    if isinstance(spec, jaxsparse.BlockSparse):
      bm = mask[:: spec.block_shape[0], :: spec.block_shape[1]]
      kept = jaxsparse.BlockSparseMatrix.from_dense(g_ref2, spec.block_shape, block_mask=bm).data
      close(g["kernel"], kept)
    else:
      assert g["kernel"].shape == (k, n)
      close(np.asarray(g["kernel"])[mask], np.asarray(g_ref2)[mask])

  # densify_linen: the original structure and shapes, holding the pruned kernels.
  module, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  assert module is sparse.module
  assert jax.tree.map(jnp.shape, dense_vars) == jax.tree.map(jnp.shape, variables)
  for got, ref in zip(jax.tree.leaves(dense_vars), jax.tree.leaves(ref_vars), strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-7)
  assert_close(module.apply(dense_vars, x), want, jnp.float32)


@pytest.mark.parametrize("name", list(SPECS))
def test_nnx_and_linen_attention_agree(name):
  spec = SPECS[name]
  x = jax.random.normal(jax.random.key(1), (2, 8, D))
  linen = nn.MultiHeadDotProductAttention(num_heads=2)
  variables = linen.init(jax.random.key(0), x)
  model = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False, rngs=nnx.Rngs(0))
  for i, proj in enumerate(("query", "key", "value", "out")):
    getattr(model, proj).kernel[...] = variables["params"][proj]["kernel"]
    getattr(model, proj).bias[...] = jax.random.normal(jax.random.key(10 + i), getattr(model, proj).bias.shape)
    variables["params"][proj]["bias"] = getattr(model, proj).bias[...]
  assert_close(linen.apply(variables, x), model(x), jnp.float32)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(linen, variables, spec, x)
  sparse_nnx, _ = jaxsparse.sparsify(model, spec)
  assert type(sparse_nnx.query).__name__ == "SparseLinearGeneral"
  assert_close(sparse.apply(sparse_vars, x), sparse_nnx(x), jnp.float32)


class SmallBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16, name="attn")(x)
    return nn.Dense(16, name="fc")(jax.nn.gelu(h))


@pytest.mark.parametrize("spec", [jaxsparse.NM(2, 4), jaxsparse.Unstructured(sparsity=0.5),
                                  jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8))], ids=str)
def test_sparsegpt_masks_make_the_sparse_attention_block(spec):
  batches = [jax.random.normal(jax.random.key(i), (4, 16, 16)) for i in range(3)]
  variables = SmallBlock().init(jax.random.key(0), batches[0])
  new_vars, masks, _ = pruning.calibrated_prune_linen(SmallBlock(), variables, spec, batches, progress=False)
  assert masks["attn.query.kernel"].shape == (16, 2, 8) and masks["attn.out.kernel"].shape == (2, 8, 16)
  sparse, sparse_vars, report = jaxsparse.sparsify_linen(SmallBlock(), new_vars, spec, batches[0], masks=masks)
  assert [c.path for c in report.replaced] == ["attn.key", "attn.out", "attn.query", "attn.value", "fc"]
  for x in batches:
    assert_close(sparse.apply(sparse_vars, x), SmallBlock().apply(new_vars, x), jnp.float32)
  _, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  for path, mask in masks.items():
    kernel = np.asarray(_get(dense_vars["params"], path))
    np.testing.assert_array_equal(kernel != 0, mask)
    np.testing.assert_allclose(kernel, np.asarray(_get(new_vars["params"], path)), rtol=1e-6, atol=1e-7)


def test_masks_of_another_shape_are_refused():
  x, variables = _setup()
  mask = np.ones((D, D), bool)  # the (K, N) view, not the kernel's own shape
  with pytest.raises(ValueError, match=r"attention.query: the given mask has shape \(32, 32\), the kernel "
                                       r"\(32, 2, 16\)"):
    jaxsparse.sparsify_linen(Block(), variables, _rules(jaxsparse.NM(2, 4)), x,
                             masks={"attention.query.kernel": mask})


@pytest.mark.parametrize("options, message", [
    (dict(axis=(1, 2)), r"nn.DenseGeneral with axis=\(1, 2\) and batch_dims=\(\) is not supported; only the"),
    (dict(axis=(-1, -2)), r"nn.DenseGeneral with axis=\(-1, -2\)"),
    (dict(batch_dims=(0,)), r"nn.DenseGeneral with axis=-1 and batch_dims=\(0,\) is not supported"),
], ids=["middle axes", "reversed axes", "batch dims"])
def test_unsupported_dense_general_fails_only_when_selected(options, message):
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8, name="fc")(nn.DenseGeneral(8, **options, name="general")(x))

  x = jax.random.normal(jax.random.key(1), (4, 8, 8, 8))
  variables = Net().init(jax.random.key(0), x)
  for rules in ({"general": jaxsparse.NM(2, 4)}, jaxsparse.NM(2, 4)):
    with pytest.raises(ValueError, match=f"general: {message}"):
      jaxsparse.sparsify_linen(Net(), variables, rules, x)
  sparse, sparse_vars, report = jaxsparse.sparsify_linen(Net(), variables, {"fc": jaxsparse.NM(2, 4)}, x)
  assert [c.path for c in report.layers] == ["fc"]
  assert sparse_vars["params"]["general"]["kernel"] is variables["params"]["general"]["kernel"]
  _, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  assert_close(sparse.apply(sparse_vars, x), Net().apply(dense_vars, x), jnp.float32)


def test_partitioning_is_folded_and_restored():
  class Attn(nn.Module):
    @nn.compact
    def __call__(self, x):
      k = nn.initializers.lecun_normal()
      heads = nn.with_partitioning(nn.initializers.zeros_init(), ("heads", None))
      h = nn.DenseGeneral((2, 16), kernel_init=nn.with_partitioning(k, ("embed", "heads", None)), bias_init=heads,
                          name="query")(x)
      return nn.DenseGeneral(D, axis=(-2, -1), kernel_init=nn.with_partitioning(k, ("heads", None, "embed")),
                             name="out")(h)

  x = jax.random.normal(jax.random.key(1), (2, 8, D))
  variables = Attn().init(jax.random.key(0), x)
  for spec in SPECS.values():
    sparse, sparse_vars, _ = jaxsparse.sparsify_linen(Attn(), variables, spec, x)
    specs = nn.get_partition_spec(sparse_vars)
    block = isinstance(spec, jaxsparse.BlockSparse)
    assert specs["params"]["query"]["kernel"] == (P(None, None, None) if block else P("embed", "heads"))
    assert specs["params"]["out"]["kernel"] == (P(None, None, None) if block else P("heads", "embed"))
    assert specs["params"]["query"]["bias"] == P("heads")
    if isinstance(spec, jaxsparse.Unstructured):
      assert specs["sparsity"]["query"]["mask"] == P("embed", "heads")
    assert_close(sparse.apply(sparse_vars, x), sparse.apply(nn.meta.unbox(sparse_vars), x), jnp.float32)
    _, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
    assert nn.get_partition_spec(dense_vars) == nn.get_partition_spec(variables)
    assert jax.tree.map(jnp.shape, nn.meta.unbox(dense_vars)) == jax.tree.map(jnp.shape, nn.meta.unbox(variables))


def test_check_speed_times_dense_general_layers():
  class Attn(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.DenseGeneral(D, axis=(-2, -1), name="out")(nn.DenseGeneral((2, 16), name="query")(x))

  x = jax.random.normal(jax.random.key(1), (4, 8, D))
  variables = Attn().init(jax.random.key(0), x)
  sparse, sparse_vars, report = jaxsparse.sparsify_linen(Attn(), variables, jaxsparse.Unstructured(sparsity=0.5), x,
                                                         check_speed="forward")
  assert [c.path for c in report.layers] == ["out", "query"]
  for c in report.layers:
    assert c.dense_ms > 0 and c.sparse_ms > 0
    assert c.replaced_by == "MaskedDense" or c.note == "kept dense: sparse not faster (forward)"
  module, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  assert jax.tree.map(jnp.shape, dense_vars) == jax.tree.map(jnp.shape, variables)
  assert_close(sparse.apply(sparse_vars, x), module.apply(dense_vars, x), jnp.float32)
