"""sparsify / densify / compress / summary on models of unusual structure (an audit, 2026-12-01): weights tied at the
layer and at the variable, tied LM heads (``attend``), containers and nesting, path rules, odd shapes and dtypes,
``LinearGeneral`` over several axes, round trips and sparsifying twice; NNX and Linen. Outputs are compared with the
densified (pruned dense) model in float32 at 1e-5."""

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsparse

SPECS = [jaxsparse.NM(2, 4), jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8)),
         jaxsparse.Unstructured(sparsity=0.5)]
TOL = dict(rtol=1e-5, atol=1e-5)

# 54 tests, about 24 s: run by test-slow (CI runs it), so that make test stays within its 15 minutes.
pytestmark = pytest.mark.slow


def _normal(seed, shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _close(a, b):
  np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **TOL)


# --- weights tied at the variable (the fix: a clear error, not two untied sparse copies) -------------------------


class VariableTied(nnx.Module):
  """Two nnx.Linear layers holding one kernel nnx.Param (tied at the variable, not at the layer)."""

  def __init__(self, rngs):
    self.a = nnx.Linear(32, 32, rngs=rngs)
    self.b = nnx.Linear(32, 32, rngs=rngs)
    self.b.kernel = self.a.kernel

  def __call__(self, x):
    return self.b(jax.nn.relu(self.a(x)))


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_layers_tied_at_the_variable_raise_naming_both_paths(spec):
  model = VariableTied(nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"^a: its kernel is also held at b\.kernel .*untie.*map their paths to None"):
    jaxsparse.sparsify(model, spec)
  with pytest.raises(ValueError, match=r"^b: its kernel is also held at a\.kernel"):
    jaxsparse.sparsify(model, {"b": spec})
  assert type(model.a) is nnx.Linear and model.a.kernel is model.b.kernel  # the model is left as it was


def test_layers_tied_at_the_variable_kept_dense_leave_the_rest_sparsified():
  class WithHead(VariableTied):
    def __init__(self, rngs):
      super().__init__(rngs)
      self.head = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
      return self.head(super().__call__(x))

  model = WithHead(nnx.Rngs(0))
  x = _normal(1, (4, 32))
  sparse, report = jaxsparse.sparsify(model, {"a|b": None, ".*": jaxsparse.NM(2, 4)})
  assert [c.path for c in report.layers] == ["head"] and sparse.a.kernel is sparse.b.kernel
  _close(sparse(x), jaxsparse.densify(sparse)(x))


