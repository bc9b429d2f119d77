"""What reached the tracking store and what did not: the summary a run ends with."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrackingReport:
    """The delivery summary of one logger (or of one :func:`replay`).

    Attributes:
        run_id: the MLflow run, or None when it could never be created.
        tracking_uri: where the records went.
        status: the run's final MLflow status (``FINISHED``, ``FAILED``, ``KILLED``).
        queued: records handed to the logger (metric values, params, tags, artifacts).
        delivered: records the store accepted.
        rejected: the records the store refused for good, each with its reason.
        truncated_params: params whose value was cut to MLflow's limit (full value in
            ``config.yaml`` when logged with ``log_config``).
        spilled: records that waited on disk because the buffer was full.
        outages: times the store became unreachable during the run.
        undelivered: records still not delivered at the end.
        undelivered_file: the JSONL file holding them; :func:`replay` sends it later.
        errors: the last errors seen (connection, terminate, model logging).
    """

    run_id: str | None
    tracking_uri: str
    status: str = "RUNNING"
    queued: int = 0
    delivered: int = 0
    rejected: list[str] = field(default_factory=list)
    truncated_params: list[str] = field(default_factory=list)
    spilled: int = 0
    outages: int = 0
    undelivered: int = 0
    undelivered_file: str | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """True when every record reached the store and none was refused."""
        return self.undelivered == 0 and not self.rejected and self.run_id is not None

    def __str__(self) -> str:
        head = (
            f"MLflow run {self.run_id} at {self.tracking_uri}: {self.status}; "
            f"{self.delivered}/{self.queued} records delivered"
        )
        lines = [head]
        if self.outages:
            lines.append(
                f"  the store was unreachable {self.outages} time(s); "
                f"{self.spilled} records waited on disk"
            )
        if self.truncated_params:
            lines.append(
                f"  {len(self.truncated_params)} param value(s) truncated to MLflow's limit: "
                + ", ".join(self.truncated_params[:5])
            )
        if self.rejected:
            lines.append(f"  {len(self.rejected)} record(s) refused by the store:")
            lines += [f"    {r}" for r in self.rejected[:10]]
        if self.undelivered:
            lines.append(
                f"  NOT DELIVERED: {self.undelivered} record(s), kept in {self.undelivered_file}."
                " Send them when the store is back: coreshell tracking replay "
                f"{self.undelivered_file} (the next coreshell train beside this run does it too)"
            )
        lines += [f"  error: {e}" for e in self.errors[-3:]]
        return "\n".join(lines)
