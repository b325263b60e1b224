"""``jaxsparse.summary`` against bytes and FLOPs counted by hand, and readable layer reprs."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsparse
from jaxsparse import layers
from jaxsparse._sparsify._masks import nm_density
from jaxsparse._sparsify._masks import nm_signature_density
from jaxsparse._sparsify._masks import nm_table_density
from jaxsparse.layers import linen

F32 = 4


class Model(nnx.Module):
  def __init__(self, rngs):
    self.block = layers.BlockSparseLinear(64, 96, density=0.5, block_shape=(16, 32), rngs=rngs)
    self.masked = layers.MaskedLinear(96, 48, sparsity=0.75, rngs=rngs)
    self.nm = layers.NMLinear(48, 32, n=2, m=4, rngs=rngs)
    self.compressed = layers.NMLinear(64, 32, n=2, m=4, rngs=rngs).to_compressed()
    self.conv = layers.MaskedConv(8, 16, (3, 3), sparsity=0.5, rngs=rngs)
    self.nm_conv = layers.NMConv(8, 16, (3, 3), n=1, m=4, rngs=rngs)
    self.dense = nnx.Linear(4, 4, rngs=rngs)  # not sparse: not listed


# Hand counts: (path, pattern, kept weights, kernel size, bytes stored, bias size, dense weight gradient).
# block: 4x3 grid of 16x32 blocks, 6 kept; pattern = 6 + 6 + 5 + 4 + 6 int32.
# masked: 96x48 f32 kernel + bool mask; nm: dense f32 kernel; compressed: 1024 f32 values + 2 bits each.
EXPECTED = [
    ("block", "block 16x32", 6 * 512, 64 * 96, 6 * 512 * F32 + 96 * F32 + 27 * 4, 96, False),
    ("masked", "unstructured", 96 * 48 // 4, 96 * 48, 96 * 48 * (F32 + 1) + 48 * F32, 48, False),
    ("nm", "2:4", 48 * 32 // 2, 48 * 32, (48 * 32 + 32) * F32, 32, True),
    ("compressed", "2:4 compressed", 1024, 64 * 32, 1024 * F32 + 1024 * 2 // 8 + 32 * F32, 32, False),
    ("conv", "unstructured", 576, 3 * 3 * 8 * 16, 1152 * (F32 + 1) + 16 * F32, 16, False),
    ("nm_conv", "1:4", 288, 1152, (1152 + 16) * F32, 16, True),
]


def _check(s, expected):
  by_path = {layer.path: layer for layer in s.layers}
  assert sorted(by_path) == sorted(e[0] for e in expected) and len(s.layers) == len(expected)
  for path, pattern, kept, size, stored, bias, dense_grad in expected:
    layer = by_path[path]
    assert layer.pattern == pattern, path
    assert layer.density == pytest.approx(kept / size), path
    assert layer.forward_flops == 2 * kept and layer.dense_forward_flops == 2 * size, path
    assert layer.backward_flops == 2 * kept + 2 * (size if dense_grad else kept), path
    assert layer.dense_backward_flops == 4 * size, path
    assert layer.bytes == stored and layer.dense_bytes == (size + bias) * F32, path
  assert s.forward_flops == sum(2 * e[2] for e in expected)
  assert s.bytes == sum(e[4] for e in expected)


def test_nnx_summary_matches_hand_counts():
  s = jaxsparse.summary(Model(nnx.Rngs(0)))
  _check(s, EXPECTED)
  assert {layer.path: layer.kind for layer in s.layers} == {
      "block": "BlockSparseLinear", "masked": "MaskedLinear", "nm": "NMLinear", "compressed": "CompressedNMLinear",
      "conv": "MaskedConv", "nm_conv": "NMConv",
  }
  text = str(s)
  assert text.splitlines()[0].split()[:5] == ["path", "layer", "shape", "pattern", "density"]
  rows = {line.split()[0]: line.split() for line in text.splitlines()[1:-1]}
  assert rows["block"][:7] == ["block", "BlockSparseLinear", "64x96", "block", "16x32", "0.500", "12.78K"]
  assert rows["total"][:2] == ["total", "6"]


def test_abstract_model_summary():
  s = jaxsparse.summary(nnx.eval_shape(lambda: Model(nnx.Rngs(0))))
  by_path = {layer.path: layer for layer in s.layers}
  # Static patterns are known without values; a mask is not.
  assert by_path["block"].forward_flops == 2 * 6 * 512 and by_path["nm"].density == 0.5
  assert by_path["masked"].density is None and by_path["masked"].forward_flops is None
  assert by_path["masked"].bytes == EXPECTED[1][4]
  assert s.forward_flops is None and "?" in str(s)


def test_linen_summary_from_variables():
  class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = linen.BlockSparseDense(96, density=0.5, block_shape=(16, 32), name="block")(x)
      x = linen.MaskedDense(48, sparsity=0.75, name="masked")(x)
      x = linen.NMDense(32, n=2, m=4, name="nm")(x)
      return nn.Dense(4, name="dense")(x)

  x = jnp.ones((2, 64))
  variables = LinenModel().init(jax.random.key(0), x)
  # From the variables alone: block-sparse and masked layers (NMDense's variables are nn.Dense's).
  _check(jaxsparse.summary(variables), EXPECTED[:2])
  s = jaxsparse.summary(variables, x, module=LinenModel())
  _check(s, EXPECTED[:3])
  assert [layer.kind for layer in s.layers] == ["BlockSparseDense", "MaskedDense", "NMDense"]


def test_linen_masked_kind_of_stacked_dense_and_masked_conv():
  """A stacked (nn.scan) MaskedDense, kernel (layers, K, N), was labelled "MaskedConv" from its kernel's ndim; a masked
  1-D nn.Conv's kernel (3, cin, cout) looks the same. The module tells them apart; without it, the kind says so."""
  mask = (jnp.arange(3 * 16 * 16) % 4 == 0).reshape(3, 16, 16)

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return linen.MaskedDense(16, sparsity=0.75, name="fc")(x), None

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      stack = nn.scan(Block, variable_axes={"params": 0, linen.SPARSITY: 0}, split_rngs={"params": True}, length=3)
      x, _ = stack(name="stack")(x, None)
      return nn.Conv(16, (3,), mask=mask, name="conv")(x)

  x = jnp.ones((2, 5, 16))
  variables = Net().init(jax.random.key(0), x)
  variables = {**variables, linen.SPARSITY: {**variables[linen.SPARSITY], "conv": {"mask": mask}}}
  s = jaxsparse.summary(variables, x, module=Net())
  assert {row.path: (row.kind, row.shape, row.density) for row in s.layers} == {
      "stack.fc": ("MaskedDense", (3, 16, 16), 0.25), "conv": ("MaskedConv", (3, 16, 16), 0.25)}
  assert [row.kind for row in jaxsparse.summary(variables).layers] == ["MaskedDense or MaskedConv"] * 2


