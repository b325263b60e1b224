"""Each product of a block-sparse layer on its two routes: the per-block kernels and the dense product.

    python benchmarks/sweeps/gpu_product_routes.py [--ns 4096,16384 --blocks 32,64 --densities 0.25,0.5
                                             --dtypes bfloat16,float32 --m 8192 --variants]

For ``x (M, K) @ W (K, N)`` (K = 4096 by default) with a random block pattern, times (device-side, median of
``--iterations`` calls) the forward, ``dX = dY Wᵀ`` and ``dW = xᵀ dY`` (kept blocks) three ways: the
per-block kernels (Mosaic GPU / Triton, as the default config picks them), the dense route (forward
and ``dX``: ``dense_weight`` then one dense product; ``dW``: the dense ``xᵀ dY`` then a gather of the
kept blocks) and the plain dense product of a dense weight; "default route" is what
``BlockSparseMatmulConfig.get_default`` picks. This is the data behind the ``DenseRules`` of ``DispatchRules.dense``
(``above_density``, ``long_contraction*``, ``dw_*``, ``min_m``) and the ``min_m`` thresholds of the other routes
in ``jaxsparse/pallas/_dispatch_rules.py``.
``--variants`` also times the forward and dX kernels in other tile orders (``group_m``), and dW on the other
per-block kernel (Triton where Mosaic is the default), the Triton dW with its blocks taken by column, and
both item orders of the Mosaic kernel. Prints the table(s) last.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import _benchmarks_path  # noqa: F401 -- benchmarks/ on sys.path (_gpu_timing, gpu_block_sparse)
import jax
import jax.numpy as jnp
from _gpu_timing import log
from _gpu_timing import time_ms
from gpu_block_sparse import problem

from jaxsparse.pallas import BlockSparseMatmulConfig
from jaxsparse.pallas import _block_sparse_matmul as kernels
from jaxsparse.pallas import _block_sparse_matmul_mgpu as mgpu
from jaxsparse.pallas import _block_sparse_sdd_mgpu as mgpu_sdd
from jaxsparse.pallas._block_sparse_config import mosaic_available


def _products(cfg):
  # Off the GPU (the CPU smoke test) the kernels run in interpret mode, which keeps them on every route.
  kw = dict(config=cfg, interpret=jax.default_backend() != "gpu")
  return {
      "fwd": lambda x, dy, w: kernels.forward(x, w, **kw),
      "dX": lambda x, dy, w: kernels.backward(x, dy, w, need_dw=False, **kw)[0],
      "dW": lambda x, dy, w: kernels.backward(x, dy, w, need_dx=False, **kw)[1],
  }


def _dense_products():
  return {
      "fwd": lambda x, dy, wd: x @ wd,
      "dX": lambda x, dy, wd: dy @ wd.T,
      "dW": lambda x, dy, wd: jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ()))),
  }


def _variants(kern, m, w, group_ms):
  """``(label, product, config)``: other tile orders (``group_m``) of the forward and dX kernels, and dW on the
  other per-block kernel (--variants)."""
  out = []
  for prod, triton, mosaic in (("fwd", "forward", "mosaic_forward"), ("dX", "dx", "mosaic_dx")):
    name = mosaic if getattr(kern, mosaic) is not None else triton
    cfg, kind = getattr(kern, name), "Mosaic" if name == mosaic else "Triton"
    out += [
        (f"{prod} {kind} group_m={g}", prod, dataclasses.replace(kern, **{name: dataclasses.replace(cfg, group_m=g)}))
        for g in group_ms
        if g != cfg.group_m
    ]
  # The other kernel family of the forward and dX: Triton where the default is Mosaic GPU, and the
  # reverse where Mosaic GPU can run these blocks.
  mosaic_cfg = mgpu.MosaicBlockSparseMatmulConfig.get_default(m, w.block_shape, w.dtype) if mosaic_available() else None
  for prod, field in (("fwd", "mosaic_forward"), ("dX", "mosaic_dx")):
    if getattr(kern, field) is not None:
      out.append((f"{prod} Triton", prod, dataclasses.replace(kern, **{field: None})))
    elif mosaic_cfg is not None:
      cfg = getattr(mosaic_cfg, "forward" if prod == "fwd" else "dx")
      out.append((f"{prod} Mosaic", prod, dataclasses.replace(kern, **{field: cfg})))
  triton_dw_cols = dataclasses.replace(kern.dw, block_order="cols")
  out.append(("dW Triton order=cols", "dW", dataclasses.replace(kern, mosaic_dw=None, dw=triton_dw_cols)))
  if kern.mosaic_dw is None and mosaic_cfg is not None:
    dw = mgpu_sdd.MosaicSddConfig.get_default(w.block_shape, w.dtype)
    out.append(("dW Mosaic", "dW", dataclasses.replace(kern, mosaic_dw=dw)))
  if kern.mosaic_dw is not None:
    out.append(("dW Triton", "dW", dataclasses.replace(kern, mosaic_dw=None)))
    for o in ("rows", "cols"):
      dw = dataclasses.replace(kern.mosaic_dw, order=o)
      out.append((f"dW Mosaic order={o}", "dW", dataclasses.replace(kern, mosaic_dw=dw)))
  return out


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--m", default="8192", help="comma-separated M")
  p.add_argument("--k", default="4096", help="comma-separated K")
  p.add_argument("--ns", default="4096,16384")
  p.add_argument("--blocks", default="32,64", help="comma-separated block sizes: 64 (square) or 64x32 (bk x bn)")
  p.add_argument("--densities", default="0.25,0.5")
  p.add_argument("--dtypes", default="bfloat16,float32")
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--variants", action="store_true", help="also time other dX tile orders and the other dW kernel")
  p.add_argument("--group-ms", default="1,2,4,8,16", help="--variants: the group_m values of the tile orders")
  args = p.parse_args(argv)
  ints = lambda s: [int(v) for v in s.split(",")]
  head = ["dtype", "M", "K x N", "block", "d", "default route"]
  for prod in ("fwd", "dX", "dW"):
    head += [f"{prod} dense ms", f"{prod} kernels ms (ratio)", f"{prod} dense route ms (ratio)"]
  rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  variant_head = "| dtype | M | K x N | block | d | variant | ms | ratio to dense | default kernels ratio |"
  variant_rows = [variant_head, "|" + "---|" * 9]
  blocks = [tuple(int(v) for v in b.split("x")) if "x" in b else int(b) for b in args.blocks.split(",")]
  for dtype, m, k, n in itertools.product((jnp.dtype(v) for v in args.dtypes.split(",")), ints(args.m), ints(args.k),
                                          ints(args.ns)):
    x, dy, _, _ = problem(m, k, n, 32, 1.0, dtype=dtype)
    wd = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(dtype)
    dense = {prod: time_ms(f, x, dy, wd, iterations=args.iterations) for prod, f in _dense_products().items()}
    del wd
    for b in blocks:
      for d in (float(v) for v in args.densities.split(",")):
        # Square blocks keep the seeds (the masks) of the runs recorded before rectangular ones were added.
        x, dy, w, _ = problem(m, k, n, b, d, seed=b if isinstance(b, int) else 1, dtype=dtype)
        default = BlockSparseMatmulConfig.get_default(m, w.shape, w.block_shape, w.nnz_blocks, w.dtype)
        kern = dataclasses.replace(default, dense=False, forward_dense=False, dx_dense=False, dw_dense=False)
        route = dataclasses.replace(default, dense=True)
        routes = {name: _products(c) for name, c in (("kernels", kern), ("route", route))}
        on = {"fwd": default.forward_dense, "dX": default.dx_dense, "dW": default.dw_dense}
        used = "dense" if default.dense else " + ".join([f"{p} dense" for p in on if on[p]] or ["kernels"])
        cells = [dtype.name, str(m), f"{k}x{n}", "x".join(map(str, w.block_shape)), str(d), used]
        base = {}
        for prod in ("fwd", "dX", "dW"):
          t = {name: time_ms(fs[prod], x, dy, w, iterations=args.iterations) for name, fs in routes.items()}
          base[prod] = t["kernels"] / dense[prod]
          cells += [f"{dense[prod]:.4f}"] + [f"{t[r]:.4f} ({t[r] / dense[prod]:.2f})" for r in ("kernels", "route")]
        rows.append("| " + " | ".join(cells) + " |")
        log(rows[-1])
        for label, prod, cfg in _variants(kern, m, w, ints(args.group_ms)) if args.variants else []:
          try:
            t = time_ms(_products(cfg)[prod], x, dy, w, iterations=args.iterations)
          except Exception as e:  # a variant the kernel does not support: say so, go on
            log(f"{' '.join(cells[:5])} {label}: FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
          variant_rows.append(
              f"| {' | '.join(cells[:5])} | {label} | {t:.4f} | {t / dense[prod]:.2f} | {base[prod]:.2f} |"
          )
          log(variant_rows[-1])
  log(f"\n{jax.devices()[0].device_kind}, density = kept blocks / blocks")
  print("\n".join(rows + (["", *variant_rows] if args.variants else [])), flush=True)


if __name__ == "__main__":
  main()
