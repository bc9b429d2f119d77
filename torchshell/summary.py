"""A model summary of the JAX parameter tree (Lightning's own sees no torch params)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import jax


def _path(path: tuple[Any, ...]) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def param_summary(params: Any) -> str:
    """A text table: parameter count, bytes and sharding per top-level module, and totals.

    Example:
        >>> import jax.numpy as jnp
        >>> param_summary({"head": {"kernel": jnp.ones((3, 2))}}).splitlines()[2].split()[:2]
        ['head', '6']
    """
    rows: dict[str, list[Any]] = defaultdict(lambda: [0, 0, set()])
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = _path(path)
        top = name.split("/")[0] if "/" in name else name
        row = rows[top]
        row[0] += leaf.size
        row[1] += leaf.size * leaf.dtype.itemsize
        spec = getattr(getattr(leaf, "sharding", None), "spec", None)
        row[2].add(str(tuple(spec)) if spec is not None else "-")
    total = sum(r[0] for r in rows.values())
    nbytes = sum(r[1] for r in rows.values())
    lines = [f"{'module':<24}{'params':>12}{'bytes':>12}  sharding", "-" * 64]
    lines += [
        f"{k:<24}{r[0]:>12,}{_bytes(r[1]):>12}  {', '.join(sorted(r[2]))}" for k, r in rows.items()
    ]
    lines += ["-" * 64, f"{'total':<24}{total:>12,}{_bytes(nbytes):>12}"]
    return "\n".join(lines)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
