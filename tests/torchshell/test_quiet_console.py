"""The console of a run long enough for periodic asynchronous Orbax saves, on a first run
(a fresh matplotlib cache): quiet by default, every library message with ``--verbose``."""

import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import CLI, user_env

# what the libraries say at INFO: Orbax through absl (its async save thread too), matplotlib
# building its font cache, and anything else logged at INFO through Hydra's job logging
LIBRARY_INFO = re.compile(r"\]\[(absl|orbax[\w.]*|matplotlib[\w.]*)\]\[INFO\]|\]\[INFO\] - ")
NOISE = re.compile(r"(?i)warning|\bINFO\b|Traceback")


@pytest.mark.timeout(900)  # two tiny runs side by side, mostly imports: minutes on 2 shared cores
def test_periodic_async_checkpoints_and_a_first_run_keep_the_console_quiet(tmp_path: Path):
    runs = {}
    for mode in ("quiet", "verbose"):
        (tmp_path / mode).mkdir()
        runs[mode] = [
            *CLI,
            *(["--verbose"] if mode == "verbose" else []),
            "train",
            "recipe=digits",
            "trainer.max_steps=24",
            "ckpt.every_n_steps=6",  # 4 periodic async saves, each ~30 absl INFO lines before
            "test_after_fit=false",
            f"tracking.uri=sqlite:///{tmp_path / mode}/mlflow.db",
            f"hydra.run.dir={tmp_path / mode}/run",
            f"ckpt.dir={tmp_path / mode}/checkpoints",
        ]
    started = {
        mode: subprocess.Popen(
            cmd,
            cwd=tmp_path / mode,
            env={**user_env(), "MPLCONFIGDIR": str(tmp_path / mode / "mpl")},  # a first run
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for mode, cmd in runs.items()
    }
    procs = {}
    for mode, popen in started.items():
        out, err = popen.communicate(timeout=840)
        procs[mode] = subprocess.CompletedProcess(runs[mode], popen.returncode, out, err)
    for mode, proc in procs.items():
        assert proc.returncode == 0, f"{mode}: {proc.stderr[-4000:]}"
        assert sorted(p.name for p in (tmp_path / mode / "checkpoints").iterdir()), mode

    quiet = procs["quiet"]
    out = quiet.stdout.replace("\r", "\n")
    lines = [line for line in (out + "\n" + quiet.stderr).splitlines() if line.strip()]
    assert [line for line in lines if NOISE.search(line)] == []
    assert out.lstrip().startswith("coreshell train: digits (DigitsDataModule, Flax MLP)")
    assert "MLflow run " in out and "parity max abs diff" in out

    loud = procs["verbose"].stdout + procs["verbose"].stderr
    assert re.search(r"\]\[absl\]\[INFO\] - .*\[thread=async_save\]", loud), loud[-4000:]
    assert "generated new fontManager" in loud
    assert len(LIBRARY_INFO.findall(loud)) > 20
