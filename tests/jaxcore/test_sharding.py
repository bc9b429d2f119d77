from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcore
from jaxcore.models.digits import MLP
from tests.jaxcore.models import encoder_case, mlp_case, put, setup

MESHES = {
    "single": ({"data": 1}, "dp"),
    "dp8": ({"data": 8}, "dp"),
    "fsdp8": ({"data": 8}, "fsdp"),
    "dp4xtp2": ({"data": 4, "model": 2}, "tp"),
}


def _mesh(axes):
    devices = jax.devices()[: int(np.prod(list(axes.values())))]
    return jaxcore.make_mesh(axes, devices=devices)


def _losses(case, axes, preset, init=None, steps=5):
    model, batch = case()
    mesh = _mesh(axes)
    state, step, sharding = setup(model, batch, mesh, preset, state=init)
    data = put(batch, sharding)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, data)
        losses.append(metrics["loss"])
    return np.asarray(jax.device_get(losses)), state


@pytest.fixture(scope="module", params=[mlp_case, encoder_case], ids=["mlp", "encoder"])
def runs(request):
    """5 steps of one model on each mesh, from the same initial values."""
    case = request.param
    model, batch = case()
    init, _, _ = setup(model, batch, _mesh({"data": 1}))
    return case, {name: _losses(case, *MESHES[name], init=init) for name in MESHES}


def test_same_losses_on_every_mesh(runs):
    case, results = runs
    ref, _ = results["single"]
    assert ref[-1] < ref[0]  # it trains
    for name in ("dp8", "fsdp8", "dp4xtp2"):
        np.testing.assert_allclose(results[name][0], ref, rtol=1e-5, err_msg=name)
    tp_state = results["dp4xtp2"][1]
    if case is encoder_case:  # dp x tp splits attention heads and the MLP over "model"
        q = tp_state.params["attn_0"]["query"]["kernel"]
        assert q.sharding.spec == P(None, "model")
        assert q.addressable_shards[0].data.shape == (16, 1, 8)
        assert tp_state.params["mlp_0"]["fc2"]["kernel"].sharding.spec == P("model")
    else:  # Megatron pair: layers_0 column-parallel, layers_1 row-parallel
        assert tp_state.params["layers_0"]["kernel"].sharding.spec == P(None, "model")
        assert tp_state.params["layers_1"]["kernel"].sharding.spec == P("model")


def _tree_bytes_per_device(tree):
    per_device: dict = {}
    total = 0
    for leaf in jax.tree.leaves(tree):
        total += leaf.nbytes
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return total, per_device


def test_fsdp_holds_an_eighth_per_device(runs):
    _, results = runs
    state = results["fsdp8"][1]  # after 5 steps: the step keeps the layout
    for part in (state.params, state.opt_state):
        total, per_device = _tree_bytes_per_device(part)
        assert len(per_device) == 8
        for nbytes in per_device.values():  # only a few tiny odd-sized leaves are replicated
            assert total / 8 <= nbytes <= total / 8 * 1.05, (nbytes, total)
    assert any(leaf.sharding.spec == P("data") for leaf in jax.tree.leaves(state.params))
    total, per_device = _tree_bytes_per_device(results["dp8"][1].params)
    assert set(per_device.values()) == {total}  # dp: every device holds everything


def test_init_is_born_sharded_under_fsdp():
    model, _ = mlp_case(features=(64, 64))
    mesh = _mesh({"data": 8})
    fn = jaxcore.state_sharding_fn(mesh, "fsdp")
    state = jaxcore.init_train_state(
        model,
        jaxcore.make_optimizer(),
        {"x": jnp.ones((8, 64))},
        seed=0,
        mesh=mesh,
        param_shardings=fn,
    )
    kernel = state.params["layers_0"]["kernel"]
    assert kernel.sharding.spec == P("data")  # largest divisible dim of [64, 64]
    assert [s.data.shape for s in kernel.addressable_shards] == [(8, 64)] * 8
    assert state.params["head"]["kernel"].sharding.spec == P("data")  # [64, 10]: dim 0
    mu = state.opt_state.inner_state[0].mu["layers_0"]["kernel"]
    assert mu.sharding.spec == P("data")  # optimizer moments follow their params


