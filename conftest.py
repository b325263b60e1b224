"""Test-wide settings (tests and the package's doctests).

Measured dispatch is off unless a test turns it on (``tests/test_tuning.py``): results must not depend on timing
noise. Tuning decisions go to a fresh cache file of this test process, never the user's cache.
"""

import os
import tempfile

import pytest

os.environ.setdefault("JAXSPARSE_AUTOTUNE", "off")
if "JAXSPARSE_AUTOTUNE_CACHE" not in os.environ:
  os.environ["JAXSPARSE_AUTOTUNE_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="jaxsparse-tests-"), "autotune.json")


def pytest_addoption(parser):
  parser.addoption(
      "--shard",
      default=None,
      metavar="I/N",
      help="run only the I-th (1-based) of N interleaved parts of the collected tests: a suite split over device "
      "calls with a time limit each (benchmarks/run_gpu.sh)",
  )


def shard_of(items: list, spec: str) -> tuple[list, list]:
  """``(kept, deselected)`` for ``spec`` ``"I/N"``: every N-th item from the I-th on, in the order of their node ids
  (pytest's own order of parametrized tests can differ between processes); a bad spec raises."""
  try:
    i, n = (int(v) for v in spec.split("/"))
  except ValueError:
    raise ValueError(f"--shard must be I/N with integers I and N, got {spec!r}") from None
  if not 1 <= i <= n:
    raise ValueError(f"--shard I/N needs 1 <= I <= N, got {spec!r}")
  mine = {t.nodeid for k, t in enumerate(sorted(items, key=lambda t: t.nodeid)) if k % n == i - 1}
  return [t for t in items if t.nodeid in mine], [t for t in items if t.nodeid not in mine]


def pytest_collection_modifyitems(config, items):
  spec = config.getoption("--shard")
  if spec:
    try:
      kept, dropped = shard_of(items, spec)
    except ValueError as e:
      raise pytest.UsageError(str(e)) from None
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept
