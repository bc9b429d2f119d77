"""torch <-> JAX hand-over of pytrees through DLPack, with an explicit copy policy."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from bridge._errors import TransferError

PyTree = Any

_ALIGN = 64
# dtypes JAX holds only with x64 on, and the 32-bit type they are narrowed to otherwise.
_NARROW = {torch.int64: torch.int32, torch.float64: torch.float32}


def _is_leaf(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _narrow(name: str, t: torch.Tensor) -> torch.Tensor:
    """int64/float64 -> 32 bit, refusing values the narrow type cannot hold exactly."""
    target = _NARROW[t.dtype]
    if t.dtype == torch.int64 and t.numel():
        info = torch.iinfo(target)
        lo, hi = int(t.min()), int(t.max())
        if lo < info.min or hi > info.max:
            raise TransferError(
                f"Field {name!r}: int64 values in [{lo}, {hi}] do not fit int32, and JAX runs "
                "with x64 off. Fix: store the field as int32 in the Dataset, or enable "
                "jax_enable_x64."
            )
    out = t.to(target)
    if t.dtype == torch.float64 and not torch.equal(out.to(torch.float64), t):
        finite = torch.isfinite(t)
        if torch.any(torch.isinf(out[finite])):
            raise TransferError(
                f"Field {name!r}: float64 values overflow float32 (JAX runs with x64 off). "
                "Fix: rescale the field or store it as float32."
            )
    return out


def _leaf_to_jax(name: str, t: torch.Tensor, *, strict: bool, stats: dict[str, Any]) -> jax.Array:
    reasons = []
    if t.requires_grad:
        reasons.append("requires_grad")
        t = t.detach()
    if t.device.type != "cpu":
        arr = jax.dlpack.from_dlpack(t)
        stats["zero_copy_bytes"] += t.nbytes
        return arr
    if t.dtype in _NARROW and not jax.config.jax_enable_x64:
        reasons.append(f"{t.dtype} with x64 off")
    if not t.is_contiguous():
        reasons.append(f"non-contiguous strides {tuple(t.stride())}")
    elif t.numel() and t.data_ptr() % _ALIGN:
        reasons.append(f"data pointer not {_ALIGN}-byte aligned")
    if t.is_pinned():
        reasons.append("pinned memory")
    if reasons and strict:
        raise TransferError(
            f"Field {name!r} ({t.dtype}, shape {tuple(t.shape)}, strides {tuple(t.stride())}) "
            f"cannot cross zero-copy: {', '.join(reasons)}. Fix: produce a contiguous, "
            "unpinned, 64-byte-aligned tensor of a 32-bit-or-narrower dtype in the Dataset or "
            "collate (e.g. `.contiguous()`, `.to(torch.int32)`), or pass strict=False to allow "
            "one counted copy."
        )
    if reasons:
        if t.dtype in _NARROW and not jax.config.jax_enable_x64:
            t = _narrow(name, t)
        t = t.contiguous().clone() if t.is_pinned() else t.contiguous()
        if t.numel() and t.data_ptr() % _ALIGN:
            t = t.clone()
        copied = np.array(t.numpy(), copy=True)  # aligned by numpy
        stats["copied_bytes"] += t.nbytes
        stats["copies"].append((name, ", ".join(reasons)))
        return jnp.asarray(copied)
    stats["zero_copy_bytes"] += t.nbytes
    return jax.dlpack.from_dlpack(t)


def _path_name(path: tuple[Any, ...]) -> str:
    return (
        "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
        or "<root>"
    )


def new_stats() -> dict[str, Any]:
    """Empty per-transfer stats: zero-copy bytes, copied bytes and why each copy happened."""
    return {"zero_copy_bytes": 0, "copied_bytes": 0, "copies": []}


def tree_to_jax(
    tree: PyTree, *, strict: bool = False, stats: dict[str, Any] | None = None
) -> PyTree:
    """Hands each torch tensor leaf of ``tree`` to JAX on its own device (no sharding)."""
    stats = new_stats() if stats is None else stats
    return jax.tree_util.tree_map_with_path(
        lambda p, t: _leaf_to_jax(_path_name(p), t, strict=strict, stats=stats),
        tree,
        is_leaf=_is_leaf,
    )


def to_torch(tree: PyTree) -> PyTree:
    """Hands each ``jax.Array`` leaf to torch through DLPack (zero-copy on one device).

    Sharded arrays are gathered to one host buffer first.

    Example:
        >>> import jax.numpy as jnp
        >>> to_torch({"a": jnp.arange(3)})["a"].tolist()
        [0, 1, 2]
    """

    def leaf(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        if len(x.sharding.device_set) > 1:
            if not x.is_fully_addressable and not x.is_fully_replicated:
                x = jax.experimental.multihost_utils.process_allgather(x, tiled=True)
                return torch.from_numpy(np.asarray(x))
            x = jax.device_put(x, next(iter(x.addressable_shards)).device)
        return torch.from_dlpack(x)

    return jax.tree.map(leaf, tree)
