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

- **A field's dtype changing mid-run** (``from_torch``): with x64 off the hand-over gives
  ``int64`` and ``int32`` (``float64`` and ``float32``) the same JAX dtype, so a batch whose
  field comes in the other one (``int32`` labels from one branch of a collate, a list of
  Python floats in place of a float32 tensor) reuses the step traced for the first batch's
  dtype, where plain torch runs that batch in its own dtype or refuses it (``expected scalar
  type Long but found Int``, ``mat1 and mat2 must have the same dtype``): ``BatchError``
  naming the field, both dtypes and the fix (:func:`check_dtypes`). A change JAX sees
  (``float16``, ``uint8``) compiles a step of its own, whose trace checks it as torch would.

A module reaches these through :func:`check_batch` in its hand-over (``_prepare``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

import jax
import torch

import bridge
from jaxcore import BatchError

__all__ = ["check_batch", "check_dtypes", "check_lengths_and_masks"]

# host dtype -> the JAX dtype the hand-over gives it under x64 off (others: their own)
_AS_JAX = {
    torch.int64: torch.int32,
    torch.uint64: torch.uint32,
    torch.float64: torch.float32,
    torch.complex128: torch.complex64,
}

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


def check_dtypes(plan: Mapping[str, tuple[Any, torch.dtype]], batch: Mapping[str, Any]) -> None:
    """Refuses a field whose host dtype differs from ``plan``'s (the first batch's) where the
    hand-over hides the difference (see the top: ``int64``/``int32``, ``float64``/``float32``).

    Args:
        plan: ``{name: (per-row shape, dtype)}`` of the batch the step was built from.
        batch: the named batch.

    Raises:
        BatchError: the field, both dtypes and the fix.

    Example:
        >>> plan = {"y": ((), torch.int64)}
        >>> check_dtypes(plan, {"y": torch.tensor([1, 2])})
        >>> check_dtypes(plan, {"y": torch.tensor([1, 2], dtype=torch.int32)})
        Traceback (most recent call last):
        ...
        jaxcore._errors.BatchError: The batch field 'y' is torch.int32 in this batch, but ...
    """
    for key, (_, want) in plan.items():
        t = batch.get(key)
        if not isinstance(t, torch.Tensor) or t.dtype == want:
            continue
        seen = _AS_JAX.get(want, want)
        if _AS_JAX.get(t.dtype, t.dtype) != seen or jax.config.read("jax_enable_x64"):
            continue  # (JAX sees the change: a step of its own, traced and checked)
        raise BatchError(
            f"The batch field {key!r} is {t.dtype} in this batch, but {want} in the batch "
            f"the step was traced from. JAX runs with x64 off, so both reach the step as "
            f"{seen}: this batch would silently run the step traced for {want}, where plain "
            "torch runs it in its own dtype or refuses it (e.g. 'expected scalar type Long but "
            "found Int' for class targets, 'mat1 and mat2 must have the same dtype' for a "
            f"layer's input). Expected {want} in every batch. Fix: give the field one dtype "
            "for the whole run in the Dataset or collate (e.g. .long() on labels, .float() "
            "on features; a list of Python floats collates to float64)."
        )


def check_batch(module: Any, batch: Any) -> None:
    """The checks above for a :class:`~torchshell.JaxModule`'s named batch (a dict);
    ``module``: its adapter (a ``from_torch`` one's plan is checked for dtype changes).

    Embedding indices (Flax ``nn.Embed``, torch ``nn.Embedding``) are checked inside the
    compiled step, not here.
    """
    if isinstance(batch, Mapping):
        check_lengths_and_masks(batch)
        plan = getattr(module, "fields", None)
        if plan and getattr(module, "torch_module", None) is not None:  # (from_torch)
            check_dtypes(plan, batch)
