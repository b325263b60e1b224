"""Token generation: prefill the prompt into a static KV cache, then decode one token per step, all under one jit.

Prompts of a batch have equal length, or are left-padded with ``attention_mask`` marking the real tokens
(as Hugging Face's ``generate`` expects for decoder-only models): padding never enters attention and
positions count real tokens only, so a left-padded row generates what it would alone.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from llama.model import LlamaForCausalLM
from llama.model import init_cache

__all__ = ["generate", "select_token"]


def select_token(logits: jax.Array, key: jax.Array | None, *, temperature: float, top_k: int | None) -> jax.Array:
  """Next tokens ``(B,)`` from logits ``(B, vocab)``: argmax for ``temperature == 0``, else a sample of
  ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits (all when ``None``)."""
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if top_k is not None:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(nnx.jit, static_argnames=("max_new_tokens", "temperature", "top_k", "eos_token_id", "cache_dtype"))
def _generate(model, prompt_ids, attention_mask, key, *, max_new_tokens, temperature, top_k, eos_token_id,
              cache_dtype):
  b, t = prompt_ids.shape
  cache = init_cache(model.config, b, t + max_new_tokens, dtype=cache_dtype)

  def pick(logits, i):
    return select_token(logits[:, -1], jax.random.fold_in(key, i), temperature=temperature, top_k=top_k)

  logits, cache = model.step(prompt_ids, cache, attention_mask=attention_mask, last_only=True)
  first = pick(logits, 0)
  done = jnp.zeros((b,), bool) if eos_token_id is None else first == eos_token_id

  def body(carry, i):
    token, cache, done = carry
    logits, cache = model.step(token[:, None], cache)
    token = pick(logits, i)
    if eos_token_id is not None:
      token = jnp.where(done, eos_token_id, token)
      done = done | (token == eos_token_id)
    return (token, cache, done), token

  _, rest = jax.lax.scan(body, (first, cache, done), jnp.arange(1, max_new_tokens))
  return jnp.concatenate([first[:, None], rest.T], axis=1)


def generate(
    model: LlamaForCausalLM,
    prompt_ids: jax.typing.ArrayLike,
    max_new_tokens: int,
    *,
    attention_mask: jax.typing.ArrayLike | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    key: jax.Array | None = None,
    eos_token_id: int | None = None,
    cache_dtype: Any = None,
) -> jax.Array:
  """Generates ``max_new_tokens`` tokens after each prompt; greedy by default.

  One ``nnx.jit`` call (compiled once per shape and setting): a prefill of the whole prompt into a KV
  cache of ``T + max_new_tokens`` slots, then ``max_new_tokens - 1`` decode steps in a ``lax.scan``.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from llama.model import LlamaConfig, LlamaForCausalLM
  >>> cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
  ...                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
  >>> model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
  >>> generate(model, jnp.ones((3, 5), jnp.int32), 4).shape
  (3, 4)

  Args:
    model: the (dense or sparse) model.
    prompt_ids: int ``(B, T)``; rows of different lengths are left-padded.
    max_new_tokens: tokens to generate per row (static).
    attention_mask: 0/1 ``(B, T)``, 0 on the left padding; ``None``: every token is real.
    temperature: 0 for greedy (argmax); > 0 samples from ``softmax(logits / temperature)``.
    top_k: sample among the ``top_k`` most likely tokens only (with ``temperature > 0``).
    key: PRNG key for sampling (required when ``temperature > 0``).
    eos_token_id: once a row generates it, the row's later tokens are ``eos_token_id`` too.
    cache_dtype: dtype of the KV cache; ``None``: the model's compute dtype.

  Returns:
    int32 ``(B, max_new_tokens)``: the new tokens only.
  """
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}.")
  if temperature > 0 and key is None:
    raise ValueError("sampling (temperature > 0) needs key=jax.random.key(...).")
  if top_k is not None and not 0 < top_k <= model.config.vocab_size:
    raise ValueError(f"top_k must be in [1, vocab_size={model.config.vocab_size}], got {top_k}.")
  prompt_ids = jnp.asarray(prompt_ids, jnp.int32)
  if prompt_ids.ndim != 2:
    raise ValueError(f"prompt_ids must be (batch, length), got shape {prompt_ids.shape}.")
  mask = jnp.ones(prompt_ids.shape, bool) if attention_mask is None else jnp.asarray(attention_mask) != 0
  key = jax.random.key(0) if key is None else key
  return _generate(model, prompt_ids, mask, key, max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                   top_k=top_k, eos_token_id=eos_token_id, cache_dtype=jnp.dtype(cache_dtype or model.dtype))
