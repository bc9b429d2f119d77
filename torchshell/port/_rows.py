"""The rows all of a user's batch fields share (the port's placement and ``batch_size``).

Apart from :mod:`torchshell.port._adapter` so that the adapter's method groups
(:mod:`torchshell.port._user`), which it owns, may use it without importing it back.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["common_rows"]


def common_rows(tree: Any, axis: int = 0) -> int:
    """The size of ``axis`` shared by every array of ``tree`` with one, else 0.

    Example:
        >>> import torch
        >>> common_rows({"x": torch.ones(4, 2), "y": torch.ones(4)})
        4
        >>> common_rows([torch.ones(3), torch.ones(4)])
        0
    """
    sizes = {t.shape[axis] for t in jax.tree.leaves(tree) if getattr(t, "ndim", 0) > axis}
    return sizes.pop() if len(sizes) == 1 else 0
