"""Which embedding tables a model ``attend``-s, for :func:`jaxsparse.summary`.

A table's lookups are no product; its ``attend`` (a tied LM head's logits ``x @ tableᵀ``) is, and only running the
model shows whether it calls it. Here the model is traced on its example inputs (nothing computed): an NNX model's
copy with a :class:`_Watch` in place of each table (and of each ``nnx.bridge.ToNNX`` of a ``SparsifiedLinen``, whose
Linen tables report under its path), a Linen module's ``apply`` under an ``nn.intercept_methods`` interceptor.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from jaxsparse._rules import get_module
from jaxsparse._rules import replace_module
from jaxsparse.layers._embed_linen import CompressedNMEmbed as LinenCompressedNMEmbed

__all__ = ["is_attend", "linen_attended", "nnx_attended", "untraced_note"]

# The path of the nnx.bridge.ToNNX a traced NNX model is calling (see _Watch), for the Linen tables it runs.
_BRIDGE: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("jaxsparse_summary_bridge", default=None)


def untraced_note(paths: Sequence[str], how: str) -> tuple[str, ...]:
  """The note on the tables at ``paths`` whose ``attend`` was not looked for (no paths: no note); ``how``: the call
  with example inputs."""
  if not paths:
    return ()
  where = ", ".join(p or "(model)" for p in paths)
  return (f"{where}: an embedding table's FLOPs are those of its attend (a tied LM head's logits), which only running "
          "the model shows; without example inputs they are its lookups' (0). If the model calls attend, pass them to "
          f"count it: {how}.",)


def is_attend(context: Any) -> bool:
  """Whether an intercepted Linen call is a table's ``attend``: a ``CompressedNMEmbed``'s, or an ``nn.Embed``'s (which
  a ``SparsifiedLinen`` runs as one)."""
  return context.method_name == "attend" and isinstance(context.module, nn.Embed | LinenCompressedNMEmbed)


def linen_attended(module: Any, variables: Mapping, inputs: Sequence[Any]) -> set[tuple[str, ...]]:
  """The scope paths of the tables whose ``attend`` ``module.apply(variables, *inputs)`` calls; traced only, under
  the caller's interceptors too."""
  attended: set[tuple[str, ...]] = set()

  def record(next_fun, args, kwargs, context):
    if is_attend(context):
      attended.add(tuple(context.module.scope.path))
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):  # outside a SparsifiedLinen's own: it sees the nn.Embed calls it redirects
    jax.eval_shape(lambda v, *a: module.apply(v, *a), dict(variables), *inputs)
  return attended


class _Watch(nnx.Module):
  """Stands in for an embedding table or an ``nnx.bridge.ToNNX`` (see :func:`replace_module`) while the model is
  traced: an ``attend`` hands ``path`` to ``record``; a call runs with ``path`` in :data:`_BRIDGE`. Other attributes
  are the module's."""

  def __init__(self, inner: nnx.Module, path: tuple, record: Any):
    self.inner = inner
    self.path = path
    self.record = record

  def __call__(self, *args, **kwargs):
    token = _BRIDGE.set(self.path)
    try:
      return self.inner(*args, **kwargs)
    finally:
      _BRIDGE.reset(token)

  def attend(self, *args, **kwargs):
    self.record(self.path)
    return self.inner.attend(*args, **kwargs)

  def __getattr__(self, name: str) -> Any:
    if name.startswith("_") or name in ("inner", "path", "record"):
      raise AttributeError(name)
    return getattr(self.inner, name)


def nnx_attended(
    model: nnx.Module, watched: Sequence[tuple], inputs: Sequence[Any]
) -> tuple[set[tuple], dict[tuple, set[tuple[str, ...]]]]:
  """The paths (of ``watched``: NNX tables and bridges) of the tables whose ``attend`` ``model(*inputs)`` calls, and
  per ``nnx.bridge.ToNNX`` path of ``watched`` the Linen paths of its attended tables; traced only, on a copy."""
  tables: set[tuple] = set()
  bridged: dict[tuple, set[tuple[str, ...]]] = {}
  if not watched:
    return tables, bridged
  graphdef, state = nnx.split(model)

  def record_linen(next_fun, args, kwargs, context):
    if is_attend(context) and _BRIDGE.get() is not None:
      bridged.setdefault(_BRIDGE.get(), set()).add(tuple(context.module.scope.path))
    return next_fun(*args, **kwargs)

  def run(state, *inputs):
    copy = nnx.merge(graphdef, state)
    for path in watched:
      watch = _Watch(get_module(copy, path), path, lambda p: tables.add(p))
      if not path:  # the model itself: nothing below it is watched
        copy = watch
        break
      replace_module(copy, path, watch)  # at every path of a tied table
    copy(*inputs)

  with nn.intercept_methods(record_linen):
    jax.eval_shape(run, state, *inputs)
  return tables, bridged
