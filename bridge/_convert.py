"""The one conversion path between torch tensors, numpy arrays and JAX arrays.

numpy has no bfloat16 or float8: ``torch.Tensor.numpy()`` refuses those tensors and
``torch.from_numpy`` refuses the ``ml_dtypes`` arrays JAX uses for them (what a
multi-process gather or ``jax.device_get`` returns). Both sides hold the same bits, so they
cross as an unsigned integer view of the same width, with no copy. 64-bit values narrow to
32 bits (JAX's default, x64 off) here and nowhere else, with a range check.

Every module of the bridge (DLPack hand-over, state_dict conversion, parity checks) goes
through these functions; :func:`as_torch`, :func:`as_numpy` and :func:`as_jax` are public.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from bridge._errors import TransferError
from bridge._stats import TransferStats

# torch dtypes numpy lacks <-> the ml_dtypes numpy dtypes JAX uses for them.
_ML_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.bfloat16: np.dtype(jnp.bfloat16),
    torch.float8_e4m3fn: np.dtype(jnp.float8_e4m3fn),
    torch.float8_e5m2: np.dtype(jnp.float8_e5m2),
}
_TORCH_OF_ML = {v: k for k, v in _ML_DTYPES.items()}
# The unsigned integer type of each width, both sides: the view the bits cross as.
_BITS = {1: (torch.uint8, np.uint8), 2: (torch.uint16, np.uint16)}

# 64-bit dtypes JAX holds only with x64 on, and the 32-bit type they narrow to otherwise.
NARROW = {
    torch.int64: torch.int32,
    torch.uint64: torch.uint32,
    torch.float64: torch.float32,
    torch.complex128: torch.complex64,
}
_NUMPY_64 = frozenset(np.dtype(d) for d in (np.int64, np.uint64, np.float64, np.complex128))


def _gathered(x: jax.Array) -> jax.Array | np.ndarray:
    """``x`` in one buffer: a replica, a one-device copy, or (across processes) host numpy."""
    if len(x.sharding.device_set) <= 1:
        return x
    if x.is_fully_replicated and x.addressable_shards:
        return x.addressable_shards[0].data  # one replica, no transfer
    if x.is_fully_addressable:
        return jax.device_put(x, x.addressable_shards[0].device)  # gather: one copy
    from jax.experimental import multihost_utils  # spread over processes: all get all

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def as_numpy(x: Any) -> np.ndarray:
    """A host numpy array of a torch tensor, JAX array or array-like, bf16/float8 included.

    A CPU tensor becomes a view of its buffer (no copy; bfloat16 as ``ml_dtypes.bfloat16``);
    a device tensor is copied to the host; a sharded JAX array is gathered (across processes
    too).

    Args:
        x: a ``torch.Tensor``, ``jax.Array``, numpy array or anything ``np.asarray`` takes.

    Returns:
        The numpy array (read-only when it views a JAX buffer).

    Example:
        >>> import torch
        >>> a = as_numpy(torch.ones(2, dtype=torch.bfloat16))
        >>> str(a.dtype), a.tolist()
        ('bfloat16', [1.0, 1.0])
    """
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        if t.dtype in _ML_DTYPES:
            return t.view(_BITS[t.element_size()][0]).numpy().view(_ML_DTYPES[t.dtype])
        return t.numpy()
    if isinstance(x, jax.Array):
        return np.asarray(_gathered(x))
    return np.asarray(x)


def as_torch(x: Any, *, stats: TransferStats | None = None) -> torch.Tensor:
    """A torch tensor of a JAX array, numpy array (``ml_dtypes`` included) or tensor.

    A JAX array on one device (or fully replicated) is handed over through DLPack with no
    copy; one sharded over several devices is gathered first (one copy; across processes
    with ``process_allgather``). Where the platform refuses DLPack (a TPU: ``BufferError``)
    or the dtype has no DLPack code (float8), the array comes to the host in one copy
    instead (onto JAX's CPU device, then DLPack; ``jax.device_get`` where JAX has no CPU
    device), counted in ``stats``; after a platform's first refusal its arrays go straight
    to the host. A numpy array is viewed (bfloat16/float8 through their
    bits, never through float32) unless it is read-only or has negative strides, then copied
    once. A tensor is returned detached.

    Args:
        x: a ``jax.Array``, ``np.ndarray`` (or array-like), or ``torch.Tensor``.
        stats: where device-to-host copies are counted (``device_to_host_bytes``).

    Returns:
        The tensor, on the CPU unless ``x`` was a device tensor or array.

    Example:
        >>> import numpy as np, jax.numpy as jnp
        >>> t = as_torch(np.ones(3, dtype=jnp.bfloat16))  # what a multi-process gather gives
        >>> t.dtype, t.tolist()
        (torch.bfloat16, [1.0, 1.0, 1.0])
    """
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, jax.Array):
        return _jax_to_torch(x, stats)
    return _numpy_to_torch(np.asarray(x))


# Platforms ("tpu", ...) whose arrays refused DLPack with a BufferError, so their later
# arrays go straight to one host copy. A module-level set: the refusal is a property of the
# platform's runtime, fixed for the life of the process (tests clear it).
_NO_DLPACK: set[str] = set()


def _jax_to_torch(x: jax.Array, stats: TransferStats | None) -> torch.Tensor:
    """DLPack where the platform and dtype allow it, else one counted device-to-host copy."""
    platform = next(iter(x.devices())).platform
    if platform in _NO_DLPACK and x.is_fully_addressable:
        return _to_host(x, stats)  # device_get assembles the shards on the host
    one = _gathered(x)
    if not isinstance(one, jax.Array):  # across processes: process_allgather came to the host
        return _to_host(one, stats)
    if platform not in _NO_DLPACK and jax.dlpack.is_supported_dtype(one.dtype):
        try:
            return torch.from_dlpack(one)
        except BufferError:  # a TPU: "__dlpack__ device only supported for CPU and GPU, ..."
            _NO_DLPACK.add(platform)
    return _to_host(one, stats)


def _to_host(x: jax.Array | np.ndarray, stats: TransferStats | None) -> torch.Tensor:
    """``x`` through one host buffer (bf16 as ``ml_dtypes.bfloat16``, crossing as bits).

    An accelerator's array is copied onto JAX's CPU device and handed over by DLPack: one
    copy, into a buffer the tensor owns. ``jax.device_get`` alone would take two on a TPU
    (the host value it returns is read-only, cached on the array: torch needs its own).
    """
    if stats is not None:
        stats.record_device_to_host(x.nbytes)
    if isinstance(x, jax.Array) and (cpu := _host_device(x)) is not None:
        try:
            return torch.from_dlpack(jax.device_put(x, cpu))
        except BufferError:
            pass  # (a CPU array refusing DLPack too: the numpy route below)
    return _numpy_to_torch(np.asarray(jax.device_get(x)))


def _host_device(x: jax.Array) -> jax.Device | None:
    """JAX's first CPU device, when ``x`` is not on it already and JAX has one."""
    if any(d.platform == "cpu" for d in x.devices()):
        return None
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without cpu
        return None


