"""The default speech recipe end to end through ``coreshell train``, on whatever JAX device is
there (tpu.sh's stage 3).

``coreshell train data.front_end=device`` (DataLoader workers on the host decode and augment
the waveform, one per host core but one; log-mel, trimming and SpecAugment run in the jitted
step on the chip), MLflow to a local SQLite store, Orbax checkpoints, the export of the torch
twin's weights and the run's parity check (the twin's logits against the JAX model's on one
batch, at the step's precision). From the run's MLflow record: the time of fit
(``trainer.max_steps`` x batch / the last logging window's samples/s, as
``speech_accuracy.py`` and docs/speech.md count it), steps/s, the test accuracy and the
parity; the whole command's wall time (data check, compiles, validation, test, export, the
MLflow model); the parity's verdict from its output.

``--front-end host`` measures the same recipe as a CPU runs it (features in the workers, the
recipe's own worker count): the reference of the goal "fits at least 5x faster than on the
2-core CPU". Its rows (``--json``) given to a chip run as ``--reference`` add the speed-up
and the accuracy difference (docs/tpu.md, "The speech recipe").

The recipe needs torchaudio, MLflow and eSpeak NG (espeakng-loader) on the host (tpu.sh
installs them from .whl-tpu on the TPU machine); where one is missing the stage stops before
training with a line naming what is missing (tpu.sh: a FAILED row).

``--dry-run``: a few steps on CPU (the suite's) on the small 4-voice set (``DRY_DATA``);
overrides after ``--`` go to the command.

Run: ``.venv/bin/python benchmarks/tpu_speech.py [--dry-run] [--front-end host]
[--reference ROWS.json] [--json PATH] [-- override ...]``.
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
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))  # the repository: `benchmarks._x` helpers

from benchmarks import _stats  # noqa: E402

# 4 voices, 1 take: 40 clips, of which ~20 train: a batch of 8 (the recipe's 96 would leave
# the training loader empty: it drops the ragged last batch, and the fit would take no step)
DRY_DATA = (
    "data.takes=1",
    "data.speakers=4",
    "data.num_workers=1",
    "data.batch_size=8",
    "data.eval_batch_size=16",
    "++data.min_test_clips=0",
    "trainer.log_every_n_steps=2",  # (samples/s is measured between two logging steps)
)
NEEDS = {"torchaudio": "torchaudio", "mlflow": "mlflow", "espeakng_loader": "espeakng-loader"}
LABEL = "tpu speech recipe"


def missing() -> list[str]:
    """The recipe's host packages this Python cannot import."""
    return [dist for mod, dist in NEEDS.items() if importlib.util.find_spec(mod) is None]


def run_figures(uri: str) -> dict[str, Any]:
    """The newest run of the store: test accuracy and clips, samples/s, steps/s, time of fit
    (``speech_accuracy.run_figures``: the last logging window's rate over all the steps) and
    the export's parity, and the kind of device it ran on (read from the run: this process
    leaves the chip alone)."""
    import mlflow

    from benchmarks.speech_accuracy import run_figures as figures

    client = mlflow.MlflowClient(uri)
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    run = runs[0]
    return figures(uri, run.info.run_id) | {
        "parity": run.data.metrics.get("system/coreshell.export.parity_max_abs_diff"),
        "device": run.data.tags.get("devices.kind", "?"),
    }


