"""Route the sparse layers of an inference model that are slower than dense to dense layers, by measurement.

Measured dispatch picks the fastest sparse kernel for each product, but a sparse layer holds no dense weight to fall
back to: a 2:4 or block-sparse projection of a few microseconds, or at 32 rows and more, can be slower than the dense
``nnx.Linear`` it replaced. :func:`route_slower_to_dense` times each distinct sparse layer against its dense twin
(:func:`jaxsparse.densify`: the same, pruned, weights) at the batch sizes a model serves, and swaps the slower ones.
The outputs do not change, only the kernels. Layers timed alone miss what only the whole model shows (XLA's dense
products run faster in a chain of kernels than alone); given a timer of the model's own step, it settles the
signatures whose layers alone were close to their twins by timing the step both ways.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import warnings
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsparse._rules import module_paths
from jaxsparse._rules import path_str
from jaxsparse._rules import replace_module
from jaxsparse._sparsify._linen import SparsifiedLinen
from jaxsparse._sparsify._linen_plan import dense_params
from jaxsparse._sparsify._linen_plan import densify_layers
from jaxsparse._sparsify._linen_plan import kept_blocks
from jaxsparse._sparsify._linen_plan import layer_variables
from jaxsparse._sparsify._linen_plan import linen_density
from jaxsparse._sparsify._linen_plan import sparse_module_of
from jaxsparse._sparsify._masks import nm_signature_density
from jaxsparse._sparsify._nnx import at_path
from jaxsparse._sparsify._nnx_convert import densify
from jaxsparse._sparsify._report import time_nnx_layer
from jaxsparse._sparsify._report import timed
from jaxsparse._tuning._cache import autotune_mode
from jaxsparse._tuning._measure import MARGIN
from jaxsparse._tuning._measure import SlowerThanDenseWarning
from jaxsparse.formats._specs import NM
from jaxsparse.formats._specs import BlockSparse
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import CompressedNMLinear
from jaxsparse.layers import MaskedLinear
from jaxsparse.layers import NMLinear
from jaxsparse.layers import SparseLinearGeneral
from jaxsparse.layers import linen as sparse_linen

__all__ = [
    "LayerSignature",
    "SignatureTiming",
    "layer_signature",
    "route_slower_to_dense",
    "route_slower_to_dense_linen",
    "time_forward_ms",
]

# The sparse linear layers this routes; each has a dense twin (``to_dense``).
SPARSE_LINEAR = (BlockSparseLinear, CompressedNMLinear, MaskedLinear, NMLinear)

# The NNX layer computing the product of each Linen sparse linear layer: a signature names the product, not the
# framework (the Linen and NNX twins run the same ops), so it is one for both and timings keyed by it carry over.
_NNX_TWIN = {sparse_linen.BlockSparseDense: BlockSparseLinear, sparse_linen.CompressedNMDense: CompressedNMLinear,
             sparse_linen.MaskedDense: MaskedLinear, sparse_linen.NMDense: NMLinear}


class LayerSignature(NamedTuple):
  """What sets a sparse layer's speed against its dense twin: :func:`route_slower_to_dense` times one layer per
  signature and routes all layers of it together.

  >>> import jaxsparse
  >>> from flax import nnx
  >>> layer = jaxsparse.layers.NMLinear(64, 32, n=2, m=4, rngs=nnx.Rngs(0))
  >>> str(jaxsparse.layer_signature(layer))
  'NMLinear 64x32 2:4 50% kept float32'

  Attributes:
    layer: the product's layer: the NNX class name, ``"CompressedNMLinear"``, ``"BlockSparseLinear"``, ... A Linen
      layer's signature takes its NNX twin's (``NMDense``: ``"NMLinear"``, ``CompressedNMDense``:
      ``"CompressedNMLinear"``, ``BlockSparseDense``: ``"BlockSparseLinear"``, ``MaskedDense``: ``"MaskedLinear"``):
      the twins compute the same product, so the same layer's signature, and timings keyed by it, are one for both.
    shape: ``(in_features, out_features)``.
    pattern: ``"2:4"``, ``"block 64x64"`` or ``"unstructured"``.
    density: fraction of the weights kept, to 2 decimals (a bucket: the block counts of one density differ by
      rounding only).
    dtype: the kernel's storage dtype.
    compute_dtype: the layer's ``dtype``, else the kernel's: the input's dtype when timed.
    bias: whether the layer adds a bias.
  """

  layer: str
  shape: tuple[int, int]
  pattern: str
  density: float
  dtype: str
  compute_dtype: str
  bias: bool

  def __str__(self) -> str:
    return _signature_text(self, self.layer)


def _signature_text(sig: LayerSignature, layer: str) -> str:
  """``sig`` in words, its layer named ``layer``: its own (``str(sig)``), or the Linen class a Linen layer's
  messages name (its signature names the NNX twin)."""
  return (f"{layer} {sig.shape[0]}x{sig.shape[1]} {sig.pattern} {sig.density:.0%} kept {sig.dtype}"
          + ("" if sig.compute_dtype == sig.dtype else f" (compute {sig.compute_dtype})"))


def layer_signature(layer: nnx.Module) -> LayerSignature:
  """The :class:`LayerSignature` of a sparse linear layer.

  >>> import jaxsparse
  >>> from flax import nnx
  >>> spec = jaxsparse.BlockSparse(density=0.5, block_shape=(32, 32))
  >>> sparse, _ = jaxsparse.sparsify(nnx.Linear(128, 64, rngs=nnx.Rngs(0)), spec)
  >>> jaxsparse.layer_signature(sparse).pattern, jaxsparse.layer_signature(sparse).density
  ('block 32x32', 0.5)

  Args:
    layer: a ``CompressedNMLinear``, ``NMLinear``, ``BlockSparseLinear`` or ``MaskedLinear``.

  Returns:
    Its signature: class, ``(in_features, out_features)``, pattern, density, dtypes and bias.

  Raises:
    TypeError: ``layer`` is not one of those four classes (e.g. an ``nnx.Linear``, or a ``SparseLinearGeneral``:
      pass the layer it wraps, ``.layer``).
    ValueError: a ``MaskedLinear`` whose mask holds no values (traced under ``nnx.jit`` / ``nnx.eval_shape``, or
      abstract: a ``jax.ShapeDtypeStruct``), whose density is unknown.
  """
  if isinstance(layer, CompressedNMLinear | NMLinear):  # the kept nonzero weights, as _linen_signature counts them
    kernel = None if layer.kernel is None else layer.kernel.get_value()
    pattern = f"{layer.n}:{layer.m}"
    density = nm_signature_density(kernel, layer.n, layer.m, compressed=isinstance(layer, CompressedNMLinear),
                                   transposable=getattr(layer, "transposable", False))
  elif isinstance(layer, BlockSparseLinear):
    pattern, density = f"block {layer.block_shape[0]}x{layer.block_shape[1]}", layer.density
  elif isinstance(layer, MaskedLinear):
    pattern, density = "unstructured", layer.density  # None where the mask holds no values
  else:
    raise TypeError(f"layer must be one of {[c.__name__ for c in SPARSE_LINEAR]}, got {type(layer).__name__}.")
  if density is None:
    raise ValueError(_unknown_density(type(layer).__name__, "nnx.jit / nnx.eval_shape", "model"))
  dtype = layer.kernel_dtype if isinstance(layer, CompressedNMLinear) else jnp.dtype(layer.kernel.dtype)
  return LayerSignature(type(layer).__name__, (layer.in_features, layer.out_features), pattern, round(density, 2),
                        dtype.name, jnp.dtype(layer.dtype or dtype).name, layer.bias is not None)


def _unknown_density(layer: str, traces: str, what: str) -> str:
  return (f"the {layer}'s mask holds no values (traced under {traces}, or abstract: a jax.ShapeDtypeStruct), so its "
          "density, part of its LayerSignature, is unknown. Signatures and routing (timing each layer) need a "
          f"concrete mask: call this outside any trace, on the concrete {what} (e.g. restored from a checkpoint).")


@dataclasses.dataclass(frozen=True)
class SignatureTiming:
  """One signature's forward times, sparse layer and dense twin, and whether its layers were routed to dense.

  >>> import jaxsparse
  >>> sig = jaxsparse.LayerSignature("CompressedNMLinear", (4096, 4096), "2:4", 0.5, "bfloat16", "bfloat16", False)
  >>> t = jaxsparse.SignatureTiming(sig, ("layers.0",), {1: 0.011, 32: 0.02}, {1: 0.012, 32: 0.016}, dense=True)
  >>> round(t.ratio, 2)
  1.25

  Attributes:
    signature: the :class:`LayerSignature`.
    paths: the dotted paths of the model's layers of that signature (a tied layer at each of its paths; a
      ``SparseLinearGeneral``'s, not its wrapped layer's).
    sparse_ms: ``{batch: ms}`` of the sparse layer's jitted forward on a ``(batch, in_features)`` input.
    dense_ms: ``{batch: ms}`` of the dense ``nnx.Linear`` holding the same (pruned) weights.
    dense: whether the layers of ``paths`` now are that ``nnx.Linear`` (a ``SparseLinearGeneral`` its
      ``nnx.LinearGeneral``).
    step_ms: with :func:`route_slower_to_dense`'s ``step_timer``, for a signature it settled by timing the model's
      step: ``{"sparse": ms, "dense": ms}``, the step with this signature's layers sparse and dense (the others as
      routed when it was timed); else ``None``.
  """

  signature: LayerSignature
  paths: tuple[str, ...]
  sparse_ms: Mapping[int, float]
  dense_ms: Mapping[int, float]
  dense: bool
  step_ms: Mapping[str, float] | None = None

  @property
  def ratio(self) -> float:
    """The largest sparse / dense time over the batch sizes (> 1: the sparse layer is slower somewhere)."""
    return max(self.sparse_ms[b] / self.dense_ms[b] for b in self.sparse_ms)


@contextlib.contextmanager
def _tuned():
  """Tuning mode, without the SlowerThanDenseWarning that routing to dense is the answer to."""
  with autotune_mode("tune"), warnings.catch_warnings():
    warnings.simplefilter("ignore", SlowerThanDenseWarning)
    yield


def time_forward_ms(layer: nnx.Module, x: jax.Array) -> float:
  """Milliseconds of one jitted forward call ``layer(x)`` on the default device.

  Traced and compiled under ``jaxsparse.autotune_mode("tune")``, so each sparse product runs on the kernel the
  measured dispatch picks for it; then timed as the tuner times its candidates: device time from CUPTI on a CUDA
  GPU, else the median wall time of back-to-back calls. On a GPU, a layer whose weights would stay in the L2 cache
  is timed over copies of them in turn, as in a model, where the other layers evict them between calls.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxsparse._sparsify._route import time_forward_ms
  >>> time_forward_ms(nnx.Linear(16, 16, rngs=nnx.Rngs(0)), jnp.ones((2, 16))) > 0
  True

  Args:
    layer: an ``nnx.Module`` taking one array.
    x: its input.

  Returns:
    Milliseconds of one call.
  """
  with _tuned():
    return time_nnx_layer(layer, x, "forward")


def route_slower_to_dense(
    model: nnx.Module,
    batches: int | Sequence[int],
    *,
    timer: Callable[[nnx.Module, jax.Array], float] | None = None,
    margin: float = MARGIN,
    step_timer: Callable[[nnx.Module], float] | None = None,
    step_band: float = 0.15,
) -> tuple[SignatureTiming, ...]:
  """Replaces, in place, the sparse linear layers that are slower than their dense twin by dense ``nnx.Linear``.

  For each distinct :class:`LayerSignature` among the model's ``CompressedNMLinear`` / ``NMLinear`` /
  ``BlockSparseLinear`` / ``MaskedLinear`` layers, one of its layers and its dense twin (``to_dense()``: the same,
  pruned, weights) are timed on the default device on a random ``(batch, in_features)`` input at every batch size
  (:func:`~jaxsparse._sparsify._route.time_forward_ms`: the sparse product tuned first, device time on a GPU). If the
  sparse time exceeds the dense time by more than ``margin`` at any of them, every layer of that signature becomes
  its dense twin (:func:`jaxsparse.densify`). The outputs do not change, only the kernels.

  For inference: a dense twin holds the dense kernel's bytes. The layers are timed alone, so a difference only the
  whole model shows (fusion with neighbouring ops) is not seen; a layer slower at batch 32 runs dense at batch 1 too
  (pass the batch sizes you serve). A ``SparseLinearGeneral`` (e.g. an attention projection) is timed by the 2-D
  layer it wraps and, routed, becomes its dense ``nnx.LinearGeneral``. A layer held at several paths (tied) is
  routed at all of them and stays tied. The other jaxsparse layers (convolutions, embeddings) stay as they are.
  Every layer is timed before any is replaced: a ``timer`` that fails leaves the model as it was.

  With ``step_timer`` (the time of the model's own step, e.g. a jitted decode step at the batch it serves), the
  signatures whose layers alone were within ``step_band`` of their twins are settled by the whole step instead,
  closest first: the step is timed with that signature's layers sparse and dense, the others as routed so far, and
  they stay sparse unless the step is slower by more than ``margin`` that way. Signatures kept sparse that way cost at
  most ``margin`` each, but more together: when the step is slower by more than ``margin`` than with all of them
  dense, they go dense one at a time, the costliest first, until it is not. In a decode step XLA's dense products
  run faster than alone, next to their neighbours, which a layer timed alone does not show. One step timing per
  settled signature, plus one, plus (with two or more kept sparse) one and one per signature routed by that check.

  >>> import jax.numpy as jnp, jaxsparse
  >>> from flax import nnx
  >>> model = nnx.Sequential(nnx.Linear(64, 64, rngs=nnx.Rngs(0)), nnx.Linear(64, 64, rngs=nnx.Rngs(1)))
  >>> sparse, _ = jaxsparse.sparsify(model, jaxsparse.Unstructured(sparsity=0.5))
  >>> timer = lambda layer, x: 2.0 if isinstance(layer, jaxsparse.layers.MaskedLinear) else 1.0  # measured: pass None
  >>> timings = jaxsparse.route_slower_to_dense(sparse, (1, 8), timer=timer)
  >>> [type(layer).__name__ for layer in sparse.layers], timings[0].dense, timings[0].paths
  (['Linear', 'Linear'], True, ('layers.0', 'layers.1'))

  Args:
    model: an ``nnx.Module`` holding sparse linear layers; changed in place.
    batches: the batch size(s) the model serves (a positive int or a sequence of them), the rows of the timed inputs.
    timer: ``(layer, x) -> ms`` of one forward call, a positive finite number; ``None``: measured on the default
      device. Tests inject their own.
    margin: a sparse layer stays unless it is slower by more than this fraction (measured dispatch's, 3%).
    step_timer: ``(model) -> ms`` of the model's step as it is at the call (the layers swapped in place between
      calls); ``None`` decides by the layers alone.
    step_band: with ``step_timer``, the signatures whose sparse / dense ratio alone lies in
      ``[1 - step_band, 1 + step_band]`` are settled by the step.

  Returns:
    One :class:`SignatureTiming` per signature, in the order the layers occur.

  Raises:
    TypeError: ``model`` is not an ``nnx.Module``, or is itself a sparse linear layer or ``SparseLinearGeneral``
      (it cannot be replaced in place); ``step_timer`` is neither ``None`` nor callable.
    ValueError: ``batches`` is not a positive int or a non-empty sequence of them; ``margin`` or ``step_band`` is
      not in [0, 1); ``timer`` or ``step_timer`` returns something other than a positive finite number (a bad
      ``timer`` leaves the model as it was; a bad ``step_timer`` leaves it routed by the layers alone).
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}.")
  batches = _check_route_args(batches, margin, step_timer, step_band)
  if isinstance(model, (*SPARSE_LINEAR, SparseLinearGeneral)):
    raise TypeError(f"model is itself a {type(model).__name__}, which cannot be replaced in place: pass a model that "
                    "holds it (or compare it with its to_dense() yourself).")
  timer = timer or time_forward_ms
  groups = _nnx_groups(model)
  all_paths = module_paths(model)
  dense_ms: dict[tuple[Any, ...], float] = {}  # dense twins of equal shape and dtype time once
  timings = []
  for sig, members in groups.items():  # every signature timed before any layer is replaced
    swapped = members[0][1]
    layer = swapped.layer if isinstance(swapped, SparseLinearGeneral) else swapped
    twin = densify(layer, inplace=True)  # a sparse layer itself is left as it is
    sparse = {}
    for b in batches:
      x = jax.random.normal(jax.random.key(b), (b, sig.shape[0]), sig.compute_dtype)
      sparse[b] = _check_ms(timer(layer, x), "timer", f"the time of the {sig} layer at batch {b}")
      key = (sig.shape, sig.dtype, sig.compute_dtype, sig.bias, b)
      if key not in dense_ms:
        dense_ms[key] = _check_ms(timer(twin, x), "timer",
                                  f"the time of the dense twin of the {sig} layer at batch {b}")
    paths = tuple(path_str(p) for path, node in members for p in all_paths.get(id(node)) or [path])
    timing = SignatureTiming(sig, paths, sparse,
                             {b: dense_ms[(sig.shape, sig.dtype, sig.compute_dtype, sig.bias, b)] for b in batches},
                             dense=False)
    timings.append(dataclasses.replace(timing, dense=True) if timing.ratio > 1 + margin else timing)
  for timing, members in zip(timings, groups.values(), strict=True):
    if timing.dense:
      _route_members(model, members, dense=True)
  if step_timer is not None:
    members = [groups[t.signature] for t in timings]
    state = {"dense": frozenset(i for i, t in enumerate(timings) if t.dense)}

    def route_as(dense: frozenset[int]) -> None:  # swaps only the signatures that change
      for i in state["dense"] ^ dense:
        _route_members(model, members[i], dense=i in dense)
      state["dense"] = dense

    def time_with(dense: frozenset[int]) -> float:
      route_as(dense)
      return step_timer(model)

    before = state["dense"]
    try:
      timings, dense = _settle_by_step(timings, time_with, margin, step_band)
    except BaseException:
      route_as(before)  # a step timer that fails leaves the model routed by the layers alone
      raise
    route_as(dense)
  return tuple(timings)


