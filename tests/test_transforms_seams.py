"""Bug bash of the seams between the sparse layers and the JAX / Flax transforms of real model code: stacks of layers
built by ``nnx.vmap`` and run by ``nnx.scan`` (and the Linen ``nn.scan`` / ``nn.vmap``), ensembles, rematerialisation
with checkpoint policies, ``nnx.jit`` with donated state, ``nnx.cond`` / ``nnx.switch``, ``lax.scan`` over time
steps, ``jax.vmap`` over a non-leading batch axis, reverse-over-reverse derivatives, and mixed precision
(``param_dtype=float32``, ``dtype=bfloat16``): forward and gradients against the dense layers holding the same pruned
weights (float32: 1e-5 relative; bfloat16 against float32: 2e-2), or against the same layers without the transform.
Float32 products run at ``jax.default_matmul_precision("highest")`` (the module's fixture): a GPU's default, TF32,
differs from float32 by ~1e-3 relative, and those tolerances are float32's.

Regression tests (they failed before the fixes of session 48) say so in a comment; the others are new coverage of
workflows no test ran before.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxsparse
from jaxsparse import ops
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import CompressedNMEmbed
from jaxsparse.layers import CompressedNMLinear
from jaxsparse.layers import MaskedConv
from jaxsparse.layers import MaskedLinear
from jaxsparse.layers import NMConv
from jaxsparse.layers import NMLinear
from jaxsparse.layers import SparseLinearGeneral
from jaxsparse.layers import SparsityPattern
from jaxsparse.layers import linen
from jaxsparse.layers.linen import SPARSITY
from jaxsparse.ops import _sr_ste
from tests._util import rel_err

F32, BF16 = jnp.float32, jnp.bfloat16
TOL = {F32: 1e-5, BF16: 2e-2}
LAYERS = 4  # a multiple of m = 4: a mask computed across the stack's axis would not raise
ROWS = 12
CP = jax.checkpoint_policies


@pytest.fixture(autouse=True)
def _float32_products():
  with jax.default_matmul_precision("highest"):  # no change on the CPU; a GPU's default is TF32
    yield


def _build(kind: str, rngs: nnx.Rngs, *, dtype=None, param_dtype=F32) -> nnx.Module:
  kw = dict(dtype=dtype, param_dtype=param_dtype)
  if kind == "block":
    return BlockSparseLinear(32, 32, density=0.5, block_shape=(8, 8), rngs=rngs, **kw)
  if kind == "masked":
    return MaskedLinear(32, 32, sparsity=0.75, rngs=rngs, **kw)
  if kind == "nm":
    return NMLinear(32, 32, rngs=rngs, **kw)
  if kind == "nm_transposable":
    return NMLinear(32, 32, transposable=True, rngs=rngs, **kw)
  if kind == "nm_1_4":  # Flax's own product with the SR-STE promotion (not the 2:4 op)
    return NMLinear(32, 32, n=1, m=4, rngs=rngs, **kw)
  if kind == "compressed":
    layer = NMLinear(32, 32, rngs=rngs, param_dtype=param_dtype)
    return CompressedNMLinear(jaxsparse.NMSparseMatrix.from_dense(layer.kernel[...], 2, 4), layer.bias[...],
                              dtype=dtype)
  if kind == "general":
    return SparseLinearGeneral(MaskedLinear(32, 32, sparsity=0.5, rngs=rngs, **kw), in_features=(4, 8),
                               out_features=32)
  if kind == "masked_conv":
    return MaskedConv(8, 8, (3,), sparsity=0.5, rngs=rngs, **kw)
  if kind == "nm_conv":
    return NMConv(8, 8, (3,), rngs=rngs, **kw)
  assert kind == "embed"  # its attend (tied output logits): (.., 32) -> (.., 32)
  table = nnx.Embed(32, 32, param_dtype=param_dtype, rngs=rngs).embedding[...]
  return CompressedNMEmbed(jaxsparse.NMSparseMatrix.from_dense(table.T, 2, 4), dtype=dtype)


KINDS = ["block", "masked", "nm", "nm_transposable", "nm_1_4", "compressed", "general", "masked_conv", "nm_conv",
         "embed"]
PATTERNED = ["block", "masked", "compressed", "general", "masked_conv", "embed"]  # kinds with SparsityPattern state


def _some_fast(values, fast) -> list:
  """``values`` as parameters, those not in ``fast`` marked slow (the file's fast set stays under a minute on two
  cores; ``make test-slow`` runs the rest)."""
  return [v if v in fast else pytest.param(v, marks=pytest.mark.slow) for v in values]


def _input(kind: str, key: int = 1, rows: int = ROWS) -> jax.Array:
  shape = (rows, 6, 8) if kind.endswith("conv") else (rows, 32)
  return jax.random.normal(jax.random.key(key), shape, F32)


def _apply(kind: str, layer, h: jax.Array) -> jax.Array:
  """One layer on the carry ``h`` (its shape kept, so that layers chain)."""
  if kind == "general":
    return layer(h.reshape(*h.shape[:-1], 4, 8))
  if kind == "embed":
    return layer.attend(h)
  return layer(h)


def _dense_f32(kind: str, layer):
  """The dense layer with the same pruned weights, all in float32: the reference."""
  dense = layer.to_dense()
  graphdef, state = nnx.split(dense)
  state = jax.tree.map(lambda a: a.astype(F32) if jnp.issubdtype(a.dtype, jnp.floating) else a, state)
  dense = nnx.merge(graphdef, state)
  dense.dtype = F32
  return dense


def _stack(kind: str, **kw) -> nnx.Module:
  @nnx.split_rngs(splits=LAYERS)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs):
    return _build(kind, rngs, **kw)

  return create(nnx.Rngs(0))


def _layer(stack: nnx.Module, i: int) -> nnx.Module:
  graphdef, state = nnx.split(stack)
  return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))


def _patterns(layer) -> bytes:
  """The layer's pattern, to tell layers apart."""
  if isinstance(layer, (NMLinear, NMConv)):
    return np.asarray(layer.nm_mask).tobytes()
  return b"".join(np.asarray(v[...]).tobytes() for _, v in nnx.to_flat_state(nnx.state(layer, SparsityPattern)))


