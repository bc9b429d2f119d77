"""``torchaudio.functional.rnnt_loss`` in a traced step: torchaudio's RNN-T kernel in JAX.

torchax 0.0.13 has no lowering for ``torchaudio::rnnt_loss_forward``, the kernel under
``torchaudio.functional.rnnt_loss`` and ``torchaudio.transforms.RNNTLoss`` (the loss of
transducer speech models: torchaudio's Emformer RNN-T, conformer transducers). The kernel
returns each sequence's cost and its gradient with respect to the logits, which torchaudio's
``autograd.Function`` multiplies by the incoming gradient in its backward.

:func:`rnnt_loss_forward` is that kernel. The forward variable ``alpha(t, u)`` (log
probability of having emitted ``u`` labels after ``t`` frames) is a log-space dynamic
program over the ``[T, U + 1]`` lattice; every cell of one anti-diagonal ``t + u = n``
depends only on the previous anti-diagonal, so it is one ``lax.scan`` over the ``T + U``
diagonals, vectorised over the batch and the target positions. Each sequence reads its cost
at its own last frame and label (``logit_lengths``, ``target_lengths``); cells past them are
masked and get a zero gradient.

The gradient is JAX's own derivative of that program (through the log-softmax when
``fused_log_softmax=True``), computed in the forward as torchaudio's kernel does and handed
back by a ``jax.custom_vjp``: so ``clamp > 0`` clips each element of it to
``[-clamp, clamp]`` before the incoming gradient scales it, as torchaudio does. torchaudio's
value checks (``logits.shape[1] == max(logit_lengths)``, ``logits.shape[2] ==
max(target_lengths) + 1``, labels in range) need the values: inside the compiled step they
are not made.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["rnnt_costs", "rnnt_loss_forward"]

_LOG0 = -1e30  # log(0) inside the recursion: finite, so gradients stay finite


@functools.partial(jax.jit, static_argnums=(4, 5))  # one compiled kernel, eager or traced
def _neg_log_likelihood(
    logits: jax.Array,
    targets: jax.Array,
    logit_lengths: jax.Array,
    target_lengths: jax.Array,
    blank: int,
    fused_log_softmax: bool,
) -> jax.Array:
    """Each sequence's ``-log P(targets | logits)``: the alpha recursion over anti-diagonals.

    ``logits [B, T, U + 1, D]`` (float32), ``targets [B, U]``, lengths ``[B]`` -> ``[B]``.
    """
    _, t_max, u1, _ = logits.shape
    lp = jax.nn.log_softmax(logits, axis=-1) if fused_log_softmax else logits
    labels = jnp.pad(targets, ((0, 0), (0, 1)), constant_values=blank)[:, :u1]  # [B, U + 1]
    emit_blank = lp[..., blank]  # [B, T, U + 1]: (t, u) -> (t + 1, u)
    emit_label = jnp.take_along_axis(lp, labels[:, None, :, None], axis=-1)[..., 0]  # -> (t, u+1)
    # skewed: [n, B, u] holds the cell (t = n - u, u) of anti-diagonal n
    n_diag = t_max + u1 - 1
    u = jnp.arange(u1)
    t_of = jnp.arange(n_diag)[:, None] - u[None, :]  # [n, u]
    skew_blank, skew_label = _skewed(emit_blank), _skewed(emit_label)  # [n, B, u]
    xl = logit_lengths.astype(jnp.int32)[:, None]
    yl = target_lengths.astype(jnp.int32)[:, None]
    # a cell is live when its frame and its label count are within the sequence's own
    live = (t_of[:, None, :] >= 0) & (t_of[:, None, :] < xl[None]) & (u[None, None, :] <= yl[None])
    last = (xl + yl - 1)[:, 0]  # the diagonal of the last cell, (T_b - 1, U_b)
    log0 = jnp.asarray(_LOG0, lp.dtype)

    def cost_at(alpha: jax.Array, blank_n: jax.Array) -> jax.Array:
        """alpha + the final blank at each sequence's last label position."""
        return jnp.take_along_axis(alpha + blank_n, yl, axis=1)[:, 0]

    alpha0 = jnp.where(live[0], jnp.where(u == 0, 0.0, log0)[None, :], log0).astype(lp.dtype)
    final0 = jnp.where(last == 0, cost_at(alpha0, skew_blank[0]), log0)

    def step(
        carry: tuple[jax.Array, jax.Array], inputs: tuple[jax.Array, ...]
    ) -> tuple[tuple[jax.Array, jax.Array], None]:
        alpha, final = carry
        blank_prev, label_prev, blank_n, live_n, n = inputs
        below = alpha + blank_prev  # (t - 1, u) -> (t, u)
        left = jnp.pad(alpha + label_prev, ((0, 0), (1, 0)), constant_values=_LOG0)[:, :-1]
        new = jnp.where(live_n, jnp.logaddexp(below, left), log0)
        final = jnp.where(last == n, cost_at(new, blank_n), final)
        return (new, final), None

    xs = (skew_blank[:-1], skew_label[:-1], skew_blank[1:], live[1:], jnp.arange(1, n_diag))
    (_, final), _ = jax.lax.scan(step, (alpha0, final0), xs)
    return -final


