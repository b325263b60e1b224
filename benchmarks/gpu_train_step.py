"""A full training step of a sparsified Flax model against the dense model, on a GPU.

The case of issue 12: a stack of pre-norm MLP blocks (``d -> hidden -> d``), or of transformer blocks
(``nnx.MultiHeadAttention`` + MLP), on ``(batch, seq, d)`` activations; the MLP's up / down
``nnx.Linear`` layers (and with ``--sparse-attention`` the attention's query / key / value / out
``LinearGeneral`` projections) are replaced by :func:`jaxsparse.sparsify` at ``--density``; one train
step is ``nnx.value_and_grad`` of a squared-error loss plus an ``optax.adamw`` update through
``nnx.Optimizer``. All models run in the same process, timed in interleaved rounds (dense, then each kind,
again and again: the GPU's clocks drift over a run); the table gives the median over rounds of step time /
the dense step time of the same round, and its range.

  python benchmarks/gpu_train_step.py --kinds block128,block64,block32 --precisions bf16,f32
  python benchmarks/gpu_train_step.py --model transformer --sparse-attention --density 0.3
  python benchmarks/gpu_train_step.py --model transformer --attention fused --kinds block64 --density 0.3

``--attention``: the transformer's attention core, ``einsum`` (``nnx.MultiHeadAttention``'s default: the scores,
softmax and values as separate XLA ops, the ``(batch, heads, seq, seq)`` scores through memory) or ``fused``
(:func:`jax.nn.dot_product_attention`, cuDNN's fused attention for 16-bit inputs on a CUDA GPU, XLA's otherwise). The
projections around it are the same (and sparse with ``--sparse-attention``) either way; the dense remainder of the
step, which no sparse layer shortens, differs.

Layer kinds are entries of ``LAYER_KINDS`` (name -> function of the density giving a sparsify rule),
so other structures (N:M kernels, unstructured) add one line each. Precisions: ``bf16`` (bfloat16
parameters and compute) and ``f32`` (Flax's defaults: float32 parameters, ``dtype=None``; XLA's dense
float32 products use TF32 at DEFAULT precision on the GPU, and so do jaxsparse's kernels).

Times are device-side (CUPTI: the sum of the step's kernel times, median of ``--iterations`` steps;
see ``_gpu_timing.py``).
"""

from __future__ import annotations

import argparse
import os
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _gpu_timing import TIMER
from _gpu_timing import log
from _gpu_timing import time_ms
from flax import nnx

import jaxsparse
from jaxsparse.ops import _sr_ste

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

LAYER_KINDS = {
    "dense": lambda d: None,
    "block128": lambda d: jaxsparse.BlockSparse(density=d, block_shape=(128, 128)),
    "block64": lambda d: jaxsparse.BlockSparse(density=d, block_shape=(64, 64)),
    "block32": lambda d: jaxsparse.BlockSparse(density=d, block_shape=(32, 32)),
    "nm2:4": lambda d: jaxsparse.NM(2, 4),
    "nm2:4t": lambda d: jaxsparse.NM(2, 4, transposable=True),  # 2:4 along the outputs too
    "unstructured": lambda d: jaxsparse.Unstructured(sparsity=1.0 - d),
}
PRECISIONS = {"bf16": {"dtype": jnp.bfloat16, "param_dtype": jnp.bfloat16}, "f32": {}}


class MLPBlock(nnx.Module):
  def __init__(self, d: int, hidden: int, *, rngs: nnx.Rngs, **opts):
    self.norm = nnx.LayerNorm(d, rngs=rngs, **opts)
    self.up = nnx.Linear(d, hidden, rngs=rngs, **opts)
    self.down = nnx.Linear(hidden, d, rngs=rngs, **opts)

  def __call__(self, x):
    return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


def fused_attention(query, key, value, mask=None, *, is_causal=False, **_):
  """An ``attention_fn`` for ``nnx.MultiHeadAttention``: :func:`jax.nn.dot_product_attention` (no dropout), cuDNN's
  fused kernel for bfloat16 / float16 on a CUDA GPU, XLA's otherwise. ``query`` ``(batch, seq, heads, head_dim)``,
  ``key`` / ``value`` alike; returns ``query``'s shape and dtype."""
  fused = query.dtype in (jnp.bfloat16, jnp.float16) and jax.default_backend() == "gpu"
  return jax.nn.dot_product_attention(query, key, value, mask=mask, is_causal=is_causal,
                                      implementation="cudnn" if fused else None)


ATTENTION = {"einsum": nnx.dot_product_attention, "fused": fused_attention}


