"""The Linen CompressedNMEmbed and its workflows: lookups, attend and gradients against nn.Embed on the pruned table,
jit / vmap, sparsify_linen / densify_linen of a tied-embedding LM, summary bytes, abstract init, partitioning boxes,
torch export, bad input."""

from __future__ import annotations

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsparse
from jaxsparse import torch_interop
from jaxsparse.layers.linen import CompressedNMEmbed
from tests._util import assert_close

# (num_embeddings, features, n, m)
# (v, d, n, m); long: (33, 24, 4, 8) moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
SHAPES = [(50, 32, 2, 4), (7, 16, 1, 4), pytest.param((33, 24, 4, 8), marks=pytest.mark.slow), (1, 8, 2, 4)]


def _pruned(table, n, m):
  """The dense table pruned to n:m along the features by magnitude (plain jnp, the reference)."""
  return jnp.where(jaxsparse.nm_mask(table, n, m, axis=1), table, jnp.zeros((), table.dtype))


def _embed_variables(v, d, n, m, dtype, seed):
  """CompressedNMEmbed variables and the dense table its init drew (nn.Embed's init draws it with the same key)."""
  ids = jnp.zeros((1,), jnp.int32)
  variables = CompressedNMEmbed(v, d, n=n, m=m, param_dtype=dtype).init(jax.random.key(seed), ids)
  table = nn.Embed(v, d, param_dtype=dtype).init(jax.random.key(seed), ids)["params"]["embedding"]
  return variables, table


# -------------------------------------------------------------------------------------------------
# The layer.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_lookup_and_attend_equal_nn_embed_on_the_pruned_table(shape, dtype):
  v, d, n, m = shape
  seed = int(np.random.default_rng().integers(1 << 30))  # fresh data each run; the seed is in the failure message
  variables, table = _embed_variables(v, d, n, m, dtype, seed)
  assert variables["params"]["embedding"].shape == (d * n // m, v) and variables["params"]["embedding"].dtype == dtype
  layer, ref = CompressedNMEmbed(v, d, n=n, m=m, param_dtype=dtype), nn.Embed(v, d, param_dtype=dtype)
  ref_vars = {"params": {"embedding": _pruned(table, n, m)}}
  ids = jax.random.randint(jax.random.key(seed), (3, 5), 0, v)
  out = layer.apply(variables, ids)
  assert out.shape == (3, 5, d) and out.dtype == dtype
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref.apply(ref_vars, ids), np.float32),
                                err_msg=str(seed))
  assert float(jnp.mean(out == 0)) >= 1 - n / m  # the pruned features read zeros
  np.testing.assert_array_equal(jax.jit(layer.apply)(variables, ids), out)
  np.testing.assert_array_equal(jax.vmap(layer.apply, in_axes=(None, 0))(variables, ids), out)
  q = jax.random.normal(jax.random.key(seed + 1), (2, 3, d), dtype)
  logits = layer.apply(variables, q, method="attend")
  expected = ref.apply(ref_vars, q, method="attend")
  assert logits.shape == (2, 3, v) and logits.dtype == expected.dtype == dtype
  if dtype == jnp.float32:
    np.testing.assert_allclose(logits, expected, rtol=1e-6, atol=1e-6, err_msg=str(seed))
  else:
    assert_close(logits, expected, dtype)
  # jit may fuse the product differently from the eager call (1 ulp apart on GPUs).
  jitted = jax.jit(lambda vs, q: layer.apply(vs, q, method="attend"))(variables, q)
  np.testing.assert_allclose(np.asarray(jitted, np.float32), np.asarray(logits, np.float32), rtol=1e-6, atol=1e-6)


def test_ids_out_of_range_and_negative_as_nn_embed():
  variables, table = _embed_variables(10, 16, 2, 4, jnp.float32, 0)
  ids = jnp.array([0, 9, -1, -10, 10, -11, 1000])
  out = CompressedNMEmbed(10, 16).apply(variables, ids)
  np.testing.assert_array_equal(out, nn.Embed(10, 16).apply({"params": {"embedding": _pruned(table, 2, 4)}}, ids))
  assert np.isnan(np.asarray(out)[4:]).all() and not np.isnan(np.asarray(out)[:4]).any()


