"""The user's path: every peer reads the same ``DataLoader`` object, in a form users bring.

Three forms of one loader over scikit-learn's digits (batch 64, shuffled), each exactly as a
user writes it (no recipe data module, nothing written for coreshell):

- ``"dict collate"``: ``DataLoader(TensorDataset(x, y), collate_fn=...)`` whose collate
  stacks the rows into ``{"x": ..., "y": ...}``;
- ``"TensorDataset tuples"``: ``DataLoader(TensorDataset(x, y))``, batches ``[x, y]``;
- ``"Dataset class"``: the user's own map-style ``Dataset`` whose ``__getitem__`` returns one
  row as a dict (the default collate stacks them);
- ``"torchdata StatefulDataLoader"``: torchdata's ``StatefulDataLoader(TensorDataset(x, y))``,
  the resumable loader, batches ``[x, y]``;
- ``"IterableDataset"``: the user's own ``IterableDataset`` yielding ``(x, y)`` rows in a
  shuffled order of its own, batched by a ``DataLoader``;
- ``"own batch_sampler"``: ``DataLoader(TensorDataset(x, y), batch_sampler=...)`` with the
  user's own ``Sampler`` class yielding shuffled lists of 64 indices.

Every path below iterates the same loader object of a form:

- coreshell at its defaults: ``JaxModule(model, loss, optimizer)`` as the README writes it
  (the headline row), and coreshell tuned (a second row: the settings passed in);
- the pure JAX loop over the same loader (numpy hand-over, one jitted step per batch): the
  ceiling of anything the loader feeds;
- Keras 3 on JAX, ``fit`` on the loader itself;
- the hand-written Lightning + JAX hybrid (manual optimization, numpy hand-over).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
import optax
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, TensorDataset

import jaxcore
from benchmarks._peers import (
    LR,
    LightningClock,
    _LitHybrid,
    handwritten_step,
    init_params,
    trainer,
)
from torchshell import JaxModule

Path = Callable[[int], tuple[float, int]]
BATCH = 64


FORMS = (
    "dict collate",
    "TensorDataset tuples",
    "Dataset class",
    "torchdata StatefulDataLoader",
    "IterableDataset",
    "own batch_sampler",
)


def stack_to_dict(rows: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A user's collate: ``(x, y)`` rows stacked into a dict batch."""
    xs, ys = zip(*rows, strict=True)
    return {"x": torch.stack(xs), "y": torch.stack(ys)}


class DigitsRows(Dataset[dict[str, torch.Tensor]]):
    """A user's own map-style ``Dataset``: one row per ``__getitem__``, as a dict."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class DigitsStream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """A user's own ``IterableDataset``: ``(x, y)`` rows, shuffled anew on every pass.

    It has a ``__len__`` (its rows), as torch's docs allow: Keras' ``fit`` on a loader needs
    the loader's length to count its epochs.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, seed: int = 0) -> None:
        self.x, self.y = x, y
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self.x)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in torch.randperm(len(self.x), generator=self.generator).tolist():
            yield self.x[i], self.y[i]


