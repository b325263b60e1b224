"""Sparse layers under Flax transforms: NNX stacks of layers built by nnx.vmap and run by nnx.scan, optimizer steps
that must leave the pattern alone, and Linen layers under nn.scan / nn.remat / nn.jit, against plain-jnp dense
references (float32, 1e-5)."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxsparse
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import MaskedLinear
from jaxsparse.layers import NMLinear
from jaxsparse.layers import SparsityPattern
from jaxsparse.layers import linen
from jaxsparse.layers.linen import SPARSITY

TOL = 1e-5
LAYERS = 4  # a multiple of m = 4: a mask computed along the stack axis would not raise


def _build(kind: str, rngs: nnx.Rngs) -> nnx.Module:
  if kind == "block_sparse":
    return BlockSparseLinear(32, 32, density=0.5, block_shape=(8, 8), rngs=rngs)
  if kind == "masked":
    return MaskedLinear(32, 32, sparsity=0.5, rngs=rngs)
  if kind == "nm":
    return NMLinear(32, 32, rngs=rngs)
  if kind == "nm_transposable":
    return NMLinear(32, 32, transposable=True, rngs=rngs)
  assert kind == "compressed_nm"
  return NMLinear(32, 32, rngs=rngs).to_compressed()


def _stack(kind: str) -> nnx.Module:
  @nnx.split_rngs(splits=LAYERS)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs):
    return _build(kind, rngs)

  return create(nnx.Rngs(0))


def _dense_weight(kind: str, layer: nnx.Module) -> jax.Array:
  """One layer's dense ``(in, out)`` weight, zero where pruned, from its variables with plain jnp."""
  if kind == "block_sparse":
    bk, bn = layer.block_shape
    rows, cols = np.asarray(layer.pattern["row_indices"][...]), np.asarray(layer.pattern["col_indices"][...])
    w = jnp.zeros((layer.in_features, layer.out_features), jnp.float32)
    for b, (i, j) in enumerate(zip(rows, cols, strict=True)):
      w = w.at[i * bk:(i + 1) * bk, j * bn:(j + 1) * bn].set(layer.kernel[...][b])
    return w
  if kind == "masked":
    return layer.kernel[...] * layer.mask[...]
  if kind.startswith("nm"):
    k = layer.kernel[...]
    return jnp.where(jaxsparse.nm_mask(k, 2, 4, axis=0, transposable=kind == "nm_transposable"), k, 0.0)
  return layer.weight.to_dense()


def _layer(stack: nnx.Module, i: int) -> nnx.Module:
  graphdef, state = nnx.split(stack)
  return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))


def _max_err(a, b) -> float:
  return float(jnp.max(jnp.abs(jnp.asarray(a) - jnp.asarray(b))))


# -------------------------------------------------------------------------------------------------
# NNX: a stack of layers built by nnx.vmap, run by nnx.scan.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["block_sparse", "masked", "nm", "compressed_nm"])
def test_nnx_scan_over_stack_matches_dense_layers(kind):
  stack = _stack(kind)
  x = jax.random.normal(jax.random.key(1), (4, 32))

  @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
  def forward(h, layer):
    return jnp.tanh(layer(h))

  def loss(stack, x):
    return jnp.sum(forward(x, stack) ** 2)

  def dense_loss(weights, biases, x):
    for w, b in zip(weights, biases, strict=True):
      x = jnp.tanh(x @ w + b)
    return jnp.sum(x ** 2)

  layers = [_layer(stack, i) for i in range(LAYERS)]
  weights = [_dense_weight(kind, layer) for layer in layers]
  biases = [layer.bias[...] for layer in layers]
  assert len({np.asarray(w != 0).tobytes() for w in weights}) == LAYERS  # each layer its own pattern
  value, grads = nnx.value_and_grad(loss)(stack, x)
  assert abs(float(value) - float(dense_loss(weights, biases, x))) <= TOL * abs(float(value))
  dense_bias_grads = jax.grad(dense_loss, argnums=1)(weights, biases, x)
  assert _max_err(grads["bias"][...], jnp.stack(dense_bias_grads)) <= TOL
  assert not nnx.state(grads, SparsityPattern)  # the pattern gets no gradient


