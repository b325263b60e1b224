"""``sparsify`` / ``densify``: turn the dense layers of an existing Flax model into sparse ones and back.

NNX: every ``nnx.Linear``, ``nnx.Conv`` and ``nnx.LinearGeneral`` (trailing contracting axes, as in
``nnx.MultiHeadAttention``) whose dotted path matches a rule is replaced by the sparse layer the
rule names, initialised from its dense weights by magnitude (or from given masks):

============================  ===========================  ======================  ==========================
rule                          ``nnx.Linear``               ``nnx.Conv``            ``nnx.LinearGeneral``
============================  ===========================  ======================  ==========================
``BlockSparse(density, bs)``  ``BlockSparseLinear``        error                   ``SparseLinearGeneral``
``NM(n, m)``                  ``NMLinear`` (SR-STE)        ``NMConv`` (SR-STE)     ``SparseLinearGeneral``
``Unstructured(sparsity)``    ``MaskedLinear``             ``MaskedConv``          ``SparseLinearGeneral``
============================  ===========================  ======================  ==========================

Linen: :func:`sparsify_linen` rewrites the variables (sparse parameters, patterns in the
``"sparsity"`` collection) and returns a :class:`SparsifiedLinen` whose ``apply`` runs the user's
unchanged module with its ``nn.Dense`` / ``nn.Conv`` calls redirected (``nn.intercept_methods``) to
the Linen sparse layers.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import time
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsparse._rules import masks_to_dict
from jaxsparse._rules import match_rules
from jaxsparse._rules import path_str
from jaxsparse._rules import resolve_rules
from jaxsparse._rules import warn_unmatched
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._masks import block_magnitude_mask
from jaxsparse.formats._masks import magnitude_mask
from jaxsparse.formats._nm import nm_mask
from jaxsparse.formats._specs import NM
from jaxsparse.formats._specs import BlockSparse
from jaxsparse.formats._specs import Spec
from jaxsparse.formats._specs import Unstructured
from jaxsparse.formats._specs import check_spec_applies
from jaxsparse.layers import BlockSparseLinear
from jaxsparse.layers import CompressedNMLinear
from jaxsparse.layers import MaskedLinear
from jaxsparse.layers import NMConv
from jaxsparse.layers import NMLinear
from jaxsparse.layers import SparsityPattern
from jaxsparse.layers import linen as sparse_linen
from jaxsparse.layers._nm import conv_options
from jaxsparse.ops._masked_matmul import check_mask

__all__ = [
    "LayerChange",
    "MaskedConv",
    "SparseLinearGeneral",
    "SparsifiedLinen",
    "SparsifyReport",
    "densify",
    "densify_linen",
    "sparsify",
    "sparsify_linen",
]


# -------------------------------------------------------------------------------------------------
# Report.
# -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerChange:
  """What :func:`sparsify` did to one layer.

  Attributes:
    path: dotted path of the layer (``"blocks.0.mlp.fc1"``).
    layer: the dense layer, e.g. ``"Linear(256->1024)"``.
    kind: the rule's structure, e.g. ``"block 64x64 25% kept"``, ``"2:4"``, ``"unstructured 90%"``.
    replaced_by: class name of the new layer, or ``None`` when the layer stayed dense.
    density: fraction of the kernel's weights the new layer keeps (1.0 when it stayed dense).
    bytes_before: bytes of the dense layer's state (kernel, bias).
    bytes_after: bytes of the new layer's state (parameters and sparsity pattern).
    dense_ms, sparse_ms: measured times with ``check_speed`` (forward, or forward+backward), else ``None``.
    note: why a layer stayed dense, or other remarks.
  """

  path: str
  layer: str
  kind: str
  replaced_by: str | None
  density: float
  bytes_before: int
  bytes_after: int
  dense_ms: float | None = None
  sparse_ms: float | None = None
  note: str = ""


@dataclasses.dataclass(frozen=True)
class SparsifyReport:
  """The layers :func:`sparsify` changed or timed, sorted by path; ``str(report)`` is a Markdown table."""

  layers: tuple[LayerChange, ...]

  @property
  def replaced(self) -> tuple[LayerChange, ...]:
    return tuple(c for c in self.layers if c.replaced_by is not None)

  @property
  def bytes_before(self) -> int:
    return sum(c.bytes_before for c in self.layers)

  @property
  def bytes_after(self) -> int:
    return sum(c.bytes_after for c in self.layers)

  def __str__(self) -> str:
    rows = [
        "| path | layer | rule | now | density | bytes before | bytes after | dense ms | sparse ms | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in self.layers:
      dense_ms = "" if c.dense_ms is None else f"{c.dense_ms:.3f}"
      sparse_ms = "" if c.sparse_ms is None else f"{c.sparse_ms:.3f}"
      rows.append(
          f"| {c.path} | {c.layer} | {c.kind} | {c.replaced_by or 'dense'} | {c.density:.3f} | {c.bytes_before} "
          f"| {c.bytes_after} | {dense_ms} | {sparse_ms} | {c.note} |"
      )
    rows.append(f"\n{len(self.replaced)} of {len(self.layers)} layers sparse; layer bytes "
                f"{self.bytes_before} -> {self.bytes_after}.")
    return "\n".join(rows)


def _nbytes(tree: Any) -> int:
  return int(sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in jax.tree.leaves(tree)))


def _state_bytes(layer: nnx.Module) -> int:
  return _nbytes(nnx.state(layer))


# -------------------------------------------------------------------------------------------------
# New NNX layers: a masked conv and a LinearGeneral over a 2-D sparse layer.
# -------------------------------------------------------------------------------------------------


def _conv_options(conv: nnx.Conv) -> dict[str, Any]:
  """``conv``'s options for rebuilding it; the caller sets the mask and rngs."""
  options = conv_options(conv)
  del options["mask"], options["rngs"]
  return options


