"""The default speech recipe end to end through ``coreshell train``, on whatever JAX device is
there (tpu.sh's stage 3).

``coreshell train data.front_end=device`` (DataLoader workers on the host decode and augment
the waveform; log-mel, trimming and SpecAugment run in the jitted step on the chip), MLflow to
a local SQLite store, Orbax checkpoints, the export of the torch twin's weights and their
parity against the JAX params: the fit's wall time, the test accuracy and the parity from
the run's end summary. The recipe needs torchaudio, MLflow and eSpeak NG (espeakng-loader)
on the host; where one is missing (a TPU VM whose only torch is 2.13 has no torchaudio build)
the stage stops before training with a line naming what is missing (tpu.sh: a FAILED row).

``--dry-run``: a few steps on CPU (the suite's) on the small 4-voice set (``DRY_DATA``);
overrides after ``--`` go to the command.

Run: ``.venv/bin/python benchmarks/tpu_speech.py [--dry-run] [--json PATH] [-- override ...]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))  # the repository: `benchmarks._x` helpers

from benchmarks import _stats  # noqa: E402

DRY_DATA = ("data.takes=1", "data.speakers=4", "data.num_workers=1", "++data.min_test_clips=0")
NEEDS = {"torchaudio": "torchaudio", "mlflow": "mlflow", "espeakng_loader": "espeakng-loader"}


def missing() -> list[str]:
    """The recipe's host packages this Python cannot import."""
    return [dist for mod, dist in NEEDS.items() if importlib.util.find_spec(mod) is None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="a few steps: a smoke run")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("overrides", nargs="*", help="coreshell train overrides")
    args = parser.parse_args()
    if gone := missing():
        raise SystemExit(
            f"tpu_speech: not run: this machine lacks {', '.join(gone)} (the speech recipe's "
            "host stack). On a TPU VM with a registry: pip install -e '.[tpu]' (torch 2.9.1 "
            "and torchaudio 2.9.1 CPU builds beside jax[tpu])."
        )
    import jax

    work = Path(tempfile.mkdtemp(prefix="tpu_speech_"))
    # the dry run: 4 steps on the small set the suite's speech tests build (4 voices, 1 take:
    # 40 clips in all, not 5,760) and one DataLoader worker per loader (3 spawned processes,
    # not 6): every part of the run still goes through (workers, test, predict, export)
    steps = ["trainer.max_steps=4", *DRY_DATA] if args.dry_run else []
    cmd = [
        sys.executable, "-m", "torchshell.app.cli", "train", "data.front_end=device",
        f"tracking.uri=sqlite:///{work / 'mlflow.db'}", f"hydra.run.dir={work / 'run'}",
        *steps, *args.overrides,
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
    accuracy = re.search(r"test[/_]acc\w*=([\d.]+)", proc.stdout)  # the end summary's metrics
    parity = re.search(r"parity max abs diff ([\d.e+-]+)", proc.stdout)
    device = jax.devices()[0].device_kind
    label = f"tpu speech recipe, coreshell train data.front_end=device on {device}"
    rows = [
        _stats.row(label, "fit wall time (train, test, export)", "s", [wall]),
        _stats.row(
            label, "test accuracy", "fraction", [float(accuracy.group(1))] if accuracy else []
        ),
        _stats.row(
            label,
            "exported torch weights vs JAX params (target <= 1e-5)",
            "max abs diff",
            [float(parity.group(1))] if parity else [],
        ),
    ]
    print(_stats.markdown(rows))
    if args.json:
        _stats.write_rows(args.json, rows, _stats.machine())


if __name__ == "__main__":
    main()