def test_dtype_and_param_dtype_as_nn_embed():
  """``dtype`` is the lookups' and attend's dtype; ``None``: the table's for lookups, the promoted one in attend."""
  ids, q = jnp.array([[1, 4, 7]]), jax.random.normal(jax.random.key(3), (2, 16), jnp.float32)
  variables, table = _embed_variables(12, 16, 2, 4, jnp.bfloat16, 1)
  ref_vars = {"params": {"embedding": _pruned(table, 2, 4)}}
  for dtype in (None, jnp.float32, jnp.bfloat16):
    layer = CompressedNMEmbed(12, 16, dtype=dtype, param_dtype=jnp.bfloat16)
    ref = nn.Embed(12, 16, dtype=dtype, param_dtype=jnp.bfloat16)
    out, expected = layer.apply(variables, ids), ref.apply(ref_vars, ids)
    assert out.dtype == expected.dtype, dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    logits, expected = layer.apply(variables, q, method="attend"), ref.apply(ref_vars, q, method="attend")
    assert logits.dtype == expected.dtype, dtype  # None: float32 query x bfloat16 table -> float32, as nn.Embed
    assert_close(logits, expected, expected.dtype)
  f32_vars = CompressedNMEmbed(12, 16, dtype=jnp.bfloat16).init(jax.random.key(0), ids)
  assert f32_vars["params"]["embedding"].dtype == jnp.float32
  assert CompressedNMEmbed(12, 16, dtype=jnp.bfloat16).apply(f32_vars, ids).dtype == jnp.bfloat16


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_gradients_of_the_kept_values_are_the_masked_dense_gradient():
  v, d = 20, 32
  variables, table = _embed_variables(v, d, 2, 4, jnp.float32, 3)
  ids = jnp.array([[1, 4, 4, 19]])
  q = jax.random.normal(jax.random.key(2), (4, d))

  def loss(module, params, rest):
    vs = {"params": params, **rest}
    return jnp.sum(module.apply(vs, ids) ** 2) + jnp.sum(jnp.sin(module.apply(vs, q, method="attend")))

  rest = {"sparsity": variables["sparsity"]}
  g = jax.grad(loss, argnums=1)(CompressedNMEmbed(v, d), variables["params"], rest)["embedding"]
  pruned = _pruned(table, 2, 4)
  g_dense = jax.grad(loss, argnums=1)(nn.Embed(v, d), {"embedding": pruned}, {})["embedding"]
  mask = np.asarray(pruned != 0)
  assert mask.sum() == v * d // 2
  # Each kept value (stored transposed, (16, 20), in feature order within its row) gets the dense gradient at its
  # position.
  picked = np.stack([np.asarray(g_dense)[r][mask[r]] for r in range(v)], axis=1)  # (d // 2, v)
  assert np.abs(picked).min() > 0  # every kept value gets a gradient here (ids 1, 4, 19 and attend)
  np.testing.assert_allclose(g, picked, rtol=1e-5, atol=1e-6)


def test_abstract_init_and_boxed_initializer():
  ids = jnp.arange(3)
  layer = CompressedNMEmbed(12, 8, param_dtype=jnp.bfloat16)
  abstract = jax.eval_shape(layer.init, jax.random.key(0), ids)
  concrete = layer.init(jax.random.key(0), ids)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(lambda a: (a.shape, a.dtype), concrete)
  assert abstract["params"]["embedding"].shape == (4, 12) and abstract["params"]["embedding"].dtype == jnp.bfloat16
  init = nn.with_partitioning(nn.initializers.normal(1.0), ("vocab", "embed"))
  boxed = CompressedNMEmbed(12, 8, embedding_init=init).init(jax.random.key(0), ids)
  # Stored transposed; the positions' packed words are not split by the features (a split need not divide them).
  for value, names in ((boxed["params"]["embedding"], ("embed", "vocab")),
                       (boxed["sparsity"]["embedding_positions"], (None, "vocab"))):
    assert isinstance(value, nn.Partitioned) and value.names == names
  np.testing.assert_array_equal(CompressedNMEmbed(12, 8, embedding_init=init).apply(boxed, ids),
                                CompressedNMEmbed(12, 8).apply(nn.meta.unbox(boxed), ids))


