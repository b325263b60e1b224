"""N:M (2:4) on a GPU: compressed decode, compressed forward at M=8192, SR-STE training, vs dense.

Run on a CUDA GPU (the device tool's H100 / H200), from the repository root:

  PYTHONPATH=. python3 -m pytest -q -m gpu -o addopts="" tests/test_pallas_nm.py
  PYTHONPATH=. python3 benchmarks/gpu_nm.py --sweep --torch --out gpu_nm.md
  PYTHONPATH=. python3 benchmarks/gpu_nm.py --tuned --help   # measured dispatch off / tune (benchmarks/_nm_tuned.py)

Cases, bf16 throughout, ``y = x @ W`` with ``W`` ``(K, N)`` 2:4 along ``K``:

* decode, M in {1, 16}, K = 4096, N in {4096, 16384}: the Pallas kernel reading the compressed
  weight (``--sweep`` times several tilings and reports the best and the default) against dense
  ``jnp.dot``. Each timed call multiplies by ``ROTATE`` different weights (128 MB dense at N =
  4096, more than the 50 MB L2 of an H100), so no weight is served from L2; times are per product.
* M = 8192 forward with the compressed weight: ``nm_matmul`` (expand in XLA + dense dot) and the
  Pallas kernel, against dense.
* SR-STE training step, M = 8192: forward + backward of ``x @ sr_ste(W)`` (mask recomputed from
  the dense weight, gradient to x and to the dense W) against the same for ``x @ W``.
* ``--torch``: torch 2:4 ``to_sparse_semi_structured`` (cuSPARSELt / CUTLASS) against ``F.linear``.
* cuSPARSELt (jaxsparse's custom call, when it can run): decode and M = 8192 products with the weight
  pre-compressed (``ops.cusparselt_compress``, what ``CompressedNMLinear`` keeps), and the SR-STE step
  through ``ops.sr_ste_matmul`` (prune + compress + sparse forward each call, dense backward).

Times are device-side: ``jax.experimental.mosaic.gpu.profiler.measure`` (CUPTI) sums the kernel
times of each call, median of ``--iterations`` calls (falls back to host timing of back-to-back calls
and says so). Ratios are against dense measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
from _gpu_timing import TIMER
from _gpu_timing import log
from _gpu_timing import rel_err
from _gpu_timing import time_ms

import jaxsparse
from jaxsparse import ops
from jaxsparse._cuda import _cusparselt as cslt
from jaxsparse.ops import nm_matmul
from jaxsparse.ops import sr_ste
from jaxsparse.pallas import NMMatmulConfig
from jaxsparse.pallas import _nm_matmul as kernels

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

K = 4096
COLS = (4096, 16384)
DECODE_ROWS = (16, 1)
M_TRAIN = 8192
ROTATE = 4


def weights(cols: int, count: int, seed: int = 0):
  """``count`` different 2:4 bf16 weights, compressed and dense (pruned)."""
  out = []
  for i in range(count):
    w = jax.random.normal(jax.random.key(seed + i), (K, cols), jnp.float32).astype(jnp.bfloat16)
    ws = jaxsparse.NMSparseMatrix.from_dense(w, 2, 4)
    out.append((ws, ws.to_dense()))
  return out


def activations(rows: int, seed: int = 100):
  return jax.random.normal(jax.random.key(seed), (rows, K), jnp.float32).astype(jnp.bfloat16)


# -------------------------------------------------------------------------------------------------
# Decode.
# -------------------------------------------------------------------------------------------------


# (block_n, block_groups, num_warps, num_stages, split_k) tried per expansion by --sweep.
DECODE_TILINGS = {
    4096: [(128, 16, 4, 4, 8), (128, 8, 4, 3, 8), (128, 32, 4, 3, 4), (64, 16, 4, 3, 8), (64, 32, 4, 3, 8)],
    16384: [(128, 16, 4, 4, 4), (128, 16, 4, 3, 8), (128, 8, 4, 3, 4), (64, 32, 4, 3, 4)],
}


def decode_configs(rows: int, cols: int) -> list[NMMatmulConfig]:
  bm = max(16, 1 << (rows - 1).bit_length())
  return [
      NMMatmulConfig(block_m=bm, block_n=bn, block_groups=bg, num_warps=w, num_stages=st, split_k=sp)
      for bn, bg, w, st, sp in DECODE_TILINGS[cols]
  ]


def decode(args) -> list[dict]:
  rows_out = []
  for cols in COLS:
    ws_all = weights(cols, ROTATE)
    comp = tuple(ws for ws, _ in ws_all)
    dense = tuple(wd for _, wd in ws_all)
    best_cfg = None
    for rows in args.decode_rows:
      x = activations(rows)
      t_dense = time_ms(lambda x, ds: [jnp.dot(x, d) for d in ds], x, dense, iterations=args.iterations) / ROTATE
      ref = jnp.dot(x.astype(jnp.float32), dense[0].astype(jnp.float32))
      default = NMMatmulConfig.get_default(rows, (K, cols), 2, 4, jnp.bfloat16)
      if args.sweep and best_cfg is None:
        configs = [default, *decode_configs(rows, cols)]
      else:  # Later row counts: the default and the winner of the first.
        configs = [default] + ([best_cfg] if best_cfg not in (None, default) else [])
      results = []
      for cfg in configs:
        try:
          f = lambda x, cs, cfg=cfg: [kernels.forward(x, c, config=cfg) for c in cs]
          err = rel_err(jax.jit(f)(x, comp[:1])[0], ref)
          t = time_ms(f, x, comp, iterations=args.iterations) / ROTATE
          results.append((t, cfg, err))
          log(f"decode M={rows} N={cols}: {t * 1e3:7.2f} us ratio {t / t_dense:.3f} err {err:.1e} {cfg}")
        except Exception as e:
          log(f"decode M={rows} N={cols}: FAILED {cfg}: {type(e).__name__}: {str(e)[:300]}")
      t_auto = time_ms(lambda x, cs: [nm_matmul(x, c) for c in cs], x, comp, iterations=args.iterations) / ROTATE
      t_expand = time_ms(lambda x, cs: [nm_matmul(x, c, implementation="xla") for c in cs], x, comp,
                         iterations=args.iterations) / ROTATE
      t_cslt = float("nan")
      if cslt.available():
        blobs = tuple(ops.cusparselt_compress(c) for c in comp)
        t_cslt = time_ms(lambda x, bs, cols=cols: [cslt.matmul(x, b, cols) for b in bs], x, blobs,
                         iterations=args.iterations) / ROTATE
        log(f"decode M={rows} N={cols}: cuSPARSELt {t_cslt * 1e3:7.2f} us ratio {t_cslt / t_dense:.3f}")
      best = min(results, key=lambda r: r[0]) if results else (float("nan"), None, float("nan"))
      best_cfg = best_cfg or best[1]
      t_def = results[0][0] if results and results[0][1] == default else float("nan")
      rows_out.append(dict(rows=rows, cols=cols, dense=t_dense, best=best[0], best_cfg=best[1], err=best[2],
                           default=t_def, auto=t_auto, expand=t_expand, cslt=t_cslt))
  return rows_out


# -------------------------------------------------------------------------------------------------
# M = 8192: compressed forward and SR-STE training.
# -------------------------------------------------------------------------------------------------


def large(args) -> list[dict]:
  out = []
  x = activations(M_TRAIN)
  for cols in COLS:
    (ws, wd), = weights(cols, 1, seed=50)
    w_dense = jax.random.normal(jax.random.key(7), (K, cols), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(8), (M_TRAIN, cols), jnp.float32).astype(jnp.bfloat16)
    t_dense = time_ms(jnp.dot, x, wd, iterations=args.iterations)
    t_auto = time_ms(nm_matmul, x, ws, iterations=args.iterations)
    t_expand_only = time_ms(lambda c: c.to_dense(), ws, iterations=args.iterations)
    kernel = {}
    for cfg in [
        NMMatmulConfig.get_default(M_TRAIN, (K, cols), 2, 4, jnp.bfloat16),
        NMMatmulConfig(block_m=128, block_n=256, block_groups=16, num_warps=8, num_stages=3),
    ][: 2 if args.sweep else 1]:
      try:
        f = lambda x, c, cfg=cfg: kernels.forward(x, c, config=cfg)
        err = rel_err(jax.jit(f)(x[:256], ws), jnp.dot(x[:256].astype(jnp.float32), wd.astype(jnp.float32)))
        kernel[cfg] = (time_ms(f, x, ws, iterations=args.iterations), err)
        log(f"M=8192 N={cols} kernel {kernel[cfg][0]:.3f} ms ratio {kernel[cfg][0] / t_dense:.3f} err {err:.1e} {cfg}")
      except Exception as e:
        log(f"M=8192 N={cols} kernel FAILED {cfg}: {type(e).__name__}: {str(e)[:300]}")
    best_kernel = min(kernel.values(), key=lambda r: r[0])[0] if kernel else float("nan")

    def train_dense(x, w, dy):
      y, vjp = jax.vjp(jnp.dot, x, w)
      return y, vjp(dy)

    def train_sr(x, w, dy):
      y, vjp = jax.vjp(lambda x, w: jnp.dot(x, sr_ste(w, 2, 4)), x, w)
      return y, vjp(dy)

    def train_dense_f32(x, w, dy):
      y, vjp = jax.vjp(lambda x, w: jnp.dot(x, w.astype(jnp.bfloat16)), x, w)
      return y, vjp(dy)

    def train_sr_f32(x, w, dy):
      y, vjp = jax.vjp(lambda x, w: jnp.dot(x, sr_ste(w, 2, 4).astype(jnp.bfloat16)), x, w)
      return y, vjp(dy)

    def train_cslt(x, w, dy):
      y, vjp = jax.vjp(lambda x, w: ops.sr_ste_matmul(x, w, 2, 4, dtype=jnp.bfloat16), x, w)
      return y, vjp(dy)

    def train_t(implementation):
      # Transposable 2:4 from float32 master weights: "cusparselt" = forward and dY Wᵀ on sparse tensor cores,
      # None = the default (the same at 8192 rows: sparse from TRANSPOSABLE_SPARSE_CORE_MIN_ROWS), "xla" = the
      # reference (XLA pattern search, dense products).
      def step(x, w, g):
        f = lambda x, w: ops.sr_ste_matmul(x, w, 2, 4, dtype=jnp.bfloat16, transposable=True,
                                           implementation=implementation)
        y, vjp = jax.vjp(f, x, w)
        return y, vjp(g)
      return step

    nan = float("nan")
    t_cslt_fwd = t_tr_cslt = t_tr_cslt32 = nan
    t_tr_t = {}
    for impl in ("cusparselt", None, "xla"):
      try:
        t_tr_t[impl] = time_ms(train_t(impl), x, w_dense.astype(jnp.float32), dy, iterations=args.iterations)
      except Exception as e:
        log(f"M=8192 N={cols}: transposable step ({impl}) FAILED {type(e).__name__}: {str(e)[:300]}")
        t_tr_t[impl] = nan
    log(f"M=8192 N={cols}: transposable SR-STE step (f32 master) sparse cores {t_tr_t['cusparselt']:.3f} ms, "
        f"default {t_tr_t[None]:.3f} ms, XLA reference {t_tr_t['xla']:.3f} ms")
    if cslt.available():
      blob = ops.cusparselt_compress(ws)
      fwd = lambda x, b, ws=ws: nm_matmul(x, ws, cusparselt_weight=b)
      t_cslt_fwd = time_ms(fwd, x, blob, iterations=args.iterations)
      t_tr_cslt = time_ms(train_cslt, x, w_dense, dy, iterations=args.iterations)
      t_tr_cslt32 = time_ms(train_cslt, x, w_dense.astype(jnp.float32), dy, iterations=args.iterations)
      (_, (dx_c, dw_c)), (_, (dx_s, dw_s)) = jax.jit(train_cslt)(x, w_dense, dy), jax.jit(train_sr)(x, w_dense, dy)
      log(f"M=8192 N={cols}: cuSPARSELt fwd {t_cslt_fwd:.3f} ms, sr_ste_matmul step {t_tr_cslt:.3f} ms "
          f"(f32 master {t_tr_cslt32:.3f}); grads equal to x @ sr_ste(w): "
          f"{bool((dx_c == dx_s).all())} / {bool((dw_c == dw_s).all())}")
    t_tr_dense = time_ms(train_dense, x, w_dense, dy, iterations=args.iterations)
    t_tr_sr = time_ms(train_sr, x, w_dense, dy, iterations=args.iterations)
    w32 = w_dense.astype(jnp.float32)
    t_tr_dense32 = time_ms(train_dense_f32, x, w32, dy, iterations=args.iterations)
    t_tr_sr32 = time_ms(train_sr_f32, x, w32, dy, iterations=args.iterations)
    # Correctness of the SR-STE step against the formula (bf16 dW rounding).
    (_, (dx, dw)), (_, (dx_ref, dw_ref)) = jax.jit(train_sr)(x, w_dense, dy), jax.jit(train_dense)(
        x, jnp.where(jaxsparse.nm_mask(w_dense, 2, 4), w_dense, 0), dy)
    mask = jaxsparse.nm_mask(w_dense, 2, 4)
    dw_formula = dw_ref.astype(jnp.float32) + 2e-4 * (~mask) * w_dense.astype(jnp.float32)
    err_tr = max(rel_err(dx, dx_ref), rel_err(dw, dw_formula))
    log(f"M=8192 N={cols}: dense {t_dense:.3f} auto {t_auto:.3f} expand-only {t_expand_only:.3f} "
        f"train dense {t_tr_dense:.3f} sr {t_tr_sr:.3f} (f32 master: {t_tr_dense32:.3f} / {t_tr_sr32:.3f}) "
        f"train err {err_tr:.1e}")
    out.append(dict(cols=cols, dense=t_dense, auto=t_auto, expand_only=t_expand_only, kernel=best_kernel,
                    tr_dense=t_tr_dense, tr_sr=t_tr_sr, tr_dense32=t_tr_dense32, tr_sr32=t_tr_sr32, err_tr=err_tr,
                    cslt_fwd=t_cslt_fwd, tr_cslt=t_tr_cslt, tr_cslt32=t_tr_cslt32, tr_t=t_tr_t))
  return out


# -------------------------------------------------------------------------------------------------
# torch 2:4.
# -------------------------------------------------------------------------------------------------


def torch_semi_structured() -> dict[tuple[int, int], tuple[float, float]]:
  """``{(rows, cols): (2:4 ms, dense ms)}`` of ``F.linear`` with a ``to_sparse_semi_structured`` weight."""
  try:
    import torch  # noqa: PLC0415 (optional)
    import triton.testing  # noqa: PLC0415 (optional)
    from torch.sparse import to_sparse_semi_structured  # noqa: PLC0415 (optional)
  except Exception as e:
    log(f"torch 2:4 unavailable: {type(e).__name__}: {e}")
    return {}
  res = {}
  for cols in COLS:
    w = torch.randn(cols, K, device="cuda", dtype=torch.bfloat16)
    w = w * torch.tensor([1, 1, 0, 0], device="cuda", dtype=torch.bfloat16).repeat(cols, K // 4)
    try:
      ws = to_sparse_semi_structured(w)
    except Exception as e:
      log(f"torch to_sparse_semi_structured failed: {type(e).__name__}: {str(e)[:200]}")
      return res
    for rows in (*DECODE_ROWS, M_TRAIN):
      x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
      try:
        t_sp = triton.testing.do_bench(lambda x=x, ws=ws: torch.nn.functional.linear(x, ws), return_mode="median")
        t_d = triton.testing.do_bench(lambda x=x, w=w: torch.nn.functional.linear(x, w), return_mode="median")
        res[(rows, cols)] = (t_sp, t_d)
        log(f"torch 2:4 M={rows} N={cols}: {t_sp:.4f} ms vs dense {t_d:.4f} ms ({t_sp / t_d:.2f}x)")
      except Exception as e:
        log(f"torch 2:4 M={rows} N={cols}: FAILED {type(e).__name__}: {str(e)[:200]}")
  return res


# -------------------------------------------------------------------------------------------------
# Report.
# -------------------------------------------------------------------------------------------------


def report(dec, big, tor, device: str) -> list[str]:
  lines = [
      f"device: {device}; jax {jax.__version__}; timer: {TIMER['how']}",
      "",
      "| decode M | K | N | dense us | Pallas 2:4 best us | ratio | target | default cfg us (ratio) | nm_matmul auto "
      "us (ratio) | XLA expand+dot us (ratio) | torch 2:4 / dense | rel err | best config |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in dec:
    d = r["dense"]
    tr = tor.get((r["rows"], r["cols"]))
    cfg = r["best_cfg"]
    cfg_s = "-" if cfg is None else (f"bn={cfg.block_n} bg={cfg.block_groups} w={cfg.num_warps} s={cfg.num_stages} "
                                     f"split={cfg.split_k}")
    lines.append(
        f"| {r['rows']} | {K} | {r['cols']} | {d * 1e3:.2f} | {r['best'] * 1e3:.2f} | **{r['best'] / d:.2f}** | 0.75 | "
        f"{r['default'] * 1e3:.2f} ({r['default'] / d:.2f}) | {r['auto'] * 1e3:.2f} ({r['auto'] / d:.2f}) | "
        f"{r['expand'] * 1e3:.2f} ({r['expand'] / d:.2f}) | {'-' if tr is None else f'{tr[0] / tr[1]:.2f}'} | "
        f"{r['err']:.1e} | {cfg_s} |"
    )
  lines += [
      "",
      "| M | K | N | dense fwd ms | nm_matmul fwd ms (ratio) | of which expand ms | Pallas kernel fwd ms (ratio) | "
      "SR-STE fwd+bwd / dense ms | ratio (target 1.15) | f32 master weights: SR-STE / dense ms (ratio) | "
      "torch 2:4 / dense fwd |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in big:
    d = r["dense"]
    tr = tor.get((M_TRAIN, r["cols"]))
    lines.append(
        f"| {M_TRAIN} | {K} | {r['cols']} | {d:.3f} | {r['auto']:.3f} ({r['auto'] / d:.2f}) | {r['expand_only']:.3f} | "
        f"{r['kernel']:.3f} ({r['kernel'] / d:.2f}) | {r['tr_sr']:.3f} / {r['tr_dense']:.3f} | "
        f"**{r['tr_sr'] / r['tr_dense']:.2f}** | {r['tr_sr32']:.3f} / {r['tr_dense32']:.3f} "
        f"({r['tr_sr32'] / r['tr_dense32']:.2f}) | {'-' if tr is None else f'{tr[0] / tr[1]:.2f}'} |"
    )
  lines += [
      "",
      "cuSPARSELt (sparse tensor cores, weight pre-compressed for the products; SR-STE step = prune + compress +",
      "sparse forward, dense backward), time / dense time:",
      "",
      "| M | K | N | 2:4 product | target | SR-STE step bf16 weights (ms, ratio) | SR-STE step f32 master "
      "(ms, ratio) | transposable step f32 master: sparse fwd + dX / default / XLA reference "
      "(ratios) |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for r in dec:
    target = 0.65
    lines.append(f"| {r['rows']} | {K} | {r['cols']} | {r['cslt'] * 1e3:.2f} us (**{r['cslt'] / r['dense']:.2f}**) | "
                 f"{target} | - | - | - |")
  for r in big:
    target = 0.65 if r["cols"] == 16384 else 0.75
    lines.append(
        f"| {M_TRAIN} | {K} | {r['cols']} | {r['cslt_fwd']:.3f} ms (**{r['cslt_fwd'] / r['dense']:.2f}**) | {target} | "
        f"{r['tr_cslt']:.3f} (**{r['tr_cslt'] / r['tr_dense']:.2f}**) | {r['tr_cslt32']:.3f} "
        f"({r['tr_cslt32'] / r['tr_dense32']:.2f}) | "
        + " / ".join(f"{r['tr_t'][i] / r['tr_dense32']:.2f}" for i in ("cusparselt", None, "xla")) + " |"
    )
  return lines


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--tuned" in argv:  # the measured-dispatch comparison: its own options
    import _nm_tuned  # noqa: PLC0415 (a sibling module, only for this mode)

    argv.remove("--tuned")
    return _nm_tuned.main(argv)
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tuned", action="store_true",
                      help="instead: 2:4 vs dense with measured dispatch off / tune (see --tuned --help)")
  parser.add_argument("--sweep", action="store_true", help="time several kernel tilings")
  parser.add_argument("--torch", action="store_true", help="add torch to_sparse_semi_structured")
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--skip-large", action="store_true", help="only the decode cases")
  parser.add_argument("--skip-decode", action="store_true", help="only the M = 8192 cases")
  parser.add_argument("--decode-rows", type=int, nargs="+", default=list(DECODE_ROWS))
  parser.add_argument("--out", default=None, help="write the markdown tables here")
  args = parser.parse_args(argv)
  dev = jax.devices()[0]
  device = getattr(dev, "device_kind", str(dev))
  log(f"{device}, jax {jax.__version__}, python {sys.version.split()[0]}")
  t0 = time.perf_counter()
  dec = [] if args.skip_decode else decode(args)
  big = [] if args.skip_large else large(args)
  tor = torch_semi_structured() if args.torch else {}
  lines = report(dec, big, tor, device)
  log(f"\n({time.perf_counter() - t0:.0f} s)\n")
  log("\n".join(lines))
  if args.out:
    with open(args.out, "w") as f:
      f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
