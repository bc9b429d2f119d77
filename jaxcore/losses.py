"""Per-example losses and exact masked means.

Loss functions return per-example values ``(loss[B], {name: metric[B]})``; the steps reduce
them with the batch ``mask`` so padded rows never count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxcore._errors import BatchError
from jaxcore._rows import rows as _rows
from jaxcore.guard import index_check

TOTAL = "total/"
"""A metric named ``total/...`` is a batch-level total of any shape (e.g. a metric's confusion
counts): summed over micro-batches as it is, never divided by the rows."""

MICRO = "micro/"
"""With ``make_train_step(per_micro=True)``, ``micro/<name>`` holds each micro-batch's own
value of metric ``<name>`` (``[m]``) beside the accumulated one (Lightning logs each
accumulated batch's value)."""


def masked_mean(values: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Mean of ``values[B]`` over rows where ``mask[B]`` is true (all rows when ``None``).

    Example:
        >>> import jax.numpy as jnp
        >>> float(masked_mean(jnp.array([1.0, 3.0, 100.0]), jnp.array([True, True, False])))
        2.0
    """
    if mask is None:
        return jnp.mean(values)
    m = mask.astype(values.dtype)
    return jnp.sum(values * m) / jnp.maximum(jnp.sum(m), 1)


def _labels(logits: jax.Array, batch: Mapping[str, jax.Array], key: str) -> jax.Array:
    """The integer labels ``[B]`` under ``key``, checked against the logits (at trace time)."""
    fix = (
        f"Fix: give the batch integer class indices of shape [B] under {key!r} (int32 in "
        "the Dataset), or pass label_key= to the loss."
    )
    if key not in batch:
        raise BatchError(
            f"The loss reads labels {key!r}: expected an integer [B] field, got a "
            f"batch with keys {sorted(batch)}. {fix}"
        )
    labels = batch[key]
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise BatchError(
            f"Labels {key!r}: expected an integer [B] array, got {labels.dtype} "
            f"of shape {tuple(labels.shape)}. {fix}"
        )
    if labels.shape != logits.shape[:-1]:
        raise BatchError(
            f"Labels {key!r}: expected an integer [B] array matching logits "
            f"{tuple(logits.shape)} ([B, C]), got shape {tuple(labels.shape)}. "
            f"{fix}"
        )
    classes = logits.shape[-1]
    index_check(  # (inside a step: read at the logging cadence, like torch's IndexError)
        labels,
        classes,
        f"The labels ({key!r}) hold {{value}} {{where}}, past the model's {classes} classes "
        f"(logits [B, {classes}]). torch raises IndexError: Target {{value}} is out of bounds; "
        f"expected class indices in [0, {classes - 1}]. Fix: map the labels into "
        f"[0, {classes - 1}] in the Dataset, or give the model's last layer more outputs.",
    )
    return labels


def softmax_cross_entropy(
    logits: jax.Array, batch: Mapping[str, jax.Array], label_key: str = "y"
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-example cross entropy on integer labels, with accuracy as a metric.

    Args:
        logits: ``[B, C]`` float logits.
        batch: holds integer labels ``[B]`` under ``label_key``.
        label_key: the labels' key.

    Returns:
        ``(loss[B], {"accuracy": [B]})`` in float32.

    Example:
        >>> import jax.numpy as jnp
        >>> loss, m = softmax_cross_entropy(jnp.array([[0.0, 9.0]]), {"y": jnp.array([1])})
        >>> float(m["accuracy"][0])
        1.0
    """
    labels = _labels(logits, batch, label_key)
    logits = logits.astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    accuracy = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return loss, {"accuracy": accuracy}


def per_example(loss_fn: Callable[..., Any]) -> Callable[..., tuple[jax.Array, dict[str, Any]]]:
    """Any JAX loss as the steps' ``(loss[B], {name: metric[B]})``.

    A team's own loss often returns the batch mean (``optax...(logits, y).mean()``), or only
    the losses without metrics. The steps need one value per row, so that padded rows (the
    ragged last batch) never count. A loss that returns per-row values ``[B]`` is used as it
    is; one that returns a mean is evaluated row by row (``jax.vmap`` over one-row batches:
    the same function, so a mean over one row is that row's loss, exactly). Losses that
    couple rows (contrastive, batch statistics) are not per-row: return ``[B]`` values.

    Args:
        loss_fn: ``(outputs, batch) -> loss`` or ``-> (loss, {name: metric})``, each value
            ``[B]`` or a scalar mean.

    Returns:
        The loss with the steps' signature.

    Example:
        >>> import jax.numpy as jnp
        >>> mean_mse = lambda out, b: jnp.mean((out - b["y"]) ** 2)
        >>> losses, metrics = per_example(mean_mse)(jnp.array([1.0, 3.0]), {"y": jnp.zeros(2)})
        >>> losses.tolist(), metrics
        ([1.0, 9.0], {})
    """

    def split(out: Any) -> tuple[Any, dict[str, Any]]:
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
            return out[0], dict(out[1])
        return out, {}

    def wrapped(outputs: Any, batch: Mapping[str, Any]) -> tuple[jax.Array, dict[str, Any]]:
        losses, metrics = split(loss_fn(outputs, batch))
        totals = {k: metrics.pop(k) for k in list(metrics) if k.startswith(TOTAL)}
        rows = _rows(batch, default=0) or None  # (fields of other lengths: as they are)
        values = [losses, *metrics.values()]
        if rows is None or all(jnp.ndim(v) == 1 and jnp.shape(v)[0] == rows for v in values):
            return losses, metrics | totals
        mapped = [jnp.ndim(x) >= 1 and jnp.shape(x)[0] == rows for x in jax.tree.leaves(outputs)]
        if not any(mapped) or any(jnp.ndim(v) > 1 for v in values):
            _check_per_row(values, metrics, rows)
            return losses, metrics | totals  # batch-level values, reduced as batch means
        if totals:
            raise BatchError(
                f"The loss returned batch totals {sorted(totals)} and a batch mean: a mean is "
                "evaluated row by row, where a batch total has no meaning. Fix: return the "
                "loss per row [B]."
            )

        leaves, tree = jax.tree.flatten((outputs, batch))
        axes = [0 if jnp.ndim(x) >= 1 and jnp.shape(x)[0] == rows else None for x in leaves]

        def one_row(*row: Any) -> Any:  # mapped leaves back to batches of one row
            ones = [x if a is None else x[None] for x, a in zip(row, axes, strict=True)]
            return split(loss_fn(*jax.tree.unflatten(tree, ones)))

        losses, metrics = jax.vmap(one_row, in_axes=axes)(*leaves)
        flat = jax.tree.map(lambda v: v.reshape(rows, -1), (losses, metrics))
        _check_per_row([flat[0], *flat[1].values()], flat[1], rows, per_row=True)
        return flat[0][:, 0], {k: v[:, 0] for k, v in flat[1].items()}

    return wrapped


def _check_per_row(
    values: list[Any], metrics: Mapping[str, Any], rows: int, per_row: bool = False
) -> None:
    names = ["loss", *metrics]
    for name, v in zip(names, values, strict=True):
        size = jnp.size(v) // rows if per_row else jnp.size(v)
        if (per_row and size != 1) or (not per_row and jnp.ndim(v) > 1):
            raise BatchError(
                f"The loss returned {name!r} of shape {tuple(jnp.shape(v))} for a batch of {rows} "
                f"rows: expected one value per row [{rows}] or a scalar mean. Fix: reduce "
                "within each row (e.g. the mean over tokens of a row) and return [B] values."
            )
