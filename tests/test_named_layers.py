"""Sparse layers built directly with a named kernel (``nnx.with_partitioning`` / ``nn.with_partitioning``) through the
workflows around them, on one device: their sparsity state is named (boxed, in Linen) like the kernel, and every tool
that reads it must read it as it reads an unnamed layer's. The multi-device side (meshes, sharded training, restores
onto another mesh) is ``tests/multidevice/md_named_workflows.py``.

Regressions:

* the torch export of Linen variables (``torch_interop.export_masks`` / ``export_state_dict``) read the boxes
  themselves: with the ``"sparsity"`` boxes of a named ``MaskedDense`` / ``BlockSparseDense`` (params unboxed for
  training, as the pruners' path rules need) it raised ``TypeError: object of type 'Partitioned' has no len()``;
  with boxed params (the variables as ``init`` returns them, a ``sparsify_linen`` result, a bridged
  ``nnx.bridge.ToLinen`` layer's ``NNXMeta``) ``ValueError: ...: its kernel has shape () and its bias (32,) ...``;
* ``jaxsparse.summary`` of a stack of block-sparse layers: an NNX ``BlockSparseLinear`` stack (``nnx.vmap``) was shown
  as one layer's ``(K, N)`` kernel keeping all the stack's blocks (density ``layers * density``, 2.000 for 4 layers
  at 0.5); a Linen ``BlockSparseDense`` stack (``nn.scan``) raised ``ValueError: too many values to unpack``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsparse
from jaxsparse import pruning
from jaxsparse import torch_interop
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import MaskedLinear
from jaxsparse.layers import linen as sparse_linen
from jaxsparse.layers._block_sparse import BLOCK_VALUES
from jaxsparse.layers._masked import OWN_MASK

D, L = 32, 4
SPARSITY = sparse_linen.SPARSITY


def _linen_init(named: bool, *names):
  return nn.with_partitioning(nn.initializers.lecun_normal(), names) if named else nn.initializers.lecun_normal()


def _nnx_init(named: bool, *names):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names) if named else nnx.initializers.lecun_normal()


class _LinenNet(nn.Module):
  named: bool = True

  @nn.compact
  def __call__(self, x):
    x = sparse_linen.MaskedDense(D, sparsity=0.5, kernel_init=_linen_init(self.named, None, "model"), name="m")(x)
    x = sparse_linen.BlockSparseDense(D, density=0.5, block_shape=(8, 8),
                                      kernel_init=_linen_init(self.named, None, None, "model"), name="b")(jnp.tanh(x))
    return x


class _BridgedNet(nn.Module):
  """NNX layers under ``nnx.bridge.ToLinen``: named, their variables come in ``NNXMeta`` boxes."""

  named: bool = True

  @nn.compact
  def __call__(self, x):
    x = nnx.bridge.to_linen(MaskedLinear, D, D, sparsity=0.5, kernel_init=_nnx_init(self.named, None, "model"),
                            name="m")(x)
    return nnx.bridge.to_linen(BlockSparseLinear, D, D, density=0.5, block_shape=(8, 8),
                               kernel_init=_nnx_init(self.named, None, None, "model"), name="b")(jnp.tanh(x))


def _one_device_mesh():
  """NNX's eager sharding of named variables needs a mesh: one of one device."""
  return jax.set_mesh(jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,)))


def _is_box(x) -> bool:
  return isinstance(x, nn.meta.AxisMetadata)


def _values(tree):
  """``tree`` with every box replaced by its value (no sharding constraint)."""
  return jax.tree.map(lambda x: x.unbox(apply_constraint=False) if isinstance(x, nn.Partitioned)
                      else x.unbox() if _is_box(x) else x, tree, is_leaf=_is_box)


def _assert_same_tensors(got: dict, want: dict, what: str = "") -> None:
  assert sorted(got) == sorted(want) and want, what
  for name, t in want.items():
    np.testing.assert_array_equal(got[name].numpy(), t.numpy(), err_msg=f"{what}: {name}")


