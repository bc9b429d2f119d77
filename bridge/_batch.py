"""Global batches: ragged-batch padding with a mask, and zero-copy placement on a sharding."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from bridge._convert import as_numpy
from bridge._dlpack import copied_shard_bytes, prepare
from bridge._errors import TransferError
from bridge._origin import AMBIGUOUS, remember
from bridge._stats import TransferStats
from bridge._tree import PyTree, flat_leaves, leaves, map_leaves, rebuilt


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


_ARRAYS = (torch.Tensor, np.ndarray, jax.Array)
_VIEWED = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.float16})
_VIEWED |= {torch.float32, torch.complex64}  # (a host tensor's t.numpy() views these as they are)


def rows(batch: PyTree, *, skip: tuple[str, ...] = ()) -> int:
    """The rows of a batch: the leading size of its first array with a dimension.

    The one definition of a batch's row count (Lightning's batch size): arrays are torch
    tensors, numpy and JAX arrays, read in the batch's own order through dicts, lists and
    tuples; anything else (strings, stand-ins of host-only fields) and 0-d arrays hold none.

    Args:
        batch: a collated batch (a tensor, or a dict/list/tuple nesting them).
        skip: top-level keys of a dict batch not to count (e.g. ``("mask",)``).

    Returns:
        The row count, or 0 when the batch holds no array with a dimension.

    Example:
        >>> import torch
        >>> rows({"n": torch.tensor(3), "x": torch.ones(5, 2)}), rows([torch.ones(4)])
        (5, 4)
        >>> rows({"mask": torch.ones(8), "y": torch.ones(6)}, skip=("mask",)), rows({})
        (6, 0)
    """
    items: Any
    if isinstance(batch, Mapping):
        items = batch.items()
    elif isinstance(batch, (list, tuple)):
        items = enumerate(batch)
    elif isinstance(batch, _ARRAYS):
        return int(batch.shape[0]) if batch.ndim else 0
    else:
        return 0
    for key, item in items:  # (an array read here, a container by a call: one call a batch)
        if skip and key in skip:
            continue
        if isinstance(item, _ARRAYS):
            if item.ndim:
                return int(item.shape[0])
        elif n := rows(item):
            return n
    return 0


def _leading(tree: PyTree) -> int:
    sizes = {name: t.shape[0] for name, t in leaves(tree, _is_tensor) if t.dim() > 0}
    if len(set(sizes.values())) != 1:
        raise TransferError(
            f"Padding needs every batch field to have the same leading (batch) size, got "
            f"{sizes or 'no field with a batch dimension'}. Fix: make the collate return "
            "fields of equal length (a field concatenated over the rows, such as "
            "EmbeddingBag's flat text with its offsets, has no row per example: pad it to "
            "[rows, length] instead, e.g. EmbeddingBag(..., padding_idx=0) on the padded "
            "rows), or train through JaxModule.from_lightning, which pads nothing."
        )
    return next(iter(sizes.values()))


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= n`` (e.g. rows per device).

    Example:
        >>> round_up(65, 8), round_up(64, 8), round_up(0, 8)
        (72, 64, 0)
    """
    return -(-n // multiple) * multiple


def pad_batch(batch: Mapping[str, Any], pad_to: int) -> dict[str, Any]:
    """Zero-pads every field to ``pad_to`` rows and adds a boolean ``mask`` of real rows.

    Fields without a batch dimension (0-d) are kept as they are; a ``mask`` already in the
    batch is combined with the new one. A batch of exactly ``pad_to`` rows is returned
    without copying its fields (the mask is still added, so every batch has the same keys).

    Args:
        batch: a mapping (possibly nested) of tensors with a common leading size.
        pad_to: rows after padding.

    Returns:
        A new dict with the padded fields and ``mask`` (bool, ``[pad_to]``).

    Raises:
        TransferError: when ``batch`` is not a Mapping, the leading sizes differ, or the
            batch has more than ``pad_to`` rows.

    Example:
        >>> import torch
        >>> out = pad_batch({"x": torch.ones(3, 2)}, 4)
        >>> out["x"].shape, out["mask"].tolist()
        (torch.Size([4, 2]), [True, True, True, False])
    """
    if not isinstance(batch, Mapping):
        raise TransferError(
            "Padding a ragged batch adds a 'mask' entry, so the batch must be a Mapping; "
            f"got {type(batch).__name__}. Fix: collate to a dict of tensors, or pass a batch "
            "whose size divides the data axis without pad_to."
        )
    if not isinstance(pad_to, int) or pad_to < 1:
        raise TransferError(f"pad_to must be a positive int, got {pad_to!r}.")
    n = _leading(batch)
    if n > pad_to:
        raise TransferError(
            f"The batch has {n} rows, more than pad_to={pad_to}. Fix: set pad_to to the "
            "global batch size (the largest batch the loader yields)."
        )

    def pad(_: str, t: torch.Tensor) -> torch.Tensor:
        if n == pad_to or t.dim() == 0:
            return t
        padded = t.new_zeros((pad_to, *t.shape[1:]))
        padded[:n] = t
        return padded

    out = dict(map_leaves(pad, dict(batch), _is_tensor))
    mask = torch.zeros(pad_to, dtype=torch.bool)
    mask[:n] = True
    if "mask" in batch:
        mask[:n] &= torch.as_tensor(batch["mask"]).bool().reshape(-1)[:n]
    out["mask"] = mask
    return out


@functools.lru_cache(maxsize=256)
def _local_row_blocks(sharding: Sharding) -> int:
    """How many distinct row blocks of the batch this process's devices hold."""
    if not isinstance(sharding, NamedSharding) or not len(sharding.spec):
        return 1
    first = sharding.spec[0]
    if first is None:
        return 1
    axes = first if isinstance(first, tuple) else (first,)
    mesh = sharding.mesh
    where = [mesh.axis_names.index(a) for a in axes]
    me = jax.process_index()
    blocks = {
        tuple(pos[i] for i in where)
        for pos, d in np.ndenumerate(mesh.devices)
        if d.process_index == me
    }
    return max(len(blocks), 1)


@functools.lru_cache(maxsize=256)
def _leaf_sharding(sharding: Sharding, ndim: int) -> Sharding:
    """``sharding`` cut to a leaf's rank: a 0-d leaf is replicated, a 1-d one keeps axis 0."""
    if isinstance(sharding, NamedSharding) and len(sharding.spec) > ndim:
        return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[:ndim]))
    return sharding


