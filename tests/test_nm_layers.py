"""N:M layers: NMLinear / NMConv (NNX) and NMDense / NMConv (Linen) against dense Flax layers, SR-STE
gradients, conversions, bad input, and a reduced run of examples/sr_ste_digits.py."""

from __future__ import annotations

import importlib.util
import math
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jaxsparse
from jaxsparse import ops
from jaxsparse.layers import CompressedNMLinear
from jaxsparse.layers import NMConv
from jaxsparse.layers import NMLinear
from jaxsparse.layers import SparsityPattern
from jaxsparse.layers import linen as jlinen
from tests._util import assert_close

K, N = 64, 24


def _normal(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _randomize_bias(layer, seed):
  if layer.bias is not None:
    layer.bias[...] = _normal(seed, layer.bias.shape, layer.bias.dtype)


def _pruned(kernel, n, m, axis):
  return jnp.where(jaxsparse.nm_mask(kernel, n, m, axis=axis), kernel, 0)


# -------------------------------------------------------------------------------------------------
# NMLinear.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "m"), [(2, 4), (1, 4), (4, 8)])
@pytest.mark.parametrize("use_bias", [True, False])
def test_nm_linear_forward_is_dense_linear_with_pruned_kernel(n, m, use_bias):
  layer = NMLinear(K, N, n=n, m=m, use_bias=use_bias, rngs=nnx.Rngs(0))
  _randomize_bias(layer, 1)
  x = _normal(2, (3, 5, K))
  kernel = layer.kernel[...]
  expected = x @ _pruned(kernel, n, m, 0) + (layer.bias[...] if use_bias else 0)
  np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(expected), rtol=1e-6, atol=1e-6)
  assert layer.kernel.shape == (K, N)  # stays dense
  np.testing.assert_array_equal(np.asarray(layer.mask), np.asarray(jaxsparse.nm_mask(kernel, n, m)))
  assert (layer.n, layer.m, layer.sr_ste_decay) == (n, m, 2e-4)
  assert isinstance(layer, nnx.Linear)


@pytest.mark.parametrize("decay", [0.0, 2e-4, 0.5])
def test_nm_linear_gradient_is_sr_ste(decay):
  layer = NMLinear(K, N, sr_ste_decay=decay, rngs=nnx.Rngs(3))
  x, dy = _normal(4, (7, K)), _normal(5, (7, N))
  grads = nnx.grad(lambda m: jnp.sum(m(x) * dy))(layer)
  w = layer.kernel[...]
  mask = jaxsparse.nm_mask(w, 2, 4)
  expected = x.T @ dy + decay * (~mask) * w  # straight through to every weight, decay on the pruned
  assert_close(grads.kernel[...], expected, jnp.float32)
  assert_close(grads.bias[...], dy.sum(0), jnp.float32)


