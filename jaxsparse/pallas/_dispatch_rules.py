"""The measured rules that choose the block-sparse kernels and tiles: one :class:`DispatchRules` table per GPU kind.

A table is composed of typed per-route defaults: :class:`TritonRules` (the Triton forward / ``dx`` / ``dw``
tiles), :class:`TritonDecodeRules` (the Triton forward / ``dx`` at decode size), :class:`MosaicRules` (the Mosaic
GPU forward / ``dx``), :class:`MosaicDwRules` (the Mosaic GPU sampled ``dw``), :class:`SplitRules` (split
contractions, one per kernel) and :class:`DenseRules` (where products run as dense XLA products). The rule
functions that read them are in :mod:`._block_sparse_config`.

Each value of :data:`HOPPER_RULES` names the results file that set it (paths under ``benchmarks/results/``); the
measurement itself is told, one section a field, in ``benchmarks/results/dispatch_rules_notes_2026-11-26.md``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import NamedTuple

import jax

from jaxsparse.pallas._kernel_config import KernelConfig

try:  # Mosaic GPU (Hopper) configs.
  from jaxsparse.pallas import _block_sparse_matmul_mgpu as mosaic
  from jaxsparse.pallas import _block_sparse_sdd_mgpu as mosaic_sdd
except ImportError:  # a jax without Mosaic GPU: the Triton kernels only.
  mosaic = mosaic_sdd = None

__all__ = [
    "DISPATCH_TABLES",
    "HOPPER_RULES",
    "DenseRules",
    "DispatchRules",
    "MosaicDwRules",
    "MosaicRules",
    "SplitRules",
    "TritonDecodeRules",
    "TritonRules",
    "dispatch_rules",
]


class TritonTiles(NamedTuple):
  """Tuned Triton tiles of the three products of one block size."""

  forward: KernelConfig
  dx: KernelConfig
  dw: KernelConfig


class MosaicTiles(NamedTuple):
  """Tuned Mosaic GPU tiles of the forward and ``dx`` products of one block size."""

  forward: mosaic.MosaicKernelConfig
  dx: mosaic.MosaicKernelConfig


class SubColumns(NamedTuple):
  """The :class:`KernelConfig` fields of decode forward programs that own a slice of a block column."""

  sub_cols: int
  split: int
  num_stages: int


class RowBand(NamedTuple):
  """Rows ``lo <= m <= hi`` (``hi=None``: no upper bound)."""

  lo: int
  hi: int | None


class MinRowsAndBlock(NamedTuple):
  """The smallest ``M`` and the smallest block dim a kernel takes."""

  min_m: int
  min_block: int


class GroupCols(NamedTuple):
  """Grouped-column Mosaic tiles (``MosaicKernelConfig.group_cols``) from a density where tiles remain."""

  min_density: float
  group: int
  min_tiles_per_sm: int


class MinBlocks(NamedTuple):
  """From ``min_m`` rows where at least ``min_blocks`` blocks are kept."""

  min_m: int
  min_blocks: int


class LongContraction(NamedTuple):
  """The dense route of a long contraction from this density, for inputs of at least this itemsize."""

  min_density: float
  min_itemsize: int


@dataclasses.dataclass(frozen=True)
class SplitRules:
  """Where one kernel splits each forward / ``dx`` output tile's steps above decode size (``contraction_split``).

  The largest power of two up to ``max_parts`` that keeps ``tiles x parts`` within ``programs_per_sm`` a SM, at
  least ``min_steps`` steps a part, and the float32 partial sums (``parts x M x out_cols``) at most
  ``max_sum_bytes`` times the kept weight's bytes.
  """

  programs_per_sm: int  # tiles x parts at most this many programs a SM
  min_steps: int  # steps a part at least (Mosaic: pipeline steps; Triton: kept blocks)
  max_parts: int  # parts at most
  max_sum_bytes: float  # float32 partial sums at most this many times the kept weight's bytes


@dataclasses.dataclass(frozen=True)
class TritonRules:
  """Tiles of the Triton forward, ``dx`` and ``dw`` kernels above decode size."""

  tuned_min_m: int  # 16-bit square blocks take ``tuned`` from this M
  tuned: Mapping[int, TritonTiles]  # {square block dim: (forward, dx, dw) tiles}
  mid_small_tile_max_m: int  # 16-bit rows above decode size up to which forward / dx take 64-row tiles
  dw_cols_order_min_ratio: int  # 16-bit dw visits kept blocks by block column from N >= ratio * K
  split: SplitRules  # split contractions of the forward / dx


@dataclasses.dataclass(frozen=True)
class TritonDecodeRules:
  """The Triton forward and ``dx`` at decode size, where their output tiles cannot fill the GPU."""

  split_depth_bytes: int  # split loops into parts of about this many bytes of contraction an output column
  split_max: int  # ... in at most this many parts (a power of two)
  sub_cols_min_block: int  # 16-bit forward: sub-column programs for output blocks at least this wide
  sub_cols_max_blocks: int  # ... with at most this many kept blocks a block column
  sub_cols: SubColumns  # ... and these tiles
  forward_warps: Mapping[tuple[int, int], int]  # {(itemsize, output block width): num_warps} of the forward


@dataclasses.dataclass(frozen=True)
class MosaicRules:
  """Where the Mosaic GPU (Hopper) forward / ``dx`` kernels replace Triton's, and their tiles."""

  min_rows_and_block: Mapping[int, MinRowsAndBlock]  # {itemsize: smallest M, smallest block dim}
  rows_16bit: Mapping[int, tuple[RowBand, ...]]  # 16-bit: {smaller block side: row bands taken}
  tuned_min_m: int  # 16-bit square blocks take ``tuned`` from this M; below it the mid-size tiles
  tuned: Mapping[int, MosaicTiles]  # {square block dim: (forward, dx) tiles}
  mid_tiles: int  # mid-size M: 256-row tiles where they still give this many output tiles
  mid_max_pad: Mapping[int, float]  # ... and pad M by at most this fraction of it, {itemsize: fraction}
  group_cols: Mapping[tuple[int, int], GroupCols]  # {(itemsize, output block dim): grouped-column rule}
  split: SplitRules  # split contractions of the forward / dx