@functools.lru_cache(maxsize=256)
def _on_cpu(sharding: Sharding) -> bool:
    return all(getattr(d, "platform", None) == "cpu" for d in sharding.device_set)


def _shard_copy_error(name: str, t: torch.Tensor, copied: int) -> TransferError:
    return TransferError(
        f"Field {name!r} ({t.dtype}, shape {tuple(t.shape)}): JAX copied {copied} bytes of its "
        "shards because their offsets in the host buffer are not 64-byte aligned. Fix: make "
        "rows per device x bytes per row a multiple of 64 (e.g. 16 int32 labels per device), "
        "or pass strict=False to allow the counted copy."
    )


def _place_single(
    name: str, t: torch.Tensor, *, strict: bool, stats: TransferStats | None, own: bool
) -> jax.Array:
    out = jax.dlpack.from_dlpack(t)
    if t.is_cpu and t.numel() and out.unsafe_buffer_pointer() != t.data_ptr():
        if strict:
            raise _shard_copy_error(name, t, t.nbytes)
        if stats is not None:
            stats.record_copy(name, "JAX copied the buffer on import", t.nbytes)
    elif own and stats is not None:
        stats.zero_copy_bytes += t.nbytes
    return out


def _indivisible(
    named: list[tuple[str, torch.Tensor]], shardings: list[Sharding]
) -> TransferError | None:
    """The error naming the first field whose size a sharded axis does not divide."""
    for (name, t), s in zip(named, shardings, strict=True):
        if not isinstance(s, NamedSharding):
            continue
        for dim, axes in enumerate(s.spec):
            if axes is None:
                continue
            names = axes if isinstance(axes, tuple) else (axes,)
            ways = int(np.prod([s.mesh.shape[a] for a in names]))
            if t.shape[dim] % ways:
                sizes = {n: tuple(x.shape) for n, x in named if x.dim()}
                return TransferError(
                    f"Field {name!r} has shape {tuple(t.shape)}: its dim {dim} is split over "
                    f"the mesh axis {axes!r} ({ways} devices), which does not divide "
                    f"{t.shape[dim]}. Every field with a dimension is split by rows like the "
                    f"others (the batch's fields: {sizes}). Fix: give the field one row per "
                    "example in the collate (e.g. `w.expand(B, *w.shape)`), or make a per-batch "
                    "value 0-d, or keep a constant in the model instead of the batch."
                )
    return None


