"""Restore seams of the compressed N:M layers: plain-dict ``nnx.update``, Linen ``jit(apply)``, a bare ``TrainState``.

a. ``nnx.update(model, pure_dict)`` sets plain arrays through ``Variable.set_raw_value``, not ``update_from_state``:
   the positions of another n:m (same shape and dtype) were set unchecked and ``nnx.jit`` computed with a wrong
   weight; a bias of another shape broadcast silently. Arrays of another shape or dtype failed on messages that named
   no variable. Now the positions are checked at the update, and the rest statically in the call, by name.
b. Linen ``jax.jit(module.apply)(restored, x)``: shape and dtype errors are static and now name the variable; positions
   of another n:m with the target's shape and dtype (orbax's cast) cannot be seen statically (``check_restored``).
c. A ``TrainState`` over the params trains the kept values only; over every variable, ``jax.grad`` refuses the
   integer positions / buffer, and with ``allow_int`` optax refuses their float0 gradients: nothing is corrupted.
"""

from __future__ import annotations

import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import errors as flax_errors
from flax import nnx
from flax.training import train_state

import jaxsparse
from jaxsparse import layers
from jaxsparse.layers import linen
from jaxsparse.ops import _nm_matmul

# 30 tests, about 30 s on 2 cores: run by test-slow (CI runs it), so that make test stays within its 15 minutes.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

_jitted = nnx.jit(lambda layer, x: layer(x))


def _key(seed):
  return jax.random.key(seed)


def _linear(n, m, seed, *, storage="values", out=64):
  w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(_key(seed), (64, out)), n, m)
  bias = jax.random.normal(_key(seed + 100), (out,))
  return layers.CompressedNMLinear(w, bias, storage=storage, cusparselt_copy=False)


def _embed(n, m, seed):
  return layers.CompressedNMEmbed.from_dense(nnx.Embed(40, 64, rngs=nnx.Rngs(seed)), n=n, m=m)


def _x(seed, rows=3):
  return jax.random.normal(_key(seed), (rows, 64))


def _ids(seed):
  return jax.random.randint(_key(seed), (2, 5), 0, 40)


def _positions(layer):
  return layer.kernel_positions if hasattr(layer, "kernel_positions") else layer.embedding_positions


# ---------------------------------------------------------------------------------------------------------------------
# a. nnx.update with a plain dict of arrays
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, inputs, name", [
    (_linear, _x, "CompressedNMLinear.kernel_positions"),
    (_embed, _ids, "CompressedNMEmbed.embedding_positions"),
])
def test_plain_dict_update_of_another_nm_raises_at_the_update(make, inputs, name):
  # 1:8 and 2:16 positions of 64 features are both uint8 (4, ...): the plain dict loads with no cast at all.
  saved, target = make(1, 8, 1), make(2, 16, 2)
  pure = nnx.state(saved).to_pure_dict()
  assert jax.tree.map(jnp.shape, pure) == jax.tree.map(jnp.shape, nnx.state(target).to_pure_dict())
  before = np.asarray(_positions(target)[...])
  with pytest.raises(ValueError, match=rf"{name}: .*n:m=2:16; they are valid 1:8 positions"):
    nnx.update(target, pure)  # before: accepted, and nnx.jit then multiplied with a wrong weight
  np.testing.assert_array_equal(_positions(target)[...], before)  # left as they were
  # A checkpoint of the layer's own n:m updates, and the jitted layer computes the saved one's outputs.
  same = make(1, 8, 3)
  nnx.update(same, nnx.state(saved).to_pure_dict())
  x = inputs(4)
  np.testing.assert_allclose(_jitted(same, x), saved(x), rtol=1e-6, atol=1e-6)


