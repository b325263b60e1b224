"""Calibrated pruning (magnitude, Wanda, SparseGPT) of stacks of layers: an ``nnx.vmap`` stack run by ``nnx.scan``, a
Linen ``nn.scan``, checked against the same layers unstacked.

Regressions (each test below failed before the fix):

* A stack of ``L`` layers holds its kernel ``(L, K, N)``. Calibration took it for one layer with ``L`` inputs: its
  statistics were recorded inside the model's scan, whose inputs are tracers of the scan body (an
  ``UnexpectedTracerError``; NNX: a reshape ``TypeError`` or a check naming a ``(3, 512)`` kernel), and without
  batches NNX magnitude pruning ranked the stack as one ``(L, K * N)`` matrix (silently: layer 0 emptied, the last
  layer kept dense). Each layer of a stack is now calibrated on its own inputs and pruned as the same layer
  unstacked (masks, weights, report), for every method and structure, NNX and Linen, sequential or not.
* A scan with ``reverse=True`` runs layer ``L - 1`` first, but sequential pruning took the layers in ascending order:
  layers ``0 .. L-2`` were pruned on inputs they never see (silently: Wanda / SparseGPT masks differed from the layers
  unstacked and run in that order). The order is now read from the scan that slices the stack's kernel.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsparse
from jaxsparse import pruning
from jaxsparse.pruning._calibration import Layer
from jaxsparse.pruning._calibration_stacks import layer_slices
from jaxsparse.pruning._calibration_stacks import scan_axes


@pytest.fixture(autouse=True)
def _full_float32_products():
  """The stacked and the unstacked model's products alike: a GPU would take the models' float32 products in TF32,
  whose rounding differs between the two programs (masks then differ at near ties)."""
  with jax.default_matmul_precision("highest"):
    yield


L, D, H, OUT = 3, 16, 32, 8
SPECS = {"unstructured 50%": jaxsparse.Unstructured(sparsity=0.5), "2:4": jaxsparse.NM(2, 4),
         "block 4x4": jaxsparse.BlockSparse(density=0.5, block_shape=(4, 4))}
METHODS = ["magnitude", "wanda", "sparsegpt"]
SLOW = pytest.mark.slow  # long: out of the fast set (make test <= 15 min on 2 cores); CI runs it


def _matrix(fast):
  """Every (method, structure); only ``fast`` in the fast set."""
  return [pytest.param(m, n, marks=() if (m, n) == fast else SLOW) for m in METHODS for n in SPECS]


def _batches(n=2, tokens=48):
  return [jax.random.normal(jax.random.key(100 + i), (tokens, D)) for i in range(n)]


def _assert_same(stacked_masks, stacked_weights, flat_masks, flat_weights, unstack_path):
  """Masks equal and weights close for every parameter: a stacked one's layer ``l`` against ``unstack_path(path, l)``
  of the unstacked model."""
  for path, mask in stacked_masks.items():
    if path in flat_masks:
      np.testing.assert_array_equal(mask, flat_masks[path], err_msg=path)
      np.testing.assert_allclose(stacked_weights[path], flat_weights[path], rtol=1e-4, atol=1e-5, err_msg=path)
      continue
    assert mask.shape[0] == L, path
    for i in range(L):
      other = unstack_path(path, i)
      np.testing.assert_array_equal(mask[i], flat_masks[other], err_msg=f"{path}[{i}] vs {other}")
      np.testing.assert_allclose(stacked_weights[path][i], flat_weights[other], rtol=1e-4, atol=1e-5,
                                 err_msg=f"{path}[{i}] vs {other}")
  assert sum(m.shape[0] if m.ndim == 3 else 1 for m in stacked_masks.values()) == len(flat_masks)


# -------------------------------------------------------------------------------------------------
# NNX: an nnx.vmap stack of blocks run by nnx.scan (the Flax NNX "scan over layers"), and the same blocks unstacked.
# -------------------------------------------------------------------------------------------------


class Block(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(D, H, rngs=rngs)
    self.fc2 = nnx.Linear(H, D, rngs=rngs)

  def __call__(self, x):
    return x + self.fc2(jax.nn.gelu(self.fc1(x)))


class Scanned(nnx.Module):
  def __init__(self, rngs, reverse=False):
    self.reverse = reverse  # nnx.scan(reverse=True): layer L - 1 runs first
    self.inp = nnx.Linear(D, D, rngs=rngs)

    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return Block(rngs)

    self.blocks = create(rngs)
    self.head = nnx.Linear(D, OUT, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, reverse=self.reverse)
    def forward(h, block):
      return block(h)

    return self.head(forward(self.inp(x), self.blocks))


class Unstacked(nnx.Module):
  """``Scanned``'s layers as separate modules: ``blocks.{l}.fc1`` is ``blocks.fc1[l]``, run in the scan's order."""

  def __init__(self, scanned):
    self.reverse = scanned.reverse
    self.inp = nnx.clone(scanned.inp)
    self.blocks = nnx.List([Block(nnx.Rngs(i)) for i in range(L)])
    for i, block in enumerate(self.blocks):
      for name in ("fc1", "fc2"):
        for p in ("kernel", "bias"):
          getattr(getattr(block, name), p)[...] = getattr(getattr(scanned.blocks, name), p)[i]
    self.head = nnx.clone(scanned.head)

  def __call__(self, x):
    h = self.inp(x)
    for block in list(self.blocks)[::-1] if self.reverse else self.blocks:
      h = block(h)
    return self.head(h)


def _scanned(reverse=False):
  model = Scanned(nnx.Rngs(0), reverse=reverse)
  scale = (4.0 ** np.arange(L)).reshape(L, 1, 1)  # layers of different scales: a ranking across them shows
  model.blocks.fc1.kernel[...] = model.blocks.fc1.kernel[...] * scale.astype(np.float32) / 4
  return model


def _nnx_weights(model):
  return {f"{path}.kernel" if path else "kernel": np.asarray(m.kernel[...]) for path, m in
          ((".".join(map(str, k)), m) for k, m in nnx.iter_modules(model)) if isinstance(m, nnx.Linear)}


def _nnx_unstack_path(path, i):
  return path.replace("blocks.", f"blocks.{i}.", 1)


def _check_nnx(method, spec, reverse=False, **kwargs):
  model = _scanned(reverse)
  flat = Unstacked(model)
  batches = _batches()
  np.testing.assert_allclose(model(batches[0]), flat(batches[0]), rtol=1e-5, atol=1e-5)
  pruned, masks, report = pruning.calibrated_prune(model, spec, batches, method=method, progress=False, **kwargs)
  flat_pruned, flat_masks, flat_report = pruning.calibrated_prune(flat, spec, batches, method=method, progress=False,
                                                                  **kwargs)
  _assert_same(masks, _nnx_weights(pruned), flat_masks, _nnx_weights(flat_pruned), _nnx_unstack_path)
  # One report row per layer of the stack, in the unstacked model's order, groups and errors.
  names = [re.sub(r"blocks\.(fc\d)\[(\d)\]", r"blocks.\2.\1", r.path) for r in report.layers]
  assert names == [r.path for r in flat_report.layers]
  assert [r.group for r in report.layers] == [r.group for r in flat_report.layers]
  np.testing.assert_allclose([r.error for r in report.layers], [r.error for r in flat_report.layers], rtol=1e-3)
  assert [r.tokens for r in report.layers] == [r.tokens for r in flat_report.layers]
  return report


@pytest.mark.parametrize(("method", "name"), _matrix(("sparsegpt", "2:4")))
def test_nnx_scan_over_layers_is_pruned_as_the_layers_unstacked(method, name):
  # Regression: a TypeError (reshape of the inputs to the stack's (3, ...) view) or an UnexpectedTracerError before.
  report = _check_nnx(method, SPECS[name])
  assert [r.path for r in report.layers][:4] == ["inp", "blocks.fc1[0]", "blocks.fc2[0]", "blocks.fc1[1]"]
  assert [r.group for r in report.layers] == [0, 1, 1, 2, 2, 3, 3, 4]  # the default groups: one per block


@pytest.mark.parametrize(("method", "name"), [
    pytest.param(m, n, marks=() if (m, n) == ("sparsegpt", "2:4") else SLOW)
    for m in ("wanda", "sparsegpt") for n in ("2:4", "unstructured 50%")])
def test_nnx_reverse_scan_is_pruned_in_the_order_it_runs(method, name):
  # Regression (silently wrong before): under nnx.scan(reverse=True) layer 2 runs first, but sequential pruning took
  # layer 0 first, on inputs of dense layers 2 and 1 it never sees: masks of layers 0 and 1 differed from the layers
  # unstacked and run in that order (SparseGPT 2:4: 36 to 58 of 512 entries).
  report = _check_nnx(method, SPECS[name], reverse=True)
  assert [r.path for r in report.layers][:4] == ["inp", "blocks.fc1[2]", "blocks.fc2[2]", "blocks.fc1[1]"]


def _scan(reverse):
  return lambda k, x: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, k, reverse=reverse)[0]


@pytest.mark.parametrize(("f", "want"), [
    pytest.param(_scan(False), ((0, False),), id="forward"),
    pytest.param(_scan(True), ((0, True),), id="reverse"),
    pytest.param(lambda k, x: _scan(False)(k[::-1], x), ((0, True),), id="flipped by the model, a forward scan"),
    pytest.param(jax.jit(lambda k, x: _scan(True)(k.astype(jnp.bfloat16), x.astype(jnp.bfloat16))), ((0, True),),
                 id="under jit, cast"),
    pytest.param(lambda k, x: _scan(False)(k, _scan(True)(k, x)), ((0, True),), id="two scans: the first counts"),
    pytest.param(lambda k, x: jax.vmap(lambda w: x @ w)(k), None, id="vmap: the layers side by side"),
])
def test_scan_axes_follow_the_kernel_to_the_scan_over_its_layers(f, want):
  # The direction of the scan that slices a stack's kernel (the jaxpr input 0, one layer axis); none under a vmap.
  k, x = jnp.ones((L, D, D)), jnp.ones((4, D))
  assert scan_axes(jax.make_jaxpr(f)(k, x), {0: ("k", 1)}).get("k") == want


def test_two_layer_axes_run_in_the_order_of_their_scans():
  # A vmap over the first layer axis around a reverse scan over the second: jax transposes the kernel to scan it.
  k, x = jnp.ones((2, L, D, D)), jnp.ones((4, D))
  jaxpr = jax.make_jaxpr(lambda k, x: jax.vmap(lambda k1: _scan(True)(k1, x))(k))(k, x)
  assert scan_axes(jaxpr, {0: ("k", 2)}) == {"k": ((1, True),)}
  # Pruning then takes the scan's steps first (layer 2 of every member of the vmap first), the vmap's axis after.
  layer = Layer("k", ("k",), jaxsparse.NM(2, 4), (D, D), D, D, stack=(2, L), root=1, scans=((1, True),))
  assert [s.index for s in layer_slices([layer])] == [(0, 2), (1, 2), (0, 1), (1, 1), (0, 0), (1, 0)]
  # A layer of the same stack module that was not followed to the scan runs in it all the same.
  other = Layer("k.fc2", ("k", "fc2"), jaxsparse.NM(2, 4), (D, D), D, D, stack=(2, L), root=1)
  assert [(s.path, s.index) for s in layer_slices([layer, other])][:4] == [
      ("k", (0, 2)), ("k.fc2", (0, 2)), ("k", (1, 2)), ("k.fc2", (1, 2))]


@pytest.mark.parametrize("sequential", [False, pytest.param("one layer at a time", marks=SLOW)])
def test_nnx_scan_other_sequential_groups(sequential):
  # Sequential off (one calibration of the dense model), and a callable given each layer's "path[l]".
  report = _check_nnx("sparsegpt", SPECS["2:4"], **(
      {"sequential": False} if sequential is False else {"sequential": lambda p: re.sub(r"\[(\d)\]", r".\1", p)}))
  assert len({r.group for r in report.layers}) == (1 if sequential is False else len(report.layers))


def test_calibrate_gives_each_layer_of_a_stack_its_own_statistics():
  # Regression: calibrate raised before. A stack's statistics come with its leading layer axis, layer l's those of the
  # layer unstacked.
  model, batches = _scanned(), _batches()
  rules = {r"blocks.*": jaxsparse.NM(2, 4), ".*": None}
  stats = pruning.calibrate(model, batches, rules)
  flat = pruning.calibrate(Unstacked(model), batches, rules)
  s = stats["blocks.fc2"]
  assert s.sq_norms.shape == (L, H) and s.gram.shape == (L, H, H) and s.tokens.tolist() == [96] * L
  for path in ("blocks.fc1", "blocks.fc2"):
    for i in range(L):
      f = flat[_nnx_unstack_path(path, i)]
      np.testing.assert_allclose(stats[path].sq_norms[i], f.sq_norms, rtol=1e-5)
      np.testing.assert_allclose(stats[path].gram[i], f.gram, rtol=1e-5, atol=1e-3)
      assert int(stats[path].tokens[i]) == int(f.tokens)


def test_magnitude_without_batches_prunes_each_layer_of_a_stack():
  # Regression (silently wrong before): without batches, magnitude ranked the stack as one (3, 16 * 32) matrix: layer
  # 0 (the smallest weights) kept none of its weights, layer 1 60% and layer 2 90%.
  model = _scanned()
  spec = jaxsparse.Unstructured(sparsity=0.5)
  _, masks, report = pruning.calibrated_prune(model, {"blocks.fc1": spec, ".*": None}, None, method="magnitude",
                                              progress=False)
  kernel = np.asarray(model.blocks.fc1.kernel[...])
  assert masks["blocks.fc1.kernel"].mean(axis=(1, 2)).tolist() == [0.5] * L
  for i in range(L):
    np.testing.assert_array_equal(masks["blocks.fc1.kernel"][i],
                                  np.asarray(pruning.magnitude_layer(jnp.asarray(kernel[i]), spec)))
  assert [r.path for r in report.layers] == ["blocks.fc1[0]", "blocks.fc1[1]", "blocks.fc1[2]"]
  # A stack of 4 (the model itself): before, its 2:4 groups ran across the 4 layers (59% of each layer's groups of 4
  # inputs kept other than 2 weights).
  @nnx.split_rngs(splits=4)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def four(rngs):
    return nnx.Linear(D, OUT, rngs=rngs)

  _, masks, report = pruning.calibrated_prune(four(nnx.Rngs(2)), jaxsparse.NM(2, 4), None, method="magnitude",
                                              progress=False)
  assert (masks["kernel"].reshape(4, D // 4, 4, OUT).sum(axis=2) == 2).all()
  assert [(r.path, r.shape) for r in report.layers] == [(f"[{i}]", (D, OUT)) for i in range(4)]


class Ensemble(nnx.Module):
  """A stack of heads, each applied to the same input by nnx.vmap (no scan)."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return nnx.Linear(D, OUT, rngs=rngs)

    self.heads = create(rngs)

  def __call__(self, x):
    return nnx.vmap(lambda head, x: head(x), in_axes=(0, None))(self.heads, x)


