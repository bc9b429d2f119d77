"""``tracking.prometheus_port``: a real ``coreshell train`` serves /metrics on 127.0.0.1 while
it trains; a scraper over HTTP sees the values move, and the port is free once fit ends."""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import quiet_env
from torchshell.tracking import PrometheusMetrics, TrackingError

GAUGES = (
    "coreshell_step",
    "coreshell_train_loss",
    "coreshell_samples_per_second",
    "coreshell_data_wait_fraction",
    "coreshell_recompiles",
    "coreshell_seconds_since_checkpoint",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(url: str) -> dict[str, float] | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            text = r.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("coreshell_")
    }


def test_a_real_run_serves_prometheus_metrics_that_move(tmp_path: Path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    cmd = [
        *(sys.executable, "-m", "torchshell.app.cli", "train"),
        "data=digits",
        "model=digits",
        "trainer.max_steps=200",
        "trainer.max_epochs=-1",
        "trainer.log_every_n_steps=5",
        "trainer.enable_progress_bar=false",
        "trainer.check_val_every_n_epoch=1000",
        "test_after_fit=false",
        "ckpt.every_n_steps=40",
        f"ckpt.dir={tmp_path}/ckpt",
        f"tracking.prometheus_port={port}",
        "tracking.system_metrics_interval_s=null",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"hydra.run.dir={tmp_path}/run",
    ]
    log = tmp_path / "train.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, env=quiet_env()
        )
    scrapes: list[dict[str, float]] = []
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            got = _scrape(url)
            if got is not None:
                scrapes.append(got)
            time.sleep(0.2)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"Prometheus metrics on http://127.0.0.1:{port}/metrics" in log.read_text()
    assert scrapes, "no scrape got through while the run trained"
    assert set(GAUGES) <= set(scrapes[0])
    steps = [s["coreshell_step"] for s in scrapes]
    assert steps == sorted(steps) and len(set(steps)) >= 3, steps  # it moves, forwards
    trained = [s for s in scrapes if s["coreshell_step"] >= 20]
    losses = [
        s["coreshell_train_loss"] for s in trained if math.isfinite(s["coreshell_train_loss"])
    ]
    assert len(set(losses)) >= 2 and all(0 < v < 10 for v in losses)  # the loss moves
    assert all(s["coreshell_samples_per_second"] > 0 for s in trained[-3:])
    assert all(0 <= s["coreshell_data_wait_fraction"] <= 1 for s in trained[-3:])
    assert {s["coreshell_recompiles"] for s in trained[-3:]} == {0.0}
    ages = [s["coreshell_seconds_since_checkpoint"] for s in scrapes]
    assert math.isnan(ages[0])  # no checkpoint yet at the start
    after = [a for s, a in zip(scrapes, ages, strict=True) if s["coreshell_step"] >= 80]
    assert after and all(0 <= a < 120 for a in after[-3:])  # committed checkpoints seen
    assert _scrape(url) is None  # the server stopped with the run


def test_the_endpoint_stops_with_fit_and_a_taken_port_is_a_clear_error():
    prom = PrometheusMetrics(port=0)
    prom.setup(None, None, "fit")
    url = f"http://127.0.0.1:{prom.port}/metrics"
    assert _scrape(url) is not None
    with pytest.raises(TrackingError, match="Fix: pick a free port"):
        PrometheusMetrics(port=prom.port).start()  # the port is taken
    prom.teardown(None, None, "fit")
    assert not prom.running and _scrape(url) is None
    with pytest.raises(TrackingError, match="0-65535"):
        PrometheusMetrics(port=70000)