def test_orbax_restore_without_target_then_update(tmp_path):
  saved, target = _linear(1, 8, 5), _linear(2, 16, 6)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.fspath(tmp_path / "ckpt"), nnx.state(saved).to_pure_dict())  # Flax's pure-dict checkpoint
  checkpointer.wait_until_finished()
  restored = ocp.StandardCheckpointer().restore(os.fspath(tmp_path / "ckpt"))  # no target: a plain dict of arrays
  assert jax.tree.map(jnp.shape, restored) == jax.tree.map(jnp.shape, nnx.state(target).to_pure_dict())
  with pytest.raises(ValueError, match=r"kernel_positions: .*n:m=2:16; they are valid 1:8 positions"):
    nnx.update(target, restored)
  same = _linear(1, 8, 7)
  nnx.update(same, restored)
  x = _x(8)
  np.testing.assert_allclose(_jitted(same, x), saved(x), rtol=1e-6, atol=1e-6)


def _stack(n, m, seed):
  @nnx.split_rngs(splits=2)
  @nnx.vmap(in_axes=0, out_axes=0)
  def build(rngs):
    return layers.NMLinear(64, 64, n=n, m=m, rngs=rngs).to_compressed(cusparselt_copy=False)

  return build(nnx.Rngs(seed))


def test_plain_dict_update_of_a_stack():
  pure = nnx.state(_stack(1, 8, 10)).to_pure_dict()
  target = _stack(2, 16, 20)
  with pytest.raises(ValueError, match=r"kernel_positions: .*n:m=2:16 \(a stack of layers: the positions \(2, 4, 64\) "
                                       r"have 1 leading layer axis/axes\); they are valid 1:8 positions"):
    nnx.update(target, pure)


def test_plain_dict_bias_of_another_shape_raises_in_the_call():
  layer, x = _linear(2, 4, 11), _x(12)
  want = layer(x)
  for bad in (layer.bias[...][:1], jnp.tile(layer.bias[...], (3, 1))):  # both broadcast against (3, 64) outputs
    target = _linear(2, 4, 13)
    nnx.update(target, {**nnx.state(layer).to_pure_dict(), "bias": bad})
    got = re.escape(f"(64,), got float32 {tuple(bad.shape)}")
    with pytest.raises(ValueError, match=rf"CompressedNMLinear.bias must have shape \(out_features,\) = {got}"):
      _jitted(target, x)  # before: outputs + a broadcast bias, silently
    with pytest.raises(ValueError, match=r"CompressedNMLinear.bias must have shape"):
      target(x)
  target = _linear(2, 4, 14)
  nnx.update(target, nnx.state(layer).to_pure_dict())
  np.testing.assert_allclose(_jitted(target, x), want, rtol=1e-6, atol=1e-6)


def _set(key, f):
  return lambda d: {**d, key: f(d[key])}


@pytest.mark.parametrize("storage, change, message", [
    ("values", _set("kernel", lambda a: a.reshape(64, 32)),
     r"CompressedNMLinear.kernel must have shape \(32, 64\) .*got \(64, 32\) float32"),
    ("values", _set("kernel_positions", lambda a: a.astype(jnp.float32)),
     r"CompressedNMLinear.kernel_positions must be uint8 of shape \(8, 64\) .*got float32 \(8, 64\): were the "
     r"positions cast"),
    ("values", _set("kernel_positions", lambda a: np.asarray(a).astype(np.uint16)),
     r"CompressedNMLinear.kernel_positions must be uint8 .*got uint16 \(8, 64\)"),
    ("values", _set("kernel_positions", lambda a: a.reshape(16, 32)),
     r"CompressedNMLinear.kernel_positions must be uint8 of shape \(8, 64\) .*got uint8 \(16, 32\): a checkpoint"),
    ("cusparselt", _set("kernel_buffer", lambda a: a.astype(jnp.float32)),
     r"CompressedNMLinear.kernel_buffer must be uint8 of shape \(8704,\) .*got float32 \(8704,\)"),
    ("cusparselt", _set("kernel_buffer", lambda a: a[:-8]),
     r"CompressedNMLinear.kernel_buffer must be uint8 of shape \(8704,\) .*got uint8 \(8696,\)"),
], ids=["kernel-shape", "positions-float32", "positions-uint16", "positions-shape", "buffer-float32", "buffer-size"])
def test_restored_arrays_of_another_shape_or_dtype_are_named(storage, change, message):
  saved, x = _linear(2, 4, 21, storage=storage), _x(22)
  target = _linear(2, 4, 23, storage=storage)
  nnx.update(target, change(nnx.state(saved).to_pure_dict()))
  with pytest.raises(ValueError, match=message):
    _jitted(target, x)  # static: under jit as eagerly
  with pytest.raises(ValueError, match=message):
    target(x)


