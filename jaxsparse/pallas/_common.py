"""What the Pallas GPU kernels share: availability on this process's devices, the float32 / TF32 rule,
the tile walk of a 2-D program grid and the float32-accumulating dot."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxsparse._utils import FallbackWarning
from jaxsparse.formats._base import IndexedSparseMatrix
from jaxsparse.formats._base import is_concrete
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._nm import NMSparseMatrix
from jaxsparse.formats._nm import index_layout

__all__ = [
    "PallasFallbackWarning",
    "allows_tf32",
    "available",
    "balanced_order",
    "check_pattern",
    "chunk",
    "dealt",
    "dealt_count",
    "dot",
    "grouped_tile",
    "items_of",
    "pad_rows",
    "unavailable_reason",
    "whole_block",
]

_MIN_COMPUTE_CAPABILITY = 8.0


class PallasFallbackWarning(FallbackWarning):
  """The Pallas GPU kernels do not support these dtypes or shapes; the XLA path runs instead.

  Issued on a GPU where the kernels run, when a product with ``implementation=None`` gets operands they do not
  support. To make it an error:

  >>> import warnings, jaxsparse.pallas
  >>> with warnings.catch_warnings():
  ...   warnings.simplefilter("error", jaxsparse.pallas.PallasFallbackWarning)
  >>> issubclass(jaxsparse.pallas.PallasFallbackWarning, jaxsparse.FallbackWarning)
  True
  """


@functools.cache
def _probe() -> str | None:
  """``None`` when the kernels can run on this process's devices, else why not."""
  try:
    gpus = jax.devices("cuda")
  except RuntimeError as e:
    return f"no CUDA GPU backend is present ({e})"
  caps = [float(getattr(d, "compute_capability", "0")) for d in gpus]
  if not caps or max(caps) < _MIN_COMPUTE_CAPABILITY:
    return f"the Triton-lowered Pallas kernels need compute capability >= 8.0, found {caps}"
  return None


def available() -> bool:
  """True when a CUDA GPU of compute capability 8.0 or later is present."""
  return _probe() is None


def unavailable_reason() -> str:
  """Why :func:`available` is False (empty when it is True)."""
  return _probe() or ""


def allows_tf32(precision: lax.PrecisionLike) -> bool:
  """Whether a float32 product at ``precision`` may run on TF32 tensor cores, as XLA's GPU dots do.

  ``None`` follows ``jax_default_matmul_precision`` (unset: DEFAULT). DEFAULT and HIGH allow TF32;
  HIGHEST (``"float32"``) and explicit algorithms other than TF32 do not.
  """
  if precision is None:
    precision = jax.config.jax_default_matmul_precision
    if precision is None:
      return True
  if isinstance(precision, (tuple, list)):
    return all(allows_tf32(p) for p in precision)
  if isinstance(precision, lax.DotAlgorithmPreset):
    return precision in (lax.DotAlgorithmPreset.DEFAULT, lax.DotAlgorithmPreset.TF32_TF32_F32)
  try:
    return lax.Precision(precision) != lax.Precision.HIGHEST
  except (TypeError, ValueError):
    return False


