"""The adapter's ``hooks`` group: what the model adds to the module's own Lightning hooks.

:class:`ModuleHooks` is the Flax and torch adapters' group: the module's hooks alone. The
port's (:class:`~torchshell.port._hooks.LightningHooks`) runs the user's ``LightningModule``
hooks beside them, forwards its attributes, loaders and ``forward``, and traces its gradient
hooks. Each method is given the :class:`~torchshell.module.JaxModule` whose hook calls it.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

__all__ = ["ModuleHooks"]


class ModuleHooks:
    """The module's own hooks, nothing added (the Flax and torch adapters' ``hooks``).

    Example:
        >>> hooks = ModuleHooks()
        >>> hooks.set_attribute(None, "batch_size", 32)
        >>> hooks.attribute(None, "batch_size")
        32
    """

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}  # attributes set through the module (batch_size)

    def attach(self, module: Any) -> None:
        """At the end of the module's ``__init__``: the model's hooks put on the module."""

    def trainer_attached(self, module: Any, trainer: L.Trainer) -> None:
        """When Lightning attaches the module: validation runs when the run has a val loader.

        Lightning warns about a ``validation_step`` without a ``val_dataloader``; the
        module's is coreshell's, not the user's, so without a loader it is hidden
        (Lightning's own check).
        """
        if trainer.fit_loop.epoch_loop.val_loop._data_source.is_defined():
            vars(module).pop("validation_step", None)
        else:
            module.validation_step = L.LightningModule.validation_step.__get__(module)

    def setup(self, module: Any, stage: str) -> None:
        """After the module's own ``setup``."""

    def teardown(self, module: Any, stage: str) -> None:
        """Before the module's own ``teardown``."""

    def forward(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        """``module(...)`` on the host: a Flax model has no torch forward."""
        raise NotImplementedError(
            f"{type(module).__name__}(...) has no torch forward: the model is a JAX one. Fix: "
            "module.predict_step(batch, 0) for predictions, or torch_state_dict() loaded "
            "into the torch twin (torchshell.export) to run it in torch."
        )

    def attribute(self, module: Any, name: str) -> Any:
        """An attribute the module does not hold itself (``AttributeError`` when missing)."""
        if name in self.values:
            return self.values[name]
        raise AttributeError(f"{type(module).__name__!r} object has no attribute {name!r}")

    def set_attribute(self, module: Any, name: str, value: Any) -> None:
        """Sets what :meth:`attribute` reads (Lightning's batch size finder: ``batch_size``)."""
        self.values[name] = value

    def wants_outputs(self, module: Any) -> bool:
        """Whether the model's own hooks read ``on_train_batch_end``'s outputs."""
        return False

    def outputs_ahead(self, module: Any, batch: Any, i: int, raw: Any) -> dict[str, Any] | None:
        """``on_train_batch_end``'s outputs computed before the step; ``None``: the step's.

        ``batch`` is the prepared batch, ``raw`` the one the DataLoader made. Under
        ``accumulate_grad_batches=m`` a batch's step runs when its window completes, but
        Lightning gives each batch its own ``outputs["loss"]`` (its loss / m) at once: when
        a callback reads them, the batch's forward pass runs alone first (micro-batch ``i``
        of the window: the window's params and random key, so the value is the one the
        window's step computes).
        """
        m = module.flags.accumulate
        if m == 1 or not module._outputs_wanted():
            return None
        _, loss = module._step_forward(batch, i)
        return {"loss": torch.tensor(float(loss)) / m}

    def train_batch_end(self, module: Any) -> None:
        """At the start of the module's ``on_train_batch_end``."""

    def grads_fn(self, module: Any) -> Any:
        """What runs on the step's gradients before the optimizer (``make_train_step``'s
        ``grads_fn``), or ``None``."""
        return None
