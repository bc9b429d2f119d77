"""Per-transfer accounting: bytes handed over zero-copy, bytes copied, and why."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class TransferStats:
    """What crossing the bridge cost, accumulated over any number of transfers.

    ``copies`` counts each ``(field, reason)`` once per transfer, so a field that is copied
    on every step shows up as one key with a growing count (the object stays small over a
    long run).

    Attributes:
        transfers: calls of :func:`bridge.to_jax` that recorded here.
        zero_copy_bytes: bytes JAX now aliases in the caller's torch buffers (measured by
            comparing buffer pointers on CPU; DLPack hand-overs on an accelerator).
        copied_bytes: bytes copied on the host because of the copy policy (dtype, layout,
            alignment, padding) or because JAX copied a shard itself.
        host_to_device_bytes: bytes moved from host memory to an accelerator (one copy per
            byte, unavoidable).
        device_to_host_copies: arrays :func:`bridge.to_torch` / :func:`bridge.as_torch`
            brought to the host because DLPack was refused (a TPU, a float8 dtype) or the
            array spans processes.
        device_to_host_bytes: the bytes of those arrays.
        copies: ``(field, reason) -> number of transfers`` that copied that field.

    Example:
        >>> import bridge, torch
        >>> stats = bridge.new_stats()
        >>> _ = bridge.to_jax({"y": torch.tensor([1, 2])}, stats=stats)  # int64: one copy
        >>> stats.copied_bytes, list(stats.copies)
        (8, [('y', 'torch.int64 narrowed to int32 (JAX runs with x64 off)')])
    """

    transfers: int = 0
    zero_copy_bytes: int = 0
    copied_bytes: int = 0
    host_to_device_bytes: int = 0
    device_to_host_copies: int = 0
    device_to_host_bytes: int = 0
    copies: Counter[tuple[str, str]] = field(default_factory=Counter)

    def record_copy(self, name: str, reason: str, nbytes: int) -> None:
        """Counts ``nbytes`` copied for field ``name`` because of ``reason``."""
        self.copied_bytes += nbytes
        self.copies[(name, reason)] += 1

    def record_device_to_host(self, nbytes: int) -> None:
        """Counts one array of ``nbytes`` copied from a device to the host for torch."""
        self.device_to_host_copies += 1
        self.device_to_host_bytes += nbytes

    def as_metrics(self) -> dict[str, float]:
        """Flat numbers for a logger (e.g. ``mlflow.log_metrics`` or ``LightningModule.log``).

        Example:
            >>> TransferStats(transfers=2, zero_copy_bytes=10).as_metrics()["zero_copy_bytes"]
            10.0
        """
        return {
            "transfers": float(self.transfers),
            "zero_copy_bytes": float(self.zero_copy_bytes),
            "copied_bytes": float(self.copied_bytes),
            "host_to_device_bytes": float(self.host_to_device_bytes),
            "device_to_host_copies": float(self.device_to_host_copies),
            "device_to_host_bytes": float(self.device_to_host_bytes),
            "copies": float(sum(self.copies.values())),
        }

    def summary(self) -> str:
        """One human-readable paragraph: totals, then each copied field and its reason."""
        lines = [
            f"{self.transfers} transfers: {self.zero_copy_bytes} B zero-copy, "
            f"{self.copied_bytes} B copied, {self.host_to_device_bytes} B host-to-device"
        ]
        if self.device_to_host_copies:
            lines.append(
                f"{self.device_to_host_copies} arrays to torch through the host: "
                f"{self.device_to_host_bytes} B device-to-host"
            )
        lines += [f"  {n}x {name!r}: {why}" for (name, why), n in self.copies.most_common()]
        return "\n".join(lines)

    def reset(self) -> None:
        """Zeroes every count (e.g. at the start of an epoch)."""
        self.transfers = self.zero_copy_bytes = self.copied_bytes = 0
        self.host_to_device_bytes = self.device_to_host_copies = self.device_to_host_bytes = 0
        self.copies.clear()


def new_stats() -> TransferStats:
    """An empty :class:`TransferStats` for ``stats=`` of :func:`bridge.to_jax` / ``to_torch``.

    Example:
        >>> new_stats().copied_bytes
        0
    """
    return TransferStats()
