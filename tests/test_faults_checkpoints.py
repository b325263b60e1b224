"""The fault set for untrusted PyTorch checkpoints and the ``jaxsparse`` command line (see tests/test_faults.py).

Crafted torch sparse tensors could crash the process (torch's ``to_dense()`` trusts their indices), so every
entry point reads them in a child process: a segfault fails the cases it hits instead of killing pytest.
"""

import functools
import io
import json
import os
import re
import struct
import warnings

import numpy as np
import pytest

from tests._faults_util import missing_report
from tests._faults_util import run_child

# -------------------------------------------------------------------------------------------------
# Untrusted torch checkpoints: crafted sparse tensors (torch.load does not check their invariants, and
# torch's to_dense() trusts them). Each is saved to a file and read by every entry point.
# -------------------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")  # the torch extra is installed in CI; see the Makefile

import jaxsparse  # noqa: E402
from jaxsparse import torch_interop  # noqa: E402
from jaxsparse.torch_interop import CheckpointError  # noqa: E402
from jaxsparse.torch_interop._cli import main as cli_main  # noqa: E402


def _coo(indices, values, size):
  return torch.sparse_coo_tensor(torch.tensor(indices), values, size, check_invariants=False)


def _compressed(layout, compressed, plain, values, size):
  return torch.sparse_compressed_tensor(torch.tensor(compressed), torch.tensor(plain), values, size,
                                        layout=getattr(torch, layout), check_invariants=False)


ones = torch.ones
_csr = functools.partial(_compressed, "sparse_csr")
_csc = functools.partial(_compressed, "sparse_csc")
_bsr = functools.partial(_compressed, "sparse_bsr")
_bsc = functools.partial(_compressed, "sparse_bsc")


def _w(t):
  return {"fc.weight": t}


