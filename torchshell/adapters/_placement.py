"""Where batches go: the mesh's data axis, split row-wise (one step) or per window."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

import bridge
import jaxcore

__all__ = ["Placement"]


class Placement:
    """Where one step's batch goes: the mesh's data axis, its shardings, the transfer counts.

    Args:
        mesh: the device mesh.
        data_axis: the mesh axis the batch is split over.
        steps_per_call: K of a ``[K, B, ...]`` batch viewed as K steps.

    Example:
        >>> import jaxcore
        >>> p = Placement(jaxcore.make_mesh({"data": -1}), "data", 1)
        >>> n = 2 * p.ways  # (rows a full batch has on this mesh)
        >>> p.global_rows(n - 1) == n, p.full_mask(n).shape == (n,)
        (True, True)
    """

    def __init__(self, mesh: Mesh, data_axis: str, steps_per_call: int) -> None:
        self.mesh = mesh
        self.data_axis = data_axis
        self.ways = int(mesh.shape[data_axis])  # devices along the data axis (read per batch)
        self.batch = jaxcore.batch_sharding(mesh, data_axis=data_axis)
        self.stacked = jaxcore.batch_sharding(
            mesh, data_axis=data_axis, steps_per_call=steps_per_call
        )
        self.window = jaxcore.batch_sharding(mesh, data_axis=data_axis, steps_per_call=2)
        self.stats = bridge.new_stats()
        self._masks: dict[Any, jax.Array] = {}

    def global_rows(self, n: int) -> int:
        """``n`` rounded up to the data axis: the rows of the padded batch."""
        return bridge.round_up(n, self.ways)

    def full_mask(self, n: int) -> jax.Array:
        """An all-true ``mask`` of ``n`` rows, made on device once (not handed over per step)."""
        mask = self._masks.get(n)
        if mask is None:
            mask = self._masks[n] = jax.device_put(np.ones(n, bool), self.batch)
        return mask

    def window_mask(self, k: int, n: int) -> jax.Array:
        """An all-true ``[k, n]`` mask for K full batches in one call."""
        mask = self._masks.get((k, n))
        if mask is None:
            mask = self._masks[k, n] = jax.device_put(np.ones((k, n), bool), self.window)
        return mask
