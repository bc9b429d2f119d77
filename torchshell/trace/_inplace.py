"""In-place ops on a slice write through to the sliced tensor, and in-place ops torchax does
not lower run as their out-of-place op and a copy.

torchax 0.0.13 makes ``t[a:b]`` a ``View`` of ``t``; its own in-place lowerings (``add_``,
``mul_``, ``copy_``, ``clamp_``...) write through one, but an in-place op it runs by torch's
decomposition (``zero_``, ``fill_``, ``masked_fill_``, ``index_fill_``, ``addcmul_``,
``addcdiv_``, ``lerp_``, ``hardtanh_``, ``silu_``, ``gelu_``...) got a copy of the slice and
its write was dropped, silently: the forward read the old values. torchvision's Swin V2
attention does ``qkv_bias = qkv_bias.clone(); qkv_bias[C:2*C].zero_()`` (no key bias): the
traced step trained the key bias torch keeps at 0 (4e-2 apart after one SGD step).

Other in-place ops it has no lowering for at all (``exp_``, ``neg_``, ``abs_``, ``log_``,
``floor_``, ``round_``, ``sign_``, ``rsqrt_``, ``reciprocal_``, ``clamp_max_``...) stopped the
trace; they run as ``copy_(self, op(self, ...))``, which writes through a view too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def _overload(func: Any) -> torch._ops.OpOverload | None:
    """``func`` as an aten overload (a packet, ``torch.ops.aten.gelu_``, as its default)."""
    if isinstance(func, torch._ops.OpOverloadPacket):
        func = getattr(func, "default", None) if "default" in func.overloads() else None
    return func if isinstance(func, torch._ops.OpOverload) else None


def _mutates_self(func: Any) -> bool:
    """An aten op whose first argument it writes (``zero_``, ``fill_.Scalar``...)."""
    op = _overload(func)
    args = op._schema.arguments if op is not None else []
    alias = args[0].alias_info if args else None
    return bool(alias is not None and alias.is_write and not args[0].kwarg_only)


def _out_of_place(func: Any) -> torch._ops.OpOverload | None:
    """The out-of-place twin of an in-place aten op (``exp_.default`` -> ``exp.default``)."""
    op = _overload(func)
    if op is None or not op._schema.name.endswith("_"):
        return None
    namespace, name = op._schema.name.split("::")
    packet = getattr(getattr(torch.ops, namespace), name[:-1], None)
    twin = getattr(packet, op._overloadname, None) if packet is not None else None
    return twin if isinstance(twin, torch._ops.OpOverload) else None


def written_through_views(env: Any) -> Callable[..., Any]:
    """``env.dispatch`` (torchax's, one torch op) where an in-place op on a ``View`` runs on
    the view's values and the result is written back through the view to its base tensor,
    and an in-place op without a lowering runs as its out-of-place op and ``copy_``."""
    from torchax.tensor import OperatorNotFound
    from torchax.view import View

    dispatch = env.dispatch

    def lowered(func: Any) -> bool:
        try:
            env._get_op_or_decomp(func)
        except OperatorNotFound:
            return False
        return True

    @functools.wraps(dispatch)
    def through(func: Any, types: Any, args: Any, kwargs: Any = None) -> Any:
        if not (args and _mutates_self(func)):
            return dispatch(func, types, args, kwargs)
        fresh = isinstance(args[0], torch.Tensor) and not lowered(func)
        twin = _out_of_place(func) if fresh else None
        if twin is not None:
            value = dispatch(twin, types, args, kwargs)
            dispatch(torch.ops.aten.copy_.default, types, (args[0], value), {})
            return args[0]
        if isinstance(args[0], View):
            view = args[0]
            values = view.torch()  # a torchax Tensor holding the view's values
            dispatch(func, types, (values, *args[1:]), kwargs)  # mutates ``values``
            view.update(values)
            return view
        return dispatch(func, types, args, kwargs)

    return through