# case -> (state dict builder, the key the message must name, regex the message must match)
SPARSE_CASES = {
    "coo_index_past_shape": (lambda: _w(_coo([[0, 1, 1000000], [0, 2, 3]], ones(3), (64, 64))),
                             "fc.weight", r"outside \[0, 64\)"),
    "coo_negative_index": (lambda: _w(_coo([[0, -5], [0, 1]], ones(2), (8, 8))),
                           "fc.weight", r"outside \[0, 8\)"),
    "coo_index_past_dim1": (lambda: _w(_coo([[0, 1], [0, 8]], ones(2), (8, 8))),
                            "fc.weight", r"dim 1.*outside \[0, 8\)"),
    "coo_huge_shape": (lambda: _w(_coo([[0], [0]], ones(1), (2**30, 2**30))),
                       "fc.weight", "does not fit in memory"),
    "csr_col_past_shape": (lambda: _w(_csr([0, 1, 2, 3], [0, 5, 99], ones(3), (3, 8))),
                           "fc.weight", r"col_indices.*outside \[0, 8\)"),
    "csr_negative_col": (lambda: _w(_csr([0, 1, 2, 3], [0, -1, 2], ones(3), (3, 8))),
                         "fc.weight", r"col_indices.*outside"),
    "csr_crow_not_monotone": (lambda: _w(_csr([0, 2, 1, 3], [0, 1, 2], ones(3), (3, 8))),
                              "fc.weight", "crow_indices.*non-decreasing"),
    "csr_crow_wrong_length": (lambda: _w(_csr([0, 1, 3], [0, 1, 2], ones(3), (3, 8))),
                              "fc.weight", r"crow_indices must have 4 entries"),
    "csr_crow_past_nnz": (lambda: _w(_csr([0, 1, 2, 50], [0, 1, 2], ones(3), (3, 8))),
                          "fc.weight", "crow_indices.*non-decreasing offsets from 0"),
    "csr_crow_first_not_zero": (lambda: _w(_csr([1, 1, 2, 3], [0, 1, 2], ones(3), (3, 8))),
                                "fc.weight", "crow_indices.*from 0"),
    "csr_duplicate_entry": (lambda: _w(_csr([0, 2, 2, 3], [1, 1, 0], ones(3), (3, 8))),
                            "fc.weight", "stored twice"),
    "csr_values_count": (lambda: _w(_csr([0, 1, 2, 3], [0, 1, 2], ones(2), (3, 8))),
                         "fc.weight", r"values must have shape"),
    "csr_col_count": (lambda: _w(_csr([0, 1, 2, 3], [0, 1], ones(3), (3, 8))),
                      "fc.weight", r"values must have shape"),
    "csr_float_indices": (lambda: _w(_csr([0.0, 1, 2, 3], [0.0, 1, 2], ones(3), (3, 8))),
                          "fc.weight", "must be an integer tensor"),
    "csr_batch_mismatch": (lambda: _w(_csr([[0, 1, 2, 3]], [[0, 1, 2], [0, 1, 2]], ones(2, 3), (2, 3, 8))),
                           "fc.weight", "do not describe a sparse_csr tensor"),
    "csr_batched_bad_col": (lambda: _w(_csr([[0, 1, 2, 3]] * 2, [[0, 1, 2], [0, 1, 9]], ones(2, 3), (2, 3, 8))),
                            "fc.weight", r"col_indices of batch 1.*outside"),
    "csc_row_past_shape": (lambda: _w(_csc([0, 1, 2, 3], [0, 1, 70], ones(3), (8, 3))),
                           "fc.weight", r"row_indices.*outside \[0, 8\)"),
    "csc_ccol_not_monotone": (lambda: _w(_csc([0, 3, 1, 3], [0, 1, 2], ones(3), (8, 3))),
                              "fc.weight", "ccol_indices.*non-decreasing"),
    "bsr_col_past_grid": (lambda: _w(_bsr([0, 1, 2], [0, 7], ones(2, 2, 2), (4, 4))),
                          "fc.weight", r"col_indices.*outside \[0, 2\)"),
    "bsr_block_not_dividing": (lambda: _w(_bsr([0, 1, 2], [0, 0], ones(2, 3, 3), (4, 4))),
                               "fc.weight", "blocks dividing"),
    "bsr_crow_wrong_length": (lambda: _w(_bsr([0, 1, 2, 2], [0, 1], ones(2, 2, 2), (4, 4))),
                              "fc.weight", "crow_indices must have 3 entries"),
    "bsc_row_past_grid": (lambda: _w(_bsc([0, 1, 2], [0, 3], ones(2, 2, 2), (4, 4))),
                          "fc.weight", r"row_indices.*outside \[0, 2\)"),
    "prune_sparse_mask": (lambda: {"fc.weight_orig": ones(4, 4),
                                   "fc.weight_mask": _coo([[0, 1, 1000000], [0, 2, 3]], ones(3), (4, 4))},
                          "fc.weight_mask", "expected a dense"),
    "prune_crafted_orig": (lambda: {"fc.weight_orig": _coo([[0, 1, 1000000], [0, 2, 3]], ones(3), (4, 4)),
                                    "fc.weight_mask": ones(4, 4)},
                           "fc.weight_orig", r"outside \[0, 4\)"),
    "apex_crafted_weight": (lambda: {"fc.weight": _csr([0, 1, 2, 3, 4], [0, 1, 2, 99], ones(4), (4, 4)),
                                     "fc.__weight_mma_mask": ones(4, 4)},
                            "fc.weight", r"col_indices.*outside \[0, 4\)"),
}



def _safetensors(header: dict, data: bytes) -> bytes:
  """A safetensors file with a hand-written header (the library refuses to write bad ones)."""
  raw = json.dumps(header).encode()
  return struct.pack("<Q", len(raw)) + raw + data


def _saved(obj) -> bytes:
  buffer = io.BytesIO()
  torch.save(obj, buffer)
  return buffer.getvalue()


