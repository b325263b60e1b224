"""A stack of sparse layers split over its layer axis on explicit mesh axes, mapped over that axis, on 4 devices.

A stack built with ``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: "layers"})`` and placed with
``jax.jit(out_shardings=nnx.get_named_sharding(...))`` on a mesh of explicit axes holds each device's layers; JAX
refuses ``nnx.scan`` over it (even of ``nnx.Linear``: a scan's carry cannot be split), but ``nnx.vmap`` / ``jax.vmap``
over the layer axis runs ``nnx.Linear``. Regression: the sparse layers raised there, in the forward and the gradient:
``ValueError: 0th dimension of all xs should be replicated`` (the C++ kernels' batching rules run ``lax.map`` over the
mapped axis) and ``ShardingTypeError: This reshape is not supported`` (the block-sparse dense route); with the kernels
split over "model" too, ``All operands should have the same sharding``. Now a mapped product runs in a ``jax.shard_map``
over the mesh, each device mapping its own layers (``jaxsparse/ops/_sharding.py``).

Checked, on a ``("layers", "model")`` mesh of 2x2 explicit axes, for a step of a block-sparse, a masked (sparse
kernels: 10% kept), an N:M, a compressed N:M and a dense layer chained: ``nnx.vmap`` over the stack and ``x``, the
kernels split over "model" too; ``jax.vmap`` over the stack's state with ``x`` unmapped, its rows split over
"model"; per-example gradients (``jax.vmap`` of ``jax.grad`` over examples split over "layers"). Forward and the
gradient to ``x`` equal the dense reference from each layer's ``to_dense()`` weights, the parameter gradients those
of the same stack on one device (the masked kernel's also the dense gradient times its mask), float32 to 1e-5
relative; outputs keep the layer axis split. Data and seeds are fresh each run (``SEED`` in the messages; set
``MD_STACK_SEED`` to repeat one). About 40 s on 2 cores.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import MaskedLinear
from jaxsparse.layers import NMLinear
from tests._util import rel_err

SEED = int(os.environ.get("MD_STACK_SEED", np.random.SeedSequence().entropy % 2**31))
L, D, ROWS = 4, 32, 8
F32_TOL = 1e-5
STACK = {nnx.PARTITION_NAME: "layers"}
KINDS = ("block", "masked", "nm", "compressed", "dense")


@pytest.fixture(autouse=True)
def _float32_products():
  with jax.default_matmul_precision("highest"):
    yield


def _mesh():
  return jax.make_mesh((2, 2), ("layers", "model"), axis_types=(AxisType.Explicit,) * 2)


class _Step(nnx.Module):
  """One layer of each kind, chained ``(.., D) -> (.., D)``; kernels and biases split over ``out`` on their outputs."""

  def __init__(self, out: str | None, rngs: nnx.Rngs):
    init = lambda *names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)
    common = dict(bias_init=nnx.with_partitioning(nnx.initializers.normal(0.1), (out,)), rngs=rngs)
    self.block = BlockSparseLinear(D, D, density=0.5, block_shape=(8, 8), kernel_init=init(None, None, out), **common)
    self.masked = MaskedLinear(D, D, sparsity=0.9, kernel_init=init(None, out), **common)
    self.nm = NMLinear(D, D, kernel_init=init(None, out), **common)
    self.compressed = NMLinear(D, D, kernel_init=init(None, out), **common).to_compressed()
    self.dense = nnx.Linear(D, D, kernel_init=init(None, out), **common)

  def __call__(self, h: jax.Array) -> jax.Array:
    for kind in KINDS:
      h = jnp.tanh(getattr(self, kind)(h))
    return h


def _stack(out: str | None, seed: int):
  """``(graphdef, params, rest)`` of a stack of ``L`` steps, split over "layers" on the mesh, and the same unsharded."""

  def make():
    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=STACK)
    def create(rngs):
      return _Step(out, rngs)

    return nnx.split(create(nnx.Rngs(seed)), nnx.Param, ...)

  mesh = _mesh()
  with jax.set_mesh(mesh):
    graphdef, *abstract = nnx.eval_shape(make)
    states = jax.jit(lambda: make()[1:], out_shardings=nnx.get_named_sharding(tuple(abstract), mesh))()
  for v in jax.tree.leaves(states):
    assert v.sharding.spec[0] == "layers", (v.shape, v.sharding, SEED)
  return graphdef, states, jax.device_get(states)


def _dense_reference(graphdef, unsharded) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """``{kind: (kernels (L, D, D), biases (L, D))}``: each layer's ``to_dense()`` weights."""
  steps = [nnx.merge(graphdef, *jax.tree.map(lambda a, i=i: np.asarray(a)[i], unsharded)) for i in range(L)]
  out = {}
  for kind in KINDS:
    dense = [getattr(s, kind) if kind == "dense" else getattr(s, kind).to_dense() for s in steps]
    out[kind] = tuple(np.stack([np.asarray(getattr(d, n).get_value()) for d in dense]) for n in ("kernel", "bias"))
  return out


def _dense_loss(weights, x, *, mapped_x: bool):
  """The reference: ``sum(step(x)**2)`` per layer (``x`` per layer where ``mapped_x``), summed; float32."""

  def one(layer, x):
    for kind in KINDS:
      kernel, bias = layer[kind]
      x = jnp.tanh(x @ kernel + bias)
    return jnp.sum(x**2)

  return jnp.sum(jax.vmap(one, in_axes=(0, 0 if mapped_x else None))(weights, x))


