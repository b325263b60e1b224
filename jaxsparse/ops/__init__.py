"""Differentiable sparse products (``jax.custom_vjp``) with a Pallas GPU backend and an XLA CPU path."""

from jaxsparse.ops._block_sparse_matmul import Implementation
from jaxsparse.ops._block_sparse_matmul import block_sparse_matmul
from jaxsparse.ops._block_sparse_matmul import block_sparse_matmul_reference
from jaxsparse.ops._masked_matmul import masked_matmul

__all__ = [
    "Implementation",
    "block_sparse_matmul",
    "block_sparse_matmul_reference",
    "masked_matmul",
]
