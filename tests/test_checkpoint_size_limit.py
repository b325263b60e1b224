"""Checkpoints that declare more than memory holds: a safetensors header over a sparse file, a ``torch.save`` view whose
zero strides expand 4 bytes to 160 GB, torch sparse tensors (BSR, CSR, 2:4) whose dense shape is huge while their
stored arrays are tiny, a sharded Llama index pointing at such a shard, many tensors each under the limit but over it
together. Every reader must refuse them from headers and shapes with a CheckpointError naming the tensor, its shape,
dtype and bytes, and the limit (``max_bytes=``, ``$JAXSPARSE_CHECKPOINT_MAX_BYTES``, else the physical memory),
before reading anything; they used to map and copy such tensors until an allocation failed or the OOM killer came.

The huge cases run in a child process whose address space is capped (``RLIMIT_AS``) at 1.5 GiB over what its imports
take, so a reader that tries to materialise them fails there instead of taking this machine's memory.
"""

import json
import os
import re
import struct
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from tests._faults_util import REPO
from tests._faults_util import missing_report
from tests._faults_util import run_child

torch = pytest.importorskip("torch")

from jaxsparse import torch_interop  # noqa: E402
from jaxsparse.torch_interop import CheckpointError  # noqa: E402
from jaxsparse.torch_interop._cli import main as cli_main  # noqa: E402
from jaxsparse.torch_interop._limits import ENV_MAX_BYTES  # noqa: E402
from jaxsparse.torch_interop._limits import physical_memory  # noqa: E402
from jaxsparse.torch_interop._limits import resolve_limit  # noqa: E402

HUGE = (200000, 200000)  # 160 GB of float32
_BITS = {"F32": 32, "F16": 16}


def _sparse_safetensors(path: Path, tensors: dict[str, tuple[tuple[int, ...], str]]) -> Path:
  """A safetensors file whose data is a hole (``truncate``): as large as its header says, on (almost) no disk."""
  header, offset = {}, 0
  for name, (shape, dtype) in tensors.items():
    nbytes = int(np.prod(shape, dtype=object)) * _BITS[dtype] // 8
    header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)
  path.write_bytes(struct.pack("<Q", len(raw)) + raw)
  os.truncate(path, 8 + len(raw) + offset)
  if os.stat(path).st_blocks * 512 > 2**20:
    path.unlink()
    pytest.skip(f"{path.parent} does not keep sparse files sparse")
  return path


# -------------------------------------------------------------------------------------------------
# Huge declared sizes, read in an address-space-capped child.
# -------------------------------------------------------------------------------------------------

_CHILD = """
import contextlib, io, json, os, resource, sys, warnings
warnings.simplefilter("ignore")
import jax, torch
from flax import nnx
from jaxsparse import torch_interop
from jaxsparse.torch_interop import _files, _linen  # noqa: F401 -- imported before the cap (the CLI imports lazily)
from jaxsparse.torch_interop._cli import main as cli_main
sys.path.insert(0, os.path.join(os.environ["REPO"], "examples"))
from llama.checkpoint import load_pretrained, read_tensors

jax.devices()
vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
cap = vm + 3 * 2**29
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
directory = sys.argv[1]

def semi_structured():
  from torch.sparse import SparseSemiStructuredTensorCUTLASS
  # 2:4 storage of 8 rows, declaring a (200000, 200000) dense shape
  return {"fc.weight": SparseSemiStructuredTensorCUTLASS(
      torch.Size((200000, 200000)), packed=torch.zeros(8, 2, dtype=torch.float16),
      meta=torch.zeros(8, 1, dtype=torch.int16), packed_t=None, meta_t=None, compressed_swizzled_bitmask=None)}

def run(case, path):
  src = semi_structured() if case == "semi_structured" else os.path.join(directory, case)
  out = os.path.join(directory, f"{case}.{path}.out.safetensors")
  err = io.StringIO()
  try:
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
      if path == "load_state_dict":
        shapes = {k: tuple(v.shape) for k, v in torch_interop.load_state_dict(src).items()}
        return {"error": None, "message": repr(shapes)}
      elif path == "decode":
        torch_interop.decode_checkpoint(src)
      elif path == "load_nnx":
        torch_interop.load_nnx(nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0))), src, name_map={"fc": "layers.0"})
      elif path == "linen":
        torch_interop.to_linen_variables(src)
      elif path == "flax_variables":
        torch_interop.load_flax_variables(src)
      elif path == "llama":
        load_pretrained(src)
      elif path == "llama_read":
        next(iter(read_tensors(src)))
      elif path in ("inspect", "convert"):
        rc = cli_main([path, src] if path == "inspect" else [path, src, out])
        return {"rc": rc, "message": err.getvalue(), "files": sorted(p for p in os.listdir(directory) if ".out." in p)}
  except BaseException as e:
    return {"error": type(e).__name__, "message": str(e)}
  return {"error": None, "message": ""}

for item in sys.argv[2].split(","):
  case, path = item.split("/")
  print(json.dumps({"case": item, **run(case, path)}), flush=True)
"""

