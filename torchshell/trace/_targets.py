"""Class-index targets of ``F.cross_entropy``/``F.nll_loss`` (and their modules), refused in
the dtypes torch refuses.

torch 2.9 takes int64 (and uint8) class indices and raises ``expected scalar type Long but
found Int`` for every other integer dtype and bool, ``... but found Float`` for floating
indices. In a traced step most of these reach the loss in their own dtype. Two do not: with
x64 off the bridge hands ``int64`` over as ``int32`` (``uint64`` as ``uint32``), so an
``int32`` target looks like the ``int64`` one torch code normally gets. For those the target's
origin decides: a batch field that was ``int32``/``uint32`` on the host
(:func:`bridge.handed_over`, through :func:`jaxcore.concrete_of` while the step is traced)
is refused, naming the field; an ``int32`` computed in the step (``y.long()``, ``argmax``:
torch's int64) is taken.

torch also raises ``IndexError: Target N is out of bounds`` for a class index outside
``[0, C)`` that is not ``ignore_index``; the one-hot select of :mod:`._nll` (and torchax's
gather) would give that row 0 and train on. Their range is checked inside the compiled step
(:func:`class_range_checked`, two reductions, :func:`jaxcore.guard.input_check`): the step is
refused and the shell raises a ``BatchError`` naming the loss, the field, the value and the fix.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F

import bridge
from jaxcore.guard import input_check
from torchshell._errors import TorchModelError
from torchshell.trace._float64 import _concrete, any_narrowed

__all__ = [
    "batch_field",
    "casts_to_long",
    "check_class_target",
    "check_float_target",
    "check_target_dtype",
    "class_index_checked",
    "class_range_check",
    "class_range_checked",
    "fields_named",
]

# class-index targets torch refuses that reach the trace in their own dtype
_REFUSED_TARGETS = {"int8": "Char", "int16": "Short", "uint16": "UInt16", "bool": "Bool"}
# host dtypes torch refuses that the trace sees as a narrowed int64/uint64 (see the top)
_HOST_REFUSED = {"int32": "Int", "uint32": "UInt32"}


def _dtype_name(x: Any) -> str:
    return str(x.dtype).removeprefix("torch.")


def check_target_dtype(loss: str, target: Any) -> None:
    """Refuses class-index targets of a dtype torch's ``nll_loss`` refuses: int16, int8,
    uint16, bool in any case; int32 and uint32 when the target is a batch field of that dtype
    on the host (see the module's docstring). ``target``: a torch or JAX array.

    Example:
        >>> check_target_dtype("cross_entropy", jnp.zeros(3, jnp.int32))  # (made in JAX)
        >>> check_target_dtype("cross_entropy", jnp.zeros(3, jnp.int16))
        Traceback (most recent call last):
        ...
        torchshell._errors.TorchModelError: cross_entropy: the class-index target is int16...
    """
    name = _dtype_name(target)
    if name in _REFUSED_TARGETS:
        raise TorchModelError(
            f"{loss}: the class-index target is {name} (shape {tuple(target.shape)}); plain "
            f"torch raises 'expected scalar type Long but found {_REFUSED_TARGETS[name]}'. "
            "Expected int64 class indices (uint8 is taken too). Fix: .long() on the labels "
            "in the Dataset or collate (or in the loss)."
        )
    if name not in ("int32", "uint32"):
        return
    origin = bridge.handed_over(_concrete(target))
    if origin is not None and str(origin.dtype).removeprefix("torch.") in _HOST_REFUSED:
        host = str(origin.dtype).removeprefix("torch.")
        raise TorchModelError(
            f"{loss}: the class-index target is {_field(origin.field)}, which the DataLoader "
            f"gives as {host} (shape {tuple(target.shape)}); plain torch raises "
            f"'expected scalar type Long but found {_HOST_REFUSED[host]}' and does not train. "
            "Expected int64 class indices (uint8 is taken too). Fix: .long() on the labels in "
            "the Dataset or collate (e.g. torch.tensor(label, dtype=torch.long))."
        )


# losses torch refuses a float64 target beside a float32 input in (mse/huber: in backward,
# "Found dtype Double but expected Float"; binary_cross_entropy: in forward)
SAME_DTYPE_LOSSES = frozenset(
    {"mse_loss", "MSELoss", "huber_loss", "HuberLoss", "binary_cross_entropy", "BCELoss"}
)


def check_float_target(loss: str, input: Any, target: Any) -> None:
    """Refuses, under a loss of :data:`SAME_DTYPE_LOSSES`, a target that was a float64 batch
    field on the host (numpy arrays, Python floats through ``default_collate``; x64 off hands
    it over as float32) beside a float32 input, as torch refuses it.

    Example:
        >>> check_float_target("mse_loss", jnp.zeros(3), jnp.zeros(3))  # (made in JAX)
    """
    if loss not in SAME_DTYPE_LOSSES or _dtype_name(input) == "float64" or any_narrowed():
        return  # (a float64 module's output is float64 in torch: the two agree)
    origin = bridge.handed_over(_concrete(target))
    if origin is None or origin.dtype != torch.float64:
        return
    raise TorchModelError(
        f"{loss}: the target is {_field(origin.field)}, which the DataLoader gives as float64 "
        f"(numpy float64 or Python floats through default_collate), beside the model's "
        f"{_dtype_name(input)} output; plain torch raises 'Found dtype Double but expected "
        "Float' and does not train. Expected float32 targets. Fix: .float() on the targets in "
        "the Dataset or collate (e.g. torch.tensor(value, dtype=torch.float32)), or in the "
        "loss."
    )


def _field(path: str) -> str:
    """A bridge path (``y``, ``1``, ``labels/0``) as the user indexes the batch.

    Example:
        >>> _field("y"), _field("1"), _field("labels/0")
        ("batch['y']", 'batch[1]', "batch['labels'][0]")
    """
    return "batch" + "".join(f"[{p}]" if p.isdigit() else f"[{p!r}]" for p in path.split("/"))


def check_class_target(loss: str, input_ndim: int, target: Any) -> None:
    """Refuses floating class indices as torch does (under JAX they fail in a gather), and
    integer ones of a dtype torch refuses (:func:`check_target_dtype`).

    A floating target of the input's rank is class probabilities (``cross_entropy``'s soft
    labels) and passes. ``target``: a torch or JAX array.
    """
    floating = getattr(target.dtype, "is_floating_point", None)
    if floating is None:
        floating = jnp.issubdtype(target.dtype, jnp.floating)
    soft = loss in ("cross_entropy", "CrossEntropyLoss") and target.ndim == input_ndim
    if floating and not soft:
        raise TorchModelError(
            f"{loss}: the target holds class indices of shape {tuple(target.shape)} but is "
            f"{target.dtype} (plain torch raises 'expected scalar type Long but found "
            "Float'). Fix: integer labels (.long() in the Dataset or collate), or class "
            "probabilities of the input's shape."
        )
    if not floating:  # class indices: int16, int8, uint16, bool; int32 from the host
        check_target_dtype(loss, target)


_FIELDS: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar(
    "torchshell_batch_fields", default=None
)
_RANGE_CHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "torchshell_class_range_checked", default=False
)


@contextlib.contextmanager
def fields_named(batch: Any) -> Iterator[None]:
    """While tracing with ``batch`` (torchax tensors or JAX values): a class-index target
    that is one of its fields is named by that field (``['y']``) in the range check's error."""
    named = {
        id(getattr(t, "_elem", t)): jax.tree_util.keystr(path)
        for path, t in jax.tree_util.tree_leaves_with_path(batch)
    }
    token = _FIELDS.set(named)
    try:
        yield
    finally:
        _FIELDS.reset(token)


