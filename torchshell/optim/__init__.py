"""torch optimizers and schedulers as optax, with torch's update math.

What ``JaxModule.from_torch`` (a ``torch.optim`` optimizer) and ``JaxModule.from_lightning``
(``configure_optimizers``) both use: :func:`map_configure_optimizers` turns the optimizers,
their param groups and their schedulers (tabulated per step) into one optax transformation
(:class:`MappedOptimizer`); :func:`state_from_torch` and :func:`state_to_torch` carry the
optimizer state both ways (a torch ``optimizer.state_dict()`` in a Lightning checkpoint).
"""

from torchshell.optim._map import MappedOptimizer, map_configure_optimizers
from torchshell.optim._state import state_from_torch, state_to_torch

__all__ = ["MappedOptimizer", "map_configure_optimizers", "state_from_torch", "state_to_torch"]