F32 = {"dtype": "F32"}
# Whole files: case -> (file suffix, bytes builder, what the message must name, regex it must match)
FILE_CASES = {
    "st_offsets_past_end": (".safetensors", lambda: _safetensors(
        {"fc.weight": {**F32, "shape": [4, 4], "data_offsets": [0, 64]}}, bytes(16)), ".safetensors", "not a valid"),
    "st_shape_vs_offsets": (".safetensors", lambda: _safetensors(
        {"fc.weight": {**F32, "shape": [4, 4], "data_offsets": [0, 32]}}, bytes(32)), ".safetensors", "not a valid"),
    "st_unknown_dtype": (".safetensors", lambda: _safetensors(
        {"fc.weight": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)), ".safetensors", "F99"),
    "st_header_not_json": (".safetensors", lambda: struct.pack("<Q", 8) + b"notjson!" + bytes(8), ".safetensors",
                           "not a valid"),
    "st_overlapping_tensors": (".safetensors", lambda: _safetensors(
        {"fc.weight": {**F32, "shape": [2], "data_offsets": [0, 8]},
         "fc.bias": {**F32, "shape": [2], "data_offsets": [4, 12]}}, bytes(12)), ".safetensors", "offset"),
    "st_negative_shape": (".safetensors", lambda: _safetensors(
        {"fc.weight": {**F32, "shape": [-1, 4], "data_offsets": [0, 16]}}, bytes(16)), ".safetensors", "not a valid"),
    "st_header_longer_than_file": (".safetensors", lambda: struct.pack("<Q", 10**9) + b"{}", ".safetensors",
                                   "header claims"),
    "pt_prune_mask_nan": (".pt", lambda: _saved({"fc.weight_orig": torch.ones(8, 8),
                                                 "fc.weight_mask": torch.full((8, 8), float("nan"))}),
                          "fc.weight_mask", "must hold only 0 and 1"),
    "pt_prune_mask_shape": (".pt", lambda: _saved({"fc.weight_orig": torch.ones(8, 8),
                                                   "fc.weight_mask": torch.ones(8, 5)}),
                            "fc.weight_mask", r"has shape \(8, 5\) but its weight has shape \(8, 8\)"),
    "pt_sparseprop_index_past_shape": (".pt", lambda: _saved({
        "fc.W_val": torch.ones(3), "fc.W_idx.indptr": torch.tensor([0, 1, 2, 3]),
        "fc.W_idx.indices": torch.tensor([0, 1, 50]), "fc.W_shape": torch.tensor([3, 8])}),
        "fc.W_idx.indices", r"outside \[0, 8\)"),
    "pt_sparsifier_mask_shape": (".pt", lambda: _saved({
        "model": {"fc.parametrizations.weight.original": torch.ones(8, 8)},
        "sparsifier": {"state": {"fc.weight": {"mask": torch.ones(8, 5)}}}}), "fc", r"has shape \(8, 5\)"),
    "pt_truncated": (".pt", lambda: _saved({"fc.weight": torch.ones(64, 64)})[:3000], ".pt", "not a readable"),
}

PATHS = ("decode", "load_nnx", "inspect", "convert")

_CHECKPOINT_CHILD = """
import contextlib, io, json, os, sys, warnings
warnings.simplefilter("ignore")
from flax import nnx
from jaxsparse import torch_interop
from jaxsparse.torch_interop._cli import main as cli_main

directory, cases, paths = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")

class Model(nnx.Module):
  def __init__(self):
    self.fc = nnx.Linear(8, 8, rngs=nnx.Rngs(0))

def run(case, path):
  src = next(os.path.join(directory, case + ext) for ext in (".pt", ".safetensors")
             if os.path.exists(os.path.join(directory, case + ext)))
  out = os.path.join(directory, f"{case}.{path}.safetensors")
  err = io.StringIO()
  try:
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
      if path == "decode":
        torch_interop.decode_checkpoint(src)
      elif path == "load_nnx":
        torch_interop.load_nnx(Model(), src)
      elif path == "inspect":
        return {"rc": cli_main(["inspect", src]), "message": err.getvalue()}
      else:
        rc = cli_main(["convert", src, out])
        leftovers = [p for p in os.listdir(directory) if p.startswith(f"{case}.{path}") or p.endswith(".tmp")]
        return {"rc": rc, "message": err.getvalue(), "files": leftovers}
  except Exception as e:
    return {"error": type(e).__name__, "message": str(e)}
  return {"error": None, "message": ""}

for case in cases:
  for path in paths:
    print(json.dumps({"case": f"{case}/{path}", **run(case, path)}), flush=True)
"""


