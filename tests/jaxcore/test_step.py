import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcore
from tests.jaxcore.models import mlp_case, put, setup


def _mesh():
    return jaxcore.make_mesh({"data": 8})


@pytest.fixture(scope="module")
def init16():
    """One initial MLP state for 16-row batches (each test places a copy: no init compile)."""
    model, batch = mlp_case(rows=16)
    return setup(model, batch, _mesh())[0]


def _close(a, b, rtol=1e-5, atol=1e-7):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


def test_accumulation_over_4_micro_batches_equals_one_full_step(init16):
    model, batch = mlp_case(rows=32)
    batch["mask"] = np.arange(32) < 27  # ragged: the micro-batches hold unequal valid rows
    mesh = _mesh()
    init, full, sharding = setup(model, batch, mesh, state=init16)
    s1, m1 = full(init, put(batch, sharding))
    init2, accum, _ = setup(model, batch, mesh, accum_steps=4, state=init16)
    s2, m2 = accum(init2, put(batch, sharding))
    np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(m2["accuracy"]), float(m1["accuracy"]), rtol=1e-5)
    _close(s2.params, s1.params)
    _close(s2.opt_state, s1.opt_state)
    with pytest.raises(jaxcore.BatchError, match="accum_steps=5"):
        _, bad, _ = setup(model, batch, mesh, state=s2, accum_steps=5)
        bad(s2, put(batch, sharding))


def test_steps_per_call_equals_k_single_steps(init16):
    k = 3
    model, batch = mlp_case(rows=16)
    rng = np.random.default_rng(3)
    stacked = {
        "x": rng.normal(size=(k, 16, 64)).astype(np.float32),
        "y": rng.integers(0, 10, (k, 16)).astype(np.int32),
    }
    mesh = _mesh()
    state, single, sharding = setup(model, batch, mesh, state=init16)
    losses = []
    for i in range(k):
        state, metrics = single(state, put({n: v[i] for n, v in stacked.items()}, sharding))
        losses.append(float(metrics["loss"]))
    state_k, multi, sharding_k = setup(model, stacked, mesh, steps_per_call=k, state=init16)
    assert sharding_k.spec == jax.sharding.PartitionSpec(None, "data")
    state_k, metrics_k = multi(state_k, put(stacked, sharding_k))
    assert metrics_k["loss"].shape == (k,)
    np.testing.assert_allclose(np.asarray(metrics_k["loss"]), losses, rtol=1e-6)
    assert int(state_k.step) == int(state.step) == k
    _close(state_k.params, state.params, rtol=1e-6)
    with pytest.raises(jaxcore.BatchError, match=r"steps_per_call=3 needs"):
        multi(state_k, put({n: v[:2] for n, v in stacked.items()}, sharding_k))


def _nan_run(policy, init):
    """Three steps in one call; the middle batch holds a NaN."""
    model, batch = mlp_case(rows=16)
    stacked = {n: np.stack([v, v, v]) for n, v in batch.items()}
    stacked["x"][1, 3, 5] = np.nan
    state, step, sharding = setup(
        model, stacked, _mesh(), steps_per_call=3, nan_policy=policy, state=init
    )
    state, metrics = step(state, put(stacked, sharding))
    return state, jax.device_get(metrics)


def _good_steps(n, init):
    """The params after ``n`` clean steps on the same batch."""
    model, batch = mlp_case(rows=16)
    state, step, sharding = setup(model, batch, _mesh(), state=init)
    for _ in range(n):
        state, _ = step(state, put(batch, sharding))
    return jax.device_get(state.params)


@pytest.mark.parametrize("per_leaf", [False, True], ids=["cond (CPU)", "select (accelerators)"])
def test_nan_guard_skip_does_not_apply_the_bad_update(init16, per_leaf, monkeypatch):
    monkeypatch.setattr(jaxcore.guard, "_accelerator", lambda: per_leaf)
    state, metrics = _nan_run("skip", init16)
    np.testing.assert_array_equal(metrics["nonfinite"], [0.0, 1.0, 0.0])
    assert np.isnan(metrics["loss"][1]) and np.isfinite(metrics["loss"][[0, 2]]).all()
    assert int(state.nonfinite) == 1 and int(state.nonfinite_step) == 1
    assert int(state.step) == 3
    params = jax.device_get(state.params)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
    _close(params, _good_steps(2, init16), rtol=1e-6)  # the two good updates, no more
    with pytest.raises(jaxcore.NonFiniteError, match="step 1") as err:
        jaxcore.check_finite(state)
    assert err.value.step == 1