@pytest.mark.parametrize("build, call, match", [
    (lambda: CompressedNMEmbed(10, 6), None, r"m=4 must divide features=6"),
    (lambda: CompressedNMEmbed(10, 8, n=4, m=4), None, r"n must satisfy 0 < n < m"),
    (lambda: CompressedNMEmbed(-1, 8), None, r"num_embeddings must be a non-negative int, got -1"),
    (lambda: CompressedNMEmbed(10, 8.0), None, r"features must be a non-negative int, got 8\.0"),
    (lambda: CompressedNMEmbed(10, 8, implementation="bogus"), None, r"implementation"),
    (lambda: CompressedNMEmbed(10, 8), lambda e, v: e.apply(v, jnp.ones(3)),
     r"inputs must be integer token ids, got dtype float32"),
    (lambda: CompressedNMEmbed(10, 8), lambda e, v: e.apply(v, jnp.ones((2, 12)), method="attend"),
     r"CompressedNMEmbed has features=8: query must have shape \(\.\.\., 8\), got query.shape=\(2, 12\)"),
    # A complex query failed inside nm_matmul with "x must have a floating dtype", naming neither query nor attend.
    (lambda: CompressedNMEmbed(10, 8), lambda e, v: e.apply(v, jnp.ones((2, 8), jnp.complex64), method="attend"),
     r"CompressedNMEmbed\.attend: query must be real \(a floating, integer or bool array.*query\.dtype=complex64"),
    (lambda: CompressedNMEmbed(10, 8), lambda e, v: e.apply({"params": v["params"]}, jnp.arange(2)),
     r"CompressedNMEmbed has no 'sparsity' collection"),
    (lambda: CompressedNMEmbed(10, 8), lambda e, v: e.apply({**v, "params": {"embedding": jnp.ones((10, 8))}},
                                                              jnp.arange(2)), r"shape \(4, 10\)"),
])
def test_bad_arguments_raise(build, call, match):
  with pytest.raises((TypeError, ValueError, flax.errors.ScopeParamShapeError), match=match):
    layer = build()
    call(layer, layer.init(jax.random.key(0), jnp.arange(2)))


@pytest.mark.parametrize("shape", [(0, 16), (8, 0)])
def test_empty_tables_as_nn_embed(shape):
  """Linen refused an empty table ("num_embeddings must be a positive int, got 0", so sparsify_linen of a model with
  one raised) that nn.Embed and the NNX CompressedNMEmbed take; sparsify_linen's layer then died on Flax's shape check
  (its default initializer divides by the empty fan-in), and attend of a table of no features on the N:M op's empty
  contraction. Now both behave as nn.Embed: empty rows, zero logits, and an IndexError naming the empty table for ids
  looked up in one."""
  init = nn.initializers.normal()
  ids = jnp.array([[0, 5, 7]])
  query = jnp.ones((2, shape[1]))

  class LM(nn.Module):
    @nn.compact
    def __call__(self, ids):
      embed = nn.Embed(*shape, embedding_init=init, name="embed")
      return embed.attend(query) if shape[0] == 0 else embed.attend(embed(ids).sum(1))

  layer = CompressedNMEmbed(*shape, embedding_init=init)
  variables = layer.init(jax.random.key(0), ids[:, :0])
  dense = nn.Embed(*shape, embedding_init=init)
  dense_vars = dense.init(jax.random.key(0), ids[:, :0])
  np.testing.assert_array_equal(layer.apply(variables, query, method="attend"),
                                dense.apply(dense_vars, query, method="attend"))
  if shape[0] == 0:
    with pytest.raises(IndexError, match=r"CompressedNMEmbed has num_embeddings=0: an empty table has no rows"):
      layer.apply(variables, ids)
  else:
    np.testing.assert_array_equal(layer.apply(variables, ids), dense.apply(dense_vars, ids))
  model = LM()
  model_vars = model.init(jax.random.key(0), ids)
  sparse, sparse_vars, report = jaxsparse.sparsify_linen(model, model_vars, {"embed": jaxsparse.NM(2, 4)}, ids)
  np.testing.assert_array_equal(sparse.apply(sparse_vars, ids), model.apply(model_vars, ids))
  assert report.layers[0].density == jaxsparse.summary(sparse_vars, module=sparse).layers[0].density == 0.0


