"""The masks given to :func:`~jaxsparse.sparsify` / :func:`~jaxsparse.sparsify_linen` and the densities they report.

One rule for NNX and Linen: the ``masks=`` argument as ``{"path.kernel": mask}`` (:func:`masks_dict`), its keys
checked against the layers the rules sparsify (:func:`check_masks_used`), each mask checked against the structure
that keeps it (:func:`block_mask_of`, :func:`check_nm_mask`, :func:`check_general_mask_view`) and against the
fraction its rule keeps (:func:`mask_density_note`, :func:`warn_mask_densities`); and the kept fraction
of an N:M kernel or table (:func:`nm_density`, :func:`nm_table_density`, :func:`nm_signature_density`), counted from
the weights where they hold values and from the given mask where a trace hides them.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxsparse import _utils
from jaxsparse._rules import as_numpy_bool
from jaxsparse._rules import masks_to_dict
from jaxsparse.formats._base import is_concrete
from jaxsparse.formats._specs import NM
from jaxsparse.formats._specs import BlockSparse
from jaxsparse.formats._specs import Spec
from jaxsparse.formats._specs import Unstructured
from jaxsparse.formats._specs import matrix_shape
from jaxsparse.layers._common import compressed_kept_count
from jaxsparse.layers._common import eager_if_concrete
from jaxsparse.layers._common import kept_fraction
from jaxsparse.layers._common import nm_kept_count

__all__ = [
    "block_mask_of", "check_general_mask_view", "check_masks_used", "check_nm_mask", "mask_density_note", "masks_dict",
    "nm_density", "nm_signature_density", "nm_table_density", "warn_mask_densities",
]

# A given mask whose kept fraction is further than this (and than one block or weight) from its rule's is reported
# (mask_density_note).
MASK_DENSITY_SLACK = 0.02


def masks_dict(masks: Any) -> dict[str, np.ndarray]:
  """``masks=`` of sparsify / sparsify_linen as ``{dotted path: bool NumPy array}``; a ``TypeError`` naming the key of a
  mask that is not boolean (every structure takes the same masks: 0.5 or 2 is no "kept")."""
  if masks is None:
    return {}
  return {k: as_numpy_bool(m, name=f"masks[{k!r}]") for k, m in masks_to_dict(masks).items()}


def check_masks_used(mask_dict: dict, used: set[str], path_of_kernel: list[str]) -> None:
  """Raises for mask keys that no sparsified layer's kernel takes (a typo, or a layer the rules keep dense)."""
  unused = sorted(set(mask_dict) - used)
  if unused:
    listing = ", ".join(path_of_kernel[:12]) + (" ..." if len(path_of_kernel) > 12 else "") or "(none)"
    raise ValueError(
        f"masks has key(s) {unused[:10]}{' ...' if len(unused) > 10 else ''} that match no layer the rules "
        f"sparsify; keys are '<layer path>.kernel' of a layer a rule maps to a structure: {listing}. Masks from a "
        "pruner (pruning.get_masks) cover every kernel its rules match: give the pruner the rules sparsify gets, "
        "with None for layers sparsify does not convert."
    )


