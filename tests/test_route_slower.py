"""``jaxsparse.route_slower_to_dense``: sparse linear layers measured slower than their dense twin become it.

The routing decisions run with injected timers (a CPU cannot say which kernel a GPU would prefer); one test times
for real on the CPU. The outputs must not change, whichever layers go dense.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsparse
from jaxsparse._sparsify import _report
from jaxsparse._sparsify import _route
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import CompressedNMLinear
from jaxsparse.layers import MaskedLinear


class _Net(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.blocks = nnx.Linear(64, 64, rngs=rngs)
    self.nm = nnx.Linear(64, 64, rngs=rngs)
    self.nm2 = nnx.Linear(64, 64, rngs=rngs)
    self.masked = nnx.Linear(64, 32, rngs=rngs)

  def __call__(self, x):
    x = jax.nn.relu(self.blocks(x))
    x = jax.nn.relu(self.nm2(jax.nn.relu(self.nm(x))))
    return self.masked(x)


def _sparse_net(seed: int = 0) -> nnx.Module:
  rules = {"blocks": jaxsparse.BlockSparse(density=0.5, block_shape=(16, 16)), "nm.*": jaxsparse.NM(2, 4),
           "masked": jaxsparse.Unstructured(sparsity=0.5)}
  net, _ = jaxsparse.sparsify(_Net(nnx.Rngs(seed)), rules)
  net.nm = net.nm.to_compressed(cusparselt_copy=False)
  net.nm2 = net.nm2.to_compressed(cusparselt_copy=False)
  return net


def _timer(slow: dict[type, float], calls: list | None = None):
  """Dense layers take 1 ms; a sparse layer of a class in ``slow`` that many ms, the others 0.5."""

  def timer(layer, x):
    if calls is not None:
      calls.append((type(layer).__name__, x.shape))
    if type(layer) is nnx.Linear:
      return 1.0
    return slow.get(type(layer), 0.5)

  return timer


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_slower_signatures_go_dense_and_the_outputs_do_not_change():
  net = _sparse_net()
  x = jax.random.normal(jax.random.key(1), (4, 64))
  before = net(x)
  calls = []
  timings = jaxsparse.route_slower_to_dense(net, (1, 8), timer=_timer({CompressedNMLinear: 1.5}, calls))
  assert [type(m).__name__ for m in (net.blocks, net.nm, net.nm2, net.masked)] == [
      "BlockSparseLinear", "Linear", "Linear", "MaskedLinear"]
  np.testing.assert_allclose(net(x), before, rtol=1e-5, atol=1e-5)
  by_layer = {t.signature.layer: t for t in timings}
  assert set(by_layer) == {"BlockSparseLinear", "CompressedNMLinear", "MaskedLinear"}
  nm = by_layer["CompressedNMLinear"]
  assert nm.dense and nm.paths == ("nm", "nm2") and nm.ratio == 1.5 and set(nm.sparse_ms) == {1, 8}
  assert not by_layer["BlockSparseLinear"].dense and by_layer["BlockSparseLinear"].ratio == 0.5
  assert str(nm.signature) == "CompressedNMLinear 64x64 2:4 50% kept float32"
  # One sparse layer per signature and batch; the dense twins of equal shape and dtype once per batch (64 x 64 for
  # the blocks and the 2:4 layers, 64 x 32 for the masked one).
  sparse_calls = [c for c in calls if c[0] != "Linear"]
  dense_calls = [c for c in calls if c[0] == "Linear"]
  assert len(sparse_calls) == 3 * 2 and len(dense_calls) == 2 * 2
  assert sorted({shape for _, shape in calls}) == [(1, 64), (8, 64)]


def _step_timer(cost: dict[str, float], calls: list):
  """A model's step: the sum over its four layers of ``cost[class name]`` (``"Linear"`` for the dense twins)."""

  def step(model):
    kinds = tuple(type(m).__name__ for m in (model.blocks, model.nm, model.nm2, model.masked))
    calls.append(kinds)
    return sum(cost[k] for k in kinds)

  return step


def test_the_step_settles_the_signatures_near_their_twins():
  net = _sparse_net()
  x = jax.random.normal(jax.random.key(1), (4, 64))
  before = net(x)
  # Alone: the 2:4 layers 1.05 of dense (routed dense), the block-sparse one 0.9 (kept sparse), the masked one 2.0
  # (routed dense, outside the band). In the step, 2:4 is faster than dense and block-sparse slower.
  layer_ms = {CompressedNMLinear: 1.05, BlockSparseLinear: 0.9, MaskedLinear: 2.0}
  cost = {"CompressedNMLinear": 0.8, "BlockSparseLinear": 1.2, "MaskedLinear": 1.1, "Linear": 1.0}
  calls = []
  timings = jaxsparse.route_slower_to_dense(net, 8, timer=_timer(layer_ms), step_timer=_step_timer(cost, calls))
  assert [type(m).__name__ for m in (net.blocks, net.nm, net.nm2, net.masked)] == [
      "Linear", "CompressedNMLinear", "CompressedNMLinear", "Linear"]
  np.testing.assert_allclose(net(x), before, rtol=1e-5, atol=1e-5)
  by_layer = {t.signature.layer: t for t in timings}
  # Closest to 1 first (2:4 at 1.05, then the blocks at 0.9): one step before, one per settled signature.
  assert calls == [("BlockSparseLinear", "Linear", "Linear", "Linear"),
                   ("BlockSparseLinear", "CompressedNMLinear", "CompressedNMLinear", "Linear"),
                   ("Linear", "CompressedNMLinear", "CompressedNMLinear", "Linear")]
  assert by_layer["CompressedNMLinear"].step_ms == {"dense": 4.2, "sparse": pytest.approx(3.8)}
  assert not by_layer["CompressedNMLinear"].dense
  assert by_layer["BlockSparseLinear"].dense
  assert by_layer["BlockSparseLinear"].step_ms == {"sparse": pytest.approx(3.8), "dense": pytest.approx(3.6)}
  assert by_layer["MaskedLinear"].dense and by_layer["MaskedLinear"].step_ms is None


