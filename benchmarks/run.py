"""``make bench``: every benchmark in one run, one markdown table, one JSON file.

Runs each script of ``benchmarks/`` in its own process (so Keras' backend choice, JAX's device
count and the compile cache of one never touch another), in this order:

- ``user_path.py`` (the headline): coreshell at its defaults on the user's own
  ``DataLoader(TensorDataset(x, y))``, against the pure JAX loop, Keras 3 and the hand-written
  hybrid on that same loader object;
- ``train_peers.py``: on the recipes' own data modules, tuned: coreshell (a) against pure
  JAX (b), Keras 3 on JAX (c), PyTorch Lightning (d) and the hand-written hybrid (e), on
  the digits MLP and the spoken-digits encoder; ratios per round; (a)'s time split;
- ``inference.py``: the spoken-digits encoder served by the jitted JAX core, the torch twin
  (eager, ``torch.compile``), the pt2 program, ONNX Runtime and ``mlflow models serve``;
- ``bridge.py``: ``bridge.to_jax`` against the DLPack primitives and a copy;
- ``compile_cache.py``: cold vs warm start with the persistent compilation cache;
- ``torch_model.py``: a torch ``nn.Module`` through torchax vs Flax vs Lightning;
- ``tracking.py`` (when present): MLflow tracking on vs off;
- ``port.py``: ``JaxModule.from_lightning`` (torch loss, traced) vs ``from_torch`` (JAX loss);
- ``export.py``: a ~100M-parameter tree to safetensors, GB/s against memcpy;
- ``checkpoint_cost.py``: step time with a checkpoint every 10 steps vs none (spoken digits).

The scripts of this project that print their own tables are parsed into rows of the one
schema of ``_stats.py``; their raw output is kept in the JSON too. The load average before
and after is printed with the table: on a shared machine it says how much to trust it.

Run: ``make bench`` or ``.venv/bin/python benchmarks/run.py [--tiny] [--only a,b]
[--out bench-results/results.json]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_stats", _HERE / "_stats.py")
assert _spec is not None and _spec.loader is not None
_stats = importlib.util.module_from_spec(_spec)
sys.modules["_stats"] = _stats
_spec.loader.exec_module(_stats)

Row = dict[str, Any]
_SPREAD = re.compile(r"([\d.,]+)\s*(µs|ms|s)?\s*\[([\d.,]+)-([\d.,]+)\]")
_SCALE = {"µs": 1.0, "ms": 1e3, "s": 1e6, None: 1.0}


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def _spread(cell: str) -> tuple[float, float, float, str | None] | None:
    """``"1.2 ms [1.0-1.5]"`` -> (1.2, 1.0, 1.5, "ms")."""
    m = _SPREAD.search(cell)
    if m is None:
        return None
    return _num(m.group(1)), _num(m.group(3)), _num(m.group(4)), m.group(2)


def _table(text: str) -> list[dict[str, str]]:
    """The first markdown table in ``text`` as a list of {header: cell}."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("|")]
    if len(lines) < 3:
        return []
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    head = cells[0]
    return [dict(zip(head, c, strict=False)) for c in cells[2:]]


def _spread_row(bench: str, case: str, metric: str, cell: str, **kw: Any) -> Row | None:
    got = _spread(cell)
    if got is None:
        return None
    med, lo, hi, _ = got
    r = _stats.row(bench, case, metric, [lo, med, hi], **kw)
    r["n"] = None  # parsed: the script's own median and extremes, not its samples
    return r


def parse_bridge(out: str) -> list[Row]:
    rows = []
    for t in _table(out):
        cell = t.get("bridge.to_jax", "")
        got = _spread(cell)
        if got is None:
            continue
        scale = _SCALE[got[3]]
        r = _stats.row(
            "bridge",
            f"to_jax {t.get('size', '?')}",
            "µs/call",
            [got[1] * scale, got[0] * scale, got[2] * scale],
            ratio=_num(t.get("bridge / fastest primitive", "nan").rstrip("x")),
            ratio_to="fastest zero-copy primitive",
            note=f"zero-copy {t.get('zero-copy', '?')}; "
            f"{t.get('copy / bridge', '?')} faster than jnp.asarray copy",
        )
        r["n"] = None
        rows.append(r)
    return rows