class TransformerBlock(nnx.Module):
  def __init__(self, d: int, hidden: int, heads: int, *, rngs: nnx.Rngs, attention: str = "einsum", **opts):
    self.norm = nnx.LayerNorm(d, rngs=rngs, **opts)
    self.attn = nnx.MultiHeadAttention(heads, d, decode=False, attention_fn=ATTENTION[attention], rngs=rngs, **opts)
    self.mlp = MLPBlock(d, hidden, rngs=rngs, **opts)

  def __call__(self, x):
    h = self.norm(x)
    return self.mlp(x + self.attn(h, h, h))


class Stack(nnx.Module):
  def __init__(self, model: str, depth: int, d: int, hidden: int, heads: int, *, rngs: nnx.Rngs,
               attention: str = "einsum", **opts):
    if model == "mlp":
      self.blocks = nnx.List([MLPBlock(d, hidden, rngs=rngs, **opts) for _ in range(depth)])
    else:
      self.blocks = nnx.List([TransformerBlock(d, hidden, heads, rngs=rngs, attention=attention, **opts)
                              for _ in range(depth)])

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return x


def rules(kind: str, density: float, sparse_attention: bool):
  spec = LAYER_KINDS[kind](density)
  if spec is None:
    return None
  r = {r".*\.(up|down)": spec}
  if sparse_attention:
    r[r".*\.attn\.(query|key|value|out)"] = spec
  r[r".*"] = None
  return r


def breakdown(f, *args, iterations: int = 10) -> str:
  """Device ms of one call of ``f`` per kind of kernel: the sparse kernels (Pallas: Mosaic GPU and
  Triton; cuSPARSELt's sparse GEMMs; our CUDA kernels), dense matrix products (cuBLAS / XLA GEMMs) and
  everything else (fusions, copies): medians over ``iterations`` calls, with the spread of the calls' totals
  and the kernels whose time varies most between calls."""
  from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415 (GPU-only module)

  _, per_call = profiler.measure(jax.jit(f), aggregate=False, iterations=iterations)(*args)
  kinds, names, totals = [], {}, []
  for call in per_call:
    kind = {"sparse": 0.0, "gemm": 0.0, "other": 0.0}
    by_name = {}
    for name, t in call:
      low = name.lower()
      by_name[name[:48]] = by_name.get(name[:48], 0.0) + t
      if any(s in low for s in ("mosaic", "block_sparse", "sampled", "sparse_gemm", "cusparselt", "nm24")):
        kind["sparse"] += t
      elif any(s in low for s in ("gemm", "cutlass", "nvjet", "xmma")):
        kind["gemm"] += t
      else:
        kind["other"] += t
    kinds.append(kind)
    totals.append(sum(kind.values()))
    for k, v in by_name.items():
      names.setdefault(k, []).append(v)
  med = lambda v: float(np.median(v))
  kind_text = ", ".join(f"{k} {med([c[k] for c in kinds]):.2f} ms" for k in ("sparse", "gemm", "other"))
  top = sorted(names.items(), key=lambda kv: -med(kv[1]))[:14]
  spread = sorted(names.items(), key=lambda kv: -(max(kv[1]) - min(kv[1])))[:3]
  return (
      f"{kind_text}; calls {min(totals):.2f}-{max(totals):.2f} ms (median {med(totals):.2f}); top: "
      + "; ".join(f"{k} {med(v):.2f}" for k, v in top)
      + "; most varying: " + "; ".join(f"{k} {min(v):.2f}-{max(v):.2f}" for k, v in spread)
  )


