"""A quiet console for ``coreshell train``: each library message a user did not ask for is
silenced at its source (a named logger, one message pattern), with the reason beside it.

Nothing here is a blanket filter: other messages of the same libraries still show (a library
whose ``INFO`` is only a narration of its work keeps its warnings and errors), and
``--verbose`` (or ``HYDRA_FULL_ERROR=1``) skips all of it.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Lightning's rank-zero INFO lines that are not a coreshell user's (see _LOG_LINES)
_LIGHTNING_INFO = (
    r"^(GPU|TPU|HPU) available: |^💡 Tip: |^Restor(ing|ed all) states from the checkpoint"
)

# Lightning's rank-zero logger, by both its names (see _LOG_LINES)
_RANK_ZERO = ("lightning.pytorch.utilities.rank_zero", "pytorch_lightning.utilities.rank_zero")

# Lightning's line when a fit reaches its limit: folded into the end summary (`stopped:`)
_STOPPED = re.compile(r"^`Trainer\.fit` stopped: `(max_(?:steps|epochs)=\S+)` reached\.$")
_stops: list[str] = []

# (logger, message pattern, why it is noise for a coreshell user)
_LOG_LINES = [
    (
        "jax._src.xla_bridge",
        r"Unable to initialize backend",
        "JAX probes for TPU/GPU plugins at start-up and logs each miss at INFO; Hydra's job "
        "logging prints INFO. The devices used are in the config line.",
    ),
    (
        "jax._src.compilation_cache",
        r"Resetting cache at",
        "jaxcore.enable_compile_cache resets JAX's cache object on purpose; the cache's "
        "hits and misses are in the end summary.",
    ),
    *[
        (
            name,
            _LIGHTNING_INFO,
            "Lightning runs on one CPU process by design (JAX owns the devices), so its device "
            "report is always 'not used'; the litlogger advert; the checkpoint a resumed run "
            "restores is in the config line (Lightning said it twice: through its own handler "
            "and Hydra's). Both names: Lightning's rank-zero logger is one object shared by "
            "`lightning` and the "
            "standalone `pytorch_lightning`, named by whichever was imported last "
            "(`mlflow.pytorch` imports `pytorch_lightning` when a run logs its model: the "
            "second job of a sweep printed these lines under that name).",
        )
        for name in _RANK_ZERO
    ],
    (
        "hydra._internal.core_plugins.basic_launcher",
        r"^Launching \d+ jobs locally$|^\t#\d+ : ",
        "Hydra's multirun names each job and all its overrides before it starts; the config "
        "line says `sweep job #N` and the job's folder, and the run's name its overrides "
        "that differ from the defaults.",
    ),
    (
        "torch.onnx._internal.exporter._schemas",
        r"^Missing annotation for parameter ",
        "torch's ONNX exporter builds its table of onnxscript functions on the first export "
        "and notes each untyped parameter of torchvision's ops (roi_align, roi_pool); no "
        "coreshell model uses them. `coreshell export` prints what it wrote and the parity.",
    ),
    (
        "mlflow.store.db.utils",
        r"Creating initial MLflow database tables|Updating database tables",
        "MLflow announces creating its SQLite schema on a new store; the run line says where "
        "the store is.",
    ),
]

# (logger, lowest level shown, why): libraries whose INFO narrates their own work. A logger's
# level holds for every thread (Orbax's async save thread logs after the set-up) and for the
# loggers under it; their WARNING and ERROR still show.
_LOGGER_LEVELS = [
    (
        "absl",
        logging.WARNING,
        "Orbax logs through absl at INFO: each periodic asynchronous checkpoint adds ~30 lines "
        "(handlers, OCDBT, commit threads). Where checkpoints are is in the config.",
    ),
    (
        "orbax",
        logging.WARNING,
        "the same narration from Orbax's modules that log through Python's logging.",
    ),
    (
        "matplotlib",
        logging.WARNING,
        "a first run builds matplotlib's font cache and says 'generated new fontManager'.",
    ),
]

# a line the children of `coreshell launch` print (C++: no logger to filter), dropped from
# their relayed output when the rank reached every peer it expected
GLOO_CONNECTED = re.compile(
    r"^\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
    r"Expected number of connected peer ranks is : \1\s*$"
)

# (category, message pattern, module, why); the category is the builtin base of the one
# raised (Lightning's PossibleUserWarning is a UserWarning): naming it would import Lightning
# (seconds) before a bad config is even told
_WARNINGS = [
    (
        UserWarning,
        r"The number of training batches \(\d+\) is smaller than the logging interval",
        "lightning.pytorch.loops.fit_loop",
        "Lightning compares log_every_n_steps with the batches of one epoch; coreshell logs "
        "every N optimizer steps across epochs, so a short epoch loses no log.",
    ),
]


def verbose() -> bool:
    """Whether ``coreshell --verbose`` or ``HYDRA_FULL_ERROR=1`` asked for everything.

    Example:
        >>> isinstance(verbose(), bool)
        True
    """
    return os.environ.get("HYDRA_FULL_ERROR") == "1" or os.environ.get("CORESHELL_VERBOSE") == "1"


class _Drop(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


class _FoldStop(logging.Filter):
    """Lightning's ```Trainer.fit` stopped: `max_steps=20` reached.``: kept for the end
    summary's ``stopped:`` line (:func:`stopped`), not printed on its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        found = _STOPPED.match(record.getMessage())
        if found is not None:
            _stops.append(found.group(1))
        return found is None


