"""A model summary of the JAX parameter tree (Lightning's own sees no torch params)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import jax


def _path(path: tuple[Any, ...]) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _spec(leaf: Any) -> str:
    """How a leaf is laid out: ``replicated``, ``('data', None)``-style axes, ``1 device``."""
    sharding = getattr(leaf, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return "-" if sharding is None else "1 device"
    if all(axis is None for axis in spec):  # P() or P(None, None): a full copy per device
        return "replicated"
    return str(tuple(spec))


def count(n: float) -> str:
    """A parameter count for people: ``85.0 K``, ``1.23 M``, ``6``.

    Example:
        >>> count(6), count(85_002), count(1_234_567), count(7.1e9)
        ('6', '85.0 K', '1.23 M', '7.10 B')
    """
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            value = n / size
            return f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f} {unit}"
    return f"{n:.0f}"


def param_summary(params: Any) -> str:
    """A text table: parameter count, bytes and sharding per top-level module, and totals.

    Example:
        >>> import jax.numpy as jnp
        >>> param_summary({"head": {"kernel": jnp.ones((3, 2))}}).splitlines()[2].split()
        ['head', '6', '24', 'B', '1', 'device']
    """
    rows: dict[str, list[Any]] = defaultdict(lambda: [0, 0, set()])
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = _path(path)
        top = name.split("/")[0] if "/" in name else name
        row = rows[top]
        row[0] += leaf.size
        row[1] += leaf.size * leaf.dtype.itemsize
        row[2].add(_spec(leaf))
    total = sum(r[0] for r in rows.values())
    nbytes = sum(r[1] for r in rows.values())
    lines = [f"{'module':<24}{'params':>12}{'bytes':>12}  sharding", "-" * 64]
    lines += [
        f"{k:<24}{count(r[0]):>12}{_bytes(r[1]):>12}  {', '.join(sorted(r[2]))}"
        for k, r in rows.items()
    ]
    lines += ["-" * 64, f"{'total':<24}{count(total):>12}{_bytes(nbytes):>12}"]
    return "\n".join(lines)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
