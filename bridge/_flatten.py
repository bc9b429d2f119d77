"""Flattening: Flax param trees (linen variables dicts, bare trees, nnx State) <-> named leaves.

Stacked (``nn.scan``/``nnx.vmap``) layers: a leaf under a ``stacked`` prefix with a leading
layer axis of length L becomes L virtual leaves ``prefix/0/...`` ... ``prefix/{L-1}/...``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from bridge._errors import StateDictError
from bridge._tree import PyTree, path_str

# Collections of a linen variables dict that hold weights; others pass through untouched.
COLLECTIONS = ("params", "batch_stats")


@dataclass
class Leaf:
    """One weight leaf, real or (for a stacked layer) one layer's slice of a real one."""

    collection: str  # "params" or "batch_stats"
    value: Any  # jax.Array, numpy array or torch tensor (template or source)
    shape: tuple[int, ...]
    stacked: tuple[str, int] | None = None  # (real path, layer index) for a virtual leaf


def is_nnx_state(tree: Any) -> bool:
    """True for an nnx ``State`` (or another flax.nnx container)."""
    return type(tree).__module__.startswith("flax.nnx")


def is_variables(tree: Any) -> bool:
    """True for a linen variables dict ``{"params": ..., ...}``."""
    return isinstance(tree, Mapping) and isinstance(tree.get("params"), Mapping)


def walk(tree: PyTree) -> Iterator[tuple[str, str, Any, Any]]:
    """Yields ``(path, collection, value, nnx variable or None)`` for every weight leaf."""
    if is_nnx_state(tree):
        from flax import nnx  # only when an nnx State comes in

        kinds = {nnx.Param: "params", nnx.BatchStat: "batch_stats"}
        flat = jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )[0]
        for keys, var in flat:
            kind = next((c for t, c in kinds.items() if isinstance(var, t)), None)
            if kind is not None:
                yield path_str(keys), kind, var.get_value(), var
        return
    trees = (
        [(c, tree[c]) for c in COLLECTIONS if c in tree]
        if is_variables(tree)
        else [("params", tree)]
    )
    for collection, sub in trees:
        for keys, leaf in jax.tree_util.tree_flatten_with_path(sub)[0]:
            yield path_str(keys), collection, leaf, None


def collect(tree: PyTree) -> dict[str, Leaf]:
    """``{path: Leaf}`` of every weight leaf; a path in two collections is refused."""
    out: dict[str, Leaf] = {}
    for path, collection, value, _ in walk(tree):
        if path in out:
            raise StateDictError(
                f"Path {path!r} is in both the {out[path].collection!r} and {collection!r} "
                "collections, so its torch key would be ambiguous. Fix: rename one of them."
            )
        shape = tuple(value.shape) if hasattr(value, "shape") else np.shape(value)
        out[path] = Leaf(collection, value, shape)
    return out


def unstack(real: dict[str, Leaf], stacked: Sequence[str]) -> dict[str, Leaf]:
    """Splits leaves under a stacked prefix along their leading layer axis."""
    if not stacked:
        return real
    patterns = [re.compile(rf"^({p})/(.+)$") for p in stacked]
    out: dict[str, Leaf] = {}
    matched = set()
    for path, leaf in real.items():
        m = next((m for pat in patterns if (m := pat.match(path))), None)
        if m is None:
            out[path] = leaf
            continue
        matched.add(m.group(1))
        if not leaf.shape:
            raise StateDictError(
                f"Stacked leaf {path!r} is a scalar; a stacked layer needs a leading layer "
                "axis. Fix: leave this prefix out of `stacked`."
            )
        for i in range(leaf.shape[0]):
            out[f"{m.group(1)}/{i}/{m.group(2)}"] = Leaf(
                leaf.collection, leaf.value, leaf.shape[1:], (path, i)
            )
    unused = [p for p in stacked if not any(re.fullmatch(p, m) for m in matched)]
    if unused:
        raise StateDictError(
            f"stacked={list(stacked)}: {unused} match no path prefix of the params. Known "
            f"top-level names: {sorted({p.split('/')[0] for p in real})}. Fix: pass the prefix "
            "of the scanned layers, e.g. stacked=['layers']."
        )
    return out


def rebuild(params: PyTree, real: Mapping[str, Leaf], fill: Callable[[str, Any], Any]) -> PyTree:
    """``params`` with each weight leaf replaced by ``fill(path, leaf)`` (same form)."""
    if is_nnx_state(params):
        from flax import nnx

        def swap(keys: Sequence[Any], var: Any) -> Any:
            path = path_str(keys)
            if isinstance(var, nnx.Variable) and path in real:
                return var.copy(fill(path, var.get_value()))
            return var

        return jax.tree_util.tree_map_with_path(
            swap, params, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )

    def tree(sub: PyTree) -> PyTree:
        return jax.tree_util.tree_map_with_path(lambda k, x: fill(path_str(k), x), sub)

    if is_variables(params):
        return {c: tree(v) if c in COLLECTIONS else v for c, v in params.items()}
    return tree(params)
