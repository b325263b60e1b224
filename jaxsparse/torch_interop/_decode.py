"""Recognising the sparse formats PyTorch users have, one parameter at a time.

Each decoder turns the raw keys of one parameter into a :class:`TorchParam`: its dense values and, for a
sparse parameter, a bool mask, both in torch layout. Recognised (the key names are the projects' own):

* ``torch.nn.utils.prune``: ``{p}_orig`` + ``{p}_mask`` (mask 0/1 in the weight's dtype);
* ``torch.ao.pruning`` parametrizations: ``{mod}.parametrizations.{p}.original`` + ``.0.mask`` (or the
  mask from ``sparsifier.state_dict()["state"][fqn]["mask"]`` stored beside the model; a prepared model passed
  itself gives its ``FakeSparsity`` masks as ``.0.mask``);
* apex ASP: ``{mod}.{p}`` + ``{mod}.__{p}_mma_mask`` (``__{p}_mma_pruned_p`` is ignored);
* a masked dense state dict: ``{p}`` + ``{p}_mask`` (what :func:`export_masks` writes);
* torch sparse tensors (COO, CSR, CSC, BSR, BSC; their indices are checked with NumPy before anything is
  densified, since torch.load does not check them): the specified entries are the mask; 2:4
  ``SparseSemiStructuredTensor`` via its dense form with the 2:4 mask recomputed;
* huggingface ``pytorch_block_sparse`` ``BlockSparseLinear``: ``{mod}.weight.data`` holds the kept
  ``(b0, b1)`` blocks of the ``(out, in)`` weight, each stored transposed, stacked to ``(nnz * b0, b1)``;
  ``{mod}.weight.cols_a`` is ``(nnz, 2)`` ``[block column, index into data]`` in row-major block order and
  ``{mod}.weight.row_start_ends_a`` its CSR row offsets; ``col_start_ends_b`` gives the block-column
  count; the emulator's ``{mod}.weight._dense``, when present, holds the current dense values;
* SparseProp ``SparseLinear``: ``{mod}.W_val`` (CSR values of the ``(out, in)`` weight) with the indices
  the module keeps outside its state dict, read by :func:`load_state_dict` from the module as
  ``{mod}.W_idx.indptr``, ``{mod}.W_idx.indices`` and ``{mod}.W_shape``;
* NM-sparsity (SR-STE) checkpoints: plain dense weights; pass ``nm=`` to recompute their N:M mask
  (its ``Sparse`` op keeps the ``n`` largest ``|w|`` of each run of ``m`` along the input dimension, ranked in
  float64 for float64 weights; equal magnitudes may break ties differently from torch's unstable ``argsort``).
  Its ``SparseLinear`` calls ``F.linear(x, w)`` without the bias it holds: drop ``*.bias`` with ``ignore=`` to
  match it.

Every other tensor is a dense parameter.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import re
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxsparse.torch_interop._conv1d import CONV1D_FORMAT
from jaxsparse.torch_interop._conv1d import check_conv1d
from jaxsparse.torch_interop._conv1d import conv1d_weights
from jaxsparse.torch_interop._limits import check_sizes
from jaxsparse.torch_interop._limits import limit_scope
from jaxsparse.torch_interop._load import CheckpointError
from jaxsparse.torch_interop._load import TensorSource
from jaxsparse.torch_interop._load import open_checkpoint
from jaxsparse.torch_interop._patterns import Pattern
from jaxsparse.torch_interop._patterns import check_mask
from jaxsparse.torch_interop._patterns import detect_pattern
from jaxsparse.torch_interop._patterns import nm_mask_torch
from jaxsparse.torch_interop._tensors import decode_dense_tensor
from jaxsparse.torch_interop._tensors import decode_hf_block_sparse
from jaxsparse.torch_interop._tensors import decode_sparseprop
from jaxsparse.torch_interop._tensors import to_numpy

__all__ = ["NMSpec", "TorchParam", "decode_checkpoint", "float_value"]

NMSpec = tuple[int, int] | Mapping[str, tuple[int, int]] | None

_HF_BLOCK_FIELDS = ("data", "cols_a", "row_start_ends_a", "rows_b", "col_start_ends_b", "blocks", "_dense")
_APEX_RE = re.compile(r"^(?:(?P<mod>.*)\.)?__(?P<p>[^.]+)_mma_(?P<what>mask|pruned_p)$")
_PARAM_RE = re.compile(r"^(?:(?P<mod>.*)\.)?parametrizations\.(?P<p>[^.]+)\.(?P<rest>.+)$")


@dataclasses.dataclass(frozen=True, eq=False)
class TorchParam:
  """One decoded PyTorch parameter, in torch layout.

  Attributes:
    name: the parameter's dotted name as the module sees it, e.g. ``"encoder.fc.weight"`` (for
      ``weight_orig`` / ``parametrizations.weight.original`` / block-sparse storage: the plain name).
    value: NumPy array, dense, in torch layout (``(out, in)`` for a Linear weight; a transformers ``Conv1D``
      weight, stored ``(in, out)``, comes transposed to that layout, see :func:`decode_checkpoint`); for pruned
      formats that keep the original weights (``prune``, ``torch.ao``) the values outside the mask are the
      originals, so use :attr:`masked_value` for the effective weight.
    mask: bool NumPy array of ``value.shape`` (True = kept), or ``None`` for a dense parameter.
    format: where it came from, e.g. ``"dense"``, ``"torch.nn.utils.prune"``, ``"apex ASP"``.
    keys: the checkpoint keys it was decoded from.
    problem: with ``on_error="collect"``, why it could not be decoded (``value`` is then ``None``).

  >>> import torch, torch.nn.utils.prune as prune
  >>> from jaxsparse import torch_interop
  >>> net = torch.nn.Sequential(torch.nn.Linear(8, 4))
  >>> _ = prune.custom_from_mask(net[0], "weight", torch.eye(4, 8, dtype=torch.bool))
  >>> p = torch_interop.decode_checkpoint(net.state_dict())["0.weight"]
  >>> p.module, p.param, p.shape, p.format, p.keys
  ('0', 'weight', (4, 8), 'torch.nn.utils.prune', ('0.weight_orig', '0.weight_mask'))
  >>> int(p.mask.sum()), int((p.masked_value != 0).sum()), str(p.pattern)  # one of every 8 inputs kept
  (4, 4, '1:8')
  """

  name: str
  value: np.ndarray | None
  mask: np.ndarray | None
  format: str
  keys: tuple[str, ...]
  problem: str | None = None

  @property
  def module(self) -> str:
    """The owning module's dotted path (``""`` for a top-level parameter)."""
    return self.name.rpartition(".")[0]

  @property
  def param(self) -> str:
    """The parameter's own name, e.g. ``"weight"``."""
    return self.name.rpartition(".")[2]

  @property
  def shape(self) -> tuple[int, ...]:
    """The shape of :attr:`value` in torch layout (``(out, in)`` for a Linear weight); ``()`` when the parameter
    could not be decoded (``value`` is ``None``, :attr:`problem` says why)."""
    return () if self.value is None else tuple(self.value.shape)

  @functools.cached_property
  def pattern(self) -> Pattern:
    """The :class:`Pattern` of :attr:`mask` (``"dense"`` without a mask)."""
    return detect_pattern(self.mask)

  @property
  def masked_value(self) -> np.ndarray:
    """``value`` with zeros where the mask drops an entry."""
    if self.mask is None:
      return self.value
    return np.where(self.mask, self.value, np.zeros((), self.value.dtype))

