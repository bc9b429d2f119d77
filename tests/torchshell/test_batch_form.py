"""The form of a run's batches (``torchshell.adapters._form``): learned from one batch, later
batches of that form only named; any other batch takes the full preparation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jaxcore
from jaxcore._errors import BatchError
from jaxcore.models.digits import MLP
from torchshell import JaxModule


def _module() -> JaxModule:
    return JaxModule(
        MLP(features=(8,)),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer(lr=0.1),
        print_summary=False,
    )


def test_a_batch_of_another_form_takes_the_full_path_after_the_form_is_learned():
    adapter = _module().adapter
    x, y = torch.ones(4, 3), torch.zeros(4, dtype=torch.long)
    first = adapter.prepare((x, y))
    assert adapter.plan is not None and sorted(first) == ["x", "y"]
    again = adapter.prepare((x * 2, y))  # the learned form: only named
    assert torch.equal(again["x"], x * 2) and again["y"] is y
    mixed = adapter.prepare((x.numpy(), y))  # a numpy field: converted, not passed on as it is
    assert isinstance(mixed["x"], torch.Tensor)
    assert adapter.plan is None  # (that batch needed the full path: no form learned from it)
    adapter.prepare({"x": x, "y": y})
    assert adapter.prepare({"x": x, "y": y, "id": ["a", "b", "c", "d"]})["id"].kind == "list"


def test_lengths_are_checked_in_every_batch_not_only_the_first():
    adapter = _module().adapter
    good = {"x": torch.ones(2, 3), "lengths": torch.tensor([3, 1])}
    adapter.prepare(good)
    adapter.prepare(good)
    with pytest.raises(BatchError, match="'lengths' holds -1 at row 1"):
        adapter.prepare({"x": torch.ones(2, 3), "lengths": torch.tensor([3, -1])})


def test_a_dict_of_the_learned_keys_holding_a_numpy_field_is_converted():
    adapter = _module().adapter
    adapter.prepare({"x": torch.ones(2, 3), "y": torch.zeros(2)})
    out = adapter.prepare({"x": torch.ones(2, 3), "y": np.zeros(2, np.int64)})
    assert isinstance(out["y"], torch.Tensor)
