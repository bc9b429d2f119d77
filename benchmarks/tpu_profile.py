"""Where a step's device time goes: a few steps of one way under JAX's profiler, summarised.

Ways: ``encoder-r`` / ``encoder-a`` / ``encoder-t`` (``gpu_encoder.py``'s pure Flax step,
``JaxModule`` and ``from_torch``) and ``MODEL-f`` / ``MODEL-j`` for MODEL in whisper, vit, gpt
(``tpu_models.py``'s pure-Flax twin and ``from_lightning``). For each: the device's compiled
programs (runs, mean ms) and the heaviest ops of the busiest one per step, by category
(the profiler's ``hlo_category`` where the backend records it), each with its HLO text cut short.

Run on the TPU: ``python benchmarks/tpu_profile.py encoder-r,encoder-t --out /tmp/prof``;
``--dry-run`` runs tiny sizes on CPU.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import jax  # noqa: E402

from benchmarks import gpu_encoder as ge  # noqa: E402
from benchmarks import tpu_models as tm  # noqa: E402


class _Window:
    """A Lightning callback tracing batches ``[first, first + n)`` (JAX's profiler)."""

    def __init__(self, trace_dir: Path, sync: Any, first: int = 4, n: int = 3) -> None:
        import lightning as L

        class Callback(L.Callback):
            def on_train_batch_start(cb, trainer: Any, module: Any, batch: Any, i: int) -> None:
                if trainer.global_step == first:
                    sync()
                    jax.profiler.start_trace(str(trace_dir))

            def on_train_batch_end(cb, trainer: Any, *args: Any) -> None:
                if trainer.global_step == first + n:
                    sync()
                    jax.profiler.stop_trace()

        self.callback = Callback()
        self.steps = first + n


def _fit(module: Any, loader: Any, trace_dir: Path) -> None:
    import lightning as L

    window = _Window(trace_dir, lambda: jax.block_until_ready(module.state))
    L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=window.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[window.callback],
    ).fit(module, loader)


def run(way: str, dry: bool, batch: int | None, trace_dir: Path) -> None:
    """Runs ``way`` past its compile, then traces 3 steady steps into ``trace_dir``."""
    model, _, kind = way.partition("-")
    if model == "encoder":
        size = ge.TINY if dry else ge.FULL
        b = batch or (2 if dry else 16)
        if kind == "r":
            fn, _ = ge.reference_path(size, b)
            fn(1)
            with jax.profiler.trace(str(trace_dir)):
                fn(1)  # (2 steps before its clock, then 1)
            return
        import jaxcore
        from torchshell import JaxModule

        tx, loss = jaxcore.make_optimizer("adam", lr=1e-4), jaxcore.softmax_cross_entropy
        if kind == "t":
            torch_model = ge.TorchEncoder(
                size["d"], size["layers"], size["heads"], size["mlp"], size["mels"]
            )
            module: Any = JaxModule.from_torch(torch_model, loss, tx, print_summary=False)
        else:
            flax = ge.FlaxEncoder(size["d"], size["layers"], size["heads"], size["mlp"])
            module = JaxModule(flax, loss, tx, print_summary=False)
        _fit(module, ge._loader(size, b), trace_dir)
        return
    size = tm.gm.SIZES[model]["tiny" if dry else "full"]
    b = batch or (2 if dry else tm.BATCH[model])
    if kind == "f":
        adamw = tm.ft.adamw_of(tm.gm.make_module(model, size).configure_optimizers())
        staged = tm._stage(model, size, b)
        twin = tm.ft.build(model, size, adamw, tm.gm.CLASSES.get(model))
        state = jax.jit(twin.init)(jax.random.key(0), staged[0][0])
        step = jax.jit(twin.step, donate_argnums=0)
        for i in range(3):
            state, _ = step(state, staged[i % len(staged)])
        jax.block_until_ready(state)
        with jax.profiler.trace(str(trace_dir)):
            for i in range(3):
                state, _ = step(state, staged[i % len(staged)])
            jax.block_until_ready(state)
        return
    from torchshell import JaxModule

    module = JaxModule.from_lightning(tm.gm.make_module(model, size), print_summary=False)
    _fit(module, tm.gm.make_loader(model, size, b, 8), trace_dir)


def summary(trace_dir: Path, top: int) -> str:
    """The busiest program's device time per run: by op category and by source line."""
    (path,) = sorted(trace_dir.rglob("*.trace.json.gz"))[-1:]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    names: dict[tuple[Any, Any], str] = {}
    procs: dict[Any, str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e["pid"], e["tid"])] = e["args"]["name"]
    device = {p for p, n in procs.items() if "/device:" in n and "CPU" not in n}
    if not device:
        return "no accelerator lanes in the trace (CPU): nothing to summarise"
    lane = {"XLA Modules": [], "XLA Ops": []}  # type: dict[str, list[Any]]
    for e in events:
        if e.get("ph") == "X" and e["pid"] in device:
            lane.get(names.get((e["pid"], e["tid"]), ""), []).append(e)
    runs: collections.Counter[str] = collections.Counter()
    busy: collections.Counter[str] = collections.Counter()
    for e in lane["XLA Modules"]:
        runs[e["name"]] += 1
        busy[e["name"]] += e["dur"]
    lines = [f"programs: {sum(busy.values()) / 1e3:.1f} ms of device time in the window"]
    for name, us in busy.most_common(4):
        lines.append(f"  {name[:70]}: {runs[name]} runs, {us / runs[name] / 1e3:.2f} ms each")
    main = max(busy, key=busy.__getitem__)
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in lane["XLA Modules"] if e["name"] == main)
    n = len(spans)
    cats: collections.Counter[str] = collections.Counter()
    where: collections.Counter[str] = collections.Counter()
    text: dict[str, str] = {}
    for e in lane["XLA Ops"]:
        if not any(a <= e["ts"] <= b for a, b in spans):
            continue
        args = e.get("args", {})
        cats[args.get("hlo_category", "?")] += e["dur"]
        src = args.get("source", "") or args.get("tf_op", "")[:60]
        src = re.sub(r"^.*/(site-packages|site|w)/", "", src)
        key = f"{src} [{args.get('hlo_category', '?')}]"
        where[key] += e["dur"]
        text.setdefault(key, args.get("long_name", "")[:110])
    total = sum(cats.values()) or 1.0
    lines.append(f"{main[:60]}: {busy[main] / n / 1e3:.2f} ms per run; ops by category:")
    lines += [
        f"  {c:28s} {us / total:6.1%} {us / n / 1e3:7.2f} ms" for c, us in cats.most_common(10)
    ]
    lines.append("by source line (per run):")
    for key, us in where.most_common(top):
        lines.append(f"  {us / n / 1e3:7.2f} ms {us / total:6.1%}  {key}  {text[key]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ways", help="comma list: encoder-r,encoder-a,encoder-t,gpt-f,gpt-j,...")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=None, help="keep the traces here")
    args = parser.parse_args()
    root = Path(args.out or tempfile.mkdtemp())
    for way in args.ways.split(","):
        trace_dir = root / way
        run(way, args.dry_run, args.batch, trace_dir)
        print(f"=== {way} ===\n{summary(trace_dir, args.top)}", flush=True)


if __name__ == "__main__":
    main()