@pytest.mark.parametrize("per_leaf", [False, True], ids=["cond (CPU)", "select (accelerators)"])
def test_nan_guard_stop_keeps_the_last_good_state(init16, per_leaf, monkeypatch):
    monkeypatch.setattr(jaxcore.guard, "_accelerator", lambda: per_leaf)
    state, metrics = _nan_run("stop", init16)
    np.testing.assert_array_equal(metrics["nonfinite"], [0.0, 1.0, 1.0])  # halted after it
    assert int(state.nonfinite_step) == 1
    _close(jax.device_get(state.params), _good_steps(1, init16), rtol=1e-6)
    # the step looked at its input: the error names the field and row, not the learning rate
    with pytest.raises(
        jaxcore.BatchError,
        match=r"\['x'\] holds NaN or Inf in rows \[3\] "
        r"\(of 16\) at step 1",
    ) as err:
        jaxcore.check_finite(state, ["['x']"])
    assert "learning rate)" in str(err.value) and "Fix:" in str(err.value)


def test_a_k_step_window_checks_its_inputs_as_k_single_steps_do(init16):
    # the window's inputs are checked once, before its loop (guard.window_input_where): the
    # refused step, the kept state and the named rows equal K single guarded steps'
    model, batch = mlp_case(rows=16)
    stacked = {n: np.stack([v, v, v]) for n, v in batch.items()}
    stacked["x"][2, 7, 1] = np.inf
    stacked["x"][2, 9, 0] = np.nan
    state_k, step_k, sharding_k = setup(
        model, stacked, _mesh(), steps_per_call=3, nan_policy="stop", state=init16
    )
    state_k, metrics = step_k(state_k, put(stacked, sharding_k))
    state_1, step_1, sharding_1 = setup(model, batch, _mesh(), nan_policy="stop", state=init16)
    for i in range(3):
        state_1, _ = step_1(state_1, put({n: v[i] for n, v in stacked.items()}, sharding_1))
    np.testing.assert_array_equal(jax.device_get(metrics["nonfinite"]), [0.0, 0.0, 1.0])
    assert state_k.nonfinite_input.tolist() == state_1.nonfinite_input.tolist()
    assert state_k.nonfinite_input.tolist()[:4] == [0, 16, 7, 9]
    _close(jax.device_get(state_k.params), jax.device_get(state_1.params), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_the_input_check_sees_nan_in_every_float_dtype_and_passes_large_finite_values(dtype):
    from jaxcore.guard import NO_INPUT, input_where

    big = jnp.full((64, 40), 60000.0 if dtype == jnp.float16 else 3e38, dtype)
    assert input_where({"x": big, "y": jnp.zeros(64, jnp.int32)}).tolist() == list(NO_INPUT)
    bad = jnp.ones((8, 4), dtype).at[5, 2].set(jnp.inf).at[6, 0].set(jnp.nan)
    ids = jnp.arange(8)  # (integer fields are not floating: never looked at)
    assert input_where((ids, big[:8], bad)).tolist() == [1, 8, 5, 6, -1, -1, -1]


def test_nan_policy_none_lets_nan_in_and_bad_policy_is_clear(init16):
    state, metrics = _nan_run("none", init16)
    assert "nonfinite" not in metrics
    assert np.isnan(np.asarray(state.params["head"]["kernel"])).any()
    jaxcore.check_finite(state)  # no guard, nothing counted
    model, _ = mlp_case()
    tx = jaxcore.make_optimizer()
    with pytest.raises(jaxcore.ConfigError, match="nan_policy"):
        jaxcore.make_train_step(model, jaxcore.softmax_cross_entropy, tx, nan_policy="ignore")
    with pytest.raises(jaxcore.ConfigError, match="steps_per_call"):
        jaxcore.make_train_step(model, jaxcore.softmax_cross_entropy, tx, steps_per_call=0)
    with pytest.raises(jaxcore.ConfigError, match="compute dtype"):
        jaxcore.make_train_step(model, jaxcore.softmax_cross_entropy, tx, compute_dtype="fp8")


def test_bf16_compute_keeps_fp32_params_and_close_loss(init16, tmp_path):
    model, batch = mlp_case(rows=16)
    state, step, sharding = setup(model, batch, _mesh(), state=init16)
    _, m32 = step(state, put(batch, sharding))
    state, step16, sharding = setup(model, batch, _mesh(), state=init16, compute_dtype="bf16")
    stats = step16.compile(state, put(batch, sharding), dump_dir=tmp_path)
    state, m16 = step16(state, put(batch, sharding))
    assert step16.compiles == 1  # the call reused the AOT executable
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    np.testing.assert_allclose(float(m16["loss"]), float(m32["loss"]), rtol=2e-2)
    assert "bf16" in (tmp_path / "train_step.hlo.txt").read_text()
    assert "bf16" not in str(jax.make_jaxpr(lambda x: x)(1.0))  # the check can fail
    assert stats.flops_per_step and stats.flops_per_step > 0


def test_a_ragged_accumulation_window_unrolls_like_stacked_micro_batches(init16):
    """``unrolled_micro``: micro-batches of different shapes (a window holding a ragged last
    batch) give the update a stacked window of their means gives; ``per_micro`` reports each
    micro-batch's own values."""
    model, batch = mlp_case(rows=16)
    first, second = ({k: v[:8] for k, v in batch.items()}, {k: v[8:] for k, v in batch.items()})
    mesh = _mesh()

    def means(outputs, b):  # weigh_rows=False: batch means, as a Lightning loss is
        losses, metrics = jaxcore.softmax_cross_entropy(outputs, b)
        return losses.mean(), {k: v.mean() for k, v in metrics.items()}

    def step(**kw):
        state, _, sharding = setup(model, first, mesh, state=init16)
        tx = jaxcore.make_optimizer("adamw", lr=1e-2, weight_decay=1e-4)
        fn = jaxcore.make_train_step(
            model,
            means,
            tx,
            state_sharding=jaxcore.state_shardings(state),
            accum_steps=2,
            weigh_rows=False,
            per_micro=True,
            **kw,
        )
        return state, fn, sharding

    state, stacked, _ = step(stacked_micro=True)
    window = jaxcore.batch_sharding(mesh, steps_per_call=2)
    s1, m1 = stacked(state, put({k: np.stack([first[k], second[k]]) for k in batch}, window))
    state, unrolled, sharding = step(unrolled_micro=True)
    s2, m2 = unrolled(state, (put(first, sharding), put(second, sharding)))
    _close(s2.params, s1.params)
    each = f"{jaxcore.MICRO}accuracy"
    assert m2[each].shape == (2,)
    _close(m2[each], m1[each])
    np.testing.assert_allclose(float(m2["accuracy"]), np.mean(np.asarray(m2[each])), rtol=1e-6)

    state, ragged, sharding = step(unrolled_micro=True)
    _, m3 = ragged(state, (put(batch, sharding), put(second, sharding)))  # 16 then 8 rows
    assert m3[each].shape == (2,) and ragged.compiles == 1


def test_grads_fn_sees_the_steps_mean_gradients_and_may_change_them(init16):
    """``grads_fn`` gets the accumulated mean gradients (those of the full batch), its
    metrics join the step's, and the gradients it returns are the ones applied."""
    model, batch = mlp_case(rows=32)
    mesh = _mesh()

    def norm_and_zero(state, grads):
        norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
        return jax.tree.map(jnp.zeros_like, grads), {"grad_norm": norm}

    init, full, sharding = setup(model, batch, mesh, state=init16)
    _, seen = full(init, put(batch, sharding))
    init2, hooked, _ = setup(
        model, batch, mesh, accum_steps=4, state=init16, grads_fn=norm_and_zero
    )
    before = jax.tree.map(np.asarray, init2.params)
    state, metrics = hooked(init2, put(batch, sharding))
    grads = jax.grad(lambda p: _mean_loss(model, p, init16, batch))(before)
    want = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(grads)))
    np.testing.assert_allclose(float(metrics["grad_norm"]), want, rtol=1e-5)
    assert float(metrics["loss"]) == pytest.approx(float(seen["loss"]), rel=1e-5)
    # zero gradients: AdamW moves the weights by weight decay alone
    decay = jax.tree.map(lambda p: p * (1 - 1e-2 * 1e-4), before)
    _close(state.params, decay, rtol=1e-6)


