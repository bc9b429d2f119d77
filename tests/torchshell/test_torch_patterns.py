"""The PyTorch patterns torchax alone refuses, traced (torchshell/_torch_patterns.py).

Each test runs the real module through ``torch_model_fns`` and the jaxcore train step (or
the traced apply) and checks the outcome against torch itself.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import lightning as L
import numpy as np
import optax
import pytest
import torch
import torchaudio
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import jaxcore
from tests.helpers import assert_fit_like_plain, fit_plain_and_ported, quiet_trainer
from tests.zoo.harness import sgd_parity
from torchshell._errors import TorchModelError
from torchshell.torch_model import STATIC_KEY, specialise_batch, torch_model_fns


def _seq_batches(n: int, t: int = 8) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randint(0, 50, (2, t), generator=g)
        out.append({"x": x, "t": x.roll(-1, 1), "y": x.roll(-1, 1)})
    return out


# -- values that do not depend on the batch are concrete ----------------------------------
def test_lightning_demo_transformer_mask_detection_traces_and_matches_torch_sgd():
    from lightning.pytorch.demos import Transformer

    # its decoder runs _detect_is_causal_mask: torch.equal(mask built from shapes, mask)
    torch.manual_seed(0)
    net = Transformer(vocab_size=50, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.0)
    p = sgd_parity(net, _seq_batches(3), ("x", "t"), "ce")
    assert p.max_rel <= 1e-4
    np.testing.assert_allclose(p.jax_losses, p.torch_losses, rtol=1e-4)
    assert net.src_mask is None  # no traced tensor cached on the module


def test_torch_equal_of_masks_from_shapes_is_a_python_bool_at_trace_time():
    class Detect(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = x.shape[1]
            mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
            same = torch.equal(mask, nn.Transformer.generate_square_subsequent_mask(t))
            assert same is True  # a real Python bool, computed while tracing
            return self.lin(x) * (2.0 if same else 1.0)

    net = Detect()
    fns = torch_model_fns(net, example={"x": torch.ones(2, 3, 4)})
    assert not fns.apply.torch_static.needed(True)  # nothing to specialise per batch
    params, state = fns.init(jax.random.key(0), {"x": jnp.ones((2, 3, 4))})
    out = jax.jit(fns.apply, static_argnums=4)(
        params, state, {"x": jnp.ones((2, 3, 4))}, jax.random.key(0), True
    )[0]
    with torch.no_grad():
        np.testing.assert_allclose(np.asarray(out), net(torch.ones(2, 3, 4)).numpy(), rtol=1e-6)


def _all_consts(closed: Any) -> list[Any]:
    """The constants of a closed jaxpr and of every jaxpr inside it (jit, cond, ...)."""
    found = list(closed.consts)
    for eqn in closed.jaxpr.eqns:
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else [value]:
                if hasattr(sub, "consts") and hasattr(sub, "jaxpr"):
                    found += _all_consts(sub)
    return found


def test_tensors_built_like_traced_ones_stay_in_the_graph_not_constants_of_their_size():
    # torch's attention softmax builds torch.zeros_like(scores) (B x heads x T x T); folded
    # while tracing, it and autodiff's zero tangent were constants of that size per layer
    # (6.9 GB for a Whisper-base-sized encoder at batch 16 on a GPU)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    fns = torch_model_fns(layer)
    xt = torch.randn(4, 128, 16)
    x = jnp.asarray(xt.numpy())
    params, state = fns.init(jax.random.key(0), {"x": x})

    def out(p: Any) -> jax.Array:
        return fns.apply(p, state, {"x": x}, jax.random.key(0), True)[0]

    scores = 4 * 2 * 128 * 128 * 4  # bytes of one float32 attention-score tensor
    consts = _all_consts(jax.make_jaxpr(jax.grad(lambda p: (out(p) * x).sum()))(params))
    assert [c.shape for c in consts if getattr(c, "nbytes", 0) >= scores] == []
    with torch.no_grad():  # and still the layer's own numbers
        np.testing.assert_allclose(np.asarray(out(params)), layer(xt).numpy(), atol=1e-5)


class _ViewWrites(nn.Module):
    """Writes through views by a mask and by index tensors, as transformers' Longformer does
    (``extended_attention_mask[attention_mask == 2] = finfo.max`` on a slice)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        view = h[:, 1:]  # a view of h
        view[flags[:, 1:] == 2] = -1.0  # a batch mask: traced in the step
        view[view > 0.5] = torch.tensor(0.5)  # a mask from the weights
        h[:, :2][torch.tensor([1, 0])] = h[:2, 4:].clone()  # index tensors: rows swapped
        return h


