"""How a model comes into :class:`~torchshell.module.JaxModule`, below the module and the port.

An adapter (:class:`Adapter`; the protocol is its docstring) hands batches over and owns six
method groups that the module's own Lightning hooks call, each given the module:

- ``optim`` (:class:`OptaxOptimizer`), ``checkpoint`` (:class:`CheckpointLayout`),
  ``logs`` (:class:`TrainLogs`), ``evaluation`` (:class:`EvalHooks`), ``steps``
  (:class:`TrainSteps`) and ``hooks`` (:class:`ModuleHooks`): the Flax and torch adapters'
  (:class:`FlaxAdapter`, :class:`TorchAdapter`); ``LightningAdapter``
  (:mod:`torchshell.port`) subclasses each for a whole ``LightningModule``;
- the hand-over of a batch: :class:`Placement` (the mesh's data axis), batches as the user's
  DataLoader yields them (:mod:`._batches`, numpy and number-list fields in :mod:`._arrays`,
  the structural checks in :mod:`._flax_checks`), Lightning's gradient clipping in optax
  (:func:`torch_clip`).

``torchshell.module`` and ``torchshell.port`` import this package; it imports neither.
"""

from torchshell.adapters._base import Adapter, FlaxAdapter, TorchAdapter
from torchshell.adapters._checkpoint import CheckpointLayout
from torchshell.adapters._clip import torch_clip
from torchshell.adapters._eval import EvalHooks
from torchshell.adapters._hooks import ModuleHooks
from torchshell.adapters._logs import TrainLogs
from torchshell.adapters._optim import OptaxOptimizer
from torchshell.adapters._placement import Placement
from torchshell.adapters._steps import TrainSteps

__all__ = [
    "Adapter",
    "CheckpointLayout",
    "EvalHooks",
    "FlaxAdapter",
    "ModuleHooks",
    "OptaxOptimizer",
    "Placement",
    "TorchAdapter",
    "TrainLogs",
    "TrainSteps",
    "torch_clip",
]
