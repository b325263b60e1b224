"""What :func:`jaxsparse.sparsify` / :func:`jaxsparse.sparsify_linen` report: per layer bytes, density and
(optionally) measured speed against the dense layer."""


from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsparse._tuning._measure import default_platform
from jaxsparse._tuning._measure import time_call_ms

__all__ = [
    "LayerChange",
    "SparsifyReport",
    "check_speed_mode",
    "nbytes",
    "random_input",
    "state_bytes",
    "time_nnx_layer",
    "timed",
    "unsupported_change",
]


@dataclasses.dataclass(frozen=True)
class LayerChange:
  """What :func:`sparsify` did to one layer.

  Attributes:
    path: dotted path of the layer (``"blocks.0.mlp.fc1"``).
    layer: the dense layer, e.g. ``"Linear(256->1024)"``.
    kind: the rule's structure, e.g. ``"block 64x64 25% kept"``, ``"2:4"``, ``"unstructured 90%"``.
    replaced_by: class name of the new layer, or ``None`` when the layer stayed dense.
    density: fraction of the kernel's weights the new layer keeps (1.0 when it stayed dense); ``None`` when unknown:
      sparsified under a trace (``nnx.eval_shape``, ``jax.eval_shape``), a mask ranked from traced weights (or an
      N:M conv's traced weight mask) has no values to count. A mask given, or ranked from concrete weights, is
      counted there too.
    bytes_before: bytes of the dense layer's state (kernel, bias).
    bytes_after: bytes of the new layer's state (parameters and sparsity pattern).
    dense_ms, sparse_ms: measured times with ``check_speed`` (forward, or forward+backward), else ``None``.
    note: why a layer stayed dense, or other remarks.
  """

  path: str
  layer: str
  kind: str
  replaced_by: str | None
  density: float | None
  bytes_before: int
  bytes_after: int
  dense_ms: float | None = None
  sparse_ms: float | None = None
  note: str = ""


@dataclasses.dataclass(frozen=True)
class SparsifyReport:
  """The layers :func:`sparsify` changed or timed, sorted by path; ``str(report)`` is a Markdown table."""

  layers: tuple[LayerChange, ...]

  @property
  def replaced(self) -> tuple[LayerChange, ...]:
    return tuple(c for c in self.layers if c.replaced_by is not None)

  @property
  def bytes_before(self) -> int:
    return sum(c.bytes_before for c in self.layers)

  @property
  def bytes_after(self) -> int:
    return sum(c.bytes_after for c in self.layers)

  def __str__(self) -> str:
    rows = [
        "| path | layer | rule | now | density | bytes before | bytes after | dense ms | sparse ms | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in self.layers:
      dense_ms = "" if c.dense_ms is None else f"{c.dense_ms:.3f}"
      sparse_ms = "" if c.sparse_ms is None else f"{c.sparse_ms:.3f}"
      density = "?" if c.density is None else f"{c.density:.3f}"  # unknown, as in jaxsparse.summary
      rows.append(
          f"| {c.path} | {c.layer} | {c.kind} | {c.replaced_by or 'dense'} | {density} | {c.bytes_before} "
          f"| {c.bytes_after} | {dense_ms} | {sparse_ms} | {c.note} |"
      )
    rows.append(f"\n{len(self.replaced)} of {len(self.layers)} layers sparse; layer bytes "
                f"{self.bytes_before} -> {self.bytes_after}.")
    return "\n".join(rows)


def unsupported_change(path: str, layer: str, spec: Any, size: int, *, takes: str) -> LayerChange:
  """The report row of a layer holding a kernel that a rule gives ``spec`` but sparsify does not take (an
  ``Einsum``, a ``ConvTranspose``, a module's own ``kernel`` param): it stays dense, and the row says so.

  Args:
    path: the layer's dotted path.
    layer: what it is, e.g. ``"Einsum((32, 16))"``.
    spec: the structure the rule gives it.
    size: bytes of its state (kept: it stays dense).
    takes: the layer types sparsify does take, for the note.
  """
  return LayerChange(path, layer, spec.describe(), None, 1.0, size, size,
                     note=f"left dense: sparsify does not take this layer (it takes {takes})")


def nbytes(tree: Any) -> int:
  return int(sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in jax.tree.leaves(tree)))


def state_bytes(layer: nnx.Module) -> int:
  return nbytes(nnx.state(layer))


def timed(apply: Callable[[Any, Any, jax.Array], jax.Array], params: Any, x: jax.Array, mode: str,
          rest: Any = None) -> float:
  """Milliseconds of one call of ``apply(params, rest, x)`` (``mode="forward"``) or of its gradient with respect to
  ``params`` and ``x`` (``"train"``), timed as measured dispatch times its candidates
  (:func:`jaxsparse._tuning._measure.time_call_ms`: device time on a GPU, over copies of operands that would stay in
  the L2 cache; else wall time).

  ``rest`` holds every other array the call reads (a layer's positions, its cuSPARSELt buffer or copy): they are
  arguments, copied with the parameters, never constants of the call. A constant is one buffer that every timed call
  reads from the L2 cache: a 2:4 layer kept as cuSPARSELt's buffer timed 8.4 µs that way at 1 x 4096 x 6144 on an
  H100, against 13.1-13.3 µs with copies and in a chain of layers
  (``benchmarks/results/llm_decode_2026-11-28_h100_routing.md``)."""
  if mode == "forward":
    f = apply
  else:
    f = jax.grad(lambda p, r, x: jnp.sum(apply(p, r, x).astype(jnp.float32)), argnums=(0, 2))
  return time_call_ms(f, (params, rest, x), default_platform())


def time_nnx_layer(layer: nnx.Module, x: jax.Array, mode: str) -> float:
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  return timed(lambda p, r, x: nnx.merge(graphdef, p, r)(x), params, x, mode, rest)


def check_speed_mode(check_speed: object, example_input: Any, *, abstract: str | None = None) -> str | None:
  """The timing mode of ``check_speed`` (``None``: no timing); ``abstract``: what makes the weights abstract, if they
  are (nothing to time then)."""
  if check_speed is False or check_speed is None:
    return None
  mode = "train" if check_speed is True else check_speed
  if mode not in ("train", "forward"):
    raise ValueError(f"check_speed must be False, True, 'train' or 'forward', got check_speed={check_speed!r}.")
  if example_input is None:
    raise ValueError("check_speed needs example_input: the input the model is timed on.")
  if abstract:
    raise ValueError(
        f"check_speed={check_speed!r} times each layer on its weights, and {abstract}: no weights. Leave check_speed "
        "out here; to match a model sparsified with check_speed, map the layers it kept dense to None in the rules."
    )
  return mode


def random_input(spec: jax.ShapeDtypeStruct) -> jax.Array:
  dtype = spec.dtype if jnp.issubdtype(spec.dtype, jnp.floating) else jnp.float32
  return jax.random.normal(jax.random.key(0), spec.shape, dtype)
