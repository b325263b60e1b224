"""``CompressedNMEmbed`` (NNX and Linen) with partitioned tables on a 4-device mesh, auto and explicit axes.

Each test runs its code in a subprocess with 4 host CPU devices (XLA_FLAGS must precede jax), as
tests/test_multidevice.py does; results are compared with the unsharded layer's (float32, 1e-5).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

PRELUDE = """
import jax, jax.numpy as jnp, numpy as np, flax.linen as nn
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import jaxsparse
from jaxsparse.layers import CompressedNMEmbed
from jaxsparse.layers.linen import CompressedNMEmbed as LinenEmbed
assert jax.device_count() == 4, jax.devices()
V, D = 64, 16
TABLE = jax.random.normal(jax.random.key(0), (V, D))
IDS = jax.random.randint(jax.random.key(1), (4, 8), 0, V).at[0, :2].set(jnp.array([-1, V + 3]))  # negative, too big
Q = jax.random.normal(jax.random.key(2), (4, 8, D))
REF = CompressedNMEmbed.from_dense(nnx.Embed(V, D, embedding_init=lambda *_: TABLE, rngs=nnx.Rngs(0)), 2, 4)

def close(got, want):
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)  # NaN rows equal NaN rows

def spec(a):
  return jax.typeof(a).sharding.spec

def sparsified(names):  # under jax.set_mesh: the table placed on its mesh, as Flax wants it there
  init = nnx.with_partitioning(lambda *_: jax.device_put(TABLE, P()), names)
  embed = nnx.Embed(V, D, embedding_init=init, rngs=nnx.Rngs(0))
  return jaxsparse.sparsify(nnx.Sequential(embed), {"layers.0": jaxsparse.NM(2, 4)})[0]
