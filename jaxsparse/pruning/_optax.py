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

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax

from jaxsparse._rules import Views
from jaxsparse._rules import flatten_with_paths
from jaxsparse._rules import resolve_views
from jaxsparse._rules import unwrap_variables
from jaxsparse.formats._masks import replicated
from jaxsparse.formats._masks import split_like
from jaxsparse.pruning._apply import is_none
from jaxsparse.pruning._apply import rebox
from jaxsparse.pruning._apply import where_masked
from jaxsparse.pruning._compressed import stored_value_paths
from jaxsparse.pruning._compressed import stored_values_error
from jaxsparse.pruning._compressed import stored_values_known
from jaxsparse.pruning._layer_masks import LayerMasks
from jaxsparse.pruning._layer_masks import allowed_units
from jaxsparse.pruning._layer_masks import check_layer_masks
from jaxsparse.pruning._layer_masks import own_mask_paths
from jaxsparse.pruning._layer_masks import own_masks_known
from jaxsparse.pruning._layer_masks import resolve_layer_masks
from jaxsparse.pruning._layer_masks import warn_zeros_kept
from jaxsparse.pruning._schedules import Schedule
from jaxsparse.pruning._schedules import one_shot
from jaxsparse.pruning._scores import check_scope
from jaxsparse.pruning._scores import frozen_rules
from jaxsparse.pruning._scores import masks_at
from jaxsparse.pruning._scores import plan
from jaxsparse.pruning._scores import target_masks
from jaxsparse.pruning._scores import unflatten_masks
from jaxsparse.pruning._stacks import Stacks
from jaxsparse.pruning._stacks import resolve_stacks

