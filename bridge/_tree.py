"""A small pytree walk over the containers a DataLoader collates to, with field names.

``jax.tree_util`` treats an unregistered ``@dataclass`` as a leaf and torch's pytree does
too; batches are dicts, lists, tuples, namedtuples or dataclasses of tensors, so the bridge
walks them itself (and names each leaf by its path for error messages and stats).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from itertools import repeat
from typing import Any

import torch

PyTree = Any


def join(prefix: str, key: object) -> str:
    """``prefix/key``, or ``key`` alone at the root: the one way the bridge names a path.

    Example:
        >>> join("", "a"), join("a", 0)
        ('a', 'a/0')
    """
    return f"{prefix}/{key}" if prefix else str(key)


def key_name(key: Any) -> str:
    """The name of one ``jax.tree_util`` path entry (dict key, attribute, index).

    Example:
        >>> import jax
        >>> key_name(jax.tree_util.DictKey("w")), key_name(jax.tree_util.SequenceKey(2))
        ('w', '2')
    """
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_str(keys: Sequence[Any]) -> str:
    """The '/'-joined name of a ``jax.tree_util`` key path (``a/b/0``).

    Example:
        >>> import jax
        >>> [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path({"a": [0, 1]})[0]]
        ['a/0', 'a/1']
    """
    return "/".join(key_name(k) for k in keys)


def map_leaves(
    fn: Callable[[str, Any], Any], tree: PyTree, is_leaf: Callable[[Any], bool], prefix: str = ""
) -> PyTree:
    """Applies ``fn(path, leaf)`` to every leaf, rebuilding containers of the same type.

    Objects that are neither leaves nor known containers are returned unchanged.

    Example:
        >>> map_leaves(lambda p, x: p, {"a": [1, 2]}, lambda x: isinstance(x, int))
        {'a': ['a/0', 'a/1']}
    """
    if is_leaf(tree):
        return fn(prefix or "<root>", tree)
    if type(tree) is dict:  # the common case first: collated batches are plain dicts
        return {k: map_leaves(fn, v, is_leaf, join(prefix, k)) for k, v in tree.items()}
    if isinstance(tree, Mapping):
        items = {k: map_leaves(fn, v, is_leaf, join(prefix, k)) for k, v in tree.items()}
        cls: Any = type(tree)
        try:
            return cls(items)
        except TypeError:
            return items
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple
        return type(tree)(
            *(
                map_leaves(fn, v, is_leaf, join(prefix, k))
                for k, v in zip(tree._fields, tree, strict=True)
            )
        )
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_leaves(fn, v, is_leaf, join(prefix, i)) for i, v in enumerate(tree))
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        out = copy.copy(tree)  # keeps init=False fields; setattr below also works when frozen
        for f in dataclasses.fields(tree):
            value = getattr(tree, f.name)
            object.__setattr__(out, f.name, map_leaves(fn, value, is_leaf, join(prefix, f.name)))
        return out
    return tree


def leaves(tree: PyTree, is_leaf: Callable[[Any], bool]) -> list[tuple[str, Any]]:
    """``(path, leaf)`` pairs in traversal order.

    Example:
        >>> leaves({"a": (1, 2)}, lambda x: isinstance(x, int))
        [('a/0', 1), ('a/1', 2)]
    """
    found: list[tuple[str, Any]] = []
    map_leaves(lambda p, x: found.append((p, x)), tree, is_leaf)
    return found


def flat_leaves(tree: PyTree) -> list[tuple[str, Any]] | None:
    """``leaves(tree, is_tensor)`` of a flat dict, list or tuple of torch tensors, read without
    walking the tree (the common collated batch); ``None`` for any other tree.

    Example:
        >>> import torch
        >>> flat_leaves({"x": torch.ones(1)}), flat_leaves([torch.ones(1), [torch.ones(1)]])
        ([('x', tensor([1.]))], None)
    """
    kind = type(tree)
    if kind is dict:
        names, values = list(map(str, tree)), list(tree.values())
    elif kind is list or kind is tuple:
        names, values = list(map(str, range(len(tree)))), list(tree)
    else:
        return None
    if not all(map(isinstance, values, repeat(torch.Tensor))):
        return None
    return list(zip(names, values, strict=True))


def rebuilt(tree: PyTree, values: Sequence[Any]) -> PyTree:
    """``tree`` (a flat dict, list or tuple: :func:`flat_leaves`) holding ``values`` instead.

    Example:
        >>> rebuilt({"x": 1}, [2]), rebuilt((1, 2), [3, 4])
        ({'x': 2}, (3, 4))
    """
    if type(tree) is dict:
        return dict(zip(tree, values, strict=True))
    return type(tree)(values)