@pytest.mark.parametrize("bad", [float("nan"), -1.0, 0.0, "fast", None])
def test_a_failing_step_timer_leaves_the_layer_routing(bad):
  net = _sparse_net()
  layer_ms = {CompressedNMLinear: 1.05, BlockSparseLinear: 0.9, MaskedLinear: 2.0}
  kinds = lambda: [type(m).__name__ for m in (net.blocks, net.nm, net.nm2, net.masked)]
  calls = []

  def step(model):  # fine once, then a bad value on the first flip
    calls.append(kinds())
    return 4.0 if len(calls) == 1 else bad

  with pytest.raises(ValueError, match=f"step_timer returned {re.escape(repr(bad))}; it must return the step's time"):
    jaxsparse.route_slower_to_dense(net, 8, timer=_timer(layer_ms), step_timer=step)
  assert calls[1] != calls[0]  # the flip was in place when it failed
  assert kinds() == ["BlockSparseLinear", "Linear", "Linear", "Linear"]  # as the layers alone routed it

  def boom(model):
    raise RuntimeError("out of memory")

  net = _sparse_net()
  with pytest.raises(RuntimeError, match="out of memory"):
    jaxsparse.route_slower_to_dense(net, 8, timer=_timer(layer_ms), step_timer=boom)
  assert kinds() == ["BlockSparseLinear", "Linear", "Linear", "Linear"]


@pytest.mark.parametrize(("sparse_step", "dense"), [(1.08, False), (1.16, True)])  # steps of 1.02 / 1.04 of 4.0
def test_the_step_keeps_a_signature_sparse_within_the_margin(sparse_step, dense):
  net = _sparse_net()
  layer_ms = {CompressedNMLinear: 3.0, BlockSparseLinear: 3.0, MaskedLinear: 1.1}  # only the masked one in the band
  cost = {"CompressedNMLinear": 1.0, "BlockSparseLinear": 1.0, "MaskedLinear": sparse_step, "Linear": 1.0}
  calls = []
  jaxsparse.route_slower_to_dense(net, 8, timer=_timer(layer_ms), step_timer=_step_timer(cost, calls))
  assert isinstance(net.masked, nnx.Linear if dense else MaskedLinear) and len(calls) == 2
  # Nothing near its twin: the step is not timed.
  calls.clear()
  net = _sparse_net()
  jaxsparse.route_slower_to_dense(net, 8, timer=_timer(layer_ms), step_timer=_step_timer(cost, calls), step_band=0.05)
  assert calls == [] and isinstance(net.masked, nnx.Linear)


def test_signatures_within_the_margin_alone_but_not_together_go_dense():
  """Each signature costs the step 2-2.9% sparse (within the 3% margin), all three together 7.5%: the costliest first go
  dense until the step is within 3% of the one with all three dense (1.1B shape at batch 32, H200: 0.92x)."""
  net = _sparse_net()
  layer_ms = {CompressedNMLinear: 1.01, BlockSparseLinear: 1.02, MaskedLinear: 1.0}  # all in the band, none routed
  cost = {"CompressedNMLinear": 1.04, "BlockSparseLinear": 1.1, "MaskedLinear": 1.12, "Linear": 1.0}
  calls = []
  timings = jaxsparse.route_slower_to_dense(net, 8, timer=_timer(layer_ms), step_timer=_step_timer(cost, calls))
  kinds = [type(m).__name__ for m in (net.blocks, net.nm, net.nm2, net.masked)]
  assert kinds == ["Linear", "CompressedNMLinear", "CompressedNMLinear", "Linear"], kinds
  # One step, one per signature (all kept), the floor (all dense), then the masked (+0.12) and the block-sparse (+0.1)
  # signatures re-routed: 4.30 -> 4.18 -> 4.08 <= 4.0 * 1.03; the 2:4 one (+0.08) stays.
  assert len(calls) == 1 + 3 + 1 + 2 and calls[4] == ("Linear",) * 4
  by_layer = {t.signature.layer: t for t in timings}
  assert by_layer["BlockSparseLinear"].dense and by_layer["MaskedLinear"].dense
  assert not by_layer["CompressedNMLinear"].dense and by_layer["CompressedNMLinear"].step_ms is not None


