"""Pruning the Llama model with calibration tokens, one decoder layer at a time, and its sparse inference form.

:func:`prune` runs :func:`jaxsparse.pruning.calibrated_prune` (magnitude, Wanda or SparseGPT) on the seven
projections of every decoder layer (:data:`~llama.model.PROJECTIONS`). It is sequential by decoder layer
(``calibrated_prune``'s default groups: the path up to its first number, ``model.layers.3``): the
calibration inputs of layer ``i`` come from the model whose layers ``0 .. i - 1`` are already pruned. With
``head=True`` the LM head is pruned too: ``lm_head`` last, or, for tied embeddings, the table that serves as the
head (last: the head is its last call), on the head's inputs with the lookups as a ridge.
:func:`to_inference` then swaps the pruned projections for jaxsparse layers with
:func:`jaxsparse.sparsify` and the same masks: 2:4 as ``CompressedNMLinear`` (kept values + 2-bit
positions; on a CUDA GPU cuSPARSELt and the ``mma.sp`` decode kernel), blocks as ``BlockSparseLinear``,
unstructured as ``MaskedLinear``; a pruned 2:4 table (tied or not) becomes a ``CompressedNMEmbed`` holding the
pruned weights under their mask. With ``dense_if_slower_at``, :func:`to_inference` times each distinct sparse
layer against its dense twin at the given decode batch sizes and routes the slower ones to dense ``nnx.Linear``
(:func:`jaxsparse.route_slower_to_dense`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxsparse
from jaxsparse import pruning
from jaxsparse._rules import embedding_rule
from jaxsparse._rules import path_str
from jaxsparse._rules import replace_module
from jaxsparse._rules import resolve_rules
from jaxsparse._sparsify._report import SparsifyReport
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import CompressedNMLinear
from jaxsparse.layers import NMLinear
from llama.model import PROJECTIONS
from llama.model import LlamaForCausalLM

__all__ = [
    "PATTERNS",
    "InferenceReport",
    "compress_nm",
    "fuse_projections",
    "layer_errors",
    "prune",
    "rules_for",
    "to_inference",
]

# The structures of the issue, by the names the scripts use.
PATTERNS = {
    "2:4": jaxsparse.NM(2, 4),
    "unstructured 50%": jaxsparse.Unstructured(sparsity=0.5),
    "block 64x64 50%": jaxsparse.BlockSparse(density=0.5, block_shape=(64, 64)),
}


def rules_for(structure: Any) -> dict[str, Any]:
  """``{PROJECTIONS: structure}``, or ``structure`` itself when it already is a rule dict."""
  return dict(structure) if isinstance(structure, Mapping) else {PROJECTIONS: structure}


def prune(
    model: LlamaForCausalLM,
    calibration_ids: np.ndarray | Sequence[np.ndarray],
    structure: Any,
    *,
    method: str = "sparsegpt",
    head: bool = False,
    batch_size: int = 8,
    progress: bool = True,
    **kwargs: Any,
) -> tuple[LlamaForCausalLM, dict[str, np.ndarray], pruning.CalibratedPruneReport]:
  """Prunes the projections of every decoder layer with calibration tokens, sequentially by layer.

  Args:
    model: the dense model (copied, not changed).
    calibration_ids: int ``(N, T)`` token ids (split into batches of ``batch_size`` rows), or a list of
      ``(b, T)`` batches.
    structure: a jaxsparse structure (``jaxsparse.NM(2, 4)``, ...) for all seven projections of every layer,
      or ``{regex: structure or None}`` rules over the module paths.
    method: ``"magnitude"``, ``"wanda"`` or ``"sparsegpt"``.
    head: prune the LM head with ``structure`` too (``structure`` must then be one structure, not rules). Untied: the
      ``lm_head`` layer, last, on the final norm's outputs of the pruned layers (its mask is
      ``masks["lm_head.kernel"]``). Tied (``tie_word_embeddings``: the logits are the embedding table's ``attend``):
      the table itself (a ``"model.embed_tokens"`` rule), which ``calibrated_prune`` prunes by the method on the
      head's inputs with its lookups as a ridge; ``structure`` must be an ``NM`` one, the only form a table is stored
      in (``CompressedNMEmbed``). The head is the table's last call, so it is pruned last, in a group of its own:
      every decoder layer calibrates on the dense lookups, and the head's statistics come from the pruned decoder
      layers, as an untied ``lm_head``'s do. Its mask is ``masks["model.embed_tokens.embedding"]``. Either way, pass
      ``head=True`` to :func:`to_inference` with the masks. Rules can name ``"lm_head"`` / ``"model.embed_tokens"``
      themselves.
    batch_size: rows per calibration batch (one jitted forward pass each).
    progress: tqdm bar over the pruned layers.
    **kwargs: passed to :func:`jaxsparse.pruning.calibrated_prune` (``damp``, ``refit_iterations``, ...).

  Returns:
    ``(pruned, masks, report)``: the model with pruned (SparseGPT: also updated) weights, still dense layers;
    ``{"model.layers.0.mlp.gate_proj.kernel": bool mask}``; the per-projection report (relative
    reconstruction error ``||Xw - Xŵ|| / ||Xw||`` on each layer's calibration inputs), see
    :func:`layer_errors`.
  """
  rules = _with_head(structure, head, tied=model.lm_head is None)  # before the calibration: its errors come first
  if isinstance(calibration_ids, np.ndarray | jnp.ndarray) and calibration_ids.ndim == 2:
    ids = np.asarray(calibration_ids, np.int32)
    batches = [jnp.asarray(ids[i:i + batch_size]) for i in range(0, len(ids), batch_size)]
  else:
    batches = [jnp.asarray(b, jnp.int32) for b in calibration_ids]
  return pruning.calibrated_prune(model, rules, batches, method=method, progress=progress,
                                  call=lambda m, ids: m(ids), **kwargs)


TABLE = "model.embed_tokens"  # the token embedding's path; its mask is masks[TABLE + ".embedding"]
TABLE_RULE = re.escape(TABLE)


def _with_head(structure: Any, head: bool, *, tied: bool, embedding_hint: str = "") -> dict[str, Any]:
  """:func:`rules_for`, plus, when ``head``, the LM head's rule with the one ``structure``: ``"lm_head"``, or for a
  tied model (no ``lm_head``: the logits are the table's ``attend``) the table's, which takes only ``NM``."""
  rules = rules_for(structure)
  if not head:
    return rules
  name = TABLE if tied else "lm_head"
  if isinstance(structure, Mapping):
    raise ValueError("head=True gives the LM head the one structure; with rules, add "
                     + (f"a {name!r} rule (an NM one: the model ties its LM head to the embedding)" if tied
                        else f"an {name!r} rule") + " instead.")
  if tied and not isinstance(structure, jaxsparse.NM):
    raise ValueError(
        "this model ties its LM head to the embedding (tie_word_embeddings): head=True gives the tied table "
        f"({TABLE}, the LM head through attend) the structure, and a table is stored only N:M (CompressedNMEmbed): "
        f"head=True takes jaxsparse.NM(n, m) here, got {_describe(structure)}. Keep head=False (the table dense)"
        f"{embedding_hint}, or give the table its own NM rule: {{PROJECTIONS: structure, {TABLE!r}: "
        "jaxsparse.NM(2, 4)}.")
  rules[TABLE_RULE if tied else "lm_head"] = structure
  return rules


def _describe(structure: Any) -> str:
  return structure.describe() if hasattr(structure, "describe") else repr(structure)


def _table_rule(model: LlamaForCausalLM, rules: Mapping[str, Any]) -> jaxsparse.NM | None:
  """The structure ``rules`` give the embedding table, read as :func:`jaxsparse.sparsify` reads them (the first rule
  that fully matches its path, if that rule matches no linear layer; it must be ``NM``), or ``None``."""
  linear = [path_str(p) for p, node in nnx.iter_modules(model) if isinstance(node, nnx.Linear | nnx.LinearGeneral)]
  return embedding_rule(resolve_rules(rules), TABLE, linear, kind="nnx.Embed",
                        layers="nnx.Linear (the projections, lm_head)", features=model.config.hidden_size)


def layer_errors(report: pruning.CalibratedPruneReport) -> dict[int, float]:
  """Mean relative reconstruction error of the pruned projections of each decoder layer, ``{layer: error}`` (layers
  outside the decoder layers, as the LM head, are left out: ``report.layers`` has them)."""
  out: dict[int, list[float]] = {}
  for row in report.layers:
    parts = row.path.split(".")
    if parts[:2] == ["model", "layers"]:
      out.setdefault(int(parts[2]), []).append(row.error)
  return {layer: float(np.mean(errors)) for layer, errors in sorted(out.items())}


def compress_nm(model: nnx.Module, *, cusparselt_copy: bool = False, storage: str = "auto") -> nnx.Module:
  """Replaces every ``NMLinear`` (in place) by its ``CompressedNMLinear``, the inference form; returns ``model``.

  ``storage``: ``CompressedNMLinear``'s; ``"auto"`` keeps a 2:4 kernel as cuSPARSELt's buffer alone where the GPU's
  cuSPARSELt reads it (0.5625x the dense projection's bytes, prefill on sparse tensor cores), else as values and
  positions. ``cusparselt_copy``: with values and positions, also keep a cuSPARSELt copy of each 2:4 kernel (1.125x
  the dense projection's bytes).
  """
  found = [(tuple(path), node) for path, node in nnx.iter_graph(model) if isinstance(node, NMLinear)]
  for path, node in found:
    replace_module(model, path, node.to_compressed(cusparselt_copy=cusparselt_copy, storage=storage))
  return model


# What the layers of one fusion must share, besides their class and input features.
_FUSE_SAME = {
    nnx.Linear: ("param_dtype",),
    CompressedNMLinear: ("n", "m", "axis", "implementation", "cusparselt_copy", "storage"),
    BlockSparseLinear: ("block_shape", "param_dtype", "implementation"),
}


def _block_sparse_concatenated(layers: list[BlockSparseLinear], bias: jax.Array | None) -> BlockSparseLinear:
  """The block-sparse layer of the weights side by side: the block masks concatenated along the block columns, the
  kept blocks reordered to the joined matrix's row-major block order."""
  first = layers[0]
  weights = [layer.sparse_kernel for layer in layers]
  offsets = np.cumsum([0] + [w.grid_shape[1] for w in weights])
  rows = np.concatenate([np.asarray(w.row_indices) for w in weights])
  cols = np.concatenate([np.asarray(w.col_indices) + off for w, off in zip(weights, offsets[:-1], strict=True)])
  order = np.lexsort((cols, rows))  # by block row, then block column
  data = jnp.concatenate([w.data for w in weights])[order]
  mask = np.concatenate([np.asarray(w.block_mask) for w in weights], axis=1)
  return BlockSparseLinear(first.in_features, int(offsets[-1]) * first.block_shape[1], block_mask=mask,
                           block_shape=first.block_shape, use_bias=bias is not None, dtype=first.dtype,
                           param_dtype=first.param_dtype, kernel_init=lambda *_: data, bias_init=lambda *_: bias,
                           implementation=first.implementation, precision=first.precision, rngs=nnx.Rngs(0))


def _concatenated(layers: list[nnx.Module]) -> nnx.Module | None:
  """One layer computing ``concatenate([layer(x) for layer in layers], -1)``, or None where they cannot be joined:
  ``nnx.Linear``, ``CompressedNMLinear`` (N:M groups along the inputs) or ``BlockSparseLinear``, all of one class
  and settings."""
  first = layers[0]
  kind = type(first)
  if kind not in _FUSE_SAME or any(type(layer) is not kind for layer in layers):
    return None
  same = ("in_features", "dtype", "precision", *_FUSE_SAME[kind])
  if any(getattr(layer, a) != getattr(first, a) for layer in layers for a in same):
    return None
  if kind is CompressedNMLinear and first.axis != 0:  # groups along the outputs: columns do not concatenate
    return None
  biases = [None if layer.bias is None else layer.bias[...] for layer in layers]
  if any((b is None) != (biases[0] is None) for b in biases):
    return None
  bias = None if biases[0] is None else jnp.concatenate(biases)
  out = sum(layer.out_features for layer in layers)
  if kind is BlockSparseLinear:
    return _block_sparse_concatenated(layers, bias)
  if kind is nnx.Linear:
    kernel = jnp.concatenate([layer.kernel[...] for layer in layers], axis=1)
    return nnx.Linear(first.in_features, out, use_bias=bias is not None, dtype=first.dtype,
                      param_dtype=first.param_dtype, precision=first.precision,
                      kernel_init=lambda *_: kernel, bias_init=lambda *_: bias, rngs=nnx.Rngs(0))
  weights = [layer.weight for layer in layers]
  weight = jaxsparse.NMSparseMatrix(
      jnp.concatenate([w.values for w in weights], axis=1), jnp.concatenate([w.indices for w in weights], axis=1),
      shape=(first.in_features, out), n=first.n, m=first.m, axis=0, validate=False)
  return CompressedNMLinear(weight, bias, dtype=first.dtype, precision=first.precision,
                            promote_dtype=first.promote_dtype, preferred_element_type=first.preferred_element_type,
                            implementation=first.implementation, cusparselt_copy=first.cusparselt_copy,
                            storage=first.storage)


def fuse_projections(model: LlamaForCausalLM) -> LlamaForCausalLM:
  """Joins, in place, the projections that share an input: ``q_proj``, ``k_proj``, ``v_proj`` into ``qkv_proj`` and
  ``gate_proj``, ``up_proj`` into ``gate_up_proj`` (concatenated along the outputs); returns ``model``.

  One product instead of three (two) per decoder layer: each sparse kernel call has a fixed cost (its launch, its
  first loads, its K-split reduction), which shows on decode-size products of a few microseconds. The outputs are
  those of the separate layers. Joined where all members are ``nnx.Linear``, all ``CompressedNMLinear`` or all
  ``BlockSparseLinear`` of equal settings (block shape included); other layers (masked, mixed kinds) stay as they
  are. An inference form: :func:`llama.checkpoint.save_pretrained` and :func:`llama.checkpoint.export_masks` (torch
  masks) split the fused layers back into Hugging Face's; ``jaxsparse.torch_interop.export_masks`` alone writes the
  fused names, which no torch model has.

  >>> import jax.numpy as jnp, jaxsparse
  >>> from flax import nnx
  >>> from llama.model import LlamaConfig, LlamaForCausalLM
  >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
  ...                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
  >>> model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
  >>> ids = jnp.arange(6)[None]
  >>> before = model(ids)
  >>> fused = fuse_projections(model)
  >>> fused.model.layers[0].self_attn.qkv_proj.out_features, fused.model.layers[0].mlp.gate_up_proj.out_features
  (64, 128)
  >>> bool(jnp.allclose(fused(ids), before, atol=1e-5))
  True
  """
  for layer in model.model.layers:
    for parent, names, joined in ((layer.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                                  (layer.mlp, ("gate_proj", "up_proj"), "gate_up_proj")):
      if not all(hasattr(parent, n) for n in names):
        continue  # fused already
      fused = _concatenated([getattr(parent, n) for n in names])
      if fused is not None:
        setattr(parent, joined, fused)
        for n in names:
          delattr(parent, n)
  return model


@dataclasses.dataclass(frozen=True)
class InferenceReport(SparsifyReport):
  """:func:`to_inference`'s report: :func:`jaxsparse.sparsify`'s, plus the timings of ``dense_if_slower_at``.

  Attributes:
    timings: one :class:`jaxsparse.SignatureTiming` per distinct sparse layer signature; empty without
      ``dense_if_slower_at``.
  """

  timings: tuple[jaxsparse.SignatureTiming, ...] = ()

  @property
  def routed_to_dense(self) -> tuple[jaxsparse.LayerSignature, ...]:
    """The signatures whose layers were routed to dense ``nnx.Linear``."""
    return tuple(t.signature for t in self.timings if t.dense)

  @property
  def dense_paths(self) -> tuple[str, ...]:
    """The paths of the layers routed to dense ``nnx.Linear``, sorted."""
    return tuple(sorted(p for t in self.timings if t.dense for p in t.paths))

  def timing_table(self) -> str:
    """The timings as a Markdown table, one row per signature."""
    batches = sorted({b for t in self.timings for b in t.sparse_ms})
    stepped = any(t.step_ms for t in self.timings)
    head = ["signature", "layers"] + [f"b={b} sparse / dense ms" for b in batches] + ["max ratio"]
    head += ["step sparse / dense ms"] * stepped + ["runs"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in self.timings:
      cells = [str(t.signature), str(len(t.paths))]
      cells += [f"{t.sparse_ms[b]:.4f} / {t.dense_ms[b]:.4f}" for b in batches]
      cells += [f"{t.ratio:.2f}"]
      if stepped:
        cells.append(f"{t.step_ms['sparse']:.4f} / {t.step_ms['dense']:.4f}" if t.step_ms else "-")
      cells += ["dense" if t.dense else "sparse"]
      rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)

  def __str__(self) -> str:
    return super().__str__() + ("\n\n" + self.timing_table() if self.timings else "")


def to_inference(model: LlamaForCausalLM, structure: Any, *, masks: Mapping[str, Any] | None = None,
                 head: bool = False, embedding: jaxsparse.NM | None = None, compress: bool = True,
                 cusparselt_copy: bool = False, storage: str = "auto",
                 dense_unstructured: bool = True,
                 dense_if_slower_at: int | Sequence[int] | None = None,
                 timer: Callable[[nnx.Module, jax.Array], float] | None = None, fuse: bool = False,
                 step_timer: Callable[[LlamaForCausalLM], float] | None = None,
                 ) -> tuple[LlamaForCausalLM, InferenceReport]:
  """The sparse inference model: :func:`jaxsparse.sparsify` with ``masks`` (or by magnitude without), 2:4
  layers compressed, and optionally the sparse layers slower than dense routed to dense.

  An unstructured model is routed to dense by default: no kernel multiplies a 50%-unstructured weight faster than
  the dense product on a GPU, and a ``MaskedLinear`` re-applies its mask in every call (0.36-0.42x the dense
  decode tokens/s for the Llama-3-8B shape on an H100, ``benchmarks/results/llm_decode_2026-11-26_h100.md``), so
  they become ``nnx.Linear`` with the pruned weights zero (:func:`jaxsparse.densify`: the same outputs, dense speed).

  ``dense_if_slower_at`` does the same for the other structures where they are measured slower: the ops' measured
  dispatch picks the fastest sparse kernel for each product, but has no dense weight to fall back to, and on the
  TinyLlama-1.1B shape 2:4 and block 64 decoded at 0.70-0.94x dense at batch 8 and 32 (the same results file).
  Each distinct sparse layer (class, shape, pattern, density, dtype) is timed against its dense twin on the
  current default device at those batch sizes, and every layer of a signature slower by more than 3% at any of
  them becomes an ``nnx.Linear`` holding the pruned weights (:func:`jaxsparse.route_slower_to_dense`). Only the
  projections are timed, one at a time: a model-level difference the layers alone do not show (XLA's dense products
  run faster next to their neighbours) is not seen, unless ``step_timer`` times the model's step to settle the
  signatures the layers alone left close to dense.

  Args:
    model: a (pruned) dense model; copied.
    structure: as in :func:`prune`.
    masks: :func:`prune`'s masks; ``None`` prunes by magnitude (random-weight benchmarks).
    head: give the LM head (``lm_head``, a ``(hidden, vocab)`` product in every decode step) ``structure`` too;
      ``structure`` must then be one structure, not rules (rules can name ``"lm_head"`` themselves). By magnitude
      unless ``masks`` has ``"lm_head.kernel"``. A model with tied embeddings (no ``lm_head``: the logits are the
      table's ``attend``) gives the table ``structure`` (an ``NM`` one; rules can name ``"model.embed_tokens"``
      instead), stored as a ``CompressedNMEmbed`` from ``masks["model.embed_tokens.embedding"]`` (:func:`prune`'s
      calibrated mask, its kept weights as they are) or else by magnitude; with ``embedding`` given, the table
      takes that instead.
    embedding: ``jaxsparse.NM(n, m)`` stores the token embedding as a ``CompressedNMEmbed`` (``n`` of every ``m``
      features of each row kept, by magnitude unless ``masks`` has ``"model.embed_tokens.embedding"``): memory
      only, a lookup reads one row a token. With ``head`` the model keeps no dense weight matrix but the norms. A model
      with tied embeddings (no ``lm_head``) computes its logits with ``CompressedNMEmbed.attend``, an N:M product on
      the stored table: ``embedding`` (or ``head``) makes both sparse there.
      Pruning the LM head and the embedding costs accuracy that the decoder layers' calibration does not see:
      measure it on your model before serving it.
    compress: turn ``NMLinear`` (SR-STE training layer, dense kernel) into ``CompressedNMLinear``.
    cusparselt_copy: with ``compress`` and ``storage="values"``, keep each 2:4 layer's cuSPARSELt copy as well
      (see :func:`compress_nm`): 1.11x the dense model's bytes for the Llama-3-8B shape.
    storage: with ``compress``, how the 2:4 layers keep their kernel (:func:`compress_nm`). ``"auto"`` (the
      default) keeps cuSPARSELt's buffer alone on a GPU that reads it: the weight bytes of ``storage="values"``
      without a copy (0.62x the dense model's for the Llama-3-8B shape), and the prefill products on sparse tensor
      cores without compressing the weight in every call.
    dense_unstructured: with an ``Unstructured`` structure, route the masked layers to dense ``nnx.Linear`` (see above).
    dense_if_slower_at: decode batch size(s) to time the sparse layers at, e.g. ``(1, 8, 32)``; ``None`` times
      nothing and keeps every sparse layer.
    timer: ``(layer, x) -> ms`` for ``dense_if_slower_at``; ``None``: measured on the default device.
    fuse: join the projections that share an input (:func:`fuse_projections`): fewer, larger sparse products for
      generation; with ``dense_if_slower_at`` the fused layers are timed. The returned model then has ``qkv_proj`` /
      ``gate_up_proj`` where Hugging Face has three / two layers: ``save_pretrained`` and
      :func:`llama.checkpoint.export_masks` split them back.
    step_timer: with ``dense_if_slower_at``, ``(model) -> ms`` of the model's decode step at the batch it serves;
      the signatures within 15% of dense alone are then kept sparse or routed by that step's time
      (``route_slower_to_dense``'s ``step_timer``).

  Returns:
    ``(sparse_model, report)``: ``report`` is ``sparsify``'s (an :class:`InferenceReport`, a
    ``SparsifyReport``) with the timings: ``report.routed_to_dense`` lists the signatures now dense,
    ``report.dense_paths`` their layers.
  """
  if embedding is not None and not isinstance(embedding, jaxsparse.NM):
    raise TypeError(f"embedding must be a jaxsparse.NM(n, m) or None, got {embedding!r}.")
  tied = model.lm_head is None
  # Tied, the table is the head: head=True gives it `structure` (a rule naming it), unless embedding= gives its own.
  rules = _with_head(structure, head and not (tied and embedding is not None), tied=tied,
                     embedding_hint=" or give the table a structure of its own with embedding=NM(n, m)")
  named = _table_rule(model, rules)  # the rules' table structure (head=True on a tied model, or the user's rule)
  if named is not None and embedding is not None:
    if embedding != named:
      raise ValueError(f"the rules give {TABLE} {named.describe()} and embedding= {embedding.describe()}: give it one "
                       "structure (a rule naming the table, or embedding=).")
    embedding = None  # the rules' own: sparsify stores it with the projections
  flat = pruning.masks_to_dict(masks) if masks is not None else {}
  embed_key = f"{TABLE}.embedding"
  embed_masks = {k: v for k, v in flat.items() if k == embed_key}
  if embed_masks and embedding is None and named is None:
    raise ValueError(f"masks has {embed_key!r}, but embedding=None keeps the embedding dense; pass embedding=NM(...)"
                     + (" or head=True (the tied table is the LM head)." if tied else "."))
  layer_masks = None if masks is None else flat if named is not None else {
      k: v for k, v in flat.items() if k != embed_key}
  sparse, report = jaxsparse.sparsify(model, rules, masks=layer_masks)
  if compress:
    compress_nm(sparse, cusparselt_copy=cusparselt_copy, storage=storage)
  if dense_unstructured and isinstance(structure, jaxsparse.Unstructured):
    sparse = jaxsparse.densify(sparse)
  if embedding is not None:  # after densify, which would expand it again
    sparse, embedded = jaxsparse.sparsify(sparse, {r"model\.embed_tokens": embedding}, masks=embed_masks or None,
                                          inplace=True)
    report = SparsifyReport(tuple(sorted(report.layers + embedded.layers, key=lambda c: c.path)))
  if fuse:  # before the timing: the fused layers are what runs
    fuse_projections(sparse)
  timings = ()
  if dense_if_slower_at is not None:
    timings = jaxsparse.route_slower_to_dense(sparse, dense_if_slower_at, timer=timer, step_timer=step_timer)
  return sparse, InferenceReport(report.layers, timings)
