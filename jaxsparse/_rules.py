"""Rules that assign sparsity structures to the dotted paths of a model's layers and parameters.

A *rule set* is either one structure (:mod:`jaxsparse.formats`' ``Unstructured``, ``BlockSparse``,
``NM``), applied everywhere, or a mapping from regular expressions to structures (or ``None``, "keep
dense"); a path takes the structure of the first pattern that matches it in full
(:func:`re.fullmatch`). Paths are dotted: ``"blocks.0.mlp.fc1"`` for a layer,
``"blocks.0.mlp.fc1.kernel"`` for its parameter; a parameter also matches the patterns that match
its layer's path, so one rule set serves :func:`jaxsparse.sparsify`, :mod:`jaxsparse.pruning` and
:mod:`jaxsparse.torch_interop` alike. Also here: the path and tree helpers those three share.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import TypeAlias

import jax
import numpy as np
from flax import nnx
from flax.nnx import graph

from jaxsparse import _utils
from jaxsparse.formats._base import is_concrete
from jaxsparse.formats._specs import NM
from jaxsparse.formats._specs import SPECS
from jaxsparse.formats._specs import Spec

__all__ = [
    "Probe",
    "Rules",
    "Views",
    "as_int_tuple",
    "as_numpy_bool",
    "check_unsupported",
    "dense_general_dims",
    "flatten_with_paths",
    "get_module",
    "kernel_in_ndim",
    "linear_general_unsupported",
    "masks_to_dict",
    "match_rules",
    "module_paths",
    "path_str",
    "replace_module",
    "resolve_rules",
    "resolve_views",
    "unwrap_variables",
    "warn_unmatched",
]

Rules: TypeAlias = Spec | Mapping[str, Spec | None]
Views: TypeAlias = Mapping[str, int]


def resolve_rules(rules: Any) -> list[tuple[str, re.Pattern, Spec | None]]:
  """``rules`` as ``[(pattern, compiled, spec_or_None)]``, checked; a lone spec matches every path."""
  if isinstance(rules, SPECS):
    return [(".*", re.compile(".*"), rules)]
  if not isinstance(rules, Mapping):
    raise TypeError(
        "rules must be a sparsity structure (jaxsparse.Unstructured, jaxsparse.BlockSparse, jaxsparse.NM) "
        f"or a mapping from regex to structure, got {type(rules).__name__}."
    )
  if not rules:
    raise ValueError("rules is empty: give at least one {regex: structure} entry.")
  out = []
  for pattern, spec in rules.items():
    if not isinstance(pattern, str):
      raise TypeError(f"rule keys must be regex strings, got {pattern!r}.")
    if spec is not None and not isinstance(spec, SPECS):
      raise TypeError(
          f"rule {pattern!r} maps to {spec!r}; use jaxsparse.Unstructured(...), jaxsparse.BlockSparse(...), "
          "jaxsparse.NM(...) or None (keep dense)."
      )
    try:
      compiled = re.compile(pattern)
    except re.error as e:
      raise ValueError(f"rule {pattern!r} is not a valid regular expression: {e}.") from e
    out.append((pattern, compiled, spec))
  return out


def resolve_views(views: Any) -> list[tuple[str, re.Pattern, int]]:
  """``views`` (``{regex: input axes}``, or ``None``) as ``[(pattern, compiled, in_ndim)]``, checked.

  A view is the number of leading input axes of a kernel's 2-D view (``matrix_shape``); its patterns
  match paths as rules do (:func:`match_rules`).
  """
  return resolve_counts(views, "views", "a kernel's number of input axes (as pruning.kernel_views returns it)",
                        "a positive int (the kernel's input axes)", minimum=1)


def resolve_counts(counts: Any, name: str, meaning: str, allowed: str, *, minimum: int) -> list[tuple[str, Any, int]]:
  """``counts`` (``{regex: int}``, or ``None``: the ``views`` / ``stacks`` options) as ``[(pattern, compiled, n)]``.

  Raises a ``TypeError`` (``ValueError`` for a bad regex) naming ``name``, the key and the value, and what is
  ``allowed``, for anything but a mapping of regex strings to ints ``>= minimum``.
  """
  if counts is None:
    return []
  if not isinstance(counts, Mapping):
    raise TypeError(f"{name} must be a mapping from regex to {meaning}, got {type(counts).__name__}.")
  out = []
  for pattern, n in counts.items():
    if not isinstance(pattern, str):
      raise TypeError(f"{name} keys must be regex strings, got {pattern!r}.")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < minimum:
      raise TypeError(f"{name}[{pattern!r}] must be {allowed}, got {n!r}.")
    try:
      compiled = re.compile(pattern)
    except re.error as e:
      raise ValueError(f"{name} key {pattern!r} is not a valid regular expression: {e}.") from e
    out.append((pattern, compiled, int(n)))
  return out


def match_rules(resolved: list[tuple[str, re.Pattern, Any]], path: str, *, owner: str | None = None) -> int | None:
  """Index of the first rule whose pattern fully matches ``path`` (or ``owner``, when given), or ``None``."""
  for i, (_, compiled, _) in enumerate(resolved):
    if compiled.fullmatch(path) or (owner is not None and compiled.fullmatch(owner)):
      return i
  return None


def embedding_rule(resolved: list[tuple[str, re.Pattern, Any]], path: str, layer_paths: Sequence[str], *,
                   kind: str, layers: str, features: int) -> Any:
  """The structure a rule aimed at the embedding at ``path`` gives it, or ``None``.

  An embedding takes the first rule that fully matches its path only when that rule matches none of the model's
  ``layer_paths`` (its Linear / Conv layers; a rule naming it, like ``"embed"``): catch-all rules leave embeddings
  dense. Such a rule must be an ``NM`` one, not transposable, whose ``m`` divides ``features``; else a
  ``ValueError`` names the embedding (its path and ``kind``) and the layers that take other structures (``layers``).
  """
  name = path or "(the model itself)"
  r = _embedding_rule_index(resolved, path, layer_paths)
  if r is None or resolved[r][2] is None:
    return None
  spec = resolved[r][2]
  if not isinstance(spec, NM) or spec.transposable:
    raise ValueError(
        f"{name} ({kind}): rule {resolved[r][0]!r} gives it {spec.describe()}, but an embedding takes only NM(n, m) "
        "rules (not transposable): it is stored as a CompressedNMEmbed, n of every m features of each row kept. "
        f"Supported for other structures: {layers}. Map it to None or narrow the rule."
    )
  if features % spec.m:
    raise ValueError(f"{name}: m={spec.m} must divide the embedding's features={features}.")
  return spec


def _embedding_rule_index(resolved: list[tuple[str, re.Pattern, Any]], path: str,
                          layer_paths: Sequence[str]) -> int | None:
  """The index of the first rule fully matching the embedding's ``path``, or ``None`` where there is none or it also
  matches one of ``layer_paths`` (a catch-all: embeddings stay dense)."""
  r = match_rules(resolved, path)
  if r is None or any(resolved[r][1].fullmatch(q) for q in layer_paths):
    return None
  return r


def embeddings_kept_dense(resolved: list[tuple[str, re.Pattern, Any]], paths: Sequence[str],
                          layer_paths: Sequence[str]) -> list[str]:
  """The embedding ``paths`` whose rule (as :func:`embedding_rule` picks it: one naming no layer of ``layer_paths``)
  maps them to ``None``: matched, and kept dense, so that rule is no unmatched one for :func:`warn_unmatched`."""
  return [path for path in paths
          if (r := _embedding_rule_index(resolved, path, layer_paths)) is not None and resolved[r][2] is None]


def warn_unmatched(
    resolved: list[tuple[str, re.Pattern, Any]], available: Sequence[str], *, what: str, kind: str = "rule(s)",
    shadowed: bool = False,
) -> None:
  """Warns about the rules (or views: ``kind``) whose pattern fully matches none of the ``available`` paths; with
  ``shadowed``, also about the rules that match some but select none, each of those paths going to an earlier rule
  (first full match wins), unless the rule matches every path (a catch-all left with nothing)."""
  unused = [pattern for pattern, compiled, _ in resolved if not any(compiled.fullmatch(p) for p in available)]
  if unused:
    listing = ", ".join(available) if available else "(none)"
    _utils.warn_at_caller(f"{kind} {unused} matched no {what}; available paths: {listing}.", UserWarning)
  if not shadowed:
    return
  chosen = {p: match_rules(resolved, p) for p in available}
  for i, (pattern, compiled, _) in enumerate(resolved):
    matched = [p for p in available if compiled.fullmatch(p)]
    if matched and len(matched) < len(available) and i not in {chosen[p] for p in matched}:
      taken = ", ".join(f"{p} -> '{resolved[chosen[p]][0]}'" for p in matched[:5])
      _utils.warn_at_caller(
          f"rule '{pattern}' selects no {what}: every path it matches goes to an earlier rule (the first rule that "
          f"matches a path in full wins): {taken}{' ...' if len(matched) > 5 else ''}. Put the more specific rule "
          "first.", UserWarning)


def check_unsupported(
    resolved: list[tuple[str, re.Pattern, Spec | None]],
    available: Sequence[str],
    unsupported: Mapping[str, str],
    *,
    supported: str,
) -> None:
  """Raises for a rule that matches none of the ``available`` layers but an ``unsupported`` one (an embedding).

  A catch-all rule that also covers supported layers passes the unsupported ones by; a rule aimed at one of them
  only would otherwise do nothing but warn. The message speaks the API of the layer type: an ``nnx.Embed`` is
  stored N:M-compressed by :meth:`jaxsparse.layers.CompressedNMEmbed.from_dense`; an ``nn.Embed`` that
  :func:`jaxsparse.sparsify_linen` cannot take is one its example input never calls (its table read directly, or
  unused), which therefore cannot run as a :class:`jaxsparse.layers.linen.CompressedNMEmbed`.

  Args:
    resolved: from :func:`resolve_rules`.
    available: the dotted paths of the layers that can take a structure.
    unsupported: ``{dotted path: layer type}`` of the layers that cannot (``{"embed": "nnx.Embed"}``).
    supported: the layer types that can, for the message.
  """
  for pattern, compiled, spec in resolved:
    if spec is None or any(compiled.fullmatch(p) for p in available):
      continue
    hit = [p for p in unsupported if compiled.fullmatch(p)]
    if hit:
      kind = unsupported[hit[0]]
      why, hint = _UNSUPPORTED_WHY.get(kind, ("sparsify does not take this layer", ""))
      raise ValueError(f"{hit[0]} ({kind}): rule {pattern!r} gives it {spec.describe()}, but {why}; supported: "
                       f"{supported}. Map it to None or narrow the rule.{hint}")


_UNSUPPORTED_WHY = {  # check_unsupported's (reason, hint) per layer type, in the words of its API
    "nnx.Embed": ("sparsify does not take this layer",
                  " (An nnx.Embed can be stored N:M-compressed: jaxsparse.layers.CompressedNMEmbed.from_dense.)"),
    "nn.Embed": ("the example input never calls this layer (its lookups or attend), so sparsify_linen cannot run it "
                 "as a jaxsparse.layers.linen.CompressedNMEmbed (a table the model reads itself, as "
                 "self.embed.embedding[ids], or an unused one)", " Call the layer instead of reading its table."),
}


def path_str(keypath: Sequence[Any]) -> str:
  """Dotted name of a JAX key path or an NNX path tuple: ``("blocks", 0, "kernel")`` -> ``"blocks.0.kernel"``."""
  parts = []
  for k in keypath:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      parts.append(k.name)
    elif isinstance(k, jax.tree_util.FlattenedIndexKey):
      parts.append(str(k.key))
    else:
      parts.append(str(k))
  return ".".join(parts)


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def check_distinct_paths(keypaths: Sequence[Sequence[Any]], *, what: str) -> None:
  """Raises a ``ValueError`` where two key paths of ``what`` give one dotted name (:func:`path_str`): a dict key that
  holds a ``"."`` (``{"a.b": ...}`` beside ``{"a": {"b": ...}}``). Rules, masks and reports name parameters by that
  name, so the two would share one mask."""
  seen: dict[str, Sequence[Any]] = {}  # the key paths of one tree are distinct: a name seen twice is a clash
  for kp in keypaths:
    name = path_str(kp)
    other = seen.setdefault(name, kp)
    if other is not kp:
      parts = lambda p: "(" + ", ".join(repr(_key_part(k)) for k in p) + ")"
      raise ValueError(
          f"{what}: two entries have the dotted name {name!r}: {parts(other)} and {parts(kp)}. jaxsparse names "
          "parameters, rules and masks by that name, so they would share one mask; rename the dict key that holds "
          "a '.'."
      )


def _key_part(k: Any) -> Any:
  """One part of a key path as the user wrote it: a dict key, an attribute name, a sequence index."""
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return getattr(k, attr)
  return k


def check_distinct_tree_paths(tree: Any, *, what: str) -> None:
  """:func:`check_distinct_paths` over the leaves of ``tree`` (NNX variables as leaves): a model's state or a
  Linen variables dict."""
  pairs = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)[0]
  check_distinct_paths([kp for kp, _ in pairs], what=what)


def flatten_with_paths(tree: Any) -> tuple[list[str], list[Any], Any]:
  """Flattens ``tree`` treating NNX variables as leaves (their values unwrapped).

  Returns:
    ``(paths, leaves, treedef)``; ``jax.tree.unflatten(treedef, leaves)`` rebuilds the tree with plain
    arrays in place of variables, the structure ``nnx.Optimizer`` hands to ``tx.update``.
  """
  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)
  check_distinct_paths([kp for kp, _ in pairs], what="the parameters")
  paths = [path_str(kp) for kp, _ in pairs]
  leaves = [v.get_value() if _is_variable(v) else v for _, v in pairs]
  return paths, leaves, treedef


def _child(node: Any, key: Any) -> Any:
  return node[key] if hasattr(type(node), "__getitem__") else getattr(node, key)


def get_module(model: nnx.Module, path: Sequence[Any]) -> Any:
  """The module at ``path`` (as from ``nnx.iter_modules``) inside ``model``; ``model`` for ``()``."""
  for k in path:
    model = _child(model, k)
  return model


def walk_graph(model: nnx.Module) -> Iterator[tuple[tuple, Any, int]]:
  """``(path, node, id of the innermost module holding it)`` for every node inside ``model`` at each of its paths (as
  ``nnx.iter_modules`` writes them), depth first: modules, ``nnx.List`` / ``nnx.Dict``, tuples, lists and dicts held as
  data, and the ``nnx.Variable`` s they hold (not entered). A node held twice (tied: ``self.b = self.a``) comes at both
  paths; a reference cycle is not followed round."""

  def walk(node, path, holder, above):
    if isinstance(node, nnx.Module):
      holder = id(node)
    if id(node) in above:  # a reference cycle
      return
    for key, child in graph.get_node_impl(node).node_dict(node).items():
      if isinstance(key, str) and key.startswith("_pytree__"):
        continue
      if isinstance(child, nnx.Variable):
        yield (*path, key), child, holder
      elif graph.is_node(child):
        yield (*path, key), child, holder
        yield from walk(child, (*path, key), holder, above | {id(node)})

  yield from walk(model, (), id(model), frozenset())


def module_paths(model: nnx.Module) -> dict[int, list[tuple]]:
  """Every path (as ``nnx.iter_modules`` writes them) of each module inside ``model``, by ``id``.

  ``nnx.iter_modules`` yields a module once, at its first path; a module that several attributes or container items
  hold (tied weights: ``self.b = self.a``, ``nnx.data((a, a))``) has all of them here, the first first
  (:func:`walk_graph`).
  """
  out: dict[int, list[tuple]] = {id(model): [()]}
  for path, node, _ in walk_graph(model):
    if isinstance(node, nnx.Module):
      out.setdefault(id(node), []).append(path)
  return out


def replace_module(model: nnx.Module, path: Sequence[Any], new: nnx.Module) -> None:
  """Puts ``new`` at ``path`` (as from ``nnx.iter_modules``) inside ``model``: attributes, list items, dict keys, items
  of tuples and fields of frozen dataclasses (rebuilt); and at every other path holding the same module (tied weights
  stay tied)."""
  old = get_module(model, path)
  paths = module_paths(model).get(id(old), [])
  for p in paths if tuple(path) in paths else [tuple(path)]:
    _set_child(model, p, new)


def _set_child(model: nnx.Module, path: tuple, new: Any) -> None:
  parent = get_module(model, path[:-1])
  if isinstance(parent, tuple):  # immutable: the tuple is rebuilt and put where it was
    items = list(parent)
    items[path[-1]] = new
    _set_child(model, path[:-1], type(parent)(*items) if hasattr(parent, "_fields") else type(parent)(items))
  elif dataclasses.is_dataclass(parent) and parent.__dataclass_params__.frozen:  # flax.struct.dataclass: rebuilt too
    _set_child(model, path[:-1], dataclasses.replace(parent, **{path[-1]: new}))
  elif hasattr(type(parent), "__setitem__"):
    parent[path[-1]] = new
  else:
    setattr(parent, path[-1], new)


class Probe(nnx.Module):
  """Stands in for a layer (see :func:`replace_module`) and hands each input it gets to ``record``."""

  def __init__(self, inner: nnx.Module, record: Callable[[jax.Array], None]):
    self.inner = inner
    self.record = record

  def __call__(self, x, *args, **kwargs):
    self.record(x)
    return self.inner(x, *args, **kwargs)


def unwrap_variables(tree: Any) -> Any:
  """``tree`` with every NNX variable replaced by its value."""
  return jax.tree.map(lambda v: v.get_value() if _is_variable(v) else v, tree, is_leaf=_is_variable)


def masks_to_dict(masks: Any) -> dict[str, np.ndarray]:
  """``{dotted path: bool NumPy array}`` for every mask: to save (``np.savez(f, **d)``) or inspect.

  >>> import jax.numpy as jnp
  >>> from jaxsparse import pruning
  >>> pruning.masks_to_dict({"fc": {"kernel": jnp.ones((2, 2), bool), "bias": None}})
  {'fc.kernel': array([[ True,  True],
         [ True,  True]])}

  Args:
    masks: a tree of bool arrays (and ``None`` for unpruned parameters), as :func:`get_masks` or
      :func:`magnitude_masks` return it; NNX variables in it are read as their values.

  Returns:
    A dict from each mask's dotted path (``"fc.kernel"``) to a NumPy bool array of its shape; ``None`` leaves
    are left out.

  Raises:
    ValueError: naming the first mask that has no values to read: a traced one (computed inside ``jax.eval_shape``
      / ``jax.jit``, as the ``masks=`` of :func:`jaxsparse.sparsify` or :func:`jaxsparse.sparsify_linen` under
      ``nnx.eval_shape``) or an abstract one (a ``jax.ShapeDtypeStruct``).
  """
  pairs = jax.tree_util.tree_flatten_with_path(unwrap_variables(masks))[0]
  check_distinct_paths([kp for kp, _ in pairs], what="masks")
  for kp, m in pairs:
    if not is_concrete(m):
      what = ("abstract (ShapeDtypeStruct: no values)" if isinstance(m, jax.ShapeDtypeStruct)
              else "traced (computed inside jax.eval_shape / jax.jit)")
      raise ValueError(
          f"masks[{path_str(kp)!r}] is {what}: its values are needed "
          "(sparsify checks the patterns, which decide the sparse shapes). Compute the masks outside the traced "
          "function and close over them, or leave masks= out to prune by magnitude."
      )
  return {path_str(kp): np.asarray(m) for kp, m in pairs}


def as_numpy_bool(mask: Any, *, name: str) -> np.ndarray:
  """``mask`` as a NumPy bool array; a ``TypeError`` naming ``name`` for any other dtype."""
  m = np.asarray(mask)
  if m.dtype != np.bool_:
    raise TypeError(f"{name} must be a boolean array, got dtype {m.dtype}.")
  return m


def as_int_tuple(v: int | Sequence[int]) -> tuple[int, ...]:
  """``v`` (an int or a sequence of ints, as Flax layer fields take them) as a tuple of ints."""
  return (int(v),) if isinstance(v, (int, np.integer)) else tuple(int(a) for a in v)


def dense_general_dims(m: Any, x_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], str]:
  """``(in_dims, features, unsupported)`` of a Linen ``nn.DenseGeneral`` ``m`` called on an input of ``x_shape``.

  ``in_dims`` are the contracted input dims, ``features`` the output dims; ``unsupported`` is why the
  layer cannot be handled as a 2-D ``(prod(in_dims), prod(features))`` product (empty when it can:
  trailing contracting axes in order, no batch dims, as in ``nn.MultiHeadDotProductAttention``).
  """
  axis, features = as_int_tuple(m.axis), as_int_tuple(m.features)
  ndim = len(x_shape)
  in_dims = tuple(int(x_shape[a]) for a in axis)
  unsupported = ""
  if as_int_tuple(m.batch_dims) or tuple(a % ndim for a in axis) != tuple(range(ndim - len(axis), ndim)):
    unsupported = (
        f"nn.DenseGeneral with axis={m.axis} and batch_dims={m.batch_dims} is not supported; only the trailing "
        "axes in order as contracting axes and no batch dims (as in nn.MultiHeadDotProductAttention)"
    )
  return in_dims, features, unsupported


def linear_general_unsupported(layer: Any) -> str | None:
  """Why an ``nnx.LinearGeneral`` has no 2-D ``(in, out)`` view of its kernel (``matrix_shape``), or ``None``.

  Only trailing contracting axes and no batch axes have one, as in ``nnx.MultiHeadAttention``; one check for
  sparsify, calibration and torch interop.
  """
  n_in = len(layer.in_features)
  if layer.batch_axis or tuple(layer.axis) != tuple(range(-n_in, 0)):
    return (f"nnx.LinearGeneral with axis={layer.axis} and batch_axis={dict(layer.batch_axis)} is not supported; "
            "only trailing contracting axes and no batch axes (as in nnx.MultiHeadAttention)")
  return None


def kernel_in_ndim(kernel_shape: Sequence[int], bias_shape: Sequence[int] | None) -> int | None:
  """The input axes of a kernel seen without its layer (by :mod:`jaxsparse.pruning`), from its layer's bias.

  A bias holds the output axes: a ``LinearGeneral`` q/k/v kernel ``(in, heads, head_dim)`` next to a
  ``(heads, head_dim)`` bias has 1 input axis. ``None`` (every axis but the last an input, the conv
  layout) when there is no bias or it has one axis; the pruners' ``views=`` (from
  ``pruning.kernel_views``) say it for a bias-free layer and win over this guess.
  """
  if bias_shape is None or len(bias_shape) < 2:
    return None
  kernel_shape, bias_shape = tuple(kernel_shape), tuple(bias_shape)
  if len(bias_shape) < len(kernel_shape) and kernel_shape[-len(bias_shape):] == bias_shape:
    return len(kernel_shape) - len(bias_shape)
  return None
