"""The adapter's ``hooks`` group: what the model adds to the module's own Lightning hooks.

:class:`ModuleHooks` is the Flax and torch adapters' group: the module's hooks alone. The
port's (:class:`~torchshell.port._hooks.LightningHooks`) runs the user's ``LightningModule``
hooks beside them, forwards its attributes, loaders and ``forward``, and traces its gradient
hooks. Each method is given the :class:`~torchshell.module.JaxModule` whose hook calls it.

User hooks are dispatched, never set on the module: each of Lightning's loop hooks
(:data:`LOOP_HOOKS`) is a method of ``JaxModule`` that does the module's own part, then calls
``adapter.hooks.run(module, name, ...)``. The hooks whose *presence* Lightning reads
(:data:`TABLE_HOOKS`: it skips an evaluation loop, a loader or a batch transfer the module does
not override) are properties of ``JaxModule`` that read the group's :attr:`ModuleHooks.table`,
built once per module (and per fit for ``validation_step``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, TypeVar

import lightning as L
import torch

__all__ = [
    "LOOP_HOOKS",
    "TABLE_HOOKS",
    "ModuleHooks",
    "adapter_hook",
    "dispatching_hooks",
    "table_hook",
]

T = TypeVar("T")

# Lightning's loop hooks on a LightningModule: JaxModule's own part, then the adapter's
LOOP_HOOKS = tuple(
    f"on_{stage}_{when}"
    for stage in (
        "fit",
        "train",
        "validation",
        "test",
        "predict",
        "train_epoch",
        "validation_epoch",
        "test_epoch",
        "predict_epoch",
    )
    for when in ("start", "end")
) + tuple(
    f"on_{stage}_batch_{when}"
    for stage in ("train", "validation", "test", "predict")
    for when in ("start", "end")
)
# the hooks Lightning checks with ``is_overridden``: JaxModule finds them in the table
TABLE_HOOKS = (
    "validation_step",
    "test_step",
    "prepare_data",
    "train_dataloader",
    "val_dataloader",
    "test_dataloader",
    "predict_dataloader",
    "on_before_batch_transfer",
    "transfer_batch_to_device",
    "on_after_batch_transfer",
)


def table_hook(name: str) -> Any:
    """``JaxModule``'s hook ``name``: the entry of its adapter's hook table (a property).

    Its getter is ``operator.attrgetter`` (C code): Lightning looks the batch transfer hooks
    up for every batch, and the lookup costs no Python call.

    Example:
        >>> class Module:
        ...     prepare_data = table_hook("prepare_data")
        >>> module = Module()
        >>> module.adapter = SimpleNamespace(hooks=ModuleHooks())
        >>> module.adapter.hooks.table = SimpleNamespace(prepare_data=print)
        >>> module.prepare_data is print
        True
    """
    return property(
        operator.attrgetter(f"adapter.hooks.table.{name}"),
        doc=f"Lightning's ``{name}``, as the adapter gives it (``adapter.hooks.table``).",
    )


def adapter_hook(name: str) -> Callable[..., Any]:
    """``JaxModule``'s loop hook ``name`` where the module has no part of its own: the
    adapter's alone (``adapter.hooks.run``; the port: the user's hook)."""

    def hook(module: Any, *args: Any, **kwargs: Any) -> Any:
        return module.adapter.hooks.run(module, name, *args, **kwargs)

    hook.__name__ = hook.__qualname__ = name
    return hook


def dispatching_hooks(cls: type[T]) -> type[T]:
    """``JaxModule``'s class with the Lightning hooks it does not define itself: the
    :data:`TABLE_HOOKS` (:func:`table_hook`) and the :data:`LOOP_HOOKS` it has no part in
    (:func:`adapter_hook`). Class attributes, set once at import; an instance holds none.

    Example:
        >>> @dispatching_hooks
        ... class Module:
        ...     def on_fit_start(self) -> None: ...
        >>> Module.on_fit_start.__qualname__, Module.on_fit_end.__name__
        ('Module.on_fit_start', 'on_fit_end')
        >>> isinstance(vars(Module)["val_dataloader"], property)
        True
    """
    for name in TABLE_HOOKS:
        setattr(cls, name, table_hook(name))
    for name in LOOP_HOOKS:
        if name not in vars(cls):  # (the class's own: it calls hooks.run itself)
            setattr(cls, name, adapter_hook(name))
    return cls


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
        self.table = SimpleNamespace()  # TABLE_HOOKS: what the module's properties give
        self.dispatches = type(self).run is not ModuleHooks.run  # (else the module skips run)
        # outputs_ahead may give a batch's outputs outside accumulation windows (else the
        # module's training step skips it there: the port's, until training_step was traced
        # returning its loss alone)
        self.ahead = False

    def attach(self, module: Any) -> None:
        """At the end of the module's ``__init__``: the hook table, the module's own
        evaluation steps and Lightning's defaults (loaders, batch transfer)."""
        self.table = SimpleNamespace(**self.entries(module))

    def entries(self, module: Any) -> dict[str, Any]:
        """The table's entries: :data:`TABLE_HOOKS` as the model gives them."""
        entries = {name: default_hook(module, name) for name in TABLE_HOOKS}
        entries.update(validation_step=module._val_step, test_step=module._test_step)
        return entries

    def trainer_attached(self, module: Any, trainer: L.Trainer) -> None:
        """When Lightning attaches the module: validation runs when the run has a val loader.

        Lightning warns about a ``validation_step`` without a ``val_dataloader``; the
        module's is coreshell's, not the user's, so without a loader it is Lightning's
        default, as if not overridden (Lightning's own check).
        """
        if trainer.fit_loop.epoch_loop.val_loop._data_source.is_defined():
            step = module._val_step
        else:
            step = default_hook(module, "validation_step")
        self.table = SimpleNamespace(**{**vars(self.table), "validation_step": step})

    def run(self, module: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        """Lightning's loop hook ``name`` (:data:`LOOP_HOOKS`), after the module's own part:
        the model's part, with the hook's arguments (the port: the user's hook); what the
        hook returns (``None`` here)."""

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

    def grads_fn(self, module: Any) -> Any:
        """What runs on the step's gradients before the optimizer (``make_train_step``'s
        ``grads_fn``), or ``None``."""
        return None


def default_hook(module: Any, name: str) -> Any:
    """``LightningModule``'s own hook ``name`` bound to ``module`` (not overridden)."""
    return getattr(L.LightningModule, name).__get__(module)
