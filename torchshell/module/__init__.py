"""The module users train: :class:`JaxModule`, the ``LightningModule`` that owns the loop.

- :mod:`._jax_module`: ``JaxModule``; how a model comes in is its adapter's
  (:mod:`torchshell.adapters`: Flax, ``from_torch``; :mod:`torchshell.port`: a whole
  ``LightningModule``);
- the parts ``JaxModule`` is still built from: the train step and its log
  (:mod:`._train_parts`), K steps per call (:mod:`._windows`), accumulation windows
  (:mod:`._accumulation`), the Trainer flags (:mod:`._flags`, :mod:`._parts`), evaluation
  (:mod:`._evaluation`); checkpoints of the JAX state (:mod:`._checkpoint`).
"""

from torchshell.adapters import Adapter, FlaxAdapter, Placement, TorchAdapter
from torchshell.module._jax_module import JaxModule

__all__ = ["Adapter", "FlaxAdapter", "JaxModule", "Placement", "TorchAdapter"]
