"""Issue #54: the console keeps the README's promise ("one config line, the parameter table,
one progress bar and the end summary") on the README's commands: a short `coreshell train`,
`train resume=last`, `export RUN --format onnx`, a multirun (`-m`), `predict` and `serve`'s
start; and the lines that were extra before (each dropped at its source:
torchshell/app/quiet.py)."""

from __future__ import annotations

import io
import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import CLI, run_cli_forked, user_env
from torchshell.app import launch, quiet

PROMISED = re.compile(
    "|".join(
        [
            r"^coreshell train: ",  # the config line
            r"^JAX params on mesh ",  # the parameter table
            r"^module\s+params\s+bytes\s+sharding$",
            r"^-{64}$",
            r"^\w[\w./]*\s+[\d.,]+( [KMB])?\s+[\d.]+ (B|KiB|MiB|GiB)(\s|$)",
            r"^train steps ",  # the progress bar
            r"^MLflow run '",  # the end summary
            r"^  (metrics|torch weights|open it with|stopped): ",
            r"^  compile cache ",
            r"^wrote \S+ \(onnx, \d+ tensors\)$",  # `coreshell export`
            r"^  onnxruntime vs torch: max abs diff ",
            r"^predict\s.*\d+/\d+",  # `coreshell predict`: its bar (stderr)
            r'^\{"file": ',  # its JSON lines (stdout)
            r"^coreshell predict: \d+ of \d+ files failed$",
        ]
    )
)
SMALL = [
    "data=digits",
    "model.flax.features=[16]",
    "ckpt.every_n_steps=10",
    "trainer.check_val_every_n_epoch=100",
    "tracking.system_metrics_interval_s=null",
]


def _extra(text: str) -> list[str]:
    lines = [line.strip("\n") for line in text.replace("\r", "\n").splitlines()]
    return [line for line in lines if line.strip() and not PROMISED.match(line)]


def test_the_readme_commands_print_only_the_promised_lines(tmp_path: Path):
    """Before: the resumed run added Lightning's 'Restoring states' four times (its handler
    and Hydra's) and 'Checkpoint directory ... exists and is not empty.', and each run the
    finished 'Testing' bar."""
    first = [*SMALL, "trainer.max_steps=20", "hydra.run.dir=runs/first"]
    again = [*SMALL, "trainer.max_steps=30", "resume=last", "hydra.run.dir=runs/again"]
    cmds = [
        (tmp_path, ["train", *first]),
        (tmp_path, ["train", *again]),
        (tmp_path, ["export", "runs/first", "--format", "onnx"]),
    ]
    procs = run_cli_forked(cmds, tmp_path / "forked", parallel=1)
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert _extra(proc.stdout + "\n" + proc.stderr) == [], proc.args
    train, resumed, export = (p.stdout for p in procs)
    assert len(re.findall(r"(?m)^coreshell train: ", train + resumed)) == 2
    assert ", resumes checkpoints/digits-mlp/runs_first/epoch=1-step=20.ckpt" in resumed
    assert "(DigitsDataModule, Flax MLP)" in train and "rules dp (params replicated)" in train
    assert re.search(r"parity max abs diff \S+: ok at fp32, tolerance 1e-04", train)
    assert "open it with: " in train and "wrote runs/first/export/model.onnx" in export
    assert "\n  stopped: max_steps=20 reached\n" in train  # Lightning's line, folded
    assert "\n  stopped: max_steps=30 reached\n" in resumed


