"""CompressedNMEmbed: lookups, attend, gradients against nnx.Embed of the pruned table; sparsify's embedding rules."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsparse
from jaxsparse.layers import CompressedNMEmbed
from tests._util import assert_close

# (num_embeddings, features, n, m)
SHAPES = [(50, 32, 2, 4), (7, 16, 1, 4), (33, 24, 4, 8), (1, 8, 2, 4)]
# The fast set: every shape but (33, 24, 4, 8) once, float32 and bfloat16 both; the other cases are long, moved out
# of the fast set (make test <= 15 min on 2 cores); CI runs them.
_FAST = {((50, 32, 2, 4), jnp.float32), ((7, 16, 1, 4), jnp.bfloat16), ((1, 8, 2, 4), jnp.float32)}


def _dense(v, d, dtype, seed):
  return nnx.Embed(v, d, param_dtype=dtype, rngs=nnx.Rngs(seed))


def _reference(dense, n, m):
  """``nnx.Embed`` holding the table pruned to n:m along the features by magnitude."""
  table = dense.embedding[...]
  pruned = jnp.where(jaxsparse.nm_mask(table, n, m, axis=1), table, jnp.zeros((), table.dtype))
  return nnx.Embed(*table.shape, dtype=dense.dtype, param_dtype=table.dtype, embedding_init=lambda *_: pruned,
                   rngs=nnx.Rngs(0))


@pytest.mark.parametrize(("shape", "dtype"), [
    c if c in _FAST else pytest.param(*c, marks=pytest.mark.slow)
    for c in itertools.product(SHAPES, [jnp.float32, jnp.bfloat16])
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else None)
def test_lookup_and_attend_equal_the_pruned_dense_embed(shape, dtype):
  v, d, n, m = shape
  seed = int(np.random.default_rng().integers(1 << 30))  # fresh data each run; the seed is in the failure message
  dense = _dense(v, d, dtype, seed)
  sparse, ref = CompressedNMEmbed.from_dense(dense, n, m), _reference(dense, n, m)
  ids = jax.random.randint(jax.random.key(seed), (3, 5), 0, v)
  np.testing.assert_array_equal(np.asarray(sparse(ids), np.float32), np.asarray(ref(ids), np.float32), err_msg=seed)
  assert sparse(ids).dtype == dtype and sparse(ids).shape == (3, 5, d)
  np.testing.assert_array_equal(jax.jit(lambda e, i: e(i))(sparse, ids), sparse(ids))
  np.testing.assert_array_equal(jax.vmap(sparse)(ids), sparse(ids))
  q = jax.random.normal(jax.random.key(seed + 1), (2, 3, d), dtype)
  assert_close(sparse.attend(q), ref.attend(q), dtype)
  assert sparse.attend(q).shape == (2, 3, v)
  np.testing.assert_array_equal(jaxsparse.densify(sparse).embedding[...], ref.embedding[...])
  assert sparse.weight.nbytes < dense.embedding[...].nbytes * (n / m + 0.25)


def test_ids_out_of_range_and_negative_as_nnx_embed():
  dense = _dense(10, 16, jnp.float32, 0)
  sparse, ref = CompressedNMEmbed.from_dense(dense), _reference(dense, 2, 4)
  ids = jnp.array([0, 9, -1, -10, 10, -11, 1000])
  np.testing.assert_array_equal(sparse(ids), ref(ids))  # NaN rows where nnx.Embed has them (equal_nan)
  assert np.isnan(np.asarray(sparse(ids))[4:]).all() and not np.isnan(np.asarray(sparse(ids))[:4]).any()


@pytest.mark.parametrize("dtype, ids", [(jnp.uint8, [0, 255, 3]), (jnp.int8, [-128, 127, -1, 5]),
                                        (jnp.int16, [-301, -300, 299, 300])])
def test_ids_of_narrow_dtypes_as_nnx_embed(dtype, ids):
  """Ids whose dtype cannot hold the vocabulary size (300): the same in-range rule as nnx.Embed's jnp.take."""
  dense = _dense(300, 8, jnp.float32, 0)
  sparse, ref = CompressedNMEmbed.from_dense(dense), _reference(dense, 2, 4)
  np.testing.assert_array_equal(sparse(jnp.array(ids, dtype)), ref(jnp.array(ids, dtype)))


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_gradients_reach_the_kept_values():
  dense = _dense(20, 32, jnp.float32, 3)
  sparse, ref = CompressedNMEmbed.from_dense(dense), _reference(dense, 2, 4)
  ids = jnp.array([[1, 4, 4, 19]])
  q = jax.random.normal(jax.random.key(2), (4, 32))

  def loss(e):
    return jnp.sum(e(ids) ** 2) + jnp.sum(jnp.sin(e.attend(q)))

  g_sparse = nnx.grad(loss)(sparse).embedding[...]
  g_dense = nnx.grad(loss)(ref).embedding[...]
  # The gradient of each kept value (stored transposed, (16, 20)) is the dense gradient at its position.
  positions = sparse.weight.positions().T.reshape(20, 8, 2).astype(jnp.int32)
  picked = jnp.take_along_axis(g_dense.reshape(20, 8, 4), positions, axis=2)
  assert float(jnp.abs(picked).min()) > 0  # every kept value gets a gradient here (ids 1, 4, 19 and attend)
  assert_close(g_sparse, picked.reshape(20, 16).T, jnp.float32)


