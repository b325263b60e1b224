"""A sparse Llama-format LLM end to end (examples/llama), on a tiny random transformers.LlamaForCausalLM (CPU, f32).

  * the Hugging Face directory loads into the Flax model with logits within 1e-4; written back, transformers
    loads it with the same logits (plain and sharded, untied and tied embeddings, llama3 RoPE scaling);
  * KV-cache decode gives the full-sequence logits; greedy ``generate`` gives transformers' greedy tokens,
    with left padding;
  * pruning by decoder layer (magnitude / Wanda / SparseGPT): reconstruction errors order SparseGPT < Wanda
    < magnitude; the sparse inference model generates the pruned dense model's tokens; its masks, exported
    and applied in torch, give the Flax sparse model's logits;
  * ``to_inference(dense_if_slower_at=...)`` routes the layers of a signature timed slower than dense to
    ``nnx.Linear`` with the same weights (timings injected), and ``llm_decode.py --dense-if-slower`` says which.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import llama  # noqa: E402
from llama.checkpoint import export_masks  # noqa: E402
from llama.checkpoint import load_pretrained  # noqa: E402
from llama.checkpoint import save_pretrained  # noqa: E402
from llama.generation import generate  # noqa: E402
from llama.prune import fuse_projections  # noqa: E402
from llama.prune import layer_errors  # noqa: E402
from llama.prune import prune  # noqa: E402
from llama.prune import to_inference  # noqa: E402

import jaxsparse  # noqa: E402
from jaxsparse import torch_interop  # noqa: E402
from jaxsparse._sparsify import _route  # noqa: E402

VOCAB = 128
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _hf_model(seed: int, *, tie: bool = False, rope: dict | None = None):
  """A tiny random LlamaForCausalLM: hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 128.

  Weights have std 0.1 (logits spread enough that greedy ties do not occur) and the RMSNorm weights are
  random too, so the projections' input features differ in scale as in trained LLMs (Wanda relies on it).
  """
  torch.manual_seed(seed)
  cfg = transformers.LlamaConfig(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, tie_word_embeddings=tie,
      rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
      bos_token_id=None, eos_token_id=None, pad_token_id=None)
  model = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(torch.exp(0.5 * torch.randn_like(p)))
  return model


def _logits(hf, ids, mask=None) -> np.ndarray:
  with torch.no_grad():
    return hf(torch.tensor(np.asarray(ids)), attention_mask=None if mask is None else torch.tensor(mask)).logits.numpy()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  hf = _hf_model(0, rope=LLAMA3_ROPE)
  path = tmp_path_factory.mktemp("hf_llama")
  hf.save_pretrained(path)
  return hf, path


@pytest.fixture(scope="module")
def ids():
  return np.random.default_rng(0).integers(0, VOCAB, (2, 12)).astype(np.int32)


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_load_and_export_match_transformers(hf_dir, ids, tmp_path):
  hf, path = hf_dir
  model = load_pretrained(path)
  ref = _logits(hf, ids)
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))), ref, atol=1e-4, rtol=0)
  # llama3 scaling matters at these positions (original context 16): plain RoPE gives other logits.
  plain = load_pretrained(path, config=dataclasses.replace(model.config, rope_scaling=None))
  assert np.abs(np.asarray(plain(jnp.asarray(ids))) - ref).max() > 1e-3
  out = save_pretrained(model, tmp_path / "plain")
  back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
  np.testing.assert_allclose(_logits(back, ids), ref, atol=1e-5, rtol=0)
  sharded = save_pretrained(model, tmp_path / "sharded", max_shard_bytes=100_000)
  assert (sharded / "model.safetensors.index.json").exists()
  np.testing.assert_array_equal(np.asarray(load_pretrained(sharded)(jnp.asarray(ids))),
                                np.asarray(model(jnp.asarray(ids))))
  back = transformers.LlamaForCausalLM.from_pretrained(sharded).eval()
  np.testing.assert_allclose(_logits(back, ids), ref, atol=1e-5, rtol=0)


def test_save_pretrained_replaces_the_checkpoint_already_there(tmp_path):
  """Saving into a directory that holds a checkpoint (sharded or not) leaves only the new one, its files readable as
  open() makes them; other files stay. A directory holding two checkpoints is refused, not read half."""
  cfg = llama.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8)
  graph, state = nnx.split(llama.LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))
  models = [nnx.merge(graph, jax.tree.map(lambda v, i=i: v + i, state)) for i in range(4)]  # 4 different models

  def weights(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))

  d = tmp_path / "ckpt"
  d.mkdir()
  (d / "tokenizer.json").write_text("{}")
  counts = []
  old = os.umask(0o022)
  try:
    for model, max_shard_bytes in zip(models, [10_000, None, 10_000, 30_000], strict=True):  # sharded, one file, ...
      save_pretrained(model, d, max_shard_bytes=max_shard_bytes)
      files = sorted(f.name for f in d.iterdir())
      if max_shard_bytes is None:
        assert files == ["config.json", "model.safetensors", "tokenizer.json"]
      else:
        shards = sorted(set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values()))
        assert files == sorted(["config.json", *shards, "model.safetensors.index.json", "tokenizer.json"])
        counts.append(len(shards))
      jax.tree.map(np.testing.assert_array_equal, weights(load_pretrained(d)), weights(model))
      assert {stat.S_IMODE(os.stat(d / f).st_mode) for f in files if f != "tokenizer.json"} == {0o644}
  finally:
    os.umask(old)
  assert counts[-2] > counts[-1] > 1, counts  # the last save left fewer shards: the others were removed
  # A directory another writer left with both layouts: neither is trusted.
  save_pretrained(models[0], tmp_path / "single")
  (d / "model.safetensors").write_bytes((tmp_path / "single" / "model.safetensors").read_bytes())
  with pytest.raises(ValueError, match=r"holds two checkpoints: model\.safetensors and the shards of "
                     r"model\.safetensors\.index\.json"):
    load_pretrained(d)
  (d / "model.safetensors").unlink()
  last = f"model-{counts[-1]:05d}-of-{counts[-1]:05d}.safetensors"
  (d / last).unlink()
  with pytest.raises(FileNotFoundError, match=re.escape(f"lists {[last]}, which are not there")):
    load_pretrained(d)


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_tied_embeddings_and_torch_interop_load(ids, tmp_path):
  hf = _hf_model(1, tie=True)
  hf.save_pretrained(tmp_path / "tied", max_shard_size="50KB")  # sharded by transformers itself
  assert (tmp_path / "tied" / "model.safetensors.index.json").exists()
  model = load_pretrained(tmp_path / "tied")
  assert model.lm_head is None
  ref = _logits(hf, ids)
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))), ref, atol=1e-4, rtol=0)
  back = transformers.LlamaForCausalLM.from_pretrained(save_pretrained(model, tmp_path / "out")).eval()
  np.testing.assert_allclose(_logits(back, ids), ref, atol=1e-5, rtol=0)
  # The same paths as torch: torch_interop.load_nnx fills the model from the torch module with no name map.
  other = llama.LlamaForCausalLM(model.config, rngs=nnx.Rngs(1))
  torch_interop.load_nnx(other, hf, ignore=("lm_head.weight",))
  np.testing.assert_allclose(np.asarray(other(jnp.asarray(ids))), ref, atol=1e-4, rtol=0)
  # A 2:4 embedding of a tied model is its LM head too (CompressedNMEmbed.attend); exported, transformers agrees.
  sparse, _ = to_inference(model, jaxsparse.NM(2, 4), head=True, embedding=jaxsparse.NM(2, 4))
  assert sparse.lm_head is None and type(sparse.model.embed_tokens).__name__ == "CompressedNMEmbed"
  x = jnp.asarray(ids)
  np.testing.assert_allclose(np.asarray(sparse(x)), np.asarray(jaxsparse.densify(sparse)(x)), atol=1e-5, rtol=0)
  back = transformers.LlamaForCausalLM.from_pretrained(save_pretrained(sparse, tmp_path / "sparse")).eval()
  np.testing.assert_allclose(_logits(back, ids), np.asarray(sparse(x)), atol=1e-4, rtol=0)
  # head=True alone gives the tied table the structure (test_tied_head_takes_nm_only_and_rules_name_the_table).
  alone, _ = to_inference(model, jaxsparse.NM(2, 4), head=True)
  np.testing.assert_array_equal(np.asarray(alone(x)), np.asarray(sparse(x)))


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_kv_cache_decode_matches_full_sequence(hf_dir, ids):
  model = load_pretrained(hf_dir[1])
  full = np.asarray(model(jnp.asarray(ids)))
  cache = llama.init_cache(model.config, 2, 16)
  step = jax.jit(lambda graphdef, state, x, c: nnx.merge(graphdef, state).step(x, c))
  graphdef, state = nnx.split(model)
  logits, cache = step(graphdef, state, jnp.asarray(ids[:, :7]), cache)
  np.testing.assert_allclose(np.asarray(logits), full[:, :7], atol=1e-5, rtol=0)
  for t in range(7, 12):
    logits, cache = step(graphdef, state, jnp.asarray(ids[:, t:t + 1]), cache)
    np.testing.assert_allclose(np.asarray(logits[:, 0]), full[:, t], atol=1e-5, rtol=0)
  assert int(cache.index) == 12 and cache.positions.tolist() == [12, 12]


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_greedy_generate_matches_transformers(hf_dir):
  hf, path = hf_dir
  model = load_pretrained(path)
  rng = np.random.default_rng(1)
  prompt = rng.integers(0, VOCAB, (3, 6)).astype(np.int32)
  mask = np.ones_like(prompt)
  mask[1, :2] = mask[2, :4] = 0  # left padding
  prompt[mask == 0] = 0
  out = np.asarray(generate(model, prompt, 12, attention_mask=mask))
  with torch.no_grad():
    ref = hf.generate(torch.tensor(prompt), attention_mask=torch.tensor(mask), max_new_tokens=12,
                      do_sample=False)[:, 6:].numpy()
  np.testing.assert_array_equal(out, ref)
  np.testing.assert_array_equal(np.asarray(generate(model, prompt[2:, 4:], 12)), ref[2:])  # the row alone
  sampled = generate(model, prompt, 5, attention_mask=mask, temperature=0.8, top_k=4, key=jax.random.key(0))
  assert sampled.shape == (3, 5) and np.all((np.asarray(sampled) >= 0) & (np.asarray(sampled) < VOCAB))


@pytest.mark.parametrize("name", [
    "2:4", "unstructured 50%",
    # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
    pytest.param("block 32x32 50%", marks=pytest.mark.slow),
])
def test_sparse_model_generates_dense_tokens(hf_dir, name):
  structure = {"2:4": jaxsparse.NM(2, 4), "unstructured 50%": jaxsparse.Unstructured(sparsity=0.5),
               "block 32x32 50%": jaxsparse.BlockSparse(density=0.5, block_shape=(32, 32))}[name]
  model = load_pretrained(hf_dir[1])
  sparse, report = to_inference(model, structure)
  assert len(report.replaced) == 14
  # Unstructured inference runs dense (the pruned weights zero): to_inference's dense_unstructured.
  expected = {"2:4": "CompressedNMLinear", "unstructured 50%": "Linear", "block 32x32 50%": "BlockSparseLinear"}[name]
  assert type(sparse.model.layers[1].mlp.down_proj).__name__ == expected
  dense = jaxsparse.densify(sparse)  # the same weights, nnx.Linear layers
  prompt = np.random.default_rng(2).integers(0, VOCAB, (2, 5))
  np.testing.assert_array_equal(np.asarray(generate(sparse, prompt, 10)), np.asarray(generate(dense, prompt, 10)))


@pytest.mark.slow  # 10-19 s on 2 cores: out of the fast set (make test <= 15 min); CI runs it
def test_sparse_head_and_embedding_generate_save_and_export(hf_dir, ids, tmp_path):
  """to_inference(head=True, embedding=NM(2, 4)): the LM head 2:4 like the projections, the embedding a
  CompressedNMEmbed; the weights shrink to 2:4's bytes, tokens equal the densified model's, and the saved directory and
  exported masks give transformers the same logits."""
  from jaxsparse._sparsify._report import state_bytes  # noqa: PLC0415

  model = load_pretrained(hf_dir[1])
  sparse, report = to_inference(model, jaxsparse.NM(2, 4), head=True, embedding=jaxsparse.NM(2, 4))
  assert type(sparse.lm_head).__name__ == "CompressedNMLinear"
  assert type(sparse.model.embed_tokens).__name__ == "CompressedNMEmbed"
  assert {c.path for c in report.replaced} >= {"lm_head", "model.embed_tokens"} and len(report.replaced) == 16
  projections_only, _ = to_inference(model, jaxsparse.NM(2, 4))
  ratio, before = state_bytes(sparse) / state_bytes(model), state_bytes(projections_only) / state_bytes(model)
  assert ratio < 0.55 < before, (ratio, before)  # float32 2:4: 0.53 of the bytes (values + 2-bit positions)
  dense = jaxsparse.densify(sparse)
  assert float(jnp.mean(dense.model.embed_tokens.embedding[...] == 0)) == 0.5
  prompt = np.random.default_rng(3).integers(0, VOCAB, (2, 5))
  np.testing.assert_array_equal(np.asarray(generate(sparse, prompt, 8)), np.asarray(generate(dense, prompt, 8)))
  x = jnp.asarray(ids)
  target = transformers.LlamaForCausalLM.from_pretrained(save_pretrained(sparse, tmp_path / "sparse")).eval()
  np.testing.assert_allclose(_logits(target, ids), np.asarray(sparse(x)), atol=1e-4, rtol=0)
  masked = transformers.LlamaForCausalLM.from_pretrained(hf_dir[1]).eval()
  masks = torch_interop.export_masks(sparse)
  assert masks["model.embed_tokens.weight_mask"].shape == (VOCAB, 64) and "lm_head.weight_mask" in masks
  torch_interop.apply_masks(masked, masks)
  np.testing.assert_allclose(_logits(masked, ids), np.asarray(sparse(x)), atol=1e-4, rtol=0)
  # Calibrated: prune(head=True) prunes the LM head last, and to_inference keeps exactly its mask.
  pruned, masks, report = prune(model, np.asarray(ids), jaxsparse.NM(2, 4), method="wanda", head=True,
                                progress=False)
  assert report.layers[-1].path == "lm_head" and sorted(layer_errors(report)) == [0, 1]
  sparse, _ = to_inference(pruned, jaxsparse.NM(2, 4), masks=masks, head=True)
  np.testing.assert_array_equal(np.asarray(sparse.lm_head.weight.mask()), np.asarray(masks["lm_head.kernel"]))
  np.testing.assert_allclose(np.asarray(sparse(x)), np.asarray(pruned(x)), atol=1e-5, rtol=0)
  with pytest.raises(ValueError, match="embedding=None keeps the embedding dense"):
    to_inference(model, jaxsparse.NM(2, 4), masks={"model.embed_tokens.embedding": np.ones((VOCAB, 64), bool)})
  with pytest.raises(ValueError, match="add an 'lm_head' rule instead"):
    to_inference(model, {"lm_head": jaxsparse.NM(2, 4)}, head=True)


@pytest.mark.slow  # long (30 s on 2 cores): moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_buffer_storage_model_generates_exports_and_saves(hf_dir, ids, tmp_path, monkeypatch):
  """2:4 layers keeping cuSPARSELt's buffer alone (to_inference's storage="auto" where cuSPARSELt reads it, faked
  here: on the CPU the routes unpack it): the same logits, tokens, masks and saved checkpoint as values and positions;
  shapes the buffer cannot hold (32 outputs) keep values, and such layers are not fused with buffer ones."""
  from jaxsparse.ops import _nm_matmul  # noqa: PLC0415

  monkeypatch.setattr(_nm_matmul, "buffer_is_cusparselt", lambda k, n, dtype: True)
  model = load_pretrained(hf_dir[1])
  buffered, _ = to_inference(model, jaxsparse.NM(2, 4))
  values, _ = to_inference(model, jaxsparse.NM(2, 4), storage="values")
  layers = {".".join(map(str, p)): n for p, n in nnx.iter_graph(buffered) if type(n).__name__ == "CompressedNMLinear"}
  storage = {p: n.storage for p, n in layers.items()}
  assert storage["model.layers.0.mlp.down_proj"] == storage["model.layers.0.self_attn.o_proj"] == "cusparselt"
  assert storage["model.layers.0.self_attn.k_proj"] == "values"  # 32 outputs: not a multiple of 64
  x = jnp.asarray(ids)
  np.testing.assert_allclose(np.asarray(buffered(x)), np.asarray(values(x)), atol=1e-6, rtol=0)
  prompt = np.random.default_rng(7).integers(0, VOCAB, (2, 5))
  np.testing.assert_array_equal(np.asarray(generate(buffered, prompt, 6)), np.asarray(generate(values, prompt, 6)))
  masks = torch_interop.export_masks(buffered)
  assert masks.keys() == torch_interop.export_masks(values).keys()
  assert all(np.array_equal(masks[k], torch_interop.export_masks(values)[k]) for k in masks)
  target = transformers.LlamaForCausalLM.from_pretrained(save_pretrained(buffered, tmp_path / "buffer")).eval()
  np.testing.assert_allclose(_logits(target, ids), np.asarray(values(x)), atol=1e-4, rtol=0)
  fused, _ = to_inference(model, jaxsparse.NM(2, 4), fuse=True)
  attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
  assert mlp.gate_up_proj.storage == "cusparselt" and hasattr(attn, "k_proj")  # q (buffer) and k, v (values) apart
  np.testing.assert_allclose(np.asarray(fused(x)), np.asarray(values(x)), atol=1e-5, rtol=0)


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_fused_projections_generate_the_same_tokens(hf_dir):
  """fuse_projections joins q / k / v and gate / up (dense, 2:4 with its positions concatenated along the outputs, or
  block-sparse); logits and greedy tokens equal the unfused model's, with and without the KV cache."""
  model = load_pretrained(hf_dir[1])
  prompt = np.random.default_rng(5).integers(0, VOCAB, (2, 5))
  ids = jnp.asarray(prompt)
  for structure in (None, jaxsparse.NM(2, 4)):
    base = nnx.clone(model) if structure is None else to_inference(model, structure)[0]
    fused = fuse_projections(nnx.clone(base)) if structure is None else to_inference(model, structure, fuse=True)[0]
    attn, mlp = fused.model.layers[1].self_attn, fused.model.layers[1].mlp
    kind = type(base.model.layers[1].self_attn.q_proj)
    assert type(attn.qkv_proj) is kind and type(mlp.gate_up_proj) is kind and type(mlp.down_proj) is kind
    assert not any(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")) and not hasattr(mlp, "up_proj")
    assert attn.qkv_proj.out_features == 64 + 2 * 32 and mlp.gate_up_proj.out_features == 2 * 128
    np.testing.assert_allclose(np.asarray(fused(ids)), np.asarray(base(ids)), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(generate(fused, prompt, 8)), np.asarray(generate(base, prompt, 8)))
  assert fuse_projections(fused) is fused  # fused already: unchanged
  # With dense_if_slower_at, the fused layers are what is timed and routed (here: the 256-output gate_up, slower).
  calls = []
  routed, report = to_inference(model, jaxsparse.NM(2, 4), fuse=True, dense_if_slower_at=(1, 8),
                                timer=_timer_slower_where(256, calls))
  assert {c[2] for c in calls} == {128, 256, 64} and report.dense_paths == (
      "model.layers.0.mlp.gate_up_proj", "model.layers.1.mlp.gate_up_proj")
  assert type(routed.model.layers[0].mlp.gate_up_proj) is nnx.Linear
  assert type(routed.model.layers[0].self_attn.qkv_proj).__name__ == "CompressedNMLinear"
  np.testing.assert_array_equal(np.asarray(generate(routed, prompt, 8)), np.asarray(generate(base, prompt, 8)))
  # Block-sparse: the masks side by side, the kept blocks in the joined matrix's order; its outputs those of the
  # separate layers.
  blocks = jaxsparse.BlockSparse(density=0.5, block_shape=(32, 32))
  base, _ = to_inference(model, blocks)
  fused, _ = to_inference(model, blocks, fuse=True)
  attn, ref = fused.model.layers[0].self_attn, base.model.layers[0].self_attn
  assert type(attn.qkv_proj).__name__ == "BlockSparseLinear" and not hasattr(attn, "q_proj")
  names = ("q_proj", "k_proj", "v_proj")
  assert attn.qkv_proj.nnz_blocks == sum(getattr(ref, n).nnz_blocks for n in names)
  joined = np.concatenate([np.asarray(getattr(ref, n).sparse_kernel.to_dense()) for n in names], axis=1)
  np.testing.assert_array_equal(np.asarray(attn.qkv_proj.sparse_kernel.to_dense()), joined)
  np.testing.assert_allclose(np.asarray(fused(ids)), np.asarray(base(ids)), atol=1e-5, rtol=0)


def _timer_slower_where(out_features: int, calls: list | None = None):
  """A fake ``(layer, x) -> ms``: dense layers 1.0; sparse ones with ``out_features`` 1.5 at batch 8 (faster, 0.9, at
  batch 1: slower at one batch is enough), those of 64 outputs (down, q, o) 1.02 (within the 3% margin), others 0.5."""

  def timer(layer, x):
    if calls is not None:
      calls.append((type(layer).__name__, layer.in_features, layer.out_features, x.shape[0]))
    if type(layer) is nnx.Linear:
      return 1.0
    if layer.out_features == out_features:
      return 1.5 if x.shape[0] == 8 else 0.9
    return 1.02 if layer.out_features == 64 else 0.5

  return timer


def test_dense_if_slower_routes_slower_signatures_to_dense(hf_dir):
  model = load_pretrained(hf_dir[1])
  reference, _ = to_inference(model, jaxsparse.NM(2, 4))
  calls = []
  sparse, report = to_inference(model, jaxsparse.NM(2, 4), dense_if_slower_at=(1, 8),
                                timer=_timer_slower_where(128, calls))
  assert len(report.replaced) == 14  # sparsify's report as before
  # One sparse and one dense timing per signature and batch: q / o, k / v, gate / up, down.
  assert len(report.timings) == 4 and len(calls) == 16
  assert [str(s) for s in report.routed_to_dense] == ["CompressedNMLinear 64x128 2:4 50% kept float32"]
  assert report.dense_paths == tuple(f"model.layers.{i}.mlp.{p}_proj" for i in (0, 1) for p in ("gate", "up"))
  x = jax.random.normal(jax.random.key(0), (3, 64))
  for i in (0, 1):
    layer, ref = sparse.model.layers[i], reference.model.layers[i]
    for name in ("gate_proj", "up_proj"):  # slower at batch 8: dense, holding exactly the pruned weights
      routed, before = getattr(layer.mlp, name), getattr(ref.mlp, name)
      assert type(routed) is nnx.Linear
      np.testing.assert_array_equal(np.asarray(routed.kernel[...]), np.asarray(before.to_dense().kernel[...]))
      np.testing.assert_array_equal(np.asarray(routed(x)), np.asarray(before(x)))
    assert type(layer.mlp.down_proj).__name__ == "CompressedNMLinear"  # 2% slower: within the margin
    assert type(layer.self_attn.k_proj).__name__ == "CompressedNMLinear"  # faster
  up = jaxsparse.layer_signature(reference.model.layers[0].mlp.up_proj)
  assert "| dense |" in str(report) and up in report.routed_to_dense
  with pytest.raises(ValueError, match="batches must be positive ints"):
    to_inference(model, jaxsparse.NM(2, 4), dense_if_slower_at=0, timer=_timer_slower_where(128))


def test_dense_if_slower_settles_the_near_signatures_by_the_step(hf_dir):
  """With a step timer, the signatures within 15% of dense alone (q / o and down, 1.02) are timed in the model's
  step; here down_proj is slower sparse in the step (routed dense), q / o no different (kept sparse)."""
  model = load_pretrained(hf_dir[1])
  steps = []

  def step_timer(m):
    kinds = [type(layer.mlp.down_proj).__name__ for layer in m.model.layers]
    steps.append(kinds)
    return 10.0 + sum(2.0 if k == "CompressedNMLinear" else 1.0 for k in kinds)

  sparse, report = to_inference(model, jaxsparse.NM(2, 4), dense_if_slower_at=8, timer=_timer_slower_where(128),
                                step_timer=step_timer)
  by_shape = {t.signature.shape: t for t in report.timings}
  assert by_shape[(128, 64)].dense and by_shape[(128, 64)].step_ms == {"sparse": 14.0, "dense": 12.0}
  assert not by_shape[(64, 64)].dense and by_shape[(64, 64)].step_ms == {"sparse": 12.0, "dense": 12.0}
  assert by_shape[(64, 128)].dense and by_shape[(64, 128)].step_ms is None  # 1.5 alone: outside the band
  assert all(type(layer.mlp.down_proj) is nnx.Linear for layer in sparse.model.layers)
  assert all(type(layer.self_attn.q_proj).__name__ == "CompressedNMLinear" for layer in sparse.model.layers)
  assert len(steps) == 3 and "step sparse / dense ms" in report.timing_table()


def test_time_forward_ms_times_sparse_layer_and_dense_twin():
  w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(jax.random.key(0), (64, 32)), 2, 4)
  layer = jaxsparse.layers.CompressedNMLinear(w)
  x = jnp.ones((4, 64))
  assert _route.time_forward_ms(layer, x) > 0 and _route.time_forward_ms(layer.to_dense(), x) > 0


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_pruning_by_layer_and_masks_back_to_torch(hf_dir, ids, tmp_path):
  path = hf_dir[1]
  model = load_pretrained(path)
  calibration = np.random.default_rng(3).integers(0, VOCAB, (16, 32))
  errors, results = {}, {}
  for method in ("magnitude", "wanda", "sparsegpt"):
    pruned, masks, report = prune(model, calibration, jaxsparse.NM(2, 4), method=method, progress=False)
    assert [r.group for r in report.layers] == [0] * 7 + [1] * 7  # sequential, one decoder layer per group
    assert all(m.mean() == 0.5 for m in masks.values()) and len(masks) == 14
    errors[method] = layer_errors(report)
    results[method] = pruned, masks
  total = {m: sum(e.values()) for m, e in errors.items()}
  assert total["sparsegpt"] < total["wanda"] < total["magnitude"], errors
  assert all(errors["sparsegpt"][i] < errors["magnitude"][i] for i in range(2)), errors

  for method in ("wanda", "sparsegpt"):
    pruned, masks = results[method]
    sparse, _ = to_inference(pruned, jaxsparse.NM(2, 4), masks=masks)
    flax_logits = np.asarray(sparse(jnp.asarray(ids)))
    np.testing.assert_allclose(flax_logits, np.asarray(pruned(jnp.asarray(ids))), atol=1e-5, rtol=0)
    torch_masks = torch_interop.export_masks(sparse)
    assert sorted(torch_masks)[0] == "model.layers.0.mlp.down_proj.weight_mask"
    if method == "wanda":  # kept weights unchanged: the original torch model pruned with the masks
      target = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    else:  # SparseGPT updated the kept weights: write them, then prune the loaded copy with the masks
      target = transformers.LlamaForCausalLM.from_pretrained(save_pretrained(sparse, tmp_path / method)).eval()
    torch_interop.apply_masks(target, torch_masks)
    np.testing.assert_allclose(_logits(target, ids), flax_logits, atol=1e-4, rtol=0)


