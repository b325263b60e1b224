"""Post-training pruning with calibration data: magnitude, Wanda and SparseGPT over a whole model.

:func:`calibrated_prune` (NNX) and :func:`calibrated_prune_linen` calibrate the selected dense layers
on a few batches (:mod:`jaxsparse.pruning._calibration`), compute each layer's mask (and for
SparseGPT its updated weights) with the jitted per-layer solvers, optionally refit the kept weights
by least squares (:func:`jaxsparse.pruning.refit_layer`; by default after SparseGPT), write the pruned
weights back and return the masks, ready for ``jaxsparse.sparsify(model, rules, masks=masks)``.

Sequential mode (SparseGPT's, also used by Wanda's reference code): layers are pruned group by group
(by default one group per transformer block), in the order the model calls them, and each group is
calibrated on the model whose earlier groups are already pruned, so a layer is fitted to the inputs
it will see. Each group costs one pass over the calibration batches up to its last layer (XLA drops
the rest of the forward pass); a model of ``G`` groups costs about ``G / 2`` full passes.

Embedding tables (``nnx.Embed`` / ``nn.Embed``) are pruned when a rule names them (a rule that matches no dense
layer, as :func:`jaxsparse.sparsify` takes them; catch-all rules leave tables dense): a table the model only looks up
by magnitude whatever the method (what Wanda and SparseGPT reduce to on one-hot inputs), a tied one (the model calls
``attend``) by the method, on its ``attend`` statistics with the lookups as a ridge. :mod:`._oneshot_solve` derives
both.

In sequential mode a tied table is pruned in the group of its last call, the head: its ``attend`` statistics are
gathered on the model whose earlier groups are already pruned, and until then the layers calibrate on its dense
lookups. A lookup-only table is pruned in the group of its first lookup. A model that reads a named table's array
itself (``h @ embed.embedding[...].T``) instead of calling ``attend`` is refused with an error naming the table.

**Stacks of layers** (``nnx.vmap`` / ``nn.scan`` over layers: one kernel ``(L, K, N)``) applied under a transform
over the layers (``nnx.scan`` / ``nn.scan``): each layer is calibrated on its own inputs and pruned as the same layer
unstacked, in the sequential group of the block it would be unstacked (:mod:`._calibration_stacks`).
"""

from __future__ import annotations

import dataclasses
import numbers
import re
import time
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxsparse import _utils
from jaxsparse._rules import check_distinct_tree_paths
from jaxsparse._rules import get_module
from jaxsparse.formats._specs import NM
from jaxsparse.pruning._calibration import LINEN_LAYERS_AND_TABLES
from jaxsparse.pruning._calibration import NNX_LAYERS_AND_TABLES
from jaxsparse.pruning._calibration import Layer
from jaxsparse.pruning._calibration import LayerStats
from jaxsparse.pruning._calibration import TableStats
from jaxsparse.pruning._calibration import check_batches
from jaxsparse.pruning._calibration import check_damp
from jaxsparse.pruning._calibration import resolve_layers
from jaxsparse.pruning._calibration_linen import linen_candidates
from jaxsparse.pruning._calibration_linen import linen_layer_stats
from jaxsparse.pruning._calibration_nnx import default_call
from jaxsparse.pruning._calibration_nnx import nnx_call_order
from jaxsparse.pruning._calibration_nnx import nnx_candidates
from jaxsparse.pruning._calibration_nnx import nnx_layer_stats
from jaxsparse.pruning._calibration_stacks import layer_slices
from jaxsparse.pruning._oneshot_solve import solve_layer
from jaxsparse.pruning._oneshot_solve import solve_table
from jaxsparse.pruning._oneshot_solve import zero_inputs
from jaxsparse.pruning._sparsegpt import reconstruction_error

__all__ = ["CalibratedPruneReport", "LayerPruned", "calibrated_prune", "calibrated_prune_linen", "sparsegpt",
           "wanda"]

