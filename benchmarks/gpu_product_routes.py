"""Each product of a block-sparse layer on its two routes: the per-block kernels and the dense product.

    python benchmarks/gpu_product_routes.py [--ns 4096,16384 --blocks 32,64 --densities 0.25,0.5
                                             --dtypes bfloat16,float32 --m 8192]

For ``x (M, 4096) @ W (4096, N)`` with a random block pattern, times (device-side, median of
``--iterations`` calls) the forward, ``dX = dY Wᵀ`` and ``dW = xᵀ dY`` (kept blocks) three ways: the
per-block kernels (Mosaic GPU / Triton, as the default config picks them), the dense route (forward
and ``dX``: ``dense_weight`` then one dense product; ``dW``: the dense ``xᵀ dY`` then a gather of the
kept blocks) and the plain dense product of a dense weight; "default route" is what
``BlockSparseMatmulConfig.get_default`` picks. This is the data behind ``DENSE_ABOVE_DENSITY``,
``DX_DENSE_*``, ``DW_DENSE_*`` and the ``*_MIN_M`` thresholds in ``jaxsparse/pallas/_block_sparse_config.py``.
Prints one table, last.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
from _gpu_timing import log
from _gpu_timing import time_ms
from gpu_block_sparse import problem

from jaxsparse.pallas import BlockSparseMatmulConfig
from jaxsparse.pallas import _block_sparse_matmul as kernels


def _products(cfg):
  return {
      "fwd": lambda x, dy, w: kernels.forward(x, w, config=cfg),
      "dX": lambda x, dy, w: kernels.backward(x, dy, w, config=cfg, need_dw=False)[0],
      "dW": lambda x, dy, w: kernels.backward(x, dy, w, config=cfg, need_dx=False)[1],
  }


def _dense_products():
  return {
      "fwd": lambda x, dy, wd: x @ wd,
      "dX": lambda x, dy, wd: dy @ wd.T,
      "dW": lambda x, dy, wd: jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ()))),
  }


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--m", default="8192", help="comma-separated M")
  p.add_argument("--ns", default="4096,16384")
  p.add_argument("--blocks", default="32,64")
  p.add_argument("--densities", default="0.25,0.5")
  p.add_argument("--dtypes", default="bfloat16,float32")
  p.add_argument("--iterations", type=int, default=10)
  args = p.parse_args(argv)
  ints = lambda s: [int(v) for v in s.split(",")]
  head = ["dtype", "M", "N", "block", "d", "default route"]
  for prod in ("fwd", "dX", "dW"):
    head += [f"{prod} dense ms", f"{prod} kernels ms (ratio)", f"{prod} dense route ms (ratio)"]
  rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for dtype in (jnp.dtype(v) for v in args.dtypes.split(",")):
    for m in ints(args.m):
      for n in ints(args.ns):
        x, dy, _, _ = problem(m, 4096, n, 32, 1.0, dtype=dtype)
        wd = jax.random.normal(jax.random.key(1), (4096, n), jnp.float32).astype(dtype)
        dense = {k: time_ms(f, x, dy, wd, iterations=args.iterations) for k, f in _dense_products().items()}
        del wd
        for b in ints(args.blocks):
          for d in (float(v) for v in args.densities.split(",")):
            x, dy, w, _ = problem(m, 4096, n, b, d, seed=b, dtype=dtype)
            default = BlockSparseMatmulConfig.get_default(m, w.shape, w.block_shape, w.nnz_blocks, w.dtype)
            kern = dataclasses.replace(default, dense=False, dx_dense=False, dw_dense=False)
            route = dataclasses.replace(default, dense=True)
            routes = {name: _products(c) for name, c in (("kernels", kern), ("route", route))}
            used = "dense" if default.dense else " + ".join(
                [f"{p} dense" for p, on in (("dX", default.dx_dense), ("dW", default.dw_dense)) if on] or ["kernels"]
            )
            cells = [dtype.name, str(m), str(n), str(b), str(d), used]
            for prod in ("fwd", "dX", "dW"):
              t = {name: time_ms(fs[prod], x, dy, w, iterations=args.iterations) for name, fs in routes.items()}
              cells += [f"{dense[prod]:.4f}"] + [f"{t[r]:.4f} ({t[r] / dense[prod]:.2f})" for r in ("kernels", "route")]
            rows.append("| " + " | ".join(cells) + " |")
            log(rows[-1])
  log(f"\n{jax.devices()[0].device_kind}, K = 4096, density = kept blocks / blocks")
  print("\n".join(rows), flush=True)


if __name__ == "__main__":
  main()