@pytest.mark.parametrize(("sparse_ms", "dense"), [(1.02, False), (1.04, True)])
def test_the_margin(sparse_ms, dense):
  net = _sparse_net()
  (timing,) = [t for t in jaxsparse.route_slower_to_dense(net, 8, timer=_timer({MaskedLinear: sparse_ms}))
               if t.signature.layer == "MaskedLinear"]
  assert timing.dense is dense and isinstance(net.masked, nnx.Linear if dense else MaskedLinear)
  # A wider margin keeps it.
  net = _sparse_net()
  jaxsparse.route_slower_to_dense(net, 8, timer=_timer({MaskedLinear: sparse_ms}), margin=0.1)
  assert isinstance(net.masked, MaskedLinear)


def test_slower_at_one_batch_is_enough():
  net = _sparse_net()
  timer = lambda layer, x: 1.0 if type(layer) is nnx.Linear else (2.0 if x.shape[0] == 32 else 0.5)
  timings = jaxsparse.route_slower_to_dense(net, (1, 32), timer=timer)
  assert all(t.dense and t.ratio == 2.0 for t in timings)
  assert all(type(m) is nnx.Linear for m in (net.blocks, net.nm, net.nm2, net.masked))


@pytest.mark.parametrize("storage", ["cusparselt", "values"])
def test_timed_layers_read_every_array_as_an_argument(monkeypatch, storage):
  # An array closed over as a constant is one buffer that every timed copy of the call reads: warm in a GPU's L2
  # cache. A 2:4 layer kept as cuSPARSELt's buffer (no nnx.Param) timed 8.4 us that way at 1 x 4096 x 6144 on an
  # H100 against 13.1 us in a chain of layers, and route_slower_to_dense kept it sparse where it was slower.
  calls = []

  def fake_time_call_ms(f, args, platform):
    calls.append(args)
    jax.block_until_ready(jax.jit(f)(*args))  # the call runs as timed
    return 1.0

  monkeypatch.setattr(_report, "time_call_ms", fake_time_call_ms)
  lin = jaxsparse.layers.NMLinear(64, 128, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  layer = lin.to_compressed(storage=storage, cusparselt_copy=False)
  arrays = jax.tree.leaves(nnx.state(layer))
  assert len(arrays) == (2 if storage == "cusparselt" else 3)  # the bias; the buffer or the values and positions
  x = jnp.ones((2, 64), jnp.bfloat16)
  assert _route.time_forward_ms(layer, x) == 1.0
  assert _report.time_nnx_layer(layer, x, "train") == 1.0
  assert len(calls) == 2
  for args in calls:
    passed = {id(a) for a in jax.tree.leaves(args)}
    assert all(id(a) in passed for a in arrays)


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_measured_on_this_device_and_jittable_after():
  net = _sparse_net()
  x = jnp.ones((2, 64))
  before = net(x)
  timings = jaxsparse.route_slower_to_dense(net, 2)
  assert len(timings) == 3 and all(t.sparse_ms[2] > 0 and t.dense_ms[2] > 0 for t in timings)
  np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(net, x), before, rtol=1e-5, atol=1e-5)
  assert _route.time_forward_ms(net.blocks, x) > 0


def test_layer_signature():
  net = _sparse_net()
  assert jaxsparse.layer_signature(net.blocks) == jaxsparse.LayerSignature(
      "BlockSparseLinear", (64, 64), "block 16x16", 0.5, "float32", "float32", True)
  assert jaxsparse.layer_signature(net.masked).pattern == "unstructured"
  assert isinstance(net.blocks, BlockSparseLinear)
  with pytest.raises(TypeError, match=r"layer must be one of .*, got Linear"):
    jaxsparse.layer_signature(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))


def test_nnx_and_linen_nm_layers_of_one_mask_have_one_signature():
  """layer_signature said n/m for an N:M layer whatever its mask kept, the Linen signature counted the kept weights:
  a 1:4 mask under a 2:4 rule gave the twins two densities. Now both count (dense and compressed alike)."""
  kernel = np.asarray(jax.random.normal(jax.random.key(0), (64, 32)))
  mask = np.zeros((64, 32), bool)
  mask[::4] = True  # 1 of every 4 input features
  rules, masks = {"fc": jaxsparse.NM(2, 4)}, {"fc.kernel": mask}

  class Net(nnx.Module):
    def __init__(self):
      self.fc = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
      self.fc.kernel[...] = kernel

  class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(32, name="fc")(x)

  x = jnp.ones((2, 64))
  variables = {"params": {"fc": {"kernel": kernel, "bias": np.zeros(32, np.float32)}}}
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(LinenNet(), variables, rules, x, masks=masks)
  timings = jaxsparse.route_slower_to_dense_linen(sparse, sparse_vars, batches=1, timer=lambda *a: 1.0)[2]
  linen_sig = timings[0].signature
  nnx_sig = jaxsparse.layer_signature(jaxsparse.sparsify(Net(), rules, masks=masks)[0].fc)
  assert nnx_sig.density == linen_sig.density == 0.25
  assert nnx_sig == linen_sig  # one name too: NMDense's signature says NMLinear
  compressed = jaxsparse.layer_signature(jaxsparse.sparsify(Net(), rules, masks=masks)[0].fc.to_compressed())
  assert compressed.density == 0.25


