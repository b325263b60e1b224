"""Pruning and sparse training: scores, masks, schedules, SET/RigL, an optax wrapper, and post-training
pruning with calibration data (magnitude, Wanda, SparseGPT: :func:`calibrated_prune`).

Train a dense Flax model with ``tx = pruning.wrap_optax(optax.adam(...), pruner)``; the wrapper keeps
the masks in its state, recomputes them on the pruner's schedule and keeps pruned weights at zero.
Read the masks with :func:`get_masks` and turn the trained model into sparse layers with
``jaxsparse.sparsify(model, rules, masks=masks)``.

>>> import jax, jax.numpy as jnp, optax, jaxsparse
>>> from flax import nnx
>>> from jaxsparse import pruning
>>> model = nnx.Sequential(nnx.Linear(32, 64, rngs=nnx.Rngs(0)), jax.nn.relu, nnx.Linear(64, 4, rngs=nnx.Rngs(1)))
>>> rules = {r"layers\\.0": jaxsparse.BlockSparse(density=0.25, block_shape=(8, 8)),
...          r".*": jaxsparse.Unstructured(sparsity=0.5)}
>>> pruner = pruning.magnitude_pruner(rules, pruning.gradual(begin_step=0, end_step=20, update_every=5))
>>> optimizer = nnx.Optimizer(model, pruning.wrap_optax(optax.adam(1e-2), pruner), wrt=nnx.Param)
>>> @nnx.jit
... def train_step(model, optimizer, x):
...   grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
...   optimizer.update(model, grads)
>>> for _ in range(25):
...   train_step(model, optimizer, jnp.ones((8, 32)))
>>> {path: round(1 - float(m.mean()), 2) for path, m in pruning.masks_to_dict(pruning.get_masks(optimizer)).items()}
{'layers.0.kernel': 0.75, 'layers.2.kernel': 0.5}
>>> sparse, report = jaxsparse.sparsify(model, rules, masks=pruning.get_masks(optimizer))
>>> type(sparse.layers[0]).__name__
'BlockSparseLinear'
"""

from jaxsparse._rules import masks_to_dict
from jaxsparse.formats import NM
from jaxsparse.formats import BlockSparse
from jaxsparse.formats import Unstructured
from jaxsparse.pruning._apply import apply_masks
from jaxsparse.pruning._calibration import LayerStats
from jaxsparse.pruning._calibration import TableStats
from jaxsparse.pruning._calibration_linen import calibrate_linen
from jaxsparse.pruning._calibration_nnx import calibrate
from jaxsparse.pruning._dst import cosine_drop_fraction
from jaxsparse.pruning._dst import rigl_pruner
from jaxsparse.pruning._dst import set_pruner
from jaxsparse.pruning._layer_masks import layer_masks
from jaxsparse.pruning._oneshot import CalibratedPruneReport
from jaxsparse.pruning._oneshot import LayerPruned
from jaxsparse.pruning._oneshot import calibrated_prune
from jaxsparse.pruning._oneshot import calibrated_prune_linen
from jaxsparse.pruning._oneshot import sparsegpt
from jaxsparse.pruning._oneshot import wanda
from jaxsparse.pruning._optax import Pruner
from jaxsparse.pruning._optax import PruningState
from jaxsparse.pruning._optax import get_masks
from jaxsparse.pruning._optax import magnitude_pruner
from jaxsparse.pruning._optax import wrap_optax
from jaxsparse.pruning._refit import refit_layer
from jaxsparse.pruning._schedules import Schedule
from jaxsparse.pruning._schedules import gradual
from jaxsparse.pruning._schedules import one_shot
from jaxsparse.pruning._schedules import periodic
from jaxsparse.pruning._schedules import polynomial_sparsity
from jaxsparse.pruning._scores import block_magnitude_scores
from jaxsparse.pruning._scores import magnitude_masks
from jaxsparse.pruning._scores import magnitude_scores
from jaxsparse.pruning._sparsegpt import SparseGPTResult
from jaxsparse.pruning._sparsegpt import reconstruction_error
from jaxsparse.pruning._sparsegpt import sparsegpt_layer
from jaxsparse.pruning._stacks import layer_stacks
from jaxsparse.pruning._views import kernel_views
from jaxsparse.pruning._wanda import magnitude_layer
from jaxsparse.pruning._wanda import wanda_layer

__all__ = [
    "NM",
    "BlockSparse",
    "CalibratedPruneReport",
    "LayerPruned",
    "LayerStats",
    "Pruner",
    "PruningState",
    "Schedule",
    "SparseGPTResult",
    "TableStats",
    "Unstructured",
    "apply_masks",
    "block_magnitude_scores",
    "calibrate",
    "calibrate_linen",
    "calibrated_prune",
    "calibrated_prune_linen",
    "cosine_drop_fraction",
    "get_masks",
    "gradual",
    "kernel_views",
    "layer_masks",
    "layer_stacks",
    "magnitude_layer",
    "magnitude_masks",
    "magnitude_pruner",
    "magnitude_scores",
    "masks_to_dict",
    "one_shot",
    "periodic",
    "polynomial_sparsity",
    "reconstruction_error",
    "refit_layer",
    "rigl_pruner",
    "set_pruner",
    "sparsegpt",
    "sparsegpt_layer",
    "wanda",
    "wanda_layer",
    "wrap_optax",
]