def parse_compile_cache(out: str) -> list[Row]:
    rows, med = [], {}
    for line in out.splitlines():
        name = next((n for n in ("no cache", "cold", "warm") if line.startswith(n)), None)
        if name is None:
            continue
        cells = _SPREAD.findall(line)
        if len(cells) != 3:
            continue
        value, lo, hi = _num(cells[2][0]), _num(cells[2][2]), _num(cells[2][3])
        med[name] = value
        r = _stats.row("compile cache", name, "s to first step", [lo, value, hi])
        r["n"] = None
        rows.append(r)
    if "cold" in med and "warm" in med and med["warm"]:
        for r in rows:
            if r["case"] == "warm":
                r["ratio"], r["ratio_to"] = med["cold"] / med["warm"], "cold / warm"
    return rows


def parse_torch_model(out: str) -> list[Row]:
    rows = []
    for t in _table(out):
        r = _spread_row(
            "torch nn.Module via torchax",
            t.get("path", "?"),
            "steps/s",
            t.get("steps/s median [min-max]", ""),
            ratio=_num(t.get("/ Flax", "nan")),
            ratio_to="Flax",
        )
        if r is not None:
            rows.append(r)
    return rows


def parse_tracking(out: str) -> list[Row]:
    rows = []
    for line in out.splitlines():
        m = re.match(r"^(.+?)\s{2,}([\d.]+ \[[\d.]+-[\d.]+\])\s+([\d.]+)\s*$", line)
        if m:
            r = _spread_row(
                "tracking",
                m.group(1).strip(),
                "ms/step",
                m.group(2),
                ratio=_num(m.group(3)),
                ratio_to="off",
            )
            if r is not None:
                rows.append(r)
    return rows


@dataclass(frozen=True)
class Bench:
    """One script: its arguments by default and in tiny mode, and how to read its output."""

    name: str
    script: str
    args: list[str]
    tiny: list[str]
    parse: Callable[[str], list[Row]] | None = None  # None: the script writes --json rows
    env: dict[str, str] = field(default_factory=dict)


BENCHES = [
    Bench("user_path", "user_path.py", [], ["--tiny"]),
    # tiny: the encoder recipe proves every train_peers row runs; the MLP's peers run in
    # user_path.py's tiny run (the same peer code, on the user's loader)
    Bench("peers", "train_peers.py", [], ["--tiny", "--models", "encoder"]),
    Bench("inference", "inference.py", [], ["--tiny"]),
    Bench("bridge", "bridge.py", ["--quick"], ["--quick"], parse_bridge),
    Bench(
        "compile_cache",
        "compile_cache.py",
        ["--repeats", "5", "--layers", "2", "--devices", "8"],
        ["--repeats", "1", "--layers", "1", "--devices", "1"],
        parse_compile_cache,
    ),
    Bench(
        "torch_model",
        "torch_model.py",
        ["--rounds", "10", "--steps", "50"],
        ["--rounds", "1", "--steps", "10"],
        parse_torch_model,
    ),
    Bench(
        "tracking",
        "tracking.py",
        ["--rounds", "5", "--steps", "200", "--log-every", "10"],
        [
            *("--rounds", "1", "--steps", "20", "--warmup", "5", "--log-every", "5"),
            *("--enqueue-calls", "500"),
        ],
        parse_tracking,
    ),
    Bench(
        "port", "port.py", ["--rounds", "7", "--steps", "300"], ["--rounds", "1", "--steps", "20"]
    ),
    Bench("export", "export.py", [], ["--tiny"]),
    Bench(
        "checkpoint",
        "checkpoint_cost.py",
        ["--rounds", "3", "--steps", "300"],
        ["--recipe", "digits", "--rounds", "1", "--steps", "40", "--warmup", "1"],
    ),
]


