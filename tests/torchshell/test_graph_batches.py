"""Batches whose fields have different numbers of rows (a graph batch: node features, an edge
list, a node-to-graph vector, graph labels) through ``JaxModule.from_torch``: no per-row
weighting where rows do not align (each batch weighs one, as plain torch's step does), the
weights equal plain torch's step for step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from torchshell import JaxModule
from torchshell._errors import ConfigError

NODES, EDGES, GRAPHS, FEATURES, CLASSES = 6, 10, 4, 5, 3


class MessagePassing(nn.Module):
    """Two rounds of summed messages along the edges (``index_add_``), a mean pool per graph
    (``scatter_add``), a linear head: a GCN-like net written as graph projects write it."""

    def __init__(self, edges_first: bool) -> None:
        super().__init__()
        self.edges_first = edges_first  # edge_index [E, 2] (else [2, E])
        self.embed = nn.Linear(FEATURES, 16)
        self.rounds = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor) -> Any:
        src, dst = edge_index.unbind(1 if self.edges_first else 0)
        h = torch.tanh(self.embed(x))
        for layer in self.rounds:
            messages = torch.zeros_like(h).index_add_(0, dst, h[src])
            h = torch.tanh(layer(h + messages))
        index = batch[:, None].expand(-1, h.shape[1])
        pooled = torch.zeros(GRAPHS, h.shape[1]).scatter_add(0, index, h)
        counts = torch.zeros(GRAPHS).index_add_(0, batch, torch.ones_like(batch, dtype=h.dtype))
        return self.head(pooled / counts[:, None])


def graphs(n: int, seed: int, edges_first: bool) -> list[dict[str, torch.Tensor]]:
    """``n`` batches of GRAPHS graphs (NODES nodes, EDGES edges each), collated as PyG does:
    node indices offset per graph, a node-to-graph ``batch`` vector, one label per graph."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        edges = [
            torch.randint(0, NODES, (2, EDGES), generator=g) + NODES * i for i in range(GRAPHS)
        ]
        edge_index = torch.cat(edges, 1)
        out.append(
            {
                "x": torch.randn(NODES * GRAPHS, FEATURES, generator=g),
                "edge_index": edge_index.T.contiguous() if edges_first else edge_index,
                "batch": torch.arange(GRAPHS).repeat_interleave(NODES),
                "y": torch.randint(0, CLASSES, (GRAPHS,), generator=g),
            }
        )
    return out


def _trainer(root: Path, **flags: Any) -> L.Trainer:
    options: dict[str, Any] = dict(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    return L.Trainer(**(options | flags))


def _build(edges_first: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = MessagePassing(edges_first)
    return net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def _module(net: nn.Module, opt: torch.optim.Optimizer, **kwargs: Any) -> JaxModule:
    return JaxModule.from_torch(
        net,
        nn.CrossEntropyLoss(),
        opt,
        inputs=("x", "edge_index", "batch"),
        print_summary=False,
        **kwargs,
    )


def _loader(batches: list[dict[str, torch.Tensor]]) -> DataLoader:
    return DataLoader(batches, batch_size=None)  # (the batches as collated)


@pytest.mark.parametrize("edges_first", [False, True], ids=["edges_2xE", "edges_Ex2"])
def test_a_graph_batch_trains_as_in_plain_torch(tmp_path: Path, edges_first: bool) -> None:
    # was: TransferError / BatchError "Every batch field needs the same number of rows"
    data, val = graphs(3, 0, edges_first), graphs(2, 1, edges_first)
    net, opt = _build(edges_first)
    losses = []
    for b in data * 2:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(b["x"], b["edge_index"], b["batch"]), b["y"])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    want = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():  # each validation batch weighs one, as plain torch's loop
        outs = [net(b["x"], b["edge_index"], b["batch"]) for b in val]
        val_loss = sum(
            float(nn.functional.cross_entropy(o, b["y"])) for o, b in zip(outs, val, strict=True)
        )

    net, opt = _build(edges_first)
    module = _module(net, opt)
    trainer = _trainer(tmp_path, num_sanity_val_steps=0)
    trainer.fit(module, _loader(data), _loader(val))
    for name, value in want.items():
        torch.testing.assert_close(net.state_dict()[name], value, rtol=1e-4, atol=1e-5)
    assert losses[0] != losses[3]  # (trained: the same batch, another loss)
    got = float(trainer.callback_metrics["val/loss"])
    assert got == pytest.approx(val_loss / len(val), rel=1e-4)


def test_a_graph_batch_under_accumulation_as_in_plain_torch(tmp_path: Path) -> None:
    data = graphs(4, 2, False)
    net, opt = _build(False)
    for i, b in enumerate(data):  # Lightning's accumulation: each batch's loss / m
        loss = nn.functional.cross_entropy(net(b["x"], b["edge_index"], b["batch"]), b["y"])
        (loss / 2).backward()
        if i % 2:
            opt.step()
            opt.zero_grad()
    want = {k: v.clone() for k, v in net.state_dict().items()}
    net, opt = _build(False)
    _trainer(tmp_path, max_epochs=1, accumulate_grad_batches=2).fit(
        _module(net, opt), _loader(data)
    )
    for name, value in want.items():
        torch.testing.assert_close(net.state_dict()[name], value, rtol=1e-4, atol=1e-5)


def test_a_graph_batch_refusals_name_their_fix(tmp_path: Path) -> None:
    net, opt = _build(False)
    batches = graphs(2, 3, False)
    with pytest.raises(ConfigError, match=r"steps_per_call=2 .*Fix: steps_per_call=1"):
        _trainer(tmp_path, max_steps=1).fit(_module(net, opt, steps_per_call=2), _loader(batches))
    masked = [{**b, "mask": torch.ones(NODES * GRAPHS, dtype=torch.bool)} for b in batches]
    with pytest.raises(ConfigError, match=r"named 'mask'.*Fix: rename the field"):
        _trainer(tmp_path, max_steps=1).fit(_module(net, opt), _loader(masked))
