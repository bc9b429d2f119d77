"""``self.global_step`` and ``self.current_epoch`` read by a ``training_step`` ported with
``JaxModule.from_lightning``, against plain Lightning on a real ``lightning.Trainer``.

``global_step`` is a traced value the compiled step receives with each batch
(:mod:`torchshell.port._host_reads`): logged, a hand-written warm-up, a branch every N steps,
under ``accumulate_grad_batches``, after a resume and under manual optimization, all as in
Lightning; one compiled program per epoch is kept at most (the old ones are freed). Also:
an ``nn.Embedding`` index past its table under manual optimization raises, as in torch.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

import jaxcore
from tests.torchshell.port_helpers import net
from tests.torchshell.test_port import Recorder
from tests.torchshell.test_port_manual import _trainer, _weights
from tests.torchshell.test_port_manual_docs import _data
from tests.torchshell.test_port_trainer_reads import EpochWeighted
from torchshell import JaxModule
from torchshell._errors import ConfigError, TorchModelError


class Stepped(L.LightningModule):
    """A classifier whose loss reads ``self.global_step`` the way ``kind`` says."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.net = net()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if self.kind == "log":
            self.log("gstep", self.global_step)
        elif self.kind == "warmup":
            scale = min(1.0, (self.global_step + 1) / 10)
            loss = loss * scale
            self.log("scale", scale)
        elif self.kind == "every" and self.trainer.global_step % 3 == 0:
            loss = loss + 0.5 * self.net(x).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _logged(rows: Recorder, name: str) -> list[tuple[int, float]]:
    return [(s, m[name]) for s, m in rows.rows if name in m]


def _same(
    plain: L.LightningModule,
    ported: L.LightningModule,
    rows: tuple[Recorder, Recorder],
    *names: str,
) -> None:
    """Every logged value of ``names`` at the same steps, and the final weights, rtol 1e-5."""
    for name in names:
        theirs, ours = _logged(rows[0], name), _logged(rows[1], name)
        assert theirs, name
        assert [s for s, _ in ours] == [s for s, _ in theirs], name
        np.testing.assert_allclose(
            [v for _, v in ours], [v for _, v in theirs], rtol=1e-5, atol=1e-7, err_msg=name
        )
    reference, trained = _weights(plain), _weights(ported)
    for k, v in reference.items():
        np.testing.assert_allclose(trained[k], v, rtol=1e-5, atol=1e-7, err_msg=k)


def _fit(make: Any, tmp_path: Path, n_batches: int = 6, **trainer: Any) -> Any:
    plain, ported = make(), make()
    rows = (Recorder(), Recorder())
    t_plain = _trainer(tmp_path / "plain", rows[0], **trainer)
    t_plain.fit(plain, _data(n_batches))
    t_ported = _trainer(tmp_path / "ported", rows[1], **trainer)
    t_ported.fit(JaxModule.from_lightning(ported), _data(n_batches))
    assert t_ported.global_step == t_plain.global_step
    return plain, ported, rows, t_ported


@pytest.mark.parametrize("kind", ["log", "warmup", "every"])
def test_global_step_reads_follow_the_trainer(kind: str, tmp_path: Path) -> None:
    plain, ported, rows, t_ported = _fit(lambda: Stepped(kind), tmp_path, max_epochs=2)
    names = {"log": ("gstep",), "warmup": ("scale",), "every": ()}[kind]
    _same(plain, ported, rows, "train_loss", *names)
    if kind == "log":  # (0, 1, ..., 11: read each step, not frozen at the first)
        assert [v for _, v in _logged(rows[1], "gstep")] == list(range(12))
    assert t_ported.lightning_module.compiled.train.recompiles == 0  # one program for all steps


