"""The adapter protocol and the Flax and torch adapters: one adapter per way a model comes in.

:class:`JaxModule` owns the loop contract (Lightning's hooks, the compiled step, logging,
checkpoints); what depends on *how the model came in* is its adapter's, in the spirit of
Lightning Fabric's small ``Strategy``/``Precision`` classes a module delegates to:

- :class:`FlaxAdapter`: a Flax module (or :class:`jaxcore.ModelFns`) with a JAX loss;
- :class:`TorchAdapter`: a team's ``nn.Module`` traced by torchax (``JaxModule.from_torch``);
- ``LightningAdapter`` (:mod:`torchshell.port._adapter`): a whole ``LightningModule``
  (``JaxModule.from_lightning``).

The protocol (:class:`Adapter`), per batch:

1. :meth:`~Adapter.prepare`: the DataLoader's batch as the step reads it (named fields for
   the Flax path, the user's own structure for the port), with the structural checks torch
   would make before any math (negative lengths, misfit masks), and host-only fields (ids,
   paths) set aside;
2. :meth:`~Adapter.one_step_view` / :meth:`~Adapter.stack`: one DLPack hand-over per leaf,
   placed on the mesh (:class:`Placement`): padded to the global batch with a ``mask``
   (Flax, torch) or as the user gave it (the port);
3. :meth:`~Adapter.checked`: the context the step runs in (a changed field shape or dtype is
   named there, after the fact, instead of a host pass before every step).

and once per run: :meth:`~Adapter.sample` (the shapes the state is built from),
:meth:`~Adapter.planned` (the first batch's fields, the plan later batches are checked
against) and :meth:`~Adapter.state_dict` (the trained weights handed back as a torch
``state_dict``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import jax
import torch

import bridge
import jaxcore
from torchshell._errors import ConfigError
from torchshell.adapters._arrays import arrays_as_tensors
from torchshell.adapters._batches import (
    MicroBatches,
    check_fields,
    host_fields_out,
    name_batch,
    positional_keys,
    refuse_no_rows,
    rows,
    signature,
)
from torchshell.adapters._checkpoint import CheckpointLayout
from torchshell.adapters._eval import EvalHooks
from torchshell.adapters._flax_checks import check_batch
from torchshell.adapters._handover import HandOver
from torchshell.adapters._hooks import ModuleHooks
from torchshell.adapters._logs import TrainLogs
from torchshell.adapters._losses import step_loss
from torchshell.adapters._optim import OptaxOptimizer
from torchshell.adapters._placement import Placement
from torchshell.adapters._steps import TrainSteps
from torchshell.adapters._torch_fns import kept_intact
from torchshell.adapters._unaligned import (
    aligned,
    refuse_row_mask,
    unaligned_batch,
    unaligned_refusal,
)
from torchshell.optim import map_configure_optimizers
from torchshell.trace._static import specialise_batch

__all__ = ["Adapter", "FlaxAdapter", "TorchAdapter", "step_loss"]


def input_names(inputs: Sequence[str | int], batch_keys: Sequence[str]) -> list[str]:
    """The batch fields a model reads: names, or positions of a tuple batch named by
    ``batch_keys``.

    Example:
        >>> input_names([0, "mask"], ("ids", "mask", "label"))
        ['ids', 'mask']
    """
    names = []
    for key in inputs:
        if isinstance(key, int):
            if not 0 <= key < len(batch_keys):
                raise ConfigError(
                    f"inputs position {key} is outside batch_keys {tuple(batch_keys)}. Fix: "
                    "name every position of the DataLoader's tuples in batch_keys=(...)."
                )
            key = batch_keys[key]
        names.append(key)
    return names


def model_functions(model: Any, names: Sequence[str]) -> jaxcore.ModelFns:
    """A Flax linen or NNX module (or ready ``ModelFns``) as the step's model functions."""
    if isinstance(model, jaxcore.ModelFns):
        return model
    from flax import nnx

    if isinstance(model, nnx.Module):  # Flax NNX: params as a plain nested dict
        return jaxcore.nnx_model(model, list(names))
    return jaxcore.linen_model(model, list(names))


