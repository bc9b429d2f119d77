"""The rows a ``DistributedSampler`` repeats, kept out of the user's evaluation hooks.

Such a sampler evens out the processes' shards by repeating rows at the end of a shard
(:func:`torchshell.data.real_rows`). ``JaxModule``'s own evaluation masks them
(:mod:`torchshell.module._evaluation`); a ported ``validation_step``/``test_step`` computes its own
means over the rows it is given, so here the repeated rows are cut off the batch before the
hook sees it (a batch of repeats only is not evaluated): the epoch's values are those of the
dataset's own rows, each once. That needs one process: with several, each process's last
batch would keep a different number of rows, and the processes hand over one global batch
of one shape, so a sampler that repeats rows is refused there, naming the fix.
"""

from __future__ import annotations

from typing import Any

import jax
import torch
from lightning_utilities.core.apply_func import apply_to_collection

from torchshell._errors import ConfigError
from torchshell.data._sampler import real_rows, shard_sampler

__all__ = ["RepeatedRows"]


class RepeatedRows:
    """Per evaluation loader: how many of this process's rows were handed out so far."""

    def __init__(self) -> None:
        self.shards: dict[int | None, list[Any]] = {}

    def real_part(
        self, loader: Any, batch: Any, n: int, batch_idx: int, dataloader_idx: int | None
    ) -> Any:
        """``batch`` without the sampler's repeated rows (``None``: all of them repeats).

        Args:
            loader: the DataLoader the batch came from (``None``: unknown, kept whole).
            batch: the user's batch (any structure of tensors, ``n`` rows each).
            n: its rows.
            batch_idx: its index in the loader's pass (0 starts a new pass).
            dataloader_idx: which evaluation loader.

        Example:
            >>> from torch.utils.data import DataLoader, DistributedSampler
            >>> data = list(range(5))
            >>> loader = DataLoader(data, batch_size=2,
            ...     sampler=DistributedSampler(data, num_replicas=2, rank=1, shuffle=False))
            >>> rows = RepeatedRows()
            >>> [rows.real_part(loader, b, len(b), i, None) for i, b in enumerate(loader)]
            [tensor([1, 3]), None]
        """
        if batch_idx == 0 or dataloader_idx not in self.shards:  # a new pass
            sampler = shard_sampler(loader)
            real = real_rows(sampler)
            if real is not None and jax.process_count() > 1:
                assert sampler is not None  # (real_rows found one)
                if sampler.total_size != len(sampler.dataset):  # type: ignore[arg-type]
                    raise ConfigError(
                        f"the evaluation loader's DistributedSampler repeats "
                        f"{sampler.total_size - len(sampler.dataset)} row(s) to even out "  # type: ignore[arg-type]
                        f"{sampler.num_replicas} shards; from_lightning's validation_step/"
                        "test_step compute their own means over the global batch, so the "
                        "repeats would count. Fix: a split whose length the number of "
                        "processes divides, or DistributedSampler(drop_last=True), or "
                        "evaluate in one process."
                    )
            self.shards[dataloader_idx] = [real, 0]
        shard = self.shards[dataloader_idx]
        real, seen = shard
        shard[1] = seen + n
        if real is None or seen + n <= real:
            return batch
        keep = max(real - seen, 0)
        if keep == 0:
            return None
        return apply_to_collection(
            batch, torch.Tensor, lambda t: t[:keep] if t.ndim and t.shape[0] == n else t
        )
