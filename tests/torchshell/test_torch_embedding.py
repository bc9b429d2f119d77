"""``nn.Embedding`` under ``JaxModule.from_torch``: ids past the table are refused like torch's
``IndexError``, with a JAX loss as with a torch loss (torchshell/_embedding.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import jaxcore
from tests.helpers import quiet_trainer
from torchshell import JaxModule

ROWS, VOCAB = 8, 30


class _Tagger(nn.Module):
    """Token ids -> nn.Embedding(30) -> mean -> 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


def _batches(bad: int | None, at: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(3):
        ids = torch.randint(0, VOCAB, (ROWS, 5), generator=g)
        if i == at and bad is not None:
            ids[3, 2] = bad
        out.append({"ids": ids, "y": torch.zeros(ROWS, dtype=torch.long)})
    return out


def _fit(loss: Any, batches: list[dict[str, torch.Tensor]]) -> JaxModule:
    torch.manual_seed(0)
    net = _Tagger()
    module = JaxModule.from_torch(
        net, loss, torch.optim.SGD(net.parameters(), lr=0.1), inputs=("ids",), print_summary=False
    )
    trainer = quiet_trainer(max_steps=len(batches), log_every_n_steps=1)
    loader = DataLoader(batches, batch_size=None)
    trainer.fit(module, train_dataloaders=loader)
    return module


LOSSES = {"jax_loss": jaxcore.softmax_cross_entropy, "torch_loss": nn.CrossEntropyLoss()}


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize(("bad", "at"), [(49, 0), (30, 2), (-1, 1)], ids=["49@0", "30@2", "-1@1"])
def test_ids_past_an_embedding_table_are_refused_like_torch(loss: str, bad: int, at: int) -> None:
    """Before (JAX loss): trained into NaN, then "The loss or gradients were NaN/Inf at step 0
    ... Fix: lower the learning rate". torch: ``IndexError: index out of range in self``."""
    batches = _batches(bad, at)
    with pytest.raises(IndexError):  # what torch itself raises on the same batch
        _Tagger()(batches[at]["ids"])
    with pytest.raises(jaxcore.BatchError) as err:
        _fit(LOSSES[loss], batches)
    msg = str(err.value)
    assert f"['ids'] indexes an embedding table of {VOCAB} rows, but holds {bad}" in msg, msg
    assert "IndexError" in msg and "Fix:" in msg and "learning rate" not in msg, msg


def test_ids_inside_the_table_train_with_finite_weights() -> None:
    module = _fit(LOSSES["jax_loss"], _batches(None, 0))
    sd = module.torch_state_dict()
    assert all(np.isfinite(v.numpy()).all() for v in sd.values())
