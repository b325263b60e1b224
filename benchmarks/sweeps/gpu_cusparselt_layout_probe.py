"""Dumps cuSPARSELt's compressed buffers of crafted 2:4 weights, to map its (undocumented) layout.

Run on a CUDA GPU from the repository root (about 15 s); writes ``$OUT/probe.npz`` (or ``--out``):

  PYTHONPATH=. python3 benchmarks/sweeps/gpu_cusparselt_layout_probe.py

For bf16 ``(K, N)`` weights in the ``LAYOUT_KN`` orientation, 2:4 along ``K``:

* ``v_K_N``: three buffers of one weight whose kept entries hold the base-64 digits (plus one, so that
  none is zero) of their index in ``NMSparseMatrix.values`` order; decoding the first ``K * N`` bytes as
  bf16 gives where each kept value went (``vpat_K_N``: the group patterns, indices into ``PATTERNS``).
* ``m_K_N``: ten buffers of weights with random 2:4 patterns (``mpat_K_N``) and all kept values 1;
  matching each 4-bit code of the metadata against the patterns' sequence over the ten trials gives
  which group it belongs to.

What it showed on an H100 with cuSPARSELt 0.8.0 is written up in ``jaxsparse/_cuda/_layout.py``; the
tests check that module against a NumPy model (CPU) and against cuSPARSELt (GPU).
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse._cuda import _cusparselt as cslt

PATTERNS = np.array([[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]])
SHAPES = [(64, 32), (128, 64), (256, 128), (512, 256)]


def weight(pat: np.ndarray, kept: np.ndarray) -> jax.Array:
  """``(G, N)`` pattern indices and ``(G, 2, N)`` kept values -> the ``(4 G, N)`` bf16 weight."""
  g, n = pat.shape
  pos = PATTERNS[pat]
  w = np.zeros((g, 4, n), np.float32)
  for s in range(2):
    np.put_along_axis(w, pos[:, :, s][:, None, :], kept[:, s, :][:, None, :], axis=1)
  return jnp.asarray(w.reshape(4 * g, n), jnp.bfloat16)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "probe.npz"))
  args = parser.parse_args(argv)
  if not cslt.available():
    raise SystemExit(f"cuSPARSELt unavailable: {cslt.unavailable_reason()}")
  rng = np.random.default_rng(0)
  compress = jax.jit(cslt.compress)
  res = {}
  for k, n in SHAPES:
    g = k // 4
    pat = rng.integers(0, 6, size=(g, n))
    idx = np.arange(g * 2 * n).reshape(g, 2, n)  # NMSparseMatrix.values order: row 2 g + s, column n
    res[f"v_{k}_{n}"] = np.stack([np.asarray(compress(weight(pat, (idx // 64**d) % 64 + 1))) for d in range(3)])
    res[f"vpat_{k}_{n}"] = pat
    pats = [rng.integers(0, 6, size=(g, n)) for _ in range(10)]
    res[f"m_{k}_{n}"] = np.stack([np.asarray(compress(weight(p, np.ones((g, 2, n))))) for p in pats])
    res[f"mpat_{k}_{n}"] = np.stack(pats)
    print(k, n, "buffer bytes", res[f"m_{k}_{n}"].shape[1], "dense bytes", k * n * 2, flush=True)
  np.savez_compressed(args.out, **res)
  print("saved", args.out)


if __name__ == "__main__":
  main()
