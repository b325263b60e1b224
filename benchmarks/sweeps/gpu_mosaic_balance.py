"""Mosaic GPU forward / dX kernels: how the persistent thread blocks share the output tiles (``balance``).

Question: does an even share of the steps (``MosaicKernelConfig.balance``: the tiles dealt back and forth in windows
sorted by their steps) beat round-robin in the grouped order? A load model (steps + 1 a tile) puts the busiest thread
block at 1.14-1.33x the mean round-robin on multi-round shapes, 1.03-1.08x with windows of 4 rounds; Nsight's 73%
SM-active at 8192 x 1536 x 6144, d 0.27, agreed. Times each variant of the default config (CUPTI, the whole call:
step lists, tile order and kernel) as a ratio to the dense product, each checked against the float32 product first.

    python3 sweeps/gpu_mosaic_balance.py [--balances 0,1,2,4,8,64] [--column-sorted] [--dynamic 0,2]

``--column-sorted`` adds variants whose tile columns are also sorted by their steps (the same order in every group
of row tiles, so that the rows in flight stay those of round-robin), then windows of 0-2 rounds (``cs0``-``cs2``).
``--dynamic`` adds the dynamic schedule (``MosaicKernelConfig.dynamic``: each thread block takes its next tile from a
counter) on the grouped order (``d0``) or on windows of the given rounds sorted by steps (``d2``, ...). ``--cases``
picks rows of ``CASES`` by index.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import _benchmarks_path  # noqa: F401 -- benchmarks/ on sys.path (_gpu_timing)
import jax
import jax.numpy as jnp
import numpy as np
from _gpu_timing import log
from _gpu_timing import rel_err

import jaxsparse
from jaxsparse._tuning import _measure
from jaxsparse.pallas import _block_sparse_matmul_mgpu as mosaic
from jaxsparse.pallas import _common
from jaxsparse.pallas._block_sparse_config import BlockSparseMatmulConfig

CASES = [  # M, K, N, block, density, dtype
    (8192, 1536, 6144, (128, 128), 0.27, jnp.bfloat16),
    (8192, 1536, 6144, (128, 128), 0.46, jnp.bfloat16),
    (8192, 6144, 1536, (128, 128), 0.27, jnp.bfloat16),
    (4096, 4096, 4096, (128, 128), 0.28, jnp.bfloat16),
    (4096, 4096, 4096, (128, 128), 0.48, jnp.bfloat16),
    (2048, 4096, 4096, (128, 128), 0.48, jnp.bfloat16),
    (512, 8192, 8192, (128, 128), 0.3, jnp.bfloat16),
    (8192, 1536, 6144, (64, 64), 0.3, jnp.bfloat16),
    (8192, 1536, 6144, (64, 64), 0.51, jnp.bfloat16),
    (1000, 5120, 6144, (64, 64), 0.57, jnp.bfloat16),
    (4096, 5120, 16384, (128, 64), 0.4, jnp.float32),
    (3000, 4096, 11008, (128, 128), 0.55, jnp.float16),
]


def column_sorted_order(window: int):
  """A ``tile_order`` whose tile columns are sorted by steps (heaviest first), then windows of ``window`` rounds."""

  def order(offsets, num_m, num_c, cfg, num_ctas):
    perm = jnp.argsort(offsets[:-1] - offsets[1:], stable=True).astype(jnp.int32)
    mi, pos = _common.grouped_tile(jnp.arange(num_m * num_c, dtype=jnp.int32), num_m, num_c, cfg.group_m)
    part = jnp.repeat(jnp.arange(cfg.split, dtype=jnp.int32), num_m * num_c)
    mi, c = jnp.tile(mi, cfg.split), jnp.tile(perm[pos], cfg.split)
    codes = (part * num_m + mi) * num_c + c
    start, end = _common.chunk(offsets[c], offsets[c + 1], part, cfg.split)
    return codes[_common.balanced_order(end - start, num_ctas, window)]

  return order


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--balances", default="0,2,4,8,64")
  p.add_argument("--column-sorted", action="store_true")
  p.add_argument("--dynamic", default="", help="windows of the dynamic schedule's variants, e.g. 0,2")
  p.add_argument("--cases", default="", help="indices into CASES (default: all)")
  args = p.parse_args()
  library_order = mosaic.tile_order
  variants = {f"b{b}": (int(b), library_order, False) for b in args.balances.split(",")}
  if args.column_sorted:
    variants |= {f"cs{b}": (max(b, 1), column_sorted_order(b), False) for b in (0, 1, 2)}
  if args.dynamic:
    variants |= {f"d{b}": (int(b), library_order, True) for b in args.dynamic.split(",")}
  cases = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
  hi = dict(precision="highest", preferred_element_type=jnp.float32)
  rows = []
  for m, k, n, blk, d, dt in cases:
    rng = np.random.default_rng(0)
    mask = rng.random((k // blk[0], n // blk[1])) < d
    dense_w = jnp.asarray(rng.standard_normal((k, n)) * np.kron(mask, np.ones(blk)), dt)
    w = jaxsparse.BlockSparseMatrix.from_dense(dense_w, block_shape=blk)
    x, dy = (jnp.asarray(rng.standard_normal(s), dt) for s in ((m, k), (m, n)))
    full = BlockSparseMatmulConfig.get_default(m, (k, n), blk, int(mask.sum()), dt)
    fallback = mosaic.MosaicBlockSparseMatmulConfig.get_default(m, blk, dt)
    for direction in ("fwd", "dx"):
      transpose = direction == "dx"
      a = dy if transpose else x
      base = (full.mosaic_dx or fallback.dx) if transpose else (full.mosaic_forward or fallback.forward)
      want = jnp.matmul(dy, dense_w.T, **hi) if transpose else jnp.matmul(x, dense_w, **hi)
      dense_ms = _measure.time_call_ms((lambda a, wd: a @ wd.T) if transpose else (lambda a, wd: a @ wd),
                                       (a, dense_w), "cuda")
      ratios = {}
      for name, (balance, order, dynamic) in variants.items():
        mosaic.tile_order = order
        cfg = dataclasses.replace(base, balance=balance, dynamic=dynamic)
        f = lambda a, w, cfg=cfg, t=transpose: mosaic.dense_sparse_matmul(a, w, transpose=t, config=cfg)
        err = rel_err(jax.jit(f)(a, w), want)
        ratios[name] = float("nan") if err > 2e-2 else _measure.time_call_ms(f, (a, w), "cuda") / dense_ms
        if err > 2e-2:
          log(f"WRONG {m}x{k}x{n} {blk} d={d} {direction} {name}: relative error {err:.3g}")
      mosaic.tile_order = library_order
      num_out = k // blk[0] if transpose else n // blk[1]
      tiles = math.prod(mosaic.tile_grid(m, num_out, base)) * base.split
      case = f"{m}x{k}x{n} {blk[0]}x{blk[1]} {jnp.dtype(dt).name} d{d}"
      rows.append((case, direction, tiles, f"{base.tile_m}/{base.group_cols}/{base.split}", dense_ms * 1e3, ratios))
      log(case, direction, " ".join(f"{v}={r:.3f}" for v, r in ratios.items()))
  names = list(variants)
  log("\n| case | dir | tiles | tile_m/G/split | dense us | " + " | ".join(names) + " | best / b0 |")
  log("|---|---|---|---|---|" + "---|" * len(names) + "---|")
  for case, direction, tiles, cfg, dense_us, ratios in rows:
    best = np.nanmin([ratios[v] for v in names if v != "b0"]) / ratios.get("b0", np.nan)
    log(f"| {case} | {direction} | {tiles} | {cfg} | {dense_us:.1f} | " + " | ".join(f"{ratios[v]:.3f}" for v in names)
        + f" | {best:.3f} |")


if __name__ == "__main__":
  main()
