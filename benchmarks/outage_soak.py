"""Tracking outage soak: a real ``mlflow server`` goes down for a long stretch of a real
``coreshell train`` and comes back; then goes down again until the run ends.

One run on the digits MLP against ``mlflow server`` (SQLite backend) on 127.0.0.1, stopped
from outside with SIGTERM at the planned end (the run checkpoints and exits 0). Schedule,
from the first metric the server holds::

    full (default): up 30 s | down 190 s | up 50 s | down 30 s, run stopped | ~5 min
    --tiny:         up  6 s | down  14 s | up 10 s | down  6 s, run stopped

The server is SIGKILLed (a crash) and restarted on the same port and store. After the run,
the records of the last outage sit in ``RUN_DIR/tracking/undelivered.jsonl``; the server is
started again and ``coreshell tracking replay RUN_DIR`` sends them. Then, from the server:

- **lost**: every metric key's history holds every logging step from its first to its last
  (``log_every_n_steps`` apart), the final down stretch included: 0 missing;
- **order**: ``train/loss`` timestamps never decrease in step order;
- **slowdown**: ms per step (from ``train/loss`` timestamps, taken on the training thread)
  while the server was down vs. while it was up before the outage (the first seconds of
  training, compile, left out): goal <= 5% slower.

    .venv/bin/python benchmarks/outage_soak.py [--tiny] [--json out.json]
"""

# ruff: noqa: E402  (imports follow the sys.path fix below)
from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from mlflow.tracking import MlflowClient

from benchmarks import _runs

