"""The rows all of a user's batch fields share (the port's placement and ``batch_size``):
``common_rows(tree, axis=0)`` is :func:`jaxcore.rows`, 0 where the arrays of ``tree`` do not
share one size of ``axis``.

A name for the adapter's method groups (:mod:`torchshell.port._user`) that import it; the
definition is jaxcore's (``tests/test_layout.py``: one definition of rows).

Example:
    >>> import torch
    >>> common_rows({"x": torch.ones(4, 2), "y": torch.ones(4)})
    4
    >>> common_rows([torch.ones(3), torch.ones(4)])
    0
"""

from __future__ import annotations

import functools

import jaxcore

__all__ = ["common_rows"]

common_rows = functools.partial(jaxcore.rows, default=0)
