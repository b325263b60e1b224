"""Writing converted Flax variables atomically (safetensors or orbax) and reading them back."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse._utils import atomic_write
from jaxsparse.torch_interop._limits import TensorSize
from jaxsparse.torch_interop._limits import check_sizes
from jaxsparse.torch_interop._limits import limit_scope
from jaxsparse.torch_interop._limits import safetensors_sizes
from jaxsparse.torch_interop._limits import tensor_size
from jaxsparse.torch_interop._linen_entries import unboxed
from jaxsparse.torch_interop._load import CheckpointError
from jaxsparse.torch_interop._load import import_torch
from jaxsparse.torch_interop._load import to_torch
from jaxsparse.torch_interop._tensors import to_numpy

__all__ = ["load_flax_variables", "save_flax_variables"]

SEP = "/"


def _flatten(tree: Mapping, prefix: tuple[str, ...] = ()) -> dict[str, Any]:
  out = {}
  for k, v in tree.items():
    k = str(k)
    if SEP in k:
      raise CheckpointError(f"variable name {k!r} contains {SEP!r}, which separates path parts in the file.")
    if isinstance(v, Mapping):
      out.update(_flatten(v, (*prefix, k)))
    else:
      out[SEP.join((*prefix, k))] = v
  return out


def _array(key: str, value: Any) -> np.ndarray:
  """A leaf as the NumPy array the file stores (a sharded array gathered); anything else raises, naming ``key``."""
  arr = np.asarray(value)
  if arr.dtype == object or not (arr.dtype == np.bool_ or jnp.issubdtype(arr.dtype, jnp.number)):
    raise CheckpointError(f"{key!r} holds {type(value).__name__} of dtype {arr.dtype}; expected a numeric or boolean "
                          "array.")
  return arr


def save_flax_variables(variables: Mapping, path: str | os.PathLike, *, format: str | None = None) -> str:
  """Writes nested Flax variables to ``path``; a failure leaves no partial file behind.

  Safetensors keys are the variable paths joined by ``/`` (``"params/encoder/layer/0/kernel"``). Orbax
  output is the standard idiom, ``orbax.checkpoint.StandardCheckpointer().save(path, variables)`` of the
  nested variables, so it restores into a Linen target, concrete or abstract::

      abstract = jax.eval_shape(model.init, jax.random.key(0), x)   # no memory, may carry shardings
      variables = ocp.StandardCheckpointer().restore(path, abstract)

  Linen variables in sharding boxes (``nn.with_partitioning`` / ``nn.with_logical_partitioning`` params, the
  ``"sparsity"`` variables of jaxsparse layers built with such a kernel, a bridged layer's ``NNXMeta``) are saved
  unboxed: the file holds each box's array under the variable's own path, as for unboxed variables (the boxes'
  names are not stored; they come from the model). Loaded, they can be used as they are (``model.apply`` takes
  unboxed variables), placed as the model names them, or boxed again::

      abstract = jax.eval_shape(model.init, jax.random.key(0), x)   # boxed: the names
      placed = jax.device_put(load_flax_variables(path), nn.get_sharding(abstract, mesh))
      is_box = lambda b: isinstance(b, nn.meta.AxisMetadata)
      boxed = jax.tree.map(lambda box, v: box.replace_boxed(v) if is_box(box) else v, abstract,
                           load_flax_variables(path), is_leaf=is_box)
      # orbax straight into the unboxed target: ocp.StandardCheckpointer().restore(path, nn.meta.unbox(abstract))

  >>> import os, tempfile, numpy as np
  >>> from jaxsparse.torch_interop import load_flax_variables, save_flax_variables
  >>> path = save_flax_variables({"params": {"fc": {"kernel": np.ones((2, 3), np.float32)}}},
  ...                            os.path.join(tempfile.mkdtemp(), "model.safetensors"))
  >>> load_flax_variables(path)["params"]["fc"]["kernel"].shape
  (2, 3)

  Args:
    variables: nested dicts (or other mappings) of arrays, Linen sharding boxes of arrays, or NNX variables.
    path: the output file (safetensors) or directory (orbax); must not exist for orbax.
    format: ``"safetensors"`` or ``"orbax"``; ``None`` picks safetensors for a ``.safetensors`` name and
      orbax otherwise.

  Returns:
    The path written.

  Raises:
    ValueError: a ``format`` other than ``"safetensors"``, ``"orbax"`` or ``None``.
    CheckpointError: (a ``ValueError``) the directory of ``path`` does not exist; for orbax, ``path`` already
      exists; a variable name containing ``"/"`` (it separates path parts in the file); a leaf that is not a
      numeric or boolean array.
    ImportError: safetensors output without PyTorch or ``safetensors`` installed, or orbax output without
      ``orbax-checkpoint``.
  """
  path = os.fspath(path)
  if format is None:
    format = "safetensors" if path.endswith(".safetensors") else "orbax"
  if format not in ("safetensors", "orbax"):
    raise ValueError(f"format must be 'safetensors' or 'orbax', got format={format!r}.")
  directory = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(directory):
    raise CheckpointError(f"cannot write {path}: the directory {directory} does not exist.")
  flat = {k: _array(k, v) for k, v in _flatten(unboxed(variables)).items()}
  if format == "safetensors":
    from safetensors.torch import save_file  # noqa: PLC0415 -- optional dependency

    import_torch()
    tensors = {k: to_torch(np.ascontiguousarray(v), key=k).contiguous() for k, v in flat.items()}
    metadata = {"format": "jaxsparse-flax-variables", "separator": SEP}
    try:
      atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    except OSError:
      raise
    except Exception as e:  # safetensors' own SafetensorError (a full disk, say): no partial file is left
      raise CheckpointError(f"cannot write {path}: {e}") from e
    return path
  import orbax.checkpoint as ocp  # noqa: PLC0415 -- optional, only for orbax output

  if os.path.exists(path):
    raise CheckpointError(f"{path} already exists; orbax output goes to a new directory.")
  # Orbax writes to a temporary directory and renames it when done: a failure leaves no checkpoint, and the
  # temporary directory it leaves (a full disk, say) is removed here.
  before = set(os.listdir(directory))
  checkpointer = ocp.StandardCheckpointer()
  try:
    checkpointer.save(os.path.abspath(path), _nested(flat, origin="variables"))
    checkpointer.wait_until_finished()
  except BaseException:
    stem = os.path.basename(os.path.abspath(path))
    for name in set(os.listdir(directory)) - before:
      if name == stem or name.startswith(stem + ".orbax-checkpoint-tmp"):
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    raise
  return path


def load_flax_variables(path: str | os.PathLike, *, max_bytes: int | None = None) -> dict[str, Any]:
  """Reads variables written by :func:`save_flax_variables` (or ``jaxsparse convert``) as nested NumPy dicts.

  To restore an orbax directory straight into a (possibly abstract or sharded) Linen target, use
  ``orbax.checkpoint.StandardCheckpointer().restore(path, target)``; for a target in sharding boxes
  (``nn.with_partitioning``), ``nn.meta.unbox(target)``. The arrays come back unboxed, as they are stored: see
  :func:`save_flax_variables` for placing them as the model names them or boxing them again.

  >>> import os, tempfile, numpy as np
  >>> from jaxsparse.torch_interop import load_flax_variables, save_flax_variables
  >>> path = save_flax_variables({"params": {"fc": {"kernel": np.ones((2, 3), np.float32), "bias": np.zeros(3)}}},
  ...                            os.path.join(tempfile.mkdtemp(), "model.safetensors"))
  >>> variables = load_flax_variables(path)
  >>> {k: (v.shape, v.dtype) for k, v in sorted(variables["params"]["fc"].items())}
  {'bias': ((3,), dtype('float64')), 'kernel': ((2, 3), dtype('float32'))}

  Args:
    path: a safetensors file or an orbax checkpoint directory.
    max_bytes: the most bytes its arrays may take, each and all together, as the safetensors header or the orbax
      metadata declares them (checked before any is read); ``None``: ``$JAXSPARSE_CHECKPOINT_MAX_BYTES`` (bytes, or
      ``none`` for no limit), else this machine's physical memory.

  Returns:
    Nested dicts (``{"params": {"fc": {"kernel": ...}}}``) of NumPy arrays with the shapes and dtypes stored.

  Raises:
    CheckpointError: ``path`` is not a readable safetensors file or orbax checkpoint, or one of its keys is both
      a tensor and the parent of another (``params/fc`` and ``params/fc/kernel``), or it declares more than
      ``max_bytes`` (an array, or all together; the message names the array, its shape, dtype and bytes).
    TypeError: ``max_bytes`` is not an int or ``None`` (one < 1: ``ValueError``).
  """
  path = os.fspath(path)
  with limit_scope(max_bytes):
    return _nested(_load_flat(path), origin=path)


def _orbax_sizes(path: str) -> dict[str, TensorSize]:
  """``{"a/b": TensorSize}`` from an orbax checkpoint's metadata (no array read); empty where it has none: the
  restore then says what is wrong."""
  import orbax.checkpoint as ocp  # noqa: PLC0415 -- optional, only for orbax input

  try:
    metadata = ocp.StandardCheckpointer().metadata(os.path.abspath(path))
    leaves = jax.tree_util.tree_leaves_with_path(getattr(metadata, "item_metadata", metadata))
    return {SEP.join(str(getattr(k, "key", k)) for k in kp): tensor_size(leaf.shape, np.dtype(leaf.dtype))
            for kp, leaf in leaves if hasattr(leaf, "shape") and hasattr(leaf, "dtype")}
  except Exception:  # untrusted directory: orbax fails in many ways, and restore below reports them
    return {}


def _load_flat(path: str) -> dict[str, np.ndarray]:
  """``{"a/b": array}`` of a safetensors file or orbax directory, its declared sizes checked before anything is read."""
  if os.path.isdir(path):
    import orbax.checkpoint as ocp  # noqa: PLC0415 -- optional, only for orbax input

    check_sizes(_orbax_sizes(path), origin=path)
    # Nested dicts; older outputs held one flat dict keyed by "/"-joined paths, which _nested splits.
    try:
      restored = ocp.StandardCheckpointer().restore(os.path.abspath(path))
    except Exception as e:  # untrusted directory: orbax / tensorstore fail in many ways
      first = str(e).splitlines()[0] if str(e) else type(e).__name__
      raise CheckpointError(f"{path} is not a readable orbax checkpoint (missing or corrupt files?): {first}") from e
    leaves = jax.tree_util.tree_leaves_with_path(restored)
    flat = {SEP.join(str(getattr(k, "key", k)) for k in kp): v for kp, v in leaves}
  else:
    from safetensors import safe_open  # noqa: PLC0415 -- optional dependency

    check_sizes(safetensors_sizes(path) or {}, origin=path)  # from the header, before safe_open maps the file
    try:
      with safe_open(path, framework="pt") as f:
        flat = {k: to_numpy(f.get_tensor(k), key=k) for k in f.keys()}
    except Exception as e:
      raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from e
  return {k: np.asarray(v) for k, v in flat.items()}


def _nested(flat: Mapping[str, Any], *, origin: str) -> dict[str, Any]:
  """``{"a/b": x}`` -> ``{"a": {"b": x}}``; a key that is both a leaf and a parent (``a`` and ``a/b``) raises."""
  out: dict[str, Any] = {}
  for k, v in flat.items():
    node = out
    *parents, leaf = k.split(SEP)
    for i, part in enumerate(parents):
      node = node.setdefault(part, {})
      if not isinstance(node, dict):
        _collision(origin, SEP.join(parents[: i + 1]), k)
    if isinstance(node.get(leaf), dict):
      _collision(origin, k, next(other for other in flat if other.startswith(k + SEP)))
    node[leaf] = v
  return out


def _collision(origin: str, leaf: str, child: str) -> None:
  raise CheckpointError(
      f"{origin}: key {leaf!r} holds a tensor but is also the parent of {child!r}; the keys of a Flax variables "
      f"file are {SEP!r}-joined paths of a tree, so a path holds a tensor or sub-paths, not both."
  )
