"""dtype parity of the sparse layers with Flax's dense layers holding the same (pruned) weights.

For each layer: parameter dtypes after init, output dtype, values (within the dtype's tolerance) and gradient dtypes
equal those of the dense Flax layer, over ``param_dtype`` x ``dtype`` x input dtype (a fast subset; the full grid is
``slow``), and with float64 under ``jax_enable_x64``.
"""

import itertools
import re

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


# long: each test keeps only some of FAST in the fast set (make test <= 15 min on 2 cores); CI runs the rest.
def _cases(*keep):
  """GRID as parametrize cases: those of FAST in ``keep`` in the fast set, the others marked slow."""
  return [
      pytest.param(*c, id="-".join(jnp.dtype(d).name if d else "None" for d in c),
                   marks=() if c in keep else pytest.mark.slow)
      for c in FAST
  ] + [pytest.param(*c, marks=pytest.mark.slow) for c in GRID if c not in FAST]


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


@pytest.mark.parametrize("pd, dt, xd", _cases((F32, None, BF16), (BF16, F32, F16)))
def test_nnx_linear_layers_match_nnx_linear(pd, dt, xd):
  x = _input((4, 32), xd)
  for layer, dense in _nnx_linear_pairs(pd, dt):
    name = type(layer).__name__
    assert set(_param_dtypes(layer).values()) == {jnp.dtype(pd)}, name
    _check_same(layer(x), dense(x))
    if jnp.issubdtype(xd, jnp.floating):
      assert _grad_dtypes(layer, x) == _param_dtypes(layer), name


@pytest.mark.parametrize("pd, dt, xd", _cases((F32, None, BF16)))
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


@pytest.mark.parametrize("pd, dt, xd", _cases((F32, None, BF16), (BF16, F32, F16)))
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


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
@pytest.mark.parametrize("pd, dt, xd", [(F64, None, F32), (F32, F64, BF16), (F64, F32, F64)])
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


# -------------------------------------------------------------------------------------------------
# float8 operands.
# -------------------------------------------------------------------------------------------------

F8_TYPES = [jnp.float8_e4m3fn, jnp.float8_e5m2]
F8_TOL = 0.25  # relative, of a float8 result against jnp.matmul's (a 1-ulp rounding difference at most)


def _f8_products(f8):
  """``(name, op(x, w), dense(w))`` for each op, ``w`` a float8 ``(32, 16)`` weight."""
  block_mask = np.array([[1, 0], [0, 1], [1, 1], [0, 0]], bool)
  mask = np.asarray(jax.random.bernoulli(jax.random.key(5), 0.5, (32, 16)))
  bsm = lambda w: jaxsparse.BlockSparseMatrix.from_dense(w, block_shape=(8, 8), block_mask=block_mask)
  csr = lambda w: jaxsparse.CSRMatrix.from_dense(w, mask)
  nm = lambda w: NMSparseMatrix.from_dense(w, 2, 4)
  return [
      ("block_sparse_matmul", lambda x, w, **kw: jaxsparse.ops.block_sparse_matmul(x, bsm(w), **kw),
       lambda w: bsm(w).to_dense()),
      ("sparse_matmul", lambda x, w, **kw: jaxsparse.ops.sparse_matmul(x, csr(w), **kw), lambda w: csr(w).to_dense()),
      ("masked_matmul", lambda x, w, **kw: jaxsparse.ops.masked_matmul(x, w, mask, **kw),
       lambda w: jnp.where(mask, w, jnp.zeros((), w.dtype))),
      ("nm_matmul", lambda x, w, **kw: jaxsparse.ops.nm_matmul(x, nm(w), **kw), lambda w: nm(w).to_dense()),
      ("sr_ste_matmul", lambda x, w, **kw: jaxsparse.ops.sr_ste_matmul(x, w, 2, 4, **kw),
       lambda w: jaxsparse.ops.sr_ste(w, 2, 4)),
  ]


def _close(a, b, tol):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)) and np.all(np.isfinite(b))
  assert np.max(np.abs(a - b)) <= tol * max(np.max(np.abs(b)), 1e-30), np.max(np.abs(a - b))