METHODS = ("magnitude", "wanda", "sparsegpt")
SPARSEGPT_REFIT_ITERATIONS = 50  # refit_iterations=None for SparseGPT; examples/minilm/README.md has the measurements
# A layer whose calibration inputs are all zero: the report's note, and what is done instead of Wanda / SparseGPT.
ZERO_NOTE = "inputs all zero on the calibration batches, so error 0"
ZERO_FALLBACK = "pruned by magnitude (the masks of method='magnitude'), with no weight update or refit"
ZERO_TABLE_NOTE = "attend queries all zero on the calibration batches: pruned as a lookup-only table"


@dataclasses.dataclass(frozen=True)
class LayerPruned:
  """What :func:`calibrated_prune` did to one layer.

  Attributes:
    path: dotted path of the layer; for layer ``l`` of a stack of layers (``nnx.vmap`` / ``nn.scan`` over layers),
      the stack's path and the layer's index: ``"blocks.fc[3]"``.
    shape: ``(K, N)``, the kernel (one layer's, for a stack) viewed as (inputs, outputs); an embedding table
      ``(V, F)`` as its ``attend`` kernel ``(F, V)``.
    pattern: the structure, e.g. ``"2:4"``.
    group: index of the sequential group the layer was pruned in.
    density: fraction of weights kept.
    error: ``||X w - X ŵ|| / ||X w||`` on the layer's calibration inputs (the pruned model's, in
      sequential mode), after the refit if any; a table's: of its ``attend`` (tied) or else of its lookups; NaN
      without ``XᵀX``; 0 for a layer whose inputs were all zero (its outputs then do not depend on its weights).
    tokens: calibration tokens ``X`` has.
    seconds: wall time of the layer's solve (and refit).
    note: what was done differently from the method's literal form, and why (an embedding table's lookups reduce
      the method to magnitude, a tied table is pruned on its ``attend`` statistics, a layer whose calibration inputs
      were all zero is pruned by magnitude); ``""`` for other layers.

  >>> import jax, jaxsparse
  >>> from flax import nnx
  >>> from jaxsparse import pruning
  >>> model = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
  >>> x = jax.random.normal(jax.random.key(0), (32, 16))
  >>> _, _, report = pruning.wanda(model, jaxsparse.NM(2, 4), [x], progress=False)
  >>> row = report.layers[0]
  >>> row.path, row.shape, row.pattern, row.group, row.density, row.tokens, 0 < row.error < 1
  ('', (16, 8), '2:4', 0, 0.5, 32, True)
  """

  path: str
  shape: tuple[int, int]
  pattern: str
  group: int
  density: float
  error: float
  tokens: int
  seconds: float
  note: str = ""


@dataclasses.dataclass(frozen=True)
class CalibratedPruneReport:
  """The pruned layers in pruning order; ``str(report)`` is a Markdown table, then the layers' notes.

  The third result of :func:`calibrated_prune`, :func:`calibrated_prune_linen`, :func:`wanda` and
  :func:`sparsegpt`.

  >>> import jax, jaxsparse
  >>> from flax import nnx
  >>> from jaxsparse import pruning
  >>> model = nnx.Sequential(nnx.Linear(16, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 4, rngs=nnx.Rngs(1)))
  >>> _, _, report = pruning.calibrated_prune(model, jaxsparse.NM(2, 4), None, method="magnitude", progress=False)
  >>> report.method, [layer.path for layer in report.layers]
  ('magnitude', ['layers.0', 'layers.1'])
  >>> print(str(report).splitlines()[0])
  magnitude: 2 layers

  Attributes:
    method: ``"magnitude"``, ``"wanda"`` or ``"sparsegpt"``.
    layers: a :class:`LayerPruned` per pruned layer.
  """

  method: str
  layers: tuple[LayerPruned, ...]

  def __str__(self) -> str:
    rows = [f"{self.method}: {len(self.layers)} layers",
            "| path | (K, N) | pattern | group | density | rel. error | tokens | s |",
            "|---|---|---|---|---|---|---|---|"]
    rows += [f"| {r.path} | {r.shape} | {r.pattern} | {r.group} | {r.density:.3f} | {r.error:.4f} | {r.tokens} | "
             f"{r.seconds:.2f} |" for r in self.layers]
    notes = [f"- {r.path or '(model)'}: {r.note}" for r in self.layers if r.note]
    return "\n".join(rows + (["", "notes:", *notes] if notes else []))


