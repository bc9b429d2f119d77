"""Bring a Lightning project as it is: its LightningModule, traced into the JAX step.

``JaxModule.from_lightning(module)`` (:class:`LightningJaxModule`) traces the module's own
``training_step``/``validation_step``/``test_step``/``predict_step`` and ``self.log`` calls
(:class:`LightningPort`), maps its ``configure_optimizers`` onto optax with torch's update
math (:func:`map_configure_optimizers`), and clips gradients like Lightning
(:func:`torch_clip`).
"""

from torchshell._clip import torch_clip
from torchshell.port._module import LightningJaxModule
from torchshell.port._optim import MappedOptimizer, map_configure_optimizers
from torchshell.port._trace import LightningPort, LogSpec

__all__ = [
    "LightningJaxModule",
    "LightningPort",
    "LogSpec",
    "MappedOptimizer",
    "map_configure_optimizers",
    "torch_clip",
]
