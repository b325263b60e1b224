"""Data parallel on 4 devices: every op and its gradients, x's leading dims sharded.

Each case is checked against the same op on one device: equal results and gradients, the output
keeps the batch sharding, dX is sharded like x, and the compiled program moves no activations
(no all-gather, all-to-all or collective-permute) and reduces the weight gradient across devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsparse
from jaxsparse import ops
from tests._util import assert_close
from tests.multidevice import _hlo

K, N = 128, 96
KEYS = jax.random.split(jax.random.key(0), 4)
W = jax.random.normal(KEYS[0], (K, N))
MASK = jaxsparse.magnitude_mask(W, sparsity=0.9)
BLOCK_MASK = jaxsparse.random_block_mask(KEYS[1], (K, N), (16, 16), 0.3)
BSM = jaxsparse.BlockSparseMatrix.from_dense(W, (16, 16), block_mask=BLOCK_MASK)
CSR = jaxsparse.CSRMatrix.from_dense(W, mask=MASK)
NMW = jaxsparse.NMSparseMatrix.from_dense(W, 2, 4)

# name -> (f(x, trainable) -> y, trainable weights, name(s) of the custom call that must see local rows)
CASES = {
    "block_sparse_xla": (
        lambda x, d: ops.block_sparse_matmul(x, BSM.with_data(d), implementation="xla"), BSM.data, None
    ),
    "block_sparse_auto": (
        lambda x, d: ops.block_sparse_matmul(x, BSM.with_data(d)), BSM.data, "jaxsparse_block_forward"
    ),
    "sparse_cpu": (
        # At most 8 local rows the forward streams the entries in row order (a decode step's kernel).
        lambda x, d: ops.sparse_matmul(x, CSR.with_data(d), implementation="cpu"), CSR.data,
        ("jaxsparse_csr_forward", "jaxsparse_csr_few_rows_forward"),
    ),
    "sparse_xla": (lambda x, d: ops.sparse_matmul(x, CSR.with_data(d), implementation="xla"), CSR.data, None),
    "masked_cpu": (lambda x, w: ops.masked_matmul(x, w, MASK, implementation="cpu"), W, "jaxsparse_masked_forward"),
    "masked_auto_dense": (lambda x, w: ops.masked_matmul(x, w, jnp.ones_like(MASK)), W, None),
    "masked_xla": (lambda x, w: ops.masked_matmul(x, w, MASK, implementation="xla"), W, None),
    "nm": (lambda x, v: ops.nm_matmul(x, NMW.with_values(v)), NMW.values, None),
    "sr_ste": (lambda x, w: x @ ops.sr_ste(w, 2, 4, decay=0.1), W, None),
}


def _mesh(shape=(4,), names=("data",), axis_type=AxisType.Auto):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def _loss(f):
  return lambda x, t: jnp.sum(jnp.sin(f(x, t)))


def _single_device(f, x, t):
  dev = jax.devices()[0]
  x, t = jax.device_put((x, t), dev)
  return jax.jit(f)(x, t), jax.jit(jax.grad(_loss(f), argnums=(0, 1)))(x, t)


def _check_case(name, x, spec, mesh):
  f, t, ffi_target = CASES[name]
  y_ref, (dx_ref, dt_ref) = _single_device(f, x, t)
  sharding = NamedSharding(mesh, spec)
  xs = jax.device_put(x, sharding)

  y = jax.jit(f)(xs, t)
  assert_close(y, y_ref, jnp.float32)
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec[:-1], None)), y.ndim), y.sharding

  grad = jax.grad(_loss(f), argnums=(0, 1))
  dx, dt = jax.jit(grad)(xs, t)
  assert_close(dx, dx_ref, jnp.float32)
  assert_close(dt, dt_ref, jnp.float32)
  assert dx.sharding.is_equivalent_to(sharding, dx.ndim), dx.sharding

  fwd_hlo = _hlo.compiled_text(f, xs, t)
  _hlo.assert_no_gather(fwd_hlo, f"{name} forward")
  grad_hlo = _hlo.compiled_text(grad, xs, t)
  _hlo.assert_no_gather(grad_hlo, f"{name} gradient")
  assert _hlo.count(grad_hlo, "all-reduce") >= 1, f"{name}: the weight gradient is not reduced across devices"
  if ffi_target is not None:
    # The C++ kernel runs on this device's rows only.
    local_rows = int(np.prod(sharding.shard_shape(x.shape)[:-1]))
    targets = (ffi_target,) if isinstance(ffi_target, str) else ffi_target
    calls = [line for line in fwd_hlo.splitlines() if any(f'custom_call_target="{t}"' in line for t in targets)]
    assert calls and all(f"f32[{local_rows},{N}]" in c for c in calls), calls


@pytest.mark.parametrize("name", sorted(CASES))
def test_batch_sharded(name):
  x = jax.random.normal(KEYS[2], (16, 4, K))
  _check_case(name, x, P("data", None, None), _mesh())


@pytest.mark.parametrize("name", ["block_sparse_auto", "sparse_cpu", "masked_cpu", "nm"])
def test_batch_and_sequence_sharded(name):
  x = jax.random.normal(KEYS[2], (4, 8, K))
  _check_case(name, x, P("data", "seq", None), _mesh((2, 2), ("data", "seq")))


def test_two_dim_x_and_a_model_axis_left_alone():
  x = jax.random.normal(KEYS[2], (32, K))
  _check_case("block_sparse_auto", x, P("data", None), _mesh((2, 2), ("data", "model")))


def test_explicit_axes():
  f, t, _ = CASES["block_sparse_auto"]
  x = jax.random.normal(KEYS[2], (16, K))
  y_ref, (_, dt_ref) = _single_device(f, x, t)
  mesh = _mesh(axis_type=AxisType.Explicit)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, P("data"))
    y = jax.jit(f)(xs, t)
    assert jax.typeof(y).sharding.spec == P("data", None)
    grad = jax.grad(_loss(f), argnums=1)
    dt = jax.jit(grad)(xs, t)
    _hlo.assert_no_gather(_hlo.compiled_text(grad, xs, t), "explicit-axes gradient")
  assert_close(y, y_ref, jnp.float32)
  assert_close(dt, dt_ref, jnp.float32)


def test_default_mesh_without_a_mesh_context():
  # jax.make_mesh's default axis types are explicit; no jax.set_mesh around the call.
  f, t, _ = CASES["masked_cpu"]
  x = jax.random.normal(KEYS[2], (16, K))
  y_ref, (_, dt_ref) = _single_device(f, x, t)
  mesh = jax.make_mesh((4,), ("data",))
  xs = jax.device_put(x, NamedSharding(mesh, P("data")))
  t_rep = jax.device_put(t, NamedSharding(mesh, P()))
  grad = jax.grad(_loss(f), argnums=1)
  assert_close(jax.jit(f)(xs, t_rep), y_ref, jnp.float32)
  assert_close(jax.jit(grad)(xs, t_rep), dt_ref, jnp.float32)
  _hlo.assert_no_gather(_hlo.compiled_text(grad, xs, t_rep), "default-mesh gradient")


def test_rows_that_do_not_divide_run_replicated():
  f, t, _ = CASES["block_sparse_auto"]
  x = jax.random.normal(KEYS[2], (8, K))
  mesh = _mesh()
  # 6 rows over 4 devices inside jit: gathered rather than padded, still correct.
  g = lambda x, t: f(jax.lax.with_sharding_constraint(x[:6], NamedSharding(mesh, P("data"))), t)
  y_ref, (_, dt_ref) = _single_device(f, x[:6], t)
  xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
  dt = jax.jit(jax.grad(_loss(g), argnums=1))(xs, t)
  assert_close(jax.jit(g)(xs, t), y_ref, jnp.float32)
  assert_close(dt, dt_ref, jnp.float32)


def test_vmap_over_sharded_x_and_per_example_gradients():
  f, t, _ = CASES["block_sparse_auto"]
  x = jax.random.normal(KEYS[2], (4, 8, K))
  xs = jax.device_put(x, NamedSharding(_mesh(), P(None, "data", None)))
  fv = jax.vmap(f, in_axes=(0, None))
  y = jax.jit(fv)(xs, t)
  assert_close(y, jax.jit(fv)(jax.device_put(x, jax.devices()[0]), t), jnp.float32)
  _hlo.assert_no_gather(_hlo.compiled_text(fv, xs, t), "vmapped forward")
  per_example = jax.vmap(jax.grad(_loss(f), argnums=1), in_axes=(0, None))
  got = jax.jit(per_example)(xs, t)
  want = np.stack([jax.grad(_loss(f), argnums=1)(x[i], t) for i in range(4)])
  assert_close(got, want, jnp.float32)


# Not sr_ste with check_vma=False: its gradient adds a decay term of the weight alone, which each device adds, so the
# psum counts it once per device, as for any weight-only term of a loss (with check_vma=True JAX counts it once).
@pytest.mark.parametrize(
    ("name", "check_vma"), [(n, c) for n in sorted(CASES) for c in (True, False) if c or n != "sr_ste"]
)
def test_inside_shard_map(name, check_vma):
  f, t, _ = CASES[name]
  x = jax.random.normal(KEYS[2], (16, K))
  y_ref, (dx_ref, dt_ref) = _single_device(f, x, t)

  def local(xl, tl):
    y = f(xl, tl)
    dx, dt = jax.grad(_loss(f), argnums=(0, 1))(xl, tl)
    # check_vma=True (shard_map's default): the op casts the replicated weight to vary as x does, so JAX sums its
    # gradient over "data" itself, as for x @ w; without it each device holds the share of its rows.
    return y, dx, dt if check_vma else jax.lax.psum(dt, "data")

  smap = jax.shard_map(
      local, mesh=_mesh(), in_specs=(P("data"), P()), out_specs=(P("data"), P("data"), P()), check_vma=check_vma
  )
  y, dx, dt = jax.jit(smap)(x, t)
  assert_close(y, y_ref, jnp.float32)
  assert_close(dx, dx_ref, jnp.float32)
  assert_close(dt, dt_ref, jnp.float32)


def test_inside_shard_map_bfloat16_vmap_and_grad_of_grad():
  f, t, _ = CASES["block_sparse_auto"]
  x = jax.random.normal(KEYS[2], (16, K))
  fb = lambda x, d: f(x.astype(jnp.bfloat16), d.astype(jnp.bfloat16)).astype(jnp.float32)
  penalty = lambda f: lambda x, t: jnp.sum(jax.grad(_loss(f), argnums=0)(x, t) ** 2)
  cases = {  # name -> (per-device function, out_spec, expected)
      "bfloat16": (lambda xl, tl: jax.grad(_loss(fb), argnums=1)(xl, tl), P(), jax.grad(_loss(fb), argnums=1)(x, t)),
      "vmap": (lambda xl, tl: jax.vmap(f, in_axes=(0, None))(xl[:, None], tl)[:, 0], P("data"), f(x, t)),
      "grad_of_grad": (
          lambda xl, tl: jax.grad(penalty(f), argnums=1)(xl, tl), P(), jax.grad(penalty(f), argnums=1)(x, t)
      ),
  }
  for name, (local, out_spec, want) in cases.items():
    got = jax.jit(jax.shard_map(local, mesh=_mesh(), in_specs=(P("data"), P()), out_specs=out_spec))(x, t)
    assert_close(got, want, jnp.bfloat16 if name == "bfloat16" else jnp.float32)


def test_gather_detector_sees_a_gather():
  mesh = _mesh()
  xs = jax.device_put(jnp.ones((16, K)), NamedSharding(mesh, P("data")))
  gathered = lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P())) @ W
  with pytest.raises(AssertionError, match="all-gather"):
    _hlo.assert_no_gather(_hlo.compiled_text(gathered, xs), "control")


def test_sr_ste_on_a_weight_sharded_across_its_groups():
  # Groups run along axis 0; splitting axis 1 keeps every group on one device: no communication.
  mesh = _mesh()
  ws = jax.device_put(W, NamedSharding(mesh, P(None, "data")))
  f = lambda w: ops.sr_ste(w, 2, 4, decay=0.1)
  y = jax.jit(f)(ws)
  np.testing.assert_array_equal(y, f(W))
  assert y.sharding.is_equivalent_to(ws.sharding, 2)
  grad = jax.grad(lambda w: jnp.sum(jnp.sin(f(w))))
  assert_close(jax.jit(grad)(ws), grad(W), jnp.float32)
  _hlo.assert_no_gather(_hlo.compiled_text(grad, ws), "sr_ste gradient")


def test_scanned_and_rematerialised_layers():
  mask = jaxsparse.random_block_mask(KEYS[3], (K, K), (16, 16), 0.3)
  w = jaxsparse.BlockSparseMatrix.from_dense(jax.random.normal(KEYS[3], (K, K)) / np.sqrt(K), (16, 16), block_mask=mask)

  def f(x, datas):
    layer = jax.checkpoint(lambda h, d: jnp.tanh(ops.block_sparse_matmul(h, w.with_data(d))))
    return jnp.sum(jax.lax.scan(lambda h, d: (layer(h, d), None), x, datas)[0])

  datas = jnp.stack([w.data] * 3)
  x = jax.random.normal(KEYS[2], (32, K))
  grad = jax.grad(f, argnums=(0, 1))
  want = grad(x, datas)
  xs = jax.device_put(x, NamedSharding(_mesh(), P("data")))
  for a, b in zip(jax.jit(grad)(xs, datas), want, strict=True):
    assert_close(a, b, jnp.float32)
  _hlo.assert_no_gather(_hlo.compiled_text(grad, xs, datas), "scanned layers")


def test_explicit_axes_with_a_sharded_weight_and_replicated_rows():
  # FSDP-like: the weight arrives sharded, x replicated; the op gathers the weight and still agrees.
  f, t, _ = CASES["masked_cpu"]
  x = jax.random.normal(KEYS[2], (8, K))
  y_ref, (_, dt_ref) = _single_device(f, x, t)
  with jax.set_mesh(_mesh(axis_type=AxisType.Explicit)):
    xs, ts = jax.device_put(x, P()), jax.device_put(t, P("data", None))
    y = jax.jit(f)(xs, ts)
    dt = jax.jit(jax.grad(_loss(f), argnums=1))(xs, ts)
  assert_close(y, y_ref, jnp.float32)
  assert_close(dt, dt_ref, jnp.float32)


@pytest.mark.parametrize("name", ["block_sparse_auto", "sparse_cpu", "nm"])
def test_explicit_axes_with_features_sharded_too(name):
  # x split on rows and features: the op gathers the features, and dX comes back split like x.
  f, t, _ = CASES[name]
  x = jax.random.normal(KEYS[2], (8, K))
  y_ref, (dx_ref, dt_ref) = _single_device(f, x, t)
  with jax.set_mesh(_mesh((2, 2), ("data", "model"), AxisType.Explicit)):
    xs = jax.device_put(x, P("data", "model"))
    y = jax.jit(f)(xs, t)
    dx, dt = jax.jit(jax.grad(_loss(f), argnums=(0, 1)))(xs, t)
    assert jax.typeof(dx).sharding.spec == P("data", "model")
    assert jax.typeof(y).sharding.spec == P("data", None)
  assert_close(y, y_ref, jnp.float32)
  assert_close(dx, dx_ref, jnp.float32)
  assert_close(dt, dt_ref, jnp.float32)


@pytest.mark.parametrize("name", ["masked_cpu", "block_sparse_auto", "nm"])
def test_auto_axes_with_a_sharded_weight(name):
  # FSDP-like under auto axes: weight split over "data" like x; it is gathered for the product, and
  # its gradient comes back correct.
  f, t, _ = CASES[name]
  x = jax.random.normal(KEYS[2], (16, K))
  y_ref, (_, dt_ref) = _single_device(f, x, t)
  mesh = _mesh()
  xs = jax.device_put(x, NamedSharding(mesh, P("data")))
  ts = jax.device_put(t, NamedSharding(mesh, P(None, "data")))
  assert_close(jax.jit(f)(xs, ts), y_ref, jnp.float32)
  assert_close(jax.jit(jax.grad(_loss(f), argnums=1))(xs, ts), dt_ref, jnp.float32)


@pytest.mark.parametrize("name", ["masked_xla", "masked_auto_dense", "masked_cpu", "sr_ste_matmul"])
def test_explicit_axes_with_a_weight_split_like_the_rows(name):
  # The XLA products of masked_matmul and sr_ste_matmul, differentiated by JAX itself, gather the weight as the
  # ops through row_parallel do, instead of failing on the clash of x's and w's splits.
  f, t, _ = CASES[name] if name in CASES else (lambda x, w: ops.sr_ste_matmul(x, w, 2, 4, decay=0.1), W, None)
  x = jax.random.normal(KEYS[2], (16, K))
  y_ref, (dx_ref, dt_ref) = _single_device(f, x, t)
  layouts = [((4,), ("data",), P("data", None), P(None, "data")),  # w's columns split over the axis of x's rows
             ((2, 2), ("data", "model"), P("data", "model"), P("data", "model"))]  # contracted dims split apart
  for shape, names, x_spec, t_spec in layouts:
    with jax.set_mesh(_mesh(shape, names, AxisType.Explicit)):
      xs, ts = jax.device_put(x, x_spec), jax.device_put(t, t_spec)
      y = jax.jit(f)(xs, ts)
      dx, dt = jax.jit(jax.grad(_loss(f), argnums=(0, 1)))(xs, ts)
      assert jax.typeof(y).sharding.spec == P("data", None)
      assert (jax.typeof(dx).sharding.spec, jax.typeof(dt).sharding.spec) == (x_spec, t_spec)
    assert_close(y, y_ref, jnp.float32)
    assert_close(dx, dx_ref, jnp.float32)
    assert_close(dt, dt_ref, jnp.float32)


@pytest.mark.parametrize("name", ["block_sparse_xla", "block_sparse_auto", "nm"])
def test_explicit_axes_with_a_compressed_weight_split_over_another_axis(name):
  # docs/guides/large_models.md said block-sparse and compressed N:M weights split over a mesh axis that x is not
  # split over fail to trace under explicit axes: they run, gather the weight, and agree (dW keeps its split).
  f, t, _ = CASES[name]
  x = jax.random.normal(KEYS[2], (16, K))
  y_ref, (dx_ref, dt_ref) = _single_device(f, x, t)
  t_spec = P(None, "model") if name == "nm" else P(None, None, "model")  # N:M values' / blocks' columns
  with jax.set_mesh(_mesh((2, 2), ("data", "model"), AxisType.Explicit)):
    xs, ts = jax.device_put(x, P("data", None)), jax.device_put(t, t_spec)
    y = jax.jit(f)(xs, ts)
    dx, dt = jax.jit(jax.grad(_loss(f), argnums=(0, 1)))(xs, ts)
    assert jax.typeof(y).sharding.spec == P("data", None)
    assert (jax.typeof(dx).sharding.spec, jax.typeof(dt).sharding.spec) == (P("data", None), t_spec)
  assert_close(y, y_ref, jnp.float32)
  assert_close(dx, dx_ref, jnp.float32)
  assert_close(dt, dt_ref, jnp.float32)


@pytest.mark.parametrize("name", ["block_sparse_auto", "sparse_cpu", "masked_cpu", "nm"])
def test_eager_calls_on_a_two_axis_explicit_mesh(name):
  # Called without jit on a mesh with an axis x is not split over: the ops' map over "data" alone failed eagerly
  # ("out_specs refers to 'model'"), forward and gradient.
  f, t, _ = CASES[name]
  x = jax.random.normal(KEYS[2], (8, K))
  y_ref, (dx_ref, dt_ref) = _single_device(f, x, t)
  with jax.set_mesh(_mesh((2, 2), ("data", "model"), AxisType.Explicit)):
    xs = jax.device_put(x, P("data", None))
    y = f(xs, t)
    dx, dt = jax.grad(_loss(f), argnums=(0, 1))(xs, t)
    assert jax.typeof(y).sharding.spec == P("data", None)
    assert jax.typeof(dx).sharding.spec == P("data", None)
  assert_close(y, y_ref, jnp.float32)
  assert_close(dx, dx_ref, jnp.float32)
  assert_close(dt, dt_ref, jnp.float32)


@pytest.mark.parametrize("name", ["masked_auto_few_rows", "sparse_cpu", "block_sparse_auto", "nm"])
def test_bfloat16_weights_on_a_two_axis_explicit_mesh(name):
  # The weight gradient of bfloat16 weights, summed over "data" alone of a ("data", "model") mesh: XLA's CPU compiler
  # aborted the process on the bfloat16 all-reduce ("Invalid binary instruction opcode copy"); it is summed in
  # float32. 8 rows over 2 devices: the few-row forwards (masked GEMM, CSR entries streamed) run on 4 local rows.
  if name == "masked_auto_few_rows":
    f, t = lambda x, w: ops.masked_matmul(x, w, MASK), W
  else:
    f, t, _ = CASES[name]
  t = t.astype(jnp.bfloat16)
  f16 = lambda x, t: f(x.astype(jnp.bfloat16), t)
  x = jax.random.normal(KEYS[2], (8, K))
  y_ref, (_, dt_ref) = _single_device(f16, x, t)
  with jax.set_mesh(_mesh((2, 2), ("data", "model"), AxisType.Explicit)):
    xs = jax.device_put(x, P("data", None))
    y = jax.jit(f16)(xs, t)
    dt = jax.jit(jax.grad(_loss(f16), argnums=1))(xs, t)
    assert y.dtype == dt.dtype == jnp.bfloat16
  assert_close(y, y_ref, jnp.bfloat16)
  assert_close(dt, dt_ref, jnp.bfloat16)


@pytest.mark.parametrize("name", ["block_sparse_auto", "sparse_cpu", "masked_cpu", "nm"])
def test_eager_calls_on_an_auto_mesh_keep_the_rows_split(name):
  # Called without jit on x split over auto axes: the custom_partitioning call ran unpartitioned, so every device
  # computed all rows and y (and dX) came back replicated, unlike the dense x @ w.
  f, t, _ = CASES[name]
  x = jax.random.normal(KEYS[2], (4, 8, K))
  y_ref, (dx_ref, dt_ref) = _single_device(f, x, t)
  sharding = NamedSharding(_mesh(), P(None, "data", None))
  xs = jax.device_put(x, sharding)
  y = f(xs, t)
  dx, dt = jax.grad(_loss(f), argnums=(0, 1))(xs, t)
  assert y.sharding.is_equivalent_to(sharding, y.ndim), y.sharding
  assert dx.sharding.is_equivalent_to(sharding, dx.ndim), dx.sharding
  assert_close(y, y_ref, jnp.float32)
  assert_close(dx, dx_ref, jnp.float32)
  assert_close(dt, dt_ref, jnp.float32)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxsparse.layers.BlockSparseLinear(K, N, block_shape=(16, 16), density=0.5, rngs=nnx.Rngs(0)),
        lambda: jaxsparse.layers.NMLinear(K, N, n=2, m=4, rngs=nnx.Rngs(0)),
        lambda: jaxsparse.layers.MaskedLinear(K, N, sparsity=0.5, rngs=nnx.Rngs(0)),
    ],
    ids=["block", "nm", "masked"],
)
def test_layer_gradients_inside_shard_map(make):
  # A data-parallel step written with shard_map (check_vma=True): the parameters' gradients come out summed.
  graph, params, rest = nnx.split(make(), nnx.Param, ...)
  loss = lambda p, x: jnp.sum(jnp.sin(nnx.merge(graph, p, rest)(x)))
  x = jax.random.normal(KEYS[2], (16, K))
  smap = jax.shard_map(jax.grad(loss), mesh=_mesh(), in_specs=(P(), P("data")), out_specs=P())
  jax.tree.map(lambda g, w: assert_close(g, w, jnp.float32), jax.jit(smap)(params, x), jax.grad(loss)(params, x))
