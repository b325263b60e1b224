"""The data-parallel wrapper of the ops (ops/_sharding.py) on one device: transparent to jit, vmap, grad; and the
argument checks of jaxsparse.sharding, which need no second device.

The multi-device behaviour is tested in tests/multidevice (run by tests/test_multidevice.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import jaxsparse
from jaxsparse import ops
from jaxsparse import sharding
from jaxsparse.formats import _masks
from tests._util import assert_close

KEYS = jax.random.split(jax.random.key(3), 3)
W = jax.random.normal(KEYS[0], (32, 24))
NMW = jaxsparse.NMSparseMatrix.from_dense(W, 2, 4)
BLOCK_MASK = jaxsparse.random_block_mask(KEYS[1], (32, 24), (8, 8), 0.5)
BSM = jaxsparse.BlockSparseMatrix.from_dense(W, (8, 8), block_mask=BLOCK_MASK)
W_DENSE = W * jnp.repeat(jnp.repeat(BLOCK_MASK, 8, 0), 8, 1)  # the block-sparse matrix, by plain jnp


def test_gradient_of_a_gradient_through_nm_matmul():
  x = jax.random.normal(KEYS[2], (4, 32))
  g = lambda f: jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(jnp.sin(f(x))))(x) ** 2))
  assert_close(g(lambda x: ops.nm_matmul(x, NMW))(x), g(lambda x: x @ NMW.to_dense())(x), jnp.float32)


def test_vmap_folds_rows_and_maps_per_example_gradients():
  x = jax.random.normal(KEYS[2], (3, 5, 32))
  f = lambda x, d: ops.block_sparse_matmul(x, BSM.with_data(d))
  ref = lambda x, d: x @ BSM.with_data(d).to_dense()
  assert_close(jax.jit(jax.vmap(f, in_axes=(0, None)))(x, BSM.data), ref(x, BSM.data), jnp.float32)
  per_example = lambda f: jax.vmap(jax.grad(lambda x, d: jnp.sum(jnp.sin(f(x, d))), argnums=1), in_axes=(0, None))
  assert_close(jax.jit(per_example(f))(x, BSM.data), per_example(ref)(x, BSM.data), jnp.float32)


def test_one_dimensional_x():
  x = jax.random.normal(KEYS[2], (32,))
  y = ops.nm_matmul(x, NMW)
  assert y.shape == (24,)
  assert_close(y, x @ NMW.to_dense(), jnp.float32)
  assert_close(jax.grad(lambda x: jnp.sum(ops.nm_matmul(x, NMW)))(x), NMW.to_dense().sum(1), jnp.float32)


def test_sharding_names_a_bad_mesh_or_axis():
  mesh = jax.make_mesh((1, 1), ("data", "model"))
  with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh .* got NoneType"):
    sharding.shard_block_sparse(BSM, None, "model", split="rows")
  with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh .* got AbstractMesh"):
    sharding.shard_block_sparse(BSM, mesh.abstract_mesh, "model", split="rows")
  for axis in (["model"], ("data", "model")):  # one axis name, not a list or a tuple of them
    with pytest.raises(TypeError, match=r"axis must be the name of one mesh axis \(a str\), got axis="):
      sharding.shard_block_sparse(BSM, mesh, axis, split="rows")


def test_tensor_parallel_layer_checks_reduce_and_batch_axes_when_built():
  mesh = jax.make_mesh((1, 1), ("data", "model"))
  layer = jaxsparse.layers.BlockSparseLinear(32, 32, density=0.5, block_shape=(16, 16), rngs=nnx.Rngs(0))
  tp_layer = sharding.TensorParallelBlockSparseLinear
  build = lambda split="columns", **kw: tp_layer(layer, mesh, "model", split=split, **kw)
  for split in ("columns", "rows"):  # a column split never read reduce: the typo went unnoticed
    with pytest.raises(ValueError, match="reduce must be 'psum' or 'scatter', got reduce='scater'"):
      build(split, reduce="scater")
  with pytest.raises(ValueError, match="batch_axes names 'batch', which is not an axis of the mesh"):
    build(batch_axes="batch")
  with pytest.raises(ValueError, match="names 'model', the mesh axis the weight is split over"):
    build(batch_axes=("data", "model"))
  with pytest.raises(ValueError, match="names a mesh axis more than once"):
    build(batch_axes=(("data",), "data"))
  for bad in (0, {"data"}):  # was: TypeError "'int' object is not iterable", or a set taken as a tuple
    with pytest.raises(ValueError, match=r"batch_axes=.*: must be None, a mesh axis name, or a tuple"):
      build(batch_axes=bad)
    with pytest.raises(ValueError, match=r"batch_axes=.*: must be None, a mesh axis name, or a tuple"):
      sharding.column_parallel_matmul(jnp.ones((2, 32)), sharding.shard_block_sparse(BSM, mesh, "model",
                                                                                     split="columns"), batch_axes=bad)


def test_tensor_parallel_on_an_explicit_mesh_takes_arrays_not_yet_on_it():
  # jax.make_mesh's axes are explicit by default; x (and new block values) not placed on the mesh, no jax.set_mesh.
  mesh = jax.make_mesh((1, 1), ("data", "model"))
  ws = sharding.shard_block_sparse(BSM, mesh, "model", split="rows")
  x = jax.random.normal(KEYS[2], (4, 32))
  data = jnp.asarray(np.asarray(ws.data))  # unplaced

  def loss(x, d):
    return jnp.sum(jnp.sin(sharding.row_parallel_matmul(x, ws.with_data(d), batch_axes="data", reduce="scatter")))

  dense = lambda x, d: jnp.sum(jnp.sin(x @ BSM.with_data(d).to_dense()))
  assert_close(sharding.row_parallel_matmul(x, ws.with_data(data), batch_axes="data"), x @ W_DENSE, jnp.float32)
  dx, dd = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, data)
  dx_ref, dd_ref = jax.grad(dense, argnums=(0, 1))(x, BSM.data)
  assert_close(dx, dx_ref, jnp.float32)
  assert_close(ws.global_data(dd), dd_ref, jnp.float32)


def test_weight_on_an_explicit_mesh_and_x_not():
  # Block values placed on a mesh with explicit axes (jax.make_mesh's default), x a plain array: the product runs on
  # that mesh (x's rows replicated) instead of failing in the XLA loop on mixed shardings.
  mesh = jax.make_mesh((1,), ("data",))
  data = jax.device_put(BSM.data, jax.NamedSharding(mesh, jax.P()))
  x = jax.random.normal(KEYS[2], (4, 32))
  f = lambda x, d: jnp.sum(jnp.sin(ops.block_sparse_matmul(x, BSM.with_data(d), implementation="xla")))
  dense = lambda x, d: jnp.sum(jnp.sin(x @ BSM.with_data(d).to_dense()))
  with jax.default_matmul_precision("highest"):  # float32 tolerances: on a GPU both sides would round to TF32
    assert_close(ops.block_sparse_matmul(x, BSM.with_data(data), implementation="xla"), x @ W_DENSE, jnp.float32)
    got, want = jax.grad(f, argnums=(0, 1))(x, data), jax.grad(dense, argnums=(0, 1))(x, BSM.data)
  for g, w in zip(got, want, strict=True):
    assert_close(g, w, jnp.float32)


# Under explicit axes JAX checks shardings in the types: a 1 x 1 mesh already refuses a sort over a dim typed as
# split, a reshape of it, and a dot_general whose operands' splits clash, as a real mesh does (tests/multidevice
# checks the values on 4 devices).
EXPLICIT_MESH = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def test_masks_of_a_weight_split_over_explicit_axes():
  keep = 24 * 32 // 4  # sparsity 0.75 of W's 768 entries
  want = np.abs(np.asarray(W)) >= np.sort(np.abs(np.asarray(W)).ravel())[-keep]  # no ties in normal samples
  norms = np.square(np.asarray(W)).reshape(4, 8, 3, 8).sum(axis=(1, 3))
  want_blocks = norms >= np.sort(norms.ravel())[-6]  # density 0.5 of 12 blocks
  with jax.set_mesh(EXPLICIT_MESH):
    ws = jax.device_put(W, jax.P("model", "data"))
    masks = [jaxsparse.magnitude_mask(ws, sparsity=0.75),
             jax.jit(lambda w: jaxsparse.magnitude_mask(w, sparsity=0.75))(ws),
             _masks.top_k_mask(jnp.abs(ws), keep)]
    blocks = [jaxsparse.block_magnitude_mask(ws, (8, 8), 0.5),
              jax.jit(lambda w: jaxsparse.block_magnitude_mask(w, (8, 8), 0.5))(ws)]
  for mask in masks:  # split like w
    assert jax.typeof(mask).sharding.spec == jax.P("model", "data")
    np.testing.assert_array_equal(mask, want)
  for block in blocks:
    np.testing.assert_array_equal(block, want_blocks)


MASK = jaxsparse.magnitude_mask(W, sparsity=0.75)
EXPLICIT_PRODUCTS = {  # name -> (f(x, w), the same product by plain jnp)
    "masked_xla": (lambda x, w: ops.masked_matmul(x, w, MASK, implementation="xla"),
                   lambda x, w: x @ jnp.where(MASK, w, 0.0)),
    "masked_auto": (lambda x, w: ops.masked_matmul(x, w, MASK), lambda x, w: x @ jnp.where(MASK, w, 0.0)),
    # sr_ste's reference: the value of x @ (w * nm_mask(w)), the straight-through gradient plus the decay of the
    # pruned weights (stop_gradient keeps the mask out of autodiff).
    "sr_ste_matmul": (lambda x, w: ops.sr_ste_matmul(x, w, 2, 4, decay=0.1),
                      lambda x, w: x @ (w + jax.lax.stop_gradient(jnp.where(jaxsparse.nm_mask(w, 2, 4), 0.0, -w)))),
}


@pytest.mark.parametrize("name", sorted(EXPLICIT_PRODUCTS))
@pytest.mark.parametrize("x_spec, w_spec", [
    (jax.P("data"), jax.P(None, "data")),  # w's columns split over the axis of x's rows
    (jax.P("data", "model"), jax.P("data", "model")),  # the contracted dim split over different axes
    (jax.P("data"), jax.P(None, "model")),  # w's columns split alone: every route must give one output type
])
def test_products_with_a_weight_split_over_explicit_axes(name, x_spec, w_spec):
  f, dense = EXPLICIT_PRODUCTS[name]
  x = jax.random.normal(KEYS[2], (4, 32))
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
  decay = jnp.where(jaxsparse.nm_mask(W, 2, 4), 0.0, 0.1 * W) if name == "sr_ste_matmul" else 0.0
  dx_ref, dw_ref = jax.grad(loss(dense), argnums=(0, 1))(x, W)
  with jax.set_mesh(EXPLICIT_MESH):
    xs, ws = jax.device_put(x, x_spec), jax.device_put(W, w_spec)
    y = jax.jit(f)(xs, ws)
    dx, dw = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(xs, ws)
  assert jax.typeof(y).sharding.spec == jax.P("data", None)  # x's rows split, as ops/_sharding.py lays them out
  assert jax.typeof(dx).sharding.spec == jax.typeof(xs).sharding.spec
  assert jax.typeof(dw).sharding.spec == jax.typeof(ws).sharding.spec
  assert_close(y, dense(x, W), jnp.float32)
  assert_close(dx, dx_ref, jnp.float32)
  assert_close(dw, dw_ref + decay, jnp.float32)


CSR = jaxsparse.CSRMatrix.from_dense(W, mask=MASK)


@pytest.mark.parametrize("implementation", ["xla", None])
def test_sparse_matmul_with_rows_split_over_explicit_axes(implementation):
  # The XLA path's autodiff took dW = x^T dY with x's rows split: JAX refused the ambiguous output sharding (a
  # ShardingTypeError from inside the op); sparse_matmul lays its operands out as masked_matmul does.
  x = jax.random.normal(KEYS[2], (4, 32))
  f = lambda x, d: ops.sparse_matmul(x, CSR.with_data(d), implementation=implementation)
  loss = lambda x, d: jnp.sum(jnp.sin(f(x, d)))
  dx_ref, dw_ref = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ jnp.where(MASK, w, 0.0))), argnums=(0, 1))(x, W)
  with jax.set_mesh(EXPLICIT_MESH):
    xs, ds = jax.device_put(x, jax.P("data")), jax.device_put(CSR.data, jax.P("model"))
    y = jax.jit(f)(xs, ds)
    dx, dd = jax.jit(jax.grad(loss, argnums=(0, 1)))(xs, ds)
  assert jax.typeof(y).sharding.spec == jax.P("data", None)
  assert jax.typeof(dx).sharding.spec == jax.typeof(xs).sharding.spec  # the cotangents split like their primals
  assert jax.typeof(dd).sharding.spec == jax.typeof(ds).sharding.spec
  assert_close(y, x @ jnp.where(MASK, W, 0.0), jnp.float32)
  assert_close(dx, dx_ref, jnp.float32)
  assert_close(dd, dw_ref[MASK], jnp.float32)


@pytest.mark.slow  # 10-19 s on 2 cores: out of the fast set (make test <= 15 min); CI runs it
@pytest.mark.parametrize("split", ["columns", "rows"])
def test_tensor_parallel_layer_back_to_one_layer_on_an_explicit_mesh(split):
  # jax.make_mesh's axes are explicit: the column split's bias is split over "model", which the new layer's is not
  # (ShardingTypeError in the copy of the bias before).
  layer = jaxsparse.layers.BlockSparseLinear(64, 128, density=0.5, block_shape=(16, 16), rngs=nnx.Rngs(0))
  layer.bias[...] = jnp.arange(128.0)
  tp = sharding.TensorParallelBlockSparseLinear(layer, jax.make_mesh((1,), ("model",)), "model", split=split)
  back = tp.to_block_sparse_linear()
  np.testing.assert_array_equal(np.asarray(back.sparse_kernel.to_dense()), np.asarray(layer.sparse_kernel.to_dense()))
  np.testing.assert_array_equal(np.asarray(back.bias[...]), np.arange(128.0))
  x = jax.random.normal(KEYS[2], (3, 64))
  assert_close(back(x), layer(x), jnp.float32)


def test_to_dense_of_values_split_over_explicit_axes():
  # Block values (or CSR values) split FSDP-style over an explicit axis: to_dense, and so a layer's to_dense and
  # jaxsparse.densify, failed to type the scatter of split values ("Incompatible types for broadcasting").
  layer = jaxsparse.layers.BlockSparseLinear(32, 24, density=0.5, block_shape=(8, 8), rngs=nnx.Rngs(0))
  want = np.asarray(layer.sparse_kernel.to_dense())
  with jax.set_mesh(EXPLICIT_MESH):
    layer.kernel.set_value(jax.device_put(layer.kernel[...], jax.P("data")))
    dense = [layer.sparse_kernel.to_dense(), jax.jit(lambda m: m.sparse_kernel.to_dense())(layer),
             layer.to_dense().kernel[...], jaxsparse.densify(nnx.Sequential(layer)).layers[0].kernel[...]]
    csr = CSR.with_data(jax.device_put(CSR.data, jax.P("model"))).to_dense()
  for d in dense:
    np.testing.assert_array_equal(np.asarray(d), want)
  np.testing.assert_array_equal(np.asarray(csr), np.asarray(CSR.to_dense()))


def test_tensor_parallel_split_of_values_split_over_explicit_axes():
  # A layer whose block values are split FSDP-style over an explicit axis: shard_block_sparse failed to type the gather
  # of each shard's blocks from the split values (ShardingTypeError).
  layer = jaxsparse.layers.BlockSparseLinear(32, 32, density=0.5, block_shape=(8, 8), rngs=nnx.Rngs(0))
  x = jax.random.normal(KEYS[2], (4, 32))
  want = layer(x)
  with jax.set_mesh(EXPLICIT_MESH):
    layer.kernel.set_value(jax.device_put(layer.kernel[...], jax.P("data")))
    tp = sharding.TensorParallelBlockSparseLinear(layer, EXPLICIT_MESH, "model", split="columns")
    y = tp(x)
  assert_close(y, want, jnp.float32)
  np.testing.assert_array_equal(np.asarray(tp.sharded_kernel.global_data()), np.asarray(layer.kernel[...]))


def test_unreduced_x_is_refused_by_name():
  # x holding unreduced partial sums (a dot_general's out_sharding with unreduced=): the ops and the tensor-parallel
  # products failed inside with JAX's "Using *pspec is dangerous"; they name x and the reshard that reduces it.
  a, b = jax.random.normal(KEYS[2], (4, 16)), jax.random.normal(KEYS[1], (16, 32))
  partial = lambda a, b: jnp.einsum("ik,kj->ij", a, b, out_sharding=jax.P("data", None, unreduced={"model"}))
  ws = sharding.shard_block_sparse(BSM, EXPLICIT_MESH, "model", split="columns")
  products = [lambda x: ops.masked_matmul(x, W, MASK), lambda x: ops.block_sparse_matmul(x, BSM),
              lambda x: ops.nm_matmul(x, NMW), lambda x: sharding.column_parallel_matmul(x, ws)]
  with jax.set_mesh(EXPLICIT_MESH):
    a_s, b_s = jax.device_put(a, jax.P("data", "model")), jax.device_put(b, jax.P("model", None))
    for f in products:
      with pytest.raises(ValueError, match=r"x is typed .*unreduced.*jax\.reshard\(x, P\('data', None\)\)"):
        jax.jit(lambda a, b, f=f: f(partial(a, b)))(a_s, b_s)
    y = jax.jit(lambda a, b: ops.masked_matmul(jax.reshard(partial(a, b), jax.P("data", None)), W, MASK))(a_s, b_s)
  assert_close(y, (a @ b) @ jnp.where(MASK, W, 0.0), jnp.float32)


def _linear_loss(f, x, t):
  """``sum(f(x, t) * r)`` for a fixed random ``r``: gradients that 16-bit rounding of ``y`` does not change."""
  y = f(x, t)
  return jnp.sum(y.astype(jnp.float32) * jax.random.normal(jax.random.key(5), y.shape))


def _in_one_device_shard_map(f, x, t):
  """``(y, dx, dt)`` of :func:`_linear_loss` inside ``shard_map(check_vma=True)`` (its default) over a one-device
  mesh: the types still say which values vary over the manual axis, which every kernel's result must declare."""
  mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  spec = jax.sharding.PartitionSpec

  def local(xl, tl):
    return f(xl, tl), *jax.grad(functools.partial(_linear_loss, f), argnums=(0, 1))(xl, tl)

  smap = jax.shard_map(local, mesh=mesh, in_specs=(spec("data"), spec()), out_specs=(spec("data"),) * 2 + (spec(),))
  return jax.jit(smap)(x, t)


