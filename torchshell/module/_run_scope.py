"""What one run (``fit``, ``validate``, ``test``, ``predict``) changes, undone at its end."""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any

from torchshell.module._flags import restore_flags

__all__ = ["RunScope"]

# Lightning warns that a manual-optimization checkpoint holds the state *after* the optimizer
# step; the JAX state of step N is exactly what a JaxModule checkpoint at step N should hold.
_AFTER_STEP_WARNING = "Using ModelCheckpoint with manual optimization and every_n_train_steps"


@dataclass
class RunScope:
    """The Trainer flags coreshell carries out itself, the loaders it reads by gathers and a
    warning filter: set while a run lasts (``setup``), undone at ``teardown`` (:meth:`close`).

    Attributes:
        originals: the Trainer's flags as the user set them (``adopt_flags``), while the
            Trainer holds neutral ones; ``None`` between runs.
        gathered: the plain ``TensorDataset`` loaders read by gathers in this run.
        fork_warned: the loaders already warned about forking workers (once each).

    Example:
        >>> scope = RunScope()
        >>> scope.open()
        >>> scope.close(None)
        >>> scope.originals is None and scope.gathered == []
        True
    """

    originals: dict[str, Any] | None = None
    gathered: list[Any] = field(default_factory=list)
    fork_warned: set[int] = field(default_factory=set)
    _quiet: contextlib.ExitStack | None = None

    def open(self) -> None:
        """At ``setup``: Lightning's after-the-step checkpoint warning, not the user's concern
        (a JaxModule checkpoint at step N holds step N's state), hidden for this run."""
        self._quiet = contextlib.ExitStack()
        self._quiet.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=_AFTER_STEP_WARNING, category=UserWarning)

    def started(self, loaders: Any) -> None:
        """A loop's loaders, before their workers start: forking ones warned about, plain
        ``TensorDataset`` ones read by gathers."""
        self.check_workers(loaders)
        self.read_by_gathers(loaders)

    def read_by_gathers(self, loaders: Any) -> None:
        """Plain ``TensorDataset`` loaders gather their batches while this run lasts (the same
        batches, ~5x faster to build: :mod:`torchshell.data._gathered`)."""
        from torchshell.data import loaders_in
        from torchshell.data._gathered import gatherable, read_by_gathers

        for loader in filter(gatherable, loaders_in(loaders)):
            if all(loader is not done for done in self.gathered):  # (validation runs repeat)
                read_by_gathers(loader)
                self.gathered.append(loader)

    def check_workers(self, loaders: Any) -> None:
        """One warning per loader whose workers would fork after JAX started, with the fix."""
        from torchshell.data import forking_loaders

        for loader in forking_loaders(loaders):
            if id(loader) not in self.fork_warned:
                self.fork_warned.add(id(loader))
                warnings.warn(
                    f"DataLoader(num_workers={loader.num_workers}) starts its workers with "
                    "fork, after JAX started its threads: JAX warns at every worker start that "
                    "this may deadlock. Fix: DataLoader(..., multiprocessing_context='spawn', "
                    "persistent_workers=True) (torchshell.data.loader_kwargs(n, seed) gives "
                    "both; spawned workers need a picklable Dataset and a script guarded by "
                    "`if __name__ == '__main__':`).",
                    UserWarning,
                    stacklevel=3,
                )

    def close(self, trainer: Any) -> None:
        """At ``teardown``: loaders read as before, the filter lifted, the flags restored."""
        from torchshell.data._gathered import read_normally

        for loader in self.gathered:
            read_normally(loader)
        self.gathered = []
        if self._quiet is not None:
            self._quiet.close()
            self._quiet = None
        if self.originals is not None and trainer is not None:
            restore_flags(trainer, self.originals)
        self.originals = None
