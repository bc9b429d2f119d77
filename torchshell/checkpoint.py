"""Checkpoints of a :class:`JaxModule` run: the JAX state through Orbax, the loop through Lightning.

Each checkpoint is a directory written atomically (a temporary directory, then a rename)::

    epoch=0-step=100.ckpt/
        state/            Orbax: the whole jaxcore TrainState
        lightning.pt      Lightning's loop, callback and DataLoader state; RNG states
                          (tensors and plain types only: loaded with weights_only=True)
        export/model.safetensors, config.yaml   written by an ``on_save`` hook, if any
        manifest.json     sha256 of every file above, written last

With several JAX processes (``torchshell.distributed``) every process writes its shards of the
state into the same directory; process 0 writes the other files and commits the rename.
"""

from __future__ import annotations

import hashlib
import json
import re
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

from torchshell._errors import CheckpointError
from torchshell.distributed import barrier, is_main

MANIFEST = "manifest.json"
_STEP = re.compile(r"step=(\d+)")


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _savable(tree: Any) -> Any:
    """Typed PRNG keys become their raw uint32 data (what Orbax stores)."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def save_state(directory: Path, state: Any) -> None:
    """Saves a JAX pytree with Orbax (sharded arrays written by their owners)."""
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory.absolute(), _savable(state))
        ckptr.wait_until_finished()


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        "/".join(
            str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path
        ): tuple(leaf.shape)
        for path, leaf in flat
    }


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
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, _savable(template))
    with ocp.StandardCheckpointer() as ckptr:
        saved = _shapes(ckptr.metadata(directory.absolute()).item_metadata.tree)
        diff = _tree_diff(saved, _shapes(target))
        if diff:
            raise CheckpointError(
                f"The checkpoint at {directory} belongs to another model: {diff}. Fix: resume "
                "with the model and optimizer config it was written with (its config.yaml), "
                "or start a new run (resume=null)."
            )
        raw = ckptr.restore(directory.absolute(), target)
    return jax.tree.map(
        lambda t, r: jax.random.wrap_key_data(r, impl=jax.random.key_impl(t)) if _is_key(t) else r,
        template,
        raw,
    )


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def verify(directory: Path) -> str | None:
    """Why ``directory`` is not a complete, intact checkpoint; ``None`` when it is."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return "no manifest.json (incomplete write)"
    try:
        expected = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return "manifest.json is not valid JSON"
    found = {str(p.relative_to(directory)): p for p in _files(directory)}
    missing = sorted(set(expected) - set(found))
    if missing:
        return f"missing files {missing}"
    bad = [name for name, digest in expected.items() if _digest(found[name]) != digest]
    return f"checksum mismatch in {bad}" if bad else None


def _hide(path: Path) -> Path | None:
    """Renames ``path`` to a hidden name no reader picks (one atomic step); ``None`` if absent."""
    trash = path.parent / f".old-{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        path.replace(trash)
    except FileNotFoundError:
        return None
    return trash


def _discard(path: Path) -> None:
    """Deletes a checkpoint so that a kill at any point leaves it whole or out of sight: the
    rename hides it first (a bare ``rmtree`` killed midway leaves half a checkpoint)."""
    trash = _hide(path)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def latest_checkpoint(directory: str | Path, *, log: Callable[[str], None] = print) -> Path | None:
    """The newest intact checkpoint under ``directory``; corrupt ones are reported and skipped.

    Example:
        >>> import tempfile
        >>> latest_checkpoint(tempfile.mkdtemp()) is None
        True
    """
    root = Path(directory)
    if not root.is_dir():
        return None
    candidates = [
        p
        for p in root.iterdir()
        if p.is_dir() and _STEP.search(p.name) and not p.name.startswith(".")
    ]
    for path in sorted(
        candidates,
        key=lambda p: int(_STEP.search(p.name).group(1)),  # type: ignore[union-attr]
        reverse=True,
    ):
        problem = verify(path)
        if problem is None:
            return path
        log(f"coreshell: skipping checkpoint {path}: {problem}; trying the previous one.")
    return None


class OrbaxCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that writes checkpoint directories (see the module doc).

    Args:
        get_state: returns the current JAX state to save.
        set_restore: receives the Orbax directory to restore the JAX state from.
        on_save: called with the temporary directory before commit, to add files
            (e.g. the exported torch weights and the config).
    """

    def __init__(
        self,
        get_state: Callable[[], Any],
        set_restore: Callable[[Path], None],
        on_save: Callable[[Path], None] | None = None,
    ) -> None:
        self.get_state = get_state
        self.set_restore = set_restore
        self.on_save = on_save

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Writes the checkpoint directory; with several JAX processes every one calls it.

        Orbax writes the (sharded) state from every process into one directory, so the
        temporary directory has the same name everywhere; ``on_save`` runs on every process
        too (it may gather sharded params, a collective) and writes files on process 0 only.
        Process 0 alone writes ``lightning.pt`` and the manifest and renames the directory,
        between barriers.
        """
        try:
            self._save(checkpoint, Path(path))
        except OSError as err:
            previous = latest_checkpoint(Path(path).parent, log=lambda _: None)
            raise CheckpointError(
                f"Writing checkpoint {Path(path).name} failed: {err.strerror or err}. Nothing "
                "partial was left; the newest intact checkpoint is "
                f"{previous if previous is not None else 'none'}. Fix: free space on "
                f"{Path(path).parent}, lower ckpt.keep, or move ckpt.dir."
            ) from err

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
            save_state(tmp / "state", self.get_state())
            if self.on_save is not None:
                self.on_save(tmp)
            barrier(f"coreshell-ckpt-written-{final.name}")
            if main:
                torch.save(checkpoint, tmp / "lightning.pt")
                digests = {str(p.relative_to(tmp)): _digest(p) for p in _files(tmp)}
                (tmp / MANIFEST).write_text(json.dumps(digests, indent=1))
                trash = _hide(final)
                tmp.replace(final)
                if trash is not None:
                    shutil.rmtree(trash, ignore_errors=True)
            barrier(f"coreshell-ckpt-done-{final.name}")
        finally:
            if main and tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        directory = Path(path)
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
        if is_main():  # every process is Lightning's "global zero" of its own run
            _discard(Path(path))


class CheckpointOnSigterm(Callback):
    """On SIGTERM (Lightning stops after the current batch), saves a checkpoint first."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.saved: Path | None = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) and pl_module.state is not None:
            path = self.directory / f"epoch={trainer.current_epoch}-step={trainer.global_step}.ckpt"
            trainer.save_checkpoint(path)
            self.saved = path
