"""Bring a Lightning project as it is: its LightningModule, traced into the JAX step.

``JaxModule.from_lightning(module)`` is a ``JaxModule`` with a :class:`LightningAdapter`: it
traces the module's own ``training_step``/``validation_step``/``test_step``/``predict_step``
and ``self.log`` calls (:class:`LightningPort`), maps its ``configure_optimizers`` onto optax
with torch's update math (:func:`map_configure_optimizers`), runs its own hooks beside the
module's (:class:`~torchshell.port._hooks.LightningHooks`), and clips gradients like
Lightning (:func:`torch_clip`).
"""

from torchshell.adapters._clip import torch_clip
from torchshell.optim import MappedOptimizer, map_configure_optimizers
from torchshell.port._adapter import LightningAdapter
from torchshell.port._logs import LogSpec
from torchshell.port._trace import LightningPort

__all__ = [
    "LightningAdapter",
    "LightningPort",
    "LogSpec",
    "MappedOptimizer",
    "map_configure_optimizers",
    "torch_clip",
]