def test_a_buffer_of_another_dtype_is_named():
  # A float32 layer's buffer restored into a bfloat16 one: another size; the layer names what it expects.
  saved, target = _linear(2, 4, 24, storage="cusparselt"), _linear(2, 4, 25, storage="cusparselt")
  target = layers.CompressedNMLinear(target.weight.with_values(target.weight.values.astype(jnp.bfloat16)),
                                     storage="cusparselt")
  nnx.update(target, {"kernel_buffer": nnx.state(saved).to_pure_dict()["kernel_buffer"]})
  with pytest.raises(ValueError, match=r"kernel_buffer must be uint8 of shape \(4608,\) \(the buffer of a \(64, 64\) "
                                       r"2:4 bfloat16 weight\), got uint8 \(8704,\)"):
    _jitted(target, _x(26).astype(jnp.bfloat16))


@pytest.mark.parametrize(("saved_dtype", "target_dtype"), [(jnp.float16, jnp.bfloat16), (jnp.bfloat16, jnp.float16)])
def test_a_float16_buffer_is_not_read_as_bfloat16(saved_dtype, target_dtype):
  # float16 and bfloat16 values take the same bytes: a float16 buffer ends with 16 bytes that mark it, so a checkpoint
  # of one restored into a layer of the other has another size, named under jit and eagerly (it was read as the
  # target's dtype before: wrong values, no error).
  def layer(seed, dtype):
    w = _linear(2, 4, seed, storage="cusparselt").weight
    return layers.CompressedNMLinear(w.with_values(w.values.astype(dtype)), storage="cusparselt")

  saved, target = layer(30, saved_dtype), layer(31, target_dtype)
  assert saved.kernel_buffer[...].shape[0] - target.kernel_buffer[...].shape[0] == (
      16 if saved_dtype == jnp.float16 else -16)
  nnx.update(target, {"kernel_buffer": nnx.state(saved).to_pure_dict()["kernel_buffer"]})
  x = _x(32).astype(target_dtype)
  message = rf"kernel_buffer must be uint8 of shape \({4608 + (16 if target_dtype == jnp.float16 else 0)},\)"
  with pytest.raises(ValueError, match=message):
    _jitted(target, x)
  with pytest.raises(ValueError, match=message):
    target(x)


def test_a_float16_buffer_round_trips_and_its_mark_is_checked():
  w = _linear(2, 4, 33, storage="cusparselt").weight
  w16 = w.with_values(w.values.astype(jnp.float16))
  buffer = _nm_matmul.to_buffer(w16)
  assert buffer.shape == (_nm_matmul.buffer_bytes(64, 64, jnp.float16),) == (4608 + 16,)
  back = _nm_matmul.from_buffer(buffer, (64, 64), jnp.float16)
  np.testing.assert_array_equal(back.to_dense(), w16.to_dense())
  assert _nm_matmul.to_buffer(w.with_values(w.values.astype(jnp.bfloat16))).shape == (4608,)  # cuSPARSELt's own size
  with pytest.raises(ValueError, match="does not end with the bytes that mark a float16 weight's buffer"):
    _nm_matmul.from_buffer(buffer.at[-1].set(7), (64, 64), jnp.float16)
  with pytest.raises(ValueError, match=r"float16 \(64, 64\) weight's buffer is \(4624,\) uint8"):
    _nm_matmul.from_buffer(buffer[:-16], (64, 64), jnp.float16)


