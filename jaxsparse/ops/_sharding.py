"""Data-parallel partitioning of the ops' products: leading dims of the activations split, weights replicated.

Every product of the ops is ``f(rows..., weights)`` where the ``rows`` arrays (``x``, ``dY``) share
their leading (batch, sequence) dims and the weights do not depend on them. :func:`row_parallel`
runs such a product under ``jax.sharding`` so that each device computes its own rows and nothing
of the activations is gathered:

* leading dims sharded over some mesh axes -> each device calls ``f`` on its rows, whatever
  backend ``f`` dispatches to (Pallas, the C++ FFI kernels, XLA);
* outputs with those leading dims (``y``, ``dX``) keep their sharding;
* outputs that sum over the rows (the weight gradient ``dW = xᵀ dY``) are reduced across those
  axes with one ``psum`` (on a CPU, 16-bit floats summed in float32), so data-parallel training needs no reduction
  by the user;
* the weights, and the last (feature) dim of the activations, are replicated: gathered if they
  arrive sharded (tensor parallelism is a different layout: :mod:`jaxsparse.sharding`). The ops' plain XLA
  paths, differentiated by JAX itself, get the same layout from :func:`rows_and_replicated_weights` under
  explicit axes (under auto axes the compiler places their products).

How, depends on when the shardings are known:

* auto axes (``jit`` with ``NamedSharding`` inputs): only the compiler knows them, so the product
  is a :func:`jax.experimental.custom_partitioning` call with a Shardy sharding rule (leading dims
  pass through, all else replicated); the partition callback sees the shardings Shardy chose and
  lowers ``f`` per device (an eager call on a split ``x`` is jitted for that). ``jax.export`` cannot serialise that
  call (a Python callback): an exported program gets ``f`` itself, which the compiler partitions as it does any
  code (the kernels' custom calls may then run on gathered rows);
* explicit axes (``jax.set_mesh`` with ``AxisType.Explicit``): the shardings are in the types, so
  the product is a ``jax.shard_map`` with those specs (over ``x``'s mesh, or the weights' when only
  they are placed on one: ``x`` is then replicated on it);
* inside ``shard_map`` each device's operands are its own: with ``check_vma=True`` (operands typed as varying over
  its manual axes) ``f`` is called directly, with ``check_vma=False`` through the custom-partitioning call, which
  runs it on them as they are.

A leading dim that does not divide by its number of shards is gathered (correct, slower): padding
rows would add garbage to ``dW``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsparse import _utils

__all__ = ["check_reduced", "row_parallel", "rows_and_replicated_weights"]


def _lead_specs(spec, shape, n_lead: int, axis_size: Callable[[str], int]) -> tuple:
  """The usable spec entries of the ``n_lead`` leading dims: ``None`` where a dim does not divide."""
  spec = tuple(spec) + (None,) * (len(shape) - len(spec))
  out = []
  for entry, size in zip(spec[:n_lead], shape[:n_lead], strict=True):
    axes = _utils.spec_axes(entry)
    out.append(entry if axes and size % math.prod(axis_size(a) for a in axes) == 0 else None)
  return tuple(out)


def _psum(a: jax.Array, axes: tuple) -> jax.Array:
  """``lax.psum(a, axes)``; on a CPU backend floats narrower than float32 are summed in float32 and cast back.

  XLA's CPU compiler (jax 0.10) aborts the process ("Invalid binary instruction opcode copy", in its
  AllReducePromotion pass) on a bfloat16 all-reduce over some of a mesh's axes: the weight gradient of bfloat16
  weights with x's rows split over "data" of a ("data", "model") mesh. Accelerators keep the narrow all-reduce (half
  the bytes of a float32 one).
  """
  if not jnp.issubdtype(a.dtype, jnp.inexact) or jax.default_backend() != "cpu":
    return lax.psum(a, axes)
  return lax.psum(a.astype(_utils.accumulation_dtype(a.dtype)), axes).astype(a.dtype)


def _local(fn: Callable, n_rows: int, summed: frozenset, lead: tuple) -> Callable:
  """``fn`` on one device's rows, its ``summed`` outputs reduced over the axes of ``lead``."""
  axes = _utils.spec_axes(*lead)

  def local_fn(*args):
    outs = fn(*args)
    if not axes:
      return outs
    return tuple(_psum(o, axes) if i in summed else o for i, o in enumerate(outs))

  return local_fn


