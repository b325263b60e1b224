"""Sending jaxsparse models back to PyTorch: masks, masked state dicts, BSR and 2:4 weights.

Every exporter reads a Flax NNX model (:mod:`._entries`) or Linen variables (``{"params": ..., "sparsity": ...}``,
:mod:`._linen_entries`) and writes torch names and layouts: Flax module path -> torch module path through
``torch_names`` (the ``LoadReport.torch_names`` of :func:`load_nnx`, a dict, a callable, or ``None`` for the same
names), ``kernel (in, out)`` -> ``weight (out, in)``, Conv ``(*k, I, O)`` -> ``(O, I, *k)``, an ``nn.DenseGeneral`` /
``nnx.LinearGeneral`` kernel ``(*in_dims, *features)`` -> the torch Linear's ``weight (prod(features),
prod(in_dims))`` and its bias flattened. Each weight is the one the Flax layer computes with: a conv's own Flax weight
``mask`` is multiplied in, as a torch conv has none; what cannot be written so (a stack of layers, variables of a
layout the exporter cannot read) is refused, naming the layer. ``torch.nn.MultiheadAttention``'s projections are
written packed, as torch holds them (:func:`~._attention.pack_attention`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import numpy as np
from flax import nnx

from jaxsparse.torch_interop._attention import attention_layouts
from jaxsparse.torch_interop._attention import pack_attention
from jaxsparse.torch_interop._conv1d import check_conv1d
from jaxsparse.torch_interop._entries import Entry
from jaxsparse.torch_interop._entries import nnx_entries
from jaxsparse.torch_interop._linen_entries import linen_entries
from jaxsparse.torch_interop._load import CheckpointError
from jaxsparse.torch_interop._load import import_torch
from jaxsparse.torch_interop._load import to_torch
from jaxsparse.torch_interop._patterns import detect_pattern

__all__ = ["EXPORT_FORMATS", "TorchNames", "apply_masks", "export_masks", "export_state_dict"]

TorchNames = Mapping[str, str] | Callable[[str], str] | None
EXPORT_FORMATS = ("dense", "prune", "ao", "bsr", "semi_structured")


def _entries(model: Any, module: Any, inputs: tuple, caller: str) -> list[Entry]:
  if isinstance(model, nnx.Module):
    if module is not None or inputs:
      raise TypeError(f"{caller}: module= and example inputs are for Linen variables (the Linen module of the "
                      "variables and the inputs of its apply), not an NNX model.")
    return nnx_entries(model)
  if isinstance(model, Mapping):
    return linen_entries(model, module, inputs, caller)
  raise TypeError(f"model must be a flax.nnx.Module or Linen variables (a dict), got {type(model).__name__}.")


def _torch_module(torch_names: TorchNames, flax_path: str) -> str:
  if torch_names is None:
    return flax_path
  if callable(torch_names):
    return torch_names(flax_path)
  if flax_path not in torch_names:
    raise CheckpointError(
        f"torch_names has no entry for the Flax module {flax_path!r}; give every exported module a torch name "
        f"(known: {sorted(torch_names)[:8]}...)."
    )
  return torch_names[flax_path]


def _check_torch_dtype(dtype: Any, *, floating: bool) -> None:
  """``dtype`` is ``None`` or a ``torch.dtype`` (a floating one with ``floating``), else a ``TypeError`` naming it: a
  string or NumPy dtype failed inside torch's ``Tensor.to`` with messages about device strings, and an integer or
  bool dtype turned every float weight into zeros / ``True``."""
  torch = import_torch()
  if dtype is None:
    return
  if not isinstance(dtype, torch.dtype) or (floating and not dtype.is_floating_point):
    allowed = "a floating torch.dtype (e.g. torch.float16)" if floating else "a torch.dtype (e.g. torch.float32)"
    raise TypeError(f"dtype must be None or {allowed}, got dtype={dtype!r}.")


def _mask_tensor(mask: np.ndarray):
  """A bool torch tensor with its own, writable memory: ``mask`` may be a view of a JAX array's (read-only) buffer,
  which ``torch.from_numpy`` would share, so writing to the exported mask would change the model's."""
  return import_torch().from_numpy(np.array(mask, dtype=bool, order="C", copy=True))


