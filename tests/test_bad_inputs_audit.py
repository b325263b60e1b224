"""Bad input to the public API gets a clear error (the argument named), never a deep traceback or a silent wrong
result: the cases the audit of 2026-12 found (ops, formats, layers), and valid edge cases that must keep computing."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsparse
from jaxsparse import _utils
from jaxsparse import ops
from jaxsparse.ops import _router


def _weights(seed: int):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  w = jax.random.normal(k1, (64, 96))
  mask = jax.random.uniform(k2, w.shape) < 0.4
  x = jax.random.normal(k3, (5, 64))
  return x, w, mask


# -------------------------------------------------------------------------------------------------
# Silent wrong: float32 operands with preferred_element_type=float64 came back float64 but float32-accurate on the
# default (C++ kernel) route of sparse_matmul / masked_matmul (about 4e-6 off a float64 product of ~1 entries).
# -------------------------------------------------------------------------------------------------

_F64_OPS = {
    "sparse_matmul": lambda x, w, mask, **kw: ops.sparse_matmul(x, jaxsparse.CSRMatrix.from_dense(w, mask), **kw),
    "masked_matmul": lambda x, w, mask, **kw: ops.masked_matmul(x, w, mask, **kw),
}


@pytest.mark.parametrize("op", sorted(_F64_OPS))
def test_float64_result_of_float32_operands_accumulates_in_float64(op):
  x, w, mask = _weights(1)
  with jax.enable_x64(True):
    want = np.asarray(x, np.float64) @ np.where(np.asarray(mask), np.asarray(w, np.float64), 0.0)
    for implementation in (None, "xla"):
      # HIGHEST: at the default precision a GPU multiplies float32 operands in TF32 (jax's default, ~1e-3 off).
      y = _F64_OPS[op](x, w, mask, implementation=implementation, preferred_element_type=jnp.float64,
                       precision=jax.lax.Precision.HIGHEST)
      assert y.dtype == jnp.float64
      # float64 sums of 64 float32 products: ~1e-15 relative; float32 accumulation was ~1e-6 off.
      np.testing.assert_allclose(np.asarray(y), want, rtol=1e-12, atol=1e-12)


def test_the_xla_path_multiplies_float32_operands_in_float64_for_a_float64_result():
  """A GPU's dot of float32 operands sums in float32 whatever ``preferred_element_type`` says (found on an H200:
  1e-5 off at HIGHEST); the XLA path casts the operands to float64 first, so every device sums in float64."""
  x, w, mask = _weights(4)
  with jax.enable_x64(True):
    for op in _F64_OPS.values():
      f = lambda x, op=op: op(x, w, mask, implementation="xla", preferred_element_type=jnp.float64)
      dots = [line for line in jax.jit(f).lower(x).as_text().splitlines() if "dot_general" in line]
      assert dots and all(re.search(r": \(tensor<[0-9x]*xf64>, tensor<[0-9x]*xf64>\)", d) for d in dots), dots
    y = _utils.matmul(x, w, precision=None, preferred_element_type=jnp.float32)  # float32 results: no cast
    assert y.dtype == jnp.float32


@pytest.mark.parametrize("op", sorted(_F64_OPS))
def test_cpu_implementation_refuses_a_float64_result(op):
  x, w, mask = _weights(2)
  with jax.enable_x64(True), pytest.raises(TypeError, match="preferred_element_type=float64"):
    _F64_OPS[op](x, w, mask, implementation="cpu", preferred_element_type=jnp.float64)


def test_cpu_implementation_keeps_narrower_results():
  with jax.default_device(jax.devices("cpu")[0]):  # implementation="cpu" runs on CPU devices (a GPU host's too)
    x, w, mask = _weights(3)
    y = ops.masked_matmul(x, w, mask, implementation="cpu", preferred_element_type=jnp.bfloat16)
    want = np.asarray(x @ jnp.where(mask, w, 0))
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=2e-2, atol=5e-2)


def test_cpu_implementation_outside_jit_on_another_platform_names_it():
  """Outside ``jit`` the CPU-only route's stand-in for other platforms raised jax's "Evaluation rule for
  'jaxsparse_unavailable' not implemented" (found on a GPU host); it names the op, the route and the platform."""
  x = jax.device_put(jnp.ones((2, 3)), jax.devices("cpu")[0])
  message = "masked_matmul: the C++ CPU kernels run only when lowered for 'cpu', and this call is lowered for " + \
      "{platforms}."
  with pytest.raises(ValueError, match=r"lowered for cpu\."):
    _router._unavailable_p.bind(x, message=message)  # CPU arrays: the message names their platform
  if jax.default_backend() != "cpu":
    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    with pytest.raises(ValueError, match=r"masked_matmul: .* run only when lowered for 'cpu'"):
      ops.masked_matmul(x, w, w > 0, implementation="cpu")


