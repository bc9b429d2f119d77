"""torchshell.tracking against real MLflow: a real ``mlflow server`` (killed and restarted
mid-run), the SQLite store, a real Lightning run, and ``mlflow models serve`` of the twin."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from importlib.metadata import version
from pathlib import Path

import jax
import jax.numpy as jnp
import lightning as L
import mlflow.pytorch
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from mlflow.tracking._tracking_service.utils import _use_tracking_uri

import jaxcore
from jaxcore.models.digits import MLP as FlaxMLP
from torchshell import JaxModule
from torchshell.data.digits import DigitsDataModule
from torchshell.export import export_twin
from torchshell.tracking import (
    AsyncMLflowLogger,
    SystemMetrics,
    TrackingError,
    log_confusion_matrix,
    log_torch_model,
    replay,
    run_tags,
)
from torchshell.tracking._outbox import Outbox
from torchshell.twins.digits import MLP as TwinMLP

BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.25)
    raise RuntimeError(f"{url} not healthy after {timeout_s} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Stops a process group this test started (the server and its workers)."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)


class Server:
    """A real ``mlflow server`` on 127.0.0.1 with a SQLite backend store in ``root``."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, _free_port()
        self.db = root / "server.db"
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        log = self.root / "server.log"
        cmd = [
            str(BIN / "mlflow"),
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.db}",
            "--artifacts-destination",
            str(self.root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.root,
            stdout=log.open("a"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"},
        )
        _wait_http(self.uri + "/health", self.proc, log)

    def kill(self) -> None:
        """SIGKILL: the server dies without a goodbye, as in a crash."""
        assert self.proc is not None
        _stop(self.proc, signal.SIGKILL)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = Server(tmp_path_factory.mktemp("mlflow-server"))
    srv.start()
    yield srv
    if srv.proc is not None:
        _stop(srv.proc)


@pytest.fixture(scope="module")
def sqlite_uri(server: Server, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A SQLite store of its own, copied from the server's freshly migrated one (creating a
    store from scratch runs MLflow's migrations: ~10 s here)."""
    path = tmp_path_factory.mktemp("sqlite-store") / "mlflow.db"
    with sqlite3.connect(server.db) as src, sqlite3.connect(path) as dst:
        src.backup(dst)
    return f"sqlite:///{path}"


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def _ordered(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    """The history in logging order: by timestamp, then step (MLflow's own order is free)."""
    ms = client.get_metric_history(run_id, key)
    return [(m.step, m.value) for m in sorted(ms, key=lambda m: (m.timestamp, m.step))]


def test_outbox_keeps_order_across_memory_file_and_inflight(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "spill.jsonl", max_in_memory=3)
    box.extend([{"i": i} for i in range(2)])
    first = box.take(lambda it: 1)  # in flight, from memory
    box.extend([{"i": i} for i in range(2, 10)])  # memory overflows -> file
    assert box.spilled_total > 0 and (tmp_path / "spill.jsonl").exists()
    assert box.take(lambda it: 5) == first  # not acknowledged: the same chunk again
    box.ack()
    got = []
    while len(box):
        chunk = box.take(lambda it: 2)
        if len(got) == 2:  # a partial delivery: only the tail stays in flight
            got.append(chunk[0])
            box.replace_inflight(chunk[1:])
            continue
        got += chunk
        box.ack()
    assert [r["i"] for r in got] == list(range(1, 10))
    assert not (tmp_path / "spill.jsonl").exists()
    box.extend([{"i": i} for i in range(6)])
    box.take(lambda it: 1)
    assert [r["i"] for r in box.drain()] == list(range(6)) and len(box) == 0


def test_lightning_run_through_a_real_server(server: Server, tmp_path: Path) -> None:
    mesh = jaxcore.make_mesh({"data": -1, "model": 1})
    logger = AsyncMLflowLogger(
        "it",
        tracking_uri=server.uri,
        run_name="lightning",
        tags=run_tags(mesh),
        spill_dir=tmp_path / "spill",
    )
    long_value = "x" * 7000
    logger.log_config({"optim": {"lr": 0.01, "names": ["a", "b"]}, "note": long_value})
    module = JaxModule(
        FlaxMLP(features=(32,)),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer(lr=1e-2),
        mesh=mesh,
    )
    trainer = L.Trainer(
        max_epochs=2,
        limit_train_batches=6,
        log_every_n_steps=3,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=2,
        default_root_dir=str(tmp_path),
    )
    data = DigitsDataModule(batch_size=32)
    trainer.fit(module, datamodule=data)
    log_confusion_matrix(logger, [0, 1, 2, 2], [0, 1, 1, 2])
    system = SystemMetrics(logger, interval_s=3600)
    assert system.sample() > 0
    system.stop()
    logger.log_text("HloModule train_step\n", "hlo/train_step.txt")
    # more than one log_batch worth of metrics
    logger.log_metrics({f"bulk/{i}": float(i) for i in range(1500)}, step=0)
    report = logger.close()
    assert report.complete, str(report)
    assert report.truncated_params == ["note"]

    client = MlflowClient(server.uri)
    run = client.get_run(report.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "lightning"
    assert run.data.params["optim.lr"] == "0.01"
    assert run.data.params["optim.names"] == "['a', 'b']"
    assert run.data.params["note"].endswith("[truncated; full value in config.yaml]")
    assert len(run.data.params["note"]) == 6000
    tags = run.data.tags
    assert tags["versions.jax"] == jax.__version__ and tags["versions.torch"] == version("torch")
    assert tags["mesh.shape"] == str(dict(mesh.shape)) and tags["devices.count"] == "8"
    assert tags["processes.count"] == "1"
    # Lightning's logging steps: every 3rd of 2 x 6, and validation after each epoch
    steps = sorted(s for s, _ in _history(client, report.run_id, "train/loss"))
    assert len(steps) == 4 and len(set(steps)) == 4
    assert len(_history(client, report.run_id, "val/loss")) == 2
    assert len(run.data.metrics) >= 1500
    assert run.data.metrics["system/cpu_utilization_percentage"] >= 0
    arts = {a.path for a in client.list_artifacts(report.run_id)}
    assert {"config.yaml", "plots", "hlo"} <= arts
    png = Path(client.download_artifacts(report.run_id, "plots/confusion_matrix.png", tmp_path))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cfg = Path(client.download_artifacts(report.run_id, "config.yaml", tmp_path)).read_text()
    assert long_value in cfg


def test_server_killed_mid_run_history_is_complete(server: Server, tmp_path: Path) -> None:
    kw = {"tracking_uri": server.uri, "max_backoff_s": 0.5, "flush_interval_s": 0.1}
    logger = AsyncMLflowLogger("outage", spill_dir=tmp_path / "a", max_in_memory=40, **kw)
    logger.log_hyperparams({"lr": 0.1})
    for step in range(30):
        logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
    assert logger.flush(60)
    server.kill()
    outage_twin = TwinMLP(features=(4,)).eval()
    try:
        _log_through_outage(logger, tmp_path, kw)
        assert log_torch_model(logger, outage_twin, np.ones((2, 64), np.float32)) is None
    finally:
        server.start()  # same port, same backend store
    report = logger.close(timeout_s=120)
    assert report.complete, str(report)
    assert report.spilled > 0 and report.outages == 1
    client = MlflowClient(server.uri)
    steps, values = zip(*_ordered(client, report.run_id, "loss"), strict=True)
    assert steps == tuple(range(230))
    assert values == pytest.approx([1.0 / (s + 1) for s in range(230)])
    assert client.get_run(report.run_id).data.params == {"lr": "0.1"}
    # the model logged during the outage was kept locally and delivered as artifacts
    assert "model/MLmodel" in {a.path for a in client.list_artifacts(report.run_id, "model")}
    with _use_tracking_uri(server.uri):
        loaded = mlflow.pytorch.load_model(f"runs:/{report.run_id}/model")
    x = np.ones((2, 64), np.float32)
    with torch.no_grad():
        np.testing.assert_allclose(loaded(torch.from_numpy(x)), outage_twin(torch.from_numpy(x)))

    replayed = replay(tmp_path / "b" / "undelivered.jsonl")
    assert replayed.complete and replayed.delivered == 200
    steps, values = zip(*_ordered(client, replayed.run_id, "acc"), strict=True)
    assert steps == tuple(range(200))
    assert values == pytest.approx([s / 200 for s in range(200)])


def _log_through_outage(logger: AsyncMLflowLogger, tmp_path: Path, kw: dict) -> None:
    # a second run ends while the server is down: its records stay in a file
    doomed = AsyncMLflowLogger("outage", spill_dir=tmp_path / "b", close_timeout_s=1.0, **kw)
    for step in range(200):  # training goes on
        logger.log_metrics({"loss": 1.0 / (step + 31)}, step=step + 30)
        doomed.log_metrics({"acc": step / 200}, step=step)
    report_b = doomed.close()
    assert not report_b.complete and report_b.run_id is None
    assert report_b.undelivered == 200 and "NOT DELIVERED" in str(report_b)
    deadline = time.monotonic() + 60
    while logger.report.outages == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # the delivery thread notices the outage
    assert logger.pending() > 0 and logger.report.outages == 1


def test_twin_as_mlflow_model_loads_and_serves(server: Server, tmp_path: Path) -> None:
    flax_model = FlaxMLP(features=(16,))
    x = np.random.default_rng(0).random((5, 64), dtype=np.float32)
    params = flax_model.init(jax.random.key(0), jnp.ones((1, 64)))["params"]
    jax_out = np.asarray(flax_model.apply({"params": params}, jnp.asarray(x)))
    twin = TwinMLP(features=(16,))
    export_twin(params, twin, tmp_path / "model.safetensors")
    logger = AsyncMLflowLogger("serve", tracking_uri=server.uri, spill_dir=tmp_path / "s")
    info = log_torch_model(logger, twin, x[:2], register_as="digits-twin")
    report = logger.close()
    assert report.complete and info is not None
    assert str(info.registered_model_version) == "1"
    assert info.signature.inputs.to_dict()[0]["tensor-spec"]["shape"] == (-1, 64)

    with _use_tracking_uri(server.uri):
        loaded = mlflow.pytorch.load_model(f"runs:/{report.run_id}/model")
    with torch.no_grad():
        np.testing.assert_allclose(loaded(torch.from_numpy(x)).numpy(), jax_out, atol=1e-5)

    port, log = _free_port(), tmp_path / "serve.log"
    env = {**os.environ, "MLFLOW_TRACKING_URI": server.uri, "PATH": f"{BIN}:{os.environ['PATH']}"}
    proc = subprocess.Popen(
        [
            str(BIN / "mlflow"),
            "models",
            "serve",
            "-m",
            f"runs:/{report.run_id}/model",
            "--env-manager",
            "local",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
        ],
        cwd=tmp_path,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_http(f"http://127.0.0.1:{port}/ping", proc, log)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/invocations",
            data=json.dumps({"inputs": x.tolist()}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            served = np.asarray(json.loads(r.read())["predictions"], dtype=np.float32)
    finally:
        _stop(proc)
    np.testing.assert_allclose(served, jax_out, atol=1e-5)


def test_sqlite_store_and_bad_input(sqlite_uri: str, tmp_path: Path) -> None:
    off = AsyncMLflowLogger("gated", tracking_uri=sqlite_uri, enabled=False)
    off.log_metrics({"loss": 1.0}, step=0)
    assert off.close().run_id is None and off.report.queued == 0

    logger = AsyncMLflowLogger("sqlite", tracking_uri=sqlite_uri, spill_dir=tmp_path)
    logger.log_hyperparams({"a": 1})
    logger.log_hyperparams({"a": 1})  # the same value again: fine
    with pytest.raises(TrackingError, match="cannot change"):
        logger.log_hyperparams({"a": 2})
    with pytest.raises(TrackingError, match="numpy array"):
        log_torch_model(logger, TwinMLP(features=(4,)), torch.ones(2, 64))  # type: ignore[arg-type]
    with pytest.raises(TrackingError, match="does not exist"):
        logger.log_artifact(tmp_path / "missing.txt")
    with pytest.raises(TrackingError, match="one label per example"):
        log_confusion_matrix(logger, [0, 1], [0])
    logger.log_metrics({"loss": 0.5}, step=3)
    report = logger.close("failed")
    assert report.complete and report.delivered == 2
    run = MlflowClient(sqlite_uri).get_run(report.run_id)
    assert run.info.status == "FAILED" and run.data.metrics == {"loss": 0.5}
    with pytest.raises(TrackingError, match="closed"):
        logger.log_metrics({"loss": 0.1}, step=4)
    with pytest.raises(TrackingError, match="must be a URI"):
        AsyncMLflowLogger(tracking_uri="mlflow.db")
    bad = tmp_path / "not-a-spill.jsonl"
    bad.write_text('{"t": "m"}\n')
    with pytest.raises(TrackingError, match="header"):
        replay(bad)


def test_the_next_train_replays_earlier_runs_undelivered_records_once(
    sqlite_uri: str, tmp_path: Path
) -> None:
    """What `coreshell train` starts with (and `coreshell tracking replay` does): the
    undelivered.jsonl of the runs beside the new run directory go to their store, in order,
    once; a store still down keeps its file."""
    from torchshell.app.tracking_cli import tracking_command
    from torchshell.app.train import _replay_earlier_runs

    head = {"t": "header", "run_id": None, "tracking_uri": sqlite_uri, "experiment": "later",
            "run_name": "was-offline", "tags": {}, "status": "FINISHED"}  # fmt: skip
    records = [{"t": "m", "k": "train/loss", "v": 1.0 / (s + 1), "ts": s, "s": s} for s in range(5)]
    earlier = tmp_path / "outputs" / "2026-12-01" / "10-00-00" / "tracking" / "undelivered.jsonl"
    down = tmp_path / "outputs" / "2026-12-01" / "10-30-00" / "tracking" / "undelivered.jsonl"
    for path, uri in ((earlier, sqlite_uri), (down, f"http://127.0.0.1:{_free_port()}")):
        path.parent.mkdir(parents=True)
        lines = [{**head, "tracking_uri": uri}, *records]
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    _replay_earlier_runs(tmp_path / "outputs" / "2026-12-01" / "11-00-00").join(timeout=120)
    assert not earlier.exists() and earlier.with_name("replayed.jsonl").is_file()
    assert down.is_file()  # its store is unreachable: kept for later
    client = MlflowClient(sqlite_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("later").experiment_id])
    assert _ordered(client, run.info.run_id, "train/loss") == [(s, 1.0 / (s + 1)) for s in range(5)]
    assert tracking_command(["replay", str(tmp_path / "outputs")]) == 1  # one still waits
    assert len(_history(client, run.info.run_id, "train/loss")) == 5  # never sent twice
