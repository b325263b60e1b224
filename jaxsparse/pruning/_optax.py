"""Pruning inside an optax optimizer: masks as optimizer state, updated on a schedule.

:func:`wrap_optax` turns any ``optax.GradientTransformation`` into one that

* recomputes the masks at the pruner's update steps (the mask-update step, inside ``update``),
* feeds the inner optimizer gradients that are zero at pruned weights,
* outputs updates that are the inner update at kept weights and ``-param`` at pruned ones, so after
  ``optax.apply_updates`` a pruned weight is exactly zero, whatever the inner optimizer's momentum,
* resets the inner optimizer's per-parameter state (momentum, second moments) wherever a weight is
  pruned or newly grown, so a stale moment never resurrects or kicks a weight.

That guarantee needs the wrapper's updates to reach ``optax.apply_updates`` unchanged: it must be the last
transformation of a chain (wrap the whole chain, ``wrap_optax(optax.chain(scale_by_adam(), scale_by_learning_rate(lr)),
pruner)``). The state counts the updates that found a pruned weight not zero, and :func:`get_masks` refuses such
a state.

The masks live in :class:`PruningState` (``state.masks``, a tree with the parameters' structure):
plain data that :func:`get_masks` reads back from an ``nnx.Optimizer``, a Linen ``TrainState`` or a
raw optax state, to save or to hand to :func:`jaxsparse.sparsify`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax

from jaxsparse import _utils
from jaxsparse._rules import Views
from jaxsparse._rules import flatten_with_paths
from jaxsparse._rules import path_str
from jaxsparse._rules import resolve_views
from jaxsparse._rules import unwrap_variables
from jaxsparse.formats._base import is_concrete
from jaxsparse.formats._block_sparse import INDEX_FIELDS
from jaxsparse.formats._masks import replicated
from jaxsparse.formats._masks import split_like
from jaxsparse.layers._block_sparse import BlockSparseLinear
from jaxsparse.layers._common import SPARSITY
from jaxsparse.layers._common import pattern_mask
from jaxsparse.layers._masked import MaskedConv
from jaxsparse.layers._masked import MaskedLinear
from jaxsparse.pruning._schedules import Schedule
from jaxsparse.pruning._schedules import one_shot
from jaxsparse.pruning._scores import check_scope
from jaxsparse.pruning._scores import frozen_rules
from jaxsparse.pruning._scores import masks_at
from jaxsparse.pruning._scores import plan
from jaxsparse.pruning._scores import target_masks
from jaxsparse.pruning._scores import unflatten_masks

__all__ = [
    "Pruner",
    "PruningState",
    "apply_masks",
    "get_masks",
    "magnitude_pruner",
    "wrap_optax",
]


class Pruner(NamedTuple):
  """A mask policy: pure functions that make and update mask trees.

  Attributes:
    init: ``(params, key) -> masks``: the masks in force at step 0.
    update: ``(masks, params, grads, step, key) -> masks``: the mask-update step; ``grads`` are the
      dense gradients of this step. Called by :func:`wrap_optax` only where ``is_update_step``.
    is_update_step: ``step -> bool`` scalar.

  A custom policy, here a fixed mask that keeps the diagonal, set at step 0 and never updated:

  >>> import jax, jax.numpy as jnp, optax
  >>> from jaxsparse import pruning
  >>> diagonal = pruning.Pruner(
  ...     init=lambda params, key: jax.tree.map(lambda p: jnp.eye(*p.shape, dtype=bool), params),
  ...     update=lambda masks, params, grads, step, key: masks,
  ...     is_update_step=lambda step: jnp.asarray(False))
  >>> tx = pruning.wrap_optax(optax.sgd(0.1), diagonal)
  >>> params = {"w": jnp.ones((3, 3))}
  >>> updates, state = tx.update({"w": jnp.ones((3, 3))}, tx.init(params), params)
  >>> optax.apply_updates(params, updates)["w"]
  Array([[0.9, 0. , 0. ],
         [0. , 0.9, 0. ],
         [0. , 0. , 0.9]], dtype=float32)
  """

  init: Callable[[Any, jax.Array], Any]
  update: Callable[[Any, Any, Any, jax.Array, jax.Array], Any]
  is_update_step: Callable[[jax.Array], jax.Array]


class PruningState(NamedTuple):
  """State of :func:`wrap_optax`: step count, PRNG key, the masks and the inner optimizer's state.

  >>> import jax.numpy as jnp, optax, jaxsparse
  >>> from jaxsparse import pruning
  >>> tx = pruning.wrap_optax(optax.adam(1e-3), pruning.magnitude_pruner(jaxsparse.Unstructured(sparsity=0.5)))
  >>> state = tx.init({"w": jnp.arange(4.0).reshape(2, 2)})
  >>> isinstance(state, pruning.PruningState), int(state.count), int(state.pruned_nonzero)
  (True, 0, 0)
  >>> state.masks["w"].tolist()
  [[False, False], [True, True]]

  Attributes:
    count: int32 scalar, the number of ``update`` calls so far (the step).
    key: the PRNG key for the pruner's random choices, split at every step.
    masks: a tree with the parameters' structure: a bool array per pruned parameter, ``None`` elsewhere.
    inner_state: the state of the wrapped optimizer.
    pruned_nonzero: int32 scalar, the number of ``update`` calls (after the first) whose ``params`` had a nonzero
      weight where the previous update's masks prune: the wrapper's updates did not reach the parameters
      unchanged (a transformation after it in a chain), or the parameters were changed by hand. :func:`get_masks`
      raises while it is not 0.
  """

  count: jax.Array
  key: jax.Array
  masks: Any
  inner_state: Any
  pruned_nonzero: jax.Array


def magnitude_pruner(
    rules: Any, schedule: Schedule | None = None, *, scope: str = "layer", views: Views | None = None
) -> Pruner:
  """Magnitude pruning to the structures in ``rules`` on ``schedule`` (default: one-shot at step 0).

  At each update step the masks keep the largest-magnitude weights (blocks by Frobenius norm, N of
  every M) among those still kept, at the schedule's sparsity; pruning never undoes itself unless
  the schedule's sparsity decreases. With :func:`gradual` this is Zhu & Gupta's gradual magnitude
  pruning. ``NM`` rules go from dense through ``(m - 1):m``, ... down to ``n:m``.

  >>> import jax, jax.numpy as jnp, optax, jaxsparse
  >>> from jaxsparse import pruning
  >>> params = {"w": jax.random.normal(jax.random.key(0), (8, 8))}
  >>> pruner = pruning.magnitude_pruner(jaxsparse.Unstructured(sparsity=0.5),
  ...                                   pruning.gradual(begin_step=0, end_step=4, update_every=2))
  >>> tx = pruning.wrap_optax(optax.sgd(0.1), pruner)
  >>> state = tx.init(params)
  >>> for step in range(5):
  ...   updates, state = tx.update({"w": jnp.ones((8, 8))}, state, params)
  ...   params = optax.apply_updates(params, updates)
  >>> int((params["w"] == 0).sum()), int(pruning.get_masks(state)["w"].sum())
  (32, 32)

  Args:
    rules: a structure or ``{regex: structure or None}`` over parameter paths (see
      :func:`magnitude_masks`).
    schedule: :func:`one_shot`, :func:`gradual` or :func:`periodic`.
    scope: ``"layer"`` or ``"global"`` thresholds (see :func:`magnitude_masks`).
    views: ``{regex: input axes}`` of multi-axis kernels, for blocks and N:M groups (see
      :func:`magnitude_masks`); pass :func:`kernel_views` of the model for bias-free attention projections.

  Returns:
    A :class:`Pruner` for :func:`wrap_optax`.

  Raises:
    TypeError: ``schedule`` is not a :class:`Schedule`; ``views`` with a key that is not a regex string or a
      value that is not a positive int; ``rules`` neither a structure nor a mapping, a rule key that is not a
      string or a rule value that is not a structure or ``None``.
    ValueError: ``scope`` is not ``"layer"`` or ``"global"``; empty ``rules`` or a rule key that is not a valid
      regex. The structures are checked against the parameters when the wrapped optimizer's ``init`` runs, which
      raises a ``ValueError`` for a structure that cannot apply to a parameter it matches.
  """
  schedule = one_shot() if schedule is None else schedule
  if not isinstance(schedule, Schedule):
    raise TypeError(f"schedule must be a pruning.Schedule (one_shot, gradual, periodic), got {schedule!r}.")
  check_scope(scope)
  rules = frozen_rules(rules)  # bad rules fail here, not at the wrapped optimizer's init
  resolve_views(views)  # bad views fail here, not at the first step

  def at_step(masks, params, step, *, warn):
    _, leaves, treedef, targets = plan(params, rules, views=views, warn=warn)
    prior = None if masks is None else target_masks(masks, treedef, targets)
    new = masks_at(
        leaves, targets, lambda spec: schedule.sparsity(step, spec.target_sparsity), scope=scope, prior=prior
    )
    return unflatten_masks(treedef, len(leaves), targets, new)

  def init(params, key):
    del key
    return at_step(None, params, 0, warn=True)

  def update(masks, params, grads, step, key):
    del grads, key
    return at_step(masks, params, step, warn=False)

  return Pruner(init, update, schedule.is_update_step)


def _is_none(x: Any) -> bool:
  return x is None


def _where_masked(masks: Any, kept: Any, pruned: Callable[[Any], Any], tree: Any) -> Any:
  """``where(mask, kept_leaf, pruned(leaf))`` leaf by leaf; leaves without a mask take ``kept``'s."""

  def f(m, k, x):
    if m is None:
      return k
    return jnp.where(m, k, pruned(x).astype(jnp.result_type(k)))

  return jax.tree.map(f, masks, kept, tree, is_leaf=_is_none)


