"""Flax Linen variables from a PyTorch checkpoint: layers recognised by their parameters, shapes from a target's.

The name mapping and the sparsifying rules are those of the NNX loader (:func:`~._names.map_name`,
:func:`~._flax.apply_rules`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse._rules import path_str
from jaxsparse._utils import warn_at_caller
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._specs import matrix_shape
from jaxsparse.torch_interop._attention import is_packed_attention
from jaxsparse.torch_interop._attention import split_packed_attention
from jaxsparse.torch_interop._decode import NMSpec
from jaxsparse.torch_interop._decode import TorchParam
from jaxsparse.torch_interop._decode import decode_checkpoint
from jaxsparse.torch_interop._decode import float_value
from jaxsparse.torch_interop._flax import loaded_twin
from jaxsparse.torch_interop._flax import mask_not_kept_note
from jaxsparse.torch_interop._import_rules import apply_rules
from jaxsparse.torch_interop._limits import limit_scope
from jaxsparse.torch_interop._load import CheckpointError
from jaxsparse.torch_interop._load import TensorSource
from jaxsparse.torch_interop._load import import_torch
from jaxsparse.torch_interop._load import open_checkpoint
from jaxsparse.torch_interop._names import DEFAULT_EMBEDDINGS
from jaxsparse.torch_interop._names import LayerLoad
from jaxsparse.torch_interop._names import LoadReport
from jaxsparse.torch_interop._names import NameMap
from jaxsparse.torch_interop._names import group_params
from jaxsparse.torch_interop._names import ignore_patterns
from jaxsparse.torch_interop._names import ignored
from jaxsparse.torch_interop._names import map_name
from jaxsparse.torch_interop._patterns import flax_layout

__all__ = ["to_linen_variables"]


def to_linen_variables(
    source: Any,
    *,
    name_map: NameMap = None,
    ignore: str | Iterable[str] | None = (),
    nm: NMSpec = None,
    rules: Any = None,
    sparse: bool = True,
    embeddings: str | None = None,
    key: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    target: Mapping | None = None,
    conv1d: str | None = None,
    max_bytes: int | None = None,
    strict: bool = True,
    report: bool = False,
) -> dict[str, dict] | tuple[dict[str, dict], LoadReport]:
  r"""Flax Linen variables for a PyTorch checkpoint, with jaxsparse layouts for its sparse layers.

  Layers are recognised by their parameters: a 2-D ``weight`` is a Linear's (``kernel = weight.T``) or an
  embedding table (``embedding``, as torch holds it), a weight of ndim >= 3 a Conv, a 1-D ``weight`` a norm
  ``scale``; ``running_mean``/``running_var`` go to ``"batch_stats"`` as ``mean``/``var``. Which 2-D weights are
  tables is decided, first to last, by the torch module's class when ``source`` is a ``torch.nn.Module``
  (``nn.Embedding`` / ``nn.EmbeddingBag``: a table, ``nn.Linear``: not), by the target's leaf at its Flax path
  (``embedding`` or ``kernel``), by a ``bias`` (a table has none), by ``embeddings`` matching its module path. A state
  dict alone does not tell a bias-free Linear from an Embedding: with the default ``embeddings``, a warning lists the
  bias-free weights read as Linear ones. A pruned
  table's bool mask ``(num_embeddings, features)`` comes under ``"masks"`` (no Linen embedding holds one): with a
  :class:`jaxsparse.NM` rule naming the table, :func:`jaxsparse.sparsify_linen` (``masks=``) makes it a
  :class:`~jaxsparse.layers.linen.CompressedNMEmbed` with exactly that mask. Sparse Linear weights take the variables of
  :class:`~jaxsparse.layers.linen.BlockSparseDense` (block patterns: ``params.kernel`` of the kept
  blocks and the index arrays in ``"sparsity"``) or :class:`~jaxsparse.layers.linen.MaskedDense`
  (other masks, N:M included: ``params.kernel`` zero where pruned and ``sparsity.mask``). A pruned
  Conv weight keeps its mask too: ``params.kernel`` zero where pruned and ``sparsity.mask`` in Flax
  layout ``(*kernel_size, in, out)``, for ``nn.Conv(..., mask=mask)``.

  >>> import torch
  >>> from jaxsparse import torch_interop
  >>> state = {"fc.weight": torch.ones(4, 8), "fc.weight_mask": torch.eye(4, 8), "fc.bias": torch.zeros(4)}
  >>> v = torch_interop.to_linen_variables(state)
  >>> v["params"]["fc"]["kernel"].shape, v["sparsity"]["fc"]["mask"].shape
  ((8, 4), (8, 4))
  >>> net = torch.nn.ModuleDict({"tok": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10, bias=False)})
  >>> {k: {n: a.shape for n, a in p.items()} for k, p in torch_interop.to_linen_variables(net)["params"].items()}
  {'head': {'kernel': (4, 10)}, 'tok': {'embedding': (10, 4)}}

  With ``target``, the variables take the target's shapes, so a Linen ``nn.MultiHeadDotProductAttention``
  (whose ``nn.DenseGeneral`` q/k/v kernels are ``(in, heads, head_dim)``) applies them, and its masks come
  in the form :func:`jaxsparse.sparsify_linen` takes:

  >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxsparse
  >>> attn = nn.MultiHeadDotProductAttention(2, qkv_features=8, use_bias=False)
  >>> x = jnp.ones((1, 3, 8))
  >>> state = {f"{p}.weight": torch.ones(8, 8) for p in ("query", "key", "value", "out")}
  >>> state["query.weight_mask"] = torch.eye(8)
  >>> v = torch_interop.to_linen_variables(state, target=jax.eval_shape(attn.init, jax.random.key(0), x))
  >>> v["params"]["query"]["kernel"].shape, v["params"]["out"]["kernel"].shape, v["masks"]["query"]["kernel"].shape
  ((8, 2, 4), (2, 4, 8), (8, 2, 4))
  >>> masks = v.pop("masks")
  >>> sparse, sparse_vars, _ = jaxsparse.sparsify_linen(attn, v, {"query": jaxsparse.Unstructured(0.875)}, x,
  ...                                                   masks=masks)
  >>> bool(jnp.allclose(sparse.apply(sparse_vars, x), attn.apply(v, x)))
  True

  ``report=True`` returns the :class:`LoadReport` too, as :func:`load_nnx` gives it: a row per torch module (its
  ``layer`` the Linen layer the variables are laid out for), the torch tensors not used (``strict=False``), the tied
  ones skipped and the notes (a pruned bias's mask applied, not kept):

  >>> import torch.nn.utils.prune as prune
  >>> net = torch.nn.ModuleDict({"fc": torch.nn.Linear(8, 4)})
  >>> _ = prune.l1_unstructured(net["fc"], "bias", amount=0.5)
  >>> variables, report = torch_interop.to_linen_variables(net, report=True)
  >>> [(row.flax_path, row.torch_module, row.layer) for row in report.layers], len(report.notes)
  ([('fc', 'fc', 'Dense')], 1)

  Args:
    source: anything :func:`load_state_dict` takes.
    name_map: torch module path -> Flax module path (see :func:`map_name`).
    ignore: glob patterns (``fnmatch``) of torch parameter names to skip: one pattern (``"pooler.*"``), an iterable
      of them or ``None`` (none).
    nm: recompute N:M masks of dense weights (see :func:`decode_checkpoint`).
    rules: sparsify Linear weights while converting (see :func:`apply_rules`), e.g.
      ``{r".*intermediate\.dense": jaxsparse.NM(2, 4)}``.
    sparse: ``False`` writes masked dense kernels and tables without ``"sparsity"`` or ``"masks"`` entries.
    embeddings: regex (``re.search``) of the torch module paths whose 2-D weight is an embedding table, for what
      the module types and ``target`` leave open; given, every bias-free 2-D weight it does not match is a Linear's,
      without a warning. ``None``: ``r"(^|\.)(\w*embed\w*|wte|wpe|shared)$"``, and the warning.
    key: path of the state dict inside a nested checkpoint.
    progress: called as ``progress(done, total)`` while decoding.
    target: the variables of the Linen model the checkpoint is for (concrete, or abstract from
      ``jax.eval_shape(model.init, key, x)``; only shapes are read). Each variable then takes the shape of the
      target's: a torch ``Linear``'s kernel ``(in, out)`` and its mask become a kernel whose 2-D view
      (``matrix_shape``: its first axes inputs, the rest outputs) is ``(in, out)``, such as the
      ``(in, heads, head_dim)`` q/k/v and ``(heads, head_dim, out)`` out kernels of Linen attention, and a
      1-D bias one of the same size, an embedding table the target's ``embedding``; pruned weights are written as
      dense kernels (zero where pruned) with their masks under ``"masks"``. A ``torch.nn.MultiheadAttention`` whose
      Flax path holds the target's ``query`` / ``key`` / ``value`` / ``out`` (``nn.MultiHeadDotProductAttention``)
      fills them: its packed ``in_proj_weight`` / ``in_proj_bias`` split by rows (a mask alike), its ``out_proj``
      into ``out``. A variable the target lacks, one of the target's ``"params"`` the checkpoint lacks, or a shape
      that does not fit raises a :class:`CheckpointError` naming it (with ``strict=False`` the first two are left
      out and listed in the report's ``unexpected`` / ``missing``). A dense torch tensor the target has no variable
      for that is the very tensor (the same memory) of one that was loaded, as a tied torch model's
      ``lm_head.weight`` is its embedding's, is skipped and listed in the report's ``tied``, as :func:`load_nnx`
      does.
    conv1d: regex of the torch module paths whose weights are stored ``(in, out)`` like transformers' ``Conv1D``
      (GPT-2): their kernel is the weight itself; see :func:`decode_checkpoint`. Not needed for a ``torch.nn.Module``
      source, whose classes say it.
    max_bytes: the most bytes the checkpoint's tensors may take in dense form, each and all together, checked from
      their headers and shapes before any is read (see :func:`decode_checkpoint`); ``None``:
      ``$JAXSPARSE_CHECKPOINT_MAX_BYTES`` (bytes, or ``none``), else this machine's physical memory. The variables
      built come on top, about once more.
    strict: with ``target``, raise on torch parameters the target has no variable for and target ``"params"`` (and
      other collections the checkpoint fills) the checkpoint lacks; ``False`` leaves them out of the variables and
      lists them in the report (``unexpected``: torch names, ``missing``: target names such as
      ``"params.fc.bias"``). Without ``target`` every torch parameter becomes a variable.
    report: also return the :class:`LoadReport`.

  Returns:
    ``{"params": ..., "sparsity"?: ..., "batch_stats"?: ..., "masks"?: ...}`` nested by Flax path. ``"masks"`` is
    a tree like ``"params"`` with a bool mask of its weight's shape for each pruned embedding table and, with
    ``target`` (then no ``"sparsity"``), each pruned kernel (not a Linen collection: pop it and pass it as ``masks=``
    to :func:`jaxsparse.sparsify_linen`). With ``report=True``, ``(variables, LoadReport)``: the report's ``layers``
    have one :class:`LayerLoad` per torch module written, its ``layer`` one of ``"Dense"``, ``"DenseGeneral"`` (a
    target's kernel of ndim >= 3), ``"MaskedDense"``, ``"BlockSparseDense"``, ``"Conv"``, ``"Embed"``, ``"Norm"`` (a
    1-D ``weight``: ``scale``), ``"BatchNorm"`` or ``"Module"`` (other parameters, under their torch names); its
    ``torch_names`` name the modules for :func:`export_state_dict`.

  Raises:
    CheckpointError: (a ``ValueError``) what :func:`decode_checkpoint` raises, a tensor or all of them together over
      ``max_bytes`` included; with ``target``, a variable it cannot take the shape of, and with ``strict``, one it
      lacks (not tied) or lacks from the checkpoint; two torch parameters for one Flax variable.
    TypeError: ``embeddings`` is not a ``str`` or ``None``, ``target`` is not a mapping, ``max_bytes`` is not an int
      or ``None``, ``ignore`` is neither a ``str``, ``None`` nor an iterable of ``str``.
  """
  ignore = ignore_patterns(ignore)
  with limit_scope(max_bytes):
    variables, load_report = _linen_variables(
        source, name_map=name_map, ignore=ignore, nm=nm, rules=rules, sparse=sparse, embeddings=embeddings, key=key,
        progress=progress, target=target, conv1d=conv1d, strict=strict)
  return (variables, load_report) if report else variables


def _linen_variables(source: Any, *, name_map: NameMap, ignore: Sequence[str], nm: NMSpec, rules: Any, sparse: bool,
                     embeddings: str | None, key: str | None, progress: Callable[[int, int], None] | None,
                     target: Mapping | None, conv1d: str | None, strict: bool) -> tuple[dict[str, dict], LoadReport]:
  if embeddings is not None and not isinstance(embeddings, str):
    raise TypeError(f"embeddings must be a regex (str) of embedding module paths or None, got {embeddings!r}.")
  try:
    re.compile(DEFAULT_EMBEDDINGS if embeddings is None else embeddings)
  except re.error as e:
    raise ValueError(f"embeddings={embeddings!r} is not a valid regular expression ({e}).") from e
  shapes = None if target is None else _target_shapes(target)
  src = source if isinstance(source, TensorSource) else open_checkpoint(source, key=key)
  params = decode_checkpoint(src, nm=nm, progress=progress, conv1d=conv1d)
  tables = _embedding_tables(params, src.module_types, shapes, name_map=name_map, ignore=ignore, embeddings=embeddings)
  if rules is not None:  # the same tables: apply_rules tells them apart by a regex, here one naming exactly them
    exactly = "^(?:" + "|".join(re.escape(t) for t in sorted(tables)) + ")$" if tables else r"(?!)"
    params = apply_rules(params, rules, name_map=name_map, embeddings=exactly)
  out: dict[str, dict] = {"params": {}}
  groups = group_params(params, name_map, ignore)
  for flax_path in [p for p, g in groups.items() if shapes is not None and is_packed_attention(g)]:
    if _param(".".join(q for q in (flax_path, "query") if q), "kernel") in shapes:  # Linen attention's projections
      split_packed_attention(groups, flax_path)
  sources: dict[str, TorchParam] = {}  # "params.fc.kernel" -> the torch parameter it holds
  notes: list[tuple[str, str]] = []  # (torch parameter, note)
  rows: list[tuple[LayerLoad, dict]] = []
  for flax_path, group in groups.items():
    kinds = [_linen_param(out, flax_path, name, p, sparse=sparse, table=group["torch"] in tables,
                          masks=target is not None, sources=sources, notes=notes)
             for name, p in group["params"].items()]
    rows.append((_layer_load(flax_path, group, kinds, shapes), group))
  out = {k: v for k, v in out.items() if v}
  missing, unexpected, tied, gone = [], [], {}, set()
  if shapes is not None:
    out, missing, dropped = _fit_to_target(out, shapes, sources)
    gone = {p.name for p in dropped}
    # As load_nnx: a dense torch tensor the target has no variable for, the very tensor of a loaded one, is tied.
    loaded_keys = {p.keys[0] for p in sources.values()
                   if p.name not in gone and len(p.keys) == 1 and p.mask is None}
    for p in dropped:
      twin = loaded_twin(p, src.shared, loaded_keys)
      if twin is None:
        unexpected.append(p.name)
      else:
        tied[p.name] = twin
    if strict:
      _check_fit(unexpected, missing, sources, shapes)
    rows = [(row, g) for row, g in rows if any(p.name not in gone for p in g["params"].values())]
  load_report = LoadReport([row for row, _ in rows], missing=missing, unexpected=unexpected, tied=tied,
                           notes=[note for name, note in notes if name not in gone])
  return jax.tree.map(jnp.asarray, out), load_report


def _layer_load(flax_path: str, group: dict, kinds: list[str | None], shapes: Mapping | None) -> LayerLoad:
  """The report's row for a torch module: the Linen layer its variables are laid out for, its weight's format."""
  params = group["params"]
  kind = next((k for k in kinds if k is not None), "Module")
  if kind == "Norm" and "running_mean" in params:
    kind = "BatchNorm"
  if kind == "Dense" and shapes is not None and len(shapes.get(_param(flax_path, "kernel"), ())) > 2:
    kind = "DenseGeneral"
  w = params.get("weight", next(iter(params.values())))
  return LayerLoad(flax_path, group["torch"], kind, w.format, w.pattern)


def _check_fit(unexpected: list[str], missing: list[str], sources: Mapping[str, TorchParam],
               shapes: Mapping[str, tuple[int, ...]]) -> None:
  """Raises for torch parameters the target has no variable for, then for target variables the checkpoint lacks."""
  if unexpected:
    at = next(name for name, p in sources.items() if p.name == unexpected[0])
    at = f"params.{at.partition('.')[2]}" if at.startswith("masks.") else at
    more = f" (and {len(unexpected) - 1} more torch parameter(s): {unexpected[1:6]})" if len(unexpected) > 1 else ""
    raise CheckpointError(
        f"{at}: the checkpoint has this variable but the target does not (torch {unexpected[0]!r}){more}; rename its "
        "torch module (name_map=), skip it (ignore=) or pass strict=False to list it in the report. The target has: "
        f"{', '.join(shapes) or '(nothing)'}."
    )
  if missing:
    raise CheckpointError(f"target variable(s) not in the checkpoint: {', '.join(missing)}; map a torch module to "
                          "them (name_map=), leave them out of the target or pass strict=False to list them in the "
                          "report.")


def _embedding_tables(params: Mapping[str, TorchParam], module_types: Mapping[str, type], shapes: Mapping | None, *,
                      name_map: NameMap, ignore: Sequence[str], embeddings: str | None) -> set[str]:
  """The torch module paths whose 2-D ``weight`` is an embedding table (the others are Linear weights).

  In this order: the torch module's class (a ``torch.nn.Module`` source), the target's leaf (``embedding`` or
  ``kernel``), a ``bias`` (an embedding has none), the ``embeddings`` regex. A bias-free weight none of these calls
  a table is a Linear's; a warning lists those converted (not ignored, no target), unless ``embeddings`` was given
  (then it names every table).
  """
  torch = import_torch()
  by_module: dict[str, dict[str, TorchParam]] = {}
  for p in params.values():
    by_module.setdefault(p.module, {})[p.param] = p
  tables, guessed = set(), []
  for mod, ps in by_module.items():
    w = ps.get("weight")
    if w is None or w.value is None or w.value.ndim != 2:
      continue
    kind = module_types.get(mod)
    fp = map_name(name_map, mod)
    if kind is not None and issubclass(kind, torch.nn.Embedding | torch.nn.EmbeddingBag):
      tables.add(mod)
    elif kind is not None and issubclass(kind, torch.nn.Linear):
      continue
    elif shapes is not None and fp is not None and _param(fp, "embedding") in shapes:
      tables.add(mod)
    elif shapes is not None and fp is not None and _param(fp, "kernel") in shapes:
      continue
    elif "bias" in ps:
      continue
    elif re.search(DEFAULT_EMBEDDINGS if embeddings is None else embeddings, mod):
      tables.add(mod)
    elif embeddings is None and shapes is None and fp is not None and not ignored(w.name, ignore):
      guessed.append(w.name)
  if guessed:
    listing = ", ".join(guessed[:5]) + (f" and {len(guessed) - 5} more" if len(guessed) > 5 else "")
    warn_at_caller(
        f"to_linen_variables read {len(guessed)} bias-free 2-D weight(s) as torch Linear weights (kernel = "
        f"weight.T): {listing}. A state dict does not tell a bias-free Linear from an nn.Embedding, and their module "
        f"paths do not match the embedding names {DEFAULT_EMBEDDINGS}. If one is an embedding table, pass "
        "embeddings= a regex of the embedding module paths (CLI: --embeddings; given, it names every table and this "
        "warning goes), target= (the Linen model's variables) or the torch module itself.",
        UserWarning,
    )
  return tables


def _param(flax_path: str, leaf: str) -> str:
  """The dotted name of a ``"params"`` variable, as :func:`path_str` gives a target's (``"params.fc.kernel"``)."""
  return ".".join(p for p in ("params", flax_path, leaf) if p)


def _target_shapes(target: Mapping) -> dict[str, tuple[int, ...]]:
  """``{"params.fc.kernel": shape}`` of a target's variables."""
  if not isinstance(target, Mapping):
    raise TypeError(f"target must be Linen variables ({{'params': ...}}, e.g. jax.eval_shape(model.init, key, x)), "
                    f"got {type(target).__name__}.")
  pairs = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(target))[0]
  return {path_str(kp): tuple(int(d) for d in np.shape(leaf)) for kp, leaf in pairs}


def _fit_to_target(out: dict[str, dict], shapes: Mapping[str, tuple[int, ...]], sources: Mapping[str, TorchParam]
                   ) -> tuple[dict[str, dict], list[str], list[TorchParam]]:
  """``out`` with each variable in the target's shape (``shapes``; a mask in its weight's), the target's variables it
  lacks, and the torch parameters (``sources``: by variable) of the variables the target lacks, left out; raises
  where a shape does not fit."""
  flat = {f"{coll}.{path_str(kp)}": v for coll, tree in out.items()
          for kp, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
  dropped = {}
  for name, p in sources.items():  # in the checkpoint's order
    coll, _, path = name.partition(".")
    if (f"params.{path}" if coll == "masks" else name) not in shapes:
      dropped.setdefault(p.name, p)
  fitted: dict[str, dict] = {}
  for name, value in flat.items():
    if sources[name].name in dropped:  # with its mask, its kernel: all of a torch parameter or none of it
      continue
    coll, _, path = name.partition(".")
    at = f"params.{path}" if coll == "masks" else name
    parent, _, leaf = path.rpartition(".")
    _nest(fitted.setdefault(coll, {}), parent, leaf, _fit(value, shapes[at], name))
  kept = {name for name in flat if sources[name].name not in dropped}
  missing = [k for k in shapes if k.partition(".")[0] in ("params", *out) and k not in kept]
  return fitted, missing, list(dropped.values())


def _fit(value: np.ndarray, shape: tuple[int, ...], name: str) -> np.ndarray:
  """``value`` in ``shape``: a 1-D leaf of the same size, a 2-D kernel ``(in, out)`` whose view ``shape`` has."""
  value = np.asarray(value)
  if value.shape == shape:
    return value
  if value.ndim == 1 and value.size == math.prod(shape):
    return value.reshape(shape)
  if value.ndim == 2 and any(matrix_shape(shape, n) == value.shape for n in range(1, len(shape))):
    return value.reshape(shape)
  raise CheckpointError(
      f"{name}: the checkpoint gives shape {value.shape}, the target {shape}; a 1-D variable takes any shape of its "
      "size, a 2-D kernel (in, out) one whose leading axes hold in and the rest out (nn.DenseGeneral), any other "
      "the same shape."
  )


def _linen_param(out: dict, flax_path: str, name: str, p: TorchParam, *, sparse: bool, table: bool, masks: bool,
                 sources: dict[str, TorchParam], notes: list[tuple[str, str]]) -> str | None:
  """Writes the variables of ``p`` into ``out`` (each one's torch parameter into ``sources``, a mask applied but not
  kept into ``notes``); returns the Linen layer a weight's variables are laid out for (``None`` for other names)."""

  def put(coll: str, leaf: str, value: Any) -> None:
    _nest(out.setdefault(coll, {}), flax_path, leaf, value)
    sources[".".join(q for q in (coll, flax_path, leaf) if q)] = p

  def dense(leaf: str) -> None:  # as load_nnx notes it: a mask applied to a variable no Linen layer keeps one for
    put("params", leaf, value)
    if p.mask is not None:
      notes.append((p.name, mask_not_kept_note(p, _join(flax_path, leaf))))

  value = p.masked_value
  if name in ("weight", "bias", "running_mean", "running_var"):  # floats; other names may be integer buffers
    value = float_value(p, into=f"Flax module {flax_path!r}")
  if name == "weight" and value.ndim == 2 and table:
    put("params", "embedding", value)
    if sparse and p.pattern.kind != "dense":  # no Linen embedding holds a mask: sparsify_linen(masks=...) takes it
      put("masks", "embedding", np.asarray(p.mask, bool))
    return "Embed"
  if name == "weight" and value.ndim >= 2:
    kernel = flax_layout(value)
    pattern = p.pattern
    if not sparse or pattern.kind == "dense" or masks:
      put("params", "kernel", kernel)
      if sparse and pattern.kind != "dense":  # for a target's dense layers, as sparsify_linen(masks=...) takes it
        put("masks", "kernel", flax_layout(p.mask))
      return "Dense" if value.ndim == 2 else "Conv"
    if value.ndim != 2:  # a pruned conv: its mask in Flax layout (*kernel, in, out), as sparsify_linen's convs
      put("params", "kernel", kernel)
      put("sparsity", "mask", flax_layout(p.mask))
      return "Conv"
    if pattern.kind == "block":
      bs = (pattern.block_shape[1], pattern.block_shape[0])
      mat = BlockSparseMatrix.from_dense(kernel, bs, block_mask=flax_layout(p.mask)[:: bs[0], :: bs[1]])
      put("params", "kernel", np.asarray(mat.data))
      for f, v in mat.index_arrays().items():
        put("sparsity", f, np.asarray(v))
      return "BlockSparseDense"
    put("params", "kernel", kernel)
    put("sparsity", "mask", flax_layout(p.mask))
    return "MaskedDense"
  if name == "weight" and value.ndim == 1:
    dense("scale")
    return "Norm"
  if name in ("running_mean", "running_var"):
    put("batch_stats", name.removeprefix("running_"), value)
  elif name != "num_batches_tracked":
    dense(name)
  return None


def _join(mod: str, name: str) -> str:
  return f"{mod}.{name}" if mod else name


def _nest(tree: dict, path: str, leaf_name: str, value: Any) -> None:
  node = tree
  for part in [p for p in path.split(".") if p]:
    node = node.setdefault(part, {})
    if not isinstance(node, dict):
      raise CheckpointError(f"Flax path {path!r} collides with a parameter of the same name.")
  if leaf_name in node:
    raise CheckpointError(f"two torch parameters map to the Flax variable {path}.{leaf_name}.")
  node[leaf_name] = value