def _nnx_groups(model: nnx.Module) -> dict[LayerSignature, list[tuple[tuple[Any, ...], nnx.Module]]]:
  """``{signature: [(path, layer)]}`` of the sparse linear layers of ``model``, in the order they occur; the layer
  to swap is a ``SparseLinearGeneral`` where one wraps the sparse layer, the signature its wrapped layer's."""
  modules = {tuple(path): node for path, node in nnx.iter_modules(model)}
  groups: dict[LayerSignature, list[tuple[tuple[Any, ...], nnx.Module]]] = {}
  for path, node in modules.items():
    if not path or not isinstance(node, SPARSE_LINEAR):
      continue
    parent = modules.get(path[:-1])
    sig = at_path(path_str(path), layer_signature, node)  # an error names the layer
    if isinstance(parent, SparseLinearGeneral) and parent.layer is node:
      groups.setdefault(sig, []).append((path[:-1], parent))
    else:
      groups.setdefault(sig, []).append((path, node))
  return groups


def _check_ms(value: Any, name: str, what: str) -> float:
  """``value``, what the callable ``name`` returned as ``what`` in milliseconds, as a positive finite float."""
  ms = None
  if not isinstance(value, bool | np.bool_ | str | bytes) and np.ndim(value) == 0:
    try:
      ms = float(value)
    except (TypeError, ValueError):
      pass
  if ms is None or not math.isfinite(ms) or ms <= 0:
    raise ValueError(f"{name} returned {value!r}; it must return {what} in milliseconds, a positive finite number.")
  return ms