@dataclasses.dataclass(frozen=True)
class MosaicDwRules:
  """Where the Mosaic GPU sampled ``dw`` (SDD) kernel replaces Triton's, and its tiles."""

  min_m: Mapping[int, int]  # {itemsize: smallest M}
  tuned_16bit: Mapping[tuple[int, int], mosaic_sdd.MosaicSddConfig]  # {block shape: 16-bit config}
  b64_long_ratio: int  # 16-bit 64-blocks: always where max(K, N) >= ratio * min(K, N)
  b64_min_m: int  # ... else from this M
  b64_min_m_dense_or_wide: int  # ... or from this M at density >= b64_density or N >= 2 K
  b64_density: float
  b64_rows_order_below_m: int  # ... items by block row below this M
  b128_min_blocks: tuple[MinBlocks, ...]  # 16-bit 128-blocks: where any (min M, min kept blocks) holds


@dataclasses.dataclass(frozen=True)
class DenseRules:
  """Where products run as dense XLA products instead of per-block kernels."""

  min_m: int  # the all-dense and long-contraction routes from this M
  above_density: Mapping[tuple[int, int], float]  # all three dense: {(min block dim, itemsize): above density}
  above_density_long: Mapping[tuple[int, int], float]  # ... instead, for blocks at least 4x as long as they are wide
  long_contraction_min: int  # forward / dx on the weight built dense from this contraction
  long_contraction: Mapping[int, LongContraction]  # ... {min block dim: (from density, from itemsize)}
  dw_min_m: int  # dw as the dense xᵀdY plus a gather: from this M
  dw_max_grid_per_sm: float  # ... where the whole grid of blocks is at most this many a SM
  dw_below_block: int  # ... for blocks below this dim (off the Mosaic kernel)
  dw_min_density: float  # ... from this density
  dw_above_density: Mapping[int, float]  # ... {block dim: from density} off the Mosaic float32 kernel
  dw_above_density_min_m: int  # ... 16-bit from this M


