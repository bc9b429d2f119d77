"""The part of :class:`~torchshell.module.JaxModule` that hands the JAX state to checkpoints
and back, and the trained weights to the user's torch module (see
:mod:`torchshell.module._parts` for the other parts).

What a checkpoint holds beyond the JAX state (the user's own layout) is the adapter's:
:class:`CheckpointLayout` is its checkpoint group (``adapter.checkpoint``), which the hooks
here call; the Flax and torch adapters' adds nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import jaxcore
import torchshell.checkpoint._state_io as _state_io
from torchshell._errors import ConfigError
from torchshell.checkpoint._orbax import restore_state
from torchshell.module._parts import _Shared

__all__ = ["CheckpointPart", "Held"]


@dataclass
class Held:
    """What a restore holds for a state not built yet, and the state the torch module holds.

    Attributes:
        directory: an Orbax directory to restore from when the state is built.
        tensors: a plain Lightning checkpoint's state tensors, likewise.
        synced: the state whose weights the user's torch module holds (``from_torch``,
            ``from_lightning``): synced once per state.

    Example:
        >>> Held().pending
        False
    """

    directory: Path | None = None
    tensors: dict[str, torch.Tensor] | None = None
    synced: Any = None

    @property
    def pending(self) -> bool:
        """Whether a restore waits for the state."""
        return self.directory is not None or self.tensors is not None

    def apply(self, state: Any) -> Any:
        """The state just built from the first batch, with what a restore held for it."""
        if self.directory is not None:
            state, self.directory = restore_state(self.directory, state), None
        if self.tensors is not None:
            state, self.tensors = _state_io.state_from_tensors(self.tensors, state), None
        return state


class CheckpointPart(_Shared):
    def torch_state_dict(self, twin: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The trained weights as a PyTorch ``state_dict`` (strictly checked against ``twin``).

        For a Flax model the params and model state (e.g. ``batch_stats``; an NNX module's
        ``BatchStat`` variables) go through :func:`bridge.export_state_dict`; for
        :meth:`from_torch` modules they already are one.
        """
        if self.state is None:
            raise ConfigError("No trained state yet: run trainer.fit first.")
        return self.adapter.state_dict(self.state, twin)

    def on_fit_start(self) -> None:
        """A new ``fit`` of a trained module (not a resume) starts a new optimizer.

        As in Lightning, which calls ``configure_optimizers`` at every ``fit``: the weights
        carry over, the optimizer state (momentum, Adam moments) and the schedule's step do
        not (:func:`jaxcore.restart_optimizer`). ``fit(ckpt_path=...)`` restores them instead.
        Then the adapter's optimizer group's ``on_fit_start`` (the port's scheduler configs).
        """
        if self.state is not None and self.trainer.ckpt_path is None:
            self.state = jaxcore.restart_optimizer(self.state, self.optimizer())
        self.adapter.optim.on_fit_start(self)

    def on_fit_end(self) -> None:
        """A ``from_torch``/``from_lightning`` module holds the trained weights after ``fit``.

        (``net(x)`` or ``torch.save(net.state_dict())`` after ``trainer.fit`` is what a team
        does next; the parameters are updated in place, so references to them stay.)
        """
        if self.state is None and self.held.pending:  # resumed at the end: no step left to run
            self._restore_without_steps()
        self._sync_user_weights()

    def _sync_user_weights(self) -> None:
        """The trained weights into the user's torch module, in place (once per state)."""
        module = self.torch_module
        if module is not None and self.state is not None and self.held.synced is not self.state:
            with torch.no_grad():
                module.load_state_dict(self.torch_state_dict(), strict=True)
            self.held.synced = self.state
            self.adapter.checkpoint.synced(self)

    def _restore_without_steps(self) -> None:
        """Builds the restored state from one training batch's shapes (nothing trains)."""
        loader = self.trainer.train_dataloader
        if loader is None:
            return
        batch = self.adapter.prepare(next(iter(loader)))
        one = (
            batch
            if self.flags.accumulate > 1
            else self.adapter.one_step_view(batch, self.steps_per_call)[1]
        )
        self.init_state(one)

    # -- checkpoints (directories: torchshell.checkpoint.OrbaxCheckpointIO) -----------------
    def restore_from(self, directory: Path) -> None:
        """Restores the JAX state from an Orbax directory when the state is (re)built."""
        if self.state is not None:
            self.state = restore_state(directory, self.state)
        else:
            self.held.directory = directory

    def _orbax_io(self) -> bool:
        from torchshell.checkpoint._orbax import OrbaxCheckpointIO

        io = getattr(self.trainer.strategy, "checkpoint_io", None)
        return isinstance(io, OrbaxCheckpointIO)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        _state_io.save_rng(checkpoint)
        if self.state is not None and not self._orbax_io():  # a plain Lightning file
            checkpoint[_state_io.STATE_KEY] = _state_io.state_to_tensors(self.state)
        self.adapter.checkpoint.save(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        _state_io.load_rng(checkpoint)
        tensors = checkpoint.get(_state_io.STATE_KEY)
        if tensors is not None:
            if self.state is not None:
                self.state = _state_io.state_from_tensors(tensors, self.state)
            else:
                self.held.tensors = tensors
        self.adapter.checkpoint.load(self, checkpoint)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """The checkpoint's ``state_dict``, as the adapter's checkpoint group reads it."""
        return self.adapter.checkpoint.load_state_dict(self, state_dict, strict, assign)
