"""Sends the records a run could not deliver (``undelivered.jsonl``) to the store, in order."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from mlflow.tracking import MlflowClient

from torchshell._errors import TrackingError
from torchshell.tracking._records import batch_size, send, server_is_up
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
    try:
        while records:
            n = batch_size(iter(records))
            send(client, run_id, records[:n])
            report.delivered += n
            records = records[n:]
    finally:  # what is left (the store went away again) stays for the next replay, once
        if records:
            head["run_id"] = run_id
            lines = [json.dumps(head), *(json.dumps(r) for r in records)]
            Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
    client.set_terminated(run_id, head["status"])
    report.status = head["status"]
    return report


PENDING = "undelivered.jsonl"
REPLAYED = "replayed.jsonl"


def pending_files(*roots: str | Path, patterns: tuple[str, ...] = ("**/" + PENDING,)) -> list[Path]:
    """The ``undelivered.jsonl`` files under ``roots`` (a file itself counts), oldest first.

    Example:
        >>> import tempfile
        >>> pending_files(tempfile.mkdtemp())
        []
    """
    found: set[Path] = set()
    for root in map(Path, roots):
        if root.is_file():
            found.add(root.resolve())
        elif root.is_dir():
            for pattern in patterns:
                found |= {p.resolve() for p in root.glob(pattern) if p.is_file()}
    return sorted(found, key=lambda p: p.stat().st_mtime)


def replay_pending(
    *roots: str | Path,
    patterns: tuple[str, ...] = ("**/" + PENDING,),
    tracking_uri: str | None = None,
    log: Callable[[str], None] = print,
) -> list[TrackingReport]:
    """Replays every ``undelivered.jsonl`` under ``roots`` whose store is reachable.

    Each file replayed in full is renamed ``replayed.jsonl`` (so it is never sent twice); a
    store still down is skipped with a line, its file kept for the next try; a replay cut
    short keeps only the records not yet sent. ``coreshell tracking replay [PATH...]`` and
    the start of every ``coreshell train`` (the earlier runs beside its run directory) call
    this.

    Args:
        roots: files or directories to search.
        patterns: glob patterns of the files under a directory.
        tracking_uri: send to this store instead of the one each file names.
        log: where the one-line summaries go.

    Returns:
        The report of each replay that completed.

    Example:
        >>> import tempfile
        >>> replay_pending(tempfile.mkdtemp())
        []
    """
    done = []
    for path in pending_files(*roots, patterns=patterns):
        try:
            head = json.loads(path.open(encoding="utf-8").readline())
            uri = tracking_uri or head["tracking_uri"]
            if uri.startswith("http") and not server_is_up(uri):
                log(f"coreshell: tracking store {uri} still unreachable; kept {path} for later")
                continue
            report = replay(path, tracking_uri)
        except TrackingError:
            raise
        except Exception as error:  # the store went away mid-replay: the rest is kept
            log(f"coreshell: replay of {path} stopped ({error}); the rest is kept for later")
            continue
        path.replace(path.with_name(REPLAYED))
        log(
            f"coreshell: replayed {report.delivered} tracking record(s) of an earlier run "
            f"from {path} into MLflow run {report.run_id}"
        )
        done.append(report)
    return done
