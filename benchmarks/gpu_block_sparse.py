"""Block-sparse ``x @ W`` on a GPU: the Pallas kernels against dense ``jnp.dot`` and torch's BSR kernel.

Run on a CUDA GPU (``benchmarks/run_gpu.sh`` runs it on the device machine):

  python benchmarks/gpu_block_sparse.py --sweep --table --torch --out results.md

* ``--sweep`` times several tile configs per kernel and block size at M=8192, K=N=4096, density 0.25
  (and the split of the block loop at decode, M=16), and uses the fastest for the table.
* ``--table`` prints, per case, the sparse time, the dense time of the same product measured in the
  same run, and their ratio, for the forward, the backward (dX + dW) and both; bf16 throughout.
* ``--torch`` adds ``torch.sparse._triton_ops.bsr_dense_mm`` (forward only) against ``torch.mm``.
* ``--mosaic-sweep`` times Mosaic GPU (Hopper) forward / dX variants against the Triton kernels at
  M=8192, density 0.25, blocks 64 and 128, and the Mosaic forward at decode (M=16).
* ``--group-cols-sweep`` times the Mosaic kernel's grouped-column tiles (``group_cols`` 1-8) for blocks 32
  and 64 at M=8192, densities 0.25 and 0.5 (or ``--ms`` / ``--ns`` / ``--blocks`` / ``--densities``), forward
  and dX, against the default route and dense; its log splits each call into the kernel and the small
  kernels around it (the step lists).

On Hopper the default configs run the forward and dX of blocks 64 / 128 at M >= 1024 on the Mosaic GPU
kernel; the table's "Triton-only" column times the same products with the Triton kernels.

The decode rows here multiply by one weight per call, which then stays in L2 ("hot");
``benchmarks/sweeps/gpu_decode.py`` times decode both that way and with the weights read from HBM.

Times are device-side: ``jax.experimental.mosaic.gpu.profiler.measure`` (CUPTI) sums the kernel
times of each call; the median over ``--iterations`` calls is reported. Where CUPTI is unavailable
the script falls back to back-to-back calls timed from the host (and says so).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
from _gpu_timing import TIMER
from _gpu_timing import kernel_split_ms
from _gpu_timing import log
from _gpu_timing import rel_err
from _gpu_timing import time_ms

import jaxsparse
from jaxsparse.pallas import BlockSparseMatmulConfig
from jaxsparse.pallas import KernelConfig
from jaxsparse.pallas import _block_sparse_matmul as kernels
from jaxsparse.pallas import _block_sparse_matmul_mgpu as mosaic
from jaxsparse.pallas._block_sparse_config import mosaic_available

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

SHAPES = [(4096, 4096), (4096, 16384)]
BLOCKS = [32, 64, 128]
DENSITIES = [0.5, 0.25, 0.125]
M_TRAIN, M_DECODE = 8192, 16
SWEEP_SHAPE = (4096, 4096)


# -------------------------------------------------------------------------------------------------
# Timing.
# -------------------------------------------------------------------------------------------------


# -------------------------------------------------------------------------------------------------
# Problems.
# -------------------------------------------------------------------------------------------------


def block_mask(k: int, n: int, b: int, density: float, seed: int, bn: int | None = None) -> np.ndarray:
  """Exactly ``round(density * blocks)`` kept blocks of ``(b, bn or b)``, uniformly at random."""
  kb, nb = k // b, n // (bn or b)
  keep = max(1, round(density * kb * nb))
  flat = np.zeros(kb * nb, bool)
  flat[np.random.default_rng(seed).permutation(kb * nb)[:keep]] = True
  return flat.reshape(kb, nb)


def problem(m, k, n, b, density, seed=0, dtype=jnp.bfloat16):
  """``x (m, k)``, ``dY (m, n)``, a ``(k, n)`` weight of ``b`` (an int: square; or ``(bk, bn)``) blocks and its mask."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  bk, bn = (b, b) if isinstance(b, int) else b
  mask = block_mask(k, n, bk, density, seed, bn=bn)
  w = jaxsparse.BlockSparseMatrix.from_dense(
      jax.random.normal(k1, (k, n), jnp.float32).astype(dtype), (bk, bn), block_mask=mask
  )
  x = jax.random.normal(k2, (m, k), jnp.float32).astype(dtype)
  dy = jax.random.normal(k3, (m, n), jnp.float32).astype(dtype)
  return x, dy, w, mask


def sparse_fns(cfg):
  fwd = lambda x, dy, w: kernels.forward(x, w, config=cfg)
  bwd = lambda x, dy, w: kernels.backward(x, dy, w, config=cfg)
  both = lambda x, dy, w: (fwd(x, dy, w), bwd(x, dy, w))
  return {"fwd": fwd, "bwd": bwd, "fwd+bwd": both}


def dense_fns():
  def fwd(x, dy, wd):
    return jnp.dot(x, wd)

  def bwd(x, dy, wd):
    _, vjp = jax.vjp(jnp.dot, x, wd)
    return vjp(dy)

  def both(x, dy, wd):
    y, vjp = jax.vjp(jnp.dot, x, wd)
    return y, vjp(dy)

  return {"fwd": fwd, "bwd": bwd, "fwd+bwd": both}