def test_summary_of_stacks_of_compressed_nm_layers():
  """A stack of 3 compressed N:M layers (nnx.vmap, nn.scan) was shown as one layer's kernel keeping all 3 layers'
  weights (density 1.5 in NNX; Linen read the stack axis as the kernel's rows). Now the stack's shape, each layer's
  density, the whole stack's dense bytes, as for block-sparse stacks."""
  stack = nnx.vmap(lambda key: layers.NMLinear(16, 8, rngs=nnx.Rngs(key)).to_compressed(), in_axes=0, out_axes=0)(
      jax.random.split(jax.random.key(0), 3))
  (row,) = jaxsparse.summary(stack).layers
  assert (row.shape, row.density, row.dense_bytes) == ((3, 16, 8), 0.5, 3 * (16 * 8 + 8) * F32)

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return linen.CompressedNMDense(16, name="fc")(x), None

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      scan = nn.scan(Block, variable_axes={"params": 0, linen.SPARSITY: 0}, split_rngs={"params": True}, length=3)
      return scan(name="stack")(x, None)[0]

  x = jnp.ones((2, 16))
  (row,) = jaxsparse.summary(Net().init(jax.random.key(0), x), x, module=Net()).layers
  assert (row.path, row.shape, row.density, row.dense_bytes) == ("stack.fc", (3, 16, 16), 0.5, 3 * (16 * 16 + 16) * F32)


