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
import operator
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import torch
from jax.sharding import NamedSharding, PartitionSpec

import bridge
import jaxcore
from torchshell._errors import ConfigError
from torchshell.adapters._base import TorchAdapter
from torchshell.adapters._batches import MicroBatches, host_fields_out
from torchshell.adapters._containers import containers_as_nodes
from torchshell.adapters._flax_checks import _checked_fields, check_lengths_and_masks
from torchshell.adapters._placement import Placement
from torchshell.port._ckpt_part import LightningCheckpoint
from torchshell.port._hooks import LightningHooks
from torchshell.port._manual_parts import LightningSteps
from torchshell.port._optim_part import LightningOptimizer
from torchshell.port._trace import LightningPort
from torchshell.port._user import LightningEvaluation, LightningLogs

__all__ = ["LightningAdapter"]

_ARRAYS = (torch.Tensor, jax.Array)
_EXACT = operator.attrgetter("shape", "dtype")
_TRANSFERS = 4  # batch forms (shapes) handed over as planned: the steady one, a ragged last


class _Form(NamedTuple):
    """The form of a training batch that needed nothing from :meth:`LightningAdapter.prepare`
    but its checks: its container type (a dict, list or tuple of tensors, one level), a dict's
    keys, and whether fields named as lengths or masks have their values checked."""

    kind: Any  # type(batch) (Any: a match does not narrow the batch for mypy)
    keys: frozenset[Any] | None  # a Mapping's (its values are the fields), else None
    checked: bool  # fields named `*lengths`/`*mask`: their values checked per batch

    @classmethod
    def learn(cls, batch: Any, prepared: Any) -> _Form | None:
        """The form of ``batch`` when ``prepared`` (its preparation) is the batch itself: a
        one-level container of tensors, no host-only field; else ``None``."""
        if prepared is not batch or not isinstance(batch, Mapping | list | tuple):
            return None
        fields = batch.values() if isinstance(batch, Mapping) else batch
        if not all(isinstance(t, _ARRAYS) for t in fields):
            return None
        if not isinstance(batch, Mapping):
            return cls(type(batch), None, False)
        return cls(type(batch), frozenset(batch), any(_checked_fields(tuple(batch))))


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
        self._form: _Form | None = None  # the run's training batches' form (``prepare``)
        # the batch `prepare` last matched, with its rows: (batch, common rows or 0, first's)
        self._rows: tuple[Any, int, int] | None = None
        self._whole: tuple[Any, int, NamedSharding] | None = None  # (placement, ways, replicated)
        # per exact form of a matched batch (container, shapes, dtypes): its hand-over,
        # decided once (None: bridge.to_jax decides per batch)
        self._transfers: dict[Any, bridge.BatchTransfer | None] = {}

    def prepare(self, batch: Any) -> Any:
        """The user's batch as it came, checked as torch would, host-only fields set aside.

        A batch of the form the run's batches had (:class:`_Form`) is matched in one pass over
        its fields, which also finds its rows (kept for :meth:`one_step_view`); any other
        takes the full path, and its form is learned anew.
        """
        form = self._form
        if form is not None and type(batch) is form.kind:
            common, first = -1, 0  # (-2: the fields' rows differ)
            named = form.keys is not None
            if not named or batch.keys() == form.keys:
                for t in batch.values() if named else batch:
                    if not isinstance(t, _ARRAYS):
                        break  # (a host-only field: the full path)
                    if t.ndim:
                        n = t.shape[0]
                        first = first or n
                        common = n if common in (-1, n) else -2
                else:
                    if form.checked:  # negative lengths, misfit masks
                        check_lengths_and_masks(batch, row_mask=False)
                    self._rows = (batch, max(common, 0), first)
                    return batch
        if isinstance(batch, Mapping):  # named fields: negative lengths, misfit masks
            check_lengths_and_masks(batch, row_mask=False)  # its 'mask' is the user's
        prepared = host_fields_out(batch)  # (embedding indices: checked in the step)
        self._form, self._rows = _Form.learn(batch, prepared), None
        return prepared

    def global_rows(self, batch: Any) -> int:
        """Rows of a batch: its fields' common leading size, else Lightning's batch size (the
        first tensor's, in the batch's own order: e.g. a dict of several loaders' batches)."""
        if self._rows is not None and self._rows[0] is batch:  # (prepare found them)
            return self._rows[1] or self._rows[2]
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
        """One training step's batch placed (as :meth:`to_jax`), the batch, its rows: for a
        batch ``prepare`` matched, with the rows it found and without asking the port for
        Python-read values when ``training_step`` reads none."""
        if k > 1:
            raise ConfigError(
                "steps_per_call > 1 is not supported by JaxModule.from_lightning (the user's "
                "batches are not re-stacked). Fix: use steps_per_call=1."
            )
        rows, self._rows = self._rows, None
        if rows is None or rows[0] is not batch:
            return self.to_jax(batch), batch, self.global_rows(batch)
        _, common, first = rows
        p = self.placement
        if self._whole is None or self._whole[0] is not p:
            self._whole = (p, p.ways, NamedSharding(p.mesh, PartitionSpec()))
            self._transfers.clear()
        kind = type(batch)
        fields = batch.values() if kind is dict else batch
        exact = (kind, tuple(map(_EXACT, fields)))
        transfer = self._transfers[exact] if exact in self._transfers else self._plan(exact, batch)
        if transfer is None:
            ways, whole = self._whole[1], self._whole[2]
            sharding = p.batch if common and common % ways == 0 else whole  # (as `place`)
            placed = bridge.to_jax(batch, sharding, stats=p.stats)
        elif kind is dict:
            placed = transfer(batch)
        else:  # (a list or tuple: its fields named by position, as bridge.to_jax names them)
            named = dict(zip(map(str, range(len(batch))), batch, strict=True))
            placed = kind(transfer(named).values())
        port = self.port
        statics = port.statics.get("training_step")  # (None: not yet looked for)
        if statics is None or statics[0] or port.reads_step:
            placed = port.specialise("training_step", placed, True)
        return placed, batch, common or first

    def _plan(self, exact: Any, batch: Any) -> bridge.BatchTransfer | None:
        """The hand-over of matched batches of this exact form (a flat dict, list or tuple of
        CPU tensors), decided once from ``batch`` as :func:`bridge.to_jax` would place it
        (:class:`bridge.BatchTransfer`); ``None``: ``to_jax`` decides per batch."""
        kind = exact[0]
        if len(self._transfers) >= _TRANSFERS or kind not in (dict, list, tuple):
            return None
        assert self._whole is not None  # (one_step_view's: this placement's)
        p, ways, whole = self.placement, self._whole[1], self._whole[2]
        n = jaxcore.rows(batch, default=0)
        sharding = p.batch if n and n % ways == 0 else whole  # (as `place`)
        names = map(str, range(len(batch)))  # (as bridge.to_jax names a list's fields)
        sample = batch if kind is dict else dict(zip(names, batch, strict=True))
        self._transfers[exact] = plan = bridge.BatchTransfer.plan(sample, sharding, p.stats)
        return plan

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

    checks_fields = False  # (the module's training step skips checked)

    def checked(self, batch: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # the traced step names its own errors

    def planned(self, batch: Any) -> None:
        """Nothing to record: the traced step checks the user's batch itself."""