def _max_rel(tree, ref) -> float:
  return max(rel_err(a, b) for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(ref), strict=True))


def _chain_loss(kind):
  """``sum(tanh(...tanh(layer(x))...) ** 2)`` over a list of layers, in float32."""
  def loss(layers, x):
    h = x
    for layer in layers:
      h = jnp.tanh(_apply(kind, layer, h)).astype(x.dtype)
    return jnp.sum(h.astype(F32) ** 2)

  return loss


# -------------------------------------------------------------------------------------------------
# 1. Stacks of layers: nnx.vmap builds them, nnx.scan runs them (the scan-over-layers of LLM code).
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "mixed"), [
    pytest.param(k, mixed, id=f"{k}-{'bf16-compute' if mixed else 'float32'}",
                 marks=() if (k, mixed) == ("embed", True) else pytest.mark.slow)
    for k in KINDS for mixed in (False, True)])
def test_scan_over_stack_matches_dense_layers(kind, mixed):
  # New coverage: every layer kind (convs, SparseLinearGeneral, CompressedNMEmbed, 1:4 and transposable N:M) and
  # mixed precision: the stack's forward and input gradient against the float32 dense layers, its parameter
  # gradients against the same layers called one by one.
  dtype = BF16 if mixed else None
  stack = _stack(kind, dtype=dtype)
  x = _input(kind)

  @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
  def forward(h, layer):
    return jnp.tanh(_apply(kind, layer, h)).astype(h.dtype)

  loss = lambda stack, x: jnp.sum(forward(x, stack).astype(F32) ** 2)
  value, (grads, gx) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(stack, x)
  layers = nnx.List([_layer(stack, i) for i in range(LAYERS)])
  assert len({_patterns(layer) for layer in layers}) == LAYERS  # each layer its own pattern
  dense = [_dense_f32(kind, layer) for layer in layers]
  ref_value, ref_gx = jax.value_and_grad(lambda x: _chain_loss(kind)(dense, x))(x)
  tol = TOL[BF16 if mixed else F32]
  assert rel_err(value, ref_value) <= tol and rel_err(gx, ref_gx) <= tol
  per_layer = nnx.grad(_chain_loss(kind))(layers, x)
  flat = dict(nnx.to_flat_state(grads))
  for i in range(LAYERS):
    for path, g in nnx.to_flat_state(per_layer[i]):
      assert flat[path][...].dtype == g[...].dtype == F32  # float32 gradients of float32 parameters
      assert rel_err(flat[path][...][i], g[...]) <= tol, (path, i)
  assert not nnx.state(grads, SparsityPattern)  # the pattern gets no gradient


@pytest.mark.parametrize("kind", _some_fast(KINDS, {"nm"}))
def test_ensemble_vmap_matches_each_member(kind):
  # New coverage: an ensemble (nnx.vmap over the stack, the input shared), forward and parameter gradients.
  stack = _stack(kind)
  x = _input(kind)
  ensemble = nnx.vmap(lambda layer, x: _apply(kind, layer, x), in_axes=(0, None))
  y = nnx.jit(ensemble)(stack, x)
  layers = [_layer(stack, i) for i in range(LAYERS)]
  for i, layer in enumerate(layers):
    assert rel_err(y[i], _apply(kind, _dense_f32(kind, layer), x)) <= TOL[F32]
  grads = nnx.grad(lambda s: jnp.sum(ensemble(s, x) ** 2))(stack)
  flat = dict(nnx.to_flat_state(grads))
  for i, layer in enumerate(layers):
    for path, g in nnx.to_flat_state(nnx.grad(lambda m: jnp.sum(_apply(kind, m, x) ** 2))(layer)):
      assert rel_err(flat[path][...][i], g[...]) <= TOL[F32], (path, i)