@dataclasses.dataclass(frozen=True)
class DispatchRules:
  """The measured thresholds and tuned tiles that choose the block-sparse kernels on one GPU kind.

  :func:`dispatch_rules` picks the table of the device that runs the product from :data:`DISPATCH_TABLES`;
  :meth:`~jaxsparse.pallas.BlockSparseMatmulConfig.get_default` (and the rule functions below it) read only this
  data. The run that set each value of :data:`HOPPER_RULES` is named beside it and told in
  ``benchmarks/results/dispatch_rules_notes_2026-11-26.md``. On a GPU these are the defaults that measured
  dispatch starts from (:func:`jaxsparse.set_autotune_mode`).

  Attributes:
    measured_on: the GPUs the values were measured on (or why a table borrows another's values).
    num_sms: streaming multiprocessors of the device; with ``programs_per_sm`` the number of programs wanted in
      flight (``target_programs``), below which decode splits its loops.
    programs_per_sm: programs in flight per SM that fill the GPU.
    decode_max_m: rows up to which products are decode-size: the Triton forward / ``dx`` split their loops or use
      sub-column programs (``triton_decode``), and no kernel splits its contraction (``SplitRules``).
    triton: tiles of the Triton kernels (:class:`TritonRules`).
    triton_decode: the Triton forward / ``dx`` at decode size (:class:`TritonDecodeRules`).
    mosaic: where the Mosaic GPU forward / ``dx`` kernels run, and their tiles (:class:`MosaicRules`).
    mosaic_dw: where the Mosaic GPU ``dw`` kernel runs, and its tiles (:class:`MosaicDwRules`).
    dense: where products run as dense XLA products (:class:`DenseRules`).
    shared_memory_bytes: shared memory one thread block may use on the device; the Triton tiles are cut to fit it
      (:func:`~jaxsparse.pallas._kernel_config.fit_shared_memory`).

  A frozen dataclass of frozen per-route dataclasses: to try other thresholds, change a copy and pass it as
  ``rules``.

  >>> import dataclasses, jax.numpy as jnp
  >>> from jaxsparse import pallas
  >>> rules = pallas.dispatch_rules("NVIDIA H100 80GB HBM3", num_sms=132)
  >>> rules.num_sms, rules.target_programs, rules.dense.min_m
  (132, 264, 1024)
  >>> fewer = dataclasses.replace(rules, num_sms=66)
  >>> fewer.target_programs
  132
  >>> later = dataclasses.replace(rules, dense=dataclasses.replace(rules.dense, min_m=2048))
  >>> cfg = pallas.BlockSparseMatmulConfig.get_default(1024, (4096, 4096), (32, 32), 8192, jnp.bfloat16, rules=later)
  >>> cfg.dense
  False
  """

  measured_on: str
  num_sms: int
  programs_per_sm: int
  decode_max_m: int
  triton: TritonRules
  triton_decode: TritonDecodeRules
  mosaic: MosaicRules
  mosaic_dw: MosaicDwRules
  dense: DenseRules
  shared_memory_bytes: int

  @property
  def target_programs(self) -> int:
    """Programs wanted in flight at once."""
    return self.programs_per_sm * self.num_sms


