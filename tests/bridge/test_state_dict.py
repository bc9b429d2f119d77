"""Flax (linen, nnx) <-> torch state_dict conversion: parity, round trips, strict errors."""

import functools
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from torch import nn as tnn

import bridge
from jaxcore.models.digits import MLP
from torchshell.twins.digits import MLP as TwinMLP

RNG = np.random.default_rng(0)

# ------------------------------------------------------------------ Flax + torch test models


class CNN(nn.Module):
    """Linen auto names: Conv_0, BatchNorm_0, Conv_1 (depthwise), BatchNorm_1, Dense_0."""

    @nn.compact
    def __call__(self, x):  # [B, H, W, 3]
        x = nn.relu(nn.BatchNorm(use_running_average=True)(nn.Conv(8, (3, 3))(x)))
        x = nn.Conv(8, (3, 3), feature_group_count=8)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=True)(x)).mean(axis=(1, 2))
        return nn.Dense(10)(x)


class TorchCNN(tnn.Module):
    def __init__(self):
        super().__init__()
        self.Conv = tnn.ModuleList(
            [tnn.Conv2d(3, 8, 3, padding=1), tnn.Conv2d(8, 8, 3, padding=1, groups=8)]
        )
        self.BatchNorm = tnn.ModuleList([tnn.BatchNorm2d(8), tnn.BatchNorm2d(8)])
        self.Dense = tnn.ModuleList([tnn.Linear(8, 10)])

    def forward(self, x):  # [B, 3, H, W]
        for conv, bn in zip(self.Conv, self.BatchNorm, strict=True):
            x = torch.relu(bn(conv(x)))
        return self.Dense[0](x.mean((2, 3)))


class Encoder(nn.Module):
    """Embedding + pre-LN transformer encoder block."""

    @nn.compact
    def __call__(self, tokens):  # [B, T] int
        x = nn.Embed(50, 16, name="embed")(tokens)
        h = nn.LayerNorm(epsilon=1e-5, name="ln1")(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=4, name="attn")(h, h)
        h = nn.LayerNorm(epsilon=1e-5, name="ln2")(x)
        return x + nn.Dense(16, name="fc2")(nn.relu(nn.Dense(32, name="fc1")(h)))


class TorchEncoder(tnn.Module):
    def __init__(self):
        super().__init__()
        self.embed = tnn.Embedding(50, 16)
        self.ln1, self.ln2 = tnn.LayerNorm(16), tnn.LayerNorm(16)
        self.attn = tnn.MultiheadAttention(16, 4, batch_first=True)
        self.fc1, self.fc2 = tnn.Linear(16, 32), tnn.Linear(32, 16)

    def forward(self, tokens):
        x = self.embed(tokens)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))


class AudioStem(nn.Module):
    """Conv1d stem over a waveform: strided convs, GroupNorm, RMSNorm."""

    @nn.compact
    def __call__(self, wav):  # [B, T, 1]
        x = nn.Conv(8, (5,), strides=(2,), padding=[(2, 2)], name="conv1")(wav)
        x = nn.gelu(nn.GroupNorm(num_groups=4, epsilon=1e-5, name="gn")(x), approximate=False)
        x = nn.Conv(16, (3,), strides=(2,), padding=[(1, 1)], name="conv2")(x)
        return nn.RMSNorm(epsilon=1e-6, name="rms")(x)  # [B, T/4, 16]


