"""A sparse Llama-format LLM end to end (examples/llama): Hugging Face checkpoint -> Flax NNX -> pruned -> back.

An example, not jaxsparse API: ``model.py`` (the decoder and its KV cache), ``checkpoint.py`` (Hugging Face
directories in and out), ``generation.py`` (``generate``), ``prune.py`` (calibrated pruning by decoder layer
and the sparse inference model). Import it with ``examples/`` on ``sys.path``: ``import llama``.
"""

from llama.model import ATTENTION_PROJECTIONS
from llama.model import MLP_PROJECTIONS
from llama.model import PROJECTIONS
from llama.model import KVCache
from llama.model import LlamaConfig
from llama.model import LlamaForCausalLM
from llama.model import init_cache

__all__ = [
    "ATTENTION_PROJECTIONS",
    "MLP_PROJECTIONS",
    "PROJECTIONS",
    "KVCache",
    "LlamaConfig",
    "LlamaForCausalLM",
    "init_cache",
]