def _fqn(mod: str, name: str) -> str:
  return f"{mod}.{name}" if mod else name


def _as_conv1d(e: Entry, mod: str, conv1d: str | None) -> Entry:
  """``e`` in the ``(in, out)`` layout of transformers' ``Conv1D`` if ``conv1d`` matches its torch module path."""
  if conv1d is None or e.name != "weight" or e.value.ndim != 2 or not re.search(conv1d, mod):
    return e
  return dataclasses.replace(e, value=e.value.T, mask=None if e.mask is None else e.mask.T,
                             block_shape=None if e.block_shape is None else e.block_shape[::-1])


def _torch_entries(model: Any, module: Any, inputs: tuple, caller: str, *, torch_names: TorchNames,
                   conv1d: str | None, target: Any, check=None, skip_unnamed=None) -> list[tuple[str, Entry]]:
  """``(torch module path, Entry)`` for each torch parameter to write, ``nn.MultiheadAttention``'s packed; ``check``
  sees each entry (and its torch name) before packing. An entry for which ``skip_unnamed(entry)`` holds is left out
  where a ``torch_names`` dict has no name for its module (e.g. a layer without a mask, for :func:`export_masks`)."""
  layouts = attention_layouts(target)
  items = []
  for e in _entries(model, module, inputs, caller):
    if isinstance(torch_names, Mapping) and e.flax_path not in torch_names and skip_unnamed and skip_unnamed(e):
      continue
    mod = _torch_module(torch_names, e.flax_path)
    if check is not None:
      check(e, _fqn(mod, e.name))
    items.append((mod, _as_conv1d(e, mod, conv1d)))
  return pack_attention(items, layouts)


