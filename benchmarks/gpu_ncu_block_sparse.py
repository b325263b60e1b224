"""One call of each block-sparse forward (blocks 128 / 64 / 32) and of dense ``jnp.dot``, for Nsight Compute.

Run under ``ncu`` on a CUDA machine to read what bounds each kernel (L2 and DRAM bytes, throughput as a
fraction of peak)::

    ncu --clock-control none --target-processes all --section SpeedOfLight \\
        --metrics lts__t_bytes.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum \\
        --kernel-name regex:"mosaic|block_sparse|gemm|nvjet|cutlass" \\
        python benchmarks/gpu_ncu_block_sparse.py [--m 8192 --k 4096 --n 4096 --density 0.25]

Each product runs twice (the first call compiles); the kernels of the second call are the ones to read.
The operands are the op table's (``gpu_block_sparse.py``): bf16, exactly ``round(d * blocks)`` kept blocks
at random, the default dispatch of :func:`jaxsparse.ops.block_sparse_matmul`.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from gpu_block_sparse import problem

import jaxsparse


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--m", type=int, default=8192)
  p.add_argument("--k", type=int, default=4096)
  p.add_argument("--n", type=int, default=4096)
  p.add_argument("--density", type=float, default=0.25)
  p.add_argument("--blocks", default="128,64,32", help="comma-separated square block sizes")
  args = p.parse_args(argv)
  dense = jax.jit(jnp.dot)
  sparse = jax.jit(jaxsparse.ops.block_sparse_matmul)
  for b in (int(v) for v in args.blocks.split(",")):
    x, _, w, _ = problem(args.m, args.k, args.n, b, args.density)
    for _ in range(2):
      jax.block_until_ready(sparse(x, w))
    print(f"block {b}: {w.data.shape[0]} kept blocks, done", flush=True)
  wd = jnp.ones((args.k, args.n), jnp.bfloat16)
  for _ in range(2):
    jax.block_until_ready(dense(x, wd))
  print("dense: done", flush=True)


if __name__ == "__main__":
  main()
