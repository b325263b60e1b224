"""``compress_linen``: the N:M layers of a :func:`~jaxsparse.sparsify_linen` model in their inference form.

The Linen side of :func:`jaxsparse.compress`: every ``NMDense`` (an ``nn.Dense`` or ``nn.DenseGeneral`` under an
``NM`` rule) becomes a :class:`~jaxsparse.layers.linen.CompressedNMDense` holding the kept values and their
positions; the plan of the returned :class:`~jaxsparse._sparsify._linen.SparsifiedLinen` says so, and
``apply``, ``init``, :func:`~jaxsparse.densify_linen` and :func:`~jaxsparse.summary` follow it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import flax.linen as nn

from jaxsparse._sparsify._linen import SparsifiedLinen
from jaxsparse._sparsify._linen_plan import _nested_set
from jaxsparse._sparsify._linen_plan import _to_dict
from jaxsparse._sparsify._linen_plan import compressed_variables
from jaxsparse._sparsify._linen_plan import layer_variables
from jaxsparse._sparsify._linen_stacks import carry_stack
from jaxsparse.formats._specs import NM
from jaxsparse.layers import linen as sparse_linen
from jaxsparse.layers._nm_compressed import check_nm_implementation
from jaxsparse.ops import NMImplementation

__all__ = ["compress_linen"]


def _check_compressible(module: nn.Module, path: str) -> None:
  """Raises for an ``nn.Dense`` / ``nn.DenseGeneral`` whose product ``nm_matmul`` would not compute."""
  defaults = {f.name: f.default for f in dataclasses.fields(type(module))}
  custom = [name for name in ("dot_general", "dot_general_cls") if getattr(module, name) is not defaults[name]]
  if custom:
    raise ValueError(
        f"{path or '(the model itself)'}: its {', '.join(custom)} is not Flax's default; CompressedNMDense multiplies "
        "with jaxsparse.ops.nm_matmul and would compute another function. Keep the model's NMDense form (the "
        "SparsifiedLinen of sparsify_linen), or build the layer with Flax's default product."
    )


def compress_linen(
    sparse: SparsifiedLinen, variables: Mapping, *, implementation: NMImplementation | None = None
) -> tuple[SparsifiedLinen, dict]:
  """Runs every N:M ``nn.Dense`` / ``nn.DenseGeneral`` of a :func:`~jaxsparse.sparsify_linen` model compressed.

  The Linen version of :func:`jaxsparse.compress`: each layer that ``sparsify_linen`` runs as an SR-STE
  ``NMDense`` (dense kernel, pruned in every call) runs as a :class:`~jaxsparse.layers.linen.CompressedNMDense`,
  which stores only the kept values and their positions (2:4 in 16 bits: 0.5625x the dense bytes) and multiplies
  them with :func:`jaxsparse.ops.nm_matmul`. The outputs stay the same (up to the products' rounding).
  ``NMConv`` layers and the block-sparse and masked layers stay as they are; layers already compressed are kept,
  with this ``implementation``. A stack of N:M layers (``nn.scan`` over layers) is compressed layer by layer, its
  values and positions stacked on the layer axes. Works on abstract variables too (``jax.eval_shape``), and the
  returned module's ``init`` makes compressed variables, so an orbax checkpoint of them restores into
  ``jax.eval_shape(module.init, key, x)``.

  >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxsparse
  >>> model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(16)])
  >>> x = jnp.ones((4, 32))
  >>> variables = model.init(jax.random.key(0), x)
  >>> sparse, sparse_vars, _ = jaxsparse.sparsify_linen(model, variables, jaxsparse.NM(2, 4), x)
  >>> small, small_vars = jaxsparse.compress_linen(sparse, sparse_vars)
  >>> jax.tree.map(jnp.shape, small_vars)["params"]["layers_0"]
  {'bias': (64,), 'kernel': (16, 64)}
  >>> bool(jnp.allclose(small.apply(small_vars, x), sparse.apply(sparse_vars, x), atol=1e-5))
  True

  Args:
    sparse: the ``SparsifiedLinen`` that :func:`~jaxsparse.sparsify_linen` (or ``compress_linen``) returned.
    variables: its variables (``"params"``, ``"sparsity"`` and any other collections); not modified.
    implementation: backend of :func:`jaxsparse.ops.nm_matmul` for the compressed layers: ``None`` (it picks),
      ``"xla"``, ``"pallas"`` or ``"cusparselt"``.

  Returns:
    ``(module, variables)``: a ``SparsifiedLinen`` whose plan runs the N:M dense layers as ``CompressedNMDense``,
    and a new dict of variables in which each of them holds ``params.kernel`` ``(K * n // m, N)`` (the kept values;
    ``(K, N)`` the kernel as the 2-D layer sees it, an ``nn.DenseGeneral``'s flattened), its bias and
    ``sparsity.kernel_positions`` (packed positions, unsigned ints). ``nn.Partitioned`` boxes carry over.

  Raises:
    TypeError: ``sparse`` is not a ``SparsifiedLinen``, or ``variables`` not a dict with ``"params"``.
    ValueError: an unknown ``implementation``, or an N:M layer with a custom ``dot_general`` /
      ``dot_general_cls`` (naming its path); nothing is compressed then.
  """
  if not isinstance(sparse, SparsifiedLinen):
    raise TypeError(f"sparse must be the SparsifiedLinen that jaxsparse.sparsify_linen returned, got "
                    f"{type(sparse).__name__}.")
  if not isinstance(variables, Mapping) or "params" not in variables:
    what = sorted(variables) if isinstance(variables, Mapping) else type(variables).__name__
    raise TypeError(f"variables must be the Linen variables of sparse (a dict with 'params'), got {what}.")
  check_nm_implementation(implementation)
  new_vars = _to_dict(variables)
  layers, compressed = dict(sparse.layers), []
  for path, layer in sparse.layers.items():  # every layer first: an error leaves nothing half done
    if layer.kind == "conv" or not isinstance(layer.spec, NM):
      continue
    layers[path] = dataclasses.replace(layer, compressed=True, implementation=implementation)
    if layer.compressed:
      continue
    _check_compressible(layer.module, ".".join(path))
    boxed = layer_variables(new_vars, path)
    compressed.append((path, carry_stack(boxed["params"], compressed_variables(layer, boxed), layer.stack)))
  for path, layer_vars in compressed:
    _nested_set(new_vars["params"], path, layer_vars["params"])
    _nested_set(new_vars.setdefault(sparse_linen.SPARSITY, {}), path, layer_vars[sparse_linen.SPARSITY])
  return SparsifiedLinen(sparse.module, layers, sparse.dense_layers), new_vars
