"""PyTorch interop: import (sparse) PyTorch checkpoints into jaxsparse Flax models and send masks back.

``import torch`` happens only when one of these functions runs; ``import jaxsparse`` never needs it.

Import: :func:`load_state_dict` reads a checkpoint safely (safetensors, or ``torch.load(weights_only=True)``
only); :func:`decode_checkpoint` recognises the sparse formats of ``torch.nn.utils.prune``,
``torch.ao.pruning``, apex ASP, torch sparse tensors, 2:4 semi-structured tensors, huggingface
``pytorch_block_sparse``, SparseProp and NM-sparsity; :func:`load_nnx` loads it into a Flax NNX model,
turning sparse layers into ``MaskedLinear`` / ``BlockSparseLinear`` / ``NMLinear``;
:func:`to_linen_variables` builds Linen variables.

Export: :func:`export_masks` + :func:`apply_masks` (``torch.nn.utils.prune.custom_from_mask``) and
:func:`export_state_dict` (masked dense, ``prune``, ``torch.ao`` parametrization, BSR, 2:4 layouts).

>>> import torch, torch.nn.utils.prune as prune
>>> from flax import nnx
>>> from jaxsparse import torch_interop
>>> net = torch.nn.Sequential(torch.nn.Linear(64, 64))
>>> _ = prune.custom_from_mask(net[0], "weight", torch.eye(2).kron(torch.ones(32, 32)))  # 2 of 4 blocks
>>> model = nnx.Sequential(nnx.Linear(64, 64, rngs=nnx.Rngs(0)))
>>> report = torch_interop.load_nnx(model, net.state_dict(), name_map=[(r"^", "layers.")])
>>> print(report)
flax path  torch module  layer              format                pattern      density
layers.0   0             BlockSparseLinear  torch.nn.utils.prune  block 32x32  0.500
>>> masks = torch_interop.export_masks(model, torch_names=report.torch_names, dtype=torch.float32)
>>> bool(torch.equal(masks["0.weight_mask"], net[0].weight_mask))
True
"""

from jaxsparse.torch_interop._decode import TorchParam
from jaxsparse.torch_interop._decode import decode_checkpoint
from jaxsparse.torch_interop._export import apply_masks
from jaxsparse.torch_interop._export import export_masks
from jaxsparse.torch_interop._export import export_state_dict
from jaxsparse.torch_interop._files import load_flax_variables
from jaxsparse.torch_interop._files import save_flax_variables
from jaxsparse.torch_interop._flax import load_nnx
from jaxsparse.torch_interop._import_rules import apply_rules
from jaxsparse.torch_interop._linen import to_linen_variables
from jaxsparse.torch_interop._load import CheckpointError
from jaxsparse.torch_interop._load import load_state_dict
from jaxsparse.torch_interop._names import LayerLoad
from jaxsparse.torch_interop._names import LoadReport
from jaxsparse.torch_interop._names import map_name
from jaxsparse.torch_interop._patterns import Pattern
from jaxsparse.torch_interop._patterns import detect_pattern

__all__ = [
    "CheckpointError",
    "LayerLoad",
    "LoadReport",
    "Pattern",
    "TorchParam",
    "apply_masks",
    "apply_rules",
    "decode_checkpoint",
    "detect_pattern",
    "export_masks",
    "export_state_dict",
    "load_flax_variables",
    "load_nnx",
    "load_state_dict",
    "map_name",
    "save_flax_variables",
    "to_linen_variables",
]