def _is_host_device(sharding: Sharding, tree: PyTree) -> bool:
    """The sharding is the one device host tensors land on (``cpu:0``, one process)."""
    devices = sharding.device_set
    return (
        len(devices) == 1
        and jax.process_count() == 1
        and next(iter(devices)) == jax.devices("cpu")[0]
        and all(t.is_cpu for _, t in flat_leaves(tree) or leaves(tree, _is_tensor))
    )


def _place_sharded(
    named: list[tuple[str, torch.Tensor]],
    sharding: Sharding,
    *,
    strict: bool,
    stats: TransferStats | None,
    copied_names: set[str],
) -> list[jax.Array]:
    shardings = [_leaf_sharding(sharding, t.dim()) for _, t in named]
    local = [
        (t.numpy() if t.dtype in _VIEWED else as_numpy(t))
        if t.is_cpu
        else jax.dlpack.from_dlpack(t)
        for _, t in named
    ]
    # One batched call: device_put with one process; with several, each process's rows are
    # assembled into one global array.
    try:
        out: list[jax.Array] = jax.make_array_from_process_local_data(shardings, local)
    except ValueError as err:  # (a field a sharded axis does not divide: named below)
        raise _indivisible(named, shardings) or err from err
    for (name, t), s, x in zip(named, shardings, out, strict=True):
        own = name not in copied_names
        if not t.is_cpu:
            if stats is not None and own:
                stats.zero_copy_bytes += t.nbytes
            continue
        if not _on_cpu(s):
            if stats is not None:
                stats.host_to_device_bytes += t.nbytes
            continue
        copied = copied_shard_bytes(x, t) if t.numel() else 0
        if copied and strict:
            raise _shard_copy_error(name, t, copied)
        if stats is None:
            continue
        if copied:
            stats.record_copy(
                name, "JAX copied shards whose host offset is not 64-byte aligned", copied
            )
        if own:
            stats.zero_copy_bytes += max(t.nbytes - copied, 0)
    return out


