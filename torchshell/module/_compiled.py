"""The module's compiled train programs: one object the module owns, dropped as a whole."""

from __future__ import annotations

from dataclasses import dataclass, field

import jaxcore

__all__ = ["Compiled"]


@dataclass
class Compiled:
    """The train step, the shorter ones, the forward pass alone and the state's init.

    Made on the first batch (the step compiled beside the state's init,
    ``jaxcore.PendingState``), rebuilt when the Trainer's flags or the optimizer change
    (:meth:`drop`).

    Attributes:
        train: the train step of full windows (``adapter.steps.compile_train_step``).
        short: a short last accumulation window's, or one holding a ragged batch's, by
            ``(micro, ragged)``.
        forward: the next step's forward pass alone (``on_train_batch_end``'s outputs ahead).
        pending: the state's init compiling beside the first step.
        stats: the first compile's statistics (``compile/*`` in the loggers).
        stats_due: whether those are still to be logged, after the step they came with.

    Example:
        >>> compiled = Compiled()
        >>> compiled.recompiles(), compiled.train is None
        (0, True)
    """

    train: jaxcore.Step | None = None
    short: dict[tuple[int, bool], jaxcore.Step] = field(default_factory=dict)
    forward: jaxcore.Step | None = None
    pending: jaxcore.PendingState | None = None
    stats: jaxcore.CompileStats | None = None
    stats_due: bool = False

    def drop(self) -> None:
        """The train programs rebuilt at their next use (new flags, a new optimizer)."""
        self.train, self.short, self.forward = None, {}, None

    def recompiles(self) -> int:
        """Compiles beyond the first: the train step's, and every shorter step's."""
        if self.train is None:
            return 0
        return self.train.recompiles + sum(s.compiles for s in self.short.values())
