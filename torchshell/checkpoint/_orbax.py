"""The Orbax side of checkpoints: the JAX state saved and restored, the directory committed."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
import torch
from lightning.pytorch import Callback
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

import bridge
import torchshell.checkpoint._files as files
import torchshell.checkpoint._packed_state as packed
from torchshell._errors import CheckpointError
from torchshell.checkpoint._async import Pending, device_copy, join_in_flight
from torchshell.distributed import barrier, is_main

MANIFEST = files.MANIFEST


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _savable(tree: Any) -> Any:
    """Typed PRNG keys become their raw uint32 data (what Orbax stores)."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def save_state(directory: Path, state: Any) -> None:
    """Saves a JAX pytree with Orbax (sharded arrays written by their owners), synchronously."""
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory.absolute(), _savable(state))
        ckptr.wait_until_finished()


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {bridge.path_str(path): tuple(leaf.shape) for path, leaf in flat}


def _tree_diff(saved: dict[str, tuple[int, ...]], wanted: dict[str, tuple[int, ...]]) -> str:
    """Paths only in the checkpoint, only in the model, and shapes that differ (params first)."""

    def first(paths: set[str]) -> list[str]:
        ordered = sorted(paths, key=lambda p: (not p.startswith("params/"), p))
        return ordered[:10] + ([f"... {len(ordered) - 10} more"] if len(ordered) > 10 else [])

    lines = []
    if missing := set(wanted) - set(saved):
        lines.append(f"in this model, not in the checkpoint: {first(missing)}")
    if extra := set(saved) - set(wanted):
        lines.append(f"in the checkpoint, not in this model: {first(extra)}")
    if differ := {p for p in set(saved) & set(wanted) if saved[p] != wanted[p]}:
        lines.append(
            "shapes differ (checkpoint vs model): "
            + ", ".join(f"{p} {saved[p]} vs {wanted[p]}" for p in first(differ) if p in saved)
        )
    return "; ".join(lines)


def restore_state(directory: Path, template: Any) -> Any:
    """Restores into the structure, dtypes and shardings of ``template``.

    Raises:
        CheckpointError: naming the paths only in the checkpoint, only in the model, and the
            shapes that differ, when the checkpoint belongs to another model.
    """
    savable = _savable(template)
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, savable)
    with ocp.StandardCheckpointer() as ckptr:
        metadata = ckptr.metadata(directory.absolute())
        layout = (metadata.custom_metadata or {}).get(packed.LAYOUT_KEY)
        if layout is None:  # saved array by array (several processes: synchronous saves)
            saved = _shapes(metadata.item_metadata.tree)
        else:
            saved = packed.saved_shapes(layout)
        diff = _tree_diff(saved, _shapes(target))
        if diff:
            raise CheckpointError(
                f"The checkpoint at {directory} belongs to another model: {diff}. Fix: resume "
                "with the model and optimizer config it was written with (its config.yaml), "
                "or start a new run (resume=null)."
            )
        if layout is None:
            raw = ckptr.restore(directory.absolute(), target)
        else:
            restored = ckptr.restore(directory.absolute(), packed.restore_target(layout, savable))
            raw = packed.unpack(restored, layout, savable)
    return jax.tree.map(
        lambda t, r: jax.random.wrap_key_data(r, impl=jax.random.key_impl(t)) if _is_key(t) else r,
        template,
        raw,
    )


# -- reading --------------------------------------------------------------------------------


def verify(directory: Path) -> str | None:
    """Why ``directory`` is not a complete, intact checkpoint; ``None`` when it is.

    A save of it in flight in this process is waited for first.

    Example:
        >>> import tempfile
        >>> verify(Path(tempfile.mkdtemp()))
        'no manifest.json (incomplete write)'
    """
    join_in_flight(Path(directory).parent)
    return files.problem_of(Path(directory))


def latest_checkpoint(directory: str | Path, *, log: Callable[[str], None] = print) -> Path | None:
    """The newest intact checkpoint under ``directory``; corrupt ones are reported and skipped.

    Example:
        >>> import tempfile
        >>> latest_checkpoint(tempfile.mkdtemp()) is None
        True
    """
    root = Path(directory)
    join_in_flight(root)
    for path in files.candidates(root):
        problem = files.problem_of(path)
        if problem is None:
            return path
        log(f"coreshell: skipping checkpoint {path}: {problem}; trying the previous one.")
    return None


def sweep_leftovers(directory: str | Path, *, log: Callable[[str], None] = print) -> list[Path]:
    """Removes the ``.tmp-*``/``.old-*`` leftovers a killed save or removal left behind.

    Only for the one run that writes ``directory`` (at its start): another process's save in
    progress there would be removed too.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> (root / ".tmp-epoch=0-step=10.ckpt-1a2b").mkdir()
        >>> [p.name for p in sweep_leftovers(root, log=lambda _: None)]
        ['.tmp-epoch=0-step=10.ckpt-1a2b']
    """
    root = Path(directory)
    join_in_flight(root)
    return files.sweep(root, log=log)


# -- writing --------------------------------------------------------------------------------


def _write_error(err: OSError, final: Path) -> CheckpointError:
    previous = latest_checkpoint(final.parent, log=lambda _: None)
    return CheckpointError(
        f"Writing checkpoint {final.name} failed: {err.strerror or err}. Nothing partial was "
        f"left; the newest intact checkpoint is {previous if previous is not None else 'none'}. "
        f"Fix: free space on {final.parent}, lower ckpt.keep, or move ckpt.dir."
    )


class OrbaxCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that writes checkpoint directories (see the module doc).

    Args:
        get_state: returns the current JAX state to save.
        set_restore: receives the Orbax directory to restore the JAX state from.
        on_save: called on the training thread with the temporary directory before
            commit, to add files.
        export: called with the temporary directory and the state saved, to add files
            derived from the state (the torch weights): in the commit thread, from the
            device copy Orbax writes, when saving asynchronously; on the training thread
            with the live state (every process: it may gather) when synchronously.
        async_save: write the state in the background (one JAX process; with several the
            saves are synchronous).
    """

    def __init__(
        self,
        get_state: Callable[[], Any],
        set_restore: Callable[[Path], None],
        on_save: Callable[[Path], None] | None = None,
        *,
        export: Callable[[Path, Any], None] | None = None,
        async_save: bool = True,
    ) -> None:
        self.get_state = get_state
        self.set_restore = set_restore
        self.on_save = on_save
        self.export = export
        self.async_save = async_save
        self._ckptr: ocp.StandardCheckpointer | None = None
        self._pending: Pending | None = None

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Writes the checkpoint directory; with several JAX processes every one calls it.

        Asynchronously (one process): returns once the state is copied and Orbax's write is
        started, ``on_save`` has run and ``lightning.pt`` is written; ``export`` and the
        commit follow in the background. Synchronously (several processes): Orbax writes
        the (sharded) state from every process into one directory, so the temporary
        directory has the same name everywhere; ``on_save`` and ``export`` run on every
        process too (they may gather sharded params, a collective) and write files on
        process 0 only. Process 0 alone writes
        ``lightning.pt`` and the manifest and renames the directory, between barriers.
        """
        final = Path(path)
        self.wait_until_finished()
        join_in_flight(final.parent)  # another writer's save of this directory
        try:
            if self.async_save and jax.process_count() == 1:
                self._save_async(checkpoint, final)
            else:
                self._save(checkpoint, final)
        except OSError as err:
            raise _write_error(err, final) from err

    def wait_until_finished(self) -> None:
        """Waits for the save in flight, if any, to be committed.

        Raises:
            CheckpointError: the background write or commit failed.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.thread.join()
        if isinstance(pending.error, OSError):
            raise _write_error(pending.error, pending.final) from pending.error
        if pending.error is not None:
            raise CheckpointError(
                f"Writing checkpoint {pending.final.name} in the background failed: "
                f"{pending.error!r}. Nothing partial was left. Fix: see the cause above."
            ) from pending.error

    def teardown(self) -> None:
        """End of fit (Lightning calls it): waits for the save in flight."""
        try:
            self.wait_until_finished()
        finally:
            if self._ckptr is not None:
                self._ckptr.close()
                self._ckptr = None

    def _save_async(self, checkpoint: dict[str, Any], final: Path) -> None:
        tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        if self._ckptr is None:
            self._ckptr = ocp.StandardCheckpointer()
        snapshot = device_copy(_savable(self.get_state()))
        saved, layout = packed.pack(snapshot)  # (Orbax's cost is per array: see the module)
        try:
            self._ckptr.save(
                (tmp / "state").absolute(), saved, custom_metadata={packed.LAYOUT_KEY: layout}
            )
            if self.on_save is not None:
                self.on_save(tmp)
            torch.save(checkpoint, tmp / "lightning.pt")
        except BaseException:
            try:
                self._ckptr.wait_until_finished()
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._pending = Pending(tmp, final, self._ckptr, snapshot, self.export)
        self._pending.start()

    def _save(self, checkpoint: dict[str, Any], final: Path) -> None:
        multi = jax.process_count() > 1
        main = is_main()
        suffix = "" if multi else f"-{uuid.uuid4().hex[:8]}"
        tmp = final.parent / f".tmp-{final.name}{suffix}"
        try:
            if main:
                final.parent.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
                tmp.mkdir()
            barrier(f"coreshell-ckpt-open-{final.name}")
            state = self.get_state()
            save_state(tmp / "state", state)
            if self.on_save is not None:
                self.on_save(tmp)
            if self.export is not None:
                self.export(tmp, state)
            barrier(f"coreshell-ckpt-written-{final.name}")
            if main:
                torch.save(checkpoint, tmp / "lightning.pt")
                files.commit(tmp, final)
            barrier(f"coreshell-ckpt-done-{final.name}")
        finally:
            if main and tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        directory = Path(path)
        self.wait_until_finished()
        problem = verify(directory)
        if problem is not None:
            raise CheckpointError(
                f"Checkpoint {directory} is not intact: {problem}. Fix: resume from an earlier "
                "checkpoint (resume=last skips damaged ones) or start a new run."
            )
        checkpoint = torch.load(directory / "lightning.pt", weights_only=True)
        self.set_restore(directory / "state")
        return checkpoint  # type: ignore[no-any-return]

    def remove_checkpoint(self, path: Any) -> None:
        """Hides, then deletes a checkpoint (Lightning's ``ckpt.keep``); one being written is
        finished first, an older one waits until the save in flight is committed."""
        if not is_main():  # every process is Lightning's "global zero" of its own run
            return
        target = Path(path)
        pending = self._pending
        if pending is not None and pending.final == target:
            self.wait_until_finished()
        elif pending is not None and pending.defer_removal(target):
            return
        files.discard(target)


class CheckpointOnSigterm(Callback):
    """Sweeps leftovers of killed saves at the start of fit; on SIGTERM (Lightning stops
    after the current batch), saves a checkpoint and waits for it to be committed."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.saved: Path | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and is_main():
            sweep_leftovers(self.directory)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) and pl_module.state is not None:
            path = self.directory / f"epoch={trainer.current_epoch}-step={trainer.global_step}.ckpt"
            trainer.save_checkpoint(path)
            io = trainer.strategy.checkpoint_io
            if isinstance(io, OrbaxCheckpointIO):
                io.wait_until_finished()
            self.saved = path
