"""Reading compiled HLO: which collectives a jitted function runs."""

from __future__ import annotations

import re

import jax

# Collectives that move activations between devices; all-reduce is checked separately.
GATHERS = ("all-gather", "all-to-all", "collective-permute")


def compiled_text(fn, *args) -> str:
  return jax.jit(fn).lower(*args).compile().as_text()


def count(text: str, op: str) -> int:
  """Number of HLO instructions ``op`` (``all-reduce`` also matches ``all-reduce-start``)."""
  return len(re.findall(rf"[ )]{op}(?:-start)?\(", text))


def assert_no_gather(text: str, what: str) -> None:
  found = {op: count(text, op) for op in GATHERS if count(text, op)}
  assert not found, f"{what}: the compiled program moves activations between devices: {found}"