_F8_OPS = ["block_sparse_matmul", "sparse_matmul", "masked_matmul", "nm_matmul", "sr_ste_matmul"]
_F8_FAST_OPS = ("block_sparse_matmul", "nm_matmul")  # the two regressions (the product, the gradient)
_F8_CASES = [pytest.param(f8, pet, op, id=f"{op}-{jnp.dtype(f8).name}-{jnp.dtype(pet).name if pet else None}",
                          marks=() if (f8, pet, op in _F8_FAST_OPS) == (F8_TYPES[0], None, True) else pytest.mark.slow)
             for f8 in F8_TYPES for pet in (None, F32) for op in _F8_OPS]


@pytest.mark.parametrize("f8, pet, op_name", _F8_CASES)
def test_ops_take_float8_like_jnp_matmul(f8, pet, op_name):
  # block_sparse_matmul raised "8-bit floats do not support implicit promotion" (its float32 accumulator was
  # jnp.promote_types(float8, float32)), and so did nm_matmul's gradient. Every op now multiplies float8 operands as
  # jnp.matmul does: accumulating in float32, the result in preferred_element_type (default float8), gradients in
  # the operands' dtypes.
  x = (jax.random.normal(jax.random.key(1), (8, 32)) * 2).astype(f8)
  w = jax.random.normal(jax.random.key(2), (32, 16)).astype(f8)
  out = jnp.dtype(pet or f8)
  op, dense = {name: (op, dense) for name, op, dense in _f8_products(f8)}[op_name]
  y = op(x, w, preferred_element_type=pet)
  want = jnp.matmul(x.astype(F32), dense(w).astype(F32)).astype(out)
  assert y.dtype == out
  _close(y, want, F8_TOL if out == jnp.dtype(f8) else 1e-6)
  loss = lambda x, w: jnp.sum(op(x, w, preferred_element_type=pet).astype(F32) * jnp.arange(16.0))
  # SR-STE's gradient (its decay of the pruned weights) is that of sr_ste on the float32 weight.
  dense_w = (lambda w: dense(w.astype(F32))) if op_name == "sr_ste_matmul" else (lambda w: dense(w).astype(F32))
  dense_loss = lambda x, w: jnp.sum(jnp.matmul(x.astype(F32), dense_w(w)) * jnp.arange(16.0))
  argnums = (0, 1) if op_name in ("masked_matmul", "sr_ste_matmul") else (0,)
  grads, want_grads = jax.grad(loss, argnums)(x, w), jax.grad(dense_loss, argnums)(x, w)
  for g, wg in zip(grads, want_grads, strict=True):
    assert g.dtype == jnp.dtype(f8)
    _close(g, wg, F8_TOL)


@pytest.mark.parametrize("f8", F8_TYPES, ids=lambda d: jnp.dtype(d).name)
def test_ops_float8_with_another_dtype_name_both(f8):
  # x of float8 and w of float32 (or the reverse) raised JAX's TypePromotionError from inside the op; each op now
  # raises a TypeError naming both operands' dtypes and the fix.
  x = jax.random.normal(jax.random.key(1), (8, 32))
  w = jax.random.normal(jax.random.key(2), (32, 16))
  for _, op, _ in _f8_products(f8):
    for xd, wd in ((f8, F32), (BF16, f8)):
      got = rf"x\.dtype={jnp.dtype(xd).name} and .*={jnp.dtype(wd).name}"
      with pytest.raises(TypeError, match=rf"{got}.*Cast one operand"):
        op(x.astype(xd), w.astype(wd))


@pytest.mark.parametrize("xd, wd", [pytest.param(jnp.float8_e4m3fn, BF16, id="f8-bf16"),
                                    pytest.param(F32, jnp.float8_e5m2, id="f32-f8", marks=pytest.mark.slow)])
