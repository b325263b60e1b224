"""``sparsify`` / ``sparsify_linen`` of Flax models and layers beyond the MLPs: attention, convs of every rank with
groups and strides, ``LinearGeneral`` over several axes, tied layers, ``nnx.Sequential`` / ``nnx.List``, Linen lifted
transforms, Flax's example CNN and a transformer block. Each supported layer converts with outputs equal to the pruned
dense model (``densify``); each unsupported one stays dense and is named in the report."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsparse

SPECS = {"nm": jaxsparse.NM(2, 4), "unstructured": jaxsparse.Unstructured(sparsity=0.5),
         "block": jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8))}
NOT_TAKEN = "left dense: sparsify does not take this layer"


def _row(report, path):
  return next(c for c in report.layers if c.path == path)


def test_nnx_layers_sparsify_does_not_take_are_named_in_the_report():
  # Was: an nnx.Einsum / nnx.ConvTranspose matched by a rule stayed dense with no word (no row, no warning).
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.einsum = nnx.Einsum("bi,ij->bj", (32, 16), rngs=rngs)
      self.fc = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
      return self.fc(self.einsum(x))

  sparse, report = jaxsparse.sparsify(Net(nnx.Rngs(0)), jaxsparse.NM(2, 4))
  row = _row(report, "einsum")
  assert (row.layer, row.replaced_by, row.density, row.bytes_before) == ("Einsum((32, 16))", None, 1.0, 32 * 16 * 4)
  assert NOT_TAKEN in row.note and type(sparse.einsum) is nnx.Einsum
  assert _row(report, "fc").replaced_by == "NMLinear" and len(report.replaced) == 1


@pytest.mark.slow  # ~3 s on 2 cores
def test_linen_layers_sparsify_linen_does_not_take_are_named_in_the_report():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      y = nn.ConvTranspose(8, (3,), name="up")(x)
      return nn.Dense(8, name="fc")(y) + nn.Einsum((8, 8), "btf,fg->btg", name="mix")(y)

  x = jnp.ones((2, 5, 8))
  module = Net()
  variables = module.init(jax.random.key(0), x)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the rule selects a layer: no "matched no layer" warning
    _, _, report = jaxsparse.sparsify_linen(module, variables, jaxsparse.NM(2, 4), x)
  assert [(c.path, c.layer, c.replaced_by) for c in report.layers] == [
      ("fc", "Dense((8, 8))", "NMDense"), ("mix", "Einsum((8, 8))", None), ("up", "ConvTranspose((3, 8, 8))", None)]
  assert all(NOT_TAKEN in c.note for c in report.layers[1:])


def test_linear_general_with_a_batch_axis_is_named_as_such():
  # Was: "its kernel has shape (3, 8, 16) ... a stacked (scan-over-layers, nnx.vmap) layer?" for a batch_axis kernel.
  layer = nnx.LinearGeneral(8, 16, axis=-1, batch_axis={0: 3}, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"batch_axis=\{0: 3\} is not supported"):
    jaxsparse.sparsify(layer, jaxsparse.NM(2, 4))


class _Tied(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(32, 32, rngs=rngs)
    self.b = self.a
    self.stack = nnx.List([nnx.Linear(32, 32, rngs=rngs) for _ in range(2)])

  def __call__(self, x):
    for layer in self.stack:
      x = layer(x)
    return self.b(jax.nn.relu(self.a(x)))


class _CNN(nnx.Module):  # Flax's NNX MNIST example, smaller
  def __init__(self, rngs):
    self.conv1 = nnx.Conv(1, 8, (3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(8, 16, (3, 3), feature_group_count=2, strides=2, rngs=rngs)
    self.linear1 = nnx.Linear(16 * 4 * 4, 32, rngs=rngs)
    self.linear2 = nnx.Linear(32, 8, rngs=rngs)

  def __call__(self, x):
    x = nnx.avg_pool(nnx.relu(self.conv1(x)), window_shape=(2, 2), strides=(2, 2))
    x = nnx.relu(self.conv2(x)).reshape(x.shape[0], -1)
    return self.linear2(nnx.relu(self.linear1(x)))


_key = jax.random.key(1)
NNX_MODELS = {  # name -> (builder, input, rules for a spec, paths each spec replaces)
    "attention": (lambda r: nnx.MultiHeadAttention(4, 32, decode=False, rngs=r), jax.random.normal(_key, (2, 5, 32)),
                  lambda s: s, {"query", "key", "value", "out"}),
    "general_two_axes": (lambda r: nnx.LinearGeneral((4, 8), 16, axis=(-2, -1), rngs=r),
                         jax.random.normal(_key, (2, 4, 8)), lambda s: s, {""}),
    "conv_1d": (lambda r: nnx.Conv(16, 32, (3,), rngs=r), jax.random.normal(_key, (2, 8, 16)), lambda s: s, {""}),
    "conv_3d": (lambda r: nnx.Conv(8, 16, (3, 3, 3), strides=(1, 2, 1), padding="VALID", rngs=r),
                jax.random.normal(_key, (2, 6, 6, 6, 8)), lambda s: s, {""}),
    "tied_and_list": (_Tied, jax.random.normal(_key, (2, 32)), lambda s: s, {"a", "stack.0", "stack.1"}),
    "sequential": (lambda r: nnx.Sequential(nnx.Linear(32, 64, rngs=r), jax.nn.relu, nnx.Linear(64, 32, rngs=r)),
                   jax.random.normal(_key, (2, 32)), lambda s: s, {"layers.0", "layers.2"}),
    "cnn": (_CNN, jax.random.normal(_key, (2, 16, 16, 1)),
            lambda s: {"conv1": None, "conv.*": None if isinstance(s, jaxsparse.BlockSparse) else s, ".*": s},
            {"conv2", "linear1", "linear2"}),
}


@pytest.mark.slow  # ~25 s on 2 cores
@pytest.mark.parametrize("name", sorted(NNX_MODELS))
def test_nnx_models_match_the_pruned_dense_model(name):
  build, x, rules, paths = NNX_MODELS[name]
  for spec_name, spec in SPECS.items():
    conv = name.startswith("conv")
    if conv and spec_name == "block":  # BlockSparse on a conv raises, naming the layer (test_sparsify)
      continue
    sparse, report = jaxsparse.sparsify(build(nnx.Rngs(0)), rules(spec))
    expected = {p for p in paths if not (spec_name == "block" and p == "conv2")}
    assert {c.path for c in report.replaced} == expected, (spec_name, report)
    np.testing.assert_allclose(sparse(x), jaxsparse.densify(sparse)(x), rtol=1e-5, atol=1e-5)
  if name == "tied_and_list":
    assert sparse.a is sparse.b


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    y = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32)(y, y)
    y = nn.Dense(32)(nn.gelu(nn.Dense(128)(nn.LayerNorm()(x))))
    return x + y


class _LinenCNN(nn.Module):  # Flax's Linen MNIST example, smaller
  @nn.compact
  def __call__(self, x):
    x = nn.avg_pool(nn.relu(nn.Conv(8, (3, 3))(x)), window_shape=(2, 2), strides=(2, 2))
    x = nn.avg_pool(nn.relu(nn.Conv(16, (3, 3), feature_group_count=2)(x)), window_shape=(2, 2), strides=(2, 2))
    return nn.Dense(8)(nn.relu(nn.Dense(32)(x.reshape(x.shape[0], -1))))


class _Remat(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.remat(nn.Dense)(32)(jax.nn.relu(nn.remat(nn.Dense)(64)(x)))


LINEN_MODELS = {
    "transformer_block": (_Block(), jax.random.normal(_key, (2, 5, 32)), 6),
    "cnn": (_LinenCNN(), jax.random.normal(_key, (2, 16, 16, 1)), 4),
    "remat": (_Remat(), jax.random.normal(_key, (2, 32)), 2),
    "dense_general_two_axes": (nn.DenseGeneral(16, axis=(-2, -1)), jax.random.normal(_key, (2, 4, 8)), 1),
    "conv_3d_strided": (nn.Conv(16, (3, 3, 3), strides=2, padding="VALID"), jax.random.normal(_key, (2, 7, 7, 7, 8)),
                        1),
}


@pytest.mark.slow  # ~30 s on 2 cores
@pytest.mark.parametrize("name", sorted(LINEN_MODELS))
def test_linen_models_match_the_pruned_dense_model(name):
  module, x, n_layers = LINEN_MODELS[name]
  variables = module.init(jax.random.key(0), x)
  for spec_name, spec in SPECS.items():
    rules = {"Conv_0": None, ".*": spec} if name == "cnn" else spec  # 1 input channel: no N:M groups
    if spec_name == "block" and name in ("cnn", "conv_3d_strided"):
      rules = {"Conv_.*": None, ".*": spec} if name == "cnn" else None
    if rules is None:
      continue
    sparse, sparse_vars, report = jaxsparse.sparsify_linen(module, variables, rules, x)
    assert len(report.replaced) == n_layers - (name == "cnn") - (name == "cnn" and spec_name == "block"), report
    dense, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
    np.testing.assert_allclose(sparse.apply(sparse_vars, x), dense.apply(dense_vars, x), rtol=1e-5, atol=1e-5)
