"""A plain ``TensorDataset`` loader read with one gather per field: the same batches, faster.

``DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)`` builds every batch by
calling ``dataset[i]`` 64 times and stacking the rows (``default_collate``): ~200 µs a batch
here, a third of a small model's step. Indexing each tensor once with the batch's indices,
``[x[idx], y[idx]]``, gives the same list of tensors (values, dtypes, shapes, layout) in
~40 µs. While a ``JaxModule`` runs (fit, validate, test, predict), its loaders that read a
``TensorDataset`` in batches in this process (no workers) read them this way (undone in the
module's ``teardown``); torchdata's ``StatefulDataLoader`` over a ``TensorDataset`` too (its
own iterator keeps its state: ``state_dict``/``load_state_dict`` resume as before). The
loader's own iterator still draws the indices (sampler, shuffle seed, ``drop_last``, pinning
unchanged), only the fetch of the rows is replaced.

A loader with its own ``collate_fn`` (``lambda rows: {"x": ..., "y": ...}``) still gets
its rows: one gather per tensor, then the gathered tensors' rows (``unbind``: views, no
copy) as the tuples ``dataset[i]`` returns, handed to the collate as a list, as torch does.
The rows hold the same values, dtypes, shapes and strides; they view the gathered batch
rather than the dataset's tensors, so a collate that writes into its rows in place no
longer changes the dataset. Anything else (a ``Dataset`` subclass, workers) is read as it
is.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate
from torchdata.stateful_dataloader import StatefulDataLoader

_PLAIN = (DataLoader, StatefulDataLoader)  # loaders whose iterators fetch by `_dataset_fetcher`


class _Gather:
    """Stands in for torch's map-style fetcher: ``fetch(indices)`` gathers each tensor
    (and hands a loader's own ``collate_fn`` the gathered rows)."""

    def __init__(self, dataset: TensorDataset, collate: Any = default_collate):
        self.dataset = dataset  # (what a StatefulDataLoader's iterator reads for its state)
        self.tensors = dataset.tensors
        self.collate = collate

    def fetch(self, index: Any) -> Any:
        """Each tensor's ``t[rows]``, copied by numpy into a torch-allocated tensor (in one
        loop: no call per tensor): torch's indexing splits over its intra-op threads, which
        wait for the cores a running step holds (at torch's default 2 threads here the gather
        took 9x longer than at 1 and the step slowed)."""
        rows = np.asarray(index, dtype=np.int64)
        gathered = []
        for t in self.tensors:
            if t.device.type != "cpu" or t.dtype == torch.bfloat16 or t.requires_grad:
                gathered.append(t[torch.as_tensor(rows)])
                continue
            out = torch.empty((len(rows), *t.shape[1:]), dtype=t.dtype)
            np.take(t.numpy(), rows, axis=0, out=out.numpy())
            gathered.append(out)
        if self.collate is default_collate:
            return gathered  # (what default_collate makes of the rows' tuples)
        return self.collate(list(zip(*(g.unbind(0) for g in gathered), strict=True)))


def _gathering_iterator(loader: DataLoader) -> Any:
    it = type(loader)._get_iterator(loader)  # the loader's own: indices, seed, pinning, state
    it._dataset_fetcher = _Gather(loader.dataset, loader.collate_fn)  # type: ignore[attr-defined,arg-type]
    return it


def gatherable(loader: Any) -> bool:
    """Whether ``loader`` (a ``DataLoader`` or torchdata's ``StatefulDataLoader``, not a
    subclass) reads a plain ``TensorDataset`` in batches, in this process.

    Example:
        >>> data = TensorDataset(torch.arange(6.0), torch.arange(6))
        >>> own = DataLoader(data, batch_size=2, collate_fn=lambda rows: rows)
        >>> workers = DataLoader(data, batch_size=2, num_workers=1)
        >>> gatherable(DataLoader(data, batch_size=2)), gatherable(own), gatherable(workers)
        (True, True, False)
    """
    return (
        type(loader) in _PLAIN
        and type(loader.dataset) is TensorDataset
        and loader.num_workers == 0
        and loader.batch_sampler is not None
    )


def read_by_gathers(loader: DataLoader) -> None:
    """From now on ``loader``'s iterators fetch each batch with one gather per tensor.

    Example:
        >>> data = TensorDataset(torch.arange(6.0).reshape(3, 2), torch.arange(3))
        >>> loader = DataLoader(data, batch_size=2)
        >>> read_by_gathers(loader)
        >>> next(iter(loader))
        [tensor([[0., 1.],
                [2., 3.]]), tensor([0, 1])]
        >>> read_normally(loader)
    """
    loader.__dict__["_get_iterator"] = lambda: _gathering_iterator(loader)


def read_normally(loader: DataLoader) -> None:
    """Undoes :func:`read_by_gathers`."""
    loader.__dict__.pop("_get_iterator", None)
