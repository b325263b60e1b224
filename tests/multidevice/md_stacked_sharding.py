"""Stacks of sparse layers (scan over layers) sharded over 4 devices: the sparsity state takes the stack axis.

Flax's recipe for scanned transformer blocks builds a stack of layers with ``nnx.vmap(...,
transform_metadata={nnx.PARTITION_NAME: "layers"})`` and runs it with ``nnx.scan`` (Linen: ``nn.scan`` / ``nn.vmap``
with ``metadata_params={nn.PARTITION_NAME: "layers"}``); the transforms insert the stack axis into the partitioning
names of every variable that has some. Regression: the layers built with a named kernel (``nnx.with_partitioning`` /
``nn.with_partitioning``) left their patterns (masks, block index arrays, packed positions) unnamed, so they got no
stack axis: ``nnx.get_partition_spec`` gave them ``P()`` and a stack of L layers held all L layers' patterns on every
device. Now each array of the sparsity state is named after the kernel (a mask the kernel's names, packed positions
their last dim's, block index arrays ``(None,)``) and the stack axis is split as the weights' is.

Checked: the spec of every variable of a stack of every NNX layer kind (abstract), and of the Linen layers under
``nn.scan`` and ``nn.vmap``; a ``jax.jit(..., out_shardings=nnx.get_named_sharding(...))`` init (Linen:
``nn.get_sharding``) of the kinds whose patterns the fix names (and the compressed N:M layer), every array's shards on
every device, the patterns' bytes per device (at most half of them on a ``(2, 2)`` mesh: each device holds its half
of the layers'); forward and gradients of a scan over the sharded stack equal to the unsharded stack's (float32, 1e-5
relative); with logical names and rules on a ``("data", "model")`` mesh, the sharded init equal to an unsharded one.
Data and seeds are fresh each run (``SEED`` in the messages; set ``MD_STACKED_SEED`` to repeat one). About 20 s on 2
cores.
"""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import CompressedNMEmbed
from jaxsparse.layers import CusparseLtKernel
from jaxsparse.layers import MaskedConv
from jaxsparse.layers import MaskedLinear
from jaxsparse.layers import NMLinear
from jaxsparse.layers import SparseLinearGeneral
from jaxsparse.layers import SparsityPattern
from jaxsparse.layers import linen as sparse_linen
from jaxsparse.layers.linen import SPARSITY
from tests._util import rel_err

SEED = int(os.environ.get("MD_STACKED_SEED", np.random.SeedSequence().entropy % 2**31))
L, D, ROWS = 4, 32, 8
F32_TOL = 1e-5
STACK = {nnx.PARTITION_NAME: "layers"}
# Logical names mapped to the ("data", "model") mesh by the variables' own rules (the "layers" stack axis included).
RULES = (("layers", "data"), ("embed", None), ("mlp", "model"))


@pytest.fixture(autouse=True)
def _float32_products():
  with jax.default_matmul_precision("highest"):
    yield


def _mesh(names=("layers", "model")):
  return jax.make_mesh((2, 2), names, axis_types=(AxisType.Auto,) * 2)


def _init(*names, **metadata):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names, **metadata)


def _bias(*names, **metadata):  # nonzero biases
  return nnx.with_partitioning(nnx.initializers.normal(0.1), names, **metadata)


def _block(rngs):
  return BlockSparseLinear(D, D, density=0.5, block_shape=(8, 8), kernel_init=_init(None, None, "model"),
                           bias_init=_bias("model"), rngs=rngs)


def _masked(rngs):
  return MaskedLinear(D, D, sparsity=0.75, kernel_init=_init(None, "model"), bias_init=_bias("model"), rngs=rngs)


def _masked_logical(rngs):  # logical names and rules, on a ("data", "model") mesh
  return MaskedLinear(D, D, sparsity=0.75, kernel_init=_init("embed", "mlp", sharding_rules=RULES),
                      bias_init=_bias("mlp", sharding_rules=RULES), rngs=rngs)


def _masked_conv(rngs):
  return MaskedConv(8, 8, (3,), sparsity=0.5, kernel_init=_init(None, None, "model"), bias_init=_bias("model"),
                    rngs=rngs)