def _gathered(tree: Any) -> Any:
  """``tree``'s arrays gathered onto every device where explicit mesh axes split them (a no-op otherwise): the
  pruners rank weights over whole arrays, and under explicit axes JAX refuses to flatten or sort a split dim."""
  return jax.tree.map(lambda a: replicated(a) if isinstance(a, jax.Array) else a, tree)


def _split_like(masks: Any, params: Any) -> Any:
  """``masks`` split like their parameters where explicit mesh axes split those (a no-op otherwise)."""
  return jax.tree.map(lambda m, p: m if m is None else split_like(m, p), masks, params, is_leaf=_is_none)


def _any_pruned_nonzero(masks: Any, params: Any) -> jax.Array:
  """Bool scalar: whether any weight of ``params`` is nonzero where ``masks`` prune it."""
  found = jax.tree.map(
      lambda m, p: None if m is None else jnp.any((jnp.asarray(p) != 0) & ~m), masks, params, is_leaf=_is_none
  )
  leaves = jax.tree.leaves(found)
  return jnp.any(jnp.stack(leaves)) if leaves else jnp.zeros((), bool)


def _keep_tree(masks: Any, params: Any) -> Any:
  """Masks with every unmasked leaf replaced by a scalar ``True``: a tree with the parameters' structure."""
  return jax.tree.map(lambda m, p: jnp.ones((), bool) if m is None else m, masks, params, is_leaf=_is_none)


