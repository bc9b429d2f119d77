"""The same MLP three ways: a torch nn.Module through torchax, Flax, and PyTorch Lightning.

The digits MLP (64-256-256-10, batch 64, adam 1e-3) is trained

- as the torch module ``torchshell.twins.digits.MLP`` extracted by
  :func:`torchshell.torch_model_fns` into the jitted ``jaxcore.make_train_step``;
- as the Flax module ``jaxcore.models.digits.MLP`` in the same jitted step;
- as the same torch module in a ``LightningModule`` with ``torch.optim.Adam`` under the real
  ``lightning.Trainer`` (lean: no logger, checkpoint, progress bar or summary);
- as the same torch module in a plain PyTorch loop (for reference).

The JAX paths step on batches already on the device (the step's own speed); Lightning reads
the same batches from a ``DataLoader`` over in-memory tensors. Rounds alternate between the
paths so that they share the machine's load (many short rounds: on a shared machine, load
bursts then hit every path alike); the table gives steps/s per round as the median
and the min-max spread, and each path's ratio to Flax's median.

Run: ``.venv/bin/python benchmarks/torch_model.py`` (``--quick`` for fewer, shorter rounds).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

# Scripts here are named like the packages they measure (benchmarks/bridge.py): drop this
# folder from the import path so that `import bridge` (through torchshell) finds the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import lightning as L  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import jaxcore  # noqa: E402
from jaxcore.models.digits import MLP as FlaxMLP  # noqa: E402
from torchshell import torch_model_fns  # noqa: E402
from torchshell.twins.digits import MLP as TorchMLP  # noqa: E402

BATCH, FEATURES, CLASSES, LR = 64, (256, 256), 10, 1e-3


def _data(n_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_batches * BATCH, 64, generator=g)
    y = torch.randint(0, CLASSES, (n_batches * BATCH,), generator=g)
    return x, y


def _jax_round(model: jaxcore.ModelFns, x: torch.Tensor, y: torch.Tensor) -> Callable[[int], float]:
    """A callable ``steps -> seconds`` running the jitted jaxcore step on device batches."""
    tx = optax.adam(LR)
    mesh = jaxcore.make_mesh({"data": 1})
    batches = [
        {"x": jnp.asarray(xb.numpy()), "y": jnp.asarray(yb.numpy().astype(np.int32))}
        for xb, yb in zip(x.split(BATCH), y.split(BATCH), strict=True)
    ]
    batches = jax.device_put(batches, jax.devices()[0])
    state = jaxcore.init_train_state(model, tx, batches[0], seed=0, mesh=mesh)
    step = jaxcore.make_train_step(
        model, jaxcore.softmax_cross_entropy, tx, state_sharding=jaxcore.state_shardings(state)
    )
    holder = {"state": state}
    state, _ = step(state, batches[0])  # compile
    holder["state"] = jax.block_until_ready(state)

    def run(steps: int) -> float:
        st = holder["state"]
        for i in range(10):  # untimed: wake the runtime's threads after the torch rounds
            st, _ = step(st, batches[i % len(batches)])
        jax.block_until_ready(st)
        start = time.perf_counter()
        for i in range(steps):
            st, _ = step(st, batches[i % len(batches)])
        jax.block_until_ready(st)
        holder["state"] = st
        return time.perf_counter() - start

    return run


class _LitMLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = TorchMLP(64, FEATURES, CLASSES)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=LR)


class _Clock(L.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.end = warmup, 0.0, 0.0

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()
        self.end = time.perf_counter()


def _lightning_round(x: torch.Tensor, y: torch.Tensor) -> Callable[[int], float]:
    module = _LitMLP()

    def run(steps: int) -> float:
        clock = _Clock(warmup=5)
        trainer = L.Trainer(
            max_steps=steps + 5,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
            devices=1,
            callbacks=[clock],
        )
        loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
        trainer.fit(module, loader)
        return clock.end - clock.start

    return run


def _torch_round(x: torch.Tensor, y: torch.Tensor) -> Callable[[int], float]:
    net = TorchMLP(64, FEATURES, CLASSES)
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    batches = list(zip(x.split(BATCH), y.split(BATCH), strict=True))

    def run(steps: int) -> float:
        for xb, yb in batches[:5]:  # untimed warm-up, as for the other paths
            opt.zero_grad()
            nn.functional.cross_entropy(net(xb), yb).backward()
            opt.step()
        start = time.perf_counter()
        for i in range(steps):
            xb, yb = batches[i % len(batches)]
            opt.zero_grad()
            nn.functional.cross_entropy(net(xb), yb).backward()
            opt.step()
        return time.perf_counter() - start

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds of 50 steps")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: on a shared 2-core machine torch's OpenMP pool "
        "collapses to a few steps/s under load)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    rounds, steps = (5, 50) if args.quick else (args.rounds, args.steps)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*Checkpoint directory.*")

    x, y = _data(16)
    torch.manual_seed(0)
    paths: dict[str, Callable[[int], float]] = {
        "torch nn.Module via torchax, jaxcore step": _jax_round(
            torch_model_fns(TorchMLP(64, FEATURES, CLASSES)), x, y
        ),
        "Flax, jaxcore step": _jax_round(
            jaxcore.linen_model(FlaxMLP(features=FEATURES, num_classes=CLASSES)), x, y
        ),
        "PyTorch Lightning (torch Adam)": _lightning_round(x, y),
        "plain PyTorch loop": _torch_round(x, y),
    }
    rates: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for r in range(rounds):
        # alternate, in a rotating order: every path sees the same load and goes first as often
        for name in names[r % len(names) :] + names[: r % len(names)]:
            rates[name].append(steps / paths[name](steps))

    flax = statistics.median(rates["Flax, jaxcore step"])
    print(
        f"jax {jax.__version__}, torch {torch.__version__}, {jax.devices()[0].platform}; "
        f"MLP 64-{'-'.join(map(str, FEATURES))}-{CLASSES}, batch {BATCH}, adam; "
        f"{rounds} rounds x {steps} steps, alternating; torch threads {args.torch_threads}\n"
    )
    print("| path | steps/s median [min-max] | / Flax |")
    print("|---|---|---|")
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"| {name} | {med:,.0f} [{min(r):,.0f}-{max(r):,.0f}] | {med / flax:.2f} |")


if __name__ == "__main__":
    main()
