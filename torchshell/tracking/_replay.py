"""Sends the records a run could not deliver (``undelivered.jsonl``) to the store, in order."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow.tracking import MlflowClient

from torchshell._errors import TrackingError
from torchshell.tracking import _records as delivery
from torchshell.tracking._report import TrackingReport


def replay(path: str | Path, tracking_uri: str | None = None) -> TrackingReport:
    """Sends the records of an ``undelivered.jsonl`` (see :class:`TrackingReport`), in order.

    Records go to the run they were logged for; when that run was never created, a new run
    is created in the same experiment with the same name and tags. Synchronous.

    Args:
        path: the ``undelivered.jsonl`` file.
        tracking_uri: override the store the file names.

    Returns:
        The report of this delivery (``complete`` when all records went through).

    Example:
        >>> import json, tempfile, os
        >>> d = tempfile.mkdtemp(); f = os.path.join(d, "undelivered.jsonl")
        >>> head = {"t": "header", "run_id": None, "tracking_uri": f"sqlite:///{d}/m.db",
        ...         "experiment": "demo", "run_name": None, "tags": {}, "status": "FINISHED"}
        >>> rec = {"t": "m", "k": "loss", "v": 1.0, "ts": 0, "s": 0}
        >>> _ = open(f, "w").write(json.dumps(head) + "\\n" + json.dumps(rec) + "\\n")
        >>> replay(f).delivered
        1
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    if not lines or json.loads(lines[0]).get("t") != "header":
        raise TrackingError(
            f"{path} is not an undelivered-records file (its first line must be the header "
            "AsyncMLflowLogger.close() writes). Fix: pass the undelivered.jsonl of a run."
        )
    head = json.loads(lines[0])
    records = [json.loads(line) for line in lines[1:]]
    uri = tracking_uri or head["tracking_uri"]
    client = MlflowClient(uri)
    run_id = head["run_id"]
    if run_id is None:
        exp = client.get_experiment_by_name(head["experiment"])
        exp_id = exp.experiment_id if exp else client.create_experiment(head["experiment"])
        run_id = client.create_run(exp_id, run_name=head["run_name"], tags=head["tags"]).info.run_id
    report = TrackingReport(run_id=run_id, tracking_uri=uri, queued=len(records))
    while records:
        n = delivery.batch_size(iter(records))
        delivery.send(client, run_id, records[:n])
        report.delivered += n
        records = records[n:]
    client.set_terminated(run_id, head["status"])
    report.status = head["status"]
    return report
