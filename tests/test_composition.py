"""The composition matrix (issue 36): layer kind x pattern x framework x path, each cell a round trip or a clear error.

Every cell of ``CELLS`` runs one path on one small model and checks that it gives back exactly what went in (the
sparse model computes the dense model with the mask applied, masks survive the path, restores give equal outputs),
or, for the cells in ``RAISES``, that it fails with an error naming the layer and what is supported. ``NOT_A_CELL``
lists the combinations that have nothing to run (no such layer exists), with the reason. The table in
``docs/guides/composition.md`` is generated from these three (``python tests/test_composition.py`` rewrites it) and
``test_docs_table_matches_the_matrix`` fails when they drift apart.
"""

from __future__ import annotations

import itertools
import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxsparse
from jaxsparse import layers
from jaxsparse import pruning
from jaxsparse.layers import linen as sparse_linen

KINDS = ("linear", "attention", "attention_nobias", "conv", "embed")
PATTERNS = ("block", "nm", "unstructured")
FRAMEWORKS = ("nnx", "linen")
PATHS = ("build", "sparsify", "prune", "dst", "calibrated", "torch", "orbax", "summary", "export")

KIND_NAMES = {
    "linear": "Linear / Dense",
    "attention": "MultiHeadAttention q/k/v/out (LinearGeneral / DenseGeneral)",
    "attention_nobias": "MultiHeadAttention without biases (use_bias=False), pruned with views=kernel_views(model)",
    "conv": "Conv",
    "embed": "Embed",
}
PATH_NAMES = {
    "build": "build directly",
    "sparsify": "sparsify",
    "prune": "gradual pruning -> get_masks -> sparsify",
    "dst": "RigL (NNX) / SET (Linen) -> get_masks -> sparsify",
    "calibrated": "calibrated_prune -> sparsify",
    "torch": "torch checkpoint -> load_nnx (NNX) / CLI convert (Linen)",
    "orbax": "orbax save -> abstract restore",
    "summary": "summary / plot_pattern",
    "export": "export_masks -> torch apply_masks",
}
SPECS = {
    "block": jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8)),
    "nm": jaxsparse.NM(2, 4),
    "unstructured": jaxsparse.Unstructured(sparsity=0.5),
}
D, HEADS, VOCAB = 32, 2, 64

# (kind, pattern, framework, path) -> (regex the error must match, the gist for the docs table). "*" matches any.
EMBED = r"layer \((nnx|nn)\.Embed\): rule 'layer' .*an embedding takes only NM\(n, m\) rules"
RAISES = {
    ("conv", "block", "*", "sparsify"): (r"layer: BlockSparse does not apply to (nnx|nn)\.Conv layers; use "
                                          r"jaxsparse\.NM.* or jaxsparse\.Unstructured", "BlockSparse does not apply "
                                          "to Conv layers; use NM or Unstructured"),
    ("conv", "block", "*", "prune"): (r"layer: BlockSparse does not apply to (nnx|nn)\.Conv layers",
                                      "sparsify: BlockSparse does not apply to Conv layers"),
    ("conv", "block", "*", "dst"): (r"layer: BlockSparse does not apply to (nnx|nn)\.Conv layers",
                                    "sparsify: BlockSparse does not apply to Conv layers"),
    ("conv", "block", "*", "calibrated"): (r"layer: BlockSparse does not apply to convolutions",
                                           "BlockSparse does not apply to convolutions"),
    ("conv", "block", "*", "orbax"): (r"layer: BlockSparse does not apply to (nnx|nn)\.Conv layers",
                                      "sparsify: BlockSparse does not apply to Conv layers"),
    ("conv", "block", "*", "summary"): (r"layer: BlockSparse does not apply to (nnx|nn)\.Conv layers",
                                        "sparsify: BlockSparse does not apply to Conv layers"),
    ("conv", "block", "*", "export"): (r"layer: BlockSparse does not apply to (nnx|nn)\.Conv layers",
                                       "sparsify: BlockSparse does not apply to Conv layers"),
    ("*", "nm", "*", "dst"): (r"rule 'layer[^']*': SET and RigL support Unstructured and BlockSparse rules",
                              "SET / RigL take Unstructured and BlockSparse"),  # where the pruner is built
    **{("embed", p, "*", path): (EMBED, "sparsify: an Embed takes NM rules only")
       for p in ("block", "unstructured")
       for path in ("sparsify", "prune", "dst", "calibrated", "orbax", "summary", "export")},
}

