"""A mapped optimizer's JAX state <-> torch's ``optimizer.state_dict()`` (and the schedulers').

The way in: a plain Lightning checkpoint's ``optimizer_states[0]`` becomes the
:class:`~torchshell.optim._rules.TorchOptState` the JAX step continues from. The exit
door: the JAX state becomes the ``optimizer.state_dict()`` and ``scheduler.state_dict()`` list
that plain Lightning writes into (and resumes from) a ``.ckpt``. The slot names are torch's own
(``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``square_avg``,
``grad_avg``, ``sum``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchshell._errors import ConfigError
from torchshell.optim._map import MappedOptimizer, Source
from torchshell.optim._rules import TorchOptState
from torchshell.optim._sched import run_schedule

_NO_STEP = "SGD"  # torch.optim.SGD keeps no per-parameter step count


def _source(mapped: MappedOptimizer) -> Source:
    if mapped.source is None:
        raise ConfigError(
            "this MappedOptimizer carries no snapshot of its torch optimizer; build it with "
            "map_configure_optimizers to convert optimizer state"
        )
    return mapped.source


def state_from_torch(
    mapped: MappedOptimizer,
    torch_state: Mapping[str, Any],
    params: Mapping[str, jax.Array],
    *,
    step: int | None = None,
) -> TorchOptState:
    """The JAX optimizer state for torch's ``optimizer.state_dict()`` (e.g. from a ``.ckpt``).

    Args:
        mapped: the mapping of the same ``configure_optimizers()``.
        torch_state: ``optimizer.state_dict()`` (a Lightning checkpoint's
            ``optimizer_states[0]``).
        params: the JAX params ``{name: array}`` (shapes and dtypes of the slots).
        step: optimizer steps already taken (Lightning's ``global_step``); default: torch's
            per-parameter ``step`` (SGD has none: 0).

    Returns:
        The state ``mapped.tx.update`` continues from.

    Raises:
        ConfigError: the state is of a different optimizer layout (groups, sizes, shapes).

    >>> import jax.numpy as jnp
    >>> from torchshell.optim._map import map_configure_optimizers
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    >>> w.grad = torch.ones(2); opt.step()
    >>> m = map_configure_optimizers(opt, {"w": w}, steps_per_epoch=None, total_steps=2)
    >>> s = state_from_torch(m, opt.state_dict(), {"w": jnp.ones(2)}, step=1)
    >>> s.slots["w"]["momentum_buffer"].tolist(), int(s.step)
    ([1.0, 1.0], 1)
    """
    cls = type(_source(mapped).optimizer).__name__
    groups = list(torch_state.get("param_groups", ()))
    theirs = [len(g["params"]) for g in groups]
    ours = [len(names) for names in mapped.torch_names]
    if theirs != ours:
        raise ConfigError(
            f"the {cls} state has param groups of sizes {theirs}, this module's optimizer "
            f"{ours}: it belongs to another configure_optimizers(); resume without the "
            "optimizer state (weights only), or make the param groups match"
        )
    base = mapped.tx.init(params)
    slots = {n: dict(s) for n, s in base.slots.items()}
    steps = []
    for group, names in zip(groups, mapped.torch_names, strict=True):
        for index, name in zip(group["params"], names, strict=True):
            entry = torch_state.get("state", {}).get(index)
            if name is None or not entry or name not in slots:
                continue
            if "step" in entry:
                steps.append(int(float(entry["step"])))
            for key in list(slots[name]):
                if key == "has_momentum_buffer":
                    slots[name][key] = jnp.asarray(entry.get("momentum_buffer") is not None)
                elif isinstance(entry.get(key), torch.Tensor):
                    value = entry[key].detach().cpu()
                    want = slots[name][key]  # the parameter's shape, or () (NAdam mu_product)
                    if tuple(value.shape) != tuple(want.shape):
                        raise ConfigError(
                            f"the {cls} state's {key} of {name} has shape {tuple(value.shape)}, "
                            f"this optimizer's {tuple(want.shape)}; resume without the "
                            "optimizer state"
                        )
                    slots[name][key] = jnp.asarray(value.numpy(), dtype=want.dtype)
    taken = step if step is not None else max(steps, default=0)
    scale = None
    if mapped.plateau:  # the lr a plateau scheduler reached, as a factor on the table's
        tables = [float(spec.at(taken)["lr"]) for spec in mapped.groups]
        scale = jnp.asarray(
            [float(g["lr"]) / t if t else 1.0 for g, t in zip(groups, tables, strict=True)],
            jnp.float32,
        )
    return TorchOptState(jnp.asarray(taken, jnp.int32), slots, scale)


def state_to_torch(
    mapped: MappedOptimizer, state: TorchOptState
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """torch's ``optimizer.state_dict()`` and the schedulers' ``state_dict()`` list for ``state``.

    They are what the user's objects would hold after ``state.step`` optimizer steps in plain
    Lightning (what a Lightning ``.ckpt`` stores as ``optimizer_states[0]`` and
    ``lr_schedulers``), so ``optimizer.load_state_dict`` / ``scheduler.load_state_dict`` resume
    from them.

    Args:
        mapped: the mapping the state belongs to.
        state: the JAX optimizer state (``mapped.tx``'s).

    Returns:
        ``(optimizer_state_dict, [scheduler_state_dict, ...])``.

    >>> import jax.numpy as jnp
    >>> from torchshell.optim._map import map_configure_optimizers
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.Adam([w], lr=0.1)
    >>> m = map_configure_optimizers(opt, {"w": w}, steps_per_epoch=None, total_steps=2)
    >>> p = {"w": jnp.ones(2)}
    >>> _, s = m.tx.update({"w": jnp.ones(2)}, m.tx.init(p), p)
    >>> sd, scheds = state_to_torch(m, s)
    >>> sorted(sd["state"][0]), float(sd["state"][0]["step"]), scheds
    (['exp_avg', 'exp_avg_sq', 'step'], 1.0, [])
    """
    source = _source(mapped)
    cls = type(source.optimizer).__name__
    taken = int(state.step)
    _, opt_copy, sched_copies = run_schedule(
        source.optimizer, list(source.configs), total_steps=taken, **source.stepping
    )
    optimizer_sd = opt_copy.state_dict()  # param_groups as they stand after `taken` steps
    if state.scale is not None:  # a plateau scheduler's reductions so far
        for group, factor in zip(
            optimizer_sd["param_groups"], np.asarray(state.scale), strict=True
        ):
            group["lr"] = float(group["lr"]) * float(factor)
    torch_state: dict[int, dict[str, Any]] = {}
    for group, names in zip(optimizer_sd["param_groups"], mapped.torch_names, strict=True):
        for index, name in zip(group["params"], names, strict=True):
            slots = state.slots.get(name) if name is not None else None
            if slots is None:
                continue
            entry = {
                k: torch.from_numpy(np.array(v))
                for k, v in slots.items()
                if not k.startswith("has_")
            }
            if cls == _NO_STEP:
                if slots and bool(slots["has_momentum_buffer"]):
                    torch_state[index] = entry
                continue
            if taken == 0 and cls != "Adagrad":  # torch creates the state at the first step
                continue
            torch_state[index] = {"step": torch.tensor(float(taken)), **entry}
    optimizer_sd["state"] = torch_state
    return optimizer_sd, [s.state_dict() for s in sched_copies]
