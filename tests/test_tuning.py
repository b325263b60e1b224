"""Measured dispatch: the tuning cache, the modes, ``choose``, and the GPU route's candidates and re-tiled blocks.

The GPU route (``ops._block_sparse_matmul``'s ``_GpuRoute`` backend, through ``ops._router.route``) runs here with
the Pallas kernels in interpret mode, and its tuning with host timing, so CI exercises the same code as a GPU; the
``gpu`` tests at the end run it on a real device.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import threading
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from jax import lax
from jax._src import core as jax_core
from jax.sharding import PartitionSpec as P

import jaxsparse
from jaxsparse import _tuning
from jaxsparse._sparsify import _route as sparsify_route
from jaxsparse._tuning import _cache
from jaxsparse._tuning import _measure
from jaxsparse.formats._block_sparse import merge_block_data
from jaxsparse.formats._block_sparse import split_blocks
from jaxsparse.ops import _block_sparse_matmul as op
from jaxsparse.pallas import _block_sparse_matmul as kernels
from tests._util import SPLIT_EXAMPLES


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
  """Each test: its own cache file, an empty memo, the environment's mode (tests/conftest.py: off) unless set."""
  monkeypatch.setenv(_cache.ENV_PATH, str(tmp_path / "autotune.json"))
  _cache.clear_memo()
  _tuning.set_autotune_mode(None)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    yield
  _cache.clear_memo()
  _tuning.set_autotune_mode(None)


def _candidates(log: list, times: dict[str, float] | None = None):
  """Three candidates computing ``2 x`` (their ``value`` is their name); ``log`` records what was measured."""

  def make(name):
    def run(x):
      log.append(name)
      return 2 * x

    return _tuning.Candidate(name, run, name)

  return [make("default"), make("a"), make("dense")]


def _choose(cands, make_args=lambda: (jnp.ones(4),), platform="cpu", **fields):
  return _tuning.choose("op", "fwd", cands, make_args, platform=platform, fields={"rows": 4, **fields})


# -------------------------------------------------------------------------------------------------
# Modes.
# -------------------------------------------------------------------------------------------------


def test_mode_precedence(monkeypatch):
  monkeypatch.setenv(_cache.ENV_MODE, "cached")
  assert _cache.current_mode("cuda") == "cached"
  _tuning.set_autotune_mode("tune")
  assert _cache.current_mode("cpu") == "tune"
  with _tuning.autotune_mode("off"):
    assert _cache.current_mode("cuda") == "off"
  assert _cache.current_mode("cpu") == "tune"
  _tuning.set_autotune_mode("auto")
  assert (_cache.current_mode("cuda"), _cache.current_mode("cpu")) == ("tune", "cached")


@pytest.mark.parametrize("bad", ["fast", "", None, 1])
def test_bad_modes_are_named(bad, monkeypatch):
  if bad is not None:
    with pytest.raises(ValueError, match="mode must be one of"):
      _tuning.set_autotune_mode(bad)
  with pytest.raises(ValueError, match="mode must be one of"):
    with _tuning.autotune_mode(bad):
      pass
  monkeypatch.setenv(_cache.ENV_MODE, "sometimes")
  with pytest.raises(ValueError, match=r"\$JAXSPARSE_AUTOTUNE must be one of .* got 'sometimes'"):
    _cache.current_mode("cpu")


def test_tuning_budget_from_the_environment_and_unbounded_ahead_of_time(monkeypatch):
  monkeypatch.delenv(_cache.ENV_BUDGET, raising=False)
  assert _cache.current_budget_s() == _cache.DEFAULT_BUDGET_S == 3.0
  monkeypatch.setenv(_cache.ENV_BUDGET, "1.5")
  assert _cache.current_budget_s() == 1.5
  with _cache.unbounded_budget():
    assert _cache.current_budget_s() is None
  assert _cache.current_budget_s() == 1.5
  monkeypatch.setenv(_cache.ENV_BUDGET, "None")
  assert _cache.current_budget_s() is None
  for bad in ("0", "-1", "soon", "inf", "nan"):
    monkeypatch.setenv(_cache.ENV_BUDGET, bad)
    with pytest.raises(ValueError, match=rf"\$JAXSPARSE_AUTOTUNE_BUDGET must be a positive number .* got '{bad}'"):
      _cache.current_budget_s()


# -------------------------------------------------------------------------------------------------
# choose().
# -------------------------------------------------------------------------------------------------


def test_off_and_cached_modes_never_measure():
  log = []
  calls = []
  make_args = lambda: calls.append(1) or (jnp.ones(4),)
  with _tuning.autotune_mode("off"):
    assert _choose(_candidates(log), make_args).name == "default"
  with _tuning.autotune_mode("cached"):
    assert _choose(_candidates(log), make_args).name == "default"
  assert log == [] and calls == [] and not _cache.cache_path().exists()


def test_tune_measures_once_then_reads_the_cache(monkeypatch):
  times = {"default": 2.0, "a": 1.0, "dense": 1.5}
  measured = []
  monkeypatch.setattr(_measure, "_measure", lambda cands, make_args, platform, dense: measured.append(1) or dict(times))
  cands = _candidates([])
  with _tuning.autotune_mode("tune"):
    assert _choose(cands).name == "a"
  assert measured == [1]
  doc = json.loads(_cache.cache_path().read_text())
  (entry,) = doc["entries"].values()
  assert entry["choice"] == "a" and entry["default"] == "default" and set(entry["times_us"]) == set(times)
  # A second trace, and a new process (memo cleared), read the decision without measuring.
  monkeypatch.setattr(_measure, "_measure", lambda *a: pytest.fail("measured again"))
  with _tuning.autotune_mode("tune"):
    assert _choose(cands).name == "a"
  _cache.clear_memo()
  with _tuning.autotune_mode("cached"):
    assert _choose(cands).name == "a"
  # Another signature is not the same decision.
  with _tuning.autotune_mode("cached"):
    assert _choose(cands, rows=8).name == "default"


@pytest.mark.parametrize("old_entry", [
    {"choice": "a", "default": "default", "candidates": ["a", "default"], "times_us": {"a": 1.0, "default": 2.0}},
    {"choice": "a", "default": "default", "times_us": {"a": 1.0, "default": 2.0}},  # before "candidates"
])
def test_a_candidate_added_since_the_decision_is_measured_once_in_tune_mode(old_entry, monkeypatch):
  cands = _candidates([])  # default, a, dense: "dense" is new to the cached decision
  key = _measure.signature_key("op", "fwd", "cpu", rows=4)
  _cache.record(key, old_entry)
  monkeypatch.setattr(_measure, "_measure", lambda *a: pytest.fail("measured in cached mode"))
  with _tuning.autotune_mode("cached"):  # may not measure: the decision stands
    assert _choose(cands).name == "a"
  measured = []
  times = {"default": 2.0, "a": 1.0, "dense": 0.5}
  monkeypatch.setattr(_measure, "_measure",
                      lambda c, m, p, d: measured.append(sorted(x.name for x in c)) or dict(times))
  with _tuning.autotune_mode("tune"):
    assert _choose(cands).name == "dense"
    assert _choose(cands).name == "dense"
  assert measured == [["a", "default", "dense"]]
  entry = _cache.lookup(key)
  assert entry["candidates"] == ["a", "default", "dense"] and entry["choice"] == "dense"
  # A candidate that fails to run is remembered as offered: no measurement on every trace.
  _cache.record(key, {**entry, "times_us": {"a": 1.0, "default": 2.0}})
  with _tuning.autotune_mode("tune"):
    assert _choose(cands).name == "dense"
  assert len(measured) == 1


def test_products_of_one_key_offering_different_candidates_measure_once_each(monkeypatch):
  make = lambda name: _tuning.Candidate(name, lambda x: 2 * x, name)
  first, second = [make("default"), make("a")], [make("default"), make("b")]
  measured = []
  monkeypatch.setattr(_measure, "_measure", lambda c, m, p, d: measured.append(len(c)) or {x.name: 1.0 for x in c})
  with _tuning.autotune_mode("tune"):
    for _ in range(3):
      assert _choose(first).name == "default" and _choose(second).name == "default"
  assert measured == [2, 2]  # each set once; then the key knows both
  assert _cache.lookup(_measure.signature_key("op", "fwd", "cpu", rows=4))["candidates"] == ["a", "b", "default"]


def test_a_cached_choice_the_product_does_not_offer_runs_its_fastest_recorded_candidate(monkeypatch):
  make = lambda name: _tuning.Candidate(name, lambda x: 2 * x, name)
  first, second = [make("default"), make("a")], [make("default"), make("b")]
  times = {"default": 3.0, "a": 2.0, "b": 1.0}
  measured = []
  monkeypatch.setattr(_measure, "_measure",
                      lambda c, m, p, dense=None: measured.append(len(c)) or {x.name: times[x.name] for x in c})
  with _tuning.autotune_mode("tune"):
    assert _choose(first).name == "a" and _choose(second).name == "b"  # "b" is new to the key: measured
    for _ in range(2):  # the key's choice "b" is not offered to the first: its fastest recorded, "a", unmeasured
      assert _choose(first).name == "a" and _choose(second).name == "b"
  assert measured == [2, 2]
  entry = _cache.lookup(_measure.signature_key("op", "fwd", "cpu", rows=4))
  assert entry["times_us"] == {"a": 2000.0, "b": 1000.0, "default": 3000.0}
  _cache.clear_memo()  # a new process, cached mode: the same choices
  with _tuning.autotune_mode("cached"):
    assert _choose(first).name == "a" and _choose(second).name == "b"


def test_cached_decisions_with_a_malformed_candidate_list_are_remeasured(monkeypatch):
  key = _measure.signature_key("op", "fwd", "cpu", rows=4)
  _cache.record(key, {"choice": "a", "candidates": "a,default", "times_us": 3})
  measured = []
  monkeypatch.setattr(_measure, "_measure", lambda c, m, p, d: measured.append(1) or {"default": 1.0, "a": 2.0})
  with _tuning.autotune_mode("tune"):
    assert _choose(_candidates([])).name == "default"
  assert measured == [1]


