"""Flax Linen layers; the sparsity pattern lives in the ``"sparsity"`` collection (:data:`SPARSITY`).

>>> import jax, jax.numpy as jnp
>>> from jaxsparse.layers.linen import SPARSITY, MaskedDense
>>> variables = MaskedDense(8, sparsity=0.5).init(jax.random.key(0), jnp.ones((1, 16)))
>>> sorted(variables), variables[SPARSITY]["mask"].shape
(['params', 'sparsity'], (16, 8))
"""

from jaxsparse.layers import _common
from jaxsparse.layers._block_sparse import BlockSparseDense
from jaxsparse.layers._embed_linen import CompressedNMEmbed
from jaxsparse.layers._masked import MaskedDense
from jaxsparse.layers._nm_linen import NMConv
from jaxsparse.layers._nm_linen import NMDense
from jaxsparse.layers._nm_linen_compressed import CompressedNMDense
from jaxsparse.layers._nm_linen_compressed import check_restored

__all__ = [
    "SPARSITY",
    "BlockSparseDense",
    "CompressedNMDense",
    "CompressedNMEmbed",
    "MaskedDense",
    "NMConv",
    "NMDense",
    "check_restored",
]

#: The name (``"sparsity"``) of the Linen variable collection holding a layer's sparsity pattern, beside
#: ``"params"`` (:class:`BlockSparseDense`'s block index arrays, :class:`MaskedDense`'s ``"mask"``,
#: :class:`CompressedNMDense`'s ``"kernel_positions"``, :class:`CompressedNMEmbed`'s ``"embedding_positions"``).
#: ``init`` returns it; pass it back to ``apply`` with the parameters. It is not trainable: differentiate and update
#: only ``variables["params"]``.
SPARSITY = _common.SPARSITY
