"""CPU benchmark: block-sparse forward and forward+backward against dense, in the same run.

    python benchmarks/cpu_block_sparse.py            # the issue's case: f32, K=N=4096, batch 256
    python benchmarks/cpu_block_sparse.py --quick    # small sizes, a smoke run
    python benchmarks/cpu_block_sparse.py --draw 35  # random shapes: is a default route ever slower than dense?

Dense is ``x @ w`` with its gradients (w.r.t. x and w), jitted. Sparse is
``jaxsparse.ops.block_sparse_matmul`` (XLA path) with gradients w.r.t. x and the kept blocks.
Each variant is timed ``--repeats`` times, interleaved with the others so that machine noise hits all
of them alike; the table shows medians and the speedup over dense (higher is better).

``--draw SEED`` instead draws ``--cases`` random problems (seeded; issue 35's CPU target): a third each
``block_sparse_matmul`` (square blocks of 16, 32 or 64), ``sparse_matmul`` on a ``CSRMatrix`` and
``masked_matmul`` (unstructured), sparsity 50-95%, M 64-1024 rows, K and N 256-2048, f32, each op with its
default route (``implementation=None``). Each case times the op and dense ``x @ w`` (the dense weight, jitted)
interleaved in the same process, forward and forward + backward (gradients to x and to the weight: the kept
blocks / entries, or masked ``w``), and prints time / dense: above 1 the default is slower than dense.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxsparse
from jaxsparse.ops import block_sparse_matmul
from jaxsparse.ops import masked_matmul
from jaxsparse.ops import sparse_matmul

# --draw: the space random problems come from.
DRAW_MS = [64, 96, 128, 192, 256, 384, 512, 768, 1024]
DRAW_DIMS = [256, 384, 512, 768, 1024, 1536, 2048]
DRAW_BLOCKS = (16, 32, 64)
DRAW_OPS = ("block", "csr", "masked")


def _timed(fn, *args) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def draw_cases(seed: int, count: int) -> list[dict]:
  """``count`` random problems, the ops in turn so that each gets a third of the draw."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(count):
    op = DRAW_OPS[i % len(DRAW_OPS)]
    m, k, n = int(rng.choice(DRAW_MS)), int(rng.choice(DRAW_DIMS)), int(rng.choice(DRAW_DIMS))
    block = int(rng.choice(DRAW_BLOCKS)) if op == "block" else None
    out.append({"op": op, "m": m, "k": k, "n": n, "block": block, "sparsity": round(float(rng.uniform(0.5, 0.95)), 2)})
  return out


def _route(fn, *args) -> str:
  """What a jitted function runs: our C++ kernels, the XLA block loop, or dense XLA (``dense``)."""
  text = fn.lower(*args).compile().as_text()
  kernels = sorted({t.removeprefix("jaxsparse_") for t in re.findall(r'custom_call_target="(jaxsparse_\w+)"', text)})
  if kernels and " conditional(" in text:  # branches picked by the pattern's density inside the call
    dense = "" if any(k.endswith("_gemm") for k in kernels) else " or dense"
    return f"{' or '.join(kernels)}{dense} (by density at run time)"
  if "route = 0 : i32" in text:  # masked_forward's "auto": its sparse kernel or its GEMM, picked in the call
    kernels = [f"{k} (sparse or gemm, by density in the call)" if k == "masked_forward" else k for k in kernels]
  return "+".join(kernels) or ("loop" if " while(" in text else "dense")


def _samples(variants: dict, repeats: int) -> dict:
  """Median seconds per call of each ``(fn, args)``, the variants interleaved; calls are batched so that one
  sample lasts about 20 ms (small problems take tens of microseconds)."""
  for fn, a in variants.values():  # compile and warm up
    jax.block_until_ready(fn(*a))
  inner = {key: max(1, int(0.02 / max(_timed(fn, *a), 1e-6))) for key, (fn, a) in variants.items()}
  times = {key: [] for key in variants}
  for _ in range(repeats):
    for key, (fn, a) in variants.items():
      t0 = time.perf_counter()
      for _ in range(inner[key]):
        r = fn(*a)
      jax.block_until_ready(r)
      times[key].append((time.perf_counter() - t0) / inner[key])
  return {key: float(np.median(v)) for key, v in times.items()}