@pytest.fixture(scope="module")
def checkpoint_results(tmp_path_factory):
  directory = tmp_path_factory.mktemp("bad_checkpoints")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch warns that invariant checks are off: that is the point
    for case, (build, _, _) in SPARSE_CASES.items():
      torch.save(build(), directory / f"{case}.pt")
    for case, (suffix, build, _, _) in FILE_CASES.items():
      (directory / f"{case}{suffix}").write_bytes(build())
  cases = [*SPARSE_CASES, *FILE_CASES]
  results, proc = run_child(_CHECKPOINT_CHILD, str(directory), ",".join(cases), ",".join(PATHS))
  return results, proc


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", [*SPARSE_CASES, *FILE_CASES])
def test_crafted_checkpoint(checkpoint_results, case, path):
  results, proc = checkpoint_results
  key, pattern = SPARSE_CASES[case][1:] if case in SPARSE_CASES else FILE_CASES[case][2:]
  r = results.get(f"{case}/{path}")
  assert r is not None, missing_report(results, f"{case}/{path}", proc)
  if path in ("inspect", "convert"):
    assert r["rc"] == 1, r
    assert "jaxsparse: error" in r["message"] or "could not be decoded" in r["message"], r
  else:
    assert r["error"] == "CheckpointError", r
  assert key in r["message"], r
  assert re.search(pattern, r["message"], re.S), r
  if path == "convert":
    assert r["files"] == [], f"convert left files behind: {r['files']}"


def test_valid_torch_sparse_layouts_match_torch():
  """The NumPy densification agrees with torch's own on valid tensors (batch, hybrid, blocked, duplicates)."""

  g = torch.Generator().manual_seed(0)
  d = torch.randn(16, 32, generator=g) * (torch.rand(16, 32, generator=g) < 0.3)
  sd = {
      "coo": d.to_sparse(), "csr": d.to_sparse_csr(), "csc": d.to_sparse_csc(), "bsr": d.to_sparse_bsr((8, 8)),
      "bsc": d.to_sparse_bsc((4, 8)), "hybrid_coo": torch.randn(4, 6, 3, generator=g).to_sparse(2),
      "batched_csr": torch.stack([d, 2 * d]).to_sparse_csr(),
      "batched_bsr": torch.stack([d, 2 * d]).to_sparse_bsr((4, 8)),
      "hybrid_csr": torch.randn(4, 6, 3, generator=g).to_sparse_csr(dense_dim=1), "bf16": d.bfloat16().to_sparse_csr(),
      "empty": torch.zeros(3, 4).to_sparse(),
      "duplicates": torch.sparse_coo_tensor([[0, 0, 1], [1, 1, 2]], torch.tensor([1.0, 2.0, 3.0]), (4, 4),
                                          check_invariants=True),
  }
  params = torch_interop.decode_checkpoint(sd)
  for k, t in sd.items():
    np.testing.assert_array_equal(params[k].value.astype(np.float32), t.to_dense().float().numpy(), err_msg=k)
    ones_t = torch.sparse_coo_tensor(t.coalesce().indices(), torch.ones(t.coalesce().values().shape), t.shape) \
        if t.layout == torch.sparse_coo else None
    if ones_t is not None:
      np.testing.assert_array_equal(params[k].mask, ones_t.to_dense().numpy() != 0, err_msg=k)
  assert params["duplicates"].value[0, 1] == 3.0 and params["duplicates"].mask.sum() == 2
  assert params["bsr"].mask.sum() % 64 == 0 and params["bsr"].pattern.kind in ("block", "dense")


