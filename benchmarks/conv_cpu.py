"""Convolution nets on CPU: torch eager against the jitted traced step, before and after
``torchshell.trace._conv``, side by side.

Each case is one SGD step (forward + backward + update) on the same module and batch:
torch eager on one thread (as the zoo times it, ``benchmarks/zoo.py``), and the jitted
``torch_model_fns`` + ``jaxcore.make_train_step`` step traced twice, once with torchax's
own convolution lowering ("before": ``_conv``'s lowerings left out of the environment) and
once with coreshell's ("after"). The three run in turn within each round; the table gives
the median of the rounds and their spread (min-max), and the load average before and after.

    .venv/bin/python benchmarks/conv_cpu.py --rounds 5
    .venv/bin/python benchmarks/conv_cpu.py --only depthwise --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

B = 2  # the zoo's rows per batch


def _conv_bn(conv: nn.Module, channels: int, dims: int) -> nn.Module:
    bn = nn.BatchNorm1d(channels) if dims == 1 else nn.BatchNorm2d(channels)
    return nn.Sequential(conv, bn, nn.ReLU())


def _cases() -> dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]]:
    """Single convolutions (a module builder and the input shape), with and without a
    BatchNorm in training after them."""
    c = {
        "conv1d k48 s2 16->250 (Wav2Letter first)": (
            lambda: nn.Conv1d(16, 250, 48, stride=2, padding=23),
            (B, 16, 20),
        ),
        "conv1d k32 250->2000 (Wav2Letter)": (
            lambda: nn.Conv1d(250, 2000, 32, padding=16),
            (B, 250, 11),
        ),
        "conv1d k7 250->250": (lambda: nn.Conv1d(250, 250, 7, padding=3), (B, 250, 11)),
        "conv2d 3x3 64->64 32x32": (lambda: nn.Conv2d(64, 64, 3, padding=1), (B, 64, 32, 32)),
        "conv2d 3x3 s2 64->128 32x32": (
            lambda: nn.Conv2d(64, 128, 3, stride=2, padding=1),
            (B, 64, 32, 32),
        ),
        "conv2d 7x7 s2 3->64 64x64 (stem)": (
            lambda: nn.Conv2d(3, 64, 7, stride=2, padding=3),
            (B, 3, 64, 64),
        ),
        "conv2d 1x1 96->576 16x16": (lambda: nn.Conv2d(96, 576, 1), (B, 96, 16, 16)),
        "depthwise 3x3 96 16x16": (
            lambda: nn.Conv2d(96, 96, 3, padding=1, groups=96),
            (B, 96, 16, 16),
        ),
        "depthwise 5x5 s2 96 32x32": (
            lambda: nn.Conv2d(96, 96, 5, stride=2, padding=2, groups=96),
            (B, 96, 32, 32),
        ),
        "grouped 3x3 128 g32 16x16": (
            lambda: nn.Conv2d(128, 128, 3, padding=1, groups=32),
            (B, 128, 16, 16),
        ),
    }
    out = {}
    for name, (build, shape) in c.items():
        out[name] = (build, shape)
        if "k32" in name or "1x1" in name or "k7" in name:
            continue

        def with_bn(build: Callable[[], nn.Module] = build, shape: tuple = shape) -> nn.Module:
            conv = build()
            return _conv_bn(conv, conv.out_channels, len(shape) - 2)

        out[f"{name} + BN"] = (with_bn, shape)
    return out


ZOO = (
    "resnet",
    "mobilenet_v3_small",
    "mobilenet_v2",
    "efficientnet_b0",
    "convnext",
    "regnet",
    "squeezenet",
    "densenet",
    "Wav2Letter",
    "ConvTasNet",
    "ConvNextForImageClassification",
    "ResNetForImageClassification",
)


def _baseline(rev: str) -> Callable[[], dict]:
    """``conv_lowerings`` of ``torchshell/trace/_conv.py`` as it was at git revision ``rev``."""
    import subprocess
    import types

    src = subprocess.run(
        ["git", "show", f"{rev}:torchshell/trace/_conv.py"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    mod = types.ModuleType(f"_conv_at_{rev}")
    exec(compile(src, f"{rev}:_conv.py", "exec"), mod.__dict__)
    return mod.conv_lowerings


def _steps(
    net: nn.Module,
    batch: dict[str, torch.Tensor],
    inputs: tuple[str, ...],
    kind: str,
    pick: Callable,
    lr: float,
    lowerings: Callable[[], dict] | None,
) -> Callable[[], None]:
    """The jitted step on ``batch`` (compiled here), traced with ``lowerings`` in place of
    ``_conv``'s (``dict``: torchax's own; ``None``: the working tree's)."""
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    import jaxcore
    from tests.zoo.harness import _host, jax_loss
    from torchshell.torch_model import specialise_batch, torch_model_fns
    from torchshell.trace import _env

    swap = mock.patch.object(_env, "conv_lowerings", lowerings)
    with nullcontext() if lowerings is None else swap:
        fns = torch_model_fns(net, inputs)
        mesh = jaxcore.make_mesh({"data": 1}, num_devices=1)
        put = jax.device_put(_host(batch), NamedSharding(mesh, PartitionSpec("data")))
        b = specialise_batch(fns, put)
        tx = optax.sgd(lr)
        state = jaxcore.init_train_state(fns, tx, b, seed=0, mesh=mesh)
        step = jaxcore.make_train_step(
            fns, jax_loss(kind, pick), tx, state_sharding=jaxcore.state_shardings(state)
        )
        box = [step(state, b)[0]]  # compiles (and traces) here
    jax.block_until_ready(box[0])

    def run() -> None:
        box[0], metrics = step(box[0], b)
        jax.block_until_ready(metrics["loss"])

    return run


