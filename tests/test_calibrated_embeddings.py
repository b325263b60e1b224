"""Calibrated pruning of embedding tables (nnx.Embed / nn.Embed): lookup-only and tied (attend) tables.

Before, a rule naming a table raised "rule(s) [...] match no nnx.Linear ...". Each test compares against a float64
NumPy reference of what the method reduces to on a table (``jaxsparse/pruning/_oneshot_solve.py``'s module docstring):

* lookups only: the one-hot inputs make Wanda and SparseGPT magnitude pruning on the ``(F, V)`` attend view (Wanda
  compared per row, SparseGPT and magnitude over the table; blocks ``(rows, features)`` by Frobenius norm), no
  weight update, token counts unused; the error is the lookups' count-weighted one;
* tied (``attend`` called): the method on the head's Hessian ``H = hᵀh`` plus the ridge ``λI``,
  ``λ = ||h W||² / ||W||²`` (the lookups with their counts replaced by their mean).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsparse
from jaxsparse import pruning
from jaxsparse.layers import CompressedNMEmbed
from jaxsparse.pruning._calibration_tables import direct_reads
from jaxsparse.pruning._calibration_tables import table_call
from tests.test_calibrated_pruning import obs_reference

V, F, SEEN = 40, 16, 32  # ids >= SEEN never occur in the calibration batches
RULES = {"nm": jaxsparse.NM(2, 4), "un": jaxsparse.Unstructured(sparsity=0.4),
         "blk": jaxsparse.BlockSparse(density=0.5, block_shape=(4, 8)), "fc": None}


class Tables(nnx.Module):
  """Three tables (one per structure) summed, a Linear; ``tied``: logits by the tables' ``attend``."""

  def __init__(self, tied: bool, seed: int):
    rngs = nnx.Rngs(seed)
    self.tied = tied
    self.nm, self.un, self.blk = (nnx.Embed(V, F, rngs=rngs) for _ in range(3))
    self.fc = nnx.Linear(F, F, rngs=rngs)

  def hidden(self, ids):
    return jnp.tanh(self.fc(self.nm(ids) + self.un(ids) + self.blk(ids)))

  def __call__(self, ids):
    h = self.hidden(ids)
    return self.nm.attend(h) + self.un.attend(h) + self.blk.attend(h) if self.tied else h


def id_batches(seed, n=3, shape=(4, 12)):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.integers(0, SEEN, shape), jnp.int32) for _ in range(n)]


# -------------------------------------------------------------------------------------------------
# float64 NumPy references, on the attend view W = E.T (F, V): inputs the features, outputs the ids.
# -------------------------------------------------------------------------------------------------


def top(scores, kept):
  """Bool mask of the ``kept`` largest (ties: lower flat index), as jaxsparse's selection."""
  order = np.argsort(-scores.reshape(-1), kind="stable")[:kept]
  out = np.zeros(scores.size, bool)
  out[order] = True
  return out.reshape(scores.shape)


