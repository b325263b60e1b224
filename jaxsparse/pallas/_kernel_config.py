"""Tiles of the Triton block-sparse kernels (forward, ``dx`` and the sampled ``dw``) and the shared memory they use."""

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
      there are too few block columns to fill the GPU. ``dw`` programs own this many of their block's
      ``bk`` rows (``bk // sub_cols`` programs a kept block, each with a smaller accumulator): for large
      blocks at a few hundred rows, where one program a block leaves SMs idle. A power of two >= 16.
    block_order: the order in which ``dw`` programs take the kept blocks: ``"rows"`` (as stored, by
      block row) or ``"cols"`` (by block column: the programs in flight share ``dY`` slabs rather than
      ``x`` slabs). The Mosaic ``dw`` kernel measured faster in that order where ``N >= K`` (see
      :class:`~jaxsparse.pallas._block_sparse_sdd_mgpu.MosaicSddConfig`); this kernel where ``N >= 4 K``
      (16-bit, ``TritonRules.dw_cols_order_min_ratio``), ``"rows"`` elsewhere.
    group_blocks: ``dw`` programs compute up to this many consecutive kept blocks of one block row
      (:func:`~jaxsparse.pallas._common.items_of`), loading each step's ``x`` slab once for all of them, one
      ``dY`` slab each; ``1``: one block a program. For small blocks, whose programs are too short to hide their
      loads (32 x 32 blocks at a few hundred rows).

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
  group_blocks: int = 1

  def __post_init__(self):
    bm = self.block_m
    if bm < 16 or bm & (bm - 1):
      raise ValueError(f"block_m must be a power of two >= 16, got block_m={bm}.")
    sc = self.sub_cols
    if sc is not None and (sc < 16 or sc & (sc - 1)):
      raise ValueError(f"sub_cols must be None or a power of two >= 16, got sub_cols={sc}.")
    for name in ("num_warps", "num_stages", "group_m", "split", "group_blocks"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {name}={getattr(self, name)}.")
    if self.block_order not in ("rows", "cols"):
      raise ValueError(f"block_order must be 'rows' or 'cols', got block_order={self.block_order!r}.")


def staged_bytes(cfg: KernelConfig, direction: str, block_shape: tuple[int, int], itemsize: int) -> int:
  """Shared memory (bytes) one program of a Triton block-sparse kernel asks for, as an upper bound.

  Each step of the kernels stages one operand tile of ``x`` / ``dY`` and one of the weight (``dw``: of ``x`` and
  ``dY``). Measured on an H100 (2026-11-27, ``benchmarks/results/gpu_unseen_shapes_2026-11-27_h100.md``): 16-bit
  operands ask for ``num_stages`` copies of those tiles, float32 ones for ``num_stages - 1`` (at least one) and up to
  64 KiB of layout scratch. A config over the device's shared memory fails to compile (RESOURCE_EXHAUSTED).

  Args:
    cfg: the kernel's tiles.
    direction: ``"fwd"``, ``"dx"`` or ``"dw"``.
    block_shape: ``(bk, bn)`` of the weight's blocks.
    itemsize: bytes per element of the operands.

  Returns:
    The bytes, an int.

  >>> staged_bytes(KernelConfig(block_m=32, num_stages=2), "fwd", (256, 256), 4)  # over an H100's 232448
  360448
  >>> staged_bytes(KernelConfig(block_m=32, num_stages=2, sub_cols=128), "fwd", (256, 256), 4)
  229376
  """
  bk, bn = block_shape
  if direction == "fwd":
    tiles = cfg.block_m * bk + bk * min(cfg.sub_cols or bn, bn)
  elif direction == "dx":
    tiles = cfg.block_m * bn + min(cfg.sub_cols or bk, bk) * bn
  elif direction == "dw":
    tiles = cfg.block_m * (min(cfg.sub_cols or bk, bk) + cfg.group_blocks * bn)
  else:
    raise ValueError(f"direction must be 'fwd', 'dx' or 'dw', got {direction!r}.")
  if itemsize == 2:
    return cfg.num_stages * tiles * itemsize
  return max(cfg.num_stages - 1, 1) * tiles * itemsize + 64 * 1024


def fit_shared_memory(
    cfg: KernelConfig, direction: str, block_shape: tuple[int, int], itemsize: int, limit: int
) -> KernelConfig | None:
  """``cfg`` with fewer stages, narrower programs or fewer rows until :func:`staged_bytes` fits ``limit``.

  In that order: stages down to 2, then (forward / ``dx``) sub-column programs down to 16 columns, then rows down
  to 16, then one stage.

  Args:
    cfg: the kernel's tiles.
    direction: ``"fwd"``, ``"dx"`` or ``"dw"``.
    block_shape: ``(bk, bn)`` of the weight's blocks.
    itemsize: bytes per element of the operands.
    limit: the device's shared memory per thread block, in bytes (``DispatchRules.shared_memory_bytes``).

  Returns:
    The fitted :class:`KernelConfig` (``cfg`` itself where it fits), or ``None`` where even the smallest does not.

  >>> fit_shared_memory(KernelConfig(block_m=32, num_stages=2), "fwd", (256, 256), 4, 232448).sub_cols
  128
  """
  ob = block_shape[1] if direction == "fwd" else block_shape[0]
  while staged_bytes(cfg, direction, block_shape, itemsize) > limit:
    sub = min(cfg.sub_cols or ob, ob)
    if cfg.num_stages > 2:
      cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    elif direction != "dw" and sub > 16:
      cfg = dataclasses.replace(cfg, sub_cols=sub // 2)
    elif cfg.block_m > 16:
      cfg = dataclasses.replace(cfg, block_m=cfg.block_m // 2)
    elif cfg.num_stages > 1:
      cfg = dataclasses.replace(cfg, num_stages=1)
    else:
      return None
  return cfg