@pytest.mark.parametrize("bad", [10**400, -(10**400), float("nan"), float("inf"), True, "1.0"])
def test_cached_times_that_are_no_finite_number_are_left_out(monkeypatch, bad):
  """A cache entry (a file other processes and machines write, imported with import_tuning_cache) whose recorded
  times are JSON integers too large for a float made every product of its signature raise OverflowError."""
  monkeypatch.setattr(_measure, "_WARNED", set())
  key = _measure.signature_key("op", "fwd", "cpu", rows=4)
  _cache.record(key, {"choice": "a", "candidates": ["a", "default"], "times_us": {"a": bad, "default": 5.0},
                      "dense_us": bad})
  assert _measure._recorded_us(_cache.lookup(key)) == {"default": 5.0}
  monkeypatch.setattr(_measure, "_measure", lambda *a: pytest.fail("cached mode measures nothing"))
  with _tuning.autotune_mode("cached"), warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    assert _dense_choose(_candidates([])).name == "a"
  assert not _slower_warnings(rec)  # no dense time to compare with
  # Tuning measures what the entry does not say (a's time) and records finite times.
  monkeypatch.setattr(_measure, "_measure", lambda *a: {"default": 1.0, "a": 2.0, _measure.DENSE: 1.5})
  with _tuning.autotune_mode("tune"):
    assert _dense_choose(_candidates([])).name in ("a", "default")
  assert all(math.isfinite(v) for v in _measure._recorded_us(_cache.lookup(key)).values())


@pytest.mark.parametrize(("times", "winner"), [
    ({"default": 1.0, "a": 0.98, "dense": 1.2}, "default"),  # within the 3% margin: the default stays
    ({"default": 1.0, "a": 0.90, "dense": 1.2}, "a"),
    ({"default": 1.0, "dense": 0.5}, "dense"),  # "a" failed to compile: left out
    ({}, "default"),  # nothing ran: the default
])
def test_margin_and_failures(monkeypatch, times, winner):
  monkeypatch.setattr(_measure, "_measure", lambda cands, make_args, platform, dense: dict(times))
  with _tuning.autotune_mode("tune"):
    assert _choose(_candidates([])).name == winner


def _step_product(backward_work: set[str]):
  """A forward of five candidates: ``a`` and ``a/wide`` do no per-call work on the weight, ``b/g2`` and ``b/g4`` do
  ``"b"`` and ``c`` does ``"c"``, which the step's backward routes may share (``backward_work``)."""
  from jaxsparse.ops import _router  # noqa: PLC0415

  def make(name):
    return _tuning.Candidate(name, lambda x: 2 * x, name)

  cands = [make("a"), make("a/wide"), make("b/g2"), make("b/g4"), make("c")]
  in_step = _router.InStep(lambda run: (lambda x: run(x) + 1), lambda name: name[0] if name[0] in "bc" else "",
                           lambda platform: set(backward_work))
  return _router.Product("op", "fwd", (jnp.ones(4),), {"rows": 4}, lambda: (jnp.ones(4),), in_step=in_step), cands


_ALONE = {"a": 100.0, "a/wide": 101.0, "b/g2": 130.0, "b/g4": 120.0, "c": 140.0}


@pytest.mark.parametrize(("alone", "backward", "in_step", "finalists", "winner"), [
    # "b/g4" does per-call work alone that the step's backward routes do too: it wins in the step. "a/wide" does what
    # the choice does, "b/g2" is slower than b/g4 alone, "c" does nothing the backward does: not timed again.
    (_ALONE, {"b", ""}, {"a": 200.0, "b/g4": 150.0}, ["a", "b/g4"], "b/g4"),
    (_ALONE, {"b"}, {"a": 150.0, "b/g4": 148.0}, ["a", "b/g4"], "a"),  # within the 3% margin
    (_ALONE, {"b", "c"}, {"a": 150.0, "b/g4": 148.0, "c": 120.0}, ["a", "b/g4", "c"], "c"),
    (_ALONE, {""}, None, None, "a"),  # the backward shares no work with any forward route: nothing timed again
    ({**_ALONE, "b/g4": 151.0, "b/g2": 152.0}, {"b"}, None, None, "a"),  # no rival within 1.5x of the choice
])
def test_a_differentiated_forward_is_chosen_in_its_train_step(monkeypatch, alone, backward, in_step, finalists,
                                                               winner):
  from jaxsparse.ops import _router  # noqa: PLC0415

  timed = []

  def fake(cands, make_args, platform, dense):
    stepped = [c.measure is not None for c in cands]
    assert len(set(stepped)) == 1  # a measurement times all its candidates one way
    timed.append(("step" if stepped[0] else "fwd", [c.name for c in cands]))
    times = in_step if stepped[0] else alone
    return {c.name: times[c.name] for c in cands}

  monkeypatch.setattr(_measure, "_measure", fake)
  product, cands = _step_product(backward)
  with _tuning.autotune_mode("tune"):
    assert _router._choose(product, cands, "cpu").name == winner
    assert _router._choose(product, cands, "cpu").name == winner  # memoized: nothing timed again
  assert timed[0] == ("fwd", ["a", "a/wide", "b/g2", "b/g4", "c"])
  assert timed[1:] == ([("step", finalists)] if finalists else [])
  entries = {json.loads(k)["dir"]: e for k, e in json.loads(_cache.cache_path().read_text())["entries"].items()}
  assert entries["fwd"]["choice"] == "a"
  if finalists:
    assert (entries["step"]["choice"], entries["step"]["candidates"]) == (winner, finalists)
  else:
    assert "step" not in entries
  # Another process reads both decisions; without in_step (the forward of an undifferentiated call) the forward's.
  _cache.clear_memo()
  monkeypatch.setattr(_measure, "_measure", lambda *a: pytest.fail("measured again"))
  with _tuning.autotune_mode("cached"):
    assert _router._choose(product, cands, "cpu").name == winner
    assert _router._choose(dataclasses.replace(product, in_step=None), cands, "cpu").name == "a"
  with _tuning.autotune_mode("off"):
    assert _router._choose(product, cands, "cpu").name == "a"


# -------------------------------------------------------------------------------------------------
# The dense product a sparse one stands in for: timed beside the candidates, a warning where none beats it.
# -------------------------------------------------------------------------------------------------

_DENSE = _tuning.DenseProduct((384, 4096), (4096, 2048), ("float16", "float16"))


def _dense_choose(cands, dense=_DENSE, **fields):
  return _tuning.choose("op", "fwd", cands, lambda: (jnp.ones(4),), platform="cpu", fields={"rows": 4, **fields},
                        dense=dense)


def _slower_warnings(record) -> list[str]:
  return [str(r.message) for r in record if issubclass(r.category, jaxsparse.SlowerThanDenseWarning)]


def test_a_choice_slower_than_the_dense_product_warns_once_per_process(monkeypatch):
  monkeypatch.setattr(_measure, "_measure", lambda *a: {"default": 2.0, "a": 1.5, "dense": 1.8, _measure.DENSE: 1.0})
  monkeypatch.setattr(_measure, "_WARNED", set())
  with _tuning.autotune_mode("tune"), warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    assert _dense_choose(_candidates([])).name == "a"
    assert _dense_choose(_candidates([])).name == "a"  # the same signature again: no second warning
  (message,) = _slower_warnings(rec)
  assert rec[0].filename == __file__  # the caller's line, not jaxsparse's
  assert "op forward" in message and "(a, 1500 us)" in message and "1.50x" in message
  assert "(384, 4096) @ (4096, 2048) float16: 1000 us" in message and "route_slower_to_dense" in message
  (entry,) = json.loads(_cache.cache_path().read_text())["entries"].values()
  assert entry["dense_us"] == 1000.0 and entry["choice"] == "a"
  # Another process (memo and warnings fresh) reads the decision from the cache, and is told again.
  monkeypatch.setattr(_measure, "_measure", lambda *a: pytest.fail("measured again"))
  monkeypatch.setattr(_measure, "_WARNED", set())
  _cache.clear_memo()
  with _tuning.autotune_mode("cached"), warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    assert _dense_choose(_candidates([])).name == "a"
  assert len(_slower_warnings(rec)) == 1


@pytest.mark.parametrize("direction", ["dx", "dw"])
def test_gradients_tuned_one_by_one_do_not_warn(direction, monkeypatch):
  # Their per-call work on the weight (re-tiled, transposed copies) is shared by a train step's products: not compared.
  monkeypatch.setattr(_measure, "_measure", lambda *a: {"default": 2.0, _measure.DENSE: 1.0})
  monkeypatch.setattr(_measure, "_WARNED", set())
  with _tuning.autotune_mode("tune"), warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    _tuning.choose("op", direction, _candidates([])[:2], lambda: (jnp.ones(4),), platform="cpu", fields={"rows": 4},
                   dense=_DENSE)
  assert not _slower_warnings(rec)
  (entry,) = json.loads(_cache.cache_path().read_text())["entries"].values()
  assert entry["dense_us"] == 1000.0  # recorded all the same


@pytest.mark.parametrize(("times", "dense_ms", "dense"), [
    ({"default": 1.0, "a": 2.0}, 0.98, _DENSE),  # within the 3% margin of the dense product
    ({"default": 1.0, "a": 2.0}, 0.5, None),  # the product names no dense product: nothing timed, no warning
    ({"default": 1.0, "a": 2.0}, None, _DENSE),  # the dense product failed to run: no comparison
])
def test_no_warning_within_the_margin_or_without_a_dense_time(monkeypatch, times, dense_ms, dense):
  monkeypatch.setattr(_measure, "_measure", lambda c, m, p, dense=None: {**times, _measure.DENSE: dense_ms}
                      if dense is not None and dense_ms is not None else dict(times))
  monkeypatch.setattr(_measure, "_WARNED", set())
  with _tuning.autotune_mode("tune"), warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    assert _dense_choose(_candidates([]), dense=dense).name == "default"
  assert not _slower_warnings(rec)
  (entry,) = json.loads(_cache.cache_path().read_text())["entries"].values()
  assert ("dense_us" in entry) == (dense is not None and dense_ms is not None)