def _route_members(model: nnx.Module, members: list, *, dense: bool) -> None:
  """Puts the layers of ``members`` (``(path, sparse layer or SparseLinearGeneral)``) into ``model`` as their dense
  twins or as they were."""
  for path, node in members:
    replace_module(model, path, densify(node, inplace=True) if dense else node)  # a twin, no copy of the model


def _settle_by_step(timings: list[SignatureTiming], time_with: Callable[[frozenset[int]], float], margin: float,
                    band: float) -> tuple[list[SignatureTiming], frozenset[int]]:
  """The ``step_timer`` pass over the signatures within ``band`` of their twins, closest first.

  ``time_with(dense)`` times the model's step with the signatures of indices ``dense`` dense and the others sparse.
  Returns the timings (``dense`` and ``step_ms`` of the settled ones set) and the indices now dense."""
  dense = frozenset(i for i, t in enumerate(timings) if t.dense)
  near = sorted((i for i, t in enumerate(timings) if 1 - band <= t.ratio <= 1 + band),
                key=lambda i: abs(timings[i].ratio - 1))
  if not near:
    return timings, dense

  def ms(routed: frozenset[int]) -> float:
    return _check_ms(time_with(routed), "step_timer", "the step's time")

  current = ms(dense)
  for i in near:
    flipped = ms(dense ^ {i})
    step = {"dense": current, "sparse": flipped} if i in dense else {"sparse": current, "dense": flipped}
    goes_dense = step["sparse"] > step["dense"] * (1 + margin)
    dense = dense | {i} if goes_dense else dense - {i}
    current = step["dense"] if goes_dense else step["sparse"]
    timings[i] = dataclasses.replace(timings[i], dense=goes_dense, step_ms=step)
  # Each signature kept sparse cost at most the margin alone; together they may cost more. Against the step with all
  # of them dense, they go dense one at a time, the costliest first, until the step is within the margin of it.
  kept = [i for i in near if i not in dense]
  if len(kept) > 1:
    floor = ms(dense | set(kept))
    gain = lambda i: timings[i].step_ms["dense"] / timings[i].step_ms["sparse"]
    for i in sorted(kept, key=gain):
      if current <= floor * (1 + margin):
        break
      dense = dense | {i}
      current = ms(dense)
      timings[i] = dataclasses.replace(timings[i], dense=True)
  return timings, dense