def test_values_cast_to_another_float_dtype_are_accepted():
  # Casting the kept values (a bfloat16 copy of a model) is allowed: the product follows the values' dtype.
  saved, x = _linear(2, 4, 27), _x(28)
  target = _linear(2, 4, 29)
  nnx.update(target, _set("kernel", lambda a: a.astype(jnp.bfloat16))(nnx.state(saved).to_pure_dict()))
  assert target.kernel[...].dtype == jnp.bfloat16
  np.testing.assert_allclose(_jitted(target, x), saved(x), rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("saved_storage, target_storage, key", [
    ("values", "cusparselt", "kernel"), ("cusparselt", "values", "kernel_buffer")])
def test_a_checkpoint_of_the_other_storage_is_refused(saved_storage, target_storage, key):
  # storage="auto" keeps the buffer on a GPU whose cuSPARSELt reads it and the values elsewhere: a checkpoint of the
  # other machine's layer is refused by Flax (no variable of that name in the target), not loaded half.
  saved, target = _linear(2, 4, 30, storage=saved_storage), _linear(2, 4, 31, storage=target_storage)
  before = jax.tree.map(np.asarray, nnx.state(target).to_pure_dict())
  with pytest.raises(ValueError, match=rf"'{key}'"):
    nnx.update(target, {key: nnx.state(saved).to_pure_dict()[key]})
  jax.tree.map(np.testing.assert_array_equal, nnx.state(target).to_pure_dict(), before)


# ---------------------------------------------------------------------------------------------------------------------
# b. Linen: jax.jit(module.apply)(restored, x) without check_restored
# ---------------------------------------------------------------------------------------------------------------------


def _linen_variables(seed, n=2, m=4):
  module = linen.CompressedNMDense(32, n=n, m=m)
  return module, module.init(_key(seed), _x(seed + 1))


@pytest.mark.parametrize("cast, got", [(jnp.float32, "float32"), (jnp.uint16, "uint16"), (jnp.int32, "int32")])
def test_linen_jit_apply_names_cast_positions(cast, got):
  module, variables = _linen_variables(40)
  cast_all = jax.tree.map(lambda a: a.astype(cast) if a.dtype == jnp.uint8 else a, variables)
  with pytest.raises(ValueError, match=rf"linen.CompressedNMDense \(sparsity 'kernel_positions'\) must be uint8 of "
                                       rf"shape \(8, 32\) .*got {got} \(8, 32\): were the positions cast"):
    jax.jit(module.apply)(cast_all, _x(41))


def test_linen_jit_apply_names_positions_of_another_shape_in_a_model():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return linen.CompressedNMDense(32, name="fc")(x)

  net = Net()
  variables = net.init(_key(42), _x(43))
  bad = {**variables, "sparsity": {"fc": {"kernel_positions": jnp.zeros((16, 16), jnp.uint8)}}}
  with pytest.raises(ValueError, match=r"linen.CompressedNMDense 'fc' \(sparsity 'kernel_positions'\) must be uint8 "
                                       r"of shape \(8, 32\) .*got uint8 \(16, 16\): a checkpoint of another layer"):
    jax.jit(net.apply)(bad, _x(44))


@pytest.mark.parametrize("where, value, error, message", [
    ("bias", lambda a: a[:1], flax_errors.ScopeParamShapeError, r'"bias".*expected to generate shape \(32,\)'),
    ("bias", lambda a: jnp.tile(a, (3, 1)), flax_errors.ScopeParamShapeError, r'"bias".*shape \(3, 32\)'),
    ("kernel", lambda a: a[:, :16], flax_errors.ScopeParamShapeError, r'"kernel".*shape \(32, 16\)'),
    ("kernel", lambda a: a[:16], ValueError, r"holds variables for 32 input features, but x.shape\[-1\] = 64"),
], ids=["bias-1", "bias-batch", "kernel-features", "kernel-rows"])
def test_linen_jit_apply_refuses_params_of_another_shape(where, value, error, message):
  module, variables = _linen_variables(45)
  bad = {**variables, "params": {**variables["params"], where: value(variables["params"][where])}}
  with pytest.raises(error, match=message):
    jax.jit(module.apply)(bad, _x(46))


def test_linen_check_restored_then_jit_apply_computes_the_checkpoint():
  module, variables = _linen_variables(47)
  other = jax.tree.map(lambda a: a, _linen_variables(48)[1])
  restored = {**other, "params": variables["params"], "sparsity": variables["sparsity"]}
  x = _x(49)
  y = jax.jit(module.apply)(linen.check_restored(module, restored, x), x)
  np.testing.assert_allclose(y, module.apply(variables, x), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# c. A bare flax.training.train_state.TrainState through an optax update
# ---------------------------------------------------------------------------------------------------------------------


def test_linen_train_state_trains_the_kept_values_only():
  module, variables = _linen_variables(50)
  x, t = _x(51, rows=16), jax.random.normal(_key(52), (16, 32))
  state = train_state.TrainState.create(apply_fn=module.apply, params=variables["params"], tx=optax.adamw(1e-2))
  sparsity = variables["sparsity"]
  loss = lambda p: jnp.mean((state.apply_fn({"params": p, "sparsity": sparsity}, x) - t) ** 2)
  step = jax.jit(lambda s: s.apply_gradients(grads=jax.grad(loss)(s.params)))
  first = loss(state.params)
  for _ in range(5):
    state = step(state)
  assert loss(state.params) < first
  assert not np.array_equal(state.params["kernel"], variables["params"]["kernel"])
  w = jaxsparse.NMSparseMatrix(state.params["kernel"], sparsity["kernel_positions"], shape=(64, 32), n=2, m=4)
  dense = w.to_dense()
  np.testing.assert_array_equal(dense * ~w.mask(), 0)  # still 2:4 on the checkpoint's positions
  y = module.apply({"params": state.params, "sparsity": sparsity}, x)
  np.testing.assert_allclose(y, x @ dense + state.params["bias"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("storage", ["values", "cusparselt"])
def test_nnx_train_state_over_params_leaves_the_structure_alone(storage):
  model = _linear(2, 4, 53, storage=storage)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  assert not [k for k in params.to_pure_dict() if k in ("kernel_positions", "kernel_buffer")]
  x, t = _x(54, rows=16), jax.random.normal(_key(55), (16, 64))
  state = train_state.TrainState.create(apply_fn=graphdef.apply, params=params, tx=optax.adam(1e-2))

  def loss(p):
    y, _ = state.apply_fn(p, rest)(x)
    return jnp.mean((y - t) ** 2)

  first = loss(state.params)
  state = state.apply_gradients(grads=jax.grad(loss)(state.params))
  assert loss(state.params) < first
  trained = nnx.merge(graphdef, state.params, rest)
  for key, value in nnx.state(rest).to_pure_dict().items():
    np.testing.assert_array_equal(nnx.state(trained).to_pure_dict()[key], value)


@pytest.mark.parametrize("framework", ["linen", "nnx-values", "nnx-cusparselt"])
def test_train_state_over_every_variable_refuses_the_integer_structure(framework):
  if framework == "linen":
    module, variables = _linen_variables(56)
    apply = module.apply
    params = variables
    out = 32
  else:
    graphdef, params = nnx.split(_linear(2, 4, 57, storage=framework.split("-")[1]))
    apply = lambda p, x: graphdef.apply(p)(x)[0]
    out = 64
  x, t = _x(58, rows=8), jax.random.normal(_key(59), (8, out))
  loss = lambda p: jnp.mean((apply(p, x) - t) ** 2)
  state = train_state.TrainState.create(apply_fn=apply, params=params, tx=optax.adam(1e-2))
  with pytest.raises(TypeError, match=r"grad requires real- or complex-valued inputs .*got uint8"):
    jax.grad(loss)(state.params)
  grads = jax.grad(loss, allow_int=True)(state.params)  # float0 for the integers: no optimizer takes them
  for tx in (optax.adam(1e-2), optax.sgd(1e-2)):
    state = train_state.TrainState.create(apply_fn=apply, params=params, tx=tx)
    with pytest.raises(TypeError):
      state.apply_gradients(grads=grads)
