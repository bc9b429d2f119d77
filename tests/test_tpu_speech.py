"""``benchmarks/tpu_speech.py``'s rows against a reference run (the 2-core CPU's): the speed-up
of the fit and the accuracy difference, from the rows its ``--json`` writes. The run itself
goes through in ``tpu.sh --dry-run`` (tests/test_tpu_script.py)."""

from __future__ import annotations

import pytest

from benchmarks import _stats
from benchmarks.tpu_speech import DRY_DATA, reference_rows


def _rows(where: str, fit_s: float, accuracy: float) -> list[_stats.Row]:
    label = f"tpu speech recipe, {where}"
    return [
        _stats.row(label, "fit", "s", [fit_s]),
        _stats.row(label, "training steps", "steps/s", [1000 / fit_s]),
        _stats.row(label, "test accuracy", "fraction", [accuracy]),
    ]


def test_the_speed_up_and_the_accuracy_difference_against_the_reference() -> None:
    chip = _rows("device front end on TPU v5 lite", 25.0, 0.9690)
    cpu = _rows("host front end on cpu", 150.0, 0.9714)
    fit, accuracy = reference_rows(chip, cpu)
    assert fit["case"] == "fit vs host front end on cpu (target >= 5x)"
    assert fit["median"] == 25.0 and fit["ratio"] == pytest.approx(6.0)
    assert fit["ratio_to"] == "150 s"
    assert accuracy["median"] == 0.9690
    assert accuracy["note"] == "0.002 below the reference's 0.971"
    assert "| s | 25 | 6.00 | 150 s |" in _stats.markdown([fit])


def test_a_reference_without_a_fit_row_is_refused_naming_how_to_make_one() -> None:
    chip = _rows("device front end on TPU v5 lite", 25.0, 0.97)
    with pytest.raises(SystemExit, match=r"no 'fit' row.*--front-end host --json"):
        reference_rows(chip, [r for r in chip if r["case"] != "fit"])


def test_the_dry_run_trains_its_small_set_in_batches_smaller_than_its_training_split() -> None:
    # 4 voices x 10 digits x 1 take, ~half of them training: the recipe's batch of 96 would
    # leave the training loader (which drops its ragged last batch) empty: no step at all
    settings = dict(item.removeprefix("++").split("=", 1) for item in DRY_DATA)
    clips = int(settings["data.speakers"]) * 10 * int(settings["data.takes"])
    assert int(settings["data.batch_size"]) * 2 <= clips // 2
