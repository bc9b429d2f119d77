"""What a traced hook says besides its result: every ``self.log``/``self.log_dict`` call
recorded as a :class:`~torchshell.port._logs.LogSpec` and a traced value, torchmetrics
objects run on the batch (their states added to the real metric on the host), learning
rates read from the schedulers, and the calls a compiled step cannot make refused by name.
The base of :class:`~torchshell.port._trace.LightningPort`, which sets what it reads.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import lightning as L
import numpy as np
import torch
from jax._src import config as jax_config
from torchmetrics import Metric

from torchshell._errors import ConfigError, TorchModelError
from torchshell.port._host_metrics import HOST_ARGS, HostValue, split_args
from torchshell.port._host_reads import traced_global_step
from torchshell.port._logs import (
    _METRIC_HOOKS,
    _METRIC_METHODS,
    GRADS_HOOKS,
    HOOKS,
    STEP_KEY,
    USER_KEY,
    LogSpec,
    MetricCall,
    _counting_class,
    _nan_check_traced,
    _path_of,
    _ReadNoted,
    _reduce_name,
    _state_reductions,
    _warn_at,
)
from torchshell.port._sandbox import TraceSandbox
from torchshell.trace import TracedScalar
from torchshell.trace._messages import DATA_DEPENDENT

__all__ = ["LogCapture"]


def _first(err: BaseException) -> str:
    """An error's first line (a JAX error's: its cause, before the advice)."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


