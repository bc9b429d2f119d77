"""Helpers for the optimizer-mapping tests: a tiny torch model, fixed batches, and a replay."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from torch import nn

N_STEPS = 8


def net(seed: int = 0) -> nn.Module:
    """``Linear(8,16) - Tanh - Linear(16,3)`` with seeded weights."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def batches(n: int = N_STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` fixed random ``(x, y)`` batches of 16."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)
    ]


def to_jax(tensors: dict[str, torch.Tensor]) -> dict[str, jax.Array]:
    """A ``{name: tensor}`` dict as ``{name: jax array}`` (a copy)."""
    return {k: jnp.asarray(v.detach().numpy().copy()) for k, v in tensors.items()}


def torch_run(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step_scheduler: Callable[[int], None],
    data: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """Plain torch training: per step the grads (before the step) and the params (after)."""
    grads, params = [], []
    for t, (x, y) in enumerate(data):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        step_scheduler(t)
        params.append(
            {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        )
    return grads, params


def lightning_stepper(
    schedulers: Sequence[Any],
    *,
    interval: str = "step",
    frequency: int = 1,
    steps_per_epoch: int = 3,
) -> Callable[[int], None]:
    """Steps ``schedulers`` after optimizer step ``t`` as Lightning does (no accumulating)."""

    def step(t: int) -> None:
        in_epoch = t % steps_per_epoch
        if interval == "step" and (in_epoch + 1) % frequency == 0:
            for s in schedulers:
                s.step()
        epoch_end = interval == "epoch" and in_epoch == steps_per_epoch - 1
        if epoch_end and (t // steps_per_epoch + 1) % frequency == 0:
            for s in schedulers:
                s.step()

    return step


def jax_replay(
    tx: optax.GradientTransformation,
    params: dict[str, jax.Array],
    grads: Sequence[dict[str, torch.Tensor]],
    *,
    state: Any = None,
    return_state: bool = False,
) -> Any:
    """Applies jitted ``tx`` to torch's recorded grads; the params after every step.

    With ``return_state``: ``(params after every step, the final optimizer state)``.
    """
    update = jax.jit(tx.update)
    state = tx.init(params) if state is None else state
    out = []
    for g in grads:
        jg = to_jax(g)
        jg = {n: jg.get(n, jnp.zeros_like(p)) for n, p in params.items()}
        updates, state = update(jg, state, params)
        params = optax.apply_updates(params, updates)
        out.append(params)
    return (out, state) if return_state else out


def max_rel_err(
    torch_params: Sequence[dict[str, torch.Tensor]],
    jax_params: Sequence[dict[str, jax.Array]],
    floor: float = 1e-2,
) -> float:
    """The worst ``|a - b| / (floor + |a|)`` over every step and parameter.

    ``err < rtol`` is ``assert_allclose(rtol=rtol, atol=rtol * floor)``: the floor keeps weights
    that pass near zero (where float32 rounding of O(1) terms dominates) from reading as large
    relative errors.
    """
    worst = 0.0
    for tp, jp in zip(torch_params, jax_params, strict=True):
        for name, t in tp.items():
            a, b = t.numpy(), np.asarray(jp[name])
            worst = max(worst, float(np.max(np.abs(a - b) / (floor + np.abs(a)))))
    return worst


def agree(
    runs: dict[str, tuple[Any, Any]],
    series: tuple[str, ...] = ("train_loss",),
    rtol: float = 1e-5,
    skip: Callable[[str], Any] = lambda name: None,
    ignore: tuple[str, ...] = (),
) -> None:
    """A plain Lightning run and a coreshell run (``runs["plain"]``, ``runs["jax"]``: each
    ``(trainer, the user's module)``) agree: the logged ``series``, ``callback_metrics`` (but
    ``ignore``) and the final ``state_dict``s (``skip(name)`` gives rows of a weight to leave
    out: a parameter Adam moves by float noise)."""
    (ref, plain), (ours, user) = runs["plain"], runs["jax"]
    for name in series:
        want = ref.logger.series(name)
        assert want, name
        np.testing.assert_allclose(ours.logger.series(name), want, rtol=rtol, err_msg=name)
    assert set(ours.callback_metrics) >= set(ref.callback_metrics)
    for name, value in ref.callback_metrics.items():
        if name not in ignore:
            got = float(ours.callback_metrics[name])
            np.testing.assert_allclose(got, float(value), rtol=rtol, atol=1e-7, err_msg=name)
    state = user.state_dict()
    for name, value in plain.state_dict().items():
        a, b = value.numpy(), state[name].numpy()
        if (drop := skip(name)) is not None:
            a, b = np.delete(a, drop, axis=0), np.delete(b, drop, axis=0)
        np.testing.assert_allclose(b, a, rtol=rtol, atol=rtol * 1e-2, err_msg=name)
