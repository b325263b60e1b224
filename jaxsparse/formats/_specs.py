"""Sparsity structures (``Unstructured``, ``BlockSparse``, ``NM``) and rules that assign them to paths.

The same vocabulary serves :func:`jaxsparse.sparsify` (which layer becomes which sparse layer) and
:mod:`jaxsparse.pruning` (which parameter gets which mask). A *rule set* is either one structure,
applied everywhere, or a mapping from regular expressions to structures (or ``None``, "keep
dense"); a path takes the structure of the first pattern that matches it in full
(:func:`re.fullmatch`). Paths are dotted: ``"blocks.0.mlp.fc1"`` for a layer,
``"blocks.0.mlp.fc1.kernel"`` for its parameter; a parameter also matches the patterns that match
its layer's path, so one rule set serves both.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import warnings
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import TypeAlias

import jax
import numpy as np
from flax import nnx

from jaxsparse import _utils

__all__ = [
    "NM",
    "BlockSparse",
    "Rules",
    "Spec",
    "Unstructured",
    "check_spec_applies",
    "flatten_with_paths",
    "match_rules",
    "path_str",
    "resolve_rules",
    "warn_unmatched",
]


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
    return f"block {self.block_shape[0]}x{self.block_shape[1]} {self.density:.0%} kept"


@dataclasses.dataclass(frozen=True)
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
  """

  n: int
  m: int

  def __post_init__(self):
    for name in ("n", "m"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={v!r}.")
    if self.n > self.m:
      raise ValueError(f"NM needs n <= m, got n={self.n}, m={self.m}.")

  @property
  def target_sparsity(self) -> float:
    """Fraction of weights pruned, ``1 - n / m``."""
    return 1.0 - self.n / self.m

  def describe(self) -> str:
    return f"{self.n}:{self.m}"


Spec: TypeAlias = Unstructured | BlockSparse | NM
Rules: TypeAlias = Spec | Mapping[str, Spec | None]
_SPECS = (Unstructured, BlockSparse, NM)


def resolve_rules(rules: Any) -> list[tuple[str, re.Pattern, Spec | None]]:
  """``rules`` as ``[(pattern, compiled, spec_or_None)]``, checked; a lone spec matches every path."""
  if isinstance(rules, _SPECS):
    return [(".*", re.compile(".*"), rules)]
  if not isinstance(rules, Mapping):
    raise TypeError(
        "rules must be a sparsity structure (jaxsparse.Unstructured, jaxsparse.BlockSparse, jaxsparse.NM) "
        f"or a mapping from regex to structure, got {type(rules).__name__}."
    )
  if not rules:
    raise ValueError("rules is empty: give at least one {regex: structure} entry.")
  out = []
  for pattern, spec in rules.items():
    if not isinstance(pattern, str):
      raise TypeError(f"rule keys must be regex strings, got {pattern!r}.")
    if spec is not None and not isinstance(spec, _SPECS):
      raise TypeError(
          f"rule {pattern!r} maps to {spec!r}; use jaxsparse.Unstructured(...), jaxsparse.BlockSparse(...), "
          "jaxsparse.NM(...) or None (keep dense)."
      )
    try:
      compiled = re.compile(pattern)
    except re.error as e:
      raise ValueError(f"rule {pattern!r} is not a valid regular expression: {e}.") from e
    out.append((pattern, compiled, spec))
  return out


def match_rules(
    resolved: list[tuple[str, re.Pattern, Spec | None]], path: str, *, owner: str | None = None
) -> int | None:
  """Index of the first rule whose pattern fully matches ``path`` (or ``owner``, when given), or ``None``."""
  for i, (_, compiled, _) in enumerate(resolved):
    if compiled.fullmatch(path) or (owner is not None and compiled.fullmatch(owner)):
      return i
  return None


def warn_unmatched(resolved: list[tuple[str, re.Pattern, Spec | None]], available: Sequence[str], *, what: str) -> None:
  """Warns about the rules whose pattern fully matches none of the ``available`` paths, listing them."""
  unused = [pattern for pattern, compiled, _ in resolved if not any(compiled.fullmatch(p) for p in available)]
  if unused:
    listing = ", ".join(available) if available else "(none)"
    warnings.warn(
        f"rule(s) {unused} matched no {what}; available paths: {listing}.",
        UserWarning,
        stacklevel=3,
    )


def path_str(keypath: Sequence[Any]) -> str:
  """Dotted name of a JAX key path or an NNX path tuple: ``("blocks", 0, "kernel")`` -> ``"blocks.0.kernel"``."""
  parts = []
  for k in keypath:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      parts.append(k.name)
    elif isinstance(k, jax.tree_util.FlattenedIndexKey):
      parts.append(str(k.key))
    else:
      parts.append(str(k))
  return ".".join(parts)


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def flatten_with_paths(tree: Any) -> tuple[list[str], list[Any], Any]:
  """Flattens ``tree`` treating NNX variables as leaves (their values unwrapped).

  Returns:
    ``(paths, leaves, treedef)``; ``jax.tree.unflatten(treedef, leaves)`` rebuilds the tree with plain
    arrays in place of variables, the structure ``nnx.Optimizer`` hands to ``tx.update``.
  """
  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)
  paths = [path_str(kp) for kp, _ in pairs]
  leaves = [v.get_value() if _is_variable(v) else v for _, v in pairs]
  return paths, leaves, treedef


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
  """A kernel of ``shape`` viewed as ``(in, out)``: every axis but the last is an input axis (conv layout)."""
  return (math.prod(shape[:-1]), shape[-1])


def check_spec_applies(spec: Spec, shape: Sequence[int], *, path: str) -> None:
  """Raises a ``ValueError`` naming ``path`` when ``spec`` cannot apply to a kernel of ``shape``."""
  shape = tuple(int(s) for s in shape)
  k, n = matrix_shape(shape)
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
    c = shape[-2]  # groups run along the innermost input axis (in-channels of a conv kernel)
    if c % spec.m:
      raise ValueError(
          f"{path}: N:M sparsity {spec.n}:{spec.m} needs m={spec.m} to divide the input size {c} of its "
          f"{shape} kernel ({c} % {spec.m} = {c % spec.m}); choose another m or give this path another rule."
      )


def as_numpy_bool(mask: Any, *, name: str) -> np.ndarray:
  m = np.asarray(mask)
  if m.dtype != np.bool_:
    raise TypeError(f"{name} must be a boolean array, got dtype {m.dtype}.")
  return m
