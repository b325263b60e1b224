"""``jaxsparse.route_slower_to_dense``: sparse linear layers measured slower than their dense twin become it.

The routing decisions run with injected timers (a CPU cannot say which kernel a GPU would prefer); one test times
for real on the CPU. The outputs must not change, whichever layers go dense.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsparse
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


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"batches": 0}, ValueError, r"batches must be positive ints, got \(0,\)"),
    ({"batches": ()}, ValueError, r"batches must be positive ints, got \(\)"),
    ({"batches": (True,)}, ValueError, "batches must be positive ints"),
    ({"batches": ("8",)}, ValueError, "batches must be positive ints"),
    ({"batches": 8, "margin": -0.1}, ValueError, r"margin must be a fraction in \[0, 1\), got margin=-0.1"),
    ({"batches": 8, "margin": 1.0}, ValueError, "margin=1.0"),
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