def export_masks(
    model: Any,
    /,
    *example_inputs: Any,
    torch_names: TorchNames = None,
    dtype: Any = None,
    module: Any = None,
    conv1d: str | None = None,
    target: Any = None,
) -> dict[str, Any]:
  """The masks of a jaxsparse model as ``{"{torch module}.weight_mask": tensor}`` in torch layout.

  Covers ``MaskedLinear``, ``BlockSparseLinear`` (its blocks expanded; a ``TensorParallelBlockSparseLinear`` as the
  ``BlockSparseLinear`` its ``to_block_sparse_linear()`` gives), ``NMLinear``/``NMConv`` (the current N:M mask),
  ``CompressedNMLinear`` / ``CompressedNMEmbed`` and the Linen ``MaskedDense``/``BlockSparseDense`` variables (and
  those of a ``BlockSparseLinear`` under ``nnx.bridge.ToLinen``, its index arrays under ``"pattern"``); with
  ``module=``, the Linen ``NMDense`` / ``NMConv`` / ``CompressedNMDense`` / ``CompressedNMEmbed`` too. A stack of
  layers (``nnx.vmap`` / ``nn.scan``: leading layer axes) has no torch form: it is refused, naming the layer.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxsparse import torch_interop
  >>> from jaxsparse.layers import MaskedLinear
  >>> layer = MaskedLinear(8, 4, mask=jnp.eye(8, 4, dtype=bool), rngs=nnx.Rngs(0))
  >>> {k: tuple(v.shape) for k, v in torch_interop.export_masks(layer, torch_names={"": "fc"}).items()}
  {'fc.weight_mask': (4, 8)}

  Args:
    model: a Flax NNX model or Linen variables.
    torch_names: Flax module path -> torch module path: ``LoadReport.torch_names``, a dict, a callable,
      or ``None`` (same dotted names). A dict needs a name for each module with a mask only.
    dtype: torch dtype of the masks; ``None`` gives bool (``torch.nn.utils.prune`` stores masks in the
      weight's dtype: pass ``torch.float32`` to match its ``weight_mask`` bit for bit).
    *example_inputs: with Linen variables and a ``module`` other than a ``SparsifiedLinen``: the inputs of
      ``module.apply`` (arrays or ``jax.ShapeDtypeStruct``; only traced, as :func:`jaxsparse.summary` takes them).
    module: for Linen variables, their Linen module (with ``example_inputs``), or the ``SparsifiedLinen`` that
      :func:`jaxsparse.sparsify_linen` / :func:`jaxsparse.compress_linen` returned (its plan; no inputs). Linen
      ``NMDense`` / ``NMConv`` layers keep no mask variable (the mask follows the kernel) and the packed positions
      of a ``CompressedNMDense`` / ``CompressedNMEmbed`` do not say their ``n:m``: only the module does. It also tells
      ``nn.DenseGeneral`` layers from convs (in the variables of :func:`jaxsparse.densify_linen` too, whose kernels
      have their ``(*in_dims, *features)`` shapes) and a stack of layers from a conv. Without it, kernels that have
      no ``"sparsity"`` pattern (or ndim >= 3) are read by their shapes and a ``UserWarning`` lists them; a
      compressed N:M layer raises.
    conv1d: regex of the torch module paths that are transformers ``Conv1D`` modules, whose masks are written
      ``(in, out)``.
    target: the torch model the masks are for (see :func:`export_state_dict`): an ``nn.MultiheadAttention``'s
      query / key / value masks come as one ``in_proj_weight_mask`` (rows of an unmasked projection all kept).

  Returns:
    ``{name: torch.Tensor}``, ready for :func:`apply_masks`.

  Raises:
    ValueError: as :func:`export_state_dict`.
    TypeError: as :func:`export_state_dict`.
    CheckpointError: as :func:`export_state_dict`.
  """
  import_torch()
  _check_torch_dtype(dtype, floating=False)
  check_conv1d(conv1d)
  out = {}
  for mod, e in _torch_entries(model, module, example_inputs, "export_masks", torch_names=torch_names, conv1d=conv1d,
                               target=target, skip_unnamed=lambda e: e.mask is None):
    if e.mask is None:
      continue
    t = _mask_tensor(e.mask)
    out[_fqn(mod, e.name) + "_mask"] = t if dtype is None else t.to(dtype)
  return out


