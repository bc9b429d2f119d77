"""Trainer values a traced ``training_step`` reads: one compiled step per value set.

Lightning's docs step a scheduler per epoch from ``training_step``:
``if self.trainer.is_last_batch and (self.trainer.current_epoch + 1) % N == 0: sch.step()``.
Those are host values, read in Python while the step is traced: a step traced on the first
batch would keep ``is_last_batch=False`` for every batch, and never step. So while a manual
``training_step`` is traced, reads of :data:`SPECIALISED` by the user's code are recorded
with the values they gave; before each batch the compiled step traced with the values the
Trainer holds now is used, traced anew when there is none (``is_last_batch``: two
programs; ``current_epoch``: one per epoch where it is read). The same holds under automatic
optimization (``if self.current_epoch < 5: loss = loss + penalty``). Only the programs
that can still be used are kept (:func:`reusable`: the current epoch's).

``global_step`` changes every step, so it is not specialised: while ``training_step`` is
traced, a read of it gives a traced value the compiled step receives with each batch
(:func:`traced_global_step`; :class:`~torchshell.port._capture.LogCapture` supplies it).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L

from torchshell.port._sandbox import TraceSandbox

__all__ = ["SPECIALISED", "reads_hold", "reusable", "traced_global_step", "watching_trainer"]

SPECIALISED = ("is_last_batch", "current_epoch")
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
def watching_trainer(reads: dict[str, Any]) -> Iterator[None]:
    """While tracing: the user's reads of :data:`SPECIALISED` Trainer values go into
    ``reads`` (name: value). The properties are patched in a
    :class:`~torchshell.port._sandbox.TraceSandbox` (put back on exit, exceptions too).

    Args:
        reads: filled with what was read.

    Example:
        >>> reads = {}
        >>> with watching_trainer(reads):
        ...     pass
        >>> reads
        {}
    """
    with TraceSandbox() as sandbox:
        for name in SPECIALISED:
            own = sandbox.trainer_getter(name)

            def get(trainer: Any, _name: str = name, _own: Any = own) -> Any:
                value = _own(trainer)
                if _user_frame():
                    reads[_name] = value
                return value

            sandbox.trainer_property(name, get)
        yield


@contextlib.contextmanager
def traced_global_step(value: Callable[[], Any]) -> Iterator[None]:
    """While tracing: the user's reads of ``trainer.global_step`` give ``value()`` (a traced
    tensor); Lightning's and coreshell's own reads still give the Trainer's int.

    Example:
        >>> import lightning as L
        >>> with traced_global_step(lambda: "traced"):  # (a doctest is a user's frame)
        ...     L.Trainer.global_step.fget(None)
        'traced'
    """
    with TraceSandbox() as sandbox:
        own = sandbox.trainer_getter("global_step")
        sandbox.trainer_property(
            "global_step", lambda trainer: value() if _user_frame() else own(trainer)
        )
        yield


def reads_hold(trainer: Any, reads: dict[str, Any]) -> bool:
    """Whether ``trainer`` holds the values a compiled step was traced with.

    Example:
        >>> class T:
        ...     is_last_batch = True
        >>> reads_hold(T(), {"is_last_batch": True}), reads_hold(T(), {"is_last_batch": False})
        (True, False)
    """
    return all(getattr(trainer, name) == value for name, value in reads.items())


def reusable(
    steps: list[tuple[dict[str, Any], Any]], reads: dict[str, Any]
) -> list[tuple[dict[str, Any], Any]]:
    """The compiled steps still worth keeping once one traced with ``reads`` is added.

    ``current_epoch`` only grows within a fit: a program traced in an earlier epoch never
    holds again, so only those of the epoch ``reads`` holds are kept (``is_last_batch``'s two,
    say), and the others are freed.

    Example:
        >>> steps = [({"current_epoch": 0}, "a"), ({"current_epoch": 1}, "b")]
        >>> [s for _, s in reusable(steps, {"current_epoch": 1})]
        ['b']
    """
    if "current_epoch" not in reads:
        return steps
    epoch = reads["current_epoch"]
    return [(r, s) for r, s in steps if r.get("current_epoch", epoch) == epoch]
