"""The user's module made whole before it is traced: ``configure_model`` run, lazy layers sized.

Plain Lightning calls ``configure_model()`` before ``configure_optimizers`` and sizes
``nn.LazyLinear``/``LazyConv*`` on the first forward; the port snapshots every weight when
``JaxModule.from_lightning(module)`` is called, so both happen there: ``configure_model`` is
called once (Lightning asks for it to be idempotent: its own later call changes nothing), and
lazy parameters are sized by running ``forward`` on ``self.example_input_array`` in eval mode
without gradients, as Lightning's model summary runs it. What is still unsized is refused.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

from torchshell._errors import ConfigError
from torchshell.trace._paths import mode

__all__ = ["check_trainable", "layers_changed", "prepare_module"]


def _unsized(module: torch.nn.Module) -> list[str]:
    named = [*module.named_parameters(), *module.named_buffers()]
    return [n for n, t in named if isinstance(t, UninitializedParameter | UninitializedBuffer)]


def prepare_module(module: LightningModule) -> None:
    """Runs ``module.configure_model()`` and sizes lazy layers, in place.

    Raises:
        ConfigError: ``configure_model`` needs the Trainer, or a lazy layer is still
            unsized (no ``example_input_array`` to size it with).

    >>> import lightning as L, torch
    >>> class Lazy(L.LightningModule):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.head = torch.nn.LazyLinear(3)
    ...         self.example_input_array = torch.zeros(2, 5)
    ...     def forward(self, x):
    ...         return self.head(x)
    >>> m = Lazy()
    >>> prepare_module(m)
    >>> tuple(m.head.weight.shape)
    (3, 5)
    """
    name = type(module).__name__
    if is_overridden("configure_model", module, parent=LightningModule):
        try:
            module.configure_model()
        except RuntimeError as err:
            if "not attached to a `Trainer`" not in str(err):
                raise
            raise ConfigError(
                f"{name}.configure_model() reads self.trainer, which "
                "JaxModule.from_lightning(module) does not have yet: the layers it builds are "
                f"needed to trace the module ({err}). Fix: build them in __init__, or call "
                "configure_model yourself before from_lightning with the values it needs."
            ) from err
    if not _unsized(module):
        return
    example = module.example_input_array
    if example is not None:
        # in eval, then every submodule's own mode back (a teacher the user put in eval stays)
        with mode(module, False), torch.no_grad():
            if isinstance(example, dict):
                module(**example)
            elif isinstance(example, tuple | list):
                module(*example)
            else:
                module(example)
    if unsized := _unsized(module):
        shown = ", ".join(unsized[:4]) + (", ..." if len(unsized) > 4 else "")
        raise ConfigError(
            f"{name} has lazy parameters not sized yet ({shown}: nn.LazyLinear/LazyConv* take "
            "their shape on the first forward). JaxModule.from_lightning needs every weight's "
            "shape before the first step"
            + (
                ""
                if example is None
                else ", and forward(self.example_input_array) left these unsized"
            )
            + ". Fix: set self.example_input_array to an example input (from_lightning runs "
            "forward on it, as Lightning's model summary does), give the layer its input size "
            "(nn.Linear(in_features, ...)), or call the module once on an example batch "
            "before from_lightning."
        )


def layers_changed(module: torch.nn.Module, tracer: Any) -> bool:
    """Whether ``module``'s parameters and buffers (names, shapes, trainable or not) differ
    from what ``tracer`` (a :class:`~torchshell.torch_model.TorchTracer`) snapshotted: a hook
    run after ``from_lightning`` (the user's ``setup(stage)``) built or froze layers."""
    now = {
        k: (tuple(v.shape), isinstance(v, torch.nn.Parameter) and v.requires_grad)
        for k, v in itertools.chain(module.named_parameters(), module.named_buffers())
    }
    seen = {k: (tuple(v.shape), k in tracer.params0) for k, v in tracer.params0.items()}
    seen |= {k: (tuple(v.shape), False) for k, v in {**tracer.state0, **tracer.consts}.items()}
    return now != seen


def check_trainable(module: torch.nn.Module, tracer: Any, optimizers: Any, epoch: int) -> None:
    """Refuses a change of ``requires_grad`` during fit (a freeze or unfreeze in a hook or
    callback) that plain Lightning would train differently from the compiled step.

    The step's trainable set is the one traced. A parameter frozen since then stops moving in
    plain Lightning (torch's optimizer skips a ``None`` gradient); one unfrozen starts moving
    when the torch optimizer holds it (``optimizers``: the Trainer's; ``None``: an optax
    transform given to ``from_lightning``, which holds every parameter).

    Raises:
        ConfigError: naming the parameters, the epoch and the fix.
    """
    held = (
        None
        if optimizers is None
        else {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    )
    frozen, unfrozen = [], []
    for name, p in module.named_parameters():
        if name in tracer.params0 and not p.requires_grad:
            frozen.append(name)
        elif name not in tracer.params0 and p.requires_grad and (held is None or id(p) in held):
            unfrozen.append(name)
    if not frozen and not unfrozen:
        return
    what = " and ".join(
        f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''} {how}"
        for names, how in ((frozen, "frozen"), (unfrozen, "unfrozen"))
        if names
    )
    raise ConfigError(
        f"{type(module).__name__}: {what} (requires_grad changed) before epoch {epoch}, during "
        "fit. The compiled step trains the parameters that were trainable when it was traced, "
        "so it would go on as before, where plain Lightning would not. Fix: train the phases "
        "as separate fits (set requires_grad, then trainer.fit(JaxModule.from_lightning(model)) "
        "with a new Trainer for each phase; the module keeps the trained weights), or keep "
        "requires_grad fixed and give those parameters their own param group whose LambdaLR "
        "factor is 0 while they should not move."
    )
