"""Tests for jaxsparse.torch_interop: loading, format decoding, Flax import, export and the CLI.

The sparse formats of projects that are not installed here (apex ASP, huggingface pytorch_block_sparse,
SparseProp) are built by re-implementing the few lines of each project that lay out its state dict
(cited at each helper), so the decoders are checked against the projects' own layouts.
"""

import os
import re
import stat
import subprocess
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse
from flax import nnx
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")  # the torch extra is installed in CI; see the Makefile
import torch.nn.utils.prune as prune  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.ao.pruning import WeightNormSparsifier  # noqa: E402

import jaxsparse  # noqa: E402
from jaxsparse import torch_interop  # noqa: E402
from jaxsparse.layers import BlockSparseLinear  # noqa: E402
from jaxsparse.layers import MaskedLinear  # noqa: E402
from jaxsparse.layers import NMLinear  # noqa: E402
from jaxsparse.layers.linen import BlockSparseDense  # noqa: E402
from jaxsparse.layers.linen import MaskedDense  # noqa: E402
from jaxsparse.torch_interop import CheckpointError  # noqa: E402
from jaxsparse.torch_interop._cli import main as cli_main  # noqa: E402

torch.manual_seed(0)


def _mlp(k=64, h=128, n=32):
  torch.manual_seed(0)
  return torch.nn.Sequential(torch.nn.Linear(k, h), torch.nn.ReLU(), torch.nn.Linear(h, n))


def _flax_mlp(k=64, h=128, n=32):
  return nnx.Sequential(nnx.Linear(k, h, rngs=nnx.Rngs(1)), nnx.relu, nnx.Linear(h, n, rngs=nnx.Rngs(2)))


SEQ = [(r"^(\d+)$", r"layers.\1")]  # torch.nn.Sequential "0" <-> nnx.Sequential "layers.0"


