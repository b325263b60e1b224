"""The dense-product route of small blocks (block 32 above d = 0.3): building the dense weight, and the products.

    python benchmarks/sweeps/gpu_dense_route.py [--m 8192 --k 4096 --n 4096 --densities 0.5,0.4]

Times (device-side, median of ``--iterations`` calls) for bf16 32 x 32 blocks: dense ``jnp.dot``; the
dense ``(K, N)`` weight built by ``BlockSparseMatrix.to_dense`` (zero fill, scatter, transpose) and by
``dense_weight`` (one gather pass, what the route uses); the library's forward and forward + backward on
that route against dense autodiff. Prints one table, last.
"""

from __future__ import annotations

import argparse

import _benchmarks_path  # noqa: F401 -- benchmarks/ on sys.path (_gpu_timing, gpu_block_sparse)
import jax
import jax.numpy as jnp
from _gpu_timing import rel_err
from _gpu_timing import time_ms
from gpu_block_sparse import dense_fns
from gpu_block_sparse import problem
from gpu_block_sparse import sparse_fns

from jaxsparse.pallas import _dense_route as dense_route


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--m", type=int, default=8192)
  p.add_argument("--k", type=int, default=4096)
  p.add_argument("--n", type=int, default=4096)
  p.add_argument("--densities", default="0.5,0.4")
  p.add_argument("--iterations", type=int, default=20)
  args = p.parse_args(argv)
  cols = ["d", "dense fwd ms", "to_dense ms", "dense_weight ms", "fwd ms (ratio)", "dense fwd+bwd ms",
          "fwd+bwd ms (ratio)", "rel err y"]
  rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for d in (float(v) for v in args.densities.split(",")):
    x, dy, w, _ = problem(args.m, args.k, args.n, 32, d)
    wd = w.to_dense()
    dense, sparse = dense_fns(), sparse_fns(None)
    t_dense = time_ms(dense["fwd"], x, dy, wd, iterations=args.iterations)
    t_dense_both = time_ms(dense["fwd+bwd"], x, dy, wd, iterations=args.iterations)
    t_old = time_ms(lambda w: w.to_dense().astype(jnp.bfloat16), w, iterations=args.iterations)
    t_new = time_ms(lambda w: dense_route.dense_weight(w, jnp.bfloat16), w, iterations=args.iterations)
    t_fwd = time_ms(sparse["fwd"], x, dy, w, iterations=args.iterations)
    t_both = time_ms(sparse["fwd+bwd"], x, dy, w, iterations=args.iterations)
    err = rel_err(jax.jit(sparse["fwd"])(x, dy, w), jnp.dot(x.astype(jnp.float32), wd.astype(jnp.float32)))
    rows.append(f"| {d} | {t_dense:.4f} | {t_old:.4f} | {t_new:.4f} | {t_fwd:.4f} ({t_fwd / t_dense:.2f}) | "
                f"{t_dense_both:.4f} | {t_both:.4f} ({t_both / t_dense_both:.2f}) | {err:.1e} |")
    print(rows[-1], flush=True)
  print(f"\nbf16, M={args.m}, K={args.k}, N={args.n}, blocks 32x32, {jax.devices()[0].device_kind}")
  print("\n".join(rows))


if __name__ == "__main__":
  main()
