"""dtype parity of the sparse layers with Flax's dense layers holding the same (pruned) weights.

For each layer: parameter dtypes after init, output dtype, values (within the dtype's tolerance) and gradient dtypes
equal those of the dense Flax layer, over ``param_dtype`` x ``dtype`` x input dtype (a fast subset; the full grid is
``slow``), and with float64 under ``jax_enable_x64``.
"""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsparse
from jaxsparse import NMSparseMatrix
from jaxsparse import nm_mask
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import CompressedNMEmbed
from jaxsparse.layers import MaskedConv
from jaxsparse.layers import MaskedLinear
from jaxsparse.layers import NMConv
from jaxsparse.layers import NMLinear
from jaxsparse.layers import linen as sparse_linen

F32, BF16, F16, F64 = jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64
# Relative error (max-abs over max-abs) of an output against the dense layer's, computed in the same dtypes.
TOL = {jnp.dtype(F32): 1e-5, jnp.dtype(BF16): 2e-2, jnp.dtype(F16): 4e-3, jnp.dtype(F64): 1e-12}

# (param_dtype, dtype, input dtype)
GRID = list(itertools.product([F32, BF16, F16], [None, F32, BF16], [F32, BF16, F16, jnp.int32]))
FAST = [(F32, None, BF16), (BF16, None, F32), (BF16, F32, F16), (F16, BF16, jnp.int32), (F16, None, F16)]
CASES = [pytest.param(*c, id="-".join(jnp.dtype(d).name if d else "None" for d in c)) for c in FAST] + [
    pytest.param(*c, marks=pytest.mark.slow) for c in GRID if c not in FAST
]


def _input(shape, dtype):
  x = jax.random.normal(jax.random.key(1), shape) * 3
  return x.astype(dtype)  # int32: rounded toward zero, as a user's integer features


def _check_same(y, y_dense):
  assert y.dtype == y_dense.dtype, (y.dtype, y_dense.dtype)
  a, e = np.asarray(y, np.float64), np.asarray(y_dense, np.float64)
  assert np.all(np.isfinite(a)) and np.all(np.isfinite(e))
  err = np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30)
  assert err <= TOL[jnp.dtype(y.dtype)], f"relative error {err:.2e} for {y.dtype}"


def _param_dtypes(module):
  return {"/".join(map(str, k)): v.dtype for k, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def _grad_dtypes(module, x):
  grads = nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32)))(module)
  return {"/".join(map(str, k)): v.dtype for k, v in nnx.to_flat_state(grads)}


def _nnx_linear_pairs(pd, dt):
  """(sparse layer, nnx.Linear holding its pruned kernel and bias) for each NNX linear layer kind."""
  kw = dict(dtype=dt, param_dtype=pd, rngs=nnx.Rngs(0))
  masked = MaskedLinear(32, 16, sparsity=0.75, **kw)
  block = BlockSparseLinear(32, 16, block_shape=(8, 8), density=0.5, **kw)
  nm = NMLinear(32, 16, **kw)
  compressed = nm.to_compressed()
  kernels = [masked.kernel[...] * masked.mask[...], block.sparse_kernel.to_dense(), nm.pruned_kernel(),
             compressed.weight.to_dense()]
  for layer, kernel in zip((masked, block, nm, compressed), kernels, strict=True):
    layer.bias[...] = jnp.linspace(-1, 1, 16).astype(pd)
    dense = nnx.Linear(32, 16, **kw)
    dense.kernel[...] = kernel
    dense.bias[...] = layer.bias[...]
    yield layer, dense


@pytest.mark.parametrize("pd, dt, xd", CASES)
def test_nnx_linear_layers_match_nnx_linear(pd, dt, xd):
  x = _input((4, 32), xd)
  for layer, dense in _nnx_linear_pairs(pd, dt):
    name = type(layer).__name__
    assert set(_param_dtypes(layer).values()) == {jnp.dtype(pd)}, name
    _check_same(layer(x), dense(x))
    if jnp.issubdtype(xd, jnp.floating):
      assert _grad_dtypes(layer, x) == _param_dtypes(layer), name


@pytest.mark.parametrize("pd, dt, xd", CASES)
def test_nnx_conv_and_embed_match_flax(pd, dt, xd):
  kw = dict(dtype=dt, param_dtype=pd, rngs=nnx.Rngs(0))
  x = _input((1, 6, 6, 8), xd)
  masked, nm = MaskedConv(8, 16, (3, 3), sparsity=0.5, **kw), NMConv(8, 16, (3, 3), **kw)
  for layer, kernel in ((masked, masked.kernel[...] * masked.mask[...]), (nm, nm.pruned_kernel())):
    dense = nnx.Conv(8, 16, (3, 3), **kw)
    dense.kernel[...] = kernel
    assert _param_dtypes(layer) == _param_dtypes(dense)
    _check_same(layer(x), dense(x))
  embed = nnx.Embed(20, 16, **kw)
  sparse = CompressedNMEmbed.from_dense(embed)
  embed.embedding[...] = embed.embedding[...] * nm_mask(embed.embedding[...], 2, 4, axis=1)
  assert sparse.embedding.dtype == jnp.dtype(pd) and sparse.embedding_positions.dtype == jnp.uint8
  ids = jnp.array([[0, 7, 19]])
  _check_same(sparse(ids), embed(ids))
  _check_same(sparse.attend(_input((3, 16), xd)), embed.attend(_input((3, 16), xd)))


