"""Differentiable sparse products (``jax.custom_vjp``) with a Pallas GPU backend and an XLA CPU path."""

from jaxsparse._cpu._build import CpuKernelFallbackWarning
from jaxsparse.ops._block_sparse_matmul import Implementation
from jaxsparse.ops._block_sparse_matmul import block_sparse_matmul
from jaxsparse.ops._block_sparse_matmul import block_sparse_matmul_reference
from jaxsparse.ops._masked_matmul import masked_matmul
from jaxsparse.ops._nm_matmul import nm_matmul
from jaxsparse.ops._nm_matmul import nm_matmul_reference
from jaxsparse.ops._sparse_matmul import CpuImplementation
from jaxsparse.ops._sparse_matmul import sparse_matmul
from jaxsparse.ops._sparse_matmul import sparse_matmul_reference
from jaxsparse.ops._sr_ste import sr_ste

__all__ = [
    "CpuImplementation",
    "CpuKernelFallbackWarning",
    "Implementation",
    "block_sparse_matmul",
    "block_sparse_matmul_reference",
    "masked_matmul",
    "nm_matmul",
    "nm_matmul_reference",
    "sparse_matmul",
    "sparse_matmul_reference",
    "sr_ste",
]
