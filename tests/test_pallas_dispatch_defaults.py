"""The default block-sparse configs over a grid of products, pinned to what the measured rules chose on 2026-11-27.

The expected values were generated from the flat ``DispatchRules`` table before it became typed per-route rules
(issue 35), and are stored as one hash per (rules, Mosaic available or not, shape, blocks, dtype) group in
``tests/data/dispatch_defaults.json``. A change to a rule's value or to how the rules are read changes a hash:
regenerate the file (``JAXSPARSE_REGEN_DISPATCH_DEFAULTS=1``) only for a change meant to move the defaults, and
name it in the commit.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import pathlib

import jax
import pytest

from jaxsparse.formats import BlockSparseMatrix
from jaxsparse.pallas import BlockSparseMatmulConfig
from jaxsparse.pallas import _block_sparse_candidates as candidates_lib
from jaxsparse.pallas import _block_sparse_config as kernel_config
from jaxsparse.pallas import dispatch_rules

DATA = pathlib.Path(__file__).parent / "data" / "dispatch_defaults.json"

RULES = {
    "h100": ("NVIDIA H100 80GB HBM3", 132),
    "h200_60sms": ("NVIDIA H200", 60),
    "a100_borrowed": ("NVIDIA A100-SXM4-80GB", 108),
}
MS = (1, 16, 64, 65, 128, 192, 200, 256, 384, 512, 640, 768, 1000, 1024, 2048, 4096, 8192)
SHAPES = ((256, 256), (768, 3072), (1024, 1024), (2048, 5120), (4096, 4096), (4096, 14336), (5120, 768),
          (16384, 4096), (4096, 16384))
BLOCKS = ((16, 16), (32, 32), (32, 64), (64, 32), (64, 64), (64, 128), (128, 64), (128, 128), (128, 32))
DTYPES = ("bfloat16", "float32")
DENSITIES = (0.05, 0.1, 0.125, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0)


def _canonical(cfg) -> str:
  # Fields added since the pin at their default value are left out (MosaicKernelConfig.balance = 0: round-robin;
  # dynamic = False: tiles dealt, not taken from a counter).
  added = {"balance": 0, "dynamic": False}

  def drop_new(v):
    if isinstance(v, dict):
      return {k: drop_new(x) for k, x in v.items() if not (k in added and x == added[k])}
    return v

  return json.dumps(drop_new(dataclasses.asdict(cfg)), sort_keys=True, default=str)


def _nnz(shape, block, density) -> int:
  grid = (shape[0] // block[0]) * (shape[1] // block[1])
  return max(1, round(density * grid))


def _default_hashes() -> dict[str, str]:
  out = {}
  for (name, (kind, sms)), hopper in itertools.product(RULES.items(), (True, False)):
    rules = dispatch_rules(kind, sms)
    probe = (lambda: None) if hopper else (lambda: "no Hopper GPU")
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(kernel_config, "_mosaic_probe", probe)
      for shape, block, dtype in itertools.product(SHAPES, BLOCKS, DTYPES):
        h = hashlib.sha256()
        for m, d in itertools.product(MS, DENSITIES):
          cfg = BlockSparseMatmulConfig.get_default(m, shape, block, _nnz(shape, block, d), dtype, rules=rules)
          h.update(f"{m},{d}:{_canonical(cfg)}\n".encode())
        out[f"{name}/{'hopper' if hopper else 'triton'}/{shape[0]}x{shape[1]}/{block[0]}x{block[1]}/{dtype}"] = (
            h.hexdigest()[:16]
        )
  return out


def _candidate_hashes() -> dict[str, str]:
  # Candidates read the rules of the first device (the CPU here borrows the Hopper table); as on a Hopper GPU.
  out = {}
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(kernel_config, "_mosaic_probe", lambda: None)
    for shape, block, dtype in itertools.product(SHAPES[3:6], BLOCKS[1:], DTYPES):
      grid, nnz = (shape[0] // block[0], shape[1] // block[1]), _nnz(shape, block, 0.25)
      w = jax.eval_shape(  # a traced mask: the block count is taken from the data's shape
          functools.partial(BlockSparseMatrix.from_block_mask, shape=shape),
          jax.ShapeDtypeStruct(grid, bool), jax.ShapeDtypeStruct((nnz, *block), dtype),
      )
      h = hashlib.sha256()
      for m, direction in itertools.product((1, 16, 256, 1024, 8192), candidates_lib.DIRECTIONS):
        x2 = jax.ShapeDtypeStruct((m, shape[0]), dtype)
        found = candidates_lib.candidates(direction, x2, w, out_dtype=dtype)
        h.update(f"{m},{direction}:{[(n, _canonical(c)) for n, c in found]}\n".encode())
      out[f"{shape[0]}x{shape[1]}/{block[0]}x{block[1]}/{dtype}"] = h.hexdigest()[:16]
  return out


def _check(key: str, got: dict[str, str]) -> None:
  if os.environ.get("JAXSPARSE_REGEN_DISPATCH_DEFAULTS"):
    data = json.loads(DATA.read_text()) if DATA.exists() else {}
    data[key] = got
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")
  expected = json.loads(DATA.read_text())[key]
  changed = sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))
  assert not changed, f"{len(changed)} of {len(expected)} groups changed their default configs: {changed[:10]}"


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_default_configs_unchanged():
  got = _default_hashes()
  assert len(got) == len(RULES) * 2 * len(SHAPES) * len(BLOCKS) * len(DTYPES)
  _check("get_default", got)


def test_candidates_unchanged():
  _check("candidates", _candidate_hashes())