# -------------------------------------------------------------------------------------------------
# Deep errors: each case raised from inside jax / numpy (or an AttributeError) naming no argument.
# -------------------------------------------------------------------------------------------------


def _formats(seed: int):
  x, w, mask = _weights(seed)
  block_mask = jax.random.uniform(jax.random.key(seed + 100), (4, 3)) < 0.5
  return {
      "x": x, "w": w, "mask": mask,
      "bsm": jaxsparse.BlockSparseMatrix.from_dense(w, (16, 32), block_mask=block_mask.at[0, 0].set(True)),
      "csr": jaxsparse.CSRMatrix.from_dense(w, mask),
      "nm": jaxsparse.NMSparseMatrix.from_dense(w, 2, 4),
  }


_DEEP = {
    # The references took any x and any w: jax's dot_general error for a wrong K or a scalar x, an AttributeError
    # ('to_dense') for a dense w.
    "block_sparse_matmul_reference K": (
        lambda f: ops.block_sparse_matmul_reference(f["x"][:, :32], f["bsm"]), ValueError, r"x\.shape=\(5, 32\)"),
    "sparse_matmul_reference K": (
        lambda f: ops.sparse_matmul_reference(f["x"][:, :32], f["csr"]), ValueError, r"x\.shape=\(5, 32\)"),
    "nm_matmul_reference K": (
        lambda f: ops.nm_matmul_reference(f["x"][:, :32], f["nm"]), ValueError, r"x\.shape=\(5, 32\)"),
    "nm_matmul_reference 0-d x": (
        lambda f: ops.nm_matmul_reference(jnp.float32(1.0), f["nm"]), ValueError, r"x\.shape=\(\)"),
    "block_sparse_matmul_reference dense w": (
        lambda f: ops.block_sparse_matmul_reference(f["x"], f["w"]), TypeError, "w must be a jaxsparse.BlockSparse"),
    "sparse_matmul_reference dense w": (
        lambda f: ops.sparse_matmul_reference(f["x"], f["w"]), TypeError, "w must be a jaxsparse.CSRMatrix"),
    "nm_matmul_reference None w": (
        lambda f: ops.nm_matmul_reference(f["x"], None), TypeError, "w must be a jaxsparse.NMSparseMatrix"),
    # None (or a string) where an array goes: jnp.asarray's "None is not a valid value for jnp.array".
    "block_sparse_matmul None x": (lambda f: ops.block_sparse_matmul(None, f["bsm"]), TypeError, "x must be an array"),
    "sparse_matmul str x": (lambda f: ops.sparse_matmul("abc", f["csr"]), TypeError, "x must be an array"),
    "nm_matmul None x": (lambda f: ops.nm_matmul(None, f["nm"]), TypeError, "x must be an array"),
    "masked_matmul None x": (lambda f: ops.masked_matmul(None, f["w"], f["mask"]), TypeError, "x must be an array"),
    "masked_matmul None w": (lambda f: ops.masked_matmul(f["x"], None, f["mask"]), TypeError, "w must be an array"),
    "masked_matmul None mask": (lambda f: ops.masked_matmul(f["x"], f["w"], None), TypeError, "mask must be an array"),
    "sr_ste None w": (lambda f: ops.sr_ste(None, 2, 4), TypeError, "w must be an array"),
    "sr_ste_matmul None x": (lambda f: ops.sr_ste_matmul(None, f["w"], 2, 4), TypeError, "x must be an array"),
    "sr_ste_matmul None w": (lambda f: ops.sr_ste_matmul(f["x"], None, 2, 4), TypeError, "w must be an array"),
    # Checked for cuSPARSELt's availability first: on a GPU a dense w failed on w.n (AttributeError).
    "cusparselt_compress dense w": (
        lambda f: ops.cusparselt_compress(f["w"]), TypeError, "w must be a jaxsparse.NMSparseMatrix"),
    # An MLIRError ("Invalid type") from XLA's RNG.
    "random_block_mask negative shape": (
        lambda f: jaxsparse.random_block_mask(jax.random.key(0), (-64, 96), (16, 32), 0.5), ValueError,
        r"shape must be 2 ints >= 0, got \(-64, 96\)"),
    # A nested list, which nnx.Linear and the other layers take: "Cannot determine dtype of [[...]]".
    "BlockSparseLinear list inputs": (
        lambda f: jaxsparse.layers.BlockSparseLinear(64, 96, density=0.5, block_shape=(16, 32), rngs=nnx.Rngs(0))(
            [[1.0] * 64, [0.5] * 63]), TypeError, "inputs must be an array"),
    "BlockSparseMatrix.from_dense None": (
        lambda f: jaxsparse.BlockSparseMatrix.from_dense(None, (16, 32)), TypeError, "w must be an array"),
    "BlockSparseMatrix.with_data None": (lambda f: f["bsm"].with_data(None), TypeError, "data must be an array"),
    "CSRMatrix.from_dense None": (lambda f: jaxsparse.CSRMatrix.from_dense(None), TypeError, "w must be an array"),
    "CSRMatrix.with_data None": (lambda f: f["csr"].with_data(None), TypeError, "data must be an array"),
    "NMSparseMatrix.from_dense None": (
        lambda f: jaxsparse.NMSparseMatrix.from_dense(None, 2, 4), TypeError, "w must be an array"),
    "NMSparseMatrix.with_values None": (lambda f: f["nm"].with_values(None), TypeError, "values must be an array"),
    "NMSparseMatrix.gather str": (lambda f: f["nm"].gather("w"), TypeError, "dense must be an array"),
    "magnitude_mask None": (lambda f: jaxsparse.magnitude_mask(None, 0.5), TypeError, "w must be an array"),
    "nm_mask ragged list": (lambda f: jaxsparse.nm_mask([[1.0, 2.0], [3.0]], 1, 2), TypeError, "w must be an array"),
    # A conv step of 0 or below: "Cannot lower jaxpr with verifier errors" from XLA at the first call.
    "NMConv strides=0": (
        lambda f: jaxsparse.layers.NMConv(16, 32, (3, 3), strides=0, rngs=nnx.Rngs(0))(jnp.ones((1, 8, 8, 16))),
        ValueError, "strides must be a positive int"),
    "MaskedConv kernel_dilation=(1, -1)": (
        lambda f: jaxsparse.layers.MaskedConv(16, 32, (3, 3), sparsity=0.5, kernel_dilation=(1, -1),
                                              rngs=nnx.Rngs(0))(jnp.ones((1, 8, 8, 16))),
        ValueError, r"kernel_dilation must be a positive int .*got \(1, -1\)"),
    "linen NMConv input_dilation=0": (
        lambda f: jaxsparse.layers.linen.NMConv(32, (3, 3), input_dilation=0).init(
            jax.random.key(0), jnp.ones((1, 8, 8, 16))), ValueError, "input_dilation must be a positive int"),
    # An unknown padding string: lax's RuntimeError "Unrecognized padding type" at the first call.
    "MaskedConv padding='FOO'": (
        lambda f: jaxsparse.layers.MaskedConv(16, 32, (3, 3), sparsity=0.5, padding="FOO", rngs=nnx.Rngs(0)),
        ValueError, r"^MaskedConv: padding must be 'SAME', .*got padding='FOO'\."),
    "NMConv padding='FOO'": (
        lambda f: jaxsparse.layers.NMConv(16, 32, (3, 3), padding="FOO", rngs=nnx.Rngs(0)),
        ValueError, r"^NMConv: padding must be 'SAME', .*got padding='FOO'\."),
    "linen NMConv padding='FOO'": (
        lambda f: jaxsparse.layers.linen.NMConv(32, (3, 3), padding="FOO"), ValueError,
        r"^NMConv: padding must be 'SAME', .*got padding='FOO'\."),
    # Flax's "Causal padding is only implemented for 1D convolutions." at the first call, naming no layer.
    "NMConv 2-D padding='CAUSAL'": (
        lambda f: jaxsparse.layers.NMConv(16, 32, (3, 3), padding="CAUSAL", rngs=nnx.Rngs(0)),
        ValueError, r"^NMConv: padding must .*'CAUSAL' pads one spatial axis only"),
    # Flax's "Invalid padding format" at the first call: a sequence of another length than kernel_size.
    "MaskedConv padding of 3 pairs for 2-D": (
        lambda f: jaxsparse.layers.MaskedConv(16, 32, (3, 3), sparsity=0.5, padding=[(1, 1)] * 3, rngs=nnx.Rngs(0)),
        ValueError, r"^MaskedConv: padding must .*a sequence of 2 \(one per spatial axis"),
    # x=None to a Linen layer: jnp.asarray's "None is not a valid value for jnp.array" (NMDense, NMConv: a ValueError
    # about x.shape=()).
    "linen MaskedDense None x": (
        lambda f: jaxsparse.layers.linen.MaskedDense(8, sparsity=0.5).init(jax.random.key(0), None), TypeError,
        "^MaskedDense: x must be an array"),
    "linen NMDense None x": (
        lambda f: jaxsparse.layers.linen.NMDense(8).init(jax.random.key(0), None), TypeError,
        "^NMDense: x must be an array"),
    "linen BlockSparseDense None x": (
        lambda f: jaxsparse.layers.linen.BlockSparseDense(32, density=0.5, block_shape=(16, 16)).init(
            jax.random.key(0), None), TypeError, "^BlockSparseDense: x must be an array"),
    "linen CompressedNMDense None x": (
        lambda f: jaxsparse.layers.linen.CompressedNMDense(96).apply(
            {"params": {"kernel": f["nm"].values}, "sparsity": {"kernel_positions": f["nm"].indices}}, None),
        TypeError, "^CompressedNMDense: x must be an array"),
    "linen NMConv None x": (
        lambda f: jaxsparse.layers.linen.NMConv(32, (3, 3)).init(jax.random.key(0), None), TypeError,
        "^NMConv: x must be an array"),
    # jnp.asarray's "None is not a valid value for jnp.array" from the embedding's token-id check.
    "CompressedNMEmbed None inputs": (
        lambda f: jaxsparse.layers.CompressedNMEmbed.from_dense(nnx.Embed(100, 64, rngs=nnx.Rngs(0)), 2, 4)(None),
        TypeError, "^inputs must be an array"),
    "linen CompressedNMEmbed None inputs": (
        lambda f: jaxsparse.layers.linen.CompressedNMEmbed(100, 64, n=2, m=4).init(jax.random.key(0), None),
        TypeError, "^inputs must be an array"),
    # The raw constructor: jnp.asarray's "None is not a valid value for jnp.array" / "Value 'None' with dtype object".
    "NMSparseMatrix values=None": (
        lambda f: jaxsparse.NMSparseMatrix(values=None, indices=f["nm"].indices, shape=(64, 96), n=2, m=4),
        TypeError, "^values must be an array"),
    "NMSparseMatrix indices=None": (
        lambda f: jaxsparse.NMSparseMatrix(values=f["nm"].values, indices=None, shape=(64, 96), n=2, m=4),
        TypeError, "^indices must be an array"),
    "NMSparseMatrix indices str": (
        lambda f: jaxsparse.NMSparseMatrix(values=f["nm"].values, indices="ab", shape=(64, 96), n=2, m=4),
        TypeError, "^indices must be an array"),
}

