"""The sharding path of the composition matrix (``tests/test_composition.py``): every layer kind x pattern x framework
that ``sparsify`` builds there, on a mesh of 4 devices, against the same sparse model on one device.

Two layouts per cell, each under ``jax.jit``:

- ``data``: the input's batch split over a ``("data",)`` mesh (auto axes), every parameter and pattern replicated.
- ``model``: a ``("data", "model")`` 2 x 2 mesh; the dense weights are named before ``sparsify`` (NNX: the
  ``out_sharding`` metadata ``nnx.with_partitioning`` gives; Linen: ``nn.Partitioned`` boxes, as
  ``nn.with_partitioning`` gives) so that output features (an embedding's vocabulary) go on ``"model"``; the sparse
  state is placed by ``nnx.get_named_sharding`` / ``nn.get_sharding``, the batch split over ``"data"``. Block-sparse
  values are replicated there (the library's layout for them), their biases split. The NNX block-sparse Linear also
  runs as a :class:`jaxsparse.sharding.TensorParallelBlockSparseLinear` (``tp`` below).

Each cell checks the forward, the gradients with respect to the input (not for an embedding's integer ids) and to
every parameter, and one ``optax.sgd`` step: equal to the unsharded model's within float32's tolerance (``1e-5``
relative Frobenius, ``tests/_util.assert_close``); the step keeps the sparsity pattern (the stepped model densified is
zero exactly where the model was). The cells ``sparsify`` refuses (``RAISES`` of ``tests/test_composition.py``: a
block-sparse Conv, a block-sparse or unstructured Embed) must raise that error, naming the layer and what is
supported.

All cells of one framework run in one subprocess with 4 host CPU devices (``XLA_FLAGS`` must precede jax). Run by
hand: ``XLA_FLAGS=--xla_force_host_platform_device_count=4 python -c "import tests.test_composition_sharding as t;
t.main('nnx')"``.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsparse
from jaxsparse.sharding import TensorParallelBlockSparseLinear
from tests import test_composition as tc
from tests._util import assert_close

ROOT = pathlib.Path(__file__).resolve().parent.parent
BATCH = 8
LAYOUTS = ("data", "model")
LR = 0.1


def inputs(kind, seed):
  """A fresh batch of ``BATCH`` examples for ``kind`` (the models of ``tests/test_composition.py``)."""
  key = jax.random.key(seed)
  if kind == "conv":
    return jax.random.normal(key, (BATCH, 6, 6, 8))
  if kind == "embed":
    return jax.random.randint(key, (BATCH, 5), 0, tc.VOCAB)
  return jax.random.normal(key, (BATCH, 3, tc.D) if tc._attention(kind) else (BATCH, tc.D))


def dense_names(kind, path, ndim):
  """The partitioning names of a dense weight at ``path`` (a tuple of keys): output features on ``"model"``."""
  name = path[-1]
  if kind == "embed":
    return ("model", None)  # the vocabulary
  if tc._attention(kind) and "out" in path:  # (heads, head_dim, D) -> D: the heads are its inputs
    return ("model", None, None) if name == "kernel" else (None,)
  if tc._attention(kind):  # q / k / v (D, heads, head_dim), bias (heads, head_dim): the heads
    return (None, "model", None) if name == "kernel" else ("model", None)
  return (None,) * (ndim - 1) + ("model",)  # a Linear's / Conv's kernel and bias: output features


def _meshes():
  return {"data": jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,)),
          "model": jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)}


def _loss(y):
  return jnp.sum(jnp.sin(y.astype(jnp.float32)))


def _step_fn(apply, kind):
  """``f(params, rest, x) -> (y, grads, dx, new_params)``: forward, gradients and one SGD step, under ``jit``."""
  tx = optax.sgd(LR)
  int_x = kind == "embed"

  def f(params, rest, x):
    y = apply(params, rest, x)
    if int_x:
      grads, dx = jax.grad(lambda p: _loss(apply(p, rest, x)))(params), None
    else:
      grads, dx = jax.grad(lambda p, x: _loss(apply(p, rest, x)), argnums=(0, 1))(params, x)
    updates, _ = tx.update(grads, tx.init(params), params)
    return y, grads, dx, optax.apply_updates(params, updates)

  return jax.jit(f)


def _is_key_bias(path):
  """The key projection's bias: its gradient is zero in exact arithmetic (a softmax does not see a shift of one
  query's logits, which is all the key bias adds), so both models' are rounding noise: compared relative to the norm
  of the whole gradient (the whole stepped parameters), not to their own."""
  keys = jax.tree_util.keystr(path)
  return "['key']" in keys and "['bias']" in keys


def _compare(got, want, what):
  names = ("forward", "param gradients", "input gradient", "sgd step")
  for name, a, b in zip(names, got, want, strict=True):
    leaves_a, leaves_b = jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b), (what, name)
    total = float(np.sqrt(sum(np.sum(np.square(np.asarray(lb, np.float64))) for lb in leaves_b)))
    for (path, la), lb in zip(leaves_a, leaves_b, strict=True):
      if name in ("param gradients", "sgd step") and _is_key_bias(path):  # (initialised to zeros: the step's is noise)
        diff = np.linalg.norm(np.asarray(la, np.float64) - np.asarray(lb, np.float64))
        assert diff <= 1e-5 * total, f"{what}: {name}: the key bias differs by {diff:.3e} of {total:.3e}"
        if name == "param gradients":
          assert np.linalg.norm(np.asarray(lb, np.float64)) <= 1e-5 * total, f"{what}: a key bias gradient not ~0"
        continue
      try:
        assert_close(la, lb, jnp.float32)
      except AssertionError as e:
        raise AssertionError(f"{what}: {name} {jax.tree_util.keystr(path)}: {e}") from None


def _same_pattern(before, after, what, nm=None):
  """The stepped kernels ``after`` (``{path: densified kernel}``) keep the pattern of ``before``: the same kept weights
  (a fixed pattern), or, for an SR-STE layer (``nm=(n, m)``, whose mask follows the weights), still ``n`` of every
  ``m`` consecutive inputs."""
  assert sorted(before) == sorted(after), what
  for p in before:
    kept, kept_after = np.asarray(before[p]) != 0, np.asarray(after[p]) != 0
    assert 0 < kept.mean() < 1, (what, p, kept.mean())
    if nm is None:
      np.testing.assert_array_equal(kept_after, kept, err_msg=f"{what}: {p}: the SGD step changed the pattern")
      continue
    n, m = nm
    out_ndim = 2 if p.endswith(("query", "key", "value")) else 1  # q / k / v: (D, heads, head_dim)
    k2 = kept_after.reshape(-1, int(np.prod(kept_after.shape[-out_ndim:])))  # (inputs, outputs)
    counts = k2.reshape(-1, m, k2.shape[-1]).sum(1)
    assert (counts == n).all(), f"{what}: {p}: the SGD step left the kernel not {n}:{m}"


def _sr_ste(kind, pattern):
  """``(n, m)`` where sparsify builds SR-STE layers (``NMLinear`` / ``NMDense``, ``NMConv``); ``None`` elsewhere."""
  spec = tc.SPECS[pattern]
  return (spec.n, spec.m) if pattern == "nm" and kind != "embed" else None


def _placed(tree, shardings):
  return jax.tree.map(lambda a, s: jax.device_put(a, s), tree, shardings)


def _one_device(tree):
  return jax.device_put(tree, jax.devices()[0])


def _split_somewhere(tree):
  return any(not a.sharding.is_fully_replicated for a in jax.tree.leaves(tree))


# -------------------------------------------------------------------------------------------------
# NNX
# -------------------------------------------------------------------------------------------------


def _nnx_named(kind):
  """``tests/test_composition.py``'s dense model, its weights named as ``nnx.with_partitioning`` names them."""
  model = tc.nnx_model(kind)
  for path, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Param):
      var.set_metadata(out_sharding=dense_names(kind, tuple(str(p) for p in path), var.ndim))
  return model


