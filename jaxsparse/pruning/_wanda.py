"""Wanda (Sun et al., 2023) and magnitude masks for one layer: |w| times the input-feature norm.

Wanda scores weight ``w[k, j]`` of a layer ``y = x @ w`` by ``|w[k, j]| * ||X[:, k]||``, the norm of
input feature ``k`` over the calibration tokens: the error that removing it adds to output ``j``
when the features are uncorrelated. Unstructured masks compare the weights of each output (the
paper's per-output groups); the per-output counts add up exactly to the layer count of
:class:`jaxsparse.Unstructured`. N:M keeps the ``n`` best of every ``m`` inputs of an output; blocks
are ranked by the sum of their squared scores (their Frobenius norm), over the whole layer. Equal scores go to the
larger ``|w|`` (for blocks, the larger Frobenius norm of the weights), then to the lower index: the weights of an input
feature that was always zero in the calibration data all score 0 and are pruned by magnitude, not by position.

Magnitude pruning is the same with all norms equal and one threshold per layer: the masks of
:func:`jaxsparse.magnitude_mask`, :func:`jaxsparse.nm_mask` and :func:`jaxsparse.block_magnitude_mask`.

References:
  Sun, Liu, Bair & Kolter, "A Simple and Effective Pruning Approach for Large Language Models",
  ICLR 2024, https://arxiv.org/abs/2306.11695.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp

from jaxsparse import _utils
from jaxsparse.formats._specs import NM
from jaxsparse.formats._specs import BlockSparse
from jaxsparse.formats._specs import Unstructured
from jaxsparse.pruning._calibration import check_layer_spec
from jaxsparse.pruning._select import keep_largest
from jaxsparse.pruning._select import keep_largest_in_groups

__all__ = ["magnitude_layer", "wanda_layer"]


def wanda_layer(
    kernel: jax.typing.ArrayLike,
    sq_norms: jax.typing.ArrayLike,
    spec: Unstructured | NM | BlockSparse,
    *,
    per_output: bool = True,
    path: str = "kernel",
) -> jax.Array:
  """The Wanda mask of one ``(K, N)`` kernel: keeps the largest ``|w[k, j]| * ||X[:, k]||``.

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> from jaxsparse import pruning
  >>> w = jnp.ones((4, 2))
  >>> norms2 = jnp.array([1.0, 9.0, 4.0, 0.0])  # feature 1 is the largest, feature 3 always zero
  >>> pruning.wanda_layer(w, norms2, jaxsparse.NM(2, 4))[:, 0]
  Array([False,  True,  True, False], dtype=bool)

  Equal scores go to the larger ``|w|``: here features 0 and 1 never fire and feature 3's weight is 0, so all three
  score 0 and the second place goes to feature 1's weight, the largest of them, not to feature 0 by its index:

  >>> pruning.wanda_layer(jnp.array([[0.1], [0.9], [2.0], [0.0]]), jnp.array([0.0, 0.0, 1.0, 1.0]),
  ...                     jaxsparse.NM(2, 4))[:, 0]
  Array([False,  True,  True, False], dtype=bool)

  Args:
    kernel: ``(K, N)`` weights (the 2-D view of a ``LinearGeneral`` kernel).
    sq_norms: ``(K,)`` sums of squares of the input features over the calibration tokens
      (``LayerStats.sq_norms``); finite and ``>= 0``. All zero (inputs that were always zero: nothing to rank
      by) ranks the weights by ``|w|`` alone, as equal norms would, in Wanda's groups. Ties in the score go to the
      larger ``|w|`` (the magnitude criterion), then to the lower input index: so the weights of features whose
      inputs were always zero (all scoring 0) are pruned by magnitude, not by their position, in every structure
      (blocks tie-break on their ``|w|`` Frobenius norm).
    spec: ``jaxsparse.Unstructured``, ``jaxsparse.NM`` (groups along ``K``) or ``jaxsparse.BlockSparse``.
    per_output: unstructured only: compare the weights of each output (Wanda) rather than the whole
      layer.
    path: the layer's name, for error messages.

  Returns:
    Bool ``(K, N)``, True where kept; the scores rank in float32, or in float64 when ``kernel`` or ``sq_norms`` is
    float64.

  Raises:
    ValueError: on shapes that do not fit, or ``sq_norms`` with NaN/inf or negative values.
  """
  kernel = jnp.asarray(kernel)
  sq_norms = jnp.asarray(sq_norms)
  if kernel.ndim != 2:
    raise ValueError(f"{path}: kernel must be 2-D (K, N), got shape {kernel.shape}; pass kernel.reshape(K, N).")
  if sq_norms.shape != kernel.shape[:1]:
    raise ValueError(f"{path}: sq_norms must have shape (K,) = {kernel.shape[:1]}, got {sq_norms.shape}.")
  if not isinstance(sq_norms, jax.core.Tracer) and not bool(jnp.all((sq_norms >= 0) & jnp.isfinite(sq_norms))):
    # NaN scores would break the pattern (a 2:4 mask keeping 3 of 4): refuse them while the values are known.
    bad, negative = int(jnp.sum(~jnp.isfinite(sq_norms))), int(jnp.sum(sq_norms < 0))
    raise ValueError(f"{path}: sq_norms must be finite and >= 0 (sums of squares of the calibration inputs), got "
                     f"{bad} NaN/inf and {negative} negative values.")
  check_layer_spec(spec, kernel.shape, path=path)
  return _mask(kernel, sq_norms, **_static(spec, kernel.shape, per_output))


def magnitude_layer(kernel: jax.typing.ArrayLike, spec: Unstructured | NM | BlockSparse, *,
                    path: str = "kernel") -> jax.Array:
  """The magnitude mask of one ``(K, N)`` kernel, as :func:`jaxsparse.sparsify` prunes without masks.

  >>> import jax.numpy as jnp, jaxsparse
  >>> from jaxsparse import pruning
  >>> pruning.magnitude_layer(jnp.array([[0.5, -2.0], [1.0, 0.1]]), jaxsparse.Unstructured(sparsity=0.5))
  Array([[False,  True],
         [ True, False]], dtype=bool)

  Args:
    kernel: ``(K, N)`` weights (the 2-D view of a ``LinearGeneral`` kernel).
    spec: ``jaxsparse.Unstructured`` (the layer's largest ``|w|``), ``jaxsparse.NM`` (groups along ``K``) or
      ``jaxsparse.BlockSparse`` (blocks by Frobenius norm).
    path: the layer's name, for error messages.

  Returns:
    Bool ``(K, N)``, True where kept; magnitudes rank in float32, float64 ones in float64.

  Raises:
    ValueError: ``kernel`` is not 2-D; ``spec`` cannot apply to it (an ``Unstructured`` sparsity that prunes
      every weight, a ``BlockSparse`` block shape that does not divide ``(K, N)`` or density that keeps no
      block, an ``NM`` ``m`` that does not divide ``K``, a transposable ``NM``); the message names ``path``.
    TypeError: ``spec`` is not ``Unstructured``, ``NM`` or ``BlockSparse``.
  """
  kernel = jnp.asarray(kernel)
  if kernel.ndim != 2:
    raise ValueError(f"{path}: kernel must be 2-D (K, N), got shape {kernel.shape}; pass kernel.reshape(K, N).")
  check_layer_spec(spec, kernel.shape, path=path)
  return _mask(kernel, None, **_static(spec, kernel.shape, False))


def _static(spec, shape: tuple[int, int], per_output: bool) -> dict:
  k, n = shape
  if isinstance(spec, Unstructured):
    if per_output:  # pruned per output j: cumulative rounding, so the layer total is the spec's count
      edges = [int(spec.sparsity * (k * j) + 0.5) for j in range(n + 1)]
      kept = tuple(k - (b - a) for a, b in itertools.pairwise(edges))
    else:
      kept = k * n - _utils.kept_count(spec.sparsity, k * n)
    return {"kind": "unstructured", "options": (per_output, kept)}
  if isinstance(spec, NM):
    return {"kind": "nm", "options": (spec.n, spec.m)}
  (bk, bn) = spec.block_shape
  return {"kind": "block", "options": ((bk, bn), _utils.kept_count(spec.density, (k // bk) * (n // bn)))}


@functools.partial(jax.jit, static_argnames=("kind", "options"))
def _mask(kernel, sq_norms, *, kind, options):
  # float32 (bfloat16 / float16 widened), float64 when the kernel or the norms are float64
  acc = _utils.accumulation_dtype(kernel.dtype, *(() if sq_norms is None else (sq_norms.dtype,)))
  magnitudes = jnp.abs(kernel.astype(acc))
  scores, tiebreak = magnitudes, None
  if sq_norms is not None:
    sq_norms = sq_norms.astype(acc)
    # All zero (inputs always zero): no information, every score would tie at 0; rank by |w| (equal norms) instead.
    scores = magnitudes * jnp.sqrt(jnp.where(jnp.any(sq_norms > 0), sq_norms, 1))[:, None]
    # Equal scores (the weights of a feature whose inputs were always zero all score 0) go by |w|, then by index.
    tiebreak = magnitudes
  k, n = scores.shape
  if kind == "nm":
    keep_n, m = options
    groups = None if tiebreak is None else tiebreak.reshape(k // m, m, n)
    return keep_largest_in_groups(scores.reshape(k // m, m, n), keep_n, axis=1, tiebreak=groups).reshape(k, n)
  if kind == "block":
    (bk, bn), kept = options
    frobenius2 = lambda s: jnp.sum((s * s).reshape(k // bk, bk, n // bn, bn), axis=(1, 3))
    blocks = keep_largest(frobenius2(scores), kept, tiebreak=None if tiebreak is None else frobenius2(tiebreak))
    return jnp.repeat(jnp.repeat(blocks, bk, axis=0), bn, axis=1)
  per_output, kept = options
  if per_output:
    return keep_largest(scores, jnp.asarray(kept, jnp.int32), axis=0, tiebreak=tiebreak)
  return keep_largest(scores, kept, tiebreak=tiebreak)
