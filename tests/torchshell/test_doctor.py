"""``coreshell doctor``: passes on the default digits config, names each blocking problem."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from torchshell.app.doctor import FAIL, Check, compose_config, doctor_command, run_checks

NAMES = [
    "versions",
    "mesh",
    "tracking",
    "workers",
    "recompiles",
    "sample batch",
    "x64",
    "zero-copy",
    "model",
    "sharding",
    "checkpoints",
]


def _base(tmp: Path) -> list[str]:
    return [
        "data=digits",
        "model=digits",
        f"tracking.uri=sqlite:///{tmp}/mlflow.db",
        f"ckpt.dir={tmp}/ck",
    ]


def _by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_default_digits_config_passes_and_prints_every_check(tmp_path: Path, capsys):
    assert doctor_command(_base(tmp_path)) == 0
    out = capsys.readouterr().out
    for name in NAMES:
        assert f"│ {name}" in out, name
    assert "coreshell doctor: no blocking problem" in out
    assert list(tmp_path.iterdir()) == []  # a pre-flight check writes nothing


def test_default_digits_findings(tmp_path: Path):
    checks = _by_name(run_checks(compose_config(_base(tmp_path))))
    assert [c for c in checks.values() if c.status == FAIL] == []
    assert "x: float32[64, 64], y: int32[64]" in checks["sample batch"].detail
    assert "'data': 8" in checks["mesh"].detail
    # 269 validation rows in batches of 256: a ragged last batch padded to 16 rows on 8
    # devices, so the eval step compiles for two shapes.
    recompiles = checks["recompiles"]
    assert recompiles.status == "warn" and "val: 269 rows / batch 256 -> rows [16, 256]" in (
        recompiles.detail
    )
    assert "zero-copy" in checks["zero-copy"].detail and "85,002 params" in checks["model"].detail


def test_mesh_axes_that_do_not_match_the_devices_fail(tmp_path: Path, capsys):
    assert doctor_command([*_base(tmp_path), "mesh.axes.data=3"]) == 1
    assert "coreshell doctor: blocking: mesh" in capsys.readouterr().out
    mesh = _by_name(run_checks(compose_config([*_base(tmp_path), "mesh.axes.data=3"])))["mesh"]
    assert mesh.status == FAIL
    assert "need 3 devices, but 8 are available" in mesh.detail and "Fix:" in mesh.detail


def test_unreachable_http_tracking_uri_fails(tmp_path: Path, capsys):
    uri = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    overrides = [f"tracking.uri={uri}", f"ckpt.dir={tmp_path}/ck", "mesh.axes.data=3"]
    assert doctor_command(overrides) == 1
    assert "blocking: mesh, tracking" in capsys.readouterr().out
    tracking = _by_name(run_checks(compose_config(overrides)))["tracking"]
    assert tracking.status == FAIL
    assert f"GET {uri}/health failed" in tracking.detail and "refused" in tracking.detail
    assert "Fix: start the server" in tracking.detail


def test_indivisible_param_under_tp_fails_naming_the_param(tmp_path: Path):
    checks = _by_name(
        run_checks(compose_config([*_base(tmp_path), "mesh=tp", "model.flax.features=[31]"]))
    )
    sharding = checks["sharding"]
    assert sharding.status == FAIL
    assert "Param 'params/layers_0/bias' of shape (31,)" in sharding.detail
    assert "not divisible by 2" in sharding.detail and "Fix:" in sharding.detail


def test_wrong_input_key_fails_at_the_sample_batch(tmp_path: Path):
    checks = _by_name(run_checks(compose_config([*_base(tmp_path), "model.inputs=[image]"])))
    sample = checks["sample batch"]
    assert sample.status == FAIL
    assert "the model reads ['image'] but the batch has ['x', 'y']" in sample.detail
    assert "Fix: rename the fields" in sample.detail
    assert checks["model"].status == FAIL and "missing ['image']" in checks["model"].detail


def test_twin_input_shape_mismatch_names_field_expected_and_got(tmp_path: Path):
    checks = _by_name(run_checks(compose_config([*_base(tmp_path), "model.twin.in_features=32"])))
    sample = checks["sample batch"]
    assert sample.status == FAIL
    assert "field 'x': the torch twin expects float32[2, 32]" in sample.detail
    assert "the data gives float32[64, 64]" in sample.detail and "Fix:" in sample.detail


def test_a_training_set_without_one_full_batch_fails(tmp_path: Path):
    overrides = [*_base(tmp_path), "data.val_fraction=0.5", "data.test_fraction=0.5"]
    build = _by_name(run_checks(compose_config(overrides)))["build"]  # the data module refuses
    assert build.status == FAIL
    assert "leave 1 training rows, fewer than one batch of 64" in build.detail
    assert "Fix:" in build.detail


@pytest.mark.parametrize(
    ("override", "needle"), [("optim.lrr=1", "optim.lrr"), ("trainer.max_steps=abc", "max_steps")]
)
def test_config_that_does_not_compose_exits_2(override: str, needle: str, capsys):
    assert doctor_command([override]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Fix:" in err


def test_coreshell_main_dispatches_doctor(tmp_path: Path, capsys):
    from torchshell.app.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["doctor", *_base(tmp_path), "mesh.axes.data=3"])
    assert exit_.value.code == 1
    assert "blocking: mesh" in capsys.readouterr().out


@pytest.fixture(scope="module")
def speech_overrides(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The default recipe (spoken digits) on a tiny built set; the rest at its defaults."""
    tmp = tmp_path_factory.mktemp("speech")
    return [
        f"data.root={tmp}/sd",
        "data.takes=1",
        "data.speakers=4",
        "data.num_workers=0",
        "data.batch_size=8",
        "++data.min_test_clips=0",
        f"tracking.uri=sqlite:///{tmp}/mlflow.db",
        f"ckpt.dir={tmp}/ck",
    ]