def _block_mask(rows, cols, block, density=0.5, seed=0):
  rng = np.random.default_rng(seed)
  grid = rng.random((rows // block[0], cols // block[1])) < density
  grid.flat[0] = True
  return np.kron(grid, np.ones(block, bool))


def _nm_mask(shape, n=2, m=4, seed=0):
  rng = np.random.default_rng(seed)
  scores = rng.random(shape)
  return torch_interop._patterns.nm_mask_torch(scores, n, m)


def _forward_close(torch_model, flax_model, k=64, atol=1e-5):
  x = np.random.default_rng(3).standard_normal((5, k)).astype(np.float32)
  with torch.no_grad():
    expected = torch_model(torch.from_numpy(x)).numpy()
  np.testing.assert_allclose(np.asarray(flax_model(jnp.asarray(x))), expected, atol=atol, rtol=1e-5)


# -------------------------------------------------------------------------------------------------
# Loading.
# -------------------------------------------------------------------------------------------------


def test_import_without_torch_loaded():
  code = "import sys, jaxsparse, jaxsparse.torch_interop._cli; assert 'torch' not in sys.modules, 'torch imported'"
  subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("wrap", ["plain", "state_dict", "model", "ddp", "compile_ddp"])
def test_load_state_dict_unwraps(tmp_path, wrap):
  sd = {"fc.weight": torch.randn(3, 4), "fc.bias": torch.randn(3)}
  obj = {
      "plain": sd,
      "state_dict": {"state_dict": sd, "epoch": 3, "optimizer": {"lr": 0.1}},
      "model": {"model": sd, "step": 10},
      "ddp": {f"module.{k}": v for k, v in sd.items()},
      "compile_ddp": {"state_dict": {f"module._orig_mod.{k}": v for k, v in sd.items()}},
  }[wrap]
  path = tmp_path / "ckpt.pt"
  torch.save(obj, path)
  out = torch_interop.load_state_dict(path)
  assert sorted(out) == sorted(sd)
  assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_load_safetensors_numpy_bf16_and_key(tmp_path):
  w = torch.randn(4, 8).to(torch.bfloat16)
  save_file({"a.weight": w}, str(tmp_path / "m.safetensors"))
  assert torch.equal(torch_interop.load_state_dict(tmp_path / "m.safetensors")["a.weight"], w)
  # NumPy / ml_dtypes bfloat16 and JAX arrays in memory
  arr = jnp.asarray(np.arange(6, dtype=np.float32).reshape(2, 3), jnp.bfloat16)
  sd = torch_interop.load_state_dict({"outer": {"inner": {"x": arr, "y": np.ones(2, np.int64)}}}, key="outer.inner")
  assert sd["x"].dtype == torch.bfloat16 and sd["x"].float().tolist() == [[0, 1, 2], [3, 4, 5]]
  assert sd["y"].dtype == torch.int64


class _Evil:
  def __reduce__(self):
    return (os.system, ("echo pwned",))


def test_refuses_pickled_code(tmp_path):
  path = tmp_path / "evil.pt"
  torch.save({"weight": torch.ones(2), "payload": _Evil()}, path)
  with pytest.raises(CheckpointError, match=r"evil\.pt needs arbitrary pickled Python code.*weights_only=True"):
    torch_interop.load_state_dict(path)
  torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pt")  # a whole module also needs code
  with pytest.raises(CheckpointError, match=r"module\.pt needs arbitrary pickled Python code"):
    torch_interop.load_state_dict(tmp_path / "module.pt")


def test_bad_files(tmp_path):
  (tmp_path / "notes.txt").write_text("hello, not a checkpoint\n")
  with pytest.raises(CheckpointError, match=r"notes\.txt is not a (readable )?PyTorch checkpoint"):
    torch_interop.load_state_dict(tmp_path / "notes.txt")
  (tmp_path / "empty.pt").write_bytes(b"")
  with pytest.raises(CheckpointError, match=r"empty\.pt is empty"):
    torch_interop.load_state_dict(tmp_path / "empty.pt")
  with pytest.raises(CheckpointError, match="does not exist"):
    torch_interop.load_state_dict(tmp_path / "missing.pt")
  with pytest.raises(CheckpointError, match="is a directory"):
    torch_interop.load_state_dict(tmp_path)
  sd = {"w": torch.randn(64, 64)}
  torch.save(sd, tmp_path / "full.pt")
  data = (tmp_path / "full.pt").read_bytes()
  (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
  with pytest.raises(CheckpointError, match=r"cut\.pt is not a readable PyTorch checkpoint"):
    torch_interop.load_state_dict(tmp_path / "cut.pt")
  save_file(sd, str(tmp_path / "full.safetensors"))
  data = (tmp_path / "full.safetensors").read_bytes()
  (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 100])
  with pytest.raises(CheckpointError, match=r"cut\.safetensors.*(truncated|not a valid)"):
    torch_interop.load_state_dict(tmp_path / "cut.safetensors")
  torch.save({"epoch": 3, "lr": 0.1}, tmp_path / "notensors.pt")
  with pytest.raises(CheckpointError, match=r"notensors\.pt: found no state dict.*keys are \['epoch', 'lr'\]"):
    torch_interop.load_state_dict(tmp_path / "notensors.pt")
  with pytest.raises(TypeError, match="source must be a path"):
    torch_interop.load_state_dict(42)


# -------------------------------------------------------------------------------------------------
# Patterns.
# -------------------------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(b0=st.sampled_from([8, 16, 32, 64]), b1=st.sampled_from([8, 16, 32, 64]), seed=st.integers(0, 100))
def test_detect_block_pattern(b0, b1, seed):
  mask = _block_mask(128, 256, (b0, b1), seed=seed)
  p = torch_interop.detect_pattern(mask)
  if mask.all():
    assert p.kind == "dense"
  else:
    assert p.kind == "block"
    # the detected block is at least as large as the true one and the mask is constant over it
    assert p.block_shape[0] % b0 == 0 and p.block_shape[1] % b1 == 0
    r0, r1 = p.block_shape
    g = mask.reshape(128 // r0, r0, 256 // r1, r1)
    assert np.all(g == g[:, :1, :, :1])
    assert p.density == pytest.approx(mask.mean())


def test_detect_nm_and_unstructured():
  assert str(torch_interop.detect_pattern(_nm_mask((16, 32)))) == "2:4"
  assert str(torch_interop.detect_pattern(_nm_mask((16, 32), 1, 4))) == "1:4"
  assert str(torch_interop.detect_pattern(_nm_mask((16, 64), 3, 8))) == "3:8"
  assert str(torch_interop.detect_pattern(_nm_mask((8, 16, 3, 3), 2, 4))) == "2:4"  # conv: groups along dim 1
  assert str(torch_interop.detect_pattern(np.tile([True, False], (4, 8)))) == "2:4"  # 1:2 is reported as 2:4
  rng = np.random.default_rng(0)
  assert torch_interop.detect_pattern(rng.random((32, 32)) < 0.3).kind == "unstructured"
  assert torch_interop.detect_pattern(np.ones((4, 4), bool)).kind == "dense"
  assert torch_interop.detect_pattern(None).kind == "dense"
  # the N:M groups run along dim 1 (inputs), not dim 0
  assert torch_interop.detect_pattern(_nm_mask((32, 16)).T).kind == "unstructured"


def test_nm_recompute_matches_jaxsparse_nm_mask():
  w = np.random.default_rng(1).standard_normal((24, 32)).astype(np.float32)
  mine = torch_interop._patterns.nm_mask_torch(w, 2, 4)
  theirs = np.asarray(jaxsparse.nm_mask(w.T, 2, 4, axis=0)).T  # Flax layout, groups along axis 0
  np.testing.assert_array_equal(mine, theirs)


# -------------------------------------------------------------------------------------------------
# Formats.
# -------------------------------------------------------------------------------------------------


def test_prune_formats_linear_and_conv():
  net = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Conv2d(3, 4, 3))
  prune.l1_unstructured(net[0], "weight", amount=0.5)
  prune.random_unstructured(net[1], "weight", amount=0.3)
  params = torch_interop.decode_checkpoint(net.state_dict())
  assert list(params) == ["0.bias", "0.weight", "1.bias", "1.weight"]
  for i in (0, 1):
    p = params[f"{i}.weight"]
    assert p.format == "torch.nn.utils.prune" and p.keys == (f"{i}.weight_orig", f"{i}.weight_mask")
    np.testing.assert_array_equal(p.mask, net[i].weight_mask.numpy() == 1)
    np.testing.assert_array_equal(p.value, net[i].weight_orig.detach().numpy())
    np.testing.assert_array_equal(p.masked_value, net[i].weight.detach().numpy())
  assert params["0.bias"].mask is None and params["0.bias"].format == "dense"


def test_torch_ao_formats():
  net = torch.nn.Sequential(torch.nn.Linear(16, 8))
  sp = WeightNormSparsifier(sparsity_level=0.5, sparse_block_shape=(1, 4), zeros_per_block=2)
  sp.prepare(net, [{"tensor_fqn": "0.weight"}])
  sp.step()
  # FakeSparsity keeps the mask out of the model's state dict: it comes from the sparsifier's.
  with pytest.raises(CheckpointError, match="FakeSparsity leaves the mask out"):
    torch_interop.decode_checkpoint(net.state_dict())
  params = torch_interop.decode_checkpoint({"model": net.state_dict(), "sparsifier": sp.state_dict()})
  p = params["0.weight"]
  assert p.format == "torch.ao.pruning"
  np.testing.assert_array_equal(p.mask, sp.state_dict()["state"]["0.weight"]["mask"].numpy())
  np.testing.assert_array_equal(p.value, net[0].parametrizations.weight.original.detach().numpy())
  # ... or the mask stored as parametrizations.weight.0.mask (float or bool)
  mask = torch.from_numpy(_nm_mask((8, 16))).float()
  sd = {"0.parametrizations.weight.original": torch.randn(8, 16), "0.parametrizations.weight.0.mask": mask}
  assert str(torch_interop.decode_checkpoint(sd)["0.weight"].pattern) == "2:4"
  sd["0.parametrizations.weight.1.scale"] = torch.ones(1)
  with pytest.raises(CheckpointError, match="unknown parametrization keys"):
    torch_interop.decode_checkpoint(sd)


def test_apex_asp_format():
  # apex/contrib/sparsity/asp.py: register_buffer('__%s_mma_mask' % name, mask) (+ '__%s_mma_pruned_p'),
  # and p.mul_(mask) so the checkpoint's weight is already pruned.
  mask = torch.from_numpy(_nm_mask((16, 32)))
  w = torch.randn(16, 32) * mask
  sd = {"fc.weight": w, "fc.bias": torch.randn(16), "fc.__weight_mma_mask": mask}
  sd["fc.__weight_mma_pruned_p"] = torch.zeros(16, 32)
  p = torch_interop.decode_checkpoint(sd)["fc.weight"]
  assert p.format == "apex ASP" and str(p.pattern) == "2:4"
  np.testing.assert_array_equal(p.mask, mask.numpy())
  with pytest.raises(CheckpointError, match=r"'fc.__weight_mma_mask' is an apex ASP mask but its weight"):
    torch_interop.decode_checkpoint({"fc.__weight_mma_mask": mask})


def test_torch_sparse_layouts():
  dense = torch.randn(16, 32) * torch.from_numpy(_block_mask(16, 32, (8, 8), seed=1))
  coo = dense.to_sparse()
  # A stored zero is still a specified entry, so it stays in the mask.
  coo_explicit = torch.sparse_coo_tensor(torch.tensor([[0, 1], [0, 5]]), torch.tensor([0.0, 2.0]), (16, 32))
  sd = {
      "coo": coo,
      "csr": dense.to_sparse_csr(),
      "csc": dense.to_sparse_csc(),
      "bsr": dense.to_sparse_bsr((8, 8)),
      "explicit": coo_explicit,
  }
  params = torch_interop.decode_checkpoint(sd)
  for k in ("coo", "csr", "csc"):
    np.testing.assert_array_equal(params[k].masked_value, dense.numpy())
    np.testing.assert_array_equal(params[k].mask, dense.numpy() != 0)
    assert params[k].format == f"torch sparse_{k}"
  bsr = params["bsr"]
  np.testing.assert_array_equal(bsr.masked_value, dense.numpy())
  assert bsr.pattern.kind == "block" and bsr.pattern.block_shape in ((8, 8), (8, 16), (16, 8), (16, 16))
  e = params["explicit"]
  assert e.mask[0, 0] and e.mask[1, 5] and e.mask.sum() == 2


def _hf_block_sparse_state_dict(dense, block_mask, block_shape, prefix="fc", *, shuffle=False, emulator=False):
  """The state dict of pytorch_block_sparse's BlockSparseLinear (block_sparse.py, BlockSparseMatrixBase).

  rebuild()/build_indices(): nnz = nonzero(block_mask) in row-major order; block_ptr gives each block's
  index in `data`; cols_a = stack([cols, block_ptr], 1), row_start_ends_a = CSR offsets over block rows;
  the "b" indices are the same for the transposed mask; blocks = nnz sorted by block_ptr, flipped to
  (col, row) and flattened; data is (nnz * b0, b1) holding each block transposed (see to_sparse()).
  """
  b0, b1 = block_shape
  X, Y = block_mask.shape
  nnz = np.argwhere(block_mask)
  n = len(nnz)
  rng = np.random.default_rng(0)
  block_ptr = rng.permutation(n) if shuffle else np.arange(n)
  rows, cols = nnz[:, 0], nnz[:, 1]
  row_start_ends_a = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=X))]).astype(np.int32)
  cols_a = np.stack([cols, block_ptr], 1).astype(np.int32)
  block_indices = np.zeros(X * Y, np.int64)
  block_indices[rows * Y + cols] = block_ptr + 1
  bt = block_indices.reshape(X, Y).T.reshape(-1)
  ptr_b = bt[bt != 0] - 1
  nnzt = np.argwhere(block_mask.T)
  rows_b = np.stack([nnzt[:, 1], ptr_b], 1).astype(np.int32)
  col_start_ends_b = np.concatenate([[0], np.cumsum(np.bincount(cols, minlength=Y))]).astype(np.int32)
  blocks = np.fliplr(nnz[np.argsort(block_ptr)]).reshape(-1).astype(np.int32)
  data = np.zeros((n, b1, b0), np.float32)
  for (r, c), p in zip(nnz, block_ptr, strict=True):
    data[p] = dense[r * b0 : (r + 1) * b0, c * b1 : (c + 1) * b1].T
  sd = {
      f"{prefix}.weight.data": torch.from_numpy(data.reshape(n * b0, b1)),
      f"{prefix}.weight.cols_a": torch.from_numpy(cols_a),
      f"{prefix}.weight.row_start_ends_a": torch.from_numpy(row_start_ends_a),
      f"{prefix}.weight.rows_b": torch.from_numpy(rows_b),
      f"{prefix}.weight.col_start_ends_b": torch.from_numpy(col_start_ends_b),
      f"{prefix}.weight.blocks": torch.from_numpy(blocks),
      f"{prefix}.bias": torch.zeros(dense.shape[0]),
  }
  if emulator:
    sd[f"{prefix}.weight._dense"] = torch.from_numpy(dense * np.kron(block_mask, np.ones(block_shape)))
  return sd


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("block_shape", [(32, 32), (16, 32)])
def test_pytorch_block_sparse(tmp_path, shuffle, block_shape):
  rng = np.random.default_rng(0)
  dense = rng.standard_normal((64, 128)).astype(np.float32)
  block_mask = rng.random((64 // block_shape[0], 128 // block_shape[1])) < 0.5
  block_mask[0, 0] = block_mask[-1, -1] = True
  sd = _hf_block_sparse_state_dict(dense, block_mask, block_shape, shuffle=shuffle)
  save_file(sd, str(tmp_path / "bs.safetensors"))  # safetensors sorts the keys
  params = torch_interop.decode_checkpoint(tmp_path / "bs.safetensors")
  assert sorted(params) == ["fc.bias", "fc.weight"]
  p = params["fc.weight"]
  full = np.kron(block_mask, np.ones(block_shape, bool))
  assert p.format == "pytorch_block_sparse" and p.shape == (64, 128)
  np.testing.assert_array_equal(p.mask, full)
  np.testing.assert_array_equal(p.masked_value, np.where(full, dense, 0))
  assert p.pattern.kind == "block"


def test_pytorch_block_sparse_emulator_and_bad_indices():
  rng = np.random.default_rng(1)
  dense = rng.standard_normal((64, 64)).astype(np.float32)
  block_mask = np.array([[True, False], [True, True]])
  sd = _hf_block_sparse_state_dict(dense, block_mask, (32, 32), emulator=True)
  sd["fc.weight._dense"] = sd["fc.weight._dense"] * 2  # the emulator trains this copy
  p = torch_interop.decode_checkpoint(sd)["fc.weight"]
  np.testing.assert_allclose(p.masked_value, 2 * np.where(np.kron(block_mask, np.ones((32, 32))), dense, 0))
  bad = dict(sd)
  bad["fc.weight.cols_a"] = torch.tensor([[0, 0], [0, 1], [5, 2]], dtype=torch.int32)
  with pytest.raises(CheckpointError, match=r"fc\.weight\.cols_a\[:, 0\].*outside \[0, 2\)"):
    torch_interop.decode_checkpoint(bad)
  bad = dict(sd)
  del bad["fc.weight.data"]
  with pytest.raises(CheckpointError, match="looks like pytorch_block_sparse"):
    torch_interop.decode_checkpoint(bad)


class _SparsePropLinear(torch.nn.Module):
  """The attribute layout of sparseprop/modules/linear.py SparseLinear: W_val is the Parameter, while
  W_idx = (indptr, indices) from scipy's csr_matrix (utils.to_csr_2d) is a plain attribute, outside
  state_dict(); N, M = dense_weight.shape."""

  def __init__(self, dense_weight, bias):
    super().__init__()
    self.N, self.M = dense_weight.shape
    spa = scipy.sparse.csr_matrix(dense_weight.numpy())
    self.W_val = torch.nn.Parameter(torch.tensor(spa.data))
    self.W_idx = (torch.tensor(spa.indptr).int(), torch.tensor(spa.indices).int())
    self.bias = torch.nn.Parameter(bias)


def test_sparseprop():
  w = torch.randn(16, 24) * (torch.rand(16, 24) < 0.3)
  net = torch.nn.Sequential(_SparsePropLinear(w, torch.randn(16)))
  params = torch_interop.decode_checkpoint(net)  # the module itself: W_idx is read from it
  p = params["0.weight"]
  assert p.format == "SparseProp SparseLinear"
  np.testing.assert_array_equal(p.masked_value, w.numpy())
  np.testing.assert_array_equal(p.mask, w.numpy() != 0)
  with pytest.raises(CheckpointError, match="CSR indices \\(W_idx\\) are not part of its state_dict"):
    torch_interop.decode_checkpoint(net.state_dict())


def test_nm_recompute_and_masked_dense():
  w = torch.randn(8, 16)
  sd = {"a.weight": w, "b.weight": w, "a.bias": torch.ones(8)}
  params = torch_interop.decode_checkpoint(sd, nm={r"^a\.": (2, 4)})
  assert str(params["a.weight"].pattern) == "2:4" and params["a.weight"].format == "dense, 2:4 recomputed"
  assert params["b.weight"].mask is None and params["a.bias"].mask is None
  with pytest.raises(CheckpointError, match=r"'a\.weight': cannot recompute an N:M mask.*m=3 must divide"):
    torch_interop.decode_checkpoint({"a.weight": w}, nm=(2, 3))
  mask = (torch.rand(8, 16) < 0.5).float()
  p = torch_interop.decode_checkpoint({"fc.weight": w, "fc.weight_mask": mask})["fc.weight"]
  assert p.format == "masked dense"
  np.testing.assert_array_equal(p.mask, mask.numpy() == 1)


def test_bad_masks():
  w = torch.randn(4, 8)
  mask = torch.ones(4, 8)
  mask[1, 2] = 0.5
  with pytest.raises(CheckpointError, match=r"'fc\.weight_mask' must hold only 0 and 1, but has 0\.5 at \(1, 2\)"):
    torch_interop.decode_checkpoint({"fc.weight_orig": w, "fc.weight_mask": mask})
  with pytest.raises(CheckpointError, match=r"'fc\.weight_mask' has shape \(4, 4\) but its weight has shape \(4, 8\)"):
    torch_interop.decode_checkpoint({"fc.weight_orig": w, "fc.weight_mask": torch.ones(4, 4)})
  with pytest.raises(CheckpointError, match=r"prune's \*_orig, but fc\.weight_mask is missing"):
    torch_interop.decode_checkpoint({"fc.weight_orig": w})
  # ambiguous and orphaned keys
  with pytest.raises(CheckpointError, match=r"'fc\.weight' appears twice .*ambiguous"):
    torch_interop.decode_checkpoint({"fc.weight": w, "fc.weight_orig": w, "fc.weight_mask": torch.ones(4, 8)})
  with pytest.raises(CheckpointError, match=r"parametrization key without its 'parametrizations\.<p>\.original'"):
    torch_interop.decode_checkpoint({"fc.parametrizations.weight.0.mask": torch.ones(4, 8)})
  with pytest.raises(CheckpointError, match="apex ASP's pruned-weight store, but its __<p>_mma_mask is missing"):
    torch_interop.decode_checkpoint({"fc.weight": w, "fc.__weight_mma_pruned_p": w})
  # collect mode: the problem is reported per parameter
  params = torch_interop.decode_checkpoint({"fc.weight_orig": w, "ok": w}, on_error="collect")
  assert params["fc.weight"].problem and params["ok"].problem is None


# -------------------------------------------------------------------------------------------------
# Into Flax NNX.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["unstructured", "block", "nm"])
def test_load_nnx_builds_sparse_layers_and_round_trips_masks(kind):
  net = _mlp()
  if kind == "unstructured":
    prune.l1_unstructured(net[0], "weight", amount=0.7)
    prune.random_unstructured(net[2], "weight", amount=0.5)
    expected = (MaskedLinear, MaskedLinear)
  elif kind == "block":
    prune.custom_from_mask(net[0], "weight", torch.from_numpy(_block_mask(128, 64, (32, 16), seed=2)))
    prune.custom_from_mask(net[2], "weight", torch.from_numpy(_block_mask(32, 128, (16, 32), seed=3)))
    expected = (BlockSparseLinear, BlockSparseLinear)
  else:
    prune.custom_from_mask(net[0], "weight", torch.from_numpy(_nm_mask((128, 64))))
    prune.custom_from_mask(net[2], "weight", torch.from_numpy(_nm_mask((32, 128), 1, 4)))
    expected = (NMLinear, NMLinear)
  model = _flax_mlp()
  report = torch_interop.load_nnx(model, net.state_dict(), name_map=SEQ)
  assert (type(model.layers[0]), type(model.layers[2])) == expected
  assert report.torch_names == {"layers.0": "0", "layers.2": "2"}
  if kind == "block":
    # torch blocks (rows, cols) = (out, in) become Flax (in, out) blocks; the largest constant block is found
    (a, b), (c, d) = model.layers[0].block_shape, model.layers[2].block_shape
    assert a % 16 == 0 and b % 32 == 0 and c % 32 == 0 and d % 16 == 0
  _forward_close(net, model)
  # torch masks -> jaxsparse -> torch masks, bit for bit (prune stores float32 masks)
  masks = torch_interop.export_masks(model, torch_names=report.torch_names, dtype=torch.float32)
  assert sorted(masks) == ["0.weight_mask", "2.weight_mask"]
  for i in (0, 2):
    assert masks[f"{i}.weight_mask"].dtype == net[i].weight_mask.dtype
    assert torch.equal(masks[f"{i}.weight_mask"], net[i].weight_mask)
  fresh = _mlp()
  torch_interop.apply_masks(fresh, masks)
  for i in (0, 2):
    assert torch.equal(fresh[i].weight_mask, net[i].weight_mask)
  with torch.no_grad():
    x = torch.randn(3, 64)
    assert torch.equal(fresh(x), net(x))
  # Linen variables carry the same masks
  variables = torch_interop.to_linen_variables(net.state_dict(), name_map=SEQ)
  linen_masks = torch_interop.export_masks(variables, torch_names=report.torch_names, dtype=torch.float32)
  assert all(torch.equal(linen_masks[k], masks[k]) for k in masks)


def test_nm_mask_with_kept_zero_stays_exact():
  """NMLinear recomputes its mask from |kernel|; a kept weight that is exactly 0 would move the mask,
  so such a layer becomes a MaskedLinear and the mask still round-trips bit for bit."""
  net = _mlp()
  mask = _nm_mask((128, 64))
  mask[0, :4] = [False, False, True, True]
  with torch.no_grad():
    net[0].weight[0, 2] = 0.0
  prune.custom_from_mask(net[0], "weight", torch.from_numpy(mask))
  model = _flax_mlp()
  report = torch_interop.load_nnx(model, net.state_dict(), name_map=SEQ)
  assert isinstance(model.layers[0], MaskedLinear) and str(report.layers[0].pattern) == "2:4"
  masks = torch_interop.export_masks(model, torch_names=report.torch_names, dtype=torch.float32)
  assert torch.equal(masks["0.weight_mask"], net[0].weight_mask)
  _forward_close(net, model)


def test_load_nnx_dense_into_existing_sparse_layers_and_bf16():
  net = _mlp()
  model = _flax_mlp()
  model.layers[0] = BlockSparseLinear.from_dense(model.layers[0], density=0.5, block_shape=(16, 16))
  block_mask = np.asarray(model.layers[0].block_mask)
  torch_interop.load_nnx(model, net.state_dict(), name_map=SEQ)
  assert isinstance(model.layers[0], BlockSparseLinear)
  np.testing.assert_array_equal(np.asarray(model.layers[0].block_mask), block_mask)  # kept its own pattern
  w = net[0].weight.detach().numpy().T * np.kron(block_mask, np.ones((16, 16)))
  np.testing.assert_array_equal(np.asarray(model.layers[0].sparse_kernel.to_dense()), w)
  # bf16 checkpoint into an f32 model: values cast to the parameter dtype
  sd = {k: v.to(torch.bfloat16) for k, v in net.state_dict().items()}
  model = _flax_mlp()
  torch_interop.load_nnx(model, sd, name_map=SEQ)
  assert model.layers[2].kernel[...].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(model.layers[2].kernel[...]), sd["2.weight"].float().numpy().T)


def test_load_nnx_conv_norm_embed():
  class TNet(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.emb = torch.nn.Embedding(10, 8)
      self.conv = torch.nn.Conv2d(8, 16, 3)
      self.norm = torch.nn.LayerNorm(16)
      self.bn = torch.nn.BatchNorm2d(16)

  class FNet(nnx.Module):
    def __init__(self):
      self.emb = nnx.Embed(10, 8, rngs=nnx.Rngs(0))
      self.conv = nnx.Conv(8, 16, (3, 3), padding="VALID", rngs=nnx.Rngs(0))
      self.norm = nnx.LayerNorm(16, rngs=nnx.Rngs(0))
      self.bn = nnx.BatchNorm(16, use_running_average=True, rngs=nnx.Rngs(0))

  tnet = TNet()
  with torch.no_grad():
    tnet.bn.running_mean.normal_()
    tnet.bn.running_var.uniform_(0.5, 2)
  prune.random_unstructured(tnet.conv, "weight", amount=0.5)
  fnet = FNet()
  report = torch_interop.load_nnx(fnet, tnet.state_dict())
  layers = {r.flax_path: r.layer for r in report.layers}
  assert layers["emb"] == "Embed" and layers["norm"] == "LayerNorm" and layers["bn"] == "BatchNorm"
  assert layers["conv"] == "MaskedConv"
  x = torch.randn(2, 8, 7, 7)
  with torch.no_grad():
    expected = tnet.conv(x).permute(0, 2, 3, 1).numpy()
  got = fnet.conv(jnp.asarray(x.permute(0, 2, 3, 1).numpy()))
  np.testing.assert_allclose(np.asarray(got), expected, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(fnet.emb.embedding[...]), tnet.emb.weight.detach().numpy())
  np.testing.assert_array_equal(np.asarray(fnet.bn.mean[...]), tnet.bn.running_mean.numpy())
  # and back: conv in OIHW with its mask
  sd = torch_interop.export_state_dict(fnet, format="prune")
  fresh = TNet()
  prune.identity(fresh.conv, "weight")
  fresh.load_state_dict(sd)
  assert torch.equal(fresh.conv.weight_mask, tnet.conv.weight_mask)
  with torch.no_grad():
    assert torch.allclose(fresh.conv(x), tnet.conv(x), atol=1e-6)


def _nm_along_inputs(w, n, m):
  return torch.from_numpy(torch_interop._patterns.nm_mask_torch(w.detach().numpy(), n, m))


@pytest.mark.parametrize("existing", ["MaskedConv", "NMConv", "nnx.Conv(mask=)"])
@pytest.mark.parametrize("torch_mask", ["unstructured", "1:4"])
def test_pruned_torch_conv_replaces_the_mask_of_a_sparse_conv_that_is_there(existing, torch_mask):
  """A pruned torch conv loaded into a conv that has its own mask computes what torch does: the torch mask replaces
  the layer's (before, both masks applied, or an NMConv kept its 2:4 where torch kept 1:4)."""
  torch.manual_seed(0)
  conv = torch.nn.Conv2d(8, 16, 3, padding=1)
  if torch_mask == "unstructured":
    prune.l1_unstructured(conv, "weight", amount=0.6)
  else:
    prune.custom_from_mask(conv, "weight", _nm_along_inputs(conv.weight, 1, 4))
  dense = nnx.Conv(8, 16, (3, 3), padding=1, rngs=nnx.Rngs(1))
  own_mask = jax.random.bernoulli(jax.random.key(2), 0.5, dense.kernel.shape)
  layer = {"MaskedConv": lambda: jaxsparse.layers.MaskedConv.from_dense(dense, sparsity=0.5),
           "NMConv": lambda: jaxsparse.layers.NMConv.from_dense(dense, n=2, m=4),
           "nnx.Conv(mask=)": lambda: nnx.Conv(8, 16, (3, 3), padding=1, mask=own_mask, rngs=nnx.Rngs(1))}[existing]()
  model = nnx.Sequential(layer)
  report = torch_interop.load_nnx(model, conv.state_dict(), name_map={"": "layers.0"})
  assert report.layers[0].layer == ("MaskedConv" if torch_mask == "unstructured" else "NMConv")
  x = np.random.default_rng(0).standard_normal((2, 8, 8, 8)).astype(np.float32)  # NHWC
  with torch.no_grad():
    expected = conv(torch.from_numpy(x).permute(0, 3, 1, 2)).permute(0, 2, 3, 1).numpy()
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(x))), expected, atol=1e-5, rtol=1e-5)
  masks = torch_interop.export_masks(model, torch_names=report.torch_names, dtype=torch.float32)
  assert torch.equal(masks["weight_mask"], conv.weight_mask)