# -------------------------------------------------------------------------------------------------
# Auto axes: custom_partitioning with a Shardy rule.
# -------------------------------------------------------------------------------------------------


def _sharding_rule(n_rows, n_lead, arg_ndims, out_ndims, summed):
  """``"m0 m1 f0, m0 m1 f1, f2 f3 -> m0 m1 f4, f5 f6"``: ``m*`` pass through, every ``f*`` replicated."""
  lead = [f"m{i}" for i in range(n_lead)]
  replicated = []

  def dims(ndim: int, has_lead: bool) -> str:
    own = [f"f{len(replicated) + i}" for i in range(ndim - (n_lead if has_lead else 0))]
    replicated.extend(own)
    return " ".join((lead if has_lead else []) + own)

  ins = [dims(nd, i < n_rows) for i, nd in enumerate(arg_ndims)]
  outs = [dims(nd, i not in summed) for i, nd in enumerate(out_ndims)]
  return f"{', '.join(ins)} -> {', '.join(outs)}", {"need_replication_factors": tuple(replicated)}


def _auto_partitioned(fn: Callable, n_rows: int, n_lead: int, summed: frozenset) -> Callable:
  @custom_partitioning
  def call(*args):
    return fn(*args)

  def partition(mesh, arg_shapes, result_shape):
    x = arg_shapes[0]
    spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
    lead = _lead_specs(spec, x.shape, n_lead, lambda a: mesh.shape[a])
    rows_sharding = lambda nd: NamedSharding(mesh, P(*lead, *([None] * (nd - n_lead))))
    replicated = NamedSharding(mesh, P())
    args = tuple(rows_sharding(s.ndim) if i < n_rows else replicated for i, s in enumerate(arg_shapes))
    outs = tuple(replicated if i in summed else rows_sharding(s.ndim) for i, s in enumerate(result_shape))
    return mesh, _local(fn, n_rows, summed, lead), outs, args

  def rule(mesh, operand_types, result_types):
    del mesh
    ndims = lambda types: [len(t.shape) for t in types]
    return _sharding_rule(n_rows, n_lead, ndims(operand_types), ndims(result_types), summed)

  call.def_partition(partition, sharding_rule=rule)

  def bind(*args):
    # The custom-partitioning call as a jaxpr param: jit then lowers it with the devices it needs (not abstract ones).
    return tuple(_auto_p.bind(*args, fn=fn, partitioned=jax.make_jaxpr(call)(*args)))

  return bind


# jax.export cannot serialise custom partitioning: its CustomSPMDPartitioning call names a Python callback kept alive
# by the lowering (jax 0.10: "NotImplementedError: serialization of host_callbacks is not yet implemented"). So an
# exported program gets the product's plain body, which the compiler partitions by itself (the same results; the
# kernels' custom calls may run on gathered rows).
_auto_p = jax_core.Primitive("jaxsparse_row_parallel")
_auto_p.multiple_results = True
_auto_p.def_impl(lambda *args, fn, partitioned: jax.jit(fn)(*args))  # an eager call: one device
_auto_p.def_abstract_eval(lambda *avals, fn, partitioned: partitioned.out_avals)


def _auto_lowering(ctx, *args, fn, partitioned):
  body = fn if ctx.module_context.lowering_parameters.for_export else jax_core.jaxpr_as_fun(partitioned)
  return mlir.lower_fun(body, multiple_results=True)(ctx, *args)


mlir.register_lowering(_auto_p, _auto_lowering)


# -------------------------------------------------------------------------------------------------
# Explicit axes: shard_map with the specs from the types.
# -------------------------------------------------------------------------------------------------