def _general(rngs):
  inner = MaskedLinear(D, D, sparsity=0.5, kernel_init=_init(None, "model"), bias_init=_bias("model"), rngs=rngs)
  return SparseLinearGeneral(inner, in_features=(4, 8), out_features=D)


def _nm(rngs):
  return NMLinear(D, D, kernel_init=_init(None, "model"), bias_init=_bias("model"), rngs=rngs)


def _compressed(rngs):
  return _nm(rngs).to_compressed()


def _cusparselt(rngs):  # the weight kept only as cuSPARSELt's buffer (written on any device): (D, 2 * D)
  return NMLinear(D, 2 * D, kernel_init=_init(None, "model"), bias_init=_bias("model"), rngs=rngs).to_compressed(
      storage="cusparselt")


def _embed(rngs):
  table = nnx.Embed(D, D, embedding_init=_init("model", None), rngs=rngs)
  return CompressedNMEmbed.from_dense(table, 2, 4)


BLOCK_INDEX = ("col_indices", "col_offsets", "row_indices", "row_offsets", "transpose_order")
# kind -> (one layer from rngs, {variable path: names of one layer}); a stack's names are ("layers", *names).
NNX = {
    "block": (_block, {"kernel": (None, None, "model"), "bias": ("model",),
                       **{f"pattern/{f}": (None,) for f in BLOCK_INDEX}}),
    "masked": (_masked, {"kernel": (None, "model"), "bias": ("model",), "mask": (None, "model")}),
    "masked_conv": (_masked_conv, {"kernel": (None, None, "model"), "bias": ("model",),
                                   "mask": (None, None, "model")}),
    "general": (_general, {"layer/kernel": (None, "model"), "layer/bias": ("model",), "layer/mask": (None, "model")}),
    "nm": (_nm, {"kernel": (None, "model"), "bias": ("model",)}),
    "compressed": (_compressed, {"kernel": (None, "model"), "bias": ("model",), "kernel_positions": (None, "model")}),
    "cusparselt": (_cusparselt, {"kernel_buffer": (None,), "bias": ("model",)}),
    "embed": (_embed, {"embedding": (None, "model"), "embedding_positions": (None, "model")}),
    "masked_logical": (_masked_logical, {"kernel": ("embed", "mlp"), "bias": ("mlp",), "mask": ("embed", "mlp")}),
}
EVERY_KIND = tuple(k for k in NNX if k != "masked_logical")
# The kinds of the sharded init, forward and backward (each costs a second or two of compilation on 2 cores): those
# with a sparsity state that the fix names, and the compressed layer (its positions split over "model" too).
RUN = ("block", "masked", "masked_conv", "general", "compressed")


class _Step(nnx.Module):
  """One step of a stack (a scanned transformer block): a layer of each of ``kinds``, chained ``(.., D) -> (.., D)``."""

  def __init__(self, kinds: tuple[str, ...], rngs: nnx.Rngs):
    self.kinds = kinds
    for kind in kinds:
      setattr(self, kind, NNX[kind][0](rngs))

  def __call__(self, h: jax.Array) -> jax.Array:
    for kind in self.kinds:
      layer = getattr(self, kind)
      if kind == "masked_conv":  # (rows, D) as (rows, 4 positions, 8 channels), D's split over "model" on channels
        # (XLA's CPU partitioner, jax 0.10.2, gets a conv wrong whose spatial dim and kernel outputs are split over
        # the same mesh axis: the plain reshape to (rows, 4, 8) would put D's split on the positions.)
        y = layer(h.reshape(*h.shape[:-1], 8, 4).swapaxes(-1, -2)).swapaxes(-1, -2).reshape(h.shape)
      elif kind == "general":
        y = layer(h.reshape(*h.shape[:-1], 4, 8))
      elif kind == "cusparselt":
        y = layer(h)
        y = y[..., :D] + y[..., D:]
      elif kind == "embed":
        y = layer.attend(h)
      else:
        y = layer(h)
      h = jnp.tanh(y)
    return h