def run_draw_case(c: dict, repeats: int) -> dict:
  kx, kw, km = jax.random.split(jax.random.key(hash((c["m"], c["k"], c["n"])) % 2**31), 3)
  x = jax.random.normal(kx, (c["m"], c["k"]), jnp.float32)
  w = jax.random.normal(kw, (c["k"], c["n"]), jnp.float32) / np.sqrt(c["k"])
  density = 1.0 - c["sparsity"]
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
  if c["op"] == "block":
    b = c["block"]
    ws = jaxsparse.BlockSparseMatrix.from_dense(w, (b, b), block_mask=jaxsparse.random_block_mask(km, w.shape, (b, b),
                                                                                                   density))
    fwd, fwd_args = jax.jit(lambda x, ws: block_sparse_matmul(x, ws)), (x, ws)
    both = jax.jit(jax.value_and_grad(loss(lambda x, d: block_sparse_matmul(x, ws.with_data(d))), argnums=(0, 1)))
    both_args = (x, ws.data)
  elif c["op"] == "csr":
    ws = jaxsparse.CSRMatrix.from_dense(w, mask=jax.random.uniform(km, w.shape) < density)
    fwd, fwd_args = jax.jit(lambda x, ws: sparse_matmul(x, ws)), (x, ws)
    both = jax.jit(jax.value_and_grad(loss(lambda x, d: sparse_matmul(x, ws.with_data(d))), argnums=(0, 1)))
    both_args = (x, ws.data)
  else:
    mask = jax.random.uniform(km, w.shape) < density
    fwd, fwd_args = jax.jit(lambda x, w, m: masked_matmul(x, w, m)), (x, w, mask)
    both = jax.jit(jax.value_and_grad(loss(lambda x, w: masked_matmul(x, w, mask)), argnums=(0, 1)))
    both_args = (x, w)
  med = _samples({
      "dense": (jax.jit(lambda x, w: x @ w), (x, w)),
      "fwd": (fwd, fwd_args),
      "dense fwd+bwd": (jax.jit(jax.value_and_grad(loss(lambda x, w: x @ w), argnums=(0, 1))), (x, w)),
      "fwd+bwd": (both, both_args),
  }, repeats)
  return {**c, "route": _route(fwd, *fwd_args), "route fwd+bwd": _route(both, *both_args),
          "dense ms": med["dense"] * 1e3, "fwd": med["fwd"] / med["dense"],
          "dense fwd+bwd ms": med["dense fwd+bwd"] * 1e3, "fwd+bwd": med["fwd+bwd"] / med["dense fwd+bwd"]}