class MaskedConv(nnx.Conv):
  """``nnx.Conv`` with a fixed unstructured weight ``mask`` held as a :class:`SparsityPattern`.

  It is Flax's own weight-masked convolution (``nnx.Conv(mask=...)``) with the mask stored as
  non-trainable state, so it can be read, saved and filtered like the other layers' patterns.
  Pruned weights are zero and get zero gradient.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxsparse._sparsify._nnx import MaskedConv
  >>> conv = MaskedConv.from_dense(nnx.Conv(8, 16, (3, 3), rngs=nnx.Rngs(0)), sparsity=0.75)
  >>> conv.density, conv(jnp.ones((2, 6, 6, 8))).shape
  (0.25, (2, 6, 6, 16))
  """

  def __init__(self, in_features: int, out_features: int, kernel_size, *, mask: Any, rngs: nnx.Rngs, **kwargs):
    super().__init__(in_features, out_features, kernel_size, rngs=rngs, **kwargs)
    mask = check_mask(mask, self.kernel_shape, name="mask")
    k = self.kernel[...]
    self.kernel[...] = jnp.where(mask, k, jnp.zeros((), k.dtype))
    self.mask = nnx.data(SparsityPattern(mask))

  @property
  def density(self) -> float:
    """Fraction of weights kept."""
    return float(np.mean(np.asarray(self.mask[...])))

  @classmethod
  def from_dense(cls, conv: nnx.Conv, *, sparsity: float | None = None, mask: Any = None) -> MaskedConv:
    """Prunes ``conv`` to its largest-magnitude weights (``sparsity``) or to ``mask``; copies every option."""
    if not isinstance(conv, nnx.Conv):
      raise TypeError(f"conv must be a flax.nnx.Conv, got {type(conv).__name__}.")
    if conv.mask is not None:
      raise ValueError("conv already has a weight mask; densify it first.")
    kernel = conv.kernel[...]
    if (sparsity is None) == (mask is None):
      raise ValueError("Pass exactly one of sparsity= and mask=.")
    if mask is None:
      mask = magnitude_mask(kernel, sparsity)
    layer = cls(
        conv.in_features,
        conv.out_features,
        conv.kernel_size,
        mask=mask,
        param_dtype=kernel.dtype,
        kernel_init=lambda *_: kernel,
        rngs=nnx.Rngs(0),
        **_conv_options(conv),
    )
    if conv.bias is not None:
      layer.bias[...] = conv.bias[...]
    return layer

  def to_dense(self) -> nnx.Conv:
    """An ``nnx.Conv`` with kernel ``kernel * mask`` and the same options and bias."""
    kernel = jnp.where(self.mask[...], self.kernel[...], jnp.zeros((), self.kernel.dtype))
    conv = nnx.Conv(
        self.in_features,
        self.out_features,
        self.kernel_size,
        param_dtype=kernel.dtype,
        kernel_init=lambda *_: kernel,
        rngs=nnx.Rngs(0),
        **_conv_options(self),
    )
    if self.bias is not None:
      conv.bias[...] = self.bias[...]
    return conv


class SparseLinearGeneral(nnx.Module):
  """An ``nnx.LinearGeneral`` over trailing axes, computed by a 2-D sparse layer on flattened features.

  ``x`` of shape ``(..., *in_features)`` is reshaped to ``(..., prod(in_features))``, multiplied by
  ``layer`` and reshaped to ``(..., *out_features)``: the attention projections of
  ``nnx.MultiHeadAttention`` (``(d,) -> (heads, head_dim)`` and back) become sparse layers.

  Attributes:
    layer: the 2-D sparse layer (``BlockSparseLinear``, ``MaskedLinear`` or ``NMLinear``).
    in_features, out_features: tuples, as in ``nnx.LinearGeneral``.
  """

  def __init__(self, layer: nnx.Module, *, in_features: tuple[int, ...], out_features: tuple[int, ...],
               dtype: Any = None, precision: Any = None):
    self.layer = layer
    self.in_features = tuple(in_features)
    self.out_features = tuple(out_features)
    self.dtype = dtype
    self.precision = precision

  def __call__(self, x: jax.Array, out_sharding: Any = None) -> jax.Array:
    if out_sharding is not None:
      raise NotImplementedError("SparseLinearGeneral does not take out_sharding.")
    n_in = len(self.in_features)
    batch = x.shape[: x.ndim - n_in]
    y = self.layer(x.reshape(*batch, math.prod(self.in_features)))
    return y.reshape(*batch, *self.out_features)

  def to_dense(self) -> nnx.LinearGeneral:
    """The ``nnx.LinearGeneral`` holding the pruned kernel."""
    lin = self.layer.to_dense()
    kernel = lin.kernel[...].reshape(*self.in_features, *self.out_features)
    n_in = len(self.in_features)
    dense = nnx.LinearGeneral(
        self.in_features,
        self.out_features,
        axis=tuple(range(-n_in, 0)),
        use_bias=lin.bias is not None,
        param_dtype=kernel.dtype,
        kernel_init=lambda *_: kernel,
        dtype=self.dtype,
        precision=self.precision,
        rngs=nnx.Rngs(0),
    )
    if lin.bias is not None:
      dense.bias[...] = lin.bias[...].reshape(self.out_features)
    return dense