def block_mask_of(mask: np.ndarray, block_shape: tuple[int, int], path: str) -> np.ndarray:
  k, n = mask.shape
  bk, bn = block_shape
  blocks = mask.reshape(k // bk, bk, n // bn, bn)
  anyb, allb = blocks.any(axis=(1, 3)), blocks.all(axis=(1, 3))
  if not np.array_equal(anyb, allb):
    raise ValueError(f"{path}: the given mask is not constant over {block_shape} blocks, so it is not a block mask.")
  if not anyb.any():
    raise ValueError(f"{path}: the given mask keeps no block.")
  return anyb


def mask_density_note(spec: Spec, mask: np.ndarray | None) -> str:
  """A report note where a mask given to sparsify keeps another fraction of the weights than its rule asks, else
  ``""``.

  The mask wins (the layer keeps exactly its weights): a gradual pruner's masks taken before its last step, or masks
  of a global magnitude ranking, give layers other densities than the rule names, and the report's structure column
  (the rule's words) would say otherwise. ``BlockSparse`` and ``Unstructured`` rules only: an ``NM`` rule's mask is
  checked group by group (:func:`check_nm_mask`). A block mask keeps the same fraction of blocks as of weights.
  """
  if mask is None or not isinstance(spec, (BlockSparse, Unstructured)) or mask.size == 0:
    return ""
  kept = float(np.count_nonzero(mask)) / mask.size
  want = 1.0 - spec.target_sparsity
  units = mask.size // math.prod(spec.block_shape) if isinstance(spec, BlockSparse) else mask.size
  if abs(kept - want) <= max(MASK_DENSITY_SLACK, 1 / units):  # a block (or weight) off: a rounding, not a schedule
    return ""
  what = "blocks" if isinstance(spec, BlockSparse) else "weights"
  return f"the given mask keeps {kept:.1%} of the {what} where the rule keeps {want:.1%}"


def warn_mask_densities(notes: dict[str, str]) -> None:
  """One ``UserWarning`` naming the layers whose given masks keep another fraction than their rules
  (``notes``: path -> :func:`mask_density_note`, empty notes left out)."""
  notes = {p: n for p, n in notes.items() if n}
  if not notes:
    return
  listed = "; ".join(f"{p or '(the model itself)'}: {n}" for p, n in list(notes.items())[:8])
  more = f"; and {len(notes) - 8} more" if len(notes) > 8 else ""
  _utils.warn_at_caller(
      f"masks= keep another fraction of the weights than the rules name at {len(notes)} layer(s) ({listed}{more}). "
      "The masks win: each layer keeps exactly the weights its mask keeps (the report's density column). Masks of a "
      "gradual pruner taken before its end_step, or of a global ranking, do this; give rules of the masks' "
      "densities, or prune to the end of the schedule, to silence this.", UserWarning)


def check_nm_mask(mask: np.ndarray, spec: NM, axis: int, path: str, *, what: str = "the input features") -> None:
  """Raises unless ``mask`` keeps at most ``n`` of every ``m`` along ``axis`` (and the last axis, if transposable).

  An N:M layer built from a mask keeps the mask's weights only when the mask is N:M; anything else
  would be re-pruned by magnitude without a word. ``what`` names ``axis`` in the message.
  """
  axes = [(axis, what)]
  if spec.transposable and mask.shape[-1] % spec.m == 0:
    axes.append((mask.ndim - 1, "the output features (transposable)"))
  for ax, what_ax in axes:
    moved = np.moveaxis(np.asarray(mask, bool), ax, 0)
    counts = moved.reshape(moved.shape[0] // spec.m, spec.m, *moved.shape[1:]).sum(1)
    if counts.size and counts.max() > spec.n:
      group = tuple(int(i) for i in np.unravel_index(np.argmax(counts), counts.shape))
      raise ValueError(
          f"{path}: the given mask is not {spec.n}:{spec.m} along {what_ax} (axis {ax}): group {group} keeps "
          f"{int(counts.max())} of {spec.m} ({int((counts > spec.n).sum())} groups keep more than {spec.n}). An "
          f"NM({spec.n}, {spec.m}) rule keeps a mask only if it is {spec.n}:{spec.m}; prune with the same NM rule, "
          "or map this layer to jaxsparse.Unstructured to keep the mask as it is."
      )


def check_general_mask_view(mask: np.ndarray, spec: Spec, in_ndim: int, path: str) -> None:
  """Explains a mask that fits the layer's kernel only in the conv-layout view of a multi-axis kernel.

  A multi-axis kernel (``nn.MultiHeadAttention``'s q/k/v ``(in, heads, head_dim)``) is the 2-D
  ``matrix_shape(shape, in_ndim)`` matrix here and in :mod:`jaxsparse.pruning`, which takes its
  input axes from ``views=`` (``pruning.kernel_views``) or else tells its output axes from the layer's
  bias; without either, the pruner takes every axis but the last as an input (conv layout), where such
  a mask fits.
  """
  if mask.ndim < 3 or in_ndim == mask.ndim - 1:
    return
  k, n = matrix_shape(mask.shape, in_ndim)
  mask2, pruner2 = mask.reshape(k, n), mask.reshape(matrix_shape(mask.shape))
  if isinstance(spec, NM):
    def fits(m, axis):
      if m.shape[axis] % spec.m:
        return False
      groups = np.moveaxis(m, axis, 0).reshape(m.shape[axis] // spec.m, spec.m, -1)
      return groups.sum(1).max(initial=0) <= spec.n
    ok_here, ok_pruner = fits(mask2, 0), fits(mask, mask.ndim - 2)
  elif isinstance(spec, BlockSparse):
    def fits(m):
      bk, bn = spec.block_shape
      if m.shape[0] % bk or m.shape[1] % bn:
        return False
      blocks = m.reshape(m.shape[0] // bk, bk, m.shape[1] // bn, bn)
      return np.array_equal(blocks.any(axis=(1, 3)), blocks.all(axis=(1, 3)))
    ok_here, ok_pruner = fits(mask2), fits(pruner2)
  else:
    return
  if not ok_here and ok_pruner:
    raise ValueError(
        f"{path}: the given mask fits {spec.describe()} in the conv-layout view of this {mask.shape} kernel "
        f"(every axis but the last an input: {pruner2.shape}), but this layer contracts its first {in_ndim} axis(es): "
        f"sparsify views it as {(k, n)}, where the mask does not fit. The pruners of jaxsparse.pruning tell a "
        "kernel's output axes from its layer's bias, and this layer has none: prune with "
        "views=jaxsparse.pruning.kernel_views(model) (the same view as sparsify), or sparsify it without masks=."
    )


def nm_density(kernel: Any, n: int, m: int, *, transposable: bool = False, weight_mask: Any = None,
               mask: np.ndarray | None = None) -> float | None:
  """The fraction of ``kernel`` that an ``n:m`` pattern keeps nonzero (a group may keep fewer than ``n``), after an N:M
  conv's own Flax ``weight_mask``; ``mask``: the mask given for the layer (checked N:M), whose kept weights the pattern
  keeps. Counted from the weights where they hold values; from ``mask`` where a trace hides them (an abstract model,
  ``nnx.eval_shape`` / ``jax.eval_shape``), else the most the pattern keeps (``n / m``), ``None`` with a traced
  ``weight_mask``. An empty (zero-size) kernel keeps nothing: 0.0, as :func:`nm_table_density` says of a table."""
  if mask is not None and not is_concrete(kernel) and (weight_mask is None or is_concrete(weight_mask)):
    kept = mask if weight_mask is None else np.logical_and(mask, np.broadcast_to(weight_mask, mask.shape))
    return kept_fraction(int(np.count_nonzero(kept)), mask.size)
  kept = nm_kept_count(kernel, n, m, transposable=transposable, weight_mask=weight_mask)
  return kept_fraction(kept, math.prod(kernel.shape))


def nm_table_density(table: Any, n: int, m: int, *, mask: np.ndarray | None = None) -> float:
  """The fraction of an embedding ``table`` ``(num_embeddings, features)`` that a ``CompressedNMEmbed`` keeps nonzero
  (``n`` of every ``m`` features of a row, fewer where ``mask`` or the table's zeros keep fewer), counted as
  :func:`nm_density` counts a kernel: from the table (pruned to ``mask``, the one given for the layer, checked N:M)
  where it holds values; from ``mask`` where a trace hides them (``nnx.eval_shape`` / ``jax.eval_shape``, an abstract
  ``jax.ShapeDtypeStruct`` table), else the most the pattern keeps (``n / m``). An empty table keeps nothing: 0.0."""
  size = math.prod(table.shape)
  if not is_concrete(table):
    return kept_fraction(int(np.count_nonzero(mask)) if mask is not None else size * n // m, size)
  with eager_if_concrete(table):
    pruned = table if mask is None else jnp.where(np.asarray(mask), table, jnp.zeros((), table.dtype))
  return kept_fraction(nm_kept_count(pruned.T, n, m), size)  # the groups along the features: axis -2 transposed


def nm_signature_density(kernel: Any, n: int, m: int, *, compressed: bool = False,
                         transposable: bool = False) -> float | None:
  """The density in an N:M layer's :class:`~jaxsparse.LayerSignature`, one rule for NNX and Linen layers: the nonzero
  weights its pattern keeps (a group may keep fewer than ``n``) over the dense kernel's size.

  Args:
    kernel: the dense kernel ``(K, N)`` of an ``NMLinear`` / ``NMDense`` (counted as :func:`nm_density` counts it), or
      with ``compressed`` the kept values ``(K * n // m, N)`` of a ``CompressedNMLinear`` / ``CompressedNMDense`` (its
      nonzero values counted); ``None`` (a ``storage="cusparselt"`` layer keeps no values) gives ``n / m``.
    n, m: the layer's pattern.
    compressed: whether ``kernel`` holds the compressed values.
    transposable: the layer's ``transposable`` (a dense kernel's pattern along both axes).

  Returns:
    The kept fraction; ``n / m`` (the most the pattern keeps) where traced or abstract values hide the count.
  """
  if kernel is None:
    return n / m
  if compressed:  # the nonzero values of the (K * n // m, N) kept ones (all of them where traced: n / m)
    return kept_fraction(compressed_kept_count(kernel), math.prod(kernel.shape) * m // n)
  return nm_density(kernel, n, m, transposable=transposable)
