"""Argument checks shared by formats, ops and layers.

Each check raises a ``ValueError``/``TypeError`` that names the argument, the value received and what
is allowed, so bad input fails early and readably.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
import secrets
import stat
import sys
import warnings
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def check_block_shape(block_shape: object, shape: Sequence[int], *, name: str = "block_shape") -> tuple[int, int]:
  """Returns ``block_shape`` as a pair of ints that divide the 2-D ``shape``."""
  if (
      not isinstance(block_shape, Sequence)
      or len(block_shape) != 2
      or not all(isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in block_shape)
  ):
    raise TypeError(f"{name} must be a pair of positive ints (bk, bn), got {block_shape!r}.")
  bk, bn = (int(b) for b in block_shape)
  if bk <= 0 or bn <= 0:
    raise ValueError(f"{name} must be positive, got {name}={(bk, bn)}.")
  k, n = shape
  if k % bk or n % bn:
    raise ValueError(
        f"{name}={(bk, bn)} must divide the matrix shape {(k, n)}: "
        f"{k} % {bk} = {k % bk}, {n} % {bn} = {n % bn}. Choose block sizes that divide both dimensions."
    )
  return bk, bn


def _integral(value: object) -> int | None:
  """``value`` as an int when it is one (also a NumPy / JAX integer scalar or an integral float), else ``None``."""
  if isinstance(value, bool | np.bool_):
    return None
  try:
    return operator.index(value)
  except TypeError:
    pass
  if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
    return int(value)
  return None


def check_dims(value: object, *, name: str, ndim: int | None = None, minimum: int = 0) -> tuple[int, ...]:
  """Returns ``value`` (a shape or a block shape) as a tuple of ints, each at least ``minimum``.

  Raises a ``ValueError`` naming ``name`` for a non-sequence, a wrong length (when ``ndim`` is given), a
  non-integral entry (``16.9``; ``16.0`` is taken as ``16``) or an entry below ``minimum``.
  """
  try:
    dims = tuple(value)
  except TypeError:
    dims = None
  want = f"{ndim} ints" if ndim is not None else "a sequence of ints"
  if dims is None or (ndim is not None and len(dims) != ndim):
    raise ValueError(f"{name} must be {want}, got {value!r}.")
  ints = [_integral(d) for d in dims]
  if None in ints:
    bad = dims[ints.index(None)]
    raise ValueError(f"{name} must be {want}, got {value!r} ({bad!r} is not an integer).")
  if any(d < minimum for d in ints):
    raise ValueError(f"{name} must be {want} >= {minimum}, got {tuple(ints)}.")
  return tuple(ints)


def _real_scalar(value: object, *, name: str, allowed: str) -> float:
  """``value`` as a Python float: a real Python / NumPy scalar or a concrete 0-d NumPy / JAX array of a real dtype
  (not a bool); a ``TypeError`` naming ``name`` and ``allowed`` (the range in words) for anything else."""
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{name} must be a concrete float in {allowed}, got the traced {value!r} (an argument of a jitted "
                    "function?): it sets the layer's structure, so pass a Python float or close over it.")
  if isinstance(value, np.ndarray | jax.Array):
    real = jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer)
    if value.ndim == 0 and real:
      return float(value)
  elif isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_):
    return float(value)
  kind = f"an array of shape {value.shape} and dtype {value.dtype}" if hasattr(value, "dtype") else (
      f"of type {type(value).__name__}")
  raise TypeError(f"{name} must be a float in {allowed}, got {value!r}, {kind}.")


def check_density(density: object, *, name: str = "density") -> float:
  """Returns ``density`` (a real scalar: Python, NumPy, a concrete 0-d array) as a float in (0, 1]."""
  d = _real_scalar(density, name=name, allowed="(0, 1]")
  if not 0.0 < d <= 1.0:
    raise ValueError(f"{name} must be in (0, 1], got {name}={d}.")
  return d


def check_sparsity(sparsity: object, *, name: str = "sparsity") -> float:
  """Returns ``sparsity`` (a real scalar: Python, NumPy, a concrete 0-d array) as a float in [0, 1)."""
  s = _real_scalar(sparsity, name=name, allowed="[0, 1)")
  if not 0.0 <= s < 1.0:
    raise ValueError(f"{name} must be in [0, 1), got {name}={s}.")
  return s


def check_ndim(shape: Sequence[int], ndim: int, *, name: str) -> None:
  if len(shape) != ndim:
    raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(shape)} ({len(shape)}-D).")


def check_positive_int(value: object, *, name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) <= 0:
    raise ValueError(f"{name} must be a positive int, got {value!r}.")
  return int(value)


def check_nonnegative_int(value: object, *, name: str) -> int:
  """Returns ``value`` as an int ``>= 0`` (a size that may be empty, as a Flax ``Embed``'s); raises naming ``name``."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
    raise ValueError(f"{name} must be a non-negative int, got {value!r}.")
  return int(value)


def kept_count(fraction: float, total: int) -> int:
  """``fraction * total`` rounded half up: the exact number of entries a mask keeps."""
  return int(fraction * total + 0.5)


def check_mask(mask: jax.typing.ArrayLike, shape: tuple[int, ...], *, name: str = "mask") -> jax.Array:
  """Returns ``mask`` as a bool array after checking its shape and dtype.

  A NumPy bool array may hold bytes other than 0 / 1 (a view of ``uint8`` data, a file's bytes): every nonzero byte
  becomes True (XLA's ``select`` reads such a byte as False, its conversions as 1).
  """
  if isinstance(mask, np.ndarray) and mask.dtype == np.bool_:
    mask = mask.view(np.uint8) != 0
  mask = as_array(mask, name=name)
  if mask.dtype != jnp.bool_:
    raise TypeError(
        f"{name} must be a boolean array, got dtype {mask.dtype}; convert 0/1 masks with "
        f"`{name}.astype(bool)`."
    )
  if mask.shape != tuple(shape):
    raise ValueError(f"{name} must have the weight's shape {tuple(shape)}, got {mask.shape}.")
  return mask


def as_array(value: object, *, name: str) -> jax.Array:
  """``value`` as a JAX array; a ``TypeError`` naming ``name`` for what JAX makes no array of (``None``, a string, a
  ragged list), instead of ``jnp.asarray``'s error naming no argument."""
  try:
    return jnp.asarray(value)
  except (TypeError, ValueError) as e:
    raise _not_an_array(name, f"{type(value).__name__}: {e}") from None


def _not_an_array(name: str, got: str) -> TypeError:
  return TypeError(f"{name} must be an array of numbers (a jax.Array, a NumPy array or a nested list), got {got}.")


def as_host_array(value: object, *, name: str) -> np.ndarray:
  """``value`` (not a ``jax.Array``) as a NumPy array of numbers or bools, kept on the host (a constant under ``jit``
  stays concrete, so its values can be checked); a ``TypeError`` naming ``name``, as :func:`as_array`'s, for ``None``,
  a string or a ragged list."""
  try:
    a = np.asarray(value)
  except (TypeError, ValueError):
    a = None
  if a is None or not (a.dtype == np.bool_ or jnp.issubdtype(a.dtype, jnp.number)):
    got = type(value).__name__ if a is None or a.dtype == object else f"{type(value).__name__} of dtype {a.dtype}"
    raise _not_an_array(name, got)
  return a


def check_precision(precision: object, *, owner: str | None = None) -> Any:
  """``precision`` of a product as ``jax.lax`` takes it, checked where it is given instead of deep in ``lax`` (or
  never, on the routes that ignore it: the C++ CPU kernels). ``owner`` (a layer's class name) prefixes the message.

  Takes what ``lax.dot_general`` takes: ``None``; a ``lax.Precision`` or one of its names (``'highest'``,
  ``'float32'``, ``'high'``, ``'default'``, ...); a pair of either kind (one per operand; a list pair comes back as
  a tuple, hashable as the ops' static arguments must be); a ``lax.DotAlgorithmPreset`` or its name
  (``'F32_F32_F32'``); a ``lax.DotAlgorithm``.

  >>> check_precision(["highest", "high"])
  ('highest', 'high')
  """
  if precision is None or isinstance(precision, jax.lax.Precision | jax.lax.DotAlgorithm | jax.lax.DotAlgorithmPreset):
    return precision
  if isinstance(precision, str) and (_precision_name(precision) or precision in jax.lax.DotAlgorithmPreset.__members__):
    return precision
  if isinstance(precision, tuple | list) and len(precision) == 2 and (
      all(isinstance(p, jax.lax.Precision) for p in precision)
      or all(isinstance(p, str) and _precision_name(p) for p in precision)):
    return tuple(precision)
  prefix = f"{owner}: " if owner else ""
  raise ValueError(
      f"{prefix}precision must be None, a jax.lax.Precision (e.g. jax.lax.Precision.HIGHEST) or one of its names "
      f"{_PRECISION_NAMES}, a pair of those (one per operand: both Precision members or both names), a "
      f"jax.lax.DotAlgorithmPreset or its name (e.g. 'F32_F32_F32'), or a jax.lax.DotAlgorithm, got "
      f"precision={precision!r}."
  )


# lax.Precision's names (its ``_missing_`` maps them); the members' own names ('HIGHEST') are not among them.
_PRECISION_NAMES = ("default", "fastest", "bfloat16", "high", "bfloat16_3x", "tensorfloat32", "highest", "float32")


def _precision_name(name: str) -> bool:
  try:
    jax.lax.Precision(name)
  except ValueError:
    return False
  return True


def check_weight_type(w: object, kind: type, *, name: str = "w") -> None:
  """Raises a ``TypeError`` naming ``name`` unless ``w`` is a ``jaxsparse.<kind>`` (a sparse format)."""
  if not isinstance(w, kind):
    raise TypeError(f"{name} must be a jaxsparse.{kind.__name__}, got {type(w).__name__}.")


def check_contraction(x: jax.Array, k: int) -> None:
  """Raises a ``ValueError`` unless ``x`` has shape ``(..., k)`` (``k = w.shape[0]``)."""
  if x.ndim < 1 or x.shape[-1] != k:
    raise ValueError(f"x must have shape (..., K) with K = w.shape[0] = {k}, got x.shape={x.shape}.")


def check_activations(x: jax.typing.ArrayLike, k: int, *, complex_ok: bool = False) -> jax.Array:
  """``x`` as an array of shape ``(..., k)`` with a floating dtype (or, with ``complex_ok``, a complex one;
  :func:`check_activation_dtype`)."""
  x = as_array(x, name="x")
  check_contraction(x, k)
  if k == 0:
    raise ValueError(
        f"the contraction is empty: w has K = w.shape[0] = 0 input features (x.shape={x.shape}). The sparse ops "
        "need K >= 1; an empty product is all zeros: jnp.zeros((*x.shape[:-1], w.shape[1]))."
    )
  check_activation_dtype(x, complex_ok=complex_ok)
  return x


def check_activation_dtype(x: jax.Array, *, complex_ok: bool = False) -> None:
  """Raises a ``TypeError`` unless ``x`` (the ops' activations) has a floating dtype (or, with ``complex_ok``, a
  complex one): an integer or bool ``x`` multiplied in integers, or lost its gradient."""
  if not jnp.issubdtype(x.dtype, jnp.inexact if complex_ok else jnp.floating):
    allowed = "a floating or complex dtype" if complex_ok else "a floating dtype"
    raise TypeError(f"x must have {allowed}, got {x.dtype}.")


def check_preferred_element_type(value: object) -> np.dtype | None:
  """The ops' ``preferred_element_type`` as a dtype, checked: a floating dtype (``"float32"``, ``jnp.bfloat16``,
  ``np.dtype("float64")``, ...), or ``None`` (the op's default, the operands' result type)."""
  return check_dtype_argument(value, "preferred_element_type", none="the operands' result type")


def check_dtype_argument(value: object, name: str, *, none: str, what: str | None = None,
                         complex_ok: bool = False) -> np.dtype | None:
  """``value`` (the argument ``name``) as a floating dtype (or, with ``complex_ok``, a complex one), ``None`` as
  ``None``; else a ``TypeError`` naming ``what`` (default ``name``), the value and what is allowed (``none``: what
  ``None`` means)."""
  if value is None:
    return None
  try:
    dtype = jnp.dtype(value)
  except (TypeError, ValueError):
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.inexact if complex_ok else jnp.floating):
    got = f"dtype {dtype}" if dtype is not None else f"not a dtype: {type(value).__name__}"
    also = "; a complex one also works" if complex_ok else ""
    raise TypeError(f"{what or name} must be a floating dtype (e.g. jnp.float32, jnp.bfloat16, 'float32'{also}) or "
                    f"None ({none}), got {name}={value!r} ({got}).")
  return dtype


