"""The user's own ``torch.autocast`` regions honoured in a traced step.

``with torch.autocast("cpu", dtype=torch.bfloat16): logits = self.model(x)`` inside
``training_step`` makes torch compute its matmuls and convolutions in bfloat16. torchax keeps
an autocast dtype of its own (``torchax.amp``), which torch's autocast state does not reach:
the region silently computed in float32. Here each traced op reads torch's autocast state and
runs under torchax's autocast with the same dtype, with torch's cast policy (``torch.nn.
functional.linear`` and the convolutions, which torchax runs as functions before any aten op,
get the policy of their aten ops).

Class-index losses follow torch's autocast too. torch runs ``cross_entropy`` and ``nll_loss``
in float32 under autocast on CPU and CUDA alike (their inputs cast up, a float32 loss), where
the traced graph computed ``log_softmax`` in bfloat16 before them: ``F.cross_entropy`` and
``F.nll_loss`` take torch's own policy for ``aten.cross_entropy_loss``/``aten.nll_loss``
inside a user's region. Under ``precision="bf16-mixed"`` (float32 weights computed in
bfloat16, :func:`mixed_precision`) there is no torch region at all: the step follows torch's
CUDA autocast list, the device a team runs bf16-mixed on (CPU's list leaves ``log_softmax``
and ``softmax`` in the input's dtype, CUDA's runs them in float32): ``log_softmax`` and the
``nll_loss`` after it compute in float32 and give float32, ``softmax`` computes in float32
and gives the input's dtype back (what CUDA's autocast feeds the bfloat16 matmul after it).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["mixed_precision", "user_autocast"]

_DEVICES = ("cpu", "cuda")
_MIXED: contextvars.ContextVar[bool] = contextvars.ContextVar("mixed_precision", default=False)
# torch.nn.functional's class-index losses, by name: the trace's own target checks wrap them
# (``_targets.class_index_checked``), so the function a region sees is not F's own object
_LOSSES = {"cross_entropy": "cross_entropy_loss", "nll_loss": "nll_loss"}
_NARROW = (torch.bfloat16, torch.float16)
# while F.cross_entropy/F.nll_loss of an autocast region (or under mixed_precision) runs
_LOSS_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar("class_loss", default=False)
_FLOAT32_OPS = (
    torch.ops.aten.nll_loss_forward.default,
    torch.ops.aten.nll_loss2d_forward.default,
    torch.ops.aten.log_softmax.int,
    torch.ops.aten._log_softmax.default,
)


@contextlib.contextmanager
def mixed_precision(enabled: bool = True) -> Iterator[None]:
    """Marks a traced call whose float32 weights compute in bfloat16/float16 (the step's
    ``precision="bf16-mixed"``): torch's (CUDA) autocast policy for the class-index losses,
    ``log_softmax`` and ``softmax`` applies (see the module's docstring).

    Example:
        >>> with mixed_precision():
        ...     _MIXED.get()
        True
    """
    token = _MIXED.set(enabled)
    try:
        yield
    finally:
        _MIXED.reset(token)


def _as_aten(func: Any) -> Any:
    """The aten op whose autocast policy a torch function follows (itself otherwise)."""
    aten = torch.ops.aten
    return {
        torch.nn.functional.linear: aten.linear.default,
        torch.conv1d: aten.conv1d.default,
        torch.conv2d: aten.conv2d.default,
        torch.conv3d: aten.conv3d.default,
        torch.conv_transpose1d: aten.conv_transpose1d.default,
        torch.conv_transpose2d: aten.conv_transpose2d.input,
        torch.conv_transpose3d: aten.conv_transpose3d.input,
        torch.matmul: aten.matmul.default,
        torch.Tensor.matmul: aten.matmul.default,
        torch.Tensor.__matmul__: aten.matmul.default,
        torch.bmm: aten.bmm.default,
        torch.mm: aten.mm.default,
    }.get(func, func)


def _class_loss(func: Any) -> Any:
    """``aten.cross_entropy_loss``/``aten.nll_loss`` for ``F.cross_entropy``/``F.nll_loss``
    (or a wrapper of them), else ``None``."""
    if getattr(func, "__module__", None) != "torch.nn.functional":
        return None
    name = _LOSSES.get(getattr(func, "__name__", ""))
    return None if name is None else getattr(torch.ops.aten, name).default


def _in_float32(func: Any, args: Any, kwargs: Any, dispatch: Callable[..., Any]) -> Any:
    """torch's autocast policy of ``func`` where it is float32 (see the module's docstring):
    ``log_softmax`` and ``nll_loss`` inside a class-index loss of an autocast region, and
    under :func:`mixed_precision` anywhere (float32 in and out); ``softmax`` under
    :func:`mixed_precision` (float32 inside, the input's dtype out); ``None`` for every other
    op, and for inputs not in bfloat16/float16."""
    aten = torch.ops.aten
    dtype = getattr(args[0], "dtype", None) if args else None
    if dtype not in _NARROW:
        return None
    if func in _FLOAT32_OPS and (_MIXED.get() or _LOSS_CALL.get()):
        return dispatch(func, (), (_float32(args[0], dispatch), *args[1:]), kwargs)
    if func in (aten.softmax.int, aten._softmax.default) and _MIXED.get():
        out = dispatch(func, (), (_float32(args[0], dispatch), *args[1:]), kwargs)
        return dispatch(aten._to_copy.default, (), (out,), {"dtype": dtype})
    return None


def _float32(value: Any, dispatch: Callable[..., Any]) -> Any:
    return dispatch(torch.ops.aten._to_copy.default, (), (value,), {"dtype": torch.float32})


def user_autocast(env: Any, dispatch: Callable[..., Any]) -> Callable[..., Any]:
    """``dispatch`` (one torch op on torchax tensors) under torch's current autocast region.

    Example:
        >>> import torchax
        >>> env = torchax.default_env()
        >>> seen = []
        >>> run = user_autocast(env, lambda f, t, a, k=None: seen.append(f) or 1)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     _ = run(torch.nn.functional.linear, (), (), {})
        >>> seen == [torch.nn.functional.linear]
        True
    """
    from torchax import amp
    from torchax.tensor import OperatorNotFound

    def autocast_dispatch(func: Any, types: Any, args: Any, kwargs: Any = None) -> Any:
        if env.param.autocast_dtype is None:
            region = any(torch.is_autocast_enabled(device) for device in _DEVICES)
            if _class_loss(func) is not None and (region or _MIXED.get()):
                token = _LOSS_CALL.set(True)  # (torch: float32 on CPU and CUDA alike)
                try:
                    return dispatch(func, types, args, kwargs)
                except OperatorNotFound:  # (torchax then runs it, its aten ops dispatched)
                    return func(*args, **(kwargs or {}))
                finally:
                    _LOSS_CALL.reset(token)
            out = _in_float32(func, args, kwargs or {}, dispatch)
            if out is not None:
                return out
            for device in _DEVICES:
                if torch.is_autocast_enabled(device):
                    dtype = torch.get_autocast_dtype(device)
                    policy = amp.autocast_policy.get(_as_aten(func))
                    if policy is not None and func not in amp.autocast_policy:
                        args, kwargs = amp.execute_policy(policy, args, kwargs or {}, dtype)
                    with env.override_property(autocast_dtype=dtype):
                        return dispatch(func, types, args, kwargs)
        return dispatch(func, types, args, kwargs)

    return autocast_dispatch