# (kind, pattern, framework, path) -> why there is nothing to run. "*" matches any.
NOT_A_CELL = {
    ("conv", "block", "*", "build"): "no block-sparse conv layer",
    ("conv", "block", "*", "torch"): "a block mask on a torch conv loads as a plain mask (torch unstructured cell)",
    ("conv", "unstructured", "linen", "build"): "Flax's own nn.Conv(mask=...)",
    ("attention", "*", "linen", "build"): "no Linen sparse DenseGeneral layer: sparsify_linen builds it",
    ("embed", "nm", "*", "build"): None,  # CompressedNMEmbed (NNX and Linen)
    ("embed", "*", "*", "build"): "embeddings are stored N:M only (CompressedNMEmbed)",
    ("embed", "nm", "*", "torch"): None,  # a 2:4 torch Embedding loads as a CompressedNMEmbed (Linen: through masks)
    ("embed", "*", "*", "torch"): "a torch Embedding loads dense (nnx.Embed / embedding); N:M ones compressed",
    **{("attention_nobias", "*", "*", path): "the bias plays no part in this path: see MultiHeadAttention above"
       for path in ("build", "sparsify", "calibrated", "torch", "orbax", "summary", "export")},
}


def _lookup(table, cell):
  """The value of the first key matching ``cell`` (``None`` values: a cell, ahead of a broader key)."""
  for key, value in table.items():
    if all(k in ("*", c) for k, c in zip(key, cell, strict=True)):
      return value
  return None


ALL = list(itertools.product(KINDS, PATTERNS, FRAMEWORKS, PATHS))
CELLS = [c for c in ALL if _lookup(NOT_A_CELL, c) is None]


def cell_result(cell) -> str:
  """The docs table's entry for ``cell``."""
  if (why := _lookup(NOT_A_CELL, cell)) is not None:
    return f"n/a: {why}"
  if (raises := _lookup(RAISES, cell)) is not None:
    return f"raises: {raises[1]}"
  return "round trip"


# -------------------------------------------------------------------------------------------------
# Models: a module whose one layer (``layer``) is the layer kind; attention is one nnx.MultiHeadAttention /
# nn.MultiHeadDotProductAttention whose q/k/v/out projections are the rule's layers.
# -------------------------------------------------------------------------------------------------


def rules_for(kind, pattern):
  spec = SPECS[pattern]
  return {r"layer\.(query|key|value|out)": spec} if _attention(kind) else {"layer": spec}


def sparse_paths(kind):
  return [f"layer.{p}" for p in ("key", "out", "query", "value")] if _attention(kind) else ["layer"]


def _attention(kind):
  return kind in ("attention", "attention_nobias")


def x_for(kind, seed=1):
  key = jax.random.key(seed)
  if kind == "conv":
    return jax.random.normal(key, (2, 6, 6, 8))
  if kind == "embed":
    return jax.random.randint(key, (2, 5), 0, VOCAB)
  return jax.random.normal(key, (2, 3, D) if _attention(kind) else (3, D))


class NNXNet(nnx.Module):
  def __init__(self, kind, rngs):
    if kind == "linear":
      self.layer = nnx.Linear(D, D, rngs=rngs)
    elif _attention(kind):
      self.layer = nnx.MultiHeadAttention(HEADS, D, qkv_features=D, decode=False, use_bias=kind == "attention",
                                          rngs=rngs)
    elif kind == "conv":
      self.layer = nnx.Conv(8, 16, (3, 3), rngs=rngs)
    else:
      self.layer = nnx.Embed(VOCAB, D, rngs=rngs)

  def __call__(self, x):
    return self.layer(x)


class LinenNet(nn.Module):
  kind: str

  @nn.compact
  def __call__(self, x):
    if self.kind == "linear":
      return nn.Dense(D, name="layer")(x)
    if _attention(self.kind):
      return nn.MultiHeadDotProductAttention(HEADS, qkv_features=D, use_bias=self.kind == "attention",
                                             name="layer")(x)
    if self.kind == "conv":
      return nn.Conv(16, (3, 3), name="layer")(x)
    return nn.Embed(VOCAB, D, name="layer")(x)


def nnx_model(kind, seed=0):
  return NNXNet(kind, nnx.Rngs(seed))


def linen_model(kind, seed=0):
  module = LinenNet(kind)
  return module, module.init(jax.random.key(seed), x_for(kind))


