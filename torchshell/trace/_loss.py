"""A torch loss (``nn.CrossEntropyLoss()``, ``F.mse_loss``...) as the JAX step's loss.

The step wants per-example losses ``[B]`` (its batches carry a ``mask`` of real rows, and
it takes exact masked means over devices and accumulation windows). A torch loss is run by
torchax inside the jitted step with ``reduction="none"``; each row's values are then
reduced so that the masked mean equals torch's own ``reduction="mean"`` on the real rows:

- the mean over the elements of each row for an elementwise loss (``MSELoss``,
  ``L1Loss``, ``BCEWithLogitsLoss``, ``HuberLoss``...), as torch averages every element;
- for ``CrossEntropyLoss``/``NLLLoss`` on class indices, torch divides by the summed class
  ``weight`` of the targets that are not ``ignore_index``: each row's sum is scaled by
  ``rows / that total``, so the masked mean is exactly torch's;
- the loss's own ``reduction`` is kept: ``"sum"`` (each row's sum times the real rows, so the
  mean is torch's sum) and ``"batchmean"`` (``KLDivLoss``: each row's sum).

A model returning a transformers ``ModelOutput`` gives a torch loss its ``logits``; a team's
own loss function reads its fields as attributes (``out.logits``) or keys.

A team's own loss *function* (or a loss module without ``reduction``) written with torch ops
(``def loss(out, y): return F.cross_entropy(out.flatten(0, 1), y.flatten())``) is run by
torchax as it is, row by row (:func:`jaxcore.per_example`), so a padded last batch stays
exact.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F

import jaxcore
from torchshell._errors import ConfigError
from torchshell.trace._targets import (
    check_class_target,
    check_float_target,
    class_index_checked,
    class_range_check,
    fields_named,
)

__all__ = [
    "is_torch_loss",
    "target_field",
    "torch_function_loss",
    "torch_loss_fn",
    "written_in_torch",
]

_CLASS_INDEX_FNS = (F.cross_entropy, F.nll_loss)


def is_torch_loss(loss: Any) -> bool:
    """Whether ``loss`` is a torch loss (a module, or a ``torch.nn.functional`` function).

    Example:
        >>> is_torch_loss(torch.nn.MSELoss()), is_torch_loss(F.cross_entropy)
        (True, True)
        >>> import jaxcore
        >>> is_torch_loss(jaxcore.softmax_cross_entropy)
        False
    """
    if isinstance(loss, torch.nn.Module):
        return True
    return callable(loss) and str(getattr(loss, "__module__", "")).startswith("torch.")


def written_in_torch(fn: Any) -> bool:
    """Whether a plain function reads torch names (``F``, ``torch``, ``nn``) from its globals.

    Such a function is a torch loss the team wrote, ``(output, target) -> loss``; a JAX
    loss (``jnp``, ``optax``) takes ``(outputs, batch)``.

    Example:
        >>> written_in_torch(lambda out, y: F.cross_entropy(out, y))
        True
        >>> written_in_torch(lambda out, batch: jnp.mean((out - batch["y"]) ** 2))
        False
    """
    if isinstance(fn, torch.nn.Module) or not callable(fn):
        return False
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__call__
    code = getattr(target, "__code__", None)
    if code is None:
        return False
    scope = getattr(target, "__globals__", {})
    names = set(code.co_names)
    for const in code.co_consts:  # nested functions and comprehensions
        if hasattr(const, "co_names"):
            names.update(const.co_names)
    for name in names:
        value = scope.get(name)
        module = getattr(value, "__name__", "") if inspect.ismodule(value) else ""
        module = module or str(getattr(value, "__module__", "") or "")
        if module == "torch" or module.startswith("torch."):
            return True
    return False


def torch_function_loss(
    fn: Callable[..., Any], label_key: str = "y", inputs: Sequence[str] = (), per_row: bool = True
) -> Callable[..., Any]:
    """A team's own torch loss function ``(output, target) -> loss`` as the step's loss.

    Run by torchax on the JAX arrays; a batch-mean result is evaluated row by row
    (:func:`jaxcore.per_example`), so padded rows never count.

    Args:
        fn: the function; it receives the model's output and ``batch[label_key]`` as torch
            tensors and returns a scalar (or one value per row).
        label_key: the batch field holding the target (see :func:`target_field`).
        inputs: the fields the model reads (never the target).
        per_row: evaluated row by row; ``False``: its value on the whole batch.

    Returns:
        A loss function for :class:`~torchshell.JaxModule`.

    Example:
        >>> fn = torch_function_loss(lambda out, y: F.mse_loss(out, y))
        >>> losses, _ = fn(jnp.array([[1.0], [3.0]]), {"y": jnp.zeros((2, 1))})
        >>> losses.tolist()
        [1.0, 9.0]
    """
    from torchax.interop import call_torch

    name = getattr(fn, "__name__", type(fn).__name__)

    def loss_fn(outputs: Any, batch: Mapping[str, Any]) -> jax.Array:
        key = target_field(batch, label_key, inputs, name)
        target = batch[key]
        # (F.cross_entropy/nll_loss in it refuse the class-index targets torch refuses, and
        # report those outside the classes, naming the field)
        with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
            warnings.filterwarnings(
                "ignore", "Explicitly requested dtype int64 requested in ", UserWarning
            )
            with class_index_checked(), fields_named({key: target}):
                value = call_torch(_with_fields(fn), outputs, target)
        return jnp.asarray(value, jnp.float32)

    return jaxcore.per_example(loss_fn) if per_row else loss_fn


class Fields(dict):  # type: ignore[type-arg]
    """A model's dict output whose fields also read as attributes (``out.logits``), as the
    ``ModelOutput`` of a transformers model the team's loss was written for."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _with_fields(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(outputs: Any, target: Any) -> Any:
        return fn(Fields(outputs) if isinstance(outputs, dict) else outputs, target)

    return call


