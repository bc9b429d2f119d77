"""Flax param trees (linen and nnx) <-> PyTorch ``state_dict``s, strict and verified.

A conversion is a *plan* (``_plan.py``): a list of entries, each mapping some Flax leaves
(``_flatten.py``) to some torch keys with a layout change both ways (``_layouts.py``, where
the layouts are listed). The same plan serves both directions, so what exports also imports;
``_check.py`` makes one error of every difference. Tensors cross through ``_convert.py``, the
bridge's one torch <-> numpy/JAX path (bf16 included).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import torch

from bridge._check import check
from bridge._convert import as_numpy, as_torch
from bridge._errors import StateDictError
from bridge._flatten import Leaf, collect, rebuild, unstack
from bridge._layouts import Rule
from bridge._plan import Entry, plan
from bridge._tree import PyTree


def _meta(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, device="meta")


def _prepare(
    params: PyTree, rules: Sequence[Rule] | None, stacked: Sequence[str], module: Any
) -> tuple[dict[str, Leaf], dict[str, Leaf], list[Entry]]:
    real = collect(params)
    if not real:
        raise StateDictError(
            f"No weights found in {type(params).__name__}: expected a params tree, a Flax "
            "variables dict {'params': ..., 'batch_stats': ...} or an nnx State. Fix: pass "
            "`variables`, `variables['params']` or `nnx.state(model)`."
        )
    leaves = unstack(real, stacked)
    modules = dict(module.named_modules()) if module is not None else None
    return real, leaves, plan(leaves, rules, modules)


def _module_spec(module: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}


def export_state_dict(
    params: PyTree,
    torch_module: torch.nn.Module | None = None,
    rules: Sequence[Rule] | None = None,
    *,
    stacked: Sequence[str] = (),
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Converts Flax weights to a PyTorch ``state_dict``.

    With ``torch_module`` the conversion is strict: every key of the module's ``state_dict``
    is filled exactly once with equal shapes and dtypes, otherwise one
    :class:`~bridge.StateDictError` lists missing keys, unexpected keys, shape mismatches
    (both shapes, with a hint when a kernel looks transposed) and dtype mismatches. The module
    also decides ambiguous kernel layouts (Linear, ConvNd, ConvTransposeNd owners).

    Sharded arrays are gathered (across processes too); tensors alias the JAX buffers through
    DLPack where the layout allows (permutes and stacked-layer slices are views); dtypes stay
    as they are (bf16 stays bf16) unless ``dtype`` is given. Call ``.contiguous()`` (or
    :func:`bridge.save_safetensors`) to save them.

    Args:
        params: a params tree, a Flax variables dict ``{"params": ..., "batch_stats": ...}``
            (other collections are ignored) or an nnx ``State`` (``Param`` and ``BatchStat``
            variables are converted).
        torch_module: the torch twin to check against.
        rules: ordered ``(regex, rename, transform)`` entries tried before the built-ins.
        stacked: regexes of path prefixes whose leaves carry a leading layer axis
            (``nn.scan``): ``layers/fc/kernel (L, in, out)`` <-> ``layers.{i}.fc.weight``.
        dtype: cast floating-point tensors to this dtype.

    Returns:
        ``{torch key: tensor}``.

    Raises:
        StateDictError: the params and the module do not match, or two params map to one key.

    Example:
        >>> import jax.numpy as jnp
        >>> sd = export_state_dict({"layers_0": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}})
        >>> sorted(sd), tuple(sd["layers.0.weight"].shape)
        (['layers.0.bias', 'layers.0.weight'], (2, 3))
    """
    _, leaves, plan = _prepare(params, rules, stacked, torch_module)
    whole: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for entry in plan:
        xs = []
        for p in entry.paths:
            leaf = leaves[p]
            src = leaf.stacked[0] if leaf.stacked else p
            if src not in whole:
                whole[src] = as_torch(leaf.value)
            xs.append(whole[src][leaf.stacked[1]] if leaf.stacked else whole[src])
        for key, tensor in zip(entry.keys, entry.to_torch(xs), strict=True):
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            out[key] = tensor
    if torch_module is not None:
        check(
            {k: (tuple(v.shape), v.dtype) for k, v in out.items()},
            _module_spec(torch_module),
            "exported params",
            "torch module's state_dict",
        )
    return out