def test_attend_reads_the_stored_table_without_a_copy():
  """The table is stored as attend's kernel: no transpose (a copy of the whole table in every decode step)."""
  sparse = CompressedNMEmbed.from_dense(_dense(256, 64, jnp.bfloat16, 0))
  jaxpr = jax.make_jaxpr(lambda e, q: e.attend(q))(sparse, jnp.ones((2, 64), jnp.bfloat16))
  transposed = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "transpose" and e.invars[0].aval.size >= 256 * 32]
  assert not transposed, transposed


def test_dtype_and_abstract_init():
  dense = nnx.Embed(12, 8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  sparse = CompressedNMEmbed.from_dense(dense)
  assert sparse.embedding.dtype == jnp.float32 and sparse(jnp.arange(3)).dtype == jnp.bfloat16
  abstract = nnx.eval_shape(lambda: CompressedNMEmbed.from_dense(nnx.Embed(12, 8, rngs=nnx.Rngs(0))))
  assert abstract.embedding.shape == (4, 12) and abstract.embedding_positions.shape == (1, 12)
  graphdef, state = nnx.split(sparse)
  np.testing.assert_array_equal(nnx.merge(graphdef, state)(jnp.arange(3)), sparse(jnp.arange(3)))


def test_from_dense_mask_is_kept_exactly():
  dense = _dense(6, 8, jnp.float32, 1)
  mask = np.zeros((6, 8), bool)
  mask[:, [0, 3, 5, 6]] = True  # 2 of every 4, not the magnitude choice
  sparse = CompressedNMEmbed.from_dense(dense, mask=mask)
  np.testing.assert_array_equal(np.asarray(sparse.weight.mask()).T, mask)
  np.testing.assert_array_equal(sparse(jnp.arange(6)), np.where(mask, dense.embedding[...], 0))


@pytest.mark.parametrize("call, match", [
    (lambda e: CompressedNMEmbed.from_dense(e, 2, 3), r"m=3 must divide the embedding's features=8"),
    (lambda e: CompressedNMEmbed.from_dense(e, mask=np.ones((6, 8), bool)), r"mask keeps 4 of the 4 features"),
    (lambda e: CompressedNMEmbed.from_dense(e, mask=np.ones((6, 4), bool)), r"mask must have the table's shape"),
    (lambda e: CompressedNMEmbed.from_dense(nnx.Linear(8, 8, rngs=nnx.Rngs(0))), r"embed must be a flax.nnx.Embed"),
    (lambda e: CompressedNMEmbed(jaxsparse.NMSparseMatrix.from_dense(jnp.ones((8, 8)), 2, 4, axis=1)), r"axis=0"),
    (lambda e: CompressedNMEmbed.from_dense(e)(jnp.ones(3)), r"inputs must be integer token ids, got dtype float32"),
    (lambda e: CompressedNMEmbed.from_dense(e, implementation="bogus"), r"implementation"),
])
def test_bad_arguments_raise(call, match):
  with pytest.raises((TypeError, ValueError), match=match):
    call(_dense(6, 8, jnp.float32, 0))


class _Net(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(32, 16, rngs=rngs)
    self.fc = nnx.Linear(16, 8, rngs=rngs)

  def __call__(self, ids):
    return self.fc(self.embed(ids))


def test_sparsify_takes_an_embedding_only_by_a_rule_naming_it():
  model = _Net(nnx.Rngs(0))
  sparse, _ = jaxsparse.sparsify(model, jaxsparse.NM(2, 4))  # a catch-all rule: the embedding stays dense
  assert type(sparse.embed) is nnx.Embed and type(sparse.fc).__name__ == "NMLinear"
  sparse, report = jaxsparse.sparsify(model, {"embed": jaxsparse.NM(2, 4)})
  assert type(sparse.embed) is CompressedNMEmbed and type(sparse.fc) is nnx.Linear
  (change,) = report.layers
  assert (change.path, change.layer, change.replaced_by, change.density) == ("embed", "Embed(32x16)",
                                                                              "CompressedNMEmbed", 0.5)
  assert change.bytes_after < 0.6 * change.bytes_before
  ids = jnp.array([[3, 1, 31]])
  np.testing.assert_array_equal(sparse(ids), _Net_with(model, _reference(model.embed, 2, 4))(ids))
  (row,) = jaxsparse.summary(sparse).layers
  assert (row.path, row.pattern, row.forward_flops, row.shape) == ("embed", "2:4 compressed", 0, (32, 16))
  assert "-" in str(jaxsparse.summary(sparse))


def _Net_with(model, embed):
  out = nnx.clone(model)
  out.embed = embed
  return out


def test_sparsify_embedding_masks_and_errors():
  model = _Net(nnx.Rngs(0))
  mask = np.zeros((32, 16), bool)
  mask[:, 1::2] = True
  sparse, _ = jaxsparse.sparsify(model, {"embed": jaxsparse.NM(2, 4)}, masks={"embed.embedding": mask})
  np.testing.assert_array_equal(np.asarray(sparse.embed.weight.mask()).T, mask)
  with pytest.raises(ValueError, match=r"embed: the given mask is not 2:4 along the features \(axis 1\)"):
    jaxsparse.sparsify(model, {"embed": jaxsparse.NM(2, 4)}, masks={"embed.embedding": np.ones((32, 16), bool)})
  with pytest.raises(ValueError, match=r"embed \(nnx.Embed\): rule 'embed' gives it unstructured"):
    jaxsparse.sparsify(model, {"embed": jaxsparse.Unstructured(sparsity=0.5)})
  with pytest.raises(ValueError, match=r"an embedding takes only NM\(n, m\) rules \(not transposable\)"):
    jaxsparse.sparsify(model, {"embed": jaxsparse.NM(2, 4, transposable=True)})
  with pytest.raises(ValueError, match=r"masks has key\(s\) \['embed.embedding'\]"):
    jaxsparse.sparsify(model, {"fc": jaxsparse.NM(2, 4)}, masks={"embed.embedding": mask})


def test_sparsify_report_counts_the_embedding_kept_weights():
  """The report said n/m for an N:M embedding whatever its mask kept (a 1:4 mask under a 2:4 rule, a table of zero
  rows), unlike an N:M linear layer's, counted: now counted; from the mask under nnx.eval_shape."""
  model = _Net(nnx.Rngs(0))
  mask = np.zeros((32, 16), bool)
  mask[:, ::4] = True  # 1 of every 4 features: 1:4 under a 2:4 rule
  masks = {"embed.embedding": mask}
  _, report = jaxsparse.sparsify(model, {"embed": jaxsparse.NM(2, 4)}, masks=masks)
  assert report.layers[0].density == 0.25
  _, report = jaxsparse.sparsify(model, {"embed": jaxsparse.NM(2, 4)})  # by magnitude: 2 of every 4
  assert report.layers[0].density == 0.5
  reports = []

  def make():
    sparse, report = jaxsparse.sparsify(_Net(nnx.Rngs(0)), {"embed": jaxsparse.NM(2, 4)}, masks=masks)
    reports.append(report)
    return sparse

  nnx.eval_shape(make)
  assert reports[0].layers[0].density == 0.25
  empty = _Net(nnx.Rngs(0))
  empty.embed = nnx.Embed(0, 16, embedding_init=nnx.initializers.normal(), rngs=nnx.Rngs(0))
  _, report = jaxsparse.sparsify(empty, {"embed": jaxsparse.NM(2, 4)})
  assert report.layers[0].density == 0.0  # nothing kept


def test_summary_counts_the_embedding_kept_weights_as_the_report():
  """summary said n/m for a CompressedNMEmbed whatever it kept (a 1:4 mask under a 2:4 rule, a zero row), while the
  sparsify report counted (nm_table_density); and it divided by zero for an empty table (num_embeddings or features
  0). Now it counts the nonzero kept values, as the report; an empty table keeps nothing: 0.0, ratios "-"."""
  model = _Net(nnx.Rngs(0))
  model.embed.embedding[...] = model.embed.embedding[...].at[3].set(0.0)  # a padding row: nothing kept
  mask = np.zeros((32, 16), bool)
  mask[:, ::4] = True  # 1 of every 4 features: 1:4 under a 2:4 rule
  mask[5, 4] = False  # a group keeping none
  for masks, kept in ((None, 31 * 8), ({"embed.embedding": mask}, 31 * 4 - 1)):
    sparse, report = jaxsparse.sparsify(model, {"embed": jaxsparse.NM(2, 4)}, masks=masks)
    (row,) = jaxsparse.summary(sparse).layers
    assert row.density == report.layers[0].density == kept / (32 * 16)
  abstract = nnx.eval_shape(lambda: CompressedNMEmbed.from_dense(_dense(32, 16, jnp.float32, 0)))
  assert jaxsparse.summary(abstract).layers[0].density == 0.5  # no values: the most the pattern keeps
  for shape in ((0, 16), (8, 0)):
    empty = nnx.Embed(*shape, embedding_init=nnx.initializers.zeros_init(), rngs=nnx.Rngs(0))
    s = jaxsparse.summary(CompressedNMEmbed.from_dense(empty))
    assert s.layers[0].density == 0.0 and s.layers[0].shape == shape
    assert str(s).splitlines()[1].split()[5:8] == ["0.000", "0", "(-)"]  # density, bytes (vs dense)


@pytest.mark.parametrize("shape", [(0, 16), (8, 0)])
def test_empty_tables_as_nnx_embed(shape):
  """attend of a table of no features (8, 0) raised the N:M op's "the contraction is empty" where nnx.Embed gives zero
  logits; ids looked up in a table of no rows raised jnp.take's IndexError, naming neither. Now as nnx.Embed, and the
  IndexError names the empty table (the Linen twin takes the same tables: test_linen_embed)."""
  dense = nnx.Embed(*shape, embedding_init=nnx.initializers.normal(), rngs=nnx.Rngs(0))
  sparse = CompressedNMEmbed.from_dense(dense)
  query = jnp.ones((2, shape[1]))
  np.testing.assert_array_equal(sparse.attend(query), dense.attend(query))
  np.testing.assert_array_equal(jax.grad(lambda q: sparse.attend(q).sum())(query), jnp.zeros_like(query))
  ids = jnp.array([0, 5])
  if shape[0] == 0:
    with pytest.raises(IndexError, match=r"CompressedNMEmbed has num_embeddings=0: an empty table has no rows"):
      sparse(ids)
  else:
    np.testing.assert_array_equal(sparse(ids), dense(ids))
  assert sparse(ids[:0]).shape == (0, shape[1])


def test_attend_names_a_query_of_another_width():
  # It raised nm_matmul's "x must have shape (..., K) with K = w.shape[0]", naming neither query nor features.
  sparse = CompressedNMEmbed.from_dense(_dense(6, 8, jnp.float32, 0))
  for bad in (jnp.ones((2, 12)), jnp.ones(())):
    with pytest.raises(ValueError, match=r"CompressedNMEmbed has features=8: query must have shape \(\.\.\., 8\), "
                       r"got query.shape=\((2, 12)?\)"):
      sparse.attend(bad)


def test_attend_names_a_complex_query():
  # It raised nm_matmul's "x must have a floating dtype", naming neither query nor what attend takes.
  sparse = CompressedNMEmbed.from_dense(_dense(6, 8, jnp.float32, 0))
  with pytest.raises(TypeError, match=r"CompressedNMEmbed\.attend: query must be real \(a floating, integer or bool "
                     r"array.*got query\.dtype=complex64"):
    sparse.attend(jnp.ones((2, 8), jnp.complex64))
  assert sparse.attend(jnp.ones((2, 8), jnp.int32)).shape == (2, 6)  # real, non-floating queries still work


def test_dtype_none_computes_in_the_table_dtype_as_nnx_embed():
  # Built from an NMSparseMatrix with dtype=None, attend promoted a float32 query over a bfloat16 table to float32,
  # while nnx.Embed (and this layer's own to_dense()) compute in the table's bfloat16: the round trip differed.
  table = jax.random.normal(jax.random.key(0), (16, 10), jnp.float32).astype(jnp.bfloat16)  # (features, vocab)
  sparse = CompressedNMEmbed(jaxsparse.NMSparseMatrix.from_dense(table, 2, 4, axis=0))
  pruned = sparse.weight.to_dense().T
  ref = nnx.Embed(10, 16, param_dtype=jnp.bfloat16, embedding_init=lambda *_: pruned, rngs=nnx.Rngs(0))
  q = jax.random.normal(jax.random.key(1), (3, 16), jnp.float32)
  for out in (sparse.attend(q), sparse.to_dense().attend(q)):
    assert out.dtype == ref.attend(q).dtype == jnp.bfloat16
    assert_close(out, ref.attend(q), jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(sparse.attend(q), np.float32), np.asarray(ref.attend(q), np.float32))
  ids = jnp.array([0, 9, 3])
  assert sparse(ids).dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(sparse(ids), np.float32), np.asarray(ref(ids), np.float32))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8])
