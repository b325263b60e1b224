"""``torch.nn.MultiheadAttention``'s packed projections, split into the layers of Flax attention.

torch's ``nn.MultiheadAttention`` holds its three input projections in one ``in_proj_weight`` ``(3 * E, E)`` (rows:
query, key, value) and ``in_proj_bias`` ``(3 * E,)`` (with ``kdim`` / ``vdim`` other than ``embed_dim``: the weights
``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight`` and the packed bias), and its output projection as the Linear
``out_proj``. ``nnx.MultiHeadAttention`` and Linen's ``nn.MultiHeadDotProductAttention`` hold four layers: ``query``,
``key``, ``value`` and ``out``. Both frameworks lay heads out alike (feature ``head * head_dim + d``), so each third of
the packed tensors is the torch Linear of one Flax projection; a mask on the packed weight (``torch.nn.utils.prune``)
splits with it. The export packs them back (:func:`pack_attention`): a projection whose torch module is the rows
``"attn.in_proj[0:64]"`` (the import's name for it), or, where the torch target says ``attn`` is an
``nn.MultiheadAttention``, ``"attn.q_proj"`` / ``"attn.query"`` (and ``"attn.out"`` for ``out_proj``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxsparse.torch_interop._decode import TorchParam
from jaxsparse.torch_interop._entries import Entry
from jaxsparse.torch_interop._load import CheckpointError
from jaxsparse.torch_interop._load import import_torch

__all__ = ["attention_layouts", "is_packed_attention", "pack_attention", "split_packed_attention"]

PROJECTIONS = ("query", "key", "value")
_SEPARATE = {"query": "q_proj_weight", "key": "k_proj_weight", "value": "v_proj_weight"}
_PACKED = ("in_proj_weight", "in_proj_bias")


def is_packed_attention(group: dict) -> bool:
  """Whether a torch module's parameters (a group of :func:`~._names.group_params`) are ``nn.MultiheadAttention``'s."""
  return any(name in group["params"] for name in (*_PACKED, *_SEPARATE.values()))


def _join(mod: str, name: str) -> str:
  return f"{mod}.{name}" if mod else name


def _rows(p: TorchParam, i: int) -> TorchParam:
  """Rows ``[i * E, (i + 1) * E)`` of a packed ``(3 * E, ...)`` parameter (and of its mask), named after them."""
  if p.value.shape[0] % 3:
    raise CheckpointError(
        f"torch {p.name!r} has shape {p.shape}: nn.MultiheadAttention's packed query / key / value, which needs a "
        f"first dimension of 3 * embed_dim, not {p.value.shape[0]}."
    )
  e = p.value.shape[0] // 3
  rows = slice(i * e, (i + 1) * e)
  return dataclasses.replace(p, name=f"{p.name}[{rows.start}:{rows.stop}]", value=p.value[rows],
                             mask=None if p.mask is None else p.mask[rows])


def split_packed_attention(groups: dict[str, dict], flax_path: str) -> None:
  """Splits, in ``groups`` (in place), ``nn.MultiheadAttention``'s parameters mapped to the Flax attention module at
  ``flax_path`` into the groups of its ``query`` / ``key`` / ``value`` layers, and moves its ``out_proj`` to ``out``.

  Each projection's group is named for the torch rows it takes (``"attn.in_proj[0:64]"``: the report's torch module,
  which the export packs back into ``in_proj_weight``), or for its own weight (``"attn.q_proj"`` for ``q_proj_weight``:
  the export packs it back given the torch target). Parameters with no Flax counterpart (``bias_k`` /
  ``bias_v`` of ``add_bias_kv=True``) stay at ``flax_path``, where the loaders report them as having no place.

  Raises:
    CheckpointError: a packed tensor whose first dimension is not a multiple of 3, or a Flax projection that another
      torch module maps to as well.
  """
  group = groups.get(flax_path)
  if group is None or not is_packed_attention(group):
    return
  mod, params = group["torch"], dict(group["params"])
  packed = {name: params.pop(name) for name in _PACKED if name in params}
  for i, proj in enumerate(PROJECTIONS):
    split: dict[str, TorchParam] = {}
    if _SEPARATE[proj] in params:
      split["weight"] = params.pop(_SEPARATE[proj])
      label = _join(mod, _SEPARATE[proj].removesuffix("_weight"))
    if "in_proj_weight" in packed:
      split["weight"] = _rows(packed["in_proj_weight"], i)
      label = split["weight"].name.replace("in_proj_weight", "in_proj")
    if "in_proj_bias" in packed:
      split["bias"] = _rows(packed["in_proj_bias"], i)
    if not split:
      continue
    if "weight" not in split:
      label = split["bias"].name.replace("in_proj_bias", "in_proj")
    _add(groups, _join(flax_path, proj), {"torch": label, "params": split})
  out = groups.pop(_join(flax_path, "out_proj"), None)
  if out is not None:
    _add(groups, _join(flax_path, "out"), out)
  if params:
    group["params"] = params
  else:
    del groups[flax_path]


def _add(groups: dict[str, dict], flax_path: str, group: dict) -> None:
  if flax_path in groups:
    raise CheckpointError(
        f"torch {groups[flax_path]['torch']!r} and {group['torch']!r} (nn.MultiheadAttention's) both map to the Flax "
        f"path {flax_path!r}; the name map is ambiguous."
    )
  groups[flax_path] = group


# The import's names for the projections (rows of the packed tensors, or the separate weights of kdim / vdim), and
# Flax's: the separate and the Flax names are also a plain Linear's (BART's q_proj, a ModuleDict's query), so only a
# torch target that has an nn.MultiheadAttention there makes them its projections.
_ROWS = re.compile(r"^(?:(?P<attn>.*)\.)?in_proj\[(?P<start>\d+):(?P<stop>\d+)\]$")
_PROJECTION_INDEX = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "query": 0, "key": 1, "value": 2}
_TARGET_PARAM = re.compile(r"^(?:(?P<mod>.*)\.)?parametrizations\.(?P<param>\w+)\.(?:original|\d+\.\w+)$")


def attention_layouts(target: Any) -> dict[str, str]:
  """``{torch module path: "packed" | "separate"}`` for the ``nn.MultiheadAttention`` modules of ``target``.

  ``target`` is a ``torch.nn.Module``, a state dict or an iterable of its keys (``None``: none). A module with an
  ``in_proj_weight`` is ``"packed"``, one with ``q_proj_weight`` / ``k_proj_weight`` / ``v_proj_weight`` (``kdim`` or
  ``vdim`` other than ``embed_dim``) ``"separate"``; pruned (``in_proj_weight_orig``) and ``torch.ao`` parametrized
  (``parametrizations.in_proj_weight.original``) names count alike.

  Raises:
    TypeError: ``target`` is none of these, or holds a key that is not a ``str``.
  """
  if target is None:
    return {}
  torch = import_torch()
  if isinstance(target, torch.nn.Module):
    keys = list(target.state_dict())
  elif isinstance(target, Mapping | Iterable) and not isinstance(target, str | bytes):
    keys = list(target)
  else:
    keys = None
  if keys is None or not all(isinstance(k, str) for k in keys):
    raise TypeError(f"target must be the torch.nn.Module the state dict is for, its state dict or its keys (str), or "
                    f"None; got {target!r:.200} ({type(target).__name__}).")
  layouts: dict[str, str] = {}
  for key in keys:
    found = _TARGET_PARAM.match(key)
    mod, param = (found["mod"] or "", found["param"]) if found else key.rpartition(".")[::2]
    param = param.removesuffix("_orig").removesuffix("_mask")
    if param == "in_proj_weight":
      layouts[mod] = "packed"
    elif param in _SEPARATE.values():
      layouts.setdefault(mod, "separate")
  return layouts


def _projection(mod: str, layouts: Mapping[str, str]) -> tuple[str, int] | None:
  """``(attention module, 0 | 1 | 2 for query / key / value, 3 for out)`` if the torch module path ``mod`` names a
  projection of an ``nn.MultiheadAttention``, else ``None``."""
  rows = _ROWS.match(mod)
  if rows:
    start, stop = int(rows["start"]), int(rows["stop"])
    if stop <= start or start % (stop - start) or start // (stop - start) > 2:
      raise CheckpointError(f"torch module {mod!r} names rows [{start}:{stop}] of nn.MultiheadAttention's packed "
                            "in_proj_weight, which are query, key or value: [i * E:(i + 1) * E] for i in 0, 1, 2.")
    return rows["attn"] or "", start // (stop - start)
  attn, _, leaf = mod.rpartition(".")
  if attn not in layouts:
    return None
  if leaf in _PROJECTION_INDEX:
    return attn, _PROJECTION_INDEX[leaf]
  return (attn, 3) if leaf == "out" else None


def _stack(parts: list[Entry], name: str, attn: str) -> Entry:
  """The rows of ``parts`` (query, key, value) as one packed entry ``name``; a mask if any part has one (the others'
  rows all kept), the block shape they share."""
  shapes = {p.value.shape[1:] for p in parts}
  if len(shapes) > 1:
    raise CheckpointError(
        f"{_join(attn, name)}: nn.MultiheadAttention packs query, key and value of one input size into {name}, but "
        f"the projections take {[p.value.shape for p in parts]}; an attention with kdim / vdim holds q_proj_weight, "
        "k_proj_weight and v_proj_weight: pass its torch module as target=."
    )
  masks = [p.mask for p in parts]
  mask = None
  if any(m is not None for m in masks):
    mask = np.concatenate([np.ones(p.value.shape, bool) if m is None else np.asarray(m, bool)
                           for p, m in zip(parts, masks, strict=True)])
  blocks = {p.block_shape for p in parts}
  block_shape = blocks.pop() if len(blocks) == 1 and all(m is not None for m in masks) else None
  value = np.concatenate([np.asarray(p.value) for p in parts])
  return Entry(parts[0].flax_path.rpartition(".")[0], name, value, mask, block_shape=block_shape)


def pack_attention(items: list[tuple[str, Entry]], layouts: Mapping[str, str]) -> list[tuple[str, Entry]]:
  """``items`` (``(torch module path, Entry)``) with ``nn.MultiheadAttention``'s projections written as torch holds
  them: query / key / value weights in ``in_proj_weight`` (rows, their masks alike) or, for a ``"separate"`` layout
  (:func:`attention_layouts`), ``q_proj_weight`` / ``k_proj_weight`` / ``v_proj_weight``, their biases in
  ``in_proj_bias``, ``out`` as ``out_proj``; each packed tensor where its first projection was.

  Raises:
    CheckpointError: a packed tensor some projections of which the export does not write (torch holds them in one
      tensor), two Flax modules for one projection, projections of different input sizes for ``in_proj_weight``.
  """
  out: list[tuple[str, Entry | tuple[str, str]]] = []
  parts: dict[tuple[str, str], dict[int, Entry]] = {}
  for mod, e in items:
    found = _projection(mod, layouts)
    if found is None:
      out.append((mod, e))
      continue
    attn, i = found
    if i == 3:
      out.append((_join(attn, "out_proj"), e))
      continue
    if e.name not in ("weight", "bias"):
      raise CheckpointError(f"torch module {mod!r} is a projection of nn.MultiheadAttention {attn!r}, which holds a "
                            f"weight and a bias, not {e.name!r} (from the Flax {_join(e.flax_path, e.name)!r}).")
    if layouts.get(attn) == "separate" and e.name == "weight":
      out.append((attn, dataclasses.replace(e, name=_SEPARATE[PROJECTIONS[i]])))
      continue
    name = f"in_proj_{e.name}"
    slot = parts.get((attn, name))
    if slot is None:
      slot = parts[attn, name] = {}
      out.append((attn, (attn, name)))
    if i in slot:
      raise CheckpointError(f"the Flax {slot[i].flax_path!r} and {e.flax_path!r} are both the {PROJECTIONS[i]} "
                            f"projection of nn.MultiheadAttention {attn!r} (torch {_join(attn, name)!r}).")
    slot[i] = e
  packed = []
  for mod, e in out:
    if isinstance(e, tuple):
      slot = parts[e]
      lacking = [PROJECTIONS[i] for i in range(3) if i not in slot]
      if lacking:
        raise CheckpointError(
            f"torch {_join(*e)!r} packs query, key and value of nn.MultiheadAttention {mod!r}, but the export has no "
            f"{' / '.join(lacking)} for it (from {sorted(p.flax_path for p in slot.values())}): torch holds all three "
            "in one tensor; export the whole attention module."
        )
      e = _stack([slot[i] for i in range(3)], e[1], mod)
    packed.append((mod, e))
  return packed