_SPARSE_NNX = (BlockSparseLinear, MaskedLinear, NMLinear, NMConv, CompressedNMLinear, MaskedConv, SparseLinearGeneral)


def _general_as_linear(layer: nnx.LinearGeneral, path: str) -> nnx.Linear:
  n_in = len(layer.in_features)
  if layer.batch_axis or tuple(layer.axis) != tuple(range(-n_in, 0)):
    raise ValueError(
        f"{path}: nnx.LinearGeneral with axis={layer.axis} and batch_axis={dict(layer.batch_axis)} is not "
        "supported; only trailing contracting axes and no batch axes (as in nnx.MultiHeadAttention)."
    )
  k, n = math.prod(layer.in_features), math.prod(layer.out_features)
  bias = None if layer.bias is None else layer.bias[...].reshape(n)
  return _linear(layer.kernel[...].reshape(k, n), bias, dtype=layer.dtype, precision=layer.precision)


def _linear(kernel: jax.Array, bias: jax.Array | None, *, dtype: Any, precision: Any) -> nnx.Linear:
  lin = nnx.Linear(
      kernel.shape[0], kernel.shape[1], use_bias=bias is not None, dtype=dtype, param_dtype=kernel.dtype,
      precision=precision, kernel_init=lambda *_: kernel, rngs=nnx.Rngs(0),
  )
  if bias is not None:
    lin.bias[...] = bias
  return lin


# -------------------------------------------------------------------------------------------------
# Building one sparse layer.
# -------------------------------------------------------------------------------------------------


