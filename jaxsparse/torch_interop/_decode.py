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
import re
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxsparse.torch_interop._conv1d import CONV1D_FORMAT
from jaxsparse.torch_interop._conv1d import check_conv1d
from jaxsparse.torch_interop._conv1d import conv1d_weights
from jaxsparse.torch_interop._load import CheckpointError
from jaxsparse.torch_interop._load import TensorSource
from jaxsparse.torch_interop._load import import_torch
from jaxsparse.torch_interop._load import open_checkpoint
from jaxsparse.torch_interop._patterns import Pattern
from jaxsparse.torch_interop._patterns import detect_pattern
from jaxsparse.torch_interop._patterns import nm_mask_torch

__all__ = ["NMSpec", "TorchParam", "decode_checkpoint", "float_value", "to_numpy"]

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


def to_numpy(t: Any, *, key: str) -> np.ndarray:
  """A dense CPU torch tensor as a NumPy array (bfloat16 through ``ml_dtypes``).

  A bool tensor comes back with every byte 0 or 1: a file may store any nonzero byte for True (a safetensors
  ``BOOL`` header over ``uint8`` data), and such bytes leak through ``where`` as a multiplier of 2, 3, ...
  """
  torch = import_torch()
  if getattr(t, "is_nested", False) or getattr(t, "layout", torch.strided) != torch.strided:
    kind = "nested" if t.is_nested else t.layout
    raise CheckpointError(f"{key!r} is a {kind} tensor; expected a dense (strided) tensor here.")
  if getattr(t, "is_meta", False):
    raise CheckpointError(
        f"{key!r} is a meta tensor of shape {tuple(t.shape)}: it has no values (a model built on the 'meta' device "
        "whose weights were never loaded?); expected a tensor with data."
    )
  # A conjugate or negative view (``z.conj()``, which torch.save keeps as such) holds its values only lazily.
  t = t.detach().cpu().resolve_conj().resolve_neg()
  if t.dtype == torch.bfloat16:
    import ml_dtypes  # noqa: PLC0415 -- only for bfloat16 checkpoints; installed with jax

    return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
  if t.dtype == torch.bool:
    return t.contiguous().view(torch.uint8).numpy() != 0
  try:
    return t.contiguous().numpy().copy()
  except TypeError as e:
    raise CheckpointError(f"{key!r} has dtype {t.dtype}, which jaxsparse cannot convert to NumPy.") from e


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


def _check_mask(mask: np.ndarray, shape: tuple[int, ...], *, key: str) -> np.ndarray:
  if tuple(mask.shape) != tuple(shape):
    raise CheckpointError(f"mask {key!r} has shape {tuple(mask.shape)} but its weight has shape {tuple(shape)}.")
  if mask.dtype == np.bool_:
    return mask
  if mask.dtype.kind not in "biuf" and mask.dtype.name != "bfloat16":
    raise CheckpointError(f"mask {key!r} has dtype {mask.dtype}; expected bool or numbers 0/1.")
  values = mask.astype(np.float64)  # exact for every mask dtype: 1 + 1e-12 (float64) is not 1
  bad = ~((values == 0) | (values == 1))
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise CheckpointError(
        f"mask {key!r} must hold only 0 and 1, but has {float(values[where])} at {where} "
        f"({int(bad.sum())} entries are not 0/1)."
    )
  return values == 1


def _int_array(t: Any, *, key: str, ndim: int) -> np.ndarray:
  arr = to_numpy(t, key=key)
  if arr.dtype.kind not in "iu" or arr.ndim != ndim:
    raise CheckpointError(f"{key!r} must be a {ndim}-D integer tensor, got dtype {arr.dtype} shape {arr.shape}.")
  return arr.astype(np.int64)


def _check_offsets(offsets: np.ndarray, nnz: int, *, key: str) -> None:
  if offsets.size == 0 or offsets[0] != 0 or offsets[-1] != nnz or np.any(np.diff(offsets) < 0):
    raise CheckpointError(
        f"{key!r} must be non-decreasing offsets from 0 to the number of stored entries ({nnz}), got "
        f"{offsets[:8].tolist()}{'...' if offsets.size > 8 else ''} (length {offsets.size})."
    )