class ShuffledBatches(Sampler[list[int]]):
    """A user's own batch sampler: shuffled lists of ``batch_size`` indices, the last short."""

    def __init__(self, n: int, batch_size: int, seed: int = 0) -> None:
        self.n, self.batch_size = n, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return math.ceil(self.n / self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(self.n, generator=self.generator).tolist()
        for start in range(0, self.n, self.batch_size):
            yield order[start : start + self.batch_size]


def digits_loader(form: str = "TensorDataset tuples", batch_size: int = BATCH) -> DataLoader[Any]:
    """scikit-learn's digits as a user loads them, in one of :data:`FORMS`, shuffled."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)  # what a user has (int64 labels)
    kwargs: dict[str, Any] = {
        "batch_size": batch_size,
        "shuffle": True,
        "generator": torch.Generator().manual_seed(0),
    }
    if form == "dict collate":
        return DataLoader(TensorDataset(x, y), collate_fn=stack_to_dict, **kwargs)
    if form == "TensorDataset tuples":
        return DataLoader(TensorDataset(x, y), **kwargs)
    if form == "Dataset class":
        return DataLoader(DigitsRows(x, y), **kwargs)
    if form == "torchdata StatefulDataLoader":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(TensorDataset(x, y), **kwargs)  # type: ignore[no-any-return]
    if form == "IterableDataset":
        return DataLoader(DigitsStream(x, y), batch_size=batch_size)
    if form == "own batch_sampler":
        return DataLoader(TensorDataset(x, y), batch_sampler=ShuffledBatches(len(x), batch_size))
    raise ValueError(f"form must be one of {FORMS}, got {form!r}")


def _named(batch: Any) -> dict[str, np.ndarray]:
    """What a team's own step takes: the batch's two fields as numpy arrays."""
    x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
    return {"x": x.numpy(), "y": y.numpy()}


def shell_defaults(model: Any, loader: Any, warmup: int, **kwargs: Any) -> tuple[JaxModule, Path]:
    """coreshell as the README writes it (``kwargs``: the tuned row's settings)."""
    module = JaxModule(
        model,
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer("adam", lr=LR),
        print_summary=False,
        **kwargs,
    )

    def run(steps: int) -> tuple[float, int]:
        clock = LightningClock(warmup, sync=lambda: jax.block_until_ready(module.state))
        trainer(warmup + steps, [clock]).fit(module, loader)
        return clock.result()

    return module, run


def pure_jax_loader(model: Any, loader: Any) -> Path:
    """A plain Python loop: ``for batch in loader: step(params, opt_state, numpy batch)``."""
    tx = optax.adam(LR)
    params = init_params(model, ("x",), _named(next(iter(loader))))
    step = handwritten_step(model, ("x",), tx)
    holder = {"p": params, "o": tx.init(params)}

    def run(steps: int) -> tuple[float, int]:
        p, o = holder["p"], holder["o"]
        done, start, warm = 0, 0.0, 3
        while done < steps + warm:
            for batch in loader:
                if done == warm:
                    jax.block_until_ready(p)
                    start = time.perf_counter()
                p, o, _ = step(p, o, _named(batch))
                done += 1
                if done == steps + warm:
                    break
        jax.block_until_ready(p)
        holder["p"], holder["o"] = p, o
        return time.perf_counter() - start, steps

    return run


class _LoaderHybrid(_LitHybrid):
    """What a team writes: ``(x, y)`` as numpy into the jitted step, manual optimization."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.params, self.opt_state, _ = self.step(self.params, self.opt_state, _named(batch))
        progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()  # so that max_steps and global_step count JAX steps
        progress.increment_completed()


def hybrid_loader(model: Any, loader: Any, warmup: int) -> Path:
    """The hand-written hybrid (Lightning manual optimization + jitted step) on the loader."""
    tx = optax.adam(LR)
    params = init_params(model, ("x",), _named(next(iter(loader))))
    module = _LoaderHybrid(handwritten_step(model, ("x",), tx), params, tx.init(params))

    def run(steps: int) -> tuple[float, int]:
        clock = LightningClock(warmup, sync=lambda: jax.block_until_ready(module.params))
        trainer(warmup + steps, [clock]).fit(module, loader)
        return clock.result()

    return run


def keras_loader(keras_model: Any, loader: Any, warmup: int) -> Path:
    """Keras 3 (JAX backend) ``fit`` on the loader object itself.

    Keras takes ``(x, y)`` batches only: for a loader of dicts it reads a twin loader over
    the same dataset whose collate is the user's followed by ``(b["x"], b["y"])``, what a
    Keras user writes (the same rows, the same collate work, one tuple more).
    """
    from benchmarks._keras_peer import keras_path

    if isinstance(next(iter(loader)), dict):
        user_collate = loader.collate_fn

        def pair(rows: Any) -> tuple[torch.Tensor, torch.Tensor]:
            batch = user_collate(rows)
            return batch["x"], batch["y"]

        loader = DataLoader(
            loader.dataset,
            batch_size=loader.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
            collate_fn=pair,
        )
    return keras_path(keras_model, loader, warmup=warmup)  # type: ignore[no-any-return]


class _Recording:
    """A compiled step that keeps the arguments of its last call (the host-time probe)."""

    def __init__(self, step: Any) -> None:
        self.step, self.args = step, None

    def __call__(self, *args: Any) -> Any:
        self.args = args
        return self.step(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.step, name)


def _staged(call: Callable[[], None], sync: Callable[[], Any], steps: int) -> float:
    """Seconds per call of ``call`` repeated ``steps`` times (best of 3 runs, synced)."""
    call()
    sync()
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            call()
        sync()
        best = min(best, (time.perf_counter() - t0) / steps)
    return best


def shell_staged_seconds(module: JaxModule, run: Path, steps: int = 200) -> float:
    """Seconds per optimizer step of coreshell's own compiled step fed pre-staged batches.

    The step the last fit ran (the K-step window, or the one-step program at K=1) is
    recorded over a short fit of the loader, then called on the device batch it last took,
    the state carried from call to call, with no loader, no Lightning and no hand-over.
    """
    k = module.window_k or 1
    owner, attr = (module.windows, "step") if k > 1 else (module.compiled, "train")
    if getattr(owner, attr) is None:  # (not built yet: a fit shorter than one window)
        run(2 * k)
    recording = _Recording(getattr(owner, attr))
    setattr(owner, attr, recording)
    try:
        run(2 * k)
    finally:
        setattr(owner, attr, recording.step)
    assert recording.args is not None, f"the short fit never called {attr}"
    holder = [module.state, *recording.args[1:]]  # (the recorded state was donated)

    def call() -> None:
        holder[0], _ = recording.step(*holder)

    seconds = _staged(call, lambda: jax.block_until_ready(holder[0]), max(steps // k, 1))
    module.state = holder[0]
    return seconds / k


def hybrid_staged_seconds(model: Any, loader: Any, steps: int = 200) -> float:
    """Seconds per step of the hybrid's jitted step fed one pre-staged device batch."""
    tx = optax.adam(LR)
    batch = jax.device_put(_named(next(iter(loader))))
    params = init_params(model, ("x",), batch)
    step = handwritten_step(model, ("x",), tx)
    holder = [params, tx.init(params)]

    def call() -> None:
        holder[0], holder[1], _ = step(holder[0], holder[1], batch)

    return _staged(call, lambda: jax.block_until_ready(holder[0]), steps)


def loader_seconds(loader: Any, steps: int = 200) -> float:
    """Seconds per batch of iterating the loader alone (best of 3 passes)."""
    best = math.inf
    for _ in range(3):
        done, t0 = 0, time.perf_counter()
        while done < steps:
            for _batch in loader:
                done += 1
                if done == steps:
                    break
        best = min(best, (time.perf_counter() - t0) / steps)
    return best


def epochs_for(loader: Any, steps: int) -> int:
    return math.ceil(steps / len(loader))
