"""Tile configs of the Triton block-sparse kernels and the measured rules that choose between kernels.

The defaults are data: one :class:`DispatchRules` table per GPU kind (tuned tiles per block shape / M,
thresholds; the measurement behind each value is in ``benchmarks/results/dispatch_rules_notes_2026-11-26.md``),
picked by :func:`dispatch_rules` from the device's
``device_kind`` and SM count. One function turns a product and a table into a config,
``BlockSparseMatmulConfig.get_default``; its parts are ``mosaic_defaults``, ``contraction_split``,
``mosaic_dw_default``, ``use_dense``, ``use_dense_long_contraction`` and ``use_dense_dw``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxsparse.formats._block_sparse import BlockSparseMatrix

try:  # Mosaic GPU (Hopper) configs.
  from jaxsparse.pallas import _block_sparse_matmul_mgpu as mosaic
  from jaxsparse.pallas import _block_sparse_sdd_mgpu as mosaic_sdd
except ImportError:  # a jax without Mosaic GPU: the Triton kernels only.
  mosaic = mosaic_sdd = None

@functools.cache
def _mosaic_probe() -> str | None:
  """``None`` when the Mosaic GPU kernels can run on this process's devices, else why not."""
  if mosaic is None:
    return "this jax has no Mosaic GPU (jax.experimental.pallas.mosaic_gpu)"
  try:
    gpus = jax.devices("cuda")
  except RuntimeError as e:
    return f"no CUDA GPU backend is present ({e})"
  caps = [float(getattr(d, "compute_capability", "0")) for d in gpus]
  if not caps or not all(9.0 <= c < 10.0 for c in caps):
    return f"the Mosaic GPU kernels use wgmma, which needs compute capability 9.x (Hopper), found {caps}"
  return None


def mosaic_available() -> bool:
  """True when the Mosaic GPU (Hopper) forward and ``dx`` kernels can run here."""
  return _mosaic_probe() is None


def mosaic_unavailable_reason() -> str:
  """Why :func:`mosaic_available` is False (empty when it is True)."""
  return _mosaic_probe() or ""


# -------------------------------------------------------------------------------------------------
# Tile configuration.
# -------------------------------------------------------------------------------------------------


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
      (16-bit, ``DispatchRules.dw_cols_order_min_ratio``), ``"rows"`` elsewhere.

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