def test_nm_linear_bfloat16_compute_and_params():
  layer = NMLinear(K, N, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  _randomize_bias(layer, 1)
  x = _normal(2, (4, K))
  y = layer(x)
  assert y.dtype == jnp.bfloat16 and layer.kernel.dtype == jnp.bfloat16
  ref = x.astype(jnp.bfloat16).astype(jnp.float32) @ _pruned(layer.kernel[...], 2, 4, 0).astype(jnp.float32)
  assert_close(y, ref + layer.bias[...].astype(jnp.float32), jnp.bfloat16)


def test_nm_linear_mask_follows_training():
  layer = NMLinear(8, 2, rngs=nnx.Rngs(0))
  layer.kernel[...] = jnp.array([[4.0, 1], [3, 2], [2, 3], [1, 4]] * 2)
  before = np.asarray(layer.mask)
  optimizer = nnx.Optimizer(layer, optax.sgd(1.0), wrt=nnx.Param)
  x = jnp.ones((1, 8))
  # Push the first column's small weights up: the mask is recomputed from the new weights.
  grads = nnx.grad(lambda m: -jnp.sum(m(x)[:, 0]) * 0)(layer)
  grads.kernel[...] = jnp.zeros((8, 2)).at[2:4, 0].set(-10.0)
  optimizer.update(layer, grads)
  after = np.asarray(layer.mask)
  np.testing.assert_array_equal(before[:4, 0], [True, True, False, False])
  np.testing.assert_array_equal(after[:4, 0], [False, False, True, True])


def test_nm_linear_state_is_just_params():
  layer = NMLinear(K, N, rngs=nnx.Rngs(0))
  _, params, rest = nnx.split(layer, nnx.Param, ...)
  assert {p for p, _ in nnx.to_flat_state(params)} == {("kernel",), ("bias",)}
  assert not list(nnx.to_flat_state(rest))
  assert nnx.graphdef(layer) == nnx.graphdef(NMLinear(K, N, rngs=nnx.Rngs(1)))  # one jit cache entry


def test_nm_linear_from_dense_to_dense_and_options():
  dense = nnx.Linear(K, N, dtype=jnp.float32, precision=jax.lax.Precision.HIGHEST, rngs=nnx.Rngs(0))
  _randomize_bias(dense, 1)
  layer = NMLinear.from_dense(dense, n=1, m=4, sr_ste_decay=0.0)
  np.testing.assert_array_equal(np.asarray(layer.kernel[...]), np.asarray(dense.kernel[...]))  # still dense
  assert layer.precision == jax.lax.Precision.HIGHEST and (layer.n, layer.m, layer.sr_ste_decay) == (1, 4, 0.0)
  x = _normal(2, (6, K))
  back = layer.to_dense()
  assert type(back) is nnx.Linear
  np.testing.assert_array_equal(np.asarray(back.kernel[...]), np.asarray(_pruned(dense.kernel[...], 1, 4, 0)))
  np.testing.assert_array_equal(np.asarray(back(x)), np.asarray(layer(x)))
  # from_dense of an NMLinear keeps its original promotion (no double pruning).
  again = NMLinear.from_dense(layer, n=2, m=4)
  assert again.promote_dtype.base is layer.promote_dtype.base


@pytest.mark.parametrize("use_bias", [True, False])
def test_to_compressed_matches_and_is_smaller(use_bias):
  layer = NMLinear(K, N, use_bias=use_bias, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  _randomize_bias(layer, 1)
  small = layer.to_compressed()
  assert isinstance(small, CompressedNMLinear)
  w = small.weight
  assert w.shape == (K, N) and w.values.shape == (K // 2, N) and w.indices.dtype == jnp.uint8
  assert w.nbytes / (K * N * 2) == pytest.approx(0.5625)
  x = _normal(2, (5, K), jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(small(x)), np.asarray(layer(x)))
  np.testing.assert_array_equal(np.asarray(small.to_dense()(x)), np.asarray(layer(x)))
  _, params, patterns = nnx.split(small, nnx.Param, SparsityPattern)
  assert {p for p, _ in nnx.to_flat_state(patterns)} == {("kernel_positions",)}
  assert ("kernel",) in {p for p, _ in nnx.to_flat_state(params)}


def test_compressed_values_can_be_fine_tuned():
  small = NMLinear(K, N, rngs=nnx.Rngs(0)).to_compressed(implementation="xla")
  x, dy = _normal(1, (4, K)), _normal(2, (4, N))
  grads = nnx.grad(lambda m: jnp.sum(m(x) * dy))(small)
  dense_grad = np.asarray(x.T @ dy)
  mask = np.asarray(small.weight.mask())
  kept = np.stack([dense_grad[mask[:, j], j] for j in range(N)], axis=1)  # dW at the kept positions
  assert_close(grads.kernel[...], kept, jnp.float32)


# -------------------------------------------------------------------------------------------------
# NMConv.
# -------------------------------------------------------------------------------------------------

CONV_OPTIONS = [
    {},
    {"strides": 2, "padding": "VALID"},
    {"padding": "CIRCULAR", "kernel_dilation": 2},
    {"feature_group_count": 2, "use_bias": False},
    {"input_dilation": 2, "padding": ((1, 0), (0, 1))},
    {"mask": "causal"},
]




def FAST_INIT(key, shape, dtype=jnp.float32):
  """Normal(0, 0.3) drawn 2-D: on this CPU jax 0.10 compiles a 4-D `jax.random.normal` for 10-30 s."""
  return 0.3 * jax.random.normal(key, (math.prod(shape[:-1]), shape[-1]), dtype).reshape(shape)


def _conv_kwargs(options, cin=8, cout=12, ks=(3, 3)):
  options = dict(options)
  if options.get("mask") == "causal":
    options["mask"] = jnp.ones((*ks, cin // options.get("feature_group_count", 1), cout)).at[2].set(0)
  return options


@pytest.mark.parametrize("options", CONV_OPTIONS)
def test_nm_conv_matches_nnx_conv_with_pruned_kernel(options):
  kw = _conv_kwargs(options)
  layer = NMConv(8, 12, (3, 3), kernel_init=FAST_INIT, rngs=nnx.Rngs(0), **kw)
  _randomize_bias(layer, 1)
  x = _normal(2, (2, 7, 7, 8))
  dense = layer.to_dense()
  assert type(dense) is nnx.Conv
  np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(dense(x)), rtol=1e-6, atol=1e-6)
  kernel = layer.kernel[...] if layer.mask is None else layer.kernel[...] * layer.mask
  np.testing.assert_array_equal(np.asarray(dense.kernel[...]) * (1 if layer.mask is None else np.asarray(layer.mask)),
                                np.asarray(_pruned(kernel, 2, 4, -2)))
  # Groups run along cin (axis -2): exactly 2 kept of every 4 input channels.
  per_group = np.asarray(layer.nm_mask).reshape(3, 3, -1, 4, 12).sum(3)
  assert np.all(per_group == 2)


def test_nm_conv_gradient_is_sr_ste_and_one_d_kernels():
  layer = NMConv(8, 4, 3, sr_ste_decay=0.1, kernel_init=FAST_INIT, rngs=nnx.Rngs(0))
  x = _normal(1, (2, 10, 8))
  g = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)
  w = layer.kernel[...]
  mask = layer.nm_mask
  dense = layer.to_dense()
  g_dense = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(dense)
  # Kept weights: the dense conv's gradient at the pruned kernel; pruned: that plus decay * w.
  assert_close(g.kernel[...], g_dense.kernel[...] + 0.1 * (~mask) * w, jnp.float32)


def test_nm_conv_from_dense_keeps_every_option_and_compresses():
  conv = nnx.Conv(8, 12, (3, 3), strides=2, padding="CIRCULAR", kernel_dilation=1, feature_group_count=2,
                  precision=jax.lax.Precision.HIGHEST, kernel_init=FAST_INIT, rngs=nnx.Rngs(0))
  _randomize_bias(conv, 1)
  layer = NMConv.from_dense(conv, n=1, m=4)
  for attr in ("strides", "padding", "feature_group_count", "precision", "kernel_size"):
    assert getattr(layer, attr) == getattr(conv, attr)
  np.testing.assert_array_equal(np.asarray(layer.kernel[...]), np.asarray(conv.kernel[...]))
  x = _normal(2, (2, 8, 8, 8))
  w = conv.kernel[...]
  conv.kernel[...] = _pruned(w, 1, 4, -2)
  np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(conv(x)), rtol=1e-6, atol=1e-6)
  packed = layer.to_compressed()
  assert packed.axis == 2 and packed.values.shape == (3, 3, 1, 12)
  np.testing.assert_array_equal(np.asarray(packed.to_dense()), np.asarray(conv.kernel[...]))


# -------------------------------------------------------------------------------------------------
# NNX vs Linen: identical outputs for the same parameters.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize(("n", "m", "decay"), [(2, 4, 2e-4), (1, 8, 0.0)])
def test_nm_dense_linen_matches_nnx(dtype, use_bias, n, m, decay):
  layer = NMLinear(K, N, n=n, m=m, sr_ste_decay=decay, use_bias=use_bias, dtype=dtype, rngs=nnx.Rngs(0))
  _randomize_bias(layer, 1)
  model = jlinen.NMDense(N, n=n, m=m, sr_ste_decay=decay, use_bias=use_bias, dtype=dtype)
  x = _normal(2, (3, K))
  variables = model.init(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, layer.to_linen_variables())
  variables = layer.to_linen_variables()
  np.testing.assert_array_equal(np.asarray(model.apply(variables, x)), np.asarray(layer(x)))
  # Gradients agree too (SR-STE on both sides).
  g_linen = jax.grad(lambda v: jnp.sum(model.apply(v, x).astype(jnp.float32) ** 2))(variables)
  g_nnx = nnx.grad(lambda mdl: jnp.sum(mdl(x).astype(jnp.float32) ** 2))(layer)
  np.testing.assert_array_equal(np.asarray(g_linen["params"]["kernel"]), np.asarray(g_nnx.kernel[...]))


@pytest.mark.parametrize("options", CONV_OPTIONS)
def test_nm_conv_linen_matches_nnx(options):
  kw = _conv_kwargs(options)
  layer = NMConv(8, 12, (3, 3), kernel_init=FAST_INIT, rngs=nnx.Rngs(0), **kw)
  _randomize_bias(layer, 1)
  model = jlinen.NMConv(12, (3, 3), kernel_init=FAST_INIT, **kw)
  x = _normal(2, (2, 7, 7, 8))
  variables = model.init(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, layer.to_linen_variables())
  np.testing.assert_array_equal(np.asarray(model.apply(layer.to_linen_variables(), x)), np.asarray(layer(x)))


def test_linen_layers_train_inside_a_model():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = jlinen.NMConv(8, (3, 3), n=2, m=4, kernel_init=FAST_INIT)(x)
      return jlinen.NMDense(4)(nn.relu(x).reshape(x.shape[0], -1))

  model = Net()
  x = _normal(0, (2, 4, 4, 4))
  params = model.init(jax.random.key(0), x)["params"]
  assert set(params) == {"NMConv_0", "NMDense_0"} and set(params["NMDense_0"]) == {"kernel", "bias"}
  grads = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, x) ** 2))(params)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_transposable_layers_nnx_linen_and_conversions():
  # The kernel is pruned with the transposable mask (N:M along the inputs and the outputs); value, SR-STE
  # gradients, the Linen twin, and the dense / compressed conversions all follow that mask.
  layer = NMLinear(K, N, sr_ste_decay=0.1, transposable=True, rngs=nnx.Rngs(0))
  _randomize_bias(layer, 1)
  kernel = layer.kernel[...]
  mask = np.asarray(layer.nm_mask)
  assert layer.transposable and (mask.reshape(K // 4, 4, N).sum(1) == 2).all()
  assert (mask.reshape(K, N // 4, 4).sum(2) == 2).all()
  np.testing.assert_array_equal(mask, np.asarray(jaxsparse.nm_mask(kernel, 2, 4, transposable=True)))
  x = _normal(2, (3, K))
  pruned = jnp.where(mask, kernel, 0.0)
  assert_close(layer(x), x @ pruned + layer.bias[...], jnp.float32)
  g = nnx.grad(lambda mdl: jnp.sum(mdl(x) ** 2))(layer).kernel[...]
  dy = 2 * (x @ pruned + layer.bias[...])
  assert_close(g, x.T @ dy + jnp.where(mask, 0.0, 0.1 * kernel), jnp.float32)
  model = jlinen.NMDense(N, sr_ste_decay=0.1, transposable=True)
  variables = layer.to_linen_variables()
  np.testing.assert_array_equal(np.asarray(model.apply(variables, x)), np.asarray(layer(x)))
  g_linen = jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2))(variables)["params"]["kernel"]
  np.testing.assert_array_equal(np.asarray(g_linen), np.asarray(g))
  assert_close(layer.to_dense()(x), layer(x), jnp.float32)
  assert_close(layer.to_compressed()(x), layer(x), jnp.float32)  # the transposable mask is N:M along K too
  assert NMLinear.from_dense(layer.to_dense(), transposable=True).transposable
  assert [entry.pattern for entry in jaxsparse.summary(layer).layers] == ["2:4 transposable"]
  assert [entry.pattern for entry in jaxsparse.summary(variables, x, module=model).layers] == ["2:4 transposable"]
  # Conv: N:M along cin and cout, NNX and Linen alike.
  conv = NMConv(8, 12, (3, 3), transposable=True, kernel_init=FAST_INIT, rngs=nnx.Rngs(0))
  cmask = np.asarray(conv.nm_mask)
  assert (cmask.reshape(3, 3, 2, 4, 12).sum(3) == 2).all() and (cmask.reshape(3, 3, 8, 3, 4).sum(4) == 2).all()
  xc = _normal(3, (2, 7, 7, 8))
  assert_close(conv(xc), conv.to_dense()(xc), jnp.float32)
  linen_conv = jlinen.NMConv(12, (3, 3), transposable=True, kernel_init=FAST_INIT)
  np.testing.assert_array_equal(np.asarray(linen_conv.apply(conv.to_linen_variables(), xc)), np.asarray(conv(xc)))
  plain = NMConv(8, 12, (3, 3), kernel_init=FAST_INIT, rngs=nnx.Rngs(0))
  assert not np.array_equal(np.asarray(plain.nm_mask), cmask)


# -------------------------------------------------------------------------------------------------
# Bad input.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"in_features": 30}, ValueError, r"in_features=30 must be a multiple of m=4"),
        ({"n": 4}, ValueError, r"n=4 with m=4"),
        ({"n": 2.5}, TypeError, r"n must be an int, got n=2.5"),
        ({"m": True}, TypeError, r"m must be an int, got m=True"),
        ({"sr_ste_decay": -0.1}, ValueError, r"sr_ste_decay must be a float >= 0.*sr_ste_decay=-0.1"),
        ({"sr_ste_decay": float("inf")}, ValueError, r"sr_ste_decay must be a float >= 0 and finite.*=inf"),
        ({"out_features": 10, "transposable": True}, ValueError, r"out_features=10 a multiple of m=4"),
        ({"n": 4, "m": 8, "transposable": True}, ValueError, r"transposable=True needs m <= 4"),
        ({"transposable": "yes"}, TypeError, r"transposable must be a bool, got transposable='yes'"),
    ],
)
def test_nm_linear_bad_arguments(kwargs, error, match):
  args = {"in_features": K, "out_features": N, **kwargs}
  with pytest.raises(error, match=match):
    NMLinear(args.pop("in_features"), args.pop("out_features"), rngs=nnx.Rngs(0), **args)