# -------------------------------------------------------------------------------------------------
# Workflows: a tied-embedding LM.
# -------------------------------------------------------------------------------------------------

VOCAB, D = 64, 32


class _TiedLM(nn.Module):
  """Token embedding, one Dense, logits through the same table (``attend``)."""

  dtype: jnp.dtype | None = None
  param_dtype: jnp.dtype = jnp.float32

  def setup(self):
    self.embed = nn.Embed(VOCAB, D, dtype=self.dtype, param_dtype=self.param_dtype)
    self.fc = nn.Dense(D, dtype=self.dtype, param_dtype=self.param_dtype)

  def __call__(self, ids):
    return self.embed.attend(nn.gelu(self.fc(self.embed(ids))))


def _lm(param_dtype=jnp.float32, seed=0):
  model = _TiedLM(param_dtype=param_dtype)
  ids = jax.random.randint(jax.random.key(seed + 1), (2, 7), 0, VOCAB)
  return model, model.init(jax.random.key(seed), ids), ids


def _with_pruned_table(variables, n=2, m=4):
  table = variables["params"]["embed"]["embedding"]
  return {"params": {**variables["params"], "embed": {"embedding": _pruned(table, n, m)}}}


def test_sparsify_linen_tied_lm_and_densify_back():
  model, variables, ids = _lm()
  sparse, sparse_vars, report = jaxsparse.sparsify_linen(model, variables, {"embed": jaxsparse.NM(2, 4)}, ids)
  (change,) = report.layers
  assert (change.path, change.layer, change.replaced_by, change.density) == ("embed", "Embed(64x32)",
                                                                              "CompressedNMEmbed", 0.5)
  assert change.bytes_after < 0.6 * change.bytes_before
  assert jax.tree.map(jnp.shape, sparse_vars["sparsity"]) == {"embed": {"embedding_positions": (4, VOCAB)}}
  assert sparse_vars["params"]["embed"]["embedding"].shape == (D // 2, VOCAB)
  expected = model.apply(_with_pruned_table(variables), ids)  # the dense model on the pruned table
  out = sparse.apply(sparse_vars, ids)
  np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(jax.jit(sparse.apply)(sparse_vars, ids), expected, rtol=1e-6, atol=1e-6)
  dense_module, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  assert dense_module is model and "sparsity" not in dense_vars
  np.testing.assert_array_equal(dense_vars["params"]["embed"]["embedding"],
                                _with_pruned_table(variables)["params"]["embed"]["embedding"])  # exact
  np.testing.assert_array_equal(dense_vars["params"]["fc"]["kernel"], variables["params"]["fc"]["kernel"])


@pytest.mark.slow  # 10-19 s on 2 cores: out of the fast set (make test <= 15 min); CI runs it
def test_sparsified_lm_trains_its_kept_values():
  """Gradients reach the kept values through the lookup and attend, as the dense model's on the pruned table (masked);
  an SGD step keeps the pattern."""
  model, variables, ids = _lm()
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, {"embed": jaxsparse.NM(2, 4)}, ids)
  grads = jax.grad(lambda p: jnp.mean(sparse.apply({**sparse_vars, "params": p}, ids) ** 2))(sparse_vars["params"])
  dense_grads = jax.grad(lambda p: jnp.mean(model.apply({"params": p}, ids) ** 2))(
      _with_pruned_table(variables)["params"])
  # The gradient of the kept values, densified like the values (zeros where pruned), is the masked dense gradient.
  as_table = jaxsparse.densify_linen(sparse, {**sparse_vars, "params": grads})[1]["params"]["embed"]["embedding"]
  pruned = _with_pruned_table(variables)["params"]["embed"]["embedding"]
  expected = jnp.where(pruned != 0, dense_grads["embed"]["embedding"], 0)
  assert float(jnp.abs(expected).sum()) > 0
  np.testing.assert_allclose(as_table, expected, rtol=1e-5, atol=1e-7)
  stepped = {**sparse_vars, "params": jax.tree.map(lambda p, g: p - 0.1 * g, sparse_vars["params"], grads)}
  table = jaxsparse.densify_linen(sparse, stepped)[1]["params"]["embed"]["embedding"]
  np.testing.assert_array_equal(table == 0, pruned == 0)


