"""JaxModule.from_torch with the team's own torch loss and torch optimizer, against the same
module trained by a plain torch loop (real Lightning Trainer, plain TensorDatasets)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import jaxcore
from jaxcore.models.digits import MLP
from tests.helpers import quiet_trainer
from torchshell import JaxModule
from torchshell._errors import ConfigError, TorchModelError

ROWS, FEATURES, OUT = 48, 6, 3


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, OUT))


def _classes(ignored: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, FEATURES, generator=g)
    y = torch.randint(0, OUT, (ROWS,), generator=g)  # int64, as torch users store labels
    if ignored:
        y[::5] = -100
    return TensorDataset(x, y)


def _targets(binary: bool) -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(ROWS, FEATURES, generator=g)
    y = (x[:, :OUT] > 0).float() if binary else x[:, :OUT] * 2.0 + 0.5
    return TensorDataset(x, y)


def _groups(net: nn.Module) -> list[dict[str, Any]]:
    decay = [p for n, p in net.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in net.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


CASES: dict[str, tuple[Callable[[], Any], Callable[[nn.Module], Any], TensorDataset]] = {
    "CrossEntropyLoss(label_smoothing) + SGD(nesterov)": (
        lambda: nn.CrossEntropyLoss(label_smoothing=0.1),
        lambda n: torch.optim.SGD(n.parameters(), lr=0.1, momentum=0.9, nesterov=True),
        _classes(),
    ),
    "CrossEntropyLoss(weight, ignore_index) + AdamW groups": (
        lambda: nn.CrossEntropyLoss(weight=torch.tensor([0.2, 1.0, 3.0])),
        lambda n: torch.optim.AdamW(_groups(n), lr=1e-2),
        _classes(ignored=True),
    ),
    "MSELoss + Adam": (
        nn.MSELoss,
        lambda n: torch.optim.Adam(n.parameters(), lr=1e-2),
        _targets(False),
    ),
    "F.cross_entropy + RMSprop": (
        lambda: F.cross_entropy,
        lambda n: torch.optim.RMSprop(n.parameters(), lr=1e-2),
        _classes(),
    ),
    "CrossEntropyLoss on class probabilities + SGD": (
        nn.CrossEntropyLoss,
        lambda n: torch.optim.SGD(n.parameters(), lr=0.1),
        TensorDataset(_classes().tensors[0], torch.softmax(_targets(False).tensors[1], -1)),
    ),
    "BCEWithLogitsLoss(pos_weight) + Adagrad": (
        lambda: nn.BCEWithLogitsLoss(pos_weight=torch.tensor([0.5, 2.0, 1.0])),
        lambda n: torch.optim.Adagrad(n.parameters(), lr=0.1),
        _targets(True),
    ),
}


def _trains_like_plain_torch(
    make_loss: Callable[[], Any],
    make_opt: Callable[[nn.Module], Any],
    data: TensorDataset,
    batch_size: int = 12,
) -> None:
    loader = DataLoader(data, batch_size=batch_size, shuffle=False)
    net = _net()
    jm = JaxModule.from_torch(net, make_loss(), make_opt(net), print_summary=False)
    trainer = quiet_trainer(max_steps=8, max_epochs=-1)
    trainer.fit(jm, loader)
    assert trainer.global_step == 8

    ref = _net()
    opt, loss_fn = make_opt(ref), make_loss()
    steps = 0
    while steps < 8:
        for x, y in loader:
            opt.zero_grad()
            loss_fn(ref(x), y).backward()
            opt.step()
            steps += 1
            if steps == 8:
                break
    exported, trained = jm.torch_state_dict(), net.state_dict()  # (net: trained in place)
    for name, value in ref.state_dict().items():
        np.testing.assert_allclose(
            exported[name].numpy(), value.numpy(), rtol=2e-5, atol=2e-6, err_msg=name
        )
        torch.testing.assert_close(trained[name], exported[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_own_torch_loss_and_optimizer_train_like_plain_torch(case: str) -> None:
    _trains_like_plain_torch(*CASES[case])


def _own_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A team's own loss function: torch ops, a batch mean, a regulariser."""
    return F.cross_entropy(out, y) + 0.01 * torch.mean(out.pow(2))


class OwnLoss(nn.Module):  # a team's own loss module, with no `reduction`
    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.smooth_l1_loss(out, y, beta=0.5) + (out - y).abs().mean()


def _soft_targets() -> TensorDataset:
    x, _ = _targets(False).tensors
    return TensorDataset(x, torch.softmax(x[:, :OUT] * 3.0, -1))