def test_ops_float8_with_another_dtype_and_preferred_element_type_as_jnp_matmul(xd, wd):
  # Was: the TypeError above also with preferred_element_type, which jnp.matmul takes for the mix; the ops now run it,
  # values and gradients as the dense product's.
  x = (jax.random.normal(jax.random.key(1), (8, 32)) * 2).astype(xd)
  w = jax.random.normal(jax.random.key(2), (32, 16)).astype(wd)
  weights = jnp.arange(16.0)
  for name, op, dense in _f8_products(jnp.float8_e4m3fn):
    y = op(x, w, preferred_element_type=F32)
    assert y.dtype == F32, name
    _close(y, jnp.matmul(x, dense(w), preferred_element_type=F32), 1e-6)
    argnums = (0, 1) if name in ("masked_matmul", "sr_ste_matmul") else (0,)
    loss = lambda x, w, op=op: jnp.sum(op(x, w, preferred_element_type=F32) * weights)
    dense_loss = lambda x, w, dense=dense: jnp.sum(jnp.matmul(x, dense(w), preferred_element_type=F32) * weights)
    grads, want = jax.grad(loss, argnums)(x, w), jax.grad(dense_loss, argnums)(x, w)
    for g, wg in zip(grads, want, strict=True):
      assert g.dtype == wg.dtype, name
      _close(g, wg, F8_TOL if jnp.finfo(g.dtype).bits == 8 else 1e-2)


def test_block_sparse_linear_computes_in_float8_like_nnx_linear():
  # BlockSparseLinear(dtype=float8_e4m3fn) raised "8-bit floats do not support implicit promotion"; nnx.Linear runs.
  # (param_dtype stays float32: Flax's default initializers give NaN when drawing float8 directly.)
  x = jax.random.normal(jax.random.key(1), (4, 32))
  layer = BlockSparseLinear(32, 16, block_shape=(8, 8), density=0.5, dtype=jnp.float8_e4m3fn, rngs=nnx.Rngs(0))
  dense = nnx.Linear(32, 16, dtype=jnp.float8_e4m3fn, rngs=nnx.Rngs(0))
  dense.kernel[...] = layer.sparse_kernel.to_dense()
  dense.bias[...] = layer.bias[...] + 0.5
  layer.bias[...] = dense.bias[...]
  y = layer(x)
  assert y.dtype == jnp.float8_e4m3fn
  _close(y, dense(x), F8_TOL)
  grads = nnx.grad(lambda m: jnp.sum(m(x).astype(F32)))(layer)
  assert grads["kernel"][...].dtype == F32 and np.all(np.isfinite(np.asarray(grads["kernel"][...])))


# -------------------------------------------------------------------------------------------------
# complex dtypes.
# -------------------------------------------------------------------------------------------------

C64 = jnp.complex64
_COMPLEX_UNSUPPORTED = [
    # (layer, how it is built with the complex argument, the argument's name as the error gives it)
    ("BlockSparseLinear", lambda: BlockSparseLinear(32, 16, block_shape=(8, 8), density=0.5, param_dtype=C64,
                                                    rngs=nnx.Rngs(0)), "param_dtype"),
    ("BlockSparseLinear", lambda: BlockSparseLinear(32, 16, block_shape=(8, 8), density=0.5, dtype=C64,
                                                    rngs=nnx.Rngs(0)), "dtype"),
    ("BlockSparseLinear", lambda: BlockSparseLinear(32, 16, block_shape=(8, 8), density=0.5,
                                                    rngs=nnx.Rngs(0))(jnp.ones((2, 32), C64)), "inputs.dtype"),
    ("NMLinear", lambda: NMLinear(32, 16, param_dtype=C64, rngs=nnx.Rngs(0)), "param_dtype"),
    ("NMConv", lambda: NMConv(8, 4, (3,), param_dtype=C64, rngs=nnx.Rngs(0)), "param_dtype"),
    ("CompressedNMLinear", lambda: NMLinear(32, 16, dtype=C64, rngs=nnx.Rngs(0)).to_compressed(), "dtype"),
    ("CompressedNMLinear", lambda: NMLinear(32, 16, rngs=nnx.Rngs(0)).to_compressed()(jnp.ones((2, 32), C64)),
     "inputs.dtype"),
]


