"""Porting an existing Lightning project to coreshell, in one file.

The team's DataModule and Trainer flags stay exactly as they were; only the model moves:
its compute becomes a Flax module trained by a jitted JAX step, and a torch twin with the
same layer names receives the trained weights for deployment.

Run: ``python examples/port_lightning.py --max-steps 300``
"""

from __future__ import annotations

import argparse

import flax.linen as fnn
import jax
import lightning as L
import torch
from torch import nn

import bridge
import jaxcore
from torchshell import JaxModule
from torchshell.data.digits import DigitsDataModule


# --- before: the team's LightningModule (kept here only for comparison) ------------------
class TorchClassifier(L.LightningModule):
    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def training_step(self, batch: dict[str, torch.Tensor], _: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(batch["x"]), batch["y"].long())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


# --- after: the same network in Flax, with names the twin shares -------------------------
class FlaxClassifier(fnn.Module):
    hidden: int = 128

    @fnn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:  # x: [B, 64]
        x = fnn.relu(fnn.Dense(self.hidden, name="net_0")(x))  # torch: net.0 (net.1 is ReLU)
        return fnn.Dense(10, name="net_2")(x)  # [B, 10]


def main(max_steps: int) -> float:
    """Trains the Flax port under the unchanged Trainer flags; returns the twin's accuracy."""
    datamodule = DigitsDataModule(batch_size=64)  # unchanged
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )  # unchanged
    module = JaxModule(
        FlaxClassifier(),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer("adamw", lr=3e-3),
        print_summary=False,
    )
    trainer.fit(module, datamodule)

    twin = TorchClassifier()  # the deployment target: the team's own module
    # Flax `net_0/kernel` (in, out) <-> torch `net.0.weight` (out, in): the bridge's built-ins.
    twin.load_state_dict(bridge.export_state_dict(module.state.params, twin), strict=True)
    batch = next(iter(datamodule.test_dataloader()))
    with torch.no_grad():
        accuracy = (twin.net(batch["x"]).argmax(-1) == batch["y"]).float().mean().item()
    print(f"torch twin accuracy on {len(batch['y'])} test digits: {accuracy:.3f}")
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-steps", type=int, default=300)
    main(parser.parse_args().max_steps)
