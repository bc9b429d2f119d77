"""Flax param trees (linen and nnx) <-> PyTorch ``state_dict``s, strict and verified.

A conversion is a *plan*: a list of entries, each mapping some Flax leaves to some torch keys
with a layout change both ways. Entries come from, in order: the user's rules, the built-in
structural rules (attention, BatchNorm counters), then the built-in per-leaf rules
(:data:`BUILTIN_RULES`). The same plan serves both directions, so what exports also imports.

Layouts (Flax -> torch):

- Dense ``kernel (in, out)`` -> Linear ``weight (out, in)``.
- Conv ``kernel (*spatial, in/groups, out)`` -> ConvNd ``weight (out, in/groups, *spatial)``
  (groups and depthwise included: the permutation is the same).
- ConvTranspose (Flax default ``transpose_kernel=False``) ``kernel (*spatial, in, out)`` ->
  ConvTransposeNd ``weight (in, out, *spatial)`` *spatially flipped*: Flax then runs a plain
  dilated convolution with the kernel as stored, torch the gradient of a convolution. A Flax
  ConvTranspose with ``transpose_kernel=True`` stores ``(*spatial, out, in)`` and needs no flip:
  pass a rule with :data:`CONV_KERNEL` for it. Padding is not a weight: match it yourself
  (Flax ``'VALID'`` equals torch ``padding=0`` when ``kernel_size >= stride``).
- LayerNorm / RMSNorm / GroupNorm / BatchNorm ``scale``, ``bias`` -> ``weight``, ``bias``;
  BatchNorm ``batch_stats`` ``mean``, ``var`` -> ``running_mean``, ``running_var`` and a
  ``num_batches_tracked`` counter (Flax keeps none: exported as 0, ignored on import).
- Embed ``embedding`` -> Embedding ``weight`` (same layout).
- MultiHeadDotProductAttention / nnx MultiHeadAttention ``query|key|value/kernel
  (in, heads, head_dim)`` and ``out/kernel (heads, head_dim, out)`` -> MultiheadAttention
  ``in_proj_weight (3*heads*head_dim, in)``, ``in_proj_bias``, ``out_proj.weight``,
  ``out_proj.bias`` (separate ``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` when the
  key/value input widths differ from the query's, as torch does with ``kdim``/``vdim``).
- Stacked (``nn.scan``/``nnx.vmap``) layers: a leaf under a ``stacked`` prefix with a leading
  layer axis of length L <-> L torch keys ``prefix.0.`` ... ``prefix.{L-1}.`` (views on export).
- Names: ``a/b/kernel`` -> ``a.b.weight``; ``layers_0`` -> ``layers.0``; nnx list indices
  ``layers/0`` -> ``layers.0``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import multihost_utils

from bridge._errors import StateDictError

PyTree = Any
TensorFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Transform:
    """A layout change of one array, Flax -> torch and back (torch tensors both ways).

    Example:
        >>> import torch
        >>> t = Transform(lambda x: x.T, lambda x: x.T, "dense")
        >>> tuple(t.to_torch(torch.zeros(3, 2)).shape)
        (2, 3)
    """

    to_torch: TensorFn
    to_flax: TensorFn
    name: str = "custom"


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _swap(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 0)


def _conv_to_torch(x: torch.Tensor) -> torch.Tensor:  # (*sp, in, out) -> (out, in, *sp)
    n = x.ndim
    return x.permute(n - 1, n - 2, *range(n - 2))


def _conv_to_flax(x: torch.Tensor) -> torch.Tensor:  # (out, in, *sp) -> (*sp, in, out)
    n = x.ndim
    return x.permute(*range(2, n), 1, 0)


def _convt_to_torch(x: torch.Tensor) -> torch.Tensor:  # (*sp, in, out) -> (in, out, *sp)
    n = x.ndim
    return x.flip(list(range(n - 2))).permute(n - 2, n - 1, *range(n - 2))


def _convt_to_flax(x: torch.Tensor) -> torch.Tensor:  # (in, out, *sp) -> (*sp, in, out)
    n = x.ndim
    return x.flip(list(range(2, n))).permute(*range(2, n), 0, 1)


IDENTITY = Transform(_identity, _identity, "identity")
DENSE_KERNEL = Transform(_swap, _swap, "dense")
CONV_KERNEL = Transform(_conv_to_torch, _conv_to_flax, "conv")
CONV_TRANSPOSE_KERNEL = Transform(_convt_to_torch, _convt_to_flax, "conv_transpose")
# Resolved per leaf: by the torch module that owns the key when one is given, else by ndim
# (2: Dense, 3-5: Conv) and by the path (a ConvTranspose in the name: ConvTranspose).
AUTO_KERNEL = Transform(_identity, _identity, "auto kernel")

# A rule: (regex searched in the '/'-joined Flax path, rename template for re.sub, transform).
# The renamed path goes through the naming convention (`/` -> `.`, `name_N` -> `name.N`)
# unless it already contains a '.', in which case it is the torch key verbatim. A plain
# callable as transform is used both ways (it must be its own inverse, like a transpose).
Rule = tuple[str, str, Transform | TensorFn | None]

BUILTIN_RULES: list[Rule] = [
    (r"^(.*/)?kernel$", r"\1weight", AUTO_KERNEL),  # Dense/Conv/ConvTranspose
    (r"^(.*/)?scale$", r"\1weight", None),  # LayerNorm/RMSNorm/GroupNorm/BatchNorm
    (r"^(.*/)?embedding$", r"\1weight", None),  # Embed
    (r"^(.*/)?bias$", r"\1bias", None),
    (r"^(.*/)?mean$", r"\1running_mean", None),  # BatchNorm batch_stats
    (r"^(.*/)?var$", r"\1running_var", None),
]

# Collections of a linen variables dict that hold weights; others pass through untouched.
COLLECTIONS = ("params", "batch_stats")


# ----------------------------------------------------------------------------- flattening


@dataclass
class _Leaf:
    collection: str  # "params" or "batch_stats"
    value: Any  # jax.Array, numpy array or torch tensor (template or source)
    shape: tuple[int, ...]
    stacked: tuple[str, int] | None = None  # (real path, layer index) for a virtual leaf


def _key_name(k: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _path(keys: Sequence[Any]) -> str:
    return "/".join(_key_name(k) for k in keys)


def _is_nnx_state(tree: Any) -> bool:
    return type(tree).__module__.startswith("flax.nnx")


def _is_variables(tree: Any) -> bool:
    return isinstance(tree, Mapping) and isinstance(tree.get("params"), Mapping)


def _walk(tree: PyTree) -> Iterator[tuple[str, str, Any, Any]]:
    """Yields ``(path, collection, value, nnx variable or None)`` for every weight leaf."""
    if _is_nnx_state(tree):
        from flax import nnx  # only when an nnx State comes in

        kinds = {nnx.Param: "params", nnx.BatchStat: "batch_stats"}
        flat = jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )[0]
        for keys, var in flat:
            kind = next((c for t, c in kinds.items() if isinstance(var, t)), None)
            if kind is not None:
                yield _path(keys), kind, var.get_value(), var
        return
    trees = (
        [(c, tree[c]) for c in COLLECTIONS if c in tree]
        if _is_variables(tree)
        else [("params", tree)]
    )
    for collection, sub in trees:
        for keys, leaf in jax.tree_util.tree_flatten_with_path(sub)[0]:
            yield _path(keys), collection, leaf, None


def _collect(tree: PyTree) -> dict[str, _Leaf]:
    out: dict[str, _Leaf] = {}
    for path, collection, value, _ in _walk(tree):
        if path in out:
            raise StateDictError(
                f"Path {path!r} is in both the {out[path].collection!r} and {collection!r} "
                "collections, so its torch key would be ambiguous. Fix: rename one of them."
            )
        shape = tuple(value.shape) if hasattr(value, "shape") else np.shape(value)
        out[path] = _Leaf(collection, value, shape)
    return out


def _unstack(real: dict[str, _Leaf], stacked: Sequence[str]) -> dict[str, _Leaf]:
    """Splits leaves under a stacked prefix along their leading layer axis."""
    if not stacked:
        return real
    patterns = [re.compile(rf"^({p})/(.+)$") for p in stacked]
    out: dict[str, _Leaf] = {}
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
            out[f"{m.group(1)}/{i}/{m.group(2)}"] = _Leaf(
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


# ----------------------------------------------------------------------------- planning


@dataclass
class _Entry:
    """Flax leaves ``paths`` <-> torch ``keys``; ``to_flax`` gets torch tensors + Flax shapes."""

    paths: tuple[str, ...]
    keys: tuple[str, ...]
    to_torch: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    to_flax: Callable[[list[torch.Tensor], list[tuple[int, ...]]], list[torch.Tensor]]
    optional: bool = False  # may be absent from an imported state_dict


def _torch_name(path: str) -> str:
    if "." in path:
        return path
    return ".".join(re.sub(r"^(.*\D)_(\d+)$", r"\1.\2", part) for part in path.split("/"))


def _as_transform(t: Transform | TensorFn | None) -> Transform:
    if t is None:
        return IDENTITY
    if isinstance(t, Transform):
        return t
    if callable(t):
        return Transform(t, t, getattr(t, "__name__", "custom"))
    raise StateDictError(
        f"A rule's transform must be None, a bridge.Transform or a callable, got {t!r}. "
        "Fix: pass e.g. bridge.Transform(to_torch=..., to_flax=...)."
    )


def _one(path: str, key: str, t: Transform) -> _Entry:
    return _Entry((path,), (key,), lambda xs: [t.to_torch(xs[0])], lambda ts, _: [t.to_flax(ts[0])])


def _kernel_layout(path: str, ndim: int, owner: torch.nn.Module | None) -> Transform:
    if isinstance(owner, torch.nn.modules.conv._ConvTransposeNd):
        return CONV_TRANSPOSE_KERNEL if ndim >= 3 else IDENTITY
    if ndim == 2:
        return DENSE_KERNEL
    if 3 <= ndim <= 5:
        if owner is None and re.search(r"(?i)conv_?transpose|deconv", path):
            return CONV_TRANSPOSE_KERNEL
        return CONV_KERNEL
    return IDENTITY  # no built-in layout: the strict check reports the shape


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def _attention(prefix: str, leaves: Mapping[str, _Leaf], free: set[str]) -> _Entry | None:
    """query/key/value/out DenseGeneral kernels -> torch MultiheadAttention, or None."""
    roles = ("query", "key", "value", "out")
    kernels = [_join(prefix, f"{r}/kernel") for r in roles]
    biases = [_join(prefix, f"{r}/bias") for r in roles]
    if not all(k in free and len(leaves[k].shape) == 3 for k in kernels):
        return None
    has_bias = [b in free for b in biases]
    if any(has_bias[:3]) and not all(has_bias[:3]):
        return None  # torch keeps one in_proj_bias for q, k and v
    q_shape = leaves[kernels[0]].shape
    packed = all(leaves[k].shape == q_shape for k in kernels[:3])
    tp = _torch_name(prefix) + "." if prefix else ""
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

    return _Entry(tuple(paths), tuple(keys), to_torch, to_flax)


def _counter(prefix: str) -> _Entry:
    key = (_torch_name(prefix) + "." if prefix else "") + "num_batches_tracked"
    return _Entry(
        (), (key,), lambda _: [torch.zeros((), dtype=torch.int64)], lambda *_: [], optional=True
    )


def _plan(
    leaves: Mapping[str, _Leaf],
    rules: Sequence[Rule] | None,
    modules: Mapping[str, torch.nn.Module] | None,
) -> list[_Entry]:
    entries: list[_Entry] = []
    free = set(leaves)
    for pattern, rename, transform in rules or ():
        rx, t = re.compile(pattern), _as_transform(transform)
        for path in sorted(free):
            if rx.search(path):
                entries.append(_one(path, _torch_name(rx.sub(rename, path)), t))
                free.discard(path)
    for path in sorted(p for p in leaves if p.endswith("query/kernel")):
        prefix = path[: -len("query/kernel")].rstrip("/")
        if (entry := _attention(prefix, leaves, free)) is not None:
            entries.append(entry)
            free -= set(entry.paths)
    for path in sorted(p for p in leaves if p == "mean" or p.endswith("/mean")):
        prefix = path[: -len("mean")].rstrip("/")
        var = _join(prefix, "var")
        if leaves[path].collection == "batch_stats" and var in leaves:
            entries.append(_counter(prefix))
    builtin = [(re.compile(p), r, t) for p, r, t in BUILTIN_RULES]
    for path in sorted(free):
        key, t = _torch_name(path), IDENTITY  # no rule: the name alone
        for rx, rename, transform in builtin:
            if rx.search(path):
                key, t = _torch_name(rx.sub(rename, path)), _as_transform(transform)
                break
        if t is AUTO_KERNEL:
            owner = modules.get(key.rpartition(".")[0]) if modules is not None else None
            t = _kernel_layout(path, len(leaves[path].shape), owner)
        entries.append(_one(path, key, t))
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


# ----------------------------------------------------------------------------- checking


def _check(
    found: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]],
    expected: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]],
    found_name: str,
    expected_name: str,
    optional: Collection[str] = (),
) -> None:
    """Raises one StateDictError listing every missing/unexpected key and shape/dtype clash."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected) - set(optional))
    shapes, dtypes = [], []
    for k in sorted(set(found) & set(expected)):
        (fs, fd), (es, ed) = found[k], expected[k]
        if fs != es:
            hint = ""
            if sorted(fs) == sorted(es):
                hint = (
                    "  (kernel looks transposed: same dims in another order; Dense kernels are "
                    "(in, out) and Linear weights (out, in), conv kernels (*spatial, in, out) "
                    "and ConvNd weights (out, in, *spatial))"
                )
            shapes.append(f"    {k}: {found_name} {fs} vs {expected_name} {es}{hint}")
        elif fd is not None and ed is not None and fd != ed:
            dtypes.append(f"    {k}: {found_name} {fd} vs {expected_name} {ed}")
    if not (missing or unexpected or shapes or dtypes):
        return
    lines = [f"The {found_name} does not match the {expected_name} key for key:"]
    if missing:
        lines.append(f"  missing keys (expected by the {expected_name}, not in the {found_name}):")
        close = {m: difflib.get_close_matches(m, unexpected, n=1) for m in missing}
        lines += [
            f"    {m}" + (f"  (did you mean {c[0]!r}?)" if c else "") for m, c in close.items()
        ]
    if unexpected:
        lines.append(
            f"  unexpected keys (in the {found_name}, not expected by the {expected_name}):"
        )
        lines += [f"    {k}" for k in unexpected]
    if any(k.endswith(("running_mean", "running_var")) for k in missing + unexpected):
        lines.append(
            "  BatchNorm statistics appear on one side only: pass the whole variables dict "
            "{'params': ..., 'batch_stats': ...} (or the nnx State), not only the params."
        )
    if shapes:
        lines += ["  shape mismatches:", *shapes]
    if dtypes:
        lines += [
            "  dtype mismatches:",
            *dtypes,
            "    Fix the dtypes with export_state_dict(..., dtype=torch.float32) or by casting "
            "the module (e.g. `module.to(torch.bfloat16)`).",
        ]
    lines.append(
        "Fix: align layer names (Flax `layers_0` <-> torch `layers.0`, `a/b` <-> `a.b`), pass "
        "stacked=['prefix'] for scanned layers, or pass rules=[(regex, rename, transform)] for "
        "custom layers."
    )
    raise StateDictError("\n".join(lines))


