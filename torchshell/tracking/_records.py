"""Records -> MLflow calls: batches within MLflow's limits, and transient vs permanent errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException, RestException
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import (
    MAX_ENTITIES_PER_BATCH,
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_TAGS_PER_BATCH,
)

Record = dict[str, Any]

# MLflow error codes that retrying cannot fix: the record itself is refused.
_PERMANENT = {
    "INVALID_PARAMETER_VALUE",
    "BAD_REQUEST",
    "RESOURCE_DOES_NOT_EXIST",
    "INVALID_STATE",
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
}


def metric(key: str, value: float, timestamp_ms: int, step: int) -> Record:
    """A metric record (short keys: a spill file of a long outage stays small)."""
    return {"t": "m", "k": key, "v": value, "ts": timestamp_ms, "s": step}


def param(key: str, value: str) -> Record:
    """A param record."""
    return {"t": "p", "k": key, "v": value}


def tag(key: str, value: str) -> Record:
    """A tag record."""
    return {"t": "g", "k": key, "v": value}


def artifact(path: str, artifact_path: str | None) -> Record:
    """An artifact record: a file or a directory uploaded when it is delivered."""
    return {"t": "a", "path": path, "dir": artifact_path}


def batch_size(records: Iterator[Record]) -> int:
    """How many of the oldest records go in one request.

    An artifact goes alone; metrics, params and tags go together in one ``log_batch`` within
    MLflow's limits (1000 metrics, 100 params, 100 tags, 1000 in all, unique param keys).
    """
    n = metrics = params = tags = 0
    keys: set[str] = set()
    for r in records:
        kind = r["t"]
        if kind == "a":
            return n or 1
        if kind == "m":
            if metrics == MAX_METRICS_PER_BATCH:
                break
            metrics += 1
        elif kind == "p":
            if params == MAX_PARAMS_TAGS_PER_BATCH or r["k"] in keys:
                break
            params += 1
            keys.add(r["k"])
        else:
            if tags == MAX_PARAMS_TAGS_PER_BATCH:
                break
            tags += 1
        n += 1
        if n == MAX_ENTITIES_PER_BATCH:
            break
    return n


def send(client: MlflowClient, run_id: str, chunk: list[Record]) -> None:
    """Delivers one chunk (from :func:`batch_size`) to the run; raises what MLflow raises."""
    if chunk[0]["t"] == "a":
        rec = chunk[0]
        path = Path(rec["path"])
        if path.is_dir():
            client.log_artifacts(run_id, str(path), rec["dir"])
        else:
            client.log_artifact(run_id, str(path), rec["dir"])
        return
    client.log_batch(
        run_id,
        metrics=[Metric(r["k"], r["v"], r["ts"], r["s"]) for r in chunk if r["t"] == "m"],
        params=[Param(r["k"], r["v"]) for r in chunk if r["t"] == "p"],
        tags=[RunTag(r["k"], r["v"]) for r in chunk if r["t"] == "g"],
        synchronous=True,
    )


def is_permanent(error: BaseException) -> bool:
    """True when resending cannot help: MLflow refused the content (a 4xx, a missing file)."""
    if isinstance(error, FileNotFoundError | IsADirectoryError | NotADirectoryError):
        return True
    if isinstance(error, RestException | MlflowException):
        return error.error_code in _PERMANENT or "Invalid artifact path" in error.message
    return False


def server_is_up(uri: str, timeout_s: float = 2.0) -> bool:
    """A quick ``/health`` probe of an ``http(s)://`` tracking server (other stores: True).

    Probing first keeps the delivery thread out of MLflow's own long retry loop (minutes with
    its defaults) while the server is down.
    """
    if not uri.startswith(("http://", "https://")):
        return True
    try:
        return requests.get(uri.rstrip("/") + "/health", timeout=timeout_s).ok
    except requests.RequestException:
        return False