def apply_masks(torch_module: Any, masks: Mapping[str, Any], *, strict: bool = True) -> Any:
  """Prunes a torch module with ``masks`` through ``torch.nn.utils.prune.custom_from_mask``.

  Each ``"{module}.{param}_mask"`` entry prunes ``param`` of ``torch_module.get_submodule(module)``,
  which then holds ``{param}_orig`` and ``{param}_mask`` like any ``torch.nn.utils.prune`` model (an
  already pruned parameter gets the product of both masks, as in torch). Every mask is checked first,
  so a bad entry leaves the module unchanged.

  >>> import torch
  >>> from jaxsparse import torch_interop
  >>> fc = torch_interop.apply_masks(torch.nn.Linear(8, 4), {"weight_mask": torch.eye(4, 8, dtype=torch.bool)})
  >>> int((fc.weight != 0).sum())
  4

  Args:
    torch_module: the ``torch.nn.Module`` to prune (in place).
    masks: ``{"{module}.{param}_mask": tensor}`` with 0/1 or bool values in the parameter's shape, e.g.
      from :func:`export_masks`.
    strict: raise on keys that do not end in ``_mask``.

  Returns:
    ``torch_module``.

  Raises:
    TypeError: ``torch_module`` is not a ``torch.nn.Module``.
    CheckpointError: (a ``ValueError``; raised before anything is pruned) with ``strict``, a key that does not
      end in ``_mask``; a key naming a module or parameter ``torch_module`` lacks; a mask that is not a tensor
      or array, has another shape than its parameter, or holds values other than 0 and 1.
    ImportError: PyTorch is not installed.
  """
  torch = import_torch()
  import torch.nn.utils.prune as prune  # noqa: PLC0415 -- optional dependency

  if not isinstance(torch_module, torch.nn.Module):
    raise TypeError(f"torch_module must be a torch.nn.Module, got {type(torch_module).__name__}.")
  todo = []
  for key, mask in masks.items():
    if not key.endswith("_mask"):
      if strict:
        raise CheckpointError(f"mask key {key!r} must end in '_mask' ('{{module}}.{{param}}_mask').")
      continue
    fqn = key[: -len("_mask")]
    mod_path, _, pname = fqn.rpartition(".")
    try:
      sub = torch_module.get_submodule(mod_path)
    except AttributeError as e:
      raise CheckpointError(f"mask {key!r}: the torch model has no module {mod_path!r}.") from e
    current = getattr(sub, pname, None)
    if not isinstance(current, torch.Tensor):
      raise CheckpointError(f"mask {key!r}: module {mod_path!r} ({type(sub).__name__}) has no parameter {pname!r}.")
    m = to_torch(mask, key=key)
    if tuple(m.shape) != tuple(current.shape):
      raise CheckpointError(f"mask {key!r} has shape {tuple(m.shape)} but {fqn!r} has shape {tuple(current.shape)}.")
    if m.dtype != torch.bool and not bool(((m == 0) | (m == 1)).all()):
      raise CheckpointError(f"mask {key!r} must hold only 0 and 1.")
    todo.append((sub, pname, m.to(device=current.device)))
  for sub, pname, m in todo:
    prune.custom_from_mask(sub, pname, m)
  return torch_module


def _check_nm_24(e: Entry, fqn: str) -> None:
  pattern = detect_pattern(e.mask)
  if e.value.ndim != 2 or pattern.kind != "nm" or (pattern.n, pattern.m) not in ((2, 4), (1, 2)):
    raise CheckpointError(
        f"{fqn}: format='semi_structured' needs 2-D 2:4 weights (2 kept of every 4 input features), but this "
        f"layer's mask is {pattern} with shape {e.value.shape}."
    )


