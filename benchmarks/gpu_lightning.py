"""A team's LightningModule on one device: plain Lightning, torch.compile, from_lightning.

The three modules of :mod:`benchmarks._gpu_modules` (plain torch: a Whisper-base-sized encoder
classifier, a ViT-B/16 classifier at 224 px, a GPT-2-small decoder at 1,024 tokens), each
trained three ways on the same device from the same synthetic ``DataLoader`` (same batches,
same order, same initial weights), all under ``Trainer(precision="bf16-mixed")``:

- (l) plain Lightning, eager (``accelerator="gpu"`` on a GPU);
- (c) plain Lightning on ``torch.compile(module)`` (Lightning compiles the module's forward;
  inductor, default mode);
- (j) ``JaxModule.from_lightning(module)`` under ``Trainer(accelerator="cpu", devices=1)``
  (devices belong to JAX: the step runs on the JAX device, a GPU there).

Each way is timed by :class:`WindowClock`, a Lightning callback: after ``--warmup`` steps,
``--windows`` windows of ``--steps`` steps each, the device synced at each window's edge
(``torch.cuda.synchronize()``; ``jax.block_until_ready`` on the module's state), so the host
and the device overlap inside a window as in a real run; steps/s is the median over the
windows. Also: MFU = the analytic model FLOPs (``_gpu_modules.model_flops``: 6 x matmul
params x tokens + attention) x steps/s / the chip's dense bf16 peak (H100/H200 989 TFLOP/s;
n/a elsewhere); peak device memory (``torch.cuda.max_memory_allocated`` for (l) and (c),
JAX's ``peak_bytes_in_use`` for (j): one model per process on a GPU, so it is that model's;
n/a on CPU); time to the first step (``fit`` called to the first step's result on the
device: tracing and compiling included). Then from_lightning/eager (target >= 1.3) and
from_lightning/compile (target >= 1.1) per model: the issue's goal is both on two of three.

A way that fails is a FAILED row naming the error; rows are written to ``--json`` after each
way, so a run cut short by its time limit keeps the rows it finished. ``--dry-run`` runs every
row on CPU at tiny sizes (``gpu.sh --dry-run``, in the suite).

Run: ``.venv/bin/python benchmarks/gpu_lightning.py [--dry-run] [--models whisper,vit,gpt]``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))  # the repository: `benchmarks._x` helpers

import jax  # noqa: E402
import lightning as L  # noqa: E402
import torch  # noqa: E402

from benchmarks import _gpu_modules as gm  # noqa: E402
from benchmarks import _stats  # noqa: E402

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "TPU v5 lite": 197e12}
WAYS = {
    "eager": "(l) plain Lightning, eager",
    "compile": "(c) plain Lightning, torch.compile(module)",
    "jax": "(j) JaxModule.from_lightning(module)",
}
TARGETS = {"eager": 1.3, "compile": 1.1}
NAMES = {"whisper": "Whisper-base encoder", "vit": "ViT-B/16", "gpt": "GPT-2 small"}


class WindowClock(L.Callback):
    """Marks the end of the first step and the edges of the timed windows, device synced."""

    def __init__(self, warmup: int, window: int, sync: Callable[[], Any]) -> None:
        self.warmup, self.window, self.sync = warmup, window, sync
        self.first: float | None = None
        self.marks: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, idx: int) -> None:
        if idx == 1:
            self.sync()
            self.first = time.perf_counter()
        if idx >= self.warmup and (idx - self.warmup) % self.window == 0:
            self.sync()
            self.marks.append(time.perf_counter())

    def on_train_end(self, trainer: L.Trainer, module: Any) -> None:
        self.sync()
        self.marks.append(time.perf_counter())

    def rates(self) -> list[float]:
        """Steps/s of each window."""
        return [self.window / (b - a) for a, b in zip(self.marks, self.marks[1:], strict=False)]


def _trainer(accelerator: str, max_steps: int, clock: WindowClock) -> L.Trainer:
    return L.Trainer(
        accelerator=accelerator,
        devices=1,
        precision="bf16-mixed",
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[clock],
    )


def run_way(
    way: str,
    name: str,
    size: dict[str, int],
    batch: int,
    timing: tuple[int, int, int],
    backend: str = "inductor",
) -> dict[str, Any]:
    """Trains model ``name`` one ``way``; returns its window rates, first step and peak memory."""
    warmup, window, windows = timing
    cuda = torch.cuda.is_available()
    module = gm.make_module(name, size)
    steps = warmup + window * windows
    loader = gm.make_loader(name, size, batch, steps)
    sync: Callable[[], Any]
    if way == "jax":
        from torchshell import JaxModule

        jax_module = JaxModule.from_lightning(module, print_summary=False)
        fit_module: Any = jax_module
        accelerator = "cpu"  # Lightning stays on the host; the step runs on the JAX device
        sync = lambda: jax.block_until_ready(jax_module.state)  # noqa: E731
    else:
        fit_module = torch.compile(module, backend=backend) if way == "compile" else module
        accelerator = "gpu" if cuda else "cpu"
        sync = torch.cuda.synchronize if cuda else lambda: None
    gc.collect()  # the previous way's tensors
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    clock = WindowClock(warmup, window, sync)
    trainer = _trainer(accelerator, steps, clock)
    start = time.perf_counter()
    trainer.fit(fit_module, loader)
    if clock.first is None or len(clock.marks) != windows + 1:
        raise RuntimeError(f"{trainer.global_step} steps ran, {steps} expected")
    peak: float | None = None
    if way == "jax":
        stats = jax.devices()[0].memory_stats() or {}
        peak = stats.get("peak_bytes_in_use")
    elif cuda:
        peak = torch.cuda.max_memory_allocated()
    del fit_module, module, trainer
    return {"rates": clock.rates(), "first": clock.first - start, "peak": peak}


def _failure(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def _device() -> tuple[str, float | None]:
    kind = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    jax_kind = jax.devices()[0].device_kind
    peak = next((v for k, v in PEAK_BF16.items() if k in kind or k in jax_kind), None)
    return f"torch: {kind}, JAX: {jax_kind}", peak


def model_rows(name: str, args: argparse.Namespace, sink: Callable[[dict[str, Any]], None]) -> None:
    """Runs the three ways of one model, handing each row to ``sink`` as it is made."""
    size = gm.SIZES[name]["tiny" if args.dry_run else "full"]
    batch = 2 if args.dry_run else gm.BATCH[name]
    flops = gm.model_flops(name, size, batch)
    device, peak_flops = _device()
    t = gm.tokens_per_sample(name, size)
    bench = f"gpu lightning {NAMES[name]} d={size['d']} x{size['layers']}, T={t}, B={batch}"
    params = gm.param_count(gm.make_module(name, size))
    medians: dict[str, float] = {}
    done: set[str] = set()
    for way in args.ways.split(","):
        case = f"{WAYS[way]}, bf16-mixed"
        if way == "compile" and args.compile_backend != "inductor":
            case = case.replace("(module)", f"(module, backend={args.compile_backend!r})")
        try:
            timing = (args.warmup, args.steps, args.windows)
            got = run_way(way, name, size, batch, timing, args.compile_backend)
        except Exception as exc:  # a FAILED row: the other ways still run
            traceback.print_exc()
            sink(_stats.row(bench, case, "steps/s", [], note=f"FAILED: {_failure(exc)}"))
            continue
        med = medians[way] = statistics.median(got["rates"])
        mfu = f"MFU {flops * med / peak_flops:.1%}" if peak_flops else "MFU n/a"
        mem = "peak mem n/a" if got["peak"] is None else f"peak mem {got['peak'] / 2**30:.2f} GiB"
        note = (
            f"{mfu}; {mem}; first step {got['first']:.1f} s; {params / 1e6:.1f} M params, "
            f"{flops / 1e12:.3g} model TFLOP/step (analytic); {device}"
        )
        sink(_stats.row(bench, case, "steps/s", got["rates"], note=note))
        ratio_rows(bench, name, medians, peak_flops is None, sink, done)
    ratio_rows(bench, name, medians, peak_flops is None, sink, done, final=True)


def ratio_rows(
    bench: str,
    name: str,
    medians: dict[str, float],
    cpu: bool,
    sink: Callable[[dict[str, Any]], None],
    done: set[str],
    final: bool = False,
) -> None:
    """The target rows whose two ways have run (each once; ``final``: n/a for the rest).

    Written as soon as they can be, so a stage cut short by its limit keeps them.
    """
    for base, target in TARGETS.items():
        if base in done or not (final or ("jax" in medians and base in medians)):
            continue
        done.add(base)
        case = f"from_lightning / {base} (target >= {target})"
        if "jax" in medians and base in medians:
            ratio = medians["jax"] / medians[base]
            verdict = "met" if ratio >= target else "not met"
            if cpu:
                verdict += ", CPU dry run: the target is a GPU's"
            r = _stats.row(bench, case, "ratio", [ratio], note=verdict)
        else:
            r = _stats.row(bench, case, "ratio", [], note="n/a: a way FAILED")
        r["target"], r["model"] = target, name
        sink(r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, CPU: a smoke run")
    parser.add_argument("--models", default="whisper,vit,gpt")
    parser.add_argument("--ways", default="eager,jax,compile", help="run in this order")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (3; dry 1)")
    parser.add_argument("--steps", type=int, default=None, help="steps per window (10; dry 1)")
    parser.add_argument("--windows", type=int, default=None, help="timed windows (3; dry 2)")
    parser.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile's backend (inductor; the dry run's eager: dynamo's graph capture "
        "through Lightning, without inductor's C++ build, >2 min on a loaded CPU)",
    )
    parser.add_argument("--json", default=None, help="write the rows here, after each way")
    args = parser.parse_args()
    dry = args.dry_run
    args.warmup = args.warmup or (1 if dry else 3)
    args.steps = args.steps or (1 if dry else 10)
    args.windows = args.windows or (2 if dry else 3)
    args.compile_backend = args.compile_backend or ("eager" if dry else "inductor")
    for model in args.models.split(","):
        if model not in gm.SIZES:
            parser.error(f"--models: {model!r} is not one of {sorted(gm.SIZES)}")
    for way in args.ways.split(","):
        if way not in WAYS:
            parser.error(f"--ways: {way!r} is not one of {sorted(WAYS)}")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.set_float32_matmul_precision("high")
    if dry:
        torch.set_num_threads(1)  # tiny ops: torch's threads only contend on a loaded CPU
    rows: list[dict[str, Any]] = []
    meta = _stats.machine()

    def sink(r: dict[str, Any]) -> None:
        rows.append(r)
        print(_stats.markdown([r]).splitlines()[-1], flush=True)
        if args.json:
            _stats.write_rows(args.json, rows, meta)

    for model in args.models.split(","):
        model_rows(model, args, sink)
    print(_stats.markdown(rows))


if __name__ == "__main__":
    main()
