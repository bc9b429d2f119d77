"""The files of checkpoint directories: manifest, verification, hiding, removal, leftovers.

A checkpoint directory is complete when its ``manifest.json`` (written last, before the
rename that publishes it) lists the sha256 of every other file. Names starting with ``.``
are never picked: ``.tmp-*`` is a save in progress (or killed), ``.old-*`` a checkpoint being
replaced or removed.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

MANIFEST = "manifest.json"
STEP = re.compile(r"step=(\d+)")
LEFTOVER_PREFIXES = (".tmp-", ".old-")


def digest(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def files(directory: Path) -> list[Path]:
    """Every file under ``directory`` but the manifest, sorted."""
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path) -> None:
    """Writes the manifest of ``directory``: the last file of a checkpoint."""
    digests = {str(p.relative_to(directory)): digest(p) for p in files(directory)}
    (directory / MANIFEST).write_text(json.dumps(digests, indent=1))


def problem_of(directory: Path) -> str | None:
    """Why ``directory`` is not a complete, intact checkpoint; ``None`` when it is."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return "no manifest.json (incomplete write)"
    try:
        expected = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return "manifest.json is not valid JSON"
    found = {str(p.relative_to(directory)): p for p in files(directory)}
    missing = sorted(set(expected) - set(found))
    if missing:
        return f"missing files {missing}"
    bad = [name for name, d in expected.items() if digest(found[name]) != d]
    return f"checksum mismatch in {bad}" if bad else None


def hide(path: Path) -> Path | None:
    """Renames ``path`` to a hidden name no reader picks (one atomic step); ``None`` if absent."""
    trash = path.parent / f".old-{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        path.replace(trash)
    except FileNotFoundError:
        return None
    return trash


def discard(path: Path) -> None:
    """Deletes a checkpoint so that a kill at any point leaves it whole or out of sight: the
    rename hides it first (a bare ``rmtree`` killed midway leaves half a checkpoint)."""
    trash = hide(path)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def commit(tmp: Path, final: Path) -> None:
    """Publishes a fully written ``tmp`` as ``final``: manifest, then one rename."""
    write_manifest(tmp)
    trash = hide(final)  # a checkpoint of the same name (e.g. rewritten): out of sight first
    tmp.replace(final)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def sweep(directory: Path, *, log: Callable[[str], None] = print) -> list[Path]:
    """Removes ``.tmp-*``/``.old-*`` leftovers of killed saves and removals in ``directory``."""
    if not directory.is_dir():
        return []
    swept = sorted(p for p in directory.iterdir() if p.name.startswith(LEFTOVER_PREFIXES))
    for path in swept:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if swept:
        log(
            f"coreshell: removed {len(swept)} leftover(s) of an interrupted checkpoint save or "
            f"removal in {directory}: {[p.name for p in swept]}"
        )
    return swept


def candidates(root: Path) -> list[Path]:
    """Checkpoint directories under ``root`` (visible names with a step), newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP.search(p.name)]
    visible = [p for p in found if not p.name.startswith(".")]
    return sorted(visible, key=lambda p: int(STEP.search(p.name).group(1)), reverse=True)  # type: ignore[union-attr]
