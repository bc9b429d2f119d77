"""Per-process figures (data wait per host, ...) aggregated before process 0 logs them."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from jax.experimental import multihost_utils


def aggregate_hosts(values: Mapping[str, float]) -> dict[str, float]:
    """Mean, min and max of per-process values over all processes.

    A collective: every process must call it with the same keys at the same step. With one
    process the three figures equal the value.

    Args:
        values: this process's figures, e.g. ``{"perf/data_wait_fraction": 0.12}``.

    Returns:
        ``{"<key>/mean": ..., "<key>/min": ..., "<key>/max": ...}`` for every key.

    Example:
        >>> aggregate_hosts({"perf/data_wait_fraction": 0.25})["perf/data_wait_fraction/max"]
        0.25
    """
    keys = sorted(values)
    local = np.asarray([float(values[k]) for k in keys], dtype=np.float32)
    table = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, len(keys))
    out: dict[str, float] = {}
    for i, key in enumerate(keys):
        column = table[:, i]
        out |= {
            f"{key}/mean": float(column.mean()),
            f"{key}/min": float(column.min()),
            f"{key}/max": float(column.max()),
        }
    return out
