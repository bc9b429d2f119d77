"""A user's ``LightningModule`` traced: its step methods as pure JAX functions.

:class:`LightningPort` runs ``training_step`` / ``validation_step`` / ``test_step`` /
``predict_step`` under torchax (:class:`~torchshell.torch_model.TorchTracer`), with the
module's weights swapped for JAX values, and records every ``self.log`` / ``self.log_dict``
call made while tracing: the values come back as JAX scalars (on device), the options as a
:class:`LogSpec` per name, static for the run; torchmetrics calls as :class:`MetricCall`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from jaxcore import TOTAL, ModelFns
from jaxcore.guard import checking
from torchshell import trace as patterns
from torchshell._errors import ConfigError, TorchModelError
from torchshell.adapters._torch_fns import intact_tracer
from torchshell.port._batch_idx import BatchIdx
from torchshell.port._capture import LogCapture
from torchshell.port._host_metrics import HOST_ARGS
from torchshell.port._logs import (
    _MAX_STATIC,
    APPENDED_KEY,
    BATCH_SIZE_KEY,
    GRADS_HOOK,
    HOOKS,
    METRIC_KEY,
    STEP_KEY,
    USER_KEY,
    LogSpec,
    MetricCall,
    _lists,
    _take_appended,
    hook_key,
)
from torchshell.port._prepare import layers_changed, prepare_module
from torchshell.trace._embedding import EVAL_CHECK_KEY, EmbeddingChecks
from torchshell.trace._static import STATIC_KEY, check_static_reads

__all__ = ["LightningPort"]

PyTree = Any


class LightningPort(LogCapture):
    """The traced step methods of one ``LightningModule``.

    Args:
        module: the user's module, with automatic optimization (Lightning's default).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> port = LightningPort(BoringModel())
        >>> out, logs, _ = port.call("training_step", port.tracer.params0,
        ...     port.tracer.state0, jnp.ones((4, 32)), jax.random.key(0), True)
        >>> float(out["loss"]) > 0
        True
    """

    def __init__(self, module: L.LightningModule) -> None:
        if not isinstance(module, L.LightningModule):
            raise ConfigError(
                f"JaxModule.from_lightning expects a lightning.LightningModule instance, got "
                f"{type(module).__name__}. Fix: pass MyModule(**hparams); for a plain "
                "nn.Module use JaxModule.from_torch."
            )
        self.module = module
        # manual optimization (torchshell.port._manual): the mapped optimizers, and the run
        # whose stand-ins a trace of training_step uses (None: a shape-only one)
        self.manual_plan: Any = None
        self.manual: Any = None
        self.manual_steps = 1  # opt.step() calls per training_step (global_step's count)
        self.host_reads: dict[str, Any] = {}  # Trainer values it read (port._host_reads)
        prepare_module(module)  # (configure_model, lazy layers: every weight sized)
        self.tracer = intact_tracer(module)
        # per hook key: the numbers and types of the batch scalars it reads (specialise)
        self.statics: dict[str, tuple[list[int], list[type]]] = {}
        self._static_seen: dict[str, set[tuple[int, ...]]] = {}
        self.embeddings = EmbeddingChecks()  # nn.Embedding's indices, checked in the step
        self.embeddings.install(self.tracer.env, module)
        self.specs: dict[str, dict[str, LogSpec]] = {hook: {} for hook in HOOKS}
        self.metric_calls: dict[str, list[MetricCall]] = {hook: [] for hook in HOOKS}
        self._warned: set[tuple[str, str]] = set()
        # training_step returns more than its loss, appends to lists (see _hook_fn)
        self.returns_more: tuple[bool, bool] | None = None  # (None: not yet traced for a step)
        self.weights_only = False  # an eval batch's state: training_step not traced on it

    def refresh(self) -> bool:
        """Snapshots the module's weights again when a hook run after ``from_lightning`` (the
        user's ``setup(stage)``: a head sized from the data, a frozen backbone) changed its
        layers; before the first step only. Whether it did."""
        if not layers_changed(self.module, self.tracer):
            return False
        self.tracer = intact_tracer(self.module)
        self.embeddings.install(self.tracer.env, self.module)
        return True

    def overrides(self, hook: str) -> bool:
        """Whether the user's class defines ``hook`` (Lightning's own check)."""
        from lightning.pytorch.utilities.model_helpers import is_overridden

        return is_overridden(hook, self.module, parent=L.LightningModule)

    def call(
        self,
        hook: str,
        params: PyTree,
        model_state: PyTree,
        batch: PyTree,
        rng: jax.Array,
        train: bool,
        dataloader_idx: int | None = None,
    ) -> tuple[Any, dict[str, jax.Array], PyTree]:
        """Runs ``module.<hook>(batch, 0)`` traced; ``(outputs, logged values, new state)``.

        With ``dataloader_idx`` (several evaluation loaders): ``module.<hook>(batch, 0,
        dataloader_idx)``; what it logs is kept under :func:`hook_key`.
        """
        records: list[tuple[LogSpec, Any]] = []
        calls: list[tuple[MetricCall, dict[str, Any]]] = []
        fn = self._hook_fn(hook, dataloader_idx, records, calls)
        statics, step = None, None
        if isinstance(batch, Mapping) and USER_KEY in batch:  # see specialise()
            if STATIC_KEY in batch:
                used, types = self.statics[hook_key(hook, dataloader_idx)]
                found = patterns.decode(batch[STATIC_KEY].shape[1:])
                statics = {n: t(v) for n, t, v in zip(used, types, found, strict=True)}
            step, batch = batch.get(STEP_KEY), batch[USER_KEY]
        # an eval hook's embedding indices: checked in its step, [code, value] for the host
        # (the train step checks its own: jaxcore.guard.checking in the gradient function)
        checks = contextlib.nullcontext() if hook == "training_step" else checking(batch)
        self._step_value = step  # (self.global_step: LogCapture._global_step)
        try:
            with self.tracer.static_values(statics), checks as found_checks:
                (out, values, states, appended), new_state = self.tracer.call(
                    fn, params, model_state, [batch], rng, train
                )
        finally:
            self._step_value = None
        specs: dict[str, LogSpec] = {}
        logs: dict[str, jax.Array] = {}
        for (spec, _), value in zip(records, values, strict=True):
            specs[spec.name], logs[spec.name] = spec, self._scalar(spec.name, hook, value)
            if spec.batch_size:  # (often the traced batch's rows: one value per compiled shape)
                logs[f"{BATCH_SIZE_KEY}{spec.name}"] = jnp.asarray(spec.batch_size, jnp.float32)
        for i, arrays in enumerate(states):  # a metric's batch states, for the host
            logs |= {f"{METRIC_KEY}{i}/{k}": jnp.asarray(v) for k, v in arrays.items()}
        if appended:  # the step's outputs kept in lists: appended on the host
            logs[APPENDED_KEY] = appended
        if found_checks is not None:  # (read with the logs: jaxcore.guard.raise_failed)
            logs[EVAL_CHECK_KEY] = found_checks.result()
        self.specs[hook_key(hook, dataloader_idx)] = specs
        self.metric_calls[hook_key(hook, dataloader_idx)] = [call for call, _ in calls]
        return out, logs, new_state

    def _hook_fn(
        self,
        hook: str,
        dataloader_idx: int | None,
        records: list[tuple[LogSpec, Any]],
        calls: list[tuple[MetricCall, dict[str, Any]]],
    ) -> Any:
        """``module.<hook>(batch, 0[, dataloader_idx])`` with ``self.log`` and the metrics
        captured, to run under the tracer: ``(out, logged, metric states, appended)``."""
        extra = () if dataloader_idx is None else (dataloader_idx,)

        def fn(b: Any) -> Any:
            # each path of a traced branch (layer drop) runs the hook again: its own records
            del records[:], calls[:]
            # (Lightning's precision plugin's torch.autocast: the traced step's dtype is JAX's)
            with (
                self._capture(hook, records, calls),
                self.embeddings.watching(b),
                torch.autocast("cpu", enabled=False),
            ):
                lists = _lists(self.module)
                try:
                    out: Any
                    if hook == "training_step" and self.manual_plan is not None:
                        out = self._manual_call(b)
                    else:  # (batch_idx: 0, refused if computed with)
                        out = getattr(self.module, hook)(b, *self._batch_idx(hook), *extra)
                finally:
                    appended = _take_appended(self.module, lists)
            if any(call.host for call, _ in calls):  # metrics run on the host: their tensors
                appended[HOST_ARGS] = [states.pop(HOST_ARGS, []) for _, states in calls]
            if hook == "training_step" and out is None and self.manual_plan is None:
                raise self._returned_none()
            if hook == "training_step" and self.tracer.reads.mode == "step":  # (not a probe)
                extras = isinstance(out, Mapping) and set(out) - {"loss"}
                self.returns_more = (bool(extras), bool(appended))
            return (
                out,
                [value for _, value in records],
                [states for _, states in calls],
                appended,
            )

        return fn

    def _manual_call(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        """``training_step`` under manual optimization: ``(its return, the run's results)``."""
        from torchshell.port._manual import ManualRun

        run = self.manual or ManualRun(self.manual_plan, [], [], dry=True)
        run.restart()  # (each path of a traced branch runs it again)
        with run.installed(self.module, self.tracer.env):
            out = self.module.training_step(batch, *self._batch_idx("training_step"))
            return out, run.results()

    def _batch_idx(self, hook: str) -> tuple[BatchIdx, ...]:
        """``(batch_idx,)`` when the user's hook takes it (Lightning's own check), else ``()``
        (e.g. ``def training_step(self, batch)``)."""
        if not is_param_in_hook_signature(getattr(self.module, hook), "batch_idx", min_args=2):
            return ()
        manual = hook == "training_step" and self.manual_plan is not None
        return (BatchIdx(type(self.module).__name__, manual=manual, hook=hook),)

    def manual_loss(self, returned: Any, losses: list[jax.Array]) -> jax.Array:
        """A manual step's loss: the one it returned, else its first backward call's."""
        loss = returned.get("loss") if isinstance(returned, Mapping) else returned
        if loss is not None and getattr(loss, "size", 0) == 1:
            return jnp.asarray(loss, jnp.float32).reshape(())
        return losses[0] if losses else jnp.zeros((), jnp.float32)

    def grads_fn(self, hooks: tuple[str, ...], optimizer: Any) -> Any:
        """The module's gradient hooks as a ``(state, grads) -> (grads, logs)`` JAX function.

        For :func:`jaxcore.make_train_step`'s ``grads_fn``: each parameter's ``.grad`` holds
        the step's gradient (as after Lightning's backward pass), then ``hooks`` run in
        order (``on_after_backward()``, ``on_before_optimizer_step(optimizer)``) with
        ``self.log`` captured; what they leave in ``.grad`` (an in-place clip or scale) goes
        to the optimizer. The logs come back as ``log/<name>`` values; their options in
        ``self.specs[GRADS_HOOK]``.
        """
        records: list[tuple[LogSpec, Any]] = []
        owner = type(self.module).__name__

        def fn(grads: dict[str, Any]) -> Any:
            del records[:]  # (each path of a traced branch runs the hooks again)
            named = dict(self.module.named_parameters())
            for name, grad in grads.items():
                named[name].grad = grad
            try:
                for hook in hooks:
                    args = (optimizer,) if hook == "on_before_optimizer_step" else ()
                    with self._capture(hook, records, []), torch.autocast("cpu", enabled=False):
                        getattr(self.module, hook)(*args)
                new = {name: named[name].grad for name in grads}
            finally:
                for param in named.values():
                    param.grad = None
            if gone := sorted(name for name, grad in new.items() if grad is None):
                raise ConfigError(
                    f"{owner}.{'/'.join(hooks)} set the gradient of {gone[:3]} to None: torch "
                    "would skip those parameters' update, which a compiled step cannot "
                    "choose per step. Fix: zero the gradient (p.grad.zero_()) or freeze the "
                    "parameter (requires_grad=False) before training."
                )
            return new, [value for _, value in records]

        def run(state: Any, grads: PyTree) -> tuple[PyTree, dict[str, jax.Array]]:
            (new, values), _ = self.tracer.call(
                fn, state.params, state.model_state, [dict(grads)], state.rng, True
            )
            specs, logs = {}, {}
            for (spec, _), value in zip(records, values, strict=True):
                specs[spec.name] = spec
                logs[f"log/{spec.name}"] = self._scalar(spec.name, GRADS_HOOK, value)
                if spec.batch_size:
                    logs[f"log/{BATCH_SIZE_KEY}{spec.name}"] = jnp.float32(spec.batch_size)
            self.specs[GRADS_HOOK] = specs
            new = {k: v.astype(grads[k].dtype).reshape(grads[k].shape) for k, v in new.items()}
            return new, logs

        return run

    @staticmethod
    def _scalar(name: str, hook: str, value: Any) -> jax.Array:
        array = jnp.asarray(value, jnp.float32)
        if array.size != 1:
            raise ConfigError(
                f"self.log({name!r}) in {hook} got a tensor of shape {tuple(array.shape)}; "
                "Lightning logs scalars. Fix: log a reduced value (e.g. .mean())."
            )
        return array.reshape(())

    def specialise(
        self, hook: str, batch: PyTree, train: bool, dataloader_idx: int | None = None
    ) -> PyTree:
        """The (concrete, placed) batch, plus the scalars the hook reads from it in Python.

        A hook that reads a batch value as a Python number (torchaudio's ``Conformer``:
        ``int(torch.max(lengths).item())``) needs it while the step compiles. The first
        batch finds such reads (:meth:`TorchTracer.host_reads`); each batch's values are then
        computed on the host (a trace up to the last read) and travel as the shape of an
        empty array: ``{USER_KEY: batch, STATIC_KEY: ...}``, so the step compiles once per
        distinct value (its ``recompiles``). Other hooks get their batch back unchanged.
        """
        key = hook_key(hook, dataloader_idx)
        if key not in self.statics:
            fn = self._hook_fn(hook, dataloader_idx, [], [])
            found = self.tracer.host_reads(fn, [batch], train)
            check_static_reads(found, f"{type(self.module).__name__}.{hook}")
            self.statics[key] = (sorted(found), [type(found[n]) for n in sorted(found)])
        used, _ = self.statics[key]
        if not used:  # (self.global_step read: the Trainer's value travels with the batch)
            return self.with_step(batch) if key == "training_step" and self.reads_step else batch
        fn = self._hook_fn(hook, dataloader_idx, [], [])
        read = self.tracer.probe(fn, [batch], train, used[-1])
        values = tuple(int(read[n]) for n in used)
        seen = self._static_seen.setdefault(key, set())
        if values not in seen:
            seen.add(values)
            if len(seen) == _MAX_STATIC + 1:
                warnings.warn(
                    f"{type(self.module).__name__}.{hook} reads batch scalars in Python "
                    f"(e.g. int(lengths.max())) that took {len(seen)} distinct values: each "
                    "compiles the step again (system/coreshell.compile.recompiles). Fix: pad the "
                    "batches to a few lengths in the collate (buckets), or keep those values "
                    "tensors.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        marker = np.zeros((0, *patterns.encode(values)), np.int8)
        out = {USER_KEY: batch, STATIC_KEY: jax.device_put(marker)}
        return self.with_step(out) if key == "training_step" and self.reads_step else out

    def needs_statics(self, hook: str) -> bool:
        """Whether ``hook`` reads batch scalars in Python (after :meth:`specialise`)."""
        return bool(self.statics.get(hook_key(hook), ([], []))[0])

    def loss_of(self, out: Any) -> jax.Array:
        """The loss a ``training_step`` returned (a tensor, or a dict holding ``"loss"``)."""
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if loss is None or not hasattr(loss, "shape") or getattr(loss, "size", 0) != 1:
            raise TorchModelError(
                f"{type(self.module).__name__}.training_step returned "
                f"{type(out).__name__ if loss is None else tuple(loss.shape)}: expected the "
                "loss, a scalar tensor (or a dict with 'loss'). A step that returns None "
                "(Lightning skips it) cannot be compiled. Fix: return the loss."
            )
        return jnp.asarray(loss, jnp.float32).reshape(())

    def model_fns(self) -> ModelFns:
        """``training_step`` as jaxcore's :class:`~jaxcore.ModelFns`.

        ``apply`` returns ``{"loss": loss, "logs": {name: value}, "user": ...}``, which
        :meth:`loss_fn` turns into the step's loss and metrics (``log/<name>``); ``"user"``
        holds what the step returned beside its loss (``"extras"``) and appended to lists
        (``"appended"``), for the host. ``init`` traces it (else ``specialise`` did).
        """

        def init(rng: jax.Array, batch: PyTree) -> tuple[PyTree, PyTree]:
            t = self.tracer
            if hook_key("training_step") not in self.statics and not self.weights_only:
                jax.eval_shape(
                    lambda b: self.apply(t.params0, t.state0, b, jax.random.key(0), True), batch
                )
            return dict(t.params0), dict(t.state0)

        return ModelFns(init, self.apply)

    def apply(
        self, params: PyTree, model_state: PyTree, batch: PyTree, rng: jax.Array, train: bool
    ) -> tuple[PyTree, PyTree]:
        out, logs, new_state = self.call("training_step", params, model_state, batch, rng, train)
        if self.manual_plan is not None:  # (a shape-only trace, or the step's forward alone)
            returned, results = out
            out = {"loss": self.manual_loss(returned, results["losses"])}
        appended: Any = logs.pop(APPENDED_KEY, {})  # ({list attribute: [values]})
        extras = {k: v for k, v in out.items() if k != "loss"} if isinstance(out, Mapping) else {}
        extras = jax.tree.map(lambda v: v if isinstance(v, jax.Array) else None, extras)
        user = {"extras": extras, "appended": appended}
        return {"loss": self.loss_of(out), "logs": logs, "user": user}, new_state

    @staticmethod
    def loss_fn(outputs: PyTree, batch: PyTree) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The traced step's loss and logged values (0-d: batch means) for jaxcore.

        A metric object's batch states are batch totals (``jaxcore.TOTAL``: summed over
        accumulated micro-batches); its batch value is a batch mean like a logged value.
        """
        metrics = {}
        for k, v in outputs["logs"].items():
            total = k.startswith(METRIC_KEY) and not k.endswith("/value")
            metrics[f"{TOTAL}{k}" if total else f"log/{k}"] = v
        return outputs["loss"], metrics
