"""The train step chained from jaxcore's transforms at the call site, as the shell builds it
(issue #53): each behaviour is the presence of a transform, not a keyword switch."""

import jax
import numpy as np

import jaxcore
from tests.jaxcore.models import mlp_case, put


def _state(model, batch, mesh, tx):
    sample = {k: v[0] for k, v in batch.items()}
    return jaxcore.init_train_state(model, tx, sample, seed=0, mesh=mesh)


def test_a_stacked_window_under_stop_numbers_a_bad_row_within_the_window():
    """An accumulation window (``accumulate(..., stacked=True)``) tells ``train_step`` how its
    ``[m, B, ...]`` batch reads as rows: the guard names row ``B + 3`` of the window's ``m*B``
    (the caller passes no ``input_rows``), as ``make_train_step(stacked_micro=True)`` does."""
    mesh = jaxcore.make_mesh({"data": 8})
    model, one = mlp_case(rows=8)
    window = {k: np.stack([v, v]) for k, v in one.items()}  # m=2 micro-batches of 8 rows
    window["x"][1, 3, 0] = np.nan
    tx = jaxcore.make_optimizer("sgd", lr=0.1)
    sharding = jaxcore.batch_sharding(mesh, steps_per_call=2)  # ([m, B]: rows on the data axis)
    grad_fn = jaxcore.accumulate(
        jaxcore.row_grads(model, jaxcore.softmax_cross_entropy), 2, stacked=True
    )
    assert isinstance(grad_fn, jaxcore.Window) and grad_fn.loop_free is not None
    step = jaxcore.train_step(grad_fn, tx, hooks=[jaxcore.scale_grads(0.5)], nan_policy="stop")
    state = _state(model, window, mesh, tx)
    jitted = jaxcore.jit_step(step, state_sharding=jaxcore.state_shardings(state))
    state, metrics = jitted(state, put(window, sharding))
    assert float(metrics["nonfinite"]) == 1.0
    assert state.nonfinite_input.tolist()[:3] == [0, 16, 11]  # field 'x', 16 rows, row 8 + 3
    assert jitted.compiles == 1


def test_the_chain_is_make_train_step_without_its_switches():
    """``accumulate`` + ``train_step`` + ``k_steps`` + ``jit_step`` give the same state, metrics,
    compile count and cost figures as ``make_train_step(accum_steps=2, steps_per_call=2)``."""
    mesh = jaxcore.make_mesh({"data": 8})
    model, one = mlp_case(rows=16)
    rng = np.random.default_rng(5)
    batches = {k: np.stack([v, v[rng.permutation(16)]]) for k, v in one.items()}  # K=2
    tx = jaxcore.make_optimizer("adamw", lr=1e-2)
    sharding = jaxcore.batch_sharding(mesh, steps_per_call=2)
    results = []
    for chained in (True, False):
        state = _state(model, batches, mesh, tx)
        shardings = jaxcore.state_shardings(state)
        if chained:
            grad_fn = jaxcore.accumulate(jaxcore.row_grads(model, jaxcore.softmax_cross_entropy), 2)
            step = jaxcore.k_steps(jaxcore.train_step(grad_fn, tx, nan_policy="skip"), 2)
            jitted = jaxcore.jit_step(step, state_sharding=shardings, batch_sharding=sharding)
        else:
            jitted = jaxcore.make_train_step(
                model, jaxcore.softmax_cross_entropy, tx, state_sharding=shardings,
                batch_sharding=sharding, accum_steps=2, steps_per_call=2, nan_policy="skip",
            )  # fmt: skip
        placed = put(batches, sharding)
        stats = jitted.compile(state, placed)
        state, metrics = jitted(state, placed)
        results.append((jax.device_get(state.params), jax.device_get(metrics), jitted, stats))
    (p1, m1, s1, c1), (p2, m2, s2, c2) = results
    jax.tree.map(np.testing.assert_array_equal, (p1, m1), (p2, m2))
    assert s1.steps_per_call == s2.steps_per_call == 2 and s1.compiles == s2.compiles == 1
    assert c1.flops_per_step == c2.flops_per_step and c1.flops_per_step