def test_stack_applied_by_nnx_vmap():
  # Each head of a vmapped stack is calibrated on the input it sees, as a separate head on that input.
  model, batches = Ensemble(nnx.Rngs(1)), _batches()
  _, masks, _ = pruning.sparsegpt(model, jaxsparse.NM(2, 4), batches, progress=False)
  for i in range(L):
    head = nnx.Linear(D, OUT, rngs=nnx.Rngs(0))
    head.kernel[...] = model.heads.kernel[i]
    head.bias[...] = model.heads.bias[i]
    _, ref, _ = pruning.sparsegpt(head, jaxsparse.NM(2, 4), batches, progress=False)
    np.testing.assert_array_equal(masks["heads.kernel"][i], ref["kernel"], err_msg=f"head {i}")


def test_stack_called_whole_or_stacked_tables_are_refused():
  # A stack the model calls outside a transform over its layers and a stack of embedding tables: errors that name the
  # path, its stacked shape and what to do.
  class Whole(nnx.Module):
    def __init__(self, rngs):
      self.heads = Ensemble(rngs).heads

    def __call__(self, x):
      return self.heads(x)

  with pytest.raises(ValueError, match=re.escape("heads: a stack of 3 layers (kernel (3, 16, 8), leading layer axes "
                                                 "(3,)) is called with its layer axes unsliced") +
                     r".*under nnx.scan / nnx.vmap.*Unstack it.*pruning.magnitude_masks"):
    pruning.wanda(Whole(nnx.Rngs(0)), jaxsparse.NM(2, 4), _batches(), progress=False)

  @nnx.split_rngs(splits=L)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def tables(rngs):
    return nnx.Embed(10, D, rngs=rngs)

  class Tables(nnx.Module):
    def __init__(self, rngs):
      self.embed = tables(rngs)

    def __call__(self, ids):
      return nnx.vmap(lambda e, ids: e(ids), in_axes=(0, None))(self.embed, ids)

  with pytest.raises(ValueError, match=re.escape("embed: a stack of 3 embedding tables (stored (3, 10, 16), leading "
                                                 "layer axes (3,)) is not supported")):
    pruning.calibrated_prune(Tables(nnx.Rngs(0)), {"embed": jaxsparse.NM(2, 4)}, [jnp.array([[1, 2, 3, 4]])],
                             method="wanda", progress=False)


