"""What a traced ``LightningModule`` hook logs, and how: ``self.log`` options as
:class:`LogSpec`, torchmetrics calls as :class:`MetricCall`, the hooks and their defaults,
the keys a step's logs carry, and the host helpers that read them (used by
:mod:`torchshell.port._trace` and :mod:`torchshell.port._user`)."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import torch
from torchmetrics import Metric

from torchshell._errors import ConfigError
from torchshell.trace import TracedScalar

__all__ = [
    "APPENDED_KEY",
    "BATCH_SIZE_KEY",
    "GRADS_HOOK",
    "GRADS_HOOKS",
    "HOOKS",
    "METRIC_KEY",
    "STEP_KEY",
    "USER_KEY",
    "LogSpec",
    "MetricCall",
    "add_metric_states",
    "hook_key",
    "host_tensors",
    "torch_ints",
]

PyTree = Any

# Lightning's defaults of self.log per hook: (on_step, on_epoch).
HOOKS = {
    "training_step": (True, False),
    "validation_step": (False, True),
    "test_step": (False, True),
    "predict_step": (False, False),
    "on_after_backward": (True, False),
    "on_before_optimizer_step": (True, False),
}
# Hooks that read (and may change) the gradients before the optimizer step: run traced on
# the step's gradients (LightningPort.grads_fn), their logs kept under GRADS_HOOK.
GRADS_HOOKS = ("on_after_backward", "on_before_optimizer_step")
GRADS_HOOK = "on_before_optimizer_step"
_REDUCE = ("mean", "sum", "max", "min")
_METRIC_METHODS = ("forward", "update", "compute", "_cast_and_nan_check_input")
# torchmetrics objects run in these (their batch states added to the real metric on the host)
_METRIC_HOOKS = ("training_step", "validation_step", "test_step")
_COUNTERS = ("global_step", "current_epoch")  # Trainer progress a step may read


@dataclasses.dataclass(frozen=True)
class LogSpec:
    """How one ``self.log`` name is reported (Lightning's meaning of each option)."""

    name: str
    prog_bar: bool = False
    logger: bool | None = None  # as given: None logs when a logger exists, like Lightning
    on_step: bool = True
    on_epoch: bool = False
    reduce_fx: str = "mean"
    batch_size: int | None = None
    metric: str | None = None  # a torchmetrics object logged (its attribute path)
    add_dataloader_idx: bool = True  # several evaluation loaders: "name/dataloader_idx_N"
    host_call: int | None = None  # the batch value of that metric call, run on the host


@dataclasses.dataclass(frozen=True)
class MetricCall:
    """One call of a torchmetrics object in a traced evaluation step.

    The step computes the metric's states on the batch alone (``states``: name ->
    ``"sum"``/``"max"``/``"min"``, torchmetrics' ``dist_reduce_fx``) and, for ``forward``,
    its batch value; the host adds them to the user's real metric, as its ``update`` would.
    With ``host`` (a metric the step cannot run: :mod:`torchshell.port._host_metrics`) the
    host calls the metric itself on the tensors the step was given.
    """

    path: str
    forward: bool
    states: tuple[tuple[str, str], ...]
    host: Any = None  # HostArgs: the call runs on the host


METRIC_KEY = "metric_call/"  # logs keys of metric calls: metric_call/<i>/<state> or /value


def _state_reductions(metric: Metric) -> tuple[tuple[str, str], ...] | None:
    """``((state, "sum"|"max"|"min"), ...)``, or ``None`` when a state is not such a tensor."""
    from torchmetrics.utilities.data import dim_zero_max, dim_zero_min, dim_zero_sum

    kinds: dict[Any, str] = {dim_zero_sum: "sum", dim_zero_max: "max", dim_zero_min: "min"}
    out = []
    for name, default in metric._defaults.items():
        kind = kinds.get(metric._reductions[name])
        if kind is None or not isinstance(default, torch.Tensor):
            return None
        out.append((name, kind))
    return tuple(out)


def add_metric_states(
    module: torch.nn.Module, call: MetricCall, host: Mapping[str, Any], i: int
) -> None:
    """Adds one traced call's batch states (host arrays) to the user's real metric (``module``,
    a torchmetrics ``Metric`` found by its submodule path).

    The same as its ``update`` on that batch: states combined by their reduction, the update
    counted, the cached value cleared; a ``forward`` also leaves its batch value where
    Lightning reads it when the metric object is logged (``_forward_cache``).
    """
    if not isinstance(module, Metric):
        raise TypeError(f"{call.path}: a torchmetrics Metric was traced, found {module!r}")
    metric = module
    for name, kind in call.states:
        old = getattr(metric, name)
        value = np.array(host[f"{METRIC_KEY}{i}/{name}"])  # a copy (float32 from the step)
        new = torch.tensor(value if old.is_floating_point() else np.rint(value)).to(old.dtype)
        new = new.reshape(old.shape)
        if kind == "sum":
            setattr(metric, name, old + new)
        else:
            setattr(
                metric, name, torch.maximum(old, new) if kind == "max" else torch.minimum(old, new)
            )
    metric._update_count += 1
    metric._computed = None
    if call.forward:
        metric._forward_cache = torch.tensor(np.array(host[f"{METRIC_KEY}{i}/value"]))  # type: ignore[assignment]


BATCH_SIZE_KEY = "~batch_size/"  # in a step's logs: the batch_size= a self.log call gave
APPENDED_KEY = "~appended"  # in an evaluation step's logs: {list attribute: [values]}
USER_KEY = "~batch"  # a batch with static values (LightningPort.specialise): the user's batch
STEP_KEY = "~global_step"  # beside it: the Trainer's global_step for this batch (int32)
_MAX_STATIC = 8  # distinct static values before a warning


def _lists(module: torch.nn.Module) -> dict[str, int]:
    """The module's own list attributes and their lengths (``self.validation_step_outputs``)."""
    return {name: len(v) for name, v in vars(module).items() if isinstance(v, list)}


def _take_appended(module: torch.nn.Module, lengths: dict[str, int]) -> dict[str, list[Any]]:
    """What a traced hook appended to the module's lists, removed from them (tracers must not
    outlive the trace); the host appends their values after each step (Lightning 2's
    ``self.validation_step_outputs.append(loss)`` pattern)."""
    taken = {}
    for name, n in lengths.items():
        items = getattr(module, name, None)
        if isinstance(items, list) and len(items) > n:
            taken[name] = [item.x if isinstance(item, TracedScalar) else item for item in items[n:]]
            del items[n:]
    return taken


def host_tensors(tree: Any) -> Any:
    """A pytree of device (or numpy) arrays as torch tensors on the host (copies), with
    :func:`torch_ints`."""
    return torch_ints(jax.tree.map(lambda v: torch.from_numpy(np.array(v)), jax.device_get(tree)))


def torch_ints(tree: Any) -> Any:
    """``int32`` tensors as ``int64``: what a traced step returns to the user's code.

    JAX runs with x64 off, so torch's integer type (``argmax``, ``arange``, a ``long``
    label echoed back) computes as ``int32`` inside the step; the user's host code gets
    torch's ``int64`` back (``F.one_hot`` and class-index losses refuse ``int32``).

    Example:
        >>> torch_ints({"ids": torch.zeros(2, dtype=torch.int32)})["ids"].dtype
        torch.int64
    """

    def widen(v: Any) -> Any:
        return v.long() if isinstance(v, torch.Tensor) and v.dtype == torch.int32 else v

    return jax.tree.map(widen, tree)


def hook_key(hook: str, dataloader_idx: int | None = None) -> str:
    """Where :meth:`LightningPort.call` keeps a hook's logged names: per evaluation loader."""
    return hook if dataloader_idx is None else f"{hook}/{dataloader_idx}"


def _reduce_name(reduce_fx: Any) -> str:
    name = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "")
    name = {"amax": "max", "amin": "min"}.get(name, name)
    if name not in _REDUCE:
        raise ConfigError(
            f"self.log(reduce_fx={reduce_fx!r}) is not supported in a traced step: expected "
            f"one of {_REDUCE} (or torch.mean/sum/max/min). Fix: use one of them."
        )
    return name


