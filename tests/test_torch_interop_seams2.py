"""torch_interop on torch users' own checkpoints: the seams an audit found (each test fails on the code before it).

* ``ignore=`` as one string is one pattern (not its characters), ``None`` no pattern, anything else a TypeError;
* a pickle of protocol 4 / 5 is named as such (the weights-only loader does not read it), and never run;
* ``format="bsr"`` state dicts load in torch with ``assign=True`` (documented);
* a tied torch model (``head.weight`` is ``embed.weight``) loads into a Flax twin without a head module, and
  ``export_state_dict(tied=)`` writes the tied key back for torch's ``strict=True``; the Llama example both ways;
* ``nn.MultiheadAttention``'s packed ``in_proj_weight`` / ``in_proj_bias`` load into NNX and Linen attention with
  torch's outputs, dense and pruned, ``batch_first`` either way;
* a pruned bias loads dense, and the report says so.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
import torch.nn.utils.prune as prune  # noqa: E402

from jaxsparse import torch_interop  # noqa: E402
from jaxsparse.torch_interop import CheckpointError  # noqa: E402

SEQ = [(r"^", "layers.")]  # torch.nn.Sequential "0" -> nnx.Sequential "layers.0"


@pytest.fixture(autouse=True)
def _full_float32_products():
  """Flax's products as torch's CPU ones (a GPU would take float32 products in TF32: 1e-4 apart)."""
  with jax.default_matmul_precision("highest"):
    yield


def _two_linears():
  torch.manual_seed(0)
  net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
  model = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 4, rngs=nnx.Rngs(0)))
  return net, model


# ------------------------------------------------------------------------------------------------- 1. ignore=


def test_ignore_as_one_string_is_one_pattern():
  net, model = _two_linears()
  report = torch_interop.load_nnx(model, net.state_dict(), name_map=SEQ, ignore="1.*", strict=False)
  assert [row.flax_path for row in report.layers] == ["layers.0"]  # "*" alone (a character) skipped every parameter
  assert report.missing == ["layers.1.kernel", "layers.1.bias"]
  np.testing.assert_array_equal(np.asarray(model.layers[0].kernel[...]), net[0].weight.detach().numpy().T)
  with pytest.raises(CheckpointError, match=r"\['layers.1.kernel', 'layers.1.bias'\]"):
    torch_interop.load_nnx(_two_linears()[1], net.state_dict(), name_map=SEQ, ignore="1.*")


def test_ignore_none_is_no_pattern_and_other_values_raise():
  net, model = _two_linears()
  report = torch_interop.load_nnx(model, net.state_dict(), name_map=SEQ, ignore=None)
  assert [row.flax_path for row in report.layers] == ["layers.0", "layers.1"]
  assert torch_interop.load_nnx(model, net.state_dict(), name_map=SEQ, ignore={"x.*"}).layers == report.layers
  for bad in (3, ["0.*", 3], b"0.*"):
    with pytest.raises(TypeError, match=r"ignore must be .*got " + ("3" if bad == 3 else "")):
      torch_interop.load_nnx(model, net.state_dict(), name_map=SEQ, ignore=bad)


def test_to_linen_variables_takes_ignore_as_one_string_or_none():
  net, _ = _two_linears()
  assert set(torch_interop.to_linen_variables(net.state_dict(), ignore="1.*")["params"]) == {"0"}
  assert set(torch_interop.to_linen_variables(net.state_dict(), ignore=None)["params"]) == {"0", "1"}
  with pytest.raises(TypeError, match="ignore must be"):
    torch_interop.to_linen_variables(net.state_dict(), ignore=1.5)


# ------------------------------------------------------------------------------------------------- 2. pickle protocol


class _Runs:
  """A pickle that would write a file if it were ever unpickled with code."""

  def __init__(self, path):
    self.path = str(path)

  def __reduce__(self):
    return (Path.touch, (Path(self.path),))


@pytest.mark.parametrize("protocol", [4, 5])
def test_pickle_protocol_4_and_5_are_named_and_never_run(tmp_path, protocol):
  sd = torch.nn.Linear(4, 3).state_dict()
  torch.save(sd, tmp_path / "zip.pt", pickle_protocol=protocol)
  torch.save(sd, tmp_path / "legacy.pt", pickle_protocol=protocol, _use_new_zipfile_serialization=False)
  with open(tmp_path / "raw.pkl", "wb") as f:
    pickle.dump({"weight": _Runs(tmp_path / "ran")}, f, protocol=protocol)
  for name in ("zip.pt", "legacy.pt", "raw.pkl"):
    with pytest.raises(CheckpointError, match=rf"pickle of protocol {protocol} .*FRAME.*default protocol.*safetensors"):
      torch_interop.load_state_dict(tmp_path / name)
  assert not (tmp_path / "ran").exists()
  torch.save(sd, tmp_path / "default.pt")  # torch.save's default protocol (2) loads
  assert sorted(torch_interop.load_state_dict(tmp_path / "default.pt")) == ["bias", "weight"]


def test_a_protocol_2_pickle_that_needs_code_is_still_called_so(tmp_path):
  with open(tmp_path / "raw.pkl", "wb") as f:
    pickle.dump({"weight": _Runs(tmp_path / "ran")}, f, protocol=2)
  with pytest.raises(CheckpointError, match="needs arbitrary pickled Python code"):
    torch_interop.load_state_dict(tmp_path / "raw.pkl")
  assert not (tmp_path / "ran").exists()


# ------------------------------------------------------------------------------------------------- 3. BSR + assign=True


def test_bsr_export_loads_into_torch_with_assign_true():
  assert "assign=True" in torch_interop.export_state_dict.__doc__
  torch.manual_seed(0)
  net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
  prune.custom_from_mask(net[0], "weight", torch.eye(2).kron(torch.ones(32, 32)))
  model = nnx.Sequential(nnx.Linear(64, 64, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(64, 32, rngs=nnx.Rngs(1)))
  report = torch_interop.load_nnx(model, net.state_dict(), name_map=SEQ)
  state = torch_interop.export_state_dict(model, format="bsr", torch_names=report.torch_names)
  fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
  fresh.load_state_dict(state, strict=True, assign=True)
  assert fresh[0].weight.layout == torch.sparse_bsr
  x = torch.randn(3, 64)
  with torch.no_grad():
    np.testing.assert_allclose(fresh(x).numpy(), net(x).numpy(), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------- 4./5. tied weights


class _TiedLM(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.embed = torch.nn.Embedding(50, 16)
    self.head = torch.nn.Linear(16, 50, bias=False)
    self.head.weight = self.embed.weight

  def forward(self, ids):
    return self.head(self.embed(ids))


class _FlaxTiedLM(nnx.Module):
  def __init__(self):
    self.embed = nnx.Embed(50, 16, rngs=nnx.Rngs(0))

  def __call__(self, ids):
    return self.embed.attend(self.embed(ids))


def test_tied_torch_model_loads_into_a_twin_without_a_head_and_exports_back(tmp_path):
  torch.manual_seed(0)
  net = _TiedLM()
  ids = torch.randint(0, 50, (2, 7))
  with torch.no_grad():
    ref = net(ids).numpy()
  torch.save(net.state_dict(), tmp_path / "tied.pt")  # torch.save keeps the sharing
  for source in (net, net.state_dict(), tmp_path / "tied.pt"):
    model = _FlaxTiedLM()
    report = torch_interop.load_nnx(model, source)
    assert report.tied == {"head.weight": "embed.weight"} and report.unexpected == []
    assert "tied (the same tensor as a loaded one; skipped): {'head.weight': 'embed.weight'}" in str(report)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids.numpy()))), ref, atol=1e-5, rtol=0)
  state = torch_interop.export_state_dict(model, torch_names=report.torch_names, tied=report.tied)
  assert sorted(state) == ["embed.weight", "head.weight"] and state["head.weight"] is state["embed.weight"]
  back = _TiedLM()
  back.load_state_dict(state, strict=True)
  with torch.no_grad():
    np.testing.assert_allclose(back(ids).numpy(), ref, atol=1e-5, rtol=0)


def test_only_the_very_same_tensor_is_skipped_as_tied():
  torch.manual_seed(0)
  net = _TiedLM()
  copy = {**net.state_dict(), "head.weight": net.embed.weight.detach().clone()}  # equal values, its own memory
  with pytest.raises(CheckpointError, match=r"no Flax module: 'head.weight'"):
    torch_interop.load_nnx(_FlaxTiedLM(), copy)
  extra = {**net.state_dict(), "extra.weight": torch.zeros(3)}
  with pytest.raises(CheckpointError, match=r"no Flax module: 'extra.weight'"):
    torch_interop.load_nnx(_FlaxTiedLM(), extra)
  report = torch_interop.load_nnx(_FlaxTiedLM(), extra, strict=False)
  assert report.unexpected == ["extra.weight"] and report.tied == {"head.weight": "embed.weight"}
  # Pruned, the embedding loads masked, while torch's tied head computes with all of it: not the same weights.
  prune.l1_unstructured(net.embed, "weight", amount=0.5)
  with pytest.raises(CheckpointError, match=r"no Flax module: 'head.weight'"):
    torch_interop.load_nnx(_FlaxTiedLM(), net)


def test_export_tied_needs_a_written_key_and_a_new_name():
  model = _FlaxTiedLM()
  state = torch_interop.export_state_dict(model, tied={"head.weight": "embed.weight"})
  assert state["head.weight"] is state["embed.weight"]
  with pytest.raises(CheckpointError, match=r"writes no 'embd.weight' \(close: \['embed.weight'\]\)"):
    torch_interop.export_state_dict(model, tied={"head.weight": "embd.weight"})
  with pytest.raises(CheckpointError, match=r"writes 'embed.weight' itself"):
    torch_interop.export_state_dict(model, tied={"embed.weight": "embed.weight"})
  with pytest.raises(TypeError, match="tied must be a mapping"):
    torch_interop.export_state_dict(model, tied="head.weight")


def test_tied_llama_loads_from_transformers_and_exports_back_strictly(tmp_path):
  transformers = pytest.importorskip("transformers")
  sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
  import llama  # noqa: PLC0415 -- the example, on the path just above

  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                 bos_token_id=None, eos_token_id=None, pad_token_id=None)
  hf = transformers.LlamaForCausalLM(cfg).eval()
  prune.l1_unstructured(hf.model.layers[0].self_attn.q_proj, "weight", amount=0.5)
  ids = torch.randint(0, 96, (2, 9))
  with torch.no_grad():
    ref = hf(ids).logits.numpy()
  config = llama.LlamaConfig.from_dict(hf.config.to_dict())
  model = llama.LlamaForCausalLM(config, rngs=nnx.Rngs(1))
  assert model.lm_head is None
  report = torch_interop.load_nnx(model, hf)  # the README's flow, with no ignore=
  assert report.tied == {"lm_head.weight": "model.embed_tokens.weight"}
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids.numpy()))), ref, atol=1e-4, rtol=0)
  state = torch_interop.export_state_dict(model, format="prune", tied=report.tied)
  back = transformers.LlamaForCausalLM(cfg).eval()
  prune.identity(back.model.layers[0].self_attn.q_proj, "weight")
  back.load_state_dict(state, strict=True)
  with torch.no_grad():
    np.testing.assert_allclose(back(ids).logits.numpy(), ref, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------------- 6. packed attention


def _torch_attention(mha, x, batch_first):
  with torch.no_grad():
    xin = x if batch_first else x.transpose(0, 1)
    out = mha(xin, xin, xin, need_weights=False)[0]
    return (out if batch_first else out.transpose(0, 1)).numpy()


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("pruned", [False, True])
def test_multihead_attention_loads_into_nnx_and_linen_attention(batch_first, pruned):
  torch.manual_seed(0)
  mha = torch.nn.MultiheadAttention(32, 4, batch_first=batch_first).eval()
  if pruned:
    prune.l1_unstructured(mha, "in_proj_weight", amount=0.5)
  x = torch.randn(2, 5, 32)
  ref = _torch_attention(mha, x, batch_first)
  attn = nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0))
  report = torch_interop.load_nnx(attn, mha)
  rows = {r.flax_path: r.torch_module for r in report.layers}
  assert rows == {"query": "in_proj[0:32]", "key": "in_proj[32:64]", "value": "in_proj[64:96]", "out": "out_proj"}
  np.testing.assert_allclose(np.asarray(attn(jnp.asarray(x.numpy()))), ref, atol=1e-5, rtol=0)
  if pruned:
    mask = mha.in_proj_weight_mask.bool().numpy()
    for i, proj in enumerate(("query", "key", "value")):
      layer = getattr(attn, proj)
      assert type(layer).__name__ == "SparseLinearGeneral"
      np.testing.assert_array_equal(np.asarray(layer.layer.mask[...]).T, mask[32 * i:32 * (i + 1)])
  linen = nn.MultiHeadDotProductAttention(4, qkv_features=32)
  xj = jnp.asarray(x.numpy())
  variables = torch_interop.to_linen_variables(mha.state_dict(),
                                               target=jax.eval_shape(linen.init, jax.random.key(0), xj))
  assert ("masks" in variables) == pruned
  variables.pop("masks", None)  # the kernels are zero where pruned
  np.testing.assert_allclose(np.asarray(linen.apply(variables, xj)), ref, atol=1e-5, rtol=0)


def test_multihead_attention_with_kdim_vdim_and_bias_kv():
  torch.manual_seed(0)
  mha = torch.nn.MultiheadAttention(32, 4, kdim=16, vdim=16, batch_first=True).eval()  # q/k/v_proj_weight apart
  q, kv = torch.randn(2, 5, 32), torch.randn(2, 7, 16)
  with torch.no_grad():
    ref = mha(q, kv, kv, need_weights=False)[0].numpy()
  attn = nnx.MultiHeadAttention(4, 32, in_kv_features=16, decode=False, rngs=nnx.Rngs(0))
  report = torch_interop.load_nnx(attn, mha)
  assert {r.flax_path: r.torch_module for r in report.layers}["key"] == "k_proj"
  np.testing.assert_allclose(np.asarray(attn(jnp.asarray(q.numpy()), jnp.asarray(kv.numpy()))), ref, atol=1e-5,
                             rtol=0)
  with_kv = torch.nn.MultiheadAttention(32, 4, add_bias_kv=True, batch_first=True)
  with pytest.raises(CheckpointError, match=r"no Flax module: 'bias_k'.*'bias_v'"):
    torch_interop.load_nnx(nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0)), with_kv)


# ------------------------------------------------------------------------------------------------- 7. pruned bias


def test_a_pruned_bias_loads_dense_and_the_report_says_so():
  torch.manual_seed(0)
  net = torch.nn.Sequential(torch.nn.Linear(8, 8))
  prune.l1_unstructured(net[0], "weight", 0.5)
  model = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)))
  assert torch_interop.load_nnx(model, net.state_dict(), name_map=SEQ).notes == []
  prune.l1_unstructured(net[0], "bias", 0.5)
  report = torch_interop.load_nnx(model, net.state_dict(), name_map=SEQ)
  (note,) = report.notes
  assert "'0.bias' is pruned" in note and "not kept" in note and "'layers.0.bias' is dense" in note
  assert f"note: {note}" in str(report)
  np.testing.assert_array_equal(np.asarray(model.layers[0].bias[...]), net[0].bias.detach().numpy())