@pytest.mark.parametrize("step", [False, True])
def test_the_dense_product_is_really_timed_inside_a_trace(step):
  dense = _tuning.DenseProduct((2, 8, 16), (16, 4), ("float32", "bfloat16"), step=step)

  def f(x):
    return _dense_choose(_candidates([]), dense=dense).run(x).sum()

  with _tuning.autotune_mode("tune"), warnings.catch_warnings():
    warnings.simplefilter("ignore", jaxsparse.SlowerThanDenseWarning)
    jax.jit(f)(jnp.ones(4))
  (entry,) = json.loads(_cache.cache_path().read_text())["entries"].values()
  assert entry["dense_us"] > 0
  assert dense.describe() == "(2, 8, 16) @ (16, 4) float32 x bfloat16" + (" train step" if step else "")


def test_block_sparse_products_record_their_dense_twins_time(monkeypatch):
  # Every direction of a tuned block-sparse product is compared with a dense layer's product of the same shapes.
  seen, measure = [], _measure._measure
  monkeypatch.setattr(_measure, "_measure", lambda c, m, p, dense: {**measure(c, m, p), _measure.DENSE: 1e-6}
                      if not seen.append(dense) else None)
  monkeypatch.setattr(_measure, "_WARNED", set())
  rng = np.random.default_rng(0)
  w = jaxsparse.BlockSparseMatrix.from_dense(jnp.asarray(rng.standard_normal((64, 96)), jnp.float32), (16, 16))
  x = jnp.asarray(rng.standard_normal((24, 64)), jnp.float32)
  with _tuning.autotune_mode("tune"), warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    jax.jit(jax.grad(lambda x, d: jnp.sum(jaxsparse.ops.block_sparse_matmul(x, w.with_data(d)) ** 2),
                     argnums=(0, 1)))(x, w.data)
  assert sorted((d.lhs, d.rhs) for d in seen if not d.step) == [
      ((24, 64), (64, 96)), ((24, 96), (96, 64)), ((64, 24), (24, 96))]
  # The forward is re-timed in its train step where a rival within 1.5x of its choice does the backward's weight
  # work (the measured times decide): against a dense train step of the forward's shapes.
  assert all((d.lhs, d.rhs) == ((24, 64), (64, 96)) for d in seen if d.step)
  entries = json.loads(_cache.cache_path().read_text())["entries"].values()
  assert [e["dense_us"] for e in entries] == [0.0] * len(seen)
  assert not _slower_warnings(rec)  # a time of 0 compares nothing


def test_routing_to_dense_does_not_warn_about_what_it_routes():
  with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    with sparsify_route._tuned():
      assert _cache.current_mode("cpu") == "tune"
      warnings.warn("slower", jaxsparse.SlowerThanDenseWarning, stacklevel=1)
    warnings.warn("slower", jaxsparse.SlowerThanDenseWarning, stacklevel=1)
  assert len(_slower_warnings(rec)) == 1


def test_no_device_of_the_platform_means_the_default(monkeypatch):
  monkeypatch.setattr(_measure, "_measure", lambda *a: pytest.fail("measured without a device"))
  with _tuning.autotune_mode("tune"):
    assert _choose(_candidates([]), platform="cuda").name == "default"


def test_only_the_running_backend_is_measured(monkeypatch):
  # Under jit both branches of lax.platform_dependent are traced: a GPU machine must not time the CPU routes.
  assert _measure._has_device("cpu") and not _measure._has_device("cuda")
  monkeypatch.setattr(_measure.jax, "default_backend", lambda: "gpu")
  assert not _measure._has_device("cpu")


def test_real_measurement_on_cpu_under_jit_vmap_and_grad():
  # The candidates really run (host timing); the choice happens while the caller is traced.
  log = []
  cands = _candidates(log)

  def f(x):
    c = _choose(cands, make_args=lambda: (jnp.ones(4),))
    return c.run(x).sum()

  with _tuning.autotune_mode("tune"):
    jax.jit(f)(jnp.ones(4))
    jax.jit(jax.vmap(f))(jnp.ones((2, 4)))
    jax.grad(f)(jnp.ones(4))
  assert {"default", "a", "dense"} <= set(log)
  assert len(json.loads(_cache.cache_path().read_text())["entries"]) == 1
  # Inside shard_map (the shard's operands) and jax.export, on another signature each.
  mesh = jax.make_mesh((1,), ("d",))
  shard = lambda x: jax.shard_map(
      lambda x: _choose(cands, make_args=lambda: (jnp.ones(4),), rows=1).run(x), mesh=mesh, in_specs=P(), out_specs=P()
  )(x)
  exported = lambda x: _choose(cands, make_args=lambda: (jnp.ones(4),), rows=2).run(x)
  with _tuning.autotune_mode("tune"):
    jax.jit(shard)(jnp.ones(4))
    jax.export.export(jax.jit(exported))(jnp.ones(4))
  assert len(json.loads(_cache.cache_path().read_text())["entries"]) == 3


def test_operands_that_fit_a_cache_are_timed_in_copies(monkeypatch):
  mb = lambda n: (types.SimpleNamespace(nbytes=n << 20),)
  assert _measure._copies(mb(1), "cuda") == 1  # no GPU here: one set, as on a CPU
  monkeypatch.setattr(_measure.jax, "default_backend", lambda: "gpu")
  assert _measure._copies(mb(1), "cpu") == 1
  # A 19 MB decode weight (4096 x 4096 at 2:4): 14 sets, 266 MB, more than twice any GPU's L2; at most 16 sets.
  assert [_measure._copies(mb(n), "cuda") for n in (1, 19, 90, 127, 128, 600)] == [16, 14, 3, 3, 1, 1]


def test_each_set_of_operands_is_called_in_turn_and_the_time_is_per_call(monkeypatch):
  monkeypatch.setattr(_measure, "_copies", lambda args, platform: 3)
  made, traced = [], []

  def make_args():
    made.append(1)
    return (jnp.arange(4.0), 5)

  def run(x, k):
    traced.append(1)
    return k * x

  times = _measure._measure([_tuning.Candidate("default", run)], make_args, "cpu")
  # Random operands made once, then copied (new buffers, same values; other leaves as they are); one trace of run.
  assert len(made) == 1 and len(traced) == 1 and set(times) == {"default"} and times["default"] > 0
  sets = _measure._sets((jnp.arange(4.0), 5), "cpu")
  assert len(sets) == 3 and all(s[1] == 5 and s[0] is not sets[0][0] for s in sets[1:])
  outs = jax.jit(_measure._in_turn(lambda x, k: k * x))(sets)
  assert len(outs) == 3 and all(np.array_equal(o, 5 * np.arange(4.0)) for o in outs)


