"""``jaxsparse.autotune``: tune every sparse product of a function or model ahead of time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jaxsparse._tuning import _cache

__all__ = ["autotune"]


def autotune(fn_or_model: Callable[..., Any], *example_args: Any, compile: bool = True) -> int:
  """Tunes every sparse product that ``fn_or_model(*example_args)`` runs, so that later traces only read the cache.

  Traces (and, with ``compile``, compiles: products of sharded operands are partitioned, and so tuned per
  shard, only then) the call in ``"tune"`` mode. Each product signature met for the first time has its candidate
  routes measured on the device and the fastest recorded in the cache file
  (:func:`jaxsparse.set_autotune_mode` has the modes; ``$JAXSPARSE_AUTOTUNE_CACHE`` the file). Pass a train step
  (forward and backward) or a decode step; an NNX module is called as ``model(*example_args)``. Nothing runs but
  the measurements: arrays may be ``jax.ShapeDtypeStruct`` with shardings. Unlike tuning at the first trace,
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
  """
  before = _cache.known_keys()
  with _cache.autotune_mode("tune"), _cache.unbounded_budget():
    # A fresh wrapper: a function jitted before keeps the routes of its earlier trace.
    lowered = jax.jit(lambda *args: fn_or_model(*args)).lower(*example_args)
    if compile:
      lowered.compile()
  return len(_cache.known_keys() - before)
