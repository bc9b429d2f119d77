"""Device meshes from plain ``{axis: size}`` mappings."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxcore._errors import MeshError


def make_mesh(
    axes: Mapping[str, int],
    devices: Sequence[jax.Device] | None = None,
    *,
    num_devices: int | None = None,
) -> Mesh:
    """Builds a ``Mesh`` over ``devices`` with the named axis sizes.

    Devices are sorted by ``(process_index, id)`` so every process sees the same order.
    One axis may be ``-1``: it takes all the devices the other axes leave.

    Args:
        axes: ordered mapping of axis name to size, e.g. ``{"data": -1, "model": 1}``.
        devices: devices to use; all of ``jax.devices()`` by default.
        num_devices: use only the first ``num_devices`` of them (in the stable order), e.g.
            1 for a single-device run on a bigger machine; ``None`` uses them all.

    Returns:
        A ``jax.sharding.Mesh`` whose shape is ``axes`` with ``-1`` resolved.

    Raises:
        MeshError: when the sizes do not multiply to the number of devices.

    Example:
        >>> import jaxcore
        >>> mesh = jaxcore.make_mesh({"data": -1, "model": 1})
        >>> mesh.shape["model"]
        1
    """
    devs = sorted(
        jax.devices() if devices is None else devices, key=lambda d: (d.process_index, d.id)
    )
    if num_devices is not None:
        if not isinstance(num_devices, int) or not 1 <= num_devices <= len(devs):
            raise MeshError(
                f"num_devices must be between 1 and the {len(devs)} available devices, got "
                f"{num_devices!r}. Fix: set mesh.num_devices to at most {len(devs)}, or null "
                "for all of them."
            )
        devs = devs[:num_devices]
    if not axes:
        raise MeshError("make_mesh needs at least one axis, got {}; e.g. {'data': -1}.")
    sizes = dict(axes)
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v == 0 or v < -1}
    fills = [k for k, v in sizes.items() if v == -1]
    if bad or len(fills) > 1:
        raise MeshError(
            f"Mesh axis sizes must be positive integers with at most one -1, got {sizes}. "
            "Fix: give each axis a size and let one axis be -1 to take the remaining devices."
        )
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if fills:
        if len(devs) % fixed:
            raise MeshError(
                f"Mesh axes {sizes}: the fixed axes need a multiple of {fixed} devices, "
                f"but {len(devs)} are available. Fix: change the fixed axis sizes so they "
                f"divide {len(devs)}."
            )
        sizes[fills[0]] = len(devs) // fixed
    if math.prod(sizes.values()) != len(devs):
        raise MeshError(
            f"Mesh axes {sizes} need {math.prod(sizes.values())} devices, but "
            f"{len(devs)} are available ({devs[0].platform}). Fix: make the sizes multiply "
            f"to {len(devs)}, or set one axis to -1."
        )
    grid = np.asarray(devs, dtype=object).reshape(tuple(sizes.values()))
    return Mesh(grid, tuple(sizes))
