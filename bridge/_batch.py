"""Global batches: ragged-batch padding with a mask, and placement on a sharding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import torch

from bridge._dlpack import new_stats, tree_to_jax
from bridge._errors import TransferError

PyTree = Any


def _leading(tree: PyTree) -> int:
    sizes = {t.shape[0] for t in jax.tree.leaves(tree) if t.dim() > 0}
    if len(sizes) != 1:
        raise TransferError(
            f"Every batch field needs the same leading (batch) size, got {sorted(sizes)}. "
            "Fix: make the collate return fields of equal length."
        )
    return sizes.pop()


def pad_batch(batch: Mapping[str, torch.Tensor], pad_to: int) -> dict[str, torch.Tensor]:
    """Zero-pads every field to ``pad_to`` rows and adds a boolean ``mask`` of real rows.

    Example:
        >>> import torch
        >>> out = pad_batch({"x": torch.ones(3, 2)}, 4)
        >>> out["x"].shape, out["mask"].tolist()
        (torch.Size([4, 2]), [True, True, True, False])
    """
    if not isinstance(batch, Mapping):
        raise TransferError(
            f"Padding a ragged batch adds a 'mask' entry, so the batch must be a Mapping; "
            f"got {type(batch).__name__}. Fix: collate to a dict of tensors."
        )
    n = _leading(batch)
    if n > pad_to:
        raise TransferError(f"Batch has {n} rows, more than pad_to={pad_to}.")
    out = {}
    for k, t in batch.items():
        if n == pad_to:
            out[k] = t
            continue
        padded = t.new_zeros((pad_to, *t.shape[1:]))
        padded[:n] = t
        out[k] = padded
    mask = torch.zeros(pad_to, dtype=torch.bool)
    mask[:n] = True
    if "mask" in batch:
        mask[:n] &= batch["mask"].bool()
    out["mask"] = mask
    return out


def to_jax(
    tree: PyTree,
    sharding: jax.sharding.Sharding | None = None,
    *,
    pad_to: int | None = None,
    strict: bool = False,
    stats: dict[str, Any] | None = None,
) -> PyTree:
    """Hands a pytree of torch tensors to JAX, zero-copy where the layout allows.

    Args:
        tree: pytree (dicts, lists, tuples, ...) of torch tensors.
        sharding: where the arrays go; leaves are placed with it (batch dim on the data
            axis). ``None`` keeps them on the device DLPack gives.
        pad_to: pad the leading dimension to this many rows and add a boolean ``mask``.
        strict: raise instead of copying when a field cannot cross zero-copy.
        stats: dict to accumulate ``zero_copy_bytes``, ``copied_bytes`` and ``copies`` into.

    Returns:
        The same pytree of ``jax.Array``.

    Example:
        >>> import torch
        >>> out = to_jax({"x": torch.ones(4, 2)})
        >>> out["x"].shape
        (4, 2)
    """
    if pad_to is not None:
        tree = pad_batch(tree, pad_to)
    out = tree_to_jax(tree, strict=strict, stats=new_stats() if stats is None else stats)
    if sharding is not None:
        out = jax.device_put(out, sharding)
    return out
