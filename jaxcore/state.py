"""The training state: one pytree holding everything a step changes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxcore.compile import gc_paused
from jaxcore.guard import NO_INPUT
from jaxcore.model import Batch, ModelFns

PyTree = Any


@struct.dataclass
class TrainState:
    """Step counter, params, optimizer state, rng key and model state (e.g. ``batch_stats``).

    ``nonfinite`` counts the steps a NaN/Inf guard refused (see ``make_train_step``'s
    ``nan_policy``) and ``nonfinite_step`` is the first of them (-1 when none);
    ``nonfinite_input`` says which input field and rows made it, when that was the cause
    (:func:`jaxcore.guard.input_where`, -1 filled otherwise): all stay on
    device, so checking them costs nothing until the shell fetches them.

    Static things (the apply function, the optimizer) live in the step closures, not here,
    so the whole state is arrays and can be donated, sharded and checkpointed.
    """

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    rng: jax.Array
    model_state: PyTree
    nonfinite: jax.Array  # steps whose loss or grads were NaN/Inf (their update was not applied)
    nonfinite_step: jax.Array  # the first such step, -1 while there is none
    nonfinite_input: jax.Array  # int32[7]: the input field and rows that made it (guard.NO_INPUT)


def replicated(mesh: Mesh, tree: PyTree) -> PyTree:
    """A tree of fully replicated ``NamedSharding``s matching ``tree``'s structure."""
    return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), tree)


class PendingState:
    """A train state whose init program compiles on a background thread.

    :func:`start_train_state` returns one at once; :attr:`abstract` (every leaf's shape,
    dtype and sharding) is all a step needs to be traced and compiled
    (``Step.compile(pending.abstract, batch)``), so the step's compilation and the init's run
    side by side. XLA compiles (and reads its persistent cache) without holding Python's
    lock: on a warm cache the init's executable loads while the step is traced.

    Attributes:
        abstract: the state as ``jax.ShapeDtypeStruct`` leaves with their shardings.
    """

    def __init__(self, compiled: Future[Any], args: tuple[Any, ...], abstract: TrainState) -> None:
        self._compiled, self._args, self.abstract = compiled, args, abstract
        self._state: TrainState | None = None

    def result(self) -> TrainState:
        """The initialised state (waits for the init's compilation; raises its errors)."""
        if self._state is None:
            self._state = self._compiled.result()(*self._args)
        return self._state


_compiler: ThreadPoolExecutor | None = None


def _background(fn: Callable[[], Any]) -> Future[Any]:
    global _compiler
    if _compiler is None:
        _compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxcore-compile")
    return _compiler.submit(fn)


def _lowered_init(
    model: ModelFns,
    tx: optax.GradientTransformation,
    sample_batch: Batch,
    seed: int,
    mesh: Mesh,
    param_shardings: Any,
) -> tuple[Any, tuple[Any, ...], TrainState]:
    """The init program lowered for its out-shardings, its arguments (the arrays it closes
    over, its key), and the placed abstract state."""
    shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), sample_batch)

    def init(rng: jax.Array) -> TrainState:
        init_key, state_key = jax.random.split(rng)
        batch = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        params, model_state = model.init(init_key, batch)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            rng=state_key,
            model_state=model_state,
            nonfinite=jnp.zeros((), jnp.int32),
            nonfinite_step=jnp.full((), -1, jnp.int32),
            nonfinite_input=jnp.array(NO_INPUT, jnp.int32),
        )

    rng = jax.random.key(seed)
    abstract = jax.eval_shape(init, rng)
    if param_shardings is None:
        out_shardings = replicated(mesh, abstract)
    elif callable(param_shardings):
        out_shardings = param_shardings(abstract)
    else:
        out_shardings = param_shardings
    traced = jax.jit(init, out_shardings=out_shardings).trace(rng)  # (the eval_shape trace)
    closed = traced.jaxpr
    if not closed.consts:
        lowered = traced.lower()
        return lowered, (rng,), lowered.out_info
    # Arrays the init closes over (a ported torch module's weights) become arguments of the
    # program, not constants in it: no copy of the weights in the compiled code or in its
    # persistent-cache key.
    treedef = jax.tree.structure(abstract)

    def run(consts: list[Any], rng: jax.Array) -> TrainState:
        return jax.tree.unflatten(treedef, jax.core.eval_jaxpr(closed.jaxpr, consts, rng))

    lowered = jax.jit(run, out_shardings=out_shardings).lower(list(closed.consts), rng)
    return lowered, (list(closed.consts), rng), lowered.out_info


