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


def run(way: str, dry: bool, batch: int | None) -> None:
    """Runs ``way`` for a few steps (its compile included: the summary counts program runs)."""
    model, _, kind = way.partition("-")
    if model == "encoder":
        size = ge.TINY if dry else ge.FULL
        b = batch or (2 if dry else 16)
        if kind == "r":
            fn, _ = ge.reference_path(size, b)
            fn(4)
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
        ge.shell_path(module, ge._loader(size, b))(4)
        return
    size = tm.gm.SIZES[model]["tiny" if dry else "full"]
    b = batch or (2 if dry else tm.BATCH[model])
    if kind == "f":
        adamw = tm.ft.adamw_of(tm.gm.make_module(model, size).configure_optimizers())
        tm.run_twin(model, size, b, (1, 2, 1), adamw)
    else:
        tm.run_way("jax", model, size, b, (1, 2, 1))


def summary(trace_dir: Path, top: int) -> str:
    """The busiest program's ops per run, heaviest first, from the profiler's trace."""
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
    device = [p for p, n in procs.items() if "/device:" in n and "CPU" not in n]
    lines = []
    modules: collections.Counter[str] = collections.Counter()
    module_us: collections.Counter[str] = collections.Counter()
    ops: dict[str, list[Any]] = {}
    for e in events:
        if e.get("ph") != "X" or (device and e["pid"] not in device):
            continue
        lane = names.get((e["pid"], e["tid"]), "")
        if "Module" in lane:
            modules[e["name"]] += 1
            module_us[e["name"]] += e.get("dur", 0)
        elif "Op" in lane or not device:
            key = re.sub(r"\.\d+$", "", e["name"])
            args = e.get("args", {})
            slot = ops.setdefault(key, [0.0, 0, args.get("hlo_category", ""), ""])
            slot[0] += e.get("dur", 0)
            slot[1] += 1
            slot[3] = slot[3] or str(args.get("long_name", ""))[:150]
    lanes = sorted({n for (p, _), n in names.items() if p in device})
    lines.append(f"device: {[procs[p] for p in device] or 'none (CPU: host threads)'} {lanes}")
    for name, n in modules.most_common(6):
        lines.append(f"  program {name}: {n} runs, mean {module_us[name] / n / 1e3:.2f} ms")
    runs = max(modules.values(), default=1)
    busiest = max(module_us, key=module_us.__getitem__, default=None)
    per_step = module_us[busiest] / modules[busiest] / 1e3 if busiest else float("nan")
    total = sum(v[0] for v in ops.values())
    cats: collections.Counter[str] = collections.Counter()
    for us, _, cat, _ in ops.values():
        cats[cat or "?"] += us
    lines.append(f"busiest program {busiest}: {per_step:.2f} ms per run; ops by category:")
    for cat, us in cats.most_common(12):
        lines.append(f"  {cat:28s} {us / total:6.1%}")
    lines.append(f"heaviest ops (share of op time, calls/run over {runs} runs):")
    for key, (us, n, cat, text) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {us / total:6.1%} {n / runs:5.1f}x {cat[:16]:16s} {key[:40]:40s} {text}")
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
        with jax.profiler.trace(str(trace_dir)):
            run(way, args.dry_run, args.batch)
        print(f"=== {way} ===\n{summary(trace_dir, args.top)}", flush=True)


if __name__ == "__main__":
    main()
