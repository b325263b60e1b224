"""Calibrated pruning on calibration data that cannot rank the weights: all-zero inputs, NaN / inf.

Regressions (each test below failed before the fix):

* A layer whose inputs are all zero on the batches (zero batches, or a ReLU that zeroes every input of the next
  layer) gave Wanda all-zero scores and SparseGPT an all-dead Hessian: every score tied, so the masks kept the first
  weights in index order (a 2:4 mask kept rows 0, 1 of every group whatever the weights), SparseGPT also set every
  weight to zero before its refit, and the report's errors were NaN (0 / 0), with no warning. Such a layer is now
  pruned by magnitude (the masks of ``method="magnitude"``, no weight update or refit), its error is 0, its note says
  why, and one ``UserWarning`` names every such layer. Magnitude pruning with zero batches reported NaN errors too.
* ``wanda_layer`` and ``sparsegpt_layer`` on all-zero statistics kept weights in index order (``sparsegpt_layer``
  returned an all-zero kernel); they now rank by magnitude. ``reconstruction_error`` on a zero Gram matrix was NaN.
* A tied embedding table whose ``attend`` queries are all zero was pruned on an all-zero Hessian (ties) and its
  note printed ``lambda = nan``.
* NaN / inf in a batch was refused naming the layer but not the batch.
"""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsparse
from jaxsparse import pruning
from tests.test_calibrated_pruning_stacks import L
from tests.test_calibrated_pruning_stacks import _scanned

SPECS = {"unstructured 50%": jaxsparse.Unstructured(sparsity=0.5), "2:4": jaxsparse.NM(2, 4),
         "block 8x4": jaxsparse.BlockSparse(density=0.5, block_shape=(8, 4))}
ZERO_WARNING = r"saw only zero inputs on the calibration batches"


class MLP(nnx.Module):
  def __init__(self, rngs, dead=False):
    self.fc1 = nnx.Linear(16, 32, rngs=rngs)
    self.fc2 = nnx.Linear(32, 8, rngs=rngs)
    if dead:  # every pre-activation negative: the ReLU zeroes every input of fc2
      self.fc1.bias[...] = jnp.full((32,), -100.0)

  def __call__(self, x):
    return self.fc2(jax.nn.relu(self.fc1(x)))


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(32, bias_init=nn.initializers.constant(-100.0))(x))  # every input of Dense_1 zero
    return nn.Dense(8)(h)


def _batches(n=2):
  return [jax.random.normal(jax.random.key(10 + i), (48, 16)) for i in range(n)]


def _prune(*args, **kwargs):
  """``calibrated_prune`` (or ``calibrated_prune_linen`` with ``linen=True``), and the warnings it raised."""
  fn = pruning.calibrated_prune_linen if kwargs.pop("linen", False) else pruning.calibrated_prune
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    out = fn(*args, progress=False, **kwargs)
  return out, [str(w.message) for w in record if issubclass(w.category, UserWarning)]


def _magnitude(kernel, spec):
  return np.asarray(pruning.magnitude_layer(jnp.asarray(kernel), spec))


def _check_magnitude_fallback(row, dense, pruned, mask, spec):
  want = _magnitude(dense, spec)
  np.testing.assert_array_equal(mask, want, err_msg=row.path)
  np.testing.assert_array_equal(pruned, np.where(want, dense, 0), err_msg=row.path)  # no update, no refit
  assert row.error == 0.0, row
  assert "inputs all zero on the calibration batches" in row.note and "pruned by magnitude" in row.note, row


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
@pytest.mark.parametrize("name", list(SPECS))
def test_layer_whose_inputs_a_relu_zeroes_is_pruned_by_magnitude_with_a_warning(method, name):
  spec = SPECS[name]
  model = MLP(nnx.Rngs(0), dead=True)
  dense2 = np.asarray(model.fc2.kernel[...])
  (pruned, masks, report), warned = _prune(model, spec, _batches(), method=method)
  assert len(warned) == 1 and re.search(rf"{method}: 1 layer\(s\) {ZERO_WARNING}: fc2 \(", warned[0]), warned
  fc1, fc2 = report.layers
  _check_magnitude_fallback(fc2, dense2, np.asarray(pruned.fc2.kernel[...]), masks["fc2.kernel"], spec)
  assert fc1.note == "" and 0 < fc1.error < 1, fc1  # the layer with real inputs: the method as usual
  assert "nan" not in str(report)