def test_default_speech_recipe_passes_on_every_length_bucket(speech_overrides: list[str]):
    """Issue 18: the sample batch may come from any bucket; the twin's example (64 frames) no
    longer decides, and both models run on every bucket."""
    cfg = compose_config(speech_overrides)
    checks = _by_name(run_checks(cfg))
    assert [c for c in checks.values() if c.status == FAIL] == []
    buckets = checks["buckets"]
    assert buckets.status == "ok" and f"buckets {list(cfg.data.buckets)}" in buckets.detail
    assert len(cfg.data.buckets) >= 2
    for size in cfg.data.buckets:
        assert f"{size} -> [8, 10]" in buckets.detail
    assert "features: float32[8, " in checks["sample batch"].detail


def test_the_sample_check_accepts_a_batch_of_every_bucket(speech_overrides: list[str]):
    """The check that failed half the time: a batch from each bucket against the twin."""
    from hydra.utils import instantiate

    from torchshell.app._doctor_shapes import _sample_checks
    from torchshell.data.spoken_digits import BucketCollate, SpokenDigitsDataModule

    cfg = compose_config(speech_overrides)
    twin = instantiate(cfg.model.twin)
    data = SpokenDigitsDataModule(
        cfg.data.root,
        batch_size=8,
        num_workers=0,
        takes=1,
        speakers=4,
        augment=False,
        buckets=cfg.data.buckets,
    )
    data.setup("fit")
    items = [data.datasets["test"][i] for i in range(4)]
    for size in sorted(cfg.data.buckets, reverse=True):
        items = [{**it, "features": it["features"][:size]} for it in items]
        batch = BucketCollate((size,))(items)
        check = _sample_checks(batch, None, twin, ["features", "frame_mask"])
        assert check.status == "ok", (size, check.detail)
    wrong = {**batch, "features": batch["features"][..., :20]}  # 20 mel bands, twin has 40
    check = _sample_checks(wrong, None, twin, ["features", "frame_mask"])
    assert check.status == FAIL and "field 'features'" in check.detail
    assert f"float32[4, {size}, 20]" in check.detail and "Fix:" in check.detail