def float_value(p: TorchParam, *, into: str) -> np.ndarray:
  """``p.masked_value`` for a floating-point Flax variable; a weight of any other dtype raises.

  Casting would lose information without a word: a complex weight its imaginary part, an int8 one the scales
  it was quantized with; a bool weight is likely a mask saved under the weight's name. (Masks themselves may
  be bool: they are read separately.)

  Args:
    p: the decoded torch parameter.
    into: what it is loaded into, for the message, e.g. ``"the Flax 'fc.kernel'"``.

  Returns:
    The effective values (zero where a mask drops an entry), float16, bfloat16, float32 or float64.

  Raises:
    CheckpointError: naming the torch key, its dtype and the dtypes allowed.
  """
  value = p.masked_value
  if value.dtype.kind == "f" or value.dtype.name == "bfloat16":
    return value
  why = {"c": "casting would drop the imaginary part", "b": f"a mask goes under the key '{p.name}_mask'"}.get(
      value.dtype.kind, "dequantize it (with its scales) first")
  key = p.keys[0] if p.keys else p.name
  raise CheckpointError(
      f"torch {key!r} has dtype {value.dtype}, but {into} takes a real floating-point tensor (float16, bfloat16, "
      f"float32 or float64): {why}."
  )



# -------------------------------------------------------------------------------------------------
# Grouping keys into parameters.
# -------------------------------------------------------------------------------------------------


