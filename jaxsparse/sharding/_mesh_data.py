"""A ``jax.sharding.Mesh`` as plain data (JSON-ready), for the serialized pytrees of the sharded matrices."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType
from jax.sharding import Mesh

__all__ = ["mesh_from_plain", "mesh_to_plain"]


def mesh_to_plain(mesh: Mesh) -> dict[str, Any]:
  """``mesh`` as its axis names, axis types and device ids (lists of str / int)."""
  return {"axis_names": list(mesh.axis_names), "axis_types": [t.name for t in mesh.axis_types],
          "device_ids": mesh.device_ids.tolist()}


def mesh_from_plain(plain: dict[str, Any], what: str) -> Mesh:
  """The mesh :func:`mesh_to_plain` described, on this process's devices of the same ids.

  The devices by id make the result the same (interned) ``Mesh`` as the one serialized where the devices are the same.

  Raises:
    ValueError: naming ``what`` (the serialized object), when this process lacks some of the devices.
  """
  ids = np.asarray(plain["device_ids"], dtype=int)
  by_id = {d.id: d for d in jax.devices()}
  missing = sorted(set(ids.ravel().tolist()) - by_id.keys())
  if missing:
    raise ValueError(
        f"A serialized {what} lies on a mesh of devices {ids.tolist()} (axes {plain['axis_names']}), but this "
        f"process has no devices of ids {missing} (it has {sorted(by_id)}); deserialize it in a process with the "
        "devices it was exported on."
    )
  devices = np.array([by_id[i] for i in ids.ravel().tolist()], dtype=object).reshape(ids.shape)
  return Mesh(devices, tuple(plain["axis_names"]), axis_types=tuple(AxisType[t] for t in plain["axis_types"]))
