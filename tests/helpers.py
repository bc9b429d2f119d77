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
        try:
            for cmd, proc in batch:
                out, err = proc.communicate(timeout=timeout)
                done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
        finally:  # (a timeout, an interrupt: the test stops what it started)
            for _, proc in batch:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
    return done


# One interpreter pays the imports every `coreshell` command needs (~18 s of CPU on this
# machine), then forks one child per command: each child is a fresh `python -m
# torchshell.app.cli ARGV` from the moment `main()` runs (JAX's backends are not started in the
# parent, so the child's device split, Hydra, logging and warnings are its own).
_FORKED_CLI = r"""
import json, os, sys, traceback
cmds, out_dir, parallel = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
import torch, jax, lightning, mlflow, hydra
import torchshell.app.config, torchshell.app.doctor, torchshell.app.export_cli
import torchshell.app.failures, torchshell.app.quiet, torchshell.app.train
from jax._src import xla_bridge
assert not xla_bridge.backends_are_initialized()
import torchshell.app.cli as cli

def child(i, cwd, argv):
    os.chdir(cwd)
    for fd, ext in ((1, "out"), (2, "err")):
        os.dup2(os.open(f"{out_dir}/{i}.{ext}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = [cli.__file__, *argv]
    try:
        cli.main()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (stop.code is not None)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

codes, running = {}, {}
for i, (cwd, argv) in enumerate(cmds):
    while len(running) >= parallel:
        pid, status = os.wait()
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        child(i, cwd, argv)
    running[pid] = i
while running:
    pid, status = os.wait()
    codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
print(json.dumps([codes[i] for i in range(len(cmds))]))
"""


def run_cli_forked(
    cmds: Sequence[tuple[Path, Sequence[str]]],
    out_dir: Path,
    *,
    env: dict[str, str] | None = None,
    parallel: int = 2,
    timeout: int = 900,
) -> list[subprocess.CompletedProcess[str]]:
    """Runs ``coreshell ARGV`` for each ``(cwd, argv)`` as :func:`run_all` would (a user's
    environment unless ``env``), but in forked children of one interpreter that imported the
    libraries once: for commands that stop early (refusals, checks), where start-up is most
    of the cost. Each child's stdout, stderr and exit status are its own."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    payload = json.dumps([[str(cwd), list(argv)] for cwd, argv in cmds])
    driver = subprocess.run(
        [sys.executable, "-c", _FORKED_CLI, payload, str(out_dir), str(parallel)],
        cwd=out_dir,
        env=user_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert driver.returncode == 0, driver.stderr[-4000:]
    codes = json.loads(driver.stdout.strip().splitlines()[-1])
    return [
        subprocess.CompletedProcess(
            [*CLI, *argv],
            code,
            (out_dir / f"{i}.out").read_text(),
            (out_dir / f"{i}.err").read_text(),
        )
        for i, ((_, argv), code) in enumerate(zip(cmds, codes, strict=True))
    ]


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
