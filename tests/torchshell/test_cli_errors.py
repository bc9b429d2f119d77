"""Errors without tracebacks: the bad inputs of docs/reliability.md through the real CLI,
and ``coreshell doctor`` refusing what ``coreshell train`` refuses, on the same mesh. Each
command is its own process (forked from one that imported the libraries once)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import jaxcore
from tests.helpers import run_cli_forked, user_env
from torchshell.app.cli import guarded

DIGITS = ["data=digits", "tracking.system_metrics_interval_s=null"]

# (reliability.md row, argv, exit code, what the one block must say)
BAD_INPUTS = [
    ("14 mesh", ["train", *DIGITS, "mesh.axes.data=3"], 2, ["MeshError", "need 3 devices"]),
    ("17 unknown key", ["train", *DIGITS, "optim.lrr=1"], 2, ["optim.lrr"]),
    (
        "11 empty training split",
        ["train", *DIGITS, "data.val_fraction=0.5", "data.test_fraction=0.5"],
        2,
        ["ConfigError", "leave 1 training rows"],
    ),
    ("22 damaged resume path", ["train", *DIGITS, "resume=nope"], 1, ["CheckpointError"]),
    ("34 cpu_devices", ["train", *DIGITS, "mesh.cpu_devices=zero"], 2, ["cpu_devices must"]),
    (
        "35 recipe mismatch",
        ["train", "data=digits", "model=spoken_digits"],
        2,
        ["data=digits and model=spoken_digits", "recipe=digits"],
    ),
    (
        "75 a data module that does not take the recipe's fields",
        ["train", *DIGITS, "data._target_=lightning.pytorch.demos.boring_classes.BoringDataModule"],
        2,
        ["does not take ['batch_size', 'eval_batch_size'", "~data.val_fraction", "Fix:"],
    ),
    (
        "36 unknown loss",
        ["train", *DIGITS, "model.loss=masked_mean"],
        2,
        ["['softmax_cross_entropy']"],
    ),
]


def test_bad_inputs_through_the_cli_are_one_block_without_traceback(tmp_path: Path):
    cmds = [(tmp_path, [*argv, f"hydra.run.dir={tmp_path}/run"]) for _, argv, _, _ in BAD_INPUTS]
    (tmp_path / "export").mkdir()
    cases = [*BAD_INPUTS, ("export of no run", [], 2, ["does not exist", "Fix:"])]
    cmds.append((tmp_path / "export", ["export", "no-such-dir", "--format", "onnx"]))
    procs = run_cli_forked(cmds, tmp_path / "forked")
    assert not (tmp_path / "export" / "mlflow.db").exists()  # a typo creates no store
    for (row, _, code, needles), proc in zip(cases, procs, strict=True):
        text = proc.stdout + proc.stderr
        assert proc.returncode == code, (row, text[-3000:])
        assert "Traceback" not in text, (row, text[-3000:])
        assert "Fix" in text or "To append" in text or "HYDRA_FULL_ERROR" in text, row
        for needle in needles:
            assert needle in proc.stderr, (row, needle, proc.stderr[-2000:])


def test_a_real_bug_keeps_its_traceback_and_ours_become_exit_codes():
    def bug() -> None:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):  # not ours: it propagates as it is
        guarded("train", bug)

    def bad_mesh() -> None:
        raise jaxcore.MeshError("Mesh axes need 3 devices. Fix: ...")

    with pytest.raises(SystemExit) as exit_:
        guarded("train", bad_mesh)
    assert exit_.value.code == 2


def test_doctor_and_train_agree_on_the_mesh_and_on_refused_configs(tmp_path: Path):
    """Both go through prepare_run: the same CPU device split (one per core here, not the
    test's 8 fake devices) and the same refusals with the same message."""
    cores = len(os.sched_getaffinity(0))
    configs = [
        ["step.steps_per_call=8", "trainer.max_steps=20"],
        ["model=spoken_digits"],
        ["mesh.axes.data=3"],
    ]
    base = [*DIGITS, f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"ckpt.dir={tmp_path}/ck"]
    cmds = []
    for extra in configs:
        cmds.append((tmp_path, ["train", *base, *extra, f"hydra.run.dir={tmp_path}/run"]))
        cmds.append((tmp_path, ["doctor", *base, *extra]))
    cmds.append((tmp_path, ["doctor", *base]))
    wide = user_env() | {"COLUMNS": "400"}  # doctor's table on one line per check
    *pairs, fine = run_cli_forked(cmds, tmp_path / "forked", env=wide)
    for extra, train, doctor in zip(configs, pairs[::2], pairs[1::2], strict=True):
        assert train.returncode != 0 and doctor.returncode != 0, extra
        assert "Traceback" not in train.stderr + doctor.stderr, extra
        if extra[0].startswith("mesh"):  # doctor reports it in its table, train refuses
            assert f"but {cores} are available" in train.stderr, train.stderr[-2000:]
            assert f"but {cores} are available" in doctor.stdout, doctor.stdout[-3000:]
        else:
            assert train.returncode == doctor.returncode == 2
            message = train.stderr.split("\n", 1)[1].strip()
            assert message and message in doctor.stderr, (train.stderr, doctor.stderr)
    assert fine.returncode == 0, fine.stdout[-3000:] + fine.stderr[-3000:]
    assert f"-> {{'data': {cores}, 'model': 1}}" in fine.stdout