# precision="bogus": jax's "Precision argument must be one of: ..." naming no argument, at the layer's first call
# (or inside a traced product) -- or no error at all, where the C++ CPU kernels ran (sparse_matmul, masked_matmul).
_BOGUS = {"precision": "bogus"}
_BAD_PRECISION = {
    "masked_matmul": lambda f: ops.masked_matmul(f["x"], f["w"], f["mask"], **_BOGUS),
    "sparse_matmul": lambda f: ops.sparse_matmul(f["x"], f["csr"], **_BOGUS),
    "block_sparse_matmul": lambda f: ops.block_sparse_matmul(f["x"], f["bsm"], **_BOGUS),
    "nm_matmul": lambda f: ops.nm_matmul(f["x"], f["nm"], **_BOGUS),
    "sr_ste_matmul": lambda f: ops.sr_ste_matmul(f["x"], f["w"], 2, 4, **_BOGUS),
    "sparse_matmul_reference": lambda f: ops.sparse_matmul_reference(f["x"], f["csr"], **_BOGUS),
    "MaskedLinear": lambda f: jaxsparse.layers.MaskedLinear(64, 96, sparsity=0.5, rngs=nnx.Rngs(0), **_BOGUS),
    "MaskedConv": lambda f: jaxsparse.layers.MaskedConv(16, 32, (3, 3), sparsity=0.5, rngs=nnx.Rngs(0), **_BOGUS),
    "BlockSparseLinear": lambda f: jaxsparse.layers.BlockSparseLinear(64, 96, density=0.5, block_shape=(16, 32),
                                                                      rngs=nnx.Rngs(0), **_BOGUS),
    "NMLinear": lambda f: jaxsparse.layers.NMLinear(64, 96, rngs=nnx.Rngs(0), **_BOGUS),
    "NMConv": lambda f: jaxsparse.layers.NMConv(16, 32, (3, 3), rngs=nnx.Rngs(0), **_BOGUS),
    "CompressedNMLinear": lambda f: jaxsparse.layers.CompressedNMLinear(f["nm"], **_BOGUS),
    "linen MaskedDense": lambda f: jaxsparse.layers.linen.MaskedDense(8, sparsity=0.5, **_BOGUS),
    "linen BlockSparseDense": lambda f: jaxsparse.layers.linen.BlockSparseDense(32, density=0.5, **_BOGUS),
    "linen NMDense": lambda f: jaxsparse.layers.linen.NMDense(8, **_BOGUS),
    "linen NMConv": lambda f: jaxsparse.layers.linen.NMConv(32, (3, 3), **_BOGUS),
    "linen CompressedNMDense": lambda f: jaxsparse.layers.linen.CompressedNMDense(96, **_BOGUS),
}