@pytest.mark.parametrize("kind", ["compressed", "embed"])
def test_bfloat16_ensemble_of_compressed_layers_trains_on_cpu(kind):
  # Regression: the gradient of an ensemble (nnx.vmap over the layers, x shared) of CompressedNMLinear /
  # CompressedNMEmbed.attend computing in bfloat16 crashed on the CPU: "Unsupported element type for
  # DotThunk::Execute: BF16 x BF16 = F32" (nm_matmul's xᵀ dY, both operands contracted along their axis 0).
  stack = _stack(kind, dtype=BF16)  # float32 parameters, bfloat16 compute
  x = _input(kind, rows=16)
  ensemble = nnx.vmap(lambda layer, x: _apply(kind, layer, x), in_axes=(0, None))
  grads, gx = nnx.grad(lambda s, x: jnp.sum(ensemble(s, x).astype(F32) ** 2), argnums=(0, 1))(stack, x)
  layers = [_layer(stack, i) for i in range(LAYERS)]
  dense = [_dense_f32(kind, layer) for layer in layers]
  ref_gx = jax.grad(lambda x: sum(jnp.sum(_apply(kind, d, x) ** 2) for d in dense))(x)
  assert rel_err(gx, ref_gx) <= TOL[BF16]
  flat = dict(nnx.to_flat_state(grads))
  for i, layer in enumerate(layers):
    for path, g in nnx.to_flat_state(nnx.grad(lambda m: jnp.sum(_apply(kind, m, x).astype(F32) ** 2))(layer)):
      assert rel_err(flat[path][...][i], g[...]) <= TOL[BF16], (path, i)


def test_nm_matmul_vmapped_over_weights_in_bfloat16():
  # Regression (the op under the fix above): jax.vmap over the weights with x unmapped, bfloat16, on the CPU.
  ws = [jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(jax.random.key(i), (32, 32), BF16), 2, 4)
        for i in range(3)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *ws)
  x = jax.random.normal(jax.random.key(9), (16, 32), BF16)

  def loss(values, op):
    mapped = jax.vmap(lambda v, w: op(x, w.with_values(v)), in_axes=(0, 0))(values, stacked)
    return jnp.sum(mapped.astype(F32) ** 2)

  got = jax.grad(loss)(stacked.values, ops.nm_matmul)
  want = jax.grad(loss)(stacked.values, lambda x, w: x.astype(F32) @ w.to_dense().astype(F32))
  assert got.dtype == BF16 and rel_err(got, want) <= TOL[BF16]


@pytest.mark.parametrize("kind", KINDS)
def test_stack_called_outside_a_transform_says_how(kind):
  # Regression: a stack called as one layer failed on an array's shape ("w must be 2-D (K, N)", "Mask needs to have
  # the same shape as weights", "conv_general_dilated lhs and rhs must have the same number of dimensions",
  # "CompressedNMLinear.weight works on one layer"), naming neither the stack nor the per-layer call.
  stack = _stack(kind)
  with pytest.raises(ValueError, match=r"was called with the variables of a stack of layers.*nnx\.scan"):
    _apply(kind, stack, _input(kind))


@pytest.mark.parametrize(("kind", "transform"), [(k, "scan") for k in PATTERNED] + [
    pytest.param(k, "vmap", marks=() if k == "masked" else pytest.mark.slow) for k in PATTERNED])
def test_state_axes_that_broadcast_the_pattern_say_how(kind, transform):
  # Regression: nnx.StateAxes({nnx.Param: 0, ...: None}), Flax's idiom for the other state of a scan over layers,
  # handed every layer the whole stack's patterns: "BlockSparseMatrix.row_indices must be an int32 array of shape
  # (8,) ... got int32 (4, 8)", "mask must have the weight's shape (32, 32), got (4, 32, 32)". The error now names
  # the variable and the StateAxes that works, which gives the results of in_axes=0.
  stack = _stack(kind)
  x = _input(kind)
  body = lambda h, layer: (jnp.tanh(_apply(kind, layer, h)), None)

  def run(axes):
    if transform == "scan":
      return nnx.scan(body, in_axes=(nnx.Carry, axes))(x, stack)[0]
    return nnx.vmap(lambda layer, x: _apply(kind, layer, x), in_axes=(axes, None))(stack, x)

  with pytest.raises(ValueError, match=r"SparsityPattern .* leading axis.*nnx\.StateAxes\(\{\(nnx\.Param, "
                                       r"SparsityPattern\): 0, \.\.\.: None\}\)"):
    run(nnx.StateAxes({nnx.Param: 0, ...: None}))
  assert rel_err(run(nnx.StateAxes({(nnx.Param, SparsityPattern): 0, ...: None})), run(0)) == 0.0


