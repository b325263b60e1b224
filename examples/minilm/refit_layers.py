"""Per-layer errors of MiniLM's pruned linear layers before and after the least-squares refit.

    python examples/minilm/refit_layers.py [--calibration 512] [--held-out 768] [--iterations 20 50 100]

Every linear layer of the dense model is pruned on its own (``sequential=False``: the dense model's
inputs) from the Gram matrix of the calibration sentences of ``prune_minilm.py``, with Wanda and
SparseGPT, then refitted with :func:`jaxsparse.pruning.refit_layer` for the same mask. Printed: the
relative error ``||X w - X ŵ|| / ||X w||`` on the calibration inputs and on the held-out sentences'
inputs (the dense model's), per layer and averaged per layer kind.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
from flax import nnx

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import prune_minilm
import run_minilm

import jaxsparse
from jaxsparse import pruning

SPECS = {"2:4": jaxsparse.NM(2, 4), "50% unstructured": jaxsparse.Unstructured(sparsity=0.5)}


def kind_of(path: str) -> str:
  return path.split(".", 3)[-1]


def main(argv: list[str] | None = None) -> None:
  from tokenizers import Tokenizer  # noqa: PLC0415 -- optional example dependency

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calibration", type=int, default=512)
  parser.add_argument("--held-out", type=int, default=768)
  parser.add_argument("--iterations", type=int, nargs="+", default=[20, 50, 100])
  parser.add_argument("--damp", type=float, default=0.01)
  args = parser.parse_args(argv)
  path = run_minilm.model_dir()
  tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
  cal_text, held_text = prune_minilm.texts(args.calibration, args.held_out)
  model, _ = run_minilm.load_flax(path)
  rules = {prune_minilm.LINEAR: jaxsparse.NM(2, 4)}
  token_mask = lambda b: b["attention_mask"]
  cal = pruning.calibrate(model, prune_minilm.batches(tokenizer, cal_text), rules, token_mask=token_mask)
  held = pruning.calibrate(model, prune_minilm.batches(tokenizer, held_text), rules, token_mask=token_mask)
  modules = {".".join(map(str, p)): m for p, m in nnx.iter_modules(model)}
  kernels = {p: np.asarray(modules[p].kernel[...]) for p in cal}
  its = args.iterations
  print(f"calibration {int(next(iter(cal.values())).tokens)} tokens, held-out {int(next(iter(held.values())).tokens)} "
        f"tokens (dense-model inputs); damp {args.damp}; refit iterations {its}\n")
  head = " | ".join(f"refit {i} calib." for i in its)
  print(f"| pattern | method | layer | (K, N) | calib. | {head} | held-out | refit {its[-1]} held-out |")
  print("|---|---|---|---|---|" + "---|" * len(its) + "---|---|")
  summary: dict[tuple, list] = {}
  for pattern, spec in SPECS.items():
    for method in ("wanda", "sparsegpt"):
      for layer, w in kernels.items():
        s, h = cal[layer], held[layer]
        if method == "wanda":
          mask = pruning.wanda_layer(w, s.sq_norms, spec)
          start = w * mask
        else:
          start, mask = pruning.sparsegpt_layer(w, s.gram, spec, damp=args.damp)
        refits = [pruning.refit_layer(w, s.gram, mask, start=start, damp=args.damp, iterations=i) for i in its]
        errs = [float(pruning.reconstruction_error(w, v, s.gram)) for v in [start, *refits]]
        held_errs = [float(pruning.reconstruction_error(w, v, h.gram)) for v in (start, refits[-1])]
        summary.setdefault((pattern, method, kind_of(layer)), []).append((errs[0], errs[-1], *held_errs))
        print(f"| {pattern} | {method} | {layer} | {w.shape} | " + " | ".join(f"{e:.4f}" for e in errs)
              + f" | {held_errs[0]:.4f} | {held_errs[1]:.4f} |", flush=True)
  print(f"\nMeans over the 6 encoder layers (refit: {its[-1]} iterations):\n")
  print("| pattern | method | layer kind | calib. | calib. refit | held-out | held-out refit |")
  print("|---|---|---|---|---|---|---|")
  for (pattern, method, kind), rows in summary.items():
    m = np.mean(rows, axis=0)
    print(f"| {pattern} | {method} | {kind} | {m[0]:.4f} | {m[1]:.4f} | {m[2]:.4f} | {m[3]:.4f} |")


if __name__ == "__main__":
  main()