def _check_in_shard_map(f, x, t, dtype):
  want = (f(x, t), *jax.grad(functools.partial(_linear_loss, f), argnums=(0, 1))(x, t))
  for got, ref in zip(_in_one_device_shard_map(f, x, t), want, strict=True):
    assert got.dtype == ref.dtype
    assert_close(got.astype(jnp.float32), ref.astype(jnp.float32), dtype)


SHARD_MAP_CASES = {
    "block": lambda x, d: ops.block_sparse_matmul(x, BSM.with_data(d)),
    "block_xla": lambda x, d: ops.block_sparse_matmul(x, BSM.with_data(d), implementation="xla"),
    "csr": lambda x, d: ops.sparse_matmul(x, jaxsparse.CSRMatrix.from_dense(W_DENSE).with_data(d)),
    "masked": lambda x, w: ops.masked_matmul(x, w, W_DENSE != 0),
    "nm": lambda x, v: ops.nm_matmul(x, NMW.with_values(v)),
    "sr_ste_matmul": lambda x, w: ops.sr_ste_matmul(x, w, 2, 4, decay=0.1),
}


@pytest.mark.parametrize("name", sorted(SHARD_MAP_CASES))
def test_ops_inside_shard_map_with_check_vma(name):
  # Every backend is traced here (lax.platform_dependent traces the GPU branches on a CPU too).
  f = SHARD_MAP_CASES[name]
  t = {"block": BSM.data, "block_xla": BSM.data, "nm": NMW.values,
       "csr": jaxsparse.CSRMatrix.from_dense(W_DENSE).data}.get(name, W)
  _check_in_shard_map(f, jax.random.normal(KEYS[2], (8, 32)), t, jnp.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 512])
