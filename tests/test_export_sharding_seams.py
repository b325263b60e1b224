"""``jax.export`` of sharded programs that call the ops, the sparse layers and the tensor-parallel products of a
``ShardedBlockSparseMatrix``, and the ops under ``shard_map``, on 8 devices.

Each ``check_*`` function runs in a subprocess with 8 host CPU devices (``XLA_FLAGS`` must be set before jax is
imported; ``tests/test_multidevice.py`` runs ``tests/multidevice`` the same way, on 4): a jitted program is exported,
serialised, deserialised and called, and compared with the jitted program and with the dense product (float32: 1e-5
relative; bfloat16: its rounding, ``tests/_util.py``).

Run one by hand: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python -c "import
tests.test_export_sharding_seams as t; t.check_layers_on_an_auto_mesh()"``.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsparse
from jaxsparse import ops
from jaxsparse import sharding
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import CompressedNMLinear
from jaxsparse.layers import MaskedLinear
from jaxsparse.layers import NMLinear
from jaxsparse.sharding import TensorParallelBlockSparseLinear
from jaxsparse.sharding import _tensor_parallel
from tests._util import RTOL
from tests._util import rel_err

ROOT = pathlib.Path(__file__).resolve().parent.parent
K, N = 64, 32


def _round_trip(f, *specs):
  """``f`` exported for ``specs`` (jaxsparse's kernels allowed), serialised and deserialised."""
  exported = jax.export.export(f, disabled_checks=ops.export_safety_checks())(*specs)
  # The custom-partitioning call names a callback of this process: no serialised program may hold one.
  assert "CustomSPMDPartitioning" not in exported.mlir_module()
  return jax.export.deserialize(exported.serialize())


def _close(got, want, dtype, what):
  tol = RTOL[jnp.dtype(dtype)]
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert rel_err(a, b) <= tol, (what, rel_err(a, b), tol)


def _mesh(axis_type=AxisType.Auto):
  return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)


def _on_model(a) -> P:
  """Out features (the last dim, ``N``) split over ``"model"``; every other array replicated."""
  return P(*([None] * (a.ndim - 1)), "model") if a.ndim in (1, 2) and a.shape[-1] == N else P()


def _split(layer):
  """``(f(x, params), params)``: the layer's forward on a plain dict of its params (``Exported.serialize`` takes no
  ``nnx.State``)."""
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def forward(x, pure):
    state = nnx.State(params)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state, rest)(x)

  return forward, nnx.to_pure_dict(params)


def _sparse_layers(dtype):
  keys = jax.random.split(jax.random.key(7), 2)
  w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(keys[0], (K, N), dtype), 2, 4)
  bias = jax.random.normal(keys[1], (N,), dtype)
  cnm = CompressedNMLinear(w, bias)
  block = BlockSparseLinear(K, N, density=0.5, block_shape=(16, 16), param_dtype=dtype, rngs=nnx.Rngs(1))
  return {"compressed_nm": (cnm, cnm.weight.to_dense(), bias),
          "block": (block, block.sparse_kernel.to_dense(), block.bias[...])}


def check_layers_on_an_auto_mesh():
  # The reported open item: jax.export of a program on an auto-sharded mesh failed on the ops' custom-partitioning
  # call, a Python callback ("NotImplementedError: serialization of host_callbacks is not yet implemented"), for every
  # op and layer (compressed N:M and block-sparse, float32 and bfloat16, forward and gradients).
  mesh = _mesh()
  for dtype in (jnp.float32, jnp.bfloat16):
    for name, (layer, w, b) in _sparse_layers(dtype).items():
      forward, params = _split(layer)
      f = jax.jit(forward)
      params = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, _on_model(a))), params)
      x = jax.random.normal(jax.random.key(3), (8, K), dtype)
      x = jax.device_put(x, NamedSharding(mesh, P("data", None)))
      want = f(x, params)
      dense = x.astype(jnp.float32) @ w.astype(jnp.float32) + b.astype(jnp.float32)
      _close(want, dense, dtype, (name, dtype, "jit"))
      got = _round_trip(f, x, params).call(x, params)
      _close(got, want, dtype, (name, dtype, "exported"))
      _close(got, dense, dtype, (name, dtype, "exported vs dense"))
      # A serving batch of any size, split over "data".
      spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape(f"2*b, {K}"), dtype,
                                  sharding=NamedSharding(mesh, P("data", None)))
      exported = _round_trip(f, spec, params)
      for batch in (2, 6):
        xb = jax.random.normal(jax.random.key(batch), (batch, K), dtype)
        xb = jax.device_put(xb, NamedSharding(mesh, P("data", None)))
        _close(exported.call(xb, params), f(xb, params), dtype, (name, dtype, "symbolic", batch))