@settings(max_examples=15, deadline=None)
@given(shape=st.lists(st.integers(1, 70), min_size=1, max_size=3), seed=st.integers(0, 2**31),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]))
def test_random_operand_is_varied_bounded_and_reproducible(shape, seed, dtype):
  # Operands to time products on (one compile per shape, no random-bits program): finite, within [-1.7, 1.7] (up to
  # the dtype's rounding), varied, the same for a seed and different between seeds.
  a = _measure.random_operand(shape, dtype, seed)
  assert a.shape == tuple(shape) and a.dtype == jnp.dtype(dtype)
  v = np.asarray(a.astype(jnp.float32))
  assert np.all(np.isfinite(v)) and np.all(np.abs(v) < 1.75)
  assert np.array_equal(v, np.asarray(_measure.random_operand(shape, dtype, seed).astype(jnp.float32)))
  if v.size >= 64:
    assert len(np.unique(v)) > min(v.size // 4, 500)  # bfloat16 has about 1100 values in [-1.7, 1.7]
    assert not np.array_equal(v, np.asarray(_measure.random_operand(shape, dtype, seed + 1).astype(jnp.float32)))
  big = np.asarray(_measure.random_operand((512, 512), "float32", seed))
  assert abs(big.mean()) < 0.02 and 0.95 < big.std() < 1.01


def test_train_step_cotangent_depends_on_the_forward():
  # Train-step candidates are timed with dY = y (loss sum(y^2) / 2): under sum(y) the cotangent is a constant and XLA
  # reorders the step (dW before the forward; the forward's weight cast fused into what follows), which no step with
  # a real loss allows.
  kx, kw = jax.random.split(jax.random.key(3))
  x, w = jax.random.normal(kx, (5, 7)), jax.random.normal(kw, (7, 3))
  loss, (dx, dw) = jax.jit(_tuning.train_step(lambda x, w: x @ w))(x, w)
  y = x @ w
  np.testing.assert_allclose(loss, 0.5 * np.sum(np.square(y)), rtol=1e-5)
  np.testing.assert_allclose(dx, y @ w.T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, x.T @ y, rtol=1e-5, atol=1e-5)
  text = jax.jit(_tuning.train_step(lambda x, w: x @ w.astype(jnp.bfloat16))).lower(x.astype(jnp.bfloat16), w)
  assert "dot_general" in text.as_text()
  _, (_, di) = _tuning.train_step(lambda x, i: x * i)(jnp.ones(3), jnp.arange(3))  # integer operands: float0
  assert di.dtype == jax.dtypes.float0


def test_random_operands_are_made_where_no_trace_is_active():
  """Inside the caller's trace, a jitted operand maker would run op by op with its constants folded (20 s for an
  LLM's weight): make_args runs where jit compiles and runs whole programs."""
  seen = []

  def make_args():
    seen.append(jax_core.trace_state_clean())
    return (jnp.ones(4),)

  def f(x):
    _measure._measure([_tuning.Candidate("a", lambda v: v + 1)], make_args, "cpu")
    return x

  jax.jit(f)(1.0)
  assert seen == [True]
  # The caller's thread-local settings go with it: 64-bit types, the default device.
  cpu = jax.devices("cpu")[0]
  made = lambda: (jnp.zeros(2, jnp.float64), jax.config.jax_default_device)
  with jax.enable_x64(True), jax.default_device(cpu):
    assert _measure._made_outside_the_trace(made)[0].dtype == jnp.float64
    assert _measure._made_outside_the_trace(made)[1] == cpu
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # float64 requested without 64-bit types: float32
    assert _measure._made_outside_the_trace(made)[0].dtype == jnp.float32


def test_candidates_are_prepared_side_by_side_before_any_is_traced():
  events, lock, both_started = [], threading.Lock(), threading.Barrier(2, timeout=10)

  def prepare(name):
    both_started.wait()  # a deadlock (BrokenBarrierError) unless the two run at once, in threads
    with lock:
      events.append(("prepared", name))
    if name == "b":
      raise RuntimeError("the build failed")  # left to tracing: logged, not raised

  def run(name):
    def f(x):
      events.append(("traced", name))
      return x + 1
    return f

  cands = [_tuning.Candidate(n, run(n), prepare=functools.partial(prepare, n)) for n in ("a", "b")]
  cands.append(_tuning.Candidate("dense", run("dense")))  # no prepare
  times = _measure._measure(cands, lambda: (jnp.ones(4),), "cpu")
  assert set(times) == {"a", "b", "dense"}
  assert sorted(events[:2]) == [("prepared", "a"), ("prepared", "b")]
  assert [e[0] for e in events[2:]] == ["traced"] * 3


def test_a_candidate_compiling_past_the_budget_is_left_untimed(monkeypatch):
  # "slow" compiles until the test releases it; the budget (0.5 s, 0.1 s of it before the timing) ends first. The
  # shipped default and the dense product (always_timed) are waited for whatever the budget.
  monkeypatch.setenv(_cache.ENV_BUDGET, "0.5")
  release, real = threading.Event(), _measure._timed_compile

  started = threading.Event()

  def compile_(lowered):
    if "3.25" in lowered.as_text():
      started.set()
      release.wait(60)
    return real(lowered)

  monkeypatch.setattr(_measure, "_timed_compile", compile_)
  cands = [_tuning.Candidate("default", lambda v: v + 1), _tuning.Candidate("slow", lambda v: v * 3.25),
           _tuning.Candidate("dense", lambda v: 2 * v, always_timed=True)]
  try:
    times = _measure._measure(cands, lambda: (jnp.ones(4),), "cpu")
    # Its compile (if it started before the budget ran out) goes on in the background: a benchmark can wait for it.
    assert _measure.wait_for_background_compiles(timeout=0.05) is not started.is_set()
  finally:
    release.set()
  assert _measure.wait_for_background_compiles(timeout=60)
  assert all(f.done() for f in _measure._BACKGROUND)  # each leaves the set as it finishes (its callback)
  assert times["slow"] is None and times["default"] > 0 and times["dense"] > 0, times
  monkeypatch.setenv(_cache.ENV_BUDGET, "none")  # no budget: every candidate timed
  assert all(v > 0 for v in _measure._measure(cands, lambda: (jnp.ones(4),), "cpu").values())


def test_candidates_left_out_for_the_budget_are_timed_by_autotune_later(monkeypatch):
  monkeypatch.delenv(_cache.ENV_BUDGET, raising=False)
  cands = _candidates([])
  measured = []

  def fake(times):
    return lambda c, m, p, dense=None: measured.append(_cache.current_budget_s()) or dict(times)

  monkeypatch.setattr(_measure, "_measure", fake({"default": 2.0, "a": None, "dense": 1.5}))
  with _tuning.autotune_mode("tune"):
    assert _choose(cands).name == "dense"
    assert _choose(cands).name == "dense"  # first-trace tuning does not come back for "a"
  key = _measure.signature_key("op", "fwd", "cpu", rows=4)
  entry = _cache.lookup(key)
  assert entry["unfinished"] == ["a"] and entry["candidates"] == ["a", "default", "dense"]
  assert set(entry["times_us"]) == {"default", "dense"} and measured == [3.0]
  monkeypatch.setattr(_measure, "_measure", fake({"default": 2.0, "a": 0.5, "dense": 1.5}))
  with _tuning.autotune_mode("tune"), _cache.unbounded_budget():  # as jaxsparse.autotune measures
    assert _choose(cands).name == "a"
    assert _choose(cands).name == "a"
  entry = _cache.lookup(key)
  assert "unfinished" not in entry and entry["times_us"] == {"a": 500.0, "default": 2000.0, "dense": 1500.0}
  assert measured == [3.0, None]


def test_time_call_ms_times_one_call_over_copies_of_the_operands(monkeypatch):
  monkeypatch.setattr(_measure, "_copies", lambda args, platform: 4)
  seen = []

  def f(w, x):
    seen.append(1)
    return x @ w

  w, x = jnp.ones((64, 64)), jnp.ones((2, 64))
  one = _measure.time_call_ms(f, (w, x), "cpu")
  assert len(seen) == 1 and one > 0  # four calls in one jitted function, f traced once; the time is per call


# -------------------------------------------------------------------------------------------------
# The cache file.
# -------------------------------------------------------------------------------------------------


_OWN_CACHE = json.dumps({"format": "jaxsparse-autotune", "version": 1, "entries": {"k": {"choice": "x"}}}, indent=1,
                        sort_keys=True)


@pytest.mark.parametrize(("content", "why"), [
    (_OWN_CACHE[:30], "not valid JSON"),  # a cache of ours cut short (a crash, a full disk)
    ('{"format": "jaxsparse-autotune", "version": 0, "entries": {}}', "format version 0"),
    ("", "is empty"),
])
def test_broken_caches_of_ours_are_ignored_with_a_named_warning_and_replaced(content, why, monkeypatch):
  _cache.cache_path().write_text(content)
  monkeypatch.setattr(_measure, "_measure", lambda *a: {"default": 1.0, "a": 0.5})
  with pytest.warns(_tuning.AutotuneCacheWarning, match=why), _tuning.autotune_mode("tune"):
    assert _choose(_candidates([])).name == "a"
  doc = json.loads(_cache.cache_path().read_text())  # rewritten whole, in the current format
  assert doc["version"] == _cache.VERSION and len(doc["entries"]) == 1


@pytest.mark.parametrize(("content", "why"), [
    (b'{"my": "precious config"}', "is not a jaxsparse tuning cache;"),
    (b"[1, 2]", "is not a jaxsparse tuning cache;"),
    (b"{not json", r"is not a jaxsparse tuning cache \(it is not valid JSON"),
    (b"model: llama\nlr: 0.001\n", r"is not a jaxsparse tuning cache \(it is not valid JSON"),
])
def test_a_foreign_file_at_the_cache_path_is_never_replaced(content, why, monkeypatch):
  # Was: tuning warned "ignoring it (it is replaced on the next tuning)" and replaced the file (someone's config)
  # with its decisions. Now it warns once, naming the file and what to do, and keeps the decisions in the process.
  path = _cache.cache_path()
  path.write_bytes(content)
  monkeypatch.setattr(_measure, "_measure", lambda *a: {"default": 1.0, "a": 0.5})
  with warnings.catch_warnings(record=True) as caught, _tuning.autotune_mode("tune"):
    warnings.simplefilter("always")
    assert _choose(_candidates([])).name == "a"
    assert _choose(_candidates([])).name == "a"  # from the memo: measured once
    _cache.record("other", {"choice": "b"})
  messages = [str(w.message) for w in caught if issubclass(w.category, _tuning.AutotuneCacheWarning)]
  assert len(messages) == 1, messages  # once, however many decisions
  assert re.search(rf"{re.escape(str(path))} {why}.*not replacing it.*for this process only.*"
                   rf"\${_cache.ENV_PATH} to another file", messages[0])
  assert path.read_bytes() == content  # byte-identical
  assert not path.with_name(path.name + ".lock").exists()  # nothing made beside it either
  assert len(_cache.unsaved_decisions()) == 2


def _tune_one_decision(*a, **k):
  """A stand-in for ``jaxsparse._bench.tune``: one product measured, its decision recorded as _measure records it."""
  _cache.record("k", {"choice": "a"})
  return [((64, 64), "block", 8, 1, 0)]


def test_cli_tune_into_a_foreign_cache_file_fails_and_leaves_it(monkeypatch, tmp_path, capsys):
  from jaxsparse.torch_interop._cli import main  # noqa: PLC0415 -- the `jaxsparse` console script

  path = _cache.cache_path()
  path.write_text('{"my": "precious config"}')

  monkeypatch.setattr("jaxsparse._bench.tune", _tune_one_decision)
  with pytest.warns(_tuning.AutotuneCacheWarning, match="not replacing it"):
    assert main(["tune", "64x64"]) == 1
  assert (f"jaxsparse: error: the tuning cache {path} is not a jaxsparse tuning cache and is not replaced: 1 "
          "decisions were not saved") in capsys.readouterr().err
  assert path.read_text() == '{"my": "precious config"}'
  _cache.clear_memo()
  out = tmp_path / "saved.json"
  with pytest.warns(_tuning.AutotuneCacheWarning, match="not replacing it"):
    assert main(["tune", "64x64", "--export", str(out)]) == 0  # saved elsewhere
  assert path.read_text() == '{"my": "precious config"}'
  assert json.loads(out.read_text())["entries"] == {"k": {"choice": "a"}}


@pytest.mark.parametrize("content", [
    b"\xff\xfe garbage \x80",  # not UTF-8 (a disk error, a binary file at $JAXSPARSE_AUTOTUNE_CACHE)
    b"[" * 100_000 + b"]" * 100_000,  # JSON nested deeper than the parser recurses
], ids=["not-utf8", "deeply-nested"])
def test_undecodable_cache_files_are_ignored_with_a_warning_everywhere(content, tmp_path, monkeypatch):
  _cache.cache_path().write_bytes(content)
  monkeypatch.setattr(_measure, "_measure", lambda *a: {"default": 1.0, "a": 0.5})
  with pytest.warns(_tuning.AutotuneCacheWarning, match="not valid JSON"), _tuning.autotune_mode("cached"):
    assert _choose(_candidates([])).name == "default"
  w = jaxsparse.BlockSparseMatrix.from_dense(np.ones((16, 16), np.float32), (8, 8))
  _cache.clear_memo()
  with pytest.warns(_tuning.AutotuneCacheWarning, match="not valid JSON"), _tuning.autotune_mode("cached"):
    assert float(jaxsparse.ops.block_sparse_matmul(np.ones((2, 16), np.float32), w).sum()) == 512.0
  with pytest.raises(ValueError, match=r"cannot import .*not valid JSON"):
    _tuning.import_cache(_cache.cache_path())
  (tmp_path / "target.json").write_bytes(content)
  with pytest.raises(ValueError, match=r"target\.json exists and is not a jaxsparse tuning cache \(it is not valid"):
    _tuning.export_cache(tmp_path / "target.json")  # a garbled (or any other) file is never replaced by an export
  assert (tmp_path / "target.json").read_bytes() == content


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_the_rewritten_cache_file_gets_the_umask_permissions_of_a_new_file(umask, tmp_path):
  old = os.umask(umask)
  try:
    _cache.record("k", {"choice": "x"})
    assert _tuning.export_cache(tmp_path / "exported.json") == 1
  finally:
    os.umask(old)
  for path in (_cache.cache_path(), tmp_path / "exported.json"):
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
  assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_stale_entries_of_other_versions_do_not_match(monkeypatch):
  monkeypatch.setattr(_measure, "_measure", lambda *a: {"default": 1.0, "a": 0.5})
  with _tuning.autotune_mode("tune"):
    _choose(_candidates([]))
  doc = json.loads(_cache.cache_path().read_text())
  (key,) = doc["entries"]
  fields = json.loads(key)
  assert fields["jaxsparse"] == jaxsparse.__version__ and fields["jax"] == jax.__version__
  assert fields["timing"] == _measure.TIMING_VERSION
  older_timing = {k: v for k, v in fields.items() if k != "timing"}  # timed on a warm L2, before the copies
  for stale_fields in ({**fields, "jaxsparse": "0.0.1"}, older_timing):
    stale = {json.dumps(stale_fields, sort_keys=True): doc["entries"][key]}
    _cache.cache_path().write_text(json.dumps({**doc, "entries": stale}))
    _cache.clear_memo()
    with _tuning.autotune_mode("cached"):
      assert _choose(_candidates([])).name == "default"


def test_an_entry_naming_an_unknown_candidate_is_not_used(monkeypatch):
  monkeypatch.setattr(_measure, "_measure", lambda *a: {"default": 1.0, "a": 0.5})
  with _tuning.autotune_mode("tune"):
    _choose(_candidates([]))
  cands = [c for c in _candidates([]) if c.name != "a"]
  with _tuning.autotune_mode("cached"):
    assert _choose(cands).name == "default"


_WRITER = textwrap.dedent("""
    import sys
    from jaxsparse._tuning import _cache
    for i in range(int(sys.argv[2])):
      _cache.record(f"{sys.argv[1]}-{i}", {"choice": "x"})
""")


def test_two_writers_lose_nothing_and_never_tear_the_file(tmp_path):
  env = {**os.environ, _cache.ENV_PATH: str(tmp_path / "shared.json")}
  procs = [subprocess.Popen([sys.executable, "-c", _WRITER, name, "40"], env=env) for name in ("p", "q")]
  assert all(p.wait(timeout=120) == 0 for p in procs)
  entries = json.loads((tmp_path / "shared.json").read_text())["entries"]
  assert set(entries) == {f"{n}-{i}" for n in "pq" for i in range(40)}
  assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_export_and_import(tmp_path, monkeypatch):
  monkeypatch.setattr(_measure, "_measure", lambda *a: {"default": 1.0, "a": 0.5})
  with _tuning.autotune_mode("tune"):
    _choose(_candidates([]))
  assert _tuning.export_cache(tmp_path / "shipped.json") == 1
  monkeypatch.setenv(_cache.ENV_PATH, str(tmp_path / "other.json"))
  _cache.clear_memo()
  assert _tuning.import_cache(tmp_path / "shipped.json") == 1
  with _tuning.autotune_mode("cached"):
    assert _choose(_candidates([])).name == "a"
  (tmp_path / "junk.json").write_text("nope")
  with pytest.raises(ValueError, match=r"cannot import .*junk.json.*not valid JSON"):
    _tuning.import_cache(tmp_path / "junk.json")
  with pytest.raises(ValueError, match="does not exist"):
    _tuning.import_cache(tmp_path / "missing.json")


def test_export_includes_decisions_other_processes_wrote_since_this_one_read_the_cache(tmp_path):
  _cache.record("mine", {"choice": "a"})  # this process has read its cache file (and written one decision)
  own = _cache.cache_path()
  doc = json.loads(own.read_text())
  doc["entries"]["theirs"] = {"choice": "b"}  # another process sharing the file adds one
  own.write_text(json.dumps(doc))
  # Was 1: only this process's memo, read before "theirs" was written.
  assert _tuning.export_cache(tmp_path / "shipped.json") == 2
  assert set(json.loads((tmp_path / "shipped.json").read_text())["entries"]) == {"mine", "theirs"}


@pytest.mark.parametrize("content", ['{"model": "llama", "lr": 0.001}', "not json", "[]"])
def test_export_never_replaces_a_file_that_is_not_a_tuning_cache(content, tmp_path):
  _cache.record("k", {"choice": "a"})
  config = tmp_path / "config.json"
  config.write_text(content)
  with pytest.raises(ValueError, match=r"config\.json exists and is not a jaxsparse tuning cache.*; not replacing it"):
    _tuning.export_cache(config)
  assert config.read_text() == content  # was: silently replaced by the tuning cache
  old = tmp_path / "old.json"  # a tuning cache of another format version is ours: replaced
  old.write_text(json.dumps({"format": _cache.FORMAT, "version": 0, "entries": {"x": {"choice": "b"}}}))
  assert _tuning.export_cache(old) == 1
  assert json.loads(old.read_text())["entries"] == {"k": {"choice": "a"}}
  empty = tmp_path / "empty.json"  # as tempfile.mkstemp makes it: nothing to lose
  empty.write_text("")
  assert _tuning.export_cache(empty) == 1 and json.loads(empty.read_text())["entries"] == {"k": {"choice": "a"}}


def test_unwritable_cache_warns_and_keeps_the_decision(tmp_path, monkeypatch):
  blocker = tmp_path / "file"
  blocker.write_text("")
  monkeypatch.setenv(_cache.ENV_PATH, str(blocker / "sub" / "autotune.json"))
  monkeypatch.setattr(_measure, "_measure", lambda *a: {"default": 1.0, "a": 0.5})
  with pytest.warns(_tuning.AutotuneCacheWarning, match="cannot write"), _tuning.autotune_mode("tune"):
    assert _choose(_candidates([])).name == "a"
  with _tuning.autotune_mode("cached"):
    assert _choose(_candidates([])).name == "a"


@pytest.mark.parametrize("own", ["missing-parent", "directory"])
def test_import_into_an_unwritable_own_cache_warns_and_keeps_the_decisions(own, tmp_path, monkeypatch):
  shipped = tmp_path / "shipped.json"
  doc = {"format": _cache.FORMAT, "version": _cache.VERSION, "entries": {"k": {"choice": "a"}}}
  shipped.write_text(json.dumps(doc))
  if own == "directory":
    target = tmp_path / "a-directory"
    target.mkdir()
  else:
    (tmp_path / "file").write_text("")
    target = tmp_path / "file" / "sub" / "autotune.json"
  monkeypatch.setenv(_cache.ENV_PATH, str(target))
  _cache.clear_memo()
  with pytest.warns(_tuning.AutotuneCacheWarning, match="cannot write .*imported decisions are kept for this process"):
    assert _tuning.import_cache(shipped) == 1
  assert _cache.lookup("k") == {"choice": "a"}


def test_export_to_an_unwritable_path_raises(tmp_path):
  (tmp_path / "file").write_text("")
  with pytest.raises(OSError):
    _tuning.export_cache(tmp_path / "file" / "sub" / "out.json")


# -------------------------------------------------------------------------------------------------
# Re-tiled blocks.
# -------------------------------------------------------------------------------------------------


@SPLIT_EXAMPLES  # 6 examples in the fast set, 6 more with `make test-slow`
@settings(max_examples=6, deadline=None)
@given(
    st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2]),
    st.integers(1, 4), st.integers(1, 4), st.floats(0.0, 1.0), st.integers(0, 2**16),
)
def test_split_blocks_is_the_same_matrix(examples, sub_k, sub_n, r, c, kb, nb, density, seed):
  rng = np.random.default_rng(seed)
  bk, bn = sub_k * r * 2, sub_n * c * 2
  mask = rng.random((kb, nb)) < density
  w = jaxsparse.BlockSparseMatrix.from_dense(rng.standard_normal((kb * bk, nb * bn), np.float32), (bk, bn),
                                             block_mask=mask)
  sub = (bk // r, bn // c)
  s = jax.jit(split_blocks, static_argnums=1)(w, sub)
  expected = jaxsparse.BlockSparseMatrix.from_dense(
      np.asarray(w.to_dense()), sub, block_mask=np.repeat(np.repeat(mask, r, 0), c, 1))
  for field in ("data", *jaxsparse.BlockSparseMatrix.INDEX_FIELDS):
    np.testing.assert_array_equal(getattr(s, field), getattr(expected, field), err_msg=field)
  np.testing.assert_array_equal(merge_block_data(s.data, w, sub), w.data)


def test_split_blocks_rejects_shapes_that_do_not_divide():
  w = jaxsparse.BlockSparseMatrix.from_dense(np.ones((64, 64), np.float32), (32, 32))
  with pytest.raises(ValueError, match=r"block_shape=\(24, 32\) must divide the matrix's block shape \(32, 32\)"):
    split_blocks(w, (24, 32))


def test_kernel_block_shapes():
  assert op._kernel_block_shape(kernels, (256, 128)) == (128, 128)
  assert op._kernel_block_shape(kernels, (96, 48)) == (32, 16)
  assert op._kernel_block_shape(kernels, (64, 64)) == (64, 64)
  assert op._kernel_block_shape(kernels, (8, 64)) is None
  assert op._kernel_block_shape(kernels, (64, 24)) is None


# -------------------------------------------------------------------------------------------------
# The GPU route in interpret mode: every candidate, re-tiled and dense-routed blocks, forward and gradients.
# -------------------------------------------------------------------------------------------------


@pytest.fixture
def interpreted(monkeypatch):
  """The op's GPU route with the Pallas kernels in interpret mode (the Mosaic kernels are unavailable on CPU)."""
  monkeypatch.setattr(kernels, "forward", functools.partial(kernels.forward, interpret=True))
  monkeypatch.setattr(kernels, "backward", functools.partial(kernels.backward, interpret=True))
  return kernels


def _problem(m, block_shape, grid, dtype, seed):
  rng = np.random.default_rng(seed)
  mask = rng.random(grid) < 0.5
  mask[0, 0] = True
  k, n = grid[0] * block_shape[0], grid[1] * block_shape[1]
  w = jaxsparse.BlockSparseMatrix.from_dense(
      jnp.asarray(rng.standard_normal((k, n), np.float32), dtype), block_shape, block_mask=mask)
  x = jnp.asarray(rng.standard_normal((m, k), np.float32), dtype)
  dy = jnp.asarray(rng.standard_normal((m, n), np.float32), dtype)
  return x, dy, w


def _reference(x, dy, w):
  f32 = lambda a: a.astype(jnp.float32)
  dense = lambda x, d: jnp.matmul(x, w.with_data(d).to_dense(), precision=lax.Precision.HIGHEST)
  y, vjp = jax.vjp(dense, f32(x), f32(w.data))
  return (y, *vjp(f32(dy)))


def _close(out, ref, rtol):
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  assert out.shape == ref.shape
  assert np.linalg.norm(out - ref) <= rtol * max(np.linalg.norm(ref), 1e-30)


# long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
slow = pytest.mark.slow


# In the fast set: a retiled block in float32 and, in bfloat16, one no supported block divides (the dense route); the
# native blocks' routes run in both dtypes in the fast set of test_every_route_matches_the_reference.
@pytest.mark.parametrize(("block_shape", "grid", "dtype"), [
    pytest.param((64, 32), (2, 3), jnp.float32, marks=slow),  # natively supported
    # 128 x 64 -> itself; and below, multiples of supported blocks
    pytest.param((128, 64), (2, 2), jnp.float32, marks=slow),
    pytest.param((256, 128), (1, 2), jnp.float32, marks=slow),
    pytest.param((64, 256), (2, 1), jnp.bfloat16, marks=slow),
    ((96, 48), (2, 2), jnp.float32),  # -> 32 x 16
    pytest.param((8, 8), (4, 6), jnp.float32, marks=slow),  # below the kernels' minimum: the dense route
    ((24, 64), (2, 2), jnp.bfloat16),  # 24 is no multiple of 16: the dense route
])
def test_gpu_route_retiles_and_matches_the_reference(interpreted, block_shape, grid, dtype):
  x, dy, w = _problem(40, block_shape, grid, dtype, seed=sum(block_shape))
  rtol = 2e-5 if dtype == jnp.float32 else 1.5e-2
  cfg = op._Config("pallas", None, jnp.dtype(dtype))  # the GPU route only, as implementation="pallas" on a GPU
  y = jax.jit(lambda a, b: op._forward(cfg, a, b))(x, w)
  dx, ddata = jax.jit(lambda a, d, b: op._backward(cfg, a, d, b))(x, dy, w)
  assert (y.dtype, dx.dtype, ddata.dtype) == (dtype, dtype, dtype)
  for out, ref in zip((y, dx, ddata), _reference(x, dy, w), strict=True):
    _close(out, ref, rtol)


ROUTE_PROBLEMS = [
    (40, (32, 32), (3, 2), jnp.float32),
    (7, (64, 32), (3, 2), jnp.bfloat16),
    (5, (256, 128), (2, 2), jnp.float32),  # split into 128 x 128, or native on Triton
]
# In the fast set: the forward of the first problem (float32) and dW of the 16-bit one.
FAST_ROUTES = {(40, "fwd"), (7, "dw")}


@pytest.mark.parametrize(("m", "block_shape", "grid", "dtype", "direction"), [
    (*p, d) if (p[0], d) in FAST_ROUTES else pytest.param(*p, d, marks=slow)
    for p in ROUTE_PROBLEMS for d in ("fwd", "dx", "dw")
])
def test_every_route_matches_the_reference(interpreted, m, block_shape, grid, dtype, direction):
  x, dy, w = _problem(m, block_shape, grid, dtype, seed=m)
  routes = op._gpu_routes(kernels, direction, x, w, precision=None, out_dtype=dtype)
  names = [name for name, _ in routes]
  assert "dense" in names and len(names) == len(set(names)) >= 3
  wide_default = "native:default" if m <= 64 and direction != "dw" else "split:default"
  assert names[0] == ("default" if block_shape[0] <= 128 else wide_default)
  if block_shape == (256, 128):
    assert any(n.startswith("native:") for n in names) and any(n.startswith("split:") for n in names)
  y_ref, dx_ref, dw_ref = _reference(x, dy, w)
  ref, args = {"fwd": (y_ref, (x, w)), "dx": (dx_ref, (x, dy, w)), "dw": (dw_ref, (x, dy, w))}[direction]
  rtol = 2e-5 if dtype == jnp.float32 else 1.5e-2
  for name, route in routes:
    out = op._gpu_run(kernels, direction, route, precision=None, out_dtype=dtype)(*args)
    try:
      assert out.dtype == dtype
      _close(out, ref, rtol)
    except AssertionError as e:
      raise AssertionError(f"route {name}: {route}") from e


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_tuned_gpu_route_records_each_direction(interpreted, monkeypatch):
  # A CPU stands in for the GPU: the route measures its candidates (interpret mode, host timing) and caches them.
  monkeypatch.setattr(_measure, "_has_device", lambda platform: platform == "cuda")  # the CPU stands in for a GPU
  x, dy, w = _problem(40, (256, 128), (1, 2), jnp.float32, seed=3)

  def step(a, d, dy):
    y, vjp = jax.vjp(lambda a, d: jaxsparse.ops.block_sparse_matmul(a, w.with_data(d)), a, d)
    return y, *vjp(dy)

  with _tuning.autotune_mode("tune"):
    # Under jit the GPU route is traced too (lax.platform_dependent), and tunes; the CPU runs the XLA branch.
    y, dx, ddata = jax.jit(step)(x, w.data, dy)
  entries = json.loads(_cache.cache_path().read_text())["entries"]
  dirs = sorted(json.loads(k)["dir"] for k in entries)
  # "step": the forward's choice timed in the train step against its rivals of other route families (where any is
  # within 1.5x of it alone).
  assert dirs in (["dw", "dx", "fwd"], ["dw", "dx", "fwd", "step"])
  assert all(json.loads(k)["block"] == [256, 128] for k in entries)
  routes = lambda d: op._gpu_routes(kernels, d, x, w, precision=None, out_dtype=x.dtype)
  names = {n for d in ("fwd", "dx", "dw") for n, _ in routes(d)}
  by_dir = {json.loads(k)["dir"]: e for k, e in entries.items()}
  for d, e in by_dir.items():  # 40 rows: wide blocks as they are by default, but for dW
    assert e["choice"] in names
    assert e["default"] == {"dw": "split:default", "step": by_dir["fwd"]["choice"]}.get(d, "native:default")
  for out, ref in zip((y, dx, ddata), _reference(x, dy, w), strict=True):
    _close(out, ref, 2e-5)


def test_a_forward_on_the_dense_route_alone_takes_the_sub_blocks_of_its_backward_in_the_step(interpreted,
                                                                                                monkeypatch):
  """The forward of a train step is timed with its backward: a route sharing the backward's copy of the blocks into
  sub-blocks wins there though the dense route was faster alone (times made up; the routes really run)."""
  monkeypatch.setattr(_measure, "_has_device", lambda platform: platform == "cuda")  # the CPU stands in for a GPU
  x, dy, w = _problem(40, (256, 128), (1, 3), jnp.float32, seed=4)  # K = 256, N = 384

  def fake(cands, make_args, platform, dense):
    if cands[0].measure is not None:  # in the step: the sub-blocks share the backward's copy
      return {c.name: 90.0 if c.name.startswith("split:") else 150.0 for c in cands}
    direction = {(40, 256): "fwd", (40, 384): "dx", (256, 40): "dw"}[tuple(dense.lhs)]
    fastest = "dense" if direction == "fwd" else "split:default"
    return {c.name: 80.0 if c.name == fastest else 100.0 if c.name.startswith("split:") else 300.0 for c in cands}

  monkeypatch.setattr(_measure, "_measure", fake)

  def step(a, d, dy):
    y, vjp = jax.vjp(lambda a, d: jaxsparse.ops.block_sparse_matmul(a, w.with_data(d)), a, d)
    return y, *vjp(dy)

  with _tuning.autotune_mode("tune"):
    outs = jax.jit(step)(x, w.data, dy)
  entries = {json.loads(k)["dir"]: e for k, e in json.loads(_cache.cache_path().read_text())["entries"].items()}
  assert {d: e["choice"] for d, e in entries.items()} == {
      "fwd": "dense", "dx": "split:default", "dw": "split:default", "step": "split:default"}
  assert entries["step"]["candidates"] == ["dense", "split:default"]
  for out, ref in zip(outs, _reference(x, dy, w), strict=True):
    _close(out, ref, 2e-5)


@slow
def test_a_forward_chosen_in_its_train_step_differentiates_under_vmap_export_and_grad_of_grad(monkeypatch):
  """The CPU routes: ``dX`` and ``dW`` take the dense route, the forward the kernel alone and the dense route in the
  step (times made up; the routes really run). Each transform's step traces its own forward, chosen in the step."""
  def fake(cands, make_args, platform, dense):
    if cands[0].measure is not None:
      return {c.name: 100.0 if c.name == "dense" else 200.0 for c in cands}
    fwd = tuple(dense.rhs) == (64, 96)
    return {c.name: (120.0 if fwd else 80.0) if c.name == "dense" else 100.0 for c in cands}

  monkeypatch.setattr(_measure, "_measure", fake)
  rng = np.random.default_rng(5)
  w = jaxsparse.BlockSparseMatrix.from_dense(jnp.asarray(rng.standard_normal((64, 96)), jnp.float32), (16, 16))
  x = jnp.asarray(rng.standard_normal((3, 40, 64)), jnp.float32)
  loss = lambda x, d: jnp.sum(jaxsparse.ops.block_sparse_matmul(x, w.with_data(d)) ** 2)
  ref = lambda x, d: jnp.sum(jnp.matmul(x, w.with_data(d).to_dense(), precision="highest") ** 2)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1)))
  with _tuning.autotune_mode("tune"), warnings.catch_warnings():
    warnings.simplefilter("ignore", jaxsparse.SlowerThanDenseWarning)
    got = {
        "jit": grads(x, w.data),
        "vmap": jax.vmap(grads, in_axes=(0, None))(x, w.data),
        "export": jax.export.export(grads, disabled_checks=jaxsparse.ops.export_safety_checks())(x, w.data).call(
            x, w.data),
        "grad of grad": jax.grad(lambda x: jnp.sum(jax.grad(loss)(x, w.data) ** 2))(x),
    }
  want = {
      "jit": jax.grad(ref, argnums=(0, 1))(x, w.data),
      "vmap": jax.vmap(jax.grad(ref, argnums=(0, 1)), in_axes=(0, None))(x, w.data),
      "grad of grad": jax.grad(lambda x: jnp.sum(jax.grad(ref)(x, w.data) ** 2))(x),
  }
  want["export"] = want["jit"]
  for name, value in got.items():
    for a, b in zip(jax.tree.leaves(value), jax.tree.leaves(want[name]), strict=True):
      _close(a, b, 1e-4)
  entries = [json.loads(k) | e for k, e in json.loads(_cache.cache_path().read_text())["entries"].items()]
  steps = {e["rows"]: e["choice"] for e in entries if e["dir"] == "step"}
  assert steps and set(steps.values()) == {"dense"}, entries
  assert {e["rows"] for e in entries if e["dir"] == "fwd"} == set(steps)  # every forward traced in a step