def _mean_loss(model, params, state, batch):
    outputs, _ = model.apply(params, state.model_state, batch, state.rng, True)
    losses, _ = jaxcore.softmax_cross_entropy(outputs, batch)
    return jnp.mean(losses)


class _Tok(fnn.Module):
    """Token ids -> nn.Embed(30) -> mean -> 3 classes; ``shift`` computes ids in the model."""

    shift: int = 0

    @fnn.compact
    def __call__(self, ids, train=False):
        return fnn.Dense(3)(fnn.Embed(30, 4)(ids + self.shift if self.shift else ids).mean(1))


def _tok_step(policy, shift=0, model=None, **kw):
    model = model or jaxcore.linen_model(_Tok(shift), inputs=("ids",))
    tx = jaxcore.make_optimizer(lr=0.1)
    good = {"ids": jnp.ones((16, 5), jnp.int32), "y": jnp.zeros(16, jnp.int32)}
    st = jaxcore.init_train_state(model, tx, good, seed=0, mesh=_mesh())
    step = jaxcore.make_train_step(
        model,
        jaxcore.softmax_cross_entropy,
        tx,
        state_sharding=jaxcore.state_shardings(st),
        nan_policy=policy,
        donate=False,
        **kw,
    )
    return st, step, good


def test_an_embed_index_past_the_table_refuses_the_step_inside_it():
    """Flax nn.Embed ids checked in the step (micro-batch 2 of 2 holds the bad id): no NaN in
    the params, the error names the field, the table, the value and the step."""
    st, step, good = _tok_step("stop", accum_steps=2)
    st, _ = step(st, good)
    bad = {**good, "ids": good["ids"].at[7, 2].set(49)}  # row 7: micro-batch 1 (rows i, i+2)
    refused, metrics = step(st, bad)
    assert float(metrics["nonfinite"]) == 1.0 and int(refused.nonfinite) == 1
    _close(refused.params, st.params)  # the update was not applied
    assert refused.nonfinite_input.tolist()[0] == -2  # (guard.CHECKED)
    with pytest.raises(jaxcore.BatchError) as err:
        jaxcore.check_finite(refused)
    msg = str(err.value)
    assert "batch field ['ids'] indexes the Flax nn.Embed Embed_0 of 30 rows" in msg, msg
    assert "holds 49 at step 1 (refused" in msg and "IndexError" in msg and "Fix:" in msg, msg
    again, _ = step(refused, good)  # under "stop" every later update is refused too
    _close(again.params, st.params)


