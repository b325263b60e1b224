"""The default config of a block-sparse product: which kernel runs each of its three products, with which tiles.

One function turns a product and a measured table (:class:`~._dispatch_rules.DispatchRules`, picked by
:func:`~._dispatch_rules.dispatch_rules` from the device's ``device_kind`` and SM count) into a config,
``BlockSparseMatmulConfig.get_default``; its parts are ``mosaic_defaults``, ``contraction_split``,
``mosaic_dw_default``, ``use_dense``, ``use_dense_long_contraction`` and ``use_dense_dw``. The Triton tiles are
:class:`~._kernel_config.KernelConfig`; the dense routes are in :mod:`._dense_route`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxsparse.pallas._dispatch_rules import DispatchRules
from jaxsparse.pallas._dispatch_rules import dispatch_rules
from jaxsparse.pallas._kernel_config import KernelConfig
from jaxsparse.pallas._kernel_config import fit_shared_memory

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

  :meth:`get_default` chooses one from the measured :class:`~jaxsparse.pallas.DispatchRules`; any config can be
  given to the Pallas kernels instead. The Mosaic fields are set only where a Hopper GPU is present, so the example
  (on CPU) reads the Triton tiles:

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

  Attributes:
    forward: :class:`~jaxsparse.pallas.KernelConfig` of the Triton forward kernel ``x @ W``.
    dx: :class:`~jaxsparse.pallas.KernelConfig` of the Triton ``dX = dY @ Wᵀ`` kernel.
    dw: :class:`~jaxsparse.pallas.KernelConfig` of the Triton sampled ``dW = xᵀ dY`` kernel (kept blocks only).
    mosaic_forward: :class:`~jaxsparse.pallas.MosaicKernelConfig` running the forward on the Mosaic GPU kernel
      (Hopper) where it supports the operands; ``None``: the Triton kernel.
    mosaic_dx: likewise for ``dx``.
    mosaic_dw: :class:`~jaxsparse.pallas.MosaicSddConfig` running ``dw`` on the Mosaic GPU sampled kernel;
      ``None``: the Triton kernel.
    dw_dense: compute ``dw`` as one dense ``xᵀ dY`` (XLA) and gather the kept blocks.
    dx_dense: compute ``dx`` as ``dY @ Wᵀ`` with ``W`` built dense first.
    forward_dense: compute the forward as ``x @ W`` with ``W`` built dense first.
    dense: run all three products densely (overrides the other fields).

    The four ``*dense`` fields are ignored in interpret mode (``interpret=True``), where the kernels always run.
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
    ``rules.triton.tuned``; everything else a heuristic. Small ``m`` (decode, ``m <= rules.decode_max_m``)
    gives each program a slice of a block column's outputs (16-bit, blocks of 128) or splits the loop
    over a column's blocks across programs; mid-size ``m`` takes 64-row tiles up to
    ``rules.triton.mid_small_tile_max_m`` (16-bit); above decode size the forward / ``dx`` split each output tile's
    steps only where the output has too few tiles (:func:`contraction_split`). Where a Hopper GPU is present, 16-bit
    blocks of 64 and 128 at ``m >= rules.mosaic.tuned_min_m`` also get Mosaic GPU configs for the forward and
    ``dx`` products (``rules.mosaic.tuned``), and so do the mid-size rows of
    ``rules.mosaic.rows_16bit``. Tiles over ``rules.shared_memory_bytes`` are cut to fit; a product where none
    fits runs dense.

    Args:
      m: rows of ``x`` (all its leading axes together).
      shape: ``(K, N)`` of the weight.
      block_shape: ``(bk, bn)`` of its blocks, dividing ``(K, N)``.
      nnz_blocks: the number of kept blocks.
      dtype: the operands' dtype (its itemsize picks the tiles).
      rules: the measured table; ``None``: :func:`~jaxsparse.pallas.dispatch_rules` of the first device (on a
        machine without a table, such as a CPU, the borrowed Hopper one).

    Returns:
      A ``BlockSparseMatmulConfig``; its Mosaic fields are ``None`` unless a Hopper GPU is present.

    >>> import jax.numpy as jnp
    >>> from jaxsparse import pallas
    >>> rules = pallas.dispatch_rules("NVIDIA H100 80GB HBM3", num_sms=132)
    >>> cfg = pallas.BlockSparseMatmulConfig.get_default(8, (4096, 4096), (128, 128), 256, jnp.bfloat16, rules=rules)
    >>> cfg.forward.block_m, cfg.forward.sub_cols, cfg.dx.split  # decode: 8 rows in 16-row tiles, work spread
    (16, 32, 4)
    """
    r = dispatch_rules() if rules is None else rules
    (k, n), (bk, bn) = shape, block_shape
    itemsize = jnp.dtype(dtype).itemsize
    kb, nb = k // bk, n // bn

    def rows_tile(out_cols: int, in_cols: int) -> KernelConfig:
      # 128-row tiles (16-bit mid-size M up to r.triton.mid_small_tile_max_m: 64), fewer where the f32
      # accumulator or the staged operands would not fit one SM.
      top = 64 if itemsize == 2 and r.decode_max_m < m <= r.triton.mid_small_tile_max_m else 128
      bm = min(top, max(16, pl.next_power_of_2(m)))
      while bm > 16 and bm * out_cols * 4 > 128 * 128 * 4 // (2 if itemsize == 4 else 1):
        bm //= 2
      warps = 8 if bm * out_cols >= 128 * 128 else 4
      stages = 2 if itemsize == 4 and in_cols * out_cols >= 64 * 128 else 3
      return KernelConfig(bm, num_warps=warps, num_stages=stages)

    tuned = r.triton.tuned.get(bk) if bk == bn and itemsize == 2 and m >= r.triton.tuned_min_m else None
    if tuned is not None:
      fwd, dx, dw = tuned
    else:
      fwd, dx = rows_tile(bn, bk), rows_tile(bk, bn)
      dw_bm = min(64 if itemsize == 4 else 128, max(16, pl.next_power_of_2(m)))
      dw = KernelConfig(dw_bm, num_warps=8 if bk * bn >= 128 * 128 else 4, num_stages=3 if itemsize < 4 else 2)

    def split_blocks(cfg: KernelConfig, num_cols: int, depth: int) -> KernelConfig:
      # Too few programs to fill the GPU (decode): each output tile's blocks (of `depth` contraction rows) in
      # parts of about r.triton_decode.split_depth_bytes of contraction, and at least one program an SM; at most
      # r.triton_decode.split_max parts (TritonDecodeRules.split_*). Not where a column keeps under one block on
      # average (most parts would be empty), nor above r.decode_max_m rows, where the partial sums cost more
      # than the idle SMs.
      programs = pl.cdiv(m, cfg.block_m) * num_cols
      if m > r.decode_max_m or programs >= r.target_programs or nnz_blocks < num_cols:
        return cfg
      by_sms = pl.cdiv(r.num_sms, programs)
      by_depth = pl.cdiv(nnz_blocks * depth * itemsize, num_cols * r.triton_decode.split_depth_bytes)
      # A power of two at most: 5 parts of a column of 8 blocks are as long as 4 (2 blocks) but cost more
      # programs and partial sums (bf16 128-blocks dX: 0.86 of dense against 0.77).
      split = 1 << (min(r.triton_decode.split_max, max(by_sms, by_depth)).bit_length() - 1)
      return dataclasses.replace(cfg, split=split)

    def sub_column_programs(cfg: KernelConfig, num_cols: int, block_dim: int) -> KernelConfig:
      # Decode with blocks of at least triton_decode.sub_cols_min_block and at most sub_cols_max_blocks kept
      # blocks a column: instead of a split and a second launch that adds the partial sums, programs own
      # triton_decode.sub_cols columns of a block column.
      num_m = pl.cdiv(m, cfg.block_m)
      small = m <= r.decode_max_m and num_m * num_cols < r.target_programs
      few = pl.cdiv(nnz_blocks, max(num_cols, 1)) <= r.triton_decode.sub_cols_max_blocks
      if not small or not few or block_dim < r.triton_decode.sub_cols_min_block or itemsize != 2:
        return split_blocks(cfg, num_cols, bk)
      return dataclasses.replace(cfg, **r.triton_decode.sub_cols._asdict())

    fwd, dx = sub_column_programs(fwd, nb, bn), split_blocks(dx, kb, bn)
    weight_bytes = nnz_blocks * bk * bn * itemsize

    def mid_split(cfg: KernelConfig, num_out: int, ob: int) -> KernelConfig:
      # Above decode size: contraction_split (few output tiles, many steps each).
      tiles = pl.cdiv(m, cfg.block_m) * num_out * (ob // (cfg.sub_cols or ob))
      parts = contraction_split(m, tiles, nnz_blocks / num_out, num_out * ob, weight_bytes, "triton", r)
      return cfg if parts == 1 else dataclasses.replace(cfg, split=parts)

    fwd, dx = mid_split(fwd, nb, bn), mid_split(dx, kb, bk)
    if m <= r.decode_max_m and (warps := r.triton_decode.forward_warps.get((itemsize, bn))) is not None:
      fwd = dataclasses.replace(fwd, num_warps=warps)
    if nnz_blocks < r.target_programs // 4:
      # Kept blocks for under half the SMs: split the reduction over M too. (At 128 blocks and
      # M = 8192 a split of 3 measured 50% slower than none on an H200.)
      steps = pl.cdiv(m, dw.block_m)
      dw = dataclasses.replace(dw, split=max(1, min(steps, pl.cdiv(r.target_programs // 2, nnz_blocks))))
    if itemsize == 2 and n >= r.triton.dw_cols_order_min_ratio * k:
      dw = dataclasses.replace(dw, block_order="cols")
    # Tiles over the device's shared memory fail to compile (float32 blocks of 256 staged whole, say): cut to fit,
    # and where nothing fits (no supported block shape measured so), the product runs on the dense route.
    fits = {d: fit_shared_memory(c, d, block_shape, itemsize, r.shared_memory_bytes)
            for d, c in (("fwd", fwd), ("dx", dx), ("dw", dw))}
    fwd, dx, dw = (fits[d] or c for d, c in (("fwd", fwd), ("dx", dx), ("dw", dw)))
    mosaic_fwd, mosaic_dx = mosaic_defaults(m, shape, block_shape, nnz_blocks, dtype, r)
    return cls(
        forward=fwd,
        dx=dx,
        dw=dw,
        mosaic_forward=mosaic_fwd,
        mosaic_dx=mosaic_dx,
        mosaic_dw=(mosaic_dw := mosaic_dw_default(m, shape, block_shape, nnz_blocks, dtype, r)),
        dw_dense=use_dense_dw(m, shape, block_shape, nnz_blocks, mosaic_dw, dtype, r)
        or (fits["dw"] is None and mosaic_dw is None),
        dx_dense=use_dense_long_contraction(m, shape[1], shape, block_shape, nnz_blocks, dtype, r, mosaic_dx)
        or (fits["dx"] is None and mosaic_dx is None),
        forward_dense=use_dense_long_contraction(m, shape[0], shape, block_shape, nnz_blocks, dtype, r, mosaic_fwd)
        or (fits["fwd"] is None and mosaic_fwd is None),
        dense=use_dense(m, shape, block_shape, nnz_blocks, dtype, r),
    )


def _mosaic_rows(m: int, block_shape: tuple[int, int], itemsize: int, rules: DispatchRules) -> bool:
  """Whether the Mosaic GPU forward / dx kernels take ``m`` rows of these blocks."""
  min_m, min_block = rules.mosaic.min_rows_and_block.get(itemsize, (None, None))
  if min_m is None or min(block_shape) < min_block:
    return False
  if itemsize == 2 and min(block_shape) == 32 and (block_shape != (32, 32) or m % 128):
    return False
  bands = rules.mosaic.rows_16bit.get(min(block_shape), ((min_m, None),)) if itemsize == 2 else ((min_m, None),)
  return any(lo <= m and (hi is None or m <= hi) for lo, hi in bands)


def mosaic_defaults(
    m: int, shape: tuple[int, int], block_shape: tuple[int, int], nnz_blocks: int, dtype, rules: DispatchRules
) -> tuple:
  """``(forward, dx)`` Mosaic GPU configs, or ``(None, None)`` where the Triton kernels are used."""
  (k, n), (bk, bn) = shape, block_shape
  itemsize = jnp.dtype(dtype).itemsize
  if mosaic_unavailable_reason() or not _mosaic_rows(m, block_shape, itemsize, rules):
    return None, None
  tuned = rules.mosaic.tuned.get(bk) if bk == bn and itemsize == 2 and m >= rules.mosaic.tuned_min_m else None
  if tuned is not None:
    fwd, dx = tuned
  else:
    default = mosaic.MosaicBlockSparseMatmulConfig.get_default(m, block_shape, dtype)
    fwd, dx = default.forward, default.dx
    if m < rules.mosaic.tuned_min_m:
      # Mid-size M: 256-row tiles only where they still give about one output tile per SM and pad M by at
      # most rules.mosaic.mid_max_pad[itemsize] of it; the ring as deep as the row tile leaves room for.
      def rows(cfg, num_cols, ob):
        padded = pl.cdiv(m, 256)
        max_pad = rules.mosaic.mid_max_pad[itemsize] * m
        big = padded * num_cols >= rules.mosaic.mid_tiles and padded * 256 - m <= max_pad
        return dataclasses.replace(cfg, tile_m=256 if big else 128, group_m=2).deepest_ring(ob, itemsize, itemsize)

      fwd, dx = rows(fwd, n // bn, bn), rows(dx, k // bk, bk)
  density = _density(shape, block_shape, nnz_blocks)

  def group_cols(cfg, num_out: int, ob: int):
    rule = rules.mosaic.group_cols.get((itemsize, ob))
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
  mid-size ``m``): the largest power of two up to ``split.max_parts`` that keeps ``tiles x split`` within
  ``split.programs_per_sm`` a SM, at least ``split.min_steps`` steps a part, and the float32 partial sums
  (``split x m x out_cols``) at most ``split.max_sum_bytes`` times the kept weight's bytes, where ``split`` is
  ``rules.mosaic.split`` or ``rules.triton.split`` (:class:`~._dispatch_rules.SplitRules`).

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
  split = {"mosaic": rules.mosaic.split, "triton": rules.triton.split}[kernel]
  programs = split.programs_per_sm * rules.num_sms
  parts = 1
  while (
      parts * 2 <= split.max_parts
      and tiles * parts * 2 <= programs
      and steps / (parts * 2) >= split.min_steps
      and parts * 2 * m * out_cols * 4 <= split.max_sum_bytes * weight_bytes
  ):
    parts *= 2
  return parts


def mosaic_dw_default(
    m: int, shape: tuple[int, int], block_shape: tuple[int, int], nnz_blocks: int, dtype, rules: DispatchRules
):
  """The Mosaic GPU ``dw`` config, or ``None`` where the Triton SDD kernel is used."""
  itemsize = jnp.dtype(dtype).itemsize
  if mosaic_unavailable_reason() or m < rules.mosaic_dw.min_m.get(itemsize, m + 1):
    return None
  (k, n), (bk, bn) = shape, block_shape
  if itemsize == 4:
    if bk in mosaic_sdd.SUPPORTED_BK and bn in mosaic_sdd.SUPPORTED_BN[itemsize]:
      return mosaic_sdd.MosaicSddConfig.get_default(block_shape, dtype)
    return None
  if (bk, bn) == (64, 64):
    long = max(k, n) >= rules.mosaic_dw.b64_long_ratio * min(k, n)
    dense_or_wide = _density(shape, block_shape, nnz_blocks) >= rules.mosaic_dw.b64_density or n >= 2 * k
    if not (long or m >= rules.mosaic_dw.b64_min_m or (dense_or_wide and m >= rules.mosaic_dw.b64_min_m_dense_or_wide)):
      return None
    cfg = rules.mosaic_dw.tuned_16bit[(64, 64)]
    return dataclasses.replace(cfg, order="rows") if m < rules.mosaic_dw.b64_rows_order_below_m else cfg
  if (bk, bn) == (128, 128) and any(m >= lo and nnz_blocks >= nb for lo, nb in rules.mosaic_dw.b128_min_blocks):
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
  key = (min(block_shape), jnp.dtype(dtype).itemsize)
  long = max(block_shape) >= 4 * min(block_shape) and key in rules.dense.above_density_long
  above = (rules.dense.above_density_long if long else rules.dense.above_density).get(key)
  return m >= rules.dense.min_m and above is not None and _density(shape, block_shape, nnz_blocks) > above


def use_dense_long_contraction(
    m: int, contraction: int, shape, block_shape, nnz_blocks: int, dtype, rules: DispatchRules, mosaic_cfg=None
) -> bool:
  """Whether a product contracting over ``contraction`` (K for the forward, N for ``dx``) runs on the
  weight built dense (see ``DenseRules.long_contraction``); never on the grouped-column
  Mosaic tiles ``mosaic_cfg`` (``group_cols > 1``), which read each slab once per group of columns."""
  rule = rules.dense.long_contraction.get(min(block_shape))
  grouped = mosaic_cfg is not None and mosaic_cfg.group_cols > 1
  if rule is None or grouped or m < rules.dense.min_m or contraction < rules.dense.long_contraction_min:
    return False
  min_density, min_itemsize = rule
  return jnp.dtype(dtype).itemsize >= min_itemsize and _density(shape, block_shape, nnz_blocks) >= min_density


def use_dense_dw(m: int, shape, block_shape, nnz_blocks: int, mosaic_dw_cfg, dtype, rules: DispatchRules) -> bool:
  """Whether ``dw`` is the dense product plus a gather (a grid of blocks that fits one wave of the SMs, small
  blocks, or 64-blocks at high density unless the Mosaic float32 kernel runs them)."""
  if m < rules.dense.dw_min_m:
    return False
  if _grid_blocks(shape, block_shape) <= rules.dense.dw_max_grid_per_sm * rules.num_sms:
    return True
  density, small = _density(shape, block_shape, nnz_blocks), min(block_shape)
  if small < rules.dense.dw_below_block and mosaic_dw_cfg is None:
    return density >= rules.dense.dw_min_density
  if mosaic_dw_cfg is not None and jnp.dtype(dtype).itemsize == 4:
    return False
  above = rules.dense.dw_above_density.get(small)
  wide = jnp.dtype(dtype).itemsize == 4  # float32 off the Mosaic kernel: Triton's SDD, 2.6x dense at M = 8192
  return above is not None and density >= above and (wide or m >= rules.dense.dw_above_density_min_m)
