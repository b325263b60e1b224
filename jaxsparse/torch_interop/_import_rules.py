"""Sparsifying decoded PyTorch weights while importing them: rules map Flax module paths to structures.

:func:`apply_rules` runs between :func:`~jaxsparse.torch_interop.decode_checkpoint` and the loaders (the Linen
converter's ``rules=``, ``jaxsparse convert --rules``): it gives the matched Linear weights a magnitude mask, in
torch layout.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxsparse import _rules
from jaxsparse import formats
from jaxsparse.formats import _masks
from jaxsparse.formats._specs import check_plain_nm
from jaxsparse.torch_interop._decode import TorchParam
from jaxsparse.torch_interop._decode import float_value
from jaxsparse.torch_interop._load import CheckpointError
from jaxsparse.torch_interop._names import DEFAULT_EMBEDDINGS
from jaxsparse.torch_interop._names import NameMap
from jaxsparse.torch_interop._names import map_name
from jaxsparse.torch_interop._patterns import flax_layout
from jaxsparse.torch_interop._patterns import nm_mask_torch

__all__ = ["apply_rules"]


def _join(mod: str, name: str) -> str:
  return f"{mod}.{name}" if mod else name


def apply_rules(
    params: Mapping[str, TorchParam],
    rules: Any,
    *,
    name_map: NameMap = None,
    embeddings: str = DEFAULT_EMBEDDINGS,
) -> dict[str, TorchParam]:
  """Sparsifies decoded Linear weights by magnitude: ``rules`` maps Flax module paths to structures.

  ``rules`` is one structure for every Linear weight or ``{regex: structure or None}``; a module takes
  the first regex that matches its Flax path in full (``None``: leave it). Structures are
  :class:`jaxsparse.BlockSparse` (largest-norm blocks, ``block_shape`` in Flax ``(in, out)`` layout),
  :class:`jaxsparse.NM` (``n`` largest of every ``m`` inputs) and :class:`jaxsparse.Unstructured`. The
  new mask replaces any mask the weight had (pruned weights are zero, so they rank last). Magnitudes rank in
  float32, float64 weights in float64 (as torch's pruning ranks them; block and unstructured rules only under
  ``jax_enable_x64``, without which JAX holds float64 as float32).

  >>> import torch, jaxsparse
  >>> from jaxsparse import torch_interop
  >>> params = torch_interop.decode_checkpoint(torch.nn.Linear(8, 4).state_dict())
  >>> w = torch_interop.apply_rules(params, jaxsparse.NM(2, 4))["weight"]
  >>> w.format, str(w.pattern), w.mask.shape, w.mask.dtype
  ('dense + 2:4', '2:4', (4, 8), dtype('bool'))

  Args:
    params: ``{name: TorchParam}`` from :func:`decode_checkpoint`.
    rules: one structure or ``{regex: structure or None}`` over Flax module paths (after ``name_map``).
    name_map: how torch module paths become Flax ones (see :func:`map_name`).
    embeddings: regex (``re.search`` on the torch module path) of the 2-D weights that are embedding tables,
      not Linear weights.

  Returns:
    A new ``{name: TorchParam}``: the matched Linear weights get a bool mask of their torch ``(out, in)``
    shape (with zeros at the dropped entries of ``value`` and ``format`` ending in the structure), every other
    parameter is passed through unchanged.

  Raises:
    CheckpointError: a rule that matches no Linear weight (listing the Linear paths there are), or a
      ``{regex: structure}`` rule that matches a convolution or embedding weight, which import rules
      cannot sparsify.
  """
  resolved = _rules.resolve_rules(rules)
  lone = not isinstance(rules, Mapping)  # one structure for every Linear weight: others are not its target
  out = dict(params)
  used: set[int] = set()
  linear_paths: list[str] = []
  for name, p in params.items():
    if p.param != "weight" or p.value is None or p.value.ndim < 2:
      continue
    flax_path = map_name(name_map, p.module)
    i = None if flax_path is None else _rules.match_rules(resolved, flax_path)
    if p.value.ndim != 2 or re.search(embeddings, p.module):
      if i is not None and resolved[i][2] is None:
        used.add(i)
      elif i is not None and not lone:
        kind = "an embedding" if p.value.ndim == 2 else f"a {p.value.ndim}-D (convolution) weight"
        raise CheckpointError(
            f"rule {resolved[i][0]!r} matches {name!r} (Flax {flax_path!r}), {kind} of shape {p.shape}; import "
            "rules sparsify Linear (2-D) weights only. Narrow the rule, or map it to None (keep dense)."
        )
      continue
    if flax_path is not None:
      linear_paths.append(flax_path)
    if i is None:
      continue
    used.add(i)
    if resolved[i][2] is None:
      continue
    spec = resolved[i][2]
    # In the weight's own dtype: the masks rank float64 weights in float64 (a cast here would make float32 ties).
    kernel = flax_layout(float_value(p, into=f"the Flax {_join(flax_path, 'kernel')!r}"))
    try:
      if isinstance(spec, formats.BlockSparse):
        bk, bn = spec.block_shape
        bm = np.asarray(_masks.block_magnitude_mask(kernel, (bk, bn), spec.density))
        mask = np.repeat(np.repeat(bm, bk, 0), bn, 1)
      elif isinstance(spec, formats.NM):
        check_plain_nm(spec, path=flax_path, what="a PyTorch import rule")
        full = spec.n == spec.m
        mask = np.ones_like(kernel, bool) if full else flax_layout(nm_mask_torch(p.masked_value, spec.n, spec.m))
      else:
        mask = np.asarray(_masks.magnitude_mask(kernel, spec.sparsity))
    except ValueError as e:
      raise CheckpointError(f"rule {resolved[i][0]!r} cannot sparsify {name!r} (Flax {flax_path!r}): {e}") from e
    mask_t = np.ascontiguousarray(mask.T)
    out[name] = TorchParam(name, p.masked_value, mask_t, f"{p.format} + {spec.describe()}", p.keys)
  unused = [pattern for i, (pattern, _, _) in enumerate(resolved) if i not in used]
  if unused:
    listing = ", ".join(linear_paths[:20]) + (" ..." if len(linear_paths) > 20 else "") if linear_paths else "(none)"
    raise CheckpointError(
        f"rule(s) {unused} matched no Linear weight (rules fully match Flax module paths, after name_map); "
        f"the Linear paths are: {listing}."
    )
  return out