def _check_route_args(batches: int | Sequence[int], margin: float, step_timer: Any, step_band: float
                      ) -> tuple[int, ...]:
  is_int = lambda b: isinstance(b, numbers.Integral) and not isinstance(b, bool | np.bool_)
  if is_int(batches):
    batches = (batches,)
  elif not isinstance(batches, str | bytes):
    try:
      batches = tuple(batches)
    except TypeError:
      pass  # not iterable: named below
  if not isinstance(batches, tuple) or not batches or not all(is_int(b) and b > 0 for b in batches):
    raise ValueError(f"batches must be positive ints, got {batches!r}; e.g. the decode batch sizes (1, 8, 32).")
  batches = tuple(int(b) for b in batches)
  if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not 0 <= margin < 1:
    raise ValueError(f"margin must be a fraction in [0, 1), got margin={margin!r}.")
  if step_timer is not None and not callable(step_timer):
    raise TypeError(f"step_timer must be a callable returning milliseconds, or None; got {type(step_timer).__name__}.")
  if isinstance(step_band, bool) or not isinstance(step_band, numbers.Real) or not 0 <= step_band < 1:
    raise ValueError(f"step_band must be a fraction in [0, 1), got step_band={step_band!r}.")
  return batches


def _linen_signature(layer, layer_vars: Mapping, path: str) -> LayerSignature:
  """The :class:`LayerSignature` of a Linen sparse layer (a ``SparsifiedLinen`` plan and its unboxed variables) at
  ``path``; raises where its density is unknown (a traced or abstract mask)."""
  spec = layer.spec
  if isinstance(spec, BlockSparse):
    pattern = f"block {spec.block_shape[0]}x{spec.block_shape[1]}"
  else:
    pattern = f"{spec.n}:{spec.m}" if isinstance(spec, NM) else "unstructured"
  module_type = type(sparse_module_of(layer, nnz=kept_blocks(layer_vars, spec)))
  name = module_type.__name__
  if isinstance(spec, NM):  # one rule with layer_signature: the kept nonzero weights, dense kernel or compressed
    density = nm_signature_density(layer_vars["params"]["kernel"], spec.n, spec.m, compressed=layer.compressed,
                                   transposable=spec.transposable)
  else:
    density = linen_density(spec, layer_vars, layer.shape_2d)
  if density is None:
    raise ValueError(f"{path}: " + _unknown_density(name, "jax.jit / jax.eval_shape", "variables"))
  dtype = jnp.dtype(layer_vars["params"]["kernel"].dtype)
  return LayerSignature(_NNX_TWIN[module_type].__name__, layer.shape_2d, pattern, round(density, 2), dtype.name,
                        jnp.dtype(layer.module.dtype or dtype).name, bool(layer.module.use_bias))


