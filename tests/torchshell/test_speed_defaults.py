"""``steps_per_call="auto"`` (the default): K buffered batches per jitted call, K=1 meaning.

The window machinery is tested with K fixed (``Windows.choose``), so that windows really
run whatever the machine's load; :func:`choose_k` itself is tested on given timings.
"""

from __future__ import annotations

from typing import Any

import jax
import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers.logger import Logger
from torch.utils.data import DataLoader, TensorDataset

import jaxcore
from jaxcore.models.digits import MLP
from tests.helpers import quiet_trainer
from torchshell import JaxModule
from torchshell.module._windows import Windows, choose_k


def _loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(300, 64, generator=g)
    y = torch.randint(0, 10, (300,), generator=g)  # int64, as a user's labels are
    return DataLoader(TensorDataset(x, y), batch_size=32)  # 9 full batches + 12 rows


class _Steps(Logger):
    """Records the steps and values the module logs."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "steps"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if "train/loss" in metrics and step is not None:
            self.logged[step] = dict(metrics)

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


class _StateReader(L.Callback):
    """Reads ``module.state`` after some batches: it must have caught up with global_step."""

    def __init__(self, every: int) -> None:
        self.every, self.seen = every, []

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            self.seen.append((trainer.global_step, int(module.state.step)))


def _fit(k: int | str, steps: int, monkeypatch: pytest.MonkeyPatch, callbacks=()) -> Any:
    if k != "auto":
        monkeypatch.setattr(Windows, "choose", staticmethod(lambda *_: k))
    module = JaxModule(
        MLP(features=(32,)),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer(lr=1e-2),
        mesh=jaxcore.make_mesh({"data": -1}, num_devices=1),
        print_summary=False,
    )
    logger = _Steps()
    trainer = quiet_trainer(max_steps=steps, log_every_n_steps=8, callbacks=list(callbacks))
    trainer.logger = logger
    trainer.fit(module, _loader())
    assert trainer.global_step == steps
    return module, logger


@pytest.fixture(scope="module")
def mp() -> Any:
    with pytest.MonkeyPatch.context() as m:
        yield m


@pytest.fixture(scope="module")
def runs(mp: pytest.MonkeyPatch) -> dict[int, Any]:
    # 27 steps: 3 epochs of 10 batches (a ragged one each), 27 not a multiple of K=4
    return {k: _fit(k, 27, mp) for k in (1, 4)}


def test_windows_train_like_single_steps(runs: dict[int, Any]) -> None:
    one, four = runs[1][0], runs[4][0]
    assert four.window_k == 4 and four.windows.runs > 0  # windows did run
    assert int(four.state.step) == 27
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
        one.state.params,
        four.state.params,
    )
    # the ragged batch is padded inside a window: no recompile for it there
    assert four.compiled.train.recompiles <= one.compiled.train.recompiles


def test_logging_steps_and_values_match_single_steps(runs: dict[int, Any]) -> None:
    one, four = runs[1][1].logged, runs[4][1].logged
    assert sorted(one) == sorted(four) == [8, 16, 24]
    for step in one:
        assert four[step]["train/loss"] == pytest.approx(one[step]["train/loss"], rel=1e-4)


def test_state_read_by_a_callback_has_caught_up(mp: pytest.MonkeyPatch) -> None:
    reader = _StateReader(every=3)
    module, _ = _fit(4, 13, mp, callbacks=[reader])
    assert reader.seen == [(s, s) for s in (3, 6, 9, 12)]
    assert int(module.state.step) == 13


def test_a_checkpoint_mid_window_holds_every_step_taken(
    mp: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from torchshell.checkpoint import _state_io

    reference, _ = _fit(1, 7, mp)
    first, _ = _fit(4, 7, mp)  # one window of 4, then 3 batches buffered when max_steps hits
    trainer = quiet_trainer(max_steps=7)
    trainer.strategy.connect(first)
    trainer.save_checkpoint(tmp_path / "seven.ckpt")  # the save reads the state
    ckpt = torch.load(tmp_path / "seven.ckpt", weights_only=False)
    saved = _state_io.state_from_tensors(ckpt[_state_io.STATE_KEY], reference.state)
    assert int(saved.step) == 7
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
        reference.state.params,
        saved.params,
    )


def test_choose_k_from_the_ratio_of_step_to_shell() -> None:
    assert choose_k(0.0004, 0.0008, 50) == 10  # the digits MLP: a short step
    assert choose_k(0.03, 0.001, 50) == 1  # the encoder: the step dominates
    assert choose_k(0.0004, 0.0008, 8) == 8
    assert choose_k(0.0004, 0.0008, 7) == 7
    assert choose_k(0.0004, 0.0008, 1) == 1  # every step logged
    assert choose_k(0.0004, 0.0008, 17) == 1  # a prime past 16: no divisor
    assert choose_k(0.009, 0.001, 50, flops=3e7) == 10  # a small step timed under load
    assert choose_k(0.03, 0.001, 50, flops=1e9) == 1
    # on an accelerator the host's time hides under a longer step: no K-step program (a
    # second compile) unless the shell nearly matches the step; a tiny step still windows
    assert choose_k(0.075, 0.022, 50) == 10  # the CPU's rule: shell >= 0.25x the step
    assert choose_k(0.075, 0.022, 50, overlapped=True) == 1  # the encoder on a TPU v5e
    assert choose_k(0.00004, 0.0009, 50, overlapped=True) == 10  # the digits MLP there
    assert choose_k(0.075, 0.07, 50, flops=1e12, overlapped=True) == 10  # host-bound


def test_steps_per_call_refuses_other_values() -> None:
    from torchshell._errors import ConfigError

    with pytest.raises(ConfigError, match="'auto' or an int >= 1"):
        JaxModule(MLP(), jaxcore.softmax_cross_entropy, None, steps_per_call="fast")


# -- a plain TensorDataset loader, read by gathers while a fit runs -------------------------
def _shuffled(seed: int, **kwargs: Any) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.rand(100, 6, generator=g),
        torch.randint(0, 10, (100,), generator=g),  # int64
        torch.rand(100, 2, 3, generator=g).double(),
        torch.rand(100, generator=g) > 0.5,
    )
    return DataLoader(
        data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(seed), **kwargs
    )


@pytest.mark.parametrize("drop_last", [False, True])
def test_gathered_batches_are_the_loaders_own(drop_last: bool) -> None:
    """Same rows in the same order (the sampler's draws), same types, dtypes, shapes, values."""
    from torchshell.data._gathered import read_by_gathers, read_normally

    plain = list(_shuffled(3, drop_last=drop_last))
    loader = _shuffled(3, drop_last=drop_last)
    read_by_gathers(loader)
    gathered = list(loader)
    read_normally(loader)
    assert len(gathered) == len(plain) == (6 if drop_last else 7)
    for a, b in zip(plain, gathered, strict=True):
        assert type(a) is type(b) is list
        for x, y in zip(a, b, strict=True):
            assert (x.dtype, x.shape, x.stride()) == (y.dtype, y.shape, y.stride())
            assert torch.equal(x, y)
    assert "_get_iterator" not in vars(loader)


class _Reads(L.Callback):
    def __init__(self) -> None:
        self.gathered: list[bool] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.gathered.append("_get_iterator" in vars(trainer.train_dataloader))

    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.gathered.append("_get_iterator" in vars(trainer.val_dataloaders))


def test_a_fit_on_a_plain_tensor_dataset_trains_as_the_loader_reads_it() -> None:
    """The gathered fit trains to the very weights of a fit on the loader's own reads; the
    loader reads as before once the fit ends, and other loaders are left alone."""
    import torchshell.data._gathered as gathered_reads

    def fit(gather: bool) -> tuple[Any, list[bool], DataLoader[Any]]:
        x, y = _shuffled(7).dataset.tensors[:2]
        loader = DataLoader(
            TensorDataset(x, y),
            batch_size=16,
            shuffle=True,
            generator=torch.Generator().manual_seed(7),
        )
        module = JaxModule(
            MLP(features=(16,)),
            jaxcore.softmax_cross_entropy,
            jaxcore.make_optimizer(lr=1e-2),
            mesh=jaxcore.make_mesh({"data": -1}, num_devices=1),
            steps_per_call=1,  # the same program both times: bitwise-equal weights
            print_summary=False,
        )
        reads = _Reads()
        with pytest.MonkeyPatch.context() as patch:
            if not gather:
                patch.setattr(gathered_reads, "gatherable", lambda loader: False)
            val = DataLoader(TensorDataset(x[:40], y[:40]), batch_size=16)
            trainer = quiet_trainer(max_epochs=2, callbacks=[reads])
            trainer.fit(module, loader, val)
        return jax.device_get(module.state.params), reads.gathered, (loader, val)

    normal, seen_normal, _ = fit(gather=False)
    gathered, seen, loaders = fit(gather=True)
    assert seen and all(seen) and not any(seen_normal)
    jax.tree.map(np.testing.assert_array_equal, gathered, normal)
    assert all("_get_iterator" not in vars(loader) for loader in loaders)
    loader = loaders[0]

    workers = DataLoader(loader.dataset, batch_size=16, num_workers=1)
    assert not gathered_reads.gatherable(workers)


def _as_dict(rows: list[tuple[torch.Tensor, ...]]) -> dict[str, Any]:
    """A team's own collate: named fields, one of them transformed, plus a plain list."""
    x, y, z, flag = (torch.stack(column) for column in zip(*rows, strict=True))
    return {"x": x * 2, "y": y, "z": z, "flag": flag, "ids": [int(r[1]) for r in rows]}


@pytest.mark.parametrize("collate", [_as_dict, lambda rows: rows], ids=["dict", "rows"])
def test_a_loaders_own_collate_gets_the_rows_torch_would_give_it(collate: Any) -> None:
    """A TensorDataset loader with its own collate_fn (the dict-collate form users bring) is
    read by gathers too: the collate receives rows equal to ``dataset[i]``'s (a list of
    tuples: values, dtypes, shapes, strides), in the sampler's order."""
    from torchshell.data._gathered import gatherable, read_by_gathers, read_normally

    plain = list(_shuffled(5, collate_fn=collate))
    loader = _shuffled(5, collate_fn=collate)
    assert gatherable(loader)
    read_by_gathers(loader)
    gathered = list(loader)
    read_normally(loader)
    assert len(gathered) == len(plain) == 7

    def check(a: Any, b: Any) -> None:
        assert type(a) is type(b)
        if isinstance(a, torch.Tensor):
            assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride())
            assert torch.equal(a, b)
        elif isinstance(a, dict):
            assert list(a) == list(b)
            for k in a:
                check(a[k], b[k])
        elif isinstance(a, list | tuple):
            assert len(a) == len(b)
            for u, v in zip(a, b, strict=True):
                check(u, v)
        else:
            assert a == b

    for a, b in zip(plain, gathered, strict=True):
        check(a, b)


