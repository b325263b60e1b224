"""Pruning the Llama model with calibration tokens, one decoder layer at a time, and its sparse inference form.

:func:`prune` runs :func:`jaxsparse.pruning.calibrated_prune` (magnitude, Wanda or SparseGPT) on the seven
projections of every decoder layer (:data:`~llama.model.PROJECTIONS`). It is sequential by decoder layer
(``calibrated_prune``'s default groups: the path up to its first number, ``model.layers.3``): the
calibration inputs of layer ``i`` come from the model whose layers ``0 .. i - 1`` are already pruned.
:func:`to_inference` then swaps the pruned projections for jaxsparse layers with
:func:`jaxsparse.sparsify` and the same masks: 2:4 as ``CompressedNMLinear`` (kept values + 2-bit
positions; on a CUDA GPU cuSPARSELt and the ``mma.sp`` decode kernel), blocks as ``BlockSparseLinear``,
unstructured as ``MaskedLinear``.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxsparse
from jaxsparse import pruning
from jaxsparse.layers import NMLinear
from llama.model import PROJECTIONS
from llama.model import LlamaForCausalLM

__all__ = ["PATTERNS", "compress_nm", "layer_errors", "prune", "rules_for", "to_inference"]

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
    batch_size: rows per calibration batch (one jitted forward pass each).
    progress: tqdm bar over the pruned layers.
    **kwargs: passed to :func:`jaxsparse.pruning.calibrated_prune` (``damp``, ``refit_iterations``, ...).

  Returns:
    ``(pruned, masks, report)``: the model with pruned (SparseGPT: also updated) weights, still dense layers;
    ``{"model.layers.0.mlp.gate_proj.kernel": bool mask}``; the per-projection report (relative
    reconstruction error ``||Xw - Xŵ|| / ||Xw||`` on each layer's calibration inputs), see
    :func:`layer_errors`.
  """
  if isinstance(calibration_ids, np.ndarray | jnp.ndarray) and calibration_ids.ndim == 2:
    ids = np.asarray(calibration_ids, np.int32)
    batches = [jnp.asarray(ids[i:i + batch_size]) for i in range(0, len(ids), batch_size)]
  else:
    batches = [jnp.asarray(b, jnp.int32) for b in calibration_ids]
  return pruning.calibrated_prune(model, rules_for(structure), batches, method=method, progress=progress,
                                  call=lambda m, ids: m(ids), **kwargs)


def layer_errors(report: pruning.CalibratedPruneReport) -> dict[int, float]:
  """Mean relative reconstruction error of the pruned projections of each decoder layer, ``{layer: error}``."""
  out: dict[int, list[float]] = {}
  for row in report.layers:
    out.setdefault(int(row.path.split(".")[2]), []).append(row.error)
  return {layer: float(np.mean(errors)) for layer, errors in sorted(out.items())}


def compress_nm(model: nnx.Module) -> nnx.Module:
  """Replaces every ``NMLinear`` (in place) by its ``CompressedNMLinear``, the inference form; returns ``model``."""
  found = [(tuple(path), node) for path, node in nnx.iter_graph(model) if isinstance(node, NMLinear)]
  for path, node in found:
    parent = model
    for part in path[:-1]:
      parent = parent[part] if isinstance(part, int) else getattr(parent, part)
    if isinstance(path[-1], int):
      parent[path[-1]] = node.to_compressed()
    else:
      setattr(parent, path[-1], node.to_compressed())
  return model


def to_inference(model: LlamaForCausalLM, structure: Any, *, masks: Mapping[str, Any] | None = None,
                 compress: bool = True, dense_unstructured: bool = True
                 ) -> tuple[LlamaForCausalLM, jaxsparse.SparsifyReport]:
  """The sparse inference model: :func:`jaxsparse.sparsify` with ``masks`` (or by magnitude without), 2:4
  layers compressed.

  An unstructured model is routed to dense by default: no kernel multiplies a 50%-unstructured weight faster than
  the dense product on a GPU, and a ``MaskedLinear`` re-applies its mask in every call (0.36-0.42x the dense
  decode tokens/s for the Llama-3-8B shape on an H100, ``benchmarks/results/llm_decode_2026-11-26_h100.md``), so
  they become ``nnx.Linear`` with the pruned weights zero (:func:`jaxsparse.densify`: the same outputs, dense speed).

  Args:
    model: a (pruned) dense model; copied.
    structure: as in :func:`prune`.
    masks: :func:`prune`'s masks; ``None`` prunes by magnitude (random-weight benchmarks).
    compress: turn ``NMLinear`` (SR-STE training layer, dense kernel) into ``CompressedNMLinear``.
    dense_unstructured: with an ``Unstructured`` structure, route the masked layers to dense ``nnx.Linear`` (see above).

  Returns:
    ``(sparse_model, report)``.
  """
  sparse, report = jaxsparse.sparsify(model, rules_for(structure), masks=masks)
  if compress:
    compress_nm(sparse)
  if dense_unstructured and isinstance(structure, jaxsparse.Unstructured):
    sparse = jaxsparse.densify(sparse)
  return sparse, report