def test_embed_stack_conversions_say_how():
  # Regression: CompressedNMEmbed.weight / to_dense() of a stack failed on "values must have shape (16, 32)"; they
  # now say what the other layers' conversions say, and the per-layer call gives each layer's table.
  stack = _stack("embed")
  for what in ("weight", "to_dense()"):
    with pytest.raises(ValueError, match=rf"CompressedNMEmbed\.{what.replace('(', '.').replace(')', '.')} works on "
                                         r"one layer.*embedding has shape \(4, 16, 32\)"):
      attr = getattr(stack, what.removesuffix("()"))
      if what.endswith("()"):
        attr()
  dense = nnx.vmap(lambda layer: layer.to_dense(), in_axes=0, out_axes=0)(stack)
  ids = jnp.arange(5)
  for i in range(LAYERS):
    assert np.array_equal(_layer(dense, i)(ids), _layer(stack, i)(ids))


def test_stack_from_given_block_masks():
  # Regression (message) and new coverage: block masks given per layer cannot be vmapped (the kept count fixes the
  # kernel's shape); the error said "traced (built under jit or eval_shape)". It names vmap and the stacking of
  # eagerly built layers, which gives a stack whose layers keep exactly the given blocks.
  rng = np.random.default_rng(0)
  masks = np.zeros((LAYERS, 4, 4), bool)
  for m in masks:
    m.flat[rng.permutation(16)[:6]] = True

  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(mask):
    return BlockSparseLinear(32, 32, block_mask=mask, block_shape=(8, 8), rngs=nnx.Rngs(0))

  with pytest.raises(ValueError, match=r"block_mask is traced \(built under jit, eval_shape or vmap\).*stack them"):
    create(jnp.asarray(masks))
  layers = [BlockSparseLinear(32, 32, block_mask=m, block_shape=(8, 8), rngs=nnx.Rngs(i)) for i, m in enumerate(masks)]
  stack = nnx.merge(nnx.graphdef(layers[0]), jax.tree.map(lambda *a: jnp.stack(a), *[nnx.state(la) for la in layers]))
  x = _input("block")
  y = nnx.scan(lambda h, layer: (layer(h), None), in_axes=(nnx.Carry, 0))(x, stack)[0]
  ref = x
  for i, layer in enumerate(layers):
    assert np.array_equal(np.asarray(_layer(stack, i).block_mask), masks[i])
    ref = layer(ref)
  assert rel_err(y, ref) <= TOL[F32]


# -------------------------------------------------------------------------------------------------
# 2. Rematerialisation, jit with donated state, cond / switch, lax.scan over time, vmap, reverse over reverse.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", _some_fast(KINDS, {"nm"}))
def test_remat_policies_keep_the_gradients(kind):
  # New coverage: nnx.remat and jax.checkpoint with checkpoint policies: the gradients of the un-remat'd layer.
  layer = _build(kind, nnx.Rngs(0))
  x = _input(kind)
  loss = lambda layer, x: jnp.sum(jnp.tanh(_apply(kind, layer, x)) ** 2)
  want = nnx.grad(loss, argnums=(0, 1))(layer, x)
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  for policy in (None, CP.dots_saveable, CP.nothing_saveable, CP.dots_with_no_batch_dims_saveable):
    got = nnx.jit(nnx.grad(nnx.remat(loss, policy=policy), argnums=(0, 1)))(layer, x)
    assert _max_rel(got, want) <= 1e-6, policy
    pure = jax.checkpoint(lambda p, x: loss(nnx.merge(graphdef, p, rest), x), policy=policy)
    got = jax.jit(jax.grad(pure, argnums=(0, 1)))(params, x)
    assert _max_rel(got, want) <= 1e-6, policy


@pytest.mark.parametrize("kind", _some_fast(["block", "masked", "nm", "compressed", "masked_conv"], {"masked"}))
def test_jit_donated_train_step_equals_eager_steps(kind):
  # New coverage: nnx.jit with the model and optimizer donated, three steps against eager ones; patterns unchanged.
  x = _input(kind)
  loss = lambda layer: jnp.sum(jnp.tanh(_apply(kind, layer, x)) ** 2)

  def step(layer, opt):
    value, grads = nnx.value_and_grad(loss)(layer)
    opt.update(layer, grads)
    return value

  models = [_build(kind, nnx.Rngs(0)) for _ in range(2)]
  opts = [nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param) for m in models]
  pattern = jax.tree.map(np.asarray, nnx.state(models[0], SparsityPattern))
  jitted = nnx.jit(step, donate_argnums=(0, 1))
  for _ in range(3):
    assert rel_err(jitted(models[0], opts[0]), step(models[1], opts[1])) <= TOL[F32]
  assert _max_rel(nnx.state(models[0], nnx.Param), nnx.state(models[1], nnx.Param)) <= 1e-5
  assert jax.tree.all(jax.tree.map(np.array_equal, pattern, jax.tree.map(np.asarray,
                                                                          nnx.state(models[0], SparsityPattern))))