def test_global_step_counts_optimizer_steps_under_accumulation(tmp_path: Path) -> None:
    # 7 batches, windows of 2: global_step 0,0,1,1,2,2,3 as training_step sees it (the last
    # window is short), and the warm-up scale follows it
    plain, ported, rows, t_ported = _fit(
        lambda: Stepped("warmup"), tmp_path, n_batches=7, accumulate_grad_batches=2
    )
    assert t_ported.global_step == 4
    _same(plain, ported, rows, "scale")


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_global_step_continues_after_a_resume(tmp_path: Path) -> None:
    runs = {}
    for side in ("plain", "ported"):
        first, second = Stepped("log"), Stepped("log")
        wrap = (lambda m: m) if side == "plain" else JaxModule.from_lightning
        t = _trainer(tmp_path / side, Recorder(), enable_checkpointing=True)
        t.fit(wrap(first), _data(3))
        ckpt = next((tmp_path / side).rglob("*.ckpt"))
        rows = Recorder()
        t2 = _trainer(tmp_path / side, rows, max_epochs=2, enable_checkpointing=True)
        t2.fit(wrap(second), _data(3), ckpt_path=ckpt)
        runs[side] = (second, rows)
    assert [v for _, v in _logged(runs["ported"][1], "gstep")] == [3.0, 4.0, 5.0]
    _same(runs["plain"][0], runs["ported"][0], (runs["plain"][1], runs["ported"][1]), "gstep")


class ManualStepped(L.LightningModule):
    """Manual optimization reading ``global_step``: a warm-up before the backward (tensor
    arithmetic), a branch and a log after ``opt.step()`` (which counts one step)."""

    def __init__(self, branch_first: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.branch_first = branch_first
        self.net = net()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        if self.branch_first:
            scale = min(1.0, (self.global_step + 1) / 4)
        else:
            scale = torch.as_tensor((self.global_step + 1) / 4).clamp(max=1.0)
        loss = F.cross_entropy(self.net(x), y) * scale
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        bonus = 1.0 if self.global_step % 2 == 0 else 0.0
        self.log_dict({"train_loss": loss, "after": self.trainer.global_step, "bonus": bonus})

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_global_step_under_manual_optimization(tmp_path: Path) -> None:
    plain, ported, rows, _ = _fit(ManualStepped, tmp_path)
    _same(plain, ported, rows, "train_loss", "after", "bonus")
    assert [v for _, v in _logged(rows[1], "after")] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_manual_branch_before_backward_is_refused(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, Recorder())
    with pytest.raises(ConfigError, match=r"Python bool before manual_backward.*Fix:"):
        trainer.fit(JaxModule.from_lightning(ManualStepped(branch_first=True)), _data(2))


class Ranged(Stepped):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        for _ in range(self.global_step):
            loss = loss * 0.9
        return loss


def test_global_step_as_a_python_number_is_refused(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, Recorder())
    with pytest.raises(TorchModelError, match=r"self\.global_step.*Python number") as err:
        trainer.fit(JaxModule.from_lightning(Ranged("range")), _data(2))
    assert "Fix:" in str(err.value)


class _Held(L.Callback):
    """Weak references to every program the module keeps, and how many it keeps, per epoch."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref[Any]] = []
        self.held: list[int] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if not hasattr(pl_module, "adapter"):  # (the plain Lightning run)
            return
        steps = [s for _, s in pl_module.adapter.steps.host_steps]
        self.held.append(len(steps))
        self.refs += [weakref.ref(s) for s in steps]


def test_epoch_programs_are_capped(tmp_path: Path) -> None:
    held = _Held()
    plain, ported, rows, _ = _fit(
        EpochWeighted, tmp_path, n_batches=3, max_epochs=5, callbacks=[held]
    )
    _same(plain, ported, rows, "train_loss")
    assert held.held == [2] * 5  # this epoch's two (last batch or not), not 2 per epoch
    gc.collect()
    alive = [r for r in held.refs if r() is not None]
    assert len(held.refs) == 10 and len(alive) == 2  # the earlier epochs' programs are freed


class ManualBag(L.LightningModule):
    """Mean-pooled token embeddings under manual optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.embed = torch.nn.Embedding(30, 8, padding_idx=0)
        self.head = torch.nn.Linear(8, 3)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        tokens, y = batch
        loss = F.cross_entropy(self.head(self.embed(tokens).mean(1)), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("train_loss", loss)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_manual_embedding_index_out_of_range_raises_naming_the_field(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 30, (32, 6), generator=g)
    y = torch.randint(0, 3, (32,), generator=g)
    tokens[9, 2] = 49  # (the second batch's second row)
    loader = DataLoader(TensorDataset(tokens, y), batch_size=8)
    with pytest.raises(jaxcore.BatchError, match=r"\[0\] indexes an embedding table of 30.*49"):
        _trainer(tmp_path, Recorder()).fit(JaxModule.from_lightning(ManualBag()), loader)
