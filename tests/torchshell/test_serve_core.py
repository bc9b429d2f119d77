"""Issue #54: the served speech model runs the fastest core: the JAX front end and encoder
(``jax.export``), with ONNX Runtime for batches of up to ``ONNX_MAX_BATCH``; it serves without
torch, flax or coreshell, from the requirements it lists. One tiny twin saved both ways."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch

from torchshell.app.served import save_waveform_model
from torchshell.app.served_core import ONNX_MAX_BATCH
from torchshell.twins.spoken_digits import SpokenDigitsEncoder

# what the served model must not need: the shell, the core's packages, torch
BLOCKED = ("torch", "torchaudio", "flax", "torchshell", "jaxcore", "bridge", "lightning")
LOAD_ALONE = """
import importlib.abc, json, sys
import numpy as np

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked}:
            raise ImportError(f"the served model imported {{name}}")

sys.meta_path.insert(0, Blocked())
import mlflow

model = mlflow.pyfunc.load_model(sys.argv[1])
batch = json.loads(sys.stdin.read())
out = model.predict({{k: np.asarray(v) for k, v in batch.items()}})
ran = dict(model.unwrap_python_model().core.ran)
print(json.dumps({{"logits": out["logits"].tolist(), "ran": ran}}))
"""


def _batch(sizes: list[int], seed: int) -> dict[str, np.ndarray]:
    """Clips of ``sizes`` samples, zero-padded to the longest."""
    rng = np.random.default_rng(seed)
    waveform = np.zeros((len(sizes), max(sizes)), np.float32)
    for row, n in enumerate(sizes):
        tone = np.sin(2 * np.pi * (150 + 40 * row) * np.arange(n) / 16_000)
        waveform[row, :n] = 0.2 * tone * np.hanning(n) + 0.01 * rng.standard_normal(n)
    return {"waveform": waveform, "lengths": np.asarray(sizes, np.int64)}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    torch.manual_seed(0)
    serving = SpokenDigitsEncoder(width=16, depth=1, heads=2, dropout=0.0).serving()
    tmp = tmp_path_factory.mktemp("served")
    for core in ("jax", "pt2"):
        save_waveform_model(serving, tmp / core, core=core)
    return {"jax": tmp / "jax", "pt2": tmp / "pt2"}


def test_the_jax_core_serves_small_batches_in_onnx_runtime_and_large_ones_in_jax(models):
    """Mixed lengths (padding to a bucket included) equal the torch program before #54."""
    fast = mlflow.pyfunc.load_model(str(models["jax"]))
    before = mlflow.pyfunc.load_model(str(models["pt2"]))
    core = fast.unwrap_python_model().core
    assert type(core).__name__ == "JaxCore" and core.onnx_max_batch == ONNX_MAX_BATCH
    for seed, sizes in enumerate([[3_200], [16_000, 4_801, 9_999], [80_000] * 2 + [3_333] * 3]):
        sizes += [12_345] * (9 - len(sizes)) if seed == 2 else []  # 9 rows: padded to 10
        batch = _batch(sizes, seed)
        got, want = fast.predict(batch), before.predict(batch)
        assert got["logits"].shape == (len(sizes), 10)
        assert np.abs(got["logits"] - want["logits"]).max() < 1e-4
        assert np.abs(got["probabilities"] - want["probabilities"]).max() < 1e-5
        assert (got["label"] == want["label"]).all()
    assert dict(core.ran) == {"onnx": 2, "jax": 1}  # batches of 1 and 3, then 9


def test_requirements_list_the_core_runtimes_and_not_torch(models):
    requirements = (models["jax"] / "requirements.txt").read_text().split()
    names = {r.partition("==")[0] for r in requirements}
    assert names == {"jax", "jaxlib", "numpy", "mlflow", "onnxruntime"}, requirements
    assert all("==" in r for r in requirements)  # pinned as installed
    conda = (models["jax"] / "conda.yaml").read_text()
    assert "onnxruntime==" in conda and "jax==" in conda and "torch" not in conda
    artifacts = sorted(p.name for p in (models["jax"] / "artifacts").iterdir())
    assert artifacts == ["core.jax", "encoder.onnx", "front.jax", "serving.json"]
    before = (models["pt2"] / "requirements.txt").read_text()
    assert "torch==" in before and "jax" not in before