def _block_mask_of(mask: np.ndarray, block_shape: tuple[int, int], path: str) -> np.ndarray:
  k, n = mask.shape
  bk, bn = block_shape
  blocks = mask.reshape(k // bk, bk, n // bn, bn)
  anyb, allb = blocks.any(axis=(1, 3)), blocks.all(axis=(1, 3))
  if not np.array_equal(anyb, allb):
    raise ValueError(f"{path}: the given mask is not constant over {block_shape} blocks, so it is not a block mask.")
  if not anyb.any():
    raise ValueError(f"{path}: the given mask keeps no block.")
  return anyb


def _sparse_linear(lin: nnx.Linear, spec: Spec, mask: np.ndarray | None, path: str) -> nnx.Module:
  kernel = lin.kernel[...]
  if isinstance(spec, BlockSparse):
    if mask is None:
      return BlockSparseLinear.from_dense(lin, density=spec.density, block_shape=spec.block_shape)
    block_mask = _block_mask_of(mask, spec.block_shape, path)
    layer = BlockSparseLinear(
        lin.in_features, lin.out_features, block_shape=spec.block_shape, block_mask=block_mask,
        use_bias=lin.bias is not None, dtype=lin.dtype, param_dtype=kernel.dtype,
        kernel_init=nnx.initializers.zeros_init(), precision=lin.precision, rngs=nnx.Rngs(0),
    )
    layer.kernel[...] = BlockSparseMatrix.from_dense(kernel, spec.block_shape, block_mask=block_mask).data
    if lin.bias is not None:
      layer.bias[...] = lin.bias[...]
    return layer
  if isinstance(spec, NM):
    if mask is not None:  # the N:M pattern follows the weights: zero the pruned ones so it is the given mask
      lin = _linear(jnp.where(mask, kernel, jnp.zeros((), kernel.dtype)), None if lin.bias is None else lin.bias[...],
                    dtype=lin.dtype, precision=lin.precision)
    return NMLinear.from_dense(lin, n=spec.n, m=spec.m)
  if mask is None:
    return MaskedLinear.from_dense(lin, sparsity=spec.sparsity)
  layer = MaskedLinear(
      lin.in_features, lin.out_features, mask=jnp.asarray(mask), use_bias=lin.bias is not None, dtype=lin.dtype,
      param_dtype=kernel.dtype, kernel_init=lambda *_: kernel, precision=lin.precision, rngs=nnx.Rngs(0),
  )
  if lin.bias is not None:
    layer.bias[...] = lin.bias[...]
  return layer


def _to_sparse(node: nnx.Module, spec: Spec, mask: np.ndarray | None, path: str) -> nnx.Module:
  kernel_shape = tuple(node.kernel.shape)
  if mask is not None and mask.shape != kernel_shape:
    raise ValueError(f"{path}: the given mask has shape {mask.shape}, the kernel {kernel_shape}.")
  if isinstance(node, nnx.Conv):
    if isinstance(spec, BlockSparse):
      raise ValueError(
          f"{path}: BlockSparse does not apply to nnx.Conv layers; use jaxsparse.NM(...) or "
          "jaxsparse.Unstructured(...) for this path, or exclude it with a None rule."
      )
    check_spec_applies(spec, kernel_shape, path=path)
    if node.mask is not None and isinstance(spec, Unstructured):
      raise ValueError(f"{path}: this nnx.Conv already has a Flax weight mask; prune it with a mask= instead.")
    if isinstance(spec, NM):
      conv = node
      if mask is not None:
        conv = MaskedConv.from_dense(node, mask=mask).to_dense()
      return NMConv.from_dense(conv, n=spec.n, m=spec.m)
    return MaskedConv.from_dense(node, sparsity=None if mask is not None else spec.sparsity, mask=mask)
  if isinstance(node, nnx.LinearGeneral):
    lin = _general_as_linear(node, path)
    check_spec_applies(spec, lin.kernel.shape, path=path)
    mask2 = None if mask is None else mask.reshape(lin.kernel.shape)
    return SparseLinearGeneral(
        _sparse_linear(lin, spec, mask2, path), in_features=node.in_features, out_features=node.out_features,
        dtype=node.dtype, precision=node.precision,
    )
  check_spec_applies(spec, kernel_shape, path=path)
  return _sparse_linear(node, spec, mask, path)


def _density(layer: nnx.Module) -> float:
  if isinstance(layer, SparseLinearGeneral):
    return _density(layer.layer)
  if isinstance(layer, (NMLinear, NMConv)):
    return layer.n / layer.m
  return float(layer.density)


# -------------------------------------------------------------------------------------------------
# Walking an NNX model.
# -------------------------------------------------------------------------------------------------


def _child(node: Any, key: Any) -> Any:
  return node[key] if hasattr(type(node), "__getitem__") else getattr(node, key)


def _set_child(node: Any, key: Any, value: Any) -> None:
  if hasattr(type(node), "__setitem__"):
    node[key] = value
  else:
    setattr(node, key, value)


def _replace(model: nnx.Module, path: tuple, new: nnx.Module) -> None:
  parent = model
  for k in path[:-1]:
    parent = _child(parent, k)
  _set_child(parent, path[-1], new)


def _describe(node: nnx.Module) -> str:
  if isinstance(node, nnx.Conv):
    return f"Conv({node.in_features}->{node.out_features}, {tuple(node.kernel_size)})"
  if isinstance(node, nnx.LinearGeneral):
    return f"LinearGeneral({node.in_features}->{node.out_features})"
  return f"Linear({node.in_features}->{node.out_features})"


def _dense_layers(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
  out = []
  for path, node in nnx.iter_modules(model):
    if isinstance(node, _SPARSE_NNX):
      continue
    if isinstance(node, (nnx.Linear, nnx.Conv, nnx.LinearGeneral)):
      out.append((tuple(path), node))
  return out


def _masks_dict(masks: Any) -> dict[str, np.ndarray]:
  if masks is None:
    return {}
  return masks_to_dict(masks)


class _Probe(nnx.Module):
  """Stands in for a layer while :func:`sparsify` records the input it gets from ``example_input``."""

  def __init__(self, inner: nnx.Module, record: Callable[[jax.Array], None]):
    self.inner = inner
    self.record = record

  def __call__(self, x, *args, **kwargs):
    self.record(x)
    return self.inner(x, *args, **kwargs)


def _record_inputs(model: nnx.Module, layers: list[tuple[tuple, nnx.Module]], example_input: Any) -> dict:
  shapes: dict[tuple, jax.ShapeDtypeStruct] = {}

  def recorder(path):
    def record(x):
      shapes.setdefault(path, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return record

  args = example_input if isinstance(example_input, tuple) else (example_input,)
  if any(not path for path, _ in layers):  # the model is the layer
    recorder(())(args[0])
    return shapes
  for path, node in layers:
    _replace(model, path, _Probe(node, recorder(path)))
  try:
    nnx.eval_shape(lambda m, *a: m(*a), model, *args)
  finally:
    for path, node in layers:
      _replace(model, path, node)
  return shapes


def _time_call(fn: Callable[..., Any], *args: Any) -> float:
  """Median milliseconds per call of a jitted ``fn``, after compiling and warming up."""
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  once = time.perf_counter() - t0
  reps = max(1, min(50, int(0.02 / max(once, 1e-6))))
  samples = []
  for _ in range(5):
    t0 = time.perf_counter()
    out = None
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / reps)
  return float(np.median(samples)) * 1e3


def _timed(apply: Callable[[Any, jax.Array], jax.Array], params: Any, x: jax.Array, mode: str) -> float:
  if mode == "forward":
    return _time_call(jax.jit(apply), params, x)
  grad = jax.jit(jax.grad(lambda p, x: jnp.sum(apply(p, x).astype(jnp.float32)), argnums=(0, 1)))
  return _time_call(grad, params, x)


def _time_nnx_layer(layer: nnx.Module, x: jax.Array, mode: str) -> float:
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  return _timed(lambda p, x: nnx.merge(graphdef, p, rest)(x), params, x, mode)


def _check_speed_mode(check_speed: object, example_input: Any) -> str | None:
  if check_speed is False or check_speed is None:
    return None
  mode = "train" if check_speed is True else check_speed
  if mode not in ("train", "forward"):
    raise ValueError(f"check_speed must be False, True, 'train' or 'forward', got check_speed={check_speed!r}.")
  if example_input is None:
    raise ValueError("check_speed needs example_input: the input the model is timed on.")
  return mode


def _random_input(spec: jax.ShapeDtypeStruct) -> jax.Array:
  dtype = spec.dtype if jnp.issubdtype(spec.dtype, jnp.floating) else jnp.float32
  return jax.random.normal(jax.random.key(0), spec.shape, dtype)


# -------------------------------------------------------------------------------------------------
# NNX API.
# -------------------------------------------------------------------------------------------------


def sparsify(
    model: nnx.Module,
    rules: Any,
    *,
    masks: Any = None,
    check_speed: bool | str = False,
    example_input: Any = None,
    inplace: bool = False,
) -> tuple[nnx.Module, SparsifyReport]:
  """Replaces the dense layers of an NNX model that match ``rules`` by sparse layers.

  Every ``nnx.Linear``, ``nnx.Conv`` and ``nnx.LinearGeneral`` (trailing contracting axes, as in
  ``nnx.MultiHeadAttention``) takes the structure of the first rule whose regex fully matches its
  dotted path; its sparse replacement keeps the largest-magnitude weights (blocks by Frobenius norm,
  N of every M) and copies the bias and options. See the module docstring for which layer each
  structure gives.

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> from flax import nnx
  >>> class MLP(nnx.Module):
  ...   def __init__(self, rngs):
  ...     self.up = nnx.Linear(64, 128, rngs=rngs)
  ...     self.down = nnx.Linear(128, 64, rngs=rngs)
  ...   def __call__(self, x):
  ...     return self.down(jax.nn.relu(self.up(x)))
  >>> model = MLP(nnx.Rngs(0))
  >>> sparse, report = jaxsparse.sparsify(model, {r"up": jaxsparse.BlockSparse(density=0.25, block_shape=(32, 32)),
  ...                                            r".*": jaxsparse.NM(2, 4)})
  >>> type(sparse.up).__name__, type(sparse.down).__name__, type(model.up).__name__
  ('BlockSparseLinear', 'NMLinear', 'Linear')
  >>> [(c.path, c.kind, c.density) for c in report.layers]
  [('down', '2:4', 0.5), ('up', 'block 32x32 25% kept', 0.25)]
  >>> sparse(jnp.ones((2, 64))).shape
  (2, 64)

  Args:
    model: an ``nnx.Module``; it is copied unless ``inplace``.
    rules: a structure (``jaxsparse.BlockSparse(density=..., block_shape=...)``, ``jaxsparse.NM(n, m)``,
      ``jaxsparse.Unstructured(sparsity=...)``) for every layer, or ``{regex: structure or None}``;
      the first pattern that fully matches a layer's dotted path wins, ``None`` keeps it dense.
    masks: optional masks from training (:func:`jaxsparse.pruning.get_masks`, or
      ``{"path.kernel": mask}``): a layer with a mask for its kernel keeps exactly those weights
      (a ``BlockSparse`` layer needs a mask constant over its blocks) instead of pruning by magnitude.
    check_speed: ``True`` / ``"train"`` times forward+backward, ``"forward"`` the forward pass, of
      each dense layer and its sparse replacement on the input it gets from ``example_input``; a
      layer stays dense unless the sparse one is faster (SparseProp's swap rule).
    example_input: the model's input (an array, or a tuple of positional arguments) for ``check_speed``.
    inplace: modify ``model`` itself instead of a copy.

  Returns:
    ``(model, report)``: the sparse model and a :class:`SparsifyReport` (path, structure, density,
    parameter bytes before and after, times).

  Raises:
    ValueError: naming the layer path, when a structure cannot apply (``m`` does not divide the
      input size, blocks do not divide the kernel, ``BlockSparse`` on a conv, a bad mask).
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}; for Linen use sparsify_linen.")
  resolved = resolve_rules(rules)
  mode = _check_speed_mode(check_speed, example_input)
  mask_dict = _masks_dict(masks)
  if not inplace:
    model = nnx.clone(model)
  layers = _dense_layers(model)
  chosen = []
  for path, node in layers:
    r = match_rules(resolved, path_str(path))
    if r is not None and resolved[r][2] is not None:
      chosen.append((path, node, resolved[r][2]))
  warn_unmatched(resolved, [path_str(p) for p, _ in layers], what="nnx.Linear / nnx.Conv / nnx.LinearGeneral")

  built = []
  for path, node, spec in chosen:
    p = path_str(path)
    mask = mask_dict.get(f"{p}.kernel" if p else "kernel")
    built.append((path, node, spec, _to_sparse(node, spec, None if mask is None else np.asarray(mask), p)))

  shapes = _record_inputs(model, [(p, n) for p, n, _, _ in built], example_input) if mode else {}
  changes = []
  for path, node, spec, new in built:
    p = path_str(path)
    dense_ms = sparse_ms = None
    note = ""
    keep_dense = False
    if mode:
      if path in shapes:
        x = _random_input(shapes[path])
        dense_ms, sparse_ms = _time_nnx_layer(node, x, mode), _time_nnx_layer(new, x, mode)
        keep_dense = sparse_ms >= dense_ms
        if keep_dense:
          note = f"kept dense: sparse not faster ({mode})"
      else:
        note = "not called by example_input; not timed"
    if keep_dense:
      changes.append(LayerChange(p, _describe(node), spec.describe(), None, 1.0, _state_bytes(node),
                                 _state_bytes(node), dense_ms, sparse_ms, note))
      continue
    if path:
      _replace(model, path, new)
    else:
      model = new
    changes.append(LayerChange(p, _describe(node), spec.describe(), type(new).__name__, _density(new),
                               _state_bytes(node), _state_bytes(new), dense_ms, sparse_ms, note))
  changes.sort(key=lambda c: c.path)
  return model, SparsifyReport(tuple(changes))


def densify(model: nnx.Module, *, inplace: bool = False) -> nnx.Module:
  """Replaces every jaxsparse layer of an NNX model by the dense Flax layer computing the same function.

  ``BlockSparseLinear`` / ``MaskedLinear`` / ``NMLinear`` / ``CompressedNMLinear`` become ``nnx.Linear``,
  ``NMConv`` / ``MaskedConv`` become ``nnx.Conv``, ``SparseLinearGeneral`` becomes ``nnx.LinearGeneral``;
  pruned weights are zeros in the dense kernels.

  >>> import jax.numpy as jnp, jaxsparse
  >>> from flax import nnx
  >>> model = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)))
  >>> sparse, _ = jaxsparse.sparsify(model, jaxsparse.Unstructured(sparsity=0.5))
  >>> dense = jaxsparse.densify(sparse)
  >>> type(dense.layers[0]).__name__, float(jnp.mean(dense.layers[0].kernel[...] == 0))
  ('Linear', 0.5)
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}.")
  if not inplace:
    model = nnx.clone(model)
  if isinstance(model, _SPARSE_NNX):
    return model.to_dense()
  found = {tuple(path) for path, node in nnx.iter_modules(model) if path and isinstance(node, _SPARSE_NNX)}
  outermost = [p for p in found if not any(p[:i] in found for i in range(1, len(p)))]
  for path in outermost:
    parent = model
    for k in path[:-1]:
      parent = _child(parent, k)
    _set_child(parent, path[-1], _child(parent, path[-1]).to_dense())
  return model


