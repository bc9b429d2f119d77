"""The private torchax environment of a trace, and what is switched for its duration."""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F

from torchshell.trace._adaptive_softmax import adaptive_softmax_fixed_shape
from torchshell.trace._attention import mha_forward, sdpa
from torchshell.trace._autocast import user_autocast
from torchshell.trace._autograd_fn import custom_backwards
from torchshell.trace._cholesky import cholesky_lowerings
from torchshell.trace._conv import conv_lowerings
from torchshell.trace._ctc import hf_ctc_shape_static
from torchshell.trace._ctc_grad import ctc_nll_torch_grad
from torchshell.trace._cumulative_bn import cumulative_batch_norm
from torchshell.trace._embedding_bag import embedding_bag_lowerings
from torchshell.trace._fold import folded_when_concrete
from torchshell.trace._func import traced_gradients
from torchshell.trace._hf import uncached
from torchshell.trace._host_random import host_random_refused
from torchshell.trace._index_reduce import index_reduce
from torchshell.trace._inplace import install_inplace, written_through_views
from torchshell.trace._kinks import kink_lowerings
from torchshell.trace._lowerings import (
    WINDOWS,
    bincount,
    grouped_mm,
    multilabel_margin_loss,
    sample_dirichlet,
    standard_gamma,
    window,
)
from torchshell.trace._module_hooks import backward_hooks_refused
from torchshell.trace._nll import nll_lowerings
from torchshell.trace._no_grad import stopped_in_no_grad, user_no_grad_regions
from torchshell.trace._norms import norm_lowerings
from torchshell.trace._ops import install_ops
from torchshell.trace._packed import packed_as_masks
from torchshell.trace._reads import Reads, scalar_reads
from torchshell.trace._refused import refused_env_lowerings, refused_lowerings
from torchshell.trace._rnnt import rnnt_loss_forward
from torchshell.trace._scatter_reduce import scatter_reduce_lowerings
from torchshell.trace._special import special_lowerings
from torchshell.trace._symmetric import symmetric_lowerings
from torchshell.trace._targets import casts_to_long, class_index_checked
from torchshell.trace._unpool import unpool_lowerings