def _check(what, got, want, tol=F32_TOL):
  err = rel_err(got, want)
  assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e} (SEED={SEED})"


def _check_stack(out: str | None, x_spec: P, run, *, mapped_x: bool, seed: int) -> None:
  """``run(stack, x)`` (a map over the stack) on the split stack against the dense reference and the unsharded stack:
  output, gradients to ``x`` and to the parameters."""
  graphdef, (params, rest), (params1, rest1) = _stack(out, seed)
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((L, ROWS, D) if mapped_x else (ROWS, D)).astype(np.float32)
  def loss(stack, x):
    y = run(stack, x)
    return jnp.sum(y**2), y

  step = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  mesh = _mesh()
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, x_spec)
    (value, y), (dparams, dx) = step(nnx.merge(graphdef, params, rest), xs)
  assert y.sharding.spec[0] == "layers", (y.sharding, SEED)
  assert dx.sharding.spec == jax.typeof(xs).sharding.spec, (dx.sharding, xs.sharding, SEED)

  dense = _dense_reference(graphdef, (params1, rest1))
  weights = {k: tuple(map(jnp.asarray, v)) for k, v in dense.items()}
  y_ref = jax.vmap(lambda w, x: _dense_forward(w, x), in_axes=(0, 0 if mapped_x else None))(weights, x)
  _check("forward", y, y_ref)
  value_ref, (dweights, dx_ref) = jax.value_and_grad(_dense_loss, argnums=(0, 1))(weights, x, mapped_x=mapped_x)
  _check("loss", value, value_ref)
  _check("dx", dx, dx_ref)
  mask = np.asarray(rest1["masked"]["mask"].get_value())
  _check("masked kernel gradient", dparams["masked"]["kernel"].get_value(), dweights["masked"][0] * mask)
  _, (dparams1, _) = step(nnx.merge(graphdef, params1, rest1), x)  # the same stack on one device
  flat, flat1 = nnx.to_flat_state(dparams), nnx.to_flat_state(dparams1)
  assert [p for p, _ in flat] == [p for p, _ in flat1] and len(flat) == 2 * len(KINDS)
  for (path, g), (_, g1) in zip(flat, flat1, strict=True):
    _check(f"gradient {path}", g.get_value(), g1.get_value())


def _dense_forward(layer, x):
  for kind in KINDS:
    kernel, bias = layer[kind]
    x = jnp.tanh(x @ kernel + bias)
  return x


def test_nnx_vmap_over_a_stack_split_over_layers_and_model():
  """``nnx.vmap`` over the stack and ``x`` (split over "layers" alike); the kernels split over "model" too."""

  @nnx.vmap(in_axes=(0, 0), out_axes=0, transform_metadata=STACK)
  def run(step, x):
    return step(x)

  _check_stack("model", P("layers"), run, mapped_x=True, seed=SEED)


def test_jax_vmap_over_a_stack_with_unmapped_rows_split_over_model():
  """``jax.vmap`` over the stack's state, ``x`` unmapped (one input to every layer), its rows split over "model"."""

  def run(stack, x):
    graphdef, params, rest = nnx.split(stack, nnx.Param, ...)
    return jax.vmap(lambda p, r: nnx.merge(graphdef, p, r)(x))(params, rest)

  _check_stack(None, P("model"), run, mapped_x=False, seed=SEED + 1)


def test_per_example_gradients_over_examples_split_over_layers():
  """``jax.vmap(jax.grad(...))`` over examples split over "layers": one kernel gradient per example, each the dense
  gradient (times the mask for the masked layer) of that example."""
  graphdef, (params, rest), (params1, rest1) = _stack(None, SEED + 2)
  mesh = _mesh()
  with jax.set_mesh(mesh):  # layer 0 of the stack, replicated
    layer0 = jax.tree.map(lambda a: jax.reshard(a, P())[0], (params, rest))
  x = np.random.default_rng(SEED + 2).standard_normal((L, ROWS, D)).astype(np.float32)

  def per_example(params, rest, x):
    loss = lambda p, x: jnp.sum(nnx.merge(graphdef, p, rest)(x) ** 2)
    return jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, x)

  with jax.set_mesh(mesh):
    grads = jax.jit(per_example)(*layer0, jax.device_put(x, P("layers")))
  dense = {k: tuple(jnp.asarray(a[0]) for a in v) for k, v in _dense_reference(graphdef, (params1, rest1)).items()}
  dweights = jax.vmap(jax.grad(lambda w, x: jnp.sum(_dense_forward(w, x) ** 2)), in_axes=(None, 0))(dense, x)
  mask = np.asarray(rest1["masked"]["mask"].get_value())[0]
  got = grads["masked"]["kernel"].get_value()
  assert got.sharding.spec[0] == "layers", (got.sharding, SEED)
  _check("per-example masked kernel gradients", got, dweights["masked"][0] * mask)
  _check("per-example dense kernel gradients", grads["dense"]["kernel"].get_value(), dweights["dense"][0])
  grads1 = jax.jit(per_example)(*jax.tree.map(lambda a: a[0], (params1, rest1)), x)
  for (path, g), (_, g1) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(grads1), strict=True):
    _check(f"per-example gradient {path}", g.get_value(), g1.get_value())
