"""Every config of the ``mma.sp`` 2:4 decode kernel (``jaxsparse._cuda``) at some products, each checked against a
float32 product and timed as measured dispatch times its candidates (CUPTI device time, operands rotated over copies
so that the weights come from HBM), against XLA's dense ``x @ W`` in the same process::

    PYTHONPATH=. python3 benchmarks/sweeps/gpu_nm24_configs.py --rows 24,32 --out $OUT/nm24_configs.json
    PYTHONPATH=. python3 benchmarks/sweeps/gpu_nm24_configs.py --rows 17,28 --shapes 5120x13824,8192x8192
    PYTHONPATH=. python3 benchmarks/sweeps/gpu_nm24_configs.py --rows 1,16 --layouts indices,buffer --blocks 1,2

Configs: split 1 / 2 / 4 / 8, warps 2 / 4 / 8, spans of 64 / 128 columns, ``token_split`` 1 / 2 (above 8 rows) and
both ``x_load``\\ s, one block per multiprocessor (72-96 configs a product; ``--blocks 1,3`` also three: 1-4), each
in the load orders of ``--loads`` (``Nm24DecodeConfig.loads``; ``--loads step`` for the configs before them; ``tma``
only on the buffer up to 8 rows, with 2-4 stages where their shared memory fits). The
weight's layout (``--layouts``): ``indices`` (:class:`jaxsparse.NMSparseMatrix`'s values and indices, what ``nm_matmul``
reads from an ``NMSparseMatrix``) or ``buffer`` (cuSPARSELt's buffer, what a compressed layer keeps and the kernel
then reads its positions from: :func:`~jaxsparse._cuda._kernels.nm24_decode_buffer`). Prints a Markdown row per
product (the shipped default, the best of :func:`~jaxsparse._cuda._kernels.nm24_candidate_configs`, the best of all)
and writes every timing to ``--out`` (JSON), from which other defaults and candidate sets can be scored without a
GPU. ``benchmarks/results/llm_decode_nm32_configs_2026-11-28_h100.md`` has its output on an H100.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp

import jaxsparse
from jaxsparse._cuda import _kernels as ck
from jaxsparse._cuda import _layout
from jaxsparse._cuda._nm24_config import NM24_MAX_TMA_SHARED_BYTES
from jaxsparse._cuda._nm24_config import nm24_tma_shared_bytes
from jaxsparse._tuning._measure import time_call_ms

# The fused decode products of the TinyLlama-1.1B and Llama-3-8B shapes (qkv, o, gate_up, down).
DEFAULT_SHAPES = "2048x2560,2048x2048,2048x11264,5632x2048,4096x6144,4096x4096,4096x28672,14336x4096"


def all_configs(m: int, k: int, n: int, blocks: tuple[int, ...] = (1,), loads: tuple[str, ...] = ("step",),
                buffer: bool = False) -> list[ck.Nm24DecodeConfig]:
  """Every config the kernel takes for an ``(m, k) @ (k, n)`` product (``blocks``: blocks per multiprocessor;
  ``loads``: the load orders, ``Nm24DecodeConfig.loads``; ``buffer``: reading cuSPARSELt's buffer, the only layout
  ``"tma"`` reads)."""
  out = [
      ck.Nm24DecodeConfig(split, warps, span, blocks_per_sm=b, token_split=ts, x_load=xl, loads=ld)
      for ld, split, warps, span, b, ts, xl in itertools.product(loads, (1, 2, 4, 8), (2, 4, 8), ck.NM24_SPANS, blocks,
                                                                 (1, 2), ck.NM24_X_LOADS)
      if ld != "tma" and not (n % span or k // 64 < split * warps or (ts == 2 and m <= 8))
  ]
  if "tma" in loads and buffer and m <= 8:
    out += [ck.Nm24DecodeConfig(split, warps, span, blocks_per_sm=b, x_load="ldmatrix", loads="tma", stages=st)
            for split, warps, span, b, st in itertools.product((1, 2, 4, 8), (2, 4, 8), ck.NM24_SPANS, blocks,
                                                               (2, 3, 4))
            if not (n % span or k // 64 < split * warps)
            and nm24_tma_shared_bytes(warps, span, st) <= NM24_MAX_TMA_SHARED_BYTES]
  return out


def sweep(m: int, k: int, n: int, layout: str = "indices", blocks: tuple[int, ...] = (1,),
          loads: tuple[str, ...] = ("step",)) -> dict:
  """Times every config and the dense product of one ``(m, k) @ (k, n)`` product, the weight in ``layout``
  (``"indices"`` or ``"buffer"``); relative errors too."""
  kx, kw = jax.random.split(jax.random.key(m * 7 + n))
  dense = jax.random.normal(kw, (k, n), jnp.float32).astype(jnp.bfloat16)
  w = jaxsparse.NMSparseMatrix.from_dense(dense, 2, 4)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  wd = w.to_dense()
  ref = jnp.dot(x.astype(jnp.float32), wd.astype(jnp.float32))
  out = {"m": m, "k": k, "n": n, "layout": layout, "dense_us": time_call_ms(jnp.dot, (x, wd), "cuda") * 1e3,
         "configs": {}}
  if layout == "buffer":
    weight = (_layout.compress_values(w.values, w.positions()),)
    run = lambda cfg: lambda x, b: ck.nm24_decode_buffer(x, b, n, config=cfg)
  else:
    weight = (w.values, w.indices)
    run = lambda cfg: lambda x, v, i: ck.nm24_decode(x, v, i, config=cfg)
  for cfg in all_configs(m, k, n, blocks, loads, buffer=layout == "buffer"):
    f = run(cfg)
    y = jax.jit(f)(x, *weight)
    err = float(jnp.linalg.norm(y.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    out["configs"][cfg.name] = {"us": time_call_ms(f, (x, *weight), "cuda") * 1e3, "rel_err": err}
  return out


def row(r: dict) -> str:
  m, k, n, dense = r["m"], r["k"], r["n"], r["dense_us"]
  us = {name: c["us"] for name, c in r["configs"].items()}
  buffer = r.get("layout") == "buffer"
  default = ck.Nm24DecodeConfig.get_default(m, k, n, buffer=buffer).name
  configs = ck.nm24_candidate_configs(m, k, n, buffer=buffer)
  cand = min((us[c.name], c.name) for c in configs if c.name in us)
  best = min((t, name) for name, t in us.items())
  wrong = sum(c["rel_err"] > 2e-2 for c in r["configs"].values())
  d_us, d_ratio = (f"{us[default]:.2f}", f"{us[default] / dense:.2f}") if default in us else ("-", "-")  # not swept
  return (f"| {m} x {k} x {n} | {r.get('layout', 'indices')} | {dense:.2f} | {d_us} ({default}) | "
          f"{cand[0]:.2f} ({cand[1]}) | "
          f"{best[0]:.2f} ({best[1]}) | {d_ratio} | {cand[0] / dense:.2f} | {best[0] / dense:.2f} | "
          f"{len(us)} | {wrong} |")


def parse_args(argv: list[str] | None = None) -> tuple[list[int], list[tuple[int, int]], list[str], tuple[int, ...],
                                                      tuple[str, ...], argparse.Namespace]:
  """The command line: rows, (K, N) shapes, layouts, blocks per multiprocessor, load orders and the namespace."""
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows", default="24,32", help="rows of x, comma-separated (1-32)")
  p.add_argument("--shapes", default=DEFAULT_SHAPES, help="K x N products, comma-separated")
  p.add_argument("--out", default="nm24_configs.json", help="every timing, JSON")
  p.add_argument("--layouts", default="indices", help="the weight's layouts, comma-separated: indices, buffer")
  p.add_argument("--blocks", default="1", help="blocks per multiprocessor, comma-separated: 1-4")
  p.add_argument("--loads", default="step,pair,stages,tma",
                 help="load orders, comma-separated: step, pair, stages, tma (the buffer up to 8 rows)")
  p.add_argument("--time-limit", type=float, default=500.0, help="seconds; products after it are left out")
  args = p.parse_args(argv)
  rows = [int(r) for r in args.rows.split(",")]
  shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
  layouts = args.layouts.split(",")
  blocks = tuple(int(b) for b in args.blocks.split(","))
  loads = tuple(args.loads.split(","))
  if not set(layouts) <= {"indices", "buffer"} or not set(blocks) <= {1, 2, 3, 4} or not set(loads) <= set(
      ck.NM24_LOADS):
    p.error(f"--layouts takes indices and buffer, --blocks 1-4, --loads {', '.join(ck.NM24_LOADS)}; got "
            f"{args.layouts!r}, {args.blocks!r}, {args.loads!r}")
  return rows, shapes, layouts, blocks, loads, args


def main() -> None:
  rows, shapes, layouts, blocks, loads, args = parse_args()
  t0 = time.time()
  with ThreadPoolExecutor(16) as pool:  # NVRTC builds, in threads (the shape only sets the token tiles)
    list(pool.map(lambda mcb: ck.nm24_prepare(mcb[0], 4096, 4096, mcb[1], buffer=mcb[2]),
                  [(m, c, lay == "buffer") for m in rows for lay in layouts
                   for c in all_configs(m, 4096, 4096, blocks, loads, buffer=lay == "buffer")]))
  print(f"built in {time.time() - t0:.0f} s", flush=True)
  results, lines = [], []
  for (k, n), m, layout in itertools.product(shapes, rows, layouts):
    if time.time() - t0 > args.time_limit:
      print(f"time limit: {m} x {k} x {n} ({layout}) and after left out", flush=True)
      break
    results.append(sweep(m, k, n, layout, blocks, loads))
    lines.append(row(results[-1]))
    print(lines[-1], flush=True)
    with open(args.out, "w") as f:
      json.dump(results, f)
  print("\n| M x K x N | weight | dense µs | default µs | best candidate µs | best of all µs | default / dense | "
        "candidates / dense | all / dense | configs | wrong |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