@pytest.mark.parametrize("layer, build, arg", _COMPLEX_UNSUPPORTED,
                         ids=[f"{name}-{arg}" for name, _, arg in _COMPLEX_UNSUPPORTED])
def test_complex_dtypes_raise_naming_the_layer_argument(layer, build, arg):
  # nnx.Linear takes complex64. These layers raised errors from inside the ops naming the op's x / w ("x must have a
  # floating dtype, got complex64", "w must have a floating dtype to be trained"), at the first call; they now raise
  # naming the layer and its argument (at construction for param_dtype / dtype).
  with pytest.raises(TypeError, match=rf"^{layer} computes with real dtypes only .*got {re.escape(arg)}=complex64.*"
                                      "MaskedLinear"):
    build()


def _linen_apply(module, x):
  return module.apply(module.init(jax.random.key(0), jnp.ones(x.shape)), x)


_X32C = jnp.ones((2, 32), C64)


def _complex_kernel_apply(module):  # variables made elsewhere, their kernel complex
  variables = module.init(jax.random.key(0), _X32C.real)
  params = dict(variables["params"], kernel=variables["params"]["kernel"].astype(C64))
  return module.apply(dict(variables, params=params), _X32C.real)


_COMPLEX_UNSUPPORTED_LINEN = [  # the Linen twins: the same check, at construction for param_dtype / dtype
    ("NMDense", lambda: sparse_linen.NMDense(16, param_dtype=C64), "param_dtype"),
    ("NMConv", lambda: sparse_linen.NMConv(4, (3,), param_dtype=C64), "param_dtype"),
    ("CompressedNMDense", lambda: sparse_linen.CompressedNMDense(16, param_dtype=C64), "param_dtype"),
    ("CompressedNMDense", lambda: sparse_linen.CompressedNMDense(16, dtype=C64), "dtype"),
    ("CompressedNMDense", lambda: _linen_apply(sparse_linen.CompressedNMDense(16), _X32C), "x.dtype"),
    ("CompressedNMDense", lambda: _complex_kernel_apply(sparse_linen.CompressedNMDense(16)), "params['kernel'].dtype"),
    ("BlockSparseDense", lambda: _complex_kernel_apply(sparse_linen.BlockSparseDense(16, density=0.5,
                                                                                     block_shape=(8, 8))),
     "params['kernel'].dtype"),
    ("BlockSparseDense", lambda: sparse_linen.BlockSparseDense(16, density=0.5, block_shape=(8, 8), param_dtype=C64),
     "param_dtype"),
    ("BlockSparseDense", lambda: sparse_linen.BlockSparseDense(16, density=0.5, block_shape=(8, 8), dtype=C64),
     "dtype"),
    ("BlockSparseDense", lambda: _linen_apply(sparse_linen.BlockSparseDense(16, density=0.5, block_shape=(8, 8)),
                                              _X32C), "x.dtype"),
]


@pytest.mark.parametrize("layer, build, arg", _COMPLEX_UNSUPPORTED_LINEN,
                         ids=[f"{name}-{arg}" for name, _, arg in _COMPLEX_UNSUPPORTED_LINEN])
def test_complex_dtypes_raise_naming_the_linen_layer_argument(layer, build, arg):
  # Was: the Linen layers had no check: errors from inside the ops at the first call naming the op's x / w ("x must
  # have a floating dtype, got complex64", "w must have a floating dtype to be trained"), or none until then.
  with pytest.raises(TypeError, match=rf"^{layer} computes with real dtypes only .*got {re.escape(arg)}=complex64.*"
                                      "MaskedDense"):
    build()


