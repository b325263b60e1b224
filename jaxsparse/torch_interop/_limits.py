"""How many bytes one checkpoint load may bring into memory, checked from headers and shapes before any is read.

A file can declare tensors its data does not hold: a safetensors header over a sparse file (``truncate``: huge, on no
disk), a ``torch.save`` view with zero strides (a 1 KB file that expands to 160 GB), a torch sparse tensor or
``pytorch_block_sparse`` / SparseProp layer whose dense shape is huge while its stored arrays are tiny. Read as they
are, such files exhaust memory: the process dies in an allocation or is killed by the OOM killer. So every reader
compares the bytes it is about to materialise (each tensor, each dense form of a sparse one, and all tensors of one
load together) with a limit and raises a :class:`CheckpointError` instead.

The limit, first to last: the ``max_bytes=`` of the public reader; ``$JAXSPARSE_CHECKPOINT_MAX_BYTES`` (bytes, or
``none`` for no limit); this machine's physical memory (no limit where the platform does not report it).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
import os
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

from jaxsparse.torch_interop._errors import CheckpointError

__all__ = [
    "ENV_MAX_BYTES",
    "Limit",
    "TensorSize",
    "check_size",
    "check_sizes",
    "check_total",
    "limit_scope",
    "over_limit",
    "physical_memory",
    "resolve_limit",
    "safetensors_sizes",
    "tensor_size",
]

ENV_MAX_BYTES = "JAXSPARSE_CHECKPOINT_MAX_BYTES"
SAFETENSORS_MAX_HEADER = 100 * 2**20
# Bits per element of each safetensors dtype (F4 / F6 pack several elements into a byte).
_SAFETENSORS_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
                     "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64,
                     "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
_HOW = (f"If the checkpoint is genuine and this machine can hold it, raise the limit: max_bytes=BYTES (CLI: "
        f"--max-bytes BYTES) or the environment variable {ENV_MAX_BYTES}=BYTES ('none' turns the check off).")


class TensorSize(NamedTuple):
  """A tensor as its header or metadata declares it: ``shape``, ``dtype`` (its name) and the bytes it takes."""

  shape: tuple[int, ...]
  dtype: str
  nbytes: int


def tensor_size(shape: Any, dtype: Any, bits: int | None = None) -> TensorSize:
  """The :class:`TensorSize` of a ``shape`` of ``dtype`` (a NumPy / torch dtype; or a name with its ``bits``)."""
  shape = tuple(int(d) for d in shape)
  if bits is None:
    bits = 8 * int(dtype.itemsize)
  name = str(dtype).removeprefix("torch.")
  return TensorSize(shape, name, -(-math.prod(shape) * bits // 8))


@dataclasses.dataclass(frozen=True)
class Limit:
  """The most bytes one load may materialise (``None``: no limit) and where that number comes from."""

  nbytes: int | None
  source: str


_scoped: contextvars.ContextVar[Limit | None] = contextvars.ContextVar("jaxsparse_checkpoint_limit", default=None)


def physical_memory() -> int | None:
  """This machine's physical memory in bytes, or ``None`` where the platform does not report it (Windows)."""
  try:
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
  except (AttributeError, ValueError, OSError):
    return None
  return pages * page_size if pages > 0 and page_size > 0 else None


def resolve_limit(max_bytes: int | None = None) -> Limit:
  """The limit a reader applies: ``max_bytes``, else that of an enclosing :func:`limit_scope` (a public reader
  calling another), else ``$JAXSPARSE_CHECKPOINT_MAX_BYTES``, else the physical memory.

  Raises:
    TypeError: ``max_bytes`` is not an int or ``None``.
    ValueError: ``max_bytes`` < 1, or ``$JAXSPARSE_CHECKPOINT_MAX_BYTES`` is neither a positive int nor ``none``.
  """
  if max_bytes is not None:
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool):
      raise TypeError(f"max_bytes must be an int (bytes) or None, got {max_bytes!r}.")
    if max_bytes < 1:
      raise ValueError(f"max_bytes must be >= 1 byte, got {max_bytes}.")
    return Limit(max_bytes, f"max_bytes={max_bytes}")
  scoped = _scoped.get()
  if scoped is not None:
    return scoped
  raw = os.environ.get(ENV_MAX_BYTES, "").strip()
  if raw.lower() == "none":
    return Limit(None, f"${ENV_MAX_BYTES}=none")
  if raw:
    try:
      value = int(raw)
    except ValueError:
      value = 0
    if value < 1:
      raise ValueError(f"${ENV_MAX_BYTES} must be a positive number of bytes or 'none', got {raw!r}.")
    return Limit(value, f"${ENV_MAX_BYTES}={raw}")
  return Limit(physical_memory(), "this machine's physical memory")