@pytest.mark.slow  # ~5.5 s alone on CPU (sparsify, compress both ways); the 2:4 pair is in the test above
def test_nnx_and_linen_layers_of_one_product_have_one_signature():
  """A signature named the layer's class, NNX NMLinear against Linen NMDense (BlockSparseLinear / BlockSparseDense,
  MaskedLinear / MaskedDense, CompressedNMLinear / CompressedNMDense) for one product: timings keyed by it did not
  carry over between NNX and Linen. The Linen signature now names the NNX twin; the other fields were equal."""
  rules = {"blocks": jaxsparse.BlockSparse(density=0.5, block_shape=(16, 16)), "nm": jaxsparse.NM(2, 4),
           "masked": jaxsparse.Unstructured(sparsity=0.5), "general": jaxsparse.NM(2, 4)}

  class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(64, name="blocks")(x)
      x = nn.Dense(32, name="nm")(x)
      x = nn.Dense(32, name="masked")(x)
      return nn.DenseGeneral((2, 16), name="general")(x)  # an attention projection: (32,) -> (2 heads, 16)

  x = jnp.ones((2, 64))
  variables = LinenNet().init(jax.random.key(0), x)

  class Net(nnx.Module):  # the same dense layers and weights
    def __init__(self):
      self.blocks, self.nm = nnx.Linear(64, 64, rngs=nnx.Rngs(0)), nnx.Linear(64, 32, rngs=nnx.Rngs(0))
      self.masked = nnx.Linear(32, 32, rngs=nnx.Rngs(0))
      self.general = nnx.LinearGeneral(32, (2, 16), rngs=nnx.Rngs(0))
      for name, weights in variables["params"].items():
        for var, value in weights.items():
          getattr(getattr(self, name), var).set_value(value)

  def linen_signatures(sparse, sparse_vars):
    timings = jaxsparse.route_slower_to_dense_linen(sparse, sparse_vars, 1, timer=lambda *_: 1.0)[2]
    return {path: t.signature for t in timings for path in t.paths}

  def nnx_signatures(net):
    layers = {"blocks": net.blocks, "nm": net.nm, "masked": net.masked, "general": net.general.layer}
    return {path: jaxsparse.layer_signature(layer) for path, layer in layers.items()}

  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(LinenNet(), variables, rules, x)
  net, _ = jaxsparse.sparsify(Net(), rules)
  got, want = linen_signatures(sparse, sparse_vars), nnx_signatures(net)
  assert got == want
  assert [want[p].layer for p in rules] == ["BlockSparseLinear", "NMLinear", "MaskedLinear", "NMLinear"]
  got = linen_signatures(*jaxsparse.compress_linen(sparse, sparse_vars))
  want = nnx_signatures(jaxsparse.compress(net))
  assert got == want and {want["nm"].layer, want["general"].layer} == {"CompressedNMLinear"}


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"batches": 0}, ValueError, r"batches must be positive ints, got \(0,\)"),
    ({"batches": ()}, ValueError, r"batches must be positive ints, got \(\)"),
    ({"batches": (True,)}, ValueError, "batches must be positive ints"),
    ({"batches": ("8",)}, ValueError, "batches must be positive ints"),
    ({"batches": 8, "margin": -0.1}, ValueError, r"margin must be a fraction in \[0, 1\), got margin=-0.1"),
    ({"batches": 8, "margin": 1.0}, ValueError, "margin=1.0"),
    ({"batches": 8, "step_timer": 3.0}, TypeError, "step_timer must be a callable returning milliseconds.*got float"),
    ({"batches": 8, "step_band": 1.5}, ValueError, r"step_band must be a fraction in \[0, 1\), got step_band=1.5"),
])
def test_bad_arguments_are_named(kwargs, error, match):
  with pytest.raises(error, match=match):
    jaxsparse.route_slower_to_dense(_sparse_net(), **kwargs, timer=_timer({}))


def test_bad_models_are_named():
  with pytest.raises(TypeError, match=r"model must be a flax\.nnx\.Module, got dict"):
    jaxsparse.route_slower_to_dense({}, 8)
  layer = _sparse_net().masked
  with pytest.raises(TypeError, match="model is itself a MaskedLinear, which cannot be replaced in place"):
    jaxsparse.route_slower_to_dense(layer, 8, timer=_timer({}))
  # A model without sparse layers: nothing to time, nothing changes.
  dense = _Net(nnx.Rngs(0))
  assert jaxsparse.route_slower_to_dense(dense, 8, timer=_timer({})) == ()


# -------------------------------------------------------------------------------------------------
# Linen: route_slower_to_dense_linen on a sparsify_linen model.
# -------------------------------------------------------------------------------------------------


class _LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(64, name="blocks")(x))
    x = nn.relu(nn.Dense(64, name="nm")(x))
    x = nn.relu(nn.Dense(64, name="nm2")(x))
    x = nn.DenseGeneral((2, 16), name="heads")(x)  # (64,) -> (2, 16): a 2-D layer on flattened features
    return nn.Dense(32, name="masked")(x.reshape(*x.shape[:-2], 32))