_OWN_MASK = jnp.ones((3, 8, 8), bool).at[:, :3].set(False)  # channels 0-2 masked: their group of 4 keeps 1 of 2


class _MaskedConvNet(nn.Module):
  def setup(self):
    self.c = nn.Conv(8, (3,), mask=_OWN_MASK)

  def __call__(self, x):
    return self.c(x)


def test_linen_nm_conv_with_a_weight_mask_counts_the_weights_it_keeps():
  """An N:M Linen conv with its own Flax weight mask keeps fewer than n of a group that mask thins out: the NNX
  summary counted that (0.375 here), sparsify_linen's report and the Linen summary said n / m = 0.5."""
  x = jnp.ones((1, 6, 8))
  sparse, variables, report = jaxsparse.sparsify_linen(
      _MaskedConvNet(), _MaskedConvNet().init(jax.random.key(0), x), jaxsparse.NM(2, 4), x)
  _, dense = jaxsparse.densify_linen(sparse, variables)
  kept = int(jnp.count_nonzero(dense["params"]["c"]["kernel"]))
  assert kept == 3 * 8 * 3  # per output channel and tap: 1 of channels 0-3, 2 of channels 4-7
  assert report.layers[0].density == kept / (3 * 8 * 8)
  row = jaxsparse.summary(variables, module=sparse).layers[0]
  assert (row.kind, row.density, row.forward_flops) == ("NMConv", kept / (3 * 8 * 8), 2 * kept)
  nnx_row = jaxsparse.summary(layers.NMConv(8, 8, (3,), mask=_OWN_MASK, rngs=nnx.Rngs(0))).layers[0]
  assert (nnx_row.density, nnx_row.forward_flops) == (row.density, row.forward_flops)


@pytest.mark.parametrize(("bad", "error", "match"), [
    (lambda m: m.astype(jnp.float32) * 0.5, TypeError, r"must be a boolean array, got dtype float32"),
    (lambda m: m[:1], ValueError, r"must have the weight's shape \(16, 8\), got \(1, 8\)"),
])
def test_linen_summary_refuses_a_sparsity_mask_the_forward_refuses(bad, error, match):
  """A "sparsity" mask of 0.5 (or of shape (1, out)) was counted (density 1.0), for a layer whose forward refuses
  it: the summary described a model that does not run."""
  variables = linen.MaskedDense(8, sparsity=0.5).init(jax.random.key(0), jnp.ones((1, 16)))
  variables = {"params": {"fc": variables["params"]}, "sparsity": {"fc": {"mask": bad(variables["sparsity"]["mask"])}}}
  with pytest.raises(error, match=r"^fc: its 'sparsity' collection's mask " + match):
    jaxsparse.summary(variables)


def test_summary_rejects_other_input():
  with pytest.raises(TypeError, match=r"model must be a flax\.nnx\.Module or Linen variables"):
    jaxsparse.summary([1, 2])
  with pytest.raises(TypeError, match=r"module= is for Linen variables; an NNX model needs none"):
    jaxsparse.summary(Model(nnx.Rngs(0)), module=nn.Dense(3))
  # Example inputs of an NNX model are for its tables' attend: a model without tables is not even traced.
  _check(jaxsparse.summary(Model(nnx.Rngs(0)), jnp.ones(3)), EXPECTED)


