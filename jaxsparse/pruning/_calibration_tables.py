"""Embedding tables in calibration: their rules' checks, their probe, where sequential pruning takes them, and the
model's reads of a table's array outside its lookups and ``attend`` calls.

Calibration sees a table only through its module's calls: lookups (``embed(ids)``) and ``attend`` (``embed.attend(h)``,
a tied LM head). Each such call runs inside the named scope :data:`TABLE_SCOPE`, so in the model's jaxpr every
equation that consumes the table's array outside that scope is a use calibration would not see (``h @
embed.embedding[...].T`` for tied logits, a lookup by indexing the array): :func:`direct_reads` finds them, and
calibration refuses the table (:func:`direct_read_message`) rather than prune it with statistics that miss a use.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from jaxsparse.formats._specs import NM
from jaxsparse.formats._specs import BlockSparse
from jaxsparse.formats._specs import Unstructured
from jaxsparse.formats._specs import check_plain_nm
from jaxsparse.formats._specs import check_spec_applies

TABLE_SCOPE = "jaxsparse_table_call"  # the named scope of a table's lookups and attend calls while calibrating


def check_structure(spec: Any, *, path: str) -> None:
  """Raises ``TypeError`` naming ``path`` unless ``spec`` is a structure (a layer's or a table's)."""
  if not isinstance(spec, (Unstructured, NM, BlockSparse)):
    raise TypeError(
        f"{path}: spec must be jaxsparse.Unstructured(...), jaxsparse.NM(...) or jaxsparse.BlockSparse(...), "
        f"got {spec!r}."
    )


def check_table_spec(spec: Any, shape: tuple[int, int], *, path: str) -> None:
  """Raises naming ``path`` when ``spec`` cannot apply to an embedding table of ``shape`` ``(num_embeddings,
  features)``: N:M groups run along the features of each row, blocks are ``(rows, features)`` of the table."""
  check_structure(spec, path=path)
  check_plain_nm(spec, path=path, what="calibrated pruning")
  rows, features = shape
  if isinstance(spec, NM) and features % spec.m:
    raise ValueError(f"{path}: N:M sparsity {spec.n}:{spec.m} needs m={spec.m} to divide the features {features} of "
                     f"its {shape} embedding table (the groups run along the features of each row, as "
                     "CompressedNMEmbed keeps them); choose another m or give this path another rule.")
  if isinstance(spec, BlockSparse) and (rows % spec.block_shape[0] or features % spec.block_shape[1]):
    raise ValueError(f"{path}: block_shape={spec.block_shape} (rows, features) does not divide its {shape} "
                     "embedding table; choose block sizes that divide both, or give this path another rule.")
  if not isinstance(spec, NM):
    check_spec_applies(spec, shape, path=path)


def table_call(fn: Callable, *args: Any, **kwargs: Any) -> Any:
  """``fn(*args, **kwargs)`` (a table's lookup or ``attend``) inside :data:`TABLE_SCOPE`."""
  with jax.named_scope(TABLE_SCOPE):
    return fn(*args, **kwargs)


class TableProbe(nnx.Module):
  """Stands in for an ``nnx.Embed``: hands the ids of each lookup and the query of each ``attend`` to ``record``
  (``record(x, attend)``), and runs them in :data:`TABLE_SCOPE`; other attributes (``embedding``, ``dtype``) are the
  table's."""

  def __init__(self, inner: nnx.Module, record: Callable[[jax.Array, bool], None]):
    self.inner = inner
    self.record = record

  def __call__(self, inputs, *args, **kwargs):
    self.record(inputs, False)
    return table_call(self.inner, inputs, *args, **kwargs)

  def attend(self, query, *args, **kwargs):
    self.record(query, True)
    return table_call(self.inner.attend, query, *args, **kwargs)

  def __getattr__(self, name: str) -> Any:
    if name.startswith("_") or name in ("inner", "record"):
      raise AttributeError(name)
    return getattr(self.inner, name)


def call_order(calls: Sequence[Hashable], attended: set) -> list:
  """The keys of ``calls`` (every layer or table call, in order), each at its first call; a table in ``attended``
  (tied: the model calls its ``attend``) at its last call instead.

  Sequential pruning takes groups in this order: a tied table is pruned after the layers that compute its
  ``attend`` queries (its LM head's inputs, then from the pruned model, as any layer's), and the lookups see it dense
  until then; a lookup-only table, whose mask does not depend on calibration, at its first lookup, so the layers
  after it calibrate on the pruned lookups.
  """
  position: dict[Hashable, int] = {}
  for i, key in enumerate(calls):
    if key not in position or key in attended:
      position[key] = i
  return sorted(position, key=position.__getitem__)


def table_leaves(tree: Any, keys: Sequence[tuple], *, collection: tuple = (), name: str = "embedding",
                 ) -> dict[int, tuple]:
  """``{leaf index: key}``: the leaves of ``tree`` (an ``nnx.State``; Linen variables with ``collection=("params",)``)
  that hold the parameter ``name`` (a table's ``embedding``; a layer's ``kernel``) of a module at one of ``keys``."""
  paths = {(*collection, *key, name): key for key in keys}
  out = {}
  for i, (path, _) in enumerate(jax.tree_util.tree_leaves_with_path(tree)):
    names = tuple(p.key for p in path if isinstance(p, jax.tree_util.DictKey))  # the Variable's "value" left out
    if names in paths:
      out[i] = paths[names]
  return out


def direct_reads(closed_jaxpr: Any, tracked: Mapping[int, Hashable]) -> set:
  """The keys of the jaxpr inputs ``tracked`` (``{invar index: key}``) that an equation outside :data:`TABLE_SCOPE`
  consumes, following them into the jaxprs of calls (``jit``, ``checkpoint``, ``scan``, ``cond``, ``while``, custom
  derivatives); an input passed to an equation whose inner jaxpr cannot be matched up counts as read."""
  jaxpr = closed_jaxpr.jaxpr
  found: set = set()
  _reads(jaxpr, {id(jaxpr.invars[i]): key for i, key in tracked.items()}, found)
  return found


def _reads(jaxpr: Any, tracked: dict[int, Hashable], found: set) -> None:
  for eqn in jaxpr.eqns:
    keys = {tracked[id(v)] for v in eqn.invars if id(v) in tracked}
    if not keys or TABLE_SCOPE in str(eqn.source_info.name_stack):
      continue
    inner = list(inner_jaxprs(eqn))
    if not inner:
      found |= keys
    for sub, invars in inner:
      if invars is None:
        found |= keys
      else:
        _reads(sub, {id(s): tracked[id(v)] for s, v in zip(sub.invars, invars, strict=True) if id(v) in tracked},
               found)


def inner_jaxprs(eqn: Any):
  """``(jaxpr, eqn invars it takes)`` for each jaxpr in ``eqn``'s parameters (``None``: not matched up)."""
  for name, value in eqn.params.items():
    for sub in value if isinstance(value, tuple) else (value,):
      sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's open jaxpr
      if not (hasattr(sub, "eqns") and hasattr(sub, "invars")):
        continue
      n = len(sub.invars)
      if eqn.primitive.name == "while" and name == "cond_jaxpr":  # cond consts, then (after the body's) the carry
        consts = eqn.params["cond_nconsts"]
        skip = consts + eqn.params["body_nconsts"]
        yield sub, [*eqn.invars[:consts], *eqn.invars[skip:]]
      elif n <= len(eqn.invars):  # the trailing operands: all for jit, checkpoint, scan; cond skips its index
        yield sub, list(eqn.invars[len(eqn.invars) - n:])
      else:
        yield sub, None


def direct_read_message(path: str) -> str:
  """Why a table the model reads directly cannot be calibrated, and what to do."""
  return (f"the model reads this embedding table's array directly ({path}.embedding, e.g. `h @ {path}.embedding"
          f"[...].T` for tied logits), not only through its lookups ({path}(ids)) and {path}.attend(h) calls; "
          "calibration sees a table only through those calls, so it would miss that use and prune the table with "
          f"the wrong statistics (a tied LM head taken for lookups only). Compute the logits with {path}.attend(h) "
          "instead, or keep the table dense")