def _check_index(index: np.ndarray, bound: int, *, key: str) -> None:
  if index.size and (index.min() < 0 or index.max() >= bound):
    raise CheckpointError(f"{key!r} holds indices outside [0, {bound}): min {index.min()}, max {index.max()}.")


# -------------------------------------------------------------------------------------------------
# Decoders. Each returns (value, mask, format) for one parameter.
# -------------------------------------------------------------------------------------------------


def _decode_dense_tensor(t: Any, *, key: str) -> tuple[np.ndarray, np.ndarray | None, str]:
  """A plain, torch-sparse or semi-structured tensor."""
  torch = import_torch()
  semi = getattr(torch.sparse, "SparseSemiStructuredTensor", None)
  if semi is not None and isinstance(t, semi):
    dense = to_numpy(t.to_dense(), key=key)
    if dense.ndim != 2 or dense.shape[1] % 4:
      raise CheckpointError(f"{key!r}: a 2:4 semi-structured tensor must be 2-D with in-features % 4 == 0.")
    # Stored zeros are indistinguishable from pruned ones in the dense form; every group keeps 2 of 4.
    return dense, nm_mask_torch(dense, 2, 4), "2:4 semi-structured"
  layout = t.layout
  if layout == torch.strided:
    return to_numpy(t, key=key), None, "dense"
  if layout == torch.sparse_coo:
    dense, mask = _coo_to_numpy(t, key=key)
  elif layout in (torch.sparse_csr, torch.sparse_bsr, torch.sparse_csc, torch.sparse_bsc):
    dense, mask = _compressed_to_numpy(t, str(layout).removeprefix("torch."), key=key)
  else:
    raise CheckpointError(f"{key!r} has layout {layout}, which jaxsparse does not read.")
  return dense, mask, f"torch {str(layout).removeprefix('torch.')}"


# Torch sparse tensors are checked and densified with NumPy, never with torch: ``to_dense()`` and
# ``coalesce()`` trust the indices, and a file with an index past the shape (``torch.load`` does not
# check them) writes out of bounds and kills the process.


def _sparse_part(t: Any, *, key: str, what: str, integer: bool = False) -> np.ndarray:
  """One stored part of a sparse tensor (an index or the values tensor) as NumPy, type-checked."""
  arr = to_numpy(t, key=f"{key} ({what})")
  if integer and arr.dtype.kind not in "iu":
    raise CheckpointError(f"{key!r}: {what} must be an integer tensor, got dtype {arr.dtype}.")
  return arr.astype(np.int64) if integer else arr


def _zeros(shape: tuple[int, ...], dtype: Any, *, key: str) -> np.ndarray:
  try:
    return np.zeros(shape, dtype)
  except (MemoryError, ValueError) as e:
    raise CheckpointError(f"{key!r}: its dense shape {shape} ({dtype}) does not fit in memory: {e}") from e


def _coo_to_numpy(t: Any, *, key: str) -> tuple[np.ndarray, np.ndarray]:
  """A COO tensor's dense values and mask of specified entries; duplicate entries sum, as ``coalesce`` does."""
  shape = tuple(int(d) for d in t.shape)
  indices = _sparse_part(t._indices(), key=key, what="COO indices", integer=True)
  values = _sparse_part(t._values(), key=key, what="COO values")
  if indices.ndim != 2 or not 1 <= indices.shape[0] <= len(shape):
    raise CheckpointError(
        f"{key!r}: COO indices must be (sparse_dim, nnz) with 1 <= sparse_dim <= {len(shape)} (the tensor is "
        f"{len(shape)}-D), got shape {indices.shape}."
    )
  sparse_dim, nnz = indices.shape
  if values.shape != (nnz, *shape[sparse_dim:]):
    raise CheckpointError(
        f"{key!r}: COO values must have shape (nnz, *dense dims) = {(nnz, *shape[sparse_dim:])} for {nnz} "
        f"indices and shape {shape}, got {values.shape}."
    )
  for d in range(sparse_dim):
    _check_index(indices[d], shape[d], key=f"{key} (COO indices of dim {d})")
  dense = _zeros(shape, values.dtype, key=key)
  mask = _zeros(shape, bool, key=key)
  if nnz == 0:
    return dense, mask
  flat = np.ravel_multi_index(tuple(indices), shape[:sparse_dim])
  unique, inverse = np.unique(flat, return_inverse=True)
  where = np.unravel_index(unique, shape[:sparse_dim])
  if unique.size == nnz:
    dense[tuple(indices)] = values
  elif values.dtype == np.bool_:
    summed = np.zeros((unique.size, *values.shape[1:]), bool)
    np.logical_or.at(summed, inverse, values)
    dense[where] = summed
  else:
    acc = np.float64 if values.dtype.kind not in "iu" else np.int64
    summed = np.zeros((unique.size, *values.shape[1:]), acc)
    np.add.at(summed, inverse, values.astype(acc))
    dense[where] = summed.astype(values.dtype)
  mask[where] = True
  return dense, mask


