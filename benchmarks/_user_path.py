"""The user's path: every peer reads the same plain ``DataLoader`` over one ``TensorDataset``.

``DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)``, exactly as a user writes it,
is the one loader object every path below iterates (no recipe data module, no gathered
batches, no collate written for coreshell):

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
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
import torch
from torch.utils.data import DataLoader, TensorDataset

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


def digits_loader(batch_size: int = BATCH) -> DataLoader[Any]:
    """scikit-learn's digits as a user loads them: ``TensorDataset(x, y)``, shuffled."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)  # what a user has (int64 labels)
    return DataLoader(
        TensorDataset(x, y),
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )


def _named(batch: Sequence[torch.Tensor]) -> dict[str, np.ndarray]:
    x, y = batch
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
    """Keras 3 (JAX backend) ``fit`` on the loader object itself."""
    from benchmarks._keras_peer import keras_path

    return keras_path(keras_model, loader, warmup=warmup)  # type: ignore[no-any-return]


def epochs_for(loader: Any, steps: int) -> int:
    return math.ceil(steps / len(loader))