TARGET_NAMES = ("labels", "label", "targets", "target", "y")
"""Field names taken as the target of a dict batch that has no ``label_key`` field."""


def target_field(batch: Any, label_key: str, inputs: Sequence[str], loss: str) -> str:
    """The batch field a torch loss compares the output with.

    ``label_key`` when the batch has it; else, in a dict batch (a Hugging Face style
    ``{"input_ids", "attention_mask", "labels"}``), the first of :data:`TARGET_NAMES` it
    holds, or its one field that is neither a model input nor the row ``mask``.

    Example:
        >>> target_field({"input_ids": 0, "attention_mask": 0, "labels": 0}, "x",
        ...              ("input_ids", "attention_mask"), "CrossEntropyLoss")
        'labels'
    """
    if isinstance(batch, Mapping) and label_key in batch:
        return label_key
    fields = sorted(batch) if isinstance(batch, Mapping) else []
    named = [k for k in TARGET_NAMES if k in fields and k not in inputs]
    rest = [k for k in fields if k not in inputs and k != "mask"]
    if named or len(rest) == 1:
        return (named or rest)[0]
    raise ConfigError(
        f"the torch loss {loss} needs the target field: the batch has "
        f"{fields if fields else type(batch).__name__}, none of them {label_key!r} or one of "
        f"{list(TARGET_NAMES)}. Fix: name it in batch_keys=(inputs..., target), or name the "
        "field 'labels' in the Dataset."
    )


def _reduction(loss: Any) -> str:
    """The user's ``reduction`` of a torch loss module (functions: torch's default, mean)."""
    reduction = (
        str(getattr(loss, "reduction", "mean")) if isinstance(loss, torch.nn.Module) else "mean"
    )
    if reduction == "none":
        raise ConfigError(
            f"{type(loss).__name__}(reduction='none') gives no scalar to minimise (torch's "
            "backward would refuse it too). coreshell already evaluates the loss per example "
            "and reproduces torch's 'mean', 'sum' and 'batchmean'. Fix: pass the loss as you "
            "train with it in torch (the default reduction='mean')."
        )
    if reduction not in ("mean", "sum", "batchmean"):
        raise ConfigError(
            f"{type(loss).__name__}(reduction={reduction!r}): expected 'mean', 'sum' or "
            "'batchmean'. Fix: use one of those."
        )
    return reduction


def _elementwise(loss: Any) -> tuple[Callable[..., Any], dict[str, Any], bool, Any, int]:
    """``(call(outputs, target, buffers), buffers, class_index, weight, ignore_index)``."""
    name = getattr(loss, "__name__", type(loss).__name__)
    if isinstance(loss, torch.nn.Module):
        module = copy.copy(loss)
        setattr(module, "reduction", "none")  # noqa: B010  (the copy's, not the user's loss)
        buffers = {k: jnp.asarray(v.detach().cpu().numpy()) for k, v in loss.named_buffers()}

        def call(outputs: Any, target: Any, tensors: Mapping[str, Any]) -> Any:
            return torch.func.functional_call(module, dict(tensors), (outputs, target))

        class_index = isinstance(loss, torch.nn.CrossEntropyLoss | torch.nn.NLLLoss)
        weight = buffers.get("weight") if class_index else None
        ignore = int(getattr(loss, "ignore_index", -100))
        return call, buffers, class_index, weight, ignore
    if "reduction" not in inspect.signature(loss).parameters:
        raise ConfigError(
            f"the torch function {name} takes no `reduction`, so its per-example losses are "
            "unknown. Fix: pass a torch loss module or a torch.nn.functional loss, or a JAX "
            "loss_fn(outputs, batch) -> (loss[B], metrics)."
        )

    def call_fn(outputs: Any, target: Any, tensors: Mapping[str, Any]) -> Any:
        return loss(outputs, target, reduction="none")

    return call_fn, {}, loss in _CLASS_INDEX_FNS, None, -100