def test_integer_table_out_of_range_ids_as_nnx_embed(dtype):
  # An integer table filled only the kept entries of an out-of-range id's row with jnp.take's fill value (the
  # pruned ones were 0); nnx.Embed's whole row is the fill value.
  init = lambda key, shape, dt: (jnp.arange(np.prod(shape)).reshape(shape) % 50 + 1).astype(dt)
  dense = nnx.Embed(6, 8, param_dtype=dtype, embedding_init=init, rngs=nnx.Rngs(0))
  sparse, ref = CompressedNMEmbed.from_dense(dense), _reference(dense, 2, 4)
  ids = jnp.array([[0, 5, -1], [6, -7, 100]])
  np.testing.assert_array_equal(sparse(ids), ref(ids))
  assert sparse(ids).dtype == dtype and (np.asarray(sparse(ids))[1] == np.asarray(ref(ids))[1, 0, 0]).all()


def test_from_dense_mask_positions_are_the_mask_on_a_zero_row():
  # A padding row of zeros: the positions were chosen by magnitude among its zeros (the first n of each group), not
  # the mask's, so fine-tuning trained, and weight.mask() (exported masks) showed, other features than the mask.
  dense = _dense(5, 8, jnp.float32, 1)
  dense.embedding[...] = dense.embedding[...].at[0].set(0.0)
  mask = np.zeros((5, 8), bool)
  mask[:, [2, 3, 5, 7]] = True
  mask[4, 3] = False  # a group keeping fewer than n: its other position holds a zero
  sparse = CompressedNMEmbed.from_dense(dense, mask=mask)
  kept = np.asarray(sparse.weight.mask()).T
  np.testing.assert_array_equal(kept[:4], mask[:4])
  assert (kept[4] >= mask[4]).all() and kept[4].sum() == 4
  expected = np.where(mask, dense.embedding[...], 0)
  np.testing.assert_array_equal(sparse(jnp.arange(5)), expected)
  # One step of fine-tuning moves the padding row at the mask's positions only.
  grads = nnx.grad(lambda e: jnp.sum(e(jnp.array([0, 0, 4]))))(sparse)
  moved = np.asarray(sparse.weight.with_values(grads.embedding[...]).to_dense().T)
  np.testing.assert_array_equal(moved[0] != 0, mask[0])