@pytest.mark.parametrize("case", sorted(_BAD_PRECISION))
def test_bad_precision_is_named(case):
  layer = case.removeprefix("linen ")
  owner = f"{layer}: " if layer[0].isupper() else ""  # layers name themselves where they are built
  message = rf"^{owner}precision must be None, a jax\.lax\.Precision .*got precision='bogus'"
  with pytest.raises(ValueError, match=message):
    _BAD_PRECISION[case](_formats(12))


@pytest.mark.parametrize("case", sorted(_DEEP))
def test_bad_input_is_named(case):
  call, error, message = _DEEP[case]
  with pytest.raises(error, match=message):
    call(_formats(4))


@pytest.mark.parametrize("case", ["block_sparse_matmul None x", "masked_matmul None mask"])
def test_bad_input_is_named_under_jit(case):
  """The checks are static: under jit a None operand is refused where the function is traced, by the same error."""
  call, error, message = _DEEP[case]
  f = _formats(5)
  with pytest.raises(error, match=message):
    jax.jit(lambda: call(f))()


# -------------------------------------------------------------------------------------------------
# Valid edge cases that must stay computed correctly.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lead", [(0,), (2, 0, 3), (2, 3)])
@pytest.mark.parametrize("op", ["bsm", "csr", "nm", "masked", "bsm_ref", "csr_ref", "nm_ref"])
def test_rows_and_leading_batch_dims(op, lead):
  f = _formats(6)
  x = jax.random.normal(jax.random.key(7), (*lead, 64))
  run = {
      "bsm": lambda: ops.block_sparse_matmul(x, f["bsm"]),
      "csr": lambda: ops.sparse_matmul(x, f["csr"]),
      "nm": lambda: ops.nm_matmul(x, f["nm"]),
      "masked": lambda: ops.masked_matmul(x, f["w"], f["mask"]),
      "bsm_ref": lambda: ops.block_sparse_matmul_reference(x, f["bsm"]),
      "csr_ref": lambda: ops.sparse_matmul_reference(x, f["csr"]),
      "nm_ref": lambda: ops.nm_matmul_reference(x, f["nm"]),
  }[op]
  dense = jnp.where(f["mask"], f["w"], 0) if op == "masked" else f[op.removesuffix("_ref")].to_dense()
  y = run()
  assert y.shape == (*lead, 96) and y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y), np.asarray(x @ dense), rtol=1e-4, atol=1e-4)