def test_a_model_reading_the_table_itself_reads_the_pruned_table():
  """``h @ self.embed.embedding.T`` (tied logits without attend): the sparse layer holds the table, so nn.Embed's setup
  does not run; the attribute is the pruned table, decompressed, so the model computes what the dense one does on it."""

  class Net(nn.Module):
    def setup(self):
      self.embed = nn.Embed(VOCAB, D)

    def __call__(self, ids):
      return self.embed(ids) @ self.embed.embedding.T

  model, ids = Net(), jnp.array([[1, 2, 3, 63]])
  variables = model.init(jax.random.key(0), ids)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, {"embed": jaxsparse.NM(2, 4)}, ids)
  np.testing.assert_allclose(sparse.apply(sparse_vars, ids), model.apply(_with_pruned_table(variables), ids),
                             rtol=1e-6, atol=1e-6)


def test_sparsify_linen_embed_rules_as_nnx_sparsify():
  """Catch-all rules leave the embedding dense; a rule naming it takes NM only; masks key ``<path>.embedding``."""
  model, variables, ids = _lm()
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, jaxsparse.NM(2, 4), ids)
  assert list(sparse.layers) == [("fc",)] and sparse_vars["params"]["embed"]["embedding"].shape == (VOCAB, D)
  with pytest.raises(ValueError, match=r"embed \(nn.Embed\): rule 'embed' gives it unstructured .* an embedding "
                     r"takes only NM\(n, m\) rules"):
    jaxsparse.sparsify_linen(model, variables, {"embed": jaxsparse.Unstructured(sparsity=0.5)}, ids)
  with pytest.raises(ValueError, match=r"takes only NM\(n, m\) rules \(not transposable\)"):
    jaxsparse.sparsify_linen(model, variables, {"embed": jaxsparse.NM(2, 4, transposable=True)}, ids)
  with pytest.raises(ValueError, match=r"embed: m=3 must divide the embedding's features=32"):
    jaxsparse.sparsify_linen(model, variables, {"embed": jaxsparse.NM(1, 3)}, ids)
  mask = np.zeros((VOCAB, D), bool)
  mask[:, 1::2] = True  # not the magnitude choice
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, {"embed": jaxsparse.NM(2, 4)}, ids,
                                                    masks={"embed.embedding": mask})
  table = jaxsparse.densify_linen(sparse, sparse_vars)[1]["params"]["embed"]["embedding"]
  np.testing.assert_array_equal(table, np.where(mask, variables["params"]["embed"]["embedding"], 0))
  with pytest.raises(ValueError, match=r"embed: the given mask is not 2:4 along the features \(axis 1\)"):
    jaxsparse.sparsify_linen(model, variables, {"embed": jaxsparse.NM(2, 4)}, ids,
                             masks={"embed.embedding": np.ones((VOCAB, D), bool)})
  with pytest.raises(ValueError, match=r"embed: the given mask has shape \(32, 64\), the embedding \(64, 32\)"):
    jaxsparse.sparsify_linen(model, variables, {"embed": jaxsparse.NM(2, 4)}, ids,
                             masks={"embed.embedding": mask.T})
  with pytest.raises(ValueError, match=r"masks has key\(s\) \['embed.embedding'\]"):
    jaxsparse.sparsify_linen(model, variables, {"fc": jaxsparse.NM(2, 4)}, ids, masks={"embed.embedding": mask})


