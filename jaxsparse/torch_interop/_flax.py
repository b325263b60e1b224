"""Building jaxsparse layers and Flax variables from decoded PyTorch parameters.

Name mapping: torch *module* paths (``"encoder.layer.0.output.dense"``) become Flax module paths
(``"encoder.layer.0.output.dense"`` by default: NNX paths are attribute names and list indices joined
by dots). Inside a module, parameters map by layer type: Linear ``weight (out, in)`` -> ``kernel (in,
out)``, Conv ``weight (O, I, *k)`` -> ``kernel (*k, I, O)``, norms ``weight`` -> ``scale``, Embedding
``weight`` -> ``embedding``, BatchNorm ``running_mean``/``running_var`` -> ``mean``/``var``.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsparse import _rules
from jaxsparse import layers as jsl
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._specs import matrix_shape
from jaxsparse.layers._common import bias_of
from jaxsparse.layers._common import conv_options
from jaxsparse.layers._common import with_weights
from jaxsparse.torch_interop._attention import split_packed_attention
from jaxsparse.torch_interop._decode import NMSpec
from jaxsparse.torch_interop._decode import TorchParam
from jaxsparse.torch_interop._decode import decode_checkpoint
from jaxsparse.torch_interop._decode import float_value
from jaxsparse.torch_interop._limits import limit_scope
from jaxsparse.torch_interop._load import CheckpointError
from jaxsparse.torch_interop._load import TensorSource
from jaxsparse.torch_interop._load import open_checkpoint
from jaxsparse.torch_interop._names import LayerLoad
from jaxsparse.torch_interop._names import LoadReport
from jaxsparse.torch_interop._names import NameMap
from jaxsparse.torch_interop._names import group_params
from jaxsparse.torch_interop._names import ignore_patterns
from jaxsparse.torch_interop._names import map_name
from jaxsparse.torch_interop._patterns import Pattern
from jaxsparse.torch_interop._patterns import flax_layout
from jaxsparse.torch_interop._patterns import nm_mask_torch

__all__ = ["load_nnx"]

_NORMS = (nnx.LayerNorm, nnx.RMSNorm, nnx.GroupNorm)


def _owns_params(module: nnx.Module) -> bool:
  return any(isinstance(v, nnx.Variable) for v in vars(module).values())


def _check_shape(param: TorchParam, expected: tuple[int, ...], *, flax_name: str, how: str) -> None:
  if tuple(param.shape) != tuple(expected):
    raise CheckpointError(
        f"torch {param.name!r} has shape {param.shape}, but the Flax model's {flax_name!r} needs a torch shape of "
        f"{tuple(expected)} ({how})."
    )


def mask_not_kept_note(p: TorchParam, flax_name: str) -> str:
  """The report's note for a pruned torch ``p`` whose mask was applied to the dense Flax ``flax_name``."""
  return (f"torch {p.name!r} is pruned ({p.format}, density {p.pattern.density:.3f}): its mask was applied (zeros "
          f"where pruned) but not kept; the Flax {flax_name!r} is dense.")


class _Plan:
  """Assignments collected before anything changes, so a failure leaves the model untouched.

  With ``strict=False``, torch parameters of a mapped module that have no place in its Flax module are listed in
  ``unexpected`` (as those of unmapped modules are) instead of raising. ``notes`` are lines for the report.
  """

  def __init__(self, *, strict: bool = True):
    self.strict = strict
    self.assign: list[tuple[nnx.Variable, jnp.ndarray]] = []
    self.replace: list[tuple[tuple, nnx.Module]] = []
    self.unexpected: list[str] = []
    self.notes: list[str] = []

  def mask_not_kept(self, p: TorchParam, flax_name: str) -> None:
    """Notes that the mask of ``p`` (a pruned bias, say) was applied to a dense Flax variable: it is not kept."""
    if p.mask is not None:
      self.notes.append(mask_not_kept_note(p, flax_name))

  def merge(self, sub: _Plan) -> None:
    """Takes the unexpected names and the notes of a plan made for a stand-in module."""
    self.unexpected.extend(sub.unexpected)
    self.notes.extend(sub.notes)

  def no_place(self, group: dict, extra: list[str], message: str) -> None:
    """Raises ``message`` about the torch parameters ``extra`` of ``group``, or lists them when not strict."""
    if not extra:
      return
    if self.strict:
      raise CheckpointError(message + " Skip them with ignore=, or pass strict=False to list them as unexpected.")
    self.unexpected.extend(_join(group["torch"], e) for e in extra)


