"""One layer's solve in calibrated pruning: its mask and pruned weights by magnitude, Wanda or SparseGPT.

:func:`solve_layer` prunes a dense layer's kernel, viewed as ``(K, N)``, on its calibration statistics and refits the
kept weights if asked; :func:`solve_table` prunes an embedding table as derived below. The driver over a whole model
(which layers, in which groups, calibrated on what) is :mod:`jaxsparse.pruning._oneshot`.

Embedding tables (``nnx.Embed`` / ``nn.Embed``), pruned when a rule names them (a rule that matches no dense layer,
as :func:`jaxsparse.sparsify` takes them; catch-all rules leave tables dense). A table ``E`` of shape
``(V, F)`` (``V`` ids, ``F`` features) serves two products:

* a lookup, ``onehot(ids) @ E``: a dense layer with kernel ``E`` whose inputs are one-hot rows. Its statistics
  are the token counts ``c`` (``sq_norms = c``, Hessian ``XᵀX = diag(c)``), and its reconstruction error is
  ``||X (E - Ê)||² = sum_v c_v ||E_v - Ê_v||²``: every weight's error is its square times its row's count, and
  no weight can make up for another (the inputs are orthogonal);
* an ``attend`` (a tied LM head, ``logits = h @ Eᵀ``): a dense layer with kernel ``Eᵀ`` ``(F, V)`` on the
  hidden states ``h``, the view :class:`jaxsparse.layers.CompressedNMEmbed` stores.

Masks are taken on the table's ``attend`` kernel ``(F, V)``: N:M groups run along the ``F`` features of one row
(what ``CompressedNMEmbed`` keeps, as :func:`magnitude_masks` prunes tables), Wanda's per-output comparison is
per row, and a ``BlockSparse`` block shape is given in table order, ``(rows, features)``.

**Lookups only** (the model never calls ``attend``). Wanda's score ``|E_vf| * sqrt(c_v)`` and SparseGPT's
saliency ``E_vf² (c_v + d)`` (``d`` its damping) scale whole rows by their count, and SparseGPT's Hessian is
diagonal, so it makes no weight update (its row ``U[k]`` is zero off the diagonal) and the refit changes nothing.
What each reduces to:

* N:M (groups within a row) and Wanda's unstructured per row: the count is a common factor of the group, so both
  methods *are* magnitude there, exactly, for every row with ``c_v > 0``. For an id the batches never saw
  (``c_v = 0``) every score would be 0 and the ties would keep the first ``n`` of each group whatever the
  weights; magnitude, the limit ``c_v -> 0+``, is used for them too.
* Comparisons spanning rows (blocks of several ids; SparseGPT's unstructured batches, which compare all rows;
  magnitude's one threshold per table): the counts would rank rows by how often the calibration text used them,
  and prune an id it never used first (score 0: a block of unseen ids, or every weight of its row, goes). A few
  hundred calibration sequences see a fraction of a large vocabulary, and an id absent from them is not absent
  when the model is used, so the counts are *not* used: blocks keep the largest Frobenius norms, SparseGPT's
  unstructured mask is one magnitude threshold over the table (the optimum of its objective
  ``sum_v ||E_v - Ê_v||²`` without counts).

So on a lookup-only table ``method="wanda"`` gives the magnitude mask compared per row (its per-output groups),
``method="sparsegpt"`` and ``method="magnitude"`` the magnitude mask of :func:`magnitude_layer` on the
``(F, V)`` view, with no weight update; the report's note on the table says so. Its error is the lookups' one,
``sqrt(sum_v c_v ||E_v - Ê_v||² / sum_v c_v ||E_v||²)``, and its tokens those of the lookups.

**Tied** (the model calls ``attend``, e.g. ``self.embed.attend(h)`` for the logits). The ``attend`` queries
``h`` are features with real statistics (Hessian ``H = hᵀh`` over the ``F`` features): the head's statistics are
the source of every ranking within a row. The one table serves both uses, so it is fitted to both, each by its
relative error: ``||h ΔW||² / ||h W||² + ||X ΔE||² / ||X E||²`` (``W = Eᵀ``). With the lookups' counts
replaced by their mean, as above, the second term is ``||ΔW||² / ||W||²``, and the sum is ``||h ΔW||²`` under the
Hessian ``H + λI`` (up to a factor), ``λ = ||h W||² / ||W||²``: the lookups act as a ridge that holds the rows
to their values. The method runs as on a dense layer ``(F, V)`` with that Hessian: Wanda scores
``|E_vf| * sqrt(||h_f||² + λ)``, SparseGPT and the refit solve with ``H + λI`` (and their own ``damp`` on
top), magnitude ignores statistics. With the head's Hessian alone, SparseGPT's updates fit the logits at the
lookups' expense: on the random 2:4 tables of ``tests/test_calibrated_embeddings.py`` they raise the lookup error
35-62% above magnitude's, with ``H + λI`` 4-6%, for a head error close to that of the head's Hessian alone. The
report's error and tokens are the head's; the note gives the lookups' error (with their real counts).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxsparse import _utils
from jaxsparse.formats._specs import NM
from jaxsparse.pruning._calibration import Layer
from jaxsparse.pruning._calibration import LayerStats
from jaxsparse.pruning._calibration import TableStats
from jaxsparse.pruning._calibration import table_spec
from jaxsparse.pruning._refit import refit_layer
from jaxsparse.pruning._sparsegpt import reconstruction_error
from jaxsparse.pruning._sparsegpt import sparsegpt_layer
from jaxsparse.pruning._wanda import magnitude_layer
from jaxsparse.pruning._wanda import wanda_layer

__all__ = ["solve_layer", "solve_table", "zero_inputs"]


def zero_inputs(stats: LayerStats | TableStats | None) -> bool:
  """Whether a layer's calibration inputs (a tied table's ``attend`` queries) were all zero: no information to rank
  its weights by (Wanda's scores and SparseGPT's saliencies would all tie at 0)."""
  if isinstance(stats, TableStats):
    stats = stats.attend
  return stats is not None and not bool(jnp.any(stats.sq_norms))


def solve_layer(method: str, layer: Layer, kernel2: jax.Array, stats: LayerStats | None, *, damp: float,
                block_size: int, refit_iterations: int) -> tuple[jax.Array, jax.Array]:
  if method == "magnitude":
    mask = magnitude_layer(kernel2, layer.spec, path=layer.path)
    new = jnp.where(mask, kernel2, jnp.zeros((), kernel2.dtype))
  elif method == "wanda":
    mask = wanda_layer(kernel2, stats.sq_norms, layer.spec, path=layer.path)
    new = jnp.where(mask, kernel2, jnp.zeros((), kernel2.dtype))
  else:
    if isinstance(layer.spec, NM):  # N:M groups must not straddle two batches; the result does not depend on it
      block_size = max(layer.spec.m, block_size - block_size % layer.spec.m)
    new, mask = sparsegpt_layer(kernel2, stats.gram, layer.spec, damp=damp, block_size=block_size, path=layer.path)
  if refit_iterations:
    new = refit_layer(kernel2, stats.gram, mask, start=new, damp=damp, iterations=refit_iterations, path=layer.path)
  return new, mask


def _lookup_error(table: jax.Array, new: jax.Array, counts: jax.Array) -> float:
  """``||X (E - Ê)|| / ||X E||`` of the one-hot lookups ``X`` with ``counts``: rows weighted by their counts."""
  acc = _utils.accumulation_dtype(table.dtype, new.dtype)
  c = counts.astype(acc)
  e = table.astype(acc)
  num = jnp.sum(c * jnp.sum((e - new.astype(acc)) ** 2, axis=1))
  den = jnp.sum(c * jnp.sum(e * e, axis=1))
  return float(jnp.where(num > 0, jnp.sqrt(num / den), 0))  # 0 / 0 (no lookups, or zero rows): 0, not NaN


def solve_table(method: str, layer: Layer, table: jax.Array, stats: TableStats | None, *, damp: float,
                block_size: int, refit_iterations: int) -> tuple[jax.Array, jax.Array, float, int, str]:
  """Prunes an embedding table ``(V, F)`` (see the module docstring): ``(table, mask, error, tokens, note)``."""
  w = table.T  # the attend kernel (F, V): inputs the features, outputs the ids
  spec = table_spec(layer.spec)
  view = dataclasses.replace(layer, spec=spec)
  head = None if stats is None else stats.attend
  if head is not None:  # tied: the head's Hessian, plus the lookups (counts replaced by their mean) as a ridge
    acc = _utils.accumulation_dtype(w.dtype, head.gram.dtype)
    wa, gram = w.astype(acc), head.gram.astype(acc)
    norm2 = jnp.sum(wa * wa)
    head2 = jnp.sum(gram * jnp.matmul(wa, wa.T, precision=jax.lax.Precision.HIGHEST))  # ||h W||²
    lam = jnp.where(norm2 > 0, head2 / jnp.where(norm2 > 0, norm2, 1), 0)
    both = LayerStats(head.sq_norms.astype(acc) + lam, gram + lam * jnp.eye(layer.k, dtype=acc), head.tokens)
    new, mask = solve_layer(method, view, w, both, damp=damp, block_size=block_size, refit_iterations=refit_iterations)
    new_table = new.T
    ranked = "a magnitude mask" if method == "magnitude" else (
        f"{method} with the LM head's (attend) statistics plus the lookups as a ridge (lambda = "
        f"{float(lam / jnp.mean(jnp.diagonal(gram))):.3g} x the mean Hessian diagonal; token counts not used)")
    note = f"tied table: {ranked}; error and tokens: the head's"
    if bool(jnp.any(stats.counts)):
      note += (f"; lookup rel. error {_lookup_error(table, new_table, stats.counts):.4f} over "
               f"{int(jnp.sum(stats.counts))} tokens")
    return new_table, mask.T, float(reconstruction_error(w, new, gram)), int(head.tokens), note
  if method == "wanda":  # per row: the count is a common factor of a row's scores
    mask = wanda_layer(w, jnp.ones((layer.k,), jnp.float32), spec, path=layer.path)
  else:
    mask = magnitude_layer(w, spec, path=layer.path)
  new_table = jnp.where(mask, w, jnp.zeros((), w.dtype)).T
  if stats is None:
    return new_table, mask.T, float("nan"), -1, ""
  if method == "magnitude":
    note = "embedding lookups (one-hot inputs); error over the lookups"
  else:
    kept = {"wanda": "compared per row", "sparsegpt": "no weight update or refit (diagonal Hessian)"}[method]
    note = (f"embedding lookups (one-hot inputs): {method} reduces to magnitude, {kept}; token counts not used "
            "(they only scale rows, and would prune unseen ids first)")
  return new_table, mask.T, _lookup_error(table, new_table, stats.counts), int(jnp.sum(stats.counts)), note
