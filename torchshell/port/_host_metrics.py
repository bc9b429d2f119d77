"""torchmetrics objects updated on the host, as plain Lightning updates them (eagerly).

A metric whose ``update`` (or ``compute``) needs a shape that depends on values (torchmetrics'
``ignore_index``: ``preds[target != ignore_index]``) or whose state is a list (AUROC's
``cat``) cannot run inside a compiled step. Its call there records what it was given
instead: the tensors leave the step beside its outputs (in the hook's appended values under
:data:`HOST_ARGS`), and the host then calls the user's real metric with them, eagerly. Its
logged object (``self.log("val/f1", self.val_f1)``) works as in Lightning; the batch value a
``forward`` returns is only known after the step: inside the step it is a
:class:`HostValue`, which an evaluation hook may log and nothing may compute with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as torch_pytree

from torchshell._errors import ConfigError
from torchshell.port._logs import MetricCall, add_metric_states

__all__ = ["HOST_ARGS", "HostArgs", "HostValue", "run_metric_calls", "split_args"]

HOST_ARGS = "~metric_args"  # in a hook's appended values: per metric call, its tensors


@dataclasses.dataclass(frozen=True)
class HostArgs:
    """A metric call's arguments with their tensors left out (``None`` where one was)."""

    spec: Any  # torch's pytree spec of ``(args, kwargs)``
    statics: tuple[Any, ...]  # the leaves: a Python value, or None where a tensor was


def split_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[HostArgs, list[Any]]:
    """``(args, kwargs)`` as their static part and their tensors (traced, to leave the step).

    Example:
        >>> host, tensors = split_args((torch.ones(2), "x"), {"k": 1})
        >>> host.statics, len(tensors)
        ((None, 'x', 1), 1)
    """
    leaves, spec = torch_pytree.tree_flatten((args, kwargs))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    statics = tuple(None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)
    return HostArgs(spec, statics), tensors


def run_host_call(metric: Any, forward: bool, host: HostArgs, tensors: Sequence[Any]) -> Any:
    """The user's metric called on the host with the step's tensors (torch, on the host):
    ``metric(*args)`` (its batch value, returned, and ``_forward_cache`` as Lightning reads
    it) or ``metric.update(*args)`` (None)."""
    given = iter(tensors)
    leaves = [next(given) if s is None else s for s in host.statics]
    args, kwargs = torch_pytree.tree_unflatten(leaves, host.spec)
    if forward:
        return metric(*args, **kwargs)
    metric.update(*args, **kwargs)
    return None


def run_metric_calls(
    user: torch.nn.Module,
    calls: Sequence[MetricCall],
    host: Mapping[str, Any] | None,
    tensors: Sequence[Any] | None,
) -> list[Any]:
    """A hook's metric calls on the user's real metrics, in order: the traced ones' batch
    states added (``host``: the step's logs, on the host), the others run on ``tensors`` (per
    call, torch tensors: :data:`HOST_ARGS`); a ``None`` of the two skips its kind. Their
    batch values (a host ``forward``'s; else None)."""
    values: list[Any] = []
    for i, call in enumerate(calls):
        metric = user.get_submodule(call.path)
        if call.host is None and host is not None:
            add_metric_states(metric, call, host, i)
        elif call.host is not None and tensors is not None:
            values.append(run_host_call(metric, call.forward, call.host, tensors[i]))
            continue
        values.append(None)
    return values


class HostValue:
    """The batch value of a metric that runs on the host, inside the traced step.

    Only an evaluation hook's ``self.log(name, value)`` takes it (the host logs the value its
    real metric returned); any computation with it is refused: the value does not exist
    until the step has run.
    """

    def __init__(self, owner: str, hook: str, path: str, why: str, index: int) -> None:
        self.where = (owner, hook, path, why)
        self.index = index  # the metric call's, in the hook

    def refusal(self, what: str = "computes with") -> ConfigError:
        owner, hook, path, why = self.where
        use = (
            f"log the metric object (self.log(name, self.{path}): its batch value on step, its "
            "compute() over the epoch), or compute the value you need with masks from torch "
            "ops of the batch (keep = y != -100; ((preds == y) & keep).sum() / keep.sum())"
        )
        return ConfigError(
            f"{owner}.{hook} {what} the batch value of self.{path}, a torchmetrics metric "
            f"that runs on the host ({why}): its value exists only after the compiled step "
            f"has run. Fix: {use}."
        )

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        value = next(a for a in torch_pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        raise value.refusal()

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise self.refusal()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise self.refusal()

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __truediv__ = __rtruediv__ = __pow__ = __rpow__ = __neg__ = __float__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __int__ = __index__ = _refuse
