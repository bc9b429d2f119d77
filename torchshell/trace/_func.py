"""Gradients taken inside the traced step: ``torch.func`` works, ``torch.autograd.grad`` is
refused naming the fix.

A gradient penalty (WGAN-GP, R1) takes the critic's gradient with respect to its input inside
``training_step``. Traced tensors carry no torch autograd graph, so
``torch.autograd.grad(out, interp, create_graph=True)`` raised torch's own "element 0 of
tensors does not require grad and does not have a grad_fn", and ``torch.func.vjp`` stopped in
functorch with a message about plain CPU tensors. While a trace runs:

- ``torch.func.vjp``, ``torch.func.grad`` and ``torch.func.grad_and_value`` on traced
  tensors are ``jax.vjp`` of the function (re-run on the traced inputs): their results are
  traced values the step differentiates again, as ``create_graph=True`` does in torch;
- ``torch.autograd.grad`` on traced tensors is refused, naming the fix (``torch.func.vjp``):
  the function from the inputs to the outputs is gone by the time it is called.

Called as ``torch.func.vjp(...)`` (an attribute of ``torch.func`` when it runs); a name bound
earlier with ``from torch.func import vjp`` keeps torch's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import torch
from torch.utils import _pytree as torch_pytree

from torchshell._errors import TorchModelError


def _is_traced(x: Any) -> bool:
    from torchax.tensor import Tensor
    from torchax.view import View

    return isinstance(x, Tensor | View)


def _as_jax(tree: Any) -> Any:
    return torch_pytree.tree_map(lambda x: x.jax() if _is_traced(x) else x, tree)


def _vjp(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.func.vjp`` that is ``jax.vjp`` on traced primals."""
    from torchax.tensor import Tensor

    def vjp(func: Callable[..., Any], *primals: Any, has_aux: bool = False) -> Any:
        flat, spec = torch_pytree.tree_flatten(primals)
        where = [i for i, x in enumerate(flat) if _is_traced(x)]
        if not where:
            return original(func, *primals, has_aux=has_aux)
        env = flat[where[0]]._env
        out_spec: dict[str, Any] = {}

        def run(*arrays: jax.Array) -> Any:
            items = list(flat)
            for i, a in zip(where, arrays, strict=True):
                items[i] = Tensor(a, env)
            out = func(*torch_pytree.tree_unflatten(items, spec))
            out, aux = out if has_aux else (out, None)
            leaves, out_spec["out"] = torch_pytree.tree_flatten(out)
            return tuple(x.jax() for x in leaves), _as_jax(aux)

        outs, pullback, aux = jax.vjp(run, *(flat[i].jax() for i in where), has_aux=True)
        output = torch_pytree.tree_unflatten([Tensor(o, env) for o in outs], out_spec["out"])

        def vjp_fn(cotangents: Any) -> Any:
            cots = [c.jax() for c in torch_pytree.tree_leaves(cotangents)]
            grads = pullback(tuple(cots))
            items: list[Any] = [None] * len(flat)
            for i, g in zip(where, grads, strict=True):
                items[i] = Tensor(g, env)
            return torch_pytree.tree_unflatten(items, spec)

        if not has_aux:
            return output, vjp_fn
        return output, vjp_fn, torch_pytree.tree_map(lambda a: env.j2t_iso(a), aux)

    return vjp


def _grad(original: Callable[..., Any], vjp: Callable[..., Any], value: bool) -> Any:
    """``torch.func.grad`` (``value``: ``grad_and_value``) through :func:`_vjp`."""

    def transform(func: Callable[..., Any], argnums: Any = 0, has_aux: bool = False) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not any(map(_is_traced, torch_pytree.tree_leaves(args))):
                return original(func, argnums, has_aux)(*args, **kwargs)
            nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

            def inner(*chosen: Any) -> Any:
                given = list(args)
                for n, v in zip(nums, chosen, strict=True):
                    given[n] = v
                return func(*given, **kwargs)

            got = vjp(inner, *(args[n] for n in nums), has_aux=has_aux)
            out, pullback = got[0], got[1]
            grads = pullback(torch.ones_like(out))
            grads = grads[0] if isinstance(argnums, int) else grads
            if value:
                return grads, ((out, got[2]) if has_aux else out)
            return (grads, got[2]) if has_aux else grads

        return call

    return transform


def _autograd_grad(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.autograd.grad`` refusing traced tensors (see the top)."""

    def grad(outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if not any(map(_is_traced, torch_pytree.tree_leaves((outputs, inputs)))):
            return original(outputs, inputs, *args, **kwargs)
        raise TorchModelError(
            "torch.autograd.grad(outputs, inputs, ...) in the traced step (a gradient penalty, "
            "an input gradient): its tensors carry no torch autograd graph (JAX differentiates "
            "the whole step), and the function from inputs to outputs is gone by the time it "
            "is called. Fix: take the gradient with torch.func, which runs in the step: "
            "out, vjp_fn = torch.func.vjp(self.critic, interp); (grads,) = "
            "vjp_fn(torch.ones_like(out)) (its result is differentiated again, as with "
            "create_graph=True), or torch.func.grad(fn)(x) for a scalar fn."
        )

    return grad


@contextlib.contextmanager
def traced_gradients() -> Iterator[None]:
    """For the duration: ``torch.func.vjp``/``grad``/``grad_and_value`` work on traced
    tensors and ``torch.autograd.grad`` on them is refused with the fix."""
    func, autograd = torch.func, torch.autograd
    saved = (func.vjp, func.grad, func.grad_and_value, autograd.grad)
    vjp = _vjp(saved[0])
    func.vjp = vjp
    func.grad = _grad(saved[1], vjp, value=False)
    func.grad_and_value = _grad(saved[2], vjp, value=True)
    autograd.grad = _autograd_grad(saved[3])
    try:
        yield
    finally:
        func.vjp, func.grad, func.grad_and_value, autograd.grad = saved
