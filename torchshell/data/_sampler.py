"""Per-process, per-epoch shuffling that a resumed run reproduces exactly."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler, Dataset, DistributedSampler


class EpochBatchSampler(BatchSampler):
    """Batches of a :class:`DistributedSampler`, checkpointable mid-epoch.

    The order is a function of ``(seed, epoch)`` and the JAX process, and the state
    (``state_dict``: epoch and batches drawn) is saved by torchdata's ``StatefulDataLoader``
    inside Lightning's checkpoint. On resume the epoch is restored before the first batch is
    drawn, so a resumed run sees exactly the batches an uninterrupted one would (a shuffling
    ``generator`` would not: its state is not part of the checkpoint).

    Example:
        >>> bs = epoch_batches(list(range(10)), batch_size=4, seed=0)
        >>> bs.load_state_dict({"epoch": 1, "drawn": 1})
        >>> len(list(bs))
        1
    """

    sampler: DistributedSampler

    def __init__(self, sampler: DistributedSampler, batch_size: int, drop_last: bool) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self._drawn = 0
        self._skip = 0

    def __iter__(self) -> Iterator[list[int]]:
        skip, self._skip = self._skip, 0
        self._drawn = skip
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                self._drawn += 1
                yield batch

    def set_epoch(self, epoch: int) -> None:
        """Sets the shuffle epoch (Lightning calls this at each epoch start)."""
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.sampler.epoch, "drawn": self._drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.set_epoch(state["epoch"])
        self._skip = state["drawn"]


def epoch_batches(
    dataset: Dataset, *, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = True
) -> EpochBatchSampler:
    """An :class:`EpochBatchSampler` over this JAX process's shard of ``dataset``.

    Each process (``jax.process_index()`` of ``jax.process_count()``) reads its own shard;
    the permutation is the same on every process for an epoch.
    """
    import jax  # here, not at import: spawned DataLoader workers import this module

    sampler: DistributedSampler = DistributedSampler(
        dataset,
        num_replicas=jax.process_count(),
        rank=jax.process_index(),
        shuffle=shuffle,
        seed=seed,
        drop_last=True,
    )
    return EpochBatchSampler(sampler, batch_size, drop_last)