def _time_apply_ms(module: nn.Module, variables: Any, x: jax.Array) -> float:
  with _tuned():
    return timed(lambda v, _, x: module.apply(v, x), variables, x, "forward")


def route_slower_to_dense_linen(
    sparse: SparsifiedLinen,
    variables: Mapping,
    batches: int | Sequence[int],
    *,
    timer: Callable[[nn.Module, Any, jax.Array], float] | None = None,
    margin: float = MARGIN,
    step_timer: Callable[[SparsifiedLinen, dict], float] | None = None,
    step_band: float = 0.15,
) -> tuple[SparsifiedLinen, dict, tuple[SignatureTiming, ...]]:
  """:func:`route_slower_to_dense` for Linen: the sparse ``nn.Dense`` / ``nn.DenseGeneral`` layers of a
  :func:`~jaxsparse.sparsify_linen` model that are slower than their dense twin run dense again.

  Each distinct :class:`LayerSignature` (``BlockSparseDense``, ``NMDense``, ``CompressedNMDense`` or ``MaskedDense``,
  named as their NNX twins, shape, pattern, density, dtypes, bias) is timed on one of its layers, alone, against the
  original layer with the same pruned weights, on a random ``(batch, *in_dims)`` input at every batch size. Every
  layer of a signature slower by more than ``margin`` at any of them is taken out of the sparse plan and given its
  dense variables (as :func:`~jaxsparse.densify_linen` does for all). The outputs do not change, only the kernels.
  Sparse convolutions, embeddings (``CompressedNMEmbed``) and stacks of layers (``nn.scan`` / ``nn.vmap`` over
  layers) stay as they are. ``step_timer`` settles the signatures near their twins by the model's step, as in
  :func:`route_slower_to_dense`.

  >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxsparse
  >>> model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(64)])
  >>> x = jnp.ones((2, 64))
  >>> variables = model.init(jax.random.key(0), x)
  >>> sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, jaxsparse.Unstructured(sparsity=0.5), x)
  >>> timer = lambda module, v, x: 2.0 if type(module) is nn.Dense else 1.0  # measured: pass None; sparse faster
  >>> sparse2, vars2, timings = jaxsparse.route_slower_to_dense_linen(sparse, sparse_vars, 8, timer=timer)
  >>> len(sparse2.layers), timings[0].dense, bool(jnp.allclose(sparse2.apply(vars2, x), sparse.apply(sparse_vars, x)))
  (2, False, True)

  Args:
    sparse: the ``SparsifiedLinen`` that :func:`~jaxsparse.sparsify_linen` returned.
    variables: its variables; not modified.
    batches: the batch size(s) the model serves (a positive int or a sequence of them), the leading dim of the timed
      inputs.
    timer: ``(module, variables, x) -> ms`` of one call ``module.apply(variables, x)`` (a positive finite number):
      the sparse layer (``BlockSparseDense``, ``NMDense``, ``MaskedDense``, on ``x`` flattened to ``(batch, K)``) and
      the original ``nn.Dense`` / ``nn.DenseGeneral``; ``None``: measured on the default device (device time on a
      GPU, the sparse products tuned first). Tests inject their own.
    margin: a sparse layer stays unless it is slower by more than this fraction (measured dispatch's, 3%).
    step_timer: ``(model, variables) -> ms`` of the model's step, given a ``SparsifiedLinen`` and its variables with
      some signatures routed; ``None`` decides by the layers alone.
    step_band: with ``step_timer``, the signatures whose sparse / dense ratio alone lies in
      ``[1 - step_band, 1 + step_band]`` are settled by the step.

  Returns:
    ``(sparse, variables, timings)``: a ``SparsifiedLinen`` without the routed layers, new variables with their
    dense parameters, and one :class:`SignatureTiming` per signature (``paths`` dotted Linen module paths).

  Raises:
    TypeError: ``sparse`` is not a ``SparsifiedLinen``; ``step_timer`` is neither ``None`` nor callable.
    ValueError: ``batches`` is not a positive int or a non-empty sequence of them; ``margin`` or ``step_band`` is
      not in [0, 1); ``timer`` or ``step_timer`` returns something other than a positive finite number; the
      variables of a compressed N:M layer lack their ``"sparsity"`` collection.
    KeyError: ``variables`` lack the parameters of a layer of ``sparse``.
  """
  if not isinstance(sparse, SparsifiedLinen):
    raise TypeError(f"sparse must be the SparsifiedLinen that sparsify_linen returned, got {type(sparse).__name__}.")
  batches = _check_route_args(batches, margin, step_timer, step_band)
  timer = timer or _time_apply_ms
  groups: dict[LayerSignature, list[tuple]] = {}
  for path, layer in sparse.layers.items():
    # Convs' and embeddings' products are not a dense layer's, a stack's layers run inside the model's nn.scan /
    # nn.vmap (not timed, as in sparsify_linen's check_speed): they stay as they are.
    if layer.kind not in ("conv", "embed") and not layer.stack:
      sig = _linen_signature(layer, nn.meta.unbox(layer_variables(variables, path)), ".".join(path))
      groups.setdefault(sig, []).append(path)
  timings = []
  for sig, paths in groups.items():
    layer = sparse.layers[paths[0]]
    layer_vars = nn.meta.unbox(layer_variables(variables, paths[0]))
    dense_vars = {"params": nn.meta.unbox(dense_params(layer, layer_vars))}
    module = sparse_module_of(layer, nnz=kept_blocks(layer_vars, layer.spec))
    what = _signature_text(sig, type(module).__name__)  # the Linen layer the user has, not its NNX twin
    sparse_ms, dense_ms = {}, {}
    for b in batches:
      x = jax.random.normal(jax.random.key(b), (b, *layer.in_dims), sig.compute_dtype)
      sparse_ms[b] = _check_ms(timer(module, layer_vars, x.reshape(b, sig.shape[0])), "timer",
                               f"the time of the {what} layer at batch {b}")
      dense_ms[b] = _check_ms(timer(layer.module, dense_vars, x), "timer",
                              f"the time of the dense twin of the {what} layer at batch {b}")
    timing = SignatureTiming(sig, tuple(".".join(p) for p in paths), sparse_ms, dense_ms, dense=False)
    timings.append(dataclasses.replace(timing, dense=True) if timing.ratio > 1 + margin else timing)
  members = list(groups.values())

  def routed_as(dense: frozenset[int]) -> tuple[SparsifiedLinen, dict]:
    routed = {p: sparse.layers[p] for i in dense for p in members[i]}
    kept = {p: layer for p, layer in sparse.layers.items() if p not in routed}
    dense_layers = {**sparse.dense_layers, **{p: layer.module for p, layer in routed.items()}}
    return SparsifiedLinen(sparse.module, kept, dense_layers), densify_layers(variables, routed)

  dense = frozenset(i for i, t in enumerate(timings) if t.dense)
  if step_timer is not None:
    timings, dense = _settle_by_step(timings, lambda d: step_timer(*routed_as(d)), margin, step_band)
  return (*routed_as(dense), tuple(timings))
