"""Device-side timing shared by the GPU benchmark scripts (imported from their folder)."""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

TIMER = {"how": "cupti"}  # falls back to "host" for the rest of the run when CUPTI is unavailable


def log(*args):
  print(*args, flush=True)


def time_ms(f, *args, iterations: int = 20) -> float:
  """Median device time of one call of ``f(*args)`` in ms."""
  f = jax.jit(f)
  jax.block_until_ready(f(*args))
  if TIMER["how"] == "cupti":
    try:
      from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415 (GPU-only module)

      _, times = profiler.measure(f, iterations=iterations)(*args)
      return float(statistics.median(times))
    except Exception as e:  # CUPTI missing or busy: fall back for the rest of the run.
      log(f"CUPTI timing failed ({type(e).__name__}: {e}); timing back-to-back calls from the host")
      TIMER["how"] = "host"
  return host_ms(f, *args, iterations=iterations)


def kernel_times_ms(f, *args, iterations: int = 20) -> list[tuple[str, float]]:
  """``(kernel name, median device ms)`` of each kernel one call of ``f(*args)`` launches, in order (CUPTI)."""
  from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415 (GPU-only module)

  f = jax.jit(f)
  jax.block_until_ready(f(*args))
  _, runs = profiler.measure(f, aggregate=False, iterations=iterations)(*args)
  return [(name, statistics.median(run[i][1] for run in runs)) for i, (name, _) in enumerate(runs[0])]


def kernel_split_ms(f, *args, iterations: int = 20) -> tuple[float, float, int]:
  """``(longest kernel, all other kernels, how many others)`` of one call of ``f(*args)``: median device ms (CUPTI)."""
  times = [t for _, t in kernel_times_ms(f, *args, iterations=iterations)]
  return max(times), sum(times) - max(times), len(times) - 1


def host_ms(f, *args, iterations: int = 20) -> float:
  """Median wall time of one call of the jitted ``f`` in ms (5 repeats of ``iterations`` back-to-back calls)."""
  jax.block_until_ready(f(*args))
  reps = []
  for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(iterations):
      out = f(*args)
    jax.block_until_ready(out)
    reps.append((time.perf_counter() - t0) * 1e3 / iterations)
  return float(statistics.median(reps))


def rel_err(a, b) -> float:
  """``|a - b| / |b|`` in float64 on the host (the arrays may live on different devices)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
