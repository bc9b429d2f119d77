"""F.scaled_dot_product_attention and nn.MultiheadAttention in a traced torch module: one fused
``jax.nn.dot_product_attention`` call, equal to torch eager in values and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import NamedSharding, PartitionSpec
from torch import nn

import jaxcore
from jaxcore.models import attention
from torchshell.torch_model import torch_model_fns


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every ``jax.nn.dot_product_attention`` call made through jaxcore's ``attend``."""
    calls: list[str] = []
    real = jax.nn.dot_product_attention

    def counting(*args: object, **kwargs: object) -> jax.Array:
        calls.append(str(kwargs["implementation"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention.jax.nn, "dot_product_attention", counting)
    return calls


class Sdpa(nn.Module):
    """``F.scaled_dot_product_attention`` of the batch, with fixed keyword arguments."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, *mask, **self.kwargs)


def _jax(t: torch.Tensor) -> jax.Array:
    return jnp.asarray(t.float().numpy()).astype(str(t.dtype).removeprefix("torch."))


def _lowered(module: nn.Module, inputs: dict[str, torch.Tensor], train: bool = False):
    """The traced forward as ``f(params, batch) -> output`` and its params and batch."""
    fns = torch_model_fns(module, inputs=tuple(inputs))
    batch = {n: _jax(t) for n, t in inputs.items()}
    params, state = fns.init(jax.random.key(0), batch)

    def f(params: dict, batch: dict) -> jax.Array:
        return fns.apply(params, state, batch, jax.random.key(1), train)[0]

    return f, params, batch


def _weights(shape: tuple[int, ...]) -> torch.Tensor:
    """A fixed cotangent: loss = sum(out * w), so every output element weighs differently."""
    return torch.cos(torch.arange(int(np.prod(shape)), dtype=torch.float32)).reshape(shape)


def _sdpa_case(case: str) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    g = torch.Generator().manual_seed(0)
    heads_kv = 2 if case == "gqa" else 4
    s = 9 if case in ("cross", "causal_cross") else 6
    q = torch.randn(2, 4, 6, 8, generator=g)
    k, v = (torch.randn(2, heads_kv, s, 8, generator=g) for _ in range(2))
    inputs, kwargs = {"q": q, "k": k, "v": v}, {}
    if case == "bool_mask":
        mask = torch.rand(2, 1, 6, s, generator=g) > 0.4
        mask[0, 0, 2] = False  # a query with every key masked: torch gives 0
        inputs["mask"] = mask
    if case == "additive_mask":
        mask = torch.randn(2, 4, 6, s, generator=g)
        mask[1, :, :, 4:] = float("-inf")  # padding as -inf, as nn.MultiheadAttention makes
        mask[0, 1, 3] = float("-inf")  # every key of one query
        inputs["mask"] = mask
    if case == "padding_2d":
        inputs["mask"] = torch.arange(s)[None, :] < 4  # [L?, S] broadcast over batch and heads
    if case in ("causal", "causal_cross"):
        kwargs["is_causal"] = True
    if case == "scale":
        kwargs["scale"] = 0.25
    if case == "gqa":
        kwargs["enable_gqa"] = True
    return inputs, kwargs


SDPA_CASES = [
    "plain",
    "bool_mask",
    "additive_mask",
    "padding_2d",
    "causal",
    "causal_cross",
    "scale",
    "gqa",
    "cross",
]


@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa_values_and_input_grads_equal_torch(case: str, fused_calls: list[str]) -> None:
    inputs, kwargs = _sdpa_case(case)
    f, params, batch = _lowered(Sdpa(**kwargs), inputs)
    fused_calls.clear()
    out = f(params, batch)
    assert fused_calls == ["xla"]  # the fused call, not torchax's math reference
    leaves = {n: t.clone().requires_grad_(True) for n, t in inputs.items() if n != "mask"}
    ref = F.scaled_dot_product_attention(
        *leaves.values(), *([inputs["mask"]] if "mask" in inputs else []), **kwargs
    )
    np.testing.assert_allclose(np.asarray(out), ref.detach().numpy(), atol=1e-5)
    w = _weights(tuple(ref.shape))
    (ref * w).sum().backward()

    def loss(qkv: dict, batch: dict) -> jax.Array:
        return jnp.sum(f(params, {**batch, **qkv}) * _jax(w))

    grads = jax.grad(loss)({n: batch[n] for n in leaves}, batch)
    for name, t in leaves.items():
        np.testing.assert_allclose(np.asarray(grads[name]), t.grad.numpy(), atol=1e-5, err_msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_in_reduced_precision_stays_there_and_matches_torch(dtype: torch.dtype) -> None:
    inputs, kwargs = _sdpa_case("additive_mask")
    inputs = {n: t.to(dtype) for n, t in inputs.items()}
    f, params, batch = _lowered(Sdpa(**kwargs), inputs)
    out = f(params, batch)
    assert out.dtype == _jax(inputs["q"]).dtype
    ref = F.scaled_dot_product_attention(*inputs.values(), **kwargs)
    tol = 3e-2 if dtype == torch.bfloat16 else 4e-3
    np.testing.assert_allclose(np.asarray(out, np.float32), ref.float().numpy(), atol=tol)


def test_attention_dropout_takes_the_math_path_with_the_step_key(fused_calls: list[str]) -> None:
    """dropout_p > 0 has no fused form: torch's semantics on the math path (kept weights
    scaled by 1/(1-p), a fresh draw per key), checked on values of ones (each output is the
    sum of the row's kept, scaled probabilities: 1 on average)."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 4, 16, 8, generator=g), torch.randn(4, 4, 16, 8, generator=g)
    inputs = {"q": q, "k": k, "v": torch.ones(4, 4, 16, 1)}
    fns = torch_model_fns(Sdpa(dropout_p=0.5), inputs=("q", "k", "v"))
    batch = {n: _jax(t) for n, t in inputs.items()}
    params, state = fns.init(jax.random.key(0), batch)
    fused_calls.clear()
    a = fns.apply(params, state, batch, jax.random.key(1), True)[0]
    b = fns.apply(params, state, batch, jax.random.key(2), True)[0]
    assert fused_calls == []
    assert not np.allclose(a, b)
    assert abs(float(a.mean()) - 1.0) < 0.1 and bool(jnp.isfinite(a).all())


class Mha(nn.Module):
    """``nn.MultiheadAttention`` self-attention with the masks and flags under test."""

    def __init__(self, batch_first: bool, need_weights: bool, average: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mha = nn.MultiheadAttention(16, 4, batch_first=batch_first, bias=True)
        with torch.no_grad():
            self.mha.in_proj_bias.normal_()
            self.mha.out_proj.bias.normal_()
        self.need_weights, self.average = need_weights, average

    def forward(self, x: torch.Tensor, *masks: torch.Tensor):
        kpm = masks[0] if masks else None
        attn_mask = masks[1] if len(masks) > 1 else None
        out, weights = self.mha(
            x,
            x,
            x,
            key_padding_mask=kpm,
            attn_mask=attn_mask,
            need_weights=self.need_weights,
            average_attn_weights=self.average,
        )
        return (out, weights) if self.need_weights else out


MHA_CASES = [
    # (batch_first, need_weights, average, masks)
    (True, False, True, "kpm"),
    (False, False, True, "kpm"),
    (True, True, True, "kpm"),
    (False, True, False, "kpm"),
    (True, False, True, "kpm_float"),
    (True, False, True, "kpm_and_causal"),
    (True, True, True, "none"),
    (True, False, True, "kpm_row_all_padding"),
]


def _mha_inputs(batch_first: bool, masks: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 16, generator=g)
    inputs = {"x": x if batch_first else x.transpose(0, 1).contiguous()}
    kpm = torch.arange(7)[None, :] >= torch.tensor([7, 4, 2])[:, None]  # True: padding
    if masks == "kpm_row_all_padding":
        kpm[2] = True
    if masks.startswith("kpm"):
        inputs["kpm"] = kpm
    if masks in ("kpm_float", "kpm_and_causal"):  # a float attn_mask wants a float kpm
        inputs["kpm"] = torch.zeros(3, 7).masked_fill(kpm, float("-inf"))
    if masks == "kpm_and_causal":
        inputs["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(7)
    return inputs


@pytest.mark.parametrize(("batch_first", "need_weights", "average", "masks"), MHA_CASES)
def test_multihead_attention_values_and_param_grads_equal_torch(
    batch_first: bool, need_weights: bool, average: bool, masks: str, fused_calls: list[str]
) -> None:
    inputs = _mha_inputs(batch_first, masks)
    module = Mha(batch_first, need_weights, average)
    f, params, batch = _lowered(module, inputs)
    fused_calls.clear()
    out = f(params, batch)
    assert fused_calls == ["xla"]  # the output comes through the fused call
    ref = module(*inputs.values())
    refs = ref if need_weights else (ref,)
    outs = out if need_weights else (out,)
    if masks == "kpm_row_all_padding":  # torch: 0 from sdpa
        assert np.allclose(refs[0].detach().numpy()[2], module.mha.out_proj.bias.detach())
    for got, want in zip(outs, refs, strict=True):
        np.testing.assert_allclose(np.asarray(got), want.detach().numpy(), atol=1e-5)
    w = _weights(tuple(refs[0].shape))
    module.zero_grad()
    (refs[0] * w).sum().backward()
    grads = jax.grad(
        lambda p: jnp.sum((f(p, batch)[0] if need_weights else f(p, batch)) * _jax(w))
    )(params)
    for name, p in module.named_parameters():
        np.testing.assert_allclose(
            np.asarray(grads[name]), p.grad.numpy(), atol=1e-5, rtol=1e-4, err_msg=name
        )


def test_multihead_attention_with_every_key_padded_and_weights_gives_0_not_nan() -> None:
    """torch's need_weights=True path gives NaN for a row whose keys are all padding; its
    need_weights=False path (sdpa) gives 0, and the traced step gives that for both."""
    inputs = _mha_inputs(True, "kpm_row_all_padding")
    module = Mha(True, need_weights=True)
    f, params, batch = _lowered(module, inputs)
    out, _ = f(params, batch)
    assert torch.isnan(module(*inputs.values())[0][2]).all()  # torch eager
    module.need_weights = False
    np.testing.assert_allclose(
        np.asarray(out), module(*inputs.values()).detach().numpy(), atol=1e-5
    )


def test_transformer_encoder_layer_takes_the_fused_call(fused_calls: list[str]) -> None:
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    inputs = _mha_inputs(True, "kpm")
    f, params, batch = _lowered(EncoderWithPadding(layer), inputs)
    fused_calls.clear()
    out = f(params, batch)
    assert fused_calls == ["xla"]
    ref = EncoderWithPadding(layer)(*inputs.values())
    np.testing.assert_allclose(np.asarray(out), ref.detach().numpy(), atol=1e-5)


class EncoderWithPadding(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, kpm: torch.Tensor) -> torch.Tensor:
        return self.layer(x, src_key_padding_mask=kpm)


class PaddedAttentionClassifier(nn.Module):
    """Embedding + nn.MultiheadAttention over padded tokens + masked mean + head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.reshape(x.shape[0], 16, 4))
        a, _ = self.attn(h, h, h, key_padding_mask=pad)
        keep = (~pad)[..., None].to(a.dtype)
        return self.head((h + a).mul(keep).sum(1) / keep.sum(1))


def test_from_torch_multihead_attention_trains_step_for_step_with_torch_sgd(
    fused_calls: list[str],
) -> None:
    torch.manual_seed(0)
    net = PaddedAttentionClassifier()
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(5):
        lengths = torch.randint(3, 17, (8,), generator=g)
        batches.append(
            {
                "x": torch.randn(8, 64, generator=g),
                "pad": torch.arange(16)[None, :] >= lengths[:, None],
                "y": torch.randint(0, 10, (8,), generator=g),
            }
        )
    fns = torch_model_fns(net, inputs=("x", "pad"))
    mesh = jaxcore.make_mesh({"data": -1})
    sharding = NamedSharding(mesh, PartitionSpec("data"))

    def on_device(b: dict[str, torch.Tensor]) -> dict[str, jax.Array]:
        host = {"x": b["x"].numpy(), "pad": b["pad"].numpy(), "y": b["y"].numpy()}
        return jax.device_put({**host, "y": host["y"].astype(np.int32)}, sharding)

    tx = optax.sgd(0.1, momentum=0.9)
    state = jaxcore.init_train_state(fns, tx, on_device(batches[0]), seed=0, mesh=mesh)
    step = jaxcore.make_train_step(
        fns, jaxcore.softmax_cross_entropy, tx, state_sharding=jaxcore.state_shardings(state)
    )
    fused_calls.clear()
    jax_losses = []
    for b in batches:
        state, metrics = step(state, on_device(b))
        jax_losses.append(float(metrics["loss"]))
    assert fused_calls == ["xla"]  # traced once, through the fused call

    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net.train()
    torch_losses = []
    for b in batches:
        opt.zero_grad()
        loss = F.cross_entropy(net(b["x"], b["pad"]), b["y"])
        loss.backward()
        opt.step()
        torch_losses.append(loss.item())
    np.testing.assert_allclose(jax_losses, torch_losses, rtol=1e-5)
    for name, p in net.state_dict().items():
        np.testing.assert_allclose(
            np.asarray(state.params[name]), p.numpy(), rtol=1e-4, atol=1e-6, err_msg=name
        )


class Unmasked(nn.Module):
    """``nn.MultiheadAttention`` with no mask and no weights: self- or cross-attention, or a
    whole ``nn.TransformerEncoderLayer``."""

    def __init__(self, kind: str, bias: bool = True, batch_first: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.mha = nn.MultiheadAttention(16, 4, bias=bias, batch_first=batch_first)
        self.layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        if bias:
            with torch.no_grad():
                self.mha.in_proj_bias.normal_()
                self.mha.out_proj.bias.normal_()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.kind == "encoder_layer":
            return self.layer(x)
        kv = y if self.kind == "cross" else x
        return self.mha(x, kv, kv, need_weights=False)[0]


@pytest.mark.parametrize(
    ("kind", "bias", "batch_first"),
    [
        ("self", True, True),
        ("self", True, False),
        ("self", False, True),
        ("cross", True, True),
        ("encoder_layer", True, True),
    ],
)
def test_unmasked_attention_goes_straight_to_the_fused_call_and_equals_torch(
    kind: str,
    bias: bool,
    batch_first: bool,
    fused_calls: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torchshell.trace import _attention

    through_torch: list[int] = []
    real = _attention._F_MHA
    monkeypatch.setattr(_attention, "_F_MHA", lambda **kw: through_torch.append(1) or real(**kw))
    g = torch.Generator().manual_seed(2)
    inputs = {"x": torch.randn(3, 7, 16, generator=g), "y": torch.randn(3, 5, 16, generator=g)}
    module = Unmasked(kind, bias, batch_first)
    f, params, batch = _lowered(module, inputs, train=True)
    fused_calls.clear()
    out = f(params, batch)
    assert fused_calls == ["xla"] and through_torch == []  # torch's function not run
    ref = module(*inputs.values())
    np.testing.assert_allclose(np.asarray(out), ref.detach().numpy(), atol=1e-5)
    w = _weights(tuple(ref.shape))
    module.zero_grad()
    (ref * w).sum().backward()
    grads = jax.grad(lambda p: jnp.sum(f(p, batch) * _jax(w)))(params)
    for name, p in module.named_parameters():
        if p.grad is not None:
            np.testing.assert_allclose(
                np.asarray(grads[name]), p.grad.numpy(), atol=1e-5, rtol=1e-4, err_msg=name
            )


def test_unmasked_attention_in_the_users_autocast_region_takes_torchs_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside the user's own ``torch.autocast`` region the projections follow torch's cast
    policy (bf16 matmuls): torch's function runs there, not the direct float32 einsums."""
    from torchshell.trace import _attention

    through_torch: list[int] = []
    real = _attention._F_MHA
    monkeypatch.setattr(_attention, "_F_MHA", lambda **kw: through_torch.append(1) or real(**kw))

    class InAutocast(Unmasked):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return super().forward(x, y)

    g = torch.Generator().manual_seed(2)
    inputs = {"x": torch.randn(3, 7, 16, generator=g), "y": torch.randn(3, 5, 16, generator=g)}
    module = InAutocast("self")
    f, params, batch = _lowered(module, inputs)
    out = f(params, batch)
    ref = module(*inputs.values())
    assert through_torch and out.dtype == jnp.bfloat16 and ref.dtype == torch.bfloat16
    np.testing.assert_allclose(
        np.asarray(out.astype(jnp.float32)), ref.float().detach().numpy(), atol=5e-2
    )
