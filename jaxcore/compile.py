"""Compilation: the persistent cache switch, AOT compile statistics, recompile counts, dumps.

Every step factory returns a :class:`Step`: the jitted function plus a trace counter. JAX
traces a jitted function once per new input signature (shapes, dtypes, shardings), and each
trace is one XLA compilation, so ``Step.recompiles`` is the number of compilations after the
first. :meth:`Step.compile` runs one AOT ``lower().compile()`` up front; the later calls reuse
that executable (no second compile) and ``cost_analysis()`` gives FLOPs and bytes per step.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

from jaxcore._errors import ConfigError


def enable_compile_cache(
    directory: str | Path, *, min_compile_time_s: float = 0.0, min_entry_size_bytes: int = 0
) -> Path:
    """Switches JAX's persistent compilation cache on, in ``directory``.

    Call it before the first compilation you want cached (the shell does it at start-up when
    the config names a directory). Executables are then written to and read from disk, so a
    second run of the same program skips XLA compilation. Trust the directory: a cache entry
    is executable code.

    Args:
        directory: the cache directory (created if missing).
        min_compile_time_s: cache only compilations slower than this (0: all).
        min_entry_size_bytes: cache only executables larger than this (0: all).

    Returns:
        The directory, absolute.

    Example:
        >>> import tempfile
        >>> d = enable_compile_cache(tempfile.mkdtemp())
        >>> disable_compile_cache()
    """
    path = Path(directory).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", int(min_entry_size_bytes))
    compilation_cache.reset_cache()  # a new directory takes effect even after a compile
    return path


def disable_compile_cache() -> None:
    """Switches the persistent compilation cache off again.

    Example:
        >>> disable_compile_cache()
    """
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()


@dataclass(frozen=True)
class CompileStats:
    """What one AOT compilation of a step cost and what the step computes.

    The FLOPs and bytes come from XLA's cost analysis of the lowered module, which takes
    about as long as reading a cached executable: it runs when one of them is first read,
    not on the way to the first step.

    Attributes:
        lower_seconds: tracing and lowering to StableHLO.
        compile_seconds: XLA compilation (near zero on a persistent-cache hit).
        steps_per_call: optimizer steps in one call.
        recompiles: compilations after the first, so far.
        cost: returns XLA's cost analysis (``{"flops": ..., "bytes accessed": ...}``) of one
            optimizer step, all devices together; ``{}`` when the backend gives none.
    """

    lower_seconds: float
    compile_seconds: float
    steps_per_call: int
    recompiles: int
    cost: Callable[[], Mapping[str, float]] = field(default=dict, repr=False, compare=False)

    @functools.cached_property
    def _analysed(self) -> dict[str, float | None]:
        cost = self.cost()

        def finite(v: Any) -> float | None:
            return v if isinstance(v, int | float) and math.isfinite(v) else None

        return {k: finite(cost.get(k)) for k in ("flops", "bytes accessed")}

    @property
    def flops_per_step(self) -> float | None:
        """XLA's FLOPs of one optimizer step, all devices together (``None``: none given)."""
        return self._analysed["flops"]

    @property
    def bytes_per_step(self) -> float | None:
        """Bytes accessed by one optimizer step, likewise."""
        return self._analysed["bytes accessed"]

    def as_dict(self) -> dict[str, float]:
        """Flat numbers for a metrics logger (``None`` values left out)."""
        items = {
            "lower_seconds": self.lower_seconds,
            "compile_seconds": self.compile_seconds,
            "flops_per_step": self.flops_per_step,
            "bytes_per_step": self.bytes_per_step,
            "steps_per_call": self.steps_per_call,
            "recompiles": self.recompiles,
        }
        return {k: float(v) for k, v in items.items() if v is not None}


def _cost(compiled: Any) -> dict[str, float]:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # some backends implement no cost analysis
        return {}
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    return dict(cost or {})


_CALL_ARGS: contextvars.ContextVar[tuple[Any, ...] | None] = contextvars.ContextVar(
    "jaxcore_step_call_args", default=None
)
_STANDS_FOR: contextvars.ContextVar[dict[int, Any] | None] = contextvars.ContextVar(
    "jaxcore_step_stands_for", default=None
)


def concrete_of(x: Any) -> Any:
    """While a :class:`Step` is traced: the argument leaf (the array the step was called
    with) that traced argument ``x`` stands for; else ``None`` (outside a trace, or a value
    computed inside the step).

    Code traced inside a step uses it to say where an input came from (e.g. which batch
    field, and its dtype on the host before it was handed to JAX).

    Example:
        >>> import jax.numpy as jnp
        >>> seen = []
        >>> step = Step(lambda batch: seen.append(concrete_of(batch["y"])) or batch["y"] * 2)
        >>> y = jnp.arange(3)
        >>> step({"y": y}).tolist(), seen[0] is y, concrete_of(y)
        ([0, 2, 4], True, None)
    """
    found = _STANDS_FOR.get()
    return None if found is None else found.get(id(x))


@contextlib.contextmanager
def _called_with(args: tuple[Any, ...]) -> Iterator[None]:
    token = _CALL_ARGS.set(args)
    try:
        yield
    finally:
        _CALL_ARGS.reset(token)