def _numpy_to_torch(arr: np.ndarray) -> torch.Tensor:
    """A tensor viewing ``arr`` (copied once if read-only or negatively strided)."""
    if not arr.flags.writeable or any(s < 0 for s in arr.strides):
        arr = arr.copy()  # torch.from_numpy refuses negative strides, warns on read-only
    if arr.dtype in _TORCH_OF_ML:
        bits = arr.view(_BITS[arr.dtype.itemsize][1])
        return torch.from_numpy(bits).view(_TORCH_OF_ML[arr.dtype])
    return torch.from_numpy(arr)


def narrow(name: str, t: torch.Tensor, *, check_range: bool = True) -> torch.Tensor:
    """A 64-bit tensor as its 32-bit type (a fresh contiguous tensor), checking the range.

    Args:
        name: the field named in the error.
        t: an int64, uint64, float64 or complex128 tensor (others are returned as they are).
        check_range: refuse values the 32-bit type cannot hold (integers outside its range,
            finite floats that would overflow to inf); ``False`` wraps/overflows like a cast.

    Raises:
        TransferError: naming the value range and the target's, when ``check_range`` and a
            value does not fit.

    Example:
        >>> import torch
        >>> narrow("ids", torch.tensor([1, 2])).dtype
        torch.int32
        >>> narrow("ids", torch.tensor([2**40]))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        bridge._errors.TransferError: Field 'ids': torch.int64 values in [1099511627776, ...
    """
    target = NARROW.get(t.dtype)
    if target is None:
        return t
    t = t.detach()
    if t.dtype in (torch.int64, torch.uint64):
        if check_range and t.numel():
            host = t.numpy(force=True)
            lo, hi = int(host.min()), int(host.max())
            info = np.iinfo(np.int32 if target == torch.int32 else np.uint32)
            if lo < info.min or hi > info.max:
                raise TransferError(
                    f"Field {name!r}: {t.dtype} values in [{lo}, {hi}] do not fit "
                    f"{str(target).removeprefix('torch.')} [{info.min}, {info.max}], and JAX "
                    "runs with x64 off, so they would be truncated. Fix: store the field as "
                    "int32 in the Dataset (or rescale it), or enable jax_enable_x64."
                )
        if target == torch.uint32:  # torch has no uint64 -> uint32 cast kernel on every build
            out = torch.empty(t.shape, dtype=torch.uint32)
            out.numpy()[...] = t.numpy(force=True).astype(np.uint32)
            return out
        return t.to(target, memory_format=torch.contiguous_format)
    out = t.to(target, memory_format=torch.contiguous_format)
    if check_range and t.numel() and bool(torch.any(torch.isinf(out) & torch.isfinite(t))):
        raise TransferError(
            f"Field {name!r}: {t.dtype} values overflow {target} (JAX runs with x64 off), "
            "so they would become inf. Fix: rescale the field or store it as float32, or "
            "enable jax_enable_x64."
        )
    return out