def test_autotune_ahead_of_time_has_no_budget(monkeypatch):
  budgets = []
  monkeypatch.setattr(_measure, "_measure",
                      lambda c, m, p, dense=None: budgets.append(_cache.current_budget_s()) or {x.name: 1.0 for x in c})
  x, _, w = _problem(8, (16, 16), (2, 2), jnp.float32, seed=1)
  jaxsparse.autotune(lambda x: jaxsparse.ops.block_sparse_matmul(x, w), jax.ShapeDtypeStruct(x.shape, x.dtype))
  assert budgets and set(budgets) == {None}, budgets


class _StatefulModel(nnx.Module):
  """A block-sparse layer between layers that update their state when called (batch statistics, dropout's rngs)."""

  def __init__(self):
    self.sparse = jaxsparse.layers.BlockSparseLinear(32, 32, density=0.5, block_shape=(16, 16), rngs=nnx.Rngs(0))
    self.norm = nnx.BatchNorm(32, rngs=nnx.Rngs(0))
    self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(1))

  def __call__(self, x):
    return self.drop(self.norm(self.sparse(x)))


def test_autotune_of_a_module_with_state_updates_leaves_it_unchanged(monkeypatch):
  measured = []
  monkeypatch.setattr(_measure, "_measure", lambda c, m, p, dense=None: measured.append(p) or {x.name: 1.0 for x in c})
  model = _StatefulModel()
  plain = lambda a: np.asarray(jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a)
  before = jax.tree.map(plain, nnx.state(model))
  x = jnp.arange(8 * 32, dtype=jnp.float32).reshape(8, 32) / 100
  # Was: "Cannot mutate BatchStat from a different trace level" (the module was closed over by the jitted call).
  assert jaxsparse.autotune(model, x) == 1 and measured == ["cpu"]
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(plain, nnx.state(model)), before)
  # An abstract module (nnx.eval_shape) on abstract inputs tunes too: nothing but the measurements runs.
  abstract = nnx.eval_shape(lambda: jaxsparse.layers.BlockSparseLinear(64, 32, density=0.5, block_shape=(16, 16),
                                                                        rngs=nnx.Rngs(0)))
  assert jaxsparse.autotune(abstract, jax.ShapeDtypeStruct((8, 64), jnp.float32)) == 1
  with pytest.raises(TypeError, match="fn_or_model must be a function or an NNX module, got int"):
    jaxsparse.autotune(3, x)


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_autotune_ahead_of_time_then_a_second_process_only_reads(interpreted, monkeypatch, tmp_path):
  monkeypatch.setattr(_measure, "_has_device", lambda platform: platform == "cuda")  # the CPU stands in for a GPU
  x, _, w = _problem(24, (64, 64), (2, 2), jnp.float32, seed=5)

  def step(x):
    return jax.grad(lambda x: jaxsparse.ops.block_sparse_matmul(x, w).sum())(x)

  added = jaxsparse.autotune(step, jax.ShapeDtypeStruct(x.shape, x.dtype))
  dirs = sorted(json.loads(k)["dir"] for k in json.loads(_cache.cache_path().read_text())["entries"])
  assert dirs in (["dw", "dx", "fwd"], ["dw", "dx", "fwd", "step"])  # step: the forward timed in its train step
  assert added == len(dirs)
  assert jaxsparse.autotune(step, jax.ShapeDtypeStruct(x.shape, x.dtype)) == 0  # all cached now
  monkeypatch.setattr(_measure, "_measure", lambda *a: pytest.fail("measured again"))
  _cache.clear_memo()
  with _tuning.autotune_mode("tune"):
    jax.jit(step).lower(x)


