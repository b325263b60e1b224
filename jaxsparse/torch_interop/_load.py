"""Reading PyTorch checkpoints safely: safetensors, or ``torch.load(weights_only=True)``, never pickled code.

A checkpoint comes in as a path, an in-memory state dict or a ``torch.nn.Module`` and leaves as a flat
``{dotted key: torch.Tensor}`` mapping. Training wrappers (``{"state_dict": ...}``, ``{"model": ...}``)
and ``module.`` / ``_orig_mod.`` prefixes are removed here, so the decoders only see parameter names.
Files are untrusted input: every failure names the file and says what was expected, and what a file declares is
checked against the memory limit (:mod:`._limits`) from its header or metadata before any of it is read.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxsparse.torch_interop._errors import CheckpointError
from jaxsparse.torch_interop._limits import SAFETENSORS_MAX_HEADER
from jaxsparse.torch_interop._limits import TensorSize
from jaxsparse.torch_interop._limits import check_size
from jaxsparse.torch_interop._limits import check_sizes
from jaxsparse.torch_interop._limits import limit_scope
from jaxsparse.torch_interop._limits import over_limit
from jaxsparse.torch_interop._limits import resolve_limit
from jaxsparse.torch_interop._limits import safetensors_sizes
from jaxsparse.torch_interop._limits import tensor_size

__all__ = ["CheckpointError", "TensorSource", "import_torch", "load_state_dict", "open_checkpoint", "to_torch"]

# Keys under which training scripts nest the model's state dict, tried in this order.
WRAPPER_KEYS = ("state_dict", "model_state_dict", "model", "module", "net", "network")
# Prefixes added by DataParallel / DistributedDataParallel and torch.compile.
STRIPPED_PREFIXES = ("module.", "_orig_mod.")
# Key under which a checkpoint may carry ``torch.ao.pruning`` sparsifier state (``sparsifier.state_dict()``).
SPARSIFIER_KEYS = ("sparsifier", "sparsifier_state_dict")


def import_torch():
  """Imports torch on first use; jaxsparse itself never needs it."""
  try:
    import torch  # noqa: PLC0415 -- optional dependency, imported only when torch_interop is used
  except ImportError as e:
    raise ImportError(
        "jaxsparse.torch_interop needs PyTorch: install it with `pip install torch` (on a CPU-only machine "
        "pin the CPU wheel first, e.g. `pip install torch==2.13.0`), then `pip install 'jaxsparse[torch]'`."
    ) from e
  return torch


def to_torch(value: Any, *, key: str):
  """``value`` (torch tensor, NumPy or JAX array) as a torch tensor; bfloat16 survives the trip."""
  torch = import_torch()
  if isinstance(value, torch.Tensor):
    return value
  if hasattr(value, "__array__") or isinstance(value, np.ndarray | np.generic):
    arr = np.asarray(value)
    if arr.dtype != object:  # a broadcast view (zero strides) is copied whole below
      check_size(key, tensor_size(arr.shape, arr.dtype))
    if arr.dtype.name == "bfloat16":  # ml_dtypes bfloat16: NumPy cannot hand it to torch directly.
      return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint16).astype(np.int16)).view(torch.bfloat16)
    if arr.dtype == object or arr.dtype.kind not in "biuf":
      raise CheckpointError(f"{key!r} holds an array of dtype {arr.dtype}; expected a numeric or boolean tensor.")
    return torch.from_numpy(np.array(arr, copy=True))
  raise CheckpointError(
      f"{key!r} holds a {type(value).__name__}, not a tensor; a state dict maps parameter names to tensors."
  )


class TensorSource(Mapping):
  """A read-only ``{key: torch.Tensor}`` view that loads each tensor when it is first asked for.

  Safetensors files are opened lazily (one tensor at a time, so ``jaxsparse inspect`` can show progress on
  large files); everything else is already in memory.

  Attributes:
    origin: the file name or a short description (``"state dict"``), used in error messages.
    nbytes: total bytes of the tensors, when known cheaply (else 0).
    sizes: ``{key: TensorSize}``: each tensor's shape, dtype and bytes in dense form (a torch sparse tensor's dense
      shape), from the header or the tensor's metadata, for the memory limit (:mod:`._limits`) of the readers.
    extras: ``torch.ao.pruning`` sparsifier masks found next to the model, ``{tensor_fqn: mask}``.
    module_types: for a ``torch.nn.Module`` source, ``{module path: its class}`` (paths as the keys have them,
      prefixes removed); empty for a state dict or a file, which do not say what their modules are.
    shared: ``{key: the other keys holding the very same tensor}`` (the same view of the same memory: tied weights,
      as a tied model's ``lm_head.weight`` and ``embed_tokens.weight``) for torch tensors in memory (a module, a
      state dict, a ``torch.save`` file, which keeps the sharing); empty for safetensors, which stores tensors apart.
  """

  def __init__(self, keys: list[str], get: Callable[[str], Any], *, origin: str, nbytes: int = 0, extras=None,
               module_types=None, sizes: Mapping[str, TensorSize] | None = None,
               shared: Mapping[str, tuple[str, ...]] | None = None):
    self._keys = list(keys)
    self._key_set = set(self._keys)
    self._get = get
    self.origin = origin
    self.nbytes = nbytes
    self.extras = dict(extras or {})
    self.module_types = dict(module_types or {})
    self.sizes = dict(sizes or {})
    self.shared = dict(shared or {})

  def __getitem__(self, key: str):
    if key not in self._key_set:
      raise KeyError(key)
    return self._get(key)

  def __iter__(self) -> Iterator[str]:
    return iter(self._keys)

  def __len__(self) -> int:
    return len(self._keys)


def _strip_prefixes(keys: list[str]) -> tuple[str, dict[str, str]]:
  """``(removed prefix, {new key: old key})``: wrapper prefixes shared by every key removed."""
  mapping = {k: k for k in keys}
  removed = ""
  changed = True
  while changed and mapping:
    changed = False
    for prefix in STRIPPED_PREFIXES:
      if all(k.startswith(prefix) for k in mapping):
        mapping = {k[len(prefix) :]: v for k, v in mapping.items()}
        removed += prefix
        changed = True
  return removed, mapping


def _is_tensor_like(value: Any) -> bool:
  torch = import_torch()
  return isinstance(value, torch.Tensor | np.ndarray) or (hasattr(value, "__array__") and not isinstance(value, str))


def _sparsifier_masks(obj: Mapping, origin: str) -> dict[str, Any]:
  """Masks of a ``torch.ao.pruning`` sparsifier state dict ``{"state": {fqn: {"mask": t}}, "groups": ...}``."""
  state = obj.get("state")
  if not isinstance(state, Mapping):
    raise CheckpointError(
        f"{origin}: the sparsifier entry must be `sparsifier.state_dict()` with a 'state' mapping "
        f"{{tensor_fqn: {{'mask': tensor}}}}, got keys {sorted(map(str, obj))}."
    )
  masks = {}
  for fqn, entry in state.items():
    if not isinstance(entry, Mapping) or "mask" not in entry:
      raise CheckpointError(f"{origin}: sparsifier state for {fqn!r} has no 'mask'; expected {{'mask': tensor}}.")
    masks[str(fqn)] = to_torch(entry["mask"], key=f"sparsifier state {fqn}.mask")
  return masks


def _unwrap(obj: Any, origin: str, key: str | None) -> tuple[Mapping, dict[str, Any]]:
  """The flat state dict inside a loaded checkpoint object, and any sparsifier masks beside it."""
  if key is not None:
    for part in key.split("."):
      if not isinstance(obj, Mapping) or part not in obj:
        found = sorted(map(str, obj)) if isinstance(obj, Mapping) else type(obj).__name__
        raise CheckpointError(f"{origin}: key={key!r} not found (no {part!r}; available: {found}).")
      obj = obj[part]
  extras: dict[str, Any] = {}
  for _ in range(4):  # nesting depth of real training checkpoints
    if not isinstance(obj, Mapping):
      raise CheckpointError(
          f"{origin} holds a {type(obj).__name__}, not a state dict (a mapping of names to tensors). Save "
          "`model.state_dict()` rather than the model object."
      )
    for sk in SPARSIFIER_KEYS:
      if isinstance(obj.get(sk), Mapping):
        extras.update(_sparsifier_masks(obj[sk], origin))
    if obj and all(_is_tensor_like(v) for v in obj.values()):
      return obj, extras
    inner = next((k for k in WRAPPER_KEYS if isinstance(obj.get(k), Mapping)), None)
    if inner is None:
      break
    obj = obj[inner]
  if isinstance(obj, Mapping) and obj:
    tensors = {k: v for k, v in obj.items() if _is_tensor_like(v)}
    others = sorted(str(k) for k in obj if k not in tensors and not str(k).endswith("_extra_state"))
    if tensors and not others:
      return tensors, extras
    if tensors:
      raise CheckpointError(
          f"{origin}: a state dict maps names to tensors, but {others[:5]} hold non-tensor values. If the state "
          f"dict is nested under one of those keys, pass key=... (e.g. key={others[0]!r})."
      )
  found = sorted(map(str, obj))[:10] if isinstance(obj, Mapping) else []
  raise CheckpointError(
      f"{origin}: found no state dict. Expected a mapping of parameter names to tensors, possibly nested under "
      f"one of {WRAPPER_KEYS}; top-level keys are {found}. Pass key=... to select the entry that holds it."
  )


def _sparseprop_extras(module) -> dict[str, Any]:
  """CSR indices of SparseProp ``SparseLinear`` modules, which keep them outside ``state_dict()``."""
  torch = import_torch()
  extras = {}
  for name, mod in module.named_modules():
    idx = getattr(mod, "W_idx", None)
    if getattr(mod, "W_val", None) is None or idx is None:
      continue
    prefix = f"{name}." if name else ""
    if not (isinstance(idx, tuple | list) and len(idx) == 2 and hasattr(mod, "N") and hasattr(mod, "M")):
      raise CheckpointError(
          f"module {name!r} ({type(mod).__name__}) has SparseProp-style W_val/W_idx but not the SparseLinear "
          "layout (W_idx = (indptr, indices), N, M); SparseProp's SparseConv2d is not supported."
      )
    extras[f"{prefix}W_idx.indptr"] = idx[0]
    extras[f"{prefix}W_idx.indices"] = idx[1]
    extras[f"{prefix}W_shape"] = torch.tensor([int(mod.N), int(mod.M)], dtype=torch.int64)
  return extras


def _fake_sparsity_masks(module) -> dict[str, Any]:
  """Masks of ``torch.ao.pruning`` ``FakeSparsity`` parametrizations, which keep them outside ``state_dict()``.

  Keyed ``{mod}.parametrizations.{p}.0.mask``, beside the ``.original`` the state dict has. A parametrized tensor
  whose parametrizations are not one ``FakeSparsity`` raises: its weight is not ``original * mask``, and nothing
  else here reads it.
  """
  torch = import_torch()
  fake = getattr(torch.ao.pruning, "FakeSparsity", None)
  masks = {}
  for name, mod in module.named_modules():
    lists = getattr(mod, "parametrizations", None)
    if not isinstance(lists, torch.nn.ModuleDict):
      continue
    for p, plist in lists.items():
      kinds = [type(q).__name__ for q in plist]
      if fake is None or len(plist) != 1 or not isinstance(plist[0], fake):
        raise CheckpointError(
            f"module {name!r} ({type(mod).__name__}) parametrizes {p!r} with {kinds}; jaxsparse reads one "
            "torch.ao.pruning FakeSparsity (weight = original * mask). Bake them into the weight first: "
            f"torch.nn.utils.parametrize.remove_parametrizations(model.get_submodule({name!r}), {p!r})."
        )
      masks[f"{name}.parametrizations.{p}.0.mask" if name else f"parametrizations.{p}.0.mask"] = plist[0].mask
  return masks


def _open_safetensors(path: str) -> TensorSource:
  try:
    from safetensors import safe_open  # noqa: PLC0415 -- optional dependency
  except ImportError as e:
    raise ImportError("Reading .safetensors files needs `pip install safetensors`.") from e
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
  header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
  if header_len <= 0 or header_len > min(SAFETENSORS_MAX_HEADER, size - 8):
    raise CheckpointError(
        f"{path} is not a valid safetensors file: it is {size} bytes but its header claims "
        f"{header_len} bytes (truncated or not a safetensors file)."
    )
  # Before safe_open, which maps the whole file: its header may declare far more than this machine holds.
  sizes = safetensors_sizes(path) or {}
  check_sizes(sizes, origin=path)
  try:
    handle = safe_open(path, framework="pt")
    keys = list(handle.keys())
    nbytes = size - 8 - header_len
  except Exception as e:  # safetensors raises its own error type for malformed files
    raise CheckpointError(f"{path} is not a valid safetensors file (truncated or corrupt?): {e}") from e

  def get(key: str):
    try:
      return handle.get_tensor(key)
    except Exception as e:
      raise CheckpointError(f"{path}: cannot read tensor {key!r} (truncated or corrupt file?): {e}") from e

  _, mapping = _strip_prefixes(keys)
  return TensorSource(list(mapping), lambda k: get(mapping[k]), origin=path, nbytes=nbytes,
                      sizes={k: sizes[old] for k, old in mapping.items() if old in sizes})


_UNPICKLER_ERROR = "WeightsUnpickler error:"
# Lines of torch's weights-only errors that give advice (rerun with weights_only=False, allowlist globals).
_TORCH_ADVICE = ("Weights only load failed", "(1)", "(2)", "Please file an issue", "Check the documentation")


def _torch_reason(msg: str) -> str:
  """What failed, from a ``torch.load`` error: the weights-only unpickler's own error, not the advice around it."""
  lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
  reason = next((ln for ln in lines if not ln.startswith(_TORCH_ADVICE)), lines[0] if lines else "")
  for i, ln in enumerate(lines):
    if _UNPICKLER_ERROR in ln:
      reason = ln.split(_UNPICKLER_ERROR, 1)[1].strip() or (lines[i + 1] if i + 1 < len(lines) else ln)
      break
  return reason.split(" Please use ")[0]


