"""``jaxsparse bench``: times sparse layers against the dense layer for the user's own shapes.

For each ``(in_features, out_features)`` shape and each pattern, a dense ``nnx.Linear`` is made sparse
with :func:`jaxsparse.sparsify` and both are timed on ``(batch, in_features)`` inputs on the current JAX
backend: the forward pass, and forward+backward (gradients of the parameters and the input), each
jitted, compiled and warmed up first, median of several runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsparse import _utils
from jaxsparse._sparsify._nnx import sparsify
from jaxsparse._sparsify._report import time_nnx_layer
from jaxsparse._tuning import _cache
from jaxsparse._tuning import autotune
from jaxsparse.formats._specs import NM
from jaxsparse.formats._specs import Spec
from jaxsparse.formats._specs import check_spec_applies

__all__ = ["BenchRow", "bench", "bench_table", "tune"]

MODES = {"fwd": "forward", "fwd+bwd": "train"}


@dataclasses.dataclass(frozen=True)
class BenchRow:
  """Times of one sparse layer and of the dense layer of the same shape, in milliseconds per call.

  ``sparse_ms`` and ``dense_ms`` map a mode (``"fwd"``, ``"fwd+bwd"``) to the median time.
  """

  shape: tuple[int, int]
  layer: str
  pattern: str
  dense_ms: dict[str, float]
  sparse_ms: dict[str, float]


def _layers(lin: nnx.Linear, spec: Spec) -> list[nnx.Module]:
  layer, _ = sparsify(lin, {".*": spec})
  # N:M trains as NMLinear (dense kernel, SR-STE) and serves as CompressedNMLinear: time both.
  return [layer, layer.to_compressed()] if isinstance(spec, NM) else [layer]


def bench(
    shapes: Sequence[tuple[int, int]],
    specs: Sequence[Spec],
    *,
    batch: int = 128,
    dtype: str = "float32",
    modes: Sequence[str] = ("fwd", "fwd+bwd"),
    progress: Callable[[int, int], None] | None = None,
) -> list[BenchRow]:
  """Times each pattern in ``specs`` against the dense layer, for each ``(in, out)`` shape.

  >>> import jaxsparse
  >>> from jaxsparse._bench import bench
  >>> rows = bench([(64, 64)], [jaxsparse.BlockSparse(density=0.5, block_shape=(16, 16))], batch=8, modes=("fwd",))
  >>> [(r.layer, r.pattern, sorted(r.sparse_ms)) for r in rows]
  [('BlockSparseLinear', 'block 16x16 50% kept', ['fwd'])]

  Args:
    shapes: ``(in_features, out_features)`` pairs.
    specs: ``jaxsparse.BlockSparse`` / ``NM`` / ``Unstructured`` patterns.
    batch: rows of the input (tokens).
    dtype: parameter and input dtype, e.g. ``"float32"`` or ``"bfloat16"``.
    modes: among ``"fwd"`` and ``"fwd+bwd"``.
    progress: called as ``progress(done, total)`` after each layer is timed.
  """
  batch = _utils.check_positive_int(batch, name="batch")
  bad = [m for m in modes if m not in MODES]
  if bad or not modes:
    raise ValueError(f"modes must be a non-empty subset of {tuple(MODES)}, got modes={tuple(modes)!r}.")
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"dtype must be a floating dtype such as 'float32' or 'bfloat16', got dtype={dtype.name!r}.")
  for k, n in shapes:
    _utils.check_positive_int(k, name="in_features")
    _utils.check_positive_int(n, name="out_features")
    for spec in specs:  # every pair is checked before anything is timed
      check_spec_applies(spec, (k, n), path=f"shape {k}x{n}, pattern {spec.describe()}")
  rows = []
  total = len(shapes) * (1 + len(specs))
  done = 0

  def step():
    nonlocal done
    done += 1
    if progress is not None:
      progress(done, total)

  for k, n in shapes:
    lin = nnx.Linear(k, n, param_dtype=dtype, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (batch, k), dtype)
    dense_ms = {m: time_nnx_layer(lin, x, MODES[m]) for m in modes}
    step()
    for spec in specs:
      for layer in _layers(lin, spec):
        sparse_ms = {m: time_nnx_layer(layer, x, MODES[m]) for m in modes}
        rows.append(BenchRow((k, n), type(layer).__name__, spec.describe(), dense_ms, sparse_ms))
      step()
  return rows


def tune(
    shapes: Sequence[tuple[int, int]],
    specs: Sequence[Spec],
    *,
    rows: Sequence[int] = (128,),
    dtype: str = "float32",
) -> list[tuple[tuple[int, int], str, int, int]]:
  """Measured dispatch ahead of time: tunes the forward and backward products of each sparse layer of each shape.

  For each ``(in, out)`` shape, pattern and row count, :func:`jaxsparse.autotune` traces a train step of the
  sparsified ``nnx.Linear`` (gradients of its parameters and its input) on ``(rows, in)`` inputs; products met for
  the first time are measured and cached (block-sparse products, on the GPU or CPU routes of the backend; products
  without measured dispatch record nothing).

  >>> import jaxsparse
  >>> from jaxsparse._bench import tune
  >>> rows = tune([(64, 64)], [jaxsparse.BlockSparse(density=0.5, block_shape=(16, 16))], rows=(8,))
  >>> [(shape, pattern, m) for shape, pattern, m, added, cached in rows]
  [((64, 64), 'block 16x16 50% kept', 8)]

  Args:
    shapes: ``(in_features, out_features)`` pairs.
    specs: ``jaxsparse.BlockSparse`` / ``NM`` / ``Unstructured`` patterns.
    rows: input row counts (tokens) to tune for, e.g. ``(1, 8, 4096)`` for decode and training.
    dtype: parameter and input dtype.

  Returns:
    ``[(shape, pattern, rows, decisions added to the cache, decisions of its products already in the cache)]``;
    both 0: no product of the pattern has measured dispatch on this backend (nothing to tune).
  """
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"dtype must be a floating dtype such as 'float32' or 'bfloat16', got dtype={dtype.name!r}.")
  rows = [_utils.check_positive_int(m, name="rows") for m in rows]
  for k, n in shapes:  # every pair is checked before anything is tuned (which may take long), as in bench
    _utils.check_positive_int(k, name="in_features")
    _utils.check_positive_int(n, name="out_features")
    for spec in specs:
      check_spec_applies(spec, (k, n), path=f"shape {k}x{n}, pattern {spec.describe()}")
  out = []
  for k, n in shapes:
    lin = nnx.Linear(k, n, param_dtype=dtype, rngs=nnx.Rngs(0))
    for spec in specs:
      layer, _ = sparsify(lin, {".*": spec})
      graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

      def step(p, x, graphdef=graphdef, rest=rest):
        return jax.grad(lambda p, x: nnx.merge(graphdef, p, rest)(x).sum(), argnums=(0, 1))(p, x)

      for m in rows:
        x = jax.ShapeDtypeStruct((m, k), dtype)
        known = _cache.known_keys()
        with _cache.collect_keys() as met:
          added = autotune(step, params, x)
        out.append(((k, n), spec.describe(), m, added, len(met & known)))
  return out


def bench_table(rows: Sequence[BenchRow], modes: Sequence[str]) -> str:
  """The rows as a text table: per mode dense ms, sparse ms and their ratio (below 1: sparse is faster)."""
  header = ["shape (in x out)", "layer", "pattern"]
  for m in modes:
    header += [f"{m} dense ms", f"{m} sparse ms", f"{m} ratio"]
  table = [header]
  for r in rows:
    cells = [f"{r.shape[0]}x{r.shape[1]}", r.layer, r.pattern]
    for m in modes:
      cells += [f"{r.dense_ms[m]:.3f}", f"{r.sparse_ms[m]:.3f}", f"{r.sparse_ms[m] / r.dense_ms[m]:.2f}"]
    table.append(cells)
  return _utils.text_table(table) + "\nratio: sparse time / dense time (below 1: the sparse layer is faster)."