class Adapter:
    """The protocol: what differs between the ways a model comes in (module docstring).

    This base class hands batches over as the Flax and torch paths do (named fields, padded
    with a ``mask``); the adapters override what differs. The method groups it owns (as
    Fabric's ``Strategy`` owns its ``precision`` and ``checkpoint_io``) are called by the
    module's own hooks, each method given the ``JaxModule``:

    ``optim`` (:class:`~torchshell.adapters.OptaxOptimizer`: ``module.tx`` after the
    Trainer's clipping; the port's maps ``configure_optimizers``):

    - ``configure_optimizers(module)``: Lightning's ``configure_optimizers``; what Lightning
      holds (``[]``: no torch optimizer).
    - ``optimizer(module)``: when the state or a train step is built; the optax transform.
    - ``on_fit_start(module)``, ``on_train_start(module)``: after the module's own part of
      those hooks; ``None``.

    ``checkpoint`` (:class:`~torchshell.adapters.CheckpointLayout`: the JAX state
    alone, which the module writes itself; the port's adds the user's own layout):

    - ``save(module, checkpoint)`` / ``load(module, checkpoint)``: in ``on_save_checkpoint``/
      ``on_load_checkpoint``, after the JAX state and RNG; ``None`` (``checkpoint`` changed
      in place).
    - ``load_state_dict(module, state_dict, strict, assign)``: Lightning's restore of the
      checkpoint's ``state_dict``; torch's ``_IncompatibleKeys``.
    - ``restored(module, state)``: when the state is first built; the state to train.
    - ``synced(module)``: after the trained weights went into ``torch_module``; ``None``.
    - ``before_step(module)``: at a ``training_step``'s start while ``host_versions``; ``None``.

    ``logs`` (:class:`~torchshell.adapters._logs.TrainLogs`: the loss function's metrics
    as ``train/<name>``; the port's are the user's ``self.log`` names and options):

    - ``own_train``: the prefix of the step's own loss, learning rate and refused steps.
    - ``train_values(module, metrics)``: at each logging step; the step's device values
      under their logged names.
    - ``user_names(module)``: when the progress bar is updated; the names the user logs
      (the bar keeps their values).
    - ``align_logger_step(module)``: at each ``on_train_batch_start``; ``None``.
    - ``log_step(module)``: when a step's values are queued; the logger step they go to.
    - ``emit(module, logs, step, progress_bar, epoch)``: when a logging step's values reach
      the host (a logging step later); ``None`` (it logs them: ``module._log_values``).
    - ``after_step(module, metrics, rows)``: after every compiled step; ``None`` (the port
      adds up its epoch values on device).
    - ``train_epoch_end(module)``: in ``on_train_epoch_end``; ``None`` (the port logs its
      epoch means).
    - ``last_step_values(module)``: in ``on_train_end``; ``None`` (``callback_metrics`` end
      with the last step's values).

    ``steps`` (:class:`~torchshell.adapters.TrainSteps`: jaxcore's transforms chained over
    the model and loss; the port's is the user's manual optimization, when it has it):

    - ``build_train_step(module, micro, state, grad_scale, ragged)``: when a step is built;
      the (uncompiled) ``jaxcore.Step``.
    - ``compile_train_step(module, micro, state, jbatch)``: on the first batch (beside the
      state's init) or after the step was dropped; ``None`` (``module.compiled.train`` set).
    - ``step_for(module, micro, jbatch)``: before each call; the compiled step to call.
    - ``counted(module)``: around a ``training_step`` where ``counts``; a context manager
      (``global_step`` counts what the port's manual steps call ``opt.step()``).
    - ``align_logger_step(module)`` / ``log_step(module)``: as ``logs``'s (which the default
      calls); ``logging_step(module, before)``: after each step; whether the step logs.

    ``evaluation`` (:class:`~torchshell.adapters.EvalHooks`: the loss function as
    exact masked means; the port's runs the user's own hooks, traced):

    - ``validation_step`` / ``test_step`` / ``predict_step(module, batch, batch_idx,
      dataloader_idx)``: in Lightning's hook of that name; what that hook returns (the
      outputs; ``None`` for the Flax/torch evaluation, whose means are logged at the
      epoch's end).

    ``hooks`` (:class:`~torchshell.adapters._hooks.ModuleHooks`: the module's own hooks alone;
    the port's runs the user's ``LightningModule`` hooks beside them):

    - ``attach(module)``: at the end of ``JaxModule.__init__``: the hook ``table``; ``None``.
    - ``run(module, name, *args, **kwargs)``: in each Lightning loop hook, after the module's
      own part (the port: the user's hook); ``None``. Nothing is set on the module.
    - ``trainer_attached(module, trainer)``: when Lightning attaches the module; ``None``.
    - ``setup`` / ``teardown(module, stage)``: after / before the module's own; ``None``.
    - ``forward(module, *args, **kwargs)``: ``module(...)`` on the host; its outputs.
    - ``attribute(module, name)`` / ``set_attribute(module, name, value)``: attributes the
      module does not hold itself (the user's, ``batch_size``).
    - ``wants_outputs(module)``: whether the model reads ``on_train_batch_end``'s outputs.
    - ``outputs_ahead(module, batch, i, raw)``: before each step (one batch's: where ``ahead``);
      ``on_train_batch_end``'s outputs computed ahead of the step, or ``None``.
    - ``grads_fn(module)``: when a step is built; the step's gradient hook, or ``None``.

    Args:
        model_fns: the model's ``init``/``apply``.
        placement: where batches go.
        batch_keys: names of the positions of a list/tuple batch.
    """

    torch_module: torch.nn.Module | None = None
    weigh_rows = True  # a micro-batch weighs its valid rows (exact masked means)
    checks_fields = True  # checked checks something (else the training step skips it)
    unaligned = False  # the fields' rows differ (a graph batch): learned from the first batch
    supports_windows = True  # K batches per call (the port: False, the user's self.log per step)

    def __init__(
        self, model_fns: jaxcore.ModelFns, placement: Placement, batch_keys: Sequence[str]
    ) -> None:
        self.model_fns = model_fns
        self.placement = placement
        self.batch_keys = tuple(batch_keys)
        self.fields: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # the plan's
        self.plan: HandOver | None = None  # the run's hand-over plan, learned (``prepare``)
        self.optim = OptaxOptimizer()  # (the method groups: see above)
        self.checkpoint = CheckpointLayout()
        self.logs = TrainLogs()
        self.evaluation = EvalHooks()
        self.steps = TrainSteps()
        self.hooks = ModuleHooks()

    # -- per batch ------------------------------------------------------------------------
    def prepare(self, batch: Any) -> Any:
        """The batch as the model reads it: named fields (numpy arrays and lists of numbers as
        tensors), host-only fields set aside; a batch matching the run's plan only named."""
        if self.plan is not None and (named := self.plan.named(batch)) is not None:
            return named
        named = arrays_as_tensors(name_batch(batch, self.batch_keys))  # numpy, lists of numbers
        others = {k: v for k, v in named.items() if k != "mask"} if "mask" in named else named
        # from_torch, a graph: rows neither padded nor weighed (a row mask of the wrong length
        # in an otherwise aligned batch is a mistake: check_batch names it; a Flax model's
        # batch keeps its rows, split over the data axis)
        if self.plan is None and self.torch_module is not None and not aligned(others):
            refuse_row_mask(named)
            self.unaligned, self.weigh_rows, self.supports_windows = True, False, False
        check_batch(self, named)  # negative lengths, misfit masks: refused like torch
        prepared = host_fields_out(named)  # ids, paths: not arrays, named if the step reads one
        refuse_no_rows(prepared)
        self.plan = HandOver.learn(batch, prepared, self.batch_keys)
        return prepared

    def global_rows(self, batch: Any) -> int:
        """Rows one step sees: the batch's, rounded up to the data axis."""
        return self.placement.global_rows(rows(batch))

    def to_jax(self, batch: Any, train: bool = True) -> Any:
        """One step's batch on the mesh: padded to the global rows with a ``mask`` when
        ragged, plus the values a traced torch forward reads in Python (compiled once per
        distinct value, counted)."""
        p = self.placement
        if self.unaligned:  # (whole on every device, flagged for the loss: ._unaligned)
            return specialise_batch(self.model_fns, unaligned_batch(batch, p), train)
        n = p.global_rows(local := rows(batch))  # (the batch's rows read once)
        if "mask" in batch or local != n:  # ragged: padded, with a mask of real rows
            out = bridge.to_jax(batch, p.batch, pad_to=n, stats=p.stats)
        else:  # full: its all-true mask is made on device once, not handed over each step
            out = bridge.to_jax(batch, p.batch, stats=p.stats)
            out["mask"] = p.full_mask(n * jax.process_count())
        return specialise_batch(self.model_fns, out, train)

    def one_step_view(self, batch: Any, k: int) -> tuple[Any, Any, int]:
        """``(jax batch, one step's torch batch, rows per step)``; with ``k > 1`` a batch of
        ``k * B`` rows is viewed as ``[k, B, ...]``, k steps in one call."""
        if k == 1:
            return self.to_jax(batch), batch, self.global_rows(batch)
        if self.unaligned:
            raise ConfigError(unaligned_refusal(f"steps_per_call={k}", "steps_per_call=1"))
        n, ways = rows(batch), self.placement.ways
        if n % k or (n // k) % ways:
            raise ConfigError(
                f"steps_per_call={k} needs training batches of K*B rows with B divisible by "
                f"the data axis ({ways}), got {n} rows. Fix: set the DataLoader batch size "
                f"to {k} x (a multiple of {ways}) and drop_last=True for training."
            )
        views = {name: t.view(k, n // k, *t.shape[1:]) for name, t in batch.items()}
        p = self.placement
        jbatch = bridge.to_jax(views, p.stacked, stats=p.stats)
        return jbatch, {name: t[: n // k] for name, t in batch.items()}, n // k

    def stack(self, batches: list[Any], accumulate: int) -> Any:
        """The ``accumulate`` batches of one window as ``[m, B, ...]`` (padded to the most
        rows); as :class:`MicroBatches` when their per-row shapes differ (bucketed lengths:
        the step unrolls them, each its own shape)."""
        if self.unaligned:  # (each batch weighs one: unrolled, as they came)
            return MicroBatches(self.to_jax(b) for b in batches)
        n = max(self.global_rows(b) for b in batches)
        padded = [bridge.pad_batch(b, n) for b in batches]
        p = self.placement
        if len({str(jax.tree.map(lambda t: tuple(t.shape), b)) for b in padded}) > 1:
            return MicroBatches(bridge.to_jax(b, p.batch, stats=p.stats) for b in padded)
        stacked = jax.tree.map(lambda *ts: torch.stack(ts), *padded)
        return bridge.to_jax(stacked, p.window, stats=p.stats)

    def checked(self, batch: Any) -> contextlib.AbstractContextManager[None]:
        """The context one step runs in: a field whose shape or dtype changed is named."""
        return check_fields(self.fields, batch)

    # -- once per run -----------------------------------------------------------------------
    def sample(self, batch: Any) -> Any:
        """A JAX batch with one step's shapes, to build the state from."""
        return self.to_jax(batch)

    def planned(self, batch: Any) -> None:
        """Records the first batch's fields (their shapes and dtypes) for :meth:`checked`."""
        if isinstance(batch, dict):
            self.fields = signature(batch)

    def reads_values(self, jbatch: Any) -> bool:
        """Whether the traced forward reads batch values in Python (one compile per value)."""
        return specialise_batch(self.model_fns, jbatch, True) is not jbatch

    def state_dict(
        self, state: Any, twin: torch.nn.Module | None = None
    ) -> dict[str, torch.Tensor]:
        """The trained weights as a torch ``state_dict`` (strictly checked against ``twin``)."""
        raise NotImplementedError(f"{type(self).__name__} hands no weights back")


class FlaxAdapter(Adapter):
    """A Flax linen module, an NNX module, or :class:`jaxcore.ModelFns`, with a JAX loss.

    Args:
        model_fns: the model's ``init``/``apply``.
        placement: where batches go.
        batch_keys: names of the positions of a list/tuple batch.
        nnx_model: the model is an NNX module (its ``BatchStat`` variables are exported as
            ``batch_stats``).
    """

    def __init__(
        self,
        model_fns: jaxcore.ModelFns,
        placement: Placement,
        batch_keys: Sequence[str],
        *,
        nnx_model: bool = False,
    ) -> None:
        super().__init__(model_fns, placement, batch_keys)
        self.nnx_model = nnx_model

    def state_dict(
        self, state: Any, twin: torch.nn.Module | None = None
    ) -> dict[str, torch.Tensor]:
        """The params and model state (``batch_stats``) through :func:`bridge.export_state_dict`."""
        extra = state.model_state
        if self.nnx_model:  # an NNX module's other variables: BatchStat
            extra = {"batch_stats": extra} if extra else {}
        return bridge.export_state_dict({"params": state.params, **extra}, twin)


class TorchAdapter(Adapter):
    """A team's ``nn.Module`` traced by torchax: its params already carry ``state_dict`` names.

    Args:
        model_fns: from :func:`torchshell.torch_model.torch_model_fns`.
        placement: where batches go.
        batch_keys: names of the positions of a list/tuple batch.
        torch_module: the user's module (not changed by training; :meth:`state_dict` is
            what it loads).
    """

    def __init__(
        self,
        model_fns: jaxcore.ModelFns,
        placement: Placement,
        batch_keys: Sequence[str],
        torch_module: torch.nn.Module,
    ) -> None:
        super().__init__(model_fns, placement, batch_keys)
        self.torch_module = torch_module

    def state_dict(
        self, state: Any, twin: torch.nn.Module | None = None
    ) -> dict[str, torch.Tensor]:
        """The params and buffers under the module's own names."""
        from torchshell.torch_model import params_to_state_dict

        assert self.torch_module is not None
        return params_to_state_dict(state.params, state.model_state, self.torch_module)

    @staticmethod
    def arguments(
        module: torch.nn.Module, optimizer: Any, inputs: Sequence[str | int], kwargs: dict
    ) -> tuple[jaxcore.ModelFns, Any, list[str], Any]:
        """``JaxModule.from_torch``'s ``(model_fns, optax optimizer, input names, adapter
        factory)``; ``kwargs`` (the module's options) gets the ``batch_keys`` of a tuple batch
        named by positions."""
        from torchshell.torch_model import torch_model_fns

        if isinstance(optimizer, torch.optim.Optimizer):  # torch's update math, its groups
            trainable = {n: p for n, p in module.named_parameters() if p.requires_grad}
            optimizer = map_configure_optimizers(
                optimizer, trainable, steps_per_epoch=None, total_steps=1
            ).tx
        positions = [i for i in inputs if isinstance(i, int)]
        if "batch_keys" not in kwargs and len(positions) == len(inputs):
            kwargs["batch_keys"] = positional_keys(positions)  # (ids, mask, label): (0, 1)
        keys = tuple(kwargs.get("batch_keys", ("x", "y")))
        names = [keys[i] if isinstance(i, int) else i for i in inputs]
        factory = functools.partial(TorchAdapter, batch_keys=keys, torch_module=module)
        return kept_intact(torch_model_fns(module, names), module), optimizer, names, factory
