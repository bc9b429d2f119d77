"""Peers (b), (d) and (e) of the training comparison, and the clock they share with (a).

- (b) a pure JAX/optax loop, one jitted step per batch, over batches already on the device;
  (b, K) the same step ``lax.scan``-ned over K stacked batches per call (the true ceiling);
- (d) PyTorch Lightning training the torch twin with ``torch.optim.Adam``;
- (e) the hybrid a team writes today: Lightning manual optimization around the same jitted
  JAX step as (b), the batch handed over as numpy arrays.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import lightning as L
import numpy as np
import optax
import torch
from flax import linen as fnn
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

LR = 1e-3
Path = Callable[[int], tuple[float, int]]


def trainer(max_steps: int, callbacks: list[L.Callback]) -> L.Trainer:
    """The lean Trainer every Lightning path runs under."""
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*configure_optimizers.*returned.*None.*")
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,  # training throughput: (d) and (e) have no validation_step
        max_steps=max_steps,
        callbacks=callbacks,
    )


class LightningClock(L.Callback):
    """Times the optimizer steps after ``warmup`` up to ``max_steps``, synced by ``sync``.

    It marks at a batch's start and at the epoch's end, never in ``on_train_batch_end``: a
    callback that overrides that hook may read the step's ``outputs``, and coreshell then
    waits for every step's loss (as plain Lightning hands it over), which is not the loop
    the benchmark times.
    """

    def __init__(self, warmup: int, sync: Callable[[], Any] = lambda: None) -> None:
        self.warmup, self.sync = warmup, sync
        self.start: tuple[float, int] | None = None
        self.end: tuple[float, int] | None = None
        self.on_start: Callable[[], None] = lambda: None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if self.start is None and step >= self.warmup:
            self.sync()
            self.on_start()
            self.start = (time.perf_counter(), step)

    def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._stop(trainer)

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._stop(trainer)

    def _stop(self, trainer: L.Trainer) -> None:
        step = trainer.global_step
        if self.start is not None and self.end is None and step >= trainer.max_steps:
            self.sync()
            self.end = (time.perf_counter(), step)

    def result(self) -> tuple[float, int]:
        if self.start is None or self.end is None:
            raise RuntimeError("the run ended before the timed window: raise max_steps")
        return self.end[0] - self.start[0], self.end[1] - self.start[1]


def handwritten_step(model: fnn.Module, inputs: Sequence[str], tx: Any, k: int = 1) -> Any:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``, jitted and donated;
    with ``k > 1`` a ``lax.scan`` over ``[k, B, ...]`` batches."""

    def loss_fn(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        logits = model.apply({"params": params}, *[batch[n] for n in inputs], train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def one(carry: Any, batch: dict[str, jax.Array]) -> tuple[Any, jax.Array]:
        params, opt_state = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(params: Any, opt_state: Any, batch: dict[str, jax.Array]) -> Any:
        if k == 1:
            (params, opt_state), loss = one((params, opt_state), batch)
        else:
            (params, opt_state), loss = jax.lax.scan(one, (params, opt_state), batch)
        return params, opt_state, loss

    return step


def init_params(model: fnn.Module, inputs: Sequence[str], batch: dict[str, Any]) -> Any:
    return model.init(jax.random.key(0), *[jnp.asarray(batch[n]) for n in inputs])["params"]


def pure_jax_path(
    model: fnn.Module,
    inputs: Sequence[str],
    batches: list[dict[str, np.ndarray]],
    k: int = 1,
    mesh: Mesh | None = None,
) -> Path:
    """(b): the jitted step over the materialized batches, put on the device once; with a
    ``mesh``, params replicated and batch rows sharded over its ``data`` axis."""
    tx = optax.adam(LR)
    params = init_params(model, inputs, batches[0])
    opt_state = tx.init(params)
    if k > 1:
        n = len(batches) // k
        batches = [
            {name: np.stack([b[name] for b in batches[i * k : (i + 1) * k]]) for name in batches[0]}
            for i in range(n)
        ]
    if mesh is None:
        on_device = jax.device_put(batches)
    else:
        rows = NamedSharding(mesh, P("data") if k == 1 else P(None, "data"))
        on_device = jax.device_put(batches, rows)
        params, opt_state = jax.device_put((params, opt_state), NamedSharding(mesh, P()))
    step = handwritten_step(model, inputs, tx, k)
    holder = {"p": params, "o": opt_state}

    def run(steps: int) -> tuple[float, int]:
        p, o = holder["p"], holder["o"]
        for i in range(3):  # warm-up (the first call compiles)
            p, o, _ = step(p, o, on_device[i % len(on_device)])
        jax.block_until_ready(p)
        calls = max(steps // k, 1)
        start = time.perf_counter()
        for i in range(calls):
            p, o, _ = step(p, o, on_device[i % len(on_device)])
        jax.block_until_ready(p)
        seconds = time.perf_counter() - start
        holder["p"], holder["o"] = p, o
        return seconds, calls * k

    return run


class _LitTwin(L.LightningModule):
    def __init__(self, net: torch.nn.Module, inputs: Sequence[str]) -> None:
        super().__init__()
        self.net, self.inputs = net, tuple(inputs)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.net(*[batch[n] for n in self.inputs])
        return torch.nn.functional.cross_entropy(logits, batch["y"].long())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=LR)


def lightning_twin_path(net: torch.nn.Module, inputs: Sequence[str], dm: Any, warmup: int) -> Path:
    """(d): the torch twin under Lightning with torch Adam (automatic optimization)."""
    module = _LitTwin(net, inputs)

    def run(steps: int) -> tuple[float, int]:
        clock = LightningClock(warmup)
        trainer(warmup + steps, [clock]).fit(module, datamodule=dm)
        return clock.result()

    return run


class _LitHybrid(L.LightningModule):
    """Manual optimization around a jitted JAX step; numpy hand-over (what teams write)."""

    def __init__(self, step: Any, params: Any, opt_state: Any) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.step, self.params, self.opt_state = step, params, opt_state

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        host = {k: v.numpy() for k, v in batch.items()}
        self.params, self.opt_state, _ = self.step(self.params, self.opt_state, host)
        progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()  # so that max_steps and global_step count JAX steps
        progress.increment_completed()

    def configure_optimizers(self) -> None:
        return None


def hybrid_path(model: fnn.Module, inputs: Sequence[str], dm: Any, warmup: int) -> Path:
    """(e): Lightning manual optimization + jitted JAX step, numpy hand-over."""
    tx = optax.adam(LR)
    dm.setup("fit")
    first = {k: v.numpy() for k, v in next(iter(dm.train_dataloader())).items()}
    params = init_params(model, inputs, first)
    module = _LitHybrid(handwritten_step(model, inputs, tx), params, tx.init(params))

    def run(steps: int) -> tuple[float, int]:
        clock = LightningClock(warmup, sync=lambda: jax.block_until_ready(module.params))
        trainer(warmup + steps, [clock]).fit(module, datamodule=dm)
        return clock.result()

    return run
