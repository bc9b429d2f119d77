"""torch <-> JAX hand-over of single buffers through DLPack, with an explicit copy policy.

A CPU tensor crosses zero-copy when it is contiguous, 64-byte aligned, not pinned, does not
require grad, and has a dtype JAX holds. Every other case costs exactly one counted copy
(or, with ``strict=True``, a :class:`TransferError` naming the field and the fix). Values
never change silently: narrowing int64/uint64/float64/complex128 under x64-off checks the
range first (``bridge._convert.narrow``, the bridge's one narrowing).
"""

from __future__ import annotations

from typing import Any

import jax
import torch

from bridge._convert import NARROW, as_torch, narrow
from bridge._errors import TransferError
from bridge._stats import TransferStats
from bridge._tree import PyTree, map_leaves

ALIGN = 64
"""Byte alignment XLA's CPU client needs to alias a host buffer instead of copying it."""

SUPPORTED = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.uint16,
        torch.uint32,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.complex64,
    }
)
_FIX = (
    "Fix: produce a contiguous, unpinned, 64-byte-aligned tensor of a dtype JAX holds in the "
    "Dataset or collate (e.g. `.contiguous()`, `.to(torch.int32)`, `.detach()`), or pass "
    "strict=False to allow one counted copy."
)


def _describe(t: torch.Tensor) -> str:
    offset = t.data_ptr() % ALIGN if t.numel() else 0
    return (
        f"{t.dtype}, shape {tuple(t.shape)}, strides {tuple(t.stride())}, "
        f"data pointer {offset} bytes past a {ALIGN}-byte boundary"
    )


def prepare(
    name: str, t: torch.Tensor, *, strict: bool, stats: TransferStats | None
) -> torch.Tensor:
    """Returns ``t`` itself when it can cross zero-copy, else one policy copy of it.

    Raises:
        TransferError: for an unsupported dtype, an out-of-range narrowing, or any copy in
            strict mode.
    """
    if (
        t.dtype in SUPPORTED
        and not t.requires_grad
        and t.is_contiguous()
        and (not t.is_cpu or (not t.data_ptr() % ALIGN and not t.is_pinned()))
    ):
        return t  # the fast path: nothing to copy (a null pointer of an empty tensor is aligned)
    return _policy_copy(name, t, strict=strict, stats=stats)


def _policy_copy(
    name: str, t: torch.Tensor, *, strict: bool, stats: TransferStats | None
) -> torch.Tensor:
    reasons = []
    narrowing = t.dtype in NARROW and not jax.config.read("jax_enable_x64")
    if narrowing:
        target = str(NARROW[t.dtype]).removeprefix("torch.")
        reasons.append(f"{t.dtype} narrowed to {target} (JAX runs with x64 off)")
    elif t.dtype not in SUPPORTED and t.dtype not in NARROW:
        raise TransferError(
            f"Field {name!r} has dtype {t.dtype}, which the bridge does not hand to JAX. "
            f"Supported: {sorted(str(d).removeprefix('torch.') for d in SUPPORTED)} and, "
            "narrowed with a range check, int64/uint64/float64/complex128. Fix: convert the "
            "field in the Dataset or collate."
        )
    if t.requires_grad:
        reasons.append("requires grad (copied so later in-place updates cannot reach JAX)")
    on_cpu = t.is_cpu
    if not t.is_contiguous():
        reasons.append(f"non-contiguous strides {tuple(t.stride())}")
    elif on_cpu and t.numel() and t.data_ptr() % ALIGN:
        reasons.append(f"data pointer not {ALIGN}-byte aligned")
    if on_cpu and t.is_pinned():
        reasons.append("pinned memory (JAX's CPU client refuses it)")
    if not reasons:  # e.g. an empty tensor with an odd (never dereferenced) pointer
        return t
    if strict:
        raise TransferError(
            f"Field {name!r} ({_describe(t)}) cannot cross zero-copy: {'; '.join(reasons)}. " + _FIX
        )
    with torch.no_grad():
        out = narrow(name, t.detach()) if narrowing else t.detach()
        if out is t or out.data_ptr() == t.data_ptr() or not out.is_contiguous():
            # torch's allocator aligns fresh buffers to 64 bytes and never pins them.
            out = torch.empty_like(out, memory_format=torch.contiguous_format).copy_(out)
    if stats is not None:
        stats.record_copy(name, "; ".join(reasons), out.nbytes)
    return out


def copied_shard_bytes(x: jax.Array, t: torch.Tensor) -> int:
    """Bytes of the distinct shards of ``x`` that JAX copied instead of aliasing ``t``."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.nbytes
    seen: set[Any] = set()
    copied = 0
    for shard in x.addressable_shards:
        key = str(shard.index)
        data = shard.data
        if key in seen or not data.size:
            continue
        seen.add(key)
        if not lo <= data.unsafe_buffer_pointer() < hi:
            copied += data.nbytes
    return copied


def to_torch(tree: PyTree, *, stats: TransferStats | None = None) -> PyTree:
    """Hands each ``jax.Array`` leaf to torch through DLPack (zero-copy on one device).

    A single-device or fully replicated array aliases JAX's buffer (the torch tensor keeps
    it alive); an array sharded over several devices is gathered into one buffer first (one
    copy), across processes with ``process_allgather``. Stream order on an accelerator is
    kept by the DLPack protocol. Where the platform refuses DLPack (a TPU), each array comes
    through the host instead (one copy; bfloat16 kept), chosen once per platform
    and counted in ``stats`` (see :func:`bridge.as_torch`). Other leaves are returned
    unchanged.

    Args:
        tree: a pytree whose ``jax.Array`` leaves are handed over.
        stats: where copies through the host are counted (``device_to_host_bytes``).

    Example:
        >>> import bridge, jax.numpy as jnp
        >>> stats = bridge.new_stats()
        >>> to_torch({"a": jnp.arange(3)}, stats=stats)["a"].tolist()
        [0, 1, 2]
        >>> stats.device_to_host_copies  # on a CPU: DLPack, nothing copied
        0
    """
    return map_leaves(
        lambda _, x: as_torch(x, stats=stats), tree, lambda x: isinstance(x, jax.Array)
    )
