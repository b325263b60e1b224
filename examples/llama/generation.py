"""Token generation: prefill the prompt into a static KV cache, then decode one token per step, all under one jit.

Prompts of a batch have equal length, or are left-padded with ``attention_mask`` marking the real tokens
(as Hugging Face's ``generate`` expects for decoder-only models): padding never enters attention and
positions count real tokens only, so a left-padded row generates what it would alone.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llama.model import LlamaForCausalLM
from llama.model import check_token_ids
from llama.model import init_cache

__all__ = ["generate", "select_token"]


def select_token(logits: jax.Array, key: jax.Array | None, *, temperature: float, top_k: int | None,
                 top_p: float | None = None) -> jax.Array:
  """Next tokens ``(B,)`` from logits ``(B, vocab)``: argmax for ``temperature == 0``, else a sample of
  ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits (all when ``None``), then to the
  fewest most likely tokens whose probabilities sum to at least ``top_p`` (Hugging Face's order and rule)."""
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if top_k is not None:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p is not None and top_p < 1:
    ordered = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the more likely tokens
    kept = jnp.sum(before < top_p, axis=-1, keepdims=True)  # >= 1: the most likely token is always kept
    cutoff = jnp.take_along_axis(ordered, kept - 1, axis=-1)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(nnx.jit, static_argnames=("max_new_tokens", "temperature", "top_k", "top_p", "eos_token_id",
                                            "cache_dtype"))
def _generate(model, prompt_ids, attention_mask, key, *, max_new_tokens, temperature, top_k, top_p, eos_token_id,
              cache_dtype):
  b, t = prompt_ids.shape
  cache = init_cache(model.config, b, t + max_new_tokens, dtype=cache_dtype)

  def pick(logits, i):
    return select_token(logits[:, -1], jax.random.fold_in(key, i), temperature=temperature, top_k=top_k,
                        top_p=top_p)

  def is_eos(token):
    return jnp.isin(token, jnp.asarray(eos_token_id, jnp.int32))

  logits, cache = model.step(prompt_ids, cache, attention_mask=attention_mask, last_only=True)
  first = pick(logits, 0)
  done = jnp.zeros((b,), bool) if eos_token_id is None else is_eos(first)

  def body(carry, i):
    prev, cache, done = carry
    logits, cache = model.step(prev[:, None], cache)
    token = pick(logits, i)
    if eos_token_id is not None:
      token = jnp.where(done, prev, token)  # a finished row repeats the end-of-sequence token it produced
      done = done | is_eos(token)
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
    top_p: float | None = None,
    key: jax.Array | None = None,
    eos_token_id: int | Sequence[int] | None = None,
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
    prompt_ids: int ``(B, T)`` ids in ``[0, vocab_size)``, ``T >= 1``; rows of different lengths are left-padded.
    max_new_tokens: tokens to generate per row (static), an int >= 1.
    attention_mask: 0/1 ``(B, T)``, 0 on the left padding (every row's last token real: right padding would
      continue from a pad token, so it is refused); ``None``: every token is real.
    temperature: 0 for greedy (argmax); > 0 (finite) samples from ``softmax(logits / temperature)``.
    top_k: sample among the ``top_k`` most likely tokens only (with ``temperature > 0``).
    top_p: in ``(0, 1]``; sample among the fewest most likely tokens whose probabilities (after ``top_k``) sum to at
      least ``top_p`` (nucleus sampling, with ``temperature > 0``); ``None`` or 1: all.
    key: one PRNG key for sampling (``jax.random.key(seed)``; required when ``temperature > 0``).
    eos_token_id: an id or a sequence of ids (Llama 3's ``config.json`` lists several); once a row generates one,
      the row's later tokens repeat it.
    cache_dtype: floating dtype of the KV cache; ``None``: the model's compute dtype.

  Returns:
    int32 ``(B, max_new_tokens)``: the new tokens only.
  """
  vocab = model.config.vocab_size
  if not _is_int(max_new_tokens) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}.")
  if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not (
      math.isfinite(temperature) and temperature >= 0):
    raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}.")
  if temperature > 0 and key is None:
    raise ValueError("sampling (temperature > 0) needs key=jax.random.key(...).")
  if top_k is not None and not (_is_int(top_k) and 0 < top_k <= vocab):
    raise ValueError(f"top_k must be an int in [1, vocab_size={vocab}] or None, got {top_k!r}.")
  if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
    raise ValueError(f"top_p must be a number in (0, 1] or None, got {top_p!r}.")
  if eos_token_id is not None:
    eos = (eos_token_id,) if _is_int(eos_token_id) else ()
    eos = tuple(eos_token_id) if isinstance(eos_token_id, Sequence) and not isinstance(eos_token_id, str) else eos
    if not eos or not all(_is_int(e) and 0 <= e < vocab for e in eos):
      raise ValueError(f"eos_token_id must be a token id in [0, vocab_size={vocab}) or a non-empty sequence of them, "
                       f"got {eos_token_id!r}.")
    eos_token_id = tuple(int(e) for e in eos)
  prompt_ids = check_token_ids(prompt_ids, vocab, name="prompt_ids")
  if prompt_ids.shape[1] == 0:
    raise ValueError(f"prompt_ids must hold at least one token per row, got shape {prompt_ids.shape}.")
  mask = jnp.ones(prompt_ids.shape, bool) if attention_mask is None else jnp.asarray(attention_mask) != 0
  if mask.shape != prompt_ids.shape:
    raise ValueError(f"attention_mask must have prompt_ids' shape {prompt_ids.shape}, got {mask.shape}.")
  last = None if isinstance(mask, jax.core.Tracer) else np.asarray(mask)[:, -1]
  if last is not None and not last.all():
    rows = np.flatnonzero(~last).tolist()
    raise ValueError(f"attention_mask is 0 on the last token of rows {rows[:8]}: generation continues from each row's "
                     f"last token, so pad on the left (a row with no real token has nothing to continue).")
  if key is not None and not _is_key(key):
    got = f"an array of dtype {key.dtype} and shape {key.shape}" if hasattr(key, "dtype") else f"{key!r:.100}"
    raise TypeError(f"key must be one PRNG key, jax.random.key(seed), got {got}.")
  key = jax.random.key(0) if key is None else key
  cache_dtype = jnp.dtype(cache_dtype or model.dtype)
  if not jnp.issubdtype(cache_dtype, jnp.floating):  # an int cache would truncate the keys and values silently
    raise ValueError(f"cache_dtype must be a floating-point dtype (None: the model's {jnp.dtype(model.dtype)}), got "
                     f"{cache_dtype}.")
  return _generate(model, prompt_ids, mask, key, max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                   top_k=None if top_k is None else int(top_k), top_p=None if top_p is None else float(top_p),
                   eos_token_id=eos_token_id, cache_dtype=cache_dtype)


def _is_key(key: Any) -> bool:
  """One PRNG key: a typed key of shape ``()`` or a raw ``uint32`` key (``jax.random.PRNGKey``)."""
  dtype = getattr(key, "dtype", None)
  if dtype is None:
    return False
  if jnp.issubdtype(dtype, jax.dtypes.prng_key):
    return key.shape == ()
  return dtype == jnp.uint32 and key.ndim == 1


def _is_int(value: Any) -> bool:
  """An int (a NumPy integer too), not a bool."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)
