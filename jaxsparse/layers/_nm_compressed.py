"""The inference form of the N:M layers: ``CompressedNMLinear`` and its cuSPARSELt variables.

:meth:`NMLinear.to_compressed <jaxsparse.layers.NMLinear.to_compressed>` (or :func:`jaxsparse.compress` for a whole
model) builds a :class:`CompressedNMLinear`: the kept values and their packed positions, multiplied with
:func:`jaxsparse.ops.nm_matmul`; on a CUDA GPU a 2:4 bfloat16 layer may also keep its kernel in cuSPARSELt's layout
(:class:`CusparseLtWeight`, a copy, or :class:`CusparseLtKernel`, the weight itself). :class:`NMPositionsLayer` (its
and ``CompressedNMEmbed``'s mixin) checks the positions ``nnx.merge`` builds the layer with.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.typing import Dtype
from jax import lax

from jaxsparse import _utils
from jaxsparse import ops
from jaxsparse.formats._nm import NMSparseMatrix
from jaxsparse.layers._checks import NM_LAYOUT
from jaxsparse.layers._checks import NMLayout
from jaxsparse.layers._checks import check_compressed_parts
from jaxsparse.layers._checks import check_dtypes
from jaxsparse.layers._checks import check_loaded_positions
from jaxsparse.layers._checks import check_positions
from jaxsparse.layers._checks import check_real_dtypes
from jaxsparse.layers._common import COMPRESSED_VALUES
from jaxsparse.layers._common import SparsityPattern
from jaxsparse.layers._common import bias_of
from jaxsparse.layers._common import check_layer_inputs
from jaxsparse.layers._common import check_one_layer
from jaxsparse.layers._common import with_weights
from jaxsparse.layers._partitioning import carry_back_nnx
from jaxsparse.layers._partitioning import structure_metadata
from jaxsparse.ops import _nm_matmul

__all__ = ["CompressedNMLinear", "CusparseLtKernel", "CusparseLtWeight", "NMPositionsLayer", "check_nm_implementation"]


class CusparseLtKernel(nnx.Variable):
  """A 2:4 kernel kept only as one buffer in cuSPARSELt's compressed layout (``uint8``): the weight itself.

  :class:`CompressedNMLinear` built with ``storage="cusparselt"`` keeps its kernel as ``kernel_buffer``, this
  variable: the kept values, then cuSPARSELt's metadata of their positions, written by jaxsparse on any device (a
  float16 weight's then 16 bytes that mark float16, so that it is never read as bfloat16's of the same size).
  Unlike :class:`CusparseLtWeight` (a copy, rebuilt with the layer) it is the layer's weight and belongs in
  checkpoints; it is not an ``nnx.Param`` and is not trained.

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> from flax import nnx
  >>> from jaxsparse.layers import CompressedNMLinear, CusparseLtKernel
  >>> w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(jax.random.key(0), (64, 128), jnp.bfloat16), 2, 4)
  >>> layer = CompressedNMLinear(w, storage="cusparselt")
  >>> sorted(nnx.state(layer).keys()), layer.kernel_buffer[...].shape, layer.kernel_buffer[...].dtype
  (['kernel_buffer'], (9216,), dtype('uint8'))
  >>> bool((layer.weight.to_dense() == w.to_dense()).all())
  True
  """


class CusparseLtWeight(nnx.Variable):
  """A 2:4 kernel in cuSPARSELt's compressed layout (``uint8``): a cache, not a parameter.

  :class:`CompressedNMLinear` keeps one as ``kernel_cusparselt`` on a CUDA GPU with cuSPARSELt (2:4, bfloat16);
  elsewhere that attribute is ``None``. Being no ``nnx.Param``, it is not trained; leave it out of checkpoints
  with ``nnx.state(model, nnx.Not(CusparseLtWeight))`` (it is rebuilt with the layer). The lines that read it
  need such a GPU and are skipped in the doctests (which run on CPU).

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> from flax import nnx
  >>> from jaxsparse.layers import CompressedNMLinear, CusparseLtWeight
  >>> issubclass(CusparseLtWeight, nnx.Param)
  False
  >>> w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(jax.random.key(0), (64, 32), jnp.bfloat16), 2, 4)
  >>> layer = CompressedNMLinear(w)
  >>> sorted(nnx.state(layer, nnx.Not(CusparseLtWeight)).keys())
  ['kernel', 'kernel_positions']
  >>> isinstance(layer.kernel_cusparselt, CusparseLtWeight), layer.kernel_cusparselt[...].dtype  # doctest: +SKIP
  (True, dtype('uint8'))
  """


def check_nm_implementation(implementation: object) -> str | None:
  """``implementation`` of :func:`jaxsparse.ops.nm_matmul`: ``None``, ``"xla"``, ``"pallas"`` or ``"cusparselt"``."""
  allowed = (None, *typing.get_args(ops.NMImplementation))
  if implementation not in allowed:
    raise ValueError(f"implementation must be one of {allowed}, got implementation={implementation!r}.")
  return implementation


class NMPositionsLayer:
  """Mixin of the NNX layers that hold packed N:M positions (``CompressedNMLinear``, ``CompressedNMEmbed``): a layer
  that ``nnx.merge`` builds from a (restored) state checks its concrete positions there, before any ``jit`` reads them.

  ``nnx.jit`` and the other transforms rebuild their input layers from the outputs after every call (Flax clears the
  layer, then initializes it again): those are not checked, or each call would read the positions.
  """

  _positions_attr: typing.ClassVar[str]

  def _positions_layout(self) -> NMLayout:
    """What the positions must be valid for (one layer's; a stack's have leading axes)."""
    raise NotImplementedError

  def _graph_node_clear(self) -> None:
    super()._graph_node_clear()
    object.__setattr__(self, _REBUILT, True)

  def _graph_node_init(self, attributes: Any) -> None:
    rebuilt = vars(self).pop(_REBUILT, False)
    super()._graph_node_init(attributes)
    positions = vars(self).get(self._positions_attr)
    if not rebuilt and isinstance(positions, SparsityPattern):
      check_positions(self._positions_layout(), positions.get_raw_value())


_REBUILT = "_jaxsparse_rebuilt"  # set on a layer Flax cleared to initialize again (a transform's outputs)


class CompressedNMLinear(NMPositionsLayer, nnx.Module):
  """Inference form of :class:`NMLinear`: ``y = nm_matmul(x, W) + b`` with ``W`` stored compressed.

  Built by :meth:`NMLinear.to_compressed`. ``kernel`` holds the kept values, an ``nnx.Param`` of
  shape ``(in_features * n // m, out_features)`` that can still be fine-tuned
  (:func:`jaxsparse.ops.nm_matmul` differentiates it); ``kernel_positions`` the packed positions, a
  non-trainable :class:`SparsityPattern`. On CUDA GPUs with few rows (decode) the product reads
  the compressed weight in a Pallas kernel; elsewhere it expands it and runs a dense product. The ``kernel`` param
  carries the metadata ``nm_compressed="CompressedNMLinear"``, so that the pruners (:mod:`jaxsparse.pruning`)
  refuse to prune the kept values as a dense kernel even where they see the parameters without the layer
  (``nnx.state(model, nnx.Param)``, an ``nnx.Optimizer``).

  On a CUDA GPU with cuSPARSELt, a 2:4 bfloat16 layer also keeps ``kernel_cusparselt``,
  the kernel in cuSPARSELt's layout (a non-trainable :class:`CusparseLtWeight`, built when the
  layer is), and multiplies more than 64 rows on sparse tensor cores with it. It is a copy of
  ``kernel``: after changing ``kernel`` (fine-tuning) call :meth:`update_cusparselt`, or the
  forward product keeps using the old values.

  Memory: the values and packed positions of a 2:4 bfloat16 kernel take 0.5625x the dense kernel's bytes;
  the cuSPARSELt copy adds as much again (1.125x dense in all). ``cusparselt_copy=False`` keeps
  the layer at 0.5625x: decode-size products (the ``mma.sp`` and Pallas kernels read ``kernel``) are
  unchanged, while products of many rows (prefill) either compress ``kernel`` for cuSPARSELt in each call
  or take another route, whichever the measured dispatch finds faster.

  ``storage="cusparselt"`` keeps the weight once, as that buffer (``kernel_buffer``, a :class:`CusparseLtKernel`:
  values, then cuSPARSELt's metadata, written by jaxsparse on any device): 0.5625x dense, and on a GPU whose
  cuSPARSELt reads that layout both the ``mma.sp`` decode kernel and cuSPARSELt's sparse tensor-core product read
  it as it is (prefill without the compression of ``cusparselt_copy=False``). The layer then has no ``kernel`` /
  ``kernel_positions`` / ``kernel_cusparselt``: :attr:`weight` (and
  :meth:`to_dense`) unpack the buffer, routes that need the values alone (the Pallas kernel, the XLA path, and
  every route where cuSPARSELt's layout differs) unpack it in the call, and the weight is not trainable. For
  inference of 2:4 layers with ``in_features`` a multiple of 32 and ``out_features`` of 64. The values' dtype is the
  layer's (``kernel_buffer_dtype``, static); a float16 buffer ends with 16 bytes that mark it, so that a checkpoint
  of a float16 layer restored into a bfloat16 one (or back) is refused by its size instead of read in the wrong
  dtype (bfloat16 and float16 values take the same bytes).

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> from jaxsparse.layers import CompressedNMLinear
  >>> w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(jax.random.key(0), (64, 32)), 2, 4)
  >>> CompressedNMLinear(w)(jnp.ones((3, 64))).shape
  (3, 32)

  Args:
    weight: a 2-D :class:`jaxsparse.NMSparseMatrix` ``(in_features, out_features)``.
    bias: ``(out_features,)`` or ``None``.
    dtype, precision, promote_dtype, preferred_element_type: as ``nnx.Linear``. Real dtypes only (``weight``,
      ``dtype`` and the inputs; integer inputs are promoted): complex ones raise ``TypeError``.
    implementation: backend of :func:`jaxsparse.ops.nm_matmul`.
    cusparselt_copy: keep the cuSPARSELt copy ``kernel_cusparselt`` where it can be built (faster products of
      many rows, about twice the memory); ``False`` never builds one. Only with ``storage="values"``.
    storage: ``"values"`` (``kernel`` and ``kernel_positions``, trainable), ``"cusparselt"`` (the one buffer
      ``kernel_buffer``, described above) or ``"auto"``: ``"cusparselt"`` where the buffer can hold the weight,
      the compute dtype is the weight's, ``implementation`` is ``None`` or ``"cusparselt"`` and cuSPARSELt on the
      default GPU reads the buffer as its own, else ``"values"`` (the layer's ``storage`` attribute says which).

  Raises:
    TypeError: a complex ``weight`` or ``dtype``.
    ValueError: ``storage="cusparselt"`` for a weight it cannot hold (not 2:4 along ``in_features``, or the
      sizes above), or an unknown ``storage``.
  """

  _positions_attr = "kernel_positions"

  def __init__(
      self,
      weight: NMSparseMatrix,
      bias: jax.Array | None = None,
      *,
      dtype: Dtype | None = None,
      precision: lax.PrecisionLike = None,
      promote_dtype: Callable[..., Any] = dtypes.promote_dtype,
      preferred_element_type: Dtype | None = None,
      implementation: ops.NMImplementation | None = None,
      cusparselt_copy: bool = True,
      storage: typing.Literal["values", "cusparselt", "auto"] = "values",
  ):
    if not isinstance(weight, NMSparseMatrix) or weight.ndim != 2:
      what = repr(weight) if isinstance(weight, NMSparseMatrix) else type(weight).__name__
      if hasattr(weight, "shape") and not isinstance(weight, NMSparseMatrix):
        what += f" of shape {tuple(weight.shape)}"
      raise TypeError(f"weight must be a 2-D jaxsparse.NMSparseMatrix, got {what}; NMSparseMatrix.from_dense builds "
                      "one from a dense (in_features, out_features) kernel.")
    check_dtypes(type(self), dtype=dtype, inexact=promote_dtype is dtypes.promote_dtype)
    _utils.check_precision(precision, owner=type(self).__name__)
    check_real_dtypes(type(self), **{"weight.dtype": weight.dtype, "dtype": dtype})
    if bias is not None and jnp.shape(bias) != (weight.shape[1],):
      raise ValueError(
          f"bias must have shape (out_features,) = ({weight.shape[1]},) for weight of shape {weight.shape}, got "
          f"{jnp.shape(bias)}."
      )
    if storage not in ("values", "cusparselt", "auto"):
      raise ValueError(f"storage must be 'values', 'cusparselt' or 'auto', got storage={storage!r}.")
    reason = _nm_matmul.buffer_unsupported_reason(weight) if storage != "values" else ""
    if storage == "auto":
      pays = (not reason and (dtype is None or jnp.dtype(dtype) == weight.dtype)
              and check_nm_implementation(implementation) in (None, "cusparselt")
              and _nm_matmul.buffer_is_cusparselt(*weight.shape, weight.dtype))
      storage = "cusparselt" if pays else "values"
    elif reason:
      raise ValueError(f"storage='cusparselt': {reason}.")
    self.storage = storage
    self.in_features, self.out_features = weight.shape
    self.n, self.m, self.axis = weight.n, weight.m, weight.axis
    self.kernel: nnx.Param[jax.Array] | None = nnx.data(None)
    self.kernel_positions: SparsityPattern | None = nnx.data(None)
    if storage == "values":
      self.kernel = nnx.Param(weight.values, **{COMPRESSED_VALUES: type(self).__name__})
      self.kernel_positions = SparsityPattern(weight.indices, **{NM_LAYOUT: self._positions_layout()})
    self.bias: nnx.Param[jax.Array] | None = nnx.data(None) if bias is None else nnx.Param(jnp.asarray(bias))
    self.dtype = dtype
    self.precision = precision
    self.promote_dtype = promote_dtype
    self.preferred_element_type = preferred_element_type
    self.implementation = check_nm_implementation(implementation)
    if not isinstance(cusparselt_copy, bool):
      raise TypeError(f"cusparselt_copy must be True or False, got cusparselt_copy={cusparselt_copy!r}.")
    self.cusparselt_copy = cusparselt_copy
    self.kernel_cusparselt: CusparseLtWeight | None = nnx.data(None)
    self.kernel_buffer: CusparseLtKernel | None = nnx.data(None)
    self.kernel_buffer_dtype = weight.dtype
    if storage == "cusparselt":
      self.kernel_buffer = CusparseLtKernel(_nm_matmul.to_buffer(weight))
    self.update_cusparselt()

  def _positions_layout(self) -> NMLayout:
    """What ``kernel_positions`` must be valid for (one layer's; a stack's have leading axes)."""
    return NMLayout("CompressedNMLinear.kernel_positions", (self.in_features, self.out_features), self.n, self.m,
                    self.axis)

  def update_cusparselt(self) -> bool:
    """(Re)builds ``kernel_cusparselt`` from ``kernel``; returns whether the layer has one.

    Built for 2:4 layers whose compute dtype (``dtype``, else the kernel's) is bfloat16,
    when cuSPARSELt can run here, ``implementation`` is ``None`` or ``"cusparselt"`` and the layer was made
    with ``cusparselt_copy=True``. With ``storage="cusparselt"`` the buffer is the weight: nothing to rebuild
    (returns True). Call it after changing ``kernel`` (fine-tuning, loading): the copy is not updated by itself.
    A training step computes with ``kernel`` (a differentiated forward does not read the copy), but a call
    without gradients after it reads the copy, so rebuild it before inference.

    Returns:
      ``True`` if the layer now has a cuSPARSELt copy (or is stored as one), else ``False``.

    Warns:
      jaxsparse.ops.CusparseLtFallbackWarning: on a CUDA machine, a 2:4 layer that asked for the copy cannot
        have one (no cuSPARSELt, or a shape or dtype it does not take).

    >>> import jax, jaxsparse
    >>> from jaxsparse.layers import CompressedNMLinear
    >>> w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(jax.random.key(0), (64, 32)), 2, 4)
    >>> CompressedNMLinear(w, cusparselt_copy=False).update_cusparselt()  # never builds a copy
    False
    """
    if self.storage == "cusparselt":
      return True
    self.kernel_cusparselt = nnx.data(None)
    self.kernel_cusparselt_dtype = None
    if not self.cusparselt_copy or self.implementation not in (None, "cusparselt") or (self.n, self.m) != (2, 4):
      return False
    w = self.weight
    w = w.with_values(w.values.astype(self.dtype or w.dtype))
    reason = _nm_matmul.cusparselt_unsupported_reason(w)
    if reason:
      _nm_matmul.warn_cusparselt_fallback("CompressedNMLinear", reason)
      return False
    # Named (None,) where the kernel is (as carry_nnx names it): a stack's transform_metadata gives it the stack axis.
    self.kernel_cusparselt = CusparseLtWeight(ops.cusparselt_compress(w),
                                              **structure_metadata(self.kernel, "kernel_cusparselt", 1))
    self.kernel_cusparselt_dtype = w.dtype
    return True

  @property
  def kernel_dtype(self) -> jnp.dtype:
    """The dtype of the kept values, as stored (either ``storage``)."""
    return self.kernel_buffer_dtype if self.storage == "cusparselt" else jnp.dtype(self.kernel.dtype)

  @property
  def weight(self) -> NMSparseMatrix:
    """The compressed ``(in_features, out_features)`` kernel.

    Raises:
      ValueError: this layer is a stack of layers (built by ``nnx.vmap``); read it per layer:
        ``nnx.vmap(lambda layer: layer.weight, in_axes=0, out_axes=0)(stack)``. Or (outside ``jit``, checked once
        per positions array) ``kernel_positions`` that are not valid for the layer's n:m, such as a checkpoint
        of another n:m restored into it: the message names the n:m they fit. Also (static, under ``jit`` too)
        ``kernel`` / ``kernel_positions`` / ``kernel_buffer`` of another shape or dtype than the layer's (a
        restored checkpoint of another layer, positions cast): the message names the variable, its shape and dtype
        and the expected ones.
    """
    check_one_layer(self, what="weight")
    shape = (self.in_features, self.out_features)
    if self.storage == "cusparselt":
      buffer = self.kernel_buffer[...]
      want = (_nm_matmul.buffer_bytes(*shape, self.kernel_buffer_dtype),)
      if tuple(jnp.shape(buffer)) != want or jnp.result_type(buffer) != jnp.uint8:  # static: as restored
        raise ValueError(
            f"CompressedNMLinear.kernel_buffer must be uint8 of shape {want} (the buffer of a {shape} 2:4 "
            f"{jnp.dtype(self.kernel_buffer_dtype)} weight), got {jnp.result_type(buffer)} {tuple(jnp.shape(buffer))}"
            ": a checkpoint of another layer (sizes or dtype), or cast (keep the buffer uint8)?"
        )
      return _nm_matmul.from_buffer(buffer, shape, self.kernel_buffer_dtype)
    check_compressed_parts("CompressedNMLinear.kernel", self.kernel[...], "CompressedNMLinear.kernel_positions",
                           self.kernel_positions[...], shape=shape, n=self.n, m=self.m, axis=self.axis)
    w = NMSparseMatrix(
        self.kernel[...],
        self.kernel_positions[...],
        shape=shape,
        n=self.n,
        m=self.m,
        axis=self.axis,
        validate=False,  # read on every call: check_loaded_positions validates each positions array once
    )
    return check_loaded_positions("CompressedNMLinear.kernel_positions", w)

  def __call__(self, inputs: jax.Array) -> jax.Array:
    """``nm_matmul(inputs, weight) + bias``, the product of :class:`NMLinear` with the same pruned kernel.

    Args:
      inputs: ``(..., in_features)`` (named as ``nnx.Linear``'s).

    Returns:
      ``(..., out_features)``, in ``dtype`` if set, else the promoted dtype of ``inputs`` and the parameters.

    Raises:
      ValueError: ``inputs`` whose last axis is not ``in_features``; a ``bias`` (as restored) of another shape than
        ``(out_features,)``, or the variables :attr:`weight` names.
      TypeError: complex ``inputs``.

    >>> import jax, jax.numpy as jnp, jaxsparse
    >>> from jaxsparse.layers import CompressedNMLinear
    >>> w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(jax.random.key(0), (64, 32)), 2, 4)
    >>> x = jnp.ones((3, 64))
    >>> bool(jnp.allclose(CompressedNMLinear(w)(x), x @ w.to_dense(), atol=1e-5))
    True
    """
    inputs = check_layer_inputs(self, inputs)
    check_real_dtypes(type(self), **{"inputs.dtype": jnp.result_type(inputs)})
    bias = bias_of(self)
    if bias is not None and jnp.shape(bias) != (self.out_features,):  # static: a restored bias would broadcast
      raise ValueError(f"CompressedNMLinear.bias must have shape (out_features,) = ({self.out_features},), got "
                       f"{jnp.result_type(bias)} {tuple(jnp.shape(bias))}: a checkpoint of another layer restored?")
    w = self.weight
    x, values, bias = self.promote_dtype((inputs, w.values, bias), dtype=self.dtype)
    if self.storage == "cusparselt" and x.dtype == values.dtype == self.kernel_buffer_dtype:
      y = _nm_matmul.nm_matmul_buffer(x, self.kernel_buffer[...], w, implementation=self.implementation,
                                      precision=self.precision, preferred_element_type=self.preferred_element_type)
      return y if bias is None else y + bias
    w = w.with_values(values)
    blob = None
    if self.kernel_cusparselt is not None and x.dtype == values.dtype == self.kernel_cusparselt_dtype:
      blob = self.kernel_cusparselt[...]
    y = ops.nm_matmul(
        x,
        w,
        implementation=self.implementation,
        precision=self.precision,
        preferred_element_type=self.preferred_element_type,
        cusparselt_weight=blob,
    )
    return y if bias is None else y + bias

  def to_dense(self) -> nnx.Linear:
    """An ``nnx.Linear`` with the decompressed kernel and the same bias and options.

    Returns:
      An ``nnx.Linear`` computing the same function as this layer. Partitioning names (``nnx.with_partitioning``)
      of kernel and bias carry over (and their placement on a mesh), as :func:`jaxsparse.densify` gives them: the
      kernel's from the kept values (``storage="cusparselt"`` keeps none: only the bias's come back).

    >>> import jax, jax.numpy as jnp, jaxsparse
    >>> from jaxsparse.layers import CompressedNMLinear
    >>> w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(jax.random.key(0), (64, 32)), 2, 4)
    >>> bool((CompressedNMLinear(w).to_dense().kernel[...] == w.to_dense()).all())
    True

    Raises:
      ValueError: this layer is a stack of layers (built by ``nnx.vmap``); call it per layer:
        ``nnx.vmap(lambda layer: layer.to_dense(), in_axes=0, out_axes=0)(stack)``.
    """
    check_one_layer(self, what="to_dense()")
    dense = with_weights(
        nnx.Linear,
        self.weight.to_dense(),
        bias_of(self),
        self.in_features,
        self.out_features,
        use_bias=self.bias is not None,
        dtype=self.dtype,
        precision=self.precision,
        promote_dtype=self.promote_dtype,
        preferred_element_type=self.preferred_element_type,
        rngs=nnx.Rngs(0),
    )
    return carry_back_nnx(self, dense)  # the partitioning names and placement
