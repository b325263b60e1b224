"""Test-wide settings.

Measured dispatch is off unless a test turns it on (``tests/test_tuning.py``): results must not depend on timing
noise, and no test may write the user's tuning cache.
"""

import os

os.environ.setdefault("JAXSPARSE_AUTOTUNE", "off")
os.environ.setdefault("JAXSPARSE_AUTOTUNE_CACHE", os.path.join(os.path.dirname(__file__), ".autotune-test-cache.json"))