def _join(mod: str | None, name: str) -> str:
  return f"{mod}.{name}" if mod else name


def _plan(keys: list[str], extras: Mapping[str, Any]) -> list[tuple[str, tuple[str, ...], Callable]]:
  """``[(param name, keys, decode(src) -> (value, mask, format))]``, ordered by each group's first key.

  Groups are found first (in any key order: safetensors sorts keys), then every unclaimed key is a
  parameter of its own.
  """
  key_set = set(keys)
  claimed: set[str] = set()
  groups: list[tuple[str, tuple[str, ...], Callable]] = []

  def add(name: str, group_keys: tuple[str, ...], fn: Callable) -> None:
    claimed.update(group_keys)
    groups.append((name, group_keys, fn))

  def fail(message: str) -> Callable:
    return functools.partial(_fail, message)

  for k in keys:
    if k in claimed:
      continue
    if k.endswith("_orig"):  # torch.nn.utils.prune
      p = k[:-5]
      if p + "_mask" in key_set:
        decode = functools.partial(_masked, value_key=k, mask_key=p + "_mask", fmt="torch.nn.utils.prune")
        add(p, (k, p + "_mask"), decode)
      else:
        add(p, (k,), fail(f"{k!r} looks like torch.nn.utils.prune's *_orig, but {p}_mask is missing."))
    elif (pm := _PARAM_RE.match(k)) and pm["rest"] == "original":  # torch.ao.pruning
      mod, p = pm["mod"], pm["p"]
      name, mask_key = _join(mod, p), _join(mod, f"parametrizations.{p}.0.mask")
      prefix = _join(mod, f"parametrizations.{p}.")
      extra = [x for x in keys if x.startswith(prefix) and x not in (k, mask_key)]
      if extra:
        add(name, (k, *extra), fail(f"{name}: unknown parametrization keys {extra}; jaxsparse reads torch.ao.pruning's "
                                    f"FakeSparsity ({k!r} + {mask_key!r})."))
      elif mask_key in key_set:
        add(name, (k, mask_key), functools.partial(_masked, value_key=k, mask_key=mask_key, fmt="torch.ao.pruning"))
      elif name in extras:
        add(name, (k,), functools.partial(_masked, value_key=k, mask=extras[name], fmt="torch.ao.pruning"))
      else:
        add(name, (k,), fail(
            f"{k!r} is a torch.ao.pruning parametrization but its mask is not in the checkpoint: FakeSparsity leaves "
            "the mask out of the model's state_dict. Save {'model': model.state_dict(), 'sparsifier': "
            "sparsifier.state_dict()}, or call sparsifier.squash_mask() before saving."))
    elif (am := _APEX_RE.match(k)) and am["what"] == "mask":  # apex ASP
      mod, p = am["mod"], am["p"]
      name = _join(mod, p)
      aux = tuple(x for x in (_join(mod, f"__{p}_mma_pruned_p"),) if x in key_set)
      if name in key_set:
        add(name, (name, k, *aux), functools.partial(_masked, value_key=name, mask_key=k, fmt="apex ASP"))
      else:
        add(name, (k, *aux), fail(f"{k!r} is an apex ASP mask but its weight {name!r} is missing."))
    elif k == "weight.cols_a" or k.endswith(".weight.cols_a"):  # pytorch_block_sparse
      mod = k[: -len("weight.cols_a")].rstrip(".")
      base = _join(mod, "weight.")
      fields = tuple(base + f for f in _HF_BLOCK_FIELDS if base + f in key_set)
      if base + "data" in key_set and base + "row_start_ends_a" in key_set:
        add(_join(mod, "weight"), fields, lambda src, mod=mod: decode_hf_block_sparse(src, mod))
      else:
        add(_join(mod, "weight"), fields, fail(f"{k!r} looks like pytorch_block_sparse, but {base}data or "
                                               f"{base}row_start_ends_a is missing."))
    elif k == "W_val" or k.endswith(".W_val"):  # SparseProp
      mod = k[: -len("W_val")].rstrip(".")
      fields = tuple(x for x in (_join(mod, "W_idx.indptr"), _join(mod, "W_idx.indices"), _join(mod, "W_shape"))
                     if x in key_set)
      add(_join(mod, "weight"), (k, *fields), lambda src, mod=mod: decode_sparseprop(src, mod))
  for k in keys:  # masked dense state dicts: {p} + {p}_mask
    if k not in claimed and k.endswith("_mask") and k[:-5] in key_set and k[:-5] not in claimed:
      add(k[:-5], (k[:-5], k), functools.partial(_masked, value_key=k[:-5], mask_key=k, fmt="masked dense"))
  for k in keys:
    if k in claimed:
      continue
    if _PARAM_RE.match(k):
      add(k, (k,), fail(f"{k!r}: a parametrization key without its 'parametrizations.<p>.original'."))
    elif _APEX_RE.match(k):
      add(k, (k,), fail(f"{k!r} is apex ASP's pruned-weight store, but its __<p>_mma_mask is missing."))
    else:
      add(k, (k,), lambda src, k=k: decode_dense_tensor(src[k], key=k))
  position = {k: i for i, k in enumerate(keys)}
  groups.sort(key=lambda g: min((position[k] for k in g[1]), default=len(keys)))
  names = {g[0] for g in groups}
  for fqn in extras:
    if fqn not in names:
      message = f"the sparsifier state has a mask for {fqn!r} but the model has no such parameter."
      groups.append((fqn, (), fail(message)))
  return groups


