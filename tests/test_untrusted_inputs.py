"""Untrusted input found by the bug bash of 2026-12: hand-built index arrays closed over in a ``jit``, files that
are no pickle, and checkpoint sizes NumPy cannot hold (the rest of the fault set: tests/test_faults*.py)."""

import json
import pickle
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsparse

# -------------------------------------------------------------------------------------------------
# Hand-built formats: under jit, jnp.asarray turns even a NumPy constant into a tracer; the constructors must
# still check the values they were given (they did not: a bad column was dropped without a word).
# -------------------------------------------------------------------------------------------------


def _bad_csr_indices():
  w = jaxsparse.CSRMatrix.from_dense(np.eye(4, dtype=np.float32))
  idx = {k: np.array(v) for k, v in w.index_arrays().items()}
  idx["col_indices"][1] = 99
  return w.data, idx


def _bad_block():
  w = jaxsparse.BlockSparseMatrix.from_dense(np.ones((16, 16), np.float32), (8, 8))
  idx = {k: np.array(v) for k, v in w.index_arrays().items()}
  idx["row_indices"][0] = 5
  return w.data, idx


def _bad_nm():
  w = jaxsparse.NMSparseMatrix.from_dense(jnp.arange(8.0).reshape(8, 1), 2, 4)
  bad = np.array(w.indices)
  bad[0, 0] = 0  # positions [0, 0]: two values claim one entry
  return w.values, bad


def test_index_constants_closed_over_in_jit_are_validated():
  data, idx = _bad_csr_indices()
  builders = {
      "CSRMatrix.from_index_arrays": (data, lambda d: jaxsparse.CSRMatrix.from_index_arrays(d, idx, shape=(4, 4))),
      "CSRMatrix": (data, lambda d: jaxsparse.CSRMatrix(d, **idx, shape=(4, 4))),
  }
  bdata, bidx = _bad_block()
  builders["BlockSparseMatrix"] = (bdata, lambda d: jaxsparse.BlockSparseMatrix.from_index_arrays(
      d, bidx, shape=(16, 16), block_shape=(8, 8)))
  values, positions = _bad_nm()
  builders["NMSparseMatrix"] = (values, lambda v: jaxsparse.NMSparseMatrix(v, positions, shape=(8, 1), n=2, m=4))
  for name, (arg, build) in builders.items():
    with pytest.raises(ValueError, match=r"(row|col)_indices is invalid|positions is invalid"):
      jax.jit(lambda a, build=build: build(a).to_dense())(arg)
      pytest.fail(f"{name} under jit took invalid index constants")


# -------------------------------------------------------------------------------------------------
# Checkpoint files.
# -------------------------------------------------------------------------------------------------


class _RunsCode:
  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return (open, (self.marker, "w"))


def test_bytes_that_are_no_pickle_are_not_called_code(tmp_path):
  """torch's weights-only unpickler words every failure as "Weights only load failed": a NumPy file, JSON or a
  sharded checkpoint's index was refused as a pickle that "needs arbitrary pickled Python code"."""
  torch = pytest.importorskip("torch")
  from jaxsparse.torch_interop import CheckpointError  # noqa: PLC0415 -- torch is optional
  from jaxsparse.torch_interop import load_state_dict  # noqa: PLC0415

  np.save(tmp_path / "weights.npy", np.ones(3))
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../../etc/passwd"}}))
  for name, fragment in (("weights.npy", "not a readable PyTorch checkpoint"),
                         ("model.safetensors.index.json", "sharded checkpoints")):
    with pytest.raises(CheckpointError, match=fragment) as e:
      load_state_dict(str(tmp_path / name))
    assert "pickled Python code" not in str(e.value)
  marker = tmp_path / "ran"
  torch.save({"fc.weight": torch.ones(2), "x": _RunsCode(str(marker))}, tmp_path / "code.pt")
  with pytest.raises(CheckpointError, match=r"needs arbitrary pickled Python code.*torch said: .*GLOBAL"):
    load_state_dict(str(tmp_path / "code.pt"))
  (tmp_path / "code.bin").write_bytes(pickle.dumps({"x": _RunsCode(str(marker))}, protocol=2))
  with pytest.raises(CheckpointError, match="needs arbitrary pickled Python code"):
    load_state_dict(str(tmp_path / "code.bin"))
  assert not marker.exists()


def _safetensors(header: dict) -> bytes:
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)
  return struct.pack("<Q", len(raw)) + raw


def test_sizes_numpy_cannot_hold_are_checkpoint_errors(tmp_path):
  """A shape NumPy cannot hold (a zero-size safetensors tensor of shape (2**62, 0), a SparseProp W_shape of 2**62
  columns) raised NumPy's ValueError / MemoryError without the key; pytorch_block_sparse's col_start_ends_b was
  trusted for the block-column count, so one of 1025 entries built a weight 512 times too wide."""
  torch = pytest.importorskip("torch")
  from jaxsparse import torch_interop  # noqa: PLC0415 -- torch is optional
  from jaxsparse.torch_interop import CheckpointError  # noqa: PLC0415

  path = tmp_path / "zero.safetensors"
  path.write_bytes(_safetensors({"fc.weight": {"dtype": "F32", "shape": [2**62, 0], "data_offsets": [0, 0]}}))
  with pytest.raises(CheckpointError, match=r"'fc.weight' has shape \(4611686018427387904, 0\)"):
    torch_interop.decode_checkpoint(str(path))
  with pytest.raises(CheckpointError, match=r"fc\.weight"):
    torch_interop.load_flax_variables(str(path))
  sparseprop = {"fc.W_val": torch.ones(3), "fc.W_idx.indptr": torch.tensor([0, 1, 2, 3]),
                "fc.W_idx.indices": torch.tensor([0, 1, 2])}
  for cols in (2**62, 2**45):
    with pytest.raises(CheckpointError, match=r"'fc\.W_shape': its dense shape"):
      torch_interop.decode_checkpoint({**sparseprop, "fc.W_shape": torch.tensor([3, cols])})
  hf = {"fc.weight.data": torch.ones(8, 4), "fc.weight.cols_a": torch.tensor([[0, 0], [1, 1]]),
        "fc.weight.row_start_ends_a": torch.tensor([0, 1, 2])}
  with pytest.raises(CheckpointError, match="col_start_ends_b must count the blocks"):
    torch_interop.decode_checkpoint({**hf, "fc.weight.col_start_ends_b": torch.tensor([0] * 1024 + [2])})
  good = torch_interop.decode_checkpoint({**hf, "fc.weight.col_start_ends_b": torch.tensor([0, 1, 2])})
  assert good["fc.weight"].shape == (8, 8)