def test_nm_conv_and_conversion_bad_arguments():
  with pytest.raises(ValueError, match=r"in_features // feature_group_count=3 must be a multiple of m=4"):
    NMConv(6, 8, (3, 3), feature_group_count=2, kernel_init=FAST_INIT, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"feature_group_count=4 must divide in_features=6 and out_features=8"):
    NMConv(6, 8, (3, 3), feature_group_count=4, kernel_init=FAST_INIT, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"linear must be a flax\.nnx\.Linear, got Conv"):
    NMLinear.from_dense(nnx.Conv(8, 8, 3, kernel_init=FAST_INIT, rngs=nnx.Rngs(0)))
  with pytest.raises(TypeError, match=r"conv must be a flax\.nnx\.Conv, got Linear"):
    NMConv.from_dense(nnx.Linear(8, 8, rngs=nnx.Rngs(0)))
  with pytest.raises(TypeError, match=r"2-D jaxsparse\.NMSparseMatrix, got ArrayImpl of shape \(8, 4\);"):
    CompressedNMLinear(jnp.ones((8, 4)))  # named by type and shape, not a printout of the array


def test_to_compressed_refuses_a_custom_dot_general():
  # CompressedNMLinear multiplies with nm_matmul: it silently dropped the layer's dot_general (here 2x the product).
  def twice(a, b, *args, **kwargs):
    return 2 * lax.dot_general(a, b, *args, **kwargs)

  layer = NMLinear(K, N, dot_general=twice, rngs=nnx.Rngs(0))
  x = _normal(1, (3, K))
  expected = 2 * (x @ _pruned(layer.kernel[...], 2, 4, 0)) + layer.bias[...]
  np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(expected), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match=r"to_compressed cannot keep this layer's custom dot_general=.*twice"):
    layer.to_compressed()
  np.testing.assert_array_equal(np.asarray(layer.to_dense()(x)), np.asarray(layer(x)))  # to_dense keeps it


