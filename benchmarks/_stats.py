"""Shared helpers of the benchmark scripts: robust summaries, result rows, machine facts.

Every script measures warm (warm-up excluded), repeats at least five times and reports the
median with the min-max spread. Results are rows of one schema so that ``run.py`` can put
every benchmark into one table and one JSON file::

    {"benchmark": "peers/digits MLP", "case": "(a) coreshell", "metric": "steps/s",
     "median": 1234.0, "min": 1100.0, "max": 1300.0, "n": 7,
     "ratio": 0.81, "ratio_to": "(b) pure JAX", "note": "..."}
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages (zeros where the OS gives none)."""
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


def machine() -> dict[str, Any]:
    """What the numbers were measured on: CPU count, load, Python and library versions."""
    import importlib.metadata as md

    versions = {}
    for name in ("jax", "jaxlib", "flax", "optax", "torch", "lightning", "keras", "safetensors"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[name] = md.version(name)
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "load_average": list(load_average()),
        "versions": versions,
    }


def row(
    benchmark: str,
    case: str,
    metric: str,
    samples: Sequence[float] | float,
    *,
    ratio: float | None = None,
    ratio_to: str | None = None,
    note: str = "",
) -> Row:
    """One result row: the median and min-max of ``samples`` (or one value)."""
    values = [float(samples)] if isinstance(samples, int | float) else [float(s) for s in samples]
    return {
        "benchmark": benchmark,
        "case": case,
        "metric": metric,
        "median": statistics.median(values) if values else float("nan"),
        "min": min(values) if values else float("nan"),
        "max": max(values) if values else float("nan"),
        "n": len(values),
        "ratio": ratio,
        "ratio_to": ratio_to,
        "note": note,
    }


def rotate(
    paths: dict[str, Callable[[int], tuple[float, int]]], rounds: int, steps: int
) -> dict[str, list[float]]:
    """Runs every path ``rounds`` times, in a rotating order, and returns steps/s per round.

    Each path is ``steps -> (seconds, steps_timed)`` and excludes its own warm-up. Rounds
    alternate between the paths so that load bursts on a shared machine hit them alike, and
    every path goes first as often as the others.
    """
    rates: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            seconds, done = paths[name](steps)
            rates[name].append(done / seconds)
    return rates


def write_rows(path: str | Path, rows: list[Row], meta: dict[str, Any] | None = None) -> None:
    """Writes ``{"machine": ..., "rows": [...]}`` to ``path`` (folders created)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": meta or machine(), "rows": rows}, indent=1))


def fmt_value(value: float) -> str:
    """A compact number: thousands separators above 100, three significant digits below."""
    if value != value:  # nan
        return "n/a"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def fmt_cell(r: Row) -> str:
    """``median [min-max]``, or just the value when there was one sample."""
    if r["n"] == 1 or r["min"] == r["max"]:
        return fmt_value(r["median"])
    return f"{fmt_value(r['median'])} [{fmt_value(r['min'])}-{fmt_value(r['max'])}]"


def markdown(rows: list[Row]) -> str:
    """All rows as one markdown table."""
    lines = [
        "| benchmark | case | metric | median [min-max] | ratio | vs |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "" if r.get("ratio") is None else f"{r['ratio']:.2f}"
        case = r["case"] + (f" ({r['note']})" if r.get("note") else "")
        lines.append(
            f"| {r['benchmark']} | {case} | {r['metric']} | {fmt_cell(r)} | {ratio} | "
            f"{r.get('ratio_to') or ''} |"
        )
    return "\n".join(lines)
