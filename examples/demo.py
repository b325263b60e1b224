"""jaxsparse demo: a small Flax NNX MLP, dense vs sparse, trained on scikit-learn's digits.

    make demo          # or: python examples/demo.py [--steps 300]

Builds the same MLP three ways and trains each with optax:
  * dense: nnx.Linear layers;
  * sparse from scratch: a BlockSparseLinear hidden layer (10% of its 32x32 blocks) and a MaskedLinear
    head (50% unstructured);
  * pruned: the trained dense model converted with ``BlockSparseLinear.from_dense`` /
    ``MaskedLinear.from_dense`` (one-shot magnitude pruning), then fine-tuned briefly.
Prints test accuracy, stored parameter bytes and the median training-step time of each. On a GPU the
block-sparse layer uses the Pallas kernels automatically; on CPU it uses the XLA path.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import MaskedLinear

HIDDEN = 2048


class MLP(nnx.Module):
  def __init__(self, hidden: nnx.Module, head: nnx.Module, *, rngs: nnx.Rngs):
    self.inp = nnx.Linear(64, HIDDEN, rngs=rngs)
    self.hidden = hidden
    self.head = head

  def __call__(self, x):
    x = jax.nn.relu(self.inp(x))
    x = jax.nn.relu(self.hidden(x))
    return self.head(x)


def dense_mlp(rngs):
  return MLP(nnx.Linear(HIDDEN, HIDDEN, rngs=rngs), nnx.Linear(HIDDEN, 10, rngs=rngs), rngs=rngs)


def sparse_mlp(rngs, density):
  hidden = BlockSparseLinear(HIDDEN, HIDDEN, density=density, block_shape=(32, 32), rngs=rngs)
  head = MaskedLinear(HIDDEN, 10, sparsity=0.5, rngs=rngs)
  return MLP(hidden, head, rngs=rngs)


def param_bytes(model) -> int:
  """Bytes of trainable parameters plus stored sparsity patterns (indices, masks)."""
  state = nnx.state(model)
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def train(model, data, steps, *, lr=1e-3, batch=128, seed=0):
  xtr, ytr = data
  optimizer = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    def loss_fn(model):
      return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  rng = np.random.default_rng(seed)
  times = []
  for _ in range(steps):
    idx = rng.integers(0, len(xtr), batch)
    t0 = time.perf_counter()
    jax.block_until_ready(step(model, optimizer, xtr[idx], ytr[idx]))
    times.append(time.perf_counter() - t0)
  return float(np.median(times[5:])) * 1e3  # skip compilation


def accuracy(model, x, y) -> float:
  return float(jnp.mean(nnx.jit(lambda m, x: m(x))(model, x).argmax(-1) == y))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--density", type=float, default=0.1, help="block density of the hidden layer")
  args = parser.parse_args()

  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  xtr, xte, ytr, yte = train_test_split(x, digits.target, test_size=0.25, random_state=0)
  xtr, xte, ytr, yte = map(jnp.asarray, (xtr, xte, ytr, yte))
  print(f"jax {jax.__version__} on {jax.default_backend()}; digits: {len(xtr)} train / {len(xte)} test; "
        f"MLP 64-{HIDDEN}-{HIDDEN}-10, {args.steps} steps of adam, batch 128")

  rows = []
  dense = dense_mlp(nnx.Rngs(0))
  t = train(dense, (xtr, ytr), args.steps)
  rows.append(("dense", accuracy(dense, xte, yte), param_bytes(dense), t))

  sparse = sparse_mlp(nnx.Rngs(0), args.density)
  t = train(sparse, (xtr, ytr), args.steps)
  rows.append((f"sparse from scratch (hidden {args.density:.0%} blocks)", accuracy(sparse, xte, yte),
               param_bytes(sparse), t))

  pruned = MLP(
      BlockSparseLinear.from_dense(dense.hidden, density=args.density, block_shape=(32, 32)),
      MaskedLinear.from_dense(dense.head, sparsity=0.5),
      rngs=nnx.Rngs(0),
  )
  pruned.inp = dense.inp
  acc_oneshot = accuracy(pruned, xte, yte)
  t = train(pruned, (xtr, ytr), max(args.steps // 3, 10), lr=3e-4)
  rows.append((f"dense -> one-shot pruned ({acc_oneshot:.3f} before fine-tune)", accuracy(pruned, xte, yte),
               param_bytes(pruned), t))

  print()
  print("| model | test accuracy | param bytes | train step ms | speedup vs dense |")
  print("|---|---|---|---|---|")
  for name, acc, nbytes, ms in rows:
    print(f"| {name} | {acc:.3f} | {nbytes / 1e6:.2f} MB | {ms:.2f} | {rows[0][3] / ms:.2f}x |")
  print(f"\nsparse hidden layer: {sparse.hidden.sparse_kernel!r}")


if __name__ == "__main__":
  main()