class TorchAudioStem(tnn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = tnn.Conv1d(1, 8, 5, stride=2, padding=2)
        self.gn = tnn.GroupNorm(4, 8, eps=1e-5)
        self.conv2 = tnn.Conv1d(8, 16, 3, stride=2, padding=1)
        self.rms = tnn.RMSNorm(16, eps=1e-6)

    def forward(self, wav):  # [B, 1, T]
        x = tnn.functional.gelu(self.gn(self.conv1(wav)))
        return self.rms(self.conv2(x).transpose(1, 2))


class UpConv(nn.Module):
    """ConvTranspose2d and Conv3d (both ways of storing a transposed kernel)."""

    transpose_kernel: bool = False

    @nn.compact
    def __call__(self, img, vol):  # [B, H, W, 3], [B, D, H, W, 2]
        up = nn.ConvTranspose(
            4, (3, 3), strides=(2, 2), padding="VALID", transpose_kernel=self.transpose_kernel
        )
        return up(img), nn.Conv(4, (2, 2, 2), padding="VALID", name="c3")(vol)


class TorchUpConv(tnn.Module):
    def __init__(self):
        super().__init__()
        self.ConvTranspose = tnn.ModuleList([tnn.ConvTranspose2d(3, 4, 3, stride=2)])
        self.c3 = tnn.Conv3d(2, 4, 2)

    def forward(self, img, vol):
        return self.ConvTranspose[0](img), self.c3(vol)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(8, name="fc")(nn.LayerNorm(epsilon=1e-5, name="ln")(x)), None


class Stack(nn.Module):
    """Three scanned blocks: params carry a leading layer axis."""

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return scan(name="layers")(x, None)[0]


class TorchBlock(tnn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc = tnn.LayerNorm(8), tnn.Linear(8, 8)

    def forward(self, x):
        return x + self.fc(self.ln(x))


class TorchStack(tnn.Module):
    def __init__(self):
        super().__init__()
        self.layers = tnn.ModuleList(TorchBlock() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class NnxNet(nnx.Module):
    """nnx: Conv1d, BatchNorm (BatchStat), MultiHeadAttention and a List of Linears."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(3, 4, (3,), rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=4, decode=False, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(2)])

    def __call__(self, x):  # [B, T, 3]
        x = nnx.relu(self.bn(self.conv(x)))
        x = x + self.attn(x)
        for layer in self.layers:
            x = layer(x)
        return x


class TorchNnxNet(tnn.Module):
    def __init__(self):
        super().__init__()
        self.conv = tnn.Conv1d(3, 4, 3, padding=1)
        self.bn = tnn.BatchNorm1d(4)
        self.attn = tnn.MultiheadAttention(4, 2, batch_first=True)
        self.layers = tnn.ModuleList(tnn.Linear(4, 4) for _ in range(2))

    def forward(self, x):  # [B, T, 3]
        x = torch.relu(self.bn(self.conv(x.transpose(1, 2)))).transpose(1, 2)
        x = x + self.attn(x, x, x, need_weights=False)[0]
        for layer in self.layers:
            x = layer(x)
        return x


# ------------------------------------------------------------------ cases


def _randomize_stats(tree):
    """Non-trivial BatchNorm statistics, so eval-mode parity tests them."""
    leaves, treedef = jax.tree.flatten(tree)
    new = [jnp.asarray(RNG.uniform(0.5, 1.5, np.shape(x)), x.dtype) for x in leaves]
    return jax.tree.unflatten(treedef, new)


def _torch_random_stats(module):
    for m in module.modules():
        if isinstance(m, tnn.modules.batchnorm._BatchNorm):
            m.running_mean.normal_(0, 0.3)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.normal_(1, 0.2)
            m.bias.data.normal_(0, 0.2)
    return module


@dataclass
class Case:
    flax: Callable[[], tuple[Callable[..., Any], Any]]  # -> (apply(variables, *inputs), vars)
    torch: Callable[[], tnn.Module]
    inputs: Callable[[], list[np.ndarray]]  # torch layout
    kw: dict[str, Any] = field(default_factory=dict)


def _linen(model, to_flax, *example):
    variables = model.init(jax.random.key(0), *example)
    if "batch_stats" in variables:
        variables = {**variables, "batch_stats": _randomize_stats(variables["batch_stats"])}
    return (lambda v, *xs: model.apply(v, *to_flax(*xs))), variables


def _nnx():
    model = NnxNet(nnx.Rngs(0))
    model.eval()
    batch_stats = nnx.state(model, nnx.BatchStat)
    nnx.update(model, _randomize_stats(batch_stats))
    graphdef, state = nnx.split(model)
    return (lambda s, x: nnx.merge(graphdef, s)(x)), state


def _f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _nchw(x):
    return jnp.transpose(x, (0, 2, 3, 1))


CASES = {
    "mlp": Case(
        lambda: _linen(MLP(features=(16, 8)), lambda x: (x,), jnp.ones((1, 64))),
        lambda: TwinMLP(features=(16, 8)),
        lambda: [_f32(3, 64)],
    ),
    "cnn_batchnorm": Case(
        lambda: _linen(CNN(), lambda x: (_nchw(x),), jnp.ones((1, 6, 6, 3))),
        TorchCNN,
        lambda: [_f32(2, 3, 6, 6)],
    ),
    "transformer": Case(
        lambda: _linen(Encoder(), lambda t: (t,), jnp.ones((1, 5), jnp.int32)),
        TorchEncoder,
        lambda: [RNG.integers(0, 50, (2, 5)).astype(np.int32)],
    ),
    "audio_conv1d": Case(
        lambda: _linen(AudioStem(), lambda w: (jnp.transpose(w, (0, 2, 1)),), jnp.ones((1, 32, 1))),
        TorchAudioStem,
        lambda: [_f32(2, 1, 32)],
    ),
    "conv_transpose_conv3d": Case(
        lambda: _linen(
            UpConv(),
            lambda i, v: (_nchw(i), jnp.transpose(v, (0, 2, 3, 4, 1))),
            jnp.ones((1, 5, 5, 3)),
            jnp.ones((1, 3, 3, 3, 2)),
        ),
        TorchUpConv,
        lambda: [_f32(2, 3, 5, 5), _f32(2, 2, 3, 3, 3)],
    ),
    "conv_transpose_kernel_true": Case(
        lambda: _linen(
            UpConv(transpose_kernel=True),
            lambda i, v: (_nchw(i), jnp.transpose(v, (0, 2, 3, 4, 1))),
            jnp.ones((1, 5, 5, 3)),
            jnp.ones((1, 3, 3, 3, 2)),
        ),
        TorchUpConv,
        lambda: [_f32(2, 3, 5, 5), _f32(2, 2, 3, 3, 3)],
        {"rules": [(r"^ConvTranspose_0/kernel$", "ConvTranspose_0/weight", bridge.CONV_KERNEL)]},
    ),
    "scanned_layers": Case(
        lambda: _linen(Stack(), lambda x: (x,), jnp.ones((1, 8))),
        TorchStack,
        lambda: [_f32(4, 8)],
        {"stacked": ["layers"]},
    ),
    "nnx": Case(_nnx, TorchNnxNet, lambda: [_f32(2, 5, 3)]),
}
IDS = list(CASES)


def _permute_outputs(name, out):
    """Channels-last Flax outputs -> torch layout for the conv-transpose cases."""
    if name.startswith("conv_transpose"):
        return jnp.transpose(out[0], (0, 3, 1, 2)), jnp.transpose(out[1], (0, 4, 1, 2, 3))
    return out


@functools.cache
def _apply(name):
    """One jitted apply per model (one compile instead of one per eager op), and its vars."""
    apply, variables = CASES[name].flax()
    return jax.jit(lambda v, *xs: _permute_outputs(name, apply(v, *xs))), variables


def _assert_bit_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), "values differ"


# ------------------------------------------------------------------ parity and round trips


@pytest.mark.parametrize("name", IDS)
def test_export_forward_parity(name):
    case = CASES[name]
    apply, variables = _apply(name)
    module = case.torch().eval()
    module.load_state_dict(bridge.export_state_dict(variables, module, **case.kw), strict=True)
    report = bridge.check_parity(apply, variables, module, case.inputs(), rtol=1e-5, atol=1e-5)
    assert report.ok, str(report)
    assert report.max_abs <= 1e-5


@pytest.mark.parametrize("name", IDS)
def test_warm_start_from_random_torch_model(name):
    case = CASES[name]
    apply, template = _apply(name)
    module = _torch_random_stats(case.torch()).eval()
    imported = bridge.import_state_dict(module.state_dict(), template, **case.kw)
    assert jax.tree.structure(imported) == jax.tree.structure(template)
    report = bridge.check_parity(apply, imported, module, case.inputs(), rtol=1e-5, atol=1e-5)
    assert report.ok, str(report)


@pytest.mark.parametrize("name", IDS)
def test_round_trips_are_bit_exact(name):
    case = CASES[name]
    _, variables = _apply(name)
    module = _torch_random_stats(case.torch())
    # params -> state_dict -> params
    exported = bridge.export_state_dict(variables, module, **case.kw)
    _assert_bit_equal(variables, bridge.import_state_dict(exported, variables, **case.kw))
    # state_dict -> params -> state_dict
    sd = module.state_dict()
    back = bridge.export_state_dict(bridge.import_state_dict(sd, variables, **case.kw), **case.kw)
    assert sorted(back) == sorted(sd)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


def test_mlp_export_matches_twin_and_round_trips():
    model = MLP(features=(16, 8))
    x = jnp.linspace(-1, 1, 3 * 64, dtype=jnp.float32).reshape(3, 64)
    params = model.init(jax.random.key(0), x)["params"]
    twin = TwinMLP(features=(16, 8))
    twin.load_state_dict(bridge.export_state_dict(params, twin), strict=True)
    with torch.no_grad():
        got = twin(torch.from_numpy(np.array(x))).numpy()
    assert abs(got - jax.device_get(model.apply({"params": params}, x))).max() < 1e-5
    back = bridge.import_state_dict(twin.state_dict(), params)
    jax.tree.map(lambda a, b: (a == b).all() or pytest.fail("round trip differs"), params, back)


def test_attention_key_names_and_bn_counter():
    _, variables = _apply("transformer")
    sd = bridge.export_state_dict(variables)
    assert tuple(sd["attn.in_proj_weight"].shape) == (48, 16)
    assert {"attn.in_proj_bias", "attn.out_proj.weight", "attn.out_proj.bias"} <= set(sd)
    _, cnn_vars = _apply("cnn_batchnorm")
    sd = bridge.export_state_dict(cnn_vars)
    assert sd["BatchNorm.1.num_batches_tracked"].dtype == torch.int64
    assert "BatchNorm.0.running_var" in sd and "Conv.1.weight" in sd


# ------------------------------------------------------------------ strict errors


def test_strict_export_lists_missing_and_transposed():
    params = {
        "layers_0": {"kernel": jnp.ones((64, 16)), "bias": jnp.ones(16)},
        "head": {"kernel": jnp.ones((10, 16)), "bias": jnp.ones(10)},
    }
    with pytest.raises(bridge.StateDictError) as err:
        bridge.export_state_dict(params, TwinMLP(features=(16, 16)))
    msg = str(err.value)
    assert "layers.1.weight" in msg and "missing" in msg
    assert "kernel looks transposed" in msg
    assert "head.weight: exported params (16, 10) vs torch module's state_dict (10, 16)" in msg


def test_strict_export_lists_unexpected_keys():
    params = MLP(features=(16, 8)).init(jax.random.key(0), jnp.ones((1, 64)))["params"]
    with pytest.raises(bridge.StateDictError, match=r"unexpected keys[^\n]*\n\s+layers\.1\.bias"):
        bridge.export_state_dict(params, TwinMLP(features=(16,)))


def test_strict_export_names_wrong_dtype_and_cast_fixes_it():
    params = MLP(features=(8,)).init(jax.random.key(0), jnp.ones((1, 64)))["params"]
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    twin = TwinMLP(features=(8,))
    with pytest.raises(bridge.StateDictError, match=r"dtype mismatches:\n\s+head.bias: exported "):
        bridge.export_state_dict(bf16, twin)
    sd = bridge.export_state_dict(bf16)
    assert sd["head.weight"].dtype == torch.bfloat16  # bf16 stays bf16 unless asked
    assert bridge.export_state_dict(bf16, twin, dtype=torch.float32)["head.bias"].dtype == (
        torch.float32
    )
    _assert_bit_equal(bf16, bridge.import_state_dict(sd, bf16))


def test_import_errors_name_missing_keys_and_batchnorm_hint():
    _, variables = _apply("cnn_batchnorm")
    sd = TorchCNN().state_dict()
    del sd["Dense.0.bias"]
    with pytest.raises(bridge.StateDictError, match=r"missing keys[^\n]*\n\s+Dense\.0\.bias"):
        bridge.import_state_dict(sd, variables)
    with pytest.raises(bridge.StateDictError, match="pass the whole variables dict"):
        bridge.export_state_dict(variables["params"], TorchCNN())


def test_duplicate_target_key_and_bad_stacked_prefix_raise():
    params = {"a": {"kernel": jnp.ones((2, 2))}, "b": {"kernel": jnp.ones((2, 2))}}
    with pytest.raises(bridge.StateDictError, match="filled twice"):
        bridge.export_state_dict(params, rules=[(r"^[ab]/kernel$", "x/weight", None)])
    with pytest.raises(bridge.StateDictError, match="match no path prefix"):
        bridge.export_state_dict(params, stacked=["blocks"])


def test_user_rule_renames_before_builtins():
    params = {"proj": {"kernel": jnp.arange(6.0).reshape(2, 3)}, "pos": jnp.ones((4, 3))}
    rules = [(r"^proj/kernel$", "out_proj.weight", bridge.DENSE_KERNEL), (r"^pos$", "pe", None)]
    sd = bridge.export_state_dict(params, rules=rules)
    assert sorted(sd) == ["out_proj.weight", "pe"]
    assert sd["out_proj.weight"].tolist() == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
    _assert_bit_equal(params, bridge.import_state_dict(sd, params, rules=rules))


# ------------------------------------------------------------------ memory: sharding, copies


def test_export_aliases_jax_buffers_without_copies():
    params = {"fc": {"kernel": jnp.ones((64, 32)), "bias": jnp.zeros(32)}}
    sd = bridge.export_state_dict(params)
    assert sd["fc.bias"].data_ptr() == params["fc"]["bias"].unsafe_buffer_pointer()
    assert sd["fc.weight"].data_ptr() == params["fc"]["kernel"].unsafe_buffer_pointer()
    assert not sd["fc.weight"].is_contiguous()  # a transposed view, made contiguous to save


def test_sharded_params_gather_and_import_keeps_shardings():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    model = MLP(features=(16, 8))
    params = model.init(jax.random.key(0), jnp.ones((1, 64)))["params"]
    sharded = jax.tree.map(
        lambda x: jax.device_put(
            x, NamedSharding(mesh, PartitionSpec(*([None] * (x.ndim - 1)), "model"))
        ),
        params,
    )
    assert len(sharded["head"]["kernel"].sharding.device_set) == 8
    plain, gathered = bridge.export_state_dict(params), bridge.export_state_dict(sharded)
    assert all(torch.equal(plain[k], gathered[k]) for k in plain)
    back = bridge.import_state_dict(plain, sharded)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(sharded), strict=True):
        assert a.sharding == b.sharding
    _assert_bit_equal(params, back)


# ------------------------------------------------------------------ safetensors and parity


def test_safetensors_round_trip_with_metadata(tmp_path: Path):
    case = CASES["scanned_layers"]
    _, variables = _apply("scanned_layers")
    sd = bridge.export_state_dict(variables, **case.kw)  # views of one stacked buffer
    sources = bridge.state_dict_sources(variables, **case.kw)
    path = bridge.save_safetensors(sd, tmp_path / "m.safetensors", sources=sources)
    loaded, meta = bridge.load_safetensors(path)
    assert all(torch.equal(loaded[k], sd[k]) for k in sd) and sorted(loaded) == sorted(sd)
    assert meta["tensors"]["layers.1.fc.weight"] == {
        "dtype": "torch.float32",
        "source": ["params/layers/fc/kernel[1]"],
    }
    assert meta["producer"] == "coreshell" and meta["coreshell_version"]
    assert not list(tmp_path.glob("*.tmp"))


def test_load_safetensors_refuses_pickles(tmp_path: Path):
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    with pytest.raises(bridge.SafetensorsError, match="not a readable safetensors"):
        bridge.load_safetensors(tmp_path / "m.pt")
    with pytest.raises(bridge.SafetensorsError, match="No safetensors file"):
        bridge.load_safetensors(tmp_path / "absent.safetensors")


def test_check_parity_reports_a_wrong_weight():
    case = CASES["mlp"]
    apply, variables = _apply("mlp")
    module = case.torch().eval()
    sd = bridge.export_state_dict(variables, module)
    sd["head.bias"] = sd["head.bias"] + 1e-3
    module.load_state_dict(sd)
    report = bridge.check_parity(apply, variables, module, case.inputs(), rtol=1e-5, atol=1e-5)
    assert not report.ok and 9e-4 < report.max_abs < 1.1e-3
    with pytest.raises(bridge.ParityError, match="OUT OF TOLERANCE"):
        report.raise_for_mismatch()
    with pytest.raises(bridge.ParityError, match="shape"):
        bridge.check_parity(lambda v, x: apply(v, x)[:, :5], variables, module, case.inputs())


_TWO_PROCESS_CHILD = """
import sys

import jax
import numpy as np

jax.distributed.initialize(f"127.0.0.1:{sys.argv[2]}", num_processes=2, process_id=int(sys.argv[1]))
import torch
from jax.sharding import NamedSharding, PartitionSpec

import bridge

mesh = jax.make_mesh((4,), ("x",), devices=jax.devices())
full = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
kernel = jax.make_array_from_callback(full.shape, NamedSharding(mesh, PartitionSpec("x")),
                                      lambda i: full[i])
bias = jax.make_array_from_callback((6,), NamedSharding(mesh, PartitionSpec()), lambda i: full[0])
params = {"fc": {"kernel": kernel, "bias": bias}}
assert not kernel.is_fully_addressable
sd = bridge.export_state_dict(params)
assert torch.equal(sd["fc.weight"], torch.from_numpy(full.T.copy())), "gathered kernel"
assert torch.equal(sd["fc.bias"], torch.from_numpy(full[0].copy())), "replicated bias"
back = bridge.import_state_dict(sd, params)["fc"]["kernel"]
assert back.sharding == kernel.sharding
assert all(np.array_equal(np.asarray(s.data), full[s.index]) for s in back.addressable_shards)
print("GATHER-OK", flush=True)
"""


def test_params_spread_over_two_processes_are_gathered(tmp_path: Path):
    script = tmp_path / "child.py"
    script.write_text(_TWO_PROCESS_CHILD)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
        "PYTHONWARNINGS": "error::UserWarning:bridge",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0 and "GATHER-OK" in out, out[-3000:]