# The H100 and H200 (SXM, 132 SMs each; same SM, the H200 with more and faster HBM): the points re-measured
# on the H200 agreed with the H100's, except the decode rule of 2026-11-25 (triton_decode.sub_cols_max_blocks,
# measured on the H200 only: at d = 0.25 it keeps what the H100 measured). Comments name the results file behind
# each value (under benchmarks/results/; dispatch_rules_notes_2026-11-26.md tells the measurement).
HOPPER_RULES = DispatchRules(
    measured_on="NVIDIA H100 and H200 (SXM)",
    num_sms=132,
    programs_per_sm=2,  # dispatch_rules_notes_2026-11-26.md
    decode_max_m=64,  # gpu_block_sparse_mid_2026-11-24_h100.md
    triton=TritonRules(
        tuned_min_m=1024,  # gpu_block_sparse_2026-11-21_h200.md
        tuned={  # gpu_block_sparse_2026-11-21_h200.md; blocks of 32: archive/gpu_product_routes_2026-11-23_h100.md
            32: TritonTiles(
                KernelConfig(256, num_warps=4, num_stages=5, group_m=1, index_window=False),
                KernelConfig(256, num_warps=4, num_stages=5, group_m=1, index_window=False),
                KernelConfig(128, num_warps=4, num_stages=2),
            ),
            64: TritonTiles(
                KernelConfig(128, num_warps=4, num_stages=3),
                KernelConfig(128, num_warps=4, num_stages=3, group_m=16),
                KernelConfig(32, num_warps=4, num_stages=3),
            ),
            128: TritonTiles(
                KernelConfig(128, num_warps=8, num_stages=3, group_m=4),
                KernelConfig(128, num_warps=4, num_stages=3, group_m=4),
                KernelConfig(64, num_warps=4, num_stages=3),
            ),
        },
        mid_small_tile_max_m=256,  # gpu_block_sparse_mid_2026-11-24_h100.md
        dw_cols_order_min_ratio=4,  # archive/gpu_nm_decode_2026-11-23_h100.md
        split=SplitRules(  # archive/gpu_split_2026-11-25_h200.md
            programs_per_sm=8,
            min_steps=10,
            max_parts=8,
            max_sum_bytes=1.5,
        ),
    ),
    triton_decode=TritonDecodeRules(
        split_depth_bytes=512,  # archive/gpu_decode_split_2026-11-25_h200.md
        split_max=8,  # archive/gpu_decode_split_2026-11-25_h200.md
        sub_cols_min_block=128,  # gpu_decode_2026-11-23_h100.md
        sub_cols_max_blocks=8,  # gpu_decode_2026-11-25_h200.md
        sub_cols=SubColumns(sub_cols=32, split=1, num_stages=4),  # gpu_decode_2026-11-23_h100.md
        # 32 wide: archive/gpu_decode_32_2026-11-25_h200.md; 16 wide: gpu_unseen_shapes_2026-11-27_h100_seed53.md
        forward_warps={(2, 32): 2, (2, 16): 1, (4, 16): 1},
    ),
    mosaic=MosaicRules(
        min_rows_and_block={  # archive/gpu_unseen_shapes_2026-11-25_h200.md
            2: MinRowsAndBlock(128, 32),
            4: MinRowsAndBlock(128, 32),
        },
        rows_16bit={  # gpu_block_sparse_mid_2026-11-24_h100.md; blocks of 32: archive/gpu_dw_kernels_2026-11-24_h100.md
            32: (RowBand(128, 256),),
            64: (RowBand(128, 512), RowBand(1024, None)),
            128: (RowBand(512, None),),
        },
        tuned_min_m=1024,  # gpu_block_sparse_2026-11-23_h100.md (--mosaic-sweep)
        tuned=(  # group_m: archive/gpu_product_routes_2026-11-23_h100.md
            {}
            if mosaic is None
            else {
                64: MosaicTiles(mosaic.MosaicKernelConfig(group_m=2), mosaic.MosaicKernelConfig(group_m=2)),
                128: MosaicTiles(mosaic.MosaicKernelConfig(group_m=2), mosaic.MosaicKernelConfig(group_m=2)),
            }
        ),
        mid_tiles=128,  # gpu_block_sparse_mid_2026-11-24_h100.md
        mid_max_pad={2: 0.0, 4: 0.125},  # archive/gpu_split_2026-11-25_h200.md
        group_cols={  # archive/gpu_group_cols_2026-11-25_h200.md; 64-wide from d = 0.2: gpu_h100_state_2026-11-26.md
            (4, 32): GroupCols(0.2, 4, 1),
            (4, 64): GroupCols(0.2, 2, 2),
            (2, 64): GroupCols(0.2, 2, 4),
        },
        split=SplitRules(  # archive/gpu_split_2026-11-25_h200.md
            programs_per_sm=1,
            min_steps=12,
            max_parts=8,
            max_sum_bytes=1.5,
        ),
    ),
    mosaic_dw=MosaicDwRules(
        min_m={2: 1024, 4: 128},  # archive/gpu_dw_kernels_2026-11-24_h100.md
        tuned_16bit=(  # archive/gpu_mosaic_stages_2026-11-26_h200.md
            {} if mosaic_sdd is None else {(64, 64): mosaic_sdd.MosaicSddConfig(group=2, tile_m=64, num_stages=6)}
        ),
        b64_long_ratio=4,  # archive/gpu_dw_kernels_2026-11-24_h100.md
        b64_min_m=8192,  # archive/gpu_dw_kernels_2026-11-24_h100.md
        b64_min_m_dense_or_wide=4096,  # archive/gpu_dw_kernels_2026-11-24_h100.md
        b64_density=0.4,  # archive/gpu_dw_kernels_2026-11-24_h100.md
        b64_rows_order_below_m=2048,  # archive/gpu_dw_kernels_2026-11-24_h100.md
        b128_min_blocks=(MinBlocks(1024, 1024), MinBlocks(8192, 512)),  # archive/gpu_dw_kernels_2026-11-24_h100.md
    ),
    dense=DenseRules(
        min_m=1024,  # archive/gpu_product_routes_2026-11-23_h100.md
        above_density={  # gpu_block_sparse_2026-11-23_h100.md; float32: archive/gpu_group_cols_2026-11-25_h200.md
            (16, 2): 0.0,
            (16, 4): 0.0,
            (32, 2): 0.3,
            (32, 4): 0.5,
        },
        above_density_long={(16, 2): 0.15},  # gpu_unseen_shapes_2026-11-27_h100.md
        long_contraction_min=16384,  # archive/gpu_product_routes_2026-11-23_h100.md
        long_contraction={  # archive/gpu_product_routes_2026-11-23_h100.md
            32: LongContraction(0.1, 4),
            64: LongContraction(0.4, 4),
        },
        dw_min_m=256,  # archive/gpu_product_routes_2026-11-23_h100.md
        dw_max_grid_per_sm=1.0,  # archive/gpu_unseen_shapes_2026-11-25_h200.md
        dw_below_block=64,  # archive/gpu_product_routes_2026-11-23_h100.md
        dw_min_density=0.1,  # archive/gpu_product_routes_2026-11-23_h100.md
        dw_above_density={64: 0.4},  # archive/gpu_product_routes_2026-11-23_h100.md
        dw_above_density_min_m=8192,  # archive/gpu_dw_kernels_2026-11-24_h100.md
    ),
    shared_memory_bytes=232448,  # compute capability 9.0's opt-in maximum (227 KiB; the H100's compile errors say so)
)