def _sparse_linen(seed: int = 0):
  x = jax.random.normal(jax.random.key(seed + 1), (4, 64))
  model = _LinenNet()
  variables = model.init(jax.random.key(seed), x)
  rules = {"blocks": jaxsparse.BlockSparse(density=0.5, block_shape=(16, 16)), "nm.*": jaxsparse.NM(2, 4),
           "heads": jaxsparse.NM(2, 4), "masked": jaxsparse.Unstructured(sparsity=0.5)}
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, rules, x)
  return sparse, sparse_vars, x


def _linen_timer(slow: dict[str, float], calls: list | None = None):
  """Dense layers (``nn.Dense`` / ``nn.DenseGeneral``) take 1 ms; a sparse layer whose class name is in ``slow`` that
  many ms, the others 0.5."""

  def timer(module, variables, x):
    if calls is not None:
      calls.append((type(module).__name__, x.shape))
    if type(module) in (nn.Dense, nn.DenseGeneral):
      return 1.0
    return slow.get(type(module).__name__, 0.5)

  return timer


def test_linen_slower_signatures_go_dense_and_the_outputs_do_not_change():
  sparse, sparse_vars, x = _sparse_linen()
  before = sparse.apply(sparse_vars, x)
  calls = []
  new, new_vars, timings = jaxsparse.route_slower_to_dense_linen(sparse, sparse_vars, (1, 8),
                                                                 timer=_linen_timer({"MaskedDense": 2.0}, calls))
  assert sorted(".".join(p) for p in new.layers) == ["blocks", "heads", "nm", "nm2"]
  assert new_vars["params"]["masked"]["kernel"].shape == (32, 32) and "masked" not in new_vars["sparsity"]
  np.testing.assert_allclose(new.apply(new_vars, x), before, rtol=1e-5, atol=1e-5)
  by_layer = {(t.signature.layer, t.signature.shape): t for t in timings}  # named as the NNX twins' signatures
  assert set(by_layer) == {("BlockSparseLinear", (64, 64)), ("NMLinear", (64, 64)), ("NMLinear", (64, 32)),
                           ("MaskedLinear", (32, 32))}
  assert by_layer["NMLinear", (64, 64)].paths == ("nm", "nm2") and not by_layer["NMLinear", (64, 64)].dense
  assert by_layer["MaskedLinear", (32, 32)].dense and by_layer["MaskedLinear", (32, 32)].ratio == 2.0
  blocks = by_layer["BlockSparseLinear", (64, 64)].signature
  assert str(blocks) == "BlockSparseLinear 64x64 block 16x16 50% kept float32"
  # One layer per signature and batch, each with its dense twin; the DenseGeneral's sparse layer on (batch, K).
  assert len(calls) == 4 * 2 * 2 and ("NMDense", (8, 64)) in calls and ("DenseGeneral", (8, 64)) in calls
  # The input variables are unchanged, and the plan of the original model too.
  assert "masked" in sparse_vars["sparsity"] and len(sparse.layers) == 5


def test_linen_step_settles_the_signatures_near_their_twins():
  sparse, sparse_vars, x = _sparse_linen()
  before = sparse.apply(sparse_vars, x)
  calls = []

  def step_timer(model, variables):  # the 2:4 layers nm / nm2 are faster sparse in the step, 1.0 against 2.0
    sparse_paths = {".".join(p) for p in model.layers}
    calls.append(sorted(sparse_paths))
    assert set(variables["params"]) == {"blocks", "nm", "nm2", "heads", "masked"}
    return sum(1.0 if p in sparse_paths else 2.0 for p in ("nm", "nm2")) + 10.0

  new, new_vars, timings = jaxsparse.route_slower_to_dense_linen(
      sparse, sparse_vars, 8, timer=_linen_timer({"NMDense": 1.05, "MaskedDense": 2.0}), step_timer=step_timer)
  by_layer = {(t.signature.layer, t.signature.shape): t for t in timings}
  # Alone, both 2:4 signatures (1.05) went dense; the step keeps nm / nm2 sparse, and the heads (no different in
  # the step) sparse within the margin. The masked layer (2.0) is outside the band.
  assert by_layer["NMLinear", (64, 64)].step_ms == {"dense": 14.0, "sparse": 12.0}
  assert not by_layer["NMLinear", (64, 64)].dense and not by_layer["NMLinear", (64, 32)].dense
  assert by_layer["MaskedLinear", (32, 32)].dense and by_layer["MaskedLinear", (32, 32)].step_ms is None
  # Three step timings and the check of the two kept together against both dense (within the margin: no change).
  assert sorted(".".join(p) for p in new.layers) == ["blocks", "heads", "nm", "nm2"] and len(calls) == 4
  np.testing.assert_allclose(new.apply(new_vars, x), before, rtol=1e-5, atol=1e-5)
  assert len(sparse.layers) == 5 and "masked" in sparse_vars["sparsity"]  # the inputs as they were


