"""``bridge.BatchTransfer``: a flat batch form's hand-over decided once, carried out per batch
as ``bridge.to_jax`` would (issue #53: the K-batch windows' hand-over)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec

import bridge
from bridge import BatchTransfer


def _window(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(4, 16, 3, generator=g),
        "y": torch.randint(0, 5, (4, 16), generator=g),  # int64: narrowed, range checked
        "w": torch.rand(4, 16, generator=g).to(torch.int32),  # int32: remembered as such
    }


@pytest.mark.parametrize("sharded", [True, False])
def test_values_and_counts_are_those_of_to_jax(sharded: bool) -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec(None, "data")) if sharded else None
    ours, theirs = bridge.new_stats(), bridge.new_stats()
    transfer = BatchTransfer.plan(_window(0), sharding, ours)
    assert transfer is not None
    for seed in range(3):
        batch = _window(seed)
        got, want = transfer(batch), bridge.to_jax(batch, sharding, stats=theirs)
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name].dtype == want[name].dtype
            assert got[name].sharding == want[name].sharding
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))
        assert bridge.handed_over(got["w"]) == bridge.handed_over(want["w"]) is not None
    assert ours == theirs  # transfers, zero-copy and copied bytes, each copy's reason


def test_an_int64_field_out_of_range_is_still_refused_per_batch() -> None:
    transfer = BatchTransfer.plan(_window(0), None, bridge.new_stats())
    assert transfer is not None
    batch = _window(1)
    batch["y"][0, 0] = 2**40
    with pytest.raises(bridge.TransferError, match="do not fit"):
        transfer(batch)


def test_forms_it_cannot_decide_once_are_left_to_to_jax() -> None:
    stats = bridge.new_stats()
    assert BatchTransfer.plan({"x": torch.ones(2, 3, requires_grad=True)}, None, stats) is None
    assert BatchTransfer.plan({"x": torch.ones(2, dtype=torch.bfloat16)}, None, stats) is None
    assert BatchTransfer.plan({"x": torch.ones(2), "id": ["a", "b"]}, None, stats) is None  # type: ignore[dict-item]