FILE_PATHS = ("decode", "load_nnx", "linen", "inspect", "convert")
# case -> (the readers that must refuse it, what the message must say beside the limit)
CASES = {
    "huge.safetensors": ((*FILE_PATHS, "load_state_dict", "flax_variables"),
                         r"'fc\.weight': its shape \(200000, 200000\) of F32 takes 160,000,000,000 bytes"),
    "expanded.pt": ((*FILE_PATHS, "load_state_dict"),
                    r"'fc\.weight': its shape \(200000, 200000\) of float32 takes 160,000,000,000 bytes"),
    "expanded_legacy.pt": ((*FILE_PATHS, "load_state_dict"),
                           r"'fc\.weight': its shape \(200000, 200000\) of float32 takes 160,000,000,000 bytes"),
    "bsr.pt": (FILE_PATHS, r"'fc\.weight': its shape \(200000, 200000\) of float32 takes 160,000,000,000 bytes"),
    "csr.pt": (FILE_PATHS, r"'fc\.weight': its shape \(200000, 200000\) of float32 takes 160,000,000,000 bytes"),
    "semi_structured": (("decode", "linen"),
                        r"'fc\.weight': its shape \(200000, 200000\) of float16 takes 80,000,000,000 bytes"),
    "together.safetensors": (("decode", "load_state_dict", "flax_variables", "inspect"),
                             r"its 3 tensors take [\d,]+ bytes \([\d.]+ GiB\) together, which does not fit in memory "
                             r"\(the largest: 'a' "),
    "llama_sharded": (("llama", "llama_read"),
                      r"model-00001-of-00002\.safetensors: 'model\.embed_tokens\.weight': its shape \(200000, 200000\) "
                      r"of F32 takes 160,000,000,000 bytes"),
}


