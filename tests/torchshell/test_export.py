"""`coreshell export`: run dirs and MLflow runs -> safetensors, torch.save and ONNX, verified."""

from pathlib import Path

import jax
import jax.numpy as jnp
import mlflow
import numpy as np
import onnxruntime as ort
import pytest
import torch
from omegaconf import OmegaConf

import bridge
from jaxcore.models.digits import MLP
from torchshell.app.export_cli import export_command
from torchshell.export import export_twin
from torchshell.twins.digits import MLP as TwinMLP

CONF = Path(__file__).resolve().parents[2] / "conf" / "model" / "digits.yaml"


def _run_dir(root: Path, features=(16,)) -> tuple[Path, MLP, dict]:
    """What `coreshell train` leaves: config.yaml + export/model.safetensors."""
    cfg = OmegaConf.create({"model": OmegaConf.load(CONF), "seed": 0})
    cfg.model.flax.features = list(features)
    run = root / "run"
    run.mkdir()
    OmegaConf.save(cfg, run / "config.yaml")
    model = MLP(features=tuple(features))
    params = model.init(jax.random.key(1), jnp.ones((1, 64)))["params"]
    export_twin(params, TwinMLP(features=features), run / "export" / "model.safetensors")
    return run, model, params


def test_onnx_export_matches_the_flax_model(tmp_path: Path, capsys):
    run, model, params = _run_dir(tmp_path)
    out = tmp_path / "m.onnx"
    export_command([str(run), "--format", "onnx", "--out", str(out)])
    assert "onnxruntime vs torch: max abs diff" in capsys.readouterr().out
    x = np.random.default_rng(0).standard_normal((7, 64)).astype(np.float32)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x})
    want = np.asarray(model.apply({"params": params}, x))
    assert got.shape == (7, 10) and np.abs(got - want).max() < 1e-5


def test_torch_format_is_weights_only_and_loads_into_the_twin(tmp_path: Path):
    run, _, _ = _run_dir(tmp_path)
    export_command([str(run), "--format", "torch"])
    state_dict = torch.load(run / "export" / "model.pt", weights_only=True)
    twin = TwinMLP(features=(16,))
    twin.load_state_dict(state_dict, strict=True)
    reference, _ = bridge.load_safetensors(run / "export" / "model.safetensors")
    assert all(torch.equal(state_dict[k], v) for k, v in reference.items())


