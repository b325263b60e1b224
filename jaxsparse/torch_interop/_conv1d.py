"""Transformers' ``Conv1D`` weights (GPT-2's ``c_attn``, ``c_proj``, ``c_fc``): stored ``(in, out)``, not a torch
``Linear``'s ``(out, in)``, which a state dict alone does not tell for a square one.

:func:`conv1d_weights` decides which decoded weights are such (module classes, a ``conv1d`` regex, a bias that gives
the layout away) for :func:`~jaxsparse.torch_interop.decode_checkpoint`, which transposes them to the Linear layout;
the exporters write them back with ``conv1d=``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from jaxsparse.torch_interop._load import CheckpointError

__all__ = ["CONV1D_FORMAT", "check_conv1d", "conv1d_weights"]

# Ends the format of a transformers Conv1D weight, decoded transposed to the Linear layout (out, in).
CONV1D_FORMAT = "Conv1D (in, out)"


def check_conv1d(conv1d: str | None) -> None:
  """Raises unless ``conv1d`` is ``None`` or a regex that compiles (naming the value)."""
  if conv1d is not None and not isinstance(conv1d, str):
    raise TypeError(f"conv1d must be a regex (str) of Conv1D module paths or None, got {conv1d!r}.")
  try:
    re.compile("" if conv1d is None else conv1d)
  except re.error as e:
    raise ValueError(f"conv1d={conv1d!r} is not a valid regular expression ({e}).") from e


def _is_conv1d(kind: type) -> bool:
  """Whether a torch module class is (a subclass of) transformers' ``Conv1D``, without importing transformers."""
  return any(c.__name__ == "Conv1D" and c.__module__.split(".")[0] == "transformers" for c in kind.__mro__)


def conv1d_weights(decoded: Mapping[str, tuple], module_types: Mapping[str, type], conv1d: str | None) -> set[str]:
  """The names of the 2-D weights stored ``(in, out)`` as transformers' ``Conv1D`` (GPT-2) stores them.

  Decided per module, first to last: its class (a ``torch.nn.Module`` source), the ``conv1d`` regex, its 1-D bias
  (a Linear ``(out, in)`` weight's bias has ``out`` entries: one of ``shape[1] != shape[0]`` entries means ``(in,
  out)``). A square weight with a bias cannot tell; once a non-square one has shown ``(in, out)`` weights in the
  checkpoint, such square weights raise instead of being read as Linear ones.
  """
  found, square = set(), []
  for name, (value, *_) in decoded.items():
    mod, _, param = name.rpartition(".")
    if param != "weight" or value.ndim != 2:
      continue
    kind = module_types.get(mod)
    if kind is not None:
      if _is_conv1d(kind):
        found.add(name)
      continue
    if conv1d is not None:
      if re.search(conv1d, mod):
        found.add(name)
      continue
    bias = decoded.get(f"{mod}.bias" if mod else "bias")
    if bias is None or bias[0].ndim != 1 or bias[0].shape[0] != value.shape[1]:
      continue
    if value.shape[0] == value.shape[1]:
      square.append(name)
    else:
      found.add(name)
  if found and square:
    listing = ", ".join(square[:5]) + (f" and {len(square) - 5} more" if len(square) > 5 else "")
    raise CheckpointError(
        f"{sorted(found)[0]!r} is stored (in, out) (its bias has {decoded[sorted(found)[0]][0].shape[1]} entries, its "
        f"second dimension), as transformers' Conv1D (GPT-2) stores weights, so the square weight(s) {listing} may be "
        "(in, out) too or torch Linear (out, in) ones: a state dict does not tell. Pass the torch module itself "
        "(its Conv1D modules are known), or conv1d= a regex (re.search) of the Conv1D module paths (CLI: --conv1d), "
        r"e.g. conv1d=r'\.(c_attn|c_proj|c_fc)$'."
    )
  return found