def test_integer_param_dtype_of_the_sr_ste_layers_is_named():
  # Was: NMLinear / NMConv / Linen NMDense (and sparsify with an NM rule) took an int8 param_dtype and failed at the
  # first call inside sr_ste_matmul ("w must have a floating dtype to be trained").
  msg = r"trains its kernel with SR-STE and needs a floating param_dtype .*got param_dtype=int8"
  with pytest.raises(TypeError, match=r"^NMLinear " + msg):
    NMLinear(8, 4, n=2, m=4, param_dtype=jnp.int8, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"^NMConv " + msg):
    NMConv(8, 4, (3,), n=2, m=4, param_dtype=jnp.int8, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"^NMDense " + msg):
    sparse_linen.NMDense(4, n=2, m=4, param_dtype=jnp.int8).init(jax.random.key(0), jnp.ones((1, 8)))
  with pytest.raises(TypeError, match=r"^\(the model itself\): NMLinear " + msg):  # sparsify names the layer's path
    jaxsparse.sparsify(nnx.Linear(8, 4, param_dtype=jnp.int8, kernel_init=nnx.initializers.ones, rngs=nnx.Rngs(0)),
                       jaxsparse.NM(2, 4))
  layer = NMLinear(8, 4, n=2, m=4, param_dtype=F16, rngs=nnx.Rngs(0))  # every float still builds
  assert layer(jnp.ones((1, 8), F16)).dtype == F16


def _nm_weight(dtype=jnp.float32):
  return NMSparseMatrix.from_dense(jnp.ones((32, 16), dtype), 2, 4)


_COMPUTE_DTYPE_LAYERS = {  # every layer constructor taking a compute dtype, NNX and Linen (built, not called)
    "BlockSparseLinear": lambda **kw: BlockSparseLinear(32, 16, density=0.5, block_shape=(8, 8), rngs=nnx.Rngs(0),
                                                        **kw),
    "MaskedLinear": lambda **kw: MaskedLinear(32, 16, sparsity=0.5, rngs=nnx.Rngs(0), **kw),
    "MaskedConv": lambda **kw: MaskedConv(8, 8, (3,), sparsity=0.5, rngs=nnx.Rngs(0), **kw),
    "NMLinear": lambda **kw: NMLinear(32, 16, rngs=nnx.Rngs(0), **kw),
    "NMConv": lambda **kw: NMConv(8, 4, (3,), rngs=nnx.Rngs(0), **kw),
    "CompressedNMLinear": lambda **kw: jaxsparse.layers.CompressedNMLinear(_nm_weight(), **kw),
    "linen.BlockSparseDense": lambda **kw: sparse_linen.BlockSparseDense(16, density=0.5, block_shape=(8, 8), **kw),
    "linen.MaskedDense": lambda **kw: sparse_linen.MaskedDense(16, sparsity=0.5, **kw),
    "linen.NMDense": lambda **kw: sparse_linen.NMDense(16, **kw),
    "linen.NMConv": lambda **kw: sparse_linen.NMConv(4, (3,), **kw),
    "linen.CompressedNMDense": lambda **kw: sparse_linen.CompressedNMDense(16, **kw),
}


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", list(_COMPUTE_DTYPE_LAYERS))
def test_non_float_compute_dtype_raises_at_construction(name, dtype):
  # Was: every layer took dtype=jnp.int32 (or bool, uint8) and failed at its first call (NNX) or init (Linen) inside
  # Flax's promote_dtype, on "Dtype must be inexact: <class 'jax.numpy.int32'>", naming neither layer nor argument.
  layer = name.removeprefix("linen.")
  msg = rf"^{layer} computes in dtype, which must be a floating dtype .* got dtype={jnp.dtype(dtype).name}: "
  with pytest.raises(TypeError, match=msg):
    _COMPUTE_DTYPE_LAYERS[name](dtype=dtype)
  with pytest.raises(TypeError, match=rf"^{layer}: dtype must be a numeric dtype .* got dtype='foo'"):
    _COMPUTE_DTYPE_LAYERS[name](dtype="foo")  # failed at the first call too, on "data type 'foo' not understood"
  _COMPUTE_DTYPE_LAYERS[name](dtype=jnp.bfloat16)  # floats build, as before