def test_safetensors_from_an_mlflow_run_id(tmp_path: Path, monkeypatch):
    run, _, _ = _run_dir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("export")).info.run_id
    client.log_artifact(run_id, str(run / "config.yaml"))
    client.log_artifact(run_id, str(run / "export" / "model.safetensors"), "export")
    client.set_terminated(run_id)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    export_command([run_id, "--format", "safetensors", "--tracking-uri", uri])
    got, meta = bridge.load_safetensors(work / "model.safetensors")
    want, _ = bridge.load_safetensors(run / "export" / "model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert meta["source"] == run_id
    assert meta["tensors"]["head.weight"]["source"] == ["params/head/kernel"]


def test_cli_dispatches_export(tmp_path: Path):
    from torchshell.app.cli import main

    run, _, _ = _run_dir(tmp_path)
    main(["export", str(run), "--format", "torch", "--out", str(tmp_path / "w.pt")])
    assert sorted(torch.load(tmp_path / "w.pt", weights_only=True)) == sorted(
        TwinMLP(features=(16,)).state_dict()
    )


def test_bad_sources_exit_with_a_clear_message(tmp_path: Path, monkeypatch, capsys):
    """Through the CLI: one block without a traceback; 2 for a bad source, 1 for a failure."""
    from torchshell.app.cli import main

    def export(*argv: str) -> tuple[int, str]:
        with pytest.raises(SystemExit) as exit_:
            main(["export", *argv])
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return exit_.value.code, err

    monkeypatch.chdir(tmp_path)
    code, err = export("no-such-run", "--format", "onnx")
    assert code == 2 and "does not exist" in err and "Fix:" in err
    assert not (tmp_path / "mlflow.db").exists()  # a typo creates no store

    (tmp_path / "empty").mkdir()
    code, err = export(str(tmp_path / "empty"), "--format", "torch")
    assert code == 2 and "export/model.safetensors" in err

    run, _, _ = _run_dir(tmp_path, features=(16,))
    cfg = OmegaConf.load(run / "config.yaml")
    cfg.model.flax.features = [8]
    OmegaConf.save(cfg, run / "config.yaml")
    code, err = export(str(run), "--format", "safetensors")
    assert code == 1 and "CheckpointError" in err and "do not fit the twin MLP" in err

    code, err = export(str(run), "--format", "tflite")
    assert code == 2  # argparse names the allowed formats


def test_onnx_export_of_the_two_input_speech_twin_has_dynamic_batch_and_time(tmp_path: Path):
    """The flagship twin (features + frame_mask): batch 1 included and three lengths (0.2 s,
    0.64 s and 5 s of frames) through onnxruntime, against the Flax model."""
    from jaxcore.models.spoken_digits import SpokenDigitsEncoder
    from torchshell.twins.spoken_digits import SpokenDigitsEncoder as Twin

    model_cfg = OmegaConf.load(CONF.with_name("spoken_digits.yaml"))
    cfg = OmegaConf.create({"model": model_cfg, "data": {"n_mels": 40}})
    cfg.model.flax.width, cfg.model.flax.depth, cfg.model.flax.heads = 16, 1, 2  # small
    run = tmp_path / "run"
    run.mkdir()
    OmegaConf.save(cfg, run / "config.yaml")
    model = SpokenDigitsEncoder(width=16, depth=1, heads=2)
    twin = Twin(width=16, depth=1, heads=2)
    features, frame_mask = (a.numpy() for a in twin.example_input(3))
    params = model.init(jax.random.key(1), features, frame_mask)["params"]
    export_twin(params, twin, run / "export" / "model.safetensors")

    out = tmp_path / "speech.onnx"
    export_command([str(run), "--format", "onnx", "--out", str(out)])
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    dims = [i.shape for i in session.get_inputs()]
    assert all(isinstance(d[0], str) and isinstance(d[1], str) for d in dims)  # symbolic
    names = [i.name for i in session.get_inputs()]
    for frames in (21, 64, 501):
        features, frame_mask = (a.numpy() for a in twin.example_input(3, frames))
        for rows in (1, 3):
            feeds = dict(zip(names, (features[:rows], frame_mask[:rows]), strict=True))
            (got,) = session.run(None, feeds)
            want = np.asarray(model.apply({"params": params}, features[:rows], frame_mask[:rows]))
            assert got.shape == (rows, 10) and np.abs(got - want).max() < 1e-4, frames


class _Trim(torch.nn.Module):
    """The speech front end's silence trimming as a module of its own (the mask as float)."""

    dynamic_axes = ({0: "batch", 1: "frames"}, {0: "batch", 1: "frames"})
    check_lengths = (21, 64, 501)

    def forward(self, features: torch.Tensor, frame_mask: torch.Tensor):
        from torchshell.data.spoken_digits import trim_silence

        kept, mask = trim_silence(features, frame_mask)
        return kept, mask.to(kept.dtype)

    def example_input(self, batch: int = 2, frames: int = 64):
        g = torch.Generator().manual_seed(frames)
        features = torch.rand(batch, frames, 40, generator=g) * 0.1  # near-silence
        lengths = torch.randint(frames // 2, frames + 1, (batch,), generator=g)
        for row, n in enumerate(lengths.tolist()):  # a loud span somewhere in each clip
            start = int(torch.randint(0, max(n - 8, 1), (), generator=g))
            features[row, start : start + 8] += 1.0
        return features, torch.arange(frames)[None] < lengths[:, None]


def test_silence_trimming_exports_to_onnx_with_dynamic_batch_and_time(tmp_path: Path):
    """The gather-based trimming (static shapes, data-dependent indices) through
    onnxruntime: batch 1 and 5 at 21, 64 and 501 frames, equal to torch."""
    from torchshell.export import ONNX_ATOL, write_onnx

    trim = _Trim()
    features, mask = trim.example_input(3, 64)
    _, kept_mask = trim(features, mask)
    assert bool((kept_mask.sum(1) < mask.sum(1)).all())  # the silence went
    diff = write_onnx(trim, tmp_path / "trim.onnx")
    assert diff is not None and diff <= ONNX_ATOL
