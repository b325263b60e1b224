"""Orbax round trips of sparse NNX models and Linen variables (patterns included) through the standard idioms:
a concrete target, an abstract target (``nnx.eval_shape`` / ``jax.eval_shape``) and a sharded abstract target;
and initialisation under ``jit`` with ``out_shardings``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxsparse
from jaxsparse import torch_interop
from tests.test_abstract_init import ABSTRACT_RULES
from tests.test_abstract_init import LINEN_LAYERS
from tests.test_abstract_init import NNX_LAYERS
from tests.test_abstract_init import _AbstractNet


def _save(path, tree):
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.fspath(path), tree)
  checkpointer.wait_until_finished()


def _assert_same_leaves(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb) > 0
  for x, y in zip(la, lb, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# long: only one layer of each kind in the fast set (make test <= 15 min on 2 cores); CI runs the others.
_NNX_FAST = ("block_sparse", "masked", "nm", "compressed_nm")


@pytest.mark.parametrize(
    "name", [n if n in _NNX_FAST else pytest.param(n, marks=pytest.mark.slow) for n in NNX_LAYERS])
def test_nnx_round_trip_concrete_and_abstract_targets(name, tmp_path):
  build, x_shape = NNX_LAYERS[name]
  x = jax.random.normal(jax.random.key(1), x_shape)
  model = build(nnx.Rngs(7))
  _save(tmp_path / "state", nnx.state(model))
  checkpointer = ocp.StandardCheckpointer()

  # Concrete target: a layer built with another seed (another pattern) takes the saved one.
  other = build(nnx.Rngs(8))
  assert not np.array_equal(other(x), model(x))
  nnx.update(other, checkpointer.restore(tmp_path / "state", nnx.state(other)))
  np.testing.assert_array_equal(other(x), model(x))

  # Abstract target: nothing is allocated before the restore.
  graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: build(nnx.Rngs(0))))
  restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "state", abstract_state))
  _assert_same_leaves(nnx.state(restored), nnx.state(model))
  np.testing.assert_array_equal(restored(x), model(x))


@pytest.mark.parametrize("name", LINEN_LAYERS)
def test_linen_round_trip_concrete_and_abstract_targets(name, tmp_path):
  model, x_shape = LINEN_LAYERS[name]
  x = jax.random.normal(jax.random.key(1), x_shape)
  variables = model.init(jax.random.key(7), x)
  _save(tmp_path / "variables", variables)
  checkpointer = ocp.StandardCheckpointer()
  concrete = checkpointer.restore(tmp_path / "variables", model.init(jax.random.key(8), x))
  abstract = checkpointer.restore(tmp_path / "variables", jax.eval_shape(model.init, jax.random.key(0), x))
  for restored in (concrete, abstract):
    assert set(restored) == set(variables)
    _assert_same_leaves(restored, variables)
    np.testing.assert_array_equal(model.apply(restored, x), model.apply(variables, x))


def test_save_flax_variables_orbax_restores_into_an_abstract_linen_target(tmp_path):
  model, x_shape = LINEN_LAYERS["block_sparse"]
  x = jax.random.normal(jax.random.key(1), x_shape)
  variables = model.init(jax.random.key(7), x)
  path = torch_interop.save_flax_variables(variables, tmp_path / "ckpt", format="orbax")
  abstract = jax.eval_shape(model.init, jax.random.key(0), x)
  restored = ocp.StandardCheckpointer().restore(os.path.abspath(path), abstract)
  _assert_same_leaves(restored, variables)
  np.testing.assert_array_equal(model.apply(restored, x), model.apply(variables, x))
  _assert_same_leaves(torch_interop.load_flax_variables(path), variables)


@pytest.mark.parametrize("kind", ABSTRACT_RULES)
def test_sparse_nnx_checkpoint_restores_into_the_sparsified_abstract_model(kind, tmp_path):
  # The orbax abstract-restore workflow: sparsify the abstract dense model (nnx.eval_shape, no weights allocated), then
  # restore the concrete sparse model's checkpoint into it. Was: sparsify raised "'ShapeDtypeStruct' object is not
  # subscriptable" on the abstract model.
  rules = ABSTRACT_RULES[kind]
  ids = jax.random.randint(jax.random.key(2), (2, 6), 0, 32)
  sparse, _ = jaxsparse.sparsify(_AbstractNet(nnx.Rngs(7)), rules)
  _save(tmp_path / "state", nnx.state(sparse))
  target, _ = jaxsparse.sparsify(nnx.eval_shape(lambda: _AbstractNet(nnx.Rngs(0))), rules)
  graphdef, abstract_state = nnx.split(target)
  restored = nnx.merge(graphdef, ocp.StandardCheckpointer().restore(tmp_path / "state", abstract_state))
  assert type(restored.fc) is type(sparse.fc) and type(restored.embed) is type(sparse.embed)
  _assert_same_leaves(nnx.state(restored), nnx.state(sparse))
  np.testing.assert_array_equal(restored(ids), sparse(ids))  # the same arrays: the same outputs, bit for bit


SHARDED = textwrap.dedent(
    """
    import jax, numpy as np, orbax.checkpoint as ocp, sys
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from tests.test_abstract_init import LINEN_LAYERS, NNX_LAYERS

    assert jax.device_count() == 2, jax.devices()
    # Auto axes (jit's sharding propagation), the mode of the Flax/orbax sharded-checkpoint guides. Under
    # explicit axes, weights split over an axis that x is not split over are a known limit
    # (docs/guides/large_models.md).
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    path = sys.argv[1]

    def sharded_like(abstract):
      # Split axis 0 over the two devices where it divides, replicate elsewhere.
      def spec(a):
        s = NamedSharding(mesh, P("x") if a.ndim and a.shape[0] % 2 == 0 else P())
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
      return jax.tree.map(spec, abstract)

    def check(restored, target, saved):
      n_split = 0
      for r, t, s in zip(jax.tree.leaves(restored), jax.tree.leaves(target), jax.tree.leaves(saved), strict=True):
        assert r.sharding == t.sharding, (r.sharding, t.sharding)
        n_split += r.sharding.spec == P("x")
        np.testing.assert_array_equal(np.asarray(r), np.asarray(s))
      assert n_split > 0

    ckpt = ocp.StandardCheckpointer()
    for name, (build, x_shape) in NNX_LAYERS.items():
      model = build(nnx.Rngs(7))
      ckpt.save(f"{path}/nnx_{name}", nnx.state(model))
      ckpt.wait_until_finished()
      graphdef, abstract = nnx.split(nnx.eval_shape(lambda: build(nnx.Rngs(0))))
      target = sharded_like(abstract)
      state = ckpt.restore(f"{path}/nnx_{name}", target)
      check(state, target, nnx.state(model))
      x = jax.random.normal(jax.random.key(1), x_shape)
      # A product over sharded weights may sum in another order: equal up to float rounding.
      np.testing.assert_allclose(nnx.merge(graphdef, state)(x), model(x), rtol=1e-5, atol=1e-6)
      # Sharded initialisation: built under jit straight into the target shardings, equal to the eager build.
      shardings = jax.tree.map(lambda t: t.sharding, target)
      built = jax.jit(lambda: nnx.state(build(nnx.Rngs(7))), out_shardings=shardings)()
      check(built, target, nnx.state(model))
    for name, (model, x_shape) in LINEN_LAYERS.items():
      x = jax.random.normal(jax.random.key(1), x_shape)
      variables = model.init(jax.random.key(7), x)
      ckpt.save(f"{path}/linen_{name}", variables)
      ckpt.wait_until_finished()
      target = sharded_like(jax.eval_shape(model.init, jax.random.key(0), x))
      restored = ckpt.restore(f"{path}/linen_{name}", target)
      check(restored, target, variables)
      np.testing.assert_allclose(model.apply(restored, x), model.apply(variables, x), rtol=1e-5, atol=1e-6)
      shardings = jax.tree.map(lambda t: t.sharding, target)
      check(jax.jit(model.init, out_shardings=shardings)(jax.random.key(7), x), target, variables)
    print("sharded restores ok")
    """
)


@pytest.mark.slow  # ~45 s on 2 cores
def test_sharded_init_and_restore_into_sharded_abstract_targets(tmp_path):
  # Two host devices need a fresh process (the device count is fixed when JAX starts).
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
  env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
  result = subprocess.run(
      [sys.executable, "-c", SHARDED, str(tmp_path)], env=env, cwd=root, capture_output=True, text=True, timeout=600
  )
  assert result.returncode == 0, result.stderr[-4000:]
  assert "sharded restores ok" in result.stdout
