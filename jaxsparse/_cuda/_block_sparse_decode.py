"""The block-sparse decode kernel (``block_sparse_decode.cu``): ``x @ W`` for a few rows of ``x`` and a
:class:`jaxsparse.BlockSparseMatrix` ``W`` whose block dims are multiples of 64, its work split (config), the default
per product and the configs measured dispatch times (their names are the tuning cache's).

The kernel streams each kept block as 64 x 64 tiles by bulk tensor copies (TMA) into a ring of shared memory per
warp and multiplies them on the tensor cores (``mma.sync``), ``x`` as 8 rows (rows past ``M`` are zeros): the decode
rows of a block-sparse layer read its kept blocks once, at the rate of the memory, where the Pallas kernels tile
for many rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import _utils
from jaxsparse._cuda import _kernels

__all__ = [
    "BS_DECODE_MAX_ROWS", "BlockSparseDecodeConfig", "block_sparse_decode", "block_sparse_decode_candidates",
    "block_sparse_decode_prepare", "block_sparse_decode_shared_bytes", "block_sparse_decode_unsupported_reason",
]

BS_DECODE_MAX_ROWS = 8  # one tile of 8 tokens
BS_DECODE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MAX_SHARED_BYTES = 200 * 1024  # launch_checks.h's kMaxBlockSparseDecodeSharedBytes
_SPLITS = (1, 2, 4, 8)
_TARGET_WARPS = 512  # warps in all the default aims at (about 4 a multiprocessor of an H100 / H200)


def block_sparse_decode_shared_bytes(warps: int, stages: int) -> int:
  """Dynamic shared memory of a build: each warp's ring of ``stages`` units (a 64 x 64 tile of ``W`` and 8 x 64 of
  ``x``, 9 KB), and 1 KB of alignment slack (launch_checks.h's ``BlockSparseDecodeSharedBytes``).

  >>> block_sparse_decode_shared_bytes(4, 2)
  74752
  """
  return warps * stages * 9216 + 1024


@dataclasses.dataclass(frozen=True)
class BlockSparseDecodeConfig:
  """Work split of :func:`block_sparse_decode`.

  Attributes:
    warps: warps per thread block (1-8, a multiple of ``bn / 64``): warp ``w`` takes the block's 64-column box
      ``w % (bn / 64)`` and every ``warps / (bn / 64)``-th tile of it.
    split: thread blocks per block column (1, 2, 4 or 8), each a slice of its kept blocks; they form a cluster and add
      their partial sums through distributed shared memory.
    stages: tiles in flight per warp (2-4; :func:`block_sparse_decode_shared_bytes` at most 200 KB).

  >>> BlockSparseDecodeConfig(warps=4, split=2, stages=3).name
  'w4s2lt3'
  """

  warps: int = 4
  split: int = 1
  stages: int = 2

  def __post_init__(self):
    if self.warps not in range(1, 9):
      raise ValueError(f"BlockSparseDecodeConfig: warps must be 1-8, got {self.warps!r}.")
    if self.split not in _SPLITS:
      raise ValueError(f"BlockSparseDecodeConfig: split must be one of {_SPLITS}, got {self.split!r}.")
    if self.stages not in (2, 3, 4):
      raise ValueError(f"BlockSparseDecodeConfig: stages must be 2, 3 or 4, got {self.stages!r}.")
    if block_sparse_decode_shared_bytes(self.warps, self.stages) > _MAX_SHARED_BYTES:
      raise ValueError(f"BlockSparseDecodeConfig: warps={self.warps} x stages={self.stages} need "
                       f"{block_sparse_decode_shared_bytes(self.warps, self.stages)} bytes of shared memory, at most "
                       f"{_MAX_SHARED_BYTES}.")

  @property
  def name(self) -> str:
    return f"w{self.warps}s{self.split}lt{self.stages}"

  def check(self, block_shape: tuple[int, int]) -> None:
    """Raises ``ValueError`` where this config cannot run blocks of ``block_shape``."""
    boxes = block_shape[1] // 64
    if self.warps % boxes:
      raise ValueError(f"BlockSparseDecodeConfig {self.name}: warps={self.warps} must be a multiple of bn / 64 = "
                       f"{boxes} for blocks {tuple(block_shape)}.")

  @staticmethod
  def get_default(m: int, k: int, n: int, block_shape: tuple[int, int], nnz: int) -> BlockSparseDecodeConfig:
    """The config with tuning off: about 512 warps in all (4 a thread block, 2 where the block columns alone give
    over 1024), the split of each block column doubled while that holds and each warp keeps at least 4 tiles, two
    stages. Fitted on an H200 (24 products of 1-8 rows, blocks 64 and 128, density 0.2-0.7: the best of 7 configs
    each had 256-900 warps; ``benchmarks/results/llm_decode_block_decode_2026-12-02_h200.md``).

    >>> BlockSparseDecodeConfig.get_default(1, 4096, 4096, (64, 64), 2048)
    BlockSparseDecodeConfig(warps=4, split=2, stages=2)
    >>> BlockSparseDecodeConfig.get_default(1, 4096, 28672, (64, 64), 14336)
    BlockSparseDecodeConfig(warps=2, split=1, stages=2)
    """
    del m, k  # the work split follows the block columns and the tiles; rows up to 8 cost the same loads
    boxes = block_shape[1] // 64
    warps = boxes * max(1, 4 // boxes)
    columns, units = n // block_shape[1], nnz * (block_shape[0] // 64) * boxes
    if columns * warps > 2 * _TARGET_WARPS and (warps // 2) % boxes == 0 and warps // 2 >= boxes:
      warps //= 2
    split = 1
    while (split < 8 and columns * warps * split * 2 <= _TARGET_WARPS
           and units >= 4 * columns * warps * split * 2):
      split *= 2
    return BlockSparseDecodeConfig(warps=warps, split=split)


def block_sparse_decode_candidates(m: int, k: int, n: int, block_shape: tuple[int, int], nnz: int
                                   ) -> list[BlockSparseDecodeConfig]:
  """The configs measured dispatch times for a product, the default first: it, the split halved and doubled, half
  and twice the warps (alone, and with the split the other way: the same warps in all), and a third stage.

  >>> [c.name for c in block_sparse_decode_candidates(1, 4096, 4096, (64, 64), 2048)]
  ['w4s2lt2', 'w4s1lt2', 'w4s4lt2', 'w2s2lt2', 'w8s2lt2', 'w8s1lt2', 'w2s4lt2', 'w4s2lt3']
  """
  base = BlockSparseDecodeConfig.get_default(m, k, n, block_shape, nnz)
  out = [base]

  def add(warps=base.warps, split=base.split, stages=base.stages):
    try:
      cfg = BlockSparseDecodeConfig(warps=warps, split=split, stages=stages)
      cfg.check(block_shape)
    except ValueError:
      return
    if cfg not in out:
      out.append(cfg)

  w, s = base.warps, base.split
  for warps, split in ((w, s // 2), (w, s * 2), (w // 2, s), (w * 2, s), (w * 2, s // 2), (w // 2, s * 2)):
    if warps >= 1 and split >= 1:
      add(warps=warps, split=split)
  add(stages=3)
  return out


def block_sparse_decode_unsupported_reason(m: int, k: int, n: int, block_shape: tuple[int, int], dtype, out_dtype
                                           ) -> str:
  """Why :func:`block_sparse_decode` cannot take an ``(m, k) @ (k, n)`` product, or ``""``."""
  dtype, out_dtype = jnp.dtype(dtype), jnp.dtype(out_dtype)
  if dtype not in BS_DECODE_DTYPES:
    return f"x and the blocks must be bfloat16 or float16, got {dtype}"
  if out_dtype not in (dtype, jnp.dtype(jnp.float32)):
    return f"the output must be {dtype} or float32, got {out_dtype}"
  if not 1 <= m <= BS_DECODE_MAX_ROWS:
    return f"M must be between 1 and {BS_DECODE_MAX_ROWS}, got M={m}"
  bk, bn = block_shape
  if bk % 64 or bn % 64 or bk > 256 or bn > 256:
    return f"block dims must be among 64, 128, 192, 256, got {tuple(block_shape)}"
  if k > _kernels.MAX_DIM or n > _kernels.MAX_DIM:
    return f"K and N must be at most 2**30, got K={k}, N={n}"
  return ""


def _defines(block_shape, cfg: BlockSparseDecodeConfig, dtype, out_dtype) -> tuple[tuple[str, int], ...]:
  return (
      ("BS_BK", block_shape[0]), ("BS_BN", block_shape[1]), ("BS_WARPS", cfg.warps), ("BS_SPLIT", cfg.split),
      ("BS_STAGES", cfg.stages), ("BS_F16", int(jnp.dtype(dtype) == jnp.float16)),
      ("BS_OUT_F32", int(jnp.dtype(out_dtype) == jnp.float32)),
  )


def block_sparse_decode_prepare(m: int, k: int, n: int, block_shape: tuple[int, int], nnz: int, dtype, out_dtype,
                                config: BlockSparseDecodeConfig | None = None) -> str:
  """Builds the kernel of ``config`` (default: the default config) once per process (NVRTC's output is cached on
  disk); why it cannot run, or ``""``. Thread-safe."""
  reason = (_kernels.unavailable_reason()
            or block_sparse_decode_unsupported_reason(m, k, n, block_shape, dtype, out_dtype))
  if reason:
    return reason
  cfg = config or BlockSparseDecodeConfig.get_default(m, k, n, block_shape, nnz)
  try:
    cfg.check(block_shape)
    _kernels.kernel_id("block_sparse_decode.cu", "block_sparse_decode", _defines(block_shape, cfg, dtype, out_dtype))
  except (RuntimeError, ValueError) as e:
    return str(e)
  return ""


def block_sparse_decode(x: jax.Array, data: jax.Array, col_offsets: jax.Array, transpose_order: jax.Array,
                        row_indices: jax.Array, n: int, *, config: BlockSparseDecodeConfig | None = None,
                        out_dtype=None) -> jax.Array:
  """``x (M, K) @ W`` -> ``(M, N)`` for a block-sparse ``W`` given as :class:`jaxsparse.BlockSparseMatrix` stores it.

  Index arrays are read as they are, never outside their arrays (a bad block id or row reads zeros; see
  ``block_sparse_decode.cu``): :meth:`jaxsparse.BlockSparseMatrix.validate` checks them.

  Args:
    x: ``(M, K)`` bfloat16 or float16, ``1 <= M <= 8``.
    data: ``(nnz, bk, bn)`` of ``x``'s dtype, the kept blocks (``bk``, ``bn`` among 64, 128, 192, 256).
    col_offsets: ``(N / bn + 1,)`` int32; transpose_order, row_indices: ``(nnz,)`` int32 (the matrix's fields).
    n: ``N``, the columns of ``W``.
    config: work split; default :meth:`BlockSparseDecodeConfig.get_default`.
    out_dtype: ``x``'s dtype (the default) or float32.

  Returns:
    ``(M, N)`` of ``out_dtype``: products accumulate in float32.
  """
  if getattr(x, "ndim", None) != 2 or getattr(data, "ndim", None) != 3:
    raise ValueError(f"block_sparse_decode: x must be 2-D and data 3-D, got x {getattr(x, 'shape', None)} and data "
                     f"{getattr(data, 'shape', None)}.")
  if config is not None and not isinstance(config, BlockSparseDecodeConfig):
    raise TypeError(f"block_sparse_decode: config must be a BlockSparseDecodeConfig or None, got "
                    f"{type(config).__name__}.")
  (m, k), (nnz, bk, bn) = x.shape, data.shape
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  reason = block_sparse_decode_unsupported_reason(m, k, n, (bk, bn), x.dtype, out_dtype)
  if not reason and data.dtype != x.dtype:
    reason = f"data must be of x's dtype {x.dtype}, got {data.dtype}"
  if not reason and (k % bk or n % bn):
    reason = f"K and N must be multiples of the block ({bk}, {bn})"
  want = ((n // bn + 1,), (nnz,), (nnz,))
  got = tuple(getattr(a, "shape", None) for a in (col_offsets, transpose_order, row_indices))
  if not reason and (got != want or any(a.dtype != jnp.int32 for a in (col_offsets, transpose_order, row_indices))):
    reason = f"col_offsets, transpose_order and row_indices must be int32 of shapes {want}, got {got}"
  if reason:
    raise ValueError(f"block_sparse_decode cannot run for x {x.shape} and W ({k}, {n}) in blocks ({bk}, {bn}): "
                     f"{reason}.")
  if nnz == 0:  # nothing kept (the kernel's tensor map needs a block)
    return jnp.zeros((m, n), out_dtype)
  cfg = config or BlockSparseDecodeConfig.get_default(m, k, n, (bk, bn), nnz)
  cfg.check((bk, bn))
  kid = _kernels.kernel_id("block_sparse_decode.cu", "block_sparse_decode", _defines((bk, bn), cfg, x.dtype, out_dtype))
  operands = _utils.vary_alike(x, data, col_offsets, transpose_order, row_indices)
  out = _utils.result_struct((m, n), out_dtype, *operands)
  return jax.ffi.ffi_call("jaxsparse_block_sparse_decode", out, vmap_method="sequential")(
      *operands, kernel=np.int64(kid), bk=np.int64(bk), bn=np.int64(bn), warps=np.int64(cfg.warps),
      split=np.int64(cfg.split), stages=np.int64(cfg.stages), f16=bool(x.dtype == jnp.float16),
      out_f32=bool(out_dtype == jnp.float32))
