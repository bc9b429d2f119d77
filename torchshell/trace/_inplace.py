"""In-place ops on a slice write through to the sliced tensor.

torchax 0.0.13 makes ``t[a:b]`` a ``View`` of ``t``; its own in-place lowerings (``add_``,
``mul_``, ``copy_``, ``clamp_``...) write through one, but an in-place op it runs by torch's
decomposition (``zero_``, ``fill_``, ``masked_fill_``, ``index_fill_``, ``addcmul_``,
``addcdiv_``, ``lerp_``, ``hardtanh_``, ``silu_``, ``gelu_``...) got a copy of the slice and
its write was dropped, silently: the forward read the old values. torchvision's Swin V2
attention does ``qkv_bias = qkv_bias.clone(); qkv_bias[C:2*C].zero_()`` (no key bias): the
traced step trained the key bias torch keeps at 0 (4e-2 apart after one SGD step).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def _mutates_self(func: Any) -> bool:
    """An aten op whose first argument it writes (``zero_``, ``fill_.Scalar``...)."""
    if isinstance(func, torch._ops.OpOverloadPacket):  # torch.ops.aten.gelu_(x)
        func = getattr(func, "default", None) if "default" in func.overloads() else None
    if not isinstance(func, torch._ops.OpOverload):
        return False
    args = func._schema.arguments
    alias = args[0].alias_info if args else None
    return bool(alias is not None and alias.is_write and not args[0].kwarg_only)


def written_through_views(dispatch: Callable[..., Any]) -> Callable[..., Any]:
    """``dispatch`` (torchax's, one torch op) where an in-place op on a ``View`` runs on the
    view's values and the result is written back through the view to its base tensor."""
    from torchax.view import View

    @functools.wraps(dispatch)
    def through(func: Any, types: Any, args: Any, kwargs: Any = None) -> Any:
        if args and isinstance(args[0], View) and _mutates_self(func):
            view = args[0]
            values = view.torch()  # a torchax Tensor holding the view's values
            dispatch(func, types, (values, *args[1:]), kwargs)  # mutates ``values``
            view.update(values)
            return view
        return dispatch(func, types, args, kwargs)

    return through
