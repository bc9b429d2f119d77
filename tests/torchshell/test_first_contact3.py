"""Issue #54, first contact round three: each run owns its checkpoints, runs are named by
what ran, config errors in coreshell's own voice (through the real CLI, tiny digits runs)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml

from benchmarks._runs import cli_module, quiet_env
from tests.helpers import run_cli_forked
from torchshell.checkpoint._files import write_manifest

TINY = [
    "data=digits",
    "model.flax.features=[16]",
    "trainer.max_steps=20",
    "ckpt.every_n_steps=10",
    "trainer.enable_progress_bar=false",
    "trainer.check_val_every_n_epoch=100",
    "test_after_fit=false",
    "tracking.system_metrics_interval_s=null",
]


def _train(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", cli_module(), "train", *args]
    return subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=quiet_env(smoke=True)
    )


def _runs(tmp: Path) -> list[str]:
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
    exp = client.get_experiment_by_name("coreshell")
    return [] if exp is None else [r.info.run_name for r in client.search_runs([exp.experiment_id])]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A two-job sweep of the tiny digits recipe in a fresh folder, default checkpoint places."""
    tmp = tmp_path_factory.mktemp("contact3")
    proc = _train(tmp, "-m", *TINY, "optim.lr=0.003,0.01", "hydra.sweep.dir=multirun/sweep")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, proc.stdout


def test_each_run_owns_its_checkpoints_and_runs_are_named_by_what_ran(sweep):
    tmp, out = sweep
    runs = sorted((tmp / "checkpoints" / "digits-mlp").iterdir())
    assert [r.name for r in runs] == ["multirun_sweep_0", "multirun_sweep_1"]
    for run in runs:  # keep=2 per run: both of its checkpoints, none of the other job's
        assert sorted(p.name for p in run.iterdir()) == [
            "epoch=0-step=10.ckpt",
            "epoch=1-step=20.ckpt",
        ]
    # optim.lr=0.003 is the digits default: only the other job names it
    names = sorted(_runs(tmp))
    same = "digits-mlp model.flax.features=[16] trainer.max_steps=20"
    same += " trainer.check_val_every_n_epoch=100"
    assert names == [same, f"{same} optim.lr=0.01"]
    for name in names:
        assert f"MLflow run '{name}' (" in out


def test_resume_at_max_steps_says_so_and_opens_no_run(sweep):
    tmp, _ = sweep
    before = len(_runs(tmp))
    proc = _train(tmp, *TINY, "resume=last", "hydra.run.dir=outputs/again")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "already at step 20" in line]
    assert len(lines) == 1 and "trainer.max_steps=40" in lines[0], proc.stdout
    assert "digits-mlp/multirun_sweep_" in lines[0]
    assert len(_runs(tmp)) == before  # no empty MLflow run


def test_a_checkpoint_of_another_model_is_refused_before_loading(sweep, tmp_path: Path):
    tmp, _ = sweep
    shared = tmp / "checkpoints" / "digits-mlp" / "multirun_sweep_1"
    wider = [a.replace("[16]", "[24]") for a in TINY]
    # the case: a spoken-digits checkpoint (its config.yaml says so) under digits
    speech = tmp_path / "speech" / "epoch=21-step=1000.ckpt"
    shutil.copytree(shared / "epoch=1-step=20.ckpt", speech)
    saved = yaml.safe_load((speech / "config.yaml").read_text())
    saved["model"]["recipe"] = "spoken_digits"
    saved["model"]["flax"] = {"_target_": "jaxcore.models.spoken_digits.Encoder", "dim": 64}
    (speech / "config.yaml").write_text(yaml.safe_dump(saved))
    write_manifest(speech)
    cmds = [
        (tmp, ["train", *wider, "resume=last", f"ckpt.dir={shared}"]),
        (tmp, ["train", *wider, f"resume='{shared}/epoch=1-step=20.ckpt'"]),
        (tmp, ["train", *TINY, "recipe=digits", f"resume='{speech}'"]),
    ]
    wider_said = "holds digits MLP (features=[16]); this run trains digits MLP (features=[24])"
    said = [wider_said, wider_said, "holds spoken_digits Encoder; this run trains digits MLP"]
    procs = run_cli_forked(cmds, tmp_path / "forked", env=quiet_env())
    for proc, needle in zip(procs, said, strict=True):
        text = proc.stdout + proc.stderr
        assert proc.returncode == 2, text[-3000:]
        assert "Traceback" not in text and "Nothing was loaded" in text, text[-3000:]
        assert needle in text, text[-3000:]


def test_an_unknown_key_is_refused_with_the_keys_and_never_advises_plus(tmp_path: Path):
    cases = [
        (
            ["optim.lrr=1"],
            ["optim.lrr is not a config key", "Did you mean optim.lr?", "Fix: optim.lr=1."],
        ),
        (["+optim.lrr=1"], ["+optim.lrr is not a config key: no schema reads it", "optim.lr=1"]),
        (["+foo=1"], ["+foo is not a config key", "The keys of the config: ckpt, data"]),
        (["trainer.max_stepz=5"], ["Did you mean trainer.max_steps?", "log_every_n_steps"]),
    ]
    cmds = [(tmp_path, ["train", "data=digits", *argv]) for argv, _ in cases]
    cases.append((["+optim.lrr=1"], ["coreshell doctor: ConfigError", "Did you mean optim.lr?"]))
    cmds.append((tmp_path, ["doctor", "data=digits", "+optim.lrr=1"]))  # doctor refuses it too
    for (argv, needles), proc in zip(cases, run_cli_forked(cmds, tmp_path / "forked"), strict=True):
        text = proc.stdout + proc.stderr
        assert proc.returncode == 2, (argv, text[-2000:])
        assert "Traceback" not in text and "To append" not in text, (argv, text)
        assert all(n in text for n in needles), (argv, text)
    assert not (tmp_path / "mlflow.db").exists()