@pytest.mark.parametrize(("n", "m"), [(2, 4), (1, 4)])
def test_nm_layers_name_wrong_input_features(n, m):
  # 2:4 said "x must be (..., K) and w (K, N)", other N:M Flax's dot_general error; neither named the layer.
  layer = NMLinear(16, 8, n=n, m=m, rngs=nnx.Rngs(0))
  for bad in (jnp.ones((2, 12)), jnp.ones(())):
    with pytest.raises(ValueError, match=r"NMLinear has in_features=16: inputs must have shape \(\.\.\., 16\)"):
      layer(bad)
  conv = NMConv(8, 4, 3, n=n, m=m, kernel_init=FAST_INIT, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"NMConv has in_features=8: inputs must have shape \(\.\.\., 8\), got "
                     r"inputs.shape=\(2, 5, 12\)"):
    conv(jnp.ones((2, 5, 12)))
  assert conv(jnp.ones((2, 5, 8))).shape == (2, 5, 4)


def test_linen_bad_arguments():
  with pytest.raises(ValueError, match=r"n=4 with m=4"):
    jlinen.NMDense(4, n=4, m=4)
  with pytest.raises(ValueError, match=r"sr_ste_decay=-1"):
    jlinen.NMConv(4, (3, 3), sr_ste_decay=-1)
  with pytest.raises(ValueError, match=r"features=10 a multiple of m=4"):
    jlinen.NMDense(10, transposable=True)
  with pytest.raises(ValueError, match=r"out_features=6 a multiple of m=4"):
    NMConv(8, 6, (3, 3), transposable=True, kernel_init=FAST_INIT, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"x.shape\[-1\]=6 must be a multiple of m=4"):
    jlinen.NMDense(4).init(jax.random.key(0), jnp.ones((1, 6)))
  with pytest.raises(ValueError, match=r"in_channels // feature_group_count=6 must be a multiple of m=4"):
    jlinen.NMConv(4, (3, 3)).init(jax.random.key(0), jnp.ones((1, 5, 5, 6)))