@pytest.mark.parametrize("kind", ["block_sparse", "masked", "compressed_nm"])
def test_optimizer_over_stack_leaves_pattern_exact(kind):
  stack = _stack(kind)
  pattern = jax.tree.map(np.asarray, nnx.state(stack, SparsityPattern))
  opt = nnx.Optimizer(stack, optax.adamw(1e-2, weight_decay=0.1), wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(1), (4, 32))

  @nnx.jit(donate_argnums=(0, 1))
  def step(stack, opt):
    def loss(stack):
      return jnp.sum(nnx.scan(lambda h, layer: (layer(h), None), in_axes=(nnx.Carry, 0))(x, stack)[0] ** 2)

    grads = nnx.grad(loss)(stack)
    opt.update(stack, grads)

  for _ in range(20):
    step(stack, opt)
  after = nnx.state(stack, SparsityPattern)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), pattern, after))
  if kind == "masked":  # the kernel stays exactly zero where the mask prunes (weight decay included)
    assert not np.any(np.where(np.asarray(stack.mask[...]), 0.0, np.asarray(stack.kernel[...])))


def test_stacked_block_sparse_density_is_per_layer():
  # nnz_blocks read kernel.shape[0], the stack axis, so a stack of 4 layers of 8 kept blocks said density 0.25.
  stack = _stack("block_sparse")
  assert stack.kernel.shape == (LAYERS, 8, 8, 8)
  assert stack.nnz_blocks == _layer(stack, 0).nnz_blocks == 8
  assert stack.density == 0.5 and stack.sparsity == 0.5


@pytest.mark.parametrize("kind", ["nm", "nm_transposable"])
def test_stacked_nm_mask_is_each_layers_mask(kind):
  # nm_mask grouped along axis 0, the stack axis: with 4 layers it silently returned a mask of groups across layers.
  stack = _stack(kind)
  mask = np.asarray(stack.mask)
  assert mask.shape == (LAYERS, 32, 32)
  for i in range(LAYERS):
    layer = _layer(stack, i)
    expected = np.asarray(_dense_weight(kind, layer) != 0)
    np.testing.assert_array_equal(mask[i], expected)
    np.testing.assert_array_equal(mask[i], np.asarray(layer.mask))
    np.testing.assert_array_equal(np.asarray(stack.pruned_kernel()[i]), np.asarray(_dense_weight(kind, layer)))


# -------------------------------------------------------------------------------------------------
# Linen: the "sparsity" collection under lifted transforms.
# -------------------------------------------------------------------------------------------------

LINEN_LAYERS = {
    "block_sparse": lambda: linen.BlockSparseDense(32, density=0.5, block_shape=(8, 8)),
    "masked": lambda: linen.MaskedDense(32, sparsity=0.5),
    "compressed_nm": lambda: linen.CompressedNMDense(32),
    "embed": lambda: linen.CompressedNMEmbed(32, 32),
}


def _linen_input(kind):
  return jnp.arange(4) if kind == "embed" else jax.random.normal(jax.random.key(1), (4, 32))