def test_nm_conv_of_the_same_n_m_keeps_its_settings():
  conv = torch.nn.Conv2d(8, 16, 3)
  prune.custom_from_mask(conv, "weight", _nm_along_inputs(conv.weight, 2, 4))
  layer = jaxsparse.layers.NMConv(8, 16, (3, 3), n=2, m=4, sr_ste_decay=0.5, rngs=nnx.Rngs(0))
  model = nnx.Sequential(layer)
  torch_interop.load_nnx(model, conv.state_dict(), name_map={"": "layers.0"})
  assert model.layers[0] is layer and layer.sr_ste_decay == 0.5
  np.testing.assert_array_equal(np.asarray(layer.nm_mask), np.transpose(conv.weight_mask.numpy(), (2, 3, 1, 0)) == 1)


def test_nm_conv_with_a_weight_mask_exports_what_its_forward_computes():
  """An NMConv whose Flax weight mask leaves a group of 4 input channels fewer than 2 nonzero weights: its N:M mask
  "keeps" masked weights there, and the export wrote their raw (unmasked) values into the torch weight and mask."""
  own = np.ones((3, 8, 8), bool)
  own[:, :3] = False  # channels 0-2 masked: the first group of 4 keeps 1
  layer = jaxsparse.layers.NMConv(8, 8, (3,), padding=1, mask=jnp.asarray(own), rngs=nnx.Rngs(0))
  conv = torch.nn.Conv1d(8, 8, 3, padding=1)
  conv.load_state_dict(torch_interop.export_state_dict(layer))
  x = np.random.default_rng(0).standard_normal((2, 6, 8)).astype(np.float32)
  with torch.no_grad():
    got = conv(torch.from_numpy(x).permute(0, 2, 1)).permute(0, 2, 1).numpy()
  np.testing.assert_allclose(got, np.asarray(layer(jnp.asarray(x))), atol=1e-5)
  mask = torch_interop.export_masks(layer)["weight_mask"].numpy()
  np.testing.assert_array_equal(mask, np.transpose(np.asarray(layer.pruned_kernel()) != 0, (2, 1, 0)))


_SCALED_MASK = np.random.default_rng(3).choice([0.0, 0.5, 2.0], size=(3, 8, 16)).astype(np.float32)


class _ScaledMaskConv(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Conv(16, (3,), mask=_SCALED_MASK, name="conv")(x)


@pytest.mark.parametrize("kind", ["NMConv", "nnx.Conv(mask=)", "linen NMConv"])
def test_conv_with_a_weight_mask_of_other_values_exports_its_forward(kind):
  """Flax multiplies a conv's kernel by its weight mask (0.5 halves a weight): the export wrote the unscaled kernel
  (where(kept, K), the forward runs where(kept, K * mask)), so the torch conv computed another function."""
  x = np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32)
  if kind == "linen NMConv":
    variables = _ScaledMaskConv().init(jax.random.key(0), x)
    sparse, sparse_vars, _ = jaxsparse.sparsify_linen(_ScaledMaskConv(), variables, jaxsparse.NM(2, 4), x)
    flax_y = np.asarray(sparse.apply(sparse_vars, x))
    state = torch_interop.export_state_dict(sparse_vars, module=sparse, torch_names={"conv": ""})
    masks = torch_interop.export_masks(sparse_vars, module=sparse, torch_names={"conv": ""})
  else:
    cls = jaxsparse.layers.NMConv if kind == "NMConv" else nnx.Conv
    layer = cls(8, 16, (3,), mask=jnp.asarray(_SCALED_MASK), rngs=nnx.Rngs(0))
    flax_y = np.asarray(layer(jnp.asarray(x)))
    state, masks = torch_interop.export_state_dict(layer), torch_interop.export_masks(layer)
  conv = torch.nn.Conv1d(8, 16, 3, padding=1)
  conv.load_state_dict(state)
  with torch.no_grad():
    torch_y = conv(torch.from_numpy(x).permute(0, 2, 1)).permute(0, 2, 1).numpy()
  assert np.abs(flax_y).max() > 0.1
  np.testing.assert_allclose(torch_y, flax_y, rtol=1e-5, atol=1e-5)
  # The mask marks the weights the forward keeps: the exported weight's nonzeros, none where the weight mask is 0.
  mask = masks["weight_mask"].numpy()
  np.testing.assert_array_equal(mask, state["weight"].numpy() != 0)
  assert not (mask & (np.transpose(_SCALED_MASK, (2, 1, 0)) == 0)).any()


@pytest.mark.parametrize(("bad", "error", "match"), [
    (lambda m: m.astype(jnp.float32) * 0.5, TypeError, r"must be a boolean array, got dtype float32"),
    (lambda m: m.astype(jnp.int32) * 2, TypeError, r"must be a boolean array, got dtype int32"),
    (lambda m: m[:1], ValueError, r"must have the weight's shape \(16, 8\), got \(1, 8\)"),
])
def test_linen_export_refuses_a_sparsity_mask_the_forward_refuses(bad, error, match):
  """A Linen "sparsity" mask of 0.5 / 2 was read as bool (.astype(bool)) and one of shape (1, out) broadcast, where the
  layer's forward refuses both: the export named neither the layer nor the problem."""
  variables = MaskedDense(8, sparsity=0.5).init(jax.random.key(0), jnp.ones((1, 16)))
  variables = {"params": {"fc": variables["params"]}, "sparsity": {"fc": {"mask": bad(variables["sparsity"]["mask"])}}}
  for export in (torch_interop.export_state_dict, torch_interop.export_masks):
    with pytest.raises(error, match=r"^fc: its 'sparsity' collection's mask " + match):
      export(variables)


@pytest.mark.parametrize("pruned", [False, True])
def test_conv_bias_of_the_wrong_shape_is_refused(pruned):
  """A torch conv bias of shape (1,) was broadcast into the (16,) bias of the MaskedConv a pruned conv becomes."""
  sd = {"weight": torch.randn(16, 8, 3, 3), "bias": torch.ones(1)}
  if pruned:
    sd["weight_mask"] = (torch.rand(16, 8, 3, 3) < 0.5).float()
  model = nnx.Sequential(nnx.Conv(8, 16, (3, 3), rngs=nnx.Rngs(0)))
  msg = r"torch 'bias' has shape \(1,\), but the Flax model's 'layers\.0\.bias' needs a torch shape of \(16,\)"
  with pytest.raises(CheckpointError, match=msg):
    torch_interop.load_nnx(model, sd, name_map={"": "layers.0"})
  assert type(model.layers[0]) is nnx.Conv


def test_load_nnx_errors_leave_model_untouched():
  net = _mlp()
  model = _flax_mlp()
  before = np.asarray(model.layers[0].kernel[...]).copy()
  with pytest.raises(CheckpointError, match=r"no Flax module: '0\.weight' \(-> Flax '0'; did you mean 'layers\.0'\?\)"):
    torch_interop.load_nnx(model, net.state_dict())
  sd = net.state_dict()
  sd["2.weight"] = torch.randn(32, 100)
  msg = r"torch '2\.weight' has shape \(32, 100\), but the Flax model's 'layers\.2\.kernel' needs .* \(32, 128\)"
  with pytest.raises(CheckpointError, match=msg):
    torch_interop.load_nnx(model, sd, name_map=SEQ)
  np.testing.assert_array_equal(np.asarray(model.layers[0].kernel[...]), before)  # nothing was written
  small = nnx.Sequential(nnx.Linear(64, 128, rngs=nnx.Rngs(0)))
  with pytest.raises(CheckpointError, match=r"torch parameters with no Flax module: '2\.weight'"):
    torch_interop.load_nnx(small, net.state_dict(), name_map=SEQ)
  report = torch_interop.load_nnx(small, net.state_dict(), name_map=SEQ, strict=False)
  assert sorted(report.unexpected) == ["2.bias", "2.weight"]
  torch_interop.load_nnx(small, net.state_dict(), name_map=SEQ, ignore=["2.*"])
  sd = dict(net.state_dict())
  sd["0.scale"] = torch.ones(1)
  with pytest.raises(CheckpointError, match=r"torch \['0\.scale'\] have no place in the Flax Linear 'layers\.0'"):
    torch_interop.load_nnx(model, sd, name_map=SEQ)
  with pytest.raises(CheckpointError, match=r"both map to the Flax path 'layers\.0'"):
    torch_interop.load_nnx(model, net.state_dict(), name_map=lambda p: "layers.0")
  big = _flax_mlp()
  with pytest.raises(CheckpointError, match=r"Flax parameters with no torch weights: \['layers\.2\.(kernel|bias)'"):
    torch_interop.load_nnx(big, {k: v for k, v in net.state_dict().items() if k.startswith("0.")}, name_map=SEQ)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool, torch.int8, torch.uint8])