def _torch_step(
    net: nn.Module, batch: dict, inputs: tuple, kind: str, pick: Callable, lr: float
) -> Callable[[], None]:
    from tests.zoo.harness import torch_loss

    opt = torch.optim.SGD(net.parameters(), lr=lr)
    net.train()

    def run() -> None:
        opt.zero_grad()
        torch_loss(kind, pick(net(*[batch[k] for k in inputs])), batch["y"]).backward()
        opt.step()

    run()
    return run


def _problems(nets: list[str] | None) -> list[tuple[str, Callable[[], tuple]]]:
    """(name, builder of (module, batch, inputs, kind, pick, lr)) for every case (``nets``:
    only those zoo nets, no single layers)."""
    out = []
    for name, (build, shape) in _cases().items() if nets is None else ():

        def make(build: Callable = build, shape: tuple = shape) -> tuple:
            torch.manual_seed(0)
            g = torch.Generator().manual_seed(1)
            batch = {"x": torch.randn(*shape, generator=g), "y": torch.zeros(B, dtype=torch.long)}
            return build(), batch, ("x",), "l2", (lambda o: o), 0.01

        out.append((name, make))
    from tests.zoo.models import build as zoo_build
    from tests.zoo.models import zoo

    for entry in zoo():
        if not any(entry.name.startswith(z) for z in ZOO):
            continue
        if nets and not any(n in entry.name for n in nets):
            continue

        def make_zoo(entry: object = entry) -> tuple:
            net, batches = zoo_build(entry, steps=1)
            return net, batches[0], entry.inputs, entry.kind, entry.pick, entry.lr

        out.append((f"zoo: {entry.name}", make_zoo))
    return out


def _fmt(ts: list[float]) -> str:
    ms = [1e3 * t for t in ts]
    return f"{statistics.median(ms):,.2f} ({min(ms):,.2f}-{max(ms):,.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="timed steps of each (median)")
    ap.add_argument("--only", default="", help="substring of the case names to run")
    ap.add_argument("--skip", default="", help="substring of the case names not to run")
    ap.add_argument(
        "--nets",
        nargs="*",
        help="zoo conv nets only (substrings of their names; none given: all of ZOO)",
    )
    ap.add_argument(
        "--baseline",
        default="torchax",
        help="'before' is torchax's own convolution (default) or _conv.py at this git rev",
    )
    args = ap.parse_args()
    import copy

    import jax

    torch.set_num_threads(1)
    base = dict if args.baseline == "torchax" else _baseline(args.baseline)
    print(
        f"load average before: {os.getloadavg()}; jax {jax.__version__}, torch "
        f"{torch.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, "
        f"before = {args.baseline}, after = the working tree",
        flush=True,
    )
    print(
        "| case | torch eager ms | jitted before ms | jitted after ms | "
        "torch / before | torch / after | load |\n|---|---|---|---|---|---|---|",
        flush=True,
    )
    nets = None if args.nets is None else (args.nets or list(ZOO))
    for name, make in _problems(nets):
        if (args.only and args.only not in name) or (args.skip and args.skip in name):
            continue
        net, batch, inputs, kind, pick, lr = make()
        runs = {
            "torch": _torch_step(copy.deepcopy(net), batch, inputs, kind, pick, lr),
            "before": _steps(copy.deepcopy(net), batch, inputs, kind, pick, lr, base),
            "after": _steps(copy.deepcopy(net), batch, inputs, kind, pick, lr, None),
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.rounds):
            for k, run in runs.items():
                t0 = time.perf_counter()
                run()
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"| {name} | {_fmt(times['torch'])} | {_fmt(times['before'])} | "
            f"{_fmt(times['after'])} | {med['torch'] / med['before']:.2f} | "
            f"{med['torch'] / med['after']:.2f} | {os.getloadavg()[0]:.2f} |",
            flush=True,
        )
    print(f"load average after: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
