"""PyTorch tensors to checked NumPy arrays: dense tensors, torch's sparse layouts (COO, CSR, CSC, BSR, BSC, 2:4
semi-structured) and the storage of two projects' sparse layers (huggingface ``pytorch_block_sparse``,
SparseProp), each as dense values and a bool mask in torch layout.

Checkpoints are untrusted input: every index and offset is checked with NumPy before anything is densified (torch.load
does not check them), every tensor and dense form is checked against the memory limit (:mod:`._limits`) before it is
materialised, and every failure is a :class:`~jaxsparse.torch_interop.CheckpointError` naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxsparse.torch_interop._limits import check_size
from jaxsparse.torch_interop._limits import tensor_size
from jaxsparse.torch_interop._load import CheckpointError
from jaxsparse.torch_interop._load import import_torch
from jaxsparse.torch_interop._patterns import nm_mask_torch

__all__ = ["decode_dense_tensor", "decode_hf_block_sparse", "decode_sparseprop", "to_numpy"]


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
  # A mapped file's tensor, or a view whose zero strides stand for far more elements than its storage holds: the copy
  # below materialises all of them.
  check_size(key, tensor_size(t.shape, t.dtype))
  # A conjugate or negative view (``z.conj()``, which torch.save keeps as such) holds its values only lazily.
  t = t.detach().cpu().resolve_conj().resolve_neg()
  try:
    if t.dtype == torch.bfloat16:
      import ml_dtypes  # noqa: PLC0415 -- only for bfloat16 checkpoints; installed with jax

      return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    if t.dtype == torch.bool:
      return t.contiguous().view(torch.uint8).numpy() != 0
    return t.contiguous().numpy().copy()
  except TypeError as e:
    raise CheckpointError(f"{key!r} has dtype {t.dtype}, which jaxsparse cannot convert to NumPy.") from e
  except ValueError as e:  # a dim past NumPy's limits (a file may claim shape (2**62, 0): no bytes, no array)
    raise CheckpointError(f"{key!r} has shape {tuple(t.shape)}, which NumPy cannot hold: {e}") from e


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


def decode_dense_tensor(t: Any, *, key: str) -> tuple[np.ndarray, np.ndarray | None, str]:
  """A plain, torch-sparse or semi-structured tensor."""
  torch = import_torch()
  semi = getattr(torch.sparse, "SparseSemiStructuredTensor", None)
  if semi is not None and isinstance(t, semi):
    check_size(key, tensor_size(t.shape, t.dtype), dense=True)  # its shape is declared, apart from what it stores
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
  """The dense form of a sparse tensor, checked against the memory limit first (its shape comes from the file)."""
  check_size(key, tensor_size(shape, np.dtype(dtype)), dense=True)
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
  check_size(key, tensor_size(shape, values.dtype), dense=True)
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


def decode_hf_block_sparse(src: Mapping, mod: str) -> tuple[np.ndarray, np.ndarray, str]:
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
  if not np.array_equal(np.diff(col_ptr), np.bincount(block_col, minlength=nb)):
    raise CheckpointError(
        f"{base}col_start_ends_b must count the blocks of each block column that cols_a lists "
        f"({np.bincount(block_col, minlength=nb)[:8].tolist()}...), got the counts {np.diff(col_ptr)[:8].tolist()}...."
    )
  if not np.array_equal(np.sort(ptr), np.arange(nnz)):
    raise CheckpointError(f"{base}cols_a[:, 1] must be a permutation of 0..{nnz - 1} (the block order in data).")
  block_row = np.repeat(np.arange(kb), np.diff(row_ptr))
  flat = block_row * nb + block_col
  if np.unique(flat).size != nnz:
    raise CheckpointError(f"{base}cols_a lists the same block twice.")
  # Block i of data holds the transposed (b0, b1) block: reshape to (nnz, b1, b0) and swap back.
  blocks = data.reshape(nnz, b1, b0).transpose(0, 2, 1)
  check_size(base + "data", tensor_size((kb * b0, nb * b1), data.dtype), dense=True)
  dense = _zeros((kb, nb, b0, b1), data.dtype, key=base + "data")
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


def decode_sparseprop(src: Mapping, mod: str) -> tuple[np.ndarray, np.ndarray, str]:
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
  dense = _zeros((rows, cols), values.dtype, key=needed[2])
  dense[row, indices] = values
  mask = _zeros((rows, cols), bool, key=needed[2])
  mask[row, indices] = True
  return dense, mask, "SparseProp SparseLinear"