def nnx_cell(kind, pattern, layout, mesh, *, tp=False):
  """One NNX cell on ``mesh``: raises ``AssertionError`` where the sharded model differs from the unsharded one."""
  what = f"{kind}/{pattern}/nnx/{layout}{'/tp' if tp else ''}"
  dense = _nnx_named(kind) if layout == "model" else tc.nnx_model(kind)
  sparse, _ = jaxsparse.sparsify(dense, tc.rules_for(kind, pattern))
  if tp:
    sparse.layer = TensorParallelBlockSparseLinear(sparse.layer, mesh, "model", split="columns", batch_axes="data")
  graphdef, params, rest = nnx.split(sparse, nnx.Param, ...)
  x = inputs(kind, seed=11)
  f = _step_fn(lambda p, r, x: nnx.merge(graphdef, p, r)(x), kind)
  if tp:  # the reference: the same weights as one BlockSparseLinear, on one device
    ref_layer = sparse.layer.to_block_sparse_linear()
    ref_model = nnx.clone(sparse)
    ref_model.layer = ref_layer
    rg, rp, rr = nnx.split(ref_model, nnx.Param, ...)
    ry, rgrads, rdx, rnew = _step_fn(lambda p, r, x: nnx.merge(rg, p, r)(x), kind)(*_one_device((rp, rr, x)))
    # The tensor-parallel kernel holds the blocks per shard: compare through each model's dense kernel.
    got = f(params, rest, jax.device_put(x, NamedSharding(mesh, P("data"))))
    # Gradients are linear in the kernel: densified like the kernel (a State of the params' structure).
    dense_of = lambda g, p, r: {k: v[...] for k, v in nnx.state(jaxsparse.densify(nnx.merge(g, p, r)), nnx.Param)
                                .flat_state()}
    _compare((got[0], dense_of(graphdef, got[1], rest), got[2], dense_of(graphdef, got[3], rest)),
             (ry, dense_of(rg, rgrads, rr), rdx, dense_of(rg, rnew, rr)), what)
    return
  want = f(*_one_device((params, rest, x)))
  if layout == "data":
    params, rest = _placed((params, rest), jax.tree.map(lambda _: NamedSharding(mesh, P()), (params, rest)))
  else:
    state = nnx.state(sparse)
    state = _placed(state, nnx.get_named_sharding(state, mesh))
    nnx.update(sparse, state)
    _, params, rest = nnx.split(sparse, nnx.Param, ...)
    # Block-sparse values are replicated (the library's layout for them): without biases nothing is split.
    assert _split_somewhere(params) or (kind, pattern) == ("attention_nobias", "block"), f"{what}: nothing split"
  got = f(params, rest, jax.device_put(x, NamedSharding(mesh, P("data"))))
  _compare(got, want, what)
  kernels = lambda p: tc.nnx_kernels(jaxsparse.densify(nnx.merge(graphdef, p, rest)), kind)
  _same_pattern(kernels(params), kernels(got[3]), what, nm=_sr_ste(kind, pattern))


