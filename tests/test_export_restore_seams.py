"""Seams of every layer kind: ``jax.export`` serialised and called back, and orbax restores into abstract targets (after
pruning, with a sharding, and with a target whose kept-block count differs from the checkpoint's)."""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsparse
from jaxsparse import layers
from jaxsparse.layers import linen

# Exported.serialize needs flatbuffers (jax's optional dependency): the export tests skip without it.
needs_flatbuffers = pytest.mark.skipif(importlib.util.find_spec("flatbuffers") is None,
                                       reason="Exported.serialize needs the flatbuffers package")

CHECKS = jaxsparse.ops.export_safety_checks()


def _round_trip(f, *args):
  """``f`` exported for ``args`` (arrays or ``ShapeDtypeStruct``s), serialised and deserialised."""
  return jax.export.deserialize(jax.export.export(f, disabled_checks=CHECKS)(*args).serialize())


def _symbolic(spec: str, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(jax.export.symbolic_shape(spec), dtype)


def _assert_close(got, want, atol=1e-5):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=atol)


@needs_flatbuffers
@pytest.mark.slow  # ~3 s on 2 cores
def test_serialized_export_takes_the_sparse_formats_as_arguments():
  # Was: "Cannot serialize PyTreeDef containing an unregistered type <class '...BlockSparseMatrix'>" (and the same for
  # NMSparseMatrix / CSRMatrix): a serving function taking its weights as arguments could not be serialised.
  dense = jnp.where(jax.random.uniform(jax.random.key(0), (64, 32)) < 0.4, 1.5, 0.0)
  weights = {"block": jaxsparse.BlockSparseMatrix.from_dense(dense, (16, 16)),
             "nm": jaxsparse.NMSparseMatrix.from_dense(dense, 2, 4), "csr": jaxsparse.CSRMatrix.from_dense(dense)}
  f = jax.jit(lambda x, w: (jaxsparse.ops.block_sparse_matmul(x, w["block"]), jaxsparse.ops.nm_matmul(x, w["nm"]),
                            jaxsparse.ops.sparse_matmul(x, w["csr"]), w))
  x = jax.random.normal(jax.random.key(1), (4, 64))
  exported = _round_trip(f, x, weights)
  got, want = exported.call(x, weights), f(x, weights)
  assert jax.tree.structure(got) == jax.tree.structure(want)  # the matrices come back as results too
  _assert_close(got, want)


# NNX layers of every kind, with options the other export tests leave out (transposable SR-STE, grouped strided and
# 1-D / 3-D convs, inputs of rank 3, LinearGeneral over N:M and masked layers), and a symbolic batch (and length).
NNX_KINDS = {
    "nm_transposable": (lambda r: layers.NMLinear(64, 32, transposable=True, rngs=r), "b, t, 64"),
    "nm_conv_grouped": (lambda r: layers.NMConv(8, 16, (3, 3), n=1, m=4, feature_group_count=2, strides=2, rngs=r),
                        "b, 6, 6, 8"),
    "nm_conv_1d": (lambda r: layers.NMConv(8, 16, (3,), rngs=r), "b, t, 8"),
    "masked_conv_3d": (lambda r: layers.MaskedConv(4, 8, (3, 3, 3), sparsity=0.5, rngs=r), "b, 4, 4, 4, 4"),
    "block": (lambda r: layers.BlockSparseLinear(64, 96, density=0.5, block_shape=(16, 32), rngs=r), "b, t, 64"),
    "masked": (lambda r: layers.MaskedLinear(64, 48, sparsity=0.75, rngs=r), "b, t, 64"),
    "compressed_nm": (lambda r: layers.NMLinear(64, 32, rngs=r).to_compressed(), "b, t, 64"),
    "general_nm": (lambda r: layers.SparseLinearGeneral(layers.NMLinear(32, 64, rngs=r), in_features=(32,),
                                                        out_features=(4, 16)), "b, 32"),
    "general_masked": (lambda r: layers.SparseLinearGeneral(layers.MaskedLinear(32, 64, sparsity=0.5, rngs=r),
                                                            in_features=(32,), out_features=(4, 16)), "b, 32"),
}


