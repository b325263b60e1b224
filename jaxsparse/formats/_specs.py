"""Sparsity structures (``Unstructured``, ``BlockSparse``, ``NM``): the patterns a rule can assign.

The same vocabulary serves :func:`jaxsparse.sparsify` (which layer becomes which sparse layer),
:mod:`jaxsparse.pruning` (which parameter gets which mask) and :mod:`jaxsparse.torch_interop`; the
rules that map model paths to structures live in :mod:`jaxsparse._rules`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import TypeAlias

from jaxsparse import _utils
from jaxsparse.formats._nm_masks import TRANSPOSABLE_MAX_M

__all__ = ["NM", "BlockSparse", "Spec", "Unstructured", "check_plain_nm", "check_spec_applies", "matrix_shape"]


@dataclasses.dataclass(frozen=True)
class Unstructured:
  """Unstructured sparsity: keep the largest-magnitude weights of each matched kernel.

  >>> import jaxsparse
  >>> jaxsparse.Unstructured(sparsity=0.9)
  Unstructured(sparsity=0.9)

  Attributes:
    sparsity: fraction of weights pruned, in [0, 1); a kernel of ``size`` weights keeps
      ``size - round(sparsity * size)``.
  """

  sparsity: float

  def __post_init__(self):
    object.__setattr__(self, "sparsity", _utils.check_sparsity(self.sparsity))

  @property
  def target_sparsity(self) -> float:
    """Fraction of weights pruned."""
    return self.sparsity

  def describe(self) -> str:
    """The pattern in words, as :func:`jaxsparse.sparsify`'s report prints it.

    >>> import jaxsparse
    >>> jaxsparse.Unstructured(sparsity=0.9).describe()
    'unstructured 90%'
    """
    return f"unstructured {self.sparsity:.0%}"


@dataclasses.dataclass(frozen=True)
class BlockSparse:
  """Block sparsity: keep the ``(bk, bn)`` blocks of largest Frobenius norm.

  >>> import jaxsparse
  >>> jaxsparse.BlockSparse(density=0.25, block_shape=(64, 64))
  BlockSparse(density=0.25, block_shape=(64, 64))

  Attributes:
    density: fraction of blocks kept, in (0, 1]; a kernel of ``blocks`` blocks keeps
      ``round(density * blocks)``.
    block_shape: ``(bk, bn)``; it must divide the kernel, viewed as ``(in_features, out_features)``.
  """

  density: float
  block_shape: tuple[int, int] = (32, 32)

  def __post_init__(self):
    object.__setattr__(self, "density", _utils.check_density(self.density))
    bs = self.block_shape
    if (
        not isinstance(bs, Sequence)
        or len(bs) != 2
        or not all(isinstance(b, numbers.Integral) and not isinstance(b, bool) and b > 0 for b in bs)
    ):
      raise TypeError(f"block_shape must be a pair of positive ints (bk, bn), got block_shape={bs!r}.")
    object.__setattr__(self, "block_shape", (int(bs[0]), int(bs[1])))

  @property
  def target_sparsity(self) -> float:
    """Fraction of blocks pruned, ``1 - density``."""
    return 1.0 - self.density

  def describe(self) -> str:
    """The pattern in words, as :func:`jaxsparse.sparsify`'s report prints it.

    >>> import jaxsparse
    >>> jaxsparse.BlockSparse(density=0.25, block_shape=(64, 64)).describe()
    'block 64x64 25% kept'
    """
    return f"block {self.block_shape[0]}x{self.block_shape[1]} {self.density:.0%} kept"


@dataclasses.dataclass(frozen=True, repr=False)
class NM:
  """N:M sparsity: in every group of ``m`` consecutive inputs of an output, keep the ``n`` largest.

  Groups run along the input (reduction) axis of the kernel, axis 0 of ``(in_features,
  out_features)``; ``m`` must divide ``in_features`` (for a conv kernel ``(..., in, out)``, the
  in-channels).

  >>> import jaxsparse
  >>> jaxsparse.NM(2, 4)
  NM(n=2, m=4)

  Attributes:
    n: weights kept per group, ``1 <= n <= m``.
    m: group size.
    transposable: N:M along the outputs too (:func:`jaxsparse.nm_mask` with ``transposable=True``;
      ``n < m <= 4``, ``m`` dividing the output size): the SR-STE layers :func:`jaxsparse.sparsify` builds
      (``NMLinear`` / ``NMConv``, Linen ``NMDense`` / ``NMConv``) prune with it. The pruning algorithms of
      :mod:`jaxsparse.pruning` and the rules of PyTorch imports compute plain N:M masks and reject it.
  """

  n: int
  m: int
  transposable: bool = False

  def __post_init__(self):
    for name in ("n", "m"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={v!r}.")
    if self.n > self.m:
      raise ValueError(f"NM needs n <= m, got n={self.n}, m={self.m}.")
    if self.transposable is not False and self.transposable is not True:
      raise TypeError(f"transposable must be a bool, got transposable={self.transposable!r}.")
    if self.transposable and not self.n < self.m <= TRANSPOSABLE_MAX_M:
      raise ValueError(
          f"NM(transposable=True) needs n < m <= {TRANSPOSABLE_MAX_M}, got n={self.n}, m={self.m}."
      )

  def __repr__(self) -> str:
    extra = ", transposable=True" if self.transposable else ""
    return f"NM(n={self.n}, m={self.m}{extra})"

  @property
  def target_sparsity(self) -> float:
    """Fraction of weights pruned, ``1 - n / m``."""
    return 1.0 - self.n / self.m

  def describe(self) -> str:
    """The pattern in words, as :func:`jaxsparse.sparsify`'s report prints it.

    >>> import jaxsparse
    >>> jaxsparse.NM(2, 4).describe(), jaxsparse.NM(2, 4, transposable=True).describe()
    ('2:4', '2:4 transposable')
    """
    return f"{self.n}:{self.m}" + (" transposable" if self.transposable else "")


Spec: TypeAlias = Unstructured | BlockSparse | NM
SPECS = (Unstructured, BlockSparse, NM)


def matrix_shape(shape: Sequence[int], in_ndim: int | None = None) -> tuple[int, int]:
  """The 2-D ``(in, out)`` view of a kernel of ``shape``: its first ``in_ndim`` axes are inputs, the rest outputs.

  The one view of a multi-axis kernel that :mod:`jaxsparse.pruning`, :func:`jaxsparse.sparsify` and
  :mod:`jaxsparse.torch_interop` share: blocks and N:M groups are taken on it. ``in_ndim=None`` (a
  ``Linear`` or conv kernel ``(*kernel_size, cin, cout)``) makes every axis but the last an input; a
  ``LinearGeneral`` contracting ``k`` trailing axes has ``in_ndim=k``, so ``nnx.MultiHeadAttention``'s
  q/k/v kernels ``(in, heads, head_dim)`` are ``(in, heads * head_dim)`` and its out kernel
  ``(heads, head_dim, out)`` is ``(heads * head_dim, out)``.

  >>> from jaxsparse.formats._specs import matrix_shape
  >>> matrix_shape((3, 3, 16, 32)), matrix_shape((256, 4, 64), in_ndim=1), matrix_shape((4, 64, 256), in_ndim=2)
  ((144, 32), (256, 256), (256, 256))
  """
  shape = tuple(int(s) for s in shape)
  in_ndim = len(shape) - 1 if in_ndim is None else int(in_ndim)
  if not 0 < in_ndim < len(shape):
    raise ValueError(f"in_ndim={in_ndim} must leave at least one input and one output axis of a {shape} kernel.")
  return (math.prod(shape[:in_ndim]), math.prod(shape[in_ndim:]))


def check_spec_applies(spec: Spec, shape: Sequence[int], *, path: str, in_ndim: int | None = None) -> None:
  """Raises a ``ValueError`` naming ``path`` when ``spec`` cannot apply to a kernel of ``shape``.

  The kernel is taken in the view of :func:`matrix_shape` with ``in_ndim`` input axes.
  """
  shape = tuple(int(s) for s in shape)
  k, n = matrix_shape(shape, in_ndim)
  in_ndim = len(shape) - 1 if in_ndim is None else in_ndim
  if k * n == 0 and not isinstance(spec, NM):  # no sparsity keeps a weight (or block) of an empty kernel
    raise ValueError(
        f"{path}: its {shape} kernel is empty (no weights), so {spec.describe()} cannot keep any; give this path "
        "another rule (None keeps it as it is)."
    )
  if isinstance(spec, Unstructured):
    size = k * n
    kept = size - _utils.kept_count(spec.sparsity, size)
    if kept == 0:
      raise ValueError(
          f"{path}: sparsity={spec.sparsity} prunes all {size} weights of its {shape} kernel; lower the sparsity."
      )
  elif isinstance(spec, BlockSparse):
    bk, bn = spec.block_shape
    if k % bk or n % bn:
      raise ValueError(
          f"{path}: block_shape={spec.block_shape} does not divide its kernel viewed as (in, out) = {(k, n)}; "
          "choose block sizes that divide both, or give this path another rule."
      )
    blocks = (k // bk) * (n // bn)
    if _utils.kept_count(spec.density, blocks) == 0:
      raise ValueError(
          f"{path}: density={spec.density} keeps 0 of its {blocks} blocks of {spec.block_shape}; raise the density."
      )
  elif isinstance(spec, NM):
    c = shape[in_ndim - 1]  # groups run along the innermost input axis (in-channels of a conv kernel)
    if c % spec.m:
      raise ValueError(
          f"{path}: N:M sparsity {spec.n}:{spec.m} needs m={spec.m} to divide the input size {c} of its "
          f"{shape} kernel ({c} % {spec.m} = {c % spec.m}); choose another m or give this path another rule."
      )
    if spec.transposable and n % spec.m:
      raise ValueError(
          f"{path}: transposable N:M sparsity {spec.n}:{spec.m} needs m={spec.m} to divide the output size "
          f"{n} of its {shape} kernel; use NM({spec.n}, {spec.m}) or give this path another rule."
      )


def check_plain_nm(spec: Spec, *, path: str, what: str) -> None:
  """Raises naming ``path`` where ``what`` (which computes plain N:M masks) is given a transposable NM rule."""
  if isinstance(spec, NM) and spec.transposable:
    raise ValueError(
        f"{path}: {what} computes plain N:M masks, got {spec!r}; transposable masks are for the SR-STE layers "
        "of jaxsparse.sparsify (or use NM(n, m) here)."
    )


