"""``jaxsparse.plot_pattern`` draws the pattern it is given: the pixels are checked against the masks."""

from __future__ import annotations

import flax.linen as nn
import jax
import matplotlib
import numpy as np
import pytest
from flax import nnx

import jaxsparse
from jaxsparse import layers
from jaxsparse.layers import linen

matplotlib.use("Agg")
import matplotlib.pyplot as plt


@pytest.fixture(autouse=True)
def _close_figures():
  yield
  plt.close("all")


def _pixels(ax) -> np.ndarray:
  return np.asarray(ax.images[0].get_array())


def test_block_pattern_is_the_block_mask_at_full_extent():
  layer = layers.BlockSparseLinear(128, 256, density=0.25, block_shape=(32, 32), rngs=nnx.Rngs(0))
  ax = jaxsparse.plot_pattern(layer)
  np.testing.assert_array_equal(_pixels(ax), np.asarray(layer.block_mask, float))
  assert ax.get_xlim() == (0, 256) and ax.get_ylim() == (128, 0)
  assert ax.get_title() == "block 32x32, density 0.250"
  # The matrix itself draws the same.
  np.testing.assert_array_equal(_pixels(jaxsparse.plot_pattern(layer.sparse_kernel)), _pixels(ax))


def test_large_unstructured_pattern_is_a_density_image():
  layer = layers.MaskedLinear(1000, 600, sparsity=0.9, rngs=nnx.Rngs(0))
  mask = np.asarray(layer.mask[...])
  ax = jaxsparse.plot_pattern(layer, max_pixels=100)
  image = _pixels(ax)
  assert image.shape == (100, 100)  # tiles of 10 x 6
  np.testing.assert_allclose(image[3, 7], mask[30:40, 42:48].mean())
  np.testing.assert_allclose(image.mean(), 0.1, atol=1e-9)
  assert ax.get_title() == "unstructured, density 0.100, 10x6 tiles"


def test_uneven_tiles_count_only_covered_entries():
  mask = np.ones((5, 3), bool)
  image = _pixels(jaxsparse.plot_pattern(mask, max_pixels=2))
  np.testing.assert_array_equal(image, np.ones((2, 2)))  # padded edges do not dilute the density