def _torch_load(path: str) -> Any:
  torch = import_torch()
  zipped = _is_zip(path)
  limit = resolve_limit()
  size = os.path.getsize(path)
  if not zipped and limit.nbytes is not None and size > limit.nbytes:
    # The legacy (non-zip) format cannot be mapped: torch.load reads every storage it lists, up to the whole file.
    raise CheckpointError(f"{path} is a legacy (non-zip) torch.save file of {size:,} bytes, all of which torch.load "
                          f"may read into memory: {over_limit(limit)}")
  try:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
  except pickle.UnpicklingError as e:
    msg, reason = str(e), _torch_reason(str(e))
    protocol = _pickle_protocol(path) if "Unsupported operand" in msg else None
    if protocol is not None and protocol >= 4:
      raise CheckpointError(
          f"{path} holds a pickle of protocol {protocol} (torch.save(..., pickle_protocol={protocol}), or "
          "pickle.dump): jaxsparse loads checkpoints only with torch.load(weights_only=True), which never runs code "
          "from the file and does not read the FRAME opcode of protocols 4 and 5. Re-save it with torch.save's "
          "default protocol (torch.save(state_dict, path)) or as safetensors (safetensors.torch.save_file(state_dict, "
          f"path)), from a trusted environment. torch said: {reason}"
      ) from e
    # The weights-only unpickler words every failure alike; an opcode it does not know means bytes that are no
    # pickle (a NumPy file, JSON, garbage), not a pickle that needs code.
    if ("Weights only load failed" in msg or "weights_only" in msg) and "Unsupported operand" not in msg:
      raise CheckpointError(
          f"{path} needs arbitrary pickled Python code to load, and jaxsparse only loads checkpoints with "
          "torch.load(weights_only=True), which never runs code from the file. Re-save the weights as plain "
          "tensors, e.g. torch.save(model.state_dict(), ...) or safetensors.torch.save_file(...), from a "
          f"trusted environment. torch said: {reason}"
      ) from e
    raise CheckpointError(
        f"{path} is not a readable PyTorch checkpoint (truncated, corrupt or another format?): torch.load failed: "
        f"{reason}"
    ) from e
  except Exception as e:  # untrusted bytes: torch.load can fail in many ways (struct.error, zip errors, ...)
    first = f"{type(e).__name__}: {str(e).splitlines()[0]}" if str(e) else type(e).__name__
    raise CheckpointError(
        f"{path} is not a readable PyTorch checkpoint (truncated, corrupt or another format?): {first}"
    ) from e