def _trained_layers():
  return {
      "nm_sr_ste": NMLinear(K, N, n=2, m=4, rngs=nnx.Rngs(0)),
      "block": BlockSparseLinear(K, N, density=0.5, block_shape=(16, 16), rngs=nnx.Rngs(1)),
      "masked": MaskedLinear(K, N, sparsity=0.7, rngs=nnx.Rngs(2)),
  }


def check_exported_gradients_on_an_auto_mesh():
  mesh = _mesh()
  for name, layer in _trained_layers().items():
    forward, params = _split(layer)
    loss = lambda x, p, forward=forward: jnp.sum(jnp.sin(forward(x, p)))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    x = jax.random.normal(jax.random.key(4), (8, K))
    one_device = grad(x, params)
    params = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, _on_model(a))), params)
    x = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    want = grad(x, params)
    _close(want, one_device, jnp.float32, (name, "sharded vs one device"))
    _close(_round_trip(grad, x, params).call(x, params), want, jnp.float32, (name, "exported"))


def check_layers_and_gradients_on_an_explicit_mesh():
  mesh = _mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    for name, (layer, w, b) in _sparse_layers(jnp.float32).items():
      forward, params = _split(layer)
      f = jax.jit(forward)
      params = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, _on_model(a))), params)
      x = jax.device_put(jax.random.normal(jax.random.key(5), (8, K)), NamedSharding(mesh, P("data", None)))
      want = f(x, params)
      _close(want, x @ w + b, jnp.float32, (name, "jit"))
      _close(_round_trip(f, x, params).call(x, params), want, jnp.float32, (name, "exported"))
    for name, layer in _trained_layers().items():
      forward, params = _split(layer)
      loss = lambda x, p, forward=forward: jnp.sum(jnp.sin(forward(x, p)))
      grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
      params = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, _on_model(a))), params)
      x = jax.device_put(jax.random.normal(jax.random.key(6), (8, K)), NamedSharding(mesh, P("data", None)))
      want = grad(x, params)
      _close(_round_trip(grad, x, params).call(x, params), want, jnp.float32, (name, "exported gradient"))


def check_ops_under_shard_map():
  for axis_type in (AxisType.Auto, AxisType.Explicit):
    _ops_under_shard_map(jax.make_mesh((8,), ("model",), axis_types=(axis_type,)))