@pytest.mark.parametrize(
    ("block", "dtype"),
    [((64, 64), jnp.float32), ((64, 64), jnp.bfloat16), ((128, 256), jnp.bfloat16), ((16, 16), jnp.float16)],
)
def test_gpu_block_sparse_inside_shard_map_with_check_vma(block, dtype, m):
  # The GPU routes (Mosaic GPU, Triton, the re-tiled blocks, the dense route) declare how their results vary.
  kw, kx, kb = jax.random.split(jax.random.key(11), 3)
  k, n = 512, 768
  mask = jaxsparse.random_block_mask(kb, (k, n), block, 0.4)
  w = jaxsparse.BlockSparseMatrix.from_dense(jax.random.normal(kw, (k, n)).astype(dtype), block, block_mask=mask)
  x = jax.random.normal(kx, (m, k)).astype(dtype)
  _check_in_shard_map(lambda x, d: ops.block_sparse_matmul(x, w.with_data(d)), x, w.data, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 256])
def test_gpu_nm_inside_shard_map_with_check_vma(m):
  # 2:4 bfloat16: the mma.sp decode kernel (few rows) and cuSPARSELt / Pallas (more), by the default dispatch.
  kw, kx = jax.random.split(jax.random.key(12))
  w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(kw, (1024, 1536)).astype(jnp.bfloat16), 2, 4)
  x = jax.random.normal(kx, (m, 1024)).astype(jnp.bfloat16)
  _check_in_shard_map(lambda x, v: ops.nm_matmul(x, w.with_values(v)), x, w.values, jnp.bfloat16)
  buffer = ops.cusparselt_compress(w) if ops.cusparselt_available() else None
  if buffer is not None:
    f = lambda x, v: ops.nm_matmul(x, w.with_values(v), cusparselt_weight=buffer)
    y_ref = f(x, w.values)
    y = _in_one_device_shard_map(f, x, w.values)[0]
    assert_close(y.astype(jnp.float32), y_ref.astype(jnp.float32), jnp.bfloat16)
