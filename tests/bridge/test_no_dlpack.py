"""JAX arrays reach torch where DLPack is refused (a TPU), through one counted host copy.

On a TPU, ``torch.from_dlpack(jax_array)`` raises ``BufferError: __dlpack__ device only
supported for CPU and GPU, got platform: tpu`` (issue #51). These tests make the CPU arrays
refuse the same way: JAX raises it from ``__dlpack_device__``, the first method
``torch.from_dlpack`` calls, so both DLPack methods of ``ArrayImpl`` are patched.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax._src.array import ArrayImpl
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bridge
from bridge import _convert

TPU_REFUSAL = "__dlpack__ device only supported for CPU and GPU, got platform: tpu"


@dataclass
class Refusals:
    calls: int = 0


@pytest.fixture(autouse=True)
def fresh_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no platform remembered, and leaves none to the rest."""
    monkeypatch.setattr(_convert, "_NO_DLPACK", set())


@pytest.fixture
def refuse(monkeypatch: pytest.MonkeyPatch) -> Iterator[Refusals]:
    """Every ``jax.Array`` refuses DLPack as a TPU array does; counts the attempts."""
    seen = Refusals()

    def refusal(self: ArrayImpl, *args: object, **kwargs: object) -> None:
        seen.calls += 1
        raise BufferError(TPU_REFUSAL)

    monkeypatch.setattr(ArrayImpl, "__dlpack_device__", refusal)
    monkeypatch.setattr(ArrayImpl, "__dlpack__", refusal)
    yield seen


def test_the_patch_refuses_as_a_tpu_does(refuse: Refusals) -> None:
    with pytest.raises(BufferError, match="got platform: tpu"):
        torch.from_dlpack(jnp.ones(2))
    assert refuse.calls == 1


@pytest.mark.parametrize(
    "value",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
        np.array([-3, 0, 2**31 - 1], dtype=np.int32),
        np.array(2.5, dtype=np.float32),  # 0-d
    ],
    ids=["float32", "int32", "0-d"],
)
def test_as_torch_copies_through_the_host(refuse: Refusals, value: np.ndarray) -> None:
    stats = bridge.new_stats()
    x = jnp.asarray(value)
    t = bridge.as_torch(x, stats=stats)
    assert t.shape == value.shape and t.dtype == torch.from_numpy(value).dtype
    np.testing.assert_array_equal(t.numpy(), value)
    assert (stats.device_to_host_copies, stats.device_to_host_bytes) == (1, value.nbytes)
    t.add_(1)  # the tensor owns its memory: writable, and JAX's array is untouched
    np.testing.assert_array_equal(np.asarray(x), value)
    assert refuse.calls == 1


def test_bfloat16_keeps_its_dtype_and_bits(refuse: Refusals) -> None:
    x = jnp.linspace(-3, 3, 7, dtype=jnp.bfloat16)
    stats = bridge.new_stats()
    t = bridge.to_torch({"w": x}, stats=stats)["w"]
    assert t.dtype == torch.bfloat16
    want = np.asarray(x).view(np.uint16)
    assert t.view(torch.uint16).numpy().tolist() == want.tolist()  # same bits, no float32
    assert (stats.device_to_host_copies, stats.device_to_host_bytes) == (1, 14)


def test_a_sharded_array_is_assembled_on_the_host(refuse: Refusals) -> None:
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    sharded = NamedSharding(mesh, PartitionSpec("data"))
    value = np.arange(16, dtype=np.float32).reshape(8, 2)
    stats = bridge.new_stats()
    for _ in range(2):  # the refusal, then the remembered platform (device_get of the shards)
        t = bridge.as_torch(jax.device_put(value, sharded), stats=stats)
        np.testing.assert_array_equal(t.numpy(), value)
    assert (stats.device_to_host_copies, stats.device_to_host_bytes) == (2, 2 * value.nbytes)
    assert refuse.calls == 1


def test_the_refusal_is_remembered_per_platform(refuse: Refusals) -> None:
    stats = bridge.new_stats()
    tree = {"a": jnp.ones(3), "b": [jnp.zeros((2, 2), jnp.int32), jnp.ones((), jnp.bfloat16)]}
    out = bridge.to_torch(tree, stats=stats)
    out2 = bridge.to_torch(tree, stats=stats)
    assert refuse.calls == 1  # DLPack tried once for the platform, never again
    assert sorted(_convert._NO_DLPACK) == ["cpu"]
    assert out["b"][0].tolist() == out2["b"][0].tolist() == [[0, 0], [0, 0]]
    assert stats.device_to_host_copies == 6 and stats.device_to_host_bytes == 2 * (12 + 16 + 2)
    metrics = stats.as_metrics()
    assert metrics["device_to_host_copies"] == 6.0 and metrics["device_to_host_bytes"] == 60.0
    assert "6 arrays to torch through the host: 60 B device-to-host" in stats.summary()
    stats.reset()
    assert stats.device_to_host_copies == stats.device_to_host_bytes == 0


def test_other_errors_from_dlpack_are_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: ArrayImpl, *args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug, not a refusal")

    monkeypatch.setattr(ArrayImpl, "__dlpack_device__", broken)
    with pytest.raises(RuntimeError, match="a bug, not a refusal"):
        bridge.as_torch(jnp.ones(2))
    assert not _convert._NO_DLPACK


def test_without_a_refusal_dlpack_stays_zero_copy() -> None:
    stats = bridge.new_stats()
    x = jnp.arange(4.0)
    t = bridge.to_torch(x, stats=stats)
    assert t.data_ptr() == x.unsafe_buffer_pointer()
    assert stats.device_to_host_copies == 0 and not _convert._NO_DLPACK


def test_a_dtype_without_dlpack_code_copies_but_keeps_dlpack_for_the_platform() -> None:
    stats = bridge.new_stats()
    x = jnp.linspace(-2, 2, 5).astype(jnp.float8_e4m3fn)  # torch: "Unsupported code 10"
    t = bridge.as_torch(x, stats=stats)
    assert t.dtype == torch.float8_e4m3fn
    assert t.view(torch.uint8).tolist() == np.asarray(x).view(np.uint8).tolist()
    assert (stats.device_to_host_copies, stats.device_to_host_bytes) == (1, 5)
    assert not _convert._NO_DLPACK  # a dtype's refusal says nothing about the platform


def test_a_from_torch_fit_ends_with_the_trained_weights_in_the_torch_module(
    refuse: Refusals,
) -> None:
    """The end of ``fit`` (``on_fit_end`` -> ``sync_user_weights`` -> ``bridge.to_torch``)
    crashed on a TPU; with the refusal it copies through the host and the module trains."""
    import lightning as L

    from torchshell import JaxModule

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g)
    module = JaxModule.from_torch(
        net, nn.CrossEntropyLoss(), torch.optim.SGD(net.parameters(), lr=0.5),
        inputs=(0,), print_summary=False,
    )  # fmt: skip
    trainer = L.Trainer(
        max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=8))
    assert trainer.global_step == 3
    assert refuse.calls >= 1 and sorted(_convert._NO_DLPACK) == ["cpu"]  # the host path ran
    after, trained = net.state_dict(), module.torch_state_dict()
    assert set(after) == set(trained) == set(before)
    for name, value in trained.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=0, msg=name)
    assert any(not torch.equal(after[k], before[k]) for k in before)  # it trained