def _stack(kinds: tuple[str, ...], seed: int) -> nnx.Module:
  @nnx.split_rngs(splits=L)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=STACK)
  def create(rngs):
    return _Step(kinds, rngs)

  return create(nnx.Rngs(seed))


def _flat(state) -> dict[str, object]:
  return {"/".join(map(str, path)): v for path, v in nnx.to_flat_state(state)}


def _specs(state) -> dict[str, tuple]:
  """``{path: names}`` of every variable of an NNX state (``()`` where ``nnx.get_partition_spec`` gives ``P()``)."""
  return {path: tuple(v.get_value()) for path, v in _flat(nnx.get_partition_spec(state)).items()}


def _assert_specs(specs: dict, want: dict, what: str) -> None:
  wrong = {p: (specs.get(p), want.get(p)) for p in specs.keys() | want.keys() if specs.get(p) != want.get(p)}
  assert not wrong, f"{what}: {{path: (spec, wanted)}} = {wrong} (SEED={SEED})"


def _assert_split(arrays: dict, specs: dict, mesh, what: str) -> None:
  """Each array's shard on every device is its shape split by its spec's mesh axes (the stack axis halved)."""
  for path, a in arrays.items():
    spec = specs[path]
    assert a.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec)), a.ndim), (what, path, a.sharding, spec, SEED)
    want = tuple(d // (mesh.shape[s] if s else 1) for d, s in zip(a.shape, spec + (None,) * a.ndim, strict=False))
    got = {tuple(s.data.shape) for s in a.addressable_shards}
    assert got == {want}, f"{what} {path}: shards {got}, want {want} (global {a.shape}, spec {spec}; SEED={SEED})"


def _assert_half_per_device(structure: list, mesh, what: str) -> None:
  """Memory per device: each device holds at most half the stack's patterns (a quarter where "model" splits them)."""
  assert structure, what
  total = sum(a.nbytes for a in structure)
  for device in mesh.devices.flat:
    held = sum(s.data.nbytes for a in structure for s in a.addressable_shards if s.device == device)
    assert held <= total // 2, f"{what}: {device} holds {held} of the patterns' {total} bytes (SEED={SEED})"


def _abstract_stack(kinds: tuple[str, ...], seed: int, mesh, rules: dict):
  """The stack's graphdef and abstract state (built under the mesh), its specs checked: every variable has the stack
  axis, the other dims as its layer names them (through ``rules``)."""
  with jax.set_mesh(mesh):
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: _stack(kinds, seed)))
  want = {f"{kind}/{path}": tuple(rules.get(n, n) for n in ("layers", *names))
          for kind in kinds for path, names in NNX[kind][1].items()}
  _assert_specs(_specs(abstract), want, "stacked NNX layers")
  for path, v in _flat(abstract).items():
    assert len(want[path]) == v.get_value().ndim, (path, want[path], v.get_value().shape)
  return graphdef, abstract


