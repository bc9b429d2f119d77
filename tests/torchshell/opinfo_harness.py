"""One OpInfo sample of torch's op database (``op_db``) through the trace, against torch eager.

Shared by the suite's share (``test_silent_ops_opinfo.py``) and the whole-database sweep
(``python -m tests.torchshell.opinfo_sweep``, ``make opinfo``). A sample becomes a module
whose differentiable tensors are parameters (the other tensors batch fields: int64 ones reach
the step as int32, as coreshell hands them over) and whose loss is ``(out * w).sum()`` with a
fixed ``w`` over every output torch differentiates (a complex one: its real and imaginary
parts, each with its own ``w``). The traced loss and every gradient (``torch_model_fns`` +
``jax.value_and_grad``, what the train step differentiates), and the values of the outputs
torch does not differentiate (batch norm's saved statistics, indices are not floating), are
compared with torch eager's (float32, rtol 1e-4, atol 1e-5).

What a sample gives (:class:`Outcome`): ``equal``; ``refused`` (coreshell's
``TorchModelError``); ``noise`` (off at that tolerance, but as close to torch's float64
result as torch's own float32 result is, within 10x, or closer); ``random`` (an op that
draws: not compared by value, its draws vary with the step's key); ``different`` (silently:
the values or gradients differ); ``error`` (a raw exception of the trace, not coreshell's);
``skipped`` (nothing to compare: no floating output, a sparse tensor, torch eager itself
fails, or its float32 result is over 1000x the tolerance from its float64 one; or only its
gradients differ where torch's own OpInfo marks its backward gradient an expected failure,
``TestBwdGradients.test_fn_grad``: ``as_strided_scatter``, whose gradient for ``self`` torch
2.9 puts on the scattered region instead of off it).
"""

from __future__ import annotations

import dataclasses
import unittest
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree

from torchshell._errors import TorchModelError
from torchshell.torch_model import torch_model_fns

RTOL, ATOL = 1e-4, 1e-5
KINDS = ("equal", "noise", "random", "refused", "different", "error", "skipped")
PASSING = ("equal", "random", "refused")  # (what the suite's share accepts)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one sample gave: ``kind`` (one of :data:`KINDS`) and a one-line ``detail``."""

    kind: str
    detail: str = ""


