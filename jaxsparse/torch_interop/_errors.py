"""The error every checkpoint reader of :mod:`jaxsparse.torch_interop` raises for a file it cannot use."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
  """A checkpoint that cannot be read or decoded; the message names the file or key and what was expected.

  A subclass of ``ValueError``:

  >>> from jaxsparse import torch_interop
  >>> try:
  ...   torch_interop.load_state_dict("/nonexistent/model.safetensors")
  ... except torch_interop.CheckpointError as e:
  ...   print(e)
  /nonexistent/model.safetensors does not exist.
  """
