"""What a torch-layout mask is: dense, N:M, block-structured or unstructured; and layout conversions.

Masks here are NumPy bool arrays in PyTorch layout: ``(out, in)`` for Linear, ``(out, in, *kernel)``
for Conv. N:M groups run along dim 1 (input features), as in apex ASP, ``torch.ao.pruning`` 2:4 and
``torch.sparse.to_sparse_semi_structured``; that is axis 0 of the Flax kernel.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxsparse.torch_interop._errors import CheckpointError

__all__ = ["Pattern", "check_mask", "detect_pattern", "flax_layout", "nm_mask_torch", "torch_layout", "zero_pattern"]

# 2:4 first: a 1:2 mask is also 2:4, the pattern sparse tensor cores run.
NM_GROUP_SIZES = (4, 2, 8, 16, 32)
# zero_pattern: the block sides it tries, and the share of a weight's zeros that must lie in all-zero blocks.
BLOCK_SIDES = (8, 16, 32, 64, 128)
BLOCK_COVER = 0.99


@dataclasses.dataclass(frozen=True)
class Pattern:
  """The structure of a mask.

  Attributes:
    kind: ``"dense"`` (all kept), ``"block"``, ``"nm"`` or ``"unstructured"``.
    density: fraction of entries kept.
    block_shape: for ``"block"``: ``(rows, cols)`` of one block in torch layout ``(out, in)``; the Flax
      ``(in, out)`` block shape is ``block_shape[::-1]``.
    n, m: for ``"nm"``: ``n`` of every ``m`` consecutive input features kept.

  :func:`detect_pattern` makes them; ``str()`` is the structure in words.

  >>> import numpy as np
  >>> from jaxsparse.torch_interop import detect_pattern
  >>> p = detect_pattern(np.tile([True, False, False, True], (8, 2)))
  >>> p.kind, p.density, p.n, p.m, str(p)
  ('nm', 0.5, 2, 4, '2:4')
  >>> str(detect_pattern(None)), detect_pattern(None).density
  ('dense', 1.0)
  """

  kind: str
  density: float
  block_shape: tuple[int, int] | None = None
  n: int | None = None
  m: int | None = None

  def __str__(self) -> str:
    if self.kind == "block":
      return f"block {self.block_shape[0]}x{self.block_shape[1]}"
    if self.kind == "nm":
      return f"{self.n}:{self.m}"
    return self.kind


def _constant_run(mask: np.ndarray, axis: int, size: int) -> bool:
  """Whether ``mask`` is constant over consecutive runs of ``size`` along ``axis``."""
  m = np.moveaxis(mask, axis, 0)
  m = m.reshape(m.shape[0] // size, size, *m.shape[1:])
  return bool(np.all(m == m[:, :1]))


def _largest_run(mask: np.ndarray, axis: int, max_block: int) -> int:
  size, best = 2, 1
  while size <= max_block and mask.shape[axis] % size == 0 and _constant_run(mask, axis, size):
    best, size = size, size * 2
  return best


def _nm_counts(mask: np.ndarray, m: int) -> np.ndarray:
  g = np.moveaxis(mask, 1, -1)
  return g.reshape(*g.shape[:-1], g.shape[-1] // m, m).sum(-1)


def check_mask(mask: np.ndarray, shape: tuple[int, ...], *, key: str) -> np.ndarray:
  """``mask`` of ``shape`` as a bool array: bool, or numbers that are all 0 or 1 (``torch.nn.utils.prune`` keeps its
  masks in the weight's dtype); else a :class:`CheckpointError` naming ``key``."""
  if tuple(mask.shape) != tuple(shape):
    raise CheckpointError(f"mask {key!r} has shape {tuple(mask.shape)} but its weight has shape {tuple(shape)}.")
  if mask.dtype == np.bool_:
    return mask
  if mask.dtype.kind not in "biuf" and mask.dtype.name != "bfloat16":
    raise CheckpointError(f"mask {key!r} has dtype {mask.dtype}; expected bool or numbers 0/1.")
  values = mask.astype(np.float64)  # exact for every mask dtype: 1 + 1e-12 (float64) is not 1
  bad = ~((values == 0) | (values == 1))
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise CheckpointError(
        f"mask {key!r} must hold only 0 and 1, but has {float(values[where])} at {where} "
        f"({int(bad.sum())} entries are not 0/1)."
    )
  return values == 1


def detect_pattern(mask: np.ndarray | None, *, min_block: int = 8, max_block: int = 128) -> Pattern:
  """Classifies a torch-layout bool mask.

  The checks run in this order: all kept is ``"dense"``; a 2-D mask constant over power-of-two blocks
  of at least ``min_block`` on each side (the largest such block up to ``max_block``) is ``"block"``;
  a mask of ndim >= 2 keeping exactly the same ``n`` of every ``m`` consecutive entries along dim 1,
  for the first ``m`` in ``(4, 2, 8, 16, 32)`` that fits, is ``"nm"``; anything else is
  ``"unstructured"``.

  >>> import numpy as np
  >>> from jaxsparse.torch_interop import detect_pattern
  >>> str(detect_pattern(np.tile([True, False, False, True], (8, 2))))
  '2:4'
  >>> str(detect_pattern(np.kron(np.eye(2, dtype=bool), np.ones((16, 32), bool))))
  'block 16x32'

  Args:
    mask: bool array in torch layout, or ``None`` (no mask: dense).
    min_block: smallest block side that counts as block structure.
    max_block: largest block side considered.

  Returns:
    A :class:`Pattern`.

  Raises:
    CheckpointError: (a ``ValueError``) a mask that is not boolean and holds values other than 0 and 1.
  """
  if mask is None:
    return Pattern("dense", 1.0)
  mask = np.asarray(mask)
  mask = check_mask(mask, mask.shape, key="detect_pattern(mask)")  # 0.5 was read as kept and 7 as one kept
  density = float(mask.mean()) if mask.size else 1.0
  if mask.all():
    return Pattern("dense", density)
  if mask.ndim == 2 and mask.any():
    b0 = _largest_run(mask, 0, max_block)
    b1 = _largest_run(mask, 1, max_block)
    if b0 >= min_block and b1 >= min_block:
      return Pattern("block", density, block_shape=(b0, b1))
  if mask.ndim >= 2:
    for m in NM_GROUP_SIZES:
      if mask.shape[1] % m:
        continue
      counts = _nm_counts(mask, m)
      n = int(counts.flat[0])
      if 0 < n < m and np.all(counts == n):
        return Pattern("nm", density, n=n, m=m)
  return Pattern("unstructured", density)


def zero_pattern(w: np.ndarray) -> Pattern:
  """The structure of the exact zeros of a dense torch-layout weight (a pruned weight stored dense), as the
  :class:`Pattern` of the entries a sparse layer keeping every nonzero would keep.

  The checks run in this order: no nonzero is ``"unstructured"`` of density 0; a 2-D weight whose zeros lie
  (``BLOCK_COVER`` of them) in all-zero blocks of power-of-two sides 8 to 128 is ``"block"`` (the largest such block,
  the squarest of equal areas; ``density``: the blocks holding a nonzero); one holding at most ``n`` nonzeros in every
  run of ``m`` consecutive entries along dim 1 (the inputs), ``n <= m / 2``, is ``"nm"`` (the smallest ``n / m``, 2:4
  first of equals; ``density``: ``n / m``); anything else is ``"unstructured"`` (``density``: the nonzeros).
  A weight without zeros is ``"dense"``. Each structure keeps every nonzero.

  >>> import numpy as np
  >>> from jaxsparse.torch_interop._patterns import zero_pattern
  >>> w = np.tile([0.0, 1.5, 0.0, -2.0], (8, 4))
  >>> str(zero_pattern(w)), zero_pattern(w).density
  ('2:4', 0.5)
  >>> w = np.kron([[1.0, 0.0], [0.0, 0.0]], np.ones((16, 32)))
  >>> str(zero_pattern(w)), zero_pattern(w).density
  ('block 16x32', 0.25)

  Args:
    w: a weight of ndim >= 2 (NumPy, any real dtype), in torch layout (``(out, in)``, ``(out, in, *kernel)``).

  Returns:
    A :class:`Pattern`.
  """
  nonzero = np.asarray(w) != 0
  kept = int(np.count_nonzero(nonzero))
  if kept == nonzero.size:
    return Pattern("dense", 1.0)
  if not kept:
    return Pattern("unstructured", 0.0)
  zeros = nonzero.size - kept
  blocks = []
  if nonzero.ndim == 2:
    rows, cols = nonzero.shape
    for b0 in (b for b in BLOCK_SIDES if rows % b == 0):
      by_rows = nonzero.reshape(rows // b0, b0, cols).any(1)
      for b1 in (b for b in BLOCK_SIDES if cols % b == 0):
        full = by_rows.reshape(rows // b0, cols // b1, b1).any(2)
        if (full.size - np.count_nonzero(full)) * b0 * b1 >= BLOCK_COVER * zeros:
          blocks.append((-b0 * b1, abs(b0 - b1), (b0, b1), float(full.mean())))
  if blocks:
    *_, shape, density = min(blocks)
    return Pattern("block", density, block_shape=shape)
  fits = []
  for order, m in enumerate(NM_GROUP_SIZES):
    if nonzero.shape[1] % m == 0:
      n = int(_nm_counts(nonzero, m).max())
      if n <= m // 2:
        fits.append((n / m, order, n, m))
  if fits:
    density, _, n, m = min(fits)
    return Pattern("nm", density, n=n, m=m)
  return Pattern("unstructured", kept / nonzero.size)


def nm_mask_torch(w: np.ndarray, n: int, m: int) -> np.ndarray:
  """Bool mask keeping the ``n`` largest ``|w|`` of every ``m`` consecutive entries along dim 1.

  Ties go to the lower index and NaN counts as largest, as in :func:`jaxsparse.nm_mask`. This is the mask
  NM-sparsity (SR-STE) layers apply in their forward pass to the dense weights they store. Magnitudes are compared in
  float32, or in float64 for float64 weights (as torch ranks them: float64 values that round to one float32 are no
  tie).
  """
  w = np.asarray(w)
  if w.ndim < 2:
    raise ValueError(f"an N:M mask needs a weight with at least 2 dimensions, got shape {w.shape}.")
  if not 0 < n < m:
    raise ValueError(f"n:m must satisfy 0 < n < m, got {n}:{m}.")
  if w.shape[1] % m:
    raise ValueError(f"m={m} must divide the input dimension (dim 1) of a weight of shape {w.shape}.")
  scores = np.abs(w.astype(np.float64 if w.dtype == np.float64 else np.float32))
  scores = np.where(np.isnan(scores), np.inf, scores)
  g = np.moveaxis(scores, 1, -1)
  g = g.reshape(*g.shape[:-1], g.shape[-1] // m, m)
  order = np.argsort(-g, axis=-1, kind="stable")
  rank = np.argsort(order, axis=-1, kind="stable")
  keep = (rank < n).reshape(*g.shape[:-2], g.shape[-2] * m)
  return np.moveaxis(keep, -1, 1)


def flax_layout(w: np.ndarray) -> np.ndarray:
  """A torch weight in Flax layout: Linear ``(out, in)`` -> ``(in, out)``, Conv ``(O, I, *k)`` -> ``(*k, I, O)``."""
  if w.ndim < 2:
    return w
  return np.transpose(w, (*range(2, w.ndim), 1, 0))


def torch_layout(k: np.ndarray) -> np.ndarray:
  """Inverse of :func:`flax_layout`: ``(in, out)`` -> ``(out, in)``, ``(*k, I, O)`` -> ``(O, I, *k)``."""
  if k.ndim < 2:
    return k
  nd = k.ndim
  return np.transpose(k, (nd - 1, nd - 2, *range(nd - 2)))
