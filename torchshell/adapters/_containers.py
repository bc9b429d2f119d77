"""A batch's own container types (transformers' ``BatchEncoding``, any ``Mapping``, a
dataclass) as pytree nodes, so the tensors inside them reach the step; and the quick checks of
a batch's leaves the hand-over runs on every batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import torch
import torch.utils._pytree as torch_pytree

__all__ = ["all_tensors", "containers_as_nodes", "has_arrays"]

_NODES: set[type] = set()  # container types registered below


def containers_as_nodes(batch: Any) -> None:
    """Makes the batch's own container types pytree nodes, so their tensors reach the step.

    A collate may build a dict-like object (transformers' ``BatchEncoding``, what its
    tokenizers and ``DataCollatorWithPadding`` return; any ``Mapping``) or a dataclass. JAX
    knows dicts, lists, tuples and namedtuples only; to it these would be leaves, not tensors.
    Each such type is registered once, process-wide: a ``Mapping`` rebuilds as
    ``type(items_dict)`` (its own constructor on a dict of its items, a plain dict if that
    fails), a dataclass with its fields set (``__init__`` not called again), so the step gets
    the type it was given.

    Example:
        >>> import dataclasses, torch
        >>> @dataclasses.dataclass
        ... class Pair:
        ...     x: torch.Tensor
        ...     y: torch.Tensor
        >>> containers_as_nodes(Pair(torch.ones(2), torch.zeros(2)))
        >>> jax.tree.map(lambda t: t + 1, Pair(torch.ones(2), torch.zeros(2))).y
        tensor([1., 1.])
    """
    pending = [batch]
    while pending:
        x = pending.pop()
        kind = type(x)
        if isinstance(x, dict | list | tuple):
            pending.extend(x.values() if isinstance(x, dict) else x)
            continue
        if isinstance(x, Mapping):
            pending.extend(x.values())
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            pending.extend(getattr(x, f.name) for f in dataclasses.fields(x))
        else:
            continue
        if kind not in _NODES:
            _NODES.add(kind)
            _register(kind)


def _register(kind: Any) -> None:
    """Registers a Mapping or dataclass type with JAX's pytrees and torch's (torchax maps its
    tensors with torch's)."""
    mapping = issubclass(kind, Mapping)
    names = () if mapping else tuple(f.name for f in dataclasses.fields(kind))

    def flatten(x: Any) -> tuple[list[Any], Any]:
        if mapping:
            return list(x.values()), tuple(x.keys())
        return [getattr(x, n) for n in names], names

    def rebuild(aux: Any, values: Any) -> Any:
        if mapping:
            items = dict(zip(aux, values, strict=True))
            try:
                return kind(items)
            except Exception:  # a constructor that takes something else
                return items
        obj = object.__new__(kind)
        for name, value in zip(names, values, strict=True):
            object.__setattr__(obj, name, value)  # (frozen dataclasses too)
        return obj

    def flatten_with_keys(x: Any) -> tuple[list[Any], Any]:
        values, aux = flatten(x)
        key = jax.tree_util.DictKey if mapping else jax.tree_util.GetAttrKey
        return [(key(k), v) for k, v in zip(aux, values, strict=True)], aux

    jax.tree_util.register_pytree_with_keys(kind, flatten_with_keys, rebuild, flatten)
    if kind not in torch_pytree.SUPPORTED_NODES:
        torch_pytree.register_pytree_node(kind, flatten, lambda v, aux: rebuild(aux, v))


def all_tensors(batch: Any) -> bool:
    """Whether a dict/list/tuple batch (one level deep) holds only tensors and arrays."""
    values = batch.values() if isinstance(batch, dict) else batch
    if not isinstance(values, list | tuple) and not isinstance(batch, dict):
        return isinstance(batch, torch.Tensor | jax.Array)
    return all(isinstance(v, torch.Tensor | jax.Array) for v in values)


def has_arrays(x: Any) -> bool:
    """Whether any leaf of ``x`` is a tensor or an array."""
    return any(isinstance(v, torch.Tensor | jax.Array) for v in jax.tree.leaves(x))