@contextlib.contextmanager
def _standing_for(traced: tuple[Any, ...]) -> Iterator[None]:
    """Pairs the traced arguments' leaves with those of the call being traced."""
    given = _CALL_ARGS.get()
    pairs: dict[int, Any] | None = None
    if given is not None:
        found: dict[int, Any] = {}
        try:
            jax.tree.map(lambda t, c: found.__setitem__(id(t), c), traced, given)
            pairs = found
        except (ValueError, TypeError):  # another structure: not this call's arguments
            pairs = None
    token = _STANDS_FOR.set(pairs)
    try:
        yield
    finally:
        _STANDS_FOR.reset(token)


class Step:
    """A jitted step: call it like the function; it counts its compilations.

    XLA's cost analysis counts a loop body once, so a step that scans (``steps_per_call``,
    gradient accumulation) passes ``cost_fn``: the same computation for one optimizer step
    without loops, and ``cost_args`` mapping the call's arguments to that function's. Its
    lowered (unpartitioned) module is analysed: the FLOPs and bytes of one whole step, over all
    devices together.

    Attributes:
        name: used for dump file names.
        steps_per_call: optimizer steps per call (for per-step statistics).
        stats: the :class:`CompileStats` of the last :meth:`compile`, or ``None``.

    Example:
        >>> import jax.numpy as jnp
        >>> step = Step(lambda x: x * 2, name="double")
        >>> int(step(jnp.ones((), jnp.int32))), step.recompiles
        (2, 0)
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str = "step",
        steps_per_call: int = 1,
        cost_fn: Callable[..., Any] | None = None,
        cost_args: Callable[..., tuple[Any, ...]] | None = None,
        **jit_kwargs: Any,
    ) -> None:
        self.name = name
        self.steps_per_call = steps_per_call
        self.stats: CompileStats | None = None
        self._traces = 0
        self._cost_fn = cost_fn
        self._cost_args = cost_args

        def traced(*args: Any) -> Any:
            self._traces += 1  # runs once per trace, i.e. once per compilation
            with _standing_for(args):  # (concrete_of: the arguments this trace is for)
                return fn(*args)

        self._jitted = jax.jit(traced, **jit_kwargs)

    def __call__(self, *args: Any) -> Any:
        token = _CALL_ARGS.set(args)
        try:
            return self._jitted(*args)
        finally:
            _CALL_ARGS.reset(token)

    @property
    def compiles(self) -> int:
        """Compilations (traces) so far."""
        return self._traces

    @property
    def recompiles(self) -> int:
        """Compilations after the first: each one a new input shape, dtype or sharding."""
        return max(self._traces - 1, 0)

    def lower(self, *args: Any) -> Any:
        """``jax.jit(...).lower(*args)`` of the underlying function."""
        return self._jitted.lower(*args)

    def _analyse(self, lowered: Any, abstract: tuple[Any, ...] | None) -> dict[str, float]:
        """XLA's cost analysis of one optimizer step (see the class docstring)."""
        if self._cost_fn is None or abstract is None:
            return _cost(lowered)
        ref_args = self._cost_args(*abstract) if self._cost_args else abstract
        return _cost(jax.jit(self._cost_fn).trace(*ref_args).lower())

    def compile(self, *args: Any, dump_dir: str | Path | None = None) -> CompileStats:
        """AOT-compiles for these arguments (arrays or ``ShapeDtypeStruct``s with shardings).

        Later calls with the same signature reuse the executable. With ``dump_dir`` it writes
        ``NAME.jaxpr.txt``, ``NAME.stablehlo.mlir`` and ``NAME.hlo.txt`` (optimized HLO).

        Args:
            *args: the step's arguments, e.g. ``(state, batch)``.
            dump_dir: directory for the jaxpr/StableHLO/HLO dumps, or ``None``.

        Returns:
            The :class:`CompileStats` (also kept in ``self.stats``).
        """
        t0 = time.perf_counter()
        with gc_paused(), _called_with(args):
            traced = self._jitted.trace(*args)
            lowered = traced.lower()
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        abstract = None  # (shapes only: the stats must not keep the arguments alive)
        if self._cost_fn is not None:
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
        self.stats = CompileStats(
            lower_seconds=t1 - t0,
            compile_seconds=t2 - t1,
            steps_per_call=self.steps_per_call,
            recompiles=self.recompiles,
            cost=functools.partial(self._analyse, lowered, abstract),
        )
        if dump_dir is not None:
            out = Path(dump_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{self.name}.jaxpr.txt").write_text(str(traced.jaxpr))
            (out / f"{self.name}.stablehlo.mlir").write_text(lowered.as_text())
            (out / f"{self.name}.hlo.txt").write_text(compiled.as_text() or "")
        return self.stats


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration (a trace and lowering), then
    back as it was.

    Tracing and lowering a step make hundreds of thousands of short-lived objects; each
    full collection they trigger walks every object the process holds (torch, JAX and Flax
    loaded: 50-70 ms a pass). Paused, the warm start of ``benchmarks/compile_cache.py``
    went from 0.96 to 0.87 s to the first step (cold 4.06 -> 3.81 s, 5 repeats each); the
    cycles are collected at the next pass after.

    Example:
        >>> with gc_paused():
        ...     gc.isenabled()
        False
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def check_positive(name: str, value: int) -> int:
    """Validates a positive integer step option."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(
            f"{name} must be a positive integer, got {value!r}. Fix: set {name} to 1 or more."
        )
    return value
