"""Scalars a torch forward reads from the batch in Python, handed to the step as static values.

``int(lengths.max().item())`` needs the batch's value while the step is being compiled. The
discovery trace of :func:`torchshell.torch_model_fns` finds such host reads; before each step,
:func:`specialise_batch` evaluates them on the host batch (a probe that traces only up to the
last read) and adds them to the batch as the *shape* of an empty array under
:data:`STATIC_KEY`. ``jax.jit`` compiles once per distinct shape, so the step is compiled once
per distinct value (bucketed by ``static_buckets``), and each compilation shows in the step's
``recompiles``; past ``max_static`` distinct values a warning says so.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import torch

import bridge
from jaxcore import ModelFns
from jaxcore.model import _inputs as jaxcore_inputs
from torchshell._errors import TorchModelError
from torchshell.trace._embedding import EmbeddingChecks
from torchshell.trace._paths import decode, encode

Batch = Mapping[str, Any]


def _inputs(batch: Mapping[str, Any], keys: Sequence[str]) -> list[Any]:
    """The forward's positional inputs, read from the batch by key (jaxcore's check)."""
    return jaxcore_inputs(batch, keys)


def _concrete(v: Any) -> Any:
    """Concrete JAX arrays of a batch value, leaf by leaf (a nested dict of inputs too): a
    copy of each torch tensor, range-checked."""
    return jax.tree.map(
        lambda t: bridge.as_jax(t) if isinstance(t, torch.Tensor) else jax.numpy.asarray(t), v
    )


STATIC_KEY = "~torchshell.static"  # sorts after every plain field name


def check_static_reads(values: Mapping[int, Any], where: str) -> None:
    """Refuses a host read that is not an int or a bool (it cannot be a static value)."""
    for n, v in values.items():
        if not isinstance(v, bool | int):
            raise TorchModelError(
                f"{where} reads a {type(v).__name__} scalar from the batch in Python "
                f"(read #{n}): only ints and bools can be specialised (one compiled step per "
                "value). Fix: keep that value a tensor (e.g. x / x.max() instead of "
                "x / x.max().item())."
            )


class StaticSpec:
    """The host reads of one traced forward, per train flag, and the values seen so far."""

    def __init__(
        self, tracer: Any, keys: Sequence[str], buckets: Sequence[int] | None, max_static: int
    ) -> None:
        self.tracer, self.keys = tracer, tuple(keys)
        self.buckets = sorted(buckets) if buckets else []
        self.max_static = max_static
        self.used: dict[bool, list[int]] = {}
        self.types: dict[bool, list[type]] = {}
        self.seen: dict[bool, set[tuple[int, ...]]] = {True: set(), False: set()}
        self.last: dict[bool, tuple[int, ...]] = {}
        # nn.Embedding's indices, checked inside the step (as torch does: an id past the
        # table is refused, not trained into NaN); the forward names the batch fields
        self.embeddings = EmbeddingChecks()
        self.embeddings.install(tracer.env, tracer.module)

    def discover(self, concrete: Batch, train: bool) -> None:
        """Finds the host reads of the forward on a concrete batch (see ``host_reads``)."""
        reads = self.tracer.host_reads(self.tracer.module, _inputs(concrete, self.keys), train)
        self.learn(train, reads)

    def learn(self, train: bool, values: Mapping[int, Any]) -> None:
        """Keeps the read numbers (and Python types) that need a static value."""
        check_static_reads(values, f"The forward ({'train' if train else 'eval'} mode)")
        self.used[train] = sorted(values)
        self.types[train] = [type(values[n]) for n in self.used[train]]

    def needed(self, train: bool) -> bool:
        return bool(self.used.get(train))

    def values_of(self, batch: Batch, train: bool) -> dict[int, Any] | None:
        """The static values the batch carries for this mode, by read number."""
        if STATIC_KEY not in batch or not self.needed(train):
            return None
        dims = batch[STATIC_KEY].shape[2:]
        values = decode(dims)
        if len(values) != len(self.used[train]):
            return None  # made for the other mode: the read will say what is missing
        return {
            n: t(v) for n, t, v in zip(self.used[train], self.types[train], values, strict=True)
        }

    def _host_values(self, batch: Batch, train: bool) -> tuple[int, ...]:
        concrete = {k: _concrete(batch[k]) for k in self.keys if k in batch}
        module = self.tracer.module
        used = self.used[train]
        values = self.tracer.probe(module, _inputs(concrete, self.keys), train, used[-1])
        return tuple(int(values[n]) for n in used)

    def attach(self, batch: Batch, concrete: Batch | None, train: bool) -> Batch:
        """``batch`` plus the static values of ``concrete`` (unbucketed: for checks), or the
        last ones :meth:`specialise` made when the batch is traced."""
        if not self.needed(train):
            return batch
        if concrete is not None:
            values = self._host_values(concrete, train)
        else:  # the other mode's when this one has none yet: the same reads, as a rule
            values = self.last.get(train, self.last.get(not train, ()))
            if len(values) != len(self.used[train]):
                return batch
        return {**batch, STATIC_KEY: _key(batch, values)}

    def missing(self, n: int, train: bool) -> TorchModelError:
        mode = "train" if train else "eval"
        return TorchModelError(
            f"The forward reads a scalar from the batch in Python (read #{n}, {mode} mode, e.g. "
            "int(lengths.max())), so each step is compiled for its value, but the batch "
            f"carries no static values ({STATIC_KEY!r}). Fix: pass every batch through "
            f"torchshell.torch_model.specialise_batch(fns, batch, train={train}) before "
            "the step (JaxModule.from_torch does), or make that value a tensor."
        )

    def specialise(self, batch: Batch, train: bool) -> Batch:
        if train not in self.used:  # not initialised on a concrete batch yet
            concrete = {k: _concrete(batch[k]) for k in self.keys if k in batch}
            for mode in (True, False):
                self.discover(concrete, mode)
        if not self.needed(train):
            return batch
        values = self._host_values(batch, train)
        if self.buckets:
            values = tuple(v if isinstance(v, bool) else _bucket(v, self.buckets) for v in values)
        seen = self.seen[train]
        if values not in seen:
            seen.add(values)
            if len(seen) > self.max_static:
                warnings.warn(
                    f"The torch forward's batch scalars took {len(seen)} distinct values "
                    f"(now {values}; {'train' if train else 'eval'} mode), past "
                    f"max_static={self.max_static}: each compiles the step again "
                    "(compile/recompiles). Fix: pad inputs to a few lengths, pass "
                    "static_buckets=(...) to torch_model_fns, or raise max_static.",
                    RuntimeWarning,
                    stacklevel=3,
                )
        self.last[train] = values
        return {**batch, STATIC_KEY: _key(batch, values)}


def _bucket(v: int, buckets: Sequence[int]) -> int:
    i = bisect.bisect_left(buckets, v)
    return buckets[i] if i < len(buckets) else v


def _key(batch: Batch, values: Sequence[int]) -> Any:
    """An empty int8 array ``[rows, 0, *values]``, placed like the batch's first array."""
    first = next(v for v in batch.values() if hasattr(v, "shape"))
    shape = (first.shape[0], 0, *encode([int(v) for v in values]))
    if isinstance(first, jax.Array) and not isinstance(first, jax.core.Tracer):
        return jax.device_put(np.zeros(shape, np.int8), first.sharding)
    if isinstance(first, torch.Tensor):
        return torch.zeros(shape, dtype=torch.int8)
    return np.zeros(shape, np.int8)


