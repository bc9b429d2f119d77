"""DataLoader workers beside a running JAX: spawned, persistent, and feeding the bridge."""

import gc
import warnings

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding, PartitionSpec
from torch.utils.data import DataLoader, StackDataset

import bridge
import jaxcore
from torchshell.data import DrainingDataLoader, loader_kwargs, stop_workers
from torchshell.data.digits import DigitsDataset


def _fork_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "fork" in str(w.message)]


def test_spawned_workers_feed_the_bridge_without_the_fork_warning():
    jax.devices()  # JAX is initialised (and multithreaded) before the workers start
    digits = DigitsDataset()
    # the same rows as a torch-only dataset, so each spawned worker imports just torch
    ds = StackDataset(x=digits.x, y=digits.y)
    loader = DataLoader(ds, batch_size=64, **loader_kwargs(2, seed=0))
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    assert loader.persistent_workers
    sharding = NamedSharding(jaxcore.make_mesh({"data": -1}), PartitionSpec("data"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = iter(loader)
        ys, rows = [], 0
        with bridge.prefetch(first, sharding=sharding, pad_to=64) as batches:
            for batch in batches:
                mask = np.asarray(batch["mask"])
                ys.append(np.asarray(batch["y"])[mask])
                rows += int(mask.sum())
        second = iter(loader)  # the next epoch reuses the same worker processes
    assert not _fork_warnings(caught), _fork_warnings(caught)
    assert second is first
    assert rows == len(ds) == 1797
    assert np.array_equal(np.concatenate(ys), digits.y.numpy())
    del first, second, loader


def test_forking_after_jax_starts_is_what_the_warning_catches():
    # the control: the same loader with the default fork context does warn
    jax.devices()
    loader = DataLoader(
        DigitsDataset(), batch_size=512, num_workers=1, multiprocessing_context="fork", timeout=60
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n = sum(len(b["y"]) for b in loader)
    assert n == 1797
    assert any("JAX is multithreaded" in m for m in _fork_warnings(caught))


def test_no_workers_needs_no_context():
    kwargs = loader_kwargs(0, seed=1)
    assert kwargs["num_workers"] == 0 and "multiprocessing_context" not in kwargs
    a = [b["y"] for b in DataLoader(DigitsDataset(), batch_size=600, shuffle=True, **kwargs)]
    b = [
        b["y"]
        for b in DataLoader(DigitsDataset(), batch_size=600, shuffle=True, **loader_kwargs(0, 1))
    ]
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))  # seeded order


def test_stop_workers_receives_the_batches_in_flight_then_joins_the_workers():
    """A pass dropped after one batch (doctor's sample, a parity batch) leaves batches in
    flight; a worker stopped in the middle of one aborted at its exit. ``stop_workers``
    receives them first, then stops and joins every worker: both exit with status 0."""
    digits = DigitsDataset()
    loader = DataLoader(StackDataset(x=digits.x, y=digits.y), batch_size=64, **loader_kwargs(2, 0))
    iterator = iter(loader)
    next(iterator)
    workers = list(iterator._workers)
    assert iterator._tasks_outstanding > 0  # prefetched batches are in flight
    stop_workers(loader)
    assert iterator._tasks_outstanding == 0 and loader._iterator is None
    assert [w.exitcode for w in workers] == [0, 0]
    stop_workers(loader)  # a loader without workers now: nothing to do


def test_a_draining_loader_dropped_mid_pass_stops_its_workers_between_batches():
    """Lightning drops a stateful loader's iterator mid-pass (``max_steps`` mid-epoch) by
    ``loader._iterator = None``, leaving its ``__del__`` to stop the workers. torchdata's own
    loader then stops a worker while it still moves a prefetched batch into shared memory,
    and the worker aborts (``terminate called without an active exception``): with these
    64 MB batches 4 of 8 workers exited with -6 (SIGABRT). The draining loader receives the
    batches in flight first: every worker exits with status 0."""
    rows = StackDataset(x=torch.zeros(64, 1).expand(64, 4_000_000))  # 16 MB rows, tiny storage
    codes = []
    for _ in range(3):
        loader = DrainingDataLoader(rows, batch_size=4, **loader_kwargs(2, 0))
        iterator = iter(loader)
        next(iterator)
        workers = list(iterator._workers)
        assert iterator._tasks_outstanding > 0  # prefetched batches are in flight
        loader._iterator = None  # Lightning's reset of a loader it does not know
        del iterator
        gc.collect()
        for worker in workers:
            worker.join(timeout=60)
        codes.append([w.exitcode for w in workers])
    assert codes == [[0, 0]] * 3


def test_a_users_forking_loader_is_named_once_with_the_fix(tmp_path) -> None:
    """A plain DataLoader(num_workers=1) (fork on Linux) under a JaxModule: one coreshell
    warning with the fix, however many times its workers start; a spawn loader: none."""
    from torch.utils.data import TensorDataset

    from tests.helpers import quiet_trainer
    from torchshell import JaxModule

    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    for loader, expected in (
        (DataLoader(data, batch_size=16, num_workers=1), 1),
        (DataLoader(data, batch_size=16, **loader_kwargs(1, seed=0)), 0),
    ):
        net = torch.nn.Linear(4, 2)
        jm = JaxModule.from_torch(
            net,
            torch.nn.CrossEntropyLoss(),
            torch.optim.SGD(net.parameters(), lr=0.1),
            print_summary=False,
        )
        trainer = quiet_trainer(max_epochs=2, default_root_dir=tmp_path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(jm, loader)
        ours = [w for w in caught if "starts its workers with fork" in str(w.message)]
        assert len(ours) == expected
        if expected:
            assert "multiprocessing_context='spawn'" in str(ours[0].message)
