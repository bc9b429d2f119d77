"""Embedding indices checked inside the compiled step, on every path (issue 39): ids past a
table are refused like torch's ``IndexError`` (no NaN reaches the weights) and named at the
logging cadence: ``from_torch`` with a JAX or a torch loss, ``from_lightning``, and a Flax
``nn.Embed``; indices computed inside the model as well as batch fields."""

from __future__ import annotations

import re
from typing import Any

import flax.linen as fnn
import jax
import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import jaxcore
from tests.helpers import quiet_trainer
from torchshell import JaxModule

ROWS, VOCAB = 8, 30


class _Tagger(nn.Module):
    """Token ids (+ ``shift``, computed in the model) -> nn.Embedding(30) -> mean -> 10."""

    def __init__(self, shift: int = 0) -> None:
        super().__init__()
        self.shift = shift
        self.emb, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids + self.shift if self.shift else ids).mean(1))


class _Bag(L.LightningModule):
    """The same tagger as a LightningModule reading a dict batch."""

    def __init__(self, shift: int = 0) -> None:
        super().__init__()
        self.net = _Tagger(shift)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.net(batch["ids"]), batch["y"])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _FlaxTagger(fnn.Module):
    shift: int = 0

    @fnn.compact
    def __call__(self, ids: jax.Array, train: bool = False) -> jax.Array:
        return fnn.Dense(10)(fnn.Embed(VOCAB, 8)(ids + self.shift if self.shift else ids).mean(1))


def _batches(bad: int | None, at: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(3):
        ids = torch.randint(0, VOCAB - 5, (ROWS, 5), generator=g)
        if i == at and bad is not None:
            ids[3, 2] = bad
        out.append({"ids": ids, "y": torch.zeros(ROWS, dtype=torch.long)})
    return out


def _fit(module: L.LightningModule, batches: list[dict[str, torch.Tensor]]) -> Any:
    trainer = quiet_trainer(max_steps=len(batches), log_every_n_steps=1)
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    return module


def _from_torch(loss: Any, shift: int = 0) -> JaxModule:
    torch.manual_seed(0)
    net = _Tagger(shift)
    return JaxModule.from_torch(
        net, loss, torch.optim.SGD(net.parameters(), lr=0.1), inputs=("ids",), print_summary=False
    )


def _refused(module: Any, batches: list[dict[str, torch.Tensor]]) -> str:
    """The error of fitting on ``batches``; the weights hold no NaN (the step was refused)."""
    with pytest.raises(jaxcore.BatchError) as err:
        _fit(module, batches)
    msg = str(err.value)
    assert "IndexError: index out of range" in msg and "Fix:" in msg, msg
    assert "learning rate" not in msg, msg
    leaves = jax.tree.leaves(jax.device_get(module.state.params))
    assert leaves and all(np.isfinite(v).all() for v in leaves)
    return msg


LOSSES = {"jax_loss": jaxcore.softmax_cross_entropy, "torch_loss": nn.CrossEntropyLoss()}


@pytest.mark.parametrize(
    ("loss", "bad", "at"),
    [("jax_loss", 49, 0), ("torch_loss", 30, 2), ("jax_loss", -1, 1)],
    ids=["jax_loss-49@0", "torch_loss-30@2", "jax_loss--1@1"],
)
def test_from_torch_refuses_ids_past_the_table_like_torch(loss: str, bad: int, at: int) -> None:
    """Before (JAX loss): trained into NaN, then "The loss or gradients were NaN/Inf at step 0
    ... Fix: lower the learning rate". torch: ``IndexError: index out of range in self``."""
    batches = _batches(bad, at)
    with pytest.raises(IndexError):  # what torch itself raises on the same batch
        _Tagger()(batches[at]["ids"])
    msg = _refused(_from_torch(LOSSES[loss]), batches)
    assert f"['ids'] indexes an embedding table of {VOCAB} rows" in msg, msg
    assert f"but holds {bad} at step {at} (refused" in msg, msg


def test_from_torch_refuses_an_index_computed_in_the_model() -> None:
    """``ids + 100`` is no batch field: a host check of the batch could never see it."""
    msg = _refused(_from_torch(LOSSES["jax_loss"], shift=100), _batches(None, 0))
    assert f"computed inside the model indexes an embedding table of {VOCAB} rows" in msg, msg
    table = r"\(emb: nn.Embedding\[30, 8\]\)"
    assert re.search(rf"{table}, but holds 1\d\d at step 0 \(refused", msg), msg


@pytest.mark.parametrize("shift", [0, 100], ids=["batch_field", "computed"])
def test_from_lightning_refuses_ids_past_the_table(shift: int) -> None:
    torch.manual_seed(0)
    module = JaxModule.from_lightning(_Bag(shift), print_summary=False)
    msg = _refused(module, _batches(None if shift else 49, 1))
    where = "computed inside the model" if shift else "The batch field ['ids']"
    assert f"{where} indexes an embedding table of {VOCAB} rows" in msg, msg


@pytest.mark.parametrize("shift", [0, 100], ids=["batch_field", "computed"])
def test_flax_nn_embed_refuses_ids_past_the_table(shift: int) -> None:
    module = JaxModule(
        _FlaxTagger(shift),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer(lr=0.1),
        inputs=("ids",),
        print_summary=False,
    )
    msg = _refused(module, _batches(None if shift else 30, 2))
    where = "An index computed in the model" if shift else "The batch field ['ids']"
    assert f"{where} indexes the Flax nn.Embed Embed_0 of {VOCAB} rows" in msg, msg


def test_ids_inside_the_table_train_with_finite_weights() -> None:
    module = _fit(_from_torch(LOSSES["jax_loss"]), _batches(None, 0))
    sd = module.torch_state_dict()
    assert all(np.isfinite(v.numpy()).all() for v in sd.values())
    assert int(module.state.nonfinite) == 0


class _EvalBag(_Bag):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.cross_entropy(self.net(batch["ids"]), batch["y"]))


