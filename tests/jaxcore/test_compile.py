import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcore


def test_recompiles_are_counted_per_new_shape():
    step = jaxcore.Step(lambda x: jnp.tanh(x).sum(), name="tanh")
    step(jnp.ones((4, 3)))
    step(jnp.ones((4, 3)) * 2)  # same signature: no compile
    assert (step.compiles, step.recompiles) == (1, 0)
    step(jnp.ones((5, 3)))  # a ragged batch: one more compile
    assert (step.compiles, step.recompiles) == (2, 1)


def test_aot_compile_gives_flops_and_dumps(tmp_path):
    step = jaxcore.Step(lambda a, b: a @ b, name="matmul")
    a, b = jnp.ones((32, 16)), jnp.ones((16, 8))
    stats = step.compile(a, b, dump_dir=tmp_path)
    assert stats.flops_per_step == pytest.approx(2 * 32 * 16 * 8, rel=0.05)
    assert stats.bytes_per_step and stats.bytes_per_step >= 4 * (32 * 16 + 16 * 8 + 32 * 8)
    assert stats.compile_seconds > 0 and stats.recompiles == 0
    np.testing.assert_allclose(step(a, b), a @ b)
    assert step.compiles == 1  # the call used the AOT executable
    assert "dot_general" in (tmp_path / "matmul.jaxpr.txt").read_text()
    assert "stablehlo.dot_general" in (tmp_path / "matmul.stablehlo.mlir").read_text()
    assert "HloModule" in (tmp_path / "matmul.hlo.txt").read_text()
    assert set(stats.as_dict()) >= {"compile_seconds", "flops_per_step", "recompiles"}


def test_flops_per_step_do_not_depend_on_steps_per_call():
    def one(w, x):
        return w @ x

    def scanned(w, xs):  # XLA's cost analysis counts this loop body once
        return jax.lax.scan(lambda c, x: (c, one(w, x)), 0, xs)[1]

    w, xs = jnp.ones((16, 16)), jnp.ones((4, 16, 16))
    flat = jaxcore.Step(one).compile(w, xs[0]).flops_per_step
    step = jaxcore.Step(
        scanned,
        steps_per_call=4,
        cost_fn=one,
        cost_args=lambda w, xs: (w, jax.ShapeDtypeStruct(xs.shape[1:], xs.dtype)),
    )
    assert step.compile(w, xs).flops_per_step == flat


def test_persistent_cache_writes_entries(tmp_path):
    try:
        path = jaxcore.enable_compile_cache(tmp_path / "cache")
        jax.jit(lambda x: jnp.sin(x) * 3.25 + 0.125)(jnp.ones(7)).block_until_ready()
        assert any(path.iterdir())  # the executable was written to disk
    finally:
        jaxcore.disable_compile_cache()
    assert jax.config.jax_compilation_cache_dir is None


def test_debug_nans_switch():
    # In a fresh process: some libraries (flax nnx) leave JAX state that masks the switch.
    code = (
        "import jax, jax.numpy as jnp, jaxcore\n"
        "f = jax.jit(lambda x: jnp.log(x) * 0)\n"
        "assert jnp.isnan(f(jnp.array(-1.0)))\n"
        "jaxcore.set_debug_nans(True)\n"
        "try:\n    f(jnp.array(-1.0))\nexcept FloatingPointError:\n    print('raised')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("raised"), out.stderr[-2000:]


def test_a_step_compiled_on_a_pending_state_runs_on_the_state_without_a_second_compile():
    from jaxcore.models.digits import MLP

    mesh = jaxcore.make_mesh({"data": -1})
    model, tx = jaxcore.linen_model(MLP(features=(16,))), jaxcore.make_optimizer("adam")
    batch = {"x": jnp.ones((8, 64)), "y": jnp.zeros((8,), jnp.int32)}
    shard = jaxcore.state_sharding_fn(mesh, "fsdp")
    pending = jaxcore.start_train_state(model, tx, batch, seed=3, mesh=mesh, param_shardings=shard)
    step = jaxcore.make_train_step(
        model,
        jaxcore.softmax_cross_entropy,
        tx,
        state_sharding=jaxcore.state_shardings(pending.abstract),
        batch_sharding=jaxcore.batch_sharding(mesh),
    )
    jbatch = jax.device_put(batch, jaxcore.batch_sharding(mesh))
    stats = step.compile(pending.abstract, jbatch)  # while the init compiles
    state = pending.result()
    same = jaxcore.init_train_state(model, tx, batch, seed=3, mesh=mesh, param_shardings=shard)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(same), strict=True):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(a, b)
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    state, metrics = step(state, jbatch)
    assert np.isfinite(float(metrics["loss"]))
    assert step.compiles == 1  # the call used the executable compiled on the abstract state
    assert stats.flops_per_step and stats.flops_per_step > 2 * 8 * 64 * 16  # analysed on read


@pytest.mark.parametrize("pending", [False, True])
def test_arrays_an_init_closes_over_are_arguments_of_its_program_not_constants(pending):
    # a ported torch module's init returns its weights: concrete arrays, closed over
    weights = {"w": jnp.arange(128 * 256, dtype=jnp.float32).reshape(128, 256)}
    model = jaxcore.ModelFns(
        init=lambda rng, batch: (weights, {}),
        apply=lambda p, s, batch, rng, train: (batch["x"] @ p["w"], s),
    )
    args = (model, jaxcore.make_optimizer("adam"), {"x": jnp.ones((2, 128))})
    kwargs = {"seed": 0, "mesh": jaxcore.make_mesh({"data": -1})}
    previous = jax.config.jax_captured_constants_warn_bytes
    jax.config.update("jax_captured_constants_warn_bytes", 4096)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", "A large amount of constants")
            state = (
                jaxcore.start_train_state(*args, **kwargs).result()
                if pending
                else jaxcore.init_train_state(*args, **kwargs)
            )
    finally:
        jax.config.update("jax_captured_constants_warn_bytes", previous)
    np.testing.assert_array_equal(np.asarray(state.params["w"]), np.asarray(weights["w"]))