_BATCH_NORM_OPS = (
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
)


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
        env.override_op_definition(op, _empty_stats_in_eval(op, impl))
    lowerings = {
        torch.ops.aten.bincount.default: bincount,
        torch.ops.aten._grouped_mm.default: grouped_mm,  # mixture-of-experts layers
        torch.ops.aten._ctc_loss.Tensor: ctc_nll_torch_grad,  # F.ctc_loss: torch's gradient
        # (torch 2.9's own decomposition, which torchax would use, counts the target slots
        # after the first -1: a wrong loss, silently)
        torch.ops.aten.multilabel_margin_loss_forward.default: multilabel_margin_loss,
        torch.ops.aten.index_reduce.default: index_reduce,  # (torch's gradient; index_reduce_)
        # windows built in a forward (torch.stft(x, n, window=torch.hann_window(n)))
        **{getattr(torch.ops.aten, f"{kind}_window").default: window(kind) for kind in WINDOWS},
        **{getattr(torch.ops.aten, f"{kind}_window").periodic: window(kind) for kind in WINDOWS},
        torch.ops.aten.hamming_window.periodic_alpha: window("hamming"),
        torch.ops.aten.hamming_window.periodic_alpha_beta: window("hamming"),
        torch.ops.aten.mT.default: lambda x: jnp.swapaxes(x, -1, -2),  # x.mT
        torch.ops.aten.mH.default: lambda x: jnp.conj(jnp.swapaxes(x, -1, -2)),
        torch.ops.aten.adjoint.default: lambda x: jnp.conj(jnp.swapaxes(x, -1, -2)),
        # torch.distributions' argument checks (Beta(a, a).sample() in a mixup step)
        torch.ops.aten._is_all_true.default: lambda x: jnp.all(x),
        torch.ops.aten._is_any_true.default: lambda x: jnp.any(x),
        **_torchaudio_lowerings(),
        **embedding_bag_lowerings(),  # EmbeddingBag(text, offsets): traced offsets
        **conv_lowerings(),  # convolutions XLA:CPU runs slowly: patches + one matmul
        **nll_lowerings(),  # nll_loss (cross_entropy): a one-hot select, not a gather
        **kink_lowerings(),  # clamp, hardtanh/relu6, abs...: torch's gradient at the kinks
        **norm_lowerings(),  # norms, distances, std: torch's gradient (0) at a zero vector
        **special_lowerings(),  # polygamma, digamma's gradient, log_ndtr, _safe_softmax, lstsq
        **cholesky_lowerings(),  # cholesky(_ex), cholesky_solve: torch's gradients
        **unpool_lowerings(),  # max_unpool1d/2d/3d: one scatter, torch's gradient (a gather)
        **symmetric_lowerings(),  # eigh/eigvalsh/pinv(hermitian): one triangle, as torch
        **scatter_reduce_lowerings(),  # (torch's gradient: prod, ties of amax/amin)
        **refused_lowerings(),  # lu_unpack, householder_product, ormqr, segment_reduce
    }
    with_env = {
        # torch.distributions' samplers (Beta(a, a).sample(): mixup) draw from the trace's key
        torch.ops.aten._sample_dirichlet.default: sample_dirichlet,
        torch.ops.aten._standard_gamma.default: standard_gamma,
        **refused_env_lowerings(),  # torch.normal(mean, std, size) of two numbers
        # attention: one fused call (jax.nn.dot_product_attention), not torchax's math reference
        F.scaled_dot_product_attention: sdpa,
        torch.ops.aten.scaled_dot_product_attention: sdpa,
    }
    for table, needs_env in ((lowerings, False), (with_env, True)):
        for aten_op, lowering in table.items():
            env._ops[aten_op] = ops_registry.Operator(
                aten_op,
                lowering,
                is_jax_function=True,
                is_user_defined=True,
                needs_env=needs_env,
                is_view_op=False,
            )
    env._ops[F.multi_head_attention_forward] = ops_registry.Operator(
        F.multi_head_attention_forward,
        mha_forward,
        is_jax_function=False,
        is_user_defined=True,
        needs_env=True,
        is_view_op=False,
    )
    # adaptive max pooling, cummax/cummin, rrelu, normal_/uniform_; matmul/conv dtypes
    install_ops(env)
    install_inplace(env)  # fill_diagonal_ (torchax: the tensor unchanged)
    scalar_reads(env, reads)
    # in-place ops on a slice (``bias[C:2*C].zero_()``) write through to the sliced tensor
    # ... under the user's own torch.autocast regions (torchax keeps its own autocast dtype)
    dispatch = user_autocast(env, folded_when_concrete(written_through_views(env)))
    # ... and the user's own torch.no_grad() regions stop gradients (:mod:`._no_grad`)
    env.dispatch = stopped_in_no_grad(env, dispatch)
    # ``t.cpu()`` (``pack_padded_sequence(x, lengths.cpu())``) keeps a traced tensor traced:
    # in the compiled step the device is JAX's; torchax would copy it to a torch CPU tensor
    env.override_op_definition(torch._C.TensorBase.cpu, lambda t, *args, **kwargs: t)
    env.override_op_definition(F.ctc_loss, functools.partial(_ctc_loss, env))
    casts_to_long(env)  # y.long() of an int32 batch field: no longer the field (_targets)
    _device_kept(env)  # x.to("cpu", torch.float64): the dtype cast, the tensor traced
    return env


def _empty_stats_in_eval(op: Any, impl: Callable[..., Any]) -> Callable[..., Any]:
    """A batch-norm decomposition whose saved mean and inverse std are empty (shape ``(0,)``)
    when it does not train, as torch's kernels return them (the decomposition gave ``(C,)``).
    """
    training_at = next(
        (i for i, a in enumerate(op._schema.arguments) if a.name == "training"), None
    )

    @functools.wraps(impl)
    def stats(*args: Any, **kwargs: Any) -> Any:
        out = impl(*args, **kwargs)
        if training_at is None:  # (_native_batch_norm_legit_no_training)
            training = False
        elif len(args) > training_at:
            training = bool(args[training_at])
        else:
            training = bool(kwargs.get("training", False))
        if training:
            return out
        first = out[0]
        return (first, first.new_empty((0,)), first.new_empty((0,)))

    return stats


