"""Block-sparse layers on several devices: data-parallel scaling and the tensor-parallel MLP.

On the 2-GPU machine (the device tool's ``nvidia-h200-x2``):

  python benchmarks/gpu_sharded.py --out results.md

* Data parallel: a train step (forward, backward, SGD update) of a sparsified MLP stack, 4 pre-norm
  blocks ``x + down(gelu(up(layer_norm(x))))`` with d=2048, hidden 8192, every ``up`` / ``down`` a
  ``BlockSparseLinear`` (blocks 64x64, density 0.25), bf16. It runs on 1 device and on all of them
  at the same batch per device (8192 tokens), the batch sharded over a ``"data"`` mesh axis and the
  parameters replicated; the table gives tokens/s and the scaling (ideal: the number of devices),
  and the collectives in the compiled step (no all-gather expected; all-reduces of the gradients).
* Tensor parallel: one block's MLP ``gelu(x @ W_up) @ W_down`` with ``W_up`` split by block columns
  and ``W_down`` by block rows over a ``"model"`` axis (:func:`jaxsparse.sharding.megatron_mlp`),
  against the same weights on one device: relative error (bf16) and times of the forward and of
  forward + backward.

Times are wall-clock medians of back-to-back jitted calls (CUPTI sums kernel times of one device
only). On a CPU, ``--tiny --cpu-devices 2`` runs the same code at small sizes on forced host devices
(a smoke test; its times mean nothing).
"""

from __future__ import annotations

import argparse
import os
import re
import sys


def _parse():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tiny", action="store_true", help="small sizes (CPU smoke test)")
  p.add_argument("--cpu-devices", type=int, default=0, help="force this many host CPU devices (before jax starts)")
  p.add_argument("--devices", type=int, default=0, help="devices to use (default: all)")
  p.add_argument("--batch-per-device", type=int, default=0, help="tokens per device (default 8192, tiny 64)")
  p.add_argument("--iterations", type=int, default=20)
  p.add_argument("--out", default="", help="also write the markdown table here")
  return p.parse_args()


ARGS = _parse()
if ARGS.cpu_devices:
  flag = f"--xla_force_host_platform_device_count={ARGS.cpu_devices}"
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _gpu_timing import host_ms  # noqa: E402
from _gpu_timing import log  # noqa: E402
from _gpu_timing import rel_err  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxsparse  # noqa: E402
from jaxsparse.sharding import megatron_mlp  # noqa: E402
from jaxsparse.sharding import shard_block_sparse  # noqa: E402

if ARGS.tiny:
  D, HIDDEN, BLOCK, DEPTH, BATCH = 128, 512, 16, 4, ARGS.batch_per_device or 64
else:
  D, HIDDEN, BLOCK, DEPTH, BATCH = 2048, 8192, 64, 4, ARGS.batch_per_device or 8192
DENSITY, DTYPE, LR = 0.25, jnp.bfloat16, 1e-3


def collectives(compiled_text: str) -> str:
  counts = {op: len(re.findall(rf"[ )]{op}(?:-start)?\(", compiled_text)) for op in ("all-gather", "all-reduce")}
  return ", ".join(f"{n} {op}" for op, n in counts.items())


# -------------------------------------------------------------------------------------------------
# The model: 4 pre-norm MLP blocks, sparsified.
# -------------------------------------------------------------------------------------------------


class Block(nnx.Module):
  def __init__(self, rngs):
    self.norm = nnx.LayerNorm(D, param_dtype=DTYPE, dtype=DTYPE, rngs=rngs)
    self.up = nnx.Linear(D, HIDDEN, param_dtype=DTYPE, dtype=DTYPE, rngs=rngs)
    self.down = nnx.Linear(HIDDEN, D, param_dtype=DTYPE, dtype=DTYPE, rngs=rngs)

  def __call__(self, x):
    return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class Stack(nnx.Module):
  def __init__(self, rngs):
    self.blocks = nnx.List([Block(rngs) for _ in range(DEPTH)])

  def __call__(self, x):
    for b in self.blocks:
      x = b(x)
    return x


def sparse_stack():
  rule = jaxsparse.BlockSparse(density=DENSITY, block_shape=(BLOCK, BLOCK))
  model, report = jaxsparse.sparsify(Stack(nnx.Rngs(0)), rule)
  log(f"sparsified {len(report.layers)} layers to BlockSparseLinear, blocks {BLOCK}x{BLOCK}, density {DENSITY}")
  return model


