"""Block-sparse layers on shapes no tuning run used: is the default dispatch ever slower than dense?

    python benchmarks/gpu_unseen_shapes.py [--cases 24 --seed 7 --iterations 10]

Draws ``--cases`` random problems (seeded): ``x`` of shape ``(B, S, K)`` or ``(M, K)`` with M from decode to
training sizes, K and N multiples of 256 from 768 to 8192, square and rectangular blocks of 32 / 64 / 128,
density 0.1-0.5, bfloat16 or float32 (float32 at DEFAULT precision, as Flax's defaults). For each it times,
device-side, ``jaxsparse.ops.block_sparse_matmul(x, w)`` (the default route, whatever it picks) and the dense
``x @ W`` of the same shapes: the forward, and for M > 64 the forward plus both gradients (``jax.vjp``, to x
and to the kept blocks / the dense weight). Prints one row per case as it goes and the table last; a ratio
above 1 is a shape where the default is slower than dense.
"""

from __future__ import annotations

import argparse
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from _gpu_timing import kernel_times_ms
from _gpu_timing import log
from _gpu_timing import rel_err
from _gpu_timing import time_ms
from gpu_block_sparse import block_mask

import jaxsparse

MS = [1, 16, 48, 200, 384, 640, 1000, 1536, 3000, 4096, 6144, 12288]
DIMS = [768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192]
BLOCKS = ((32, 32), (64, 64), (128, 128), (64, 128), (128, 64), (32, 64), (64, 32))


def cases(count: int, seed: int) -> list[dict]:
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(count):
    m = int(rng.choice(MS))
    batch = (2, m // 2) if m > 64 and m % 2 == 0 and rng.random() < 0.5 else (m,)
    out.append({
        "batch": batch,
        "k": int(rng.choice(DIMS)),
        "n": int(rng.choice(DIMS)),
        "block": tuple(int(v) for v in BLOCKS[rng.integers(len(BLOCKS))]),
        "density": round(float(rng.uniform(0.1, 0.5)), 2),
        "dtype": jnp.dtype(jnp.bfloat16 if rng.random() < 0.6 else jnp.float32),
    })
  return out


def route(f, *args) -> str:
  """The custom calls the default route lowers to (Mosaic GPU, Triton, our FFI kernels), or ``xla``."""
  targets = sorted(set(re.findall(r"custom_call @([\w$.]+)", jax.jit(f).lower(*args).as_text())))
  short = {"mosaic_gpu": "mosaic", "mosaic_gpu_v2": "mosaic", "__gpu$xla.gpu.triton": "triton"}
  return "+".join(sorted({short.get(t, t) for t in targets})) or "xla"


def run_case(c: dict, iterations: int, breakdown: bool = False) -> dict:
  k, n, (bk, bn), d, dtype = c["k"], c["n"], c["block"], c["density"], c["dtype"]
  keys = jax.random.split(jax.random.key(hash((c["batch"], k, n, bk, bn)) % 2**31), 3)
  mask = block_mask(k, n, bk, d, seed=1, bn=bn)
  wd = jax.random.normal(keys[0], (k, n), jnp.float32).astype(dtype)
  w = jaxsparse.BlockSparseMatrix.from_dense(wd, (bk, bn), block_mask=mask)
  wd = w.to_dense()
  x = jax.random.normal(keys[1], (*c["batch"], k), jnp.float32).astype(dtype)
  dy = jax.random.normal(keys[2], (*c["batch"], n), jnp.float32).astype(dtype)
  sparse = lambda x, w: jaxsparse.ops.block_sparse_matmul(x, w)
  dense = lambda x, wd: x @ wd

  def both(f):
    def g(x, w, dy):
      y, vjp = jax.vjp(f, x, w)
      return y, vjp(dy)
    return g

  ref = jnp.dot(x.astype(jnp.float32), wd.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  row = dict(c, route=route(sparse, x, w), err=rel_err(jax.jit(sparse)(x, w), ref))
  row["fwd"] = time_ms(sparse, x, w, iterations=iterations) / time_ms(dense, x, wd, iterations=iterations)
  m = math.prod(c["batch"])
  if m > 64:
    row["fwd+bwd"] = (time_ms(both(sparse), x, w, dy, iterations=iterations)
                      / time_ms(both(dense), x, wd, dy, iterations=iterations))
  if breakdown:  # where the time goes: every kernel of each timed call, device µs
    calls = {"fwd": ((sparse, x, w), (dense, x, wd))}
    if m > 64:
      calls["fwd+bwd"] = ((both(sparse), x, w, dy), (both(dense), x, wd, dy))
    for mode, ((fs, *sargs), (fd, *dargs)) in calls.items():
      for name, f, args in (("sparse", fs, sargs), ("dense", fd, dargs)):
        ks = kernel_times_ms(f, *args, iterations=iterations)
        log(f"  {mode} {name} {sum(t for _, t in ks) * 1e3:.1f}us: "
            + ", ".join(f"{k[:48]} {t * 1e3:.1f}" for k, t in ks))
  return row


def fmt(r: dict) -> str:
  shape = "x".join(str(v) for v in r["batch"])
  fb = r.get("fwd+bwd")
  flag = " **slower**" if max(r["fwd"], fb or 0) > 1.0 else ""
  return (f"| {shape} | {r['k']} | {r['n']} | {r['block'][0]}x{r['block'][1]} | {r['density']} | {r['dtype'].name} | "
          f"{r['route']} | {r['err']:.1e} | {r['fwd']:.2f} | {'-' if fb is None else f'{fb:.2f}'} |{flag}")


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cases", type=int, default=24)
  p.add_argument("--out", default=None, help="also write the table (markdown) here")
  p.add_argument("--seed", type=int, default=7)
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--skip", type=int, default=0, help="skip the first SKIP cases (to resume a run)")
  p.add_argument("--only", default="", help="comma-separated case numbers of the draw to run (default: all)")
  p.add_argument("--breakdown", action="store_true", help="also log each kernel's device time (CUPTI)")
  p.add_argument("--tiny", action="store_true", help="tiny sizes: a smoke test that runs in seconds on a CPU")
  args = p.parse_args(argv)
  if args.tiny:
    MS[:], DIMS[:] = [3, 70, 130], [256, 384]
  dev = jax.devices()[0]
  log(f"device: {dev.device_kind}, jax {jax.__version__}; {args.cases} cases, seed {args.seed}")
  header = ["| x | K | N | block | d | dtype | route | rel err | fwd / dense | fwd+bwd / dense |",
            "|---|---|---|---|---|---|---|---|---|---|"]
  rows = []
  only = {int(v) for v in args.only.split(",") if v}
  for i, c in enumerate(cases(args.cases, args.seed)):
    if i < args.skip or (only and i not in only):
      continue
    try:
      rows.append(fmt(run_case(c, args.iterations, args.breakdown)))
    except Exception as e:  # report and go on: one failing shape should not hide the others
      rows.append(f"| {c} | failed: {type(e).__name__}: {str(e)[:160]} |")
    log(f"case {i}: {rows[-1]}")
  table = "\n".join([*header, *rows])
  log("\n" + table)
  if args.out:
    with open(args.out, "w") as f:
      f.write(table + "\n")


if __name__ == "__main__":
  main()