def test_linen_inputs_and_module_come_together():
  class NMModel(nn.Module):
    @nn.compact
    def __call__(self, x):
      return linen.NMDense(32, n=2, m=4, name="nm")(x)

  x = jnp.ones((2, 48))
  variables = NMModel().init(jax.random.key(0), x)
  # Inputs without module: were silently ignored (and the NMDense silently missing from the summary).
  with pytest.raises(TypeError, match=r"example inputs are for module\.apply: pass module="):
    jaxsparse.summary(variables, x)
  # A module without inputs: was "NMModel.__call__() missing 1 required positional argument".
  with pytest.raises(TypeError, match="module=NMModel needs the example inputs of its apply"):
    jaxsparse.summary(variables, module=NMModel())
  _check(jaxsparse.summary(variables, x, module=NMModel()), EXPECTED[2:3])
  # A SparsifiedLinen knows its layers: no inputs needed.
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(nn.Dense(32), nn.Dense(32).init(jax.random.key(0), x),
                                                    {".*": jaxsparse.NM(2, 4)}, x)
  assert [(layer.kind, layer.pattern) for layer in jaxsparse.summary(sparse_vars, module=sparse).layers] == [
      ("NMDense", "2:4")]


def test_reprs_show_shapes_not_index_values():
  layer = layers.BlockSparseLinear(256, 256, density=0.5, block_shape=(32, 32), rngs=nnx.Rngs(0))
  text = repr(layer)
  assert "Array(shape=(32,), dtype=" in text and "transpose_order" in text
  assert "[0, 0, 0" not in text and len(text.splitlines()) < 40
  masked = repr(layers.MaskedLinear(64, 64, sparsity=0.5, rngs=nnx.Rngs(0)))
  assert "[[" not in masked and "Array(shape=(64, 64), dtype=" in masked


def _pruned_further(kernel: jax.Array) -> jax.Array:
  """``kernel`` (16, N) with 3 of the 4 weights of its first group of each column zeroed and the whole second group,
  as an optimizer pruning past 2:4 (``pruning.wrap_optax`` at a higher sparsity) leaves it: those groups hold 1 and 0
  nonzero weights (the layer keeps the dense kernel, so a group keeps 2 nonzero while it holds them)."""
  return kernel.at[0:3].set(0.0).at[4:8].set(0.0)


def test_nm_summary_counts_the_nonzero_weights_kept():
  """N:M layers keep no mask: a group an optimizer pruned past n:m kept n by the count (a density of 0.5 for 2:4),
  zeros among them. The summary counts the nonzero weights the forward pass keeps, NNX and Linen alike."""
  layer = layers.NMLinear(16, 8, n=2, m=4, rngs=nnx.Rngs(0))
  layer.kernel[...] = _pruned_further(layer.kernel[...])
  nonzero = int(jnp.count_nonzero(layer.to_dense().kernel[...]))  # the forward's kernel
  assert nonzero == 16 * 8 // 2 - 3 * 8  # 1 + 2 kept weights a column zero: the reference is not trivially n / m
  got = jaxsparse.summary(layer).layers[0]
  assert got.density == nonzero / (16 * 8) and got.forward_flops == 2 * nonzero

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return linen.NMDense(8, n=2, m=4, name="nm")(x)

  x = jnp.ones((2, 16))
  variables = {"params": {"nm": {**layer.to_linen_variables()["params"]}}}
  got = jaxsparse.summary(variables, x, module=Net()).layers[0]
  assert got.density == nonzero / (16 * 8) and got.forward_flops == 2 * nonzero
  # An abstract layer: n of every m, the most it can keep.
  abstract = nnx.eval_shape(lambda: layers.NMLinear(16, 8, n=2, m=4, rngs=nnx.Rngs(0)))
  assert jaxsparse.summary(abstract).layers[0].density == 0.5


