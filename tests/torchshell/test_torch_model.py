"""A torch nn.Module as the JAX core: N jaxcore steps match N plain PyTorch steps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from hydra.utils import instantiate
from jax.sharding import NamedSharding, PartitionSpec
from omegaconf import OmegaConf
from torch import nn

import jaxcore
from tests.helpers import quiet_trainer
from torchshell import JaxModule
from torchshell._errors import TorchModelError
from torchshell.data.digits import DigitsDataModule
from torchshell.torch_model import params_to_state_dict, specialise_batch, torch_model_fns
from torchshell.twins.digits import MLP

ROWS = 8  # divisible by the 8 fake devices of the data axis


class SmallCNN(nn.Module):
    """Conv + BatchNorm2d + ReLU + pool + linear head on 1x8x8 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1, bias=False)  # bias before BN has zero grad
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, 64]
        h = torch.relu(self.bn(self.conv(x.reshape(-1, 1, 8, 8))))
        return self.head(nn.functional.max_pool2d(h, 2).flatten(1))  # [B, 10]


class SmallEncoder(nn.Module):
    """Token embedding + positions made in forward + 2 transformer encoder layers."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, 64] read as 16 tokens of 4
        h = self.embed(x.reshape(x.shape[0], 16, 4))
        h = h + 0.01 * torch.arange(16, dtype=h.dtype)[None, :, None]
        return self.head(self.encoder(h).mean(1))  # [B, 10]


class WithMaxPool(nn.Module):
    """A layer torchax 0.0.13 cannot lower, nor coreshell (fractional max pooling)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 8), nn.Unflatten(1, (1, 2, 4)))
        self.pool = nn.FractionalMaxPool2d(2, output_size=(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.body(x)).flatten(1)


class Branchy(nn.Module):
    """Python control flow on a tensor's value."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) if x.sum() > 0 else -self.lin(x)


def _batches(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"x": torch.randn(ROWS, 64, generator=g), "y": torch.randint(0, 10, (ROWS,), generator=g)}
        for _ in range(n)
    ]


def _to_device(batch: dict[str, torch.Tensor], sharding: NamedSharding) -> dict[str, jax.Array]:
    host = {"x": batch["x"].numpy(), "y": batch["y"].numpy().astype(np.int32)}
    return jax.device_put(host, sharding)


def _train_both(
    net: nn.Module,
    tx: optax.GradientTransformation,
    torch_opt: Callable[[nn.Module], torch.optim.Optimizer],
    steps: int,
    axes: dict[str, int] | None = None,
    rules: list[list[object]] | None = None,
) -> tuple[jaxcore.TrainState, nn.Module, list[float], list[float]]:
    """Trains ``net`` N steps through jaxcore (8-way data mesh) and in plain PyTorch."""
    fns = torch_model_fns(net)  # copies the weights: the torch run below starts equal
    mesh = jaxcore.make_mesh(axes or {"data": -1})
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    batches = _batches(steps)
    state = jaxcore.init_train_state(
        fns,
        tx,
        _to_device(batches[0], sharding),
        seed=0,
        mesh=mesh,
        param_shardings=jaxcore.state_sharding_fn(mesh, "fsdp", rules) if rules else None,
    )
    step = jaxcore.make_train_step(
        fns, jaxcore.softmax_cross_entropy, tx, state_sharding=jaxcore.state_shardings(state)
    )
    jax_losses = []
    for b in batches:
        state, metrics = step(state, _to_device(b, sharding))
        jax_losses.append(float(metrics["loss"]))

    opt = torch_opt(net)
    net.train()
    torch_losses = []
    for b in batches:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(b["x"]), b["y"])
        loss.backward()
        opt.step()
        torch_losses.append(loss.item())
    return state, net, jax_losses, torch_losses


def _assert_same(state: jaxcore.TrainState, net: nn.Module) -> None:
    trained = {**state.model_state, **state.params}
    reference = net.state_dict()
    assert set(trained) == set(reference)
    for name, ref in reference.items():
        np.testing.assert_allclose(
            np.asarray(trained[name]), ref.numpy(), rtol=1e-4, atol=1e-6, err_msg=name
        )


def test_mlp_sgd_steps_match_pytorch():
    torch.manual_seed(0)
    net = MLP(64, features=(32, 32), num_classes=10)
    state, net, jl, tl = _train_both(
        net,
        optax.sgd(0.1, momentum=0.9),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        steps=5,
    )
    np.testing.assert_allclose(jl, tl, rtol=1e-4)
    _assert_same(state, net)
    assert set(state.params) == {n for n, _ in net.named_parameters()}
    assert state.model_state == {}


def test_mlp_with_fsdp_and_tp_rules_on_torch_names_matches_pytorch():
    # nn.Linear weights are (out, in): column-parallel splits dim 0, row-parallel dim 1
    rules = [
        [r"(^|/)layers\.0\.weight$", ["model", None]],
        [r"(^|/)layers\.0\.bias$", ["model"]],
        [r"(^|/)layers\.1\.weight$", [None, "model"]],
        [r"(^|/)layers\.1\.bias$", []],
    ]
    torch.manual_seed(6)
    state, net, jl, tl = _train_both(
        MLP(64, features=(32, 32), num_classes=10),
        optax.adam(1e-2),
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
        steps=3,
        axes={"data": 4, "model": 2},
        rules=rules,
    )
    shard = {k: v.sharding.shard_shape(v.shape) for k, v in state.params.items()}
    assert shard["layers.0.weight"] == (16, 64)  # (32, 64) split on out over model=2
    assert shard["layers.1.weight"] == (32, 16)  # (32, 32) split on in over model=2
    assert shard["head.weight"] == (10, 8)  # fsdp: largest dim over data=4
    np.testing.assert_allclose(jl, tl, rtol=1e-4)
    _assert_same(state, net)


def test_cnn_batchnorm_adam_steps_match_pytorch_running_stats_included():
    torch.manual_seed(1)
    state, net, jl, tl = _train_both(
        SmallCNN(),
        optax.adam(1e-2),
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
        steps=4,
    )
    np.testing.assert_allclose(jl, tl, rtol=1e-4)
    assert sorted(state.model_state) == [
        "bn.num_batches_tracked",
        "bn.running_mean",
        "bn.running_var",
    ]
    assert int(state.model_state["bn.num_batches_tracked"]) == 4
    assert not np.allclose(np.asarray(state.model_state["bn.running_var"]), 1.0)
    _assert_same(state, net)  # params and running stats


def test_transformer_encoder_sgd_steps_match_pytorch():
    # sgd, not adam: the attention key bias has a true gradient of zero (softmax ignores a
    # per-query shift), and adam would scale both frameworks' float noise up to +-lr.
    torch.manual_seed(2)
    state, net, jl, tl = _train_both(
        SmallEncoder(),
        optax.sgd(0.05, momentum=0.9),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
        steps=3,
    )
    np.testing.assert_allclose(jl, tl, rtol=1e-4)
    assert "encoder.layers.0.self_attn.in_proj_weight" in state.params
    _assert_same(state, net)


def test_export_is_exact_and_eval_mode_uses_running_stats():
    torch.manual_seed(3)
    net = SmallCNN()
    fns = torch_model_fns(net)
    x = _batches(1)[0]["x"]
    params, model_state = fns.init(jax.random.key(0), {"x": jnp.asarray(x.numpy())})
    for i in range(3):  # three train-mode forwards update the running stats
        _, model_state = fns.apply(
            params, model_state, {"x": jnp.asarray(x.numpy())}, jax.random.key(0), True
        )
        assert int(model_state["bn.num_batches_tracked"]) == i + 1

    sd = params_to_state_dict(params, model_state, net)
    fresh = SmallCNN()
    assert str(fresh.load_state_dict(sd, strict=True)) == "<All keys matched successfully>"
    assert fresh.bn.num_batches_tracked.dtype == torch.int64
    assert int(fresh.bn.num_batches_tracked) == 3
    fresh.eval()
    outputs, same_state = fns.apply(
        params, model_state, {"x": jnp.asarray(x.numpy())}, jax.random.key(0), False
    )
    assert same_state is model_state  # eval never changes the state
    with torch.no_grad():
        np.testing.assert_allclose(np.asarray(outputs), fresh(x).numpy(), rtol=1e-5, atol=1e-6)
        fresh.train()  # train mode normalises with batch stats: a different output
        assert not np.allclose(np.asarray(outputs), fresh(x).numpy(), atol=1e-3)


def test_export_fills_tied_weights_and_keeps_frozen_params_out_of_training():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight  # tied
            self.scale = nn.Parameter(torch.tensor(2.0), requires_grad=False)  # frozen

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) * self.scale

    net = Tied()
    fns = torch_model_fns(net)
    params, state = fns.init(jax.random.key(0), {"x": jnp.ones((2, 4))})
    assert sorted(params) == ["a.bias", "a.weight", "b.bias"]
    assert sorted(state) == ["scale"]
    grads = jax.grad(
        lambda p: fns.apply(p, state, {"x": jnp.ones((2, 4))}, jax.random.key(0), True)[0].sum()
    )(params)
    assert float(jnp.abs(grads["a.weight"]).sum()) > 0
    new = {k: v + 1.0 for k, v in params.items()}
    sd = params_to_state_dict(new, state, net)
    assert sorted(sd) == ["a.bias", "a.weight", "b.bias", "b.weight", "scale"]
    fresh = Tied()
    fresh.load_state_dict(sd, strict=True)
    assert torch.equal(fresh.b.weight, torch.from_numpy(np.array(new["a.weight"])))
    x = torch.randn(2, 4)
    out = fns.apply(new, state, {"x": jnp.asarray(x.numpy())}, jax.random.key(0), False)[0]
    with torch.no_grad():
        np.testing.assert_allclose(np.asarray(out), fresh(x).numpy(), rtol=1e-6)


def test_dropout_follows_the_step_key_and_eval_turns_it_off():
    torch.manual_seed(4)
    net = MLP(64, features=(64,), dropout=0.5)
    fns = torch_model_fns(net)
    batch = {"x": jnp.ones((4, 64))}
    params, state = fns.init(jax.random.key(0), batch)
    apply = jax.jit(fns.apply, static_argnums=4)

    def hidden_mask(key: jax.Array) -> np.ndarray:
        # the gradient w.r.t. head.weight is zero exactly where dropout dropped a unit
        g = jax.grad(lambda p: apply(p, state, batch, key, True)[0].sum())(params)
        return np.asarray(g["head.weight"][0] != 0)

    a, b, c = (
        hidden_mask(jax.random.key(1)),
        hidden_mask(jax.random.key(1)),
        hidden_mask(jax.random.key(2)),
    )
    assert (a == b).all()  # deterministic per key
    assert (a != c).any()  # a new key drops other units
    assert 0.3 < a.mean() < 0.7  # about half kept
    e1 = apply(params, state, batch, jax.random.key(1), False)[0]
    e2 = apply(params, state, batch, jax.random.key(2), False)[0]
    np.testing.assert_array_equal(np.asarray(e1), np.asarray(e2))
    net.eval()
    with torch.no_grad():
        np.testing.assert_allclose(np.asarray(e1), net(torch.ones(4, 64)).numpy(), rtol=1e-5)
    assert net.training is False  # the module's own mode is left as it was


def test_unsupported_op_fails_at_extraction_naming_op_and_module():
    with pytest.raises(TorchModelError) as info:
        torch_model_fns(WithMaxPool(), example={"x": torch.zeros(2, 64)})
    message = str(info.value)
    assert "aten::fractional_max_pool2d" in message
    assert "pool (FractionalMaxPool2d)" in message
    assert "Flax" in message


class BucketsPerRow(nn.Module):
    """``torch.searchsorted`` with a 2-D sorted sequence: torchax's lowering takes 1-D only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        edges = torch.sort(x[:, :4], dim=1).values
        return torch.searchsorted(edges, x[:, 4:8]).float()


def test_an_op_whose_lowering_fails_is_named_not_a_bare_python_error():
    """Before: ``ValueError: a should be 1-dimensional`` from inside torchax, nothing naming
    the op or the module."""
    with pytest.raises(TorchModelError) as info:
        torch_model_fns(BucketsPerRow(), example={"x": torch.zeros(2, 64)})
    message = str(info.value)
    assert "aten::searchsorted" in message and "a should be 1-dimensional" in message
    assert "<root> (BucketsPerRow)" in message and "Flax" in message


def test_python_branch_on_the_batch_is_specialised_per_outcome():
    # `if x.sum() > 0` reads the batch on the host: one compiled step per outcome
    torch.manual_seed(7)
    net = Branchy()
    fns = torch_model_fns(net)
    params, state = fns.init(jax.random.key(0), {"x": jnp.ones((8, 64))})
    traces: list[int] = []

    def counted(*args):
        traces.append(1)  # runs once per compilation, whatever jax's caches hold
        return fns.apply(*args)

    apply = jax.jit(counted, static_argnums=4)
    for sign in (1.0, -1.0, 1.0):
        batch = specialise_batch(fns, {"x": sign * jnp.ones((8, 64))})
        out = apply(params, state, batch, jax.random.key(0), True)[0]
        with torch.no_grad():
            ref = net(sign * torch.ones(8, 64)).numpy()
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5)
    assert len(traces) == 2


