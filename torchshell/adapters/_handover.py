"""The hand-over plan of a run's batches, made from one batch: later batches are matched
against it, not prepared again.

A DataLoader yields batches of one form for a whole run: the same container (a dict with the
same keys, or a list/tuple of the same length) holding tensors. When a batch needed nothing
from the full preparation (:meth:`Adapter.prepare <torchshell.adapters.Adapter.prepare>`: no
field named, no numpy array or list converted, no host-only field, no lengths or mask to
check), it fixes the plan, and:

- a later batch of the same container, fields and dtypes is only named (:meth:`HandOver.named`);
- one that also has the same shapes (:meth:`HandOver.same`: every batch but a ragged last one)
  stacks with the others into a K-batch window as it is, and the window crosses to JAX in one
  :class:`bridge.BatchTransfer` decided once per plan (``steps_per_call="auto"``,
  :mod:`torchshell.module._windows`).

Any other batch takes the full path (and the plan is made anew from it): another container,
other keys, a field that is not a tensor, or a field of another dtype (a collate giving
``int32`` labels in some batches: the full path's checks see it, see ``check_batch``). The
matching is C-level work (``map``, ``operator.attrgetter``, tuple comparison): no Python call
per field.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import jax
import torch

from torchshell.adapters._batches import HostOnly
from torchshell.adapters._flax_checks import _checked_fields

__all__ = ["HandOver", "sizeless", "stack_form"]

_TENSORS = (torch.Tensor, jax.Array)
_DTYPE = operator.attrgetter("dtype")
_EXACT = operator.attrgetter("__class__", "dtype", "shape")


class HandOver:
    """A batch's container type, its keys (a dict's) or length (a list/tuple's), the names of
    a list/tuple's positions, its fields' dtypes and their classes and shapes.

    Example:
        >>> batch = (torch.ones(2, 3), torch.zeros(2))
        >>> plan = HandOver.learn(batch, {"x": batch[0], "y": batch[1]}, ("x", "y"))
        >>> sorted(plan.named(batch)), sorted(plan.same(batch))
        (['x', 'y'], ['x', 'y'])
        >>> plan.named([batch[0]]) is None  # another form: the full path
        True
        >>> plan.named((batch[0].double(), batch[1])) is None  # a field of another dtype
        True
        >>> short = (torch.ones(1, 3), torch.zeros(1))  # a ragged last batch: named, not same
        >>> sorted(plan.named(short)), plan.same(short)
        (['x', 'y'], None)
    """

    __slots__ = ("dtypes", "exact", "keys", "kind", "names", "order")

    def __init__(self, kind: type, names: tuple[str, ...] | None, batch: Any) -> None:
        self.kind: Any = kind  # (Any: a `type(batch) is` test narrows nothing)
        self.names = names  # a list/tuple's positions' names (None: a dict)
        self.keys = frozenset(batch) if names is None else len(batch)  # (a list's: its length)
        self.order = tuple(batch) if names is None else ()  # a dict's keys, as recorded
        values = [batch[k] for k in self.order] if names is None else batch
        self.dtypes = tuple(map(_DTYPE, values))
        self.exact = tuple(map(_EXACT, values))  # (class, dtype, shape) of each field

    @classmethod
    def learn(cls, batch: Any, prepared: Any, batch_keys: Sequence[str]) -> HandOver | None:
        """The plan of ``batch`` when its preparation (``prepared``) only named its tensors,
        else ``None``."""
        kind = type(batch)
        if not isinstance(prepared, dict) or not _all_tensors(prepared.values()):
            return None
        if any(_checked_fields(tuple(prepared))):  # lengths and masks: checked per batch
            return None
        if kind is dict and prepared is batch:
            return cls(dict, None, batch)
        if kind in (list, tuple) and _all_tensors(batch) and len(batch) <= len(batch_keys):
            return cls(kind, tuple(batch_keys[: len(batch)]), batch)
        return None

    def _values(self, batch: Any) -> Any:
        """The fields of a batch of the plan's container, in the plan's order (``None``: other
        keys or length)."""
        if type(batch) is not self.kind:
            return None
        if self.names is None:
            return map(batch.__getitem__, self.order) if batch.keys() == self.keys else None
        return batch if len(batch) == self.keys else None

    def same(self, batch: Any) -> dict[str, Any] | None:
        """``batch`` named when it matches the plan exactly (container, keys, each field's
        class, dtype and shape); else ``None``."""
        if type(batch) is not self.kind:  # (as _values, inline: this runs for every batch)
            return None
        values: Any
        if self.names is None:
            if batch.keys() != self.keys:
                return None
            values = map(batch.__getitem__, self.order)
        elif len(batch) == self.keys:
            values = batch
        else:
            return None
        try:
            if tuple(map(_EXACT, values)) != self.exact:
                return None
        except AttributeError:  # (a field that is not an array)
            return None
        return batch if self.names is None else dict(zip(self.names, batch, strict=True))

    def named(self, batch: Any) -> dict[str, Any] | None:
        """``batch`` named, when it has this form and holds only tensors of the learned
        dtypes (any shapes); else ``None``."""
        if (values := self._values(batch)) is None:
            return None
        values = tuple(values)
        if not _all_tensors(values) or tuple(map(_DTYPE, values)) != self.dtypes:
            return None
        return batch if self.names is None else dict(zip(self.names, batch, strict=True))


def _all_tensors(values: Any) -> bool:
    """Whether every value is a tensor or an array (C-level: no call per value)."""
    return all(map(isinstance, values, repeat(_TENSORS)))


def stack_form(batch: Any) -> Any:
    """What must agree for batches to stack into one window: the tree, each field's per-row
    shape and dtype (the window's batches that do not all match the plan exactly)."""
    if isinstance(batch, dict) and _all_tensors(batch.values()):
        return frozenset((k, v.shape[1:], v.dtype) for k, v in batch.items())
    leaves, tree = jax.tree.flatten(sizeless(batch))
    return tree, [(t.shape[1:], t.dtype) if isinstance(t, torch.Tensor) else t for t in leaves]


def sizeless(batch: Any) -> Any:
    """``batch`` with its :class:`HostOnly` stand-ins' lengths dropped, so that the batches
    of a window (a short one padded) stack with one structure (the Flax step never reads a
    host field)."""
    return jax.tree.map(
        lambda x: HostOnly(x.path, x.kind) if isinstance(x, HostOnly) else x,
        batch,
        is_leaf=lambda x: isinstance(x, HostOnly),
    )
