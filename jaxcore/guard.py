"""NaN/Inf guard of the train step, and the ``jax_debug_nans`` debug switch.

The guard runs inside the jitted step with no host sync: a step whose loss or gradient norm is
not finite does not apply its update (params, optimizer and model state keep their values),
``TrainState.nonfinite`` counts it and ``TrainState.nonfinite_step`` remembers the first one.

- ``"none"``: no guard (a NaN propagates into the params).
- ``"skip"``: refused steps are skipped; training goes on with the next batch.
- ``"stop"``: after the first refused step every later update is refused too, so the state
  stays the last good one until the shell looks (:func:`check_finite`) and stops. When the
  refused step's batch held NaN/Inf in a floating field, ``TrainState.nonfinite_input``
  remembers which field and rows (:func:`input_where`): the error then names the input, not
  the learning rate. A batch with NaN that the model handles (missing values read through
  ``torch.where``/``nan_to_num``) gives a finite loss and trains, as in torch. No host pass
  over the batch.

**Input checks** (:func:`input_check`): an op of the model (an embedding's index range)
reports, while the step is traced, that its input is invalid; the step folds every report
into one ``[code, value]`` (:data:`NO_CHECK` when none fails), refuses the update under
``skip``/``stop`` and ``TrainState.nonfinite_input`` remembers the check (``[CHECKED, code,
value, ...]``), so :func:`check_finite` raises the check's own message. Flax's ``nn.Embed``
is checked this way by every train step (:func:`checking`); the torch ops report from the
shell. One min/max reduction per index array, no host pass.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from jax.extend import core as jex_core

from jaxcore._errors import BatchError, ConfigError, NonFiniteError
from jaxcore._inputs import INPUT_ROWS, NO_INPUT
from jaxcore._inputs import input_where as input_where  # (re-exported: the guard's own check)
from jaxcore._inputs import window_input_where as window_input_where

PyTree = Any

NAN_POLICIES = ("none", "skip", "stop")
CHECKED = -2  # ``nonfinite_input[0]`` when an input check refused the step: [CHECKED, code, value]
NO_CHECK = (-1, 0)  # the ``[code, value]`` of a step whose input checks all passed


def check_policy(nan_policy: str) -> str:
    """Validates a NaN policy name.

    Example:
        >>> check_policy("skip")
        'skip'
    """
    if nan_policy not in NAN_POLICIES:
        raise ConfigError(
            f"Unknown nan_policy {nan_policy!r}; expected one of {NAN_POLICIES}. "
            "Fix: set nan_policy to none, skip or stop."
        )
    return nan_policy


def finite_ok(loss: jax.Array, grads: PyTree, state: Any, nan_policy: str) -> jax.Array:
    """The on-device flag "apply this update": loss and gradient norm finite (and, under
    ``stop``, no earlier refused step)."""
    ok = jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads))
    if nan_policy == "stop":
        ok = ok & (state.nonfinite == 0)
    return ok


_CODES: dict[str, int] = {}  # an input check's message -> its code (interned, per process)
_MESSAGES: list[str] = []  # and back


class InputChecks:
    """The input checks reported while one (micro-)batch's forward pass is traced.

    Made by :func:`checking`; :meth:`result` folds them into ``int32[2]``: ``[code, value]``
    of the first failed check in program order, :data:`NO_CHECK` when none failed.
    """

    def __init__(self, batch: PyTree) -> None:
        self.trace = jex_core.get_opaque_trace_state(convention="jaxcore")
        self.fields = {
            id(leaf): jax.tree_util.keystr(path)
            for path, leaf in jax.tree_util.tree_leaves_with_path(batch)
        }
        self.found: list[tuple[int, jax.Array, jax.Array]] = []

    def result(self) -> jax.Array:
        where = jnp.array(NO_CHECK, jnp.int32)
        for code, bad, value in reversed(self.found):  # the first failed check wins
            where = jnp.where(bad, jnp.stack([jnp.int32(code), value]), where)
        return where


_REPORTS: contextvars.ContextVar[InputChecks | None] = contextvars.ContextVar(
    "jaxcore_input_checks", default=None
)


def input_check(bad: jax.Array, value: jax.Array, message: str) -> None:
    """Reports, from inside a forward pass a train step traces, whether its input is invalid.

    Where ``bad`` holds, the step refuses its update (``nan_policy`` ``"skip"``/``"stop"``)
    and :func:`check_finite` raises ``BatchError(message)`` with ``{value}`` (``value``) and
    ``{where}`` (``"at step N (...)"``, or :func:`raise_failed`'s ``where``) filled in.
    Outside :func:`checking` (an eager call, ``init``) and inside a transform of the model's
    own (``lax.cond``, ``scan``) it does nothing.

    Example:
        >>> import jax.numpy as jnp
        >>> input_check(jnp.bool_(True), jnp.int32(7), "bad {value}")  # (no step: nothing)
    """
    reports = _REPORTS.get()
    if reports is None or jex_core.get_opaque_trace_state(convention="jaxcore") != reports.trace:
        return
    code = _CODES.setdefault(message, len(_CODES))
    if code == len(_MESSAGES):
        _MESSAGES.append(message)
    reports.found.append((code, jnp.asarray(bad, bool), jnp.asarray(value, jnp.int32)))


def index_check(indices: jax.Array, rows: int, message: str) -> None:
    """:func:`input_check` of indices into a table of ``rows`` rows: refused outside
    ``[0, rows)``, ``{value}`` the largest index past the table (else the smallest below 0).
    One min and one max reduction.

    Example:
        >>> import jax.numpy as jnp
        >>> index_check(jnp.array([1, 40]), 30, "index {value} past 30")  # (no step: nothing)
    """
    if _REPORTS.get() is None or not indices.size:
        return
    low, high = jnp.min(indices), jnp.max(indices)
    input_check((low < 0) | (high >= rows), jnp.where(high >= rows, high, low), message)


def _escaped(text: str) -> str:
    return text.replace("{", "(").replace("}", ")")


def _embed_ids_checked(ids: Any, rows: int, table: str, kind: str) -> None:
    """A Flax embedding's ids checked against its table (like torch's ``IndexError``) before
    the gather fills the rows past it with NaN."""
    reports = _REPORTS.get()
    if reports is None or not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
        return
    field = reports.fields.get(id(ids))
    what = f"The batch field {_escaped(field)}" if field else "An index computed in the model"
    fix = (
        "map the ids into the vocabulary in the Dataset (an unknown-token id)"
        if field
        else "check how the model computes those indices"
    )
    index_check(
        ids,
        rows,
        f"{what} indexes the Flax {kind} {_escaped(table)}of {rows} rows, but holds {{value}} "
        f"{{where}}. torch raises IndexError: index out of range on it; expected ids in "
        f"[0, {rows - 1}]. Fix: {fix}, or build the {kind} with num_embeddings > "
        "{value}.",
    )


def _embed_bounds(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
    """Flax linen ``nn.Embed.__call__``, its ids checked (an ``nn.intercept_methods`` hook)."""
    module = context.module
    if isinstance(module, nn.Embed) and context.method_name == "__call__" and args:
        table = "/".join(str(p) for p in getattr(module, "path", ())) or module.name or ""
        _embed_ids_checked(
            args[0], int(module.num_embeddings), f"{table} " if table else "", "nn.Embed"
        )
    return next_fun(*args, **kwargs)


@contextlib.contextmanager
def _nnx_embeds_checked() -> Iterator[None]:
    """Flax NNX ``nnx.Embed.__call__``, its ids checked, while a step traces (NNX has no
    method interception: the class's ``__call__`` is wrapped for the trace's duration)."""
    from flax import nnx

    original = nnx.Embed.__call__

    def call(self: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        _embed_ids_checked(inputs, int(self.num_embeddings), "", "nnx.Embed")
        return original(self, inputs, *args, **kwargs)

    nnx.Embed.__call__ = call  # type: ignore[method-assign]
    try:
        yield
    finally:
        nnx.Embed.__call__ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def checking(batch: PyTree) -> Iterator[InputChecks]:
    """While a train step traces its forward pass on ``batch``: collects the
    :func:`input_check` reports (and checks every Flax ``nn.Embed``'s ids).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> def forward(ids):
        ...     with checking({"ids": ids}) as checks:
        ...         index_check(ids, 30, "id {value} past the table")
        ...         return checks.result()
        >>> jax.jit(forward)(jnp.array([3, 49])).tolist()[1]
        49
    """
    reports = InputChecks(batch)
    token = _REPORTS.set(reports)
    try:
        with nn.intercept_methods(_embed_bounds), _nnx_embeds_checked():
            yield reports
    finally:
        _REPORTS.reset(token)


def checked(check: jax.Array) -> jax.Array:
    """A step's ``[code, value]`` (:meth:`InputChecks.result`) as ``nonfinite_input``:
    ``[CHECKED, code, value, -1, ...]`` when a check failed, else :data:`NO_INPUT`."""
    failed = jnp.concatenate(
        [jnp.array([CHECKED], jnp.int32), check.astype(jnp.int32), jnp.full(INPUT_ROWS - 1, -1)]
    ).astype(jnp.int32)
    return jnp.where(check[0] >= 0, failed, jnp.array(NO_INPUT, jnp.int32))


def _check_message(code: int, value: int, where: str) -> str:
    if 0 <= code < len(_MESSAGES):
        return _MESSAGES[code].replace("{value}", str(value)).replace("{where}", where)
    return (  # (a state restored from another process: its messages are not known here)
        f"An input check (#{code}) of the model failed {where} (it saw {value}). Fix: check "
        "the batch's index fields (e.g. ids past an embedding table)."
    )


def first_failed(a: jax.Array, b: jax.Array) -> jax.Array:
    """The first of two ``[code, value]`` checks that failed (on device, no sync): to keep
    one per evaluation epoch, batch by batch.

    Example:
        >>> import jax.numpy as jnp
        >>> first_failed(jnp.array(NO_CHECK), jnp.array([3, 49])).tolist()
        [3, 49]
    """
    return jnp.where(a[0] >= 0, a, b)


def checked_forward(fn: Callable[..., Any]) -> Callable[..., tuple[Any, jax.Array]]:
    """A step that does not train (eval, predict), with its input checks:
    ``fn(state, batch, *args) -> out`` becomes ``-> (out, check)``, ``check`` the
    ``int32[2]`` of :meth:`InputChecks.result`. Jit the result; read ``check`` where the
    shell already syncs (the end of an evaluation epoch) with :func:`raise_failed`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> def forward(state, batch):
        ...     index_check(batch["ids"], 30, "id {value} {where}")
        ...     return batch["ids"] * 2
        >>> out, check = jax.jit(checked_forward(forward))(None, {"ids": jnp.array([1, 49])})
        >>> check.tolist()[1]
        49
    """

    def wrapped(state: Any, batch: PyTree, *args: Any) -> tuple[Any, jax.Array]:
        with checking(batch) as checks:
            out = fn(state, batch, *args)
            return out, checks.result()

    return wrapped


def raise_failed(check: Any, where: str) -> None:
    """Raises the failed input check of a ``[code, value]`` (a host read: call it where the
    shell syncs anyway, e.g. the end of an evaluation epoch).

    Args:
        check: from :func:`checked_forward` (or :func:`first_failed` over several).
        where: fills the message's ``{where}``, e.g. ``"in a validation batch"``.

    Raises:
        BatchError: the check's own message (the field, the table, the value, the fix).

    Example:
        >>> raise_failed(NO_CHECK, "in a validation batch")  # nothing failed
    """
    code, value = (int(v) for v in jax.device_get(check))
    if code >= 0:
        raise BatchError(_check_message(code, value, where))


def _accelerator() -> bool:
    return jax.default_backend() != "cpu"


def guarded(
    ok: jax.Array, update: Callable[[], PyTree], old: PyTree, *, per_leaf: bool | None = None
) -> PyTree:
    """``update()`` where ``ok`` else ``old``, with no host sync.

    On CPU a ``lax.cond``: the update runs only on an accepted step (there a select per leaf
    cost ~13% of a small MLP step, the cond ~3%). On an accelerator a select per leaf, which
    XLA fuses into the optimizer's update: a cond kept AdamW's update out of the
    weight-gradient fusions, ~10% of a GPT-2 small step on a TPU v5e (the update and the
    cond's own copies: 5 + 5 ms of 101, ``benchmarks/tpu_profile.py gpt-j``).

    Args:
        ok: a boolean scalar.
        update: computes the new pytree.
        old: the pytree kept when ``ok`` is false.
        per_leaf: select leaf by leaf (default: on any backend but CPU).

    Example:
        >>> import jax.numpy as jnp
        >>> guarded(jnp.bool_(False), lambda: jnp.ones(2), jnp.zeros(2), per_leaf=True)
        Array([0., 0.], dtype=float32)
    """
    if per_leaf is None:
        per_leaf = _accelerator()
    if per_leaf:
        return jax.tree.map(lambda n, o: jnp.where(ok, n, o), update(), old)
    return jax.lax.cond(ok, update, lambda: old)


def check_finite(state: Any, fields: Sequence[str] | None = None) -> None:
    """Raises when the state has refused a non-finite step.

    This fetches a few scalars from the device: call it where the shell already syncs (a
    logging step, the end of an epoch), not every step.

    Args:
        state: the train state.
        fields: the names of the batch's floating fields, in ``jax.tree.leaves`` order (to
            name the one that held NaN/Inf); ``None``: they are named by index.

    Raises:
        BatchError: the step was refused because its input held NaN/Inf (the field, its
            first bad rows and the fix), or failed an :func:`input_check` (its message).
        NonFiniteError: the loss or gradients were NaN/Inf on a finite input.

    Example:
        >>> import jax.numpy as jnp, jaxcore
        >>> from jaxcore.models.digits import MLP
        >>> st = jaxcore.init_train_state(jaxcore.linen_model(MLP(features=(8,))),
        ...     jaxcore.make_optimizer(), {"x": jnp.ones((8, 64))}, seed=0,
        ...     mesh=jaxcore.make_mesh({"data": -1}))
        >>> check_finite(st)  # nothing raised
    """
    count, first, where = jax.device_get(
        (state.nonfinite, state.nonfinite_step, state.nonfinite_input)
    )
    count, first = int(count), int(first)
    if count and int(where[0]) == CHECKED:
        when = f"at step {first} (refused: the state holds the params from before it)"
        raise BatchError(_check_message(int(where[1]), int(where[2]), when))
    if count and int(where[0]) >= 0:
        index, rows = int(where[0]), int(where[1])
        name = fields[index] if fields is not None and index < len(fields) else f"#{index}"
        bad = [int(r) for r in where[2:] if r >= 0]
        raise BatchError(
            f"The input batch field {name} holds NaN or Inf in rows {bad} (of {rows}) at step "
            f"{first}: a training step on it makes the loss NaN (the input, not the learning "
            "rate); the state holds the params from before that step. Fix: clean or drop "
            "those examples in the Dataset (e.g. torch.nan_to_num), or train with "
            "nan_policy='skip' to skip such steps."
        )
    if count:
        raise NonFiniteError(
            f"The loss or gradients were NaN/Inf at step {first} ({count} step(s) refused); "
            f"the state holds the params from before step {first}. Fix: lower the learning "
            "rate, enable gradient clipping (optim.clip_norm), check the data for NaN/Inf, or "
            "rerun with jaxcore.set_debug_nans(True) to find the operation that made it.",
            step=first,
        )


def set_debug_nans(enabled: bool = True) -> None:
    """Switches ``jax_debug_nans``: every jitted op is re-run un-jitted on a NaN and the first
    producing op raises. Slow; a debugging switch, off by default.

    Example:
        >>> set_debug_nans(False)
    """
    jax.config.update("jax_debug_nans", bool(enabled))
