"""A Llama-format checkpoint end to end: load into Flax, generate, prune (magnitude / Wanda / SparseGPT), sparsify,
send the masks back to torch.

    python examples/llama/run_llama.py [--model DIR] [--patterns 2:4 ...] [--methods ...] [--no-progress]

``--model`` is a Hugging Face Llama directory (``config.json`` + safetensors, e.g. a TinyLlama download);
without it a small random ``transformers.LlamaForCausalLM`` is made (seeded: d = 256, MLP 512, 4 layers,
8 / 4 heads, vocab 512; RMSNorm weights drawn log-normal so that input features differ in scale, as in
trained LLMs). Calibration and held-out token ids are random (``--calibration-text FILE`` tokenizes a text
file with the directory's ``tokenizer.json`` instead). Needs torch (CPU wheel) and transformers for the
comparisons; the Flax side needs neither.

Steps, each printed:

1. the checkpoint loaded with ``checkpoint.load_pretrained``: max abs logit difference to transformers;
2. greedy ``generate`` of 16 tokens vs ``transformers``' ``generate``: identical tokens?
3. for every pattern and method: ``prune.prune`` (sequential by decoder layer) -> the mean relative
   reconstruction error of each decoder layer's projections, the held-out next-token agreement with the dense
   model (fraction of positions whose argmax is the same), ``prune.to_inference`` (jaxsparse layers;
   identical generated tokens and logits?), and the masks exported with ``checkpoint.export_masks`` and
   applied to the torch model holding the pruned weights (max abs logit difference to the Flax sparse model).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxsparse import torch_interop
from llama.checkpoint import export_masks
from llama.checkpoint import load_pretrained
from llama.checkpoint import save_pretrained
from llama.generation import generate
from llama.prune import PATTERNS
from llama.prune import layer_errors
from llama.prune import prune
from llama.prune import to_inference

METHODS = ("magnitude", "wanda", "sparsegpt")


def random_checkpoint(directory: Path, *, seed: int = 0) -> Path:
  """Saves a small random ``transformers.LlamaForCausalLM`` (see the module docstring) in ``directory``."""
  import torch  # noqa: PLC0415 -- optional dependency of the example
  import transformers  # noqa: PLC0415

  torch.manual_seed(seed)
  cfg = transformers.LlamaConfig(
      vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
      num_key_value_heads=4, max_position_embeddings=256, initializer_range=0.05, bos_token_id=None,
      eos_token_id=None, pad_token_id=None)
  model = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(torch.exp(0.5 * torch.randn_like(p)))
  model.save_pretrained(directory)
  return directory


def token_ids(path: Path, vocab: int, rows: int, length: int, *, seed: int, text: str | None = None) -> np.ndarray:
  """``(rows, length)`` ids: random, or consecutive windows of ``text`` tokenized with ``tokenizer.json``."""
  if text is None:
    return np.random.default_rng(seed).integers(0, vocab, (rows, length)).astype(np.int32)
  from tokenizers import Tokenizer  # noqa: PLC0415

  ids = np.asarray(Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids, np.int32)
  if len(ids) < rows * length:
    raise ValueError(f"the text has {len(ids)} tokens; {rows} x {length} are needed.")
  start = np.random.default_rng(seed).integers(0, len(ids) - length, rows)
  return np.stack([ids[s:s + length] for s in start])


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
  import torch  # noqa: PLC0415

  with torch.no_grad():
    return model(torch.tensor(ids)).logits.float().numpy()


def run(path: Path, *, patterns: list[str], methods: list[str], calibration: int = 64, length: int = 64,
        text: str | None = None, progress: bool = True) -> dict:
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype="float32").eval()
  model = load_pretrained(path, param_dtype=jnp.float32)
  vocab = model.config.vocab_size
  held_out = token_ids(path, vocab, 8, length, seed=1, text=text)
  dense_logits = np.asarray(model(jnp.asarray(held_out)))
  out = {"dense_max_abs": float(np.abs(dense_logits - torch_logits(hf, held_out)).max())}
  prompt = held_out[:2, :8]
  tokens = np.asarray(generate(model, prompt, 16))
  ref = hf.generate(torch.tensor(prompt), max_new_tokens=16, do_sample=False)[:, 8:].numpy()
  out["greedy_same"] = bool((tokens == ref).all())
  calib = token_ids(path, vocab, calibration, length, seed=2, text=text)
  out["rows"] = []
  for name in patterns:
    for method in methods:
      t0 = time.perf_counter()
      pruned, masks, report = prune(model, calib, PATTERNS[name], method=method, progress=progress)
      seconds = time.perf_counter() - t0
      sparse, _ = to_inference(pruned, PATTERNS[name], masks=masks)
      sparse_logits = np.asarray(sparse(jnp.asarray(held_out)))
      agreement = float(np.mean(sparse_logits.argmax(-1) == dense_logits.argmax(-1)))
      same_tokens = bool((np.asarray(generate(sparse, prompt, 16)) == np.asarray(generate(pruned, prompt, 16))).all())
      with tempfile.TemporaryDirectory() as tmp:  # the pruned weights to torch, then the masks
        target = transformers.LlamaForCausalLM.from_pretrained(save_pretrained(sparse, tmp), dtype="float32").eval()
      torch_interop.apply_masks(target, export_masks(sparse))
      torch_max_abs = float(np.abs(torch_logits(target, held_out) - sparse_logits).max())
      out["rows"].append({"pattern": name, "method": method, "errors": layer_errors(report), "agreement": agreement,
                          "same_tokens": same_tokens, "torch_max_abs": torch_max_abs, "seconds": seconds,
                          "sparse_layer": type(sparse.model.layers[0].mlp.up_proj).__name__})
  return out


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", type=Path, help="a Hugging Face Llama directory (default: a small random one)")
  parser.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=list(PATTERNS))
  parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
  parser.add_argument("--calibration", type=int, default=64, help="calibration sequences")
  parser.add_argument("--length", type=int, default=64, help="tokens per sequence")
  parser.add_argument("--calibration-text", type=Path, help="a text file tokenized with the model's tokenizer.json")
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)
  text = None if args.calibration_text is None else args.calibration_text.read_text()
  with tempfile.TemporaryDirectory() as tmp:
    path = args.model or random_checkpoint(Path(tmp))
    t0 = time.perf_counter()
    r = run(path, patterns=args.patterns, methods=args.methods, calibration=args.calibration, length=args.length,
            text=text, progress=not args.no_progress)
  print(f"\n{path if args.model else 'random LlamaForCausalLM (d 256, 4 layers)'}, float32, CPU, "
        f"{time.perf_counter() - t0:.0f} s")
  print(f"dense Flax vs transformers: max abs logit diff {r['dense_max_abs']:.2e}; "
        f"greedy generate identical: {r['greedy_same']}")
  print("\n| pattern | method | rel. error per decoder layer | held-out top-1 agreement | sparse layer | "
        "sparse = pruned tokens | torch + masks vs Flax | prune s |")
  print("|---|---|---|---|---|---|---|---|")
  for row in r["rows"]:
    errors = " / ".join(f"{e:.3f}" for e in row["errors"].values())
    print(f"| {row['pattern']} | {row['method']} | {errors} | {row['agreement']:.3f} | {row['sparse_layer']} | "
          f"{row['same_tokens']} | {row['torch_max_abs']:.1e} | {row['seconds']:.1f} |")


if __name__ == "__main__":
  main()
