"""Running traced torch code: traced bools as ``lax.cond`` paths, module modes and
attributes around a call, outputs JAX can return."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import torch
from torch import nn

import bridge
from torchshell._errors import TorchModelError
from torchshell.trace._module_hooks import training_trace
from torchshell.trace._reads import Branch


def explore(run: Callable[[tuple[bool, ...]], Any], max_paths: int, where: str) -> Any:
    """``run(())``, with every traced Python bool it meets turned into a ``lax.cond``.

    ``run(decisions)`` executes the traced code taking the first ``len(decisions)`` traced
    bools as given; at the next one it raises :class:`Branch`, and the code is run again
    once per outcome inside ``lax.cond`` (each run draws the same random values up to that
    point, as the key is the same). Paths grow as 2**decisions; more than ``max_paths``
    raises :class:`TorchModelError`.
    """
    paths = [0]
    # a check met along this path (its decisions) -> the outcome that raised: met again (a
    # later check's rerun of this part), it is traced once per outcome, not as a lax.cond
    # first; the reruns grew as 2**checks (torch.distributions checks each argument)
    checks: dict[tuple[bool, ...], bool] = {}

    def go(decisions: tuple[bool, ...]) -> Any:
        try:
            return run(decisions)
        except Branch as b:
            if decisions in checks:
                return _checked(go, decisions, b.pred, None, checks[decisions])
            paths[0] += 1
            if paths[0] >= max_paths:
                raise TorchModelError(
                    f"The code of {where} uses more than {len(decisions)} traced values as "
                    f"Python bools in one call (e.g. layer drop over many layers): each "
                    f"becomes a lax.cond and the paths double every time, past {max_paths}. "
                    "Expected a few such branches per call. Fix: write the choice with "
                    "torch.where (e.g. x = torch.where(keep, layer(x), x)), or raise "
                    "max_branches."
                ) from None
            raised: list[bool] = []  # the outcome whose run raised

            def branch(taken: bool) -> Callable[[], Any]:
                def run_branch() -> Any:
                    try:
                        return go((*decisions, taken))
                    except (ValueError, RuntimeError):
                        raised.append(taken)
                        raise

                return run_branch

            try:
                return jax.lax.cond(b.pred, branch(True), branch(False))
            except (ValueError, RuntimeError) as err:
                if not is_check(err):
                    raise
                checks[decisions] = raised[0] if raised else True
                return _checked(go, decisions, b.pred, err, checks[decisions])

    return go(())


def is_check(err: BaseException) -> bool:
    """A ``raise ValueError/RuntimeError`` of the traced code (not ours, not JAX's)."""
    return not isinstance(err, TorchModelError) and not type(err).__module__.startswith(
        ("jax", "jaxlib", "torchshell", "torchax")
    )


def _checked(
    go: Callable[[tuple[bool, ...]], Any],
    decisions: tuple[bool, ...],
    pred: Any,
    original: BaseException | None,
    first: bool = True,
) -> Any:
    """A traced bool whose one outcome raises (a check: ``if n >= limit: raise ValueError``).

    The step takes the other outcome, and raises the check's error when the traced value
    says so, as torch would (a host callback: the step fails with that message).

    ``first``: the outcome that raised in the ``lax.cond``, traced first here, so the run
    kept is the last one made: what a run records (its reads, its ``self.log`` calls)
    is that run's. (Traced last, ``torch.distributions``' ``if not valid: raise`` left
    the failing path's records: a raw ``IndexError``/``zip()`` error.)
    """
    outcomes: dict[bool, Any] = {}
    errors: dict[bool, BaseException] = {}
    for taken in (first, not first):
        try:
            outcomes[taken] = go((*decisions, taken))
        except (ValueError, RuntimeError) as raised:
            if not is_check(raised):
                raise
            errors[taken] = raised
    if len(errors) != 1:  # both outcomes raise (or neither alone): as traced in the cond
        if not errors and original is None:  # (a known check that raised on neither)
            return jax.lax.cond(
                pred, lambda: go((*decisions, True)), lambda: go((*decisions, False))
            )
        raise errors.get(True) or errors.get(False) or original  # type: ignore[misc]
    fails, check = next(iter(errors.items()))
    message = f"{type(check).__name__}: {check}"
    jax.debug.callback(functools.partial(_raise_check, message), pred if fails else ~pred)
    return outcomes[not fails]


def _raise_check(message: str, failed: Any) -> None:
    if bool(failed):
        raise ValueError(f"A check in the traced torch code failed on this batch: {message}")


def encode(values: Sequence[int]) -> tuple[int, ...]:
    """Ints as array dimensions (>= 0): 0, -1, 1, -2, ... -> 0, 1, 2, 3, ..."""
    return tuple(2 * v if v >= 0 else -2 * v - 1 for v in values)


def decode(dims: Sequence[int]) -> tuple[int, ...]:
    """The inverse of :func:`encode`."""
    return tuple(d // 2 if d % 2 == 0 else -(d + 1) // 2 for d in dims)


@contextlib.contextmanager
def mode(module: nn.Module, train: bool, own_modes: bool = False) -> Iterator[None]:
    """``module.train(train)`` for the duration, then the module's own modes back.

    With ``own_modes``, training keeps each submodule's mode as it is, as Lightning 2's fit
    loop does (it never calls ``LightningModule.train()``): a teacher or a backbone whose
    BatchNorm the user put in eval (``self.teacher.eval()`` in ``__init__``) stays in eval.
    Within, the trace is a training one exactly when ``train``
    (:func:`~torchshell.trace._module_hooks.training_trace`).
    """
    before = {m: m.training for m in module.modules()}
    if not (train and own_modes):
        module.train(train)
    try:
        with training_trace(train):  # (module backward hooks: refused when training only)
            yield
    finally:
        for m, was in before.items():
            m.training = was


@contextlib.contextmanager
def attributes_kept(module: nn.Module, carried: set[str] | None = None) -> Iterator[None]:
    """Tensor attributes a call sets on its modules are put back (or removed) afterwards.

    A cache (``self.src_mask = mask``, Lightning's demo Transformer) comes back as it was: no
    traced tensor outlives a call. An attribute set to a value computed from the weights or
    the batch (``self.hidden = (h, c)``, Lightning's demo LSTM carrying state to the next
    batch) is named in ``carried`` (``"path.attr"``): the compiled step cannot carry it.
    """
    before = {name: (m, dict(vars(m))) for name, m in module.named_modules()}
    try:
        yield
    finally:
        for name, (m, old) in before.items():
            now = vars(m)
            derived = _recomputed(m)
            for key in [k for k in now if k not in old or now[k] is not old[k]]:
                value = now[key]
                own = not key.startswith("_") and key not in derived
                if carried is not None and own and traced(value):
                    carried.add(f"{name}.{key}" if name else key)
                if key not in old:
                    if _tensors(value):
                        del now[key]
                elif old[key] is None or isinstance(old[key], torch.Tensor) or _tensors(value):
                    now[key] = old[key]


def _recomputed(m: nn.Module) -> set[str]:
    """Attributes a forward pre-hook of ``m`` computes afresh in every call (the legacy
    ``torch.nn.utils.weight_norm``/``spectral_norm`` set ``m.weight`` from ``weight_g`` and
    ``weight_v``): derived from the weights each step, not state kept for the next batch."""
    hooks = getattr(m, "_forward_pre_hooks", {}).values()
    return {h.name for h in hooks if isinstance(getattr(h, "name", None), str)}


def _tensors(value: Any) -> list[torch.Tensor]:
    leaves = value if isinstance(value, list | tuple) else [value]
    return [v for v in leaves if isinstance(v, torch.Tensor)]


def traced(value: Any) -> bool:
    """Whether a value (a torchax tensor or view, a JAX array, a list or tuple of them) holds
    a traced JAX value (not a constant)."""
    from torchax.view import View

    def one(x: Any) -> bool:
        while isinstance(x, View):
            x = x.parent
        return isinstance(getattr(x, "_elem", x), jax.core.Tracer)

    return any(map(one, value if isinstance(value, list | tuple) else [value]))


def plain(x: Any, where: str = "the output") -> Any:
    """Outputs JAX can return: mapping types JAX does not know (transformers' ``ModelOutput``)
    become dicts of their set fields; a leaf that is not an array or a number is refused.

    Raises:
        TorchModelError: a field holds a Python object (a transformers ``DynamicCache`` from
            ``use_cache=True``, a string), naming the field.
    """
    out = _as_dicts(x)
    for path, leaf in jax.tree_util.tree_leaves_with_path(out):
        if isinstance(leaf, jax.Array | np.ndarray | np.generic | bool | int | float):
            continue
        fix = (
            "call the model with use_cache=False (a training step keeps no KV cache)"
            if "cache" in type(leaf).__name__.lower()
            else "return tensors (or dicts, lists, tuples of them) from forward"
        )
        raise TorchModelError(
            f"{where}{jax.tree_util.keystr(path)} is a {type(leaf).__module__}."
            f"{type(leaf).__qualname__}, not a tensor: a compiled step returns arrays only. "
            f"Fix: {fix}."
        )
    return out


def _as_dicts(x: Any) -> Any:
    """Mappings JAX does not know as dicts, inside plain lists, tuples and dicts."""
    if isinstance(x, Mapping):
        return {k: _as_dicts(v) for k, v in x.items()}
    if type(x) in (list, tuple):
        return type(x)(_as_dicts(v) for v in x)
    if type(x).__module__ == "torch.return_types":  # torch.max(x, 1): (values, indices)
        return tuple(_as_dicts(v) for v in x)
    return x


class Bound(nn.Module):
    """Calls ``fn`` with ``module`` registered as its only child, so
    ``torch.func.functional_call`` can swap the module's weights for any method, not just
    ``forward`` (names gain the ``m.`` prefix)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.m = module
        self.fn: Callable[..., Any] | None = None  # None: the module's own forward

    def forward(self, *args: Any) -> Any:
        return (self.m if self.fn is None else self.fn)(*args)


def spec(v: Any) -> jax.ShapeDtypeStruct:
    """The shape and (JAX) dtype of a torch tensor or an array, for an abstract trace."""
    if isinstance(v, torch.Tensor):
        dtype = bridge.as_jax(torch.empty(0, dtype=v.dtype)).dtype
        return jax.ShapeDtypeStruct(tuple(v.shape), dtype)
    return jax.ShapeDtypeStruct(v.shape, v.dtype)
