"""The form of a run's batches, learned from one batch: later batches of that form pass
:meth:`Adapter.prepare <torchshell.adapters.Adapter.prepare>` after one structural check.

A DataLoader yields batches of one form for a whole run: the same container (a dict with the
same keys, or a list/tuple of the same length) holding tensors. When a batch of that form
needed nothing from the full preparation (no field named, no numpy array or list converted,
no host-only field, no lengths or mask to check), the next batches of the same form are only
named. Any other batch takes the full path (and its form is learned anew): another container,
other keys, a field that is not a tensor, or a field of another dtype (a collate giving
``int32`` labels in some batches: the full path's checks see it, see ``check_batch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torchshell.adapters._containers import all_tensors
from torchshell.adapters._flax_checks import _checked_fields

__all__ = ["BatchForm"]


@dataclass(frozen=True)
class BatchForm:
    """A batch's container type, its keys (a dict's) or length (a list/tuple's), the names of
    a list/tuple's positions and its fields' dtypes.

    Example:
        >>> import torch
        >>> batch = (torch.ones(2, 3), torch.zeros(2))
        >>> form = BatchForm.learn(batch, {"x": batch[0], "y": batch[1]}, ("x", "y"))
        >>> sorted(form.named(batch))
        ['x', 'y']
        >>> form.named([batch[0]]) is None  # another form: the full path
        True
        >>> form.named((batch[0].double(), batch[1])) is None  # a field of another dtype
        True
    """

    kind: type
    keys: Any  # a dict's keys, or the number of a list/tuple's positions
    names: tuple[str, ...] | None  # a list/tuple's positions' names
    dtypes: tuple[Any, ...] = ()  # each field's (a dict's: by key, ``(key, dtype)``)

    @classmethod
    def learn(cls, batch: Any, prepared: Any, batch_keys: Sequence[str]) -> BatchForm | None:
        """The form of ``batch`` when its preparation (``prepared``) only named its tensors,
        else ``None``."""
        kind = type(batch)
        if not isinstance(prepared, dict) or not all_tensors(prepared):
            return None
        if any(_checked_fields(tuple(prepared))):  # lengths and masks: checked per batch
            return None
        if kind is dict and prepared is batch:
            return cls(dict, frozenset(batch), None, tuple((k, v.dtype) for k, v in batch.items()))
        if kind in (list, tuple) and all_tensors(batch) and len(batch) <= len(batch_keys):
            names = tuple(batch_keys[: len(batch)])
            return cls(kind, len(batch), names, tuple(t.dtype for t in batch))
        return None

    def named(self, batch: Any) -> dict[str, Any] | None:
        """``batch`` named, when it has this form and holds only tensors of the learned dtypes;
        else ``None``."""
        if type(batch) is not self.kind or not all_tensors(batch):
            return None
        fields: Any = batch
        if self.names is None:
            same = fields.keys() == self.keys and all(fields[k].dtype == d for k, d in self.dtypes)
            return fields if same else None
        if len(fields) != self.keys or any(
            t.dtype != d for t, d in zip(fields, self.dtypes, strict=True)
        ):
            return None
        return dict(zip(self.names, fields, strict=True))