# -------------------------------------------------------------------------------------------------
# Linen
# -------------------------------------------------------------------------------------------------


def _linen_named(kind):
  """``tests/test_composition.py``'s dense module and variables, the weights boxed as ``nn.with_partitioning`` does."""
  module, variables = tc.linen_model(kind)

  def box(path, a):
    keys = tuple(str(getattr(k, "key", k)) for k in path)
    return nn.Partitioned(a, names=dense_names(kind, keys, a.ndim))

  return module, {"params": jax.tree_util.tree_map_with_path(box, variables["params"])}


def linen_cell(kind, pattern, layout, mesh):
  what = f"{kind}/{pattern}/linen/{layout}"
  module, variables = _linen_named(kind) if layout == "model" else tc.linen_model(kind)
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(module, variables, tc.rules_for(kind, pattern), tc.x_for(kind))
  plain = nn.meta.unbox(sparse_vars)
  params, rest = plain["params"], {k: v for k, v in plain.items() if k != "params"}
  x = inputs(kind, seed=11)
  f = _step_fn(lambda p, r, x: sparse.apply({"params": p, **r}, x), kind)
  want = f(*_one_device((params, rest, x)))
  if layout == "data":
    params, rest = _placed((params, rest), jax.tree.map(lambda _: NamedSharding(mesh, P()), (params, rest)))
  else:
    shardings = nn.get_sharding(sparse_vars, mesh)
    placed = _placed(plain, shardings)
    params, rest = placed["params"], {k: v for k, v in placed.items() if k != "params"}
    # Block-sparse values are replicated (the library's layout for them): without biases nothing is split.
    assert _split_somewhere(params) or (kind, pattern) == ("attention_nobias", "block"), f"{what}: nothing split"
  got = f(params, rest, jax.device_put(x, NamedSharding(mesh, P("data"))))
  _compare(got, want, what)

  def kernels(p):
    _, dense_vars = jaxsparse.densify_linen(sparse, {"params": p, **rest})
    dense_vars = nn.meta.unbox(dense_vars)  # the dense boxes come back
    return {q: np.asarray(tc._get(dense_vars["params"], q)[tc.leaf(kind)]) for q in tc.sparse_paths(kind)}

  _same_pattern(kernels(params), kernels(got[3]), what, nm=_sr_ste(kind, pattern))