# XLA's CPU backend unoptimised, for smoke runs only: every step compiles about twice as fast
# (gpu.sh's dry run measured 44 -> 22 s for its tiny step at load 8) and the few steps a tiny
# run times run slower, which a smoke run's figures may (they mean nothing either way)
SMOKE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def child_env(tiny: bool = False) -> dict[str, str]:
    """The environment without a forced host device count (tests set 8 fake devices); with
    ``tiny``, XLA's CPU backend unoptimised (:data:`SMOKE_XLA_FLAGS`).

    Example:
        >>> "xla_force_host_platform_device_count" in child_env().get("XLA_FLAGS", "")
        False
    """
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    if tiny:  # each flag once (JAX's persistent cache keys on the words: see _runs.with_flags)
        flags = " ".join(dict.fromkeys(f"{flags} {SMOKE_XLA_FLAGS}".split()))
    env["XLA_FLAGS"] = flags.strip()
    if not env["XLA_FLAGS"]:
        del env["XLA_FLAGS"]
    return env


def run_one(bench: Bench, tiny: bool, tmp: Path) -> tuple[list[Row], dict[str, Any]]:
    """Runs one script; returns its rows and a record (command, seconds, output)."""
    cmd = [sys.executable, str(_HERE / bench.script), *(bench.tiny if tiny else bench.args)]
    out_json = tmp / f"{bench.name}.json"
    if bench.parse is None:
        cmd += ["--json", str(out_json)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=child_env(tiny), capture_output=True, text=True, check=False)
    record: dict[str, Any] = {
        "command": " ".join(cmd[1:]),
        "seconds": time.perf_counter() - start,
        "returncode": proc.returncode,
        "stdout": proc.stdout,
        "stderr_tail": proc.stderr[-4000:],
    }
    print(f"  {bench.script}: {record['seconds']:.0f} s", flush=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"benchmarks/{bench.script} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    if bench.parse is None:
        rows = json.loads(out_json.read_text())["rows"]
    else:
        rows = bench.parse(proc.stdout)
        if not rows:
            raise RuntimeError(
                f"benchmarks/{bench.script}: no result rows found in its output:\n{proc.stdout}"
            )
    return rows, record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results/results.json", help="JSON output path")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="smoke run of every benchmark (XLA CPU unoptimised: the figures mean nothing)",
    )
    parser.add_argument(
        "--only", default="", help=f"comma list of: {', '.join(b.name for b in BENCHES)}"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="scripts run at once (1 for figures worth reading; more only for smoke runs)",
    )
    args = parser.parse_args()
    only = {s for s in args.only.split(",") if s}
    unknown = only - {b.name for b in BENCHES}
    if unknown:
        parser.error(
            f"unknown benchmark(s) {sorted(unknown)}; expected some of {[b.name for b in BENCHES]}"
        )
    before = _stats.machine()
    start = time.perf_counter()
    rows: list[Row] = []
    records: dict[str, Any] = {}
    todo = [b for b in BENCHES if not only or b.name in only]
    for bench in todo:
        if not (_HERE / bench.script).exists():
            records[bench.name] = {"skipped": f"benchmarks/{bench.script} not present"}
    todo = [b for b in todo if b.name not in records]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        for bench in todo:
            print(f"running {bench.script} ...", file=sys.stderr, flush=True)
        results = pool.map(lambda b: run_one(b, args.tiny, Path(tmp)), todo)
        for bench, (got, record) in zip(todo, results, strict=True):
            records[bench.name] = record
            rows += got
    after = _stats.load_average()
    meta = {
        **before,
        "load_average_after": list(after),
        "total_seconds": time.perf_counter() - start,
        "tiny": args.tiny,
        "runs": records,
    }
    la = before["load_average"]
    print(
        f"{before['processor']}, {before['cpus']} CPUs; load average (1/5/15 min) "
        f"{la[0]:.1f}/{la[1]:.1f}/{la[2]:.1f} before, {after[0]:.1f}/{after[1]:.1f}/"
        f"{after[2]:.1f} after; {meta['total_seconds']:.0f} s in all"
        + ("; TINY smoke run: the figures mean nothing" if args.tiny else "")
        + "\n"
    )
    _stats.write_rows(args.out, rows, meta)
    print(_stats.markdown(rows))
    print(f"\nJSON: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