def _compressed_to_numpy(t: Any, layout: str, *, key: str) -> tuple[np.ndarray, np.ndarray]:
  """A CSR / CSC / BSR / BSC tensor (with batch and dense dims) as its dense values and mask, after checking
  every invariant torch states for it: offsets from 0 to nnz, non-decreasing; indices in range, no entry twice."""
  by_row = layout in ("sparse_csr", "sparse_bsr")
  blocked = layout in ("sparse_bsr", "sparse_bsc")
  comp_name, plain_name = ("crow_indices", "col_indices") if by_row else ("ccol_indices", "row_indices")
  compressed = _sparse_part(getattr(t, comp_name)(), key=key, what=comp_name, integer=True)
  plain = _sparse_part(getattr(t, plain_name)(), key=key, what=plain_name, integer=True)
  values = _sparse_part(t.values(), key=key, what="values")
  shape = tuple(int(d) for d in t.shape)
  nb = compressed.ndim - 1  # batch dims
  if nb < 0 or plain.ndim != nb + 1 or compressed.shape[:nb] != plain.shape[:nb] or len(shape) < nb + 2:
    raise CheckpointError(
        f"{key!r}: {comp_name} {compressed.shape} and {plain_name} {plain.shape} do not describe a {layout} "
        f"tensor of shape {shape} (both (*batch, ...) with the same batch dims, then 2 sparse dims)."
    )
  batch, (rows, cols), dense_dims = shape[:nb], shape[nb : nb + 2], shape[nb + 2 :]
  nnz = plain.shape[-1]
  block = tuple(values.shape[nb + 1 : nb + 3]) if blocked else (1, 1)
  tail = (*block, *dense_dims) if blocked else dense_dims
  if values.shape != (*batch, nnz, *tail) or min(block, default=0) <= 0 or rows % block[0] or cols % block[1]:
    raise CheckpointError(
        f"{key!r}: {layout} values must have shape (*batch, nnz, {'block rows, block cols, ' if blocked else ''}"
        f"*dense dims) = {(*batch, nnz, *tail)} with blocks dividing ({rows}, {cols}); got {values.shape} "
        f"for shape {shape}."
    )
  grid = (rows // block[0], cols // block[1])
  n_comp, n_plain = grid if by_row else grid[::-1]
  if compressed.shape[-1] != n_comp + 1:
    raise CheckpointError(
        f"{key!r}: {comp_name} must have {n_comp + 1} entries per batch (one more than the "
        f"{'block ' if blocked else ''}{'rows' if by_row else 'columns'}), got {compressed.shape[-1]}."
    )
  count = int(np.prod(batch, dtype=np.int64))
  compressed, plain = compressed.reshape(count, n_comp + 1), plain.reshape(count, nnz)
  values = values.reshape(count, nnz, *block, *dense_dims)
  grid_values = _zeros((count, *grid, *block, *dense_dims), values.dtype, key=key)
  grid_mask = _zeros((count, *grid), bool, key=key)
  for b in range(count):
    where = f"{key} ({comp_name}{f' of batch {b}' if batch else ''})"
    _check_offsets(compressed[b], nnz, key=where)
    _check_index(plain[b], n_plain, key=f"{key} ({plain_name}{f' of batch {b}' if batch else ''})")
    major = np.repeat(np.arange(n_comp), np.diff(compressed[b]))
    r, c = (major, plain[b]) if by_row else (plain[b], major)
    if np.unique(r * grid[1] + c).size != nnz:
      raise CheckpointError(f"{where}: an entry is stored twice in one {'row' if by_row else 'column'}.")
    grid_values[b, r, c] = values[b]
    grid_mask[b, r, c] = True
  # (count, R, C, bh, bw, *dense) -> (*batch, R bh, C bw, *dense)
  order = (0, 1, 3, 2, 4, *range(5, 5 + len(dense_dims)))
  dense = grid_values.transpose(order).reshape(shape)
  mask = np.broadcast_to(grid_mask[:, :, None, :, None], (count, grid[0], block[0], grid[1], block[1]))
  mask = mask.reshape(*batch, rows, cols)
  mask = np.broadcast_to(mask.reshape(*mask.shape, *(1,) * len(dense_dims)), shape).copy()
  return dense, mask


def _decode_hf_block_sparse(src: Mapping, mod: str) -> tuple[np.ndarray, np.ndarray, str]:
  base = f"{mod}.weight."
  data = to_numpy(src[base + "data"], key=base + "data")
  cols = _int_array(src[base + "cols_a"], key=base + "cols_a", ndim=2)
  row_ptr = _int_array(src[base + "row_start_ends_a"], key=base + "row_start_ends_a", ndim=1)
  if base + "col_start_ends_b" not in src:
    raise CheckpointError(
        f"{base}col_start_ends_b is missing: pytorch_block_sparse state dicts carry it, and it gives the "
        "number of block columns (in_features // block width)."
    )
  col_ptr = _int_array(src[base + "col_start_ends_b"], key=base + "col_start_ends_b", ndim=1)
  nnz = cols.shape[0]
  if cols.shape[1] != 2:
    raise CheckpointError(f"{base}cols_a must be (nnz, 2) [block column, data index], got shape {cols.shape}.")
  if data.ndim != 2 or nnz == 0 or data.shape[0] % nnz:
    raise CheckpointError(
        f"{base}data must be 2-D (nnz * block_rows, block_cols) with nnz = len(cols_a) = {nnz}, got shape "
        f"{data.shape}."
    )
  b0, b1 = data.shape[0] // nnz, data.shape[1]
  kb, nb = row_ptr.size - 1, col_ptr.size - 1
  _check_offsets(row_ptr, nnz, key=base + "row_start_ends_a")
  _check_offsets(col_ptr, nnz, key=base + "col_start_ends_b")
  block_col, ptr = cols[:, 0], cols[:, 1]
  _check_index(block_col, nb, key=base + "cols_a[:, 0]")
  if not np.array_equal(np.sort(ptr), np.arange(nnz)):
    raise CheckpointError(f"{base}cols_a[:, 1] must be a permutation of 0..{nnz - 1} (the block order in data).")
  block_row = np.repeat(np.arange(kb), np.diff(row_ptr))
  flat = block_row * nb + block_col
  if np.unique(flat).size != nnz:
    raise CheckpointError(f"{base}cols_a lists the same block twice.")
  # Block i of data holds the transposed (b0, b1) block: reshape to (nnz, b1, b0) and swap back.
  blocks = data.reshape(nnz, b1, b0).transpose(0, 2, 1)
  dense = np.zeros((kb, nb, b0, b1), data.dtype)
  dense[block_row, block_col] = blocks[ptr]
  dense = dense.transpose(0, 2, 1, 3).reshape(kb * b0, nb * b1)
  block_mask = np.zeros((kb, nb), bool)
  block_mask[block_row, block_col] = True
  mask = np.repeat(np.repeat(block_mask, b0, 0), b1, 1)
  if base + "_dense" in src:  # the emulator trains this dense copy and masks it
    emulated = to_numpy(src[base + "_dense"], key=base + "_dense")
    if emulated.shape != dense.shape:
      raise CheckpointError(f"{base}_dense has shape {emulated.shape}; the block indices give {dense.shape}.")
    dense = emulated
  return dense, mask, "pytorch_block_sparse"


def _decode_sparseprop(src: Mapping, mod: str) -> tuple[np.ndarray, np.ndarray, str]:
  p = f"{mod}." if mod else ""
  needed = [f"{p}W_idx.indptr", f"{p}W_idx.indices", f"{p}W_shape"]
  if any(k not in src for k in needed):
    raise CheckpointError(
        f"{p}W_val looks like a SparseProp SparseLinear, whose CSR indices (W_idx) are not part of its "
        "state_dict. Pass the torch module itself to jaxsparse (it reads W_idx, N and M from the module), or "
        f"store them beside W_val as {needed}."
    )
  values = to_numpy(src[f"{p}W_val"], key=f"{p}W_val")
  indptr = _int_array(src[needed[0]], key=needed[0], ndim=1)
  indices = _int_array(src[needed[1]], key=needed[1], ndim=1)
  shape = _int_array(src[needed[2]], key=needed[2], ndim=1)
  if shape.size != 2 or np.any(shape <= 0):
    raise CheckpointError(f"{needed[2]!r} must be [out_features, in_features], got {shape.tolist()}.")
  rows, cols = int(shape[0]), int(shape[1])
  if values.ndim != 1 or indices.size != values.size or indptr.size != rows + 1:
    raise CheckpointError(
        f"{p}W_val/W_idx are not a CSR matrix of shape {(rows, cols)}: {values.size} values, {indices.size} "
        f"column indices, {indptr.size} row offsets (expected {rows + 1})."
    )
  _check_offsets(indptr, values.size, key=needed[0])
  _check_index(indices, cols, key=needed[1])
  row = np.repeat(np.arange(rows), np.diff(indptr))
  if np.unique(row * cols + indices).size != values.size:
    raise CheckpointError(f"{needed[1]!r} lists the same entry twice within a row.")
  dense = np.zeros((rows, cols), values.dtype)
  dense[row, indices] = values
  mask = np.zeros((rows, cols), bool)
  mask[row, indices] = True
  return dense, mask, "SparseProp SparseLinear"


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
        add(_join(mod, "weight"), fields, lambda src, mod=mod: _decode_hf_block_sparse(src, mod))
      else:
        add(_join(mod, "weight"), fields, fail(f"{k!r} looks like pytorch_block_sparse, but {base}data or "
                                               f"{base}row_start_ends_a is missing."))
    elif k == "W_val" or k.endswith(".W_val"):  # SparseProp
      mod = k[: -len("W_val")].rstrip(".")
      fields = tuple(x for x in (_join(mod, "W_idx.indptr"), _join(mod, "W_idx.indices"), _join(mod, "W_shape"))
                     if x in key_set)
      add(_join(mod, "weight"), (k, *fields), lambda src, mod=mod: _decode_sparseprop(src, mod))
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
      add(k, (k,), lambda src, k=k: _decode_dense_tensor(src[k], key=k))
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
  value, inner_mask, inner_fmt = _decode_dense_tensor(src[value_key], key=value_key)
  if inner_mask is not None:
    raise CheckpointError(f"{value_key!r} is a {inner_fmt} tensor; a {fmt} weight must be a dense tensor.")
  raw = to_numpy(src[mask_key] if mask_key is not None else mask, key=mask_key or value_key + " (sparsifier mask)")
  return value, _check_mask(raw, value.shape, key=mask_key or f"sparsifier mask of {value_key}"), fmt


def _nm_for(name: str, nm: NMSpec) -> tuple[int, int] | None:
  if nm is None:
    return None
  if isinstance(nm, Mapping):
    for pattern, spec in nm.items():
      if re.search(pattern, name):
        return tuple(spec)
    return None
  return tuple(nm)


def decode_checkpoint(
    source: Any,
    *,
    nm: NMSpec = None,
    key: str | None = None,
    on_error: str = "raise",
    progress: Callable[[int, int], None] | None = None,
    conv1d: str | None = None,
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

  Returns:
    ``{parameter name: TorchParam}`` in checkpoint order.

  Raises:
    ValueError: ``on_error`` is not ``"raise"`` or ``"collect"``.
    CheckpointError: (a ``ValueError``) ``source`` cannot be read (see :func:`load_state_dict`; also with
      ``on_error="collect"``); with ``on_error="raise"``, a parameter that cannot be decoded (an inconsistent
      sparse format, a name decoded twice, an N:M mask that ``nm`` cannot recompute); the message names the
      file and the keys. Also with ``on_error="collect"``: square weights of unknown layout beside Conv1D ones
      (see ``conv1d``).
    TypeError: ``conv1d`` is not a ``str`` or ``None`` (a ``conv1d`` that does not compile: ``ValueError``).
    ImportError: PyTorch is not installed.
  """
  if on_error not in ("raise", "collect"):
    raise ValueError(f"on_error must be 'raise' or 'collect', got {on_error!r}.")
  check_conv1d(conv1d)
  src = source if isinstance(source, TensorSource) else open_checkpoint(source, key=key)
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
