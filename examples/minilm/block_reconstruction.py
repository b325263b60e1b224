"""Block-wise reconstruction of a pruned BERT with its masks fixed (an example step, not jaxsparse API).

After :func:`jaxsparse.pruning.calibrated_prune`, each encoder layer (a block: attention, FFN, both
LayerNorms) is fitted in turn, first to last, to the dense model's hidden states after that layer,
from the inputs the pruned model itself gives it (its earlier blocks already reconstructed): Adam on
the block's weights, biases and LayerNorm parameters, the kernels multiplied by their masks in every
step, so pruned weights stay zero and N:M / block structures are kept. No weight outside the block
changes; nothing is fitted end to end. A few calibration sentences are left out of the fit and pick
each block's epoch with the lowest error (the held-out sentences of ``prune_minilm.py`` are never
seen).

References:
  Shin et al., "Rethinking Pruning Large Language Models: Benefits and Pitfalls of Reconstruction
  Error Minimization", 2024, https://arxiv.org/abs/2406.15524 (block-wise reconstruction towards the
  dense model's outputs after SparseGPT / Wanda).
  Li et al., "BRECQ: Pushing the Limit of Post-Training Quantization by Block Reconstruction", 2021,
  https://arxiv.org/abs/2102.05426.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Mapping
from collections.abc import Sequence

import bert
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

Batch = tuple[jax.Array, jax.Array, jax.Array]  # input_ids, attention_mask, token_type_ids


def length_batches(tokenizer, sentences: Sequence[str], *, batch_size: int = 32, max_length: int = 64,
                   multiple: int = 16) -> list[Batch]:
  """Sentences sorted by length, in batches padded to the batch's longest (rounded up to ``multiple``)."""
  tokenizer.no_padding()
  tokenizer.enable_truncation(max_length=max_length)
  enc = tokenizer.encode_batch(list(sentences))
  order = sorted(range(len(enc)), key=lambda i: len(enc[i].ids))
  out = []
  for i in range(0, len(order), batch_size):
    chunk = [enc[j] for j in order[i:i + batch_size]]
    length = min(max_length, -(-max(len(e.ids) for e in chunk) // multiple) * multiple)
    arrays = np.zeros((3, len(chunk), length), np.int32)
    for row, e in enumerate(chunk):
      arrays[:, row, :len(e.ids)] = e.ids, e.attention_mask, e.type_ids
    out.append(tuple(jnp.asarray(a) for a in arrays))
  return out


def _mask_bias(attention_mask: jax.Array) -> jax.Array:
  return jnp.where(attention_mask[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)


@nnx.jit
def _embed(model: bert.Bert, input_ids: jax.Array, token_type_ids: jax.Array) -> jax.Array:
  return model.embeddings(input_ids, token_type_ids)


@nnx.jit
def _block(layer: bert.Layer, x: jax.Array, attention_mask: jax.Array) -> jax.Array:
  return layer(x, _mask_bias(attention_mask))


def _path(path: tuple) -> str:
  return ".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def _masked(params: nnx.State, masks: Mapping[str, jax.Array]) -> nnx.State:
  return jax.tree_util.tree_map_with_path(lambda p, v: v * masks[_path(p)] if _path(p) in masks else v, params)


def _squared_error(graphdef, params, masks, x, attention_mask, y):
  """Mean squared error of the block's output over the real tokens (padding left out)."""
  out = nnx.merge(graphdef, _masked(params, masks))(x, _mask_bias(attention_mask))
  w = attention_mask[..., None].astype(jnp.float32)
  return jnp.sum(w * (out - y) ** 2) / (jnp.sum(w) * y.shape[-1])


def reconstruct(pruned: bert.Bert, dense: bert.Bert, masks: Mapping[str, np.ndarray], fit: Sequence[Batch],
                val: Sequence[Batch], *, epochs: int = 8, learning_rate: float = 1e-3, seed: int = 0,
                log: list | None = None) -> bert.Bert:
  """A copy of ``pruned`` with each encoder layer fitted to ``dense``'s output of that layer, masks fixed.

  Args:
    pruned: the pruned model (its kernels zero off ``masks``).
    dense: the dense model it was pruned from.
    masks: ``calibrated_prune``'s ``{"encoder.layer.3.intermediate.dense.kernel": (K, N) bool}``;
      kernels without a mask (layers the rules left dense) are fitted without one.
    fit: the batches to fit (:func:`length_batches` of calibration sentences).
    val: batches of other calibration sentences: they only pick each block's best epoch.
    epochs: passes over the fitting batches per block (Adam, cosine-decayed ``learning_rate``).
    learning_rate: Adam's peak step size.
    seed: the order of the batches in each epoch.
    log: if given, one dict per block is appended (errors on the fitting and validation batches
      before and after, validation error per epoch).

  Returns:
    The reconstructed model; ``pruned`` is not modified.
  """
  rng = random.Random(seed)
  tx = optax.adam(optax.cosine_decay_schedule(learning_rate, epochs * len(fit)))
  loss = jax.jit(_squared_error, static_argnums=0)

  @functools.partial(jax.jit, static_argnums=0)  # the blocks' graphdefs are equal: one compilation per shape
  def step(graphdef, params, opt_state, masks, x, attention_mask, y):
    grads = jax.grad(_squared_error, argnums=1)(graphdef, params, masks, x, attention_mask, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  model = nnx.clone(pruned)
  x_fit = [_embed(model, ids, types) for ids, _, types in fit]  # embeddings are not pruned
  x_val = [_embed(model, ids, types) for ids, _, types in val]
  d_fit, d_val = list(x_fit), list(x_val)  # the dense model's hidden states
  for index, layer in enumerate(model.encoder.layer):
    dense_layer = dense.encoder.layer[index]
    d_fit = [_block(dense_layer, x, b[1]) for x, b in zip(d_fit, fit, strict=True)]
    d_val = [_block(dense_layer, x, b[1]) for x, b in zip(d_val, val, strict=True)]
    prefix = f"encoder.layer.{index}."
    layer_masks = {k[len(prefix):]: jnp.asarray(m, jnp.float32) for k, m in masks.items() if k.startswith(prefix)}
    graphdef, params = nnx.split(layer)

    def error(params, xs, ys, bs, graphdef=graphdef, layer_masks=layer_masks):
      errors = [loss(graphdef, params, layer_masks, x, b[1], y) for x, b, y in zip(xs, bs, ys, strict=True)]
      return float(np.mean(errors))

    opt_state = tx.init(params)
    best = (error(params, x_val, d_val, val), params)
    entry = {"block": index, "fit_before": error(params, x_fit, d_fit, fit), "val_before": best[0], "val": []}
    order = list(range(len(fit)))
    for _ in range(epochs):
      rng.shuffle(order)
      for i in order:
        params, opt_state = step(graphdef, params, opt_state, layer_masks, x_fit[i], fit[i][1], d_fit[i])
      entry["val"].append(error(params, x_val, d_val, val))
      if entry["val"][-1] < best[0]:
        best = (entry["val"][-1], params)
    params = _masked(best[1], layer_masks)
    nnx.update(layer, params)
    entry |= {"fit_after": error(params, x_fit, d_fit, fit), "val_after": best[0]}
    if log is not None:
      log.append(entry)
    x_fit = [_block(layer, x, b[1]) for x, b in zip(x_fit, fit, strict=True)]
    x_val = [_block(layer, x, b[1]) for x, b in zip(x_val, val, strict=True)]
  return model
