"""torch.optim's update math as pure JAX functions, and the param-group driver around them.

Each rule follows the installed torch's single-tensor kernel line by line (same operation order,
same scalar placement), computes the new parameter exactly as torch would, and returns the
optax update ``new - old`` (``optax.apply_updates`` then lands on torch's value to the last bit
in the common case, where old and new are within a factor of two). Hyperparameters arrive per
group and per step as a mapping: Python numbers when constant, traced float32 scalars when a
scheduler moves them.

Caveat (zero gradients): torch skips a parameter whose ``.grad`` is ``None`` (it took no part in
the loss); JAX always has a gradient, zeros for such a parameter, so momentum, Adam moments and
decoupled weight decay still move it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

Hyper = Mapping[str, Any]
Slots = dict[str, jax.Array]


class TorchOptState(NamedTuple):
    """Optax state of a mapped torch optimizer.

    Attributes:
        step: optimizer steps taken so far (int32); the step about to run is ``step``.
        slots: per parameter name, torch's per-parameter state (momentum buffer, moments...).
        scale: per param group, a factor on the tabulated lr set on the host between steps
            (``ReduceLROnPlateau``); ``None`` when no scheduler needs it.
    """

    step: jax.Array
    slots: dict[str, Slots]
    scale: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One torch param group: its parameter names and hyperparameters.

    Attributes:
        names: the state_dict names of the group's (trainable) parameters.
        const: hyperparameters that stay fixed for the run (numbers and flags).
        tables: hyperparameters a scheduler moves: one float32 value per optimizer step.
    """

    names: tuple[str, ...]
    const: Mapping[str, Any]
    tables: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def at(self, step: jax.Array | int) -> dict[str, Any]:
        """Hyperparameters used at optimizer step ``step`` (0-based; tables clamp at the end).

        >>> g = GroupSpec(("w",), {"lr": 0.1}, {"momentum": np.array([0.9, 0.8], np.float32)})
        >>> hp = g.at(5)
        >>> hp["lr"], float(hp["momentum"])
        (0.1, 0.800000011920929)
        """
        hp: dict[str, Any] = dict(self.const)
        for key, table in self.tables.items():
            idx = jnp.clip(jnp.asarray(step, jnp.int32), 0, table.shape[0] - 1)
            hp[key] = jnp.asarray(table, jnp.float32)[idx]
        return hp


class Rule(NamedTuple):
    """One optimizer's math: per-parameter state init and the per-parameter step."""

    init: Callable[[jax.Array, Hyper], Slots]
    step: Callable[[jax.Array, jax.Array, Slots, Hyper, jax.Array], tuple[jax.Array, Slots]]


def _is_zero(x: Any) -> bool:
    return isinstance(x, (int, float)) and x == 0


def _lerp(a: jax.Array, b: jax.Array, w: Any) -> jax.Array:
    """torch.lerp's CPU formula: ``a + w*(b-a)`` for ``|w| < 0.5``, else ``b - (b-a)*(1-w)``."""
    if isinstance(w, (int, float)):
        return a + w * (b - a) if abs(w) < 0.5 else b - (b - a) * (1 - w)
    return jnp.where(jnp.abs(w) < 0.5, a + w * (b - a), b - (b - a) * (1 - w))


def _one_minus_pow(beta: Any, t: jax.Array) -> jax.Array:
    """``1 - beta**t`` without float32 cancellation (torch computes it in float64)."""
    log_beta = math.log(beta) if isinstance(beta, (int, float)) else jnp.log(beta)
    return -jnp.expm1(t * log_beta)


def _coupled_decay(g: jax.Array, p: jax.Array, hp: Hyper) -> jax.Array:
    g = -g if hp["maximize"] else g
    if not _is_zero(hp["weight_decay"]):
        g = g + hp["weight_decay"] * p
    return g


# --- SGD -------------------------------------------------------------------------------------


def _sgd_init(p: jax.Array, hp: Hyper) -> Slots:
    if _is_zero(hp["momentum"]) and "momentum" not in hp.get("_scheduled", ()):
        return {}
    return {"momentum_buffer": jnp.zeros_like(p), "has_momentum_buffer": jnp.zeros((), jnp.bool_)}