@pytest.mark.parametrize("block_shape", [  # the C++ kernel's blocks, and the loop's only
    (16, 16),
    pytest.param((12, 8), marks=pytest.mark.slow),  # long: moved out of the fast set (make test <= 15 min); CI runs it
])
def test_cpu_routes_match_the_reference_and_tune_on_request(block_shape, monkeypatch):
  x, dy, w = _problem(24, block_shape, (4, 3), jnp.float32, seed=7)
  refs = dict(zip(("fwd", "dx", "dw"), _reference(x, dy, w), strict=True))
  for direction, ref in refs.items():
    args = (x, w) if direction == "fwd" else (x, dy, w)
    product = op._product(direction, args, jnp.float32, None)
    cpu = [b for b in op._backends(op._Config("auto", None, jnp.dtype(jnp.float32)), jnp.float32)
           if "cpu" in b.platforms and b.unsupported_reason(product) is None]
    routes = [(c.name, c.run) for b in cpu for c in b.candidates(product)]
    names = [name for name, _ in routes]
    assert names == (["cpu_kernel", "loop", "dense"] if block_shape == (16, 16) else ["loop", "dense"])
    for name, run in routes:
      try:
        _close(run(*args), ref, 2e-5)
      except AssertionError as e:
        raise AssertionError(f"{direction} on {name}") from e

  def step(a, d, dy):
    y, vjp = jax.vjp(lambda a, d: jaxsparse.ops.block_sparse_matmul(a, w.with_data(d)), a, d)
    return y, *vjp(dy)

  # "auto" on a CPU reads the cache and never measures; "tune" measures each direction once.
  with monkeypatch.context() as patch, _tuning.autotune_mode("auto"):
    patch.setattr(_measure, "_measure", lambda *a: pytest.fail("auto measured on a CPU"))
    jax.jit(step)(x, w.data, dy)
  assert not _cache.cache_path().exists()
  with _tuning.autotune_mode("tune"):
    outs = jax.jit(lambda *a: step(*a))(x, w.data, dy)  # a new function: traced again, in this mode
  entries = {json.loads(k)["dir"]: (json.loads(k), e) for k, e in json.loads(_cache.cache_path().read_text())[
      "entries"].items()}
  assert sorted(entries) in (["dw", "dx", "fwd"], ["dw", "dx", "fwd", "step"])  # step: see _router._choose_in_step
  assert all(k["device"] == "cpu" and e["choice"] in ("cpu_kernel", "loop", "dense") for k, e in entries.values())
  if "step" in entries:  # the forward's choice against its rivals, timed in the train step
    assert entries["step"][1]["default"] == entries["fwd"][1]["choice"]
  for out, ref in zip(outs, refs.values(), strict=True):
    _close(out, ref, 2e-5)


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_tune_command_tunes_shapes_and_exports(interpreted, monkeypatch, tmp_path, capsys):
  from jaxsparse.torch_interop._cli import main  # noqa: PLC0415 -- the `jaxsparse` console script

  monkeypatch.setattr(_measure, "_has_device", lambda platform: platform == "cuda")  # the CPU stands in for a GPU
  out = tmp_path / "shared.json"
  assert main(["tune", "128x64", "--patterns", "block:0.5:32x32", "--rows", "16", "--export", str(out)]) == 0
  printed = capsys.readouterr().out
  dirs = sorted(json.loads(k)["dir"] for k in json.loads(out.read_text())["entries"])
  assert dirs in (["dw", "dx", "fwd"], ["dw", "dx", "fwd", "step"])  # step: the forward timed in its train step
  assert f"128x64 block 32x32 50% kept, 16 rows: {len(dirs)} new decisions, 0 already cached" in printed, printed
  assert main(["tune", "128x64", "--patterns", "block:0.5:32x32", "--rows", "16", "--import", str(out)]) == 0
  assert f"16 rows: 0 new decisions, {len(dirs)} already cached" in capsys.readouterr().out
  # A pattern with no measured dispatch here (N:M on a CPU: one route) says so, not "0 new decisions".
  assert main(["tune", "128x64", "--patterns", "nm:2:4", "--rows", "16"]) == 0
  assert "16 rows: nothing to tune (no product of this pattern has measured dispatch on cpu)" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    (["tune", "64x64", "--rows", "8", "0"], "argument --rows: must be a positive int, got '0'"),
    (["tune", "64x64", "--dtype", "int8"], "argument --dtype: must be a floating dtype .* got 'int8'"),
    (["tune", "64x64", "--dtype", "float33"], "argument --dtype: must be a floating dtype .* got 'float33'"),
    (["bench", "64x64", "--batch", "-2"], "argument --batch: must be a positive int, got '-2'"),
    (["bench", "64x64", "--dtype", "int32"], "argument --dtype: must be a floating dtype .* got 'int32'"),
    # Sizes past int32 (past int64: an MLIR "get(): incompatible function arguments" after the first shape was tuned).
    (["tune", "64x64", "--rows", "99999999999999999999"], r"argument --rows: must be at most 2\*\*31 - 1, got '9+'"),
    (["tune", "64x64", "99999999999999999999x64"], r"shape '9+x64': both sizes must be at most 2\*\*31 - 1"),
    (["bench", "64x64", "--batch", str(2**31)], r"argument --batch: must be at most 2\*\*31 - 1, got '2147483648'"),
    # Was: an uncaught XLA "overflow in static extent product" (exit 134): each size fits, their product does not.
    (["tune", "2147483647x2147483647", "--patterns", "unstructured:0.5"],
     r"shape '2147483647x2147483647': its weight has 4611686014132420609 elements, more bytes than this machine's "
     r"memory \(\d+ bytes\) holds in any dtype"),
])
def test_cli_rejects_bad_rows_and_dtypes_before_any_work(args, message, monkeypatch, capsys):
  from jaxsparse.torch_interop._cli import main  # noqa: PLC0415 -- the `jaxsparse` console script

  # Was: rows checked after the earlier rows were tuned; --dtype int8 failed inside jax.random ("dtype argument to
  # `uniform` must be a float dtype").
  monkeypatch.setattr("jaxsparse._bench.tune", lambda *a, **k: pytest.fail("tuned"))
  monkeypatch.setattr("jaxsparse._bench.bench", lambda *a, **k: pytest.fail("timed"))
  with pytest.raises(SystemExit) as exit_:
    main(args)
  assert exit_.value.code == 2
  assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("command", [["tune", "65536x65536", "--rows", "8", str(2**31 - 1)],
                                     ["bench", "65536x65536", "--batch", str(2**31 - 1)]])
