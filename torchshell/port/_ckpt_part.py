"""The port's checkpoints: the user's ``state_dict`` names and the optimizers' state as
plain Lightning writes them, read back into the JAX state (a part of
:class:`~torchshell.port._module.LightningParts`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import torch

import bridge
from torchshell._errors import ConfigError
from torchshell.checkpoint import _state_io
from torchshell.module._parts import _Shared
from torchshell.optim import state_from_torch, state_to_torch
from torchshell.port._weights import changed_tensors, tensor_versions

__all__ = ["PortCheckpointPart"]


class PortCheckpointPart(_Shared):
    _host_versions: Any  # the user's tensors' versions when last synced

    def _with_weights(self, state: Any, sd: Mapping[str, torch.Tensor]) -> Any:
        """The state with a plain Lightning checkpoint's weights (and optimizer state)."""

        def put(tree: dict[str, jax.Array]) -> dict[str, jax.Array]:
            return {
                k: jax.device_put(bridge.as_jax(sd[k], name=k).astype(v.dtype), v.sharding)
                for k, v in tree.items()
            }

        state = state.replace(params=put(state.params), model_state=put(state.model_state))
        torch_opt, self._restore_optim = self._restore_optim, None
        if self.manual and torch_opt is not None and self.tx is None:  # (the whole .ckpt)
            return self._manual_restore(state, torch_opt)
        if torch_opt is None or self.mapped is None or self.tx is not None:
            print(
                "coreshell: starting from the checkpoint's weights; it holds no optimizer state "
                "this run can map, so the JAX optimizer starts fresh."
            )
            return state
        step = int(self._restore_step)
        mapped_state = state_from_torch(self.mapped, torch_opt, state.params, step=step)
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

    # -- what the user's host code changes in place -------------------------------------------
    def _sync_user_weights(self) -> None:
        """(Also keeps a copy of what was synced: :meth:`_write_back_host`.)"""
        fresh = self._synced is not self.state
        super()._sync_user_weights()
        if fresh and self.state is not None and self._synced is self.state:
            self._host_versions = tensor_versions(self.port.module)

    def _write_back_host(self) -> None:
        """Weights the user's host code changed in place since they were synced into the
        module, into the JAX state, as plain Lightning keeps them: BatchNorm's running
        statistics after an epoch-end ``self(z)`` in train mode, a weight clamp in
        ``on_train_batch_end``. (Compared with a copy taken at the sync; nothing is compared
        when no host code read the weights since the last step.)"""
        versions = self._host_versions
        if self.state is None or self._synced is not self.state or not versions:
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

            self.state = self.state.replace(
                params=put(self.state.params), model_state=put(self.state.model_state)
            )
            self._synced = self.state
            self._host_versions = tensor_versions(self.port.module)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self._write_back_host()
        return super().training_step(batch, batch_idx)  # type: ignore[misc]

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
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
        if self.state is not None:
            if self._restore_tensors is None:
                self.state = self._with_weights(self.state, state_dict)
        elif self._restore_tensors is None:
            self._restore_weights = dict(state_dict)
        return torch.nn.modules.module._IncompatibleKeys([], [])

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        user = self.port.module
        if self.state is None:  # before the first step (Lightning's tuner saves one): as built
            checkpoint["state_dict"] = user.state_dict()
        else:
            checkpoint["state_dict"] = self.torch_state_dict()
            if self.manual and self.tx is None:
                self._manual_checkpoint(checkpoint)
            elif self.mapped is not None and self.tx is None:  # plain Lightning resumes from it
                opt_state = self.state.opt_state
                if self.flags.clip_val is not None:
                    opt_state = opt_state[1]
                optimizer, schedulers = state_to_torch(self.mapped, opt_state)
                for index in self.mapped.plateau:  # stepped on the host: the live objects'
                    schedulers[index] = self._configs[index].scheduler.state_dict()
                    live = self.trainer.optimizers[0].param_groups  # (exact, not float32)
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

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.port.module.on_load_checkpoint(checkpoint)
        loop = checkpoint.get("loops", {}).get("fit_loop", {})
        auto = loop.get("epoch_loop.automatic_optimization.optim_progress", {})
        manual = loop.get("epoch_loop.manual_optimization.optim_step_progress")
        steps = auto.get("optimizer", {}).get("step")
        if steps and manual is not None and not manual["total"]["completed"]:
            # a plain Lightning run counted its optimizer steps under automatic optimization
            loop["epoch_loop.manual_optimization.optim_step_progress"] = steps
        if _state_io.STATE_KEY not in checkpoint and checkpoint.get("optimizer_states"):
            self._restore_optim = checkpoint if self.manual else checkpoint["optimizer_states"][0]
            self._restore_step = int(checkpoint.get("global_step", 0))
