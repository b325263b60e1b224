"""One call of each block-sparse forward (blocks 128 / 64 / 32) and of dense ``jnp.dot``, for Nsight Compute.

Run under ``ncu`` on a CUDA machine to read what bounds each kernel (L2 and DRAM bytes, throughput as a
fraction of peak)::

    ncu --clock-control none --target-processes all --section SpeedOfLight \\
        --metrics lts__t_bytes.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum \\
        --kernel-name regex:"mosaic|block_sparse|gemm|nvjet|cutlass" \\
        python benchmarks/sweeps/gpu_ncu_block_sparse.py [--m 8192 --k 4096 --n 4096 --density 0.25]

Each product runs twice (the first call compiles); the kernels of the second call are the ones to read.
The operands are the op table's (``gpu_block_sparse.py``): exactly ``round(d * blocks)`` kept blocks at
random, the default dispatch of :func:`jaxsparse.ops.block_sparse_matmul`. ``--mosaic-group-cols 1,4,8``
instead runs the Mosaic GPU forward kernel itself with tiles of that many output block columns
(``MosaicKernelConfig.group_cols``), to compare what bounds each grouping.
"""

from __future__ import annotations

import argparse
import dataclasses

import _benchmarks_path  # noqa: F401 -- benchmarks/ on sys.path (_gpu_timing, gpu_block_sparse)
import jax
import jax.numpy as jnp
from gpu_block_sparse import problem

import jaxsparse
from jaxsparse.pallas import _block_sparse_matmul_mgpu as mosaic


def mosaic_config(x, w, group: int):
  """The default Mosaic forward config with ``group`` output block columns a tile (128-row tiles where the
  256-row tile's accumulators do not fit)."""
  base = mosaic.MosaicBlockSparseMatmulConfig.get_default(x.shape[0], w.block_shape, x.dtype).forward
  cfg = mosaic.resolve_config(x, w, None, dataclasses.replace(base, group_cols=group))
  if mosaic.unsupported_reason(x, w, None, cfg):
    cfg = mosaic.resolve_config(x, w, None, dataclasses.replace(cfg, tile_m=128, num_stages=base.num_stages))
  reason = mosaic.unsupported_reason(x, w, None, cfg)
  if reason:
    raise ValueError(f"group_cols={group}: {reason}")
  return cfg


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--m", type=int, default=8192)
  p.add_argument("--k", type=int, default=4096)
  p.add_argument("--n", type=int, default=4096)
  p.add_argument("--density", type=float, default=0.25)
  p.add_argument("--blocks", default="128,64,32", help="comma-separated square block sizes")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
  p.add_argument("--mosaic-group-cols", default=None,
                 help="comma-separated group_cols: run the Mosaic forward kernel with each instead of the default")
  args = p.parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  dense = jax.jit(jnp.dot)
  sparse = jax.jit(jaxsparse.ops.block_sparse_matmul)
  for b in (int(v) for v in args.blocks.split(",")):
    x, _, w, _ = problem(args.m, args.k, args.n, b, args.density, dtype=dtype)
    if args.mosaic_group_cols is None:
      runs = [("", sparse)]
    else:
      runs = []
      for g in (int(v) for v in args.mosaic_group_cols.split(",")):
        cfg = mosaic_config(x, w, g)
        runs.append((f", {cfg}", jax.jit(lambda x, w, cfg=cfg: mosaic.dense_sparse_matmul(x, w, config=cfg))))
    for name, f in runs:
      for _ in range(2):
        jax.block_until_ready(f(x, w))
      print(f"block {b}{name}: {w.data.shape[0]} kept blocks, done", flush=True)
  wd = jnp.ones((args.k, args.n), dtype)
  for _ in range(2):
    jax.block_until_ready(dense(x, wd))
  print("dense: done", flush=True)


if __name__ == "__main__":
  main()