def _narrow_float(dtype: np.dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 2


def accumulation_dtype(*dtypes: jax.typing.DTypeLike) -> np.dtype:
  """The dtype the ops accumulate products of operands of ``dtypes`` in: their result type, at least float32.

  8-bit floats (``float8_e4m3fn``, ``float8_e5m2``, ...), which JAX promotes to nothing implicitly, accumulate in
  float32, as ``jnp.matmul`` does with them.
  """
  acc = jnp.dtype(jnp.float32)
  for dtype in map(jnp.dtype, dtypes):
    if not _narrow_float(dtype):
      acc = jnp.promote_types(acc, dtype)  # not canonicalized: a float64 stays float64 without jax_enable_x64
  return acc


def cpu_dot_operands(acc: jax.typing.DTypeLike, *arrays: jax.Array) -> tuple[jax.Array, ...]:
  """``arrays`` for an XLA dot accumulating in ``acc``: on a CPU backend, floats narrower than ``acc`` cast to it.

  XLA's CPU runtime (jax 0.10) refuses some dots of 16-bit operands into float32 ("Unsupported element type for
  DotThunk::Execute: BF16 x BF16 = F32"): ``xᵀ dY`` of an unmapped ``x`` under ``jax.vmap`` over the weights (an
  ensemble of layers), once ``jit`` folds the transposes into it. The products of two such floats are exact in
  ``acc``, so the cast dot computes what the mixed one does. Accelerators keep the mixed dot (their 16-bit units).
  """
  if jax.default_backend() != "cpu":
    return arrays
  acc = jnp.dtype(acc)
  return tuple(a.astype(acc) if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize < acc.itemsize else a
               for a in arrays)


def result_dtype(x_dtype: jax.typing.DTypeLike, w_dtype: jax.typing.DTypeLike, preferred_element_type: object, *,
                 names: tuple[str, str] = ("x.dtype", "w.dtype")) -> np.dtype:
  """The ops' output dtype: ``preferred_element_type`` (checked) or ``result_type(x, w)``.

  Without ``preferred_element_type``, floating operands of which one is an 8-bit float must have one dtype: JAX
  promotes those to no other float, so ``x`` of ``float8_e4m3fn`` and ``w`` of ``float32`` raise a ``TypeError``
  naming both (``names``) instead of an error from deep inside the op (an integer ``x`` takes a float8 ``w``'s dtype,
  as in ``jnp.matmul``). With it the mix runs, as ``jnp.matmul(x, w, preferred_element_type=...)`` runs it.
  """
  pet = check_preferred_element_type(preferred_element_type)
  x_dtype, w_dtype = jnp.dtype(x_dtype), jnp.dtype(w_dtype)
  floats = jnp.issubdtype(x_dtype, jnp.floating) and jnp.issubdtype(w_dtype, jnp.floating)
  if pet is None and floats and x_dtype != w_dtype and (_narrow_float(x_dtype) or _narrow_float(w_dtype)):
    raise TypeError(
        f"{names[0]} and {names[1]} must be the same dtype when one is an 8-bit float and preferred_element_type is "
        f"not given (JAX promotes those to no other dtype), got {names[0]}={x_dtype} and {names[1]}={w_dtype}. Cast "
        "one operand to the other's dtype, or pass preferred_element_type (the result's dtype), as jnp.matmul wants."
    )
  return pet or jnp.dtype(jnp.result_type(x_dtype, w_dtype))


def dense_reference(x: jax.typing.ArrayLike, w, *, kind: type, precision, preferred_element_type) -> jax.Array:
  """``x @ w.to_dense()`` in ``preferred_element_type`` (default ``result_type(x, w)``): the ops' oracle, for ``w``
  a ``kind`` (its format) and ``x`` of shape ``(..., K)``, any dtype ``jnp.matmul`` takes."""
  check_weight_type(w, kind)
  preferred_element_type = check_preferred_element_type(preferred_element_type)
  precision = check_precision(precision)
  x = as_array(x, name="x")
  check_contraction(x, w.shape[0])
  out_dtype = preferred_element_type or jnp.result_type(x.dtype, w.dtype)
  return matmul(x, w.to_dense(), precision=precision, preferred_element_type=out_dtype)


def matmul(x: jax.Array, w: jax.Array, *, precision: jax.lax.PrecisionLike, preferred_element_type) -> jax.Array:
  """``jnp.matmul`` that sums in ``preferred_element_type`` where that is wider than float32 on every device.

  A GPU's dot of float32 operands sums in float32 whatever the result type (``preferred_element_type=float64`` came
  back float32-accurate, 1e-5 off a float64 product); the operands are cast to the wider type first.
  """
  if preferred_element_type is not None:
    acc = accumulation_dtype(preferred_element_type)
    if jnp.finfo(acc).bits > 32:
      x, w = (a.astype(jnp.promote_types(a.dtype, acc)) for a in (x, w))
  return jnp.matmul(x, w, precision=precision, preferred_element_type=preferred_element_type)


def spec_axes(*entries: Any) -> tuple[str, ...]:
  """The mesh axis names of ``PartitionSpec`` entries (each ``None``, ``P.UNCONSTRAINED``, a name or a tuple of
  names), in order."""
  out: list[str] = []
  for entry in entries:
    if entry is None or entry is jax.sharding.PartitionSpec.UNCONSTRAINED:
      continue
    out.extend((entry,) if isinstance(entry, str) else entry)
  return tuple(out)


def explicit_mesh(a: jax.typing.ArrayLike):
  """The mesh of ``a``'s type when it has explicit axes (``jax.set_mesh`` with ``AxisType.Explicit``), else ``None``."""
  mesh = getattr(jax.typeof(a).sharding, "mesh", None)
  if mesh is None or mesh.empty or jax.sharding.AxisType.Explicit not in mesh.axis_types:
    return None
  return mesh


# Inside ``jax.shard_map(..., check_vma=True)`` (its default) every value's type says over which manual mesh axes it
# varies. JAX infers that for its own primitives; a kernel (``pallas_call``, an FFI call) must be told, a loop's
# carry must start as varying as it ends, and an FFI call takes operands that all vary alike. Outside such a map
# every value varies over no axis and these helpers change nothing.


def varying_axes(*trees: Any) -> tuple[Any, ...]:
  """The manual mesh axes over which any array leaf of ``trees`` varies (``jax.shard_map`` with ``check_vma``)."""
  axes: set = set()
  for leaf in jax.tree.leaves(trees):
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
      axes |= jax.typeof(leaf).mat.varying
  return tuple(sorted(axes, key=str))


def vary(tree: Any, axes: Sequence[Any]) -> Any:
  """``tree``'s array leaves cast (``lax.pcast(..., to="varying")``, no data moves) to vary over ``axes`` too."""

  def one(leaf):
    if not isinstance(leaf, jax.Array):
      return leaf
    missing = tuple(a for a in axes if a not in jax.typeof(leaf).mat.varying)
    return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf

  return jax.tree.map(one, tree)


def vary_alike(*trees: Any) -> tuple[Any, ...]:
  """``trees`` with every array leaf varying over the axes any of them varies over: the operands of one product.

  Called on an op's operands before its ``custom_vjp``: JAX then reduces the cotangent of an operand that did not
  vary (a replicated weight) over the axes it was cast to, as it does for ``x @ w``.
  """
  axes = varying_axes(*trees)
  return tuple(vary(t, axes) for t in trees) if axes else trees


def result_struct(shape: Sequence[int], dtype: jax.typing.DTypeLike, *like: Any) -> jax.ShapeDtypeStruct:
  """A kernel result's ``jax.ShapeDtypeStruct``, varying over the manual mesh axes the operands ``like`` vary over."""
  axes = varying_axes(*like)
  mat = jax.sharding.ManualAxisType(varying=frozenset(axes))
  # A type varying over manual axes names its mesh (the map's); Pallas wants the field set even where none vary.
  sharding = NamedSharding(jax.sharding.get_abstract_mesh(), P()) if axes else None
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding, manual_axis_type=mat)


