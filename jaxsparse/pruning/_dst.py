"""Dynamic sparse training at a fixed sparsity: SET and RigL, for unstructured and block masks.

Both start from a uniformly random mask at each rule's target sparsity and, every
``update_every`` steps until ``end_step``, move a cosine-decaying fraction of each layer's kept units
(weights or blocks): they drop the kept units of smallest magnitude and grow as many among the units
that were pruned before this update, at random (SET) or where the dense gradient is largest
(RigL). Grown weights start at zero (they were held at zero while pruned) and their optimizer state
is reset by :func:`wrap_optax`. Each layer of a stack (``stacks=``) is one layer here. The number of kept units per
layer never changes, even with NaN or infinite weights (kept to the last) or gradients (a NaN gradient counts as the
largest). A layer with a mask of its own (``layer_masks=``) is drawn and grown inside that mask only.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp

from jaxsparse._rules import Views
from jaxsparse._rules import resolve_rules
from jaxsparse._rules import resolve_views
from jaxsparse.formats._specs import NM
from jaxsparse.pruning._layer_masks import LayerMasks
from jaxsparse.pruning._layer_masks import allowed_units
from jaxsparse.pruning._layer_masks import check_layer_masks
from jaxsparse.pruning._layer_masks import resolve_layer_masks
from jaxsparse.pruning._optax import Pruner
from jaxsparse.pruning._schedules import check_steps
from jaxsparse.pruning._schedules import periodic
from jaxsparse.pruning._schedules import ramp
from jaxsparse.pruning._scores import Target
from jaxsparse.pruning._scores import frozen_rules
from jaxsparse.pruning._scores import magnitude_scores
from jaxsparse.pruning._scores import plan
from jaxsparse.pruning._scores import rank_mask
from jaxsparse.pruning._scores import target_masks
from jaxsparse.pruning._scores import unflatten_masks
from jaxsparse.pruning._stacks import Stacks
from jaxsparse.pruning._stacks import resolve_stacks

__all__ = ["cosine_drop_fraction", "rigl_pruner", "set_pruner"]


def cosine_drop_fraction(
    step: jax.typing.ArrayLike, *, drop_fraction: float, begin_step: int, end_step: int
) -> jax.Array:
  """RigL's update fraction ``alpha / 2 * (1 + cos(pi * (t - t0) / (t1 - t0)))``, 0 after ``end_step``.

  >>> from jaxsparse import pruning
  >>> [round(float(pruning.cosine_drop_fraction(t, drop_fraction=0.3, begin_step=0, end_step=100)), 3)
  ...  for t in (0, 50, 100, 101)]
  [0.3, 0.15, 0.0, 0.0]

  Args:
    step: the step ``t``, an int or a scalar array (may be traced); integer steps are exact at any size (clipped
      and subtracted as integers).
    drop_fraction: ``alpha``, the fraction at ``begin_step``.
    begin_step: ``t0``.
    end_step: ``t1``; the fraction is 0 at ``end_step`` and after it.

  Returns:
    A float32 scalar array in ``[0, drop_fraction]``: the fraction of each layer's kept units moved at ``step``.

  Raises:
    ValueError: naming the argument, for a ``drop_fraction`` outside ``(0, 1]``, steps that are not ints ``>= 0``
      or ``end_step < begin_step``.
  """
  _check_drop_fraction(drop_fraction)
  begin_step, end_step = check_steps(begin_step, end_step)
  _, _, left = ramp(step, begin_step, end_step)  # left = 1 - frac, from exact step arithmetic
  # alpha / 2 (1 + cos(pi frac)) = alpha sin^2(pi (1 - frac) / 2): no cancellation near the end of a long ramp.
  f = jnp.float32(drop_fraction) * jnp.sin(jnp.float32(jnp.pi / 2) * left) ** 2
  up_to_end = ramp(step, end_step + 1, end_step + 1)[0]  # step <= end_step, exact as above
  return jnp.where(up_to_end, f, jnp.float32(0.0))


def _swap(
    units: jax.Array, drop_scores: jax.Array, grow_scores: jax.Array, n_swap: jax.Array, allowed: jax.Array | None
) -> jax.Array:
  """In one layer's (flat) units, drops the ``n_swap`` kept units of smallest ``drop_scores`` and grows the pruned
  ones of largest ``grow_scores`` (among the ``allowed`` ones: those its layer's own mask can carry).

  As many are grown as dropped, whatever the scores: a NaN or infinite weight is dropped last, a NaN gradient counts
  as the largest.
  """
  free = ~units if allowed is None else allowed & ~units
  n = jnp.minimum(n_swap, jnp.minimum(jnp.sum(units), jnp.sum(free)))
  drop = rank_mask(-jnp.where(jnp.isnan(drop_scores), jnp.inf, drop_scores), n, among=units)
  grow = rank_mask(grow_scores, n, among=free)
  return (units & ~drop) | grow


def _check_drop_fraction(drop_fraction: object) -> None:
  if isinstance(drop_fraction, bool) or not isinstance(drop_fraction, numbers.Real) or not 0 < drop_fraction <= 1:
    raise ValueError(f"drop_fraction must be in (0, 1], got drop_fraction={drop_fraction!r}.")


def _check_args(drop_fraction: object, update_every: object, end_step: object, begin_step: object) -> None:
  _check_drop_fraction(drop_fraction)
  periodic(update_every=update_every, begin_step=begin_step, end_step=end_step)  # checks the steps


_NM_REFUSED = ("SET and RigL support Unstructured and BlockSparse rules, got {spec!r}; for N:M masks that follow the "
               "weights, train NMLinear / NMConv layers (jaxsparse.sparsify with NM: SR-STE).")


def _dst_pruner(rules: Any, *, grow: str, update_every: int, end_step: int, begin_step: int, drop_fraction: float,
                views: Views | None, stacks: Stacks | None, layer_masks: LayerMasks | None):
  _check_args(drop_fraction, update_every, end_step, begin_step)
  schedule = periodic(update_every=update_every, begin_step=begin_step, end_step=end_step)
  rules = frozen_rules(rules)  # bad rules fail here, not at init
  for pattern, _, spec in resolve_rules(rules):
    if isinstance(spec, NM):
      raise ValueError(f"rule {pattern!r}: {_NM_REFUSED.format(spec=spec)}")
  resolve_views(views)  # bad views and stacks fail here, not at init
  resolve_stacks(stacks)
  layer_masks = check_layer_masks(layer_masks)

  def targets_of(params, *, warn):
    paths, leaves, treedef, targets = plan(params, rules, views=views, stacks=stacks, warn=warn)
    for t in targets:
      if isinstance(t.spec, NM):
        raise ValueError(f"{t.path}: {_NM_REFUSED.format(spec=t.spec)}")
    own = resolve_layer_masks(params, layer_masks, targets, warn=warn)  # a model given: its layers' masks
    allowed = allowed_units(targets, own, paths, warn=warn) or [None] * len(targets)
    return leaves, treedef, targets, allowed

  def draw(t, scores, allowed):
    if allowed is None:
      return jax.vmap(lambda s: rank_mask(s, t.kept_final))(scores)
    return jax.vmap(lambda s, a: rank_mask(s, t.kept_final, among=a))(scores, allowed)

  def init(params, key):
    leaves, treedef, targets, allowed = targets_of(params, warn=True)
    keys = jax.random.split(key, max(len(targets), 1))
    masks = [  # each layer of a stack its own random mask, inside its layer's own mask where it has one
        t.expand(draw(t, jax.random.uniform(k, (t.layers, t.units)), a))
        for t, k, a in zip(targets, keys[: len(targets)], allowed, strict=True)
    ]
    return unflatten_masks(treedef, len(leaves), targets, masks)

  def update(masks, params, grads, step, key):
    leaves, treedef, targets, allowed = targets_of(params, warn=False)
    current = target_masks(masks, treedef, targets)
    grad_leaves = treedef.flatten_up_to(grads)
    fraction = cosine_drop_fraction(step, drop_fraction=drop_fraction, begin_step=begin_step, end_step=end_step)
    keys = jax.random.split(key, max(len(targets), 1))
    new = []
    for t, mask, k, a in zip(targets, current, keys[: len(targets)], allowed, strict=True):
      units = t.unit_mask(mask)
      n_swap = jnp.minimum(jnp.floor(fraction * t.kept_final).astype(jnp.int32), t.units - t.kept_final)
      drop_scores = t.unit_scores(magnitude_scores(leaves[t.index]))
      grow_scores = _grow_scores(t, grow, grad_leaves[t.index], k)
      swap = jax.vmap(_swap, in_axes=(0, 0, 0, None, None if a is None else 0))
      new.append(t.expand(swap(units, drop_scores, grow_scores, n_swap, a)))
    return unflatten_masks(treedef, len(leaves), targets, new)

  return Pruner(init, update, schedule.is_update_step)


def _grow_scores(t: Target, grow: str, grad: Any, key: jax.Array) -> jax.Array:
  if grow == "random":
    return jax.random.uniform(key, (t.layers, t.units))
  return t.unit_scores(magnitude_scores(grad))


def set_pruner(
    rules: Any, *, update_every: int, end_step: int, begin_step: int = 0, drop_fraction: float = 0.3,
    views: Views | None = None, stacks: Stacks | None = None, layer_masks: LayerMasks | None = None,
) -> Pruner:
  """SET (Mocanu et al., 2018): drop the smallest-magnitude kept weights, regrow as many at random.

  >>> import jax, jax.numpy as jnp, optax, jaxsparse
  >>> from jaxsparse import pruning
  >>> params = {"w": jax.random.normal(jax.random.key(0), (16, 16))}
  >>> tx = pruning.wrap_optax(optax.sgd(0.1), pruning.set_pruner(
  ...     jaxsparse.Unstructured(sparsity=0.9), update_every=2, end_step=10))
  >>> state = tx.init(params)
  >>> first = pruning.get_masks(state)["w"]
  >>> for _ in range(3):
  ...   updates, state = tx.update({"w": jnp.ones((16, 16))}, state, params)
  ...   params = optax.apply_updates(params, updates)
  >>> mask = pruning.get_masks(state)["w"]
  >>> int(mask.sum()), bool((mask != first).any())
  (26, True)

  Args:
    rules: ``jaxsparse.Unstructured`` / ``jaxsparse.BlockSparse`` structures (or ``{regex: ...}``);
      each matched parameter keeps its target count throughout.
    update_every: steps between mask updates.
    end_step: last step with a mask update (RigL uses 75% of training).
    begin_step: first update step.
    drop_fraction: fraction of kept units moved at ``begin_step``; it decays to 0 at ``end_step`` on
      a cosine (:func:`cosine_drop_fraction`).
    views: ``{regex: input axes}`` of multi-axis kernels, for blocks (see :func:`magnitude_masks`); pass
      :func:`kernel_views` of the model for bias-free attention projections.
    stacks: ``{regex: leading layer axes}`` of stacked parameters (``nnx.vmap`` / ``nn.scan`` over layers): each
      layer keeps its own count and moves its own units (see :func:`magnitude_masks`); pass :func:`layer_stacks` of
      the model.
    layer_masks: ``{parameter path: bool mask}`` of the layers that have a mask of their own (a model that is
      already sparse: ``MaskedLinear``, ``MaskedConv``, Linen ``MaskedDense``); pass :func:`layer_masks` of the model.
      The optimizer shows the pruner the parameters only: without them the random mask and the grown units land
      outside those masks, on weights the layer cannot carry, so the model keeps fewer than :func:`get_masks` says.
      With them both are drawn inside each layer's mask (a block: one it keeps a weight of), and the density is
      still that of the whole weight; a rule looser than its layer keeps the layer's own units (warned at ``init``).
      Read once, here: after :func:`apply_masks` narrows the layers' masks, build a new pruner to follow them.
      Given the model itself (``pruner.init(model, key)``) the pruner reads its layers' masks (these win, path by
      path); given parameters whose kernels mark a masked layer (the ``nnx.State`` that ``nnx.Optimizer`` hands
      :func:`wrap_optax`) without their masks here, ``init`` warns once, naming them.

  Returns:
    A :class:`Pruner` for :func:`wrap_optax`; its ``init`` draws a uniformly random mask per matched parameter
    (from the key that :func:`wrap_optax` seeds with its ``seed``), inside its layer's mask where ``layer_masks`` has
    one.

  Raises:
    TypeError: ``rules`` neither a structure nor a mapping, a rule key that is not a string or a rule value that is
      not a structure or ``None``; bad ``views`` or ``stacks``; ``layer_masks`` not a mapping of paths to bool arrays.
    ValueError: naming the argument, for a bad ``drop_fraction`` or steps; an ``NM`` rule, empty ``rules`` or a
      rule key that is not a valid regex (here, where the pruner is built); at ``init``, a structure that cannot
      apply to a parameter it matches, a rule matching the stored values of an already N:M-compressed layer or
      the kept blocks of a block-sparse layer (see :func:`magnitude_masks`), or a layer mask not of its parameter's
      shape, naming the path.

  References:
    Mocanu et al., "Scalable training of artificial neural networks with adaptive sparse
    connectivity inspired by network science", Nature Communications 2018.
  """
  return _dst_pruner(
      rules, grow="random", update_every=update_every, end_step=end_step, begin_step=begin_step,
      drop_fraction=drop_fraction, views=views, stacks=stacks, layer_masks=layer_masks,
  )


def rigl_pruner(
    rules: Any, *, update_every: int, end_step: int, begin_step: int = 0, drop_fraction: float = 0.3,
    views: Views | None = None, stacks: Stacks | None = None, layer_masks: LayerMasks | None = None,
) -> Pruner:
  """RigL (Evci et al., 2020): drop the smallest-magnitude kept weights, grow where the dense gradient is largest.

  The gradient is the one :func:`wrap_optax` receives: train the dense model (``nnx.Linear`` layers)
  so that it is dense; for blocks the score is the Frobenius norm of the gradient block. Arguments
  as :func:`set_pruner`.

  >>> import jax, jax.numpy as jnp, optax, jaxsparse
  >>> from jaxsparse import pruning
  >>> params = {"w": jnp.ones((8, 8))}
  >>> tx = pruning.wrap_optax(optax.sgd(0.0), pruning.rigl_pruner(
  ...     jaxsparse.BlockSparse(density=0.25, block_shape=(4, 4)), update_every=1, end_step=10,
  ...     drop_fraction=1.0))
  >>> state = tx.init(params)
  >>> grads = {"w": jnp.zeros((8, 8)).at[4:, :4].set(1.0)}  # the bottom-left block wants to grow
  >>> _, state = tx.update(grads, state, params)
  >>> pruning.get_masks(state)["w"][::4, ::4].astype(int).tolist()
  [[0, 0], [1, 0]]

  Args:
    rules: ``jaxsparse.Unstructured`` / ``jaxsparse.BlockSparse`` structures (or ``{regex: ...}``);
      each matched parameter keeps its target count throughout.
    update_every: steps between mask updates.
    end_step: last step with a mask update (RigL uses 75% of training).
    begin_step: first update step.
    drop_fraction: fraction of kept units moved at ``begin_step``, decaying to 0 at ``end_step`` on a cosine
      (:func:`cosine_drop_fraction`).
    views: as :func:`set_pruner`.
    stacks: as :func:`set_pruner`.
    layer_masks: as :func:`set_pruner`: the random mask and the grown units stay inside each layer's own mask.

  Returns:
    A :class:`Pruner` for :func:`wrap_optax`; it starts from a uniformly random mask per matched parameter (inside
    its layer's mask where ``layer_masks`` has one).

  Raises:
    TypeError: as :func:`set_pruner`.
    ValueError: as :func:`set_pruner`.

  References:
    Evci et al., "Rigging the Lottery: Making All Tickets Winners", ICML 2020,
    https://arxiv.org/abs/1911.11134.
  """
  return _dst_pruner(
      rules, grow="gradient", update_every=update_every, end_step=end_step, begin_step=begin_step,
      drop_fraction=drop_fraction, views=views, stacks=stacks, layer_masks=layer_masks,
  )

