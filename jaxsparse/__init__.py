"""jaxsparse: sparse layers for JAX and Flax that are actually faster than dense.

Formats (pytrees), masks, differentiable ops (:mod:`jaxsparse.ops`) and Flax layers
(:mod:`jaxsparse.layers`).
"""

from jaxsparse import layers
from jaxsparse import ops
from jaxsparse._formats import BlockSparseMatrix
from jaxsparse._masks import block_magnitude_mask
from jaxsparse._masks import magnitude_mask
from jaxsparse._masks import random_block_mask

__version__ = "0.1.0"

__all__ = [
    "BlockSparseMatrix",
    "block_magnitude_mask",
    "layers",
    "magnitude_mask",
    "ops",
    "random_block_mask",
]