def check(x, dy, w, cfg) -> str:
  """Relative errors of y, dX, dW against dense float32 products on the device."""
  hi = jax.lax.Precision.HIGHEST
  f32 = lambda a: a.astype(jnp.float32)
  wd = f32(w.to_dense())
  y = kernels.forward(x, w, config=cfg)
  dx, ddata = kernels.backward(x, dy, w, config=cfg)
  y_ref = jnp.dot(f32(x), wd, precision=hi)
  dx_ref = jnp.dot(f32(dy), wd.T, precision=hi)
  bk, bn = w.block_shape
  dw_ref = jnp.dot(f32(x).T, f32(dy), precision=hi)
  kb, nb = w.grid_shape
  ddata_ref = dw_ref.reshape(kb, bk, nb, bn).transpose(0, 2, 1, 3)[w.row_indices, w.col_indices]
  return f"y {rel_err(y, y_ref):.1e} dX {rel_err(dx, dx_ref):.1e} dW {rel_err(ddata, ddata_ref):.1e}"


def breakdown(iterations: int) -> list[str]:
  """Per-kernel device times (CUPTI) of the sparse products for a few cases: where the time goes."""
  from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415

  lines = []
  cases = [(16, 4096, 4096, 128), (16, 4096, 16384, 64), (M_TRAIN, 4096, 4096, 128), (M_TRAIN, 4096, 4096, 64)]
  for m, k, n, b in cases:
    x, dy, w, _ = problem(m, k, n, b, 0.25, seed=b)
    for name, f in sparse_fns(None).items():
      f = jax.jit(f)
      jax.block_until_ready(f(x, dy, w))
      _, per_kernel = profiler.measure(f, aggregate=False, iterations=iterations)(x, dy, w)
      summary = ", ".join(f"{kname[:40]} {statistics.median(r[i][1] for r in per_kernel) * 1e3:.1f}us"
                          for i, (kname, _) in enumerate(per_kernel[0]))
      lines.append(f"{m}x{k}x{n} b={b} {name}: {summary}")
      log(lines[-1])
  return lines


# -------------------------------------------------------------------------------------------------
# Tile sweep.
# -------------------------------------------------------------------------------------------------

ROW_VARIANTS = [
    KernelConfig(bm, num_warps=wp, num_stages=st, index_window=iw)
    for iw in (True, False)
    for bm in (64, 128, 256)
    for wp in (4, 8)
    for st in (2, 3, 4, 5)
] + [KernelConfig(bm, num_warps=wp, num_stages=3, group_m=g) for bm in (128, 256) for wp in (4, 8) for g in (4, 16, 64)]
DW_VARIANTS = [
    KernelConfig(bm, num_warps=wp, num_stages=st) for bm in (32, 64, 128) for wp in (4, 8) for st in (2, 3, 4, 5)
]
DECODE_VARIANTS = [
    KernelConfig(16, num_warps=4, num_stages=st, split=sp, index_window=iw)
    for iw in (True, False)
    for sp in (4, 8)
    for st in (2, 3, 4)
]


def fits_smem(kind: str, v: KernelConfig, b: int, itemsize: int = 2, limit: int = 200 * 1024) -> bool:
  """Whether the pipelined operand tiles plausibly fit in an H100/H200 SM's shared memory."""
  per_stage = (v.block_m * b + b * b) if kind != "dw" else v.block_m * 2 * b
  return v.num_stages * per_stage * itemsize <= limit


def sweep(iterations: int) -> tuple[dict[int, BlockSparseMatmulConfig], dict[int, KernelConfig], list[str]]:
  """Fastest config per kernel and block size; returns (training configs, decode configs, log lines)."""
  lines, best, best_decode = [], {}, {}
  for b in BLOCKS:
    x, dy, w, _ = problem(M_TRAIN, *SWEEP_SHAPE, b, 0.25, seed=b)
    default = BlockSparseMatmulConfig.get_default(M_TRAIN, w.shape, w.block_shape, w.nnz_blocks, w.dtype)
    chosen = {}
    for kind, variants in (("forward", ROW_VARIANTS), ("dx", ROW_VARIANTS), ("dw", DW_VARIANTS)):
      results = []
      for v in [getattr(default, kind), *(v for v in variants if fits_smem(kind, v, b))]:
        cfg = dataclasses.replace(default, **{kind: v})
        f = {
            "forward": lambda x, dy, w, cfg=cfg: kernels.forward(x, w, config=cfg),
            "dx": lambda x, dy, w, cfg=cfg: kernels.backward(x, dy, w, config=cfg, need_dw=False)[0],
            "dw": lambda x, dy, w, cfg=cfg: kernels.backward(x, dy, w, config=cfg, need_dx=False)[1],
        }[kind]
        try:
          t = time_ms(f, x, dy, w, iterations=iterations)
        except Exception as e:
          lines.append(f"b={b} {kind} {v}: FAILED {type(e).__name__}: {str(e)[:200]}")
          log(lines[-1])
          continue
        results.append((t, v))
        lines.append(f"b={b} {kind} {v}: {t:.4f} ms")
        log(lines[-1])
      t, v = min(results, key=lambda r: r[0])
      chosen[kind] = v
      lines.append(f"b={b} {kind} BEST {t:.4f} ms {v}")
      log(lines[-1])
    best[b] = BlockSparseMatmulConfig(**chosen)

    x, dy, w, _ = problem(M_DECODE, *SWEEP_SHAPE, b, 0.25, seed=b)
    default = BlockSparseMatmulConfig.get_default(M_DECODE, w.shape, w.block_shape, w.nnz_blocks, w.dtype)
    results = []
    for v in [default.forward, *DECODE_VARIANTS]:
      cfg = dataclasses.replace(default, forward=v)
      try:
        t = time_ms(lambda x, w, cfg=cfg: kernels.forward(x, w, config=cfg), x, w, iterations=iterations)
      except Exception as e:
        lines.append(f"b={b} decode {v}: FAILED {type(e).__name__}: {str(e)[:200]}")
        log(lines[-1])
        continue
      results.append((t, v))
      lines.append(f"b={b} decode {v}: {t:.4f} ms")
      log(lines[-1])
    t, v = min(results, key=lambda r: r[0])
    best_decode[b] = v
    lines.append(f"b={b} decode BEST {t:.4f} ms {v}")
    log(lines[-1])
  return best, best_decode, lines


