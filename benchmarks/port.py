"""The one-line port against ``from_torch``: the same torch MLP, the same plain DataLoader.

The digits-sized MLP (64-256-256-10, batch 64, adam 1e-3) trains under the real
``lightning.Trainer`` (lean: no logger, checkpoint, progress bar or summary), fed by one
``DataLoader(TensorDataset(x, y))`` of tuples:

- ``from_torch``: ``JaxModule.from_torch(net, jaxcore.softmax_cross_entropy, optax.adam)``,
  the loss written in JAX;
- ``from_lightning``: ``JaxModule.from_lightning(LitMLP(net))``, the team's own
  ``training_step`` with ``F.cross_entropy``, ``self.log`` and ``torch.optim.Adam``, traced.

Both run at their defaults on one JAX device. Rounds rotate between the two (each round a
new ``fit`` on the same module: compiled once, warm after the first round); the table gives
steps/s per round (median [min-max]) and from_lightning's step time over from_torch's.
Goal: <= 1.05.

Run: ``.venv/bin/python benchmarks/port.py [--rounds 7 --steps 300]``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))  # the repository: `benchmarks._x` helpers

import lightning as L  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import jaxcore  # noqa: E402
from benchmarks import _stats  # noqa: E402
from torchshell import JaxModule  # noqa: E402
from torchshell.twins.digits import MLP  # noqa: E402

BATCH, LR = 64, 1e-3


class LitMLP(L.LightningModule):
    """The same MLP as a team's LightningModule."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=LR)


class Clock(L.Callback):
    """Times the training batches after the first ``skip`` of a fit."""

    def __init__(self, skip: int) -> None:
        self.skip, self.count, self.start, self.end = skip, 0, 0.0, 0.0

    def on_train_batch_end(self, *args: Any) -> None:
        self.count += 1
        if self.count == self.skip:
            self.start = time.perf_counter()
        self.end = time.perf_counter()


def _path(module: JaxModule, loader: DataLoader, skip: int) -> Any:
    def run(steps: int) -> tuple[float, int]:
        clock = Clock(skip)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps + skip,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[clock],
        )
        trainer.fit(module, loader)
        return clock.end - clock.start, clock.count - clock.skip

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # per-fit banners
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    g = torch.Generator().manual_seed(0)
    n = BATCH * (args.steps + 20)
    x, y = torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, drop_last=True)
    torch.manual_seed(0)
    paths = {
        "from_torch (JAX loss)": _path(
            JaxModule.from_torch(
                MLP(64), jaxcore.softmax_cross_entropy, optax.adam(LR), print_summary=False
            ),
            loader,
            skip=10,
        ),
        "from_lightning (torch loss)": _path(
            JaxModule.from_lightning(LitMLP(MLP(64)), print_summary=False), loader, skip=10
        ),
    }
    for run in paths.values():
        run(5)  # compile, outside the rounds
    rates = _stats.rotate(paths, args.rounds, args.steps)
    base = statistics.median(rates["from_torch (JAX loss)"])
    rows = [
        _stats.row(
            "port/digits MLP",
            name,
            "steps/s",
            values,
            ratio=base / statistics.median(values),
            ratio_to="step time / from_torch",
        )
        for name, values in rates.items()
    ]
    print(
        f"from_lightning vs from_torch, batch {BATCH}, {args.steps} steps x {args.rounds} "
        f"rounds, load average {_stats.load_average()[0]:.1f}\n"
    )
    print(_stats.markdown(rows))
    if args.json:
        _stats.write_rows(args.json, rows)


if __name__ == "__main__":
    main()
