"""Flax layers over :mod:`jaxsparse.ops`: NNX modules here, Linen modules in :mod:`jaxsparse.layers.linen`."""

from jaxsparse.layers import linen
from jaxsparse.layers._block_sparse import BlockSparseLinear
from jaxsparse.layers._common import SparsityPattern
from jaxsparse.layers._embed import CompressedNMEmbed
from jaxsparse.layers._linear_general import SparseLinearGeneral
from jaxsparse.layers._masked import MaskedConv
from jaxsparse.layers._masked import MaskedLinear
from jaxsparse.layers._nm import NMConv
from jaxsparse.layers._nm import NMLinear
from jaxsparse.layers._nm_compressed import CompressedNMLinear
from jaxsparse.layers._nm_compressed import CusparseLtKernel
from jaxsparse.layers._nm_compressed import CusparseLtWeight

__all__ = [
    "BlockSparseLinear",
    "CompressedNMEmbed",
    "CompressedNMLinear",
    "CusparseLtKernel",
    "CusparseLtWeight",
    "MaskedConv",
    "MaskedLinear",
    "NMConv",
    "NMLinear",
    "SparseLinearGeneral",
    "SparsityPattern",
    "linen",
]
