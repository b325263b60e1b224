"""``torch_interop.save_flax_variables`` of Linen variables in sharding boxes, and what ``load_flax_variables`` gives.

Regression: boxed variables (``nn.with_partitioning`` / ``nn.with_logical_partitioning`` params, the ``"sparsity"``
variables of jaxsparse's Linen layers built with such a kernel) raised for safetensors (``'params/Dense_0/kernel'
holds an array of dtype object``) and were written by orbax as ``kernel/value`` sub-trees (loaded back as
``{"value": array}`` dicts, which no model takes); an NNX state went to orbax as ``{"value": array}`` too. Now both
formats store each box's array under the variable's own path: loaded, the arrays equal ``nn.meta.unbox(variables)``
(paths, dtypes, values), run in the model as they are, and box again into the model's boxes. Fresh random data each
run (``SEED`` in the messages). About 3 s.
"""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from jaxsparse import torch_interop
from jaxsparse.layers import linen as sparse_linen
from jaxsparse.torch_interop import CheckpointError

SEED = int(np.random.SeedSequence().entropy % 2**31)
D = 16
FORMATS = {"safetensors": "variables.safetensors", "orbax": "variables"}


def _named(*names):
  return nn.with_partitioning(nn.initializers.lecun_normal(), names)


class _Model(nn.Module):
  """Boxed params (named, logically named, a bfloat16 one), jaxsparse layers with boxed patterns, an unboxed bias."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(D, kernel_init=_named(None, "model"), name="dense")(x)
    x = nn.Dense(D, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")),
                 param_dtype=jnp.bfloat16, name="logical")(x)
    x = sparse_linen.MaskedDense(D, sparsity=0.75, kernel_init=_named(None, "model"), name="masked")(jnp.tanh(x))
    return sparse_linen.BlockSparseDense(D, density=0.5, block_shape=(4, 4), kernel_init=_named(None, None, "model"),
                                         name="block")(jnp.tanh(x))


def _boxes(tree) -> dict[str, str]:
  is_box = lambda a: isinstance(a, nn.meta.AxisMetadata)
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]
  return {jax.tree_util.keystr(p): type(a).__name__ for p, a in flat if is_box(a)}


@pytest.fixture(scope="module")
def model_and_variables():
  x = jax.random.normal(jax.random.key(SEED), (3, D))
  model = _Model()
  variables = model.init(jax.random.key(SEED + 1), x)
  boxes = _boxes(variables)
  assert {"['params']['logical']['kernel']", "['sparsity']['masked']['mask']",
          "['sparsity']['block']['row_indices']"} <= boxes.keys(), boxes
  assert "['params']['dense']['bias']" not in boxes
  return model, variables, x


@pytest.mark.parametrize("format", FORMATS)
def test_boxed_linen_variables_save_unboxed_and_load_back(model_and_variables, format, tmp_path):
  model, variables, x = model_and_variables
  path = torch_interop.save_flax_variables(variables, tmp_path / FORMATS[format], format=format)
  loaded = torch_interop.load_flax_variables(path)

  want = nn.meta.unbox(variables)
  assert jax.tree.structure(loaded) == jax.tree.structure(jax.tree.map(np.asarray, want)), SEED
  for (p, got), w in zip(jax.tree_util.tree_flatten_with_path(loaded)[0], jax.tree.leaves(want), strict=True):
    assert isinstance(got, np.ndarray) and got.dtype == w.dtype, (jax.tree_util.keystr(p), got.dtype, w.dtype, SEED)
    np.testing.assert_array_equal(got, np.asarray(w), err_msg=f"{jax.tree_util.keystr(p)} SEED={SEED}")
  y = model.apply(variables, x)
  np.testing.assert_array_equal(model.apply(loaded, x), y, err_msg=f"SEED={SEED}")  # usable as they are

  # Boxed again into the model's boxes (save_flax_variables' recipe): the same names, the same outputs.
  abstract = jax.eval_shape(model.init, jax.random.key(0), x)
  is_box = lambda b: isinstance(b, nn.meta.AxisMetadata)
  boxed = jax.tree.map(lambda box, v: box.replace_boxed(v) if is_box(box) else v, abstract, loaded, is_leaf=is_box)
  assert _boxes(boxed) == _boxes(variables)
  assert nn.get_partition_spec(boxed) == nn.get_partition_spec(variables)
  np.testing.assert_array_equal(model.apply(boxed, x), y, err_msg=f"SEED={SEED}")
  if format == "orbax":  # straight into the unboxed abstract target
    restored = ocp.StandardCheckpointer().restore(os.path.abspath(path), nn.meta.unbox(abstract))
    np.testing.assert_array_equal(model.apply(restored, x), y, err_msg=f"SEED={SEED}")


@pytest.mark.parametrize("format", FORMATS)
def test_nnx_state_saves_its_arrays(format, tmp_path):
  """An NNX state (``nnx.Variable`` leaves) is written as arrays in both formats (orbax wrote ``{"value": ...}``)."""
  layer = nnx.Linear(4, 3, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(SEED))
  path = torch_interop.save_flax_variables(nnx.state(layer), tmp_path / FORMATS[format], format=format)
  loaded = torch_interop.load_flax_variables(path)
  assert sorted(loaded) == ["bias", "kernel"], loaded
  np.testing.assert_array_equal(loaded["kernel"], np.asarray(layer.kernel[...]))
  np.testing.assert_array_equal(loaded["bias"], np.asarray(layer.bias[...]))


@pytest.mark.parametrize("format", FORMATS)
def test_a_leaf_that_is_not_an_array_is_refused_by_name(format, tmp_path):
  bad = {"params": {"fc": {"kernel": np.ones((2, 2), np.float32), "name": "fc"}}}
  with pytest.raises(CheckpointError, match=r"'params/fc/name' holds str of dtype <U2; expected a numeric or boolean"):
    torch_interop.save_flax_variables(bad, tmp_path / FORMATS[format], format=format)
  assert os.listdir(tmp_path) == []
