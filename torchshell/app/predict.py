"""``coreshell predict RUN_OR_MODEL FILES_OR_FOLDER...``: WAV files in, one JSON line per file out.

Scores audio files with the run's served model (the pyfunc over the exported pt2 program,
:mod:`torchshell.app.served`): clips of different lengths go in padded batches with their
lengths. Each file gets one line on stdout, in the order given (a folder: its audio files,
sorted, recursively)::

    {"file": "a.wav", "label": 7, "probabilities": [0.001, ...]}
    {"file": "b.wav", "error": "sample rate 8000 Hz; expected 16000 Hz. Fix: ..."}

A file that is not audio, is empty, has another sample rate or a length outside 0.2-5 s is
reported on its own line and the rest are still scored. A progress bar goes to stderr. Exit
status: 0 every file scored, 1 some file failed, 2 the model or the arguments are bad.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from torchshell._errors import ConfigError
from torchshell.app.served import quiet_pyfunc

FAILED = 1


def audio_files(paths: Sequence[str | Path]) -> list[Path]:
    """The files to score: each named file, and each folder's audio files (sorted).

    Raises:
        ConfigError: a path that does not exist, or a folder without audio files.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp()); (d / "b.wav").touch(); (d / "a.WAV").touch()
        >>> [p.name for p in audio_files([d])]
        ['a.WAV', 'b.wav']
    """
    import soundfile as sf

    suffixes = {f".{ext.lower()}" for ext in sf.available_formats()}
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            inside = sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and p.suffix.lower() in suffixes and not p.name.startswith(".")
            )
            if not inside:
                raise ConfigError(
                    f"The folder {path} holds no audio file (expected one of "
                    f"{sorted(suffixes)[:6]}...). Fix: pass a folder of WAV files."
                )
            found.extend(inside)
        elif path.is_file():
            found.append(path)
        else:
            raise ConfigError(f"{path} does not exist. Fix: pass WAV files or a folder of them.")
    return found


def read_clip(path: Path, spec: dict[str, Any]) -> np.ndarray:
    """A file as float32 mono samples, or a ``ValueError`` saying what is wrong and the fix.

    Args:
        path: an audio file.
        spec: the model's ``serving.json`` (``sample_rate``, ``min_samples``, ``max_samples``).

    Example:
        >>> import soundfile as sf, tempfile, pathlib
        >>> f = pathlib.Path(tempfile.mkdtemp()) / "x.wav"
        >>> sf.write(f, np.zeros(4000, np.float32), 16000)
        >>> spec = {"sample_rate": 16000, "min_samples": 3200, "max_samples": 80000}
        >>> read_clip(f, spec).shape
        (4000,)
    """
    import soundfile as sf

    rate, low, high = spec["sample_rate"], spec["min_samples"], spec["max_samples"]
    try:
        data, file_rate = sf.read(path, dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, OSError) as err:
        raise ValueError(
            f"not an audio file soundfile can read ({err}). Fix: pass 16 kHz mono WAV files."
        ) from None
    if not len(data):
        raise ValueError("the file holds no samples. Fix: record or export the clip again.")
    if file_rate != rate:
        raise ValueError(
            f"sample rate {file_rate} Hz; expected {rate} Hz. Fix: resample it, e.g. "
            f"`sox {path.name} -r {rate} out.wav`."
        )
    if not low <= len(data) <= high:
        raise ValueError(
            f"{len(data)} samples ({len(data) / rate:.3f} s); expected {low / rate:g} s to "
            f"{high / rate:g} s. Fix: trim or split the recording."
        )
    return data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]


def load_served(source: str, tracking_uri: str, work: Path) -> tuple[Any, dict[str, Any]]:
    """The served pyfunc model of a run, and its ``serving.json``.

    Args:
        source: a local MLflow model directory (with ``MLmodel``), a model URI
            (``runs:/ID/model``, ``models:/NAME/VERSION``), an MLflow run id (its
            ``model``), or a run directory (``config.yaml`` + ``export/model.safetensors``:
            the model is exported from it as ``coreshell train`` logs it).
        tracking_uri: the MLflow store of a run id or URI.
        work: a scratch folder (a run directory's model is written there).

    Raises:
        ConfigError: the source is none of those, or its model takes no waveforms.
    """
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    from torchshell.app import quiet
    from torchshell.app.serve import model_uri

    uri = model_uri(source, tracking_uri, work)
    try:
        with _use_tracking_uri(tracking_uri), quiet.torch_export_notes(), quiet_pyfunc():
            model = mlflow.pyfunc.load_model(uri)
    except (MlflowException, OSError) as err:
        raise ConfigError(
            f"Cannot load the MLflow model {uri} ({err}). Fix: pass a run directory, a run id "
            "with --tracking-uri, or a model URI such as runs:/RUN_ID/model."
        ) from err
    names = [spec.name for spec in model.metadata.get_input_schema().inputs]
    if names != ["waveform", "lengths"]:
        raise ConfigError(
            f"The model {uri} takes {names}; expected ['waveform', 'lengths'] (a speech "
            "recipe's served model). Fix: pass the run of a spoken-digits training."
        )
    return model, dict(model.unwrap_python_model().spec)  # its serving.json, loaded


def _batches(items: list[tuple[int, np.ndarray]], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def predict_files(
    model: Any,
    spec: dict[str, Any],
    files: Sequence[Path],
    *,
    batch: int = 16,
    progress: Any = None,
) -> Iterator[dict[str, Any]]:
    """One result per file, in order: ``{"file", "label", "probabilities"}`` or an error.

    Args:
        model: the pyfunc model from :func:`load_served`.
        spec: its ``serving.json``.
        files: audio files.
        batch: clips per model call (padded to the longest, with their lengths).
        progress: called with the number of files done after each batch.
    """
    results: dict[int, dict[str, Any]] = {}
    good: list[tuple[int, np.ndarray]] = []
    for i, path in enumerate(files):
        try:
            good.append((i, read_clip(path, spec)))
        except ValueError as err:
            results[i] = {"file": str(path), "error": str(err)}
    done, emitted = len(results), 0
    for chunk in _batches(good, batch):
        waveform = np.zeros((len(chunk), max(len(c) for _, c in chunk)), np.float32)
        for row, (_, clip) in enumerate(chunk):
            waveform[row, : len(clip)] = clip
        lengths = np.array([len(c) for _, c in chunk], np.int64)
        try:
            with quiet_pyfunc():
                out = model.predict({"waveform": waveform, "lengths": lengths})
        except Exception as err:  # the model refused the batch: each of its files says why
            for i, _ in chunk:
                results[i] = {"file": str(files[i]), "error": f"{type(err).__name__}: {err}"}
        else:
            for row, (i, _) in enumerate(chunk):
                results[i] = {
                    "file": str(files[i]),
                    "label": int(out["label"][row]),
                    "probabilities": [round(float(p), 6) for p in out["probabilities"][row]],
                }
        done += len(chunk)
        if progress is not None:
            progress(done)
        while emitted in results:  # in the order given, as soon as each is known
            yield results.pop(emitted)
            emitted += 1
    while emitted in results:
        yield results.pop(emitted)
        emitted += 1


def predict_command(argv: list[str]) -> int:
    """``coreshell predict RUN_OR_MODEL FILES_OR_FOLDER...``; returns 0, or 1 if a file failed.

    Example:
        >>> predict_command(["--help"])  # doctest: +ELLIPSIS
        usage: coreshell predict ...
        0
    """
    parser = argparse.ArgumentParser(
        prog="coreshell predict",
        description="Score WAV files with a run's served model: one JSON line per file.",
    )
    parser.add_argument(
        "source",
        metavar="RUN_OR_MODEL",
        help="a run directory, an MLflow run id, a model URI (runs:/ID/model) or model folder",
    )
    parser.add_argument("paths", nargs="+", metavar="FILES_OR_FOLDER", help="WAV files, folders")
    parser.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="MLflow store")
    parser.add_argument("--batch", type=int, default=16, help="clips per model call")
    if argv and argv[0] in ("-h", "--help"):
        print(parser.format_usage().rstrip())
        return 0
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    files = audio_files(args.paths)
    failed = 0
    with tempfile.TemporaryDirectory() as work:
        model, spec = load_served(args.source, args.tracking_uri, Path(work))
        columns = (TextColumn("predict"), BarColumn(), MofNCompleteColumn())
        with Progress(*columns, console=Console(file=sys.stderr)) as bar:
            task = bar.add_task("predict", total=len(files))
            for line in predict_files(
                model,
                spec,
                files,
                batch=args.batch,
                progress=lambda n: bar.update(task, completed=n),
            ):
                failed += "error" in line
                print(json.dumps(line), flush=True)
    if failed:
        print(f"coreshell predict: {failed} of {len(files)} files failed", file=sys.stderr)
    return FAILED if failed else 0
