"""The routes and tiles measured dispatch chooses from for one block-sparse product on a GPU.

:func:`candidates` starts from the shipped default (:meth:`BlockSparseMatmulConfig.get_default`, the measured
rules of :mod:`._block_sparse_config`) and adds, for one direction of the product (``"fwd"``, ``"dx"`` or
``"dw"``): the dense route (the weight built dense and one XLA product; for ``dw`` the dense ``xᵀ dY`` and a
gather), the Triton kernel with its default tiles, with split contractions, with smaller row tiles, (the decode
forward of 16-wide blocks) with the other warp count and (``dw`` of blocks up to 64 x 64) with several blocks a
program or (``dw`` of blocks of 128 rows or more, at most 1024 rows) slices of a block's rows a program, and the
Mosaic GPU kernel (Hopper, from 64 rows) with one or two block columns a tile, split contractions, (more tiles than
SMs) tiles taken from a counter and (16-bit, 128-wide output blocks, more tiles than SMs) tiles balanced over the
thread blocks. Only configs the kernels support
for these operands are listed; duplicates of the default are dropped. The other directions' fields keep the
default's values.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.pallas._block_sparse_config import BlockSparseMatmulConfig
from jaxsparse.pallas._block_sparse_config import mosaic_unavailable_reason
from jaxsparse.pallas._common import allows_tf32
from jaxsparse.pallas._dispatch_rules import dispatch_rules
from jaxsparse.pallas._kernel_config import staged_bytes

try:  # Mosaic GPU (Hopper).
  from jaxsparse.pallas import _block_sparse_matmul_mgpu as mosaic
  from jaxsparse.pallas import _block_sparse_sdd_mgpu as mosaic_sdd
except ImportError:  # a jax without Mosaic GPU: the Triton kernels only.
  mosaic = mosaic_sdd = None

__all__ = ["DIRECTIONS", "candidates"]

DIRECTIONS = ("fwd", "dx", "dw")
# The fields of BlockSparseMatmulConfig each direction reads (besides `dense`, which candidates never set).
_FIELDS = {
    "fwd": ("forward", "mosaic_forward", "forward_dense"),
    "dx": ("dx", "mosaic_dx", "dx_dense"),
    "dw": ("dw", "mosaic_dw", "dw_dense"),
}


def _own(cfg: BlockSparseMatmulConfig, direction: str) -> tuple:
  return tuple(getattr(cfg, f) for f in _FIELDS[direction])


def _mosaic_ok(a, w, out_dtype, cfg, *, transpose: bool, precision) -> bool:
  if mosaic is None or mosaic_unavailable_reason():
    return False
  if jnp.dtype(a.dtype).itemsize == 4 and not allows_tf32(precision):
    return False
  return mosaic.supports(a, w, out_dtype, mosaic.resolve_config(a, w, out_dtype, cfg, transpose=transpose),
                         transpose=transpose)


def candidates(
    direction: str,
    x2: jax.Array,
    w: BlockSparseMatrix,
    *,
    out_dtype,
    precision=None,
) -> list[tuple[str, BlockSparseMatmulConfig]]:
  """``[(name, config), ...]`` for one direction of ``x2 @ w``, the shipped default first.

  Args:
    direction: ``"fwd"`` (``x2 @ W``), ``"dx"`` (``dY @ Wᵀ``) or ``"dw"`` (sampled ``x2ᵀ dY``).
    x2: ``(M, K)`` activations (any array or tracer; only the shape and dtype are read).
    w: the ``(K, N)`` weight, of blocks the kernels support.
    out_dtype: the product's output dtype (the forward's; ``dx`` writes ``x2.dtype``).
    precision: the product's precision (float32 runs on the Mosaic kernel only where TF32 is allowed).

  Returns:
    Named configs; each differs from the default only in the fields of ``direction``.
  """
  if direction not in DIRECTIONS:
    raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}.")
  m, (k, n) = x2.shape[0], w.shape
  rules = dispatch_rules()
  default = BlockSparseMatmulConfig.get_default(m, w.shape, w.block_shape, w.nnz_blocks, w.dtype, rules=rules)
  base = dataclasses.replace(default, dense=False)
  out: list[tuple[str, BlockSparseMatmulConfig]] = []
  seen = set()

  itemsize = jnp.result_type(x2.dtype, w.dtype).itemsize

  def add(name: str, cfg: BlockSparseMatmulConfig) -> None:
    own = _own(cfg, direction)
    on_triton = not getattr(cfg, f_dense) and getattr(cfg, f_mosaic) is None
    if on_triton and staged_bytes(own[0], direction, w.block_shape, itemsize) > rules.shared_memory_bytes:
      return  # would not compile
    if own not in seen:
      seen.add(own)
      out.append((name, cfg))

  f_kernel, f_mosaic, f_dense = _FIELDS[direction]
  add("default", dataclasses.replace(base, **{f_dense: default.dense or getattr(default, f_dense)}))
  add("dense", dataclasses.replace(base, **{f_dense: True}))
  triton = dataclasses.replace(base, **{f_dense: False, f_mosaic: None})
  tk = getattr(triton, f_kernel)
  add("triton", triton)
  if direction == "dw":
    if tk.split == 1:
      add("triton/s4", dataclasses.replace(triton, dw=dataclasses.replace(tk, split=4)))
    if w.block_shape[0] * w.block_shape[1] <= 64 * 64:
      # 4 kept blocks of a block row a program, for blocks too small to keep a program busy, 64 rows a step. H200
      # (gpu_grouped_dw_2026-11-30_h200.md): 0.80x the default's time at 224 x 5120 x 16384 in 32 x 32 bf16
      # blocks, d 0.14; 1.2-2.2x it at 640 rows (8 blocks a program: slower than 4 in 3 of 4 shapes).
      grouped = dataclasses.replace(tk, group_blocks=4, block_m=min(tk.block_m, 64))
      add("triton/g4", dataclasses.replace(triton, dw=grouped))
    if m <= 1024 and w.block_shape[0] >= 128:
      # Programs of a half / quarter of a block's rows: a smaller accumulator and twice / four times the programs.
      # H200 (gpu_dw_masked_rows_2026-11-30_h200.md): 0.72x the whole-block programs' time at 448 x 2048 x 5632 in
      # 256 x 128 bf16 blocks, 0.92x at 224 x 14336 x 512; with 128 x 128 blocks 1.04-2.8x (left to the tuner).
      for sub in (w.block_shape[0] // 2, w.block_shape[0] // 4):
        if sub >= 32:
          add(f"triton/sub{sub}", dataclasses.replace(triton, dw=dataclasses.replace(tk, sub_cols=sub)))
    if mosaic_sdd is not None and not mosaic_unavailable_reason():
      dy = jax.ShapeDtypeStruct((m, n), x2.dtype)
      msd = mosaic_sdd.MosaicSddConfig.get_default(w.block_shape, w.dtype)
      if (jnp.dtype(x2.dtype).itemsize != 4 or allows_tf32(precision)) and mosaic_sdd.supports(x2, dy, w, msd):
        mos = dataclasses.replace(triton, mosaic_dw=msd)
        add("mosaic", mos)
        add("mosaic/rows", dataclasses.replace(mos, mosaic_dw=dataclasses.replace(msd, order="rows")))
        add("mosaic/cols", dataclasses.replace(mos, mosaic_dw=dataclasses.replace(msd, order="cols")))
    return out

  # Split contractions pay where the output has few tiles: small M (H100: they lost at every M >= 1024 tried). At
  # decode size the best split of the forward ranged over 1-32 (a column's blocks over 1-32 programs) with the shape
  # (gpu_decode_masked_rows_2026-11-26_h200.md): 1, 4, 16 and 32 programs, at most one a step of a column / row.
  # Where even 32 leave the GPU short of `target_programs` programs (an output of few block columns, a long
  # contraction: 1 x 16384 x 512 in 256 x 128 blocks has 4 columns, 128 programs at s32), the split that fills it.
  steps = (k // w.block_shape[0]) if direction == "fwd" else (n // w.block_shape[1])
  splits = (2, 4) if m <= 512 else ()
  if m <= rules.decode_max_m:
    columns = (n // w.block_shape[1]) if direction == "fwd" else (k // w.block_shape[0])
    fill = 1 << max(0, -(-rules.target_programs // columns) - 1).bit_length()  # a power of two >= programs / columns
    splits = sorted({min(s, steps) for s in (1, 4, 16, 32, *((fill,) if fill > 32 else ()))})
  for split in splits:
    add(f"triton/s{split}", dataclasses.replace(triton, **{f_kernel: dataclasses.replace(tk, split=split)}))
  if m <= rules.decode_max_m and tk.sub_cols is None:
    # Decode: more programs a block column (slices of its outputs), with or without a split contraction.
    for sub in (32, 64):
      if sub < (w.block_shape[1] if direction == "fwd" else w.block_shape[0]):
        for split in (1, 4):
          cfg = dataclasses.replace(tk, sub_cols=sub, split=split)
          add(f"triton/sub{sub}" + (f"s{split}" if split > 1 else ""), dataclasses.replace(triton, **{f_kernel: cfg}))
  if direction == "fwd" and m <= rules.decode_max_m and w.block_shape[1] == 16:
    # Decode forward of 16-wide blocks: the other warp count of the default's tiles (1 warp by the shipped rule,
    # TritonDecodeRules.forward_warps; 4 at every other block width).
    alt = 4 if tk.num_warps == 1 else 1
    add(f"triton/w{alt}", dataclasses.replace(triton, forward=dataclasses.replace(tk, num_warps=alt)))
  if tk.block_m > 32 and 2 * tk.block_m <= m < 4096:
    add("triton/bm_half", dataclasses.replace(triton, **{f_kernel: dataclasses.replace(tk, block_m=tk.block_m // 2)}))
  transpose = direction == "dx"
  a = jax.ShapeDtypeStruct((m, n if transpose else k), x2.dtype)
  o_dtype = x2.dtype if transpose else out_dtype
  if mosaic is None or mosaic_unavailable_reason() or not set(w.block_shape) <= set(mosaic.SUPPORTED_BLOCK_DIMS):
    return out
  if m < 64 and getattr(default, f_mosaic) is None:
    # Fewer rows than the Mosaic kernel's smallest row tile: measured 1.5-6.6x the Triton default's time at M = 1-48
    # (the tuning cache of gpu_decode_masked_rows_2026-11-26_h200.md), and its compiles are the slowest to tune.
    return out
  prior_m = getattr(default, f_mosaic)
  if prior_m is None:
    defaults = mosaic.MosaicBlockSparseMatmulConfig.get_default(m, w.block_shape, w.dtype, o_dtype)
    prior_m = defaults.dx if transpose else defaults.forward
  variants = {"mosaic": dataclasses.replace(prior_m, split=1, group_cols=1)}
  ob = w.block_shape[0] if transpose else w.block_shape[1]
  if ob <= 64:
    variants["mosaic/g2"] = dataclasses.replace(prior_m, split=1, group_cols=2)
  for split in (2, 4) if m <= 1024 else ():
    variants[f"mosaic/s{split}"] = dataclasses.replace(prior_m, split=split, group_cols=1)
  if prior_m.tile_m == 256:
    variants["mosaic/t128"] = dataclasses.replace(prior_m, tile_m=128, split=1, group_cols=1)
  num_out = k // w.block_shape[0] if transpose else n // w.block_shape[1]
  tiles = math.prod(mosaic.tile_grid(m, num_out, prior_m)) * prior_m.split
  if ob == 128 and itemsize == 2 and tiles > mosaic.num_sms():
    # Tiles dealt in windows of 2 rounds sorted by their steps (MosaicKernelConfig.balance) against round-robin.
    # H200 (gpu_mosaic_balance_2026-12-01_h200.md), 16-bit 128-blocks at d 0.27-0.55: 0.91-0.97x the default's time
    # on 7 of 18 products (the activations of two rounds' tiles in L2), up to 1.13x on the others.
    variants["mosaic/b2"] = dataclasses.replace(prior_m, balance=2)
  # The first of the Mosaic variants (the tuner times candidates in order, within its budget): each thread block takes
  # its next tile from a counter (MosaicKernelConfig.dynamic) instead of every num_ctas-th. H200
  # (gpu_mosaic_dynamic_2026-12-02_h200.md): 0.88x the default's time at 1536 tiles of 128-blocks (11.6 a thread
  # block), up to 1.09x at 2-6 tiles a thread block; in the transformer train step the tuner took it for the dX of
  # the MLP's down projection (0.85-0.87x).
  first = {"mosaic/dyn": dataclasses.replace(prior_m, dynamic=True)} if tiles > mosaic.num_sms() else {}
  variants = {"mosaic/default": prior_m, **first, **variants}
  for name, cfg in variants.items():
    if _mosaic_ok(a, w, o_dtype, cfg, transpose=transpose, precision=precision):
      add(name, dataclasses.replace(base, **{f_dense: False, f_mosaic: cfg}))
  return out