def train_step_fn(graphdef, rest):
  def loss(params, x, y):
    out = nnx.merge(graphdef, params, rest)(x)
    return jnp.mean(jnp.square(out.astype(jnp.float32) - y.astype(jnp.float32)))

  def step(params, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    return jax.tree.map(lambda p, g: (p - LR * g).astype(p.dtype), params, grads), value

  return step


def data_parallel(model, devices) -> dict:
  n = len(devices)
  mesh = jax.make_mesh((n,), ("data",), devices=devices)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params, rest = jax.device_put((params, rest), replicated)
  kx, ky = jax.random.split(jax.random.key(n))
  x = jax.device_put(jax.random.normal(kx, (n * BATCH, D), DTYPE), batch)
  y = jax.device_put(jax.random.normal(ky, (n * BATCH, D), DTYPE), batch)
  step = jax.jit(
      train_step_fn(graphdef, rest), in_shardings=(replicated, batch, batch), out_shardings=(replicated, replicated)
  )
  text = step.lower(params, x, y).compile().as_text()
  ms = host_ms(step, params, x, y, iterations=ARGS.iterations)
  return {"devices": n, "ms": ms, "tokens_per_s": n * BATCH / ms * 1e3, "collectives": collectives(text)}


def tensor_parallel(model, devices) -> dict:
  n = len(devices)
  mesh = jax.make_mesh((n,), ("model",), devices=devices)
  block = model.blocks[0]
  w_up, w_down = block.up.sparse_kernel, block.down.sparse_kernel
  up_tp = shard_block_sparse(w_up, mesh, "model", split="columns")
  down_tp = shard_block_sparse(w_down, mesh, "model", split="rows")
  x = jax.random.normal(jax.random.key(7), (BATCH, D), DTYPE)
  one = devices[0]
  w_up1, w_down1, x1 = jax.device_put((w_up, w_down, x), one)
  ops = jaxsparse.ops

  def single(x, d_up, d_down):
    h = jax.nn.gelu(ops.block_sparse_matmul(x, w_up1.with_data(d_up)))
    return ops.block_sparse_matmul(h, w_down1.with_data(d_down))

  def tp(x, d_up, d_down):
    return megatron_mlp(x, up_tp.with_data(d_up), down_tp.with_data(d_down))

  xs = jax.device_put(x, NamedSharding(mesh, P()))
  grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
  y1 = jax.jit(single)(x1, w_up1.data, w_down1.data)
  ytp = jax.jit(tp)(xs, up_tp.data, down_tp.data)
  f_text = jax.jit(tp).lower(xs, up_tp.data, down_tp.data).compile().as_text()
  b_text = grad(tp).lower(xs, up_tp.data, down_tp.data).compile().as_text()
  it = ARGS.iterations
  return {
      "devices": n,
      "rel_err": rel_err(ytp, y1),
      "fwd_1": host_ms(jax.jit(single), x1, w_up1.data, w_down1.data, iterations=it),
      "fwd_tp": host_ms(jax.jit(tp), xs, up_tp.data, down_tp.data, iterations=it),
      "train_1": host_ms(grad(single), x1, w_up1.data, w_down1.data, iterations=it),
      "train_tp": host_ms(grad(tp), xs, up_tp.data, down_tp.data, iterations=it),
      "collectives_fwd": collectives(f_text),
      "collectives_train": collectives(b_text),
  }


def main():
  devices = jax.devices()[: ARGS.devices or None]
  log(f"jax {jax.__version__}, {len(devices)} x {devices[0].device_kind}")
  if len(devices) < 2:
    sys.exit("needs at least 2 devices (on a CPU: --cpu-devices 2)")
  model = sparse_stack()
  rows = [data_parallel(model, devices[:1]), data_parallel(model, devices)]
  base = rows[0]["tokens_per_s"]
  lines = [
      f"# Block-sparse layers on {len(devices)} x {devices[0].device_kind} (jax {jax.__version__})",
      "",
      f"Data parallel: train step of {DEPTH} pre-norm MLP blocks, d={D}, hidden {HIDDEN}, BlockSparseLinear "
      f"{BLOCK}x{BLOCK} density {DENSITY}, bf16, {BATCH} tokens per device.",
      "",
      "| devices | step ms | tokens/s | scaling | collectives in the step |",
      "|---:|---:|---:|---:|---|",
  ]
  for r in rows:
    scaling = r["tokens_per_s"] / base
    lines.append(f"| {r['devices']} | {r['ms']:.2f} | {r['tokens_per_s']:,.0f} | {scaling:.2f}x | {r['collectives']} |")
  t = tensor_parallel(model, devices)
  lines += [
      "",
      f"Tensor parallel: one block's MLP, up split by block columns and down by block rows over {t['devices']} "
      f"devices (megatron_mlp), {BATCH} tokens, against the same weights on 1 device.",
      "",
      "| | 1 device ms | TP ms | collectives (TP) |",
      "|---|---:|---:|---|",
      f"| forward | {t['fwd_1']:.2f} | {t['fwd_tp']:.2f} | {t['collectives_fwd']} |",
      f"| forward + backward | {t['train_1']:.2f} | {t['train_tp']:.2f} | {t['collectives_train']} |",
      "",
      f"TP output vs 1 device: relative error {t['rel_err']:.2e} (bf16).",
  ]
  text = "\n".join(lines)
  log(text)
  if ARGS.out:
    with open(ARGS.out, "w") as f:
      f.write(text + "\n")
  if t["rel_err"] > 2e-2:
    sys.exit(f"tensor-parallel output differs from one device: relative error {t['rel_err']:.2e}")


if __name__ == "__main__":
  main()
