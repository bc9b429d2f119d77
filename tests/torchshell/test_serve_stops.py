"""Issue #54: ``coreshell serve`` stopped with SIGTERM stops whole: no server left answering
on its port, no temporary folder left behind (an MLflow model of a few lines, no training)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlflow

from benchmarks._runs import cli_module, quiet_env

MODEL_CODE = """
import mlflow
from mlflow.pyfunc import PythonModel


class Echo(PythonModel):
    def predict(self, context, model_input: list[str], params=None) -> list[str]:
        return model_input


mlflow.models.set_model(Echo())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_sigterm_stops_the_server_and_its_workers_and_removes_temp_folders(tmp_path: Path):
    code = tmp_path / "echo.py"
    code.write_text(MODEL_CODE)
    mlflow.pyfunc.save_model(path=tmp_path / "model", python_model=str(code))
    temp = tmp_path / "temp"
    temp.mkdir()
    port = _free_port()
    env = {**quiet_env(), "TMPDIR": str(temp)}
    cmd = [sys.executable, "-m", cli_module(), "serve", str(tmp_path / "model")]
    cmd += ["--port", str(port), "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server never answered /ping"
            time.sleep(0.5)
        assert list(temp.iterdir())  # serve's temporary folder, while it runs
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        time.sleep(0.5)
        assert not _answers(port), "a server still answers after SIGTERM"
        assert not list(temp.iterdir()), list(temp.iterdir())
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)


def test_a_refused_request_names_the_fault_first_and_echoes_at_most_200_characters():
    """Through MLflow's own scoring function (``mlflow models serve`` runs it per request):
    it prefixed the refusal with the whole request (a 0.06 s clip: 17,000 characters)."""
    import json

    import numpy as np
    from mlflow.exceptions import MlflowException
    from mlflow.pyfunc.scoring_server import invocations

    from torchshell.app.waveform_model import ECHO, validated

    spec = {"sample_rate": 16000, "min_samples": 3200, "max_samples": 80000}

    class Served:
        metadata = None

        def predict(self, data, params=None):
            return validated(data, spec)

    clip = np.random.default_rng(0).random(960).tolist()
    body = json.dumps({"inputs": {"waveform": [clip], "lengths": [960]}})
    try:
        invocations(body, "application/json", Served(), None)
    except MlflowException as err:
        reply = json.loads(err.serialize_as_json())
    else:
        raise AssertionError("a 0.06 s clip was served")
    message = reply["message"]
    assert reply["error_code"] == "INVALID_PARAMETER_VALUE"
    assert message.startswith("Clip 0 has lengths[0]=960 samples (0.060 s)"), message[:300]
    fix = message.index("Fix:")
    request = message[fix:].partition(" Request: ")[2]
    assert request and len(request.partition("...")[0]) <= ECHO, message
    assert len(message) < fix + 400, len(message)


def test_serve_refuses_a_port_something_already_answers_on(tmp_path: Path):
    """coreshell says when its server answers by connecting to the port: a port another
    server holds is refused first (that server's answer would read as coreshell's)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cmd = [sys.executable, "-m", cli_module(), "serve", "runs:/0123/model"]
        cmd += ["--port", str(port), "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"]
        proc = subprocess.run(
            cmd, cwd=tmp_path, env=quiet_env(), capture_output=True, text=True, timeout=300
        )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"Something already answers on 127.0.0.1:{port}. Fix: pass another --port" in (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr
