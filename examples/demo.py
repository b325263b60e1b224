"""jaxsparse demo: take a trained dense Flax model, sparsify it three ways, fine-tune, compare.

    make demo          # or: python examples/demo.py [--steps 300] [--plot jaxsparse_demo.png]

1. Trains a dense Flax NNX MLP (64-2048-2048-10) on scikit-learn's bundled digits (no download).
2. :func:`jaxsparse.sparsify` turns copies of it into sparse models, initialised by magnitude from the
   trained weights: the 2048x2048 hidden layer block-sparse (10% of its 32x32 blocks), 2:4 (N:M, trained
   on with SR-STE), or 90% unstructured; and one model mixing all three (2:4 input layer, block-sparse
   hidden layer, unstructured head).
3. Fine-tunes each briefly with optax, then prints a table of test accuracy (before and after
   fine-tuning), stored parameter bytes and median training-step time against the dense model, and
   writes a plot.

On a GPU the block-sparse layers use the Pallas kernels automatically; on a CPU they use the XLA path.
The 2:4 layer keeps dense weights while training (SR-STE recomputes the mask every step), so it is
not faster to train; its compressed form (``to_compressed``) is what makes inference smaller.
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

import jaxsparse

HIDDEN = 2048
VARIANTS = {
    "block-sparse 32x32, 10% kept": {"hidden": jaxsparse.BlockSparse(density=0.1, block_shape=(32, 32))},
    "2:4 (SR-STE)": {"hidden": jaxsparse.NM(2, 4)},
    "unstructured, 90% pruned": {"hidden": jaxsparse.Unstructured(sparsity=0.9)},
    "mixed: 2:4 inp + block hidden + 90% head": {
        "inp": jaxsparse.NM(2, 4),
        "hidden": jaxsparse.BlockSparse(density=0.1, block_shape=(32, 32)),
        "head": jaxsparse.Unstructured(sparsity=0.9),
    },
}


class MLP(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.inp = nnx.Linear(64, HIDDEN, rngs=rngs)
    self.hidden = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)
    self.head = nnx.Linear(HIDDEN, 10, rngs=rngs)

  def __call__(self, x):
    x = jax.nn.relu(self.inp(x))
    x = jax.nn.relu(self.hidden(x))
    return self.head(x)


def param_bytes(model: nnx.Module) -> int:
  """Bytes the model stores: parameters plus sparsity patterns (indices, masks)."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))


def train(model: nnx.Module, data, steps: int, *, lr: float, batch: int = 128, seed: int = 0) -> float:
  """Trains ``model`` in place with adam; returns the median step time in ms (compilation excluded)."""
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
  return float(np.median(times[3:])) * 1e3


def accuracy(model: nnx.Module, x, y) -> float:
  return float(jnp.mean(nnx.jit(lambda m, x: m(x))(model, x).argmax(-1) == y))


def plot(rows, path: str) -> None:
  import matplotlib  # noqa: PLC0415 -- only needed for the figure

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  names = ["dense", "block 10%", "2:4", "unstructured 90%", "mixed"][: len(rows)]
  fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
  colors = ["gray"] + [f"C{i}" for i in range(len(rows) - 1)]
  panels = [
      ("test accuracy", [r["acc"] for r in rows], (min(r["acc"] for r in rows) - 0.02, 1.0)),
      ("stored parameter MB", [r["bytes"] / 1e6 for r in rows], None),
      ("train step time / dense", [r["ms"] / rows[0]["ms"] for r in rows], None),
  ]
  for ax, (title, values, ylim) in zip(axes, panels, strict=True):
    ax.bar(range(len(rows)), values, color=colors)
    ax.set_xticks(range(len(rows)), names, fontsize=8, rotation=20)
    ax.set_title(title)
    if ylim:
      ax.set_ylim(*ylim)
  fig.suptitle(f"jaxsparse demo: digits MLP 64-{HIDDEN}-{HIDDEN}-10 on {jax.default_backend()}")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300, help="dense training steps")
  parser.add_argument("--finetune", type=int, default=100, help="fine-tuning steps of each sparse model")
  parser.add_argument("--plot", default="jaxsparse_demo.png", help="where to write the figure ('' for none)")
  args = parser.parse_args(argv)

  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  xtr, xte, ytr, yte = map(jnp.asarray, train_test_split(x, digits.target, test_size=0.25, random_state=0))
  print(f"jax {jax.__version__} on {jax.default_backend()}; digits {len(xtr)} train / {len(xte)} test; "
        f"MLP 64-{HIDDEN}-{HIDDEN}-10; dense {args.steps} steps, each sparse model {args.finetune} more (adam)")

  dense = MLP(rngs=nnx.Rngs(0))
  ms = train(dense, (xtr, ytr), args.steps, lr=1e-3)
  rows = [{"name": "dense", "before": float("nan"), "acc": accuracy(dense, xte, yte),
           "bytes": param_bytes(dense), "ms": ms}]
  for name, rules in VARIANTS.items():
    sparse, _ = jaxsparse.sparsify(dense, rules)
    before = accuracy(sparse, xte, yte)
    ms = train(sparse, (xtr, ytr), args.finetune, lr=3e-4, seed=1)
    rows.append({"name": name, "before": before, "acc": accuracy(sparse, xte, yte),
                 "bytes": param_bytes(sparse), "ms": ms, "layers": [type(getattr(sparse, k)).__name__ for k in rules]})

  print("\n| model | layers replaced | test acc. after sparsify | after fine-tune | stored params | "
        "train step ms | step time vs dense |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    before = "-" if r["name"] == "dense" else f"{r['before']:.3f}"
    print(f"| {r['name']} | {', '.join(r.get('layers', [])) or '-'} | {before} | {r['acc']:.3f} | "
          f"{r['bytes'] / 1e6:.2f} MB ({r['bytes'] / rows[0]['bytes']:.2f}x) | {r['ms']:.2f} | "
          f"{r['ms'] / rows[0]['ms']:.2f}x |")
  if args.plot:
    plot(rows, args.plot)
    print(f"\nplot written to {args.plot}")
  return rows


if __name__ == "__main__":
  main()
