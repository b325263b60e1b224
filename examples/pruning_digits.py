"""Pruning and sparse training of an MLP on scikit-learn's digits, with jaxsparse.pruning.

    python examples/pruning_digits.py [--steps 2000] [--hidden 512]

Trains the same MLP (64-H-H-10, Flax NNX) four ways with the same initialisation, data order and
optimizer (Adam), and prints test accuracy against dense:

  * dense;
  * gradual magnitude pruning (Zhu & Gupta) of the two hidden layers to 90% unstructured sparsity;
  * gradual magnitude pruning to 75% block sparsity (16x16 blocks);
  * RigL at 90% unstructured sparsity from the first step (dynamic sparse training).

The output layer stays dense. Each pruned model is then turned into sparse layers with
``jaxsparse.sparsify(model, rules, masks=...)``; its accuracy is measured again on the sparse model.
:func:`run` is the experiment; the test suite runs a reduced version of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import jaxsparse
from jaxsparse import pruning


class MLP(nnx.Module):
  def __init__(self, hidden: int, *, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(64, hidden, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, hidden, rngs=rngs)
    self.head = nnx.Linear(hidden, 10, rngs=rngs)

  def __call__(self, x):
    x = jax.nn.relu(self.fc1(x))
    x = jax.nn.relu(self.fc2(x))
    return self.head(x)


@dataclasses.dataclass(frozen=True)
class Result:
  name: str
  accuracy: float  # test accuracy of the trained (dense-format) model
  sparse_accuracy: float | None  # the same model after jaxsparse.sparsify with the trained masks
  sparsity: float  # fraction of zero weights in the pruned kernels (fc1, fc2)
  seconds: float


def load_data(seed: int = 0):
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  xtr, xte, ytr, yte = train_test_split(x, digits.target, test_size=0.25, random_state=seed, stratify=digits.target)
  return tuple(map(jnp.asarray, (xtr, ytr, xte, yte)))


def _accuracy(model, x, y) -> float:
  return float(jnp.mean(nnx.jit(lambda m, x: m(x))(model, x).argmax(-1) == y))


def _train(model, tx, data, *, steps: int, batch: int, seed: int):
  xtr, ytr, _, _ = data
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    def loss_fn(model):
      return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    grads = nnx.grad(loss_fn)(model)
    optimizer.update(model, grads)

  rng = np.random.default_rng(seed)
  for _ in range(steps):
    idx = rng.integers(0, len(xtr), batch)
    step(model, optimizer, xtr[idx], ytr[idx])
  return optimizer


def run(*, steps: int = 2000, hidden: int = 512, batch: int = 128, lr: float = 1e-3, seed: int = 0) -> list[Result]:
  """Trains dense, gradual-pruned (90% unstructured, 75% block) and RigL (90%) MLPs; returns their results."""
  data = load_data(seed)
  _, _, xte, yte = data
  begin, end, every = steps // 5, (7 * steps) // 10, max(steps // 40, 1)
  gradual = pruning.gradual(begin_step=begin, end_step=end, update_every=every)
  experiments = {
      "dense": None,
      "gradual magnitude, 90% unstructured": (
          {"head": None, "fc.*": jaxsparse.Unstructured(sparsity=0.9)},
          lambda rules: pruning.magnitude_pruner(rules, gradual),
      ),
      "gradual magnitude, 75% block 16x16": (
          {"head": None, "fc.*": jaxsparse.BlockSparse(density=0.25, block_shape=(16, 16))},
          lambda rules: pruning.magnitude_pruner(rules, gradual),
      ),
      "RigL, 90% unstructured": (
          {"head": None, "fc.*": jaxsparse.Unstructured(sparsity=0.9)},
          lambda rules: pruning.rigl_pruner(rules, update_every=every, end_step=(3 * steps) // 4, drop_fraction=0.3),
      ),
  }
  results = []
  for name, setup in experiments.items():
    t0 = time.perf_counter()
    model = MLP(hidden, rngs=nnx.Rngs(seed))
    tx = optax.adam(lr)
    if setup is None:
      _train(model, tx, data, steps=steps, batch=batch, seed=seed)
      results.append(Result(name, _accuracy(model, xte, yte), None, 0.0, time.perf_counter() - t0))
      continue
    rules, make_pruner = setup
    optimizer = _train(model, pruning.wrap_optax(tx, make_pruner(rules), seed=seed), data, steps=steps, batch=batch,
                       seed=seed)
    masks = pruning.get_masks(optimizer)
    sparse, _ = jaxsparse.sparsify(model, rules, masks=masks)
    kernels = [model.fc1.kernel[...], model.fc2.kernel[...]]
    sparsity = float(sum(jnp.sum(k == 0) for k in kernels) / sum(k.size for k in kernels))
    results.append(Result(name, _accuracy(model, xte, yte), _accuracy(sparse, xte, yte), sparsity,
                          time.perf_counter() - t0))
  return results


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--hidden", type=int, default=512)
  parser.add_argument("--seeds", type=int, default=1, help="repeat with seeds 0..n-1 and report mean accuracy")
  args = parser.parse_args()
  print(f"jax {jax.__version__} on {jax.default_backend()}; digits, MLP 64-{args.hidden}-{args.hidden}-10, "
        f"{args.steps} Adam steps of batch 128; fc1 and fc2 pruned, head dense")
  runs = [run(steps=args.steps, hidden=args.hidden, seed=s) for s in range(args.seeds)]
  dense = np.mean([r[0].accuracy for r in runs])
  print()
  print("| training | test accuracy | vs dense | after sparsify | zero weights in fc1, fc2 | seconds |")
  print("|---|---|---|---|---|---|")
  for i, first in enumerate(runs[0]):
    acc = np.mean([r[i].accuracy for r in runs])
    sparse = "" if first.sparse_accuracy is None else f"{np.mean([r[i].sparse_accuracy for r in runs]):.4f}"
    print(f"| {first.name} | {acc:.4f} | {acc - dense:+.4f} | {sparse} | {first.sparsity:.1%} | "
          f"{np.mean([r[i].seconds for r in runs]):.1f} |")


if __name__ == "__main__":
  main()
