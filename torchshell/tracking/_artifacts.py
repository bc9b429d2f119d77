"""Artifacts worth a run page: a confusion-matrix PNG, per-class accuracy, misclassified
examples (WAV + spectrogram) and the torch twin as an MLflow model."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from torchshell._errors import TrackingError
from torchshell.tracking._records import server_is_up

if TYPE_CHECKING:
    from mlflow.models.model import ModelInfo

    from torchshell.tracking._logger import AsyncMLflowLogger


def confusion_matrix(y_true: Any, y_pred: Any, num_classes: int | None = None) -> np.ndarray:
    """Counts ``[true, predicted]`` over integer labels.

    Example:
        >>> confusion_matrix([0, 1, 1], [0, 1, 0]).tolist()
        [[1, 0], [1, 1]]
    """
    t = np.asarray(y_true).astype(np.int64).ravel()
    p = np.asarray(y_pred).astype(np.int64).ravel()
    if t.shape != p.shape:
        raise TrackingError(
            f"y_true and y_pred must hold one label per example; got {t.size} and {p.size} "
            "labels. Fix: pass the labels and the argmax of the outputs of the same examples."
        )
    n = num_classes or int(max(t.max(initial=0), p.max(initial=0)) + 1)
    if t.size and (min(t.min(), p.min()) < 0 or max(t.max(), p.max()) >= n):
        raise TrackingError(
            f"labels must lie in [0, {n}); got {t.min()}..{t.max()} and "
            f"{p.min()}..{p.max()}. Fix: pass num_classes or valid labels."
        )
    return np.bincount(t * n + p, minlength=n * n).reshape(n, n)


def confusion_matrix_png(matrix: np.ndarray, labels: Sequence[str] | None, path: Any) -> None:
    """Draws the matrix with its counts to a PNG (matplotlib's Agg canvas, no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = matrix.shape[0]
    names = list(labels) if labels is not None else [str(i) for i in range(n)]
    fig = Figure(figsize=(1.0 + 0.5 * n, 1.0 + 0.5 * n), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.imshow(matrix, cmap="Blues")
    ax.set(
        xticks=range(n),
        yticks=range(n),
        xticklabels=names,
        yticklabels=names,
        xlabel="predicted",
        ylabel="true",
        title=f"accuracy {np.trace(matrix) / max(matrix.sum(), 1):.4f}",
    )
    high = matrix.max() / 2 if matrix.size else 0
    for i in range(n):
        for j in range(n):
            ax.text(
                j,
                i,
                str(matrix[i, j]),
                ha="center",
                va="center",
                fontsize=7,
                color="white" if matrix[i, j] > high else "black",
            )
    fig.tight_layout()
    fig.savefig(path, format="png")


def log_confusion_matrix(
    logger: AsyncMLflowLogger,
    y_true: Any,
    y_pred: Any,
    *,
    labels: Sequence[str] | None = None,
    artifact_file: str = "plots/confusion_matrix.png",
) -> np.ndarray:
    """Queues a confusion-matrix PNG of a classification run; returns the matrix.

    Example:
        >>> import tempfile
        >>> from torchshell.tracking import AsyncMLflowLogger
        >>> lg = AsyncMLflowLogger("demo", tracking_uri=f"sqlite:///{tempfile.mkdtemp()}/m.db")
        >>> log_confusion_matrix(lg, [0, 1, 1], [0, 1, 0]).sum(), lg.close().complete
        (np.int64(3), True)
    """
    matrix = confusion_matrix(y_true, y_pred, len(labels) if labels is not None else None)
    if logger.enabled:
        path = logger.stage_path(artifact_file.rsplit("/", 1)[-1])
        confusion_matrix_png(matrix, labels, path)
        logger.log_artifact(path, artifact_file.rsplit("/", 1)[0] if "/" in artifact_file else None)
    return matrix


def default_pip_requirements() -> list[str]:
    """Pinned requirements of a served torch twin: torch, numpy and mlflow as installed."""
    return [f"{p}=={metadata.version(p).split('+')[0]}" for p in ("torch", "numpy", "mlflow")]


def log_torch_model(
    logger: AsyncMLflowLogger,
    twin: torch.nn.Module,
    input_example: np.ndarray,
    *,
    name: str = "model",
    register_as: str | None = None,
    pip_requirements: Sequence[str] | None = None,
) -> ModelInfo | None:
    """Logs the torch twin as an MLflow PyTorch model of the run, servable by MLflow.

    The signature comes from ``input_example`` and the twin's output on it; requirements are
    pinned explicitly (inferring them takes ~10 s). The call is synchronous: it waits for
    the run to exist. If the store is unreachable the model is saved locally, queued as an
    artifact directory ``name`` for later delivery, and None is returned.

    Args:
        logger: the run's logger.
        twin: the torch module with the trained weights (put in eval mode here).
        input_example: a numpy batch of the twin's input (a few rows).
        name: the model's name in the run (``runs:/<run_id>/<name>``).
        register_as: register the model in the Model Registry under this name.
        pip_requirements: override :func:`default_pip_requirements`.

    Returns:
        MLflow's ``ModelInfo`` (``model_uri``, ``registered_model_version``), or None.

    Example:
        >>> import numpy as np, tempfile
        >>> from torchshell.tracking import AsyncMLflowLogger
        >>> from torchshell.twins.digits import MLP
        >>> lg = AsyncMLflowLogger("demo", tracking_uri=f"sqlite:///{tempfile.mkdtemp()}/m.db")
        >>> info = log_torch_model(lg, MLP(features=(8,)), np.ones((2, 64), np.float32))
        >>> info.model_uri.startswith("models:/"), lg.close().complete
        (True, True)
    """
    import mlflow
    from mlflow.models import infer_signature
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    if not isinstance(input_example, np.ndarray):
        raise TrackingError(
            f"input_example must be a numpy array (MLflow needs one to save an example); got "
            f"{type(input_example).__name__}. Fix: pass batch['x'][:4].numpy()."
        )
    if not logger.enabled:
        return None
    twin.eval()
    with torch.no_grad():
        output = twin(torch.from_numpy(input_example)).numpy()
    kwargs: dict[str, Any] = {
        "signature": infer_signature(input_example, output),
        "input_example": input_example,
        "pip_requirements": list(pip_requirements or default_pip_requirements()),
        # torch.export's pt2 archive, never a pickle: loading it runs no user code
        "serialization_format": "pt2",
    }
    _ = logger.version  # waits a few seconds for the run to exist
    if logger.run_id is not None and server_is_up(logger.tracking_uri):
        try:
            with _use_tracking_uri(logger.tracking_uri), mlflow.start_run(run_id=logger.run_id):
                return mlflow.pytorch.log_model(
                    twin, name=name, registered_model_name=register_as, **kwargs
                )
        except Exception as error:  # the store went away: keep it locally
            logger.report.errors.append(f"log_torch_model: {type(error).__name__}: {error}")
    local = logger.stage_path(name)
    mlflow.pytorch.save_model(twin, str(local), **kwargs)
    logger.log_artifact(local, name)
    return None


def per_class_table(matrix: np.ndarray, labels: Sequence[str] | None = None) -> str:
    """A CSV of per-class examples, correct predictions and accuracy from a confusion matrix.

    Example:
        >>> print(per_class_table(np.array([[3, 1], [0, 2]]), ["no", "yes"]))
        class,examples,correct,accuracy
        no,4,3,0.7500
        yes,2,2,1.0000
        <BLANKLINE>
    """
    names = list(labels) if labels is not None else [str(i) for i in range(matrix.shape[0])]
    rows = ["class,examples,correct,accuracy"]
    for name, row, hit in zip(names, matrix, np.diag(matrix), strict=True):
        rows.append(f"{name},{row.sum()},{hit},{hit / max(row.sum(), 1):.4f}")
    return "\n".join(rows) + "\n"


def _spectrogram_png(features: np.ndarray, title: str, path: Any) -> None:
    """Log-mel features ``[T, n_mels]`` drawn to a PNG (matplotlib's Agg canvas, no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.imshow(np.asarray(features).T, origin="lower", aspect="auto")
    ax.set(xlabel="frame (10 ms)", ylabel="mel band", title=title)
    fig.tight_layout()
    fig.savefig(path, format="png")


def log_class_report(
    logger: AsyncMLflowLogger,
    y_true: Any,
    y_pred: Any,
    *,
    labels: Sequence[str] | None = None,
    clip: Any = None,
    max_clips: int = 4,
    prefix: str = "test",
    step: int = 0,
) -> dict[str, float]:
    """Per-class accuracy (metrics and a CSV table) and a few misclassified examples.

    Logged: ``{prefix}/examples`` (the split's size), ``{prefix}/accuracy_<class>`` per
    class, ``tables/{prefix}_per_class_accuracy.csv``, and, when ``clip`` is given, the first
    ``max_clips`` misclassified examples under ``misclassified/``: each as a WAV and its
    spectrogram PNG, named ``<index>_<true>_as_<predicted>``.

    Args:
        logger: the run's logger.
        y_true: the labels, in the order of ``clip``'s indices.
        y_pred: the predicted labels.
        labels: class names (``"0"``, ``"1"``, ... when ``None``).
        clip: ``clip(i) -> {"wave": float[N], "rate": int, "features": [T, F],
            "description": str}`` for example ``i`` (a data module's ``test_clip``).
        max_clips: misclassified examples to keep.
        prefix: the metrics' prefix.
        step: the metrics' step.

    Returns:
        The metrics logged.

    Example:
        >>> import tempfile
        >>> from torchshell.tracking import AsyncMLflowLogger
        >>> lg = AsyncMLflowLogger("demo", tracking_uri=f"sqlite:///{tempfile.mkdtemp()}/m.db")
        >>> log_class_report(lg, [0, 1, 1], [0, 1, 0])["test/accuracy_1"], lg.close().complete
        (0.5, True)
    """
    t = np.asarray(y_true).astype(np.int64).ravel()
    p = np.asarray(y_pred).astype(np.int64).ravel()
    matrix = confusion_matrix(t, p, len(labels) if labels is not None else None)
    names = list(labels) if labels is not None else [str(i) for i in range(matrix.shape[0])]
    metrics = {f"{prefix}/examples": float(t.size)}
    for name, row, hit in zip(names, matrix, np.diag(matrix), strict=True):
        if row.sum():
            metrics[f"{prefix}/accuracy_{name}"] = float(hit / row.sum())
    if not logger.enabled:
        return metrics
    logger.log_metrics(metrics, step=step)
    logger.log_text(per_class_table(matrix, names), f"tables/{prefix}_per_class_accuracy.csv")
    if clip is None:
        return metrics
    import soundfile as sf

    for i in np.flatnonzero(t != p)[:max_clips]:
        example = clip(int(i))
        stem = f"{i}_{names[t[i]]}_as_{names[p[i]]}"
        wav = logger.stage_path(f"{stem}.wav")
        wave = np.asarray(example["wave"], dtype=np.float32).ravel()
        sf.write(wav, np.clip(wave, -1.0, 1.0), int(example["rate"]), subtype="PCM_16")
        logger.log_artifact(wav, "misclassified")
        png = logger.stage_path(f"{stem}.png")
        title = f"{example.get('description', '')}: {names[t[i]]} taken for {names[p[i]]}"
        _spectrogram_png(example["features"], title, png)
        logger.log_artifact(png, "misclassified")
    return metrics
