"""Run tags that say where a run came from: code version, library versions, devices, mesh."""

from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import jax

PACKAGES = ("jax", "jaxlib", "flax", "optax", "torch", "torchaudio", "lightning", "mlflow")


def git_commit(repo_dir: str | Path | None = None) -> tuple[str, bool] | None:
    """``(commit, dirty)`` of the git checkout holding ``repo_dir`` (the cwd), or None."""
    cwd = str(repo_dir) if repo_dir is not None else None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10
        )
        if commit.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return commit.stdout.strip(), bool(status.stdout.strip())


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def run_tags(mesh: Any = None, *, repo_dir: str | Path | None = None) -> dict[str, str]:
    """Tags for a run: git commit, library versions, devices, mesh shape, process count.

    Args:
        mesh: the ``jax.sharding.Mesh`` the run trains on (its axes become a tag), or None.
        repo_dir: where to look for a git checkout (default: the working directory).

    Returns:
        ``{tag: value}``: ``mlflow.source.git.commit`` (when in a checkout),
        ``coreshell.git.dirty``, ``versions.<package>``, ``devices.kind``, ``devices.count``,
        ``devices.local_count``, ``devices.platform``, ``processes.count``, ``mesh.shape``.

    Example:
        >>> tags = run_tags()
        >>> tags["versions.mlflow"].startswith("3."), int(tags["devices.count"]) >= 1
        (True, True)
    """
    devices = jax.devices()
    tags = {f"versions.{p}": _version(p) for p in PACKAGES}
    tags |= {
        "devices.platform": devices[0].platform,
        "devices.kind": devices[0].device_kind,
        "devices.count": str(jax.device_count()),
        "devices.local_count": str(jax.local_device_count()),
        "processes.count": str(jax.process_count()),
    }
    if mesh is not None:
        tags["mesh.shape"] = str(dict(mesh.shape))
    git = git_commit(repo_dir)
    if git is not None:
        tags["mlflow.source.git.commit"] = git[0]
        tags["coreshell.git.dirty"] = str(git[1]).lower()
    return tags
