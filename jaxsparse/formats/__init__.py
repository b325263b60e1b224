"""Sparse formats (pytrees), the masks that define their patterns, and the pattern specs.

``BlockSparseMatrix`` (kept blocks + index arrays), ``NMSparseMatrix`` (kept values + positions) and
``CSRMatrix`` (unstructured) are what the ops take; ``BlockSparse``, ``NM`` and ``Unstructured`` describe a
pattern for ``jaxsparse.sparsify``, ``jaxsparse.pruning`` and ``jaxsparse.torch_interop``.
"""

from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._csr import CSRMatrix
from jaxsparse.formats._masks import block_magnitude_mask
from jaxsparse.formats._masks import magnitude_mask
from jaxsparse.formats._masks import random_block_mask
from jaxsparse.formats._nm import NMSparseMatrix
from jaxsparse.formats._nm_masks import nm_mask
from jaxsparse.formats._specs import NM
from jaxsparse.formats._specs import BlockSparse
from jaxsparse.formats._specs import Unstructured

__all__ = [
    "NM",
    "BlockSparse",
    "BlockSparseMatrix",
    "CSRMatrix",
    "NMSparseMatrix",
    "Unstructured",
    "block_magnitude_mask",
    "magnitude_mask",
    "nm_mask",
    "random_block_mask",
]
