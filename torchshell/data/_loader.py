"""DataLoader settings that are safe beside JAX."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate
from torch.utils.data import _utils as _worker_utils
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.stateful_dataloader import (
    _StatefulMultiProcessingDataLoaderIter,
)


def loader_kwargs(num_workers: int, seed: int) -> dict[str, Any]:
    """DataLoader keyword arguments for ``num_workers`` workers beside a running JAX.

    JAX is multithreaded and not fork-safe: forking after it starts warns ("os.fork() was
    called ... JAX is multithreaded, so this will likely lead to a deadlock"). So workers
    start with ``spawn`` (never ``fork``), and are kept alive across epochs
    (``persistent_workers``) because a spawned worker is slow to start (it imports torch and
    the dataset's module afresh: 2.6 s against 0.11 s with fork for 64 batches, measured).

    Seeding: the ``generator`` fixes the shuffle order and the workers' base seed; torch then
    seeds ``random``, ``numpy`` and ``torch`` in each worker from it (no ``worker_init_fn``,
    so a spawned worker imports only what the dataset itself needs).

    Example:
        >>> loader_kwargs(0, seed=1)["num_workers"]
        0
        >>> loader_kwargs(2, seed=1)["multiprocessing_context"]
        'spawn'
    """
    generator = torch.Generator().manual_seed(seed)
    if num_workers == 0:
        return {"num_workers": 0, "generator": generator}
    return {
        "num_workers": num_workers,
        "multiprocessing_context": "spawn",
        "persistent_workers": True,
        "generator": generator,
    }


def stop_workers(loader: Any) -> None:
    """Stops a DataLoader's worker processes now and waits for them (persistent ones too).

    A ``persistent_workers`` loader keeps its workers alive for the next epoch. Whoever
    iterates a loader for a fixed pass (export, parity, doctor's sample batch) calls this when
    done: the batches still in flight are received first (see :class:`DrainingDataLoader`
    for why), then each worker is sent its stop and joined. Takes the loader, or the iterator
    of a loader without persistent workers; anything without workers is left as it is.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(range(4), batch_size=2)
        >>> [b.tolist() for b in loader]
        [[0, 1], [2, 3]]
        >>> stop_workers(loader)
    """
    iterator = (
        loader if hasattr(loader, "_shutdown_workers") else getattr(loader, "_iterator", None)
    )
    if iterator is None or not hasattr(iterator, "_shutdown_workers"):
        return
    try:
        _receive_in_flight(iterator)
    finally:  # a worker that died while draining still gets the others stopped
        iterator._shutdown_workers()  # sends each worker its stop and joins it
    if getattr(loader, "_iterator", None) is iterator:
        loader._iterator = None


def _receive_in_flight(iterator: Any) -> None:
    """Receives (and drops) the batches a multi-process iterator's workers still owe it."""
    while getattr(iterator, "_tasks_outstanding", 0) > 0 and not getattr(
        iterator, "_shutdown", True
    ):
        iterator._get_data()  # a batch in flight (or a worker's error), dropped
        iterator._tasks_outstanding -= 1


class _DrainingIterator(_StatefulMultiProcessingDataLoaderIter):
    """torchdata's multi-process iterator, whose shutdown first receives the batches in flight."""

    def _shutdown_workers(self) -> None:
        try:
            if _worker_utils.python_exit_status is False:  # not from the interpreter's exit
                _receive_in_flight(self)
        finally:
            super()._shutdown_workers()


class DrainingDataLoader(StatefulDataLoader):
    """torchdata's ``StatefulDataLoader``, whose workers are only ever stopped between batches.

    A worker hands each batch to a queue thread that moves it into shared memory; a worker
    told to stop while that thread still works on a prefetched batch exits under it, and the
    C++ frame it is in aborts the worker: ``terminate called without an active exception``,
    then ``DataLoader worker ... is killed by signal: Aborted`` in the trainer. Lightning drops
    a stateful loader's iterator without stopping it first when a pass ends early
    (``max_steps`` mid-epoch, ``limit_*_batches``; its reset only stops torch's own
    iterator class), so the iterator's ``__del__`` stopped workers mid-batch: 4 of 8 workers
    aborted with 16 MB rows. This loader's iterator receives the batches in flight before
    it stops its workers, however it is stopped (0 of 8).

    Example:
        >>> loader = DrainingDataLoader(range(4), batch_size=2)
        >>> [b.tolist() for b in loader]
        [[0, 1], [2, 3]]
    """

    def _get_iterator(self) -> Any:
        if self.num_workers == 0:
            return super()._get_iterator()
        self.check_worker_number_rationality()
        iterator = _DrainingIterator(self, self.next_iter_state)  # type: ignore[has-type]
        self.next_iter_state = None
        return iterator


class GatheredRows(Sequence[dict[str, torch.Tensor]]):
    """A batch a dataset gathered at once (``__getitems__``), still a sequence of rows.

    torch's DataLoader hands ``dataset.__getitems__(indices)`` to the collate function. A
    dataset returning this object works with any collate (``default_collate`` sees rows), and
    :func:`batch_collate` takes the pre-gathered batch as it is: one fancy index per field
    instead of one ``__getitem__`` per row and a stack.

    Example:
        >>> import torch
        >>> rows = GatheredRows({"x": torch.arange(6).reshape(3, 2)})
        >>> len(rows), rows[1]["x"].tolist()
        (3, [2, 3])
    """

    def __init__(self, batch: Mapping[str, torch.Tensor]) -> None:
        self.batch = dict(batch)
        self._rows = len(next(iter(self.batch.values())))

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {name: t[i] for name, t in self.batch.items()}


def batch_collate(data: Any) -> Any:
    """Collate that passes a :class:`GatheredRows` batch through and collates rows otherwise.

    Example:
        >>> import torch
        >>> batch_collate(GatheredRows({"x": torch.ones(2, 3)}))["x"].shape
        torch.Size([2, 3])
    """
    return data.batch if isinstance(data, GatheredRows) else default_collate(data)


def forking_loaders(loaders: Any) -> list[DataLoader]:
    """The torch ``DataLoader``s among ``loaders`` whose workers would start with ``fork``.

    ``loaders`` is what the Trainer holds (one loader, or a list/dict of them). A loader
    with workers and no ``multiprocessing_context`` uses the platform's default start
    method: ``fork`` on Linux, where JAX (already running) warns that its threads may
    deadlock the child.

    Example:
        >>> data = torch.utils.data.TensorDataset(torch.ones(4))
        >>> [l.num_workers for l in forking_loaders([DataLoader(data, num_workers=2)])]
        [2]
        >>> forking_loaders({"a": DataLoader(data, **loader_kwargs(2, seed=0))})
        []
    """
    import multiprocessing as mp

    found: list[DataLoader] = []
    for item in loaders_in(loaders):
        if item.num_workers > 0:
            context = item.multiprocessing_context
            method = (
                context.get_start_method()
                if context is not None
                else mp.get_start_method(allow_none=True) or mp.get_all_start_methods()[0]
            )
            if method == "fork":
                found.append(item)
    return found


def loaders_in(loaders: Any) -> list[DataLoader]:
    """The torch ``DataLoader``s in what the Trainer holds (a loader, lists/dicts of them).

    Example:
        >>> data = torch.utils.data.TensorDataset(torch.ones(4))
        >>> len(loaders_in({"a": DataLoader(data), "b": [DataLoader(data), None]}))
        2
    """
    found: list[DataLoader] = []
    pending = [loaders]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
        elif isinstance(item, DataLoader):
            found.append(item)
    return found[::-1]