def test_nm_crop_and_conv_layout():
  nm = layers.NMLinear(64, 32, n=2, m=4, rngs=nnx.Rngs(0))
  _, ax = plt.subplots()
  assert jaxsparse.plot_pattern(nm, ax, crop=(8, 4)) is ax
  np.testing.assert_array_equal(_pixels(ax), np.asarray(nm.nm_mask[:8, :4], float))
  assert ax.get_title() == "2:4, density 0.500"
  np.testing.assert_array_equal(_pixels(jaxsparse.plot_pattern(nm.to_compressed())), np.asarray(nm.nm_mask, float))
  conv = layers.NMConv(8, 16, (3, 3), n=1, m=4, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(_pixels(jaxsparse.plot_pattern(conv)), np.asarray(conv.nm_mask, float).reshape(72, 16))
  csr = jaxsparse.CSRMatrix.from_dense(jax.random.normal(jax.random.key(0), (12, 10)), mask=np.eye(12, 10, dtype=bool))
  np.testing.assert_array_equal(_pixels(jaxsparse.plot_pattern(csr)), np.eye(12, 10))


def test_linen_layer_variables():
  x = jax.numpy.ones((1, 64))
  v = linen.BlockSparseDense(96, density=0.5, block_shape=(16, 32)).init(jax.random.key(0), x)
  expected = np.zeros((4, 3))  # 64 / 16 block rows, 96 / 32 block columns
  expected[np.asarray(v["sparsity"]["row_indices"]), np.asarray(v["sparsity"]["col_indices"])] = 1
  assert expected.sum() == 6
  np.testing.assert_array_equal(_pixels(jaxsparse.plot_pattern(v)), expected)
  m = linen.MaskedDense(32, sparsity=0.5).init(jax.random.key(0), x)
  np.testing.assert_array_equal(_pixels(jaxsparse.plot_pattern(m)), np.asarray(m["sparsity"]["mask"], float))


def test_linen_variables_of_a_bridged_nnx_layer():
  # nnx.bridge.ToLinen(BlockSparseLinear) keeps its index arrays one level down, {"sparsity": {"pattern": {...}}}:
  # plot_pattern raised "the 'sparsity' variables hold ['pattern'], not a block pattern or a mask". It draws them now,
  # as it draws the flat ones of a BlockSparseDense.
  x = jax.numpy.ones((1, 64))
  bridged = nnx.bridge.ToLinen(layers.BlockSparseLinear, args=(64, 96), kwargs={"density": 0.5,
                                                                                "block_shape": (16, 32)})
  v = bridged.init(jax.random.key(0), x)
  index = v["sparsity"]["pattern"]
  expected = np.zeros((4, 3))
  expected[np.asarray(index["row_indices"]), np.asarray(index["col_indices"])] = 1
  assert expected.sum() == 6
  ax = jaxsparse.plot_pattern(v)
  np.testing.assert_array_equal(_pixels(ax), expected)
  assert ax.get_title() == "block 16x32, density 0.500"
  flat = jaxsparse.plot_pattern({"params": v["params"], "sparsity": dict(index)})  # the same arrays, flat
  np.testing.assert_array_equal(_pixels(flat), expected)
  masked = nnx.bridge.ToLinen(layers.MaskedLinear, args=(64, 32), kwargs={"sparsity": 0.5})
  m = masked.init(jax.random.key(0), x)
  np.testing.assert_array_equal(_pixels(jaxsparse.plot_pattern(m)), np.asarray(m["sparsity"]["mask"], float))
  # A "sparsity" entry of another layout is refused, saying which layouts plot_pattern reads.
  other = {"params": v["params"], "sparsity": {"pattern": {"row_indices": index["row_indices"]}}}
  with pytest.raises(TypeError, match=r"the 'sparsity' variables hold \['pattern'\], not a layout plot_pattern "
                                      r"reads: a block pattern .* under 'pattern' as a nnx\.bridge\.ToLinen"):
    jaxsparse.plot_pattern(other)


def test_bad_input():
  with pytest.raises(TypeError, match="plot_pattern takes a jaxsparse layer"):
    jaxsparse.plot_pattern(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"crop must be a pair of positive ints \(rows, cols\), got crop=\(0, 4\)"):
    jaxsparse.plot_pattern(np.ones((4, 4), bool), crop=(0, 4))
  with pytest.raises(ValueError, match="max_pixels must be a positive int"):
    jaxsparse.plot_pattern(np.ones((4, 4), bool), max_pixels=0)


def test_unusable_input_is_named_not_a_lookup_error():
  x = jax.numpy.ones((1, 64))

  class Two(nn.Module):
    @nn.compact
    def __call__(self, x):
      return linen.MaskedDense(8, sparsity=0.5, name="b")(linen.MaskedDense(16, sparsity=0.5, name="a")(x))

  v = Two().init(jax.random.key(0), x)
  # A whole Linen model's variables: was KeyError: 'kernel'.
  with pytest.raises(TypeError, match=r"variables of one Linen layer.*'params' hold \['a', 'b'\]: pick a layer"):
    jaxsparse.plot_pattern(v)
  np.testing.assert_array_equal(  # one of its layers, as the message says
      _pixels(jaxsparse.plot_pattern({"params": v["params"]["a"], "sparsity": v["sparsity"]["a"]})),
      np.asarray(v["sparsity"]["a"]["mask"], float))
  # An abstract layer: was TypeError: 'ShapeDtypeStruct' object is not subscriptable.
  for make in (lambda: layers.MaskedLinear(16, 8, sparsity=0.5, rngs=nnx.Rngs(0)),
               lambda: layers.NMLinear(16, 8, rngs=nnx.Rngs(0))):
    with pytest.raises(ValueError, match=r"the (MaskedLinear|NMLinear) is abstract \(nnx.eval_shape\)"):
      jaxsparse.plot_pattern(nnx.eval_shape(make))
  with pytest.raises(ValueError, match=r"the mask is empty \(shape \(0, 4\)\)"):
    jaxsparse.plot_pattern(np.zeros((0, 4), bool))


def test_crop_and_max_pixels_take_numpy_ints_and_reject_other_values():
  mask = np.random.default_rng(0).random((12, 10)) < 0.5
  ax = jaxsparse.plot_pattern(mask, crop=(np.int64(6), np.int32(4)), max_pixels=np.int64(64))
  np.testing.assert_array_equal(_pixels(ax), mask[:6, :4].astype(float))
  for bad in (6, (True, 4), (6.5, 4), "64"):  # was: 6 raised "object of type 'int' has no len()", (True, 4) drew
    with pytest.raises(ValueError, match=r"crop must be a pair of positive ints \(rows, cols\)"):
      jaxsparse.plot_pattern(mask, crop=bad)


def test_empty_matrices_and_1d_nm_matrices_raise_a_named_error():
  # Was: ZeroDivisionError for a matrix with no columns (the figure's aspect ratio), IndexError for a 1-D
  # NMSparseMatrix (its mask unpacked as rows, cols); a matrix with no rows drew an empty figure.
  empty = {
      "csr 8x0": jaxsparse.CSRMatrix.from_dense(np.zeros((8, 0), np.float32)),
      "csr 0x8": jaxsparse.CSRMatrix.from_dense(np.zeros((0, 8), np.float32)),
      "block 0x8": jaxsparse.BlockSparseMatrix.from_dense(np.zeros((0, 8), np.float32), (2, 2)),
      "nm 8x0": jaxsparse.NMSparseMatrix.from_dense(np.zeros((8, 0), np.float32), 2, 4),
  }
  for name, w in empty.items():
    with pytest.raises(ValueError, match=r"plot_pattern: the pattern is empty \(\d+x\d+\); nothing to draw"):
      jaxsparse.plot_pattern(w)
      pytest.fail(name)
  with pytest.raises(ValueError, match=r"the NMSparseMatrix is 1-D \(shape \(8,\)\); it draws patterns of 2 or more"):
    jaxsparse.plot_pattern(jaxsparse.NMSparseMatrix.from_dense(np.ones(8, np.float32), 2, 4))