class TableHead(nnx.Module):
  """A tied LM head kept as the embedding's own Param (``self.table = self.embed.embedding``)."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(64, 32, rngs=rngs)
    self.mid = nnx.Linear(32, 32, rngs=rngs)
    self.table = self.embed.embedding

  def __call__(self, ids):
    return self.mid(self.embed(ids)) @ self.table[...].T


def test_embedding_table_held_by_another_module_raises_when_a_rule_names_it():
  model = TableHead(nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"^embed: its embedding is also held at table .*untie"):
    jaxsparse.sparsify(model, {"embed": jaxsparse.NM(2, 4), ".*": jaxsparse.NM(2, 4)})
  # A catch-all rule leaves the table dense: nothing is untied.
  ids = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 5)))
  sparse, report = jaxsparse.sparsify(model, jaxsparse.NM(2, 4))
  assert [c.path for c in report.layers] == ["mid"] and sparse.table is sparse.embed.embedding
  _close(sparse(ids), jaxsparse.densify(sparse)(ids))


# --- weights tied at the layer, tied LM heads (pinned: they work) --------------------------------------------------


class HeldTwice(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(32, 32, rngs=rngs)
    self.b = self.a

  def __call__(self, x):
    return self.b(jax.nn.relu(self.a(x)))


class CalledTwice(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(32, 32, rngs=rngs)

  def __call__(self, x):
    return self.a(jax.nn.relu(self.a(x)))


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("cls", [HeldTwice, CalledTwice])
def test_a_layer_used_twice_is_one_sparse_layer_counted_once(cls, spec):
  model = cls(nnx.Rngs(0))
  x = _normal(1, (4, 32))
  sparse, report = jaxsparse.sparsify(model, spec)
  assert len(report.layers) == 1 and report.layers[0].path == "a"
  if cls is HeldTwice:
    assert sparse.b is sparse.a and report.layers[0].note == "tied: also at b"
  dense = jaxsparse.densify(sparse)
  pruned = dense.a
  _close(sparse(x), pruned(jax.nn.relu(pruned(x))))
  rows = jaxsparse.summary(sparse).layers
  assert [(r.path, r.shape) for r in rows] == [("a", (32, 32))]
  assert rows[0].density == pytest.approx(float(jnp.mean(pruned.kernel[...] != 0)))


class TiedLM(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(64, 32, rngs=rngs)
    self.mid = nnx.Linear(32, 32, rngs=rngs)

  def __call__(self, ids):
    return self.embed.attend(self.mid(self.embed(ids)))


def test_tied_lm_head_through_attend():
  model = TiedLM(nnx.Rngs(0))
  ids = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 5)))
  # A catch-all rule leaves the table dense.
  sparse, report = jaxsparse.sparsify(model, jaxsparse.NM(2, 4))
  assert [c.path for c in report.layers] == ["mid"] and type(sparse.embed) is nnx.Embed
  # A rule naming it compresses it: lookups and attend read the one pruned table.
  sparse, report = jaxsparse.sparsify(model, {"embed": jaxsparse.NM(2, 4), ".*": jaxsparse.NM(2, 4)})
  assert [(c.path, c.replaced_by) for c in report.layers] == [("embed", "CompressedNMEmbed"), ("mid", "NMLinear")]
  dense = jaxsparse.densify(sparse)
  table = dense.embed.embedding[...]
  assert float(jnp.mean(table != 0)) == pytest.approx(0.5)
  _close(sparse(ids), dense(ids))
  _close(sparse(ids), dense.mid(table[ids]) @ table.T)
  rows = {r.path: r for r in jaxsparse.summary(sparse, ids).layers}
  assert rows["embed"].forward_flops == 2 * 32 * 64 // 2 and rows["embed"].dense_forward_flops == 2 * 32 * 64
  small = jaxsparse.compress(sparse)
  assert type(small.mid).__name__ == "CompressedNMLinear"
  _close(small(ids), sparse(ids))


# --- containers, nesting and path rules (pinned) ---------------------------------------------------------------


class Stack(nnx.Module):
  def __init__(self, kind, rngs):
    layers = [nnx.Linear(32, 32, rngs=rngs) for _ in range(3)]
    if kind == "nnx.List":
      self.layers = nnx.List(layers)
    elif kind == "nnx.data(list)":
      self.layers = nnx.data(layers)
    elif kind == "nnx.Dict":
      self.layers = nnx.Dict({str(i): layer for i, layer in enumerate(layers)})
    elif kind == "nnx.Sequential":
      self.layers = nnx.Sequential(*layers)
    self.head = nnx.Linear(32, 8, rngs=rngs)

  def __call__(self, x):
    layers = self.layers.layers if isinstance(self.layers, nnx.Sequential) else self.layers
    for layer in layers.values() if isinstance(layers, nnx.Dict) else layers:
      x = jax.nn.relu(layer(x))
    return self.head(x)


@pytest.mark.parametrize("kind", ["nnx.List", "nnx.data(list)", "nnx.Dict", "nnx.Sequential"])
def test_layers_in_containers_are_replaced_where_the_rules_select_them(kind):
  model = Stack(kind, nnx.Rngs(0))
  x = _normal(4, (4, 32))
  prefix = "layers.layers" if kind == "nnx.Sequential" else "layers"
  sparse, report = jaxsparse.sparsify(model, {rf"{prefix}\.[02]": jaxsparse.NM(2, 4)})
  assert [(c.path, c.replaced_by) for c in report.layers] == [(f"{prefix}.0", "NMLinear"), (f"{prefix}.2", "NMLinear")]
  layers = sparse.layers.layers if kind == "nnx.Sequential" else sparse.layers
  kinds = [type(layers[k]).__name__ for k in ((0, 1, 2) if kind != "nnx.Dict" else ("0", "1", "2"))]
  assert kinds == ["NMLinear", "Linear", "NMLinear"] and type(sparse.head) is nnx.Linear
  assert [r.path for r in jaxsparse.summary(sparse).layers] == [f"{prefix}.0", f"{prefix}.2"]
  _close(sparse(x), jaxsparse.densify(sparse)(x))
  assert all(type(m) is nnx.Linear for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear))  # not changed


def test_rules_are_regexes_matched_in_full():
  """A glob such as ``"layers.*.kernel"`` is a regex, matched against layer paths (never ``.kernel``): it selects
  nothing, and says so."""
  model = Stack("nnx.List", nnx.Rngs(0))
  with pytest.warns(UserWarning, match=r"\['layers\.\*\.kernel'\] matched no .*available paths: head, layers\.0"):
    _, report = jaxsparse.sparsify(model, {"layers.*.kernel": jaxsparse.NM(2, 4)})
  assert report.layers == ()
  _, report = jaxsparse.sparsify(model, {"layers.*": jaxsparse.NM(2, 4)})
  assert [c.path for c in report.layers] == ["layers.0", "layers.1", "layers.2"]


@flax.struct.dataclass
class StructBox:
  lin: nnx.Module
  scale: float = flax.struct.field(pytree_node=False, default=2.0)


class WithBox(nnx.Module):
  """A layer held in a frozen dataclass (a flax.struct.dataclass pytree), and the same layer tied at an attribute."""

  def __init__(self, rngs):
    self.box = nnx.data(StructBox(nnx.Linear(32, 32, rngs=rngs)))
    self.tied = self.box.lin
    self.other = nnx.Linear(32, 32, rngs=rngs)

  def __call__(self, x):
    return self.other(self.tied(self.box.scale * self.box.lin(x)))


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_layer_in_a_frozen_dataclass_is_replaced(spec):
  """Was a FrozenInstanceError from replacing the field in place (also in densify and compress)."""
  model = WithBox(nnx.Rngs(0))
  x = _normal(14, (4, 32))
  sparse, report = jaxsparse.sparsify(model, spec)
  assert [(c.path, c.note) for c in report.layers] == [("box.lin", "tied: also at tied"), ("other", "")]
  assert isinstance(sparse.box, StructBox) and sparse.box.scale == 2.0 and sparse.box.lin is sparse.tied
  assert type(sparse.box.lin) is not nnx.Linear and type(model.box.lin) is nnx.Linear
  dense = jaxsparse.densify(sparse)
  assert type(dense.box.lin) is nnx.Linear and dense.box.lin is dense.tied
  _close(sparse(x), dense(x))
  assert [r.path for r in jaxsparse.summary(sparse).layers] == ["box.lin", "other"]
  if isinstance(spec, jaxsparse.NM):
    small = jaxsparse.compress(sparse)
    assert type(small.box.lin).__name__ == "CompressedNMLinear" and small.box.lin is small.tied
    _close(small(x), sparse(x))


class Deep(nnx.Module):
  def __init__(self, depth, rngs):
    self.inner = Deep(depth - 1, rngs) if depth else nnx.Linear(32, 32, rngs=rngs)

  def __call__(self, x):
    return self.inner(x)


class Nested(nnx.Module):
  """A layer four containers deep: nnx.List / nnx.Dict / nnx.List / nnx.Sequential."""

  def __init__(self, rngs):
    self.stages = nnx.List([nnx.Dict({"mlp": nnx.List([nnx.Sequential(nnx.Linear(32, 32, rngs=rngs))])})])
    self.out = nnx.Linear(32, 32, rngs=rngs)

  def __call__(self, x):
    return self.out(self.stages[0]["mlp"][0](x))


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_layers_nested_deep_are_replaced(spec):
  x = _normal(5, (4, 32))
  deep = Deep(4, nnx.Rngs(0))
  sparse, report = jaxsparse.sparsify(deep, {r"(inner\.){4}inner": spec})
  assert [c.path for c in report.layers] == ["inner.inner.inner.inner.inner"]
  assert type(sparse.inner.inner.inner.inner.inner) is not nnx.Linear
  _close(sparse(x), jaxsparse.densify(sparse)(x))
  nested = Nested(nnx.Rngs(0))
  sparse, report = jaxsparse.sparsify(nested, {r"stages\.0\.mlp\.0\.layers\.0": spec})
  assert [c.path for c in report.layers] == ["stages.0.mlp.0.layers.0"] and type(sparse.out) is nnx.Linear
  assert type(sparse.stages[0]["mlp"][0].layers[0]) is not nnx.Linear
  _close(sparse(x), jaxsparse.densify(sparse)(x))


# --- odd shapes and dtypes (pinned) -----------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "shape", "message"), [
    (jaxsparse.NM(2, 4), (30, 16), r"layers\.0: N:M sparsity 2:4 needs m=4 to divide the input size 30 of its "
                                   r"\(30, 16\) kernel"),
    (jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8)), (30, 16),
     r"layers\.0: block_shape=\(8, 8\) does not divide its kernel viewed as \(in, out\) = \(30, 16\)"),
    (jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8)), (32, 20), r"layers\.0: block_shape=\(8, 8\)"),
])
def test_shapes_a_structure_cannot_take_raise_naming_layer_shape_and_fix(spec, shape, message):
  model = nnx.Sequential(nnx.Linear(*shape, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=message):
    jaxsparse.sparsify(model, spec)


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("options", [
    dict(param_dtype=jnp.bfloat16, dtype=jnp.float32), dict(param_dtype=jnp.float32, dtype=jnp.bfloat16),
    dict(use_bias=False), dict(precision=jax.lax.Precision.HIGHEST),
], ids=["bf16-params-f32-compute", "f32-params-bf16-compute", "no-bias", "precision-highest"])
def test_layer_options_carry_over(spec, options):
  model = nnx.Sequential(nnx.Linear(32, 32, rngs=nnx.Rngs(0), **options))
  x = _normal(6, (4, 32))
  sparse, _ = jaxsparse.sparsify(model, spec)
  dense = jaxsparse.densify(sparse)
  layer, pruned = sparse.layers[0], dense.layers[0]
  assert pruned.kernel.dtype == model.layers[0].kernel.dtype and pruned.dtype == model.layers[0].dtype
  assert (pruned.bias is None) == (model.layers[0].bias is None) and pruned.precision == model.layers[0].precision
  y = sparse(x)
  assert y.dtype == model(x).dtype
  if options.get("dtype") == jnp.bfloat16:
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(dense(x), np.float32), rtol=2e-2, atol=2e-2)
  else:
    _close(y, dense(x))
  kept = np.asarray(pruned.kernel[...] != 0)
  np.testing.assert_array_equal(np.asarray(pruned.kernel[...]), np.where(kept, model.layers[0].kernel[...], 0))
  assert type(layer).__name__ in ("NMLinear", "BlockSparseLinear", "MaskedLinear")


class General(nnx.Module):
  def __init__(self, rngs, in_features=(4, 8), out_features=(2, 16)):
    self.g = nnx.LinearGeneral(in_features, out_features, axis=(-2, -1), rngs=rngs)

  def __call__(self, x):
    return self.g(x)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_linear_general_over_several_axes(spec):
  model = General(nnx.Rngs(0))
  x = _normal(7, (3, 4, 8))
  sparse, report = jaxsparse.sparsify(model, spec)
  assert type(sparse.g).__name__ == "SparseLinearGeneral" and report.layers[0].density == pytest.approx(0.5)
  dense = jaxsparse.densify(sparse)
  kernel = dense.g.kernel[...]
  assert type(dense.g) is nnx.LinearGeneral and kernel.shape == (4, 8, 2, 16)
  kept = np.asarray(kernel != 0)
  assert kept.mean() == pytest.approx(0.5)
  np.testing.assert_array_equal(np.asarray(kernel), np.where(kept, model.g.kernel[...], 0))
  _close(sparse(x), jnp.einsum("bij,ijkl->bkl", x, kernel) + dense.g.bias[...])
  rows = jaxsparse.summary(sparse).layers
  assert [(r.path, r.shape, r.density) for r in rows] == [("g", (32, 32), pytest.approx(0.5))]


# --- round trips, sparsify twice, compress (pinned; Linen twice: the fix) ------------------------------------------


def _mlp():
  return nnx.Sequential(nnx.Linear(32, 64, rngs=nnx.Rngs(0)), jax.nn.relu, nnx.Linear(64, 16, rngs=nnx.Rngs(1)))


@pytest.mark.parametrize("spec", [jaxsparse.BlockSparse(density=1.0, block_shape=(8, 8)),
                                  jaxsparse.Unstructured(sparsity=0.0)], ids=str)
def test_a_structure_keeping_every_weight_round_trips_exactly(spec):
  model = _mlp()
  x = _normal(8, (4, 32))
  sparse, report = jaxsparse.sparsify(model, spec)
  assert [c.density for c in report.layers] == [1.0, 1.0]
  dense = jaxsparse.densify(sparse)
  for i in (0, 2):
    np.testing.assert_array_equal(np.asarray(dense.layers[i].kernel[...]), np.asarray(model.layers[i].kernel[...]))
    np.testing.assert_array_equal(np.asarray(dense.layers[i].bias[...]), np.asarray(model.layers[i].bias[...]))
  _close(sparse(x), model(x))


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_sparsify_twice_leaves_sparse_layers_as_they_are(spec):
  model = _mlp()
  x = _normal(9, (4, 32))
  sparse, _ = jaxsparse.sparsify(model, spec)
  for again in (spec, jaxsparse.NM(1, 4), jaxsparse.Unstructured(sparsity=0.9)):
    with pytest.warns(UserWarning, match="matched no"):
      twice, report = jaxsparse.sparsify(sparse, again)
    assert report.layers == () and [type(t) for t in twice.layers] == [type(s) for s in sparse.layers]
    np.testing.assert_array_equal(np.asarray(twice(x)), np.asarray(sparse(x)))
  summary = jaxsparse.summary(sparse)
  assert jaxsparse.summary(model).layers == () and [r.path for r in summary.layers] == ["layers.0", "layers.2"]


def test_compress_after_sparsify_and_summary_before_and_after():
  model = _mlp()
  x = _normal(10, (4, 32))
  sparse, _ = jaxsparse.sparsify(model, jaxsparse.NM(2, 4))
  small = jaxsparse.compress(sparse)
  _close(small(x), sparse(x))
  _close(jaxsparse.densify(small)(x), sparse(x))
  before, after = jaxsparse.summary(sparse), jaxsparse.summary(small)
  assert [r.kind for r in after.layers] == ["CompressedNMLinear"] * 2
  assert [r.density for r in after.layers] == [r.density for r in before.layers] == [0.5, 0.5]
  assert after.bytes < before.bytes == before.dense_bytes and after.forward_flops == before.forward_flops
  with pytest.warns(UserWarning, match="matched no"):
    _, report = jaxsparse.sparsify(small, jaxsparse.NM(2, 4))
  assert report.layers == ()


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(16)(nn.relu(nn.Dense(64)(x)))


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_sparsify_linen_of_a_sparsified_linen_raises(spec):
  model = LinenMLP()
  x = _normal(11, (4, 32))
  variables = model.init(jax.random.key(0), x)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, spec, x)
  for again in (spec, jaxsparse.Unstructured(sparsity=0.75)):
    with pytest.raises(TypeError, match=r"module is a SparsifiedLinen .*densify_linen"):
      jaxsparse.sparsify_linen(sparse, sparse_vars, again, x)
  # The way it names: densify, then sparsify the dense module.
  module, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  again, again_vars, _ = jaxsparse.sparsify_linen(module, dense_vars, spec, x)
  _close(again.apply(again_vars, x), sparse.apply(sparse_vars, x))


class LinenShared(nn.Module):
  def setup(self):
    self.d = nn.Dense(32)

  def __call__(self, x):
    return self.d(nn.relu(self.d(x)))


class LinenLM(nn.Module):
  def setup(self):
    self.embed = nn.Embed(64, 32)
    self.mid = nn.Dense(32)

  def __call__(self, ids):
    return self.embed.attend(self.mid(self.embed(ids)))


class LinenContainers(nn.Module):
  def setup(self):
    self.layers = [nn.Dense(32) for _ in range(3)]
    self.named = {"a": nn.Dense(32), "b": nn.Dense(32)}

  def __call__(self, x):
    for layer in self.layers:
      x = nn.relu(layer(x))
    return self.named["b"](self.named["a"](x))


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_linen_shared_layer_and_containers(spec):
  x = _normal(12, (4, 32))
  for model, paths in ((LinenShared(), ["d"]),
                       (LinenContainers(), ["layers_0", "layers_1", "layers_2", "named_a", "named_b"])):
    variables = model.init(jax.random.key(0), x)
    sparse, sparse_vars, report = jaxsparse.sparsify_linen(model, variables, spec, x)
    assert [c.path for c in report.layers] == paths
    _, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
    _close(sparse.apply(sparse_vars, x), model.apply(dense_vars, x))
    assert [r.path for r in jaxsparse.summary(sparse_vars, x, module=sparse).layers] == paths


def test_linen_tied_lm_head_through_attend():
  model = LinenLM()
  ids = jnp.asarray(np.random.default_rng(13).integers(0, 64, (2, 5)))
  variables = model.init(jax.random.key(0), ids)
  sparse, sparse_vars, report = jaxsparse.sparsify_linen(
      model, variables, {"embed": jaxsparse.NM(2, 4), ".*": jaxsparse.NM(2, 4)}, ids)
  assert [(c.path, c.replaced_by) for c in report.layers] == [("embed", "CompressedNMEmbed"), ("mid", "NMDense")]
  _, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  table = dense_vars["params"]["embed"]["embedding"]
  assert float(jnp.mean(table != 0)) == pytest.approx(0.5)
  _close(sparse.apply(sparse_vars, ids), model.apply(dense_vars, ids))
  rows = {r.path: r for r in jaxsparse.summary(sparse_vars, ids, module=sparse).layers}
  assert rows["embed"].forward_flops == 2 * 32 * 64 // 2
  small, small_vars = jaxsparse.compress_linen(sparse, sparse_vars)
  _close(small.apply(small_vars, ids), sparse.apply(sparse_vars, ids))