# -------------------------------------------------------------------------------------------------
# Linen.
# -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _LinenLayer:
  kind: str  # "dense" or "conv"
  spec: Spec
  module: nn.Module  # the original layer, unbound (its configuration)
  in_features: int


def _nested_get(tree: Mapping, path: tuple) -> Any:
  for k in path:
    tree = tree[k]
  return tree


def _nested_set(tree: dict, path: tuple, value: Any) -> None:
  if not path:  # the root module is the layer
    tree.clear()
    tree.update(value)
    return
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def _to_dict(tree: Any) -> Any:
  if isinstance(tree, Mapping):
    return {k: _to_dict(v) for k, v in tree.items()}
  return tree


def _linen_sparse_module(layer: _LinenLayer, *, nnz: int | None = None) -> nn.Module:
  m, spec = layer.module, layer.spec
  if layer.kind == "dense":
    common = dict(use_bias=m.use_bias, dtype=m.dtype, param_dtype=m.param_dtype, precision=m.precision)
    if isinstance(spec, BlockSparse):
      k, n = layer.in_features, m.features
      blocks = (k // spec.block_shape[0]) * (n // spec.block_shape[1])
      density = spec.density if nnz is None else nnz / blocks
      return sparse_linen.BlockSparseDense(m.features, density=density, block_shape=spec.block_shape, **common)
    if isinstance(spec, NM):
      return sparse_linen.NMDense(m.features, n=spec.n, m=spec.m, promote_dtype=m.promote_dtype,
                                  dot_general=m.dot_general, dot_general_cls=m.dot_general_cls, **common)
    return sparse_linen.MaskedDense(m.features, sparsity=spec.sparsity, **common)
  if isinstance(spec, NM):
    fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(sparse_linen.NMConv)
              if f.name not in ("n", "m", "sr_ste_decay", "parent", "name", "_") and hasattr(m, f.name)}
    return sparse_linen.NMConv(n=spec.n, m=spec.m, **fields)
  return m  # unstructured conv: the original conv, given its mask at call time


