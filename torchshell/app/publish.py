"""The end of a run: export, parity, and everything the run page needs to deploy it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchshell.adapters._logs import OWN
from torchshell.app import quiet
from torchshell.app.served import log_waveform_model
from torchshell.data import stop_workers
from torchshell.data._module import SplitDataModule
from torchshell.export import export_module
from torchshell.tracking import AsyncMLflowLogger, log_confusion_matrix, log_torch_model
from torchshell.tracking._artifacts import log_class_report


def predict_test_split(module: Any, data: Any, label_key: str = "y") -> tuple[Any, np.ndarray, Any]:
    """JAX logits over the whole test split, and the labels (every process must call it).

    One pass over one loader, whose workers are stopped at its end. A recipe's test loader is
    split across JAX processes (each evaluates its share); this pass reads the whole split in
    every process (the data module's ``predict_dataloader``), as the predictions are.

    Returns:
        ``(labels per batch or None, logits [N, C], the first batch)``.
    """
    labels, logits, first = [], [], None
    whole = isinstance(data, SplitDataModule)  # (its test loader is split across processes)
    loader = data.predict_dataloader() if whole else data.test_dataloader()
    try:
        for batch in loader:
            first = batch if first is None else first
            logits.append(module.predict_step(batch, 0).numpy())
            labels.append(batch[label_key].numpy() if label_key in batch else None)
    finally:
        stop_workers(loader)
    return labels, np.concatenate(logits), first


def has_forward(twin: torch.nn.Module) -> bool:
    """Whether ``twin`` computes outputs (a LightningModule may define only its steps).

    Example:
        >>> has_forward(torch.nn.Linear(2, 1)), has_forward(torch.nn.Module())
        (True, False)
    """
    import lightning as L

    forward = getattr(type(twin), "forward", None)
    return forward not in (torch.nn.Module.forward, L.LightningModule.forward)


def servable(twin: torch.nn.Module) -> tuple[torch.nn.Module, np.ndarray]:
    """What MLflow serves: ``twin.serving()`` when the recipe defines one (e.g. the audio
    front-end in front of the encoder), else the twin; with a numpy input example."""
    serve: Any = getattr(twin, "serving", twin.eval)()
    example = serve.example_input() if hasattr(serve, "example_input") else None
    if example is None:  # Lightning's own convention
        example = getattr(serve, "example_input_array", None)
    if not isinstance(example, torch.Tensor):
        raise TypeError(
            f"{type(serve).__name__} needs an example_input() (or Lightning's "
            "example_input_array) returning one tensor to be logged as an MLflow model. Fix: "
            "add it, or a serving() method that wraps the twin into a single-input module."
        )
    if example.dim() and example.shape[0] == 1:  # torch.export specialises a batch of 1
        example = example.expand(2, *example.shape[1:]).contiguous()  # two rows keep it free
    return serve, example.numpy()


def spectrogram_png(features: np.ndarray, path: Path) -> Path:
    """A log-mel spectrogram ``[T, n_mels]`` drawn to a PNG (matplotlib's Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.imshow(features.T, origin="lower", aspect="auto")
    ax.set(xlabel="frame", ylabel="mel bin", title="sample input features")
    fig.savefig(path)
    return path


# |jax - torch| <= tol + tol * |torch| on the parity batch, by the step's compute dtype: the
# twin computes in float32; a bfloat16 step carries 8 significant bits (2**-8 = 3.9e-3
# relative per rounding), so its logits may sit ~10 roundings from the twin's
PARITY_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}


def parity_verdict(jax_out: np.ndarray, torch_out: np.ndarray, precision: str) -> dict[str, Any]:
    """The parity figures and verdict at the precision the step computed in.

    Example:
        >>> v = parity_verdict(np.ones(3), np.ones(3) + 9.1e-3, "bf16")
        >>> round(v["parity_max_abs_diff"], 4), v["parity_ok"], v["parity_tolerance"]
        (0.0091, True, 0.05)
        >>> parity_verdict(np.ones(3), np.ones(3) + 9.1e-3, "fp32")["parity_ok"]
        False
    """
    tol = PARITY_TOLERANCE[precision]
    diff = np.abs(np.asarray(jax_out, np.float64) - np.asarray(torch_out, np.float64))
    return {
        "parity_max_abs_diff": float(diff.max(initial=0.0)),
        "parity_ok": bool(np.all(diff <= tol + tol * np.abs(np.asarray(torch_out)))),
        "parity_tolerance": tol,
        "precision": precision,
    }


def publish(
    logger: AsyncMLflowLogger,
    module: Any,
    twin: torch.nn.Module,
    data: Any,
    out_dir: Path,
    *,
    inputs: Sequence[str],
    register_as: str | None = None,
    step: int = 0,
) -> dict[str, Any]:
    """Exports the trained weights to ``twin``, checks parity, and logs the deployable run.

    Logged: ``export/model.safetensors``, ``system/coreshell.export.parity_max_abs_diff``
    (JAX vs torch on a test batch), the model summary, the train step's HLO, a confusion
    matrix PNG (when the batches have labels), a sample spectrogram (audio recipes), and the
    deployable model with signature and input example (optionally registered): a recipe
    whose ``serving()`` module takes ``waveform`` and ``lengths`` is logged as a pyfunc over
    its pt2 program with dynamic batch and time axes (:mod:`torchshell.app.served`), any
    other as an MLflow PyTorch model.

    A twin with no ``forward`` (a LightningModule that computes only in its steps) gets the
    export and the summary; predictions, parity and the served model are skipped, said once.

    Returns:
        ``{"export": path, "parity_max_abs_diff": float | None, "test_accuracy": float |
        None}``, and with a parity check its verdict at the step's precision
        (``parity_ok``, ``parity_tolerance``, ``precision``: :func:`parity_verdict`).
    """
    export_path = export_module(module, twin, out_dir / "export" / "model.safetensors")
    if not has_forward(twin):  # a LightningModule that computes in training_step only
        print(
            f"coreshell: {type(twin).__name__} defines no forward(), so the test-split "
            "predictions, the parity check and the served model are skipped (the trained "
            "weights are in export/model.safetensors and the checkpoints). Fix: define "
            "forward(...) on it."
        )
        logger.log_artifact(export_path, "export")
        logger.log_text(module.summary + "\n", "model_summary.txt")
        return {"export": export_path, "parity_max_abs_diff": None, "test_accuracy": None}
    labels, logits, batch = predict_test_split(module, data)
    with torch.no_grad():
        torch_logits = twin(*(batch[k] for k in inputs))
    precision = "bf16" if getattr(module, "_compute_dtype", None) == "bfloat16" else "fp32"
    verdict = parity_verdict(logits[: len(torch_logits)], torch_logits.detach().numpy(), precision)
    parity = verdict["parity_max_abs_diff"]
    logger.log_metrics({f"{OWN}export.parity_max_abs_diff": parity}, step=step)
    logger.log_artifact(export_path, "export")
    logger.log_text(module.summary + "\n", "model_summary.txt")
    if module.hlo_dump_dir is not None and Path(module.hlo_dump_dir).is_dir():
        logger.log_artifact(module.hlo_dump_dir, "hlo")
    accuracy = None
    if labels and labels[0] is not None and logits.ndim == 2:
        y = np.concatenate(labels)
        log_confusion_matrix(logger, y, logits.argmax(-1))
        log_class_report(  # per-class accuracy, test/examples, a few misclassified clips
            logger,
            y,
            logits.argmax(-1),
            labels=getattr(data, "class_names", None),
            clip=getattr(data, "test_clip", None),
            step=step,
        )
        accuracy = float((logits.argmax(-1) == y).mean())
    if "features" in batch and batch["features"].dim() == 3:
        png = spectrogram_png(batch["features"][0].numpy(), logger.stage_path("spectrogram.png"))
        logger.log_artifact(png, "plots")
    serve: Any = getattr(twin, "serving", twin.eval)()
    with quiet.torch_export_notes():
        if len(getattr(serve, "input_names", ())) > 1:  # waveform + lengths: any clip length
            log_waveform_model(logger, serve, register_as=register_as)
        else:
            log_torch_model(logger, *servable(twin), register_as=register_as)
    return {"export": export_path, **verdict, "test_accuracy": accuracy}
