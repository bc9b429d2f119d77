"""The run's hand-over plan (``torchshell.adapters._handover``, issue #53): made from the first
batch; a steady batch matching it is only kept, its window handed over as the plan decided
and run by the K-step program compiled when K was chosen."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import jaxcore
from jaxcore.models.digits import MLP
from tests.calls import CallCounter
from torchshell import JaxModule
from torchshell.adapters._handover import HandOver
from torchshell.module._windows import Windows

WAYS: dict[str, Callable[[], JaxModule]] = {
    "flax": lambda: JaxModule(
        MLP(features=(32,)), jaxcore.softmax_cross_entropy, jaxcore.make_optimizer("sgd", lr=0.1)
    ),
    "from_torch": lambda: JaxModule.from_torch(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer("sgd", lr=0.1),
    ),
}
KEPT = {  # a buffered batch's whole walk in coreshell (besides the loader's own reads)
    "torchshell/module/_jax_module.py:on_train_batch_start",
    "torchshell/module/_training.py:train_batch",
    "torchshell/adapters/_handover.py:same",
    "torchshell/module/_training.py:buffer_batch",
    "torchshell/module/_windows.py:take",
    "torchshell/module/_jax_module.py:on_train_batch_end",
}


@pytest.mark.parametrize("way", list(WAYS))
def test_steady_batches_are_matched_against_the_plan_and_windows_never_compile(
    way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Windows, "choose", staticmethod(lambda *_: 10))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40 * 16, 16, generator=g), torch.randint(0, 4, (640,)))
    counter = CallCounter(start=10)
    module = WAYS[way]()
    module.print_summary = False
    L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[counter],
    ).fit(module, DataLoader(data, batch_size=16))
    own = [
        {k for k in c if not k.startswith("torchshell/data/")}
        for c in counter.counts
        if "torchshell/module/_training.py:run_window" not in c
    ]
    assert len(own) >= 50 and all(calls == KEPT for calls in own), own[:2]
    assert not any("jaxcore/compile.py:traced" in c for c in counter.counts)  # (no trace)
    assert module.windows.runs >= 6 and module.windows.step is not None
    assert module.windows.step.compiles == 1  # (compiled when K was chosen, then reused)


def test_a_batch_is_matched_by_container_keys_classes_dtypes_and_shapes() -> None:
    x, y = torch.ones(4, 3), torch.zeros(4, dtype=torch.long)
    first = {"x": x, "y": y}
    plan = HandOver.learn(first, first, ("x", "y"))
    assert plan is not None
    reordered = {"y": y, "x": x}
    assert plan.same(reordered) is reordered and plan.named(reordered) is reordered
    short = {"x": x[:3], "y": y[:3]}  # a ragged last batch: named, not the same
    assert plan.same(short) is None and plan.named(short) is short
    assert plan.same({"x": x, "y": y.int()}) is None and plan.named({"x": x, "y": y.int()}) is None
    assert plan.same({"x": x.numpy(), "y": y}) is None  # a numpy field: the full path
    assert plan.same({"x": x, "y": y, "z": y}) is None and plan.same([x, y]) is None
    listed = HandOver.learn([x, y], {"x": x, "y": y}, ("x", "y"))
    assert listed is not None and sorted(listed.same([x, y]) or {}) == ["x", "y"]
    assert listed.same((x, y)) is None and listed.same([x, "y"]) is None
    checked = {"x": x, "lengths": y}  # (lengths: checked in every batch, no plan)
    assert HandOver.learn(checked, checked, ()) is None


def test_a_window_of_the_plan_trains_as_one_step_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(24 * 16, 16, generator=g), torch.randint(0, 4, (384,)))

    def fit(k: int) -> Any:
        monkeypatch.setattr(Windows, "choose", staticmethod(lambda *_: k))
        torch.manual_seed(0)  # (the same torch init)
        module = WAYS["from_torch"]()
        module.print_summary = False
        L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(module, DataLoader(data, batch_size=16))
        return module

    windowed, single = fit(4), fit(1)
    assert windowed.windows.runs >= 4 and single.windows.runs == 0
    for name, value in windowed.torch_state_dict().items():
        torch.testing.assert_close(value, single.torch_state_dict()[name], rtol=1e-5, atol=1e-6)
