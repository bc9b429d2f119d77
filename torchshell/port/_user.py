"""The user's ``self.log`` and eval hooks: two method groups of ``LightningAdapter``.

- :class:`LightningLogs` (``adapter.logs``): training values under the user's names and
  options: on-step ones at the logging cadence (``name_step`` when on-epoch too, as Lightning
  names them), on-epoch ones as exact means (or sum, max, min) accumulated on device;
- :class:`LightningEvaluation` (``adapter.evaluation``): ``validation_step``/``test_step``/
  ``predict_step`` traced in eval mode; their ``self.log`` values go through Lightning's own
  ``self.log`` per batch.

Each owns its state (the epoch sums; the compiled eval steps) and implements the protocol of
the Flax/torch defaults (:class:`~torchshell.adapters._logs.TrainLogs`,
:class:`~torchshell.adapters.EvalHooks`): ``JaxModule``'s hooks call them with the
module, whose ``log`` and ``trainer`` they use.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

import bridge
import jaxcore
from jaxcore import MICRO, TOTAL
from jaxcore.guard import NO_CHECK, raise_failed
from jaxcore.precision import cast_floating, resolve_dtype
from torchshell._errors import ConfigError
from torchshell.adapters._batches import host_fields_back, host_fields_out
from torchshell.adapters._eval import EvalHooks, eval_loader
from torchshell.adapters._logs import OWN, TrainLogs
from torchshell.port._host_metrics import HOST_ARGS, run_metric_calls
from torchshell.port._logs import (
    APPENDED_KEY,
    BATCH_SIZE_KEY,
    GRADS_HOOK,
    METRIC_KEY,
    LogSpec,
    hook_key,
    host_tensors,
    torch_ints,
)
from torchshell.port._repeats import RepeatedRows
from torchshell.port._trace import LightningPort
from torchshell.trace._embedding import EVAL_CHECK_KEY

__all__ = ["LightningEvaluation", "LightningLogs"]


@jax.jit
def _accumulate(acc: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (
            acc[k][0] + new[k][0],
            acc[k][1] + new[k][1],
            jnp.maximum(acc[k][2], new[k][2]),
            jnp.minimum(acc[k][3], new[k][3]),
        )
        for k in acc
    }


class LightningLogs(TrainLogs):
    """Training values under the user's names (see the module docstring).

    What coreshell adds (the returned loss, the learning rate, refused steps) is named under
    ``system/coreshell.train.``: the user's module names its own values.

    Args:
        port: the traced user module (its ``self.log`` names and options).
    """

    own_train = f"{OWN}train."

    def __init__(self, port: LightningPort) -> None:
        self.port = port
        self._epoch: dict[str, Any] | None = None  # the epoch's sums, on device
        # on-step values, the last of the epoch (as Lightning's results: kept on later steps)
        self._last: dict[str, Any] = {}
        self._last_epoch, self._specs = -1, dict[str, LogSpec]()
        # what the traces log, worked out when a trace is new (:meth:`_train_specs`)
        self._seen: tuple[Any, Any] = (None, None)
        self._train, self._on_epoch = dict[str, LogSpec](), dict[str, LogSpec]()
        self._on_step: list[tuple[str, str, str]] = []  # (name, each batch's key, the key)
        self._once: set[str] = set()  # the gradient hooks' own: once per optimizer step

    def _train_specs(self) -> dict[str, LogSpec]:
        """What ``training_step`` (any specialisation: ``f"{task}_loss"``) and the gradient
        hooks log (reported as the step's values); worked out anew after a new trace (the
        port's specs: a new dict per trace)."""
        step, grads = self.port.specs["training_step"], self.port.specs[GRADS_HOOK]
        if step is not self._seen[0] or grads is not self._seen[1]:
            self._seen = (step, grads)
            self._specs.update(step)
            self._train = train = {**self._specs, **grads}
            self._on_step = [
                (n, f"{MICRO}log/{n}", f"log/{n}") for n, s in train.items() if s.on_step
            ]
            self._on_epoch = {n: s for n, s in train.items() if s.on_epoch and s.metric is None}
            self._once = set(grads) - set(self._specs)
        return self._train

    def train_values(self, module: Any, metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """The loss under ``system/coreshell.train.``, the user's on-step values as named."""
        out = {f"{self.own_train}loss": metrics["loss"]}
        for name, spec in self._train_specs().items():
            if spec.on_step and spec.metric is None:  # (metric objects: Lightning logs them)
                # under accumulate_grad_batches: each batch's own, the last one's reported
                value = metrics.get(f"{MICRO}log/{name}", metrics.get(f"log/{name}"))
                value = self._last.get(name) if value is None else value  # (None: not logged)
                if value is not None:
                    out[f"{name}_step" if spec.on_epoch else name] = value
        for key in ("nonfinite",):
            if key in metrics:
                out[f"{self.own_train}{key}"] = metrics[key]
        return out

    def user_names(self, module: Any) -> set[str]:
        """The names ``training_step`` (and the gradient hooks) log."""
        return set(self._train_specs())

    def log_step(self, module: Any) -> int:
        """The step plain Lightning logs a training ``self.log`` value at: the optimizer
        steps before the step that computed it (0 for the first step's values)."""
        return max(int(module.trainer.global_step) - 1, 0)

    def emit(
        self,
        module: Any,
        logs: dict[str, float],
        step: int,
        progress_bar: bool,
        epoch: int | None = None,
    ) -> None:
        """Logs all but ``logger=False`` names; ``callback_metrics`` and the bar under
        Lightning's names."""
        specs = self._train_specs()
        hidden = {(f"{n}_step" if s.on_epoch else n) for n, s in specs.items() if s.logger is False}
        shown = {k: v for k, v in logs.items() if k not in hidden}
        trainer = module.trainer
        for name, spec in specs.items():
            key = f"{name}_step" if spec.on_epoch else name
            if spec.on_step and key in logs and progress_bar:  # (at the end: epoch values)
                trainer.callback_metrics[name] = torch.tensor(logs[key])
        module._log_values(shown, step, progress_bar, epoch)
        if progress_bar:  # under Lightning's bar names (name_step when on epoch too)
            bar = trainer.progress_bar_metrics
            for name, spec in specs.items():
                key = f"{name}_step" if spec.on_epoch else name
                if spec.prog_bar and spec.on_step and key in logs:
                    bar[key] = logs[key]

    def after_step(self, module: Any, metrics: dict[str, jax.Array], rows: int) -> None:
        """The step's torchmetrics states into the user's metrics; its on-epoch values added
        to the epoch's sums (weighted by rows or the ``batch_size=`` they were logged with)."""
        if self.port.metric_calls["training_step"]:
            self._metric_objects(module, metrics)
        self._train_specs()  # (after a new trace: what it logs, worked out anew)
        if (epoch_now := getattr(module._trainer, "current_epoch", 0)) != self._last_epoch:
            self._last, self._last_epoch = {}, epoch_now  # (Lightning's results: afresh)
        for name, each_key, key in self._on_step:
            value = metrics.get(each_key, metrics.get(key))
            if value is not None:
                self._last[name] = value
        if not self._on_epoch:
            return
        new = {}
        micro_rows = module.accumulation.micro_rows  # each batch's rows of the last window
        # logged once per optimizer step (on_before_optimizer_step): Lightning weighs it by
        # the batch it ran after, an accumulation window's last one
        once = self._once
        for name, spec in self._on_epoch.items():
            each = metrics.get(f"{MICRO}log/{name}")  # accumulated batches: each its own
            size = f"log/{BATCH_SIZE_KEY}{name}"  # the batch_size= it was logged with
            if each is None and f"log/{name}" not in metrics:
                continue  # logged on other batches only (f"{task}_loss": a name per task)
            if each is None:
                v = jnp.reshape(metrics[f"log/{name}"], (-1,))[-1:]
                window = module.flags.accumulate > 1
                weights = micro_rows[-1:] if name in once and window else [rows]
                given = metrics.get(size)
                given = None if given is None else jnp.reshape(given, (-1,))[-1:]
            else:
                v, weights, given = each, micro_rows, metrics.get(f"{MICRO}{size}")
            weight = given if given is not None else jnp.asarray(weights, jnp.float32)
            if spec.reduce_fx == "sum":  # Lightning sums the logged values, unweighted
                weight = jnp.ones(v.shape, jnp.float32)
            new[name] = (jnp.sum(v * weight), jnp.sum(weight), jnp.max(v), jnp.min(v))
        old = self._epoch
        if old is not None and old.keys() == new.keys():  # (the same names every batch)
            self._epoch = _accumulate(old, new)
            return
        old = old or {}
        both = {k: old[k] for k in new if k in old}  # (names some batches log, others not)
        self._epoch = {**old, **new, **(_accumulate(both, {k: new[k] for k in both}))}

    def _metric_objects(self, module: Any, metrics: dict[str, jax.Array]) -> None:
        """The step's torchmetrics batch states into the user's metrics; logged by Lightning.

        Waits for this step (a module with metric objects in ``training_step`` only): the
        metric's state lives on the host, as in plain Lightning, which then logs the object
        (its batch value on step, its own ``compute`` over the epoch, then ``reset``).
        """
        prefixes = (f"{TOTAL}{METRIC_KEY}", f"log/{METRIC_KEY}")
        wanted = {k: v for k, v in metrics.items() if k.startswith(prefixes)}
        host = {k.split("/", 1)[1]: v for k, v in jax.device_get(wanted).items()}
        user = self.port.module
        # (metrics run on the host: updated before the step, LightningHooks.outputs_ahead)
        run_metric_calls(user, self.port.metric_calls["training_step"], host, None)
        for name, spec in self._train_specs().items():
            if spec.metric is not None:
                module.log(
                    name,
                    user.get_submodule(spec.metric),
                    prog_bar=spec.prog_bar,
                    logger=spec.logger,
                    on_step=spec.on_step,
                    on_epoch=spec.on_epoch,
                    metric_attribute=spec.metric,
                )

    def train_epoch_end(self, module: Any) -> None:
        """The epoch's last on-step values and its on-epoch means, through ``module.log``."""
        self._user_step_values(module)
        if self._epoch is None:
            return
        acc, self._epoch = jax.device_get(self._epoch), None
        for name, spec in self._train_specs().items():
            if name not in acc:
                continue
            total, weight, top, bottom = (float(x) for x in acc[name])
            value = {"mean": total / max(weight, 1e-30), "sum": total, "max": top, "min": bottom}
            module.log(
                f"{name}_epoch" if spec.on_step else name,
                value[spec.reduce_fx],
                prog_bar=spec.prog_bar,
                logger=spec.logger,
                on_step=False,
                on_epoch=True,
            )
            if spec.on_step:
                module.trainer.callback_metrics[name] = torch.tensor(value[spec.reduce_fx])

    def last_step_values(self, module: Any) -> None:
        """``callback_metrics`` end on the last step's values (not the last logging step's)."""
        self._user_step_values(module, end=True)

    def _user_step_values(self, module: Any, end: bool = False) -> None:
        """``callback_metrics`` hold the epoch's last on-step values, as in plain Lightning.

        (Lightning updates them every step; here they are fetched once per epoch, so a run
        shorter than ``log_every_n_steps`` still ends with them.)
        """
        if not module._last_metrics:
            return
        values = jax.device_get(self.train_values(module, module._last_metrics))
        callback_metrics = module.trainer.callback_metrics
        for name, spec in self._train_specs().items():
            key = f"{name}_step" if spec.on_epoch else name
            if spec.on_step and key in values:
                value = torch.tensor(float(np.ravel(values[key])[-1]))
                callback_metrics[key] = value
                if not (end and spec.on_epoch):
                    callback_metrics[name] = value  # (the epoch value follows)


class LightningEvaluation(EvalHooks):
    """The user's eval hooks, traced (see the module docstring).

    Args:
        port: the traced user module.
    """

    def __init__(self, port: LightningPort) -> None:
        self.port = port
        self.steps: dict[str, jaxcore.Step] = {}  # per hook (and loader): the compiled step
        self.specs: dict[str, dict[str, LogSpec]] = {}  # what every specialisation logs
        self.repeats = RepeatedRows()  # rows a DistributedSampler repeated, per loader

    def _step_for(self, module: Any, hook: str, dataloader_idx: int | None) -> jaxcore.Step:
        key = hook_key(hook, dataloader_idx)
        if key not in self.steps:
            dtype = resolve_dtype(module._compute_dtype)
            dtype = None if dtype == jnp.float32 else dtype
            port = self.port

            def step(state: Any, batch: Any) -> Any:
                out, logs, _ = port.call(
                    hook,
                    cast_floating(state.params, dtype),
                    state.model_state,
                    cast_floating(batch, dtype),
                    state.rng,
                    False,
                    dataloader_idx,
                )
                return cast_floating(out, jnp.float32), logs

            self.steps[key] = jaxcore.Step(step, name=key)
        return self.steps[key]

    def _run_hook(
        self,
        module: Any,
        hook: str,
        batch: Any,
        dataloader_idx: int | None = None,
        batch_idx: int = -1,
    ) -> Any:
        """The user's ``hook`` traced on ``batch``; with ``batch_idx`` (validation and test),
        without the rows a ``DistributedSampler`` repeated (:mod:`torchshell.port._repeats`:
        a batch of repeats only is not evaluated)."""
        adapter = module.adapter
        if batch_idx >= 0:
            loader = eval_loader(module._trainer, dataloader_idx)
            batch = self.repeats.real_part(
                loader, batch, adapter.global_rows(batch), batch_idx, dataloader_idx
            )
            if batch is None:
                return None
        user = self.port.module
        if dataloader_idx is not None:
            user_hook = getattr(user, hook)
            if not is_param_in_hook_signature(user_hook, "dataloader_idx", explicit=True):
                raise ConfigError(  # (Lightning's own check, on the user's hook)
                    f"You provided several dataloaders for {type(user).__name__}."
                    f"{hook}, which takes no `dataloader_idx` argument. Fix: add "
                    "`dataloader_idx=0` to its signature (Lightning passes each loader's index)."
                )
        fields = host_fields_out(batch)  # ids, paths: stand-ins in the step, back in `out`
        adapter.checkpoint.write_back_host(module)  # (host hooks changed in place: BatchNorm)
        state = self._first_state(module, fields)
        jbatch = self.port.specialise(hook, adapter.place(fields), False, dataloader_idx)
        out, logs = self._step_for(module, hook, dataloader_idx)(state, jbatch)
        out = host_fields_back(out, batch)
        n = jaxcore.rows(batch, default=0)
        host = jax.device_get(logs)
        raise_failed(host.pop(EVAL_CHECK_KEY, NO_CHECK), f"in a {hook} batch")
        key = hook_key(hook, dataloader_idx)
        appended = host.get(APPENDED_KEY, {})
        given = host_tensors(appended.pop(HOST_ARGS, None))  # (metrics run on the host)
        values = run_metric_calls(user, self.port.metric_calls[key], host, given)
        for name, items in appended.items():  # self.<list>.append(...)
            getattr(user, name).extend(host_tensors(items))
        specs = self.specs.setdefault(key, {})
        specs.update(self.port.specs[key])
        for name, spec in specs.items():
            if spec.metric is None and spec.host_call is None and name not in host:
                continue  # (logged on other batches only: f"val_{task}_loss")
            value = float(host[name]) if spec.metric is None else user.get_submodule(spec.metric)
            if spec.host_call is not None:  # a host metric's batch value
                value = values[spec.host_call]
            module.log(
                name,
                value,
                metric_attribute=spec.metric,
                prog_bar=spec.prog_bar,
                logger=spec.logger,
                on_step=spec.on_step,
                on_epoch=spec.on_epoch,
                reduce_fx=spec.reduce_fx,
                batch_size=int(host.get(f"{BATCH_SIZE_KEY}{name}", 0)) or n or None,
                add_dataloader_idx=spec.add_dataloader_idx,
            )
        return out

    def _first_state(self, module: Any, batch: Any) -> Any:
        """The state; built here when an eval batch comes first (the sanity check), from the
        module's weights alone: ``training_step`` is never traced on an eval batch (whose form
        may differ: SimCLR's two views); the first training batch traces it."""
        if module.state is not None:
            return module.state
        self.port.weights_only = True
        try:
            return module.init_state(batch)
        finally:
            self.port.weights_only = False

    def validation_step(
        self, module: Any, batch: Any, batch_idx: int, dataloader_idx: int | None
    ) -> Any:
        """The user's ``validation_step``, traced; its outputs (for batch-end hooks)."""
        out = self._run_hook(module, "validation_step", batch, dataloader_idx, batch_idx)
        return torch_ints(bridge.to_torch(out))

    def test_step(self, module: Any, batch: Any, batch_idx: int, dataloader_idx: int | None) -> Any:
        """The user's ``test_step``, traced; its outputs (for batch-end hooks)."""
        out = self._run_hook(module, "test_step", batch, dataloader_idx, batch_idx)
        return torch_ints(bridge.to_torch(out))

    def predict_step(
        self, module: Any, batch: Any, batch_idx: int, dataloader_idx: int | None
    ) -> Any:
        """The user's ``predict_step`` (or Lightning's default, the module's forward), traced:
        its outputs as torch tensors."""
        out = self._run_hook(module, "predict_step", batch, dataloader_idx)
        return torch_ints(bridge.to_torch(out))