def test_layer_dtype_checks_at_construction_keep_what_works():
  # Integer weights with a kernel_init, integer lookups of an embedding and a custom promote_dtype still build.
  zeros = nn.initializers.zeros_init()
  for build in (lambda: MaskedLinear(32, 16, sparsity=0.5, param_dtype=jnp.int8, kernel_init=zeros, rngs=nnx.Rngs(0)),
                lambda: BlockSparseLinear(32, 16, density=0.5, block_shape=(8, 8), param_dtype=jnp.int32,
                                          kernel_init=zeros, rngs=nnx.Rngs(0))):
    assert build()(jnp.ones((2, 32))).dtype == jnp.float32
  ids = jnp.array([0, 3])
  table = NMSparseMatrix.from_dense(jnp.ones((32, 10)), 2, 4, axis=0)
  assert CompressedNMEmbed(table, dtype=jnp.int32)(ids).dtype == jnp.int32  # as nnx.Embed(dtype=int32) looks up
  table = sparse_linen.CompressedNMEmbed(10, 32, dtype=jnp.int32)
  assert table.apply(table.init(jax.random.key(0), ids), ids).dtype == jnp.int32
  own = lambda args, dtype=None, inexact=True: args  # a promote_dtype of one's own decides about the dtype itself
  NMLinear(32, 16, dtype=jnp.int32, promote_dtype=own, rngs=nnx.Rngs(0))
  dense = sparse_linen.CompressedNMDense(16, param_dtype=jnp.int8, kernel_init=nn.initializers.ones)
  assert dense.init(jax.random.key(0), jnp.ones((2, 32)))["params"]["kernel"].dtype == jnp.int8


@pytest.mark.parametrize("build, match", [
    (lambda: sparse_linen.CompressedNMDense(16, param_dtype=jnp.int8),
     r"^CompressedNMDense's default kernel_init draws from a normal distribution .* got param_dtype=int8"),
    (lambda: sparse_linen.CompressedNMDense(16, param_dtype=jnp.bool_, kernel_init=nn.initializers.ones),
     r"^CompressedNMDense stores its weights' values compressed and needs a numeric param_dtype .* got "
     r"param_dtype=bool"),
    (lambda: sparse_linen.CompressedNMEmbed(10, 32, param_dtype=jnp.int32),
     r"^CompressedNMEmbed's default embedding_init draws from a normal distribution .* got param_dtype=int32\. "
     r".* embedding_init="),
    (lambda: sparse_linen.MaskedDense(16, sparsity=0.5, param_dtype="foo"),
     r"^MaskedDense: param_dtype must be a numeric dtype .* got param_dtype='foo'"),
    (lambda: MaskedLinear(32, 16, sparsity=0.5, param_dtype=object, rngs=nnx.Rngs(0)),
     r"^MaskedLinear: param_dtype must be a numeric dtype .* got param_dtype=<class 'object'>"),
    (lambda: CompressedNMEmbed(NMSparseMatrix.from_dense(jnp.ones((32, 10)), 2, 4, axis=0), dtype="foo"),
     r"^CompressedNMEmbed: dtype must be a numeric dtype .* got dtype='foo'"),
    (lambda: jaxsparse.layers.SparseLinearGeneral(MaskedLinear(32, 16, sparsity=0.5, rngs=nnx.Rngs(0)),
                                                  in_features=32, out_features=16, dtype="foo"),
     r"^SparseLinearGeneral: dtype must be a numeric dtype .* got dtype='foo'"),
], ids=["CompressedNMDense-int8-default-init", "CompressedNMDense-bool", "linen.CompressedNMEmbed-int32-default-init",
        "MaskedDense-foo", "MaskedLinear-object", "CompressedNMEmbed-foo", "SparseLinearGeneral-foo"])
def test_non_float_param_dtype_raises_at_construction(build, match):
  # Was: these failed at init inside JAX's samplers ("dtype argument to `uniform` must be a float dtype, got int8"),
  # inside the compression ("w must be a numeric array, got dtype bool") or on NumPy's "data type 'foo' not
  # understood", naming neither the layer nor its argument.
  with pytest.raises(TypeError, match=match):
    build()


