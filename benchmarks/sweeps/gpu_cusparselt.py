"""cuSPARSELt 2:4 custom calls on a GPU: correctness and op-level timings of the layouts, vs dense.

Run on a CUDA GPU from the repository root:

  PYTHONPATH=. python3 benchmarks/sweeps/gpu_cusparselt.py --out gpu_cusparselt.md

Checks ``jaxsparse._cuda._cusparselt.matmul(x, compress(W))`` against a float32 product of the
same (rounded) inputs for both weight layouts, both 16-bit dtypes and several row counts (including
ones that are padded), then times, bf16, ``y = x @ W`` with ``W`` ``(K, N)`` 2:4 along ``K``:

* the product with a pre-compressed weight (layouts KN and NK; algorithm searched or cuSPARSELt's
  default) against dense ``jnp.dot``; decode rows multiply by ``ROTATE`` different weights per
  call so that no weight stays in L2;
* ``compress`` alone and the SR-STE forward (mask + prune in XLA, compress, product).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import _benchmarks_path  # noqa: F401 -- benchmarks/ on sys.path (_gpu_timing, gpu_block_sparse)
import jax
import jax.numpy as jnp
from _gpu_timing import TIMER
from _gpu_timing import log
from _gpu_timing import rel_err
from _gpu_timing import time_ms

import jaxsparse
from jaxsparse._cuda import _cusparselt as cslt

ROTATE = 4
SHAPES = [(1, 64, 128), (16, 256, 512), (100, 512, 256), (1024, 1024, 2048)]
CASES = [  # (M, K, N)
    (8192, 4096, 16384),
    (8192, 4096, 4096),
    (64, 8192, 8192),
    (16, 4096, 4096),
    (16, 4096, 16384),
    (1, 4096, 4096),
    (1, 4096, 16384),
]


def pruned(key, k, n, dtype):
  w = jax.random.normal(key, (k, n), jnp.float32).astype(dtype)
  return jnp.where(jaxsparse.nm_mask(w, 2, 4), w, jnp.zeros((), dtype))


def stored(w, layout):
  return w if layout == cslt.LAYOUT_KN else w.T


def check(dtypes) -> list[str]:
  failures = []
  for dtype in dtypes:
    for layout in (cslt.LAYOUT_KN, cslt.LAYOUT_NK):
      for rows, k, n in SHAPES:
        kx, kw = jax.random.split(jax.random.key(rows * 7 + k + n + layout))
        w = pruned(kw, k, n, dtype)
        x = jax.random.normal(kx, (rows, k), jnp.float32).astype(dtype)
        f = jax.jit(lambda x, w, layout=layout, n=n: cslt.matmul(x, cslt.compress(stored(w, layout), layout=layout),
                                                                 n, layout=layout))
        y = f(x, w)
        ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
        err = rel_err(y, ref)
        finite = bool(jnp.isfinite(y.astype(jnp.float32)).all())
        ok = y.shape == (rows, n) and y.dtype == dtype and finite and err < 1e-2
        name = jnp.dtype(dtype).name
        log(f"check {name} layout={layout} M={rows} K={k} N={n}: err {err:.1e} {'ok' if ok else 'FAIL'}")
        if not ok:
          failures.append(f"{jnp.dtype(dtype).name} layout={layout} {rows}x{k}x{n} err={err}")
  return failures


def bench(args) -> list[dict]:
  out = []
  dt = jnp.bfloat16
  for rows, k, n in CASES:
    count = ROTATE if rows <= 64 else 1
    ws = [pruned(jax.random.key(50 + i), k, n, dt) for i in range(count)]
    x = jax.random.normal(jax.random.key(3), (rows, k), jnp.float32).astype(dt)
    t_dense = time_ms(lambda x, ws: [jnp.dot(x, w) for w in ws], x, ws, iterations=args.iterations) / count
    row = dict(rows=rows, k=k, n=n, dense=t_dense)
    for layout in (cslt.LAYOUT_KN, cslt.LAYOUT_NK):
      blobs = [jax.jit(lambda w, layout=layout: cslt.compress(stored(w, layout), layout=layout))(w) for w in ws]
      for search in (True, False):
        f = lambda x, bs, layout=layout, search=search, n=n: [
            cslt.matmul(x, b, n, layout=layout, search=search) for b in bs]
        try:
          err = rel_err(jax.jit(f)(x, blobs[:1])[0], jnp.dot(x.astype(jnp.float32), ws[0].astype(jnp.float32)))
          t = time_ms(f, x, blobs, iterations=args.iterations) / count
        except Exception as e:
          log(f"M={rows} K={k} N={n} layout={layout} search={search}: FAILED {type(e).__name__}: {str(e)[:400]}")
          t, err = float("nan"), float("nan")
        row[(layout, search)] = t
        log(f"M={rows} K={k} N={n} layout={layout} search={search}: {t * 1e3:8.2f} us dense {t_dense * 1e3:8.2f} us "
            f"ratio {t / t_dense:.3f} err {err:.1e}")
    if rows >= 8192:
      w = ws[0]
      row["compress"] = time_ms(lambda w: cslt.compress(w), w, iterations=args.iterations)
      wd = jax.random.normal(jax.random.key(9), (k, n), jnp.float32).astype(dt)

      def sr_fwd(x, w, n=n):
        wp = jnp.where(jaxsparse.nm_mask(w, 2, 4), w, jnp.zeros((), w.dtype))
        return cslt.matmul(x, cslt.compress(wp), n)

      row["sr_fwd"] = time_ms(sr_fwd, x, wd, iterations=args.iterations)
      row["prune"] = time_ms(lambda w: jnp.where(jaxsparse.nm_mask(w, 2, 4), w, jnp.zeros((), w.dtype)), wd,
                             iterations=args.iterations)
      log(f"M={rows} K={k} N={n}: compress {row['compress']:.3f} ms, prune {row['prune']:.3f} ms, "
          f"prune+compress+product {row['sr_fwd']:.3f} ms (dense {t_dense:.3f} ms)")
    out.append(row)
  return out


def report(rows, device) -> list[str]:
  lines = [f"device: {device}; jax {jax.__version__}; timer: {TIMER['how']}", "",
           "| M | K | N | dense us | KN searched | KN default | NK searched | NK default | prune / compress / "
           "prune+compress+product ms |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    d = r["dense"]
    cells = [f"{r[(lay, s)] * 1e3:.1f} ({r[(lay, s)] / d:.2f})" for lay in (0, 1) for s in (True, False)]
    extra = (f"{r['prune']:.3f} / {r['compress']:.3f} / {r['sr_fwd']:.3f} ({r['sr_fwd'] / d:.2f})"
             if "compress" in r else "-")
    lines.append(f"| {r['rows']} | {r['k']} | {r['n']} | {d * 1e3:.1f} | " + " | ".join(cells) + f" | {extra} |")
  return lines


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--out", default=None)
  parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], help="dtypes of the correctness check")
  parser.add_argument("--check-only", action="store_true")
  args = parser.parse_args(argv)
  dev = jax.devices()[0]
  device = getattr(dev, "device_kind", str(dev))
  log(f"{device}, jax {jax.__version__}, python {sys.version.split()[0]}")
  if not cslt.available():
    log(f"cuSPARSELt unavailable: {cslt.unavailable_reason()}")
    sys.exit(1)
  failures = check([jnp.dtype(d) for d in args.dtypes])
  if args.check_only:
    log(f"correctness failures: {failures or 'none'}")
    return
  rows = bench(args)
  lines = report(rows, device)
  lines.append("")
  lines.append(f"correctness failures: {failures or 'none'}")
  log("\n".join(lines))
  if args.out:
    with open(args.out, "w") as f:
      f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
