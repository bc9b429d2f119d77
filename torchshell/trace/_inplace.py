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
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from torchshell._errors import TorchModelError


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


@functools.cache
def _functional(func: Any) -> tuple[torch._ops.OpOverload, list[str]] | None:
    """The functional overload of an ``out=`` overload (``exp.out`` -> ``exp.default``,
    ``sum.IntList_out`` -> ``sum.dim_IntList``) and the names of its out arguments: the
    overload of the same op taking the same arguments less those."""
    op = _overload(func)
    if op is None:
        return None
    args = op._schema.arguments
    outs = [a for a in args if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
    if not outs:
        return None
    want = [(a.name, str(a.type)) for a in args if a not in outs]
    packet = op.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        given = candidate._schema.arguments
        if [(a.name, str(a.type)) for a in given] == want and not any(
            a.alias_info is not None and a.alias_info.is_write for a in given
        ):
            return candidate, [a.name for a in outs]
    return None


def _written_out(
    dispatch: Callable[..., Any], func: Any, types: Any, args: Any, kwargs: Any
) -> Any:
    """``op(..., out=t)``: the functional op, its result written into ``t`` (``copy_``, which
    writes through a view; a tensor of another shape takes the result's, as torch resizes
    ``out``). torchax passed ``out=`` to lowerings that take none: refused, op by op."""
    found = _functional(func)
    assert found is not None
    functional, names = found
    outs = [kwargs[n] for n in names]
    rest = {k: v for k, v in kwargs.items() if k not in names}
    values = dispatch(functional, types, args, rest)
    one = len(outs) == 1  # (one out: a tensor, or a list of them: unbind_copy)
    _write(dispatch, types, outs, [values] if one else list(values))
    return outs[0] if one else tuple(outs)


def _write(dispatch: Callable[..., Any], types: Any, outs: list[Any], values: list[Any]) -> None:
    """Each result into its ``out`` tensor (lists and tuples of them in turn)."""
    from torchax.tensor import Tensor

    for out, value in zip(outs, values, strict=True):
        if isinstance(out, list | tuple):
            _write(dispatch, types, list(out), list(value))
        elif tuple(out.shape) != tuple(value.shape) and isinstance(out, Tensor):
            out._elem = value._elem.astype(out._elem.dtype)
        else:
            dispatch(torch.ops.aten.copy_.default, types, (out, value), {})


# factories with ``out=``: torchax refused ``torch.linspace(0, 1, 5, out=o)`` / ``logspace``
# ("device type jax does not match device type of out parameter (meta)", a wrong fix) and
# resized a one-element ``out`` of another shape (``arange(0, 1, out=o)`` of a 0-d ``o``)
_FACTORIES = (torch.linspace, torch.logspace, torch.arange)


def _takes(func: Any, args: Any) -> bool:
    """Whether a function's arguments hold a tensor (not a factory: torchax writes their
    ``out=``, ``torch.zeros(2, out=o)``), or it is one of :data:`_FACTORIES`."""
    from torch.utils import _pytree as pytree

    return func in _FACTORIES or any(isinstance(a, torch.Tensor) for a in pytree.tree_leaves(args))


def _function_out(
    dispatch: Callable[..., Any], func: Any, types: Any, args: Any, kwargs: Any
) -> Any:
    """A torch function called with ``out=`` (``torch.kron(a, b, out=o)``,
    ``torch.linalg.multi_dot(ts, out=o)``, ``torch.linspace(..., out=o)``): the function
    without it, its result written into ``out``. torchax ran the function's decomposition,
    which writes into a reshape of ``out`` (``_unsafe_view``: a copy in torchax), so ``out``
    kept its old values, silently."""
    from torchax.tensor import OperatorNotFound

    out = kwargs["out"]
    rest = {k: v for k, v in kwargs.items() if k != "out"}
    if func in _FACTORIES and rest.get("dtype") is None:  # (torch: out's dtype)
        rest["dtype"] = out.dtype
    try:
        value = dispatch(func, types, args, rest)
    except OperatorNotFound:  # (not lowered as a function: torch's own, as torchax runs it)
        value = func(*args, **rest)
    if func in _FACTORIES and math.prod(out.shape) == math.prod(value.shape):
        value = value.reshape(out.shape)  # (torch resizes out only to another size)
    _write(dispatch, types, [out], [value])
    return out


def _broadcast_copy(dispatch: Callable[..., Any], types: Any, args: Any, kwargs: Any) -> Any:
    """``t.copy_(src)`` with ``src`` broadcast to ``t``'s shape, as torch: torchax's copy_
    gave ``t`` the source's shape (``o.copy_(c[1])`` of a (2, 3) ``o``: shape (3,),
    silently). (A source of as many elements is left to torchax: its shape-changing
    in-place ops, ``t_``, ``squeeze_``..., write their result through copy_.)"""
    import jax.numpy as jnp

    dest = args[0]
    shape = tuple(dest.shape)
    out = dispatch(torch.ops.aten.copy_.default, types, args, kwargs)
    source = args[1]
    if tuple(dest.shape) != shape and math.prod(getattr(source, "shape", ())) < math.prod(shape):
        dest._elem = jnp.broadcast_to(dest._elem, shape)
    return out


# in-place ops torchax 0.0.13 dropped on a 0-d tensor (torch's decompositions)
_INDEXED = {
    getattr(getattr(torch.ops.aten, name), overload)
    for name in ("index_add_", "index_copy_", "index_fill_")
    for overload in getattr(torch.ops.aten, name).overloads()
}
# in-place ops whose out-of-place twin takes its arguments in another order
_OWN_ORDER = (torch.ops.aten.polygamma_.default,)
# in-place ops torchax decomposes into an op it has no lowering for (``mvlgamma_``:
# ``special_multigammaln.out``): their out-of-place twin and ``copy_``
_VIA_TWIN = (torch.ops.aten.mvlgamma_.default,)


def written_through_views(env: Any) -> Callable[..., Any]:
    """``env.dispatch`` (torchax's, one torch op) where an in-place op on a ``View`` runs on
    the view's values and the result is written back through the view to its base tensor,
    and an in-place op without a lowering runs as its out-of-place op and ``copy_``."""
    from torchax.tensor import OperatorNotFound, Tensor
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
        if func is torch.ops.aten.copy_.default and len(args) > 1 and isinstance(args[1], View):
            # ``t.copy_(c[:, 2:])``: torchax's copy_ read the source's ``_elem`` (a View has
            # none): refused; the source's values
            args = (args[0], args[1].torch(), *args[2:])
        if func is torch.ops.aten.copy_.default and isinstance(args[0], Tensor):
            return _broadcast_copy(dispatch, types, args, kwargs)
        if kwargs and _functional(func) is not None:
            return _written_out(dispatch, func, types, args, kwargs)
        out = kwargs.get("out") if kwargs else None
        if out is not None and _overload(func) is None and _takes(func, args):
            return _function_out(dispatch, func, types, args, kwargs)
        if not (args and _mutates_self(func)):
            return dispatch(func, types, args, kwargs)
        # a 0-d tensor too: torch's decompositions of ``index_add_``/``index_copy_``/
        # ``index_fill_`` write into ``self.unsqueeze(0)``, a copy in torchax (dropped)
        scalar = isinstance(args[0], torch.Tensor) and args[0].ndim == 0 and func in _INDEXED
        fresh = isinstance(args[0], torch.Tensor) and (
            scalar or func in _VIA_TWIN or not lowered(func)
        )
        twin = _out_of_place(func) if fresh and func not in _OWN_ORDER else None
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


def _diagonal_mask(shape: tuple[int, ...], wrap: bool) -> np.ndarray:
    """Where ``Tensor.fill_diagonal_`` writes, as torch's kernel: ``(i, i, ...)`` for ``i``
    below the smallest size, and for a tall 2-D tensor with ``wrap`` (``h > w + 1``) every
    ``w + 1``-th element of the flattened tensor after them too."""
    if len(shape) < 2 or (len(shape) > 2 and len(set(shape)) != 1):
        raise TorchModelError(
            f"Tensor.fill_diagonal_ on a tensor of shape {tuple(shape)}: torch needs at "
            "least 2 dimensions, all of equal length beyond 2. Fix: fill the diagonal of a "
            "matrix (or of a cube with equal sides)."
        )
    mask = np.zeros(shape, bool)
    n = min(shape)
    mask[(np.arange(n),) * len(shape)] = True
    h, w = shape[0], shape[-1]
    if wrap and len(shape) == 2 and h > w + 1:
        mask.reshape(-1)[:: w + 1] = True
    return mask


def fill_diagonal(x: Any, fill_value: Any, wrap: bool = False) -> Any:
    """``Tensor.fill_diagonal_(fill_value, wrap)``'s new values (a JAX array): torchax 0.0.13
    ran torch's kernel on a strided copy and left the tensor unchanged, silently (an NT-Xent
    loss's ``sim.fill_diagonal_(-inf)``: the diagonal stayed in the softmax).

    Example:
        >>> import jax.numpy as jnp
        >>> fill_diagonal(jnp.zeros((5, 3)), 1.0, wrap=True).nonzero()[0].tolist()
        [0, 1, 2, 4]
    """
    import jax
    import jax.numpy as jnp

    mask = jnp.asarray(_diagonal_mask(tuple(x.shape), bool(wrap)))
    value = jnp.asarray(fill_value).astype(x.dtype)
    return jnp.where(mask, value, x) if isinstance(x, jax.Array) else x


def _drawn(env: Any) -> dict[str, Callable[..., Any]]:
    """``cauchy_`` (torchax: the tensor unchanged) and ``random_`` (torchax: floats where
    torch draws integers) from the step's key."""
    import jax
    import jax.numpy as jnp

    def cauchy(x: Any, median: float = 0.0, sigma: float = 1.0, *, generator: Any = None) -> Any:
        key = env.get_and_rotate_prng_key(generator)
        dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32
        draw = jax.random.cauchy(key, x.shape, dtype) * float(sigma) + float(median)
        return draw.astype(x.dtype)

    def random(x: Any, low: Any = 0, high: Any = None, *, generator: Any = None) -> Any:
        if high is None:  # [low, 2^digits] as torch (a float's mantissa's integers)
            floating = jnp.issubdtype(x.dtype, jnp.floating)
            digits = jnp.finfo(x.dtype).nmant + 1 if floating else 31
            high = 2 ** min(digits, 31) + (1 if floating else 0)
        key = env.get_and_rotate_prng_key(generator)
        draw = jax.random.randint(key, x.shape, int(low), int(high), jnp.int32)
        return draw.astype(x.dtype)

    def random_to(x: Any, high: Any, *, generator: Any = None) -> Any:
        return random(x, 0, high, generator=generator)

    return {"cauchy": cauchy, "random": random, "random_to": random_to}


def resize_(t: Any, *size: Any, memory_format: Any = None) -> Any:
    """``Tensor.resize_(*size)`` to as many elements or fewer: the first ones, in the new
    shape (torchax kept the old shape, silently); to more (torch leaves the new ones
    uninitialised) or on a view, refused."""
    from torchax.view import View

    shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
    shape = tuple(int(n) for n in shape)
    count = int(np.prod(shape))
    if isinstance(t, View) or count > t._elem.size:
        where = "a view (a slice)" if isinstance(t, View) else f"shape {tuple(t.shape)}"
        raise TorchModelError(
            f"Tensor.resize_{shape} of a tensor of {where}: a traced tensor can only be "
            "resized to as many elements or fewer, and not through a view (torch leaves "
            "added elements uninitialised). Fix: build the new tensor (torch.zeros(...) or "
            "x.reshape(-1)[:n].reshape(...)) instead of resizing in place."
        )
    t._elem = t._elem.reshape(-1)[:count].reshape(shape)
    return t


def install_inplace(env: Any) -> None:
    """Registers the in-place ops above (torchax has none, or one that drops the write)."""
    from torchax.ops import op_base, ops_registry

    from torchshell.trace._special import polygamma

    ops: dict[Any, Callable[..., Any]] = {
        torch.ops.aten.polygamma_.default: lambda x, n: polygamma(n, x),  # (self first)
        torch.ops.aten.fill_diagonal_.default: fill_diagonal,
        torch.ops.aten.cauchy_.default: _drawn(env)["cauchy"],
        torch.ops.aten.random_.default: _drawn(env)["random"],
        getattr(torch.ops.aten.random_, "from"): _drawn(env)["random"],
        torch.ops.aten.random_.to: _drawn(env)["random_to"],
        torch.Tensor.fill_diagonal_: fill_diagonal,  # (torchax sees the method first)
    }
    for resize in (torch.ops.aten.resize_.default, torch.Tensor.resize_):
        env._ops[resize] = ops_registry.Operator(
            resize,
            resize_,
            is_jax_function=False,
            is_user_defined=True,
            needs_env=False,
            is_view_op=True,
        )
    for op, func in ops.items():
        env._ops[op] = ops_registry.Operator(
            op,
            op_base.InplaceOp(func, is_jax_func=True),
            is_jax_function=False,
            is_user_defined=True,
            needs_env=False,
            is_view_op=True,
        )