# -------------------------------------------------------------------------------------------------
# Linen: nn.scan over blocks, and the same blocks unstacked.
# -------------------------------------------------------------------------------------------------


class LBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _=None):
    return x + nn.Dense(D, name="fc2")(nn.gelu(nn.Dense(H, name="fc1")(x))), None


class LScanned(nn.Module):
  reverse: bool = False  # nn.scan(reverse=True): layer L - 1 runs first

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(D, name="inp")(x)
    scan = nn.scan(LBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=L, reverse=self.reverse,
                   metadata_params={nn.PARTITION_NAME: "layers"})
    x, _ = scan(name="blocks")(x, None)
    return nn.Dense(OUT, name="head")(x)


class LUnstacked(nn.Module):
  reverse: bool = False  # LScanned's layers run in its order: blocks_{L - 1} first

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(D, name="inp")(x)
    for i in reversed(range(L)) if self.reverse else range(L):
      x, _ = LBlock(name=f"blocks_{i}")(x)
    return nn.Dense(OUT, name="head")(x)


def _linen_pair():
  batches = _batches()
  variables = LScanned().init(jax.random.key(0), batches[0])
  params = jax.tree.map(np.asarray, variables["params"])
  params["blocks"]["fc1"]["kernel"] = params["blocks"]["fc1"]["kernel"] * (4.0 ** np.arange(L)).reshape(L, 1, 1) / 4
  flat = {"inp": params["inp"], "head": params["head"]}
  for i in range(L):
    flat[f"blocks_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["blocks"])
  return {"params": params}, {"params": flat}, batches


def _linen_weights(variables):
  pairs = jax.tree_util.tree_flatten_with_path(variables["params"])[0]
  return {".".join(p.key for p in kp): np.asarray(a) for kp, a in pairs if kp[-1].key == "kernel"}


def _linen_unstack_path(path, i):
  return path.replace("blocks.", f"blocks_{i}.", 1)


def _block_of(path):
  """The block number of a path (``"blocks.fc1[2]"``, ``"blocks_2.fc1"``), else the path: equal groups either way."""
  number = re.search(r"\[(\d+)\]$|^blocks_(\d+)\.", path)
  return path if number is None else number.group(1) or number.group(2)


def _check_linen(method, spec, reverse=False):
  variables, flat_vars, batches = _linen_pair()
  scanned, flat = LScanned(reverse=reverse), LUnstacked(reverse=reverse)
  np.testing.assert_allclose(scanned.apply(variables, batches[0]), flat.apply(flat_vars, batches[0]), rtol=1e-5,
                             atol=1e-5)
  new, masks, report = pruning.calibrated_prune_linen(scanned, variables, spec, batches, method=method,
                                                      sequential=_block_of, progress=False)
  flat_new, flat_masks, flat_report = pruning.calibrated_prune_linen(flat, flat_vars, spec, batches, method=method,
                                                                     sequential=_block_of, progress=False)
  _assert_same(masks, _linen_weights(new), flat_masks, _linen_weights(flat_new), _linen_unstack_path)
  names = [re.sub(r"blocks\.(fc\d)\[(\d)\]", r"blocks_\2.\1", r.path) for r in report.layers]
  assert names == [r.path for r in flat_report.layers]
  assert [r.group for r in report.layers] == [r.group for r in flat_report.layers] == [0, 1, 1, 2, 2, 3, 3, 4]
  np.testing.assert_allclose([r.error for r in report.layers], [r.error for r in flat_report.layers], rtol=1e-3)
  return report


@pytest.mark.parametrize(("method", "name"), _matrix(("wanda", "block 4x4")))
def test_linen_scan_over_layers_is_pruned_as_the_layers_unstacked(method, name):
  # Regression: an UnexpectedTracerError before, for every method (the inputs were recorded inside nn.scan).
  report = _check_linen(method, SPECS[name])
  assert [r.path for r in report.layers][:3] == ["inp", "blocks.fc1[0]", "blocks.fc2[0]"]


@pytest.mark.parametrize(("method", "name"), [
    pytest.param(m, n, marks=() if (m, n) == ("wanda", "unstructured 50%") else SLOW)
    for m in ("wanda", "sparsegpt") for n in ("2:4", "unstructured 50%")])
def test_linen_reverse_scan_is_pruned_in_the_order_it_runs(method, name):
  # Regression (silently wrong before): nn.scan(reverse=True) runs layer 2 first; sequential pruning took layer 0
  # first, so layers 0 and 1 were pruned on inputs they never see.
  report = _check_linen(method, SPECS[name], reverse=True)
  assert [r.path for r in report.layers][:3] == ["inp", "blocks.fc1[2]", "blocks.fc2[2]"]


def test_calibrate_linen_of_a_boxed_scan():
  # Params kept boxed (nn.with_partitioning, the stack axis named by metadata_params): each layer's statistics.
  class Step(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
      return jnp.tanh(nn.Dense(D, kernel_init=init, name="fc")(h)), None

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      scan = nn.scan(Step, variable_axes={"params": 0}, split_rngs={"params": True}, length=L,
                     metadata_params={nn.PARTITION_NAME: "layers"})
      return scan(name="s")(x, None)[0]

  batches = _batches()
  variables = Stack().init(jax.random.key(0), batches[0])
  assert variables["params"]["s"]["fc"]["kernel"].names == ("layers", None, "model")
  stats = pruning.calibrate_linen(Stack(), variables, batches, jaxsparse.NM(2, 4))
  params = nn.meta.unbox(variables["params"])["s"]["fc"]
  hs = batches
  for i in range(L):  # layer i's inputs: the outputs of layer i - 1
    x = jnp.concatenate(hs)
    np.testing.assert_allclose(stats["s.fc"].gram[i], x.T @ x, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(stats["s.fc"].sq_norms[i], jnp.sum(x * x, axis=0), rtol=1e-4, atol=1e-3)
    hs = [jnp.tanh(h @ params["kernel"][i] + params["bias"][i]) for h in hs]


@pytest.mark.parametrize("spec", [jaxsparse.NM(2, 4), jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8))],
                         ids=lambda s: s.describe())
def test_to_sparse_turns_a_pruned_stack_into_a_stack_of_sparse_layers(spec):
  # to_sparse=True of a scan-over-layers stack: the stacked sparse layers (sparsify of nnx.Linear stacks) compute what
  # the pruned dense stack computes, under the model's own nnx.scan.
  batches = _batches()
  rules = {r"blocks\..*": spec, ".*": None}
  dense, masks, _ = pruning.calibrated_prune(_scanned(), rules, batches, method="wanda", progress=False)
  sparse, masks_s, _ = pruning.calibrated_prune(_scanned(), rules, batches, method="wanda", to_sparse=True,
                                                progress=False)
  for path in ("blocks.fc1.kernel", "blocks.fc2.kernel"):
    np.testing.assert_array_equal(masks_s[path], masks[path])
  kind = jaxsparse.layers.NMLinear if isinstance(spec, jaxsparse.NM) else jaxsparse.layers.BlockSparseLinear
  assert isinstance(sparse.blocks.fc1, kind) and isinstance(sparse.blocks.fc2, kind)
  x = batches[0]
  np.testing.assert_allclose(sparse(x), dense(x), rtol=2e-5, atol=2e-5)
  with pytest.raises(ValueError, match=r"stacks of nnx.Linear layers only, not of Conv"):
    pruning.calibrated_prune(_conv_stack(), jaxsparse.NM(2, 4), [jnp.ones((2, 8, 8, 4))], method="wanda",
                             to_sparse=True, progress=False)


def _conv_stack():
  @nnx.split_rngs(splits=L)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def convs(rngs):
    return nnx.Conv(4, 4, (3, 3), rngs=rngs)

  class ConvStack(nnx.Module):
    def __init__(self, rngs):
      self.convs = convs(rngs)

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def forward(h, conv):
        return conv(h)

      return forward(x, self.convs)

  return ConvStack(nnx.Rngs(0))
