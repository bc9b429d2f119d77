"""``torch.no_grad()`` regions of the user's code stop gradients in the traced step.

A trace runs under torch's ``no_grad`` throughout (JAX differentiates it, not torch's
autograd), so a user's own ``with torch.no_grad():`` (or ``@torch.no_grad()``) changed
nothing: what it computed carried gradients into the loss. MoCo's momentum key encoder
(``param_k.data = param_k.data * m + param_q.data * (1 - m)`` and ``k = encoder_k(x)`` under
``no_grad``) sent the contrastive loss's gradient through the keys into the query encoder,
silently (its weights 9e-3 apart from plain Lightning's after one SGD step); a teacher's
logits, a DINO centre or spectral norm's power iteration did the same.

While such a region of the user's code is open, every op's result is
``jax.lax.stop_gradient`` of itself, as torch records no graph there; an in-place op
(``ema.mul_(d).add_(p, alpha=1 - d)``, ``w.clamp_(-c, c)``) keeps the gradient path of the
tensor it writes to, as torch keeps a leaf's identity, and takes none from the new values.
``torch.utils.checkpoint``'s own ``no_grad`` forward (recomputed in its backward) and
coreshell's own regions are not the user's and change nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
import torch

from torchshell.trace._inplace import _mutates_self

_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("coreshell_user_no_grad", default=0)
_TORCH = os.path.dirname(torch.__file__)
_SHELL = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PASS_THROUGH = (  # torch's decorator and context-manager plumbing
    os.path.join(_TORCH, "utils", "_contextlib.py"),
    os.path.join(_TORCH, "autograd", "grad_mode.py"),
)
_NOT_USERS = (os.path.join(_TORCH, "utils", "checkpoint.py"), _SHELL + os.sep)


def _entered_by_user() -> bool:
    """Whether the ``no_grad`` being entered was opened by code other than torch's
    checkpointing or coreshell's own (its decorator's plumbing skipped)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in _PASS_THROUGH:
        frame = frame.f_back  # type: ignore[assignment]
    name = frame.f_code.co_filename if frame is not None else ""
    return not name.startswith(_NOT_USERS)


@jax.custom_vjp
def _keep_path(old: jax.Array, new: jax.Array) -> jax.Array:
    """``new``'s values with ``old``'s gradient path (an in-place write under no_grad)."""
    return new


def _keep_path_fwd(old: jax.Array, new: jax.Array) -> tuple[jax.Array, None]:
    return new, None


def _keep_path_bwd(_: None, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    return g, jax.numpy.zeros_like(g)


_keep_path.defvjp(_keep_path_fwd, _keep_path_bwd)


@contextlib.contextmanager
def user_no_grad_regions() -> Iterator[None]:
    """For the duration: ``torch.no_grad``, ``torch.set_grad_enabled(False)`` and
    ``torch.inference_mode()`` entered by the user's code are counted (see
    :func:`stopped_in_no_grad`, which stops the gradients of ops run inside them).

    ``set_grad_enabled(not self.freeze_encoder)`` around a backbone (fine-tuning code) was
    not: the frozen encoder trained. A user's ``inference_mode()`` is counted and not
    entered: under it torch skips the decompositions torchax lowers (``aten::dropout``
    stopped the trace, its message blaming the layer).
    """
    grad_mode = torch.autograd.grad_mode
    patched = [
        _counting(grad_mode.no_grad, lambda cm: True),
        _counting(grad_mode.set_grad_enabled, lambda cm: not cm.mode),
        _counting(grad_mode.inference_mode, lambda cm: bool(cm.mode), replace=True),
    ]
    token = _DEPTH.set(0)
    try:
        yield
    finally:
        for cls, enter, exit_ in patched:
            cls.__enter__ = enter  # type: ignore[method-assign]
            cls.__exit__ = exit_  # type: ignore[method-assign]
        _DEPTH.reset(token)


def _counting(
    cls: Any, stops: Callable[[Any], bool], replace: bool = False
) -> tuple[Any, Any, Any]:
    """Patches ``cls``'s ``__enter__``/``__exit__`` to count a region the user's code opens
    whose gradients ``stops`` (``replace``: such a region is not entered, only counted);
    returns ``(cls, enter, exit)`` to put back."""
    enter, exit_ = cls.__enter__, cls.__exit__

    def counted_enter(self: Any) -> None:
        user = _entered_by_user() and stops(self)
        self._coreshell_token = _DEPTH.set(_DEPTH.get() + 1) if user else None
        if not (replace and user):
            enter(self)

    def counted_exit(self: Any, *exc: Any) -> None:
        token = self.__dict__.pop("_coreshell_token", None)
        if not (replace and token is not None):
            exit_(self, *exc)
        if token is not None:
            _DEPTH.reset(token)

    cls.__enter__ = counted_enter
    cls.__exit__ = counted_exit
    return cls, enter, exit_


def stopped_in_no_grad(env: Any, dispatch: Callable[..., Any]) -> Callable[..., Any]:
    """``dispatch`` (torchax's, one torch op) whose results carry no gradient inside a
    user's ``torch.no_grad()`` region (an in-place op: its target keeps its own path)."""
    from torchax.tensor import Tensor

    def stop(x: Any) -> Any:
        if type(x) is Tensor:
            return Tensor(jax.lax.stop_gradient(x._elem), x._env)
        return x

    @functools.wraps(dispatch)
    def run(func: Any, types: Any, args: Any, kwargs: Any = None) -> Any:
        if _DEPTH.get() <= 0:
            return dispatch(func, types, args, kwargs)
        if args and type(args[0]) is Tensor and _mutates_self(func):
            target = args[0]
            old = target._elem
            out = dispatch(func, types, args, kwargs)
            new = target._elem
            same = getattr(new, "shape", None) == old.shape and new.dtype == old.dtype
            if new is not old and same and jax.numpy.issubdtype(old.dtype, jax.numpy.inexact):
                target._elem = _keep_path(old, jax.lax.stop_gradient(new))
            return out
        out = dispatch(func, types, args, kwargs)
        return jax.tree.map(stop, out, is_leaf=lambda x: isinstance(x, torch.Tensor))

    return run
