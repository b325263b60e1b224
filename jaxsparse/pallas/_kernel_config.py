"""Tiles of the Triton block-sparse kernels (forward, ``dx`` and the sampled ``dw``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Tiling of one kernel.

  Attributes:
    block_m: rows of ``x`` / ``dY`` per program (forward and ``dx``), or per reduction step (``dw``).
      A power of two, at least 16.
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining depth of the loop over blocks.
    group_m: output tiles are visited in groups of ``group_m`` row tiles so that programs running
      together share their ``x`` rows and ``W`` columns in L2 (forward and ``dx``).
    split: split the loop over kept blocks (forward, ``dx``) or over ``M`` (``dw``) into this many
      programs whose partial sums are added afterwards; for small ``M`` (decode) or few kept blocks.
    index_window: forward and ``dx`` load the block indices of their column / row once, as one
      vector, and pick each step's index from registers, so that the addresses of the next blocks do
      not wait on memory and the loads can be pipelined.
    sub_cols: forward and ``dx`` programs own this many output columns of their block (of ``bn``
      in the forward, of ``bk`` in ``dx``), so that a block column feeds ``bn // sub_cols``
      programs without a reduction afterwards; ``None`` for the whole block. For decode, where
      there are too few block columns to fill the GPU. A power of two >= 16.
    block_order: the order in which ``dw`` programs take the kept blocks: ``"rows"`` (as stored, by
      block row) or ``"cols"`` (by block column: the programs in flight share ``dY`` slabs rather than
      ``x`` slabs). The Mosaic ``dw`` kernel measured faster in that order where ``N >= K`` (see
      :class:`~jaxsparse.pallas._block_sparse_sdd_mgpu.MosaicSddConfig`); this kernel where ``N >= 4 K``
      (16-bit, ``TritonRules.dw_cols_order_min_ratio``), ``"rows"`` elsewhere.

  Built and checked on any machine (the kernels it tiles need a CUDA GPU):

  >>> from jaxsparse import pallas
  >>> cfg = pallas.KernelConfig(block_m=64, num_warps=8)
  >>> cfg.block_m, cfg.num_warps, cfg.split, cfg.block_order
  (64, 8, 1, 'rows')
  >>> pallas.KernelConfig(block_m=48)
  Traceback (most recent call last):
  ...
  ValueError: block_m must be a power of two >= 16, got block_m=48.
  """

  block_m: int
  num_warps: int = 4
  num_stages: int = 3
  group_m: int = 8
  split: int = 1
  index_window: bool = True
  sub_cols: int | None = None
  block_order: str = "rows"

  def __post_init__(self):
    bm = self.block_m
    if bm < 16 or bm & (bm - 1):
      raise ValueError(f"block_m must be a power of two >= 16, got block_m={bm}.")
    sc = self.sub_cols
    if sc is not None and (sc < 16 or sc & (sc - 1)):
      raise ValueError(f"sub_cols must be None or a power of two >= 16, got sub_cols={sc}.")
    for name in ("num_warps", "num_stages", "group_m", "split"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {name}={getattr(self, name)}.")
    if self.block_order not in ("rows", "cols"):
      raise ValueError(f"block_order must be 'rows' or 'cols', got block_order={self.block_order!r}.")
