"""The trace sandbox (:mod:`torchshell.port._sandbox`, issue #53): every patch the port makes
on objects it does not own is put back, after an error too, nested or not; after a
``from_lightning`` fit the user's module and ``lightning.Trainer`` are as they were, and no
hook was ever set on the ``JaxModule`` instance."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchshell import JaxModule
from torchshell.adapters._hooks import LOOP_HOOKS, TABLE_HOOKS
from torchshell.port._host_reads import traced_global_step, watching_trainer
from torchshell.port._sandbox import TraceSandbox


class _Owner:
    size = 1


def test_every_patch_is_put_back_after_an_error_inside() -> None:
    owner, groups = _Owner(), [{"lr": 0.1}]
    owner.colour = "blue"
    trainer_before = dict(vars(L.Trainer))
    with pytest.raises(ZeroDivisionError), TraceSandbox() as sandbox:
        sandbox.patch(owner, "size", 2)  # (a class attribute: the instance had none)
        sandbox.patch(owner, "colour", "red")  # (the instance's own)
        sandbox.patch_item(groups, 0, {"lr": 0.5})
        sandbox.trainer_property("current_epoch", lambda trainer: 7)
        assert (owner.size, owner.colour, groups[0]["lr"]) == (2, "red", 0.5)
        assert L.Trainer.current_epoch.fget(None) == 7
        1 / 0  # noqa: B018
    assert vars(owner) == {"colour": "blue"} and owner.size == 1
    assert groups == [{"lr": 0.1}]
    assert dict(vars(L.Trainer)) == trainer_before


def test_a_failing_restore_does_not_stop_the_others() -> None:
    owner = _Owner()

    class Flaky:
        def __setattr__(self, name: str, value: Any) -> None:
            if vars(self).get("frozen"):
                raise RuntimeError("frozen")
            super().__setattr__(name, value)

    flaky = Flaky()
    flaky.mode = "a"
    with pytest.raises(RuntimeError, match="frozen"), TraceSandbox() as sandbox:
        sandbox.patch(owner, "size", 5)
        sandbox.patch(flaky, "mode", "b")
        vars(flaky)["frozen"] = True  # (its restore, run first, fails)
    assert "size" not in vars(owner)  # (restored although the later patch's restore raised)


def test_nested_sandboxes_restore_the_outer_values() -> None:
    owner = _Owner()
    sandbox = TraceSandbox()
    with sandbox:
        sandbox.patch(owner, "size", 2)
        with sandbox:  # (the same sandbox entered again)
            sandbox.patch(owner, "size", 3)
            with TraceSandbox() as inner:
                inner.patch(owner, "size", 4)
                assert owner.size == 4
            assert owner.size == 3
        assert owner.size == 2
    assert owner.size == 1 and "size" not in vars(owner)


def test_nested_trainer_watches_read_through_and_restore() -> None:
    before = dict(vars(L.Trainer))
    reads: dict[str, Any] = {}
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    with watching_trainer(reads):
        with traced_global_step(lambda: "traced"), watching_trainer(reads):
            # (a test is a user's frame: its reads are recorded, global_step traced)
            assert trainer.current_epoch == 0 and trainer.global_step == "traced"
        assert trainer.global_step == 0
    assert reads == {"current_epoch": 0}
    assert dict(vars(L.Trainer)) == before


def test_wear_class_only_a_subclass_and_put_back() -> None:
    owner = _Owner()

    class Counting(_Owner):
        pass

    with TraceSandbox() as sandbox:
        with pytest.raises(TypeError, match="not a subclass"):
            sandbox.wear_class(owner, int)
        sandbox.wear_class(owner, Counting)
        assert type(owner) is Counting
    assert type(owner) is _Owner


def test_patch_outside_a_with_is_refused_and_leaves_nothing() -> None:
    owner = _Owner()
    with pytest.raises(RuntimeError, match="outside"):
        TraceSandbox().patch(owner, "size", 9)
    assert "size" not in vars(owner)


class _Hooked(L.LightningModule):
    """Reads the Trainer values the trace watches, logs, runs a torchmetrics object, and
    overrides loop, data and transfer hooks (each records its call)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 3)
        self.acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
        self.calls: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        if self.current_epoch >= 0 and not self.trainer.is_last_batch:
            loss = loss + 0.0 * self.global_step
        self.acc(logits, y)
        self.log("acc", self.acc)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_epoch_end(self) -> None:
        self.calls.append("on_train_epoch_end")
        self.log("epoch_mark", float(self.current_epoch))

    def on_validation_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.calls.append("on_validation_batch_start")

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.calls.append("on_after_batch_transfer")
        return batch


def _state(obj: Any) -> dict[str, Any]:
    return {"class": type(obj), "keys": sorted(vars(obj))}


def test_after_a_fit_the_users_module_and_the_trainer_are_as_before() -> None:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    user = _Hooked()
    trainer_class = dict(vars(L.Trainer))
    module = JaxModule.from_lightning(user, print_summary=False)
    before = _state(user)  # (reading user.hparams made Lightning's own `_hparams`)
    seen: list[set[str]] = []

    class Watch(L.Callback):  # the module's own attributes at every batch
        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            seen.append(set(vars(pl_module)))

    trainer = L.Trainer(
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=2,
        callbacks=[Watch()],
    )
    loader = DataLoader(data, batch_size=16)
    trainer.fit(module, loader, loader)
    assert _state(user) == before  # (its class and instance attributes)
    assert dict(vars(L.Trainer)) == trainer_class  # (every property Lightning's own)
    hooks = set(LOOP_HOOKS) | set(TABLE_HOOKS) | {"log", "log_dict"}
    assert not hooks & set(vars(module)), "a hook was set on the JaxModule instance"
    assert seen and not any(hooks & attrs for attrs in seen)
    # the user's hooks still ran, as plain Lightning runs them
    assert user.calls.count("on_train_epoch_end") == 2
    assert "on_validation_batch_start" in user.calls and "on_after_batch_transfer" in user.calls
    assert "epoch_mark" in trainer.callback_metrics
