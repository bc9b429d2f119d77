"""The model zoo (tests/zoo/models.py): every public model trains as docs/zoo.md says.

Per model: 3 SGD steps through ``torch_model_fns`` + ``jaxcore.make_train_step`` against
``torch.optim.SGD`` (max relative parameter/buffer difference <= 1e-4, fp32), the trained
``state_dict`` loaded strictly into a fresh instance, and the result equal to the table's
result column (so the table stays true: regenerate it with
``.venv/bin/python benchmarks/zoo.py --write docs/zoo.md``). Entries marked ``trainer`` also
run a train and a validation step under the real Lightning Trainer.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from tests.zoo.harness import CHAOS, CHAOTIC, bound, classify, trainer_check
from tests.zoo.models import build, zoo

DOC = Path(__file__).parents[2] / "docs" / "zoo.md"
ENTRIES = zoo()


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """torch eager on one thread, as in ``benchmarks/zoo.py``, which writes the table: the
    same torch arithmetic as the table's rows, and no intra-op threads for batch-2 models
    (on 2 shared cores they made the torch side ~8x slower). Restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


RESULTS = ("parity", "mismatch", CHAOTIC, "TorchModelError", "error")


def _rows() -> dict[str, list[str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[2] in RESULTS:
            rows[cells[0]] = cells
    return rows


def _table() -> dict[str, str]:
    return {name: cells[2] for name, cells in _rows().items()}


def test_the_table_lists_every_model_and_meets_the_coverage_goal():
    table = _table()
    assert sorted(table) == sorted(e.name for e in ENTRIES)
    assert len(table) >= 25
    ok = sum(r == "parity" for r in table.values())
    assert ok / len(table) >= 0.85, f"{ok}/{len(table)} with parity"
    text = DOC.read_text()
    assert re.search(rf"\*\*{ok} of {len(table)} train with parity", text)


def test_no_parity_row_of_the_table_rests_on_torch_disagreeing_with_itself():
    """A parity row's torch-vs-torch spread (the column) is at most CHAOS: its bound is
    decided by TOL, not by chaos; a chaotic net's row says so instead."""
    loose = {
        name: cells[4]
        for name, cells in _rows().items()
        if cells[2] == "parity" and not float(cells[4]) <= CHAOS
    }
    assert not loose, f"parity rows whose torch vs torch spread exceeds {CHAOS}: {loose}"


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_model_trains_as_the_table_says(entry):
    net, batches = build(entry)
    result = classify(net, batches, entry)
    assert result["result"] == _table()[entry.name], result
    if result["result"] == "parity":
        assert result["max_rel"] <= bound(result["torch_floor"])
        assert result["torch_floor_max"] <= CHAOS, result  # parity, not chaos
        if entry.trainer:
            net, batches = build(entry)
            trainer_check(net, batches, entry.inputs, entry.kind, entry.pick)
    else:  # a failure names what stopped it
        assert result["reason"]
