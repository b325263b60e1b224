"""The ``mma.sp`` 2:4 decode kernel on cuSPARSELt's buffer: every candidate config measured dispatch times for some
products, each checked against a float32 product and timed as the tuner times it (CUPTI device time, operands rotated
over copies so that the weight comes from HBM), against XLA's dense ``x @ W`` in the same process::

    PYTHONPATH=. python3 benchmarks/sweeps/gpu_nm24_candidates.py --products 1x14336x4096,8x4096x28672

Prints one line of every candidate's µs a product, then a Markdown row a product: the default, the best candidate of
the bulk-copy build (``loads="tma"``, up to 8 rows) and of the other builds, and the other builds' default (what the
default was before the bulk-copy build), with the largest relative error of any candidate and of the default call.
``benchmarks/results/llm_decode_nm24_tma_2026-12-01_h200.md`` has its output on an H200.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

import jaxsparse
from jaxsparse._cuda import _kernels as ck
from jaxsparse._cuda import _layout
from jaxsparse._cuda._nm24_config import nm24_candidate_configs
from jaxsparse._tuning._measure import time_call_ms

DEFAULT_PRODUCTS = ",".join(f"{m}x{kn}" for kn in ("14336x4096", "4096x4096", "4096x6144", "4096x28672", "5632x2048",
                                                  "2048x11264", "2048x2048", "2048x2560") for m in (1, 8))


def measure(m: int, k: int, n: int) -> dict:
  """Every candidate's µs and relative error for one product, the default call's error and XLA's dense µs."""
  key = jax.random.key(k * 7 + n + m)
  w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(key, (k, n), jnp.float32).astype(jnp.bfloat16), 2, 4)
  wd = w.to_dense().astype(jnp.float32)
  buffer = _layout.compress_values(w.values, w.positions())
  x = jax.random.normal(jax.random.fold_in(key, 1), (m, k), jnp.float32).astype(jnp.bfloat16)
  ref = np.asarray(x.astype(jnp.float32) @ wd)
  scale = float(np.max(np.abs(ref))) + 1e-9

  def err(y):
    return float(np.max(np.abs(np.asarray(y.astype(jnp.float32)) - ref))) / scale

  out = {"dense": time_call_ms(jnp.dot, (x, wd.astype(jnp.bfloat16)), "cuda") * 1e3, "us": {}, "err": {},
         "default_err": err(ck.nm24_decode_buffer(x, buffer, n))}
  for cfg in nm24_candidate_configs(m, k, n, buffer=True):
    f = lambda a, b, c=cfg: ck.nm24_decode_buffer(a, b, n, config=c)
    out["err"][cfg] = err(jax.jit(f)(x, buffer))
    out["us"][cfg] = time_call_ms(f, (x, buffer), "cuda") * 1e3
  return out


def row(m: int, k: int, n: int, r: dict) -> str:
  us, dense = r["us"], r["dense"]
  configs = list(us)
  tma = min((c for c in configs if c.loads == "tma"), key=us.get)
  step = min((c for c in configs if c.loads != "tma"), key=us.get)
  before = next(c for c in configs if c.loads != "tma")  # the other builds' default leads their candidates
  now = configs[0]
  e = max([*r["err"].values(), r["default_err"]])
  return (f"| {m}x{k}x{n} | {dense:.2f} | {us[now]:.2f} ({now.name}) | {us[tma]:.2f} ({tma.name}) | "
          f"{us[before]:.2f} ({before.name}) | {us[step]:.2f} ({step.name}) | {us[now] / us[before]:.3f} | "
          f"{us[tma] / us[step]:.3f} | {us[now] / dense:.2f} | {min(us[tma], us[step]) / dense:.2f} | {e:.1e} |")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--products", default=DEFAULT_PRODUCTS, help="M x K x N, comma-separated (M 1-32)")
  args = p.parse_args()
  products = [tuple(int(d) for d in s.split("x")) for s in args.products.split(",")]
  t0 = time.time()
  jobs = {(m, c) for m, k, n in products for c in nm24_candidate_configs(m, k, n, buffer=True)}
  with ThreadPoolExecutor(16) as pool:  # NVRTC builds, in threads
    list(pool.map(lambda mc: ck.nm24_prepare(mc[0], 4096, 4096, mc[1], buffer=True), jobs))
  print(f"built {len(jobs)} in {time.time() - t0:.0f} s", flush=True)
  rows = []
  for m, k, n in products:
    r = measure(m, k, n)
    print(f"{m}x{k}x{n} dense {r['dense']:.2f} " + " ".join(f"{c.name}={t:.2f}" for c, t in r["us"].items()),
          flush=True)
    rows.append(row(m, k, n, r))
  print("\n| M x K x N | dense µs | default (config) | best tma (config) | default before (config) | "
        "best other (config) | default / before | best tma / best other | default / dense | best / dense | "
        "max rel err |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  print("\n".join(rows))


if __name__ == "__main__":
  main()
