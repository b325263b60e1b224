"""Pruning a whole random-weight Llama model by decoder layer: time and per-layer reconstruction error per method.

Run on a CUDA GPU (the device tool's H100), from the repository root:

  PYTHONPATH=.:examples python3 examples/llama/prune_timing.py --shape 1.1b
  python examples/llama/prune_timing.py --tiny          # CPU, seconds: the CI check

The model is ``examples/llama``'s ``LlamaForCausalLM`` with the shape of ``benchmarks/llm_decode.py``
(``1.1b``: TinyLlama-1.1B, 22 layers; ``8b``; ``tiny``), random weights (normal, std 0.02) and RMSNorm
weights drawn log-normal (``--norm-sigma``, 0.5): with all-ones norms every input feature of a projection
has about the same scale and Wanda's activation weighting has nothing to work with, while trained LLMs
have features of very different scales. Calibration: ``--calibration`` sequences of ``--length`` random
token ids. Each method (magnitude, Wanda, SparseGPT with its least-squares refit) prunes the seven
projections of every decoder layer to ``--pattern`` with ``examples/llama/prune.py``'s ``prune``
(``jaxsparse.pruning.calibrated_prune``, sequential by decoder layer, progress bar), from the same dense
model. Reported: wall time (compiles included) and the mean relative error ``||Xw - Xŵ|| / ||Xw||`` of
each decoder layer's projections on its calibration inputs. Table last; with ``$OUT`` set, written to
``llm_prune.md`` there too.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# examples/ (the llama package) and benchmarks/ (llm_decode's model shapes).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from llm_decode import SHAPES

from llama.model import LlamaForCausalLM
from llama.model import RMSNorm
from llama.prune import PATTERNS
from llama.prune import layer_errors
from llama.prune import prune

METHODS = ("magnitude", "wanda", "sparsegpt")


def random_model(name: str, layers: int | None, dtype, norm_sigma: float) -> LlamaForCausalLM:
  cfg = SHAPES[name]
  if layers is not None:
    cfg = dataclasses.replace(cfg, num_hidden_layers=layers)
  # Built eagerly: one jitted initialiser of the 22-layer 1.1B model took 2 min 31 s to compile on an H100
  # (benchmarks/results/llm_prune_2026-11-27_h100.md), while eager ops compile once per distinct shape.
  model = LlamaForCausalLM(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
  key = jax.random.key(1)
  for i, (_, node) in enumerate(nnx.iter_graph(model)):
    if isinstance(node, RMSNorm):
      shape = node.weight.shape
      node.weight[...] = jnp.exp(norm_sigma * jax.random.normal(jax.random.fold_in(key, i), shape)).astype(dtype)
  return model


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shape", default="1.1b", choices=list(SHAPES))
  p.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
  p.add_argument("--pattern", default="2:4", choices=list(PATTERNS))
  p.add_argument("--methods", type=lambda v: v.split(","), default=list(METHODS))
  p.add_argument("--calibration", type=int, default=32, help="calibration sequences")
  p.add_argument("--length", type=int, default=512, help="tokens per calibration sequence")
  p.add_argument("--batch-size", type=int, default=4, help="sequences per calibration batch")
  p.add_argument("--dtype", default="float32")
  p.add_argument("--norm-sigma", type=float, default=0.5, help="log-normal sigma of the RMSNorm weights")
  p.add_argument("--no-progress", action="store_true")
  p.add_argument("--tiny", action="store_true", help="tiny shape, 8 x 32 tokens: a CPU check in seconds")
  args = p.parse_args(argv)
  if args.tiny:
    args.shape, args.calibration, args.length = "tiny", 8, 32
  dtype = jnp.dtype(args.dtype)
  model = random_model(args.shape, args.layers, dtype, args.norm_sigma)
  depth = model.config.num_hidden_layers
  calibration = np.random.default_rng(0).integers(0, model.config.vocab_size, (args.calibration, args.length))
  dev = jax.devices()[0]
  head = (f"{getattr(dev, 'device_kind', dev.platform)}, jax {jax.__version__}: {args.shape} shape, {depth} layers, "
          f"{args.dtype}, {args.pattern}, {args.calibration} x {args.length} random calibration tokens")
  print(head, flush=True)
  rows = []
  for method in args.methods:
    t0 = time.perf_counter()
    _, _, report = prune(model, calibration, PATTERNS[args.pattern], method=method, batch_size=args.batch_size,
                         progress=not args.no_progress)
    seconds = time.perf_counter() - t0
    errors = layer_errors(report)
    rows.append((method, seconds, errors))
    print(f"{method}: {seconds:.1f} s, mean error {np.mean(list(errors.values())):.4f}", flush=True)
  lines = ["| method | s (compiles included) | mean rel. error | per decoder layer |", "|---|---|---|---|"]
  for method, seconds, errors in rows:
    per_layer = " / ".join(f"{e:.3f}" for e in errors.values())
    lines.append(f"| {method} | {seconds:.1f} | {np.mean(list(errors.values())):.4f} | {per_layer} |")
  by = {m: e for m, _, e in rows}
  if set(METHODS) <= set(by):
    order = [i for i in range(depth) if by["sparsegpt"][i] < by["wanda"][i] < by["magnitude"][i]]
    lines.append(f"\nSparseGPT < Wanda < magnitude in {len(order)} of {depth} decoder layers.")
  table = head + "\n\n" + "\n".join(lines)
  if os.environ.get("OUT"):
    Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
    Path(os.environ["OUT"], "llm_prune.md").write_text(table + "\n")
  print("\n" + table)


if __name__ == "__main__":
  main()