def test_linen_all_slower_is_densify_linen():
  sparse, sparse_vars, x = _sparse_linen()
  slow = {"BlockSparseDense": 1.5, "NMDense": 1.5, "MaskedDense": 1.5}
  new, new_vars, timings = jaxsparse.route_slower_to_dense_linen(sparse, sparse_vars, 8, timer=_linen_timer(slow))
  assert not new.layers and all(t.dense for t in timings) and "sparsity" not in new_vars
  module, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  jax.tree.map(np.testing.assert_array_equal, new_vars, dense_vars)
  np.testing.assert_allclose(module.apply(new_vars, x), sparse.apply(sparse_vars, x), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_linen_measured_on_this_device():
  sparse, sparse_vars, x = _sparse_linen()
  new, new_vars, timings = jaxsparse.route_slower_to_dense_linen(sparse, sparse_vars, 2)
  assert len(timings) == 4 and all(t.sparse_ms[2] > 0 and t.dense_ms[2] > 0 for t in timings)
  np.testing.assert_allclose(jax.jit(new.apply)(new_vars, x), sparse.apply(sparse_vars, x), rtol=1e-5, atol=1e-5)


def test_linen_bad_arguments_are_named():
  sparse, sparse_vars, _ = _sparse_linen()
  with pytest.raises(TypeError, match="sparse must be the SparsifiedLinen that sparsify_linen returned, got Dense"):
    jaxsparse.route_slower_to_dense_linen(nn.Dense(4), sparse_vars, 8)
  with pytest.raises(ValueError, match=r"batches must be positive ints, got \(-1,\)"):
    jaxsparse.route_slower_to_dense_linen(sparse, sparse_vars, -1)
  with pytest.raises(ValueError, match="margin=2"):
    jaxsparse.route_slower_to_dense_linen(sparse, sparse_vars, 8, margin=2)


# -------------------------------------------------------------------------------------------------
# Bug bash: batches, timer values, failures, SparseLinearGeneral, tied layers, the band's edge.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("batches", "want"), [
    ([1, 8], (1, 8)), (np.int64(8), (8,)), ((np.int32(2), 8), (2, 8)), (range(1, 3), (1, 2)),
    (np.array([4, 2]), (4, 2)),
])
def test_batches_of_any_integer_kind(batches, want):
  net = _sparse_net()
  timings = jaxsparse.route_slower_to_dense(net, batches, timer=_timer({}))
  assert all(tuple(t.sparse_ms) == want and all(type(b) is int for b in t.sparse_ms) for t in timings)


@pytest.mark.parametrize(("batches", "shown"), [
    (None, "None"), (8.0, "8.0"), ("8", "'8'"), ([1.5], r"\(1\.5,\)"), (np.float32(2.0), r"np\.float32\(2\.0\)"),
    ([8, False], r"\(8, False\)"),
])
def test_bad_batches_are_named(batches, shown):
  for route in (lambda: jaxsparse.route_slower_to_dense(_sparse_net(), batches, timer=_timer({}))[0],
                lambda: jaxsparse.route_slower_to_dense_linen(*_sparse_linen()[:2], batches, timer=_linen_timer({}))):
    with pytest.raises(ValueError, match=f"batches must be positive ints, got {shown}"):
      route()


def _kinds(net) -> list[str]:
  return [type(m).__name__ for m in (net.blocks, net.nm, net.nm2, net.masked)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0, "fast", None, jnp.ones(2)])
@pytest.mark.parametrize("side", ["sparse", "dense"])
def test_a_bad_timer_value_is_named_and_changes_nothing(bad, side):
  # Before: a NaN or negative time kept the layer sparse without a word, a zero dense time divided by zero.
  net = _sparse_net()
  good = _timer({BlockSparseLinear: 2.0, CompressedNMLinear: 2.0})  # both timed before the masked one: routed

  def timer(layer, x):
    is_masked = isinstance(layer, MaskedLinear) or (type(layer) is nnx.Linear and layer.out_features == 32)
    return bad if is_masked and (type(layer) is nnx.Linear) == (side == "dense") else good(layer, x)

  twin = "the dense twin of " if side == "dense" else ""
  with pytest.raises(ValueError, match=rf"timer returned {re.escape(repr(bad))}; it must return the time of {twin}"
                                       r"the MaskedLinear 64x32 unstructured 50% kept float32 layer at batch 8 in "
                                       "milliseconds, a positive finite number"):
    jaxsparse.route_slower_to_dense(net, 8, timer=timer)
  assert _kinds(net) == ["BlockSparseLinear", "CompressedNMLinear", "CompressedNMLinear", "MaskedLinear"]
  sparse, sparse_vars, _ = _sparse_linen()

  def linen_timer(module, variables, x):  # the masked layer "masked" is the one of 32 inputs
    return bad if x.shape[-1] == 32 and (type(module) is nn.Dense) == (side == "dense") else 1.0

  with pytest.raises(ValueError, match=rf"timer returned {re.escape(repr(bad))}; it must return the time of {twin}"
                                       "the MaskedDense 32x32"):
    jaxsparse.route_slower_to_dense_linen(sparse, sparse_vars, 8, timer=linen_timer)