@contextlib.contextmanager
def limit_scope(max_bytes: int | None = None) -> Iterator[Limit]:
  """Resolves the limit once (:func:`resolve_limit`) and makes it the one of every check inside the block."""
  token = _scoped.set(resolve_limit(max_bytes))
  try:
    yield _scoped.get()
  finally:
    _scoped.reset(token)


def _gib(nbytes: int) -> str:
  return f"{nbytes / 2**30:.1f} GiB"


def over_limit(limit: Limit) -> str:
  """The end of a message: the limit, where it comes from and how to raise it."""
  return f"over the limit of {limit.nbytes:,} bytes ({_gib(limit.nbytes)}; {limit.source}). {_HOW}"


def check_size(key: str, size: TensorSize, *, dense: bool = False, limit: Limit | None = None) -> None:
  """Raises a :class:`CheckpointError` naming ``key`` when ``size`` (its dense form: ``dense``) is over the limit."""
  limit = limit or resolve_limit()
  if limit.nbytes is not None and size.nbytes > limit.nbytes:
    raise CheckpointError(
        f"{key!r}: its {'dense ' if dense else ''}shape {size.shape} of {size.dtype} takes {size.nbytes:,} bytes "
        f"({_gib(size.nbytes)}), which does not fit in memory: {over_limit(limit)}"
    )


def check_total(sizes: Mapping[str, TensorSize], *, origin: str, limit: Limit | None = None) -> None:
  """Raises a :class:`CheckpointError` when the tensors of one load are over the limit together."""
  limit = limit or resolve_limit()
  total = sum(s.nbytes for s in sizes.values())
  if limit.nbytes is not None and total > limit.nbytes:
    largest = sorted(sizes.items(), key=lambda kv: -kv[1].nbytes)[:3]
    listing = ", ".join(f"{k!r} {s.shape} of {s.dtype} ({s.nbytes:,} bytes)" for k, s in largest)
    raise CheckpointError(
        f"{origin}: its {len(sizes)} tensors take {total:,} bytes ({_gib(total)}) together, which does not fit in "
        f"memory (the largest: {listing}): {over_limit(limit)}"
    )


def check_sizes(sizes: Mapping[str, TensorSize], *, origin: str, limit: Limit | None = None,
                total: bool = True) -> None:
  """:func:`check_size` of each tensor (the message prefixed with ``origin``), then (``total``) :func:`check_total`."""
  limit = limit or resolve_limit()
  for key, size in sizes.items():
    try:
      check_size(key, size, limit=limit)
    except CheckpointError as e:
      raise CheckpointError(f"{origin}: {e}") from None
  if total:
    check_total(sizes, origin=origin, limit=limit)


def safetensors_sizes(path: str | os.PathLike) -> dict[str, TensorSize] | None:
  """``{name: TensorSize}`` of the tensors a safetensors file declares, read from its header alone (no data, no
  mmap); ``None`` for a file whose header cannot be read (safetensors says what is wrong when it opens it).

  Entries whose dtype or shape is not valid are left out, for the same reason.
  """
  try:
    with open(path, "rb") as f:
      head = f.read(8)
      length = int.from_bytes(head, "little") if len(head) == 8 else -1
      if length <= 0 or length > min(SAFETENSORS_MAX_HEADER, os.fstat(f.fileno()).st_size - 8):
        return None
      header = json.loads(f.read(length))
  except (OSError, ValueError):  # json's errors (and UnicodeDecodeError) are ValueErrors
    return None
  if not isinstance(header, dict):
    return None
  sizes = {}
  for name, entry in header.items():
    if name == "__metadata__" or not isinstance(entry, dict):
      continue
    shape, bits = entry.get("shape"), _SAFETENSORS_BITS.get(entry.get("dtype"))
    if bits is None or not isinstance(shape, list):
      continue
    if all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
      sizes[name] = tensor_size(shape, entry["dtype"], bits)
  return sizes
