"""The real `coreshell train` command on tiny configs, each into a temporary MLflow store."""

import re
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import CLI, run_all, run_ok
from tests.torchshell.test_tracking_ui import sections
from torchshell._errors import ConfigError
from torchshell.app.export_cli import export_command
from torchshell.twins.digits import MLP as TwinMLP

ROOT = Path(__file__).resolve().parents[2]


def _train(tmp: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """Runs `coreshell train` in ``tmp`` (store ``tmp/mlflow.db``, run dir ``tmp/run``)."""
    cmd = [
        sys.executable,
        "-m",
        "torchshell.app.cli",
        "train",
        "trainer.enable_progress_bar=false",
        f"tracking.uri=sqlite:///{tmp}/mlflow.db",
        f"hydra.run.dir={tmp}/run",
        *overrides,
    ]
    return run_ok(cmd, tmp)


def _run(tmp: Path, experiment: str) -> tuple[mlflow.MlflowClient, object]:
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One real `coreshell train` of the digits recipe, asserted on by the two tests below
    (one training run instead of two): its directory and stdout."""
    tmp = tmp_path_factory.mktemp("digits_run")
    proc = _train(
        tmp,
        "data=digits",
        "model=digits",
        "trainer.max_steps=300",
        "trainer.log_every_n_steps=10",
        "tracking.experiment=smoke",
    )
    return tmp, proc.stdout


def test_coreshell_train_end_to_end(digits_run: tuple[Path, str]):
    tmp_path, stdout = digits_run
    assert "mlflow ui --backend-store-uri" in stdout

    client, run = _run(tmp_path, "smoke")
    losses = [m.value for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert len(losses) >= 10 and losses[-1] < losses[0] / 3
    assert run.data.metrics["val/accuracy"] > 0.9
    assert run.data.metrics["system/coreshell.export.parity_max_abs_diff"] < 1e-5
    assert run.data.params["optim.name"] == "adamw"

    local = client.download_artifacts(run.info.run_id, "export", str(tmp_path / "dl"))
    twin = TwinMLP()
    twin.load_state_dict(load_file(Path(local) / "model.safetensors"), strict=True)
    assert not (tmp_path / "outputs").exists()
    # the run directory itself is what `coreshell export RUN_DIR` (README) reads
    export_command([str(tmp_path / "run"), "--format", "torch"])
    assert (tmp_path / "run" / "export" / "model.pt").is_file()


def test_run_page_has_what_deployment_needs(digits_run: tuple[Path, str], monkeypatch):
    """Model summary, HLO, confusion matrix and a servable MLflow model reproduce the run."""
    tmp_path, _ = digits_run
    client, run = _run(tmp_path, "smoke")
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "model_summary.txt", "hlo", "plots", "export"} <= names
    assert run.data.tags["versions.jax"] and run.data.tags["mesh.shape"]
    assert any(k.startswith("system/coreshell.compile.") for k in run.data.metrics)  # 3728e52
    # MLflow's run page opens on the run's own metrics; coreshell's are in System metrics
    assert [name for name, _ in sections(run.data.metrics)] == [
        "test",
        "train",
        "val",
        "Model metrics",
    ]

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    model = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
    assert np.asarray(model(torch.zeros(3, 64)).detach()).shape == (3, 10)


def test_train_a_torch_module_from_the_config(tmp_path: Path):
    """model=torch_mlp: the nn.Module is traced by torchax; export is its own state_dict."""
    proc = _train(
        tmp_path, "data=digits", "model=torch_mlp", "trainer.max_steps=60", "ckpt.every_n_steps=0"
    )
    net = TwinMLP()
    net.load_state_dict(load_file(tmp_path / "run" / "export" / "model.safetensors"), strict=True)
    assert "parity max abs diff" in proc.stdout


def test_recipes_compose():
    """recipe=NAME picks data and model; data=NAME alone brings its model and its training
    length; a pair of two recipes is refused naming both and the fix."""
    from torchshell.app.config import compose_config, typed

    for choice, data, model, steps, schedule in [
        (["recipe=digits"], "DigitsDataModule", "digits.MLP", 600, "constant"),
        (["recipe=spoken_digits"], "SpokenDigitsDataModule", "SpokenDigitsEncoder", 1000, "cosine"),
        (["data=digits"], "DigitsDataModule", "digits.MLP", 600, "constant"),
        ([], "SpokenDigitsDataModule", "SpokenDigitsEncoder", 1000, "cosine"),
        (["trainer.max_steps=50"], "SpokenDigitsDataModule", "SpokenDigitsEncoder", 50, "cosine"),
        (["trainer=default"], "SpokenDigitsDataModule", "SpokenDigitsEncoder", 600, "constant"),
    ]:
        cfg = typed(compose_config(choice))
        assert cfg.data["_target_"].endswith(data) and cfg.model.flax["_target_"].endswith(model)
        # the training length and schedule follow the data too; the cosine spans the steps
        assert (cfg.trainer.max_steps, cfg.optim.schedule) == (steps, schedule)
        assert cfg.optim.total_steps == (steps if schedule == "cosine" else 0)
    with pytest.raises(ConfigError, match=r"data=digits and model=spoken_digits .* recipe=digits"):
        typed(compose_config(["data=digits", "model=spoken_digits"]))


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Use it", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_every_readme_train_command_composes_and_passes_the_checks(tmp_path: Path):
    """Each `coreshell train` line of the README gives a config train accepts (the checks
    of prepare_run); `--cfg job` runs for real. Training itself: the tests above."""
    from torchshell.app.config import compose_config, typed
    from torchshell.app.launch import child_commands

    commands = _readme_commands()
    trains = [c.split()[2:] for c in commands if c.startswith(".venv/bin/coreshell train")]
    assert len(trains) >= 8
    for args in trains:
        overrides = [a for a in args if a not in ("--cfg", "job", "-m")]
        sweeps = [o for o in overrides if "," in o] if "-m" in args else []
        for value in sweeps[0].split("=", 1)[1].split(",") if sweeps else [None]:
            job = [o for o in overrides if o not in sweeps]
            job += [f"{sweeps[0].split('=')[0]}={value}"] if value else []
            typed(compose_config(job)).check()
    launch = next(c for c in commands if " launch " in c).split("-- ", 1)[1].split()
    assert "dist.process_id=1" in child_commands(launch, 2, 1234)[1]
    make = next(c for c in commands if c.startswith("make run"))
    typed(compose_config(make.split('"')[1].split())).check()
    proc = run_ok([*CLI, "train", "--cfg", "job"], tmp_path)
    assert "_target_: torchshell.data.spoken_digits.SpokenDigitsDataModule" in proc.stdout


NOISE = re.compile(
    r"(?i)warning|^[WE]\d{4} |\bINFO\b|terminate called|Aborted|core dumped|Traceback"
)


@pytest.mark.timeout(1500)  # the real default recipe: minutes on 2 shared cores
def test_a_default_train_is_quiet_and_truthful(tmp_path: Path, capsys):
    """`coreshell train` at the defaults (the spoken-digits recipe), a few steps, as a user's
    shell runs it (no test device count, Python's default warnings): the config line, the
    param table, one progress bar, the end summary, and nothing else. Then the README's
    `coreshell export RUN_DIR --format onnx` on that run."""
    cmd = [*CLI, "train", "trainer.max_steps=4", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
    (proc,) = run_all([[*cmd, f"hydra.run.dir={tmp_path}/run"]], tmp_path, timeout=1400)
    out = proc.stdout.replace("\r", "\n")
    lines = [line for line in (out + "\n" + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [line for line in lines if NOISE.search(line)] == []
    assert out.lstrip().startswith("coreshell train: spoken_digits (SpokenDigitsDataModule,")
    table = out.split("sharding", 1)[1].split("total", 1)[0]
    assert "replicated" in table and "()" not in table
    bars = [line for line in lines if line.startswith("train steps")]
    assert bars and all("/4 " in bar for bar in bars) and "4/4" in bars[-1]
    assert "Epoch" not in out and "v_num" not in out
    assert "MLflow run " in out and "parity max abs diff" in out and "compile cache" in out
    capsys.readouterr()  # the export runs in this process (the CLI's dispatch: test_export)
    export_command([str(tmp_path / "run"), "--format", "onnx"])
    exported = capsys.readouterr().out
    assert "wrote" in exported and "onnxruntime vs torch" in exported