def test_sparsify_linen_embed_with_compact_modules_and_compress_linen():
  """An nn.Embed made in a compact method, called by keyword (``inputs=`` / ``query=``), with an NMDense next to it;
  compress_linen compresses the Dense and keeps the embedding."""

  class Net(nn.Module):
    @nn.compact
    def __call__(self, ids):
      embed = nn.Embed(VOCAB, D, name="tok")
      return embed.attend(query=nn.Dense(D, name="fc")(embed(inputs=ids)))

  model, ids = Net(), jnp.array([[3, 1, 63, 0]])
  variables = model.init(jax.random.key(0), ids)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, {"tok": jaxsparse.NM(2, 4),
                                                                       "fc": jaxsparse.NM(2, 4)}, ids)
  _, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  expected = model.apply(dense_vars, ids)
  np.testing.assert_allclose(sparse.apply(sparse_vars, ids), expected, rtol=1e-5, atol=1e-6)
  small, small_vars = jaxsparse.compress_linen(sparse, sparse_vars)
  assert small_vars["params"]["fc"]["kernel"].shape == (D // 2, D)
  np.testing.assert_array_equal(small_vars["params"]["tok"]["embedding"], sparse_vars["params"]["tok"]["embedding"])
  np.testing.assert_allclose(small.apply(small_vars, ids), expected, rtol=1e-5, atol=1e-6)


def test_summary_bytes_of_a_2_4_bfloat16_table():
  model, variables, ids = _lm(jnp.bfloat16)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, {"embed": jaxsparse.NM(2, 4)}, ids)
  (row,) = jaxsparse.summary(sparse_vars, module=sparse).layers
  assert (row.path, row.kind, row.shape, row.pattern, row.density) == ("embed", "CompressedNMEmbed", (VOCAB, D),
                                                                        "2:4 compressed", 0.5)
  assert row.dense_bytes == VOCAB * D * 2 and row.bytes / row.dense_bytes == 0.5625
  assert row.forward_flops == row.dense_forward_flops == 0  # a lookup
  layer = CompressedNMEmbed(VOCAB, D, param_dtype=jnp.bfloat16)
  (row2,) = jaxsparse.summary(layer.init(jax.random.key(0), ids), ids, module=layer).layers  # the layer by itself
  assert (row2.kind, row2.bytes, row2.dense_bytes) == ("CompressedNMEmbed", row.bytes, row.dense_bytes)
  with pytest.raises(ValueError, match=r"embed holds a compressed N:M embedding .* pass module="):
    jaxsparse.summary(sparse_vars)


def test_abstract_init_of_the_sparsified_lm_is_the_restore_target():
  model, variables, ids = _lm()
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, {"embed": jaxsparse.NM(2, 4)}, ids)
  abstract = jax.eval_shape(sparse.init, jax.random.key(0), ids)
  assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(abstract))
  spec = lambda t: jax.tree.map(lambda a: (a.shape, a.dtype), t)
  assert spec(abstract) == spec(sparse_vars) and jax.tree.structure(abstract) == jax.tree.structure(sparse_vars)
  # A fresh sparse init is pruned as sparsify_linen prunes: densified, it is the dense init on the pruned table.
  fresh = sparse.init(jax.random.key(0), ids)
  np.testing.assert_allclose(sparse.apply(fresh, ids), model.apply(_with_pruned_table(variables), ids), rtol=1e-6,
                             atol=1e-6)
  _, target = jaxsparse.densify_linen(sparse, abstract)
  assert spec(target) == spec(variables)