def _explicit_lead(args: Sequence[jax.Array], n_lead: int):
  """``(mesh, lead specs)`` when ``args[0]`` (``x``) or, failing it, another argument (a weight placed on a mesh while
  ``x`` is not) is typed with explicit mesh axes, else ``None``. ``x`` not on that mesh has its rows replicated."""
  mesh = next((m for m in map(_utils.explicit_mesh, args) if m is not None), None)
  if mesh is None:
    return None
  for i, a in enumerate(args):
    if _utils.explicit_mesh(a) is not None:
      check_reduced(jax.typeof(a).sharding.spec, "x" if i == 0 else f"operand {i} ({jax.typeof(a).str_short()})")
  x = args[0]
  sharding = jax.typeof(x).sharding
  spec = sharding.spec if _utils.explicit_mesh(x) == mesh else P()
  return mesh, _lead_specs(spec, x.shape, n_lead, lambda a: mesh.shape[a])


def _resharded(a: jax.Array, mesh, spec: P) -> jax.Array:
  """``a`` resharded to ``spec`` (a no-op when it already is); works without a ``jax.set_mesh`` context."""
  placed = _utils.explicit_mesh(a) == mesh and jax.typeof(a).sharding.spec == spec
  return a if placed else jax.reshard(a, NamedSharding(mesh, spec))


def check_reduced(spec: P, what: str = "x") -> None:
  """Refuses an operand typed with unreduced (or reduced) partial sums over mesh axes, naming it as ``what``."""
  if spec.unreduced or spec.reduced:
    name = "x" if what == "x" else "a"
    raise ValueError(
        f"{what} is typed {spec}: unreduced partial sums, which a product cannot take (nor can a dense x @ w); "
        f"reduce them first, e.g. jax.reshard({name}, P{spec.partitions})."
    )


def _eager_and_split(x) -> bool:
  """True for a concrete ``x`` (an eager call) placed on more than one device."""
  return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and len(x.sharding.device_set) > 1


def _explicit_call(fn, n_rows, summed, mesh, lead, args, out_ndims):
  rows_spec = lambda nd: P(*lead, *([None] * (nd - len(lead))))
  specs = tuple(rows_spec(a.ndim) if i < n_rows else P() for i, a in enumerate(args))
  args = tuple(_resharded(a, mesh, s) for a, s in zip(args, specs, strict=True))
  out_specs = tuple(P() if i in summed else rows_spec(nd) for i, nd in enumerate(out_ndims))
  local = _local(fn, n_rows, summed, lead)
  # No autodiff runs through this map (it sits inside the ops' custom VJPs): nothing needs its types to track how
  # values vary.
  smap = jax.shard_map(
      local, mesh=mesh, in_specs=specs, out_specs=out_specs, axis_names=set(_utils.spec_axes(*lead)), check_vma=False
  )
  # Under jit: called eagerly, a map over some of the mesh's axes with check_vma=False fails in jax 0.10 ("out_specs
  # refers to 'model'", an axis it does not map) although its specs name only mapped axes. Inside jit it is inlined.
  return jax.jit(smap)(*args)


