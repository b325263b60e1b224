"""A compressed N:M checkpoint restored into a layer of another n:m raises where it is restored, not under ``jit``.

For ``in_features=64`` the packed positions of 2:4 and 4:8 have one shape, (8, 32), uint8 words against uint16 ones;
orbax casts a saved array to the target's dtype, so the restore itself succeeds. 1:8 and 2:16 share the dtype too
(uint8, (4, 32)). NNX: the positions' ``SparsityPattern`` carries the layer's layout (``nm_layout``), checked where
``nnx.merge``, ``nnx.update`` or ``set_value`` set concrete positions (``jaxsparse.layers._checks.check_positions``),
so a model restored and then only called under ``nnx.jit`` raises at the restore. Linen: ``linen.check_restored``,
and each layer's first call outside ``jit`` (``check_loaded_positions``). The messages name the n:m the positions fit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxsparse
from jaxsparse import layers
from jaxsparse.layers import _checks
from jaxsparse.layers import linen

_X = jax.random.normal(jax.random.key(1), (3, 64))
_IDS = jnp.arange(10)[None]
_MISMATCH = r"n:m=4:8; they are valid 2:4 positions"


def _linear(n, m, seed=7):
  return layers.NMLinear(64, 32, n=n, m=m, rngs=nnx.Rngs(seed)).to_compressed(cusparselt_copy=False)


def _embed(n, m, seed=0):
  return layers.CompressedNMEmbed.from_dense(nnx.Embed(50, 32, rngs=nnx.Rngs(seed)), n=n, m=m)


def _packed(n, m, dtype, word, rows=8):
  """A (64, 32) N:M matrix whose packed words are all ``word`` (no jit, fast)."""
  values = np.arange(64 * n // m * 32, dtype=np.float32).reshape(-1, 32)
  return jaxsparse.NMSparseMatrix(values, np.full((rows, 32), word, dtype), shape=(64, 32), n=n, m=m)


# Two groups of (0, 1) per byte (2 bits a position) as 2:4; as 4:8 words (cast to uint16), (4, 0, 1, 0): invalid.
_24 = (2, 4, np.uint8, 0b0100_0100, 8)
_48 = (4, 8, np.uint16, 0 | 1 << 3 | 2 << 6 | 3 << 9, 8)
# Two groups of (1,) and (2,) per byte (3 bits a position) as 1:8; as 2:16 words (4 bits a position), (1, 1): invalid.
_18 = (1, 8, np.uint8, 1 | 2 << 3, 4)
_216 = (2, 16, np.uint8, 0 | 1 << 4, 4)


def _uint(dtype):
  return lambda tree: jax.tree.map(lambda a: a.astype(dtype) if a.dtype == jnp.uint8 else a, tree)


@pytest.mark.parametrize("saved, target, fits", [(_24, _48, "2:4"), (_18, _216, "1:8")])
def test_set_value_of_another_nm_raises_and_keeps_the_positions(saved, target, fits):
  saved, target = _packed(*saved), _packed(*target)
  layer = layers.CompressedNMLinear(target, cusparselt_copy=False)
  before = layer.kernel_positions.get_raw_value()
  cast = saved.indices.astype(target.indices.dtype)  # what orbax's restore does
  name = r"CompressedNMLinear\.kernel_positions: "
  with pytest.raises(ValueError, match=name + rf"its packed positions are not valid for its n:m={target.n}:"
                                     rf"{target.m}; they are valid {fits} positions"):
    layer.kernel_positions.set_value(cast)
  with pytest.raises(ValueError, match=name):
    layer.kernel_positions[...] = cast
  assert layer.kernel_positions.get_raw_value() is before
  layer.kernel_positions.set_value(target.indices + 0)  # valid positions (a new array) are taken
  np.testing.assert_array_equal(layer(_X), _X @ target.to_dense())


def test_zero_positions_are_named_as_never_loaded():
  layer = layers.CompressedNMLinear(_packed(*_24), cusparselt_copy=False)
  with pytest.raises(ValueError, match="every word is zero: positions never loaded"):
    layer.kernel_positions.set_value(jnp.zeros((8, 32), jnp.uint8))


def test_positions_given_as_an_unchecked_matrix_raise_at_first_use():
  saved = _packed(*_24)
  w = jaxsparse.NMSparseMatrix(_packed(*_48).values, saved.indices.astype(np.uint16), shape=(64, 32), n=4, m=8,
                               validate=False)
  layer = layers.CompressedNMLinear(w, cusparselt_copy=False)  # built from the matrix: no restore checked it
  with pytest.raises(ValueError, match=r"CompressedNMLinear\.kernel_positions: .*" + _MISMATCH):
    layer(_X)
  with pytest.raises(ValueError, match=_MISMATCH):
    layer.to_dense()
  # Under jit the positions are traced: not checked (a restore checks them: the tests below).
  assert nnx.jit(lambda layer, x: layer(x))(layer, _X).shape == (3, 32)


def _save(path, tree):
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.fspath(path), tree)
  checkpointer.wait_until_finished()


def _restore(path, target):
  return ocp.StandardCheckpointer().restore(os.fspath(path), target)


@pytest.fixture
def device_checks(monkeypatch):
  """The positions arrays checked on their device (one ``_all_valid`` each) while the test runs."""
  calls = []
  check = _checks._all_valid
  monkeypatch.setattr(_checks, "_all_valid", lambda words, **kw: calls.append(words.shape) or check(words, **kw))
  return calls


@pytest.mark.parametrize("make, inputs, name, nms", [
    (_linear, _X, "CompressedNMLinear.kernel_positions", [(2, 4), (4, 8)]),
    (_embed, _IDS, "CompressedNMEmbed.embedding_positions", [(2, 4), (4, 8)]),
    (_linear, _X, "CompressedNMLinear.kernel_positions", [(1, 8), (2, 16)]),
])
def test_nnx_orbax_restore_raises_before_jit(tmp_path, make, inputs, name, nms, device_checks):
  (n, m), (other_n, other_m) = nms
  saved = make(n, m)
  _save(tmp_path / "ckpt", nnx.state(saved))
  want = saved(inputs)
  jitted = nnx.jit(lambda layer, x: layer(x))
  mismatch = rf"{name}: .*n:m={other_n}:{other_m}; they are valid {n}:{m} positions"
  abstract = lambda n, m: nnx.eval_shape(lambda: make(n, m, seed=3))
  # The documented restores: into an abstract target and nnx.merge; into a built model's state (concrete) or an
  # abstract one, and nnx.update.
  graphdef, state = nnx.split(abstract(other_n, other_m))
  restored = _restore(tmp_path / "ckpt", state)
  with pytest.raises(ValueError, match=mismatch):
    nnx.merge(graphdef, restored)
  for target in (lambda: nnx.state(make(other_n, other_m, seed=3)), lambda: nnx.state(abstract(other_n, other_m))):
    built = make(other_n, other_m, seed=3)
    with pytest.raises(ValueError, match=mismatch):
      nnx.update(built, _restore(tmp_path / "ckpt", target()))
  # A checkpoint of the layer's own n:m restores as before, and runs under jit with no check per call.
  graphdef, state = nnx.split(abstract(n, m))
  model = nnx.merge(graphdef, _restore(tmp_path / "ckpt", state))
  built = make(n, m, seed=3)
  nnx.update(built, _restore(tmp_path / "ckpt", nnx.state(built)))
  positions = built.kernel_positions if hasattr(built, "kernel_positions") else built.embedding_positions
  assert positions.get_metadata("nm_layout") == built._positions_layout()  # the layout stays with the layer
  for layer in (model, built):
    device_checks.clear()
    for _ in range(3):
      np.testing.assert_array_equal(jitted(layer, inputs), want)
    assert not device_checks
  np.testing.assert_array_equal(model(inputs), want)  # eagerly too


def test_jit_and_transforms_check_nothing_per_call(device_checks):
  layer = _linear(2, 4)
  graphdef, state = nnx.split(layer)
  step = jax.jit(lambda state, x: (nnx.merge(graphdef, state)(x), nnx.state(nnx.merge(graphdef, state))))
  scan = lambda layer: nnx.scan(lambda layer, c: (c, layer(_X)), in_axes=(None, nnx.Carry), length=2)(layer, 0.0)
  grad = lambda layer: nnx.grad(lambda layer: layer(_X).sum())(layer)
  device_checks.clear()
  for _ in range(3):  # each call returns new arrays: the positions are not read again
    _, state = step(state, _X)
    nnx.jit(lambda layer, x: layer(x))(layer, _X)
    nnx.jit(lambda layer: (scan(layer), grad(layer)))(layer)
  assert not device_checks
  # Eager transforms (no jit) see the positions they are given: checked once, when new (here: after the jit calls).
  for _ in range(3):
    scan(layer)
    grad(layer)
  assert len(device_checks) <= 1


def _stack(n, m, seed=0):
  @nnx.split_rngs(splits=3)
  @nnx.vmap(in_axes=0, out_axes=0)
  def build(rngs):
    return layers.NMLinear(64, 64, n=n, m=m, rngs=rngs).to_compressed(cusparselt_copy=False)

  return build(nnx.Rngs(seed))


def _run_stack(stack, x):
  return nnx.scan(lambda h, layer: (layer(h), None), in_axes=(nnx.Carry, 0))(x, stack)[0]


def test_vmap_stack_restore(tmp_path, device_checks):
  saved = _stack(2, 4)
  assert saved.kernel_positions.shape == (3, 8, 64)
  _save(tmp_path / "ckpt", nnx.state(saved))
  graphdef, state = nnx.split(nnx.eval_shape(lambda: _stack(4, 8, seed=3)))
  with pytest.raises(ValueError, match=r"kernel_positions: .*n:m=4:8 \(a stack of layers: the positions \(3, 8, 64\) "
                                       r"have 1 leading layer axis/axes\); they are valid 2:4 positions"):
    nnx.merge(graphdef, _restore(tmp_path / "ckpt", state))
  graphdef, state = nnx.split(nnx.eval_shape(lambda: _stack(2, 4, seed=3)))
  stack = nnx.merge(graphdef, _restore(tmp_path / "ckpt", state))
  x = jax.random.normal(jax.random.key(1), (3, 64))
  run = nnx.jit(_run_stack)
  device_checks.clear()
  for _ in range(2):
    np.testing.assert_allclose(run(stack, x), _run_stack(saved, x), rtol=1e-6, atol=1e-6)
  assert not device_checks


def test_valid_positions_are_checked_once(device_checks):
  layer = _linear(2, 4)
  layer(_X)
  layer(_X)
  layer.to_dense()
  assert len(device_checks) == 1  # the same positions array: remembered
  layer.kernel_positions.set_value(layer.kernel_positions[...] + 0)  # a new array (a restore): checked again
  layer(_X)
  assert len(device_checks) == 2


class _Block(nn.Module):
  n: int
  m: int

  @nn.compact
  def __call__(self, h, _):
    return linen.CompressedNMDense(64, n=self.n, m=self.m, name="dense")(h), None


class _Model(nn.Module):
  """A stack of three CompressedNMDense (nn.scan) and a CompressedNMEmbed."""

  n: int = 2
  m: int = 4

  @nn.compact
  def __call__(self, x):
    blocks = nn.scan(_Block, variable_axes={"params": 0, "sparsity": 0}, split_rngs={"params": True}, length=3)
    h, _ = blocks(self.n, self.m, name="blocks")(x, None)
    return h + linen.CompressedNMEmbed(10, 64, n=self.n, m=self.m, name="embed")(jnp.zeros(x.shape[:-1], int))


@pytest.mark.parametrize("make, inputs, name", [
    (lambda **nm: linen.CompressedNMDense(32, **nm), _X, r"linen\.CompressedNMDense \(sparsity 'kernel_positions'\)"),
    (lambda **nm: linen.CompressedNMEmbed(50, 32, **nm), _IDS,
     r"linen\.CompressedNMEmbed \(sparsity 'embedding_positions'\)"),
    (lambda **nm: _Model(**nm), _X,
     r"linen\.CompressedNMEmbed 'embed' \(sparsity 'embedding_positions'\)"),
])
def test_linen_orbax_restore(tmp_path, make, inputs, name):
  saved = make()  # 2:4, the default
  variables = saved.init(jax.random.key(7), inputs)
  _save(tmp_path / "ckpt", variables)
  module = make(n=4, m=8)
  restored = _restore(tmp_path / "ckpt", jax.eval_shape(module.init, jax.random.key(0), inputs))
  with pytest.raises(ValueError, match=rf"{name}: .*{_MISMATCH}"):
    linen.check_restored(module, restored, inputs)
  with pytest.raises(ValueError, match=rf"{name}: .*{_MISMATCH}"):  # each layer's first call outside jit
    module.apply(restored, inputs)
  # Under jax.jit a Linen layer reads traced positions: not checked (docs/guides/large_models.md).
  assert jax.jit(module.apply)(restored, inputs).shape == saved.apply(variables, inputs).shape
  module = make()
  restored = _restore(tmp_path / "ckpt", jax.eval_shape(module.init, jax.random.key(0), inputs))
  assert linen.check_restored(module, restored, jax.ShapeDtypeStruct(inputs.shape, inputs.dtype)) is restored
  np.testing.assert_array_equal(jax.jit(module.apply)(restored, inputs), saved.apply(variables, inputs))


def test_linen_check_restored_finds_a_stack_by_its_path():
  variables = _Model().init(jax.random.key(7), _X)
  cast = _uint(jnp.uint16)(variables)
  valid_embed = _Model(n=4, m=8).init(jax.random.key(7), _X)
  cast["params"]["embed"], cast["sparsity"]["embed"] = valid_embed["params"]["embed"], valid_embed["sparsity"]["embed"]
  # Inside nn.scan the stacked positions are traced: only check_restored, by their path, sees them.
  with pytest.raises(ValueError, match=r"linen\.CompressedNMDense 'blocks/dense' \(sparsity 'kernel_positions'\): "
                                       r".*n:m=4:8 \(a stack of layers.*they are valid 2:4 positions"):
    linen.check_restored(_Model(n=4, m=8), cast, _X)
  assert _Model(n=4, m=8).apply(cast, _X).shape == (3, 64)  # the first calls do not see them


_SHARDED = textwrap.dedent(
    """
    import jax, numpy as np, orbax.checkpoint as ocp, sys
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxsparse import layers

    assert jax.device_count() == 2, jax.devices()
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    make = lambda n, m, seed: layers.NMLinear(64, 32, n=n, m=m, rngs=nnx.Rngs(seed)).to_compressed()
    saved = make(2, 4, 7)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(sys.argv[1], nnx.state(saved))
    ckpt.wait_until_finished()
    x = jax.random.normal(jax.random.key(1), (4, 64))
    for n, m in [(2, 4), (4, 8)]:
      graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make(n, m, 0)))
      split = lambda a: NamedSharding(mesh, P(None, "x") if a.ndim == 2 else P())  # the outputs over the devices
      target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=split(a)), abstract)
      state = ckpt.restore(sys.argv[1], target)
      assert len(state["kernel_positions"][...].sharding.device_set) == 2
      try:
        model = nnx.merge(graphdef, state)
      except ValueError as e:
        assert (n, m) == (4, 8) and "n:m=4:8; they are valid 2:4 positions" in str(e), e
        continue
      np.testing.assert_allclose(nnx.jit(lambda layer, x: layer(x))(model, x), saved(x), rtol=1e-5, atol=1e-6)
      assert (n, m) == (2, 4)
    print("sharded restores ok")
    """
)


@pytest.mark.slow  # a 2-device subprocess
def test_sharded_restore(tmp_path):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
  env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
  result = subprocess.run([sys.executable, "-c", _SHARDED, str(tmp_path / "ckpt")], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-4000:]
  assert "sharded restores ok" in result.stdout