__all__ = [
    "Pruner",
    "PruningState",
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
    masks: a tree with the parameters' structure: a bool array per pruned parameter, ``None`` elsewhere; where the
      parameters are Linen boxes (``nn.Partitioned`` params kept boxed in a ``TrainState``), each mask is in its
      parameter's box (its names: ``nn.get_partition_spec`` shards it like its kernel). :func:`get_masks` unboxes.
    inner_state: the state of the wrapped optimizer.
    pruned_nonzero: int32 scalar, the number of ``update`` calls (after the first) whose ``params`` had a finite
      nonzero weight where the previous update's masks prune: the wrapper's updates did not reach the parameters
      unchanged (a transformation after it in a chain), or the parameters were changed by hand. :func:`get_masks`
      raises while it is not 0.
    pruned_nonfinite: int32 scalar, the number of ``update`` calls (after the first) whose ``params`` had a NaN or
      infinite weight where the previous update's masks prune: the weights went non-finite in training (a NaN or inf
      in a batch, a loss that overflowed), and an update of ``-param`` cannot zero them (``NaN - NaN`` is NaN).
      :func:`get_masks` raises while it is not 0, saying so.
  """

  count: jax.Array
  key: jax.Array
  masks: Any
  inner_state: Any
  pruned_nonzero: jax.Array
  pruned_nonfinite: jax.Array


def magnitude_pruner(
    rules: Any, schedule: Schedule | None = None, *, scope: str = "layer", views: Views | None = None,
    stacks: Stacks | None = None, layer_masks: LayerMasks | None = None,
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
    scope: ``"layer"`` (each parameter, and each layer of a stack, to its rule's sparsity) or ``"global"``
      thresholds (all layers of a rule ranked together, stacks included; see :func:`magnitude_masks`).
    views: ``{regex: input axes}`` of multi-axis kernels, for blocks and N:M groups (see
      :func:`magnitude_masks`); pass :func:`kernel_views` of the model for bias-free attention projections.
    stacks: ``{regex: leading layer axes}`` of stacked parameters (``nnx.vmap`` / ``nn.scan`` over layers), each
      layer pruned on its own (see :func:`magnitude_masks`). An optimizer hands the pruner bare parameters, which do
      not tell their stacks: pass :func:`layer_stacks` of the model.
    layer_masks: ``{parameter path: bool mask}`` of the layers with a mask of their own (a model that is already
      sparse); pass :func:`layer_masks` of the model. Each such layer is ranked inside its mask, so a rule looser than
      the layer keeps the layer's own weights (warned at ``init``) and :func:`get_masks` reports what the model keeps
      (see :func:`set_pruner`). Read once, here. Given the model itself (``pruner.init(model, key)``) the pruner reads
      its layers' masks (these win, path by path); given parameters whose kernels mark a masked layer (the
      ``nnx.State`` of ``nnx.Optimizer``) without their masks here, ``init`` warns naming them.

  Returns:
    A :class:`Pruner` for :func:`wrap_optax`.

  Raises:
    TypeError: ``schedule`` is not a :class:`Schedule`; ``views`` (``stacks``) with a key that is not a regex string
      or a value that is not a positive int (an int ``>= 0``); ``rules`` neither a structure nor a mapping, a rule
      key that is not a string or a rule value that is not a structure or ``None``; ``layer_masks`` not a mapping of
      paths to bool arrays.
    ValueError: ``scope`` is not ``"layer"`` or ``"global"``; empty ``rules`` or a rule key that is not a valid
      regex. The structures are checked against the parameters when the wrapped optimizer's ``init`` runs, which
      raises a ``ValueError`` for a structure that cannot apply to a parameter it matches, and, given an
      ``nnx.Module``, for a layer it holds at several paths (tied) that the rules give different structures, as
      :func:`jaxsparse.sparsify` does. Parameters (the ``nnx.State`` that ``nnx.Optimizer`` hands the optimizer) hold
      a tied layer once, at its first path: a rule naming only its other path then matches nothing and warns; check
      such rules on the model with :func:`magnitude_masks`. A rule matching the stored values of an already
      N:M-compressed layer or the kept blocks of a block-sparse layer raises where the parameters show them (see
      :func:`magnitude_masks`).
  """
  schedule = one_shot() if schedule is None else schedule
  if not isinstance(schedule, Schedule):
    raise TypeError(f"schedule must be a pruning.Schedule (one_shot, gradual, periodic), got {schedule!r}.")
  check_scope(scope)
  rules = frozen_rules(rules)  # bad rules fail here, not at the wrapped optimizer's init
  resolve_views(views)  # bad views and stacks fail here, not at the first step
  resolve_stacks(stacks)
  layer_masks = check_layer_masks(layer_masks)

  def at_step(masks, params, step, *, warn):
    paths, leaves, treedef, targets = plan(params, rules, views=views, stacks=stacks, warn=warn)
    prior = None if masks is None else target_masks(masks, treedef, targets)
    new = masks_at(
        leaves, targets, lambda spec: schedule.sparsity(step, spec.target_sparsity), scope=scope, prior=prior,
        allowed=allowed_units(targets, resolve_layer_masks(params, layer_masks, targets, warn=warn), paths,
                              scope=scope, warn=warn),
    )
    return unflatten_masks(treedef, len(leaves), targets, new)

  def init(params, key):
    del key
    return at_step(None, params, 0, warn=True)

  def update(masks, params, grads, step, key):
    del grads, key
    return at_step(masks, params, step, warn=False)

  return Pruner(init, update, schedule.is_update_step)


def _gathered(tree: Any) -> Any:
  """``tree``'s arrays gathered onto every device where explicit mesh axes split them (a no-op otherwise): the
  pruners rank weights over whole arrays, and under explicit axes JAX refuses to flatten or sort a split dim."""
  return jax.tree.map(lambda a: replicated(a) if isinstance(a, jax.Array) else a, tree)


def _split_like(masks: Any, params: Any) -> Any:
  """``masks`` split like their parameters where explicit mesh axes split those (a no-op otherwise)."""
  return jax.tree.map(lambda m, p: m if m is None else split_like(m, p), masks, params, is_leaf=is_none)