@pytest.mark.parametrize("kind", _some_fast(KINDS, {"compressed", "nm_conv"}))
def test_cond_and_switch_between_sparse_and_dense_branches(kind):
  # New coverage: nnx.cond / nnx.switch (traced predicate / index) between a sparse layer and a dense one.
  layer = _build(kind, nnx.Rngs(0))
  dense = _dense_f32(kind, layer)
  x = _input(kind)
  branches = [lambda s, d, x: _apply(kind, s, x), lambda s, d, x: _apply(kind, d, x),
              lambda s, d, x: 2 * _apply(kind, s, x)]
  switch = nnx.jit(lambda i, s, d, x: nnx.switch(i, branches, s, d, x))
  ref = _apply(kind, dense, x)
  for i, want in enumerate([ref, ref, 2 * ref]):
    assert rel_err(switch(jnp.int32(i), layer, dense, x), want) <= TOL[F32]
  cond = lambda s, d, x, p: jnp.sum(nnx.cond(p, branches[0], branches[1], s, d, x) ** 2)
  got = nnx.jit(nnx.grad(cond, argnums=(0, 2)))(layer, dense, x, jnp.bool_(True))
  want = nnx.grad(lambda s, x: jnp.sum(_apply(kind, s, x) ** 2), argnums=(0, 1))(layer, x)
  assert _max_rel(got[0], want[0]) <= 1e-6 and rel_err(got[1], want[1]) <= 1e-6


@pytest.mark.parametrize(("kind", "mixed"), [
    pytest.param(k, mixed, id=f"{k}-{'bf16-compute' if mixed else 'float32'}",
                 marks=() if (k, mixed) == ("nm", True) else pytest.mark.slow)
    for k in ["block", "masked", "nm", "nm_transposable", "compressed", "general", "embed"] for mixed in (False, True)])
def test_lax_scan_over_time_steps(kind, mixed):
  # New coverage: a recurrent cell (one sparse layer, its state split off, inside jax.lax.scan) and nnx.scan with
  # the layer broadcast: the unrolled dense loop's outputs and gradients.
  layer = _build(kind, nnx.Rngs(0), dtype=BF16 if mixed else None)
  xs = jax.random.normal(jax.random.key(3), (5, ROWS, 32))
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def rnn(params, xs, graphdef=graphdef):
    cell = nnx.merge(graphdef, params, rest)

    def step(h, x):
      h = jnp.tanh(_apply(kind, cell, h + x)).astype(F32)
      return h, h

    return jax.lax.scan(step, jnp.zeros_like(xs[0]), xs)[1]

  dense = _dense_f32(kind, layer)

  def unrolled(xs):
    h, hs = jnp.zeros_like(xs[0]), []
    for x in xs:
      h = jnp.tanh(_apply(kind, dense, h + x))
      hs.append(h)
    return jnp.stack(hs)

  tol = TOL[BF16 if mixed else F32]
  assert rel_err(jax.jit(rnn)(params, xs), unrolled(xs)) <= tol
  gx = jax.jit(jax.grad(lambda xs: jnp.sum(rnn(params, xs) ** 2)))(xs)
  assert rel_err(gx, jax.grad(lambda xs: jnp.sum(unrolled(xs) ** 2))(xs)) <= tol
  @nnx.scan(in_axes=(None, nnx.Carry, 0), out_axes=(nnx.Carry, 0))
  def scanned(cell, h, x):  # nnx.scan with the layer broadcast to every step
    h = jnp.tanh(_apply(kind, cell, h + x)).astype(F32)
    return h, h

  grads = nnx.grad(lambda cell: jnp.sum(scanned(cell, jnp.zeros_like(xs[0]), xs)[1] ** 2))(layer)
  assert _max_rel(grads, jax.grad(lambda p: jnp.sum(rnn(p, xs) ** 2))(params)) <= tol