def test_masks_of_a_fused_model_have_hugging_face_names(hf_dir):
  """llama.checkpoint.export_masks of a fused 2:4 model (qkv_proj / gate_up_proj) splits the masks back, as
  save_pretrained splits the weights: each is the nonzeros of its projection's rows of the fused kernel, and a
  transformers model takes them all."""
  model = load_pretrained(hf_dir[1])
  fused, _ = to_inference(model, jaxsparse.NM(2, 4), fuse=True)
  masks = export_masks(fused)
  assert not any("qkv_proj" in k or "gate_up_proj" in k for k in masks) and len(masks) == 14, sorted(masks)
  dense = jaxsparse.densify(fused)
  for i, layer in enumerate(dense.model.layers):  # torch layout: the fused kernel's outputs are its rows
    qkv, gate_up = np.asarray(layer.self_attn.qkv_proj.kernel[...]).T, np.asarray(layer.mlp.gate_up_proj.kernel[...]).T
    for name, rows in (("self_attn.q_proj", qkv[:64]), ("self_attn.k_proj", qkv[64:96]), ("self_attn.v_proj", qkv[96:]),
                       ("mlp.gate_proj", gate_up[:128]), ("mlp.up_proj", gate_up[128:])):
      np.testing.assert_array_equal(masks[f"model.layers.{i}.{name}.weight_mask"].numpy(), rows != 0, err_msg=name)
  target = transformers.LlamaForCausalLM.from_pretrained(hf_dir[1]).eval()
  torch_interop.apply_masks(target, masks)  # strict: every name is a module of the torch model
  assert float((target.model.layers[1].self_attn.k_proj.weight == 0).float().mean()) == 0.5
  # A fused layer whose outputs are not the config's cannot be split: said, not written under wrong names.
  fused.config = dataclasses.replace(fused.config, intermediate_size=96)
  with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_up_proj\.weight_mask: shape \(256, 64\), whose "
                     r"256 rows \(outputs\) are not those of the fused gate_proj 96 \+ up_proj 96"):
    export_masks(fused)


