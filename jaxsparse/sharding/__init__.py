"""Block-sparse layers past one device: tensor-parallel layouts of a ``BlockSparseMatrix``.

Data parallelism needs nothing from here: every op in :mod:`jaxsparse.ops` partitions over the
leading dims of its activations under ``jax.jit`` with sharded inputs (see ``docs/guides/large_models.md``).
"""

from jaxsparse.sharding._layers import TensorParallelBlockSparseLinear
from jaxsparse.sharding._tensor_parallel import ShardedBlockSparseMatrix
from jaxsparse.sharding._tensor_parallel import column_parallel_matmul
from jaxsparse.sharding._tensor_parallel import megatron_mlp
from jaxsparse.sharding._tensor_parallel import row_parallel_matmul
from jaxsparse.sharding._tensor_parallel import shard_block_sparse

__all__ = [
    "ShardedBlockSparseMatrix",
    "TensorParallelBlockSparseLinear",
    "column_parallel_matmul",
    "megatron_mlp",
    "row_parallel_matmul",
    "shard_block_sparse",
]