def _fail(message: str, _src: Mapping) -> tuple:
  raise CheckpointError(message)


def _masked(src: Mapping, *, value_key: str, fmt: str, mask_key: str | None = None, mask: Any = None):
  value, inner_mask, inner_fmt = decode_dense_tensor(src[value_key], key=value_key)
  if inner_mask is not None:
    raise CheckpointError(f"{value_key!r} is a {inner_fmt} tensor; a {fmt} weight must be a dense tensor.")
  raw = to_numpy(src[mask_key] if mask_key is not None else mask, key=mask_key or value_key + " (sparsifier mask)")
  return value, check_mask(raw, value.shape, key=mask_key or f"sparsifier mask of {value_key}"), fmt


def _check_nm(nm: NMSpec) -> None:
  """``nm`` is ``None``, a pair of ints ``(n, m)`` with ``1 <= n <= m``, or ``{regex: (n, m)}``; else an error naming
  it (``"2:4"`` failed deep in the mask code, ``(2.0, 4)`` was taken and reported as ``2.0:4``)."""
  if nm is None:
    return
  for pattern, spec in nm.items() if isinstance(nm, Mapping) else [(None, nm)]:
    where = "nm" if pattern is None else f"nm[{pattern!r}]"
    if pattern is not None:
      if not isinstance(pattern, str):
        raise TypeError(f"nm's keys must be regexes (str) of parameter names, got {pattern!r}.")
      try:
        re.compile(pattern)
      except re.error as e:
        raise ValueError(f"{where}: the regex does not compile ({e}).") from None
    if not (isinstance(spec, tuple | list) and len(spec) == 2
            and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in spec)):
      raise TypeError(f"{where} must be a pair of ints (n, m), e.g. (2, 4), or a dict of regex -> (n, m); got "
                      f"{spec!r}.")
    if not 1 <= spec[0] <= spec[1]:
      raise ValueError(f"{where}={tuple(spec)} must have 1 <= n <= m.")


