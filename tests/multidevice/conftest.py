"""Tests that need 4 devices; `tests/test_multidevice.py` runs them in a subprocess with 4 host CPU devices.

Run by hand: ``XLA_FLAGS=--xla_force_host_platform_device_count=4 pytest tests/multidevice/md_*.py``. The
files are named ``md_*.py`` so that the main (single-device) pytest run does not collect them as tests.
"""

import jax
import pytest


@pytest.fixture(autouse=True)
def _four_devices():
  if jax.device_count() < 4:
    pytest.fail(
        f"tests/multidevice needs 4 devices, found {jax.device_count()}: set "
        "XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax is imported (tests/test_multidevice.py does)."
    )
