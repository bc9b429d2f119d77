"""The port's ``hooks`` group: the user's ``LightningModule`` hooks beside the module's own.

A ``JaxModule`` made by ``from_lightning`` runs the user's loop, batch and data hooks after
its own, forwards the user's attributes (the trained weights synced on read) and ``forward``,
and traces its gradient hooks into the step. What differs from the Flax path of
:class:`~torchshell.module.JaxModule` as a whole:

- batches reach ``training_step`` with the structure the DataLoader gave (tuples, dicts,
  nested); nothing is padded (a ragged batch compiles once more, counted): the user's loss
  is a mean over the rows it is given, as in plain Lightning;
- ``configure_optimizers`` is read and mapped onto optax (:mod:`torchshell.optim._map`);
  its torch optimizers are also handed to Lightning, so ``LearningRateMonitor`` and the
  checkpoint's ``optimizer_states`` see them (their ``lr`` follows the JAX schedule);
- ``self.log`` values: on-step ones at the logging cadence, on-epoch ones as exact means
  accumulated on device (training), and through Lightning's own ``self.log`` per batch
  (evaluation), under the user's names and options;
- checkpoints carry the trained weights in the module's own ``state_dict`` layout and its
  ``hyper_parameters``: ``MyModule.load_from_checkpoint(path)`` works in plain Lightning.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import lightning as L
import torch

from torchshell._errors import ConfigError
from torchshell.adapters._batches import host_fields_back
from torchshell.adapters._hooks import LOOP_HOOKS, TABLE_HOOKS, ModuleHooks, default_hook
from torchshell.port._host_metrics import HOST_ARGS, run_metric_calls
from torchshell.port._logs import GRADS_HOOKS, host_tensors
from torchshell.port._prepare import check_trainable, layers_changed
from torchshell.port._sandbox import TraceSandbox
from torchshell.port._trace import LightningPort
from torchshell.port._weights import synced_on_read
from torchshell.trace._paths import mode

__all__ = ["LightningHooks"]

# Lightning skips an evaluation loop whose step is not overridden (predict_step stays:
# Lightning's default one calls the module's forward)
_EVAL_HOOKS = ("validation_step", "test_step")
# the user's own data hooks and batch transforms on the host (augmentation, moving fields)
_DATA_HOOKS = tuple(hook for hook in TABLE_HOOKS if hook not in _EVAL_HOOKS)
# Hooks that run torch code around the backward pass or the torch optimizer: the JAX step has
# no place to run them, so a module that overrides one is refused rather than half-trained.
# (on_after_backward/on_before_optimizer_step run traced on the step's gradients: GRADS_HOOKS.)
_OPTIMIZER_HOOKS = (
    "backward",
    "on_before_zero_grad",
    "on_before_backward",
    "configure_gradient_clipping",
    "optimizer_step",
    "lr_scheduler_step",
)
# what such an override usually does, and the form the compiled step takes it in
_OPTIMIZER_HOOK_FIXES = {
    "optimizer_step": (
        "; a learning-rate warm-up set in optimizer_step, as Lightning's docs show it: return "
        'it from configure_optimizers as {"scheduler": LambdaLR(opt, lambda s: min(1.0, '
        '(s + 1) / N)), "interval": "step"}'
    ),
    "lr_scheduler_step": (
        "; a scheduler that is not a torch LRScheduler (timm's, stepped with epoch=): the "
        "same schedule as a torch one (LambdaLR, or SequentialLR of LinearLR and "
        "CosineAnnealingLR), which Lightning steps itself"
    ),
}


class LightningHooks(ModuleHooks):
    """The user's ``LightningModule`` hooks, attributes and ``forward`` on the module
    (``LightningAdapter``'s ``hooks``; the protocol: :class:`~torchshell.module.Adapter`).

    Args:
        port: the traced user module.

    Raises:
        ConfigError: the module overrides a hook that runs torch code around the backward
            pass or the optimizer step under automatic optimization.
    """

    def __init__(self, port: LightningPort) -> None:
        super().__init__()
        self.port = port
        # the loop hooks the user's module overrides: run after the module's own (`run`)
        self.user_hooks = frozenset(hook for hook in LOOP_HOOKS if port.overrides(hook))
        self.lr_monitor = False  # the run has a LearningRateMonitor (trainer_attached)
        self.ahead = True  # outputs_ahead asked (until training_step returns its loss alone)
        custom = [hook for hook in _OPTIMIZER_HOOKS if port.overrides(hook)]
        if custom and port.module.automatic_optimization:  # (manual: see LightningSteps)
            raise ConfigError(
                f"{type(port.module).__name__} overrides {custom}: torch code around the "
                "backward pass or the optimizer step, which the compiled JAX step does not "
                "run. Fix: remove the override (gradient clipping: Trainer("
                "gradient_clip_val=...)"
                + "".join(_OPTIMIZER_HOOK_FIXES[h] for h in custom if h in _OPTIMIZER_HOOK_FIXES)
                + "), or pass optimizer= an optax transform that does the same."
            )

    def entries(self, module: Any) -> dict[str, Any]:
        """The hook table: the user's loaders and batch transforms where it has them, and the
        evaluation loops it has (an evaluation step it does not override: Lightning's
        default, so the loop is skipped as in plain Lightning)."""
        port, user, entries = self.port, self.port.module, super().entries(module)
        for hook in _EVAL_HOOKS:
            if not port.overrides(hook):
                entries[hook] = default_hook(module, hook)
        for hook in _DATA_HOOKS:
            if port.overrides(hook):
                entries[hook] = getattr(user, hook)
        return entries

    def attach(self, module: Any) -> None:
        """The hook table; the user's hparams, which the loggers (MLflow) log as the run's."""
        super().attach(module)
        if self.port.module.hparams:
            module.save_hyperparameters(dict(self.port.module.hparams))

    def run(self, module: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        """The user's own loop hook ``name`` (when it overrides it), after the module's part,
        with the port's own work around it, in plain Lightning's order; what it returns
        (``on_train_batch_start``'s -1 ends the epoch, as in plain Lightning).

        Before the user's: ``on_train_batch_start`` aligns Lightning's logger step
        (``steps.align_logger_step``); ``on_train_batch_end`` gives a
        ``LearningRateMonitor`` the schedule's hyperparameters. After it:
        ``on_train_epoch_start`` traces and maps anew what the user's hooks froze or
        unfroze; ``on_train_epoch_end`` steps a ``ReduceLROnPlateau`` (after every epoch-end
        hook, as Lightning).
        """
        if name == "on_train_batch_start":
            module.adapter.steps.align_logger_step(module)
        elif name == "on_train_batch_end" and self.lr_monitor:
            module.adapter.optim.sync_torch_lr(module)
        returned = None
        if name in self.user_hooks:
            returned = self._run_user_hook(module, name, args, kwargs)
        if name == "on_train_epoch_start":
            self._trainable_checked(module)
        elif name == "on_train_epoch_end":
            module.adapter.optim.step_plateau(module)
        return returned

    def _run_user_hook(
        self, module: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The user's hook ``name``, as plain Lightning runs it.

        The user's ``self.log``/``self.log_dict`` in it go to the module's (the one
        Lightning's loop is running), so what it logs reaches the loggers and
        ``callback_metrics`` as in plain Lightning; under manual optimization its
        ``sch.step()`` moves the compiled step's schedule. These are patched for the call
        only (:class:`~torchshell.port._sandbox.TraceSandbox`). ``on_train_batch_end``
        receives the step's outputs as plain Lightning gives them (:meth:`wants_outputs`).
        """
        user, steps = self.port.module, module.adapter.steps
        with TraceSandbox() as sandbox:
            sandbox.patch(user, "log", module.log)
            sandbox.patch(user, "log_dict", module.log_dict)
            if steps.manual:  # (its sch.step() moves the compiled step's schedule)
                host = functools.partial(steps.host_schedulers, module)
                sandbox.patch(user, "lr_schedulers", host)
            with synced_on_read(user, module._sync_user_weights):
                return getattr(user, name)(*args, **kwargs)

    def _trainable_checked(self, module: Any) -> None:
        """After the callbacks' and the user's ``on_train_epoch_start`` (a freeze or unfreeze
        there): before the first step, traced and mapped anew; the trainable parameters
        checked against the optimizers."""
        if (
            module.state is None
            and not module.adapter.steps.manual
            and self.port.refresh()
            and module.tx is None
        ):
            module.adapter.optim.remap(module)
        optimizers = None if module.tx is not None else module.trainer.optimizers
        check_trainable(self.port.module, self.port.tracer, optimizers, module.current_epoch)

    def trainer_attached(self, module: Any, trainer: L.Trainer) -> None:
        """The user's own hooks decide, as in plain Lightning; the module sees the Trainer.

        Its data hooks and ``configure_optimizers`` often read ``self.trainer`` (e.g.
        ``estimated_stepping_batches``). Inside the traced steps, Trainer values are read
        once, at trace time.
        """
        self.port.module.trainer = trainer
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # (set by Lightning)
        self.lr_monitor = any(type(c).__name__ == "LearningRateMonitor" for c in callbacks)

    def setup(self, module: Any, stage: str) -> None:
        user = self.port.module
        user.setup(stage)
        self.ahead = True  # (asked again: see outputs_ahead)
        module.adapter.steps.counts = not user.automatic_optimization  # (once per fit)
        if module.state is None:  # (layers its setup built: traced and trained, as in Lightning)
            self.port.refresh()
        elif layers_changed(user, self.port.tracer):
            raise ConfigError(
                f"{type(user).__name__}.setup({stage!r}) changed the module's layers after "
                "its weights were already in the JAX state (an earlier fit or a restored "
                "checkpoint). Fix: make setup idempotent (build a layer only when it is "
                "missing: `if self.head is None:`), or build the layers in __init__."
            )

    def teardown(self, module: Any, stage: str) -> None:
        self.port.module.teardown(stage)

    def forward(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        """The user's module called on the host with the weights trained so far.

        What a callback's ``pl_module(x)`` runs (sampling at an epoch's end), as in plain
        Lightning; the training and evaluation steps never call it (they are traced).
        After ``pl_module.eval()`` (the UvA tutorials' ``GenerateCallback``) it runs in eval
        mode, as the user's module would in plain Lightning, its own modes back afterwards.
        """
        module._sync_user_weights()
        if module.training:
            return self.port.module(*args, **kwargs)
        with mode(self.port.module, False):
            return self.port.module(*args, **kwargs)

    def attribute(self, module: Any, name: str) -> Any:
        """The user's module's own attributes (``pl_module.net``, ``pl_module.my_setting`` in
        a callback, ``batch_size`` for Lightning's batch size finder), its weights the
        trained ones; private names are not forwarded."""
        user = self.port.module
        if name.startswith("_") or not hasattr(user, name):
            return super().attribute(module, name)
        value = getattr(user, name)
        if isinstance(value, torch.nn.Module | torch.Tensor):
            module._sync_user_weights()
        return value

    def set_attribute(self, module: Any, name: str, value: Any) -> None:
        """On the user's module, whose loaders read it (``self.batch_size``)."""
        setattr(self.port.module, name, value)

    def wants_outputs(self, module: Any) -> bool:
        """When the user's module overrides ``on_train_batch_end`` itself."""
        return "on_train_batch_end" in self.user_hooks

    def outputs_ahead(self, module: Any, batch: Any, i: int, raw: Any) -> dict[str, Any] | None:
        """Lightning's outputs, computed before the step when ``training_step`` returns more
        than its loss or appends to the module's lists (Lightning 2's
        ``self.training_step_outputs.append(...)``): the lists get the values after each
        batch, ``on_train_batch_end`` the returned dict (its loss / ``accumulate_grad_batches``,
        as Lightning gives it). This runs the batch's forward pass alone, so such a module
        computes it twice per batch.
        """
        if self.port.returns_more == (False, False) and module.flags.accumulate == 1:
            self.ahead = False  # (the module asks again when the step is traced anew)
            return None  # (the common case, known once training_step was traced)
        module.init_state(batch)  # (the first batch traces training_step: now it is known)
        if self.port.returns_more is None:  # (the state came from an eval batch: shapes only)
            s, placed, port = module.state, module.adapter.to_jax(batch), self.port
            call = functools.partial(port.call, "training_step", s.params, s.model_state)
            jax.eval_shape(lambda b: call(b, s.rng, True) and None, placed)
        extras, appends = self.port.returns_more or (False, False)
        wanted = module._outputs_wanted()
        if not appends and not (extras and wanted):  # (extras no one reads: not computed)
            return super().outputs_ahead(module, batch, i, raw)
        outputs, loss = module._step_forward(batch, i)
        user = host_tensors(outputs["user"])
        if (given := user["appended"].pop(HOST_ARGS, None)) is not None:  # host metrics
            run_metric_calls(self.port.module, self.port.metric_calls["training_step"], None, given)
        for name, items in user["appended"].items():
            getattr(self.port.module, name).extend(host_fields_back(items, raw))
        if not wanted:
            return None
        extras = host_fields_back(user["extras"], raw)  # (ids: the DataLoader's values)
        return {"loss": torch.tensor(float(loss)) / module.flags.accumulate, **extras}

    def grads_fn(self, module: Any) -> Any:
        """The module's ``on_after_backward``/``on_before_optimizer_step``, traced on the
        step's gradients (``LightningPort.grads_fn``), or ``None`` when it has neither."""
        hooks = tuple(hook for hook in GRADS_HOOKS if self.port.overrides(hook))
        if not hooks or module.adapter.steps.manual:  # (manual: refused, see LightningSteps)
            return None
        if "on_after_backward" in hooks and module.flags.accumulate > 1:
            raise ConfigError(
                f"{type(self.port.module).__name__}.on_after_backward with "
                f"accumulate_grad_batches={module.flags.accumulate}: Lightning runs it after "
                "each batch's backward, on partly accumulated gradients, which the compiled "
                "step never holds (it sums the window's gradients at once). Fix: move the "
                "code to on_before_optimizer_step (the window's gradients), or "
                "accumulate_grad_batches=1."
            )
        optimizers = module.trainer.optimizers if module._trainer is not None else []
        return self.port.grads_fn(hooks, optimizers[0] if optimizers else None)
