"""Shared test helpers."""

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L


def quiet_env() -> dict[str, str]:
    """This process's environment (read now) with Python warnings off, for a child."""
    return {**os.environ, "PYTHONWARNINGS": "ignore"}


def run_ok(cmd: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """Runs ``cmd`` in ``cwd`` (Python warnings off) and asserts it exits 0."""
    proc = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=quiet_env()
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


CLI = [sys.executable, "-m", "torchshell.app.cli"]


def user_env() -> dict[str, str]:
    """The environment a user's shell gives ``coreshell``: no test-only device count (the
    CLI splits the CPU itself), Python's default warnings; the compile cache stays in the
    tests' temporary directory (conftest.py)."""
    return {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONWARNINGS")}


def run_all(
    cmds: Sequence[Sequence[str]],
    cwd: Path,
    *,
    env: dict[str, str] | None = None,
    parallel: int = 4,
    timeout: int = 600,
) -> list[subprocess.CompletedProcess[str]]:
    """Runs the commands, ``parallel`` at a time (most of each is Python's imports), in order."""
    env = user_env() if env is None else env
    done: list[subprocess.CompletedProcess[str]] = []
    for start in range(0, len(cmds), parallel):
        batch = [
            (
                list(cmd),
                subprocess.Popen(
                    list(cmd),
                    cwd=cwd,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            )
            for cmd in cmds[start : start + parallel]
        ]
        for cmd, proc in batch:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    return done


def quiet_trainer(**kwargs: Any) -> L.Trainer:
    """The real ``lightning.Trainer`` on one CPU process, without files or console output."""
    return L.Trainer(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        **kwargs,
    )


def fit_plain_and_ported(
    make: Callable[[], L.LightningModule], tmp_path: Path, *loaders: Any, **flags: Any
) -> dict[str, tuple[L.Trainer, L.LightningModule]]:
    """Fits ``make()`` in plain Lightning and through ``JaxModule.from_lightning`` on the same
    loaders (each module built after ``torch.manual_seed(0)``; ``max_epochs=2`` unless other
    flags are given): ``{"plain"|"jax": (trainer, the module fit)}``."""
    import torch

    from torchshell import JaxModule

    runs = {}
    for mode in ("plain", "jax"):
        torch.manual_seed(0)
        user = make()
        module = user if mode == "plain" else JaxModule.from_lightning(user, print_summary=False)
        trainer = quiet_trainer(default_root_dir=tmp_path / mode, **(flags or {"max_epochs": 2}))
        trainer.fit(module, *loaders)
        runs[mode] = (trainer, module)
    return runs


def assert_fit_like_plain(
    runs: dict[str, tuple[L.Trainer, L.LightningModule]], rtol: float, atol: float
) -> None:
    """The ported run's weights and ``callback_metrics`` equal the plain run's."""
    import torch

    plain, ported = runs["plain"][1].state_dict(), runs["jax"][1].torch_state_dict()
    for name, w in plain.items():
        torch.testing.assert_close(ported[name], w, rtol=rtol, atol=atol, msg=name)
    want, got = runs["plain"][0].callback_metrics, runs["jax"][0].callback_metrics
    assert set(got) == set(want)
    for name, v in want.items():
        torch.testing.assert_close(got[name], v, rtol=rtol, atol=atol, msg=name)
