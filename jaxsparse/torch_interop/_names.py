"""Torch module paths to Flax module paths, and the report of a load.

Name mapping: torch *module* paths (``"encoder.layer.0.output.dense"``) become Flax module paths
(``"encoder.layer.0.output.dense"`` by default: NNX paths are attribute names and list indices joined by dots),
through :func:`map_name`; :func:`group_params` groups decoded parameters by the Flax module they load into.
:class:`LoadReport` (one :class:`LayerLoad` a layer) is what :func:`~jaxsparse.torch_interop.load_nnx` and the Linen
loader return.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence

from jaxsparse.torch_interop._decode import TorchParam
from jaxsparse.torch_interop._load import CheckpointError
from jaxsparse.torch_interop._patterns import Pattern

__all__ = ["DEFAULT_EMBEDDINGS", "LayerLoad", "LoadReport", "NameMap", "group_params", "ignore_patterns", "ignored",
           "map_name"]

NameMap = Callable[[str], str | None] | Mapping[str, str | None] | Sequence[tuple[str, str | None]] | None

# Embedding tables are 2-D like Linear weights but are not transposed; without a target model
# (to_linen_variables, the CLI) they are told apart by name.
DEFAULT_EMBEDDINGS = r"(^|\.)(\w*embed\w*|wte|wpe|shared)$"


def map_name(name_map: NameMap, torch_path: str) -> str | None:
  """Maps a torch module path to a Flax module path (``None``: drop it).

  ``name_map`` is ``None`` (same dotted names), a callable, a dict of exact paths (others unchanged),
  or a sequence of ``(regex, replacement)`` rules applied in order with :func:`re.sub`; a rule whose
  replacement is ``None`` drops every path it matches.

  >>> from jaxsparse.torch_interop import map_name
  >>> map_name([(r"attention\\.self\\.", "attention.")], "encoder.layer.0.attention.self.query")
  'encoder.layer.0.attention.query'
  >>> map_name([(r"^pooler\\.", None)], "pooler.dense") is None
  True

  Args:
    name_map: ``None``, a callable ``torch path -> Flax path or None``, a dict of exact paths, or a sequence
      of ``(regex, replacement or None)`` rules.
    torch_path: the dotted torch module path, e.g. ``"encoder.layer.0.attention.self.query"``.

  Returns:
    The dotted Flax module path (a ``str``), or ``None`` when the module is dropped.

  Raises:
    TypeError: a rule of a sequence ``name_map`` that is not a ``(regex, replacement)`` pair.
    re.error: a rule's regex (or replacement) that does not compile; the message names the rule.
  """
  if name_map is None:
    return torch_path
  if callable(name_map):
    return name_map(torch_path)
  if isinstance(name_map, Mapping):
    return name_map.get(torch_path, torch_path)
  out = torch_path
  for rule in name_map:
    if not (isinstance(rule, tuple | list) and len(rule) == 2):
      raise TypeError(f"name_map rules must be (regex, replacement) pairs, got {rule!r}.")
    pattern, repl = rule
    try:
      if repl is None:
        if re.search(pattern, out):
          return None
        continue
      out = re.sub(pattern, repl, out)
    except re.error as e:  # name the argument and the rule, not only the regex
      raise re.error(f"name_map rule {rule!r}: {e.msg}", e.pattern, e.pos) from None
  return out


@dataclasses.dataclass(frozen=True)
class LayerLoad:
  """How one torch module was loaded.

  Attributes:
    flax_path: dotted Flax module path.
    torch_module: dotted torch module path.
    layer: class name of the Flax module that holds the weights now.
    format: the torch format of its weight (``"dense"``, ``"torch.nn.utils.prune"``, ...).
    pattern: the sparsity :class:`Pattern` of the weight (``"dense"`` without a mask).

  >>> import torch, torch.nn.utils.prune as prune
  >>> from flax import nnx
  >>> from jaxsparse import torch_interop
  >>> net = torch.nn.Sequential(torch.nn.Linear(16, 8))
  >>> _ = prune.l1_unstructured(net[0], "weight", amount=0.5)
  >>> model = nnx.Sequential(nnx.Linear(16, 8, rngs=nnx.Rngs(0)))
  >>> row = torch_interop.load_nnx(model, net.state_dict(), name_map=[(r"^", "layers.")]).layers[0]
  >>> row.flax_path, row.torch_module, row.layer, row.format, str(row.pattern), row.pattern.density
  ('layers.0', '0', 'MaskedLinear', 'torch.nn.utils.prune', 'unstructured', 0.5)
  """

  flax_path: str
  torch_module: str
  layer: str
  format: str
  pattern: Pattern


@dataclasses.dataclass
class LoadReport:
  """What :func:`load_nnx` did (or :func:`to_linen_variables`, with ``report=True``).

  Attributes:
    layers: one :class:`LayerLoad` per Flax module that received weights.
    missing: Flax parameters nothing was loaded into (only with ``strict=False``; :func:`to_linen_variables`: the
      target's variables, e.g. ``"params.fc.bias"``).
    unexpected: torch parameters that were not used (only with ``strict=False``).
    tied: ``{torch parameter: torch parameter}``: those skipped because they are the very tensor (the same memory) of
      a loaded one and the Flax model has no module for them (a tied torch model's ``lm_head.weight``, whose Flax
      twin computes with the embedding's ``attend``); ``export_state_dict(..., tied=report.tied)`` writes them back.
    notes: what was loaded but not kept, one line each (the mask of a pruned bias, applied to a dense Flax bias).

  ``str(report)`` is a table of the layers, then the missing, unexpected and tied names and the notes.

  >>> import torch
  >>> from flax import nnx
  >>> from jaxsparse import torch_interop
  >>> state = {**torch.nn.Linear(16, 8).state_dict(), "extra.weight": torch.zeros(2, 2)}
  >>> report = torch_interop.load_nnx(nnx.Linear(16, 8, rngs=nnx.Rngs(0)), state, strict=False)
  >>> [layer.layer for layer in report.layers], report.missing, report.unexpected
  (['Linear'], [], ['extra.weight'])
  >>> report.torch_names
  {'': ''}
  """

  layers: list[LayerLoad]
  missing: list[str] = dataclasses.field(default_factory=list)
  unexpected: list[str] = dataclasses.field(default_factory=list)
  tied: dict[str, str] = dataclasses.field(default_factory=dict)
  notes: list[str] = dataclasses.field(default_factory=list)

  @property
  def torch_names(self) -> dict[str, str]:
    """``{flax module path: torch module path}``: pass it to the export functions to write torch names."""
    return {layer.flax_path: layer.torch_module for layer in self.layers}

  def __str__(self) -> str:
    rows = [("flax path", "torch module", "layer", "format", "pattern", "density")]
    for r in self.layers:
      rows.append((r.flax_path, r.torch_module, r.layer, r.format, str(r.pattern), f"{r.pattern.density:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if self.missing:
      lines.append(f"missing (not loaded): {self.missing}")
    if self.unexpected:
      lines.append(f"unexpected (not used): {self.unexpected}")
    if self.tied:
      lines.append(f"tied (the same tensor as a loaded one; skipped): {self.tied}")
    lines.extend(f"note: {note}" for note in self.notes)
    return "\n".join(lines)


def ignore_patterns(ignore: str | Iterable[str] | None) -> tuple[str, ...]:
  """The glob patterns of an ``ignore=`` argument: one ``str`` is one pattern, ``None`` none.

  A string is iterable, and taken character by character its ``"*"`` would match every parameter: it is one pattern.

  Raises:
    TypeError: ``ignore`` is neither a ``str``, ``None`` nor an iterable of ``str``, naming the value.
  """
  if ignore is None:
    return ()
  if isinstance(ignore, str):
    return (ignore,)
  allowed = "a glob pattern (str), an iterable of them (e.g. ['pooler.*', 'lm_head.weight']) or None"
  if not isinstance(ignore, Iterable):
    raise TypeError(f"ignore must be {allowed}, got {ignore!r} ({type(ignore).__name__}).")
  patterns = tuple(ignore)
  bad = [p for p in patterns if not isinstance(p, str)]
  if bad:
    raise TypeError(f"ignore must be {allowed}, got {ignore!r}, holding {bad[0]!r} ({type(bad[0]).__name__}).")
  return patterns


def ignored(name: str, ignore: str | Iterable[str] | None) -> bool:
  return any(fnmatch.fnmatchcase(name, pattern) for pattern in ignore_patterns(ignore))


def group_params(params: Mapping[str, TorchParam], name_map: NameMap,
                 ignore: str | Iterable[str] | None) -> dict[str, dict]:
  """``{flax module path: {"torch": torch module path, "params": {param: TorchParam}}}``."""
  ignore = ignore_patterns(ignore)
  groups: dict[str, dict] = {}
  for p in params.values():
    if ignored(p.name, ignore):
      continue
    flax_path = map_name(name_map, p.module)
    if flax_path is None:
      continue
    g = groups.setdefault(flax_path, {"torch": p.module, "params": {}})
    if g["torch"] != p.module:
      raise CheckpointError(
          f"torch modules {g['torch']!r} and {p.module!r} both map to the Flax path {flax_path!r}; the name map is "
          "ambiguous."
      )
    g["params"][p.param] = p
  return groups