def test_non_float_weights_are_refused_not_cast(dtype):
  """A complex weight would lose its imaginary part, an int8 one its scales, a bool one is a mask: all raise."""

  def bad(*shape):
    if dtype.is_complex:
      return torch.complex(torch.ones(shape), torch.full(shape, 5.0))
    return torch.ones(shape, dtype=dtype)

  pattern = rf"torch '{{key}}' has dtype {str(dtype).removeprefix('torch.')}, but {{into}} takes a real floating-point "
  pattern += r"tensor \(float16, bfloat16, float32 or float64\)"
  model = nnx.Sequential(nnx.Linear(8, 4, rngs=nnx.Rngs(0)))
  before = np.asarray(model.layers[0].kernel[...]).copy()
  for key in ("0.weight", "0.bias"):  # the weight, and the bias of a float weight
    sd = {"0.weight": torch.ones(4, 8), "0.bias": torch.zeros(4), key: bad(4, 8) if key == "0.weight" else bad(4)}
    into = re.escape(f"the Flax 'layers.0.{'kernel' if key == '0.weight' else 'bias'}'")
    with pytest.raises(CheckpointError, match=pattern.format(key=re.escape(key), into=into)):
      torch_interop.load_nnx(model, sd, name_map=SEQ)
    with pytest.raises(CheckpointError, match=pattern.format(key=re.escape(key), into="Flax module 'layers.0'")):
      torch_interop.to_linen_variables(sd, name_map=SEQ)
  np.testing.assert_array_equal(np.asarray(model.layers[0].kernel[...]), before)
  # pruned (the value key is named), sparsified by a rule, a conv, a norm and an embedding table
  mask = torch.ones(4, 8, dtype=torch.bool)
  with pytest.raises(CheckpointError, match=pattern.format(key=r"0\.weight_orig", into="the Flax 'layers.0.kernel'")):
    torch_interop.load_nnx(model, {"0.weight_orig": bad(4, 8), "0.weight_mask": mask, "0.bias": torch.zeros(4)},
                           name_map=SEQ)
  with pytest.raises(CheckpointError, match=pattern.format(key=r"fc\.weight", into=r"the Flax 'fc\.kernel'")):
    torch_interop.to_linen_variables({"fc.weight": bad(4, 8)}, rules=jaxsparse.NM(2, 4))
  conv = nnx.Conv(2, 4, (3, 3), use_bias=False, rngs=nnx.Rngs(0))
  with pytest.raises(CheckpointError, match=pattern.format(key="weight", into="the Flax 'kernel'")):
    torch_interop.load_nnx(conv, {"weight": bad(4, 2, 3, 3)})
  with pytest.raises(CheckpointError, match=pattern.format(key="weight", into="the Flax 'scale'")):
    torch_interop.load_nnx(nnx.LayerNorm(8, rngs=nnx.Rngs(0)), {"weight": bad(8), "bias": torch.zeros(8)})
  with pytest.raises(CheckpointError, match=pattern.format(key="weight", into="the Flax 'embedding'")):
    torch_interop.load_nnx(nnx.Embed(4, 8, rngs=nnx.Rngs(0)), {"weight": bad(4, 8)})


def test_meta_and_nested_tensors_are_refused_naming_the_key():
  """A state dict of a model built on the 'meta' device (weights never loaded) raised torch's NotImplementedError,
  a nested tensor an internal RuntimeError; neither named the key."""
  with torch.device("meta"):
    meta_net = torch.nn.Linear(8, 4)
  model = nnx.Sequential(nnx.Linear(8, 4, rngs=nnx.Rngs(0)))
  with pytest.raises(CheckpointError, match=r"Linear module: 'weight' is a meta tensor of shape \(4, 8\): it has no "
                     "values"):
    torch_interop.load_nnx(model, meta_net, name_map={"": "layers.0"})
  sd = {"fc.weight_orig": torch.ones(4, 8), "fc.weight_mask": torch.empty(4, 8, device="meta")}
  with pytest.raises(CheckpointError, match=r"'fc\.weight_mask' is a meta tensor"):
    torch_interop.to_linen_variables(sd)
  nested = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(3, 3)])
  with pytest.raises(CheckpointError, match=r"'fc\.weight' is a nested tensor; expected a dense \(strided\) tensor"):
    torch_interop.decode_checkpoint({"fc.weight": nested})


def test_float_weights_and_bool_masks_still_load():
  mask = torch.from_numpy(_nm_mask((4, 8)))
  for dtype in (torch.float16, torch.bfloat16, torch.float64):
    model = nnx.Sequential(nnx.Linear(8, 4, rngs=nnx.Rngs(0)))
    sd = {"0.weight_orig": torch.ones(4, 8, dtype=dtype), "0.weight_mask": mask, "0.bias": torch.ones(4, dtype=dtype)}
    torch_interop.load_nnx(model, sd, name_map=SEQ, sparse=False)
    np.testing.assert_array_equal(np.asarray(model.layers[0].kernel[...]), mask.numpy().T.astype(np.float32))
    v = torch_interop.to_linen_variables({"fc.weight": torch.ones(4, 8, dtype=dtype), "fc.weight_mask": mask})
    np.testing.assert_array_equal(v["sparsity"]["fc"]["mask"], mask.numpy().T)
  # integer buffers that are no float weight pass as before: BatchNorm's counter, a Linen variable of another name
  bn = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
  torch_interop.load_nnx(bn, torch.nn.BatchNorm1d(4).state_dict())
  v = torch_interop.to_linen_variables({"emb.weight": torch.ones(8, 4), "emb.position_ids": torch.arange(6)})
  assert v["params"]["emb"]["position_ids"].dtype == jnp.int32


def test_import_rules_reject_transposable_nm():
  # Import rules compute plain N:M masks; transposable ones are for the SR-STE layers of jaxsparse.sparsify.
  params = torch_interop.decode_checkpoint(torch.nn.Sequential(torch.nn.Linear(16, 8)).state_dict())
  with pytest.raises(CheckpointError, match=r"'0\.weight'.*a PyTorch import rule computes plain N:M masks"):
    torch_interop.apply_rules(params, jaxsparse.NM(2, 4, transposable=True))
  assert torch_interop.apply_rules(params, jaxsparse.NM(2, 4))["0.weight"].mask.mean() == 0.5


def test_map_name_forms():
  assert torch_interop.map_name(None, "a.b") == "a.b"
  assert torch_interop.map_name({"a.b": "c"}, "a.b") == "c"
  assert torch_interop.map_name({"a.b": "c"}, "x") == "x"
  assert torch_interop.map_name([(r"^pooler", None)], "pooler.dense") is None
  assert torch_interop.map_name([(r"\.self\.", "."), (r"^", "bert.")], "att.self.q") == "bert.att.q"
  with pytest.raises(TypeError, match="rules must be"):
    torch_interop.map_name(["oops"], "a")


# -------------------------------------------------------------------------------------------------
# Export formats.
# -------------------------------------------------------------------------------------------------


def _sparse_flax_model():
  model = _flax_mlp()
  model.layers[0] = BlockSparseLinear.from_dense(model.layers[0], density=0.5, block_shape=(16, 32))
  model.layers[2] = NMLinear.from_dense(model.layers[2], n=2, m=4)
  return model


def test_export_state_dict_formats():
  model = _sparse_flax_model()
  names = {"layers.0": "0", "layers.2": "2"}
  x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
  expected = np.asarray(model(jnp.asarray(x)))

  dense = _mlp()
  dense.load_state_dict(torch_interop.export_state_dict(model, torch_names=names))
  with torch.no_grad():
    np.testing.assert_allclose(dense(torch.from_numpy(x)).numpy(), expected, atol=1e-5)

  pruned = _mlp()
  for i in (0, 2):
    prune.identity(pruned[i], "weight")
  pruned.load_state_dict(torch_interop.export_state_dict(model, format="prune", torch_names=names))
  with torch.no_grad():
    np.testing.assert_allclose(pruned(torch.from_numpy(x)).numpy(), expected, atol=1e-5)

  ao = torch_interop.export_state_dict(model, format="ao", torch_names=names)
  assert ao["0.parametrizations.weight.0.mask"].dtype == torch.bool
  back = torch_interop.decode_checkpoint(ao)
  assert back["0.weight"].pattern.kind == "block" and str(back["2.weight"].pattern) == "2:4"

  bsr = torch_interop.export_state_dict(model, format="bsr", torch_names=names)
  w0 = bsr["0.weight"]
  assert w0.layout == torch.sparse_bsr and tuple(w0.values().shape[1:]) == (32, 16)
  assert w0.values().shape[0] == model.layers[0].nnz_blocks
  np.testing.assert_array_equal(w0.to_dense().numpy(), np.asarray(model.layers[0].sparse_kernel.to_dense()).T)
  assert bsr["2.weight"].layout == torch.strided

  with pytest.raises(CheckpointError, match=r"0\.weight: format='semi_structured' needs 2-D 2:4 weights.*block 32x16"):
    torch_interop.export_state_dict(model, format="semi_structured", torch_names=names)
  semi = torch_interop.export_state_dict(model.layers[2], format="semi_structured", dtype=torch.float16)
  assert semi["weight"].dtype == torch.float16
  g = (semi["weight"] != 0).reshape(32, 32, 4).sum(-1)
  assert int(g.max()) <= 2
  with pytest.raises(ValueError, match="format must be one of"):
    torch_interop.export_state_dict(model, format="coo")
  with pytest.raises(CheckpointError, match=r"torch_names has no entry for the Flax module 'layers\.2'"):
    torch_interop.export_masks(model, torch_names={"layers.0": "0"})


@pytest.mark.parametrize("shape", [(1, 4), (4, 1), (4, 8)])
def test_exported_masks_do_not_share_the_model_memory(shape):
  """A mask whose torch layout is the same bytes as the Flax one ((1, n) or (n, 1)) came back as a view of the JAX
  array's read-only buffer: torch warned, and writing to the exported mask changed the model's mask."""
  mask = np.asarray(jax.random.bernoulli(jax.random.key(0), 0.5, shape))
  layer = MaskedLinear(*shape, mask=jnp.asarray(mask), rngs=nnx.Rngs(0))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # "The given NumPy array is not writable"
    exported = {
        "masks": torch_interop.export_masks(layer)["weight_mask"],
        "ao": torch_interop.export_state_dict(layer, format="ao")["parametrizations.weight.0.mask"],
    }
  for name, t in exported.items():
    assert t.dtype == torch.bool and torch.equal(t, torch.from_numpy(mask.T.copy())), name
    t.logical_not_()
    np.testing.assert_array_equal(np.asarray(layer.mask[...]), mask, err_msg=name)


def test_apply_masks_errors_leave_module_untouched():
  net = _mlp()
  good = torch.ones(128, 64, dtype=torch.bool)
  with pytest.raises(CheckpointError, match="the torch model has no module 'nope'"):
    torch_interop.apply_masks(net, {"0.weight_mask": good, "nope.weight_mask": good})
  with pytest.raises(CheckpointError, match=r"'2\.weight_mask' has shape \(128, 64\) but .* \(32, 128\)"):
    torch_interop.apply_masks(net, {"0.weight_mask": good, "2.weight_mask": good})
  with pytest.raises(CheckpointError, match="must hold only 0 and 1"):
    torch_interop.apply_masks(net, {"0.weight_mask": torch.full((128, 64), 0.5)})
  with pytest.raises(CheckpointError, match="must end in '_mask'"):
    torch_interop.apply_masks(net, {"0.weight": good})
  assert not hasattr(net[0], "weight_mask")  # nothing was pruned


# -------------------------------------------------------------------------------------------------
# Command line.
# -------------------------------------------------------------------------------------------------


def test_cli_inspect_and_convert(tmp_path, capsys):
  net = _mlp()
  prune.custom_from_mask(net[0], "weight", torch.from_numpy(_nm_mask((128, 64))))
  torch.save({"state_dict": {f"module.{k}": v for k, v in net.state_dict().items()}}, tmp_path / "in.pt")
  assert cli_main(["inspect", str(tmp_path / "in.pt"), "--progress"]) == 0
  out, err = capsys.readouterr()
  assert "reading:" in err and "4/4" in err  # the tqdm bar
  assert "0.weight" in out and "torch.nn.utils.prune" in out and "2:4" in out and "2.weight" in out

  target = tmp_path / "out.safetensors"
  args = ["convert", str(tmp_path / "in.pt"), str(target), "--rules", r"mlp\.2=block:0.5:32x16"]
  args += ["--name-map", r"^=mlp."]
  assert cli_main(args) == 0
  v = torch_interop.load_flax_variables(target)
  assert v["params"]["mlp"]["0"]["kernel"].shape == (64, 128)
  assert v["sparsity"]["mlp"]["0"]["mask"].dtype == np.bool_
  assert v["params"]["mlp"]["2"]["kernel"].shape == (4, 32, 16)  # 50% of 8 blocks, Flax (in, out) blocks
  assert cli_main(args) == 1 and "exists; pass --force" in capsys.readouterr().err

  # bad input: a clear message and no output file
  (tmp_path / "junk.pt").write_bytes(b"\x80\x04junk")
  assert cli_main(["convert", str(tmp_path / "junk.pt"), str(tmp_path / "x.safetensors")]) == 1
  assert "junk.pt is not a" in capsys.readouterr().err
  assert not (tmp_path / "x.safetensors").exists()
  assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
  torch.save({"fc.weight_orig": torch.ones(2, 2)}, tmp_path / "half.pt")
  assert cli_main(["inspect", str(tmp_path / "half.pt")]) == 1
  assert "fc.weight_mask is missing" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli_main(["convert", "a", "b", "--rules", "x=block:lots"])