def reference_rows(rows: list[_stats.Row], reference: list[_stats.Row]) -> list[_stats.Row]:
    """The speed-up of this run's fit over a reference run's (target >= 5x) and the difference
    of their test accuracies, from both runs' rows.

    Example:
        >>> mine = [_stats.row("tpu speech recipe, device on TPU v5 lite", "fit", "s", [20.0]),
        ...         _stats.row("tpu speech recipe, device on TPU v5 lite", "test accuracy",
        ...                    "fraction", [0.975])]
        >>> ref = [_stats.row("tpu speech recipe, host on cpu", "fit", "s", [150.0]),
        ...        _stats.row("tpu speech recipe, host on cpu", "test accuracy", "fraction",
        ...                   [0.971])]
        >>> [(r["median"], r["ratio"], r["note"]) for r in reference_rows(mine, ref)]
        [(20.0, 7.5, ''), (0.975, None, "0.004 above the reference's 0.971")]
    """

    def pick(rs: list[_stats.Row], case: str) -> _stats.Row:
        found = [r for r in rs if r["case"] == case]
        if not found:
            raise SystemExit(
                f"tpu_speech: the rows have no '{case}' row (cases: {[r['case'] for r in rs]}). "
                "Expected the --json rows of a tpu_speech.py run; fix: run "
                "tpu_speech.py --front-end host --json PATH on the reference machine."
            )
        return found[0]

    fit, ref_fit = pick(rows, "fit"), pick(reference, "fit")
    acc, ref_acc = pick(rows, "test accuracy"), pick(reference, "test accuracy")
    ref_name = ref_fit["benchmark"].removeprefix(LABEL + ", ")
    diff = acc["median"] - ref_acc["median"]
    return [
        _stats.row(
            fit["benchmark"],
            f"fit vs {ref_name} (target >= 5x)",
            "s",
            [fit["median"]],
            ratio=ref_fit["median"] / fit["median"],
            ratio_to=f"{ref_fit['median']:.0f} s",
        ),
        _stats.row(
            acc["benchmark"],
            f"test accuracy vs {ref_name} (the same)",
            "fraction",
            [acc["median"]],
            note=f"{abs(diff):.3f} {'above' if diff >= 0 else 'below'} the reference's "
            f"{ref_acc['median']:.3f}",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="a few steps: a smoke run")
    parser.add_argument(
        "--front-end", default="device", choices=["device", "host"], help="data.front_end"
    )
    parser.add_argument("--reference", default=None, help="rows of a reference run (--json)")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("overrides", nargs="*", help="coreshell train overrides")
    args = parser.parse_args()
    if gone := missing():
        raise SystemExit(
            f"tpu_speech: not run: this machine lacks {', '.join(gone)} (the speech recipe's "
            "host stack). On the lent TPU machine: benchmarks/tpu.sh --fetch-wheels here, the "
            "device call carrying .whl-tpu (tpu.sh installs it); on a TPU VM with a registry: "
            "pip install -e '.[tpu]'."
        )
    reference = json.loads(Path(args.reference).read_text())["rows"] if args.reference else None
    work = Path(tempfile.mkdtemp(prefix="tpu_speech_"))
    # the dry run: 4 steps on the small set the suite's speech tests build (4 voices, 1 take:
    # 40 clips in all, not 5,760) and one DataLoader worker per loader (3 spawned processes,
    # not 6): every part of the run still goes through (workers, test, predict, export)
    if args.dry_run:
        steps = ["trainer.max_steps=4", *DRY_DATA]
    elif args.front_end == "device":  # the workers only decode and augment: one per host core
        steps = [f"data.num_workers={max(2, (os.cpu_count() or 3) - 1)}"]
    else:  # the recipe as a CPU runs it, its own worker count
        steps = []
    uri = f"sqlite:///{work / 'mlflow.db'}"
    cmd = [
        sys.executable, "-m", "torchshell.app.cli", "train", f"data.front_end={args.front_end}",
        f"tracking.uri={uri}", f"hydra.run.dir={work / 'run'}", *steps, *args.overrides,
    ]  # fmt: skip
    env = dict(
        os.environ, PYTHONPATH=str(_HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    print(proc.stdout[-3000:])
    if proc.returncode:
        raise SystemExit(f"coreshell train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    fig = run_figures(uri)
    verdict = re.search(r"parity max abs diff [^:(]+: ([^,]+),", proc.stdout)
    label = f"{LABEL}, {args.front_end} front end on {fig['device']}"
    workers = next((s.split("=")[1] for s in steps if s.startswith("data.num_workers=")), "2")
    rows = [
        _stats.row(
            label,
            "fit",
            "s",
            [fig["fit_s"]],
            note=f"{fig['steps']:.0f} steps x batch / samples/s; DataLoader workers: {workers}",
        ),
        _stats.row(label, "training steps", "steps/s", [fig["steps_s"]]),
        _stats.row(
            label,
            "test accuracy",
            "fraction",
            [fig["test_accuracy"]] if fig["test_accuracy"] is not None else [],
            note=f"{fig['test_examples'] or 0:.0f} clips of unseen voices",
        ),
        _stats.row(label, "the whole command (data, compile, test, export)", "s", [wall]),
        _stats.row(
            label,
            "export: the torch twin's logits vs the JAX model's on the parity batch",
            "max abs diff",
            [fig["parity"]] if fig["parity"] is not None else [],
            note=verdict.group(1) if verdict else "no verdict printed",
        ),
    ]
    if reference is not None:
        rows += reference_rows(rows, reference)
    print(_stats.markdown(rows))
    if args.json:
        _stats.write_rows(args.json, rows, _stats.machine())


if __name__ == "__main__":
    main()