def _nan_check_traced(metric: Any, x: Any, weight: Any = None) -> tuple[Any, Any]:
    """torchmetrics' aggregator input check, shape-static: NaN rows get a neutral value.

    torchmetrics drops NaN values (``nan_strategy="warn"``/``"ignore"``: boolean indexing, a
    shape that depends on values) or fills them (a float). Here a dropped value becomes one
    that changes nothing (weight 0 and value 0 for a mean or sum, -inf for a max, +inf for a
    min), the same result; ``"error"`` cannot raise inside a compiled step and lets the NaN
    through to the logged value instead.
    """
    dtype = metric.dtype
    x = x.to(dtype) if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=dtype)
    if weight is None:
        weight = torch.ones_like(x)
    elif not isinstance(weight, torch.Tensor):
        weight = torch.full_like(x, float(weight))
    weight = torch.broadcast_to(weight.to(dtype), x.shape)
    strategy = metric.nan_strategy
    if strategy in ("disable", "error"):
        return x, weight
    nans = torch.isnan(x) | torch.isnan(weight)
    if isinstance(strategy, float):
        return torch.where(nans, strategy, x), torch.where(nans, 1.0, weight)
    neutral = {"MaxMetric": -torch.inf, "MinMetric": torch.inf}.get(type(metric).__name__, 0.0)
    return torch.where(nans, neutral, x), torch.where(nans, 0.0, weight)