def test_linen_layer_with_zero_inputs_is_pruned_by_magnitude():
  spec = jaxsparse.NM(2, 4)
  variables = LinenMLP().init(jax.random.key(0), _batches()[0])
  (new_vars, masks, report), warned = _prune(LinenMLP(), variables, spec, _batches(), method="sparsegpt", linen=True)
  assert len(warned) == 1 and re.search(rf"sparsegpt: 1 layer\(s\) {ZERO_WARNING}: Dense_1 \(", warned[0]), warned
  _check_magnitude_fallback(report.layers[1], variables["params"]["Dense_1"]["kernel"],
                            new_vars["params"]["Dense_1"]["kernel"], masks["Dense_1.kernel"], spec)
  assert report.layers[0].note == "" and 0 < report.layers[0].error < 1


def test_all_zero_batches_warn_once_and_report_zero_errors():
  zeros = [jnp.zeros((48, 16))] * 2
  spec = jaxsparse.Unstructured(sparsity=0.5)
  (pruned, masks, report), warned = _prune(MLP(nnx.Rngs(0)), spec, zeros, method="wanda")
  assert len(warned) == 1 and f"wanda: 2 layer(s) {ZERO_WARNING}: fc1, fc2 (" in warned[0], warned
  model = MLP(nnx.Rngs(0))
  for row, layer in zip(report.layers, (model.fc1, model.fc2), strict=True):
    _check_magnitude_fallback(row, layer.kernel[...], getattr(pruned, row.path).kernel[...],
                              masks[f"{row.path}.kernel"], spec)
  # Magnitude pruning's masks do not depend on the data: no warning, but errors 0 (they were NaN) and a note.
  (_, masks, report), warned = _prune(MLP(nnx.Rngs(0)), spec, zeros, method="magnitude")
  assert warned == []
  assert [r.error for r in report.layers] == [0.0, 0.0]
  assert all(r.note.startswith("inputs all zero") for r in report.layers)
  np.testing.assert_array_equal(masks["fc2.kernel"], _magnitude(model.fc2.kernel[...], spec))


def test_stack_of_layers_with_zero_inputs_falls_back_layer_by_layer():
  model = _scanned()
  dense = {name: np.asarray(getattr(model.blocks, name).kernel[...]) for name in ("fc1", "fc2")}
  spec = jaxsparse.NM(2, 4)
  (pruned, masks, report), warned = _prune(model, {r"blocks\..*": spec, ".*": None}, [jnp.zeros((8, 16))],
                                           method="sparsegpt")
  names = [f"blocks.{name}[{i}]" for i in range(L) for name in ("fc1", "fc2")]
  assert len(warned) == 1 and f"sparsegpt: {len(names)} layer(s) {ZERO_WARNING}: " in warned[0], warned
  assert all(n in warned[0] for n in names), warned
  assert sorted(r.path for r in report.layers) == sorted(names)
  for row in report.layers:
    name, i = row.path[len("blocks."):-3], int(row.path[-2])
    _check_magnitude_fallback(row, dense[name][i], np.asarray(getattr(pruned.blocks, name).kernel[...])[i],
                              masks[f"blocks.{name}.kernel"][i], spec)