def _linen_apply(layer: _LinenLayer, variables: Mapping, x: jax.Array) -> jax.Array:
  if layer.kind == "conv" and isinstance(layer.spec, Unstructured):
    mask = variables[sparse_linen.SPARSITY]["mask"]
    return layer.module.clone(parent=None, mask=mask).apply({"params": variables["params"]}, x)
  nnz = None
  if isinstance(layer.spec, BlockSparse):
    nnz = variables["params"]["kernel"].shape[0]
  return _linen_sparse_module(layer, nnz=nnz).apply(variables, x)


_IN_SPARSE_LAYER: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxsparse_in_sparse_layer", default=False)


@dataclasses.dataclass(frozen=True, eq=False)
class SparsifiedLinen:
  """A Linen module whose matched ``nn.Dense`` / ``nn.Conv`` calls run as sparse layers.

  ``apply(variables, *args, **kwargs)`` is ``module.apply`` with those calls redirected
  (``nn.intercept_methods``) to ``BlockSparseDense``, ``MaskedDense``, ``NMDense``, ``NMConv`` or a
  masked ``nn.Conv`` on the variables of the same scope. Use it as ``apply_fn`` of a ``TrainState``.

  Attributes:
    module: the user's Linen module, unchanged.
    layers: ``{module path: plan}`` of the redirected layers.
  """

  module: nn.Module
  layers: Mapping[tuple, _LinenLayer]

  def _intercept(self, next_fun, args, kwargs, context):
    layer = self.layers.get(tuple(context.module.path)) if context.method_name == "__call__" else None
    if layer is None or _IN_SPARSE_LAYER.get() or type(context.module) is not type(layer.module):
      return next_fun(*args, **kwargs)
    if len(args) != 1 or kwargs:
      raise TypeError(f"{'.'.join(context.module.path)}: sparse layers take one positional input.")
    token = _IN_SPARSE_LAYER.set(True)  # the sparse layer's own nn.Dense / nn.Conv must run as is
    try:
      return _linen_apply(layer, context.module.variables, args[0])
    finally:
      _IN_SPARSE_LAYER.reset(token)

  def apply(self, variables: Mapping, *args: Any, **kwargs: Any) -> Any:
    """``module.apply(variables, *args, **kwargs)`` with the sparse layers in place."""
    with nn.intercept_methods(self._intercept):
      return self.module.apply(variables, *args, **kwargs)