def test_cli_nm_flag_and_existing_orbax_output_errors(tmp_path, capsys):
  torch.save({"fc.weight": torch.ones(8, 16)}, tmp_path / "in.pt")
  for bad in ("4:2", "0:4", "3:3"):  # was: accepted, then every weight "could not be decoded"
    with pytest.raises(SystemExit):
      cli_main(["inspect", str(tmp_path / "in.pt"), "--nm", bad])
    assert f"--nm N:M needs 0 < N < M, got '{bad}'" in capsys.readouterr().err
  (tmp_path / "ckpt").mkdir()
  for force in ([], ["--force"]):  # was: "pass --force to overwrite it", then with --force "must not exist yet"
    assert cli_main(["convert", str(tmp_path / "in.pt"), str(tmp_path / "ckpt"), *force]) == 1
    err = capsys.readouterr().err
    assert "orbax output" in err and "remove it or choose another name" in err and "--force" not in err
  assert os.listdir(tmp_path / "ckpt") == []


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_written_files_get_the_mode_open_would_give(tmp_path, umask):
  """Files are written under a temporary name and renamed, but keep open()'s mode (0o666 less the umask), not
  mkstemp's or safetensors' 0o600."""
  variables = {"params": {"fc": {"kernel": np.ones((2, 3), np.float32)}}}
  torch.save({"fc.weight": torch.ones(3, 2)}, tmp_path / "in.pt")
  old = os.umask(umask)
  try:
    path = torch_interop.save_flax_variables(variables, tmp_path / "out.safetensors")
    assert cli_main(["convert", str(tmp_path / "in.pt"), str(tmp_path / "cli.safetensors")]) == 0
  finally:
    os.umask(old)
  for written in (path, tmp_path / "cli.safetensors"):
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o666 & ~umask, written
  os.chmod(path, 0o640)  # an existing file keeps its mode, as with open(path, "w")
  torch_interop.save_flax_variables(variables, path)
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
  assert sorted(os.listdir(tmp_path)) == ["cli.safetensors", "in.pt", "out.safetensors"]  # no temporary files left


def test_convert_orbax(tmp_path):
  sd = {"fc.weight": torch.randn(8, 16), "fc.weight_mask": torch.from_numpy(_nm_mask((8, 16))).float()}
  variables = torch_interop.to_linen_variables(sd)
  path = torch_interop.save_flax_variables(variables, tmp_path / "ckpt", format="orbax")
  back = torch_interop.load_flax_variables(path)
  np.testing.assert_array_equal(back["params"]["fc"]["kernel"], variables["params"]["fc"]["kernel"])
  np.testing.assert_array_equal(back["sparsity"]["fc"]["mask"], variables["sparsity"]["fc"]["mask"])
  with pytest.raises(CheckpointError, match="already exists"):
    torch_interop.save_flax_variables(variables, tmp_path / "ckpt", format="orbax")


def test_linen_variables_run_in_jaxsparse_linen_layers():
  """Linen variables from a pruned checkpoint run in jaxsparse's Linen layers like torch does."""
  net = _mlp()
  prune.custom_from_mask(net[0], "weight", torch.from_numpy(_block_mask(128, 64, (32, 32), density=0.5, seed=5)))
  prune.l1_unstructured(net[2], "weight", amount=0.5)
  v = torch_interop.to_linen_variables(net.state_dict())
  x = jax.random.normal(jax.random.key(0), (3, 64))
  l0 = {c: v[c]["0"] for c in ("params", "sparsity")}
  l2 = {c: v[c]["2"] for c in ("params", "sparsity")}
  density = l0["params"]["kernel"].shape[0] / 8  # the blocks the random torch mask kept
  h = BlockSparseDense(128, density=density, block_shape=(32, 32)).apply(l0, x)
  y = MaskedDense(32, sparsity=0.5).apply(l2, jax.nn.relu(h))
  with torch.no_grad():
    expected = net(torch.from_numpy(np.array(x))).numpy()
  np.testing.assert_allclose(np.asarray(y), expected, atol=1e-5)


