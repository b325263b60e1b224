"""Puts ``benchmarks/`` on ``sys.path``, so that the sweeps import ``_gpu_timing`` and the op table's helpers."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