def test_from_dense_keeps_the_table_partitioning_names_swapped():
  # Was: only jaxsparse.sparsify carried the names; from_dense dropped them (nnx.get_partition_spec gave no split).
  init = nnx.with_partitioning(nnx.initializers.normal(), ("vocab", "embed"))
  mesh = jax.make_mesh((1, 1), ("vocab", "embed"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    dense = nnx.Embed(12, 8, embedding_init=init, rngs=nnx.Rngs(0))
    sparse = CompressedNMEmbed.from_dense(dense, 2, 4)
  assert sparse.embedding.get_metadata()["out_sharding"] == ("embed", "vocab")  # the table is stored transposed
  assert sparse.embedding_positions.get_metadata()["out_sharding"] == (None, "vocab")  # packed rows: replicated
  specs = nnx.get_partition_spec(nnx.state(sparse))
  assert specs["embedding"].get_value() == jax.sharding.PartitionSpec("embed", "vocab")
  ids = jnp.array([0, 5, 11])
  np.testing.assert_array_equal(sparse(ids), _reference(dense, 2, 4)(ids))


def test_summary_of_a_stack_of_tables():
  # A stack of 3 tables (nnx.vmap) was shown as one table's (32, 16) keeping all 3 tables' weights: density 1.5, and
  # the dense bytes of one table. Now the stack's shape, each table's density, the whole stack's dense bytes.
  stack = nnx.vmap(lambda key: CompressedNMEmbed.from_dense(nnx.Embed(32, 16, rngs=nnx.Rngs(key))), in_axes=0,
                   out_axes=0)(jax.random.split(jax.random.key(0), 3))
  (row,) = jaxsparse.summary(stack).layers
  assert (row.shape, row.density, row.dense_bytes) == ((3, 32, 16), 0.5, 3 * 32 * 16 * 4)


class _TiedNet(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(32, 16, rngs=rngs)
    self.fc = nnx.Linear(16, 16, rngs=rngs)
    self.head = self.embed  # tied input and output embeddings

  def __call__(self, ids):
    return self.head.attend(self.fc(self.embed(ids)))


def test_sparsify_matches_every_path_of_a_tied_table():
  # The rules were matched at the table's first path only: {"head": NM(2, 4)} left it dense (warning that "head"
  # matched nothing) while pruning.magnitude_masks pruned it under the same rules, and rules giving its two paths
  # different structures took the first silently. Now as for a tied linear layer.
  model = _TiedNet(nnx.Rngs(0))
  masks = jaxsparse.pruning.magnitude_masks(model, {"head": jaxsparse.NM(2, 4)})
  sparse, report = jaxsparse.sparsify(model, {"head": jaxsparse.NM(2, 4)}, masks=masks)
  assert type(sparse.embed) is CompressedNMEmbed and sparse.head is sparse.embed
  (change,) = report.layers
  assert (change.path, change.density, change.note) == ("embed", 0.5, "tied: also at head")
  ids = jnp.array([[3, 1, 31]])
  ref = nnx.clone(model)  # tied: the table pruned in place
  ref.embed.embedding[...] = _reference(model.embed, 2, 4).embedding[...]
  np.testing.assert_array_equal(sparse(ids), ref(ids))
  with pytest.raises(ValueError, match=r"embed: one embedding held at several paths \(tied\) gets different "
                     r"structures from the rules: embed: 2:4, head: 1:4"):
    jaxsparse.sparsify(model, {"embed": jaxsparse.NM(2, 4), "head": jaxsparse.NM(1, 4)})


class _ScaledEmbed(nnx.Embed):
  def __call__(self, inputs):
    return super().__call__(inputs) * 4.0


def test_sparsify_refuses_a_table_it_cannot_rebuild():
  # A subclass of nnx.Embed became a plain CompressedNMEmbed, dropping its scale: lookups 4x off, silently. A stacked
  # (nnx.vmap) table raised compress_table's "table must be 2-D", without the way out.
  model = nnx.Sequential(_ScaledEmbed(32, 16, rngs=nnx.Rngs(0)))
  with pytest.raises(TypeError, match=r"layers.0: _ScaledEmbed is a subclass of nnx.Embed; sparsify stores its table "
                     r"as a CompressedNMEmbed and would drop what the subclass adds.*Map this path to None"):
    jaxsparse.sparsify(model, {"layers.0": jaxsparse.NM(2, 4)})
  stack = nnx.vmap(lambda key: nnx.Embed(32, 16, rngs=nnx.Rngs(key)), in_axes=0, out_axes=0)(
      jax.random.split(jax.random.key(0), 3))
  with pytest.raises(ValueError, match=r"layers.0: its table has shape \(3, 32, 16\), not the \(32, 16\) of its "
                     r"num_embeddings and features: a stacked .* map this path to None"):
    jaxsparse.sparsify(nnx.Sequential(stack), {"layers.0": jaxsparse.NM(2, 4)})
