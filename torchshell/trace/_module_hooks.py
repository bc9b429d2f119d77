"""Module backward hooks in a traced step: refused, naming the module, the hook and the fix.

``nn.Module.register_full_backward_hook`` (and ``register_full_backward_pre_hook``, the
deprecated ``register_backward_hook``, their global forms) run from torch's autograd: the
hook sees ``grad_input``/``grad_output`` and may replace them. A traced step is differentiated
by ``jax.grad`` over a forward run without autograd, so such a hook never runs and the
gradients silently differ from torch's (a hook that halved ``grad_input`` trained at the
unhalved rate). ``Tensor.register_hook`` does run in the step (:mod:`._inplace` and the
tracer honour it), so the fix is a tensor hook on the module's input or output.

Only a training trace is refused: an eval trace (``validation_step``, ``predict``, a
``validate``- or ``predict``-only run) computes no gradient, so the hook would not run in
torch either (:func:`training_trace`, set by :func:`~torchshell.trace._paths.mode`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.modules import module as torch_module

from torchshell._errors import TorchModelError

_FIX = (
    "Fix: hook the tensor instead, which the traced step runs: a forward pre-hook that "
    "returns `(x,)` after `x = args[0].view_as(args[0]); x.register_hook(lambda g: ...)` "
    "changes the gradient into the module's input (what grad_input is); "
    "`out.register_hook(...)` in a forward hook changes grad_output."
)


# whether the trace running is a training one (no trace said otherwise: refused, the safe side)
_TRAINING = contextvars.ContextVar("coreshell_training_trace", default=True)


@contextlib.contextmanager
def training_trace(train: bool) -> Iterator[None]:
    """Within: the trace is a training one (``train``) or an eval one, which computes no
    gradient and so runs no backward hook in torch either: not refused."""
    token = _TRAINING.set(train)
    try:
        yield
    finally:
        _TRAINING.reset(token)


def _hook_names(hooks: Any) -> list[str]:
    return [getattr(h, "__qualname__", type(h).__name__) for h in hooks.values()]


def _refuse_backward_hooks(module: torch.nn.Module, args: Any) -> None:
    if not _TRAINING.get():
        return
    own = _hook_names(module._backward_hooks) + _hook_names(module._backward_pre_hooks)
    shared = _hook_names(torch_module._global_backward_hooks) + _hook_names(
        torch_module._global_backward_pre_hooks
    )
    if own or shared:
        kind = "its own" if own else "a global (register_module_full_backward_hook)"
        raise TorchModelError(
            f"A {type(module).__name__} module in the traced step has {kind} backward hook "
            f"{', '.join(own or shared)} (register_full_backward_hook / "
            "register_full_backward_pre_hook / register_backward_hook). The step's gradients "
            "come from jax.grad, which does not run module backward hooks, so training would "
            f"silently differ from torch. Expected no module backward hooks. {_FIX}"
        )


@contextlib.contextmanager
def backward_hooks_refused() -> Iterator[None]:
    """While tracing for training, a module with a backward hook raises
    :class:`TorchModelError` when called (a global forward pre-hook checks each module as it
    runs); in an eval trace (:func:`training_trace` ``(False)``) it runs as in torch.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> _ = lin.register_full_backward_hook(lambda m, gi, go: None)
        >>> with backward_hooks_refused():
        ...     try:
        ...         lin(torch.ones(1, 2))
        ...     except TorchModelError as err:
        ...         print(str(err)[:48])
        A Linear module in the traced step has its own b
        >>> with backward_hooks_refused(), training_trace(False):
        ...     lin(torch.ones(1, 2)).shape
        torch.Size([1, 2])
    """
    handle = torch_module.register_module_forward_pre_hook(_refuse_backward_hooks)
    try:
        yield
    finally:
        handle.remove()
