"""Shared test helpers."""

import os
import subprocess
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