def test_cli_refuses_shapes_the_device_cannot_hold_before_any_work(command, monkeypatch, capsys):
  from jaxsparse.torch_interop._cli import main  # noqa: PLC0415 -- the `jaxsparse` console script

  # Was: the layers were built until XLA failed (RESOURCE_EXHAUSTED, a traceback) or aborted.
  monkeypatch.setattr("jaxsparse._bench.tune", lambda *a, **k: pytest.fail("tuned"))
  monkeypatch.setattr("jaxsparse._bench.bench", lambda *a, **k: pytest.fail("timed"))
  assert main(command) == 1
  err = capsys.readouterr().err
  assert re.fullmatch(r"jaxsparse: error: shape 65536x65536 with 2147483647 rows of float32: the weight, input and "
                      r"output alone take 1125917086187520 bytes, more than .* \(\d+ bytes\)\. Choose smaller shapes, "
                      r"fewer rows or a narrower --dtype\.\n", err), err


@pytest.mark.parametrize("command", [["tune", "64x64"], ["bench", "64x64"]])
def test_cli_runtime_errors_are_one_line_messages(command, monkeypatch, capsys):
  from jaxsparse.torch_interop._cli import main  # noqa: PLC0415 -- the `jaxsparse` console script

  # Was: the JaxRuntimeError's traceback (e.g. `tune 65536x65536` under a memory limit).
  def oom(*a, **k):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 17179869184 bytes.\nmore detail")

  monkeypatch.setattr("jaxsparse._bench.tune", oom)
  monkeypatch.setattr("jaxsparse._bench.bench", oom)
  assert main(command) == 1
  want = ("jaxsparse: error: RESOURCE_EXHAUSTED: Out of memory allocating 17179869184 bytes. (out of memory: choose "
          "smaller shapes, fewer rows or a narrower --dtype)\n")
  assert capsys.readouterr().err == want  # one line


