"""The port's checkpoint group (``LightningAdapter.checkpoint``): the user's ``state_dict``
names and the optimizers' state as plain Lightning writes them, read back into the JAX state;
the user's host code's in-place weight changes kept.

The group owns what a restore holds until the state exists; its methods receive the
:class:`~torchshell.module.JaxModule` whose hooks call them (the protocol:
:class:`~torchshell.adapters.CheckpointLayout`). Manual optimization's optimizer
states are the step group's (``adapter.steps``:
:class:`~torchshell.port._manual_parts.LightningSteps`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import torch

import bridge
from torchshell._errors import ConfigError
from torchshell.adapters._checkpoint import CheckpointLayout
from torchshell.checkpoint import _state_io
from torchshell.optim import state_from_torch, state_to_torch
from torchshell.port._optim_part import LightningOptimizer
from torchshell.port._weights import changed_tensors, tensor_versions

__all__ = ["LightningCheckpoint"]


class LightningCheckpoint(CheckpointLayout):
    """Checkpoints in the user's own layout: ``MyModule.load_from_checkpoint`` and a plain
    Lightning resume read them, and coreshell resumes from plain Lightning's.

    Args:
        port: the traced user module (:class:`~torchshell.port._trace.LightningPort`).
        optim: the adapter's optimizer group (its mapping writes and reads the optimizer
            state).
    """

    def __init__(self, port: Any, optim: LightningOptimizer) -> None:
        self.port = port
        self.optim = optim
        self.restore_weights: Mapping[str, torch.Tensor] | None = None  # until the state exists
        self.restore_optim: Mapping[str, Any] | None = None  # torch optimizer.state_dict()
        self.restore_step = 0
        self.host_versions: Any = None  # the user's tensors' versions when last synced

    def with_weights(self, module: Any, state: Any, sd: Mapping[str, torch.Tensor]) -> Any:
        """The state with a plain Lightning checkpoint's weights (and optimizer state)."""

        def put(tree: dict[str, jax.Array]) -> dict[str, jax.Array]:
            return {
                k: jax.device_put(bridge.as_jax(sd[k], name=k).astype(v.dtype), v.sharding)
                for k, v in tree.items()
            }

        state = state.replace(params=put(state.params), model_state=put(state.model_state))
        torch_opt, self.restore_optim = self.restore_optim, None
        mapped = self.optim.mapped
        steps = module.adapter.steps
        if steps.manual and torch_opt is not None and module.tx is None:  # (the whole .ckpt)
            return steps.restore_optimizers(module, state, torch_opt)
        if torch_opt is None or mapped is None or module.tx is not None:
            print(
                "coreshell: starting from the checkpoint's weights; it holds no optimizer state "
                "this run can map, so the JAX optimizer starts fresh."
            )
            return state
        step = int(self.restore_step)
        mapped_state = state_from_torch(mapped, torch_opt, state.params, step=step)
        opt_state = state.opt_state
        if isinstance(opt_state, tuple) and not hasattr(opt_state, "_fields"):  # (clip, tx)
            opt_state = (opt_state[0], mapped_state)
        else:
            opt_state = mapped_state
        shardings = jax.tree.map(lambda x: x.sharding, state.opt_state)
        return state.replace(
            opt_state=jax.device_put(opt_state, shardings),
            step=jax.device_put(jnp.asarray(step, state.step.dtype), state.step.sharding),
        )

    def restored(self, module: Any, state: Any) -> Any:
        """The first state with the weights a plain Lightning checkpoint loaded before it."""
        if self.restore_weights is None:
            return state
        state = self.with_weights(module, state, self.restore_weights)
        self.restore_weights = None
        return state

    # -- what the user's host code changes in place -------------------------------------------
    def synced(self, module: Any) -> None:
        """Keeps the versions of the tensors just synced (see :meth:`write_back_host`)."""
        self.host_versions = tensor_versions(self.port.module)

    def before_step(self, module: Any) -> None:
        """What the user's host hooks changed in place, into the state before the step (only
        compared when host code read the weights since the last sync)."""
        if self.host_versions:
            self.write_back_host(module)

    def write_back_host(self, module: Any) -> None:
        """Weights the user's host code changed in place since they were synced into the
        module, into the JAX state, as plain Lightning keeps them: BatchNorm's running
        statistics after an epoch-end ``self(z)`` in train mode, a weight clamp in
        ``on_train_batch_end``. (Compared with a copy taken at the sync; nothing is compared
        when no host code read the weights since the last step.)"""
        versions = self.host_versions
        state = module.state
        if state is None or module.held.synced is not state or not versions:
            return
        changed = changed_tensors(self.port.module, versions)
        if changed:

            def put(tree: dict[str, jax.Array]) -> dict[str, jax.Array]:
                return {
                    k: jax.device_put(
                        bridge.as_jax(changed[k].detach().clone(), name=k).astype(v.dtype),
                        v.sharding,
                    )
                    if k in changed
                    else v
                    for k, v in tree.items()
                }

            module.state = state.replace(
                params=put(state.params), model_state=put(state.model_state)
            )
            module.held.synced = module.state
            self.host_versions = tensor_versions(self.port.module)

    def load_state_dict(
        self, module: Any, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Takes the user's ``state_dict`` (a plain Lightning checkpoint of the same module)."""
        expected = set(self.port.module.state_dict())
        got = set(state_dict)
        if strict and got != expected:
            raise ConfigError(
                f"The checkpoint's state_dict does not match {type(self.port.module).__name__}:"
                f" missing {sorted(expected - got)[:5]}, unexpected {sorted(got - expected)[:5]}."
                " Fix: resume from a checkpoint of the same module class and hyperparameters."
            )
        if module.state is not None:
            if module.held.tensors is None:
                module.state = self.with_weights(module, module.state, state_dict)
        elif module.held.tensors is None:
            self.restore_weights = dict(state_dict)
        return torch.nn.modules.module._IncompatibleKeys([], [])

    def save(self, module: Any, checkpoint: dict[str, Any]) -> None:
        """The user's ``state_dict``, optimizer and scheduler states, ``hyper_parameters``,
        then the user's own ``on_save_checkpoint``."""
        user = self.port.module
        if module.state is None:  # before the first step (Lightning's tuner saves one): as built
            checkpoint["state_dict"] = user.state_dict()
        else:
            checkpoint["state_dict"] = module.torch_state_dict()
            mapped = self.optim.mapped
            if module.adapter.steps.manual and module.tx is None:
                module.adapter.steps.save_optimizers(module, checkpoint)
            elif mapped is not None and module.tx is None:  # plain Lightning resumes from it
                opt_state = module.state.opt_state
                if module.flags.clip_val is not None:
                    opt_state = opt_state[1]
                optimizer, schedulers = state_to_torch(mapped, opt_state)
                for index in mapped.plateau:  # stepped on the host: the live objects'
                    schedulers[index] = self.optim.configs[index].scheduler.state_dict()
                    live = module.trainer.optimizers[0].param_groups  # (exact, not float32)
                    for group, now in zip(optimizer["param_groups"], live, strict=True):
                        group["lr"] = now["lr"]
                checkpoint["optimizer_states"] = [optimizer]
                checkpoint["lr_schedulers"] = schedulers
        if user.hparams:
            checkpoint["hyper_parameters"] = dict(user.hparams)
            name = getattr(user, "_hparams_name", None)
            if name:
                checkpoint["hparams_name"] = name
        user.on_save_checkpoint(checkpoint)

    def load(self, module: Any, checkpoint: dict[str, Any]) -> None:
        """The user's ``on_load_checkpoint``; a plain Lightning checkpoint's optimizer state
        kept for the state (and its step counts made readable under manual optimization)."""
        self.port.module.on_load_checkpoint(checkpoint)
        loop = checkpoint.get("loops", {}).get("fit_loop", {})
        auto = loop.get("epoch_loop.automatic_optimization.optim_progress", {})
        manual = loop.get("epoch_loop.manual_optimization.optim_step_progress")
        steps = auto.get("optimizer", {}).get("step")
        if steps and manual is not None and not manual["total"]["completed"]:
            # a plain Lightning run counted its optimizer steps under automatic optimization
            loop["epoch_loop.manual_optimization.optim_step_progress"] = steps
        if _state_io.STATE_KEY not in checkpoint and checkpoint.get("optimizer_states"):
            manual = module.adapter.steps.manual
            self.restore_optim = checkpoint if manual else checkpoint["optimizer_states"][0]
            self.restore_step = int(checkpoint.get("global_step", 0))
