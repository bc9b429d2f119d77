"""Batches as the user's DataLoader yields them, named for the Flax path.

A Flax model's ``inputs`` and a JAX loss read batch fields by key. A ``TensorDataset``
collates to a list ``[x, y]`` (a tuple or namedtuple from other datasets), so a sequence
batch is named position by position with ``batch_keys`` (``("x", "y")`` by default, the
convention the losses use); a namedtuple or a dataclass keeps its field names. Dicts pass
unchanged (other mappings, e.g. transformers' ``BatchEncoding``, become dicts); one tensor
(``DataLoader(x)``: prediction, an autoencoder) is the first position, as ``[x]`` would be.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import torch
from flax.errors import FlaxError

import bridge
from bridge import rows  # (the one definition, re-exported for this package's modules)
from jaxcore import BatchError
from torchshell.adapters._containers import all_tensors, containers_as_nodes, has_arrays

Batch = Mapping[str, Any]
Signature = dict[str, tuple[tuple[int, ...], torch.dtype]]

__all__ = [
    "HostOnly",
    "MicroBatches",
    "check_fields",
    "float_fields",
    "host_fields_back",
    "host_fields_out",
    "name_batch",
    "positional_keys",
    "refuse_no_rows",
    "rows",
    "signature",
]


def name_batch(batch: Any, batch_keys: Sequence[str] = ("x", "y")) -> dict[str, Any]:
    """The batch as a dict of named fields (a dict batch is returned as it is).

    Args:
        batch: a mapping, a list/tuple of tensors (``TensorDataset``), a namedtuple or a
            dataclass (named by its fields), or one tensor (named ``batch_keys[0]``).
        batch_keys: names of the positions of a list/tuple batch, in order.

    Returns:
        ``{name: tensor}``.

    Raises:
        BatchError: a batch that is neither a mapping nor a sequence, or a sequence with
            more positions than ``batch_keys`` names.

    Example:
        >>> import torch
        >>> sorted(name_batch([torch.ones(2, 3), torch.zeros(2)]))
        ['x', 'y']
    """
    if isinstance(batch, Mapping):
        return batch if isinstance(batch, dict) else dict(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return dict(zip(batch._fields, batch, strict=True))
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    if isinstance(batch, (list, tuple)):
        if len(batch) > len(batch_keys):
            raise BatchError(
                f"The DataLoader yields a {type(batch).__name__} of {len(batch)} fields, but "
                f"batch_keys names only {len(batch_keys)}: {tuple(batch_keys)}. Fix: pass "
                f"JaxModule(..., batch_keys=(...)) with {len(batch)} names, in the order the "
                "Dataset returns them (inputs= and the loss read those names)."
            )
        return dict(zip(batch_keys, batch, strict=False))
    if isinstance(batch, torch.Tensor | np.ndarray) and batch.ndim and batch_keys:
        return {batch_keys[0]: batch}  # DataLoader(x): its rows, as a TensorDataset(x)'s [x]
    raise BatchError(
        f"Expected a batch collated to a dict, a list/tuple (e.g. from a TensorDataset), a "
        f"namedtuple or a dataclass of tensors, got {type(batch).__name__}. Fix: return "
        "tensors from the Dataset (or a collate_fn that builds a dict of tensors)."
    )


def positional_keys(inputs: Sequence[int]) -> tuple[str, ...]:
    """Names for a tuple batch whose model inputs are given by position.

    The positions up to the last input are the model's inputs (``x``, ``x1``, ``x2``...),
    the next one is the loss's target ``y``.

    Example:
        >>> positional_keys((0,)), positional_keys((0, 1))
        (('x', 'y'), ('x', 'x1', 'y'))
    """
    last = max(inputs, default=0)
    return (*("x" if i == 0 else f"x{i}" for i in range(last + 1)), "y")


def refuse_no_rows(batch: Batch) -> None:
    """Refuses a batch with no rows (:func:`bridge.rows`: no tensor with a batch dimension).

    Example:
        >>> import torch
        >>> refuse_no_rows({"x": torch.ones(5, 2)})
        >>> refuse_no_rows({"name": "a"})
        Traceback (most recent call last):
        ...
        jaxcore._errors.BatchError: The batch has no tensor field with a batch dimension: ...
    """
    if bridge.rows(batch):
        return
    raise BatchError(
        f"The batch has no tensor field with a batch dimension: {sorted(batch)}. Fix: "
        "return tensors from the Dataset and let the DataLoader collate them."
    )


def signature(batch: Batch) -> Signature:
    """Per-row shape and dtype of every field (what a compiled step is specialised on).

    Example:
        >>> import torch
        >>> signature({"x": torch.ones(4, 3)})
        {'x': ((3,), torch.float32)}
    """
    return {
        name: (tuple(t.shape[1:]), t.dtype)
        for name, t in batch.items()
        if isinstance(t, torch.Tensor)
    }


@contextlib.contextmanager
def check_fields(expected: Signature, batch: Batch) -> Iterator[None]:
    """Turns a trace-time failure on a changed batch into an error naming the field.

    Example:
        >>> import torch
        >>> with check_fields({"x": ((3,), torch.float32)}, {"x": torch.ones(2, 3)}):
        ...     pass
    """
    try:
        yield
    except (TypeError, ValueError, FlaxError) as err:
        got = signature(batch)
        diff = [
            f"{name!r}: expected per-row shape {want[0]} {want[1]}, got "
            + (f"{got[name][0]} {got[name][1]}" if name in got else "no such field")
            for name, want in expected.items()
            if got.get(name) != want
        ]
        if not diff:
            raise
        raise BatchError(
            "The batch no longer matches the one the model was built from: "
            + "; ".join(diff)
            + ". Fix: keep every field's per-row shape and dtype fixed "
            "(pad variable lengths to buckets in the collate)."
        ) from err


def float_fields(batch: Any) -> list[str]:
    """The names of a batch's floating tensor fields, in ``jax.tree.leaves`` order.

    The compiled step checks these for NaN/Inf itself (under ``nan_policy="stop"``, see
    :func:`jaxcore.guard.input_where`) and remembers a field by its index among them; this
    names it in the error.

    Example:
        >>> import torch
        >>> float_fields({"y": torch.ones(2), "ids": torch.zeros(2, dtype=torch.int64),
        ...               "x": torch.ones(2, 3)})
        ["['x']", "['y']"]
    """
    return [
        jax.tree_util.keystr(path)
        for path, t in jax.tree_util.tree_leaves_with_path(batch)
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]


class HostOnly:
    """Stands in, in a traced step, for a batch field that is not a tensor (ids, file names).

    A ``LightningModule``'s batch may carry strings or other Python values next to its
    tensors (``{"tokens": ..., "id": ["s0", "s1"]}``); plain Lightning hands them to
    ``training_step``, which usually ignores them. A compiled step takes arrays only, and such
    values change every batch, so they cannot be compiled in as constants either: the field
    is replaced by this stand-in, a pytree node without leaves. Its length (a list of ids
    has one per row: ``self.log(..., batch_size=len(batch["id"]))``) is part of its static
    structure, as the tensors' shapes are; any other use in the step raises an error naming
    the field.

    Example:
        >>> h = HostOnly("['id']", "list", 2)
        >>> len(h)
        2
        >>> h[0]
        Traceback (most recent call last):
        ...
        jaxcore._errors.BatchError: The batch field ['id'] holds a list, not a tensor: ...
    """

    __slots__ = ("kind", "path", "size")

    def __init__(self, path: str, kind: str, size: int | None = None) -> None:
        self.path, self.kind, self.size = path, kind, size

    def __len__(self) -> int:
        if self.size is None:
            return self._refuse()
        return self.size

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise BatchError(
            f"The batch field {self.path} holds a {self.kind}, not a tensor: a compiled step "
            "takes arrays only, so the traced training/validation step cannot read it. Fix: "
            "turn it into a tensor in the Dataset or collate (e.g. class ids instead of "
            "names), or read it outside the step (e.g. in on_train_batch_end, which gets the "
            "batch as the DataLoader made it)."
        )

    __iter__ = __getitem__ = __contains__ = __bool__ = _refuse
    __eq__ = __add__ = __mul__ = __call__ = _refuse  # type: ignore[assignment]
    __hash__ = None  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._refuse()

    def __repr__(self) -> str:
        return f"HostOnly({self.path}, {self.kind})"


jax.tree_util.register_pytree_node(
    HostOnly, lambda h: ((), (h.path, h.kind, h.size)), lambda aux, _: HostOnly(*aux)
)


class MicroBatches(tuple):  # type: ignore[type-arg]
    """An accumulation window's batches whose shapes differ (a ragged last batch in it):
    handed to the step as they are, which unrolls them (``unrolled_micro``) instead of
    stacking. A pytree of its items; a plain tuple stays the user's own batch structure.

    Example:
        >>> jax.tree.leaves(MicroBatches(([1, 2], [3])))
        [1, 2, 3]
    """

    __slots__ = ()


jax.tree_util.register_pytree_node(
    MicroBatches, lambda t: (tuple(t), None), lambda _, items: MicroBatches(items)
)


def host_fields_out(batch: Any) -> Any:
    """The batch with every leaf that is not a tensor or array replaced by :class:`HostOnly`.

    Example:
        >>> import torch
        >>> host_fields_out({"x": torch.ones(2), "id": ["a", "b"]})["id"]
        HostOnly(['id'], list)
    """

    if all_tensors(batch):  # the common case, checked in ~1 us (no tree rebuilt)
        return batch
    containers_as_nodes(batch)

    def swap(path: Any, x: Any) -> Any:
        if x is None or isinstance(x, torch.Tensor | jax.Array):
            return x
        size = len(x) if isinstance(x, list | tuple) else None
        name = jax.tree_util.keystr(path) or "(the whole batch)"
        return HostOnly(name, type(x).__name__, size)

    return jax.tree_util.tree_map_with_path(swap, batch, is_leaf=_host_leaf)


def _host_leaf(x: Any) -> bool:
    """A list or tuple without tensors is one host field (a batch's ids), not a node."""
    return isinstance(x, list | tuple) and bool(x) and not has_arrays(x)


def host_fields_back(out: Any, batch: Any) -> Any:
    """``out`` with each :class:`HostOnly` put back to the batch value it stands for.

    A step may return a field it did not compute on (``predict_step`` returning the batch's
    ids beside its predictions): the compiled step returns the stand-in, and the caller gets
    the DataLoader's value, as plain Lightning returns it.

    Example:
        >>> import torch
        >>> batch = {"x": torch.ones(2), "id": ["a", "b"]}
        >>> out = {"id": host_fields_out(batch)["id"], "pred": torch.zeros(2)}
        >>> host_fields_back(out, batch)["id"]
        ['a', 'b']
    """
    stand_ins = jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, HostOnly))
    if not any(isinstance(x, HostOnly) for x in stand_ins):
        return out
    values = {}
    for path, value in jax.tree_util.tree_flatten_with_path(batch, is_leaf=_host_leaf)[0]:
        values[jax.tree_util.keystr(path) or "(the whole batch)"] = value
    return jax.tree.map(
        lambda x: values.get(x.path, x) if isinstance(x, HostOnly) else x,
        out,
        is_leaf=lambda x: isinstance(x, HostOnly),
    )
