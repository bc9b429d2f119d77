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
- tensors the forward creates (``torch.arange``, ``torch.zeros``) are created as JAX arrays.

An op torchax cannot lower, or data-dependent Python control flow, raises
:class:`~torchshell._errors.TorchModelError` naming the op and the module path.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import torch
from torch import nn

import bridge
from jaxcore import BatchError, ModelFns
from torchshell._errors import TorchModelError

PyTree = Any
Batch = Mapping[str, Any]

__all__ = ["TorchTracer", "params_to_state_dict", "torch_model_fns"]

_BATCH_NORM_OPS = (
    "native_batch_norm.default",
    "_native_batch_norm_legit.default",
    "_native_batch_norm_legit_no_training.default",
)
_DATA_DEPENDENT = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)
_FLAX_ROUTE = (
    "or take the Flax route: write the model in Flax (jaxcore.linen_model) and keep this "
    "nn.Module as its torch twin for export (docs/torch_model.md)."
)


def _environment() -> Any:
    """A private torchax environment whose BatchNorm writes running stats back like torch.

    torchax 0.0.13 lowers batch norm as a pure JAX op that drops the updated running stats
    (and uses the biased variance). Here the three batch-norm ops run torch's own
    decomposition on torchax tensors instead: its ``running_mean.copy_(...)`` mutates the
    buffers we passed in, which :func:`torch_model_fns` reads back as the new model state.
    """
    # Imported here: importing torchax disables torch's MHA fast path process-wide, which
    # only the users of this path should pay for.
    from torch._decomp import get_decompositions
    from torchax import tensor as torchax_tensor

    env = torchax_tensor.Environment()
    ops = [getattr(torch.ops.aten, name.split(".")[0]).default for name in _BATCH_NORM_OPS]
    for op, impl in get_decompositions(ops).items():
        env.override_op_definition(op, impl)
    return env


def _to_jax(t: torch.Tensor) -> jax.Array:
    """A JAX copy of a torch tensor (never aliasing it: the module may keep training)."""
    t = t.detach().cpu()
    if not jax.config.read("jax_enable_x64"):
        narrow = {torch.int64: torch.int32, torch.float64: torch.float32}
        t = t.to(narrow.get(t.dtype, t.dtype))
    if t.dtype == torch.bfloat16:
        return jax.numpy.array(t.float().numpy(), copy=True).astype(jax.numpy.bfloat16)
    return jax.numpy.array(t.numpy(), copy=True)


def _inputs(batch: Batch, keys: Sequence[str]) -> list[Any]:
    missing = [k for k in keys if k not in batch]
    if missing:
        raise BatchError(
            f"The torch module's forward reads batch keys {list(keys)}, but the batch has "
            f"{sorted(batch)}: missing {missing}. Fix: name the fields in the Dataset/collate "
            "as the model expects, or pass inputs=(...) with the batch's key names."
        )
    return [batch[k] for k in keys]


@contextlib.contextmanager
def _mode(module: nn.Module, train: bool) -> Iterator[None]:
    """``module.train(train)`` for the duration, then the module's own modes back."""
    before = {m: m.training for m in module.modules()}
    module.train(train)
    try:
        yield
    finally:
        for m, was in before.items():
            m.training = was


def _where(err: BaseException, names: Mapping[int, str]) -> tuple[str, str]:
    """The innermost submodule whose ``forward`` was running when ``err`` was raised."""
    path, site = "", ""
    tb: types.TracebackType | None = err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code  # a method's first argument, whatever its name
        owner = tb.tb_frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        if owner is not None and id(owner) in names:
            path = names[id(owner)] or "<root>"
            path = f"{path} ({type(owner).__name__})"
            site = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return path or "<unknown>", site


def _lowering_error(err: BaseException, names: Mapping[int, str], train: bool) -> TorchModelError:
    path, site = _where(err, names)
    mode = "train" if train else "eval"
    at = f" at {site}" if site else ""
    if type(err).__name__ == "OperatorNotFound":
        found = re.search(r"name (\S+) has no lowering", str(err))
        op = found.group(1) if found else str(err)
        return TorchModelError(
            f"torchax cannot lower the op `{op}`, called in module {path}{at} ({mode} mode). "
            "Expected a forward made of ops torchax lowers to JAX. Fix: replace that layer "
            f"with an equivalent made of supported ops, {_FLAX_ROUTE}"
        )
    if isinstance(err, _DATA_DEPENDENT):
        return TorchModelError(
            f"The forward of module {path}{at} ({mode} mode) needs a tensor's value in Python "
            f"({type(err).__name__}: data-dependent control flow, .item(), or a shape that "
            "depends on values), which a compiled JAX step cannot have. Fix: make the "
            "computation shape-static (torch.where instead of `if`, masks instead of "
            f"boolean indexing), {_FLAX_ROUTE}"
        )
    return TorchModelError(
        f"The forward of module {path}{at} ({mode} mode) mixes a plain CPU torch.Tensor with "
        f"the traced ones ({err}). Fix: register tensors the module keeps as buffers "
        "(self.register_buffer(name, t, persistent=False)) instead of plain attributes, "
        f"{_FLAX_ROUTE}"
    )