def _half_blocks(rows, cols, block, seed):
  grid = np.random.default_rng(seed).permutation((rows // block[0]) * (cols // block[1])) % 2 == 0
  return np.kron(grid.reshape(rows // block[0], cols // block[1]), np.ones(block, bool))


def test_linen_attention_from_torch_with_target(tmp_path):
  """Pruned torch q/k/v/out Linears -> variables shaped by a Linen attention target -> masked and sparse == torch."""
  import flax.linen as nn  # noqa: PLC0415

  d, heads = 64, 4
  torch.manual_seed(0)
  net = torch.nn.ModuleDict({"attn": torch.nn.ModuleDict({p: torch.nn.Linear(d, d) for p in
                                                          ("query", "key", "value", "out")})})
  for i, p in enumerate(("query", "key", "value")):
    prune.custom_from_mask(net["attn"][p], "weight", torch.from_numpy(_half_blocks(d, d, (16, 16), seed=i)))
  prune.custom_from_mask(net["attn"]["out"], "weight", torch.from_numpy(_nm_mask((d, d))))

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.MultiHeadDotProductAttention(heads, qkv_features=d, name="attn")(x)

  model = Model()
  x = jax.random.normal(jax.random.key(0), (2, 5, d))
  target = jax.eval_shape(model.init, jax.random.key(1), x)
  v = torch_interop.to_linen_variables(net.state_dict(), target=target)
  masks = v.pop("masks")
  assert "sparsity" not in v
  assert jax.tree.map(jnp.shape, v) == jax.tree.map(jnp.shape, target)  # (in, heads, head_dim), (heads, head_dim)
  for p in ("query", "key", "value", "out"):  # the masks reshape with their kernels
    np.testing.assert_array_equal(np.asarray(masks["attn"][p]["kernel"]).reshape(d, d),
                                  net["attn"][p].weight_mask.numpy().T.astype(bool), err_msg=p)
  t = torch.from_numpy(np.array(x))
  with torch.no_grad():
    q, k, w = (net["attn"][p](t).reshape(2, 5, heads, d // heads).transpose(1, 2) for p in ("query", "key", "value"))
    y = torch.nn.functional.scaled_dot_product_attention(q, k, w)
    expected = net["attn"]["out"](y.transpose(1, 2).reshape(2, 5, d)).numpy()
  np.testing.assert_allclose(np.asarray(model.apply(v, x)), expected, atol=1e-5, rtol=1e-5)
  rules = {r"attn\.(query|key|value)": jaxsparse.BlockSparse(density=0.5, block_shape=(16, 16)),
           r"attn\.out": jaxsparse.NM(2, 4)}
  sparse, sparse_vars, report = jaxsparse.sparsify_linen(model, v, rules, x, masks=masks)
  assert len(report.layers) == 4
  np.testing.assert_allclose(np.asarray(sparse.apply(sparse_vars, x)), expected, atol=1e-5, rtol=1e-5)
  # The "masks" entry is not a Linen collection: exporting variables that hold it would leave its masks out.
  with pytest.raises(ValueError, match=r"hold a 'masks' entry .* Pop it and pass it as masks= to"):
    torch_interop.export_masks({**v, "masks": masks})

  # The command line takes the target as a file of Flax variables and writes the same.
  torch.save(net.state_dict(), tmp_path / "attn.pt")
  init = torch_interop.save_flax_variables(model.init(jax.random.key(1), x), tmp_path / "init.safetensors")
  assert cli_main(["convert", str(tmp_path / "attn.pt"), str(tmp_path / "out.safetensors"), "--target", init]) == 0
  back = torch_interop.load_flax_variables(tmp_path / "out.safetensors")
  jax.tree.map(np.testing.assert_array_equal, back, {**v, "masks": masks})


def test_target_that_does_not_fit_names_the_variable():
  f32 = jnp.float32
  target = {"params": {"fc": {"kernel": jax.ShapeDtypeStruct((16, 8), f32), "bias": jax.ShapeDtypeStruct((2, 4), f32)}}}
  # kernel (8, 16): the size, not a view, of (16, 8). (No bias: one of 8 would make it a Conv1D's (in, out) weight.)
  sd = {"fc.weight": torch.ones(16, 8)}
  with pytest.raises(CheckpointError, match=r"params\.fc\.kernel: the checkpoint gives shape \(8, 16\), the target "
                     r"\(16, 8\)"):
    torch_interop.to_linen_variables(sd, target=target)
  sd = {"fc.weight": torch.ones(8, 16), "fc.bias": torch.ones(16)}
  with pytest.raises(CheckpointError, match=r"params\.fc\.bias: the checkpoint gives shape \(16,\), the target "
                     r"\(2, 4\)"):
    torch_interop.to_linen_variables(sd, target=target)
  with pytest.raises(CheckpointError, match=r"params\.head\.kernel: the checkpoint has this variable but the target "
                     r"does not.*The target has: params\.fc\.bias, params\.fc\.kernel"):
    torch_interop.to_linen_variables({"fc.weight": torch.ones(8, 16), "fc.bias": torch.ones(8),
                                      "head.weight": torch.ones(2, 2)}, target=target)
  with pytest.raises(CheckpointError, match=r"target variable\(s\) not in the checkpoint: params\.fc\.bias"):
    torch_interop.to_linen_variables({"fc.weight": torch.ones(8, 16)}, target=target)
  with pytest.raises(TypeError, match="target must be Linen variables"):
    torch_interop.to_linen_variables({"fc.weight": torch.ones(8, 16)}, target=[1])


def test_linen_dense_general_exports_as_the_torch_linear_on_its_2d_view():
  """An nn.DenseGeneral kernel (*in_dims, *features) of Linen variables was written as a conv weight (reversed axes)
  and its bias unflattened: torch refused both. Its bias of ndim >= 2 tells it from a conv; where it does not (a 1-D
  bias), the plan of module= does (densify_linen's variables too, whose N:M masks were taken along the wrong axis)."""
  import flax.linen as nn  # noqa: PLC0415

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.DenseGeneral((4, 8), name="up")(x)  # (16,) -> (4, 8): kernel (16, 4, 8), bias (4, 8)
      return nn.DenseGeneral(16, axis=(-2, -1), name="down")(h)  # (4, 8) -> (16,): kernel (4, 8, 16), bias (16,)

  model = Net()
  x = jax.random.normal(jax.random.key(0), (3, 16))
  variables = model.init(jax.random.key(1), x)
  variables["params"]["up"]["bias"] = jax.random.normal(jax.random.key(2), (4, 8))  # not zeros: a bias must count
  state = torch_interop.export_state_dict(variables)
  assert {k: tuple(v.shape) for k, v in state.items() if k.startswith("up.")} == {"up.weight": (32, 16),
                                                                                  "up.bias": (32,)}
  up = torch.nn.Linear(16, 32)
  up.load_state_dict({k[3:]: v for k, v in state.items() if k.startswith("up.")})
  h = nn.DenseGeneral((4, 8)).apply({"params": variables["params"]["up"]}, x)
  with torch.no_grad():
    np.testing.assert_allclose(up(torch.from_numpy(np.array(x))).numpy(), np.asarray(h).reshape(3, 32), atol=1e-5,
                               rtol=1e-5)
  # A 1-D bias: a conv's or an nn.DenseGeneral's; the SparsifiedLinen's plan says which.
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, jaxsparse.NM(2, 4), x)
  _, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  torch_net = torch.nn.ModuleDict({"up": torch.nn.Linear(16, 32), "down": torch.nn.Linear(32, 16)})
  exported = torch_interop.export_state_dict(dense_vars, module=sparse)
  torch_net.load_state_dict(exported)
  with torch.no_grad():
    y = torch_net["down"](torch_net["up"](torch.from_numpy(np.array(x)))).numpy()
  np.testing.assert_allclose(y, np.asarray(model.apply(dense_vars, x)), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(y, np.asarray(sparse.apply(sparse_vars, x)), atol=1e-5, rtol=1e-5)
  # The dense variables give the same weights and masks as the sparse ones.
  for got, want in [(exported, torch_interop.export_state_dict(sparse_vars, module=sparse)),
                    (torch_interop.export_masks(dense_vars, module=sparse),
                     torch_interop.export_masks(sparse_vars, module=sparse))]:
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
  # A bias of ndim >= 2 that is not the kernel's trailing axes: neither layer.
  bad = {"params": {"fc": {"kernel": np.zeros((16, 4, 8), np.float32), "bias": np.zeros((8, 4), np.float32)}}}
  with pytest.raises(ValueError, match=r"fc: its kernel has shape \(16, 4, 8\) and its bias \(8, 4\)"):
    torch_interop.export_state_dict(bad)


@pytest.mark.parametrize("how", ["no rule", "routed dense", "compressed", "attention"])
def test_linen_dense_general_left_dense_by_sparsify_exports_as_a_linear(how):
  """An nn.DenseGeneral that sparsify_linen left dense (no rule matched it, or route_slower_to_dense_linen routed it
  back; the out projection of nn.MultiHeadDotProductAttention with only q / k / v sparse) has a kernel of ndim 3 and a
  1-D bias: export_state_dict(module=the SparsifiedLinen) wrote it as a conv's reversed 3-D weight, with no warning
  (the plan held only the sparse layers). The SparsifiedLinen now knows the dense layers the example inputs called."""

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.relu(nn.DenseGeneral((4, 8), name="up")(x))  # kernel (16, 4, 8), bias (4, 8)
      return nn.DenseGeneral(16, axis=(-2, -1), name="down")(h)  # kernel (4, 8, 16), bias (16,)

  x = jax.random.normal(jax.random.key(0), (3, 16))
  if how == "attention":
    model = nn.MultiHeadDotProductAttention(4, qkv_features=16)
    x = jax.random.normal(jax.random.key(0), (2, 5, 16))
    rules = {r"query|key|value": jaxsparse.Unstructured(0.5)}
  else:
    model = Net()
    rules = {"up": jaxsparse.NM(2, 4) if how == "compressed" else jaxsparse.Unstructured(0.5),
             "down": None if how in ("no rule", "compressed") else jaxsparse.Unstructured(0.5)}
  variables = model.init(jax.random.key(1), x)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, rules, x)
  if how == "routed dense":
    timer = lambda module, v, xx: 1.0 if type(module) is nn.DenseGeneral else 2.0  # dense faster
    sparse, sparse_vars, _ = jaxsparse.route_slower_to_dense_linen(sparse, sparse_vars, 8, timer=timer)
    assert not sparse.layers
  elif how == "compressed":
    sparse, sparse_vars = jaxsparse.compress_linen(sparse, sparse_vars)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # nothing is read by its shape alone: the module says what each layer is
    state = torch_interop.export_state_dict(sparse_vars, module=sparse)
  # The torch export of the dense model (module= with example inputs) writes the same shapes.
  _, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  want = torch_interop.export_state_dict(dense_vars, x, module=model)
  assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in want.items()}
  out = "out." if how == "attention" else "down."
  assert all(v.ndim <= 2 for v in state.values()) and tuple(state[out + "weight"].shape) == (16, 16 if how ==
                                                                                               "attention" else 32)
  if how != "attention":
    torch_net = torch.nn.ModuleDict({"up": torch.nn.Linear(16, 32), "down": torch.nn.Linear(32, 16)})
    torch_net.load_state_dict(state)
    with torch.no_grad():
      h = torch.relu(torch_net["up"](torch.from_numpy(np.array(x))))
      y = torch_net["down"](h).numpy()
    np.testing.assert_allclose(y, np.asarray(sparse.apply(sparse_vars, x)), atol=1e-5, rtol=1e-5)
  else:
    np.testing.assert_allclose(state[out + "weight"].numpy(),
                               np.asarray(dense_vars["params"]["out"]["kernel"]).reshape(16, 16).T)


def test_densify_linen_of_a_plain_module_names_the_argument():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8)(x)

  model = Net()
  variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
  with pytest.raises(TypeError, match=r"sparse must be the SparsifiedLinen that jaxsparse\.sparsify_linen "
                     r"returned, got Net"):
    jaxsparse.densify_linen(model, variables)


# -------------------------------------------------------------------------------------------------
# Linen embeddings: told from Linear weights, fitted to a target, their masks kept.
# -------------------------------------------------------------------------------------------------

VOCAB, FEATURES = 16, 8


def _lm():
  """A torch model whose embedding's name is none of the default embedding names, with a bias-free Linear beside it and
  a Linear (with a bias) whose name is one."""
  torch.manual_seed(0)
  return torch.nn.ModuleDict({"tok": torch.nn.Embedding(VOCAB, FEATURES),
                              "proj": torch.nn.Linear(FEATURES, FEATURES, bias=False),
                              "embed": torch.nn.Linear(FEATURES, 4)})


def _linen_lm():
  import flax.linen as nn  # noqa: PLC0415

  class LM(nn.Module):
    @nn.compact
    def __call__(self, ids):
      h = nn.Embed(VOCAB, FEATURES, name="tok")(ids)
      return nn.Dense(4, name="embed")(nn.Dense(FEATURES, use_bias=False, name="proj")(h))

  return LM()


def _lm_forward(net, ids):
  with torch.no_grad():
    return net["embed"](net["proj"](net["tok"](torch.from_numpy(np.array(ids))))).numpy()


def test_linen_embedding_told_from_linear_by_module_type_bias_and_explicit_names(tmp_path, capsys):
  """An nn.Embedding named "tok" became params.tok.kernel (its table transposed, as a Linear's), silently; a Linear with
  a bias named "embed" became an embedding table. The module types decide when the torch module is given, a bias rules
  out a table, an explicit embeddings= (CLI --embeddings) names the tables, and otherwise a warning lists the bias-free
  weights read as Linear ones."""
  net, model = _lm(), _linen_lm()
  ids = jnp.array([[1, 5, 7], [15, 0, 3]])
  expected = _lm_forward(net, ids)
  tok, proj = net["tok"].weight.detach().numpy(), net["proj"].weight.detach().numpy()
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the module's types leave nothing to guess
    v = torch_interop.to_linen_variables(net)
    explicit = torch_interop.to_linen_variables(net.state_dict(), embeddings=r"^tok$")
  for variables in (v, explicit):
    assert jax.tree.map(jnp.shape, variables) == {"params": {"tok": {"embedding": (VOCAB, FEATURES)},
                                                             "proj": {"kernel": (FEATURES, FEATURES)},
                                                             "embed": {"kernel": (FEATURES, 4), "bias": (4,)}}}
    np.testing.assert_array_equal(np.asarray(variables["params"]["tok"]["embedding"]), tok)
    np.testing.assert_array_equal(np.asarray(variables["params"]["proj"]["kernel"]), proj.T)
    np.testing.assert_allclose(np.asarray(model.apply(variables, ids)), expected, atol=1e-5, rtol=1e-5)
  # A state dict alone: both bias-free weights are read as Linear ones, and the warning names them and the way out.
  with pytest.warns(UserWarning, match=r"read 2 bias-free 2-D weight\(s\) as torch Linear weights .*: tok\.weight, "
                    r"proj\.weight\..*pass embeddings= .*target= .*or the torch module itself"):
    guessed = torch_interop.to_linen_variables(net.state_dict())
  assert sorted(guessed["params"]["tok"]) == ["kernel"] and sorted(guessed["params"]["embed"]) == ["bias", "kernel"]
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # skipped weights are not converted: nothing to warn of
    assert sorted(torch_interop.to_linen_variables(net.state_dict(), ignore=["tok.*", "proj.*"])["params"]) == ["embed"]
  # The command line takes the names too (and refuses a bad regex before reading anything).
  torch.save(net.state_dict(), tmp_path / "lm.pt")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert cli_main(["convert", str(tmp_path / "lm.pt"), str(tmp_path / "lm.safetensors"), "--embeddings", "^tok"]) == 0
  back = torch_interop.load_flax_variables(tmp_path / "lm.safetensors")
  jax.tree.map(np.testing.assert_array_equal, back, jax.tree.map(np.asarray, v))
  with pytest.raises(SystemExit):
    cli_main(["convert", "a", "b", "--embeddings", "(tok"])
  assert "--embeddings: '(tok' is not a valid regular expression" in capsys.readouterr().err
  with pytest.raises(ValueError, match=r"embeddings='\(tok' is not a valid regular expression"):
    torch_interop.to_linen_variables(net, embeddings="(tok")


def test_linen_target_with_an_embedding_takes_the_torch_table():
  """A target holding params.tok.embedding: the conversion raised "the checkpoint has this variable but the target does
  not" (it had written tok.kernel); the target's leaf decides, and a lone import rule leaves the table alone."""
  net, model = _lm(), _linen_lm()
  ids = jnp.array([[1, 5, 7], [15, 0, 3]])
  target = jax.eval_shape(model.init, jax.random.key(0), ids)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    v = torch_interop.to_linen_variables(net.state_dict(), target=target)
  assert jax.tree.map(jnp.shape, v) == jax.tree.map(jnp.shape, target)
  np.testing.assert_array_equal(np.asarray(v["params"]["tok"]["embedding"]), net["tok"].weight.detach().numpy())
  np.testing.assert_allclose(np.asarray(model.apply(v, ids)), _lm_forward(net, ids), atol=1e-5, rtol=1e-5)
  ruled = torch_interop.to_linen_variables(net.state_dict(), target=target, rules=jaxsparse.NM(2, 4))
  assert sorted(ruled["masks"]) == ["embed", "proj"]  # the Linear weights only
  np.testing.assert_array_equal(np.asarray(ruled["params"]["tok"]["embedding"]), net["tok"].weight.detach().numpy())


def _nm_embedding():
  """A torch Embedding pruned 2:4 along its features by a mask that is not the magnitude one (one kept weight is
  exactly zero), and the Linen model that looks it up and computes tied logits with it."""
  import flax.linen as nn  # noqa: PLC0415

  torch.manual_seed(1)
  emb = torch.nn.Embedding(VOCAB, FEATURES)
  mask = torch.from_numpy(_nm_mask((VOCAB, FEATURES), seed=4))
  with torch.no_grad():
    emb.weight[0, int(np.flatnonzero(mask[0].numpy())[0])] = 0.0
  prune.custom_from_mask(emb, "weight", mask)

  class Tied(nn.Module):
    @nn.compact
    def __call__(self, ids):
      embed = nn.Embed(VOCAB, FEATURES, name="tok")
      rows = embed(ids)
      return rows, embed.attend(rows)

  return torch.nn.ModuleDict({"tok": emb}), Tied()


def test_linen_nm_embedding_keeps_its_mask_into_compressed_nm_embed(tmp_path):
  """A 2:4-pruned torch Embedding gave only its masked table: its mask was dropped, so sparsify_linen recomputed one by
  magnitude (another mask where a kept weight is 0, or ties) and could not give back the torch tensors. Its mask now
  comes under masks.<path>.embedding, (num_embeddings, features) like the table, with or without a target."""
  net, model = _nm_embedding()
  emb = net["tok"]
  ids = jnp.array([[0, 5, 7], [15, 0, 3]])
  t_ids = torch.from_numpy(np.array(ids))
  with torch.no_grad():
    rows_t = emb(t_ids).numpy()
    logits_t = (emb(t_ids) @ emb.weight.T).numpy()
  target = jax.eval_shape(model.init, jax.random.key(0), ids)
  state = net.state_dict()  # prune's weight_orig and weight_mask
  plain = {"tok.weight": emb.weight.detach(), "tok.weight_mask": emb.weight_mask}  # a masked dense state dict
  for source, kwargs in [(state, {"target": target}), (plain, {"target": target}), (net, {})]:
    v = torch_interop.to_linen_variables(source, **kwargs)
    masks = v.pop("masks")
    assert jax.tree.map(jnp.shape, masks) == {"tok": {"embedding": (VOCAB, FEATURES)}}
    np.testing.assert_array_equal(np.asarray(masks["tok"]["embedding"]), emb.weight_mask.numpy().astype(bool))
    np.testing.assert_array_equal(np.asarray(v["params"]["tok"]["embedding"]), emb.weight.detach().numpy())
    sparse, sparse_vars, report = jaxsparse.sparsify_linen(model, v, {"tok": jaxsparse.NM(2, 4)}, ids, masks=masks)
    assert [layer.replaced_by for layer in report.layers] == ["CompressedNMEmbed"]
    rows, logits = sparse.apply(sparse_vars, ids)
    np.testing.assert_allclose(np.asarray(rows), rows_t, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(logits), logits_t, atol=1e-5, rtol=1e-5)
    exported = torch_interop.export_state_dict(sparse_vars, module=sparse)
    exported_masks = torch_interop.export_masks(sparse_vars, module=sparse, dtype=torch.float32)
    assert sorted(exported) == ["tok.weight"] and sorted(exported_masks) == ["tok.weight_mask"]
    assert torch.equal(exported["tok.weight"], emb.weight.detach())
    assert torch.equal(exported_masks["tok.weight_mask"], emb.weight_mask)
  # sparse=False: the masked table alone, as for kernels.
  assert "masks" not in torch_interop.to_linen_variables(net, sparse=False)


# -------------------------------------------------------------------------------------------------
# Hugging Face GPT-2: transformers' Conv1D stores its weight (in, out), not a Linear's (out, in).
# -------------------------------------------------------------------------------------------------

GPT2_CONV1D = r"\.(c_attn|c_proj|c_fc)$"
GPT2_BLOCK = [(r"^transformer\.h\.0\.", "")]
GPT2_OTHERS = ["transformer.w*", "transformer.ln_f.*", "transformer.h.0.ln_*", "lm_head.*"]


def _gpt2(prune_proj: bool = False):
  """A tiny seeded GPT2LMHeadModel (n_embd 16: attn.c_proj is square); optionally attn.c_proj pruned 50%."""
  transformers = pytest.importorskip("transformers")
  cfg = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=8, vocab_size=32, bos_token_id=0,
                                eos_token_id=0)
  torch.manual_seed(0)
  hf = transformers.GPT2LMHeadModel(cfg).eval()
  if prune_proj:
    prune.l1_unstructured(hf.transformer.h[0].attn.c_proj, "weight", amount=0.5)
  return hf


class _GPT2Projections(nnx.Module):
  """The Conv1D layers of one GPT-2 block as nnx.Linear layers, under the block's own names."""

  def __init__(self):
    rngs = nnx.Rngs(0)
    self.attn = nnx.Dict(c_attn=nnx.Linear(16, 48, rngs=rngs), c_proj=nnx.Linear(16, 16, rngs=rngs))
    self.mlp = nnx.Dict(c_fc=nnx.Linear(16, 64, rngs=rngs), c_proj=nnx.Linear(64, 16, rngs=rngs))


def _gpt2_close(hf, c_attn, attn_proj, c_fc, mlp_proj):
  """Each Flax projection against the GPT-2 block's own modules (f32, 1e-5); the MLP as a whole (gelu_new)."""
  block = hf.transformer.h[0]
  x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
  with torch.no_grad():
    t = torch.from_numpy(x)
    expected = {"c_attn": block.attn.c_attn(t), "attn.c_proj": block.attn.c_proj(t), "mlp": block.mlp(t)}
  got = {"c_attn": c_attn(x), "attn.c_proj": attn_proj(x), "mlp": mlp_proj(jax.nn.gelu(c_fc(x), approximate=True))}
  for name, value in expected.items():
    np.testing.assert_allclose(np.asarray(got[name]), value.numpy(), atol=1e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("pruned", [False, True])
def test_gpt2_conv1d_module_load_nnx_and_export(pruned):
  """Defect: transformers' Conv1D (GPT-2's c_attn, c_proj, c_fc) holds weight (in, out), but load_nnx transposed it
  as a Linear's (out, in): the square attn.c_proj loaded silently transposed (wrong outputs), the others failed on
  shape. A torch module source now says which modules are Conv1D; their weights and masks load the right way round
  and export_state_dict(conv1d=...) writes GPT-2's layout back."""
  hf = _gpt2(prune_proj=pruned)
  model = _GPT2Projections()
  report = torch_interop.load_nnx(model, hf, name_map=GPT2_BLOCK, ignore=GPT2_OTHERS)
  assert {r.flax_path: r.format.endswith(", Conv1D (in, out)") for r in report.layers} == {
      "attn.c_attn": True, "attn.c_proj": True, "mlp.c_fc": True, "mlp.c_proj": True}
  assert type(model.attn["c_proj"]) is (MaskedLinear if pruned else nnx.Linear)
  _gpt2_close(hf, model.attn["c_attn"], model.attn["c_proj"], model.mlp["c_fc"], model.mlp["c_proj"])
  fmt = "prune" if pruned else "dense"
  back = torch_interop.export_state_dict(model, torch_names=report.torch_names, format=fmt, conv1d=GPT2_CONV1D)
  state = {k: v for k, v in hf.state_dict().items() if k.startswith("transformer.h.0.") and ".ln_" not in k}
  if pruned:  # the export holds zeros where pruned, torch's weight_orig the pruned values too
    orig = "transformer.h.0.attn.c_proj.weight_orig"
    state[orig] = state[orig] * state["transformer.h.0.attn.c_proj.weight_mask"]
  assert sorted(back) == sorted(state)
  for k, v in state.items():
    assert back[k].shape == v.shape and torch.equal(back[k], v.to(back[k].dtype)), k
  if pruned:
    masks = torch_interop.export_masks(model, torch_names=report.torch_names, conv1d=GPT2_CONV1D)
    key = "transformer.h.0.attn.c_proj.weight_mask"
    assert torch.equal(masks[key], state[key].bool())


def test_gpt2_conv1d_state_dict_to_linen_variables():
  """Defect: to_linen_variables (and the CLI convert) read GPT-2's Conv1D weights (in, out) as Linear (out, in) ones.
  From the module, the classes decide; from a plain state dict, a bias of the second dimension's size marks the
  non-square ones, a square one beside them raises naming it (a state dict cannot tell), and conv1d= resolves it."""
  hf = _gpt2()
  from_module = torch_interop.to_linen_variables(hf, name_map=GPT2_BLOCK, ignore=GPT2_OTHERS)
  p = from_module["params"]
  dense = {name: (lambda x, v=v: nn.Dense(v["kernel"].shape[1]).apply({"params": v}, x))
           for name, v in [("c_attn", p["attn"]["c_attn"]), ("attn.c_proj", p["attn"]["c_proj"]),
                           ("c_fc", p["mlp"]["c_fc"]), ("mlp.c_proj", p["mlp"]["c_proj"])]}
  _gpt2_close(hf, *dense.values())
  state = hf.state_dict()
  with pytest.raises(CheckpointError, match=r"transformer\.h\.0\.attn\.c_proj\.weight.*conv1d="):
    torch_interop.to_linen_variables(state, name_map=GPT2_BLOCK, ignore=GPT2_OTHERS)
  from_state = torch_interop.to_linen_variables(state, name_map=GPT2_BLOCK, ignore=GPT2_OTHERS, conv1d=GPT2_CONV1D)
  jax.tree.map(np.testing.assert_array_equal, from_state, from_module)
  # Without the square one, the biases alone tell the layout.
  no_square = {k: v for k, v in state.items() if "attn.c_proj" not in k}
  params = torch_interop.decode_checkpoint(no_square)
  assert params["transformer.h.0.mlp.c_proj.weight"].shape == (16, 64)
  assert params["transformer.h.0.attn.c_attn.weight"].format == "dense, Conv1D (in, out)"
  assert params["lm_head.weight"].format == "dense"  # a bias-free Linear: untouched
  with pytest.raises(ValueError, match=r"conv1d='\('"):
    torch_interop.decode_checkpoint(no_square, conv1d="(")


def test_gpt2_conv1d_cli_convert(tmp_path, capsys):
  """The CLI convert of a GPT-2 safetensors file: an error naming the square Conv1D weight, then --conv1d converts."""
  hf = _gpt2()
  src = tmp_path / "gpt2.safetensors"
  save_file({k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}, str(src))
  assert cli_main(["convert", str(src), str(tmp_path / "bad.safetensors")]) == 1
  assert "attn.c_proj.weight" in capsys.readouterr().err and not (tmp_path / "bad.safetensors").exists()
  out = tmp_path / "flax.safetensors"
  assert cli_main(["convert", str(src), str(out), "--conv1d", GPT2_CONV1D]) == 0
  kernel = torch_interop.load_flax_variables(out)["params"]["transformer"]["h"]["0"]["attn"]["c_proj"]["kernel"]
  np.testing.assert_array_equal(kernel, hf.transformer.h[0].attn.c_proj.weight.detach().numpy())


# -------------------------------------------------------------------------------------------------
# float64 checkpoints, conjugate views, torch.ao modules.
# -------------------------------------------------------------------------------------------------


def _x64_linear(w: np.ndarray) -> torch.nn.Linear:
  fc = torch.nn.Linear(w.shape[1], w.shape[0]).double()
  with torch.no_grad():
    fc.weight.copy_(torch.from_numpy(w))
  return fc


def test_float64_nm_recompute_ranks_like_sr_ste_in_float64():
  """A float64 SR-STE checkpoint (``nm=``): 0.3 and 0.3 + 1e-9 are one float32, so a float32 ranking kept the lower
  index, the smaller weight, and the Flax layer read another input feature than torch's."""
  w = np.tile([0.5, 0.3, 0.3 + 1e-9, -0.1, 0.2, -0.7, 0.6 + 1e-9, 0.6], (8, 4))
  w[::2] *= -1
  fc = _x64_linear(w)
  # NM-sparsity's Sparse.forward (sparse_ops.py): zero the M - N smallest |w| of each group of M inputs.
  groups = fc.weight.detach().abs().reshape(-1, 4)
  pruned = torch.argsort(groups, dim=1)[:, :2]
  torch_mask = torch.ones_like(groups).scatter_(1, pruned, 0).reshape(fc.weight.shape)
  p = torch_interop.decode_checkpoint(fc.state_dict(), nm=(2, 4))["weight"]
  np.testing.assert_array_equal(p.mask, torch_mask.numpy() == 1)
  x = np.random.default_rng(0).standard_normal((5, 32))
  with jax.enable_x64(True):
    model = nnx.Sequential(nnx.Linear(32, 8, param_dtype=jnp.float64, dtype=jnp.float64, rngs=nnx.Rngs(0)))
    report = torch_interop.load_nnx(model, fc.state_dict(), name_map={"": "layers.0"}, nm=(2, 4))
    assert report.layers[0].layer == "NMLinear"
    got = np.asarray(model(jnp.asarray(x)))
  with torch.no_grad():
    expected = torch.nn.functional.linear(torch.from_numpy(x), fc.weight * torch_mask, fc.bias).numpy()
  np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_float64_import_rules_rank_like_torch_prune_under_x64():
  """``rules=Unstructured(0.5)`` on a float64 checkpoint under x64 cast the weights to float32 first: the 16th and
  17th largest (one float32) tied, the lower Flax index won and a larger weight was pruned; torch's
  ``prune.l1_unstructured`` (and ``jaxsparse.magnitude_mask`` under x64) rank in float64."""
  # Flax kernel (in, out) = w.T: 15 larger, then 1.5 + 1e-12 at flat index 30 (kept) and 1.5 at 3 (pruned).
  kernel = np.empty(32)
  others = [i for i in range(32) if i not in (3, 30)]
  kernel[others] = np.concatenate([np.linspace(1.6, 2.0, 15), np.linspace(1.0, 1.4, 15)])
  kernel[3], kernel[30] = 1.5, 1.5 + 1e-12
  assert np.float32(kernel[3]) == np.float32(kernel[30])
  w = kernel.reshape(8, 4).T.copy() * np.where(np.arange(32).reshape(4, 8) % 3, 1, -1)
  fc = _x64_linear(w)
  state = {k: t.clone() for k, t in fc.state_dict().items()}
  prune.l1_unstructured(fc, "weight", amount=0.5)
  x = np.random.default_rng(0).standard_normal((5, 8))
  with jax.enable_x64(True):
    v = torch_interop.to_linen_variables(state, rules=jaxsparse.Unstructured(0.5))
    np.testing.assert_array_equal(np.asarray(v["sparsity"]["mask"]).T, fc.weight_mask.numpy() == 1)
    got = np.asarray(MaskedDense(4, sparsity=0.5, param_dtype=jnp.float64, dtype=jnp.float64).apply(v, x))
  with torch.no_grad():
    expected = fc(torch.from_numpy(x)).numpy()
  np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_float64_mask_values_near_one_are_not_one():
  """A float64 mask compared in float32 took 1 - 1e-12 for 1 (torch's prune multiplies by it) and 1e-50 for 0."""
  w = torch.ones(4, 8, dtype=torch.float64)
  for value in (1 - 1e-12, 1e-50):
    mask = torch.ones(4, 8, dtype=torch.float64)
    mask[2, 3] = value
    with pytest.raises(CheckpointError, match=r"'fc\.weight_mask' must hold only 0 and 1, but has .* at \(2, 3\)"):
      torch_interop.decode_checkpoint({"fc.weight_orig": w, "fc.weight_mask": mask})


def test_conjugate_views_are_read_not_crashed_on(tmp_path, capsys):
  """``torch.save`` keeps a complex ``z.conj()``'s conjugate bit; reading it raised torch's RuntimeError (``inspect``
  crashed) instead of showing it, and load_nnx did not say why a complex weight cannot load."""
  z = torch.complex(torch.randn(4, 8), torch.randn(4, 8))
  path = tmp_path / "conj.pt"
  torch.save({"0.weight": z.conj(), "0.bias": torch.zeros(4)}, path)
  assert torch.load(path, weights_only=True)["0.weight"].is_conj()
  p = torch_interop.decode_checkpoint(str(path))["0.weight"]
  np.testing.assert_array_equal(p.value, z.conj().resolve_conj().numpy())
  assert cli_main(["inspect", str(path)]) == 0
  assert "complex64" in capsys.readouterr().out
  with pytest.raises(CheckpointError, match=r"torch '0\.weight' has dtype complex64.*imaginary part"):
    torch_interop.load_nnx(nnx.Sequential(nnx.Linear(8, 4, rngs=nnx.Rngs(0))), str(path), name_map=SEQ)
  neg = torch.randn(4, 8)._neg_view()  # a real tensor with torch's negative bit (``z.conj().imag`` of one element)
  np.testing.assert_array_equal(torch_interop.decode_checkpoint({"w": neg})["w"].value, neg.resolve_neg().numpy())


def test_torch_ao_module_source_reads_its_fake_sparsity_masks():
  """A model prepared by a torch.ao sparsifier, passed itself: FakeSparsity keeps the mask out of ``state_dict()``,
  and loading raised asking for a file with the sparsifier state, though the mask is on the module."""
  torch.manual_seed(0)
  net = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
  sp = WeightNormSparsifier(sparsity_level=1.0, sparse_block_shape=(1, 4), zeros_per_block=2)
  sp.prepare(net, [{"tensor_fqn": "0.weight"}, {"tensor_fqn": "2.weight"}])
  sp.step()
  model = nnx.Sequential(nnx.Linear(16, 8, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(8, 4, rngs=nnx.Rngs(0)))
  report = torch_interop.load_nnx(model, net, name_map=SEQ)
  assert [(r.layer, r.format, str(r.pattern)) for r in report.layers] == [("NMLinear", "torch.ao.pruning", "2:4")] * 2
  x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
  with torch.no_grad():
    expected = net(torch.from_numpy(x)).numpy()  # through the parametrization: original * mask
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(x))), expected, rtol=1e-5, atol=1e-6)
  state = torch_interop.load_state_dict(net)
  torch.testing.assert_close(state["0.parametrizations.weight.0.mask"], net[0].parametrizations.weight[0].mask)
  # Another parametrization: its weight is not original * mask, and the error says what to do.
  other = torch.nn.Sequential(torch.nn.Linear(4, 4))
  torch.nn.utils.parametrize.register_parametrization(other[0], "weight", torch.nn.Identity())
  with pytest.raises(CheckpointError, match=r"module '0' \(ParametrizedLinear\) parametrizes 'weight' with "
                     r"\['Identity'\].*remove_parametrizations"):
    torch_interop.load_nnx(nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0))), other, name_map=SEQ)


