"""Running the real ``coreshell train`` in a child process: the command, a run that is
watched and killed, its MLflow loss history, its exported weights.

Shared by ``kill_campaign.py``, ``checkpoint_cost.py``, ``outage_soak.py``,
``tests/torchshell/test_resume.py`` and ``tests/torchshell/test_serve.py``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file


def cli_module() -> str:
    """The module ``coreshell`` runs: the installed console script's, else the app's."""
    names = []
    for ep in importlib.metadata.entry_points(group="console_scripts", name="coreshell"):
        names.append(ep.value.partition(":")[0])
    names += ["torchshell.app.cli", "torchshell.cli"]
    for name in names:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except ModuleNotFoundError:
            continue
    raise RuntimeError(f"no coreshell CLI module found among {names}")


# XLA's CPU backend unoptimised, for smoke runs whose figures mean nothing (benchmarks/run.py
# --tiny and gpu.sh --dry-run set the same flags): a cold compile takes less CPU (the tiny
# spoken-digits train of tests/torchshell/test_serve.py: 39-42 -> 32-34 s of CPU in all),
# the steps run a little slower. A run that hits the compile cache gains nothing.
SMOKE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def quiet_env(smoke: bool = False) -> dict[str, str]:
    """This process's environment with Python warnings off, for a child; with ``smoke``,
    XLA's CPU backend unoptimised (:data:`SMOKE_XLA_FLAGS`)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if smoke:
        env["XLA_FLAGS"] = with_flags(env.get("XLA_FLAGS", ""), SMOKE_XLA_FLAGS)
    return env


def with_flags(flags: str, more: str) -> str:
    """``flags`` with those of ``more`` it lacks appended, each once: JAX's persistent
    compilation cache keys on the XLA_FLAGS words (a repeated flag is another key), so a child
    given the smoke flags twice would miss the programs its siblings compiled.

    Example:
        >>> with_flags("--a=1 --b", "--b --c")
        '--a=1 --b --c'
    """
    return " ".join(dict.fromkeys(f"{flags} {more}".split()))


def train_cmd(tmp: Path, name: str, *overrides: str, prefix: list[str] | None = None) -> list[str]:
    """``coreshell train`` with its MLflow store and run directory under ``tmp``.

    ``prefix`` replaces ``[python, -m, cli]`` (e.g. ``[python, -c, code]`` for a probe).
    """
    head = prefix if prefix is not None else [sys.executable, "-m", cli_module()]
    return [
        *head,
        "train",
        *overrides,
        f"tracking.uri=sqlite:///{tmp}/mlflow.db",
        f"tracking.experiment={name}",
        f"hydra.run.dir={tmp}/{name}",
    ]


def run_ok(cmd: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    """Runs ``cmd`` and raises with its stderr's tail unless it exits 0."""
    proc = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=quiet_env()
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[:4])} ... exited {proc.returncode}:\n{proc.stderr[-4000:]}"
        )
    return proc


def losses(tmp: Path, experiment: str, metric: str = "train/loss") -> dict[int, float]:
    """``{step: value}`` of ``metric`` over every run of ``experiment`` in ``tmp``'s store."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
    exp = client.get_experiment_by_name(experiment)
    history: dict[int, float] = {}
    if exp is None:
        return history
    for run in client.search_runs([exp.experiment_id]):
        for m in client.get_metric_history(run.info.run_id, metric):
            history[m.step] = m.value
    return history


def weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of an exported ``model.safetensors``."""
    return load_file(path)


def same_weights(a: Path, b: Path) -> bool:
    """Whether two exported ``model.safetensors`` hold bit-identical tensors."""
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def start_and_wait_for_checkpoint(
    cmd: list[str], cwd: Path, ckpt_dir: Path, extra_wait: float, timeout: float = 300
) -> subprocess.Popen[str]:
    """Starts ``cmd``; returns once an intact checkpoint exists in ``ckpt_dir`` (+ a wait)."""
    from torchshell.checkpoint import latest_checkpoint

    proc = subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=quiet_env()
    )
    deadline = time.monotonic() + timeout
    while latest_checkpoint(ckpt_dir, log=lambda _: None) is None:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the run ended before a checkpoint: {proc.communicate()[1][-3000:]}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("no checkpoint appeared")
        time.sleep(0.05)
    time.sleep(extra_wait)
    return proc