def test_partitioned_table_keeps_its_names():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, ids):
      init = nn.with_partitioning(nn.initializers.normal(1.0), ("vocab", "embed"))
      return nn.Embed(VOCAB, D, embedding_init=init, name="embed")(ids)

  model, ids = Net(), jnp.array([[1, 2, 3]])
  variables = model.init(jax.random.key(0), ids)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, {"embed": jaxsparse.NM(2, 4)}, ids)
  for value, names in ((sparse_vars["params"]["embed"]["embedding"], ("embed", "vocab")),
                       (sparse_vars["sparsity"]["embed"]["embedding_positions"], (None, "vocab"))):
    assert isinstance(value, nn.Partitioned) and value.names == names
  init_vars = sparse.init(jax.random.key(0), ids)
  assert init_vars["params"]["embed"]["embedding"].names == ("embed", "vocab")
  _, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  table = dense_vars["params"]["embed"]["embedding"]
  assert isinstance(table, nn.Partitioned) and table.names == ("vocab", "embed")
  np.testing.assert_array_equal(table.value, _pruned(variables["params"]["embed"]["embedding"].value, 2, 4))
  np.testing.assert_array_equal(sparse.apply(sparse_vars, ids), model.apply(dense_vars, ids))


def test_torch_export_is_the_pruned_nn_embedding():
  torch = pytest.importorskip("torch")
  model, variables, ids = _lm()
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, {"embed": jaxsparse.NM(2, 4)}, ids)
  state = torch_interop.export_state_dict(sparse_vars, module=sparse)
  pruned = np.asarray(_with_pruned_table(variables)["params"]["embed"]["embedding"])
  assert tuple(state["embed.weight"].shape) == (VOCAB, D)
  np.testing.assert_array_equal(state["embed.weight"].numpy(), pruned)
  embedding = torch.nn.Embedding(VOCAB, D)
  embedding.load_state_dict({"weight": state["embed.weight"]})
  lookups = sparse.apply(sparse_vars, ids, method=lambda lm, i: lm.embed(i))
  np.testing.assert_array_equal(embedding(torch.from_numpy(np.array(ids))).detach().numpy(), lookups)
  masks = torch_interop.export_masks(sparse_vars, module=sparse)
  np.testing.assert_array_equal(masks["embed.weight_mask"].numpy(), pruned != 0)
  assert sorted(torch_interop.export_state_dict(sparse_vars, module=sparse, format="prune")) == [
      "embed.weight_mask", "embed.weight_orig", "fc.bias", "fc.weight"]
  with pytest.raises(TypeError, match=r"embed holds a compressed N:M embedding \(CompressedNMEmbed\).* module="):
    torch_interop.export_state_dict(sparse_vars)


def test_sparsify_linen_report_counts_the_embedding_kept_weights():
  """As NNX sparsify: the report said n/m for an N:M embedding whatever its mask kept; now counted, from the mask
  under jax.eval_shape."""
  model, variables, ids = _lm()
  mask = np.zeros((VOCAB, D), bool)
  mask[:, ::4] = True  # 1:4 under a 2:4 rule
  rules, masks = {"embed": jaxsparse.NM(2, 4)}, {"embed.embedding": mask}
  report = jaxsparse.sparsify_linen(model, variables, rules, ids, masks=masks)[2]
  assert [c.density for c in report.layers if c.path == "embed"] == [0.25]
  report = jaxsparse.sparsify_linen(model, variables, rules, ids)[2]
  assert [c.density for c in report.layers if c.path == "embed"] == [0.5]
  reports = []

  def make(v):
    sparse_vars, report = jaxsparse.sparsify_linen(model, v, rules, ids, masks=masks)[1:]
    reports.append(report)
    return sparse_vars

  jax.eval_shape(make, variables)
  assert [c.density for c in reports[0].layers if c.path == "embed"] == [0.25]