@pytest.mark.parametrize("kind", _some_fast(KINDS, {"masked", "nm_conv"}))
def test_vmap_over_a_non_leading_batch_axis(kind):
  # New coverage: jax.vmap of the layer's call with in_axes=1 (and out_axes=1), forward, input and parameter
  # gradients against the unmapped calls.
  layer = _build(kind, nnx.Rngs(0))
  x = _input(kind)
  xb = jnp.stack([x[:6], x[6:]], axis=1)  # (6, 2, ...): the batch on axis 1
  call = lambda layer, xb: jax.vmap(lambda x: _apply(kind, layer, x), in_axes=1, out_axes=1)(xb)
  ref = lambda layer, xb: jnp.stack([_apply(kind, layer, xb[:, i]) for i in range(2)], axis=1)
  assert rel_err(nnx.jit(call)(layer, xb), ref(_dense_f32(kind, layer), xb)) <= TOL[F32]
  loss = lambda f: (lambda layer, xb: jnp.sum(jnp.tanh(f(layer, xb)) ** 2))
  got = nnx.grad(loss(call), argnums=(0, 1))(layer, xb)
  want = nnx.grad(loss(ref), argnums=(0, 1))(layer, xb)
  assert _max_rel(got, want) <= TOL[F32]


@pytest.mark.parametrize("kind", _some_fast(KINDS, {"nm"}))
def test_reverse_over_reverse_derivatives(kind):
  # New coverage: jax.jacrev, and the Hessian in x as jacrev of grad (reverse over reverse), through each layer
  # against the dense layer. jax.hessian (forward over reverse) works where the layer has no custom VJP in x and
  # otherwise raises JAX's forward-mode error (docs/guides/performance.md says so, and how to get the Hessian).
  layer = _build(kind, nnx.Rngs(0))
  dense = _dense_f32(kind, layer)
  x = _input(kind, rows=2)
  scalar = lambda m: (lambda x: jnp.sum(jnp.tanh(_apply(kind, m, x)) ** 2))
  jacobian = lambda m: jax.jacrev(lambda x: _apply(kind, m, x))(x)
  assert rel_err(jacobian(layer), jacobian(dense)) <= TOL[F32]
  hessian = lambda m: jax.jit(jax.jacrev(jax.grad(scalar(m))))(x)
  want = hessian(dense)
  assert rel_err(hessian(layer), want) <= 1e-4
  try:
    forward_over_reverse = jax.hessian(scalar(layer))(x)
  except TypeError as e:
    assert "forward-mode" in str(e)
  else:
    assert rel_err(forward_over_reverse, want) <= 1e-4


# -------------------------------------------------------------------------------------------------
# 3. SR-STE's decay under jax.vmap: once per pruning of the weight, as the reference adds it.
# -------------------------------------------------------------------------------------------------


def _fake_cuda(monkeypatch):
  """XLA stand-ins for the CUDA parts of sr_ste_matmul's fused routes (the tests in test_cusparselt.py use them too):
  cuSPARSELt's compress (the pruned kernel stands for its buffer) and product, our transposable pruning kernel."""
  monkeypatch.setattr(_sr_ste.cslt, "compress", lambda w: w)
  monkeypatch.setattr(_sr_ste.cslt, "matmul", lambda x2, blob, n: x2 @ blob)

  def transposable(w, dtype=None):
    dtype = dtype or w.dtype
    pattern = jaxsparse.formats._nm_masks.transposable_pattern(w, 2, 4).astype(jnp.uint8)
    mask = jaxsparse.formats._nm_masks.tile_mask(pattern, 2, 4)
    return jnp.where(mask, w, jnp.zeros((), w.dtype)).astype(dtype), pattern

  monkeypatch.setattr(_sr_ste.cuda_kernels, "nm24_transposable", transposable)


FUSED = {"prune_kernel": (False, 0), "cusparselt": (False, 1), "prune_kernel_t": (True, 0), "cusparselt_t": (True, 1)}


@pytest.mark.parametrize("route", _some_fast(sorted(FUSED), {"prune_kernel"}))
def test_sr_ste_fused_routes_add_the_decay_once_under_vmap(route, monkeypatch):
  # Regression: on a CUDA GPU, sr_ste_matmul's fused routes (the default for 2:4: our pruning kernel, cuSPARSELt)
  # added SR-STE's decay inside the product's custom VJP, so jax.vmap over x with the weight shared (a model written
  # for one example, jax.vmap(layer)(batch)) added it once per mapped element: a batch of 256 took 256 times the
  # decay. It is now added once per pruning of w, as the reference (x @ sr_ste(w)) adds it; per-example gradients
  # (vmap of grad) and ensembles (w mapped) keep one decay each. Run on the CPU with XLA stand-ins of the CUDA parts.
  _fake_cuda(monkeypatch)
  transposable, sparse = FUSED[route]
  cfg = _sr_ste._MatmulConfig(2, 4, 0.5, jnp.dtype(F32), None, None, transposable=transposable)
  fused = _sr_ste._sr_ste_matmul_t if transposable else _sr_ste._sr_ste_matmul
  route = (72 if sparse else 0) if transposable else bool(sparse)  # blob_bytes / sparse
  op = lambda x, w: fused(cfg, route, x, w)
  ref = lambda x, w: _sr_ste._reference(cfg, x, w)
  w = jax.random.normal(jax.random.key(0), (16, 8))
  x = jax.random.normal(jax.random.key(1), (5, 3, 16))
  plain = lambda f: jax.grad(lambda w: jnp.sum(jnp.tanh(f(x, w))))(w)
  assert rel_err(plain(op), plain(ref)) <= 1e-6  # the fused route is the reference where nothing is mapped
  mapped = lambda f: jax.grad(lambda w: jnp.sum(jnp.tanh(jax.vmap(lambda x: f(x, w))(x))))(w)
  assert rel_err(mapped(op), mapped(ref)) <= 1e-6
  per_example = lambda f: jax.vmap(jax.grad(lambda w, x: jnp.sum(jnp.tanh(f(x, w)))), in_axes=(None, 0))(w, x)
  assert rel_err(per_example(op), per_example(ref)) <= 1e-6
  ws = jnp.stack([w, -w, 2 * w])
  ensemble = lambda f: jax.grad(lambda ws: jnp.sum(jnp.tanh(jax.vmap(f, in_axes=(None, 0))(x, ws))))(ws)
  assert rel_err(ensemble(op), ensemble(ref)) <= 1e-6