class _CountingLinear(torch.nn.Linear):
  """A Linear with a buffer of its own (a step counter): not a weight, nothing a Flax Linear holds."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.register_buffer("steps", torch.tensor(7))


def test_strict_false_lists_extra_tensors_of_a_mapped_module_as_unexpected():
  """``strict=False`` says torch weights without a place are listed in the report; one beside a mapped Linear's
  weight and bias raised all the same."""
  torch.manual_seed(0)
  net = torch.nn.Sequential(_CountingLinear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
  prune.l1_unstructured(net[0], "weight", amount=0.5)
  state = {**net.state_dict(), "head.weight": torch.ones(2, 2)}
  model = nnx.Sequential(nnx.Linear(16, 8, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(8, 4, rngs=nnx.Rngs(0)))
  with pytest.raises(CheckpointError, match=r"torch \['0\.steps'\] have no place in the Flax Linear 'layers\.0'.*"
                     "strict=False"):
    torch_interop.load_nnx(model, state, name_map=SEQ)
  assert type(model.layers[0]) is nnx.Linear  # untouched
  report = torch_interop.load_nnx(model, state, name_map=SEQ, strict=False)
  assert report.unexpected == ["0.steps", "head.weight"] and report.missing == []
  assert [r.layer for r in report.layers] == ["MaskedLinear", "Linear"]
  _forward_close(net, model, k=16)


def test_nm_export_masks_only_the_nonzero_weights_kept():
  """An NMLinear whose groups an optimizer pruned past n:m: its exported ``weight_mask`` kept n of every group, zero
  weights among them; it keeps the weights the forward pass keeps nonzero, and torch computes the same function."""
  layer = NMLinear(16, 8, n=2, m=4, rngs=nnx.Rngs(0))
  layer.kernel[...] = layer.kernel[...].at[0:3].set(0.0).at[4:8].set(0.0)  # groups 0 and 1: 1 and 0 nonzero
  pruned = np.asarray(layer.to_dense().kernel[...])
  assert np.count_nonzero(pruned) == 16 * 8 // 2 - 3 * 8
  masks = torch_interop.export_masks(nnx.Sequential(layer), torch_names={"layers.0": "fc"}, dtype=torch.float32)
  np.testing.assert_array_equal(masks["fc.weight_mask"].numpy(), (pruned != 0).T.astype(np.float32))
  state = torch_interop.export_state_dict(nnx.Sequential(layer), torch_names={"layers.0": "fc"})
  np.testing.assert_array_equal(state["fc.weight"].numpy(), pruned.T)


def test_linen_export_of_a_bridged_block_sparse_linear_is_its_torch_linear():
  """``nnx.bridge.ToLinen(BlockSparseLinear)`` keeps its index arrays under ``"sparsity" / "pattern"`` (a
  ``BlockSparseDense`` keeps them flat): the export read the ``(nnz, bk, bn)`` blocks as a conv kernel and wrote a
  ``weight`` of shape (4, 8, 8), with no mask. It now writes the layer's torch Linear, mask and BSR blocks included."""
  x = jax.random.normal(jax.random.key(1), (3, 32))
  bridged = nnx.bridge.ToLinen(BlockSparseLinear, args=(32, 16), kwargs={"density": 0.5, "block_shape": (8, 4)})

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nnx.bridge.ToLinen(BlockSparseLinear, args=(32, 16), kwargs={"density": 0.5, "block_shape": (8, 4)},
                                name="fc")(x)

  for model, name in [(bridged, ""), (Net(), "fc")]:
    variables = model.init(jax.random.key(0), x)
    variables["params"] = jax.tree.map(lambda v: v + 1.0, variables["params"])  # a nonzero bias counts too
    prefix = f"{name}." if name else ""
    state = torch_interop.export_state_dict(variables)
    assert {k: tuple(v.shape) for k, v in state.items()} == {f"{prefix}weight": (16, 32), f"{prefix}bias": (16,)}
    fc = torch.nn.Linear(32, 16)
    fc.load_state_dict({k[len(prefix):]: v for k, v in state.items()})
    with torch.no_grad():
      y = fc(torch.from_numpy(np.array(x))).numpy()
    np.testing.assert_allclose(y, np.asarray(model.apply(variables, x)), atol=1e-5, rtol=1e-5)
    mask = torch_interop.export_masks(variables)[f"{prefix}weight_mask"]
    assert tuple(mask.shape) == (16, 32) and int(mask.sum()) == 16 * 32 // 2
    assert bool(((state[f"{prefix}weight"] != 0) <= mask).all())
    bsr = torch_interop.export_state_dict(variables, format="bsr")[f"{prefix}weight"]
    assert bsr.layout == torch.sparse_bsr and torch.equal(bsr.to_dense(), state[f"{prefix}weight"])