def first_line(text: str, limit: int = 400) -> str:
    """The first non-empty line of ``text``, at most ``limit`` characters."""
    line = next((s.strip() for s in str(text).splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def in_scope(op: Any) -> bool:
    """Whether the sweep runs ``op``: it supports float32 and autograd on CPU."""
    return bool(op.supports_autograd) and torch.float32 in op.supported_dtypes("cpu")


def draws(op: Any) -> bool:
    """Whether ``op`` may draw random numbers (op_db wraps those in ``wrapper_set_seed``)."""
    code = getattr(op.op, "__code__", None)
    return "wrapper_set_seed" in getattr(code, "co_names", ())


def samples(op: Any, count: int = 2) -> list[Any]:
    """``op``'s first ``count`` float32 autograd samples whose tensors are all non-empty,
    drawn from a fixed seed (the same whichever ops ran before)."""
    found: list[Any] = []
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for sample in op.sample_inputs("cpu", torch.float32, requires_grad=True):
            tensors = pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
            if all(t.numel() > 0 for t in tensors if isinstance(t, torch.Tensor)):
                found.append(sample)
            if len(found) == count:
                break
    return found


class SampleModule(nn.Module):
    """``op(input, *args, **kwargs)`` with the differentiable tensors as parameters.

    It returns every floating (or complex) tensor of the output, after the sample's
    ``output_process_fn_grad`` (torch's own gradient tests keep to what it returns: an SVD's
    singular vectors only up to sign, as ``U @ V.mH``).
    """

    def __init__(
        self, op: Any, leaves: list[Any], spec: Any, grad: list[int], process: Any = None
    ) -> None:
        super().__init__()
        self.op, self.leaves, self.spec, self.grad = op, leaves, spec, grad
        self.process = process or (lambda out: out)
        self.ps = nn.ParameterList([nn.Parameter(leaves[i].detach().clone()) for i in grad])

    def forward(self, *fields: torch.Tensor) -> list[torch.Tensor]:
        given, params = iter(fields), iter(self.ps)
        leaves = [
            next(params)
            if i in self.grad
            else (next(given) if isinstance(leaf, torch.Tensor) else leaf)
            for i, leaf in enumerate(self.leaves)
        ]
        x, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        out = self.process(self.op(x, *args, **kwargs))  # (torch's own: U @ V.mH of an SVD)
        return [
            o
            for o in pytree.tree_leaves(out)
            if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex())
        ]


def _parts(o: Any, xp: Any) -> list[Any]:
    """A real output, or the real and imaginary parts of a complex one."""
    return [xp.real(o), xp.imag(o)] if xp.iscomplexobj(o) else [o]


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A torch tensor's values; bfloat16/half (complex32) ones as float32 (complex64)."""
    t = t.detach().resolve_conj()
    wider = torch.promote_types(t.dtype, torch.float32) if t.is_floating_point() else None
    wider = torch.complex64 if t.dtype == torch.complex32 else wider
    return (t.to(wider) if wider is not None else t).numpy()


def _weights(outs: Sequence[torch.Tensor]) -> list[np.ndarray]:
    g = torch.Generator().manual_seed(0)
    parts = [p for o in outs for p in _parts(_numpy(o), np)]
    return [(torch.rand(p.shape, generator=g) + 0.5).numpy() for p in parts]


def _loss(outs: Sequence[Any], ws: Sequence[np.ndarray], xp: Any) -> Any:
    """The sum of each output's (or part's) elements weighed by its ``w``, in float32 or
    wider (a bfloat16 output's values summed in float32)."""
    parts = [p.astype(xp.promote_types(p.dtype, xp.float32)) for o in outs for p in _parts(o, xp)]
    return sum(
        ((p * xp.asarray(w, dtype=p.dtype)).sum() for p, w in zip(parts, ws, strict=True)),
        xp.zeros(()),
    )


def _values(o: Any) -> np.ndarray:
    """An output's values as one real array (a complex one: real and imaginary parts)."""
    return np.stack([np.asarray(p) for p in _parts(np.asarray(o), np)])


@dataclasses.dataclass(frozen=True)
class _Eager:
    """What torch eager gives: the loss over the outputs torch differentiates (``diff``),
    every gradient (zeros for an unused parameter), and the other outputs' values."""

    diff: list[int]
    ws: list[np.ndarray]
    found: list[np.ndarray]  # [loss, *gradients, *other outputs]


def _eager(net: SampleModule, fields: list[torch.Tensor], like: _Eager | None) -> _Eager:
    outs = net(*fields)
    diff = like.diff if like else [i for i, o in enumerate(outs) if o.requires_grad]
    ws = like.ws if like else _weights([outs[i] for i in diff])
    parts = [
        p.to(torch.promote_types(p.dtype, torch.float32))
        for i in diff
        for p in ([outs[i].real, outs[i].imag] if outs[i].is_complex() else [outs[i]])
    ]
    wide = torch.promote_types(outs[0].real.dtype, torch.float32)
    loss = sum(
        ((p * torch.from_numpy(w).to(p.dtype)).sum() for p, w in zip(parts, ws, strict=True)),
        torch.zeros((), dtype=wide),
    )
    want = (
        torch.autograd.grad(loss, list(net.ps), allow_unused=True)
        if net.ps and loss.requires_grad
        else [None] * len(net.ps)
    )
    grads = [torch.zeros_like(p) if w is None else w for p, w in zip(net.ps, want, strict=True)]
    others = [_values(_numpy(o)) for i, o in enumerate(outs) if i not in diff]
    return _Eager(diff, ws, [loss.detach().numpy(), *(w.detach().numpy() for w in grads), *others])


def _float64(leaves: list[Any]) -> list[Any]:
    return [
        t.detach().double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        for t in leaves
    ]


def _scaled_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / (atol + rtol |want|): at most 1 where they are close."""
    if got.shape != want.shape:
        return float("inf")
    got, want = got.astype(np.float64), want.astype(np.float64)
    both_nan = np.isnan(got) & np.isnan(want)
    err = np.abs(got - want) / (ATOL + RTOL * np.abs(want))
    err = np.where(both_nan | (got == want), 0.0, err)
    return float(np.nan_to_num(err, nan=np.inf).max(initial=0.0))


def _traced(
    net: SampleModule, fields: list[torch.Tensor], eager: _Eager
) -> Callable[[jax.Array], list[np.ndarray]]:
    """The traced loss, gradients and other outputs' values, as :class:`_Eager`'s ``found``,
    under a step key."""
    names = tuple(f"f{i}" for i in range(len(fields)))
    fns = torch_model_fns(net, names)
    batch = {n: jnp.asarray(t.numpy()) for n, t in zip(names, fields, strict=True)}
    params = {f"ps.{i}": jnp.asarray(p.detach().numpy()) for i, p in enumerate(net.ps)}
    state: dict[str, jax.Array] = {}  # (no buffers: init, another trace, is not needed)

    def run(key: jax.Array) -> list[np.ndarray]:
        def loss(p: dict[str, jax.Array]) -> tuple[jax.Array, list[jax.Array]]:
            outs = fns.apply(p, state, batch, key, True)[0]
            diff = [outs[i] for i in eager.diff]
            others = [jax.lax.stop_gradient(o) for i, o in enumerate(outs) if i not in eager.diff]
            return _loss(diff, eager.ws, jnp), others

        (value, others), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return [
            np.asarray(value),
            *(np.asarray(grads[f"ps.{i}"]) for i in range(len(net.ps))),
            *(_values(o) for o in others),
        ]

    return run


def compare(op: Any, sample: Any, *, random: bool = False) -> Outcome:
    """Runs one sample of ``op`` (its ``op.op``) in torch eager and through the trace.

    Args:
        op: an OpInfo of ``op_db``.
        sample: one of :func:`samples`.
        random: ``op`` draws (:func:`draws`): where the values differ, its draws must vary
            with the step's key instead.
    """
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    if any(isinstance(t, torch.Tensor) and t.layout != torch.strided for t in leaves):
        return Outcome("skipped", "a sparse tensor: coreshell's batches and weights are dense")
    grad = [
        i
        for i, t in enumerate(leaves)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
    ]
    net = SampleModule(op.op, leaves, spec, grad, sample.output_process_fn_grad)
    fields = [
        t.detach() for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and i not in grad
    ]
    try:
        outs = net(*fields)
        if not outs:
            return Outcome("skipped", "no floating output")
        if any(o.layout != torch.strided for o in outs):
            return Outcome("skipped", "a sparse output: coreshell's outputs are dense")
        eager = _eager(net, fields, None)
    except Exception as e:  # (torch's own sample fails: nothing to compare)
        return Outcome("skipped", f"torch eager: {type(e).__name__}: {first_line(str(e))}")
    want = eager.found
    try:
        run = _traced(net, fields, eager)
        got = run(jax.random.key(0))
    except TorchModelError as e:
        return Outcome("refused", first_line(str(e)))
    except Exception as e:  # (a raw error is what the sweep reports)
        return Outcome("error", f"{type(e).__name__}: {first_line(str(e))}")
    errors = [_scaled_error(g, w) for g, w in zip(got, want, strict=True)]
    if max(errors) <= 1.0:
        return Outcome("equal")
    values_equal = errors[0] <= 1.0 and max(errors[1 + len(grad) :], default=0.0) <= 1.0
    if values_equal and torch_gradient_known_wrong(op):
        return Outcome("skipped", "values equal; torch's own OpInfo marks its gradient wrong")
    what = ["loss", *(f"gradient of input {i}" for i in grad)]
    what += [f"output {i}" for i in range(len(outs)) if i not in eager.diff]
    detail = "; ".join(
        f"{what[k]}: {_head(got[k])} != {_head(want[k])}" + _shapes(got[k], want[k])
        for k in [k for k, e in enumerate(errors) if e > 1.0][:2]
    )
    if random:
        again = run(jax.random.key(1))
        varies = any(_scaled_error(a, g) > 1.0 for a, g in zip(again, got, strict=True))
        shaped = all(g.shape == w.shape for g, w in zip(got, want, strict=True))
        if varies and shaped:
            return Outcome("random", "draws vary with the step's key")
        return Outcome("different", "draws do not vary with the step's key; " + detail)
    try:
        net64 = SampleModule(op.op, _float64(leaves), spec, grad, sample.output_process_fn_grad)
        exact = _eager(net64, _float64(fields), eager).found
    except Exception:  # (no float64 reference: judged at float32)
        return Outcome("different", detail)
    ours = [_scaled_error(g, e) for g, e in zip(got, exact, strict=True)]
    torchs = [_scaled_error(w, e) for w, e in zip(want, exact, strict=True)]
    if max(torchs) > 1e3:  # (torch 2.9's `sgn` gradient of a sample: uninitialised memory)
        return Outcome("skipped", "torch's float32 and float64 results differ (over 1000x)")
    if all(o <= max(1.0, 10 * t) for o, t in zip(ours, torchs, strict=True)):
        return Outcome("noise", f"off by {max(errors):.3g} x tolerance; torch float32 too")
    return Outcome("different", detail)


def torch_gradient_known_wrong(op: Any) -> bool:
    """Whether ``op``'s OpInfo marks its backward gradient test an expected failure (torch's
    own gradient is not the reference there)."""
    return any(
        getattr(d, "cls_name", None) == "TestBwdGradients"
        and getattr(d, "test_name", None) == "test_fn_grad"
        and unittest.expectedFailure in getattr(d, "decorators", ())
        for d in op.decorators
    )


def _head(a: np.ndarray) -> str:
    return np.array2string(np.asarray(a).ravel()[:3], precision=4, separator=", ")


def _shapes(got: np.ndarray, want: np.ndarray) -> str:
    return "" if got.shape == want.shape else f" (shape {got.shape} != {want.shape})"