def grouped_tile(pid, num_m: int, num_n: int, group_m: int):
  """Program (or output tile) number -> ``(row tile, column)``, walking ``group_m`` row tiles per column first.

  Within a group of ``group_m`` row tiles, row tiles vary fastest, then columns; the last group may be shorter.
  Every ``(row tile, column)`` pair gets exactly one number in ``[0, num_m * num_n)``.
  """
  width = group_m * num_n
  first_m = (pid // width) * group_m
  size = jnp.minimum(num_m - first_m, group_m)
  r = pid % width
  return first_m + r % size, r // size


def dealt(i, worker, num_workers: int, snake: bool):
  """The position in a sequence of work items that ``worker`` takes on its ``i``-th turn.

  Items are dealt to ``num_workers`` persistent workers (thread blocks) a round of ``num_workers`` at a time:
  in round ``i`` worker ``k`` takes position ``i * num_workers + k``, or with ``snake`` ``num_workers - 1 - k`` in
  odd rounds (back and forth, so that a worker served first in one round is served last in the next). Plain
  ``jnp`` on scalars, shared by the kernels and the CPU tests; :func:`dealt_count` is how many turns a worker has.
  """
  if not snake:
    return i * num_workers + worker
  return i * num_workers + jnp.where(i % 2 == 0, worker, num_workers - 1 - worker)


def dealt_count(worker, num_items: int, num_workers: int, snake: bool):
  """How many of ``num_items`` items :func:`dealt` gives ``worker``: every position ``< num_items`` exactly once."""
  rounds, rest = divmod(num_items, num_workers)
  last = dealt(rounds, worker, num_workers, snake) - rounds * num_workers  # the worker's place in the last round
  return rounds + jnp.where(last < rest, 1, 0)


def balanced_order(weights: jax.Array, num_workers: int, window: int) -> jax.Array:
  """A reordering of work items that :func:`dealt` with ``snake`` spreads evenly over the workers.

  The items, in their given order (the order that keeps the tiles running together sharing their inputs in
  L2), are cut into windows of ``window`` rounds (``window * num_workers`` items); each window is sorted by weight,
  heaviest first (ties keep their order). Dealt back and forth, the workers of a window take items of falling
  weight in turns, the heaviest of one round paired with the lightest of the next, so that their sums stay close,
  while the items in flight stay within one window of the given order. ``window = 0`` keeps the order.

  Args:
    weights: ``(num_items,)`` non-negative int32 cost of each item (an output tile's steps).
    num_workers: the persistent workers the items are dealt to.
    window: rounds per sorted window; 0 for none.

  Returns:
    ``(num_items,)`` int32: the item at each position of the dealt sequence (a permutation of
    ``arange(num_items)``).

  >>> import jax.numpy as jnp
  >>> from jaxsparse.pallas._common import balanced_order
  >>> balanced_order(jnp.array([1, 5, 2, 5, 0, 3], jnp.int32), num_workers=2, window=2).tolist()
  [1, 3, 2, 0, 5, 4]
  """
  n = weights.shape[0]
  size = window * num_workers
  if window == 0 or n <= num_workers:
    return jnp.arange(n, dtype=jnp.int32)
  num_windows = -(-n // size)
  # One int32 key an item: heavier first, then the given order; padding (past the last item) sorts last.
  top = jnp.max(weights, initial=0) + 1
  pos = jnp.arange(num_windows * size, dtype=jnp.int32)
  w = jnp.concatenate([weights.astype(jnp.int32), jnp.full(num_windows * size - n, -1, jnp.int32)])
  key = (top - w) * size + pos % size
  local = jnp.sort(key.reshape(num_windows, size), axis=1) % size
  order = (local + jnp.arange(num_windows, dtype=jnp.int32)[:, None] * size).reshape(-1)
  return order[:n]


def chunk(start, end, part, parts: int):
  """The part ``part`` (of ``parts`` equal parts, the last ones shorter or empty) of the range ``[start, end)``.

  Plain ``jnp`` on scalars: the split contraction of the forward / ``dx`` kernels (Triton and Mosaic GPU),
  shared with the CPU tests. The parts partition the range; an empty part has ``lo == hi``.
  """
  if parts == 1:
    return start, end
  size = (end - start + parts - 1) // parts
  lo = jnp.minimum(start + part * size, end)
  return lo, jnp.minimum(lo + size, end)


def pad_rows(a: jax.Array, multiple: int) -> jax.Array:
  """``a`` with zero rows appended up to a multiple of ``multiple`` rows (``a`` itself if it is one)."""
  pad = -a.shape[0] % multiple
  return a if pad == 0 else jnp.pad(a, ((0, pad), (0, 0)))


def dot(a, b, contract, *, compute_dtype, precision):
  return lax.dot_general(
      a.astype(compute_dtype),
      b.astype(compute_dtype),
      (contract, ((), ())),
      precision=precision,
      preferred_element_type=jnp.float32,
  )


def check_pattern(w, *, op: str) -> None:
  """Rejects a weight whose index arrays a kernel would read out of bounds, before it is launched.

  The kernels index ``x`` / ``dY`` / the output with the stored pattern and check nothing on the device. A
  hand-built or tree-mapped matrix (``validate=False``, ``jax.tree.map``) skips the constructors' checks, so the
  entry points check again: the shapes and dtypes of the index arrays always (static), and, when they are concrete,
  their values (:meth:`~jaxsparse.BlockSparseMatrix.validate`: indices inside the grid, row-major order, offsets
  and transpose order as the indices imply; for :class:`~jaxsparse.NMSparseMatrix`, positions inside their group).
  Traced arrays are checked by the constructors that built them.

  Raises:
    ValueError: naming ``op``, the field and the bad value.
  """
  try:
    if isinstance(w, IndexedSparseMatrix):
      w._check_static()
      if all(is_concrete(getattr(w, f)) for f in w.INDEX_FIELDS):
        w.validate()
    elif isinstance(w, NMSparseMatrix):
      dtype, per_word = index_layout(w.n, w.m, w.groups)
      want = (*w.shape[: w.axis], w.groups // per_word, *w.shape[w.axis + 1 :])
      if tuple(w.indices.shape) != want or w.indices.dtype != dtype:
        raise ValueError(f"NMSparseMatrix.indices must be {dtype} of shape {want}, got {w.indices.dtype} "
                         f"{tuple(w.indices.shape)}.")
      if is_concrete(w.indices):
        w.validate()
  except ValueError as e:
    raise ValueError(f"{op}: the weight's pattern is invalid: {e}") from None


def whole_block(shape: tuple[int, ...], grid_rank: int) -> pl.BlockSpec:
  """A BlockSpec that hands a kernel of a ``grid_rank``-D grid the whole array (index arrays, block data)."""
  zeros = (0,) * len(shape)
  return pl.BlockSpec(shape, lambda *_: zeros) if grid_rank else pl.BlockSpec(shape, lambda: zeros)


def items_of(w: BlockSparseMatrix, group: int, order: str = "rows") -> tuple[jax.Array, ...]:
  """Work items: runs of up to ``group`` consecutive kept blocks of one block row.

  The ``dw`` kernels' schedule (Mosaic GPU: :mod:`._block_sparse_sdd_mgpu`; Triton: ``KernelConfig.group_blocks``).
  Items are ordered by block row (``order="rows"``) or by the block column of their first block
  (``"cols"``; ties by row); see :class:`MosaicSddConfig`.

  Returns:
    ``(num_items, rows, blocks, cols)``: ``num_items`` ``(1,)`` int32, the number of real items;
    ``rows`` ``(max_items,)`` the block row of each item; ``blocks`` / ``cols`` ``(max_items * group,)``
    the positions in ``data`` and block columns of each item's blocks, a short item repeating its
    last block. Entries past ``num_items`` are padding (valid indices, never visited).
  """
  if order not in ("rows", "cols"):
    raise ValueError(f"order must be 'rows' or 'cols', got order={order!r}.")
  nnz, (kb, nb) = w.nnz_blocks, w.grid_shape
  max_items = max(1, min(nnz, -(-nnz // group) + kb))
  t = jnp.arange(nnz, dtype=jnp.int32)
  row = w.row_indices
  starts_here = (t - w.row_offsets[row]) % group == 0
  num_items = jnp.sum(starts_here, dtype=jnp.int32).reshape(1)
  starts = jnp.nonzero(starts_here, size=max_items, fill_value=0)[0].astype(jnp.int32)
  if order == "cols":
    # Real items first (padding keeps its place past num_items), by first column, then row.
    key = w.col_indices[starts] * kb + row[starts]
    starts = starts[jnp.argsort(jnp.where(jnp.arange(max_items) < num_items[0], key, kb * nb))]
  rows = row[starts]
  last = w.row_offsets[rows + 1] - 1
  blocks = jnp.minimum(starts[:, None] + jnp.arange(group, dtype=jnp.int32), last[:, None]).reshape(-1)
  return num_items, rows, blocks, w.col_indices[blocks]
