"""The kill campaign, small: SIGKILL a real `coreshell train` mid-save and mid-delete, each
followed by `resume=last`; every resume is exact (all phases: benchmarks/kill_campaign.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import _runs, kill_campaign


def test_kills_mid_save_and_mid_delete_resume_bit_identically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # every run of the campaign (the reference and the chain) on XLA's CPU backend
    # unoptimised: less CPU per cold compile; all of them alike, so bit-identity still holds
    monkeypatch.setenv("XLA_FLAGS", _runs.quiet_env(smoke=True)["XLA_FLAGS"])
    points = kill_campaign.campaign(
        tmp_path, chains=1, max_steps=40, seed=1, phases=("mid-save", "mid-delete")
    )
    assert [p.target for p in points] == ["mid-save", "mid-delete"]
    table = kill_campaign.table(points)
    for p in points:
        assert p.killed, (p, table)
        assert p.resumed, (p, table)  # from the newest intact checkpoint, leftovers swept
        assert p.identical, (p, table)  # checkpoints, losses and the final export
    assert points[0].hit in ("mid-save", "mid-step")  # the save runs beside the steps
    assert all(p.lost_steps <= 20 for p in points)  # at most two checkpoint intervals
