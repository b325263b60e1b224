"""Mosaic GPU building blocks the block-sparse kernels share (:mod:`._block_sparse_matmul_mgpu`,
:mod:`._block_sparse_sdd_mgpu`): the persistent grid's size and launch, the dynamic schedule's tile counter, TMA's
row rule, shared-memory layouts and interpret-mode parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import config as jax_config
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith
from jaxlib.mlir.dialects import llvm
from jaxlib.mlir.dialects import memref

from jaxsparse.pallas._common import pad_rows

__all__ = [
    "interpret_params",
    "launch",
    "num_sms",
    "publish_position",
    "request_position",
    "smem_transforms",
    "tma_rows",
    "transposed",
]

_DEFAULT_NUM_SMS = 132


def num_sms() -> int:
  """Streaming multiprocessors of the first device: the persistent grid's thread blocks (132 where unknown)."""
  try:
    return int(jax.devices()[0].core_count)
  except (AttributeError, RuntimeError, TypeError, ValueError):
    return _DEFAULT_NUM_SMS


def interpret_params(uninitialized: str = "nan"):
  """Mosaic GPU interpret-mode parameters (public from jax 0.11; private in 0.10).

  The kernels load the last row tile of an activation whose rows are not a multiple of the tile past
  its end (:func:`tma_rows`; TMA fills zeros on the GPU). The interpreter returns ``uninitialized``
  values there, as for uninitialized memory: NaN for the forward / ``dX`` kernel, whose rows past ``M``
  are dropped (a NaN reaching a kept row fails the tests), zeros for the ``dW`` kernel, which sums over
  the rows as TMA's zero fill lets it.
  """
  if hasattr(plgpu, "InterpretGPUParams"):
    cls = plgpu.InterpretGPUParams
  else:
    from jax._src.pallas.mosaic_gpu.interpret import params  # noqa: PLC0415 -- jax 0.10 has no public name

    cls = params.InterpretGPUParams
  return cls(out_of_bounds_reads="uninitialized", uninitialized_memory=uninitialized)


def tma_rows(*arrays: jax.Array, tile_m: int) -> tuple[jax.Array, ...]:
  """``arrays`` (of one row count ``M``) as the kernels' TMA loads of ``tile_m``-row tiles can read them.

  Where ``M`` is not a multiple of ``tile_m`` the last row tile reads past row ``M`` and TMA fills those
  rows with zeros: no padded copy, a full pass over the activations (at ``M = 3000`` padding a float32
  ``dY`` of 8192 columns took 47 µs, 40% of the ``dX`` kernel's time). Mosaic GPU needs the rows a
  multiple of its 8-row shared-memory tiling and at least one tile (a TMA box may not exceed the
  array): otherwise the arrays are padded with zero rows to a multiple of ``tile_m``.
  """
  m = arrays[0].shape[0]
  if m >= tile_m and m % 8 == 0:
    return arrays
  return tuple(pad_rows(a, tile_m) for a in arrays)


def transposed(ref):
  """A 2-D shared-memory ref viewed transposed (the API moved in jax 0.11)."""
  if jax.__version_info__ >= (0, 11):
    return ref.transpose((1, 0))
  return plgpu.transpose_ref(ref, (1, 0))


def smem_transforms(minor: int, dtype) -> tuple:
  """The shared-memory tiling and swizzle of a tile ``minor`` elements wide (one 128-byte swizzle row at most)."""
  swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
  return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def launch(static_kernel, operands, out_type, num_ctas: int, params, *, num_threads: int, dynamic_kernel=None):
  """Runs a persistent Mosaic GPU kernel on ``operands``: ``num_ctas`` thread blocks (axis ``"cta"``) of
  ``num_threads`` warpgroups (axis ``"wg"``), warpgroup lowering semantics.

  ``static_kernel`` deals the tiles itself. ``dynamic_kernel`` (optional) takes them from a counter
  (:func:`request_position`): it is called with one more ``Ref`` before the output, a fresh zero tile counter
  aliased in and out of the kernel (inside ``pl.run_state``), so that every call starts from a zero of its own that
  the kernel may add to. ``plgpu.kernel``'s batching wrapper takes no ``Ref`` operand, so that kernel goes through
  ``pl.kernel`` on a Mosaic GPU mesh, traced as ``plgpu.kernel`` traces it (``check_vma`` off), under a batching
  rule of its own that runs ``static_kernel`` (``plgpu.kernel``'s rule: a grid row per batch element). Mosaic GPU's
  interpreter takes no aliased ``Ref`` (jax 0.10) and the interpreted kernel no counter (:func:`request_position`):
  there ``dynamic_kernel`` runs without one.

  Args:
    static_kernel: the kernel body, ``static_kernel(*in_refs, out_ref)``.
    operands: the input arrays.
    out_type: the output's ``jax.ShapeDtypeStruct``.
    num_ctas: thread blocks of the grid.
    params: more keyword arguments of ``plgpu.kernel`` / ``pl.kernel`` (``interpret``).
    num_threads: warpgroups a thread block.
    dynamic_kernel: the kernel that takes its tiles from the counter, ``dynamic_kernel(*in_refs, counter_ref,
      out_ref)`` (``dynamic_kernel(*in_refs, out_ref)`` in interpret mode), or ``None``.

  Returns:
    The output array.
  """
  compiler_params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)

  def static(*ops):
    return plgpu.kernel(
        static_kernel,
        out_type=out_type,
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=num_threads,
        thread_name="wg",
        compiler_params=compiler_params,
        **params,
    )(*ops)

  if dynamic_kernel is None:
    return static(*operands)

  @jax.custom_batching.custom_vmap
  def dynamic(*ops):
    mesh = plgpu.Mesh(grid=(num_ctas,), grid_names=("cta",), num_threads=num_threads, thread_name="wg")
    run = pl.kernel(dynamic_kernel, out_type=out_type, mesh=mesh, compiler_params=compiler_params, **params)
    if "interpret" in params:
      return run(*ops)

    def stateful(refs):
      counter_ref, out_ref = refs
      with jax_config._check_vma(False):  # as plgpu.kernel does (no public switch)
        out_ref[...] = run(*ops, counter_ref)

    # The counter's effects end inside run_state (custom_vmap's body may have none); the output's initial value
    # is overwritten whole, so XLA drops it.
    _, out = pl.run_state(stateful)((jnp.zeros((1,), jnp.int32), jnp.zeros(out_type.shape, out_type.dtype)))
    return out

  @dynamic.def_vmap
  def _(axis_size, in_batched, *ops):
    del axis_size
    return jax.vmap(static, in_axes=[0 if b else None for b in in_batched])(*ops), True

  return dynamic(*operands)


