"""Sparse layers built directly with a named kernel, through a user's workflows on 4 devices.

A layer built with ``kernel_init=nnx.with_partitioning(...)`` (Linen ``nn.with_partitioning``) names its sparsity state
like its kernel (43c05a6: a mask is split over the kernel's mesh axes, block index arrays are named ``(None,)``, a
stack's patterns take the stack axis). Checked here, against the same layers unnamed on one device: pruning while
training (``pruning.wrap_optax`` with gradual magnitude, SET and RigL, under ``nnx.jit`` with donated state, then
``pruning.apply_masks``) on ``("data", "model")`` meshes of 2x2 and 1x4, auto and explicit axes: masks exactly, values
to float32's rounding, the layers' masks still named and split as their kernels; a stack (``nnx.vmap`` with
``transform_metadata``) initialised under ``jax.jit(out_shardings=...)``, trained, pruned and summarized; an orbax
checkpoint of a stack restored into the abstract target of another mesh shape (``nnx.eval_shape`` +
``nnx.get_named_sharding``); Linen variables with boxed patterns (``nn.get_sharding`` init, ``apply_masks``, the torch
export: it read the boxes themselves and raised, see ``tests/test_named_layers.py``); the tensor-parallel layer of a
named ``BlockSparseLinear``. About 30 s on 2 cores.

Regressions: ``pruning.apply_masks`` of masks saved as NumPy arrays (one device's) onto a model whose kernels are split
over explicit axes raised ``ShardingTypeError: select `which` must be scalar or have the same sharding as cases``
(the masks are split like their parameters now); ``jaxsparse.summary`` of a stack of ``BlockSparseLinear`` layers
showed one layer's shape and ``layers`` times its density; the torch export of boxed Linen variables raised.
"""

from __future__ import annotations

import contextlib
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsparse
from jaxsparse import pruning
from jaxsparse import torch_interop
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import MaskedLinear
from jaxsparse.layers import SparsityPattern
from jaxsparse.layers import linen as sparse_linen
from jaxsparse.sharding import TensorParallelBlockSparseLinear
from tests._util import rel_err

D, L, ROWS = 32, 4, 8
F32_TOL = 1e-6
STACK = {nnx.PARTITION_NAME: "data"}  # a stack's layers split over "data"
MASK = np.asarray(jax.random.uniform(jax.random.key(4), (D, D)) < 0.3)
BLOCK_MASK = np.asarray(jaxsparse.random_block_mask(jax.random.key(3), (D, D), (8, 8), 0.5))
# The block-sparse layer's kept blocks are not pruned (the pruners refuse them: its blocks are fixed); its pattern and
# kernel still travel through the sharded training, summary and restore.
RULES = {r"(^|\.)m\.kernel": jaxsparse.Unstructured(sparsity=0.75), r"(^|\.)b\.kernel": None}
PRUNERS = {  # stacks: the stack's layer axes (pruning.layer_stacks), so that each layer is pruned to its sparsity
    "gradual": lambda stacks: pruning.magnitude_pruner(
        RULES, pruning.gradual(begin_step=0, end_step=1, update_every=1), stacks=stacks),
    "set": lambda stacks: pruning.set_pruner(RULES, update_every=1, end_step=2, stacks=stacks),
    "rigl": lambda stacks: pruning.rigl_pruner(RULES, update_every=1, end_step=2, stacks=stacks),
}


@pytest.fixture(autouse=True)
def _float32_products():
  with jax.default_matmul_precision("highest"):
    yield


def _mesh(shape, axis_type=AxisType.Auto):
  return jax.make_mesh(shape, ("data", "model"), axis_types=(axis_type,) * 2)


def _init(named: bool, *names):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names) if named else nnx.initializers.lecun_normal()


def _bias(named: bool):
  init = nnx.initializers.normal(0.1)
  return nnx.with_partitioning(init, ("model",)) if named else init


class _Model(nnx.Module):
  """A masked layer ``m`` (its mask given, ``mask=``, or in a stack drawn per layer) and a block-sparse one ``b`` (its
  blocks given, ``block_mask=``); each kernel split over "model" on its outputs (named)."""

  def __init__(self, rngs: nnx.Rngs, named: bool = True, stacked: bool = False):
    options = dict(bias_init=_bias(named), rngs=rngs, kernel_init=_init(named, None, "model"))
    self.m = MaskedLinear(D, D, **({"sparsity": 0.5} if stacked else {"mask": MASK}), **options)
    options["kernel_init"] = _init(named, None, None, "model")
    self.b = BlockSparseLinear(D, D, block_mask=BLOCK_MASK, block_shape=(8, 8), **options)

  def __call__(self, x):
    return jnp.tanh(self.b(jnp.tanh(self.m(x))))


def _stack(named: bool) -> nnx.Module:
  @nnx.split_rngs(splits=L)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=STACK if named else {})
  def create(rngs):
    return _Model(rngs, named, stacked=True)

  return create(nnx.Rngs(0))