def block_group(path: str) -> str:
  """Default sequential group: the path up to its first numeric part (``"encoder.layer.3"``), else the path."""
  parts = path.split(".")
  for i, part in enumerate(parts):
    if part.isdigit():
      return ".".join(parts[: i + 1])
  return path


def _groups(ordered: Sequence[Layer], sequential: Any) -> list[list[Layer]]:
  """``ordered`` (one layer of a stack each its own) in sequential groups: by default the block of the path each would
  have unstacked (``"blocks.3"`` for ``"blocks.fc[3]"``), else by ``sequential(name)``."""
  if sequential is False:
    return [list(ordered)]
  if sequential is not True and not callable(sequential):
    raise TypeError(f"sequential must be True, False or a callable path -> group key, got {sequential!r}.")
  groups: dict[Hashable, list[Layer]] = {}
  for layer in ordered:
    key = block_group(layer.unstacked_path) if sequential is True else sequential(layer.name)
    groups.setdefault(key, []).append(layer)
  return list(groups.values())


def _check_options(method: object, damp: object, block_size: object, refit_iterations: object) -> tuple[str, int]:
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got method={method!r}.")
  if refit_iterations is None:
    refit_iterations = SPARSEGPT_REFIT_ITERATIONS if method == "sparsegpt" else 0
  if isinstance(refit_iterations, bool) or not isinstance(refit_iterations, numbers.Integral) or refit_iterations < 0:
    raise ValueError(f"refit_iterations must be None or an int >= 0 (0: no refit), got {refit_iterations=}.")
  check_damp(damp)
  if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size <= 0:
    raise ValueError(f"block_size must be a positive int, got block_size={block_size!r}.")
  return method, int(refit_iterations)


def _progress(total: int, enabled: bool, desc: str) -> tqdm:
  return tqdm(total=total, desc=desc, unit="layer", disable=not enabled)


def _run(
    layers: Sequence[Layer],
    batches: Sequence[Any] | None,
    *,
    method: str,
    sequential: Any,
    damp: float,
    block_size: int,
    refit_iterations: int,
    progress: bool,
    stats_of: Callable[[Sequence[Layer]], dict[str, LayerStats | TableStats]],
    get_kernel: Callable[[Layer], jax.Array],
    set_kernel: Callable[[Layer, jax.Array], None],
) -> tuple[dict[str, np.ndarray], CalibratedPruneReport]:
  masks, rows, zeroed = {}, [], []
  ordered = layer_slices(layers)  # each layer of a stack on its own, as if unstacked
  groups = _groups(ordered, sequential)
  bar = _progress(len(ordered), progress, method)
  try:
    for g, group in enumerate(groups):
      bar.set_postfix_str(f"group {g + 1}/{len(groups)}: calibrating")
      whole = {layer.path: dataclasses.replace(layer, index=None) for layer in group}  # a stack's, all its layers
      stats = stats_of(list(whole.values())) if batches is not None else {}
      for layer in group:
        bar.set_postfix_str(layer.name)
        stored = get_kernel(layer)
        kernel = stored if layer.index is None else stored[layer.index]
        s = stats.get(layer.path)
        if s is not None and layer.index is not None:
          s = jax.tree.map(lambda a, i=layer.index: a[i], s)
        zero = zero_inputs(s)
        if zero:
          zeroed.append(layer.name or "(model)")
        t0 = time.perf_counter()
        if layer.table:  # a tied table whose attend queries are all zero: pruned as a lookup-only one (magnitude)
          new2, mask2, error, tokens, note = solve_table(method, layer, kernel, s._replace(attend=None) if zero else s,
                                                         damp=damp, block_size=block_size,
                                                         refit_iterations=refit_iterations)
          jax.block_until_ready(new2)
          seconds = time.perf_counter() - t0
          note = f"{ZERO_TABLE_NOTE}; {note}" if zero else note
        else:
          kernel2 = kernel.reshape(layer.k, layer.n)
          new2, mask2 = solve_layer("magnitude" if zero else method, layer, kernel2, s, damp=damp,
                                    block_size=block_size, refit_iterations=0 if zero else refit_iterations)
          jax.block_until_ready(new2)
          seconds = time.perf_counter() - t0
          error = float("nan") if s is None or s.gram is None else float(reconstruction_error(kernel2, new2, s.gram))
          tokens = -1 if s is None else int(s.tokens)
          note = "" if not zero else ZERO_NOTE if method == "magnitude" else f"{ZERO_NOTE}: {ZERO_FALLBACK}"
        new = new2.reshape(kernel.shape).astype(kernel.dtype)
        set_kernel(layer, new if layer.index is None else stored.at[layer.index].set(new))
        mask = np.asarray(mask2).reshape(layer.kernel_shape)
        name = "embedding" if layer.table else "kernel"
        name = f"{layer.path}.{name}" if layer.path else name
        if layer.index is None:
          masks[name] = mask
        else:
          masks.setdefault(name, np.zeros((*layer.stack, *layer.kernel_shape), bool))[layer.index] = mask
        rows.append(LayerPruned(layer.name, (layer.k, layer.n), layer.spec.describe(), g, float(mask.mean()), error,
                                tokens, seconds, note))
        bar.update(1)
  finally:
    bar.close()
  if zeroed and method != "magnitude":
    _utils.warn_at_caller(
        f"{method}: {len(zeroed)} layer(s) saw only zero inputs on the calibration batches: {', '.join(zeroed)} (the "
        "batches are zero, or the model zeroes them before these layers, e.g. a ReLU of all-negative inputs). Their "
        f"inputs give nothing to rank their weights by, so they are {ZERO_FALLBACK} (a tied table's: as a "
        "lookup-only table); their reported errors are 0, since on these inputs their outputs do not depend on "
        "their weights. Check the calibration batches.", UserWarning)
  return masks, CalibratedPruneReport(method, tuple(rows))