def _device_kept(env: Any) -> None:
    """``x.to("cpu", dtype)`` / ``x.to(device="cpu")`` of a traced tensor casts the dtype and
    keeps the tensor traced, as ``x.cpu()`` (above): in the compiled step the device is JAX's.
    torchax copied it to a torch CPU tensor, which reads a traced value: refused as reading
    a weight as a Python number."""
    from torchax.tensor import Tensor
    from torchax.view import View

    to_copy = env._to_copy

    def copy(the_tensor: Any, new_dtype: Any, new_device: Any) -> Any:
        device = getattr(new_device, "type", new_device)
        if isinstance(the_tensor, Tensor | View) and device == "cpu":
            new_device = None
        return to_copy(the_tensor, new_dtype, new_device)

    env._to_copy = copy


def _torchaudio_lowerings() -> dict[Any, Callable[..., Any]]:
    """torchaudio's custom ops, where torchaudio is already imported (never imported here):
    ``rnnt_loss_forward`` under ``torchaudio.functional.rnnt_loss`` / ``transforms.RNNTLoss``."""
    if "torchaudio" not in sys.modules:
        return {}
    try:
        op = torch.ops.torchaudio.rnnt_loss_forward.default
    except (AttributeError, RuntimeError):  # a torchaudio built without its RNN-T kernel
        return {}
    return {op: rnnt_loss_forward}


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

    numpy's and Python's global random draws raise (:mod:`._host_random`: one draw would be
    reused by every step); an autocast region around the trace (Lightning's precision
    plugin) is off, the user's own inside it is honoured (:mod:`._autocast`).

    Attention (``F.scaled_dot_product_attention``, ``nn.MultiheadAttention``) is one fused
    ``jax.nn.dot_product_attention`` call (:mod:`._attention`). What torch still computes by
    its math path (``nn.MultiheadAttention``'s weights with ``need_weights=True``) is allowed
    to keep bfloat16/float16 while tracing, as torch's fused kernels do on a GPU
    (``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp``).
    """
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # nested tensors, fused MHA: math path
    reduced_sdpa = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    checks = _metric_checks()
    torchax_log = logging.getLogger("torchax.tensor")
    torchax_log.addFilter(_not_data_copy)
    from torchax.view import View

    view_setitem = View.__setitem__
    View.__setitem__ = _view_setitem(view_setitem)  # type: ignore[method-assign]
    try:
        for module, name in checks:
            setattr(module, name, _no_check)
        # constants fold (ops over traced values do not: folded_when_concrete)
        with (
            jax.ensure_compile_time_eval(),
            packed_as_masks(),  # packed sequences are masks
            hf_ctc_shape_static(),
            uncached(),
            host_random_refused(),  # np.random.beta in a step: one draw reused, refused
            backward_hooks_refused(),  # module backward hooks: jax.grad never runs them
            cumulative_batch_norm(),  # BatchNorm(momentum=None): 1/num_batches_tracked
            adaptive_softmax_fixed_shape(),  # AdaptiveLogSoftmaxWithLoss: no nonzero()
            user_no_grad_regions(),  # the user's torch.no_grad(): no gradient through it
            custom_backwards(),  # a user's torch.autograd.Function: its own backward
            traced_gradients(),  # torch.func.vjp/grad in a step (a gradient penalty)
            class_index_checked(),  # F.cross_entropy/nll_loss: targets torch refuses, refused
            warnings.catch_warnings(),
            # Lightning's precision plugin's region is not the step's (the JAX step has its
            # compute dtype); the user's own torch.autocast inside it is (user_autocast)
            torch.autocast("cpu", enabled=False),
        ):
            # checkpoint(fn, x, use_reentrant=True) on traced inputs (no requires_grad):
            # jax.grad differentiates through it all the same
            warnings.filterwarnings("ignore", "None of the inputs have requires_grad=True")
            yield
    finally:
        for (module, name), check in checks.items():
            setattr(module, name, check)
        torch.backends.mha.set_fastpath_enabled(fast)
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(reduced_sdpa)
        torchax_log.removeFilter(_not_data_copy)
        View.__setitem__ = view_setitem  # type: ignore[method-assign]


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
