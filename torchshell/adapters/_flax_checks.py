"""Host checks of a batch that torch would refuse and a jitted step would not.

- **Flax ``nn.Embed`` indices** are not checked here: torch raises ``IndexError`` for an id
  past the table, and every train step checks each ``nn.Embed``'s ids inside the compiled
  step (``flax.linen.intercept_methods``, :func:`jaxcore.guard.checking`), like the traced
  ``nn.Embedding`` (:mod:`torchshell.trace._embedding`).
- **Lengths and masks**: an integer ``length``/``lengths``/``*_lengths``/``*_len`` field
  holding a negative value (torch's ``pack_padded_sequence`` refuses it; a mask built from
  it in a jitted step is silently empty), a row ``mask`` that is not ``[B]``, or a
  ``*_mask`` field whose shape does not line up with the data it masks (``frame_mask``
  ``[B, T']`` beside ``features`` ``[B, T, F]``): ``jaxcore.BatchError`` naming the field,
  what was expected, what came, and the fix.

A module reaches these through :func:`check_batch` in its hand-over (``_prepare``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

import torch

import bridge
from jaxcore import BatchError

__all__ = ["check_batch", "check_lengths_and_masks"]

_LENGTH = re.compile(r"(^|_)(lengths?|lens?)$")


def _check_length(key: str, t: torch.Tensor) -> None:
    if t.is_floating_point() or t.dtype == torch.bool or not t.numel() or int(t.min()) >= 0:
        return
    row = int((t.reshape(t.shape[0], -1) < 0).any(1).nonzero()[0, 0])
    raise BatchError(
        f"The batch field {key!r} holds {int(t.min())} at row {row}; expected lengths >= 0 "
        "(torch's pack_padded_sequence refuses negative lengths; a mask built from one is "
        "silently empty). Fix: compute the lengths in the Dataset/collate before padding, "
        "from the unpadded items."
    )


def _check_mask(
    key: str, t: torch.Tensor, batch: Mapping[str, Any], rows: int, row_mask: bool
) -> None:
    shape = tuple(t.shape)
    if key == "mask" and row_mask:
        if shape != (rows,):
            raise BatchError(
                f"The batch field 'mask' (which rows are real) has shape {list(shape)}; "
                f"expected [{rows}], one flag per row of the batch. Fix: return a [B] bool "
                "mask from the collate, or rename the field if it masks something else "
                "(e.g. 'frame_mask' [B, T])."
            )
        return
    data = {
        k: tuple(v.shape)
        for k, v in batch.items()
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and not k.endswith("mask")
    }
    lined_up = len(shape) == 1 or not data or any(d[: len(shape)] == shape for d in data.values())
    if shape[0] != rows or not lined_up:
        fields = {k: list(v) for k, v in data.items()}
        raise BatchError(
            f"The batch field {key!r} has shape {list(shape)}, which masks none of the "
            f"batch's fields {fields} ({rows} rows): expected the leading dims of the field "
            f"it masks (e.g. [{rows}, T] for [{rows}, T, F]). Fix: pad the mask to the same "
            "length as the data in the collate (the same bucket)."
        )


def check_lengths_and_masks(batch: Mapping[str, Any], *, row_mask: bool = True) -> None:
    """Refuses negative lengths and masks whose shape does not fit the batch.

    Args:
        batch: the named batch.
        row_mask: whether ``mask`` is coreshell's mask of real rows (``[B]``), as it is for
            a Flax or ``from_torch`` model; a ``LightningModule``'s batch is its own, and its
            ``mask`` is checked like any other mask (it must line up with the data).

    Raises:
        BatchError: the field, what was expected, what came, and the fix.

    Example:
        >>> check_lengths_and_masks({"x": torch.ones(2, 3), "lengths": torch.tensor([3, 1])})
        >>> check_lengths_and_masks({"x": torch.ones(2, 3), "lengths": torch.tensor([3, -1])})
        Traceback (most recent call last):
        ...
        jaxcore._errors.BatchError: The batch field 'lengths' holds -1 at row 1; ...
    """
    lengths, masks = _checked_fields(tuple(batch))
    if not lengths and not masks:  # (the common case: one look-up per batch)
        return
    rows = bridge.rows(batch, skip=("mask",)) or None
    for key in lengths:
        t = batch[key]
        if isinstance(t, torch.Tensor) and t.dim():
            _check_length(key, t)
    for key in masks:
        t = batch[key]
        if isinstance(t, torch.Tensor) and t.dim() and rows is not None:
            _check_mask(key, t, batch, rows, row_mask)


@functools.lru_cache(maxsize=64)
def _checked_fields(keys: tuple[Any, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Which fields of a batch with these keys hold lengths and which masks (by name: the
    names are fixed for a run, so this is worked out once, not per batch)."""
    names = [k for k in keys if isinstance(k, str)]
    return (
        tuple(k for k in names if _LENGTH.search(k)),
        tuple(k for k in names if k.endswith("mask")),
    )


def check_batch(module: Any, batch: Any) -> None:
    """The checks above for a :class:`~torchshell.JaxModule`'s named batch (a dict).

    Embedding indices (Flax ``nn.Embed``, torch ``nn.Embedding``) are checked inside the
    compiled step, not here.
    """
    if isinstance(batch, Mapping):
        check_lengths_and_masks(batch)