def calibrated_prune(
    model: nnx.Module,
    rules: Any,
    batches: Sequence[Any] | None,
    *,
    method: str = "sparsegpt",
    sequential: bool | Callable[[str], Hashable] = True,
    damp: float = 0.01,
    block_size: int = 128,
    refit_iterations: int | None = None,
    call: Callable[[nnx.Module, Any], Any] | None = None,
    token_mask: Callable[[Any], jax.typing.ArrayLike] | None = None,
    to_sparse: bool = False,
    inplace: bool = False,
    measure_error: bool = True,
    progress: bool = True,
) -> tuple[nnx.Module, dict[str, np.ndarray], CalibratedPruneReport]:
  """Prunes the dense layers of an NNX model with calibration data: magnitude, Wanda or SparseGPT.

  >>> import jax, jaxsparse
  >>> from flax import nnx
  >>> from jaxsparse import pruning
  >>> model = nnx.Sequential(nnx.Linear(32, 64, rngs=nnx.Rngs(0)), jax.nn.relu, nnx.Linear(64, 8, rngs=nnx.Rngs(1)))
  >>> batches = [jax.random.normal(jax.random.key(i), (64, 32)) for i in range(4)]
  >>> rules = {r"layers\\.0": jaxsparse.NM(2, 4), r"layers\\.2": jaxsparse.Unstructured(sparsity=0.5)}
  >>> pruned, masks, report = pruning.calibrated_prune(model, rules, batches, method="sparsegpt", progress=False)
  >>> {path: float(m.mean()) for path, m in masks.items()}
  {'layers.0.kernel': 0.5, 'layers.2.kernel': 0.5}
  >>> [round(r.error, 2) < 0.6 for r in report.layers]
  [True, True]
  >>> sparse, _ = jaxsparse.sparsify(pruned, rules, masks=masks)
  >>> type(sparse.layers[0]).__name__, type(sparse.layers[2]).__name__
  ('NMLinear', 'MaskedLinear')

  A layer whose inputs are all zero on the batches (zero batches, or a model that zeroes them before it, e.g. a
  ReLU of all-negative inputs) gives Wanda and SparseGPT nothing to rank its weights by: it is pruned by magnitude
  (``method="magnitude"``'s mask, no weight update or refit; a tied table as a lookup-only one), its reported error
  is 0 and its report row says so, with one ``UserWarning`` naming all such layers.

  Args:
    model: an ``nnx.Module``; copied unless ``inplace``.
    rules: ``{regex: structure or None}`` or one structure, as :func:`jaxsparse.sparsify`: every
      ``nnx.Linear`` / ``nnx.LinearGeneral`` (trailing contracting axes) whose dotted path a rule fully
      matches is pruned to its structure (``Unstructured``, ``NM`` along the inputs, ``BlockSparse``),
      as is every ``nnx.Conv`` without feature groups (``Unstructured``, or ``NM`` along its input
      channels as ``NMConv``; solved on its im2col patches, kernel viewed as
      ``(prod(kernel_size) * cin, cout)``). An ``nnx.Embed`` table is pruned only by a rule that names it
      (matches no other layer: ``{"embed": jaxsparse.NM(2, 4), ...}``; catch-all rules leave tables dense, as
      :func:`jaxsparse.sparsify` does): ``NM`` along the features of each row, ``Unstructured``, or
      ``BlockSparse`` with blocks of ``(rows, features)``; its mask is ``masks["<path>.embedding"]``. A table the
      model only looks up is pruned by magnitude whatever the method (what Wanda and SparseGPT reduce to on
      one-hot inputs); a tied one (the model calls its ``attend``) by the method, on the ``attend`` statistics
      with the lookups as a ridge. The pruning guide's "Embedding tables" section derives both; the report's
      note on the table says which applied. A stack of ``L`` layers (an ``nnx.vmap``-made layer whose kernel is
      ``(L, K, N)``, applied by ``nnx.scan`` / ``nnx.vmap`` over its layers) is pruned layer by layer, each layer
      as if it were a separate layer on its own inputs (the pruning guide's "Stacks of layers").
    batches: a list of calibration inputs (array, tuple of positional args or dict of keyword args
      each; see ``call``); may be ``None`` for ``method="magnitude"`` (the report then has no errors).
    method: ``"sparsegpt"`` (masks and OBS weight updates), ``"wanda"`` (masks by ``|w| * ||x||``) or
      ``"magnitude"`` (masks by ``|w|``, the baseline).
    sequential: ``True``: prune group by group in call order, each group calibrated on the model with
      the earlier groups pruned; groups are the path up to its first number (one transformer block,
      ``"encoder.layer.3"``), for layer ``l`` of a stack the path it would have unstacked (``"blocks.fc[3]"``
      in group ``"blocks.3"``). A callable ``path -> key`` gives other groups (``lambda p: p``: one layer
      at a time; it gets ``"blocks.fc[3]"`` for a layer of a stack); ``False``: one calibration pass on the dense
      model for all layers.
    damp: SparseGPT's Hessian damping, a fraction of the mean diagonal.
    block_size: SparseGPT's lazy update batch (input features); for an N:M layer rounded down to a
      multiple of ``m`` (at least ``m``), which changes the speed, not the result.
    refit_iterations: conjugate-gradient iterations of the least-squares refit of each layer's kept
      weights for its final mask (:func:`refit_layer`, same ``damp``), after the method's solve; 0: no
      refit. ``None``: 50 for SparseGPT (its greedy updates leave the kept weights short of the
      optimum for its mask), 0 for Wanda and magnitude (a refit needs ``XᵀX``, which they otherwise
      do without). On all-MiniLM-L6-v2 (``examples/minilm/README.md``) the refit raises the held-out
      embedding cosine of SparseGPT 2:4 on the FFN from 0.935 to 0.950 and of Wanda from 0.853 to 0.943.
    call: ``(model, batch) -> output``; default ``model(*batch)``, ``model(**batch)`` or ``model(batch)``.
    token_mask: ``batch -> 0/1 array`` marking the real tokens of a padded batch (see
      :func:`calibrate`); padding is left out of the statistics.
    to_sparse: return ``jaxsparse.sparsify(pruned, rules, masks=masks)``'s sparse model instead of the
      dense model with pruned weights (an ``NM`` table becomes a ``CompressedNMEmbed``; sparsify takes no other
      structure for tables; a stack of ``nnx.Linear`` layers becomes a stack of sparse layers).
    inplace: prune ``model`` itself.
    measure_error: also collect ``XᵀX`` for Wanda and magnitude, to report each layer's reconstruction
      error (SparseGPT always has it); without it their errors are NaN.
    progress: show a progress bar over layers (tqdm).

  Returns:
    ``(model, masks, report)``: the model with pruned (and, for SparseGPT, updated) weights, or its
    sparse version with ``to_sparse``; ``{"path.kernel": bool mask}`` of each kernel's shape (a stack's
    ``(L, K, N)``, each layer pruned on its own) for ``jaxsparse.sparsify(..., masks=masks)``; a
    :class:`CalibratedPruneReport` with a row per layer (per layer of a stack).

  Raises:
    ValueError: no batches (Wanda, SparseGPT), a rule that matches no layer, a structure that does
      not fit a layer, a layer the model never calls or no batch token reaches, NaN or inf in a layer's inputs
      (naming the layer and the first such batch), a Hessian that is not positive definite; with
      ``to_sparse``, a table under a structure other than ``NM`` or a stack of layers other than ``nnx.Linear``
      (sparsify takes stacks of those only); a rule naming an already compressed ``CompressedNMEmbed``; a stack of
      embedding tables; a stack of layers the model calls with its layer axes unsliced (not under ``nnx.scan`` /
      ``nnx.vmap`` over them).
  """
  method, refit_iterations = _check_options(method, damp, block_size, refit_iterations)
  check_distinct_tree_paths(nnx.state(model), what="model")
  if batches is None and method != "magnitude":
    raise ValueError(f"method={method!r} needs calibration batches; got batches=None.")
  if batches is None and refit_iterations:
    raise ValueError(f"the refit needs calibration batches (XᵀX); got batches=None with {refit_iterations=}. "
                     "Pass batches or refit_iterations=0.")
  batches = None if batches is None else check_batches(batches)
  layers = resolve_layers(nnx_candidates(model, tables=True), rules, what=NNX_LAYERS_AND_TABLES)
  if to_sparse:
    for layer in layers:
      kind = type(get_module(model, layer.key))
      if layer.stack and kind is not nnx.Linear:  # refused before pruning, not by sparsify after it
        raise ValueError(f"{layer.path or '(model)'}: to_sparse=True, but sparsify takes stacks of nnx.Linear layers "
                         f"only, not of {kind.__name__} (kernel {(*layer.stack, *layer.kernel_shape)}, leading layer "
                         f"axes {layer.stack}); use to_sparse=False (the dense model with each layer of the stack "
                         "pruned, and its mask with the stack's axes).")
      if layer.table and not isinstance(layer.spec, NM):
        raise ValueError(f"{layer.path or '(model)'}: to_sparse=True, but sparsify stores an embedding table only "
                         f"N:M-compressed (CompressedNMEmbed), not {layer.spec.describe()}; use jaxsparse.NM(n, m) "
                         "for it, or to_sparse=False (the dense model with the pruned table and its mask).")
  if not inplace:
    model = nnx.clone(model)
  call = default_call if call is None else call
  if batches is not None:
    layers = nnx_call_order(model, layers, batches[0], call)  # a stack's with the order its scan runs its layers

  def param(layer: Layer) -> nnx.Param:
    return getattr(get_module(model, layer.key), "embedding" if layer.table else "kernel")

  def set_kernel(layer: Layer, kernel: jax.Array) -> None:
    param(layer)[...] = kernel

  masks, report = _run(
      layers, batches, method=method, sequential=sequential, damp=damp, block_size=block_size,
      refit_iterations=refit_iterations, progress=progress,
      stats_of=lambda group: nnx_layer_stats(model, group, batches, call=call, token_mask=token_mask,
                                             gram=method == "sparsegpt" or measure_error or bool(refit_iterations)),
      get_kernel=lambda layer: param(layer)[...], set_kernel=set_kernel,
  )
  if to_sparse:
    from jaxsparse import sparsify  # noqa: PLC0415 -- jaxsparse imports this package before sparsify

    model, _ = sparsify(model, {re.escape(layer.path): layer.spec for layer in layers}, masks=masks, inplace=True)
  return model, masks, report


