"""Trainer values a traced ``training_step`` reads: one compiled step per value set.

Lightning's docs step a scheduler per epoch from ``training_step``:
``if self.trainer.is_last_batch and (self.trainer.current_epoch + 1) % N == 0: sch.step()``.
Those are host values, read in Python while the step is traced: a step traced on the first
batch would keep ``is_last_batch=False`` for every batch, and never step. So while a manual
``training_step`` is traced, reads of :data:`SPECIALISED` by the user's code are recorded
with the values they gave; before each batch the compiled step traced with the values the
Trainer holds now is used, traced anew when there is none (``is_last_batch``: two
programs; ``current_epoch``: one per epoch where it is read). The same holds under automatic
optimization (``if self.current_epoch < 5: loss = loss + penalty``). ``global_step`` changes
every step: under manual optimization a read of it is refused, naming it and the fix; under
automatic optimization it is left as it was (docs/porting.md).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L

from torchshell._errors import ConfigError

__all__ = ["SPECIALISED", "reads_hold", "watching_trainer"]

SPECIALISED = ("is_last_batch", "current_epoch")
_REFUSED = ("global_step",)
_LIGHTNING = str(Path(L.__file__).parent)
# frames a read passes through on its way from the user's code: Lightning's properties
# (``self.current_epoch``) and the trace's counting class (:func:`port._logs._counting_class`)
_PASSING = (_LIGHTNING, str(Path(__file__).with_name("_logs.py")))
_OURS = tuple(str(Path(__file__).parents[2] / p) for p in ("torchshell", "jaxcore", "bridge"))


def _user_frame() -> bool:
    """Whether the property was read by the user's code (not Lightning's, not coreshell's)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_PASSING):
        frame = frame.f_back
    return frame is not None and not frame.f_code.co_filename.startswith(_OURS)


@contextlib.contextmanager
def watching_trainer(owner: str, reads: dict[str, Any], manual: bool = True) -> Iterator[None]:
    """While tracing: the user's reads of :data:`SPECIALISED` Trainer values go into
    ``reads`` (name: value); under manual optimization a read of ``global_step`` is refused.

    Args:
        owner: the user's module's class name (for the message).
        reads: filled with what was read.
        manual: the step is a manual-optimization one.

    Example:
        >>> reads = {}
        >>> with watching_trainer("Net", reads):
        ...     pass
        >>> reads
        {}
    """
    saved = {name: L.Trainer.__dict__[name] for name in SPECIALISED + (_REFUSED if manual else ())}

    def recorder(name: str) -> property:
        def get(trainer: Any) -> Any:
            value = saved[name].fget(trainer)
            if _user_frame():
                if name in _REFUSED:
                    raise ConfigError(
                        f"{owner}.training_step reads self.{name} under manual optimization: "
                        "the compiled step is traced once, so the value of the first batch "
                        "would be kept for every batch. Fix: decide per batch on host values "
                        "in on_train_batch_start/on_train_batch_end, or let a scheduler "
                        "(self.lr_schedulers(), sch.step() every batch) carry the step count."
                    )
                reads[name] = value
            return value

        return property(get)

    for name in saved:
        setattr(L.Trainer, name, recorder(name))
    try:
        yield
    finally:
        for name, prop in saved.items():
            setattr(L.Trainer, name, prop)


def reads_hold(trainer: Any, reads: dict[str, Any]) -> bool:
    """Whether ``trainer`` holds the values a compiled step was traced with.

    Example:
        >>> class T:
        ...     is_last_batch = True
        >>> reads_hold(T(), {"is_last_batch": True}), reads_hold(T(), {"is_last_batch": False})
        (True, False)
    """
    return all(getattr(trainer, name) == value for name, value in reads.items())