# -------------------------------------------------------------------------------------------------
# The command line: bad arguments and rules that do not apply.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["convert", "a", "b", "--name-map", "(=x"], "name map '(=x'"),
        (["convert", "a", "b", "--name-map", r"a=\3"], "bad replacement"),
        (["convert", "a", "b", "--rules", "[=nm:2:4"], "not a valid regular expression"),
        (["convert", "a", "b", "--rules", "x=block:lots"], "rule 'x=block:lots'"),
        (["convert", "a", "b", "--rules", "x=nm:2"], "rule 'x=nm:2'"),
        (["convert", "a", "b", "--rules", "=nm:2:4"], "must look like REGEX=SPEC"),
        # Was: "invalid literal for int() with base 10: ''", naming neither the format nor the value.
        (["convert", "a", "b", "--rules", "fc1=block:0.5:3x"],
         "rule 'fc1=block:0.5:3x': the block shape must be BKxBN (two positive ints, e.g. 32x32), got '3x'."),
        (["bench", "64x64", "--patterns", "block:0.5:8x8x8"], "BKxBN (two positive ints, e.g. 32x32), got '8x8x8'"),
        (["inspect", "a", "--nm", "2:x"], "--nm must look like N:M"),
        (["bench", "0x5"], "both sizes must be positive"),
        (["bench", "64x64", "--patterns", "nm:2"], "pattern 'nm:2'"),
    ],
)
def test_cli_bad_arguments(capsys, args, fragment):
  with pytest.raises(SystemExit) as e:
    cli_main(args)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert fragment in err and "Traceback" not in err, err


def _pruned_conv_net_file(tmp_path):
  net = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8, 16))
  sd = {"conv.weight": net[0].weight.detach(), "conv.bias": net[0].bias.detach(),
        "fc.weight": net[2].weight.detach(), "fc.bias": net[2].bias.detach(), "embed.weight": torch.randn(10, 4)}
  torch.save(sd, tmp_path / "in.pt")
  return tmp_path / "in.pt"


@pytest.mark.parametrize(
    "rules, fragment",
    [
        (["nothing=nm:2:4"], r"rule(s) ['nothing'] matched no Linear weight"),
        (["fc=nm:2:4", "fcc?x=dense"], r"rule(s) ['fcc?x'] matched no Linear weight"),
        (["conv=nm:2:4"], "'conv.weight' (Flax 'conv'), a 4-D (convolution) weight"),
        (["embed=unstructured:0.5"], "'embed.weight' (Flax 'embed'), an embedding"),
        ([".*=block:0.5:4x4"], "a 4-D (convolution) weight"),
    ],
)
def test_cli_convert_rules_that_do_not_apply(tmp_path, capsys, rules, fragment):
  src = _pruned_conv_net_file(tmp_path)
  out = tmp_path / "out.safetensors"
  assert cli_main(["convert", str(src), str(out), "--rules", *rules]) == 1
  err = capsys.readouterr().err
  assert fragment in err, err
  assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_rules_keep_working_where_they_apply(tmp_path, capsys):
  src = _pruned_conv_net_file(tmp_path)
  out = tmp_path / "out.safetensors"
  # a None rule may name a conv (keep it dense); a lone structure applies to Linear weights only
  assert cli_main(["convert", str(src), str(out), "--rules", "conv=dense", "fc=nm:2:4"]) == 0, capsys.readouterr().err
  assert torch_interop.load_flax_variables(out)["sparsity"]["fc"]["mask"].mean() == 0.5
  params = torch_interop.decode_checkpoint(src)
  assert torch_interop.apply_rules(params, jaxsparse.NM(2, 4))["fc.weight"].mask.mean() == 0.5