def _any_pruned(masks: Any, params: Any, where: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """Bool scalar: whether ``where`` holds of any weight of ``params`` that ``masks`` prune."""
  found = jax.tree.map(
      lambda m, p: None if m is None else jnp.any(where(jnp.asarray(p)) & ~m), masks, params, is_leaf=is_none
  )
  leaves = jax.tree.leaves(found)
  return jnp.any(jnp.stack(leaves)) if leaves else jnp.zeros((), bool)


def _is_masked_node(x: Any) -> bool:
  """``optax.MaskedNode``: where ``optax.masked`` / ``optax.multi_transform`` leave a parameter out of a group."""
  return isinstance(x, optax.MaskedNode)


def _keep_tree(masks: Any, params: Any) -> Any:
  """Masks with every unmasked leaf replaced by a scalar ``True``: a tree with the parameters' structure."""
  return jax.tree.map(lambda m, p: jnp.ones((), bool) if m is None else m, masks, params, is_leaf=is_none)


def _refuse_stored(stored: dict[str, str], masks: Any) -> None:
  """Raises where ``masks`` prune the stored values (:func:`~jaxsparse.pruning._compressed.stored_value_paths`) of an
  N:M-compressed or block-sparse layer: a pruner of one's own, which does not know them (jaxsparse's pruners refuse
  them themselves, told by :func:`~jaxsparse.pruning._compressed.stored_values_known`)."""
  paths, leaves, _ = flatten_with_paths(masks)  # the None of an unpruned parameter is no leaf
  for path, mask in zip(paths, leaves, strict=True):
    if path in stored:
      raise stored_values_error(path, stored[path], tuple(mask.shape), "the pruner (a rule of it matches this path)")


def wrap_optax(
    inner: optax.GradientTransformation,
    pruner: Pruner,
    *,
    seed: int = 0,
    reset_state: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` so that it trains a sparse model: masked updates, pruned weights kept at zero.

  Use it wherever an optax optimizer goes: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``,
  ``TrainState.create(..., tx=tx)``, or a raw ``tx.update`` loop. ``update`` needs ``params``. Linen params kept
  boxed (``nn.Partitioned``) are pruned through their boxes: the pruner sees plain arrays, the inner optimizer and
  the updates keep the boxes.

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
  ``PruningState.pruned_nonzero`` (``pruned_nonfinite`` where they are NaN or infinite: training went non-finite),
  and :func:`get_masks` then raises, saying which.

  A model that is already sparse (``MaskedLinear``, ``MaskedConv``, Linen ``MaskedDense``) shows the pruner its
  parameters only, not its layers' own masks: give the pruner ``layer_masks=`` (:func:`layer_masks`). ``init`` warns
  once, naming them, about the kernels of ``MaskedLinear`` / ``MaskedConv`` layers (their ``nnx.Param`` marks them)
  that a rule of :func:`magnitude_pruner`, :func:`set_pruner` or :func:`rigl_pruner` prunes without their masks, and
  elsewhere (Linen ``params``, a pruner of your own) where the pruner's first masks keep weights that are exactly zero
  in a kernel that also holds nonzero ones (the mark of such a layer the pruner was not told of).

  Around it and inside it, the optax combinators (the pruning guide has more):

  * ``optax.MultiSteps(wrap_optax(tx, pruner), k)``: the pruner's step (``PruningState.count``, which the schedule
    reads) counts optimizer steps, not micro-steps, and RigL grows on the accumulated gradient; inside the wrapper
    (``wrap_optax(optax.MultiSteps(tx, k).gradient_transformation(), pruner)``) it counts micro-steps.
  * ``optax.apply_if_finite(wrap_optax(tx, pruner), n)``: a skipped step leaves the masks, the pruner's step and the
    parameters as they were; inside the wrapper a skipped step still counts, and a mask update reads its gradient.
  * ``optax.masked`` / ``optax.multi_transform`` (a frozen group: ``optax.set_to_zero()``) inside the wrapper, whose
    rules still decide what is pruned; or the wrapper in one group, which sees that group only. One wrapper in each
    of several groups is not supported (:func:`get_masks` raises): wrap the ``multi_transform`` once.
  * Not supported: ``optax.lookahead`` around the wrapper (its slow weights stay dense and replace the fast ones at
    each sync; :func:`get_masks` raises), and clipping or anything else that changes the updates after it.

  Args:
    inner: the optimizer to wrap.
    pruner: :func:`magnitude_pruner`, :func:`set_pruner`, :func:`rigl_pruner` or your own
      :class:`Pruner`.
    seed: seeds the PRNG key kept in the state (random masks and growth).
    reset_state: zero the inner state of pruned and newly grown weights at mask updates: the leaves of the
      inner state that have their parameter's shape (momentum, second moments); factored statistics of another
      shape (``optax.adafactor``'s) stay as they are. It needs an inner state that
      ``optax.tree_utils.tree_map_params`` understands (those of ``optax.masked`` and ``optax.multi_transform``
      included; ``init`` raises a ``ValueError`` for one it does not, such as ``optax.sm3``'s: pass ``False``
      then).

  Returns:
    A ``GradientTransformationExtraArgs`` whose state is a :class:`PruningState`.

  Raises:
    TypeError: ``pruner`` is not a :class:`Pruner`. Later, ``init`` raises a ``ValueError`` with
      ``reset_state=True`` for an inner state it cannot map to the parameters, for masks of the pruner on the stored
      values of an N:M-compressed layer or the kept blocks of a block-sparse layer (a ``CompressedNMLinear`` /
      ``CompressedNMEmbed`` / ``BlockSparseLinear`` / ``TensorParallelBlockSparseLinear`` of an ``nnx.Optimizer``,
      whose params carry the layers' mark; not a Linen ``CompressedNMDense`` / ``BlockSparseDense`` in a
      ``TrainState``, whose bare ``params`` do not tell), and the pruner's own errors (see :func:`magnitude_pruner`);
      ``update`` raises a ``ValueError`` when called without ``params``.
  """
  inner = optax.with_extra_args_support(inner)
  if not isinstance(pruner, Pruner):
    raise TypeError(f"pruner must be a pruning.Pruner (magnitude_pruner, set_pruner, rigl_pruner), got {pruner!r}.")

  def init(params):
    key, init_key = jax.random.split(jax.random.PRNGKey(seed))
    _, leaves, treedef = flatten_with_paths(params)
    boxed = jax.tree_util.tree_unflatten(treedef, leaves)  # NNX variables unwrapped; Linen boxes kept
    plain = nn.meta.unbox(boxed)  # the pruner sees plain arrays (a TrainState's nn.Partitioned params unboxed)
    # The pruner sees plain arrays, which cannot tell stored values (N:M-compressed, kept blocks) from a dense weight;
    # params are still what the optimizer was given: the nnx.Param variables of an nnx.Optimizer (whose layers mark
    # their stored values), Linen boxes.
    stored = stored_value_paths(params)
    # The kernels of layers with a mask of their own (MaskedLinear, MaskedConv) are marked in the params of an
    # nnx.Optimizer; the pruner sees plain arrays, so it is told them here (it warns where it lacks their masks).
    with stored_values_known(stored), own_masks_known(own_mask_paths(params)) as seen:
      masks = _split_like(jax.jit(lambda p, k: pruner.init(_gathered(p), k))(plain, init_key), plain)
    _refuse_stored(stored, masks)
    # An nnx.Optimizer's params mark the kernels of masked layers (above); exact zeros elsewhere are weights (a bf16
    # initializer draws some). Bare params (Linen) tell nothing: their zeros kept are the mark of a layer's own mask.
    is_variable = lambda v: isinstance(v, nnx.Variable)
    if not any(is_variable(v) for v in jax.tree.leaves(params, is_leaf=is_variable)):
      warn_zeros_kept(masks, plain, skip=seen)
    inner_state = inner.init(params)
    if reset_state:
      try:  # an inner state that reset cannot map fails here, with a way out, not inside the first update's trace
        jax.eval_shape(lambda p, m: reset(inner.init(p), m, m, p), boxed, masks)
      except ValueError as e:
        raise ValueError(
            "wrap_optax(reset_state=True) cannot find the per-parameter state of the inner optimizer (its state "
            "does not hold trees with the parameters' structure, as optax.sm3's does not); pass reset_state=False "
            f"to leave its state as it is at mask updates. The error was: {e}"
        ) from e
    # Two arrays, not one shared: a step that donates the state would donate the same buffer twice.
    return PruningState(jnp.zeros((), jnp.int32), key, rebox(boxed, masks), inner_state, jnp.zeros((), jnp.int32),
                        jnp.zeros((), jnp.int32))

  def reset(inner_state, new_masks, old_masks, params):
    kept = jax.tree.map(lambda n, o: n & o, new_masks, old_masks)
    keep = rebox(params, _keep_tree(kept, nn.meta.unbox(params)))  # boxed as the parameters the inner state has

    def reset_leaf(s, k):
      # Only state of the parameter's own shape is per weight; factored statistics (optax.adafactor's row and
      # column second moments) and scalars are shared by kept weights and stay as they are.
      if not hasattr(s, "dtype") or (k.ndim and s.shape != k.shape):
        return s
      return jnp.where(k, s, jnp.zeros((), s.dtype))

    # optax.masked / optax.multi_transform (and optimizers built on them, optax.contrib.muon) keep their inner
    # state over the parameters with an optax.MaskedNode in place of each parameter outside their group: no state.
    return optax.tree_utils.tree_map_params(inner, reset_leaf, inner_state, keep, is_leaf=_is_masked_node)

  def update(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError("pruning.wrap_optax needs params: call tx.update(grads, state, params).")
    step = state.count
    key, update_key = jax.random.split(state.key)
    # Linen params kept boxed (nn.Partitioned in a TrainState): masks are computed and applied on the plain arrays,
    # the inner optimizer and the results keep the boxes.
    plain_params, plain_updates = nn.meta.unbox(params), nn.meta.unbox(updates)
    # After an update, the weights its masks prune are zero, unless something changed the updates on the way, or
    # they went non-finite (a NaN weight plus its update of -NaN stays NaN): told apart, as their fixes differ.
    old_masks = nn.meta.unbox(state.masks)
    stray = (step > 0) & _any_pruned(old_masks, plain_params, lambda p: jnp.isfinite(p) & (p != 0))
    nonfinite = (step > 0) & _any_pruned(old_masks, plain_params, lambda p: ~jnp.isfinite(p))
    pruned_nonzero = state.pruned_nonzero + stray.astype(jnp.int32)
    pruned_nonfinite = state.pruned_nonfinite + nonfinite.astype(jnp.int32)

    def mask_update(masks, inner_state):
      new = pruner.update(_gathered(masks), _gathered(plain_params), _gathered(plain_updates), step, update_key)
      new = _split_like(new, plain_params)
      if reset_state:
        inner_state = reset(inner_state, new, masks, params)
      return new, inner_state

    masks, inner_state = lax.cond(
        pruner.is_update_step(step), mask_update, lambda m, s: (m, s), nn.meta.unbox(state.masks), state.inner_state
    )
    grads = rebox(updates, where_masked(masks, plain_updates, jnp.zeros_like, plain_updates))
    new_updates, inner_state = inner.update(grads, inner_state, params, **extra_args)
    new_updates = rebox(new_updates, where_masked(masks, nn.meta.unbox(new_updates), jnp.negative, plain_params))
    return new_updates, PruningState(step + 1, key, rebox(params, masks), inner_state, pruned_nonzero,
                                     pruned_nonfinite)

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
    check: raise when the state recorded pruned weights that were not zero (``PruningState.pruned_nonzero``,
      ``pruned_nonfinite``); ``False`` reads the masks anyway (inside ``jit`` there is no check).

  Returns:
    The masks, a tree with the parameters' structure (Linen boxes read through: plain masks in their place): a bool
    array of each pruned parameter's shape, ``None``
    for the parameters no rule matched (and, with :func:`wrap_optax` inside ``optax.masked`` or one group of
    ``optax.multi_transform``, for the parameters outside its group). They are the state's own arrays: copy them
    (``jax.tree.map(np.array, masks)``) to keep them past a step that donates the state.

  Raises:
    ValueError: when there is no :class:`PruningState` in ``state``, or several (one :func:`wrap_optax` in each
      group of an ``optax.multi_transform``: wrap the ``multi_transform`` once instead); or (``check``) when an
      update found weights that the masks prune not zero, so the masks do not describe the trained parameters: a
      transformation after :func:`wrap_optax` in an ``optax.chain`` (or a wrapper around it such as
      ``optax.lookahead``) changed its updates (see :func:`wrap_optax`), or, where those weights are NaN or
      infinite, the training went non-finite (the message says which).
  """
  if isinstance(state, nnx.Optimizer):
    state = state.opt_state
  elif hasattr(state, "opt_state") and not isinstance(state, PruningState):
    state = state.opt_state
  found = [
      x for x in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, PruningState))
      if isinstance(x, PruningState)
  ]
  if len(found) > 1:
    raise ValueError(
        f"state must hold exactly one pruning.PruningState (the state of pruning.wrap_optax), found {len(found)}: "
        "one pruning.wrap_optax in each group of an optax.multi_transform (or optax.masked) is not supported. Wrap "
        "the whole optimizer once instead, pruning.wrap_optax(optax.multi_transform({...}, labels), pruner), with "
        "a rule for each group's parameters ({regex: structure or None})."
    )
  if not found:
    raise ValueError("state must hold exactly one pruning.PruningState (the state of pruning.wrap_optax), found 0.")
  pruning_state = unwrap_variables(found[0])
  try:
    stray = int(pruning_state.pruned_nonzero) if check else 0
    nonfinite = int(pruning_state.pruned_nonfinite) if check else 0
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
    stray = nonfinite = 0  # inside jit: nothing to check
  changed = (
      "A transformation after wrap_optax (or a wrapper around it that changes its updates or the weights, such as "
      "optax.lookahead, which is not supported) changed its updates: wrap_optax must be the last transformation, "
      "with the learning rate and everything else that changes updates inside it, e.g. "
      "pruning.wrap_optax(optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(lr)), pruner), not "
      "optax.chain(pruning.wrap_optax(optax.scale_by_adam(), pruner), optax.scale_by_learning_rate(lr)). If you "
      "changed the parameters yourself, pass check=False."
  )
  if nonfinite:
    also = "" if not stray else (
        f" Besides, {stray} updates found finite weights that the masks prune not zero: {changed[0].lower()}"
        f"{changed[1:]}")
    raise ValueError(
        f"{nonfinite} of {int(pruning_state.count)} updates of pruning.wrap_optax found weights that its masks prune "
        "not finite (NaN or inf): the parameters went non-finite in training, from gradients that were not finite "
        "(a NaN or inf in a batch, a loss that overflowed, a learning rate too large), and a pruned weight that is "
        "NaN stays NaN (its update of -param cannot zero it), so the masks do not describe the parameters. Find the "
        "first step whose loss or gradients are not finite (jax.config.update('jax_debug_nans', True), or "
        "jnp.isfinite of the loss), fix the data or the loss and train again from before it; "
        "optax.apply_if_finite(pruning.wrap_optax(tx, pruner), max_consecutive_errors) skips such steps, leaving "
        "the parameters and masks as they were. Pass check=False to read the masks anyway." + also
    )
  if stray:
    raise ValueError(
        f"{stray} of {int(pruning_state.count)} updates of pruning.wrap_optax found "
        "weights that its masks prune not zero, so the masks do not describe the trained parameters (a model "
        f"sparsified with them would differ from the trained one). {changed}"
    )
  # Inside optax.masked / optax.multi_transform the masks hold an optax.MaskedNode for each parameter outside the
  # wrapper's group: not pruned by it, so None, as for a parameter no rule matched.
  # Masks of Linen params kept boxed are kept boxed like them (sharded like their kernels); they are read unboxed.
  masks = nn.meta.unbox(pruning_state.masks)
  return jax.tree.map(lambda m: None if _is_masked_node(m) else m, masks, is_leaf=_is_masked_node)
