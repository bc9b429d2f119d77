"""The tracking outage soak, tiny: a real `mlflow server` killed for a stretch of a real
`coreshell train` and restarted, then killed until the run ends; `coreshell tracking replay`
sends the rest. 0 metrics lost, order kept (the full 5-minute soak: benchmarks/outage_soak.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import outage_soak


@pytest.mark.timeout(1500)  # two server restarts and a run: minutes on 2 shared cores
def test_an_outage_loses_no_metric_and_the_spill_is_replayed(tmp_path: Path):
    result = outage_soak.soak(tmp_path, "tiny")
    report = outage_soak.table(result)
    assert result.exit_code == 0, report
    assert result.windows_s["down_long"] >= 14 and result.windows_s["down_to_end"] >= 6
    assert result.missing and not any(result.missing.values()), (result.missing, report)
    assert result.order_kept, report
    assert result.replayed > 0, report  # the final outage's records, sent after the run
    assert result.logged_points >= 10, report  # steps were logged through both outages
    assert result.ok