def to_jax(
    tree: PyTree,
    sharding: Sharding | None = None,
    *,
    pad_to: int | None = None,
    strict: bool = False,
    stats: TransferStats | None = None,
) -> PyTree:
    """Hands a pytree of torch tensors to JAX, zero-copy where the layout allows.

    A contiguous, 64-byte-aligned CPU tensor of a dtype JAX holds becomes a ``jax.Array``
    over the same memory (no copy); so does a CUDA tensor, through DLPack with stream order
    kept. Everything else costs one counted copy, or raises with ``strict=True`` (see
    ``docs/bridge.md`` for the policy and the aliasing rules).

    Args:
        tree: dicts, lists, tuples, namedtuples or dataclasses of torch tensors; other
            leaves are returned unchanged.
        sharding: where the arrays go. A ``NamedSharding`` whose first spec entry names the
            data axis splits the batch rows over it (a leaf of lower rank gets the spec cut
            to its rank; 0-d leaves are replicated). With several processes each process
            passes its own rows and gets one global array. ``None`` keeps each array on the
            device DLPack gives (``cpu:0`` for host tensors).
        pad_to: rows this process contributes after padding (the global batch with one
            process). The leading dimension is zero-padded to ``pad_to`` (rounded up to a
            multiple of the data axis) and a boolean ``mask`` of real rows is added; the
            tree must then be a Mapping. Without ``pad_to``, a batch whose rows do not
            divide the data axis is padded to the next multiple the same way.
        strict: raise :class:`bridge.TransferError` instead of copying.
        stats: a :class:`bridge.TransferStats` (from :func:`bridge.new_stats`) to count
            zero-copy and copied bytes into.

    Returns:
        The same pytree with ``jax.Array`` leaves (plus ``mask`` when padded).

    Raises:
        TransferError: unsupported dtype, values that do not fit the 32-bit type, a ragged
            batch that is not a Mapping, or any copy in strict mode.

    Example:
        >>> import torch
        >>> t = torch.ones(4, 2)
        >>> out = to_jax({"x": t})
        >>> out["x"].unsafe_buffer_pointer() == t.data_ptr()
        True
    """
    if stats is not None:
        stats.transfers += 1
    flat = flat_leaves(tree)  # (a flat dict/list/tuple of tensors: no tree walks below)
    if sharding is not None and _is_host_device(sharding, tree):
        sharding = None  # one process, one CPU device: DLPack already puts it there
    if sharding is None and pad_to is None:  # the lean path: one walk, no bookkeeping sets

        def hand_over(name: str, t: torch.Tensor) -> jax.Array:
            ready = prepare(name, t, strict=strict, stats=stats)
            out = _place_single(name, ready, strict=strict, stats=stats, own=ready is t)
            if t.dtype in AMBIGUOUS:  # (an int32 field: JAX shows it as a narrowed int64)
                remember(name, t.dtype, out)
            return out

        if flat is not None:
            return rebuilt(tree, [hand_over(name, t) for name, t in flat])
        return map_leaves(hand_over, tree, _is_tensor)

    copied_names: set[str] = set()
    host_dtypes: dict[str, torch.dtype] = {}  # (before narrowing: for remember)

    def policy(name: str, t: torch.Tensor) -> torch.Tensor:
        host_dtypes[name] = t.dtype
        out = prepare(name, t, strict=strict, stats=stats)
        if out is not t:
            copied_names.add(name)
        return out

    if flat is not None:
        flat = [(name, policy(name, t)) for name, t in flat]
    else:
        tree = map_leaves(policy, tree, _is_tensor)
    blocks = _local_row_blocks(sharding) if sharding is not None else 1
    rows = None
    if pad_to is not None:
        rows = round_up(pad_to, blocks)
    elif blocks > 1:
        sizes = {t.shape[0] for _, t in flat or leaves(tree, _is_tensor) if t.dim()}
        if len(sizes) == 1 and (n := sizes.pop()) % blocks:
            rows = round_up(n, blocks)
    if flat is not None and (rows is not None or sharding is None):
        tree, flat = rebuilt(tree, [t for _, t in flat]), None  # (padded or placed: walked)
    if rows is not None:
        before = {name: t.data_ptr() for name, t in leaves(tree, _is_tensor)}
        tree = pad_batch(tree, rows)
        for name, t in leaves(tree, _is_tensor):
            if name in before and t.data_ptr() != before[name]:
                copied_names.add(name)
                if stats is not None:
                    stats.record_copy(name, f"ragged batch padded to {rows} rows", t.nbytes)
    if sharding is None:

        def place(name: str, t: torch.Tensor) -> jax.Array:
            out = _place_single(name, t, strict=strict, stats=stats, own=name not in copied_names)
            remember(name, host_dtypes.get(name, t.dtype), out)
            return out

        return map_leaves(place, tree, _is_tensor)
    named = flat if flat is not None else leaves(tree, _is_tensor)
    arrays = _place_sharded(named, sharding, strict=strict, stats=stats, copied_names=copied_names)
    for (name, t), out in zip(named, arrays, strict=True):
        if (dtype := host_dtypes.get(name, t.dtype)) in AMBIGUOUS:  # (else: nothing to recall)
            remember(name, dtype, out)
    if flat is not None:
        return rebuilt(tree, arrays)
    placed = iter(arrays)
    return map_leaves(lambda _, t: next(placed), tree, _is_tensor)
