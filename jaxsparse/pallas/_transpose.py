"""A 2-D transpose at memory bandwidth, for the TF32 kernels that read their operands K-major only.

TF32 wgmma reads both operands with the reduction dimension contiguous, so the float32 sampled
``dW = xᵀ dY`` kernel (:mod:`jaxsparse.pallas._block_sparse_sdd_mgpu`) needs ``xᵀ`` and ``dYᵀ`` in
memory. Inside a training step XLA's transposes of these activations measured about 0.6 TB/s on an
H100 (8.4 ms of an 18 ms float32 step, ``benchmarks/results/gpu_train_step_2026-11-23_h100.md``).
This Triton kernel is a plain tiled transpose: each program loads one ``(tile, tile)`` tile, which
Triton transposes through shared memory, and stores it at the mirrored place.
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxsparse import _utils
from jaxsparse.pallas import _common

__all__ = ["transpose"]

_TILE = 64
_NUM_WARPS = 4


def _kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...].T


def transpose(x: jax.Array, *, interpret: bool = False) -> jax.Array:
  """``x.T`` of a 2-D ``(M, K)`` array, as ``(K, M)``, by the tiled Triton kernel where it applies.

  The kernel runs when a CUDA GPU is present (or ``interpret``) and both dimensions are multiples of
  64; otherwise this is XLA's ``x.T``. The result is exactly ``x.T`` either way.

  Args:
    x: ``(M, K)`` array of any dtype.
    interpret: run the kernel in Pallas interpret mode (any backend, slow; for tests).

  Returns:
    The ``(K, M)`` transpose of ``x``.
  """
  if x.ndim != 2:
    raise ValueError(f"x must be 2-D, got shape {x.shape}.")
  m, k = x.shape
  if m % _TILE or k % _TILE or not (interpret or _common.available()):
    return x.T
  return pl.pallas_call(
      _kernel,
      grid=(m // _TILE, k // _TILE),
      in_specs=[pl.BlockSpec((_TILE, _TILE), lambda i, j: (i, j))],
      out_specs=pl.BlockSpec((_TILE, _TILE), lambda i, j: (j, i)),
      out_shape=_utils.result_struct((k, m), x.dtype, x),
      compiler_params=pltriton.CompilerParams(num_warps=_NUM_WARPS, num_stages=1),
      interpret=interpret,
      name="jaxsparse_transpose",
  )(x)