def test_indivisible_dimension_names_param_shape_and_spec():
    model = jaxcore.linen_model(MLP(features=(12,)))
    mesh = _mesh({"data": 8})
    fn = jaxcore.state_sharding_fn(mesh, "dp", rules=[["layers_0/kernel", [None, "data"]]])
    with pytest.raises(jaxcore.ShardingError) as err:
        jaxcore.init_train_state(
            model,
            jaxcore.make_optimizer(),
            {"x": jnp.ones((8, 64))},
            seed=0,
            mesh=mesh,
            param_shardings=fn,
        )
    msg = str(err.value)
    assert "params/layers_0/kernel" in msg and "(64, 12)" in msg and "'data'" in msg
    assert "Fix" in msg


@pytest.mark.parametrize(
    ("preset", "rules", "match"),
    [
        ("zero", None, "Unknown sharding preset"),
        ("dp", [["kernel", ["nope"]]], "names mesh axes"),
        ("dp", [["kernel", [None, None, "data"]]], "has 2 dims"),
        ("dp", [["kernel"]], "regex"),
    ],
)
def test_bad_rules_are_clear_errors(preset, rules, match):
    mesh = _mesh({"data": 8})
    tree = {"dense": {"kernel": jax.ShapeDtypeStruct((64, 16), jnp.float32)}}
    with pytest.raises(jaxcore.ShardingError, match=match):
        jaxcore.state_sharding_fn(mesh, preset, rules)(tree)


def test_large_unmatched_param_is_reported(caplog):
    mesh = _mesh({"data": 4, "model": 2})
    tree = {
        "params": {
            "fc1": {"kernel": jax.ShapeDtypeStruct((512, 1024), jnp.float32)},  # 2 MiB, tp rule
            "big": {"kernel": jax.ShapeDtypeStruct((600, 600), jnp.float32)},  # 1.4 MiB, none
            "small": {"kernel": jax.ShapeDtypeStruct((64, 64), jnp.float32)},
        }
    }
    plan = jaxcore.plan_shardings(tree, mesh, jaxcore.preset_rules("tp"))
    assert [u.path for u in plan.unmatched] == ["params/big/kernel"]
    assert plan.specs["params"]["fc1"]["kernel"] == P(None, "model")
    with caplog.at_level("WARNING", logger="jaxcore.sharding"):
        jaxcore.state_sharding_fn(mesh, "tp")(tree)
    assert "params/big/kernel" in caplog.text
    # fsdp shards it (600 % 4 == 0), so nothing is reported; dp reports nothing at all
    assert not jaxcore.plan_shardings(tree, mesh, jaxcore.sharding_rules("fsdp_tp")).unmatched
    assert not jaxcore.plan_shardings(tree, mesh, jaxcore.preset_rules("dp")).unmatched


def test_rules_from_yaml_data_and_order():
    rules = jaxcore.sharding_rules(
        "fsdp", [["head/kernel", []], ["layers_0/kernel", ["largest:model"]]]
    )
    mesh = _mesh({"data": 4, "model": 2})
    tree = {
        "head": {"kernel": jnp.zeros((64, 8))},
        "layers_0": {"kernel": jnp.zeros((6, 4))},
        "other": {"kernel": jnp.zeros((6, 4))},
    }
    specs = jaxcore.plan_shardings(tree, mesh, rules).specs
    assert specs["head"]["kernel"] == P()  # the user's rule wins over the preset
    assert specs["layers_0"]["kernel"] == P("model")  # largest dim divisible by 2
    assert specs["other"]["kernel"] == P(None, "data")  # fsdp: 6 % 4 != 0, 4 % 4 == 0


@pytest.mark.parametrize("name", ["single", "dp", "fsdp", "tp"])
def test_conf_mesh_groups_build(name):
    import yaml  # the Hydra group files are plain YAML data for these functions

    root = Path(__file__).resolve().parents[2] / "conf"
    cfg = yaml.safe_load((root / "mesh" / f"{name}.yaml").read_text())
    mesh = jaxcore.make_mesh(cfg["axes"], num_devices=cfg.get("num_devices"))
    assert mesh.size == (1 if name == "single" else 8)
    model, batch = mlp_case()
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), batch)[0])
    fn = jaxcore.state_sharding_fn(mesh, cfg["preset"], cfg.get("rules"))
    shardings = fn({"layers_0": abstract["layers_0"]})
    expected = {"single": P(), "dp": P(), "fsdp": P("data"), "tp": P(None, "model")}[name]
    assert shardings["layers_0"]["kernel"].spec == expected
    for precision in ("fp32", "bf16"):
        dtype = yaml.safe_load((root / "precision" / f"{precision}.yaml").read_text())
        assert jaxcore.resolve_dtype(dtype["compute_dtype"]) is not None