def _sgd_step(
    g: jax.Array, p: jax.Array, s: Slots, hp: Hyper, t: jax.Array
) -> tuple[jax.Array, Slots]:
    g = _coupled_decay(g, p, hp)
    if s:
        m, damp = hp["momentum"], hp["dampening"]
        buf = jnp.where(s["has_momentum_buffer"], s["momentum_buffer"] * m + (1 - damp) * g, g)
        d = g + m * buf if hp["nesterov"] else buf
        if isinstance(m, (int, float)):
            s = {"momentum_buffer": buf, "has_momentum_buffer": jnp.ones((), jnp.bool_)}
        else:  # a scheduler moves momentum; torch skips the buffer while it is 0
            active = m != 0
            s = {
                "momentum_buffer": jnp.where(active, buf, s["momentum_buffer"]),
                "has_momentum_buffer": s["has_momentum_buffer"] | active,
            }
            d = jnp.where(active, d, g)
        g = d
    return (p + (-hp["lr"]) * g) - p, s


SGD = Rule(_sgd_init, _sgd_step)


# --- Adam / AdamW ----------------------------------------------------------------------------


def _adam_init(p: jax.Array, hp: Hyper) -> Slots:
    s = {"exp_avg": jnp.zeros_like(p), "exp_avg_sq": jnp.zeros_like(p)}
    if hp["amsgrad"]:
        s["max_exp_avg_sq"] = jnp.zeros_like(p)
    return s


def _adam_step(
    g: jax.Array, p: jax.Array, s: Slots, hp: Hyper, t: jax.Array
) -> tuple[jax.Array, Slots]:
    lr, wd, b1, b2 = hp["lr"], hp["weight_decay"], hp["beta1"], hp["beta2"]
    g = -g if hp["maximize"] else g
    new_p = p
    if not _is_zero(wd):
        if hp["decoupled_weight_decay"]:
            new_p = p * (1 - lr * wd)
        else:
            g = g + wd * p
    exp_avg = _lerp(s["exp_avg"], g, 1 - b1)
    exp_avg_sq = s["exp_avg_sq"] * b2 + (1 - b2) * g * g
    out = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    step_size = lr / _one_minus_pow(b1, t)
    bc2_sqrt = jnp.sqrt(_one_minus_pow(b2, t))
    v = exp_avg_sq
    if hp["amsgrad"]:
        v = out["max_exp_avg_sq"] = jnp.maximum(s["max_exp_avg_sq"], exp_avg_sq)
    denom = jnp.sqrt(v) / bc2_sqrt + hp["eps"]
    new_p = new_p + (-step_size) * (exp_avg / denom)
    return new_p - p, out


ADAM = Rule(_adam_init, _adam_step)


# --- RMSprop ---------------------------------------------------------------------------------


def _rmsprop_init(p: jax.Array, hp: Hyper) -> Slots:
    s = {"square_avg": jnp.zeros_like(p)}
    if not _is_zero(hp["momentum"]) or "momentum" in hp.get("_scheduled", ()):
        s["momentum_buffer"] = jnp.zeros_like(p)
    if hp["centered"]:
        s["grad_avg"] = jnp.zeros_like(p)
    return s


def _rmsprop_step(
    g: jax.Array, p: jax.Array, s: Slots, hp: Hyper, t: jax.Array
) -> tuple[jax.Array, Slots]:
    alpha, lr, m = hp["alpha"], hp["lr"], hp["momentum"]
    g = _coupled_decay(g, p, hp)
    square_avg = s["square_avg"] * alpha + (1 - alpha) * g * g
    out = {"square_avg": square_avg}
    if hp["centered"]:
        grad_avg = out["grad_avg"] = _lerp(s["grad_avg"], g, 1 - alpha)
        avg = jnp.sqrt(square_avg + (-1) * grad_avg * grad_avg)
    else:
        avg = jnp.sqrt(square_avg)
    avg = avg + hp["eps"]
    plain = p + (-lr) * (g / avg)
    if "momentum_buffer" not in s:
        return plain - p, out
    buf = s["momentum_buffer"] * m + g / avg
    with_momentum = p + (-lr) * buf
    if isinstance(m, (int, float)):
        out["momentum_buffer"] = buf
        return with_momentum - p, out
    out["momentum_buffer"] = jnp.where(m > 0, buf, s["momentum_buffer"])
    return jnp.where(m > 0, with_momentum, plain) - p, out


RMSPROP = Rule(_rmsprop_init, _rmsprop_step)