def test_plain_tensor_attribute_is_reported_with_the_fix():
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.mask = torch.ones(4)  # a plain attribute, not a buffer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.mask

    with pytest.raises(TorchModelError, match=r"<root> \(Masked\).*register_buffer"):
        torch_model_fns(Masked(), example={"x": torch.ones(2, 4)})


def test_an_output_that_is_not_tensors_is_refused_naming_the_field_and_the_fix():
    """A transformers decoder asked for its KV cache returns a ``DynamicCache`` object: named,
    with ``use_cache=False`` as the fix (by default the cache is off while tracing, so
    ``LlamaForCausalLM`` itself trains: the zoo). Before: JAX's bare TypeError."""
    import transformers as hf

    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            cfg = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_key_value_heads=1)
            self.lm = hf.LlamaForCausalLM(
                hf.LlamaConfig(num_hidden_layers=1, num_attention_heads=2, **cfg)
            )

        def forward(self, x: torch.Tensor) -> object:
            return self.lm(input_ids=x, use_cache=True)

    with pytest.raises(TorchModelError) as info:
        torch_model_fns(Cached(), example={"x": torch.ones(2, 4, dtype=torch.long)})
    message = str(info.value)
    assert "the output of Cached['cache'] is a transformers.cache_utils.DynamicCache" in message
    assert "use_cache=False" in message

    class Tagged(nn.Module):
        def forward(self, x: torch.Tensor) -> object:
            return {"logits": x * 2, "extra": [x, "a note"]}

    with pytest.raises(TorchModelError, match=r"Tagged\['extra'\]\[1\] is a builtins.str"):
        torch_model_fns(Tagged(), example={"x": torch.ones(2, 4)})

    class Best(nn.Module):  # torch.max's (values, indices) comes back as a tuple
        def forward(self, x: torch.Tensor) -> object:
            return torch.max(x, 1)

    values, indices = torch_model_fns(Best(), example={"x": torch.ones(2, 4)}).apply(
        {}, {}, {"x": jnp.arange(8.0).reshape(2, 4)}, jax.random.key(0), False
    )[0]
    np.testing.assert_array_equal(np.asarray(values), [3.0, 7.0])
    np.testing.assert_array_equal(np.asarray(indices), [3, 3])


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(TorchModelError, match=r"expects a torch\.nn\.Module"):
        torch_model_fns(MLP)  # the class, not an instance
    fns = torch_model_fns(MLP(64, features=(8,)), inputs=("features",))
    with pytest.raises(jaxcore.BatchError, match="missing"):
        fns.init(jax.random.key(0), {"x": jnp.ones((2, 64))})
    params, state = torch_model_fns(MLP(64, features=(8,))).init(
        jax.random.key(0), {"x": jnp.ones((2, 64))}
    )
    with pytest.raises(TorchModelError, match="shape mismatches"):
        params_to_state_dict(params, state, MLP(64, features=(16,)))


