"""Flax on 4 devices: sharding annotations survive sparsify; a sparsified model trains data-parallel."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsparse
from tests._util import assert_close
from tests.multidevice import _hlo

D, H = 64, 128
RULES = {"up": jaxsparse.BlockSparse(density=0.5, block_shape=(16, 16)), "mid": jaxsparse.NM(2, 4),
         "down": jaxsparse.Unstructured(sparsity=0.75)}


def _mesh():
  return jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


class MLP(nnx.Module):
  def __init__(self, rngs, kernel_names=None):
    part = (lambda init, names: nnx.with_partitioning(init, names)) if kernel_names else (lambda init, _: init)
    k_init, b_init = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
    names = kernel_names or {}
    self.up = nnx.Linear(D, H, kernel_init=part(k_init, names.get("up")), bias_init=part(b_init, ("model",)),
                         rngs=rngs)
    self.mid = nnx.Linear(H, H, kernel_init=part(k_init, names.get("mid")), rngs=rngs)
    self.down = nnx.Linear(H, D, kernel_init=part(k_init, names.get("down")), rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.relu(self.mid(jax.nn.relu(self.up(x)))))


def test_nnx_partitioning_survives_sparsify():
  mesh = _mesh()
  names = {"up": (None, "model"), "mid": (None, "model"), "down": ("model", None)}
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(0), names)
  sparse, _ = jaxsparse.sparsify(model, RULES)
  specs = jax.tree.map(lambda v: v.get_value(), nnx.get_partition_spec(nnx.state(sparse)),
                       is_leaf=lambda v: isinstance(v, nnx.Variable))
  assert specs["up"]["kernel"] == P(None, None, None)  # block-sparse values: replicated
  assert specs["up"]["bias"] == P("model")
  assert specs["up"]["pattern"]["row_indices"] == P(None)
  assert specs["mid"]["kernel"] == P(None, "model")
  assert specs["down"]["kernel"] == P("model", None)
  assert specs["down"]["mask"] == P("model", None)
  # The arrays are placed like the dense ones were.
  placed = lambda a, spec: a.sharding.is_equivalent_to(NamedSharding(mesh, spec), a.ndim)
  assert placed(sparse.mid.kernel[...], P(None, "model"))
  assert placed(sparse.down.mask[...], P("model", None))
  assert placed(sparse.up.bias[...], P("model"))
  assert placed(sparse.up.kernel[...], P())

  shardings = nnx.get_named_sharding(nnx.state(sparse), mesh)
  state = jax.jit(lambda s: s, out_shardings=shardings)(nnx.state(sparse))
  assert state["down"]["kernel"][...].sharding.is_equivalent_to(NamedSharding(mesh, P("model", None)), 2)
  x = jax.random.normal(jax.random.key(1), (8, D))
  dense_sparse = jaxsparse.densify(sparse)
  assert_close(jax.jit(lambda m, x: m(x))(sparse, x), dense_sparse(x), jnp.float32)


def test_nnx_densify_gives_back_partitioning_and_placement():
  # densify of a sparsified (and compressed) model: the dense kernels and biases take their names back (they came
  # back unnamed, P()) and are split over the mesh as the dense model's were; block-sparse values, replicated in the
  # sparse model, come back split too.
  mesh = _mesh()
  names = {"up": (None, "model"), "mid": ("model", None), "down": ("model", None)}
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(0), names)
  sparse, _ = jaxsparse.sparsify(model, RULES)
  sparse.mid = jaxsparse.compress(nnx.Sequential(sparse.mid)).layers[0]  # a CompressedNMLinear
  dense = jaxsparse.densify(sparse)
  want = {"up": {"kernel": (None, "model"), "bias": ("model",)}, "mid": {"kernel": ("model", None), "bias": ()},
          "down": {"kernel": ("model", None), "bias": ()}}
  got = jax.tree.map(lambda v: tuple(v.get_value()), nnx.get_partition_spec(nnx.state(dense)),
                     is_leaf=lambda v: isinstance(v, nnx.Variable))
  assert nnx.to_pure_dict(got) == want
  for layer in ("up", "mid", "down"):
    for var in ("kernel", "bias"):
      value = getattr(getattr(dense, layer), var)[...]
      assert value.sharding.is_equivalent_to(NamedSharding(mesh, P(*want[layer][var])), value.ndim), (layer, var)
  x = jax.random.normal(jax.random.key(1), (8, D))
  assert_close(jax.jit(lambda m, x: m(x))(dense, x), sparse(x), jnp.float32)


_FROM_DENSE = {
    "MaskedLinear": lambda d: jaxsparse.layers.MaskedLinear.from_dense(d, sparsity=0.75),
    "NMLinear": lambda d: jaxsparse.layers.NMLinear.from_dense(d, n=2, m=4),
    "CompressedNMLinear": lambda d: jaxsparse.layers.NMLinear.from_dense(d, n=2, m=4).to_compressed(),
    "BlockSparseLinear": lambda d: jaxsparse.layers.BlockSparseLinear.from_dense(d, density=0.5, block_shape=(16, 16)),
    "MaskedConv": lambda d: jaxsparse.layers.MaskedConv.from_dense(d, sparsity=0.75),
    "NMConv": lambda d: jaxsparse.layers.NMConv.from_dense(d, n=2, m=4),
}


@pytest.mark.parametrize("kind", list(_FROM_DENSE))
def test_nnx_from_dense_round_trip_keeps_partitioning_and_placement(kind):
  # Layer.from_dense (and NMLinear.to_compressed) of a dense layer whose weights are named and split over the mesh:
  # the sparse layer took neither the names nor the placement (only sparsify carried them), so its to_dense() came
  # back unnamed and unsplit. The round trip now gives the dense layer's names and placement back.
  mesh = _mesh()
  named = lambda *names: nnx.with_partitioning(nnx.initializers.normal(), names)
  conv = kind.endswith("Conv")
  with jax.set_mesh(mesh):
    if conv:
      dense = nnx.Conv(8, 16, (3, 3), kernel_init=named(None, None, "data", "model"), bias_init=named("model"),
                       rngs=nnx.Rngs(0))
    else:
      dense = nnx.Linear(D, H, kernel_init=named("data", "model"), bias_init=named("model"), rngs=nnx.Rngs(0))
  sparse = _FROM_DENSE[kind](dense)
  if kind not in ("BlockSparseLinear", "CompressedNMLinear"):  # the kernel of the dense kernel's shape: split alike
    assert sparse.kernel[...].sharding.is_equivalent_to(dense.kernel[...].sharding, dense.kernel.ndim)
  back = sparse.to_dense()
  for var in ("kernel", "bias"):
    want, got = getattr(dense, var), getattr(back, var)
    assert got.get_metadata().get("out_sharding") == want.get_metadata()["out_sharding"], var
    assert got[...].sharding.is_equivalent_to(want[...].sharding, want.ndim), (var, got[...].sharding)
  assert not want[...].sharding.is_fully_replicated  # the check above tells split from replicated
  x = jax.random.normal(jax.random.key(1), (4, 5, 5, 8) if conv else (4, D))
  assert_close(back(x), sparse(x), jnp.float32)


def test_nnx_embedding_partitioning_survives_sparsify():
  mesh = _mesh()
  with jax.set_mesh(mesh):
    embed = nnx.Embed(64, D, embedding_init=nnx.with_partitioning(nnx.initializers.normal(), ("model", None)),
                      rngs=nnx.Rngs(0))
  sparse, _ = jaxsparse.sparsify(nnx.Sequential(embed), {"layers.0": jaxsparse.NM(2, 4)})
  layer = sparse.layers[0]
  assert type(layer).__name__ == "CompressedNMEmbed"
  for var in (layer.embedding, layer.embedding_positions):  # the vocabulary split like the dense table's (transposed)
    assert var.get_metadata()["out_sharding"] == (None, "model")
    assert var[...].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)
  ids = jax.random.randint(jax.random.key(1), (4, 8), 0, 64)
  ids = jax.device_put(ids, NamedSharding(mesh, P("data")))
  assert_close(jax.jit(lambda m, i: m(i))(sparse, ids), jaxsparse.densify(sparse)(ids), jnp.float32)


def test_nnx_sparsified_model_trains_data_parallel():
  mesh = _mesh()
  model, _ = jaxsparse.sparsify(MLP(nnx.Rngs(0)), RULES)
  x = jax.random.normal(jax.random.key(1), (16, 8, D))
  target = jax.random.normal(jax.random.key(2), (16, 8, D))

  def loss_fn(m, x, t):
    return jnp.mean((m(x) - t) ** 2)

  def step(m, x, t):
    return nnx.value_and_grad(loss_fn)(m, x, t)

  loss_ref, grads_ref = nnx.jit(step)(model, x, target)
  xs = jax.device_put(x, NamedSharding(mesh, P("data")))
  ts = jax.device_put(target, NamedSharding(mesh, P("data")))
  loss, grads = nnx.jit(step)(model, xs, ts)
  assert_close(loss, loss_ref, jnp.float32)
  for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True):
    assert_close(g, g_ref, jnp.float32)

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  pure = lambda p, x, t: jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), x, t))(p)
  _hlo.assert_no_gather(_hlo.compiled_text(pure, params, xs, ts), "sparsified MLP train step")

  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  nnx.jit(lambda m, o, x, t: o.update(m, step(m, x, t)[1]))(model, optimizer, xs, ts)


def test_linen_partitioning_survives_sparsify_linen():
  class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      k = nn.initializers.lecun_normal()
      h = nn.relu(nn.Dense(H, kernel_init=nn.with_partitioning(k, (None, "model")), name="up")(x))
      h = nn.relu(nn.Dense(H, kernel_init=nn.with_partitioning(k, (None, "model")), name="mid")(h))
      return nn.Dense(D, kernel_init=nn.with_partitioning(k, ("model", None)), name="down")(h)

  model, x = LinenMLP(), jnp.ones((4, D))
  variables = model.init(jax.random.key(0), x)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, RULES, x)
  specs = nn.get_partition_spec(sparse_vars)
  assert specs["params"]["up"]["kernel"] == P(None, None, None)
  assert specs["params"]["mid"]["kernel"] == P(None, "model")
  assert specs["params"]["down"]["kernel"] == P("model", None)
  assert specs["sparsity"]["down"]["mask"] == P("model", None)
  mesh = _mesh()
  placed = jax.device_put(nn.meta.unbox(sparse_vars), nn.get_sharding(sparse_vars, mesh))
  y = jax.jit(sparse.apply)(placed, x)
  np.testing.assert_allclose(y, sparse.apply(nn.meta.unbox(sparse_vars), x), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(y, sparse.apply(sparse_vars, x), rtol=1e-5, atol=1e-5)


def test_linen_logical_partitioning_survives_sparsify_linen():
  # nn.with_logical_partitioning boxes stay logical (nn.LogicallyPartitioned, rules kept): applying the sparse
  # variables under a mesh and logical axis rules constrains them to the rules' mesh axes, as the dense ones.
  rules = (("embed", None), ("mlp", "model"))

  class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      k = nn.initializers.lecun_normal()
      h = nn.relu(nn.Dense(H, kernel_init=nn.with_logical_partitioning(k, ("embed", "mlp")), name="up")(x))
      h = nn.relu(nn.Dense(H, kernel_init=nn.with_logical_partitioning(k, ("embed", "mlp")), name="mid")(h))
      return nn.Dense(D, kernel_init=nn.with_logical_partitioning(k, ("mlp", "embed")), name="down")(h)

  model, x = LinenMLP(), jax.random.normal(jax.random.key(1), (4, D))
  variables = model.init(jax.random.key(0), x)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, RULES, x)
  boxes = [b for b in jax.tree.leaves(sparse_vars, is_leaf=lambda b: isinstance(b, nn.Partitioned))
           if isinstance(b, nn.Partitioned)]
  assert len(boxes) == 9 and all(isinstance(b, nn.LogicallyPartitioned) for b in boxes)  # kernels, patterns, mask
  assert sparse_vars["params"]["down"]["kernel"].names == ("mlp", "embed")
  assert sparse_vars["sparsity"]["down"]["mask"].rules is None  # as the dense box: rules from the context
  mesh = _mesh()
  dense_model, dense_vars = jaxsparse.densify_linen(sparse, nn.meta.unbox(sparse_vars))
  want = dense_model.apply(dense_vars, x)  # the pruned dense model, a plain-Linen reference
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    y = jax.jit(sparse.apply)(sparse_vars, x)
    specs = nn.logical_to_mesh(nn.get_partition_spec(sparse_vars))
  assert specs["params"]["mid"]["kernel"] == P(None, "model")
  assert specs["sparsity"]["down"]["mask"] == P("model", None)
  assert_close(y, want, jnp.float32)


def test_nnx_sparsify_on_an_explicit_mesh():
  # Kernels split over explicit axes: the masks are computed on the whole weights (a sort or a reshape over a split
  # dim is refused there), the sparse model is the one sparsify builds without a mesh, and the names are carried.
  rules = {"up": jaxsparse.BlockSparse(density=0.5, block_shape=(16, 16)), "mid": jaxsparse.NM(2, 4),
           "down": jaxsparse.Unstructured(sparsity=0.75)}
  names = {"up": (None, "model"), "mid": ("model", "data"), "down": ("model", "data")}
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  want, _ = jaxsparse.sparsify(MLP(nnx.Rngs(0)), rules)
  with jax.set_mesh(mesh):
    sparse, _ = jaxsparse.sparsify(MLP(nnx.Rngs(0), names), rules)
    w = sparse.down.kernel[...]
    block_mask = jaxsparse.block_magnitude_mask(w, (16, 16), 0.5)
    x = jax.random.normal(jax.random.key(1), (8, D))
    xs = jax.device_put(x, P("data"))
    y = jax.jit(lambda m, x: m(x))(sparse, xs)
  np.testing.assert_array_equal(block_mask, jaxsparse.block_magnitude_mask(np.asarray(w), (16, 16), 0.5))
  got, ref = nnx.to_pure_dict(nnx.state(sparse)), nnx.to_pure_dict(nnx.state(want))
  assert jax.tree.structure(got) == jax.tree.structure(ref)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
    np.testing.assert_array_equal(a, b)
  for var in (sparse.down.kernel, sparse.down.mask):
    assert var.get_metadata()["out_sharding"] == ("model", "data")
    assert jax.typeof(var[...]).sharding.spec == P("model", "data")
  assert sparse.mid.kernel.get_metadata()["out_sharding"] == ("model", "data")
  assert_close(y, jaxsparse.densify(want)(x), jnp.float32)  # the dense model with the pruned weights


@pytest.mark.parametrize("rule", [jaxsparse.BlockSparse(density=0.5, block_shape=(16, 16)), jaxsparse.NM(2, 4),
                                  jaxsparse.Unstructured(sparsity=0.5)], ids=["block", "nm", "unstructured"])
def test_nnx_sparsify_a_split_bias_on_an_explicit_mesh(rule):
  # A bias split over explicit mesh axes (named with nnx.with_partitioning): every sparse layer but a block-sparse
  # one built by from_dense copied it into its own unsplit bias, which explicit axes refuse ("Incompatible types for
  # broadcasting"), in sparsify (with masks too) and in to_dense(). It is gathered for the copy and split again.
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  normal = nnx.initializers.normal()

  def dense_of(name, named):  # named=False: the same layer without names, off the mesh
    part = (lambda *names: nnx.with_partitioning(normal, names)) if named else (lambda *_: normal)
    if name == "conv":
      return nnx.Conv(8, 16, (3, 3), kernel_init=part(None, None, None, "model"), bias_init=part("model"),
                      rngs=nnx.Rngs(0))
    return nnx.Linear(D, H, kernel_init=part("data", "model"), bias_init=part("model"), rngs=nnx.Rngs(0))

  for name in ("fc",) if isinstance(rule, jaxsparse.BlockSparse) else ("fc", "conv"):
    want, _ = jaxsparse.sparsify(dense_of(name, named=False), rule)
    masks = {"kernel": np.asarray(jaxsparse.densify(want).kernel[...] != 0)}
    for given in (None, masks):
      with jax.set_mesh(mesh):
        sparse, _ = jaxsparse.sparsify(dense_of(name, named=True), rule, masks=given)
        back = sparse.to_dense()
      for layer in (sparse, back):
        assert layer.bias.get_metadata()["out_sharding"] == ("model",), (name, type(layer).__name__)
        assert jax.typeof(layer.bias[...]).sharding.spec == P("model"), (name, type(layer).__name__)
      for var in ("kernel", "bias"):  # the weights of the layer built off the mesh
        np.testing.assert_array_equal(getattr(back, var)[...], getattr(want.to_dense(), var)[...])
      if name == "fc":  # (a conv of a split kernel wants an out_sharding under explicit axes, nnx.Conv's too)
        x = jax.random.normal(jax.random.key(1), (4, D))
        assert_close(back(x), want(x), jnp.float32)


@pytest.mark.parametrize("rule", [jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8)), jaxsparse.NM(2, 4),
                                  jaxsparse.Unstructured(sparsity=0.5)], ids=["block", "nm", "unstructured"])
def test_nnx_sparsify_a_linear_general_split_over_explicit_axes(rule):
  # An nnx.LinearGeneral (2, 8) -> (4, 8) whose kernel and multi-dim bias are split over explicit mesh axes: sparsify
  # folded them to (K, N) / (N,) split, which explicit axes refuse ("This reshape is not supported"), with masks too;
  # SparseLinearGeneral.to_dense (densify) unfolded its split (K, N) kernel the same way. They are gathered to be
  # folded and unfolded, and split again by the names: the bias's (4, 8) split along heads or along head_dim.
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  normal = nnx.initializers.normal()
  x = jax.random.normal(jax.random.key(1), (4, 2, 8))

  def dense_of(kernel_names, bias_names):  # None: the same layer without names, off the mesh
    part = (lambda names: nnx.with_partitioning(normal, names)) if kernel_names else (lambda _: normal)
    return nnx.LinearGeneral((2, 8), (4, 8), axis=(-2, -1), kernel_init=part(kernel_names),
                             bias_init=part(bias_names), rngs=nnx.Rngs(0))

  want, _ = jaxsparse.sparsify(dense_of(None, None), rule)
  want_dense = jaxsparse.densify(want)
  masks = {"kernel": np.asarray(want_dense.kernel[...] != 0)}
  # (kernel names, bias names, the folded (N,) bias's split): a split along heads folds to the (N,) bias's, one along
  # head_dim cannot (the folded bias is whole; densify gives the recorded names back).
  layouts = [((None, None, "model", None), ("model", None), P("model")),
             ((None, None, None, "model"), (None, "model"), P(None))]
  for kernel_names, bias_names, folded in layouts:
    for given in (None, masks):
      with jax.set_mesh(mesh):
        sparse, _ = jaxsparse.sparsify(dense_of(kernel_names, bias_names), rule, masks=given)
        assert jax.typeof(sparse.layer.bias[...]).sharding.spec == folded
        back = jaxsparse.densify(sparse)
        assert back.bias.get_metadata()["out_sharding"] == bias_names
        assert back.kernel.get_metadata()["out_sharding"] == kernel_names
        assert jax.typeof(back.bias[...]).sharding.spec == P(*bias_names)
        layers = [sparse, back] + ([jaxsparse.compress(sparse)] if isinstance(rule, jaxsparse.NM) else [])
        ys = [jax.jit(lambda m, x: m(x))(layer, jax.device_put(x, P("data"))) for layer in layers]
      for var in ("kernel", "bias"):  # the weights of the layer built off the mesh
        np.testing.assert_array_equal(getattr(back, var)[...], getattr(want_dense, var)[...])
      for y in ys:
        assert_close(y, want(x), jnp.float32)


def test_nnx_compress_on_an_explicit_mesh():
  # An N:M kernel split along its grouped (input) dim over explicit axes: compress packed the split groups and failed
  # (NMSparseMatrix.from_dense); it gathers that dim, and the compressed model is the one compress builds unsplit.
  names = {"up": (None, "model"), "mid": ("data", "model"), "down": ("model", None)}
  rules = {"mid": jaxsparse.NM(2, 4)}
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  want = jaxsparse.compress(jaxsparse.sparsify(MLP(nnx.Rngs(0)), rules)[0])
  x = jax.random.normal(jax.random.key(1), (8, D))
  with jax.set_mesh(mesh):
    sparse, _ = jaxsparse.sparsify(MLP(nnx.Rngs(0), names), rules)
    got = jaxsparse.compress(sparse)
    y = jax.jit(lambda m, x: m(x))(got, jax.device_put(x, P("data")))
    assert jax.typeof(got.mid.kernel[...]).sharding.spec == P("data", "model")
    assert jax.typeof(got.mid.kernel_positions[...]).sharding.spec == P(None, "model")
  for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(nnx.state(got))), jax.tree.leaves(nnx.to_pure_dict(nnx.state(want))),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  assert_close(y, want(x), jnp.float32)


def test_wrap_optax_on_params_split_over_explicit_axes():
  # Weights split over explicit axes: the pruners flatten and rank whole weights (JAX refuses that on split dims, so
  # init failed); the masks are computed on the gathered weights and come back split like them, the updates equal
  # one device's.
  keys = jax.random.split(jax.random.key(0), 4)
  params = {"a": jax.random.normal(keys[0], (D, H)), "b": jax.random.normal(keys[1], (H, D))}
  grads = {"a": jax.random.normal(keys[2], (D, H)), "b": jax.random.normal(keys[3], (H, D))}
  specs = {"a": P(None, "model"), "b": P("model", "data")}
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  pruners = [jaxsparse.pruning.magnitude_pruner(jaxsparse.Unstructured(sparsity=0.75)),
             jaxsparse.pruning.magnitude_pruner(jaxsparse.NM(2, 4), scope="global"),
             jaxsparse.pruning.rigl_pruner(jaxsparse.BlockSparse(density=0.5, block_shape=(16, 16)), update_every=1,
                                           end_step=10)]
  for pruner in pruners:
    tx = jaxsparse.pruning.wrap_optax(optax.adam(1e-2), pruner)
    state = tx.init(params)
    want, state = jax.jit(tx.update)(grads, state, params)
    with jax.set_mesh(mesh):
      ps, gs = (jax.tree.map(jax.device_put, t, specs) for t in (params, grads))
      got_state = tx.init(ps)
      got, got_state = jax.jit(tx.update)(gs, got_state, ps)
      for name, spec in specs.items():
        assert jax.typeof(got_state.masks[name]).sharding.spec == spec
        assert jax.typeof(got[name]).sharding.spec == spec
    for name in specs:
      np.testing.assert_array_equal(got_state.masks[name], state.masks[name])
      assert_close(got[name], want[name], jnp.float32)


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_magnitude_masks_of_params_split_over_explicit_axes(scope):
  # pruning.magnitude_masks ranks whole weights (JAX refuses to reshape or sort a split dim: it raised): the masks are
  # one device's, split like their weights.
  keys = jax.random.split(jax.random.key(1), 2)
  params = {"a": jax.random.normal(keys[0], (D, H)), "b": jax.random.normal(keys[1], (H, D))}
  specs = {"a": P(None, "model"), "b": P("model", "data")}
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  rules = [jaxsparse.Unstructured(sparsity=0.75), jaxsparse.NM(2, 4),
           jaxsparse.BlockSparse(density=0.5, block_shape=(16, 16))]
  for rule in rules:
    want = jaxsparse.pruning.magnitude_masks(params, rule, scope=scope)
    with jax.set_mesh(mesh):
      split = jax.tree.map(jax.device_put, params, specs)
      got = jaxsparse.pruning.magnitude_masks(split, rule, scope=scope)
      for name, spec in specs.items():
        assert jax.typeof(got[name]).sharding.spec == spec, (rule, name)
    for name in specs:
      np.testing.assert_array_equal(got[name], want[name])
