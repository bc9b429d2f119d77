"""Scalar reads of traced torch code: which read a value, which branch, which specialise.

A scalar read is any of ``Tensor.item``, ``bool``, ``int``, ``float``, ``__index__`` and
``torch.equal`` (or ``aten._local_scalar_dense``, where a read inside a torch function lands).
Reads are numbered in the order the traced code makes them; discovery (a trace on a concrete
batch) learns which are host reads, and the step matches them by that number. A traced value
used as a Python bool stops the run (:class:`Branch`), to become a ``lax.cond``
(:func:`torchshell.trace.explore`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

HOST, TRACED = "host", "traced"


class Branch(BaseException):  # control flow, not an error: passes `except Exception`
    """Raised at a traced value used as a Python bool whose outcome this run has not fixed."""

    def __init__(self, pred: jax.Array) -> None:
        super().__init__("traced branch")
        self.pred = pred


class ProbeDone(BaseException):
    """Raised by a probe once it has read every host value it needs."""


class NeedsStatic(Exception):
    """A host read met a traced batch with no static value supplied."""


class Reads:
    """Numbered scalar reads of one tracer: what discovery learnt and what a run supplies.

    Attributes:
        mode: ``"discover"`` (concrete batch: a concrete read is a host read), ``"step"``
            (host reads come from ``statics``) or ``"probe"`` (like discover, stops early).
        kinds: per train flag, the kind of each numbered read found by discovery.
        used: per train flag, the read numbers the compiled step needs as static values.
    """

    def __init__(self) -> None:
        self.mode = "step"
        self.train = True
        self.kinds: dict[bool, list[str]] = {}
        self.used: dict[bool, list[int]] = {}
        self.values: list[Any] = []  # discover/probe: the value of every read, by number
        self.statics: dict[int, Any] | None = None  # step: read number -> static value
        self.stop_after: int | None = None
        self.consumed: set[int] = set()  # step: the read numbers that took a static value
        self.decisions: tuple[bool, ...] = ()
        self.probe_path = True  # probe: the outcome taken at every traced bool
        self.k = 0  # reads so far in this run
        self.d = 0  # decisions so far in this run

    def start(self, decisions: tuple[bool, ...]) -> None:
        """A fresh run along ``decisions``."""
        self.k, self.d, self.decisions, self.values = 0, 0, decisions, []

    def read(
        self, t: Any, as_python: Callable[[Any], Any], traced: Callable[[Any], Any] | None
    ) -> Any:
        """The Python value of a scalar read of the torchax tensor ``t``.

        ``as_python`` converts a concrete value; ``traced`` makes the result for a traced one
        (``None``: the read needs a number, and a traced value cannot be one).
        """
        x = t._elem if hasattr(t, "_elem") else t
        n, self.k = self.k, self.k + 1
        concrete = not isinstance(x, jax.core.Tracer)
        if self.mode != "step":
            if self.mode == "discover":
                kinds = self.kinds.setdefault(self.train, [])
                if len(kinds) <= n:
                    kinds.append(HOST if concrete else TRACED)
            value = as_python(x) if concrete else None
            self.values.append(value)
            if self.mode == "probe" and self.stop_after is not None and n >= self.stop_after:
                raise ProbeDone()
            if concrete:
                return value
        elif concrete:
            return as_python(x)
        else:
            kinds = self.kinds.get(self.train, [])
            if n < len(kinds) and kinds[n] == HOST:
                if self.statics is None or n not in self.statics:
                    raise NeedsStatic(n)
                self.consumed.add(n)
                return self.statics[n]
        if traced is None:
            raise jax.errors.ConcretizationTypeError(x, "a traced value read as a Python number")
        return traced(x)

    def decide(self, pred: Any) -> bool:
        """The outcome of a traced bool along this run's decisions, or :class:`Branch`."""
        if self.mode == "probe":  # a probe only reads host values; any path leads to them
            return self.probe_path  # (unless a check raises on it: TorchTracer.probe)
        if self.d < len(self.decisions):
            self.d += 1
            return self.decisions[self.d - 1]
        raise Branch(jnp.asarray(pred).reshape(()).astype(bool))