def specialise_batch(fns: ModelFns, batch: Batch, train: bool = True) -> Batch:
    """The batch plus the static values its torch forward reads from it in Python.

    A no-op (the same batch) for models without such reads and for non-torch models. Call it
    on every host batch before the jitted step (and before ``jaxcore.init_train_state``,
    which traces ``init`` under ``jax.jit``, where the batch is no longer concrete): the
    first call finds the reads, and the step is compiled once per distinct value.

    Args:
        fns: from :func:`torchshell.torch_model_fns`, after ``init`` (or ``example=``).
        batch: the batch the step will get (torch tensors, numpy or JAX arrays).
        train: the mode of the step (train or eval/predict).

    Returns:
        ``batch`` with :data:`STATIC_KEY` added when the forward needs it.

    Example:
        >>> import jax, jax.numpy as jnp, torch
        >>> from torchshell.torch_model import torch_model_fns
        >>> class Crop(torch.nn.Module):
        ...     def forward(self, x, n):
        ...         return x[:, : int(n.max())]
        >>> fns = torch_model_fns(Crop(), ("x", "n"))
        >>> batch = {"x": jnp.ones((2, 8)), "n": jnp.array([3, 5])}
        >>> _ = fns.init(jax.random.key(0), batch)
        >>> b = specialise_batch(fns, batch)
        >>> fns.apply({}, {}, b, jax.random.key(0), True)[0].shape
        (2, 5)
    """
    spec = getattr(fns.apply, "torch_static", None)
    if not isinstance(spec, StaticSpec) or (train in spec.used and not spec.needed(train)):
        return batch
    return spec.specialise(batch, train)
