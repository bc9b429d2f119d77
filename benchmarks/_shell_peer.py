"""Peer (a): coreshell end to end, and where its time goes.

torch DataLoader -> ``lightning.Trainer`` -> ``JaxModule`` -> ``bridge.to_jax`` -> the jitted
jaxcore step, with ``steps_per_call=K`` (the DataLoader batch carries K*B rows, viewed as
``[K, B, ...]`` without a copy) where the installed ``JaxModule`` has it.

The time split comes from separate, instrumented rounds (not the throughput rounds): the
loader's ``next()`` (data wait), ``JaxModule``'s hand-over methods (bridge) and the train
step, blocked until its result is ready (compute); loop overhead is the rest of the wall time
(Lightning's loop, hooks, Python glue). Blocking removes the overlap of compute with the next
batch's host work, so an instrumented round is a little slower than a plain one.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

import jaxcore
from benchmarks._peers import LR, LightningClock, trainer
from torchshell import JaxModule


def supports_steps_per_call() -> bool:
    """Whether the installed ``JaxModule`` takes ``steps_per_call``."""
    return "steps_per_call" in inspect.signature(JaxModule.__init__).parameters


def make_module(model: Any, inputs: tuple[str, ...], k: int, mesh: Any = None) -> JaxModule:
    kwargs: dict[str, Any] = {"steps_per_call": k} if k > 1 else {}
    if mesh is not None:
        kwargs["mesh"] = mesh
    return JaxModule(
        model,
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer("adam", lr=LR),
        inputs=inputs,
        print_summary=False,
        **kwargs,
    )


def shell_path(module: JaxModule, dm: Any, warmup: int) -> Callable[[int], tuple[float, int]]:
    """``steps -> (seconds, optimizer steps timed)`` for ``trainer.fit(module, dm)``."""

    def run(steps: int) -> tuple[float, int]:
        clock = LightningClock(warmup, sync=lambda: jax.block_until_ready(module.state))
        trainer(warmup + steps, [clock]).fit(module, datamodule=dm)
        return clock.result()

    return run


class _Timers:
    def __init__(self) -> None:
        self.on = False
        self.seconds = {"data wait": 0.0, "bridge": 0.0, "compute": 0.0}

    def start(self) -> None:
        self.on = True
        self.seconds = dict.fromkeys(self.seconds, 0.0)

    def timed(self, name: str, fn: Callable[..., Any], block: bool = False) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if block:
                jax.block_until_ready(out)
            if self.on:
                self.seconds[name] += time.perf_counter() - t0
            return out

        return wrapper


class _TimedLoader:
    """Iterates ``loader``, timing each ``next()``."""

    def __init__(self, loader: Any, timers: _Timers) -> None:
        self.loader, self.timers = loader, timers

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        nxt = self.timers.timed("data wait", lambda: next(it))
        while True:
            try:
                yield nxt()
            except StopIteration:
                return


class _BlockingStep:
    """The module's train step, blocked until ready (attributes pass through)."""

    def __init__(self, step: Any, timers: _Timers) -> None:
        self._step, self._call = step, timers.timed("compute", step, block=True)

    def __call__(self, *args: Any) -> Any:
        return self._call(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._step, name)


def split_round(module: JaxModule, dm: Any, warmup: int, steps: int) -> dict[str, float]:
    """One instrumented round: microseconds per optimizer step in each part of the loop."""
    if module.compiled.train is None:
        raise RuntimeError("run a plain round first (the step is compiled there)")
    timers = _Timers()
    adapter = module.adapter  # (its hand-over methods, timed on the instance)
    hand_over = ["to_jax", "stack"]
    for name in hand_over:
        setattr(adapter, name, timers.timed("bridge", getattr(adapter, name)))
    original = module.compiled.train
    module.compiled.train = _BlockingStep(original, timers)  # type: ignore[assignment]
    dm.setup("fit")
    clock = LightningClock(warmup, sync=lambda: jax.block_until_ready(module.state))
    clock.on_start = timers.start
    try:
        trainer(warmup + steps, [clock]).fit(
            module, train_dataloaders=_TimedLoader(dm.train_dataloader(), timers)
        )
    finally:
        module.compiled.train = original
        for name in hand_over:
            delattr(adapter, name)
    seconds, done = clock.result()
    per = {name: s / done * 1e6 for name, s in timers.seconds.items()}
    per["loop overhead"] = seconds / done * 1e6 - sum(per.values())
    per["total"] = seconds / done * 1e6
    return per
