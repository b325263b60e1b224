"""Every route measured dispatch offers for the weight gradient ``dW`` of a block-sparse product, against dense.

    python benchmarks/sweeps/gpu_dw_routes.py [--shapes 224x14336x512:256x128:0.24:float16,...] [--iterations 20]

For each ``M x K x N : block : density : dtype`` (default: ten shapes of a few hundred to 1024 rows, blocks 64-256,
where ``dW`` was slower than the dense layer's ``xᵀ dY``), device-side medians of ``--iterations`` calls of the
dense layer's ``xᵀ dY`` and of each candidate of ``jaxsparse.ops._block_sparse_matmul._gpu_routes(..., "dw", ...)``
(the Triton kernel's tilings, the Mosaic GPU kernel's, the dense route; blocks of 256 as they are, ``native:``, and
as their 128-sub-blocks, ``split:``), each checked against the first. Logs every candidate; prints one table, last:
the shipped default's time, the fastest candidate and the fastest of the row-slice programs (``sub``).
On a machine without a GPU the kernels run in Pallas interpret mode (a smoke run of tiny shapes only).
"""

from __future__ import annotations

import argparse

import _benchmarks_path  # noqa: F401 -- benchmarks/ on sys.path (_gpu_timing)
import jax
import jax.numpy as jnp
import numpy as np
from _gpu_timing import log
from _gpu_timing import time_ms
from gpu_dense_route import parse  # the same MxKxN:BKxBN:density:dtype specs

from jaxsparse.formats import BlockSparseMatrix
from jaxsparse.ops import _block_sparse_matmul as op

SHAPES = (
    "224x14336x512:256x128:0.24:float16,224x4096x4096:128x128:0.3:bfloat16,512x4096x11008:128x128:0.1:bfloat16,"
    "256x8192x2048:256x256:0.25:bfloat16,1024x4096x4096:128x128:0.3:float32,64x4096x14336:128x128:0.2:bfloat16,"
    "640x2048x8192:128x64:0.3:bfloat16,1024x4096x4096:128x128:0.5:bfloat16,128x5120x5120:128x128:0.25:bfloat16,"
    "448x2048x5632:256x128:0.4:bfloat16"
)


def _row(spec: str, iterations: int) -> str:
  m, k, n, block, d, dtype = parse(spec)
  rng = np.random.default_rng(0)
  kb, nb = k // block[0], n // block[1]
  mask = np.zeros(kb * nb, bool)
  mask[rng.choice(kb * nb, max(1, round(d * kb * nb)), replace=False)] = True
  data = jnp.asarray(rng.standard_normal((int(mask.sum()), *block)), dtype)
  w = BlockSparseMatrix.from_block_mask(mask.reshape(kb, nb), data)
  x, dy = (jnp.asarray(rng.standard_normal(s), dtype) for s in ((m, k), (m, n)))
  us = lambda f, *a: time_ms(f, *a, iterations=iterations) * 1e3
  dense = us(lambda a, b: a.T @ b, x, dy)
  kernels = op._pallas_ops()
  times, ref = {}, None
  for name, route in op._gpu_routes(kernels, "dw", x, w, precision=None, out_dtype=dtype):
    f = op._gpu_run(kernels, "dw", route, precision=None, out_dtype=dtype)
    if jax.default_backend() != "gpu" and route[1] is not None:  # interpret mode (a smoke run on a CPU)
      if route[0] is not None:  # (sub-blocks: GPU only)
        continue
      f = lambda a, b, c, route=route: kernels.backward(a, b, c, config=route[1], interpret=True, need_dx=False)[1]
    out = np.asarray(jax.jit(f)(x, dy, w), np.float32)
    ref = out if ref is None else ref
    err = float(np.abs(out - ref).max() / (np.abs(ref).max() + 1e-30))
    times[name] = us(f, x, dy, w)
    log(f"{spec} {name}: {times[name]:.1f} us, rel. err against the first {err:.1e}, config "
        f"{None if route[1] is None else route[1].dw}")
  default = next(iter(times))
  best = min(times, key=times.get)
  subs = [t for name, t in times.items() if "/sub" in name]
  return (f"| {m}x{k}x{n} | {block[0]}x{block[1]} | {d} | {dtype.name} | {dense:.1f} | {times[default]:.1f} | "
          f"{best} | {times[best]:.1f} | {min(subs) if subs else float('nan'):.1f} |")


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", default=SHAPES, help="comma-separated MxKxN:BKxBN:density:dtype")
  p.add_argument("--iterations", type=int, default=20)
  args = p.parse_args(argv)
  rows = [_row(spec, args.iterations) for spec in args.shapes.split(",")]
  print(f"\n# dW routes against the dense layer's xᵀ dY ({jax.devices()[0].device_kind})\n")
  print("| M x K x N | block | d | dtype | dense xᵀ dY us | default us | fastest | fastest us | fastest sub us |")
  print("|---|---|---|---|---|---|---|---|---|")
  print("\n".join(rows))


if __name__ == "__main__":
  main()