def test_an_nnx_embed_index_past_the_table_refuses_the_step_inside_it():
    """Flax NNX nnx.Embed ids checked in the step too (NNX has no method interception): before,
    id 49 of a 30-row table trained into NaN ("Fix: lower the learning rate")."""
    from flax import nnx

    class Tok(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(30, 4, rngs=rngs)
            self.head = nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, ids):
            return self.head(self.embed(ids).mean(1))

    model = jaxcore.nnx_model(Tok(nnx.Rngs(0)), inputs=("ids",))
    st, step, good = _tok_step("stop", model=model)
    refused, metrics = step(st, {**good, "ids": good["ids"].at[3, 1].set(49)})
    assert float(metrics["nonfinite"]) == 1.0
    assert all(np.isfinite(v).all() for v in jax.tree.leaves(refused.params))
    with pytest.raises(jaxcore.BatchError) as err:
        jaxcore.check_finite(refused)
    msg = str(err.value)
    assert "batch field ['ids'] indexes the Flax nnx.Embed of 30 rows" in msg, msg
    assert "holds 49 at step 0" in msg and "IndexError" in msg, msg
    assert nnx.Embed.__call__.__name__ == "__call__"  # the class is left as it was


def test_a_computed_index_is_skipped_under_skip_and_the_next_step_trains():
    st, step, good = _tok_step("skip", shift=-1, steps_per_call=2)
    two = jax.tree.map(lambda v: jnp.stack([v - 1, v]), good)  # step 1: ids 0 - 1 = -1
    new, metrics = step(st, two)
    assert metrics["nonfinite"].tolist() == [1.0, 0.0] and int(new.nonfinite) == 1
    assert all(np.isfinite(v).all() for v in jax.tree.leaves(new.params))
    assert not np.allclose(new.params["Dense_0"]["kernel"], st.params["Dense_0"]["kernel"])
    where = new.nonfinite_input.tolist()  # [CHECKED, code, value, ...]: -1 = 0 + shift
    assert where[0] == -2 and where[2] == -1, where


def test_an_input_check_outside_a_step_or_inside_a_model_transform_does_nothing():
    from jaxcore.guard import NO_CHECK, checking, index_check

    index_check(jnp.array([99]), 30, "unseen {value}")  # eager, no step: nothing to record

    def forward(ids):
        with checking({"ids": ids}) as checks:
            jax.lax.cond(ids[0] > 0, lambda: index_check(ids, 30, "inner {value}"), lambda: None)
            return checks.result()

    assert jax.jit(forward)(jnp.array([99])).tolist() == list(NO_CHECK)  # (no leaked tracer)


def test_a_step_that_does_not_train_reports_its_input_checks_for_the_epoch_end():
    """Evaluation: checked_forward gives each batch's check, first_failed keeps the epoch's
    first on device, raise_failed names it where the shell syncs."""
    from jaxcore.guard import NO_CHECK, checked_forward, first_failed, raise_failed

    st, _, good = _tok_step("stop")
    model = jaxcore.linen_model(_Tok(), inputs=("ids",))
    forward = jax.jit(
        checked_forward(lambda s, b: model.apply(s.params, s.model_state, b, s.rng, False)[0])
    )
    epoch = jnp.array(NO_CHECK)
    for ids in (good["ids"], good["ids"].at[2, 1].set(-3), good["ids"].at[0, 0].set(31)):
        _, check = forward(st, {**good, "ids": ids})
        epoch = first_failed(epoch, check)
    with pytest.raises(jaxcore.BatchError, match=r"\['ids'\] .* of 30 rows, but holds -3 in a val"):
        raise_failed(epoch, "in a validation batch")