class _Bound(nn.Module):
    """Calls ``fn`` with ``module`` registered as its only child, so
    ``torch.func.functional_call`` can swap the module's weights for any method, not just
    ``forward`` (names gain the ``m.`` prefix)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.m = module
        self.fn: Callable[..., Any] | None = None  # None: the module's own forward

    def forward(self, *args: Any) -> Any:
        return (self.m if self.fn is None else self.fn)(*args)


class TorchTracer:
    """A torch module's weights, extracted once, and calls into it traced under torchax.

    Trainable parameters become ``params0``; persistent buffers and frozen parameters
    ``state0``; non-persistent buffers are constants. :meth:`call` runs any function of the
    module (its ``forward``, or e.g. a LightningModule's ``training_step``) with the weights
    swapped for JAX values, and returns the outputs as JAX arrays with the new model state.

    Args:
        module: the team's ``nn.Module``.

    Example:
        >>> import jax, jax.numpy as jnp, torch
        >>> tracer = TorchTracer(torch.nn.Linear(3, 2))
        >>> out, _ = tracer.call(lambda x: tracer.module(x).sum(1), tracer.params0,
        ...                      tracer.state0, [jnp.ones((4, 3))], jax.random.key(0), True)
        >>> out.shape
        (4,)
    """

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TorchModelError(
                f"coreshell expects a torch.nn.Module, got {type(module).__name__}. Fix: pass "
                "the module instance (e.g. MyNet(**kwargs)), not its class or a function."
            )
        self.module = module
        self.env = _environment()
        persistent = set(module.state_dict().keys())
        named = dict(itertools.chain(module.named_parameters(), module.named_buffers()))
        self.params0 = {k: _to_jax(v) for k, v in module.named_parameters() if v.requires_grad}
        self.state0 = {
            k: _to_jax(v) for k, v in named.items() if k in persistent and k not in self.params0
        }
        self.consts = {k: _to_jax(v) for k, v in named.items() if k not in persistent}
        self.names = {id(m): name for name, m in module.named_modules()}
        self._bound = _Bound(module)

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
        with contextlib.ExitStack() as stack:
            # Lightning evaluates under torch.inference_mode, which skips the decompositions
            # torchax relies on (aten::dropout has no lowering): trace the same way always.
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.no_grad())
            return self._traced(fn, params, model_state, list(args), rng, train)

    def _traced(
        self,
        fn: Callable[..., Any],
        params: PyTree,
        model_state: PyTree,
        args: list[Any],
        rng: jax.Array,
        train: bool,
    ) -> tuple[PyTree, PyTree]:
        env, module = self.env, self.module
        p, s, c, a = env.j2t_iso((dict(params), dict(model_state), self.consts, args))
        weights = {f"m.{k}": v for k, v in {**c, **s, **p}.items()}
        object.__setattr__(self._bound, "fn", None if fn is module else fn)
        with _mode(module, train), env, env.override_property(prng=rng), torch.device("jax"):
            try:
                out = torch.func.functional_call(
                    self._bound, weights, tuple(a), tie_weights=True, strict=False
                )
            except Exception as err:  # named below; anything else propagates unchanged
                if (
                    type(err).__name__ == "OperatorNotFound"
                    or isinstance(err, _DATA_DEPENDENT)
                    or (isinstance(err, AssertionError) and "mixed math" in str(err))
                ):
                    raise _lowering_error(err, self.names, train) from err
                raise
            finally:
                object.__setattr__(self._bound, "fn", None)
        outputs = env.t2j_iso(out)
        if not train:
            return outputs, model_state
        new_state = {k: env.t2j_iso(s[k]).astype(model_state[k].dtype) for k in model_state}
        return outputs, new_state

    def check(self, fn: Callable[[PyTree, bool], Any], batch: PyTree) -> None:
        """Traces ``fn(batch, train)`` abstractly in train and eval mode (shapes only)."""
        spec = jax.tree.map(_spec, batch)
        for train in (True, False):
            jax.eval_shape(lambda b, t=train: fn(b, t), spec)


def _spec(v: Any) -> jax.ShapeDtypeStruct:
    if isinstance(v, torch.Tensor):
        dtype = _to_jax(torch.empty(0, dtype=v.dtype)).dtype
        return jax.ShapeDtypeStruct(tuple(v.shape), dtype)
    return jax.ShapeDtypeStruct(v.shape, v.dtype)


def torch_model_fns(
    module: nn.Module,
    inputs: Sequence[str] = ("x",),
    *,
    example: Batch | None = None,
) -> ModelFns:
    """Extracts a torch ``nn.Module`` into jaxcore's :class:`~jaxcore.ModelFns`.

    ``init`` ignores its rng and returns the module's current weights (its own torch
    initialisation), copied: the module itself is never changed by training. ``apply`` calls
    ``module.forward(*[batch[k] for k in inputs])`` under torchax, in train or eval mode.
    The forward is traced (and unsupported ops reported) when ``example`` is given, and
    otherwise on ``init``, before any training step.

    Args:
        module: the team's ``nn.Module``.
        inputs: batch keys passed positionally to ``module.forward``.
        example: a batch (torch tensors or JAX arrays) to trace the forward with now, in
            train and eval mode.

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
    tracer = TorchTracer(module)
    keys = tuple(inputs)

    def forward(
        params: PyTree, model_state: PyTree, batch: Batch, rng: jax.Array, train: bool
    ) -> tuple[PyTree, PyTree]:
        return tracer.call(module, params, model_state, _inputs(batch, keys), rng, train)

    def check(batch: Batch) -> None:
        tracer.check(
            lambda b, t: forward(tracer.params0, tracer.state0, b, jax.random.key(0), t), batch
        )

    def init(rng: jax.Array, batch: Batch) -> tuple[PyTree, PyTree]:
        check(batch)
        return dict(tracer.params0), dict(tracer.state0)

    if example is not None:
        check(example)
    return ModelFns(init, forward)


