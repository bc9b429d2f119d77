"""The module users train: :class:`JaxModule`, the ``LightningModule`` that owns the loop.

- :mod:`._jax_module`: ``JaxModule``; how a model comes in is its adapter's
  (:mod:`torchshell.adapters`: Flax, ``from_torch``; :mod:`torchshell.port`: a whole
  ``LightningModule``);
- what its hooks hand over to, as functions of the module: the train step
  (:mod:`._training`) and its log (:mod:`._logging`), the Trainer flags (:mod:`._flags`),
  evaluation (:mod:`._evaluation`), checkpoints of the JAX state (:mod:`._checkpoint`);
- what it owns as objects: K steps per call (:mod:`._windows`), accumulation windows
  (:mod:`._accumulation`), the compiled programs (:mod:`._compiled`), one run's changes
  (:mod:`._run_scope`).
"""

from torchshell.adapters import Adapter, FlaxAdapter, Placement, TorchAdapter
from torchshell.module._jax_module import JaxModule

__all__ = ["Adapter", "FlaxAdapter", "JaxModule", "Placement", "TorchAdapter"]