def _run_stack(stack, x):
  @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=STACK)
  def step(h, layer):
    return layer(h)

  return step(x, stack)


def _flat(module) -> dict[str, nnx.Variable]:
  return {"/".join(map(str, path)): v for path, v in nnx.to_flat_state(nnx.state(module))}


def _assert_same(got: nnx.Module, want: nnx.Module, what: str) -> None:
  """Patterns exactly, weights to float32's rounding."""
  got, want = _flat(got), _flat(want)
  assert got.keys() == want.keys(), what
  for path, v in got.items():
    a, b = np.asarray(v.get_value()), np.asarray(want[path].get_value())
    if isinstance(v, SparsityPattern):
      np.testing.assert_array_equal(a, b, err_msg=f"{what}: {path}")
    else:
      assert rel_err(a, b) <= F32_TOL, (what, path, rel_err(a, b))


def _assert_named_like_kernels(module: nnx.Module, stacked: bool, what: str) -> None:
  """Each mask is named and split as its kernel is; block index arrays ``(None,)`` (the stack axis first)."""
  lead = ("data",) if stacked else ()
  assert module.m.mask.get_metadata()["out_sharding"] == (*lead, None, "model"), what
  mask, kernel = module.m.mask.get_value(), module.m.kernel.get_value()
  assert mask.sharding.is_equivalent_to(kernel.sharding, mask.ndim), (what, mask.sharding, kernel.sharding)
  assert {s.data.shape for s in mask.addressable_shards} == {s.data.shape for s in kernel.addressable_shards}
  for f, v in module.b.pattern.items():
    assert v.get_metadata()["out_sharding"] == (*lead, None), (what, f)


def _train(model: nnx.Module, pruner: str, loss) -> tuple[nnx.Module, object]:
  """Two ``nnx.jit`` steps with donated model and optimizer, then the optimizer's masks applied to the model."""
  transform = pruning.wrap_optax(optax.sgd(0.05), PRUNERS[pruner](pruning.layer_stacks(model)))
  optimizer = nnx.Optimizer(model, transform, wrt=nnx.Param)

  @functools.partial(nnx.jit, donate_argnums=(0, 1))
  def step(model, optimizer, x):
    optimizer.update(model, nnx.grad(loss)(model, x))

  x = jax.random.normal(jax.random.key(1), (ROWS, D))
  for _ in range(2):
    step(model, optimizer, x)
  masks = pruning.get_masks(optimizer)
  pruning.apply_masks(model, masks)
  return model, masks


def _loss(model, x):
  return jnp.sum(model(x) ** 2)


@functools.cache
def _unsharded(pruner: str) -> nnx.Module:
  return _train(_Model(nnx.Rngs(0), named=False), pruner, _loss)[0]


# SET differs from RigL only in where it grows (at random): run by hand with "set" in these lists.
@pytest.mark.parametrize(("pruner", "shape", "axis_type"), [
    ("gradual", (1, 4), AxisType.Auto), ("rigl", (2, 2), AxisType.Explicit)])
def test_nnx_pruning_while_training_named_layers_equals_one_device(pruner, shape, axis_type):
  mesh = _mesh(shape, axis_type)
  with jax.set_mesh(mesh):
    model, masks = _train(_Model(nnx.Rngs(0)), pruner, _loss)
    _assert_named_like_kernels(model, stacked=False, what=pruner)
    mask, kernel = masks["m"]["kernel"], model.m.kernel.get_value()  # the optimizer's mask is split as its kernel
    assert mask.sharding.is_equivalent_to(kernel.sharding, mask.ndim), (mask.sharding, kernel.sharding)
    y = nnx.jit(lambda m, x: m(x))(model, jnp.ones((ROWS, D)))
    # The masks saved (NumPy, one device's) and applied to the model as built: under explicit axes jnp.where of a
    # replicated mask and a split kernel raised a ShardingTypeError; they are split like their parameters.
    saved = jax.tree.map(np.asarray, masks)
    fresh = pruning.apply_masks(_Model(nnx.Rngs(0)), saved)
    _assert_named_like_kernels(fresh, stacked=False, what=f"{pruner}: saved masks")
  want_fresh = pruning.apply_masks(_Model(nnx.Rngs(0), named=False), saved)
  _assert_same(fresh, want_fresh, f"{pruner}: saved masks")
  want = _unsharded(pruner)
  _assert_same(model, want, pruner)
  assert rel_err(y, want(jnp.ones((ROWS, D)))) <= 1e-5
  assert model.m.density == want.m.density < MASK.mean()  # narrowed to the optimizer's mask


