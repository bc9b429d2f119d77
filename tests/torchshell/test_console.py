"""Issue #54: the console keeps the README's promise ("one config line, the parameter table,
one progress bar and the end summary") on the README's commands: a short `coreshell train`,
`train resume=last`, `export RUN --format onnx`; and the lines that were extra before (each
dropped at its source: torchshell/app/quiet.py)."""

from __future__ import annotations

import io
import logging
import re
import threading
from pathlib import Path

from tests.helpers import run_cli_forked
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
            r"^  (metrics|torch weights|open it with): ",
            r"^  compile cache ",
            r"^wrote \S+ \(onnx, \d+ tensors\)$",  # `coreshell export`
            r"^  onnxruntime vs torch: max abs diff ",
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
