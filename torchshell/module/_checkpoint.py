"""How a :class:`~torchshell.module.JaxModule` hands the JAX state to checkpoints and back,
and the trained weights to the user's torch module, as functions of the module (its
``on_save_checkpoint``, ``on_load_checkpoint``, ``on_fit_start``/``on_fit_end`` call them).

What a checkpoint holds beyond the JAX state (the user's own layout) is the adapter's:
:class:`CheckpointLayout` is its checkpoint group (``adapter.checkpoint``), which the
functions here call; the Flax and torch adapters' adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import jaxcore
import torchshell.checkpoint._state_io as _state_io
from torchshell.adapters._torch_fns import restore_weights
from torchshell.checkpoint._orbax import restore_state

# The JaxModule these functions serve, by name only: _jax_module imports this file, and an
# import back (even for type checking) would close a cycle.
JaxModule = Any

__all__ = ["Held", "fit_end", "fit_start", "load", "restore_from", "save", "sync_user_weights"]


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


def fit_start(module: JaxModule) -> None:
    """A new ``fit`` of a trained module (not a resume) starts a new optimizer.

    As in Lightning, which calls ``configure_optimizers`` at every ``fit``: the weights
    carry over, the optimizer state (momentum, Adam moments) and the schedule's step do
    not (:func:`jaxcore.restart_optimizer`). ``fit(ckpt_path=...)`` restores them instead.
    Then the adapter's optimizer group's ``on_fit_start`` (the port's scheduler configs).
    """
    if module.state is not None and module.trainer.ckpt_path is None:
        module.state = jaxcore.restart_optimizer(module.state, module.optimizer())
    module.adapter.optim.on_fit_start(module)


def fit_end(module: JaxModule) -> None:
    """A ``from_torch``/``from_lightning`` module holds the trained weights after ``fit``.

    (``net(x)`` or ``torch.save(net.state_dict())`` after ``trainer.fit`` is what a team
    does next; the parameters are updated in place, so references to them stay.)
    """
    if module.state is None and module.held.pending:  # resumed at the end: no step to run
        _restore_without_steps(module)
    sync_user_weights(module)


def sync_user_weights(module: JaxModule) -> None:
    """The trained weights into the user's torch module, in place (once per state)."""
    user, state = module.torch_module, module.state
    restore_weights(module.model_fns)  # (shared submodules: the trace's torchax tensors out)
    if user is not None and state is not None and module.held.synced is not state:
        with torch.no_grad():
            user.load_state_dict(module.torch_state_dict(), strict=True)
        module.held.synced = state
        module.adapter.checkpoint.synced(module)


def _restore_without_steps(module: JaxModule) -> None:
    """Builds the restored state from one training batch's shapes (nothing trains)."""
    loader = module.trainer.train_dataloader
    if loader is None:
        return
    batch = module.adapter.prepare(next(iter(loader)))
    one = (
        batch
        if module.flags.accumulate > 1
        else module.adapter.one_step_view(batch, module.steps_per_call)[1]
    )
    module.init_state(one)


# -- checkpoints (directories: torchshell.checkpoint.OrbaxCheckpointIO) -----------------------
def restore_from(module: JaxModule, directory: Path) -> None:
    """Restores the JAX state from an Orbax directory when the state is (re)built."""
    if module.state is not None:
        module.state = restore_state(directory, module.state)
    else:
        module.held.directory = directory


def _orbax_io(module: JaxModule) -> bool:
    from torchshell.checkpoint._orbax import OrbaxCheckpointIO

    io = getattr(module.trainer.strategy, "checkpoint_io", None)
    return isinstance(io, OrbaxCheckpointIO)


def save(module: JaxModule, checkpoint: dict[str, Any]) -> None:
    """``on_save_checkpoint``: the rng, the JAX state (a plain Lightning file's tensors;
    an Orbax directory holds it itself) and the adapter's layout."""
    _state_io.save_rng(checkpoint)
    if module.state is not None and not _orbax_io(module):  # a plain Lightning file
        checkpoint[_state_io.STATE_KEY] = _state_io.state_to_tensors(module.state)
    module.adapter.checkpoint.save(module, checkpoint)


def load(module: JaxModule, checkpoint: dict[str, Any]) -> None:
    """``on_load_checkpoint``: the rng, the state (held until it is built) and the adapter's
    layout."""
    _state_io.load_rng(checkpoint)
    tensors = checkpoint.get(_state_io.STATE_KEY)
    if tensors is not None:
        if module.state is not None:
            module.state = _state_io.state_from_tensors(tensors, module.state)
        else:
            module.held.tensors = tensors
    module.adapter.checkpoint.load(module, checkpoint)
