"""Post-training pruning at causal-LM layer sizes: time, memory and reconstruction error, CPU or GPU.

    python benchmarks/calibrated_pruning.py                       # the issue's case, on JAX's default device
    python benchmarks/calibrated_pruning.py --shapes 4096x4096 4096x11008 11008x4096 --out results.md
    python benchmarks/calibrated_pruning.py --quick               # small sizes, a smoke run

Layers are ``(K, N)`` = (inputs, outputs) Flax kernels of LLaMA-7B sizes (4096x4096: attention
projections; 4096x11008: MLP up/gate; 11008x4096: MLP down), with random N(0, 1/K) weights.

Calibration data: ``--sequences`` x ``--seq-len`` tokens (default 128 x 2048, SparseGPT's setting),
generated on the device inside the jitted calibration step (never held in memory at once) with
language-model-like statistics: features correlated through a rank-64 factor, per-feature scales
log-normal, and 1% outlier features 20x larger. ``jaxsparse.pruning.calibrate`` accumulates the
per-feature norms and ``XᵀX`` in float32 (one jitted step per 2048-token sequence); its time includes
generating the data. Held-out error uses 16 more sequences from the same distribution.

For each layer and pattern: the steady-state time of the jitted per-layer solve (median of
``--repeats`` after a first call, whose compile + run time is shown separately), the memory XLA
plans for the SparseGPT solve (arguments + outputs + temporaries, from ``memory_analysis()``), the
device's peak memory (GPU) or the process's peak RSS (CPU) so far, and the relative reconstruction
error ``||X w - X ŵ|| / ||X w||`` on the calibration and held-out data.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxsparse
from jaxsparse import pruning
from jaxsparse.pruning import _sparsegpt

PATTERNS = {
    "unstructured 50%": jaxsparse.Unstructured(sparsity=0.5),
    "2:4": jaxsparse.NM(2, 4),
    "4:8": jaxsparse.NM(4, 8),
    "block 32x32 50%": jaxsparse.BlockSparse(density=0.5, block_shape=(32, 32)),
}


def lm_like_inputs(key: jax.Array, k: int, tokens: int, *, rank: int = 64) -> jax.Array:
  """``(tokens, k)`` float32 inputs with correlated features of very different scales (fixed per ``k``)."""
  fixed = jax.random.key(k)
  f1, f2, f3 = jax.random.split(fixed, 3)
  factor = jax.random.normal(f1, (rank, k)) / np.sqrt(rank) * 2.0
  scale = jnp.exp(0.7 * jax.random.normal(f2, (k,)))
  outliers = jax.random.uniform(f3, (k,)) < 0.01
  scale = jnp.where(outliers, 20.0 * scale, scale)
  z1, z2 = jax.random.split(key)
  x = jax.random.normal(z1, (tokens, rank)) @ factor + jax.random.normal(z2, (tokens, k))
  return x * scale


def calibration_stats(k: int, sequences: int, seq_len: int, seed: int) -> tuple[pruning.LayerStats, float]:
  """The ``LayerStats`` of a ``K``-input layer on generated data, via ``pruning.calibrate``; and seconds."""
  model = nnx.Linear(k, 8, rngs=nnx.Rngs(0))  # its output is unused: XLA drops the product
  keys = [jax.random.key(seed * 100_000 + i) for i in range(sequences)]
  t0 = time.perf_counter()
  stats = pruning.calibrate(model, keys, {"": jaxsparse.NM(2, 4)},
                            call=lambda m, key: m(lm_like_inputs(key, k, seq_len)))[""]
  jax.block_until_ready(stats)
  return stats, time.perf_counter() - t0


def memory_now() -> str:
  dev = jax.devices()[0]
  stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
  if stats and "peak_bytes_in_use" in stats:
    return f"device peak {stats['peak_bytes_in_use'] / 2**30:.2f} GiB"
  return f"process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"


def timed(fn, repeats: int) -> tuple[float, float]:
  """(first call seconds: compile + run, median of ``repeats`` later calls)."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  first = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return first, float(np.median(times))


def sparsegpt_plan_bytes(w, gram, spec, block_size: int) -> int:
  """Bytes XLA plans for the jitted SparseGPT solve: arguments + outputs + temporaries."""
  args, static = _sparsegpt.solve_inputs(w, gram, spec, damp=0.01, block_size=block_size)
  compiled = _sparsegpt._solve.lower(*args, **static).compile()
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes)


