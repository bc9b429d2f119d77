"""The MLflow model of a waveform recipe: the serving module's fastest core behind a pyfunc.

``mlflow.pytorch`` takes one array (``Tensor('float32', (-1, 8000))`` for the speech recipe:
every clip the example's length). A batch of clips of different lengths needs two named
inputs, so the speech model is logged as a pyfunc from code
(:mod:`torchshell.app.waveform_model`) over the JAX core with dynamic batch and sample axes
(:mod:`torchshell.app.served_core`; ONNX Runtime for small batches), or ``torch.export``'s
program (``core="pt2"``). The request format is documented there and in ``docs/serving.md``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchshell.export import export_program

MIN_SECONDS, MAX_SECONDS = 0.2, 5.0
CODE = Path(__file__).with_name("waveform_model.py")


class _DropValidating(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not re.search(r"Validating input example", record.getMessage())


@contextlib.contextmanager
def quiet_pyfunc() -> Iterator[None]:
    """While a pyfunc model is saved or loaded: MLflow's notes that are not the user's.

    Each silenced at its source, for the call only: the INFO line ``Validating input example
    against model signature`` (MLflow runs the example through the model, as asked) and the
    ``Downloading artifacts`` bars (local copies of the run's own files). ``--verbose`` keeps
    both.

    Example:
        >>> with quiet_pyfunc():
        ...     pass
    """
    from torchshell.app.quiet import verbose

    if verbose():
        yield
        return
    logger, drop = logging.getLogger("mlflow.pyfunc"), _DropValidating()
    bar = os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")
    logger.addFilter(drop)
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    try:
        yield
    finally:
        logger.removeFilter(drop)
        if bar is None:
            os.environ.pop("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", None)
        else:
            os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = bar


def serving_spec(serving: torch.nn.Module, num_classes: int) -> dict[str, Any]:
    """What the pyfunc validates requests against (written as ``serving.json``).

    Example:
        >>> serving_spec(torch.nn.Identity(), 10)["max_samples"]
        80000
    """
    from torchshell.data.spoken_digits import SAMPLE_RATE

    rate = int(getattr(serving, "sample_rate", SAMPLE_RATE))
    return {
        "sample_rate": rate,
        "min_samples": round(MIN_SECONDS * rate),
        "max_samples": round(MAX_SECONDS * rate),
        "num_classes": num_classes,
        "inputs": list(getattr(serving, "input_names", ("waveform", "lengths"))),
    }


def signature(num_classes: int) -> Any:
    """The model's signature: variable batch and time (``-1``) on every tensor.

    Example:
        >>> signature(10).inputs.to_dict()[0]["tensor-spec"]["shape"]
        (-1, -1)
    """
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    f32, i64 = np.dtype(np.float32), np.dtype(np.int64)
    return ModelSignature(
        inputs=Schema([TensorSpec(f32, (-1, -1), "waveform"), TensorSpec(i64, (-1,), "lengths")]),
        outputs=Schema(
            [
                TensorSpec(f32, (-1, num_classes), "logits"),
                TensorSpec(f32, (-1, num_classes), "probabilities"),
                TensorSpec(i64, (-1,), "label"),
            ]
        ),
    )


def save_waveform_model(
    serving: torch.nn.Module, path: str | Path, *, core: str = "jax"
) -> dict[str, Any]:
    """Writes the pyfunc model directory (``MLmodel``, the core's files, ``serving.json``).

    Args:
        serving: the waveform module (``forward(waveform[B, N], lengths[B]) -> logits``)
            with ``example_input()`` and ``dynamic_axes``.
        path: a directory that does not exist yet.
        core: ``"jax"`` (the served default) or ``"pt2"`` (:func:`waveform_model_kwargs`).

    Returns:
        The keyword arguments ``mlflow.pyfunc.log_model`` takes for the same model.
    """
    import mlflow

    with tempfile.TemporaryDirectory(prefix="coreshell-served-") as work:  # copied into path
        kwargs = waveform_model_kwargs(serving, Path(work), core=core)
        with quiet_pyfunc():
            mlflow.pyfunc.save_model(str(path), **kwargs)
    return kwargs


def waveform_model_kwargs(
    serving: torch.nn.Module, work: Path, *, core: str = "jax"
) -> dict[str, Any]:
    """Writes the model's core into ``work``; returns pyfunc ``log_model``/``save_model`` kwargs.

    Args:
        serving: the waveform module.
        work: folder for the artifacts.
        core: ``"jax"``: the JAX front end and encoder as ``jax.export`` programs, the encoder
            in ONNX Runtime for small batches (:mod:`torchshell.app.served_core`); served
            with jax, jaxlib, numpy, mlflow (and onnxruntime). ``"pt2"``: ``torch.export``'s
            program of ``serving`` (the model before #54; any serving module); served with
            torch, numpy, mlflow.

    Example:
        >>> from torchshell.twins.spoken_digits import SpokenDigitsEncoder
        >>> serving = SpokenDigitsEncoder(width=16, depth=1, heads=2).serving()
        >>> kw = waveform_model_kwargs(serving, Path(tempfile.mkdtemp()), core="pt2")
        >>> sorted(kw["artifacts"]), kw["input_example"]["lengths"].tolist()
        (['program', 'serving'], [8000, 4800])
    """
    from torchshell.tracking import default_pip_requirements

    if core not in ("jax", "pt2"):
        raise ValueError(f"core={core!r}: expected 'jax' or 'pt2'. Fix: pass one of them.")
    serving.eval()
    make: Any = serving.example_input  # the module's own method
    waveform, lengths = make()
    with torch.no_grad():
        num_classes = int(serving(waveform, lengths).shape[-1])
    work.mkdir(parents=True, exist_ok=True)
    spec = serving_spec(serving, num_classes)
    schema = signature(num_classes)
    if core == "jax":
        from torchshell.app.served_core import write_jax_core

        artifacts, entries = write_jax_core(serving, work, spec["max_samples"])
        requirements = entries.pop("requirements")
        spec.update(entries)
        # MLflow's scoring server deep-copies a request's lists and converts them per the
        # signature before `predict` (a third of a batch-64 request's time, as long as one of
        # its two JSON parses); `predict` validates and converts every request itself
        # (`validated`), so the model says so as a model typed by its hints does (the MLmodel
        # field `is_signature_from_type_hint: true`): the request's lists come straight in.
        # The signature stays the explicit tensors above. And in `mlflow models serve` the
        # model makes the server decode each request's JSON once, not twice
        # (`waveform_model.decode_once`: the other half of a batch-64 request's time).
        schema._is_signature_from_type_hint = True
        spec["decode_once"] = True
    else:
        program = export_program(serving, (waveform, lengths))
        torch.export.save(program, work / "program.pt2")
        artifacts, requirements = {"program": str(work / "program.pt2")}, default_pip_requirements()
        spec["core"] = "pt2"
    (work / "serving.json").write_text(json.dumps(spec, indent=1))
    return {
        "python_model": str(CODE),
        "artifacts": {**artifacts, "serving": str(work / "serving.json")},
        "signature": schema,
        "input_example": {"waveform": waveform.numpy(), "lengths": lengths.numpy()},
        "pip_requirements": requirements,
    }


def log_waveform_model(
    logger: Any, serving: torch.nn.Module, *, name: str = "model", register_as: str | None = None
) -> Any:
    """Logs the waveform pyfunc model into the run (``runs:/<run_id>/<name>``).

    As :func:`torchshell.tracking.log_torch_model`: when the store is unreachable, the model is
    saved locally and queued as an artifact directory ``name``, and None is returned.

    Returns:
        MLflow's ``ModelInfo``, or None.
    """
    import mlflow
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    from torchshell.tracking._records import server_is_up

    if not logger.enabled:
        return None
    with tempfile.TemporaryDirectory(prefix="coreshell-served-") as work:  # copied when logged
        kwargs = waveform_model_kwargs(serving, Path(work))
        _ = logger.version  # waits a few seconds for the run to exist
        if logger.run_id is not None and server_is_up(logger.tracking_uri):
            try:
                with (
                    _use_tracking_uri(logger.tracking_uri),
                    mlflow.start_run(run_id=logger.run_id),
                    quiet_pyfunc(),
                ):
                    return mlflow.pyfunc.log_model(
                        name=name, registered_model_name=register_as, **kwargs
                    )
            except Exception as error:  # the store went away: keep it locally
                logger.report.errors.append(f"log_waveform_model: {type(error).__name__}: {error}")
        local = logger.stage_path(name)
        with quiet_pyfunc():
            mlflow.pyfunc.save_model(str(local), **kwargs)
    logger.log_artifact(local, name)
    return None