BIN = Path(sys.executable).parent
SCHEDULES = {  # seconds: up, down, up, final down
    "full": (30.0, 190.0, 50.0, 30.0),
    "tiny": (6.0, 14.0, 10.0, 6.0),
}
EVERY = {"full": 5, "tiny": 20}  # trainer.log_every_n_steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``mlflow server`` on 127.0.0.1 with a SQLite store in ``root``; killed and restarted."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 300.0) -> float:
        """Starts it and waits for ``/health``; returns the seconds that took."""
        t0 = time.monotonic()
        cmd = [
            *(str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port)),
            *("--backend-store-uri", f"sqlite:///{self.root}/server.db"),
            *("--artifacts-destination", str(self.root / "artifacts"), "--workers", "1"),
        ]
        log = (self.root / "server.log").open("a")
        env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
        self.proc = subprocess.Popen(
            cmd, cwd=self.root, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited {self.proc.returncode}; see {log.name}")
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"mlflow server not healthy after {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL of the whole server (gunicorn/uvicorn and its workers): a crash."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None


@dataclass
class Result:
    mode: str
    load_avg: tuple[float, float, float]
    windows_s: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    logged_points: int = 0
    missing: dict[str, int] = field(default_factory=dict)
    order_kept: bool = False
    replayed: int = 0
    ms_per_step: dict[str, float] = field(default_factory=dict)
    slowdown: float = 0.0
    exit_code: int | None = None

    @property
    def ok(self) -> bool:
        return (
            self.exit_code == 0
            and self.steps > 0
            and not any(self.missing.values())
            and self.order_kept
            and self.replayed > 0
        )


def _first_metric(client: MlflowClient, experiment: str, proc: subprocess.Popen[str]) -> str:
    """Waits until the server holds a ``train/loss`` of the run; returns its run id."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"coreshell train exited {proc.returncode} before training")
        exp = client.get_experiment_by_name(experiment)
        if exp is not None:
            for run in client.search_runs([exp.experiment_id]):
                if run.data.metrics.get("train/loss") is not None:
                    return run.info.run_id
        time.sleep(0.25)
    raise RuntimeError("no train/loss on the server after 900 s")


def _ms_per_step(points: list[tuple[int, int]], start: float, end: float) -> float:
    """Mean ms per step of the logging intervals lying inside [start, end] (epoch ms)."""
    steps = ms = 0
    for (s0, t0), (s1, t1) in itertools.pairwise(points):
        if start <= t0 and t1 <= end and s1 > s0:
            steps, ms = steps + s1 - s0, ms + t1 - t0
    return ms / steps if steps else float("nan")


def soak(tmp: Path, mode: str) -> Result:
    """Runs the schedule of ``mode`` once; see the module doc."""
    up1, down1, up2, down2 = SCHEDULES[mode]
    every = EVERY[mode]
    result = Result(mode, os.getloadavg())
    server = Server(tmp)
    result.windows_s["server_start"] = server.start()
    client = MlflowClient(server.uri)
    run_dir = tmp / "runs" / "soak"
    cmd = [
        *(sys.executable, "-m", _runs.cli_module(), "train"),
        *("data=digits", "model=digits", "trainer.max_steps=100000000", "trainer.max_epochs=-1"),
        # one device: the soak is about tracking; an 8-device all-reduce under a loaded
        # machine can time out its rendezvous (XLA CPU's 40 s), which is not what is measured
        "mesh=single",
        *(f"trainer.log_every_n_steps={every}", "trainer.enable_progress_bar=false"),
        *("trainer.check_val_every_n_epoch=100000", "test_after_fit=false"),
        *("ckpt.every_n_steps=0", f"ckpt.dir={tmp}/ckpt"),
        *(f"tracking.uri={server.uri}", "tracking.experiment=soak"),
        *("tracking.system_metrics_interval_s=null", "tracking.close_timeout_s=5"),
        f"hydra.run.dir={run_dir}",
    ]
    log = (tmp / "train.log").open("w")
    proc = subprocess.Popen(
        cmd, cwd=tmp, stdout=log, stderr=subprocess.STDOUT, text=True, env=_runs.quiet_env()
    )
    marks: dict[str, float] = {}
    try:
        run_id = _first_metric(client, "soak", proc)
        marks["trained"] = time.time()
        time.sleep(up1)
        server.kill()
        marks["down1"] = time.time()
        time.sleep(down1)
        result.windows_s["server_restart"] = server.start()
        marks["up2"] = time.time()
        time.sleep(up2)
        server.kill()
        marks["down2"] = time.time()
        time.sleep(down2)
        marks["stop"] = time.time()
        proc.send_signal(signal.SIGTERM)  # checkpoint after this step, exit 0
        result.exit_code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    pending = run_dir / "tracking" / "undelivered.jsonl"
    if not pending.is_file():
        raise RuntimeError(f"no {pending} after the run ended with the store down")
    result.windows_s["server_start_for_replay"] = server.start()
    replay = subprocess.run(
        [sys.executable, "-m", _runs.cli_module(), "tracking", "replay", str(run_dir)],
        cwd=tmp, capture_output=True, text=True, timeout=900, env=_runs.quiet_env(),
    )  # fmt: skip
    if replay.returncode != 0:
        raise RuntimeError(f"coreshell tracking replay exited {replay.returncode}: {replay}")
    result.replayed = sum(1 for _ in pending.with_name("replayed.jsonl").open()) - 1

    run = client.get_run(run_id)
    for key in run.data.metrics:
        history = client.get_metric_history(run_id, key)
        steps = sorted({m.step for m in history})
        if (
            key.startswith(("train/", "system/coreshell.perf.", "system/coreshell.bridge."))
            and len(steps) > 1
        ):
            expected = set(range(steps[0], steps[-1] + 1, every))
            result.missing[key] = len(expected - set(steps))
    loss = sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.step)
    result.steps, result.logged_points = loss[-1].step, len(loss)
    points = [(m.step, m.timestamp) for m in loss]
    result.order_kept = all(a[1] <= b[1] for a, b in itertools.pairwise(points))
    ms = {k: 1e3 * v for k, v in marks.items()}
    result.windows_s |= {
        "up_before": marks["down1"] - marks["trained"],
        "down_long": marks["up2"] - marks["down1"],
        "up_after": marks["down2"] - marks["up2"],
        "down_to_end": marks["stop"] - marks["down2"],
        "run_total": marks["stop"] - marks["trained"],
    }
    edge = 1000.0  # the first second after each switch left out
    result.ms_per_step = {
        "up (before the outage)": _ms_per_step(points, ms["trained"] + 3 * edge, ms["down1"]),
        "down (long outage)": _ms_per_step(points, ms["down1"] + edge, ms["up2"]),
        "up (catching up)": _ms_per_step(points, ms["up2"] + edge, ms["down2"]),
        "down (until the end)": _ms_per_step(points, ms["down2"] + edge, ms["stop"]),
    }
    up = result.ms_per_step["up (before the outage)"]
    result.slowdown = result.ms_per_step["down (long outage)"] / up - 1.0
    server.kill()
    return result


def table(r: Result) -> str:
    w = r.windows_s
    lines = [
        f"mode {r.mode}, load average {r.load_avg[0]:.1f}; run {w['run_total']:.0f} s from the "
        f"first metric: up {w['up_before']:.0f} s, DOWN {w['down_long']:.0f} s, up "
        f"{w['up_after']:.0f} s, DOWN {w['down_to_end']:.0f} s until the run ended "
        f"(server (re)start {w['server_start']:.0f}/{w['server_restart']:.0f} s)",
        f"steps {r.steps}, train/loss points {r.logged_points}, missing per key "
        f"{sum(r.missing.values())} over {len(r.missing)} keys, order kept {r.order_kept}, "
        f"replayed after the run {r.replayed} records, exit {r.exit_code}",
        "| window | ms/step |",
        "|---|---|",
        *(f"| {k} | {v:.2f} |" for k, v in r.ms_per_step.items()),
        f"slowdown while down vs up before: {100 * r.slowdown:+.1f}% (goal <= +5%)",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the compressed test schedule")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = soak(Path(tmp), "tiny" if args.tiny else "full")
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(result), indent=1))
    if not result.ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