def torch_loss_fn(
    loss: Any, label_key: str = "y", inputs: Sequence[str] = ()
) -> Callable[..., Any]:
    """The JAX ``loss_fn(outputs, batch) -> (loss[B], metrics)`` of a torch loss.

    Args:
        loss: a torch loss module (``nn.CrossEntropyLoss(label_smoothing=0.1)``, with its
            ``weight``/``ignore_index``) or a ``torch.nn.functional`` loss.
        label_key: the batch field holding the target (see :func:`target_field`).
        inputs: the fields the model reads (never the target).

    Returns:
        A loss function for :class:`~torchshell.JaxModule`; class-index losses on ``[B, C]``
        outputs also report ``accuracy``.

    Example:
        >>> fn = torch_loss_fn(torch.nn.CrossEntropyLoss())
        >>> loss, metrics = fn(jnp.array([[0.0, 9.0], [9.0, 0.0]]), {"y": jnp.array([1, 1])})
        >>> [round(float(v), 4) for v in loss], float(metrics["accuracy"].mean())
        ([0.0001, 9.0001], 0.5)
    """
    from torchax.interop import call_torch

    if isinstance(loss, torch.nn.Module) and not hasattr(loss, "reduction"):
        return torch_function_loss(loss, label_key, inputs)  # the team's own loss module
    reduction = _reduction(loss)
    call, buffers, class_index, weight, ignore = _elementwise(loss)
    name = getattr(loss, "__name__", type(loss).__name__)

    def loss_fn(outputs: Any, batch: Mapping[str, Any]) -> tuple[jax.Array, dict[str, Any]]:
        target = batch[target_field(batch, label_key, inputs, name)]
        if isinstance(outputs, Mapping) and isinstance(outputs.get("logits"), jax.Array):
            outputs = outputs["logits"]  # a transformers ModelOutput: what its loss reads
        if not isinstance(outputs, jax.Array):
            raise ConfigError(
                f"the torch loss {name} takes the model's output tensor, and the model "
                f"returned {_describe(outputs)}. Fix: wrap the model so that forward returns "
                "the tensor the loss reads (e.g. `return self.model(x).logits` for a "
                "transformers model), or pass a JAX loss_fn(outputs, batch) that picks it."
            )
        if class_index:
            check_class_target(name, outputs.ndim, target)
        check_float_target(name, outputs, target)  # (float64 targets torch refuses)
        # Lightning evaluates under inference_mode, which skips the decompositions torchax
        # lowers losses with (as in torch_model.py); int64 -> int32 narrowing: see there
        with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
            warnings.filterwarnings(
                "ignore", "Explicitly requested dtype int64 requested in ", UserWarning
            )
            per = call_torch(call, outputs, target, buffers)
        per = jnp.asarray(per, jnp.float32)
        if per.ndim == 0 or per.shape[0] != target.shape[0]:
            raise ConfigError(
                f"the torch loss {name} with reduction='none' returned shape "
                f"{tuple(per.shape)}, not one value per example ({target.shape[0]} rows). "
                "Fix: make its forward honour reduction='none'."
            )
        rows = per.reshape(per.shape[0], -1)
        mask = batch.get("mask")
        real = jnp.ones(per.shape[0]) if mask is None else mask.astype(jnp.float32)
        metrics: dict[str, Any] = {}
        class_targets = class_index and jnp.issubdtype(target.dtype, jnp.integer)
        if class_targets and outputs.ndim == 2:
            metrics["accuracy"] = (jnp.argmax(outputs, -1) == target).astype(jnp.float32)
        if reduction == "sum":  # the step's mean over the real rows is then torch's sum
            losses = rows.sum(1) * jnp.sum(real)
        elif reduction == "batchmean":
            losses = rows.sum(1)
        elif class_targets:
            kept = target != ignore
            field = f"[{target_field(batch, label_key, inputs, name)!r}]"
            class_range_check(
                name, target, outputs.shape[1 if outputs.ndim > 1 else 0], ignore, field
            )
            w = jnp.ones(target.shape) if weight is None else weight[jnp.where(kept, target, 0)]
            counted = (w * kept).reshape(per.shape[0], -1).sum(1)
            total = jnp.sum(counted * real)
            losses = rows.sum(1) * jnp.sum(real) / jnp.where(total > 0, total, 1.0)
        else:
            losses = rows.mean(1)
        return losses, metrics

    return loss_fn


def _describe(outputs: Any) -> str:
    """``a dict with keys ['logits', ...]``, ``a tuple of 2``: what a model returned."""
    if isinstance(outputs, Mapping):
        return f"a {type(outputs).__name__} with keys {sorted(outputs)}"
    if isinstance(outputs, list | tuple):
        return f"a {type(outputs).__name__} of {len(outputs)}"
    return f"a {type(outputs).__name__}"