MOSAIC_VARIANTS = [
    {},
    {"group_m": 4},
    {"group_m": 2},
    {"group_m": 1},
    {"num_ctas": 0},
    {"num_ctas": 0, "group_m": 4},
    {"num_stages": 3},
    {"num_stages": 3, "group_m": 4},
    {"tile_m": 128, "num_ctas": 0, "num_stages": 3},
    {"epi_n": 128},
]


def time_mosaic(a, w, cfg, kind: str, ref, iterations: int):
  """``(ms, rel err, f)`` of the Mosaic kernel's ``kind`` product with ``cfg`` (``"fwd"``: ``a @ W``, ``"dx"``:
  ``a @ Wᵀ``; ``f`` is the timed function). Raises where the kernel cannot compile or run this config."""
  f = lambda a, w: mosaic.dense_sparse_matmul(a, w, transpose=kind == "dx", config=cfg)
  err = rel_err(jax.jit(f)(a, w), ref)
  return time_ms(f, a, w, iterations=iterations), err, f


def mosaic_sweep(iterations: int, blocks=(128, 64), shapes=((4096, 4096), (4096, 16384))) -> list[str]:
  """Mosaic GPU forward / dX variants against the Triton kernels at M=8192, d=0.25 (and one decode case)."""
  lines = []

  def note(line):
    lines.append(line)
    log(line)

  m = M_TRAIN
  for shape in shapes:
    x, dy, _, _ = problem(m, *shape, 32, 1.0)
    wd = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(jnp.bfloat16)
    t_dense = time_ms(lambda x, wd: jnp.dot(x, wd), x, wd, iterations=iterations)
    note(f"{m}x{shape}: dense fwd {t_dense:.4f} ms")
    variants = MOSAIC_VARIANTS if shape == SWEEP_SHAPE else MOSAIC_VARIANTS[:2]
    for b in blocks:
      x, dy, w, _ = problem(m, *shape, b, 0.25, seed=b)
      hi = jax.lax.Precision.HIGHEST
      wf = w.to_dense().astype(jnp.float32)
      y_ref = jnp.dot(x.astype(jnp.float32), wf, precision=hi)
      dx_ref = jnp.dot(dy.astype(jnp.float32), wf.T, precision=hi)
      no_mosaic = dataclasses.replace(
          BlockSparseMatmulConfig.get_default(m, w.shape, w.block_shape, w.nnz_blocks, w.dtype),
          mosaic_forward=None,
          mosaic_dx=None,
      )
      tri_fwd = lambda x, w, c=no_mosaic: kernels.forward(x, w, config=c)
      tri_dx = lambda dy, x, w, c=no_mosaic: kernels.backward(x, dy, w, config=c, need_dw=False)[0]
      t_tri = time_ms(tri_fwd, x, w, iterations=iterations)
      t_tri_dx = time_ms(tri_dx, dy, x, w, iterations=iterations)
      note(f"{shape} b={b} triton fwd {t_tri:.4f} ms ({t_tri / t_dense:.2f}) dx {t_tri_dx:.4f} ms")
      base = mosaic.MosaicBlockSparseMatmulConfig.get_default(m, w.block_shape, x.dtype)
      for kind, a, ref in (("fwd", x, y_ref), ("dx", dy, dx_ref)):
        for change in variants:
          cfg = dataclasses.replace(base.forward if kind == "fwd" else base.dx, **change)
          try:
            t, err, _ = time_mosaic(a, w, cfg, kind, ref, iterations)
          except Exception as e:
            note(f"{shape} b={b} mosaic {kind} {change}: FAILED {type(e).__name__}: {str(e)[:400]}")
            continue
          note(f"{shape} b={b} mosaic {kind} {t:.4f} ms ({t / t_dense:.2f}) err {err:.1e} {change}")
  # Decode: one row tile; the Triton kernels split each column's block loop instead.
  for b in blocks:
    x, _, w, _ = problem(M_DECODE, *SWEEP_SHAPE, b, 0.25, seed=b)
    t_tri = time_ms(lambda x, w: kernels.forward(x, w), x, w, iterations=iterations)
    t_mos = time_ms(lambda x, w: mosaic.dense_sparse_matmul(x, w), x, w, iterations=iterations)
    note(f"decode {M_DECODE}x{SWEEP_SHAPE} b={b}: triton fwd {t_tri:.4f} ms, mosaic fwd {t_mos:.4f} ms")
  return lines


