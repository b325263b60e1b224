"""Test-wide settings (tests and the package's doctests).

Measured dispatch is off unless a test turns it on (``tests/test_tuning.py``): results must not depend on timing
noise. Tuning decisions go to a fresh cache file of this test process, never the user's cache.
"""

import os
import tempfile

os.environ.setdefault("JAXSPARSE_AUTOTUNE", "off")
if "JAXSPARSE_AUTOTUNE_CACHE" not in os.environ:
  os.environ["JAXSPARSE_AUTOTUNE_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="jaxsparse-tests-"), "autotune.json")