def test_compressed_nm_summary_counts_the_nonzero_values_kept():
  """A compressed N:M layer (NNX CompressedNMLinear, Linen CompressedNMDense) was reported at n/m whatever it kept,
  while its LayerSignature counted its nonzero kept values: a kernel pruned past 2:4 (or a sparser mask given to
  sparsify) stores zeros. Now the summary counts them too, NNX and Linen alike, as it counts an NMLinear's."""
  layer = layers.NMLinear(16, 8, n=2, m=4, rngs=nnx.Rngs(0))
  layer.kernel[...] = _pruned_further(layer.kernel[...])
  nonzero = int(jnp.count_nonzero(layer.to_dense().kernel[...]))
  compressed = layer.to_compressed()
  got = jaxsparse.summary(compressed).layers[0]
  assert got.density == nonzero / (16 * 8) and round(got.density, 2) == jaxsparse.layer_signature(compressed).density
  assert got.forward_flops == 2 * nonzero and got.pattern == "2:4 compressed"

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8, name="nm")(x)

  x = jnp.ones((2, 16))
  variables = {"params": {"nm": {**layer.to_linen_variables()["params"]}}}
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(Net(), variables, jaxsparse.NM(2, 4), x)
  small, small_vars = jaxsparse.compress_linen(sparse, sparse_vars)
  got = jaxsparse.summary(small_vars, module=small).layers[0]
  assert (got.kind, got.density, got.forward_flops) == ("CompressedNMDense", nonzero / (16 * 8), 2 * nonzero)
  abstract = nnx.eval_shape(lambda: layers.NMLinear(16, 8, n=2, m=4, rngs=nnx.Rngs(0)).to_compressed())
  assert jaxsparse.summary(abstract).layers[0].density == 0.5  # no values: the most the pattern keeps


def test_zero_size_kernels_report_density_zero():
  """An empty kernel or table keeps nothing: density 0.0 (its byte and FLOP ratios "-"), one rule for summary (it
  divided by zero: Linen variables of a zero-size masked kernel, an empty CompressedNMEmbed) and the report's
  densities (nm_density divided by zero; nm_table_density and compressed signatures said 0.0)."""
  variables = {"params": {"fc": {"kernel": jnp.zeros((0, 4))}}, "sparsity": {"fc": {"mask": jnp.zeros((0, 4), bool)}}}
  (row,) = jaxsparse.summary(variables).layers
  assert (row.kind, row.density, row.forward_flops, row.dense_bytes) == ("MaskedDense", 0.0, 0, 0)
  assert str(jaxsparse.summary(variables)).splitlines()[1].split()[4:7] == ["0.000", "0", "(-)"]
  for shape in ((0, 8), (8, 0)):
    kernel = jnp.zeros(shape)
    assert nm_density(kernel, 2, 4) == nm_density(jax.ShapeDtypeStruct(shape, jnp.float32), 2, 4) == 0.0
    assert nm_density(jax.ShapeDtypeStruct(shape, jnp.float32), 2, 4, mask=np.zeros(shape, bool)) == 0.0
    assert nm_table_density(kernel, 2, 4) == nm_signature_density(kernel, 2, 4) == 0.0
    assert nm_signature_density(kernel, 2, 4, compressed=True) == 0.0