def batch_field(value: Any) -> str | None:
    """The batch field (``['y']``) ``value`` (a torchax tensor or JAX value) is, under
    :func:`fields_named`; ``None`` for a value computed in the step."""
    return (_FIELDS.get() or {}).get(id(getattr(value, "_elem", value)))


def class_range_message(loss: str, classes: int, ignore_index: int, field: str | None) -> str:
    """The error of a class index outside ``[0, classes)``, with ``{value}`` and ``{where}``
    for :func:`jaxcore.guard.input_check` to fill.

    Example:
        >>> class_range_message("cross_entropy", 4, -100, "['y']").split(" {where}")[0]
        "cross_entropy: the target batch['y'] holds {value}"
    """
    what = f"the target batch{field}" if field else "a class-index target"
    source = "the labels in the Dataset" if field else "the targets where the model computes them"
    return (
        f"{loss}: {what.replace('{', '(').replace('}', ')')} holds {{value}} {{where}}, outside "
        f"the input's {classes} classes. torch raises IndexError: Target {{value}} is out of "
        f"bounds; expected class indices in [0, {classes - 1}] or the loss's ignore_index "
        f"({ignore_index}). Fix: map {source} into [0, {classes - 1}] (or to "
        f"ignore_index={ignore_index} for rows without a label), or give the model's last "
        "layer more outputs."
    )


