"""The module users train: :class:`JaxModule` and the adapters a model comes in through.

- :mod:`._jax_module`: ``JaxModule``, the ``LightningModule`` that owns the loop contract;
- :mod:`.adapters`: one adapter per way a model comes in (Flax, ``from_torch``; the
  ``LightningModule``'s is in :mod:`torchshell.port`), and the ``Placement`` of batches;
- the parts ``JaxModule`` is still built from: the train step and its log
  (:mod:`._train_parts`, :mod:`._train_log`), K steps per call (:mod:`._windows`), the Trainer
  flags (:mod:`._flags`, :mod:`._clip`, :mod:`._parts`), evaluation (:mod:`._evaluation`);
- batches as the user's DataLoader yields them (:mod:`._batches`, :mod:`._arrays` for numpy
  and number-list fields, :mod:`._flax_checks`).
"""

from torchshell.module._jax_module import JaxModule
from torchshell.module.adapters import Adapter, FlaxAdapter, Placement, TorchAdapter

__all__ = ["Adapter", "FlaxAdapter", "JaxModule", "Placement", "TorchAdapter"]
