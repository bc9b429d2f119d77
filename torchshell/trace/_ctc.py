"""``F.ctc_loss`` / ``nn.CTCLoss`` in a traced step: torch's ``aten::_ctc_loss`` in JAX.

torchax 0.0.13 has no lowering for ``aten::_ctc_loss``, the kernel under torch's CTC loss (the
speech loss: wav2vec2, conformer and DeepSpeech heads train with it). :func:`ctc_nll` is that
kernel: the CTC forward (alpha) recursion in log space over the extended label sequence
(blank, l1, blank, l2, ..., blank), one ``lax.scan`` over time, each sequence frozen past its
own input length. torch's own composite ``ctc_loss`` around it (the ``zero_infinity``
replacement, the ``mean``/``sum``/``none`` reductions, the target-length division) runs
unchanged on the traced tensors, and JAX differentiates the recursion.

Impossible alignments (an input shorter than its target plus its repeated labels) give
``inf`` as in torch; their gradient is 0 (a finite stand-in for log 0 inside the recursion
keeps NaN out of the ``zero_infinity=True`` gradient). Padded ``[N, S]`` targets and torch's
concatenated 1-D form both work. torch's value checks (a target length past ``S``, an input
length past ``T``, a label out of range) need the values: inside the compiled step they are
not made. transformers' CTC heads (``Wav2Vec2ForCTC(labels=...)``) flatten their labels with
``masked_select``, a shape that depends on values: :func:`hf_ctc_shape_static` gives them
the same loss on padded labels while a step is traced.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F

__all__ = ["ctc_nll", "hf_ctc_shape_static"]

_LOG0 = -1e30  # log(0) inside the recursion: finite, so gradients stay finite


def _padded_targets(targets: jax.Array, target_lengths: jax.Array, n: int) -> jax.Array:
    """``[N, S]`` targets from torch's concatenated (1-D) form, S its total length."""
    # concatenated: sequence i is targets[offset_i : offset_i + length_i]; S = the total
    offsets = jnp.cumsum(target_lengths) - target_lengths
    idx = offsets[:, None] + jnp.arange(targets.shape[0])[None, :]
    return targets[jnp.clip(idx, 0, max(targets.shape[0] - 1, 0))].reshape(n, -1)


