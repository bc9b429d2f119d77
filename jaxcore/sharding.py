"""Partition rules: ordered ``[(regex, PartitionSpec)]`` over '/'-joined param paths.

One function, :func:`plan_shardings`, turns a tree of arrays (or abstract shapes) and the
rules into ``NamedSharding``s. The first rule whose regex ``re.search``-es a leaf's path wins;
a leaf that no rule matches is replicated. Because optimizer moments mirror the params (their
paths end with the param path, e.g. ``opt_state/inner_state/0/mu/layers_0/kernel``), the same
rules shard params and optimizer state alike. Scalars (step counters, learning rates) are
always replicated.

A spec entry may be :data:`LARGEST` (or a :class:`Largest` for another axis): "shard the
largest dimension that the axis divides", which is how the ``fsdp`` preset is written.

Presets (:func:`preset_rules`):

- ``dp``: no rules; params replicated, the batch split over the data axis.
- ``fsdp``: every leaf sharded over the data axis on its largest divisible dimension.
- ``tp``: Megatron column/row splits of Dense kernels over the model axis (see
  :func:`preset_rules` for the names it knows); combine with dp through the mesh shape
  (e.g. ``{"data": 4, "model": 2}``).
- ``fsdp_tp``: the ``tp`` rules, then ``fsdp`` for everything else.

Under a sharded preset every leaf over ``report_bytes`` (1 MiB) that no rule shards is
reported (logged and returned in :attr:`ShardingPlan.unmatched`), never silently replicated.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from jaxcore._errors import ShardingError

PyTree = Any
Rule = tuple[str, PartitionSpec]

logger = logging.getLogger("jaxcore.sharding")

PRESETS = ("dp", "fsdp", "tp", "fsdp_tp")
REPORT_BYTES = 1 << 20


@dataclass(frozen=True)
class Largest:
    """Spec entry: shard the leaf's largest dimension that ``axis`` divides (else replicate).

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> rules = [(".*", P(Largest("data")))]
    """

    axis: str = "data"


LARGEST = Largest("data")


@dataclass(frozen=True)
class Unmatched:
    """A large leaf that no rule shards: its path, shape and size in bytes."""

    path: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class ShardingPlan:
    """What :func:`plan_shardings` decided.

    Attributes:
        specs: a tree of ``PartitionSpec`` matching the input tree.
        shardings: the same tree as ``NamedSharding``s on the mesh.
        unmatched: leaves over the report threshold that no rule shards.
    """

    specs: PyTree
    shardings: PyTree
    unmatched: tuple[Unmatched, ...]


def _key_name(key: Any) -> str:
    if isinstance(key, DictKey):
        return str(key.key)
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, SequenceKey | FlattenedIndexKey):
        return str(key.idx)
    return str(key)


def path_str(path: Sequence[Any]) -> str:
    """The '/'-joined name of a ``jax.tree_util`` key path.

    Example:
        >>> import jax
        >>> leaves = jax.tree_util.tree_flatten_with_path({"a": {"b": [0, 1]}})[0]
        >>> [path_str(p) for p, _ in leaves]
        ['a/b/0', 'a/b/1']
    """
    return "/".join(_key_name(k) for k in path)


def preset_rules(preset: str, *, data_axis: str = "data", model_axis: str = "model") -> list[Rule]:
    """The rules of a named preset.

    ``tp`` knows these Dense kernels (Flax names): column-parallel (output features split,
    with their bias) ``query``, ``key``, ``value``, ``q_proj``, ``k_proj``, ``v_proj``,
    ``qkv``, ``fc1``, ``wi``, ``up_proj``, ``gate_proj``, ``mlp_in`` and the even MLP layers
    ``layers_0``, ``layers_2``, ...; row-parallel (input features split, bias replicated)
    ``out``, ``o_proj``, ``out_proj``, ``fc2``, ``wo``, ``down_proj``, ``mlp_out`` and the odd
    layers ``layers_1``, ``layers_3``, .... Multi-head ``DenseGeneral`` kernels
    (``[d, heads, head_dim]`` / ``[heads, head_dim, d]``) are split on the heads.

    Args:
        preset: one of :data:`PRESETS`.
        data_axis: the mesh axis of the batch (fsdp shards over it).
        model_axis: the mesh axis of tensor parallelism.

    Returns:
        Ordered ``[(regex, PartitionSpec)]``.

    Raises:
        ShardingError: for an unknown preset.

    Example:
        >>> len(preset_rules("dp"))
        0
        >>> preset_rules("fsdp")[0][0]
        '.*'
    """
    if preset not in PRESETS:
        raise ShardingError(
            f"Unknown sharding preset {preset!r}; expected one of {PRESETS}. "
            "Fix: set mesh.preset to one of them, or give explicit mesh.rules."
        )
    m = model_axis
    col = r"(query|key|value|q_proj|k_proj|v_proj|qkv|fc1|wi|up_proj|gate_proj|mlp_in)"
    row = r"(out|o_proj|out_proj|fc2|wo|down_proj|mlp_out)"
    tp: list[Rule] = [
        # multi-head DenseGeneral: kernel [d, H, hd] / bias [H, hd]; out kernel [H, hd, d]
        (rf"(^|/){col}/kernel$", PartitionSpec(None, m)),
        (rf"(^|/){col}/bias$", PartitionSpec(m)),
        (rf"(^|/){row}/kernel$", PartitionSpec(m)),
        (rf"(^|/){row}/bias$", PartitionSpec()),
        (r"(^|/)layers_\d*[02468]/kernel$", PartitionSpec(None, m)),
        (r"(^|/)layers_\d*[02468]/bias$", PartitionSpec(m)),
        (r"(^|/)layers_\d*[13579]/kernel$", PartitionSpec(m, None)),
        (r"(^|/)layers_\d*[13579]/bias$", PartitionSpec()),
    ]
    fsdp: list[Rule] = [(".*", PartitionSpec(Largest(data_axis)))]
    return {"dp": [], "fsdp": fsdp, "tp": tp, "fsdp_tp": tp + fsdp}[preset]


def parse_rules(rules: Sequence[Sequence[Any]]) -> list[Rule]:
    """Rules from plain data (e.g. YAML): ``[[regex, [axis_or_null, ...]], ...]``.

    An entry ``"largest:AXIS"`` (or ``"largest"`` for ``data``) becomes :class:`Largest`; a
    list entry is a tuple of axes (one dimension over several axes).

    Example:
        >>> parse_rules([["head/kernel", [None, "model"]]])
        [('head/kernel', P(None, 'model'))]
    """
    out: list[Rule] = []
    for rule in rules:
        if isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[1], PartitionSpec):
            out.append((str(rule[0]), rule[1]))
            continue
        if len(rule) != 2 or not isinstance(rule[0], str):
            raise ShardingError(
                f"A sharding rule is [regex, [axis_or_null, ...]], got {rule!r}. "
                'Fix: write e.g. ["layers_0/kernel", [null, "model"]].'
            )
        entries: list[Any] = []
        for e in list(rule[1] or []):
            if isinstance(e, str) and e.startswith("largest"):
                entries.append(Largest(e.partition(":")[2] or "data"))
            elif isinstance(e, Sequence) and not isinstance(e, str):
                entries.append(tuple(e))
            else:
                entries.append(e)
        out.append((rule[0], PartitionSpec(*entries)))
    return out


def _axes_of(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _resolve(path: str, shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> PartitionSpec:
    """Replaces :class:`Largest` entries and checks axes and divisibility."""
    entries = list(spec)
    if len(entries) > len(shape):
        raise ShardingError(
            f"Param {path!r} of shape {shape} has {len(shape)} dims, but its spec {spec} "
            f"names {len(entries)}. Fix: shorten the spec or make the rule's regex stricter."
        )
    largest = [e for e in entries if isinstance(e, Largest)]
    if largest:
        axis = largest[0].axis
        if axis not in mesh.shape:
            raise ShardingError(
                f"Param {path!r}: spec {spec} shards over axis {axis!r}, but the mesh has axes "
                f"{tuple(mesh.shape)}. Fix: use a mesh axis name."
            )
        ways = mesh.shape[axis]
        dims = sorted(range(len(shape)), key=lambda d: (-shape[d], d))
        pick = next((d for d in dims if ways > 1 and shape[d] % ways == 0), None)
        entries = [None] * len(shape)
        if pick is not None:
            entries[pick] = axis
    while entries and entries[-1] is None:  # P("data", None) is P("data")
        entries.pop()
    for dim, entry in enumerate(entries):
        axes = _axes_of(entry)
        unknown = [a for a in axes if a not in mesh.shape]
        if unknown:
            raise ShardingError(
                f"Param {path!r}: spec {PartitionSpec(*entries)} names mesh axes {unknown}, "
                f"but the mesh has axes {tuple(mesh.shape)}. Fix: use the mesh's axis names "
                "or add the axis to mesh.axes."
            )
        ways = math.prod(mesh.shape[a] for a in axes)
        if shape[dim] % ways:
            raise ShardingError(
                f"Param {path!r} of shape {shape}: dimension {dim} (size {shape[dim]}) is not "
                f"divisible by {ways} under spec {PartitionSpec(*entries)} on mesh "
                f"{dict(mesh.shape)}. Fix: change the layer width to a multiple of {ways}, "
                "change the mesh axes, or add an earlier rule for this param."
            )
    return PartitionSpec(*entries)


def plan_shardings(
    tree: PyTree,
    mesh: Mesh,
    rules: Sequence[Rule],
    *,
    report_bytes: int | None = REPORT_BYTES,
) -> ShardingPlan:
    """Applies ordered rules to every leaf of ``tree`` (arrays or ``ShapeDtypeStruct``s).

    Args:
        tree: params, optimizer state or a whole ``TrainState`` (shapes are enough).
        mesh: the device mesh.
        rules: ordered ``[(regex, PartitionSpec)]``; the first ``re.search`` match wins.
        report_bytes: report unsharded leaves larger than this; ``None`` reports nothing.

    Returns:
        The :class:`ShardingPlan`.

    Raises:
        ShardingError: a rule names an unknown axis, has more dims than the leaf, or splits a
            dimension its axes do not divide (the message names the param, shape and spec).

    Example:
        >>> import jax, jax.numpy as jnp, jaxcore
        >>> mesh = jaxcore.make_mesh({"data": -1})
        >>> plan = plan_shardings({"w": jnp.zeros((64, 8))}, mesh, preset_rules("fsdp"))
        >>> plan.specs["w"] == jax.sharding.PartitionSpec("data") or mesh.size == 1
        True
    """
    compiled = [(re.compile(rx), spec) for rx, spec in rules]
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    specs: list[PartitionSpec] = []
    unmatched: list[Unmatched] = []
    for key_path, leaf in leaves:
        path = path_str(key_path)
        shape = tuple(getattr(leaf, "shape", ()))
        spec = PartitionSpec()
        if shape:
            rule = next((s for rx, s in compiled if rx.search(path)), None)
            if rule is not None:
                spec = _resolve(path, shape, rule, mesh)
            dtype = getattr(leaf, "dtype", None)
            nbytes = math.prod(shape) * (dtype.itemsize if dtype is not None else 4)
            sharded = any(mesh.shape[a] > 1 for e in spec for a in _axes_of(e))
            auto = rule is not None and any(isinstance(e, Largest) for e in rule)
            missed = rule is None or (auto and not sharded)
            if report_bytes is not None and compiled and missed and nbytes > report_bytes:
                unmatched.append(Unmatched(path, shape, nbytes))
        specs.append(spec)
    for u in unmatched:
        logger.warning(
            "No sharding rule shards %s %s (%.1f MiB): it is replicated on every device. "
            "Add a rule for it to mesh.rules.",
            u.path,
            u.shape,
            u.nbytes / 2**20,
        )
    spec_tree = jax.tree_util.tree_unflatten(treedef, specs)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), spec_tree)
    return ShardingPlan(spec_tree, shardings, tuple(unmatched))


def sharding_rules(
    preset: str | None = "dp",
    rules: Sequence[Any] | None = None,
    *,
    data_axis: str = "data",
    model_axis: str = "model",
) -> list[Rule]:
    """User rules first, then the preset's: the one rule list a run uses.

    Example:
        >>> [rx for rx, _ in sharding_rules("fsdp", [["head/kernel", []]])]
        ['head/kernel', '.*']
    """
    user = parse_rules(rules or [])
    base = preset_rules(preset, data_axis=data_axis, model_axis=model_axis) if preset else []
    return user + base


def state_sharding_fn(
    mesh: Mesh,
    preset: str | None = "dp",
    rules: Sequence[Any] | None = None,
    *,
    data_axis: str = "data",
    model_axis: str = "model",
    report_bytes: int | None = REPORT_BYTES,
) -> Callable[[PyTree], PyTree]:
    """``abstract_state -> shardings``, for ``init_train_state(param_shardings=...)``.

    Args:
        mesh: the device mesh.
        preset: one of :data:`PRESETS`, or ``None`` for the explicit ``rules`` only.
        rules: explicit rules, tried before the preset's (``[(regex, PartitionSpec)]`` or
            the plain-data form of :func:`parse_rules`).
        data_axis: the batch's mesh axis.
        model_axis: the tensor-parallel mesh axis.
        report_bytes: report unsharded leaves over this size (under a sharded preset).

    Returns:
        A function mapping an abstract (or real) ``TrainState`` to its ``NamedSharding`` tree.

    Example:
        >>> import jax.numpy as jnp, jaxcore
        >>> from jaxcore.models.digits import MLP
        >>> mesh = jaxcore.make_mesh({"data": -1})
        >>> st = jaxcore.init_train_state(jaxcore.linen_model(MLP(features=(64,))),
        ...     jaxcore.make_optimizer(), {"x": jnp.ones((8, 64))}, seed=0, mesh=mesh,
        ...     param_shardings=state_sharding_fn(mesh, "fsdp"))
        >>> kernel = st.params["layers_0"]["kernel"]  # [64, 64], one slice per device
        >>> kernel.addressable_shards[0].data.size * mesh.size == kernel.size
        True
    """
    full = sharding_rules(preset, rules, data_axis=data_axis, model_axis=model_axis)

    def fn(abstract_state: PyTree) -> PyTree:
        return plan_shardings(abstract_state, mesh, full, report_bytes=report_bytes).shardings

    return fn


def batch_sharding(
    mesh: Mesh, *, data_axis: str | tuple[str, ...] = "data", steps_per_call: int = 1
) -> NamedSharding:
    """The batch's sharding: rows split over ``data_axis`` (after the K axis when K > 1).

    Example:
        >>> import jaxcore
        >>> batch_sharding(jaxcore.make_mesh({"data": -1}), steps_per_call=4).spec
        P(None, 'data')
    """
    spec = PartitionSpec(data_axis) if steps_per_call == 1 else PartitionSpec(None, data_axis)
    return NamedSharding(mesh, spec)