def _ops_under_shard_map(mesh):
  keys = jax.random.split(jax.random.key(8), 4)
  w = jax.random.normal(keys[0], (K, 64))
  x = jax.random.normal(keys[1], (16, K))
  nmw = jaxsparse.NMSparseMatrix.from_dense(w, 2, 4)
  bsm = jaxsparse.BlockSparseMatrix.from_dense(
      w, (8, 8), block_mask=jaxsparse.random_block_mask(keys[2], (K, 64), (8, 8), 0.5))
  csr = jaxsparse.CSRMatrix.from_dense(w, mask=jaxsparse.magnitude_mask(w, sparsity=0.8))
  sum_sin = lambda f: jax.grad(lambda x, *a: jnp.sum(jnp.sin(f(x, *a))))
  rows = jax.device_put(x, NamedSharding(mesh, P("model", None)))
  on_mesh = lambda tree: jax.device_put(tree, NamedSharding(mesh, P()))
  for check_vma in (True, False):
    # x split on rows, the weight replicated.
    for name, wt, op in (("nm", nmw, ops.nm_matmul), ("block", bsm, ops.block_sparse_matmul),
                         ("csr", csr, ops.sparse_matmul)):
      f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(P("model", None), P()), out_specs=P("model", None),
                                check_vma=check_vma))
      want, wd, wt = x @ wt.to_dense(), wt.to_dense(), on_mesh(wt)
      _close(f(rows, wt), want, jnp.float32, (name, check_vma, "rows"))
      _close(_round_trip(f, rows, wt).call(rows, wt), want, jnp.float32, (name, check_vma, "rows exported"))
      _close(jax.jit(sum_sin(f))(rows, wt), sum_sin(jnp.matmul)(x, wd), jnp.float32,
             (name, check_vma, "rows dx"))

    # The N:M weight split on N (its values and positions both have N last), x replicated: each device multiplies
    # by its own (K, N / 8) matrix.
    def local(x, values, indices):
      return ops.nm_matmul(x, jaxsparse.NMSparseMatrix(values, indices, shape=(K, values.shape[1]), n=2, m=4,
                                                       validate=False))

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, "model"), P(None, "model")),
                              out_specs=P(None, "model"), check_vma=check_vma))
    cols = lambda a: jax.device_put(a, NamedSharding(mesh, P(None, "model")))
    args = (on_mesh(x), cols(nmw.values), cols(nmw.indices))
    _close(f(*args), x @ nmw.to_dense(), jnp.float32, ("nm columns", check_vma))
    _close(_round_trip(f, *args).call(*args), x @ nmw.to_dense(), jnp.float32, ("nm columns exported", check_vma))
    grad = jax.jit(jax.grad(lambda x, v, i, f=f: jnp.sum(jnp.sin(f(x, v, i))), argnums=(0, 1)))
    dense_grad = jax.grad(lambda x, v: jnp.sum(jnp.sin(x @ nmw.with_values(v).to_dense())), argnums=(0, 1))
    _close(grad(*args), dense_grad(x, nmw.values), jnp.float32, ("nm columns grad", check_vma))


def _random_block_sparse(key, shape, block_shape=(8, 8)):
  k1, k2 = jax.random.split(key)
  return jaxsparse.BlockSparseMatrix.from_dense(
      jax.random.normal(k1, shape), block_shape, block_mask=jaxsparse.random_block_mask(k2, shape, block_shape, 0.5))