def _step_module(kind):
  class Step(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      if kind == "embed":  # ids in, ids out: the rows go to the scan's per-step outputs
        return h, LINEN_LAYERS[kind]()(h)
      return jnp.tanh(LINEN_LAYERS[kind]()(h)), None

  return Step


@pytest.mark.parametrize("kind", sorted(LINEN_LAYERS))
def test_linen_scan_with_sparsity_axes_matches_each_step(kind):
  step = _step_module(kind)
  scan = nn.scan(step, variable_axes={"params": 0, SPARSITY: 0}, split_rngs={"params": True}, length=3)
  x = _linen_input(kind)
  variables = scan().init(jax.random.key(0), x, None)
  h, ys = scan().apply(variables, x, None)
  ref_h, ref_ys = x, []
  for i in range(3):
    ref_h, y = step().apply(jax.tree.map(lambda a, i=i: a[i], variables), ref_h, None)
    ref_ys.append(y)
  assert _max_err(h, ref_h) <= TOL
  if kind == "embed":
    assert _max_err(ys, jnp.stack(ref_ys)) <= TOL
  patterns = jax.tree.leaves(variables[SPARSITY])
  assert not all(np.array_equal(p[0], p[1]) for p in patterns)  # each step its own pattern


@pytest.mark.parametrize("kind", sorted(LINEN_LAYERS))
def test_linen_scan_without_sparsity_axes_says_how(kind):
  # Flax's own errors ("the collection is empty", "collection 'sparsity' is immutable") said neither why nor how.
  x = _linen_input(kind)
  params_only = nn.scan(_step_module(kind), variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
  with pytest.raises(ValueError, match=r"variable_axes=\{'params': 0, 'sparsity': 0\}"):
    params_only().init(jax.random.key(0), x, None)
  both = nn.scan(_step_module(kind), variable_axes={"params": 0, SPARSITY: 0}, split_rngs={"params": True}, length=3)
  variables = both().init(jax.random.key(0), x, None)
  with pytest.raises(ValueError, match=r"has no 'sparsity' collection.*variable_axes=\{'params': 0, 'sparsity': 0\}"):
    params_only().apply(variables, x, None)


@pytest.mark.parametrize("transform", [nn.remat, nn.jit])
@pytest.mark.parametrize("kind", [k if k == "embed" else pytest.param(k, marks=pytest.mark.slow)
                                  for k in sorted(LINEN_LAYERS)])
def test_linen_remat_and_jit_match_plain(kind, transform):
  # The Linen CompressedNMEmbed raised "has no 'sparsity' collection" under nn.remat / nn.jit, even in init: Flax
  # runs setup once on an empty scope before a lifted transform.
  layer = LINEN_LAYERS[kind]()
  lifted = transform(type(layer))(**{f: getattr(layer, f) for f in layer.__dataclass_fields__
                                     if f not in ("parent", "name", "_")})
  x = _linen_input(kind)
  variables = layer.init(jax.random.key(0), x)
  lifted_variables = lifted.init(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, lifted_variables) == jax.tree.map(jnp.shape, variables)
  assert _max_err(lifted.apply(variables, x), layer.apply(variables, x)) <= TOL

  def loss(params, module):
    return jnp.sum(module.apply({**variables, "params": params}, x) ** 2 if kind != "embed" else
                   module.apply({**variables, "params": params}, x, method="attend") ** 2)

  if kind == "embed":
    x = jax.random.normal(jax.random.key(2), (3, 32))
  grads, lifted_grads = jax.grad(loss)(variables["params"], layer), jax.grad(loss)(variables["params"], lifted)
  assert max(jax.tree.leaves(jax.tree.map(_max_err, lifted_grads, grads))) <= TOL
  with pytest.raises(ValueError, match="has no 'sparsity' collection"):
    lifted.apply({"params": variables["params"]}, x if kind != "embed" else jnp.arange(2))


# -------------------------------------------------------------------------------------------------
# Converting a stack of layers.
# -------------------------------------------------------------------------------------------------


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_masked_to_dense_on_stack_says_how():
  # MaskedLinear.to_dense() on a stack built by nnx.vmap raised "Linear.__init__() takes 3 positional arguments but
  # 4 ... were given" (MaskedConv: "Cannot broadcast to shape with fewer dimensions"). It now names the stack and the
  # per-layer call, which gives each layer's dense weights.
  stack = _stack("masked")
  with pytest.raises(ValueError, match=r"MaskedLinear\.to_dense\(\).*kernel has shape \(4, 32, 32\).*nnx\.vmap\("):
    stack.to_dense()
  dense = nnx.vmap(lambda layer: layer.to_dense(), in_axes=0, out_axes=0)(stack)
  assert type(dense) is nnx.Linear and dense.kernel.shape == (LAYERS, 32, 32)
  x = jax.random.normal(jax.random.key(1), (4, 32))
  for i in range(LAYERS):
    layer = _layer(stack, i)
    assert _max_err(_layer(dense, i)(x), x @ _dense_weight("masked", layer) + layer.bias[...]) <= TOL

  @nnx.split_rngs(splits=LAYERS)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def convs(rngs):
    return jaxsparse.layers.MaskedConv(4, 8, (3,), sparsity=0.5, rngs=rngs)

  with pytest.raises(ValueError, match=r"MaskedConv\.to_dense\(\).*kernel has shape \(4, 3, 4, 8\)"):
    convs(nnx.Rngs(0)).to_dense()


# -------------------------------------------------------------------------------------------------
# Models made by jaxsparse.sparsify / sparsify_linen under Flax transforms.
# -------------------------------------------------------------------------------------------------


class _SparsifiedBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.Linear(32, 32, rngs=rngs)
    self.down = nnx.Linear(32, 32, rngs=rngs)
    self.out = nnx.Linear(32, 32, rngs=rngs)

  def __call__(self, x):
    h = nnx.remat(lambda block, x: jnp.tanh(block.down(jnp.tanh(block.up(x)))))(self, x)
    return self.out(h)


def test_sparsified_nnx_model_under_jit_remat_and_optimizer():
  # sparsify's layers inside nnx.remat, under nnx.jit, through optimizer steps: each step's loss is the plain-jnp
  # dense model's on the masked weights, and the patterns (and the pruned zeros) stay as they were.
  rules = {"up": jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8)), "down": jaxsparse.NM(2, 4),
           "out": jaxsparse.Unstructured(0.5)}
  model, _ = jaxsparse.sparsify(_SparsifiedBlock(nnx.Rngs(0)), rules)
  assert [type(getattr(model, n)).__name__ for n in rules] == ["BlockSparseLinear", "NMLinear", "MaskedLinear"]
  pattern = jax.tree.map(np.asarray, nnx.state(model, SparsityPattern))
  out_mask = np.asarray(model.out.mask[...])
  opt = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.1), wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(1), (4, 32))

  @nnx.jit
  def step(model, opt):
    loss, grads = nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)
    opt.update(model, grads)
    return loss

  for _ in range(3):
    kinds = {"up": "block_sparse", "down": "nm", "out": "masked"}
    w = {n: _dense_weight(k, getattr(model, n)) for n, k in kinds.items()}
    b = {n: getattr(model, n).bias[...] for n in kinds}
    h = jnp.tanh(jnp.tanh(x @ w["up"] + b["up"]) @ w["down"] + b["down"])
    expected = float(jnp.sum((h @ w["out"] + b["out"]) ** 2))
    assert abs(float(step(model, opt)) - expected) <= TOL * abs(expected)
  after = jax.tree.map(np.asarray, nnx.state(model, SparsityPattern))
  assert jax.tree.all(jax.tree.map(lambda a, c: bool(np.array_equal(a, c)), pattern, after))
  assert not np.any(np.where(out_mask, 0.0, np.asarray(model.out.kernel[...])))


