"""End to end: a full optax train step of a sparsified model against the dense model, in one run.

What a user sees who takes a Flax model, calls ``jaxsparse.sparsify`` and trains it: ``value_and_grad`` +
``optax.adamw`` through ``nnx.Optimizer``, every product, norm, activation and optimizer update included.

    python3 benchmarks/gpu_train_step.py                      # MLP stack, every layer kind, bf16 and f32
    python3 benchmarks/gpu_train_step.py --model transformer --sparse-attention --kinds block64,nm
    python3 benchmarks/gpu_train_step.py --tiny               # seconds on a CPU (a smoke test, no timing claim)

Models (pre-norm residual blocks, ``--depth`` of them):

* ``mlp``: ``x + down(gelu(up(rmsnorm(x))))`` on ``(tokens, d)``, up ``d -> hidden``, down ``hidden -> d``.
* ``transformer``: ``x + attn(rmsnorm(x))`` (``nnx.MultiHeadAttention``, causal, its query/key/value/out
  projections are ``nnx.LinearGeneral``) then the MLP block, on ``(tokens // seq, seq, d)``.

Kinds (``--kinds``): ``dense``, ``block128`` / ``block64`` / ``block32`` (``BlockSparse(density, (b, b))``),
``nm`` (``NM(2, 4)``, SR-STE), ``unstructured`` (``Unstructured(sparsity=--sparsity)``). The rules sparsify the
MLP's up/down layers, and with ``--sparse-attention`` the attention projections too.

Precisions (``--precisions``): ``bf16`` (bf16 params and compute) and ``f32`` (Flax's defaults: f32 params,
``dtype=None``, DEFAULT matmul precision, which is TF32 on Hopper for XLA's dense products).

Times are device-side (``benchmarks/_gpu_timing.py``: CUPTI via ``jax.experimental.mosaic.gpu.profiler``,
median of ``--iterations`` steps; falls back to host timing and says so) and every ratio is against the dense
model of the same precision measured in the same run. Warnings raised while compiling a variant (a kernel
falling back to XLA, say) are listed under the table.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import optax
from _gpu_timing import TIMER
from _gpu_timing import log
from _gpu_timing import time_ms
from flax import nnx

import jaxsparse

DTYPES = {"bf16": jnp.bfloat16, "f32": None}


class MLPBlock(nnx.Module):
  def __init__(self, d: int, hidden: int, *, dtype, rngs: nnx.Rngs):
    pd = dtype or jnp.float32
    self.norm = nnx.RMSNorm(d, dtype=dtype, param_dtype=pd, rngs=rngs)
    self.up = nnx.Linear(d, hidden, dtype=dtype, param_dtype=pd, rngs=rngs)
    self.down = nnx.Linear(hidden, d, dtype=dtype, param_dtype=pd, rngs=rngs)

  def __call__(self, x):
    return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class AttentionBlock(nnx.Module):
  def __init__(self, d: int, heads: int, *, dtype, rngs: nnx.Rngs):
    pd = dtype or jnp.float32
    self.norm = nnx.RMSNorm(d, dtype=dtype, param_dtype=pd, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
        heads, d, dtype=dtype, param_dtype=pd, decode=False, deterministic=True, rngs=rngs
    )

  def __call__(self, x):
    h = self.norm(x)
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    return x + self.attn(h, mask=mask)


class Model(nnx.Module):
  def __init__(self, args, *, dtype, rngs: nnx.Rngs):
    blocks = []
    for _ in range(args.depth):
      if args.model == "transformer":
        blocks.append(AttentionBlock(args.d, args.heads, dtype=dtype, rngs=rngs))
      blocks.append(MLPBlock(args.d, args.hidden, dtype=dtype, rngs=rngs))
    self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return x


def spec(kind: str, args):
  if kind.startswith("block"):
    b = int(kind[len("block"):])
    return jaxsparse.BlockSparse(density=args.density, block_shape=(b, b))
  if kind == "nm":
    return jaxsparse.NM(2, 4)
  if kind == "unstructured":
    return jaxsparse.Unstructured(sparsity=args.sparsity)
  raise ValueError(f"unknown kind {kind!r}; use dense, block128, block64, block32, nm or unstructured.")


def build(kind: str, precision: str, args):
  model = Model(args, dtype=DTYPES[precision], rngs=nnx.Rngs(0))
  if kind == "dense":
    return model
  rules = {r".*\.(up|down)": spec(kind, args)}
  if args.sparse_attention:
    rules[r".*\.attn\.(query|key|value|out)"] = spec(kind, args)
  sparse, _ = jaxsparse.sparsify(model, rules)
  return sparse


def make_step(model):
  optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def step(state, x, target):
    model, optimizer = nnx.merge(graphdef, state)

    def loss_fn(model):
      return jnp.mean((model(x).astype(jnp.float32) - target) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  return step, state


def inputs(precision: str, args):
  dtype = DTYPES[precision] or jnp.float32
  kx, kt = jax.random.split(jax.random.key(1))
  shape = (args.tokens, args.d) if args.model == "mlp" else (args.tokens // args.seq, args.seq, args.d)
  return jax.random.normal(kx, shape, dtype), jax.random.normal(kt, shape, jnp.float32)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
  p.add_argument("--d", type=int, default=2048)
  p.add_argument("--hidden", type=int, default=8192)
  p.add_argument("--tokens", type=int, default=8192)
  p.add_argument("--depth", type=int, default=4)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--seq", type=int, default=1024, help="sequence length (transformer)")
  p.add_argument("--density", type=float, default=0.25, help="kept fraction of blocks (block kinds)")
  p.add_argument("--sparsity", type=float, default=0.9, help="pruned fraction (unstructured)")
  p.add_argument("--kinds", default="block128,block64,block32,nm,unstructured")
  p.add_argument("--precisions", default="bf16,f32")
  p.add_argument("--sparse-attention", action="store_true", help="sparsify the attention projections too")
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--tiny", action="store_true", help="tiny sizes: a smoke test that runs in seconds on a CPU")
  p.add_argument("--out", help="also write the table (markdown) to this file")
  args = p.parse_args(argv)
  if args.tiny:
    args.d, args.hidden, args.tokens, args.depth, args.heads, args.seq, args.iterations = 128, 256, 64, 2, 2, 16, 2
    args.kinds = args.kinds.replace("block128", "block32").replace("block64", "block32")
  kinds = list(dict.fromkeys(k for k in args.kinds.split(",") if k and k != "dense"))
  precisions = [q for q in args.precisions.split(",") if q]
  for q in precisions:
    if q not in DTYPES:
      p.error(f"--precisions: {q!r} is not one of {sorted(DTYPES)}")
  log(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; model={args.model} d={args.d} "
      f"hidden={args.hidden} tokens={args.tokens} depth={args.depth} density={args.density} "
      f"sparse_attention={args.sparse_attention}")

  results, notes = {}, []
  for q in precisions:
    x, target = inputs(q, args)
    for kind in ["dense", *kinds]:
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, state = make_step(build(kind, q, args))
        _, loss = jax.jit(step)(state, x, target)
        if not bool(jnp.isfinite(loss)):
          raise RuntimeError(f"{kind} {q}: the loss is not finite ({loss})")
        ms = time_ms(step, state, x, target, iterations=args.iterations)
      for w in {f"{w.category.__name__}: {str(w.message)[:160]}" for w in caught}:
        notes.append(f"{kind} {q}: {w}")
      results[kind, q] = ms
      ratio = ms / results["dense", q]
      log(f"{kind:>13} {q}: {ms:9.3f} ms  ({ratio:.2f} of dense)  loss {float(loss):.4f}")

  header = "| layer kind | " + " | ".join(f"{q} ms | {q} / dense" for q in precisions) + " |"
  lines = [header, "|" + "---|" * (1 + 2 * len(precisions))]
  for kind in ["dense", *kinds]:
    cells = []
    for q in precisions:
      ms = results[kind, q]
      cells += [f"{ms:.2f}", f"**{ms / results['dense', q]:.2f}**" if kind != "dense" else "1.00"]
    lines.append(f"| {kind} | " + " | ".join(cells) + " |")
  table = "\n".join(lines)
  log(f"\ntiming: {TIMER['how']}\n")
  log(table)
  if notes:
    log("\nwarnings while compiling:\n" + "\n".join(f"- {n}" for n in notes))
  if args.out:
    with open(args.out, "w") as f:
      f.write(table + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