def wanda(model: nnx.Module, rules: Any, batches: Sequence[Any], **kwargs: Any):
  """Wanda pruning of an NNX model: :func:`calibrated_prune` with ``method="wanda"``.

  >>> import jax, jaxsparse
  >>> from flax import nnx
  >>> from jaxsparse import pruning
  >>> model = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
  >>> _, masks, _ = pruning.wanda(model, jaxsparse.NM(2, 4), [jax.numpy.ones((4, 16))], progress=False)
  >>> masks["kernel"].shape, float(masks["kernel"].mean())
  ((16, 8), 0.5)

  Args:
    model: an ``nnx.Module``; copied unless ``inplace=True`` is passed.
    rules: ``{regex: structure or None}`` or one structure, as :func:`calibrated_prune`.
    batches: a list of calibration inputs, as :func:`calibrated_prune`.
    **kwargs: the other options of :func:`calibrated_prune` (``sequential``, ``refit_iterations``,
      ``call``, ``token_mask``, ``to_sparse``, ``inplace``, ``measure_error``, ``progress``).

  Returns:
    ``(model, masks, report)`` as :func:`calibrated_prune`: the pruned model, ``{"path.kernel": bool mask}``
    (NumPy, each of its kernel's shape) and a :class:`CalibratedPruneReport`.
  """
  return calibrated_prune(model, rules, batches, method="wanda", **kwargs)