def _build_cases(directory: Path) -> None:
  _sparse_safetensors(directory / "huge.safetensors", {"fc.weight": (HUGE, "F32")})
  # Each tensor 0.6 of this machine's memory: under the limit alone, 1.8 times it together.
  memory = physical_memory()
  rows = -(-int(0.6 * memory) // (4 * 2**20))
  _sparse_safetensors(directory / "together.safetensors", {k: ((rows, 2**20), "F32") for k in "abc"})
  view = torch.zeros(1).expand(*HUGE)  # torch.save keeps the view: one float stored
  torch.save({"fc.weight": view}, directory / "expanded.pt")
  torch.save({"fc.weight": view}, directory / "expanded_legacy.pt", _use_new_zipfile_serialization=False)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # beta layouts
    block = torch.sparse_bsr_tensor(torch.tensor([0, 1] + [1] * 399), torch.tensor([0]), torch.ones(1, 500, 500),
                                    HUGE, check_invariants=False)  # one 500x500 block of 400x400
    torch.save({"fc.weight": block}, directory / "bsr.pt")
    crow = torch.zeros(HUGE[0] + 1, dtype=torch.int64)
    crow[1:] = 1
    csr = torch.sparse_csr_tensor(crow, torch.tensor([7]), torch.ones(1), HUGE, check_invariants=False)
    torch.save({"fc.weight": csr}, directory / "csr.pt")
  llama = directory / "llama_sharded"
  llama.mkdir()
  sys.path.insert(0, str(Path(REPO) / "examples"))
  from llama.model import LlamaConfig  # noqa: PLC0415

  cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=8)
  (llama / "config.json").write_text(json.dumps(cfg.to_dict()))
  _sparse_safetensors(llama / "model-00001-of-00002.safetensors", {"model.embed_tokens.weight": (HUGE, "F32")})
  _sparse_safetensors(llama / "model-00002-of-00002.safetensors", {"model.norm.weight": ((16,), "F32")})
  weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                "model.norm.weight": "model-00002-of-00002.safetensors"}
  (llama / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.fixture(scope="module")
def huge_results(tmp_path_factory):
  if not sys.platform.startswith("linux") or physical_memory() is None:
    pytest.skip("the address-space cap of the child reads /proc and needs the physical memory")
  directory = tmp_path_factory.mktemp("huge_checkpoints")
  _build_cases(directory)
  items = [f"{case}/{path}" for case, (paths, _) in CASES.items() for path in paths]
  items += ["bsr.pt/load_state_dict", "csr.pt/load_state_dict"]  # not densified there: must load
  env = {"REPO": REPO, ENV_MAX_BYTES: ""}
  return run_child(_CHILD, str(directory), ",".join(items), env=env, timeout=120)


@pytest.mark.parametrize("item", [f"{case}/{path}" for case, (paths, _) in CASES.items() for path in paths])
def test_huge_declared_sizes_are_refused_before_anything_is_read(huge_results, item):
  results, proc = huge_results
  r = results.get(item)
  assert r is not None, missing_report(results, item, proc)
  pattern = CASES[item.split("/")[0]][1]
  if "rc" in r:
    assert r["rc"] == 1 and r["files"] == [], r
  else:
    assert r["error"] in ("CheckpointError", "ValueError"), r  # the Llama example's errors are ValueErrors
  message = r["message"]
  assert re.search(pattern, message), r
  assert re.search(r"does not fit in memory.*over the limit of [\d,]+ bytes \([\d.]+ GiB; this machine's physical "
                   r"memory\).*max_bytes=BYTES.*JAXSPARSE_CHECKPOINT_MAX_BYTES=BYTES", message, re.S), r


def test_sparse_tensors_are_not_refused_where_they_stay_sparse(huge_results):
  """load_state_dict hands torch sparse tensors over as they are (their stored arrays are small): no refusal."""
  results, proc = huge_results
  for item in ("bsr.pt/load_state_dict", "csr.pt/load_state_dict"):
    r = results.get(item)
    assert r is not None, missing_report(results, item, proc)
    assert r == {"case": item, "error": None, "message": "{'fc.weight': (200000, 200000)}"}, r


# -------------------------------------------------------------------------------------------------
# The limit: max_bytes=, then $JAXSPARSE_CHECKPOINT_MAX_BYTES, then the physical memory; checked exactly.
# -------------------------------------------------------------------------------------------------


def _small_file(tmp_path: Path) -> Path:
  from safetensors.numpy import save_file  # noqa: PLC0415

  path = tmp_path / "small.safetensors"
  save_file({"a": np.ones((4, 4), np.float32), "b": np.ones((4, 8), np.float32)}, str(path))  # 64 + 128 bytes
  return path


def test_limit_from_the_argument_the_environment_or_the_memory(tmp_path, monkeypatch):
  monkeypatch.delenv(ENV_MAX_BYTES, raising=False)
  path = _small_file(tmp_path)
  assert set(torch_interop.load_state_dict(path, max_bytes=192)) == {"a", "b"}  # exactly the limit: loads
  assert torch_interop.decode_checkpoint(path, max_bytes=192)["b"].shape == (4, 8)
  with pytest.raises(CheckpointError, match=r"small\.safetensors: its 2 tensors take 192 bytes \(0\.0 GiB\) together, "
                     r"which does not fit in memory \(the largest: 'b' \(4, 8\) of F32 \(128 bytes\), 'a' \(4, 4\) of "
                     r"F32 \(64 bytes\)\): over the limit of 191 bytes \(0\.0 GiB; max_bytes=191\)"):
    torch_interop.load_state_dict(path, max_bytes=191)
  with pytest.raises(CheckpointError, match=r"'b': its shape \(4, 8\) of F32 takes 128 bytes .* over the limit of 100 "
                     r"bytes"):
    torch_interop.load_flax_variables(path, max_bytes=100)
  monkeypatch.setenv(ENV_MAX_BYTES, "100")
  with pytest.raises(CheckpointError, match=re.escape("over the limit of 100 bytes (0.0 GiB; "
                                                      "$JAXSPARSE_CHECKPOINT_MAX_BYTES=100)")):
    torch_interop.to_linen_variables(path)
  assert torch_interop.to_linen_variables(path, max_bytes=192)["params"]["b"].shape == (4, 8)
  with pytest.raises(CheckpointError, match=r"over the limit of 191 bytes \(0\.0 GiB; max_bytes=191\)"):
    torch_interop.load_nnx(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), path, max_bytes=191)
  monkeypatch.setenv(ENV_MAX_BYTES, "none")
  assert resolve_limit().nbytes is None
  assert torch_interop.decode_checkpoint(path)["a"].shape == (4, 4)
  monkeypatch.setenv(ENV_MAX_BYTES, "lots")
  with pytest.raises(ValueError, match=r"\$JAXSPARSE_CHECKPOINT_MAX_BYTES must be a positive number of bytes or "
                     r"'none', got 'lots'"):
    torch_interop.load_state_dict(path)
  monkeypatch.delenv(ENV_MAX_BYTES)
  assert resolve_limit() == resolve_limit(None) and resolve_limit().nbytes == physical_memory()
  with pytest.raises(TypeError, match="max_bytes must be an int"):
    torch_interop.decode_checkpoint(path, max_bytes="1G")
  with pytest.raises(ValueError, match="max_bytes must be >= 1 byte, got 0"):
    torch_interop.load_state_dict(path, max_bytes=0)
  monkeypatch.setattr(os, "sysconf", lambda name: (_ for _ in ()).throw(ValueError(name)))
  assert resolve_limit().nbytes is None  # a platform that does not say: no limit