def test_complex_compute_dtype_and_inputs_where_supported_match_nnx_linear():
  # NMLinear prunes its real kernel and then computes as nnx.Linear does, so a complex dtype or complex inputs work;
  # the documented support must stay true.
  x = (jax.random.normal(jax.random.key(1), (4, 32)) + 1j * jax.random.normal(jax.random.key(2), (4, 32))).astype(C64)
  layer = NMLinear(32, 16, dtype=C64, rngs=nnx.Rngs(0))
  dense = nnx.Linear(32, 16, dtype=C64, rngs=nnx.Rngs(0))
  dense.kernel[...] = layer.pruned_kernel()
  y = layer(x)
  assert y.dtype == C64
  want = x @ layer.pruned_kernel().astype(C64) + layer.bias[...]
  np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dense(x)), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("param_dtype", [jnp.float32, C64])
def test_masked_layers_take_complex_inputs_and_weights_as_documented(param_dtype):
  """MaskedLinear / MaskedDense refused complex inputs ("x must have a floating dtype, got complex64"; with a complex
  param_dtype the error blamed a float32 x) though their docs and BlockSparseLinear's say they take them."""
  x = (jax.random.normal(jax.random.key(1), (4, 32)) + 1j * jax.random.normal(jax.random.key(2), (4, 32))).astype(C64)
  layer = MaskedLinear(32, 16, sparsity=0.5, param_dtype=param_dtype, rngs=nnx.Rngs(0))
  w = layer.kernel[...] * layer.mask[...]
  for xi in (x, x.real):
    y = layer(xi)
    assert y.dtype == jnp.result_type(xi.dtype, param_dtype)
    np.testing.assert_allclose(np.asarray(y), np.asarray(xi @ w + layer.bias[...]), rtol=1e-5, atol=1e-5)
  # The gradient of a real loss to x and to the kernel: masked where pruned, as the dense product's.
  loss = lambda x, k: jnp.sum(jnp.abs(jaxsparse.ops.masked_matmul(x, k, layer.mask[...])) ** 2)
  ref = lambda x, k: jnp.sum(jnp.abs(x @ (k * layer.mask[...])) ** 2)
  got, want = jax.grad(loss, (0, 1))(x, layer.kernel[...]), jax.grad(ref, (0, 1))(x, layer.kernel[...])
  for g, r in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)
  dense = sparse_linen.MaskedDense(16, sparsity=0.5, param_dtype=param_dtype)
  variables = dense.init(jax.random.key(0), x.real)
  assert dense.apply(variables, x).dtype == C64


# -------------------------------------------------------------------------------------------------
# 64-bit mode: float64 magnitudes, int64 index arrays.
# -------------------------------------------------------------------------------------------------


def _top_k_reference(scores, k):
  """Bool mask of the ``k`` largest ``scores`` (a stable descending sort: ties to the lower flat index), in NumPy."""
  flat = np.asarray(scores, np.float64).reshape(-1)
  keep = np.zeros(flat.size, bool)
  keep[np.argsort(-flat, kind="stable")[:k]] = True
  return keep.reshape(np.shape(scores))


