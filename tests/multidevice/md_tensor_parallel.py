"""Tensor parallel on 4 devices: block-column and block-row splits of a BlockSparseMatrix, the Megatron MLP.

Results and gradients equal the unsplit matrix on one device; the communication is the one each
layout needs (none for column-parallel, one all-reduce for row-parallel and for the MLP's forward).
"""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsparse
from jaxsparse.sharding import ShardedBlockSparseMatrix
from jaxsparse.sharding import TensorParallelBlockSparseLinear
from jaxsparse.sharding import column_parallel_matmul
from jaxsparse.sharding import megatron_mlp
from jaxsparse.sharding import row_parallel_matmul
from jaxsparse.sharding import shard_block_sparse
from tests._util import assert_close
from tests.multidevice import _hlo

KEYS = jax.random.split(jax.random.key(1), 6)
D, H, BLOCK = 64, 128, (16, 16)


def _matrix(key, shape, density=0.3):
  k1, k2 = jax.random.split(key)
  mask = jaxsparse.random_block_mask(k2, shape, BLOCK, density)
  w = jax.random.normal(k1, shape) / np.sqrt(shape[0])
  return jaxsparse.BlockSparseMatrix.from_dense(w, BLOCK, block_mask=mask)


W_IN, W_OUT = _matrix(KEYS[0], (D, H)), _matrix(KEYS[1], (H, D))
X = jax.random.normal(KEYS[2], (8, 4, D))


def _mesh(shape=(2, 2), names=("data", "model")):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


@pytest.mark.parametrize("split", ["columns", "rows"])
@pytest.mark.parametrize("model", [2, 4])
def test_layout_roundtrip_and_per_shard_indices(split, model):
  mesh = _mesh((4 // model, model))
  ws = shard_block_sparse(W_IN, mesh, "model", split=split)
  assert isinstance(ws, ShardedBlockSparseMatrix) and ws.data.shape[0] == model
  np.testing.assert_array_equal(ws.to_block_sparse().to_dense(), W_IN.to_dense())
  # Each shard is the matching slice of the dense matrix.
  dense = np.asarray(W_IN.to_dense())
  for s in range(model):
    shard = jax.tree.map(lambda a, s=s: np.asarray(a)[s], ws.shards)
    if split == "columns":
      part = dense[:, s * H // model : (s + 1) * H // model]
    else:
      part = dense[s * D // model : (s + 1) * D // model]
    np.testing.assert_array_equal(np.asarray(shard.to_dense()), part)
  assert ws.data.sharding.spec == P("model")


def test_uneven_shards_are_padded_with_zero_blocks():
  mask = np.zeros((4, 8), bool)
  mask[:, :2] = True  # every block in the first of four column shards
  w = jaxsparse.BlockSparseMatrix.from_dense(jnp.ones((64, 128)), BLOCK, block_mask=mask)
  ws = shard_block_sparse(w, _mesh((1, 4)), "model", split="columns")
  assert ws.data.shape == (4, 8, 16, 16)
  assert int((np.asarray(ws.source) >= 0).sum()) == 8
  np.testing.assert_array_equal(ws.to_block_sparse().to_dense(), w.to_dense())
  x = jax.random.normal(KEYS[3], (4, 64))
  assert_close(column_parallel_matmul(x, ws), x @ w.to_dense(), jnp.float32)
  # Padding blocks get no gradient, so they stay zero through training.
  g = jax.grad(lambda d: column_parallel_matmul(x, ws.with_data(d)).sum())(ws.data)
  assert not np.any(np.asarray(g)[np.asarray(ws.source) < 0])


def _loss_and_grads(f, x, *weights):
  loss = lambda x, *d: jnp.sum(jnp.sin(f(x, *d)))
  return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(weights) + 1))))(x, *weights)