def mask_reference(scores, spec, *, per_output):
  """The mask of ``scores`` ``(F, V)`` under ``spec`` given on the table ``(V, F)``; returned as ``(V, F)``."""
  k, n = scores.shape
  if isinstance(spec, jaxsparse.NM):
    groups = scores.T.reshape(n, k // spec.m, spec.m)
    ranks = np.argsort(np.argsort(-groups, axis=2, kind="stable"), axis=2, kind="stable")
    return (ranks < spec.n).reshape(n, k)
  if isinstance(spec, jaxsparse.BlockSparse):
    bv, bf = spec.block_shape
    blocks = (scores.T**2).reshape(n // bv, bv, k // bf, bf).sum(axis=(1, 3))
    return np.kron(top(blocks, int(spec.density * blocks.size + 0.5)), np.ones((bv, bf))).astype(bool)
  if per_output:  # Wanda: per output (a table row), counts rounded cumulatively
    edges = [int(spec.sparsity * k * j + 0.5) for j in range(n + 1)]
    return np.stack([top(scores[:, j], k - (edges[j + 1] - edges[j])) for j in range(n)])
  return top(scores, scores.size - int(spec.sparsity * scores.size + 0.5)).T


def lookup_error(table, new, counts):
  d = ((table - new) ** 2).sum(axis=1)
  return np.sqrt((counts * d).sum() / (counts * (table**2).sum(axis=1)).sum())


def tables_of(model):
  return {name: np.asarray(getattr(model, name).embedding[...], np.float64) for name in ("nm", "un", "blk")}


# -------------------------------------------------------------------------------------------------
# Lookups only.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_lookup_only_tables_reduce_to_magnitude(method):
  model = Tables(tied=False, seed=11)
  batches = id_batches(12)
  pruned, masks, report = pruning.calibrated_prune(model, RULES, batches, method=method, sequential=False,
                                                   progress=False)
  counts = np.bincount(np.concatenate([np.asarray(b).reshape(-1) for b in batches]), minlength=V).astype(np.float64)
  assert counts[SEEN:].sum() == 0  # unseen ids: a count-weighted score would prune their rows first
  rows = {r.path: r for r in report.layers}
  assert sorted(masks) == ["blk.embedding", "nm.embedding", "un.embedding"]
  for name, table in tables_of(model).items():
    spec = RULES[name]
    want = mask_reference(np.abs(table.T), spec, per_output=method == "wanda")
    np.testing.assert_array_equal(masks[f"{name}.embedding"], want, err_msg=name)
    # no weight update: the kept weights are the table's
    new = np.asarray(getattr(pruned, name).embedding[...], np.float64)
    np.testing.assert_array_equal(new, np.where(want, table, 0.0))
    row = rows[name]
    assert row.shape == (F, V) and row.pattern == spec.describe() and row.tokens == counts.sum()
    np.testing.assert_allclose(row.error, lookup_error(table, new, counts), rtol=1e-5)
    assert ("reduces to magnitude" in row.note) == (method != "magnitude"), row.note
  # an id never seen keeps its largest weights (not the first 2 of every 4, as all-zero Wanda scores would)
  unseen = np.abs(tables_of(model)["nm"][SEEN:]).reshape(V - SEEN, F // 4, 4)
  kept = masks["nm.embedding"][SEEN:].reshape(V - SEEN, F // 4, 4)
  np.testing.assert_array_equal(kept, np.argsort(np.argsort(-unseen, axis=2), axis=2) < 2)
  assert "notes:" in str(report) and "nm: embedding lookups" in str(report)


def test_magnitude_without_batches_and_token_mask_counts():
  model = Tables(tied=False, seed=13)
  _, masks, report = pruning.calibrated_prune(model, RULES, None, method="magnitude", progress=False)
  table = tables_of(model)["un"]
  np.testing.assert_array_equal(masks["un.embedding"], mask_reference(np.abs(table.T), RULES["un"],
                                                                      per_output=False))
  assert all(np.isnan(r.error) and r.tokens == -1 for r in report.layers)
  # the masks of the training-time pruners for the same rules: one convention for tables
  for key, mask in pruning.masks_to_dict(pruning.magnitude_masks(model, RULES)).items():
    np.testing.assert_array_equal(masks[key], mask, err_msg=key)
  # token_mask: padding ids are left out of the counts (and so of the tokens and the error)
  batches = [{"ids": b, "mask": jnp.asarray(np.random.default_rng(15 + i).integers(0, 2, b.shape))}
             for i, b in enumerate(id_batches(14, n=2))]
  _, pruned_masks, report = pruning.calibrated_prune(model, {"un": RULES["un"]}, batches, method="wanda",
                                                     progress=False, call=lambda m, b: m(b["ids"]),
                                                     token_mask=lambda b: b["mask"])
  ids = np.concatenate([np.asarray(b["ids"])[np.asarray(b["mask"]) != 0] for b in batches])
  counts = np.bincount(ids, minlength=V).astype(np.float64)
  assert report.layers[0].tokens == len(ids)
  new = np.where(pruned_masks["un.embedding"], table, 0.0)
  np.testing.assert_allclose(report.layers[0].error, lookup_error(table, new, counts), rtol=1e-5)


# -------------------------------------------------------------------------------------------------
# Tied tables: the head's statistics with the lookups as a ridge.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_tied_tables_use_the_head_statistics_with_the_lookup_ridge(method):
  model = Tables(tied=True, seed=21)
  batches = id_batches(22)
  pruned, masks, report = pruning.calibrated_prune(model, RULES, batches, method=method, sequential=False,
                                                   refit_iterations=0, progress=False)
  h = np.concatenate([np.asarray(model.hidden(b), np.float64).reshape(-1, F) for b in batches])
  gram = h.T @ h
  counts = np.bincount(np.concatenate([np.asarray(b).reshape(-1) for b in batches]), minlength=V).astype(np.float64)
  rows = {r.path: r for r in report.layers}
  for name, table in tables_of(model).items():
    w = table.T
    lam = np.sum(gram * (w @ w.T)) / np.sum(w * w)
    both = gram + lam * np.eye(F)
    spec = RULES[name]
    if method == "sparsegpt":
      t_spec = spec if not isinstance(spec, jaxsparse.BlockSparse) else jaxsparse.BlockSparse(0.5, (8, 4))
      ref_w, ref_mask = obs_reference(w, both, t_spec, damp=0.01)
      want, want_table = ref_mask.T, ref_w.T
    else:
      scores = np.abs(w) if method == "magnitude" else np.abs(w) * np.sqrt(np.diag(both))[:, None]
      want = mask_reference(scores, spec, per_output=method == "wanda")
      want_table = np.where(want, table, 0.0)
    np.testing.assert_array_equal(masks[f"{name}.embedding"], want, err_msg=name)
    new = np.asarray(getattr(pruned, name).embedding[...], np.float64)
    np.testing.assert_allclose(new, want_table, atol=2e-4 * np.abs(want_table).max())
    row = rows[name]
    assert row.tokens == h.shape[0] and row.note.startswith("tied table")
    d = (w - new.T)
    np.testing.assert_allclose(row.error, np.sqrt(np.sum(d * (gram @ d)) / np.sum(w * (gram @ w))), rtol=1e-3)
    assert f"lookup rel. error {lookup_error(table, new, counts):.4f}" in row.note, row.note


def test_tied_sparsegpt_keeps_the_lookups_near_magnitude():
  # The ridge keeps SparseGPT's head-fitted updates from degrading the lookups: the lookup error stays near plain
  # masking's while the head's error drops below magnitude's; SparseGPT on the head's Hessian alone raises it by a
  # third or more (seeds 1-4 and 31: by 35-62%, with the ridge by 4-6%).
  model = Tables(tied=True, seed=31)
  batches = id_batches(32)
  rules = {"nm": jaxsparse.NM(2, 4), "un|blk|fc": None}
  reports = {method: pruning.calibrated_prune(model, rules, batches, method=method, refit_iterations=0,
                                              progress=False)[2].layers[0] for method in ("magnitude", "sparsegpt")}

  def lookup(note):
    return float(note.split("lookup rel. error ")[1].split()[0])

  assert reports["sparsegpt"].error < reports["magnitude"].error
  assert lookup(reports["sparsegpt"].note) < 1.15 * lookup(reports["magnitude"].note)
  h = np.concatenate([np.asarray(model.hidden(b), np.float64).reshape(-1, F) for b in batches])
  table = tables_of(model)["nm"]
  head_only = np.asarray(pruning.sparsegpt_layer(table.T, h.T @ h, jaxsparse.NM(2, 4)).kernel, np.float64).T
  counts = np.bincount(np.concatenate([np.asarray(b).reshape(-1) for b in batches]), minlength=V)
  assert lookup_error(table, head_only, counts) > 1.25 * lookup(reports["magnitude"].note)


# -------------------------------------------------------------------------------------------------
# Sequential mode, Linen, rules and to_sparse.
# -------------------------------------------------------------------------------------------------


class LM(nnx.Module):
  def __init__(self, seed):
    rngs = nnx.Rngs(seed)
    self.embed = nnx.Embed(V, F, rngs=rngs)
    self.fc1 = nnx.Linear(F, 2 * F, rngs=rngs)
    self.fc2 = nnx.Linear(2 * F, F, rngs=rngs)

  def __call__(self, ids):
    return self.embed.attend(self.fc2(jax.nn.relu(self.fc1(self.embed(ids)))))


def wanda_tied_reference(table, h, spec):
  """Wanda's mask of a tied table ``(V, F)`` with head inputs ``h`` ``(T, F)``: ``|W| * sqrt(diag(hᵀh) + λ)``."""
  w, gram = table.T, h.T @ h
  lam = np.sum(gram * (w @ w.T)) / np.sum(w * w)
  return mask_reference(np.abs(w) * np.sqrt(np.diag(gram) + lam)[:, None], spec, per_output=True)


def wanda_nm_reference(kernel, x):
  scores = np.abs(kernel) * np.sqrt((x * x).sum(0))[:, None]
  k, n = kernel.shape
  ranks = np.argsort(np.argsort(-scores.reshape(k // 4, 4, n), axis=1, kind="stable"), axis=1, kind="stable")
  return (ranks < 2).reshape(k, n)


def test_sequential_prunes_a_tied_table_last_on_the_pruned_model():
  # Was: a tied table was pruned in the group of its first call (the lookup), first, so its head (attend) statistics
  # came from the dense model while every other layer's came from the model with the earlier groups pruned. It is
  # pruned at its last call (the head), on the outputs of the pruned fc1 and fc2; they calibrate on the dense lookups.
  model = LM(41)
  batches = id_batches(42)
  spec = jaxsparse.NM(2, 4)
  rules = {"embed": spec, "fc1": spec, "fc2": spec}
  pruned, masks, report = pruning.calibrated_prune(model, rules, batches, method="wanda", progress=False)
  assert [(r.path, r.group) for r in report.layers] == [("fc1", 0), ("fc2", 1), ("embed", 2)]
  f64 = lambda a: np.asarray(a, np.float64)
  lookups = np.concatenate([f64(model.embed(b)).reshape(-1, F) for b in batches])  # the table still dense
  np.testing.assert_array_equal(masks["fc1.kernel"], wanda_nm_reference(f64(model.fc1.kernel[...]), lookups))
  x2 = np.concatenate([f64(jax.nn.relu(pruned.fc1(model.embed(b)))).reshape(-1, 2 * F) for b in batches])
  np.testing.assert_array_equal(masks["fc2.kernel"], wanda_nm_reference(f64(model.fc2.kernel[...]), x2))
  table = f64(model.embed.embedding[...])
  h = np.concatenate([f64(pruned.fc2(jax.nn.relu(pruned.fc1(model.embed(b))))).reshape(-1, F) for b in batches])
  want = wanda_tied_reference(table, h, spec)
  np.testing.assert_array_equal(masks["embed.embedding"], want)
  h_dense = np.concatenate([f64(model.fc2(jax.nn.relu(model.fc1(model.embed(b))))).reshape(-1, F) for b in batches])
  assert not np.array_equal(wanda_tied_reference(table, h_dense, spec), want)  # the dense model's head would differ
  assert report.layers[-1].tokens == h.shape[0] and report.layers[-1].note.startswith("tied table")
  # A lookup-only table is still pruned at its first call: fc1 calibrates on its pruned lookups.
  untied = LM(43)
  _, masks, report = pruning.calibrated_prune(untied, {"embed": spec, "fc1": spec}, batches, method="wanda",
                                              call=lambda m, ids: m.fc1(m.embed(ids)), progress=False)
  assert [(r.path, r.group) for r in report.layers] == [("embed", 0), ("fc1", 1)]
  table = np.where(masks["embed.embedding"], f64(untied.embed.embedding[...]), 0.0)
  x = np.concatenate([table[np.asarray(b)].reshape(-1, F) for b in batches])
  np.testing.assert_array_equal(masks["fc1.kernel"], wanda_nm_reference(f64(untied.fc1.kernel[...]), x))


class LinenLM(nn.Module):
  @nn.compact
  def __call__(self, ids):
    embed, other = nn.Embed(V, F, name="embed"), nn.Embed(V, F, name="other")
    h = jnp.tanh(nn.Dense(F, name="fc")(embed(ids) + other(ids)))
    return embed.attend(h)  # embed tied, other looked up only


class NNXTwin(nnx.Module):
  def __init__(self, params):
    rngs = nnx.Rngs(0)
    self.embed, self.other = nnx.Embed(V, F, rngs=rngs), nnx.Embed(V, F, rngs=rngs)
    self.fc = nnx.Linear(F, F, rngs=rngs)
    self.embed.embedding[...] = params["embed"]["embedding"]
    self.other.embedding[...] = params["other"]["embedding"]
    self.fc.kernel[...], self.fc.bias[...] = params["fc"]["kernel"], params["fc"]["bias"]

  def __call__(self, ids):
    return self.embed.attend(jnp.tanh(self.fc(self.embed(ids) + self.other(ids))))


@pytest.mark.parametrize("method", ["wanda", pytest.param("sparsegpt", marks=pytest.mark.slow)])
def test_linen_tables_as_nnx(method):
  batches = id_batches(51, n=2)
  module = LinenLM()
  variables = module.init(jax.random.key(52), batches[0])
  rules = {"embed": jaxsparse.NM(2, 4), "other": jaxsparse.Unstructured(sparsity=0.5)}
  new_vars, masks, report = pruning.calibrated_prune_linen(module, variables, rules, batches, method=method,
                                                           progress=False)
  _, nnx_masks, nnx_report = pruning.calibrated_prune(NNXTwin(variables["params"]), rules, batches, method=method,
                                                      progress=False)
  # sequential, in both: the lookup-only table at its first call, the tied one at its last (the head)
  assert [(r.path, r.group) for r in report.layers] == [(r.path, r.group) for r in nnx_report.layers] == [
      ("other", 0), ("embed", 1)]
  assert sorted(masks) == sorted(nnx_masks) == ["embed.embedding", "other.embedding"]
  for key in masks:
    np.testing.assert_array_equal(masks[key], nnx_masks[key])
  assert [r.note.split(":")[0] for r in report.layers] == ["embedding lookups (one-hot inputs)", "tied table"]
  np.testing.assert_allclose([r.error for r in report.layers], [r.error for r in nnx_report.layers], rtol=1e-4)
  # the pruned table is the mask's, and sparsify_linen stores the N:M one compressed
  assert np.array_equal(np.asarray(new_vars["params"]["embed"]["embedding"]) != 0, masks["embed.embedding"])
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(module, new_vars, {"embed": jaxsparse.NM(2, 4)}, batches[0],
                                                    masks={"embed.embedding": masks["embed.embedding"]})
  np.testing.assert_allclose(sparse.apply(sparse_vars, batches[1]), module.apply(new_vars, batches[1]), atol=1e-5)


def test_catch_all_rules_leave_tables_dense_as_sparsify():
  model = LM(61)
  for rules in (jaxsparse.NM(2, 4), {".*": jaxsparse.NM(2, 4)}):
    _, masks, _ = pruning.calibrated_prune(model, rules, None, method="magnitude", progress=False)
    assert sorted(masks) == ["fc1.kernel", "fc2.kernel"]


def test_to_sparse_stores_an_nm_table_compressed():
  model = LM(71)
  batches = id_batches(72, n=2)
  rules = {"embed": jaxsparse.NM(2, 4)}
  dense, _, _ = pruning.calibrated_prune(model, rules, None, method="magnitude", progress=False)
  sparse, _, _ = pruning.calibrated_prune(model, rules, None, method="magnitude", to_sparse=True, progress=False)
  assert isinstance(sparse.embed, CompressedNMEmbed)
  np.testing.assert_allclose(sparse(batches[0]), dense(batches[0]), atol=1e-5)
  with pytest.raises(ValueError, match=r"embed: to_sparse=True, but sparsify stores an embedding table only N:M"):
    pruning.calibrated_prune(model, {"embed": jaxsparse.Unstructured(sparsity=0.5)}, batches, to_sparse=True,
                             progress=False)


def test_table_rules_that_cannot_apply_raise():
  model = LM(81)
  with pytest.raises(ValueError, match=r"embed: N:M sparsity 2:3 needs m=3 to divide the features 16"):
    pruning.calibrated_prune(model, {"embed": jaxsparse.NM(2, 3)}, None, method="magnitude", progress=False)
  with pytest.raises(ValueError, match=r"embed: block_shape=\(3, 8\) \(rows, features\) does not divide its \(40, "):
    pruning.calibrated_prune(model, {"embed": jaxsparse.BlockSparse(0.5, (3, 8))}, None, method="magnitude",
                             progress=False)
  sparse, _ = jaxsparse.sparsify(model, {"embed": jaxsparse.NM(2, 4)})
  with pytest.raises(ValueError, match=r"embed: a CompressedNMEmbed is already N:M-compressed"):
    pruning.calibrated_prune(sparse, {"embed": jaxsparse.NM(2, 4)}, None, method="magnitude", progress=False)


# -------------------------------------------------------------------------------------------------
# calibrate / calibrate_linen: the tables' statistics; a table the model reads directly.
# -------------------------------------------------------------------------------------------------


def test_calibrate_returns_the_table_statistics_the_pruning_uses():
  # Was: calibrate / calibrate_linen refused a rule naming a table ("rule(s) ['nm'] match no nnx.Linear ...").
  batches = id_batches(92)
  ids = np.concatenate([np.asarray(b).reshape(-1) for b in batches])
  counts = np.bincount(ids, minlength=V)
  model = Tables(tied=True, seed=91)
  stats = pruning.calibrate(model, batches, RULES)
  assert sorted(stats) == ["blk", "nm", "un"] and all(type(s).__name__ == "TableStats" for s in stats.values())
  for s in stats.values():
    np.testing.assert_array_equal(s.counts, counts)
    assert s.counts.dtype == jnp.int32
  h = np.concatenate([np.asarray(model.hidden(b), np.float64).reshape(-1, F) for b in batches])
  head = stats["nm"].attend
  np.testing.assert_allclose(head.gram, h.T @ h, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(head.sq_norms, (h * h).sum(0), rtol=1e-5)
  assert int(head.tokens) == h.shape[0]
  # the statistics calibrated_prune uses (sequential=False): Wanda on the head's norms plus the lookups' ridge
  rules = {"nm": jaxsparse.NM(2, 4), "un|blk|fc": None}
  _, masks, _ = pruning.calibrated_prune(model, rules, batches, method="wanda", sequential=False, progress=False)
  w = model.nm.embedding[...].T
  lam = jnp.sum(head.gram * (w @ w.T)) / jnp.sum(w * w)
  np.testing.assert_array_equal(pruning.wanda_layer(w, head.sq_norms + lam, rules["nm"]).T, masks["nm.embedding"])
  # Linen: a tied table ("embed") and a lookup-only one ("other", no attend statistics), against NumPy
  module = LinenLM()
  variables = module.init(jax.random.key(93), batches[0])
  got = pruning.calibrate_linen(module, variables, batches, {"embed": jaxsparse.NM(2, 4), "other": jaxsparse.NM(2, 4)})
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), variables["params"])
  h = np.tanh((p["embed"]["embedding"][ids] + p["other"]["embedding"][ids]) @ p["fc"]["kernel"] + p["fc"]["bias"])
  assert sorted(got) == ["embed", "other"] and got["other"].attend is None
  for name in got:
    np.testing.assert_array_equal(got[name].counts, counts)
  np.testing.assert_allclose(got["embed"].attend.gram, h.T @ h, rtol=1e-5, atol=1e-4)


class DirectHead(nnx.Module):
  """A tied LM whose logits read the table's array (``how``: ``"matmul"``, ``"jit"``), or call ``attend``
  (``"attend"``, reading only the table's shape besides)."""

  def __init__(self, how, seed=0):
    rngs = nnx.Rngs(seed)
    self.how = how
    self.embed = nnx.Embed(V, F, rngs=rngs)
    self.fc = nnx.Linear(F, F, rngs=rngs)

  def __call__(self, ids):
    h = jnp.tanh(self.fc(self.embed(ids)))
    table = self.embed.embedding
    if self.how == "matmul":
      return h @ table[...].T
    if self.how == "jit":
      return jax.jit(lambda e, h: h @ e.T)(table[...], h)
    return self.embed.attend(h) / table.shape[0]


class LinenDirectHead(nn.Module):
  def setup(self):
    self.embed = nn.Embed(V, F)
    self.fc = nn.Dense(F)

  def __call__(self, ids):
    return jnp.tanh(self.fc(self.embed(ids))) @ self.embed.embedding.T


def test_a_table_the_model_reads_directly_is_refused():
  # Was: a head computed from the table's array (not attend) was missed: the tied table was taken for lookups only
  # and pruned by magnitude without a word; calibrate refused table rules.
  batches = id_batches(94, n=1)
  rules = {"embed": jaxsparse.NM(2, 4), "fc": jaxsparse.NM(2, 4)}
  refused = r"embed: the model reads this embedding table's array directly .*Compute the logits with embed\.attend\(h\)"
  for how in ("matmul", "jit"):
    model = DirectHead(how)
    with pytest.raises(ValueError, match=refused):
      pruning.calibrated_prune(model, rules, batches, method="wanda", progress=False)
    with pytest.raises(ValueError, match=refused):
      pruning.calibrate(model, batches, rules)
  assert sorted(pruning.calibrate(DirectHead("matmul"), batches, {"fc": rules["fc"]})) == ["fc"]  # table not named
  assert pruning.calibrate(DirectHead("attend"), batches, rules)["embed"].attend is not None  # reads its shape only
  module = LinenDirectHead()
  variables = module.init(jax.random.key(95), batches[0])
  with pytest.raises(ValueError, match=refused + r".*exclude it with a None rule"):
    pruning.calibrate_linen(module, variables, batches, rules)
  with pytest.raises(ValueError, match=refused):
    pruning.calibrated_prune_linen(module, variables, rules, batches, method="wanda", progress=False)
  # the reads are followed into loops, branches and remat: only the table's own calls (in their scope) are not reads
  legit = lambda e, h: table_call(lambda: h @ e.T)
  cases = {
      lambda e, h: jax.checkpoint(legit)(e, h): False,
      lambda e, h: jax.lax.scan(lambda c, _: (c, legit(e, h)), 0.0, None, length=2)[1]: False,
      lambda e, h: jax.jit(lambda e, h: h * e.shape[0])(e, h): False,  # passed in, never read
      lambda e, h: jax.lax.scan(lambda c, _: (c, h @ e.T), 0.0, None, length=2)[1]: True,
      lambda e, h: jax.lax.cond(h.sum() > 0, lambda: h @ e.T, lambda: legit(e, h)): True,
      lambda e, h: jax.lax.while_loop(lambda c: c[0] < e.sum(), lambda c: (c[0] + 1, c[1]), (0.0, h))[1]: True,
  }
  for i, (fn, read) in enumerate(cases.items()):
    jaxpr = jax.make_jaxpr(fn)(jnp.ones((V, F)), jnp.ones((3, F)))
    assert direct_reads(jaxpr, {0: "embed"}) == ({"embed"} if read else set()), i
