"""Smoke run of ``make bench``: every benchmark script in tiny mode, one JSON with its rows.

Figures from a tiny run mean nothing (and nothing here is timed): the test checks that every
benchmark runs end to end through ``benchmarks/run.py`` and reports the rows the docs rely on.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("spoken-digits encoder",)  # the tiny run's recipe (the MLP: the user-path rows)
PEERS = ("(b) pure JAX", "(c) Keras 3 (JAX)", "(d) PyTorch Lightning", "(e) hand-written hybrid")
SPLIT = ("data wait", "bridge", "compute", "loop overhead", "total")
# every benchmark script once, 3 at a time: ~8.5 min on 2 shared cores (the first test's
# setup runs them all)
pytestmark = pytest.mark.timeout(1500)


def _run(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), *args],
        cwd=tmp_path,  # anything a benchmark might drop lands here, not in the repo
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=1400,
        check=False,
    )


@pytest.fixture(scope="module")
def tiny(
    tmp_path_factory: pytest.TempPathFactory, child_cache_env: dict[str, str]
) -> tuple[dict[str, Any], str]:
    tmp = tmp_path_factory.mktemp("bench")
    out = str(tmp / "out" / "results.json")
    # the scripts on the suite's compile cache (conftest): user_path.py's forms and peers
    # compile the same steps again in new jitted functions, and tpu.sh/gpu.sh run them too
    proc = _run(tmp, "--tiny", "--jobs", "3", "--out", out, env=child_cache_env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(p.name for p in tmp.iterdir()) == ["out"]  # nothing else left behind
    return json.loads((tmp / "out" / "results.json").read_text()), proc.stdout


def _cases(data: dict[str, Any], bench: str) -> dict[str, dict[str, Any]]:
    return {r["case"]: r for r in data["rows"] if r["benchmark"] == bench}


def test_one_table_with_the_load_average(tiny: tuple[dict[str, Any], str]) -> None:
    data, stdout = tiny
    assert stdout.count("| benchmark | case | metric |") == 1
    assert "load average" in stdout
    assert len(data["machine"]["load_average"]) == 3
    assert len(stdout.splitlines()) > len(data["rows"])  # every row is in the table


@pytest.mark.parametrize("recipe", RECIPES)
def test_peer_rows(tiny: tuple[dict[str, Any], str], recipe: str) -> None:
    cases = _cases(tiny[0], f"peers/{recipe}")
    shell = [c for c in cases if c.startswith("(a) coreshell, K=")]
    assert len(shell) == 1
    for name in [*shell, *PEERS]:
        r = cases[name]
        assert r["metric"] == "steps/s" and r["median"] > 0 and math.isfinite(r["median"])
        assert r["samples_per_s"] == pytest.approx(64 * r["median"])
    for peer in PEERS:  # (a) over each peer, per round, and as the ratio of the medians
        assert cases[peer]["ratio"] == pytest.approx(
            cases[shell[0]]["median"] / cases[peer]["median"]
        )
        ratio = cases["a/" + peer[1]]
        assert ratio["metric"] == "ratio per round" and ratio["median"] > 0
    split = {part: cases[f"(a) split: {part}"]["median"] for part in SPLIT}
    assert all(split[p] >= 0 for p in ("data wait", "bridge", "compute"))
    assert sum(split[p] for p in SPLIT[:4]) == pytest.approx(split["total"], rel=1e-6)


# every loader form the tiny run measures (benchmarks/_user_path.py FORMS: the three collates,
# torchdata's StatefulDataLoader, the user's IterableDataset, the user's batch_sampler)
USER_FORMS = (
    "dict collate",
    "TensorDataset tuples",
    "Dataset class",
    "torchdata StatefulDataLoader",
    "IterableDataset",
    "own batch_sampler",
)


@pytest.mark.parametrize("form", USER_FORMS)
def test_user_path_rows(tiny: tuple[dict[str, Any], str], form: str) -> None:
    cases = _cases(tiny[0], f"peers/digits MLP, user DataLoader: {form}")
    a = cases["(a) coreshell at its defaults"]
    assert a["metric"] == "steps/s" and a["median"] > 0 and "(auto)" in a["note"]
    for peer, target in (("b", 0.8), ("c", 1.1), ("e", 1.05)):
        (name,) = [c for c in cases if c.startswith(f"({peer}) ")]
        assert cases[name]["ratio"] == pytest.approx(a["median"] / cases[name]["median"])
        assert cases[f"a/{peer}"]["note"] == f"target >= {target}"


def test_inference_rows(tiny: tuple[dict[str, Any], str]) -> None:
    cases = _cases(tiny[0], "inference/spoken-digits encoder (random init)")
    for path in ("JAX core", "torch twin, eager", "torch twin, torch.compile", "pt2", "ONNX"):
        one = [c for c in cases if c.startswith(path) and c.endswith("batch 1")]
        many = [c for c in cases if c.startswith(path) and c.endswith("batch 64")]
        assert len(one) == len(many) == 1, (path, sorted(cases))
        assert cases[one[0]]["metric"] == "ms" and cases[one[0]]["p99"] >= cases[one[0]]["median"]
        assert cases[many[0]]["median"] > 0 and "max |diff| vs JAX" in cases[many[0]]["note"]
    for batch in (1, 64):  # the served model before (pt2) and after #54, side by side
        served = [c for c in cases if c.startswith(f"mlflow models serve, batch {batch}, ")]
        assert len(served) == 6, sorted(cases)  # requests/s, p50, in process: before, after
        rates = [cases[c] for c in served if cases[c]["metric"] == "requests/s"]
        assert [r["ratio"] is None for r in rates] == [True, False]
        assert all(r["median"] > 0 for r in rates)


def test_other_benchmarks_rows(tiny: tuple[dict[str, Any], str]) -> None:
    data = tiny[0]
    bridge = _cases(data, "bridge")
    assert bridge and all("zero-copy yes" in r["note"] for r in bridge.values())
    assert set(_cases(data, "compile cache")) == {"no cache", "cold", "warm"}
    torch_model = _cases(data, "torch nn.Module via torchax")
    assert torch_model["Flax, jaxcore step"]["ratio"] == pytest.approx(1.0)
    if (ROOT / "benchmarks" / "tracking.py").exists():
        assert _cases(data, "tracking")["off"]["ratio"] == pytest.approx(1.0)
    (export,) = [b for b in {r["benchmark"] for r in data["rows"]} if b.startswith("export/")]
    rows = _cases(data, export)
    assert rows["memcpy of the same bytes"]["ratio"] == pytest.approx(1.0)
    assert rows["export + save (end to end)"]["median"] > 0
    port = _cases(data, "port/digits MLP")
    assert port["from_torch (JAX loss)"]["ratio"] == pytest.approx(1.0)
    assert port["from_lightning (torch loss)"]["median"] > 0
    assert all(rec.get("returncode", 0) == 0 for rec in data["machine"]["runs"].values())


def test_unknown_benchmark_is_refused(tmp_path: Path) -> None:
    proc = _run(tmp_path, "--only", "nonesuch")
    assert proc.returncode == 2 and "unknown benchmark" in proc.stderr
