"""Scores and masks: magnitude, block magnitude and N:M, with layer-wise or global thresholds.

Every mask keeps an exact count and breaks ties by the lower flat index, and a NaN score (a NaN weight, or a
block holding one) counts as the largest, so a diverged weight is kept and stays visible, like
:func:`jaxsparse.magnitude_mask` and :func:`jaxsparse.nm_mask`. The counts may be traced values (the pruning
schedule changes them inside ``jit``), so selection ranks the scores instead of slicing a sorted list.

A mask tree has the structure of the parameter tree; a leaf is a bool array of the parameter's
shape for a pruned parameter and ``None`` for one that is never pruned: only parameters with two or
more axes are pruned, and never a ``bias`` (``nn.MultiHeadAttention``'s q/k/v biases are 2-D), as
:func:`jaxsparse.sparsify` never sparsifies one. A parameter not named ``kernel`` (an ``nnx.Embed`` table, a
positional ``nnx.Param``) is pruned only by a rule that matches no kernel (a rule naming it), so a catch-all
rule prunes what :func:`jaxsparse.sparsify` sparsifies under it and no more.

Blocks and N:M groups are taken on the kernel's 2-D view (``jaxsparse.formats._specs.matrix_shape``),
the one :func:`jaxsparse.sparsify` and :mod:`jaxsparse.torch_interop` use. Its input axes are the ones
``views`` gives (:func:`~jaxsparse.pruning.kernel_views` reads them off a model); otherwise a kernel whose
layer has a bias of ``d`` axes has ``d`` output axes (``LinearGeneral`` q/k/v ``(in, heads, head_dim)`` with
its ``(heads, head_dim)`` bias is ``(in, heads * head_dim)``), and any other kernel is
``(prod(shape[:-1]), shape[-1])``. An embedding table (a 2-D leaf named ``embedding``) keeps ``n`` of every ``m``
of its features, as :func:`jaxsparse.sparsify` stores it (a ``CompressedNMEmbed``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsparse import _utils
from jaxsparse._rules import Views
from jaxsparse._rules import flatten_with_paths
from jaxsparse._rules import kernel_in_ndim
from jaxsparse._rules import match_rules
from jaxsparse._rules import module_paths
from jaxsparse._rules import path_str
from jaxsparse._rules import resolve_rules
from jaxsparse._rules import resolve_views
from jaxsparse._rules import warn_unmatched
from jaxsparse.formats._masks import replicated
from jaxsparse.formats._masks import split_like
from jaxsparse.formats._specs import NM
from jaxsparse.formats._specs import BlockSparse
from jaxsparse.formats._specs import Spec
from jaxsparse.formats._specs import check_plain_nm
from jaxsparse.formats._specs import check_spec_applies
from jaxsparse.formats._specs import matrix_shape

__all__ = ["block_magnitude_scores", "magnitude_masks", "magnitude_scores"]


def magnitude_scores(w: jax.typing.ArrayLike) -> jax.Array:
  """``|w|`` in float32 (float64 for float64 weights): the score of unstructured magnitude pruning.

  >>> import jax.numpy as jnp
  >>> from jaxsparse import pruning
  >>> pruning.magnitude_scores(jnp.array([-2.0, 0.5]))
  Array([2. , 0.5], dtype=float32)

  Args:
    w: weights of any shape and dtype.

  Returns:
    A float32 array of ``w``'s shape; float64 for float64 ``w`` (whose magnitudes float32 would round to ties).
  """
  w = jnp.asarray(w)
  return jnp.abs(w.astype(_utils.accumulation_dtype(w.dtype)))


def block_magnitude_scores(
    w: jax.typing.ArrayLike, block_shape: tuple[int, int], *, in_ndim: int | None = None
) -> jax.Array:
  """Frobenius norm of every ``(bk, bn)`` block of ``w``, viewed as ``(prod(shape[:in_ndim]), prod(shape[in_ndim:]))``.

  >>> import jax.numpy as jnp
  >>> from jaxsparse import pruning
  >>> pruning.block_magnitude_scores(jnp.ones((4, 6)), (2, 3))
  Array([[2.4494898, 2.4494898],
         [2.4494898, 2.4494898]], dtype=float32)

  Args:
    w: weights with at least 2 axes.
    block_shape: ``(bk, bn)`` dividing the ``(in, out)`` view.
    in_ndim: the number of leading input axes; default every axis but the last (see ``matrix_shape``).

  Returns:
    float32 ``(in // bk, out // bn)``; float64 for float64 ``w``.

  Raises:
    ValueError: ``w`` has fewer than 2 axes; ``in_ndim`` leaves no input or no output axis; ``block_shape`` is
      not positive or does not divide the ``(in, out)`` view.
    TypeError: ``block_shape`` is not a pair of ints.
  """
  w = jnp.asarray(w)
  if w.ndim < 2:
    raise ValueError(f"w must have at least 2 axes, got shape {w.shape}.")
  k, n = matrix_shape(w.shape, in_ndim)
  bk, bn = _utils.check_block_shape(block_shape, (k, n))
  return _block_reduce(w.reshape(k, n).astype(_utils.accumulation_dtype(w.dtype)) ** 2, (bk, bn)) ** 0.5


def _block_reduce(x2: jax.Array, block_shape: tuple[int, int]) -> jax.Array:
  (k, n), (bk, bn) = x2.shape, block_shape
  return jnp.sum(x2.reshape(k // bk, bk, n // bn, bn), axis=(1, 3))


def _nan_largest(scores: jax.Array) -> jax.Array:
  """``scores`` with NaN replaced by ``+inf`` (a sort would put NaN last, i.e. prune it first)."""
  return jnp.where(jnp.isnan(scores), jnp.inf, scores)


def rank_mask(scores: jax.Array, k: jax.typing.ArrayLike, *, among: jax.Array | None = None) -> jax.Array:
  """Bool mask of the ``k`` largest entries of ``scores`` (``k`` may be traced; ties: lower index first; NaN largest).

  With ``among`` (a bool array of ``scores.shape``), only those entries compete and no other is kept, whatever
  their scores (``+-inf`` included): ``min(k, among.sum())`` entries are kept.
  """
  flat = _nan_largest(scores.reshape(-1))
  if among is None:
    order = jnp.argsort(-flat, stable=True)
  else:
    order = jnp.lexsort((-flat, ~among.reshape(-1)))  # eligible entries first, each part by descending score
  ranks = jnp.zeros(flat.shape, jnp.int32).at[order].set(jnp.arange(flat.size, dtype=jnp.int32))
  keep = (ranks < k).reshape(scores.shape)
  return keep if among is None else keep & among


def group_rank_mask(scores2: jax.Array, n: jax.typing.ArrayLike, m: int) -> jax.Array:
  """Keeps the ``n`` largest of every ``m`` consecutive rows of each column of ``scores2`` (``(K, N)``; NaN largest)."""
  k, cols = scores2.shape
  g = _nan_largest(scores2.reshape(k // m, m, cols))
  ranks = jnp.argsort(jnp.argsort(-g, axis=1, stable=True), axis=1)
  return (ranks < n).reshape(k, cols)


def kept_at(total: int, kept_final: int, sparsity: jax.typing.ArrayLike, final: float) -> jax.Array:
  """Units kept at ``sparsity`` on the way to ``final``; exactly ``kept_final`` once it is reached."""
  s = jnp.asarray(sparsity, jnp.float32)
  kept = total - jnp.floor(s * total + 0.5).astype(jnp.int32)
  return jnp.where(s >= jnp.float32(final), kept_final, jnp.clip(kept, kept_final, total)).astype(jnp.int32)


# -------------------------------------------------------------------------------------------------
# Targets: which leaves a rule set prunes, and their units (weights, blocks or N:M groups).
# -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
  """One pruned leaf: its position among the flattened leaves, path, shape and structure."""

  index: int
  path: str
  shape: tuple[int, ...]
  spec: Spec
  rule: int
  in_ndim: int | None = None  # leading input axes of the 2-D view (matrix_shape); None: all but the last
  table: bool = False  # an embedding table (num_embeddings, features): N:M groups run along its features

  @property
  def shape_2d(self) -> tuple[int, int]:
    """The leaf viewed as ``(in, out)``, as sparsify and torch_interop view its layer's kernel."""
    return matrix_shape(self.shape, self.in_ndim)

  @property
  def units(self) -> int:
    """Number of units that are kept or pruned together: weights, or blocks."""
    if isinstance(self.spec, BlockSparse):
      k, n = self.shape_2d
      bk, bn = self.spec.block_shape
      return (k // bk) * (n // bn)
    return math.prod(self.shape)

  @property
  def kept_final(self) -> int:
    """Units kept at the structure's target sparsity, with the counting rules of the layers."""
    if isinstance(self.spec, BlockSparse):
      return _utils.kept_count(self.spec.density, self.units)
    if isinstance(self.spec, NM):
      return self.units // self.spec.m * self.spec.n
    return self.units - _utils.kept_count(self.spec.sparsity, self.units)

  def unit_scores(self, scores: jax.Array, *, blockwise: str = "norm") -> jax.Array:
    """Flat scores per unit. ``blockwise``: ``"norm"`` (Frobenius norm of the block) or ``"sum"``."""
    scores = scores.astype(_utils.accumulation_dtype(scores.dtype))  # float32, float64 kept
    if isinstance(self.spec, BlockSparse):
      x2 = scores.reshape(self.shape_2d)
      if blockwise == "norm":
        return (_block_reduce(x2 * x2, self.spec.block_shape) ** 0.5).reshape(-1)
      return _block_reduce(x2, self.spec.block_shape).reshape(-1)
    return scores.reshape(-1)

  def unit_mask(self, mask: jax.Array) -> jax.Array:
    """Flat bool per unit of an element mask (a block is kept if any of its weights is)."""
    if isinstance(self.spec, BlockSparse):
      m2 = mask.reshape(self.shape_2d).astype(jnp.int32)
      return (_block_reduce(m2, self.spec.block_shape) > 0).reshape(-1)
    return mask.reshape(-1)

  def expand(self, units: jax.Array) -> jax.Array:
    """Element mask of the leaf's shape from a flat unit mask."""
    if isinstance(self.spec, BlockSparse):
      k, n = self.shape_2d
      bk, bn = self.spec.block_shape
      blocks = units.reshape(k // bk, n // bn)
      return jnp.repeat(jnp.repeat(blocks, bk, axis=0), bn, axis=1).reshape(self.shape)
    return units.reshape(self.shape)


def frozen_rules(rules: Any) -> Any:
  """``rules`` checked now (:func:`~jaxsparse._rules.resolve_rules`: structures, regex keys) and copied, for a factory
  that applies them later (a pruner's ``init``): a bad rule fails where the pruner is built, and later changes to
  the caller's dict do not change the pruner."""
  resolve_rules(rules)
  return dict(rules) if isinstance(rules, Mapping) else rules


def tied_paths(tree: Any) -> dict[str, list[str]] | None:
  """``{path: every path of that layer}`` for the layers an ``nnx.Module`` holds at several paths (tied: ``self.b =
  self.a``), as :func:`jaxsparse.sparsify` finds them; ``None`` for another tree, whose ties cannot be seen (an
  ``nnx.State`` holds a tied layer once, at its first path)."""
  if not isinstance(tree, nnx.Module):
    return None
  tied = [[path_str(p) for p in paths] for paths in module_paths(tree).values() if len(paths) > 1]
  return {p: paths for paths in tied for p in paths}


def plan(
    tree: Any, rules: Any, *, views: Views | None = None, warn: bool = True, tied: Mapping[str, list[str]] | None = None
) -> tuple[list[str], list[Any], Any, list[Target]]:
  """Flattens ``tree`` and gives each leaf with ``ndim >= 2`` (not a ``bias``) the structure of its first matching rule.

  A leaf not named ``kernel`` (an ``embedding`` table, a positional ``nnx.Param``) takes it only when that rule
  matches no ``kernel`` leaf nor its layer: catch-all rules pass it by, as :func:`jaxsparse.sparsify` passes
  embeddings by (so a tree of raw arrays without kernels, ``{"w": ...}``, is pruned as before).

  A leaf's 2-D view takes its input axes from the first pattern of ``views`` that matches it (as rules
  match), else from its layer's bias (:func:`~jaxsparse._rules.kernel_in_ndim`). Raises ``ValueError``
  naming the path when a structure (or a given view) cannot apply to a leaf, and (``warn``) warns about
  rules and views that matched no leaf.

  ``tied`` (:func:`tied_paths`, default: those of ``tree`` if it is an ``nnx.Module``) gives every path of a layer
  held at several paths: as in :func:`jaxsparse.sparsify`, its leaves take the one structure the rules give its paths
  (a ``ValueError`` naming them when they give different ones).
  """
  tied = tied_paths(tree) if tied is None else tied
  resolved = resolve_rules(rules)
  resolved_views = resolve_views(views)
  paths, leaves, treedef = flatten_with_paths(tree)
  biases = {path.rpartition(".")[0]: tuple(getattr(leaf, "shape", ())) for path, leaf in zip(paths, leaves, strict=True)
            if path.rpartition(".")[2] == "bias"}
  kernels = [q for path, leaf in zip(paths, leaves, strict=True) if path.rpartition(".")[2] == "kernel"
             and len(getattr(leaf, "shape", ())) >= 2 for q in (path, path.rpartition(".")[0]) if q]
  def rule_of(path: str, owner: str, name: str) -> int | None:
    r = match_rules(resolved, path, owner=owner)
    if r is None or resolved[r][2] is None or (name != "kernel" and any(resolved[r][1].fullmatch(q) for q in kernels)):
      return None  # a rule that also matches kernels passes other parameters (embeddings) by, as sparsify does
    return r

  targets, available = [], []
  for i, (path, leaf) in enumerate(zip(paths, leaves, strict=True)):
    shape = tuple(getattr(leaf, "shape", ()))
    owner, _, name = path.rpartition(".")
    if len(shape) < 2 or name == "bias":  # biases are not kernels (a 2-D attention bias neither)
      continue
    owners = (tied or {}).get(owner, [owner])  # a tied layer: every path it is held at, as sparsify matches them
    available += [q for o in owners for q in ((o, f"{o}.{name}") if o else (name,))]
    chosen = {f"{o}.{name}" if o else name: rule_of(f"{o}.{name}" if o else name, o, name) for o in owners}
    chosen = {q: r for q, r in chosen.items() if r is not None}
    if len({resolved[r][2] for r in chosen.values()}) > 1:
      raise ValueError(
          f"{path}: one layer held at several paths (tied) gets different structures from the rules: "
          f"{', '.join(f'{q}: {resolved[r][2].describe()}' for q, r in chosen.items())}. Give its paths one structure."
      )
    if not chosen:
      continue
    r = next(iter(chosen.values()))
    spec = resolved[r][2]
    v = match_rules(resolved_views, path, owner=owner)
    if v is None:
      in_ndim = kernel_in_ndim(shape, biases.get(owner))
    else:
      pattern, _, in_ndim = resolved_views[v]
      if not 0 < in_ndim < len(shape):
        raise ValueError(
            f"{path}: views[{pattern!r}] = {in_ndim} input axes do not fit its {shape} kernel; a view needs at "
            f"least one input and one output axis (1 to {len(shape) - 1} here)."
        )
    # An embedding table's N:M groups run along its features, as sparsify's CompressedNMEmbed keeps them.
    table = name == "embedding" and len(shape) == 2 and isinstance(spec, NM)
    if table and shape[1] % spec.m:
      raise ValueError(
          f"{path}: N:M sparsity {spec.n}:{spec.m} needs m={spec.m} to divide the features {shape[1]} of its {shape} "
          f"embedding table (the groups run along the features); choose another m or give this path another rule."
      )
    if not table:
      check_spec_applies(spec, shape, path=path, in_ndim=in_ndim)
    check_plain_nm(spec, path=path, what="jaxsparse.pruning")
    targets.append(Target(i, path, shape, spec, r, in_ndim, table))
  if warn:
    # Parameters (an nnx.State: what nnx.Optimizer hands an optax pruner) hold a tied layer once, at its first path.
    hint = "" if tied is not None else (
        "; if it names another path of a layer held at several paths (tied), the parameters hold that layer once, at "
        "its first path: check the rules on the model, pruning.magnitude_masks(model, rules), which raises when a "
        "tied layer's paths get different structures")
    warn_unmatched(resolved, available, what=f"parameter with 2 or more axes (nor the layer holding it){hint}")
    warn_unmatched(resolved_views, available, what="parameter with 2 or more axes (nor the layer holding it)",
                   kind="view(s)")
  return paths, leaves, treedef, targets


def masks_at(
    leaves: Sequence[Any],
    targets: Sequence[Target],
    sparsity: Any,
    *,
    scope: str = "layer",
    prior: Sequence[jax.Array | None] | None = None,
    scores: Sequence[jax.Array] | None = None,
) -> list[jax.Array]:
  """One element mask per target at a (possibly traced) sparsity.

  Args:
    leaves: the flattened parameters.
    targets: from :func:`plan`.
    sparsity: callable ``spec -> sparsity`` (in the units of the spec: blocks for ``BlockSparse``),
      evaluated once per rule.
    scope: ``"layer"`` (each leaf keeps its own count) or ``"global"`` (one threshold over all leaves
      of the same rule, each ``BlockSparse`` leaf keeping at least its best block; ``NM`` rules are always per
      group).
    prior: element masks currently in force (per target); a pruned unit only comes back when the
      count grows.
    scores: per-target scores of the leaf's shape; default ``|w|`` with blocks scored by their norm.

  Returns:
    One bool mask per target, of its leaf's shape (split like the leaf where explicit mesh axes split it: the
    ranking gathers leaves, scores and prior masks, as JAX refuses to reshape or sort split dims).
  """
  check_scope(scope)
  whole = lambda a: replicated(a) if isinstance(a, jax.Array) else a
  unit_scores, unit_prior = [], []
  for j, t in enumerate(targets):
    if scores is None:
      s = t.unit_scores(magnitude_scores(whole(leaves[t.index])))
    else:
      s = t.unit_scores(whole(jnp.asarray(scores[j])), blockwise="sum")
    p = None if prior is None or prior[j] is None else t.unit_mask(whole(prior[j]))
    if p is not None:
      s = jnp.where(p, s, -jnp.inf)
    unit_scores.append(s)
    unit_prior.append(p)

  out: list[jax.Array | None] = [None] * len(targets)
  groups: dict[int, list[int]] = {}
  for j, t in enumerate(targets):
    s_t = sparsity(t.spec)
    if isinstance(t.spec, NM):
      out[j] = _nm_at(t, unit_scores[j], s_t)
    elif scope == "layer":
      out[j] = t.expand(rank_mask(unit_scores[j], kept_at(t.units, t.kept_final, s_t, t.spec.target_sparsity)))
    else:
      groups.setdefault(t.rule, []).append(j)
  for members in groups.values():
    spec = targets[members[0]].spec
    total = sum(targets[j].units for j in members)
    member_scores = [unit_scores[j] for j in members]
    if isinstance(spec, BlockSparse):
      kept_final = _utils.kept_count(spec.density, total)
      # A block-sparse layer needs a block (jaxsparse.sparsify builds none from an empty block mask): each layer's
      # best block ranks first, and the count grows to one block per layer if it must.
      member_scores = [s.at[jnp.argmax(s)].set(jnp.inf) for s in member_scores]
    else:
      kept_final = total - _utils.kept_count(spec.sparsity, total)
    kept = kept_at(total, kept_final, sparsity(spec), spec.target_sparsity)
    if isinstance(spec, BlockSparse):
      kept = jnp.maximum(kept, len(members))
    joint = rank_mask(jnp.concatenate(member_scores), kept)
    start = 0
    for j in members:
      u = targets[j].units
      out[j] = targets[j].expand(joint[start:start + u])
      start += u
  return [m if not isinstance(leaves[t.index], jax.Array) else split_like(m, leaves[t.index])
          for m, t in zip(out, targets, strict=True)]


def _nm_at(t: Target, unit_scores: jax.Array, sparsity: jax.typing.ArrayLike) -> jax.Array:
  n, m = t.spec.n, t.spec.m
  s = jnp.asarray(sparsity, jnp.float32)
  n_t = jnp.where(s >= jnp.float32(t.spec.target_sparsity), n, jnp.clip(m - jnp.floor(s * m + 0.5), n, m))
  if t.table:  # the groups along the features: the table's attend kernel (features, num_embeddings)
    return group_rank_mask(unit_scores.reshape(t.shape).T, n_t, m).T
  return group_rank_mask(unit_scores.reshape(t.shape_2d), n_t, m).reshape(t.shape)


def check_scope(scope: object) -> str:
  if scope not in ("layer", "global"):
    raise ValueError(f"scope must be 'layer' or 'global', got scope={scope!r}.")
  return scope


def unflatten_masks(treedef: Any, n_leaves: int, targets: Sequence[Target], masks: Sequence[jax.Array]) -> Any:
  """The mask tree: the mask of each target at its leaf, ``None`` elsewhere."""
  leaves: list[Any] = [None] * n_leaves
  for t, m in zip(targets, masks, strict=True):
    leaves[t.index] = m
  return jax.tree_util.tree_unflatten(treedef, leaves)


def target_masks(masks: Any, treedef: Any, targets: Sequence[Target]) -> list[jax.Array | None]:
  """The masks of ``targets`` read back from a mask tree with the parameters' structure."""
  flat = treedef.flatten_up_to(masks)
  return [None if flat[t.index] is None else jnp.asarray(flat[t.index]) for t in targets]


def magnitude_masks(
    params: Any, rules: Any, *, scope: str = "layer", scores: Any = None, views: Views | None = None
) -> Any:
  """Masks keeping the largest-magnitude weights (or blocks, or N of every M) of matched parameters.

  >>> import jax, jaxsparse
  >>> from jaxsparse import pruning
  >>> params = {"fc": {"kernel": jax.random.normal(jax.random.key(0), (8, 4)), "bias": jax.numpy.zeros(4)}}
  >>> masks = pruning.magnitude_masks(params, jaxsparse.Unstructured(sparsity=0.75))
  >>> int(masks["fc"]["kernel"].sum()), masks["fc"]["bias"]
  (8, None)
  >>> masks = pruning.magnitude_masks(params, {r".*fc.*": jaxsparse.NM(2, 4)})
  >>> masks["fc"]["kernel"].reshape(2, 4, 4).sum(axis=1).tolist()
  [[2, 2, 2, 2], [2, 2, 2, 2]]

  Args:
    params: a parameter pytree (Linen ``params``, an NNX ``nnx.State``, or an ``nnx.Module``, whose
      ``nnx.Param`` state is used). Only leaves with 2 or more axes are pruned; blocks and N:M groups
      are taken on a leaf's 2-D ``(in, out)`` view (see ``views``).
    rules: one structure (``jaxsparse.Unstructured``, ``BlockSparse`` or ``NM``) for every such leaf,
      or ``{regex: structure or None}``. A pattern matches a leaf when it fully matches its dotted
      path (``"layers.0.kernel"``) or the path of the layer holding it (``"layers.0"``), so the
      rules of :func:`jaxsparse.sparsify` work unchanged; the first match wins and ``None`` keeps
      the leaf dense. As in sparsify, a leaf not named ``kernel`` (an embedding table ``embed.embedding``, a 2-D
      ``nnx.Param``) is pruned only by a rule that matches no ``kernel`` (nor its layer), such as ``r"embed"``;
      a catch-all rule like ``r".*"`` passes it by when the tree holds kernels. Under ``NM`` an embedding table
      keeps ``n`` of every ``m`` features of each row, the groups sparsify's ``CompressedNMEmbed`` keeps. A layer that
      an ``nnx.Module`` holds at several paths (tied: ``self.b = self.a``) takes the one structure the rules give its
      paths, as in sparsify, and different ones raise a ``ValueError``; an ``nnx.State`` holds it once, at its first
      path, so only the module shows the rules of its other paths.
    scope: ``"layer"``: each leaf keeps its own fraction; ``"global"``: one threshold over all
      leaves of the same rule, so layers end up with different sparsities (``NM`` is per group). Under a
      ``BlockSparse`` rule every leaf keeps at least its best block, which :func:`jaxsparse.sparsify` needs to
      build the layer (so a rule over more layers than it keeps blocks keeps one block per layer, above its
      density); an ``Unstructured`` leaf may lose all its weights.
    scores: optional tree like ``params`` (the same paths) of real per-weight scores (higher is kept) used instead
      of ``|w|``, each of its parameter's shape (``ValueError`` otherwise; ``TypeError`` for complex ones); a block
      then scores the sum of its weights' scores. Scores rank in float32, float64 ones in float64.
    views: ``{regex: input axes}``: the number of leading input axes of the kernels a pattern matches
      (matched like ``rules``, first match wins), so that blocks and N:M groups are taken on the 2-D view
      :func:`jaxsparse.sparsify` uses. Without one, a kernel whose layer has a bias of ``d`` axes has ``d``
      output axes (an attention q/k/v ``(in, heads, head_dim)`` with its ``(heads, head_dim)`` bias), any
      other every axis but the last as inputs; a bias-free ``MultiHeadAttention`` needs
      :func:`kernel_views` of the model here. A given view wins over the bias.

  Returns:
    A tree with the structure of ``params``: bool masks (True = kept) for pruned leaves, ``None``
    for the others.
  """
  paths, leaves, treedef, targets = plan(_params_of(params), rules, views=views, tied=tied_paths(params))
  params = _params_of(params)
  score_list = None
  if scores is not None:
    score_list = _target_scores(_params_of(scores), paths, targets)
  check_scope(scope)
  # One compiled computation is much cheaper than dispatching its dozens of small ops one by one.
  compute = jax.jit(
      lambda leaves, s: masks_at(leaves, targets, lambda spec: spec.target_sparsity, scope=scope, scores=s)
  )
  return unflatten_masks(treedef, len(leaves), targets, compute(leaves, score_list))


def _target_scores(scores: Any, paths: Sequence[str], targets: Sequence[Target]) -> list[Any]:
  """The score array of each target, checked: ``scores`` must have the parameters' paths and each target's shape."""
  score_paths, score_leaves, _ = flatten_with_paths(scores)
  if list(score_paths) != list(paths):
    missing, extra = sorted(set(paths) - set(score_paths)), sorted(set(score_paths) - set(paths))
    raise ValueError(
        f"scores must have the structure of params (the same paths): missing {missing[:8]}, extra {extra[:8]}"
        + ("." if missing or extra else f"; got the paths in another order: {list(score_paths)[:8]}.")
    )
  out = []
  for t in targets:
    shape = tuple(np.shape(score_leaves[t.index]))
    if shape != t.shape:
      hint = " (transposed? torch lays weights out (out, in), Flax (in, out))" if shape == t.shape[::-1] else ""
      raise ValueError(
          f"{t.path}: scores must have the parameter's shape; got scores of shape {shape} for a parameter of shape "
          f"{t.shape}{hint}."
      )
    dtype = jnp.asarray(score_leaves[t.index]).dtype
    if not any(jnp.issubdtype(dtype, kind) for kind in (jnp.floating, jnp.integer, jnp.bool_)):
      raise TypeError(f"{t.path}: scores must be real (higher is kept), got dtype {dtype}.")
    out.append(score_leaves[t.index])
  return out


def _params_of(tree: Any) -> Any:
  if isinstance(tree, nnx.Module):
    return nnx.state(tree, nnx.Param)
  return tree
