"""Calibration: the input statistics of a model's dense layers on a few batches, accumulated on the device.

For each selected ``nnx.Linear`` / ``nnx.LinearGeneral`` / ``nnx.Conv`` (Linen: ``nn.Dense`` /
``nn.DenseGeneral`` / ``nn.Conv``) a layer's inputs ``X`` (all tokens of all batches, ``(T, K)``, ``K``
the flattened input features) give a :class:`LayerStats`: the per-feature sums of squares (Wanda's
activation norms are their square roots) and the Gram matrix ``XᵀX`` (SparseGPT's Hessian, up to a
factor), accumulated in float32, or in float64 when the layer's kernel or inputs are float64 (the rule of
``jaxsparse._utils.accumulation_dtype``). A general layer contracting its trailing input axes has its kernel viewed as
``(K, N)`` over the flattened input and output axes. A convolution is a dense layer on its im2col
patches: ``X`` has one row per output position, ``K = prod(kernel_size) * cin`` in the kernel's own
``(*kernel_size, cin)`` order, so ``kernel.reshape(K, cout)`` is its ``(K, N)`` view and N:M groups of
``K`` are groups of consecutive input channels at one kernel position, as in ``NMConv``.

An embedding table (``nnx.Embed`` / ``nn.Embed``, ``(num_embeddings, features)``) that a rule names (a rule matching
no dense layer, as :func:`jaxsparse.sparsify` takes tables) gets a :class:`TableStats` instead: its lookups are
products of one-hot rows with the table, whose statistics are the count of each token id (``sq_norms`` of the one-hot
inputs; their Gram matrix is ``diag(counts)``, never built), and, when the model also calls its ``attend`` (a tied
LM head), the :class:`LayerStats` of the ``attend`` queries: the table is then the ``(features, num_embeddings)``
kernel of a dense layer, the view :class:`jaxsparse.layers.CompressedNMEmbed` stores. A model that reads a named
table's array itself (``h @ embed.embedding[...].T``) is refused (:mod:`._calibration_tables`): that use would be
missing from the statistics.

A stack of ``L`` layers (``nnx.vmap`` / ``nn.scan`` over layers: a kernel ``(L, K, N)``) that the model applies
under a transform over its layers (``nnx.scan`` / ``nn.scan``, ``nnx.vmap`` / ``nn.vmap``) gets a :class:`LayerStats`
with its leading layer axes, layer ``l``'s those of its own inputs, summed inside the transform
(:mod:`._calibration_stacks`).

One jitted function per set of layers records the inputs during the forward pass and adds their
statistics to the running sums; the rest of the forward pass, whose output is unused, is dead code
for XLA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import _utils
from jaxsparse._rules import match_rules
from jaxsparse._rules import resolve_rules
from jaxsparse.formats._specs import BlockSparse
from jaxsparse.formats._specs import check_plain_nm
from jaxsparse.formats._specs import check_spec_applies
from jaxsparse.formats._specs import matrix_shape
from jaxsparse.pruning._calibration_stacks import whole_stack_message
from jaxsparse.pruning._calibration_tables import check_structure
from jaxsparse.pruning._calibration_tables import check_table_spec

NNX_LAYERS = "nnx.Linear / nnx.LinearGeneral / nnx.Conv layer"
LINEN_LAYERS = "nn.Dense / nn.DenseGeneral / nn.Conv call"
NNX_LAYERS_AND_TABLES = f"{NNX_LAYERS} nor nnx.Embed (a rule naming it)"
LINEN_LAYERS_AND_TABLES = f"{LINEN_LAYERS} nor nn.Embed (a rule naming it)"

__all__ = ["LayerStats", "TableStats"]

_HIGHEST = jax.lax.Precision.HIGHEST


class LayerStats(NamedTuple):
  """Calibration statistics of one layer's inputs ``X`` (``(T, K)``: T tokens, K input features).

  Attributes:
    sq_norms: ``(K,)``, ``sum_t X[t, k]²``; Wanda's activation norm is its square root.
    gram: ``(K, K)``, ``XᵀX`` (SparseGPT's Hessian up to a factor), or ``None`` when not collected.
    tokens: int32 scalar ``T``.

  For a stack of ``L`` layers (a kernel ``(L, K, N)``) each field has the leading layer axes: ``(L, K)``,
  ``(L, K, K)``, ``(L,)``, layer ``l``'s from its own inputs.

  :func:`calibrate` accumulates ``sq_norms`` and ``gram`` in float32 (also for bfloat16 / float16 layers), or in
  float64 when the layer's kernel or inputs are float64.

  :func:`calibrate` returns one per layer; the fields can also be computed directly:

  >>> import jax.numpy as jnp
  >>> from jaxsparse import pruning
  >>> x = jnp.array([[1.0, 2.0], [3.0, 0.0]])
  >>> s = pruning.LayerStats(sq_norms=(x**2).sum(0), gram=x.T @ x, tokens=jnp.int32(x.shape[0]))
  >>> s.sq_norms.tolist(), s.gram.tolist(), int(s.tokens)
  ([10.0, 4.0], [[10.0, 2.0], [2.0, 4.0]], 2)
  """

  sq_norms: jax.Array
  gram: jax.Array | None
  tokens: jax.Array


class TableStats(NamedTuple):
  """Calibration statistics of an embedding table ``(num_embeddings, features)``, as calibrated pruning uses them.

  Attributes:
    counts: int32 ``(num_embeddings,)``, how often the lookups saw each id (padding left out): the ``sq_norms`` of
      the one-hot lookup inputs, whose Gram matrix is ``diag(counts)``.
    attend: the :class:`LayerStats` of the queries of the table's ``attend`` calls (``K = features``; always with
      its ``gram``, float32 or float64 as a layer's), when the model calls it (a tied LM head); ``None`` otherwise.

  :func:`calibrate` returns one for each table a rule names. A tied table (``attend`` called) is pruned as the dense
  layer ``(features, num_embeddings)`` on ``attend.gram`` plus the lookups' ridge (the pruning guide's "Embedding
  tables"); a lookup-only table by magnitude, ``counts`` weighting only its reported error.

  >>> import jax.numpy as jnp, jaxsparse
  >>> from flax import nnx
  >>> from jaxsparse import pruning
  >>> class TiedLM(nnx.Module):
  ...   def __init__(self, rngs):
  ...     self.embed = nnx.Embed(10, 8, rngs=rngs)
  ...   def __call__(self, ids):
  ...     return self.embed.attend(jnp.tanh(self.embed(ids)))  # the table is the LM head too
  >>> stats = pruning.calibrate(TiedLM(nnx.Rngs(0)), [jnp.array([[1, 1, 3]])], {"embed": jaxsparse.NM(2, 4)})
  >>> s = stats["embed"]
  >>> type(s).__name__, s.counts.tolist(), s.attend.gram.shape, int(s.attend.tokens)
  ('TableStats', [0, 2, 0, 1, 0, 0, 0, 0, 0, 0], (8, 8), 3)
  """

  counts: jax.Array
  attend: LayerStats | None


def check_damp(damp: Any) -> float:
  """``damp`` as a float; raises unless it is a finite real number ``>= 0``."""
  if isinstance(damp, bool) or not isinstance(damp, numbers.Real) or not 0 <= damp < math.inf:
    raise ValueError(f"damp must be a float >= 0 and finite (a fraction of the mean Hessian diagonal), got {damp=}.")
  return float(damp)


def check_kernel_and_gram(kernel: Any, gram: Any, *, path: str) -> tuple[jax.Array, jax.Array]:
  """``(kernel, gram)`` as arrays; raises naming ``path`` unless they are ``(K, N)`` and ``(K, K)``."""
  kernel, gram = jnp.asarray(kernel), jnp.asarray(gram)
  if kernel.ndim != 2:
    raise ValueError(f"{path}: kernel must be 2-D (K, N), got shape {kernel.shape}; pass kernel.reshape(K, N).")
  k = kernel.shape[0]
  if gram.shape != (k, k):
    raise ValueError(f"{path}: gram must be (K, K) = {(k, k)} for a kernel of shape {kernel.shape}, got {gram.shape}.")
  return kernel, gram


def check_layer_spec(spec: Any, shape: tuple[int, ...], *, path: str) -> None:
  """Raises naming ``path`` when ``spec`` is not a structure or cannot apply to a kernel of ``shape``.

  ``shape`` is ``(K, N)`` for a dense layer, the kernel's own shape for a convolution (N:M groups run
  along its input channels, axis -2).
  """
  check_structure(spec, path=path)
  check_spec_applies(spec, shape, path=path)
  check_plain_nm(spec, path=path, what="calibrated pruning")


def table_spec(spec: Any) -> Any:
  """The structure of a table ``(num_embeddings, features)`` on its ``attend`` kernel ``(features, num_embeddings)``.

  N:M groups run along the features in both (the groups :class:`jaxsparse.layers.CompressedNMEmbed` keeps); a block
  of ``(rows, features)`` of the table is a block of ``(features, rows)`` of the kernel.
  """
  if isinstance(spec, BlockSparse):
    return BlockSparse(density=spec.density, block_shape=spec.block_shape[::-1])
  return spec


# -------------------------------------------------------------------------------------------------
# Which layers: NNX and Linen.
# -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConvPatches:
  """How a convolution sees its input: im2col rows ``(T, prod(kernel_size) * cin)``, channels innermost.

  Row ``t`` holds the input window of output position ``t`` in the order of the kernel's leading axes
  ``(*kernel_size, cin)``, so ``rows @ kernel.reshape(-1, cout)`` is the convolution (bias aside).
  Fields as in ``nnx.Conv`` / ``nn.Conv``, canonical (tuples; padding a string or ``(low, high)`` pairs).
  """

  kernel_size: tuple[int, ...]
  strides: tuple[int, ...]
  padding: str | tuple[tuple[int, int], ...]
  input_dilation: tuple[int, ...]
  kernel_dilation: tuple[int, ...]

  @classmethod
  def of(cls, conv: Any) -> ConvPatches:
    """The patches of an ``nnx.Conv`` or ``nn.Conv`` (same field names), before any call."""
    size = (conv.kernel_size,) if isinstance(conv.kernel_size, int) else tuple(conv.kernel_size)

    def each(v: Any) -> tuple[int, ...]:
      v = 1 if v is None else v
      return (int(v),) * len(size) if isinstance(v, int) else tuple(int(d) for d in v)

    padding = conv.padding
    if isinstance(padding, int):
      padding = ((padding, padding),) * len(size)
    elif not isinstance(padding, str):
      padding = tuple((p, p) if isinstance(p, int) else tuple(p) for p in padding)
    return cls(size, each(conv.strides), padding, each(conv.input_dilation), each(conv.kernel_dilation))

  def __call__(self, x: jax.Array, dtype: jax.typing.DTypeLike = jnp.float32) -> jax.Array:
    nd = len(self.kernel_size)
    cin = x.shape[-1]
    x = x.reshape((-1, *x.shape[-(nd + 1):])).astype(dtype)  # batch dims as one, as Flax does
    padding = self.padding
    if padding in ("CIRCULAR", "REFLECT"):  # Flax pads the input itself for these, then runs VALID
      dilated = [(k - 1) * d + 1 for k, d in zip(self.kernel_size, self.kernel_dilation, strict=True)]
      pads = [(0, 0), *(((k - 1) // 2, k // 2) for k in dilated), (0, 0)]
      x = jnp.pad(x, pads, mode={"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding])
      padding = "VALID"
    elif padding == "CAUSAL":
      x = jnp.pad(x, [(0, 0), (self.kernel_dilation[0] * (self.kernel_size[0] - 1), 0), (0, 0)])
      padding = "VALID"
    spec = (0, nd + 1, *range(1, nd + 1))  # channels last, as Flax's convolutions
    dims = jax.lax.ConvDimensionNumbers(spec, (nd + 1, nd, *range(nd)), spec)
    p = jax.lax.conv_general_dilated_patches(
        x, self.kernel_size, self.strides, padding if isinstance(padding, str) else list(padding),
        lhs_dilation=self.input_dilation, rhs_dilation=self.kernel_dilation, dimension_numbers=dims,
        precision=_HIGHEST)
    # The patches' features run (cin, *kernel_size); the kernel's leading axes (*kernel_size, cin).
    window = math.prod(self.kernel_size)
    return p.reshape(-1, cin, window).transpose(0, 2, 1).reshape(-1, window * cin)


class Candidate(NamedTuple):
  """A layer a rule may select: key in the module tree, kernel shape (one layer's), number of its input axes.

  ``patches``: a convolution's im2col (``None`` for dense layers); ``unsupported``: why the layer
  cannot be calibrated, raised only if a rule selects it; ``table``: an embedding table, ``kernel_shape``
  ``(num_embeddings, features)``, taken only by a rule that matches no other candidate (as in
  :func:`jaxsparse.sparsify`); ``stack``: the leading layer axes of a stack of layers (``nnx.vmap`` / ``nn.scan``
  over layers; the kernel is stored ``(*stack, *kernel_shape)``), ``root`` the parts of ``key`` above the stack
  (:func:`._calibration_stacks.stack_root`), ``scans`` the ``(axis, reverse)`` of each layer axis a scan of the model
  runs over, outermost first (:func:`._calibration_stacks.scan_axes`).
  """

  key: tuple
  kernel_shape: tuple[int, ...]
  n_in: int
  patches: ConvPatches | None = None
  unsupported: str | None = None
  table: bool = False
  stack: tuple[int, ...] = ()
  root: int = 0
  scans: tuple[tuple[int, bool], ...] = ()


@dataclasses.dataclass(frozen=True)
class Layer:
  """A selected layer: dotted path, its key in the module tree, structure and kernel shapes.

  An embedding table (``table``) has ``kernel_shape`` ``(num_embeddings, features)`` and ``(k, n)`` those of its
  ``attend`` kernel, ``(features, num_embeddings)``; ``spec`` is given on the table (blocks ``(rows, features)``).
  """

  path: str
  key: tuple
  spec: Any
  kernel_shape: tuple[int, ...]  # one layer's (a stack stores (*stack, *kernel_shape))
  k: int  # flattened input features
  n: int  # flattened output features
  patches: ConvPatches | None = None  # a convolution's im2col
  table: bool = False  # an embedding table
  stack: tuple[int, ...] = ()  # leading layer axes of a stack of layers, () for a plain layer
  root: int = 0  # parts of key above the stack (Candidate.root)
  scans: tuple[tuple[int, bool], ...] = ()  # (axis, reverse) of the layer axes the model scans over (Candidate.scans)
  index: tuple[int, ...] | None = None  # one layer of the stack, as pruning takes it

  @property
  def name(self) -> str:
    """The path, and for one layer of a stack its index: ``"blocks.fc[3]"``."""
    return self.path if self.index is None else f"{self.path}[{', '.join(map(str, self.index))}]"

  @property
  def unstacked_path(self) -> str:
    """The path one layer of a stack would have unstacked, its index after the stack's module: ``"blocks.3.fc"``."""
    if self.index is None:
      return self.path
    return dotted_path((*self.key[: self.root], *self.index, *self.key[self.root:]))

  def rows(self, x: jax.Array, dtype: jax.typing.DTypeLike = jnp.float32) -> jax.Array:
    """The layer's ``(T, K)`` inputs from one call's input ``x``, in ``dtype``."""
    if self.patches is not None:
      return self.patches(x, dtype)
    return x.reshape(-1, self.k).astype(dtype)


def dotted_path(key: Sequence[Any]) -> str:
  return ".".join(str(k) for k in key)


def resolve_layers(candidates: Sequence[Candidate], rules: Any, *, what: str) -> list[Layer]:
  """The candidates that a non-``None`` rule selects, checked.

  Raises ``ValueError`` when a rule matches none of the candidates (a typo would otherwise leave
  layers dense without notice), when a selected layer is not supported, or when nothing is selected.
  An embedding table (``Candidate.table``) takes the first rule that fully matches its path only when that rule
  matches no other candidate (a rule naming it, ``"embed"``), as in :func:`jaxsparse.sparsify`: catch-all rules
  leave tables dense.
  """
  resolved = resolve_rules(rules)
  paths = [dotted_path(c.key) for c in candidates]
  layer_paths = [p for c, p in zip(candidates, paths, strict=True) if not c.table]
  unused = [pattern for pattern, compiled, _ in resolved if not any(compiled.fullmatch(p) for p in paths)]
  if unused:
    raise ValueError(f"rule(s) {unused} match no {what}; its layers are: {', '.join(paths) or '(none)'}.")
  layers = []
  for c, path in zip(candidates, paths, strict=True):
    r = match_rules(resolved, path)
    spec = None if r is None else resolved[r][2]
    if spec is None or (c.table and any(resolved[r][1].fullmatch(q) for q in layer_paths)):
      continue
    if c.unsupported is not None:
      raise ValueError(f"{path or '(model)'}: {c.unsupported}; exclude it with a None rule.")
    if c.table and c.stack:
      raise ValueError(f"{path or '(model)'}: a stack of {math.prod(c.stack)} embedding tables (stored "
                       f"{(*c.stack, *c.kernel_shape)}, leading layer axes {c.stack}) is not supported by calibrated "
                       "pruning; exclude it with a None rule, or prune it by magnitude (pruning.magnitude_masks).")
    if c.table:
      check_table_spec(spec, c.kernel_shape, path=path or "(model)")
      rows, features = c.kernel_shape
      layers.append(Layer(path, tuple(c.key), spec, tuple(c.kernel_shape), features, rows, table=True))
      continue
    shape = c.kernel_shape
    k, n = matrix_shape(shape, c.n_in)
    if c.patches is not None and isinstance(spec, BlockSparse):
      raise ValueError(f"{path}: BlockSparse does not apply to convolutions (as in jaxsparse.sparsify); use "
                       "jaxsparse.NM(...) or jaxsparse.Unstructured(...), or give this path another rule.")
    check_layer_spec(spec, shape if c.patches is not None else (k, n), path=path)
    layers.append(Layer(path, tuple(c.key), spec, tuple(shape), k, n, c.patches, stack=c.stack, root=c.root,
                        scans=c.scans))
  if not layers:
    raise ValueError(f"rules select no {what} (every match maps to None); nothing to prune.")
  return layers


def conv_candidate(key: tuple, conv: Any, kernel_shape: tuple[int, ...], what: str) -> Candidate:
  if conv.feature_group_count != 1:
    return Candidate(key, kernel_shape, len(kernel_shape) - 1, unsupported=(
        f"{what} with feature_group_count={conv.feature_group_count} (a grouped convolution) is not supported; "
        "only feature_group_count=1"))
  if conv.mask is not None:
    return Candidate(key, kernel_shape, len(kernel_shape) - 1, unsupported=(
        f"{what} with a Flax weight mask is not supported; fold the mask into the kernel first"))
  return Candidate(key, kernel_shape, len(kernel_shape) - 1, patches=ConvPatches.of(conv))


def _add_stats(acc: LayerStats, xs: list[jax.Array], layer: Layer, gram: bool, weights: jax.Array | None,
               kernel_dtype: Any) -> LayerStats:
  # The sums' dtype: float32, float64 when the layer's kernel or inputs (or the sums so far) are float64.
  dtype = _utils.accumulation_dtype(acc.sq_norms.dtype, kernel_dtype, *(x.dtype for x in xs))
  rows = []
  for x in xs:
    x = layer.rows(x, dtype)
    w = _token_weights(weights, x.shape[0], layer)
    if w is not None:
      x = jnp.where(w[:, None], x, 0)  # any nonzero value counts the token once
    rows.append(x)
  x = jnp.concatenate(rows)
  count = x.shape[0] if weights is None else len(xs) * jnp.sum(weights != 0, dtype=jnp.int32)
  return LayerStats(
      acc.sq_norms.astype(dtype) + jnp.sum(x * x, axis=0),
      acc.gram.astype(dtype) + jnp.matmul(x.T, x, precision=_HIGHEST) if gram else None,
      acc.tokens + count,
  )


def _token_weights(weights: jax.Array | None, size: int, layer: Layer) -> jax.Array | None:
  """``token_mask``'s weights as a flat bool array over ``size`` tokens (None: every token counts)."""
  if weights is None:
    return None
  if weights.size != size:
    raise ValueError(f"{layer.path}: token_mask gives {weights.size} weights per batch but the layer sees {size} "
                     "tokens; the mask must have the shape of the layer input without its features.")
  return weights.reshape(-1) != 0


def _add_table_stats(acc: TableStats, ids: list[jax.Array], queries: list[jax.Array], layer: Layer,
                     weights: jax.Array | None, table_dtype: Any) -> TableStats:
  """Adds the token counts of the lookups' ``ids`` and the statistics of the ``attend`` ``queries``."""
  counts = acc.counts
  for x in ids:
    x = jnp.asarray(x).reshape(-1)
    w = _token_weights(weights, x.size, layer)
    ones = jnp.ones(x.shape, jnp.int32) if w is None else w.astype(jnp.int32)
    counts = counts.at[x].add(ones, mode="drop")  # negative ids count from the end, out-of-range ones not at all
  attend = acc.attend
  if queries:  # always with the Gram matrix: a tied table's pruning needs it (F x F, small beside the table)
    start = zero_layer_stats(layer.k, True, jnp.float32) if attend is None else attend
    attend = _add_stats(start, queries, layer, True, weights, table_dtype)
  return TableStats(counts, attend)


def zero_layer_stats(k: int, gram: bool, dtype: jax.typing.DTypeLike, stack: tuple[int, ...] = ()) -> LayerStats:
  return LayerStats(jnp.zeros((*stack, k), dtype), jnp.zeros((*stack, k, k), dtype) if gram else None,
                    jnp.zeros(stack, jnp.int32))


def _zero_stats(layer: Layer, gram: bool) -> LayerStats | TableStats:
  if layer.table:
    return TableStats(jnp.zeros((layer.n,), jnp.int32), None)
  return zero_layer_stats(layer.k, gram, jnp.float32, layer.stack)


def accumulators(step: Callable, state: Any, layers: Sequence[Layer], batch: Any, gram: bool) -> dict[str, LayerStats]:
  """Zero statistics in the dtypes ``step`` accumulates in: float32, float64 for float64 kernels or inputs.

  The dtypes of the layers' kernels and inputs are known once the model is traced: ``step`` is traced (not run) on
  ``batch`` from float32 zeros, and gives back the dtypes it keeps (for float32 ones jit reuses this trace).
  """
  acc = {layer.path: _zero_stats(layer, gram) for layer in layers}
  with naming_batch(0):
    shapes = jax.eval_shape(step, state, acc, batch)
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def check_batches(batches: Any) -> list:
  """``batches`` as a list; raises on one array (it would be iterated row by row), a mapping or an empty list."""
  if isinstance(batches, (jax.Array, np.ndarray, Mapping)) or not hasattr(batches, "__iter__"):
    raise TypeError(f"batches must be a sequence of model inputs (a list of batches), got {type(batches).__name__}; "
                    "wrap a single batch in a list: [x].")
  batches = list(batches)
  if not batches:
    raise ValueError("batches is empty: calibration needs at least one batch of inputs.")
  return batches


@contextlib.contextmanager
def naming_batch(i: int):
  """Adds a note naming ``batches[i]`` to an error raised while the model runs on it (e.g. a wrong input shape)."""
  try:
    yield
  except Exception as e:
    e.add_note(f"(raised while running the model on the calibration input batches[{i}])")
    raise


def _flags(s: LayerStats | TableStats) -> tuple[jax.Array, jax.Array]:
  """``(tokens, finite)`` of one layer's statistics: a stack's tokens those of its layer with the fewest; a table's
  those of its ``attend`` queries when the model calls ``attend``, else of its lookups (always finite)."""
  if isinstance(s, TableStats):
    if s.attend is None:
      return jnp.sum(s.counts), jnp.bool_(True)
    s = s.attend
  finite = jnp.all(jnp.isfinite(s.sq_norms))
  if s.gram is not None:
    finite &= jnp.all(jnp.isfinite(s.gram))
  return jnp.min(s.tokens), finite


def check_stats(stats: Mapping[str, LayerStats | TableStats], layers: Sequence[Layer],
                first_non_finite: Callable[[str], int | None] | None = None) -> None:
  """Raises naming the layer when its statistics count no tokens or are not finite (NaN/inf inputs).

  ``first_non_finite(path)``, if given, finds the batch from which the statistics of ``path`` are not finite; the
  error names it. It runs only on that error.
  """
  summary = jax.device_get({layer.path: _flags(stats[layer.path]) for layer in layers})  # one transfer
  for layer in layers:
    tokens, finite = summary[layer.path]
    if tokens == 0 and layer.stack:
      raise ValueError(f"{layer.path or '(model)'}: batches give a layer of this stack of layers (leading layer axes "
                       f"{layer.stack}) 0 calibration tokens: empty batches, a token_mask that marks every token as "
                       "padding, or a model that does not call each layer of the stack under a transform over its "
                       "layer axes (nnx.scan / nn.scan) but slices the stack itself.")
    if tokens == 0:
      raise ValueError(f"{layer.path or '(model)'}: batches give this layer 0 calibration tokens (empty batches, or a "
                       "token_mask that marks every token as padding); its statistics would be all zero.")
    if not finite:
      i = None if first_non_finite is None else first_non_finite(layer.path)
      where = "" if i is None else f"first in batches[{i}]: "
      raise ValueError(f"{layer.path or '(model)'}: the inputs this layer sees on the calibration batches contain "
                       f"NaN or inf ({where}in the batch itself, or produced by the model before this layer, or too "
                       f"large to square in {_sums_dtype(stats[layer.path])}); masks and weights computed from them "
                       "would be meaningless. Check that batch, or leave it out.")


def _sums_dtype(s: LayerStats | TableStats) -> Any:
  return (s.attend if isinstance(s, TableStats) else s).sq_norms.dtype


def step_stats(acc: Mapping, layers: Sequence[Layer], xs: Mapping[tuple, list], queries: Mapping[tuple, list],
                gram: bool, weights: jax.Array | None, dtypes: Mapping[tuple, Any], what: str,
                stacked: Mapping[tuple, LayerStats]) -> dict:
  """One batch's update of the statistics of ``layers``, from their recorded inputs (a table: lookups' ids in ``xs``,
  ``attend`` queries in ``queries``); a stack's, summed while the model ran (``stacked``; its calls in ``xs``, as
  ``None``)."""
  out = {}
  for layer in layers:
    if not xs[layer.key] and not queries.get(layer.key):
      raise ValueError(f"{layer.path}: the {what} does not call this layer on a calibration batch.")
    if layer.stack:
      out[layer.path] = stacked[layer.key]
    elif layer.table:
      out[layer.path] = _add_table_stats(acc[layer.path], xs[layer.key], queries[layer.key], layer, weights,
                                         dtypes[layer.key])
    else:
      out[layer.path] = _add_stats(acc[layer.path], xs[layer.key], layer, gram, weights, dtypes[layer.key])
  return out


def stack_update(layer: Layer, gram: bool, weights: jax.Array | None, kernel_dtype: Any, calls: list) -> Callable:
  """``(stats, x) -> stats``: one layer of the stack ``layer`` adds one call's input ``x`` (inside the model's
  transform over the layers) to its ``(sq_norms, gram, tokens)``; the call is recorded in ``calls`` (as ``None``:
  ``x`` cannot leave the transform)."""
  def update(stats: tuple, x: jax.Array) -> LayerStats:
    calls.append(None)
    return _add_stats(LayerStats(*stats), [x], layer, gram, weights, kernel_dtype)

  return update


def stack_check(layer: Layer, how: str) -> Callable[[tuple[int, ...]], None]:
  """Raises (:func:`whole_stack_message`) when one call of the stack ``layer`` sees statistics of ``shape`` other
  than one layer's ``(K,)``."""
  def check(shape: tuple[int, ...]) -> None:
    if tuple(shape) != (layer.k,):
      raise ValueError(whole_stack_message(layer.path, layer.stack, layer.kernel_shape, tuple(shape), layer.k, how))

  return check


def run_steps(step: Callable, state: Any, layers: Sequence[Layer], batches: Sequence[Any], gram: bool) -> dict:
  """The statistics of ``layers`` over ``batches``: ``step(state, acc, batch)`` jitted, run on each batch from zero
  statistics, the sums checked (:func:`check_stats`)."""
  step = jax.jit(step, donate_argnums=1)
  acc = accumulators(step, state, layers, batches[0], gram)
  for i, batch in enumerate(batches):
    with naming_batch(i):
      acc = step(state, acc, batch)

  def first_non_finite(path: str) -> int | None:
    # Only on that error: the sums again, from zero, checked after each batch (once not finite they stay so).
    again = accumulators(step, state, layers, batches[0], gram)
    for i, batch in enumerate(batches):
      again = step(state, again, batch)
      if not bool(_flags(again[path])[1]):
        return i
    return None

  check_stats(acc, layers, first_non_finite)
  return acc