def test_a_stateful_loader_is_read_by_gathers_and_resumes_as_its_own() -> None:
    """torchdata's ``StatefulDataLoader`` over a ``TensorDataset`` is read by gathers too:
    the same batches, and a ``state_dict`` taken mid-epoch resumes to the loader's own rest."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from torchshell.data._gathered import gatherable, read_by_gathers, read_normally

    def loader() -> StatefulDataLoader:
        data = _shuffled(0).dataset
        return StatefulDataLoader(
            data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(3)
        )

    def equal(a: list[Any], b: list[Any]) -> None:
        assert len(a) == len(b)
        for u, v in zip(a, b, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(u, v, strict=True))

    plain = iter(loader())
    head = [next(plain) for _ in range(3)]
    tail = list(plain)
    gathered = loader()
    assert gatherable(gathered)
    read_by_gathers(gathered)
    it = iter(gathered)
    equal([next(it) for _ in range(3)], head)
    state = gathered.state_dict()
    equal(list(it), tail)
    resumed = loader()
    read_by_gathers(resumed)
    resumed.load_state_dict(state)
    equal(list(resumed), tail)
    assert type(iter(resumed)._dataset_fetcher).__name__ == "_Gather"
    read_normally(resumed)
    assert "_get_iterator" not in vars(resumed)