def test_nm_layers_under_vmap_take_the_decay_once():
  # New coverage, on the layers (the CPU's reference route): NMLinear / Linen NMDense called on a jax.vmap'ed batch
  # get the gradients of the batched call, the decay of the pruned weights included once.
  x = _input("nm")
  layer = NMLinear(32, 32, sr_ste_decay=0.5, rngs=nnx.Rngs(0))
  plain = nnx.grad(lambda m: jnp.sum(jnp.tanh(m(x))))(layer)
  mapped = nnx.grad(lambda m: jnp.sum(jnp.tanh(jax.vmap(m)(x))))(layer)
  assert _max_rel(mapped, plain) <= 1e-6
  module = linen.NMDense(32, sr_ste_decay=0.5)
  params = module.init(jax.random.key(0), x)["params"]
  plain = jax.grad(lambda p: jnp.sum(jnp.tanh(module.apply({"params": p}, x))))(params)
  mapped = jax.grad(lambda p: jnp.sum(jnp.tanh(jax.vmap(lambda r: module.apply({"params": p}, r))(x))))(params)
  assert _max_rel(mapped, plain) <= 1e-6


# -------------------------------------------------------------------------------------------------
# 4. Linen: nn.vmap ensembles, nn.remat policies, nn.remat_scan, nn.cond, mixed precision.
# -------------------------------------------------------------------------------------------------


LINEN = {
    "block": lambda **kw: linen.BlockSparseDense(32, density=0.5, block_shape=(8, 8), **kw),
    "masked": lambda **kw: linen.MaskedDense(32, sparsity=0.75, **kw),
    "nm": lambda **kw: linen.NMDense(32, **kw),
    "nm_1_4": lambda **kw: linen.NMDense(32, n=1, m=4, **kw),
    "compressed": lambda **kw: linen.CompressedNMDense(32, **kw),
    "nm_conv": lambda **kw: linen.NMConv(8, (3,), **kw),
}


def _linen_input(kind):
  return _input("nm_conv" if kind == "nm_conv" else "nm")


def _fields(module: nn.Module) -> dict:
  return {f.name: getattr(module, f.name) for f in dataclasses.fields(module) if f.init and f.name not in ("parent",
                                                                                                        "name")}


@pytest.mark.parametrize("kind", _some_fast(sorted(LINEN), {"compressed", "nm"}))
def test_linen_vmap_ensemble(kind):
  # New coverage: nn.vmap over a jaxsparse Linen layer with the "sparsity" collection mapped beside "params",
  # bfloat16 compute on float32 parameters: each member's outputs and gradients against the float32 dense product.
  layer = LINEN[kind](dtype=BF16)
  ensemble = nn.vmap(type(layer), variable_axes={"params": 0, SPARSITY: 0}, split_rngs={"params": True},
                     in_axes=None, axis_size=3)(**_fields(layer))
  x = _linen_input(kind)
  variables = ensemble.init(jax.random.key(0), x)
  assert jax.tree.leaves(variables["params"])[0].dtype == F32
  loss = lambda p, x: jnp.sum(ensemble.apply({**variables, "params": p}, x).astype(F32) ** 2)
  grads, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(variables["params"], x)
  member = lambda i, p: jax.tree.map(lambda a: a[i], {**variables, "params": p})
  f32 = LINEN[kind]()  # the same layer computing in float32
  ref_loss = lambda p, x: sum(jnp.sum(f32.apply(member(i, p), x) ** 2) for i in range(3))
  ref_grads, ref_gx = jax.grad(ref_loss, argnums=(0, 1))(variables["params"], x)
  assert rel_err(loss(variables["params"], x), ref_loss(variables["params"], x)) <= TOL[BF16]
  assert rel_err(gx, ref_gx) <= TOL[BF16] and _max_rel(grads, ref_grads) <= TOL[BF16]
  patterns = jax.tree.leaves(variables.get(SPARSITY, {}))
  assert all(not np.array_equal(p[0], p[1]) for p in patterns)  # each member its own pattern


