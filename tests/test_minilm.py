"""all-MiniLM-L6-v2 end to end (examples/minilm): a real PyTorch checkpoint through jaxsparse and back.

Checks, on a few short sentences (CPU, float32):
  * the checkpoint loaded into the example's Flax NNX BERT gives sentence-transformers' ``encode``
    embeddings within 1e-4 max abs;
  * after sparsifying the 12 FFN layers (2:4, and 50% of 32x32 blocks), the masks exported back and
    applied to the torch model with ``torch.nn.utils.prune`` give the sparse Flax model's embeddings
    within 1e-4; the cosine similarity to the dense embeddings is reported (one-shot magnitude
    pruning without fine-tuning, so it drops).
"""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")  # installed by the Makefile (torch==2.13.0 CPU wheel, then the torch extra)

RUN_MINILM = Path(__file__).resolve().parent.parent / "examples" / "minilm" / "run_minilm.py"
PRUNE_MINILM = RUN_MINILM.with_name("prune_minilm.py")


def _load_example(path=RUN_MINILM):
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow  # ~40 s on 2 cores
def test_minilm_end_to_end(capsys):
  example = _load_example()
  r = example.run(example.SENTENCES)
  layers = {layer.flax_path: layer for layer in r["report"].layers}
  assert len(layers) == 4 + 6 * 8  # 3 embeddings + LayerNorm, and 8 modules per encoder layer
  assert layers["encoder.layer.3.attention.query"].torch_module == "encoder.layer.3.attention.self.query"
  assert r["dense_max_abs"] <= 1e-4
  assert set(r["variants"]) == {"2:4", "block 32x32, 50%"}
  for name, v in r["variants"].items():
    assert v["masked_layers"] == 12, name
    assert v["density"] == pytest.approx(0.5), name
    assert v["torch_max_abs"] <= 1e-4, name
    cos = np.asarray(v["cosine"])
    assert cos.shape == (len(example.SENTENCES),) and np.all(np.isfinite(cos)) and np.all(cos <= 1 + 1e-5)
    print(f"{name}: cosine to dense {cos.mean():.4f} (min {cos.min():.4f}), torch vs Flax {v['torch_max_abs']:.2e}")


@pytest.mark.slow  # ~60 s on 2 cores
def test_minilm_calibrated_pruning_reduced(capsys):
  """prune_minilm.py on a reduced setup: 2:4 in the FFN layers of the first two encoder layers."""
  example = _load_example(PRUNE_MINILM)
  name = "2:4 FFN of layers 0-1"
  patterns = {name: {r"encoder\.layer\.[01]\.(intermediate|output)\.dense": example.jaxsparse.NM(2, 4)}}
  out = example.run(calibration=64, held_out=32, patterns=patterns, progress=False, reconstruct_epochs=1)
  methods = (*example.METHODS, example.RECONSTRUCTED)
  cos = {m: float(out["results"][(name, m)]["cosine"].mean()) for m in methods}
  for m in example.METHODS:
    r = out["results"][(name, m)]
    assert r["layers"] == 4 and r["density"] == pytest.approx(0.5), m
    assert [layer.group for layer in r["report"].layers] == [0, 0, 1, 1], m
  assert cos["magnitude"] < cos["wanda"] and cos["magnitude"] < cos["sparsegpt"], cos
  assert cos["sparsegpt"] > 0.95, cos
  assert example.sparse_check(out, name, "sparsegpt") < 1e-4
  # Block reconstruction keeps the masks (run() checks every kernel), so the model still sparsifies.
  assert [entry["block"] for entry in out["results"][(name, example.RECONSTRUCTED)]["report"]] == list(range(6))
  assert cos[example.RECONSTRUCTED] > 0.95, cos
  assert example.sparse_check(out, name, example.RECONSTRUCTED) < 1e-4
  print(f"{name}, cosine to dense: {cos}")
