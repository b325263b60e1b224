"""Argument checks of the layer constructors: implementations, dtypes, kept counts, kernel sizes, feature groups.

Each raises a ``ValueError`` / ``TypeError`` that names the layer, the argument, the value received and what is
allowed, when the layer is built (NNX) or constructed (Linen), not at its first call. The checks of the packed positions
a compressed N:M layer reads are the exception: :func:`check_positions` checks them where a restore or an update sets
them (NNX, by their :class:`NMLayout`), :func:`check_loaded_positions` at the layer's first use outside ``jit``.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import typing
import weakref
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import _utils
from jaxsparse import ops
from jaxsparse.formats import _nm_masks
from jaxsparse.formats._nm import NMSparseMatrix
from jaxsparse.formats._nm import index_layout
from jaxsparse.formats._nm import position_bits

__all__ = [
    "NMLayout",
    "NM_LAYOUT",
    "check_compressed_parts",
    "check_conv_steps",
    "check_dtypes",
    "check_feature_groups",
    "check_implementation",
    "check_in_features",
    "check_init_dtype",
    "check_input",
    "check_kept",
    "check_kernel_size",
    "check_loaded_positions",
    "check_masked_implementation",
    "check_one_of",
    "check_padding",
    "check_passthrough_kwargs",
    "check_positions",
    "check_real_dtypes",
    "check_trained_dtype",
    "check_transposable_layer",
    "check_use_bias",
    "layer_array",
    "linen_positions_name",
]


_IMPLEMENTATIONS = (None, *typing.get_args(ops.Implementation))


def check_implementation(implementation: object) -> str | None:
  if implementation not in _IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {_IMPLEMENTATIONS}, got implementation={implementation!r}.")
  return implementation


def check_masked_implementation(implementation: object) -> str | None:
  """``implementation`` of :func:`jaxsparse.ops.masked_matmul`: ``None``, ``"xla"`` or ``"cpu"``."""
  allowed = (None, *typing.get_args(ops.CpuImplementation))
  if implementation not in allowed:
    raise ValueError(f"implementation must be one of {allowed}, got implementation={implementation!r}.")
  return implementation


def check_kept(kept: int, total: int, *, name: str, value: float, what: str) -> None:
  if kept == 0:
    raise ValueError(f"{name}={value} keeps 0 of {total} {what}; choose a {name} that keeps at least one.")


def check_one_of(name: str, value: object, other: str, other_value: object) -> None:
  """Raises unless exactly one of the two arguments (a number ``name`` or an array ``other``) is given."""
  if (value is None) == (other_value is None):
    raise ValueError(
        f"Pass exactly one of {name}= and {other}=, got {name}={value!r} and "
        f"{other}={'None' if other_value is None else 'an array'}."
    )


def check_dtypes(
    layer: type, *, dtype: Any = None, param_dtype: Any = None, inexact: bool = True, numeric_params: bool = False
) -> None:
  """Checks a layer's compute ``dtype`` and storage ``param_dtype`` where it is built (an NNX layer's ``__init__``, a
  Linen layer's ``__post_init__``): a ``TypeError`` names the layer, the argument, its value and what it takes.

  Flax's ``promote_dtype`` refuses a compute dtype that is not inexact only at the first call ("Dtype must be
  inexact: <class 'jax.numpy.int32'>", naming neither the layer nor the argument), and a value that is not a dtype
  (``"foo"``) failed there too, on NumPy's "data type 'foo' not understood". Complex dtypes pass here;
  :func:`check_real_dtypes` refuses them for the layers that compute with real ones only.

  Args:
    layer: the layer's class, which the message names.
    dtype: the compute dtype as given; ``None`` (inferred from the inputs and parameters) passes.
    param_dtype: the storage dtype as given; ``None`` skips it. Integer ones pass (integer weights, with a
      ``kernel_init``: :func:`check_init_dtype`), as do bool ones unless ``numeric_params``.
    inexact: whether ``dtype`` must be floating or complex: ``False`` for an embedding, whose lookups take any
      dtype (as ``nnx.Embed``'s), and for a layer given its own ``promote_dtype``.
    numeric_params: refuse a bool ``param_dtype`` too (a compressed layer's values must be numbers).
  """
  checked = {}
  for name, value in (("dtype", dtype), ("param_dtype", param_dtype)):
    if value is None:
      continue
    try:
      checked[name] = jnp.dtype(value)
    except TypeError:
      checked[name] = None
    ok = checked[name] is not None and (checked[name] == np.bool_ or jnp.issubdtype(checked[name], jnp.number))
    if not ok:
      default = ", or None (inferred from the inputs and parameters)" if name == "dtype" else ""
      raise TypeError(
          f"{layer.__name__}: {name} must be a numeric dtype such as jnp.float32 or jnp.bfloat16{default}, got "
          f"{name}={value!r}."
      )
  if inexact and "dtype" in checked and not jnp.issubdtype(checked["dtype"], jnp.inexact):
    raise TypeError(
        f"{layer.__name__} computes in dtype, which must be a floating dtype (float32, bfloat16, float16, float64, "
        f"float8) or None (inferred from the inputs and parameters), got dtype={checked['dtype']}: Flax's "
        "promote_dtype refuses integer and bool compute dtypes. For integer weights give param_dtype= (with a "
        "kernel_init); integer inputs are promoted."
    )
  if numeric_params and checked.get("param_dtype") == np.bool_:
    raise TypeError(
        f"{layer.__name__} stores its weights' values compressed and needs a numeric param_dtype (float32, bfloat16, "
        "float16, float64, or an integer dtype with a kernel_init), got param_dtype=bool."
    )


def check_real_dtypes(layer: type, **dtypes: Any) -> None:
  """Raises a ``TypeError`` naming the layer's argument when one of ``dtypes`` (``name=dtype``, ``None`` skipped) is
  complex, for layers whose products (the sparse ops, SR-STE's magnitudes) take real dtypes only (NNX and Linen).

  Args:
    layer: the layer's class, which the message names (with the masked layer of its framework to use instead).
    **dtypes: the layer's arguments as the user passed them (``param_dtype``, ``dtype``, ``inputs.dtype``, ...).
  """
  linen = issubclass(layer, nn.Module)  # a Linen layer: name the Linen alternative
  alternative = "MaskedDense, which computes as nn.Dense does" if linen else (
      "MaskedLinear / MaskedConv, which compute as nnx.Linear / nnx.Conv do")
  for name, dtype in dtypes.items():
    if dtype is not None and jnp.issubdtype(jnp.dtype(dtype), jnp.complexfloating):
      raise TypeError(
          f"{layer.__name__} computes with real dtypes only (floating: float32, bfloat16, float16, float64, float8; "
          f"integer inputs are promoted), got {name}={jnp.dtype(dtype)}. For complex weights or inputs use "
          f"{alternative}."
      )


def check_trained_dtype(layer: type, param_dtype: Any) -> None:
  """Raises a ``TypeError`` naming ``param_dtype`` when it is not a floating dtype, for the layers that train their
  dense kernel with SR-STE (its gradient and magnitudes need floats; an integer kernel failed at the first call)."""
  check_real_dtypes(layer, param_dtype=param_dtype)
  if not jnp.issubdtype(jnp.dtype(param_dtype), jnp.floating):
    raise TypeError(
        f"{layer.__name__} trains its kernel with SR-STE and needs a floating param_dtype (float32, bfloat16, "
        f"float16, float64), got param_dtype={jnp.dtype(param_dtype)}. For integer weights prune a float copy and "
        "compress it (CompressedNMLinear / CompressedNMDense take any real dtype)."
    )


def check_init_dtype(layer: type, param_dtype: Any, kernel_init: Any, *, name: str = "kernel_init") -> None:
  """Raises a ``TypeError`` naming ``param_dtype`` when it is not floating (nor complex) and ``kernel_init`` is
  ``None`` (the layer's default, passed as ``None`` by the layers whose default is another initializer): the layer's
  default initializer draws a (truncated) normal, which needs one (an integer or bool dtype failed inside JAX's
  sampler, naming neither the layer nor the argument). ``name``: the initializer's argument name."""
  if kernel_init is None and not jnp.issubdtype(jnp.dtype(param_dtype), jnp.inexact):
    raise TypeError(
        f"{layer.__name__}'s default {name} draws from a normal distribution and needs a floating param_dtype "
        f"(float32, bfloat16, float16, float64), got param_dtype={jnp.dtype(param_dtype)}. For "
        f"{jnp.dtype(param_dtype)} weights pass {name}= (called as {name}(key, shape, param_dtype)), e.g. "
        "jax.nn.initializers.zeros before loading trained weights."
    )


def check_transposable_layer(transposable: object, out_features: int, m: int, *, name: str = "out_features") -> bool:
  """``transposable`` of an N:M layer, checked: a bool; if True, ``m <= 4`` and dividing ``out_features``."""
  if _nm_masks.check_transposable_flag(transposable, m) and out_features % m:
    raise ValueError(
        f"transposable=True needs {name}={out_features} a multiple of m={m} (the transposed kernel is N:M along "
        "the output features)."
    )
  return transposable


def check_feature_groups(
    groups: object, in_features: int, out_features: int, *, in_name: str = "in_features",
    out_name: str = "out_features"
) -> int:
  """A conv's ``feature_group_count``, checked: a positive int dividing both feature counts (Flax's convolutions take
  any other and fail at the first call, on a bare ``AssertionError`` or a ``lax`` error)."""
  groups = _utils.check_positive_int(groups, name="feature_group_count")
  if in_features % groups or out_features % groups:
    raise ValueError(
        f"feature_group_count={groups} must divide {in_name}={in_features} and {out_name}={out_features}."
    )
  return groups


def check_use_bias(use_bias: object) -> bool:
  """``use_bias`` as a bool (a NumPy bool too); anything else (``"no"``, ``None``, ``0``) raises instead of building a
  layer with or without a bias by the value's truthiness."""
  if not isinstance(use_bias, bool | np.bool_):
    raise TypeError(f"use_bias must be a bool, got use_bias={use_bias!r} of type {type(use_bias).__name__}.")
  return bool(use_bias)


def check_kernel_size(kernel_size: object, *, name: str = "kernel_size") -> tuple[int, ...]:
  """A conv's ``kernel_size`` as a tuple of positive ints: an int (a NumPy integer too) or a sequence of them. Flax's
  convolutions take others and fail later, opaquely (a NumPy int is "not iterable", a 0 a ``ZeroDivisionError`` in the
  default initializer, a negative size an XLA error), or build a layer from a bool. ``name``: the argument's."""
  integral = isinstance(kernel_size, numbers.Integral) and not isinstance(kernel_size, bool | np.bool_)
  try:
    sizes = (kernel_size,) if integral else tuple(kernel_size)
  except TypeError:
    sizes = None
  if sizes is None or not all(isinstance(k, numbers.Integral) and not isinstance(k, bool | np.bool_) and k > 0
                              for k in sizes):
    raise ValueError(f"{name} must be a positive int or a sequence of positive ints, got {kernel_size!r}.")
  return tuple(int(k) for k in sizes)


def check_conv_steps(**steps: object) -> dict[str, int | tuple[int, ...] | None]:
  """A conv's ``strides``, ``input_dilation`` and ``kernel_dilation`` (given as ``name=value``), checked as
  :func:`check_kernel_size` checks sizes, ``None`` passing: Flax's convolutions take a 0 or a negative step and fail
  at the first call inside XLA ("Cannot lower jaxpr with verifier errors"), a NumPy int as "not iterable". Returns
  them with ints as Python ints (a sequence as a tuple)."""
  checked = {}
  for name, value in steps.items():
    if value is None:
      checked[name] = None
      continue
    sizes = check_kernel_size(value, name=name)
    integral = isinstance(value, numbers.Integral)
    checked[name] = sizes[0] if integral else sizes
  return checked


# Padding strings: lax's (it upper-cases them) and Flax's own modes, which Flax's convolutions compare as given.
_LAX_PADDINGS = ("SAME", "VALID", "SAME_LOWER")
_FLAX_PADDINGS = ("CIRCULAR", "REFLECT", "CAUSAL")


def check_padding(layer: type, padding: object, rank: int) -> str | int | tuple[tuple[int, int], ...]:
  """A conv's ``padding`` as Flax's convolutions take it, checked where the layer is built (an unknown string failed
  at the first call on lax's ``RuntimeError``, naming neither the layer nor the argument). ``rank``: the number of
  spatial axes (``len(kernel_size)``).

  Takes a string (``'SAME'``, ``'VALID'``, ``'SAME_LOWER'`` in any case, as lax reads them; ``'CIRCULAR'``,
  ``'REFLECT'``, ``'CAUSAL'`` as Flax spells them, ``'CAUSAL'`` for one spatial axis only), an int, or a sequence of
  ``rank`` entries each an int or a ``(low, high)`` pair of ints. Returns it with NumPy ints as Python ints and each
  pair as a tuple (Flax takes only those), else a ``ValueError`` naming ``layer``, the value and what is allowed.
  """
  def integral(p: object) -> bool:
    return isinstance(p, numbers.Integral) and not isinstance(p, bool | np.bool_)

  if isinstance(padding, str):
    if padding.upper() in _LAX_PADDINGS or (padding in _FLAX_PADDINGS and (padding != "CAUSAL" or rank == 1)):
      return padding
  elif integral(padding):
    return int(padding)
  elif isinstance(padding, typing.Sequence) and len(padding) == rank:
    pads = []
    for p in padding:
      if integral(p):
        pads.append((int(p), int(p)))
      elif isinstance(p, typing.Sequence) and len(p) == 2 and all(map(integral, p)):
        pads.append((int(p[0]), int(p[1])))
    if len(pads) == rank:
      return tuple(pads)
  causal = " ('CAUSAL' pads one spatial axis only)" if isinstance(padding, str) and padding == "CAUSAL" else ""
  raise ValueError(
      f"{layer.__name__}: padding must be 'SAME', 'VALID' or 'SAME_LOWER' (any case), 'CIRCULAR', 'REFLECT' or "
      f"'CAUSAL' (1-D convolutions only), an int, or a sequence of {rank} (one per spatial axis of kernel_size) ints "
      f"or (low, high) pairs of ints, got padding={padding!r}{causal}."
  )


def layer_array(layer: Any, value: Any, name: str) -> jax.Array:
  """:func:`jaxsparse._utils.as_array` whose ``TypeError`` names the layer too (``None`` or a string passed as the
  inputs failed in ``jnp.asarray``, naming neither)."""
  try:
    return _utils.as_array(value, name=name)
  except TypeError as e:
    raise TypeError(f"{type(layer).__name__}: {e}") from None


def check_input(module: nn.Module, x: jax.typing.ArrayLike) -> jax.Array:
  """A Linen layer's input ``x`` as an array of at least one axis; errors name the layer and ``x``."""
  x = layer_array(module, x, "x")
  if x.ndim < 1:
    raise ValueError(f"{type(module).__name__}: x must have shape (..., in_features), got x.shape={x.shape}.")
  return x


def check_passthrough_kwargs(cls: type, base: type, kwargs: dict[str, Any]) -> None:
  """Raises a ``TypeError`` naming ``cls`` for keywords of ``kwargs`` (what ``cls`` hands on to ``base.__init__``)
  that ``base`` does not take: Python's own error would name ``base.__init__`` (``Linear.__init__() got an
  unexpected keyword argument``) for a typo made calling ``cls``."""
  params = inspect.signature(base.__init__).parameters
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
    return
  unknown = sorted(set(kwargs) - set(params))
  if unknown:
    names = ", ".join(n for n in params if n != "self")
    raise TypeError(f"{cls.__name__} got unexpected keyword arguments {unknown}; besides its own it takes those of "
                    f"{base.__module__.split('.')[0]}'s {base.__name__}: {names}.")


def check_in_features(in_features: int, m: int, *, name: str = "in_features") -> None:
  _utils.check_positive_int(in_features, name=name)
  if in_features % m:
    raise ValueError(
        f"{name}={in_features} must be a multiple of m={m}: the N:M groups run along the input features."
    )


NM_LAYOUT = "nm_layout"
"""Metadata key of the :class:`SparsityPattern` holding a compressed N:M layer's packed positions
(``CompressedNMLinear.kernel_positions``, ``CompressedNMEmbed.embedding_positions``); its value is the layer's
:class:`NMLayout`."""


class NMLayout(typing.NamedTuple):
  """What a compressed N:M layer's packed positions must be valid for: the ``nm_layout`` metadata of its positions.

  Orbax casts a saved array to the target's dtype when the shapes agree: a 2:4 checkpoint restored into a 4:8 layer
  (uint8 words against uint16 ones, one shape) loads without error, and the layer would compute with a wrong weight.
  The positions' variable carries this layout, so that concrete positions set into it (``nnx.update``, ``set_value``)
  are checked there (:func:`check_positions`), before any ``jit`` reads them; the layer checks those ``nnx.merge``
  gives it. The positions of a stack of layers (``nnx.vmap``) have leading axes; the layout is one layer's.

  Attributes:
    name: how errors name the variable, e.g. ``"CompressedNMLinear.kernel_positions"``.
    shape: the dense shape of one layer's weight (``(in_features, out_features)``; an embedding's transposed table).
    n, m, axis: the layer's ``n`` of every ``m`` along ``axis``.
  """

  name: str
  shape: tuple[int, ...]
  n: int
  m: int
  axis: int


# id(packed positions) -> (a weak reference to them, the (shape, n, m, axis, their shape) they were found valid for).
_valid_positions: dict[int, tuple[weakref.ref, tuple]] = {}


def check_positions(layout: NMLayout, value: Any) -> None:
  """Raises a ``ValueError`` naming ``layout.name``, the layout's n:m and the n:m the positions fit, when ``value``
  (packed positions of one layer or, with leading axes, of a stack) are concrete and not valid for ``layout``.

  Anything else passes: traced and abstract values (under ``jit``, ``nnx.eval_shape``), arrays spread over several
  hosts (not fully addressable), and values of another dtype or shape (not this layout's positions; the layer's own
  shape check names them where it reads them). Each positions array is checked once (remembered by identity while it
  lives), on its device: one elementwise pass over the packed words and a one-element copy to the host; the message
  of a failure reads them on the host.

  Args:
    layout: the layer's :class:`NMLayout`.
    value: the positions set into the layer's variable.
  """
  if not _readable(value):
    return
  shape, n, m, axis = layout.shape, layout.n, layout.m, layout.axis
  groups = shape[axis] // m
  dtype, per_word = index_layout(n, m, groups)
  one = (*shape[:axis], groups // per_word, *shape[axis + 1:])
  lead = np.ndim(value) - len(one)
  if lead < 0 or tuple(np.shape(value)[lead:]) != one or value.dtype != dtype:
    return
  _check_words(layout, value, lead)


def check_compressed_parts(
    values_name: str, values: Any, positions_name: str, positions: Any, *, shape: tuple[int, ...], n: int, m: int,
    axis: int
) -> None:
  """Raises a ``ValueError`` naming the variable, its shape and dtype and the expected ones, when a compressed N:M
  layer's kept ``values`` or packed ``positions`` (as restored: ``nnx.update``, a Linen checkpoint) are not the
  arrays of its ``shape`` weight's ``n:m`` along ``axis``. Static (shapes and dtypes only), so also under ``jit``;
  :class:`jaxsparse.NMSparseMatrix` checks the same, without the layer's names.

  Args:
    values_name, positions_name: how the message names the variables, e.g. ``"CompressedNMLinear.kernel"``.
    values, positions: the layer's arrays (concrete, traced or abstract).
    shape, n, m, axis: the layer's dense weight shape and pattern.
  """
  groups = shape[axis] // m
  dtype, per_word = index_layout(n, m, groups)
  want_v = (*shape[:axis], groups * n, *shape[axis + 1:])
  want_i = (*shape[:axis], groups // per_word, *shape[axis + 1:])
  weight = f"the {shape} {n}:{m} weight's"
  got_v, got_i = tuple(jnp.shape(values)), tuple(jnp.shape(positions))
  if got_v != want_v:
    raise ValueError(f"{values_name} must have shape {want_v} ({weight} kept values), got {got_v} "
                     f"{jnp.result_type(values)}: a checkpoint of another layer (sizes or n:m) restored into this one?")
  dtype_i = jnp.result_type(positions)
  if got_i != want_i or dtype_i != dtype:
    hint = ("a checkpoint of another layer (sizes or n:m) restored into this one?" if dtype_i == dtype else
            "were the positions cast (a jax.tree.map over the model, a checkpoint of another n:m)? Cast only the "
            "values.")
    raise ValueError(f"{positions_name} must be {dtype} of shape {want_i} ({weight} packed positions), got "
                     f"{dtype_i} {got_i}: {hint}")


def check_loaded_positions(layer: str, weight: NMSparseMatrix) -> NMSparseMatrix:
  """``weight`` (a compressed N:M layer's, built with ``validate=False``) if its concrete positions are valid for the
  layer's n:m, else a ``ValueError`` naming ``layer``, the layer's n:m and the n:m the positions fit.

  The check at the layer's first use outside ``jit``, for positions no restore checked (:func:`check_positions`):
  a Linen layer's, or an NNX layer's given a plain array. Such positions of another n:m cast as orbax casts them are
  not valid (decoded, they repeat or are out of order). Each positions array is checked once, on its device
  (remembered by identity while it lives); traced positions (under ``jit``) are not checked.
  """
  indices = weight.indices
  if not _readable(indices):
    return weight
  layout = NMLayout(layer, weight.shape, weight.n, weight.m, weight.axis)
  try:
    weight._check_static()  # the shape and dtype first: words of another n:m's dtype are named as such
  except ValueError:
    raise _invalid(layout, np.asarray(indices), 0) from None
  _check_words(layout, indices, 0)
  return weight


def _readable(value: Any) -> bool:
  """Whether ``value`` holds values this process can read: a NumPy array, or a JAX array (not a tracer) whose
  shards are all on this process and not deleted (donated)."""
  if isinstance(value, np.ndarray):
    return True
  if not isinstance(value, jax.Array) or isinstance(value, jax.core.Tracer):
    return False
  return value.is_fully_addressable and not value.is_deleted()


def _check_words(layout: NMLayout, words: Any, lead: int) -> None:
  """Raises unless the packed ``words`` (of ``layout``'s dtype and shape, ``lead`` leading stack axes) are valid;
  remembers valid ones."""
  n, m = layout.n, layout.m
  key = (layout.shape, n, m, layout.axis, tuple(words.shape))
  seen = _valid_positions.get(id(words))
  if seen is not None and seen[0]() is words and seen[1] == key:
    return
  _, per_word = index_layout(n, m, layout.shape[layout.axis] // m)
  if isinstance(words, np.ndarray):
    ok = bool(_valid_words(words, n, m, per_word, np).all())
  else:
    with jax.ensure_compile_time_eval():  # a concrete array inside a trace (a closed-over constant) runs eagerly too
      ok = bool(_all_valid(words, n=n, m=m, per_word=per_word))
  if not ok:
    raise _invalid(layout, np.asarray(words), lead)
  key_id = id(words)
  try:
    ref = weakref.ref(words, lambda _: _valid_positions.pop(key_id, None))
  except TypeError:  # not weakly referenceable: checked again next time
    return
  _valid_positions[key_id] = (ref, key)


def _valid_words(words: Any, n: int, m: int, per_word: int, xp: Any) -> Any:
  """Elementwise: whether each packed word holds valid positions (``xp``: ``np`` or ``jnp``).

  A word packs ``per_word`` whole groups of ``n`` positions (:func:`jaxsparse.formats._nm.index_layout`), so the checks
  of :meth:`NMSparseMatrix.validate` are per word: every position below ``m``, the ``n`` of a group strictly
  increasing, the bits past the packed fields zero. No reshape: any leading axes and any sharding pass as they are.
  """
  bits = position_bits(m)
  field = (1 << bits) - 1
  w = words.astype(xp.uint32)
  used = per_word * n * bits
  ok = (w >> used) == 0 if used < words.dtype.itemsize * 8 else xp.ones(w.shape, bool)
  for s in range(per_word):
    prev = None
    for j in range(n):
      pos = (w >> ((s * n + j) * bits)) & field
      ok = ok & (pos < m)
      if prev is not None:
        ok = ok & (pos > prev)
      prev = pos
  return ok


@functools.partial(jax.jit, static_argnames=("n", "m", "per_word"))
def _all_valid(words: jax.Array, *, n: int, m: int, per_word: int) -> jax.Array:
  return jnp.all(_valid_words(words, n, m, per_word, jnp))


def _invalid(layout: NMLayout, words: np.ndarray, lead: int) -> ValueError:
  """The error for ``words``, not valid for ``layout``: the n:m they fit, and the first bad group."""
  shape = (*words.shape[:lead], *layout.shape)
  n, m, axis = layout.n, layout.m, layout.axis + lead
  values_shape = (*shape[:axis], shape[axis] * n // m, *shape[axis + 1:])
  stacked = NMSparseMatrix.tree_unflatten(  # only the positions are read: the values' shape stands in for them
      (shape, n, m, axis), (jax.ShapeDtypeStruct(values_shape, np.float32), words))
  try:
    stacked.validate()
    details = ""
  except ValueError as e:
    details = f" Details: {e}"
  fits = _layouts_that_fit(words, shape, n, m, axis)
  if fits:
    stored = (f"they are valid {' or '.join(fits)} positions: a checkpoint saved with n:m={fits[0]} was likely "
              "restored into this layer (orbax casts the packed words to the target's dtype when the shapes agree). "
              "Restore into a target built with the checkpoint's n:m (n=, m= of the layer)")
  elif words.size and not words.any():
    stored = ("every word is zero: positions never loaded (a placeholder such as jnp.zeros_like's?). Load the "
              "layer's positions, or build it from its weights")
  else:
    stored = ("they fit no other n:m of the same shapes either (a checkpoint of another layer?). Restore into a "
              "target built with the checkpoint's n:m (n=, m= of the layer)")
  stack = f" (a stack of layers: the positions {words.shape} have {lead} leading layer axis/axes)" if lead else ""
  return ValueError(f"{layout.name}: its packed positions are not valid for its n:m={layout.n}:{layout.m}{stack}; "
                    f"{stored}.{details}")


def linen_positions_name(module: nn.Module, name: str) -> str:
  """How :func:`check_loaded_positions` names a Linen layer's positions: class, module path, variable."""
  path = "/".join(module.path)
  return f"linen.{type(module).__name__}{f' {path!r}' if path else ''} (sparsity {name!r})"


def _layouts_that_fit(words: np.ndarray, shape: tuple[int, ...], n: int, m: int, axis: int) -> list[str]:
  """The other ``n:m`` (``n / m`` the layer's, as the values' shape says) whose layout the ``words`` are valid in: of
  the same shape (orbax casts only arrays of the target's shape), their values fitting the other layout's dtype."""
  if words.ndim != len(shape):
    return []
  k = shape[axis]
  fits = []
  for m2 in range(2, min(k, 64) + 1):
    n2, rest = divmod(n * m2, m)
    if k % m2 or rest or (n2, m2) == (n, m):
      continue
    try:
      dtype, per_word = index_layout(n2, m2, k // m2)
    except ValueError:  # n2 positions do not fit one 32-bit word
      continue
    if words.shape[axis] != k // m2 // per_word or (words.size and int(words.max()) > np.iinfo(dtype).max):
      continue
    if _valid_words(words, n2, m2, per_word, np).all():
      fits.append(f"{n2}:{m2}")
  return fits