@pytest.mark.parametrize("reduce", ["psum", "scatter"])
def test_column_then_row_parallel_equal_one_device(reduce):
  mesh = _mesh()
  w_in = shard_block_sparse(W_IN, mesh, "model", split="columns")
  w_out = shard_block_sparse(W_OUT, mesh, "model", split="rows")
  xs = jax.device_put(X, NamedSharding(mesh, P("data")))

  def tp(x, d_in, d_out):
    h = column_parallel_matmul(x, w_in.with_data(d_in), batch_axes="data")
    return row_parallel_matmul(jax.nn.relu(h), w_out.with_data(d_out), batch_axes="data", reduce=reduce)

  def ref(x, d_in, d_out):
    h = jaxsparse.ops.block_sparse_matmul(x, W_IN.with_data(d_in))
    return jaxsparse.ops.block_sparse_matmul(jax.nn.relu(h), W_OUT.with_data(d_out))

  y = jax.jit(tp)(xs, w_in.data, w_out.data)
  assert_close(y, ref(X, W_IN.data, W_OUT.data), jnp.float32)
  want = NamedSharding(mesh, P("data", None, "model" if reduce == "scatter" else None))
  assert y.sharding.is_equivalent_to(want, y.ndim), y.sharding

  (loss, (dx, di, do)) = _loss_and_grads(tp, xs, w_in.data, w_out.data)
  (loss_ref, (dx_ref, di_ref, do_ref)) = _loss_and_grads(ref, X, W_IN.data, W_OUT.data)
  assert_close(loss, loss_ref, jnp.float32)
  assert_close(dx, dx_ref, jnp.float32)
  assert_close(w_in.global_data(di), di_ref, jnp.float32)
  assert_close(w_out.global_data(do), do_ref, jnp.float32)


def test_megatron_mlp_one_reduction_each_way():
  mesh = _mesh()
  w_in = shard_block_sparse(W_IN, mesh, "model", split="columns")
  w_out = shard_block_sparse(W_OUT, mesh, "model", split="rows")
  xs = jax.device_put(X, NamedSharding(mesh, P("data")))
  mlp = lambda x, d_in, d_out: megatron_mlp(x, w_in.with_data(d_in), w_out.with_data(d_out), batch_axes="data")
  y = jax.jit(mlp)(xs, w_in.data, w_out.data)
  h = jax.nn.gelu(X @ W_IN.to_dense())
  assert_close(y, h @ W_OUT.to_dense(), jnp.float32)

  fwd = _hlo.compiled_text(mlp, xs, w_in.data, w_out.data)
  _hlo.assert_no_gather(fwd, "Megatron MLP forward")
  assert _hlo.count(fwd, "all-reduce") == 1, "the forward pass should reduce once (over 'model')"

  grad = jax.grad(lambda x, a, b: jnp.sum(mlp(x, a, b) ** 2), argnums=(0, 1, 2))
  bwd = _hlo.compiled_text(grad, xs, w_in.data, w_out.data)
  _hlo.assert_no_gather(bwd, "Megatron MLP gradient")
  # forward y, backward dx (over 'model'), and the two weight gradients (over 'data'), which XLA
  # may combine into one.
  assert 3 <= _hlo.count(bwd, "all-reduce") <= 4, _hlo.count(bwd, "all-reduce")


def test_tensor_parallel_only_mesh_and_explicit_axes():
  mesh = jax.make_mesh((4,), ("model",), axis_types=(AxisType.Explicit,))
  w_in = shard_block_sparse(W_IN, mesh, "model", split="columns")
  w_out = shard_block_sparse(W_OUT, mesh, "model", split="rows")
  with jax.set_mesh(mesh):
    y = jax.jit(lambda x: megatron_mlp(x, w_in, w_out))(jax.device_put(X, P()))
  assert_close(y, jax.nn.gelu(X @ W_IN.to_dense()) @ W_OUT.to_dense(), jnp.float32)