def test_linen_variables_keep_a_pruned_conv_mask(tmp_path):
  import flax.linen as nn  # noqa: PLC0415
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import torch.nn.utils.prune as prune  # noqa: PLC0415

  torch.manual_seed(0)
  conv = torch.nn.Conv2d(4, 8, 3)
  prune.l1_unstructured(conv, "weight", amount=0.7)
  variables = torch_interop.to_linen_variables({f"conv.{k}": v for k, v in conv.state_dict().items()})
  mask = np.asarray(variables["sparsity"]["conv"]["mask"])
  assert mask.shape == (3, 3, 4, 8) and mask.mean() == pytest.approx(0.3, abs=0.01)
  np.testing.assert_array_equal(mask, conv.weight_mask.numpy().astype(bool).transpose(2, 3, 1, 0))
  # The mask keeps pruned weights at zero through Flax's masked conv, as torch computes.
  x = np.random.default_rng(0).standard_normal((1, 4, 6, 6)).astype(np.float32)
  flax_conv = nn.Conv(8, (3, 3), padding="VALID", mask=jnp.asarray(mask))
  y = flax_conv.apply({"params": variables["params"]["conv"]}, jnp.asarray(x.transpose(0, 2, 3, 1)))
  with torch.no_grad():
    expected = conv(torch.from_numpy(x)).numpy().transpose(0, 2, 3, 1)
  np.testing.assert_allclose(np.asarray(y), expected, atol=1e-5)
  grads = jax.grad(lambda p: flax_conv.apply({"params": p}, jnp.ones((1, 6, 6, 4))).sum())(variables["params"]["conv"])
  assert not np.asarray(grads["kernel"])[~mask].any()
  # and through the CLI
  torch.save({f"conv.{k}": v for k, v in conv.state_dict().items()}, tmp_path / "conv.pt")
  assert cli_main(["convert", str(tmp_path / "conv.pt"), str(tmp_path / "out.safetensors")]) == 0
  np.testing.assert_array_equal(torch_interop.load_flax_variables(tmp_path / "out.safetensors")["sparsity"]["conv"]
                                ["mask"], mask)


def test_corrupt_flax_variable_files(tmp_path):
  good = torch_interop.save_flax_variables({"params": {"fc": {"kernel": np.ones((4, 4), np.float32)}}},
                                           tmp_path / "ckpt", format="orbax")
  (tmp_path / "empty").mkdir()
  (tmp_path / "junk.safetensors").write_bytes(b"junk")
  corrupt = tmp_path / "corrupt"
  corrupt.mkdir()
  for name in os.listdir(good):
    src = os.path.join(good, name)
    if os.path.isfile(src):
      (corrupt / name).write_bytes(b"garbage" if name.startswith(("manifest", "_METADATA")) else open(src, "rb").read())
  cases = {"empty": "is not a readable orbax checkpoint", "corrupt": "is not a readable orbax checkpoint",
           "junk.safetensors": "is not a readable safetensors file", "missing.safetensors": "is not a readable"}
  for name, fragment in cases.items():
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path / name} {fragment}")):
      torch_interop.load_flax_variables(tmp_path / name)
  assert torch_interop.load_flax_variables(good)["params"]["fc"]["kernel"].shape == (4, 4)


def test_flax_variable_file_whose_key_is_a_tensor_and_a_parent(tmp_path, capsys):
  """``params/fc`` both a tensor and the parent of ``params/fc/kernel``: a CheckpointError naming both keys (the CLI
  prints it on one line), in either key order, never an IndexError or a silently dropped tensor."""
  from safetensors.numpy import save_file  # noqa: PLC0415

  from jaxsparse.torch_interop._files import _nested  # noqa: PLC0415

  path = tmp_path / "conflict.safetensors"
  save_file({"params/fc": np.ones(2, np.float32), "params/fc/kernel": np.ones((2, 2), np.float32)}, str(path))
  message = re.escape(f"{path}: key 'params/fc' holds a tensor but is also the parent of 'params/fc/kernel'")
  with pytest.raises(CheckpointError, match=message):
    torch_interop.load_flax_variables(path)
  torch.save({"fc.weight": torch.ones(2, 2)}, tmp_path / "in.pt")
  assert cli_main(["convert", str(tmp_path / "in.pt"), str(tmp_path / "out.safetensors"), "--target", str(path)]) == 1
  err = capsys.readouterr().err
  assert re.fullmatch(f"jaxsparse: error: {message}.*\n", err), err
  assert not (tmp_path / "out.safetensors").exists()
  # Safetensors sorts its keys, so the tensor comes first in a file; an orbax tree may give the other order.
  with pytest.raises(CheckpointError, match=r"ckpt: key 'params/fc' holds a tensor but is also the parent of "
                     r"'params/fc/kernel'"):
    _nested({"params/fc/kernel": np.ones((2, 2)), "params/fc": np.ones(2)}, origin="ckpt")


