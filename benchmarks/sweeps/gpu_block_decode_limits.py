"""What holds the block-sparse decode kernel (``jaxsparse/_cuda/block_sparse_decode.cu``) under dense's streaming
rate: each product with a uniformly random block mask and with a balanced one (every block column keeps the same
number of blocks), at block-column counts that do and do not divide evenly over the multiprocessors, every listed
config checked against a float32 product and timed as the tuner times candidates (CUPTI, the weight rotated over
copies so that it comes from HBM), XLA's dense ``x @ W`` beside it::

    PYTHONPATH=. python3 benchmarks/sweeps/gpu_block_decode_limits.py --products 1x4096x28672:64:0.5

A product is ``MxKxN:block:density`` (square blocks). Prints a Markdown row per product and mask: the kept blocks of
the fullest block column against the mean, dense µs and its TB/s (the dense weight's bytes), then each config's µs
and TB/s (the kept blocks' bytes), the fastest config and the default's. ``--profile`` then runs each config once
more between ``cuProfilerStart`` / ``cuProfilerStop``, for ``ncu --profile-from-start off -k
regex:block_sparse_decode ...``.
``benchmarks/results/llm_decode_block_decode_limits_2026-12-02_h200.md`` has its output on an H200.
"""

from __future__ import annotations

import argparse
import ctypes

import jax
import jax.numpy as jnp
import numpy as np
from gpu_block_decode import product  # the sibling sweep's MxKxN:block:density parser

import jaxsparse
from jaxsparse._cuda import _block_sparse_decode as bsd
from jaxsparse._tuning._measure import time_call_ms

DEFAULT_PRODUCTS = ",".join(f"1x{shape}:64:0.5" for shape in (
    "4096x6144", "4096x4096", "4096x28672", "14336x4096",  # a Llama-3-8B layer's decode products
    "4096x25344", "4096x33792"))                         # 396 and 528 block columns: 3 and 4 per SM of an H200
DEFAULT_CONFIGS = "default,w1s1lt2,w2s1lt2,w4s1lt2,w8s1lt2,w2s2lt2"


def config(name: str) -> bsd.BlockSparseDecodeConfig:
  """``"w2s1lt3"`` -> ``BlockSparseDecodeConfig(warps=2, split=1, stages=3)``."""
  warps, rest = name.removeprefix("w").split("s", 1)
  split, stages = rest.split("lt")
  return bsd.BlockSparseDecodeConfig(warps=int(warps), split=int(split), stages=int(stages))


def balanced_block_mask(grid: tuple[int, int], density: float, seed: int = 0) -> np.ndarray:
  """Bool ``grid`` keeping ``round(density * rows)`` blocks of every block column, at random rows."""
  rows, cols = grid
  rng = np.random.default_rng(seed)
  mask = np.zeros(grid, bool)
  for j in range(cols):
    mask[rng.choice(rows, round(density * rows), replace=False), j] = True
  return mask


def masks(k: int, n: int, block: int, density: float, kinds: list[str]) -> dict[str, np.ndarray]:
  grid = (k // block, n // block)
  make = {"random": lambda: np.asarray(jaxsparse.random_block_mask(jax.random.key(0), (k, n), (block, block),
                                                                   density)),
          "balanced": lambda: balanced_block_mask(grid, density)}
  return {kind: make[kind]() for kind in kinds}


def row(spec: str, kind: str, counts: np.ndarray, dense_us: float, dense_bytes: int, kept_bytes: int,
        times_us: dict[str, float], default: str) -> str:
  """A Markdown row: ``times_us`` by config name as listed (``"default"``: the config ``default`` names)."""
  best = min(times_us, key=times_us.get)
  cells = [spec, kind, f"{counts.max()} / {counts.mean():.1f}",
           f"{dense_us:.2f} ({dense_bytes / dense_us / 1e6:.2f})",
           *(f"{us:.2f} ({kept_bytes / us / 1e6:.2f})" for us in times_us.values()),
           default if best == "default" else best, default]
  return "| " + " | ".join(cells) + " |"


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--products", default=DEFAULT_PRODUCTS, help="MxKxN:block:density, comma-separated (M 1-8)")
  p.add_argument("--masks", default="random,balanced", help="random and / or balanced, comma-separated")
  p.add_argument("--configs", default=DEFAULT_CONFIGS, help="default and / or names like w2s1lt2, comma-separated")
  p.add_argument("--profile", action="store_true", help="each config once more inside a profiler range (ncu)")
  args = p.parse_args()
  kinds, names = args.masks.split(","), args.configs.split(",")
  rows, profiled = [], []
  for spec in args.products.split(","):
    m, k, n, block, density = product(spec)
    w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.key(2), (m, k), jnp.float32).astype(jnp.bfloat16)
    dense_us = 1e3 * time_call_ms(lambda a, b: a @ b, (x, w), "cuda")
    for kind, mask in masks(k, n, block, density, kinds).items():
      weight = jaxsparse.BlockSparseMatrix.from_dense(w, (block, block), block_mask=jnp.asarray(mask))
      ref = np.asarray(x.astype(jnp.float32) @ weight.to_dense().astype(jnp.float32))
      times, default = {}, bsd.BlockSparseDecodeConfig.get_default(m, k, n, (block, block), weight.nnz_blocks)
      for name in names:
        cfg = default if name == "default" else config(name)
        f = jax.jit(lambda a, b, c=cfg, n=n: bsd.block_sparse_decode(a, b.data, b.col_offsets, b.transpose_order,
                                                                     b.row_indices, n, config=c))
        err = float(np.max(np.abs(np.asarray(f(x, weight), np.float32) - ref)) / np.max(np.abs(ref)))
        if err > 1e-2:
          raise AssertionError(f"{spec} {kind} {cfg.name}: relative error {err:.1e}")
        times[name] = 1e3 * time_call_ms(f, (x, weight), "cuda")
        if args.profile:
          profiled.append((f, x, weight))
      rows.append(row(spec, kind, mask.sum(0), dense_us, w.nbytes, weight.data.nbytes, times, default.name))
      print(rows[-1], flush=True)
  if args.profile:  # each config once more, every earlier call (compiles, timing) outside the profiled range
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    for f, x, weight in profiled:
      f(x, weight).block_until_ready()
    cuda.cuProfilerStop()
  print("\n| M x K x N : block : density | mask | fullest column / mean | dense µs (TB/s) | "
        + " | ".join(f"{name} µs (TB/s)" for name in names) + " | fastest | default |")
  print("|---" * (len(names) + 6) + "|")
  print("\n".join(rows))


if __name__ == "__main__":
  main()