def test_references_take_what_jnp_matmul_takes():
  """The references' new shape check leaves their dtypes alone: integer x multiplies as in ``jnp.matmul``."""
  f = _formats(8)
  x = jnp.arange(2 * 64).reshape(2, 64) % 5
  np.testing.assert_allclose(np.asarray(ops.nm_matmul_reference(x, f["nm"])), np.asarray(x @ f["nm"].to_dense()),
                             rtol=1e-5, atol=1e-4)


def test_layers_take_nested_lists():
  x = np.random.default_rng(9).standard_normal((3, 64)).astype(np.float32)
  layer = jaxsparse.layers.BlockSparseLinear(64, 96, density=0.5, block_shape=(16, 32), rngs=nnx.Rngs(1))
  np.testing.assert_allclose(np.asarray(layer(x.tolist())), np.asarray(layer(jnp.asarray(x))), rtol=1e-6, atol=1e-6)
  compressed = jaxsparse.layers.CompressedNMLinear(jaxsparse.NMSparseMatrix.from_dense(_weights(9)[1], 2, 4))
  np.testing.assert_allclose(np.asarray(compressed(x.tolist())), np.asarray(compressed(jnp.asarray(x))), rtol=1e-6,
                             atol=1e-6)


def test_random_block_mask_takes_empty_and_numpy_shapes():
  m = jaxsparse.random_block_mask(jax.random.key(0), (np.int64(0), 96), (16, 32), 0.5)
  assert m.shape == (0, 3) and m.dtype == jnp.bool_