def test_the_model_loads_and_predicts_without_torch_flax_or_coreshell(models, tmp_path):
    """A Python that cannot import torch, flax or coreshell, outside the checkout."""
    batch = _batch([16_000, 4_000], seed=5)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_ALONE.format(blocked=set(BLOCKED)), str(models["jax"])],
        input=json.dumps({k: v.tolist() for k, v in batch.items()}),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    want = mlflow.pyfunc.load_model(str(models["pt2"])).predict(batch)["logits"]
    assert np.abs(np.asarray(out["logits"]) - want).max() < 1e-4 and out["ran"] == {"onnx": 1}


def test_a_json_request_reaches_the_model_as_lists_and_is_validated_there(models):
    """MLflow's scoring function on the request bytes: no deep copy and cast per the
    signature (the model validates every request itself); whole-number float lengths pass,
    text samples are a 400 with the fix."""
    from mlflow.exceptions import MlflowException
    from mlflow.pyfunc.scoring_server import invocations

    model = mlflow.pyfunc.load_model(str(models["jax"]))
    assert model.metadata._is_signature_from_type_hint()
    inputs = model.metadata.get_input_schema()
    assert [s["tensor-spec"]["shape"] for s in inputs.to_dict()] == [(-1, -1), (-1,)]
    batch = _batch([8_000, 6_400], seed=3)
    body = {"waveform": batch["waveform"].tolist(), "lengths": [8000.0, 6400]}
    reply = invocations(json.dumps({"inputs": body}), "application/json", model, inputs)
    assert reply.status == 200, reply.response
    got = np.asarray(json.loads(reply.response)["predictions"]["logits"])
    assert np.abs(got - model.predict(batch)["logits"]).max() < 1e-5
    body["waveform"] = [["a"] * 8000] * 2
    with pytest.raises(MlflowException) as refused:
        invocations(json.dumps({"inputs": body}), "application/json", model, inputs)
    assert refused.value.get_http_status_code() == 400
    assert "must be arrays of numbers" in refused.value.message and "Fix:" in refused.value.message


def test_a_waveform_padded_past_5_s_is_cropped_to_its_longest_clip(models):
    """The exported programs take at most the longest clip's samples (bucketed): a request
    padded wider than that is cropped to its longest clip first, with the same logits."""
    batch = _batch([16_000, 8_000], seed=7)
    wide = {**batch, "waveform": np.pad(batch["waveform"], ((0, 0), (0, 90_000)))}
    fast = mlflow.pyfunc.load_model(str(models["jax"]))
    got, want = fast.predict(wide)["logits"], fast.predict(batch)["logits"]
    assert np.abs(got - want).max() < 1e-5


def test_the_core_exports_on_a_tpu_backend_with_xla_attention(monkeypatch, tmp_path):
    """On a TPU, attention picks the Pallas kernel from 640 frames: the exported sample axis
    is bounded by the longest clip, so the choice (XLA) is decidable while exporting."""
    import jax

    import jaxcore.models.attention as attention
    from torchshell.app.served_core import write_jax_core

    class OnTpu:
        def __getattr__(self, name: str):
            return getattr(jax, name)

        @staticmethod
        def default_backend() -> str:
            return "tpu"

    monkeypatch.setattr(attention, "jax", OnTpu())
    serving = SpokenDigitsEncoder(width=16, depth=1, heads=2, dropout=0.0).serving()
    artifacts, spec = write_jax_core(serving, tmp_path, 80_000)  # checked against torch
    assert spec["core"] == "jax" and Path(artifacts["core"]).stat().st_size > 0