def sparsegpt(model: nnx.Module, rules: Any, batches: Sequence[Any], **kwargs: Any):
  """SparseGPT pruning of an NNX model: :func:`calibrated_prune` with ``method="sparsegpt"``.

  >>> import jax, jaxsparse
  >>> from flax import nnx
  >>> from jaxsparse import pruning
  >>> model = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
  >>> x = jax.random.normal(jax.random.key(0), (64, 16))
  >>> pruned, masks, _ = pruning.sparsegpt(model, jaxsparse.Unstructured(sparsity=0.5), [x], progress=False)
  >>> int(masks["kernel"].sum()), bool(((pruned.kernel[...] != 0) == masks["kernel"]).all())
  (64, True)

  Args:
    model: an ``nnx.Module``; copied unless ``inplace=True`` is passed.
    rules: ``{regex: structure or None}`` or one structure, as :func:`calibrated_prune`.
    batches: a list of calibration inputs, as :func:`calibrated_prune`.
    **kwargs: the other options of :func:`calibrated_prune` (``sequential``, ``damp``, ``block_size``,
      ``refit_iterations``, ``call``, ``token_mask``, ``to_sparse``, ``inplace``, ``progress``).

  Returns:
    ``(model, masks, report)`` as :func:`calibrated_prune`: the model with pruned and updated weights,
    ``{"path.kernel": bool mask}`` (NumPy, each of its kernel's shape) and a :class:`CalibratedPruneReport`.
  """
  return calibrated_prune(model, rules, batches, method="sparsegpt", **kwargs)