def _linen_layers(module: nn.Module, variables: Mapping, example_input: Any, kwargs: Mapping) -> dict:
  found: dict[tuple, tuple[str, nn.Module, jax.ShapeDtypeStruct]] = {}

  def interceptor(next_fun, args, kw, context):
    m = context.module
    if context.method_name == "__call__" and type(m) in (nn.Dense, nn.Conv) and args:
      x = args[0]
      found.setdefault(tuple(m.path), ("dense" if type(m) is nn.Dense else "conv", m.clone(parent=None),
                                      jax.ShapeDtypeStruct(x.shape, x.dtype)))
    return next_fun(*args, **kw)

  args = example_input if isinstance(example_input, tuple) else (example_input,)
  with nn.intercept_methods(interceptor):
    jax.eval_shape(lambda v, *a: module.apply(v, *a, **kwargs), variables, *args)
  return found


def sparsify_linen(
    module: nn.Module,
    variables: Mapping,
    rules: Any,
    example_input: Any,
    *,
    masks: Any = None,
    check_speed: bool | str = False,
    apply_kwargs: Mapping[str, Any] | None = None,
) -> tuple[SparsifiedLinen, dict, SparsifyReport]:
  """Linen version of :func:`sparsify`: sparse variables plus a module that applies them.

  The ``nn.Dense`` and ``nn.Conv`` layers that ``module`` calls on ``example_input`` are found by
  path (``"Dense_0"``, ``"mlp.fc1"``); each one a rule matches gets the variables of the Linen
  sparse layer for its structure (``BlockSparseDense``, ``MaskedDense``, ``NMDense``, ``NMConv``, or
  a masked ``nn.Conv`` for unstructured convs), pruned by magnitude from its dense kernel (or to
  ``masks``). Patterns go into the ``"sparsity"`` collection.

  >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxsparse
  >>> class MLP(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     h = nn.relu(nn.Dense(64)(x))  # Dense_0: 32 -> 64
  ...     return nn.Dense(16)(h)  # Dense_1: 64 -> 16
  >>> model = MLP()
  >>> x = jnp.ones((4, 32))
  >>> variables = model.init(jax.random.key(0), x)
  >>> sparse, sparse_vars, report = jaxsparse.sparsify_linen(
  ...     model, variables, {"Dense_0": jaxsparse.BlockSparse(density=0.5, block_shape=(16, 16)),
  ...                        "Dense_1": jaxsparse.Unstructured(sparsity=0.75)}, x)
  >>> jax.tree.map(jnp.shape, sparse_vars["sparsity"])["Dense_1"]
  {'mask': (64, 16)}
  >>> sparse.apply(sparse_vars, x).shape
  (4, 16)

  Args:
    module: the dense Linen module (unchanged).
    variables: its variables (``{"params": ...}`` and any other collections).
    rules: as :func:`sparsify`, matched against Linen module paths such as ``"Dense_0"``.
    example_input: an input (or tuple of positional inputs) for ``module.apply``, used to find the
      layers and their input shapes.
    masks: as :func:`sparsify`, with paths like ``"Dense_0.kernel"`` (``get_masks`` of a
      ``TrainState`` trained with :func:`jaxsparse.pruning.wrap_optax` gives them).
    check_speed: as :func:`sparsify`.
    apply_kwargs: keyword arguments for ``module.apply`` (e.g. ``{"train": False}``).

  Returns:
    ``(sparse_module, sparse_variables, report)``: call ``sparse_module.apply(sparse_variables, x)``.
  """
  resolved = resolve_rules(rules)
  mode = _check_speed_mode(check_speed, example_input)
  mask_dict = _masks_dict(masks)
  kwargs = dict(apply_kwargs or {})
  found = _linen_layers(module, variables, example_input, kwargs)
  new_vars = _to_dict(variables)
  params = new_vars.setdefault("params", {})
  layers, changes = {}, []
  for path, (kind, m, x_spec) in found.items():
    p = ".".join(path)
    r = match_rules(resolved, p)
    if r is None:
      continue
    spec = resolved[r][2]
    if spec is None:
      continue
    dense_params = _nested_get(params, path)
    kernel = dense_params["kernel"]
    if kind == "conv" and isinstance(spec, BlockSparse):
      raise ValueError(
          f"{p}: BlockSparse does not apply to nn.Conv layers; use jaxsparse.NM or jaxsparse.Unstructured."
      )
    check_spec_applies(spec, kernel.shape, path=p)
    mask = mask_dict.get(f"{p}.kernel")
    layer_vars = _linen_variables(kind, spec, dense_params, None if mask is None else np.asarray(mask), p)
    layer = _LinenLayer(kind, spec, m, int(x_spec.shape[-1]))
    dense_ms = sparse_ms = None
    note = ""
    if mode:
      x = _random_input(x_spec)
      rest = {k: v for k, v in layer_vars.items() if k != "params"}
      dense_ms = _timed(lambda q, x, m=m: m.apply({"params": q}, x), dense_params, x, mode)
      sparse_ms = _timed(
          lambda q, x, layer=layer, rest=rest: _linen_apply(layer, {"params": q, **rest}, x),
          layer_vars["params"], x, mode,
      )
      if sparse_ms >= dense_ms:
        changes.append(LayerChange(p, f"{type(m).__name__}({kernel.shape})", spec.describe(), None, 1.0,
                                   _nbytes(dense_params), _nbytes(dense_params), dense_ms, sparse_ms,
                                   f"kept dense: sparse not faster ({mode})"))
        continue
    layers[path] = layer
    _nested_set(params, path, layer_vars["params"])
    if sparse_linen.SPARSITY in layer_vars:
      _nested_set(new_vars.setdefault(sparse_linen.SPARSITY, {}), path, layer_vars[sparse_linen.SPARSITY])
    density = _linen_density(spec, layer_vars, kernel)
    changes.append(LayerChange(p, f"{type(m).__name__}({kernel.shape})", spec.describe(),
                               type(_linen_sparse_module(layer, nnz=_nnz(layer_vars, spec))).__name__,
                               density, _nbytes(dense_params), _nbytes(layer_vars), dense_ms, sparse_ms, note))
  warn_unmatched(resolved, [".".join(p) for p in found], what="nn.Dense / nn.Conv")
  changes.sort(key=lambda c: c.path)
  return SparsifiedLinen(module, layers), new_vars, SparsifyReport(tuple(changes))


