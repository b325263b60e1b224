"""Tests that need 4 devices; `tests/test_multidevice.py` runs them in a subprocess with 4 host CPU devices.

Run by hand: ``XLA_FLAGS=--xla_force_host_platform_device_count=4 pytest tests/multidevice/md_*.py``.
"""

import jax

if jax.device_count() < 4:
  raise RuntimeError(
      f"tests/multidevice needs 4 devices, found {jax.device_count()}: set "
      "XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax is imported (tests/test_multidevice.py does)."
  )
