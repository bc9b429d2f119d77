"""A flat batch form's hand-over to JAX, decided once from its first batch.

:func:`bridge.to_jax` works out, for every batch, what each leaf needs: walking the tree,
the copy policy, the sharding cut to the leaf's rank, whether JAX aliased each shard. For a
run whose batches share one form (a dict of CPU tensors of fixed shapes and dtypes: every
K-batch window of a ``steps_per_call="auto"`` run) those answers do not change, so
:class:`BatchTransfer` decides them from the first batch and then only carries them out:
per field the copy policy (:func:`bridge._dlpack.prepare`: an ``int64`` field still narrowed
with its range checked, every batch), then one placement call for all fields, the zero-copy
and copied bytes counted as :func:`to_jax` counts them.
"""

from __future__ import annotations

import operator

import jax
import torch
from jax.sharding import Sharding

from bridge._batch import _is_host_device, _leaf_sharding, _on_cpu, _place_single
from bridge._convert import NARROW
from bridge._dlpack import ALIGN, SUPPORTED, _policy_copy, copied_shard_bytes
from bridge._origin import AMBIGUOUS, remember
from bridge._stats import TransferStats

__all__ = ["BatchTransfer"]

_NBYTES = operator.attrgetter("nbytes")
_NUMPY = SUPPORTED - {torch.bfloat16, torch.uint16, torch.uint32}  # (t.numpy() views them)


class BatchTransfer:
    """The hand-over of dicts of CPU tensors of one form (names, dtypes, shapes) to
    ``sharding``: what :func:`bridge.to_jax` would do, decided once (:meth:`plan`).

    Example:
        >>> import torch, bridge
        >>> stats = bridge.new_stats()
        >>> batch = {"x": torch.ones(4, 2), "y": torch.arange(4)}
        >>> hand_over = BatchTransfer.plan(batch, None, stats)
        >>> out = hand_over(batch)
        >>> out["x"].unsafe_buffer_pointer() == batch["x"].data_ptr(), str(out["y"].dtype)
        (True, 'int32')
        >>> stats.transfers, sum(stats.copies.values())  # (the int64 labels: narrowed)
        (1, 1)
    """

    def __init__(
        self, sample: dict[str, torch.Tensor], sharding: Sharding | None, stats: TransferStats
    ) -> None:
        self.names = tuple(sample)
        self.stats = stats
        single = sharding is None or _is_host_device(sharding, sample)
        self.shardings = (
            None if single else [_leaf_sharding(sharding, t.dim()) for t in sample.values()]
        )
        self.on_host = single or all(map(_on_cpu, self.shardings or ()))  # (else: copied over)
        self.remembered = tuple(t.dtype in AMBIGUOUS for t in sample.values())
        self.copied: list[int] | None = None  # shard bytes JAX copied, per field (first call)

    @classmethod
    def plan(
        cls, sample: dict[str, torch.Tensor], sharding: Sharding | None, stats: TransferStats
    ) -> BatchTransfer | None:
        """The transfer for batches like ``sample``, or ``None`` where :func:`to_jax` must
        decide per batch (several processes, a device tensor, a leaf that is not a tensor,
        a dtype numpy does not view, a tensor that requires grad)."""
        x64 = jax.config.read("jax_enable_x64")
        for t in sample.values():
            if not isinstance(t, torch.Tensor) or not t.is_cpu or t.requires_grad:
                return None
            if t.dtype not in _NUMPY and (x64 or NARROW.get(t.dtype) not in _NUMPY):
                return None
        if jax.process_count() != 1 or type(sample) is not dict:
            return None
        return cls(sample, sharding, stats)

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, jax.Array]:
        """``batch`` (of the planned form) on its sharding: one loop over the fields, the
        copy policy's test inline (:func:`bridge._dlpack.prepare`'s, the tensors on the CPU)
        and its copy only for a field that needs one (an ``int64`` field: narrowed, its range
        checked, every batch)."""
        stats, names, sharded = self.stats, self.names, self.shardings is not None
        stats.transfers += 1
        ready: list[torch.Tensor] = []
        local = []
        for name in names:
            t = batch[name]
            if not (
                t.dtype in SUPPORTED
                and not t.requires_grad
                and t.is_contiguous()
                and not t.data_ptr() % ALIGN
                and not t.is_pinned()
            ):
                t = _policy_copy(name, t, strict=False, stats=stats)
            ready.append(t)
            if sharded:
                local.append(t.numpy())
        if self.shardings is None:
            out = []
            for name, r in zip(names, ready, strict=True):
                out.append(_place_single(name, r, strict=False, stats=stats, own=r is batch[name]))
        else:
            out = jax.make_array_from_process_local_data(self.shardings, local)
            if not self.on_host:  # (a device's memory: one host-to-device copy of each field)
                stats.host_to_device_bytes += sum(map(_NBYTES, ready))
            elif self.copied is None:  # (the same layout each batch: JAX copies the same shards)
                self.copied = [copied_shard_bytes(x, r) for x, r in zip(out, ready, strict=True)]
            for name, r, copied in zip(names, ready, self.copied or (), strict=False):
                if copied:
                    stats.record_copy(
                        name, "JAX copied shards whose host offset is not 64-byte aligned", copied
                    )
                if r is batch[name]:
                    stats.zero_copy_bytes += max(r.nbytes - copied, 0)
        for name, keep, x in zip(names, self.remembered, out, strict=True):
            if keep:
                remember(name, batch[name].dtype, x)
        return dict(zip(names, out, strict=True))
