"""Flax Linen layers; the sparsity pattern lives in the ``"sparsity"`` collection (:data:`SPARSITY`)."""

from jaxsparse.layers._linen import SPARSITY
from jaxsparse.layers._linen import BlockSparseDense
from jaxsparse.layers._linen import MaskedDense

__all__ = [
    "SPARSITY",
    "BlockSparseDense",
    "MaskedDense",
]
