"""The stored values of already N:M-compressed layers, which the pruners refuse to prune as a dense weight.

A ``CompressedNMLinear`` / ``CompressedNMDense`` (``CompressedNMEmbed``) keeps only the kept values of its weight,
``(K * n / m, N)`` (the table transposed), in a parameter named like the dense layer's (``kernel``, ``embedding``):
ranked as a dense weight, an N:M rule would group them across the layer's pattern and drop weights it keeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from jaxsparse._rules import get_module
from jaxsparse._rules import module_paths
from jaxsparse._rules import path_str
from jaxsparse.layers._common import COMPRESSED_VALUES
from jaxsparse.layers._common import SPARSITY
from jaxsparse.layers._embed import CompressedNMEmbed
from jaxsparse.layers._nm_compressed import CompressedNMLinear
from jaxsparse.pruning._apply import is_box

__all__ = ["compressed_error", "compressed_paths"]


def compressed_paths(tree: Any) -> dict[str, str]:
  """``{parameter path: layer class name}`` of the stored values of the N:M-compressed layers that ``tree`` shows (a
  ``CompressedNMLinear`` / ``CompressedNMDense``'s ``kernel``, a ``CompressedNMEmbed``'s ``embedding``): those they
  are the kept weights of, not a dense kernel or table.

  Seen in an NNX object's layers (at every path of a tied layer); in ``nnx.Param`` variables (an ``nnx.State``, what
  ``nnx.Optimizer`` hands its optimizer's ``init``) and Linen boxes (``nnx.bridge.ToLinen``'s ``NNXMeta``) that carry
  the layers' mark (``COMPRESSED_VALUES`` metadata); and in Linen variables whose ``"sparsity"`` collection holds the
  layer's packed positions (``kernel_positions``, ``embedding_positions``) beside the values. Bare Linen ``params``
  (a ``TrainState``'s) do not tell compressed values from a dense kernel or table: ``{}``.
  """
  out = {}
  if isinstance(tree, nnx.Pytree):
    for paths in module_paths(tree).values():
      node = get_module(tree, paths[0])
      name = {CompressedNMEmbed: "embedding", CompressedNMLinear: "kernel"}.get(type(node))
      if name is not None and isinstance(getattr(node, name, None), nnx.Variable):
        out.update({path_str((*q, name)): type(node).__name__ for q in paths})
    tree = nnx.state(tree)
  pairs = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable) or is_box(x))[0]
  leaves = {path_str(kp): leaf for kp, leaf in pairs}
  for path, leaf in leaves.items():
    if isinstance(leaf, nnx.Param):
      mark = leaf.get_metadata().get(COMPRESSED_VALUES)
    else:  # a Linen box; nnx.bridge.ToLinen keeps an NNX variable's metadata in an NNXMeta box
      metadata = getattr(leaf, "metadata", None) if is_box(leaf) else None
      mark = metadata.get(COMPRESSED_VALUES) if isinstance(metadata, Mapping) else None
    if mark:
      out.setdefault(path, str(mark))
    owner, _, name = path.rpartition(".")
    weight = name.removesuffix("_positions")
    if weight not in ("kernel", "embedding") or weight == name:
      continue
    linen = owner == SPARSITY or owner.startswith(f"{SPARSITY}.")  # Linen variables: the values are in "params"
    values = f"params{owner[len(SPARSITY):]}.{weight}" if linen else f"{owner}.{weight}" if owner else weight
    if values in leaves:
      kind = "CompressedNMEmbed" if weight == "embedding" else "CompressedNMDense" if linen else "CompressedNMLinear"
      out.setdefault(values, kind)
  return out


def compressed_error(path: str, kind: str, shape: tuple[int, ...], by: str) -> ValueError:
  """The error for ``by`` (a rule, a pruner) pruning the stored values at ``path`` of an N:M-compressed ``kind``."""
  what = "table" if path.rpartition(".")[2] == "embedding" else "kernel"
  return ValueError(
      f"{path}: this {kind} is already N:M-compressed: its {shape} values are the kept weights, not the dense {what}, "
      f"and {by} would prune them as if they were, dropping weights the layer keeps (an N:M rule would group them "
      "across its pattern). Prune the dense model before sparsify / compress (jaxsparse.densify or densify_linen "
      "gives it back), or map this path to None."
  )