def test_a_timer_that_fails_leaves_the_model_as_it_was():
  # Before: the signatures timed before the failing one were already swapped in place.
  net = _sparse_net()
  x = jax.random.normal(jax.random.key(1), (4, 64))
  before = net(x)
  slow = _timer({BlockSparseLinear: 2.0, CompressedNMLinear: 2.0, MaskedLinear: 2.0})

  def timer(layer, x):
    if isinstance(layer, MaskedLinear):
      raise RuntimeError("out of memory")
    return slow(layer, x)

  with pytest.raises(RuntimeError, match="out of memory"):
    jaxsparse.route_slower_to_dense(net, (1, 8), timer=timer)
  assert _kinds(net) == ["BlockSparseLinear", "CompressedNMLinear", "CompressedNMLinear", "MaskedLinear"]
  np.testing.assert_array_equal(net(x), before)


@pytest.mark.parametrize("ms", [np.float32, jnp.float32, np.int64])
def test_timers_may_return_numpy_and_jax_scalars(ms):
  # Before: a step timer returning a NumPy float32 or a JAX scalar raised "step_timer returned ...".
  net = _sparse_net()
  layer_ms = {CompressedNMLinear: 3.0, BlockSparseLinear: 3.0, MaskedLinear: 1.1}
  timer = lambda layer, x: ms(_timer(layer_ms)(layer, x) * 10)
  cost = {"CompressedNMLinear": 1, "BlockSparseLinear": 1, "MaskedLinear": 2, "Linear": 1}
  calls = []
  step = _step_timer(cost, calls)
  timings = jaxsparse.route_slower_to_dense(net, 8, timer=timer, step_timer=lambda m: ms(step(m)))
  assert _kinds(net) == ["Linear", "Linear", "Linear", "Linear"] and len(calls) == 2
  by_layer = {t.signature.layer: t for t in timings}
  assert by_layer["MaskedLinear"].step_ms == {"sparse": 5.0, "dense": 4.0}
  assert by_layer["MaskedLinear"].sparse_ms == {8: 11.0} and by_layer["BlockSparseLinear"].dense_ms == {8: 10.0}


@pytest.mark.parametrize(("ratio", "settled"), [(0.85, True), (1.15, True), (0.84, False), (1.16, False)])
def test_the_step_band_is_closed(ratio, settled):
  # Before: a ratio of exactly 1 - step_band (0.85) was left out of the band (abs(0.85 - 1) > 0.15 in floats).
  net = _sparse_net()
  layer_ms = {CompressedNMLinear: 3.0, BlockSparseLinear: 3.0, MaskedLinear: ratio}  # only the masked one near
  cost = {"CompressedNMLinear": 1.0, "BlockSparseLinear": 1.0, "MaskedLinear": 1.0, "Linear": 1.0}
  calls = []
  timings = jaxsparse.route_slower_to_dense(net, 8, timer=_timer(layer_ms), step_timer=_step_timer(cost, calls))
  (masked,) = [t for t in timings if t.signature.layer == "MaskedLinear"]
  assert masked.ratio == ratio
  assert (masked.step_ms is not None) is settled and len(calls) == (2 if settled else 0)


class _Attention(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=32, qkv_features=32, decode=False, rngs=rngs)
    self.fc = nnx.Linear(32, 32, rngs=rngs)

  def __call__(self, x):
    return self.fc(self.attn(x))