def _mapped(flat_fn, n_rows: int, summed: frozenset, in_batched: Sequence[bool], args: Sequence[jax.Array]):
  """``jax.vmap(flat_fn)`` over axis 0 of the ``in_batched`` args: :func:`row_parallel`'s batching rule where it
  cannot add the mapped axis to the rows' leading dims (mapped weights, or a mapped product with ``summed`` outputs).

  Under explicit mesh axes this runs in a ``jax.shard_map`` over the whole mesh: the mapped axis keeps its usable split
  (a ``jax.vmap`` over a stack of layers split over its layer axis: each device maps over its own layers), the rows'
  leading dims keep theirs on the other mesh axes (``summed`` outputs reduced over those), everything else is
  replicated, gathered where it arrives split, as in the unmapped product. Without that the per-element code sees
  arrays typed with a split mapped axis, which ``lax.map`` (the C++ kernels' batching rules) and some of JAX's
  reshape rules refuse, or weights split over other axes, which the kernels cannot take.
  """
  mapped = lambda *a: tuple(jax.vmap(flat_fn, in_axes=tuple(0 if b else None for b in in_batched))(*a))
  mesh = next((m for m in map(_utils.explicit_mesh, args) if m is not None), None)
  if mesh is None:
    return mapped(*args)
  axis_size = lambda a: mesh.shape[a]
  spec_of = lambda a: jax.typeof(a).sharding.spec if _utils.explicit_mesh(a) == mesh else P()
  for i, a in enumerate(args):
    check_reduced(spec_of(a), "x" if i == 0 else f"operand {i} ({jax.typeof(a).str_short()})")
  # The mapped axis: split as the first mapped operand (a row if one is mapped) has it, where it divides.
  first = min((i for i, b in enumerate(in_batched) if b), key=lambda i: (_utils.explicit_mesh(args[i]) != mesh, i))
  entry = _lead_specs(spec_of(args[first]), args[first].shape, 1, axis_size)[0]
  taken = set(_utils.spec_axes(entry))
  # The rows' leading dims (after the mapped axis where x is mapped): x's usable split on the axes left.
  x, off = args[0], int(in_batched[0])
  lead = _lead_specs(tuple(spec_of(x))[off:], x.shape[off:], x.ndim - 1 - off, axis_size)
  lead = tuple(None if set(_utils.spec_axes(e)) & taken else e for e in lead)
  specs = tuple(P(*((entry,) if b else ()), *((*lead, None) if i < n_rows else ())) for i, b in enumerate(in_batched))
  args = tuple(_resharded(a, mesh, s) for a, s in zip(args, specs, strict=True))
  n_out = len(jax.eval_shape(mapped, *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]))
  out_specs = tuple(P(entry) if i in summed else P(entry, *lead, None) for i in range(n_out))
  smap = jax.shard_map(_local(mapped, n_rows, summed, lead), mesh=mesh, in_specs=specs, out_specs=out_specs,
                       check_vma=False)
  return jax.jit(smap)(*args)  # jitted: see _explicit_call


# -------------------------------------------------------------------------------------------------
# The entry point.
# -------------------------------------------------------------------------------------------------


