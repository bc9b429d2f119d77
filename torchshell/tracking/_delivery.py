"""The delivery of one run: a background thread that creates the run, sends the outbox in
order, backs off while the store is down, and writes what is left to a file at the end."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from torchshell.tracking._outbox import Outbox
from torchshell.tracking._records import batch_size, is_permanent, send, server_is_up
from torchshell.tracking._report import TrackingReport

log = logging.getLogger("torchshell.tracking")


class Delivery:
    """Queue (an :class:`Outbox` that spills to disk), delivery thread and leftovers.

    Args:
        client: the ``MlflowClient`` of the store.
        report: the :class:`TrackingReport` the counts go into.
        experiment: the experiment name (created when missing).
        run_name: the run's display name.
        run_id: an existing run to log into, or None to create one.
        tags: the new run's tags.
        spill_dir: where the spill file and the leftovers go.
        max_in_memory: records kept in memory before spilling.
        flush_interval_s: how often the thread sends what has queued up.
        max_backoff_s: the longest wait between retries while the store is down.
        start: start the thread now (False: a disabled logger, nothing is sent).

    Example:
        >>> import tempfile, pathlib
        >>> from torchshell.tracking._records import metric
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> uri = f"sqlite:///{d}/m.db"
        >>> rep = TrackingReport(run_id=None, tracking_uri=uri)
        >>> dv = Delivery(MlflowClient(uri), rep, experiment="demo", spill_dir=d)
        >>> dv.put([metric("loss", 1.0, 0, 0)]); dv.flush(30.0), rep.delivered
        (True, 1)
        >>> dv.stop()
    """

    def __init__(
        self,
        client: MlflowClient,
        report: TrackingReport,
        *,
        experiment: str,
        spill_dir: Path,
        run_name: str | None = None,
        run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
        max_in_memory: int = 50_000,
        flush_interval_s: float = 1.0,
        max_backoff_s: float = 30.0,
        start: bool = True,
    ) -> None:
        self.client = client
        self.report = report
        self.tracking_uri = report.tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.run_id = run_id
        self.tags = dict(tags or {})
        self.spill_dir = spill_dir
        self.flush_interval_s = flush_interval_s
        self.max_backoff_s = max_backoff_s
        self.outbox = Outbox(spill_dir / "spill.jsonl", max_in_memory=max_in_memory)
        self.run_ready = threading.Event()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._down = False
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._loop, name="mlflow-delivery", daemon=True)
            self._thread.start()

    def __len__(self) -> int:
        return len(self.outbox)

    def put(self, chunk: list[dict[str, Any]]) -> None:
        """Queues records (a few microseconds); a big chunk wakes the thread at once."""
        self.outbox.extend(chunk)
        if len(chunk) >= 1000:
            self._wake.set()

    def flush(self, timeout_s: float) -> bool:
        """Waits until everything queued so far is delivered; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while len(self.outbox) and time.monotonic() < deadline:
            if self._thread is None or not self._thread.is_alive():
                break
            self._wake.set()
            time.sleep(0.01)
        return len(self.outbox) == 0

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops the thread (after :meth:`flush`) and joins it."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    # -- the thread ------------------------------------------------------------------------
    def _ensure_run(self) -> None:
        if self.run_id is not None:
            self.run_ready.set()
            return
        if not server_is_up(self.tracking_uri):
            raise ConnectionError(f"tracking server {self.tracking_uri} is unreachable")
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is None:
            try:
                exp_id = self.client.create_experiment(self.experiment)
            except MlflowException:  # created meanwhile by another process
                exp = self.client.get_experiment_by_name(self.experiment)
                if exp is None:
                    raise
                exp_id = exp.experiment_id
        else:
            exp_id = exp.experiment_id
        run = self.client.create_run(exp_id, run_name=self.run_name, tags=self.tags)
        self.run_id = self.report.run_id = run.info.run_id
        self.run_ready.set()

    def _loop(self) -> None:
        backoff = 0.0
        while True:
            try:
                self._ensure_run()
                chunk = self.outbox.take(batch_size)
                if chunk:
                    self._send(chunk)
                if self._down:
                    log.warning("tracking: %s is reachable again; replaying", self.tracking_uri)
                self._down, backoff = False, 0.0
                if chunk:
                    continue
            except Exception as error:  # transient: keep training, retry later
                if not self._down:
                    self._down = True
                    self.report.outages += 1
                    log.warning(
                        "tracking: %s unreachable (%s); buffering and retrying",
                        self.tracking_uri,
                        error,
                    )
                self.report.errors = [*self.report.errors[-9:], f"{type(error).__name__}: {error}"]
                backoff = min(max(2 * backoff, 0.25), self.max_backoff_s)
                if self._stop.is_set():
                    return
                self._wake.wait(backoff)
                self._wake.clear()
                continue
            if self._stop.is_set():
                return
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()

    def _send(self, chunk: list[dict[str, Any]]) -> None:
        if not server_is_up(self.tracking_uri):
            raise ConnectionError(f"tracking server {self.tracking_uri} is unreachable")
        run_id = str(self.run_id)  # _ensure_run ran
        try:
            send(self.client, run_id, chunk)
            self.report.delivered += len(chunk)
        except Exception as error:
            if not is_permanent(error):
                raise
            self._send_one_by_one(run_id, chunk)
        self.outbox.ack()

    def _send_one_by_one(self, run_id: str, chunk: list[dict[str, Any]]) -> None:
        """Isolates the records the store refuses; transient errors still propagate."""
        done = 0
        try:
            for record in chunk:
                try:
                    send(self.client, run_id, [record])
                    self.report.delivered += 1
                except Exception as error:
                    if not is_permanent(error):
                        raise
                    what = record.get("k", record.get("path"))
                    self.report.rejected.append(f"{what}: {type(error).__name__}: {error}")
                done += 1
        finally:
            if done < len(chunk):
                self.outbox.replace_inflight(chunk[done:])

    # -- the end ---------------------------------------------------------------------------
    def write_leftovers(self, status: str) -> None:
        """Moves what was not delivered to ``undelivered.jsonl`` (:func:`replay` sends it)."""
        left = self.outbox.drain()
        self.report.undelivered = len(left)
        if not left:
            return
        path = self.spill_dir / "undelivered.jsonl"
        header = {
            "t": "header",
            "run_id": self.run_id,
            "tracking_uri": self.tracking_uri,
            "experiment": self.experiment,
            "run_name": self.run_name,
            "tags": self.tags,
            "status": status,
        }
        with path.open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in [header, *left])
        self.report.undelivered_file = str(path)