def group_cols_sweep(
    iterations: int, dtype, shapes=(SWEEP_SHAPE,), blocks=(32, 64), densities=(0.25, 0.5), ms=(M_TRAIN,)
):
  """Grouped-column tiles of the Mosaic kernel (``MosaicKernelConfig.group_cols``) at each M of ``ms``.

  Per block size, density and product (forward, dX): the default route's time and the Mosaic kernel's with
  ``group_cols`` 1, 2, 4, 8 (the largest row tile whose accumulators fit), as ratios to the dense product of
  the same run. The timed call includes building the step lists (``steps_of``), as a layer's call would.
  """
  lines, table_rows = [], []

  def note(line):
    lines.append(line)
    log(line)

  for m, shape in itertools.product(ms, shapes):
    x, dy, _, _ = problem(m, *shape, 32, 1.0, dtype=dtype)
    wd = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(dtype)
    t_dense = {
        "fwd": time_ms(lambda x, wd: jnp.dot(x, wd), x, wd, iterations=iterations),
        "dx": time_ms(lambda dy, wd: jnp.dot(dy, wd.T), dy, wd, iterations=iterations),
    }
    note(f"{dtype.name} {m}x{shape}: dense fwd {t_dense['fwd']:.4f} ms, dx {t_dense['dx']:.4f} ms")
    for b, d in itertools.product(blocks, densities):
      x, dy, w, _ = problem(m, *shape, b, d, seed=b, dtype=dtype)
      hi = jax.lax.Precision.HIGHEST
      wf = w.to_dense().astype(jnp.float32)
      refs = {
          "fwd": (x, jnp.dot(x.astype(jnp.float32), wf, precision=hi)),
          "dx": (dy, jnp.dot(dy.astype(jnp.float32), wf.T, precision=hi)),
      }
      default = BlockSparseMatmulConfig.get_default(m, w.shape, w.block_shape, w.nnz_blocks, w.dtype)
      base = mosaic.MosaicBlockSparseMatmulConfig.get_default(m, w.block_shape, dtype)
      for kind, (a, ref) in refs.items():
        if kind == "fwd":
          f_def = lambda x, w, c=default: kernels.forward(x, w, config=c)
        else:
          f_def = lambda dy, w, x=x, c=default: kernels.backward(x, dy, w, config=c, need_dw=False)[0]
        t_def = time_ms(f_def, a, w, iterations=iterations)
        cells = [f"{t_def / t_dense[kind]:.2f}"]
        for group in (1, 2, 4, 8):
          fit = lambda c, kind=kind, a=a, w=w: mosaic.resolve_config(a, w, None, c, transpose=kind == "dx")
          cfg = fit(dataclasses.replace(base.forward if kind == "fwd" else base.dx, group_cols=group))
          reason = mosaic.unsupported_reason(a, w, None, cfg, transpose=kind == "dx")
          if reason:  # too many accumulators (or too much shared memory) for 256-row tiles: 128 rows
            cfg = fit(dataclasses.replace(cfg, tile_m=128, num_stages=base.forward.num_stages))
            reason = mosaic.unsupported_reason(a, w, None, cfg, transpose=kind == "dx")
          if reason:
            note(f"M={m} {shape} b={b} d={d} {kind} group_cols={group}: not run, {reason}")
            cells.append("-")
            continue
          try:
            t, err, f = time_mosaic(a, w, cfg, kind, ref, iterations)
          except Exception as e:
            note(f"M={m} {shape} b={b} d={d} {kind} group_cols={group}: FAILED {type(e).__name__}: {str(e)[:400]}")
            cells.append("failed")
            continue
          ratio = t / t_dense[kind]
          split = ""
          if TIMER["how"] == "cupti":  # the kernel alone, and what the step lists cost around it
            k_ms, rest_ms, others = kernel_split_ms(f, a, w, iterations=iterations)
            split = f" (kernel {k_ms / t_dense[kind]:.2f}, {others} other kernels {rest_ms * 1e3:.1f} us)"
          case = f"M={m} {shape} b={b} d={d} {kind} group_cols={group}"
          note(f"{case} {t:.4f} ms ({ratio:.2f}){split} err {err:.1e} {cfg}")
          cells.append(f"{ratio:.2f}")
        table_rows.append(f"| {m} | {shape[0]}x{shape[1]} | {b} | {d} | {kind} | " + " | ".join(cells) + " |")
  header = [
      f"group_cols sweep, {dtype.name}, time / dense time:",
      "| M | K x N | block | d | product | default route | G=1 | G=2 | G=4 | G=8 |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for line in header + table_rows:
    note(line)
  return lines


def f32_sweep(iterations: int, blocks=(128, 64, 32), densities=(0.25,), shapes=(SWEEP_SHAPE,)) -> list[str]:
  """Float32 at M=8192: dense f32 (DEFAULT precision = TF32), Triton TF32, Mosaic TF32 variants."""
  lines = []

  def note(line):
    lines.append(line)
    log(line)

  m, dtype = M_TRAIN, jnp.float32
  for shape in shapes:
    x, dy, _, _ = problem(m, *shape, 32, 1.0, dtype=dtype)
    wd = jax.random.normal(jax.random.key(1), shape, jnp.float32)
    t_dense = time_ms(lambda x, wd: jnp.dot(x, wd), x, wd, iterations=iterations)
    note(f"f32 {m}x{shape}: dense fwd {t_dense:.4f} ms")
    for b in blocks:
      for d in densities:
        x, dy, w, _ = problem(m, *shape, b, d, seed=b, dtype=dtype)
        wf = w.to_dense()
        hi = jax.lax.Precision.HIGHEST
        y_ref, dx_ref = jnp.dot(x, wf, precision=hi), jnp.dot(dy, wf.T, precision=hi)
        default = BlockSparseMatmulConfig.get_default(m, w.shape, w.block_shape, w.nnz_blocks, w.dtype)
        tri = dataclasses.replace(default, mosaic_forward=None, mosaic_dx=None)
        t_tri = time_ms(lambda x, w, tri=tri: kernels.forward(x, w, config=tri), x, w, iterations=iterations)
        t_tri_dx = time_ms(lambda dy, x, w, tri=tri: kernels.backward(x, dy, w, config=tri, need_dw=False)[0], dy, x, w,
                           iterations=iterations)
        t_dw = time_ms(lambda dy, x, w, tri=tri: kernels.backward(x, dy, w, config=tri, need_dx=False)[1], dy, x, w,
                       iterations=iterations)
        note(f"f32 {shape} b={b} d={d} triton fwd {t_tri:.4f} ({t_tri / t_dense:.2f}) dx {t_tri_dx:.4f} "
             f"({t_tri_dx / t_dense:.2f}) dw {t_dw:.4f} ({t_dw / t_dense:.2f})")
        base = mosaic.MosaicBlockSparseMatmulConfig.get_default(m, w.block_shape, dtype)
        variants = [{}, {"group_m": 2}] if b == 128 else [{}]
        for kind, a, ref in (("fwd", x, y_ref), ("dx", dy, dx_ref)):
          for change in variants:
            cfg = dataclasses.replace(base.forward if kind == "fwd" else base.dx, **change)
            try:
              t, err, _ = time_mosaic(a, w, cfg, kind, ref, iterations)
            except Exception as e:
              note(f"f32 {shape} b={b} d={d} mosaic {kind} {change}: FAILED {type(e).__name__}: {str(e)[:400]}")
              continue
            note(f"f32 {shape} b={b} d={d} mosaic {kind} {t:.4f} ms ({t / t_dense:.2f}) err {err:.1e} {change} {cfg}")
  return lines


def dw_sweep(
    iterations: int, block_shapes=((128, 128), (64, 64), (32, 32)), shapes=(SWEEP_SHAPE,), dtype=jnp.bfloat16
) -> list[str]:
  """Sampled xᵀdY at M=8192, d=0.25: Mosaic variants against the Triton SDD kernel, the dense
  product plus a gather, and the dense xᵀdY alone."""
  from jaxsparse.pallas import _block_sparse_sdd_mgpu as sdd  # noqa: PLC0415

  lines = []

  def note(line):
    lines.append(line)
    log(line)

  m = M_TRAIN
  name = jnp.dtype(dtype).name
  for shape in shapes:
    x, dy, _, _ = problem(m, *shape, 32, 1.0, dtype=dtype)
    t_dense = time_ms(lambda x, dy: jnp.dot(x.T, dy), x, dy, iterations=iterations)
    note(f"dw {name} {m}x{shape}: dense xᵀdY {t_dense:.4f} ms")
    for bs in block_shapes:
      k1 = jax.random.key(bs[1])
      mask = np.random.default_rng(bs[0] + bs[1]).random((shape[0] // bs[0], shape[1] // bs[1])) < 0.25
      w = jaxsparse.BlockSparseMatrix.from_dense(
          jax.random.normal(k1, shape, jnp.float32).astype(dtype), bs, block_mask=mask
      )
      default = BlockSparseMatmulConfig.get_default(m, w.shape, w.block_shape, w.nnz_blocks, w.dtype)
      tri = dataclasses.replace(default, mosaic_dw=None, dw_dense=False)
      gathered = dataclasses.replace(default, mosaic_dw=None, dw_dense=True)
      f_tri = lambda x, dy, w, tri=tri: kernels.backward(x, dy, w, config=tri, need_dx=False)[1]
      f_gather = lambda x, dy, w, c=gathered: kernels.backward(x, dy, w, config=c, need_dx=False)[1]
      ref = f_tri(x, dy, w)
      t_tri = time_ms(f_tri, x, dy, w, iterations=iterations)
      t_gather = time_ms(f_gather, x, dy, w, iterations=iterations)
      err = rel_err(jax.jit(f_gather)(x, dy, w), ref)
      note(f"dw {name} {shape} {bs} triton {t_tri:.4f} ms ({t_tri / t_dense:.2f}) dense+gather {t_gather:.4f} "
           f"({t_gather / t_dense:.2f}, err vs triton {err:.1e}) default {default.mosaic_dw} dense={default.dw_dense}")
      if not sdd.supports(x, dy, w):
        continue
      base = sdd.MosaicSddConfig.get_default(bs, dtype)
      itemsize = jnp.dtype(dtype).itemsize
      variants = [base]
      for g in (2, 4, 8):
        for tm in (32,) if itemsize == 4 else (64, 128):
          for st in (4, 3, 2):
            v = sdd.MosaicSddConfig(group=g, tile_m=tm, num_stages=st)
            if g // 2 * bs[0] * bs[1] <= 128 * 128 and v.smem_bytes(bs, itemsize) <= 227 * 1024 and v != base:
              variants.append(v)
              break
      if shape != SWEEP_SHAPE:
        variants = variants[:1]
      for v in variants:
        f = lambda x, dy, w, v=v: sdd.sampled_dw(x, dy, w, config=v)
        try:
          err = rel_err(jax.jit(f)(x, dy, w), ref)
          t = time_ms(f, x, dy, w, iterations=iterations)
        except Exception as e:
          note(f"dw {name} {shape} {bs} mosaic {v}: FAILED {type(e).__name__}: {str(e)[:400]}")
          continue
        note(f"dw {name} {shape} {bs} mosaic {t:.4f} ms ({t / t_dense:.2f}) err vs triton {err:.1e} {v}")
  return lines


def decode_sweep(iterations: int) -> list[str]:
  """Forward at decode sizes (M = 16, 64): Triton split variants and the Mosaic kernel, d=0.25."""
  lines = []

  def note(line):
    lines.append(line)
    log(line)

  for m in (16,):
    for shape in (SWEEP_SHAPE,):
      x, _, _, _ = problem(m, *shape, 32, 1.0)
      wd = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(jnp.bfloat16)
      t_dense = time_ms(lambda x, wd: jnp.dot(x, wd), x, wd, iterations=iterations)
      note(f"decode {m}x{shape}: dense {t_dense:.4f} ms")
      for b in (128, 64):
        x, _, w, _ = problem(m, *shape, b, 0.25, seed=b)
        default = BlockSparseMatmulConfig.get_default(m, w.shape, w.block_shape, w.nnz_blocks, w.dtype)
        for change in ({}, {"split": 1}, {"split": 2}, {"split": 8}, {"num_stages": 2}):
          cfg = dataclasses.replace(default, forward=dataclasses.replace(default.forward, **change))
          try:
            t = time_ms(lambda x, w, cfg=cfg: kernels.forward(x, w, config=cfg), x, w, iterations=iterations)
          except Exception as e:
            note(f"decode {m}x{shape} b={b} {change}: FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
          note(f"decode {m}x{shape} b={b} triton {t:.4f} ms ({t / t_dense:.2f}) {change} -> {cfg.forward}")
        cfg = mosaic.MosaicKernelConfig(tile_m=128, num_ctas=0, num_stages=3, group_m=1)
        t = time_ms(lambda x, w, cfg=cfg: mosaic.dense_sparse_matmul(x, w, config=cfg), x, w, iterations=iterations)
        note(f"decode {m}x{shape} b={b} mosaic plain grid {t:.4f} ms ({t / t_dense:.2f})")
  return lines


def mid_sweep(iterations: int, ms=(256, 512)) -> list[str]:
  """Forward and backward at mid-size M (K = N = 4096, blocks of ``--blocks``, d = 0.25 and 0.5): Triton row
  tiles without a split, and the Mosaic kernel with 128 / 256-row tiles, against the default config."""
  lines = []

  def note(line):
    lines.append(line)
    log(line)

  k, n = SWEEP_SHAPE
  for m in ms:
    x, dy, _, _ = problem(m, k, n, 32, 1.0)
    wd = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(jnp.bfloat16)
    dense = {s: time_ms(dense_fns()[s], x, dy, wd, iterations=iterations) for s in ("fwd", "bwd")}
    note(f"mid {m}x{k}x{n}: dense fwd {dense['fwd']:.4f} ms bwd {dense['bwd']:.4f} ms")
    for b, d in itertools.product(BLOCKS, (0.25, 0.5)):
      x, dy, w, _ = problem(m, k, n, b, d, seed=b)
      y_ref = jnp.dot(x.astype(jnp.float32), w.to_dense().astype(jnp.float32))
      default = BlockSparseMatmulConfig.get_default(m, w.shape, w.block_shape, w.nnz_blocks, w.dtype)
      plain = dict(mosaic_forward=None, mosaic_dx=None)
      variants = {"default": default}
      for bm in (32, 64, 128):
        tri = KernelConfig(bm, num_warps=4 if bm * b < 128 * 128 else 8, num_stages=3)
        variants[f"triton bm{bm}"] = dataclasses.replace(default, forward=tri, dx=tri, **plain)
      if mosaic_available():
        for tm, ctas in ((128, None), (256, None), (128, 0)):
          mc = mosaic.MosaicKernelConfig(tile_m=tm, tile_k=min(64, b), num_ctas=ctas, group_m=2)
          variants[f"mosaic tm{tm} ctas{ctas}"] = dataclasses.replace(default, mosaic_forward=mc, mosaic_dx=mc)
      for name, cfg in variants.items():
        try:
          err = rel_err(kernels.forward(x, w, config=cfg), y_ref)
          t = {s: time_ms(sparse_fns(cfg)[s], x, dy, w, iterations=iterations) for s in ("fwd", "bwd")}
        except Exception as e:
          note(f"mid {m} b={b} d={d} {name}: FAILED {type(e).__name__}: {str(e)[:200]}")
          continue
        note(
            f"mid {m} b={b} d={d} {name}: fwd {t['fwd']:.4f} ms ({t['fwd'] / dense['fwd']:.2f}) "
            f"bwd {t['bwd']:.4f} ms ({t['bwd'] / dense['bwd']:.2f}) err {err:.1e}"
        )
  return lines


# -------------------------------------------------------------------------------------------------
# torch BSR.
# -------------------------------------------------------------------------------------------------


def torch_ratios(cases) -> dict[tuple, tuple[float, float]]:
  """``{(m, k, n, b, d): (bsr ms, dense ms)}`` for ``y = x @ W`` computed as ``Wᵀ xᵀ`` by torch."""
  out = {}
  try:
    import torch  # noqa: PLC0415
    import triton.testing  # noqa: PLC0415
    from torch.sparse._triton_ops import bsr_dense_mm  # noqa: PLC0415
  except Exception as e:
    log(f"torch BSR unavailable: {type(e).__name__}: {e}")
    return out
  dense_cache = {}
  for m, k, n, b, d in cases:
    try:
      g = torch.Generator(device="cuda").manual_seed(0)
      mask = torch.from_numpy(block_mask(k, n, b, d, seed=b)).cuda()
      full = mask.repeat_interleave(b, 0).repeat_interleave(b, 1)
      wt = (torch.randn(k, n, device="cuda", generator=g, dtype=torch.bfloat16) * full).T.contiguous()
      xt = torch.randn(k, m, device="cuda", generator=g, dtype=torch.bfloat16)
      bsr = wt.to_sparse_bsr((b, b))
      bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
      t_bsr = bench(lambda bsr=bsr, xt=xt: bsr_dense_mm(bsr, xt))
      if (m, k, n) not in dense_cache:
        dense_cache[(m, k, n)] = bench(lambda wt=wt, xt=xt: wt @ xt)
      out[(m, k, n, b, d)] = (t_bsr, dense_cache[(m, k, n)])
      log(f"torch {m}x{k}x{n} b={b} d={d}: bsr {t_bsr:.4f} ms dense {dense_cache[(m, k, n)]:.4f} ms")
    except Exception as e:
      log(f"torch {m}x{k}x{n} b={b} d={d}: FAILED {type(e).__name__}: {str(e)[:200]}")
  torch.cuda.empty_cache()
  return out


# -------------------------------------------------------------------------------------------------
# Table.
# -------------------------------------------------------------------------------------------------


# Issue 12's op targets (time / dense time, M = 8192, K = 4096, forward and forward+backward) by block and density.
TARGETS = {(128, 0.25): 0.32, (64, 0.25): 0.36, (32, 0.25): 0.50, (128, 0.5): 0.62, (64, 0.5): 0.65, (32, 0.5): 0.80}


def target(b: int, d: float) -> str:
  return f"{TARGETS[b, d]:.2f}" if (b, d) in TARGETS else "-"


def table(
    best, best_decode, torch_res, iterations: int, quick: bool, dtype=jnp.bfloat16, ms=(M_TRAIN,), decode=True
) -> list[str]:
  rows = [
      "| M | K | N | block | d | fwd sparse / dense ms | fwd ratio | bwd sparse / dense ms | bwd ratio "
      "| fwd+bwd sparse / dense ms | fwd+bwd ratio | target | Triton-only fwd / fwd+bwd ratio | torch BSR fwd ratio "
      "| max rel err |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  shapes = SHAPES[:1] if quick else SHAPES
  for (k, n), m in itertools.product(shapes, ms):
    x, dy, _, _ = problem(m, k, n, 32, 1.0, dtype=dtype)
    wd = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(dtype)
    dense = {name: time_ms(f, x, dy, wd, iterations=iterations) for name, f in dense_fns().items()}
    del wd
    log(f"dense {m}x{k}x{n}: {dense}")
    for b in BLOCKS:
      for d in DENSITIES:
        x, dy, w, _ = problem(m, k, n, b, d, seed=b, dtype=dtype)
        cfg = best.get(b)
        err = check(x, dy, w, cfg)
        sp = {name: time_ms(f, x, dy, w, iterations=iterations) for name, f in sparse_fns(cfg).items()}
        # The same products with the Triton kernels only (the default uses Mosaic GPU on Hopper).
        used = cfg or BlockSparseMatmulConfig.get_default(m, w.shape, w.block_shape, w.nnz_blocks, w.dtype)
        tri = "-"
        if used.mosaic_forward is not None or used.mosaic_dx is not None or used.mosaic_dw is not None:
          tri_fns = sparse_fns(dataclasses.replace(used, mosaic_forward=None, mosaic_dx=None, mosaic_dw=None))
          t_tri = {s: time_ms(tri_fns[s], x, dy, w, iterations=iterations) for s in ("fwd", "fwd+bwd")}
          tri = f"{t_tri['fwd'] / dense['fwd']:.2f} / {t_tri['fwd+bwd'] / dense['fwd+bwd']:.2f}"
        tr = torch_res.get((m, k, n, b, d))
        trs = f"{tr[0] / tr[1]:.2f}" if tr else "-"
        cells = " | ".join(
            f"{sp[s]:.3f} / {dense[s]:.3f} | **{sp[s] / dense[s]:.2f}**" for s in ("fwd", "bwd", "fwd+bwd")
        )
        rows.append(f"| {m} | {k} | {n} | {b} | {d} | {cells} | {target(b, d)} | {tri} | {trs} | {err} |")
        log(rows[-1])
  if not decode:
    return rows
  rows += [
      "",
      "| decode M | K | N | block | d | fwd sparse / dense ms | fwd ratio | target | torch BSR fwd ratio | rel err y |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for k, n in shapes:
    m = M_DECODE
    x, dy, _, _ = problem(m, k, n, 32, 1.0, dtype=dtype)
    wd = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(dtype)
    t_dense = time_ms(dense_fns()["fwd"], x, dy, wd, iterations=iterations)
    for b in BLOCKS:
      for d in DENSITIES:
        x, dy, w, _ = problem(m, k, n, b, d, seed=b, dtype=dtype)
        cfg = best.get(b)
        if cfg is not None and b in best_decode:
          cfg = dataclasses.replace(cfg, forward=best_decode[b])
        t = time_ms(sparse_fns(cfg)["fwd"], x, dy, w, iterations=iterations)
        y_ref = jnp.dot(x.astype(jnp.float32), w.to_dense().astype(jnp.float32))
        y_err = rel_err(kernels.forward(x, w, config=cfg), y_ref)
        tr = torch_res.get((m, k, n, b, d))
        trs = f"{tr[0] / tr[1]:.2f}" if tr else "-"
        tgt = "0.50" if d == 0.25 else "-"
        rows.append(
            f"| {m} | {k} | {n} | {b} | {d} | {t:.4f} / {t_dense:.4f} | **{t / t_dense:.2f}** | {tgt} | {trs} "
            f"| {y_err:.1e} |"
        )
        log(rows[-1])
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sweep", action="store_true", help="tune tile configs first and use the fastest")
  p.add_argument("--table", action="store_true", help="print the benchmark table")
  p.add_argument("--torch", action="store_true", help="also time torch's BSR kernel")
  p.add_argument("--quick", action="store_true", help="only K = N = 4096")
  p.add_argument("--breakdown", action="store_true", help="per-kernel times of a few cases first")
  p.add_argument("--mosaic-sweep", action="store_true", help="time Mosaic GPU kernel variants first")
  p.add_argument("--iterations", type=int, default=20)
  p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                 help="input dtype of the table (float32: dense and sparse at DEFAULT precision, i.e. TF32)")
  p.add_argument("--densities", default=None, help="comma-separated densities of the table (default 0.5,0.25,0.125)")
  p.add_argument("--blocks", default=None, help="comma-separated block sizes of the table (default 32,64,128)")
  p.add_argument("--ns", default=None, help="comma-separated N of the table, K = 4096 (default 4096,16384)")
  p.add_argument("--f32-sweep", action="store_true", help="time float32 Mosaic (TF32) against Triton first")
  p.add_argument("--group-cols-sweep", action="store_true",
                 help="time the Mosaic kernel's grouped-column tiles first (with --dtype, --ns, --ms, --blocks, "
                 "--densities)")
  p.add_argument("--dw-sweep", action="store_true", help="time Mosaic sampled xᵀdY variants against Triton first")
  p.add_argument("--decode-sweep", action="store_true", help="time decode (M <= 64) variants first")
  p.add_argument("--mid-sweep", default=None, help="comma-separated mid-size M: time row-tile variants first")
  p.add_argument("--ms", default=None, help=f"comma-separated M of the table (default {M_TRAIN})")
  p.add_argument("--skip-decode", action="store_true", help="no decode rows in the table")
  p.add_argument("--out", default=None, help="also write the table (markdown) here")
  args = p.parse_args(argv)

  dev = jax.devices()[0]
  header = [
      f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
      f"compute capability {getattr(dev, 'compute_capability', '?')}",
  ]
  log(header[0])
  if not kernels.available():
    sys.exit(f"the Pallas kernels cannot run here: {kernels.unavailable_reason()}")
  best, best_decode, sweep_lines = {}, {}, []
  if args.breakdown:
    sweep_lines += breakdown(args.iterations)
  if args.densities:
    DENSITIES[:] = [float(v) for v in args.densities.split(",")]
  if args.blocks:
    BLOCKS[:] = [int(v) for v in args.blocks.split(",")]
  if args.ns:
    SHAPES[:] = [(4096, int(v)) for v in args.ns.split(",")]
  if args.mosaic_sweep:
    sweep_lines += mosaic_sweep(args.iterations)
  if args.f32_sweep:
    sweep_lines += f32_sweep(args.iterations)
  if args.group_cols_sweep:
    sweep_lines += group_cols_sweep(
        args.iterations,
        jnp.dtype(args.dtype),
        shapes=SHAPES if args.ns else (SWEEP_SHAPE,),
        blocks=BLOCKS if args.blocks else (32, 64),
        densities=DENSITIES if args.densities else (0.25, 0.5),
        ms=[int(v) for v in args.ms.split(",")] if args.ms else (M_TRAIN,),
    )
  if args.dw_sweep:
    sweep_lines += dw_sweep(args.iterations, dtype=jnp.dtype(args.dtype))
  if args.decode_sweep:
    sweep_lines += decode_sweep(args.iterations)
  if args.mid_sweep:
    sweep_lines += mid_sweep(args.iterations, [int(v) for v in args.mid_sweep.split(",")])
  t0 = time.time()
  if args.sweep:
    best, best_decode, sweep_lines = sweep(args.iterations)
    log(f"sweep took {time.time() - t0:.0f} s")
  torch_res = {}
  if args.torch:
    shapes = SHAPES[:1] if args.quick else SHAPES
    cases = [(M_TRAIN, k, n, b, d) for k, n in shapes for b in BLOCKS for d in DENSITIES]
    cases += [(M_DECODE, k, n, b, d) for k, n in shapes for b in BLOCKS for d in DENSITIES]
    torch_res = torch_ratios(cases)
  rows = []
  if args.table:
    ms = [int(v) for v in args.ms.split(",")] if args.ms else [M_TRAIN]
    rows = table(
        best, best_decode, torch_res, args.iterations, args.quick, jnp.dtype(args.dtype), ms, not args.skip_decode
    )
  header.append(f"timing: {TIMER['how']}, median of {args.iterations} calls; {args.dtype} inputs, f32 accumulation")
  configs = [f"- block {b}: {best[b]}; decode forward: {best_decode.get(b)}" for b in best]
  text = "\n".join([*header, "", *rows, "", "Configs used (sweep winners; default heuristic where empty):", *configs])
  if args.out:
    with open(args.out, "w") as fh:
      fh.write(text + "\n\n## Sweep log\n\n" + "\n".join(sweep_lines) + "\n")
  log("\n" + text)


if __name__ == "__main__":
  main()