def train_step(model: nnx.Module, x, y):
  """One value_and_grad + adamw step in functional form (split state, jit, no donation): ``(step, state)``,
  after one checked call."""
  opt = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
  graphdef, state = nnx.split((model, opt))

  def step(state, x, y):
    model, opt = nnx.merge(graphdef, state)

    def loss_fn(model):
      return jnp.mean(jnp.square(model(x).astype(jnp.float32) - y))

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss, nnx.state((model, opt))

  loss, _ = jax.jit(step)(state, x, y)
  if not bool(jnp.isfinite(loss)):
    raise FloatingPointError(f"non-finite loss {loss}")
  return step, state


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
  p.add_argument("--depth", type=int, default=4)
  p.add_argument("--d", type=int, default=2048, help="model width")
  p.add_argument("--hidden", type=int, default=8192, help="MLP hidden width")
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--seq", type=int, default=2048, help="tokens = batch * seq")
  p.add_argument("--density", type=float, default=0.25)
  p.add_argument("--kinds", default="block128,block64,block32", help=f"comma-separated, of {list(LAYER_KINDS)}")
  p.add_argument("--precisions", default="bf16,f32", help=f"comma-separated, of {list(PRECISIONS)}")
  p.add_argument("--sparse-attention", action="store_true", help="also sparsify the attention projections")
  p.add_argument("--attention", choices=tuple(ATTENTION), default="einsum",
                 help="the transformer's attention core: einsum (nnx's) or fused (jax.nn.dot_product_attention)")
  p.add_argument("--iterations", type=int, default=10, help="steps per timing")
  p.add_argument("--rounds", type=int, default=3,
                 help="timings of every model, interleaved (dense, kind 1, kind 2, ..., dense, ...): each kind's "
                      "ratio is the median over rounds of its time over the dense time of the same round")
  p.add_argument("--breakdown", action="store_true", help="also print device time per kind of kernel")
  p.add_argument("--out", default=None, help="also write the table (markdown) here")
  p.add_argument("--sparse-core-min-rows", type=int, default=None,
                 help="N:M kinds: rows of x from which 2:4 SR-STE products run on sparse tensor cores "
                      "(ops._sr_ste.SPARSE_CORE_MIN_ROWS and TRANSPOSABLE_SPARSE_CORE_MIN_ROWS; default theirs)")
  p.add_argument("--tiny", action="store_true", help="tiny sizes: a smoke test that runs in seconds on a CPU")
  args = p.parse_args(argv)
  if args.tiny:
    args.depth, args.d, args.hidden, args.heads, args.batch, args.seq, args.iterations = 2, 128, 256, 2, 2, 16, 2
    args.rounds = 2
  if args.sparse_core_min_rows is not None:
    _sr_ste.SPARSE_CORE_MIN_ROWS = _sr_ste.TRANSPOSABLE_SPARSE_CORE_MIN_ROWS = args.sparse_core_min_rows
  dev = jax.devices()[0]
  header = (
      f"device: {dev.device_kind}, jax {jax.__version__}; {args.model} x{args.depth}, d={args.d}, "
      f"hidden={args.hidden}, x ({args.batch}, {args.seq}, {args.d}), density {args.density}"
      + (", attention projections sparse too" if args.sparse_attention else "")
      + (f", {args.attention} attention" if args.model == "transformer" else "")
  )
  log(header)
  rows = ["| layer kind | precision | step ms | dense step ms | ratio (range over rounds) |", "|---|---|---|---|---|"]
  key = jax.random.key(0)
  for prec in args.precisions.split(","):
    opts = PRECISIONS[prec]
    dtype = opts.get("dtype", jnp.float32)
    x = jax.random.normal(key, (args.batch, args.seq, args.d), jnp.float32).astype(dtype)
    y = jax.random.normal(jax.random.fold_in(key, 1), (args.batch, args.seq, args.d), jnp.float32)
    dense = Stack(args.model, args.depth, args.d, args.hidden, args.heads, rngs=nnx.Rngs(0), attention=args.attention,
                  **opts)
    steps = {"dense": train_step(dense, x, y)}
    for kind in args.kinds.split(","):
      r = rules(kind, args.density, args.sparse_attention)
      try:
        model = dense
        if r is not None:
          model, report = jaxsparse.sparsify(dense, r)
          log(f"{prec} {kind}: {len(report.layers)} layers sparsified")
        with warnings.catch_warnings(record=True) as caught:  # e.g. a kernel falling back to XLA
          warnings.simplefilter("always")
          steps[kind] = train_step(model, x, y)
        for w in {f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught}:
          log(f"{prec} {kind}: warning while compiling: {w}")
      except Exception as e:  # report and go on with the other kinds
        log(f"{prec} {kind}: FAILED {type(e).__name__}: {str(e)[:300]}")
        rows.append(f"| {kind} | {prec} | failed | - | - |")
    times = {name: [] for name in steps}
    for rnd in range(args.rounds):
      for name, (step, state) in steps.items():
        times[name].append(time_ms(step, state, x, y, iterations=args.iterations))
      log(f"{prec} round {rnd}: " + ", ".join(f"{name} {t[-1]:.3f} ms" for name, t in times.items()))
    if args.breakdown:
      for name, (step, state) in steps.items():
        try:
          log(f"{prec} {name} per kind of kernel: {breakdown(step, state, x, y)}")
        except Exception as e:  # CUPTI unavailable: the table does not need it
          log(f"  breakdown failed: {type(e).__name__}: {str(e)[:200]}")
    t_dense = float(np.median(times["dense"]))
    for name, t in times.items():
      if name == "dense":
        continue
      ratios = [a / b for a, b in zip(t, times["dense"], strict=True)]
      spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
      rows.append(f"| {name} | {prec} | {np.median(t):.3f} | {t_dense:.3f} | **{np.median(ratios):.2f}** ({spread}) |")
      log(rows[-1])
  text = "\n".join([
      header,
      f"timing: {TIMER['how']}, median of {args.iterations} steps per timing, {args.rounds} interleaved rounds",
      "",
      *rows,
  ])
  if args.out:
    with open(args.out, "w") as fh:
      fh.write(text + "\n")
  log("\n" + text)


if __name__ == "__main__":
  main()
