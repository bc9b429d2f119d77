"""torch ops run traced (torchax in coreshell's environment) against eager torch.

A sweep over ops models reach for (resampling, pooling, padding, sorting, special functions,
linear algebra, losses' building blocks, attention, STFT): one traced forward computes them
all, and each output must equal eager torch's. torchax falls back to torch's own
decompositions for ops it does not lower; one of those was wrong
(``multilabel_margin_loss``), silently. This keeps the others honest across upgrades.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from torchshell.torch_model import torch_model_fns


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "x4": torch.randn(2, 3, 7, 9, generator=g),
        "x3": torch.randn(2, 5, 11, generator=g),
        "v": torch.randn(4, 10, generator=g),
        "grid": torch.rand(2, 4, 5, 2, generator=g) * 2 - 1,
        "ps": torch.randn(1, 8, 3, 3, generator=g),
        "gn": torch.randn(2, 6, 5, generator=g),
        "wt": torch.randn(3, 2, 3, 3, generator=g),
        "c1": torch.randn(2, 4, 12, generator=g),
        "w1": torch.randn(6, 2, 3, generator=g),
        "sig": torch.randn(2, 400, generator=g),
        "cs": torch.randn(1, 6, 2, 2, generator=g),
        "q": torch.randn(1, 2, 5, 4, generator=g),
        "am": torch.rand(5, 5, generator=g) > 0.3,
        "theta": torch.tensor([[[0.9, 0.1, 0.0], [-0.1, 1.1, 0.2]]]),
        # mixture-of-experts rows by expert: [rows, K] x [experts, K, M], expert 1 empty
        "gm_rows": torch.randn(7, 8, generator=g),
        "gm_experts": torch.randn(3, 8, 8, generator=g),
        "gm_ends": torch.tensor([2, 2, 5], dtype=torch.int32),
    }


OPS: dict[str, Any] = {
    "interp_bilinear": lambda t: F.interpolate(
        t.x4, size=(10, 13), mode="bilinear", align_corners=False
    ),
    "interp_bilinear_ac": lambda t: F.interpolate(
        t.x4, scale_factor=1.7, mode="bilinear", align_corners=True
    ),
    "interp_bicubic": lambda t: F.interpolate(
        t.x4, size=(5, 6), mode="bicubic", align_corners=False
    ),
    "interp_nearest": lambda t: F.interpolate(t.x4, size=(10, 13), mode="nearest"),
    "interp_nearest_exact": lambda t: F.interpolate(t.x4, size=(10, 13), mode="nearest-exact"),
    "interp_area": lambda t: F.interpolate(t.x4, size=(3, 4), mode="area"),
    "interp_linear1d": lambda t: F.interpolate(t.x3, size=17, mode="linear"),
    "grid_sample": lambda t: F.grid_sample(t.x4, t.grid, align_corners=False),
    "pixel_shuffle": lambda t: F.pixel_shuffle(t.ps, 2),
    "unfold": lambda t: F.unfold(t.x4, 3, padding=1, stride=2),
    "avgpool_ceil": lambda t: F.avg_pool2d(
        t.x4, 3, stride=2, ceil_mode=True, count_include_pad=False
    ),
    "avgpool_pad": lambda t: F.avg_pool2d(t.x4, 3, stride=2, padding=1, count_include_pad=True),
    "maxpool_dil": lambda t: F.max_pool2d(t.x4, 3, stride=2, dilation=2, ceil_mode=True),
    "adaptive_avg": lambda t: F.adaptive_avg_pool2d(t.x4, (4, 5)),
    "lp_pool": lambda t: F.lp_pool2d(t.x4.abs(), 2, 2),
    "local_response_norm": lambda t: F.local_response_norm(t.x4, 2),
    "group_norm": lambda t: F.group_norm(t.gn, 3),
    "conv_transpose": lambda t: F.conv_transpose2d(
        t.x4, t.wt, stride=2, output_padding=1, padding=1
    ),
    "conv_groups_dil": lambda t: F.conv1d(t.c1, t.w1, groups=2, dilation=2, padding="same"),
    "pad_reflect": lambda t: F.pad(t.x4, (2, 1, 1, 2), mode="reflect"),
    "pad_replicate": lambda t: F.pad(t.x3, (3, 2), mode="replicate"),
    "pad_circular": lambda t: F.pad(t.x4, (2, 1, 1, 2), mode="circular"),
    "cumprod": lambda t: torch.cumprod(t.v, 1),
    "logcumsumexp": lambda t: torch.logcumsumexp(t.v, 1),
    "cummax": lambda t: torch.cummax(t.v, 1).values,
    "sort": lambda t: torch.sort(t.v, 1, descending=True).values,
    "argsort_stable": lambda t: torch.argsort(torch.round(t.v), dim=1, stable=True).float(),
    "topk": lambda t: torch.topk(t.v, 3, 1).values,
    "kthvalue": lambda t: torch.kthvalue(t.v, 3, 1).values,
    "median": lambda t: torch.median(t.v, 1).values,
    "quantile": lambda t: torch.quantile(t.v, 0.3, dim=1),
    "nanmean": lambda t: torch.nanmean(torch.where(t.v > 1, float("nan"), t.v), 1),
    "bucketize": lambda t: torch.bucketize(t.v, torch.tensor([-1.0, 0.0, 1.0])).float(),
    "renorm": lambda t: torch.renorm(t.v, 2, 0, 1.0),
    "normalize": lambda t: F.normalize(t.v, p=1, dim=1),
    "cdist": lambda t: torch.cdist(t.v, t.v.flip(0)),
    "pdist": lambda t: F.pdist(t.v),
    "erfinv": lambda t: torch.erfinv(torch.tanh(t.v) * 0.9),
    "digamma": lambda t: torch.digamma(t.v.abs() + 0.5),
    "lgamma": lambda t: torch.lgamma(t.v.abs() + 0.5),
    "i0": lambda t: torch.special.i0(t.v),
    "xlogy": lambda t: torch.xlogy(t.v.abs(), t.v.abs() + 1),
    "atan2": lambda t: torch.atan2(t.v, t.v.flip(1)),
    "fmod": lambda t: torch.fmod(t.v * 3, 1.3),
    "remainder": lambda t: torch.remainder(t.v * 3, 1.3),
    "floor_divide": lambda t: torch.floor_divide(t.v * 3, 1.3),
    "div_trunc": lambda t: torch.div(t.v * 3, 1.3, rounding_mode="trunc"),
    "round_dec": lambda t: torch.round(t.v, decimals=1),
    "histc": lambda t: torch.histc(t.v, bins=5, min=-2, max=2),
    "diff": lambda t: torch.diff(t.v, n=2, dim=1),
    "tril_diag": lambda t: torch.tril(t.v[:, :4].reshape(2, 2, 4).repeat(1, 2, 1), diagonal=-1),
    "diag_embed": lambda t: torch.diag_embed(t.v[:, :3], offset=1),
    "cross": lambda t: torch.linalg.cross(t.v[:, :3], t.v[:, 3:6]),
    "logdet": lambda t: torch.logdet(t.v[:, :4].T @ t.v[:, :4] + torch.eye(4)),
    "solve": lambda t: torch.linalg.solve(t.v[:, :4] + 4 * torch.eye(4), t.v[:, 4:6]),
    "inv": lambda t: torch.linalg.inv(t.v[:, :4] + 4 * torch.eye(4)),
    "cholesky": lambda t: torch.linalg.cholesky(t.v[:, :4].T @ t.v[:, :4] + torch.eye(4)),
    "qr_r": lambda t: torch.linalg.qr(t.v).R.abs(),
    "svdvals": lambda t: torch.linalg.svdvals(t.v),
    "matrix_norm": lambda t: torch.linalg.matrix_norm(t.v, "nuc"),
    "vector_norm_inf": lambda t: torch.linalg.vector_norm(t.v, float("inf"), dim=1),
    "std_unbiased": lambda t: torch.std(t.v, 1, correction=1),
    "var_mean": lambda t: torch.var_mean(t.v, 1, correction=0)[0],
    "logsumexp": lambda t: torch.logsumexp(t.v, 1),
    "softmin": lambda t: F.softmin(t.v, 1),
    "glu": lambda t: F.glu(t.v, 1),
    "hardtanh": lambda t: F.hardtanh(t.v, -0.5, 0.7),
    "celu": lambda t: F.celu(t.v, 0.7),
    "softplus_beta": lambda t: F.softplus(t.v, beta=2, threshold=1),
    "mish": lambda t: F.mish(t.v),
    "gelu_tanh": lambda t: F.gelu(t.v, approximate="tanh"),
    "threshold": lambda t: F.threshold(t.v, 0.1, 20),
    "one_hot": lambda t: F.one_hot(torch.tensor([0, 3, 1]), 5).float(),
    "scatter_reduce_amax": lambda t: torch.zeros(4, 3).scatter_reduce(
        0, torch.tensor([[0, 1, 2], [0, 1, 3]]), t.v[:2, :3], "amax", include_self=False
    ),
    "index_add": lambda t: torch.zeros(5, 10).index_add(0, torch.tensor([0, 2, 2, 4]), t.v),
    "masked_fill": lambda t: t.v.masked_fill(t.v > 0.5, -1.0),
    "where_scalar": lambda t: torch.where(t.v > 0, t.v, 0.0),
    "clamp_tensor": lambda t: torch.clamp(t.v, min=t.v.flip(0) * 0.1, max=t.v.abs() + 0.2),
    "stft_mag": lambda t: torch.stft(
        t.sig, 64, 16, window=torch.hann_window(64), return_complex=True
    ).abs(),
    "fft_rfft": lambda t: torch.fft.rfft(t.v, dim=1).abs(),
    "einsum": lambda t: torch.einsum("bi,bj->bij", t.v[:, :3], t.v[:, 3:6]),
    "bmm_baddbmm": lambda t: torch.baddbmm(
        torch.ones(2, 2, 2),
        t.v[:2, :6].reshape(2, 2, 3),
        t.v[2:, :6].reshape(2, 3, 2),
        beta=0.5,
        alpha=2,
    ),
    "addcmul": lambda t: torch.addcmul(t.v, t.v, t.v.flip(1), value=0.3),
    "lerp": lambda t: torch.lerp(t.v, t.v.flip(1), 0.3),
    "hypot": lambda t: torch.hypot(t.v, t.v.flip(0)),
    "logaddexp": lambda t: torch.logaddexp(t.v, t.v.flip(1)),
    "sinc": lambda t: torch.sinc(t.v),
    "nan_to_num": lambda t: torch.nan_to_num(torch.log(t.v), nan=0.0, neginf=-5.0),
    "count_nonzero": lambda t: torch.count_nonzero(t.v > 0, dim=1).float(),
    "affine_grid": lambda t: F.affine_grid(t.theta, (1, 1, 4, 5), align_corners=False),
    "channel_shuffle": lambda t: F.channel_shuffle(t.cs, 3),
    "cosine_similarity": lambda t: F.cosine_similarity(t.v, t.v.flip(0), dim=1),
    "pairwise_distance": lambda t: F.pairwise_distance(t.v, t.v.flip(0), p=3),
    "dropout_eval": lambda t: F.dropout(t.v, 0.5, training=False),
    "alpha_dropout_eval": lambda t: F.alpha_dropout(t.v, 0.5, training=False),
    # rows past the last group's end: unset in torch's kernel, so not compared
    "grouped_mm": lambda t: torch._grouped_mm(t.gm_rows, t.gm_experts, offs=t.gm_ends)[:5],
    "sdpa_causal": lambda t: F.scaled_dot_product_attention(
        t.q, t.q * 0.5, t.q.flip(-1), is_causal=True
    ),
    "sdpa_mask_scale": lambda t: F.scaled_dot_product_attention(
        t.q, t.q * 0.5, t.q.flip(-1), attn_mask=t.am, scale=0.3
    ),
}


class _AllOps(nn.Module):
    def forward(self, *tensors: torch.Tensor) -> dict[str, torch.Tensor]:
        t = SimpleNamespace(**dict(zip(_inputs(), tensors, strict=True)))
        return {name: op(t) for name, op in OPS.items()}


def test_torch_ops_traced_equal_eager() -> None:
    inputs = _inputs()
    want = _AllOps()(*inputs.values())
    fns = torch_model_fns(_AllOps(), tuple(inputs))
    batch = {k: jnp.asarray(v.numpy()) for k, v in inputs.items()}
    params, state = {}, {}  # (the module has no weights: init, which runs it, is not needed)
    apply = jax.jit(lambda p, s, b: fns.apply(p, s, b, train=False, rng=jax.random.key(0)))
    got, _ = apply(params, state, batch)
    wrong = []
    for name, w in want.items():
        g = np.asarray(got[name], np.float64)
        w_ = w.detach().double().numpy()
        if g.shape != w_.shape or not np.allclose(g, w_, rtol=1e-4, atol=1e-4, equal_nan=True):
            wrong.append(name)
    assert not wrong, f"traced != eager for {wrong}"


# Inputs on the kinks: 0, +-1, +-3, 6 and the bounds used below (-0.5, 0.7) exactly.
_KINK_X = [-7.0, -3.0, -1.0, -0.5, 0.0, 0.5, 0.7, 1.0, 3.0, 6.0, 7.0, 0.0]

KINK_OPS: dict[str, Any] = {
    # torch's hardtanh_backward: strictly inside (min, max); relu6 is hardtanh(0, 6)
    "relu6": lambda x, lo, hi: F.relu6(x),
    "hardtanh": lambda x, lo, hi: F.hardtanh(x),
    "hardtanh_bounds": lambda x, lo, hi: F.hardtanh(x, -0.5, 0.7),
    # clamp_backward: the closed interval; the bounds' gradient where they are the result
    "clamp": lambda x, lo, hi: torch.clamp(x, -1.0, 6.0),
    "clamp_min": lambda x, lo, hi: torch.clamp(x, min=0.0),
    "clamp_max": lambda x, lo, hi: torch.clamp(x, max=6.0),
    "clamp_tensors": lambda x, lo, hi: torch.clamp(x, lo, hi),
    "clamp_min_tensor": lambda x, lo, hi: torch.clamp_min(x, lo),
    "clamp_max_tensor": lambda x, lo, hi: torch.clamp_max(x, hi),
    "clamp_crossed": lambda x, lo, hi: torch.clamp(x, hi, lo),  # min > max: the result is max
    "hardsigmoid": lambda x, lo, hi: F.hardsigmoid(x),
    "hardswish": lambda x, lo, hi: F.hardswish(x),
    "leaky_relu": lambda x, lo, hi: F.leaky_relu(x, 0.1),
    "abs": lambda x, lo, hi: x.abs(),
    "l1_loss": lambda x, lo, hi: F.l1_loss(x, lo, reduction="none"),
    "logsigmoid": lambda x, lo, hi: F.logsigmoid(x),
    "margin_ranking": lambda x, lo, hi: F.margin_ranking_loss(
        x, lo, torch.ones_like(x), margin=1.0, reduction="none"
    ),
    "sqrt_of_clamp": lambda x, lo, hi: torch.sqrt(x.clamp(min=0.0)),
    "relu": lambda x, lo, hi: F.relu(x),
    "threshold": lambda x, lo, hi: F.threshold(x, 0.5, -2.0),
}


class _KinkOp(nn.Module):
    def __init__(self, op: Any) -> None:
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        return self.op(x, lo, hi)


def test_gradients_at_kinks_equal_torch() -> None:
    """Each op's gradient (inputs and tensor bounds) with inputs exactly on its kinks, traced
    against torch autograd: torchax's ``jnp.clip`` gave 1/2 on a bound where torch gives 0
    (hardtanh, relu6: MobileNetV2's eval-mode BatchNorm feeds its ReLU6s exact zeros) or 1
    (clamp), JAX's ``abs`` 1 at 0 where torch's ``sgn`` gives 0."""
    x = torch.tensor([_KINK_X])
    lo = torch.zeros_like(x)  # on x's zeros
    hi = torch.full_like(x, 6.0)  # on x's 6
    hi[0, 2] = -1.0  # one bound crossed (max < min), on x's -1
    cot = torch.linspace(0.5, 1.5, x.numel()).reshape(x.shape)
    batch = {k: jnp.asarray(v.numpy()) for k, v in {"x": x, "lo": lo, "hi": hi}.items()}
    wrong = []
    for name, op in KINK_OPS.items():
        leaves = [t.clone().requires_grad_(True) for t in (x, lo, hi)]
        out = op(*leaves)
        want = torch.autograd.grad((out * cot).sum(), leaves, allow_unused=True)
        fns = torch_model_fns(_KinkOp(op), ("x", "lo", "hi"))

        def run(b: dict[str, jax.Array], fns: Any = fns) -> jax.Array:
            return fns.apply({}, {}, b, jax.random.key(0), True)[0]

        got, vjp = jax.vjp(run, batch)
        (grads,) = vjp(jnp.asarray(cot.numpy()))
        if not np.allclose(np.asarray(got), out.detach().numpy(), rtol=1e-6, atol=1e-6):
            wrong.append(f"{name} (forward)")
        for key, w in zip(("x", "lo", "hi"), want, strict=True):
            w_ = np.zeros(x.shape) if w is None else w.numpy()
            if not np.allclose(np.asarray(grads[key]), w_, rtol=1e-6, atol=1e-7):
                wrong.append(f"{name} (d/d{key}: {np.asarray(grads[key])} != {w_})")
    assert not wrong, "traced gradient != torch's at the kinks:\n" + "\n".join(wrong)


# In-place ops on a slice of a tensor (torchvision's Swin V2: ``bias[C:2*C].zero_()``).
SLICE_OPS: dict[str, Any] = {
    "zero_": lambda v: v.zero_(),
    "fill_": lambda v: v.fill_(0.5),
    "fill_tensor": lambda v: v.fill_(torch.tensor(0.5)),
    "masked_fill_": lambda v: v.masked_fill_(v > 3.5, 0.0),
    "index_fill_": lambda v: v.index_fill_(0, torch.tensor([0]), 0.0),
    "addcmul_": lambda v: v.addcmul_(torch.ones(2), torch.full((2,), 3.0), value=0.5),
    "addcdiv_": lambda v: v.addcdiv_(torch.ones(2), torch.full((2,), 3.0), value=0.5),
    "lerp_": lambda v: v.lerp_(torch.zeros(2), 0.5),
    "hardtanh_": lambda v: F.hardtanh_(v, 0.0, 3.5),
    "hardsigmoid_": lambda v: F.hardsigmoid(v, inplace=True),
    "silu_": lambda v: F.silu(v, inplace=True),
    "mul_": lambda v: v.mul_(2.0),  # (written through before too: torchax's own)
    "copy_": lambda v: v.copy_(torch.zeros(2)),
    "nested_slice": lambda v: v[1:].zero_(),
    # in-place ops torchax has no lowering for (the trace stopped, slice or not)
    "exp_": lambda v: v.exp_(),
    "neg_": lambda v: v.neg_(),
    "abs_": lambda v: v.sub_(3.5).abs_(),
    "log_": lambda v: v.log_(),
    "floor_": lambda v: v.div_(3).floor_(),
    "round_": lambda v: v.div_(3).round_(),
    "trunc_": lambda v: v.div_(-3).trunc_(),
    "sign_": lambda v: v.sub_(3.5).sign_(),
    "rsqrt_": lambda v: v.rsqrt_(),
    "reciprocal_": lambda v: v.reciprocal_(),
    "clamp_max_": lambda v: v.clamp_max_(3.5),
}


class _SliceWrite(nn.Module):
    def __init__(self, op: Any, whole: bool) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.arange(1.0, 7.0))
        self.op, self.whole = op, whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.b.clone()
        self.op(b if self.whole else b[2:4])
        return x * b


def test_in_place_ops_on_a_slice_write_through() -> None:
    """An in-place op on ``t[2:4]`` changes ``t`` (forward) and cuts or scales the gradient
    to the overwritten entries, as in torch. torchax ran ``zero_``, ``fill_``,
    ``masked_fill_``... by torch's decomposition on a copy of the slice and dropped the write;
    ``exp_``, ``neg_``, ``log_``... it did not lower at all (on a slice or a whole tensor)."""
    x = torch.linspace(0.5, 1.5, 6)
    wrong = []
    for (name, op), whole in itertools.product(SLICE_OPS.items(), (False, True)):
        if whole and name in ("lerp_", "addcmul_", "addcdiv_", "copy_", "nested_slice"):
            continue  # (their operands are slice-shaped)
        name += " (whole tensor)" if whole else ""
        net = _SliceWrite(op, whole)
        want = net(x)
        want.sum().backward()
        fns = torch_model_fns(net, ("x",))
        batch = {"x": jnp.asarray(x.numpy())}
        params, state = fns.init(jax.random.key(0), batch)

        def loss(p: dict, fns: Any = fns, state: Any = state, batch: Any = batch) -> jax.Array:
            out = fns.apply(p, state, batch, jax.random.key(0), True)[0]
            return out.sum(), out

        (_, got), grads = jax.value_and_grad(loss, has_aux=True)(params)
        if not np.allclose(np.asarray(got), want.detach().numpy(), rtol=1e-6):
            wrong.append(f"{name}: forward {np.asarray(got)} != {want.detach().numpy()}")
        if not np.allclose(np.asarray(grads["b"]), net.b.grad.numpy(), rtol=1e-6):
            wrong.append(f"{name}: gradient {np.asarray(grads['b'])} != {net.b.grad.numpy()}")
    assert not wrong, "\n".join(wrong)


# Norms with a zero vector among the rows (a padded row; a point's distance to itself).
NORM_OPS: dict[str, Any] = {
    "normalize": lambda a, b: F.normalize(a, dim=-1),
    "norm": lambda a, b: a.norm(dim=-1),
    "norm_keepdim_all": lambda a, b: a.norm(dim=(0, 1), keepdim=True) * a,
    **{
        f"vector_norm_{p}": lambda a, b, p=p: torch.linalg.vector_norm(a, p, dim=-1)
        for p in (0, 0.5, 1, 1.5, 3, float("inf"), float("-inf"))
    },
    "dist": lambda a, b: torch.dist(a[1], b[0]) + torch.dist(a[0], a[0] * 2),
    "cdist": lambda a, b: torch.cdist(a, torch.cat([a, b])),
    "cdist_p1": lambda a, b: torch.cdist(a, b, p=1.0),
    "cdist_mm": lambda a, b: torch.cdist(a, b, compute_mode="use_mm_for_euclid_dist"),
    "cdist_many": lambda a, b: torch.cdist(a.repeat(9, 1), b.repeat(9, 1)),  # 27 rows: mm
    "pdist": lambda a, b: F.pdist(torch.cat([a, a])),
    "std": lambda a, b: torch.std(a, -1),
    "std_mean": lambda a, b: torch.std_mean(a, -1, correction=0)[0],
    "cosine_similarity": lambda a, b: F.cosine_similarity(a, b, dim=-1),
}


class _NormOp(nn.Module):
    def __init__(self, op: Any) -> None:
        super().__init__()
        self.op = op

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.op(a, b)


def test_norm_gradients_at_a_zero_vector_equal_torch() -> None:
    """Norms, distances and ``std`` over rows one of which is zero (and one with ties):
    torch's gradient there is 0, torchax's ``sqrt(sum(x**2))`` gave NaN (every weight NaN
    after one step of a net that ``F.normalize``s a padded row)."""
    a = torch.tensor([[0.0, 0.0, 0.0], [0.6, -0.8, 0.0], [1.5, -1.5, 0.2]])
    b = torch.tensor([[0.6, -0.8, 0.0], [0.1, 0.2, -0.3], [0.0, 0.0, 0.0]])
    batch = {"a": jnp.asarray(a.numpy()), "b": jnp.asarray(b.numpy())}
    wrong = []
    for name, op in NORM_OPS.items():
        leaves = [t.clone().requires_grad_(True) for t in (a, b)]
        out = op(*leaves)
        cot = torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)
        want = torch.autograd.grad((out * cot).sum(), leaves, allow_unused=True)
        fns = torch_model_fns(_NormOp(op), ("a", "b"))

        def run(b_: dict[str, jax.Array], fns: Any = fns) -> jax.Array:
            return fns.apply({}, {}, b_, jax.random.key(0), True)[0]

        got, vjp = jax.vjp(run, batch)
        (grads,) = vjp(jnp.asarray(cot.numpy()))
        if not np.allclose(np.asarray(got), out.detach().numpy(), rtol=1e-5, atol=1e-6):
            wrong.append(f"{name} (forward: {np.asarray(got)} != {out.detach().numpy()})")
        for key, w in zip(("a", "b"), want, strict=True):
            w_ = np.zeros(a.shape) if w is None else w.numpy()
            if not np.allclose(np.asarray(grads[key]), w_, rtol=1e-5, atol=1e-6):
                wrong.append(f"{name} (d/d{key}: {np.asarray(grads[key])} != {w_})")
    assert not wrong, "traced != torch at a zero vector:\n" + "\n".join(wrong)
