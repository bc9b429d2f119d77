"""Lightning's ``accumulate_grad_batches`` on the JAX side: ``m`` batches, one optimizer step.

The module owns one :class:`Accumulation` (``module.accumulation``); the step for a window is
the module's (``accum_steps=m`` over the stacked batches, a short last window scaled).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Accumulation"]


class Accumulation:
    """The batches of the current window, and the rows of each batch of the last one.

    Example:
        >>> acc = Accumulation()
        >>> acc.take([1, 2, 3, 4], 2, False, rows=len) is None  # 1 batch of 2
        True
        >>> acc.take([5, 6, 7], 2, False, rows=len), acc.micro_rows, acc.batches
        ([[1, 2, 3, 4], [5, 6, 7]], [4, 3], [])
    """

    def __init__(self) -> None:
        self.batches: list[Any] = []
        self.micro_rows: list[int] = []

    def take(self, batch: Any, m: int, last: bool, rows: Callable[[Any], int]) -> list[Any] | None:
        """Keeps ``batch``; the window's batches once it holds ``m`` (or ``last``, the epoch's
        last batch, closes it short), ``None`` while it fills. ``rows``: a batch's rows."""
        self.batches.append(batch)
        if len(self.batches) < m and not last:
            return None
        window, self.batches = self.batches, []
        self.micro_rows = [rows(b) for b in window]
        return window

    def clear(self) -> None:
        """Drops a partial window (a window never spans epochs)."""
        self.batches = []