@pytest.mark.parametrize("pd, dt, xd", CASES)
def test_linen_layers_match_flax(pd, dt, xd):
  kw = dict(dtype=dt, param_dtype=pd)
  key, x = jax.random.key(0), _input((4, 32), xd)
  dense = nn.Dense(16, **kw)
  for module in (sparse_linen.MaskedDense(16, sparsity=0.5, **kw), sparse_linen.NMDense(16, **kw),
                 sparse_linen.BlockSparseDense(16, density=0.5, block_shape=(8, 8), **kw),
                 sparse_linen.CompressedNMDense(16, **kw)):
    v = module.init(key, jnp.ones((1, 32)))
    p, s = v["params"], v.get("sparsity", {})
    assert {a.dtype for a in jax.tree.leaves(p)} == {jnp.dtype(pd)}, type(module).__name__
    if isinstance(module, sparse_linen.MaskedDense):
      kernel = p["kernel"] * s["mask"]
    elif isinstance(module, sparse_linen.NMDense):
      kernel = p["kernel"] * nm_mask(p["kernel"], 2, 4)
    elif isinstance(module, sparse_linen.BlockSparseDense):
      kernel = jaxsparse.BlockSparseMatrix.from_index_arrays(p["kernel"], s, shape=(32, 16), block_shape=(8, 8))
      kernel = kernel.to_dense()
    else:
      kernel = NMSparseMatrix(p["kernel"], s["kernel_positions"], shape=(32, 16), n=2, m=4, axis=0).to_dense()
    _check_same(module.apply(v, x), dense.apply({"params": {"kernel": kernel, "bias": p["bias"]}}, x))
  embed = sparse_linen.CompressedNMEmbed(20, 16, **kw)
  v = embed.init(key, jnp.arange(3))
  table = NMSparseMatrix(v["params"]["embedding"], v["sparsity"]["embedding_positions"], shape=(16, 20), n=2, m=4,
                         axis=0).to_dense().T
  ids, q = jnp.array([[0, 7, 19]]), _input((3, 16), xd)
  dense_embed = nn.Embed(20, 16, **kw)
  _check_same(embed.apply(v, ids), dense_embed.apply({"params": {"embedding": table}}, ids))
  _check_same(embed.apply(v, q, method="attend"),
              dense_embed.apply({"params": {"embedding": table}}, q, method="attend"))


@pytest.fixture
def x64():
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("pd, dt, xd", [(F64, None, F32), pytest.param(F32, F64, BF16, marks=pytest.mark.slow),
                                         pytest.param(F64, F32, F64, marks=pytest.mark.slow)])
def test_float64_parity(x64, pd, dt, xd):
  x = _input((4, 32), xd)
  for layer, dense in _nnx_linear_pairs(pd, dt):
    assert set(_param_dtypes(layer).values()) == {jnp.dtype(pd)}
    _check_same(layer(x), dense(x))
    assert _grad_dtypes(layer, x) == _param_dtypes(layer)


@pytest.mark.parametrize("kernel_dtype, bias_dtype", [(BF16, F32), (F32, BF16)])
def test_block_sparse_from_dense_keeps_bias_dtype(kernel_dtype, bias_dtype):
  # A dense layer with a bias of another dtype than its kernel (float32 biases beside bfloat16 kernels, as mixed
  # precision keeps them) computes with that bias; from_dense cast it to the kernel's dtype, so the sparse layer
  # returned another dtype than the dense one.
  linear = nnx.Linear(32, 16, param_dtype=kernel_dtype, rngs=nnx.Rngs(0))
  linear.bias.set_value(jnp.linspace(-1, 1, 16, dtype=bias_dtype))
  layer = BlockSparseLinear.from_dense(linear, density=0.5, block_shape=(8, 8))
  assert layer.bias.dtype == jnp.dtype(bias_dtype)
  x = _input((4, 32), BF16)
  kernel = layer.sparse_kernel.to_dense()
  y = layer(x)
  want = jnp.dot(x.astype(y.dtype), kernel.astype(y.dtype)) + linear.bias[...].astype(y.dtype)
  assert y.dtype == linear(x).dtype == jnp.result_type(x, kernel, linear.bias[...])
  _check_same(y, want)
  assert layer.to_dense().bias.dtype == jnp.dtype(bias_dtype)


@pytest.mark.parametrize("spec", [jaxsparse.BlockSparse(0.5, (4, 4)), jaxsparse.Unstructured(0.5), jaxsparse.NM(2, 4)])
def test_sparsify_with_masks_keeps_bias_dtype(spec):
  """``sparsify`` with given masks keeps a float32 bias beside a bfloat16 kernel, as the dense layer computes with."""

  class Net(nnx.Module):
    def __init__(self):
      self.fc = nnx.Linear(16, 8, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
      self.fc.bias.set_value(jax.random.normal(jax.random.key(1), (8,), jnp.float32))

  net = Net()
  x = jax.random.normal(jax.random.key(2), (3, 16), jnp.bfloat16)
  if isinstance(spec, jaxsparse.NM):
    mask = np.asarray(jaxsparse.nm_mask(net.fc.kernel[...], 2, 4))
  else:
    mask = np.kron(np.random.default_rng(0).random((4, 2)) < 0.5, np.ones((4, 4), bool))
  sparse, _ = jaxsparse.sparsify(net, {"fc": spec}, masks={"fc.kernel": mask})
  assert sparse.fc.bias[...].dtype == jnp.float32
  dense = nnx.Linear(16, 8, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  dense.kernel.set_value(jnp.where(mask, net.fc.kernel[...], 0))
  dense.bias.set_value(net.fc.bias[...])
  want = dense(x)
  got = sparse.fc(x)
  assert got.dtype == want.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)
