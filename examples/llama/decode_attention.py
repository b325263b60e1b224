"""Fused decode attention: one new query token per row against the KV cache, in one Pallas kernel and a merge.

An example, not jaxsparse API. A decode step's eager attention (``model._eager_attention``: scores einsum, the mask,
a softmax, the values einsum) is five to seven small XLA kernels a layer, each a few microseconds at batch 1, about
as long as reading the whole cache once: with a sparse model's projections fast, that fixed cost is a large share of
a token's time. :func:`decode_attention` does it in one Pallas kernel (lowered through Triton on a GPU) and a
merge of the partial results (two or three small XLA fusions): program ``(row, kv head, split)`` reads its share of
the row's cached keys and values once for all the query heads of the group (grouped-query attention), with an online
softmax (flash-decoding), and writes its unnormalised output with its running maximum and sum.

The mask is a ``(B, S)`` bool input like eager attention's, so left padding, unfilled slots and any other pattern
give eager attention's result; a row that sees no key at all gets, as there, the plain average of every slot's
values.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Score of a masked slot: eager attention's finfo(float32).min after its scaling, so a fully masked row averages
# every slot as there; slots past the cache's end (the last block's padding) get -inf and no weight.
_MASKED = float(jnp.finfo(jnp.float32).min)
# Programs to aim for when choosing the number of splits of the cache (about two per SM of an H100 / H200).
_TARGET_PROGRAMS = 264


def supports(q: jax.Array, k: jax.Array) -> bool:
  """Whether :func:`decode_attention` takes these shapes: ``q`` ``(B, heads, head_dim)``, ``k`` ``(B, S, kv_heads,
  head_dim)``, 16-bit, a power-of-two ``head_dim`` of at least 16, ``heads`` a multiple of ``kv_heads``."""
  hd = q.shape[-1]
  return (q.ndim == 3 and k.ndim == 4 and q.dtype in (jnp.bfloat16, jnp.float16) and k.dtype == q.dtype
          and hd >= 16 and hd & (hd - 1) == 0 and q.shape[1] % k.shape[2] == 0)


def _kernel(q_ref, k_ref, v_ref, mask_ref, o_ref, m_ref, total_ref, *, block_k: int, per_split: int, size: int,
            scale: float):
  num_blocks = pl.cdiv(size, block_k)
  first = pl.program_id(2) * per_split
  q = q_ref[...]
  lane = jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)

  def body(t, carry):
    o, m, total = carry
    s0 = (first + t) * block_k
    inside = s0 + lane < size
    k = pltriton.load(k_ref.at[pl.ds(s0, block_k), :], mask=inside[:, None], other=0)
    v = pltriton.load(v_ref.at[pl.ds(s0, block_k), :], mask=inside[:, None], other=0)
    keep = pltriton.load(mask_ref.at[pl.ds(s0, block_k)], mask=inside, other=0) != 0
    qk = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    qk = jnp.where(keep[None, :], qk, _MASKED)
    qk = jnp.where(inside[None, :], qk, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(qk, axis=1))
    correction = jnp.exp(m - m_new)
    p = jnp.exp(qk - m_new[:, None])
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return o * correction[:, None] + pv, m_new, total * correction + jnp.sum(p, axis=1)

  rows, hd = q_ref.shape
  init = (jnp.zeros((rows, hd), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
          jnp.zeros((rows,), jnp.float32))
  o, m, total = jax.lax.fori_loop(0, jnp.minimum(per_split, num_blocks - first), body, init)
  o_ref[...], m_ref[...], total_ref[...] = o, m, total


@functools.partial(jax.jit, static_argnames=("block_k", "splits", "interpret"))
def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, block_k: int = 128,
                     splits: int | None = None, interpret: bool = False) -> jax.Array:
  """``softmax(q kᵀ / sqrt(head_dim), masked) v`` for one query token a row, as eager attention computes it.

  Args:
    q: ``(B, heads, head_dim)`` queries (bfloat16 or float16; see :func:`supports`).
    k: ``(B, S, kv_heads, head_dim)`` cached keys, ``q``'s dtype; query head ``h`` reads key head
      ``h // (heads // kv_heads)``.
    v: ``(B, S, kv_heads, head_dim)`` cached values.
    mask: bool ``(B, S)``, the slots each row's query may see.
    block_k: cache slots a loop step reads (a power of two, at least 16).
    splits: programs a ``(row, kv head)`` pair's slots are split over; ``None``: about two programs per SM in all,
      at most one per ``block_k`` slots.
    interpret: run in Pallas interpret mode (any backend; tests).

  Returns:
    ``(B, heads, head_dim)`` in ``q``'s dtype.

  >>> q = jnp.ones((1, 4, 16), jnp.bfloat16); kv = jnp.ones((1, 40, 2, 16), jnp.bfloat16)
  >>> decode_attention(q, kv, kv, jnp.ones((1, 40), bool), interpret=True).shape
  (1, 4, 16)
  """
  b, heads, hd = q.shape
  size, kv_heads = k.shape[1], k.shape[2]
  if not supports(q, k) or k.shape != v.shape or k.shape[0] != b or k.shape[3] != hd or mask.shape != (b, size):
    raise ValueError(f"decode_attention takes q (B, heads, head_dim) and k, v (B, S, kv_heads, head_dim) of one "
                     f"16-bit dtype, a power-of-two head_dim >= 16, mask (B, S); got q {q.shape} {q.dtype}, k "
                     f"{k.shape} {k.dtype}, v {v.shape} {v.dtype}, mask {mask.shape}.")
  group = heads // kv_heads
  rows = max(16, pl.next_power_of_2(group))  # the MMA's minimum M
  num_blocks = pl.cdiv(size, block_k)
  if splits is None:
    splits = max(1, min(num_blocks, _TARGET_PROGRAMS // (b * kv_heads)))
  per_split = pl.cdiv(num_blocks, splits)
  splits = pl.cdiv(num_blocks, per_split)  # every split non-empty
  qg = jnp.pad(q.reshape(b, kv_heads, group, hd), ((0, 0), (0, 0), (0, rows - group), (0, 0)))
  kernel = functools.partial(_kernel, block_k=block_k, per_split=per_split, size=size, scale=1 / math.sqrt(hd))
  kv_spec = pl.BlockSpec((None, size, None, hd), lambda i, h, j: (i, 0, h, 0))
  o, m, total = pl.pallas_call(
      kernel,
      grid=(b, kv_heads, splits),
      in_specs=[pl.BlockSpec((None, None, rows, hd), lambda i, h, j: (i, h, 0, 0)), kv_spec, kv_spec,
                pl.BlockSpec((None, size), lambda i, h, j: (i, 0))],
      out_specs=[pl.BlockSpec((None, None, None, rows, hd), lambda i, h, j: (i, h, j, 0, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda i, h, j: (i, h, j, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda i, h, j: (i, h, j, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, kv_heads, splits, rows, hd), jnp.float32),
                 jax.ShapeDtypeStruct((b, kv_heads, splits, rows), jnp.float32),
                 jax.ShapeDtypeStruct((b, kv_heads, splits, rows), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="llama_decode_attention",
  )(qg, k, v, mask.astype(jnp.int32))
  weight = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))  # (B, kv, splits, rows)
  out = jnp.sum(o * weight[..., None], axis=2) / jnp.sum(total * weight, axis=2)[..., None]
  return out[:, :, :group].reshape(b, heads, hd).astype(q.dtype)
