"""Calibration of an NNX model: its layers (:func:`nnx_candidates`), the probes that stand in for them while the model
runs on the calibration batches, and :func:`calibrate`; the NNX half of :mod:`._calibration`, whose docstring says
what the statistics are."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsparse._rules import Probe
from jaxsparse._rules import get_module
from jaxsparse._rules import linear_general_unsupported
from jaxsparse._rules import replace_module
from jaxsparse.pruning._calibration import NNX_LAYERS_AND_TABLES
from jaxsparse.pruning._calibration import Candidate
from jaxsparse.pruning._calibration import Layer
from jaxsparse.pruning._calibration import LayerStats
from jaxsparse.pruning._calibration import TableStats
from jaxsparse.pruning._calibration import check_batches
from jaxsparse.pruning._calibration import conv_candidate
from jaxsparse.pruning._calibration import dotted_path
from jaxsparse.pruning._calibration import naming_batch
from jaxsparse.pruning._calibration import resolve_layers
from jaxsparse.pruning._calibration import run_steps
from jaxsparse.pruning._calibration import stack_check
from jaxsparse.pruning._calibration import stack_update
from jaxsparse.pruning._calibration import step_stats
from jaxsparse.pruning._calibration import zero_layer_stats
from jaxsparse.pruning._calibration_stacks import StackProbe
from jaxsparse.pruning._calibration_stacks import nnx_layer_ndim
from jaxsparse.pruning._calibration_stacks import scan_axes
from jaxsparse.pruning._calibration_stacks import stack_root
from jaxsparse.pruning._calibration_tables import TableProbe
from jaxsparse.pruning._calibration_tables import call_order
from jaxsparse.pruning._calibration_tables import direct_read_message
from jaxsparse.pruning._calibration_tables import direct_reads
from jaxsparse.pruning._calibration_tables import table_leaves

__all__ = ["calibrate", "nnx_call_order", "nnx_candidates", "nnx_layer_stats"]


def _is_jaxsparse(node: Any) -> bool:
  return type(node).__module__.startswith("jaxsparse.")


def nnx_candidates(model: nnx.Module, *, tables: bool = False) -> list[Candidate]:
  """Every dense ``nnx.Linear`` / ``nnx.LinearGeneral`` / ``nnx.Conv`` in ``model``; with ``tables``, also every
  ``nnx.Embed`` (and, unsupported, every already compressed ``CompressedNMEmbed``)."""
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}; for Linen use the *_linen "
                    "functions.")
  sparse_keys, out = [], []
  shapes = None
  for key, node in nnx.iter_modules(model):
    key = tuple(key)
    if any(key[: len(s)] == s for s in sparse_keys):
      continue
    if _is_jaxsparse(node):
      sparse_keys.append(key)
      if tables and type(node).__name__ == "CompressedNMEmbed":
        out.append(Candidate(key, (int(node.num_embeddings), int(node.features)), 1, table=True, unsupported=(
            "a CompressedNMEmbed is already N:M-compressed (jaxsparse.sparsify made it); calibrated pruning prunes "
            "the dense nnx.Embed, before sparsify")))
      continue
    if not isinstance(node, (nnx.Conv, nnx.LinearGeneral, nnx.Linear, *((nnx.Embed,) if tables else ()))):
      continue
    name = "embedding" if isinstance(node, nnx.Embed) else "kernel"
    stored = tuple(getattr(node, name).shape)
    axes = len(stored) - (nnx_layer_ndim(node, name) or len(stored))  # > 0: a stack of layers (nnx.vmap)
    stack, own = stored[:axes], stored[axes:]
    if stack and shapes is None:
      shapes = [(p, tuple(v.shape)) for p, v in nnx.to_flat_state(nnx.state(model)) if hasattr(v, "shape")]
    where = {"stack": stack, "root": stack_root(shapes, key, stack) if stack else 0}
    if name == "embedding":
      out.append(Candidate(key, own, 1, table=True, **where))
    elif isinstance(node, nnx.Conv):
      out.append(conv_candidate(key, node, own, "nnx.Conv")._replace(**where))
    elif isinstance(node, nnx.LinearGeneral):
      out.append(Candidate(key, own, len(node.in_features), unsupported=linear_general_unsupported(node), **where))
    else:
      out.append(Candidate(key, own, 1, **where))
  return out


def default_call(model: Any, batch: Any) -> Any:
  """``model(*batch)`` for a tuple, ``model(**batch)`` for a mapping, else ``model(batch)``."""
  if isinstance(batch, tuple):
    return model(*batch)
  if isinstance(batch, Mapping):
    return model(**batch)
  return model(batch)


def _with_probes(model: nnx.Module, keys: Sequence[tuple], record: Callable[[tuple, jax.Array, bool], None],
                 tables: Sequence[tuple] = ()) -> nnx.Module:
  """Replaces the layers at ``keys`` by probes (in place); returns the model (a probe if a key is ``()``).

  ``record(key, x, attend)``: ``attend`` is True for the query of a table's ``attend``; the keys in ``tables``
  (embedding tables) get a :class:`TableProbe`, which records their lookups' ids and ``attend`` queries.
  """
  for key in keys:
    if key in tables:
      probe = TableProbe(get_module(model, key), lambda x, attend, key=key: record(key, x, attend))
    else:
      probe = Probe(get_module(model, key), lambda x, key=key: record(key, x, False))
    if not key:
      return probe
    replace_module(model, key, probe)
  return model


_NNX_STACK_HOW = "under nnx.scan / nnx.vmap over its layer axes, with its state on the kernel's axis (nnx.StateAxes)"


def _with_stack_probes(model: nnx.Module, stacks: Sequence[Layer], stats: Mapping[tuple, tuple],
                       updates: Mapping[tuple, Callable]) -> tuple[nnx.Module, dict[tuple, StackProbe]]:
  """Replaces the stacks of layers ``stacks`` by :class:`StackProbe` s (in place) starting from ``stats`` and adding
  each call's input with ``updates``; returns the model (a probe if a key is ``()``) and the probes by key."""
  probes = {}
  for layer in stacks:
    inner = get_module(model, layer.key)
    probe = probes[layer.key] = StackProbe(inner, stats[layer.key], type(inner.kernel), updates[layer.key],
                                           stack_check(layer, _NNX_STACK_HOW))
    if not layer.key:
      return probe, probes
    replace_module(model, layer.key, probe)
  return model, probes