@pytest.mark.slow  # about 10 s on 2 cores
def test_masks_of_fused_models_prune_torch_to_the_flax_logits(hf_dir, ids):
  """The split masks of fused 2:4 and block-sparse models equal the unfused models' and prune the original torch
  model (magnitude pruning keeps the kept weights) to the fused Flax model's logits."""
  model = load_pretrained(hf_dir[1])
  for structure in (jaxsparse.NM(2, 4), jaxsparse.BlockSparse(density=0.5, block_shape=(32, 32))):
    fused, _ = to_inference(model, structure, fuse=True)
    assert hasattr(fused.model.layers[0].self_attn, "qkv_proj") and hasattr(fused.model.layers[0].mlp, "gate_up_proj")
    masks = export_masks(fused)
    unfused = torch_interop.export_masks(to_inference(model, structure)[0])
    assert sorted(masks) == sorted(unfused), sorted(masks)
    for name, mask in masks.items():
      np.testing.assert_array_equal(mask.numpy(), unfused[name].numpy(), err_msg=name)
    target = transformers.LlamaForCausalLM.from_pretrained(hf_dir[1]).eval()
    torch_interop.apply_masks(target, masks)
    np.testing.assert_allclose(_logits(target, ids), np.asarray(fused(jnp.asarray(ids))), atol=1e-4, rtol=0)


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_llm_decode_benchmark_tiny(tmp_path, monkeypatch, capsys):
  """benchmarks/llm_decode.py --tiny, dense and 2:4 (the other structures generate in the test above); --layers 1
  of the tiny shape's 2 also runs the 0-layer model and the extrapolation to full depth; --dense-if-slower (timings
  injected: layers of 256 outputs slower) adds the column of the projections routed to dense: the fused q / k / v
  (128 + 2 x 64 outputs) by default, gate and up (256 each) with --no-fuse."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import llm_decode  # noqa: PLC0415

  monkeypatch.setattr(_route, "time_forward_ms", _timer_slower_where(256))
  monkeypatch.setenv("OUT", str(tmp_path))
  llm_decode.ROWS.clear()
  llm_decode.main(["--tiny", "--layers", "1", "--batches", "8", "--patterns", "2:4,dense", "--dense-if-slower"])
  rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| tiny")]
  assert [(r.split("|")[2].strip(), r.split("|")[-2].strip()) for r in rows] == [
      ("dense", "-"), ("2:4", "k_proj 1, q_proj 1, v_proj 1")], rows
  assert all("(extrapolated)" in r for r in rows)
  # Decoder layers' bytes over dense's: 2:4 holds 0.5625x in its sparse projections (q / k / v went dense here).
  layer_ratio = {r.split("|")[2].strip(): float(r.split("|")[6].strip().rstrip("x")) for r in rows}
  assert layer_ratio["dense"] == 1.0 and 0.5625 < layer_ratio["2:4"] < 1.0, rows
  assert "| tiny | dense |" in (tmp_path / "llm_decode.md").read_text()
  assert "layers routed to dense" in (tmp_path / "llm_decode.md").read_text()
  llm_decode.ROWS.clear()
  llm_decode.main(["--tiny", "--layers", "1", "--batches", "8", "--patterns", "2:4", "--dense-if-slower", "--no-fuse",
                   "--prefill", "0"])
  rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| tiny")]
  assert [r.split("|")[-2].strip() for r in rows] == ["gate_proj 1, up_proj 1"], rows
  assert "projections not fused" in (tmp_path / "llm_decode.md").read_text()
  # per-batch: one model per decode batch, routed at that batch alone (the fused q / k / v are slower at 8, not at 1).
  llm_decode.ROWS.clear()
  llm_decode.main(["--tiny", "--layers", "2", "--batches", "1,8", "--patterns", "dense,2:4", "--dense-if-slower",
                   "per-batch", "--prefill", "0"])  # full depth: tokens/s measured, not extrapolated
  rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| tiny")]
  routed = rows[1].split("|")[-2].strip()
  assert routed.startswith("b=1: none (") and "; b=8: k_proj 2, q_proj 2, v_proj 2 (" in routed, rows
  assert all(float(r.split("|")[c].strip()) > 0 for r in rows for c in (9, 11)), rows  # tokens/s at both batches
  assert "one model per decode batch" in (tmp_path / "llm_decode.md").read_text()
  # step: per-batch, with o_proj (128 x 128, 1.05 alone) settled by timing the tiny model's decode step for real.
  near = _timer_slower_where(256)
  monkeypatch.setattr(_route, "time_forward_ms",
                      lambda layer, x: 1.05 if (layer.in_features, layer.out_features) == (128, 128) and
                      type(layer) is not nnx.Linear else near(layer, x))
  llm_decode.ROWS.clear()
  llm_decode.main(["--tiny", "--layers", "1", "--batches", "8", "--patterns", "2:4", "--dense-if-slower", "step",
                   "--prefill", "0"])
  out = capsys.readouterr().out
  md = (tmp_path / "llm_decode.md").read_text()
  assert "step sparse / dense ms" in out and "settled by the decode step's time" in md, out
  routed = next(r for r in out.splitlines() if r.startswith("| tiny")).split("|")[-2]
  assert all(f"{p}_proj 1" in routed for p in "qkv"), out  # 1.5 alone: outside the band; o_proj as the step says
  # --head sparse --embedding 2:4: the LM head 2:4 too and the embedding a CompressedNMEmbed, each sparse pattern with
  # its own 0-layer model: the whole model at 2:4's bytes (0.5625x in bfloat16, the norms aside).
  llm_decode.ROWS.clear()
  llm_decode.main(["--tiny", "--layers", "1", "--batches", "8", "--patterns", "dense,2:4", "--head", "sparse",
                   "--embedding", "2:4", "--prefill", "0"])
  out = capsys.readouterr().out
  rows = [r for r in out.splitlines() if r.startswith("| tiny")]
  weight = {r.split("|")[2].strip(): float(r.split("|")[5].strip().rstrip("x")) for r in rows}
  assert weight["dense"] == 1.0 and 0.5625 <= weight["2:4"] < 0.57, rows
  assert "0-layer model (embedding, norm, LM head) of 2:4" in "\n".join(llm_decode.LOG), llm_decode.LOG[-20:]
  assert "LM head: the pattern's structure" in (tmp_path / "llm_decode.md").read_text()
  # Without the option: the table as before, no such column.
  args = SimpleNamespace(batches=[8], prefill=32, steps=4, dense_if_slower=False)
  assert "routed" not in llm_decode.table(args, llm_decode.ROWS)
  # A time that could not be extrapolated (the layers below the noise) reads "-", not a negative tokens/s.
  rows = [llm_decode.Row("tiny", "dense", 1, 2, 1e6, 0.0, 5e5, float("nan"), {8: 1e-3}),
          llm_decode.Row("tiny", "2:4", 1, 2, 6e5, 0.0, 3e5, 2e-3, {8: float("nan")})]
  cells = [[c.strip() for c in line.split("|")[7:11]] for line in llm_decode.table(args, rows).splitlines()[2:]]
  assert cells == [["-", "-", "32000.0", "1.00x"], ["2.00", "-", "-", "-"]], cells
  # A tied model (tiny-tied, as the 3.2-1b shape): the logits are the 2:4 table's product, the whole model at 2:4's
  # bytes; the 0-layer model's sparsify (no projections to match) warns nothing.
  llm_decode.ROWS.clear()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    llm_decode.main(["--tiny", "--shapes", "tiny-tied", "--layers", "1", "--batches", "2", "--patterns", "dense,2:4",
                     "--head", "sparse", "--embedding", "2:4", "--prefill", "0"])
  rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| tiny-tied")]
  weight = {r.split("|")[2].strip(): float(r.split("|")[5].strip().rstrip("x")) for r in rows}
  assert weight["dense"] == 1.0 and 0.5625 <= weight["2:4"] < 0.57, rows
  assert not [w for w in caught if "matched no" in str(w.message)], [str(w.message) for w in caught]
  with pytest.raises(SystemExit):
    llm_decode.main(["--tiny", "--shapes", "8b"])  # --tiny runs the tiny shapes only


def test_llm_prune_benchmark_tiny(tmp_path, monkeypatch, capsys):
  """examples/llama/prune_timing.py --tiny, one layer, the two methods that compile fast (SparseGPT runs above)."""
  from llama import prune_timing  # noqa: PLC0415

  monkeypatch.setenv("OUT", str(tmp_path))
  prune_timing.main(["--tiny", "--layers", "1", "--methods", "magnitude,wanda", "--no-progress"])
  rows = [r for r in (tmp_path / "llm_prune.md").read_text().splitlines() if r.startswith("| ") and "method" not in r]
  assert [r.split("|")[1].strip() for r in rows] == ["magnitude", "wanda"], rows
  errors = [float(r.split("|")[3]) for r in rows]
  assert 0 < errors[1] < errors[0] < 1, errors


# -------------------------------------------------------------------------------------------------
# Bug bash: checkpoint variants and errors, export, generate's arguments, the KV cache's bounds.
# -------------------------------------------------------------------------------------------------


def _tiny_model(*, seed: int = 0, layers: int = 2) -> llama.LlamaForCausalLM:
  cfg = llama.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)
  return llama.LlamaForCausalLM(cfg, init_std=0.1, rngs=nnx.Rngs(seed))


def test_linear_rope_head_dim_biases_and_no_kv_heads_match_transformers(ids, tmp_path):
  """A config.json with rope_type "linear", head_dim 32 (not hidden / heads = 16), attention and MLP biases, and no
  num_key_value_heads (all heads are KV heads) loads with transformers' logits (f32, 1e-4) and exports back; a RoPE
  type that is not implemented ("yarn") is refused by name."""
  torch.manual_seed(4)
  cfg = transformers.LlamaConfig(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
      head_dim=32, attention_bias=True, mlp_bias=True, max_position_embeddings=64, initializer_range=0.1,
      rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, rms_norm_eps=1e-5,
      bos_token_id=None, eos_token_id=None, pad_token_id=None)
  hf = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.copy_(torch.exp(0.5 * torch.randn_like(p)))
  hf.save_pretrained(tmp_path / "hf")
  config = json.loads((tmp_path / "hf" / "config.json").read_text())
  del config["num_key_value_heads"]
  (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
  model = load_pretrained(tmp_path / "hf")
  assert model.config.num_key_value_heads == 4 and model.config.head_dim == 32
  long_ids = np.random.default_rng(4).integers(0, VOCAB, (2, 40)).astype(np.int32)  # positions where scaling shows
  ref = _logits(hf, long_ids)
  forward = nnx.jit(lambda m, x: m(x))  # one compile: faster than the eager forward op by op
  np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(long_ids))), ref, atol=1e-4, rtol=0)
  back = transformers.LlamaForCausalLM.from_pretrained(save_pretrained(model, tmp_path / "out")).eval()
  np.testing.assert_allclose(_logits(back, long_ids), ref, atol=1e-4, rtol=0)
  config["rope_parameters"] = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}
  with pytest.raises(ValueError, match=r"rope_scaling type 'yarn' is not implemented; only \['default', 'dynamic'"):
    llama.LlamaConfig.from_dict(config)
  config["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0}
  with pytest.raises(ValueError, match=r"needs the numbers.*\['low_freq_factor', 'high_freq_factor', 'original_max"):
    llama.LlamaConfig.from_dict(config)


@pytest.mark.slow  # about 25 s on 2 cores (transformers and a jitted step)
def test_dynamic_ntk_rope_matches_transformers_past_max_position_embeddings(tmp_path):
  """rope_type "dynamic" (dynamic NTK: the base rescaled from the current length once it exceeds
  max_position_embeddings = 16) was refused. Logits match transformers' (f32, 1e-4) for a prefill of 18 tokens, 4
  decode steps with the KV cache (transformers with its own cache: each step's frequencies from the length so far,
  cached keys as they were rotated), and a whole sequence of 26 tokens without cache."""
  torch.manual_seed(5)
  cfg = transformers.LlamaConfig(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, max_position_embeddings=16, initializer_range=0.1,
      rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
      bos_token_id=None, eos_token_id=None, pad_token_id=None)
  hf = transformers.LlamaForCausalLM(cfg).eval()
  hf.save_pretrained(tmp_path / "hf")
  model = load_pretrained(tmp_path / "hf")
  assert model.config.rope == {"rope_type": "dynamic", "factor": 4.0}
  ids = np.random.default_rng(5).integers(0, VOCAB, (2, 26)).astype(np.int32)
  graphdef, state = nnx.split(model)
  step = jax.jit(lambda s, x, c: nnx.merge(graphdef, s).step(x, c))
  cache = llama.init_cache(model.config, 2, 26)
  logits, cache = step(state, jnp.asarray(ids[:, :18]), cache)
  with torch.no_grad():  # transformers keeps the longest length seen: its calls go from short to long, as ours
    out = hf(torch.tensor(ids[:, :18]), use_cache=True)
  np.testing.assert_allclose(np.asarray(logits), out.logits.numpy(), atol=1e-4, rtol=0)
  past = out.past_key_values
  for t in range(18, 22):
    logits, cache = step(state, jnp.asarray(ids[:, t:t + 1]), cache)
    with torch.no_grad():
      out = hf(torch.tensor(ids[:, t:t + 1]), past_key_values=past, use_cache=True)
    past = out.past_key_values
    np.testing.assert_allclose(np.asarray(logits), out.logits.numpy(), atol=1e-4, rtol=0, err_msg=f"step {t}")
  full = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids)))
  ref = _logits(hf, ids)
  np.testing.assert_allclose(full, ref, atol=1e-4, rtol=0)
  # The scaling matters here: plain RoPE gives other logits past position 16. Up to 16 tokens the frequencies are
  # plain ones (a fresh transformers model: this one keeps the 26 tokens' frequencies, see rope_frequencies_at).
  plain = load_pretrained(tmp_path / "hf", config=dataclasses.replace(model.config, rope_scaling=None))
  assert np.abs(np.asarray(plain(jnp.asarray(ids))) - ref).max() > 1e-3
  fresh = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids[:, :16]))), _logits(fresh, ids[:, :16]), atol=1e-4,
                             rtol=0)


def _edit_index(directory: Path, edit) -> None:
  path = directory / "model.safetensors.index.json"
  path.write_text(edit(path.read_text()))


def test_checkpoint_errors_name_the_tensor_and_the_file(tmp_path):
  """A sharded checkpoint whose index is wrong fails with the tensor and the file named, never half read: a tensor its
  shard does not hold, a tensor listed twice in different shards (json would keep the last silently), no weight_map, the
  embedding missing; a directory without config.json says so."""
  import shutil  # noqa: PLC0415

  good = save_pretrained(_tiny_model(), tmp_path / "good", max_shard_bytes=40_000)
  weight_map = json.loads((good / "model.safetensors.index.json").read_text())["weight_map"]
  files = sorted(set(weight_map.values()))
  name = "model.layers.0.mlp.up_proj.weight"
  other = next(f for f in files if f != weight_map[name])

  def variant(label, edit):
    directory = tmp_path / label
    shutil.copytree(good, directory)
    _edit_index(directory, edit)
    return directory

  moved = variant("moved", lambda s: s.replace(f'"{name}": "{weight_map[name]}"', f'"{name}": "{other}"'))
  with pytest.raises(ValueError, match=re.escape(f"places ['{name}'] in {other}, which does not hold it")):
    load_pretrained(moved)
  twice = variant("twice", lambda s: s.replace('"weight_map": {', f'"weight_map": {{\n "{name}": "{other}",'))
  listed = f"lists the tensor '{name}' twice, in '{other}' and '{weight_map[name]}'"
  with pytest.raises(ValueError, match=re.escape(listed)):
    load_pretrained(twice)
  with pytest.raises(ValueError, match="has no weight_map"):
    load_pretrained(variant("no_map", lambda s: '{"metadata": {}}'))
  embed = "model.embed_tokens.weight"
  no_embed = variant("no_embed", lambda s: s.replace(f'"{embed}": "{weight_map[embed]}",', ""))
  with pytest.raises(ValueError, match=re.escape(f"tensors missing from the checkpoint: ['{embed}']")):
    load_pretrained(no_embed)
  (no_embed / "config.json").unlink()
  with pytest.raises(FileNotFoundError, match=r"has no config\.json: not a Hugging Face model directory"):
    load_pretrained(no_embed)
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(load_pretrained(good), nnx.Param)),
               nnx.to_pure_dict(nnx.state(_tiny_model(), nnx.Param)))


def test_save_pretrained_failure_leaves_the_old_checkpoint(tmp_path, monkeypatch):
  """A save that fails while writing its shards (disk full, ...) leaves the old checkpoint whole, not its index over a
  mix of new and old shards, and no temporary file."""
  import safetensors.numpy  # noqa: PLC0415

  old, new = _tiny_model(seed=0), _tiny_model(seed=1)
  directory = save_pretrained(old, tmp_path / "ckpt", max_shard_bytes=40_000)
  before = sorted(f.name for f in directory.iterdir())
  assert len(before) > 3  # sharded: config, index, several shards
  real, calls = safetensors.numpy.save_file, []

  def failing(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise OSError(28, "No space left on device")
    return real(*args, **kwargs)

  monkeypatch.setattr(safetensors.numpy, "save_file", failing)
  with pytest.raises(OSError, match="No space left"):
    save_pretrained(new, directory, max_shard_bytes=40_000)
  assert sorted(f.name for f in directory.iterdir()) == before
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(load_pretrained(directory), nnx.Param)),
               nnx.to_pure_dict(nnx.state(old, nnx.Param)))


def test_save_pretrained_of_a_fused_model_writes_hugging_face_projections(hf_dir, ids, tmp_path):
  """save_pretrained of a fused model (fuse_projections, to_inference(fuse=True)) writes q / k / v and gate / up apart,
  as transformers has them (it would otherwise load qkv_proj as unexpected and draw q / k / v at random, warning
  only)."""
  hf, path = hf_dir
  model = load_pretrained(path)
  fused = fuse_projections(nnx.clone(model))  # dense: the outputs of the model before (test_fused_projections_...)
  assert hasattr(fused.model.layers[0].self_attn, "qkv_proj") and hasattr(fused.model.layers[0].mlp, "gate_up_proj")
  out = save_pretrained(fused, tmp_path / "fused")
  back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
  np.testing.assert_allclose(_logits(back, ids), _logits(hf, ids), atol=1e-5, rtol=0)
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(load_pretrained(out), nnx.Param)),
               nnx.to_pure_dict(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"max_new_tokens": 2.7}, ValueError, "max_new_tokens must be an int >= 1, got 2.7"),
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be an int >= 1, got 0"),
    ({"temperature": float("nan")}, ValueError, "temperature must be a finite number >= 0"),
    ({"temperature": float("inf"), "key": "key"}, ValueError, "temperature must be a finite number >= 0"),
    ({"top_k": 2.5, "temperature": 1.0, "key": "key"}, ValueError, r"top_k must be an int in \[1, vocab_size=128\]"),
    ({"top_p": 0.0, "temperature": 1.0, "key": "key"}, ValueError, r"top_p must be a number in \(0, 1\]"),
    ({"top_p": 1.5, "temperature": 1.0, "key": "key"}, ValueError, r"top_p must be a number in \(0, 1\]"),
    ({"eos_token_id": VOCAB}, ValueError, r"eos_token_id must be a token id in \[0, vocab_size=128\)"),
    ({"eos_token_id": -1}, ValueError, r"eos_token_id must be a token id in \[0, vocab_size=128\)"),
    ({"prompt_ids": [[1, 2, VOCAB + 100]]}, ValueError, r"prompt_ids must be token ids in \[0, vocab_size=128\), "
     r"got ids from 1 to 228"),
    ({"prompt_ids": [[-1, 2, 3]]}, ValueError, r"prompt_ids must be token ids in \[0, vocab_size=128\)"),
    ({"prompt_ids": [[1.5, 2.0]]}, TypeError, "prompt_ids must hold integer token ids, got dtype float64"),
    ({"prompt_ids": np.zeros((2, 0), np.int32)}, ValueError, "prompt_ids must hold at least one token"),
    ({"attention_mask": [[1, 1, 1, 0], [1, 1, 1, 1]]}, ValueError, r"attention_mask is 0 on the last token of rows "
     r"\[0\].*pad on the left"),
    ({"attention_mask": [[0, 0, 0, 0], [1, 1, 1, 1]]}, ValueError, r"attention_mask is 0 on the last token of rows "
     r"\[0\]"),
    ({"attention_mask": [1, 1, 1, 1]}, ValueError, r"attention_mask must have prompt_ids' shape \(2, 4\), got \(4,\)"),
    ({"temperature": 1.0, "key": 0}, TypeError, r"key must be one PRNG key, jax.random.key\(seed\), got 0"),
    ({"cache_dtype": jnp.int32}, ValueError, r"cache_dtype must be a floating-point dtype \(None: the model's "
     r"float32\), got int32"),
])
def test_generate_refuses_bad_arguments(kwargs, error, match):
  """Each of these used to run: a float max_new_tokens truncated, a NaN temperature giving token 0, out-of-range ids NaN
  logits (negative ones wrapped around), float ids truncated, an unmatchable eos id, right padding continuing from a pad
  token, an int cache_dtype truncating the cached keys and values (other tokens); or failed deep in JAX (a mask of
  another shape, an empty prompt, a float top_k, an int seed for key)."""
  model = _tiny_model()
  kwargs = {"prompt_ids": np.arange(8, dtype=np.int32).reshape(2, 4), "max_new_tokens": 3, **kwargs}
  if kwargs.get("key") == "key":
    kwargs["key"] = jax.random.key(0)
  with pytest.raises(error, match=match):
    generate(model, **kwargs)


@pytest.mark.slow  # two generate compiles, about 5 s on 2 cores
def test_generate_stops_at_any_of_a_list_of_eos_ids():
  """eos_token_id may be a list (Llama 3's config.json lists several; it used to fail hashing the static argument):
  each row stops at the first of them it generates and repeats it."""
  model = _tiny_model(layers=1)
  prompt = np.random.default_rng(6).integers(0, VOCAB, (2, 5))
  greedy = np.asarray(generate(model, prompt, 8))
  eos = [int(greedy[0, 2]), int(greedy[1, 4])]
  expected = greedy.copy()
  for row in expected:
    stop = np.flatnonzero(np.isin(row, eos))[0]
    row[stop + 1:] = row[stop]
  assert not np.array_equal(expected, greedy)
  np.testing.assert_array_equal(np.asarray(generate(model, prompt, 8, eos_token_id=eos)), expected)


def test_select_token_top_p_keeps_what_transformers_keeps():
  """top_p (new: generate had top_k only) keeps the tokens Hugging Face's TopPLogitsWarper keeps, the fewest whose
  probabilities reach top_p, after temperature and top_k; top_p near 0 keeps the most likely token alone."""
  from llama.generation import select_token  # noqa: PLC0415

  logits = jnp.asarray([[3.0, 2.6, 2.5, 2.0, 1.0, 0.5, 0.4, -1.0]])
  hf_logits = torch.tensor(np.asarray(logits)) / 0.7
  for warper in (transformers.TopKLogitsWarper(6), transformers.TopPLogitsWarper(0.8)):
    hf_logits = warper(None, hf_logits)
  kept = set(np.flatnonzero(np.isfinite(hf_logits.numpy()[0])).tolist())
  assert 1 < len(kept) < 6, kept  # top_p cuts inside top_k's set
  keys = jax.random.split(jax.random.key(2), 500)
  samples = jax.jit(jax.vmap(lambda k: select_token(logits, k, temperature=0.7, top_k=6, top_p=0.8)))(keys)
  assert set(np.asarray(samples).ravel().tolist()) == kept
  rows = jax.random.normal(jax.random.key(3), (16, VOCAB))
  nearest = jax.jit(lambda x: select_token(x, jax.random.key(4), temperature=1.0, top_k=None, top_p=1e-6))(rows)
  np.testing.assert_array_equal(np.asarray(nearest), np.asarray(jnp.argmax(rows, -1)))


def test_model_refuses_bad_ids_and_a_full_cache():
  """An id outside the vocabulary used to give NaN logits; a step past the cache's end overwrote its last slot (the
  logits of a wrong context). Eagerly both raise; under jit, where the cache index is traced, the overflowing step's
  logits are NaN."""
  model = _tiny_model(layers=1)
  with pytest.raises(ValueError, match=r"input_ids must be token ids in \[0, vocab_size=128\), got ids from 1 to 300"):
    model(jnp.asarray([[1, 300]]))
  graphdef, state = nnx.split(model)
  step = jax.jit(lambda s, x, c: nnx.merge(graphdef, s).step(x, c))
  logits, cache = step(state, jnp.ones((2, 5), jnp.int32), llama.init_cache(model.config, 2, 6))
  logits, cache = step(state, jnp.ones((2, 1), jnp.int32), cache)
  assert np.isfinite(np.asarray(logits)).all() and int(cache.index) == 6
  logits, _ = step(state, jnp.ones((2, 1), jnp.int32), cache)
  assert np.isnan(np.asarray(logits)).all()
  with pytest.raises(ValueError, match="the cache is full: 6 of its 6 slots used, 1 more tokens do not fit"):
    model.step(jnp.ones((2, 1), jnp.int32), cache)  # eager: the cache index is concrete
  with pytest.raises(ValueError, match=r"input_ids \(2, 7\) do not fit the cache of batch 2 and 6 slots"):
    model.step(jnp.ones((2, 7), jnp.int32), llama.init_cache(model.config, 2, 6))


def test_tied_config_over_a_different_lm_head_loads_as_transformers_does(ids, tmp_path):
  """config.json ties the embeddings but the checkpoint holds an lm_head.weight of other values: transformers keeps
  that head (it does not tie them), and so does load_pretrained now, with a warning (it used to drop the head
  silently: other logits). A head equal to the embedding stays tied."""
  from safetensors.numpy import load_file  # noqa: PLC0415
  from safetensors.numpy import save_file  # noqa: PLC0415

  hf = _hf_model(2, tie=True)
  hf.save_pretrained(tmp_path / "hf")
  file = tmp_path / "hf" / "model.safetensors"
  tensors = load_file(file)
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
  save_file(tensors, file, metadata={"format": "pt"})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert load_pretrained(tmp_path / "hf").lm_head is None  # equal: tied, no warning
  head = np.random.default_rng(2).normal(0, 0.1, tensors["lm_head.weight"].shape)
  tensors["lm_head.weight"] = head.astype(np.float32)
  save_file(tensors, file, metadata={"format": "pt"})
  ref = _logits(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval(), ids)
  with pytest.warns(UserWarning, match="holds an lm_head.weight that differs from model.embed_tokens.weight"):
    model = load_pretrained(tmp_path / "hf")
  assert model.lm_head is not None and not model.config.tie_word_embeddings
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))), ref, atol=1e-4, rtol=0)
  back = transformers.LlamaForCausalLM.from_pretrained(save_pretrained(model, tmp_path / "out")).eval()
  np.testing.assert_allclose(_logits(back, ids), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("edit", "match"), [
    ({"model_type": "mistral", "sliding_window": 4}, r"sliding_window=4: Mistral's sliding-window attention is not "
     r"implemented"),
    ({"model_type": "qwen2"}, r"model_type='qwen2' is not implemented: only \['llama', 'mistral'\]"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, r"quantization_config \(quant_method='gptq'\): "
     "quantized checkpoints are not implemented"),
    ({"vocab_size": None}, r"the config has no \['vocab_size'\]"),
    ({"num_attention_heads": "4"}, r"num_attention_heads must be an int >= 1, got '4'"),
    ({"num_key_value_heads": 0}, r"num_key_value_heads must be an int >= 1, got 0"),
    ({"head_dim": 15}, r"head_dim=15 must be even"),
    ({"rms_norm_eps": -1e-6}, r"rms_norm_eps must be a finite number > 0, got -1e-06"),
    ({"rope_theta": None}, r"rope_theta must be a finite number > 0, got None"),
    ({"tie_word_embeddings": "false"}, r"tie_word_embeddings must be true or false, got 'false'"),
    ({"rope_scaling": "linear"}, r"rope_parameters / rope_scaling must be a JSON object or null, got 'linear'"),
])
def test_config_json_refuses_other_models_and_bad_fields(tmp_path, edit, match):
  """config.json is untrusted: a Mistral config with a sliding window and a Qwen2 one loaded as Llama (other logits,
  silently); a quantized checkpoint's config was ignored; a missing field raised KeyError, a string size failed in
  string formatting, num_key_value_heads 0 became all heads, an odd head_dim or a negative eps built a model, a null
  rope_theta raised float()'s TypeError, the string "false" tied the embeddings. Each now raises naming the file and
  the field."""
  directory = save_pretrained(_tiny_model(layers=1), tmp_path / "ckpt")
  config = json.loads((directory / "config.json").read_text())
  (directory / "config.json").write_text(json.dumps({**config, **edit}))
  with pytest.raises(ValueError, match=re.escape(str(directory / "config.json")) + ": " + match):
    load_pretrained(directory)


def test_config_json_that_is_not_a_json_object_or_a_mistral_without_window(tmp_path):
  """A config.json that is not JSON, or not an object, raised json's error or an AttributeError without the file's name;
  a Mistral config without a sliding window is Llama's architecture and loads."""
  model = _tiny_model(layers=1)
  directory = save_pretrained(model, tmp_path / "ckpt")
  file = directory / "config.json"
  config = json.loads(file.read_text())
  file.write_text(json.dumps({**config, "model_type": "mistral", "sliding_window": None}))
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(load_pretrained(directory), nnx.Param)),
               nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  file.write_text("[1, 2]")
  with pytest.raises(ValueError, match=re.escape(f"{file}: a config must be a JSON object")):
    load_pretrained(directory)
  file.write_text("{not json")
  with pytest.raises(ValueError, match=re.escape(f"{file} is not a valid JSON file")):
    load_pretrained(directory)


