"""A state's small arrays saved as one array per dtype (asynchronous checkpoints).

Orbax's cost is per array, not per byte: a spoken-digits ``TrainState`` (128 arrays,
1.4 MB) took ~220 ms of CPU per save, packed ~30 ms (measured, ``benchmarks/checkpoint_cost.py``
and docs/reliability.md). On 2 cores that CPU is taken from the training loop even when
the write runs in the background. Arrays under :data:`SMALL_BYTES` are concatenated per
dtype; larger ones are saved as they are (a copy of them would cost memory, and their
per-array cost is small next to their bytes). The layout (every leaf's path, shape, dtype
and place) goes in the checkpoint's Orbax metadata under :data:`LAYOUT_KEY`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import bridge

LAYOUT_KEY = "coreshell_packed_layout"
SMALL_BYTES = 1 << 20


@jax.jit
def _concat(groups: dict[str, tuple[jax.Array, ...]]) -> dict[str, jax.Array]:
    return {dtype: jnp.concatenate([jnp.ravel(x) for x in xs]) for dtype, xs in groups.items()}


def pack(tree: Any) -> tuple[dict[str, Any], list[list[Any]]]:
    """``(saved tree, layout)``: small arrays concatenated per dtype, large ones as they are.

    Example:
        >>> import jax.numpy as jnp
        >>> saved, layout = pack({"b": jnp.zeros(2), "w": jnp.ones((2, 3))})
        >>> saved["small"]["float32"].shape, layout[1]
        ((8,), ['w', [2, 3], 'float32', 'float32', 2])
    """
    layout: list[list[Any]] = []
    small: dict[str, list[jax.Array]] = {}
    big: dict[str, jax.Array] = {}
    filled: dict[str, int] = {}
    for i, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
        dtype = str(leaf.dtype)
        if leaf.nbytes < SMALL_BYTES:
            group, offset = dtype, filled.get(dtype, 0)
            small.setdefault(dtype, []).append(leaf)
            filled[dtype] = offset + leaf.size
        else:
            group, offset = "", 0
            big[str(i)] = leaf
        layout.append([bridge.path_str(path), list(leaf.shape), dtype, group, offset])
    saved: dict[str, Any] = {}
    if small:
        saved["small"] = _concat({k: tuple(v) for k, v in small.items()})
    if big:
        saved["big"] = big
    return saved, layout


def saved_shapes(layout: list[list[Any]]) -> dict[str, tuple[int, ...]]:
    """Each saved leaf's shape by path (to compare with the model's)."""
    return {path: tuple(shape) for path, shape, *_ in layout}


def restore_target(layout: list[list[Any]], template: Any) -> dict[str, Any]:
    """The abstract saved tree to restore: packed groups on one device, large leaves with
    the template's shardings."""
    leaves = jax.tree.leaves(template)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    sizes: dict[str, int] = {}
    big = {}
    for i, (_, shape, _, group, offset) in enumerate(layout):
        if group:
            sizes[group] = max(sizes.get(group, 0), offset + int(np.prod(shape)))
        else:
            leaf = leaves[i]
            big[str(i)] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    target: dict[str, Any] = {}
    if sizes:
        target["small"] = {
            g: jax.ShapeDtypeStruct((n,), jnp.dtype(g), sharding=device) for g, n in sizes.items()
        }
    if big:
        target["big"] = big
    return target


def unpack(saved: dict[str, Any], layout: list[list[Any]], template: Any) -> Any:
    """The template's tree from a restored saved tree, each leaf with the template's dtype
    and sharding."""
    leaves = jax.tree.leaves(template)
    host = {g: np.asarray(v) for g, v in saved.get("small", {}).items()}
    out = []
    for i, (_, shape, _, group, offset) in enumerate(layout):
        like = leaves[i]
        if group:
            part = host[group][offset : offset + int(np.prod(shape))].reshape(shape)
            out.append(jax.device_put(part.astype(like.dtype), like.sharding))
        else:
            out.append(saved["big"][str(i)])
    return jax.tree.unflatten(jax.tree.structure(template), out)
