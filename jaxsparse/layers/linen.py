"""Flax Linen layers; the sparsity pattern lives in the ``"sparsity"`` collection (:data:`SPARSITY`)."""

from jaxsparse.layers._block_sparse import BlockSparseDense
from jaxsparse.layers._common import SPARSITY
from jaxsparse.layers._masked import MaskedDense
from jaxsparse.layers._nm_linen import NMConv
from jaxsparse.layers._nm_linen import NMDense

__all__ = [
    "SPARSITY",
    "BlockSparseDense",
    "MaskedDense",
    "NMConv",
    "NMDense",
]