def _nnz(layer_vars: Mapping, spec: Spec) -> int | None:
  return layer_vars["params"]["kernel"].shape[0] if isinstance(spec, BlockSparse) else None


def _linen_density(spec: Spec, layer_vars: Mapping, kernel: jax.Array) -> float:
  if isinstance(spec, NM):
    return spec.n / spec.m
  if isinstance(spec, BlockSparse):
    k2 = (math.prod(kernel.shape[:-1]), kernel.shape[-1])
    return layer_vars["params"]["kernel"].shape[0] / ((k2[0] // spec.block_shape[0]) * (k2[1] // spec.block_shape[1]))
  return float(np.mean(np.asarray(layer_vars[sparse_linen.SPARSITY]["mask"])))


def _linen_variables(kind: str, spec: Spec, dense_params: Mapping, mask: np.ndarray | None, path: str) -> dict:
  kernel = jnp.asarray(dense_params["kernel"])
  if mask is not None and mask.shape != kernel.shape:
    raise ValueError(f"{path}: the given mask has shape {mask.shape}, the kernel {kernel.shape}.")
  bias = {"bias": dense_params["bias"]} if "bias" in dense_params else {}
  if isinstance(spec, BlockSparse):
    if mask is None:
      block_mask = np.asarray(block_magnitude_mask(kernel, spec.block_shape, spec.density))
    else:
      block_mask = _block_mask_of(mask, spec.block_shape, path)
    w = BlockSparseMatrix.from_dense(kernel, spec.block_shape, block_mask=block_mask)
    return {"params": {"kernel": w.data, **bias}, sparse_linen.SPARSITY: dict(w.index_arrays())}
  if isinstance(spec, NM):
    if mask is not None:
      kernel = jnp.where(mask, kernel, jnp.zeros((), kernel.dtype))
    return {"params": {"kernel": kernel, **bias}}
  if mask is None:
    mask = magnitude_mask(kernel, spec.sparsity)
  mask = jnp.asarray(mask)
  return {"params": {"kernel": jnp.where(mask, kernel, jnp.zeros((), kernel.dtype)), **bias},
          sparse_linen.SPARSITY: {"mask": mask}}


def densify_linen(sparse: SparsifiedLinen, variables: Mapping) -> tuple[nn.Module, dict]:
  """Inverse of :func:`sparsify_linen`: the original module and dense variables (zeros where pruned).

  >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxsparse
  >>> model = nn.Dense(8)
  >>> x = jnp.ones((2, 8))
  >>> variables = model.init(jax.random.key(0), x)
  >>> sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, jaxsparse.NM(2, 4), x)
  >>> module, dense_vars = jaxsparse.densify_linen(sparse, sparse_vars)
  >>> bool(jnp.allclose(module.apply(dense_vars, x), sparse.apply(sparse_vars, x)))
  True
  """
  new_vars = _to_dict(variables)
  params = new_vars["params"]
  pattern = new_vars.get(sparse_linen.SPARSITY, {})
  for path, layer in sparse.layers.items():
    p = _nested_get(params, path)
    kernel = p["kernel"]
    if isinstance(layer.spec, BlockSparse):
      idx = _nested_get(pattern, path)
      k2 = (layer.in_features, layer.module.features)
      dense = BlockSparseMatrix.from_index_arrays(kernel, dict(idx), shape=k2, block_shape=layer.spec.block_shape)
      kernel = dense.to_dense()
    elif isinstance(layer.spec, NM):
      kernel = jnp.where(nm_mask(kernel, layer.spec.n, layer.spec.m, axis=-2), kernel, jnp.zeros((), kernel.dtype))
    else:
      kernel = jnp.where(_nested_get(pattern, path)["mask"], kernel, jnp.zeros((), kernel.dtype))
    _nested_set(params, path, {**p, "kernel": kernel})
    _drop(pattern, path)
  if sparse_linen.SPARSITY in new_vars and not jax.tree.leaves(new_vars[sparse_linen.SPARSITY]):
    del new_vars[sparse_linen.SPARSITY]
  return sparse.module, new_vars


def _drop(tree: dict, path: tuple) -> None:
  if not path:
    tree.clear()
    return
  node = tree
  for k in path[:-1]:
    node = node.get(k, {})
  node.pop(path[-1], None)
