"""A team's LightningModule on one TPU: ``JaxModule.from_lightning`` beside a pure-Flax twin.

The three modules of :mod:`benchmarks._gpu_modules` (a Whisper-base-sized encoder classifier,
ViT-B/16 at 224 px, GPT-2 small at 1,024 tokens), each trained two ways on the JAX device
from the same synthetic data (``_gpu_modules.make_loader``), both in bfloat16 with float32
params and the module's own AdamW:

- (f) the pure-Flax twin (:mod:`benchmarks._flax_twins`: same shapes and math, attention
  through ``jaxcore.models.attention.attend``, ``optax.adamw`` at the values the module's
  ``configure_optimizers`` returns): one jitted step, state donated, over a pool of 4 batches
  staged on the device once; timed over ``--windows`` windows of ``--steps`` steps after
  ``--warmup``, ``jax.block_until_ready`` at each window's edge;
- (j) ``JaxModule.from_lightning(module)`` under ``Trainer(precision="bf16-mixed")`` fed by the
  ``DataLoader`` (``gpu_lightning.run_way("jax", ...)``: the same windows, by its callback).

Rows: steps/s per way (median and spread over the windows) with MFU (``_gpu_modules``'s
analytic model FLOPs x steps/s / the chip's dense bf16 peak: TPU v5e ("TPU v5 lite") 197
TFLOP/s; n/a on CPU), time to the first step, memory (the twin's compiled step by XLA's
memory analysis; (j): the process's peak so far); then per model the ratio (j)/(f) (target
>= 0.95) and MFU targets per way (Whisper-base encoder 30%, ViT-B/16 50%, GPT-2 small 45%),
met or not. Checks, noted on the rows: the twin's loss over 5 steps on one batch starts near
ln(classes) (ln(vocab)) and falls; with ``--parity`` (on in the dry run) the twin's forward at
the torch module's weights, tiny sizes, matches the module's (float32 and bf16 autocast). A
model that fails gives a FAILED row and the others still run; rows go to ``--json`` as they
are made. ``--dry-run``: CPU, tiny sizes, a few steps (exit 1 if a check fails).

Run: ``JAX_PLATFORMS=cpu .venv/bin/python benchmarks/tpu_models.py --dry-run`` (CPU smoke);
on a TPU: ``.venv/bin/python benchmarks/tpu_models.py [--models whisper,vit,gpt]
[--batch gpt=8] [--json out.json]`` (``benchmarks/tpu.sh``'s models stage).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import logging
import math
import os
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
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import _flax_twins as ft  # noqa: E402
from benchmarks import _gpu_modules as gm  # noqa: E402
from benchmarks import _stats  # noqa: E402
from benchmarks.gpu_lightning import NAMES, _device, _failure, run_way  # noqa: E402

# GPT-2 small at 16 x 1,024 would need ~15 GiB (its [B x T, 50,304] logits in float32 and their
# gradient alone ~6.6 GiB): 8 fits the chip's 15.7 GiB and matches gpu_lightning.py
BATCH = {"whisper": 16, "vit": 64, "gpt": 8}
MFU_TARGETS = {"whisper": 0.30, "vit": 0.50, "gpt": 0.45}
RATIO_TARGET = 0.95
TWIN = "(f) pure-Flax twin, batches on device"
JAX = "(j) JaxModule.from_lightning(module), bf16-mixed"
POOL, SANITY = 4, 5  # batches staged for (f); steps of the loss check on one batch
PARITY = {"float32": 1e-4, "bfloat16": 2e-2}  # forward rel. diff limits, twin vs torch
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
Sink = Callable[[dict[str, Any]], None]


def _stage(name: str, size: dict[str, int], batch: int) -> list[tuple[jax.Array, jax.Array]]:
    """The first ``POOL`` batches of ``make_loader`` on the JAX device (ints as int32)."""
    out = []
    for tensors in gm.make_loader(name, size, batch, POOL):
        arrays = [t.numpy() for t in tensors]
        arrays = [a.astype(np.int32) if a.dtype == np.int64 else a for a in arrays]
        out.append(tuple(jax.device_put(a) for a in arrays))
    return out  # type: ignore[return-value]


def _xla_bytes(compiled: Any) -> float | None:
    """Device bytes of a compiled program: arguments + outputs - aliased + temporaries."""
    try:
        m = compiled.memory_analysis()
        total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
        return float(total - m.alias_size_in_bytes)
    except Exception:  # not every backend reports it
        return None


def run_twin(
    name: str, size: dict[str, int], batch: int, timing: tuple[int, int, int], adamw: Any
) -> dict[str, Any]:
    """Trains the twin: window rates, time to the first step, XLA memory, one-batch losses."""
    warmup, window, windows = timing
    start = time.perf_counter()
    staged = _stage(name, size, batch)
    twin = ft.build(name, size, adamw, gm.CLASSES.get(name))
    state = jax.jit(twin.init)(jax.random.key(0), staged[0][0])
    step = jax.jit(twin.step, donate_argnums=0).lower(state, staged[0]).compile()
    memory = _xla_bytes(step)
    losses, first = [], 0.0
    for _ in range(SANITY):  # the loss check; the first is the first step
        state, loss = step(state, staged[0])
        losses.append(loss)
        if len(losses) == 1:
            jax.block_until_ready(loss)
            first = time.perf_counter() - start
    for i in range(warmup):
        state, _ = step(state, staged[i % POOL])
    jax.block_until_ready(state)
    marks = [time.perf_counter()]
    for w in range(windows):
        for i in range(window):
            state, _ = step(state, staged[(w * window + i) % POOL])
        jax.block_until_ready(state)
        marks.append(time.perf_counter())
    rates = [window / (b - a) for a, b in itertools.pairwise(marks)]
    return {
        "rates": rates,
        "first": first,
        "memory": memory,
        "losses": [float(v) for v in losses],
    }


def loss_check(name: str, size: dict[str, int], losses: list[float]) -> tuple[bool, str]:
    """The first loss within 1 of ln(classes) (GPT: ln(vocab)), the last below the first."""
    n = size["vocab"] if name == "gpt" else gm.CLASSES[name]
    ok = abs(losses[0] - math.log(n)) < 1.0 and losses[-1] < losses[0]
    return ok, (
        f"loss on one batch {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps "
        f"(ln {n} = {math.log(n):.3f}): {'ok' if ok else 'CHECK FAILED'}"
    )


def parity(name: str) -> dict[str, float]:
    """Rel. L2 diff of the twin's logits against the torch module's at tiny sizes, same weights."""
    size = gm.SIZES[name]["tiny"]
    module = gm.make_module(name, size).eval()
    x, _ = next(iter(gm.make_loader(name, size, 2, 1)))
    state = {k: v.detach().float().numpy() for k, v in module.state_dict().items()}
    params = ft.params_from_state_dict(state)
    with torch.no_grad():
        ref = {"float32": module(x).float().numpy()}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref["bfloat16"] = module(x).float().numpy()
    out = {}
    for dtype, want in ref.items():
        model = ft.make_model(name, size, gm.CLASSES.get(name), getattr(jnp, dtype))
        xs = jnp.asarray(x.numpy())
        shapes = jax.eval_shape(model.init, jax.random.key(0), xs)["params"]
        if jax.tree.map(np.shape, shapes) != jax.tree.map(np.shape, params):
            raise ValueError(f"{name}: the state_dict maps to other params than the twin's")
        with jax.default_matmul_precision("highest"):  # a TPU's float32 default is bf16 passes
            got = np.asarray(jax.jit(model.apply)({"params": params}, xs), np.float32)
        out[dtype] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    return out


def _gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def _way_row(
    bench: str, case: str, got: dict[str, Any], flops: float, peak: float | None, extra: str
) -> tuple[dict[str, Any], float, float | None]:
    med = statistics.median(got["rates"])
    mfu = flops * med / peak if peak else None
    note = f"MFU {'n/a' if mfu is None else f'{mfu:.1%}'}; {extra}first step {got['first']:.1f} s"
    return _stats.row(bench, case, "steps/s", got["rates"], note=note), med, mfu


def _target_row(
    bench: str, name: str, case: str, metric: str, value: float | None, target: float, cpu: bool
) -> dict[str, Any]:
    if value is None:
        why = "n/a on CPU (no bf16 peak)" if cpu and metric == "MFU" else "n/a: a way FAILED"
        r = _stats.row(bench, case, metric, [], note=why)
    else:
        verdict = "met" if value >= target else "not met"
        if cpu:
            verdict += ", CPU dry run: the target is a TPU's"
        r = _stats.row(bench, case, metric, [value], note=verdict)
    r["target"], r["model"] = target, name
    return r


def model_rows(name: str, args: argparse.Namespace, sink: Sink) -> list[str]:
    """Runs both ways of one model, each row handed to ``sink``; returns failed checks."""
    size = gm.SIZES[name]["tiny" if args.dry_run else "full"]
    batch = args.batch[name]
    flops = gm.model_flops(name, size, batch)
    device, peak = _device()
    bench = (
        f"tpu {NAMES[name]} d={size['d']} x{size['layers']}, "
        f"T={gm.tokens_per_sample(name, size)}, B={batch}"
    )
    timing = (args.warmup, args.steps, args.windows)
    failed: list[str] = []
    module = gm.make_module(name, size)
    adamw = ft.adamw_of(module.configure_optimizers())
    facts = f"{gm.param_count(module) / 1e6:.1f} M params, {flops / 1e12:.3g} model TFLOP/step"
    del module
    if args.parity:
        case = "(f) twin forward vs torch module's, same weights, tiny sizes"
        try:
            diff = parity(name)
        except Exception as exc:
            traceback.print_exc()
            failed.append(f"{name} parity")
            sink(_stats.row(bench, case, "rel diff", [], note=f"FAILED: {_failure(exc)}"))
        else:
            ok = all(diff[k] < lim for k, lim in PARITY.items())
            failed += [] if ok else [f"{name} parity"]
            note = ", ".join(f"{k} {diff[k]:.1e} (< {PARITY[k]:g})" for k in PARITY)
            sink(
                _stats.row(
                    bench,
                    case,
                    "rel diff",
                    [diff["bfloat16"]],
                    note=f"{note}: " + ("ok" if ok else "CHECK FAILED"),
                )
            )
    medians: dict[str, float] = {}
    mfus: dict[str, float | None] = {TWIN: None, JAX: None}
    for case in (TWIN, JAX):
        try:
            if case == TWIN:
                got = run_twin(name, size, batch, timing, adamw)
            else:
                got = run_way("jax", name, size, batch, timing)
        except Exception as exc:  # a FAILED row: the other way and models still run
            traceback.print_exc()
            sink(_stats.row(bench, case, "steps/s", [], note=f"FAILED: {_failure(exc)}"))
            failed.append(f"{name} {case[:3]}")
            continue
        finally:
            gc.collect()
        if case == TWIN:
            ok, check = loss_check(name, size, got["losses"])
            failed += [] if ok else [f"{name} loss"]
            mem = _gib(got["memory"])
            extra = f"XLA memory {mem}; {check}; "
        else:
            mem = _gib(got["peak"])
            extra = f"process peak mem so far {mem}; "
        r, medians[case], mfus[case] = _way_row(bench, case, got, flops, peak, extra)
        r["note"] += f"; {facts}; {device}"
        if case == JAX and TWIN in medians:
            r["ratio"], r["ratio_to"] = medians[JAX] / medians[TWIN], "(j) / (f)"
        sink(r)
    ratio = medians[JAX] / medians[TWIN] if len(medians) == 2 else None
    case = f"from_lightning / pure-Flax twin (target >= {RATIO_TARGET})"
    sink(_target_row(bench, name, case, "ratio", ratio, RATIO_TARGET, peak is None))
    target = MFU_TARGETS[name]
    for way, mfu in mfus.items():
        case = f"MFU {way[:3]} (target >= {target:.0%})"
        sink(_target_row(bench, name, case, "MFU", mfu, target, peak is None))
    return failed


def _parse_batch(text: str | None, dry: bool, parser: argparse.ArgumentParser) -> dict[str, int]:
    out = {k: 2 for k in BATCH} if dry else dict(BATCH)
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        if key not in BATCH or not value.isdigit() or int(value) < 1:
            parser.error(f"--batch: {item!r} is not NAME=N with NAME in {sorted(BATCH)}")
        out[key] = int(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, CPU: a smoke run")
    parser.add_argument("--models", default="whisper,vit,gpt")
    parser.add_argument("--batch", default=None, help=f"NAME=N,... (defaults {BATCH}; dry 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (3; dry 1)")
    parser.add_argument("--steps", type=int, default=None, help="steps per window (10; dry 1)")
    parser.add_argument("--windows", type=int, default=None, help="timed windows (5; dry 2)")
    parser.add_argument(
        "--parity",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the forward parity check at tiny sizes (default: on in the dry run only)",
    )
    parser.add_argument("--json", default=None, help="write the rows here, after each row")
    args = parser.parse_args()
    dry = args.dry_run
    if dry:  # before JAX starts its backend: tiny programs, CPU compiles ~2x faster unoptimised
        flags = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}"  # each once (cache key)
        os.environ["XLA_FLAGS"] = " ".join(dict.fromkeys(flags.split()))
    args.warmup = args.warmup or (1 if dry else 3)
    args.steps = args.steps or (1 if dry else 10)
    args.windows = args.windows or (2 if dry else 5)
    args.batch = _parse_batch(args.batch, dry, parser)
    args.parity = dry if args.parity is None else args.parity
    for model in args.models.split(","):
        if model not in gm.SIZES:
            parser.error(f"--models: {model!r} is not one of {sorted(gm.SIZES)}")
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

    failed: list[str] = []
    for model in args.models.split(","):
        try:
            failed += model_rows(model, args, sink)
        except Exception as exc:  # outside a way (building the module): the next model runs
            traceback.print_exc()
            sink(
                _stats.row(
                    f"tpu {NAMES[model]}",
                    "all ways",
                    "steps/s",
                    [],
                    note=f"FAILED: {_failure(exc)}",
                )
            )
            failed.append(model)
        gc.collect()
        jax.clear_caches()  # the model's compiled steps
    print(_stats.markdown(rows))
    if failed:
        print(f"checks or ways failed: {', '.join(failed)}", file=sys.stderr)
        if dry:
            sys.exit(1)


if __name__ == "__main__":
    main()