def wrap_optax(
    inner: optax.GradientTransformation,
    pruner: Pruner,
    *,
    seed: int = 0,
    reset_state: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` so that it trains a sparse model: masked updates, pruned weights kept at zero.

  Use it wherever an optax optimizer goes: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``,
  ``TrainState.create(..., tx=tx)``, or a raw ``tx.update`` loop. ``update`` needs ``params``.

  >>> import jax, jax.numpy as jnp, optax, jaxsparse
  >>> from flax import nnx
  >>> from jaxsparse import pruning
  >>> model = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
  >>> tx = pruning.wrap_optax(optax.adam(1e-2), pruning.magnitude_pruner(jaxsparse.Unstructured(sparsity=0.75)))
  >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  >>> grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((2, 16))) ** 2))(model)
  >>> _ = optimizer.update(model, grads)
  >>> float(jnp.mean(model.kernel[...] == 0)), pruning.get_masks(optimizer.opt_state)["kernel"].shape
  (0.75, (16, 8))

  At every step ``update``:

  1. where ``pruner.is_update_step(count)``, computes new masks with ``pruner.update`` from the
     current parameters and the dense gradients, and (``reset_state``) zeroes the inner state of
     every weight that is pruned or was just grown;
  2. runs ``inner`` on the gradients zeroed at pruned weights;
  3. returns the inner updates at kept weights and ``-params`` at pruned ones.

  The ``-params`` updates zero the pruned weights only if they reach ``optax.apply_updates`` as they are, so the
  wrapper must be the **outermost** transformation: the last one of an ``optax.chain``, with everything that
  scales or adds to the updates (learning rate, weight decay) inside it. Transformations before it (gradient
  clipping) are fine:

  >>> lr = 1e-2
  >>> pruner = pruning.magnitude_pruner(jaxsparse.Unstructured(sparsity=0.75))
  >>> tx = pruning.wrap_optax(optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(lr)), pruner)  # right
  >>> tx = optax.chain(optax.clip_by_global_norm(1.0), pruning.wrap_optax(optax.adam(lr), pruner))  # right
  >>> tx = optax.chain(pruning.wrap_optax(optax.scale_by_adam(), pruner), optax.scale_by_learning_rate(lr))  # WRONG

  In the last one ``scale_by_learning_rate`` turns ``-param`` into ``lr * param``, so pruned weights grow instead
  of vanishing. No sound correction exists from inside the chain; instead every update (from the second on)
  checks that the weights the masks prune are zero, counts the updates where they are not in
  ``PruningState.pruned_nonzero``, and :func:`get_masks` then raises.

  Args:
    inner: the optimizer to wrap.
    pruner: :func:`magnitude_pruner`, :func:`set_pruner`, :func:`rigl_pruner` or your own
      :class:`Pruner`.
    seed: seeds the PRNG key kept in the state (random masks and growth).
    reset_state: zero the inner state of pruned and newly grown weights at mask updates: the leaves of the
      inner state that have their parameter's shape (momentum, second moments); factored statistics of another
      shape (``optax.adafactor``'s) stay as they are. It needs an inner state that
      ``optax.tree_utils.tree_map_params`` understands (``init`` raises a ``ValueError`` for one it does not,
      such as ``optax.sm3``'s: pass ``False`` then).

  Returns:
    A ``GradientTransformationExtraArgs`` whose state is a :class:`PruningState`.

  Raises:
    TypeError: ``pruner`` is not a :class:`Pruner`. Later, ``init`` raises a ``ValueError`` with
      ``reset_state=True`` for an inner state it cannot map to the parameters (and the pruner's own errors,
      see :func:`magnitude_pruner`); ``update`` raises a ``ValueError`` when called without ``params``.
  """
  inner = optax.with_extra_args_support(inner)
  if not isinstance(pruner, Pruner):
    raise TypeError(f"pruner must be a pruning.Pruner (magnitude_pruner, set_pruner, rigl_pruner), got {pruner!r}.")

  def init(params):
    key, init_key = jax.random.split(jax.random.PRNGKey(seed))
    _, leaves, treedef = flatten_with_paths(params)
    plain = jax.tree_util.tree_unflatten(treedef, leaves)
    masks = _split_like(jax.jit(lambda p, k: pruner.init(_gathered(p), k))(plain, init_key), plain)
    inner_state = inner.init(params)
    if reset_state:
      try:  # an inner state that reset cannot map fails here, with a way out, not inside the first update's trace
        jax.eval_shape(lambda p, m: reset(inner.init(p), m, m, p), plain, masks)
      except ValueError as e:
        raise ValueError(
            "wrap_optax(reset_state=True) cannot find the per-parameter state of the inner optimizer (its state "
            "does not hold trees with the parameters' structure, as optax.sm3's does not); pass reset_state=False "
            f"to leave its state as it is at mask updates. The error was: {e}"
        ) from e
    return PruningState(jnp.zeros((), jnp.int32), key, masks, inner_state, jnp.zeros((), jnp.int32))

  def reset(inner_state, new_masks, old_masks, params):
    keep = _keep_tree(jax.tree.map(lambda n, o: n & o, new_masks, old_masks), params)

    def reset_leaf(s, k):
      # Only state of the parameter's own shape is per weight; factored statistics (optax.adafactor's row and
      # column second moments) and scalars are shared by kept weights and stay as they are.
      if not hasattr(s, "dtype") or (k.ndim and s.shape != k.shape):
        return s
      return jnp.where(k, s, jnp.zeros((), s.dtype))

    return optax.tree_utils.tree_map_params(inner, reset_leaf, inner_state, keep)

  def update(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError("pruning.wrap_optax needs params: call tx.update(grads, state, params).")
    step = state.count
    key, update_key = jax.random.split(state.key)
    # After an update, the weights its masks prune are zero, unless something changed the updates on the way.
    stray = (step > 0) & _any_pruned_nonzero(state.masks, params)
    pruned_nonzero = state.pruned_nonzero + stray.astype(jnp.int32)

    def mask_update(masks, inner_state):
      new = pruner.update(_gathered(masks), _gathered(params), _gathered(updates), step, update_key)
      new = _split_like(new, params)
      if reset_state:
        inner_state = reset(inner_state, new, masks, params)
      return new, inner_state

    masks, inner_state = lax.cond(
        pruner.is_update_step(step), mask_update, lambda m, s: (m, s), state.masks, state.inner_state
    )
    grads = _where_masked(masks, updates, jnp.zeros_like, updates)
    new_updates, inner_state = inner.update(grads, inner_state, params, **extra_args)
    new_updates = _where_masked(masks, new_updates, jnp.negative, params)
    return new_updates, PruningState(step + 1, key, masks, inner_state, pruned_nonzero)

  return optax.GradientTransformationExtraArgs(init, update)


def get_masks(state: Any, *, check: bool = True) -> Any:
  """The masks held by a :func:`wrap_optax` state, as a tree of bool arrays (and ``None``).

  Accepts the raw optax state, an ``nnx.Optimizer`` or its ``opt_state``, or a Linen ``TrainState``;
  the :class:`PruningState` may be nested in other optax states (``optax.chain``, with :func:`wrap_optax` last).

  >>> import jax.numpy as jnp, optax, jaxsparse
  >>> from jaxsparse import pruning
  >>> tx = optax.chain(optax.clip_by_global_norm(1.0),
  ...                  pruning.wrap_optax(optax.sgd(0.1), pruning.magnitude_pruner(jaxsparse.Unstructured(0.75))))
  >>> masks = pruning.get_masks(tx.init({"w": jnp.arange(8.0).reshape(2, 4), "b": jnp.zeros(4)}))
  >>> masks["w"].astype(int).tolist(), masks["b"]
  ([[0, 0, 0, 0], [0, 0, 1, 1]], None)

  Args:
    state: the state of an optimizer that contains :func:`wrap_optax`: a raw optax state, an ``nnx.Optimizer``
      or its ``opt_state``, or an object with an ``opt_state`` attribute (a Linen ``TrainState``).
    check: raise when the state recorded pruned weights that were not zero (``PruningState.pruned_nonzero``);
      ``False`` reads the masks anyway (inside ``jit`` there is no check).

  Returns:
    The masks, a tree with the parameters' structure: a bool array of each pruned parameter's shape, ``None``
    for the parameters no rule matched.

  Raises:
    ValueError: when there is no :class:`PruningState` in ``state``, or (``check``) when an update found weights
      that the masks prune not zero, so the masks do not describe the trained parameters: a transformation after
      :func:`wrap_optax` in an ``optax.chain`` changed its updates (see :func:`wrap_optax`).
  """
  if isinstance(state, nnx.Optimizer):
    state = state.opt_state
  elif hasattr(state, "opt_state") and not isinstance(state, PruningState):
    state = state.opt_state
  found = [
      x for x in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, PruningState))
      if isinstance(x, PruningState)
  ]
  if len(found) != 1:
    raise ValueError(
        f"state must hold exactly one pruning.PruningState (the state of pruning.wrap_optax), found {len(found)}."
    )
  pruning_state = unwrap_variables(found[0])
  try:
    stray = int(pruning_state.pruned_nonzero) if check else 0
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
    stray = 0  # inside jit: nothing to check
  if stray:
    raise ValueError(
        f"{stray} of {int(pruning_state.count)} updates of pruning.wrap_optax found "
        "weights that its masks prune not zero, so the masks do not describe the trained parameters (a model "
        "sparsified with them would differ from the trained one). A transformation after wrap_optax changed its "
        "updates: wrap_optax must be the last transformation, with the learning rate and everything else that "
        "changes updates inside it, e.g. pruning.wrap_optax(optax.chain(optax.scale_by_adam(), "
        "optax.scale_by_learning_rate(lr)), pruner), not optax.chain(pruning.wrap_optax(optax.scale_by_adam(), "
        "pruner), optax.scale_by_learning_rate(lr)). If you changed the parameters yourself, pass check=False."
    )
  return pruning_state.masks


def apply_masks(target: Any, masks: Any) -> Any:
  """Zeroes the pruned weights: of a parameter tree or Linen variables (returns new ones) or of an NNX model (in place).

  >>> import jax.numpy as jnp
  >>> from jaxsparse import pruning
  >>> pruning.apply_masks({"w": jnp.ones((2, 2)), "b": jnp.ones(2)}, {"w": jnp.eye(2, dtype=bool), "b": None})
  {'b': Array([1., 1.], dtype=float32), 'w': Array([[1., 0.],
         [0., 1.]], dtype=float32)}

  Call it after ``init`` when a model must be sparse before its first optimizer step (the wrapped
  optimizer zeroes pruned weights at its first update).

  On an NNX model, the layers with a mask of their own (``MaskedLinear``, ``MaskedConv``) keep only the weights
  both masks keep: their ``mask``, ``density`` and :func:`jaxsparse.summary` then tell the truth. An optimizer
  sees only the parameters, so after :func:`wrap_optax` pruned such a layer further, call
  ``apply_masks(model, get_masks(optimizer))`` (the layer's outputs were already right; its mask was not):

  >>> import jax.numpy as jnp, optax, jaxsparse
  >>> from flax import nnx
  >>> layer = jaxsparse.layers.MaskedLinear(16, 8, sparsity=0.75, rngs=nnx.Rngs(0))
  >>> optimizer = nnx.Optimizer(layer, pruning.wrap_optax(optax.sgd(0.0), pruning.magnitude_pruner(
  ...     jaxsparse.Unstructured(0.875))), wrt=nnx.Param)
  >>> _ = optimizer.update(layer, nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 16)))))(layer))
  >>> layer.density, float(jnp.mean(layer.kernel[...] != 0))
  (0.25, 0.125)
  >>> _ = pruning.apply_masks(layer, pruning.get_masks(optimizer))
  >>> layer.density
  0.125

  Linen variables (``{"params": ..., "sparsity": ..., ...}``) keep such masks in their ``"sparsity"`` collection
  (``MaskedDense``, the masked convs of :func:`jaxsparse.sparsify_linen`): pass the variables and the masks of their
  ``"params"`` (``get_masks`` of a ``TrainState``, paths like ``"Dense_0.kernel"``), and the result holds the pruned
  parameters and each ``"sparsity"`` mask narrowed to the weights both keep, so :func:`jaxsparse.summary` and the
  torch export report the new pattern (the other collections are kept as they are).

  Block-sparse layers (``BlockSparseLinear``, ``BlockSparseDense`` and the block-sparse layers of
  :func:`jaxsparse.sparsify_linen`) keep their pattern: a block the masks zero in part stays kept, holding the zeroed
  weights, and one they zero entirely stays kept too, as a zero block, which their density, :func:`jaxsparse.summary`
  and products still count; ``apply_masks`` then warns (a ``UserWarning``), naming the layer, the blocks and how to
  rebuild it without them. It does not drop such blocks itself: a block-sparse layer's kept blocks are static index
  arrays, which the kernel's shape ``(nnz_blocks, bk, bn)`` follows, so dropping blocks would change that shape under
  the optimizer state (its moments, :func:`wrap_optax`'s masks), under a stack of layers (one block count for all)
  and, in Linen, against ``BlockSparseDense``, whose kernel's shape follows its ``density``. Its outputs are right
  either way (the zeroed weights are zero); rebuild it once training is over. Masks traced under ``jit`` are not
  checked.

  Args:
    target: a parameter tree with the masks' structure, Linen variables whose ``"params"`` have it, or an
      ``nnx.Module`` whose ``nnx.Param`` state has it (an ``nnx.State``, or plain nested dicts with its keys:
      ``{"linear": {"kernel": mask, "bias": None}}``).
    masks: from :func:`get_masks` or :func:`magnitude_masks`: a bool array of its parameter's exact shape (never
      broadcast) or ``None`` per leaf.

  Returns:
    For a parameter tree, a new tree with the pruned entries set to zero (same shapes and dtypes; a leaf
    whose mask is ``None`` is kept as it is); for Linen variables, a new dict with those parameters and narrowed
    ``"sparsity"`` masks; for an ``nnx.Module``, ``target`` itself, updated in place (its parameters, and the masks
    of its masked layers).

  Raises:
    ValueError: naming the path, for a mask whose shape is not its parameter's, or one where the parameters have
      none; a Linen ``"sparsity"`` mask not of its kernel's shape; masks of an NNX model that leave out some of its
      parameters (give ``None`` for those not pruned).
    TypeError: naming the path, for a mask that is not boolean (a float 0.5 or an int 2 would be read as "kept");
      a Linen ``"sparsity"`` mask that is not boolean (the layer's forward refuses it too).
  """
  if isinstance(target, nnx.Module):
    params = nnx.as_pure(nnx.state(target, nnx.Param))
    masks = _like_params(_checked_masks(masks, params), params)
    nnx.update(target, _where_masked(masks, params, jnp.zeros_like, params))
    _narrow_layer_masks(target, masks)
    _warn_emptied_blocks(_nnx_block_masks(target, masks), linen=False)
    return target
  params_masks = _linen_params_masks(target, masks)
  if params_masks is not None:
    boxed = target["params"]
    params = nn.meta.unbox(boxed)  # nn.Partitioned boxes (sparsify_linen carries the dense layers' over)
    params_masks = _checked_masks(params_masks, params)
    out = dict(target)
    out["params"] = _rebox(boxed, _where_masked(params_masks, params, jnp.zeros_like, params))
    if SPARSITY in target:
      out[SPARSITY] = _narrow_linen_masks(target[SPARSITY], params_masks)
      _warn_emptied_blocks(_linen_block_masks(target[SPARSITY], params_masks), linen=True)
    return out
  masks = _checked_masks(masks, target)
  return _where_masked(masks, target, jnp.zeros_like, target)


def _linen_params_masks(target: Any, masks: Any) -> Any:
  """The masks of ``target["params"]`` when ``target`` is Linen variables and ``masks`` are keyed like their
  ``"params"`` (as ``get_masks`` of a ``TrainState`` gives them) or are ``{"params": masks}``; else ``None`` (a
  parameter tree with the masks' own structure)."""
  if not (isinstance(target, Mapping) and isinstance(target.get("params"), Mapping)):
    return None
  if not (isinstance(masks, Mapping) and "params" in masks):
    return masks
  if set(masks) == {"params"} and set(target) != {"params"}:
    return masks["params"]
  return None


def _is_box(x: Any) -> bool:
  return isinstance(x, nn.meta.AxisMetadata)


def _rebox(boxed: Any, values: Any) -> Any:
  """``values`` (an unboxed copy of ``boxed``) in ``boxed``'s ``nn.Partitioned`` boxes."""
  return jax.tree.map(lambda b, v: b.replace_boxed(v) if _is_box(b) else v, boxed, values, is_leaf=_is_box)


def _narrow_linen_masks(sparsity: Mapping, masks: Any) -> dict:
  """The ``"sparsity"`` collection with each layer's ``"mask"`` narrowed to the weights it and its kernel's mask in
  ``masks`` both keep (other patterns, block-sparse indices or N:M positions, are kept as they are)."""
  paths, leaves, _ = flatten_with_paths(masks)
  by_path = dict(zip(paths, leaves, strict=True))

  def walk(tree: Mapping, prefix: tuple[str, ...]) -> dict:
    out = {}
    for key, value in tree.items():
      if isinstance(value, Mapping):
        out[key] = walk(value, (*prefix, str(key)))
        continue
      new = by_path.get(path_str((*prefix, "kernel"))) if key == "mask" else None
      if new is not None:
        old = pattern_mask(nn.meta.unbox(value), np.shape(new), path=path_str(prefix))
        value = _rebox(value, old & new) if _is_box(value) else old & new
      out[key] = value
    return out

  return walk(sparsity, ())


def _masks_by_path(masks: Any) -> dict[str, Any]:
  """``{dotted path: mask}`` of the masks of an NNX model's parameters (``None`` left out)."""
  pairs = jax.tree_util.tree_flatten_with_path(unwrap_variables(masks), is_leaf=_is_none)[0]
  return {path_str(kp): m for kp, m in pairs if m is not None}


def _narrow_layer_masks(model: nnx.Module, masks: Any) -> None:
  """Sets the ``mask`` of each ``MaskedLinear`` / ``MaskedConv`` of ``model`` to the weights it and its kernel's
  mask in ``masks`` both keep (a weight either prunes is zero and gets no gradient)."""
  by_path = _masks_by_path(masks)
  for path, node in nnx.iter_modules(model):
    mask = by_path.get(path_str((*path, "kernel"))) if isinstance(node, MaskedLinear | MaskedConv) else None
    if mask is not None:
      node.mask[...] = node.mask[...] & mask


def _nnx_block_masks(model: nnx.Module, masks: Any) -> list[tuple[str, Any, int]]:
  """``(path, kernel mask, blocks of the grid)`` of each ``BlockSparseLinear`` of ``model`` that ``masks`` prune."""
  by_path = _masks_by_path(masks)
  found = []
  for path, node in nnx.iter_modules(model):
    mask = by_path.get(path_str((*path, "kernel"))) if isinstance(node, BlockSparseLinear) else None
    if mask is not None:
      (bk, bn), where = node.block_shape, path_str(path) or "(the model itself)"
      found.append((where, mask, (node.in_features // bk) * (node.out_features // bn)))
  return found


def _linen_block_masks(sparsity: Mapping, masks: Any) -> list[tuple[str, Any, int]]:
  """``(path, kernel mask, blocks of the grid)`` of each block-sparse layer of Linen variables (its ``"sparsity"``
  index arrays) that ``masks`` (of their ``"params"``) prune."""
  paths, leaves, _ = flatten_with_paths(masks)
  by_path = dict(zip(paths, leaves, strict=True))
  found = []

  def walk(tree: Mapping, prefix: tuple[str, ...]) -> None:
    mask = by_path.get(path_str((*prefix, "kernel"))) if INDEX_FIELDS[0] in tree else None
    if mask is not None:  # the grid from the offsets: (K // bk + 1,) and (N // bn + 1,)
      kb, nb = (np.shape(nn.meta.unbox(tree[f]))[-1] - 1 for f in ("row_offsets", "col_offsets"))
      found.append((path_str(prefix) or "(the variables themselves)", mask, kb * nb))
    for key, value in tree.items():
      if isinstance(value, Mapping):
        walk(value, (*prefix, str(key)))

  walk(sparsity, ())
  return found


def _warn_emptied_blocks(found: list[tuple[str, Any, int]], *, linen: bool) -> None:
  """Warns, naming the layer, where a block-sparse kernel's mask (``(..., nnz_blocks, bk, bn)``) prunes whole kept
  blocks: the layer keeps them, as zero blocks (its kept blocks are static; see :func:`apply_masks`). Masks traced
  under ``jit`` are not checked."""
  for where, mask, blocks in found:
    if not is_concrete(mask):
      continue
    mask = np.asarray(mask)
    *stack, nnz, bk, bn = mask.shape
    emptied = int(np.sum(~mask.any(axis=(-2, -1))))
    if not emptied:
      continue
    layers = math.prod(stack)
    left = nnz - emptied if layers == 1 else None
    what = "block-sparse layer" if linen else "BlockSparseLinear"
    counted = f"{emptied} of the {nnz} kept" if layers == 1 else f"{emptied} of the {layers} x {nnz} kept"
    if left is None:
      fix = ("to drop them, rebuild the stack's layers from their weights (BlockSparseLinear.from_dense of each "
             "layer's to_dense(); a stack holds one block count for all its layers)")
    elif left == 0:
      fix = "every kept block is zero: remove the layer, or keep it as it is"
    elif linen:
      fix = (f"to drop them, rebuild the layer: BlockSparseDense(..., density={left}/{blocks}) with the variables of "
             f"w = jaxsparse.BlockSparseMatrix.from_dense(dense_kernel, ({bk}, {bn})), which keeps the nonzero blocks "
             "of its dense kernel: params kernel w.data, sparsity w.index_arrays()")
    else:
      fix = (f"to drop them, rebuild the layer from its weights: BlockSparseLinear.from_dense(layer.to_dense(), "
             f"density={left}/{blocks}, block_shape=({bk}, {bn})) keeps its {left} blocks of largest norm, the ones "
             "left")
    _utils.warn_at_caller(
        f"pruning.apply_masks: the masks zero {counted} {bk}x{bn} blocks of the {what} at {where!r} entirely. They "
        "stay kept, as zero blocks (a block-sparse layer's kept blocks are static index arrays, which its kernel's "
        "shape (nnz_blocks, bk, bn) follows), so its density, jaxsparse.summary and products still count them; its "
        f"outputs are right (the pruned weights are zero). {fix[0].upper()}{fix[1:]}.",
        UserWarning,
    )


def _like_params(masks: Any, params: Any) -> Any:
  """``masks`` (checked) in the structure of an NNX model's ``params`` (an ``nnx.State``): masks given as plain nested
  dicts (or lists) with the same keys are rebuilt by path; raises, naming them, for parameters they leave out or
  entries the parameters lack."""
  if jax.tree.structure(masks, is_leaf=_is_none) == jax.tree.structure(params):
    return masks
  given = {path_str(kp): m for kp, m in jax.tree_util.tree_flatten_with_path(masks, is_leaf=_is_none)[0]}
  param_paths = [path_str(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  missing = [p for p in param_paths if p not in given]
  extra = sorted(set(given) - set(param_paths))
  if missing or extra:
    listing = lambda paths: ", ".join(paths[:12]) + (" ..." if len(paths) > 12 else "")
    raise ValueError(
        "masks must have the structure of the model's nnx.state(model, nnx.Param): a mask or None for each of its "
        f"parameters {listing(param_paths)}"
        + (f"; masks lack {listing(missing)} (give None for parameters not pruned)" if missing else "")
        + (f"; masks have {listing(extra)}, which the parameters do not" if extra else "")
        + ". pruning.get_masks / magnitude_masks give them so."
    )
  return jax.tree_util.tree_map_with_path(lambda kp, _: given[path_str(kp)], params)


def _checked_masks(masks: Any, target: Any) -> Any:
  """``masks`` with every mask checked against its parameter in ``target``, naming the path: its exact shape (a
  mask is never broadcast) and a bool dtype (each returned as a bool array, ``_utils.check_mask``)."""
  mask_paths, mask_leaves, treedef = flatten_with_paths(masks)
  target_paths, target_leaves, _ = flatten_with_paths(target)
  shapes = {p: tuple(np.shape(x)) for p, x in zip(target_paths, target_leaves, strict=True)}
  checked = []
  for path, m in zip(mask_paths, mask_leaves, strict=True):
    if path not in shapes:
      raise ValueError(f"masks has a mask at {path!r}, where the parameters have none; parameters: "
                       f"{', '.join(list(shapes)[:12])}{' ...' if len(shapes) > 12 else ''}.")
    if tuple(np.shape(m)) != shapes[path]:
      raise ValueError(
          f"{path}: the mask has shape {tuple(np.shape(m))}, the parameter {shapes[path]}; a mask must have its "
          "parameter's shape (it is not broadcast)."
      )
    checked.append(_utils.check_mask(m, shapes[path], name=f"masks[{path!r}]"))
  return jax.tree_util.tree_unflatten(treedef, checked)
