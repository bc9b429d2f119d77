"""The ``LightningModule`` adapter: batches in the user's own structure, nothing padded.

What differs from the Flax and torch paths' hand-over (:class:`torchshell.adapters._base.Adapter`):

- batches reach ``training_step`` with the structure the DataLoader gave (tuples, dicts,
  nested); nothing is padded (a ragged batch compiles once more, counted): the user's loss
  is a mean over the rows it is given, as in plain Lightning;
- a batch whose rows the data axis does not divide is placed whole on every device;
- the values ``training_step`` reads in Python specialise the step
  (:meth:`LightningPort.specialise`); the trained weights come back in the module's own
  ``state_dict`` layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import jax
import torch
from jax.sharding import NamedSharding, PartitionSpec

import bridge
import jaxcore
from torchshell._errors import ConfigError
from torchshell.adapters._base import TorchAdapter
from torchshell.adapters._batches import MicroBatches, host_fields_out
from torchshell.adapters._containers import containers_as_nodes
from torchshell.adapters._flax_checks import check_lengths_and_masks
from torchshell.adapters._placement import Placement
from torchshell.port._ckpt_part import LightningCheckpoint
from torchshell.port._hooks import LightningHooks
from torchshell.port._manual_parts import LightningSteps
from torchshell.port._optim_part import LightningOptimizer
from torchshell.port._trace import LightningPort
from torchshell.port._user import LightningEvaluation, LightningLogs

__all__ = ["LightningAdapter"]


class LightningAdapter(TorchAdapter):
    """A whole ``LightningModule`` as the JAX core (``JaxModule.from_lightning``).

    Its method groups (the protocol: :class:`~torchshell.adapters._base.Adapter`): ``optim``
    maps the user's ``configure_optimizers`` (:class:`LightningOptimizer`), ``checkpoint``
    writes and reads the user's own layout (:class:`LightningCheckpoint`).
    ``logs`` names the training values as the user's ``self.log`` calls do and adds up their
    epoch means (:class:`~torchshell.port._user.LightningLogs`); ``evaluation`` runs the
    user's ``validation_step``/``test_step``/``predict_step`` traced, their ``self.log``
    values through Lightning's (:class:`~torchshell.port._user.LightningEvaluation`);
    ``steps`` supplies the user's manual optimization's step and its ``opt.step()`` counts
    (:class:`~torchshell.port._manual_parts.LightningSteps`); ``hooks`` runs the user's own
    hooks beside the module's and forwards its attributes (:class:`LightningHooks`).

    Args:
        model_fns: the port's ``init``/``apply`` (:meth:`LightningPort.model_fns`).
        placement: where batches go.
        port: the traced user module.
    """

    # Lightning weighs each accumulated batch's loss equally (loss / accumulate_grad_batches),
    # whatever its rows or mask: the user's structure has no row count of coreshell's
    weigh_rows = False
    supports_windows = False  # the user's self.log and epoch aggregation run per step

    def __init__(self, model_fns: jaxcore.ModelFns, placement: Placement, port: LightningPort):
        super().__init__(model_fns, placement, (), port.module)
        self.port = port
        self.hooks: LightningHooks = LightningHooks(port)  # (refuses torch optimizer hooks)
        self.optim: LightningOptimizer = LightningOptimizer(port)
        self.checkpoint: LightningCheckpoint = LightningCheckpoint(port, self.optim)
        self.logs: LightningLogs = LightningLogs(port)
        self.evaluation: LightningEvaluation = LightningEvaluation(port)
        self.steps: LightningSteps = LightningSteps(port)

    def prepare(self, batch: Any) -> Any:
        """The user's batch as it came, checked as torch would, host-only fields set aside."""
        if isinstance(batch, Mapping):  # named fields: negative lengths, misfit masks
            check_lengths_and_masks(batch, row_mask=False)  # its 'mask' is the user's
        return host_fields_out(batch)  # (embedding indices: checked in the step)

    def global_rows(self, batch: Any) -> int:
        """Rows of a batch: its fields' common leading size, else Lightning's batch size (the
        first tensor's, in the batch's own order: e.g. a dict of several loaders' batches)."""
        return jaxcore.rows(batch, default=0) or bridge.rows(batch)

    def place(self, tree: Any, stacked: bool = False) -> Any:
        """``tree`` on the mesh: split over the data axis when it divides the rows, else
        whole on every device."""
        p = self.placement
        n = jaxcore.rows(tree, 1 if stacked else 0, default=0)
        if n and n % p.ways == 0:
            sharding = p.window if stacked else p.batch
        else:  # rows the data axis does not divide: the whole batch on every device
            sharding = NamedSharding(p.mesh, PartitionSpec())
        return bridge.to_jax(tree, sharding, stats=p.stats)

    def to_jax(self, batch: Any, train: bool = True) -> Any:
        """The batch placed; for training, with the values ``training_step`` reads in Python
        (the evaluation hooks specialise their own: :mod:`torchshell.port._user`)."""
        placed = self.place(batch)
        return self.port.specialise("training_step", placed, True) if train else placed

    def sample(self, batch: Any) -> Any:
        containers_as_nodes(batch)  # (the first batch may come before any hand-over)
        if self.port.weights_only:  # an eval batch: the state from the weights alone
            return self.place(batch)
        return self.to_jax(batch)

    def one_step_view(self, batch: Any, k: int) -> tuple[Any, Any, int]:
        if k > 1:
            raise ConfigError(
                "steps_per_call > 1 is not supported by JaxModule.from_lightning (the user's "
                "batches are not re-stacked). Fix: use steps_per_call=1."
            )
        return self.to_jax(batch), batch, self.global_rows(batch)

    def stack(self, batches: list[Any], accumulate: int) -> Any:
        """The window's batches stacked ``[m, B, ...]``; as :class:`MicroBatches` when their
        shapes differ (a ragged last batch: the step unrolls them, each its own shape)."""
        self.to_jax(batches[0])
        if self.port.needs_statics("training_step"):
            raise ConfigError(
                f"accumulate_grad_batches={accumulate}: "
                f"{type(self.port.module).__name__}.training_step reads batch values in Python "
                "(e.g. int(lengths.max())), which differ between the accumulated batches of "
                "one compiled step. Fix: accumulate_grad_batches=1 with a larger batch, or "
                "keep those values tensors (masks instead of lengths.max())."
            )
        if len({repr(jax.tree.map(lambda t: tuple(t.shape), b)) for b in batches}) > 1:
            return MicroBatches(self.place(b) for b in batches)
        stacked = jax.tree.map(lambda *ts: torch.stack(ts), *batches)
        return self.place(stacked, stacked=True)

    def checked(self, batch: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # the traced step names its own errors

    def planned(self, batch: Any) -> None:
        """Nothing to record: the traced step checks the user's batch itself."""