def _path_of(module: torch.nn.Module, metric: Metric) -> str:
    for path, sub in module.named_modules():
        if sub is metric:
            return path
    raise ConfigError(
        f"self.log got a {type(metric).__name__} that is not an attribute of the module: "
        "Lightning logs metric objects the module owns. Fix: assign it in __init__ "
        "(self.acc = ...)."
    )


class _ReadNoted(dict):  # type: ignore[type-arg]
    """A param group dict that notes, in ``read``, that its ``lr`` was read."""

    def __init__(self, group: dict[str, Any], read: set[str]) -> None:
        super().__init__(group)
        self._read = read

    def __getitem__(self, key: str) -> Any:
        if key == "lr":
            self._read.add("lr")
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        if key == "lr":
            self._read.add("lr")
        return super().get(key, default)


def _counting_class(
    cls: type, read: set[str], values: Mapping[str, Callable[[], Any]] | None = None
) -> type:
    """``cls`` whose ``global_step``/``current_epoch`` record, in ``read``, that they were read.

    The user's module wears this class while a step is traced (and its own class again after):
    the values themselves are the ones ``cls`` gives, or ``values[name]()`` where given (a
    traced ``global_step``).
    """
    given = dict(values or {})

    def counter(name: str) -> property:
        base = getattr(cls, name)

        def get(self: Any) -> Any:
            read.add(name)
            return given[name]() if name in given else base.__get__(self, cls)

        return property(get)

    attrs: dict[str, Any] = {name: counter(name) for name in _COUNTERS}
    attrs.update(__module__=cls.__module__, __qualname__=cls.__qualname__)
    return type(cls.__name__, (cls,), attrs)


def _warn_at(method: Any, where: str, name: str) -> None:
    """Warns, at the user's method, that it read a value frozen when the step is traced."""
    if name == "lr":
        message = (
            f"{where} reads the optimizer's lr: the compiled step is traced once, so every "
            "step sees the lr at trace time, where plain Lightning gives the scheduled one "
            "(the step itself does use the scheduled lr). Fix: to log it, "
            "Trainer(callbacks=[LearningRateMonitor()]) logs lr-<Optimizer> every step."
        )
    else:
        message = (
            f"{where} reads self.{name}: the compiled step is traced once, so every step sees "
            "its value at trace time, where plain Lightning gives the current one (in "
            "training_step it is the Trainer's, step by step). Fix: "
            "for an lr warmup or decay use a torch lr scheduler in configure_optimizers "
            "(mapped per step); for a loss weight that changes over training, compute it from "
            "a batch field."
        )
    try:
        filename = inspect.getsourcefile(method) or "<unknown>"
        lineno = inspect.getsourcelines(method)[1]
    except (OSError, TypeError):
        filename, lineno = "<unknown>", 0
    warnings.warn_explicit(message, UserWarning, filename, lineno)
