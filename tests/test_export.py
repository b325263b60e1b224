"""``jax.export`` of functions that call jaxsparse's kernels (``jaxsparse.ops.export_safety_checks``)."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsparse
from jaxsparse._cpu import _build as cpu_build
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import MaskedLinear
from tests._util import rel_err
from tests.test_abstract_init import LINEN_LAYERS
from tests.test_abstract_init import NNX_LAYERS


def _layers():
  rngs = nnx.Rngs(0)
  return {
      "block": BlockSparseLinear(64, 48, block_shape=(16, 16), density=0.5, rngs=rngs),
      "masked": MaskedLinear(64, 48, sparsity=0.7, rngs=rngs),
  }


@pytest.mark.parametrize("kind", ["block", "masked", "csr"])
def test_export_with_the_safety_checks_runs_the_same_forward_and_gradient(kind):
  x = jax.random.normal(jax.random.key(1), (5, 64))
  if kind == "csr":
    w = jaxsparse.CSRMatrix.from_dense(jnp.where(jax.random.uniform(jax.random.key(2), (64, 48)) < 0.3, 1.5, 0.0))
    loss = lambda x, data: jnp.sum(jaxsparse.ops.sparse_matmul(x, w.with_data(data)) ** 2)
    args = (x, w.data)
  else:
    graphdef, params, rest = nnx.split(_layers()[kind], nnx.Param, ...)
    loss = lambda x, params: jnp.sum(nnx.merge(graphdef, params, rest)(x) ** 2)
    args = (x, params)
  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  if jax.default_backend() == "cpu" and cpu_build.load():  # the C++ kernels' custom calls: refused by default
    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility guarantees"):
      jax.export.export(f)(*args)
  exported = jax.export.export(f, disabled_checks=jaxsparse.ops.export_safety_checks())(*args)
  got, want = exported.call(*args), f(*args)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


_DESERIALIZE = """
import sys, jax, jax.numpy as jnp, jaxsparse
exported = jax.export.deserialize(open(sys.argv[1], "rb").read())
try:
  exported.call(jnp.ones((2, 64)))
except Exception as e:
  print("unregistered:", type(e).__name__, str(e).splitlines()[0])
