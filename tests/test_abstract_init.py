"""Every layer kind built under ``nnx.jit`` / ``jax.jit`` / ``nnx.eval_shape`` (NNX) or ``jit``-ed ``init``
(Linen) is the layer an eager build with the same seed gives: same graph, parameters, pattern and outputs."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsparse
from jaxsparse import layers
from jaxsparse.layers import linen

BLOCK_MASK = np.random.default_rng(0).random((4, 3)) < 0.5  # (64 // 16, 96 // 32) blocks

# name -> (builder taking rngs, input shape). Sizes are small: these run on two CPU cores in CI.
NNX_LAYERS = {
    "block_sparse": (lambda r: layers.BlockSparseLinear(64, 96, density=0.5, block_shape=(16, 32), rngs=r), (3, 64)),
    "block_sparse_mask": (  # a NumPy block_mask stays concrete under jit / eval_shape (the abstract restore target)
        lambda r: layers.BlockSparseLinear(64, 96, block_mask=BLOCK_MASK, block_shape=(16, 32), rngs=r),
        (3, 64),
    ),
    "block_sparse_from_dense": (
        lambda r: layers.BlockSparseLinear.from_dense(nnx.Linear(64, 32, rngs=r), density=0.25, block_shape=(16, 16)),
        (3, 64),
    ),
    "masked": (lambda r: layers.MaskedLinear(64, 48, sparsity=0.75, rngs=r), (3, 64)),
    "masked_from_dense": (lambda r: layers.MaskedLinear.from_dense(nnx.Linear(32, 16, rngs=r), sparsity=0.5), (3, 32)),
    "masked_conv": (lambda r: layers.MaskedConv(8, 16, (3, 3), sparsity=0.5, rngs=r), (2, 6, 6, 8)),
    "nm": (lambda r: layers.NMLinear(64, 32, n=2, m=4, rngs=r), (3, 64)),
    "nm_conv": (lambda r: layers.NMConv(8, 16, (3, 3), n=1, m=4, rngs=r), (2, 6, 6, 8)),
    "compressed_nm": (lambda r: layers.NMLinear(64, 32, rngs=r).to_compressed(), (3, 64)),
    "compressed_nm_buffer": (  # the weight kept once, as cuSPARSELt's buffer (a CusparseLtKernel, no Param)
        lambda r: layers.NMLinear(64, 64, param_dtype=jnp.bfloat16, rngs=r).to_compressed(storage="cusparselt"),
        (3, 64),
    ),
    "linear_general": (
        lambda r: layers.SparseLinearGeneral(
            layers.BlockSparseLinear(32, 64, density=0.5, block_shape=(16, 16), rngs=r),
            in_features=(32,),
            out_features=(4, 16),
        ),
        (3, 32),
    ),
}

LINEN_LAYERS = {
    "block_sparse": (linen.BlockSparseDense(96, density=0.5, block_shape=(16, 32)), (3, 64)),
    "masked": (linen.MaskedDense(48, sparsity=0.75), (3, 64)),
    "nm": (linen.NMDense(32, n=2, m=4), (3, 64)),
    "nm_conv": (linen.NMConv(16, (3, 3), n=1, m=4), (2, 6, 6, 8)),
}


def _assert_trees_equal(a, b):
  """Equal trees: patterns (masks, indices) exactly; weights exactly on a CPU and to float32 rounding elsewhere (a GPU
  computes an initializer's draw in other fused kernels under jit than eagerly: so does plain ``nnx.Linear``'s)."""
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  assert la, "empty state"
  for x, y in zip(la, lb, strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype
    if jnp.issubdtype(x.dtype, jnp.floating) and jax.default_backend() != "cpu":
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
    else:
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _assert_outputs_equal(a, b):
  """Exactly on a CPU; elsewhere to TF32's rounding (weights one float32 ulp apart, per :func:`_assert_trees_equal`,
  can round to other TF32 operands)."""
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(a, b)
  else:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=1e-3)


# long: only one layer of each kind in the fast set (make test <= 15 min on 2 cores); CI runs the others.
_NNX_FAST = ("block_sparse", "masked", "nm", "compressed_nm")


@pytest.mark.parametrize("name", [n if n in _NNX_FAST else pytest.param(n, marks=pytest.mark.slow) for n in NNX_LAYERS])
def test_nnx_jit_and_eval_shape_build_the_eager_layer(name):
  build, x_shape = NNX_LAYERS[name]
  make = lambda: build(nnx.Rngs(7))
  eager = make()
  jitted = nnx.jit(make)()
  abstract = nnx.eval_shape(make)
  graphdef, state = nnx.split(eager)
  assert nnx.graphdef(jitted) == graphdef == nnx.graphdef(abstract)
  _assert_trees_equal(nnx.state(jitted), state)
  _assert_trees_equal(jax.jit(lambda: nnx.state(make()))(), state)  # plain jax.jit over the state
  shapes = lambda s: jax.tree.map(lambda v: (v.shape, v.dtype), s)
  assert shapes(nnx.state(abstract)) == shapes(state)
  x = jax.random.normal(jax.random.key(1), x_shape)
  _assert_outputs_equal(jitted(x), eager(x))
  # Another seed gives another layer: the comparison above can fail.
  other = nnx.state(build(nnx.Rngs(8)))
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(state), strict=True))


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_block_sparse_pattern_is_drawn_under_jit():
  # The pattern itself (not only the kernel) comes from the rng stream under jit.
  make = lambda seed: layers.BlockSparseLinear(64, 128, density=0.25, block_shape=(16, 16), rngs=nnx.Rngs(seed))
  a, b = nnx.jit(lambda: make(0))(), nnx.jit(lambda: make(1))()
  np.testing.assert_array_equal(a.block_mask, make(0).block_mask)
  assert int(a.block_mask.sum()) == int(b.block_mask.sum()) == 8
  assert not np.array_equal(a.block_mask, b.block_mask)


@pytest.mark.parametrize("name", LINEN_LAYERS)
def test_linen_jit_init_equals_eager_init(name):
  model, x_shape = LINEN_LAYERS[name]
  x = jax.random.normal(jax.random.key(1), x_shape)
  key = jax.random.key(3)
  eager = model.init(key, x)
  jitted = jax.jit(model.init)(key, x)
  _assert_trees_equal(jitted, eager)
  abstract = jax.eval_shape(model.init, key, x)
  assert jax.tree.map(lambda v: (v.shape, v.dtype), abstract) == jax.tree.map(lambda v: (v.shape, v.dtype), eager)
  _assert_outputs_equal(model.apply(jitted, x), model.apply(eager, x))


def test_linen_model_of_sparse_layers_inits_in_jit():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = linen.BlockSparseDense(64, density=0.5, block_shape=(16, 16))(x)
      x = linen.MaskedDense(32, sparsity=0.5)(jax.nn.relu(x))
      return linen.NMDense(8)(x)

  x = jnp.ones((2, 32))
  eager = Net().init(jax.random.key(0), x)
  _assert_trees_equal(jax.jit(Net().init)(jax.random.key(0), x), eager)
  assert set(eager) == {"params", "sparsity"}


def test_densify_of_an_abstract_model_is_the_abstract_dense_model():
  # An orbax restore target: nnx.eval_shape of a sparsified model. densify read the abstract arrays ("'ShapeDtypeStruct'
  # object is not subscriptable"); it gives the abstract dense model, as densify of the concrete model has.
  def make():
    model = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), nnx.Conv(8, 8, (3,), rngs=nnx.Rngs(1)),
                           nnx.Linear(8, 16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(2)))
    rules = {"layers.0": jaxsparse.NM(2, 4), "layers.1": jaxsparse.Unstructured(0.5),
             "layers.2": jaxsparse.BlockSparse(0.5, (4, 4))}
    return jaxsparse.sparsify(model, rules)[0]

  abstract = jaxsparse.densify(nnx.eval_shape(make))
  concrete = jaxsparse.densify(make())
  assert [type(m).__name__ for m in abstract.layers] == ["Linear", "Conv", "Linear"]
  shapes = lambda m: jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), nnx.state(m, nnx.Param))
  leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
  assert leaves and all(isinstance(a, jax.ShapeDtypeStruct) for a in leaves)
  assert shapes(abstract) == shapes(concrete)


# -------------------------------------------------------------------------------------------------
# An unstructured layer's density under a trace: counted from a concrete mask, None (unknown) from a traced one.
# -------------------------------------------------------------------------------------------------

_MASK = np.asarray(jax.random.bernoulli(jax.random.key(3), 0.3, (16, 8)))
_CONV_MASK = np.asarray(jax.random.bernoulli(jax.random.key(4), 0.3, (3, 3, 4, 8)))
_DENSE = nnx.Linear(16, 8, rngs=nnx.Rngs(5))  # concrete weights, made outside the traces
_CONV = nnx.Conv(4, 8, (3, 3), rngs=nnx.Rngs(6))

# name -> builder of a masked layer whose mask is concrete however it is built (given, or ranked from concrete weights)
MASKED_CONCRETE = {
    "masked_mask": lambda: layers.MaskedLinear(16, 8, mask=_MASK, rngs=nnx.Rngs(0)),
    "masked_from_dense": lambda: layers.MaskedLinear.from_dense(_DENSE, sparsity=0.75),
    "masked_conv_mask": lambda: layers.MaskedConv(4, 8, (3, 3), mask=_CONV_MASK, rngs=nnx.Rngs(0)),
    "masked_conv_from_dense": lambda: layers.MaskedConv.from_dense(_CONV, sparsity=0.75),
}


@pytest.mark.parametrize("name", MASKED_CONCRETE)
def test_masked_density_under_eval_shape_is_counted_from_a_concrete_mask(name):
  # Was: a given NumPy mask (or one ranked from concrete weights) became a traced value under nnx.eval_shape, so
  # layer.density raised ConcretizationTypeError there and summary / sparsify reported it unknown (None / NaN).
  build = MASKED_CONCRETE[name]
  want = build().density
  assert 0 < want < 1
  seen = {}

  def make():
    layer = build()
    seen["density"], seen["summary"] = layer.density, jaxsparse.summary(layer).layers[0].density
    drawn = layers.MaskedLinear(16, 8, sparsity=0.5, rngs=nnx.Rngs(0))  # a mask drawn from traced rngs: unknown
    seen["drawn"], seen["drawn_sparsity"] = drawn.density, drawn.sparsity
    return layer

  abstract = nnx.eval_shape(make)
  assert seen == {"density": want, "summary": want, "drawn": None, "drawn_sparsity": None}
  # The abstract layer (an orbax restore target) has no mask values: unknown, not NaN nor an error.
  assert abstract.density is None and jaxsparse.summary(abstract).layers[0].density is None
  if isinstance(abstract, layers.MaskedLinear):
    assert abstract.sparsity is None


def test_sparsify_report_under_eval_shape_counts_concrete_masks():
  # Was: every unstructured layer reported density NaN under nnx.eval_shape / jax.eval_shape, even with masks= given
  # or masks ranked from weights made outside the trace.
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.fc = nnx.Linear(16, 8, rngs=rngs)
      self.conv = nnx.Conv(4, 8, (3, 3), rngs=rngs)
      self.general = nnx.LinearGeneral(16, (2, 4), rngs=rngs)

  rule = jaxsparse.Unstructured(sparsity=0.5)
  model = Model(nnx.Rngs(7))
  masks = {"fc.kernel": _MASK}
  reports = {}

  def make(key, model_of, **kw):
    def f():
      sparse, report = jaxsparse.sparsify(model_of(), rule, **kw)
      reports[key] = report
      return sparse
    return f

  nnx.eval_shape(make("concrete", lambda: model, masks=masks))
  nnx.eval_shape(make("traced", lambda: Model(nnx.Rngs(7))))  # weights drawn under the trace: masks unknown
  eager = {c.path: c.density for c in jaxsparse.sparsify(model, rule, masks=masks)[1].layers}
  assert eager["fc"] == _MASK.mean() and eager["conv"] == eager["general"] == 0.5
  assert {c.path: c.density for c in reports["concrete"].layers} == eager
  assert {c.path: c.density for c in reports["traced"].layers} == {"fc": None, "conv": None, "general": None}
  assert [line.split(" | ")[4] for line in str(reports["traced"]).splitlines()[2:5]] == ["?", "?", "?"]

  class Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8, name="fc")(x)

  x = jnp.ones((2, 16))
  variables = Linen().init(jax.random.key(0), x)
  linen_reports = []
  jax.eval_shape(lambda: linen_reports.append(jaxsparse.sparsify_linen(Linen(), variables, rule, x, masks=masks)[2]))
  assert [c.density for c in linen_reports[0].layers] == [_MASK.mean()]


def test_linen_summary_under_a_trace_counts_a_numpy_mask():
  # Was: the mask of NumPy variables (a checkpoint read with NumPy) was checked with jnp under the trace, which made
  # it a traced value: density None there.
  x = jnp.ones((2, 16))
  variables = jax.tree.map(np.asarray, linen.MaskedDense(8, sparsity=0.75).init(jax.random.key(0), x))
  seen = []
  jax.eval_shape(lambda: seen.append(jaxsparse.summary(variables).layers[0].density))
  assert seen == [jaxsparse.summary(variables).layers[0].density] == [0.25]


# -------------------------------------------------------------------------------------------------
# sparsify of an abstract model (nnx.eval_shape: the orbax restore target built without weights).
# -------------------------------------------------------------------------------------------------


class _AbstractNet(nnx.Module):
  """One layer of every kind sparsify takes: an embedding, a linear, a LinearGeneral and a conv."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(32, 16, rngs=rngs)
    self.fc = nnx.Linear(16, 32, rngs=rngs)
    self.general = nnx.LinearGeneral(32, (2, 8), rngs=rngs)
    self.conv = nnx.Conv(16, 16, (3,), rngs=rngs)

  def __call__(self, ids):
    h = self.general(jax.nn.relu(self.fc(self.embed(ids))))  # (B, T, 2, 8)
    return self.conv(h.reshape(*h.shape[:-2], 16))


