"""Calibration: the input statistics of a model's dense layers on a few batches, accumulated on the device.

For each selected ``nnx.Linear`` / ``nnx.LinearGeneral`` (Linen: ``nn.Dense``) a layer's inputs ``X``
(all tokens of all batches, ``(T, K)``, ``K`` the flattened input features) give a :class:`LayerStats`:
the per-feature sums of squares (Wanda's activation norms are their square roots) and the Gram matrix
``XᵀX`` (SparseGPT's Hessian, up to a factor), in float32. One jitted function per set of layers
records the inputs during the forward pass and adds their statistics to the running sums; the rest
of the forward pass, whose output is unused, is dead code for XLA.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from jaxsparse._rules import Probe
from jaxsparse._rules import get_module
from jaxsparse._rules import match_rules
from jaxsparse._rules import replace_module
from jaxsparse._rules import resolve_rules
from jaxsparse.formats._specs import NM
from jaxsparse.formats._specs import BlockSparse
from jaxsparse.formats._specs import Unstructured
from jaxsparse.formats._specs import check_spec_applies

__all__ = ["LayerStats", "calibrate", "calibrate_linen"]

_HIGHEST = jax.lax.Precision.HIGHEST
_SPECS = (Unstructured, NM, BlockSparse)


class LayerStats(NamedTuple):
  """Calibration statistics of one layer's inputs ``X`` (``(T, K)``: T tokens, K input features).

  Attributes:
    sq_norms: float32 ``(K,)``, ``sum_t X[t, k]²``; Wanda's activation norm is its square root.
    gram: float32 ``(K, K)``, ``XᵀX`` (SparseGPT's Hessian up to a factor), or ``None`` when not collected.
    tokens: int32 scalar ``T``.
  """

  sq_norms: jax.Array
  gram: jax.Array | None
  tokens: jax.Array


def check_layer_spec(spec: Any, shape: tuple[int, int], *, path: str) -> None:
  """Raises naming ``path`` when ``spec`` is not a structure or cannot apply to a ``(K, N)`` kernel."""
  if not isinstance(spec, _SPECS):
    raise TypeError(
        f"{path}: spec must be jaxsparse.Unstructured(...), jaxsparse.NM(...) or jaxsparse.BlockSparse(...), "
        f"got {spec!r}."
    )
  check_spec_applies(spec, shape, path=path)


# -------------------------------------------------------------------------------------------------
# Which layers: NNX and Linen.
# -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layer:
  """A selected dense layer: dotted path, its key in the module tree, structure and kernel shapes."""

  path: str
  key: tuple
  spec: Any
  kernel_shape: tuple[int, ...]
  k: int  # flattened input features
  n: int  # flattened output features


def _dotted(key: Sequence[Any]) -> str:
  return ".".join(str(k) for k in key)


def resolve_layers(candidates: Sequence[tuple[tuple, tuple[int, ...], int]], rules: Any, *, what: str) -> list[Layer]:
  """The candidates ``(key, kernel_shape, n_in_axes)`` that a non-``None`` rule selects, checked.

  Raises ``ValueError`` when a rule matches none of the candidates (a typo would otherwise leave
  layers dense without notice) or when nothing is selected.
  """
  resolved = resolve_rules(rules)
  paths = [_dotted(key) for key, _, _ in candidates]
  unused = [pattern for pattern, compiled, _ in resolved if not any(compiled.fullmatch(p) for p in paths)]
  if unused:
    raise ValueError(f"rule(s) {unused} match no {what}; its layers are: {', '.join(paths) or '(none)'}.")
  layers = []
  for (key, shape, n_in), path in zip(candidates, paths, strict=True):
    r = match_rules(resolved, path)
    spec = None if r is None else resolved[r][2]
    if spec is None:
      continue
    k, n = math.prod(shape[:n_in]), math.prod(shape[n_in:])
    check_layer_spec(spec, (k, n), path=path)
    layers.append(Layer(path, tuple(key), spec, tuple(shape), k, n))
  if not layers:
    raise ValueError(f"rules select no {what} (every match maps to None); nothing to prune.")
  return layers


def _is_jaxsparse(node: Any) -> bool:
  return type(node).__module__.startswith("jaxsparse.")


def nnx_candidates(model: nnx.Module) -> list[tuple[tuple, tuple[int, ...], int]]:
  """``(key, kernel_shape, n_in_axes)`` of every dense ``nnx.Linear`` / ``nnx.LinearGeneral`` in ``model``."""
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}; for Linen use the *_linen "
                    "functions.")
  sparse_keys, out = [], []
  for key, node in nnx.iter_modules(model):
    key = tuple(key)
    if any(key[: len(s)] == s for s in sparse_keys):
      continue
    if _is_jaxsparse(node):
      sparse_keys.append(key)
      continue
    path = _dotted(key) or "(model)"
    if isinstance(node, nnx.Conv):
      continue  # convolutions are not calibrated (yet); a rule naming one is reported as matching nothing
    if isinstance(node, nnx.LinearGeneral):
      n_in = len(node.in_features)
      if node.batch_axis or tuple(node.axis) != tuple(range(-n_in, 0)):
        raise ValueError(
            f"{path}: nnx.LinearGeneral with axis={node.axis} and batch_axis={dict(node.batch_axis)} is not supported; "
            "only trailing contracting axes and no batch axes (as in nnx.MultiHeadAttention)."
        )
      out.append((key, tuple(node.kernel.shape), n_in))
    elif isinstance(node, nnx.Linear):
      out.append((key, tuple(node.kernel.shape), 1))
  return out


def default_call(model: Any, batch: Any) -> Any:
  """``model(*batch)`` for a tuple, ``model(**batch)`` for a mapping, else ``model(batch)``."""
  if isinstance(batch, tuple):
    return model(*batch)
  if isinstance(batch, Mapping):
    return model(**batch)
  return model(batch)


def _with_probes(model: nnx.Module, keys: Sequence[tuple], record: Callable[[tuple, jax.Array], None]) -> nnx.Module:
  """Replaces the layers at ``keys`` by probes (in place); returns the model (a probe if a key is ``()``)."""
  for key in keys:
    probe = Probe(get_module(model, key), lambda x, key=key: record(key, x))
    if not key:
      return probe
    replace_module(model, key, probe)
  return model


def nnx_call_order(model: nnx.Module, keys: Sequence[tuple], batch: Any, call: Callable) -> list[tuple]:
  """``keys`` in the order the model first calls them on ``batch`` (traced only, nothing computed)."""
  graphdef, state = nnx.split(model)
  order: list[tuple] = []

  def run(state):
    m = _with_probes(nnx.merge(graphdef, state), keys, lambda key, x: order.append(key) if key not in order else None)
    call(m, batch)

  jax.eval_shape(run, state)
  missing = [_dotted(k) or "(model)" for k in keys if k not in order]
  if missing:
    raise ValueError(f"layer(s) {missing} are selected by the rules but the model does not call them on the "
                     "calibration batches; exclude them with a None rule.")
  return order


def _add_stats(acc: LayerStats, xs: list[jax.Array], layer: Layer, gram: bool, weights: jax.Array | None) -> LayerStats:
  rows = []
  for x in xs:
    x = x.reshape(-1, layer.k).astype(jnp.float32)
    if weights is not None:
      if weights.size != x.shape[0]:
        raise ValueError(f"{layer.path}: token_mask gives {weights.size} weights per batch but the layer sees "
                         f"{x.shape[0]} tokens; the mask must have the shape of the layer input without its features.")
      x = x * weights.reshape(-1, 1).astype(jnp.float32)
    rows.append(x)
  x = jnp.concatenate(rows)
  count = x.shape[0] if weights is None else len(xs) * jnp.sum(weights != 0, dtype=jnp.int32)
  return LayerStats(
      acc.sq_norms + jnp.sum(x * x, axis=0),
      acc.gram + jnp.matmul(x.T, x, precision=_HIGHEST) if gram else None,
      acc.tokens + count,
  )


def _zeros(k: int, gram: bool) -> LayerStats:
  return LayerStats(jnp.zeros((k,), jnp.float32), jnp.zeros((k, k), jnp.float32) if gram else None,
                    jnp.zeros((), jnp.int32))


def check_batches(batches: Any) -> list:
  if isinstance(batches, (jax.Array, Mapping)) or not hasattr(batches, "__iter__"):
    raise TypeError(f"batches must be a sequence of model inputs (a list of batches), got {type(batches).__name__}.")
  batches = list(batches)
  if not batches:
    raise ValueError("batches is empty: calibration needs at least one batch of inputs.")
  return batches


def nnx_layer_stats(model: nnx.Module, layers: Sequence[Layer], batches: Sequence[Any], *, call: Callable,
                    gram: bool, token_mask: Callable[[Any], jax.Array] | None = None) -> dict[str, LayerStats]:
  """Accumulates the :class:`LayerStats` of ``layers`` over ``batches`` (one jitted step per batch)."""
  graphdef, state = nnx.split(model)

  def step(state, acc, batch):
    xs: dict[tuple, list] = {layer.key: [] for layer in layers}
    m = _with_probes(nnx.merge(graphdef, state), list(xs), lambda key, x: xs[key].append(x))
    call(m, batch)
    for layer in layers:
      if not xs[layer.key]:
        raise ValueError(f"{layer.path}: the model does not call this layer on a calibration batch.")
    weights = None if token_mask is None else jnp.asarray(token_mask(batch))
    return {layer.path: _add_stats(acc[layer.path], xs[layer.key], layer, gram, weights) for layer in layers}

  step = jax.jit(step, donate_argnums=1)
  acc = {layer.path: _zeros(layer.k, gram) for layer in layers}
  for batch in batches:
    acc = step(state, acc, batch)
  return acc


def calibrate(model: nnx.Module, batches: Sequence[Any], rules: Any, *, gram: bool = True,
              call: Callable[[nnx.Module, Any], Any] | None = None,
              token_mask: Callable[[Any], jax.typing.ArrayLike] | None = None) -> dict[str, LayerStats]:
  """Runs an NNX model on calibration batches and returns the input statistics of the selected layers.

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
      ``nnx.Linear`` and ``nnx.LinearGeneral`` (trailing contracting axes) layers whose dotted path a
      rule with a structure fully matches are calibrated.
    gram: also accumulate ``XᵀX`` (SparseGPT needs it; Wanda only the norms).
    call: ``(model, batch) -> output``; default ``model(*batch)`` for a tuple, ``model(**batch)`` for
      a dict, else ``model(batch)``.
    token_mask: ``batch -> 0/1 array`` over the tokens of a batch (the shape of a layer input without
      its feature axes, e.g. ``lambda b: b["attention_mask"]`` for padded ``(B, S)`` text batches):
      tokens with 0 (padding) are left out of the statistics.

  Returns:
    ``{layer path: LayerStats}``, on the device.

  Raises:
    ValueError: no batches, a rule that matches no layer, a selected layer the model never calls.
  """
  batches = check_batches(batches)
  layers = resolve_layers(nnx_candidates(model), rules, what="nnx.Linear / nnx.LinearGeneral layer")
  call = default_call if call is None else call
  nnx_call_order(model, [layer.key for layer in layers], batches[0], call)
  return nnx_layer_stats(model, layers, batches, call=call, gram=gram, token_mask=token_mask)


# -------------------------------------------------------------------------------------------------
# Linen.
# -------------------------------------------------------------------------------------------------


def _linen_args(batch: Any) -> tuple[tuple, dict]:
  if isinstance(batch, tuple):
    return batch, {}
  if isinstance(batch, Mapping):
    return (), dict(batch)
  return (batch,), {}


def linen_candidates(module: nn.Module, variables: Mapping, batch: Any,
                     apply_kwargs: Mapping) -> list[tuple[tuple, tuple[int, ...], int]]:
  """``(path, kernel_shape, 1)`` of every ``nn.Dense`` that ``module`` calls on ``batch``, in call order."""
  if not isinstance(module, nn.Module):
    raise TypeError(f"module must be a flax.linen.Module, got {type(module).__name__}.")
  found: dict[tuple, tuple[int, ...]] = {}

  def interceptor(next_fun, args, kwargs, context):
    m = context.module
    if context.method_name == "__call__" and type(m) is nn.Dense and args:
      found.setdefault(tuple(m.path), (int(args[0].shape[-1]), int(m.features)))
    return next_fun(*args, **kwargs)

  args, kwargs = _linen_args(batch)
  with nn.intercept_methods(interceptor):
    jax.eval_shape(lambda v, *a: module.apply(v, *a, **kwargs, **apply_kwargs), variables, *args)
  return [(path, shape, 1) for path, shape in found.items()]


def linen_layer_stats(module: nn.Module, variables: Mapping, layers: Sequence[Layer], batches: Sequence[Any], *,
                      apply_kwargs: Mapping, gram: bool,
                      token_mask: Callable[[Any], jax.Array] | None = None) -> dict[str, LayerStats]:
  """Linen version of :func:`nnx_layer_stats`: inputs of the ``nn.Dense`` calls at the layers' paths."""
  by_key = {layer.key: layer for layer in layers}

  def step(variables, acc, batch):
    xs: dict[tuple, list] = {key: [] for key in by_key}

    def interceptor(next_fun, args, kwargs, context):
      key = tuple(context.module.path)
      if context.method_name == "__call__" and key in xs and type(context.module) is nn.Dense:
        xs[key].append(args[0])
      return next_fun(*args, **kwargs)

    args, kwargs = _linen_args(batch)
    with nn.intercept_methods(interceptor):
      module.apply(variables, *args, **kwargs, **apply_kwargs)
    for layer in layers:
      if not xs[layer.key]:
        raise ValueError(f"{layer.path}: the module does not call this layer on a calibration batch.")
    weights = None if token_mask is None else jnp.asarray(token_mask(batch))
    return {layer.path: _add_stats(acc[layer.path], xs[layer.key], layer, gram, weights) for layer in layers}

  step = jax.jit(step, donate_argnums=1)
  acc = {layer.path: _zeros(layer.k, gram) for layer in layers}
  for batch in batches:
    acc = step(variables, acc, batch)
  return acc


def calibrate_linen(module: nn.Module, variables: Mapping, batches: Sequence[Any], rules: Any, *, gram: bool = True,
                    apply_kwargs: Mapping[str, Any] | None = None,
                    token_mask: Callable[[Any], jax.typing.ArrayLike] | None = None) -> dict[str, LayerStats]:
  """Linen version of :func:`calibrate`: statistics of the inputs of the selected ``nn.Dense`` calls.

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
    rules: as :func:`calibrate`, matched against Linen module paths (``"Dense_0"``, ``"mlp.fc1"``).
    gram: also accumulate ``XᵀX``.
    apply_kwargs: extra keyword arguments of ``module.apply`` (e.g. ``{"train": False}``).
    token_mask: as :func:`calibrate`.

  Returns:
    ``{layer path: LayerStats}``.
  """
  batches = check_batches(batches)
  apply_kwargs = dict(apply_kwargs or {})
  layers = resolve_layers(linen_candidates(module, variables, batches[0], apply_kwargs), rules, what="nn.Dense call")
  return linen_layer_stats(module, variables, layers, batches, apply_kwargs=apply_kwargs, gram=gram,
                           token_mask=token_mask)