# --- Adagrad ---------------------------------------------------------------------------------


def _adagrad_init(p: jax.Array, hp: Hyper) -> Slots:
    return {"sum": jnp.full_like(p, hp["initial_accumulator_value"])}


def _adagrad_step(
    g: jax.Array, p: jax.Array, s: Slots, hp: Hyper, t: jax.Array
) -> tuple[jax.Array, Slots]:
    g = _coupled_decay(g, p, hp)
    clr = hp["lr"] / (1 + (t - 1) * hp["lr_decay"])
    state_sum = s["sum"] + g * g
    std = jnp.sqrt(state_sum) + hp["eps"]
    return (p + (-clr) * (g / std)) - p, {"sum": state_sum}


ADAGRAD = Rule(_adagrad_init, _adagrad_step)


# --- Adamax ----------------------------------------------------------------------------------


def _adamax_init(p: jax.Array, hp: Hyper) -> Slots:
    return {"exp_avg": jnp.zeros_like(p), "exp_inf": jnp.zeros_like(p)}


def _adamax_step(
    g: jax.Array, p: jax.Array, s: Slots, hp: Hyper, t: jax.Array
) -> tuple[jax.Array, Slots]:
    g = _coupled_decay(g, p, hp)
    exp_avg = _lerp(s["exp_avg"], g, 1 - hp["beta1"])
    exp_inf = jnp.maximum(s["exp_inf"] * hp["beta2"], jnp.abs(g) + hp["eps"])
    clr = hp["lr"] / _one_minus_pow(hp["beta1"], t)
    return (p + (-clr) * (exp_avg / exp_inf)) - p, {"exp_avg": exp_avg, "exp_inf": exp_inf}


ADAMAX = Rule(_adamax_init, _adamax_step)


def _decay(g: jax.Array, p: jax.Array, hp: Hyper) -> tuple[jax.Array, jax.Array]:
    """NAdam/RAdam: ``(grad, param)`` after L2 or decoupled weight decay."""
    g = -g if hp["maximize"] else g
    if _is_zero(hp["weight_decay"]):
        return g, p
    if hp["decoupled_weight_decay"]:
        return g, p * (1 - hp["lr"] * hp["weight_decay"])
    return g + hp["weight_decay"] * p, p


# --- NAdam -----------------------------------------------------------------------------------


def _nadam_init(p: jax.Array, hp: Hyper) -> Slots:
    return {
        "exp_avg": jnp.zeros_like(p),
        "exp_avg_sq": jnp.zeros_like(p),
        "mu_product": jnp.ones((), jnp.float32),
    }


def _nadam_step(
    g: jax.Array, p: jax.Array, s: Slots, hp: Hyper, t: jax.Array
) -> tuple[jax.Array, Slots]:
    lr, b1, b2, decay = hp["lr"], hp["beta1"], hp["beta2"], hp["momentum_decay"]
    g, new_p = _decay(g, p, hp)
    mu = b1 * (1.0 - 0.5 * (0.96 ** (t * decay)))
    mu_next = b1 * (1.0 - 0.5 * (0.96 ** ((t + 1) * decay)))
    mu_product = s["mu_product"] * mu  # a float32 tensor in torch too
    exp_avg = _lerp(s["exp_avg"], g, 1 - b1)
    exp_avg_sq = s["exp_avg_sq"] * b2 + (1 - b2) * g * g
    denom = jnp.sqrt(exp_avg_sq / _one_minus_pow(b2, t)) + hp["eps"]
    new_p = new_p + (-lr * (1.0 - mu) / (1.0 - mu_product)) * (g / denom)
    new_p = new_p + ((-lr * mu_next) / (1.0 - mu_product * mu_next)) * (exp_avg / denom)
    slots = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "mu_product": mu_product}
    return new_p - p, slots


NADAM = Rule(_nadam_init, _nadam_step)


# --- RAdam -----------------------------------------------------------------------------------


def _radam_init(p: jax.Array, hp: Hyper) -> Slots:
    return {"exp_avg": jnp.zeros_like(p), "exp_avg_sq": jnp.zeros_like(p)}


