"""A team's own torch ``nn.Module`` as the JAX core, traced by torchax.

The module is extracted once. Its trainable parameters become ``params``: a flat dict keyed by
``state_dict`` names (``"layers.0.weight"``), so sharding rules match torch names and export
is the identity. Persistent buffers (BatchNorm ``running_mean``, ``running_var``,
``num_batches_tracked``) and frozen parameters (``requires_grad=False``) become
``model_state``; non-persistent buffers are constants of the traced function.

The forward runs under a private torchax environment, so jaxcore's jitted step sees a pure JAX
function ``apply(params, model_state, batch, rng, train) -> (outputs, model_state)``:

- ``train`` switches ``module.train()`` / ``module.eval()`` while the step is traced;
- in training, buffers the forward updates in place come back as the new ``model_state``;
  BatchNorm's running statistics follow torch's own formula (unbiased running variance,
  ``momentum``, ``num_batches_tracked += 1``);
- dropout (and any other torch random op) draws from the step's JAX key ``rng``, so a seed
  fixes it and two steps differ;
- tensors the forward creates (``torch.arange``, ``torch.zeros``) are created as JAX arrays;
- Python that reads tensor values is traced where it can be (:mod:`torchshell.trace`):
  batch-independent values are concrete, traced bools branch with ``lax.cond``, and scalars
  read from the batch are specialised (:func:`specialise_batch`).

An op torchax cannot lower, or a value Python needs that none of these covers, raises
:class:`~torchshell._errors.TorchModelError` naming the op, the module path and the line.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import torch
from torch import nn

from jaxcore import ModelFns
from torchshell import trace as patterns
from torchshell._errors import TorchModelError
from torchshell.trace._dtypes import reduced_compute
from torchshell.trace._hf import no_kv_cache
from torchshell.trace._messages import is_lowering_error, is_raw, lowering_error
from torchshell.trace._state_dict import params_to_state_dict
from torchshell.trace._static import STATIC_KEY, StaticSpec, _concrete, _inputs, specialise_batch

PyTree = Any
Batch = Mapping[str, Any]

__all__ = [
    "STATIC_KEY",
    "TorchTracer",
    "params_to_state_dict",
    "specialise_batch",
    "torch_model_fns",
]


def _to_jax(t: torch.Tensor) -> jax.Array:
    """A JAX copy of a torch tensor (never aliasing it: the module may keep training);
    64-bit values narrow to 32 bits with a range check (:func:`bridge.as_jax`)."""
    return patterns.weight_as_jax(t)  # (a float64 one: a warning)


class TorchTracer:
    """A torch module's weights, extracted once, and calls into it traced under torchax.

    Trainable parameters become ``params0``; persistent buffers and frozen parameters
    ``state0``; non-persistent buffers are constants. :meth:`call` runs any function of the
    module (its ``forward``, or e.g. a LightningModule's ``training_step``) with the weights
    swapped for JAX values, and returns the outputs as JAX arrays with the new model state.
    The patterns of :mod:`torchshell.trace` apply to every call: batch-independent
    values are concrete, traced bools become ``lax.cond`` (at most ``max_branches`` paths per
    call), and host reads of the batch take the values of :meth:`static_values`.

    Args:
        module: the team's ``nn.Module``.
        max_branches: the most ``lax.cond`` paths one call may trace.

    Example:
        >>> import jax, jax.numpy as jnp, torch
        >>> tracer = TorchTracer(torch.nn.Linear(3, 2))
        >>> out, _ = tracer.call(lambda x: tracer.module(x).sum(1), tracer.params0,
        ...                      tracer.state0, [jnp.ones((4, 3))], jax.random.key(0), True)
        >>> out.shape
        (4,)
    """

    def __init__(self, module: nn.Module, *, max_branches: int = 64) -> None:
        if not isinstance(module, nn.Module):
            raise TorchModelError(
                f"coreshell expects a torch.nn.Module, got {type(module).__name__}. Fix: pass "
                "the module instance (e.g. MyNet(**kwargs)), not its class or a function."
            )
        self.module = module
        self.max_branches = max_branches
        # a LightningModule trains in the submodule modes it has (Lightning 2 never calls
        # .train() on it in fit); a plain nn.Module is put in train mode, as a torch loop does
        self.own_modes = any(c.__name__ == "LightningModule" for c in type(module).__mro__)
        self.reads = patterns.Reads()
        self.env = patterns.environment(self.reads)
        persistent = set(module.state_dict().keys())
        named = dict(itertools.chain(module.named_parameters(), module.named_buffers()))
        self.params0 = {k: _to_jax(v) for k, v in module.named_parameters() if v.requires_grad}
        self.state0 = {
            k: _to_jax(v) for k, v in named.items() if k in persistent and k not in self.params0
        }
        self.consts = {k: _to_jax(v) for k, v in named.items() if k not in persistent}
        self.names = {id(m): name for name, m in module.named_modules()}
        self._bound = patterns.Bound(module)
        self.carried: set[str] = set()  # attributes a call set from traced values
        self._warned: set[str] = set()

    def call(
        self,
        fn: Callable[..., Any],
        params: PyTree,
        model_state: PyTree,
        args: Sequence[Any],
        rng: jax.Array,
        train: bool,
    ) -> tuple[PyTree, PyTree]:
        """``fn(*args)`` with the module's weights swapped for ``params``/``model_state``.

        ``args`` are JAX values (any pytree); ``fn`` sees them as torch tensors on the
        ``jax`` device. Returns ``(outputs as JAX, new model state)``; in eval mode the
        model state comes back unchanged.
        """
        self.reads.train = train
        with contextlib.ExitStack() as stack:
            # Lightning evaluates under torch.inference_mode, which skips the decompositions
            # torchax relies on (aten::dropout has no lowering): trace the same way always.
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.no_grad())
            stack.enter_context(patterns.tracing())
            # JAX runs with x64 off, so torchax narrows in-graph int64 (torch's default for
            # arange, .long(), argmax) to int32 and says so at every such op: the documented
            # policy (docs/porting.md), not something the user's module can change. float64
            # narrowing changes numerics and keeps its warning.
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings(
                "ignore", "Explicitly requested dtype int64 requested in ", UserWarning
            )
            where = f"{type(self.module).__name__} ({'train' if train else 'eval'} mode)"
            try:
                return patterns.explore(
                    lambda decisions: self._run(
                        fn, params, model_state, list(args), rng, train, decisions
                    ),
                    self.max_branches,
                    where,
                )
            except Exception as err:  # JAX's own (lax.cond's paths disagree): never raw
                if is_raw(err):
                    raise lowering_error(err, self.names, train) from err
                raise

    def _run(
        self,
        fn: Callable[..., Any],
        params: PyTree,
        model_state: PyTree,
        args: list[Any],
        rng: jax.Array,
        train: bool,
        decisions: tuple[bool, ...],
    ) -> tuple[PyTree, PyTree]:
        """One run of ``fn`` along ``decisions`` (fresh tensors: a run mutates its buffers)."""
        env, module = self.env, self.module
        self.reads.start(decisions)
        p, s, c, a = env.j2t_iso((dict(params), dict(model_state), self.consts, args))
        weights = {f"m.{k}": v for k, v in {**c, **s, **p}.items()}
        object.__setattr__(self._bound, "fn", None if fn is module else fn)
        with (
            patterns.mode(module, train, self.own_modes),
            no_kv_cache(module),
            patterns.attributes_kept(module, self.carried),
            env,
            env.override_property(prng=rng),
            torch.device("jax"),
            reduced_compute(params, self.params0),  # (bf16 compute: fp32 buffers allowed)
        ):
            try:
                out = torch.func.functional_call(
                    self._bound, weights, tuple(a), tie_weights=True, strict=False
                )
            except Exception as err:  # named below; anything else propagates unchanged
                if is_lowering_error(err):
                    raise lowering_error(err, self.names, train) from err
                raise
            finally:
                object.__setattr__(self._bound, "fn", None)
        self._warn_carried()
        outputs = patterns.plain(env.t2j_iso(out), f"the output of {type(module).__name__}")
        if not train:
            return outputs, model_state
        new_state = {k: env.t2j_iso(s[k]).astype(model_state[k].dtype) for k in model_state}
        return outputs, new_state

    def _warn_carried(self) -> None:
        """Once per attribute: state a call keeps for the next one is not carried."""
        for name in sorted(self.carried - self._warned):
            self._warned.add(name)
            owner = type(self.module).__name__
            warnings.warn(
                f"{owner} sets self.{name} to a value computed from the batch or the weights "
                "(state kept for the next batch, e.g. an RNN's hidden state): the compiled "
                "step is traced once, so every step sees the attribute as it was before "
                "(plain torch/Lightning would carry it from batch to batch). Fix: pass that "
                "state in the batch, or start it fresh in each step as a local variable.",
                UserWarning,
                stacklevel=2,
            )

    @contextlib.contextmanager
    def static_values(self, values: Mapping[int, Any] | None) -> Iterator[None]:
        """Calls inside take host read number ``n`` as ``values[n]`` (see :meth:`discover`)."""
        before = self.reads.statics
        self.reads.statics = None if values is None else dict(values)
        try:
            yield
        finally:
            self.reads.statics = before

    def _abstract(
        self, fn: Callable[..., Any], args: Sequence[Any], train: bool, concrete: bool = True
    ) -> None:
        """``fn(*args)`` traced with abstract weights and key; ``args`` concrete or not."""
        spec = jax.tree.map(patterns.spec, (self.params0, self.state0))
        if concrete:  # closed over: ops on them alone are evaluated while tracing
            jax.eval_shape(
                lambda p, s, r: self.call(fn, p, s, args, r, train), *spec, jax.random.key(0)
            )
        else:
            jax.eval_shape(
                lambda p, s, r, a: self.call(fn, p, s, a, r, train),
                *spec,
                jax.random.key(0),
                jax.tree.map(patterns.spec, list(args)),
            )

    def discover(self, fn: Callable[..., Any], args: Sequence[Any], train: bool) -> list[Any]:
        """Traces ``fn(*args)`` on concrete ``args``: numbers the scalar reads, keeps kinds.

        A read that is concrete here depends on the arguments and constants only (a host
        read); one that is traced depends on the weights or the key. Returns each read's
        value (``None`` for traced ones).
        """
        reads = self.reads
        reads.mode, reads.kinds[train] = "discover", []
        try:
            self._abstract(fn, args, train)
            return list(reads.values)
        finally:
            reads.mode = "step"

    def probe(
        self, fn: Callable[..., Any], args: Sequence[Any], train: bool, last: int
    ) -> list[Any]:
        """The values of host reads ``0..last`` of ``fn(*args)`` on concrete ``args``.

        Traces only as far as read ``last``, with abstract weights (cheap when the reads
        come early, as length masks do).
        """
        reads = self.reads
        reads.mode, reads.stop_after = "probe", last
        try:
            for path in (True, False):  # the other outcome when a check raises on the first
                reads.probe_path = path
                try:
                    self._abstract(fn, args, train)
                except patterns.ProbeDone:
                    pass
                except (ValueError, RuntimeError) as err:
                    if not patterns.is_check(err) or not path:
                        raise
                    continue
                break
        finally:
            reads.mode, reads.stop_after, reads.probe_path = "step", None, True
        return list(reads.values)

    def host_reads(
        self, fn: Callable[..., Any], args: Sequence[Any], train: bool
    ) -> dict[int, Any]:
        """The host reads of ``fn(*args)`` that take a batch value, with their values here.

        Runs :meth:`discover` on the concrete ``args``, then traces ``fn`` on abstract ones
        with the discovered values supplied: the reads that consume one depend on ``args``.
        """
        values = self.discover(fn, args, train)
        kinds = self.reads.kinds[train]
        host = {n: values[n] for n, k in enumerate(kinds) if k == patterns.HOST}
        if not host:
            return {}
        self.reads.consumed = set()
        with self.static_values(host):
            self._abstract(fn, args, train, concrete=False)
        return {n: host[n] for n in sorted(self.reads.consumed)}

    def check(self, fn: Callable[[PyTree, bool], Any], batch: PyTree) -> None:
        """Traces ``fn(batch, train)`` abstractly in train and eval mode (shapes only)."""
        spec = jax.tree.map(patterns.spec, batch)
        for train in (True, False):
            jax.eval_shape(lambda b, t=train: fn(b, t), spec)


def torch_model_fns(
    module: nn.Module,
    inputs: Sequence[str] = ("x",),
    *,
    example: Batch | None = None,
    static_buckets: Sequence[int] | None = None,
    max_static: int = 8,
    max_branches: int = 64,
) -> ModelFns:
    """Extracts a torch ``nn.Module`` into jaxcore's :class:`~jaxcore.ModelFns`.

    ``init`` ignores its rng and returns the module's current weights (its own torch
    initialisation), copied: the module itself is never changed by training. ``apply`` calls
    ``module.forward(*[batch[k] for k in inputs])`` under torchax, in train or eval mode.
    The forward is traced (and unsupported ops reported) when ``example`` is given, and
    otherwise on ``init``, before any training step, on that concrete batch: a forward that
    reads a scalar from the batch in Python (``int(lengths.max())``) then needs
    :func:`specialise_batch` on every batch before the step.

    Args:
        module: the team's ``nn.Module``.
        inputs: batch keys passed positionally to ``module.forward``.
        example: a batch (torch tensors or JAX arrays) to trace the forward with now, in
            train and eval mode.
        static_buckets: integer scalars read from the batch are rounded up to the next of
            these (so a run compiles at most one step per bucket); only for reads the forward
            uses as an upper bound (a crop or mask length over padded, masked data).
        max_static: distinct static values past which :func:`specialise_batch` warns.
        max_branches: the most ``lax.cond`` paths (traced Python bools) one call may trace.

    Returns:
        ``ModelFns`` whose params are ``{state_dict name: array}`` of the trainable
        parameters and whose model state holds buffers and frozen parameters.

    Raises:
        TorchModelError: an op torchax cannot lower, or data-dependent control flow; the
            message names the op and the module path.

    Example:
        >>> import jax, jax.numpy as jnp, torch
        >>> from torchshell.twins.digits import MLP
        >>> _ = torch.manual_seed(0)
        >>> fns = torch_model_fns(MLP(64, features=(16,)))
        >>> batch = {"x": jnp.ones((2, 64))}
        >>> params, state = fns.init(jax.random.key(0), batch)
        >>> sorted(params)[:2]
        ['head.bias', 'head.weight']
        >>> fns.apply(params, state, batch, jax.random.key(1), False)[0].shape
        (2, 10)
    """
    tracer = TorchTracer(module, max_branches=max_branches)
    keys = tuple(inputs)
    static = StaticSpec(tracer, keys, static_buckets, max_static)

    def forward(
        params: PyTree, model_state: PyTree, batch: Batch, rng: jax.Array, train: bool
    ) -> tuple[PyTree, PyTree]:
        fields = {k: batch[k] for k in keys if k in batch}
        with (
            tracer.static_values(static.values_of(batch, train)),
            static.embeddings.watching(fields),
        ):
            try:
                return tracer.call(module, params, model_state, _inputs(batch, keys), rng, train)
            except patterns.NeedsStatic as err:
                raise static.missing(int(str(err)), train) from None

    def check(batch: Batch) -> None:
        leaves = jax.tree.leaves(dict(batch))
        concrete = None
        if not any(isinstance(v, jax.core.Tracer) for v in leaves):  # else: inside a jit
            concrete = jax.tree.map(_concrete, dict(batch))
            for train in (True, False):
                static.discover(concrete, train)
        tracer.check(
            lambda b, t: forward(
                tracer.params0, tracer.state0, static.attach(b, concrete, t), jax.random.key(0), t
            ),
            batch,
        )

    def init(rng: jax.Array, batch: Batch) -> tuple[PyTree, PyTree]:
        check(batch)
        return dict(tracer.params0), dict(tracer.state0)

    forward.torch_static = static  # type: ignore[attr-defined]  # for specialise_batch
    forward.torch_embeddings = static.embeddings  # type: ignore[attr-defined]  # check_batch
    if example is not None:
        check(example)
    return ModelFns(init, forward)