def test_linen_export_refuses_variables_it_cannot_read():
  """A layer's variables the exporter cannot read are refused, naming the layer, instead of written as a guess: a
  kernel of ndim 3 whose bias is not its last axis (the blocks of a block-sparse layer with its pattern missing or
  elsewhere), and a "sparsity" entry that is no pattern of a layer beside it."""
  blocks = {"kernel": np.ones((8, 8, 4), np.float32), "bias": np.zeros(16, np.float32)}
  with pytest.raises(ValueError, match=r"^fc: its kernel has shape \(8, 8, 4\) and its bias \(16,\), not the \(out,\) "
                     r"= \(4,\) bias"):
    torch_interop.export_state_dict({"params": {"fc": blocks}})
  index = BlockSparseDense(16, density=0.5, block_shape=(8, 4)).init(jax.random.key(0), jnp.ones((1, 32)))["sparsity"]
  odd = {"params": {"fc": {"kernel": np.ones((32, 16), np.float32)}},
         "sparsity": {"fc": {"kernel_mask": np.ones((32, 16), bool)}, "head": {"pattern": dict(index)}}}
  for export in (torch_interop.export_state_dict, torch_interop.export_masks):
    with pytest.raises(ValueError, match=r"^fc: its 'sparsity' variables \['kernel_mask'\] are not the pattern"):
      export(odd)
  odd["sparsity"].pop("fc")
  with pytest.raises(ValueError, match=r"^head\.pattern: its 'sparsity' variables \['col_indices', "):
    torch_interop.export_state_dict(odd)


def test_load_nnx_into_a_compressed_embedding():
  """A model sparsify made (a CompressedNMEmbed) refused its own torch export: "the Flax model's embed.embedding has no
  torch counterpart: expected 'embed.embedding'" (a generic module's names). Now a dense weight fills the values at
  the layer's kept positions and a 2:4-masked one (format="prune") replaces the layer by one of that mask, as into
  an nnx.Embed."""
  dense = nnx.Sequential(nnx.Embed(16, 8, rngs=nnx.Rngs(0)))
  sparse = nnx.Sequential(jaxsparse.layers.CompressedNMEmbed.from_dense(dense.layers[0], 2, 4))  # as sparsify makes it
  ids = jnp.arange(-1, 17)
  for fmt in ("dense", "prune"):
    state = torch_interop.export_state_dict(sparse, format=fmt)
    target = nnx.clone(sparse)
    target.layers[0].embedding[...] = jnp.zeros_like(target.layers[0].embedding[...])
    if fmt == "prune":  # another pattern: the torch mask's replaces it
      target.layers[0] = jaxsparse.layers.CompressedNMEmbed.from_dense(dense.layers[0], 1, 4)
    report = torch_interop.load_nnx(target, state, name_map=SEQ)
    assert type(target.layers[0]).__name__ == report.layers[0].layer == "CompressedNMEmbed"
    np.testing.assert_array_equal(target(ids), sparse(ids))


def test_load_nnx_into_a_tied_embedding():
  """A torch model with tied embeddings lists the table at both paths ("head.weight" too); load_nnx matched the Flax
  model's tied module at its first path only and refused "head.weight" as "torch parameters with no Flax module"
  (the Flax model has a head). Now it loads, and torch weights that differ at the two paths are refused."""

  class Torch(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.embed, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16, bias=False)
      self.head.weight = self.embed.weight

  class Flax(nnx.Module):
    def __init__(self):
      self.embed = nnx.Embed(16, 8, rngs=nnx.Rngs(0))
      self.head = self.embed

  net, model = Torch(), Flax()
  report = torch_interop.load_nnx(model, net.state_dict())
  assert [layer.flax_path for layer in report.layers] == ["embed"] and model.head is model.embed
  np.testing.assert_array_equal(model.embed.embedding[...], net.embed.weight.detach().numpy())
  state = {**net.state_dict(), "head.weight": torch.zeros(16, 8)}
  with pytest.raises(CheckpointError, match=r"the Flax module 'embed' is also held at 'head' \(tied.*torch 'embed' "
                     r"and 'head' differ in \['weight'\]"):
    torch_interop.load_nnx(Flax(), state)


@pytest.mark.parametrize("storage", ["values", "cusparselt"])
def test_load_nnx_into_a_compressed_linear(storage):
  """A model holding a CompressedNMLinear (NMLinear.to_compressed, as sparsify makes it) refused its own torch export
  ("... has no torch counterpart", a generic module's names). Now a dense weight fills the values at the layer's kept
  positions, keeping its storage and options, and a 2:4-masked one (format="prune") of another mask replaces the layer
  by a compressed one of that mask."""
  if storage == "cusparselt" and not jaxsparse.layers.CompressedNMLinear(
      jaxsparse.NMSparseMatrix.from_dense(jnp.ones((64, 64)), 2, 4), storage="auto").storage == "cusparselt":
    storage = "values"  # no GPU here: the buffer storage builds only where cuSPARSELt reads it
  source = jaxsparse.layers.NMLinear(64, 64, rngs=nnx.Rngs(0))
  sparse = nnx.Sequential(source.to_compressed(storage=storage, implementation="xla"))
  x = jax.random.normal(jax.random.key(1), (3, 64))
  for fmt in ("dense", "prune"):
    state = torch_interop.export_state_dict(sparse, format=fmt)
    target = nnx.clone(sparse)
    if fmt == "prune":  # another mask (other kept positions): the torch mask's replaces it
      target.layers[0] = jaxsparse.layers.NMLinear(64, 64, rngs=nnx.Rngs(5)).to_compressed(
          storage=storage, implementation="xla")
    else:
      target.layers[0].kernel[...] = jnp.zeros_like(target.layers[0].kernel[...])
    report = torch_interop.load_nnx(target, state, name_map=SEQ)
    layer = target.layers[0]
    assert type(layer).__name__ == report.layers[0].layer == "CompressedNMLinear"
    assert layer.storage == storage and layer.implementation == "xla"
    np.testing.assert_allclose(target(x), sparse(x), rtol=1e-6, atol=1e-6)
  dense = {"0.weight": torch.ones(64, 64), "0.bias": torch.zeros(64)}  # dense: the layer's own positions kept
  target = nnx.clone(sparse)
  torch_interop.load_nnx(target, dense, name_map=SEQ)
  np.testing.assert_array_equal(target.layers[0].weight.positions(), sparse.layers[0].weight.positions())
  kept = np.asarray(sparse.layers[0].weight.to_dense() != 0, np.float32)
  np.testing.assert_array_equal(target.layers[0].to_dense().kernel[...], kept)


def test_export_masks_needs_torch_names_only_for_the_masked_modules():
  # A dense head without a mask used to need a torch name too ("give every exported module a torch name").
  model = nnx.Sequential(MaskedLinear(8, 8, sparsity=0.5, rngs=nnx.Rngs(0)), nnx.Linear(8, 4, rngs=nnx.Rngs(1)))
  masks = torch_interop.export_masks(model, torch_names={"layers.0": "fc1"})
  assert list(masks) == ["fc1.weight_mask"]
  np.testing.assert_array_equal(masks["fc1.weight_mask"].numpy(), np.asarray(model.layers[0].mask[...]).T)
  with pytest.raises(CheckpointError, match=r"no entry for the Flax module 'layers\.0'"):  # a masked module still does
    torch_interop.export_masks(model, torch_names={"layers.1": "head"})
  variables = {"params": {"fc": {"kernel": jnp.ones((8, 8)), "bias": jnp.zeros(8)},
                          "head": {"kernel": jnp.ones((8, 4)), "bias": jnp.zeros(4)}},
               "sparsity": {"fc": {"mask": jnp.eye(8, dtype=bool)}}}
  with pytest.warns(UserWarning, match="read by their shapes alone: head"):
    assert list(torch_interop.export_masks(variables, torch_names={"fc": "fc1"})) == ["fc1.weight_mask"]


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, "float16", np.float16])
def test_export_dtype_must_be_a_torch_float_dtype(dtype):
  # int8 / bool turned every float weight into zeros / True; a string or NumPy dtype failed inside torch's Tensor.to
  # ("Invalid device string").
  layer = MaskedLinear(8, 4, sparsity=0.5, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"dtype must be None or a floating torch\.dtype"):
    torch_interop.export_state_dict(layer, torch_names={"": "fc"}, dtype=dtype)
  if isinstance(dtype, torch.dtype):  # a mask may take any torch dtype (0 / 1)
    masks = torch_interop.export_masks(layer, torch_names={"": "fc"}, dtype=dtype)
    np.testing.assert_array_equal(masks["fc.weight_mask"].numpy().astype(bool), np.asarray(layer.mask[...]).T)
  else:
    with pytest.raises(TypeError, match=r"dtype must be None or a torch\.dtype"):
      torch_interop.export_masks(layer, torch_names={"": "fc"}, dtype=dtype)
  assert torch_interop.export_state_dict(layer, torch_names={"": "fc"}, dtype=torch.float16)["fc.weight"].dtype == \
      torch.float16


@pytest.mark.parametrize("nm, error, match", [
    ("2:4", TypeError, r"nm must be a pair of ints \(n, m\)"),
    ((2.0, 4), TypeError, r"nm must be a pair of ints"),
    ((3, 2), ValueError, r"nm=\(3, 2\) must have 1 <= n <= m"),
    ({"fc": "2:4"}, TypeError, r"nm\['fc'\] must be a pair of ints"),
    ({"(": (2, 4)}, ValueError, r"nm\['\('\]: the regex does not compile"),
])
def test_nm_argument_is_checked_naming_it(nm, error, match):
  # "2:4" failed inside the mask code ("nm_mask_torch() takes 3 positional arguments"); (2.0, 4) was taken.
  fc = torch.nn.Linear(8, 4)
  model = nnx.Sequential(nnx.Linear(8, 4, rngs=nnx.Rngs(0)))
  with pytest.raises(error, match=match):
    torch_interop.load_nnx(model, {"layers.0." + k: v for k, v in fc.state_dict().items()}, nm=nm)
  params = torch_interop.decode_checkpoint(fc.state_dict(), nm=(2, 4))  # a good one still works
  assert params["weight"].pattern.kind == "nm" and (params["weight"].pattern.n, params["weight"].pattern.m) == (2, 4)


def test_name_map_regex_errors_name_the_rule():
  fc = torch.nn.Linear(8, 4)
  model = nnx.Sequential(nnx.Linear(8, 4, rngs=nnx.Rngs(0)))
  with pytest.raises(re.error, match=r"name_map rule \('\(', 'x'\)"):
    torch_interop.load_nnx(model, fc.state_dict(), name_map=[("(", "x")])


def test_detect_pattern_refuses_a_mask_of_other_values_than_0_and_1():
  with pytest.raises(ValueError, match="must hold only 0 and 1"):
    torch_interop.detect_pattern(np.full((8, 8), 0.5))
  with pytest.raises(ValueError, match="must hold only 0 and 1"):
    torch_interop.detect_pattern(np.full((8, 8), 7, np.int32))
  float_mask = np.tile(np.array([1.0, 0.0, 0.0, 1.0], np.float32), (8, 2))  # torch.nn.utils.prune's float masks
  assert str(torch_interop.detect_pattern(float_mask)) == "2:4"