def test_writes_through_a_view_by_a_mask_or_index_tensors_match_torch():
    """Before: IndexError inside torchax (the index stayed a torchax tensor)."""
    torch.manual_seed(0)
    net = _ViewWrites()
    xt = torch.randn(5, 6)
    flags = torch.tensor([[0, 2, 0, 0, 2, 0], [0, 0, 0, 0, 0, 0]] * 2 + [[2] * 6])
    fns = torch_model_fns(net, inputs=("x", "flags"))
    batch = {"x": jnp.asarray(xt.numpy()), "flags": jnp.asarray(flags.numpy(), jnp.int32)}
    params, state = fns.init(jax.random.key(0), batch)
    apply = jax.jit(lambda p, b: fns.apply(p, state, b, jax.random.key(0), True)[0])
    grads = jax.grad(lambda p: apply(p, batch).sum())(params)
    out = torch.func.functional_call(net, dict(net.named_parameters()), (xt, flags))
    np.testing.assert_allclose(np.asarray(apply(params, batch)), out.detach().numpy(), atol=1e-6)
    out.sum().backward()
    np.testing.assert_allclose(
        np.asarray(grads["lin.weight"]), net.lin.weight.grad.numpy(), atol=1e-6
    )


def test_attention_of_a_ported_encoder_computes_in_the_step_compute_dtype():
    # torch's math attention upcasts bf16 to float32; its fused kernels (what a torch user
    # gets on a GPU) do not: the port follows the fused kernels. The attention is one
    # jax.nn.dot_product_attention call (torchshell/trace/_attention.py): its logits dots
    # multiply bf16 by bf16 accumulating in float32 (the dot's algorithm says so), as those do
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    fns = torch_model_fns(layer)
    batch = {"x": jnp.ones((2, 8, 16)), "y": jnp.ones((2, 8, 16))}
    tx = optax.sgd(0.1)
    mesh = jaxcore.make_mesh({"data": 1}, jax.devices()[:1])
    state = jaxcore.init_train_state(fns, tx, batch, seed=0, mesh=mesh)

    def mse(out: jax.Array, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, Any]]:
        return ((out - batch["y"]) ** 2).mean(axis=(1, 2)), {}

    step = jaxcore.make_train_step(fns, mse, tx, compute_dtype=jnp.bfloat16)
    text = step.lower(state, batch).as_text()
    dots = re.findall(r"stablehlo.dot_general .*", text)
    bf16_in_f32_out = (
        "lhs_precision_type = bf16, rhs_precision_type = bf16, accumulation_type = f32"
    )
    results = [
        "bf16" if re.search(r"-> tensor<[\dx]*xbf16>", d) or bf16_in_f32_out in d else d
        for d in dots
    ]
    assert len(results) >= 12 and set(results) == {"bf16"}, results
    assert sum(bf16_in_f32_out in d for d in dots) == 3  # the logits, forward and backward
    assert not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()  # restored


# -- eval-mode fast paths take the math path ----------------------------------------------
def test_encoder_nested_tensor_fast_path_in_eval_is_routed_to_the_math_path():
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    torch.manual_seed(1)
    net = nn.TransformerEncoder(layer, 2)  # enable_nested_tensor=True (the default)
    assert net.use_nested_tensor
    x = torch.randn(2, 6, 16)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4:] = True

    class Padded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = net

        def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            return self.enc(x, src_key_padding_mask=m)

    fns = torch_model_fns(Padded(), ("x", "m"))
    batch = {"x": jnp.asarray(x.numpy()), "m": jnp.asarray(pad.numpy())}
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(True)  # as a user, or torch by default
    try:
        params, state = fns.init(jax.random.key(0), batch)
        out = jax.jit(fns.apply, static_argnums=4)(params, state, batch, jax.random.key(0), False)
        assert torch.backends.mha.get_fastpath_enabled()  # put back after tracing
        net.eval()
        with torch.no_grad():
            ref = net(x, src_key_padding_mask=pad)  # torch's nested-tensor fast path
    finally:
        torch.backends.mha.set_fastpath_enabled(before)
    keep = ~pad.numpy()  # the fast path writes 0 at padded positions, the math path does not
    np.testing.assert_allclose(np.asarray(out[0])[keep], ref.numpy()[keep], rtol=1e-4, atol=1e-5)


