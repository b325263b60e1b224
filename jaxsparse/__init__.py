"""jaxsparse: sparse layers for JAX and Flax that are actually faster than dense.

Formats (pytrees: ``BlockSparseMatrix``, ``NMSparseMatrix``, ``CSRMatrix``), masks (``nm_mask``,
``magnitude_mask``, ...), differentiable ops (:mod:`jaxsparse.ops`), Flax NNX and Linen layers
(:mod:`jaxsparse.layers`), pruning and sparse training with optax (:mod:`jaxsparse.pruning`),
``sparsify`` / ``densify`` for existing models with the rule specs ``BlockSparse``, ``NM`` and
``Unstructured``, and PyTorch checkpoint import / mask export (:mod:`jaxsparse.torch_interop`, imported
on demand; it needs torch).
"""

from jaxsparse import layers
from jaxsparse import ops
from jaxsparse import pruning
from jaxsparse import sharding
from jaxsparse._sparsify._linen import densify_linen
from jaxsparse._sparsify._linen import sparsify_linen
from jaxsparse._sparsify._nnx import densify
from jaxsparse._sparsify._nnx import sparsify
from jaxsparse.formats import NM
from jaxsparse.formats import BlockSparse
from jaxsparse.formats import Unstructured
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._csr import CSRMatrix
from jaxsparse.formats._masks import block_magnitude_mask
from jaxsparse.formats._masks import magnitude_mask
from jaxsparse.formats._masks import random_block_mask
from jaxsparse.formats._nm import NMSparseMatrix
from jaxsparse.formats._nm import nm_mask

__version__ = "0.1.0"

__all__ = [
    "NM",
    "BlockSparse",
    "BlockSparseMatrix",
    "CSRMatrix",
    "NMSparseMatrix",
    "block_magnitude_mask",
    "densify",
    "densify_linen",
    "layers",
    "magnitude_mask",
    "nm_mask",
    "ops",
    "pruning",
    "random_block_mask",
    "sharding",
    "sparsify",
    "sparsify_linen",
    "Unstructured",
]