def export_state_dict(
    model: Any,
    /,
    *example_inputs: Any,
    format: str = "dense",
    torch_names: TorchNames = None,
    dtype: Any = None,
    module: Any = None,
    conv1d: str | None = None,
    tied: Mapping[str, str] | None = None,
    target: Any = None,
) -> dict[str, Any]:
  """A torch state dict of a whole jaxsparse model, its sparse layers written in ``format``.

  Formats for the sparse weights (everything else is written densely):

  * ``"dense"``: ``weight`` with zeros where pruned (a plain ``model.load_state_dict`` input);
  * ``"prune"``: ``weight_orig`` + ``weight_mask`` (mask in the weight's dtype), what a model pruned with
    ``torch.nn.utils.prune`` holds;
  * ``"ao"``: ``parametrizations.weight.original`` + ``parametrizations.weight.0.mask`` (bool), the
    layout of a model prepared by a ``torch.ao.pruning`` sparsifier;
  * ``"bsr"``: block-sparse weights as ``torch.sparse_bsr`` tensors with the layer's blocks (transposed to
    torch layout), other masked weights dense. Load them with ``net.load_state_dict(state, assign=True)``: the BSR
    tensor becomes the parameter (a torch Linear computes with it). Without ``assign=True`` torch copies into the
    dense parameter there, which it cannot do from a BSR tensor (``copy_sparse_compressed_ expected sparse
    compressed tensor layout but got Strided``);
  * ``"semi_structured"``: like ``"dense"``, but every sparse weight must be 2:4 along the input features,
    the pattern ``torch.sparse.to_sparse_semi_structured(w.half().cuda())`` needs (checked here; its
    shape and dtype limits, e.g. dimensions that are multiples of 64, are left to torch).

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxsparse import torch_interop
  >>> from jaxsparse.layers import MaskedLinear
  >>> layer = MaskedLinear(8, 4, mask=jnp.eye(8, 4, dtype=bool), rngs=nnx.Rngs(0))
  >>> sorted(torch_interop.export_state_dict(layer, format="prune"))
  ['bias', 'weight_mask', 'weight_orig']

  A tied torch model (``head.weight`` is ``embed.weight``) lists its tied parameter under each name, and
  ``load_state_dict(strict=True)`` wants both; the Flax twin holds it once (``embed.attend`` computes the logits).
  ``tied={"head.weight": "embed.weight"}`` writes the tensor of ``"embed.weight"`` under ``"head.weight"`` too (the
  very same tensor: torch loads it into the shared parameter; ``LoadReport.tied`` has this form):

  >>> import torch
  >>> class TiedLM(torch.nn.Module):
  ...   def __init__(self):
  ...     super().__init__()
  ...     self.embed, self.head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
  ...     self.head.weight = self.embed.weight
  >>> state = torch_interop.export_state_dict(nnx.Embed(10, 4, rngs=nnx.Rngs(0)), torch_names={"": "embed"},
  ...                                         tied={"head.weight": "embed.weight"})
  >>> TiedLM().load_state_dict(state, strict=True)
  <All keys matched successfully>

  A ``torch.nn.MultiheadAttention`` holds query, key and value in one ``in_proj_weight`` (their rows) and
  ``in_proj_bias``: the projections :func:`load_nnx` split from them (torch names ``"in_proj[0:32]"`` in its report)
  are packed back, masks alike (``in_proj_weight_mask`` with ``format="prune"``; the rows of an unmasked projection
  all kept). ``target=`` the torch model names them too where the Flax names or the report's do not say it: Flax's own
  ``query`` / ``key`` / ``value`` / ``out`` under an attention module of the target, and ``q_proj_weight`` /
  ``k_proj_weight`` / ``v_proj_weight`` of an attention with ``kdim`` / ``vdim`` (the report's ``"q_proj"``, also the
  name of a plain Linear):

  >>> mha = torch.nn.MultiheadAttention(32, 4)
  >>> attn = nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0))
  >>> report = torch_interop.load_nnx(attn, mha)
  >>> state = torch_interop.export_state_dict(attn, torch_names=report.torch_names)
  >>> sorted(state)
  ['in_proj_bias', 'in_proj_weight', 'out_proj.bias', 'out_proj.weight']
  >>> mha.load_state_dict(state, strict=True)
  <All keys matched successfully>
  >>> sorted(torch_interop.export_state_dict(attn, target=mha)) == sorted(state)  # Flax names, a torch target
  True

  Linen variables of jaxsparse's Linen layers come with their module and example inputs, which say what each layer
  computes (an ``NMDense``'s N:M mask follows its kernel: the variables alone hold a dense kernel):

  >>> import jax, flax.linen as nn
  >>> from jaxsparse.layers import linen
  >>> model = nn.Sequential([linen.NMDense(16, n=2, m=4), nn.relu, linen.MaskedDense(4, sparsity=0.5)])
  >>> x = jnp.ones((1, 8))
  >>> variables = model.init(jax.random.key(0), x)
  >>> state = torch_interop.export_state_dict(variables, x, module=model, format="prune")
  >>> state["layers_0.weight_mask"].shape, float(state["layers_0.weight_mask"].mean())
  (torch.Size([16, 8]), 0.5)

  Args:
    model: a Flax NNX model or Linen variables.
    *example_inputs: with Linen variables and their Linen ``module``: the inputs of ``module.apply`` (see
      :func:`export_masks`).
    format: one of ``"dense"``, ``"prune"``, ``"ao"``, ``"bsr"``, ``"semi_structured"``.
    torch_names: Flax module path -> torch module path (see :func:`export_masks`).
    dtype: torch dtype for floating-point tensors (e.g. ``torch.float16``); ``None`` keeps them.
    module: for Linen variables, their Linen module (with ``example_inputs``) or the ``SparsifiedLinen`` of
      :func:`jaxsparse.sparsify_linen` (see :func:`export_masks`).
    conv1d: regex of the torch module paths that are transformers ``Conv1D`` modules, whose weights (and masks,
      BSR blocks) are written ``(in, out)`` (see :func:`export_masks`); ``format="semi_structured"`` checks their
      2:4 pattern along the input features, as the Linear layout has it.
    tied: ``{torch key: torch key this export writes}``: each first key gets the tensor of the second (tied weights,
      as a tied ``lm_head.weight`` is ``model.embed_tokens.weight``); the same tensor object under both names, which
      ``torch.save`` and ``load_state_dict`` take (``safetensors.torch.save_file`` refuses tensors that share memory:
      leave ``tied`` out for it, or use ``safetensors.torch.save_model``).
    target: the torch model the state dict is for: a ``torch.nn.Module``, its state dict or its keys (only names are
      read; pruned or parametrized names count as the parameter's). Where it has an ``nn.MultiheadAttention`` at
      ``attn``, the torch names ``attn.query`` / ``attn.key`` / ``attn.value`` (Flax's, with ``torch_names=None``)
      and ``attn.q_proj`` / ``attn.k_proj`` / ``attn.v_proj`` are its projections and ``attn.out`` its ``out_proj``,
      written in its layout: ``in_proj_weight``, or ``q_proj_weight`` / ``k_proj_weight`` / ``v_proj_weight`` with
      ``kdim`` / ``vdim``; the biases always in ``in_proj_bias``. ``None``: only the report's ``"attn.in_proj[i:j]"``
      names are packed.

  Returns:
    ``{name: torch.Tensor}``.

  Warns:
    UserWarning: Linen kernels read by their shapes alone (without ``module``, or not called by its ``apply`` on the
      example inputs), listing them: an ``NMDense`` / ``NMConv`` among them would be written unpruned.

  Raises:
    ValueError: an unknown ``format``; a stack of layers (an ``nnx.vmap`` stack, an ``nn.scan`` / ``nn.vmap`` Linen
      layer with ``module``: leading layer axes), naming the layer: export one layer at a time; Linen variables
      holding a ``"masks"`` entry (from ``to_linen_variables(..., target=...)``); a Linen kernel of ndim >= 3 whose
      bias (ndim >= 2) is not its trailing axes, neither an ``nn.DenseGeneral`` nor a conv (naming the path); a Linen
      ``"sparsity"`` mask not of its kernel's shape (naming the path); a Linen bias that is not ``(out,)`` of its
      kernel (its Linear's, conv's or block-sparse layer's), or a ``"sparsity"`` entry that is not the pattern of the
      layer beside it (a mask, the block index arrays, flat or under ``"pattern"``, or N:M positions): variables of a
      layout the exporter cannot read, refused (naming the path) rather than written wrong.
    TypeError: ``dtype`` not ``None`` or a floating ``torch.dtype`` (for :func:`export_masks`: any ``torch.dtype``);
      ``model`` is neither an NNX module nor Linen variables, or Linen variables without ``"params"``; ``module`` or
      example inputs given with an NNX model, ``module`` not a Linen module, example inputs without ``module``, a Linen
      module (other than a ``SparsifiedLinen``) without example inputs; Linen variables with a compressed N:M kernel or
      embedding (``CompressedNMDense``, ``CompressedNMEmbed``) and no ``module`` (or one whose ``apply`` on the example
      inputs does not call it); a Linen ``"sparsity"`` mask that is not boolean (naming the layer and the dtype; the
      layer's forward refuses it too); ``tied`` that is not a mapping of ``str`` to ``str``; ``target`` that is not a
      torch module, a state dict or an iterable of ``str`` keys.
    CheckpointError: (a ``ValueError``) ``format="semi_structured"`` with a sparse weight that is not 2-D and
      2:4 (or 1:2) along the input features; a ``torch_names`` dict without an entry for an exported module; a
      ``tied`` key the export writes itself, or one tied to a key it does not write (a sparse weight in ``"prune"``
      / ``"ao"`` is written as two tensors: tie its ``_orig`` / ``_mask`` keys one by one); an
      ``nn.MultiheadAttention`` packed tensor (``in_proj_weight`` / ``in_proj_bias``) some of whose query / key / value
      the export does not write or has twice, or whose projections take inputs of different sizes.
    ImportError: PyTorch is not installed.
  """
  torch = import_torch()
  if format not in EXPORT_FORMATS:
    raise ValueError(f"format must be one of {EXPORT_FORMATS}, got format={format!r}.")
  _check_torch_dtype(dtype, floating=True)
  check_conv1d(conv1d)
  tied = _check_tied(tied)

  def t(x: np.ndarray):
    out = to_torch(np.ascontiguousarray(x), key="export")
    return out.to(dtype) if dtype is not None and out.is_floating_point() else out

  def check(e: Entry, fqn: str) -> None:
    if format == "semi_structured" and e.mask is not None:
      _check_nm_24(e, fqn)

  out = {}
  for mod, e in _torch_entries(model, module, example_inputs, "export_state_dict", torch_names=torch_names,
                               conv1d=conv1d, target=target, check=check):
    fqn = _fqn(mod, e.name)
    if e.mask is None or format in ("dense", "semi_structured"):
      out[fqn] = t(e.value)
    elif format == "prune":
      value = t(e.value)
      out[fqn + "_orig"] = value
      out[fqn + "_mask"] = _mask_tensor(e.mask).to(value.dtype)
    elif format == "ao":
      out[_fqn(mod, f"parametrizations.{e.name}.original")] = t(e.value)
      out[_fqn(mod, f"parametrizations.{e.name}.0.mask")] = _mask_tensor(e.mask)
    elif e.block_shape is not None:  # bsr
      b0, b1 = e.block_shape
      rows, cols = e.value.shape
      block_mask = e.mask[::b0, ::b1]
      r, c = np.nonzero(block_mask)
      crow = np.concatenate([[0], np.cumsum(block_mask.sum(1))]).astype(np.int64)
      blocks = e.value.reshape(rows // b0, b0, cols // b1, b1).transpose(0, 2, 1, 3)[r, c]
      out[fqn] = torch.sparse_bsr_tensor(
          torch.from_numpy(crow), torch.from_numpy(c.astype(np.int64)), t(blocks), size=(rows, cols)
      )
    else:
      out[fqn] = t(e.value)
  for name, source in tied.items():
    if name in out:
      raise CheckpointError(f"tied={{{name!r}: {source!r}}}: the export writes {name!r} itself, from the Flax "
                            "model; a tied key is one the Flax model holds under another name only.")
    if source not in out:
      near = difflib.get_close_matches(source, list(out), n=3, cutoff=0.5)
      raise CheckpointError(
          f"tied={{{name!r}: {source!r}}}: the export writes no {source!r}" + (f" (close: {near})" if near else "")
          + "; tie to a key it writes (a sparse weight in format 'prune' or 'ao' is two tensors: tie each key)."
      )
    out[name] = out[source]
  return out


def _check_tied(tied: Any) -> dict[str, str]:
  if tied is None:
    return {}
  if not isinstance(tied, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
    raise TypeError(f"tied must be a mapping {{torch key to write: torch key the export writes}} of str, e.g. "
                    f"{{'lm_head.weight': 'model.embed_tokens.weight'}}, or None; got {tied!r}.")
  return dict(tied)