# -- a random draw used as a Python bool becomes lax.cond on the step's key -----------------
def _transformer(layer_drop: float) -> nn.Module:
    from torchaudio.models.wav2vec2 import components

    torch.manual_seed(2)
    enc = components._get_encoder(
        in_features=8, embed_dim=16, dropout_input=0.0, pos_conv_kernel=4, pos_conv_groups=2,
        num_layers=2, num_heads=2, attention_dropout=0.0, ff_interm_features=32,
        ff_interm_dropout=0.0, dropout=0.0, layer_norm_first=True, layer_drop=layer_drop,
    )  # fmt: skip
    return enc.transformer  # the torchaudio Transformer with `torch.rand(1).item() <= p`


def test_layer_drop_is_a_traced_branch_that_varies_per_step_like_torch():
    net = _transformer(layer_drop=0.5)
    x = torch.randn(2, 5, 16)
    fns = torch_model_fns(net)
    batch = {"x": jnp.asarray(x.numpy())}
    params, state = fns.init(jax.random.key(0), batch)
    apply = jax.jit(fns.apply, static_argnums=4)
    jaxpr = str(jax.make_jaxpr(lambda p, r: fns.apply(p, state, batch, r, True)[0])(
        params, jax.random.key(0)
    ))  # fmt: skip
    assert jaxpr.count("cond[") >= 2  # one traced branch per layer

    # torch's four outcomes: each layer kept or dropped
    refs = {}
    layers = net.layers
    net.train()
    with torch.no_grad():
        for keep in [(a, b) for a in (0, 1) for b in (0, 1)]:
            net.layers = nn.ModuleList([m for m, k in zip(layers, keep, strict=True) if k])
            net.layer_drop = 0.0
            refs[keep] = net(x).numpy()
    net.layers, net.layer_drop = layers, 0.5
    seen = set()
    for i in range(8):
        out = np.asarray(apply(params, state, batch, jax.random.key(i), True)[0])
        match = [k for k, r in refs.items() if np.allclose(out, r, rtol=1e-4, atol=1e-5)]
        assert len(match) == 1, f"key {i}: output is none of torch's layer-drop outcomes"
        seen.add(match[0])
    assert len(seen) >= 3  # the draw follows the step's key: different layers each step
    same = [apply(params, state, batch, jax.random.key(7), True)[0] for _ in range(2)]
    np.testing.assert_array_equal(np.asarray(same[0]), np.asarray(same[1]))
    # eval mode never draws (`self.training and ...`): all layers, as torch
    net.eval()
    with torch.no_grad():
        np.testing.assert_allclose(
            np.asarray(apply(params, state, batch, jax.random.key(0), False)[0]),
            net(x).numpy(), rtol=1e-4, atol=1e-5,
        )  # fmt: skip
    grads = jax.grad(lambda p: apply(p, state, batch, jax.random.key(3), True)[0].sum())(params)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads.values())


class _Heteroscedastic(nn.Module):
    """Predicts a mean and a variance: torch's own Gaussian NLL, whose check
    ``torch.any(var < 0)`` reads the (traced) variance inside ``F.gaussian_nll_loss``."""

    def __init__(self, positive: bool) -> None:
        super().__init__()
        self.lin, self.positive = nn.Linear(4, 2), positive

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        var = out[:, 1].exp() if self.positive else out[:, 1]
        return F.gaussian_nll_loss(out[:, 0], y, var)


