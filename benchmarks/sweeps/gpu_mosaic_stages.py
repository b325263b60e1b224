"""Mosaic GPU kernels: ring depth (``num_stages``) against output block columns a tile (``group_cols``), and for dW.

Question: are the grouped-column tiles of small blocks bound by the latency of the load ring rather than by L2
bandwidth (Nsight Compute on the 32-block forward: G = 4 moves 26% fewer L2 bytes than G = 1 at 58% of the L2's
peak, yet runs 10% longer)? Times the kernel (CUPTI, the step-list kernels around it reported apart) for each
``(group_cols, tile_m, num_stages)`` that fits shared memory and the registers, as ratios to the dense product.

    python3 sweeps/gpu_mosaic_stages.py [--blocks 32,64 --densities 0.25,0.5 --dtype bfloat16 --products fwd,dx]

``--products dw`` times the sampled ``dW = xᵀ dY`` kernel (:mod:`jaxsparse.pallas._block_sparse_sdd_mgpu`) over the
dense ``xᵀ dY``, its ``group`` (``--groups``) and ``tile_m`` (``--tile-ms``) in place of ``group_cols`` and the row
tile.

``--ab-seeds 7,23`` instead times the default route (``jaxsparse.ops.block_sparse_matmul``, forward and
forward + both gradients) on the draws of ``gpu_unseen_shapes.py`` whose route runs a Mosaic kernel, with the
default forward / dX configs' ring capped at 4 slots (the cap before ``MAX_STAGES``) and at ``MAX_STAGES``,
interleaved (the dW kernel's ring keeps its default).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import _benchmarks_path  # noqa: F401 -- benchmarks/ on sys.path (_gpu_timing, gpu_block_sparse)
import jax
import jax.numpy as jnp
from _gpu_timing import TIMER
from _gpu_timing import kernel_split_ms
from _gpu_timing import log
from _gpu_timing import rel_err
from _gpu_timing import time_ms
from gpu_block_sparse import block_mask
from gpu_block_sparse import problem
from gpu_unseen_shapes import cases
from gpu_unseen_shapes import route
from gpu_unseen_shapes import run_case

import jaxsparse
from jaxsparse.pallas import _block_sparse_matmul_mgpu as mosaic
from jaxsparse.pallas import _block_sparse_sdd_mgpu as sdd


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--m", type=int, default=8192)
  p.add_argument("--k", type=int, default=4096)
  p.add_argument("--n", type=int, default=4096)
  p.add_argument("--blocks", default="32,64")
  p.add_argument("--densities", default="0.25,0.5")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
  p.add_argument("--products", default="fwd")
  p.add_argument("--groups", default="1,2,4,8")
  p.add_argument("--stages", default="2,3,4,6,8,10")
  p.add_argument("--tile-ms", default="128,256")
  p.add_argument("--iterations", type=int, default=20)
  p.add_argument("--ab-seeds", default=None, help="comma-separated gpu_unseen_shapes.py seeds: A/B of the ring cap")
  p.add_argument("--ab-cases", type=int, default=24)
  args = p.parse_args(argv)
  if args.ab_seeds:
    ab_stages([int(v) for v in args.ab_seeds.split(",")], args.ab_cases, args.iterations)
    return
  dtype = jnp.dtype(args.dtype)
  ints = lambda s: [int(v) for v in s.split(",")]
  hi = jax.lax.Precision.HIGHEST
  rows = []
  x, dy, _, _ = problem(args.m, args.k, args.n, 32, 1.0, dtype=dtype)
  wd = jax.random.normal(jax.random.key(1), (args.k, args.n), jnp.float32).astype(dtype)
  t_dense = {"fwd": time_ms(jnp.dot, x, wd, iterations=args.iterations),
             "dx": time_ms(lambda dy, wd: jnp.dot(dy, wd.T), dy, wd, iterations=args.iterations),
             "dw": time_ms(lambda x, dy: jnp.dot(x.T, dy), x, dy, iterations=args.iterations)}
  log(f"{dtype.name} {args.m}x{args.k}x{args.n}: dense {t_dense}, timer {TIMER['how']}")
  for b, d, kind in itertools.product(ints(args.blocks), [float(v) for v in args.densities.split(",")],
                                      args.products.split(",")):
    x, dy, w, mask = problem(args.m, args.k, args.n, b, d, seed=b, dtype=dtype)
    a = dy if kind == "dx" else x
    wf = w.to_dense().astype(jnp.float32)
    if kind == "dw":
      dense_dw = jnp.dot(x.astype(jnp.float32).T, dy.astype(jnp.float32), precision=hi)
      ref = jaxsparse.BlockSparseMatrix.from_dense(dense_dw, w.block_shape, block_mask=mask).data
      base = sdd.MosaicSddConfig.get_default(w.block_shape, dtype)
    else:
      ref = jnp.dot(a.astype(jnp.float32), wf if kind == "fwd" else wf.T, precision=hi)
      base = mosaic.MosaicBlockSparseMatmulConfig.get_default(args.m, w.block_shape, dtype)
      base = base.forward if kind == "fwd" else base.dx
    best = {}
    for g, tm, s in itertools.product(ints(args.groups), ints(args.tile_ms), ints(args.stages)):
      if kind == "dw":
        cfg = dataclasses.replace(base, group=g, tile_m=tm, num_stages=s)
        reason = sdd.unsupported_reason(x, dy, w, cfg)
        f = lambda a, w, cfg=cfg, dy=dy: sdd.sampled_dw(a, dy, w, config=cfg)
      else:
        cfg = dataclasses.replace(base, group_cols=g, tile_m=tm, num_stages=s)
        reason = mosaic.unsupported_reason(a, w, None, cfg, transpose=kind == "dx")
        f = lambda a, w, cfg=cfg, t=kind == "dx": mosaic.dense_sparse_matmul(a, w, transpose=t, config=cfg)
      if reason:
        continue
      try:
        err = rel_err(jax.jit(f)(a, w), ref)
        k_ms, rest_ms, _ = kernel_split_ms(f, a, w, iterations=args.iterations)
      except Exception as e:  # a config Mosaic cannot lower: say so, go on
        log(f"b={b} d={d} {kind} G={g} tm={tm} stages={s}: FAILED {type(e).__name__}: {str(e)[:300]}")
        continue
      r = k_ms / t_dense[kind]
      log(f"b={b} d={d} {kind} G={g} tm={tm} stages={s}: kernel {k_ms:.4f} ms ({r:.3f}), "
          f"other {rest_ms * 1e3:.1f} us, err {err:.1e}")
      rows.append((b, d, kind, g, tm, s, r))
      if r < best.get((g, tm), (9.0,))[0]:
        best[(g, tm)] = (r, s)
    log(f"b={b} d={d} {kind}: best stages per (G, tile_m): " +
        ", ".join(f"G{g}/{tm}: {r:.3f} (s={s})" for (g, tm), (r, s) in sorted(best.items())))
  print("| block | d | product | G | tile_m | " + " | ".join(f"s={s}" for s in ints(args.stages)) + " |")
  for key, group in itertools.groupby(rows, key=lambda r: r[:5]):
    cells = {r[5]: f"{r[6]:.3f}" for r in group}
    print("| " + " | ".join(map(str, key)) + " | " + " | ".join(cells.get(s, "-") for s in ints(args.stages)) + " |")


def ab_stages(seeds, count: int, iterations: int) -> None:
  """Default route, ring capped at 4 against ``mosaic.MAX_STAGES``, on the unseen-shape draws that run Mosaic."""
  deepest = mosaic.MAX_STAGES
  print("| seed | case | x | K | N | block | d | dtype | fwd 4 / max | fwd+bwd 4 / max |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for seed in seeds:
    for i, c in enumerate(cases(count, seed)):
      x = jnp.zeros((*c["batch"], c["k"]), c["dtype"])
      bk, bn = c["block"]
      mask = block_mask(c["k"], c["n"], bk, c["density"], seed=1, bn=bn)  # run_case's pattern
      w = jaxsparse.BlockSparseMatrix.from_dense(jnp.ones((c["k"], c["n"]), c["dtype"]), (bk, bn), block_mask=mask)
      if "mosaic" not in route(jaxsparse.ops.block_sparse_matmul, x, w):
        continue
      got = {}
      for cap in (4, deepest, 4, deepest):  # interleaved; the better of two runs each
        mosaic.MAX_STAGES = cap
        r = run_case(c, iterations)
        for kind in ("fwd", "fwd+bwd"):
          if kind in r:
            got[(cap, kind)] = min(got.get((cap, kind), 9.0), r[kind])
      mosaic.MAX_STAGES = deepest
      cells = [f"{got[(4, k)]:.2f} / {got[(deepest, k)]:.2f}" if (4, k) in got else "-" for k in ("fwd", "fwd+bwd")]
      shape = "x".join(map(str, c["batch"]))
      print(f"| {seed} | {i} | {shape} | {c['k']} | {c['n']} | {bk}x{bn} | {c['density']} | {c['dtype'].name} | "
            + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
  main()