@needs_flatbuffers
@pytest.mark.slow  # ~20 s on 2 cores: two exports of a train step per kind
@pytest.mark.parametrize("name", sorted(NNX_KINDS))
def test_serialized_train_step_of_each_nnx_kind(name):
  build, spec = NNX_KINDS[name]
  graphdef, params, rest = nnx.split(build(nnx.Rngs(0)), nnx.Param, ...)
  pure = nnx.to_pure_dict(params)  # nnx.State has no export serialization (Flax's, for dense layers too)

  def loss(x, p):
    state = jax.tree.map(lambda a: a, params)
    nnx.replace_by_pure_dict(state, p)
    return jnp.sum(nnx.merge(graphdef, state, rest)(x) ** 2)

  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  concrete = tuple(3 if d == "b" else 5 if d == "t" else int(d) for d in spec.split(", "))
  x = jax.random.normal(jax.random.key(1), concrete)
  for arg in (x, _symbolic(spec)):
    _assert_close(_round_trip(f, arg, pure).call(x, pure), f(x, pure), atol=1e-4)


@needs_flatbuffers
@pytest.mark.slow  # ~8 s on 2 cores
def test_serialized_train_step_of_the_linen_kinds_left_out_elsewhere():
  ids = jax.random.randint(jax.random.key(1), (3, 7), 0, 50)
  x = jax.random.normal(jax.random.key(1), (3, 64))
  for module, inp, spec in [(linen.CompressedNMDense(32), x, _symbolic("b, 64")),
                            (linen.CompressedNMEmbed(50, 32), ids, _symbolic("b, 7", jnp.int32)),
                            (linen.NMDense(32, transposable=True), x, _symbolic("b, 64"))]:
    variables = module.init(jax.random.key(0), inp)
    f = jax.jit(jax.grad(lambda p, i, v=variables, m=module: jnp.sum(m.apply({**v, "params": p}, i) ** 2)))
    params = variables["params"]
    for arg in (inp, spec):
      _assert_close(_round_trip(f, params, arg).call(params, inp), f(params, inp))


def _save(path, tree):
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.fspath(path), tree)
  checkpointer.wait_until_finished()


@pytest.mark.slow  # ~4 s on 2 cores
def test_pruned_masks_restore_into_an_abstract_sharded_target(tmp_path):
  # Masks changed after the build (pruning) are state: they restore from the checkpoint, not from the target's build.
  model = layers.MaskedLinear(64, 48, sparsity=0.5, rngs=nnx.Rngs(7))
  model.mask[...] = jaxsparse.magnitude_mask(model.kernel[...], 0.9)
  x = jax.random.normal(jax.random.key(1), (3, 64))
  _save(tmp_path / "state", nnx.state(model))
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: layers.MaskedLinear(64, 48, sparsity=0.5, rngs=nnx.Rngs(0))))
  for target in (abstract, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                      sharding=NamedSharding(mesh, P())), abstract)):
    restored = nnx.merge(graphdef, ocp.StandardCheckpointer().restore(tmp_path / "state", target))
    np.testing.assert_array_equal(restored.mask[...], model.mask[...])
    np.testing.assert_array_equal(restored(x), model(x))


@pytest.mark.slow  # ~3 s on 2 cores
def test_a_target_keeping_another_block_count_is_refused(tmp_path):
  # The kept-block count fixes the kernel's and index arrays' shapes: orbax refuses a target built with another density
  # (NNX and Linen) instead of truncating or padding.
  x = jax.random.normal(jax.random.key(1), (3, 64))
  build = lambda density: layers.BlockSparseLinear(64, 96, density=density, block_shape=(16, 32), rngs=nnx.Rngs(0))
  _save(tmp_path / "nnx", nnx.state(build(0.5)))
  module = lambda density: linen.BlockSparseDense(96, density=density, block_shape=(16, 32))
  _save(tmp_path / "linen", module(0.5).init(jax.random.key(0), x))
  for density in (0.25, 0.75):
    with pytest.raises(ValueError, match="is not compatible with the stored shape"):
      ocp.StandardCheckpointer().restore(tmp_path / "nnx", nnx.state(nnx.eval_shape(lambda d=density: build(d))))
    with pytest.raises(ValueError, match="is not compatible with the stored shape"):
      ocp.StandardCheckpointer().restore(tmp_path / "linen",
                                         jax.eval_shape(module(density).init, jax.random.key(0), x))



