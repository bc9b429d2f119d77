"""Bring a Lightning project as it is: its LightningModule, traced into the JAX step.

``JaxModule.from_lightning(module)`` (:class:`LightningJaxModule`) traces the module's own
``training_step``/``validation_step``/``test_step``/``predict_step`` and ``self.log`` calls
(:class:`LightningPort`), maps its ``configure_optimizers`` onto optax with torch's update
math (:func:`map_configure_optimizers`), and clips gradients like Lightning
(:func:`torch_clip`).
"""

from typing import Any

from torchshell.module._clip import torch_clip
from torchshell.optim import MappedOptimizer, map_configure_optimizers
from torchshell.port._logs import LogSpec
from torchshell.port._trace import LightningPort

__all__ = [
    "LightningJaxModule",
    "LightningPort",
    "LogSpec",
    "MappedOptimizer",
    "map_configure_optimizers",
    "torch_clip",
]


def __getattr__(name: str) -> Any:
    # LightningJaxModule is built in torchshell.module (from this package's part), which
    # imports this package: loaded on first use, like torchshell's own lazy names.
    if name == "LightningJaxModule":
        import importlib

        return importlib.import_module("torchshell.module").LightningJaxModule
    raise AttributeError(f"module 'torchshell.port' has no attribute {name!r}")