# -------------------------------------------------------------------------------------------------
# The cells, one framework per process.
# -------------------------------------------------------------------------------------------------


def cells(fw):
  """``[(kind, pattern, layout, tp)]``: every cell of ``fw``."""
  out = [(k, p, layout, False) for k in tc.KINDS for p in tc.PATTERNS for layout in LAYOUTS]
  if fw == "nnx":
    out.append(("linear", "block", "model", True))
  return out


def run_cell(fw, kind, pattern, layout, tp, mesh) -> str:
  """``"passes"`` or ``"clear error: ..."``; raises where the cell is wrong or its error unclear."""
  raises = tc._lookup(tc.RAISES, (kind, pattern, fw, "sparsify"))
  runner = (lambda: nnx_cell(kind, pattern, layout, mesh, tp=tp)) if fw == "nnx" else (
      lambda: linen_cell(kind, pattern, layout, mesh))
  if raises is None:
    runner()
    return "passes"
  try:
    runner()
  except (ValueError, TypeError) as e:
    assert re.search(raises[0], str(e)), f"{kind}/{pattern}/{fw}/{layout}: unclear error {e!r}"
    return f"clear error: {raises[1]}"
  raise AssertionError(f"{kind}/{pattern}/{fw}/{layout}: expected an error matching {raises[0]!r}")


def main(fw):
  assert jax.device_count() == 4, jax.devices()
  meshes = _meshes()
  failures = []
  for kind, pattern, layout, tp in cells(fw):
    name = f"{kind}/{pattern}/{fw}/{layout}{'/tp' if tp else ''}"
    try:
      result = run_cell(fw, kind, pattern, layout, tp, meshes[layout])
    except Exception as e:  # every cell's failure is reported, then the process fails
      failures.append(name)
      result = f"FAILED: {type(e).__name__}: {str(e)[:1500]}"
    print(f"CELL {name}: {result}", flush=True)
  assert not failures, f"failed cells: {failures}"
  print("done")


@pytest.mark.slow  # one process with 4 devices per framework, ~60 s each on 2 cores
@pytest.mark.parametrize("fw", tc.FRAMEWORKS)
def test_sharding_cells(fw):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
  code = f"import tests.test_composition_sharding as t; t.main({fw!r})"
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("done"), (
      f"{fw} failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}")
  results = re.findall(r"^CELL (\S+): (\w+)", proc.stdout, re.M)
  assert len(results) == len(cells(fw)), proc.stdout
  assert all(r in ("passes", "clear") for _, r in results), proc.stdout


def test_every_sparsify_cell_is_covered():
  # Every kind x pattern sparsify builds in tests/test_composition.py (its RAISES cells too), and the bias-free
  # attention (no sparsify cell there: the same layers, but no bias to split or step here).
  sparsify_cells = {(k, p) for k, p, _, path in tc.CELLS if path == "sparsify"}
  covered = {(k, p) for k, p, _, _ in cells("nnx")}
  assert covered == {(k, p) for k, p, _, _ in cells("linen")}
  assert covered == sparsify_cells | {("attention_nobias", p) for p in tc.PATTERNS}, covered ^ sparsify_cells
