"""``jaxsparse.autotune``: tune every sparse product of a function or model ahead of time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxsparse._tuning import _cache

__all__ = ["autotune"]


def autotune(fn_or_model: Callable[..., Any], *example_args: Any, compile: bool = True) -> int:
  """Tunes every sparse product that ``fn_or_model(*example_args)`` runs, so that later traces only read the cache.

  Traces (and, with ``compile``, compiles: products of sharded operands are partitioned, and so tuned per
  shard, only then) the call in ``"tune"`` mode. Each product signature met for the first time has its candidate
  routes measured on the device and the fastest recorded in the cache file
  (:func:`jaxsparse.set_autotune_mode` has the modes; ``$JAXSPARSE_AUTOTUNE_CACHE`` the file). Pass a train step
  (forward and backward) or a decode step; an NNX module is called as ``model(*example_args)``, on a copy of its
  state passed as arguments (as ``nnx.jit`` passes it): the module is left as it was, and layers that update their
  state when called (batch statistics, dropout's random stream) tune like the others. Nothing runs but the
  measurements: arrays may be ``jax.ShapeDtypeStruct`` with shardings, and the module may be abstract
  (``nnx.eval_shape``). Unlike tuning at the first trace,
  every candidate is timed however long it takes to compile (no ``$JAXSPARSE_AUTOTUNE_BUDGET``), also those a
  first-trace measurement left out for its budget.

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> w = jaxsparse.BlockSparseMatrix.from_dense(jnp.ones((64, 64)), (32, 32))
  >>> step = lambda x: jax.grad(lambda x: jaxsparse.ops.block_sparse_matmul(x, w).sum())(x)
  >>> jaxsparse.autotune(step, jax.ShapeDtypeStruct((8, 64), jnp.float32)) >= 0
  True

  Args:
    fn_or_model: a function, or a callable module (NNX), of ``example_args``.
    *example_args: arrays or ``jax.ShapeDtypeStruct`` of the shapes, dtypes (and shardings) to tune for.
    compile: also compile the traced call (tunes the per-shard products of sharded operands).

  Returns:
    The number of decisions added to the cache.

  Raises:
    TypeError: ``fn_or_model`` is not callable.
  """
  if isinstance(fn_or_model, nnx.Module):
    # Its state as arguments, merged into a module of the trace: a module closed over would be mutated (or refuse
    # to be, "Cannot mutate ... from a different trace level") by layers that update their state.
    graphdef, state = nnx.split(fn_or_model)
    fn, example_args = (lambda state, *args: nnx.merge(graphdef, state)(*args)), (state, *example_args)
  elif callable(fn_or_model):
    fn = lambda *args: fn_or_model(*args)  # a fresh wrapper: a function jitted before keeps its earlier routes
  else:
    raise TypeError(f"fn_or_model must be a function or an NNX module, got {type(fn_or_model).__name__}.")
  before = _cache.known_keys()
  with _cache.autotune_mode("tune"), _cache.unbounded_budget():
    lowered = jax.jit(fn).lower(*example_args)
    if compile:
      lowered.compile()
  return len(_cache.known_keys() - before)