def test_explicit_axes_batch_from_the_type_and_gradients():
  emesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  w_in = shard_block_sparse(W_IN, emesh, "model", split="columns")
  w_out = shard_block_sparse(W_OUT, emesh, "model", split="rows")

  def ref(x, a, b):
    h = jax.nn.gelu(jaxsparse.ops.block_sparse_matmul(x, W_IN.with_data(a)))
    return jnp.sum(jnp.sin(jaxsparse.ops.block_sparse_matmul(h, W_OUT.with_data(b))))

  want = jax.grad(ref, argnums=(0, 1, 2))(X, W_IN.data, W_OUT.data)
  with jax.set_mesh(emesh):
    xs = jax.device_put(X, P("data"))  # batch_axes=None: read from the type
    loss = lambda x, a, b: jnp.sum(jnp.sin(megatron_mlp(x, w_in.with_data(a), w_out.with_data(b))))
    dx, da, db = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(xs, w_in.data, w_out.data)
    assert jax.typeof(dx).sharding.spec == jax.typeof(xs).sharding.spec
  assert_close(dx, want[0], jnp.float32)
  assert_close(w_in.global_data(da), want[1], jnp.float32)
  assert_close(w_out.global_data(db), want[2], jnp.float32)


def test_bad_arguments():
  mesh = _mesh()
  with pytest.raises(ValueError, match="must divide by the 2 devices"):
    shard_block_sparse(_matrix(KEYS[4], (D, 48)), mesh, "model", split="columns")
  with pytest.raises(ValueError, match="not an axis of the mesh"):
    shard_block_sparse(W_IN, mesh, "tensor", split="columns")
  w_rows = shard_block_sparse(W_IN, mesh, "model", split="rows")
  with pytest.raises(ValueError, match="split by columns"):
    column_parallel_matmul(X, w_rows)
  with pytest.raises(ValueError, match="batch_axes names 'batch'"):
    row_parallel_matmul(X, w_rows, batch_axes="batch")
  with pytest.raises(ValueError, match="names 'model', the mesh axis the weight is split over"):
    row_parallel_matmul(X, w_rows, batch_axes="model")
  with pytest.raises(ValueError, match="names a mesh axis more than once"):
    row_parallel_matmul(X, w_rows, batch_axes=("data", "data"))
  with pytest.raises(ValueError, match="hidden dim"):
    megatron_mlp(X, shard_block_sparse(W_IN, mesh, "model", split="columns"), w_rows)


class _MLP(nnx.Module):
  def __init__(self, up, down):
    self.up, self.down = up, down

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.up(x)))


def test_tensor_parallel_nnx_layers_train():
  rngs = nnx.Rngs(0)
  up = jaxsparse.layers.BlockSparseLinear(D, H, density=0.5, block_shape=BLOCK, rngs=rngs)
  down = jaxsparse.layers.BlockSparseLinear(H, D, density=0.5, block_shape=BLOCK, rngs=rngs)
  down.bias[...] = jax.random.normal(KEYS[5], (D,))
  ref = _MLP(up, down)
  mesh = _mesh()
  tp = _MLP(TensorParallelBlockSparseLinear(up, mesh, "model", split="columns", batch_axes="data"),
            TensorParallelBlockSparseLinear(down, mesh, "model", split="rows", batch_axes="data"))
  specs = nnx.get_partition_spec(nnx.state(tp, nnx.Param))
  assert specs["up"]["kernel"].get_value() == P("model", None, None, None)
  assert specs["up"]["bias"].get_value() == P("model")
  assert specs["down"]["bias"].get_value() == P(None)
  state = jax.jit(lambda s: s, out_shardings=nnx.get_named_sharding(nnx.state(tp), mesh))(nnx.state(tp))
  assert state["down"]["kernel"][...].sharding.spec == P("model", None, None, None)

  xs = jax.device_put(X, NamedSharding(mesh, P("data")))
  loss = lambda m, x: jnp.sum(jnp.sin(m(x)))
  assert_close(nnx.jit(lambda m, x: m(x))(tp, xs), ref(X), jnp.float32)
  g_tp = nnx.jit(nnx.grad(loss))(tp, xs)
  g_ref = nnx.grad(loss)(ref, X)
  assert_close(tp.up.sharded_kernel.global_data(g_tp["up"]["kernel"][...]), g_ref["up"]["kernel"][...], jnp.float32)
  assert_close(tp.down.sharded_kernel.global_data(g_tp["down"]["kernel"][...]), g_ref["down"]["kernel"][...],
               jnp.float32)
  assert_close(g_tp["down"]["bias"][...], g_ref["down"]["bias"][...], jnp.float32)

  optimizer = nnx.Optimizer(tp, optax.sgd(0.1), wrt=nnx.Param)
  nnx.jit(lambda m, o, x: o.update(m, nnx.grad(loss)(m, x)))(tp, optimizer, xs)
  back = tp.up.to_block_sparse_linear()
  np.testing.assert_array_equal(back.block_mask, up.block_mask)
  assert_close(back.kernel[...], up.kernel[...] - 0.1 * g_ref["up"]["kernel"][...], jnp.float32)


