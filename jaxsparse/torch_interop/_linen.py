"""Flax Linen variables from a PyTorch checkpoint, without a target model (layers recognised by their parameters).

The name mapping and the sparsifying rules are those of :mod:`._flax` (:func:`~._flax.map_name`,
:func:`~._flax.apply_rules`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.torch_interop._decode import NMSpec
from jaxsparse.torch_interop._decode import TorchParam
from jaxsparse.torch_interop._decode import decode_checkpoint
from jaxsparse.torch_interop._flax import DEFAULT_EMBEDDINGS
from jaxsparse.torch_interop._flax import NameMap
from jaxsparse.torch_interop._flax import _group
from jaxsparse.torch_interop._flax import apply_rules
from jaxsparse.torch_interop._load import CheckpointError
from jaxsparse.torch_interop._patterns import flax_layout

__all__ = ["to_linen_variables"]


def to_linen_variables(
    source: Any,
    *,
    name_map: NameMap = None,
    ignore: Sequence[str] = (),
    nm: NMSpec = None,
    rules: Any = None,
    sparse: bool = True,
    embeddings: str = DEFAULT_EMBEDDINGS,
    key: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, dict]:
  r"""Flax Linen variables for a PyTorch checkpoint, with jaxsparse layouts for its sparse layers.

  Without a target model, layers are recognised by their parameters: a 2-D ``weight`` is a Linear
  (``kernel = weight.T``) unless its module path matches ``embeddings`` (then ``embedding``), a
  weight of ndim >= 3 a Conv, a 1-D ``weight`` a norm ``scale``; ``running_mean``/``running_var``
  go to ``"batch_stats"`` as ``mean``/``var``. Sparse Linear weights take the variables of
  :class:`~jaxsparse.layers.linen.BlockSparseDense` (block patterns: ``params.kernel`` of the kept
  blocks and the index arrays in ``"sparsity"``) or :class:`~jaxsparse.layers.linen.MaskedDense`
  (other masks, N:M included: ``params.kernel`` zero where pruned and ``sparsity.mask``). A pruned
  Conv weight keeps its mask too: ``params.kernel`` zero where pruned and ``sparsity.mask`` in Flax
  layout ``(*kernel_size, in, out)``, for ``nn.Conv(..., mask=mask)``.

  >>> import torch
  >>> from jaxsparse import torch_interop
  >>> v = torch_interop.to_linen_variables({"fc.weight": torch.ones(4, 8), "fc.weight_mask": torch.eye(4, 8)})
  >>> v["params"]["fc"]["kernel"].shape, v["sparsity"]["fc"]["mask"].shape
  ((8, 4), (8, 4))

  Args:
    source: anything :func:`load_state_dict` takes.
    name_map: torch module path -> Flax module path (see :func:`map_name`).
    ignore: glob patterns of torch parameter names to skip.
    nm: recompute N:M masks of dense weights (see :func:`decode_checkpoint`).
    rules: sparsify Linear weights while converting (see :func:`apply_rules`), e.g.
      ``{r".*intermediate\.dense": jaxsparse.NM(2, 4)}``.
    sparse: ``False`` writes masked dense kernels without ``"sparsity"`` entries.
    embeddings: regex (``re.search``) of module paths whose 2-D weight is an embedding table.
    key: path of the state dict inside a nested checkpoint.
    progress: called as ``progress(done, total)`` while decoding.

  Returns:
    ``{"params": ..., "sparsity"?: ..., "batch_stats"?: ...}`` nested by Flax path.
  """
  params = decode_checkpoint(source, nm=nm, key=key, progress=progress)
  if rules is not None:
    params = apply_rules(params, rules, name_map=name_map, embeddings=embeddings)
  out: dict[str, dict] = {"params": {}}
  for flax_path, group in _group(params, name_map, ignore).items():
    for name, p in group["params"].items():
      _linen_param(out, flax_path, group["torch"], name, p, sparse=sparse, embeddings=embeddings)
  return jax.tree.map(jnp.asarray, {k: v for k, v in out.items() if v})


def _linen_param(out: dict, flax_path: str, torch_mod: str, name: str, p: TorchParam, *, sparse, embeddings) -> None:
  value = p.masked_value
  if name == "weight" and value.ndim == 2 and re.search(embeddings, torch_mod):
    _nest(out["params"], flax_path, "embedding", value)
  elif name == "weight" and value.ndim >= 2:
    kernel = flax_layout(value)
    pattern = p.pattern
    if not sparse or pattern.kind == "dense":
      _nest(out["params"], flax_path, "kernel", kernel)
    elif value.ndim != 2:  # a pruned conv: its mask in Flax layout (*kernel, in, out), as sparsify_linen's convs
      _nest(out["params"], flax_path, "kernel", kernel)
      _nest(out.setdefault("sparsity", {}), flax_path, "mask", flax_layout(p.mask))
    elif pattern.kind == "block":
      bs = (pattern.block_shape[1], pattern.block_shape[0])
      mat = BlockSparseMatrix.from_dense(kernel, bs, block_mask=flax_layout(p.mask)[:: bs[0], :: bs[1]])
      _nest(out["params"], flax_path, "kernel", np.asarray(mat.data))
      for f, v in mat.index_arrays().items():
        _nest(out.setdefault("sparsity", {}), flax_path, f, np.asarray(v))
    else:
      _nest(out["params"], flax_path, "kernel", kernel)
      _nest(out.setdefault("sparsity", {}), flax_path, "mask", flax_layout(p.mask))
  elif name == "weight" and value.ndim == 1:
    _nest(out["params"], flax_path, "scale", value)
  elif name in ("running_mean", "running_var"):
    _nest(out.setdefault("batch_stats", {}), flax_path, name.removeprefix("running_"), value)
  elif name == "num_batches_tracked":
    return
  else:
    _nest(out["params"], flax_path, name, value)


def _nest(tree: dict, path: str, leaf_name: str, value: Any) -> None:
  node = tree
  for part in [p for p in path.split(".") if p]:
    node = node.setdefault(part, {})
    if not isinstance(node, dict):
      raise CheckpointError(f"Flax path {path!r} collides with a parameter of the same name.")
  if leaf_name in node:
    raise CheckpointError(f"two torch parameters map to the Flax variable {path}.{leaf_name}.")
  node[leaf_name] = value
