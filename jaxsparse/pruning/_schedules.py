"""Pruning schedules: when masks are recomputed, and at what sparsity.

A :class:`Schedule` is a pair of pure functions of the (possibly traced) step: ``sparsity(step,
final)`` gives the sparsity in force at ``step`` on the way to a structure's ``final`` sparsity, and
``is_update_step(step)`` says whether masks are recomputed at ``step``.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import _utils

__all__ = ["Schedule", "gradual", "one_shot", "periodic", "polynomial_sparsity"]


class Schedule(NamedTuple):
  """When and how far to prune.

  Attributes:
    sparsity: ``(step, final) -> sparsity`` (a float32 scalar): the sparsity in force at ``step``
      when the structure's target is ``final``; 0 before pruning begins and exactly ``final`` once
      it is reached.
    is_update_step: ``step -> bool`` scalar: whether masks are recomputed at ``step``.

  :func:`one_shot`, :func:`gradual` and :func:`periodic` make them; a custom one, here pruning in two steps
  (half the target at step 10, all of it at step 20):

  >>> import jax.numpy as jnp
  >>> from jaxsparse import pruning
  >>> two_steps = pruning.Schedule(
  ...     sparsity=lambda t, final: jnp.float32(final) * jnp.clip(jnp.asarray(t) // 10, 0, 2) / 2,
  ...     is_update_step=lambda t: (jnp.asarray(t) == 10) | (jnp.asarray(t) == 20))
  >>> [round(float(two_steps.sparsity(t, 0.8)), 3) for t in (0, 10, 15, 20, 30)], bool(two_steps.is_update_step(15))
  ([0.0, 0.4, 0.4, 0.8, 0.8], False)
  >>> import jaxsparse
  >>> pruner = pruning.magnitude_pruner(jaxsparse.Unstructured(sparsity=0.8), two_steps)
  """

  sparsity: Callable[[jax.typing.ArrayLike, float], jax.Array]
  is_update_step: Callable[[jax.typing.ArrayLike], jax.Array]


def _check_step(value: object, *, name: str, minimum: int = 0) -> int:
  """``value`` as an int ``>= minimum``: a Python or NumPy int, or a concrete 0-d integer array (``jnp.int32(10)``,
  a step read back from an optimizer state); never a bool, a float or a traced value."""
  step = None
  if not isinstance(value, bool | np.bool_) and np.dtype(getattr(value, "dtype", np.int64)) != np.bool_:
    try:
      step = operator.index(value)
    except TypeError:  # a float, a traced value (TracerIntegerConversionError is a TypeError), an array of more dims
      pass
  if step is None or step < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {name}={value!r}.")
  return step


def _check_power(power: object) -> float:
  if isinstance(power, bool) or not isinstance(power, numbers.Real) or not 0 < power < float("inf"):
    raise ValueError(f"power must be a finite number > 0, got power={power!r}.")
  return float(power)


def _check_fraction(value: object, *, name: str) -> None:
  """Checks a sparsity given as a number (a traced one passes): in ``[0, 1]``, not NaN."""
  if isinstance(value, bool) or (isinstance(value, numbers.Real) and not 0.0 <= value <= 1.0):
    raise ValueError(f"{name} must be in [0, 1], got {name}={value!r}.")


def ramp(step: jax.typing.ArrayLike, begin_step: int, end_step: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Where ``step`` is on the ramp from ``begin_step`` to ``end_step`` (checked ints, ``begin_step <= end_step``).

  Returns ``(before, ended, left)``: bool ``step < begin_step``, bool ``step >= end_step``, and the float32 fraction of
  the ramp still ahead, ``1 - (t - begin_step) / span`` with ``t`` clipped to ``[begin_step, end_step]`` and
  ``span = max(end_step - begin_step, 1)`` (1 at and before ``begin_step``, 0 from ``end_step`` on unless the ramp is
  empty). Integer steps (Python and NumPy ints of any size, integer arrays, traced or not) are clipped and subtracted
  as integers, so only exact step differences become float32: a float32 step holds integers exactly only up to
  ``2**24`` (``2**24 + 1`` was read as ``2**24``, and a ramp beyond it moved in steps of 2, 4, ... or stood still). The
  fraction ahead, not the fraction done, so that ``1 - frac`` never cancels near the end of a long ramp. Other steps
  (floats) are taken as float32.
  """
  span = max(end_step - begin_step, 1)
  stop = begin_step + span  # left = (stop - t) / span
  if isinstance(step, numbers.Integral) and not isinstance(step, bool | np.bool_):  # exact on the host, any size
    t = operator.index(step)
    clipped = min(max(t, begin_step), end_step)
    return jnp.asarray(t < begin_step), jnp.asarray(t >= end_step), jnp.float32(stop - clipped) / jnp.float32(span)
  t = jnp.asarray(step)
  if jnp.issubdtype(t.dtype, jnp.integer):
    # In t's own integer dtype; bounds past its range are clipped to it (no overflow) and the rest added as floats.
    top = int(jnp.iinfo(t.dtype).max)
    lo, hi = min(begin_step, top), min(end_step, top)
    clipped = jnp.clip(t, lo, hi)
    ahead = (hi - clipped).astype(jnp.float32) + jnp.float32(stop - hi)
    before = t < begin_step if begin_step <= top else jnp.ones(t.shape, bool)
    ended = t >= end_step if end_step <= top else jnp.zeros(t.shape, bool)
    return before, ended, jnp.where(before, jnp.float32(1.0), ahead / jnp.float32(span))
  t = t.astype(jnp.float32)
  ahead = (stop - jnp.clip(t, begin_step, end_step)) / jnp.float32(span)
  return t < begin_step, t >= end_step, ahead


def check_steps(begin_step: object, end_step: object) -> tuple[int, int]:
  """``begin_step`` and ``end_step`` as ints ``>= 0`` with ``end_step >= begin_step``."""
  begin_step = _check_step(begin_step, name="begin_step")
  end_step = _check_step(end_step, name="end_step")
  if end_step < begin_step:
    raise ValueError(f"end_step must be >= begin_step, got begin_step={begin_step}, end_step={end_step}.")
  return begin_step, end_step


def one_shot(*, step: int = 0) -> Schedule:
  """Prune once, at ``step``, straight to the target sparsity.

  >>> from jaxsparse import pruning
  >>> s = pruning.one_shot(step=10)
  >>> round(float(s.sparsity(9, 0.9)), 3), round(float(s.sparsity(10, 0.9)), 3), bool(s.is_update_step(10))
  (0.0, 0.9, True)

  Args:
    step: the one step at which masks are computed, an int ``>= 0``.

  Returns:
    A :class:`Schedule` whose sparsity is 0 before ``step`` and the structure's target from ``step`` on, with
    ``step`` its only update step.
  """
  step = _check_step(step, name="step")

  def sparsity(t, final):
    return jnp.where(ramp(t, step, step)[0], jnp.float32(0.0), jnp.float32(final))

  return Schedule(sparsity, lambda t: jnp.asarray(t) == step)


def polynomial_sparsity(
    step: jax.typing.ArrayLike,
    *,
    final_sparsity: float,
    begin_step: int,
    end_step: int,
    initial_sparsity: float = 0.0,
    power: float = 3.0,
) -> jax.Array:
  """Zhu & Gupta's ``s_t = s_f + (s_i - s_f) (1 - (t - t0) / (t1 - t0))^power``, clipped to ``[t0, t1]``.

  >>> from jaxsparse import pruning
  >>> [round(float(pruning.polynomial_sparsity(t, final_sparsity=0.9, begin_step=0, end_step=100)), 4)
  ...  for t in (0, 50, 100, 200)]
  [0.0, 0.7875, 0.9, 0.9]

  Args:
    step: the step ``t``, an int or a scalar array (may be traced). Integer steps are exact at any size (Python and
      NumPy ints, integer arrays such as ``state.count``): they are clipped and subtracted as integers.
    final_sparsity: ``s_f``, reached at ``end_step`` and kept after it.
    begin_step: ``t0``, the first step of the ramp.
    end_step: ``t1``, the step at which ``final_sparsity`` is reached. With ``end_step == begin_step`` there is
      no ramp: the sparsity jumps from 0 to ``final_sparsity`` at that step.
    initial_sparsity: ``s_i``, the sparsity at ``begin_step`` (unless ``begin_step == end_step``).
    power: the exponent of the ramp; 3 (the paper's) prunes fast early and slowly near the end.

  Returns:
    A float32 scalar array, the sparsity at ``step``: 0 before ``begin_step``, exactly ``initial_sparsity`` at
    ``begin_step`` (unless it is ``end_step``) and exactly ``final_sparsity`` from ``end_step`` on.

  Raises:
    ValueError: naming the argument, for steps that are not ints ``>= 0``, ``end_step < begin_step``, a power
      that is not a finite number ``> 0``, or a sparsity given as a number outside ``[0, 1]``.
  """
  begin_step, end_step = check_steps(begin_step, end_step)
  power = _check_power(power)
  _check_fraction(final_sparsity, name="final_sparsity")
  _check_fraction(initial_sparsity, name="initial_sparsity")
  before, ended, left = ramp(step, begin_step, end_step)  # left = 1 - frac, exact step arithmetic
  s = jnp.float32(final_sparsity) + jnp.float32(initial_sparsity - final_sparsity) * left**power
  s = jnp.where(left >= 1.0, jnp.float32(initial_sparsity), s)  # s_f + (s_i - s_f) is s_i only up to rounding
  s = jnp.where(ended, jnp.float32(final_sparsity), s)  # end_step wins a tie with begin
  return jnp.where(before, jnp.float32(0.0), s)


def gradual(
    *, begin_step: int, end_step: int, update_every: int, initial_sparsity: float = 0.0, power: float = 3.0
) -> Schedule:
  """Gradual magnitude pruning (Zhu & Gupta, 2017): sparsity rises polynomially from ``begin_step`` to ``end_step``.

  Masks are recomputed every ``update_every`` steps from ``begin_step`` and at ``end_step``; at step
  ``t`` the sparsity is ``s_f + (s_i - s_f) (1 - (t - begin) / (end - begin))^power`` (``s_f``: the
  structure's target, ``s_i``: ``initial_sparsity``), and ``s_f`` from ``end_step`` on. ``begin_step == end_step``
  prunes once, straight to the target, at that step (like ``one_shot(step=begin_step)``).

  >>> from jaxsparse import pruning
  >>> s = pruning.gradual(begin_step=100, end_step=1000, update_every=100)
  >>> [round(float(s.sparsity(t, 0.9)), 3) for t in (0, 100, 550, 1000)]
  [0.0, 0.0, 0.787, 0.9]
  >>> [bool(s.is_update_step(t)) for t in (50, 100, 150, 200, 1000, 1100)]
  [False, True, False, True, True, False]
  >>> s = pruning.gradual(begin_step=0, end_step=0, update_every=1)  # one-shot pruning at step 0
  >>> round(float(s.sparsity(0, 0.9)), 3), [t for t in range(3) if s.is_update_step(t)]
  (0.9, [0])

  Args:
    begin_step: the first step at which masks are computed (at ``initial_sparsity``).
    end_step: the step at which the target sparsity is reached (``>= begin_step``); the last update step. Equal
      to ``begin_step``: the target is reached at that one update step.
    update_every: steps between mask updates, ``>= 1``.
    initial_sparsity: ``s_i`` in ``[0, 1)``, capped at each structure's target.
    power: the exponent of the ramp, a finite number ``> 0``.

  Returns:
    A :class:`Schedule` for :func:`magnitude_pruner` (or any :class:`Pruner` whose masks follow a sparsity).

  References:
    Zhu & Gupta, "To prune, or not to prune: exploring the efficacy of pruning for model
    compression", 2017, https://arxiv.org/abs/1710.01878.
  """
  begin_step, end_step = check_steps(begin_step, end_step)
  update_every = _check_step(update_every, name="update_every", minimum=1)
  initial_sparsity = _utils.check_sparsity(initial_sparsity, name="initial_sparsity")
  power = _check_power(power)

  def sparsity(t, final):
    # A traced final (a custom pruner's) has no Python min; a number keeps its exact float64 difference below.
    initial = min(initial_sparsity, final) if isinstance(final, numbers.Real) else jnp.minimum(initial_sparsity, final)
    return polynomial_sparsity(
        t,
        final_sparsity=final,
        begin_step=begin_step,
        end_step=end_step,
        initial_sparsity=initial,
        power=power,
    )

  def is_update_step(t):
    t = jnp.asarray(t)
    in_range = (t >= begin_step) & (t <= end_step)
    return (in_range & ((t - begin_step) % update_every == 0)) | (t == end_step)

  return Schedule(sparsity, is_update_step)


def periodic(*, update_every: int, begin_step: int = 0, end_step: int | None = None) -> Schedule:
  """Masks recomputed every ``update_every`` steps from ``begin_step`` (to ``end_step``), at the target sparsity.

  The timing of dynamic sparse training and of custom :class:`~jaxsparse.pruning.Pruner` s. With
  :func:`~jaxsparse.pruning.magnitude_pruner` it prunes once at ``begin_step`` and then re-applies the
  same masks (pruned weights are held at zero, so they never win back their place).

  >>> from jaxsparse import pruning
  >>> s = pruning.periodic(update_every=10, begin_step=5, end_step=30)
  >>> [bool(s.is_update_step(t)) for t in (0, 5, 15, 35)], float(s.sparsity(0, 0.5)), float(s.sparsity(5, 0.5))
  ([False, True, True, False], 0.0, 0.5)

  Args:
    update_every: steps between mask updates, ``>= 1``.
    begin_step: the first update step; the sparsity is 0 before it.
    end_step: the last step that may be an update step; ``None``: no end.

  Returns:
    A :class:`Schedule` at the structure's target sparsity from ``begin_step`` on, updating at ``begin_step``,
    ``begin_step + update_every``, ... up to ``end_step``.

  Raises:
    ValueError: ``update_every`` is not an int ``>= 1``; ``begin_step`` or ``end_step`` is not an int ``>= 0``;
      ``end_step < begin_step``.
  """
  begin_step = _check_step(begin_step, name="begin_step")
  update_every = _check_step(update_every, name="update_every", minimum=1)
  if end_step is not None:
    end_step = _check_step(end_step, name="end_step")
    if end_step < begin_step:
      raise ValueError(f"end_step must be >= begin_step, got begin_step={begin_step}, end_step={end_step}.")

  def sparsity(t, final):
    return jnp.where(ramp(t, begin_step, begin_step)[0], jnp.float32(0.0), jnp.float32(final))

  def is_update_step(t):
    t = jnp.asarray(t)
    ok = (t >= begin_step) & ((t - begin_step) % update_every == 0)
    return ok if end_step is None else ok & (t <= end_step)

  return Schedule(sparsity, is_update_step)
