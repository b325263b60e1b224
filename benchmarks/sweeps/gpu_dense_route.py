"""The dense route of a block-sparse product: the dense weight built from the kept blocks, then one XLA product.

    python benchmarks/sweeps/gpu_dense_route.py [--shapes 2048x4096x4096:16x16:0.5:bfloat16,...] [--iterations 10]

For each ``M x K x N : block : density : dtype`` (default: twelve shapes where the route runs or nearly does, blocks
16-128, from the unseen-shape draws), device-side medians of ``--iterations`` calls: dense ``x @ W``; the ``(K, N)``
weight built by ``BlockSparseMatrix.to_dense`` (zero fill, scatter, transpose), by the XLA gather
(``dense_weight(kernel=False)``) and by what the route uses (``dense_weight``: the Pallas build kernel where it takes
the blocks); the forward on the route (``dense_forward``) over dense, with either build. Prints one table, last.
"""

from __future__ import annotations

import argparse

import _benchmarks_path  # noqa: F401 -- benchmarks/ on sys.path (_gpu_timing)
import jax
import jax.numpy as jnp
import numpy as np
from _gpu_timing import rel_err
from _gpu_timing import time_ms

from jaxsparse.formats import BlockSparseMatrix
from jaxsparse.pallas import _dense_route as dense_route

SHAPES = (
    "8192x6144x14336:16x16:0.43:bfloat16,2048x4096x4096:16x16:0.5:bfloat16,1024x11008x1536:16x16:0.53:float32,"
    "4096x4096x4096:32x32:0.3:bfloat16,256x4096x4096:16x32:0.4:float16,8192x4096x11008:8x8:0.5:bfloat16,"
    "4096x6144x8192:16x16:0.23:float16,1536x3072x512:32x32:0.54:float16,4096x1536x11008:16x64:0.29:float16,"
    "384x768x768:16x16:0.22:float16,2048x4096x4096:64x64:0.5:bfloat16,512x8192x8192:128x128:0.6:bfloat16"
)


def parse(spec: str):
  dims, block, d, dtype = spec.split(":")
  m, k, n = (int(v) for v in dims.split("x"))
  return m, k, n, tuple(int(v) for v in block.split("x")), float(d), jnp.dtype(dtype)


def _row(spec: str, rng, iterations: int) -> str:
  m, k, n, block, d, dtype = parse(spec)
  mask = rng.random((k // block[0], n // block[1])) < d
  w = BlockSparseMatrix.from_block_mask(mask, jnp.asarray(rng.standard_normal((int(mask.sum()), *block)), dtype))
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  wd = w.to_dense()
  us = lambda f, *a: time_ms(f, *a, iterations=iterations) * 1e3
  build = lambda kernel: lambda w: dense_route.dense_weight(w, dtype, kernel=kernel)
  fwd = lambda kernel: lambda x, w: x @ build(kernel)(w)
  t_dense = us(lambda x, wd: x @ wd, x, wd)
  t_to_dense, t_gather, t_build = us(lambda w: w.to_dense(), w), us(build(False), w), us(build(None), w)
  t_fwd_gather, t_fwd = us(fwd(False), x, w), us(fwd(None), x, w)
  err = rel_err(jax.jit(fwd(None))(x, w), jnp.dot(x.astype(jnp.float32), wd.astype(jnp.float32)))
  exact = np.array_equal(np.asarray(jax.jit(build(None))(w), np.float32), np.asarray(wd, np.float32))
  uses_kernel = dense_route.build_kernel_supports(w) and dense_route.available()
  return (
      f"| {m}x{k}x{n} | {block[0]}x{block[1]} | {d} | {dtype.name} | {k * n * dtype.itemsize / 1e6:.0f} | "
      f"{t_dense:.1f} | {t_to_dense:.1f} | {t_gather:.1f} | {t_build:.1f}{'' if exact else ' (WRONG)'} | "
      f"{'yes' if uses_kernel else 'no'} | {t_fwd_gather / t_dense:.3f} | {t_fwd / t_dense:.3f} | {err:.1e} |"
  )


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", default=SHAPES, help="comma-separated MxKxN:BKxBN:density:dtype")
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  rng = np.random.default_rng(args.seed)
  cols = ["M x K x N", "block", "d", "dtype", "weight MB", "dense us", "to_dense us", "XLA gather us", "route build us",
          "kernel", "fwd / dense (XLA gather)", "fwd / dense (route)", "rel err"]
  rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for spec in args.shapes.split(","):
    rows.append(_row(spec, rng, args.iterations))
    print(rows[-1], flush=True)
  print(f"\nThe dense route's weight build, {jax.devices()[0].device_kind}")
  print("\n".join(rows))


if __name__ == "__main__":
  main()