# A GPU computes float32 products at jax's default precision in TF32 (10-bit mantissa; dense, sparse kernels and torch
# each round differently): the same cells run there with `benchmarks/run_gpu.sh tests` at that precision's tolerance.
TOL = 1e-5 if jax.default_backend() == "cpu" else 2e-3


def close(a, b):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=TOL, atol=TOL)


def _get(tree, dotted):
  for k in dotted.split("."):
    tree = tree[k]
  return tree


def leaf(kind):
  """The weight's name: an embedding's table, else the kernel."""
  return "embedding" if kind == "embed" else "kernel"


def nnx_kernels(model, kind):
  """``{path: kernel}`` of the dense layers of ``model`` (kernel in the layer's own shape; an embedding's table)."""
  return {p: np.asarray(_get(nnx.state(model, nnx.Param), p)[leaf(kind)][...]) for p in sparse_paths(kind)}


def nnx_sparse_kernels(sparse, kind):
  """``{path: kernel with zeros where pruned}`` of the sparse layers, through densify."""
  dense = jaxsparse.densify(sparse)
  return nnx_kernels(dense, kind)


def check_nnx_sparse(sparse, dense, kind, masks=None):
  """``sparse`` computes ``dense`` with each layer's kernel pruned to its pattern (``masks`` when given)."""
  pruned = nnx_sparse_kernels(sparse, kind)
  reference = nnx.clone(dense)
  for p, k in nnx_kernels(dense, kind).items():
    kept = pruned[p] != 0
    if masks is not None:
      np.testing.assert_array_equal(kept, np.asarray(masks[f"{p}.{leaf(kind)}"]), err_msg=p)
    np.testing.assert_array_equal(pruned[p], np.where(kept, k, 0), err_msg=p)  # the kept weights are the dense ones
    getattr(_get_module(reference, p), leaf(kind))[...] = jnp.asarray(pruned[p])
  x = x_for(kind)
  close(sparse(x), reference(x))
  assert 0 < np.mean([np.mean(k != 0) for k in pruned.values()]) < 1


def check_linen_sparse(sparse, sparse_vars, module, variables, kind, masks=None):
  """``sparse.apply(sparse_vars)`` computes ``module`` with the kernels pruned (``masks`` when given)."""
  _, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  reference = {"params": jax.tree.map(np.asarray, dict(nn.meta.unbox(variables["params"])))}
  for p in sparse_paths(kind):
    k = np.asarray(_get(variables["params"], p)[leaf(kind)])
    pruned = np.asarray(_get(dense_vars["params"], p)[leaf(kind)])
    kept = pruned != 0
    if masks is not None:
      np.testing.assert_array_equal(kept, np.asarray(masks[f"{p}.{leaf(kind)}"]), err_msg=p)
    np.testing.assert_array_equal(pruned, np.where(kept, k, 0), err_msg=p)
    _get(reference["params"], p)[leaf(kind)] = pruned
    assert 0 < kept.mean() < 1
  x = x_for(kind)
  close(sparse.apply(sparse_vars, x), module.apply(reference, x))


# -------------------------------------------------------------------------------------------------
# Paths.
# -------------------------------------------------------------------------------------------------


