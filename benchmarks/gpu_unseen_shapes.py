"""Block-sparse layers on shapes no tuning run used: is the default dispatch ever slower than dense?

    python benchmarks/gpu_unseen_shapes.py [--cases 24 --seed 7 --iterations 10] [--space wide] [--modes off,tune]

Draws ``--cases`` random problems (seeded): ``x`` of shape ``(B, S, K)`` or ``(M, K)`` with M from decode to
training sizes, K and N multiples of 256 from 768 to 8192, square and rectangular blocks of 32 / 64 / 128,
density 0.1-0.5, bfloat16 or float32 (float32 at DEFAULT precision, as Flax's defaults). For each it times,
device-side, ``jaxsparse.ops.block_sparse_matmul(x, w)`` (the default route, whatever it picks) and the dense
``x @ W`` of the same shapes: the forward, and for M > 64 the forward plus both gradients (``jax.vjp``, to x
and to the kept blocks / the dense weight). Prints one row per case as it goes and the table last; a ratio
above 1 is a shape where the default is slower than dense.

``--space wide`` draws from the wider space of issue 35 (M 1-12288, K and N 512-16384, blocks 16-256 square and
rectangular, density 0.05-0.6, bf16 / fp16 / f32). ``--modes off,tune`` times each case once per measured-dispatch
mode (``jaxsparse.autotune_mode``; ``off`` is the shipped rules alone, ``tune`` measures each product's candidate
routes on its first trace, into a fresh cache under ``$OUT``), with the first-trace tuning cost of the forward and
of forward + backward, and checks that a second trace of a tuned signature measures nothing; its last column names
whether tuning said no route of the forward beats the dense product (``jaxsparse.SlowerThanDenseWarning``).

``--cold`` times every call (the op's and dense's) as measured dispatch times its candidates: over copies of the
operands called in turn, so that a weight under the L2's size is read from memory, as in a model whose other layers
evict it between calls (``jaxsparse._tuning._measure.time_call_ms``). Without it, each call repeats on the same
operands, and such a weight, dense or sparse, is read from the L2; decode rows (M <= 64) then also get the forward
timed cold, in a column of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import re
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from _gpu_timing import kernel_times_ms
from _gpu_timing import log
from _gpu_timing import rel_err
from _gpu_timing import time_ms
from gpu_block_sparse import block_mask

import jaxsparse
from jaxsparse._tuning import _cache as _tuning_cache
from jaxsparse._tuning import _measure as _tuning_measure


def timed_ms(f, *args, iterations: int, cold: bool) -> float:
  """One call of ``f(*args)`` in ms: :func:`time_ms`, or (``cold``) as measured dispatch times its candidates."""
  if cold:
    return _tuning_measure.time_call_ms(f, args, _tuning_measure.default_platform())
  return time_ms(f, *args, iterations=iterations)


MS = [1, 16, 48, 200, 384, 640, 1000, 1536, 3000, 4096, 6144, 12288]
DIMS = [768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192]
BLOCKS = ((32, 32), (64, 64), (128, 128), (64, 128), (128, 64), (32, 64), (64, 32))
# --space wide (issue 35): decode to training rows, wider layers, blocks 16-256, density 0.05-0.6, fp16 too.
WIDE = {
    "ms": [1, 2, 4, 16, 48, 200, 384, 640, 1000, 1536, 3000, 4096, 6144, 8192, 12288],
    "dims": [512, 768, 1024, 1536, 2048, 3072, 4096, 5120, 6144, 8192, 11008, 14336, 16384],
    "blocks": ((16, 16), (32, 32), (64, 64), (128, 128), (256, 128), (128, 256), (256, 256), (32, 64), (64, 32),
               (128, 64), (64, 128), (16, 64)),
    "density": (0.05, 0.6),
    "dtypes": (jnp.bfloat16, jnp.float16, jnp.float32),
}


def cases(count: int, seed: int, space: str = "default") -> list[dict]:
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(count):
    if space == "wide":
      m = int(rng.choice(WIDE["ms"]))
      block = tuple(int(v) for v in WIDE["blocks"][rng.integers(len(WIDE["blocks"]))])
      k, n = (int(rng.choice([d for d in WIDE["dims"] if d % b == 0])) for b in block)
      density, dtype = round(float(rng.uniform(*WIDE["density"])), 2), WIDE["dtypes"][rng.integers(3)]
    else:
      m = int(rng.choice(MS))
      k, n = int(rng.choice(DIMS)), int(rng.choice(DIMS))
      block = tuple(int(v) for v in BLOCKS[rng.integers(len(BLOCKS))])
      density = round(float(rng.uniform(0.1, 0.5)), 2)
      dtype = jnp.bfloat16 if rng.random() < 0.6 else jnp.float32
    batch = (2, m // 2) if m > 64 and m % 2 == 0 and rng.random() < 0.5 else (m,)
    out.append({"batch": batch, "k": k, "n": n, "block": block, "density": density, "dtype": jnp.dtype(dtype)})
  return out


def route(f, *args) -> str:
  """The custom calls the default route lowers to (Mosaic GPU, Triton, our FFI kernels), or ``xla``."""
  targets = sorted(set(re.findall(r"custom_call @([\w$.]+)", jax.jit(f).lower(*args).as_text())))
  short = {"mosaic_gpu": "mosaic", "mosaic_gpu_v2": "mosaic", "__gpu$xla.gpu.triton": "triton"}
  return "+".join(sorted({short.get(t, t) for t in targets})) or "xla"


def run_case(
    c: dict, iterations: int, breakdown: bool = False, modes: tuple[str, ...] = (), cold: bool = False
) -> dict:
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
  m = math.prod(c["batch"])
  row = dict(c)
  dense_fwd = timed_ms(dense, x, wd, iterations=iterations, cold=cold)
  dense_both = timed_ms(both(dense), x, wd, dy, iterations=iterations, cold=cold) if m > 64 else None
  # Decode rows also with the weights out of the L2 (as the tuner times its candidates, and as a model's layers read
  # them); --cold times every column so.
  dense_cold = timed_ms(dense, x, wd, iterations=iterations, cold=True) if m <= 64 and not cold else None
  for mode in modes or (None,):
    tag = "" if mode is None else f"[{mode}]"
    scope = contextlib.nullcontext() if mode is None else jaxsparse.autotune_mode(mode)
    with scope, warnings.catch_warnings(record=True) as said:  # the tuner's SlowerThanDenseWarning, by direction
      warnings.simplefilter("always", jaxsparse.SlowerThanDenseWarning)
      fresh = lambda x, w: sparse(x, w)  # a new function: its own trace in this mode
      t0 = time.perf_counter()
      jax.jit(fresh).lower(x, w)
      row["tune_s_fwd" + tag] = time.perf_counter() - t0
      row["route" + tag] = route(fresh, x, w)
      row["err" + tag] = rel_err(jax.jit(fresh)(x, w), ref)
      row["fwd" + tag] = timed_ms(fresh, x, w, iterations=iterations, cold=cold) / dense_fwd
      if dense_cold is not None:
        row["fwd cold" + tag] = timed_ms(fresh, x, w, iterations=iterations, cold=True) / dense_cold
      if m > 64:
        fresh_both = both(lambda x, w: sparse(x, w))
        t0 = time.perf_counter()
        jax.jit(fresh_both).lower(x, w, dy)
        row["tune_s_both" + tag] = time.perf_counter() - t0
        row["fwd+bwd" + tag] = timed_ms(fresh_both, x, w, dy, iterations=iterations, cold=cold) / dense_both
    row["warned" + tag] = sorted({str(r.message).split(":")[0].removeprefix("block_sparse_matmul ") for r in said
                                  if issubclass(r.category, jaxsparse.SlowerThanDenseWarning)})
  if "tune" in modes:
    # A second process with the cache (the memo dropped, the file read back): no measurement, and compile time
    # against mode off (best of 2 fresh compiles each, forward + backward where timed).
    f = both(lambda x, w: sparse(x, w)) if m > 64 else (lambda x, w: sparse(x, w))
    operands = (x, w, dy) if m > 64 else (x, w)
    compile_s = {}
    for mode in ("off", "cached"):
      runs = []
      for _ in range(2):
        _tuning_cache.clear_memo()
        with jaxsparse.autotune_mode(mode):
          g = lambda *a: f(*a)
          t0 = time.perf_counter()
          jax.jit(g).lower(*operands).compile()
          runs.append(time.perf_counter() - t0)
      compile_s[mode] = min(runs)
    row["compile cached / off"] = compile_s["cached"] / compile_s["off"]
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


def fmt(r: dict, modes: tuple[str, ...] = ()) -> str:
  shape = "x".join(str(v) for v in r["batch"])
  cells = [shape, r["k"], r["n"], f"{r['block'][0]}x{r['block'][1]}", r["density"], r["dtype"].name]
  worst = 0.0
  for mode in modes or (None,):
    tag = "" if mode is None else f"[{mode}]"
    fb, fc = r.get("fwd+bwd" + tag), r.get("fwd cold" + tag)
    worst = max(worst, r["fwd" + tag], fb or 0, fc or 0)
    cells += [r["route" + tag], f"{r['err' + tag]:.1e}", f"{r['fwd' + tag]:.2f}", "-" if fb is None else f"{fb:.2f}",
              "-" if fc is None else f"{fc:.2f}"]
    if mode == "tune":
      both = r.get("tune_s_both" + tag)
      cells.append(f"{r['tune_s_fwd' + tag]:.1f} / {'-' if both is None else f'{both:.1f}'}")
      cells.append(f"{r['compile cached / off']:.2f}")
      cells.append(", ".join(r["warned" + tag]) or "-")
  flag = " **slower**" if worst > 1.0 else ""
  return "| " + " | ".join(str(v) for v in cells) + f" |{flag}"


def header(modes: tuple[str, ...] = ()) -> list[str]:
  cols = ["x", "K", "N", "block", "d", "dtype"]
  for mode in modes or (None,):
    tag = "" if mode is None else f" ({mode})"
    cols += [f"route{tag}", f"rel err{tag}", f"fwd / dense{tag}", f"fwd+bwd / dense{tag}",
             f"fwd / dense, cold L2{tag}"]
    if mode == "tune":
      cols += ["first trace s (fwd / fwd+bwd)", "compile cached / off", "said slower than dense"]
  return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


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
  p.add_argument("--space", choices=("default", "wide"), default="default", help="the space the shapes are drawn from")
  p.add_argument("--cold", action="store_true", help="time over copies of the operands (weights out of the L2)")
  p.add_argument("--modes", default="", help="comma-separated autotune modes to time each case in (off, cached, tune)")
  args = p.parse_args(argv)
  modes = tuple(v for v in args.modes.split(",") if v)
  if "tune" in modes:  # what each tuning measured goes to the log
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("jaxsparse.autotune").setLevel(logging.INFO)
  if "tune" in modes and not os.environ.get("JAXSPARSE_AUTOTUNE_CACHE"):
    # A fresh cache: every signature of the draw is measured here, the first-trace cost included.
    os.environ["JAXSPARSE_AUTOTUNE_CACHE"] = os.path.join(os.environ.get("OUT", "."), "autotune_unseen.json")
  if args.tiny:
    MS[:], DIMS[:] = [3, 70, 130], [256, 384]
    WIDE.update(ms=[3, 70, 130], dims=[256, 512])
  dev = jax.devices()[0]
  log(f"device: {dev.device_kind}, jax {jax.__version__}; {args.cases} cases, seed {args.seed}")
  rows = []
  only = {int(v) for v in args.only.split(",") if v}
  for i, c in enumerate(cases(args.cases, args.seed, args.space)):
    if i < args.skip or (only and i not in only):
      continue
    try:
      rows.append(fmt(run_case(c, args.iterations, args.breakdown, modes, args.cold), modes))
    except Exception as e:  # report and go on: one failing shape should not hide the others
      rows.append(f"| {c} | failed: {type(e).__name__}: {str(e)[:160]} |")
    log(f"case {i}: {rows[-1]}")
  table = "\n".join([*header(modes), *rows])
  log("\n" + table)
  if args.out:
    with open(args.out, "w") as f:
      f.write(table + "\n")


if __name__ == "__main__":
  main()