def _check_extra(group: dict, allowed: tuple[str, ...], plan: _Plan, *, flax_path: str, layer: str) -> None:
  extra = sorted(set(group["params"]) - set(allowed))
  plan.no_place(group, extra, f"torch {[_join(group['torch'], e) for e in extra]} have no place in the Flax {layer} "
                f"{flax_path!r}, which takes only {[_join(group['torch'], a) for a in allowed]}.")


def _linear_plan(
    module: nnx.Module, path: tuple, group: dict, plan: _Plan, *, sparse: bool, flax_path: str
) -> tuple[str, TorchParam]:
  params = group["params"]
  _check_extra(group, ("weight", "bias"), plan, flax_path=flax_path, layer="Linear")
  if "weight" not in params:
    raise CheckpointError(f"torch module {group['torch']!r} has no 'weight' for the Flax Linear {flax_path!r}.")
  w = params["weight"]
  in_f, out_f = module.in_features, module.out_features
  _check_shape(w, (out_f, in_f), flax_name=f"{flax_path}.kernel", how="Linear weight (out, in) -> kernel (in, out)")
  has_bias = getattr(module, "bias", None) is not None
  if has_bias and "bias" not in params:
    raise CheckpointError(f"the Flax layer {flax_path!r} has a bias but torch module {group['torch']!r} has none.")
  if "bias" in params and not has_bias:
    raise CheckpointError(f"torch {params['bias'].name!r} has a bias but the Flax layer {flax_path!r} has none.")
  if has_bias:
    _check_shape(params["bias"], (out_f,), flax_name=f"{flax_path}.bias", how="bias")
  bias = float_value(params["bias"], into=f"the Flax {_join(flax_path, 'bias')!r}") if has_bias else None
  if has_bias:
    plan.mask_not_kept(params["bias"], _join(flax_path, "bias"))
  dtype = getattr(module, "param_dtype", jnp.float32)
  kernel = jnp.asarray(flax_layout(float_value(w, into=f"the Flax {_join(flax_path, 'kernel')!r}")), dtype)
  pattern = w.pattern
  if sparse and pattern.kind != "dense":
    mask = flax_layout(w.mask)
    common = dict(use_bias=has_bias, dtype=module.dtype, param_dtype=dtype, precision=module.precision)
    own = _own_blocks(module, mask)
    if own is not None:  # a BlockSparseLinear keeps its block shape where the mask is made of its blocks
      w = _reported_as(w, Pattern("block", pattern.density, block_shape=own[::-1]))
    if own is not None or pattern.kind == "block":
      bk, bn = own if own is not None else (pattern.block_shape[1], pattern.block_shape[0])
      block_mask = mask[::bk, ::bn]
      impl = getattr(module, "implementation", None)
      new = jsl.BlockSparseLinear(
          in_f, out_f, block_shape=(bk, bn), block_mask=block_mask, kernel_init=nnx.initializers.zeros_init(),
          implementation=impl, rngs=nnx.Rngs(0), **common,
      )
      new.kernel[...] = BlockSparseMatrix.from_dense(kernel, (bk, bn), block_mask=block_mask).data
    elif (
        pattern.kind == "nm"
        and np.array_equal(nm_mask_torch(w.masked_value, pattern.n, pattern.m), w.mask)
    ):
      # NMLinear recomputes its mask from the kernel on every call: that gives back exactly this mask.
      new = jsl.NMLinear(in_f, out_f, n=pattern.n, m=pattern.m, kernel_init=lambda *_: kernel, rngs=nnx.Rngs(0),
                        **common)
    else:
      new = jsl.MaskedLinear(in_f, out_f, mask=jnp.asarray(mask), kernel_init=lambda *_: kernel, rngs=nnx.Rngs(0),
                             **common)
    if has_bias:
      new.bias[...] = jnp.asarray(bias, dtype)
    plan.replace.append((path, new))
    return type(new).__name__, w
  # Dense torch weights (or sparse=False): fill the layer that is there, keeping its own pattern.
  if isinstance(module, jsl.BlockSparseLinear):
    bm = np.asarray(module.block_mask)
    plan.assign.append((module.kernel, BlockSparseMatrix.from_dense(kernel, module.block_shape, block_mask=bm).data))
  elif isinstance(module, jsl.MaskedLinear):
    plan.assign.append((module.kernel, jnp.where(module.mask[...], kernel, jnp.zeros((), kernel.dtype))))
  else:
    plan.assign.append((module.kernel, kernel))
  if has_bias:
    plan.assign.append((module.bias, jnp.asarray(bias, module.bias[...].dtype)))
  return type(module).__name__, w