class TracedScalar:
    """``t.item()`` of a traced value: comparisons stay traced, ``bool()`` branches."""

    def __init__(self, x: jax.Array, reads: Reads) -> None:
        self.x, self.reads = jnp.asarray(x).reshape(()), reads

    def _cmp(self, op: Callable[[Any, Any], Any], other: Any) -> TracedScalar:
        other = other.x if isinstance(other, TracedScalar) else other
        return TracedScalar(op(self.x, other), self.reads)

    def __lt__(self, o: Any) -> TracedScalar:
        return self._cmp(jnp.less, o)

    def __le__(self, o: Any) -> TracedScalar:
        return self._cmp(jnp.less_equal, o)

    def __gt__(self, o: Any) -> TracedScalar:
        return self._cmp(jnp.greater, o)

    def __ge__(self, o: Any) -> TracedScalar:
        return self._cmp(jnp.greater_equal, o)

    def __eq__(self, o: Any) -> TracedScalar:  # type: ignore[override]
        return self._cmp(jnp.equal, o)

    def __ne__(self, o: Any) -> TracedScalar:  # type: ignore[override]
        return self._cmp(jnp.not_equal, o)

    __hash__ = None  # type: ignore[assignment]

    def _arith(self, op: Callable[[Any, Any], Any], other: Any, swap: bool = False) -> Any:
        """``x.item() / n`` and the like (a value to log) stay traced scalars."""
        if isinstance(other, TracedScalar):
            other = other.x
        elif not isinstance(other, int | float):
            return NotImplemented
        return TracedScalar(op(other, self.x) if swap else op(self.x, other), self.reads)

    def __add__(self, o: Any) -> Any:
        return self._arith(jnp.add, o)

    def __radd__(self, o: Any) -> Any:
        return self._arith(jnp.add, o, swap=True)

    def __sub__(self, o: Any) -> Any:
        return self._arith(jnp.subtract, o)

    def __rsub__(self, o: Any) -> Any:
        return self._arith(jnp.subtract, o, swap=True)

    def __mul__(self, o: Any) -> Any:
        return self._arith(jnp.multiply, o)

    def __rmul__(self, o: Any) -> Any:
        return self._arith(jnp.multiply, o, swap=True)

    def __truediv__(self, o: Any) -> Any:
        return self._arith(jnp.true_divide, o)

    def __rtruediv__(self, o: Any) -> Any:
        return self._arith(jnp.true_divide, o, swap=True)

    def __neg__(self) -> TracedScalar:
        return TracedScalar(-self.x, self.reads)

    def __bool__(self) -> bool:
        return self.reads.decide(self.x != 0)

    def _number(self, *_: Any) -> Any:
        raise jax.errors.ConcretizationTypeError(self.x, "a traced .item() used as a number")  # type: ignore[arg-type]

    __int__ = __float__ = __index__ = _number


def scalar_reads(env: Any, reads: Reads) -> None:
    """Routes every Python read of a torchax tensor through ``reads``."""
    base = torch._C.TensorBase

    def as_bool(x: Any) -> bool:
        return bool(jnp.asarray(x).reshape(()) != 0)

    def branch(x: Any) -> bool:
        return reads.decide(jnp.reshape(x, ()) != 0)

    ops = {
        base.item: lambda t: reads.read(t, lambda x: x.item(), lambda x: TracedScalar(x, reads)),
        base.__bool__: lambda t: reads.read(t, as_bool, branch),
        base.__int__: lambda t: reads.read(t, lambda x: int(x.reshape(())), None),
        base.__index__: lambda t: reads.read(t, lambda x: int(x.reshape(())), None),
        base.__float__: lambda t: reads.read(t, lambda x: float(x.reshape(())), None),
    }
    for fn, impl in ops.items():
        env.override_op_definition(fn, impl)

    def equal(a: Any, b: Any) -> bool:
        if tuple(a.shape) != tuple(b.shape):
            return False
        eq = env.j2t_iso(jnp.array_equal(a._elem, b._elem))
        return reads.read(eq, bool, reads.decide)

    env.override_op_definition(torch.equal, equal)

    # A read inside a torch function torchax runs as Python (``F.gaussian_nll_loss``'s
    # ``torch.any(var < 0)``) reaches aten, not the methods above.
    def local_scalar(t: Any) -> Any:
        if t.dtype == torch.bool:
            return reads.read(t, as_bool, branch)
        return reads.read(t, lambda x: x.item(), None)

    env.override_op_definition(torch.ops.aten._local_scalar_dense.default, local_scalar)
