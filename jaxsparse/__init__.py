"""jaxsparse: sparse layers for JAX and Flax that are actually faster than dense.

Formats (pytrees: ``BlockSparseMatrix``, ``NMSparseMatrix``, ``CSRMatrix``), masks (``nm_mask``,
``magnitude_mask``, ...), differentiable ops (:mod:`jaxsparse.ops`), Flax NNX and Linen layers
(:mod:`jaxsparse.layers`), pruning and sparse training with optax (:mod:`jaxsparse.pruning`),
``sparsify`` / ``densify`` for existing models with the rule specs ``BlockSparse``, ``NM`` and
``Unstructured``, ``compress`` / ``compress_linen`` (N:M layers in their inference form), ``summary`` (bytes
and FLOPs against dense) and ``plot_pattern`` (matplotlib), and PyTorch checkpoint import / mask export
(:mod:`jaxsparse.torch_interop`, imported on demand; it needs torch).
"""

from jaxsparse import formats
from jaxsparse import layers
from jaxsparse import ops
from jaxsparse import pruning
from jaxsparse import sharding
from jaxsparse._plot import plot_pattern
from jaxsparse._sparsify._linen import densify_linen
from jaxsparse._sparsify._linen import sparsify_linen
from jaxsparse._sparsify._linen_compress import compress_linen
from jaxsparse._sparsify._nnx import sparsify
from jaxsparse._sparsify._nnx_convert import compress
from jaxsparse._sparsify._nnx_convert import densify
from jaxsparse._sparsify._route import LayerSignature
from jaxsparse._sparsify._route import SignatureTiming
from jaxsparse._sparsify._route import layer_signature
from jaxsparse._sparsify._route import route_slower_to_dense
from jaxsparse._sparsify._route import route_slower_to_dense_linen
from jaxsparse._summary import LayerSummary
from jaxsparse._summary import ModelSummary
from jaxsparse._summary import summary
from jaxsparse._tuning import AutotuneCacheWarning
from jaxsparse._tuning import SlowerThanDenseWarning
from jaxsparse._tuning import autotune
from jaxsparse._tuning import autotune_mode
from jaxsparse._tuning import export_cache as export_tuning_cache
from jaxsparse._tuning import import_cache as import_tuning_cache
from jaxsparse._tuning import set_autotune_mode
from jaxsparse._utils import FallbackWarning
from jaxsparse.formats import NM
from jaxsparse.formats import BlockSparse
from jaxsparse.formats import BlockSparseMatrix
from jaxsparse.formats import CSRMatrix
from jaxsparse.formats import NMSparseMatrix
from jaxsparse.formats import Unstructured
from jaxsparse.formats import block_magnitude_mask
from jaxsparse.formats import magnitude_mask
from jaxsparse.formats import nm_mask
from jaxsparse.formats import random_block_mask

__version__ = "0.1.0"

__all__ = [
    "AutotuneCacheWarning",
    "NM",
    "BlockSparse",
    "BlockSparseMatrix",
    "CSRMatrix",
    "FallbackWarning",
    "LayerSignature",
    "LayerSummary",
    "ModelSummary",
    "NMSparseMatrix",
    "SignatureTiming",
    "SlowerThanDenseWarning",
    "block_magnitude_mask",
    "autotune",
    "autotune_mode",
    "compress",
    "compress_linen",
    "densify",
    "densify_linen",
    "export_tuning_cache",
    "formats",
    "import_tuning_cache",
    "layer_signature",
    "layers",
    "magnitude_mask",
    "nm_mask",
    "ops",
    "plot_pattern",
    "pruning",
    "random_block_mask",
    "route_slower_to_dense",
    "route_slower_to_dense_linen",
    "set_autotune_mode",
    "sharding",
    "sparsify",
    "sparsify_linen",
    "summary",
    "Unstructured",
]