def test_messages_name_the_argument_and_the_value():
  f = _formats(10)
  with pytest.raises(TypeError, match=re.escape("got NoneType")):
    ops.sparse_matmul(None, f["csr"])
  with pytest.raises(TypeError, match=re.escape("got ArrayImpl")):
    ops.sparse_matmul_reference(f["x"], f["w"])


def test_conv_steps_keep_working():
  """Valid strides and dilations (a NumPy int too, which nnx.Conv found "not iterable") compute as nnx.Conv does."""
  x = jax.random.normal(jax.random.key(11), (2, 9, 9, 8))
  conv = jaxsparse.layers.MaskedConv(8, 16, (3, 3), sparsity=0.25, strides=np.int64(2), kernel_dilation=(1, 2),
                                     rngs=nnx.Rngs(2))
  dense = nnx.Conv(8, 16, (3, 3), strides=2, kernel_dilation=(1, 2), rngs=nnx.Rngs(0))
  dense.kernel[...] = jnp.where(conv.mask[...], conv.kernel[...], 0)
  dense.bias[...] = conv.bias[...]
  np.testing.assert_allclose(np.asarray(conv(x)), np.asarray(dense(x)), rtol=1e-5, atol=1e-5)
  nm = jaxsparse.layers.NMConv(8, 16, (3, 3), strides=(2, 1), input_dilation=None, rngs=nnx.Rngs(3))
  assert nm(x).shape == (2, 5, 9, 16)


