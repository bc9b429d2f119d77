"""A team's Flax model as it is written: a linen ``__call__`` with no mode argument (or
``deterministic=``), and an NNX module; each trained through ``JaxModule`` on a plain
``TensorDataset`` and compared with the same model trained by a hand-written optax loop."""

from __future__ import annotations

from typing import Any

import flax.linen as linen
import jax
import jax.numpy as jnp
import lightning as L
import numpy as np
import optax
import torch
from flax import nnx
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import quiet_trainer
from torchshell import JaxModule

STEPS, BATCH = 6, 16


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).to(torch.int32))


def _mean_ce(out: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean()


def _fit(model: Any) -> tuple[JaxModule, L.Trainer]:
    jm = JaxModule(model, _mean_ce, optax.sgd(0.3), print_summary=False)
    trainer = quiet_trainer(max_steps=STEPS)  # (fewer steps than log_every_n_steps)
    trainer.fit(jm, DataLoader(_data(), batch_size=BATCH))
    return jm, trainer


def _batches() -> list[tuple[jax.Array, jax.Array]]:
    x, y = _data().tensors
    return [
        (jnp.asarray(x[i : i + BATCH].numpy()), jnp.asarray(y[i : i + BATCH].numpy()))
        for i in range(0, STEPS * BATCH, BATCH)
    ]


class Plain(linen.Module):
    """No ``train`` argument: the most common way a small linen model is written."""

    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return linen.Dense(2)(linen.tanh(linen.Dense(16)(x)))


class Deterministic(linen.Module):
    """Flax's own convention: ``deterministic=`` (the negation of train mode)."""

    @linen.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        h = linen.Dropout(0.5, deterministic=deterministic)(linen.Dense(16)(x))
        return linen.Dense(2)(h)


def test_a_linen_model_without_a_mode_argument_trains_like_a_plain_optax_loop() -> None:
    jm, trainer = _fit(Plain())
    params = jm.state.params
    # the same math from the initial params coreshell drew (jaxcore.init_train_state's key)
    init_key, _ = jax.random.split(jax.random.key(jm.seed))
    start, _ = jm.model_fns.init(init_key, {"x": jnp.ones((BATCH, 6))})
    tx = optax.sgd(0.3)
    p, opt = start, tx.init(start)
    for x, y in _batches():
        loss, grads = jax.value_and_grad(
            lambda q: _mean_ce(Plain().apply({"params": q}, x), {"y": y})  # noqa: B023
        )(p)
        updates, opt = tx.update(grads, opt, p)
        p = optax.apply_updates(p, updates)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # a run shorter than log_every_n_steps still ends with its last step's loss, as in Lightning
    logged = trainer.callback_metrics["train/loss"]
    np.testing.assert_allclose(float(logged), float(loss), rtol=1e-5)


def test_deterministic_is_the_negated_mode() -> None:
    fns = JaxModule(Deterministic(), _mean_ce, optax.sgd(0.1), print_summary=False).model_fns
    batch = {"x": jnp.ones((4, 6))}
    params, state = fns.init(jax.random.key(0), batch)
    train = [fns.apply(params, state, batch, jax.random.key(k), True)[0] for k in (1, 2)]
    evals = [fns.apply(params, state, batch, jax.random.key(k), False)[0] for k in (1, 2)]
    assert not np.allclose(train[0], train[1])  # dropout on, a new draw per key
    np.testing.assert_array_equal(evals[0], evals[1])  # off in eval


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.0) -> None:
        self.l1 = nnx.Linear(6, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.l2 = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def test_an_nnx_module_trains_like_a_plain_nnx_loop_batch_stats_included() -> None:
    jm, _ = _fit(Net(nnx.Rngs(0)))
    assert set(jm.state.params) == {"l1", "bn", "l2"}  # plain nested dicts, by attribute

    model = Net(nnx.Rngs(0))  # the same initial weights: the module's own
    optimizer = nnx.Optimizer(model, optax.sgd(0.3), wrt=nnx.Param)
    for x, y in _batches():
        grads = nnx.grad(lambda m: _mean_ce(m(x), {"y": y}))(model)  # noqa: B023
        optimizer.update(model, grads)
    expected = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    got = jax.device_get((jm.state.params, jm.state.model_state))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves((expected, stats)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


class Twin(torch.nn.Module):
    """The torch twin of ``Net``, for export."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.bn, self.l2 = (
            torch.nn.Linear(6, 16),
            torch.nn.BatchNorm1d(16),
            torch.nn.Linear(16, 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.bn(self.l1(x))))


def test_a_trained_nnx_module_exports_to_its_torch_twin_with_parity() -> None:
    jm, _ = _fit(Net(nnx.Rngs(0)))
    twin = Twin()
    twin.load_state_dict(jm.torch_state_dict(twin), strict=True)  # batch stats included
    x = np.random.default_rng(0).normal(size=(5, 6)).astype(np.float32)
    out, _ = jm.model_fns.apply(
        jm.state.params, jm.state.model_state, {"x": jnp.asarray(x)}, jax.random.key(0), False
    )
    with torch.no_grad():
        expected = twin.eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)


def test_nnx_dropout_draws_from_the_step_key_and_eval_is_deterministic() -> None:
    net = Net(nnx.Rngs(0), dropout=0.5)
    before = nnx.to_pure_dict(nnx.state(net, nnx.Param))
    fns = JaxModule(net, _mean_ce, optax.sgd(0.1), print_summary=False).model_fns
    batch = {"x": jax.random.normal(jax.random.key(3), (8, 6))}
    params, state = fns.init(jax.random.key(0), batch)
    train = [fns.apply(params, state, batch, jax.random.key(k), True)[0] for k in (1, 1, 2)]
    np.testing.assert_array_equal(train[0], train[1])  # fixed by the key
    assert not np.allclose(train[0], train[2])  # a new draw for another key
    evals = [fns.apply(params, state, batch, jax.random.key(k), False)[0] for k in (1, 2)]
    np.testing.assert_array_equal(evals[0], evals[1])
    jax.tree.map(np.testing.assert_array_equal, before, nnx.to_pure_dict(nnx.state(net, nnx.Param)))
