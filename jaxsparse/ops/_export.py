"""What ``jax.export`` needs to serialise a function that calls jaxsparse's kernels."""

from __future__ import annotations

import json
from typing import Any

from jax import export

from jaxsparse._cpu import _build as _cpu_build
from jaxsparse._cuda import _build as _cuda_build
from jaxsparse._cuda import _kernels as _cuda_kernels
from jaxsparse.formats._block_sparse import BlockSparseMatrix
from jaxsparse.formats._csr import CSRMatrix
from jaxsparse.formats._nm import NMSparseMatrix

__all__ = ["export_safety_checks"]

# Pallas's Triton kernels lower to this custom call; jax.export does not list it among the stable targets.
_TRITON_TARGET = "__gpu$xla.gpu.triton"


def export_safety_checks() -> list[export.DisabledSafetyCheck]:
  """The custom-call checks ``jax.export`` must skip to serialise a function that calls jaxsparse's kernels.

  ``jax.export.export`` refuses custom calls whose targets have no compatibility guarantee; jaxsparse's C++ CPU kernels
  (``block_sparse_matmul``, ``sparse_matmul``, ``masked_matmul`` on a CPU), its CUDA kernels (the 2:4 decode kernel,
  cuSPARSELt) and Pallas's Triton kernels are such targets (the Mosaic GPU kernels are on JAX's list). Pass these
  checks as ``disabled_checks``. The guarantee is then yours: the exported function runs where the same jaxsparse
  registers the same targets, and the process that calls it must have them registered. This function registers the
  C++ CPU kernels (building them on first use; a machine without a compiler runs the XLA routes, which export
  anyway), so calling it there first is enough on a CPU; on a GPU, the first jaxsparse product of the process
  registers its CUDA kernels.

  A row count left symbolic (shape polymorphism, ``jax.export.symbolic_shape("b, 64")``) runs on the XLA routes,
  which take any number of rows and need no such checks: the kernels' configs and the measured dispatch depend on
  the row count, so export with concrete shapes (one per serving batch size) to keep the kernels.

  ``Exported.serialize`` takes :class:`jaxsparse.BlockSparseMatrix`, :class:`jaxsparse.NMSparseMatrix`,
  :class:`jaxsparse.CSRMatrix` and :class:`jaxsparse.sharding.ShardedBlockSparseMatrix` arguments and results
  (jaxsparse registers their serialization on import; the sharded matrix's mesh is saved as its axes and device ids,
  so it deserializes where those devices exist). A function exported for several devices is called with its
  arguments on them, or under ``jax.set_mesh`` where it takes only unplaced dense arrays. Flax's
  ``nnx.State`` has no such registration (for any layer, dense ones too): pass ``nnx.to_pure_dict(state)`` and
  rebuild inside with ``nnx.replace_by_pure_dict``; Linen variables are plain dicts already.

  >>> import jax, jax.numpy as jnp, jaxsparse
  >>> w = jaxsparse.BlockSparseMatrix.from_dense(jnp.ones((64, 32)), (16, 16))
  >>> f = jax.jit(lambda x: jaxsparse.ops.block_sparse_matmul(x, w))
  >>> exported = jax.export.export(f, disabled_checks=jaxsparse.ops.export_safety_checks())(jnp.ones((2, 64)))
  >>> bool(jnp.allclose(exported.call(jnp.ones((2, 64))), f(jnp.ones((2, 64)))))
  True

  Args:
    None.

  Returns:
    A list of ``jax.export.DisabledSafetyCheck``, one per custom-call target of jaxsparse's kernels.
  """
  _cpu_build.load()
  targets = [*_cpu_build.TARGETS, *_cuda_kernels.TARGETS, *_cuda_build.TARGETS, _TRITON_TARGET]
  return [export.DisabledSafetyCheck.custom_call(t) for t in targets]


def _serialize_aux(aux: tuple[Any, ...]) -> bytes:
  return json.dumps(aux).encode()


def _deserialize_aux(data: bytes) -> tuple[Any, ...]:
  # The aux data are ints and tuples of ints (shapes, block shapes, n, m, axis); JSON gives the tuples back as lists,
  # and the deserialized tree must equal the one the exported function was traced with.
  return tuple(tuple(a) if isinstance(a, list) else a for a in json.loads(data))


# The sparse formats as arguments or results of an exported function (``Exported.serialize`` refuses pytree nodes
# it has no name for): their aux data are static ints, so JSON names them.
for _cls in (BlockSparseMatrix, CSRMatrix, NMSparseMatrix):
  export.register_pytree_node_serialization(
      _cls, serialized_name=f"jaxsparse.{_cls.__name__}", serialize_auxdata=_serialize_aux,
      deserialize_auxdata=_deserialize_aux,
  )
