"""Measured dispatch (autotuning) of the sparse products, with a persistent cache.

The routers of the ops (:mod:`jaxsparse.ops`) time each product's candidate routes the first time its
signature is traced (in ``"tune"`` mode, the default on GPUs) and remember the fastest in an in-process memo and
a JSON file; :func:`autotune` does it ahead of time for a whole step function.
"""

from jaxsparse._tuning._api import autotune
from jaxsparse._tuning._cache import AutotuneCacheWarning
from jaxsparse._tuning._cache import autotune_mode
from jaxsparse._tuning._cache import cache_path
from jaxsparse._tuning._cache import export_cache
from jaxsparse._tuning._cache import import_cache
from jaxsparse._tuning._cache import set_autotune_mode
from jaxsparse._tuning._measure import Candidate
from jaxsparse._tuning._measure import DenseProduct
from jaxsparse._tuning._measure import SlowerThanDenseWarning
from jaxsparse._tuning._measure import choose
from jaxsparse._tuning._measure import random_operand
from jaxsparse._tuning._measure import recorded_decision
from jaxsparse._tuning._measure import train_step
from jaxsparse._tuning._measure import will_measure

__all__ = [
    "AutotuneCacheWarning",
    "Candidate",
    "DenseProduct",
    "SlowerThanDenseWarning",
    "autotune",
    "autotune_mode",
    "cache_path",
    "choose",
    "export_cache",
    "import_cache",
    "random_operand",
    "recorded_decision",
    "set_autotune_mode",
    "train_step",
    "will_measure",
]
