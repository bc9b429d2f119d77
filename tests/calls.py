"""Count the Python calls coreshell makes per steady training batch (issue #53's measure).

:class:`CallCounter` is a Lightning callback: from batch ``start`` on it records, for each
batch, every call of a function defined in ``jaxcore/``, ``bridge/`` or ``torchshell/`` made
on the training thread between that batch's ``on_train_batch_start`` and the next one's (the
hand-over, the step's dispatch, the logging, the hooks). ``per_batch()`` is the mean count;
``files()`` the coreshell files those calls ran in. ``sys.setprofile`` sees Python frames
only: the compiled step's own work is not counted, nor the prefetch thread's.

Example:
    >>> counter = CallCounter(start=1)
    >>> counter.per_batch()  # nothing recorded yet
    0.0
"""

from __future__ import annotations

import statistics
import sys
import threading
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = tuple(str(ROOT / name) + "/" for name in ("jaxcore", "bridge", "torchshell"))


class CallCounter(L.Callback):
    """Calls into coreshell's own functions, per training batch from batch ``start`` on."""

    def __init__(self, start: int = 20) -> None:
        self.start = start
        self.counts: list[Counter[str]] = []
        self._current: Counter[str] | None = None
        self._thread = threading.get_ident()

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or self._current is None or threading.get_ident() != self._thread:
            return
        name = frame.f_code.co_filename
        if name.startswith(PACKAGES):
            self._current[f"{name[len(str(ROOT)) + 1 :]}:{frame.f_code.co_name}"] += 1

    def _close(self) -> None:
        if self._current is not None:
            self.counts.append(self._current)
            self._current = None

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, idx: int) -> None:
        self._close()
        if trainer.global_step >= self.start:
            self._thread = threading.get_ident()
            self._current = Counter()
            sys.setprofile(self._profile)

    def on_train_end(self, trainer: Any, module: Any) -> None:
        sys.setprofile(None)
        self._current = None  # the last batch's window holds the end of the fit: not counted

    def per_batch(self) -> float:
        """The mean number of coreshell calls per recorded batch (0 when none): a mean, as
        K-step windows dispatch on one batch in K."""
        return statistics.fmean(sum(c.values()) for c in self.counts) if self.counts else 0.0

    def files(self) -> set[str]:
        """The coreshell files the recorded calls ran in."""
        return {key.split(":")[0] for c in self.counts for key in c}

    def table(self) -> list[tuple[str, float]]:
        """``(file:function, calls per batch)``, most called first."""
        total: Counter[str] = Counter()
        for c in self.counts:
            total.update(c)
        n = max(len(self.counts), 1)
        return [(key, count / n) for key, count in total.most_common()]
