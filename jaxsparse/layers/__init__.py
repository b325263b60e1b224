"""Flax layers over :mod:`jaxsparse.ops`: NNX modules here, Linen modules in :mod:`jaxsparse.layers.linen`."""

from jaxsparse.layers import linen
from jaxsparse.layers._nm_nnx import CompressedNMLinear
from jaxsparse.layers._nm_nnx import CusparseLtWeight
from jaxsparse.layers._nm_nnx import NMConv
from jaxsparse.layers._nm_nnx import NMLinear
from jaxsparse.layers._nnx import BlockSparseLinear
from jaxsparse.layers._nnx import MaskedLinear
from jaxsparse.layers._nnx import SparsityPattern

__all__ = [
    "BlockSparseLinear",
    "CompressedNMLinear",
    "CusparseLtWeight",
    "MaskedLinear",
    "NMConv",
    "NMLinear",
    "SparsityPattern",
    "linen",
]
