"""Batch fields a collate gives as numpy arrays or Python lists of numbers, as tensors."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch

import bridge
from torchshell.adapters._batches import _host_leaf
from torchshell.adapters._containers import all_tensors, containers_as_nodes

__all__ = ["arrays_as_tensors"]

_NUMERIC = frozenset("biufc")  # numpy kinds: bool, int, uint, float, complex
_ML_NAMES = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})  # ml_dtypes (kind "V")


def arrays_as_tensors(batch: Any) -> Any:
    """The batch with numeric numpy arrays and lists of numbers as torch tensors.

    A collate may return numpy arrays (``{"x": np.stack(...)}``) or Python lists of numbers
    (``{"y": [0, 2, 1]}``): data a JAX step can take. Each becomes the tensor of the same
    values and dtype (a numpy array through :func:`bridge.as_torch`, a view of its buffer; a
    list through ``np.asarray``, as ``default_collate`` would: Python floats as float64 and
    ints as int64, narrowed with a range check at the hand-over) when it has one item per row
    of the batch. Strings, ragged lists, lists of another length and other Python values
    (a Python or numpy scalar too) stay host-only fields (:func:`host_fields_out`).

    Example:
        >>> import numpy as np
        >>> batch = {"x": np.ones((2, 3), np.float32), "y": [1, 0], "id": ["a", "b"]}
        >>> out = arrays_as_tensors(batch)
        >>> out["x"].dtype, out["y"].tolist(), out["id"]
        (torch.float32, [1, 0], ['a', 'b'])
    """
    if all_tensors(batch):  # the common case: nothing to convert
        return batch
    containers_as_nodes(batch)
    n = bridge.rows(batch)  # (a list of another length is not per-row data: left as it is)

    def convert(x: Any) -> Any:
        if isinstance(x, np.ndarray) and x.ndim:
            numeric = x.dtype.kind in _NUMERIC or x.dtype.name in _ML_NAMES
            return bridge.as_torch(x) if numeric else x
        if isinstance(x, list | tuple) and _host_leaf(x):
            try:
                arr = np.asarray(x)
            except ValueError:  # ragged
                return x
            if arr.ndim and arr.dtype.kind in _NUMERIC and (not n or len(arr) == n):
                return torch.from_numpy(arr)
        return x

    return jax.tree.map(convert, batch, is_leaf=_host_leaf)