def _check_nnx_stack(kinds: tuple[str, ...], mesh, rules: dict, *, unsharded_init: bool) -> None:
  """The sharded init of a stack of ``kinds`` (its patterns split, memory per device), then its forward and gradients
  against the unsharded stack's: built without a mesh (``unsharded_init``: also the same values; a second compile of
  the init, ~1.5 s a layer kind), else the sharded init's values gathered onto one device."""
  seed = SEED + len(kinds)
  graphdef, abstract = _abstract_stack(kinds, seed, mesh, rules)
  specs = _specs(abstract)

  with jax.set_mesh(mesh):
    state = jax.jit(lambda: nnx.state(_stack(kinds, seed)), out_shardings=nnx.get_named_sharding(abstract, mesh))()
  flat = _flat(state)
  _assert_split({path: v.get_value() for path, v in flat.items()}, specs, mesh, "sharded init")
  structure = {path: v.get_value() for path, v in flat.items() if isinstance(v, (SparsityPattern, CusparseLtKernel))}
  _assert_half_per_device(list(structure.values()), mesh, "sharded init")

  if unsharded_init:
    with nnx.use_eager_sharding(False):  # no mesh: the unsharded stack, on one device
      ref = jax.jit(lambda: nnx.state(_stack(kinds, seed)))()
    flat_ref = _flat(ref)
    assert flat.keys() == flat_ref.keys()
    for path, v in flat.items():  # the same layers: patterns exactly, weights to float32's rounding
      a, b = np.asarray(v.get_value()), np.asarray(flat_ref[path].get_value())
      if path in structure:
        np.testing.assert_array_equal(a, b, err_msg=f"{path} SEED={SEED}")
      else:
        assert rel_err(a, b) <= F32_TOL, (path, SEED)
  else:
    ref = jax.device_get(state)  # the same values, unsharded (NumPy: on one device)

  def loss(stack, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=STACK)
    def run(h, step):
      return step(h)

    return jnp.sum(run(x, stack) ** 2)

  train_step = nnx.jit(nnx.value_and_grad(loss))
  x = jax.random.normal(jax.random.key(seed), (ROWS, D), jnp.float32)
  with jax.set_mesh(mesh):
    value, grads = train_step(nnx.merge(graphdef, state), x)
  value_ref, grads_ref = train_step(nnx.merge(graphdef, ref), x)
  assert rel_err(value, value_ref) <= F32_TOL, (float(value), float(value_ref), SEED)
  grads, grads_ref = _flat(grads), _flat(grads_ref)
  assert grads.keys() == grads_ref.keys() and grads
  for path, g in grads.items():
    assert rel_err(g.get_value(), grads_ref[path].get_value()) <= F32_TOL, (path, SEED)


def test_nnx_stack_specs_of_every_layer_kind():
  """A stack built by ``nnx.vmap(..., transform_metadata=...)`` of a step holding every NNX layer kind: every variable
  has the stack axis in its spec, of the variable's rank (the patterns of the layers built directly had ``P()``)."""
  _abstract_stack(EVERY_KIND, SEED, _mesh(), {})


def test_nnx_stack_sharded_init_forward_and_grad():
  """A jitted sharded init (``out_shardings=nnx.get_named_sharding(...)``) splits the patterns over ``"layers"`` (half
  the bytes per device, or less; they were replicated); a scan over it (``nnx.scan`` with the same
  ``transform_metadata``) and its gradients equal the unsharded stack's."""
  _check_nnx_stack(RUN, _mesh(), {}, unsharded_init=False)


def test_nnx_stack_with_logical_names_and_rules():
  """Logical names with the variables' own ``sharding_rules`` (``"layers"`` -> ``"data"``, ``"mlp"`` -> ``"model"``)
  on a ``("data", "model")`` mesh: the mask takes the kernel's rules with its names; the sharded init gives the
  unsharded init's layers."""
  _check_nnx_stack(("masked_logical",), _mesh(("data", "model")), dict(RULES), unsharded_init=True)


def _linen(kind: str) -> nn.Module:
  """A Linen layer of ``kind``, its kernel and bias named (``nn.with_partitioning``)."""
  init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, None, "model") if kind == "block" else
                              (None, "model"))
  bias = nn.with_partitioning(nn.initializers.normal(0.1), ("model",))
  if kind == "block":
    return sparse_linen.BlockSparseDense(D, density=0.5, block_shape=(8, 8), kernel_init=init, bias_init=bias)
  if kind == "masked":
    return sparse_linen.MaskedDense(D, sparsity=0.75, kernel_init=init, bias_init=bias)
  return sparse_linen.CompressedNMDense(D, kernel_init=init, bias_init=bias)


# kind -> {collection/variable: names of one layer}; a stack's names are ("layers", *names).
LINEN = {
    "block": {"params/kernel": (None, None, "model"), "params/bias": ("model",),
              **{f"{SPARSITY}/{f}": (None,) for f in BLOCK_INDEX}},
    "masked": {"params/kernel": (None, "model"), "params/bias": ("model",), f"{SPARSITY}/mask": (None, "model")},
    "compressed": {"params/kernel": (None, "model"), "params/bias": ("model",),
                   f"{SPARSITY}/kernel_positions": (None, "model")},
}


class _LinenStep(nn.Module):
  """One step of a Linen stack: a layer of each of ``kinds``, chained."""

  kinds: tuple[str, ...]

  @nn.compact
  def __call__(self, h, _):
    for kind in self.kinds:
      h = jnp.tanh(_linen(kind)(h))
    return h, None


