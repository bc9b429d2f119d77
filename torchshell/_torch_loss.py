"""A torch loss (``nn.CrossEntropyLoss()``, ``F.mse_loss``...) as the JAX step's loss.

The step wants per-example losses ``[B]`` (its batches carry a ``mask`` of real rows, and
it takes exact masked means over devices and accumulation windows). A torch loss is run by
torchax inside the jitted step with ``reduction="none"``; each row's values are then
reduced so that the masked mean equals torch's own ``reduction="mean"`` on the real rows:

- the mean over the elements of each row for an elementwise loss (``MSELoss``,
  ``L1Loss``, ``BCEWithLogitsLoss``, ``HuberLoss``...), as torch averages every element;
- for ``CrossEntropyLoss``/``NLLLoss`` on class indices, torch divides by the summed class
  ``weight`` of the targets that are not ``ignore_index``: each row's sum is scaled by
  ``rows / that total``, so the masked mean is exactly torch's.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F

from torchshell._errors import ConfigError

__all__ = ["is_torch_loss", "torch_loss_fn"]

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


def _elementwise(loss: Any) -> tuple[Callable[..., Any], dict[str, Any], bool, Any, int]:
    """``(call(outputs, target, buffers), buffers, class_index, weight, ignore_index)``."""
    name = getattr(loss, "__name__", type(loss).__name__)
    if isinstance(loss, torch.nn.Module):
        if not hasattr(loss, "reduction"):
            raise ConfigError(
                f"the torch loss {name} has no `reduction`: the step needs a loss per example "
                "(its batches are padded and masked). Fix: subclass torch.nn.modules.loss._Loss "
                "and honour reduction='none', or write training_step in a LightningModule and "
                "use JaxModule.from_lightning."
            )
        module = copy.copy(loss)
        setattr(module, "reduction", "none")  # noqa: B010  (the copy's, not the user's loss)
        buffers = {k: jnp.asarray(v.detach().cpu().numpy()) for k, v in loss.named_buffers()}

        def call(outputs: Any, target: Any, tensors: Mapping[str, Any]) -> Any:
            return torch.func.functional_call(module, dict(tensors), (outputs, target))

        class_index = isinstance(loss, torch.nn.CrossEntropyLoss | torch.nn.NLLLoss)
        weight = buffers.get("weight") if class_index else None
        ignore = int(getattr(loss, "ignore_index", -100))
        smoothing = float(getattr(loss, "label_smoothing", 0.0))
        if class_index and weight is not None and smoothing:
            raise ConfigError(
                f"{name}(weight=..., label_smoothing={smoothing}): torch's mean "
                "over weighted, smoothed targets is not a per-example mean. Fix: drop one of "
                "the two, or use JaxModule.from_lightning with the loss in training_step."
            )
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


def torch_loss_fn(loss: Any, label_key: str = "y") -> Callable[..., Any]:
    """The JAX ``loss_fn(outputs, batch) -> (loss[B], metrics)`` of a torch loss.

    Args:
        loss: a torch loss module (``nn.CrossEntropyLoss(label_smoothing=0.1)``, with its
            ``weight``/``ignore_index``) or a ``torch.nn.functional`` loss.
        label_key: the batch field holding the target.

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

    call, buffers, class_index, weight, ignore = _elementwise(loss)
    name = getattr(loss, "__name__", type(loss).__name__)

    def loss_fn(outputs: Any, batch: Mapping[str, Any]) -> tuple[jax.Array, dict[str, Any]]:
        if not isinstance(batch, Mapping) or label_key not in batch:
            raise ConfigError(
                f"the torch loss {name} reads the target from batch[{label_key!r}], and the "
                f"batch has {sorted(batch) if isinstance(batch, Mapping) else type(batch)}. "
                "Fix: name the target field in batch_keys=(inputs..., target)."
            )
        target = batch[label_key]
        if not isinstance(outputs, jax.Array):
            raise ConfigError(
                f"the torch loss {name} takes the model's output tensor, and the model "
                f"returned {_describe(outputs)}. Fix: wrap the model so that forward returns "
                "the tensor the loss reads (e.g. `return self.model(x).logits` for a "
                "transformers model), or pass a JAX loss_fn(outputs, batch) that picks it."
            )
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
        metrics: dict[str, Any] = {}
        if class_index and jnp.issubdtype(target.dtype, jnp.integer):
            kept = target != ignore
            w = jnp.ones(target.shape) if weight is None else weight[jnp.where(kept, target, 0)]
            counted = (w * kept).reshape(per.shape[0], -1).sum(1)
            mask = batch.get("mask")
            real = jnp.ones(per.shape[0]) if mask is None else mask.astype(jnp.float32)
            total = jnp.sum(counted * real)
            losses = rows.sum(1) * jnp.sum(real) / jnp.where(total > 0, total, 1.0)
            if outputs.ndim == 2:
                metrics["accuracy"] = (jnp.argmax(outputs, -1) == target).astype(jnp.float32)
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
