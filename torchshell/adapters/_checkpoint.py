"""The Flax and torch adapters' ``checkpoint`` group: the JAX state alone (the module writes it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L

__all__ = ["CheckpointLayout"]


class CheckpointLayout:
    """The adapter's checkpoint group (``adapter.checkpoint``): the Flax and torch adapters'.

    The protocol the module's hooks call, each method given the
    :class:`~torchshell.module.JaxModule`. The JAX state and the RNG are written and read by
    the module itself (:mod:`torchshell.module._checkpoint`), whatever the adapter; a group adds the
    user's own layout (``LightningAdapter``'s: :mod:`torchshell.port._ckpt_part`). This one
    adds nothing.

    Example:
        >>> checkpoint = {}
        >>> CheckpointLayout().save(None, checkpoint)
        >>> checkpoint
        {}
    """

    host_versions: Any = None
    """What :meth:`before_step` compares with (the port's: the user's tensors' versions when
    host code read the weights); while it is empty the module's training step skips
    :meth:`before_step`."""

    def save(self, module: Any, checkpoint: dict[str, Any]) -> None:
        """``on_save_checkpoint``, after the JAX state and the RNG were written."""

    def load(self, module: Any, checkpoint: dict[str, Any]) -> None:
        """``on_load_checkpoint``, after the JAX state and the RNG were read."""

    def load_state_dict(
        self, module: Any, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """``JaxModule.load_state_dict`` (Lightning's restore, after :meth:`load`): the
        module's own torch parameters (none), as ``LightningModule`` loads them."""
        return L.LightningModule.load_state_dict(module, state_dict, strict=strict, assign=assign)

    def restored(self, module: Any, state: Any) -> Any:
        """The state just built from the first batch, with what a restore held for it."""
        return state

    def synced(self, module: Any) -> None:
        """After the trained weights were loaded into ``module.torch_module``."""

    def before_step(self, module: Any) -> None:
        """At the start of every ``training_step``, before the batch is handed over."""
