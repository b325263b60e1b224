"""Tile configs of the Mosaic GPU block-sparse kernels (:mod:`._block_sparse_matmul_mgpu`) and the limits they fit.

Plain Python, no Mosaic GPU import; the kernel module imports them from here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["MAX_ACC_ELEMENTS", "MAX_STAGES", "MosaicBlockSparseMatmulConfig", "MosaicKernelConfig"]

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
SUPPORTED_BLOCK_DIMS = (32, 64, 128)
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
NUM_COMPUTE_WGS = 2  # the compute warpgroups of a thread block, tile_m / 2 rows each
MAX_ACC_ELEMENTS = 128 * 128
# The deepest load ring the default configs take (where shared memory allows). Against 4 slots on an H200
# (benchmarks/results/gpu_mosaic_stages_2026-11-26_h200.md), 6-8 slots took 5-20% off the 128-row tiles of 32- and
# 64-blocks and 4-7% off the 256-row tiles of 32-blocks; 8 was within 1-2% of 6; more than 8 was not measured.
MAX_STAGES = 8
SMEM_BYTES = 227 * 1024  # shared memory a Hopper thread block may allocate


@dataclasses.dataclass(frozen=True)
class MosaicKernelConfig:
  """Tiling of the Mosaic GPU dense x sparse kernel.

  Attributes:
    tile_m: rows of ``a`` per output tile, split between the two compute warpgroups: 128 or 256.
    tile_k: contraction depth of one pipeline step (a divisor of the contraction block): 32 or 64
      (float32 inputs: 32, one 128-byte swizzle row).
    num_stages: shared-memory slots in the load ring (each holds one ``a`` tile and one ``B`` tile).
    group_m: output tiles are visited ``group_m`` row tiles at a time (per block column), so that the
      tiles running together share their ``a`` rows in L2.
    num_ctas: thread blocks of the persistent grid; ``None`` means one per streaming multiprocessor,
      ``0`` one per output tile (a plain grid, scheduled by the hardware).
    epi_n: output columns stored per epilogue step (a divisor of the output block width).
    group_cols: output block columns per output tile. With ``group_cols = G > 1`` a tile covers ``G``
      neighbouring output block columns, walks the union of their kept blocks' ``a`` blocks, loads
      each ``a`` tile once for all ``G`` columns and runs the MMA of each column only where that
      column keeps the block (``G`` float32 accumulators): fewer ``a`` reads from L2 for small blocks,
      the limit of blocks of 32 and 64 (see the module docstring). The default configs choose it where it
      measured faster (``MosaicRules.group_cols``: float32 blocks of 32 and 64, 16-bit blocks of 64,
      from density 0.2 where enough grouped tiles remain to fill the GPU).
    split: parts the steps of each output tile are split into, each run by its own tile of the grid into its
      own float32 partial sum (added afterwards, one XLA pass over ``split x M x`` output columns): more tiles
      where the output has too few to fill the GPU and each walks many steps (narrow layers and mid-size
      ``M``; ``SplitRules``).
    balance: how the persistent thread blocks share the output tiles. 0: round-robin in the grouped order
      (``group_m``), each thread block taking every ``num_ctas``-th tile; tiles of columns that keep more blocks
      take longer, and the thread block dealt the most steps sets the kernel's time. ``B > 0``: the grouped order
      is cut into windows of ``B`` rounds (``B x num_ctas`` tiles), each window sorted by the tiles' steps, and
      the tiles are dealt back and forth (:func:`jaxsparse.pallas._common.balanced_order`), so that each thread
      block's steps come out about equal while the tiles in flight stay within a window of the grouped order.
      The default configs deal round-robin; measured dispatch also times ``balance=2`` for 16-bit products of
      128-wide output blocks with more tiles than SMs (H200: 0.91-0.97x round-robin's time on 7 of 18 such
      products, up to 1.13x on the others, where the rows in flight outgrow L2).
    dynamic: take the tiles from a counter instead of dealing them: each thread block, as it starts a tile, takes
      the next tile of the order (grouped, or balanced with ``balance``) with an atomic add on a counter in global
      memory, so that a thread block whose tiles ran short takes more of them and all finish within about one
      tile of each other, while the tiles in flight stay neighbours in the order. Needs the persistent grid
      (``num_ctas`` not 0). The default configs deal round-robin; measured dispatch also times ``dynamic=True`` for
      products of more tiles than SMs (H200: 0.88x round-robin's time at 1536 tiles of 128-blocks, up to 1.09x at
      2-6 tiles a thread block). A batch (``vmap`` of the kernel) runs round-robin.

  Used as ``mosaic_forward`` / ``mosaic_dx`` of a :class:`~jaxsparse.pallas.BlockSparseMatmulConfig`; the
  kernel needs a Hopper GPU, the config does not:

  >>> from jaxsparse import pallas
  >>> cfg = pallas.MosaicKernelConfig(tile_m=128, group_cols=2)
  >>> cfg.tile_m, cfg.tile_k, cfg.group_cols, cfg.num_ctas
  (128, 64, 2, None)
  >>> tiles = pallas.BlockSparseMatmulConfig(forward=pallas.KernelConfig(block_m=128),
  ...                                        dx=pallas.KernelConfig(block_m=128), dw=pallas.KernelConfig(block_m=32),
  ...                                        mosaic_forward=cfg)
  >>> tiles.mosaic_forward.group_cols
  2
  """

  tile_m: int = 256
  tile_k: int = 64
  num_stages: int = 4
  group_m: int = 4
  num_ctas: int | None = None
  epi_n: int = 64
  group_cols: int = 1
  split: int = 1
  balance: int = 0
  dynamic: bool = False

  def __post_init__(self):
    if self.tile_m not in (128, 256):
      raise ValueError(f"tile_m must be 128 or 256 (64 or 128 rows per compute warpgroup), got tile_m={self.tile_m}.")
    if self.tile_k not in (32, 64):
      raise ValueError(f"tile_k must be 32 or 64, got tile_k={self.tile_k}.")
    if self.epi_n not in (32, 64, 128):
      raise ValueError(f"epi_n must be 32, 64 or 128, got epi_n={self.epi_n}.")
    for name in ("num_stages", "group_m"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {name}={getattr(self, name)}.")
    if self.num_ctas is not None and self.num_ctas < 0:
      raise ValueError(f"num_ctas must be None, 0 or positive, got num_ctas={self.num_ctas}.")
    if self.group_cols not in (1, 2, 4, 8):
      raise ValueError(f"group_cols must be 1, 2, 4 or 8, got group_cols={self.group_cols}.")
    if not 1 <= self.split <= 16:
      raise ValueError(f"split must be between 1 and 16, got split={self.split}.")
    if not 0 <= self.balance <= 64:
      raise ValueError(f"balance must be between 0 (round-robin) and 64 rounds, got balance={self.balance}.")
    if self.dynamic and self.num_ctas == 0:
      raise ValueError("dynamic=True takes tiles on the persistent grid: num_ctas must be None or positive, got 0.")

  def smem_bytes(self, ob: int, itemsize: int, out_itemsize: int) -> int:
    """Shared memory the kernel allocates for output blocks ``ob`` wide (a split stores float32 partial sums).

    Args:
      ob: the width of an output block: ``bn`` for the forward, ``bk`` for ``dx``.
      itemsize: bytes per element of the inputs.
      out_itemsize: bytes per element of the output.

    Returns:
      The bytes (an int): the load ring (``num_stages`` slots of one ``a`` tile and ``group_cols`` ``B`` tiles)
      plus the epilogue's staging tile.

    >>> from jaxsparse import pallas
    >>> pallas.MosaicKernelConfig(tile_m=128, num_stages=4).smem_bytes(128, 2, 2)  # bf16 blocks of 128
    147456
    """
    ring = self.num_stages * (self.tile_m * self.tile_k + self.group_cols * self.tile_k * ob) * itemsize
    return ring + self.tile_m * min(self.epi_n, ob) * (4 if self.split > 1 else out_itemsize)

  def deepest_ring(self, ob: int, itemsize: int, out_itemsize: int) -> MosaicKernelConfig:
    """This config with the most ring slots, up to :data:`MAX_STAGES`, that fit shared memory (227 KiB).

    Args:
      ob: the width of an output block: ``bn`` for the forward, ``bk`` for ``dx``.
      itemsize: bytes per element of the inputs.
      out_itemsize: bytes per element of the output.

    Returns:
      A ``MosaicKernelConfig`` equal to this one but for ``num_stages``; 2 slots where not even 3 fit (check
      :meth:`smem_bytes` then: 2 may not fit either).

    >>> from jaxsparse import pallas
    >>> pallas.MosaicKernelConfig(tile_m=128).deepest_ring(128, 2, 2).num_stages
    6
    """
    for stages in range(MAX_STAGES, 2, -1):
      cfg = dataclasses.replace(self, num_stages=stages)
      if cfg.smem_bytes(ob, itemsize, out_itemsize) <= SMEM_BYTES:
        return cfg
    return dataclasses.replace(self, num_stages=2)

  def acc_elements(self, ob: int) -> int:
    """Float32 accumulator elements per compute warpgroup for output blocks ``ob`` wide.

    Args:
      ob: the width of an output block: ``bn`` for the forward, ``bk`` for ``dx``.

    Returns:
      ``tile_m // 2 * group_cols * ob`` (an int); the default configs keep it at most :data:`MAX_ACC_ELEMENTS`
      (128 x 128: 128 registers per thread).

    >>> from jaxsparse import pallas
    >>> pallas.MosaicKernelConfig(tile_m=256, group_cols=2).acc_elements(64)
    16384
    """
    return self.tile_m // NUM_COMPUTE_WGS * self.group_cols * ob


@dataclasses.dataclass(frozen=True)
class MosaicBlockSparseMatmulConfig:
  """Tile configs of the Mosaic GPU forward (``x @ W``) and ``dX = dY @ Wᵀ`` kernels."""

  forward: MosaicKernelConfig = MosaicKernelConfig()
  dx: MosaicKernelConfig = MosaicKernelConfig()

  @classmethod
  def get_default(
      cls,
      m: int,
      block_shape: tuple[int, int],
      dtype: jax.typing.DTypeLike,
      out_dtype: jax.typing.DTypeLike | None = None,
  ) -> MosaicBlockSparseMatmulConfig:
    """The config for ``m`` rows and ``block_shape`` blocks: the deepest ring that fits shared memory.

    Measured on an H100 at ``M = 8192`` (``benchmarks/gpu_block_sparse.py --mosaic-sweep``): 256-row tiles, a
    persistent grid, and 2 row tiles per group (``gpu_product_routes.py --variants``: 4 measured up to 0.3x slower
    for the forward of float32 blocks of 32 at K = 16384); the ring as deep as shared memory allows, up to
    :data:`MAX_STAGES` slots (``benchmarks/gpu_mosaic_stages.py``, H200).
    """
    bk, bn = block_shape
    itemsize = jnp.dtype(dtype).itemsize
    out_itemsize = jnp.dtype(out_dtype or dtype).itemsize

    def pick(ob: int, cb: int, group_m: int, transpose: bool) -> MosaicKernelConfig:
      tile_m = 256 if m > 128 else 128
      # One 128-byte swizzle row per step: 64 16-bit or 32 float32 elements.
      tile_k = min(128 // itemsize, cb)
      if itemsize == 2 and not transpose and ob == 32:
        tile_k = 32  # 16-bit forward B tiles with one side of 32 need the other 32 too (see unsupported_reason)
      base = MosaicKernelConfig(tile_m=tile_m, tile_k=tile_k, group_m=group_m, epi_n=min(64, ob))
      return base.deepest_ring(ob, itemsize, out_itemsize)

    return cls(forward=pick(bn, bk, 2, False), dx=pick(bk, bn, 2, True))
