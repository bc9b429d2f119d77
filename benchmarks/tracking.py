"""Step time with MLflow tracking on vs off on the digits recipe, side by side.

Each round trains the digits MLP under the real ``lightning.Trainer`` once per case, in a
rotating order, and takes the mean step time over the steps after a warm-up (compile and
first batches excluded; logging steps included, since that is where tracking costs):

- ``off``: ``logger=False`` (no metrics fetched from the device, nothing logged);
- ``no-op logger``: a Lightning logger that drops everything (the module still fetches the
  metrics on logging steps: the cost of the fetch alone);
- ``async MLflow``: :class:`torchshell.tracking.AsyncMLflowLogger` on SQLite;
- ``Lightning MLFlowLogger``: Lightning's synchronous logger on the same SQLite store.

Prints medians with the min-max spread over the rounds and the ratio to ``off``, plus the
cost of one ``log_metrics`` call on the training thread.

    .venv/bin/python benchmarks/tracking.py --rounds 5 --steps 400 --log-every 10
"""

# ruff: noqa: E402  (imports follow the sys.path fix below)
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run as a script, this folder comes first on sys.path, and benchmarks/bridge.py would
# shadow the bridge package that JaxModule imports.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import lightning as L
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.loggers.logger import Logger

import jaxcore
from jaxcore.models.digits import MLP
from torchshell import JaxModule
from torchshell.data.digits import DigitsDataModule
from torchshell.tracking import AsyncMLflowLogger


class NoOpLogger(Logger):
    """Receives Lightning's metrics and drops them."""

    name, version = "noop", "0"

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


class StepClock(L.Callback):
    """Wall time at the end of every training batch."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())


def train_once(logger: Logger | bool, steps: int, warmup: int, log_every: int) -> float:
    """Mean seconds per step over the steps after ``warmup``."""
    module = JaxModule(
        MLP(features=(256, 256)),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer(lr=1e-3),
    )
    clock = StepClock()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=warmup + steps,
        max_epochs=-1,
        log_every_n_steps=log_every,
        logger=logger,
        callbacks=[clock],
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DigitsDataModule(batch_size=64))
    ends = clock.ends[warmup:]
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def enqueue_cost(uri: str, spill: Path, calls: int = 20_000) -> float:
    """Microseconds per ``log_metrics`` call of four metrics on the training thread."""
    logger = AsyncMLflowLogger("bench-enqueue", tracking_uri=uri, spill_dir=spill)
    metrics = {"train/loss": 0.1, "train/accuracy": 0.9, "train/lr": 1e-3, "epoch": 1.0}
    t0 = time.perf_counter()
    for i in range(calls):
        logger.log_metrics(metrics, step=i)
    per_call = (time.perf_counter() - t0) / calls * 1e6
    report = logger.close()
    if not report.complete:
        raise RuntimeError(str(report))
    return per_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument(
        "--enqueue-calls",
        type=int,
        default=20_000,
        help="log_metrics calls (of 4 metrics) in each of the 3 enqueue-cost runs; a smoke run "
        "needs few (every record is then written to SQLite, which a loaded machine makes slow)",
    )
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-tracking-"))
    uri = f"sqlite:///{tmp}/mlflow.db"
    AsyncMLflowLogger("bench", tracking_uri=uri, spill_dir=tmp / "s").close()  # migrate once
    reports = []

    def async_logger() -> Logger:
        lg = AsyncMLflowLogger("bench", tracking_uri=uri, spill_dir=tmp / "s")
        reports.append(lg)
        return lg

    cases: dict[str, Callable[[], Logger | bool]] = {
        "off": lambda: False,
        "no-op logger": NoOpLogger,
        "async MLflow": async_logger,
        "Lightning MLFlowLogger": lambda: MLFlowLogger("bench-sync", tracking_uri=uri),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(train_once(cases[name](), args.steps, args.warmup, args.log_every))
        for lg in reports:
            report = lg.close()
            if not report.complete:
                raise RuntimeError(f"tracking lost records: {report}")
        reports.clear()

    base = statistics.median(times["off"])
    print(
        f"digits MLP 64-256-256-10, batch 64, {args.steps} steps after {args.warmup} warm-up, "
        f"log_every_n_steps={args.log_every}, {args.rounds} rounds (rotating order)"
    )
    print(f"{'case':<24}{'ms/step median [min-max]':>30}{'ratio to off':>16}")
    for name, samples in times.items():
        med = statistics.median(samples)
        spread = f"{med * 1e3:.3f} [{min(samples) * 1e3:.3f}-{max(samples) * 1e3:.3f}]"
        print(f"{name:<24}{spread:>30}{med / base:>16.3f}")
    costs = [enqueue_cost(uri, tmp / "e", args.enqueue_calls) for _ in range(3)]
    print(
        f"log_metrics (4 metrics) on the training thread: {statistics.median(costs):.2f} us "
        f"[{min(costs):.2f}-{max(costs):.2f}] per call"
    )


if __name__ == "__main__":
    main()
