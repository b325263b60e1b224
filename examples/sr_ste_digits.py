"""2:4 sparse from scratch with SR-STE on scikit-learn's digits: dense vs SR-STE vs plain STE.

    python examples/sr_ste_digits.py [--steps 1500] [--seeds 0 1 2]

Trains the same MLP (64-256-256-10, ReLU) four ways with Adam, every layer 2:4 in the sparse runs
(groups of 4 input features):
  * dense: ``nnx.Linear`` layers;
  * SR-STE: ``NMLinear(n=2, m=4, sr_ste_decay=2e-4)``: the mask is recomputed from the dense
    weights every step; gradients reach all weights, plus the SR-STE decay on the pruned ones;
  * transposable SR-STE: the same with ``transposable=True`` where the outputs allow it (the two hidden
    layers; the 10-way head keeps the plain mask): 2:4 along the outputs too, so that ``Wᵀ`` is 2:4
    along its contraction axis as well (what a 2:4 ``dY Wᵀ`` on sparse tensor cores needs);
  * STE: the same as SR-STE with ``sr_ste_decay=0``.
Prints the mean test accuracy over seeds and the fraction of mask entries that still flipped over
the last 10% of training (SR-STE's decay is meant to settle the mask). The digits data ships with
scikit-learn: nothing is downloaded. ``tests/test_nm_layers.py`` runs a reduced version through
:func:`run`.
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from jaxsparse.layers import NMLinear

KINDS = ("dense", "sr_ste", "sr_ste_t", "ste")
SR_STE_DECAY = 2e-4


class MLP(nnx.Module):
  def __init__(self, kind: str, hidden: int, *, rngs: nnx.Rngs):
    sizes = [64, hidden, hidden, 10]
    if kind == "dense":
      make = lambda i, o: nnx.Linear(i, o, rngs=rngs)
    else:
      decay = 0.0 if kind == "ste" else SR_STE_DECAY
      make = lambda i, o: NMLinear(
          i, o, n=2, m=4, sr_ste_decay=decay, transposable=kind == "sr_ste_t" and o % 4 == 0, rngs=rngs
      )
    self.layers = nnx.List([make(i, o) for i, o in itertools.pairwise(sizes)])

  def __call__(self, x):
    for layer in self.layers[:-1]:
      x = jax.nn.relu(layer(x))
    return self.layers[-1](x)


def load_data(seed: int = 0):
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  xtr, xte, ytr, yte = train_test_split(x, digits.target, test_size=0.25, random_state=seed, stratify=digits.target)
  return tuple(map(jnp.asarray, (xtr, xte, ytr, yte)))


def masks(model: MLP) -> list[np.ndarray]:
  return [np.asarray(layer.mask) for layer in model.layers if isinstance(layer, NMLinear)]


def train_and_evaluate(kind: str, data, *, seed: int, steps: int, hidden: int, lr: float, batch: int) -> dict:
  """Trains one model; returns its test accuracy and late mask flips (``None`` for dense)."""
  xtr, xte, ytr, yte = data
  model = MLP(kind, hidden, rngs=nnx.Rngs(seed))
  schedule = optax.cosine_decay_schedule(lr, steps)
  optimizer = nnx.Optimizer(model, optax.adam(schedule), wrt=nnx.Param)

  graphdef, state = nnx.split((model, optimizer))

  @jax.jit
  def train_steps(state, batches):
    """Runs one Adam step per row of ``batches`` (indices into the training set) in a scan."""

    def body(state, idx):
      model, optimizer = nnx.merge(graphdef, state)

      def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(xtr[idx]), ytr[idx]).mean()

      loss, grads = nnx.value_and_grad(loss_fn)(model)
      optimizer.update(model, grads)
      return nnx.state((model, optimizer)), loss

    return jax.lax.scan(body, state, batches)[0]

  batches = jnp.asarray(np.random.default_rng(seed).integers(0, len(xtr), (steps, batch)))
  late = int(0.9 * steps)
  state = train_steps(state, batches[:late])
  model, optimizer = nnx.merge(graphdef, state)
  before = masks(model)
  model, optimizer = nnx.merge(graphdef, train_steps(state, batches[late:]))
  accuracy = float(jnp.mean(nnx.jit(lambda m, x: m(x))(model, xte).argmax(-1) == yte))
  flips = None
  if kind != "dense":
    after = masks(model)
    flips = sum(int((a != b).sum()) for a, b in zip(before, after, strict=True)) / sum(a.size for a in after)
  return {"accuracy": accuracy, "late_mask_flips": flips}


def run(
    *, steps: int = 1500, seeds=(0, 1, 2), hidden: int = 256, lr: float = 3e-3, batch: int = 128
) -> dict[str, list[dict]]:
  """Trains every kind for every seed; returns ``{kind: [result per seed]}``.

  Each result is ``{"accuracy": test accuracy, "late_mask_flips": fraction of mask entries that
  changed over the last 10% of steps (None for dense)}``.
  """
  data = load_data()
  return {
      kind: [
          train_and_evaluate(kind, data, seed=s, steps=steps, hidden=hidden, lr=lr, batch=batch) for s in seeds
      ]
      for kind in KINDS
  }


def mean_accuracy(results: list[dict]) -> float:
  return float(np.mean([r["accuracy"] for r in results]))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=1500)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--hidden", type=int, default=256)
  args = parser.parse_args()
  t0 = time.perf_counter()
  results = run(steps=args.steps, seeds=tuple(args.seeds), hidden=args.hidden)
  print(
      f"jax {jax.__version__} on {jax.default_backend()}; digits (sklearn, 1347 train / 450 test); "
      f"MLP 64-{args.hidden}-{args.hidden}-10, {args.steps} Adam steps, seeds {args.seeds}; "
      f"{time.perf_counter() - t0:.0f} s"
  )
  dense = mean_accuracy(results["dense"])
  print()
  print("| model | test accuracy (mean over seeds) | per seed | vs dense (points) | mask flips, last 10% of steps |")
  print("|---|---|---|---|---|")
  names = {
      "dense": "dense",
      "sr_ste": f"2:4 SR-STE (decay {SR_STE_DECAY:g})",
      "sr_ste_t": "2:4 SR-STE, transposable masks (hidden layers)",
      "ste": "2:4 plain STE (decay 0)",
  }
  for kind in KINDS:
    rs = results[kind]
    acc = mean_accuracy(rs)
    per_seed = " / ".join(f"{r['accuracy']:.3f}" for r in rs)
    flips = "-" if kind == "dense" else f"{np.mean([r['late_mask_flips'] for r in rs]):.2%}"
    print(f"| {names[kind]} | {acc:.2%} | {per_seed} | {100 * (acc - dense):+.2f} | {flips} |")


if __name__ == "__main__":
  main()