def _pickle_protocol(path: str) -> int | None:
  """The protocol a ``torch.save`` file's pickle declares (its ``data.pkl`` in a zip file, else the file's first
  bytes), from the PROTO opcode it starts with; ``None`` where there is none to read. Only for the message: the
  pickle itself is never loaded here."""
  try:
    if _is_zip(path):
      with zipfile.ZipFile(path) as z:
        name = next((n for n in z.namelist() if n.rpartition("/")[2] == "data.pkl"), None)
        if name is None:
          return None
        with z.open(name) as f:
          head = f.read(2)
    else:
      with open(path, "rb") as f:
        head = f.read(2)
  except Exception:  # untrusted bytes, read for a diagnosis only: any failure keeps the plain message
    return None
  return head[1] if len(head) == 2 and head[0] == pickle.PROTO[0] else None


def _is_zip(path: str) -> bool:
  with open(path, "rb") as f:
    return f.read(4) == b"PK\x03\x04"


def _looks_like_safetensors(path: str) -> bool:
  with open(path, "rb") as f:
    head = f.read(9)
  return len(head) == 9 and head[8:9] == b"{"


def _sizes(tensors: Mapping[str, Any]) -> dict[str, TensorSize]:
  """``{key: TensorSize}`` of in-memory (or mapped) tensors at their dense size, from their shape and dtype alone
  (never their data); tensors without data (meta, nested) are left out."""
  sizes = {}
  for key, value in tensors.items():
    if getattr(value, "is_nested", False) or getattr(value, "is_meta", False):
      continue
    try:
      sizes[key] = tensor_size(value.shape, value.dtype)
    except (AttributeError, TypeError, ValueError, RuntimeError):
      continue
  return sizes