class _Inner(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(32, name="proj")(x)


class _SharedScope(nn.Module):
  def setup(self):
    self.inner = _Inner()
    nn.share_scope(self, self.inner)  # inner's Dense lives at "shared.proj", not "shared.inner.proj"

  def __call__(self, x):
    return self.inner(x)


class _LinenModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.remat(_Inner)(name="rematted")(x)
    x = nn.jit(_Inner)(name="jitted")(jnp.tanh(x))
    return _SharedScope(name="shared")(jnp.tanh(x))


def test_sparsified_linen_model_under_remat_jit_and_share_scope():
  # sparsify_linen finds and runs its layers inside nn.remat, nn.jit and nn.share_scope: each is sparse (the
  # plain-jnp reference on the masked kernels matches, the dense one would not) and jax.grad through it works.
  model = _LinenModel()
  x = jax.random.normal(jax.random.key(1), (4, 32))
  variables = model.init(jax.random.key(0), x)
  sparse, sparse_vars, report = jaxsparse.sparsify_linen(model, variables, jaxsparse.NM(2, 4), x)
  assert sorted(c.path for c in report.layers) == ["jitted.proj", "rematted.proj", "shared.proj"]

  def reference(params):
    h = x
    for i, name in enumerate(["rematted", "jitted", "shared"]):
      p = params[name]["proj"]
      w = jnp.where(jaxsparse.nm_mask(p["kernel"], 2, 4, axis=0), p["kernel"], 0.0)
      h = (jnp.tanh(h) if i else h) @ w + p["bias"]
    return h

  assert _max_err(jax.jit(sparse.apply)(sparse_vars, x), reference(sparse_vars["params"])) <= TOL
  assert _max_err(model.apply(variables, x), reference(sparse_vars["params"])) > 1e-2  # the dense model differs
  grads = jax.grad(lambda p: jnp.sum(sparse.apply({**sparse_vars, "params": p}, x) ** 2))(sparse_vars["params"])
  ref_grads = jax.grad(lambda p: jnp.sum(reference(p) ** 2))(sparse_vars["params"])
  for name, g in grads.items():  # kept weights and biases; the pruned ones get SR-STE's straight-through gradient
    kept = jaxsparse.nm_mask(sparse_vars["params"][name]["proj"]["kernel"], 2, 4, axis=0)
    ref = ref_grads[name]["proj"]
    assert _max_err(jnp.where(kept, g["proj"]["kernel"], 0.0), ref["kernel"]) <= TOL, name
    assert _max_err(g["proj"]["bias"], ref["bias"]) <= TOL, name


def _stack_of(build) -> nnx.Module:
  @nnx.split_rngs(splits=LAYERS)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs):
    return build(rngs)

  return create(nnx.Rngs(0))


