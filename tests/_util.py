"""Shared test helpers: tolerances per dtype, relative-error checks, the fast / slow split of hypothesis examples."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

# Relative Frobenius error allowed against a float32 reference computed on the same (rounded) inputs.
# f32: products accumulate in f32 in a different order than the dense reference.
# bf16: outputs and gradients are rounded to bf16 (8 bits of mantissa, ~4e-3 relative per entry).
RTOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1.5e-2, jnp.dtype(jnp.float16): 4e-3}


def rel_err(actual, expected) -> float:
  a = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  e = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
  assert a.shape == e.shape, (a.shape, e.shape)
  assert np.all(np.isfinite(a)), "non-finite values in result"
  denom = max(np.linalg.norm(e), 1e-30)
  return float(np.linalg.norm(a - e) / denom)


def assert_close(actual, expected, dtype, *, factor: float = 1.0):
  tol = RTOL[jnp.dtype(dtype)] * factor
  err = rel_err(actual, expected)
  assert err <= tol, f"relative error {err:.3e} > {tol:.1e} for {jnp.dtype(dtype).name}"


# A hypothesis test's examples in two runs of fresh examples, each of its max_examples: one in the fast set, one with
# `make test-slow` (long: moved out of the fast set (make test <= 15 min on 2 cores); CI runs it). The test takes an
# ``examples`` argument ("fast" or "more") and ignores it.
SPLIT_EXAMPLES = pytest.mark.parametrize("examples", ["fast", pytest.param("more", marks=pytest.mark.slow)])
