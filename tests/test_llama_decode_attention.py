"""examples/llama's fused decode attention (``llama.decode_attention``) against eager attention (Pallas interpret).

The kernel (one query token a row against the cache, split over the cache with an online softmax, merged by XLA)
must give eager attention's result for every mask: left padding, holes, a row that sees nothing (eager attention
then averages every slot), caches that are no multiple of the block, grouped-query heads whose group is no power of
two. Tolerances: bfloat16 / float16 inputs, float32 softmax in both, compared with eager attention on the inputs
upcast to float32 (the kernel's error must be at most about eager attention's own in the 16-bit dtype).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from llama import decode_attention as da
from llama import model as llama_model


def _case(seed, b, heads, kv_heads, hd, size, dtype, keep=0.7):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, heads, hd)), dtype)
  k = jnp.asarray(rng.standard_normal((b, size, kv_heads, hd)), dtype)
  v = jnp.asarray(rng.standard_normal((b, size, kv_heads, hd)), dtype)
  mask = rng.random((b, size)) < keep
  mask[0, : size // 3] = False  # left padding
  return q, k, v, jnp.asarray(mask)


def _eager(q, k, v, mask):
  b, heads, hd = q.shape
  return llama_model._eager_attention(q[:, None], k, v, mask[:, None, :])[:, 0].reshape(b, heads, hd)


@pytest.mark.parametrize(("b", "heads", "kv_heads", "hd", "size", "block_k", "splits", "dtype"), [
    (1, 8, 2, 16, 40, 16, None, jnp.bfloat16),    # 3 blocks, the last partial
    (3, 6, 2, 32, 100, 32, 2, jnp.bfloat16),     # a group of 3 query heads (padded to the MMA's 16 rows)
    (2, 4, 4, 64, 257, 64, 1, jnp.float16),      # no grouping, one split
    (2, 16, 2, 16, 64, 16, 3, jnp.bfloat16),     # a group of 8, splits of 2 blocks and one of 0 after rounding
])
def test_decode_attention_matches_eager_attention(b, heads, kv_heads, hd, size, block_k, splits, dtype):
  q, k, v, mask = _case(b * size, b, heads, kv_heads, hd, size, dtype)
  mask = mask.at[b - 1].set(False) if b > 1 else mask  # a row that sees no key: eager's uniform average
  got = da.decode_attention(q, k, v, mask, block_k=block_k, splits=splits, interpret=True)
  assert got.shape == (b, heads, hd) and got.dtype == dtype
  up = lambda a: a.astype(jnp.float32)
  want = _eager(up(q), up(k), up(v), mask)
  err = float(jnp.max(jnp.abs(up(got) - want)))
  eager_err = float(jnp.max(jnp.abs(up(_eager(q, k, v, mask)) - want)))
  assert err <= max(2 * eager_err, 4e-3), (err, eager_err)


def test_decode_attention_under_vmap():
  q, k, v, mask = _case(0, 2, 4, 2, 16, 48, jnp.bfloat16)
  f = functools.partial(da.decode_attention, block_k=16, interpret=True)
  stacked = jax.vmap(f)(q[None].repeat(2, 0), k[None].repeat(2, 0), v[None].repeat(2, 0), mask[None].repeat(2, 0))
  np.testing.assert_array_equal(np.asarray(stacked[1], np.float32), np.asarray(f(q, k, v, mask), np.float32))


@pytest.mark.parametrize(("q_shape", "k_shape", "dtype", "mask_shape"), [
    ((1, 4, 16), (1, 8, 2, 16), jnp.float32, (1, 8)),     # float32: eager attention's job
    ((1, 4, 24), (1, 8, 2, 24), jnp.bfloat16, (1, 8)),    # head_dim no power of two
    ((1, 6, 16), (1, 8, 4, 16), jnp.bfloat16, (1, 8)),    # heads no multiple of kv_heads
    ((1, 4, 16), (1, 8, 2, 16), jnp.bfloat16, (1, 9)),    # mask of another length
])
def test_decode_attention_refuses_shapes_it_does_not_take(q_shape, k_shape, dtype, mask_shape):
  q, k = jnp.zeros(q_shape, dtype), jnp.zeros(k_shape, dtype)
  with pytest.raises(ValueError, match=r"decode_attention takes q \(B, heads, head_dim\).*got q"):
    da.decode_attention(q, k, k, jnp.ones(mask_shape, bool), interpret=True)


@pytest.mark.slow  # 8-17 s on 2 cores (two model steps traced twice, the kernel interpreted)
def test_model_decode_step_runs_the_kernel_on_a_gpu_and_matches_eager(monkeypatch):
  """``attention_core`` sends a 16-bit decode step to the kernel where the backend is a GPU (faked here, the
  kernel in interpret mode) and its logits equal the eager model's within bfloat16's error."""
  cfg = llama_model.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16)
  model = llama_model.LlamaForCausalLM(cfg, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  prompt = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 5)), jnp.int32)
  mask = jnp.asarray([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # left padding in row 0

  def decode_logits():
    cache = llama_model.init_cache(cfg, 2, 9, dtype=jnp.bfloat16)
    _, cache = model.step(prompt, cache, attention_mask=mask)
    logits, _ = model.step(prompt[:, -1:], cache)
    return logits.astype(jnp.float32)

  eager = decode_logits()
  calls, original = [], da.decode_attention

  def kernel(*args, **kwargs):
    calls.append(args[0].shape)
    return original(*args, **kwargs, interpret=True)

  monkeypatch.setattr(llama_model.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(llama_model.decode_attention, "decode_attention", kernel)
  monkeypatch.setattr(llama_model, "FLASH_MIN_QUERIES", 10**9)  # the prefill stays eager (no cuDNN on a CPU)
  fused = decode_logits()
  assert calls == [(2, 4, 16)] * 2  # the decode step's two layers, not the prefill
  np.testing.assert_allclose(np.asarray(fused), np.asarray(eager), atol=0.05, rtol=0.05)
  assert float(jnp.mean(jnp.abs(fused - eager))) < 5e-3