_STACK_CONVERSIONS = {
    "block_sparse": (lambda r: _build("block_sparse", r), ["to_dense()", "sparse_kernel"], "kernel", (4, 8, 8, 8)),
    "nm": (lambda r: _build("nm", r), ["to_dense()"], "kernel", (4, 32, 32)),
    # Without a bias, NMLinear.to_dense() on a stack returned an nnx.Linear(32, 32) holding a (4, 32, 32) kernel.
    "nm_no_bias": (lambda r: NMLinear(32, 32, use_bias=False, rngs=r), ["to_dense()"], "kernel", (4, 32, 32)),
    "compressed_nm": (lambda r: _build("compressed_nm", r), ["to_dense()", "weight"], "kernel", (4, 16, 32)),
    "nm_conv": (lambda r: jaxsparse.layers.NMConv(8, 4, (3,), rngs=r), ["to_dense()"], "kernel", (4, 3, 8, 4)),
    "linear_general": (
        lambda r: jaxsparse.layers.SparseLinearGeneral(NMLinear(32, 32, rngs=r), in_features=(4, 8), out_features=32),
        ["to_dense()"], "kernel", (4, 32, 32),
    ),
}


@pytest.mark.parametrize("kind", sorted(_STACK_CONVERSIONS))
def test_sparse_layer_conversions_on_stack_say_how(kind):
  # to_dense() / sparse_kernel / weight of a stack built by nnx.vmap raised unclear errors ("BlockSparseMatrix.data
  # must have shape (8, 8, 8)", "Cannot broadcast to shape with fewer dimensions", "values must have shape (16, 32)")
  # or, for an NMLinear without bias, returned a malformed nnx.Linear. They now name the layer, the stacked shape and
  # the per-layer call, which gives each layer's dense weights.
  build, whats, leaf, shape = _STACK_CONVERSIONS[kind]
  stack = _stack_of(build)
  name = type(stack).__name__
  for what in whats:
    pattern = rf"{re.escape(f'{name}.{what}')} works on one layer.*{leaf} has shape {re.escape(str(shape))}"
    pattern += r".*nnx\.vmap\("
    with pytest.raises(ValueError, match=pattern):
      attr = getattr(stack, what.removesuffix("()"))
      if what.endswith("()"):
        attr()
  if kind in ("nm", "nm_no_bias", "block_sparse", "compressed_nm"):  # the per-layer call works and is right
    dense = nnx.vmap(lambda layer: layer.to_dense(), in_axes=0, out_axes=0)(stack)
    x = jax.random.normal(jax.random.key(1), (4, 32))
    for i in range(LAYERS):
      layer = _layer(stack, i)
      ref = x @ _dense_weight(kind.removesuffix("_no_bias"), layer)
      ref = ref if layer.bias is None else ref + layer.bias[...]
      assert _max_err(_layer(dense, i)(x), ref) <= TOL