def test_bridged_layers_are_summarized_or_said_not_to_be():
  """An NNX model holding ``nnx.bridge.ToNNX`` around Linen sparse layers, and the Linen variables of
  ``nnx.bridge.ToLinen(BlockSparseLinear / NMLinear)``, were summarized as "no sparse layers", without a word why."""
  x = jnp.ones((2, 64))

  class Dense2(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(32, name="down")(nn.Dense(96, name="up")(x))

  rules = {"up": jaxsparse.BlockSparse(density=0.5, block_shape=(16, 32)), "down": jaxsparse.NM(2, 4)}
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(Dense2(), Dense2().init(jax.random.key(0), x), rules, x)
  want = [(row.path, row.kind, row.pattern, row.bytes, row.forward_flops)
          for row in jaxsparse.summary(sparse_vars, module=sparse).layers]
  assert [row[:3] for row in want] == [("down", "NMDense", "2:4"), ("up", "BlockSparseDense", "block 16x32")]

  class Outer(nnx.Module):
    def __init__(self, inner):
      self.enc = inner
      self.head = layers.NMLinear(32, 8, n=2, m=4, rngs=nnx.Rngs(0))

  # ToNNX around a SparsifiedLinen: its plan says what each layer is.
  bridged = nnx.bridge.ToNNX(sparse, rngs=nnx.Rngs(0)).lazy_init(x)
  nnx.update(bridged, nnx.bridge.variables.linen_vars_to_nnx_attrs(sparse_vars))
  s = jaxsparse.summary(Outer(bridged))
  head = ("head", "NMLinear", "2:4", (32 * 8 + 8) * F32, 2 * 32 * 8 // 2)
  assert [(row.path, row.kind, row.pattern, row.bytes, row.forward_flops) for row in s.layers] == [
      (f"enc.{path}", *rest) for path, *rest in want] + [head]
  assert s.notes == ()

  # ToNNX around another Linen module: not summarized, and said so (with how).
  class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
      return linen.NMDense(32, name="nm")(linen.BlockSparseDense(96, density=0.5, block_shape=(16, 32), name="b")(x))

  plain = nnx.bridge.ToNNX(LinenModel(), rngs=nnx.Rngs(0)).lazy_init(x)
  with pytest.warns(UserWarning, match=r"^enc is an nnx\.bridge\.ToNNX of the Linen LinenModel, whose layers are not "
                    r"summarized here .*Summarize its Linen variables: jaxsparse\.summary\("):
    s = jaxsparse.summary(Outer(plain))
  assert [row.path for row in s.layers] == ["head"] and len(s.notes) == 1
  assert str(s).endswith("\nnote: " + s.notes[0])
  with pytest.warns(UserWarning, match="not summarized"):
    assert str(jaxsparse.summary(plain)).startswith("no sparse layers found\nnote: (model) is an nnx.bridge.ToNNX")
  # ... and the recipe of the note works.
  linen_vars = nnx.bridge.variables.nnx_attrs_to_linen_vars(dict(nnx.state(plain, nnx.Not(nnx.RngState))))
  s = jaxsparse.summary(linen_vars, x, module=plain.to_nnx__module)
  assert [(row.path, row.kind) for row in s.layers] == [("b", "BlockSparseDense"), ("nm", "NMDense")]

  # Linen variables of ToLinen(BlockSparseLinear) (its index arrays under "pattern") and ToLinen(NMLinear).
  class Bridged(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nnx.bridge.ToLinen(layers.BlockSparseLinear, args=(64, 96),
                             kwargs={"density": 0.5, "block_shape": (16, 32)}, name="block")(x)
      return nnx.bridge.ToLinen(layers.NMLinear, args=(96, 32), kwargs={"n": 1, "m": 4}, name="nm")(x)

  variables = Bridged().init(jax.random.key(0), x)
  s = jaxsparse.summary(variables)
  _check(s, EXPECTED[:1])
  assert s.layers[0].kind == "BlockSparseLinear"
  assert s.notes == ("1 kernel(s) with no pattern variable were not checked for N:M (nm): NMDense / NMConv and an NNX "
                     "NMLinear / NMConv under nnx.bridge.ToLinen keep none; pass module= (and example inputs) to find "
                     "them.",)
  s = jaxsparse.summary(variables, x, module=Bridged())
  assert [(row.path, row.kind, row.pattern, row.density) for row in s.layers] == [
      ("block", "BlockSparseLinear", "block 16x32", 0.5), ("nm", "NMLinear", "1:4", 0.25)]
  assert s.notes == ()


# -------------------------------------------------------------------------------------------------
# Embedding tables: a lookup is no product, a tied LM head's attend is (summary counted 0 for both).
# -------------------------------------------------------------------------------------------------

V, D = 64, 32


class _TiedNNX(nnx.Module):
  """Token embedding, one Linear, logits through the same table (``attend``); ``untied``: a Linear head instead."""

  def __init__(self, rngs, *, untied=False):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.fc = nnx.Linear(D, D, rngs=rngs)
    self.head = nnx.Linear(D, V, rngs=rngs) if untied else self.embed  # tied: the same module at two paths

  def __call__(self, ids):
    h = self.fc(self.embed(ids))
    return self.head(h) if isinstance(self.head, nnx.Linear) else self.head.attend(h)


class _TiedLinen(nn.Module):
  def setup(self):
    self.embed = nn.Embed(V, D)
    self.fc = nn.Dense(D)

  def __call__(self, ids):
    return self.embed.attend(self.fc(self.embed(ids)))


def _attend_flops(row, kept):
  """The hand count of a table attended once per row: the product of its (features, num_embeddings) kernel, as a
  compressed layer's (the weight gradient at the kept values), against the dense table's."""
  assert (row.forward_flops, row.backward_flops) == (2 * kept, 4 * kept), row.path
  assert (row.dense_forward_flops, row.dense_backward_flops) == (2 * V * D, 4 * V * D), row.path


def _dense_attend_flops():
  """XLA's count of the dense nnx.Embed.attend of one query row: the reference of the dense baseline."""
  dense = nnx.Embed(V, D, rngs=nnx.Rngs(0))
  cost = jax.jit(lambda q: dense.attend(q)).lower(jnp.ones((1, D))).compile().cost_analysis()
  return int((cost[0] if isinstance(cost, list) else cost)["flops"])


def test_nnx_tied_table_counts_its_attend():
  """A CompressedNMEmbed used as the tied LM head (embed.attend(h)) counted 0 FLOPs, dense and sparse: a dense vs sparse
  comparison of a tied-embedding LM left its largest product out. With example inputs the summary traces the model
  and counts the attend; without them the FLOPs are 0 and a note says why."""
  ids = jnp.array([[3, 1, 31]])
  model = _TiedNNX(nnx.Rngs(0))
  model.embed.embedding[...] = model.embed.embedding[...].at[5].set(0.0)  # a zero row: kept values stored as zeros
  sparse, _ = jaxsparse.sparsify(model, {"embed": jaxsparse.NM(2, 4), "fc": jaxsparse.NM(2, 4)})
  kept = (V - 1) * D // 2
  s = jaxsparse.summary(sparse, ids)
  (embed,) = [row for row in s.layers if row.path == "embed"]
  _attend_flops(embed, kept)
  assert embed.dense_forward_flops == 2 * V * D
  if jax.default_backend() == "cpu":  # the dense nnx.Embed.attend, by XLA (a GPU's cost analysis counts 2 V D - V)
    assert _dense_attend_flops() == 2 * V * D
  assert s.forward_flops == 2 * kept + 2 * D * D // 2 and s.dense_forward_flops == 2 * V * D + 2 * D * D
  assert s.notes == ()
  # The same table as a layer: an NMLinear (D, V) kernel keeping the same weights counts the same.
  layer = layers.NMLinear(D, V, n=2, m=4, rngs=nnx.Rngs(0))
  layer.kernel[...] = sparse.embed.to_dense().embedding[...].T
  (row,) = jaxsparse.summary(layer).layers
  assert (row.forward_flops, row.dense_forward_flops, row.dense_backward_flops) == (
      embed.forward_flops, embed.dense_forward_flops, embed.dense_backward_flops)
  # An abstract model and abstract inputs: the same counts (n/m of the table), nothing computed.
  abstract = jaxsparse.summary(nnx.eval_shape(lambda: sparse), jax.ShapeDtypeStruct(ids.shape, ids.dtype))
  assert [r.forward_flops for r in abstract.layers if r.path == "embed"] == [V * D]
  # Without inputs: the lookups' 0, and a note naming the table and how to count its attend.
  s = jaxsparse.summary(sparse)
  assert [r.forward_flops for r in s.layers if r.path == "embed"] == [0]
  (note,) = s.notes
  assert note.startswith("embed: an embedding table's FLOPs are those of its attend") and note in str(s)
  assert note.endswith("pass them to count it: jaxsparse.summary(model, *inputs).")
  # An untied table (a Linear head): traced, a lookup only: 0 and no note.
  untied, _ = jaxsparse.sparsify(_TiedNNX(nnx.Rngs(0), untied=True), {"embed": jaxsparse.NM(2, 4)})
  s = jaxsparse.summary(untied, ids)
  assert [(r.path, r.forward_flops, r.dense_forward_flops) for r in s.layers] == [("embed", 0, 0)]
  assert s.notes == ()


def test_linen_tied_table_counts_its_attend():
  """As NNX, for the SparsifiedLinen of sparsify_linen (its nn.Embed's attend runs as the CompressedNMEmbed's), a
  Linen CompressedNMEmbed in the user's module, and a SparsifiedLinen under nnx.bridge.ToNNX in an NNX model."""
  model, ids = _TiedLinen(), jnp.array([[3, 1, 31]])
  variables = model.init(jax.random.key(0), ids)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, {"embed": jaxsparse.NM(2, 4)}, ids)
  (row,) = jaxsparse.summary(sparse_vars, ids, module=sparse).layers
  _attend_flops(row, V * D // 2)
  s = jaxsparse.summary(sparse_vars, module=sparse)  # no inputs: the lookups' 0, and the note
  assert s.layers[0].forward_flops == 0
  assert s.notes == (
      "embed: an embedding table's FLOPs are those of its attend (a tied LM head's logits), which only running the "
      "model shows; without example inputs they are its lookups' (0). If the model calls attend, pass them to count "
      "it: jaxsparse.summary(variables, *inputs, module=...).",)

  class Direct(nn.Module):  # the Linen layer itself; tied or lookup-only
    tied: bool

    @nn.compact
    def __call__(self, ids):
      embed = linen.CompressedNMEmbed(V, D, name="tok")
      h = nn.Dense(D, name="fc")(embed(ids))
      return embed.attend(h) if self.tied else h

  for tied in (True, False):
    direct_vars = Direct(tied).init(jax.random.key(0), ids)
    s = jaxsparse.summary(direct_vars, ids, module=Direct(tied))
    (row,) = s.layers
    if tied:
      _attend_flops(row, V * D // 2)
    else:
      assert (row.forward_flops, row.dense_forward_flops) == (0, 0)
    assert s.notes == ()

  class Outer(nnx.Module):
    def __init__(self, inner):
      self.enc = inner

    def __call__(self, ids):
      return self.enc(ids)

  bridged = nnx.bridge.ToNNX(sparse, rngs=nnx.Rngs(0)).lazy_init(ids)
  nnx.update(bridged, nnx.bridge.variables.linen_vars_to_nnx_attrs(sparse_vars))
  (row,) = jaxsparse.summary(Outer(bridged), ids).layers
  assert row.path == "enc.embed"
  _attend_flops(row, V * D // 2)
  s = jaxsparse.summary(Outer(bridged))
  assert s.layers[0].forward_flops == 0 and s.notes[0].startswith("enc.embed: an embedding table's FLOPs")


@pytest.mark.parametrize("make", [
    lambda: layers.BlockSparseLinear(32, 16, density=0.5, block_shape=(8, 8), rngs=nnx.Rngs(0)),
    lambda: layers.MaskedLinear(32, 16, sparsity=0.5, rngs=nnx.Rngs(0)),
    lambda: layers.NMLinear(32, 16, rngs=nnx.Rngs(0)),
    lambda: layers.NMLinear(32, 16, rngs=nnx.Rngs(0)).to_compressed(),
], ids=["block", "masked", "nm", "compressed"])
def test_nnx_tabulate_of_a_model_with_sparse_layers(make):
  """nnx.tabulate of a model holding a BlockSparseLinear raised RecursionError (the layer iterated its nnx.Dict of
  index arrays through the Mapping methods tabulate wraps), and the model's class kept tabulate's wrapper."""
  layer = make()
  model = nnx.Sequential(layer, jax.nn.relu)
  x = jax.random.normal(jax.random.key(1), (2, 32))
  want = np.asarray(model(x))
  table = nnx.tabulate(model, x)
  assert "Sequential Summary" in table and "Total Parameters" in table
  np.testing.assert_array_equal(np.asarray(model(x)), want)  # the model still runs as before