def test_tune_checks_every_shape_and_pattern_before_tuning_any(monkeypatch, tmp_path, capsys):
  from jaxsparse import _bench  # noqa: PLC0415
  from jaxsparse.torch_interop._cli import main  # noqa: PLC0415 -- the `jaxsparse` console script

  # Was: the shapes were checked one at a time, so 64x64 was tuned (and cached) before 60x64 failed; nothing was
  # printed of that work, and --export was never reached.
  monkeypatch.setattr(_bench, "autotune", lambda *a, **k: pytest.fail("tuned"))
  out = tmp_path / "out.json"
  assert main(["tune", "64x64", "60x64", "--patterns", "block:0.5:16x16", "--rows", "8", "--export", str(out)]) == 1
  assert ("shape 60x64, pattern block 16x16 50% kept: block_shape=(16, 16) does not divide"
          in capsys.readouterr().err)
  with pytest.raises(ValueError, match=r"rows must be a positive int, got 0"):
    _bench.tune([(64, 64)], [jaxsparse.NM(2, 4)], rows=(8, 0))
  with pytest.raises(ValueError, match=r"N:M sparsity 2:4 needs m=4 to divide the input size 6"):
    _bench.tune([(64, 64), (6, 64)], [jaxsparse.NM(2, 4)], rows=(8,))


def test_cli_tune_export_errors_are_messages_not_tracebacks(monkeypatch, tmp_path, capsys):
  from jaxsparse.torch_interop._cli import main  # noqa: PLC0415 -- the `jaxsparse` console script

  calls = []
  monkeypatch.setattr("jaxsparse._bench.tune", lambda *a, **k: calls.append(1) or [((64, 64), "block", 8, 0, 0)])
  _cache.record("k", {"choice": "a"})
  config = tmp_path / "config.json"
  config.write_text('{"lr": 0.1}')
  # A file that is not a tuning cache, or a directory: refused before tuning (was: the file silently replaced, and
  # for a directory a traceback after the tuning).
  for target, why in ((config, "exists and is not a jaxsparse tuning cache"), (tmp_path, "is a directory")):
    assert main(["tune", "64x64", "--export", str(target)]) == 1
    assert why in capsys.readouterr().err and not calls
  assert config.read_text() == '{"lr": 0.1}'
  (tmp_path / "file").write_text("")
  assert main(["tune", "64x64", "--export", str(tmp_path / "file" / "sub" / "out.json")]) == 1  # was: OSError raised
  assert capsys.readouterr().err.startswith("jaxsparse: error: ") and calls == [1]
  assert main(["tune", "64x64", "--export", str(tmp_path / "out.json")]) == 0
  assert "exported 1 decisions" in capsys.readouterr().out


# -------------------------------------------------------------------------------------------------
# GPU (benchmarks/run_gpu.sh).
# -------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable_reason())
@pytest.mark.parametrize(("m", "k", "n", "block_shape", "dtype", "density"), [
    (2048, 4096, 512, (256, 128), jnp.bfloat16, 0.25),
    (1000, 1536, 2048, (16, 16), jnp.float32, 0.53),
    (4, 2048, 512, (32, 32), jnp.float32, 0.3),
    (1, 8192, 1024, (64, 64), jnp.bfloat16, 0.2),
    (4096, 1024, 2048, (32, 64), jnp.float16, 0.4),
    (384, 2048, 6144, (128, 256), jnp.bfloat16, 0.5),
])
def test_gpu_tuning_picks_a_runnable_route(m, k, n, block_shape, dtype, density):
  rng = np.random.default_rng(m)
  grid = (k // block_shape[0], n // block_shape[1])
  mask = rng.random(grid) < density
  w = jaxsparse.BlockSparseMatrix.from_dense(jnp.asarray(rng.standard_normal((k, n), np.float32), dtype),
                                             block_shape, block_mask=mask)
  x = jnp.asarray(rng.standard_normal((m, k), np.float32), dtype)
  dy = jnp.asarray(rng.standard_normal((m, n), np.float32), dtype)
  with _tuning.autotune_mode("tune"):
    y, vjp = jax.vjp(lambda a, d: jaxsparse.ops.block_sparse_matmul(a, w.with_data(d)), x, w.data)
    dx, ddata = vjp(dy)
  entries = {json.loads(key)["dir"]: e for key, e in json.loads(_cache.cache_path().read_text())["entries"].items()}
  assert sorted(entries) in (["dw", "dx", "fwd"], ["dw", "dx", "fwd", "step"])  # step: see _router._choose_in_step
  if "step" in entries:  # timed again in the step: the forward's choice and a route sharing the backward's work
    assert entries["step"]["default"] == entries["fwd"]["choice"] and len(entries["step"]["candidates"]) >= 2
  rtol = 1e-3 if dtype == jnp.float32 else 1.5e-2
  for out, ref in zip((y, dx, ddata), _reference(x, dy, w), strict=True):
    _close(out, ref, rtol)


def test_cli_tune_into_an_unwritable_cache_fails(monkeypatch, tmp_path, capsys):
  """``jaxsparse tune`` with a cache it cannot write exited 0 after a warning, having saved nothing: filling the cache
  is its purpose. It now fails naming the cache, unless --export wrote the decisions elsewhere; the library call
  (``jaxsparse.autotune``, a measured trace) still only warns and keeps the decision for the process."""
  from jaxsparse.torch_interop._cli import main  # noqa: PLC0415 -- the `jaxsparse` console script

  (tmp_path / "file").write_text("")
  unwritable = tmp_path / "file" / "sub" / "autotune.json"
  monkeypatch.setenv(_cache.ENV_PATH, str(unwritable))
  _cache.clear_memo()

  monkeypatch.setattr("jaxsparse._bench.tune", _tune_one_decision)
  with pytest.warns(_tuning.AutotuneCacheWarning, match="cannot write"):
    assert main(["tune", "64x64"]) == 1
  err = capsys.readouterr().err
  assert err.startswith(f"jaxsparse: error: cannot write the tuning cache {unwritable} (") and (
      "1 decisions were not saved and are lost when this command exits. Make " in err), err
  _cache.clear_memo()
  out = tmp_path / "out.json"
  with pytest.warns(_tuning.AutotuneCacheWarning, match="cannot write"):
    assert main(["tune", "64x64", "--export", str(out)]) == 0  # saved elsewhere
  assert f"the tuning cache {unwritable} could not be written: 1 decisions are in {out} only" in capsys.readouterr().out
  assert json.loads(out.read_text())["entries"] == {"k": {"choice": "a"}}
  # Importing into the unwritable cache saves nothing either.
  _cache.clear_memo()
  with pytest.warns(_tuning.AutotuneCacheWarning, match="imported decisions are kept for this process"):
    assert main(["tune", "64x64", "--import", str(out)]) == 1
  assert "jaxsparse: error: cannot write the tuning cache" in capsys.readouterr().err
  # A writable cache: as before.
  monkeypatch.setenv(_cache.ENV_PATH, str(tmp_path / "autotune.json"))
  _cache.clear_memo()
  assert main(["tune", "64x64"]) == 0 and _cache.unsaved_decisions() == {}
  assert json.loads((tmp_path / "autotune.json").read_text())["entries"] == {"k": {"choice": "a"}}


def test_exporting_a_tuning_cache_under_a_file_names_it(tmp_path):
  blocker = tmp_path / "cache.json"
  blocker.write_text("{}")
  with pytest.raises(NotADirectoryError, match=f"{re.escape(str(blocker))} is a file, not a folder"):
    jaxsparse.export_tuning_cache(blocker / "sub.json")