def test_nm_convs_name_feature_groups_that_do_not_divide_the_channels():
  # Linen: 10 input channels in 4 groups passed the N:M check (10 // 4 = 2, a multiple of m=2) and hit nn.Conv's bare
  # AssertionError; NNX: out_features=6 in 4 groups failed at the first call in lax, and True was taken as 1 group.
  with pytest.raises(ValueError, match=r"feature_group_count=4 must divide in_channels \(x.shape\[-1\]\)=10 and "
                     r"features=8"):
    jlinen.NMConv(8, (3,), n=1, m=2, feature_group_count=4).init(jax.random.key(0), jnp.ones((1, 5, 10)))
  with pytest.raises(ValueError, match=r"feature_group_count=4 must divide in_features=16 and out_features=6"):
    NMConv(16, 6, (3,), feature_group_count=4, kernel_init=FAST_INIT, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"feature_group_count must be a positive int, got True"):
    NMConv(8, 8, (3,), feature_group_count=True, kernel_init=FAST_INIT, rngs=nnx.Rngs(0))


# -------------------------------------------------------------------------------------------------
# SR-STE on real data (reduced examples/sr_ste_digits.py).
# -------------------------------------------------------------------------------------------------


def _load_example():
  path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "sr_ste_digits.py"
  spec = importlib.util.spec_from_file_location("sr_ste_digits", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_sr_ste_digits_reduced_within_one_point_of_dense():
  example = _load_example()
  results = example.run(steps=300, seeds=(0,), hidden=128)
  acc = {kind: example.mean_accuracy(rs) for kind, rs in results.items()}
  assert acc["dense"] > 0.95, acc
  assert acc["sr_ste"] >= acc["dense"] - 0.01, acc  # 2:4 on every layer, trained from scratch
  assert acc["sr_ste_t"] >= acc["dense"] - 0.01, acc  # ... with transposable masks on the hidden layers
  assert acc["ste"] > 0.9, acc
  assert results["sr_ste"][0]["late_mask_flips"] is not None


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_nm_dense_linen_2_4_goes_through_sr_ste_matmul(monkeypatch, dtype):
  # 2:4 NMDense with Flax's defaults uses ops.sr_ste_matmul (sparse tensor cores on a GPU), with the value
  # and gradients of the nn.Dense path (a custom dot_general keeps the layer on that path).
  calls, real = [], ops.sr_ste_matmul
  monkeypatch.setattr(ops, "sr_ste_matmul", lambda *a, **k: calls.append(k) or real(*a, **k))
  model = jlinen.NMDense(N, n=2, m=4, sr_ste_decay=0.1, dtype=dtype)
  plain = jlinen.NMDense(N, n=2, m=4, sr_ste_decay=0.1, dtype=dtype, dot_general=lax.dot_general)
  x = _normal(2, (2, 3, K))
  variables = model.init(jax.random.key(0), x)
  variables = jax.tree.map(lambda v: v + _normal(3, v.shape), variables)  # a non-zero bias
  assert not calls  # init builds nn.Dense's parameters
  loss = lambda mdl: lambda v: jnp.sum(jnp.sin(mdl.apply(v, x).astype(jnp.float32)))
  (y, g), (y_ref, g_ref) = (jax.value_and_grad(loss(mdl))(variables) for mdl in (model, plain))
  assert len(calls) == 1 and calls[0]["dtype"] == (dtype or jnp.float32)
  np.testing.assert_allclose(y, y_ref, rtol=1e-6 if dtype is None else 1e-2)
  for name in ("kernel", "bias"):
    atol = 1e-6 if dtype is None else 1e-2
    np.testing.assert_allclose(g["params"][name], g_ref["params"][name], rtol=1e-5, atol=atol)


def test_nm_linear_takes_a_concrete_jax_scalar_decay():
  # As ops.sr_ste does: a 0-d array (a schedule's value outside jit) is a number.
  layer = NMLinear(K, N, sr_ste_decay=jnp.float32(2e-4), rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (3, K))
  np.testing.assert_allclose(layer(x), NMLinear(K, N, sr_ste_decay=2e-4, rngs=nnx.Rngs(0))(x), rtol=1e-6)


# -------------------------------------------------------------------------------------------------
# CompressedNMLinear and the XLA path of nm_matmul (bug bash).
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "m", "axis"), [(2, 4, 0), (1, 2, 1), (4, 8, 0), (3, 16, 1)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_nm_matmul_keeps_preferred_element_type_digits(n, m, axis, dtype):
  # The XLA path multiplied in the operands' dtype and cast after: float32 outputs carried bfloat16's 3 digits.
  w = jaxsparse.NMSparseMatrix.from_dense(_normal(0, (64, 48), dtype), n, m, axis=axis)
  x = _normal(1, (5, 64), dtype)
  expected = jnp.matmul(x.astype(jnp.float32), w.to_dense().astype(jnp.float32), precision="highest")
  for y in (ops.nm_matmul(x, w, preferred_element_type=jnp.float32),
            jax.jit(lambda x, w: ops.nm_matmul(x, w, preferred_element_type=jnp.float32))(x, w),
            CompressedNMLinear(w, dtype=dtype, preferred_element_type=jnp.float32)(x)):
    assert y.dtype == jnp.float32
    assert_close(y, expected, jnp.float32)  # rel. 1e-5; bfloat16 rounding of the result is ~1e-3
  assert_close(ops.nm_matmul(x, w), expected, dtype)  # the default output dtype is the operands'


def test_compressed_nm_linear_names_wrong_input_features():
  # It raised nm_matmul's "x must have shape (..., K) with K = w.shape[0]", naming neither the layer nor inputs.
  layer = NMLinear(16, 8, rngs=nnx.Rngs(0)).to_compressed()
  for bad in (jnp.ones((2, 12)), jnp.ones(())):
    with pytest.raises(ValueError, match=r"CompressedNMLinear has in_features=16: inputs must have shape "
                       r"\(\.\.\., 16\), got inputs.shape=\((2, 12)?\)"):
      layer(bad)
  x = _normal(0, (2, 3, 16))
  assert_close(layer(x), x @ layer.weight.to_dense() + layer.bias[...], jnp.float32)


def test_linen_nm_conv_kernel_size_is_checked():
  # A 0 failed on a ZeroDivisionError in the initializer, a NumPy int as "not iterable", a bool built a layer.
  x = jnp.ones((1, 5, 4))
  for ks in (0, -3, (0, 3), True, 3.0, None):
    with pytest.raises(ValueError, match=r"kernel_size must be a positive int or a sequence of positive ints"):
      jlinen.NMConv(4, ks).init(jax.random.key(0), x)
  variables = jlinen.NMConv(4, np.int64(3)).init(jax.random.key(0), x)
  assert variables["params"]["kernel"].shape == (3, 4, 4)