def request_position(counter_ref, n, cta, num_ctas: int, *, interpret: bool):
  """Asks the dynamic schedule's counter for a tile position; :func:`publish_position` makes it known.

  On the GPU one thread of the memory warpgroup adds 1 to ``counter_ref`` (an atomic add: the thread blocks take
  positions ``0, 1, 2, ...`` in the order they ask, so a thread block whose tiles ran short takes more of them).
  The add is only issued here: the thread waits for its result where :func:`publish_position` stores it, a tile's
  copies later, so that its latency hides behind them. The value is that thread's alone (the other threads hold
  nothing). Mosaic GPU's interpreter runs no inline code: there the ``n``-th request of thread block ``cta`` is the
  static schedule's ``n * num_ctas + cta``.

  Returns:
    An int32 scalar for :func:`publish_position`.
  """
  if interpret:
    return n * num_ctas + cta

  @plgpu.inline_mgpu(
      arg_types=(plgpu.RefType(),), return_type=plgpu.ShapeDtypeStruct((), jnp.int32, plgpu.Layout.WG_SPLAT)
  )
  def request(ctx, counter):
    del ctx
    got = llvm.inline_asm(
        ir.IntegerType.get_signless(32),
        [_one_thread(), mgpu_utils.memref_ptr(counter)],
        "{ .reg .pred p; setp.ne.b32 p, $1, 0; mov.u32 $0, 0; @p atom.global.add.u32 $0, [$2], 1; }",
        "=r,r,l",
        has_side_effects=True,
    )
    return mgpu.FragmentedArray.splat(got, (), is_signed=True)

  return request(counter_ref)


def publish_position(requested, positions, slot, *, interpret: bool):
  """Stores a position :func:`request_position` got in ``positions[slot]``; returns it to the whole warpgroup.

  Returns:
    The position (int32 scalar, the same in every thread): a tile's index in the kernel's ``order`` while below
    the tile count.
  """
  if interpret:
    positions[slot] = requested
    return requested

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WG_SPLAT, plgpu.RefType(), plgpu.Layout.WG_SPLAT),
      return_type=plgpu.ShapeDtypeStruct((), jnp.int32, plgpu.Layout.WG_SPLAT),
  )
  def publish(ctx, got, ring, slot):
    del ctx
    index = arith.index_cast(ir.IndexType.get(), slot.registers.item())
    dst = llvm.ptrtoint(ir.IntegerType.get_signless(64), mgpu_utils.memref_ptr(mgpu_utils.memref_slice(ring, index)))
    llvm.inline_asm(
        ir.Type.parse("!llvm.void"),
        [_one_thread(), got.registers.item(), dst],
        "{ .reg .pred p; setp.ne.b32 p, $0, 0; @p st.shared.u32 [$2], $1; }",
        "r,r,l",
        has_side_effects=True,
    )
    mgpu_utils.warpgroup_barrier()
    return mgpu.FragmentedArray.splat(memref.load(ring, [index]), (), is_signed=True)

  return publish(requested, positions, slot)


def _one_thread():
  """1 (int32) in the one thread of the warpgroup that requests and publishes positions, 0 in the others."""
  pred = mgpu_utils.single_thread_predicate(mgpu_utils.ThreadSubset.WARPGROUP)
  return arith.extui(ir.IntegerType.get_signless(32), pred)