def main_draw(args) -> None:
  print(f"# jaxsparse CPU random shapes, seed {args.draw}, {args.cases} cases, {datetime.date.today()}")
  print(f"# {platform.processor() or platform.machine()}, jax {jax.__version__}, cores available: "
        f"{len(os.sched_getaffinity(0))}, f32, medians of {args.repeats} interleaved samples, time / dense "
        f"(above 1.05: **slower**)", flush=True)
  rows = ["| # | op | M | K | N | block | sparsity | route (fwd; fwd+bwd) | dense fwd ms | fwd / dense "
          "| dense fwd+bwd ms | fwd+bwd / dense |", "|" + "---|" * 12]
  for i, c in enumerate(draw_cases(args.draw, args.cases)):
    r = run_draw_case(c, args.repeats)
    slow = " **slower**" if max(r["fwd"], r["fwd+bwd"]) > 1.05 else ""
    rows.append(f"| {i} | {r['op']} | {r['m']} | {r['k']} | {r['n']} | {r['block'] or '-'} | {r['sparsity']:.0%} "
                f"| {r['route']}; {r['route fwd+bwd']} | {r['dense ms']:.2f} | {r['fwd']:.2f} "
                f"| {r['dense fwd+bwd ms']:.2f} | {r['fwd+bwd']:.2f} |{slow}")
    print(rows[-1], flush=True)
  table = "\n".join(rows)
  print(f"# load average at the end: {', '.join(f'{v:.1f}' for v in os.getloadavg())}\n\n{table}")
  if args.out:
    with open(args.out, "w") as f:
      f.write(table + "\n")


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--k", type=int, default=4096)
  parser.add_argument("--n", type=int, default=4096)
  parser.add_argument("--blocks", type=int, nargs="+", default=[32, 64])
  parser.add_argument("--sparsities", type=float, nargs="+", default=[0.8, 0.9, 0.95, 0.98])
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
  parser.add_argument("--draw", type=int, default=None, metavar="SEED", help="time random problems (see above)")
  parser.add_argument("--cases", type=int, default=12, help="with --draw: how many problems")
  parser.add_argument("--out", default=None, help="with --draw: also write the table (markdown) here")
  args = parser.parse_args()
  if args.draw is not None:
    if args.quick:
      DRAW_MS[:], DRAW_DIMS[:] = [16, 40], [128, 192]
    main_draw(args)
    return
  if args.quick:
    args.batch, args.k, args.n, args.blocks, args.repeats = 64, 512, 512, [32], 3

  kx, kw, km = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (args.batch, args.k), jnp.float32)
  w = jax.random.normal(kw, (args.k, args.n), jnp.float32) / np.sqrt(args.k)

  def dense_loss(x, w):
    return jnp.sum(jnp.sin(x @ w))

  def sparse_loss(ws):
    return lambda x, data: jnp.sum(jnp.sin(block_sparse_matmul(x, ws.with_data(data))))

  variants = {
      ("dense", "fwd"): (jax.jit(lambda x, w: x @ w), (x, w)),
      ("dense", "fwd+bwd"): (jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1))), (x, w)),
  }
  for b in args.blocks:
    for s in args.sparsities:
      mask = jaxsparse.random_block_mask(km, (args.k, args.n), (b, b), 1.0 - s)
      ws = jaxsparse.BlockSparseMatrix.from_dense(w, (b, b), block_mask=mask)
      variants[(f"block {b}, {s:.0%}", "fwd")] = (
          jax.jit(lambda x, ws: block_sparse_matmul(x, ws, implementation="xla")),
          (x, ws),
      )
      variants[(f"block {b}, {s:.0%}", "fwd+bwd")] = (
          jax.jit(jax.value_and_grad(sparse_loss(ws), argnums=(0, 1))),
          (x, ws.data),
      )
  for fn, a in variants.values():  # compile and warm up
    jax.block_until_ready(fn(*a))
  times = {key: [] for key in variants}
  for _ in range(args.repeats):
    for key, (fn, a) in variants.items():
      times[key].append(_timed(fn, *a))
  med = {key: float(np.median(v)) * 1e3 for key, v in times.items()}

  print(f"# jaxsparse CPU block-sparse benchmark, {datetime.date.today()}")
  print(f"# {platform.processor() or platform.machine()}, {jax.device_count()} device(s), "
        f"jax {jax.__version__}, cores available: {len(__import__('os').sched_getaffinity(0))}")
  print(f"# f32, x: ({args.batch}, {args.k}), W: ({args.k}, {args.n}), medians of {args.repeats} interleaved runs")
  print()
  print("| case | fwd ms | fwd speedup | fwd+bwd ms | fwd+bwd speedup |")
  print("|---|---|---|---|---|")
  dense_f, dense_fb = med[("dense", "fwd")], med[("dense", "fwd+bwd")]
  names = dict.fromkeys(k[0] for k in variants)
  for name in names:
    f, fb = med[(name, "fwd")], med[(name, "fwd+bwd")]
    print(f"| {name} | {f:.1f} | {dense_f / f:.2f}x | {fb:.1f} | {dense_fb / fb:.2f}x |")


if __name__ == "__main__":
  main()