def ctc_nll(
    log_probs: jax.Array,
    targets: jax.Array,
    input_lengths: Any,
    target_lengths: Any,
    blank: int = 0,
    zero_infinity: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """torch's ``aten::_ctc_loss``: each sequence's negative log likelihood, and log alpha.

    Args:
        log_probs: ``[T, N, C]`` (or ``[T, C]``) log probabilities, as torch takes them.
        targets: ``[N, S]`` padded labels, or the ``[sum(target_lengths)]`` concatenation.
        input_lengths: ``[N]`` frames per sequence (array or list).
        target_lengths: ``[N]`` labels per sequence (array or list).
        blank: the blank label.
        zero_infinity: unused here (torch's composite applies it to the result).

    Returns:
        ``(nll [N], log_alpha [N, T, 2S+1])`` as torch's kernel returns them (``nll`` is
        ``inf`` where no alignment exists).

    Example:
        >>> import torch, torch.nn.functional as F
        >>> g = torch.Generator().manual_seed(0)
        >>> lp = torch.randn(12, 3, 5, generator=g).log_softmax(-1)
        >>> y, yl, xl = torch.tensor([[1, 2, 2], [3, 4, 0], [1, 1, 1]]), [3, 2, 3], [12, 9, 4]
        >>> nll, _ = ctc_nll(jnp.asarray(lp.numpy()), jnp.asarray(y.numpy()), xl, yl)
        >>> ref = F.ctc_loss(lp, y, xl, yl, reduction="none")
        >>> bool(jnp.allclose(nll, jnp.asarray(ref.numpy()), rtol=1e-5))
        True
    """
    del zero_infinity  # (torch's composite ctc_loss replaces inf by 0 around this kernel)
    batched = log_probs.ndim == 3
    lp = log_probs if batched else log_probs[:, None]
    t_max, n, _ = lp.shape
    compute = jnp.promote_types(lp.dtype, jnp.float32)
    lp = lp.astype(compute)
    xl = jnp.asarray(input_lengths, jnp.int32).reshape(n)
    yl = jnp.asarray(target_lengths, jnp.int32).reshape(n)
    labels = jnp.asarray(targets).astype(jnp.int32)
    if not batched:
        y = labels.reshape(1, -1)
    elif labels.ndim == 1:
        y = _padded_targets(labels, yl, n)
    else:
        y = labels
    s_max = y.shape[1]
    width = 2 * s_max + 1
    pos = jnp.arange(width)
    # extended labels: blank at even positions, the targets at odd ones
    ext = jnp.where(pos % 2 == 0, blank, y[:, jnp.clip((pos - 1) // 2, 0, max(s_max - 1, 0))])
    # a label may be reached from two positions back when it differs from that one (skip)
    skip = (pos >= 2) & (pos % 2 == 1) & (ext != jnp.roll(ext, 2, axis=1))
    live = pos[None, :] < 2 * yl[:, None] + 1  # positions of each sequence's own labels
    emit = jnp.take_along_axis(lp, jnp.broadcast_to(ext[None], (t_max, n, width)), axis=2)
    log0 = jnp.asarray(_LOG0, compute)
    alpha0 = jnp.where((pos[None, :] < 2) & live, emit[0], log0)

    def step(alpha: jax.Array, inputs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        e, t = inputs
        prev1 = jnp.pad(alpha, ((0, 0), (1, 0)), constant_values=_LOG0)[:, :-1]
        prev2 = jnp.pad(alpha, ((0, 0), (2, 0)), constant_values=_LOG0)[:, :-2]
        merged = jnp.logaddexp(alpha, prev1)
        merged = jnp.where(skip, jnp.logaddexp(merged, prev2), merged)
        new = jnp.where(live, merged + e, log0)
        new = jnp.where((t < xl)[:, None], new, alpha)  # past its input: frozen
        return new, new

    last, alphas = jax.lax.scan(step, alpha0, (emit[1:], jnp.arange(1, t_max)))
    end = 2 * yl
    final = jnp.take_along_axis(last, end[:, None], axis=1)[:, 0]
    before = jnp.take_along_axis(last, jnp.maximum(end - 1, 0)[:, None], axis=1)[:, 0]
    ll = jnp.where(yl > 0, jnp.logaddexp(final, before), final)
    ll = jnp.where(xl > 0, ll, 0.0)  # no frames: only the empty target, with probability 1
    # an alignment needs a frame per label plus one between each pair of repeated labels
    same = (y[:, 1:] == y[:, :-1]) & (jnp.arange(1, s_max)[None, :] < yl[:, None])
    needed = yl + same.sum(axis=1)
    possible = xl >= needed
    nll = jnp.where(possible, -ll, jnp.inf)
    log_alpha = jnp.concatenate([alpha0[None], alphas], axis=0).transpose(1, 0, 2)
    log_alpha = jnp.where(log_alpha <= _LOG0 / 2, -jnp.inf, log_alpha)
    out_dtype = log_probs.dtype
    return nll.astype(out_dtype), log_alpha.astype(out_dtype)


def _shape_static_hf_ctc(
    logits: torch.Tensor,
    labels: torch.Tensor,
    logit_lengths: torch.Tensor,
    blank_token_id: int,
    reduction: str = "mean",
    zero_infinity: bool = False,
    ignore_index: int = -100,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' ``ForCTCLoss`` with padded targets instead of ``masked_select``'s.

    transformers flattens the kept labels (``labels.masked_select(mask)``: as many as the mask
    holds, a shape that depends on values). Here each row's kept labels move to its front, in
    order (a stable sort on the mask), and the ``[N, U]`` result goes to the same
    ``F.ctc_loss`` with the same lengths: the same loss, with a static shape.
    """
    labels = labels.to(logits.device)
    keep = (labels != ignore_index) & (labels != blank_token_id)
    order = torch.argsort((~keep).to(torch.int32), dim=-1, stable=True)
    targets = torch.gather(torch.where(keep, labels, blank_token_id), -1, order)
    log_probs = F.log_softmax(logits, dim=-1, dtype=torch.float32).transpose(0, 1)
    return F.ctc_loss(
        log_probs,
        targets,
        logit_lengths,
        keep.sum(-1),
        blank=blank_token_id,
        reduction=reduction,
        zero_infinity=zero_infinity,
    )


@contextlib.contextmanager
def hf_ctc_shape_static() -> Iterator[None]:
    """transformers' CTC loss (``Wav2Vec2ForCTC``, ``HubertForCTC``... ``labels=``) traced.

    Only when transformers' loss table is already imported (this never imports it).

    Example:
        >>> with hf_ctc_shape_static():
        ...     pass
    """
    table = getattr(sys.modules.get("transformers.loss.loss_utils"), "LOSS_MAPPING", None)
    if not isinstance(table, dict) or "ForCTC" not in table:
        yield
        return
    original = table["ForCTC"]
    table["ForCTC"] = _shape_static_hf_ctc
    try:
        yield
    finally:
        table["ForCTC"] = original