@dataclasses.dataclass(frozen=True)
class BlockSparseMatmulConfig:
  """Tile configs of the three kernels of one block-sparse product.

  ``mosaic_forward`` / ``mosaic_dx``, when set, run the forward / ``dx`` product on the Mosaic GPU
  kernel (Hopper only; see :mod:`jaxsparse.pallas._block_sparse_matmul_mgpu`) wherever it supports
  the operands, and the Triton kernel with ``forward`` / ``dx`` elsewhere; ``mosaic_dw`` likewise
  runs ``dw`` on :mod:`jaxsparse.pallas._block_sparse_sdd_mgpu`. ``dw_dense`` computes ``dw`` as
  one dense ``xᵀ dY`` product (XLA) with the kept blocks gathered, where small blocks make the
  per-block kernels slower than that; ``forward_dense`` / ``dx_dense`` compute the forward / ``dx`` as
  one dense ``x W`` / ``dY Wᵀ`` product of the weight built dense first (:func:`dense_weight`), where a
  long contraction makes the kernels re-read their operands from HBM; ``dense`` runs all three products
  densely, where the pattern is too dense for small blocks to beat the dense product at all.

  :meth:`get_default` chooses one from the measured :class:`DispatchRules`; any config can be given to the
  Pallas kernels instead. The Mosaic fields are set only where a Hopper GPU is present, so the example (on CPU)
  reads the Triton tiles:

  >>> import jax.numpy as jnp
  >>> from jaxsparse import pallas
  >>> rules = pallas.dispatch_rules("NVIDIA H100 80GB HBM3", num_sms=132)
  >>> cfg = pallas.BlockSparseMatmulConfig.get_default(4096, (4096, 4096), (64, 64), 1024, jnp.bfloat16, rules=rules)
  >>> cfg.forward.block_m, cfg.dx.block_m, cfg.dw.block_m, cfg.dense
  (128, 128, 32, False)
  >>> custom = pallas.BlockSparseMatmulConfig(forward=pallas.KernelConfig(block_m=64),
  ...                                         dx=pallas.KernelConfig(block_m=64), dw=pallas.KernelConfig(block_m=32))
  >>> custom.mosaic_forward is None, custom.dw_dense
  (True, False)
  """

  forward: KernelConfig
  dx: KernelConfig
  dw: KernelConfig
  mosaic_forward: mosaic.MosaicKernelConfig | None = None
  mosaic_dx: mosaic.MosaicKernelConfig | None = None
  mosaic_dw: mosaic_sdd.MosaicSddConfig | None = None
  dw_dense: bool = False
  dx_dense: bool = False
  forward_dense: bool = False
  dense: bool = False

  @classmethod
  def get_default(
      cls,
      m: int,
      shape: tuple[int, int],
      block_shape: tuple[int, int],
      nnz_blocks: int,
      dtype: jax.typing.DTypeLike,
      rules: DispatchRules | None = None,
  ) -> BlockSparseMatmulConfig:
    """The config for ``x (m, K) @ W (K, N)`` with ``nnz_blocks`` kept ``block_shape`` blocks.

    All choices are read from ``rules`` (by default :func:`dispatch_rules` of the first device: the
    measured table of its GPU kind). 16-bit square blocks at large ``m`` take the measured winners in
    ``rules.tuned_configs``; everything else a heuristic. Small ``m`` (decode, ``m <= rules.decode_max_m``)
    gives each program a slice of a block column's outputs (16-bit, blocks of 128) or splits the loop
    over a column's blocks across programs; mid-size ``m`` takes 64-row tiles up to
    ``rules.mid_small_tile_max_m`` (16-bit); above decode size the forward / ``dx`` split each output tile's
    steps only where the output has too few tiles (:func:`contraction_split`). Where a Hopper GPU is present, 16-bit
    blocks of 64 and 128 at ``m >= rules.mosaic_min_m`` also get Mosaic GPU configs for the forward and
    ``dx`` products (``rules.mosaic_tuned_configs``), and so do the mid-size rows of
    ``rules.mosaic_16bit_rows``.
    """
    r = dispatch_rules() if rules is None else rules
    (k, n), (bk, bn) = shape, block_shape
    itemsize = jnp.dtype(dtype).itemsize
    kb, nb = k // bk, n // bn

    def rows_tile(out_cols: int, in_cols: int) -> KernelConfig:
      # 128-row tiles (16-bit mid-size M up to r.mid_small_tile_max_m: 64), fewer where the f32
      # accumulator or the staged operands would not fit one SM.
      top = 64 if itemsize == 2 and r.decode_max_m < m <= r.mid_small_tile_max_m else 128
      bm = min(top, max(16, pl.next_power_of_2(m)))
      while bm > 16 and bm * out_cols * 4 > 128 * 128 * 4 // (2 if itemsize == 4 else 1):
        bm //= 2
      warps = 8 if bm * out_cols >= 128 * 128 else 4
      stages = 2 if itemsize == 4 and in_cols * out_cols >= 64 * 128 else 3
      return KernelConfig(bm, num_warps=warps, num_stages=stages)

    tuned = r.tuned_configs.get(bk) if bk == bn and itemsize == 2 and m >= r.tuned_min_m else None
    if tuned is not None:
      fwd, dx, dw = tuned
    else:
      fwd, dx = rows_tile(bn, bk), rows_tile(bk, bn)
      dw_bm = min(64 if itemsize == 4 else 128, max(16, pl.next_power_of_2(m)))
      dw = KernelConfig(dw_bm, num_warps=8 if bk * bn >= 128 * 128 else 4, num_stages=3 if itemsize < 4 else 2)

    def split_blocks(cfg: KernelConfig, num_cols: int, depth: int) -> KernelConfig:
      # Too few programs to fill the GPU (decode): each output tile's blocks (of `depth` contraction rows) in
      # parts of about r.decode_split_depth_bytes of contraction, and at least one program an SM; at most
      # r.decode_split_max parts (DispatchRules.decode_split_*). Not where a column keeps under one block on
      # average (most parts would be empty), nor above r.decode_max_m rows, where the partial sums cost more
      # than the idle SMs.
      programs = pl.cdiv(m, cfg.block_m) * num_cols
      if m > r.decode_max_m or programs >= r.target_programs or nnz_blocks < num_cols:
        return cfg
      by_sms = pl.cdiv(r.num_sms, programs)
      by_depth = pl.cdiv(nnz_blocks * depth * itemsize, num_cols * r.decode_split_depth_bytes)
      # A power of two at most: 5 parts of a column of 8 blocks are as long as 4 (2 blocks) but cost more
      # programs and partial sums (bf16 128-blocks dX: 0.86 of dense against 0.77).
      split = 1 << (min(r.decode_split_max, max(by_sms, by_depth)).bit_length() - 1)
      return dataclasses.replace(cfg, split=split)

    def sub_column_programs(cfg: KernelConfig, num_cols: int, block_dim: int) -> KernelConfig:
      # Decode with blocks of at least r.decode_sub_cols_min_block and at most r.decode_sub_cols_max_blocks kept blocks
      # a column: instead of a split and a second launch that adds the partial sums, programs own
      # r.decode_sub_cols columns of a block column.
      num_m = pl.cdiv(m, cfg.block_m)
      small = m <= r.decode_max_m and num_m * num_cols < r.target_programs
      few = pl.cdiv(nnz_blocks, max(num_cols, 1)) <= r.decode_sub_cols_max_blocks
      if not small or not few or block_dim < r.decode_sub_cols_min_block or itemsize != 2:
        return split_blocks(cfg, num_cols, bk)
      return dataclasses.replace(cfg, **r.decode_sub_cols)

    fwd, dx = sub_column_programs(fwd, nb, bn), split_blocks(dx, kb, bn)
    weight_bytes = nnz_blocks * bk * bn * itemsize

    def mid_split(cfg: KernelConfig, num_out: int, ob: int) -> KernelConfig:
      # Above decode size: contraction_split (few output tiles, many steps each).
      tiles = pl.cdiv(m, cfg.block_m) * num_out * (ob // (cfg.sub_cols or ob))
      parts = contraction_split(m, tiles, nnz_blocks / num_out, num_out * ob, weight_bytes, "triton", r)
      return cfg if parts == 1 else dataclasses.replace(cfg, split=parts)

    fwd, dx = mid_split(fwd, nb, bn), mid_split(dx, kb, bk)
    if m <= r.decode_max_m and (warps := r.decode_warps.get((itemsize, bn))) is not None:
      fwd = dataclasses.replace(fwd, num_warps=warps)
    if nnz_blocks < r.target_programs // 4:
      # Kept blocks for under half the SMs: split the reduction over M too. (At 128 blocks and
      # M = 8192 a split of 3 measured 50% slower than none on an H200.)
      steps = pl.cdiv(m, dw.block_m)
      dw = dataclasses.replace(dw, split=max(1, min(steps, pl.cdiv(r.target_programs // 2, nnz_blocks))))
    if itemsize == 2 and n >= r.dw_cols_order_min_ratio * k:
      dw = dataclasses.replace(dw, block_order="cols")
    mosaic_fwd, mosaic_dx = mosaic_defaults(m, shape, block_shape, nnz_blocks, dtype, r)
    return cls(
        forward=fwd,
        dx=dx,
        dw=dw,
        mosaic_forward=mosaic_fwd,
        mosaic_dx=mosaic_dx,
        mosaic_dw=(mosaic_dw := mosaic_dw_default(m, shape, block_shape, nnz_blocks, dtype, r)),
        dw_dense=use_dense_dw(m, shape, block_shape, nnz_blocks, mosaic_dw, dtype, r),
        dx_dense=use_dense_long_contraction(m, shape[1], shape, block_shape, nnz_blocks, dtype, r, mosaic_dx),
        forward_dense=use_dense_long_contraction(m, shape[0], shape, block_shape, nnz_blocks, dtype, r, mosaic_fwd),
        dense=use_dense(m, shape, block_shape, nnz_blocks, dtype, r),
    )


# -------------------------------------------------------------------------------------------------
# Dispatch rules: measured data, one table per GPU kind.
# -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DispatchRules:
  """The measured thresholds and tuned tiles that choose the block-sparse kernels on one GPU kind.

  :func:`dispatch_rules` picks the table of the device that runs the product from
  :data:`DISPATCH_TABLES`; :meth:`BlockSparseMatmulConfig.get_default` (and the rule functions below
  it) read only this data. The run that set each value of :data:`HOPPER_RULES` is told, field by field, in
  ``benchmarks/results/dispatch_rules_notes_2026-11-26.md``. On a GPU these are the defaults that measured
  dispatch starts from (:func:`jaxsparse.set_autotune_mode`).

  Attributes:
    measured_on: the GPUs the values were measured on (or why a table borrows another's values).
    num_sms: streaming multiprocessors of the device; with ``programs_per_sm`` the number of
      programs wanted in flight (``target_programs``), below which decode splits its loops.
    programs_per_sm: programs in flight per SM that fill the GPU.
    dw_cols_order_min_ratio: the Triton ``dw`` visits kept blocks by block column from ``N >= ratio K``.
    decode_max_m: rows up to which the forward / ``dx`` split their loops or use ``decode_sub_cols``.
    decode_split_depth_bytes, decode_split_max: that split's parts cover about ``decode_split_depth_bytes`` of
      contraction an output column, with at least one program an SM; at most ``decode_split_max`` parts.
    mid_small_tile_max_m: 16-bit rows up to which the Triton kernels take 64-row tiles.
    decode_sub_cols_min_block, decode_sub_cols_max_blocks, decode_sub_cols: decode forward programs
      own a slice of a block column (``decode_sub_cols`` fields of :class:`KernelConfig`) for blocks
      at least this wide with at most this many kept blocks per column.
    decode_warps: ``{(itemsize, output block width): num_warps}`` of the decode forward.
    tuned_min_m, tuned_configs: ``{block: (forward, dx, dw)}`` Triton tiles for 16-bit square blocks
      from ``tuned_min_m`` rows.
    mosaic_min_m, mosaic_16bit_rows, mosaic_mid_tiles, mosaic_mid_max_pad, mosaic_tuned_configs, mosaic_min_m_and_block:
      where the Mosaic GPU forward / ``dx`` kernels replace Triton's, and their tiles.
    mosaic_group_cols: ``{(itemsize, output block dim): (min density, G, min tiles per SM)}``: the Mosaic
      forward / ``dx`` tiles span ``G`` output block columns (``MosaicKernelConfig.group_cols``) from this
      density where that still leaves this many output tiles per SM.
    mosaic_dw_*: where the Mosaic GPU sampled ``dw`` kernel replaces Triton's.
    split_*: where the forward / ``dx`` kernels split each output tile's steps (:func:`contraction_split`).
    dense_route_min_m, dw_dense_*, long_contraction_*, dense_above_density: where products run as
      dense XLA products instead of per-block kernels (``dw_dense_max_grid_per_sm``: ``dw`` runs dense
      where the weight's whole grid of blocks is at most this many blocks per SM).

  A frozen dataclass: to try other thresholds, change a copy and pass it as ``rules``.

  >>> import dataclasses, jax.numpy as jnp
  >>> from jaxsparse import pallas
  >>> rules = pallas.dispatch_rules("NVIDIA H100 80GB HBM3", num_sms=132)
  >>> rules.num_sms, rules.target_programs
  (132, 264)
  >>> fewer = dataclasses.replace(rules, num_sms=66)
  >>> fewer.target_programs
  132
  >>> cfg = pallas.BlockSparseMatmulConfig.get_default(16, (4096, 4096), (64, 64), 1024, jnp.bfloat16, rules=fewer)
  >>> type(cfg).__name__
  'BlockSparseMatmulConfig'
  """

  measured_on: str
  num_sms: int
  programs_per_sm: int
  dw_cols_order_min_ratio: int
  decode_max_m: int
  decode_split_depth_bytes: int
  decode_split_max: int
  mid_small_tile_max_m: int
  decode_sub_cols_min_block: int
  decode_sub_cols_max_blocks: int
  decode_sub_cols: dict
  decode_warps: dict
  tuned_min_m: int
  tuned_configs: dict
  mosaic_min_m: int
  mosaic_16bit_rows: dict
  mosaic_mid_tiles: int
  mosaic_mid_max_pad: float
  mosaic_tuned_configs: dict
  mosaic_min_m_and_block: dict
  mosaic_group_cols: dict
  mosaic_dw_min_m: dict
  mosaic_dw_tuned_16bit: dict
  mosaic_dw_64_long_ratio: int
  mosaic_dw_64_min_m: int
  mosaic_dw_64_min_m_dense_or_wide: int
  mosaic_dw_64_density: float
  mosaic_dw_64_rows_order_below_m: int
  mosaic_dw_128_min_blocks: tuple
  dense_route_min_m: int
  dw_dense_min_m: int
  dw_dense_below_block: int
  dw_dense_min_density: float
  dw_dense_above_density: dict
  dw_dense_above_density_min_m: int
  dw_dense_max_grid_per_sm: float
  long_contraction_min: int
  long_contraction_dense_above: dict
  dense_above_density: dict
  split_max: int
  split_programs_per_sm: dict
  split_min_steps: dict
  split_max_sum_bytes: float

  @property
  def target_programs(self) -> int:
    """Programs wanted in flight at once."""
    return self.programs_per_sm * self.num_sms


# The H100 and H200 (SXM, 132 SMs each; same SM, the H200 with more and faster HBM): the points re-measured
# on the H200 agreed with the H100's, except the decode rule of 2026-11-25 (decode_sub_cols_max_blocks,
# measured on the H200 only: at d = 0.25 it keeps what the H100 measured).
HOPPER_RULES = DispatchRules(
    # What measured each value, and why: benchmarks/results/dispatch_rules_notes_2026-11-26.md (one section a field).
    measured_on="NVIDIA H100 and H200 (SXM)",
    num_sms=132,
    programs_per_sm=2,

    dw_cols_order_min_ratio=4,

    decode_max_m=64,
    mid_small_tile_max_m=256,
    decode_split_depth_bytes=512,
    decode_split_max=8,

    decode_sub_cols_min_block=128,
    decode_sub_cols_max_blocks=8,
    decode_sub_cols=dict(sub_cols=32, split=1, num_stages=4),
    decode_warps={(2, 32): 2},

    tuned_min_m=1024,
    tuned_configs={
        32: (
            KernelConfig(256, num_warps=4, num_stages=5, group_m=1, index_window=False),
            KernelConfig(256, num_warps=4, num_stages=5, group_m=1, index_window=False),
            KernelConfig(128, num_warps=4, num_stages=2),
        ),
        64: (
            KernelConfig(128, num_warps=4, num_stages=3),
            KernelConfig(128, num_warps=4, num_stages=3, group_m=16),
            KernelConfig(32, num_warps=4, num_stages=3),
        ),
        128: (
            KernelConfig(128, num_warps=8, num_stages=3, group_m=4),
            KernelConfig(128, num_warps=4, num_stages=3, group_m=4),
            KernelConfig(64, num_warps=4, num_stages=3),
        ),
    },

    mosaic_min_m=1024,
    mosaic_16bit_rows={32: ((128, 256),), 64: ((128, 512), (1024, None)), 128: ((512, None),)},
    mosaic_mid_tiles=128,
    mosaic_mid_max_pad={2: 0.0, 4: 0.125},
    mosaic_tuned_configs=(
        {}
        if mosaic is None
        else {
            64: (mosaic.MosaicKernelConfig(group_m=2), mosaic.MosaicKernelConfig(group_m=2)),
            128: (mosaic.MosaicKernelConfig(group_m=2), mosaic.MosaicKernelConfig(group_m=2)),
        }
    ),

    mosaic_min_m_and_block={2: (128, 32), 4: (128, 32)},

    mosaic_group_cols={(4, 32): (0.2, 4, 1), (4, 64): (0.2, 2, 2), (2, 64): (0.2, 2, 4)},

    mosaic_dw_min_m={2: 1024, 4: 128},
    mosaic_dw_tuned_16bit=(
        {} if mosaic_sdd is None else {(64, 64): mosaic_sdd.MosaicSddConfig(group=2, tile_m=64, num_stages=6)}
    ),
    mosaic_dw_64_long_ratio=4,  # max(K, N) / min(K, N) from which 64-blocks always take the Mosaic kernel
    mosaic_dw_64_min_m=8192,  # ... else from this M,
    mosaic_dw_64_min_m_dense_or_wide=4096,  # ... or this one at d >= mosaic_dw_64_density or N >= 2 K,
    mosaic_dw_64_density=0.4,
    mosaic_dw_64_rows_order_below_m=2048,  # items by block row below this M.
    mosaic_dw_128_min_blocks=((1024, 1024), (8192, 512)),  # (min M, min kept blocks) for 128-blocks

    dense_route_min_m=1024,
    dw_dense_min_m=256,

    dw_dense_below_block=64,
    dw_dense_min_density=0.1,
    dw_dense_above_density={64: 0.4},
    dw_dense_above_density_min_m=8192,
    dw_dense_max_grid_per_sm=1.0,

    long_contraction_min=16384,
    long_contraction_dense_above={32: (0.1, 4), 64: (0.4, 4)},

    dense_above_density={(16, 2): 0.0, (16, 4): 0.0, (32, 2): 0.3, (32, 4): 0.5},

    split_max=8,
    split_programs_per_sm={"mosaic": 1, "triton": 8},
    split_min_steps={"mosaic": 12, "triton": 10},
    split_max_sum_bytes=1.5,
)

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
    rules = dataclasses.replace(HOPPER_RULES, measured_on=f"{HOPPER_RULES.measured_on}; borrowed for {device_kind!r}")
  return rules if num_sms in (None, rules.num_sms) else dataclasses.replace(rules, num_sms=num_sms)


def _mosaic_rows(m: int, block_shape: tuple[int, int], itemsize: int, rules: DispatchRules) -> bool:
  """Whether the Mosaic GPU forward / dx kernels take ``m`` rows of these blocks."""
  min_m, min_block = rules.mosaic_min_m_and_block.get(itemsize, (None, None))
  if min_m is None or min(block_shape) < min_block:
    return False
  if itemsize == 2 and min(block_shape) == 32 and (block_shape != (32, 32) or m % 128):
    return False
  bands = rules.mosaic_16bit_rows.get(min(block_shape), ((min_m, None),)) if itemsize == 2 else ((min_m, None),)
  return any(lo <= m and (hi is None or m <= hi) for lo, hi in bands)


def mosaic_defaults(
    m: int, shape: tuple[int, int], block_shape: tuple[int, int], nnz_blocks: int, dtype, rules: DispatchRules
) -> tuple:
  """``(forward, dx)`` Mosaic GPU configs, or ``(None, None)`` where the Triton kernels are used."""
  (k, n), (bk, bn) = shape, block_shape
  itemsize = jnp.dtype(dtype).itemsize
  if mosaic_unavailable_reason() or not _mosaic_rows(m, block_shape, itemsize, rules):
    return None, None
  tuned = rules.mosaic_tuned_configs.get(bk) if bk == bn and itemsize == 2 and m >= rules.mosaic_min_m else None
  if tuned is not None:
    fwd, dx = tuned
  else:
    default = mosaic.MosaicBlockSparseMatmulConfig.get_default(m, block_shape, dtype)
    fwd, dx = default.forward, default.dx
    if m < rules.mosaic_min_m:
      # Mid-size M: 256-row tiles only where they still give about one output tile per SM and pad M by at
      # most rules.mosaic_mid_max_pad[itemsize] of it; the ring as deep as the row tile leaves room for.
      def rows(cfg, num_cols, ob):
        padded = pl.cdiv(m, 256)
        max_pad = rules.mosaic_mid_max_pad[itemsize] * m
        big = padded * num_cols >= rules.mosaic_mid_tiles and padded * 256 - m <= max_pad
        return dataclasses.replace(cfg, tile_m=256 if big else 128, group_m=2).deepest_ring(ob, itemsize, itemsize)

      fwd, dx = rows(fwd, n // bn, bn), rows(dx, k // bk, bk)
  density = _density(shape, block_shape, nnz_blocks)

  def group_cols(cfg, num_out: int, ob: int):
    rule = rules.mosaic_group_cols.get((itemsize, ob))
    if rule is None or density < rule[0]:
      return cfg
    _, group, min_tiles_per_sm = rule
    grouped = dataclasses.replace(cfg, group_cols=group)
    tiles = pl.cdiv(m, cfg.tile_m) * pl.cdiv(num_out, group)
    if tiles < min_tiles_per_sm * rules.num_sms or grouped.acc_elements(ob) > mosaic.MAX_ACC_ELEMENTS:
      return cfg
    return grouped

  fwd, dx = group_cols(fwd, n // bn, bn), group_cols(dx, k // bk, bk)
  weight_bytes = nnz_blocks * bk * bn * itemsize

  def split(cfg, num_out: int, ob: int, num_a: int, cb: int):
    # Steps of a tile: its column's kept blocks (the union over G columns) times the pipeline steps of a block.
    kept = num_a * (1 - (1 - density) ** cfg.group_cols) if cfg.group_cols > 1 else nnz_blocks / num_out
    tiles = pl.cdiv(m, cfg.tile_m) * pl.cdiv(num_out, cfg.group_cols)
    parts = contraction_split(m, tiles, kept * (cb // cfg.tile_k), num_out * ob, weight_bytes, "mosaic", rules)
    return dataclasses.replace(cfg, split=parts)

  return split(fwd, n // bn, bn, k // bk, bk), split(dx, k // bk, bk, n // bn, bn)


def contraction_split(
    m: int, tiles: int, steps: float, out_cols: int, weight_bytes: int, kernel: str, rules: DispatchRules
) -> int:
  """Parts to split the steps of each forward / ``dx`` output tile into (``split`` of the kernel configs).

  Above decode size, where the output has too few tiles for the GPU and each walks many steps (narrow layers,
  mid-size ``m``): the largest power of two up to ``rules.split_max`` that keeps ``tiles x split`` within
  ``rules.split_programs_per_sm[kernel]`` a SM, at least ``rules.split_min_steps[kernel]`` steps a part, and the
  float32 partial sums (``split x m x out_cols``) at most ``rules.split_max_sum_bytes`` times the kept weight's bytes.

  Args:
    m: rows of the product.
    tiles: output tiles of the kernel without a split.
    steps: average steps (pipeline steps of the Mosaic kernel, kept blocks of Triton's) an output tile walks.
    out_cols: columns of the output.
    weight_bytes: bytes of the kept blocks.
    kernel: ``"mosaic"`` or ``"triton"``.
    rules: the dispatch table.
  """
  if m <= rules.decode_max_m:
    return 1
  programs = rules.split_programs_per_sm[kernel] * rules.num_sms
  min_steps = rules.split_min_steps[kernel]
  parts = 1
  while (
      parts * 2 <= rules.split_max
      and tiles * parts * 2 <= programs
      and steps / (parts * 2) >= min_steps
      and parts * 2 * m * out_cols * 4 <= rules.split_max_sum_bytes * weight_bytes
  ):
    parts *= 2
  return parts


def mosaic_dw_default(
    m: int, shape: tuple[int, int], block_shape: tuple[int, int], nnz_blocks: int, dtype, rules: DispatchRules
):
  """The Mosaic GPU ``dw`` config, or ``None`` where the Triton SDD kernel is used."""
  itemsize = jnp.dtype(dtype).itemsize
  if mosaic_unavailable_reason() or m < rules.mosaic_dw_min_m.get(itemsize, m + 1):
    return None
  (k, n), (bk, bn) = shape, block_shape
  if itemsize == 4:
    if bk in mosaic_sdd.SUPPORTED_BK and bn in mosaic_sdd.SUPPORTED_BN[itemsize]:
      return mosaic_sdd.MosaicSddConfig.get_default(block_shape, dtype)
    return None
  if (bk, bn) == (64, 64):
    long = max(k, n) >= rules.mosaic_dw_64_long_ratio * min(k, n)
    dense_or_wide = _density(shape, block_shape, nnz_blocks) >= rules.mosaic_dw_64_density or n >= 2 * k
    if not (long or m >= rules.mosaic_dw_64_min_m or (dense_or_wide and m >= rules.mosaic_dw_64_min_m_dense_or_wide)):
      return None
    cfg = rules.mosaic_dw_tuned_16bit[(64, 64)]
    return dataclasses.replace(cfg, order="rows") if m < rules.mosaic_dw_64_rows_order_below_m else cfg
  if (bk, bn) == (128, 128) and any(m >= lo and nnz_blocks >= nb for lo, nb in rules.mosaic_dw_128_min_blocks):
    return mosaic_sdd.MosaicSddConfig.get_default(block_shape, dtype)
  return None


def _grid_blocks(shape, block_shape) -> int:
  """Blocks in the weight's whole grid, kept or not."""
  (k, n), (bk, bn) = shape, block_shape
  return (k // bk) * (n // bn)


def _density(shape, block_shape, nnz_blocks: int) -> float:
  return nnz_blocks / _grid_blocks(shape, block_shape)


def use_dense(m: int, shape, block_shape, nnz_blocks: int, dtype, rules: DispatchRules) -> bool:
  """Whether all three products run dense (small blocks, dense patterns, large M)."""
  above = rules.dense_above_density.get((min(block_shape), jnp.dtype(dtype).itemsize))
  return m >= rules.dense_route_min_m and above is not None and _density(shape, block_shape, nnz_blocks) > above


def use_dense_long_contraction(
    m: int, contraction: int, shape, block_shape, nnz_blocks: int, dtype, rules: DispatchRules, mosaic_cfg=None
) -> bool:
  """Whether a product contracting over ``contraction`` (K for the forward, N for ``dx``) runs on the
  weight built dense (see ``DispatchRules.long_contraction_dense_above``); never on the grouped-column
  Mosaic tiles ``mosaic_cfg`` (``group_cols > 1``), which read each slab once per group of columns."""
  rule = rules.long_contraction_dense_above.get(min(block_shape))
  grouped = mosaic_cfg is not None and mosaic_cfg.group_cols > 1
  if rule is None or grouped or m < rules.dense_route_min_m or contraction < rules.long_contraction_min:
    return False
  min_density, min_itemsize = rule
  return jnp.dtype(dtype).itemsize >= min_itemsize and _density(shape, block_shape, nnz_blocks) >= min_density


def dense_weight(w: BlockSparseMatrix, dtype) -> jax.Array:
  """The dense ``(K, N)`` weight of ``w`` in ``dtype``, built in one pass for the dense-product route.

  A gather of each output block from ``w.data`` (a zero block where none is kept), transposed into
  ``(K, N)`` order in the same fusion; :meth:`BlockSparseMatrix.to_dense` instead zero-fills, scatters
  and then transposes (three passes over the ``K x N`` output).
  """
  (bk, bn), (kb, nb) = w.block_shape, w.grid_shape
  nnz = w.nnz_blocks
  slot = jnp.full((kb, nb), nnz, jnp.int32).at[w.row_indices, w.col_indices].set(jnp.arange(nnz, dtype=jnp.int32))
  data = jnp.concatenate([w.data.astype(dtype), jnp.zeros((1, bk, bn), dtype)])
  return data[slot].transpose(0, 2, 1, 3).reshape(w.shape)


def dense_product_dtype(operand_dtype, out_dtype) -> jnp.dtype:
  """The result dtype of a dense-route product whose result is cast to ``out_dtype``.

  ``out_dtype`` itself where the operands have it: XLA's GPU products accumulate in float32 and round
  once in their epilogue, as a float32 result cast afterwards would, but write half the bytes (at
  M = 256, K = N = 4096 the ``K x N`` float32 result of the dense ``dW``, 64 MB, is 1.8x the bytes of
  its 16-bit inputs and 16-bit output together). Float32 where the operands are wider than ``out_dtype``.
  """
  return jnp.dtype(out_dtype) if jnp.dtype(operand_dtype) == jnp.dtype(out_dtype) else jnp.dtype(jnp.float32)


def dense_forward(x2, w: BlockSparseMatrix, *, precision, out_dtype) -> jax.Array:
  """The dense route of ``x2 @ W``: the weight built dense (:func:`dense_weight`) and one XLA product."""
  compute = jnp.result_type(x2.dtype, w.dtype)
  return jnp.matmul(x2.astype(compute), dense_weight(w, compute), precision=precision, preferred_element_type=out_dtype)


def dense_dx(dy2, w: BlockSparseMatrix, *, precision, out_dtype) -> jax.Array:
  """The dense route of ``dX = dY @ Wᵀ``, in ``out_dtype``."""
  compute = jnp.result_type(dy2.dtype, w.dtype)
  acc = dense_product_dtype(compute, out_dtype)
  dx = jnp.matmul(dy2.astype(compute), dense_weight(w, compute).T, precision=precision, preferred_element_type=acc)
  return dx.astype(out_dtype)


def dw_dense_then_gather(x2, dy2, w, *, precision):
  """``dW`` as the dense ``x2ᵀ dy2`` with the kept blocks gathered: faster than per-block products
  where blocks are small and many."""
  (bk, bn), (kb, nb) = w.block_shape, w.grid_shape
  acc = dense_product_dtype(jnp.result_type(x2, dy2), w.dtype)
  full = lax.dot_general(x2, dy2, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=acc)
  return full.reshape(kb, bk, nb, bn)[w.row_indices, :, w.col_indices, :].astype(w.dtype)


def use_dense_dw(m: int, shape, block_shape, nnz_blocks: int, mosaic_dw_cfg, dtype, rules: DispatchRules) -> bool:
  """Whether ``dw`` is the dense product plus a gather (a grid of blocks that fits one wave of the SMs, small
  blocks, or 64-blocks at high density unless the Mosaic float32 kernel runs them)."""
  if m < rules.dw_dense_min_m:
    return False
  if _grid_blocks(shape, block_shape) <= rules.dw_dense_max_grid_per_sm * rules.num_sms:
    return True
  density, small = _density(shape, block_shape, nnz_blocks), min(block_shape)
  if small < rules.dw_dense_below_block and mosaic_dw_cfg is None:
    return density >= rules.dw_dense_min_density
  if mosaic_dw_cfg is not None and jnp.dtype(dtype).itemsize == 4:
    return False
  above = rules.dw_dense_above_density.get(small)
  wide = jnp.dtype(dtype).itemsize == 4  # float32 off the Mosaic kernel: Triton's SDD, 2.6x dense at M = 8192
  return above is not None and density >= above and (wide or m >= rules.dw_dense_above_density_min_m)
