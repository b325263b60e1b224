"""The block-sparse decode kernel (``jaxsparse/_cuda/block_sparse_decode.cu``) against the Pallas routes at 1-8 rows:
every candidate config checked against a float32 product, then each product tuned from a fresh cache as
``block_sparse_matmul`` tunes it (every route and config of the op timed with CUPTI, the weight rotated over copies
so that it comes from HBM; XLA's dense ``x @ W`` as the bound)::

    PYTHONPATH=. python3 benchmarks/sweeps/gpu_block_decode.py --products 1x4096x4096:64:0.5,8x14336x4096:128:0.5

A product is ``MxKxN:block:density`` (square blocks). Prints the tuner's line a product, then a Markdown row a
product: dense µs, the decode kernel's default and best candidate, the Pallas route's default and best route, the
choice, and the largest relative error of any decode candidate.
``benchmarks/results/llm_decode_block_decode_2026-12-02_h200.md`` has its output on an H200.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import jaxsparse
from jaxsparse._cuda import _block_sparse_decode as bsd

DEFAULT_PRODUCTS = ",".join(
    f"{m}x{shape}:{block}:{d}"
    for shape, d in (("4096x6144", 0.5), ("4096x4096", 0.5), ("4096x28672", 0.5), ("14336x4096", 0.5),
                     ("2048x2560", 0.5), ("2048x11264", 0.5), ("5632x2048", 0.5), ("8192x1024", 0.3),
                     ("4096x4096", 0.2), ("3072x8192", 0.7))
    for m in (1, 8) for block in (64, 128))


class _Decisions(logging.Handler):
  """Keeps the tuner's decision records (``jaxsparse.autotune`` at INFO: op, direction, key fields, entry)."""

  def __init__(self):
    super().__init__()
    self.entries = []

  def emit(self, record):
    if record.msg.startswith("autotune %s %s %s"):
      self.entries.append(record.args[3])


def product(spec: str) -> tuple[int, int, int, int, float]:
  shape, block, density = spec.split(":")
  m, k, n = (int(v) for v in shape.split("x"))
  return m, k, n, int(block), float(density)


def problem(m, k, n, block, density, seed=0):
  kw, km, kx = jax.random.split(jax.random.key(seed), 3)
  mask = jaxsparse.random_block_mask(km, (k, n), (block, block), density)
  w = jax.random.normal(kw, (k, n), jnp.float32).astype(jnp.bfloat16)
  w = jaxsparse.BlockSparseMatrix.from_dense(w, (block, block), block_mask=mask)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  return x, w, np.asarray(x.astype(jnp.float32) @ w.to_dense().astype(jnp.float32))


def candidate_errors(x, w, ref) -> float:
  """The largest relative error (max abs / max |ref|) of every decode candidate."""
  (m, k), n = x.shape, w.shape[1]
  worst = 0.0
  for cfg in bsd.block_sparse_decode_candidates(m, k, n, w.block_shape, w.nnz_blocks):
    y = jax.jit(lambda a, b, c=cfg: bsd.block_sparse_decode(a, b.data, b.col_offsets, b.transpose_order,
                                                            b.row_indices, n, config=c))(x, w)
    worst = max(worst, float(np.max(np.abs(np.asarray(y, np.float32) - ref)) / (np.max(np.abs(ref)) + 1e-9)))
  return worst


def row(spec: str, entry: dict, err: float) -> str:
  t = entry["times_us"]
  decode = {name: us for name, us in t.items() if name.startswith("cuda_decode")}
  pallas = {name: us for name, us in t.items() if not name.startswith("cuda_decode") and name != "dense"}
  best_d, best_p = min(decode, key=decode.get), min(pallas, key=pallas.get)
  pallas_default = next(name for name in ("default", "native:default", "split:default") if name in pallas)
  best_name = best_d.removeprefix("cuda_decode/") if "/" in best_d else "default"
  return (f"| {spec} | {entry['dense_us']:.2f} | {decode['cuda_decode']:.2f} | {decode[best_d]:.2f} ({best_name}) | "
          f"{pallas[pallas_default]:.2f} | {pallas[best_p]:.2f} ({best_p}) | {decode[best_d] / pallas[best_p]:.3f} | "
          f"{min(t.values()) / entry['dense_us']:.2f} | {entry['choice']} | {err:.1e} |")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--products", default=DEFAULT_PRODUCTS, help="MxKxN:block:density, comma-separated (M 1-8)")
  args = p.parse_args()
  os.environ.setdefault("JAXSPARSE_AUTOTUNE_BUDGET", "none")  # every candidate timed
  os.environ["JAXSPARSE_AUTOTUNE_CACHE"] = os.path.join(tempfile.mkdtemp(), "autotune.json")  # a fresh cache
  log = logging.getLogger("jaxsparse.autotune")
  log.setLevel(logging.INFO)
  decisions = _Decisions()
  log.addHandler(decisions)
  jaxsparse.set_autotune_mode("tune")
  rows = []
  for spec in args.products.split(","):
    x, w, ref = problem(*product(spec))
    err = candidate_errors(x, w, ref)
    before = len(decisions.entries)
    jax.jit(jaxsparse.ops.block_sparse_matmul)(x, w).block_until_ready()
    entry = decisions.entries[before]
    print(spec, {name: round(us, 2) for name, us in entry["times_us"].items()}, flush=True)
    rows.append(row(spec, entry, err))
  print("\n| M x K x N : block : density | dense µs | decode default µs | best decode (config) | Pallas default µs | "
        "best Pallas (route) | best decode / best Pallas | tuned / dense | choice | max rel err |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  print("\n".join(rows))


if __name__ == "__main__":
  main()