ABSTRACT_RULES = {
    "nm": {"fc|general|conv": jaxsparse.NM(2, 4)},
    "unstructured": {"fc|general|conv": jaxsparse.Unstructured(sparsity=0.5)},
    "block": {"fc|general": jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8))},
    "embed": {"embed": jaxsparse.NM(2, 4)},
}


def _abstract_masks():
  """Concrete masks for every layer a rule of ABSTRACT_RULES sparsifies, sparser than the rules keep by magnitude: 1:4
  masks (axis: the groups'), unstructured ones keeping ~30%, and 8x8 block masks keeping ~30% of the blocks."""
  def nm14(key, shape, axis):
    scores = np.moveaxis(np.asarray(jax.random.uniform(key, shape)), axis, -1)
    groups = scores.reshape(*scores.shape[:-1], -1, 4)
    keep = groups == groups.max(-1, keepdims=True)
    return np.moveaxis(keep.reshape(scores.shape), -1, axis)

  keys = jax.random.split(jax.random.key(11), 9)
  blocks = lambda key, shape: np.kron(np.asarray(jax.random.bernoulli(key, 0.3, (shape[0] // 8, shape[1] // 8))),
                                      np.ones((8, 8), bool)).astype(bool)
  return {
      "nm": {"fc.kernel": nm14(keys[0], (16, 32), 0), "general.kernel": nm14(keys[1], (32, 2, 8), 0),
             "conv.kernel": nm14(keys[2], (3, 16, 16), 1)},
      "unstructured": {"fc.kernel": np.asarray(jax.random.bernoulli(keys[3], 0.3, (16, 32))),
                       "general.kernel": np.asarray(jax.random.bernoulli(keys[4], 0.3, (32, 2, 8))),
                       "conv.kernel": np.asarray(jax.random.bernoulli(keys[5], 0.3, (3, 16, 16)))},
      "block": {"fc.kernel": blocks(keys[6], (16, 32)), "general.kernel": blocks(keys[7], (32, 16)).reshape(32, 2, 8)},
      "embed": {"embed.embedding": nm14(keys[8], (32, 16), 1)},
  }


_state_shapes = lambda m: jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), nnx.state(m))
_report_rows = lambda report: [(c.path, c.layer, c.kind, c.replaced_by, c.bytes_before, c.bytes_after)
                               for c in report.layers]


@pytest.mark.parametrize(("kind", "with_masks"), [
    pytest.param(kind, with_masks, id=f"{kind}-{'masks' if with_masks else 'magnitude'}",
                 marks=[pytest.mark.slow] if (kind, with_masks) == ("nm", True) else [])  # ~5 s on 2 cores
    for kind in ABSTRACT_RULES for with_masks in (False, True)
])
def test_sparsify_of_an_abstract_model_is_the_abstract_sparse_model(kind, with_masks):
  # Was: every rule kind raised "TypeError: <path>: 'ShapeDtypeStruct' object is not subscriptable" (the layers'
  # from_dense read the abstract arrays); sparsify runs itself under nnx.eval_shape there, as densify does.
  rules = ABSTRACT_RULES[kind]
  masks = _abstract_masks()[kind] if with_masks else None
  make = lambda: _AbstractNet(nnx.Rngs(0))
  abstract = nnx.eval_shape(make)
  sparse, report = jaxsparse.sparsify(abstract, rules, masks=masks)
  concrete, concrete_report = jaxsparse.sparsify(make(), rules, masks=masks)
  # What a concrete model's sparsify gives under nnx.eval_shape (the orbax guides' target), and its state's shapes.
  want = nnx.eval_shape(lambda: jaxsparse.sparsify(make(), rules, masks=masks)[0])
  assert nnx.graphdef(sparse) == nnx.graphdef(want) == nnx.graphdef(concrete)
  assert _state_shapes(sparse) == _state_shapes(want) == _state_shapes(concrete)
  leaves = jax.tree.leaves(nnx.state(sparse))
  assert leaves and all(isinstance(a, jax.ShapeDtypeStruct) for a in leaves)
  assert type(abstract.fc) is nnx.Linear and type(abstract.embed) is nnx.Embed  # the abstract model is not changed
  # The report comes out of the trace: the same rows, densities known where the masks or the rules fix them.
  assert report.layers and _report_rows(report) == _report_rows(concrete_report)
  densities = {c.path: c.density for c in report.layers}
  if kind == "unstructured" and not with_masks:  # ranked from weights the abstract model does not have: unknown
    assert set(densities.values()) == {None}
    assert all(line.split(" | ")[4] == "?" for line in str(report).splitlines()[2:2 + len(densities)])
  else:
    assert densities == {c.path: c.density for c in concrete_report.layers}
    assert all(0 < d < 1 for d in densities.values())
  if with_masks and kind != "embed":  # the masks keep fewer than the rules would (1:4 against 2:4, ~30%)
    assert all(d < 0.5 for d in densities.values())


def test_compress_of_an_abstract_model_is_the_abstract_compressed_model():
  """compress of an abstract N:M model raised "TypeError: 'ShapeDtypeStruct' object is not subscriptable" (to_compressed
  reads the kernels): eval_shape -> sparsify -> compress -> orbax restore stopped at compress. It runs itself under
  nnx.eval_shape there, as sparsify does."""
  make = lambda: nnx.Sequential(nnx.Linear(32, 16, rngs=nnx.Rngs(0)), nnx.Linear(16, 8, rngs=nnx.Rngs(1)))
  abstract, _ = jaxsparse.sparsify(nnx.eval_shape(make), jaxsparse.NM(2, 4))
  small = jaxsparse.compress(abstract)
  want = nnx.eval_shape(lambda: jaxsparse.compress(jaxsparse.sparsify(make(), jaxsparse.NM(2, 4))[0]))
  assert [type(layer).__name__ for layer in small.layers] == ["CompressedNMLinear"] * 2
  assert nnx.graphdef(small) == nnx.graphdef(want)
  assert _state_shapes(small) == _state_shapes(want)
  assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(nnx.state(small)))
  assert type(abstract.layers[0]).__name__ == "NMLinear"  # not changed


