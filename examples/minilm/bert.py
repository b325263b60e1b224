"""A compact BERT encoder in Flax NNX, enough to run sentence-transformers' all-MiniLM-L6-v2.

An example, not jaxsparse API. Module names follow Hugging Face's ``BertModel`` so that
:func:`jaxsparse.torch_interop.load_nnx` maps the checkpoint with one rule (``attention.self.query``
lives at ``attention.query`` here). Inference only: no dropout.

Sentence embeddings as sentence-transformers computes them for this model: token states of the last
layer, mean-pooled over the attention mask, L2-normalised.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# torch module path -> Flax module path: the only difference between the two models.
NAME_MAP = [(r"\.attention\.self\.", ".attention.")]
# Checkpoint tensors this encoder does not use: a constant buffer and the (unused) pooler head.
IGNORE = ("embeddings.position_ids", "pooler.*")


@dataclasses.dataclass(frozen=True)
class BertConfig:
  vocab_size: int
  hidden_size: int
  num_hidden_layers: int
  num_attention_heads: int
  intermediate_size: int
  max_position_embeddings: int
  type_vocab_size: int
  layer_norm_eps: float

  @classmethod
  def from_json(cls, path: str | os.PathLike) -> BertConfig:
    with open(path) as f:
      cfg = json.load(f)
    if cfg.get("hidden_act", "gelu") != "gelu" or cfg.get("position_embedding_type", "absolute") != "absolute":
      raise ValueError(f"{path}: only hidden_act='gelu' and absolute position embeddings are implemented.")
    return cls(**{f.name: cfg[f.name] for f in dataclasses.fields(cls)})


def _layer_norm(cfg: BertConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
  # use_fast_variance=False: the two-pass variance, as torch computes it.
  return nnx.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps, use_fast_variance=False, rngs=rngs)


class Embeddings(nnx.Module):
  def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
    self.word_embeddings = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
    self.position_embeddings = nnx.Embed(cfg.max_position_embeddings, cfg.hidden_size, rngs=rngs)
    self.token_type_embeddings = nnx.Embed(cfg.type_vocab_size, cfg.hidden_size, rngs=rngs)
    self.LayerNorm = _layer_norm(cfg, rngs)

  def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array) -> jax.Array:
    positions = jnp.arange(input_ids.shape[1])[None, :]
    h = self.word_embeddings(input_ids) + self.position_embeddings(positions)
    return self.LayerNorm(h + self.token_type_embeddings(token_type_ids))


class DenseNorm(nnx.Module):
  """``LayerNorm(dense(x) + residual)``: BERT's ``*.output`` blocks."""

  def __init__(self, in_features: int, cfg: BertConfig, rngs: nnx.Rngs):
    self.dense = nnx.Linear(in_features, cfg.hidden_size, rngs=rngs)
    self.LayerNorm = _layer_norm(cfg, rngs)

  def __call__(self, x: jax.Array, residual: jax.Array) -> jax.Array:
    return self.LayerNorm(self.dense(x) + residual)


class Attention(nnx.Module):
  def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
    h = cfg.hidden_size
    self.heads = cfg.num_attention_heads
    self.query = nnx.Linear(h, h, rngs=rngs)
    self.key = nnx.Linear(h, h, rngs=rngs)
    self.value = nnx.Linear(h, h, rngs=rngs)
    self.output = DenseNorm(h, cfg, rngs)

  def __call__(self, x: jax.Array, mask_bias: jax.Array) -> jax.Array:
    b, s, h = x.shape
    d = h // self.heads

    def split(y):
      return y.reshape(b, s, self.heads, d)

    q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d) + mask_bias
    context = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, s, h)
    return self.output(context, x)


class Intermediate(nnx.Module):
  def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
    self.dense = nnx.Linear(cfg.hidden_size, cfg.intermediate_size, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return jax.nn.gelu(self.dense(x), approximate=False)  # HF "gelu" is the exact erf form


class Layer(nnx.Module):
  def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
    self.attention = Attention(cfg, rngs)
    self.intermediate = Intermediate(cfg, rngs)
    self.output = DenseNorm(cfg.intermediate_size, cfg, rngs)

  def __call__(self, x: jax.Array, mask_bias: jax.Array) -> jax.Array:
    x = self.attention(x, mask_bias)
    return self.output(self.intermediate(x), x)


class Encoder(nnx.Module):
  def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
    self.layer = nnx.List([Layer(cfg, rngs) for _ in range(cfg.num_hidden_layers)])


class Bert(nnx.Module):
  """BERT without its pooler head; ``__call__`` returns the last layer's token states ``(B, S, hidden)``."""

  def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
    self.embeddings = Embeddings(cfg, rngs)
    self.encoder = Encoder(cfg, rngs)

  def __call__(self, input_ids: jax.Array, attention_mask: jax.Array, token_type_ids: jax.Array) -> jax.Array:
    x = self.embeddings(input_ids, token_type_ids)
    # As Hugging Face: padded keys get the most negative float added to their scores.
    mask_bias = jnp.where(attention_mask[:, None, None, :] > 0, 0.0, jnp.finfo(x.dtype).min).astype(x.dtype)
    for layer in self.encoder.layer:
      x = layer(x, mask_bias)
    return x


@nnx.jit
def sentence_embeddings(model: Bert, input_ids, attention_mask, token_type_ids) -> jax.Array:
  """Mean pooling over the attention mask, then L2 normalisation: sentence-transformers' ``encode``."""
  h = model(input_ids, attention_mask, token_type_ids)
  m = attention_mask[..., None].astype(h.dtype)
  pooled = jnp.sum(h * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1e-9)
  return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)


def tokenize(tokenizer, sentences: list[str], *, max_length: int = 256) -> dict[str, np.ndarray]:
  """Pads a batch with a ``tokenizers.Tokenizer`` (from ``tokenizer.json``) into int32 arrays."""
  tokenizer.enable_truncation(max_length=max_length)
  tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
  enc = tokenizer.encode_batch(sentences)
  return {
      "input_ids": np.array([e.ids for e in enc], np.int32),
      "attention_mask": np.array([e.attention_mask for e in enc], np.int32),
      "token_type_ids": np.array([e.type_ids for e in enc], np.int32),
  }


TOKENIZER_FIELDS = ("input_ids", "attention_mask", "token_type_ids")
