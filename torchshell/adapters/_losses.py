"""The step's loss from what the team passed: a torch loss (run by torchax) or a JAX one.

A torch loss module or ``torch.nn.functional`` function is torch; a function of the team's
own is read for the names it uses (``torch``/``F``: torch; ``jnp``/``jax``/``optax``: JAX).
One that reads neither (``def l1(out, y): return (out - y).abs().mean()``: tensor methods
only) is tried both ways at its first trace: as a JAX loss ``(outputs, batch)``, then as a
torch loss ``(output, target)``; the form that runs is kept. A loss given the other kind's
arguments (a JAX loss written ``(output, target)``, a torch loss indexing a batch dict) is
refused with coreshell's message: what it was taken for, what it got, and the fix.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jaxcore
from torchshell._errors import ConfigError
from torchshell.adapters._unaligned import means_where_unaligned
from torchshell.trace._loss import is_torch_loss, torch_function_loss, torch_loss_fn

__all__ = ["loss_kind", "step_loss"]

_TORCH = ("torch",)
_JAX = ("jax", "jaxlib", "optax", "flax", "jaxcore")
_WRONG_FORM = (TypeError, AttributeError, IndexError)  # what the other kind's arguments raise


def step_loss(
    loss_fn: Any, names: Sequence[str], batch_keys: Sequence[str], *, per_row: bool
) -> Any:
    """The loss as the step calls it: a torch loss run by torchax, or a JAX loss evaluated per
    row when ``per_row`` (a JAX loss may return batch means, or no metrics); on a batch
    whose fields' rows do not align (a graph), batch means (:mod:`._unaligned`)."""
    rows = _step_loss(loss_fn, names, batch_keys, per_row=per_row)
    if not per_row:
        return rows
    return means_where_unaligned(rows, _step_loss(loss_fn, names, batch_keys, per_row=False))


def _step_loss(
    loss_fn: Any, names: Sequence[str], batch_keys: Sequence[str], *, per_row: bool
) -> Any:
    label = next((k for k in batch_keys if k not in names), "y")
    if is_torch_loss(loss_fn):  # nn.CrossEntropyLoss(), F.mse_loss: run by torchax
        return torch_loss_fn(loss_fn, label_key=label, inputs=list(names))
    as_jax = jaxcore.per_example(loss_fn) if per_row else loss_fn
    if str(getattr(loss_fn, "__module__", "")).split(".")[0] in ("jaxcore", "torchshell"):
        return as_jax  # coreshell's own losses (the port's: the traced step's)
    as_torch = torch_function_loss(loss_fn, label_key=label, inputs=list(names), per_row=per_row)
    return _Loss(loss_fn, loss_kind(loss_fn), {"torch": as_torch, "jax": as_jax}, label)


def loss_kind(fn: Any) -> str | None:
    """``"torch"`` or ``"jax"`` by the modules a function reads from its globals; ``None``
    when it reads neither or both (tried both ways at the first trace).

    Example:
        >>> import jax.numpy as jnp, torch
        >>> loss_kind(lambda out, y: torch.abs(out - y).mean())
        'torch'
        >>> loss_kind(lambda out, batch: jnp.mean((out - batch["y"]) ** 2))
        'jax'
        >>> loss_kind(lambda out, y: (out - y).abs().mean()) is None
        True
    """
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__call__
    code = getattr(target, "__code__", None)
    if code is None:
        return None
    scope = getattr(target, "__globals__", {})
    names = set(code.co_names)
    for const in code.co_consts:  # nested functions and comprehensions
        names.update(getattr(const, "co_names", ()))
    roots = set()
    for name in names:
        value = scope.get(name)
        module = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", "")
        roots.add(str(module or "").split(".")[0])
    torch_, jax_ = bool(roots & set(_TORCH)), bool(roots & set(_JAX))
    return "torch" if torch_ and not jax_ else "jax" if jax_ and not torch_ else None


class _Loss:
    """A team's loss function in the form its kind takes (decided at the first trace)."""

    def __init__(
        self, fn: Any, kind: str | None, forms: Mapping[str, Callable[..., Any]], label: str
    ) -> None:
        self.fn, self.kind, self.forms, self.label = fn, kind, forms, label
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, outputs: Any, batch: Any) -> Any:
        if self.kind is not None:
            try:
                return self.forms[self.kind](outputs, batch)
            except _WRONG_FORM as err:
                raise self._refused(self.kind, err, batch) from err
        errors = {}
        for kind in ("jax", "torch"):  # (reads neither: tensor methods only)
            try:
                out = self.forms[kind](outputs, batch)
            except _WRONG_FORM as err:
                errors[kind] = err
                continue
            self.kind = kind
            return out
        raise self._refused(None, errors["torch"], batch, errors["jax"])

    def _refused(
        self, kind: str | None, err: Exception, batch: Any, jax_err: Exception | None = None
    ) -> ConfigError:
        fields = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        as_jax = (
            "a JAX loss loss(outputs, batch): outputs JAX arrays, batch the dict of fields "
            f"{fields} (the target is batch[{self.label!r}])"
        )
        as_torch = (
            "a torch loss loss(output, target): torch tensors, the target the batch field "
            f"{self.label!r}"
        )
        fix = (
            "Fix: write a torch loss as loss(output, target) with torch tensors (torch.*, F.*, "
            "tensor methods), or a JAX loss as loss(outputs, batch) reading batch["
            f"{self.label!r}] with jax.numpy/optax; do not mix the two."
        )
        if kind is None:
            return ConfigError(
                f"The loss {self.__name__} reads neither torch nor JAX names, so it was tried "
                f"as {as_jax} ({type(jax_err).__name__}: {jax_err}) and as {as_torch} "
                f"({type(err).__name__}: {err}); neither ran. {fix}"
            )
        reads = "JAX names (jnp, jax, optax)" if kind == "jax" else "torch names (torch, F)"
        taken = as_jax if kind == "jax" else as_torch
        return ConfigError(
            f"The loss {self.__name__} reads {reads}, so it is taken for {taken}; called so, "
            f"it raised {type(err).__name__}: {err}. {fix}"
        )