def test_many_tensors_each_under_the_limit_are_refused_together():
  state = {f"fc{i}.weight": torch.ones(16, 16) for i in range(4)}  # 1024 bytes each
  assert len(torch_interop.decode_checkpoint(state, max_bytes=4096)) == 4
  with pytest.raises(CheckpointError, match=r"state dict: its 4 tensors take 4,096 bytes .* together.*the largest: "
                     r"'fc0\.weight' \(16, 16\) of float32 \(1,024 bytes\)"):
    torch_interop.decode_checkpoint(state, max_bytes=4095)


def test_dense_forms_that_only_indices_declare_are_checked():
  """pytorch_block_sparse and SparseProp give their dense shape in index arrays, not in a tensor's shape: the dense
  form is checked when the indices give it, before it is allocated."""
  nb = 64  # 64 x 64 blocks of 64 x 64: a (4096, 4096) float32 weight (64 MiB) from one stored block
  hf = {"fc.weight.data": torch.ones(64, 64), "fc.weight.cols_a": torch.tensor([[0, 0]]),
        "fc.weight.row_start_ends_a": torch.tensor([0] + [1] * nb),
        "fc.weight.col_start_ends_b": torch.tensor([0] + [1] * nb)}
  with pytest.raises(CheckpointError, match=r"'fc\.weight\.data': its dense shape \(4096, 4096\) of float32 takes "
                     r"67,108,864 bytes .*max_bytes=1048576"):
    torch_interop.decode_checkpoint(hf, max_bytes=2**20)
  assert torch_interop.decode_checkpoint(hf, max_bytes=2**27)["fc.weight"].shape == (4096, 4096)
  sparseprop = {"fc.W_val": torch.ones(1), "fc.W_idx.indptr": torch.tensor([0, 1]),
                "fc.W_idx.indices": torch.tensor([0]), "fc.W_shape": torch.tensor([1, 2**20])}
  with pytest.raises(CheckpointError, match=r"'fc\.W_shape': its dense shape \(1, 1048576\) of float32"):
    torch_interop.decode_checkpoint(sparseprop, max_bytes=2**20)


