"""Differentiable sparse products (``jax.custom_vjp``) with a Pallas GPU backend and an XLA CPU path."""

from jaxsparse._cpu._build import CpuKernelFallbackWarning
from jaxsparse._cuda._build import CusparseLtFallbackWarning
from jaxsparse._cuda._kernels import CudaKernelFallbackWarning
from jaxsparse.ops._block_sparse_matmul import Implementation
from jaxsparse.ops._block_sparse_matmul import block_sparse_matmul
from jaxsparse.ops._block_sparse_matmul import block_sparse_matmul_reference
from jaxsparse.ops._export import export_safety_checks
from jaxsparse.ops._masked_matmul import masked_matmul
from jaxsparse.ops._nm_matmul import NMImplementation
from jaxsparse.ops._nm_matmul import cusparselt_available
from jaxsparse.ops._nm_matmul import cusparselt_compress
from jaxsparse.ops._nm_matmul import nm_matmul
from jaxsparse.ops._nm_matmul import nm_matmul_reference
from jaxsparse.ops._sparse_matmul import CpuImplementation
from jaxsparse.ops._sparse_matmul import sparse_matmul
from jaxsparse.ops._sparse_matmul import sparse_matmul_reference
from jaxsparse.ops._sr_ste import sr_ste
from jaxsparse.ops._sr_ste import sr_ste_matmul

__all__ = [
    "CpuImplementation",
    "CpuKernelFallbackWarning",
    "CudaKernelFallbackWarning",
    "CusparseLtFallbackWarning",
    "Implementation",
    "NMImplementation",
    "block_sparse_matmul",
    "block_sparse_matmul_reference",
    "cusparselt_available",
    "cusparselt_compress",
    "export_safety_checks",
    "masked_matmul",
    "nm_matmul",
    "nm_matmul_reference",
    "sparse_matmul",
    "sparse_matmul_reference",
    "sr_ste",
    "sr_ste_matmul",
]
