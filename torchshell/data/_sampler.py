"""Per-process data: per-epoch shuffling that a resumed run reproduces exactly, and each
process's share of an evaluation set."""

from __future__ import annotations

from collections.abc import Iterator, Sized
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


def eval_shard(dataset: Sized) -> DistributedSampler:
    """This JAX process's share of an evaluation set, in order; every row on some process.

    Process ``p`` of ``N`` (``jax.process_index()`` of ``jax.process_count()``) reads rows
    ``p, p + N, p + 2N, ...``. A step is one collective over every process, so every process
    must run as many batches, of the same sizes: like Lightning's distributed sampler (torch's
    ``DistributedSampler``, ``drop_last=False``), the shards are evened out by repeating the
    first rows. Those repeats are padding: :func:`real_rows` counts the rows of a shard that
    are not, and ``JaxModule`` masks the rest, so validation/test means stay exact.

    Example:
        >>> sampler = eval_shard(list(range(5)))  # one process: every row, in order
        >>> list(sampler), real_rows(sampler)
        ([0, 1, 2, 3, 4], 5)
    """
    import jax  # here, not at import: spawned DataLoader workers import this module

    return DistributedSampler(
        dataset,  # type: ignore[arg-type]
        num_replicas=jax.process_count(),
        rank=jax.process_index(),
        shuffle=False,
        drop_last=False,
    )


def real_rows(sampler: Any) -> int | None:
    """How many of a distributed sampler's rows are the dataset's own, not padding repeats.

    torch's ``DistributedSampler`` (and Lightning's wrappers of it) with ``drop_last=False``
    appends repeated indices so that ``total_size`` is a multiple of ``num_replicas``, then
    gives replica ``r`` the positions ``r, r + num_replicas, ...`` of that list: positions
    from ``len(dataset)`` on are the repeats, so they are the last ones of a shard. Returns
    the count before them, or ``None`` for a sampler that adds no rows (any other sampler, or
    ``drop_last=True``, which drops rows instead).

    Example:
        >>> s = DistributedSampler(list(range(5)), num_replicas=2, rank=1, shuffle=False)
        >>> list(s), real_rows(s)  # rows 1 and 3, then row 0 again to even out the shards
        ([1, 3, 0], 2)
    """
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last:
        return None
    return len(range(sampler.rank, len(sampler.dataset), sampler.num_replicas))  # type: ignore[arg-type]


def shard_sampler(loader: Any) -> DistributedSampler | None:
    """The ``DistributedSampler`` a DataLoader draws its rows from (given as its
    ``sampler``, or inside its ``batch_sampler``), or ``None``.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> shard_sampler(DataLoader(list(range(4)), sampler=eval_shard(list(range(4))))).rank
        0
        >>> shard_sampler(DataLoader(list(range(4)))) is None
        True
    """
    for sampler in (
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
        getattr(loader, "sampler", None),
    ):
        if isinstance(sampler, DistributedSampler):
            return sampler
    return None
