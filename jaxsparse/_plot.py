"""``jaxsparse.plot_pattern``: draws the sparsity pattern of a layer or a sparse matrix with matplotlib."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx

from jaxsparse import _utils
from jaxsparse.formats._block_sparse import INDEX_FIELDS
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._csr import CSRMatrix
from jaxsparse.formats._nm import NMSparseMatrix
from jaxsparse.layers._block_sparse import BlockSparseLinear
from jaxsparse.layers._common import SPARSITY
from jaxsparse.layers._common import bridged_block_pattern
from jaxsparse.layers._embed import CompressedNMEmbed
from jaxsparse.layers._linear_general import SparseLinearGeneral
from jaxsparse.layers._masked import MaskedConv
from jaxsparse.layers._masked import MaskedLinear
from jaxsparse.layers._nm import NMConv
from jaxsparse.layers._nm import NMLinear
from jaxsparse.layers._nm_compressed import CompressedNMLinear

__all__ = ["pattern_image", "plot_pattern"]


def _as_2d(mask: np.ndarray) -> np.ndarray:
  """A conv kernel mask ``(*kernel_size, cin, cout)`` as ``(prod(kernel_size) * cin, cout)``."""
  return mask.reshape(-1, mask.shape[-1]) if mask.ndim > 2 else mask


def _linen_layer(variables: Mapping) -> Any:
  """A Linen ``BlockSparseDense`` / ``MaskedDense`` layer's ``{"params", "sparsity"}`` as a matrix or mask, or those of
  an NNX ``BlockSparseLinear`` / ``MaskedLinear`` under ``nnx.bridge.ToLinen`` (the former's index arrays one level
  down, under ``"pattern"``)."""
  params, pattern = variables["params"], variables[SPARSITY]
  if not isinstance(params.get("kernel"), jax.Array | np.ndarray | jax.ShapeDtypeStruct):
    raise TypeError(
        "plot_pattern takes the variables of one Linen layer, {'params': {'kernel': ...}, 'sparsity': {...}}; these "
        f"'params' hold {sorted(params)}: pick a layer, e.g. {{'params': variables['params'][name], "
        "'sparsity': variables['sparsity'][name]}."
    )
  kernel = params["kernel"]
  bridged = bridged_block_pattern(pattern, params)  # ToLinen(BlockSparseLinear): {"pattern": {"row_indices": ...}}
  pattern = pattern if bridged is None else bridged
  if "row_indices" in pattern:
    _, bk, bn = kernel.shape
    shape = ((pattern["row_offsets"].shape[0] - 1) * bk, (pattern["col_offsets"].shape[0] - 1) * bn)
    return BlockSparseMatrix.from_index_arrays(kernel, pattern, shape=shape, block_shape=(bk, bn))
  if "mask" in pattern:
    return np.asarray(pattern["mask"])
  if "kernel_positions" in pattern:  # a CompressedNMDense: its n:m is in its module, not in its variables
    raise TypeError(
        "these are a Linen CompressedNMDense's variables, which do not say its n:m: plot its weight, "
        "jaxsparse.NMSparseMatrix(params['kernel'], sparsity['kernel_positions'], shape=(in_features, features), "
        "n=n, m=m)."
    )
  raise TypeError(
      f"the {SPARSITY!r} variables hold {sorted(pattern)}, not a layout plot_pattern reads: a block pattern (the "
      f"index arrays {list(INDEX_FIELDS)}, flat as a BlockSparseDense keeps them or under 'pattern' as a "
      "nnx.bridge.ToLinen(BlockSparseLinear) does) or a 'mask' (MaskedDense, ToLinen(MaskedLinear))."
  )


def _pattern(x: Any) -> tuple[np.ndarray, tuple[int, int], str]:
  """``(mask, cell, title)``: a bool mask whose entries stand for ``cell``-shaped tiles of the kernel."""
  if isinstance(x, nnx.Module) and any(isinstance(v, jax.ShapeDtypeStruct) for v in jax.tree.leaves(nnx.state(x))):
    raise ValueError(f"plot_pattern: the {type(x).__name__} is abstract (nnx.eval_shape): its pattern has no values "
                     "to draw yet; make the layer with values first.")
  if isinstance(x, Mapping) and "params" in x and SPARSITY in x:
    x = _linen_layer(nn.meta.unbox(x))  # nn.with_partitioning boxes, as sparsify_linen carries them over
  if isinstance(x, SparseLinearGeneral):
    x = x.layer
  if isinstance(x, BlockSparseLinear):
    x = x.sparse_kernel
  if isinstance(x, BlockSparseMatrix):
    bk, bn = x.block_shape
    return np.asarray(x.block_mask), (bk, bn), f"block {bk}x{bn}, density {x.density:.3f}"
  if isinstance(x, CompressedNMLinear | CompressedNMEmbed):
    x = x.weight
  if isinstance(x, NMSparseMatrix):
    if x.ndim < 2:
      raise ValueError(f"plot_pattern: the NMSparseMatrix is {x.ndim}-D (shape {x.shape}); it draws patterns of 2 or "
                       "more dims (a kernel (in, out) or (*kernel_size, cin, cout)).")
    return _as_2d(np.asarray(x.mask())), (1, 1), f"{x.n}:{x.m}, density {x.density:.3f}"
  if isinstance(x, NMLinear | NMConv):
    own = x.mask if isinstance(x, NMConv) else None  # a conv's own weight mask
    mask = np.asarray(x.nm_mask) if own is None else np.asarray(x.nm_mask & (own != 0))
    return _as_2d(mask), (1, 1), f"{x.n}:{x.m}, density {mask.mean():.3f}"
  if isinstance(x, MaskedLinear | MaskedConv):
    mask = _as_2d(np.asarray(x.mask[...]))
    return mask, (1, 1), f"unstructured, density {mask.mean():.3f}"
  if isinstance(x, CSRMatrix):
    return np.asarray(x.mask), (1, 1), f"unstructured, density {x.density:.3f}"
  if isinstance(x, np.ndarray | jax.Array) and x.dtype == np.bool_ and x.ndim >= 2:
    if x.size == 0:
      raise ValueError(f"plot_pattern: the mask is empty (shape {x.shape}); nothing to draw.")
    mask = _as_2d(np.asarray(x))
    return mask, (1, 1), f"density {mask.mean():.3f}"
  raise TypeError(
      "plot_pattern takes a jaxsparse layer (BlockSparseLinear, MaskedLinear, MaskedConv, NMLinear, NMConv, "
      "CompressedNMLinear, CompressedNMEmbed, SparseLinearGeneral), a "
      "Linen layer's variables {'params': ..., 'sparsity': ...}, a "
      f"BlockSparseMatrix, CSRMatrix or NMSparseMatrix, or a bool mask of 2 or more dims; got {type(x).__name__}."
  )


def pattern_image(mask: np.ndarray, max_pixels: int) -> tuple[np.ndarray, tuple[int, int]]:
  """The fraction of kept entries in each ``(fr, fc)`` tile of ``mask``, with at most ``max_pixels`` a side.

  >>> import numpy as np
  >>> from jaxsparse._plot import pattern_image
  >>> image, tile = pattern_image(np.eye(4, dtype=bool), max_pixels=2)
  >>> image.tolist(), tile
  ([[0.5, 0.0], [0.0, 0.5]], (2, 2))

  Returns:
    ``(image, tile)``: float ``(ceil(rows / fr), ceil(cols / fc))`` in [0, 1], and the tile shape.
    Tiles at the edges that run past ``mask`` count only the entries they cover.
  """
  rows, cols = mask.shape
  fr, fc = max(1, math.ceil(rows / max_pixels)), max(1, math.ceil(cols / max_pixels))
  pr, pc = -rows % fr, -cols % fc
  kept = np.pad(mask.astype(np.float64), ((0, pr), (0, pc)))
  valid = np.pad(np.ones(mask.shape), ((0, pr), (0, pc)))
  shape = (kept.shape[0] // fr, fr, kept.shape[1] // fc, fc)
  return kept.reshape(shape).sum(axis=(1, 3)) / valid.reshape(shape).sum(axis=(1, 3)), (fr, fc)


def plot_pattern(
    x: Any,
    ax: Any = None,
    *,
    crop: tuple[int, int] | None = None,
    max_pixels: int = 256,
    title: str | None = None,
):
  """Draws which weights a layer or sparse matrix keeps (black: kept, white: pruned).

  Rows are input features and columns output features (the Flax ``(in, out)`` kernel layout); a
  convolution's ``(*kernel_size, cin, cout)`` kernel is drawn as ``(prod(kernel_size) * cin, cout)``.
  A pattern wider or taller than ``max_pixels`` is drawn as a density image: each pixel is the fraction
  kept in its tile, so a 4096 x 4096 layer draws as fast as a small one.

  >>> import matplotlib
  >>> matplotlib.use("Agg")
  >>> from flax import nnx
  >>> import jaxsparse
  >>> layer = jaxsparse.layers.BlockSparseLinear(512, 1024, density=0.25, block_shape=(32, 32), rngs=nnx.Rngs(0))
  >>> ax = jaxsparse.plot_pattern(layer)
  >>> ax.get_title()
  'block 32x32, density 0.250'

  Args:
    x: a jaxsparse layer (``BlockSparseLinear``, ``MaskedLinear``, ``MaskedConv``, ``NMLinear``,
      ``NMConv``, ``CompressedNMLinear``, ``CompressedNMEmbed``, ``SparseLinearGeneral``), the variables of one Linen
      ``BlockSparseDense`` / ``MaskedDense`` (``{"params": ..., "sparsity": ...}``), a
      ``BlockSparseMatrix``, ``CSRMatrix`` or ``NMSparseMatrix``, or a bool mask (for N:M Linen layers:
      ``jaxsparse.nm_mask(kernel, n, m)``; for a ``CompressedNMDense``: its ``NMSparseMatrix``).
    ax: the matplotlib ``Axes`` to draw on; ``None`` makes a new figure.
    crop: ``(rows, cols)``: draw only this top-left corner of the kernel, e.g. ``(32, 32)`` to see
      the 2:4 groups of a large layer.
    max_pixels: the most pixels a side before the pattern is drawn as a density image.
    title: the axes title; ``None`` describes the pattern.

  Returns:
    The ``Axes`` drawn on.

  Raises:
    TypeError: ``x`` is none of the above (e.g. a float or 1-D mask, a dense ``nnx.Linear``), or Linen
      variables of a whole model (not of one layer) or of a ``CompressedNMDense`` (whose ``n:m`` they do not hold).
    ValueError: ``max_pixels`` is not a positive int; ``crop`` is not a pair of positive ints; ``x`` is an
      abstract layer (from ``nnx.eval_shape``), an empty pattern (a mask or matrix with a zero-size dim) or a 1-D
      ``NMSparseMatrix``.
    ImportError: matplotlib is not installed.
  """
  try:
    import matplotlib.pyplot as plt  # noqa: PLC0415 -- matplotlib is optional
  except ImportError as e:
    raise ImportError("plot_pattern needs matplotlib: pip install matplotlib") from e
  max_pixels = _utils.check_positive_int(max_pixels, name="max_pixels")
  if crop is not None:
    try:
      crop = _utils.check_dims(crop, name="crop", ndim=2, minimum=1)  # also NumPy ints; never bools
    except ValueError:
      raise ValueError(f"crop must be a pair of positive ints (rows, cols), got crop={crop!r}.") from None
  mask, (bk, bn), description = _pattern(x)
  height, width = mask.shape[0] * bk, mask.shape[1] * bn
  if height == 0 or width == 0:
    raise ValueError(f"plot_pattern: the pattern is empty ({height}x{width}); nothing to draw.")
  if crop is not None:
    height, width = min(crop[0], height), min(crop[1], width)
    # Whole tiles (blocks) covering the crop, drawn with the crop's extent.
    mask = mask[: math.ceil(height / bk), : math.ceil(width / bn)]
  image, (fr, fc) = pattern_image(mask, max_pixels)
  if ax is None:
    _, ax = plt.subplots(figsize=(5, 5 * min(max(height / width, 0.25), 4)))
  ax.imshow(
      image,
      cmap="Greys",
      vmin=0.0,
      vmax=1.0,
      interpolation="nearest",
      aspect="auto",
      extent=(0, image.shape[1] * fc * bn, image.shape[0] * fr * bk, 0),
  )
  ax.set_xlim(0, width)
  ax.set_ylim(height, 0)
  ax.set(xlabel="output feature", ylabel="input feature")
  if fr > 1 or fc > 1:
    description += f", {fr * bk}x{fc * bn} tiles"
  ax.set_title(description if title is None else title)
  return ax