def import_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    params: PyTree,
    rules: Sequence[Rule] | None = None,
    *,
    stacked: Sequence[str] = (),
    torch_module: torch.nn.Module | None = None,
) -> PyTree:
    """Fills Flax weights from a PyTorch ``state_dict`` (the warm-start direction).

    ``params`` is the template: it decides structure (bare tree, variables dict or nnx
    ``State``), dtypes and shardings of the result. The import is strict: every key of
    ``state_dict`` is used (``num_batches_tracked`` may be absent) and every template leaf
    filled, with equal shapes, otherwise one :class:`~bridge.StateDictError` lists the
    differences. Values are copied, never aliased with the torch tensors.

    Args:
        state_dict: ``{torch key: tensor}``, e.g. ``module.state_dict()``.
        params: the template (same forms as :func:`export_state_dict` accepts).
        rules: ordered ``(regex, rename, transform)`` entries tried before the built-ins.
        stacked: path prefixes of stacked layers (see :func:`export_state_dict`).
        torch_module: optional; decides ambiguous kernel layouts like on export.

    Returns:
        A tree of the template's form with the state_dict's values.

    Example:
        >>> import jax.numpy as jnp, torch
        >>> tpl = {"head": {"kernel": jnp.zeros((3, 2)), "bias": jnp.zeros(2)}}
        >>> sd = {"head.weight": torch.ones(2, 3), "head.bias": torch.ones(2)}
        >>> float(import_state_dict(sd, tpl)["head"]["kernel"].sum())
        6.0
    """
    real, leaves, plan = _prepare(params, rules, stacked, torch_module)
    produced: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}
    for entry in plan:
        metas = entry.to_torch([_meta(leaves[p].shape) for p in entry.paths])
        produced.update({k: (tuple(m.shape), None) for k, m in zip(entry.keys, metas, strict=True)})
    optional = {k for e in plan if e.optional for k in e.keys}
    check(
        {k: (tuple(v.shape), None) for k, v in state_dict.items()},
        {k: v for k, v in produced.items() if k not in optional or k in state_dict},
        "state_dict",
        "params template",
        optional=optional,
    )
    virtual: dict[str, torch.Tensor] = {}
    for entry in plan:
        if not entry.paths:
            continue
        ts = [state_dict[k].detach() for k in entry.keys]
        vals = entry.to_flax(ts, [leaves[p].shape for p in entry.paths])
        virtual.update(zip(entry.paths, vals, strict=True))
    values: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for path, leaf in leaves.items():
        if leaf.stacked:
            parts.setdefault(leaf.stacked[0], {})[leaf.stacked[1]] = virtual[path]
        else:
            values[path] = virtual[path]
    for path, by_index in parts.items():
        values[path] = torch.stack([by_index[i] for i in range(len(by_index))])

    def fill(path: str, template: Any) -> Any:
        arr = np.array(as_numpy(values[path]), dtype=template.dtype, copy=True)
        sharding = getattr(template, "sharding", None)  # jax.Array or jax.ShapeDtypeStruct
        if sharding is not None:
            return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])
        return jax.device_put(arr) if isinstance(template, jax.ShapeDtypeStruct) else arr

    return rebuild(params, real, fill)


def state_dict_sources(
    params: PyTree,
    rules: Sequence[Rule] | None = None,
    *,
    stacked: Sequence[str] = (),
    torch_module: torch.nn.Module | None = None,
) -> dict[str, list[str]]:
    """Which Flax leaves each torch key comes from (for metadata and debugging).

    Paths carry their collection (``params/...``, ``batch_stats/...``) and, for stacked
    layers, the layer index (``params/layers/fc/kernel[3]``).

    Example:
        >>> import jax.numpy as jnp
        >>> state_dict_sources({"head": {"kernel": jnp.ones((3, 2))}})
        {'head.weight': ['params/head/kernel']}
    """
    _, leaves, plan = _prepare(params, rules, stacked, torch_module)

    def name(p: str) -> str:
        leaf = leaves[p]
        if leaf.stacked:
            return f"{leaf.collection}/{leaf.stacked[0]}[{leaf.stacked[1]}]"
        return f"{leaf.collection}/{p}"

    return {k: [name(p) for p in e.paths] for e in plan for k in e.keys}