jaxsparse.ops.export_safety_checks()  # the guide's recipe (docs/guides/large_models.md, `jax.export`)
print("registered:", float(exported.call(jnp.ones((2, 64))).sum()))
"""


@pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_build.load(), reason="the C++ CPU kernels' FFI targets")
def test_a_fresh_process_calls_a_deserialized_export_after_export_safety_checks(tmp_path):
  # A process that only deserializes has no FFI handler for the kernels' custom calls (the audit's NOT_FOUND); the
  # guide says to call export_safety_checks first, which registers them.
  w = jaxsparse.BlockSparseMatrix.from_dense(jnp.ones((64, 32)), (16, 16))
  f = jax.jit(lambda x: jaxsparse.ops.block_sparse_matmul(x, w))
  blob = jax.export.export(f, disabled_checks=jaxsparse.ops.export_safety_checks())(jnp.ones((2, 64))).serialize()
  (tmp_path / "f.exp").write_bytes(blob)
  out = subprocess.run([sys.executable, "-c", _DESERIALIZE, str(tmp_path / "f.exp")], capture_output=True, text=True,
                       timeout=300, check=True).stdout
  assert "unregistered: JaxRuntimeError NOT_FOUND: No FFI handler registered for jaxsparse_block_forward" in out, out
  assert f"registered: {2 * 64 * 32 * 1.0:.1f}" in out, out


def test_the_checks_name_every_kernel_target():
  names = {str(c) for c in jaxsparse.ops.export_safety_checks()}
  for target in ("jaxsparse_block_forward", "jaxsparse_csr_backward", "jaxsparse_nm24_decode",
                 "jaxsparse_cusparselt_matmul", "__gpu$xla.gpu.triton"):
    assert any(target in n for n in names), target


@pytest.mark.parametrize("name", ["nm", "nm_conv", "masked_conv", "compressed_nm",
                                  pytest.param("compressed_nm_buffer", marks=pytest.mark.slow),  # long: CI runs it
                                  "linear_general"])
def test_export_of_each_nnx_layer_kind_runs_the_same_forward_and_gradient(name):
  # The kinds the test above leaves out (the SR-STE, convolution, compressed, buffer and LinearGeneral routes), from
  # the builders the checkpoint and abstract-init tests use.
  build, x_shape = NNX_LAYERS[name]
  layer = build(nnx.Rngs(0))
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  dtype = getattr(layer, "kernel_dtype", jnp.float32)
  x = jax.random.normal(jax.random.key(1), x_shape).astype(dtype)
  loss = lambda x, params: jnp.sum(nnx.merge(graphdef, params, rest)(x).astype(jnp.float32) ** 2)
  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  exported = jax.export.export(f, disabled_checks=jaxsparse.ops.export_safety_checks())(x, params)
  got, want = exported.call(x, params), f(x, params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-6)


# The symbolic exports run the XLA routes, the jitted references the kernels: on a GPU, float32 products at jax's
# default precision round in TF32 (10-bit mantissa), each route differently.
SYMBOLIC_TOL = 2e-5 if jax.default_backend() == "cpu" else 5e-3


def _close(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert rel_err(a, b) <= SYMBOLIC_TOL, (rel_err(a, b), SYMBOLIC_TOL)


def _symbolic(shape, dtype):
  """A ``ShapeDtypeStruct`` of ``shape`` with its leading dim the symbol ``b``."""
  return jax.ShapeDtypeStruct(jax.export.symbolic_shape(", ".join(["b", *map(str, shape[1:])])), dtype)


@pytest.mark.parametrize("name", sorted(NNX_LAYERS))
def test_export_with_a_symbolic_batch_runs_every_layer_kind(name):
  # Shape polymorphism (a serving batch of any size): the row-count rules and tuning keys compared a symbolic
  # dimension ("'b' <= '16' is inconclusive"); such products now take the XLA routes, which run any row count.
  build, x_shape = NNX_LAYERS[name]
  layer = build(nnx.Rngs(0))
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  dtype = getattr(layer, "kernel_dtype", jnp.float32)
  loss = lambda x, params: jnp.sum(nnx.merge(graphdef, params, rest)(x).astype(jnp.float32) ** 2)
  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  exported = jax.export.export(f, platforms=["cpu", "cuda"])(_symbolic(x_shape, dtype), params)
  for batch in (1, 5):
    x = jax.random.normal(jax.random.key(batch), (batch, *x_shape[1:])).astype(dtype)
    _close(exported.call(x, params), f(x, params))


@pytest.mark.parametrize("name", sorted(LINEN_LAYERS))
def test_export_with_a_symbolic_batch_runs_every_linen_layer_kind(name):
  module, x_shape = LINEN_LAYERS[name]
  variables = module.init(jax.random.key(0), jnp.ones(x_shape))
  loss = lambda x, params: jnp.sum(module.apply({**variables, "params": params}, x) ** 2)
  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  params = variables["params"]
  exported = jax.export.export(f, platforms=["cpu", "cuda"])(_symbolic(x_shape, jnp.float32), params)
  for batch in (1, 4):
    x = jax.random.normal(jax.random.key(batch), (batch, *x_shape[1:]))
    _close(exported.call(x, params), f(x, params))


def test_export_with_a_symbolic_batch_runs_the_sparse_embedding():
  # The lookup built an NMSparseMatrix of the ids' shape, which must be ints ("b is not an integer").
  emb = jaxsparse.layers.CompressedNMEmbed.from_dense(nnx.Embed(50, 32, rngs=nnx.Rngs(0)), n=2, m=4)
  graphdef, params, rest = nnx.split(emb, nnx.Param, ...)
  lookup = jax.jit(lambda ids, p: nnx.merge(graphdef, p, rest)(ids))
  attend = jax.jit(lambda q, p: nnx.merge(graphdef, p, rest).attend(q))
  exported_lookup = jax.export.export(lookup, platforms=["cpu", "cuda"])(_symbolic((1, 7), jnp.int32), params)
  exported_attend = jax.export.export(attend, platforms=["cpu", "cuda"])(_symbolic((1, 32), jnp.float32), params)
  for batch in (1, 3):
    ids = jax.random.randint(jax.random.key(batch), (batch, 7), -50, 50)
    np.testing.assert_array_equal(exported_lookup.call(ids, params), lookup(ids, params))
    q = jax.random.normal(jax.random.key(batch), (batch, 32))
    _close(exported_attend.call(q, params), attend(q, params))
