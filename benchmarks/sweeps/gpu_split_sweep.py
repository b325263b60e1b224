"""The forward and dX kernels with their contraction split, on layers whose output has too few tiles to fill the GPU.

    python benchmarks/sweeps/gpu_split_sweep.py [--cases float32:200x5120x768:128x64:0.38,... --iterations 10]

A case is ``dtype:MxKxN:BKxBN:density``. For each, times (device-side, median of ``--iterations`` calls) the
forward ``x @ W`` and ``dX = dY Wᵀ`` of the default config, and of the Mosaic GPU kernel (row tiles of 128 and
256) and the Triton kernel with the steps of each output tile split into 1, 2, 4 and 8 parts
(``MosaicKernelConfig.split`` / ``KernelConfig.split``), each against the dense product of the same run, and
checks each result against the dense product. The default cases are the rows of
``benchmarks/results/gpu_unseen_shapes_2026-11-25_h200.md`` still slower than dense, narrow or mid-size; this is
the data behind ``SplitRules`` (``DispatchRules.mosaic.split`` / ``.triton.split``). Prints one line per variant
as it goes and a table of the best last.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

import _benchmarks_path  # noqa: F401 -- benchmarks/ on sys.path (_gpu_timing, gpu_block_sparse)
import jax
import jax.numpy as jnp
from _gpu_timing import log
from _gpu_timing import rel_err
from _gpu_timing import time_ms
from gpu_block_sparse import problem

from jaxsparse.pallas import BlockSparseMatmulConfig
from jaxsparse.pallas import _block_sparse_matmul as kernels
from jaxsparse.pallas import _block_sparse_matmul_mgpu as mgpu
from jaxsparse.pallas._block_sparse_config import mosaic_available

CASES = (
    "float32:200x5120x768:128x64:0.38",
    "float32:200x4096x8192:64x128:0.41",
    "bfloat16:200x6144x2560:32x64:0.42",
    "bfloat16:1000x1024x2560:64x32:0.46",
    "bfloat16:200x1024x5120:64x32:0.32",
    "bfloat16:200x768x2560:32x32:0.44",
    "float32:1000x3072x6144:32x64:0.35",
    "bfloat16:384x4096x1024:64x64:0.25",
    "float32:640x2048x1024:128x128:0.3",
    "float32:16x768x3072:128x128:0.2",
)
SPLITS = (1, 2, 4, 8)


def parse(case: str):
  dtype, mkn, block, d = case.split(":")
  m, k, n = (int(v) for v in mkn.split("x"))
  bk, bn = (int(v) for v in block.split("x"))
  return jnp.dtype(dtype), m, k, n, (bk, bn), float(d)


def variants(
    default: BlockSparseMatmulConfig,
    m: int,
    w,
    transpose: bool,
    kinds=("mosaic", "triton"),
    block_ms=(),
    splits=SPLITS,
    index_windows=(None,),
    stages=(None,),
):
  """``(label, config)`` of one product: the default, Mosaic (tile_m x split) and Triton (split; and row tiles
  ``block_ms`` besides the default's, index windows and pipeline stages, ``None``: the default's), of ``kinds``."""
  field, tri_field = ("mosaic_dx", "dx") if transpose else ("mosaic_forward", "forward")
  out = [("default", default)]
  if mosaic_available() and "mosaic" in kinds:
    base = getattr(default, field) or getattr(mgpu.MosaicBlockSparseMatmulConfig.get_default(m, w.block_shape, w.dtype),
                                             "dx" if transpose else "forward")
    for tm in (128, 256):
      for s in splits:
        cfg = dataclasses.replace(base, tile_m=tm, split=s)
        out.append((f"mosaic tm{tm} G{cfg.group_cols} split{s}", dataclasses.replace(default, **{field: cfg})))
  tri = getattr(default, tri_field)
  ob = w.block_shape[0] if transpose else w.block_shape[1]
  for bm in dict.fromkeys((tri.block_m, *block_ms)) if "triton" in kinds else ():
    # 8 warps where the float32 accumulator is 128 x 128 or more (as the default configs).
    warps = 8 if bm * ob >= 128 * 128 else tri.num_warps
    for s, window, st in itertools.product(splits, index_windows, stages):
      window = tri.index_window if window is None else window
      cfg = dataclasses.replace(tri, block_m=bm, num_warps=warps, split=s, index_window=window,
                                num_stages=st or tri.num_stages)
      label = f"triton bm{bm} w{warps} split{s} st{cfg.num_stages}" + ("" if window else " mem")
      out.append((label, dataclasses.replace(default, **{field: None, tri_field: cfg})))
  return out


def _dense_forward(x, dy, wd, precision=None):
  return jnp.dot(x, wd, precision=precision)


def _dense_dx(x, dy, wd, precision=None):
  return jnp.dot(dy, wd.T, precision=precision)


def _sparse(x, dy, w, *, config, transpose, interpret):
  if transpose:
    return kernels.backward(x, dy, w, config=config, need_dw=False, interpret=interpret)[0]
  return kernels.forward(x, w, config=config, interpret=interpret)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cases", default=",".join(CASES), help="comma-separated dtype:MxKxN:BKxBN:density")
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--kernels", default="mosaic,triton", help="comma-separated kernel families of the variants")
  p.add_argument("--triton-block-ms", default="", help="comma-separated Triton row tiles to time besides the default's")
  p.add_argument("--splits", default=",".join(map(str, SPLITS)), help="comma-separated splits of the variants")
  p.add_argument("--triton-index-memory", action="store_true",
                 help="also time the Triton variants with their indices read from memory (index_window=False)")
  p.add_argument("--triton-stages", default="", help="comma-separated Triton pipeline stages (default: the config's)")
  args = p.parse_args(argv)
  interpret = jax.default_backend() != "gpu"  # the CPU smoke test: interpret mode
  table = ["| case | product | dense ms | default (ratio) | best variant | best ms (ratio) | max rel err |",
           "|---|---|---|---|---|---|---|"]
  for case in args.cases.split(","):
    dtype, m, k, n, block, d = parse(case)
    x, dy, w, _ = problem(m, k, n, block, d, seed=1, dtype=dtype)
    wd = w.to_dense()
    default = BlockSparseMatmulConfig.get_default(m, w.shape, w.block_shape, w.nnz_blocks, w.dtype)
    # The kernels only: the dense routes are not what this sweep is about.
    default = dataclasses.replace(default, dense=False, forward_dense=False, dx_dense=False)
    hi = jax.lax.Precision.HIGHEST
    f32 = lambda a: a.astype(jnp.float32)
    for prod, transpose in (("fwd", False), ("dX", True)):
      dense = _dense_dx if transpose else _dense_forward
      ref = dense(f32(x), f32(dy), f32(wd), precision=hi)
      t_dense = time_ms(dense, x, dy, wd, iterations=args.iterations)
      results, errs = {}, []
      ints = lambda v: [int(x) for x in v.split(",") if x]
      for label, cfg in variants(
          default, m, w, transpose, args.kernels.split(","), ints(args.triton_block_ms), ints(args.splits),
          (None, False) if args.triton_index_memory else (None,), ints(args.triton_stages) or (None,),
      ):
        run = functools.partial(_sparse, config=cfg, transpose=transpose, interpret=interpret)
        try:
          errs.append(rel_err(jax.jit(run)(x, dy, w), ref))
          results[label] = time_ms(run, x, dy, w, iterations=args.iterations)
        except Exception as e:  # a variant the kernel does not support: say so, go on
          log(f"{case} {prod} {label}: FAILED {type(e).__name__}: {str(e)[:160]}")
          continue
        log(f"{case} {prod} {label}: {results[label]:.4f} ms ({results[label] / t_dense:.2f}) err {errs[-1]:.1e}")
      best = min((v, k) for k, v in results.items() if k != "default")
      table.append(
          f"| {case} | {prod} | {t_dense:.4f} | {results['default'] / t_dense:.2f} | {best[1]} | "
          f"{best[0]:.4f} ({best[0] / t_dense:.2f}) | {max(errs):.1e} |"
      )
  log(f"\n{jax.devices()[0].device_kind}")
  print("\n".join(table), flush=True)


if __name__ == "__main__":
  main()