def test_a_lightning_eval_hook_reports_ids_past_the_table_with_its_logs() -> None:
    """An evaluation hook's indices are checked in its compiled step too: ``[code, value]``
    comes back with the logs it already hands to the host (EVAL_CHECK_KEY)."""
    from jaxcore.guard import raise_failed
    from torchshell.port._trace import LightningPort
    from torchshell.trace._embedding import EVAL_CHECK_KEY

    port = LightningPort(_EvalBag())

    @jax.jit
    def checks(batch: Any) -> Any:
        t = port.tracer
        key = jax.random.key(0)
        _, logs, _ = port.call("validation_step", t.params0, t.state0, batch, key, False)
        return logs[EVAL_CHECK_KEY]

    good = {k: jax.numpy.asarray(v.int().numpy()) for k, v in _batches(None, 0)[0].items()}
    raise_failed(checks(good), "in a validation_step batch")  # nothing failed
    bad = {**good, "ids": good["ids"].at[1, 1].set(VOCAB)}
    with pytest.raises(jaxcore.BatchError) as err:
        raise_failed(checks(bad), "in a validation_step batch")
    msg = str(err.value)
    assert "['ids'] indexes an embedding table of 30 rows (net.emb: nn.Embedding[30, 8])" in msg
    assert "but holds 30 in a validation_step batch. torch raises IndexError" in msg, msg


def _flax(shift: int = 0) -> JaxModule:
    return JaxModule(
        _FlaxTagger(shift),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer(lr=0.1),
        inputs=("ids",),
        print_summary=False,
    )


@pytest.mark.parametrize("path", ["flax", "from_torch", "from_lightning"])
def test_validation_refuses_ids_past_the_table_through_the_trainer(path: str) -> None:
    """``trainer.validate`` with one bad batch among good ones: the compiled eval step keeps
    its first failed check, read once at the epoch's end (torch raises IndexError there)."""
    torch.manual_seed(0)
    module = {
        "flax": lambda: _flax(),
        "from_torch": lambda: _from_torch(LOSSES["jax_loss"]),
        "from_lightning": lambda: JaxModule.from_lightning(_EvalBag(), print_summary=False),
    }[path]()
    good = DataLoader(_batches(None, 0), batch_size=None)
    quiet_trainer().validate(module, good)  # in range: nothing raised
    with pytest.raises(jaxcore.BatchError) as err:
        quiet_trainer().validate(module, DataLoader(_batches(VOCAB, 1), batch_size=None))
    msg = str(err.value)
    assert "['ids'] indexes " in msg and f"of {VOCAB} rows" in msg, msg
    assert f"but holds {VOCAB} in a validation" in msg, msg


def test_predict_refuses_ids_past_the_table() -> None:
    module = _flax()
    quiet_trainer().predict(module, DataLoader(_batches(None, 0), batch_size=None))
    with pytest.raises(jaxcore.BatchError, match="but holds 49 in a predict batch"):
        quiet_trainer().predict(module, DataLoader(_batches(49, 2), batch_size=None))