def stopped() -> str | None:
    """The limit the last fit reached (``max_steps=20``), when its line was folded (quiet
    mode); None otherwise (``--verbose`` shows Lightning's line). Taken once.

    Example:
        >>> _ = stopped()  # (what an earlier fit in this process left, taken)
        >>> stopped() is None
        True
    """
    stop = _stops[-1] if _stops else None
    _stops.clear()
    return stop


def _logger(name: str) -> logging.Logger:
    """The logger ``name`` as its library makes it: absl's is an ``ABSLLogger`` that absl
    creates on import (a plain logger made here first would be the one absl gets)."""
    if name == "absl":
        from absl import logging as absl_logging  # orbax's dependency: the log it writes to

        return absl_logging.get_absl_logger()
    return logging.getLogger(name)


def configure(verbose: bool) -> None:
    """Silences the known noise (see ``_LOG_LINES``, ``_LOGGER_LEVELS`` and ``_WARNINGS``)
    and folds Lightning's stop line into the end summary (:func:`stopped`) unless ``verbose``.

    Idempotent: a sweep configures once per job.

    Example:
        >>> configure(verbose=True)  # keeps everything
    """
    if verbose:
        return
    for name, level, _why in _LOGGER_LEVELS:
        logger = _logger(name)
        if logger.level < level:  # NOTSET (0) or chattier: raised; a stricter one is kept
            logger.setLevel(level)
    for name, pattern, _why in _LOG_LINES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_Drop(pattern))
    _stops.clear()  # (a sweep's job starts with none)
    for name in _RANK_ZERO:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _FoldStop) for f in logger.filters):
            logger.addFilter(_FoldStop())
    for category, pattern, module, _why in _WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category, module=module)


@contextmanager
def resuming(ckpt_path: str | None) -> Iterator[None]:
    """Around ``trainer.fit`` of a resumed run: Lightning's warning that the checkpoint
    folder "exists and is not empty" is the point of a resume (the run goes on in its own
    folder, and the config line names the checkpoint). A new run into a full folder (an
    explicit ``ckpt.dir``) still gets it.

    Example:
        >>> with resuming(None):
        ...     pass
    """
    if ckpt_path is None or verbose():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r"Checkpoint directory .* exists and is not empty",
            category=UserWarning,
            module="lightning.pytorch.callbacks.model_checkpoint",
        )
        yield


@contextmanager
def torch_export_notes() -> Iterator[None]:
    """Around saving the twin as MLflow's pt2 model: torch's notes that are not the user's.

    ``torch.export``'s archive reader builds tensors with ``torch.frombuffer`` over a
    read-only buffer of the archive it just wrote and warns that the buffer is not writable
    (nothing writes to it); ``torch.export`` notes each dimension it specialises for the
    example batch, while the logged signature already declares the batch dimension free.
    """
    if verbose():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"The given buffer is not writable", category=UserWarning
        )
        yield


def server_env(work: Path) -> dict[str, str]:
    """The environment of ``mlflow models serve`` that keeps its console to what a user of
    the server reads: the requests (uvicorn's access log) and every warning and error.

    Folded (``--verbose`` keeps them): MLflow's ``Downloading artifacts`` bar (a local copy of
    the model's files) and its INFO narration (``Selected backend for flavor``, ``=== Running
    command 'exec uvicorn ...'``); uvicorn's start and stop narration (``Started server
    process``, ``Waiting for application startup.``, ``Application startup complete.``,
    ``Uvicorn running on ...``, and the four lines of its shutdown): coreshell's one line says
    when the server answers. uvicorn's own logging config, levels changed, written in ``work``.

    Example:
        >>> import tempfile; from pathlib import Path
        >>> env = server_env(Path(tempfile.mkdtemp()))
        >>> sorted(env)
        ['MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR', 'MLFLOW_LOGGING_LEVEL', 'UVICORN_LOG_CONFIG']
    """
    import copy
    import json

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["uvicorn"]["level"] = "WARNING"
    config["loggers"]["uvicorn.error"]["level"] = "WARNING"  # its start/stop narration is INFO
    path = work / "uvicorn-logging.json"
    path.write_text(json.dumps(config))
    return {
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
        "MLFLOW_LOGGING_LEVEL": "WARNING",
        "UVICORN_LOG_CONFIG": str(path),
    }
