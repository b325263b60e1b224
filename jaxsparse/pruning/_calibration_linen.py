"""Calibration statistics of the layers of a Linen module: the Linen half of :mod:`._calibration` (the layers' calls
are intercepted with ``nn.intercept_methods`` instead of replaced by probes)."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse._rules import as_int_tuple
from jaxsparse._rules import dense_general_dims
from jaxsparse.pruning._calibration import LINEN_LAYERS_AND_TABLES
from jaxsparse.pruning._calibration import Candidate
from jaxsparse.pruning._calibration import Layer
from jaxsparse.pruning._calibration import LayerStats
from jaxsparse.pruning._calibration import TableStats
from jaxsparse.pruning._calibration import check_batches
from jaxsparse.pruning._calibration import conv_candidate
from jaxsparse.pruning._calibration import naming_batch
from jaxsparse.pruning._calibration import resolve_layers
from jaxsparse.pruning._calibration import run_steps
from jaxsparse.pruning._calibration import stack_check
from jaxsparse.pruning._calibration import stack_update
from jaxsparse.pruning._calibration import step_stats
from jaxsparse.pruning._calibration_stacks import LINEN_ACCUMULATOR
from jaxsparse.pruning._calibration_stacks import STATS_FIELDS
from jaxsparse.pruning._calibration_stacks import linen_accumulators
from jaxsparse.pruning._calibration_stacks import scan_axes
from jaxsparse.pruning._calibration_stacks import stack_root
from jaxsparse.pruning._calibration_stacks import with_linen_accumulators
from jaxsparse.pruning._calibration_tables import call_order
from jaxsparse.pruning._calibration_tables import direct_read_message
from jaxsparse.pruning._calibration_tables import direct_reads
from jaxsparse.pruning._calibration_tables import table_call
from jaxsparse.pruning._calibration_tables import table_leaves

__all__ = ["calibrate_linen", "linen_candidates", "linen_layer_stats"]

def linen_args(batch: Any) -> tuple[tuple, dict]:
  if isinstance(batch, tuple):
    return batch, {}
  if isinstance(batch, Mapping):
    return (), dict(batch)
  return (batch,), {}


_LINEN_TYPES = (nn.Dense, nn.DenseGeneral, nn.Conv)


def _linen_candidate(m: nn.Module, x: jax.Array) -> Candidate:
  """The candidate of a Linen layer called on ``x``: shapes from the input, as the layer makes them."""
  key = tuple(m.path)
  if type(m) is nn.Dense:
    return Candidate(key, (int(x.shape[-1]), int(m.features)), 1)
  if type(m) is nn.Conv:
    size = as_int_tuple(m.kernel_size)
    cin = int(x.shape[-1])
    return conv_candidate(key, m, (*size, cin // max(int(m.feature_group_count), 1), int(m.features)), "nn.Conv")
  in_dims, features, unsupported = dense_general_dims(m, x.shape)
  return Candidate(key, in_dims + features, len(in_dims), unsupported=unsupported or None)


def _is_table_call(context: Any) -> bool:
  """Whether an intercepted call is a lookup or ``attend`` of an ``nn.Embed``."""
  return type(context.module) is nn.Embed and context.method_name in ("__call__", "attend")


def linen_candidates(module: nn.Module, variables: Mapping, batch: Any, apply_kwargs: Mapping, *,
                     tables: bool = False) -> list[Candidate]:
  """Every ``nn.Dense`` / ``nn.DenseGeneral`` / ``nn.Conv`` that ``module`` calls on ``batch``, in call order, a stack
  of layers (``nn.scan`` / ``nn.vmap`` over layers) with the scans that run its layers (``Candidate.scans``,
  :func:`scan_axes`); with ``tables``, also every ``nn.Embed`` it looks up or ``attend``-s, a tied one (``attend``
  called) at its last call (:func:`call_order`), and one the module also reads directly marked unsupported
  (:func:`direct_reads`)."""
  if not isinstance(module, nn.Module):
    raise TypeError(f"module must be a flax.linen.Module, got {type(module).__name__}.")
  found: dict[tuple, Candidate] = {}
  calls: list[tuple] = []
  attended: set[tuple] = set()

  def interceptor(next_fun, args, kwargs, context):
    m = context.module
    key = tuple(m.path)
    if not args:
      return next_fun(*args, **kwargs)
    if context.method_name == "__call__" and type(m) in _LINEN_TYPES:
      found.setdefault(key, _linen_candidate(m, args[0]))
      calls.append(key)
    elif tables and _is_table_call(context):
      found.setdefault(key, Candidate(key, (int(m.num_embeddings), int(m.features)), 1, table=True))
      calls.append(key)
      if context.method_name == "attend":
        attended.add(key)
      return table_call(next_fun, *args, **kwargs)
    return next_fun(*args, **kwargs)

  args, kwargs = linen_args(batch)
  with nn.intercept_methods(interceptor), naming_batch(0):
    jaxpr = jax.make_jaxpr(lambda v, *a: module.apply(v, *a, **kwargs, **apply_kwargs))(variables, *args)
  keys = [key for key, c in found.items() if c.table]
  read = direct_reads(jaxpr, table_leaves(variables, keys, collection=("params",))) if keys else set()
  for key in read:
    path = ".".join(str(k) for k in key)
    found[key] = found[key]._replace(unsupported=direct_read_message(path))
  out = [_with_stack(found[key], variables) for key in call_order(calls, attended)]
  ndim = {c.key: len(c.stack) for c in out if c.stack}
  if not ndim:
    return out
  kernels = table_leaves(variables, list(ndim), collection=("params",), name="kernel")
  scans = scan_axes(jaxpr, {i: (key, ndim[key]) for i, key in kernels.items()})
  return [c._replace(scans=scans.get(c.key, ())) if c.stack else c for c in out]


def _with_stack(c: Candidate, variables: Mapping) -> Candidate:
  """``c`` with its ``stack`` and ``root`` when its parameter is stored with more axes than its layer sees (a stack of
  layers: ``nn.scan`` / ``nn.vmap`` over layers)."""
  params = nn.meta.unbox(variables.get("params", {}))
  node = params
  for k in c.key:
    node = node.get(k, {}) if isinstance(node, Mapping) else {}
  stored = np.shape(node.get("embedding" if c.table else "kernel")) if isinstance(node, Mapping) else ()
  axes = len(stored) - len(c.kernel_shape)
  if axes <= 0:
    return c
  stack = tuple(int(d) for d in stored[:axes])
  shapes = [(tuple(getattr(p, "key", p) for p in kp), np.shape(leaf))
            for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0]]
  return c._replace(stack=stack, root=stack_root(shapes, c.key, stack))


def linen_layer_stats(module: nn.Module, variables: Mapping, layers: Sequence[Layer], batches: Sequence[Any], *,
                      apply_kwargs: Mapping, gram: bool,
                      token_mask: Callable[[Any], jax.Array] | None = None) -> dict[str, LayerStats | TableStats]:
  """Linen version of :func:`nnx_layer_stats`: inputs of the layer calls at the layers' paths (a table's lookups
  and ``attend`` calls)."""
  by_key = {layer.key: layer for layer in layers}
  stacks = [layer for layer in layers if layer.stack]

  def step(variables, acc, batch):
    xs: dict[tuple, list] = {key: [] for key in by_key}
    queries: dict[tuple, list] = {key: [] for key, layer in by_key.items() if layer.table}
    dtypes: dict[tuple, Any] = {}
    weights = None if token_mask is None else jnp.asarray(token_mask(batch))
    if stacks:  # a stack's statistics are summed in its params, which the module's nn.scan slices per layer
      params = variables["params"]
      for layer in stacks:
        params = with_linen_accumulators(params, layer.key, acc[layer.path])
      variables = {**variables, "params": params}

    def interceptor(next_fun, args, kwargs, context):
      key = tuple(context.module.path)
      layer = by_key.get(key)
      if layer is not None and args and (_is_table_call(context) if layer.table else (
          context.method_name == "__call__" and type(context.module) in _LINEN_TYPES)):
        name = "embedding" if layer.table else "kernel"
        param = nn.meta.unbox(context.module.variables.get("params", {})).get(name)
        dtypes[key] = jnp.float32 if param is None else param.dtype
        if layer.stack:
          _add_to_stack(context.module, layer, args[0], gram, weights, dtypes[key], xs[key])
        else:
          (queries if context.method_name == "attend" else xs)[key].append(args[0])
      return next_fun(*args, **kwargs)

    args, kwargs = linen_args(batch)
    with nn.intercept_methods(interceptor):
      out = module.apply(variables, *args, **kwargs, **apply_kwargs, mutable=["params"] if stacks else False)
    stacked = {s.key: LayerStats(*linen_accumulators(out[1]["params"], s.key, gram)) for s in stacks}
    return step_stats(acc, layers, xs, queries, gram, weights, dtypes, "module", stacked)

  return run_steps(step, variables, layers, batches, gram)


def _add_to_stack(m: nn.Module, layer: Layer, x: jax.Array, gram: bool, weights: jax.Array | None, dtype: Any,
                  calls: list) -> None:
  """Adds the input ``x`` of one call of one layer ``m`` of the stack ``layer`` (inside the module's ``nn.scan`` /
  ``nn.vmap``) to its statistics in its params (:data:`LINEN_ACCUMULATOR`)."""
  names = [LINEN_ACCUMULATOR.format(f) for f in STATS_FIELDS]
  now = tuple(m.get_variable("params", n) if f != "gram" or gram else None for f, n in zip(STATS_FIELDS, names,
                                                                                            strict=True))
  stack_check(layer, "under nn.scan / nn.vmap over its layer axes, with its params on the kernel's axis "
              "(variable_axes={'params': 0})")(np.shape(now[0]))
  new = stack_update(layer, gram, weights, dtype, calls)(now, x)
  for n, a in zip(names, new, strict=True):
    if a is not None:
      m.put_variable("params", n, a)


def calibrate_linen(module: nn.Module, variables: Mapping, batches: Sequence[Any], rules: Any, *, gram: bool = True,
                    apply_kwargs: Mapping[str, Any] | None = None,
                    token_mask: Callable[[Any], jax.typing.ArrayLike] | None = None,
                    ) -> dict[str, LayerStats | TableStats]:
  """Linen version of :func:`calibrate`: the selected ``nn.Dense`` / ``DenseGeneral`` / ``Conv`` calls.

  ``nn.DenseGeneral`` (trailing contracting axes, no batch dims: the projections of
  ``nn.MultiHeadDotProductAttention``), ``nn.Conv`` (no feature groups) and an ``nn.Embed`` a rule names (its lookups
  and ``attend`` calls) are handled as their NNX twins in :func:`calibrate`, as is a layer of an ``nn.scan`` /
  ``nn.vmap`` over layers (``variable_axes={"params": 0}``): statistics with the leading layer axes, each layer's of
  its own inputs (summed in extra ``params`` entries that the transform slices, while calibrating only).

  >>> import jax, jaxsparse, flax.linen as nn
  >>> from jaxsparse import pruning
  >>> class MLP(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     h = nn.relu(nn.Dense(32)(x))  # Dense_0
  ...     return nn.Dense(4)(h)  # Dense_1
  >>> x = jax.random.normal(jax.random.key(0), (8, 16))
  >>> variables = MLP().init(jax.random.key(1), x)
  >>> stats = pruning.calibrate_linen(MLP(), variables, [x, x], jaxsparse.Unstructured(sparsity=0.5))
  >>> {path: (s.gram.shape, int(s.tokens)) for path, s in stats.items()}
  {'Dense_0': ((16, 16), 16), 'Dense_1': ((32, 32), 16)}

  Args:
    module: a Linen module.
    variables: its variables (``{"params": ...}``, other collections).
    batches: a list of inputs for ``module.apply``: an array, a tuple of positional arguments or a
      dict of keyword arguments each.
    rules: as :func:`calibrate`, matched against Linen module paths (``"Dense_0"``, ``"mlp.fc1"``); a rule naming
      an ``nn.Embed`` (matching no other layer) calibrates its table.
    gram: also accumulate ``XᵀX`` (a table's ``attend`` statistics always have it).
    apply_kwargs: extra keyword arguments of ``module.apply`` (e.g. ``{"train": False}``).
    token_mask: as :func:`calibrate`.

  Returns:
    ``{layer path: LayerStats}`` and ``{table path: TableStats}``, on the device, as :func:`calibrate`; a stacked
    layer's (kernel stored ``(L, K, N)``) with the leading layer axes: ``(L, K)``, ``(L, K, K)``, ``(L,)``.

  Raises:
    ValueError: as :func:`calibrate`, e.g. a named table the module reads directly (``h @ embed.embedding.T``
      instead of ``embed.attend(h)``), a stack of tables.
    TypeError: ``module`` is not a Linen module; ``batches`` is a single array or a mapping.
  """
  batches = check_batches(batches)
  apply_kwargs = dict(apply_kwargs or {})
  layers = resolve_layers(linen_candidates(module, variables, batches[0], apply_kwargs, tables=True), rules,
                          what=LINEN_LAYERS_AND_TABLES)
  return linen_layer_stats(module, variables, layers, batches, apply_kwargs=apply_kwargs, gram=gram,
                           token_mask=token_mask)