def check_sharded_block_sparse_matrix():
  # The reported open item: Exported.serialize refused a ShardedBlockSparseMatrix argument or result ("Cannot serialize
  # PyTreeDef containing an unregistered type"), its aux data holding the jax.sharding.Mesh.
  for axis_type in (AxisType.Auto, AxisType.Explicit):
    mesh = _mesh(axis_type)
    keys = jax.random.split(jax.random.key(9), 4)
    w_in, w_out = _random_block_sparse(keys[0], (K, 64)), _random_block_sparse(keys[1], (64, N))
    ws_in = sharding.shard_block_sparse(w_in, mesh, "model", split="columns")
    ws_out = sharding.shard_block_sparse(w_out, mesh, "model", split="rows")
    x_host, h_host = jax.random.normal(keys[2], (8, K)), jax.random.normal(keys[3], (8, 64))
    x = jax.device_put(x_host, NamedSharding(mesh, P("data", None)))
    h = jax.device_put(h_host, NamedSharding(mesh, P("data", "model")))  # row-parallel: split on K
    mlp = jnp.tanh(x_host @ w_in.to_dense()) @ w_out.to_dense()
    cases = {
        "column": (sharding.column_parallel_matmul, (x, ws_in), x_host @ w_in.to_dense()),
        "row": (sharding.row_parallel_matmul, (h, ws_out), h_host @ w_out.to_dense()),
        "megatron": (functools.partial(sharding.megatron_mlp, activation=jnp.tanh), (x, ws_in, ws_out), mlp),
        # Only dense arguments: the matrices are constants of the program.
        "closure": (functools.partial(sharding.megatron_mlp, w_in=ws_in, w_out=ws_out, activation=jnp.tanh), (x,),
                    mlp),
    }
    for name, (fn, args, dense) in cases.items():
      f = jax.jit(fn)
      want = f(*args)
      _close(want, dense, jnp.float32, (name, axis_type, "jit"))
      _close(_round_trip(f, *args).call(*args), want, jnp.float32, (name, axis_type, "exported"))

    # Gradients of the block values, through a matrix argument.
    def loss(x, data, w):
      return jnp.sum(jnp.sin(sharding.column_parallel_matmul(x, w.with_data(data))))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    want = grad(x, ws_in.data, ws_in)
    _close(_round_trip(grad, x, ws_in.data, ws_in).call(x, ws_in.data, ws_in), want, jnp.float32,
           (axis_type, "exported gradient"))

    # A matrix as the result: the deserialized tree rebuilds the same mesh.
    double = jax.jit(lambda w: w.with_data(2 * w.data))
    got = _round_trip(double, ws_out).call(ws_out)
    assert isinstance(got, sharding.ShardedBlockSparseMatrix) and got.mesh == mesh, (axis_type, got)
    _close(got.to_block_sparse().to_dense(), 2 * w_out.to_dense(), jnp.float32, (axis_type, "result"))

    # The tensor-parallel layer, its params passed as a plain dict.
    base = BlockSparseLinear(K, N, density=0.5, block_shape=(8, 8), rngs=nnx.Rngs(3))
    forward, params = _split(TensorParallelBlockSparseLinear(base, mesh, "model", split="columns"))
    f = jax.jit(forward)
    want = f(x, params)
    _close(want, base(x_host), jnp.float32, (axis_type, "layer"))
    _close(_round_trip(f, x, params).call(x, params), want, jnp.float32, (axis_type, "exported layer"))


CHECKS = sorted(name for name in dir(sys.modules[__name__]) if name.startswith("check_"))


@pytest.mark.slow  # a fresh process with 8 devices each: 20-60 s on 2 cores
@pytest.mark.parametrize("check", CHECKS)
def test_on_eight_devices(check):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
  code = f"import jax; assert jax.device_count() == 8; import tests.test_export_sharding_seams as t; t.{check}()"
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, f"{check} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def test_found_the_checks():
  assert "check_layers_on_an_auto_mesh" in CHECKS and len(CHECKS) == 5, CHECKS


def test_sharded_block_sparse_matrix_round_trips_on_one_device():
  mesh = jax.make_mesh((1,), ("model",))
  keys = jax.random.split(jax.random.key(10), 2)
  w = _random_block_sparse(keys[0], (K, N))
  ws = sharding.shard_block_sparse(w, mesh, "model", split="columns")
  x = jax.random.normal(keys[1], (4, K))
  f = jax.jit(sharding.column_parallel_matmul)
  _close(_round_trip(f, x, ws).call(x, ws), f(x, ws), jnp.float32, "exported")
  got = _round_trip(jax.jit(lambda w: w.with_data(-w.data)), ws).call(ws)
  assert got.mesh == mesh and (got.axis, got.split, got.shape, got.nnz_blocks) == (
      "model", "columns", (K, N), ws.nnz_blocks)
  _close(got.to_block_sparse().to_dense(), -w.to_dense(), jnp.float32, "result")


def test_a_sharded_matrix_on_devices_this_process_lacks_is_named():
  mesh = jax.make_mesh((1,), ("model",))
  ws = sharding.shard_block_sparse(_random_block_sparse(jax.random.key(11), (K, N)), mesh, "model", split="rows")
  _, treedef = jax.tree.flatten(ws)
  aux = json.loads(_tensor_parallel._serialize_aux(treedef.node_data()[1]))
  aux["mesh"]["device_ids"] = [1000]
  with pytest.raises(ValueError, match=r"no devices of ids \[1000\]"):
    _tensor_parallel._deserialize_aux(json.dumps(aux).encode())
