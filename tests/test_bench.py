"""``jaxsparse bench`` on tiny shapes: one row per sparse layer, timings that add up, clear errors."""

from __future__ import annotations

import pytest

import jaxsparse
from jaxsparse._bench import bench
from jaxsparse.torch_interop._cli import main as cli_main


def test_cli_bench_prints_a_row_per_layer(capsys):
  args = ["bench", "32x64", "--patterns", "block:0.5:16x16", "nm:2:4", "--batch", "4", "--progress"]
  assert cli_main(args) == 0
  out, err = capsys.readouterr()
  lines = out.splitlines()
  assert lines[0].startswith("backend: cpu") and "batch 4, float32" in lines[0]
  header = lines[1].split()
  assert header[:6] == ["shape", "(in", "x", "out)", "layer", "pattern"]
  rows = [line.split() for line in lines[2:-1]]
  assert [r[1] for r in rows] == ["BlockSparseLinear", "NMLinear", "CompressedNMLinear"]
  assert {r[0] for r in rows} == {"32x64"}
  for r in rows:
    times = [float(v) for v in r[-6:]]
    dense_fwd, sparse_fwd, ratio_fwd, dense_train, sparse_train, ratio_train = times
    assert min(dense_fwd, sparse_fwd, dense_train, sparse_train) > 0
    # The ratio is of the unrounded times; the printed times are rounded to 0.001 ms, the ratio to 0.01.
    for ratio, sparse, dense in ((ratio_fwd, sparse_fwd, dense_fwd), (ratio_train, sparse_train, dense_train)):
      assert (sparse - 5e-4) / (dense + 5e-4) - 5e-3 <= ratio <= (sparse + 5e-4) / (dense - 5e-4) + 5e-3
  # The dense layer is timed once per shape and shared by its rows.
  assert len({r[-6] for r in rows}) == 1
  assert lines[-1].startswith("ratio: sparse time / dense time")
  assert "timing" in err and "3/3" in err  # tqdm: the dense layer and the two patterns


def test_bench_modes_and_errors(capsys):
  rows = bench([(16, 16)], [jaxsparse.Unstructured(sparsity=0.5)], batch=2, modes=("fwd+bwd",))
  assert [(r.layer, r.pattern, set(r.sparse_ms), set(r.dense_ms)) for r in rows] == [
      ("MaskedLinear", "unstructured 50%", {"fwd+bwd"}, {"fwd+bwd"})
  ]
  with pytest.raises(ValueError, match=r"modes must be a non-empty subset of \('fwd', 'fwd\+bwd'\)"):
    bench([(16, 16)], [], modes=("backward",))
  with pytest.raises(ValueError, match="dtype must be a floating dtype"):
    bench([(16, 16)], [], dtype="int32")
  for bad in (["bench", "16by16"], ["bench", "16x16", "--patterns", "dense"], ["bench", "16x16", "--patterns", "nm:2"]):
    with pytest.raises(SystemExit):
      cli_main(bad)
  err = capsys.readouterr().err
  assert "shape must look like INxOUT" in err
  assert "SPEC must be block:DENSITY[:BKxBN], nm:N:M, unstructured:SPARSITY, got 'dense'" in err
  # A shape the pattern does not fit fails with the library's message, not a traceback.
  assert cli_main(["bench", "48x48", "--patterns", "block:0.5:32x32", "--batch", "2"]) == 1
  err = capsys.readouterr().err
  assert "shape 48x48, pattern block 32x32 50% kept: block_shape=(32, 32) does not divide" in err
