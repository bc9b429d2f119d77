import jax
import jax.numpy as jnp
import pytest
import torch

import bridge
from jaxcore.models.digits import MLP
from torchshell.twins.digits import MLP as TwinMLP


def test_aligned_tensor_crosses_zero_copy():
    t = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    stats = bridge.new_stats()
    out = bridge.to_jax({"x": t}, stats=stats)["x"]
    assert out.unsafe_buffer_pointer() == t.data_ptr()
    assert stats["zero_copy_bytes"] == t.nbytes and stats["copied_bytes"] == 0


def test_jax_to_torch_is_zero_copy():
    x = jnp.arange(1024, dtype=jnp.float32)
    assert bridge.to_torch({"x": x})["x"].data_ptr() == x.unsafe_buffer_pointer()


def test_int64_overflow_raises_instead_of_truncating():
    with pytest.raises(bridge.TransferError, match="int32"):
        bridge.to_jax({"y": torch.tensor([2**40, 1])})


def test_int64_in_range_is_one_counted_copy():
    stats = bridge.new_stats()
    out = bridge.to_jax({"y": torch.tensor([2**31 - 1, -5])}, stats=stats)["y"]
    assert out.dtype == jnp.int32 and out.tolist() == [2**31 - 1, -5]
    assert stats["copies"] and stats["copied_bytes"] > 0


def test_strict_mode_names_the_field():
    with pytest.raises(bridge.TransferError, match=r"'cols'.*non-contiguous"):
        bridge.to_jax({"cols": torch.ones(8, 8)[:, ::2]}, strict=True)


def test_padding_adds_mask_and_shards():
    mesh = jax.make_mesh((8,), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    out = bridge.to_jax({"x": torch.ones(5, 3)}, sharding, pad_to=8)
    assert out["x"].shape == (8, 3) and out["mask"].tolist() == [True] * 5 + [False] * 3
    assert len(out["x"].sharding.device_set) == 8


def test_mlp_export_matches_twin_and_round_trips():
    model = MLP(features=(16, 8))
    x = jnp.linspace(-1, 1, 3 * 64, dtype=jnp.float32).reshape(3, 64)
    params = model.init(jax.random.key(0), x)["params"]
    twin = TwinMLP(features=(16, 8))
    twin.load_state_dict(bridge.export_state_dict(params, twin), strict=True)
    with torch.no_grad():
        got = twin(torch.from_numpy(jax.device_get(x))).numpy()
    assert abs(got - jax.device_get(model.apply({"params": params}, x))).max() < 1e-5
    back = bridge.import_state_dict(twin.state_dict(), params)
    jax.tree.map(lambda a, b: (a == b).all() or pytest.fail("round trip differs"), params, back)


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