def test_legacy_torch_files_and_orbax_directories(tmp_path):
  """A legacy (non-zip) torch.save file cannot be mapped (torch.load reads what it lists): its size is checked before
  torch.load. An orbax directory's arrays are checked from its metadata before the restore."""
  torch.save({"fc.weight": torch.ones(64, 64)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
  size = os.path.getsize(tmp_path / "legacy.pt")
  with pytest.raises(CheckpointError, match=rf"legacy\.pt is a legacy \(non-zip\) torch\.save file of {size:,} bytes"):
    torch_interop.load_state_dict(tmp_path / "legacy.pt", max_bytes=size - 1)
  assert torch_interop.decode_checkpoint(tmp_path / "legacy.pt", max_bytes=size)["fc.weight"].shape == (64, 64)
  path = torch_interop.save_flax_variables({"params": {"fc": {"kernel": np.ones((4, 8), np.float32)}}},
                                           tmp_path / "ckpt", format="orbax")
  with pytest.raises(CheckpointError, match=r"ckpt: 'params/fc/kernel': its shape \(4, 8\) of float32 takes 128 bytes"):
    torch_interop.load_flax_variables(path, max_bytes=127)
  assert torch_interop.load_flax_variables(path, max_bytes=128)["params"]["fc"]["kernel"].shape == (4, 8)


def test_cli_max_bytes(tmp_path, capsys):
  path = _small_file(tmp_path)
  assert cli_main(["inspect", str(path), "--max-bytes", "100"]) == 1
  assert "its shape (4, 8) of F32 takes 128 bytes" in capsys.readouterr().err
  assert cli_main(["inspect", str(path), "--max-bytes", "192"]) == 0
  out = tmp_path / "out.safetensors"
  assert cli_main(["convert", str(path), str(out), "--max-bytes", "191"]) == 1
  assert "its 2 tensors take 192 bytes" in capsys.readouterr().err and not out.exists()
  with pytest.raises(SystemExit):
    cli_main(["inspect", str(path), "--max-bytes", "0"])
  assert "must be a positive number of bytes" in capsys.readouterr().err


def test_llama_checkpoint_over_the_limit_together(tmp_path):
  """Each shard's tensors under the limit, all of them over it: refused before any is read; at the limit: loads."""
  sys.path.insert(0, str(Path(REPO) / "examples"))
  import llama  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  from llama.checkpoint import load_pretrained  # noqa: PLC0415
  from llama.checkpoint import save_pretrained  # noqa: PLC0415

  cfg = llama.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8)
  directory = save_pretrained(llama.LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)), tmp_path / "ckpt", max_shard_bytes=4096)
  index = json.loads((directory / "model.safetensors.index.json").read_text())
  total = index["metadata"]["total_size"]
  with pytest.raises(CheckpointError, match=rf"ckpt: its \d+ tensors take {total:,} bytes .* together.*over the limit "
                     rf"of {total - 1:,} bytes"):
    load_pretrained(directory, max_bytes=total - 1)
  assert load_pretrained(directory, max_bytes=total).config.hidden_size == 16