def class_range_check(
    loss: str, target: Any, classes: int, ignore_index: int, field: str | None = None
) -> None:
    """Reports (:func:`jaxcore.guard.input_check`) class indices outside ``[0, classes)``
    that are not ``ignore_index``, as torch's ``Target N is out of bounds``; ``{value}``: the
    largest past the classes, else the smallest below 0. Two reductions; outside a step,
    nothing.

    Example:
        >>> class_range_check("nll_loss", jnp.array([1, 7]), 4, -100)  # (no step: nothing)
    """
    if hasattr(target, "torch") and not hasattr(target, "_elem"):  # (a torchax View)
        target = target.torch()
    target = getattr(target, "_elem", target)
    if not jnp.size(target) or not jnp.issubdtype(jnp.result_type(target), jnp.integer):
        return
    field = field if field is not None else batch_field(target)
    target = jnp.asarray(target).astype(jnp.int32)
    kept = jnp.where(target != ignore_index, target, 0)
    low, high = jnp.min(kept), jnp.max(kept)
    input_check(
        (low < 0) | (high >= classes),
        jnp.where(high >= classes, high, low),
        class_range_message(loss, classes, ignore_index, field),
    )


@contextlib.contextmanager
def class_range_checked() -> Iterator[None]:
    """For the duration: the class-index loss being called has had its targets' range
    checked (:func:`class_range_check`), so the ``nll_loss`` lowering under it does not again."""
    token = _RANGE_CHECKED.set(True)
    try:
        yield
    finally:
        _RANGE_CHECKED.reset(token)


def range_already_checked() -> bool:
    """Whether :func:`class_range_checked` is in effect (see :mod:`._nll`)."""
    return _RANGE_CHECKED.get()


def _checked(loss: Callable[..., Any]) -> Callable[..., Any]:
    """``loss`` with its target checked first: :func:`check_class_target` and, in a step,
    :func:`class_range_check` for a class-index loss, :func:`check_float_target` for the
    others."""
    name = loss.__name__
    classes = name in ("cross_entropy", "nll_loss")
    signature = inspect.signature(loss)

    @functools.wraps(loss)
    def checked(input: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
        if not classes:
            check_float_target(name, input, target)
            return loss(input, target, *args, **kwargs)
        check_class_target(name, input.ndim, target)
        ignore = signature.bind(input, target, *args, **kwargs).arguments.get("ignore_index")
        ignore = -100 if ignore is None else int(ignore)
        class_range_check(name, target, input.shape[1 if input.ndim > 1 else 0], ignore)
        with class_range_checked():
            return loss(input, target, *args, **kwargs)

    return checked


@contextlib.contextmanager
def class_index_checked() -> Iterator[None]:
    """``F.cross_entropy`` and ``F.nll_loss`` (``nn.CrossEntropyLoss``/``nn.NLLLoss`` call
    them) check their target first (:func:`check_class_target`) for the duration, and so do
    ``F.mse_loss``, ``F.huber_loss`` and ``F.binary_cross_entropy`` (a float64 target
    torch refuses: :func:`check_float_target`).

    Example:
        >>> import torch
        >>> with class_index_checked():
        ...     F.cross_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int16))
        Traceback (most recent call last):
        ...
        torchshell._errors.TorchModelError: cross_entropy: the class-index target is int16...
    """
    names = ("cross_entropy", "nll_loss", "mse_loss", "huber_loss", "binary_cross_entropy")
    originals = {name: getattr(F, name) for name in names}
    try:
        for name, loss in originals.items():
            setattr(F, name, _checked(loss))
        yield
    finally:
        for name, loss in originals.items():
            setattr(F, name, loss)


def casts_to_long(env: Any) -> None:
    """``y.long()`` (``.to(torch.int64)``...) in a torchax environment gives a new array.

    With x64 off the cast of an int32 tensor to int64 is int32 to int32, and JAX returns the
    same array: a batch field the user casts (what torch asks for) would still be the field
    :func:`check_target_dtype` refuses. A copy (which XLA removes) makes it a value of its
    own, as in torch. So does ``x.float()`` of a float64 field (JAX: float32 already), which
    the traced matmuls would otherwise refuse as float64 (:mod:`._float64`).
    """
    from torchax.tensor import Tensor

    to_copy = env._to_copy

    def cast(the_tensor: Any, new_dtype: Any, new_device: Any) -> Any:
        out = to_copy(the_tensor, new_dtype, new_device)
        same = isinstance(out, Tensor) and out._elem is getattr(the_tensor, "_elem", None)
        if same and (
            new_dtype in (torch.int64, torch.uint64)
            or (new_dtype == torch.float32 and _from_float64(out._elem))  # x.float()
        ):
            return Tensor(jnp.array(out._elem, copy=True), env, out.requires_grad)
        return out

    env._to_copy = cast
    # x.float() of a float32 array: torch returns x itself without dispatching an op
    env.override_op_definition(
        torch._C.TensorBase.float, lambda t, *args, **kwargs: cast(t, torch.float32, None)
    )


def _from_float64(value: Any) -> bool:
    """Whether ``value`` is a batch field that was float64 on the host."""
    origin = bridge.handed_over(_concrete(value))
    return origin is not None and origin.dtype == torch.float64