SYMBOLIC_ROWS = "symbolic"


def row_bucket(m: int) -> int | str:
  """Rows of products that share a tuning decision: powers of two up to 16, then steps of a quarter octave;
  :data:`SYMBOLIC_ROWS` for a symbolic row count (``jax.export`` with shape polymorphism: no route is measured, and
  the router keeps to the XLA routes, which take any row count)."""
  if jax.export.is_symbolic_dim(m):
    return SYMBOLIC_ROWS
  if m <= 16:
    return 1 << max(0, m - 1).bit_length()
  step = (1 << (m.bit_length() - 1)) // 4
  return -(-m // step) * step


def text_table(rows: Sequence[Sequence[str]]) -> str:
  """Rows of strings as left-aligned columns two spaces apart (the first row is the header)."""
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


class FallbackWarning(UserWarning):
  """Base class of jaxsparse's fallback warnings: a faster path cannot run these operands here, another one runs.

  Each backend has its subclass (``PallasFallbackWarning``, ``CpuKernelFallbackWarning``,
  ``CusparseLtFallbackWarning``, ``CudaKernelFallbackWarning``); filter them all at once with this class.

  >>> import warnings, jaxsparse
  >>> warnings.simplefilter("ignore", jaxsparse.FallbackWarning)  # or "error", to make every fallback fail
  >>> warnings.resetwarnings()
  """


_INTERNAL_MODULES = ("jaxsparse", "jax", "jaxlib", "flax", "functools", "contextlib")


def warn_at_caller(message: str, category: type[Warning] = FallbackWarning) -> None:
  """``warnings.warn`` attributed to the first frame outside jaxsparse, jax and flax: the user's call.

  No hand-counted ``stacklevel``: the same warning raised from different depths (an op called directly, inside
  ``jit``, ``grad`` or a layer) points at the user's line each time.
  """
  frame, level = sys._getframe(1), 1
  while frame is not None and (frame.f_globals.get("__name__") or "").split(".")[0] in _INTERNAL_MODULES:
    frame, level = frame.f_back, level + 1
  warnings.warn(message, category, stacklevel=level + 1)


def atomic_write(path: str | os.PathLike, write: Callable[[str], Any]) -> None:
  """Has ``write(tmp)`` fill a new file next to ``path``, then renames it to ``path``.

  Readers see the old file or the complete new one, never a partial one, and a failure leaves no file behind.
  The file gets the mode ``open(path, "w")`` would give it: an existing file's mode, else ``0o666`` less the
  umask, whatever mode ``write`` left (``tempfile.mkstemp`` and safetensors' ``save_file`` leave ``0o600``,
  which other users and serving processes cannot read).

  Args:
    path: the file to write; its directory must exist.
    write: called once with the temporary file's path (an empty file); writes the content there.
  """
  path = os.fspath(path)
  directory, name = os.path.split(os.path.abspath(path))
  while True:  # mkstemp's O_EXCL loop, but with open()'s 0o666, from which the kernel removes the umask
    tmp = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.tmp")
    try:
      os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
      break
    except FileExistsError:
      continue
  try:
    mode = stat.S_IMODE(os.stat(path if os.path.isfile(path) else tmp).st_mode)
    write(tmp)
    os.chmod(tmp, mode)  # write may have replaced the file: safetensors writes its own 0o600 file and renames it
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def check_decay(decay: Any, *, name: str = "decay") -> float:
  """SR-STE's ``decay`` as a finite Python float >= 0 (a static hyperparameter: a concrete NumPy / JAX scalar is
  converted); ``name`` is the argument's name in the errors."""
  if isinstance(decay, jax.core.Tracer):
    raise ValueError(
        f"{name} must be a concrete number: it is a static hyperparameter of the custom gradient, and got the traced "
        f"{decay!r} (e.g. an argument of a jitted function or a schedule's value under jit). Pass a Python float, "
        "close over it, or mark it static (jax.jit(..., static_argnames=...))."
    )
  if isinstance(decay, np.ndarray | jax.Array):  # a 0-d array of a real dtype, e.g. a schedule's value
    real = jnp.issubdtype(decay.dtype, jnp.floating) or jnp.issubdtype(decay.dtype, jnp.integer)
    numeric = decay.ndim == 0 and real
  else:
    numeric = isinstance(decay, numbers.Real) and not isinstance(decay, bool | np.bool_)
  value = float(decay) if numeric else None
  if value is None or not (math.isfinite(value) and value >= 0):
    raise ValueError(f"{name} must be a float >= 0 and finite (0 gives plain STE), got {name}={decay!r}.")
  return value
