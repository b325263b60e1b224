"""CPU benchmark: unstructured sparse forward and forward+backward against dense, in the same run.

    python benchmarks/cpu_unstructured.py            # the issue's case: f32, K=N=4096, batch 256
    python benchmarks/cpu_unstructured.py --quick    # small sizes, a smoke run

Dense is ``x @ w`` with its gradients (w.r.t. x and w), jitted. Two sparse variants, both on the
C++ CPU kernels:

* ``csr``: :func:`jaxsparse.ops.sparse_matmul` on a :class:`jaxsparse.CSRMatrix`, gradients w.r.t.
  x and the kept weights (``w.data``); everything is O(nnz).
* ``masked``: :func:`jaxsparse.ops.masked_matmul` with its default backend choice (what
  ``MaskedLinear`` runs), dense ``w`` plus a bool mask read on every call, gradients w.r.t. x and the
  dense ``w`` (zero outside the mask).
* ``masked-xla`` (not run by default): the same with ``implementation="xla"``, the masked dense
  product ``x @ where(mask, w, 0)`` that MaskedLinear ran before the CPU kernels.

Each variant is timed ``--repeats`` times, interleaved with the others so that machine noise hits
all of them alike; the table shows medians and the speedup over dense (higher is better).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxsparse
from jaxsparse.ops import masked_matmul
from jaxsparse.ops import sparse_matmul


def _timed(fn, *args) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--k", type=int, default=4096)
  parser.add_argument("--n", type=int, default=4096)
  parser.add_argument("--sparsities", type=float, nargs="+", default=[0.7, 0.8, 0.9, 0.95, 0.98])
  parser.add_argument("--variants", nargs="+", default=["csr", "masked"], choices=["csr", "masked", "masked-xla"])
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
  args = parser.parse_args()
  if args.quick:
    args.batch, args.k, args.n, args.repeats = 64, 512, 512, 3

  kx, kw, km = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (args.batch, args.k), jnp.float32)
  w = jax.random.normal(kw, (args.k, args.n), jnp.float32) / np.sqrt(args.k)

  def dense_loss(x, w):
    return jnp.sum(jnp.sin(x @ w))

  def csr_loss(ws):
    return lambda x, data: jnp.sum(jnp.sin(sparse_matmul(x, ws.with_data(data))))

  def masked_loss(mask, impl):
    return lambda x, w: jnp.sum(jnp.sin(masked_matmul(x, w, mask, implementation=impl)))

  variants = {
      ("dense", "fwd"): (jax.jit(lambda x, w: x @ w), (x, w)),
      ("dense", "fwd+bwd"): (jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1))), (x, w)),
  }
  for s in args.sparsities:
    mask = jax.random.uniform(km, (args.k, args.n)) >= s
    if "csr" in args.variants:
      ws = jaxsparse.CSRMatrix.from_dense(w, mask=mask)
      variants[(f"csr, {s:.0%}", "fwd")] = (jax.jit(lambda x, ws: sparse_matmul(x, ws, implementation="cpu")), (x, ws))
      variants[(f"csr, {s:.0%}", "fwd+bwd")] = (
          jax.jit(jax.value_and_grad(csr_loss(ws), argnums=(0, 1))),
          (x, ws.data),
      )
    for name, impl in (("masked", None), ("masked-xla", "xla")):
      if name in args.variants:
        variants[(f"{name}, {s:.0%}", "fwd")] = (
            jax.jit(lambda x, w, m, impl=impl: masked_matmul(x, w, m, implementation=impl)),
            (x, w, mask),
        )
        variants[(f"{name}, {s:.0%}", "fwd+bwd")] = (
            jax.jit(jax.value_and_grad(masked_loss(mask, impl), argnums=(0, 1))),
            (x, w),
        )
  for fn, a in variants.values():  # compile and warm up
    jax.block_until_ready(fn(*a))
  times = {key: [] for key in variants}
  for _ in range(args.repeats):
    for key, (fn, a) in variants.items():
      times[key].append(_timed(fn, *a))
  med = {key: float(np.median(v)) * 1e3 for key, v in times.items()}

  print(f"# jaxsparse CPU unstructured benchmark, {datetime.date.today()}")
  print(f"# {platform.processor() or platform.machine()}, {jax.device_count()} device(s), "
        f"jax {jax.__version__}, cores available: {len(os.sched_getaffinity(0))}, load average at the end: "
        f"{', '.join(f'{v:.1f}' for v in os.getloadavg())}")
  print(f"# f32, x: ({args.batch}, {args.k}), W: ({args.k}, {args.n}), medians of {args.repeats} interleaved runs")
  print()
  print("| case | fwd ms | fwd speedup | fwd+bwd ms | fwd+bwd speedup |")
  print("|---|---|---|---|---|")
  dense_f, dense_fb = med[("dense", "fwd")], med[("dense", "fwd+bwd")]
  for name in dict.fromkeys(k[0] for k in variants):
    f, fb = med[(name, "fwd")], med[(name, "fwd+bwd")]
    print(f"| {name} | {f:.1f} | {dense_f / f:.2f}x | {fb:.1f} | {dense_fb / fb:.2f}x |")


if __name__ == "__main__":
  main()
