"""Planning: which Flax leaves fill which torch keys, with which layout change, both ways.

Entries come from, in order: the user's rules, the built-in structural rules (attention,
BatchNorm counters), then the built-in per-leaf rules (:data:`BUILTIN_RULES`). The same plan
serves both directions, so what exports also imports.

MultiHeadDotProductAttention / nnx MultiHeadAttention ``query|key|value/kernel
(in, heads, head_dim)`` and ``out/kernel (heads, head_dim, out)`` -> MultiheadAttention
``in_proj_weight (3*heads*head_dim, in)``, ``in_proj_bias``, ``out_proj.weight``,
``out_proj.bias`` (separate ``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` when the
key/value input widths differ from the query's, as torch does with ``kdim``/``vdim``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from bridge._errors import StateDictError
from bridge._flatten import Leaf
from bridge._layouts import (
    AUTO_KERNEL,
    BUILTIN_RULES,
    IDENTITY,
    Rule,
    Transform,
    as_transform,
    kernel_layout,
    torch_name,
)
from bridge._tree import join


@dataclass
class Entry:
    """Flax leaves ``paths`` <-> torch ``keys``; ``to_flax`` gets torch tensors + Flax shapes."""

    paths: tuple[str, ...]
    keys: tuple[str, ...]
    to_torch: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    to_flax: Callable[[list[torch.Tensor], list[tuple[int, ...]]], list[torch.Tensor]]
    optional: bool = False  # may be absent from an imported state_dict


def one(path: str, key: str, t: Transform) -> Entry:
    """One Flax leaf <-> one torch key through ``t``."""
    return Entry((path,), (key,), lambda xs: [t.to_torch(xs[0])], lambda ts, _: [t.to_flax(ts[0])])


def attention(prefix: str, leaves: Mapping[str, Leaf], free: set[str]) -> Entry | None:
    """query/key/value/out DenseGeneral kernels -> torch MultiheadAttention, or None."""
    roles = ("query", "key", "value", "out")
    kernels = [join(prefix, f"{r}/kernel") for r in roles]
    biases = [join(prefix, f"{r}/bias") for r in roles]
    if not all(k in free and len(leaves[k].shape) == 3 for k in kernels):
        return None
    has_bias = [b in free for b in biases]
    if any(has_bias[:3]) and not all(has_bias[:3]):
        return None  # torch keeps one in_proj_bias for q, k and v
    q_shape = leaves[kernels[0]].shape
    packed = all(leaves[k].shape == q_shape for k in kernels[:3])
    tp = torch_name(prefix) + "." if prefix else ""
    in_keys = [tp + "in_proj_weight"] if packed else [tp + f"{r[0]}_proj_weight" for r in roles[:3]]
    keys = [*in_keys]
    paths = [*kernels[:3]]
    if has_bias[0]:
        keys.append(tp + "in_proj_bias")
        paths += biases[:3]
    keys.append(tp + "out_proj.weight")
    paths.append(kernels[3])
    if has_bias[3]:
        keys.append(tp + "out_proj.bias")
        paths.append(biases[3])
    bias_q = has_bias[0]
    bias_o = has_bias[3]

    def to_torch(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        qkv = [x.reshape(x.shape[0], -1).T for x in xs[:3]]
        out = [torch.cat(qkv, 0)] if packed else qkv
        i = 3
        if bias_q:
            out.append(torch.cat([b.reshape(-1) for b in xs[3:6]]))
            i = 6
        o = xs[i]
        out.append(o.reshape(-1, o.shape[-1]).T)
        if bias_o:
            out.append(xs[i + 1])
        return out

    def to_flax(ts: list[torch.Tensor], shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        widths = [int(np.prod(s[1:])) for s in shapes[:3]]
        qkv = list(ts[0].split(widths, 0)) if packed else ts[:3]
        out = [w.T.reshape(s) for w, s in zip(qkv, shapes[:3], strict=True)]
        j, i = (1, 3) if packed else (3, 3)
        if bias_q:
            out += [b.reshape(s) for b, s in zip(ts[j].split(widths), shapes[3:6], strict=True)]
            j, i = j + 1, 6
        out.append(ts[j].T.reshape(shapes[i]))
        if bias_o:
            out.append(ts[j + 1])
        return out

    return Entry(tuple(paths), tuple(keys), to_torch, to_flax)


def counter(prefix: str) -> Entry:
    """BatchNorm's ``num_batches_tracked``: exported as 0, optional on import."""
    key = (torch_name(prefix) + "." if prefix else "") + "num_batches_tracked"
    return Entry(
        (), (key,), lambda _: [torch.zeros((), dtype=torch.int64)], lambda *_: [], optional=True
    )


def plan(
    leaves: Mapping[str, Leaf],
    rules: Sequence[Rule] | None,
    modules: Mapping[str, torch.nn.Module] | None,
) -> list[Entry]:
    """The conversion plan of ``leaves``; a torch key filled twice is refused."""
    entries: list[Entry] = []
    free = set(leaves)
    for pattern, rename, transform in rules or ():
        rx, t = re.compile(pattern), as_transform(transform)
        for path in sorted(free):
            if rx.search(path):
                entries.append(one(path, torch_name(rx.sub(rename, path)), t))
                free.discard(path)
    for path in sorted(p for p in leaves if p.endswith("query/kernel")):
        prefix = path[: -len("query/kernel")].rstrip("/")
        if (entry := attention(prefix, leaves, free)) is not None:
            entries.append(entry)
            free -= set(entry.paths)
    for path in sorted(p for p in leaves if p == "mean" or p.endswith("/mean")):
        prefix = path[: -len("mean")].rstrip("/")
        var = join(prefix, "var")
        if leaves[path].collection == "batch_stats" and var in leaves:
            entries.append(counter(prefix))
    builtin = [(re.compile(p), r, t) for p, r, t in BUILTIN_RULES]
    for path in sorted(free):
        key, t = torch_name(path), IDENTITY  # no rule: the name alone
        for rx, rename, transform in builtin:
            if rx.search(path):
                key, t = torch_name(rx.sub(rename, path)), as_transform(transform)
                break
        if t is AUTO_KERNEL:
            owner = modules.get(key.rpartition(".")[0]) if modules is not None else None
            t = kernel_layout(path, len(leaves[path].shape), owner)
        entries.append(one(path, key, t))
    seen: dict[str, tuple[str, ...]] = {}
    for e in entries:
        for k in e.keys:
            if k in seen:
                raise StateDictError(
                    f"Torch key {k!r} would be filled twice: from {list(seen[k])} and "
                    f"{list(e.paths)}. Fix: rename one of the Flax modules or add a rule."
                )
            seen[k] = e.paths
    return entries
