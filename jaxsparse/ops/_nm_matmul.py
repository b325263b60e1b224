"""``nm_matmul``: ``x @ W`` for a compressed N:M-sparse ``W``, differentiable in ``x`` and the kept values.

Two backends for the forward product:

* XLA: expand ``W`` to dense (one fused pass over the compressed bytes) and run a dense ``dot``.
  This is the reference, the CPU path, and on a GPU the faster choice for many rows, where the
  product is bound by arithmetic and the dense tensor-core ``dot`` wins.
* Pallas (CUDA GPUs, few rows): :mod:`jaxsparse.pallas._nm_matmul` reads the compressed weight
  (56% of the dense bytes for 2:4 bf16) and expands it on chip. The expansion, not memory, limits
  it: 0.79-1.0x the dense time at M = 16 on an H100, 3-4x faster than expanding in XLA first
  (``benchmarks/results/gpu_nm_2026-11-21.md``).

The backward pass (both backends) is ``dX = dY @ Wᵀ`` and ``dvalues = (xᵀ dY)`` sampled at the
kept positions, both through XLA.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from jaxsparse import _utils
from jaxsparse.formats._nm import NMSparseMatrix
from jaxsparse.ops import _dispatch
from jaxsparse.ops import _sharding

__all__ = ["nm_matmul", "nm_matmul_reference"]

Implementation = Literal["xla", "pallas"]
_IMPLEMENTATIONS = (None, "xla", "pallas")


def nm_matmul_reference(
    x: jax.typing.ArrayLike,
    w: NMSparseMatrix,
    *,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
) -> jax.Array:
  """Dense oracle and XLA path: ``x @ w.to_dense()``.

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> w = jaxsparse.NMSparseMatrix.from_dense(jnp.arange(8.0).reshape(4, 2), 2, 4)
  >>> jaxsparse.ops.nm_matmul_reference(jnp.ones((1, 4)), w)
  Array([[10., 12.]], dtype=float32)
  """
  return _utils.dense_reference(x, w, precision=precision, preferred_element_type=preferred_element_type)


def _pallas_ops():
  """The Pallas kernel module, or ``None`` when it cannot be imported here."""
  return _dispatch.import_kernels("_nm_matmul")


_Config = _dispatch.Config


def _xla_forward(cfg: _Config, x2, w):
  return nm_matmul_reference(x2, w, precision=cfg.precision).astype(cfg.out_dtype)


def _local_forward(cfg: _Config, x2: jax.Array, w: NMSparseMatrix) -> tuple[jax.Array]:
  kernels = _pallas_ops()
  xla_fn = functools.partial(_xla_forward, cfg)
  pallas_fn = lambda a, b: kernels.forward(a, b, precision=cfg.precision).astype(cfg.out_dtype)
  preferred = None if kernels is None else kernels.preferred
  return (_dispatch.dispatch("nm_matmul", cfg, kernels, xla_fn, pallas_fn, x2, w, preferred=preferred),)


def _forward(cfg: _Config, x: jax.Array, w: NMSparseMatrix) -> jax.Array:
  # Data parallel: each device multiplies its rows of x (ops/_sharding.py).
  return _sharding.row_parallel(functools.partial(_local_forward, cfg), (x,), w)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _nm_matmul(cfg: _Config, x: jax.Array, w: NMSparseMatrix) -> jax.Array:
  return _forward(cfg, x, w)


def _nm_matmul_fwd(cfg, x, w):
  return _forward(cfg, x, w), (x, w)


def _local_backward(cfg: _Config, x2, dy2, w):
  acc = jnp.promote_types(jnp.result_type(x2.dtype, dy2.dtype, w.dtype), jnp.float32)
  wd = w.to_dense()
  dx = lax.dot_general(dy2, wd, (((1,), (1,)), ((), ())), precision=cfg.precision, preferred_element_type=acc)
  dw = lax.dot_general(x2, dy2, (((0,), (0,)), ((), ())), precision=cfg.precision, preferred_element_type=acc)
  # The gradient of the kept values is dW at the kept positions: the VJP of w.to_dense().
  _, to_dense_vjp = jax.vjp(lambda v: w.with_values(v).to_dense(), w.values)
  (dvalues,) = to_dense_vjp(dw.astype(w.dtype))
  return dx.astype(x2.dtype), dvalues


def _nm_matmul_bwd(cfg, res, dy):
  x, w = res
  # Data parallel: dX keeps the rows' sharding, dvalues is summed over the row shards.
  local = functools.partial(_local_backward, cfg)
  dx, dvalues = _sharding.row_parallel(local, (x, dy), w, summed=(1,), like={0: x, 1: w.values})
  dw_tree = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(w), [dvalues, None])
  return dx, dw_tree


_nm_matmul.defvjp(_nm_matmul_fwd, _nm_matmul_bwd)


def _check_implementation(implementation) -> str:
  kernels = _pallas_ops() if implementation == "pallas" else None
  return _dispatch.check_implementation(implementation, _IMPLEMENTATIONS, kernels)


def nm_matmul(
    x: jax.typing.ArrayLike,
    w: NMSparseMatrix,
    *,
    implementation: Implementation | None = None,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
) -> jax.Array:
  """Computes ``x @ w`` for an N:M-sparse ``w`` stored compressed.

  Equal to ``x @ w.to_dense()``. Differentiable with respect to ``x`` and ``w.values`` (the
  positions are integers and get no gradient); works under ``jit``, ``vmap`` and ``grad``.

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(jax.random.key(0), (64, 32)), 2, 4)
  >>> x = jnp.ones((2, 3, 64))
  >>> y = jaxsparse.ops.nm_matmul(x, w)
  >>> y.shape, bool(jnp.allclose(y, x @ w.to_dense(), atol=1e-5))
  ((2, 3, 32), True)

  Args:
    x: ``(..., K)`` activations.
    w: a 2-D :class:`jaxsparse.NMSparseMatrix` of shape ``(K, N)``; groups along ``K`` (axis 0)
      for the GPU kernel, either axis on the XLA path.
    implementation: ``None`` picks at lowering time: the Pallas kernel on CUDA GPUs for few rows
      (``M <= 64``) when it supports the operands, the XLA path otherwise; ``"xla"`` or
      ``"pallas"`` force one, and a forced backend that cannot run raises.
    precision: passed to the products.
    preferred_element_type: output dtype; defaults to ``result_type(x, w.values)``. Products
      accumulate in at least float32.

  Returns:
    ``(..., N)`` array.
  """
  if not isinstance(w, NMSparseMatrix):
    raise TypeError(f"w must be a jaxsparse.NMSparseMatrix, got {type(w).__name__}.")
  if w.ndim != 2:
    raise ValueError(f"w must be a 2-D (K, N) NMSparseMatrix, got shape {w.shape}.")
  x = _utils.check_activations(x, w.shape[0])
  impl = _check_implementation(implementation)
  out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(x.dtype, w.dtype))
  cfg = _Config(impl, precision, out_dtype)
  return _nm_matmul(cfg, x, w)
