"""Pallas GPU kernels behind :mod:`jaxsparse.ops` (one op per module, each with its tile config).

``jaxsparse.ops.block_sparse_matmul`` picks these kernels on CUDA GPUs; call them directly only to
pick a tile config or to run them in interpret mode. The block-sparse configs come from measured
per-GPU-kind tables (:class:`DispatchRules`, :func:`dispatch_rules`).
"""

from jaxsparse.pallas._block_sparse_config import BlockSparseMatmulConfig
from jaxsparse.pallas._block_sparse_matmul_mgpu import MosaicKernelConfig
from jaxsparse.pallas._block_sparse_sdd_mgpu import MosaicSddConfig
from jaxsparse.pallas._common import PallasFallbackWarning
from jaxsparse.pallas._dispatch_rules import DispatchRules
from jaxsparse.pallas._dispatch_rules import dispatch_rules
from jaxsparse.pallas._kernel_config import KernelConfig
from jaxsparse.pallas._nm_matmul import NMMatmulConfig

__all__ = [
    "BlockSparseMatmulConfig",
    "DispatchRules",
    "KernelConfig",
    "MosaicKernelConfig",
    "MosaicSddConfig",
    "NMMatmulConfig",
    "PallasFallbackWarning",
    "dispatch_rules",
]
