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
from torchshell.adapters._hooks import ModuleHooks
from torchshell.port._host_metrics import HOST_ARGS, run_metric_calls
from torchshell.port._logs import GRADS_HOOKS, host_tensors
from torchshell.port._prepare import check_trainable, layers_changed
from torchshell.port._trace import LightningPort
from torchshell.port._weights import synced_on_read
from torchshell.trace._paths import mode

__all__ = ["LightningHooks"]

_EVAL_HOOKS = ("validation_step", "test_step", "predict_step")
# the user's own loop and batch hooks, run on the host after coreshell's part of each (the
# optimizer/backward ones are refused: see docs/porting.md)
_LOOP_HOOKS = tuple(
    f"on_{stage}_{when}"
    for stage in (
        "fit",
        "train",
        "validation",
        "test",
        "predict",
        "train_epoch",
        "validation_epoch",
        "test_epoch",
        "predict_epoch",
    )
    for when in ("start", "end")
) + tuple(
    f"on_{stage}_batch_{when}"
    for stage in ("train", "validation", "test", "predict")
    for when in ("start", "end")
)
# the user's own batch transforms on the host (augmentation, moving fields): theirs alone
_TRANSFER_HOOKS = (
    "on_before_batch_transfer",
    "transfer_batch_to_device",
    "on_after_batch_transfer",
)
_DATA_HOOKS = (
    "prepare_data",
    "train_dataloader",
    "val_dataloader",
    "test_dataloader",
    "predict_dataloader",
)
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

    def attach(self, module: Any) -> None:
        """The user's hooks, loaders and transfer hooks on the module; its hparams logged."""
        port, user = self.port, self.port.module
        for hook in _EVAL_HOOKS[:2]:  # Lightning skips a loop whose hook is not overridden
            # (predict_step stays: Lightning's default one calls the module's forward)
            if not port.overrides(hook):
                setattr(module, hook, getattr(L.LightningModule, hook).__get__(module))
        for hook in _LOOP_HOOKS:  # the user's own hooks run too, logging through Lightning
            if port.overrides(hook):
                setattr(module, hook, self._with_user_hook(module, hook))
        epoch_end = module.on_train_epoch_end  # (the user's own too, when it has one)

        def on_train_epoch_end() -> None:
            epoch_end()
            module.adapter.optim.step_plateau(module)  # after every epoch-end hook, as Lightning

        module.on_train_epoch_end = on_train_epoch_end
        epoch_start = module.on_train_epoch_start

        def on_train_epoch_start() -> None:
            epoch_start()  # (after the callbacks' and the user's: a freeze or unfreeze there)
            # before the first step (a freeze in on_train_start): traced and mapped anew
            if (
                module.state is None
                and not module.adapter.steps.manual
                and port.refresh()
                and module.tx is None
            ):
                module.adapter.optim.remap(module)
            optimizers = None if module.tx is not None else module.trainer.optimizers
            check_trainable(user, port.tracer, optimizers, module.current_epoch)

        module.on_train_epoch_start = on_train_epoch_start
        for hook in _DATA_HOOKS + _TRANSFER_HOOKS:  # the module's own loaders and transforms
            if port.overrides(hook):
                setattr(module, hook, getattr(user, hook))
        if user.hparams:  # the run's params in the loggers (MLflow) are the user's
            module.save_hyperparameters(dict(user.hparams))

    def _with_user_hook(self, module: Any, hook: str) -> Any:
        """``hook`` as the module runs it, then as the user's module does.

        The user's ``self.log``/``self.log_dict`` in it go to the module's (the one
        Lightning's loop is running), so what it logs reaches the loggers and
        ``callback_metrics`` as in plain Lightning. ``on_train_batch_end`` receives the step's
        outputs as plain Lightning gives them (:meth:`wants_outputs`); the evaluation hooks,
        what the traced step returned.
        """
        ours, theirs = getattr(module, hook), getattr(self.port.module, hook)

        def both(*args: Any, **kwargs: Any) -> Any:
            ours(*args, **kwargs)
            user = self.port.module
            user.log, user.log_dict = module.log, module.log_dict  # type: ignore[method-assign]
            steps = module.adapter.steps
            if steps.manual:  # (its sch.step() moves the compiled step's schedule)
                host = functools.partial(steps.host_schedulers, module)
                user.lr_schedulers = host  # type: ignore[method-assign]
            try:
                with synced_on_read(user, module._sync_user_weights):
                    return theirs(*args, **kwargs)
            finally:
                del user.log, user.log_dict
                vars(user).pop("lr_schedulers", None)

        return both

    def trainer_attached(self, module: Any, trainer: L.Trainer) -> None:
        """The user's own hooks decide, as in plain Lightning; the module sees the Trainer.

        Its data hooks and ``configure_optimizers`` often read ``self.trainer`` (e.g.
        ``estimated_stepping_batches``). Inside the traced steps, Trainer values are read
        once, at trace time.
        """
        self.port.module.trainer = trainer

    def setup(self, module: Any, stage: str) -> None:
        user = self.port.module
        user.setup(stage)
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
        return self.port.overrides("on_train_batch_end")

    def outputs_ahead(self, module: Any, batch: Any, i: int, raw: Any) -> dict[str, Any] | None:
        """Lightning's outputs, computed before the step when ``training_step`` returns more
        than its loss or appends to the module's lists (Lightning 2's
        ``self.training_step_outputs.append(...)``): the lists get the values after each
        batch, ``on_train_batch_end`` the returned dict (its loss / ``accumulate_grad_batches``,
        as Lightning gives it). This runs the batch's forward pass alone, so such a module
        computes it twice per batch.
        """
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

    def train_batch_end(self, module: Any) -> None:
        """A ``LearningRateMonitor`` reads the torch optimizers' ``lr``: the schedule's."""
        if any(type(c).__name__ == "LearningRateMonitor" for c in module.trainer.callbacks):
            module.adapter.optim.sync_torch_lr(module)

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