def test_magnitude_masks_of_float64_weights_rank_them_in_float64():
  # Was: magnitude_mask, block_magnitude_mask and pruning.magnitude_masks compared float64 magnitudes after a cast to
  # float32, which rounds 1 + 1e-9 and 1 to the same value: the tie went to the lower index, keeping smaller weights
  # than the ones pruned (nm_mask, comparing in w's dtype, kept the right ones).
  rng = np.random.default_rng(0)
  w = (1 + rng.random((8, 8)) * 1e-9) * rng.choice([-1.0, 1.0], (8, 8))  # all 1.0 in float32
  assert len(np.unique(w.astype(np.float32))) == 2
  want = _top_k_reference(np.abs(w), 32)
  block_norms = np.sqrt((w.reshape(4, 2, 4, 2) ** 2).sum(axis=(1, 3)))
  want_blocks = _top_k_reference(block_norms, 8)
  with jax.enable_x64(True):
    w64 = jnp.asarray(w)
    assert w64.dtype == jnp.float64
    np.testing.assert_array_equal(np.asarray(jaxsparse.magnitude_mask(w64, 0.5)), want)
    np.testing.assert_array_equal(np.asarray(jaxsparse.block_magnitude_mask(w64, (2, 2), 0.5)), want_blocks)
    pruned = jaxsparse.pruning.magnitude_masks(
        {"a": w64, "b": w64, "c": w64},
        {"a": jaxsparse.Unstructured(0.5), "b": jaxsparse.BlockSparse(0.5, (2, 2)), "c": jaxsparse.NM(1, 2)})
    np.testing.assert_array_equal(np.asarray(pruned["a"]), want)
    np.testing.assert_array_equal(np.asarray(pruned["b"]), np.kron(want_blocks, np.ones((2, 2), bool)))
    np.testing.assert_array_equal(np.asarray(pruned["c"]), np.asarray(nm_mask(w64, 1, 2)))
    scored = jaxsparse.pruning.magnitude_masks({"a": w64}, {"a": jaxsparse.Unstructured(0.5)}, scores={"a": -w64})
    np.testing.assert_array_equal(np.asarray(scored["a"]), _top_k_reference(-w, 32))
    assert jaxsparse.pruning.magnitude_scores(w64).dtype == jnp.float64
    # The layers built from a float64 kernel keep the same weights.
    linear = nnx.Linear(8, 8, param_dtype=F64, rngs=nnx.Rngs(0))
    linear.kernel[...] = w64
    np.testing.assert_array_equal(np.asarray(MaskedLinear.from_dense(linear, sparsity=0.5).mask[...]), want)
    with pytest.raises(TypeError, match=r"a: scores must be real \(higher is kept\), got dtype complex64"):
      jaxsparse.pruning.magnitude_masks({"a": w64}, {"a": jaxsparse.Unstructured(0.5)},
                                        scores={"a": w64.astype(jnp.complex64)})


@pytest.mark.parametrize("fmt", ["block", "csr"])
def test_from_index_arrays_takes_int64_indices_under_x64(fmt):
  # Was: NumPy int64 index arrays (NumPy's default int) were taken without 64-bit mode (jnp.asarray made them int32)
  # and refused with it ("row_indices must be an int32 array ..., got int64"), as were concrete jnp int64 arrays.
  rng = np.random.default_rng(1)
  w = rng.standard_normal((16, 8))
  with jax.enable_x64(True):
    if fmt == "block":
      ws = jaxsparse.BlockSparseMatrix.from_dense(jnp.asarray(w), (4, 4), block_mask=rng.random((4, 2)) < 0.5)
      static = dict(shape=(16, 8), block_shape=(4, 4))
    else:
      ws = jaxsparse.CSRMatrix.from_dense(jnp.asarray(w), rng.random((16, 8)) < 0.4)
      static = dict(shape=(16, 8))
    cls, op = type(ws), (jaxsparse.ops.block_sparse_matmul if fmt == "block" else jaxsparse.ops.sparse_matmul)
    x = jnp.asarray(rng.standard_normal((3, 16)))
    want = np.asarray(x) @ np.asarray(ws.to_dense())
    for as_int64 in (lambda a: np.asarray(a).astype(np.int64), lambda a: jnp.asarray(a, jnp.int64)):
      idx = {k: as_int64(v) for k, v in ws.index_arrays().items()}
      assert {v.dtype for v in idx.values()} == {np.dtype(np.int64)}
      rebuilt = cls.from_index_arrays(ws.data, idx, **static)
      assert {v.dtype for v in rebuilt.index_arrays().values()} == {np.dtype(np.int32)}
      y = op(x, rebuilt)
      assert y.dtype == jnp.float64
      np.testing.assert_allclose(np.asarray(y), want, rtol=1e-12, atol=1e-12)
    bad = {k: jnp.asarray(v, jnp.int64) for k, v in ws.index_arrays().items()}
    bad["col_indices"] = bad["col_indices"].at[0].add(2**32)  # a cast to int32 would wrap it back in range
    with pytest.raises(ValueError, match=r"index_arrays\['col_indices'\] holds values in .*outside int32"):
      cls.from_index_arrays(ws.data, bad, **static)
