"""``AsyncMLflowLogger``: a Lightning logger that never blocks the training loop."""

from __future__ import annotations

import sys
import tempfile
import time
import uuid
from argparse import Namespace
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
from lightning.pytorch.loggers.logger import Logger
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_TAG_VAL_LENGTH, path_not_unique

from torchshell._errors import TrackingError
from torchshell.tracking._delivery import Delivery
from torchshell.tracking._records import artifact, metric, param, tag
from torchshell.tracking._report import TrackingReport

_STATUS = {
    "success": "FINISHED",
    "finished": "FINISHED",
    "failed": "FAILED",
    "aborted": "KILLED",
    "killed": "KILLED",
    "interrupted": "KILLED",
}
_TRUNCATED = "...[truncated; full value in config.yaml]"


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": [1, 2]}`` -> ``{"a.b": 1, "c": [1, 2]}`` (lists stay values).

    Example:
        >>> flatten({"optim": {"lr": 0.1, "betas": [0.9, 0.99]}, "seed": 0})
        {'optim.lr': 0.1, 'optim.betas': [0.9, 0.99], 'seed': 0}
    """
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= flatten(value, name + ".")
        else:
            out[name] = value
    return out


def _directory(artifact_file: str) -> str | None:
    """The artifact directory of ``"a/b/c.txt"`` (``"a/b"``); None at the root."""
    parent = Path(artifact_file).parent.as_posix()
    return None if parent in ("", ".") else parent


def _terminal_status(status: str) -> str:
    upper = status.upper()
    if upper in ("FINISHED", "FAILED", "KILLED"):
        return upper
    if status.lower() not in _STATUS:
        raise TrackingError(
            f"Unknown run status {status!r}; expected one of {sorted(_STATUS)} or "
            "FINISHED/FAILED/KILLED. Fix: pass Lightning's status or an MLflow status."
        )
    return _STATUS[status.lower()]


class AsyncMLflowLogger(Logger):
    """A Lightning ``Logger`` for MLflow that queues, batches and survives store outages.

    ``log_metrics``, ``log_hyperparams`` and the artifact helpers only append to an in-memory
    outbox (a few microseconds); one background thread creates the run and delivers the
    records in order with ``MlflowClient.log_batch`` (up to 1000 metrics per request). When
    the store is unreachable training goes on: the outbox keeps ``max_in_memory`` records and
    spills older ones to a JSONL file, delivery is retried with exponential backoff and
    resumes in order when the store is back. :meth:`close` flushes, ends the run and returns
    a :class:`TrackingReport`; records still undelivered stay in a file :func:`replay` sends.
    Only process 0 (``jax.process_index() == 0``) logs; elsewhere every method is a no-op.

    Args:
        experiment: the MLflow experiment name (created when missing).
        tracking_uri: ``sqlite:///mlflow.db`` (default) or ``http(s)://host:port``.
        run_name: the run's display name.
        run_id: log into this existing run instead of creating one (e.g. on resume).
        tags: run tags (see :func:`run_tags`); values cut to MLflow's tag limit.
        spill_dir: where the spill file, staged artifacts and leftovers go (default: a new
            temporary directory).
        flush_interval_s: how often the thread sends what has queued up.
        max_in_memory: records kept in memory before spilling to disk.
        max_backoff_s: the longest wait between retries while the store is down.
        close_timeout_s: how long :meth:`finalize` and :meth:`close` wait for delivery.
        enabled: force logging on or off (default: on in process 0 only).

    Example:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> logger = AsyncMLflowLogger("demo", tracking_uri=f"sqlite:///{d}/mlflow.db")
        >>> logger.log_hyperparams({"optim": {"lr": 1e-3}})
        >>> logger.log_metrics({"train/loss": 0.5}, step=1)
        >>> report = logger.close()
        >>> report.complete, report.delivered
        (True, 2)
    """

    def __init__(
        self,
        experiment: str = "coreshell",
        *,
        tracking_uri: str = "sqlite:///mlflow.db",
        run_name: str | None = None,
        run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
        spill_dir: str | Path | None = None,
        flush_interval_s: float = 1.0,
        max_in_memory: int = 50_000,
        max_backoff_s: float = 30.0,
        close_timeout_s: float = 60.0,
        enabled: bool | None = None,
    ) -> None:
        super().__init__()
        if not tracking_uri or "://" not in tracking_uri:
            raise TrackingError(
                f"tracking_uri must be a URI like 'sqlite:///mlflow.db' or "
                f"'http://127.0.0.1:5000'; got {tracking_uri!r}. Fix: set tracking.uri."
            )
        for name, value in (
            ("flush_interval_s", flush_interval_s),
            ("max_backoff_s", max_backoff_s),
            ("close_timeout_s", close_timeout_s),
        ):
            if value <= 0:
                raise TrackingError(f"{name} must be > 0; got {value}. Fix: pass a positive value.")
        if max_in_memory < 1:
            raise TrackingError(f"max_in_memory must be >= 1; got {max_in_memory}.")
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment
        self.run_name = run_name
        self.flush_interval_s = flush_interval_s
        self.max_backoff_s = max_backoff_s
        self.close_timeout_s = close_timeout_s
        self.spill_dir = Path(spill_dir or tempfile.mkdtemp(prefix="coreshell-tracking-"))
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        self._client = MlflowClient(tracking_uri)
        self._local_id = "offline-" + uuid.uuid4().hex[:12]
        self._version: str | None = None
        self._status = "FINISHED"
        self._params: dict[str, str] = {}
        self._closed = False
        self.report = TrackingReport(run_id=run_id, tracking_uri=tracking_uri)
        self._delivery = Delivery(
            self._client,
            self.report,
            experiment=experiment,
            spill_dir=self.spill_dir,
            run_name=run_name,
            run_id=run_id,
            tags={k: str(v)[:MAX_TAG_VAL_LENGTH] for k, v in (tags or {}).items()},
            max_in_memory=max_in_memory,
            flush_interval_s=flush_interval_s,
            max_backoff_s=max_backoff_s,
            start=self.enabled,
        )

    # -- Lightning's Logger interface -------------------------------------------------------
    @property
    def name(self) -> str:
        """The experiment name."""
        return self.experiment_name

    @property
    def version(self) -> str:
        """The run id (waits up to 5 s for the run; ``offline-...`` if the store is down)."""
        if self._version is None:
            self._delivery.run_ready.wait(5.0)
            self._version = self._delivery.run_id or self._local_id
        return self._version

    @property
    def run_id(self) -> str | None:
        """The MLflow run id once the run exists (None while the store is unreachable)."""
        return self._delivery.run_id

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def client(self) -> MlflowClient:
        """A synchronous ``MlflowClient`` on the same store (for reading back)."""
        return self._client

    @property
    def experiment(self) -> MlflowClient:
        """Lightning's name for the backend object: the ``MlflowClient``."""
        return self._client

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Queues metric values (converted to float) at ``step`` with the current time."""
        if not self.enabled:
            return
        ts, step = int(time.time() * 1000), int(step or 0)
        self._put([metric(k, float(v), ts, step) for k, v in metrics.items()])

    def log_hyperparams(self, params: Mapping[str, Any] | Namespace, *args: Any, **kw: Any) -> None:
        """Queues params, flattened with dots; values past MLflow's limit are truncated.

        A key logged again with the same value is skipped; with another value it is refused
        (MLflow params are immutable) with a :class:`TrackingError`.
        """
        if not self.enabled:
            return
        if isinstance(params, Namespace):
            params = vars(params)
        records = []
        for key, value in flatten(params).items():
            text = str(value)
            if len(text) > MAX_PARAM_VAL_LENGTH:
                text = text[: MAX_PARAM_VAL_LENGTH - len(_TRUNCATED)] + _TRUNCATED
                self.report.truncated_params.append(key)
            if key in self._params:
                if self._params[key] != text:
                    raise TrackingError(
                        f"Param {key!r} was logged as {self._params[key]!r} and now as {text!r}; "
                        "MLflow params cannot change within a run. Fix: log the new value as "
                        "a metric or a tag, or start a new run."
                    )
                continue
            self._params[key] = text
            records.append(param(key, text))
        self._put(records)

    def finalize(self, status: str) -> None:
        """Lightning's end-of-stage hook: waits for delivery; the run stays open.

        The worst status seen (``failed``) is kept for :meth:`close`.
        """
        if not self.enabled or self._closed:
            return
        mlflow_status = _terminal_status(status)
        if self._status == "FINISHED":
            self._status = mlflow_status
        if not self.flush(self.close_timeout_s):
            print(
                f"tracking: {len(self._delivery)} record(s) not yet delivered to "
                f"{self.tracking_uri}; still retrying",
                file=sys.stderr,
            )

    # -- more logging --------------------------------------------------------------------
    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Queues run tags (values cut to MLflow's tag limit)."""
        if self.enabled:
            self._put([tag(k, str(v)[:MAX_TAG_VAL_LENGTH]) for k, v in tags.items()])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Queues a file or directory upload; it is read when delivered, so keep it there."""
        if not self.enabled:
            return
        path = Path(path)
        if artifact_path is not None and path_not_unique(artifact_path):
            raise TrackingError(
                f"Artifact directory {artifact_path!r} is not a plain relative path. "
                "Fix: pass something like 'plots' or 'export/best', or None for the root."
            )
        if not path.exists():
            raise TrackingError(
                f"Artifact {str(path)!r} does not exist. Fix: write the file before logging it."
            )
        self._put([artifact(str(path.resolve()), artifact_path)])

    def stage_path(self, artifact_file: str) -> Path:
        """A fresh local path for a generated artifact named ``artifact_file``."""
        path = self.spill_dir / "staged" / uuid.uuid4().hex[:8] / artifact_file
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def log_text(self, text: str, artifact_file: str) -> None:
        """Queues ``text`` as the artifact ``artifact_file`` (e.g. ``"hlo/train_step.txt"``)."""
        if not self.enabled:
            return
        path = self.stage_path(artifact_file)
        path.write_text(text, encoding="utf-8")
        self.log_artifact(path, _directory(artifact_file))

    def log_config(self, config: Any, artifact_file: str = "config.yaml") -> None:
        """Logs a config (a dict or an OmegaConf ``DictConfig``) as params and as YAML.

        Args:
            config: the resolved run configuration.
            artifact_file: the name of the full YAML artifact.
        """
        if not self.enabled:
            return
        from omegaconf import DictConfig, OmegaConf

        node = config if isinstance(config, DictConfig) else OmegaConf.create(dict(config))
        container = OmegaConf.to_container(node, resolve=True)
        if not isinstance(container, dict):
            raise TrackingError(f"config must be a mapping; got {type(config).__name__}.")
        self.log_hyperparams({str(k): v for k, v in container.items()})
        self.log_text(OmegaConf.to_yaml(node, resolve=True), artifact_file)

    # -- delivery ------------------------------------------------------------------------
    def _put(self, records: list[dict[str, Any]]) -> None:
        if self._closed:
            raise TrackingError("This logger is closed. Fix: log before close(), or a new logger.")
        if records:
            self.report.queued += len(records)
            self._delivery.put(records)

    def pending(self) -> int:
        """Records queued and not yet delivered."""
        return len(self._delivery)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Waits until everything queued so far is delivered; False on timeout."""
        if not self.enabled:
            return True
        return self._delivery.flush(self.close_timeout_s if timeout_s is None else timeout_s)

    # -- the end -------------------------------------------------------------------------
    def close(self, status: str | None = None, *, timeout_s: float | None = None) -> TrackingReport:
        """Flushes, ends the run and returns what was and was not delivered.

        Args:
            status: the run's final status (default: the worst one :meth:`finalize` saw).
            timeout_s: how long to wait for delivery (default ``close_timeout_s``).

        Returns:
            The :class:`TrackingReport`; it is printed to stderr when anything is missing.
        """
        if not self.enabled or self._closed:
            return self.report
        if status is not None:
            self._status = _terminal_status(status)
        self.flush(timeout_s)
        self._closed = True
        self._delivery.stop()
        self.report.spilled = self._delivery.outbox.spilled_total
        self.report.status = self._status
        run_id = self._delivery.run_id
        if run_id is not None and not len(self._delivery):
            try:
                self._client.set_terminated(run_id, self._status)
            except Exception as error:  # report it, never crash the caller
                self.report.errors.append(f"set_terminated: {error}")
        self._delivery.write_leftovers(self._status)
        if not self.report.complete:
            print(f"tracking: {self.report}", file=sys.stderr)
        return self.report
