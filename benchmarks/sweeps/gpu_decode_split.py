"""Decode-size block-sparse forwards: the Triton kernel's split / sub-column / warp / stage space against dense.

    python benchmarks/sweeps/gpu_decode_split.py [--cases float16:1x768x6144:64x64:0.49,... --iterations 20]

A case is ``dtype:MxKxN:BKxBN:density``. The default cases are the decode-size rows of
``benchmarks/results/gpu_unseen_shapes_2026-11-26_h200_tuned.md`` (the slower-than-dense ones and two that win),
two common decode layers and the 16-wide blocks of ``gpu_unseen_shapes_2026-11-27_h100_seed53.md``. For each case:
the dense ``x @ W``, the op with its defaults, and variants of ``KernelConfig`` of the Triton forward (``split``,
``sub_cols``, ``num_warps`` / ``num_stages``; one warp for blocks up to 32 wide), device time (CUPTI, median), each
checked against the dense product; then the kernels of the fastest variant. A table of the best per case last.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import _benchmarks_path  # noqa: F401 -- benchmarks/ on sys.path (_gpu_timing, gpu_block_sparse)
import jax
import jax.numpy as jnp
from _gpu_timing import kernel_times_ms
from _gpu_timing import log
from _gpu_timing import rel_err
from _gpu_timing import time_ms
from gpu_block_sparse import problem
from gpu_split_sweep import parse  # the same case syntax

from jaxsparse import ops
from jaxsparse.pallas import BlockSparseMatmulConfig
from jaxsparse.pallas import _block_sparse_matmul as kernels

CASES = (
    "float32:1x5120x768:64x64:0.52",
    "float16:48x6144x1536:32x32:0.6",
    "float16:1x768x6144:64x64:0.49",
    "float16:16x512x2048:16x64:0.49",
    "bfloat16:1x4096x4096:64x64:0.5",
    "bfloat16:8x4096x11008:128x128:0.3",
    "float32:4x6144x6144:64x32:0.09",
    "bfloat16:2x8192x3072:64x128:0.47",
    "bfloat16:4x1536x11008:16x16:0.26",
    "bfloat16:16x2048x1536:16x16:0.55",
    "float32:32x2048x2048:16x16:0.3",
)


def variants(default: BlockSparseMatmulConfig, kb: int, bn: int):
  base = dataclasses.replace(default, dense=False, forward_dense=False, mosaic_forward=None)
  splits = [s for s in (1, 4, 8, 16, 32) if s <= kb]
  subs = [None] + [s for s in (32,) if s < bn]
  warps_stages = ((4, 3), (2, 2), (1, 3)) if bn <= 32 else ((4, 3), (2, 2))
  for split, sub, (warps, stages) in itertools.product(splits, subs, warps_stages):
    cfg = dataclasses.replace(base.forward, split=split, sub_cols=sub, num_warps=warps, num_stages=stages)
    yield f"s{split} sub{sub} w{warps} st{stages}", dataclasses.replace(base, forward=cfg)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cases", default=",".join(CASES))
  p.add_argument("--iterations", type=int, default=20)
  args = p.parse_args(argv)
  table = []
  for case in args.cases.split(","):
    dtype, m, k, n, (bk, bn), d = parse(case)
    x, _, w, _ = problem(m, k, n, (bk, bn), d, dtype=dtype)
    wd = w.to_dense()
    ref = jnp.dot(x.astype(jnp.float32), wd.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    dense = time_ms(lambda x, wd: x @ wd, x, wd, iterations=args.iterations)
    op = time_ms(lambda x, w: ops.block_sparse_matmul(x, w), x, w, iterations=args.iterations)
    default = BlockSparseMatmulConfig.get_default(m, w.shape, w.block_shape, w.nnz_blocks, w.dtype)
    log(f"{case}: dense {dense * 1e3:.1f}us  op {op / dense:.2f}  default fwd {default.forward}")
    results = []
    for name, cfg in variants(default, k // bk, bn):
      try:
        f = lambda x, w, cfg=cfg: kernels.forward(x, w, config=cfg)
        err = rel_err(jax.jit(f)(x, w), ref)
        t = time_ms(f, x, w, iterations=args.iterations)
      except Exception as e:  # a variant the kernel cannot compile: log and go on
        log(f"  {name}: {type(e).__name__}: {str(e)[:120]}")
        continue
      results.append((t, name, cfg, err))
      log(f"  {name}: {t / dense:.2f} ({t * 1e3:.1f}us) err {err:.1e}")
    results.sort(key=lambda r: r[0])
    best_t, best_name, best_cfg, _ = results[0]
    ks = kernel_times_ms(lambda x, w, cfg=best_cfg: kernels.forward(x, w, config=cfg), x, w, iterations=args.iterations)
    log("  best kernels: " + ", ".join(f"{name[:40]} {t * 1e3:.1f}us" for name, t in ks))
    fifth = results[min(4, len(results) - 1)][0]
    table.append((case, dense * 1e3, op / dense, best_t / dense, best_name, fifth / dense))
  log("\n| case | dense us | op / dense | best / dense | best variant | 5th best / dense |\n|---|---|---|---|---|---|")
  for case, dense_us, op_r, best_r, name, fifth in table:
    log(f"| {case} | {dense_us:.1f} | {op_r:.2f} | {best_r:.2f} | {name} | {fifth:.2f} |")


if __name__ == "__main__":
  main()