def params_to_state_dict(
    params: PyTree, model_state: PyTree, module: nn.Module | None = None
) -> dict[str, torch.Tensor]:
    """The trained params and model state as the module's ``state_dict`` (the identity).

    With ``module``, tied parameters are filled under every name the module's ``state_dict``
    uses, dtypes are the module's own (``num_batches_tracked`` back to int64), and keys and
    shapes are checked, so ``module.load_state_dict(sd, strict=True)`` cannot fail.

    Args:
        params: ``{state_dict name: array}`` from :func:`torch_model_fns`' params.
        model_state: the model state (buffers, frozen parameters).
        module: the torch module the state dict is for.

    Returns:
        ``{name: torch.Tensor}`` on CPU, owning its memory (never aliasing JAX buffers).

    Raises:
        TorchModelError: keys or shapes that do not match ``module``.

    Example:
        >>> import jax, jax.numpy as jnp, torch
        >>> from torchshell.twins.digits import MLP
        >>> net = MLP(64, features=(8,))
        >>> fns = torch_model_fns(net)
        >>> params, state = fns.init(jax.random.key(0), {"x": jnp.ones((2, 64))})
        >>> net.load_state_dict(params_to_state_dict(params, state, net), strict=True)
        <All keys matched successfully>
    """
    merged = {**dict(model_state), **dict(params)}
    tensors = {k: bridge.to_torch(v).clone() for k, v in merged.items()}
    if module is None:
        return tensors
    canonical: dict[int, str] = {}
    for name, t in itertools.chain(
        module.named_parameters(remove_duplicate=False), module.named_buffers()
    ):
        canonical.setdefault(id(t), name)
    out: dict[str, torch.Tensor] = {}
    missing, wrong = [], []
    for key, ref in module.state_dict(keep_vars=True).items():
        src = canonical.get(id(ref), key)
        if src not in tensors:
            missing.append(key)
            continue
        t = tensors[src]
        if tuple(t.shape) != tuple(ref.shape):
            wrong.append(f"{key}: {tuple(t.shape)} vs module {tuple(ref.shape)}")
            continue
        out[key] = t.to(ref.dtype)
    used = {canonical.get(id(r), k) for k, r in module.state_dict(keep_vars=True).items()}
    unexpected = sorted(set(tensors) - used)
    if missing or wrong or unexpected:
        raise TorchModelError(
            f"The params and model state do not match {type(module).__name__}'s state_dict: "
            f"missing {missing}, unexpected {unexpected}, shape mismatches {wrong}. Fix: export "
            "with the same module class and constructor arguments that were extracted."
        )
    return out
