"""Where a handed-over array came from, for the dtypes JAX cannot tell apart.

With x64 off, :func:`bridge.to_jax` hands an ``int64`` field over as ``int32`` (and
``uint64`` as ``uint32``), so in JAX a field that was ``int32`` on the host looks the same as
the ``int64`` one torch code normally gets. Where torch treats the two differently (class
indices: ``F.cross_entropy`` raises ``expected scalar type Long but found Int`` for
``int32``), the traced code asks :func:`handed_over` for the field's host dtype.

The same holds for ``float64`` (handed over as ``float32``): torch refuses a float64 field
(numpy arrays, Python floats through ``default_collate``) in a float32 ``nn.Linear``, so the
traced matmuls ask for it too.

Only leaves whose host dtype is ``int32``, ``uint32`` or ``float64`` are remembered (an
``int64`` label batch costs nothing), each for as long as its JAX array lives.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch

__all__ = ["Origin", "handed_over", "remember"]

AMBIGUOUS = frozenset({torch.int32, torch.uint32, torch.float64})
"""Host dtypes JAX shows as the narrowed form of a 64-bit one."""


class Origin(NamedTuple):
    """A handed-over leaf's batch field (its bridge path, e.g. ``y`` or ``1``) and host
    dtype."""

    field: str
    dtype: torch.dtype


_ORIGINS: dict[int, tuple[weakref.ref[Any], Origin]] = {}


def remember(name: str, dtype: torch.dtype, out: Any) -> None:
    """Records ``out`` (the JAX array of field ``name``, a host tensor of ``dtype`` before any
    narrowing) when ``dtype`` is one JAX shows ambiguously (:data:`AMBIGUOUS`)."""
    if dtype not in AMBIGUOUS:
        return
    key = id(out)
    _ORIGINS[key] = (weakref.ref(out, lambda _: _ORIGINS.pop(key, None)), Origin(name, dtype))


def handed_over(x: Any) -> Origin | None:
    """The host field and dtype of ``x``, an array :func:`bridge.to_jax` returned for an
    ``int32``/``uint32``/``float64`` tensor; ``None`` for anything else (a tracer, an array
    made in JAX, a field handed over as ``int64``).

    Example:
        >>> import bridge, torch
        >>> batch = bridge.to_jax({"y": torch.tensor([1, 2], dtype=torch.int32),
        ...                        "z": torch.tensor([1, 2])})
        >>> handed_over(batch["y"]), handed_over(batch["z"])
        (Origin(field='y', dtype=torch.int32), None)
    """
    entry = _ORIGINS.get(id(x))
    if entry is None or entry[0]() is not x:
        return None
    return entry[1]