OWN: dict[str, tuple[Callable[[], Any], Callable[[nn.Module], Any], TensorDataset]] = {
    "own torch function": (
        lambda: _own_loss,
        lambda n: torch.optim.Adam(n.parameters(), lr=1e-2),
        _classes(),
    ),
    "own loss module": (
        OwnLoss,
        lambda n: torch.optim.SGD(n.parameters(), lr=0.1),
        _targets(False),
    ),
    "KLDivLoss(batchmean)": (
        lambda: nn.KLDivLoss(reduction="batchmean"),
        lambda n: torch.optim.SGD(n.parameters(), lr=0.1),
        _soft_targets(),
    ),
    "MSELoss(sum)": (
        lambda: nn.MSELoss(reduction="sum"),
        lambda n: torch.optim.SGD(n.parameters(), lr=1e-3),
        _targets(False),
    ),
    "CrossEntropyLoss(weight, label_smoothing, ignore_index)": (
        lambda: nn.CrossEntropyLoss(weight=torch.tensor([0.2, 1.0, 3.0]), label_smoothing=0.2),
        lambda n: torch.optim.Adam(n.parameters(), lr=1e-2),
        _classes(ignored=True),
    ),
}


@pytest.mark.parametrize("case", list(OWN))
def test_the_teams_own_loss_and_every_reduction_train_like_plain_torch(case: str) -> None:
    """Batches of 10 over 48 rows: step 5 is the padded last batch of the epoch."""
    _trains_like_plain_torch(*OWN[case], batch_size=10)


def test_a_loss_with_reduction_none_is_refused_with_the_fix() -> None:
    net = _net()
    with pytest.raises(ConfigError, match=r"reduction='none'.*Fix"):
        JaxModule.from_torch(
            net, nn.MSELoss(reduction="none"), jaxcore.make_optimizer(), print_summary=False
        )


def test_validation_loss_of_a_torch_loss_is_torchs_mean_over_the_real_rows() -> None:
    """40 rows in batches of 16: the last batch is padded to 16 and masked; the validation
    loss is still torch's cross entropy over exactly the 40 rows."""
    net = _net()
    jm = JaxModule.from_torch(
        net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), lr=0.1), print_summary=False
    )
    val = TensorDataset(*(t[:40] for t in _classes().tensors))
    trainer = quiet_trainer(max_steps=1, max_epochs=-1)
    trainer.fit(jm, DataLoader(_classes(), batch_size=16))
    (metrics,) = trainer.validate(jm, DataLoader(val, batch_size=16), verbose=False)
    trained = _net()
    trained.load_state_dict(jm.torch_state_dict())
    with torch.no_grad():
        expected = F.cross_entropy(trained(val.tensors[0]), val.tensors[1]).item()
    assert metrics["val/loss"] == pytest.approx(expected, rel=1e-5)


def test_a_torch_optimizer_without_a_torch_module_is_named() -> None:
    net = _net()
    with pytest.raises(ConfigError, match="from_torch"):
        JaxModule(MLP(features=(8,)), nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters()))


class Tokens(torch.utils.data.Dataset):
    """Hugging Face style samples: {"input_ids", "attention_mask", "labels"}."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 20, (40, 6), generator=g)
        self.labels = torch.randint(0, OUT, (40,), generator=g)

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = (torch.arange(6) < 3 + i % 4).long()
        return {"input_ids": self.ids[i], "attention_mask": mask, "labels": self.labels[i]}


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(20, 8), nn.Linear(8, OUT)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        m = attention_mask.unsqueeze(-1).float()
        return self.head((self.emb(input_ids) * m).sum(1) / m.sum(1))


def test_a_dict_batch_finds_its_labels_field_and_trains_like_torch() -> None:
    torch.manual_seed(0)
    net, ref = Bag(), Bag()
    ref.load_state_dict(net.state_dict())
    jm = JaxModule.from_torch(
        net,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(net.parameters(), lr=0.5),
        inputs=("input_ids", "attention_mask"),
        print_summary=False,
    )
    loader = DataLoader(Tokens(), batch_size=8)
    quiet_trainer(max_steps=5).fit(jm, loader)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for batch in loader:
        opt.zero_grad()
        F.cross_entropy(
            ref(batch["input_ids"], batch["attention_mask"]), batch["labels"]
        ).backward()
        opt.step()
    for name, value in ref.state_dict().items():
        np.testing.assert_allclose(jm.torch_state_dict()[name], value, rtol=1e-5, atol=1e-6)


def test_floating_class_indices_are_refused_as_torch_refuses_them() -> None:
    """Labels stored as float ([B] float32), which torch refuses ('expected scalar type Long
    but found Float'): before, JAX's "Indexer must have integer or boolean type" from inside
    the loss. Now named, with the fix, on both torch paths (probabilities [B, C] train)."""
    import lightning as L

    x, y = _classes().tensors
    loader = DataLoader(TensorDataset(x, y.float()), batch_size=12)
    net = _net()
    jm = JaxModule.from_torch(
        net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), lr=0.1), print_summary=False
    )
    with pytest.raises(TorchModelError, match=r"class indices.*float32.*Fix: integer labels"):
        quiet_trainer(max_steps=1).fit(jm, loader)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return F.nll_loss(F.log_softmax(self.net(batch[0]), -1), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    port = JaxModule.from_lightning(Module(), print_summary=False)
    with pytest.raises(TorchModelError, match=r"nll_loss: the target holds class indices"):
        quiet_trainer(max_steps=1).fit(port, loader)
