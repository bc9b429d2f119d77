"""The loader side every recipe's DataModule shares."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning as L
from torch.utils.data import Dataset

from torchshell.data._loader import DrainingDataLoader, batch_collate, loader_kwargs
from torchshell.data._sampler import epoch_batches, eval_shard


def _processes() -> int:
    import jax  # here, not at import: spawned DataLoader workers import this module

    return jax.process_count()


class SplitDataModule(L.LightningDataModule):
    """Train/val/test ``datasets`` served by torchdata's ``StatefulDataLoader``
    (:class:`~torchshell.data.DrainingDataLoader`: its workers stop between batches).

    Training batches come from :func:`~torchshell.data._sampler.epoch_batches`: shuffled as a
    function of ``(seed, epoch, process)``, ``drop_last`` (one compiled step), and resumable
    mid-epoch (Lightning checkpoints the loader's position). Validation and test keep every
    row in order, split over the JAX processes (:func:`~torchshell.data.eval_shard`: each
    process evaluates its share; the repeats that even out the shards and the last batch's
    padding are masked by the shell); prediction reads the whole test split in every
    process. Workers follow
    :func:`~torchshell.data.loader_kwargs` (``spawn``, persistent).

    Subclasses set ``batch_size``, ``eval_batch_size``, ``num_workers``, ``seed`` and, in
    ``setup``, ``datasets``; ``collate`` defaults to :func:`batch_collate`.
    """

    batch_size: int
    eval_batch_size: int
    num_workers: int
    seed: int
    datasets: Mapping[str, Dataset[Any]]
    collate: Callable[[Any], Any] = staticmethod(batch_collate)

    def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
        """The identity: JAX's mesh places the batch (through the bridge), Lightning never
        moves it (its default walks every batch: ~0.3 ms a step, measured)."""
        return batch

    def _loader(
        self, split: str, batch_size: int, train: bool, shard: bool = False
    ) -> DrainingDataLoader:
        dataset, kwargs = self.datasets[split], loader_kwargs(self.num_workers, self.seed)
        if train:
            kwargs.pop("generator", None)  # the order comes from (seed, epoch, process)
            batches = epoch_batches(dataset, batch_size=batch_size, seed=self.seed)
            return DrainingDataLoader(
                dataset, batch_sampler=batches, collate_fn=self.collate, **kwargs
            )
        if shard and _processes() > 1:  # (one process: the plain loader, every row in order)
            kwargs["sampler"] = eval_shard(dataset)  # type: ignore[arg-type]
        return DrainingDataLoader(dataset, batch_size=batch_size, collate_fn=self.collate, **kwargs)

    def train_dataloader(self) -> DrainingDataLoader:
        return self._loader("train", self.batch_size, True)

    def val_dataloader(self) -> DrainingDataLoader:
        return self._loader("val", self.eval_batch_size, False, shard=True)

    def test_dataloader(self) -> DrainingDataLoader:
        return self._loader("test", self.eval_batch_size, False, shard=True)

    def predict_dataloader(self) -> DrainingDataLoader:
        return self._loader("test", self.eval_batch_size, False)