@pytest.mark.parametrize("slow", [True, False])
def test_sparse_linear_general_routes_to_its_dense_linear_general(slow):
  # Before: the layer wrapped by each SparseLinearGeneral was swapped for an nnx.Linear inside the wrapper, which
  # then had no to_dense (jaxsparse.densify raised AttributeError) while the docstring said it stayed as it was.
  model, _ = jaxsparse.sparsify(_Attention(nnx.Rngs(0)), {r"attn\.(query|key|value|out)": jaxsparse.NM(2, 4),
                                                          "fc": jaxsparse.Unstructured(sparsity=0.5)})
  x = jax.random.normal(jax.random.key(1), (2, 5, 32))
  before = model(x)
  calls = []
  timer = _timer({jaxsparse.layers.NMLinear: 2.0 if slow else 0.5}, calls)
  timings = jaxsparse.route_slower_to_dense(model, 4, timer=timer)
  (nm,) = [t for t in timings if t.signature.layer == "NMLinear"]
  assert sorted(nm.paths) == ["attn.key", "attn.out", "attn.query", "attn.value"] and nm.dense is slow
  assert nm.signature.shape == (32, 32) and ("NMLinear", (4, 32)) in calls  # timed as the 2-D layer it wraps
  for name in ("query", "key", "value", "out"):
    layer = getattr(model.attn, name)
    assert type(layer) is (nnx.LinearGeneral if slow else jaxsparse.layers.SparseLinearGeneral), (name, layer)
  np.testing.assert_allclose(model(x), before, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(jaxsparse.densify(model)(x), before, rtol=1e-5, atol=1e-5)
  with pytest.raises(TypeError, match="model is itself a SparseLinearGeneral, which cannot be replaced in place"):
    jaxsparse.route_slower_to_dense(_sparse_general(), 4, timer=timer)


def _sparse_general() -> jaxsparse.layers.SparseLinearGeneral:
  inner = MaskedLinear(16, 8, sparsity=0.5, rngs=nnx.Rngs(0))
  return jaxsparse.layers.SparseLinearGeneral(inner, in_features=(16,), out_features=(2, 4))


class _Tied(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.a = nnx.Linear(32, 32, rngs=rngs)
    self.b = self.a
    self.c = nnx.Linear(32, 32, rngs=rngs)

  def __call__(self, x):
    return self.c(self.b(jax.nn.relu(self.a(x))))


def test_a_tied_layer_is_listed_at_every_path_and_stays_tied():
  # Before: the timings named a tied layer at its first path only ("a", not "b").
  model, _ = jaxsparse.sparsify(_Tied(nnx.Rngs(0)), jaxsparse.Unstructured(sparsity=0.5))
  x = jax.random.normal(jax.random.key(1), (3, 32))
  before = model(x)
  (timing,) = jaxsparse.route_slower_to_dense(model, 2, timer=_timer({MaskedLinear: 2.0}))
  assert timing.paths == ("a", "b", "c") and timing.dense
  assert type(model.a) is nnx.Linear and model.a is model.b and type(model.c) is nnx.Linear
  np.testing.assert_allclose(model(x), before, rtol=1e-5, atol=1e-5)


class _LinenEmbedNet(nn.Module):
  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(32, 64, name="embed")
    h = nn.relu(nn.Dense(64, name="fc")(embed(ids)))
    return embed.attend(h)  # tied output logits: the CompressedNMEmbed's attend


@pytest.mark.slow  # long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it
def test_linen_embeddings_stay_as_they_are():
  ids = jax.random.randint(jax.random.key(1), (2, 5), 0, 32)
  model = _LinenEmbedNet()
  variables = model.init(jax.random.key(0), ids)
  rules = {"embed": jaxsparse.NM(2, 4), "fc": jaxsparse.Unstructured(sparsity=0.5)}
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, rules, ids)
  before = sparse.apply(sparse_vars, ids)
  calls = []
  new, new_vars, timings = jaxsparse.route_slower_to_dense_linen(sparse, sparse_vars, 8,
                                                                 timer=_linen_timer({"MaskedDense": 2.0}, calls))
  # The masked fc goes dense; the embedding is neither timed nor routed: still compressed, its variables as they were.
  assert [t.paths for t in timings] == [("fc",)] and timings[0].dense
  assert [".".join(p) for p in new.layers] == ["embed"] and calls == [("MaskedDense", (8, 64)), ("Dense", (8, 64))]
  assert set(new_vars["sparsity"]) == {"embed"} and new_vars["params"]["fc"]["kernel"].shape == (64, 64)
  jax.tree.map(np.testing.assert_array_equal, new_vars["params"]["embed"], sparse_vars["params"]["embed"])
  np.testing.assert_allclose(new.apply(new_vars, ids), before, rtol=1e-5, atol=1e-5)
  # Against the dense model with the pruned table and kernel (densify_linen's), in plain jnp.
  _, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  table, fc = dense_vars["params"]["embed"]["embedding"], dense_vars["params"]["fc"]
  assert np.mean(np.asarray(table) != 0) == 0.5
  expected = jax.nn.relu(jnp.take(table, ids, axis=0) @ fc["kernel"] + fc["bias"]) @ table.T
  np.testing.assert_allclose(new.apply(new_vars, ids), expected, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------------------------
# A mask without values (traced, abstract): its density, part of the signature, is unknown.
# -------------------------------------------------------------------------------------------------


def test_a_traced_or_abstract_mask_is_named_not_rounded():
  # Was: Linen rounded the None density of a traced / abstract "sparsity" mask ("type NoneType doesn't define
  # __round__ method"); NNX read an abstract mask ("'ShapeDtypeStruct' object is not subscriptable") or took float()
  # of a traced one (ConcretizationTypeError).
  sparse, sparse_vars, x = _sparse_linen()
  route = lambda v: jaxsparse.route_slower_to_dense_linen(sparse, v, 2, timer=_linen_timer({}))[1]
  linen_match = r"masked: the MaskedDense's mask holds no values \(traced under jax.jit / jax.eval_shape, or abstract"
  with pytest.raises(ValueError, match=linen_match):
    jax.eval_shape(route, sparse_vars)
  with pytest.raises(ValueError, match=linen_match):
    jax.jit(route)(sparse_vars)
  with pytest.raises(ValueError, match=linen_match):
    route(jax.eval_shape(sparse.init, jax.random.key(0), x))
  assert route(sparse_vars)  # concrete variables: routed as before

  net = _sparse_net()
  nnx_match = r"masked: the MaskedLinear's mask holds no values \(traced under nnx.jit / nnx.eval_shape, or abstract"
  with pytest.raises(ValueError, match=nnx_match):
    nnx.eval_shape(lambda m: jaxsparse.route_slower_to_dense(m, 2, timer=_timer({})), net)
  abstract = nnx.eval_shape(_sparse_net)
  with pytest.raises(ValueError, match=nnx_match):
    jaxsparse.route_slower_to_dense(abstract, 2, timer=_timer({}))
  with pytest.raises(ValueError, match=r"^the MaskedLinear's mask holds no values"):
    jaxsparse.layer_signature(abstract.masked)
  # The other layers' signatures need no values: the abstract layers give the concrete ones'.
  assert jaxsparse.layer_signature(abstract.blocks) == jaxsparse.layer_signature(net.blocks)
  assert jaxsparse.layer_signature(abstract.nm) == jaxsparse.layer_signature(net.nm)