def path_build(kind, pattern, fw):
  spec, x = SPECS[pattern], x_for(kind)
  rngs = nnx.Rngs(3)
  if fw == "nnx" and kind == "embed":
    layer = layers.CompressedNMEmbed.from_dense(nnx.Embed(VOCAB, D, rngs=rngs), spec.n, spec.m)
    dense = jaxsparse.densify(layer)
    assert type(dense) is nnx.Embed
    close(layer(x), dense(x))
    close(layer.attend(x_for("linear")), dense.attend(x_for("linear")))
    assert np.isclose(np.mean(np.asarray(dense.embedding[...]) != 0), 0.5)
    return
  if fw == "nnx":
    if kind == "conv":
      layer = (layers.NMConv(8, 16, (3, 3), n=spec.n, m=spec.m, rngs=rngs) if pattern == "nm"
               else layers.MaskedConv(8, 16, (3, 3), sparsity=spec.sparsity, rngs=rngs))
    else:
      if pattern == "block":
        inner = layers.BlockSparseLinear(D, D, density=spec.density, block_shape=spec.block_shape, rngs=rngs)
      elif pattern == "nm":
        inner = layers.NMLinear(D, D, n=spec.n, m=spec.m, rngs=rngs)
      else:
        inner = layers.MaskedLinear(D, D, sparsity=spec.sparsity, rngs=rngs)
      layer = inner if kind == "linear" else layers.SparseLinearGeneral(
          inner, in_features=(D,), out_features=(HEADS, D // HEADS))
      if kind == "attention":
        x = x.reshape(-1, D)
    dense = jaxsparse.densify(layer)
    close(layer(x), dense(x))
    assert np.isclose(np.mean(np.asarray(dense.kernel[...]) != 0), 0.5)
    return
  if kind == "embed":  # the table decompressed from the stored variables is the layer's, 2 of every 4 features kept
    module = sparse_linen.CompressedNMEmbed(VOCAB, D, n=spec.n, m=spec.m)
    variables = module.init(jax.random.key(3), x)
    table = np.asarray(jaxsparse.NMSparseMatrix(
        variables["params"]["embedding"], variables[sparse_linen.SPARSITY]["embedding_positions"],
        shape=(D, VOCAB), n=spec.n, m=spec.m, axis=0).to_dense()).T
    assert np.isclose(np.mean(table != 0), 0.5) and ((table != 0).reshape(VOCAB, -1, spec.m).sum(-1) == spec.n).all()
    close(module.apply(variables, x), jnp.take(table, x, axis=0))
    q = x_for("linear")
    close(module.apply(variables, q, method="attend"), q @ table.T)
    (row,) = jaxsparse.summary(variables, x, module=module).layers
    assert np.isclose(row.density, 0.5) and row.bytes < row.dense_bytes, row
    return
  if kind == "conv":
    module = sparse_linen.NMConv(16, (3, 3), n=spec.n, m=spec.m)
  elif pattern == "block":
    module = sparse_linen.BlockSparseDense(D, density=spec.density, block_shape=spec.block_shape)
  elif pattern == "nm":
    module = sparse_linen.NMDense(D, n=spec.n, m=spec.m)
  else:
    module = sparse_linen.MaskedDense(D, sparsity=spec.sparsity)
  variables = module.init(jax.random.key(3), x)
  summary = jaxsparse.summary(variables, x, module=module)
  (row,) = summary.layers
  assert np.isclose(row.density, 0.5), row
  close(jax.jit(module.apply)(variables, x), module.apply(variables, x))


def path_sparsify(kind, pattern, fw):
  rules = rules_for(kind, pattern)
  if fw == "nnx":
    dense = nnx_model(kind)
    sparse, report = jaxsparse.sparsify(dense, rules)
    assert sorted(c.path for c in report.layers) == sparse_paths(kind)
    check_nnx_sparse(sparse, dense, kind)
  else:
    module, variables = linen_model(kind)
    sparse, sparse_vars, _ = jaxsparse.sparsify_linen(module, variables, rules, x_for(kind))
    check_linen_sparse(sparse, sparse_vars, module, variables, kind)


def _train(kind, pattern, fw, path):
  """Three masked optimizer steps: the model (NNX) or ``(module, variables)`` (Linen), and the masks.

  Bias-free attention is pruned with ``views=kernel_views(model)``; the other kinds without views.
  """
  rules = rules_for(kind, pattern)
  x = x_for(kind)
  model = nnx_model(kind) if fw == "nnx" else None
  module, variables = (None, None) if fw == "nnx" else linen_model(kind)
  views = None
  if kind == "attention_nobias":
    views = pruning.kernel_views(model) if fw == "nnx" else pruning.kernel_views(module, variables, x)
  pruner = (pruning.rigl_pruner(rules, update_every=1, end_step=2, views=views) if path == "dst" and fw == "nnx"
            else pruning.set_pruner(rules, update_every=1, end_step=2, views=views) if path == "dst"
            else pruning.magnitude_pruner(rules, pruning.gradual(begin_step=0, end_step=2, update_every=1),
                                          views=views))
  tx = pruning.wrap_optax(optax.sgd(1e-2), pruner)
  loss = lambda y: jnp.mean(y.astype(jnp.float32) ** 2)
  if fw == "nnx":
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    for _ in range(3):
      opt.update(model, nnx.grad(lambda m: loss(m(x)))(model))
    return model, pruning.get_masks(opt)
  params = variables["params"]
  state = tx.init(params)
  for _ in range(3):
    grads = jax.grad(lambda p: loss(module.apply({"params": p}, x)))(params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return (module, {"params": params}), pruning.get_masks(state)


def path_prune(kind, pattern, fw, path="prune"):
  rules = rules_for(kind, pattern)
  trained, masks = _train(kind, pattern, fw, path)
  flat = pruning.masks_to_dict(masks)
  assert sorted(flat) == [f"{p}.{'embedding' if kind == 'embed' else 'kernel'}" for p in sparse_paths(kind)]
  if fw == "nnx":
    sparse, _ = jaxsparse.sparsify(trained, rules, masks=masks)
    check_nnx_sparse(sparse, trained, kind, flat)
    close(sparse(x_for(kind)), trained(x_for(kind)))  # the trained model's pruned weights are zero already
  else:
    module, variables = trained
    sparse, sparse_vars, _ = jaxsparse.sparsify_linen(module, variables, rules, x_for(kind), masks=masks)
    check_linen_sparse(sparse, sparse_vars, module, variables, kind, flat)
    close(sparse.apply(sparse_vars, x_for(kind)), module.apply(variables, x_for(kind)))


def path_dst(kind, pattern, fw):
  path_prune(kind, pattern, fw, path="dst")


def path_calibrated(kind, pattern, fw):
  rules = rules_for(kind, pattern)
  batches = [x_for(kind, seed) for seed in (5, 6)]
  if fw == "nnx":
    pruned, masks, _ = pruning.calibrated_prune(nnx_model(kind), rules, batches, method="wanda", progress=False)
    sparse, _ = jaxsparse.sparsify(pruned, rules, masks=masks)
    check_nnx_sparse(sparse, pruned, kind, masks)
    close(sparse(x_for(kind)), pruned(x_for(kind)))
  else:
    module, variables = linen_model(kind)
    new_vars, masks, _ = pruning.calibrated_prune_linen(module, variables, rules, batches, method="wanda",
                                                        progress=False)
    sparse, sparse_vars, _ = jaxsparse.sparsify_linen(module, new_vars, rules, x_for(kind), masks=masks)
    check_linen_sparse(sparse, sparse_vars, module, new_vars, kind, masks)
    close(sparse.apply(sparse_vars, x_for(kind)), module.apply(new_vars, x_for(kind)))


# --- torch -----------------------------------------------------------------------------------------


def _torch():
  return pytest.importorskip("torch")


def torch_mask(weight, pattern, kind):
  """A mask of ``pattern`` for a torch weight (Linear ``(out, in)``, Conv ``(O, I, kh, kw)``)."""
  torch = _torch()
  w = weight.detach()
  if pattern == "unstructured":
    return (w.abs() >= w.abs().flatten().median()).to(w.dtype)
  if pattern == "nm":  # 2 of every 4 along the inputs (torch axis 1), by magnitude
    moved = w.abs().movedim(1, -1)
    groups = moved.reshape(*moved.shape[:-1], -1, 4)
    keep = torch.zeros_like(groups).scatter(-1, groups.topk(2, dim=-1).indices, 1.0)
    return keep.reshape(moved.shape).movedim(-1, 1)
  blocks = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
  return torch.kron(blocks, torch.ones(8, 8))


def torch_net(kind, pattern):
  """A torch model with the Flax model's module names, pruned with ``torch.nn.utils.prune``, and its input."""
  torch = _torch()
  import torch.nn.utils.prune as prune  # noqa: PLC0415

  torch.manual_seed(0)
  if kind == "linear":
    net = torch.nn.ModuleDict({"layer": torch.nn.Linear(D, D)})
    names = ["layer"]
  elif kind == "embed":
    net = torch.nn.ModuleDict({"layer": torch.nn.Embedding(VOCAB, D)})
    names = ["layer"]
  elif kind == "conv":
    net = torch.nn.ModuleDict({"layer": torch.nn.Conv2d(8, 16, 3, padding=1)})
    names = ["layer"]
  else:
    net = torch.nn.ModuleDict({"layer": torch.nn.ModuleDict({p: torch.nn.Linear(D, D) for p in
                                                             ("query", "key", "value", "out")})})
    names = [f"layer.{p}" for p in ("query", "key", "value", "out")]
  for name in names:
    module = net.get_submodule(name)
    blocks_fit = kind != "embed"  # the 32 x 32 block mask fits the Linear layers, not the 64 x 32 table
    prune.custom_from_mask(module, "weight", torch_mask(module.weight, pattern if blocks_fit or pattern != "block"
                                                        else "unstructured", kind))
  return net


def path_torch(kind, pattern, fw, tmp_path):
  torch = _torch()
  from jaxsparse import torch_interop  # noqa: PLC0415

  net = torch_net(kind, pattern)
  x = x_for(kind)
  state = net.state_dict()
  expected_kernels = {}
  for name, module in net.named_modules():
    if isinstance(module, torch.nn.Linear):
      expected_kernels[name] = module.weight.detach().numpy().T
    elif isinstance(module, torch.nn.Conv2d):
      expected_kernels[name] = module.weight.detach().numpy().transpose(2, 3, 1, 0)
    elif isinstance(module, torch.nn.Embedding):  # the table as Flax holds it, zeros where pruned
      expected_kernels[name] = module.weight.detach().numpy()
  if fw == "nnx":
    model = nnx_model(kind)
    report = torch_interop.load_nnx(model, state)
    dense = jaxsparse.densify(model)
    for p, k in nnx_kernels(dense, kind).items():
      np.testing.assert_array_equal(k.reshape(expected_kernels[p].shape), expected_kernels[p], err_msg=p)
    assert {layer.flax_path for layer in report.layers} >= set(sparse_paths(kind))
    assert all(type(_get_module(model, p)).__name__ != type(_get_module(dense, p)).__name__
               for p in sparse_paths(kind)), "sparse torch layers become jaxsparse layers"
    close(model(x), dense(x))
    close(model(x), _torch_forward(net, kind, x))
    return
  from jaxsparse.torch_interop import _cli  # noqa: PLC0415

  src = tmp_path / "model.pt"
  torch.save(state, src)
  out = tmp_path / "model.safetensors"
  module, init_vars = linen_model(kind)
  target = []
  if kind in ("attention", "embed"):  # the Linen model's variables give the (in, heads, head_dim) kernel shapes, and
    # say which weight is an embedding table (the torch module "layer" has no embedding's name)
    target = ["--target", torch_interop.save_flax_variables(init_vars, tmp_path / "init.safetensors")]
  assert _cli.main(["convert", str(src), str(out), "--no-progress", *target]) == 0
  variables = jax.tree.map(jnp.asarray, torch_interop.load_flax_variables(out))
  if kind in ("attention", "embed"):
    masks = variables.pop("masks")
    close(module.apply(variables, x), _torch_forward(net, kind, x))  # the masked dense model
    sparse, sparse_vars, _ = jaxsparse.sparsify_linen(module, variables, rules_for(kind, pattern), x, masks=masks)
    check_linen_sparse(sparse, sparse_vars, module, variables, kind, pruning.masks_to_dict(masks))
    close(sparse.apply(sparse_vars, x), _torch_forward(net, kind, x))
    return
  if kind == "linear":
    spec = SPECS[pattern]
    module = (sparse_linen.BlockSparseDense(D, density=spec.density, block_shape=spec.block_shape)
              if pattern == "block" else sparse_linen.MaskedDense(D, sparsity=0.5))
    variables = {k: v["layer"] for k, v in variables.items()}
  close(module.apply(variables, x), _torch_forward(net, kind, x))


def _get_module(model, dotted):
  for part in dotted.split("."):
    model = getattr(model, part)
  return model


def _torch_forward(net, kind, x):
  torch = _torch()
  t = torch.from_numpy(np.array(x))
  with torch.no_grad():
    if kind == "conv":
      return net.layer(t.permute(0, 3, 1, 2)).permute(0, 2, 3, 1).numpy()
    if kind == "attention":  # self-attention over the q/k/v/out Linears, heads split as Flax does
      b, n, _ = t.shape
      q, k, v = (net.layer[p](t).reshape(b, n, HEADS, D // HEADS).transpose(1, 2) for p in ("query", "key", "value"))
      y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
      return net.layer["out"](y.transpose(1, 2).reshape(b, n, D)).numpy()
    return net.layer(t).numpy()


# --- orbax, summary, export ------------------------------------------------------------------------


def _sparsified(kind, pattern, fw):
  rules = rules_for(kind, pattern)
  if fw == "nnx":
    return jaxsparse.sparsify(nnx_model(kind), rules)[0]
  module, variables = linen_model(kind)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(module, variables, rules, x_for(kind))
  return sparse, sparse_vars


def path_orbax(kind, pattern, fw, tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  x = x_for(kind)
  checkpointer = ocp.StandardCheckpointer()
  rules = rules_for(kind, pattern)
  if fw == "nnx":
    sparse = _sparsified(kind, pattern, fw)
    checkpointer.save(tmp_path / "ckpt", nnx.state(sparse))
    checkpointer.wait_until_finished()
    # The target is built abstractly: no dense (nor sparse) weights are allocated before the restore.
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: jaxsparse.sparsify(nnx_model(kind, seed=9), rules)[0]))
    restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "ckpt", abstract))
    np.testing.assert_array_equal(restored(x), sparse(x))
    return
  sparse, sparse_vars = _sparsified(kind, pattern, fw)
  checkpointer.save(tmp_path / "ckpt", sparse_vars)
  checkpointer.wait_until_finished()
  abstract = jax.eval_shape(sparse.init, jax.random.key(9), x)
  restored = checkpointer.restore(tmp_path / "ckpt", abstract)
  np.testing.assert_array_equal(sparse.apply(restored, x), sparse.apply(sparse_vars, x))


def path_summary(kind, pattern, fw):
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  x = x_for(kind)
  if fw == "nnx":
    sparse = _sparsified(kind, pattern, fw)
    summary = jaxsparse.summary(sparse)
    dense = jaxsparse.densify(sparse)
    density = {p: float(np.mean(k != 0)) for p, k in nnx_kernels(dense, kind).items()}
    for p in sparse_paths(kind):
      ax = jaxsparse.plot_pattern(_get_module(sparse, p))
      assert ax.get_images()
      plt.close(ax.figure)
  else:
    sparse, sparse_vars = _sparsified(kind, pattern, fw)
    summary = jaxsparse.summary(sparse_vars, x, module=sparse)
    _, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
    density = {p: float(np.mean(np.asarray(_get(dense_vars["params"], p)[leaf(kind)]) != 0))
               for p in sparse_paths(kind)}
  rows = {row.path: row for row in summary.layers}
  assert sorted(rows) == sparse_paths(kind)
  for p, row in rows.items():
    assert np.isclose(row.density, density[p]), (p, row)
    if kind == "embed":  # a lookup: no product
      assert row.forward_flops == row.dense_forward_flops == 0 and row.bytes < row.dense_bytes, row
    else:
      assert row.forward_flops < row.dense_forward_flops


def path_export(kind, pattern, fw):
  torch = _torch()
  from jaxsparse import torch_interop  # noqa: PLC0415

  net = torch_net(kind, "unstructured" if kind == "conv" else pattern)
  for module in net.modules():  # undo the torch pruning: a dense torch model to send masks to
    if hasattr(module, "weight_mask"):
      torch.nn.utils.prune.remove(module, "weight")
  if fw == "nnx":
    sparse = _sparsified(kind, pattern, fw)
    masks = torch_interop.export_masks(sparse)
    pruned = nnx_kernels(jaxsparse.densify(sparse), kind)
  else:
    sparse, sparse_vars = _sparsified(kind, pattern, fw)
    masks = torch_interop.export_masks(sparse_vars, module=sparse)
    _, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
    pruned = {p: np.asarray(_get(dense_vars["params"], p)[leaf(kind)]) for p in sparse_paths(kind)}
  assert sorted(masks) == [f"{p}.weight_mask" for p in sparse_paths(kind)]
  torch_interop.apply_masks(net, masks)
  for p, k in pruned.items():
    k2 = k.transpose(3, 2, 0, 1) if kind == "conv" else k if kind == "embed" else k.reshape(D, D).T
    np.testing.assert_array_equal(masks[f"{p}.weight_mask"].numpy(), k2 != 0, err_msg=p)
    np.testing.assert_array_equal(net.get_submodule(p).weight_mask.numpy().astype(bool), k2 != 0, err_msg=p)


RUNNERS = {
    "build": path_build, "sparsify": path_sparsify, "prune": path_prune, "dst": path_dst,
    "calibrated": path_calibrated, "torch": path_torch, "orbax": path_orbax, "summary": path_summary,
    "export": path_export,
}


def run_cell(cell, tmp_path):
  kind, pattern, fw, path = cell
  runner = RUNNERS[path]
  args = (kind, pattern, fw, tmp_path) if path in ("torch", "orbax") else (kind, pattern, fw)
  raises = _lookup(RAISES, cell)
  if raises is None:
    runner(*args)
    return
  with pytest.raises(Exception, match=raises[0]) as info:
    runner(*args)
  assert info.type.__name__ in ("ValueError", "TypeError", "ScopeParamShapeError", "CheckpointError"), info.value


# In the fast suite: the cells of issue 36's report (gradual block / N:M pruning of attention, then sparsify with the
# same rules) and one cell of every path; the rest (about 10 minutes of CPU on 2 cores) run with `make test-slow`.
FAST = {("attention", "block", "nnx", "prune"), ("attention", "nm", "nnx", "prune"),
        ("attention", "block", "linen", "prune"), ("linear", "unstructured", "nnx", "build"),
        ("attention", "unstructured", "nnx", "torch"), ("attention", "block", "nnx", "export"),
        ("embed", "unstructured", "nnx", "sparsify"), ("embed", "nm", "nnx", "orbax"),
        ("embed", "nm", "linen", "export")}


@pytest.mark.parametrize("cell", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CELLS],
                         ids=["-".join(c) for c in CELLS])
def test_cell(cell, tmp_path):
  run_cell(cell, tmp_path)


# -------------------------------------------------------------------------------------------------
# The docs table.
# -------------------------------------------------------------------------------------------------

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "guides" / "composition.md"
BEGIN, END = "<!-- matrix: generated by tests/test_composition.py -->", "<!-- end of matrix -->"


def matrix_table() -> str:
  """The Markdown tables of the matrix: one per layer kind, paths as rows, pattern x framework as columns."""
  out = []
  for kind in KINDS:
    out.append(f"### {KIND_NAMES[kind]}\n")
    cols = [(p, f) for p in PATTERNS for f in FRAMEWORKS]
    out.append("| path | " + " | ".join(f"{p} {f.upper() if f == 'nnx' else 'Linen'}" for p, f in cols) + " |")
    out.append("|---" * (len(cols) + 1) + "|")
    for path in PATHS:
      out.append(f"| {PATH_NAMES[path]} | " + " | ".join(cell_result((kind, p, f, path)) for p, f in cols) + " |")
    out.append("")
  return "\n".join(out)


def _doc_section(text: str) -> str:
  match = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
  assert match, f"{DOC} has no {BEGIN} ... {END} section"
  return match.group(1).strip()


def test_docs_table_matches_the_matrix():
  assert _doc_section(DOC.read_text()) == matrix_table().strip(), (
      "docs/guides/composition.md is out of date: run python tests/test_composition.py"
  )


def test_every_combination_is_a_cell_or_not_a_cell():
  assert len(ALL) == len(KINDS) * len(PATTERNS) * len(FRAMEWORKS) * len(PATHS)
  assert all((_lookup(NOT_A_CELL, c) is None) == (c in CELLS) for c in ALL)
  embed = {c for c in CELLS if _lookup(RAISES, c) is None and c[0] == "embed"}
  paths = ("build", "sparsify", "prune", "calibrated", "orbax", "summary", "export")
  expected = {("embed", "nm", fw, p) for fw in FRAMEWORKS for p in (*paths, "torch")}
  assert embed == expected, embed


# -------------------------------------------------------------------------------------------------
# Outside the matrix: a Linen embedding sparsify_linen cannot see.
# -------------------------------------------------------------------------------------------------


class _TableReader(nn.Module):
  """Reads its embedding's table itself: the example input never calls the ``nn.Embed``."""

  def setup(self):
    self.embed = nn.Embed(VOCAB, D)
    self.fc = nn.Dense(D)

  def __call__(self, ids):
    return self.fc(self.embed.embedding[ids])


def test_linen_embed_never_called_is_explained_in_linen_terms():
  ids = x_for("embed")
  module = _TableReader()
  variables = module.init(jax.random.key(0), ids)
  with pytest.raises(ValueError, match=r"embed \(nn\.Embed\): rule 'embed' gives it 2:4, but the example input never "
                     r"calls this layer .*jaxsparse\.layers\.linen\.CompressedNMEmbed") as info:
    jaxsparse.sparsify_linen(module, variables, {"embed": jaxsparse.NM(2, 4)}, ids)
  assert "nnx" not in str(info.value) and "from_dense" not in str(info.value)  # no NNX advice for a Linen model


if __name__ == "__main__":
  text = DOC.read_text()
  start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
  DOC.write_text(text[:start] + "\n" + matrix_table().strip() + "\n" + text[end:])