@pytest.mark.parametrize("split", ["columns", "rows"])
def test_tensor_parallel_layer_restores_into_an_abstract_target(split, tmp_path):
  # bfloat16 parameters, saved with orbax and restored into nnx.eval_shape's target: same values, dtypes,
  # shardings and outputs. (The target closes over a concrete layer: the per-shard block count is the pattern's.)
  base = jaxsparse.layers.BlockSparseLinear(D, H, density=0.5, block_shape=BLOCK, param_dtype=jnp.bfloat16,
                                            rngs=nnx.Rngs(3))
  mesh = _mesh()
  tp = TensorParallelBlockSparseLinear(base, mesh, "model", split=split, batch_axes="data")
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "tp", nnx.state(tp))
  checkpointer.wait_until_finished()
  graphdef, abstract = nnx.split(nnx.eval_shape(
      lambda: TensorParallelBlockSparseLinear(base, mesh, "model", split=split, batch_axes="data")))
  restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "tp", abstract))
  for a, b in zip(jax.tree.leaves(nnx.state(restored)), jax.tree.leaves(nnx.state(tp)), strict=True):
    assert a.dtype == b.dtype and a.sharding.is_equivalent_to(b.sharding, a.ndim), (a, b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  x_spec = P("data", None, "model" if split == "rows" else None)
  xs = jax.device_put(X.astype(jnp.bfloat16), NamedSharding(mesh, x_spec))
  y = nnx.jit(lambda m, x: m(x))(restored, xs)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(tp(xs), np.float32))
  assert_close(y, base(X.astype(jnp.bfloat16)), jnp.bfloat16)

  # The gradient of the unsplit matrix, mapped inside the jitted step; the layout back to one layer is host work.
  loss = lambda m, x: jnp.sum(jnp.sin(m(x).astype(jnp.float32)))
  g = nnx.jit(lambda m, x: m.sharded_kernel.global_data(nnx.grad(loss)(m, x)["kernel"][...]))(restored, xs)
  g_ref = nnx.grad(loss)(base, X.astype(jnp.bfloat16))["kernel"][...]
  assert g.shape == g_ref.shape and g.dtype == g_ref.dtype
  assert_close(g, g_ref, jnp.bfloat16)
  with pytest.raises(ValueError, match=r"to_block_sparse needs the pattern .* concrete"):
    nnx.jit(lambda m: m.to_block_sparse_linear().kernel[...])(restored)


