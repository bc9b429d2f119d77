"""Asynchronous checkpoint saves: a device copy of the state, Orbax's background write, a
commit thread; one save in flight per checkpoint directory in this process."""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

import torchshell.checkpoint._files as files

# One asynchronous save at a time per checkpoint directory in this process, whichever
# OrbaxCheckpointIO started it: readers and the next writer of that directory wait for it.
_IN_FLIGHT: dict[Path, Pending] = {}
_IN_FLIGHT_LOCK = threading.Lock()


def _key(root: Path) -> Path:
    return root.absolute()


def join_in_flight(root: Path) -> None:
    """Waits for this process's save in flight under ``root`` (its errors go to its writer)."""
    with _IN_FLIGHT_LOCK:
        pending = _IN_FLIGHT.get(_key(root))
    if pending is not None and pending.thread is not threading.current_thread():
        pending.thread.join()


@jax.jit
def device_copy(tree: Any) -> Any:
    """A copy of every array on its own devices: buffers the next step cannot donate."""
    return jax.tree.map(jnp.copy, tree)


class Pending:
    """One save in flight: Orbax writes the state; this thread commits when it is done."""

    def __init__(
        self,
        tmp: Path,
        final: Path,
        ckptr: ocp.StandardCheckpointer,
        snapshot: Any,
        extra: Callable[[Path, Any], None] | None = None,
    ):
        self.tmp, self.final, self.ckptr = tmp, final, ckptr
        self.snapshot = snapshot  # the copy Orbax reads, alive until it is written
        self.extra = extra  # writes more files from the copy (the torch export), here
        self.error: BaseException | None = None
        self.removals: list[Path] = []  # asked for meanwhile: done once this one is committed
        self._lock = threading.Lock()
        self._removing = False
        self.thread = threading.Thread(target=self._run, name=f"coreshell-ckpt-{final.name}")

    def start(self) -> None:
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT[_key(self.final.parent)] = self
        self.thread.start()

    def defer_removal(self, path: Path) -> bool:
        """Queues ``path`` for removal after the commit; False when too late to queue."""
        with self._lock:
            if self._removing:
                return False
            self.removals.append(path)
            return True

    def _run(self) -> None:
        try:
            if self.extra is not None:  # meanwhile Orbax writes the state
                self.extra(self.tmp, self.snapshot)
            self.ckptr.wait_until_finished()
            files.commit(self.tmp, self.final)
        except BaseException as err:  # raised to the writer at its next save or teardown
            self.error = err
            with contextlib.suppress(Exception):  # Orbax may still write: wait before the
                self.ckptr.wait_until_finished()  # removal below (the first error is kept)
        finally:
            self.snapshot = None
            if self.tmp.exists():
                shutil.rmtree(self.tmp, ignore_errors=True)
            with self._lock:
                self._removing = True
            if self.error is None:  # a failed save keeps the older ones it would replace
                for path in self.removals:
                    files.discard(path)
            with _IN_FLIGHT_LOCK:
                if _IN_FLIGHT.get(_key(self.final.parent)) is self:
                    del _IN_FLIGHT[_key(self.final.parent)]