def test_nnx_named_stack_sharded_init_training_summary_and_restore_on_another_mesh(tmp_path):
  """A stack split over "data": ``jax.jit(out_shardings=...)`` init, gradual pruning, ``apply_masks`` (its masks keep
  the stack axis), ``summary``; its orbax checkpoint restored into the abstract target of a 1x4 explicit mesh."""
  mesh = _mesh((2, 2))
  with jax.set_mesh(mesh):
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: _stack(True)))
    state = jax.jit(lambda: nnx.state(_stack(True)), out_shardings=nnx.get_named_sharding(abstract, mesh))()
    stack = nnx.merge(graphdef, state)
    assert stack.m.mask.get_value().sharding.spec == P("data", None, "model")
    stack, _ = _train(stack, "gradual", lambda s, x: jnp.sum(_run_stack(s, x) ** 2))
    _assert_named_like_kernels(stack, stacked=True, what="stack")
    rows = {row.path: (row.shape, row.density) for row in jaxsparse.summary(stack).layers}
  with contextlib.ExitStack() as stack_context:
    stack_context.enter_context(nnx.use_eager_sharding(False))
    want = _train(_stack(False), "gradual", lambda s, x: jnp.sum(_run_stack(s, x) ** 2))[0]
  _assert_same(stack, want, "stack")
  assert rows == {"m": ((L, D, D), want.m.density), "b": ((L, D, D), 0.5)}

  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "stack", nnx.state(stack))
  checkpointer.wait_until_finished()
  other = _mesh((1, 4), AxisType.Explicit)
  with jax.set_mesh(other):
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: _stack(True)))
    shardings = nnx.get_named_sharding(abstract, other)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "stack", target))
    assert restored.m.mask.get_value().sharding == NamedSharding(other, P("data", None, "model"))
  _assert_same(restored, want, "restored")


class _LinenModel(nn.Module):
  named: bool = True

  @nn.compact
  def __call__(self, x):
    def init(*names):
      lecun = nn.initializers.lecun_normal()
      return nn.with_partitioning(lecun, names) if self.named else lecun

    x = sparse_linen.MaskedDense(D, sparsity=0.5, kernel_init=init(None, "model"), name="m")(x)
    return sparse_linen.BlockSparseDense(D, density=0.5, block_shape=(8, 8), kernel_init=init(None, None, "model"),
                                         name="b")(jnp.tanh(x))


def test_linen_named_layers_sharded_init_pruning_and_torch_export():
  x = jax.random.normal(jax.random.key(1), (ROWS, D))
  want = _LinenModel(False).init(jax.random.key(0), x)
  rules = {r"m\.kernel": jaxsparse.Unstructured(sparsity=0.75)}
  want = pruning.apply_masks(want, pruning.magnitude_masks(want["params"], rules))
  mesh = _mesh((2, 2))
  with jax.set_mesh(mesh):
    abstract = jax.eval_shape(_LinenModel().init, jax.random.key(0), x)
    variables = jax.jit(_LinenModel().init, out_shardings=nn.get_sharding(abstract, mesh))(jax.random.key(0), x)
    params = jax.tree.map(lambda b: b.value if isinstance(b, nn.Partitioned) else b, variables["params"],
                          is_leaf=lambda b: isinstance(b, nn.Partitioned))  # unboxed for the pruner
    got = pruning.apply_masks(variables, pruning.magnitude_masks(params, rules))
    mask = got[sparse_linen.SPARSITY]["m"]["mask"]
    assert isinstance(mask, nn.Partitioned) and mask.names == (None, "model")
    assert mask.value.sharding.spec == P(None, "model")
    for a, b in zip(jax.tree.leaves(nn.unbox(got)), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    exported = torch_interop.export_masks(got)  # boxed patterns and params, split over the mesh
  expected = torch_interop.export_masks(want)
  assert sorted(exported) == sorted(expected) == ["b.weight_mask", "m.weight_mask"]
  for name, t in expected.items():
    np.testing.assert_array_equal(exported[name].numpy(), t.numpy(), err_msg=name)


def test_tensor_parallel_layer_of_a_named_block_sparse_layer():
  x = jax.random.normal(jax.random.key(1), (ROWS, D))
  want = BlockSparseLinear(D, D, block_mask=BLOCK_MASK, block_shape=(8, 8), kernel_init=_init(False),
                           rngs=nnx.Rngs(0))
  mesh = _mesh((1, 4), AxisType.Explicit)
  with jax.set_mesh(mesh):
    layer = BlockSparseLinear(D, D, block_mask=BLOCK_MASK, block_shape=(8, 8),
                              kernel_init=_init(True, None, None, "model"), rngs=nnx.Rngs(0))
    tp = TensorParallelBlockSparseLinear(layer, mesh, "model", split="columns")
    assert rel_err(nnx.jit(lambda m, x: m(x))(tp, x), want(x)) <= 1e-5
    np.testing.assert_array_equal(tp.to_block_sparse_linear().sparse_kernel.to_dense(), want.sparse_kernel.to_dense())
