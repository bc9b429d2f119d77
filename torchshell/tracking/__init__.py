"""MLflow tracking that never slows or kills training.

- :class:`AsyncMLflowLogger`: a Lightning logger; queued, batched, survives store outages,
  ends with a :class:`TrackingReport` of anything not delivered.
- :func:`run_tags`: git commit, library versions, devices, mesh shape, process count.
- :func:`log_confusion_matrix`, :func:`log_torch_model`: the run page's plot and the torch
  twin as a servable MLflow PyTorch model.
- :class:`SystemMetrics`: CPU/memory/disk/network (and GPU) samples as ``system/*`` metrics.
- :class:`PrometheusMetrics`: an opt-in ``/metrics`` endpoint (step, loss, samples/s,
  data wait, recompiles, seconds since the last checkpoint) for Prometheus.
- :func:`replay`: sends an ``undelivered.jsonl`` left by a run whose store was down.

Example:
    >>> import tempfile
    >>> uri = f"sqlite:///{tempfile.mkdtemp()}/mlflow.db"
    >>> logger = AsyncMLflowLogger("demo", tracking_uri=uri, tags=run_tags())
    >>> logger.log_metrics({"train/loss": 1.0}, step=0)
    >>> logger.close().complete
    True
"""

from __future__ import annotations

from torchshell._errors import TrackingError
from torchshell.tracking._artifacts import (
    confusion_matrix,
    default_pip_requirements,
    log_confusion_matrix,
    log_torch_model,
)
from torchshell.tracking._logger import AsyncMLflowLogger, flatten
from torchshell.tracking._prometheus import PrometheusMetrics
from torchshell.tracking._replay import replay
from torchshell.tracking._report import TrackingReport
from torchshell.tracking._system import SystemMetrics
from torchshell.tracking._tags import run_tags

__all__ = [
    "AsyncMLflowLogger",
    "PrometheusMetrics",
    "SystemMetrics",
    "TrackingError",
    "TrackingReport",
    "confusion_matrix",
    "default_pip_requirements",
    "flatten",
    "log_confusion_matrix",
    "log_torch_model",
    "replay",
    "run_tags",
]