"""


def _run(code: str) -> None:
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
  script = PRELUDE + textwrap.dedent(code) + "\nprint('done')\n"
  proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("done"), proc.stderr[-4000:]


@pytest.mark.slow  # a 4-device subprocess, as tests/test_multidevice.py's (~10 s on 2 cores)
def test_nnx_sparsify_of_a_feature_split_table_on_an_explicit_mesh():
  # Was: the compression packed groups across the split features, which explicit axes refuse (ShardingTypeError).
  _run("""
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  with jax.set_mesh(mesh):
    sparse = sparsified((None, "model"))
    layer = sparse.layers[0]
    assert layer.embedding.get_metadata()["out_sharding"] == ("model", None)
    assert spec(layer.embedding[...]) == P("model", None)
    ids, q = jax.device_put(IDS, P("data")), jax.device_put(Q, P("data"))
    rows = jax.jit(lambda m, i: m(i))(sparse, ids)
    logits = jax.jit(lambda m, q: m.layers[0].attend(q))(sparse, q)
  np.testing.assert_array_equal(np.asarray(layer.embedding[...]), np.asarray(REF.embedding[...]))
  np.testing.assert_array_equal(np.asarray(layer.embedding_positions[...]), np.asarray(REF.embedding_positions[...]))
  close(rows, REF(IDS))
  close(logits, REF.attend(Q))
  assert spec(rows) == P("data", None, "model") and spec(logits) == P("data", None, None)  # features: as the table
  """)


@pytest.mark.slow  # a 4-device subprocess (~10 s on 2 cores)
def test_lookup_of_a_split_table_with_split_ids_on_an_explicit_mesh():
  # Was: jnp.take from the split table (or by the split ids) could not be typed under explicit axes, NNX and Linen.
  # And attend of a table whose vocabulary is split returned the logits replicated (NNX and Linen), where nnx.Embed's
  # attend of the table split so returns them split over the vocabulary (unless the query uses that axis).
  _run("""
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  linen = LinenEmbed(V, D, embedding_init=lambda *_: TABLE)
  variables = linen.init(jax.random.key(0), IDS)
  grad_q = jax.grad(lambda q: jnp.sum(jnp.sin(REF.attend(q))))(Q)
  with jax.set_mesh(mesh):
    for names in (("model", None), ("data", "model")):
      sparse = sparsified(names)
      ids, q = jax.device_put(IDS, P("data")), jax.device_put(Q, P("data"))
      rows = jax.jit(lambda m, i: m(i))(sparse, ids)
      close(rows, REF(IDS))
      assert spec(rows) == P("data", None, names[1]), spec(rows)  # the features split as the table's
      close(jax.jit(lambda m, i: m(i))(sparse, IDS), REF(IDS))  # replicated ids
      vocab = None if names[0] == "data" else names[0]  # the query's rows hold "data"
      logits = jax.jit(lambda m, q: m.layers[0].attend(q))(sparse, q)
      close(logits, REF.attend(Q))
      assert spec(logits) == P("data", None, vocab), spec(logits)
      close(jax.jit(jax.grad(lambda q: jnp.sum(jnp.sin(sparse.layers[0].attend(q)))))(q), grad_q)
      placed = jax.tree.map(lambda a: jax.device_put(a, P(*names[::-1])), variables)
      rows = jax.jit(linen.apply)(placed, ids)
      close(rows, REF(IDS))
      assert spec(rows) == P("data", None, names[1]), spec(rows)
      logits = jax.jit(lambda v, q: linen.apply(v, q, method="attend"))(placed, q)
      close(logits, REF.attend(Q))
      assert spec(logits) == P("data", None, vocab), spec(logits)
  """)


@pytest.mark.slow  # a 4-device subprocess (~10 s on 2 cores)
def test_lookup_of_a_feature_split_table_is_split_as_nnx_embeds_on_an_explicit_mesh():
  # Was: the sparse lookups (NNX and Linen) returned the features replicated where nnx.Embed's lookup of the same
  # table, its features split over "model", returns them split over "model".
  _run("""
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  linen = LinenEmbed(V, D, embedding_init=lambda *_: TABLE)
  variables = linen.init(jax.random.key(0), IDS)
  with jax.set_mesh(mesh):
    init = nnx.with_partitioning(lambda *_: jax.device_put(TABLE, P()), (None, "model"))
    dense = nnx.Embed(V, D, embedding_init=init, rngs=nnx.Rngs(0))
    want = spec(jax.jit(lambda m, i: m(i))(dense, IDS))
    assert want == P(None, None, "model"), want
    for sparse in (CompressedNMEmbed.from_dense(dense, 2, 4), sparsified((None, "model"))):
      rows = jax.jit(lambda m, i: m(i))(sparse, IDS)
      assert spec(rows) == want, spec(rows)
      close(rows, REF(IDS))
    placed = jax.tree.map(lambda a: jax.device_put(a, P("model", None) if a.shape[0] == D // 2 else P()), variables)
    rows = jax.jit(linen.apply)(placed, IDS)
    assert spec(rows) == want, spec(rows)
    close(rows, REF(IDS))
  """)


@pytest.mark.slow  # a 4-device subprocess (~10 s on 2 cores)
def test_positions_of_a_feature_split_table_are_not_split_by_the_features():
  # Was: the packed positions (features / 8 rows) took the features' name: IndivisibleError in jit's out_shardings
  # from the names on a 4-way split of 16 features (the dense table's split divides).
  _run("""
  mesh = jax.make_mesh((4,), ("model",), axis_types=(AxisType.Auto,))
  rules = [("vocab", None), ("embed", "model")]
  for init, to_mesh in ((nn.with_partitioning(lambda *_: TABLE, (None, "model")), lambda s: s),
                        (nn.with_logical_partitioning(lambda *_: TABLE, ("vocab", "embed")),
                         lambda s: nn.logical_to_mesh(s, rules))):
    linen = LinenEmbed(V, D, embedding_init=init)
    with nn.logical_axis_rules(rules):
      abstract = jax.eval_shape(linen.init, jax.random.key(0), IDS)
    specs = to_mesh(nn.get_partition_spec(abstract))
    assert specs["params"]["embedding"] == P("model", None), specs
    assert specs["sparsity"]["embedding_positions"] == P(None, None), specs
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
    with nn.logical_axis_rules(rules):
      variables = nn.unbox(jax.jit(linen.init, out_shardings=shardings)(jax.random.key(0), IDS))
    assert variables["params"]["embedding"].sharding.spec == P("model", None)
    np.testing.assert_array_equal(np.asarray(variables["params"]["embedding"]), np.asarray(REF.embedding[...]))
    close(jax.jit(linen.apply)(variables, IDS), REF(IDS))
    close(jax.jit(lambda v, q: linen.apply(v, q, method="attend"))(variables, Q), REF.attend(Q))
  with jax.set_mesh(mesh):
    sparse = sparsified((None, "model"))
    assert sparse.layers[0].embedding_positions.get_metadata()["out_sharding"] == (None, None)
    state = jax.jit(lambda s: s, out_shardings=nnx.get_named_sharding(nnx.state(sparse), mesh))(nnx.state(sparse))
  assert state["layers"][0]["embedding"][...].sharding.spec == P("model", None)
  close(jax.jit(lambda s, i: nnx.merge(nnx.graphdef(sparse), s)(i))(state, IDS), REF(IDS))
  """)


@pytest.mark.slow  # a 4-device subprocess (~10 s on 2 cores)
def test_compress_linen_positions_of_a_split_kernel_are_not_split_by_its_rows():
  # Was: CompressedNMDense's kernel_positions (K / 8 rows) took the K name of a 4-way split of K = 16: IndivisibleError.
  _run("""
  mesh = jax.make_mesh((4,), ("model",), axis_types=(AxisType.Auto,))
  x = jax.random.normal(jax.random.key(3), (4, 16))
  model = nn.Dense(8, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None)))
  variables = model.init(jax.random.key(0), x)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, jaxsparse.NM(2, 4), x)
  small, small_vars = jaxsparse.compress_linen(sparse, sparse_vars)
  specs = nn.get_partition_spec(small_vars)
  assert specs["params"]["kernel"] == P("model", None) and specs["sparsity"]["kernel_positions"] == P(None, None)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
  placed = jax.device_put(nn.unbox(small_vars), shardings)
  close(jax.jit(small.apply)(placed, x), sparse.apply(nn.unbox(sparse_vars), x))
  """)
