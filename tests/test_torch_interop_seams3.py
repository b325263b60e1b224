"""torch_interop seams, third audit (each test fails on the code before it).

* ``export_state_dict`` / ``export_masks`` of attention imported from ``torch.nn.MultiheadAttention`` write torch's
  packed ``in_proj_weight`` / ``in_proj_bias`` (``in_proj_weight_mask`` with ``format="prune"``), or with ``target=``
  the ``q/k/v_proj_weight`` of ``kdim`` / ``vdim`` and Flax's own names: the original torch module loads them with
  ``strict=True`` and computes what the Flax model does;
* ``to_linen_variables(..., report=True)`` returns the ``LoadReport`` ``load_nnx`` gives for the same state dict
  (unexpected, tied, notes, rows), ``strict=False`` lists what a target has no place for, and a tied duplicate the
  target lacks is skipped as ``load_nnx`` skips it.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
import torch.nn.utils.prune as prune  # noqa: E402

import jaxsparse  # noqa: E402
from jaxsparse import torch_interop  # noqa: E402
from jaxsparse.torch_interop import CheckpointError  # noqa: E402
from jaxsparse.torch_interop import LoadReport  # noqa: E402

# 14 tests, about 26 s on 2 cores: run by test-slow (CI runs it), so that make test stays within its 15 minutes.
pytestmark = pytest.mark.slow

ATOL = 1e-5  # float32, full-precision products on both sides


@pytest.fixture(autouse=True)
def _full_float32_products():
  """Flax's products as torch's CPU ones (a GPU would take float32 products in TF32: 1e-4 apart)."""
  with jax.default_matmul_precision("highest"):
    yield


def _seed() -> int:
  seed = int(np.random.SeedSequence().entropy % 2**31)  # fresh data each run; printed on failure by the asserts
  torch.manual_seed(seed)
  return seed


def _torch_out(mha, q, kv=None) -> np.ndarray:
  kv = q if kv is None else kv
  with torch.no_grad():
    return mha(q, kv, kv, need_weights=False)[0].numpy()


def _flax_out(attn, q, kv=None) -> np.ndarray:
  args = (jnp.asarray(q.numpy()),) if kv is None else (jnp.asarray(q.numpy()), jnp.asarray(kv.numpy()))
  return np.asarray(attn(*args))


# ------------------------------------------------------------------------------------------------- 1. attention export


@pytest.mark.parametrize("bias", [True, False])
def test_imported_attention_exports_packed_and_torch_loads_it_strictly(bias):
  seed = _seed()
  mha = torch.nn.MultiheadAttention(32, 4, bias=bias, batch_first=True).eval()
  attn = nnx.MultiHeadAttention(4, 32, use_bias=bias, decode=False, rngs=nnx.Rngs(0))
  report = torch_interop.load_nnx(attn, mha)
  state = torch_interop.export_state_dict(attn, torch_names=report.torch_names)
  expected = {"in_proj_weight", "out_proj.weight"} | ({"in_proj_bias", "out_proj.bias"} if bias else set())
  assert set(state) == expected, seed
  fresh = torch.nn.MultiheadAttention(32, 4, bias=bias, batch_first=True).eval()
  assert not fresh.load_state_dict(state, strict=True).missing_keys
  for name, tensor in mha.state_dict().items():  # the very weights it was imported from
    np.testing.assert_allclose(fresh.state_dict()[name].numpy(), tensor.numpy(), atol=ATOL, rtol=0, err_msg=name)
  x = torch.randn(2, 5, 32)
  np.testing.assert_allclose(_torch_out(fresh, x), _flax_out(attn, x), atol=ATOL, rtol=0, err_msg=f"seed {seed}")
  # The torch module as target= says the same for Flax's own names (no report needed).
  by_target = torch_interop.export_state_dict(attn, target=mha)
  assert set(by_target) == expected
  for name in expected:
    np.testing.assert_array_equal(by_target[name].numpy(), state[name].numpy())


def test_sparsified_attention_exports_in_proj_weight_mask_for_a_pruned_torch_module():
  seed = _seed()
  mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
  attn = nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0))
  report = torch_interop.load_nnx(attn, mha)
  sparse, _ = jaxsparse.sparsify(attn, {"query": jaxsparse.Unstructured(0.5)})
  state = torch_interop.export_state_dict(sparse, torch_names=report.torch_names, format="prune")
  assert set(state) == {"in_proj_weight_orig", "in_proj_weight_mask", "in_proj_bias", "out_proj.weight",
                        "out_proj.bias"}
  mask = state["in_proj_weight_mask"].numpy()
  assert state["in_proj_weight_mask"].dtype == torch.float32 and mask.shape == (96, 32)
  np.testing.assert_array_equal(mask[:32].T, np.asarray(sparse.query.layer.mask[...]))  # query's rows: its mask
  assert mask[32:].all()  # key and value are dense: all their rows kept
  fresh = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
  prune.identity(fresh, "in_proj_weight")  # the layout of a pruned torch attention
  fresh.load_state_dict(state, strict=True)
  x = torch.randn(2, 5, 32)
  np.testing.assert_allclose(_torch_out(fresh, x), _flax_out(sparse, x), atol=ATOL, rtol=0, err_msg=f"seed {seed}")
  # export_masks packs the same way: apply_masks prunes a plain torch attention with it.
  masks = torch_interop.export_masks(sparse, torch_names=report.torch_names)
  assert set(masks) == {"in_proj_weight_mask"}
  plain = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
  plain.load_state_dict(torch_interop.export_state_dict(sparse, torch_names=report.torch_names), strict=True)
  torch_interop.apply_masks(plain, masks)
  np.testing.assert_allclose(_torch_out(plain, x), _flax_out(sparse, x), atol=ATOL, rtol=0, err_msg=f"seed {seed}")


def test_a_pruned_torch_attention_round_trips_its_mask():
  seed = _seed()
  mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
  prune.l1_unstructured(mha, "in_proj_weight", amount=0.5)
  attn = nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0))
  report = torch_interop.load_nnx(attn, mha)
  state = torch_interop.export_state_dict(attn, torch_names=report.torch_names, format="prune")
  np.testing.assert_array_equal(state["in_proj_weight_mask"].numpy(), mha.in_proj_weight_mask.numpy())
  np.testing.assert_allclose(state["in_proj_weight_orig"].numpy() * state["in_proj_weight_mask"].numpy(),
                             mha.in_proj_weight.detach().numpy(), atol=ATOL, rtol=0, err_msg=f"seed {seed}")
  fresh = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
  prune.identity(fresh, "in_proj_weight")
  fresh.load_state_dict(state, strict=True)
  x = torch.randn(2, 5, 32)
  np.testing.assert_allclose(_torch_out(fresh, x), _torch_out(mha, x), atol=ATOL, rtol=0, err_msg=f"seed {seed}")
  np.testing.assert_allclose(_torch_out(fresh, x), _flax_out(attn, x), atol=ATOL, rtol=0, err_msg=f"seed {seed}")


@pytest.mark.parametrize("bias", [True, False])
def test_kdim_vdim_attention_exports_separate_weights_with_target(bias):
  seed = _seed()
  mha = torch.nn.MultiheadAttention(32, 4, kdim=16, vdim=16, bias=bias, batch_first=True).eval()
  prune.l1_unstructured(mha, "k_proj_weight", amount=0.25)
  attn = nnx.MultiHeadAttention(4, 32, in_kv_features=16, use_bias=bias, decode=False, rngs=nnx.Rngs(0))
  report = torch_interop.load_nnx(attn, mha)
  assert report.torch_names["key"] == "k_proj"  # also a plain Linear's name: target= says which it is
  state = torch_interop.export_state_dict(attn, torch_names=report.torch_names, target=mha, format="prune")
  expected = {"q_proj_weight", "k_proj_weight_orig", "k_proj_weight_mask", "v_proj_weight", "out_proj.weight"}
  assert set(state) == expected | ({"in_proj_bias", "out_proj.bias"} if bias else set())
  np.testing.assert_array_equal(state["k_proj_weight_mask"].numpy(), mha.k_proj_weight_mask.numpy())
  fresh = torch.nn.MultiheadAttention(32, 4, kdim=16, vdim=16, bias=bias, batch_first=True).eval()
  prune.identity(fresh, "k_proj_weight")
  fresh.load_state_dict(state, strict=True)
  q, kv = torch.randn(2, 5, 32), torch.randn(2, 7, 16)
  np.testing.assert_allclose(_torch_out(fresh, q, kv), _flax_out(attn, q, kv), atol=ATOL, rtol=0,
                             err_msg=f"seed {seed}")
  np.testing.assert_allclose(_torch_out(fresh, q, kv), _torch_out(mha, q, kv), atol=ATOL, rtol=0,
                             err_msg=f"seed {seed}")
  # The target as a state dict or its keys names them alike.
  for target in (mha.state_dict(), list(mha.state_dict())):
    assert set(torch_interop.export_state_dict(attn, torch_names=report.torch_names, target=target)) == (
        {"q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight"}
        | ({"in_proj_bias", "out_proj.bias"} if bias else set()))


def test_flax_built_attention_exports_to_a_torch_target_nnx_and_linen():
  seed = _seed()
  net = torch.nn.ModuleDict({"attn": torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()})
  x = torch.randn(2, 5, 32)
  # NNX: a Flax model never imported, its own names under "attn".
  holder = nnx.Dict(attn=nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(seed)))
  state = torch_interop.export_state_dict(holder, target=net)
  assert set(state) == {"attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight", "attn.out_proj.bias"}
  net.load_state_dict(state, strict=True)
  np.testing.assert_allclose(_torch_out(net["attn"], x), _flax_out(holder["attn"], x), atol=ATOL, rtol=0,
                             err_msg=f"seed {seed}")
  # Linen's nn.MultiHeadDotProductAttention (nn.DenseGeneral projections) with its module and inputs.
  linen = nn.MultiHeadDotProductAttention(4, qkv_features=32)
  xj = jnp.asarray(x.numpy())
  variables = linen.init(jax.random.key(seed), xj)
  state = torch_interop.export_state_dict(variables, xj, module=linen, target=net["attn"])
  net["attn"].load_state_dict(state, strict=True)
  np.testing.assert_allclose(_torch_out(net["attn"], x), np.asarray(linen.apply(variables, xj)), atol=ATOL, rtol=0,
                             err_msg=f"seed {seed}")


def test_plain_linears_named_like_projections_are_not_packed():
  _seed()
  # BART-like q_proj / k_proj / v_proj / out Linears: without a target that says attention, they are Linears.
  net = torch.nn.ModuleDict({n: torch.nn.Linear(8, 8) for n in ("q_proj", "k_proj", "v_proj", "out")})
  model = nnx.Dict({n: nnx.Linear(8, 8, rngs=nnx.Rngs(0)) for n in ("q_proj", "k_proj", "v_proj", "out")})
  torch_interop.load_nnx(model, net)
  for target in (None, net):
    state = torch_interop.export_state_dict(model, target=target)
    net.load_state_dict(state, strict=True)
    assert "in_proj_weight" not in state


def test_packing_refuses_what_torch_cannot_hold():
  _seed()
  mha = torch.nn.MultiheadAttention(32, 4)
  attn = nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0))
  names = dict(torch_interop.load_nnx(attn, mha).torch_names)
  with pytest.raises(CheckpointError, match=r"'in_proj_weight' packs query, key and value.*no value"):
    torch_interop.export_state_dict(attn, torch_names={**names, "value": "v"})
  with pytest.raises(CheckpointError, match=r"both the query projection"):
    torch_interop.export_state_dict(attn, torch_names={**names, "value": "in_proj[0:32]"})
  with pytest.raises(TypeError, match=r"target must be the torch.nn.Module .* got 3"):
    torch_interop.export_state_dict(attn, target=3)
  with pytest.raises(TypeError, match=r"target must be"):
    torch_interop.export_masks(attn, target="in_proj_weight")


# ------------------------------------------------------------------------------------------------- 2. Linen report


class _TiedNet(torch.nn.Module):
  """An embedding, a Linear with a pruned bias, a head tied to the embedding and a module no Flax twin has."""

  def __init__(self):
    super().__init__()
    self.embed, self.fc = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8)
    self.head = torch.nn.Linear(8, 10, bias=False)
    self.head.weight = self.embed.weight
    self.extra = torch.nn.Linear(2, 2)
    prune.l1_unstructured(self.fc, "bias", amount=0.5)


class _NNXTwin(nnx.Module):
  def __init__(self):
    self.embed, self.fc = nnx.Embed(10, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 8, rngs=nnx.Rngs(0))


class _LinenTwin(nn.Module):
  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(10, 8, name="embed")
    return embed.attend(nn.Dense(8, name="fc")(embed(ids)))


def _linen_target():
  return jax.eval_shape(_LinenTwin().init, jax.random.key(0), jnp.zeros((1, 3), jnp.int32))


@pytest.mark.parametrize("as_state_dict", [False, True])
def test_linen_report_names_what_the_nnx_report_names(as_state_dict):
  seed = _seed()
  net = _TiedNet()
  source = net.state_dict() if as_state_dict else net
  nnx_report = torch_interop.load_nnx(_NNXTwin(), source, strict=False)
  variables, report = torch_interop.to_linen_variables(source, target=_linen_target(), strict=False, report=True)
  assert isinstance(report, LoadReport)
  assert report.unexpected == nnx_report.unexpected == ["extra.weight", "extra.bias"]  # ignored: no Flax module
  assert report.tied == nnx_report.tied == {"head.weight": "embed.weight"}  # the embedding's very tensor
  assert report.notes == nnx_report.notes and len(report.notes) == 1  # the pruned bias, applied but not kept
  assert "'fc.bias' is pruned" in report.notes[0] and "not kept" in report.notes[0]
  assert report.missing == nnx_report.missing == []
  assert report.torch_names == nnx_report.torch_names == {"embed": "embed", "fc": "fc"}
  assert [r.layer for r in report.layers] == ["Embed", "Dense"]
  assert "unexpected (not used): ['extra.weight', 'extra.bias']" in str(report)
  assert set(variables) == {"params"} and set(variables["params"]) == {"embed", "fc"}
  np.testing.assert_array_equal(np.asarray(variables["params"]["fc"]["bias"]), net.fc.bias.detach().numpy(),
                                err_msg=f"seed {seed}")
  ids = jnp.asarray([[1, 4, 7]])
  logits = _LinenTwin().apply(variables, ids)
  with torch.no_grad():
    ref = net.head(net.fc(net.embed(torch.tensor([[1, 4, 7]])))).numpy()
  np.testing.assert_allclose(np.asarray(logits), ref, atol=ATOL, rtol=0, err_msg=f"seed {seed}")


def test_linen_tied_duplicate_is_skipped_and_strict_still_raises_for_the_rest():
  _seed()
  net = _TiedNet()
  with pytest.raises(CheckpointError, match=r"params\.extra\.kernel: the checkpoint has this variable but the "
                                            r"target does not \(torch 'extra\.weight'\).*strict=False"):
    torch_interop.to_linen_variables(net, target=_linen_target())
  variables, report = torch_interop.to_linen_variables(net, target=_linen_target(), ignore="extra.*", report=True)
  assert report.tied == {"head.weight": "embed.weight"} and report.unexpected == []
  # The report's tied and torch names write the tied key back: the torch model loads it strictly.
  state = torch_interop.export_state_dict(variables, jnp.zeros((1, 3), jnp.int32), module=_LinenTwin(),
                                          torch_names=report.torch_names, tied=report.tied)
  fresh = _TiedNet()
  prune.remove(fresh.fc, "bias")
  del fresh.extra
  fresh.load_state_dict(state, strict=True)
  np.testing.assert_array_equal(fresh.head.weight.detach().numpy(), net.embed.weight.detach().numpy())


def test_linen_report_strict_false_lists_missing_target_variables():
  _seed()
  net = torch.nn.ModuleDict({"fc": torch.nn.Linear(8, 8, bias=False)})
  target = jax.eval_shape(nn.Dense(8).init, jax.random.key(0), jnp.ones((1, 8)))
  target = {"params": {"fc": target["params"]}}
  with pytest.raises(CheckpointError, match=r"not in the checkpoint: params\.fc\.bias"):
    torch_interop.to_linen_variables(net, target=target)
  variables, report = torch_interop.to_linen_variables(net, target=target, strict=False, report=True)
  assert report.missing == ["params.fc.bias"] and set(variables["params"]["fc"]) == {"kernel"}


def test_linen_report_rows_match_nnx_for_sparse_layers_and_the_return_type_is_kept():
  _seed()
  net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
  prune.l1_unstructured(net[0], "weight", amount=0.75)
  prune.custom_from_mask(net[2], "weight", torch.ones(8, 64) * torch.cat([torch.ones(32), torch.zeros(32)]))  # blocks
  model = nnx.Sequential(nnx.Linear(64, 64, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(64, 8, rngs=nnx.Rngs(0)))
  nnx_report = torch_interop.load_nnx(model, net.state_dict(), name_map=[(r"^", "layers.")])
  plain = torch_interop.to_linen_variables(net.state_dict(), name_map=[(r"^", "layers_")])
  assert isinstance(plain, dict)  # without report=, the variables alone, as before
  variables, report = torch_interop.to_linen_variables(net.state_dict(), name_map=[(r"^", "layers_")], report=True)
  assert jax.tree.map(np.shape, variables) == jax.tree.map(np.shape, plain)
  assert [(r.torch_module, r.format, r.pattern) for r in report.layers] == [
      (r.torch_module, r.format, r.pattern) for r in nnx_report.layers]
  assert [r.layer for r in nnx_report.layers] == ["MaskedLinear", "BlockSparseLinear"]
  assert [r.layer for r in report.layers] == ["MaskedDense", "BlockSparseDense"]
  assert report.torch_names == {"layers_0": "0", "layers_2": "2"}
