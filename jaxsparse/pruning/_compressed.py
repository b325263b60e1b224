"""Stored values that are not a dense weight, which the pruners refuse to prune as one.

A ``CompressedNMLinear`` / ``CompressedNMDense`` (``CompressedNMEmbed``) keeps only the kept values of its weight,
``(K * n / m, N)`` (the table transposed), in a parameter named like the dense layer's (``kernel``, ``embedding``):
ranked as a dense weight, an N:M rule would group them across the layer's pattern and drop weights it keeps.

A ``BlockSparseLinear`` / ``BlockSparseDense`` keeps its kept blocks, ``(nnz_blocks, bk, bn)`` (a
``TensorParallelBlockSparseLinear`` its shards' blocks, ``(shards, blocks_per_shard, bk, bn)``), in its ``kernel``:
ranked as a dense weight, a rule would take N:M groups and blocks across the kept blocks (or fail on their shape),
and any rule would zero weights inside blocks that the layer still keeps, so its density, ``summary`` and products
would count weights it no longer has. The layer's blocks are static (the kernel's shape follows them), so there is no
narrowing them in place: the way to prune such a layer is to densify it, prune the dense layer and sparsify again.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from jaxsparse._rules import get_module
from jaxsparse._rules import module_paths
from jaxsparse._rules import path_str
from jaxsparse.formats._block_sparse import INDEX_FIELDS
from jaxsparse.layers._block_sparse import BLOCK_VALUES
from jaxsparse.layers._block_sparse import BlockSparseLinear
from jaxsparse.layers._common import COMPRESSED_VALUES
from jaxsparse.layers._common import SPARSITY
from jaxsparse.layers._embed import CompressedNMEmbed
from jaxsparse.layers._nm_compressed import CompressedNMLinear
from jaxsparse.pruning._apply import is_box
from jaxsparse.sharding._layers import TensorParallelBlockSparseLinear

__all__ = ["known_stored_values", "stored_value_paths", "stored_values_error", "stored_values_known"]

# The layers whose kernel holds kept blocks, by the kind stored_value_paths gives them.
_BLOCK_KINDS = ("BlockSparseLinear", "BlockSparseDense", "TensorParallelBlockSparseLinear")

# The parameter each layer keeps its stored values in.
_VALUES = {CompressedNMEmbed: "embedding", CompressedNMLinear: "kernel", BlockSparseLinear: "kernel",
           TensorParallelBlockSparseLinear: "kernel"}


def _mark(leaf: Any) -> str | None:
  """The layer class a parameter's metadata marks it as the stored values of (``COMPRESSED_VALUES``,
  ``BLOCK_VALUES``), read from an ``nnx.Param`` or a Linen box (``nnx.bridge.ToLinen`` keeps an NNX variable's
  metadata in an ``NNXMeta`` box); ``None`` for an unmarked one."""
  if isinstance(leaf, nnx.Param):
    metadata = leaf.get_metadata()
  else:
    metadata = getattr(leaf, "metadata", None) if is_box(leaf) else None
  if not isinstance(metadata, Mapping):
    return None
  mark = metadata.get(COMPRESSED_VALUES) or metadata.get(BLOCK_VALUES)
  return None if not mark else str(mark)


def stored_value_paths(tree: Any) -> dict[str, str]:
  """``{parameter path: layer class name}`` of the stored values that ``tree`` shows: the kept values of N:M-compressed
  layers (a ``CompressedNMLinear`` / ``CompressedNMDense``'s ``kernel``, a ``CompressedNMEmbed``'s ``embedding``) and
  the kept blocks of block-sparse layers (a ``BlockSparseLinear`` / ``BlockSparseDense`` /
  ``TensorParallelBlockSparseLinear``'s ``kernel``): those they are the kept weights of, not a dense kernel or table.

  Seen in an NNX object's layers (at every path of a tied layer); in ``nnx.Param`` variables (an ``nnx.State``, what
  ``nnx.Optimizer`` hands its optimizer's ``init``) and Linen boxes (``nnx.bridge.ToLinen``'s ``NNXMeta``) that carry
  the layers' mark (``COMPRESSED_VALUES``, ``BLOCK_VALUES`` metadata: every NNX layer above); and in Linen variables
  whose ``"sparsity"`` collection holds the layer's structure beside the values (packed positions
  ``kernel_positions`` / ``embedding_positions``; block index arrays, flat or under ``"pattern"``). Bare Linen
  ``params`` (a ``TrainState``'s) do not tell stored values from a dense kernel or table: ``{}``.
  """
  out = {}
  if isinstance(tree, nnx.Pytree):
    for paths in module_paths(tree).values():
      node = get_module(tree, paths[0])
      name = next((v for cls, v in _VALUES.items() if isinstance(node, cls)), None)
      if name is not None and isinstance(getattr(node, name, None), nnx.Variable):
        out.update({path_str((*q, name)): type(node).__name__ for q in paths})
    tree = nnx.state(tree)
  pairs = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable) or is_box(x))[0]
  leaves = {path_str(kp): leaf for kp, leaf in pairs}
  for path, leaf in leaves.items():
    mark = _mark(leaf)
    if mark:
      out.setdefault(path, mark)
  for path in leaves:  # the layers' structure beside their values
    owner, _, name = path.rpartition(".")
    nested = owner == "pattern" or owner.endswith(".pattern")  # NNX (and bridged) block index arrays: one level down
    if name == INDEX_FIELDS[0]:  # a block-sparse layer's index arrays: its kept blocks are its kernel
      owner, weight = owner[: -len("pattern")].rstrip(".") if nested else owner, "kernel"
    else:
      weight = name.removesuffix("_positions")
      if weight not in ("kernel", "embedding") or weight == name:
        continue
    linen = owner == SPARSITY or owner.startswith(f"{SPARSITY}.")  # Linen variables: the values are in "params"
    values = f"params{owner[len(SPARSITY):]}.{weight}" if linen else f"{owner}.{weight}" if owner else weight
    if values not in leaves:
      continue
    if name != INDEX_FIELDS[0]:
      kind = "CompressedNMEmbed" if weight == "embedding" else "CompressedNMDense" if linen else "CompressedNMLinear"
    elif not nested:
      kind = "BlockSparseDense"
    else:  # a tensor-parallel layer keeps its blocks' places in the unsplit matrix too
      kind = "TensorParallelBlockSparseLinear" if f"{owner}.source" in leaves else "BlockSparseLinear"
    out.setdefault(values, kind)
  return out


# The stored values of the parameters that pruning.wrap_optax's init hands its pruner as plain arrays (which cannot
# tell them), read by the pruners' plan while that call traces.
_KNOWN: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar("stored_values", default=None)


@contextlib.contextmanager
def stored_values_known(paths: Mapping[str, str]) -> Iterator[None]:
  """Within it, :func:`known_stored_values` gives ``paths`` (:func:`stored_value_paths` of the parameters a pruner
  gets as plain arrays): so that a rule matching them fails with :func:`stored_values_error`, before any check of the
  rule against their shape (an N:M rule's group size against a block's)."""
  token = _KNOWN.set(dict(paths))
  try:
    yield
  finally:
    _KNOWN.reset(token)


def known_stored_values() -> Mapping[str, str]:
  """The stored values set by the innermost :func:`stored_values_known`; ``{}`` outside one."""
  return _KNOWN.get() or {}


def stored_values_error(path: str, kind: str, shape: tuple[int, ...], by: str) -> ValueError:
  """The error for ``by`` (a rule, a pruner) pruning the stored values at ``path`` of a ``kind`` layer (a kind of
  :func:`stored_value_paths`)."""
  if kind in _BLOCK_KINDS:
    bk, bn = shape[-2:]
    split = kind == "TensorParallelBlockSparseLinear"
    return ValueError(
        f"{path}: this {kind} is block-sparse: its {shape} kernel holds the values of its kept {bk}x{bn} blocks"
        f"{' (per shard)' if split else ''}, not the dense kernel, and {by} would prune them as if they were: a "
        "rule's blocks and N:M groups would run across the kept blocks, and a pruned weight would stay inside a "
        "block the layer keeps, so its density, jaxsparse.summary and products would still count it. A block-sparse "
        "layer's blocks are fixed when it is built. To prune it further, densify it (jaxsparse.densify, "
        f"densify_linen{': the nnx.Linear of its unsplit weight' if split else ''}), prune the dense layer (a "
        "BlockSparse rule prunes to blocks) and sparsify it again; or map this path to None."
    )
  what = "table" if path.rpartition(".")[2] == "embedding" else "kernel"
  return ValueError(
      f"{path}: this {kind} is already N:M-compressed: its {shape} values are the kept weights, not the dense {what}, "
      f"and {by} would prune them as if they were, dropping weights the layer keeps (an N:M rule would group them "
      "across its pattern). Prune the dense model before sparsify / compress (jaxsparse.densify or densify_linen "
      "gives it back), or map this path to None."
  )