def _skewed(x: jax.Array) -> jax.Array:
    """``[B, T, U1] -> [T + U1 - 1, B, U1]``, ``out[n, :, u] = x[:, n - u, u]`` (pad values
    where ``n - u`` is outside ``[0, T)``: masked by the caller).

    Pads and reshapes, no gather: row ``u`` of ``x[b].T``, padded to width ``W = T + U1``
    and read with a row width of ``W - 1``, starts ``u`` places later.
    """
    b, t_max, u1 = x.shape
    rows = jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, u1)))  # [B, U1, W]
    width = t_max + u1 - 1
    flat = rows.reshape(b, -1)[:, : u1 * width]
    return jnp.moveaxis(flat.reshape(b, u1, width), 2, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _kernel(
    logits: jax.Array,
    targets: jax.Array,
    logit_lengths: jax.Array,
    target_lengths: jax.Array,
    blank: int,
    clamp: float,
    fused_log_softmax: bool,
) -> tuple[jax.Array, jax.Array]:
    """torchaudio's kernel: ``(costs [B], gradient [B, T, U + 1, D])``; the costs
    differentiate to the gradient times the incoming one, the gradient output does not
    differentiate (torchaudio only saves it). Under ``jit`` an unused gradient is dropped."""
    return _costs_and_grads(
        logits, targets, logit_lengths, target_lengths, blank, clamp, fused_log_softmax
    )


def _costs_and_grads(
    logits: jax.Array,
    targets: jax.Array,
    logit_lengths: jax.Array,
    target_lengths: jax.Array,
    blank: int,
    clamp: float,
    fused_log_softmax: bool,
) -> tuple[jax.Array, jax.Array]:
    """Costs ``[B]`` and torchaudio's per-element gradient ``[B, T, U + 1, D]``."""
    compute = jnp.promote_types(logits.dtype, jnp.float32)

    def nll(x: jax.Array) -> jax.Array:
        return _neg_log_likelihood(
            x.astype(compute),
            jnp.asarray(targets).astype(jnp.int32),
            jnp.asarray(logit_lengths),
            jnp.asarray(target_lengths),
            blank,
            fused_log_softmax,
        )

    costs, pullback = jax.vjp(nll, logits)
    (grads,) = pullback(jnp.ones_like(costs))  # sequences are independent: each its own
    if clamp > 0:
        grads = jnp.clip(grads, -clamp, clamp)
    return costs.astype(logits.dtype), grads.astype(logits.dtype)


def _costs_fwd(
    logits: jax.Array,
    targets: jax.Array,
    logit_lengths: jax.Array,
    target_lengths: jax.Array,
    blank: int,
    clamp: float,
    fused_log_softmax: bool,
) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    costs, grads = _costs_and_grads(
        logits, targets, logit_lengths, target_lengths, blank, clamp, fused_log_softmax
    )
    return (costs, grads), grads


def _costs_bwd(
    blank: int,
    clamp: float,
    fused_log_softmax: bool,
    grads: jax.Array,
    cotangents: tuple[jax.Array, jax.Array],
) -> tuple[jax.Array, None, None, None]:
    del blank, clamp, fused_log_softmax
    d_costs = cotangents[0]  # (the gradient output's own cotangent: not differentiated)
    return grads * d_costs[:, None, None, None].astype(grads.dtype), None, None, None


_kernel.defvjp(_costs_fwd, _costs_bwd)


def rnnt_costs(
    logits: jax.Array,
    targets: jax.Array,
    logit_lengths: jax.Array,
    target_lengths: jax.Array,
    blank: int,
    clamp: float,
    fused_log_softmax: bool,
) -> jax.Array:
    """Each sequence's RNN-T cost, differentiable with torchaudio's gradient.

    Args:
        logits: ``[B, T, U + 1, D]`` joiner outputs (log-probabilities when
            ``fused_log_softmax=False``).
        targets: ``[B, U]`` labels, padded.
        logit_lengths: ``[B]`` frames per sequence.
        target_lengths: ``[B]`` labels per sequence.
        blank: the blank label (``0 <= blank < D``).
        clamp: when ``> 0``, each element of the gradient is clipped to ``[-clamp, clamp]``.
        fused_log_softmax: whether the log-softmax over ``D`` is taken here.

    Returns:
        ``[B]`` costs (``-log P(targets | logits)``), in the logits' dtype.

    Example:
        >>> import torch, torchaudio.functional as AF, warnings
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.randn(2, 6, 4, 5, generator=g)
        >>> y = torch.tensor([[1, 2, 3], [4, 4, 0]], dtype=torch.int32)
        >>> xl = torch.tensor([6, 4], dtype=torch.int32)  # frames per sequence
        >>> yl = torch.tensor([3, 2], dtype=torch.int32)  # labels per sequence
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")  # torchaudio's deprecation note
        ...     ref = AF.rnnt_loss(x, y, xl, yl, blank=0, reduction="none")
        >>> j = lambda t: jnp.asarray(t.numpy())
        >>> got = rnnt_costs(j(x), j(y), j(xl), j(yl), 0, -1.0, True)
        >>> bool(jnp.allclose(got, j(ref), rtol=1e-5))
        True
    """
    costs, _ = _kernel(
        logits, targets, logit_lengths, target_lengths, blank, clamp, fused_log_softmax
    )
    return costs


def rnnt_loss_forward(
    logits: jax.Array,
    targets: jax.Array,
    logit_lengths: jax.Array,
    target_lengths: jax.Array,
    blank: int,
    clamp: float,
    fused_log_softmax: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """``torchaudio::rnnt_loss_forward``: the costs ``[B]`` and their gradient (the kernel's
    second output, which torchaudio's backward reads; here JAX differentiates the costs).

    Example:
        >>> x = jnp.zeros((1, 2, 2, 3))
        >>> costs, grads = rnnt_loss_forward(
        ...     x, jnp.array([[1]]), jnp.array([2]), jnp.array([1]), 0, -1.0)
        >>> round(float(costs[0]), 4)  # 2 paths, each of probability (1/3)**3: -log(2/27)
        2.6027
        >>> grads.shape
        (1, 2, 2, 3)
    """
    return _kernel(
        logits,
        targets,
        logit_lengths,
        target_lengths,
        int(blank),
        float(clamp),
        bool(fused_log_softmax),
    )