def _nm_for(name: str, nm: NMSpec) -> tuple[int, int] | None:
  if nm is None:
    return None
  if isinstance(nm, Mapping):
    for pattern, spec in nm.items():
      if re.search(pattern, name):
        return tuple(int(v) for v in spec)
    return None
  return tuple(int(v) for v in nm)


def decode_checkpoint(
    source: Any,
    *,
    nm: NMSpec = None,
    key: str | None = None,
    on_error: str = "raise",
    progress: Callable[[int, int], None] | None = None,
    conv1d: str | None = None,
    max_bytes: int | None = None,
) -> dict[str, TorchParam]:
  """Decodes every parameter of a checkpoint into dense values plus a mask, in torch layout.

  >>> import torch, torch.nn.utils.prune as prune
  >>> from jaxsparse import torch_interop
  >>> _ = torch.manual_seed(0)  # a mask of 8 x 4 weights could fall into 4:8 groups by chance (about 4%)
  >>> fc = torch.nn.Linear(64, 16)
  >>> _ = prune.l1_unstructured(fc, "weight", amount=0.5)
  >>> params = torch_interop.decode_checkpoint(fc.state_dict())
  >>> p = params["weight"]
  >>> p.format, p.shape, p.pattern.kind, p.pattern.density
  ('torch.nn.utils.prune', (16, 64), 'unstructured', 0.5)

  Args:
    source: anything :func:`load_state_dict` takes.
    nm: recompute N:M masks of dense weights (NM-sparsity / SR-STE checkpoints keep dense weights and
      prune in the forward pass): ``(n, m)`` for every mask-less parameter with ndim >= 2, or
      ``{regex: (n, m)}`` for the parameters whose name matches (``re.search``). Groups run along the
      input dimension (dim 1), keeping the ``n`` largest ``|w|`` (ties: lower index).
    key: path of the state dict in a nested checkpoint (see :func:`load_state_dict`).
    on_error: ``"raise"`` stops at the first parameter that cannot be decoded; ``"collect"`` returns it
      with :attr:`TorchParam.problem` set (what ``jaxsparse inspect`` shows).
    progress: called as ``progress(done, total)`` after each parameter.
    conv1d: regex (``re.search``) of the torch module paths whose 2-D ``weight`` is stored ``(in, out)``, as
      transformers' ``Conv1D`` (GPT-2's ``c_attn``, ``c_proj``, ``c_fc``) stores it; such weights (and their masks)
      come transposed to the ``(out, in)`` layout of a Linear weight, their format ending in
      ``", Conv1D (in, out)"``. For a ``torch.nn.Module`` source the module classes decide instead. ``None``: a
      weight whose 1-D bias has ``shape[1] != shape[0]`` entries is one; a square weight with a bias in a checkpoint
      that has such weights raises (a state dict does not tell its layout).
    max_bytes: the most bytes the checkpoint's tensors may take in dense form (a sparse tensor at its dense shape),
      each and all together, as their headers and shapes declare them: checked before any is read or densified
      (also the dense form of a ``pytorch_block_sparse`` or SparseProp layer, when its indices give it). ``None``:
      ``$JAXSPARSE_CHECKPOINT_MAX_BYTES`` (bytes, or ``none`` for no limit), else this machine's physical memory.
      Masks and the copies made while decoding come on top (a mask is one byte per entry).

  Returns:
    ``{parameter name: TorchParam}`` in checkpoint order.

  Raises:
    ValueError: ``on_error`` is not ``"raise"`` or ``"collect"``.
    CheckpointError: (a ``ValueError``) ``source`` cannot be read (see :func:`load_state_dict`; also with
      ``on_error="collect"``); with ``on_error="raise"``, a parameter that cannot be decoded (an inconsistent
      sparse format, a name decoded twice, an N:M mask that ``nm`` cannot recompute); the message names the
      file and the keys. Also with ``on_error="collect"``: square weights of unknown layout beside Conv1D ones
      (see ``conv1d``); a tensor or dense form over ``max_bytes``, or all tensors together over it (the message
      names the tensor, its shape, dtype and bytes, and the limit).
    TypeError: ``nm`` is not ``None``, a pair of ints or a dict of regexes to pairs (a pair without
      ``1 <= n <= m``, or a regex that does not compile: ``ValueError``); ``conv1d`` is not a ``str`` or ``None``
      (a ``conv1d`` that does not compile: ``ValueError``);
      ``max_bytes`` is not an int or ``None`` (one < 1: ``ValueError``).
    ImportError: PyTorch is not installed.
  """
  if on_error not in ("raise", "collect"):
    raise ValueError(f"on_error must be 'raise' or 'collect', got {on_error!r}.")
  _check_nm(nm)
  check_conv1d(conv1d)
  with limit_scope(max_bytes):
    src = source if isinstance(source, TensorSource) else open_checkpoint(source, key=key)
    # Every tensor at its dense size, from the metadata: a sparse tensor declares its dense shape apart from what it
    # stores, and decoding holds all of them at once.
    check_sizes(src.sizes, origin=src.origin)
    return _decode(src, nm=nm, on_error=on_error, progress=progress, conv1d=conv1d)