def as_jax(x: Any, *, check_range: bool = True, name: str = "tensor") -> jax.Array:
    """A JAX copy of a torch tensor (or numpy array) that never aliases it.

    For values that stay owned by torch (a module that keeps training, its buffers);
    batches go through :func:`bridge.to_jax` instead, zero-copy. 64-bit dtypes narrow to
    32 bits when JAX runs with x64 off (see :func:`narrow`).

    Args:
        x: a ``torch.Tensor`` (any device), numpy array or JAX array.
        check_range: refuse 64-bit values that do not fit 32 bits instead of wrapping them.
        name: the name used in the error message.

    Returns:
        A new ``jax.Array`` on JAX's default device.

    Raises:
        TransferError: a 64-bit value out of the 32-bit range (with ``check_range``).

    Example:
        >>> import torch
        >>> a = as_jax(torch.tensor([1.5, 2.0], dtype=torch.bfloat16))
        >>> str(a.dtype), a.tolist()
        ('bfloat16', [1.5, 2.0])
        >>> str(as_jax(torch.tensor([3])).dtype)  # int64 -> int32 with x64 off
        'int32'
    """
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        if t.dtype in NARROW and not jax.config.read("jax_enable_x64"):
            t = narrow(name, t, check_range=check_range)
        return _owned(as_numpy(t))
    if isinstance(x, jax.Array):
        return jax.device_put(x, may_alias=False)
    arr = np.asarray(x)
    if arr.dtype in _NUMPY_64 and not jax.config.read("jax_enable_x64"):
        return as_jax(as_torch(arr), check_range=check_range, name=name)
    return _owned(arr)


def _owned(arr: np.ndarray) -> jax.Array:
    """A JAX array of a fresh copy of ``arr`` (``device_put`` may alias a numpy buffer, so
    the copy is the array's own). Not ``jnp.array``: in this JAX it compiles a program per
    new shape and dtype (``lax.stage``), ~20 ms for each weight of a model."""
    return jax.device_put(np.array(arr, copy=True))
