"""Issue 18, serving: a tiny speech run served over HTTP (MLflow and Triton) at any clip length,
and ``coreshell predict`` on a folder with bad files. One real training run for the module."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlflow
import numpy as np
import pytest
import soundfile as sf
import torch

from benchmarks import _runs
from tests.helpers import CLI

ROOT = Path(__file__).resolve().parents[2]
RATE = 16_000
LENGTHS = (3_200, 16_000, 80_000)  # 0.2 s, 1 s, 5 s
TINY = [
    "data.takes=1",
    "data.speakers=4",
    "data.num_workers=0",
    "data.batch_size=8",
    "++data.min_test_clips=0",
    "model.flax.width=16",
    "model.flax.depth=1",
    "model.flax.heads=2",
    "trainer.max_steps=3",
    "trainer.enable_progress_bar=false",
    "ckpt.every_n_steps=0",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`coreshell train` of the default recipe, tiny: its directory, store and run id."""
    tmp = tmp_path_factory.mktemp("serve")
    uri = f"sqlite:///{tmp}/mlflow.db"
    cmd = [*CLI, "train", *TINY, f"data.root={tmp}/sd", f"tracking.uri={uri}"]
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.run(
        [*cmd, f"hydra.run.dir={tmp}/run"],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=900,
        # the checkout, wherever it is installed from; XLA's CPU backend unoptimised (the
        # tests below read the exported weights, not how fast or how well the steps trained)
        env={**_runs.quiet_env(smoke=True), "PYTHONPATH": path},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    client = mlflow.MlflowClient(tracking_uri=uri)
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return {"dir": tmp / "run", "uri": uri, "id": found.info.run_id, "tmp": tmp}


def _clip(n: int, seed: int) -> np.ndarray:
    """A voiced-like clip: a few harmonics under an envelope, with noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / RATE
    f0 = 120 + 80 * rng.random()
    voiced = sum(np.sin(2 * np.pi * f0 * k * t) / k for k in (1, 2, 3))
    envelope = np.sin(np.pi * np.arange(n) / n) ** 2
    return (0.2 * voiced * envelope + 0.01 * rng.standard_normal(n)).astype(np.float32)


def _padded(clips: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    wave = np.zeros((len(clips), max(len(c) for c in clips)), np.float32)
    for row, clip in enumerate(clips):
        wave[row, : len(clip)] = clip
    return wave, np.array([len(c) for c in clips], np.int64)


def _eager(run_dir: Path):
    """The twin of the run (eager torch) and its serving module: the reference."""
    from torchshell.app.export_cli import load_twin

    twin, _ = load_twin(run_dir / "config.yaml", run_dir / "export" / "model.safetensors")
    return twin, twin.serving()


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_signature_says_batch_and_time_are_variable(run: dict, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", run["uri"])
    info = mlflow.models.get_model_info(f"runs:/{run['id']}/model")
    inputs = {s["name"]: s["tensor-spec"] for s in info.signature.inputs.to_dict()}
    assert inputs["waveform"] == {"dtype": "float32", "shape": (-1, -1)}
    assert inputs["lengths"] == {"dtype": "int64", "shape": (-1,)}


def test_mlflow_models_serve_over_http_any_length_and_a_mixed_batch(run: dict):
    """`mlflow models serve` of the logged model on 127.0.0.1: 0.2 s, 1 s and 5 s clips, and
    the three in one padded batch, equal the eager twin; in-bucket lengths equal JAX too."""
    import jax
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    import bridge
    from torchshell.data.spoken_digits import LogMel, trim_clips

    port = _free_port()
    bin_dir = str(Path(sys.executable).parent)  # MLflow execs `uvicorn` from PATH
    env = {**os.environ, "MLFLOW_TRACKING_URI": run["uri"]}
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
    cmd = [sys.executable, "-m", "mlflow", "models", "serve", "-m", f"runs:/{run['id']}/model"]
    cmd += ["--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)]
    server = subprocess.Popen(
        cmd, env=env, cwd=run["tmp"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{url}/ping", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, server.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "mlflow models serve did not come up"
            time.sleep(1)
        twin, serving = _eager(run["dir"])
        clips = [_clip(n, seed) for seed, n in enumerate(LENGTHS)]
        singles = []
        for clip in clips:
            status, body = _post(
                f"{url}/invocations",
                {"inputs": {"waveform": [clip.tolist()], "lengths": [len(clip)]}},
            )
            assert status == 200, body
            got = np.asarray(body["predictions"]["logits"], np.float32)
            with torch.no_grad():
                want = serving(torch.from_numpy(clip)[None]).numpy()
            assert got.shape == (1, 10) and np.abs(got - want).max() < 1e-4
            probs = np.asarray(body["predictions"]["probabilities"])
            assert abs(probs.sum() - 1) < 1e-5 and body["predictions"]["label"] == [got.argmax()]
            singles.append(got[0])
        wave, lengths = _padded(clips)
        status, body = _post(
            f"{url}/invocations",
            {"inputs": {"waveform": wave.tolist(), "lengths": lengths.tolist()}},
        )
        assert status == 200, body
        mixed = np.asarray(body["predictions"]["logits"], np.float32)
        assert mixed.shape == (3, 10) and np.abs(mixed - np.stack(singles)).max() < 1e-4

        # the JAX model on the training features (trimmed) of the clips that fit a bucket
        cfg = OmegaConf.load(run["dir"] / "config.yaml")
        model = instantiate(cfg.model.flax, _convert_="all")
        feats, mask = (t.numpy() for t in twin.example_input(2))
        variables = bridge.import_state_dict(
            twin.state_dict(), model.init(jax.random.key(0), feats, mask)
        )
        bucket = max(cfg.data.buckets)
        for clip, served in zip(clips, singles, strict=True):
            features = LogMel(n_mels=cfg.data.n_mels)(torch.from_numpy(clip))
            features = trim_clips([features])[0].numpy()  # the data set's item of the clip
            if len(features) > bucket:
                continue
            f = np.zeros((1, bucket, features.shape[1]), np.float32)
            f[0, : len(features)] = features
            m = np.arange(bucket)[None] < len(features)
            jax_logits = np.asarray(model.apply(variables, f, m))[0]
            assert np.abs(jax_logits - served).max() < 1e-4

        status, body = _post(
            f"{url}/invocations", {"inputs": {"waveform": [[0.0] * 800], "lengths": [800]}}
        )
        assert status == 400 and "0.2 s to 5 s" in body["message"] and "Fix:" in body["message"]
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_triton_serves_the_jax_core_equal_to_the_exported_model(run: dict, monkeypatch):
    """`coreshell serve RUN --triton`'s server: the jitted Flax encoder behind PyTriton, over
    HTTP with tritonclient: three lengths and a mixed batch, equal to the MLflow model."""
    import tritonclient.http as triton_http

    from torchshell.app.serve import JaxCore, triton_server

    monkeypatch.setenv("MLFLOW_TRACKING_URI", run["uri"])
    exported = mlflow.pyfunc.load_model(f"runs:/{run['id']}/model")
    core = JaxCore(run["dir"] / "config.yaml", run["dir"] / "export" / "model.safetensors")
    clips = [_clip(n, 10 + seed) for seed, n in enumerate(LENGTHS)]
    http, grpc = _free_port(), _free_port()
    with triton_server(core, http_port=http, grpc_port=grpc):
        client = triton_http.InferenceServerClient(f"127.0.0.1:{http}")
        try:
            for batch in [[c] for c in clips] + [clips]:
                wave, lengths = _padded(batch)
                inputs = [
                    triton_http.InferInput("waveform", list(wave.shape), "FP32"),
                    triton_http.InferInput("lengths", [len(batch), 1], "INT64"),
                ]
                inputs[0].set_data_from_numpy(wave)
                inputs[1].set_data_from_numpy(lengths[:, None])
                result = client.infer("spoken_digits", inputs)
                got = result.as_numpy("logits")
                want = exported.predict({"waveform": wave, "lengths": lengths})["logits"]
                assert got.shape == (len(batch), 10) and np.abs(got - want).max() < 1e-4
                assert (result.as_numpy("label")[:, 0] == want.argmax(1)).all()
        finally:
            client.close()


def test_predict_a_folder_with_bad_files(run: dict, tmp_path: Path, capsys, monkeypatch):
    """One JSON line per file, in order; a non-audio, an empty and an 8 kHz file are reported
    and the rest still scored (as the served model scores them); exit status 1."""
    from torchshell.app.cli import main

    folder = tmp_path / "clips"
    folder.mkdir()
    clips = {f"{i}_ok.wav": _clip(n, 20 + i) for i, n in enumerate((4_000, 12_000, 30_000))}
    for name, clip in clips.items():
        sf.write(folder / name, clip, RATE)
    (folder / "3_not_audio.wav").write_bytes(b"this is not a wav file")
    sf.write(folder / "4_empty.wav", np.zeros(0, np.float32), RATE)
    sf.write(folder / "5_rate.wav", _clip(8_000, 1), 8_000)
    (folder / "notes.txt").write_text("not an audio suffix: skipped")
    with pytest.raises(SystemExit) as exit_:
        main(["predict", run["id"], str(folder), "--tracking-uri", run["uri"], "--batch", "2"])
    assert exit_.value.code == 1
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert [Path(r["file"]).name for r in lines] == sorted(
        [*clips, "3_not_audio.wav", "4_empty.wav", "5_rate.wav"]
    )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", run["uri"])
    exported = mlflow.pyfunc.load_model(f"runs:/{run['id']}/model")
    for row, (name, clip) in zip(lines, clips.items(), strict=False):
        want = exported.predict({"waveform": clip[None], "lengths": np.array([len(clip)])})
        assert Path(row["file"]).name == name and row["label"] == int(want["label"][0])
        assert np.abs(np.asarray(row["probabilities"]) - want["probabilities"][0]).max() < 1e-5
    errors = {Path(r["file"]).name: r["error"] for r in lines if "error" in r}
    assert "not an audio file" in errors["3_not_audio.wav"]
    assert "no samples" in errors["4_empty.wav"]
    assert "8000 Hz; expected 16000 Hz" in errors["5_rate.wav"] and "Fix:" in errors["5_rate.wav"]
    assert "3 of 6 files failed" in err and "Traceback" not in err


def test_predict_refuses_a_missing_path_without_a_traceback(run: dict, tmp_path: Path, capsys):
    from torchshell.app.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["predict", str(run["dir"]), str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "does not exist" in err and "Traceback" not in err