def _linen_stack(kinds: tuple[str, ...], transform: str) -> nn.Module:
  axes = dict(variable_axes={"params": 0, SPARSITY: 0}, split_rngs={"params": True},
              metadata_params={nn.PARTITION_NAME: "layers"})
  if transform == "scan":
    return nn.scan(_LinenStep, length=L, **axes)(kinds, name="stack")
  return nn.vmap(_LinenStep, in_axes=(None, None), out_axes=0, axis_size=L, **axes)(kinds, name="stack")


def _linen_specs(variables) -> dict[str, tuple]:
  flat = jax.tree_util.tree_flatten_with_path(nn.get_partition_spec(variables), is_leaf=lambda s: isinstance(s, P))[0]
  return {"/".join(str(k.key) for k in path if k.key != "stack"): tuple(s) for path, s in flat}


_MODULE = {"block": "BlockSparseDense_0", "masked": "MaskedDense_0", "compressed": "CompressedNMDense_0"}


def _linen_want(kinds) -> dict[str, tuple]:
  return {f"{path.split('/')[0]}/{_MODULE[kind]}/{path.split('/')[1]}": ("layers", *names)
          for kind in kinds for path, names in LINEN[kind].items()}


@pytest.mark.parametrize("transform", ["scan", "vmap"])
@pytest.mark.parametrize("kind", list(LINEN))
def test_linen_stack_specs(kind, transform):
  """``nn.scan`` / ``nn.vmap`` with ``metadata_params`` put the stack axis in every variable's spec, the
  ``"sparsity"`` collection's too (it was ``P()``)."""
  x = jnp.ones((ROWS, D))
  abstract = jax.eval_shape(lambda: _linen_stack((kind,), transform).init(jax.random.key(SEED), x, None))
  _assert_specs(_linen_specs(abstract), _linen_want((kind,)), f"Linen {kind} under nn.{transform}")


def test_linen_stack_sharded_init_forward_and_grad():
  """A jitted sharded init of an ``nn.scan`` stack (each step a block-sparse, a masked and a compressed N:M layer)
  splits the ``"sparsity"`` collection over ``"layers"`` (it was replicated); the scan's forward and gradients equal
  the unsharded stack's."""
  mesh = _mesh()
  seed = SEED + 100
  x = jax.random.normal(jax.random.key(seed), (ROWS, D), jnp.float32)
  model = _linen_stack(tuple(LINEN), "scan")
  init = lambda: model.init(jax.random.key(seed), x, None)
  with jax.set_mesh(mesh):
    variables = jax.jit(init, out_shardings=nn.get_sharding(jax.eval_shape(init), mesh))()
  specs = _linen_specs(variables)
  _assert_specs(specs, _linen_want(LINEN), "Linen stack")
  flat = {p: a for p, a in zip(specs, jax.tree.leaves(nn.meta.unbox(variables)), strict=True)}
  _assert_split(flat, specs, mesh, "Linen sharded init")
  _assert_half_per_device([a for p, a in flat.items() if p.startswith(SPARSITY)], mesh, "Linen sharded init")
  ref = jax.device_get(nn.meta.unbox(variables))  # the same values, unsharded (NumPy: on one device)

  def loss(params, sparsity, x):
    h, _ = model.apply({"params": params, SPARSITY: sparsity}, x, None)
    return jnp.sum(h**2)

  step = jax.jit(jax.value_and_grad(loss))
  with jax.set_mesh(mesh):
    value, grads = step(variables["params"], variables[SPARSITY], x)
  value_ref, grads_ref = step(ref["params"], ref[SPARSITY], x)
  assert rel_err(value, value_ref) <= F32_TOL, (float(value), float(value_ref), SEED)
  grads, grads_ref = jax.tree.leaves(nn.meta.unbox(grads)), jax.tree.leaves(grads_ref)
  assert len(grads) == len(grads_ref) == 6
  for g, g_ref in zip(grads, grads_ref, strict=True):
    assert rel_err(g, g_ref) <= F32_TOL, SEED