@pytest.mark.parametrize("kind", _some_fast(sorted(LINEN), {"masked"}))
def test_linen_remat_policies_and_remat_scan(kind):
  # New coverage: nn.remat with checkpoint policies (gradients of the plain layer), and nn.remat_scan over blocks
  # holding the layer (its variables, "sparsity" too, stacked (2, 2, ...); outputs of the blocks applied in turn).
  layer = LINEN[kind]()
  x = _linen_input(kind)
  variables = layer.init(jax.random.key(0), x)
  loss = lambda module: (lambda p: jnp.sum(jnp.tanh(module.apply({**variables, "params": p}, x)) ** 2))
  want = jax.grad(loss(layer))(variables["params"])
  for policy in (None, CP.dots_saveable, CP.nothing_saveable):
    lifted = nn.remat(type(layer), policy=policy)(**_fields(layer))
    assert _max_rel(jax.jit(jax.grad(loss(lifted)))(variables["params"]), want) <= 1e-6, policy

  class Block(nn.Module):
    @nn.compact
    def __call__(self, h):
      return jnp.tanh(LINEN[kind]()(h))

  stack = nn.remat_scan(Block, lengths=(2, 2))()
  stacked = stack.init(jax.random.key(0), x)
  assert sorted(stacked) == sorted(variables)
  one = lambda i: jax.tree.map(lambda a: a.reshape(4, *a.shape[2:])[i], stacked)
  h = x
  for i in range(4):
    h = Block().apply(one(i), h)
  assert rel_err(stack.apply(stacked, x), h) <= TOL[F32]


@pytest.mark.parametrize("kind", _some_fast(sorted(LINEN), {"nm"}))
def test_linen_cond_between_sparse_and_dense(kind):
  # New coverage: nn.cond between a jaxsparse layer and a dense one (both initialised outside the cond, as Flax
  # requires of branches that hold variables), forward and gradients of the taken branch.
  class Choice(nn.Module):
    def setup(self):
      self.sparse = LINEN[kind]()
      self.dense = nn.Conv(8, (3,)) if kind == "nm_conv" else nn.Dense(32)

    def __call__(self, x, pred):
      if self.is_initializing():
        self.sparse(x)
        self.dense(x)
      return nn.cond(pred, lambda m, x: m.sparse(x), lambda m, x: m.dense(x), self, x)

  x = _linen_input(kind)
  variables = Choice().init(jax.random.key(0), x, True)
  sparse_vars = {c: v["sparse"] for c, v in variables.items() if "sparse" in v}
  run = jax.jit(lambda p, pred: Choice().apply({**variables, "params": p}, x, pred))
  assert rel_err(run(variables["params"], True), LINEN[kind]().apply(sparse_vars, x)) <= TOL[F32]
  grads = jax.grad(lambda p: jnp.sum(run(p, True) ** 2))(variables["params"])
  want = jax.grad(lambda p: jnp.sum(LINEN[kind]().apply({**sparse_vars, "params": p}, x) ** 2))(sparse_vars["params"])
  assert _max_rel(grads["sparse"], want) <= 1e-6
  assert not any(np.any(np.asarray(g)) for g in jax.tree.leaves(grads["dense"]))


@pytest.mark.parametrize("kind", _some_fast(["block", "masked", "compressed"], {"masked"}))
def test_linen_scan_with_one_pattern_for_every_step(kind):
  # New coverage of the recipe docs/guides/getting_started.md gives for a pattern shared by every step: init draws
  # one per step ("sparsity": 0), take the first and broadcast it (variable_broadcast="sparsity").
  class Step(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      return jnp.tanh(LINEN[kind]()(h)), None

  x = _linen_input(kind)
  per_step = nn.scan(Step, variable_axes={"params": 0, SPARSITY: 0}, split_rngs={"params": True}, length=3)()
  variables = per_step.init(jax.random.key(0), x, None)
  shared = {**variables, SPARSITY: jax.tree.map(lambda a: a[0], variables[SPARSITY])}
  scan = nn.scan(Step, variable_axes={"params": 0}, variable_broadcast=SPARSITY, split_rngs={"params": True},
                 length=3)()
  h = x
  for i in range(3):
    h, _ = Step().apply({"params": jax.tree.map(lambda a, i=i: a[i], variables["params"]), SPARSITY: shared[SPARSITY]},
                        h, None)
  assert rel_err(scan.apply(shared, x, None)[0], h) <= TOL[F32]