def _nested_get(tree: Mapping, path: tuple) -> Any:
  for k in path:
    tree = tree[k]
  return tree


def _to_dict(tree: Any) -> Any:
  if isinstance(tree, Mapping):
    return {k: _to_dict(v) for k, v in tree.items()}
  return tree


def calibrated_prune_linen(
    module: nn.Module,
    variables: Mapping,
    rules: Any,
    batches: Sequence[Any] | None,
    *,
    method: str = "sparsegpt",
    sequential: bool | Callable[[str], Hashable] = True,
    damp: float = 0.01,
    block_size: int = 128,
    refit_iterations: int | None = None,
    apply_kwargs: Mapping[str, Any] | None = None,
    token_mask: Callable[[Any], jax.typing.ArrayLike] | None = None,
    measure_error: bool = True,
    progress: bool = True,
) -> tuple[dict, dict[str, np.ndarray], CalibratedPruneReport]:
  """Linen version of :func:`calibrated_prune` for the ``nn.Dense`` / ``DenseGeneral`` / ``Conv`` layers called.

  ``nn.DenseGeneral`` (trailing contracting axes, no batch dims: ``nn.MultiHeadDotProductAttention``'s
  projections) and ``nn.Conv`` (no feature groups) are pruned as their NNX twins; their masks have
  the kernel's own shape, as :func:`jaxsparse.sparsify_linen` takes them. An ``nn.Embed`` that a rule names
  (looked up or ``attend``-ed on the batches) is pruned as an ``nnx.Embed`` in :func:`calibrated_prune`:
  magnitude for a lookup-only table, the method on the ``attend`` statistics for a tied one; its mask is
  ``masks["<path>.embedding"]``. A layer of an ``nn.scan`` / ``nn.vmap`` over layers (``variable_axes={"params":
  0}``; its kernel stored ``(L, K, N)``) is pruned layer by layer as in :func:`calibrated_prune`, each layer on its
  own inputs, its report rows ``"blocks.fc[3]"``, its mask ``(L, K, N)``. A layer whose inputs are all zero on the
  batches is pruned by magnitude, with a warning, as in :func:`calibrated_prune`.

  >>> import jax, jaxsparse, flax.linen as nn
  >>> from jaxsparse import pruning
  >>> class MLP(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     h = nn.relu(nn.Dense(64)(x))
  ...     return nn.Dense(8)(h)
  >>> batches = [jax.random.normal(jax.random.key(i), (64, 32)) for i in range(2)]
  >>> variables = MLP().init(jax.random.key(0), batches[0])
  >>> new_vars, masks, _ = pruning.calibrated_prune_linen(MLP(), variables, jaxsparse.NM(2, 4), batches, progress=False)
  >>> sparse, sparse_vars, _ = jaxsparse.sparsify_linen(MLP(), new_vars, jaxsparse.NM(2, 4), batches[0], masks=masks)
  >>> bool(jax.numpy.allclose(sparse.apply(sparse_vars, batches[0]), MLP().apply(new_vars, batches[0]), atol=1e-5))
  True

  Args:
    module: the Linen module (unchanged).
    variables: its variables; the returned copy has the pruned ``params``.
    rules, batches, method, sequential, damp, block_size, refit_iterations, token_mask, measure_error, progress: as
      :func:`calibrated_prune`, with Linen module paths (``"Dense_0"``).
    apply_kwargs: extra keyword arguments of ``module.apply``.

  Returns:
    ``(variables, masks, report)``: the variables with the pruned ``params``; ``{"path.kernel": bool mask}`` of
    each kernel's stored shape (a stack's ``(L, K, N)``); a :class:`CalibratedPruneReport` with a row per layer.
    ``jaxsparse.sparsify_linen(module, variables, rules, x, masks=masks)`` makes the sparse layers.

  Raises:
    ValueError: as :func:`calibrated_prune`: an unknown ``method``; a ``damp``, ``block_size`` or
      ``refit_iterations`` out of range; ``batches`` that are ``None`` or empty (needed for every method here:
      they find the layer calls); a rule that matches no layer, a structure that does not fit a layer, a layer
      the model never calls, NaN or inf in a layer's inputs, a Hessian that is not positive definite; a stack of
      ``nn.Embed`` tables.
    TypeError: ``module`` is not a Linen module; ``batches`` is a single array or a mapping (wrap one batch in
      a list); a rule that is not a sparsity structure.
  """
  method, refit_iterations = _check_options(method, damp, block_size, refit_iterations)
  check_distinct_tree_paths(variables, what="variables")
  if batches is None:
    raise ValueError("calibrated_prune_linen needs calibration batches (they also find the layer calls); "
                     "got batches=None.")
  batches = check_batches(batches)
  apply_kwargs = dict(apply_kwargs or {})
  layers = resolve_layers(linen_candidates(module, variables, batches[0], apply_kwargs, tables=True), rules,
                          what=LINEN_LAYERS_AND_TABLES)
  new_vars = _to_dict(variables)

  def set_kernel(layer: Layer, kernel: jax.Array) -> None:
    _nested_get(new_vars["params"], layer.key)["embedding" if layer.table else "kernel"] = kernel

  def get_kernel(layer: Layer) -> jax.Array:
    return jnp.asarray(_nested_get(new_vars["params"], layer.key)["embedding" if layer.table else "kernel"])

  masks, report = _run(
      layers, batches, method=method, sequential=sequential, damp=damp, block_size=block_size,
      refit_iterations=refit_iterations, progress=progress,
      stats_of=lambda group: linen_layer_stats(module, new_vars, group, batches, apply_kwargs=apply_kwargs,
                                               token_mask=token_mask,
                                               gram=method == "sparsegpt" or measure_error or bool(refit_iterations)),
      get_kernel=get_kernel, set_kernel=set_kernel,
  )
  return new_vars, masks, report
