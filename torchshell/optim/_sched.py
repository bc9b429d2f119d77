"""Lightning's ``configure_optimizers`` parsing, and torch schedulers simulated into step tables.

The user's optimizer and schedulers are deep-copied together (the copy's schedulers drive the
copy's optimizer; parameters and ``LambdaLR`` callables are shared, not copied) and stepped on the
host exactly as Lightning's training loop steps them; each param group's hyperparameters are
recorded before every optimizer step. The user's own objects are never touched.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.core.optimizer import (
    _configure_optimizers,
    _configure_schedulers_automatic_opt,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from torchshell._errors import ConfigError

FIX = "pass optimizer= an optax transform to JaxModule.from_lightning(...) instead"


def parse_configure_optimizers(
    returned: Any,
) -> tuple[torch.optim.Optimizer, list[LRSchedulerConfig]]:
    """Parse a ``configure_optimizers()`` return value with Lightning's own parser.

    Args:
        returned: what ``LightningModule.configure_optimizers()`` returned, in any form Lightning
            accepts.

    Returns:
        The one optimizer and its scheduler configs (``interval``, ``frequency``, ``name``).

    Raises:
        ConfigError: nothing returned, several optimizers, a plateau scheduler stepped per
            batch, a scheduler of another optimizer, or a form Lightning itself rejects.

    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> opt = torch.optim.SGD([w], lr=0.1)
    >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    >>> o, cfgs = parse_configure_optimizers(([opt], [{"scheduler": sched, "interval": "step"}]))
    >>> o is opt, cfgs[0].interval, cfgs[0].frequency
    (True, 'step', 1)
    """
    if returned is None:
        raise ConfigError(
            "configure_optimizers() returned None: from_lightning needs the torch optimizer to "
            f"map onto optax; return one from configure_optimizers, or {FIX}"
        )
    try:
        optimizers, schedulers, monitor = _configure_optimizers(returned)
        configs = _configure_schedulers_automatic_opt(schedulers, monitor)
    except MisconfigurationException as err:
        raise ConfigError(
            f"configure_optimizers() returned a value Lightning cannot use: {err}; "
            f"return a form Lightning accepts, or {FIX}"
        ) from err
    optimizers = [getattr(o, "_optimizer", o) for o in optimizers]  # a LightningOptimizer
    if len(optimizers) != 1:
        names = ", ".join(type(o).__name__ for o in optimizers)
        if not optimizers:
            raise ConfigError(
                "configure_optimizers() returned no optimizer; from_lightning maps exactly "
                f"one (automatic optimization); return one, or {FIX}"
            )
        raise ConfigError(
            f"configure_optimizers() returned {len(optimizers)} optimizers ({names}); "
            "under automatic optimization from_lightning maps exactly one (Lightning 2 "
            "refuses several there too). Fix: set `self.automatic_optimization = False` in "
            "__init__ and step them in training_step (`opt_g, opt_d = self.optimizers()`, "
            "`self.manual_backward(loss)`, `opt.step()`, `opt.zero_grad()`), which "
            "from_lightning traces with each optimizer mapped; or return one optimizer "
            f"over all the parameters (param groups keep their own settings); or {FIX}"
        )
    (optimizer,) = optimizers
    for config in configs:
        sched = config.scheduler
        if is_plateau(config) and config.interval != "epoch":
            raise ConfigError(
                f"{type(sched).__name__} with interval={config.interval!r}: "
                "from_lightning steps a plateau scheduler at the end of each epoch (after "
                "validation), on the host; use interval='epoch' (Lightning's default), or " + FIX
            )
        if not isinstance(sched, LRScheduler):
            raise ConfigError(
                f"the lr scheduler {type(sched).__name__} is not a torch.optim.lr_scheduler."
                f"LRScheduler and cannot be mapped; {FIX}"
            )
        if getattr(sched, "optimizer", None) is not optimizer:
            raise ConfigError(
                f"the lr scheduler {type(sched).__name__} drives another optimizer than the one "
                f"returned ({type(optimizer).__name__}); build it on that optimizer, or {FIX}"
            )
        if not isinstance(config.frequency, int) or config.frequency < 1:
            raise ConfigError(
                f"lr scheduler frequency must be a positive int, got {config.frequency!r}"
            )
    return optimizer, configs


def is_plateau(config: LRSchedulerConfig) -> bool:
    """Whether a scheduler steps on a monitored metric (``ReduceLROnPlateau``).

    Its lr changes are not tabulated: the host steps it after validation and hands the
    step a per-group factor (``TorchOptState.scale``).
    """
    return isinstance(config.scheduler, ReduceLROnPlateau) or bool(config.reduce_on_plateau)


def read_group(group: dict[str, Any]) -> dict[str, Any]:
    """A torch param group's hyperparameters as plain Python values (``betas`` split in two).

    >>> read_group({"params": [], "lr": torch.tensor(0.5), "betas": (0.9, 0.99), "amsgrad": False})
    {'lr': 0.5, 'beta1': 0.9, 'beta2': 0.99, 'amsgrad': False}
    """
    out: dict[str, Any] = {}
    for key, value in group.items():
        if key == "params":
            continue
        if key == "betas":
            out["beta1"], out["beta2"] = (_plain(b) for b in value)
        else:
            out[key] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


def _private_copy(
    optimizer: torch.optim.Optimizer, schedulers: Sequence[LRScheduler]
) -> tuple[torch.optim.Optimizer, list[LRScheduler]]:
    memo: dict[int, Any] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            memo[id(p)] = p  # share the parameters: a scheduler never reads them
    pending = list(schedulers)
    while pending:
        sched = pending.pop()
        for fn in getattr(sched, "lr_lambdas", ()):
            memo[id(fn)] = fn  # a bound method would otherwise deep-copy its module
        pending.extend(getattr(sched, "_schedulers", ()))
    try:
        opt_copy, sched_copies = copy.deepcopy((optimizer, list(schedulers)), memo)
    except Exception as err:
        names = ", ".join(type(s).__name__ for s in schedulers)
        raise ConfigError(
            f"the lr scheduler(s) {names} could not be copied to tabulate them ({err!r}); "
            f"make them deep-copyable, or {FIX}"
        ) from err

    def step_noop(*args: Any, **kwargs: Any) -> None:
        return None

    step_noop._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt_copy.step = step_noop  # type: ignore[method-assign,assignment]
    opt_copy._opt_called = True  # type: ignore[attr-defined]
    return opt_copy, sched_copies


def simulate(
    optimizer: torch.optim.Optimizer,
    configs: Sequence[LRSchedulerConfig],
    *,
    steps_per_epoch: int | None,
    total_steps: int,
    accumulate_grad_batches: int = 1,
    batches_per_epoch: int | None = None,
) -> list[dict[str, list[Any]]]:
    """Each param group's hyperparameters at every optimizer step, as Lightning steps schedulers.

    Lightning (``training_epoch_loop._update_learning_rates``) steps a ``"step"`` scheduler after
    an optimizer step when ``(batch_idx + 1) % frequency == 0`` (``batch_idx`` restarts every
    epoch), and an ``"epoch"`` scheduler after the last batch of epoch ``e`` when
    ``(e + 1) % frequency == 0``.

    Args:
        optimizer: the user's optimizer (left untouched).
        configs: its scheduler configs, from :func:`parse_configure_optimizers`.
        steps_per_epoch: optimizer steps per epoch; ``None`` when unknown.
        total_steps: optimizer steps to tabulate.
        accumulate_grad_batches: Lightning's flag: batches per optimizer step.
        batches_per_epoch: batches per epoch (default ``steps_per_epoch * accumulate``).

    Returns:
        Per param group, ``{hyperparameter: [value at step 0, 1, ...]}`` (``total_steps`` long).

    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> opt = torch.optim.SGD([w], lr=1.0)
    >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    >>> simulate(opt, [LRSchedulerConfig(sched)], steps_per_epoch=2, total_steps=5)[0]["lr"]
    [1.0, 1.0, 0.5, 0.5, 0.25]
    >>> opt.param_groups[0]["lr"]
    1.0
    """
    records, _, _ = run_schedule(
        optimizer,
        configs,
        steps_per_epoch=steps_per_epoch,
        total_steps=max(int(total_steps), 1),
        accumulate_grad_batches=accumulate_grad_batches,
        batches_per_epoch=batches_per_epoch,
    )
    return records


def run_schedule(
    optimizer: torch.optim.Optimizer,
    configs: Sequence[LRSchedulerConfig],
    *,
    steps_per_epoch: int | None,
    total_steps: int,
    accumulate_grad_batches: int = 1,
    batches_per_epoch: int | None = None,
) -> tuple[list[dict[str, list[Any]]], torch.optim.Optimizer, list[LRScheduler]]:
    """:func:`simulate`, also returning the private copies after ``total_steps`` steps.

    The copies' ``param_groups`` and scheduler ``state_dict()`` are then what the user's objects
    would hold after that many optimizer steps in plain Lightning (``total_steps`` may be 0).

    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> opt = torch.optim.SGD([w], lr=1.0)
    >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    >>> _, o, (s,) = run_schedule(opt, [LRSchedulerConfig(sched, interval="step")],
    ...                           steps_per_epoch=None, total_steps=3)
    >>> o.param_groups[0]["lr"], s.last_epoch
    (0.125, 3)
    """
    total = max(int(total_steps), 0)
    k = max(int(accumulate_grad_batches), 1)
    for config in configs:
        needs_epochs = config.interval == "epoch" or config.frequency > 1
        if needs_epochs and not steps_per_epoch:
            raise ConfigError(
                f"{type(config.scheduler).__name__} steps with interval={config.interval!r}, "
                f"frequency={config.frequency}, which needs the number of optimizer steps per "
                "epoch, but the train loader has no length (an iterable dataset); give the "
                "loader a __len__, use interval='step' with frequency=1, or " + FIX
            )
    opt_copy, sched_copies = _private_copy(optimizer, [c.scheduler for c in configs])
    tabulated = [(c, s) for c, s in zip(configs, sched_copies, strict=True) if not is_plateau(c)]
    step_ones = [(c, s) for c, s in tabulated if c.interval == "step"]
    epoch_ones = [(c, s) for c, s in tabulated if c.interval != "step"]
    records: list[dict[str, list[Any]]] = [{} for _ in opt_copy.param_groups]
    for t in range(total):
        for rec, group in zip(records, opt_copy.param_groups, strict=True):
            for key, value in read_group(group).items():
                rec.setdefault(key, []).append(value)
        per_epoch = steps_per_epoch or total + 1  # unknown: no epoch boundary is ever reached
        in_epoch = t % per_epoch
        last_of_epoch = in_epoch == per_epoch - 1
        batch_end = (in_epoch + 1) * k  # Lightning's batch_idx + 1 after this step
        if last_of_epoch and batches_per_epoch:
            batch_end = batches_per_epoch
        for config, sched in step_ones:
            if batch_end % config.frequency == 0:
                sched.step()
        if last_of_epoch:
            epoch = t // per_epoch
            for config, sched in epoch_ones:
                if (epoch + 1) % config.frequency == 0:
                    sched.step()
    return records, opt_copy, sched_copies