def start_train_state(
    model: ModelFns,
    tx: optax.GradientTransformation,
    sample_batch: Batch,
    *,
    seed: int,
    mesh: Mesh,
    param_shardings: Any = None,
) -> PendingState:
    """Starts :func:`init_train_state`: traces the init, compiles it in the background.

    Same arguments as :func:`init_train_state`; ``.result()`` gives the same state.

    Example:
        >>> import jax.numpy as jnp, jaxcore
        >>> from jaxcore.models.digits import MLP
        >>> pending = start_train_state(jaxcore.linen_model(MLP(features=(8,))),
        ...     jaxcore.make_optimizer(), {"x": jnp.ones((2, 64))}, seed=0,
        ...     mesh=jaxcore.make_mesh({"data": -1}))
        >>> pending.abstract.params["layers_0"]["kernel"].shape, int(pending.result().step)
        ((64, 8), 0)
    """
    with gc_paused():
        lowered, args, placed = _lowered_init(model, tx, sample_batch, seed, mesh, param_shardings)
    return PendingState(_background(lowered.compile), args, placed)


def init_train_state(
    model: ModelFns,
    tx: optax.GradientTransformation,
    sample_batch: Batch,
    *,
    seed: int,
    mesh: Mesh,
    param_shardings: Any = None,
) -> TrainState:
    """Initialises a :class:`TrainState` under ``jax.jit`` with explicit out-shardings.

    Params and optimizer state are born with their shardings (no full replica on one device
    when they are sharded). ``param_shardings`` maps the abstract state to its shardings (e.g.
    ``jaxcore.state_sharding_fn(mesh, "fsdp")``), or is that sharding tree itself; ``None``
    replicates everything. :func:`start_train_state` does the same with the compilation in
    the background.

    Args:
        model: the model's init/apply functions.
        tx: the optimizer.
        sample_batch: a batch with the real shapes and dtypes (values are not used).
        seed: the run's seed; the state's rng derives from it.
        mesh: the device mesh.
        param_shardings: callable ``abstract_state -> sharding tree``, a sharding tree, or
            ``None``.

    Returns:
        The initial state, placed on ``mesh``.

    Example:
        >>> import jax.numpy as jnp, jaxcore
        >>> from jaxcore.models.digits import MLP
        >>> st = init_train_state(jaxcore.linen_model(MLP(features=(8,))),
        ...     jaxcore.make_optimizer(), {"x": jnp.ones((2, 64))}, seed=0,
        ...     mesh=jaxcore.make_mesh({"data": -1}))
        >>> int(st.step)
        0
    """
    with gc_paused():
        lowered, args, _ = _lowered_init(model, tx, sample_batch, seed, mesh, param_shardings)
    return lowered.compile()(*args)  # type: ignore[no-any-return]


def restart_optimizer(state: TrainState, tx: optax.GradientTransformation) -> TrainState:
    """The state's params and model state with a fresh optimizer: what a new run starts from.

    Lightning calls ``configure_optimizers`` at every ``fit``: a second ``fit`` of a module
    continues from its trained weights with a new optimizer (no momentum, its schedule from
    step 0). This is that state: ``opt_state`` from ``tx.init``, ``step`` 0, the NaN-guard
    counters cleared, each leaf with its old sharding; the random key is advanced (folded
    with the old step) so the new run does not repeat the old one's dropout masks.

    Example:
        >>> import jax.numpy as jnp, jaxcore
        >>> from jaxcore.models.digits import MLP
        >>> tx = jaxcore.make_optimizer()
        >>> st = init_train_state(jaxcore.linen_model(MLP(features=(8,))), tx,
        ...     {"x": jnp.ones((2, 64))}, seed=0, mesh=jaxcore.make_mesh({"data": -1}))
        >>> int(restart_optimizer(st.replace(step=st.step + 5), tx).step)
        0
    """

    def fresh(old: TrainState) -> TrainState:
        return dataclasses.replace(
            old,
            step=jnp.zeros_like(old.step),
            opt_state=tx.init(old.params),
            rng=jax.random.fold_in(old.rng, old.step),
            nonfinite=jnp.zeros_like(old.nonfinite),
            nonfinite_step=jnp.full_like(old.nonfinite_step, -1),
            nonfinite_input=jnp.full_like(old.nonfinite_input, -1),
        )

    shardings = state_shardings(state)
    if all(x.is_fully_addressable for x in jax.tree.leaves(state)):
        # one process: op by op, then placed as before (a jit would compile at every fit)
        return jax.device_put(fresh(state), shardings)  # type: ignore[no-any-return]
    return jax.jit(fresh, out_shardings=shardings)(state)  # type: ignore[no-any-return]


def state_shardings(state: TrainState) -> PyTree:
    """The sharding of every leaf of a placed state (to jit steps with the same layout)."""
    return jax.tree.map(lambda x: x.sharding, state)