# A keyword typo in a layer that hands its other keywords to Flax's layer named Flax's class ("Linear.__init__() got
# an unexpected keyword argument").
_TYPOS = {
    "NMLinear": lambda **kw: jaxsparse.layers.NMLinear(8, 4, rngs=nnx.Rngs(0), **kw),
    "NMConv": lambda **kw: jaxsparse.layers.NMConv(8, 4, (3,), rngs=nnx.Rngs(0), **kw),
    "MaskedConv": lambda **kw: jaxsparse.layers.MaskedConv(8, 4, (3,), sparsity=0.5, rngs=nnx.Rngs(0), **kw),
}


@pytest.mark.parametrize("layer", sorted(_TYPOS))
def test_keyword_typo_names_the_layer(layer):
  with pytest.raises(TypeError, match=rf"^{layer} got unexpected keyword arguments \['kernel_metdata'\]"):
    _TYPOS[layer](kernel_metdata={})
  _TYPOS[layer](kernel_metadata={})  # Flax's own keywords still pass through


# What Flax's convolutions take (lax's strings in any case, Flax's own modes, ints and (low, high) pairs) keeps
# computing as nnx.Conv computes it; a NumPy int and list pairs, which Flax refused, are taken as ints and tuples.
_PADDINGS = {  # ours: nnx.Conv's equivalent
    "SAME": "SAME", "same": "same", "VALID": "VALID", "valid": "valid", "SAME_LOWER": "SAME_LOWER",
    "CIRCULAR": "CIRCULAR", "REFLECT": "REFLECT", "1": 1, "np.int64(2)": 2, "pairs": [(1, 0), (0, 2)],
    "int and pair": [1, (0, 2)], "list pair": [(1, 1), (2, 0)],
}
_OURS = {"np.int64(2)": np.int64(2), "list pair": ((1, 1), [2, 0])}


@pytest.mark.parametrize("case", list(_PADDINGS))
def test_conv_paddings_keep_working(case):
  x = jax.random.normal(jax.random.key(13), (2, 9, 8, 8))
  padding = _OURS.get(case, _PADDINGS[case])
  dense = nnx.Conv(8, 16, (3, 3), padding=_PADDINGS[case], rngs=nnx.Rngs(0))
  conv = jaxsparse.layers.MaskedConv(8, 16, (3, 3), sparsity=0.25, padding=padding, rngs=nnx.Rngs(4))
  dense.kernel[...] = jnp.where(conv.mask[...], conv.kernel[...], 0)
  dense.bias[...] = conv.bias[...]
  np.testing.assert_allclose(np.asarray(conv(x)), np.asarray(dense(x)), rtol=1e-5, atol=1e-5)
  nm = jaxsparse.layers.NMConv(8, 16, (3, 3), padding=padding, rngs=nnx.Rngs(5))
  assert nm(x).shape == dense(x).shape
  linen = jaxsparse.layers.linen.NMConv(16, (3, 3), padding=padding)
  assert linen.apply(linen.init(jax.random.key(0), x), x).shape == dense(x).shape


def test_causal_padding_keeps_working_in_1d():
  x = jax.random.normal(jax.random.key(14), (2, 10, 8))
  conv = jaxsparse.layers.MaskedConv(8, 4, (3,), sparsity=0.5, padding="CAUSAL", rngs=nnx.Rngs(6))
  dense = nnx.Conv(8, 4, (3,), padding="CAUSAL", rngs=nnx.Rngs(0))
  dense.kernel[...] = jnp.where(conv.mask[...], conv.kernel[...], 0)
  dense.bias[...] = conv.bias[...]
  np.testing.assert_allclose(np.asarray(conv(x)), np.asarray(dense(x)), rtol=1e-5, atol=1e-5)
  assert jaxsparse.layers.NMConv(8, 4, (3,), padding="CAUSAL", rngs=nnx.Rngs(7))(x).shape == (2, 10, 4)