def row_parallel(
    fn: Callable[..., tuple[jax.Array, ...]],
    rows: Sequence[jax.Array],
    rest: object,
    *,
    summed: Sequence[int] = (),
    like: Mapping[int, jax.Array] | None = None,
) -> tuple[jax.Array, ...]:
  """Calls ``fn(*rows2d, rest)`` on each device's rows of ``rows`` (see the module docstring).

  Args:
    fn: the product on 2-D rows: takes the ``rows`` arrays flattened to ``(M, D_i)`` positionally,
      then ``rest``, and returns a tuple of arrays. Outputs listed in ``summed`` are sums over all
      ``M`` rows (e.g. ``xᵀ dY``); every other output is ``(M, D_out)``.
    rows: arrays ``(*lead, D_i)`` with the same leading dims (``x`` and ``dY``).
    rest: a pytree of weight-side arrays (a sparse matrix, a mask), replicated on every device.
    summed: positions in ``fn``'s outputs that are reduced over the row shards.
    like: ``{output position: primal}`` for outputs that are cotangents (``dX``, ``dW``): under
      explicit axes they are resharded to the primal's sharding, as a custom VJP must return.

  Returns:
    ``fn``'s outputs, the row outputs reshaped to ``(*lead, D_out)`` and sharded like ``rows[0]``,
    the ``summed`` ones replicated.

  Under ``vmap``, mapped ``rows`` with unmapped ``rest`` and no ``summed`` output gain one leading
  dim (one partitioned call); any other mapping runs ``jax.vmap(fn)``, i.e. the backend's own batching rule:
  unpartitioned, or under explicit mesh axes in a ``shard_map`` where each device maps over its share of a split
  mapped axis (a stack of layers split over its layer axis) and of the rows (:func:`_mapped`). Differentiating the
  call (a gradient of a gradient) differentiates ``fn`` itself, unpartitioned.
  """
  rows = tuple(rows)
  leaves, treedef = jax.tree.flatten(rest)
  n_rows, summed = len(rows), frozenset(summed)

  def flat_fn(*args):
    lead = args[0].shape[:-1]
    # Not reshape(-1, d): that cannot infer the row count when d == 0 (an empty output, N = 0).
    rows2d = [a.reshape(math.prod(a.shape[:-1]), a.shape[-1]) for a in args[:n_rows]]
    outs = tuple(fn(*rows2d, jax.tree.unflatten(treedef, args[n_rows:])))
    return tuple(o if i in summed else o.reshape(*lead, o.shape[-1]) for i, o in enumerate(outs))

  def partitioned(*args):
    n_lead = args[0].ndim - 1
    unsharded = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    out_ndims = [o.ndim for o in jax.eval_shape(flat_fn, *unsharded)]
    explicit = _explicit_lead(args, n_lead)
    if explicit is not None:
      return _explicit_call(flat_fn, n_rows, summed, *explicit, args, out_ndims)
    if _utils.varying_axes(*args):  # inside shard_map(check_vma=True): each device has its rows already
      return flat_fn(*args)
    return _auto_partitioned(flat_fn, n_rows, n_lead, summed)(*args)

  @jax.custom_batching.custom_vmap
  def call(*args):
    return partitioned(*args)

  @call.def_vmap
  def _vmap_rule(axis_size, in_batched, *args):
    del axis_size
    if all(in_batched[:n_rows]) and not any(in_batched[n_rows:]) and not summed:
      outs = call(*args)  # the mapped axis is one more leading dim of the rows (split as the rows are)
    else:
      outs = _mapped(flat_fn, n_rows, summed, in_batched, args)
    return outs, (True,) * len(outs)

  # Higher-order derivatives (the JVP of a backward pass) differentiate the plain product: the
  # custom_partitioning primitive has no differentiation rule.
  differentiable = jax.custom_jvp(call)
  differentiable.defjvp(lambda primals, tangents: jax.jvp(flat_fn, primals, tangents))
  # Called eagerly, the custom_partitioning call ran fn unpartitioned: every device computed all rows, gathered onto
  # it (y came back replicated). Under jit its partition callback sees x's sharding.
  outs = (jax.jit(differentiable) if _eager_and_split(rows[0]) else differentiable)(*rows, *leaves)
  return tuple(_like(o, like[i]) if like and i in like else o for i, o in enumerate(outs))


def rows_and_replicated_weights(x: jax.Array, weights: Sequence[jax.Array]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """``x`` and ``weights`` resharded as :func:`row_parallel` lays them out under explicit axes, for products that
  run as plain XLA under autodiff (not through :func:`row_parallel`).

  Under explicit axes JAX refuses a ``dot_general`` whose operands' shardings clash (``x``'s rows and ``w``'s
  columns split over one mesh axis, or the contracted dim split differently); and an op whose backends run in a
  ``lax.platform_dependent`` needs every backend to give one output type. So, as :func:`row_parallel` does: the
  leading dims of ``x`` keep their usable split (see the module docstring), its feature dim and the weights are
  gathered. Resharding is differentiable: the cotangents come back split like ``x`` and the weights arrived.

  Args:
    x: ``(..., K)`` activations.
    weights: weight-side arrays (a dense weight, a mask).

  Returns:
    ``(x, weights)``, unchanged where neither ``x`` nor a weight is typed with explicit mesh axes.
  """
  weights = tuple(weights)
  explicit = _explicit_lead((x, *weights), x.ndim - 1)
  if explicit is None:
    return x, weights
  mesh, lead = explicit
  return _resharded(x, mesh, P(*lead, None)), tuple(_resharded(w, mesh, P()) for w in weights)


def _like(out: jax.Array, primal: jax.Array) -> jax.Array:
  mesh = _utils.explicit_mesh(primal)
  return out if mesh is None else _resharded(out, mesh, jax.typeof(primal).sharding.spec)
