"""Flax param trees <-> PyTorch ``state_dict``s, strict and verified."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import torch

from bridge._dlpack import to_torch
from bridge._errors import StateDictError

PyTree = Any
Transform = Callable[[np.ndarray], np.ndarray]
# A rule: (regex over the '/'-joined flax path, rename template, transform to torch layout).
Rule = tuple[str, str, Transform | None]


def _t2(x: np.ndarray) -> np.ndarray:
    return x.T


# Built-in rules, tried after the user's. A transform maps a flax array to torch layout; its
# inverse is itself for the 2-D transpose.
BUILTIN_RULES: list[Rule] = [
    (r"^(.*)/kernel$", r"\1/weight", _t2),  # Dense (in, out) -> Linear (out, in)
    (r"^(.*)/scale$", r"\1/weight", None),  # LayerNorm/RMSNorm/GroupNorm
    (r"^(.*)/embedding$", r"\1/weight", None),
    (r"^(.*)/(bias)$", r"\1/\2", None),
]


def _flat(tree: PyTree) -> dict[str, Any]:
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        flat["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = leaf
    return flat


def _params_of(params: PyTree) -> PyTree:
    """Accepts a bare params tree or a Flax variables dict ``{"params": ...}``."""
    if isinstance(params, Mapping) and "params" in params:
        return params["params"]
    return params


def _torch_name(path: str) -> str:
    # layers_0 -> layers.0 ; a/b -> a.b
    return ".".join(re.sub(r"^(.*)_(\d+)$", r"\1.\2", part) for part in path.split("/"))


def _match(path: str, rules: Sequence[Rule]) -> tuple[str, Transform | None]:
    for pattern, rename, transform in rules:
        if re.search(pattern, path):
            new = re.sub(pattern, rename, path)
            return _torch_name(new), transform
    return _torch_name(path), None


def _plan(params: PyTree, rules: Sequence[Rule] | None) -> dict[str, tuple[str, Transform | None]]:
    """flax path -> (torch key, transform to torch layout)."""
    all_rules = [*(rules or []), *BUILTIN_RULES]
    plan = {}
    for path, leaf in _flat(_params_of(params)).items():
        key, transform = _match(path, all_rules)
        if transform is _t2 and np.ndim(leaf) != 2:
            transform = None  # only Dense kernels are 2-D
        plan[path] = (key, transform)
    return plan


def _check(
    found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], what: str
) -> None:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = [
        f"  {k}: ours {found[k]} vs {what} {expected[k]}"
        + ("  (kernel looks transposed)" if tuple(found[k]) == tuple(expected[k])[::-1] else "")
        for k in sorted(set(found) & set(expected))
        if tuple(found[k]) != tuple(expected[k])
    ]
    if missing or unexpected or shapes:
        lines = [f"The param tree does not match the {what} key for key:"]
        if missing:
            lines.append(f"missing keys (in the {what}, not produced): {missing}")
        if unexpected:
            lines.append(f"unexpected keys (produced, not in the {what}): {unexpected}")
        if shapes:
            lines.append("shape mismatches:\n" + "\n".join(shapes))
        lines.append(
            "Fix: align layer names (Flax `layers_0` <-> torch `layers.0`) and "
            "layouts, or pass rules=[(regex, rename, transform)] for custom layers."
        )
        raise StateDictError("\n".join(lines))


def export_state_dict(
    params: PyTree,
    torch_module: torch.nn.Module | None = None,
    rules: Sequence[Rule] | None = None,
) -> dict[str, torch.Tensor]:
    """Converts a Flax param tree to a PyTorch ``state_dict``.

    With ``torch_module`` the conversion is strict: every key of the module's
    ``state_dict`` is filled exactly once with equal shapes and dtypes, otherwise one error
    lists missing keys, unexpected keys and shape mismatches.

    Args:
        params: params tree, or a Flax variables dict with a ``params`` collection.
        torch_module: the torch twin to check against.
        rules: ordered ``(regex, rename, transform)`` entries tried before the built-ins.

    Returns:
        ``{torch key: tensor}`` on the CPU.

    Example:
        >>> import jax.numpy as jnp
        >>> sd = export_state_dict({"layers_0": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}})
        >>> sorted(sd), tuple(sd["layers.0.weight"].shape)
        (['layers.0.bias', 'layers.0.weight'], (2, 3))
    """
    flat = _flat(_params_of(params))
    out: dict[str, torch.Tensor] = {}
    for path, (key, transform) in _plan(params, rules).items():
        leaf = flat[path]
        tensor = (
            to_torch(leaf) if isinstance(leaf, jax.Array) else torch.from_numpy(np.asarray(leaf))
        )
        if transform is not None:
            tensor = torch.from_numpy(np.ascontiguousarray(transform(tensor.numpy())))
        out[key] = tensor
    if torch_module is not None:
        expected = torch_module.state_dict()
        _check(
            {k: tuple(v.shape) for k, v in out.items()},
            {k: tuple(v.shape) for k, v in expected.items()},
            "torch module's state_dict",
        )
        bad = [
            f"{k}: ours {out[k].dtype} vs module {v.dtype}"
            for k, v in expected.items()
            if out[k].dtype != v.dtype
        ]
        if bad:
            raise StateDictError(
                "dtype mismatches: "
                + "; ".join(bad)
                + ". Fix: cast the module (e.g. `.to(torch.bfloat16)`) or "
                "the params before exporting."
            )
    return out


def import_state_dict(
    state_dict: Mapping[str, torch.Tensor], params: PyTree, rules: Sequence[Rule] | None = None
) -> PyTree:
    """Fills a Flax param tree from a PyTorch ``state_dict`` (the warm-start direction).

    ``params`` is the template: it decides structure, dtypes and shardings of the result.

    Example:
        >>> import jax.numpy as jnp, torch
        >>> tpl = {"head": {"kernel": jnp.zeros((3, 2)), "bias": jnp.zeros(2)}}
        >>> sd = {"head.weight": torch.ones(2, 3), "head.bias": torch.ones(2)}
        >>> float(import_state_dict(sd, tpl)["head"]["kernel"].sum())
        6.0
    """
    template = _params_of(params)
    flat = _flat(template)
    plan = _plan(template, rules)
    produced = {
        key: tuple(np.shape(flat[p]))[::-1] if tr is not None else tuple(np.shape(flat[p]))
        for p, (key, tr) in plan.items()
    }
    _check(produced, {k: tuple(v.shape) for k, v in state_dict.items()}, "state_dict")
    leaves = {}
    for path, (key, transform) in plan.items():
        value = state_dict[key].detach().cpu()
        arr = value.float().numpy() if value.dtype == torch.bfloat16 else value.numpy()
        if transform is not None:
            arr = transform(arr)
        tpl = flat[path]
        leaves[path] = jax.device_put(np.asarray(arr).astype(tpl.dtype), tpl.sharding)
    paths = list(flat)
    treedef = jax.tree_util.tree_structure(template)
    result = jax.tree_util.tree_unflatten(treedef, [leaves[p] for p in paths])
    if isinstance(params, Mapping) and "params" in params:
        return {**params, "params": result}
    return result
