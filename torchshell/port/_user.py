"""The user's ``self.log`` and eval hooks in a :class:`LightningJaxModule` (mixins).

- :class:`UserMetrics`: training values under the user's names and options: on-step ones at
  the logging cadence (``name_step`` when on-epoch too, as Lightning names them), on-epoch
  ones as exact means (or sum, max, min) accumulated on device;
- :class:`UserEvaluation`: ``validation_step``/``test_step``/``predict_step`` traced in eval
  mode; their ``self.log`` values go through Lightning's own ``self.log`` per batch.

They expect the attributes :class:`~torchshell.port._module.LightningJaxModule` sets.
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
from torchshell.module._batches import host_fields_back, host_fields_out
from torchshell.module._train_log import OWN
from torchshell.port._adapter import common_rows
from torchshell.port._logs import (
    APPENDED_KEY,
    BATCH_SIZE_KEY,
    GRADS_HOOK,
    METRIC_KEY,
    LogSpec,
    add_metric_states,
    hook_key,
    host_tensors,
    torch_ints,
)
from torchshell.trace._embedding import EVAL_CHECK_KEY

__all__ = ["UserEvaluation", "UserMetrics"]


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


class UserMetrics:
    """Training values under the user's names (see the module docstring).

    What coreshell adds (the returned loss, the learning rate, refused steps) is named under
    ``coreshell/train/``: the user's module names its own values.
    """

    _own_train = f"{OWN}train/"

    port: Any
    trainer: Any
    _trainer: Any
    _epoch: Any
    _last_metrics: dict[str, jax.Array]
    log: Any
    accumulation: Any  # (its micro_rows: each batch's rows of the last window)
    flags: Any

    def _train_specs(self) -> dict[str, LogSpec]:
        # (what on_after_backward/on_before_optimizer_step log is reported as a step's value)
        return {**self.port.specs["training_step"], **self.port.specs[GRADS_HOOK]}

    def _train_values(self, metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
        out = {f"{self._own_train}loss": metrics["loss"]}
        for name, spec in self._train_specs().items():
            if spec.on_step and spec.metric is None:  # (metric objects: Lightning logs them)
                # under accumulate_grad_batches: each batch's own, the last one's reported
                value = metrics.get(f"{MICRO}log/{name}", metrics[f"log/{name}"])
                out[f"{name}_step" if spec.on_epoch else name] = value
        for key in ("nonfinite",):
            if key in metrics:
                out[f"{self._own_train}{key}"] = metrics[key]
        return out

    def _user_names(self) -> set[str]:
        return set(self._train_specs())

    def _align_logger_step(self) -> None:
        """Lightning's logger step during a batch is the optimizer steps before it, as in a
        plain automatic-optimization run (Lightning counts this module's batches, as it
        steps no torch optimizer): so what ``self.log`` logs in an epoch-end hook lands at
        the step plain Lightning gives it, also under ``accumulate_grad_batches``."""
        if self._trainer is not None:
            self.trainer.fit_loop.epoch_loop._batches_that_stepped = self.trainer.global_step

    def _log_step(self) -> int:
        """The step plain Lightning logs a training ``self.log`` value at: the optimizer
        steps before the step that computed it (0 for the first step's values)."""
        return max(int(self.trainer.global_step) - 1, 0)

    def _emit(
        self, logs: dict[str, float], step: int, progress_bar: bool, epoch: int | None = None
    ) -> None:
        hidden = {
            (f"{n}_step" if s.on_epoch else n)
            for n, s in self._train_specs().items()
            if s.logger is False
        }
        shown = {k: v for k, v in logs.items() if k not in hidden}
        for name, spec in self._train_specs().items():
            key = f"{name}_step" if spec.on_epoch else name
            if spec.on_step and key in logs and progress_bar:  # (at the end: epoch values)
                self.trainer.callback_metrics[name] = torch.tensor(logs[key])
        super()._emit(shown, step, progress_bar, epoch)  # type: ignore[misc]
        if progress_bar:  # under Lightning's bar names (name_step when on epoch too)
            bar = self.trainer.progress_bar_metrics
            for name, spec in self._train_specs().items():
                key = f"{name}_step" if spec.on_epoch else name
                if spec.prog_bar and spec.on_step and key in logs:
                    bar[key] = logs[key]

    def _after_step(self, metrics: dict[str, jax.Array], rows_: int) -> None:
        if self.port.metric_calls["training_step"]:
            self._metric_objects(metrics)
        epoch = {n: s for n, s in self._train_specs().items() if s.on_epoch and s.metric is None}
        if not epoch:
            return
        new = {}
        # logged once per optimizer step (on_before_optimizer_step): Lightning weighs it by
        # the batch it ran after, an accumulation window's last one
        once = set(self.port.specs[GRADS_HOOK]) - set(self.port.specs["training_step"])
        for name, spec in epoch.items():
            each = metrics.get(f"{MICRO}log/{name}")  # accumulated batches: each its own
            size = f"log/{BATCH_SIZE_KEY}{name}"  # the batch_size= it was logged with
            if each is None:
                v = jnp.reshape(metrics[f"log/{name}"], (-1,))[-1:]
                window = self.flags.accumulate > 1
                rows = self.accumulation.micro_rows[-1:] if name in once and window else [rows_]
                given = metrics.get(size)
                given = None if given is None else jnp.reshape(given, (-1,))[-1:]
            else:
                v, rows, given = each, self.accumulation.micro_rows, metrics.get(f"{MICRO}{size}")
            weight = given if given is not None else jnp.asarray(rows, jnp.float32)
            if spec.reduce_fx == "sum":  # Lightning sums the logged values, unweighted
                weight = jnp.ones(v.shape, jnp.float32)
            new[name] = (jnp.sum(v * weight), jnp.sum(weight), jnp.max(v), jnp.min(v))
        self._epoch = new if self._epoch is None else _accumulate(self._epoch, new)

    def _metric_objects(self, metrics: dict[str, jax.Array]) -> None:
        """The step's torchmetrics batch states into the user's metrics; logged by Lightning.

        Waits for this step (a module with metric objects in ``training_step`` only): the
        metric's state lives on the host, as in plain Lightning, which then logs the object
        (its batch value on step, its own ``compute`` over the epoch, then ``reset``).
        """
        prefixes = (f"{TOTAL}{METRIC_KEY}", f"log/{METRIC_KEY}")
        wanted = {k: v for k, v in metrics.items() if k.startswith(prefixes)}
        host = {k.split("/", 1)[1]: v for k, v in jax.device_get(wanted).items()}
        user = self.port.module
        for i, call in enumerate(self.port.metric_calls["training_step"]):
            add_metric_states(user.get_submodule(call.path), call, host, i)
        for name, spec in self._train_specs().items():
            if spec.metric is not None:
                self.log(
                    name,
                    user.get_submodule(spec.metric),
                    prog_bar=spec.prog_bar,
                    logger=spec.logger,
                    on_step=spec.on_step,
                    on_epoch=spec.on_epoch,
                    metric_attribute=spec.metric,
                )

    def on_train_epoch_end(self) -> None:
        super().on_train_epoch_end()  # type: ignore[misc]
        self._user_step_values()
        if self._epoch is None:
            return
        acc, self._epoch = jax.device_get(self._epoch), None
        for name, spec in self._train_specs().items():
            if name not in acc:
                continue
            total, weight, top, bottom = (float(x) for x in acc[name])
            value = {"mean": total / max(weight, 1e-30), "sum": total, "max": top, "min": bottom}
            self.log(
                f"{name}_epoch" if spec.on_step else name,
                value[spec.reduce_fx],
                prog_bar=spec.prog_bar,
                logger=spec.logger,
                on_step=False,
                on_epoch=True,
            )
            if spec.on_step:
                self.trainer.callback_metrics[name] = torch.tensor(value[spec.reduce_fx])

    def _last_step_values(self) -> None:
        """(Done per epoch, under the user's names: :meth:`_user_step_values`.)"""

    def _user_step_values(self) -> None:
        """``callback_metrics`` hold the epoch's last on-step values, as in plain Lightning.

        (Lightning updates them every step; here they are fetched once per epoch, so a run
        shorter than ``log_every_n_steps`` still ends with them.)
        """
        if not self._last_metrics:
            return
        values = jax.device_get(self._train_values(self._last_metrics))
        for name, spec in self._train_specs().items():
            key = f"{name}_step" if spec.on_epoch else name
            if spec.on_step and key in values:
                value = torch.tensor(float(np.ravel(values[key])[-1]))
                self.trainer.callback_metrics[key] = value
                self.trainer.callback_metrics[name] = value  # (the epoch value follows)


class UserEvaluation:
    """The user's eval hooks, traced (see the module docstring)."""

    port: Any
    _eval_steps: dict[str, jaxcore.Step]
    log: Any
    _compute_dtype: Any
    init_state: Any
    adapter: Any  # torchshell.port._adapter.LightningAdapter
    _repeats: Any  # torchshell.port._repeats.RepeatedRows
    _write_back_host: Any
    _eval_loader: Any

    def _eval_step_for(self, hook: str, dataloader_idx: int | None) -> jaxcore.Step:
        key = hook_key(hook, dataloader_idx)
        if key not in self._eval_steps:
            dtype = resolve_dtype(self._compute_dtype)
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

            self._eval_steps[key] = jaxcore.Step(step, name=key)
        return self._eval_steps[key]

    def _run_hook(
        self, hook: str, batch: Any, dataloader_idx: int | None = None, batch_idx: int = -1
    ) -> Any:
        """The user's ``hook`` traced on ``batch``; with ``batch_idx`` (validation and test),
        without the rows a ``DistributedSampler`` repeated (:mod:`torchshell.port._repeats`:
        a batch of repeats only is not evaluated)."""
        if batch_idx >= 0:
            repeats = self._repeats
            loader = self._eval_loader(dataloader_idx)
            batch = repeats.real_part(
                loader, batch, self.adapter.global_rows(batch), batch_idx, dataloader_idx
            )
            if batch is None:
                return None
        if dataloader_idx is not None:
            user_hook = getattr(self.port.module, hook)
            if not is_param_in_hook_signature(user_hook, "dataloader_idx", explicit=True):
                raise ConfigError(  # (Lightning's own check, on the user's hook)
                    f"You provided several dataloaders for {type(self.port.module).__name__}."
                    f"{hook}, which takes no `dataloader_idx` argument. Fix: add "
                    "`dataloader_idx=0` to its signature (Lightning passes each loader's index)."
                )
        fields = host_fields_out(batch)  # ids, paths: stand-ins in the step, back in `out`
        self._write_back_host()  # (what host hooks changed in place: BatchNorm statistics)
        state = self.init_state(fields)  # (the sanity check's batch may be the first one)
        jbatch = self.port.specialise(hook, self.adapter.place(fields), False, dataloader_idx)
        out, logs = self._eval_step_for(hook, dataloader_idx)(state, jbatch)
        out = host_fields_back(out, batch)
        n = common_rows(batch)
        host = jax.device_get(logs)
        raise_failed(host.pop(EVAL_CHECK_KEY, NO_CHECK), f"in a {hook} batch")
        user = self.port.module
        key = hook_key(hook, dataloader_idx)
        for i, call in enumerate(self.port.metric_calls[key]):  # torchmetrics objects
            add_metric_states(user.get_submodule(call.path), call, host, i)
        for name, items in host.get(APPENDED_KEY, {}).items():  # self.<list>.append(...)
            getattr(user, name).extend(host_tensors(items))
        for name, spec in self.port.specs[key].items():
            value = float(host[name]) if spec.metric is None else user.get_submodule(spec.metric)
            self.log(
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

    # ``dataloader_idx`` is passed by Lightning with several loaders only (the user's hook
    # then takes it too, as Lightning requires).
    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> Any:
        out = self._run_hook("validation_step", batch, dataloader_idx, batch_idx)
        return torch_ints(bridge.to_torch(out))  # batch-end hooks' outputs

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> Any:
        out = self._run_hook("test_step", batch, dataloader_idx, batch_idx)
        return torch_ints(bridge.to_torch(out))

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> Any:
        return torch_ints(bridge.to_torch(self._run_hook("predict_step", batch, dataloader_idx)))