@pytest.mark.parametrize("model", [_LinenNet, _BridgedNet])
def test_linen_torch_export_of_named_layers_reads_their_boxes(model):
  x = jax.random.normal(jax.random.key(1), (4, D))
  with _one_device_mesh():
    named = jax.jit(model(True).init)(jax.random.key(0), x)
  unnamed = jax.jit(model(False).init)(jax.random.key(0), x)
  assert all(_is_box(v) for v in jax.tree.leaves(named[SPARSITY], is_leaf=_is_box))  # the patterns are boxed
  # No names, no boxes, but for the NNXMeta boxes that keep a bridged BlockSparseLinear's or MaskedLinear's kernel's
  # mark for the pruners.
  marked = lambda v: isinstance(v, nnx.bridge.variables.NNXMeta) and bool(set(v.metadata) & {BLOCK_VALUES, OWN_MASK})
  assert not any(_is_box(v) and not marked(v) for v in jax.tree.leaves(unnamed, is_leaf=_is_box))
  # The same layers: the names change no value.
  for a, b in zip(jax.tree.leaves(_values(named)), jax.tree.leaves(unnamed), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  masks = torch_interop.export_masks(unnamed)
  state = torch_interop.export_state_dict(unnamed, format="prune")
  assert set(masks) == {"m.weight_mask", "b.weight_mask"}
  variants = {  # the first, the training idiom, exported before the patterns were boxed (43c05a6)
      "params unboxed for training, patterns as init returns them": {**named, "params": _values(named["params"])},
      "as init returns them": named,
  }
  for what, variables in variants.items():
    _assert_same_tensors(torch_interop.export_masks(variables), masks, what)
    _assert_same_tensors(torch_interop.export_state_dict(variables, format="prune"), state, what)


def test_linen_torch_export_of_sparsify_linen_boxes_and_pruned_patterns():
  """The boxes ``sparsify_linen`` carries over from a named dense model, and a named layer's mask narrowed by
  ``pruning.apply_masks`` (kept in its box): the export is the unboxed variables'."""
  x = jax.random.normal(jax.random.key(1), (4, D))

  class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(D, kernel_init=_linen_init(True, None, "model"), name="d")(x)
      return _LinenNet(name="net")(x)

  variables = jax.jit(Dense().init)(jax.random.key(0), x)
  rules = {r"^d$": jaxsparse.BlockSparse(density=0.5, block_shape=(8, 8))}
  sparse, sparse_vars, _ = jaxsparse.sparsify_linen(Dense(), variables, rules, x)
  masks = pruning.magnitude_masks(_values(sparse_vars["params"]), {r"net\.m\.kernel": jaxsparse.Unstructured(0.75)})
  pruned = pruning.apply_masks(sparse_vars, masks)
  assert isinstance(pruned[SPARSITY]["net"]["m"]["mask"], nn.Partitioned)
  assert float(jnp.mean(_values(pruned[SPARSITY])["net"]["m"]["mask"])) == 0.25
  got = torch_interop.export_masks(pruned, module=sparse)
  _assert_same_tensors(got, torch_interop.export_masks(_values(pruned), module=sparse))
  assert float(got["net.m.weight_mask"].float().mean()) == 0.25


def test_summary_of_a_named_nnx_stack_of_block_sparse_layers():
  """Each row of a stack (``nnx.vmap``, the stack axis named by ``transform_metadata``) has the stack's shape and one
  layer's density, block-sparse as masked."""

  class Step(nnx.Module):
    def __init__(self, rngs):
      self.b = BlockSparseLinear(D, D, density=0.5, block_shape=(8, 8),
                                 kernel_init=_nnx_init(True, None, None, "model"), rngs=rngs)
      self.m = MaskedLinear(D, D, sparsity=0.75, kernel_init=_nnx_init(True, None, "model"), rngs=rngs)

  @nnx.split_rngs(splits=L)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def stack(rngs):
    return Step(rngs)

  with _one_device_mesh():
    s = jaxsparse.summary(nnx.jit(lambda: stack(nnx.Rngs(0)))())
  assert {row.path: (row.shape, row.density) for row in s.layers} == {"b": ((L, D, D), 0.5), "m": ((L, D, D), 0.25)}
  assert s.layers[0].forward_flops == L * 2 * (D * D // 2)  # each layer keeps half its weights


def test_summary_of_a_named_linen_stack_of_block_sparse_layers():
  class Step(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      return sparse_linen.BlockSparseDense(D, density=0.25, block_shape=(8, 8),
                                           kernel_init=_linen_init(True, None, None, "model"), name="b")(h), None

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      scan = nn.scan(Step, variable_axes={"params": 0, SPARSITY: 0}, split_rngs={"params": True}, length=L,
                     metadata_params={nn.PARTITION_NAME: "layers"})
      return scan(name="s")(x, None)[0]

  x = jnp.ones((2, D))
  variables = jax.jit(Stack().init)(jax.random.key(0), x)
  assert variables[SPARSITY]["s"]["b"]["row_offsets"].names == ("layers", None)
  for s in (jaxsparse.summary(variables), jaxsparse.summary(variables, x, module=Stack())):
    assert [(row.path, row.kind, row.shape, row.density) for row in s.layers] == [
        ("s.b", "BlockSparseDense", (L, D, D), 0.25)]