def test_lightnings_stop_line_is_folded_into_the_end_summary_and_its_warnings_stay(capsys):
    """Lightning's rank-zero '`Trainer.fit` stopped: `max_steps=20` reached.' was a line of
    its own; in quiet mode it is the end summary's `stopped:` line (taken once), while the
    same logger's other lines still print. Verbose (no configure) keeps Lightning's line."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
    from lightning_utilities.core.rank_zero import log  # (named by the Lightning imported)

    seen: list[str] = []
    catch = logging.Handler()
    catch.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    log.addHandler(catch)
    kept = list(log.filters)
    log.filters[:] = []
    quiet.stopped()  # (a limit an earlier fit of this process folded and nobody took)
    try:
        rank_zero_info("`Trainer.fit` stopped: `max_steps=20` reached.")
        assert seen and quiet.stopped() is None  # not configured: Lightning's own line
        seen.clear()
        quiet.configure(verbose=False)
        rank_zero_info("`Trainer.fit` stopped: `max_steps=20` reached.")
        rank_zero_info("`Trainer.fit` stopped: `max_epochs=3` reached.")
        rank_zero_info("an INFO line of Lightning's that concerns the user")
        with pytest.warns(UserWarning, match="a warning"):
            rank_zero_warn("a warning")
    finally:
        log.removeHandler(catch)
        log.filters[:] = kept
    assert seen == ["an INFO line of Lightning's that concerns the user"], seen
    assert quiet.stopped() == "max_epochs=3" and quiet.stopped() is None


def test_onnx_exports_notes_on_torchvision_ops_are_dropped():
    """torch's ONNX exporter notes 'Missing annotation for parameter' of torchvision's ops
    while building its function table (spoken digits' export printed 4); kept verbose."""
    import torchvision  # noqa: F401  (what brings the annotated-less ops into the table)
    from torch.onnx._internal.exporter._registration import ONNXRegistry

    logger = logging.getLogger("torch.onnx._internal.exporter._schemas")
    seen: list[str] = []
    catch = logging.Handler()
    catch.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(catch)
    kept = list(logger.filters)
    logger.filters[:] = []  # (an earlier test in this process may have quieted it already)
    try:
        ONNXRegistry.from_torchlib()
        loud = [m for m in seen if m.startswith("Missing annotation for parameter")]
        seen.clear()
        quiet.configure(verbose=False)
        ONNXRegistry.from_torchlib()
    finally:
        logger.removeHandler(catch)
        logger.filters[:] = kept
    assert loud and not [m for m in seen if m.startswith("Missing annotation")]


def test_launch_relays_each_rank_without_gloos_connected_notes(monkeypatch):
    monkeypatch.delenv("CORESHELL_VERBOSE", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    note = (
        "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
    )
    short = (
        "[Gloo] Rank 1 is connected to 0 peer ranks. Expected number of connected peer ranks is : 1"
    )
    child = io.BytesIO(f"{note}\ncoreshell train: digits\n{short}\n".encode())
    out = io.StringIO()
    launch._pump(1, child, out, threading.Lock())
    assert out.getvalue().splitlines() == ["[rank 1] coreshell train: digits", f"[rank 1] {short}"]


def test_lightnings_model_summary_gives_way_to_coreshells_table(capsys):
    """The README's library example: Lightning's summary counted the torch parameters (a
    table of 0 params above coreshell's); the module drops it for its run and prints its own."""
    import jax
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelSummary
    from torch.utils.data import DataLoader, TensorDataset

    import jaxcore
    from jaxcore.models.digits import MLP
    from torchshell import JaxModule

    seen: list[str] = []

    class Spy(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            seen.extend(type(c).__name__ for c in trainer.callbacks)

    data = TensorDataset(torch.randn(16, 64), torch.randint(0, 10, (16,)))
    module = JaxModule(
        MLP(features=(8,)),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer(lr=1e-2),
        mesh=jaxcore.make_mesh({"data": 1, "model": 1}, jax.devices()[:1]),
    )
    trainer = L.Trainer(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        accelerator="cpu",
        devices=1,
        callbacks=[Spy()],
    )
    assert any(isinstance(c, ModelSummary) for c in trainer.callbacks)  # Lightning's default
    trainer.fit(module, DataLoader(data, batch_size=8))
    assert "Spy" in seen and not [n for n in seen if "ModelSummary" in n], seen
    assert any(isinstance(c, ModelSummary) for c in trainer.callbacks)  # given back after
    assert "JAX params on mesh {'data': 1, 'model': 1}:" in capsys.readouterr().out


def test_lightnings_rich_bar_under_max_steps_reads_the_epoch_without_a_bogus_total():
    """The README's library example (`L.Trainer(max_steps=300)`): Lightning's Rich bar read
    `Epoch 15/-2` (max_epochs=-1 less one); during the module's run it reads `Epoch 15`, and
    the bar is Lightning's own again after."""
    import jax
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import RichProgressBar
    from torch.utils.data import DataLoader, TensorDataset

    import jaxcore
    from jaxcore.models.digits import MLP
    from torchshell import JaxModule

    seen: list[str] = []

    class Spy(L.Callback):
        def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            bar = trainer.progress_bar_callback
            seen.append(bar._get_train_description(trainer.current_epoch).strip())

    data = TensorDataset(torch.randn(16, 64), torch.randint(0, 10, (16,)))
    module = JaxModule(
        MLP(features=(8,)),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer(lr=1e-2),
        mesh=jaxcore.make_mesh({"data": 1, "model": 1}, jax.devices()[:1]),
    )
    trainer = L.Trainer(
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        callbacks=[Spy()],
    )
    bar = trainer.progress_bar_callback
    assert isinstance(bar, RichProgressBar), bar  # Lightning's default where rich is installed
    trainer.fit(module, DataLoader(data, batch_size=8))
    assert seen == ["Epoch 0", "Epoch 1"], seen
    assert bar._get_train_description(1).strip() == "Epoch 1/-2"  # Lightning's own, after


def test_a_multirun_prints_one_config_line_per_job_and_no_hydra_or_lightning_lines(
    tmp_path: Path,
):
    """Before: Hydra's `Launching 2 jobs locally` and `#N : <every override>`, and in the
    second job Lightning's device report, litlogger tip and max_steps stop (the shared
    rank-zero logger renamed `pytorch_lightning...` once the first job imported
    mlflow.pytorch): 6 extra lines for two jobs. Now the job is in the config line."""
    sweep = [*SMALL, "trainer.max_steps=10", "optim.lr=1e-3,3e-3", "hydra.sweep.dir=sweep"]
    (proc,) = run_cli_forked([(tmp_path, ["train", "-m", *sweep])], tmp_path / "forked")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _extra(proc.stdout + "\n" + proc.stderr) == []
    lines = re.findall(r"(?m)^coreshell train: .*$", proc.stdout)
    assert [line.rsplit(", ", 1)[-1] for line in lines] == [
        "sweep job #0 in sweep/0",
        "sweep job #1 in sweep/1",
    ]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny served model (the JAX core) and a folder of clips, one too short."""
    import soundfile as sf
    import torch

    from torchshell.app.served import save_waveform_model
    from torchshell.twins.spoken_digits import SpokenDigitsEncoder

    torch.manual_seed(0)
    tmp = tmp_path_factory.mktemp("console-served")
    serving = SpokenDigitsEncoder(width=16, depth=1, heads=2, dropout=0.0).serving()
    save_waveform_model(serving, tmp / "model")
    (tmp / "clips").mkdir()
    rng = np.random.default_rng(0)
    for name, n in [("a", 16_000), ("b", 8_000), ("short", 100)]:
        sf.write(tmp / "clips" / f"{name}.wav", 0.1 * rng.standard_normal(n), 16_000)
    return tmp


def test_predict_prints_a_json_line_per_file_its_bar_and_a_failure_count(served: Path):
    (proc,) = run_cli_forked([(served, ["predict", "model", "clips"])], served / "forked")
    assert proc.returncode == 1, proc.stderr[-3000:]  # the short clip
    assert _extra(proc.stdout + "\n" + proc.stderr) == []
    assert len(proc.stdout.splitlines()) == 3
    assert "coreshell predict: 1 of 3 files failed" in proc.stderr


def test_serve_prints_one_line_when_it_answers_then_only_the_requests(served: Path):
    """Before: coreshell's line before the server was up, MLflow's `Downloading artifacts`
    bar and two INFO lines (backend, the uvicorn command), uvicorn's four start lines and
    four stop lines. Its access log (the requests) and warnings stay."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        k: v for k, v in user_env().items() if k not in ("CORESHELL_VERBOSE", "HYDRA_FULL_ERROR")
    }
    cmd = [*CLI, "serve", "model", "--port", str(port)]
    cmd += ["--tracking-uri", f"sqlite:///{served}/mlflow.db"]
    proc = subprocess.Popen(
        cmd, cwd=served, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the server never answered /ping"
                time.sleep(0.5)
        time.sleep(1.0)  # (coreshell's own probe sees the port within its 0.5 s)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    assert err.splitlines() == [
        f"coreshell serve: model answering at http://127.0.0.1:{port}/invocations (Ctrl-C stops)"
    ], err[-3000:]
    assert re.fullmatch(r'INFO: +127\.0\.0\.1:\d+ - "GET /ping HTTP/1\.1" 200 OK\n', out), out