# Every precision form jax takes, and near misses it refuses (the members' own names, a mixed or long pair, an int).
_PRECISIONS = [None, "highest", "float32", "high", "bfloat16_3x", "tensorfloat32", "default", "fastest", "bfloat16",
               jax.lax.Precision.HIGHEST, ("highest", "default"), ["high", "high"],
               (jax.lax.Precision.HIGH, jax.lax.Precision.DEFAULT), "F32_F32_F32", jax.lax.DotAlgorithmPreset.DEFAULT,
               "HIGHEST", "bogus", ("highest", jax.lax.Precision.HIGH), ("highest",) * 3, 2, ("F32_F32_F32",) * 2]


@pytest.mark.parametrize("precision", _PRECISIONS, ids=repr)
def test_precision_check_takes_what_lax_takes(precision):
  a = jnp.ones((2, 3))
  try:
    jax.lax.dot(a, a.T, precision=precision)
    lax_takes = True
  except (ValueError, TypeError):
    lax_takes = False
  try:
    _utils.check_precision(precision)
    ours = True
  except ValueError:
    ours = False
  assert ours == lax_takes


@pytest.mark.parametrize("precision", [jax.lax.Precision.HIGHEST, "highest", ["highest", "highest"], "F32_F32_F32"],
                         ids=repr)
def test_ops_and_layers_take_valid_precisions(precision):
  """A list pair, which lax takes, is passed on as a tuple: nm_matmul failed on it ("Non-hashable static
  arguments")."""
  f = _formats(15)
  want = np.asarray(f["x"], np.float64) @ np.asarray(f["nm"].to_dense(), np.float64)  # not TF32, as a GPU's x @ w
  for op in (ops.nm_matmul, ops.nm_matmul_reference):
    np.testing.assert_allclose(np.asarray(op(f["x"], f["nm"], precision=precision)), want, rtol=1e-5, atol=1e-5)
  y = jax.grad(lambda x: ops.masked_matmul(x, f["w"], f["mask"], precision=precision).sum())(f["x"])
  np.testing.assert_allclose(np.asarray(y), np.asarray(jnp.where(f["mask"], f["w"], 0).sum(1)[None].repeat(5, 0)),
                             rtol=1e-5, atol=1e-5)
  layer = jaxsparse.layers.CompressedNMLinear(f["nm"], precision=precision)
  np.testing.assert_allclose(np.asarray(layer(f["x"])), want, rtol=1e-5, atol=1e-5)
  model = jaxsparse.layers.linen.MaskedDense(8, sparsity=0.5, precision=precision)
  assert model.apply(model.init(jax.random.key(0), f["x"]), f["x"]).shape == (5, 8)


def test_linen_layers_take_lists_and_numpy():
  x = np.random.default_rng(16).standard_normal((3, 64)).astype(np.float32)
  for model in (jaxsparse.layers.linen.MaskedDense(8, sparsity=0.5), jaxsparse.layers.linen.NMDense(8),
                jaxsparse.layers.linen.BlockSparseDense(32, density=0.5, block_shape=(16, 16))):
    variables = model.init(jax.random.key(1), x)
    want = np.asarray(model.apply(variables, jnp.asarray(x)))
    np.testing.assert_allclose(np.asarray(model.apply(variables, x.tolist())), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(model.apply(variables, x)), want, rtol=1e-6, atol=1e-6)


def test_nm_constructor_takes_numpy_and_lists():
  nm = _formats(17)["nm"]
  again = jaxsparse.NMSparseMatrix(nm.values.tolist(), np.asarray(nm.indices), shape=nm.shape, n=2, m=4)
  np.testing.assert_array_equal(np.asarray(again.to_dense()), np.asarray(nm.to_dense()))