def test_in_mlflow_models_serve_the_request_json_is_decoded_once(models, monkeypatch):
    """MLflow's scoring server decodes a JSON body twice (`_parse_json_data`, then
    `_split_data_and_params` on the raw body); the served model, loaded by the server's app,
    makes it once, with the same reply and the same refusals. The pt2 model (the baseline
    before #54) leaves the server as it is."""
    from mlflow.exceptions import MlflowException
    from mlflow.pyfunc import scoring_server

    decoded: list[int] = []
    loads = json.loads

    def counted(text, *args, **kwargs):
        decoded.append(len(text))
        return loads(text, *args, **kwargs)

    batch = _batch([8_000, 6_400], seed=4)
    body = json.dumps({"inputs": {k: v.tolist() for k, v in batch.items()}}).encode()
    monkeypatch.setattr(scoring_server, "_parse_json_data", scoring_server._parse_json_data)
    monkeypatch.setitem(sys.modules, "mlflow.pyfunc.scoring_server.app", sys.modules[__name__])
    monkeypatch.setattr(scoring_server.json, "loads", counted)
    replies = {}
    for core in ("pt2", "jax"):  # pt2 first: it must not change the server
        model = mlflow.pyfunc.load_model(str(models[core]))
        schema = model.metadata.get_input_schema()
        decoded.clear()
        reply = scoring_server.invocations(body, "application/json", model, schema)
        assert reply.status == 200, reply.response
        replies[core] = json.loads(reply.response)["predictions"]
        assert [n for n in decoded if n == len(body)] == [len(body)] * (1 if core == "jax" else 2)
    assert np.abs(np.subtract(replies["jax"]["logits"], replies["pt2"]["logits"])).max() < 1e-4
    for bad in (b"{not json", b"[1, 2]"):
        with pytest.raises(MlflowException) as refused:
            scoring_server.invocations(bad, "application/json", model, schema)
        assert refused.value.get_http_status_code() == 400


def test_the_served_models_class_gets_no_type_hint_advice():
    """MLflow advises 'Add type hints to the `predict` method' for a PythonModel whose
    `predict` has none (a UserWarning where the class is defined: when the model is logged,
    and at every load); the served model validates its requests itself and says so."""
    import runpy
    import warnings

    from torchshell.app.served import CODE

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        runpy.run_path(str(CODE), run_name="served_model_probe")
    assert not [w for w in seen if "type hints" in str(w.message)], [str(w.message) for w in seen]


def test_malformed_json_gets_a_short_400_that_says_the_fault_and_the_fix(models, monkeypatch):
    """MLflow answers a body that is not JSON with a 400 that echoes the whole body (a
    truncated batch-64 request: 14 MB back); the served model's server answers with the fault
    and the fix first and at most ECHO characters of the body."""
    from mlflow.exceptions import MlflowException
    from mlflow.pyfunc import scoring_server

    from torchshell.app.waveform_model import ECHO

    monkeypatch.setattr(scoring_server, "_parse_json_data", scoring_server._parse_json_data)
    monkeypatch.setitem(sys.modules, "mlflow.pyfunc.scoring_server.app", sys.modules[__name__])
    model = mlflow.pyfunc.load_model(str(models["jax"]))
    schema = model.metadata.get_input_schema()
    batch = _batch([8_000, 6_400], seed=5)
    whole = json.dumps({"inputs": {k: v.tolist() for k, v in batch.items()}}).encode()
    for bad in (whole[: len(whole) // 2], b'{"inputs": [1, 2,', b"\xff\xfe{}"):
        with pytest.raises(MlflowException) as refused:
            scoring_server.invocations(bad, "application/json", model, schema)
        error = refused.value
        reply = json.loads(error.serialize_as_json())  # what the HTTP client reads
        assert error.get_http_status_code() == 400
        message = reply["message"]
        assert message.startswith("The request is not valid JSON"), message[:300]
        assert message.index("Fix:") < message.index("Request ("), message[:300]
        echo = message.split(f"Request ({len(bad):,} bytes): ", 1)[1]
        assert len(echo.removesuffix("...")) <= ECHO, len(echo)
        assert len(message) < 700 and "stack_trace" not in reply, len(message)