# Shared memory a thread block may use (the opt-in maximum) on kinds without a table of their own, by substrings of
# jax's device_kind: compute capability 9.0 / 10.x (H800, H20, B200) as the H100's table, 8.0 / 8.7 (A100, A30, Orin)
# 163 KiB; other kinds (8.6, 8.9, 12.x: 99 KiB) get the smallest.
_SHARED_MEMORY: tuple[tuple[tuple[str, ...], int], ...] = (
    (("H800", "H20", "GH200", "B100", "B200", "GB200"), HOPPER_RULES.shared_memory_bytes),
    (("A100", "A800", "A30", "Orin"), 166912),
)
_SHARED_MEMORY_OTHER = 101376

# ``(substrings of jax's device_kind, rules)``; the first whose substring is in the device's kind wins.
DISPATCH_TABLES: tuple[tuple[tuple[str, ...], DispatchRules], ...] = ((("H100", "H200"), HOPPER_RULES),)


def dispatch_rules(device_kind: str | None = None, num_sms: int | None = None) -> DispatchRules:
  """The dispatch table of a GPU kind (by default the first device's), with its SM count.

  Args:
    device_kind: ``jax.Device.device_kind``, e.g. ``"NVIDIA H100 80GB HBM3"``; ``None``: the first device's.
    num_sms: the device's streaming multiprocessors; ``None``: the device's ``core_count`` where
      ``device_kind`` is also ``None``, else the table's.

  Returns:
    The table in :data:`DISPATCH_TABLES` whose kind matches. A kind without a table (measured on
    none of our machines) gets :data:`HOPPER_RULES`, marked as borrowed; ``num_sms`` replaces the
    table's SM count, so that the program counts of decode follow the device.

  >>> from jaxsparse import pallas
  >>> rules = pallas.dispatch_rules("NVIDIA H100 80GB HBM3", num_sms=132)
  >>> rules.measured_on, rules.num_sms
  ('NVIDIA H100 and H200 (SXM)', 132)
  >>> pallas.dispatch_rules("NVIDIA A100-SXM4-80GB", num_sms=108).measured_on
  "NVIDIA H100 and H200 (SXM); borrowed for 'NVIDIA A100-SXM4-80GB'"
  """
  if device_kind is None:
    device = jax.devices()[0]
    device_kind = device.device_kind
    if num_sms is None:
      try:
        num_sms = int(device.core_count) or None
      except (AttributeError, RuntimeError, TypeError, ValueError):  # not every backend reports it
        num_sms = None
  if num_sms is not None and (not isinstance(num_sms, int) or num_sms < 1):
    raise ValueError(f"num_sms must be None or a positive int, got num_sms={num_sms!r}.")
  return _dispatch_rules(device_kind, num_sms)


@functools.cache
def _dispatch_rules(device_kind: str, num_sms: int | None) -> DispatchRules:
  rules = next((r for kinds, r in DISPATCH_TABLES if any(k in device_kind for k in kinds)), None)
  if rules is None:
    # The CPU (interpret mode: no shared memory limit) keeps the borrowed table's value.
    other = HOPPER_RULES.shared_memory_bytes if device_kind == "cpu" else _SHARED_MEMORY_OTHER
    smem = next((b for kinds, b in _SHARED_MEMORY if any(k in device_kind for k in kinds)), other)
    rules = dataclasses.replace(
        HOPPER_RULES, measured_on=f"{HOPPER_RULES.measured_on}; borrowed for {device_kind!r}", shared_memory_bytes=smem
    )
  return rules if num_sms in (None, rules.num_sms) else dataclasses.replace(rules, num_sms=num_sms)
