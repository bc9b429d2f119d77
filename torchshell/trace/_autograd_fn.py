"""A user's ``torch.autograd.Function`` keeps its own ``backward`` in the traced step.

torchax runs ``MyFunction.apply(x)`` as torch does in eager mode: the ``forward`` ops,
dispatched one by one. JAX then differentiated those ops, and the function's own
``backward`` never ran: DANN's gradient reversal layer (identity forward, ``-alpha * grad``
backward) trained its feature extractor *with* the domain classifier, silently, and a
straight-through estimator or a memory-efficient Swish got the gradient of their forward
instead of theirs. While a trace runs, ``Function.apply`` on traced tensors is one
``jax.custom_vjp``: its primal runs the user's ``forward`` (or ``forward`` then
``setup_context``), its backward the user's ``backward`` (or ``vjp``) with a ``ctx`` that
holds what ``forward`` saved (``save_for_backward``, attributes), tensors carried as
residuals.

Tensors passed inside lists or as keyword arguments are not the function's inputs to torch's
autograd either; such a call runs as before (its forward differentiated by JAX).

``Tensor.register_hook(hook)`` on a traced tensor (a gradient scaled or reversed in a
forward: ``h.register_hook(lambda g: g * 0.1)``) raised torch's "cannot register a hook on a
tensor that doesn't require gradient" (traced tensors carry no torch autograd); the tensor is
now an identity whose backward passes the gradient through ``hook`` (its return value, or the
gradient itself for ``None``). As in torch for the uses that follow the registration; uses
made before it take the gradient unhooked. ``handle.remove()`` in the step drops it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils import _pytree as torch_pytree


class _Ctx:
    """The ``ctx`` a custom Function's ``forward``/``backward`` get inside a trace."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.to_save: tuple[Any, ...] = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors: Any) -> None:
        self.to_save = tensors

    def save_for_forward(self, *tensors: Any) -> None:
        pass

    @property
    def saved_tensors(self) -> tuple[Any, ...]:
        return tuple(self.to_save)

    saved_variables = saved_tensors

    def mark_dirty(self, *args: Any) -> None:
        pass

    def mark_non_differentiable(self, *args: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


def _is_traced(x: Any) -> bool:
    from torchax.tensor import Tensor
    from torchax.view import View

    return isinstance(x, Tensor | View)


def _traced_apply(original: Any) -> Any:
    """``Function.apply`` whose user ``backward`` gives the gradient of traced inputs."""
    from torch.autograd.function import Function, _is_setup_context_defined
    from torchax.tensor import Tensor

    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        setup = _is_setup_context_defined(cls.setup_context)
        if setup:
            import inspect

            bound = inspect.signature(cls.forward).bind(*args, **kwargs)
            bound.apply_defaults()
            args, kwargs = bound.args, {}
        nested = [a for a in args if isinstance(a, list | tuple | dict)]
        where = [i for i, a in enumerate(args) if _is_traced(a)]
        own = cls.__module__.split(".")[0] == "torch"  # torch's own (reentrant checkpoint)
        if own or not where or any(map(_is_traced, torch_pytree.tree_leaves((kwargs, nested)))):
            return original.__get__(None, cls)(*args, **kwargs)
        env = args[where[0]]._env
        backward = cls.vjp if cls.vjp is not Function.vjp else cls.backward
        primals = tuple(a.jax() for a in (args[i] for i in where))
        needs = tuple(
            i in where and jnp.issubdtype(args[i].jax().dtype, jnp.inexact)
            for i in range(len(args))
        )
        static: dict[str, Any] = {}

        def forward(arrays: tuple[jax.Array, ...]) -> tuple[tuple[jax.Array, ...], _Ctx]:
            call = list(args)
            for i, a in zip(where, arrays, strict=True):
                call[i] = Tensor(a, env)
            ctx = _Ctx(needs)
            if setup:
                out = cls.forward(*call, **kwargs)
                cls.setup_context(ctx, tuple(call), out)
            else:
                out = cls.forward(ctx, *call, **kwargs)
            leaves, static["spec"] = torch_pytree.tree_flatten(out)
            static["leaves"] = leaves
            return tuple(x.jax() for x in leaves if _is_traced(x)), ctx

        @jax.custom_vjp
        def run(*arrays: jax.Array) -> tuple[jax.Array, ...]:
            return forward(arrays)[0]

        def run_fwd(*arrays: jax.Array) -> Any:
            outs, ctx = forward(arrays)
            leaves, static["ctx"] = torch_pytree.tree_flatten(vars(ctx))
            static["ctx_leaves"] = leaves
            return outs, tuple(x.jax() for x in leaves if _is_traced(x))

        def run_bwd(res: tuple[jax.Array, ...], grads: tuple[jax.Array, ...]) -> Any:
            it = iter(res)
            leaves = [Tensor(next(it), env) if _is_traced(x) else x for x in static["ctx_leaves"]]
            ctx = _Ctx(needs)
            vars(ctx).update(torch_pytree.tree_unflatten(leaves, static["ctx"]))
            g = iter(grads)
            outs = [_cotangent(next(g), env) if _is_traced(x) else None for x in static["leaves"]]
            with _entered(env), torch.no_grad():
                got = backward(ctx, *outs)
            got = got if isinstance(got, tuple) else (got,)
            result = []
            for i, primal in zip(where, primals, strict=True):
                value = got[i] if i < len(got) else None
                result.append(_input_grad(value, primal))
            return tuple(result)

        run.defvjp(run_fwd, run_bwd)
        arrays = run(*primals)
        it = iter(arrays)
        leaves = [Tensor(next(it), env) if _is_traced(x) else x for x in static["leaves"]]
        return torch_pytree.tree_unflatten(leaves, static["spec"])

    return apply


def _cotangent(g: Any, env: Any) -> Any:
    from torchax.tensor import Tensor

    if getattr(g, "dtype", None) == jax.dtypes.float0:
        return None
    return Tensor(g, env)


def _input_grad(value: Any, primal: jax.Array) -> Any:
    """The cotangent JAX wants for ``primal`` from what the user's backward returned."""
    if not jnp.issubdtype(primal.dtype, jnp.inexact):
        return np.zeros(primal.shape, jax.dtypes.float0)
    if value is None:
        return jnp.zeros_like(primal)
    array = value.jax() if _is_traced(value) else jnp.asarray(value.numpy(force=True))
    return jnp.broadcast_to(array, primal.shape).astype(primal.dtype)


@contextlib.contextmanager
def _entered(env: Any) -> Iterator[None]:
    """The torchax environment for the user's backward (JAX runs it after the trace)."""
    if env.enabled:
        yield
        return
    with env:
        yield


class _Handle:
    """What ``register_hook`` returns: ``remove()`` turns the hook off."""

    def __init__(self) -> None:
        self.active = True

    def remove(self) -> None:
        self.active = False


def _register_hook(original: Any) -> Any:
    """``Tensor.register_hook`` that hooks the gradient of a traced tensor (see the top)."""
    from torchax.tensor import Tensor

    def register_hook(self: Any, hook: Any) -> Any:
        if type(self) is not Tensor or not jnp.issubdtype(self._elem.dtype, jnp.inexact):
            return original(self, hook)
        env, handle = self._env, _Handle()

        @jax.custom_vjp
        def hooked(x: jax.Array) -> jax.Array:
            return x

        def hooked_bwd(_: None, g: jax.Array) -> tuple[jax.Array]:
            if not handle.active:
                return (g,)
            with _entered(env), torch.no_grad():
                out = hook(Tensor(g, env))
            return (g if out is None else _input_grad(out, g),)

        hooked.defvjp(lambda x: (x, None), hooked_bwd)
        self._elem = hooked(self._elem)
        return handle

    return register_hook


@contextlib.contextmanager
def custom_backwards() -> Iterator[None]:
    """For the duration: ``torch.autograd.Function.apply`` on traced tensors keeps the
    function's own backward, ``Tensor.register_hook`` hooks a traced tensor's gradient (see
    the module's docstring)."""
    original = torch.autograd.Function.__dict__["apply"]
    hook = torch.Tensor.register_hook
    torch.autograd.Function.apply = classmethod(_traced_apply(original))  # type: ignore[method-assign,assignment]
    torch.Tensor.register_hook = _register_hook(hook)  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.autograd.Function.apply = original  # type: ignore[method-assign]
        torch.Tensor.register_hook = hook  # type: ignore[method-assign]