def _shared(tensors: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
  """``{key: the other keys}`` of the torch tensors that are one view of one memory (tied weights), from their
  storage pointers, offsets, shapes and strides (never their data)."""
  torch = import_torch()
  views: dict[tuple, list[str]] = {}
  for key, t in tensors.items():
    if not isinstance(t, torch.Tensor) or t.is_nested or t.is_meta or t.layout != torch.strided:
      continue
    try:
      ptr = t.untyped_storage().data_ptr()
      view = (str(t.device), ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
    except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without a plain storage
      continue
    if ptr and t.numel():
      views.setdefault(view, []).append(key)
  return {k: tuple(o for o in keys if o != k) for keys in views.values() if len(keys) > 1 for k in keys}


def open_checkpoint(source: Any, *, key: str | None = None, max_bytes: int | None = None) -> TensorSource:
  """Opens a checkpoint as a lazy :class:`TensorSource` (see :func:`load_state_dict` for the arguments)."""
  with limit_scope(max_bytes):
    return _open_checkpoint(source, key=key)


def _open_checkpoint(source: Any, *, key: str | None) -> TensorSource:
  torch = import_torch()
  types: dict[str, type] = {}
  from_file = isinstance(source, str | os.PathLike)
  if from_file:
    path = os.fspath(source)
    if os.path.isdir(path):
      raise CheckpointError(f"{path} is a directory; pass the checkpoint file inside it (e.g. model.safetensors).")
    if not os.path.exists(path):
      raise CheckpointError(f"{path} does not exist.")
    if os.path.getsize(path) == 0:
      raise CheckpointError(f"{path} is empty (0 bytes); expected a .safetensors or torch.save checkpoint.")
    if path.endswith(".json"):
      raise CheckpointError(
          f"{path} is a JSON file, not a checkpoint. jaxsparse does not read sharded checkpoints through their index "
          "(model.safetensors.index.json): pass one shard file, or merge the shards into one file first."
      )
    if path.endswith(".safetensors") or _looks_like_safetensors(path):
      if key is not None:
        raise CheckpointError(f"{path}: key={key!r} applies to nested torch.save checkpoints, not safetensors.")
      return _open_safetensors(path)
    obj = _torch_load(path)
    origin = path
  elif isinstance(source, torch.nn.Module):
    obj = {**source.state_dict(), **_sparseprop_extras(source), **_fake_sparsity_masks(source)}
    origin = f"{type(source).__name__} module"
    types = {name: type(mod) for name, mod in source.named_modules()}
  elif isinstance(source, Mapping):
    obj = source
    origin = "state dict"
  else:
    raise TypeError(
        f"source must be a path, a state dict (mapping of names to tensors) or a torch.nn.Module, got "
        f"{type(source).__name__}."
    )
  flat, extras = _unwrap(obj, origin, key)
  removed, mapping = _strip_prefixes([str(k) for k in flat])
  original = {str(k): k for k in flat}
  tensors = {k: flat[original[old]] for k, old in mapping.items()}
  sizes = _sizes(tensors)
  strided = {k: size for k, size in sizes.items() if getattr(tensors[k], "layout", torch.strided) == torch.strided}
  if from_file:
    # Mapped, not read yet: reading a tensor (or a view whose zero strides expand 4 bytes to 160 GB) copies it whole.
    check_sizes(strided, origin=origin)
  nbytes = sum(size.nbytes for size in strided.values())
  return TensorSource(
      list(mapping),
      lambda k: to_torch(tensors[k], key=k),
      origin=origin,
      nbytes=nbytes,
      extras={(f[len(removed) :] if f.startswith(removed) else f): m for f, m in extras.items()},
      module_types={(n[len(removed) :] if n.startswith(removed) else n): t for n, t in types.items()},
      sizes=sizes,
      shared=_shared(tensors),
  )


def load_state_dict(source: Any, *, key: str | None = None, max_bytes: int | None = None) -> dict[str, Any]:
  """Loads a PyTorch checkpoint as a flat ``{name: torch.Tensor}`` dict, without running pickled code.

  >>> import torch
  >>> from jaxsparse import torch_interop
  >>> sd = torch_interop.load_state_dict({"model": {"module.fc.weight": torch.ones(2, 3)}, "epoch": 3})
  >>> {k: tuple(v.shape) for k, v in sd.items()}
  {'fc.weight': (2, 3)}

  Args:
    source: a ``.safetensors`` file, a ``torch.save`` file (``.pt``/``.pth``/``.bin``, read with
      ``torch.load(weights_only=True)`` only: a file that needs pickled code is refused), an in-memory
      state dict (torch tensors or NumPy/JAX arrays), or a ``torch.nn.Module`` (its ``state_dict()``
      plus what it keeps outside it: the CSR indices of SparseProp ``SparseLinear`` modules, and the mask of
      each ``torch.ao.pruning`` ``FakeSparsity`` parametrization as ``{mod}.parametrizations.{p}.0.mask``).
    key: dotted path of the state dict inside a nested checkpoint; by default the first of
      ``state_dict``, ``model_state_dict``, ``model``, ``module``, ``net``, ``network`` that holds one.
    max_bytes: the most bytes a file's tensors may take, each and all together, as their header or metadata
      declares them (checked before any is read); ``None``: ``$JAXSPARSE_CHECKPOINT_MAX_BYTES`` (bytes, or ``none``
      for no limit), else this machine's physical memory. Tensors come back mapped from the file, read when used.

  Returns:
    ``{name: torch.Tensor}`` with ``module.`` / ``_orig_mod.`` prefixes shared by all keys removed.

  Raises:
    CheckpointError: a missing, empty, truncated or non-checkpoint file, a file that needs pickled code, a
      ``torch.save`` file or pickle of protocol 4 or 5 (which the weights-only loader does not read: the message says
      to re-save it with the default protocol or as safetensors), or no state dict inside it; a module with a
      parametrized tensor whose parametrizations are not one ``torch.ao.pruning`` ``FakeSparsity``; a file declaring
      more than ``max_bytes`` (a tensor, or all together: a sparse file, a view whose zero strides expand it); the
      message names the tensor, its shape, dtype and bytes.
    TypeError: ``max_bytes`` is not an int or ``None``.
    ValueError: ``max_bytes`` < 1, or ``$JAXSPARSE_CHECKPOINT_MAX_BYTES`` is neither a positive int nor ``none``.
  """
  src = open_checkpoint(source, key=key, max_bytes=max_bytes)
  return {k: src[k] for k in src}