def nnx_call_order(model: nnx.Module, layers: Sequence[Layer], batch: Any, call: Callable) -> list[Layer]:
  """``layers`` in the order sequential pruning takes them (:func:`call_order`: each at its first call on ``batch``, a
  table that the model ``attend``-s at its last; a stack of layers where its transform over the layers traces it),
  a stack's with the scans that run its layers (``Layer.scans``, :func:`scan_axes`); traced only, nothing computed.

  Raises ``ValueError`` when the model reads a table of ``layers`` directly (outside its lookups and ``attend``),
  does not call a layer, or calls a stack with its layer axes unsliced.
  """
  graphdef, state = nnx.split(model)
  keys = [layer.key for layer in layers]
  tables = [layer.key for layer in layers if layer.table]
  stacks = [layer for layer in layers if layer.stack]
  calls: list[tuple] = []
  attended: set[tuple] = set()

  def record(key: tuple, x: jax.Array, attend: bool) -> None:
    calls.append(key)
    if attend:
      attended.add(key)

  def recorder(key: tuple) -> Callable:
    def update(stats: tuple, x: jax.Array) -> tuple:
      record(key, x, False)
      return stats

    return update

  def run(state):
    m, probes = _with_stack_probes(nnx.merge(graphdef, state), stacks,
                                   {s.key: zero_layer_stats(s.k, False, jnp.float32, s.stack) for s in stacks},
                                   {s.key: recorder(s.key) for s in stacks})
    call(_with_probes(m, [k for k in keys if k not in probes], record, tables), batch)

  with naming_batch(0):
    jaxpr = jax.make_jaxpr(run)(state)
  read = direct_reads(jaxpr, table_leaves(state, tables)) if tables else set()
  if read:
    path = next(dotted_path(k) or "(model)" for k in tables if k in read)
    raise ValueError(f"{path}: {direct_read_message(path)}; exclude it with a None rule.")
  order = call_order(calls, attended)
  missing = [dotted_path(k) or "(model)" for k in keys if k not in order]
  if missing:
    raise ValueError(f"layer(s) {missing} are selected by the rules but the model does not call them on the "
                     "calibration batches; exclude them with a None rule.")
  ndim = {s.key: len(s.stack) for s in stacks}
  scans = scan_axes(jaxpr, {i: (key, ndim[key]) for i, key in table_leaves(state, list(ndim), name="kernel").items()})
  by_key = {layer.key: layer for layer in layers}
  return [dataclasses.replace(by_key[key], scans=scans.get(key, ())) if key in ndim else by_key[key] for key in order]


def nnx_layer_stats(model: nnx.Module, layers: Sequence[Layer], batches: Sequence[Any], *, call: Callable,
                    gram: bool, token_mask: Callable[[Any], jax.Array] | None = None,
                    ) -> dict[str, LayerStats | TableStats]:
  """Accumulates the :class:`LayerStats` of ``layers`` (:class:`TableStats` of tables) over ``batches`` (one jitted
  step per batch); a stack's (``Layer.stack``) with its leading layer axes, summed by a :class:`StackProbe` inside
  the model's ``nnx.scan`` / ``nnx.vmap`` over the layers."""
  graphdef, state = nnx.split(model)
  tables = [layer.key for layer in layers if layer.table]
  stacks = [layer for layer in layers if layer.stack]

  def step(state, acc, batch):
    xs: dict[tuple, list] = {layer.key: [] for layer in layers}
    queries: dict[tuple, list] = {key: [] for key in tables}
    m = nnx.merge(graphdef, state)
    dtypes = {layer.key: getattr(get_module(m, layer.key), "embedding" if layer.table else "kernel").dtype
              for layer in layers}
    weights = None if token_mask is None else jnp.asarray(token_mask(batch))
    m, probes = _with_stack_probes(  # a stack's statistics summed inside the model's transform over its layers
        m, stacks, {s.key: acc[s.path] for s in stacks},
        {s.key: stack_update(s, gram, weights, dtypes[s.key], xs[s.key]) for s in stacks})
    m = _with_probes(m, [k for k in xs if k not in probes],
                     lambda key, x, attend: (queries if attend else xs)[key].append(x), tables)
    call(m, batch)
    stacked = {key: LayerStats(*probe.stats()) for key, probe in probes.items()}
    return step_stats(acc, layers, xs, queries, gram, weights, dtypes, "model", stacked)

  return run_steps(step, state, layers, batches, gram)


