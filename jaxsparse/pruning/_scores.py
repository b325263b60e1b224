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

import flax.linen as nn
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
from jaxsparse.pruning._apply import is_box
from jaxsparse.pruning._compressed import known_stored_values
from jaxsparse.pruning._compressed import stored_value_paths
from jaxsparse.pruning._compressed import stored_values_error
from jaxsparse.pruning._layer_masks import LayerMasks
from jaxsparse.pruning._layer_masks import allowed_units
from jaxsparse.pruning._layer_masks import check_layer_masks
from jaxsparse.pruning._layer_masks import resolve_layer_masks
from jaxsparse.pruning._stacks import Stacks
from jaxsparse.pruning._stacks import nnx_stacks
from jaxsparse.pruning._stacks import resolve_stacks
from jaxsparse.pruning._stacks import stack_of

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
  """Sums of the ``(bk, bn)`` blocks of the last two axes of ``x2`` (``(..., K, N)`` -> ``(..., K // bk, N // bn)``)."""
  *lead, k, n = x2.shape
  bk, bn = block_shape
  return jnp.sum(x2.reshape(*lead, k // bk, bk, n // bn, bn), axis=(-3, -1))


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
  """One pruned leaf: its position among the flattened leaves, path, shape and structure.

  A stack of layers (``stack`` leading layer axes, ``nnx.vmap`` / ``nn.scan``) is pruned per layer: its units,
  counts and 2-D view are those of one layer, and its unit arrays are ``(layers, units)``.
  """

  index: int
  path: str
  shape: tuple[int, ...]
  spec: Spec
  rule: int
  in_ndim: int | None = None  # leading input axes of the 2-D view (matrix_shape); None: all but the last
  table: bool = False  # an embedding table (num_embeddings, features): N:M groups run along its features
  stack: int = 0  # leading layer axes (a stack of layers): each layer slice is pruned on its own

  @property
  def layers(self) -> int:
    """Number of layers of the stack (1 for a leaf that is not one)."""
    return math.prod(self.shape[: self.stack])

  @property
  def layer_shape(self) -> tuple[int, ...]:
    """One layer's shape: the leaf's without its leading layer axes."""
    return self.shape[self.stack :]

  @property
  def shape_2d(self) -> tuple[int, int]:
    """One layer viewed as ``(in, out)``, as sparsify and torch_interop view its layer's kernel."""
    return matrix_shape(self.layer_shape, self.in_ndim)

  @property
  def units(self) -> int:
    """Number of units of one layer that are kept or pruned together: weights, or blocks."""
    if isinstance(self.spec, BlockSparse):
      k, n = self.shape_2d
      bk, bn = self.spec.block_shape
      return (k // bk) * (n // bn)
    return math.prod(self.layer_shape)

  @property
  def kept_final(self) -> int:
    """Units of one layer kept at the structure's target sparsity, with the counting rules of the layers."""
    if isinstance(self.spec, BlockSparse):
      return _utils.kept_count(self.spec.density, self.units)
    if isinstance(self.spec, NM):
      return self.units // self.spec.m * self.spec.n
    return self.units - _utils.kept_count(self.spec.sparsity, self.units)

  def unit_scores(self, scores: jax.Array, *, blockwise: str = "norm") -> jax.Array:
    """Scores per unit, ``(layers, units)``. ``blockwise``: ``"norm"`` (Frobenius norm of the block) or ``"sum"``."""
    scores = scores.astype(_utils.accumulation_dtype(scores.dtype))  # float32, float64 kept
    if isinstance(self.spec, BlockSparse):
      x2 = scores.reshape(self.layers, *self.shape_2d)
      if blockwise == "norm":
        return (_block_reduce(x2 * x2, self.spec.block_shape) ** 0.5).reshape(self.layers, -1)
      return _block_reduce(x2, self.spec.block_shape).reshape(self.layers, -1)
    return scores.reshape(self.layers, -1)

  def unit_mask(self, mask: jax.Array) -> jax.Array:
    """Bool per unit of an element mask, ``(layers, units)`` (a block is kept if any of its weights is)."""
    if isinstance(self.spec, BlockSparse):
      m2 = mask.reshape(self.layers, *self.shape_2d).astype(jnp.int32)
      return (_block_reduce(m2, self.spec.block_shape) > 0).reshape(self.layers, -1)
    return mask.reshape(self.layers, -1)

  def expand(self, units: jax.Array) -> jax.Array:
    """Element mask of the leaf's shape from a unit mask ``(layers, units)``."""
    if isinstance(self.spec, BlockSparse):
      k, n = self.shape_2d
      bk, bn = self.spec.block_shape
      blocks = units.reshape(self.layers, k // bk, n // bn)
      return jnp.repeat(jnp.repeat(blocks, bk, axis=1), bn, axis=2).reshape(self.shape)
    return units.reshape(self.shape)


def frozen_rules(rules: Any) -> Any:
  """``rules`` checked now (:func:`~jaxsparse._rules.resolve_rules`: structures, regex keys) and copied, for a factory
  that applies them later (a pruner's ``init``): a bad rule fails where the pruner is built, and later changes to
  the caller's dict do not change the pruner."""
  resolve_rules(rules)
  return dict(rules) if isinstance(rules, Mapping) else rules


def tied_paths(tree: Any) -> dict[str, list[str]] | None:
  """``{path: every path of that layer}`` for the layers an NNX object (an ``nnx.Module``, an ``nnx.Optimizer`` that
  holds one) holds at several paths (tied: ``self.b = self.a``), as :func:`jaxsparse.sparsify` finds them; ``None`` for
  another tree, whose ties cannot be seen (an ``nnx.State`` holds a tied layer once, at its first path)."""
  if not isinstance(tree, nnx.Pytree):
    return None
  tied = [[path_str(p) for p in paths] for paths in module_paths(tree).values() if len(paths) > 1]
  return {p: paths for paths in tied for p in paths}


def params_of(tree: Any) -> Any:
  """The parameters the pruners rank: an NNX object's ``nnx.Param`` state (each array once, a tied layer at its first
  path; an optimizer's own state left out), a tree of Linen boxes (``nn.Partitioned``, kept boxed in a ``TrainState``)
  unboxed; any other tree as it is."""
  if isinstance(tree, nnx.Pytree):
    params = nnx.state(tree, nnx.Param)
    if isinstance(tree, nnx.Optimizer) and not jax.tree.leaves(params):
      raise TypeError(
          "params is an nnx.Optimizer, which holds no nnx.Param (it keeps its own state, not the model's parameters): "
          "pass the model (an nnx.ModelAndOptimizer's .model), or the masks of pruning.get_masks(optimizer).")
    return params
  if any(is_box(x) for x in jax.tree.leaves(tree, is_leaf=is_box)):
    return nn.meta.unbox(tree)
  return tree


def plan(
    tree: Any, rules: Any, *, views: Views | None = None, stacks: Any = None, warn: bool = True
) -> tuple[list[str], list[Any], Any, list[Target]]:
  """Flattens ``tree`` and gives each leaf with ``ndim >= 2`` (not a ``bias``) the structure of its first matching rule.

  ``tree`` is read by :func:`params_of` (an NNX object's ``nnx.Param`` state, Linen boxes unboxed): the returned
  ``treedef`` is that of the parameters, which the mask tree takes. Only ``nnx.Param`` variables are pruned (not an
  optimizer's ``OptState``, not a layer's ``SparsityPattern``, in an ``nnx.State`` that holds them).

  A leaf not named ``kernel`` (an ``embedding`` table, a positional ``nnx.Param``) takes it only when that rule
  matches no ``kernel`` leaf nor its layer: catch-all rules pass it by, as :func:`jaxsparse.sparsify` passes
  embeddings by (so a tree of raw arrays without kernels, ``{"w": ...}``, is pruned as before).

  A leaf's leading layer axes (a stack of layers, pruned per layer) are those of the first pattern of ``stacks``
  that matches it, else those read off ``tree`` when it is an NNX object (``_stacks.nnx_stacks``), else none. One
  layer's 2-D view takes its input axes from the first pattern of ``views`` that matches it (as rules match), else
  from its layer's bias (:func:`~jaxsparse._rules.kernel_in_ndim`). Raises ``ValueError`` naming the path when a
  structure (or a given view or stack) cannot apply to a leaf, and (``warn``) warns about rules, views and stacks that
  matched no leaf, and about kernels that look stacked (a bias with the kernel's leading axis) but are not known to be.

  A layer that an NNX object holds at several paths (:func:`tied_paths`): as in :func:`jaxsparse.sparsify`, its leaves
  take the one structure the rules give its paths (a ``ValueError`` naming them when they give different ones).
  A rule that matches the stored values of an N:M-compressed layer or the kept blocks of a block-sparse layer
  (:func:`~jaxsparse.pruning._compressed.stored_value_paths`) raises a ``ValueError`` naming the path.
  """
  tied = tied_paths(tree)
  found_stacks = nnx_stacks(tree)
  stored = {**stored_value_paths(tree), **known_stored_values()}  # known: read by pruning.wrap_optax before unboxing
  tree = params_of(tree)
  resolved = resolve_rules(rules)
  resolved_views = resolve_views(views)
  resolved_stacks = resolve_stacks(stacks)
  paths, leaves, treedef = flatten_with_paths(tree)
  not_params = {i for i, v in enumerate(jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable)))
                if isinstance(v, nnx.Variable) and not isinstance(v, nnx.Param)}
  biases = {path.rpartition(".")[0]: tuple(getattr(leaf, "shape", ())) for path, leaf in zip(paths, leaves, strict=True)
            if path.rpartition(".")[2] == "bias"}
  kernels = [q for path, leaf in zip(paths, leaves, strict=True) if path.rpartition(".")[2] == "kernel"
             and len(getattr(leaf, "shape", ())) >= 2 for q in (path, path.rpartition(".")[0]) if q]
  def rule_of(path: str, owner: str, name: str) -> int | None:
    r = match_rules(resolved, path, owner=owner)
    if r is None or resolved[r][2] is None or (name != "kernel" and any(resolved[r][1].fullmatch(q) for q in kernels)):
      return None  # a rule that also matches kernels passes other parameters (embeddings) by, as sparsify does
    return r

  targets, available, look_stacked = [], [], []
  for i, (path, leaf) in enumerate(zip(paths, leaves, strict=True)):
    shape = tuple(getattr(leaf, "shape", ()))
    owner, _, name = path.rpartition(".")
    if len(shape) < 2 or name == "bias" or i in not_params:  # biases are not kernels (a 2-D attention bias neither)
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
    if path in stored:
      raise stored_values_error(path, stored[path], shape, f"rule {resolved[r][0]!r} ({spec.describe()})")
    stack = stack_of(resolved_stacks, found_stacks, path, owner)
    if stack is not None and stack > len(shape) - 2:
      raise ValueError(
          f"{path}: {stack} leading layer axes (stacks) leave its {shape} parameter fewer than 2 axes per layer; "
          f"give it 0 to {len(shape) - 2} layer axes."
      )
    bias = biases.get(owner)
    if stack is None and name == "kernel" and bias is not None and len(shape) >= 3 and len(bias) >= 2 \
        and bias[0] == shape[0] and kernel_in_ndim(shape, bias) is None:
      look_stacked.append(f"{path} {shape} beside a bias {bias}")
    stack = stack or 0
    if stack and bias is not None and bias[:stack] == shape[:stack]:
      bias = bias[stack:]
    layer_shape = shape[stack:]
    v = match_rules(resolved_views, path, owner=owner)
    if v is None:
      in_ndim = kernel_in_ndim(layer_shape, bias)
    else:
      pattern, _, in_ndim = resolved_views[v]
      if not 0 < in_ndim < len(layer_shape):
        raise ValueError(
            f"{path}: views[{pattern!r}] = {in_ndim} input axes do not fit its {layer_shape} kernel; a view needs at "
            f"least one input and one output axis (1 to {len(layer_shape) - 1} here)."
        )
    # An embedding table's N:M groups run along its features, as sparsify's CompressedNMEmbed keeps them.
    table = name == "embedding" and len(layer_shape) == 2 and isinstance(spec, NM)
    if table and layer_shape[1] % spec.m:
      raise ValueError(
          f"{path}: N:M sparsity {spec.n}:{spec.m} needs m={spec.m} to divide the features {layer_shape[1]} of its "
          f"{layer_shape} embedding table (the groups run along the features); choose another m or give this path "
          "another rule."
      )
    if not table:
      check_spec_applies(spec, layer_shape, path=path, in_ndim=in_ndim)
    check_plain_nm(spec, path=path, what="jaxsparse.pruning")
    targets.append(Target(i, path, shape, spec, r, in_ndim, table, stack))
  if warn:
    # Parameters (an nnx.State: what nnx.Optimizer hands an optax pruner) hold a tied layer once, at its first path.
    hint = "" if tied is not None else (
        "; if it names another path of a layer held at several paths (tied), the parameters hold that layer once, at "
        "its first path: check the rules on the model, pruning.magnitude_masks(model, rules), which raises when a "
        "tied layer's paths get different structures")
    warn_unmatched(resolved, available, what=f"parameter with 2 or more axes (nor the layer holding it){hint}")
    for kind, given in (("view(s)", resolved_views), ("stacks", resolved_stacks)):
      warn_unmatched(given, available, what="parameter with 2 or more axes (nor the layer holding it)", kind=kind)
    if look_stacked:
      _utils.warn_at_caller(
          f"{', '.join(look_stacked)}: each looks like a stack of layers (nnx.vmap, nn.scan; its bias has the "
          "kernel's leading axis), which the pruners cannot see in bare parameters: it is pruned as one parameter, "
          "all its layers ranked together (one layer may end dense, another empty). To prune each layer to the "
          "rule's sparsity, pass stacks=pruning.layer_stacks(model) (or {regex: leading layer axes}); "
          "stacks={regex: 0} prunes it whole without this warning.", UserWarning)
  return paths, leaves, treedef, targets


def masks_at(
    leaves: Sequence[Any],
    targets: Sequence[Target],
    sparsity: Any,
    *,
    scope: str = "layer",
    prior: Sequence[jax.Array | None] | None = None,
    scores: Sequence[jax.Array] | None = None,
    allowed: Sequence[jax.Array | None] | None = None,
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
    allowed: per target, the units its layer's own mask can carry (``(layers, units)`` bool, from
      :func:`~jaxsparse.pruning._layer_masks.allowed_units`) or ``None``: only those are kept, at most all of them
      (``NM`` targets have ``None``).

  Returns:
    One bool mask per target, of its leaf's shape (split like the leaf where explicit mesh axes split it: the
    ranking gathers leaves, scores and prior masks, as JAX refuses to reshape or sort split dims).
  """
  check_scope(scope)
  whole = lambda a: replicated(a) if isinstance(a, jax.Array) else a
  allowed = [None] * len(targets) if allowed is None else list(allowed)
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
    elif scope == "layer" and allowed[j] is None:  # each layer of a stack keeps its own count
      kept = kept_at(t.units, t.kept_final, s_t, t.spec.target_sparsity)
      out[j] = t.expand(jax.vmap(lambda s, kept=kept: rank_mask(s, kept))(unit_scores[j]))
    elif scope == "layer":  # only among the units its layer's own mask can carry
      kept = kept_at(t.units, t.kept_final, s_t, t.spec.target_sparsity)
      out[j] = t.expand(jax.vmap(lambda s, a, kept=kept: rank_mask(s, kept, among=a))(unit_scores[j], allowed[j]))
    else:
      groups.setdefault(t.rule, []).append(j)
  for members in groups.values():  # global: every layer of every leaf of the rule, stacks included, ranked together
    spec = targets[members[0]].spec
    total = sum(targets[j].layers * targets[j].units for j in members)
    member_scores = [unit_scores[j] if allowed[j] is None else jnp.where(allowed[j], unit_scores[j], -jnp.inf)
                     for j in members]
    if isinstance(spec, BlockSparse):
      kept_final = _utils.kept_count(spec.density, total)
      # A block-sparse layer needs a block (jaxsparse.sparsify builds none from an empty block mask): each layer's
      # best block ranks first, and the count grows to one block per layer if it must.
      member_scores = [s.at[jnp.arange(s.shape[0]), jnp.argmax(s, axis=1)].set(jnp.inf) for s in member_scores]
    else:
      kept_final = total - _utils.kept_count(spec.sparsity, total)
    kept = kept_at(total, kept_final, sparsity(spec), spec.target_sparsity)
    if isinstance(spec, BlockSparse):
      kept = jnp.maximum(kept, sum(targets[j].layers for j in members))
    if all(allowed[j] is None for j in members):
      joint = rank_mask(jnp.concatenate([s.reshape(-1) for s in member_scores]), kept)
    else:
      among = jnp.concatenate([jnp.ones(s.size, bool) if allowed[j] is None else allowed[j].reshape(-1)
                               for j, s in zip(members, member_scores, strict=True)])
      joint = rank_mask(jnp.concatenate([s.reshape(-1) for s in member_scores]), kept, among=among)
    start = 0
    for j in members:
      t = targets[j]
      size = t.layers * t.units
      out[j] = t.expand(joint[start:start + size].reshape(t.layers, t.units))
      start += size
  return [m if not isinstance(leaves[t.index], jax.Array) else split_like(m, leaves[t.index])
          for m, t in zip(out, targets, strict=True)]


def _nm_at(t: Target, unit_scores: jax.Array, sparsity: jax.typing.ArrayLike) -> jax.Array:
  n, m = t.spec.n, t.spec.m
  s = jnp.asarray(sparsity, jnp.float32)
  n_t = jnp.where(s >= jnp.float32(t.spec.target_sparsity), n, jnp.clip(m - jnp.floor(s * m + 0.5), n, m))
  one_layer = lambda scores2: group_rank_mask(scores2, n_t, m)
  if t.table:  # the groups along the features: the table's attend kernel (features, num_embeddings)
    scores = jnp.swapaxes(unit_scores.reshape(t.layers, *t.layer_shape), 1, 2)
    return jnp.swapaxes(jax.vmap(one_layer)(scores), 1, 2).reshape(t.shape)
  return jax.vmap(one_layer)(unit_scores.reshape(t.layers, *t.shape_2d)).reshape(t.shape)


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
    params: Any, rules: Any, *, scope: str = "layer", scores: Any = None, views: Views | None = None,
    stacks: Stacks | None = None, layer_masks: LayerMasks | None = None,
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
    params: a parameter pytree (Linen ``params``, boxed in ``nn.Partitioned`` or not, an NNX ``nnx.State``, or an
      ``nnx.Module`` or ``nnx.ModelAndOptimizer``, whose ``nnx.Param`` state is used: each array once, the
      optimizer's own state left out). Only leaves with 2 or more axes are pruned, and in an ``nnx.State`` only
      ``nnx.Param`` variables; blocks and N:M groups are taken on a leaf's 2-D ``(in, out)`` view (see ``views``),
      per layer of a stack (see ``stacks``). Linen boxes are read through: the masks are plain arrays in place of
      the boxes (``jax.tree.structure(nn.meta.unbox(params))``).
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
      path, so only the module (or an ``nnx.ModelAndOptimizer`` holding it) shows the rules of its other paths.
    scope: ``"layer"``: each leaf, and each layer of a stack, keeps its own fraction; ``"global"``: one threshold
      over all leaves of the same rule and all layers of their stacks (ranked together by design), so layers end up
      with different sparsities (``NM`` is per group). Under a ``BlockSparse`` rule every layer keeps at least its
      best block, which :func:`jaxsparse.sparsify` needs to build the layer (so a rule over more layers than it
      keeps blocks keeps one block per layer, above its density); an ``Unstructured`` layer may lose all its
      weights.
    scores: optional tree like ``params`` (the same paths) of real per-weight scores (higher is kept) used instead
      of ``|w|``, each of its parameter's shape (``ValueError`` otherwise; ``TypeError`` for complex ones); a block
      then scores the sum of its weights' scores. Scores rank in float32, float64 ones in float64.
    views: ``{regex: input axes}``: the number of leading input axes of the kernels a pattern matches
      (matched like ``rules``, first match wins), so that blocks and N:M groups are taken on the 2-D view
      :func:`jaxsparse.sparsify` uses. Without one, a kernel whose layer has a bias of ``d`` axes has ``d``
      output axes (an attention q/k/v ``(in, heads, head_dim)`` with its ``(heads, head_dim)`` bias), any
      other every axis but the last as inputs; a bias-free ``MultiHeadAttention`` needs
      :func:`kernel_views` of the model here. A given view wins over the bias. A view counts one layer's axes.
    stacks: ``{regex: leading layer axes}`` of stacked parameters (a stack of ``L`` layers built by ``nnx.vmap`` or
      ``nn.scan`` holds a kernel ``(L, K, N)``: 1 layer axis), matched like ``rules``: each layer slice is pruned on
      its own, to the rule's sparsity (its own blocks, N:M groups and count), as ``L`` separate layers would be;
      ``0`` prunes the parameter whole. An ``nnx.Module`` tells its stacks itself (each layer's fields give its
      kernel's rank; these win); bare parameters (Linen ``params``, an ``nnx.State``) do not: pass
      :func:`layer_stacks` of the model. A kernel that looks stacked (a bias ``(L, N)`` beside a kernel
      ``(L, K, N)``) but is not known to be warns.
    layer_masks: ``{parameter path: bool mask}`` of the layers with a mask of their own (``MaskedLinear``,
      ``MaskedConv``, Linen ``MaskedDense``: :func:`layer_masks`): their weights are ranked inside that mask only, and
      a rule looser than its layer keeps the layer's own weights (and warns), so the masks tell what the model keeps.
      An ``nnx.Module`` tells them itself (given ones win); bare parameters do not: pass :func:`layer_masks` of the
      model (Linen: of its variables). Not for ``NM`` rules (a pattern keeps ``n`` of every ``m``).

  Returns:
    A tree with the structure of ``params`` (Linen boxes read through): bool masks (True = kept) for pruned leaves,
    each of its parameter's shape, ``None`` for the others.

  Raises:
    ValueError: naming the path, for a structure (view, stack) that cannot apply to a parameter it matches; a tied
      layer whose paths the rules give different structures; ``scores`` of the wrong paths or shapes; a rule that
      selects the stored values of an already N:M-compressed layer (``CompressedNMEmbed``, ``CompressedNMLinear``,
      ``CompressedNMDense``: they are the kept weights, not the dense table or kernel) or the kept blocks of a
      block-sparse layer (``BlockSparseLinear``, ``BlockSparseDense``, ``TensorParallelBlockSparseLinear``: its
      blocks are fixed; densify, prune and sparsify again), seen in an ``nnx.Module``, in its ``nnx.State`` (the
      layers mark those params) or in Linen variables that hold the
      layers' ``"sparsity"`` collection; bare Linen ``params`` do not tell them from a dense kernel (map such paths to
      ``None``); a layer mask not of its parameter's shape.
    TypeError: bad ``rules``, ``views``, ``stacks`` or ``layer_masks``; complex ``scores``; an ``nnx.Optimizer`` (it
      holds no parameters: pass the model).
  """
  layer_masks = check_layer_masks(layer_masks)
  paths, leaves, treedef, targets = plan(params, rules, views=views, stacks=stacks)
  score_list = None
  if scores is not None:
    score_list = _target_scores(params_of(scores), paths, targets)
  check_scope(scope)
  # an NNX object's masked layers tell their masks; marked kernels of bare parameters without them warn
  allowed = allowed_units(targets, resolve_layer_masks(params, layer_masks, targets, warn=True), paths, scope=scope,
                          warn=True)
  # One compiled computation is much cheaper than dispatching its dozens of small ops one by one.
  compute = jax.jit(
      lambda leaves, s, a: masks_at(leaves, targets, lambda spec: spec.target_sparsity, scope=scope, scores=s,
                                    allowed=a)
  )
  return unflatten_masks(treedef, len(leaves), targets, compute(leaves, score_list, allowed))


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