class TiedLM(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(40, 16, rngs=rngs)

  def __call__(self, ids):
    return self.embed.attend(0.0 * jnp.tanh(self.embed(ids)))  # the attend queries are all zero


def test_tied_table_with_zero_attend_queries_is_pruned_as_lookups():
  model = TiedLM(nnx.Rngs(0))
  table = np.asarray(model.embed.embedding[...])
  ids = [jnp.asarray(np.random.default_rng(0).integers(0, 40, (4, 12)), jnp.int32)]
  (pruned, masks, report), warned = _prune(model, {"embed": jaxsparse.NM(2, 4)}, ids, method="sparsegpt")
  assert len(warned) == 1 and f"sparsegpt: 1 layer(s) {ZERO_WARNING}: embed (" in warned[0], warned
  row = report.layers[0]
  want = _magnitude(table.T, jaxsparse.NM(2, 4)).T  # N:M along the features of each row
  np.testing.assert_array_equal(masks["embed.embedding"], want)
  np.testing.assert_array_equal(np.asarray(pruned.embed.embedding[...]), np.where(want, table, 0))
  assert row.note.startswith("attend queries all zero on the calibration batches: pruned as a lookup-only table")
  assert "nan" not in row.note and 0 < row.error < 1 and row.tokens == 48, row  # the lookups' error and tokens


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_batch_is_named(bad):
  batches = _batches(3)
  batches[2] = batches[2].at[7, 1].set(bad)
  message = r"fc1: the inputs this layer sees on the calibration batches contain NaN or inf \(first in batches\[2\]"
  with pytest.raises(ValueError, match=message):
    pruning.calibrated_prune(MLP(nnx.Rngs(0)), jaxsparse.NM(2, 4), batches, method="wanda", progress=False)
  variables = LinenMLP().init(jax.random.key(0), batches[0])
  with pytest.raises(ValueError, match=r"Dense_0: .* NaN or inf \(first in batches\[2\]"):
    pruning.calibrated_prune_linen(LinenMLP(), variables, jaxsparse.NM(2, 4), batches, progress=False)
  # Sums that overflow only once added up (each batch finite): the batch where they first do.
  big = [jnp.full((48, 16), 3e18)] * 3
  with pytest.raises(ValueError, match=r"fc1: .* \(first in batches\[0\]: .* too large to square in float32"):
    pruning.calibrate(MLP(nnx.Rngs(0)), big, {"fc1": jaxsparse.NM(2, 4)})
  big = [jnp.full((4, 16), 4e18)] * 8  # 6.4e37 per batch, each finite: float32's max (3.4e38) is passed at the 6th
  with pytest.raises(ValueError, match=r"fc1: .* \(first in batches\[5\]"):
    pruning.calibrate(MLP(nnx.Rngs(0)), big, {"fc1": jaxsparse.NM(2, 4)}, gram=False)


@pytest.mark.parametrize("name", list(SPECS))
def test_layer_solvers_rank_by_magnitude_on_all_zero_statistics(name):
  spec = SPECS[name]
  w = jax.random.normal(jax.random.key(3), (32, 8))
  wanda = np.asarray(pruning.wanda_layer(w, jnp.zeros(32), spec))
  np.testing.assert_array_equal(wanda, np.asarray(pruning.wanda_layer(w, jnp.ones(32), spec)))  # equal norms
  if not isinstance(spec, jaxsparse.Unstructured):  # Wanda's unstructured groups are per output, magnitude's not
    np.testing.assert_array_equal(wanda, _magnitude(w, spec))
  out = pruning.sparsegpt_layer(w, jnp.zeros((32, 32)), spec, block_size=8)
  ident = pruning.sparsegpt_layer(w, jnp.eye(32), spec, block_size=8)  # H = I: magnitude saliencies, no updates
  np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(ident.mask))
  np.testing.assert_array_equal(np.asarray(out.kernel), np.where(out.mask, w, 0))
  assert int(np.sum(out.mask)) == 128
  if not isinstance(spec, jaxsparse.Unstructured):  # SparseGPT's unstructured counts are per batch of features
    np.testing.assert_array_equal(np.asarray(out.mask), _magnitude(w, spec))


def test_reconstruction_error_of_zero_inputs_is_zero_not_nan():
  w = jax.random.normal(jax.random.key(4), (8, 4))
  assert float(pruning.reconstruction_error(w, w * 0.0, jnp.zeros((8, 8)))) == 0.0
  x = jnp.zeros((5, 8)).at[:, 0].set(1.0)  # only input 0 is ever nonzero
  w0 = w.at[0].set(0.0)  # the layer's outputs are zero on these inputs, the pruned ones not: infinitely worse
  assert float(pruning.reconstruction_error(w0, w, x.T @ x)) == np.inf
  assert float(pruning.reconstruction_error(w0, w0 * 0.5, x.T @ x)) == 0.0
