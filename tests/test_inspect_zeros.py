"""``jaxsparse inspect`` on pruned weights stored dense: the exact zeros of each weight and the structure they form.

A checkpoint pruned and saved as plain dense weights (``torch.nn.utils.prune`` made permanent, 2:4 or block pruning
stored dense) showed every weight as ``dense``, density 1.000, with no word that most entries are zeros.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the torch extra is installed in CI; see the Makefile
import torch.nn.utils.prune as prune  # noqa: E402

from jaxsparse.torch_interop import apply_rules  # noqa: E402
from jaxsparse.torch_interop import decode_checkpoint  # noqa: E402
from jaxsparse.torch_interop._cli import main as cli_main  # noqa: E402
from jaxsparse.torch_interop._cli import parse_rule  # noqa: E402
from jaxsparse.torch_interop._patterns import nm_mask_torch  # noqa: E402
from jaxsparse.torch_interop._patterns import zero_pattern  # noqa: E402


def _weight(shape, seed=0):
  """Normal values, no exact zero."""
  w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  return np.where(w == 0, np.float32(1), w)


def _nm(shape, n, m, seed=0):
  """A weight keeping ``n`` of every ``m`` along dim 1 (the rest exact zeros), as N:M pruning stored dense."""
  w = _weight(shape, seed)
  return np.where(nm_mask_torch(w, n, m), w, np.float32(0))


def _blocks(grid, block, seed=0):
  """A weight whose zeros are whole ``block`` blocks: ``grid`` says which blocks are kept."""
  w = _weight((len(grid) * block[0], len(grid[0]) * block[1]), seed)
  return np.where(np.kron(np.asarray(grid, bool), np.ones(block, bool)), w, np.float32(0))


def test_zero_pattern():
  assert (str(zero_pattern(_nm((16, 32), 2, 4))), zero_pattern(_nm((16, 32), 2, 4)).density) == ("2:4", 0.5)
  # The tightest n:m: a 1:8 weight also holds at most 1 nonzero in every 4; 1:2 is reported as 2:4, as detect_pattern.
  assert str(zero_pattern(_nm((16, 64), 1, 8))) == "1:8"
  assert str(zero_pattern(_nm((16, 32), 1, 2))) == "2:4"
  assert str(zero_pattern(_nm((16, 64), 4, 8))) == "4:8"
  # At most n: a group pruned further (a zero row) is still n:m; the groups run along dim 1 (the inputs), not dim 0.
  w = _nm((16, 32), 2, 4)
  w[3] = 0
  assert str(zero_pattern(w)) == "2:4"
  assert zero_pattern(_nm((32, 16), 2, 4).T).kind == "unstructured"
  assert str(zero_pattern(_nm((8, 16, 3, 3), 2, 4))) == "2:4"  # a conv weight: along its input channels
  # Whole blocks, the largest that holds them (a 32x32 grid is also one of 16x16 blocks), blocks holding a nonzero
  # kept; a few zeros inside kept blocks (1% of the zeros) do not hide them.
  grid = [[1, 0, 0, 1], [0, 0, 1, 0]]
  found = zero_pattern(_blocks(grid, (32, 32)))
  assert (found.kind, found.block_shape, found.density) == ("block", (32, 32), 3 / 8)
  w = _blocks(grid, (16, 64))
  w[0, :8] = 0  # 8 stray zeros; 5 * 16 * 64 lie in zero blocks
  assert zero_pattern(w).block_shape == (16, 64)
  w[1, :80] = 0  # ... but not 88 of them
  assert zero_pattern(w).kind == "unstructured"
  # Unstructured: random zeros; no zeros; nothing but zeros; bfloat16.
  rng = np.random.default_rng(0)
  w = np.where(rng.random((64, 64)) < 0.6, 0, _weight((64, 64))).astype(np.float32)
  assert (zero_pattern(w).kind, zero_pattern(w).density) == ("unstructured", np.count_nonzero(w) / w.size)
  assert zero_pattern(_weight((8, 8))).kind == "dense"
  assert (zero_pattern(np.zeros((8, 8))).kind, zero_pattern(np.zeros((8, 8))).density) == ("unstructured", 0.0)
  assert str(zero_pattern(_nm((16, 32), 2, 4).astype(ml_dtypes.bfloat16))) == "2:4"


def _state_dict():
  torch.manual_seed(0)
  unstructured = torch.nn.Linear(64, 64)
  prune.l1_unstructured(unstructured, "weight", amount=0.6)
  prune.remove(unstructured, "weight")  # made permanent: a plain dense weight, 60% zeros
  masked = torch.nn.Linear(32, 16)
  prune.custom_from_mask(masked, "weight", torch.from_numpy(nm_mask_torch(_weight((16, 32)), 2, 4)))
  padded = _weight((32, 16))
  padded[0] = 0  # an embedding's padding row: 3% zeros, no pruning
  return {
      "enc.fc1.weight": torch.from_numpy(_nm((128, 64), 2, 4)), "enc.fc1.bias": torch.zeros(128),
      "enc.fc2.weight": torch.from_numpy(_blocks([[1, 0, 0, 0], [0, 0, 1, 0]], (32, 16))),
      "fc3.weight": unstructured.weight.detach(),
      "conv.weight": torch.from_numpy(_nm((8, 16, 3, 3), 1, 4)),
      "tok_embed.weight": torch.from_numpy(_nm((32, 16), 2, 4)), "pos_embed.weight": torch.from_numpy(padded),
      "dense.weight": torch.from_numpy(_weight((16, 16))), "zero.weight": torch.zeros(8, 8),
      **{f"masked.{k}": v for k, v in masked.state_dict().items()},
  }


def test_cli_inspect_reports_the_zeros_of_dense_weights(tmp_path, capsys):
  torch.save(_state_dict(), tmp_path / "pruned.pt")
  assert cli_main(["inspect", str(tmp_path / "pruned.pt")]) == 0
  out = capsys.readouterr().out.splitlines()
  # The table: the columns it had, then the exact zeros of each tensor (the effective weight's: a mask's zeros too).
  assert out[1].split() == ["name", "shape", "dtype", "format", "pattern", "density", "zeros"]
  rows = {line.split()[0]: line.split()[1:] for line in out[2:13]}
  assert rows["enc.fc1.weight"] == ["128x64", "float32", "dense", "dense", "1.000", "0.500"]
  assert rows["enc.fc1.bias"][-1] == "1.000" and rows["dense.weight"][-1] == "0.000"
  assert rows["fc3.weight"][-1] == "0.600" and rows["pos_embed.weight"][-1] == "0.031"
  assert rows["masked.weight"] == ["16x32", "float32", "torch.nn.utils.prune", "2:4", "0.500", "0.500"]
  total = 128 * 64 + 64 * 64 * 2 + 8 * 16 * 9 + 32 * 16 * 3 + 16 * 16 + 8 * 8
  assert out[13] == f"weights (ndim >= 2): {total - 256}/{total} kept, density 0.987"  # as before: the mask's
  # The hints: the dense weights holding at least 10% zeros (not the padding row, the bias, the masked weight).
  assert out[14] == ("6 dense weight(s) hold a pruning's exact zeros (convert's --rules below name torch module "
                     "paths; with --name-map, name the mapped ones):")
  assert out[15:] == [
      "  enc.fc1.weight: dense storage, 50.0% zeros, 2:4 along dim 1 (the inputs): sparsify with convert --rules "
      r"'enc\.fc1=nm:2:4'",
      "  enc.fc2.weight: dense storage, 75.0% zeros, in whole 32x16 blocks (out x in), 25.0% of them kept: sparsify "
      r"with convert --rules 'enc\.fc2=block:0.25:16x32'",
      "  fc3.weight: dense storage, 60.0% zeros, unstructured: sparsify with convert --rules 'fc3=unstructured:0.6'",
      "  conv.weight: dense storage, 75.0% zeros, 1:4 along dim 1 (the input channels): after loading, sparsify its "
      "layer with jaxsparse.NM(1, 4) (convert's rules take Linear weights only)",
      "  tok_embed.weight: dense storage, 50.0% zeros, 2:4 along dim 1 (the features): after loading, sparsify its "
      "layer with jaxsparse.NM(2, 4) (convert's rules take Linear weights only)",
      "  zero.weight: dense storage, 100.0% zeros: every entry is zero",
  ]
  # Each rule, as convert applies it, keeps every nonzero of its weight and drops every zero (these weights' kept
  # groups and blocks hold no zero).
  params = decode_checkpoint(str(tmp_path / "pruned.pt"))
  for line in out[15:18]:
    name = line.split(":")[0].strip()
    rule = parse_rule(re.search(r"--rules '(.*)'$", line).group(1))
    got = apply_rules(params, dict([rule]))[name]
    np.testing.assert_array_equal(got.mask, params[name].value != 0, err_msg=line)


def test_cli_inspect_of_a_checkpoint_without_zeros_is_as_before(tmp_path, capsys):
  torch.save(torch.nn.Linear(8, 4).state_dict(), tmp_path / "dense.pt")
  assert cli_main(["inspect", str(tmp_path / "dense.pt")]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[2].split() == ["weight", "4x8", "float32", "dense", "dense", "1.000", "0.000"]
  assert out[-1] == "weights (ndim >= 2): 32/32 kept, density 1.000"  # no hints
