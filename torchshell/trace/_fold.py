"""Constant folding while tracing: values that do not depend on the batch stay concrete.

An op none of whose inputs is traced runs at trace time (JAX's eager constant folding), so a
mask built from shapes, or a pad amount computed from constant buffers, is a concrete value
Python can read. An op with a traced input stays in the graph; the numbers it takes as
parameters (pad amounts, sizes) are handed to its lowering as Python ints when they are
concrete tensors (:func:`as_numbers`), as torch's own argument parser would read them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import torch
from jax._src import config as jax_config

from torchshell.trace._paths import traced as _traced

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


def folded_when_concrete(dispatch: Callable[..., Any]) -> Callable[..., Any]:
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
        if traced and not isinstance(func, torch._ops.OpOverload) and not _indexes(func):
            args, kwargs = as_numbers(args), as_numbers(kwargs or {})
        with folding(not traced or _folds(func, args)):
            return dispatch(func, types, args, kwargs)

    return folded


def _number(x: Any) -> int | None:
    """The Python int of a concrete one-element integer tensor (torchax's), else ``None``."""
    if not isinstance(x, torch.Tensor) or x.ndim > 1 or x.numel() != 1:
        return None
    if x.dtype.is_floating_point:
        return None
    if x.dtype in (torch.bool, torch.complex64, torch.complex128):
        return None
    elem = getattr(x, "_elem", None)
    if not isinstance(elem, jax.Array) or isinstance(elem, jax.core.Tracer):
        return None
    return int(elem.reshape(()))


def _indexes(func: Any) -> bool:
    """``x[i]``, ``x[i] = v``, ``index_put``...: tensors in their sequences are indices."""
    name = getattr(func, "__name__", "")
    return "index" in name or name in ("__getitem__", "__setitem__")


def as_numbers(args: Any) -> Any:
    """``args`` (a tuple, or a dict of keyword arguments) with every sequence of ints and
    concrete one-element integer tensors given as Python ints.

    Such a sequence is a parameter of the op (``F.pad``'s amounts, a size), not data: torch's
    argument parser reads its tensors as numbers; torchax's lowering compares them
    (``if pad_start < 0``), which, inside an op with a traced input, would stage the
    comparison and make it a tracer. transformers' Encodec computes its pad amounts from
    constant non-persistent buffers (``padding_total``, ``stride``, ``kernel_size``).

    Example:
        >>> import torch
        >>> as_numbers(((1, 2), [3]))  # nothing to change: the same values
        ((1, 2), [3])
    """

    def convert(value: Any) -> Any:
        if not isinstance(value, list | tuple) or not value:
            return value
        numbers = [v if isinstance(v, int) else _number(v) for v in value]
        if any(n is None for n in numbers) or all(isinstance(v, int) for v in value):
            return value
        return type(value)(numbers)

    if isinstance(args, dict):
        return {k: convert(v) for k, v in args.items()}
    return tuple(convert(v) for v in args)