# ----------------------------------------------------------------------------- tensors


def _leaf_to_torch(x: Any) -> torch.Tensor:
    """A host or device leaf -> torch, zero-copy where one buffer holds it all."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, jax.Array):
        if len(x.sharding.device_set) > 1:
            if x.is_fully_replicated:
                x = x.addressable_data(0)  # one replica, no transfer
            elif x.is_fully_addressable:
                x = jax.device_put(x, next(iter(x.sharding.device_set)))  # gather: one copy
            else:  # spread over processes: every process gets the whole array
                return _from_numpy(multihost_utils.process_allgather(x, tiled=True))
        return torch.from_dlpack(x)
    return _from_numpy(x)


def _from_numpy(x: Any) -> torch.Tensor:
    arr = np.asarray(x)
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


_JAX_DTYPES = {torch.bfloat16: jnp.bfloat16, torch.float8_e4m3fn: jnp.float8_e4m3fn}


def _to_numpy(t: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    """A torch tensor -> a fresh host numpy array of ``dtype`` (bf16 included)."""
    t = t.detach().cpu()
    if t.dtype in _JAX_DTYPES:
        arr = t.contiguous().view(torch.uint8).numpy().view(np.dtype(_JAX_DTYPES[t.dtype]))
        arr = arr.reshape(t.shape)
    else:
        arr = t.numpy()
    return np.array(arr, dtype=dtype, copy=True)


def _meta(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, device="meta")


def _prepare(
    params: PyTree, rules: Sequence[Rule] | None, stacked: Sequence[str], module: Any
) -> tuple[dict[str, _Leaf], dict[str, _Leaf], list[_Entry]]:
    real = _collect(params)
    if not real:
        raise StateDictError(
            f"No weights found in {type(params).__name__}: expected a params tree, a Flax "
            "variables dict {'params': ..., 'batch_stats': ...} or an nnx State. Fix: pass "
            "`variables`, `variables['params']` or `nnx.state(model)`."
        )
    leaves = _unstack(real, stacked)
    modules = dict(module.named_modules()) if module is not None else None
    return real, leaves, _plan(leaves, rules, modules)


def _module_spec(module: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}


# ----------------------------------------------------------------------------- public API


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
                whole[src] = _leaf_to_torch(leaf.value)
            xs.append(whole[src][leaf.stacked[1]] if leaf.stacked else whole[src])
        for key, tensor in zip(entry.keys, entry.to_torch(xs), strict=True):
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            out[key] = tensor
    if torch_module is not None:
        _check(
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
    _check(
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
        arr = _to_numpy(values[path], np.dtype(template.dtype))
        sharding = getattr(template, "sharding", None)  # jax.Array or jax.ShapeDtypeStruct
        if sharding is not None:
            return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])
        return jax.device_put(arr) if isinstance(template, jax.ShapeDtypeStruct) else arr

    return _rebuild(params, real, fill)


def _rebuild(params: PyTree, real: Mapping[str, _Leaf], fill: Callable[[str, Any], Any]) -> PyTree:
    if _is_nnx_state(params):
        from flax import nnx

        def swap(keys: Sequence[Any], var: Any) -> Any:
            path = _path(keys)
            if isinstance(var, nnx.Variable) and path in real:
                return var.copy(fill(path, var.get_value()))
            return var

        return jax.tree_util.tree_map_with_path(
            swap, params, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )

    def tree(sub: PyTree) -> PyTree:
        return jax.tree_util.tree_map_with_path(lambda k, x: fill(_path(k), x), sub)

    if _is_variables(params):
        return {c: tree(v) if c in COLLECTIONS else v for c, v in params.items()}
    return tree(params)


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
