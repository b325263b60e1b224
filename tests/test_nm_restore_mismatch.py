"""A compressed N:M checkpoint restored into a layer of another n:m fails at the layer's first use.

For ``in_features=64`` the packed positions of 2:4 and 4:8 have one shape, (8, 32), uint8 words against uint16 ones;
orbax casts a saved array to the target's dtype, so the restore itself succeeds. The layers check their concrete
positions once (``jaxsparse.layers._checks.check_loaded_positions``) and name the n:m the positions fit.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxsparse
from jaxsparse import layers
from jaxsparse.layers import linen

_X = jax.random.normal(jax.random.key(1), (3, 64))
_IDS = jnp.arange(10)[None]
_MISMATCH = r"n:m=4:8; they are valid 2:4 positions"


def _linear(n, m, seed=7):
  return layers.NMLinear(64, 32, n=n, m=m, rngs=nnx.Rngs(seed)).to_compressed()


def _embed(n, m, seed=0):
  return layers.CompressedNMEmbed.from_dense(nnx.Embed(50, 32, rngs=nnx.Rngs(seed)), n=n, m=m)


def _packed(n, m, dtype, word):
  """A (64, 32) N:M matrix whose groups all keep positions 0..n-1 (``word`` their packed words): no jit, fast."""
  values = np.arange(64 * n // m * 32, dtype=np.float32).reshape(-1, 32)
  return jaxsparse.NMSparseMatrix(values, np.full((8, 32), word, dtype), shape=(64, 32), n=n, m=m)


def test_positions_of_another_nm_cast_as_orbax_does_raise():
  saved = _packed(2, 4, np.uint8, 0b0100_0100)  # two groups of (0, 1) per byte, 2 bits a position
  target = layers.CompressedNMLinear(_packed(4, 8, np.uint16, 0 | 1 << 3 | 2 << 6 | 3 << 9), cusparselt_copy=False)
  target.kernel_positions.set_value(saved.indices.astype(np.uint16))  # what orbax's restore does
  with pytest.raises(ValueError, match=r"CompressedNMLinear\.kernel_positions: .*" + _MISMATCH):
    target(_X)

@pytest.mark.slow
def test_to_dense_raises_and_jit_does_not_check():
  target = _linear(4, 8, seed=0)
  positions = nnx.state(_linear(2, 4))["kernel_positions"][...].astype(jnp.uint16)
  target.kernel_positions.set_value(positions)
  with pytest.raises(ValueError, match=_MISMATCH):
    target.to_dense()
  # Under jit the positions are traced: not checked (documented in docs/guides/large_models.md).
  assert nnx.jit(lambda layer, x: layer(x))(target, _X).shape == (3, 32)


def _save(path, tree):
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.fspath(path), tree)
  checkpointer.wait_until_finished()


def _restore(path, target):
  return ocp.StandardCheckpointer().restore(os.fspath(path), target)


@pytest.mark.slow
@pytest.mark.parametrize("make, inputs, name", [(_linear, _X, "CompressedNMLinear.kernel_positions"),
                                                (_embed, _IDS, "CompressedNMEmbed.embedding_positions")])
def test_nnx_orbax_restore(tmp_path, make, inputs, name):
  saved = make(2, 4)
  _save(tmp_path / "ckpt", nnx.state(saved))
  for n, m in [(2, 4), (4, 8)]:
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda n=n, m=m: make(n, m, seed=3)))
    restored = nnx.merge(graphdef, _restore(tmp_path / "ckpt", abstract))
    if (n, m) == (2, 4):
      np.testing.assert_array_equal(restored(inputs), saved(inputs))
    else:
      with pytest.raises(ValueError, match=rf"{name}: .*{_MISMATCH}"):
        restored(inputs)
    # The nnx.update idiom into a built layer, too.
    built = make(n, m, seed=3)
    nnx.update(built, _restore(tmp_path / "ckpt", nnx.state(nnx.eval_shape(lambda n=n, m=m: make(n, m, seed=3)))))
    if (n, m) == (2, 4):
      np.testing.assert_array_equal(built(inputs), saved(inputs))
    else:
      with pytest.raises(ValueError, match=_MISMATCH):
        built(inputs)


@pytest.mark.slow
@pytest.mark.parametrize("make, inputs, name", [
    (lambda **nm: linen.CompressedNMDense(32, **nm), _X, r"linen\.CompressedNMDense \(sparsity 'kernel_positions'\)"),
    (lambda **nm: linen.CompressedNMEmbed(50, 32, **nm), _IDS,
     r"linen\.CompressedNMEmbed \(sparsity 'embedding_positions'\)"),
])
def test_linen_orbax_restore(tmp_path, make, inputs, name):
  saved = make()  # 2:4, the default
  variables = saved.init(jax.random.key(7), inputs)
  _save(tmp_path / "ckpt", variables)
  for n, m in [(2, 4), (4, 8)]:
    module = make(n=n, m=m)
    restored = _restore(tmp_path / "ckpt", jax.eval_shape(module.init, jax.random.key(0), inputs))
    if (n, m) == (2, 4):
      np.testing.assert_array_equal(module.apply(restored, inputs), saved.apply(variables, inputs))
    else:
      with pytest.raises(ValueError, match=rf"{name}: .*{_MISMATCH}"):
        module.apply(restored, inputs)


@pytest.mark.slow
def test_valid_positions_are_checked_once(monkeypatch):
  layer = _linear(2, 4)
  layer(_X)
  calls = []
  validate = type(layer.weight).validate
  monkeypatch.setattr(type(layer.weight), "validate", lambda w: calls.append(1) or validate(w))
  layer(_X)
  layer.to_dense()
  assert not calls  # the same positions array: remembered
  layer.kernel_positions.set_value(layer.kernel_positions[...] + 0)  # a new array (a restore): checked again
  layer(_X)
  assert len(calls) == 1
