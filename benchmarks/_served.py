"""``mlflow models serve`` of the spoken-digits served model, before and after issue #54.

The same twin saved as coreshell logs it (:func:`torchshell.app.served.save_waveform_model`):
``core="pt2"``, the ``torch.export`` program the pyfunc served before, and ``core="jax"``, the
JAX core with ONNX Runtime for small batches, whose model makes the server decode a request's
JSON once; with ``cores=TWO_PARSES`` also the JAX core under MLflow's two decodes
(``decode_once`` off). Each is
served in turn on 127.0.0.1 (one uvicorn worker) and gets the same JSON requests of 0.64 s
clips (64 frames, the in-process rows' length) at batch 1 and 64: p50 latency of one
client's sequential requests, and requests/s at 4 concurrent clients. Beside them, each
model's ``predict`` in process (the same request, no HTTP or JSON): what the core itself
costs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import _stats

SAMPLES = 63 * 160  # 0.64 s at 16 kHz: 64 log-mel frames
CORES = {"pt2": "before: pt2 program", "jax": "after: JAX core + ONNX Runtime, one JSON parse"}
#: ``inference.py --two-parses``: the JAX core under MLflow's own request handling too
TWO_PARSES = {
    "pt2": CORES["pt2"],
    "jax-two-parses": "JAX core + ONNX Runtime, MLflow's two JSON parses",
    "jax": CORES["jax"],
}


def save(serving: torch.nn.Module, path: Path, core: str) -> None:
    """The served model as coreshell logs it; ``jax-two-parses``: the JAX core with the
    server's request handling left as MLflow's (``decode_once`` off in ``serving.json``)."""
    from torchshell.app.served import save_waveform_model

    save_waveform_model(serving, path, core=core.removesuffix("-two-parses"))
    if core.endswith("-two-parses"):
        spec_path = path / "artifacts" / "serving.json"
        spec_path.write_text(
            json.dumps({**json.loads(spec_path.read_text()), "decode_once": False})
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def request(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A request of ``batch`` clips of 0.64 s (noise at -20 dBFS)."""
    rng = np.random.default_rng(seed)
    waveform = (0.1 * rng.standard_normal((batch, SAMPLES))).astype(np.float32)
    return {"waveform": waveform, "lengths": np.full(batch, SAMPLES, np.int64)}


class Server:
    """``mlflow models serve -m path`` on 127.0.0.1 in its own process group, stopped on exit."""

    def __init__(self, path: Path, log: Path) -> None:
        self.port, self.log = _free_port(), log
        cmd = [sys.executable, "-m", "mlflow", "models", "serve", "-m", str(path)]
        cmd += ["--env-manager", "local", "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [*cmd, "--workers", "1"],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the server's workers end with it
            # mlflow execs `uvicorn` by name: this interpreter's bin folder first on PATH
            env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
        )

    def __enter__(self) -> Server:
        deadline = time.monotonic() + 600  # (the server's imports and the model's load, loaded)
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/ping", timeout=2):
                    return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    tail = self.log.read_text()[-3000:]
                    raise RuntimeError(f"mlflow models serve did not come up:\n{tail}") from None
                time.sleep(0.5)

    def __exit__(self, *_: Any) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=60)

    def post(self, body: bytes) -> dict[str, Any]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/invocations", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())["predictions"]  # type: ignore[no-any-return]


def _timed(fn: Any, arg: Any) -> float:
    t0 = time.perf_counter()
    fn(arg)
    return (time.perf_counter() - t0) * 1e3


def served_rows(
    serving: torch.nn.Module,
    tmp: Path,
    bench: str,
    counts: dict[int, tuple[int, int]],
    cores: dict[str, str] = CORES,
) -> list[dict[str, Any]]:
    """Rows of both models at each batch of ``counts`` (``{batch: (sequential, concurrent)}``
    requests); outputs checked against the eager serving module within 1e-4."""
    import mlflow

    found: dict[tuple[str, int], dict[str, list[float]]] = {}
    for core in cores:
        save(serving, tmp / f"served-{core}", core)
        model = mlflow.pyfunc.load_model(str(tmp / f"served-{core}"))
        with Server(tmp / f"served-{core}", tmp / f"serve-{core}.log") as server:
            for batch, (sequential, concurrent) in counts.items():
                inputs = request(batch)
                body = json.dumps({"inputs": {k: v.tolist() for k, v in inputs.items()}}).encode()
                with torch.no_grad():
                    want = serving(*(torch.from_numpy(v) for v in inputs.values())).numpy()
                got = np.asarray(server.post(body)["logits"], np.float32)  # + the compile
                diff = float(np.abs(got - want).max())
                if diff > 1e-4:
                    raise SystemExit(f"served {core}: logits differ by {diff:.2e} > 1e-4")
                model.predict(inputs)
                seconds = [_timed(server.post, body) for _ in range(sequential)]
                local = [_timed(model.predict, inputs) for _ in range(sequential)]
                t0 = time.perf_counter()
                with ThreadPoolExecutor(4) as pool:
                    list(pool.map(server.post, [body] * concurrent))
                rate = concurrent / (time.perf_counter() - t0)
                found[core, batch] = {"p50": seconds, "rate": [rate], "local": local}
    rows = []
    for batch, (sequential, concurrent) in counts.items():
        for key, metric, what in [
            ("rate", "requests/s", f"4 clients, {concurrent} requests"),
            ("p50", "ms", f"p50 of {sequential} sequential requests"),
            ("local", "ms", f"in process (pyfunc predict), p50 of {sequential}"),
        ]:
            before = float(np.median(found["pt2", batch][key]))
            for core, label in cores.items():
                value = float(np.median(found[core, batch][key]))
                ratio = value / before if key == "rate" else before / value
                row = _stats.row(
                    bench,
                    f"mlflow models serve, batch {batch}, {what}: {label}",
                    metric,
                    found[core, batch][key],
                    ratio=None if core == "pt2" else ratio,
                    ratio_to=None if core == "pt2" else "before (x faster)",
                    note="HTTP + JSON" if key != "local" else "no HTTP, no JSON",
                )
                rows.append(row)
    return rows