def test_damaged_safetensors_files_and_indexes_are_refused_by_name(tmp_path):
  """A truncated file and a header whose offsets do not match the data raised safetensors' error without the file's
  name; an index that is not a JSON object raised AttributeError; an index placing shards outside the directory
  ("/...", "../...") read them; int8 / bool tensors were cast into the float weights silently (a wrong model)."""
  import shutil  # noqa: PLC0415
  import struct  # noqa: PLC0415

  from safetensors.numpy import load_file  # noqa: PLC0415
  from safetensors.numpy import save_file  # noqa: PLC0415

  single = save_pretrained(_tiny_model(layers=1), tmp_path / "single")
  sharded = save_pretrained(_tiny_model(layers=1), tmp_path / "sharded", max_shard_bytes=40_000)
  index = "model.safetensors.index.json"

  def variant(source, label, edit):
    directory = tmp_path / label
    shutil.copytree(source, directory)
    edit(directory)
    return directory

  file = "model.safetensors"
  raw = (single / file).read_bytes()
  truncated = variant(single, "truncated", lambda d: (d / file).write_bytes(raw[:len(raw) // 2]))
  with pytest.raises(ValueError, match=re.escape(f"{truncated / file} is not a readable safetensors file")):
    load_pretrained(truncated)

  def lie(directory):  # one tensor's offsets moved by 4 bytes, the data as it was
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    begin, end = header["model.norm.weight"]["data_offsets"]
    header["model.norm.weight"]["data_offsets"] = [begin + 4, end + 4]
    text = json.dumps(header).encode()
    (directory / file).write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])

  lying = variant(single, "lying", lie)
  with pytest.raises(ValueError, match=re.escape(f"{lying / file} is not a readable safetensors file") + ".*offset"):
    load_pretrained(lying)
  for label, dtype in (("int8", np.int8), ("bool", bool)):
    def retype(directory, dtype=dtype):
      tensors = load_file(directory / file)
      tensors["model.layers.0.mlp.up_proj.weight"] = (tensors["model.layers.0.mlp.up_proj.weight"] * 100).astype(dtype)
      save_file(tensors, directory / file, metadata={"format": "pt"})

    with pytest.raises(ValueError, match=re.escape(f"tensors {{'model.layers.0.mlp.up_proj.weight': "
                                                   f"'{np.dtype(dtype)}'}} are not floating point")):
      load_pretrained(variant(single, label, retype))
  listed = variant(sharded, "list", lambda d: (d / index).write_text("[]"))
  with pytest.raises(ValueError, match=re.escape(f"{listed / index} has no weight_map")):
    load_pretrained(listed)
  for label, shard in (("absolute", str(single / file)), ("parent", "../single/model.safetensors"), ("dot", ".")):
    def elsewhere(directory, shard=shard):
      content = json.loads((directory / index).read_text())
      content["weight_map"] = dict.fromkeys(content["weight_map"], shard)
      (directory / index).write_text(json.dumps(content))

    with pytest.raises(ValueError, match=re.escape(f"places tensors in ['{shard}'], which are not file names in")):
      load_pretrained(variant(sharded, label, elsewhere))


def test_save_pretrained_refuses_a_non_float_dtype_before_writing(tmp_path):
  """save_pretrained(dtype=jnp.int8) wrote the weights truncated to integers (and torch_dtype "int8") without a word;
  max_shard_bytes 0 or a string failed mid-way or wrote one shard per tensor. Both raise before anything is written."""
  model = _tiny_model(layers=1)
  with pytest.raises(ValueError, match=r"dtype must be a floating-point dtype .* got int8"):
    save_pretrained(model, tmp_path / "int8", dtype=jnp.int8)
  with pytest.raises(ValueError, match="max_shard_bytes must be an int >= 1 or None, got 0"):
    save_pretrained(model, tmp_path / "zero", max_shard_bytes=0)
  assert not (tmp_path / "int8").exists() and not (tmp_path / "zero").exists()


def test_masks_of_a_tied_sparse_embedding_prune_the_torch_head_too(ids, tmp_path):
  """A tied model with a 2:4 embedding computes its logits with the sparse embedding; export_masks gave its mask for
  model.embed_tokens only, and in torch the tied lm_head (the embedding's parameter) stayed dense: logits off by ~2.
  The head's mask is exported too, and the pruned torch model gives the Flax model's logits."""
  hf = _hf_model(3, tie=True)
  hf.save_pretrained(tmp_path / "hf")
  model = load_pretrained(tmp_path / "hf")
  sparse, _ = to_inference(model, {llama.PROJECTIONS: None}, embedding=jaxsparse.NM(2, 4))  # the embedding alone
  masks = export_masks(sparse)
  np.testing.assert_array_equal(masks["lm_head.weight_mask"].numpy(), masks["model.embed_tokens.weight_mask"].numpy())
  torch_interop.apply_masks(hf, masks)
  flax_logits = nnx.jit(lambda m, x: m(x))(sparse, jnp.asarray(ids))
  np.testing.assert_allclose(_logits(hf, ids), np.asarray(flax_logits), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def tied_pruned(tmp_path_factory):
  """A tied tiny model (tie_word_embeddings) and ``prune(..., NM(2, 4), head=True)``'s SparseGPT result:
  ``(hf, directory, model, pruned, masks, report)``."""
  hf = _hf_model(4, tie=True)
  path = tmp_path_factory.mktemp("hf_tied")
  hf.save_pretrained(path)
  model = load_pretrained(path)
  calibration = np.random.default_rng(5).integers(0, VOCAB, (8, 16))
  pruned, masks, report = prune(model, calibration, jaxsparse.NM(2, 4), head=True, progress=False)
  return hf, path, model, pruned, masks, report


def test_prune_head_of_a_tied_model_prunes_the_table_with_calibration(tied_pruned):
  """prune(head=True) on a tied model raised (no lm_head); it prunes the tied table, which is the LM head, by
  SparseGPT on the head's inputs with the lookups as a ridge: a 2:4 mask along the features, kept weights updated,
  last (the head is the table's last call) in a group of its own, after the decoder layers' groups."""
  _, _, model, pruned, masks, report = tied_pruned
  key = "model.embed_tokens.embedding"
  assert len(masks) == 15 and key in masks and "lm_head.kernel" not in masks
  mask = masks[key]
  assert mask.shape == (VOCAB, 64) and np.all(mask.reshape(VOCAB, 16, 4).sum(-1) == 2)
  table = np.asarray(pruned.model.embed_tokens.embedding[...])
  dense = np.asarray(model.model.embed_tokens.embedding[...])
  assert np.all(table[~mask] == 0) and not np.array_equal(table[mask], dense[mask])  # SparseGPT updated the kept ones
  magnitude = np.argsort(-np.abs(dense).reshape(VOCAB, 16, 4), axis=-1)[..., :2]
  by_magnitude = np.zeros((VOCAB, 16, 4), bool)
  np.put_along_axis(by_magnitude, magnitude, True, axis=-1)
  assert not np.array_equal(mask, by_magnitude.reshape(VOCAB, 64))  # calibrated, not the magnitude mask
  last = report.layers[-1]
  assert (last.path, last.group) == ("model.embed_tokens", 2) and last.note.startswith("tied table: sparsegpt")
  assert [r.group for r in report.layers[:-1]] == [0] * 7 + [1] * 7 and sorted(layer_errors(report)) == [0, 1]


@pytest.mark.slow  # 10-12 s on 2 cores (the generation loops)
def test_to_inference_of_a_pruned_tied_model_keeps_its_calibrated_table_and_generates(tied_pruned, ids):
  """to_inference(head=True) on the tied model stores the table as a 2:4 CompressedNMEmbed from the calibrated mask and
  the pruned (updated) weights exactly: the logits and greedy tokens are the pruned dense model's."""
  _, _, _, pruned, masks, _ = tied_pruned
  key = "model.embed_tokens.embedding"
  sparse, report = to_inference(pruned, jaxsparse.NM(2, 4), masks=masks, head=True)
  table = sparse.model.embed_tokens
  assert sparse.lm_head is None and type(table).__name__ == "CompressedNMEmbed" and len(report.replaced) == 15
  np.testing.assert_array_equal(np.asarray(table.weight.mask()).T, masks[key])
  np.testing.assert_array_equal(np.asarray(jaxsparse.densify(sparse).model.embed_tokens.embedding[...]),
                                np.asarray(pruned.model.embed_tokens.embedding[...]))
  x = jnp.asarray(ids)
  np.testing.assert_allclose(np.asarray(sparse(x)), np.asarray(pruned(x)), atol=1e-5, rtol=0)
  prompt = np.random.default_rng(6).integers(0, VOCAB, (2, 5))
  np.testing.assert_array_equal(np.asarray(generate(sparse, prompt, 8)), np.asarray(generate(pruned, prompt, 8)))


def test_pruned_tied_model_saves_and_exports_masks_to_transformers(tied_pruned, ids, tmp_path):
  """The pruned tied model's sparse form, saved with save_pretrained, loads in transformers (tied); export_masks gives
  the table's mask for model.embed_tokens and the tied lm_head, and the masked torch model gives the Flax sparse
  model's logits. The pruned dense model saved gives its own logits."""
  _, _, _, pruned, masks, _ = tied_pruned
  sparse, _ = to_inference(pruned, jaxsparse.NM(2, 4), masks=masks, head=True)
  x = jnp.asarray(ids)
  flax_logits = np.asarray(nnx.jit(lambda m, x: m(x))(sparse, x))
  target = transformers.LlamaForCausalLM.from_pretrained(save_pretrained(sparse, tmp_path / "sparse")).eval()
  assert target.config.tie_word_embeddings and target.lm_head.weight is target.model.embed_tokens.weight
  torch_masks = export_masks(sparse)
  assert len(torch_masks) == 16
  for name in ("model.embed_tokens.weight_mask", "lm_head.weight_mask"):  # torch's tied head: the table's mask too
    np.testing.assert_array_equal(torch_masks[name].numpy(), masks["model.embed_tokens.embedding"], err_msg=name)
  torch_interop.apply_masks(target, torch_masks)
  np.testing.assert_allclose(_logits(target, ids), flax_logits, atol=1e-4, rtol=0)
  dense = transformers.LlamaForCausalLM.from_pretrained(save_pretrained(pruned, tmp_path / "pruned")).eval()
  np.testing.assert_allclose(_logits(dense, ids), np.asarray(pruned(x)), atol=1e-4, rtol=0)


def test_tied_head_takes_nm_only_and_rules_name_the_table():
  """On a tied model head=True gives the table the structure: other structures than NM and rule dicts are refused
  before any calibration, with what to do instead; a rule naming the table and a different embedding= conflict; a
  table mask with the table left dense says head=True would take it. to_inference(head=True) and a rule naming the
  table store the given table mask (here the 2 smallest of each 4: not magnitude's), not one derived again."""
  cfg = llama.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
  model = llama.LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
  calibration = np.zeros((2, 8), np.int32)
  for structure in (jaxsparse.Unstructured(sparsity=0.5), jaxsparse.BlockSparse(density=0.5, block_shape=(32, 32))):
    with pytest.raises(ValueError, match=r"ties its LM head.*head=True takes jaxsparse\.NM\(n, m\) here, got "
                       + re.escape(structure.describe()) + r".*'model\.embed_tokens': jaxsparse\.NM\(2, 4\)"):
      prune(model, calibration, structure, head=True, progress=False)
    with pytest.raises(ValueError, match=r"head=True takes jaxsparse\.NM.*embedding=NM\(n, m\)"):
      to_inference(model, structure, head=True)
  rules = {llama.PROJECTIONS: jaxsparse.NM(2, 4), "model.embed_tokens": jaxsparse.NM(2, 4)}
  for call in (lambda: prune(model, calibration, rules, head=True, progress=False),
               lambda: to_inference(model, rules, head=True)):
    with pytest.raises(ValueError, match=r"with rules, add a 'model\.embed_tokens' rule \(an NM one"):
      call()
  with pytest.raises(ValueError, match=r"the rules give model\.embed_tokens 2:4 and embedding= 1:4"):
    to_inference(model, rules, embedding=jaxsparse.NM(1, 4))
  with pytest.raises(ValueError, match=r"embedding=None keeps the embedding dense.*or head=True"):
    to_inference(model, jaxsparse.NM(2, 4), masks={"model.embed_tokens.embedding": np.ones((VOCAB, 64), bool)})
  # The one structure and embedding= agree: head=True alone gives the same (magnitude) table.
  alone, _ = to_inference(model, jaxsparse.NM(2, 4), head=True)
  both, _ = to_inference(model, jaxsparse.NM(2, 4), head=True, embedding=jaxsparse.NM(2, 4))
  np.testing.assert_array_equal(np.asarray(alone.model.embed_tokens.embedding[...]),
                                np.asarray(both.model.embed_tokens.embedding[...]))
  table = np.abs(np.asarray(model.model.embed_tokens.embedding[...])).reshape(VOCAB, 16, 4)
  smallest = np.zeros(table.shape, bool)
  np.put_along_axis(smallest, np.argsort(table, axis=-1)[..., :2], True, axis=-1)
  key = "model.embed_tokens.embedding"
  masks = {key: smallest.reshape(VOCAB, 64)}
  for sparse in (to_inference(model, jaxsparse.NM(2, 4), masks=masks, head=True)[0],
                 to_inference(model, rules, masks=masks)[0]):
    assert type(sparse.model.embed_tokens).__name__ == "CompressedNMEmbed"
    np.testing.assert_array_equal(np.asarray(sparse.model.embed_tokens.weight.mask()).T, masks[key])