def calibrate(model: nnx.Module, batches: Sequence[Any], rules: Any, *, gram: bool = True,
              call: Callable[[nnx.Module, Any], Any] | None = None,
              token_mask: Callable[[Any], jax.typing.ArrayLike] | None = None,
              ) -> dict[str, LayerStats | TableStats]:
  """Runs an NNX model on calibration batches and returns the input statistics of the selected layers and tables.

  >>> import jax, jaxsparse
  >>> from flax import nnx
  >>> from jaxsparse import pruning
  >>> model = nnx.Sequential(nnx.Linear(16, 32, rngs=nnx.Rngs(0)), jax.nn.relu, nnx.Linear(32, 4, rngs=nnx.Rngs(1)))
  >>> batches = [jax.random.normal(jax.random.key(i), (8, 16)) for i in range(3)]
  >>> stats = pruning.calibrate(model, batches, {r"layers\\.\\d": jaxsparse.NM(2, 4)})
  >>> {path: (s.sq_norms.shape, s.gram.shape, int(s.tokens)) for path, s in stats.items()}
  {'layers.0': ((16,), (16, 16), 24), 'layers.2': ((32,), (32, 32), 24)}

  Args:
    model: an ``nnx.Module``.
    batches: a list of model inputs: an array, a tuple of positional arguments or a dict of keyword
      arguments each (see ``call``). Batches of one shape compile once.
    rules: ``{regex: structure or None}`` or one structure, as :func:`jaxsparse.sparsify`; the
      ``nnx.Linear``, ``nnx.LinearGeneral`` (trailing contracting axes) and ``nnx.Conv`` (no feature
      groups; statistics of its im2col patches, ``K = prod(kernel_size) * cin``) layers whose dotted
      path a rule with a structure fully matches are calibrated. An ``nnx.Embed`` is calibrated when a rule names it
      (matches no other layer: ``{"embed": jaxsparse.NM(2, 4)}``; catch-all rules leave tables out, as
      :func:`calibrated_prune` and :func:`jaxsparse.sparsify` do).
    gram: also accumulate ``XᵀX`` (SparseGPT needs it; Wanda only the norms); a table's ``attend`` statistics
      always have it.
    call: ``(model, batch) -> output``; default ``model(*batch)`` for a tuple, ``model(**batch)`` for
      a dict, else ``model(batch)``.
    token_mask: ``batch -> 0/1 array`` over the tokens of a batch (the shape of a layer input without
      its feature axes, e.g. ``lambda b: b["attention_mask"]`` for padded ``(B, S)`` text batches):
      tokens with 0 (padding) are left out of the statistics; any other value (``True``, 1, 2.5) counts the
      token once, unscaled.

  Returns:
    ``{layer path: LayerStats}``, on the device, and ``{table path: TableStats}`` for the tables (their lookups'
    token counts and, for a tied table, the :class:`LayerStats` of its ``attend`` queries): the statistics
    :func:`calibrated_prune` uses with ``sequential=False`` (in sequential mode each group's are taken on the model
    whose earlier groups are pruned). A stack of ``L`` layers (an ``nnx.vmap``-made layer, kernel ``(L, K, N)``,
    that the model applies by ``nnx.scan`` / ``nnx.vmap`` over its layers) has one ``LayerStats`` with the leading
    layer axes, ``sq_norms`` ``(L, K)``, ``gram`` ``(L, K, K)``, ``tokens`` ``(L,)``: layer ``l``'s of its own
    inputs.

  Raises:
    ValueError: no batches, a rule that matches no layer, a selected layer the model never calls, a named table
      the model reads directly (``h @ embed.embedding[...].T`` instead of ``embed.attend(h)``), NaN/inf inputs; a
      stack of embedding tables; a stack of layers the model calls with its layer axes unsliced (not under
      ``nnx.scan`` / ``nnx.vmap`` over them, with its state on the kernel's axis).
  """
  batches = check_batches(batches)
  layers = resolve_layers(nnx_candidates(model, tables=True), rules, what=NNX_LAYERS_AND_TABLES)
  call = default_call if call is None else call
  nnx_call_order(model, layers, batches[0], call)
  return nnx_layer_stats(model, layers, batches, call=call, gram=gram, token_mask=token_mask)
