"""Which Triton block-sparse tiles compile within the GPU's shared memory, against the library's model of them.

    python benchmarks/sweeps/gpu_triton_smem.py

Compiles and runs the Triton forward, ``dX`` and ``dW`` kernels (``jaxsparse.pallas``, an explicit config each) over
stages, row tiles and sub-column programs for float32 and bf16 blocks of 128 and 256, and prints per config: whether
it compiled, the bytes a failed compile asked for, and ``staged_bytes`` (the bound the default tiles and measured
dispatch are cut to, :func:`jaxsparse.pallas._kernel_config.fit_shared_memory`) against the device's
``DispatchRules.shared_memory_bytes``. A row where the model says "fits" but the compile failed is a bug in the
model. Prints one table, last.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import BlockSparseMatrix
from jaxsparse.pallas import BlockSparseMatmulConfig
from jaxsparse.pallas import KernelConfig
from jaxsparse.pallas import _block_sparse_matmul as kernels
from jaxsparse.pallas import dispatch_rules
from jaxsparse.pallas._kernel_config import staged_bytes

FIELD = {"fwd": "forward", "dx": "dx", "dw": "dw"}
# (direction, M, K, N, block, dtype, block_m, sub_cols); each over stages 1-4.
CASES = [
    *[("fwd", 48, 1024, 2048, (256, 256), jnp.float32, 32, sub) for sub in (None, 128, 64)],
    ("fwd", 48, 1024, 2048, (128, 128), jnp.float32, 64, None),
    ("fwd", 2, 2048, 4096, (128, 256), jnp.bfloat16, 16, None),
    ("fwd", 256, 2048, 4096, (128, 256), jnp.bfloat16, 128, None),
    ("fwd", 256, 2048, 4096, (128, 128), jnp.bfloat16, 128, None),
    ("dx", 48, 1024, 2048, (256, 256), jnp.float32, 32, None),
    ("dx", 256, 2048, 4096, (128, 128), jnp.float32, 64, None),
    ("dw", 256, 1024, 2048, (256, 256), jnp.float32, 64, None),
    ("dw", 256, 1024, 2048, (128, 128), jnp.float32, 64, None),
    ("dw", 256, 1024, 2048, (256, 256), jnp.bfloat16, 128, None),
]


def _weight(k, n, block, dtype, seed=0) -> BlockSparseMatrix:
  rng = np.random.default_rng(seed)
  mask = rng.random((k // block[0], n // block[1])) < 0.4
  mask[0, 0] = True
  return BlockSparseMatrix.from_block_mask(mask, jnp.asarray(rng.standard_normal((int(mask.sum()), *block)), dtype))


def _compiles(direction, x, dy, w, cfg) -> str:
  try:
    if direction == "fwd":
      jax.block_until_ready(jax.jit(lambda a, b: kernels.forward(a, b, config=cfg))(x, w))
    else:
      run = lambda a, d, b: kernels.backward(a, d, b, config=cfg, need_dx=direction == "dx", need_dw=direction == "dw")
      jax.block_until_ready(jax.jit(run)(x, dy, w))
    return "ok"
  except Exception as e:  # a failed compile is the measurement
    asked = re.search(r"requested (\d+)", str(e))
    return f"failed ({asked.group(1)} bytes)" if asked else f"failed ({type(e).__name__})"


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--stages", default="1,2,3,4")
  args = p.parse_args(argv)
  limit = dispatch_rules().shared_memory_bytes
  rows = ["| product | M | block | dtype | block_m | sub_cols | stages | staged_bytes | model | compile |",
          "|---|---|---|---|---|---|---|---|---|---|"]
  for direction, m, k, n, block, dtype, bm, sub in CASES:
    w = _weight(k, n, block, dtype)
    x, dy = jnp.ones((m, k), dtype), jnp.ones((m, n), dtype)
    base = BlockSparseMatmulConfig.get_default(m, w.shape, w.block_shape, w.nnz_blocks, w.dtype)
    base = dataclasses.replace(base, dense=False, forward_dense=False, dx_dense=False, dw_dense=False,
                               mosaic_forward=None, mosaic_dx=None, mosaic_dw=None)
    for stages in (int(s) for s in args.stages.split(",")):
      kc = KernelConfig(bm, num_stages=stages, sub_cols=sub, num_warps=8 if direction == "dw" else 4)
      cfg = dataclasses.replace(base, **{FIELD[direction]: kc})
      used = staged_bytes(kc, direction, block, jnp.dtype(dtype).itemsize)
      got = _compiles(direction, x, dy, w, cfg)
      model = "fits" if used <= limit else "over"
      row = (f"| {direction} | {m} | {block[0]}x{block[1]} | {jnp.dtype(dtype).name} | {bm} | {sub} | {stages} | "
             f"{used} | {model} | {got}{' **model wrong**' if model == 'fits' and got != 'ok' else ''} |")
      print(row, flush=True)
      rows.append(row)
  print(f"\nshared memory limit (DispatchRules.shared_memory_bytes): {limit}")
  print("\n".join(rows))


if __name__ == "__main__":
  main()