def _decode(src: TensorSource, *, nm: NMSpec, on_error: str, progress: Callable[[int, int], None] | None,
            conv1d: str | None) -> dict[str, TorchParam]:
  plan = _plan(list(src), src.extras)
  decoded: dict[str, tuple] = {}
  out: dict[str, TorchParam] = {}

  def failed(name: str, keys: tuple[str, ...], e: CheckpointError) -> None:
    if on_error == "raise":
      raise CheckpointError(f"{src.origin}: {e}") from e
    out[name] = TorchParam(name, None, None, "unreadable", tuple(keys), problem=str(e))

  for i, (name, keys, fn) in enumerate(plan):
    try:
      if name in decoded:
        raise CheckpointError(
            f"{name!r} appears twice (keys {decoded[name][3]} and {keys}); the checkpoint is ambiguous")
      value, mask, fmt = fn(src)
      decoded[name] = (value, mask, fmt, tuple(keys))
    except CheckpointError as e:
      failed(name, keys, e)
    if progress is not None:
      progress(i + 1, len(plan))
  try:
    transposed = conv1d_weights(decoded, src.module_types, conv1d)
  except CheckpointError as e:
    raise CheckpointError(f"{src.origin}: {e}") from e  # a checkpoint-wide question: collect cannot answer it
  for name, (value, mask, fmt, keys) in decoded.items():
    if name in transposed:  # a Conv1D's (in, out) weight in the (out, in) layout of every other Linear weight
      value, mask, fmt = value.T.copy(), None if mask is None else mask.T.copy(), f"{fmt}, {CONV1D_FORMAT}"
    try:
      spec = _nm_for(name, nm)
      if spec is not None and mask is None and value.ndim >= 2:
        try:
          mask = nm_mask_torch(value, *spec)
        except ValueError as e:
          raise CheckpointError(f"{name!r}: cannot recompute an N:M mask: {e}") from e
        fmt = f"{fmt}, {spec[0]}:{spec[1]} recomputed"
      out[name] = TorchParam(name, value, mask, fmt, keys)
    except CheckpointError as e:
      failed(name, keys, e)
  return {name: out[name] for name in dict.fromkeys(n for n, _, _ in plan) if name in out}
