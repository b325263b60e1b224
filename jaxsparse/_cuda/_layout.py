"""cuSPARSELt's compressed 2:4 layout written by XLA: prune + compress without cuSPARSELt's own kernel.

cuSPARSELt documents its compressed buffer as opaque. For a bfloat16 ``(K, N)`` weight read in the
``LAYOUT_KN`` orientation, 2:4 along ``K``, on an H100 with cuSPARSELt 0.8 it is (mapped by
compressing crafted weights and reading the bytes back, 2026-11-23):

* values: the kept entries as a ``(K / 2, N)`` row-major array, row ``2 g + s`` holding the ``s``-th kept
  entry (in increasing position) of group ``g`` — exactly :attr:`jaxsparse.NMSparseMatrix.values`;
* then metadata: one 4-bit code per group, ``p0 | p1 << 2`` for kept positions ``p0 < p1``, two codes a
  byte (the first in the low nibble), ordered by a fixed permutation of the bits of ``(g, n)``: tiles of
  8 groups x 64 columns of 512 codes, tiles with the group tile varying fastest, and inside a tile the
  code index has bits (most significant first) ``n5 n4 n2 n1 n0 g1 g0 g2 n3``.

That needs ``K`` a multiple of 32 and ``N`` of 64 (smaller shapes are padded by cuSPARSELt). Because the
layout is undocumented and may change with the architecture or the library, :func:`matches` compares
:func:`compress_dense` with cuSPARSELt's own compression on the device once per process, and the ops
use this path only when they agree byte for byte.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsparse.formats import _nm_masks

__all__ = ["compress_dense", "compress_values", "decompress", "matches", "supports"]


def supports(k: int, n: int) -> bool:
  return k % 32 == 0 and n % 64 == 0


# Axes of a code's group and column digits, (gh, g2, g1, g0, nh, n5, n4, n3, n2, n1, n0), as the metadata orders
# them, most significant first: nh, gh, n5, n4, n2, n1, n0, g1, g0, g2, n3.
_CODE_ORDER = (4, 0, 5, 6, 8, 9, 10, 2, 3, 1, 7)
_CODE_ORDER_INVERSE = tuple(int(a) for a in np.argsort(_CODE_ORDER))


def _metadata(p0: jax.Array, p1: jax.Array) -> jax.Array:
  """``(G, N)`` kept positions -> the metadata bytes, ``(G * N / 2,)`` uint8."""
  g, n = p0.shape
  code = p0.astype(jnp.uint8) | (p1.astype(jnp.uint8) << 2)
  c = code.reshape(g // 8, 2, 2, 2, n // 64, 2, 2, 2, 2, 2, 2).transpose(_CODE_ORDER)
  return (c[..., 0] | (c[..., 1] << 4)).reshape(-1)


def decompress(buffer: jax.Array, k: int, n: int, dtype) -> tuple[jax.Array, jax.Array]:
  """Inverse of :func:`compress_values`: ``(values, positions)`` of a ``(k, n)`` weight's buffer.

  Args:
    buffer: ``(K N / 2 * itemsize + K N / 8,)`` uint8, as :func:`compress_values` writes it.
    k, n: the weight's shape (``k`` a multiple of 32, ``n`` of 64).
    dtype: the values' dtype.

  Returns:
    ``values`` ``(K / 2, N)`` of ``dtype`` and ``positions`` ``(K / 2, N)`` uint8 (``NMSparseMatrix.positions()``).
  """
  dtype = jnp.dtype(dtype)
  size = k // 2 * n * dtype.itemsize
  if buffer.shape != (size + k * n // 8,) or buffer.dtype != jnp.uint8:
    raise ValueError(f"a 2:4 {dtype} ({k}, {n}) weight's buffer is ({size + k * n // 8},) uint8, got "
                     f"{buffer.shape} {buffer.dtype}.")
  raw = buffer[:size].reshape(k // 2, n, dtype.itemsize)
  values = lax.bitcast_convert_type(raw if dtype.itemsize > 1 else raw[..., 0], dtype)
  meta = buffer[size:]
  nibbles = jnp.stack([meta & 0xF, meta >> 4], axis=-1)
  g = k // 4
  code = nibbles.reshape(n // 64, g // 8, *(2,) * 9).transpose(_CODE_ORDER_INVERSE).reshape(g, n)
  return values, jnp.stack([code & 3, code >> 2], axis=1).reshape(k // 2, n)


def _bytes(values: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(values, jnp.uint8).reshape(-1)


def compress_values(values: jax.Array, positions: jax.Array) -> jax.Array:
  """The buffer of a 2:4 weight given as :class:`jaxsparse.NMSparseMatrix` ``values`` and ``positions()``.

  Args:
    values: ``(K / 2, N)`` bfloat16 kept values, row ``2 g + s`` the ``s``-th kept entry of group ``g``.
    positions: ``(K / 2, N)`` their positions inside the group (increasing within a group).
  """
  pos = positions.reshape(-1, 2, positions.shape[-1])
  return jnp.concatenate([_bytes(values), _metadata(pos[:, 0], pos[:, 1])])


def compress_dense(w: jax.Array, *, dtype=None) -> jax.Array:
  """Prunes ``w`` ``(K, N)`` to 2:4 along ``K`` (:func:`jaxsparse.nm_mask`) and writes the buffer.

  The mask is computed on ``w`` as given; the kept values are then cast to ``dtype`` (default
  ``w.dtype``), as ``sr_ste(w).astype(dtype)`` does.
  """
  k, n = w.shape
  wg = w.reshape(k // 4, 4, n)
  keep = _nm_masks._group_mask(_nm_masks._scores(wg), 2)  # the mask of nm_mask(w, 2, 4, axis=0)
  lane = jnp.arange(4, dtype=jnp.int32).reshape(1, 4, 1)
  p0 = jnp.min(jnp.where(keep, lane, 4), axis=1)
  p1 = jnp.max(jnp.where(keep, lane, -1), axis=1)
  v0 = jnp.take_along_axis(wg, p0[:, None], axis=1)
  v1 = jnp.take_along_axis(wg, p1[:, None], axis=1)
  values = jnp.concatenate([v0, v1], axis=1).reshape(k // 2, n).astype(dtype or w.dtype)
  return jnp.concatenate([_bytes(values), _metadata(p0, p1)])


@functools.cache
def matches() -> bool:
  """Whether :func:`compress_dense` writes what cuSPARSELt's compression writes, on the default GPU."""
  from jaxsparse._cuda import _cusparselt as cslt  # noqa: PLC0415 (circular at import time)

  k, n = 256, 128
  with jax.ensure_compile_time_eval():
    w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32).astype(jnp.bfloat16)
    pruned = jnp.where(_nm_masks.nm_mask(w, 2, 4), w, jnp.zeros((), w.dtype))
    if cslt.compressed_bytes(n, k, jnp.bfloat16) != k * n + k * n // 8:
      return False
    ours = jax.jit(compress_dense)(w)
    theirs = jax.jit(cslt.compress)(pruned)
    return bool((ours == theirs).all())