def _radam_step(
    g: jax.Array, p: jax.Array, s: Slots, hp: Hyper, t: jax.Array
) -> tuple[jax.Array, Slots]:
    lr, b1, b2 = hp["lr"], hp["beta1"], hp["beta2"]
    g, new_p = _decay(g, p, hp)
    exp_avg = _lerp(s["exp_avg"], g, 1 - b1)
    exp_avg_sq = s["exp_avg_sq"] * b2 + (1 - b2) * g * g
    bc1, bc2 = _one_minus_pow(b1, t), _one_minus_pow(b2, t)
    corrected = exp_avg / bc1
    rho_inf = 2 / (1 - b2) - 1
    rho_t = rho_inf - 2 * t * (b2**t) / bc2
    safe = jnp.maximum(rho_t, 5.0)  # (the rectified branch runs only where rho_t > 5)
    rect = jnp.sqrt((safe - 4) * (safe - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * safe))
    adaptive = jnp.sqrt(bc2) / (jnp.sqrt(exp_avg_sq) + hp["eps"])
    rectified = new_p + (-1.0) * (corrected * lr * adaptive * rect)
    plain = new_p + (-1.0) * (corrected * lr)
    return jnp.where(rho_t > 5.0, rectified, plain) - p, {
        "exp_avg": exp_avg,
        "exp_avg_sq": exp_avg_sq,
    }


RADAM = Rule(_radam_init, _radam_step)


# --- the driver ------------------------------------------------------------------------------


def grouped(
    rule: Rule, groups: Sequence[GroupSpec], scaled: bool = False
) -> optax.GradientTransformation:
    """An optax transformation running ``rule`` on flat ``{name: array}`` params, by group.

    A parameter in no group gets a zero update (torch never touches it). The state holds the
    optimizer step count, which also indexes the scheduled hyperparameter tables, and with
    ``scaled`` a per-group factor on the lr (``state.scale``, set on the host).

    >>> import jax.numpy as jnp, optax
    >>> hp = {"lr": 0.5, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0,
    ...       "nesterov": False, "maximize": False}
    >>> tx = grouped(SGD, [GroupSpec(("w",), hp)])
    >>> params = {"w": jnp.ones(2), "frozen": jnp.ones(2)}
    >>> grads = {"w": jnp.ones(2), "frozen": jnp.ones(2)}
    >>> u, state = tx.update(grads, tx.init(params), params)
    >>> optax.apply_updates(params, u)["w"].tolist(), u["frozen"].tolist(), int(state.step)
    ([0.5, 0.5], [0.0, 0.0], 1)
    """
    label = {name: i for i, group in enumerate(groups) for name in group.names}

    def with_scheduled(group: GroupSpec, hp: dict[str, Any]) -> dict[str, Any]:
        hp["_scheduled"] = tuple(group.tables)
        return hp

    def init(params: Mapping[str, jax.Array]) -> TorchOptState:
        _check_flat(params)
        hps = [with_scheduled(g, g.at(0)) for g in groups]
        slots = {n: rule.init(p, hps[label[n]]) for n, p in params.items() if n in label}
        scale = jnp.ones(len(groups), jnp.float32) if scaled else None
        return TorchOptState(jnp.zeros([], jnp.int32), slots, scale)

    def update(
        updates: Mapping[str, jax.Array],
        state: TorchOptState,
        params: Mapping[str, jax.Array] | None = None,
    ) -> tuple[dict[str, jax.Array], TorchOptState]:
        if params is None:
            raise ValueError("a mapped torch optimizer needs params: call tx.update(g, s, params)")
        _check_flat(updates)
        hps = [with_scheduled(g, g.at(state.step)) for g in groups]
        if state.scale is not None:
            for i, hp in enumerate(hps):
                hp["lr"] = hp["lr"] * state.scale[i]
        t = (state.step + 1).astype(jnp.float32)
        out: dict[str, jax.Array] = {}
        slots: dict[str, Slots] = {}
        for name, g in updates.items():
            if name not in label:
                out[name] = jnp.zeros_like(g)
                continue
            p = params[name]
            u, slots[name] = rule.step(g, p, state.slots[name], hps[label[name]], t)
            out[name] = u.astype(p.dtype)
        return out, TorchOptState(optax.safe_increment(state.step), slots, state.scale)

    return optax.GradientTransformation(init, update)  # type: ignore[arg-type]


def _check_flat(tree: Any) -> None:
    if not isinstance(tree, Mapping):
        raise TypeError(
            "a mapped torch optimizer expects flat params {state_dict name: array}, "
            f"got {type(tree).__name__}"
        )