def _own_blocks(module: nnx.Module, mask: np.ndarray) -> tuple[int, int] | None:
  """The ``(bk, bn)`` block shape of ``module``, a ``BlockSparseLinear``, when the Flax-layout ``mask`` keeps whole
  blocks of it (at least one); else ``None`` (the mask's own pattern then picks the layer)."""
  if not isinstance(module, jsl.BlockSparseLinear) or not mask.any():
    return None
  (bk, bn), (k, n) = module.block_shape, mask.shape
  if k % bk or n % bn:
    return None
  blocks = mask.reshape(k // bk, bk, n // bn, bn)
  return (bk, bn) if bool(np.all(blocks == blocks[:, :1, :, :1])) else None


def _reported_as(w: TorchParam, pattern: Pattern) -> TorchParam:
  """``w`` with ``pattern`` as its :attr:`~TorchParam.pattern` (a mask of 24x24 blocks is also one of 8x8 blocks,
  the one ``detect_pattern`` reports): the structure of the layer it was loaded into, for the report."""
  out = dataclasses.replace(w)
  object.__setattr__(out, "pattern", pattern)  # the cached_property's value: TorchParam is frozen
  return out


def _general_plan(
    module: nnx.LinearGeneral, path: tuple, group: dict, plan: _Plan, *, sparse: bool, flax_path: str
) -> tuple[str, TorchParam]:
  """A torch Linear into an ``nnx.LinearGeneral``: its weight is the kernel's 2-D view (``matrix_shape``) transposed.

  The q/k/v projections of ``nnx.MultiHeadAttention`` (kernel ``(in, heads, head_dim)``) take a torch
  ``Linear(in, heads * head_dim)``, the out projection ``(heads, head_dim, out)`` a ``Linear(heads * head_dim,
  out)``; a sparse torch weight makes a :class:`~jaxsparse.layers.SparseLinearGeneral`.
  """
  reason = _rules.linear_general_unsupported(module)
  if reason:
    raise CheckpointError(f"{flax_path}: {reason}: it has no torch Linear counterpart.")
  k, n = matrix_shape(module.kernel.shape, len(module.in_features))
  lin = nnx.Linear(k, n, use_bias=module.bias is not None, dtype=module.dtype, param_dtype=module.param_dtype,
                   precision=module.precision, rngs=nnx.Rngs(0))
  sub = _Plan(strict=plan.strict)
  _, w = _linear_plan(lin, path, group, sub, sparse=sparse, flax_path=flax_path)
  plan.merge(sub)
  if sub.replace:
    ((_, new),) = sub.replace
    plan.replace.append((path, jsl.SparseLinearGeneral(new, in_features=module.in_features,
                                                       out_features=module.out_features, dtype=module.dtype,
                                                       precision=module.precision)))
    return "SparseLinearGeneral", w
  for var, value in sub.assign:
    target = module.kernel if var is lin.kernel else module.bias
    plan.assign.append((target, jnp.reshape(value, target.shape)))
  return type(module).__name__, w


def _conv_plan(module: nnx.Conv, path: tuple, group: dict, plan: _Plan, *, sparse: bool, flax_path: str):
  params = group["params"]
  _check_extra(group, ("weight", "bias"), plan, flax_path=flax_path, layer="Conv")
  if "weight" not in params:
    raise CheckpointError(f"torch module {group['torch']!r} has no 'weight' for the Flax Conv {flax_path!r}.")
  w = params["weight"]
  k = module.kernel[...]
  expected = (k.shape[-1], k.shape[-2], *k.shape[:-2])
  _check_shape(w, expected, flax_name=f"{flax_path}.kernel", how="Conv weight (O, I, *k) -> kernel (*k, I, O)")
  kernel = jnp.asarray(flax_layout(float_value(w, into=f"the Flax {_join(flax_path, 'kernel')!r}")), k.dtype)
  has_bias = module.bias is not None
  if has_bias != ("bias" in params):
    raise CheckpointError(f"bias mismatch between torch {group['torch']!r} and Flax {flax_path!r}.")
  if has_bias:  # before any branch: assigning a (1,) bias into an (O,) one would broadcast it
    _check_shape(params["bias"], (k.shape[-1],), flax_name=f"{flax_path}.bias", how="bias")
  bias = float_value(params["bias"], into=f"the Flax {_join(flax_path, 'bias')!r}") if has_bias else None
  if has_bias:
    plan.mask_not_kept(params["bias"], _join(flax_path, "bias"))
  pattern = w.pattern
  exact_nm = pattern.kind == "nm" and np.array_equal(nm_mask_torch(w.masked_value, pattern.n, pattern.m), w.mask)
  # An NMConv that would recompute exactly the torch mask from the kernel keeps its settings (SR-STE decay).
  same_nm = (isinstance(module, jsl.NMConv) and exact_nm and (module.n, module.m) == (pattern.n, pattern.m)
             and not module.transposable and module.mask is None)
  if sparse and pattern.kind != "dense" and not same_nm:
    # The torch mask replaces whatever mask the Conv that is there has (MaskedConv, NMConv, nnx.Conv(mask=)):
    # keeping it would apply both masks, and the layer would no longer compute what the torch one does.
    base = _unmasked_conv(module)
    if exact_nm:  # NMConv recomputes its mask from the kernel on every call: that gives back exactly this mask
      new = jsl.NMConv.from_dense(base, n=pattern.n, m=pattern.m)
    else:
      new = jsl.MaskedConv.from_dense(base, mask=jnp.asarray(flax_layout(w.mask)))
    new.kernel[...] = kernel
    if has_bias:
      new.bias[...] = jnp.asarray(bias, k.dtype)
    plan.replace.append((path, new))
    return type(new).__name__, w
  # Dense torch weights (or sparse=False, or the NMConv's own n:m): the kernel, masked, fills the Conv that is there.
  plan.assign.append((module.kernel, kernel))
  if has_bias:
    plan.assign.append((module.bias, jnp.asarray(bias, module.bias[...].dtype)))
  return type(module).__name__, w


def _unmasked_conv(module: nnx.Conv) -> nnx.Conv:
  """``module`` itself if it is a plain ``nnx.Conv`` without a weight mask, else an ``nnx.Conv`` with its options."""
  if type(module) is nnx.Conv and module.mask is None:
    return module
  return with_weights(nnx.Conv, module.kernel[...], bias_of(module), module.in_features, module.out_features,
                      module.kernel_size, **{**conv_options(module), "mask": None})


def _generic_plan(module: nnx.Module, group: dict, plan: _Plan, *, flax_path: str):
  """Norms, embeddings, BatchNorm and any module whose parameters share the torch names."""
  params = dict(group["params"])
  if isinstance(module, nnx.Embed):
    names = {"embedding": "weight"}
  elif isinstance(module, nnx.BatchNorm):
    names = {"scale": "weight", "bias": "bias", "mean": "running_mean", "var": "running_var"}
    params.pop("num_batches_tracked", None)
  elif isinstance(module, _NORMS):
    names = {"scale": "weight", "bias": "bias"}
  else:
    names = {k: k for k, v in vars(module).items() if isinstance(v, nnx.Variable)}
  used = set()
  first = None
  for flax_name, torch_name in names.items():
    var = getattr(module, flax_name, None)
    if not isinstance(var, nnx.Variable):
      continue
    if torch_name not in params:
      raise CheckpointError(
          f"the Flax model's {flax_path}.{flax_name} has no torch counterpart: expected "
          f"{_join(group['torch'], torch_name)!r} (torch module {group['torch']!r} has {sorted(params)})."
      )
    p = params[torch_name]
    _check_shape(p, var[...].shape, flax_name=f"{flax_path}.{flax_name}", how="same shape")
    dtype = var[...].dtype
    value = p.masked_value
    if jnp.issubdtype(dtype, jnp.floating):  # a non-float variable (a custom module's int counter) takes any number
      value = float_value(p, into=f"the Flax {_join(flax_path, flax_name)!r}")
    plan.assign.append((var, jnp.asarray(value, dtype)))
    if not isinstance(module, nnx.Embed):  # a table's other masks fill it, zeros where pruned (load_nnx says so)
      plan.mask_not_kept(p, _join(flax_path, flax_name))
    used.add(torch_name)
    first = first or p
  extra = sorted(set(params) - used)
  plan.no_place(group, extra, f"torch {[_join(group['torch'], e) for e in extra]} have no place in the Flax module "
                f"{flax_path!r} ({type(module).__name__} with {sorted(names)}).")
  return type(module).__name__, first


def _embed_plan(module: nnx.Embed, path: tuple, group: dict, plan: _Plan, *, sparse: bool, flax_path: str):
  """An ``nnx.Embed``: a torch weight keeping ``n`` of every ``m`` features of each row (an N:M mask along dim 1)
  becomes a :class:`~jaxsparse.layers.CompressedNMEmbed` with exactly that mask; any other weight fills the table."""
  w = group["params"].get("weight")
  if not (sparse and set(group["params"]) == {"weight"} and w.mask is not None and w.pattern.kind == "nm"):
    return _generic_plan(module, group, plan, flax_path=flax_path)
  table = module.embedding[...]
  _check_shape(w, table.shape, flax_name=f"{flax_path}.embedding", how="same shape")
  values = jnp.asarray(float_value(w, into=f"the Flax {_join(flax_path, 'embedding')!r}"), table.dtype)
  dense = nnx.Embed(*table.shape, dtype=module.dtype, param_dtype=table.dtype, promote_dtype=module.promote_dtype,
                    embedding_init=lambda *_: values, rngs=nnx.Rngs(0))
  new = jsl.CompressedNMEmbed.from_dense(dense, w.pattern.n, w.pattern.m, mask=w.mask)
  plan.replace.append((path, new))
  return type(new).__name__, w


def _compressed_embed_plan(module: jsl.CompressedNMEmbed, path: tuple, group: dict, plan: _Plan, *, sparse: bool,
                           flax_path: str):
  """A :class:`~jaxsparse.layers.CompressedNMEmbed` takes its torch ``Embedding`` as an ``nnx.Embed`` of its
  decompressed table does (:func:`_embed_plan`): an N:M-masked weight replaces it by one with that mask; any other
  weight fills the values at its own kept positions (a sparse layer keeps its own pattern)."""
  sub = _Plan(strict=plan.strict)
  layer, w = _embed_plan(module.to_dense(), path, group, sub, sparse=sparse, flax_path=flax_path)
  plan.merge(sub)
  if sub.replace:
    ((_, new),) = sub.replace
    new.implementation = module.implementation
    plan.replace.append((path, new))
    return layer, w
  ((_, table),) = sub.assign
  plan.assign.append((module.embedding, module.weight.gather(table.T).values))  # (features, num_embeddings)
  return type(module).__name__, w


def _compressed_linear_plan(module: jsl.CompressedNMLinear, path: tuple, group: dict, plan: _Plan, *, sparse: bool,
                            flax_path: str):
  """A :class:`~jaxsparse.layers.CompressedNMLinear` takes its torch ``Linear`` as an ``nnx.Linear`` of its
  decompressed kernel does (:func:`_linear_plan`): an N:M-masked weight replaces it by a compressed layer of that
  mask (other sparse weights by their pattern's layer), any other weight fills the values at its own kept positions
  (a sparse layer keeps its own pattern); the layer's options (``storage``, ``implementation``, ...) carry over."""
  sub = _Plan(strict=plan.strict)
  _, w = _linear_plan(module.to_dense(), path, group, sub, sparse=sparse, flax_path=flax_path)
  plan.merge(sub)
  options = dict(implementation=module.implementation, cusparselt_copy=module.cusparselt_copy, storage=module.storage)
  if sub.replace:
    ((_, new),) = sub.replace
    if isinstance(new, jsl.NMLinear):
      new = new.to_compressed(**options)
    plan.replace.append((path, new))
    return type(new).__name__, w
  (_, kernel), *rest = sub.assign  # the decompressed nnx.Linear's kernel (the torch weight), then its bias
  kept = module.weight  # (in_features, out_features)
  weight = kept.gather(kernel.astype(kept.values.dtype))
  bias = rest[0][1] if rest else None
  if module.storage == "values":  # in place: the Variables keep their metadata (partitioning names)
    plan.assign.append((module.kernel, weight.values))
    if bias is not None:
      plan.assign.append((module.bias, bias.astype(module.bias[...].dtype)))
    return type(module).__name__, w
  new = jsl.CompressedNMLinear(weight, bias, dtype=module.dtype, precision=module.precision,
                               promote_dtype=module.promote_dtype,
                               preferred_element_type=module.preferred_element_type, **options)
  plan.replace.append((path, new))
  return type(new).__name__, w


def _tied_group(flax_path: str, aliases: Sequence[str], groups: Mapping[str, dict]) -> dict | None:
  """The torch group of the Flax module at ``flax_path``, also held at ``aliases`` (tied: ``self.head =
  self.embed``): the first of its paths that torch has; every other one torch has must hold the same parameters (a
  torch model with tied weights lists them at each path), else a :class:`CheckpointError` names both."""
  found = [(p, groups[p]) for p in (flax_path, *aliases) if p in groups]
  if not found:
    return None
  (first, group), *rest = found
  for p, other in rest:
    a, b = group["params"], other["params"]
    differ = sorted(set(a) ^ set(b)) or [k for k in sorted(a) if not (
        np.array_equal(a[k].value, b[k].value) and (a[k].mask is None) == (b[k].mask is None)
        and (a[k].mask is None or np.array_equal(a[k].mask, b[k].mask)))]
    if differ:
      raise CheckpointError(
          f"the Flax module {first!r} is also held at {p!r} (tied: one module, one set of weights), but torch "
          f"{group['torch']!r} and {other['torch']!r} differ in {differ}: skip one with ignore=, or load into a model "
          f"whose {first!r} and {p!r} are not tied."
      )
  return group


def _join(mod: str, name: str) -> str:
  return f"{mod}.{name}" if mod else name


def load_nnx(
    model: nnx.Module,
    source: Any,
    *,
    name_map: NameMap = None,
    ignore: str | Iterable[str] | None = (),
    nm: NMSpec = None,
    sparse: bool = True,
    strict: bool = True,
    key: str | None = None,
    conv1d: str | None = None,
    max_bytes: int | None = None,
) -> LoadReport:
  """Loads a PyTorch checkpoint into a Flax NNX model, turning sparse torch layers into jaxsparse layers.

  Every ``nnx.Linear`` (or jaxsparse linear layer) whose torch weight carries a mask is replaced, in
  place, by the layer its pattern calls for: a block pattern by :class:`~jaxsparse.layers.BlockSparseLinear`
  with the detected block shape (:func:`detect_pattern`: the largest power-of-two blocks of at least 8, so a mask of
  24x24 blocks reads as 8x8 and one of 4x8 blocks as unstructured; a ``BlockSparseLinear`` in ``model`` keeps its own
  block shape wherever the mask keeps whole blocks of it, so a model built as the exported one loads back the same
  layers), an N:M pattern by ``NMLinear``, any other mask by
  :class:`~jaxsparse.layers.MaskedLinear`; likewise every ``nnx.Conv``, by ``NMConv`` or ``MaskedConv`` (the torch
  mask replaces a ``MaskedConv``'s or ``NMConv``'s own; an ``NMConv`` of the same ``n:m`` is kept, with its
  settings). An ``nnx.LinearGeneral`` over trailing axes (the projections of ``nnx.MultiHeadAttention``) takes a
  torch ``Linear`` whose weight is its kernel's 2-D view ``(prod(in axes), prod(out axes))`` transposed, and
  becomes a :class:`~jaxsparse.layers.SparseLinearGeneral` when that weight is sparse; an ``nnx.MultiHeadAttention``
  takes a ``torch.nn.MultiheadAttention`` (either ``batch_first``): its packed ``in_proj_weight`` ``(3 * E, E)`` and
  ``in_proj_bias`` split by rows into ``query`` / ``key`` / ``value`` (a mask on them splits alike; the report names
  the rows, e.g. torch module ``"attn.in_proj[0:64]"``) and its ``out_proj`` fills ``out``. An ``nnx.Embed`` whose
  torch ``Embedding`` keeps ``n`` of every ``m`` features of each row becomes a
  :class:`~jaxsparse.layers.CompressedNMEmbed` with that mask (other masks fill the table, zeros where pruned), and so
  does a ``CompressedNMEmbed`` (such as :func:`jaxsparse.sparsify` made: its own torch export loads back into it);
  a :class:`~jaxsparse.layers.CompressedNMLinear` likewise becomes a compressed layer of an N:M-masked torch weight's
  mask, and keeps its own kept positions for a dense one.
  Dense torch weights fill the layer that is there (a sparse layer keeps its own pattern). A module the model holds at
  several paths (tied: ``self.head = self.embed``) loads from the torch module at the first of them that the
  checkpoint has; the torch weights at its other paths (a tied torch model lists them at each) must be the same. A
  torch tensor the Flax model has no module for that is the very tensor (the same memory) of one that was loaded, as a
  tied torch model's ``lm_head.weight`` is its ``embed_tokens.weight`` while the Flax twin computes its logits with
  ``embed.attend``, is skipped and listed in the report's ``tied`` (a torch module or a state dict in memory: a file
  stores such tensors apart). A pruned bias (``prune.l1_unstructured(fc, "bias", ...)``) loads zero where pruned into
  the dense Flax bias; the report's ``notes`` say its mask was not kept. Nothing changes unless every check passes.

  >>> import torch, torch.nn.utils.prune as prune
  >>> from flax import nnx
  >>> from jaxsparse import torch_interop
  >>> net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
  >>> prune.l1_unstructured(net[0], "weight", amount=0.75)  # doctest: +ELLIPSIS
  Linear(...)
  >>> model = nnx.Sequential(nnx.Linear(64, 64, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(64, 8, rngs=nnx.Rngs(0)))
  >>> report = torch_interop.load_nnx(model, net.state_dict(), name_map=[(r"^(\\d+)$", r"layers.\\1")])
  >>> type(model.layers[0]).__name__, report.torch_names
  ('MaskedLinear', {'layers.0': '0', 'layers.2': '2'})

  Args:
    model: the Flax NNX model; modified in place.
    source: anything :func:`load_state_dict` takes.
    name_map: torch module path -> Flax module path (see :func:`map_name`); default: same names.
    ignore: glob patterns (``fnmatch``) of torch parameter names to skip: one pattern (``"pooler.*"``), an iterable of
      them (``["pooler.*", "lm_head.weight"]``) or ``None`` (none).
    nm: recompute N:M masks of dense weights (see :func:`decode_checkpoint`).
    sparse: ``False`` loads masked weights into the existing (dense) layers instead of replacing them.
    strict: raise on Flax parameters without torch weights and torch weights without a place (in a module
      that maps to none, or beside a mapped module's weights); ``False`` lists them in the report instead. A mapped
      layer that lacks its torch weight or bias, or whose shapes differ, raises either way: it would not compute
      what the torch layer does.
    key: path of the state dict inside a nested checkpoint.
    conv1d: regex of the torch module paths whose weights are stored ``(in, out)`` like transformers' ``Conv1D``
      (GPT-2); see :func:`decode_checkpoint`. Not needed for a ``torch.nn.Module`` source, whose classes say it.
    max_bytes: the most bytes the checkpoint's tensors may take in dense form, each and all together, checked from
      their headers and shapes before any is read (see :func:`decode_checkpoint`); ``None``:
      ``$JAXSPARSE_CHECKPOINT_MAX_BYTES`` (bytes, or ``none``), else this machine's physical memory.

  Returns:
    A :class:`LoadReport`; its ``torch_names`` drive the export functions back to torch names (and its ``tied``,
    ``export_state_dict(..., tied=)``).

  Raises:
    CheckpointError: unreadable input, missing or unexpected keys (with close matches), shape mismatches
      naming the torch key and the Flax parameter, a mask that is not 0/1, torch weights that differ at two paths of
      one tied Flax module, a tensor or all of them together over ``max_bytes``.
    TypeError: ``model`` is not an NNX module; ``ignore`` is neither a ``str``, ``None`` nor an iterable of ``str``.
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}.")
  ignore = ignore_patterns(ignore)
  with limit_scope(max_bytes):
    src = source if isinstance(source, TensorSource) else open_checkpoint(source, key=key)
    params = decode_checkpoint(src, nm=nm, conv1d=conv1d)
  groups = group_params(params, name_map, ignore)
  plan = _Plan(strict=strict)
  loads, missing = [], []
  linear_types, seen = (jsl.NMLinear, jsl.MaskedLinear, jsl.BlockSparseLinear, nnx.Linear), set()
  targets = []
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Module) and _owns_params(node) and id(node) not in seen:
      seen.add(id(node))
      targets.append((tuple(path), node))
  paths_of = _rules.module_paths(model)  # a module held at several paths (tied) is one target, matched at each
  aliases = {id(m): [_rules.path_str(q) for q in paths_of.get(id(m), [p]) if tuple(q) != p] for p, m in targets}
  target_paths = {_rules.path_str(p) for p, _ in targets} | {q for qs in aliases.values() for q in qs}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.MultiHeadAttention):
      split_packed_attention(groups, _rules.path_str(path))
  loaded: list[dict] = []
  for path, module in targets:
    flax_path = _rules.path_str(path)
    group = _tied_group(flax_path, aliases[id(module)], groups)
    if group is None:
      names = [_join(flax_path, k) for k, v in vars(module).items() if isinstance(v, nnx.Param)]
      if names:
        missing.extend(names)
      continue
    if isinstance(module, linear_types):
      layer, w = _linear_plan(module, path, group, plan, sparse=sparse, flax_path=flax_path)
    elif isinstance(module, nnx.Conv):
      layer, w = _conv_plan(module, path, group, plan, sparse=sparse, flax_path=flax_path)
    elif isinstance(module, nnx.LinearGeneral):
      layer, w = _general_plan(module, path, group, plan, sparse=sparse, flax_path=flax_path)
    elif isinstance(module, nnx.Embed):
      layer, w = _embed_plan(module, path, group, plan, sparse=sparse, flax_path=flax_path)
    elif isinstance(module, jsl.CompressedNMEmbed):
      layer, w = _compressed_embed_plan(module, path, group, plan, sparse=sparse, flax_path=flax_path)
    elif isinstance(module, jsl.CompressedNMLinear):
      layer, w = _compressed_linear_plan(module, path, group, plan, sparse=sparse, flax_path=flax_path)
    else:
      layer, w = _generic_plan(module, group, plan, flax_path=flax_path)
    fmt, pattern = (w.format, w.pattern) if w is not None else ("dense", Pattern("dense", 1.0))
    loads.append(LayerLoad(flax_path, group["torch"], layer, fmt, pattern))
    loaded.append(group)
  unexpected = list(plan.unexpected)
  not_used = set(unexpected)
  # Dense ones only: a pruned tensor loads masked, while the torch module tied to it computes with all of it.
  loaded_keys = {p.keys[0] for g in loaded for p in g["params"].values()
                 if p.name not in not_used and len(p.keys) == 1 and p.mask is None}
  tied: dict[str, str] = {}
  for flax_path, group in groups.items():
    if flax_path in target_paths:
      continue
    for p in group["params"].values():
      twin = loaded_twin(p, src.shared, loaded_keys)
      if twin is None:
        unexpected.append(p.name)
      else:
        tied[p.name] = twin
  if strict and (missing or unexpected):
    parts = []
    if unexpected:
      hints = []
      for name in unexpected[:5]:
        fp = map_name(name_map, name.rpartition(".")[0])
        fp_ = fp or ""
        close = [t for t in sorted(target_paths) if t.endswith("." + fp_) or fp_.endswith("." + t)]
        close = close or difflib.get_close_matches(fp_, sorted(target_paths), n=1)
        hints.append(f"{name!r} (-> Flax {fp!r}" + (f"; did you mean {close[0]!r}?)" if close else ")"))
      parts.append(f"torch parameters with no Flax module: {', '.join(hints)}"
                   + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""))
    if missing:
      parts.append(f"Flax parameters with no torch weights: {missing[:8]}"
                   + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    raise CheckpointError(
        "; ".join(parts) + ". Map names with name_map=, skip torch keys with ignore=, or pass strict=False."
    )
  for path, new in plan.replace:
    if not path:  # checked before anything is written
      raise ValueError(
          f"model is itself the {type(model).__name__} that this checkpoint stores sparse (it loads as a "
          f"{type(new).__name__}); load_nnx swaps such layers into a model in place and cannot replace the model "
          f"object itself: load into a module holding it (e.g. nnx.Sequential(layer)), then take the layer out."
      )
  for var, value in plan.assign:
    var[...] = value
  for path, new in plan.replace:
    _rules.replace_module(model, path, new)
  return LoadReport(loads, missing=missing, unexpected=unexpected, tied=tied, notes=plan.notes)


def loaded_twin(p: TorchParam, shared: Mapping[str, Sequence[str]], loaded_keys: set[str]) -> str | None:
  """The loaded torch key whose tensor is the very tensor of ``p`` (the same memory: tied weights), else ``None``."""
  if len(p.keys) != 1 or p.mask is not None:  # a pruned or sparse parameter: not one plain tensor
    return None
  return next((k for k in shared.get(p.keys[0], ()) if k in loaded_keys), None)

