"""Decode speed (M <= 16; 2:4 also up to M = 32 with --rows) of the block-sparse and N:M kernels against dense,
L2-hot and from HBM.

Run on a CUDA GPU (the device tool's H100), from the repository root:

  PYTHONPATH=. python3 benchmarks/gpu_decode.py --out gpu_decode.md

Cases, bf16, ``y = x @ W``, ``x`` ``(M, 4096)``:

* block-sparse ``W`` ``(4096, 4096)``, blocks 64 and 128, density 0.25, M = 16 (``--bs-rows``, ``--bs-blocks``
  (also 32), ``--bs-densities``): the default and, with ``--sweep``, tile variants of the Triton forward
  (``KernelConfig.split``, ``sub_cols``, warps, stages).
* 2:4 ``W`` ``(4096, N)`` along ``K``, N in {4096, 16384}, M in {16, 8, 1}: the Pallas N:M kernel
  (default; ``--sweep``: its tilings, ``NMMatmulConfig``), the CUDA kernel on the sparse tensor cores
  (``jaxsparse/_cuda/nm24_decode.cu``: default; ``--sweep``: its work splits, ``Nm24DecodeConfig``),
  and what ``ops.nm_matmul`` picks.

Two timings per case, as device time (CUPTI, ``benchmarks/_gpu_timing.py``) per product:

* ``hot``: every call multiplies by the same weight, which then stays in the 50 MB L2 of an H100
  (a dense 4096 x 4096 bf16 weight is 32 MiB): what repeated calls of one layer in a microbenchmark see.
* ``hbm``: every call multiplies by several different weights, at least 128 MiB of them in total, so
  that no weight is still in L2 when it is read again: what a model's decode step sees, layer after
  layer.

Ratios are against dense ``jnp.dot`` timed the same way in the same run. ``GB/s`` is the weight
bytes (kept blocks / compressed values + positions) over the time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import _benchmarks_path  # noqa: F401 -- benchmarks/ on sys.path (_gpu_timing)
import jax
import jax.numpy as jnp
import numpy as np
from _gpu_timing import log
from _gpu_timing import rel_err
from _gpu_timing import time_ms

import jaxsparse
from jaxsparse import ops
from jaxsparse._cuda import _kernels as cuda_kernels
from jaxsparse.pallas import BlockSparseMatmulConfig
from jaxsparse.pallas import NMMatmulConfig
from jaxsparse.pallas import _block_sparse_matmul as bs_kernels
from jaxsparse.pallas import _nm_matmul as nm_kernels

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

K = 4096
HBM_BYTES = 128 << 20  # weights per timed call in the "hbm" timing: 2.5x the L2 of an H100
BS_N, BS_BLOCKS, BS_DENSITY, BS_M = 4096, (128, 64), 0.25, 16
NM_COLS, NM_ROWS = (4096, 16384), (16, 8, 1)
# (split, warps, span) of the sparse tensor-core kernel timed by --sweep (span 128: M <= 16 only).
NM24_SWEEP = [
    (1, 8, 128), (2, 8, 128), (4, 4, 128), (8, 4, 128), (8, 2, 128),
    (1, 4, 64), (2, 4, 64), (4, 4, 64), (8, 4, 64), (1, 8, 64), (2, 8, 64), (4, 8, 64), (4, 2, 64), (8, 2, 64),
]


def _bf16(key, shape):
  return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(jnp.bfloat16)


def _rotation(nbytes: int) -> int:
  return max(2, -(-HBM_BYTES // nbytes))


def _time(f, x, ws, iterations):
  """(hot, hbm) µs per product: one weight over and over, and a rotation through all of ``ws``."""
  hot = time_ms(lambda x, w: f(x, w), x, ws[0], iterations=iterations)
  hbm = time_ms(lambda x, ws: [f(x, w) for w in ws], x, tuple(ws), iterations=iterations) / len(ws)
  return hot * 1e3, hbm * 1e3


def _breakdown(f, *args) -> str:
  """Kernels of one call and their device times (µs)."""
  try:
    from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415 (GPU-only module)

    _, runs = profiler.measure(jax.jit(f), aggregate=False, iterations=5)(*args)
    per = {}
    for run in runs:
      for name, t in run:
        per.setdefault(name, []).append(t * 1e3)
    return ", ".join(f"{n[:40]} {np.median(v):.2f}" for n, v in per.items())
  except Exception as e:
    return f"(no breakdown: {type(e).__name__})"


# -------------------------------------------------------------------------------------------------
# Block-sparse.
# -------------------------------------------------------------------------------------------------


def _block_weight(b: int, seed: int, density: float = BS_DENSITY) -> jaxsparse.BlockSparseMatrix:
  kb, nb = K // b, BS_N // b
  flat = np.zeros(kb * nb, bool)
  flat[np.random.default_rng(seed).permutation(kb * nb)[: round(density * kb * nb)]] = True
  return jaxsparse.BlockSparseMatrix.from_dense(_bf16(seed, (K, BS_N)), (b, b), block_mask=flat.reshape(kb, nb))


# (label, forward config fields) per block size, on top of the default's block_m / group_m.
_OLD = dict(sub_cols=None, index_window=True, num_stages=3, num_warps=4)  # split: the default before 2026-11-23
_SUB = dict(sub_cols=32, split=1, index_window=False, num_stages=4, num_warps=4)  # "mem": indices from memory
BS_VARIANTS = {
    b: [
        (f"old default: split {4 if b == 128 else 8}", dict(_OLD, split=4 if b == 128 else 8)),
        ("split 4", dict(_SUB, sub_cols=None, split=4)),
        ("sub 32 mem", _SUB),
        ("sub 32 mem st3", dict(_SUB, num_stages=3)),
        ("sub 32 mem st5", dict(_SUB, num_stages=5)),
        ("sub 32 mem w2", dict(_SUB, num_warps=2)),
        ("sub 32", dict(_SUB, index_window=True)),
        ("sub 16 mem", dict(_SUB, sub_cols=16)),
        ("sub 16 mem w2", dict(_SUB, sub_cols=16, num_warps=2)),
        ("sub 64 mem", dict(_SUB, sub_cols=64)),
        ("sub 32 mem split 2", dict(_SUB, split=2)),
    ]
    for b in (128, 64)
}
# Blocks of 32 (2 KB a step; default: split 8, 4 warps, 3 stages): more or fewer programs, fewer warps for the
# 16 x 32 output tile, deeper pipelines, and 16-column programs.
BS_VARIANTS[32] = [
    ("split 4", dict(split=4)),
    ("split 16", dict(split=16)),
    ("split 8 w2", dict(split=8, num_warps=2)),
    ("split 8 w1", dict(split=8, num_warps=1)),
    ("split 16 w2", dict(split=16, num_warps=2)),
    ("split 16 w1", dict(split=16, num_warps=1)),
    ("split 4 w2", dict(split=4, num_warps=2)),
    ("split 8 st5", dict(split=8, num_stages=5)),
    ("split 8 w2 st5", dict(split=8, num_warps=2, num_stages=5)),
    ("split 8 mem", dict(split=8, index_window=False)),
    ("sub 16 split 4", dict(sub_cols=16, split=4)),
    ("sub 16 split 8 w2", dict(sub_cols=16, split=8, num_warps=2)),
]


def _variant_row(name, cfg, f, x, w0, ws, ref, dense_us, nbytes, iterations, rows: list[str]) -> None:
  """Checks ``f(x, w0)`` against ``ref``, times it hot and from HBM over ``ws``, appends its table row."""
  d_hot, d_hbm = dense_us
  try:
    err = rel_err(jax.jit(f)(x, w0), ref)
    hot, hbm = _time(f, x, ws, iterations)
  except Exception as e:
    log(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
    return
  line = (
      f"| {name} | {cfg} | {err:.1e} | {hot:.2f} | **{hot / d_hot:.2f}** | {hbm:.2f} | **{hbm / d_hbm:.2f}** | "
      f"{nbytes / hbm / 1e3:.0f} | {len(ws)} |"
  )
  rows.append(line)
  log(line)
  if name.endswith(" default"):
    log(f"  kernels: {_breakdown(f, x, w0)}")


def block_sparse(args, rows: list[str]) -> None:
  for m in args.bs_rows:
    x = _bf16(100 + m, (m, K))
    dense = [_bf16(200 + i, (K, BS_N)) for i in range(_rotation(K * BS_N * 2))]
    d_hot, d_hbm = _time(jnp.dot, x, dense, args.iterations)
    log(f"block-sparse decode {m}x{K}x{BS_N}: dense hot {d_hot:.2f} us, hbm {d_hbm:.2f} us ({len(dense)} weights)")
    log(f"  dense kernels: {_breakdown(jnp.dot, x, dense[0])}")
    rate = K * BS_N * 2 / d_hbm / 1e3
    rows.append(f"| M={m} dense | - | - | {d_hot:.2f} | 1.00 | {d_hbm:.2f} | 1.00 | {rate:.0f} | - |")
    del dense
    for b in args.bs_blocks:
      for density in args.bs_densities:
        _block_sparse_cases(args, rows, m, x, b, density, (d_hot, d_hbm))


def _block_sparse_cases(args, rows, m, x, b, density, dense_us) -> None:
  w0 = _block_weight(b, b, density)
  nbytes = w0.data.size * 2
  ws = [w0] + [_block_weight(b, b + 1000 * i, density) for i in range(1, _rotation(nbytes))]
  ref = jnp.dot(x.astype(jnp.float32), w0.to_dense().astype(jnp.float32))
  tag = f"M={m} b={b} d={density}"
  default = BlockSparseMatmulConfig.get_default(m, w0.shape, w0.block_shape, w0.nnz_blocks, w0.dtype)
  # Without --sweep: the default, and at block 128 the split default of 2026-11-23 and the 32-column programs.
  quick = [v for v in BS_VARIANTS.get(b, []) if v[0].startswith("old default") or v[0] == "sub 32"]
  variants = [("default", {})] + (BS_VARIANTS.get(b, []) if args.sweep else quick if b == 128 else [])
  for label, change in variants:
    cfg = dataclasses.replace(default, forward=dataclasses.replace(default.forward, **change))
    f = lambda x, w, cfg=cfg: bs_kernels.forward(x, w, config=cfg)
    _variant_row(f"{tag} Triton {label}", cfg.forward, f, x, w0, ws, ref, dense_us, nbytes, args.iterations, rows)


# -------------------------------------------------------------------------------------------------
# N:M (2:4).
# -------------------------------------------------------------------------------------------------

# (block_n, block_groups, num_warps, num_stages, split_k) per N.
NM_TILINGS = {
    4096: [
        (128, 8, 8, 3, 8),
        (128, 8, 4, 3, 16),
        (64, 8, 4, 3, 8),
        (64, 16, 4, 3, 4),
        (128, 16, 8, 3, 8),
        (128, 4, 4, 3, 16),
        (128, 8, 4, 2, 8),
    ],
    16384: [
        (128, 8, 8, 3, 4),
        (128, 8, 4, 3, 8),
        (64, 8, 4, 3, 4),
        (128, 16, 8, 3, 4),
        (64, 8, 2, 3, 4),
    ],
}


def _nm_weight(k: int, cols: int, seed: int) -> jaxsparse.NMSparseMatrix:
  return jaxsparse.NMSparseMatrix.from_dense(_bf16(seed, (k, cols)), 2, 4)


def nm(args, rows: list[str]) -> None:
  k = args.nm_k
  for cols in args.nm_cols:
    dense = [_bf16(300 + i, (k, cols)) for i in range(_rotation(k * cols * 2))]
    w0 = _nm_weight(k, cols, seed=7)
    nbytes = w0.values.size * 2 + w0.indices.size * w0.indices.dtype.itemsize
    ws = [w0] + [_nm_weight(k, cols, seed=7 + i) for i in range(1, _rotation(nbytes))]
    for m in args.rows if not args.quick else args.rows[:1]:
      x = _bf16(400 + m, (m, k))
      d_hot, d_hbm = _time(jnp.dot, x, dense, args.iterations)
      log(f"2:4 decode {m}x{k}x{cols}: dense hot {d_hot:.2f} us, hbm {d_hbm:.2f} us ({len(dense)} weights)")
      rows.append(
          f"| {m}x{cols} dense | - | - | {d_hot:.2f} | 1.00 | {d_hbm:.2f} | 1.00 | "
          f"{k * cols * 2 / d_hbm / 1e3:.0f} | {len(dense)} |"
      )
      ref = jnp.dot(x.astype(jnp.float32), w0.to_dense().astype(jnp.float32))
      default = NMMatmulConfig.get_default(m, (k, cols), 2, 4, jnp.bfloat16)
      bm = max(16, 1 << (m - 1).bit_length())
      configs = [] if args.mma_only else [("default", default)]
      if args.sweep and m == args.rows[0] and not args.mma_only:
        configs += [
            (f"bn{bn} bg{bg} w{wa} st{st} sp{sp}",
             NMMatmulConfig(block_m=bm, block_n=bn, block_groups=bg, num_warps=wa, num_stages=st, split_k=sp))
            for bn, bg, wa, st, sp in NM_TILINGS[cols]
        ]
      for label, cfg in configs:
        f = lambda x, w, cfg=cfg: nm_kernels.forward(x, w, config=cfg)
        _variant_row(f"{m}x{cols} {label}", cfg, f, x, w0, ws, ref, (d_hot, d_hbm), nbytes, args.iterations, rows)
      if cuda_kernels.available():
        sparse = [("mma.sp default", cuda_kernels.Nm24DecodeConfig.get_default(m, k, cols))]
        if args.sweep:
          sparse += [
              (f"mma.sp split {sp} warps {wa} span {sn}", cuda_kernels.Nm24DecodeConfig(sp, wa, sn))
              for sp, wa, sn in NM24_SWEEP
              if sn == 64 or m <= 16
          ]
        for label, cfg in sparse:
          f = lambda x, w, cfg=cfg: cuda_kernels.nm24_decode(x, w.values, w.indices, config=cfg)
          _variant_row(f"{m}x{cols} {label}", cfg, f, x, w0, ws, ref, (d_hot, d_hbm), nbytes, args.iterations, rows)
      else:
        log(f"CUDA kernels unavailable: {cuda_kernels.unavailable_reason()}")
      f = lambda x, w: ops.nm_matmul(x, w)
      picked = "mma.sp" if "nm24_decode" in jax.jit(f).lower(x, w0).as_text() else "Pallas / XLA"
      _variant_row(f"{m}x{cols} nm_matmul", picked, f, x, w0, ws, ref, (d_hot, d_hbm), nbytes, args.iterations, rows)
    del dense, ws


def memory_rate(iterations: int) -> str:
  """Device-to-device rate of a 512 MiB bf16 ``a * 2`` (bytes read + written over time)."""
  a = _bf16(1, (16384, 16384))
  t = time_ms(lambda a: a * 2, a, iterations=iterations)
  return f"HBM rate (bf16 a * 2, 512 MiB read + 512 MiB written): {2 * a.size * 2 / t / 1e9:.2f} TB/s"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sweep", action="store_true", help="time tile variants besides the default")
  p.add_argument("--quick", action="store_true", help="N:M at M = 16 only")
  p.add_argument("--skip-block-sparse", action="store_true")
  p.add_argument("--skip-nm", action="store_true")
  p.add_argument("--rows", type=lambda v: [int(r) for r in v.split(",")], default=list(NM_ROWS),
                 help="N:M: comma-separated M values (the mma.sp kernel takes M <= 32)")
  p.add_argument("--nm-cols", type=lambda v: [int(c) for c in v.split(",")], default=list(NM_COLS),
                 help="N:M: comma-separated N values")
  p.add_argument("--nm-k", type=int, default=K, help="N:M: K")
  p.add_argument("--mma-only", action="store_true", help="N:M: time only the sparse tensor-core kernel and nm_matmul")
  p.add_argument("--iterations", type=int, default=50)
  p.add_argument("--bs-rows", type=lambda v: [int(r) for r in v.split(",")], default=[BS_M], help="block-sparse: M")
  p.add_argument("--bs-blocks", type=lambda v: [int(r) for r in v.split(",")], default=list(BS_BLOCKS),
                 help="block-sparse: square block sizes")
  p.add_argument("--bs-densities", type=lambda v: [float(r) for r in v.split(",")], default=[BS_DENSITY],
                 help="block-sparse: densities")
  p.add_argument("--out", help="also write the table to this file")
  args = p.parse_args(argv)
  log(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  head = [
      "| case | config | rel err | hot µs | hot ratio | HBM µs | HBM ratio | weight GB/s (HBM) | weights rotated |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  rows = [memory_rate(args.iterations), ""]
  if not args.skip_block_sparse:
    rows += head
    block_sparse(args, rows)
    rows.append("")
  if not args.skip_nm:
    rows += head
    nm(args, rows)
  text = "\n".join(rows)
  print("\n" + text, flush=True)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  sys.exit(main())
