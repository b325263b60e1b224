"""``torch.nn.MultiheadAttention``'s packed projections, split into the layers of Flax attention.

torch's ``nn.MultiheadAttention`` holds its three input projections in one ``in_proj_weight`` ``(3 * E, E)`` (rows:
query, key, value) and ``in_proj_bias`` ``(3 * E,)`` (with ``kdim`` / ``vdim`` other than ``embed_dim``: the weights
``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight`` and the packed bias), and its output projection as the Linear
``out_proj``. ``nnx.MultiHeadAttention`` and Linen's ``nn.MultiHeadDotProductAttention`` hold four layers: ``query``,
``key``, ``value`` and ``out``. Both frameworks lay heads out alike (feature ``head * head_dim + d``), so each third of
the packed tensors is the torch Linear of one Flax projection; a mask on the packed weight (``torch.nn.utils.prune``)
splits with it.
"""

from __future__ import annotations

import dataclasses

from jaxsparse.torch_interop._decode import TorchParam
from jaxsparse.torch_interop._load import CheckpointError

__all__ = ["is_packed_attention", "split_packed_attention"]

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

  Each projection's group is named for the torch rows it takes (``"attn.in_proj[0:64]"``: the report's torch module;
  there is no such torch module, so export it back by hand). Parameters with no Flax counterpart (``bias_k`` /
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