def test_sparsify_of_an_abstract_model_names_check_speed():
  abstract = nnx.eval_shape(lambda: _AbstractNet(nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"check_speed='forward' times each layer on its weights, and this model is "
                                       r"abstract"):
    jaxsparse.sparsify(abstract, ABSTRACT_RULES["nm"], check_speed="forward", example_input=jnp.zeros((2, 4), int))
  sparse, _ = jaxsparse.sparsify(abstract, ABSTRACT_RULES["nm"], inplace=True)  # a new abstract model, as densify
  assert type(sparse.fc) is layers.NMLinear and type(abstract.fc) is nnx.Linear


def test_sparsify_linen_of_abstract_variables_is_the_abstract_sparse_variables():
  # Was: "TypeError: up: float() argument must be a string or a real number, not 'ShapeDtypeStruct'".
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(16, name="down")(nn.relu(nn.Dense(32, name="up")(x)))

  x = jax.random.normal(jax.random.key(0), (2, 64))
  rules = {"up": jaxsparse.NM(2, 4), "down": jaxsparse.Unstructured(sparsity=0.5)}
  masks = {"up.kernel": np.tile(_abstract_masks()["nm"]["fc.kernel"], (4, 1))}  # (64, 32), 1:4 along the inputs
  variables = Net().init(jax.random.key(1), x)
  sparse, sparse_vars, report = jaxsparse.sparsify_linen(Net(), variables, rules, x, masks=masks)
  abstract = jax.eval_shape(Net().init, jax.random.key(1), x)
  sparse_a, abstract_vars, report_a = jaxsparse.sparsify_linen(Net(), abstract, rules, x, masks=masks)
  shapes = lambda t: jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), t)
  assert jax.tree.structure(abstract_vars) == jax.tree.structure(sparse_vars)
  assert shapes(abstract_vars) == shapes(sparse_vars) == shapes(jax.eval_shape(sparse.init, jax.random.key(0), x))
  assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(abstract_vars))
  assert _report_rows(report_a) == _report_rows(report)
  assert {c.path: c.density for c in report_a.layers} == {"up": 0.25, "down": None}
  assert {c.path: c.density for c in report.layers} == {"up": 0.25, "down": 0.5}
  np.testing.assert_array_equal(sparse_a.apply(sparse_vars, x), sparse.apply(sparse_vars, x))
