"""A traced torch module's functions that leave the team's module as it was.

A module holding a submodule under two names (locuslab's TCN: ``self.conv1`` is
``self.net[0]``) is left holding torchax tensors by each trace
(:mod:`torchshell.trace._shared`); these functions put its own tensors back after every
call, so that the team's ``net(x)`` and the trained weights' sync keep working.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

import jaxcore
from torchshell.trace._shared import shared_weights_kept

__all__ = ["intact_tracer", "kept_intact", "restore_weights"]


def _kept(fn: Callable[..., Any], restore: Callable[[], None]) -> Callable[..., Any]:
    depth = [0]  # (a call inside a call: restored when the outermost one ends)

    @functools.wraps(fn)  # (its attributes too: torch_static, torch_embeddings)
    def call(*args: Any, **kwargs: Any) -> Any:
        depth[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            depth[0] -= 1
            if not depth[0]:
                restore()

    call.restore_weights = restore  # type: ignore[attr-defined]
    return call


def intact_tracer(module: torch.nn.Module) -> Any:
    """A :class:`~torchshell.torch_model.TorchTracer` of ``module`` whose every call (each
    trace: ``call``, ``probe``, ``host_reads`` go through it) restores the module's own
    tensors when it shares submodules or tensors (``from_lightning``'s tracer)."""
    from torchshell.torch_model import TorchTracer

    tracer = TorchTracer(module)
    restore = shared_weights_kept(module)
    if restore is not None:
        tracer.call = _kept(tracer.call, restore)  # type: ignore[method-assign]
    return tracer


def kept_intact(fns: jaxcore.ModelFns, module: torch.nn.Module) -> jaxcore.ModelFns:
    """``fns`` (a trace of ``module``) whose calls restore the module's own tensors after
    each trace when it shares submodules or tensors; ``fns`` itself otherwise. The restore
    is ``fns.apply.restore_weights`` (see :func:`restore_weights`)."""
    restore = shared_weights_kept(module)
    if restore is None:
        return fns

    return jaxcore.ModelFns(_kept(fns.init, restore), _kept(fns.apply, restore))


def restore_weights(fns: Any) -> None:
    """The module's own tensors back (after host-side traces outside ``fns``' calls)."""
    restore = getattr(getattr(fns, "apply", None), "restore_weights", None)
    if restore is not None:
        restore()