def test_a_check_on_a_traced_value_inside_a_torch_function_branches_like_torch():
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8)
    batch = {"x": jnp.asarray(x.numpy()), "y": jnp.asarray(y.numpy())}
    net = _Heteroscedastic(positive=True)
    fns = torch_model_fns(net, ("x", "y"))
    params, state = fns.init(jax.random.key(0), batch)

    def loss(p: Any) -> jax.Array:
        return fns.apply(p, state, batch, jax.random.key(0), True)[0]

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    want = net(x, y)
    want.backward()
    np.testing.assert_allclose(float(value), want.item(), rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(grads["lin.weight"]), net.lin.weight.grad.numpy(), rtol=1e-4, atol=1e-6
    )

    # a negative variance fails the step with torch's message, as torch raises
    bad = torch_model_fns(_Heteroscedastic(positive=False), ("x", "y"))
    p, s = bad.init(jax.random.key(0), batch)
    with pytest.raises(Exception, match="var has negative entry"):
        jax.block_until_ready(
            jax.jit(bad.apply, static_argnums=4)(p, s, batch, jax.random.key(0), True)
        )


def test_too_many_traced_branches_in_one_call_are_refused_with_the_fix():
    class Drops(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                if torch.rand(1).item() > 0.5:
                    x = layer(x)
            return x

    with pytest.raises(TorchModelError, match=r"torch\.where.*max_branches"):
        torch_model_fns(Drops(), example={"x": torch.ones(2, 4)}, max_branches=8)


# -- a scalar read from the batch on the host is specialised ----------------------------------
def test_conformer_lengths_max_item_is_specialised_per_value_and_matches_torch_sgd():
    torch.manual_seed(3)
    net = torchaudio.models.Conformer(16, 2, 32, 1, 3)  # int(torch.max(lengths).item())
    g = torch.Generator().manual_seed(0)
    batches = []
    for t in (10, 10, 12, 12):  # the padding mask's length: two distinct values
        n = torch.tensor([t, t - 3])
        batches.append({"x": torch.randn(2, t, 16, generator=g), "n": n, "y": torch.zeros(2)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = sgd_parity(net, batches, ("x", "n"), "l2", lambda o: o[0], max_static=1)
    assert p.max_rel <= 1e-4
    np.testing.assert_allclose(p.jax_losses, p.torch_losses, rtol=1e-4)
    assert p.recompiles == 1  # one compiled step per distinct max length
    past = [w for w in caught if "max_static=1" in str(w.message)]
    assert len(past) == 1 and issubclass(past[0].category, RuntimeWarning)


class Crop(nn.Module):
    """Averages the valid steps after cropping to the longest: `x[:, :int(n.max())]`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return self.lin(x[:, : int(n.max())].sum(1) / n[:, None])  # zero padding adds 0


def test_static_buckets_bound_the_compiled_shapes_and_stay_exact():
    torch.manual_seed(4)
    net = Crop()
    g = torch.Generator().manual_seed(1)
    batches = []
    for m in (3, 5, 7, 6, 2):  # maxima 3, 5, 7, 6, 2 -> buckets 4, 8, 8, 8, 4
        x = torch.randn(2, 8, 3, generator=g)
        n = torch.tensor([m, 1])
        x[0, m:] = 0
        x[1, 1:] = 0
        batches.append({"x": x, "n": n, "y": torch.zeros(2)})
    p = sgd_parity(net, batches, ("x", "n"), "l2", static_buckets=(4, 8))
    assert p.max_rel <= 1e-4
    np.testing.assert_allclose(p.jax_losses, p.torch_losses, rtol=1e-4)
    assert p.recompiles == 1  # two buckets, not four lengths


def test_host_read_without_specialise_batch_says_what_to_call():
    fns = torch_model_fns(Crop(), ("x", "n"))
    batch = {"x": jnp.ones((2, 8, 3)), "n": jnp.array([3, 5])}
    params, state = fns.init(jax.random.key(0), batch)
    step = jax.jit(fns.apply, static_argnums=4)
    with pytest.raises(TorchModelError, match=r"specialise_batch\(fns, batch, train=True\)"):
        step(params, state, batch, jax.random.key(0), True)
    b = specialise_batch(fns, batch)
    assert b[STATIC_KEY].shape[:2] == (2, 0)  # rows like the batch, no elements
    assert step(params, state, b, jax.random.key(0), True)[0].shape == (2, 2)
    plain = torch_model_fns(nn.Linear(3, 2))
    plain.init(jax.random.key(0), {"x": jnp.ones((2, 3))})
    same = {"x": jnp.ones((2, 3))}
    assert specialise_batch(plain, same) is same  # no reads: the batch unchanged


def test_make_train_step_with_specialised_batches_counts_recompiles():
    torch.manual_seed(5)
    fns = torch_model_fns(Crop(), ("x", "n"))
    mesh = jaxcore.make_mesh({"data": -1})
    tx = optax.sgd(0.1)
    batch = {"x": jnp.ones((8, 8, 3)), "n": jnp.full((8,), 4), "y": jnp.zeros(8)}
    state = jaxcore.init_train_state(fns, tx, specialise_batch(fns, batch), seed=0, mesh=mesh)

    def loss(out: jax.Array, b: dict) -> tuple[jax.Array, dict]:
        return (out**2).mean(1), {}

    step = jaxcore.make_train_step(fns, loss, tx, state_sharding=jaxcore.state_shardings(state))
    for m in (4, 4, 6, 4):
        b = {**batch, "n": jnp.full((8,), m)}
        state, _ = step(state, specialise_batch(fns, b))
    assert step.recompiles == 1


def test_a_number_from_the_weights_is_still_reported_with_the_module():
    class FromWeights(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.new_zeros(int(self.lin.weight.abs().sum() * 10)) + 1

    with pytest.raises(TorchModelError, match=r"<root> \(FromWeights\).*needs a tensor's value"):
        torch_model_fns(FromWeights(), example={"x": torch.ones(2, 4)})


def test_boolean_indexing_by_a_traced_mask_is_reported_with_the_fix():
    # torchvision's generalized_box_iou_loss writes intsctk[mask] = (x2[mask] - x1[mask]) * ...
    class Positive(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.lin(x)
            return out[out > 0].sum()

    with pytest.raises(TorchModelError, match=r"<root> \(Positive\).*masks instead of boolean"):
        torch_model_fns(Positive()).init(jax.random.key(0), {"x": jnp.ones((2, 4))})


# -- packed sequences run as masks (torchshell/trace/_packed.py) ---------------------------------
class _PackedRNN(L.LightningModule):
    """A team's RNN classifier over padded token batches with their lengths, packed."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.emb = kind, nn.Embedding(20, 8, padding_idx=0)
        if kind == "bigru":  # 2 layers, both directions; pad_packed_sequence to the longest
            self.rnn: nn.Module = nn.GRU(8, 16, 2, batch_first=True, bidirectional=True)
            self.out = nn.Linear(32, 3)
        else:  # an LSTM with projections, time-major, padded back to a fixed total_length
            self.rnn, self.out = nn.LSTM(8, 16, proj_size=4), nn.Linear(40, 3)

    def forward(self, tok: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        x = self.emb(tok)
        if self.kind == "bigru":
            packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
            out, h = self.rnn(packed)
            out, lens = pad_packed_sequence(out, batch_first=True)
            pooled = out.sum(1) / lens[:, None].to(out.dtype)
            return self.out(pooled) + self.out(torch.cat([h[-2], h[-1]], -1))
        packed = pack_padded_sequence(x.transpose(0, 1), lengths, enforce_sorted=False)
        out, _ = self.rnn(packed)
        return self.out(pad_packed_sequence(out, total_length=10)[0].transpose(0, 1).flatten(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tok, lengths, y = batch
        loss = nn.functional.cross_entropy(self(tok, lengths), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("kind", ["bigru", "lstm_proj"])
def test_packed_sequences_train_as_plain_lightning(tmp_path: Path, kind: str) -> None:
    """Before: ``torchax cannot lower the op aten::_pack_padded_sequence`` (and
    ``lengths.cpu()`` left the traced step). Now the packed recurrence runs on the padded
    batch with each sequence's state frozen past its length: weights equal plain
    Lightning's after 2 epochs, losses per batch too."""
    from torchshell import JaxModule

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 11, (96,), generator=g)
    tok = torch.randint(1, 20, (96, 10), generator=g) * (torch.arange(10) < lengths[:, None])
    data = TensorDataset(tok, lengths, tok[:, 0] % 3)
    weights = {}
    for mode in ("plain", "jax"):
        user = _PackedRNN(kind)
        module = user if mode == "plain" else JaxModule.from_lightning(user, print_summary=False)
        quiet_trainer(default_root_dir=tmp_path / mode, max_epochs=2).fit(
            module, DataLoader(data, batch_size=32)
        )
        weights[mode] = user.state_dict()  # (the trained weights, back in the module)
    for name, w in weights["plain"].items():
        torch.testing.assert_close(weights["jax"][name], w, rtol=1e-4, atol=1e-5, msg=name)


class _CTCHead(L.LightningModule):
    """A speech team's CTC head: frames -> per-frame label log-probs -> torch's CTC loss."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(8, 16, 3, padding=1), nn.GELU(), nn.Conv1d(16, 5, 1))
        self.kind = kind
        self.ctc = nn.CTCLoss(blank=0, reduction="sum", zero_infinity=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, frames, labels, label_lengths = batch
        log_probs = self.net(x.transpose(1, 2)).permute(2, 0, 1).log_softmax(-1)  # [T, N, C]
        if self.kind == "concat_zero_inf":
            loss = self.ctc(log_probs, labels, frames, label_lengths) / x.shape[0]
        elif self.kind == "list_lengths":  # whole inputs and labels, lengths as Python lists
            n, t, s = x.shape[0], x.shape[1], labels.shape[1]
            loss = F.ctc_loss(log_probs, labels, [t] * n, [s] * n)
        else:
            loss = F.ctc_loss(log_probs, labels, frames, label_lengths)  # mean over lengths
        self.log("ctc", loss, on_epoch=True, batch_size=x.shape[0])
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _concatenate_labels(rows: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    x, frames, labels, lengths = (torch.stack(c) for c in zip(*rows, strict=True))
    return x, frames, torch.cat([y[:n] for y, n in zip(labels, lengths, strict=True)]), lengths


@pytest.mark.parametrize("kind", ["padded_mean", "concat_zero_inf", "list_lengths"])
def test_ctc_loss_trains_as_plain_lightning(tmp_path: Path, kind: str) -> None:
    """Before: ``torchax cannot lower the op aten::_ctc_loss.Tensor`` (F.ctc_loss,
    nn.CTCLoss: the loss of wav2vec2/conformer speech heads). Now the CTC recursion runs in
    the step (torchshell/trace/_ctc.py): per-step losses and the weights after 2 epochs equal plain
    Lightning's, with padded targets and with torch's concatenated ones, repeated labels,
    empty targets, (zero_infinity) an input too short for its labels, and lengths given as a
    Python list."""

    g = torch.Generator().manual_seed(0)
    n, t, s = 48, 16, 5
    frames = torch.randint(8, t + 1, (n,), generator=g)
    labels = torch.randint(1, 5, (n, s), generator=g)
    labels[:4] = 2  # repeated labels need a blank between them
    label_lengths = torch.randint(0, s + 1, (n,), generator=g)
    concatenated = kind == "concat_zero_inf"
    if concatenated:
        frames[5], label_lengths[5], labels[5] = 3, 5, 1  # no alignment: 0 with zero_infinity
    data = TensorDataset(torch.randn(n, t, 8, generator=g), frames, labels, label_lengths)
    collate = _concatenate_labels if concatenated else None
    loader = DataLoader(data, batch_size=16, collate_fn=collate)
    runs = fit_plain_and_ported(lambda: _CTCHead(kind), tmp_path, loader, max_epochs=2)
    assert all(torch.isfinite(v) for v in runs["plain"][0].callback_metrics.values())
    assert_fit_like_plain(runs, rtol=1e-4, atol=1e-5)


class _LayerDrop(L.LightningModule):
    """wav2vec2's layer drop (``torch.rand(1).item() <= p``: a traced Python bool) in a module
    that logs from its ``training_step``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head, self.p = nn.Linear(8, 3), p

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        for layer in self.layers:
            if not (self.training and torch.rand(1).item() < self.p):
                x = x + torch.tanh(layer(x))
        loss = F.cross_entropy(self.head(x), y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_traced_branch_in_a_logging_training_step_trains_as_plain_lightning(
    tmp_path: Path,
) -> None:
    """Before: ``true_fun output ... is a list of length 1 but false_fun output ... is a list
    of length 2`` (each path of the branch appended its ``self.log`` to the same records).
    Now each path keeps its own: with ``p=0`` (the branch traced, never taken) the losses and
    weights equal plain Lightning's; with ``p=0.5`` it trains and logs."""
    from torchshell import JaxModule

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    runs = fit_plain_and_ported(lambda: _LayerDrop(0.0), tmp_path, DataLoader(data, batch_size=16))
    assert_fit_like_plain(runs, rtol=1e-5, atol=1e-6)
    trainer = quiet_trainer(default_root_dir=tmp_path / "drop", max_epochs=1)
    trainer.fit(
        JaxModule.from_lightning(_LayerDrop(0.5), print_summary=False),
        DataLoader(data, batch_size=16),
    )
    assert torch.isfinite(trainer.callback_metrics["train_loss"])


_STOCK_LOSSES = {
    # targets: class indices up to the first -1 (torch's own decomposition, which torchax
    # used, counted the slots after it: a wrong loss, silently)
    "multilabel_margin": lambda o, y, z, b: F.multilabel_margin_loss(
        o, torch.where(b > 0, y[:, None].expand(-1, 4), -1)
    ),
    "triplet_margin": lambda o, y, z, b: F.triplet_margin_loss(o, z, z.flip(0)),
    "cosine_embedding": lambda o, y, z, b: F.cosine_embedding_loss(o, z, (y % 2) * 2 - 1),
    "gaussian_nll": lambda o, y, z, b: F.gaussian_nll_loss(o, z, torch.full_like(z, 0.5)),
}


class _StockLoss(L.LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.net, self.loss = nn.Linear(8, 4), _STOCK_LOSSES[name]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, z, b = batch
        loss = self.loss(self.net(x), y, z, b)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("name", list(_STOCK_LOSSES))
def test_stock_torch_losses_train_as_plain_lightning(tmp_path: Path, name: str) -> None:
    """torch losses a team picks (metric learning, multi-label, heteroscedastic): the
    logged loss and the weights after an epoch equal plain Lightning's."""

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(32, 8, generator=g),
        torch.randint(0, 4, (32,), generator=g),
        torch.randn(32, 4, generator=g),
        (torch.rand(32, 4, generator=g) > 0.5).float(),
    )
    loader = DataLoader(data, batch_size=16)
    runs = fit_plain_and_ported(lambda: _StockLoss(name), tmp_path, loader, max_epochs=1)
    assert_fit_like_plain(runs, rtol=1e-5, atol=1e-6)


def _weights(o: torch.Tensor) -> torch.Tensor:
    return torch.tensor([1.0, 2.0, 0.5, 1.0], device=o.device)


def _focal(o: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from torchvision.ops import sigmoid_focal_loss

    return sigmoid_focal_loss(o, b, reduction="mean")


# (outputs o [B, 4], class indices y [B], regression targets z [B, 4], binary labels b [B, 4])
_FORWARD_LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "poisson_nll": lambda o, y, z, b: F.poisson_nll_loss(o, z.abs()),
    "poisson_nll_rate": lambda o, y, z, b: F.poisson_nll_loss(o.exp(), z.abs(), log_input=False),
    "kl_div": lambda o, y, z, b: F.kl_div(
        F.log_softmax(o, -1), F.softmax(z, -1), reduction="batchmean"
    ),
    "huber": lambda o, y, z, b: F.huber_loss(o, z, delta=0.5),
    "smooth_l1": lambda o, y, z, b: F.smooth_l1_loss(o, z, beta=0.5),
    "soft_margin": lambda o, y, z, b: F.soft_margin_loss(o, b * 2 - 1),
    "multi_margin": lambda o, y, z, b: F.multi_margin_loss(o, y),
    "hinge_embedding": lambda o, y, z, b: F.hinge_embedding_loss(o, b * 2 - 1),
    "margin_ranking": lambda o, y, z, b: F.margin_ranking_loss(o[:, 0], o[:, 1], b[:, 0] * 2 - 1),
    "bce": lambda o, y, z, b: F.binary_cross_entropy(torch.sigmoid(o), b),
    "bce_logits_pos_weight": lambda o, y, z, b: F.binary_cross_entropy_with_logits(
        o, b, pos_weight=_weights(o)
    ),
    "nll_weight_ignore": lambda o, y, z, b: F.nll_loss(
        F.log_softmax(o, -1), torch.where(y == 3, -100, y), weight=_weights(o)
    ),
    "cross_entropy_smoothing": lambda o, y, z, b: F.cross_entropy(o, y, label_smoothing=0.1),
    "cross_entropy_soft": lambda o, y, z, b: F.cross_entropy(o, F.softmax(z, -1)),
    "multilabel_soft_margin": lambda o, y, z, b: F.multilabel_soft_margin_loss(o, b),
    "gaussian_nll_predicted_var": lambda o, y, z, b: F.gaussian_nll_loss(
        o[:, :2], z[:, :2], o[:, 2:].exp()
    ),
    "cosine_similarity": lambda o, y, z, b: (1 - F.cosine_similarity(o, z)).mean(),
    "torchvision_sigmoid_focal": lambda o, y, z, b: _focal(o, b),
}


class _LossInForward(nn.Module):
    def __init__(self, loss: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.lin, self.loss = nn.Linear(8, 4), loss

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        x, *targets = batch
        return self.loss(self.lin(x), *targets)


@pytest.mark.parametrize("name", list(_FORWARD_LOSSES))
def test_stock_losses_in_a_forward_match_torch_value_and_grad(name: str) -> None:
    """torch's losses (and torchvision's focal loss) as a team writes them in a forward, with
    their value checks: the traced loss and its gradient are torch's."""
    g = torch.Generator().manual_seed(0)
    x, z = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    y = torch.randint(0, 4, (16,), generator=g)
    b = (torch.rand(16, 4, generator=g) > 0.5).float()
    torch.manual_seed(0)
    net = _LossInForward(_FORWARD_LOSSES[name])
    keys = ("x", "y", "z", "b")
    fns = torch_model_fns(net, keys)
    batch = {k: jnp.asarray(t.numpy()) for k, t in zip(keys, (x, y, z, b), strict=True)}
    params, state = fns.init(jax.random.key(0), batch)

    def loss(p: Any) -> jax.Array:
        return fns.apply(p, state, batch, jax.random.key(0), True)[0]

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    want = net(x, y, z, b)
    want.backward()
    np.testing.assert_allclose(float(value), want.item(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(
        np.asarray(grads["lin.weight"]), net.lin.weight.grad.numpy(), rtol=1e-4, atol=1e-6
    )


class _STFTFrontEnd(L.LightningModule):
    """Features computed in the forward, as speech code often writes them: ``torch.stft``
    with a window built on the spot, a log magnitude, a conv over time (``w.mT`` too)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(33, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        window = torch.hann_window(64, device=wav.device) * torch.hamming_window(64)
        spec = torch.stft(wav, 64, 16, window=window, return_complex=True).abs()
        h = torch.relu(self.conv(torch.log1p(spec)))  # [B, 8, T]
        return self.head(h.mT.mean(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        wav, y = batch
        loss = F.cross_entropy(self(wav), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_a_window_built_in_the_forward_trains_as_plain_lightning(tmp_path: Path) -> None:
    """Before: ``torchax cannot lower the op aten::hann_window`` (and ``aten::mT`` for
    ``x.mT``). Now windows (hann, hamming, blackman, bartlett) and ``mT``/``mH`` are lowered:
    the loss and weights after an epoch equal plain Lightning's."""

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 800, generator=g), torch.randint(0, 4, (32,), generator=g))
    loader = DataLoader(data, batch_size=16)
    runs = fit_plain_and_ported(_STFTFrontEnd, tmp_path, loader, max_epochs=1)
    assert_fit_like_plain(runs, rtol=1e-4, atol=1e-5)