def test_config_form_builds_the_module_and_its_model_fns():
    cfg = OmegaConf.load(Path(__file__).parents[2] / "conf" / "model" / "torch_mlp.yaml")
    module = instantiate(cfg.torch)
    assert isinstance(module, MLP)
    fns = torch_model_fns(module, inputs=tuple(cfg.inputs))
    params, _ = fns.init(jax.random.key(0), {"x": jnp.ones((2, 64))})
    assert params["layers.0.weight"].shape == (256, 64)  # nn.Linear layout: (out, in)


def test_torch_module_trains_under_lightning_and_exports_into_itself():
    torch.manual_seed(5)
    net = MLP(64, features=(64,), num_classes=10)
    module = JaxModule(
        torch_model_fns(net),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer("adam", lr=1e-2),
        mesh=jaxcore.make_mesh({"data": -1}),
    )
    trainer = quiet_trainer(max_steps=100)
    dm = DigitsDataModule(batch_size=64)
    trainer.fit(module, dm)
    assert trainer.global_step == 100
    assert trainer.validate(module, dm, verbose=False)[0]["val/accuracy"] > 0.9
    jax_logits = torch.cat(trainer.predict(module, dm.test_dataloader()))

    net.load_state_dict(
        params_to_state_dict(module.state.params, module.state.model_state, net), strict=True
    )
    net.eval()
    with torch.no_grad():
        torch_logits = torch.cat([net(b["x"]) for b in dm.test_dataloader()])
    np.testing.assert_allclose(jax_logits.numpy(), torch_logits.numpy(), rtol=1e-4, atol=1e-5)


def test_the_exported_state_dict_carries_the_module_versions_torch_loading_reads() -> None:
    """torchvision's MNASNet reads its version from ``state_dict._metadata`` when loading and
    refuses a dict without one: the export is torch's own type with the module's versions."""
    import torchvision

    net = torchvision.models.mnasnet0_5(num_classes=3)
    fns = torch_model_fns(net)
    params, state = fns.init(jax.random.key(0), {"x": jnp.ones((2, 3, 32, 32))})
    sd = params_to_state_dict(params, state, net)
    assert sd._metadata[""] == net.state_dict()._metadata[""]  # type: ignore[attr-defined]
    fresh = torchvision.models.mnasnet0_5(num_classes=3)
    fresh.load_state_dict(sd, strict=True)
    torch.testing.assert_close(fresh.state_dict(), net.state_dict())
