"""CompressedNMDense (Linen inference form of NMDense) and jaxsparse.compress_linen, against NMDense / sparsify_linen:
outputs, jit, gradients of the kept values, bytes, abstract init, whole models (Dense, DenseGeneral, Conv),
densify_linen, summary, partitioning boxes and bad input."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsparse
from jaxsparse.layers import CompressedNMLinear
from jaxsparse.layers.linen import CompressedNMDense
from jaxsparse.layers.linen import NMDense
from tests._util import assert_close

K, N = 64, 24


def _normal(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _nm_dense_variables(n, m, dtype=jnp.float32, use_bias=True):
  """NMDense variables with a random bias (the default one is zeros, which would hide a dropped bias)."""
  variables = NMDense(N, n=n, m=m, param_dtype=dtype, use_bias=use_bias).init(jax.random.key(0), jnp.ones((1, K)))
  if use_bias:
    variables["params"]["bias"] = _normal(1, (N,), dtype)
  return variables


def _compressed(variables, n, m):
  """CompressedNMDense variables of NMDense ``variables``, built independently of compress_linen."""
  kernel = variables["params"]["kernel"]
  w = jaxsparse.NMSparseMatrix.from_dense(jnp.where(jaxsparse.nm_mask(kernel, n, m), kernel, 0), n, m)
  return {"params": {**variables["params"], "kernel": w.values}, "sparsity": {"kernel_positions": w.indices}}


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


# -------------------------------------------------------------------------------------------------
# The layer.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("n", "m"), [(2, 4), (1, 4), (4, 8)])
def test_layer_output_equals_nm_dense(n, m, dtype):
  variables = _nm_dense_variables(n, m, dtype)
  x = _normal(2, (3, 5, K), dtype)
  expected = NMDense(N, n=n, m=m, param_dtype=dtype).apply(variables, x)
  y = CompressedNMDense(N, n=n, m=m, param_dtype=dtype).apply(_compressed(variables, n, m), x)
  assert y.shape == expected.shape == (3, 5, N) and y.dtype == expected.dtype == dtype
  assert_close(y, expected, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, None])
def test_dtype_promotion_is_nn_dense(dtype):
  # bf16 parameters, f32 inputs: the compute dtype is Flax's promotion (or dtype=), as nn.Dense's.
  variables = _nm_dense_variables(2, 4, jnp.bfloat16)
  x = _normal(2, (4, K))
  expected = NMDense(N, dtype=dtype, param_dtype=jnp.bfloat16).apply(variables, x)
  y = CompressedNMDense(N, dtype=dtype, param_dtype=jnp.bfloat16).apply(_compressed(variables, 2, 4), x)
  assert y.dtype == expected.dtype == jnp.float32
  assert_close(y, expected, jnp.bfloat16)


def test_without_bias_and_under_jit():
  variables = _nm_dense_variables(2, 4, use_bias=False)
  small = _compressed(variables, 2, 4)
  layer = CompressedNMDense(N, use_bias=False)
  x = _normal(2, (8, K))
  y = jax.jit(layer.apply)(small, x)
  assert sorted(small["params"]) == ["kernel"]
  np.testing.assert_allclose(np.asarray(y), np.asarray(layer.apply(small, x)), rtol=1e-6, atol=1e-6)
  assert_close(y, NMDense(N, use_bias=False).apply(variables, x), jnp.float32)


def test_grad_of_kept_values_is_nm_dense_kernel_grad_at_kept_positions():
  variables = _nm_dense_variables(2, 4)
  small = _compressed(variables, 2, 4)
  x = _normal(2, (6, K))
  target = _normal(3, (6, N))

  def loss(module, params, rest):
    return jnp.sum((module.apply({"params": params, **rest}, x) - target) ** 2)

  g_dense = jax.grad(loss, argnums=1)(NMDense(N, sr_ste_decay=0.0), variables["params"], {})
  g_small = jax.grad(loss, argnums=1)(CompressedNMDense(N), small["params"], {"sparsity": small["sparsity"]})
  positions = small["sparsity"]["kernel_positions"]
  as_dense = jaxsparse.NMSparseMatrix(g_small["kernel"], positions, shape=(K, N), n=2, m=4).to_dense()
  mask = jaxsparse.nm_mask(variables["params"]["kernel"], 2, 4)
  assert g_small["kernel"].shape == (K // 2, N)
  np.testing.assert_allclose(np.asarray(as_dense), np.asarray(jnp.where(mask, g_dense["kernel"], 0)), atol=1e-5)
  np.testing.assert_allclose(np.asarray(g_small["bias"]), np.asarray(g_dense["bias"]), rtol=1e-5, atol=1e-5)
  # The NNX layer gives the same gradient of its kept values.
  nnx_layer = CompressedNMLinear(
      jaxsparse.NMSparseMatrix(small["params"]["kernel"], positions, shape=(K, N), n=2, m=4),
      small["params"]["bias"], cusparselt_copy=False)
  g_nnx = nnx.grad(lambda layer: jnp.sum((layer(x) - target) ** 2))(nnx_layer)
  np.testing.assert_allclose(np.asarray(g_nnx["kernel"][...]), np.asarray(g_small["kernel"]), rtol=1e-5, atol=1e-5)


def test_variables_are_0_5625x_dense_for_2_4_bf16():
  layer = CompressedNMDense(256, param_dtype=jnp.bfloat16, use_bias=False)
  variables = layer.init(jax.random.key(0), jnp.ones((1, 512), jnp.bfloat16))
  assert variables["params"]["kernel"].shape == (256, 256)
  assert variables["sparsity"]["kernel_positions"].dtype == jnp.uint8
  assert _nbytes(variables) / (512 * 256 * 2) == 0.5625


def test_init_is_a_valid_random_layer_and_works_abstract():
  layer = CompressedNMDense(N, n=2, m=4)
  x = _normal(2, (3, K))
  variables = layer.init(jax.random.key(0), x)
  w = jaxsparse.NMSparseMatrix(variables["params"]["kernel"], variables["sparsity"]["kernel_positions"],
                               shape=(K, N), n=2, m=4)  # validate=True: checks the positions
  assert float(jnp.abs(w.values).min()) > 0  # kept values of a random kernel, not zeros
  expected = x @ w.to_dense() + variables["params"]["bias"]
  np.testing.assert_allclose(np.asarray(layer.apply(variables, x)), np.asarray(expected), rtol=1e-5, atol=1e-5)
  abstract = jax.eval_shape(layer.init, jax.random.key(0), x)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(lambda a: (a.shape, a.dtype), variables)
  other = layer.init(jax.random.key(1), x)  # another key, another layer
  assert not np.array_equal(np.asarray(other["params"]["kernel"]), np.asarray(variables["params"]["kernel"]))


def test_init_keeps_the_kernel_init_partitioning_box():
  init = nn.with_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
  variables = CompressedNMDense(N, kernel_init=init).init(jax.random.key(0), jnp.ones((1, K)))
  kernel = variables["params"]["kernel"]
  assert isinstance(kernel, nn.Partitioned) and kernel.names == ("embed", "mlp") and kernel.value.shape == (K // 2, N)
  assert CompressedNMDense(N, kernel_init=init).apply(variables, jnp.ones((2, K))).shape == (2, N)


def test_bad_input_and_fields_raise_clear_errors():
  layer = CompressedNMDense(N)
  variables = layer.init(jax.random.key(0), jnp.ones((1, K)))
  with pytest.raises(ValueError, match=r"holds variables for 64 input features, but x.shape\[-1\] = 60"):
    layer.apply(variables, jnp.ones((2, 60)))
  with pytest.raises(ValueError, match=r"no 'sparsity' collection"):
    layer.apply({"params": variables["params"]}, jnp.ones((2, K)))
  with pytest.raises(ValueError, match=r"x.shape\[-1\]=30 must be a multiple of m=4"):
    layer.init(jax.random.key(0), jnp.ones((1, 30)))
  with pytest.raises(ValueError, match=r"x must have shape"):
    layer.apply(variables, jnp.float32(1.0))
  dense = _nm_dense_variables(2, 4)  # NMDense variables (a dense kernel) given to the compressed layer
  with pytest.raises(ValueError, match=r"holds variables for 128 input features"):
    layer.apply({**dense, "sparsity": variables["sparsity"]}, jnp.ones((2, K)))
  with pytest.raises(ValueError, match=r"not the kept values"):
    CompressedNMDense(N, n=3, m=4).apply({**dense, "sparsity": variables["sparsity"]}, jnp.ones((2, K)))
  with pytest.raises(ValueError, match=r"n must satisfy 0 < n < m"):
    CompressedNMDense(N, n=4, m=4)
  with pytest.raises(ValueError, match=r"m must be an int >= 2"):
    CompressedNMDense(N, n=1, m=1)
  with pytest.raises(ValueError, match=r"features"):
    CompressedNMDense(0)
  with pytest.raises(ValueError, match=r"implementation must be one of"):
    CompressedNMDense(N, implementation="cuda")


# -------------------------------------------------------------------------------------------------
# compress_linen.
# -------------------------------------------------------------------------------------------------


class Net(nn.Module):
  """nn.Dense, nn.DenseGeneral (the attention projections) and nn.Conv."""

  @nn.compact
  def __call__(self, x):  # x: (batch, 4, 16)
    a = nn.MultiHeadDotProductAttention(num_heads=2)(x)  # kernels (16, 2, 8) and (2, 8, 16): (16, 16) in 2-D
    c = nn.Conv(16, (3,), name="conv")(x).mean(axis=1)
    return nn.Dense(16, name="head")(a.reshape(x.shape[0], -1)) + nn.Dense(16, name="side")(c)


@pytest.fixture(scope="module")
def net():
  """``(x, sparse, sparse_vars)`` of ``Net`` under ``NM(2, 4)``, made once (no test modifies them)."""
  x = _normal(1, (2, 4, 16))
  variables = jax.jit(Net().init)(jax.random.key(0), x)
  rng = np.random.default_rng(7)  # nonzero biases; NumPy: one XLA compile per leaf shape would take seconds
  variables = jax.tree.map(lambda a: a + 0.1 * rng.standard_normal(a.shape, np.float32), variables)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(Net(), variables, jaxsparse.NM(2, 4), x)
  return x, sparse, sparse_vars


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_compress_linen_outputs_equal_sparsify_linen(net, dtype):
  x, sparse, sparse_vars = net
  x, sparse_vars = jax.tree.map(lambda a: a.astype(dtype), (x, sparse_vars))  # bf16 parameters: bf16 compute
  small, small_vars = jaxsparse.compress_linen(sparse, sparse_vars)
  expected = jax.jit(sparse.apply)(sparse_vars, x)  # jitted: one compile instead of one per op (seconds on CPU)
  y = jax.jit(small.apply)(small_vars, x)
  assert y.dtype == expected.dtype == dtype
  if dtype == jnp.float32:
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=1e-5, atol=1e-5)
  assert_close(y, expected, dtype)
  kinds = {".".join(p): jaxsparse._sparsify._linen_plan.sparse_layer_name(layer) for p, layer in small.layers.items()}
  assert kinds == {"conv": "NMConv", "head": "CompressedNMDense", "side": "CompressedNMDense",
                   **{f"MultiHeadDotProductAttention_0.{k}": "CompressedNMDense"
                      for k in ("query", "key", "value", "out")}}
  # The conv keeps its dense kernel and NMDense's plan; the inputs are not modified.
  assert small.layers[("conv",)] == sparse.layers[("conv",)]
  assert small_vars["params"]["conv"]["kernel"] is sparse_vars["params"]["conv"]["kernel"]
  assert "sparsity" not in sparse_vars
  assert "conv" not in small_vars["sparsity"]
  q = small_vars["params"]["MultiHeadDotProductAttention_0"]["query"]
  assert q["kernel"].shape == (8, 16) and q["bias"].shape == (16,)  # (K * n // m, N) of the (16, 16) 2-D kernel


def test_compress_linen_variables_shrink_and_differentiate(net):
  x, sparse, sparse_vars = net
  small, small_vars = jaxsparse.compress_linen(sparse, sparse_vars)
  head = small_vars["params"]["head"]
  assert head["kernel"].shape == (32, 16)  # (64, 16) kernel
  assert _nbytes(head["kernel"]) + _nbytes(small_vars["sparsity"]["head"]) < 0.6 * 64 * 16 * 4

  def loss(params):
    return jnp.sum(small.apply({"params": params, "sparsity": small_vars["sparsity"]}, x) ** 2)

  grads = jax.jit(jax.grad(loss))(small_vars["params"])
  assert jax.tree.map(jnp.shape, grads) == jax.tree.map(jnp.shape, small_vars["params"])
  assert float(jnp.abs(grads["head"]["kernel"]).sum()) > 0


def test_densify_linen_of_compressed_equals_densify_of_sparse(net):
  x, sparse, sparse_vars = net
  small, small_vars = jaxsparse.compress_linen(sparse, sparse_vars)
  module, dense_vars = jaxsparse.densify_linen(small, small_vars)
  _, expected = jaxsparse.densify_linen(sparse, sparse_vars)
  assert module is sparse.module and "sparsity" not in dense_vars
  with pytest.raises(ValueError, match=r"need their 'sparsity' collection"):
    jaxsparse.densify_linen(small, {"params": small_vars["params"]})
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), dense_vars, expected)
  assert dense_vars["params"]["MultiHeadDotProductAttention_0"]["query"]["kernel"].shape == (16, 2, 8)
  np.testing.assert_allclose(np.asarray(module.apply(dense_vars, x)), np.asarray(sparse.apply(sparse_vars, x)),
                             rtol=1e-5, atol=1e-5)


def test_compressed_module_init_and_abstract_restore_target(net):
  x, sparse, sparse_vars = net
  small, small_vars = jaxsparse.compress_linen(sparse, sparse_vars)
  fresh = small.init(jax.random.key(3), x)
  abstract = jax.eval_shape(small.init, jax.random.key(3), x)
  spec = jax.tree.map(lambda a: (a.shape, a.dtype), small_vars)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), fresh) == spec
  assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == spec
  assert small.apply(fresh, x).shape == (x.shape[0], 16)
  # Abstract variables compress too (a restore target from the SR-STE variables' shapes).
  abstract_vars = jax.eval_shape(lambda v: jaxsparse.compress_linen(sparse, v)[1], sparse_vars)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract_vars) == spec


def test_compress_linen_twice_keeps_the_variables(net):
  x, sparse, sparse_vars = net
  small, small_vars = jaxsparse.compress_linen(sparse, sparse_vars)
  again, again_vars = jaxsparse.compress_linen(small, small_vars, implementation="xla")
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), again_vars, small_vars)
  assert again.layers[("head",)].implementation == "xla"
  np.testing.assert_allclose(np.asarray(again.apply(again_vars, x)), np.asarray(small.apply(small_vars, x)),
                             rtol=1e-6, atol=1e-6)


def test_summary_describes_compressed_layers(net):
  _, sparse, sparse_vars = net
  small, small_vars = jaxsparse.compress_linen(sparse, sparse_vars)
  layers = {s.path: s for s in jaxsparse.summary(small_vars, module=small).layers}
  head = layers["head"]
  assert (head.kind, head.shape, head.pattern, head.density) == ("CompressedNMDense", (64, 16), "2:4 compressed", 0.5)
  assert head.bytes == _nbytes(small_vars["params"]["head"]) + _nbytes(small_vars["sparsity"]["head"])
  assert head.dense_bytes == (64 * 16 + 16) * 4
  assert (head.forward_flops, head.backward_flops) == (64 * 16, 2 * 64 * 16)  # no SR-STE: a sparse weight gradient
  assert layers["MultiHeadDotProductAttention_0.query"].shape == (16, 16)
  assert layers["conv"].kind == "NMConv"
  # A Linen module holding CompressedNMDense layers, found with its example inputs.
  head_vars = {"params": small_vars["params"]["head"], "sparsity": small_vars["sparsity"]["head"]}
  own = {s.path: s for s in jaxsparse.summary(head_vars, jnp.ones((2, 64)), module=CompressedNMDense(16)).layers}
  assert own[""].pattern == "2:4 compressed" and own[""].shape == (64, 16)
  with pytest.raises(ValueError, match=r"holds a compressed N:M kernel .* pass module="):
    jaxsparse.summary(small_vars)


def test_plot_pattern_of_compressed_variables_says_what_to_plot(net):
  _, sparse, sparse_vars = net
  _, small_vars = jaxsparse.compress_linen(sparse, sparse_vars)
  head = {"params": small_vars["params"]["head"], "sparsity": small_vars["sparsity"]["head"]}
  with pytest.raises(TypeError, match=r"CompressedNMDense's variables, which do not say its n:m"):
    jaxsparse.plot_pattern(head)


def test_route_slower_to_dense_linen_takes_compressed_layers(net):
  x, sparse, sparse_vars = net
  small, small_vars = jaxsparse.compress_linen(sparse, sparse_vars)
  timer = lambda module, v, x: 1.0 if isinstance(module, nn.Dense | nn.DenseGeneral) else 2.0  # dense faster
  routed, routed_vars, timings = jaxsparse.route_slower_to_dense_linen(small, small_vars, 2, timer=timer)
  assert {t.signature.layer for t in timings} == {"CompressedNMLinear"}  # the product, named as the NNX twin
  assert list(routed.layers) == [("conv",)]
  np.testing.assert_allclose(np.asarray(routed.apply(routed_vars, x)), np.asarray(small.apply(small_vars, x)),
                             rtol=1e-5, atol=1e-5)


def test_partitioning_boxes_carry_over():
  class Boxed(nn.Module):
    @nn.compact
    def __call__(self, x):
      init = nn.with_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
      return nn.Dense(16, kernel_init=init, bias_init=nn.with_partitioning(nn.initializers.zeros, ("mlp",)))(x)

  x = _normal(1, (2, 32))
  variables = Boxed().init(jax.random.key(0), x)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(Boxed(), variables, jaxsparse.NM(2, 4), x)
  small, small_vars = jaxsparse.compress_linen(sparse, sparse_vars)
  kernel = small_vars["params"]["Dense_0"]["kernel"]
  assert isinstance(kernel, nn.Partitioned) and kernel.names == ("embed", "mlp") and kernel.value.shape == (16, 16)
  assert small_vars["params"]["Dense_0"]["bias"].names == ("mlp",)
  abstract = jax.eval_shape(small.init, jax.random.key(0), x)  # the restore target has the same boxes
  assert jax.tree.structure(abstract) == jax.tree.structure(small_vars)
  np.testing.assert_allclose(np.asarray(small.apply(small_vars, x)), np.asarray(sparse.apply(sparse_vars, x)),
                             rtol=1e-5, atol=1e-5)
  _, dense_vars = jaxsparse.densify_linen(small, small_vars)
  assert dense_vars["params"]["Dense_0"]["kernel"].names == ("embed", "mlp")


def test_compress_linen_bad_arguments(net):
  x, sparse, sparse_vars = net
  with pytest.raises(TypeError, match=r"sparse must be the SparsifiedLinen"):
    jaxsparse.compress_linen(Net(), sparse_vars)
  with pytest.raises(TypeError, match=r"variables must be the Linen variables"):
    jaxsparse.compress_linen(sparse, sparse_vars["params"])
  with pytest.raises(ValueError, match=r"implementation must be one of"):
    jaxsparse.compress_linen(sparse, sparse_vars, implementation="gpu")

  class Custom(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8, dot_general=jax.lax.dot_general, name="fc")(nn.Dense(8, name="ok")(x))

  x = _normal(1, (2, 8))
  variables = Custom().init(jax.random.key(0), x)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(Custom(), variables, jaxsparse.NM(2, 4), x)
  with pytest.raises(ValueError, match=r"^fc: its dot_general is not Flax's default"):
    jaxsparse.compress_linen(sparse, sparse_vars)


def test_export_state_dict_of_compressed_equals_sparse(net):
  pytest.importorskip("torch")
  from jaxsparse import torch_interop  # noqa: PLC0415 -- needs torch

  _, sparse, sparse_vars = net
  small, small_vars = jaxsparse.compress_linen(sparse, sparse_vars)
  got = torch_interop.export_state_dict(small_vars, module=small)
  want = torch_interop.export_state_dict(sparse_vars, module=sparse)
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(got[k].numpy(), want[k].numpy())
  with pytest.raises(TypeError, match=r"pass module="):
    torch_interop.export_state_dict(small_vars)
  assert math.prod(got["head.weight"].shape) == 64 * 16


@pytest.mark.slow  # 10-19 s on 2 cores: out of the fast set (make test <= 15 min); CI runs it
def test_export_of_transposable_and_conv_masked_nm_layers_is_what_they_compute():
  """Linen N:M layers exported to torch carry the mask they prune with: a transposable rule's (the compressed and
  the SR-STE form export the same weights) and, for a conv, its own Flax weight mask applied first."""
  torch = pytest.importorskip("torch")
  from jaxsparse import torch_interop  # noqa: PLC0415 -- needs torch

  model = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(16)])
  x = _normal(1, (3, 32))
  variables = model.init(jax.random.key(0), x)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, jaxsparse.NM(2, 4, transposable=True), x)
  small, small_vars = jaxsparse.compress_linen(sparse, sparse_vars)
  names = {"layers_0": "0", "layers_2": "2"}
  got = torch_interop.export_state_dict(sparse_vars, module=sparse, torch_names=names)
  want = torch_interop.export_state_dict(small_vars, module=small, torch_names=names)
  _, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  for layer in ("0", "2"):
    np.testing.assert_array_equal(got[f"{layer}.weight"].numpy(), want[f"{layer}.weight"].numpy())
    np.testing.assert_array_equal(got[f"{layer}.weight"].numpy().T,
                                  np.asarray(dense_vars["params"][f"layers_{layer}"]["kernel"]))
  masks = torch_interop.export_masks(sparse_vars, module=sparse, torch_names=names)
  assert all(torch.equal(masks[k], v) for k, v in torch_interop.export_masks(small_vars, module=small,
                                                                              torch_names=names).items())
  net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
  net.load_state_dict(got)
  with torch.no_grad():
    y = net(torch.from_numpy(np.asarray(x))).numpy()
  np.testing.assert_allclose(y, np.asarray(sparse.apply(sparse_vars, x)), rtol=1e-5, atol=1e-5)

  own = np.asarray(jax.random.bernoulli(jax.random.key(5), 0.5, (3, 8, 16)))  # the conv's own weight mask
  conv = nn.Conv(16, (3,), mask=own)
  xc = _normal(2, (2, 6, 8))
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(conv, conv.init(jax.random.key(0), xc), jaxsparse.NM(2, 4), xc)
  _, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  weight = torch_interop.export_state_dict(sparse_vars, module=sparse)["weight"].numpy()  # (out, in, k)
  np.testing.assert_array_equal(weight, np.transpose(np.asarray(dense_vars["params"]["kernel"]), (2, 1, 0)))
  mask = torch_interop.export_masks(sparse_vars, module=sparse)["weight_mask"].numpy()
  assert not mask[np.transpose(~own, (2, 1, 0))].any()


def test_compress_linen_of_abstract_variables_is_the_restore_target(net):
  """``compress_linen`` of ``jax.eval_shape(sparse.init, ...)`` (jax.ShapeDtypeStruct leaves) gives the shapes, dtypes
  and structure of the compressed variables, so an orbax checkpoint of them restores into it."""
  x, sparse, sparse_vars = net
  _, small_vars = jaxsparse.compress_linen(sparse, sparse_vars)
  abstract = jax.eval_shape(sparse.init, jax.random.key(0), x)
  _, target = jaxsparse.compress_linen(sparse, abstract)
  assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(target))
  assert jax.tree.map(lambda a: (a.shape, a.dtype), target) == jax.tree.map(lambda a: (a.shape, a.dtype), small_vars)
  assert jax.tree.structure(target) == jax.tree.structure(small_vars)
