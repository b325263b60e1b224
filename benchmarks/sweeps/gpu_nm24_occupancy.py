"""The ``mma.sp`` 2:4 decode kernel (``jaxsparse._cuda``) compiled for one and for two thread blocks per
multiprocessor (``Nm24DecodeConfig.blocks_per_sm``), at the fused Llama-3-8B decode products; and, with
``--profile``, one call of the kernel and of the dense ``jnp.dot`` to read under Nsight Compute::

    python benchmarks/sweeps/gpu_nm24_occupancy.py                      # CUPTI device time, a Markdown table
    ncu --clock-control none --kernel-name regex:'nm24_decode|gemm_fusion|gemv|nvjet|cutlass|sm90_' --launch-count 8 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \\
        python benchmarks/sweeps/gpu_nm24_occupancy.py --profile

Shapes (K x N): qkv 4096 x 6144, o 4096 x 4096, gate_up 4096 x 28672, down 14336 x 4096; bfloat16, random 2:4
weights; the default config of each product (``Nm24DecodeConfig.get_default``) with ``blocks_per_sm`` 1 and 2.
Recorded in ``benchmarks/results/llm_decode_fused_2026-11-27_h100.md``.
"""

from __future__ import annotations

import argparse
import dataclasses

import _benchmarks_path  # noqa: F401 -- benchmarks/ on sys.path (_gpu_timing)
import jax
import jax.numpy as jnp
import numpy as np
from _gpu_timing import time_ms

import jaxsparse
from jaxsparse._cuda import _kernels as ck

SHAPES = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096))


def _weights(k: int, n: int):
  rng = np.random.default_rng(0)
  dense = jnp.asarray(rng.standard_normal((k, n), np.float32), jnp.bfloat16)
  return dense, jaxsparse.NMSparseMatrix.from_dense(dense, 2, 4)


def profile() -> None:
  """Two calls each (the first compiles) of the kernel and of the dense product, at M = 1, for ``ncu``."""
  for k, n in SHAPES[2:]:
    dense, w = _weights(k, n)
    x = jnp.ones((1, k), jnp.bfloat16)
    kernel = jax.jit(lambda x, v, i: ck.nm24_decode(x, v, i))
    dot = jax.jit(jnp.dot)
    for _ in range(2):
      jax.block_until_ready(kernel(x, w.values, w.indices))
      jax.block_until_ready(dot(x, dense))


def table(rows_of_x: tuple[int, ...]) -> str:
  lines = ["| M x K x N | default (split, warps, span) | 1 block / SM µs | 2 blocks / SM µs | ratio |",
           "|---|---|---|---|---|"]
  for k, n in SHAPES:
    _, w = _weights(k, n)
    for m in rows_of_x:
      x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k), np.float32), jnp.bfloat16)
      default = ck.Nm24DecodeConfig.get_default(m, k, n)
      us = {}
      for blocks in (1, 2):
        cfg = dataclasses.replace(default, blocks_per_sm=blocks)
        run = lambda x, v, i, cfg=cfg: ck.nm24_decode(x, v, i, config=cfg)
        us[blocks] = time_ms(run, x, w.values, w.indices, iterations=50) * 1e3
      lines.append(f"| {m} x {k} x {n} | {default.split}, {default.warps}, {default.span} | {us[1]:.2f} | "
                   f"{us[2]:.2f} | {us[2] / us[1]:.3f} |")
      print(lines[-1], flush=True)
  return "\n".join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--profile", action="store_true", help="one call of each kernel, for ncu; no timing")
  p.add_argument("--rows", default="1,8", help="rows of x (M <= 32), comma-separated")
  args = p.parse_args()
  if args.profile:
    profile()
  else:
    print(table(tuple(int(m) for m in args.rows.split(","))))


if __name__ == "__main__":
  main()
