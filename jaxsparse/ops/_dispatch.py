"""Backend choice shared by the ops: ``implementation=None | "xla" | "pallas"``.

``None`` ("auto") picks the Pallas GPU kernel on CUDA and the XLA path elsewhere with
``lax.platform_dependent``, i.e. when lowering for a platform, so ``jit`` and AOT export work; operands
the kernel does not support fall back to XLA with a named warning. ``"pallas"`` that cannot run raises.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax.numpy as jnp
from jax import lax

from jaxsparse import _utils


@dataclasses.dataclass(frozen=True)
class Config:
  """Static (non-differentiable) configuration of one op call."""

  implementation: str  # "xla", "pallas" or "auto" (decided per platform at lowering time)
  precision: lax.PrecisionLike
  out_dtype: jnp.dtype


def import_kernels(module: str) -> ModuleType | None:
  """``jaxsparse.pallas.<module>``, or ``None`` when it cannot be imported here (no Triton/Mosaic bits)."""
  try:
    return importlib.import_module(f"jaxsparse.pallas.{module}")
  except ImportError:
    return None


def check_implementation(implementation: Any, allowed: tuple, kernels: ModuleType | None) -> str:
  """Validates ``implementation``; returns ``"auto"``, ``"xla"`` or ``"pallas"``."""
  if implementation not in allowed:
    raise ValueError(f"implementation must be one of {allowed}, got implementation={implementation!r}.")
  if implementation is None:
    return "auto"
  if implementation == "pallas" and (kernels is None or not kernels.available()):
    reason = "jaxsparse.pallas could not be imported" if kernels is None else kernels.unavailable_reason()
    raise RuntimeError(f"implementation='pallas' was requested but cannot run here: {reason}.")
  return implementation


def dispatch(
    op: str,
    cfg: Config,
    kernels: ModuleType | None,
    xla_fn: Callable,
    pallas_fn: Callable,
    *args,
    preferred: Callable[..., bool] | None = None,
    unsupported_reason: Callable[..., str | None] | None = None,
):
  """Runs ``xla_fn(*args)`` or ``pallas_fn(*args)`` for ``cfg.implementation`` (see the module docstring).

  ``preferred(*args)``, if given, can keep supported operands on XLA in "auto" mode where the kernel is
  known to be slower (no warning then). ``unsupported_reason(*args)`` replaces the kernels' own support check
  where the op's GPU route takes more than its kernels (e.g. re-tiled blocks).
  """
  if cfg.implementation == "xla":
    return xla_fn(*args)
  if cfg.implementation == "pallas":
    return pallas_fn(*args)
  reason = None if kernels is None else (unsupported_reason or kernels.unsupported_reason)(*args)
  if kernels is None or reason is not None:
    if kernels is not None and kernels.available():
      _utils.warn_at_caller(
          f"{op}: the Pallas GPU kernels do not support these operands ({reason}); using the slower XLA path.",
          kernels.PallasFallbackWarning,
      )
    return xla_fn(*args)
  if preferred is not None and not preferred(*args):
    return xla_fn(*args)
  return lax.platform_dependent(*args, cuda=pallas_fn, default=xla_fn)
