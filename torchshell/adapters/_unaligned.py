"""Batches whose fields have different numbers of rows: a graph batch (node features
``[N, F]``, an edge list ``[2, E]`` or ``[E, 2]``, a node-to-graph vector ``[N]``, graph
labels ``[G]``), an edge list, a ragged side input, under ``JaxModule.from_torch`` (a Flax
module's batch keeps its rows, split over the data axis; a field without them is named).

Such a batch has no rows to pad or to weigh: it goes to the step as it came (whole on every
device, no ``mask``), and the step weighs each batch as one (``weigh_rows=False``), as plain
torch's step does: the loss is the loss function's batch value (a torch loss's
``reduction="mean"`` over its target's rows), its metrics their batch means. The adapter
learns the form from the first training batch; the loss reads it from :data:`UNALIGNED_KEY`,
a 0-d flag the adapter adds to such a batch (removed before the loss sees the batch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import bridge
from jaxcore import TOTAL
from torchshell._errors import ConfigError
from torchshell.adapters._placement import Placement

__all__ = [
    "UNALIGNED_KEY",
    "aligned",
    "means_where_unaligned",
    "refuse_row_mask",
    "unaligned_batch",
    "unaligned_refusal",
]

UNALIGNED_KEY = "~unaligned"  # in a JAX batch: its fields' rows do not align (see above)


def aligned(batch: Any) -> bool:
    """Whether every array field with a dimension has the same leading size.

    Example:
        >>> import torch
        >>> aligned({"x": torch.ones(4, 2), "y": torch.ones(4), "n": torch.tensor(3)})
        True
        >>> aligned({"x": torch.ones(24, 5), "edge_index": torch.ones(2, 40, dtype=int)})
        False
    """
    sizes = {t.shape[0] for t in jax.tree.leaves(batch) if getattr(t, "ndim", 0) > 0}
    return len(sizes) <= 1


def refuse_row_mask(batch: Mapping[str, Any]) -> None:
    """A ``mask`` field in a batch whose rows do not align: coreshell reads ``mask`` as the
    row mask of padded batches, which such a batch has no rows for."""
    if "mask" in batch:
        sizes = {k: tuple(getattr(v, "shape", ())) for k, v in batch.items()}
        raise ConfigError(
            f"The batch's fields have different numbers of rows ({sizes}) and one is named "
            "'mask': coreshell reads a field of that name as the mask of real rows, and such "
            "a batch has no common rows. Fix: rename the field (e.g. 'node_mask') in the "
            "collate, and apply it in the model or the loss."
        )


def unaligned_batch(batch: Mapping[str, Any], placement: Placement) -> dict[str, Any]:
    """The batch on the mesh, whole on every device (no rows to split), flagged."""
    whole = NamedSharding(placement.mesh, PartitionSpec())
    out = dict(bridge.to_jax(batch, whole, stats=placement.stats))
    out[UNALIGNED_KEY] = np.zeros((), np.bool_)  # (0-d: no rows; its presence is the flag)
    return out


def unaligned_refusal(what: str, fix: str) -> str:
    """The refusal of a way to group steps that needs rows a graph batch does not have."""
    return (
        f"{what} stacks batches row by row, and the batch's fields have different numbers of "
        f"rows (a graph batch: nodes, edges, graphs), which no common row axis joins. Fix: "
        f"{fix}; to group steps use Trainer(accumulate_grad_batches=m), which keeps each "
        "batch as it came."
    )


def means_where_unaligned(loss_fn: Callable[..., Any], means_fn: Callable[..., Any]) -> Any:
    """``loss_fn`` (per-row values) for batches whose rows align; ``means_fn`` for a batch
    flagged :data:`UNALIGNED_KEY`, its loss and metrics reduced to batch means (0-d)."""

    def loss(outputs: Any, batch: Any) -> Any:
        if not (isinstance(batch, Mapping) and UNALIGNED_KEY in batch):
            return loss_fn(outputs, batch)
        batch = {k: v for k, v in batch.items() if k != UNALIGNED_KEY}
        out = means_fn(outputs, batch)
        value, metrics = out if isinstance(out, tuple) else (out, {})
        means = {k: v if k.startswith(TOTAL) else _mean(v) for k, v in dict(metrics).items()}
        return _mean(value), means

    loss.__name__ = getattr(loss_fn, "__name__", "loss")
    return loss


def _mean(v: Any) -> jax.Array:
    return jnp.mean(jnp.asarray(v, jnp.float32))