def sparsegpt_refit(w, gram, spec, block_size: int, iterations: int) -> jax.Array:
  out = pruning.sparsegpt_layer(w, gram, spec, block_size=block_size)
  return pruning.refit_layer(w, gram, out.mask, start=out.kernel, iterations=iterations)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", nargs="+", default=["4096x4096", "4096x11008"], help="KxN layer shapes")
  parser.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=list(PATTERNS))
  parser.add_argument("--sequences", type=int, default=128)
  parser.add_argument("--seq-len", type=int, default=2048)
  parser.add_argument("--held-out", type=int, default=16, help="held-out sequences (0: none)")
  parser.add_argument("--block-size", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--refit-iterations", type=int, default=0,
                      help="also time Wanda and SparseGPT followed by pruning.refit_layer (0: not)")
  parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
  parser.add_argument("--out", help="also write the table to this file")
  args = parser.parse_args()
  if args.quick:
    args.shapes, args.sequences, args.seq_len, args.held_out, args.repeats = ["256x512"], 8, 256, 2, 1

  dev = jax.devices()[0]
  lines = [
      f"# {platform.machine()}, {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
      f"cores available: {len(os.sched_getaffinity(0))}, {datetime.date.today().isoformat()}",
      f"# calibration: {args.sequences} x {args.seq_len} tokens (LM-like generated data), held-out "
      f"{args.held_out} x {args.seq_len}; SparseGPT damp 0.01, block size {args.block_size}",
  ]
  print("\n".join(lines), flush=True)
  stats_cache: dict[int, tuple] = {}
  rows = []
  for shape in args.shapes:
    k, n = (int(v) for v in shape.split("x"))
    if k not in stats_cache:
      stats, seconds = calibration_stats(k, args.sequences, args.seq_len, seed=1)
      held = calibration_stats(k, args.held_out, args.seq_len, seed=2)[0] if args.held_out else None
      stats_cache[k] = (stats, seconds, held)
      msg = (f"calibration K={k}: {int(stats.tokens)} tokens, {seconds:.1f} s "
             f"({int(stats.tokens) / seconds:,.0f} tokens/s), {memory_now()}")
      lines.append("# " + msg)
      print("# " + msg, flush=True)
    stats, _, held = stats_cache[k]
    w = jax.random.normal(jax.random.key(k * 7 + n), (k, n), jnp.float32) / np.sqrt(k)
    for name in args.patterns:
      spec = PATTERNS[name]
      solves = {
          "magnitude": lambda w=w, spec=spec: w * pruning.magnitude_layer(w, spec),
          "wanda": lambda w=w, s=stats, spec=spec: w * pruning.wanda_layer(w, s.sq_norms, spec),
          "sparsegpt": lambda w=w, s=stats, spec=spec: pruning.sparsegpt_layer(
              w, s.gram, spec, block_size=args.block_size).kernel,
      }
      if args.refit_iterations:
        solves["wanda + refit"] = lambda w=w, s=stats, spec=spec: pruning.refit_layer(
            w, s.gram, pruning.wanda_layer(w, s.sq_norms, spec), iterations=args.refit_iterations)
        solves["sparsegpt + refit"] = lambda w=w, s=stats, spec=spec: sparsegpt_refit(
            w, s.gram, spec, args.block_size, args.refit_iterations)
      for method, fn in solves.items():
        first, steady = timed(fn, args.repeats)
        w_hat = fn()
        err = float(pruning.reconstruction_error(w, w_hat, stats.gram))
        err_held = float(pruning.reconstruction_error(w, w_hat, held.gram)) if held is not None else float("nan")
        plan = sparsegpt_plan_bytes(w, stats.gram, spec, args.block_size) if method == "sparsegpt" else None
        row = (f"| {k}x{n} | {name} | {method} | {steady:.2f} | {first:.2f} | "
               f"{'' if plan is None else f'{plan / 2**20:.0f}'} | {memory_now()} | {err:.4f} | {err_held:.4f} |")
        rows.append(row)
        print(row, flush=True)
      del w_hat
  table = ["| layer (K x N) | pattern | method | solve s | first call s (compile + run) | XLA plan MiB | "
           "memory so far | rel. error (calib.) | rel. error (held-out) |", "|---|---|---|---|---|---|---|---|---|",
           *rows]
  text = "\n".join([*lines, "", *table])
  print("\n" + text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()