def test_summary_counts_the_embedding_kept_weights_as_the_report():
  """As NNX: summary said n/m for a Linen CompressedNMEmbed whatever it kept (a 1:4 mask under a 2:4 rule, a zero
  row), while the sparsify_linen report counted. Now it counts the nonzero kept values, as the report; the layer by
  itself (module=, example inputs) and abstract variables too."""
  model, variables, ids = _lm()
  table = variables["params"]["embed"]["embedding"].at[3].set(0.0)  # a padding row: nothing kept
  variables = {"params": {**variables["params"], "embed": {"embedding": table}}}
  mask = np.zeros((VOCAB, D), bool)
  mask[:, ::4] = True  # 1:4 under a 2:4 rule
  mask[5, 4] = False  # a group keeping none
  rules = {"embed": jaxsparse.NM(2, 4)}
  for masks, kept in ((None, (VOCAB - 1) * D // 2), ({"embed.embedding": mask}, (VOCAB - 1) * D // 4 - 1)):
    sparse, sparse_vars, report = jaxsparse.sparsify_linen(model, variables, rules, ids, masks=masks)
    (row,) = jaxsparse.summary(sparse_vars, module=sparse).layers
    assert row.density == next(c.density for c in report.layers if c.path == "embed") == kept / (VOCAB * D)
  layer = CompressedNMEmbed(VOCAB, D)
  layer_vars = {"params": {"embedding": sparse_vars["params"]["embed"]["embedding"]},
                "sparsity": {"embedding_positions": sparse_vars["sparsity"]["embed"]["embedding_positions"]}}
  assert jaxsparse.summary(layer_vars, ids, module=layer).layers[0].density == kept / (VOCAB * D)
  abstract = jax.eval_shape(layer.init, jax.random.key(0), ids)
  assert jaxsparse.summary(abstract, ids, module=layer).layers[0].density == 0.5  # no values: the most it keeps


def test_summary_of_a_stack_of_tables():
  # A stack of 3 tables (nn.scan) was shown as a (8, 6) table of density 16.0 (its kept values' (3, 8, 32) read as one
  # table's); now the stack's (3, 32, 16), each table's density, the whole stack's dense bytes, as NNX.
  class Step(nn.Module):
    @nn.compact
    def __call__(self, carry, _):
      embed = CompressedNMEmbed(32, 16, name="embed")
      return carry + embed.attend(embed(jnp.array([1, 2]))).sum(), None

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, ids):
      scan = nn.scan(Step, variable_axes={"params": 0, "sparsity": 0}, split_rngs={"params": True}, length=3)
      return scan(name="blocks")(jnp.zeros(()), None)[0]

  model, ids = Stack(), jnp.array([1])
  (row,) = jaxsparse.summary(model.init(jax.random.key(0), ids), ids, module=model).layers
  assert (row.path, row.shape, row.density, row.dense_bytes) == ("blocks.embed", (3, 32, 16), 0.5, 3 * 32 * 16 * 4)


def test_sparsify_linen_names_a_subclass_of_nn_embed():
  # A called subclass of nn.Embed was refused as a table "the example input never calls"; now named as what it is.
  class Scaled(nn.Embed):
    def __call__(self, inputs):
      return super().__call__(inputs) * 4.0

  class Net(nn.Module):
    @nn.compact
    def __call__(self, ids):
      return Scaled(VOCAB, D, name="embed")(ids)

  model, ids = Net(), jnp.array([[1, 2]])
  with pytest.raises(ValueError, match=r"embed \(Scaled, a subclass of nn.Embed whose additions a CompressedNMEmbed "
                     r"would drop\): rule 'embed' gives it 2:4, but sparsify does not take this layer"):
    jaxsparse.sparsify_linen(model, model.init(jax.random.key(0), ids), {"embed": jaxsparse.NM(2, 4)}, ids)
