"""The ``mma.sp`` 2:4 decode kernel (``jaxsparse._cuda``) at its default config against the same config with one field
changed: ``blocks_per_sm`` 2 (compiled for two thread blocks per multiprocessor) or ``token_split`` 2 (two warps a
step of ``K``, half the rows each); and, with ``--profile``, one call of the kernel and of the dense ``jnp.dot`` to
read under Nsight Compute::

    python benchmarks/sweeps/gpu_nm24_occupancy.py                      # CUPTI device time, a Markdown table
    python benchmarks/sweeps/gpu_nm24_occupancy.py --field token_split --shapes 8b,1.1b --rows 16,24,32 --cold
    ncu --clock-control none --kernel-name regex:'nm24_decode|gemm_fusion|gemv|nvjet|cutlass|sm90_' --launch-count 8 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \\
        python benchmarks/sweeps/gpu_nm24_occupancy.py --profile

Shapes (K x N), fused Llama decode products: ``8b`` qkv 4096 x 6144, o 4096 x 4096, gate_up 4096 x 28672, down
14336 x 4096; ``1.1b`` (TinyLlama) qkv 2048 x 2560, o 2048 x 2048, gate_up 2048 x 11264, down 5632 x 2048. bfloat16,
random 2:4 weights. ``--cold`` times as measured dispatch does (the operands rotated over copies, so that the weights
come from HBM; the dense ``x @ W`` too); without it the weights stay in L2 (as in
``benchmarks/results/llm_decode_fused_2026-11-27_h100.md``). The token split's table in
``benchmarks/results/llm_decode_kernel_limits_2026-11-27_h100.md`` was measured with a throwaway script that timed
the same way as ``--cold``.
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
from jaxsparse._tuning import _measure

SHAPES = {
    "8b": ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)),
    "1.1b": ((2048, 2560), (2048, 2048), (2048, 11264), (5632, 2048)),
}


def _weights(k: int, n: int):
  rng = np.random.default_rng(0)
  dense = jnp.asarray(rng.standard_normal((k, n), np.float32), jnp.bfloat16)
  return dense, jaxsparse.NMSparseMatrix.from_dense(dense, 2, 4)


def profile() -> None:
  """Two calls each (the first compiles) of the kernel and of the dense product, at M = 1, for ``ncu``."""
  for k, n in SHAPES["8b"][2:]:
    dense, w = _weights(k, n)
    x = jnp.ones((1, k), jnp.bfloat16)
    kernel = jax.jit(lambda x, v, i: ck.nm24_decode(x, v, i))
    dot = jax.jit(jnp.dot)
    for _ in range(2):
      jax.block_until_ready(kernel(x, w.values, w.indices))
      jax.block_until_ready(dot(x, dense))


def _us(f, args: tuple, cold: bool) -> float:
  if cold:
    return _measure.time_call_ms(f, args, "cuda") * 1e3
  return time_ms(f, *args, iterations=50) * 1e3


def table(shapes, rows_of_x: tuple[int, ...], field: str, cold: bool) -> str:
  lines = [f"| M x K x N | default config | dense µs | default µs | {field}=2 µs | ratio |", "|---" * 6 + "|"]
  for k, n in shapes:
    dense, w = _weights(k, n)
    for m in rows_of_x:
      x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k), np.float32), jnp.bfloat16)
      default = ck.Nm24DecodeConfig.get_default(m, k, n)
      us = {}
      for value in (1, 2):
        cfg = dataclasses.replace(default, **{field: value})
        us[value] = _us(lambda x, v, i, cfg=cfg: ck.nm24_decode(x, v, i, config=cfg), (x, w.values, w.indices), cold)
      d = _us(jnp.dot, (x, dense), cold)
      lines.append(f"| {m} x {k} x {n} | {default.name} | {d:.2f} | {us[1]:.2f} | {us[2]:.2f} | {us[2] / us[1]:.3f} |")
      print(lines[-1], flush=True)
  return "\n".join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--profile", action="store_true", help="one call of each kernel, for ncu; no timing")
  p.add_argument("--rows", default="1,8", help="rows of x (M <= 32), comma-separated")
  p.add_argument("--field", choices=("blocks_per_sm", "token_split"), default="blocks_per_sm",
                 help="the config field set to 2 against the default config")
  p.add_argument("--shapes", default="8b", help="8b, 1.1b or both (comma-separated)")
  p.add_argument("--cold", action="store_true", help="weights from HBM, as measured dispatch times them")
  args = p.parse_args()
  if args.profile:
    profile()
    return
  shapes = [s for name in args.shapes.split(",") for s in SHAPES[name]]
  print(table(shapes, tuple(int(m) for m in args.rows.split(",")), args.field, args.cold))


if __name__ == "__main__":
  main()