def test_bool_mask_bytes_other_than_one_mean_kept(tmp_path):
  """A safetensors ``BOOL`` mask may hold any nonzero byte for True (a ``U8`` tensor relabelled in the header); such
  bytes flowed into MaskedLinear's mask, which then scaled the kept weights by 2 without a word."""
  rng = np.random.default_rng(0)
  w = rng.standard_normal((16, 32)).astype(np.float32)
  kept = rng.random((16, 32)) < 0.4
  stored = kept.astype(np.uint8) * 2
  path = tmp_path / "mask_bytes.safetensors"
  header = {"fc.weight": {**F32, "shape": [16, 32], "data_offsets": [0, w.nbytes]},
            "fc.weight_mask": {"dtype": "BOOL", "shape": [16, 32], "data_offsets": [w.nbytes, w.nbytes + kept.size]}}
  path.write_bytes(_safetensors(header, w.tobytes() + stored.tobytes()))
  mask = torch_interop.decode_checkpoint(str(path))["fc.weight"].mask
  np.testing.assert_array_equal(mask.view(np.uint8), kept.astype(np.uint8))
  from flax import nnx  # noqa: PLC0415

  model = nnx.Sequential(nnx.Linear(32, 16, use_bias=False, rngs=nnx.Rngs(0)))
  torch_interop.load_nnx(model, str(path), name_map={"fc": "layers.0"})
  assert type(model.layers[0]).__name__ == "MaskedLinear"
  x = rng.standard_normal((3, 32)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(model(x)), x @ np.where(kept, w, 0).T, atol=1e-5, rtol=1e-5)
  linen_mask = np.asarray(torch_interop.to_linen_variables(str(path))["sparsity"]["fc"]["mask"])
  np.testing.assert_array_equal(linen_mask.view(np.uint8), kept.T.astype(np.uint8))


def test_a_write_failing_midway_leaves_nothing_and_an_error(tmp_path, monkeypatch, capsys):
  """A disk that fills up while the variables are written: safetensors' own error (SafetensorError, no OSError)
  escaped `jaxsparse convert` as a traceback, and orbax left its temporary directory behind."""
  import orbax.checkpoint as ocp  # noqa: PLC0415
  import safetensors.torch  # noqa: PLC0415

  variables = {"params": {"fc": {"kernel": np.ones((4, 4), np.float32)}}}

  class SafetensorError(Exception):  # as safetensors raises it: not an OSError
    pass

  def full_disk(tensors, filename, metadata=None):
    with open(filename, "wb") as f:
      f.write(b"\0" * 10)  # part of the file, then the disk is full
    raise SafetensorError("Error while serializing: I/O error: No space left on device")

  monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
  out = tmp_path / "out.safetensors"
  with pytest.raises(CheckpointError, match=r"cannot write .*out\.safetensors: Error while serializing"):
    torch_interop.save_flax_variables(variables, str(out))
  assert os.listdir(tmp_path) == []

  def orbax_full_disk(self, directory, *args, **kwargs):
    os.makedirs(f"{directory}.orbax-checkpoint-tmp-1764700000")
    with open(f"{directory}.orbax-checkpoint-tmp-1764700000/part", "wb") as f:
      f.write(b"\0" * 10)
    raise ValueError("RESOURCE_EXHAUSTED: No space left on device")

  keep = tmp_path / "unrelated.orbax-checkpoint-tmp-1"  # another save's: left alone
  keep.mkdir()
  monkeypatch.setattr(ocp.StandardCheckpointer, "save", orbax_full_disk)
  with pytest.raises(ValueError, match="No space left on device"):
    torch_interop.save_flax_variables(variables, str(tmp_path / "ckpt"), format="orbax")
  assert sorted(os.listdir(tmp_path)) == ["unrelated.orbax-checkpoint-tmp-1"]
