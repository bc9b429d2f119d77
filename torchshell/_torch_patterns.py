"""The torchax environment of :mod:`torchshell.torch_model`, and the PyTorch patterns it traces.

Real torch code reads tensor values in Python. Under ``jax.jit`` every value is a tracer, so
torchax alone stops there. This environment traces four such patterns instead:

- **values that do not depend on the batch** (masks built from shapes,
  ``generate_square_subsequent_mask``, ``torch.equal`` of two such masks in
  ``nn.TransformerDecoder``'s ``_detect_is_causal_mask``) are computed while tracing (JAX's
  eager constant folding, for each op none of whose inputs is traced), so Python sees
  concrete values;
- **eval-mode fast paths** torchax cannot lower (the nested-tensor path of
  ``nn.TransformerEncoder`` with a padding mask, the fused MHA kernel) are switched off while
  tracing, so torch takes its math path;
- **a traced value used as a Python bool** (layer drop: ``torch.rand(1).item() <= p``)
  becomes a ``lax.cond`` on that value: the traced function is re-run once per outcome
  (:func:`explore`), so the step draws it from its key, like torch, differently every step;
- **a scalar read from the batch** (``int(lengths.max().item())``) is *specialised*: found by
  a discovery trace on a concrete batch, evaluated on the host batch before each step
  (:class:`Reads` in ``probe`` mode) and handed to the compiled step as a static value.

A scalar read is any of ``Tensor.item``, ``bool``, ``int``, ``float``, ``__index__`` and
``torch.equal`` (or ``aten._local_scalar_dense``, where a read inside a torch function lands).
Reads are numbered in the order the traced code makes them; discovery learns
which are host reads, and the step matches them by that number.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from jax._src import config as jax_config
from torch import nn

from torchshell._ctc import ctc_nll, hf_ctc_shape_static
from torchshell._errors import TorchModelError
from torchshell._hf import uncached
from torchshell._packed import packed_as_masks

_BATCH_NORM_OPS = (
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
)
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


def _scalar_reads(env: Any, reads: Reads) -> None:
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


# Factories whose values do not depend on their tensor input's values, only its shape
# (``torch.full_like(target, 0.5)`` as gaussian_nll_loss's variance): folded while small, so
# Python checks on them read concrete values; in the graph past this many elements.
_LIKE = frozenset({"full_like", "zeros_like", "ones_like", "empty_like"})
_NEW = frozenset({"new_full", "new_zeros", "new_ones", "new_empty"})
_FOLD_LIMIT = 1 << 16


def _folds(func: Any, args: Sequence[Any]) -> bool:
    """Whether an op with a traced input still runs at trace time: a small factory above."""
    name = getattr(func, "__name__", "").split(".")[0]
    if name in _LIKE and args:
        shape = tuple(args[0].shape)
    elif name in _NEW and len(args) > 1:
        shape = tuple(args[1] if isinstance(args[1], Sequence) else args[1:])
    else:
        return False
    return math.prod(int(n) for n in shape) <= _FOLD_LIMIT


def _folded_when_concrete(dispatch: Callable[..., Any]) -> Callable[..., Any]:
    """``dispatch`` (torchax's, one torch op) with JAX's eager constant folding on exactly
    when none of the op's inputs is traced (or it is a small factory, :func:`_folds`).

    Then an op over values that do not depend on the batch (a mask built from shapes) runs at
    trace time and stays concrete for Python to read, while an op over traced values (and the
    zero tangents JAX's autodiff makes for it) stays in the graph. (:func:`tracing` keeps
    folding on around the ops, for torchax's own work between them, such as writing through a
    view.) Folding inside such ops too baked values in as constants of the traced tensors'
    size: ``torch.zeros_like(scores)`` in torch's attention softmax became a 1.15 GB constant
    per layer (6.9 GB) for a 6-layer encoder over 1,500 frames at batch 16, and autodiff's
    zero tangent for it one more.
    """
    # JAX's own switch behind jax.ensure_compile_time_eval, which has no public "off"
    folding = jax_config.eager_constant_folding

    @functools.wraps(dispatch)
    def folded(func: Any, types: Any, args: Any, kwargs: Any = None) -> Any:
        traced = any(map(_traced, jax.tree.leaves((args, kwargs))))
        with folding(not traced or _folds(func, args)):
            return dispatch(func, types, args, kwargs)

    return folded


def environment(reads: Reads) -> Any:
    """A private torchax environment: torch's BatchNorm math and the scalar reads above.

    torchax 0.0.13 lowers batch norm as a pure JAX op that drops the updated running stats
    (and uses the biased variance). Here the three batch-norm ops run torch's own
    decomposition on torchax tensors instead: its ``running_mean.copy_(...)`` mutates the
    buffers we passed in, which the tracer reads back as the new model state.
    """
    # Imported here: importing torchax disables torch's MHA fast path process-wide, which
    # only the users of this path should pay for.
    from torch._decomp import get_decompositions
    from torchax import tensor as torchax_tensor
    from torchax.ops import ops_registry

    env = torchax_tensor.Environment()
    ops = [getattr(torch.ops.aten, name).default for name in _BATCH_NORM_OPS]
    for op, impl in get_decompositions(ops).items():
        env.override_op_definition(op, impl)
    lowerings = {
        torch.ops.aten.bincount.default: _bincount,
        torch.ops.aten._grouped_mm.default: _grouped_mm,  # mixture-of-experts layers
        torch.ops.aten._ctc_loss.Tensor: ctc_nll,  # F.ctc_loss, nn.CTCLoss
        # (torch 2.9's own decomposition, which torchax would use, counts the target slots
        # after the first -1: a wrong loss, silently)
        torch.ops.aten.multilabel_margin_loss_forward.default: _multilabel_margin_loss,
        # windows built in a forward (torch.stft(x, n, window=torch.hann_window(n)))
        **{getattr(torch.ops.aten, f"{kind}_window").default: _window(kind) for kind in _WINDOWS},
        **{getattr(torch.ops.aten, f"{kind}_window").periodic: _window(kind) for kind in _WINDOWS},
        torch.ops.aten.hamming_window.periodic_alpha: _window("hamming"),
        torch.ops.aten.hamming_window.periodic_alpha_beta: _window("hamming"),
        torch.ops.aten.mT.default: lambda x: jnp.swapaxes(x, -1, -2),  # x.mT
        torch.ops.aten.mH.default: lambda x: jnp.conj(jnp.swapaxes(x, -1, -2)),
        torch.ops.aten.adjoint.default: lambda x: jnp.conj(jnp.swapaxes(x, -1, -2)),
    }
    for aten_op, lowering in lowerings.items():
        env._ops[aten_op] = ops_registry.Operator(
            aten_op,
            lowering,
            is_jax_function=True,
            is_user_defined=True,
            needs_env=False,
            is_view_op=False,
        )
    _scalar_reads(env, reads)
    env.dispatch = _folded_when_concrete(env.dispatch)
    # ``t.cpu()`` (``pack_padded_sequence(x, lengths.cpu())``) keeps a traced tensor traced:
    # in the compiled step the device is JAX's; torchax would copy it to a torch CPU tensor
    env.override_op_definition(torch._C.TensorBase.cpu, lambda t, *args, **kwargs: t)
    env.override_op_definition(F.ctc_loss, functools.partial(_ctc_loss, env))
    return env


_F_CTC_LOSS = F.ctc_loss


def _ctc_loss(
    env: Any,
    log_probs: Any,
    targets: Any,
    input_lengths: Any,
    target_lengths: Any,
    *args: Any,
    **kw: Any,
) -> Any:
    """``F.ctc_loss`` with lengths given as lists or tuples: passed as tensors (torch's list
    overload reads the traced tensors' data in C++; the tensor one reaches ``ctc_nll``)."""

    def as_tensor(x: Any) -> Any:
        return x if isinstance(x, torch.Tensor) else env.j2t_iso(jnp.asarray(x, jnp.int32))

    return _F_CTC_LOSS(
        log_probs, targets, as_tensor(input_lengths), as_tensor(target_lengths), *args, **kw
    )


_WINDOWS = ("hann", "hamming", "blackman", "bartlett")


def _window(kind: str) -> Callable[..., jax.Array]:
    """torch's ``<kind>_window(n, periodic=True, [alpha, beta], dtype=...)`` in JAX.

    Example:
        >>> import torch
        >>> w = _window("hann")(64)
        >>> bool(jnp.allclose(w, jnp.asarray(torch.hann_window(64).numpy()), atol=1e-6))
        True
    """

    def window(
        n: int, periodic: bool = True, alpha: float = 0.54, beta: float = 0.46, **kw: Any
    ) -> jax.Array:
        from torchax.ops import mappings

        dtype = mappings.t2j_dtype(kw.get("dtype") or torch.get_default_dtype())
        if n <= 1:
            return jnp.ones((n,), dtype)
        k = jnp.arange(n, dtype=jnp.float32)
        step = 2 * jnp.pi * k / (n if periodic else n - 1)  # periodic: one of n + 1, last dropped
        if kind == "hann":
            w = 0.5 - 0.5 * jnp.cos(step)
        elif kind == "hamming":
            w = alpha - beta * jnp.cos(step)
        elif kind == "blackman":
            w = 0.42 - 0.5 * jnp.cos(step) + 0.08 * jnp.cos(2 * step)
        else:  # bartlett
            w = 1 - jnp.abs(step / jnp.pi - 1)
        return w.astype(dtype)

    return window


def _multilabel_margin_loss(
    x: jax.Array, target: jax.Array, reduction: int
) -> tuple[jax.Array, jax.Array]:
    """``F.multilabel_margin_loss`` as torch's kernel computes it: a row's targets are its
    class indices up to the first ``-1``; each (target j, non-target i) pair adds
    ``max(0, 1 - x[j] + x[i]) / C``. Returns ``(loss, is_target)``.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> x = torch.tensor([[0.1, 0.2, 0.4, 0.8], [0.3, -0.2, 0.5, 0.1]])
        >>> t = torch.tensor([[3, 0, -1, 1], [2, -1, 0, 0]])
        >>> loss, _ = _multilabel_margin_loss(jnp.asarray(x.numpy()), jnp.asarray(t.numpy()), 1)
        >>> round(float(loss), 5) == round(float(F.multilabel_margin_loss(x, t)), 5)
        True
    """
    rows, labels = jnp.atleast_2d(x), jnp.atleast_2d(target)
    classes = jnp.arange(rows.shape[1])
    end = jnp.min(jnp.where(labels == -1, classes, rows.shape[1]), axis=-1, keepdims=True)
    valid = classes < end  # [B, slot]: the slots before the first -1
    scores = jnp.take_along_axis(rows, jnp.where(valid, labels, 0), axis=-1)  # [B, slot]
    hit = classes[None, None, :] == jnp.where(valid, labels, -1)[:, :, None]
    is_target = jnp.any(hit, axis=1)  # [B, class]
    z = jnp.maximum(1.0 - scores[:, :, None] + rows[:, None, :], 0.0) / rows.shape[1]
    z = jnp.where(valid[:, :, None] & ~is_target[:, None, :], z, 0.0)
    per_row = z.sum(axis=(1, 2))
    if reduction == 1:
        loss = per_row.mean()
    elif reduction == 2:
        loss = per_row.sum()
    else:
        loss = per_row.reshape(x.shape[:-1])
    return loss, is_target.astype(x.dtype).reshape(target.shape)


def _bincount(x: jax.Array, weights: jax.Array | None = None, minlength: int = 0) -> jax.Array:
    """``torch.bincount`` with ``minlength`` bins (torchmetrics' confusion counts).

    torch's length is ``max(minlength, x.max() + 1)``, a value; traced, it is ``minlength``
    (a value past it, which torch would count in a longer result, is not counted).
    """
    if not minlength:
        raise TorchModelError(
            "torch.bincount without minlength has a length that depends on the values, which "
            "a compiled JAX step cannot have. Fix: pass minlength= (the number of bins)."
        )
    counts = jnp.bincount(x, weights, length=int(minlength))
    return counts if weights is not None else counts.astype(jnp.int32)


def _grouped_mm(
    a: jax.Array,
    b: jax.Array,
    offs: jax.Array | None = None,
    bias: jax.Array | None = None,
    out_dtype: Any = None,
) -> jax.Array:
    """``torch._grouped_mm``: the experts of a mixture-of-experts layer in one matmul.

    transformers' default experts (Mixtral, Qwen-MoE, OLMoE...: ``grouped_mm_experts_forward``)
    sort the routed rows by expert and multiply ``a [rows, K]`` by ``b[g] [K, M]`` for the rows
    of group ``g`` (``offs``: where each group ends). That is ``lax.ragged_dot`` with the
    groups' sizes; rows past the last group come out 0 (torch leaves them unset). Batched
    ``[G, N, K] @ [G, K, M]`` without ``offs`` is a plain matmul.
    """
    if bias is not None:
        raise TorchModelError(
            "torch._grouped_mm with bias= is not lowered to JAX (torch has it on CUDA only). "
            "Fix: add the bias after the grouped matmul."
        )
    if a.ndim == 2 and b.ndim == 3 and offs is not None:
        sizes = jnp.diff(offs.astype(jnp.int32), prepend=0)
        out = jax.lax.ragged_dot(a, b, sizes)
    elif a.ndim == 3 and b.ndim == 3 and offs is None:
        out = jnp.matmul(a, b)
    else:
        raise TorchModelError(
            f"torch._grouped_mm of a {a.ndim}-D by a {b.ndim}-D tensor "
            f"{'with' if offs is not None else 'without'} offs is not lowered to JAX: only "
            "[rows, K] x [groups, K, M] with offs (mixture-of-experts layers) and batched "
            "[groups, N, K] x [groups, K, M]. Fix: write the experts as a loop of matmuls."
        )
    if out_dtype is None:
        return out
    from torchax.ops import mappings

    return out.astype(
        mappings.t2j_dtype(out_dtype) if isinstance(out_dtype, torch.dtype) else out_dtype
    )


def _view_setitem(original: Callable[..., None]) -> Callable[..., None]:
    """torchax's ``View.__setitem__`` taking tensor indices, a boolean mask shape-statically.

    ``view[mask] = value`` on a view (transformers' Longformer:
    ``extended_attention_mask[attention_mask == 2] = finfo.max`` on a slice) failed in
    torchax 0.0.13: the index stayed a torchax tensor inside ``jax_array.at[...]`` (an
    IndexError), and a traced mask there would need its nonzero count. A boolean mask is now
    a ``where`` over the view (torchax's own rule for tensors, ``_shape_static_boolean_index_put``),
    other tensor indices are unwrapped to arrays.
    """

    def setitem(self: Any, indexes: Any, value: Any) -> None:
        def unwrap(x: Any) -> Any:
            return x.jax() if hasattr(x, "jax") and not isinstance(x, jax.Array) else x

        parts = tuple(map(unwrap, indexes)) if isinstance(indexes, tuple) else (unwrap(indexes),)
        mask = parts[0] if len(parts) == 1 else None
        if not (isinstance(mask, jax.Array) and mask.dtype == jnp.bool_):
            return original(self, parts if isinstance(indexes, tuple) else parts[0], value)
        from torchax.ops.jaten import _shape_static_boolean_index_put

        current = self.jax()
        value = unwrap(value)
        if isinstance(value, torch.Tensor):  # a plain CPU tensor
            value = value.numpy(force=True)
        new = _shape_static_boolean_index_put(current, mask, jnp.asarray(value, current.dtype))
        self.update(new_values=new)
        return None

    return setitem


def _not_data_copy(record: logging.LogRecord) -> bool:
    """torchax's note that ``t.data`` copies on TPU: about eager runs, not a traced step
    (``lightning.pytorch.utilities.grad_norm`` reads ``p.grad.data``)."""
    return not record.getMessage().startswith("In-place to .data modifications")


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Constant folding on and torch's fused fast paths off, for the duration of a trace.

    Also torchmetrics' input checks off (``_*_tensor_validation``: ``torch.unique`` of the
    predictions, a shape that depends on values), so its functional metrics
    (``torchmetrics.functional.accuracy(preds, y, task="multiclass", ...)``) trace.

    Attention (``F.scaled_dot_product_attention``) always takes torch's math path here, which
    by default computes bfloat16/float16 inputs in float32; torch's fused kernels, which a
    torch user gets on a GPU, keep them in the reduced precision (accumulating in float32, as
    XLA's dots do). The math path is allowed the same while tracing
    (``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp``): under ``bf16-mixed`` the
    attention matmuls of a ported ``nn.TransformerEncoder`` were float32, the rest bfloat16.
    """
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # nested tensors, fused MHA: math path
    reduced_sdpa = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    checks = _metric_checks()
    losses = {(F, name): getattr(F, name) for name in ("cross_entropy", "nll_loss")}
    torchax_log = logging.getLogger("torchax.tensor")
    torchax_log.addFilter(_not_data_copy)
    from torchax.view import View

    view_setitem = View.__setitem__
    View.__setitem__ = _view_setitem(view_setitem)  # type: ignore[method-assign]
    try:
        for module, name in checks:
            setattr(module, name, _no_check)
        for (module, name), loss in losses.items():
            setattr(module, name, _class_index_checked(loss))
        # constants fold (ops over traced values do not: _folded_when_concrete)
        with jax.ensure_compile_time_eval(), packed_as_masks(), hf_ctc_shape_static(), uncached():
            yield  # packed sequences are masks
    finally:
        for (module, name), check in {**checks, **losses}.items():
            setattr(module, name, check)
        torch.backends.mha.set_fastpath_enabled(fast)
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(reduced_sdpa)
        torchax_log.removeFilter(_not_data_copy)
        View.__setitem__ = view_setitem  # type: ignore[method-assign]


def check_class_target(loss: str, input_ndim: int, target: Any) -> None:
    """Refuses floating class indices as torch does (under JAX they fail in a gather).

    A floating target of the input's rank is class probabilities (``cross_entropy``'s soft
    labels) and passes. ``target``: a torch or JAX array.
    """
    floating = getattr(target.dtype, "is_floating_point", None)
    if floating is None:
        floating = jnp.issubdtype(target.dtype, jnp.floating)
    soft = loss in ("cross_entropy", "CrossEntropyLoss") and target.ndim == input_ndim
    if floating and not soft:
        raise TorchModelError(
            f"{loss}: the target holds class indices of shape {tuple(target.shape)} but is "
            f"{target.dtype} (plain torch raises 'expected scalar type Long but found "
            "Float'). Fix: integer labels (.long() in the Dataset or collate), or class "
            "probabilities of the input's shape."
        )


def _class_index_checked(loss: Callable[..., Any]) -> Callable[..., Any]:
    """``loss`` with :func:`check_class_target` first."""

    @functools.wraps(loss)
    def checked(input: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
        check_class_target(loss.__name__, input.ndim, target)
        return loss(input, target, *args, **kwargs)

    return checked


def _no_check(*args: Any, **kwargs: Any) -> None:
    return None


def _metric_checks() -> dict[tuple[Any, str], Callable[..., Any]]:
    """torchmetrics' tensor validators, where a loaded torchmetrics module refers to them.

    (Only modules already imported: this never imports torchmetrics itself.)
    """
    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torchmetrics."):
            continue
        for attr, value in list(vars(module).items()):
            if attr.startswith("_") and attr.endswith("_tensor_validation") and callable(value):
                found[(module, attr)] = value
    return found


def explore(run: Callable[[tuple[bool, ...]], Any], max_paths: int, where: str) -> Any:
    """``run(())``, with every traced Python bool it meets turned into a ``lax.cond``.

    ``run(decisions)`` executes the traced code taking the first ``len(decisions)`` traced
    bools as given; at the next one it raises :class:`Branch`, and the code is run again
    once per outcome inside ``lax.cond`` (each run draws the same random values up to that
    point, as the key is the same). Paths grow as 2**decisions; more than ``max_paths``
    raises :class:`TorchModelError`.
    """
    paths = [0]

    def go(decisions: tuple[bool, ...]) -> Any:
        try:
            return run(decisions)
        except Branch as b:
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
            try:
                return jax.lax.cond(
                    b.pred, lambda: go((*decisions, True)), lambda: go((*decisions, False))
                )
            except (ValueError, RuntimeError) as err:
                if not is_check(err):
                    raise
                return _checked(go, decisions, b.pred, err)

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
    original: BaseException,
) -> Any:
    """A traced bool whose one outcome raises (a check: ``if n >= limit: raise ValueError``).

    The step takes the other outcome, and raises the check's error when the traced value
    says so, as torch would (a host callback: the step fails with that message).
    """
    outcomes: dict[bool, Any] = {}
    errors: dict[bool, BaseException] = {}
    for taken in (True, False):
        try:
            outcomes[taken] = go((*decisions, taken))
        except (ValueError, RuntimeError) as raised:
            if not is_check(raised):
                raise
            errors[taken] = raised
    if len(errors) != 1:  # both outcomes raise (or neither alone): as traced in the cond
        raise errors.get(True) or original
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
def mode(module: nn.Module, train: bool) -> Iterator[None]:
    """``module.train(train)`` for the duration, then the module's own modes back."""
    before = {m: m.training for m in module.modules()}
    module.train(train)
    try:
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
            for key in [k for k in now if k not in old or now[k] is not old[k]]:
                value = now[key]
                if carried is not None and not key.startswith("_") and _traced(value):
                    carried.add(f"{name}.{key}" if name else key)
                if key not in old:
                    if _tensors(value):
                        del now[key]
                elif old[key] is None or isinstance(old[key], torch.Tensor) or _tensors(value):
                    now[key] = old[key]


def _tensors(value: Any) -> list[torch.Tensor]:
    leaves = value if isinstance(value, list | tuple) else [value]
    return [v for v in leaves if isinstance(v, torch.Tensor)]


def _traced(value: Any) -> bool:
    """Whether a value (a torchax tensor or view, a JAX array, a list or tuple of them) holds
    a traced JAX value (not a constant)."""
    from torchax.view import View

    def traced(x: Any) -> bool:
        while isinstance(x, View):
            x = x.parent
        return isinstance(getattr(x, "_elem", x), jax.core.Tracer)

    return any(map(traced, value if isinstance(value, list | tuple) else [value]))


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
