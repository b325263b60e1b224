"""The pieces of a 2:4 SR-STE step on sparse tensor cores, each timed on its own, against the dense products.

    python benchmarks/sweeps/gpu_sr_ste_parts.py [--shapes 8192x2048x8192,8192x8192x2048 --iterations 20]

For ``x (M, K) @ W (K, N)``, bf16 ``x`` / ``dY`` and a float32 master ``W``: the dense forward, ``dY Wᵀ`` and
``xᵀ dY``; pruning (plain 2:4 pruned and compressed in one pass by XLA and by our kernel; the
transposable mask by our kernel, ``nm24_transposable``, alone and writing both compressed buffers, and by XLA's
pattern search); cuSPARSELt's compression of the pruned weight as ``W`` and as ``Wᵀ`` (read transposed,
``LAYOUT_NK``, or a transposed copy); the sparse forward and ``dY Wᵀ``;
and whole steps (value and both gradients of ``sr_ste_matmul``) on each path. Device-side times (median of
``--iterations`` calls), ratios to the dense forward product; the table prints last.
"""

from __future__ import annotations

import argparse

import _benchmarks_path  # noqa: F401 -- benchmarks/ on sys.path (_gpu_timing, gpu_block_sparse)
import jax
import jax.numpy as jnp
from _gpu_timing import TIMER
from _gpu_timing import log
from _gpu_timing import time_ms

from jaxsparse import ops
from jaxsparse._cuda import _cusparselt as cslt
from jaxsparse._cuda import _kernels as ck
from jaxsparse._cuda import _layout
from jaxsparse.formats import _nm_masks
from jaxsparse.ops import _sr_ste


def _step(dense_products=False, **kw):
  """One SR-STE step; ``dense_products``: the automatic path with its sparse-core threshold out of reach
  while tracing (the transposable layers' kernel-pruned dense products)."""

  def step(x, w, dy):
    saved = _sr_ste.TRANSPOSABLE_SPARSE_CORE_MIN_ROWS
    if dense_products:
      _sr_ste.TRANSPOSABLE_SPARSE_CORE_MIN_ROWS = x.shape[0] + 1
    try:
      y, vjp = jax.vjp(lambda x, w: ops.sr_ste_matmul(x, w, 2, 4, dtype=jnp.bfloat16, **kw), x, w)
      return y, vjp(dy)
    finally:
      _sr_ste.TRANSPOSABLE_SPARSE_CORE_MIN_ROWS = saved

  return step


def _dense_step(x, w, dy):
  y, vjp = jax.vjp(lambda x, w: x @ w.astype(jnp.bfloat16), x, w)
  return y, vjp(dy)


def parts(m: int, k: int, n: int, iterations: int) -> list[tuple[str, float]]:
  kx, kw, kg = jax.random.split(jax.random.key(m + k + n), 3)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(kg, (m, n), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(kw, (k, n), jnp.float32)
  wb = w.astype(jnp.bfloat16)
  pruned = jnp.where(_nm_masks.nm_mask(w, 2, 4, transposable=True), w, 0).astype(jnp.bfloat16)
  blob, blob_t = cslt.compress(pruned), cslt.compress(pruned.T)
  cases = {
      "dense fwd x W": (lambda x, w: x @ w, x, wb),
      "dense dX dY Wᵀ": (lambda dy, w: dy @ w.T, dy, wb),
      "dense dW xᵀ dY": (lambda x, dy: x.T @ dy, x, dy),
      "plain prune + compress (XLA, one pass)": (lambda w: _layout.compress_dense(w, dtype=jnp.bfloat16), w),
      "plain prune + compress (our kernel)": (lambda w: ck.nm24_prune(w, jnp.bfloat16, compress=True), w),
      "transposable prune (our kernel)": (lambda w: ck.nm24_transposable(w, jnp.bfloat16), w),
      "transposable prune into both compressed buffers (our kernel)": (ck.nm24_transposable_compress, w),
      "transposable pattern (XLA search)": (lambda w: _nm_masks.transposable_pattern(w, 2, 4), w),
      "compress W (cuSPARSELt, KN)": (lambda p: cslt.compress(p), pruned),
      "compress Wᵀ (cuSPARSELt, NK)": (lambda p: cslt.compress(p, layout=cslt.LAYOUT_NK), pruned),
      "transpose + compress Wᵀ (cuSPARSELt, KN)": (lambda p: cslt.compress(p.T), pruned),
      "sparse fwd x W": (lambda x, b: cslt.matmul(x, b, n), x, blob),
      "sparse dX dY Wᵀ": (lambda dy, b: cslt.matmul(dy, b, k), dy, blob_t),
      "step dense": (_dense_step, x, w, dy),
      "step SR-STE, dense products": (_step(implementation="xla"), x, w, dy),
      "step SR-STE, sparse fwd": (_step(implementation="cusparselt"), x, w, dy),
      "step transposable, kernel-pruned dense": (_step(dense_products=True, transposable=True), x, w, dy),
      "step transposable, sparse fwd + dX": (_step(transposable=True, implementation="cusparselt"), x, w, dy),
  }
  out = []
  for name, (f, *args) in cases.items():
    try:
      t = time_ms(f, *args, iterations=iterations)
    except Exception as e:  # report and go on
      log(f"{m}x{k}x{n} {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
      t = float("nan")
    log(f"{m}x{k}x{n} {name}: {t:.4f} ms")
    out.append((name, t))
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shapes", default="8192x2048x8192,8192x8192x2048", help="comma-separated MxKxN")
  p.add_argument("--iterations", type=int, default=20)
  args = p.parse_args(argv)
  shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
  results = {s: parts(*s, args.iterations) for s in shapes}
  names = [name for name, _ in next(iter(results.values()))]
  head = " | ".join(f"{m}x{k}x{n} ms (/ dense fwd)" for m, k, n in shapes)
  lines = [f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, timer: {TIMER['how']}", "",
           f"| part | {head} |", "|---|" + "---|" * len(shapes)]
  for i, name in enumerate(names):
    cells = [f"{r[i][1]:.3f} ({r[i][1] / r[0][1]:.2f})" for r in results.values()]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  log("\n" + "\n".join(lines))


if __name__ == "__main__":
  main()
