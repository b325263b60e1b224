"""``CompressedNMDense``: the Linen inference form of :class:`~jaxsparse.layers.linen.NMDense`.

The Linen twin of :class:`jaxsparse.layers.CompressedNMLinear`: it stores only the kept values of an N:M kernel
(``params.kernel``, ``(in_features * n // m, features)``) and their packed positions (``sparsity.kernel_positions``)
and multiplies them with :func:`jaxsparse.ops.nm_matmul`. :func:`jaxsparse.compress_linen` gives a
:func:`jaxsparse.sparsify_linen` model these layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype as linen_promote_dtype
from flax.linen.linear import default_kernel_init
from flax.typing import Dtype
from flax.typing import Initializer
from jax import lax

from jaxsparse import _utils
from jaxsparse import ops
from jaxsparse.formats import _nm_masks
from jaxsparse.formats._nm import NMSparseMatrix
from jaxsparse.layers._checks import NMLayout
from jaxsparse.layers._checks import check_compressed_parts
from jaxsparse.layers._checks import check_dtypes
from jaxsparse.layers._checks import check_in_features
from jaxsparse.layers._checks import check_init_dtype
from jaxsparse.layers._checks import check_input
from jaxsparse.layers._checks import check_loaded_positions
from jaxsparse.layers._checks import check_positions
from jaxsparse.layers._checks import check_real_dtypes
from jaxsparse.layers._checks import check_use_bias
from jaxsparse.layers._checks import linen_positions_name
from jaxsparse.layers._common import SPARSITY
from jaxsparse.layers._common import check_known_in_features
from jaxsparse.layers._common import check_pattern
from jaxsparse.layers._common import existing_shape
from jaxsparse.layers._common import map_boxed
from jaxsparse.layers._embed_linen import CompressedNMEmbed
from jaxsparse.layers._nm_compressed import check_nm_implementation
from jaxsparse.layers._partitioning import box_structure

__all__ = ["CompressedNMDense", "check_restored"]


class CompressedNMDense(nn.Module):
  """Linen ``nn.Dense`` whose N:M-sparse kernel is stored compressed: ``y = nm_matmul(x, W) + b``.

  The inference form of :class:`~jaxsparse.layers.linen.NMDense` (and the Linen twin of
  :class:`jaxsparse.layers.CompressedNMLinear`): it keeps only the kernel's kept values and their positions in each
  group of ``m`` input features, 0.5625x the dense kernel's bytes for 2:4 in bfloat16, and multiplies them with
  :func:`jaxsparse.ops.nm_matmul` (on a CUDA GPU its N:M kernels; elsewhere a dense product of the expanded kernel).
  :func:`jaxsparse.compress_linen` turns the ``NMDense`` layers of a :func:`jaxsparse.sparsify_linen` model into
  these. Unlike the NNX layer it keeps no cuSPARSELt copy or buffer of the kernel (``CompressedNMLinear``'s
  ``cusparselt_copy`` / ``storage="cusparselt"``): ``nm_matmul`` compresses for cuSPARSELt in the call where that
  route is taken.

  Variables: ``{"params": {"kernel": (in_features * n // m, features), "bias": (features,)},
  "sparsity": {"kernel_positions": packed positions}}``, the layout of :class:`jaxsparse.NMSparseMatrix`'s
  ``values`` / ``indices`` grouped along axis 0. ``init`` draws a dense kernel with ``kernel_init`` and keeps its
  ``n`` largest-magnitude weights of every ``m`` (it works under ``jax.eval_shape``). The kept values are trainable
  (``nm_matmul`` differentiates them); the positions are not.

  >>> import jax, jax.numpy as jnp
  >>> from jaxsparse.layers.linen import CompressedNMDense
  >>> model = CompressedNMDense(32, n=2, m=4)
  >>> variables = model.init(jax.random.key(0), jnp.ones((1, 64)))
  >>> jax.tree.map(jnp.shape, variables)
  {'params': {'bias': (32,), 'kernel': (32, 32)}, 'sparsity': {'kernel_positions': (8, 32)}}
  >>> model.apply(variables, jnp.ones((8, 64))).shape
  (8, 32)

  Attributes:
    features: output size; the input size ``x.shape[-1]`` must be a multiple of ``m``.
    n, m: ``n`` kept of every ``m`` input features, ``0 < n < m``.
    use_bias, dtype, param_dtype, precision, kernel_init, bias_init, promote_dtype: as ``nn.Dense``;
      ``kernel_init`` draws the dense ``(in_features, features)`` kernel that ``init`` prunes. ``dtype`` and
      ``param_dtype`` are real only (a complex one raises ``TypeError``, as do complex inputs and kernels;
      :class:`~jaxsparse.layers.linen.MaskedDense` takes them).
    implementation: backend of :func:`jaxsparse.ops.nm_matmul`: ``None`` (it picks), ``"xla"``, ``"pallas"`` or
      ``"cusparselt"``.
  """

  features: int
  _: dataclasses.KW_ONLY
  n: int = 2
  m: int = 4
  use_bias: bool = True
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  precision: lax.PrecisionLike = None
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = nn.initializers.zeros_init()
  promote_dtype: Callable[..., Any] = linen_promote_dtype
  implementation: ops.NMImplementation | None = None

  def __post_init__(self):
    _nm_masks.check_nm(self.n, self.m)
    _utils.check_positive_int(self.features, name="features")
    check_use_bias(self.use_bias)
    check_nm_implementation(self.implementation)
    check_dtypes(type(self), dtype=self.dtype, param_dtype=self.param_dtype, numeric_params=True,
                 inexact=self.promote_dtype is linen_promote_dtype)
    check_real_dtypes(type(self), param_dtype=self.param_dtype, dtype=self.dtype)
    _utils.check_precision(self.precision, owner=type(self).__name__)
    default_init = self.kernel_init is default_kernel_init  # draws a truncated normal, as the other layers' default
    check_init_dtype(type(self), self.param_dtype, None if default_init else self.kernel_init)
    super().__post_init__()

  def _in_features(self, x_shape: tuple[int, ...]) -> int:
    """The input size: the held kernel's (checked against ``x``), else ``x``'s."""
    values_shape = existing_shape(self, "params", "kernel")
    expected = None
    if values_shape is not None:
      if len(values_shape) != 2 or values_shape[0] % self.n:
        raise ValueError(
            f"{type(self).__name__}{f' {self.name!r}' if self.name else ''}: params['kernel'] has shape "
            f"{values_shape}, not the kept values (in_features * n // m, features) of an {self.n}:{self.m} kernel; "
            "pass the variables its init or jaxsparse.compress_linen made (NMDense keeps the dense kernel)."
        )
      expected = values_shape[0] * self.m // self.n
    check_known_in_features(self, x_shape, expected)
    check_in_features(x_shape[-1], self.m, name="x.shape[-1]")
    return x_shape[-1]

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """Applies the layer: ``nm_matmul(x, W) + b`` with Flax's dtype promotion, as ``nn.Dense`` does.

    Args:
      x: ``(..., in_features)``.

    Returns:
      ``(..., features)``, in ``dtype`` if set, else the promoted dtype of ``x`` and the parameters.

    Raises:
      ValueError: ``x`` whose last axis is not the layer's input size (both named) or not a multiple of ``m``,
        variables without the ``"sparsity"`` collection, a ``params['kernel']`` that is not kept values, or (static,
        under ``jit`` too) ``kernel_positions`` of another shape or dtype than the layer's (positions cast, a
        checkpoint of another layer): the message names the variable, its shape and dtype and the expected ones.
      TypeError: a complex ``x`` or ``params['kernel']``.

    >>> import jax, jax.numpy as jnp, jaxsparse
    >>> from jaxsparse.layers.linen import CompressedNMDense
    >>> w = jaxsparse.NMSparseMatrix.from_dense(jax.random.normal(jax.random.key(0), (64, 32)), 2, 4)
    >>> variables = {"params": {"kernel": w.values}, "sparsity": {"kernel_positions": w.indices}}
    >>> y = CompressedNMDense(32, use_bias=False).apply(variables, jnp.ones((3, 64)))
    >>> bool(jnp.allclose(y, jnp.ones((3, 64)) @ w.to_dense(), atol=1e-5))
    True
    """
    x = check_input(self, x)
    check_real_dtypes(type(self), **{"x.dtype": x.dtype})
    k = self._in_features(x.shape)
    check_pattern(self, "kernel_positions")
    shape = (k, self.features)
    drawn: dict[str, NMSparseMatrix] = {}  # the pruned kernel drawn at init: its values and positions

    def init_values(key: jax.Array) -> Any:
      def compress(dense: jax.Array) -> jax.Array:
        drawn["w"] = NMSparseMatrix.from_dense(dense, self.n, self.m, axis=0)
        return drawn["w"].values

      return map_boxed(self.kernel_init(key, shape, self.param_dtype), compress)

    values = self.param("kernel", init_values)
    # Boxed as the kernel is (nn.with_partitioning), named by the outputs: nn.scan metadata_params add the stack axis.
    positions = self.variable(SPARSITY, "kernel_positions", lambda: box_structure(
        self.get_variable("params", "kernel"), drawn["w"].indices, "kernel_positions")).value
    bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
    check_real_dtypes(type(self), **{"params['kernel'].dtype": jnp.result_type(values)})  # variables made elsewhere
    path = "/".join(self.path)
    check_compressed_parts(f"linen.{type(self).__name__}{f' {path!r}' if path else ''} (params 'kernel')", values,
                           linen_positions_name(self, "kernel_positions"), positions, shape=shape, n=self.n,
                           m=self.m, axis=0)  # static: named, also under jit (a checkpoint's positions, cast)
    w = NMSparseMatrix(values, positions, shape=shape, n=self.n, m=self.m, axis=0, validate=False)
    w = check_loaded_positions(linen_positions_name(self, "kernel_positions"), w)
    x, values, bias = self.promote_dtype(x, w.values, bias, dtype=self.dtype)
    y = ops.nm_matmul(x, w.with_values(values), implementation=self.implementation, precision=self.precision)
    if bias is not None:
      y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


def check_restored(module: Any, variables: Mapping, /, *example_inputs: Any, **kwargs: Any) -> Mapping:
  """Checks the packed positions of the compressed N:M layers in Linen ``variables`` (a restored checkpoint) against
  the n:m of ``module``'s layers; returns ``variables``.

  A Linen layer's n:m is in its module, not in its variables, and under ``jax.jit(module.apply)`` it reads traced
  positions, which it cannot check: a checkpoint of another n:m (2:4 restored into a 4:8 target: orbax casts the
  packed words to the target's dtype when the shapes agree) would compute with a wrong weight there, silently. Outside
  ``jit`` each ``CompressedNMDense`` / ``CompressedNMEmbed`` checks its positions at its first call; call this once
  after a restore whose model then runs only under ``jit``. It traces ``module.apply(variables, *example_inputs)``
  (``jax.eval_shape``: no products are computed) with the variables concrete, so that each layer it calls checks its
  positions, and checks the stacked positions of the layers called inside ``nn.scan`` / ``nn.vmap`` by their path.
  Each positions array is checked once, on its device (remembered while it lives).

  >>> import jax, jax.numpy as jnp
  >>> from jaxsparse.layers import linen
  >>> x = jnp.ones((1, 64))
  >>> variables = linen.CompressedNMDense(32).init(jax.random.key(0), x)  # 2:4
  >>> linen.check_restored(linen.CompressedNMDense(32), variables, x) is variables
  True
  >>> cast = jax.tree.map(lambda a: a.astype(jnp.uint16) if a.dtype == jnp.uint8 else a, variables)  # as orbax
  >>> linen.check_restored(linen.CompressedNMDense(32, n=4, m=8), cast, x)
  Traceback (most recent call last):
    ...
  ValueError: linen.CompressedNMDense (sparsity 'kernel_positions'): its packed positions are not valid for its ...

  Args:
    module: the Linen module of ``variables`` (or the ``SparsifiedLinen`` of :func:`jaxsparse.sparsify_linen` /
      :func:`jaxsparse.compress_linen`).
    variables: the restored variables, ``{"params": ..., "sparsity": ...}`` (boxed or not).
    *example_inputs, **kwargs: the arguments of ``module.apply`` after the variables (arrays or
      ``jax.ShapeDtypeStruct``; only traced). Only the layers this call reaches are checked.

  Returns:
    ``variables``, unchanged.

  Raises:
    ValueError: positions not valid for their layer's n:m, naming the layer, its n:m and the n:m they fit.
  """
  found: dict[tuple[str, ...], tuple[str, NMLayout]] = {}

  def record(next_fun, args, kw, context):
    layer = context.module
    if context.method_name in ("__call__", "attend"):
      if isinstance(layer, CompressedNMDense) and (values := existing_shape(layer, "params", "kernel")) is not None:
        found[tuple(layer.path)] = ("kernel_positions", NMLayout(
            linen_positions_name(layer, "kernel_positions"), (values[-2] * layer.m // layer.n, layer.features),
            layer.n, layer.m, 0))
      elif isinstance(layer, CompressedNMEmbed):
        found[tuple(layer.path)] = ("embedding_positions", NMLayout(
            linen_positions_name(layer, "embedding_positions"), (layer.features, layer.num_embeddings), layer.n,
            layer.m, 0))
    return next_fun(*args, **kw)

  with nn.intercept_methods(record):  # concrete variables: each unstacked layer checks its own positions
    jax.eval_shape(lambda *inputs: module.apply(variables, *inputs, **kwargs), *example_inputs)
  sparsity = nn.meta.unbox(variables).get(SPARSITY, {})
  for path, (name, layout) in found.items():  # a stack's positions, traced in the call: looked up by path
    node = sparsity
    for part in (*path, name):
      node = node.get(part) if isinstance(node, Mapping) else None
    if node is not None:
      check_positions(layout, node)
  return variables
