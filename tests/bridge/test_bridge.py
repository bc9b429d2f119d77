import jax
import jax.numpy as jnp
import pytest
import torch

import bridge
from jaxcore.models.digits import MLP
from torchshell.twins.digits import MLP as TwinMLP


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
