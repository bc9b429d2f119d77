import os
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcore
from jaxcore.models.digits import MLP


def test_make_mesh_fills_and_sorts():
    mesh = jaxcore.make_mesh({"data": -1, "model": 2})
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    ids = [d.id for d in mesh.devices.flat]
    assert ids == sorted(ids)


@pytest.mark.parametrize("axes", [{"data": 3}, {"data": -1, "model": 3}, {"a": -1, "b": -1}])
def test_make_mesh_rejects_bad_axes(axes):
    with pytest.raises(jaxcore.MeshError, match="Fix"):
        jaxcore.make_mesh(axes)


def _setup(mesh):
    model = jaxcore.linen_model(MLP(features=(32,)))
    tx = jaxcore.make_optimizer("adamw", lr=1e-2)
    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.normal(size=(16, 64)), jnp.float32),
        "y": jnp.asarray(rng.integers(0, 10, 16), jnp.int32),
    }
    state = jaxcore.init_train_state(model, tx, batch, seed=0, mesh=mesh)
    step = jaxcore.make_train_step(
        model, jaxcore.softmax_cross_entropy, tx, state_sharding=jaxcore.state_shardings(state)
    )
    return model, state, step, batch


def test_train_step_lowers_loss_and_counts_steps():
    _, state, step, batch = _setup(jaxcore.make_mesh({"data": -1}))
    losses = []
    for _ in range(20):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert int(state.step) == 20
    assert losses[-1] < 0.5 * losses[0]


def test_masked_rows_do_not_change_the_step():
    mesh = jaxcore.make_mesh({"data": -1})
    _, state, step, batch = _setup(mesh)
    _, state2, _, _ = _setup(mesh)
    padded = {k: jnp.concatenate([v, jnp.zeros_like(v[:8]) + 7]) for k, v in batch.items()}
    padded["mask"] = jnp.arange(24) < 16
    step2 = jaxcore.make_train_step(
        jaxcore.linen_model(MLP(features=(32,))),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer("adamw", lr=1e-2),
        state_sharding=jaxcore.state_shardings(state2),
    )
    s1, m1 = step(state, batch)
    s2, m2 = step2(state2, padded)
    np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), s1.params, s2.params
    )


def test_unknown_optimizer_is_a_clear_error():
    with pytest.raises(jaxcore.ConfigError, match=r"optim\.name"):
        jaxcore.make_optimizer("adamax")


def test_missing_batch_key_is_named():
    model = jaxcore.linen_model(MLP(features=(8,)), inputs=("features",))
    with pytest.raises(jaxcore.BatchError, match="missing \\['features'\\]"):
        model.init(jax.random.key(0), {"x": jnp.ones((2, 64))})


def test_make_mesh_num_devices_takes_the_first():
    mesh = jaxcore.make_mesh({"data": 1}, num_devices=1)
    assert mesh.devices.flat[0] == sorted(jax.devices(), key=lambda d: d.id)[0]
    with pytest.raises(jaxcore.MeshError, match="num_devices"):
        jaxcore.make_mesh({"data": 1}, num_devices=9)


_PROBE = "import jax, jaxcore; n = jaxcore.set_cpu_devices({count!r}); print(n, len(jax.devices()))"


@pytest.mark.parametrize(
    ("count", "flags", "expected"),
    [
        ("auto", "", f"{len(os.sched_getaffinity(0))} {len(os.sched_getaffinity(0))}"),
        ("auto", "--xla_force_host_platform_device_count=3", "None 3"),  # the flag wins
        (3, "--xla_force_host_platform_device_count=5", "3 3"),  # an explicit count wins
        (None, "", "None 1"),
    ],
)
def test_set_cpu_devices_in_a_fresh_process(count, flags, expected):
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(count=count)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.split("\n")[-2] == expected


def test_set_cpu_devices_once_jax_runs():
    have = len(jax.devices("cpu"))  # 8, from tests/conftest.py
    assert jaxcore.set_cpu_devices("auto") is None  # the running count stands
    assert jaxcore.set_cpu_devices(have) == have
    with pytest.raises(jaxcore.ConfigError, match=f"already runs with {have}.*Fix:"):
        jaxcore.set_cpu_devices(have + 1)
    for bad in (0, "all", True, 1.5):
        with pytest.raises(jaxcore.ConfigError, match="positive int"):
            jaxcore.set_cpu_devices(bad)


def test_per_example_turns_batch_means_into_exact_rows() -> None:
    import optax

    logits = jnp.asarray(np.random.default_rng(0).normal(size=(6, 4)), jnp.float32)
    batch = {"y": jnp.array([0, 1, 2, 3, 0, 1]), "mask": jnp.arange(6) < 4, "w": jnp.ones(())}

    def mean_loss(out: jax.Array, b: dict[str, jax.Array]) -> Any:
        ce = optax.softmax_cross_entropy_with_integer_labels(out, b["y"]) * b["w"]
        return ce.mean(), {"acc": (out.argmax(-1) == b["y"]).mean()}

    rows, metrics = jax.jit(jaxcore.per_example(mean_loss))(logits, batch)
    want, _ = jaxcore.softmax_cross_entropy(logits, batch)
    np.testing.assert_allclose(rows, want, rtol=1e-6)
    np.testing.assert_array_equal(metrics["acc"], logits.argmax(-1) == batch["y"])
    # [B] values pass unchanged; per-token values are refused with the fix
    assert jaxcore.per_example(jaxcore.softmax_cross_entropy)(logits, batch)[0] is not None
    with pytest.raises(jaxcore.BatchError, match=r"shape \(6, 3\).*one value per row"):
        jaxcore.per_example(lambda o, b: jnp.ones((6, 3)))(logits, batch)