def _restored_across_sizes(split, saved, target):
  """``(base, saved_layer, target_layer)``: a layer split over a 'model' axis of ``saved`` devices and one built on a
  mesh whose 'model' axis has ``target`` (from another layer: its own values and pattern), with a nonzero bias."""
  base = jaxsparse.layers.BlockSparseLinear(D, H, density=0.5, block_shape=BLOCK, rngs=nnx.Rngs(3))
  base.bias[...] = jax.random.normal(KEYS[5], (H,))
  other = jaxsparse.layers.BlockSparseLinear(D, H, density=0.25, block_shape=BLOCK, rngs=nnx.Rngs(4))
  src = TensorParallelBlockSparseLinear(base, _mesh((4 // saved, saved)), "model", split=split, batch_axes="data")
  dst = TensorParallelBlockSparseLinear(other, _mesh((4 // target, target)), "model", split=split, batch_axes="data")
  return base, src, dst


def _check_resplit_layer(layer, base, split, target):
  """``layer`` (re-split over ``target`` devices) is ``base``: outputs, gradients, layout, and the unsplit layer."""
  mesh = layer.mesh
  assert layer.kernel.shape[0] == target
  assert layer.kernel[...].sharding.is_equivalent_to(NamedSharding(mesh, P("model")), 4)
  assert layer.source.shape[0] == target and layer.nnz_blocks == base.nnz_blocks
  x_spec = P("data", None, "model" if split == "rows" else None)
  xs = jax.device_put(X, NamedSharding(mesh, x_spec))
  assert_close(nnx.jit(lambda m, x: m(x))(layer, xs), base(X), jnp.float32)
  loss = lambda m, x: jnp.sum(jnp.sin(m(x)))
  g = nnx.jit(lambda m, x: m.sharded_kernel.global_data(nnx.grad(loss)(m, x)["kernel"][...]))(layer, xs)
  assert_close(g, nnx.grad(loss)(base, X)["kernel"][...], jnp.float32)
  back = layer.to_block_sparse_linear()
  np.testing.assert_array_equal(back.block_mask, base.block_mask)
  np.testing.assert_array_equal(back.kernel[...], base.kernel[...])
  np.testing.assert_array_equal(back.bias[...], base.bias[...])


@pytest.mark.parametrize("saved, target", [(2, 4), (4, 2)])
@pytest.mark.parametrize("split", ["columns", "rows"])
def test_state_of_another_tensor_parallel_size_is_named_then_resplit(split, saved, target):
  # nnx.update with the state of a layer split over another number of devices: the call failed inside shard_map
  # ("axis sizes that are not evenly divisible"; 2 -> 4) or on an index array's shape ("col_offsets must be an int32
  # array of shape (5,)"; 4 -> 2), naming neither size. It now names both, and resplit() lays the state out again.
  base, src, dst = _restored_across_sizes(split, saved, target)
  nnx.update(dst, nnx.state(src))
  msg = rf"holds {saved} shards .*\(saved axis size {saved}, target axis size {target}\). Call layer\.resplit\(\)"
  with pytest.raises(ValueError, match=msg):
    dst(X)
  with pytest.raises(ValueError, match=msg):
    nnx.jit(lambda m, x: m(x))(dst, X)
  with pytest.raises(ValueError, match="resplit needs the layer's state to be concrete"):
    nnx.jit(lambda m: m.resplit())(dst)
  dst.resplit()
  _check_resplit_layer(dst, base, split, target)
  dst.resplit()  # laid out already: the same layer
  _check_resplit_layer(dst, base, split, target)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's reads left after its refusal
@pytest.mark.parametrize("saved, target", [(2, 4), (4, 2)])
def test_orbax_checkpoint_of_another_tensor_parallel_size_restores_by_resplit(saved, target, tmp_path):
  # Orbax refuses the abstract target of the other size (the shapes differ, it does not pad or truncate by default);
  # restored as saved and put into the layer of the target size, the state is re-split onto its mesh.
  base, src, dst = _restored_across_sizes("columns", saved, target)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "tp", nnx.state(src))
  checkpointer.wait_until_finished()
  _, wrong = nnx.split(nnx.eval_shape(lambda: TensorParallelBlockSparseLinear(
      base, _mesh((4 // target, target)), "model", split="columns", batch_axes="data")))
  refusal = None
  try:
    checkpointer.restore(tmp_path / "tp", wrong)
  except ValueError as e:
    refusal = str(e)
  gc.collect()  # the reads orbax left pending (held by the error's traceback, gone now), collected while ignored
  assert refusal is not None and "not compatible with the stored shape" in refusal, refusal
  graphdef, as_saved = nnx.split(nnx.eval_shape(lambda: TensorParallelBlockSparseLinear(
      base, _mesh((4 // saved, saved)), "model", split="columns", batch_axes="data")))
  restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "tp", as_saved))
  nnx.update(dst, nnx.state(restored))
  with pytest.raises(ValueError, match=rf"saved axis size {saved}, target axis size {target}"):
    dst(X)
  dst.resplit()
  _check_resplit_layer(dst, base, "columns", target)


def test_resplit_refuses_the_state_of_another_layer():
  base, _, dst = _restored_across_sizes("columns", 2, 4)
  narrow = jaxsparse.layers.BlockSparseLinear(D, D, density=0.5, block_shape=BLOCK, rngs=nnx.Rngs(5))
  nnx.update(dst, nnx.state(TensorParallelBlockSparseLinear(narrow, _mesh((2, 2)), "model", split="columns")))
  with pytest.raises(ValueError, match=r"resplit: the state .* is not that of this layer \(64 -> 128, blocks "
                                       r"\(16, 16\), split by columns\) over any number of shards"):
    dst.resplit()
  del base


@pytest.mark.parametrize("rows", [1, 3])
def test_batch_axes_over_a_batch_that_does_not_divide(rows):
  # 1 or 3 rows over the 2 devices of "data": gathered (as the data-parallel ops do), not a shard_map error.
  mesh = _mesh()
  w_in = shard_block_sparse(W_IN, mesh, "model", split="columns")
  w_out = shard_block_sparse(W_OUT, mesh, "model", split="rows")
  x = X[:rows, 0]
  mlp = lambda x, a, b: megatron_mlp(x, w_in.with_data(a), w_out.with_data(b), batch_axes="data")

  def ref(x, a, b):
    h = jax.nn.gelu(jaxsparse.ops.block_sparse_matmul(x, W_IN.with_data(a)))
    return jaxsparse.ops.block_sparse_matmul(h, W_OUT.with_data(b))

  assert_close(jax.jit(mlp)(x, w_in.data, w_out.data), ref(x, W_IN.data, W_OUT.data), jnp.float32)
  _, (dx, da, db) = _loss_and_grads(mlp, x, w_in.data, w_out.data)
  _, (dx_ref, da_ref, db_ref) = _loss_and_grads(ref, x, W_IN.data, W_OUT.data)
  assert_close(dx, dx_ref, jnp.float32)
  assert_close(w_in.global_data(da), da_ref, jnp.float32)  # summed once, not once per device
  assert_close(w_out.global_data(db), db_ref, jnp.float32)


def test_explicit_x_sharded_over_the_tensor_parallel_axis():
  # Under explicit axes x's batch is read from its type; a batch split over the tensor-parallel axis itself is
  # gathered over it (x is replicated over that axis for a column split) and dX comes back split like x.
  mesh = jax.make_mesh((4,), ("model",), axis_types=(AxisType.Explicit,))
  w = shard_block_sparse(W_IN, mesh, "model", split="columns")
  x = X[:, 0]
  loss = lambda x, d: jnp.sum(jnp.sin(column_parallel_matmul(x, w.with_data(d))))
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, P("model"))
    y = jax.jit(lambda x: column_parallel_matmul(x, w))(xs)
    dx, dd = jax.jit(jax.grad(loss, argnums=(0, 1)))(xs, w.data)
    assert jax.typeof(dx).sharding.spec == P("model", None)
  dx_ref, dd_ref = jax.grad(lambda x, d: jnp.sum(jnp.sin(x @ W_IN.with_data(d).to_dense())), argnums=(0, 1))(
      x, W_IN.data)
  assert_close(y, x @ W_IN.to_dense(), jnp.float32)
  assert_close(dx, dx_ref, jnp.float32)
  assert_close(w.global_data(dd), dd_ref, jnp.float32)
