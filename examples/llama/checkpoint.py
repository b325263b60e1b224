"""Hugging Face Llama-format directories in and out, without torch.

A directory holds ``config.json`` and ``model.safetensors``, or shards listed in
``model.safetensors.index.json``, never both: :func:`save_pretrained` removes the other layout's files, and
:func:`load_pretrained` refuses a directory that holds both. Tensors are read and written with
``safetensors``' NumPy API (bfloat16 through ``ml_dtypes``), so neither direction needs torch. Names map one
to one, since the Flax model has Hugging Face's module paths (``model.py``): ``<module>.weight`` is
``kernel`` transposed for a linear layer, ``embedding`` for the embedding and ``weight`` for the norms.

Sparse checkpoints the other way round (a pruned torch model, ``torch.nn.utils.prune`` masks, 2:4
semi-structured weights) load with :func:`jaxsparse.torch_interop.load_nnx` into the same model, which
turns their layers into jaxsparse layers: ``torch_interop.load_nnx(model, hf_model_or_state_dict)`` (with tied
embeddings it skips ``lm_head.weight``, the embedding's own tensor, and lists it in the report's ``tied``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxsparse
from jaxsparse import torch_interop
from jaxsparse._utils import atomic_write
from jaxsparse.torch_interop._limits import Limit
from jaxsparse.torch_interop._limits import check_sizes
from jaxsparse.torch_interop._limits import check_total
from jaxsparse.torch_interop._limits import resolve_limit
from jaxsparse.torch_interop._limits import safetensors_sizes
from llama.model import LlamaConfig
from llama.model import LlamaForCausalLM

__all__ = ["export_masks", "hf_name", "load_pretrained", "read_tensors", "save_pretrained"]

# Checkpoint entries with no parameter here: RoPE buffers some older exports saved.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD_RE = re.compile(r"model-\d{5,}-of-\d{5,}\.safetensors")


def hf_name(path: tuple) -> tuple[str, bool]:
  """``(Hugging Face tensor name, transposed?)`` of a Flax parameter path like ``("lm_head", "kernel")``."""
  *module, leaf = (str(p) for p in path)
  name = {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
  return ".".join((*module, name)), leaf == "kernel"


def _index_weight_map(index: Path) -> dict[str, str]:
  """The ``weight_map`` of ``model.safetensors.index.json``; a tensor listed twice with different files raises."""

  def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in items:
      if key in out and out[key] != value and isinstance(value, str):
        raise ValueError(f"{index} lists the tensor {key!r} twice, in {out[key]!r} and {value!r}: which one is "
                         f"meant is ambiguous (json keeps the last). Fix the index.")
      out[key] = value
    return out

  try:
    with open(index) as f:
      content = json.load(f, object_pairs_hook=pairs)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{index} is not a valid JSON file: {e}") from e
  weight_map = content.get("weight_map") if isinstance(content, dict) else None
  if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
    raise ValueError(f"{index} has no weight_map {{tensor name: shard file}}, got {weight_map!r:.200}.")
  # A shard is a file beside the index: a path elsewhere ("/...", "../...") would read another checkpoint's tensors.
  outside = sorted({v for v in weight_map.values() if v in ("", ".", "..") or Path(v).name != v or "\\" in v})
  if outside:
    raise ValueError(f"{index} places tensors in {outside[:4]}, which are not file names in {index.parent}: the "
                     "shards of a checkpoint are files beside its index.")
  return weight_map


def _open(file: Path, limit: Limit):
  """``safe_open(file)`` (NumPy), a damaged file raising a ``ValueError`` that names it.

  Each tensor its header declares is checked against ``limit`` first: ``safe_open`` maps the whole file and
  ``get_tensor`` copies a tensor whole, and a header can declare far more than the file's data (a sparse file).
  """
  from safetensors import safe_open  # noqa: PLC0415 -- optional dependency of the example

  check_sizes(safetensors_sizes(file) or {}, origin=str(file), limit=limit, total=False)
  try:
    return safe_open(str(file), framework="numpy")
  except Exception as e:  # untrusted file: safetensors raises its own SafetensorError, or OSError
    raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): {e}") from e


def _unfused(name: str, value: Any, cfg: LlamaConfig) -> list[tuple[str, Any]]:
  """Hugging Face's tensors of a tensor of :func:`llama.prune.fuse_projections`' ``qkv_proj`` / ``gate_up_proj`` (its
  rows, the outputs, split back into ``q_proj`` / ``k_proj`` / ``v_proj``, ``gate_proj`` / ``up_proj``); any other
  tensor as it is. ``value`` is in torch layout (outputs first), a NumPy array or a torch tensor (row slices of it).

  Raises:
    ValueError: a fused tensor whose rows are not the outputs of the fused projections of ``cfg``.
  """
  module, _, leaf = name.rpartition(".")
  parent, _, kind = module.rpartition(".")
  if kind == "qkv_proj":
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv}
  elif kind == "gate_up_proj":
    sizes = {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size}
  else:
    return [(name, value)]
  if value.shape[0] != sum(sizes.values()):
    raise ValueError(f"{name}: shape {tuple(value.shape)}, whose {value.shape[0]} rows (outputs) are not those of the "
                     f"fused {' + '.join(f'{k} {v}' for k, v in sizes.items())} of the model's config: it cannot be "
                     "split back into Hugging Face's projections.")
  parts, start = [], 0
  for part, size in sizes.items():
    parts.append((f"{parent}.{part}.{leaf}", value[start:start + size]))
    start += size
  return parts


def export_masks(model: LlamaForCausalLM, *, dtype: Any = None) -> dict[str, Any]:
  """:func:`jaxsparse.torch_interop.export_masks` of a Llama model, under Hugging Face's names.

  Fused projections (:func:`llama.prune.fuse_projections`) are written as the masks of Hugging Face's separate
  ``q_proj`` / ``k_proj`` / ``v_proj`` and ``gate_proj`` / ``up_proj`` (their rows split as :func:`save_pretrained`
  splits the weights); a model without them gets ``torch_interop.export_masks``' masks as they are. A model with tied
  embeddings and a sparse embedding gets the embedding's mask under ``lm_head.weight_mask`` too: in torch the head
  shares the embedding's parameter, and pruning the embedding alone leaves the head dense (other logits).

  Args:
    model: a sparse :class:`~llama.model.LlamaForCausalLM`, fused or not.
    dtype: torch dtype of the masks, as in :func:`jaxsparse.torch_interop.export_masks` (``None``: bool).

  Returns:
    ``{"<Hugging Face module>.weight_mask": torch.Tensor}``, for :func:`jaxsparse.torch_interop.apply_masks` on a
    ``transformers.LlamaForCausalLM``.

  Raises:
    ValueError: a fused mask whose rows do not match the model's config.
  """
  masks = {}
  for name, mask in torch_interop.export_masks(model, dtype=dtype).items():
    masks.update((part, value.contiguous()) for part, value in _unfused(name, mask, model.config))
  embed = masks.get("model.embed_tokens.weight_mask")
  if model.lm_head is None and embed is not None:  # the logits use the sparse embedding (attend)
    masks["lm_head.weight_mask"] = embed
  return masks


def _shards(directory: Path, limit: Limit) -> dict[str, Path]:
  """``{tensor name: file}`` of a single-file or sharded safetensors checkpoint."""
  index, single = directory / INDEX, directory / SINGLE
  if index.exists():
    weight_map = _index_weight_map(index)
    files = set(weight_map.values())
    if single.exists() and SINGLE not in files:
      # Two checkpoints (left by another writer): transformers would read model.safetensors, the index the other.
      raise ValueError(f"{directory} holds two checkpoints: {SINGLE} and the shards of {INDEX}, which does not list "
                       f"{SINGLE}. Delete the stale one, or save the model again with save_pretrained.")
    absent = sorted(file for file in files if not (directory / file).is_file())
    if absent:
      raise FileNotFoundError(f"{directory}: {INDEX} lists {absent[:4]}, which are not there.")
    return {name: directory / file for name, file in weight_map.items()}
  if not single.exists():
    raise FileNotFoundError(f"{directory} has neither {SINGLE} nor {INDEX}.")
  with _open(single, limit) as f:
    return dict.fromkeys(f.keys(), single)


def _by_file(directory: Path, limit: Limit) -> dict[Path, list[str]]:
  """``{shard file: names of the tensors to read from it}``."""
  by_file: dict[Path, list[str]] = {}
  for name, file in _shards(directory, limit).items():
    by_file.setdefault(file, []).append(name)
  return by_file


def read_tensors(directory: str | os.PathLike, *, max_bytes: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
  """``(name, NumPy array)`` for every tensor of a checkpoint directory, read one at a time, one shard open at a time.

  The index (or the single file's header) is read now; the shards and their tensors as they are asked for.

  Args:
    directory: holds ``model.safetensors``, or ``model.safetensors.index.json`` and its shards.
    max_bytes: the most bytes one tensor may take, as its header declares it (checked before it is read);
      ``None``: ``$JAXSPARSE_CHECKPOINT_MAX_BYTES`` (bytes, or ``none`` for no limit), else the physical memory.

  Returns:
    An iterator of ``(name, array)``, shard by shard.

  Raises:
    ValueError: an index that is not valid, or places a tensor outside the directory or in a shard that does not
      hold it; a file that is not a readable safetensors file (truncated, a header that does not match the data); a
      tensor declared larger than ``max_bytes`` (a :class:`~jaxsparse.torch_interop.CheckpointError` naming it, its
      shape, dtype and bytes, and the limit).
    FileNotFoundError: no checkpoint, or a shard the index lists is not there.
  """
  limit = resolve_limit(max_bytes)
  return _read(_by_file(Path(directory), limit), limit)


def _read(by_file: dict[Path, list[str]], limit: Limit) -> Iterator[tuple[str, np.ndarray]]:
  for file, names in by_file.items():
    with _open(file, limit) as f:
      absent = sorted(set(names) - set(f.keys()))
      if absent:
        raise ValueError(f"{file.parent}: {INDEX} places {absent[:4]} in {file.name}, which does not hold "
                         f"{'them' if len(absent) > 1 else 'it'}.")
      for name in names:
        try:
          tensor = f.get_tensor(name)
        except Exception as e:  # a dtype NumPy has no type for, or data the header does not describe
          raise ValueError(f"{file}: cannot read tensor {name!r} (truncated or corrupt file?): {e}") from e
        yield name, tensor


def load_pretrained(directory: str | os.PathLike, *, dtype: Any = None, param_dtype: Any = None,
                    config: LlamaConfig | None = None, max_bytes: int | None = None) -> LlamaForCausalLM:
  """Builds the Flax model of a Hugging Face Llama directory and loads its weights.

  The model is built abstractly (``nnx.eval_shape``: no random weights are drawn) and every parameter is
  filled from the checkpoint; a missing or unexpected tensor, or a shape that does not match, raises. A config that
  ties the embeddings over a checkpoint whose ``lm_head.weight`` differs from the embedding loads untied, with a
  warning, as transformers loads it.

  Args:
    directory: holds ``config.json`` and ``model.safetensors`` (or ``model.safetensors.index.json`` + shards).
    dtype: compute dtype (``None``: the parameters').
    param_dtype: storage dtype; ``None`` keeps the checkpoint's dtype (of its embedding).
    config: overrides ``config.json``.
    max_bytes: the most bytes the checkpoint's tensors may take, each and all together (over every shard), as their
      headers declare them: checked before any is read. ``None``: ``$JAXSPARSE_CHECKPOINT_MAX_BYTES`` (bytes, or
      ``none`` for no limit), else this machine's physical memory. The model's parameters come on top, about once
      more (in ``param_dtype``).

  Returns:
    A :class:`~llama.model.LlamaForCausalLM`.

  Raises:
    ValueError: a ``config.json`` that is not valid or not a Llama-architecture model's
      (:meth:`~llama.model.LlamaConfig.from_dict`); a damaged safetensors file or index (:func:`read_tensors`); a tensor
      that is not floating point, missing, unexpected or of another shape than the config's; a tensor, or all of them
      together, declared larger than ``max_bytes`` (a :class:`~jaxsparse.torch_interop.CheckpointError` naming the
      tensor or the largest ones, shapes, dtypes and bytes, and the limit).
    FileNotFoundError: no ``config.json``, no checkpoint, or a shard the index lists is not there.
  """
  directory = Path(directory)
  if config is None and not (directory / "config.json").is_file():
    raise FileNotFoundError(f"{directory} has no config.json: not a Hugging Face model directory (or pass config=).")
  cfg = config or LlamaConfig.from_json(directory / "config.json")
  limit = resolve_limit(max_bytes)
  by_file = _by_file(directory, limit)
  declared = {}  # every tensor of every shard is held at once below: each, and their sum, checked before any is read
  for file, names in by_file.items():
    sizes = safetensors_sizes(file) or {}
    sizes = {name: sizes[name] for name in names if name in sizes}
    check_sizes(sizes, origin=str(file), limit=limit, total=False)
    declared.update(sizes)
  check_total(declared, origin=str(directory), limit=limit)
  tensors = dict(_read(by_file, limit))
  # Cast silently, an int8 / bool tensor (a quantized checkpoint, a mask) would give a wrong model.
  not_float = {n: str(t.dtype) for n, t in tensors.items() if not jnp.issubdtype(t.dtype, jnp.floating)}
  if not_float:
    raise ValueError(f"{directory}: tensors {dict(list(not_float.items())[:4])} are not floating point; a Llama "
                     "checkpoint holds float32 / bfloat16 / float16 weights (quantized checkpoints are not supported).")
  head, embed = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
  if cfg.tie_word_embeddings and head is not None and embed is not None and not np.array_equal(head, embed):
    # As transformers (5) does: both present and different, the head is not tied (else the logits would differ).
    warnings.warn(f"{directory}: config.json ties the LM head to the embedding (tie_word_embeddings), but the "
                  f"checkpoint holds an lm_head.weight that differs from model.embed_tokens.weight; loading it untied, "
                  f"as transformers does (config.tie_word_embeddings=False).", stacklevel=2)
    cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
  if param_dtype is None:
    first = tensors.get("model.embed_tokens.weight", next(iter(tensors.values()), None))
    param_dtype = jnp.float32 if first is None else first.dtype
  model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)))
  used, missing = set(), []
  for path, var in nnx.iter_graph(model):
    if not isinstance(var, nnx.Param):
      continue
    name, transposed = hf_name(path)
    if name not in tensors:
      missing.append(name)
      continue
    value = tensors[name].T if transposed else tensors[name]
    if value.shape != var.shape:
      raise ValueError(f"{directory}: {name} has shape {tensors[name].shape}, the model expects "
                       f"{var.shape[::-1] if transposed else var.shape} (config.json does not match the weights?).")
    var.set_value(jnp.asarray(value, param_dtype))
    used.add(name)
  unexpected = sorted(n for n in set(tensors) - used if not n.endswith(IGNORED_SUFFIXES)
                      and not (cfg.tie_word_embeddings and n == "lm_head.weight"))
  if missing or unexpected:
    raise ValueError(f"{directory}: tensors missing from the checkpoint: {missing[:8]}; tensors the model has no "
                     f"place for: {unexpected[:8]}.")
  return model


def save_pretrained(model: LlamaForCausalLM, directory: str | os.PathLike, *, dtype: Any = None,
                    max_shard_bytes: int | None = None) -> Path:
  """Writes ``config.json`` and ``model.safetensors`` that ``transformers.LlamaForCausalLM.from_pretrained`` loads.

  Sparse layers (from ``jaxsparse.sparsify`` or pruning) are written densely, pruned weights as zeros
  (:func:`jaxsparse.densify`); their masks go to torch separately with :func:`export_masks` (Hugging Face's names,
  fused projections split back). Fused projections (:func:`llama.prune.fuse_projections`) are
  written as Hugging Face's separate ``q_proj`` / ``k_proj`` / ``v_proj`` and ``gate_proj`` / ``up_proj``.

  Into a directory that holds a checkpoint already, the new one replaces it: every file is written under a
  temporary name first and renamed only once all are written (a failure while writing leaves the old checkpoint
  as it was and no temporary file), then the old checkpoint's files the new one does not use
  (``model.safetensors``, the index, ``model-*-of-*.safetensors`` shards) are deleted. Other files (a tokenizer)
  stay.

  Args:
    model: a dense or sparsified :class:`~llama.model.LlamaForCausalLM`.
    directory: created if needed.
    dtype: floating dtype of the written tensors (``None``: each parameter's own).
    max_shard_bytes: an int >= 1: split into ``model-0000i-of-0000n.safetensors`` shards with an index above this
      size.

  Returns:
    ``directory``.
  """
  from safetensors.numpy import save_file  # noqa: PLC0415

  if dtype is not None and not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):  # an int8 cast would truncate
    raise ValueError(f"dtype must be a floating-point dtype (float32, bfloat16, float16) or None, got "
                     f"{jnp.dtype(dtype)}.")
  if max_shard_bytes is not None and (not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool)
                                      or max_shard_bytes < 1):
    raise ValueError(f"max_shard_bytes must be an int >= 1 or None, got {max_shard_bytes!r}.")
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  dense = jaxsparse.densify(model)
  tensors = {}
  for path, var in nnx.iter_graph(dense):
    if isinstance(var, nnx.Param):
      name, transposed = hf_name(path)
      value = np.asarray(jax.device_get(var[...] if dtype is None else var[...].astype(dtype)))
      tensors.update((part, np.ascontiguousarray(v)) for part, v in _unfused(name, value.T if transposed else value,
                                                                             model.config))
  cfg = model.config.to_dict()
  cfg["torch_dtype"] = str(np.dtype(next(iter(tensors.values())).dtype))
  metadata = {"format": "pt"}  # transformers checks it
  total = sum(v.nbytes for v in tensors.values())
  if max_shard_bytes is None or total <= max_shard_bytes:
    shards = [tensors]
    files = [SINGLE]
  else:
    shards, size = [{}], 0
    for name, value in tensors.items():
      if shards[-1] and size + value.nbytes > max_shard_bytes:
        shards.append({})
        size = 0
      shards[-1][name] = value
      size += value.nbytes
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  # The tensors first, then the index and config.json that point at them, then the old files: a reader
  # never meets a file half written or an index whose shards are gone. The shards are all staged before any
  # is renamed: a failure in the middle must not leave the old index pointing at a mix of old and new shards.
  contents = [(file, lambda tmp, shard=shard: save_file(shard, tmp, metadata=metadata))
              for shard, file in zip(shards, files, strict=True)]
  if len(files) > 1:
    weight_map = {name: file for shard, file in zip(shards, files, strict=True) for name in shard}
    index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    contents.append((INDEX, lambda tmp: Path(tmp).write_text(index)))
  contents.append(("config.json", lambda tmp: Path(tmp).write_text(json.dumps(cfg, indent=2))))
  staged = []
  try:
    for file, write in contents:
      staging = directory / f".{file}.{os.getpid()}.staged"
      atomic_write(staging, write)
      staged.append((staging, directory / file))
      if (directory / file).is_file():  # as open() would: an existing file keeps its mode
        os.chmod(staging, stat.S_IMODE(os.stat(directory / file).st_mode))
  except BaseException:
    for staging, _ in staged:
      staging.unlink(missing_ok=True)
    raise
  for staging, target in staged:
    os.replace(staging, target)
  written = {*files, INDEX} if len(files) > 1 else {SINGLE}
  stale = [f for f in (INDEX, SINGLE) if f not in written and (directory / f).exists()]  # the index first
  stale += sorted(f.name for f in directory.iterdir() if SHARD_RE.fullmatch(f.name) and f.name not in written)
  for file in stale:
    (directory / file).unlink()
  return directory