class LogCapture:
    """Records a hook's logs and metric calls while it is traced (see the module docstring)."""

    module: L.LightningModule
    tracer: Any  # the port's TorchTracer (its reads: traced values used as Python bools)
    _warned: set[tuple[str, str]]
    manual: Any  # manual optimization: the run being traced (its opt.step() calls)
    manual_plan: Any
    reads_step = False  # training_step reads global_step: its batches carry it (with_step)
    _step_value: Any = None  # this call's STEP_KEY value (None: a shape-only trace)

    def host_step(self) -> int:
        """The Trainer's ``global_step`` now (0 without a Trainer)."""
        trainer = getattr(self.module, "_trainer", None)
        return 0 if trainer is None else int(trainer.global_step)

    def with_step(self, batch: Any, micro: int = 0) -> Any:
        """``batch`` with the Trainer's ``global_step`` beside it (:data:`STEP_KEY`), which a
        traced ``training_step`` reads as ``self.global_step``; ``micro``: a window of that
        many stacked batches, which all see the same value (one optimizer step)."""
        out = dict(batch) if isinstance(batch, Mapping) and USER_KEY in batch else {USER_KEY: batch}
        # (a numpy value: jit places it in its own call, cheaper than a device_put of it)
        out[STEP_KEY] = np.full((micro,) if micro else (), self.host_step(), np.int32)
        return out

    def _global_step(self) -> Any:
        """``self.global_step`` inside a traced ``training_step``: the value the step received
        with its batch, plus the ``opt.step()`` calls made so far under manual optimization
        (as Lightning counts); a traced int32 tensor, so the step follows it every call."""
        value = self._step_value
        # (the trace folds ops on constants: off here, so a shape-only trace, discovery or
        # init, gets a traced value too, and the user's reads of it number alike)
        with jax_config.eager_constant_folding(False):
            if value is None:
                value = jnp.asarray(self.host_step(), jnp.int32) + 0
            if self.manual_plan is not None and self.manual is not None:
                value = value + self.manual.steps
            return self.tracer.env.j2t_iso(jnp.asarray(value, jnp.int32))

    def _step_as_number(self, err: BaseException) -> TorchModelError:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return TorchModelError(
            f"{type(self.module).__name__}.training_step reads self.global_step and uses a "
            "traced value as a Python number (int(), float(), range(), a tensor shape or an "
            "index). In the compiled step global_step is a traced int32 tensor the step "
            "receives with each batch: arithmetic, comparisons, min/max and `if` on it work, "
            "a Python number made from it cannot. Fix: keep it a tensor (e.g. "
            "torch.as_tensor((self.global_step + 1) / 100).clamp(max=1.0), self.log('gstep', "
            "self.global_step)), or decide on the host in on_train_batch_start. "
            f"({type(err).__name__}: {first})"
        )

    def _returned_none(self) -> TorchModelError:
        """``training_step`` returned None: Lightning skips that batch; a compiled step cannot
        (on a traced branch, ``lax.cond`` would get a loss on one path and None on the other)."""
        name = type(self.module).__name__
        where = (
            " on a path chosen by a traced value (e.g. `if not torch.isfinite(loss): return None`)"
            if self.tracer.reads.d
            else ""
        )
        return TorchModelError(
            f"{name}.training_step returned None{where}: plain Lightning skips that batch's "
            "optimizer step, which one compiled JAX step cannot decide per batch. Expected "
            "the loss (a scalar tensor, or a dict with 'loss') on every path. Fix: return the "
            "loss; to skip steps whose loss or gradients are not finite, pass "
            "nan_policy='skip' to JaxModule.from_lightning(...) (the update is not applied, "
            "counted in system/coreshell.train.nonfinite_steps)."
        )

    @contextlib.contextmanager
    def _capture(
        self,
        hook: str,
        records: list[tuple[LogSpec, Any]],
        calls: list[tuple[MetricCall, dict[str, Any]]],
    ) -> Iterator[None]:
        on_step_default, on_epoch_default = HOOKS[hook]
        cached: dict[str, Any] = {}  # metric path -> its traced batch value (forward)

        def log(
            name: str,
            value: Any,
            prog_bar: bool = False,
            logger: bool | None = None,
            on_step: bool | None = None,
            on_epoch: bool | None = None,
            reduce_fx: Any = "mean",
            enable_graph: bool = False,
            sync_dist: bool = False,
            sync_dist_group: Any = None,
            add_dataloader_idx: bool = True,
            batch_size: int | None = None,
            metric_attribute: str | None = None,
            rank_zero_only: bool = False,
        ) -> None:
            metric, host_call = None, None
            if isinstance(value, HostValue):  # a host metric's batch value (see the module)
                if hook not in ("validation_step", "test_step"):
                    raise value.refusal("logs")
                value, host_call = 0.0, value.index
            if isinstance(value, TracedScalar):  # ``loss.item()``: the traced value itself
                value = value.x
            elif isinstance(value, np.number | np.ndarray) and np.size(value) == 1:
                value = float(value)
            if isinstance(value, Metric) and hook in _METRIC_HOOKS:
                metric = _path_of(self.module, value)
                value = cached.get(metric, 0.0)  # its batch value (forward), as Lightning logs
            elif isinstance(value, Mapping) or not isinstance(
                value, (torch.Tensor, jax.Array, int, float)
            ):
                raise ConfigError(
                    f"self.log({name!r}, ...) in {hook} got a {type(value).__name__}: a "
                    "traced step logs tensors or numbers (torchmetrics objects keep state "
                    "outside the step). Fix: log metric.compute() values from a torch "
                    "function of the batch, or a tensor."
                )
            spec = LogSpec(
                name=name,
                prog_bar=bool(prog_bar),
                logger=logger,
                on_step=on_step_default if on_step is None else bool(on_step),
                on_epoch=on_epoch_default if on_epoch is None else bool(on_epoch),
                reduce_fx=_reduce_name(reduce_fx),
                batch_size=batch_size,
                metric=metric,
                add_dataloader_idx=bool(add_dataloader_idx),
                host_call=host_call,
            )
            records.append((spec, value))

        user_class = type(self.module)
        read: set[str] = set()

        def global_step() -> Any:  # (a traced value in training_step: see _global_step)
            read.add("global_step")
            return self._global_step()

        train = hook == "training_step"
        given = {"global_step": global_step} if train else {}
        # (every patch below is put back when the sandbox closes, an error or not)
        with TraceSandbox() as sandbox:
            sandbox.patch(self.module, "log", log)
            sandbox.patch(self.module, "_device", torch.device("jax"))  # self.device: traced
            if hook in _METRIC_HOOKS:
                self._traced_metrics(sandbox, hook, calls, cached)
            else:
                self._refuse_metrics(sandbox, hook)
            sandbox.wear_class(self.module, _counting_class(user_class, read, given))
            if hook in ("training_step", *GRADS_HOOKS):
                self._watch_lr(sandbox, read)
            steps = traced_global_step(global_step) if train else contextlib.nullcontext()
            try:
                with steps:
                    yield
            except DATA_DEPENDENT as err:
                if train and "global_step" in read:
                    raise self._step_as_number(err) from err
                raise
        if train:  # specialised: one program per epoch (port._host_reads)
            read.discard("current_epoch")
            if "global_step" in read:  # traced: its batches carry it from now on
                self.reads_step = True
                read.discard("global_step")
        for name in sorted(read):
            if (hook, name) not in self._warned:
                self._warned.add((hook, name))
                _warn_at(getattr(user_class, hook), f"{user_class.__name__}.{hook}", name)

    def _watch_lr(self, sandbox: TraceSandbox, read: set[str]) -> None:
        """The Trainer's optimizers' param groups, swapped (in ``sandbox``) for dicts that
        note an ``lr`` read, and their schedulers' ``get_last_lr``.

        (``self.optimizers().param_groups[0]["lr"]`` logged from a step is a constant of the
        trace.)
        """
        trainer = getattr(self.module, "_trainer", None)
        for optimizer in getattr(trainer, "optimizers", None) or []:
            groups = optimizer.param_groups
            for index, group in enumerate(groups):
                sandbox.patch_item(groups, index, _ReadNoted(group, read))
        for config in getattr(trainer, "lr_scheduler_configs", None) or []:
            scheduler = config.scheduler  # get_last_lr() of self.lr_schedulers()

            def noted(_f: Any = scheduler.get_last_lr) -> Any:
                read.add("lr")
                return _f()

            sandbox.patch(scheduler, "get_last_lr", noted)

    def _traced_metrics(
        self,
        sandbox: TraceSandbox,
        hook: str,
        calls: list[tuple[MetricCall, dict[str, Any]]],
        cached: dict[str, Any],
    ) -> None:
        """The module's torchmetrics objects, run on the traced batch alone.

        ``forward``/``update`` compute the metric's states on this batch (from its defaults,
        with its own update code) and, for ``forward``, the batch value (its own compute);
        the states are recorded for the host (:func:`add_metric_states`) and the metric's
        own states are left as they were. A metric that cannot run there (a list state, or
        an update whose shapes depend on values) runs on the host after the step instead
        (:mod:`torchshell.port._host_metrics`). ``compute`` inside the step is refused (it
        would read the states of other batches). The methods are patched in ``sandbox``.
        """
        for path, metric in self.module.named_modules():
            if not isinstance(metric, Metric):
                continue
            states = _state_reductions(metric)

            def run(
                *args: Any,
                _p: str = path,
                _m: Metric = metric,
                _s: Any = states,
                _f: bool = True,
                **kw: Any,
            ) -> Any:
                why = "its state is a list (all predictions, e.g. AUROC), which grows with data"
                if _s is not None:
                    try:
                        return self._metric_in_step(_p, _m, _s, _f, calls, cached, args, kw)
                    except DATA_DEPENDENT as err:  # (ignore_index: preds[target != -100])
                        why = f"its update needs a shape that depends on values: {_first(err)}"
                host, tensors = split_args(args, kw)  # run on the host, after the step
                calls.append((MetricCall(_p, _f, (), host), {HOST_ARGS: tensors}))
                owner = type(self.module).__name__
                return HostValue(owner, hook, _p, why, len(calls) - 1) if _f else None

            if hasattr(metric, "_cast_and_nan_check_input"):  # MeanMetric, SumMetric...
                nan_check = functools.partial(_nan_check_traced, metric)
                sandbox.patch(metric, "_cast_and_nan_check_input", nan_check)
            sandbox.patch(metric, "forward", run)
            sandbox.patch(metric, "update", functools.partial(run, _f=False))
            why = "compute() there would read other batches' states (call it in an epoch hook)"
            sandbox.patch(metric, "compute", self._refusal(hook, path, why))

    def _metric_in_step(
        self,
        path: str,
        metric: Metric,
        states: Any,
        forward: bool,
        calls: list[tuple[MetricCall, dict[str, Any]]],
        cached: dict[str, Any],
        args: tuple[Any, ...],
        kw: dict[str, Any],
    ) -> Any:
        """``metric``'s update (and, for ``forward``, its compute) on the traced batch alone,
        from its defaults: its batch states recorded for the host, its own left as they were."""
        with TraceSandbox() as sandbox:  # (its own states put back after)
            for name, _ in states:
                default: Any = metric._defaults[name]  # (a tensor: _state_reductions)
                sandbox.patch(metric, name, default.detach().clone().to(self.module._device))
            type(metric).update(metric, *args, **kw)
            batch = {name: getattr(metric, name) for name, _ in states}
            if forward:
                batch["value"] = type(metric).compute(metric)
        if forward:
            cached[path] = batch["value"]
        calls.append((MetricCall(path, forward, states), batch))
        return batch.get("value")

    def _refusal(self, hook: str, path: str, why: str) -> Any:
        owner = type(self.module).__name__
        metric = self.module.get_submodule(path)

        def refuse(*args: Any, **kw: Any) -> Any:
            raise ConfigError(
                f"{owner}.{hook} runs the torchmetrics metric self.{path} "
                f"({type(metric).__name__}) in a compiled step: {why}. Fix: log a "
                "torchmetrics.functional value (accuracy(preds, y, task='multiclass', "
                "num_classes=C)) or a torch expression of the batch, with on_epoch=True for the "
                "epoch's mean, or run the metric on the host on predict_step's outputs."
            )

        return refuse

    def _refuse_metrics(self, sandbox: TraceSandbox, hook: str) -> None:
        """Makes the module's torchmetrics objects refuse to run inside the traced ``hook``
        (patched in ``sandbox``).

        ``predict_step`` returns outputs, it logs nothing: run the metric on them on the host.
        """
        why = (
            "predict_step logs nothing; a metric there has no epoch to report to"
            if hook == "predict_step"
            else "it runs on the gradients, once per optimizer step; log tensors there"
        )
        for path, metric in self.module.named_modules():
            if isinstance(metric, Metric):
                refusal = self._refusal(hook, path, why)
                for method in _METRIC_METHODS:
                    sandbox.patch(metric, method, refusal)
