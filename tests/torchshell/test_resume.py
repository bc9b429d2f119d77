"""Checkpoints under the real CLI: SIGKILL+resume bit-exact, SIGTERM saves, damage skipped."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from benchmarks._runs import (
    cli_module,
    losses,
    run_ok,
    same_weights,
    start_and_wait_for_checkpoint,
    train_cmd,
)
from tests.helpers import run_cli_forked
from torchshell.checkpoint import latest_checkpoint, verify

STEPS = 120
COMMON = [
    "data=digits",
    "model=digits",
    f"trainer.max_steps={STEPS}",
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=10",
    "trainer.check_val_every_n_epoch=100",
    "ckpt.every_n_steps=20",
    "ckpt.keep=3",
    "test_after_fit=false",
    "model.flax.features=[64]",
]


def _cmd(tmp: Path, name: str, *extra: str) -> list[str]:
    return train_cmd(tmp, name, *COMMON, *extra)


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted STEPS-step run (checkpoints every 20 steps, the last 3 kept): the
    reference of the SIGKILL test and the checkpoints the damage test copies and damages."""
    tmp = tmp_path_factory.mktemp("full")
    run_ok(_cmd(tmp, "full", f"ckpt.dir={tmp}/ck_full"), tmp)
    return tmp


def test_sigkill_then_resume_is_bit_identical(tmp_path: Path, full: Path):
    ckpt = tmp_path / "ck_kill"
    proc = start_and_wait_for_checkpoint(
        _cmd(tmp_path, "killed", f"ckpt.dir={ckpt}"), tmp_path, ckpt, random.uniform(0.0, 1.0)
    )
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    resumed_from = latest_checkpoint(ckpt)
    assert resumed_from is not None
    run_ok(_cmd(tmp_path, "resumed", f"ckpt.dir={ckpt}", "resume=last"), tmp_path)
    step = int(resumed_from.name.split("step=")[1].removesuffix(".ckpt"))
    # (killed after its last checkpoint, at max_steps: the resume says so and trains nothing,
    # issue #54; the weights are the checkpoint's own export)
    exported = resumed_from if step == STEPS else tmp_path / "resumed"
    assert same_weights(
        full / "full" / "export" / "model.safetensors", exported / "export" / "model.safetensors"
    )
    # The loss history after the checkpoint is the uninterrupted run's, exactly (none when
    # the kill came after the last checkpoint, at the end of the run: nothing was left).
    full_losses, resumed_losses = losses(full, "full"), losses(tmp_path, "resumed")
    assert all(full_losses[s] == v for s, v in resumed_losses.items())
    assert bool(resumed_losses) == (step < STEPS), (resumed_from.name, resumed_losses)
    # Every checkpoint carries the torch export and the config, so it loads without JAX.
    for path in ckpt.iterdir():
        if path.name.endswith(".ckpt"):
            assert (path / "export" / "model.safetensors").is_file()
            assert (path / "config.yaml").is_file()


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path: Path):
    ckpt = tmp_path / "ck"
    proc = start_and_wait_for_checkpoint(
        _cmd(tmp_path, "term", f"ckpt.dir={ckpt}"), tmp_path, ckpt, 0.2
    )
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "SIGTERM received; saved checkpoint" in out
    saved = latest_checkpoint(ckpt)
    assert saved is not None and verify(saved) is None


def test_damaged_checkpoints_are_skipped_with_a_message(tmp_path: Path, full: Path):
    shutil.copytree(full / "ck_full", tmp_path / "ck")  # the full run's last 3, damaged here
    newest = latest_checkpoint(tmp_path / "ck")
    assert newest is not None and newest.name.endswith(f"step={STEPS}.ckpt")
    (newest / "lightning.pt").write_bytes(b"torn")
    (tmp_path / "ck" / ".tmp-epoch=9-step=999.ckpt-abc").mkdir()  # an interrupted write
    messages: list[str] = []
    fallback = latest_checkpoint(tmp_path / "ck", log=messages.append)
    assert fallback is not None and fallback.name.endswith(f"step={STEPS - 20}.ckpt")
    assert "checksum mismatch" in messages[0] and f"step={STEPS}" in messages[0]
    proc = subprocess.run(
        _cmd(tmp_path, "damage2", f"ckpt.dir={tmp_path}/ck", f"resume='{newest}'"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and "not an intact checkpoint" in proc.stderr


def test_bad_config_fails_before_any_work(tmp_path: Path):
    cases = [("trainer.max_steps=abc", "max_steps"), ("optim.lrr=1", "lrr")]
    for i in range(len(cases)):  # each in its own directory
        (tmp_path / str(i)).mkdir()
    procs = run_cli_forked(
        [(tmp_path / str(i), ["train", override]) for i, (override, _) in enumerate(cases)],
        tmp_path / "forked",
        env=dict(os.environ),
    )
    for i, ((override, needle), proc) in enumerate(zip(cases, procs, strict=True)):
        assert proc.returncode != 0 and needle in proc.stderr, (override, proc.stderr[-2000:])
        assert not (tmp_path / str(i) / "mlflow.db").exists(), override


def test_multirun_gives_one_mlflow_run_per_job(tmp_path: Path):
    cmd = [
        sys.executable,
        "-m",
        cli_module(),
        "train",
        "-m",
        "data=digits",
        "model=digits",
        "optim.lr=1e-3,3e-3",
        "trainer.max_steps=20",
        "trainer.enable_progress_bar=false",
        "test_after_fit=false",
        "ckpt.every_n_steps=0",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        "tracking.experiment=sweep",
        f"hydra.sweep.dir={tmp_path}/multirun",
    ]
    run_ok(cmd, tmp_path)
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("sweep").experiment_id])
    assert sorted(r.data.params["optim.lr"] for r in runs) == ["0.001", "0.003"]
