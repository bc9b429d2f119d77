"""configure_optimizers -> optax: torch's update math, param groups, schedulers, refusals, clip."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import lightning as L
import numpy as np
import optax
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.optim import lr_scheduler as S
from torch.utils.data import DataLoader, TensorDataset

from tests.torchshell import port_helpers as H
from torchshell._errors import ConfigError
from torchshell.adapters._clip import torch_clip
from torchshell.optim import map_configure_optimizers, state_from_torch, state_to_torch

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd-damp-wd": lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=0.8, dampening=0.3, weight_decay=1e-2
    ),
    "sgd-nesterov-max": lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=0.9, nesterov=True, maximize=True, weight_decay=1e-3
    ),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam-l2-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "adam-betas-max": lambda p: torch.optim.Adam(
        p, lr=3e-3, betas=(0.3, 0.99), eps=1e-6, maximize=True
    ),
    "adam-decoupled": lambda p: torch.optim.Adam(
        p, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True
    ),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "adamw-wd-amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.3, amsgrad=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2),
    "rmsprop-centered-mom-wd": lambda p: torch.optim.RMSprop(
        p, lr=1e-3, alpha=0.9, eps=1e-5, centered=True, momentum=0.7, weight_decay=1e-2
    ),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "adamax": lambda p: torch.optim.Adamax(p, lr=2e-2),
    "adamax-wd-max": lambda p: torch.optim.Adamax(
        p, lr=2e-2, betas=(0.8, 0.99), weight_decay=0.1, maximize=True
    ),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "nadam-decay-wd": lambda p: torch.optim.NAdam(p, lr=1e-2, weight_decay=0.1, momentum_decay=0.1),
    "nadam-decoupled": lambda p: torch.optim.NAdam(
        p, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True
    ),
    "radam": lambda p: torch.optim.RAdam(p, lr=1e-2, betas=(0.9, 0.9)),  # rectified at step 6+
    "radam-wd": lambda p: torch.optim.RAdam(p, lr=1e-2, weight_decay=0.1),  # never rectified
    "radam-decoupled-max": lambda p: torch.optim.RAdam(
        p, lr=1e-2, betas=(0.9, 0.8), weight_decay=0.1, decoupled_weight_decay=True, maximize=True
    ),
    "adagrad-decay-wd-init": lambda p: torch.optim.Adagrad(
        p, lr=0.1, lr_decay=0.1, weight_decay=1e-2, initial_accumulator_value=0.1, eps=1e-8
    ),
}


def _replay(
    make_opt: Callable[[Any], torch.optim.Optimizer],
    make_sched: Callable[[torch.optim.Optimizer], Any] | None = None,
    *,
    interval: str = "step",
    frequency: int = 1,
) -> tuple[float, Any]:
    model = H.net()
    params0 = H.to_jax(dict(model.named_parameters()))
    opt = make_opt(model.parameters())
    scheds = [] if make_sched is None else [make_sched(opt)]
    returned: Any = opt
    if scheds:
        returned = ([opt], [{"scheduler": scheds[0], "interval": interval, "frequency": frequency}])
    mapped = map_configure_optimizers(
        returned, dict(model.named_parameters()), steps_per_epoch=3, total_steps=H.N_STEPS
    )
    lrs_torch = []

    def step(t: int) -> None:
        H.lightning_stepper(scheds, interval=interval, frequency=frequency)(t)
        lrs_torch.append([g["lr"] for g in opt.param_groups])

    first_lr = [g["lr"] for g in opt.param_groups]
    grads, torch_params = H.torch_run(model, opt, step, H.batches())
    jax_params = H.jax_replay(mapped.tx, params0, grads)
    used = [first_lr, *lrs_torch[:-1]]  # the lr each step ran with
    ours = [[float(v) for v in mapped.lrs(t).values()] for t in range(H.N_STEPS)]
    np.testing.assert_allclose(ours, used, rtol=1e-6)
    return H.max_rel_err(torch_params, jax_params), mapped


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_math_matches_torch(name: str) -> None:
    err, mapped = _replay(OPTIMIZERS[name])
    assert err < 1e-5, err
    assert mapped.description == type(OPTIMIZERS[name](H.net().parameters())).__name__


SCHEDULERS: dict[str, tuple[str, Callable[[torch.optim.Optimizer], Any]]] = {
    "step": ("sgd-momentum", lambda o: S.StepLR(o, step_size=2, gamma=0.5)),
    "multistep": ("sgd-momentum", lambda o: S.MultiStepLR(o, milestones=[1, 3, 6], gamma=0.3)),
    "exponential": ("adam", lambda o: S.ExponentialLR(o, gamma=0.8)),
    "cosine": ("adamw", lambda o: S.CosineAnnealingLR(o, T_max=5, eta_min=1e-4)),
    "linear": ("rmsprop", lambda o: S.LinearLR(o, start_factor=0.1, total_iters=4)),
    "constant": ("adagrad", lambda o: S.ConstantLR(o, factor=0.5, total_iters=3)),
    "onecycle-sgd": ("sgd-momentum", lambda o: S.OneCycleLR(o, max_lr=0.5, total_steps=8)),
    "onecycle-adamw": ("adamw", lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=8)),
    "onecycle-rmsprop": (
        "rmsprop-centered-mom-wd",
        lambda o: S.OneCycleLR(o, max_lr=0.01, total_steps=8),
    ),
    "sequential": (
        "sgd-damp-wd",
        lambda o: S.SequentialLR(
            o,
            [S.LinearLR(o, start_factor=0.2, total_iters=3), S.CosineAnnealingLR(o, T_max=5)],
            milestones=[3],
        ),
    ),
    "lambda": ("adam", lambda o: S.LambdaLR(o, lambda s: 1.0 / (1.0 + s))),
    "cyclic-momentum-to-zero": (  # momentum reaches 0 at step 3: torch skips the buffer there
        "sgd-momentum",
        lambda o: S.CyclicLR(o, 0.01, 0.1, step_size_up=3, base_momentum=0.0, max_momentum=0.9),
    ),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_per_step_matches_torch(name: str) -> None:
    opt_name, make_sched = SCHEDULERS[name]
    err, mapped = _replay(OPTIMIZERS[opt_name], make_sched)
    assert err < 1e-5, err
    assert (
        f"+ {type(make_sched(OPTIMIZERS[opt_name](H.net().parameters()))).__name__} per step"
        in (mapped.description)
    )
    if name.startswith(("onecycle", "cyclic")):
        key = "beta1" if "adam" in opt_name else "momentum"
        assert key in mapped.groups[0].tables  # OneCycleLR cycles momentum / beta1 too


def test_state_structure_does_not_depend_on_total_steps() -> None:
    model = H.net()
    params = H.to_jax(dict(model.named_parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = S.CyclicLR(opt, 0.01, 0.1, step_size_up=3, base_momentum=0.0, max_momentum=0.0)
    structures = {
        str(jax.tree.structure(m.tx.init(params)))
        for total in (1, 8)
        for m in [
            map_configure_optimizers(
                ([opt], [{"scheduler": sched, "interval": "step"}]),
                dict(model.named_parameters()),
                steps_per_epoch=None,
                total_steps=total,
            )
        ]
    }
    assert len(structures) == 1


@pytest.mark.parametrize(
    ("interval", "frequency"), [("epoch", 1), ("epoch", 2), ("step", 2), ("step", 3)]
)
def test_scheduler_interval_and_frequency(interval: str, frequency: int) -> None:
    err, _ = _replay(
        OPTIMIZERS["sgd-momentum"],
        lambda o: S.StepLR(o, step_size=1, gamma=0.5),
        interval=interval,
        frequency=frequency,
    )
    assert err < 1e-5


def test_epoch_interval_needs_steps_per_epoch() -> None:
    model = H.net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"StepLR.*interval='epoch'.*__len__.*optimizer="):
        map_configure_optimizers(
            ([opt], [S.StepLR(opt, 1)]),
            dict(model.named_parameters()),
            steps_per_epoch=None,
            total_steps=4,
        )


def test_user_objects_untouched_and_jittable() -> None:
    model = H.net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = S.OneCycleLR(opt, max_lr=1.0, total_steps=10)
    before = copy.deepcopy((opt.state_dict(), sched.state_dict()))
    mapped = map_configure_optimizers(
        {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}},
        dict(model.named_parameters()),
        steps_per_epoch=None,
        total_steps=10,
    )
    assert (opt.state_dict(), sched.state_dict()) == before
    jitted = jax.jit(mapped.lrs)
    for t in (0, 4, 9, 50):  # past the end: the last entry
        assert float(jitted(jnp.int32(t))["lr-AdamW"]) == float(mapped.lrs(min(t, 9))["lr-AdamW"])


# --- param groups --------------------------------------------------------------------------


def test_param_groups_by_name_and_untouched_params() -> None:
    model = H.net()
    model[0].bias.requires_grad_(False)  # frozen: in a group, not a trainable param
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    params0 = H.to_jax(named)
    opt = torch.optim.SGD(
        [
            {"params": [model[0].weight], "lr": 0.2, "momentum": 0.9},
            {"params": [model[0].bias, model[2].bias], "weight_decay": 0.1, "name": "biases"},
        ],
        lr=0.05,
    )  # model[2].weight is in no group: torch never updates it
    mapped = map_configure_optimizers(opt, named, steps_per_epoch=3, total_steps=8)
    assert [g.names for g in mapped.groups] == [("0.weight",), ("2.bias",)]
    assert mapped.groups[0].const["lr"] == 0.2 and mapped.groups[1].const["weight_decay"] == 0.1
    assert mapped.lr_names == ("lr-SGD/pg1", "lr-SGD/biases")
    assert mapped.description == "SGD (2 param groups)"
    grads, torch_params = H.torch_run(model, opt, lambda t: None, H.batches())
    jax_params = H.jax_replay(mapped.tx, params0, grads)
    assert H.max_rel_err(torch_params, jax_params) < 1e-5
    np.testing.assert_array_equal(np.asarray(jax_params[-1]["2.weight"]), params0["2.weight"])


# --- return forms ---------------------------------------------------------------------------

FORMS: dict[str, Callable[[Any, Any], Any]] = {
    "optimizer": lambda o, s: o,
    "list": lambda o, s: [o],
    "tuple": lambda o, s: (o,),
    "lists": lambda o, s: ([o], [s]),
    "list-and-scheduler": lambda o, s: ([o], s),
    "lists-dict": lambda o, s: ([o], [{"scheduler": s, "interval": "step", "frequency": 2}]),
    "dict": lambda o, s: {"optimizer": o},
    "dict-scheduler": lambda o, s: {"optimizer": o, "lr_scheduler": s},
    "dict-config-monitor": lambda o, s: {
        "optimizer": o,
        "lr_scheduler": {"scheduler": s, "interval": "step", "name": "my-lr"},
        "monitor": "val_loss",
    },
    "list-of-dict": lambda o, s: [{"optimizer": o, "lr_scheduler": s}],
}
EXPECTED = {  # lr per step (0.1, halved by each scheduler step; 3 steps per epoch), names
    "optimizer": ([0.1] * 6, "SGD", ("lr-SGD",)),
    "list": ([0.1] * 6, "SGD", ("lr-SGD",)),
    "tuple": ([0.1] * 6, "SGD", ("lr-SGD",)),
    "lists": ([0.1] * 3 + [0.05] * 3, "SGD + StepLR per epoch", ("lr-SGD",)),
    "list-and-scheduler": ([0.1] * 3 + [0.05] * 3, "SGD + StepLR per epoch", ("lr-SGD",)),
    "lists-dict": (
        [0.1, 0.1, 0.05, 0.05, 0.05, 0.025],
        "SGD + StepLR every 2 steps",
        ("lr-SGD",),
    ),
    "dict": ([0.1] * 6, "SGD", ("lr-SGD",)),
    "dict-scheduler": ([0.1] * 3 + [0.05] * 3, "SGD + StepLR per epoch", ("lr-SGD",)),
    "dict-config-monitor": (
        [0.1, 0.05, 0.025, 0.0125, 0.00625, 0.003125],
        "SGD + StepLR per step",
        ("my-lr",),
    ),
    "list-of-dict": ([0.1] * 3 + [0.05] * 3, "SGD + StepLR per epoch", ("lr-SGD",)),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_every_return_form(form: str) -> None:
    model = H.net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = S.StepLR(opt, step_size=1, gamma=0.5)
    mapped = map_configure_optimizers(
        FORMS[form](opt, sched), dict(model.named_parameters()), steps_per_epoch=3, total_steps=6
    )
    lrs, description, names = EXPECTED[form]
    assert mapped.lr_names == names and mapped.description == description
    ours = [float(mapped.lrs(t)[names[0]]) for t in range(6)]
    np.testing.assert_allclose(ours, lrs, rtol=1e-6)


# --- refusals -------------------------------------------------------------------------------


class MySGD(torch.optim.SGD):
    pass


def _refusals() -> dict[str, tuple[Callable[[list[nn.Parameter]], Any], str]]:
    def plateau(p: list[nn.Parameter]) -> Any:  # per epoch it maps (test_plateau.py)
        o = torch.optim.SGD(p, lr=0.1)
        schedule = {"scheduler": S.ReduceLROnPlateau(o), "monitor": "val_loss", "interval": "step"}
        return {"optimizer": o, "lr_scheduler": schedule}

    def other_opt_sched(p: list[nn.Parameter]) -> Any:
        o = torch.optim.SGD(p, lr=0.1)
        return ([o], [S.StepLR(torch.optim.SGD(p, lr=0.1), 1)])

    def unmapped_flag(p: list[nn.Parameter]) -> Any:
        o = torch.optim.SGD(p, lr=0.1)
        o.defaults["future_flag"] = True  # a torch flag this mapping does not know
        o.param_groups[0]["future_flag"] = True
        return o

    return {
        "none": (lambda p: None, r"returned None"),
        "adadelta": (lambda p: torch.optim.Adadelta(p), r"torch\.optim\.adadelta\.Adadelta"),
        "subclass": (lambda p: MySGD(p, lr=0.1), r"MySGD has no exact optax mapping"),
        "plateau-per-step": (plateau, r"ReduceLROnPlateau with interval='step'"),
        "two-optimizers": (
            lambda p: [torch.optim.SGD(p[:2], lr=0.1), torch.optim.Adam(p[2:])],
            r"2 optimizers \(SGD, Adam\)",
        ),
        "bad-form": (lambda p: "sgd", r"Lightning cannot use.*Unknown configuration"),
        "other-optimizer-scheduler": (other_opt_sched, r"StepLR drives another optimizer"),
        "unmapped-flag": (unmapped_flag, r"SGD param group 0 sets future_flag=True"),
    }


@pytest.mark.parametrize("case", list(_refusals()))
def test_refusals_name_the_thing_and_the_fix(case: str) -> None:
    model = H.net()
    make, pattern = _refusals()[case]
    with pytest.raises(ConfigError, match=pattern) as info:
        map_configure_optimizers(
            make(list(model.parameters())),
            dict(model.named_parameters()),
            steps_per_epoch=3,
            total_steps=4,
        )
    assert "optimizer= an optax transform" in str(info.value)


def test_harmless_flags_are_accepted() -> None:
    model = H.net()
    opt = torch.optim.Adam(model.parameters(), foreach=False, capturable=True, differentiable=False)
    mapped = map_configure_optimizers(
        opt, dict(model.named_parameters()), steps_per_epoch=3, total_steps=4
    )
    assert mapped.description == "Adam"


# --- clipping -------------------------------------------------------------------------------


def _grads() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(5, 4, generator=g) * 3, "b": torch.randn(7, generator=g)}


@pytest.mark.parametrize(
    ("algorithm", "value"), [("norm", 1.0), (None, 0.5), ("norm", 1e3), ("value", 0.3)]
)
def test_torch_clip_matches_torch(algorithm: str | None, value: float) -> None:
    grads = _grads()
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for p, g in zip(params, grads.values(), strict=True):
        p.grad = g.clone()
    if algorithm == "value":
        torch.nn.utils.clip_grad_value_(params, value)
    else:
        torch.nn.utils.clip_grad_norm_(params, value)
    tx = torch_clip(value, algorithm)
    ours, _ = jax.jit(tx.update)(H.to_jax(grads), tx.init(None))
    for p, name in zip(params, grads, strict=True):
        np.testing.assert_allclose(np.asarray(ours[name]), p.grad.numpy(), rtol=1e-6)


def test_torch_clip_identity_only_and_errors() -> None:
    grads = H.to_jax(_grads())
    for off in (None, 0, 0.0):
        assert torch_clip(off, "norm").update(grads, None)[0] is grads
    tx = torch_clip(1.0, "norm", only={"a"})
    ours, _ = tx.update(grads, tx.init(None))
    np.testing.assert_array_equal(np.asarray(ours["b"]), np.asarray(grads["b"]))
    assert float(jnp.linalg.norm(ours["a"])) == pytest.approx(1.0, rel=1e-5)
    with pytest.raises(ConfigError, match=r"'bogus'.*gradient_clip_algorithm='norm'"):
        torch_clip(1.0, "bogus")
    with pytest.raises(ConfigError, match=r">= 0.*-1.0"):
        torch_clip(-1.0, "value")


# --- against a real Lightning Trainer -------------------------------------------------------


class Tiny(L.LightningModule):
    """A plain LightningModule: tuple batches, a torch loss, the optimizer setup of ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.net = H.net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        weights = [self.net[0].weight, self.net[2].weight]
        biases = [self.net[0].bias, self.net[2].bias]
        if self.kind == "adamw-onecycle":
            opt = torch.optim.AdamW(
                [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}],
                lr=1e-2,
            )
            sched = S.OneCycleLR(opt, max_lr=[0.05, 0.02], total_steps=H.N_STEPS)
            return [opt], [{"scheduler": sched, "interval": "step"}]
        opt = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9, weight_decay=1e-3)
        return {"optimizer": opt, "lr_scheduler": S.StepLR(opt, step_size=1, gamma=0.5)}


class Recorder(L.Callback):
    """Records, per optimizer step, each group's lr and the gradients Lightning computed."""

    def __init__(self) -> None:
        self.lrs: list[list[float]] = []
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.lrs.append([g["lr"] for g in trainer.optimizers[0].param_groups])

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, opt: Any) -> None:
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters()})


def _fit(kind: str, tmp_path: Path, **trainer_kwargs: Any) -> tuple[Tiny, Recorder, Any]:
    x, y = H.batches(1)[0]  # 16 samples, batches of 6: 3 steps per epoch, a ragged last one
    loader = DataLoader(TensorDataset(x, y), batch_size=6)
    module, recorder = Tiny(kind), Recorder()
    monitor = LearningRateMonitor(logging_interval="step")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        max_steps=H.N_STEPS,
        callbacks=[recorder, monitor],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(module, loader)
    return module, recorder, monitor


@pytest.mark.parametrize(
    ("kind", "clip", "description"),
    [
        ("adamw-onecycle", {}, "AdamW (2 param groups) + OneCycleLR per step"),
        ("sgd-steplr", {"gradient_clip_val": 0.05}, "SGD + StepLR per epoch"),
    ],
)
def test_against_lightning_trainer(
    kind: str, clip: dict[str, Any], description: str, tmp_path: Path
) -> None:
    twin = Tiny(kind)  # same seed: the weights Lightning started from
    named = dict(twin.named_parameters())
    params0 = H.to_jax(named)
    mapped = map_configure_optimizers(
        twin.configure_optimizers(), named, steps_per_epoch=3, total_steps=H.N_STEPS
    )
    module, recorder, monitor = _fit(kind, tmp_path, **clip)
    assert mapped.description == description
    assert len(recorder.grads) == H.N_STEPS
    if clip:  # the clip bites: Lightning's gradients are longer than gradient_clip_val
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in recorder.grads[0].values()]))
        assert norm > 2 * clip["gradient_clip_val"]
    # the lr of every step, and LearningRateMonitor's names and values
    ours = [[float(mapped.lrs(t)[n]) for n in mapped.lr_names] for t in range(H.N_STEPS)]
    np.testing.assert_allclose(ours, recorder.lrs, rtol=1e-6)
    assert set(monitor.lrs) == set(mapped.lr_names)
    for name in mapped.lr_names:
        np.testing.assert_allclose(
            [float(mapped.lrs(t)[name]) for t in range(H.N_STEPS)], monitor.lrs[name], rtol=1e-6
        )
    # Lightning's own gradients through (clip +) tx land on Lightning's final weights
    tx = optax.chain(
        torch_clip(clip.get("gradient_clip_val"), "norm", only=mapped.param_names), mapped.tx
    )
    final = H.jax_replay(tx, params0, recorder.grads)[-1]
    trained = {n: p.detach() for n, p in module.named_parameters()}
    err = H.max_rel_err([trained], [final])
    assert err < 1e-5, err
    assert H.max_rel_err([{n: t.detach() for n, t in named.items()}], [final]) > 1e-3  # it trained


# --- optimizer state <-> torch state_dict ------------------------------------------------------

STATEFUL = {
    "sgd-momentum": lambda o: S.StepLR(o, step_size=2, gamma=0.5),
    "adamw-wd-amsgrad": lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=8),
    "rmsprop-centered-mom-wd": lambda o: S.CosineAnnealingLR(o, T_max=6),
    "adagrad-decay-wd-init": lambda o: S.LambdaLR(o, lambda s: 1.0 / (1.0 + s)),
    "adamax-wd-max": lambda o: S.ExponentialLR(o, gamma=0.9),
    "nadam-decay-wd": lambda o: S.StepLR(o, step_size=2, gamma=0.5),
    "radam": lambda o: S.LinearLR(o, start_factor=0.5, total_iters=4),
}


@pytest.mark.parametrize("name", list(STATEFUL))
def test_state_round_trip_with_torch(name: str) -> None:
    """torch 3 steps -> JAX state -> 5 JAX steps, and JAX 3 steps -> torch state -> 5 torch
    steps: both land on torch's own 8-step run (weights, optimizer and scheduler state)."""
    data = H.batches()
    model = H.net()
    params0 = H.to_jax(dict(model.named_parameters()))
    opt = OPTIMIZERS[name](model.parameters())
    sched = STATEFUL[name](opt)
    mapped = map_configure_optimizers(
        ([opt], [{"scheduler": sched, "interval": "step"}]),
        dict(model.named_parameters()),
        steps_per_epoch=None,
        total_steps=8,
    )
    step = H.lightning_stepper([sched], steps_per_epoch=100)
    grads, torch_params = H.torch_run(model, opt, step, data)  # the reference, 8 steps
    # the way in: torch's state after 3 steps, then JAX
    mid_model = H.net()
    mid_opt = OPTIMIZERS[name](mid_model.parameters())
    mid_sched = STATEFUL[name](mid_opt)
    H.torch_run(mid_model, mid_opt, H.lightning_stepper([mid_sched], steps_per_epoch=100), data[:3])
    mid_params = H.to_jax(dict(mid_model.named_parameters()))
    state = state_from_torch(mapped, mid_opt.state_dict(), mid_params)
    assert int(state.step) == (0 if name.startswith("sgd") else 3)
    state = state._replace(step=jnp.int32(3))
    ours = H.jax_replay(mapped.tx, mid_params, grads[3:], state=state)
    assert H.max_rel_err(torch_params[3:], ours) < 1e-5
    # the exit door: JAX's state after 3 steps, then torch
    _, jax_state = H.jax_replay(mapped.tx, params0, grads[:3], return_state=True)
    opt_sd, sched_sds = state_to_torch(mapped, jax_state)
    out_model = H.net()
    out_model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in mid_params.items()})
    out_opt = OPTIMIZERS[name](out_model.parameters())
    out_sched = STATEFUL[name](out_opt)
    out_opt.load_state_dict(opt_sd)
    out_sched.load_state_dict(sched_sds[0])
    assert out_opt.param_groups[0]["lr"] == pytest.approx(mid_opt.param_groups[0]["lr"], rel=1e-12)
    assert out_sched.state_dict().keys() == mid_sched.state_dict().keys()
    assert out_sched.last_epoch == mid_sched.last_epoch == 3
    stepper = H.lightning_stepper([out_sched], steps_per_epoch=100)
    _, out_params = H.torch_run(out_model, out_opt, lambda t: stepper(t + 3), data[3:])
    assert H.max_rel_err(torch_params[3:], [H.to_jax(p) for p in out_params]) < 1e-5


def test_state_from_torch_refuses_another_layout() -> None:
    model = H.net()
    opt = torch.optim.Adam(model.parameters())
    mapped = map_configure_optimizers(
        opt, dict(model.named_parameters()), steps_per_epoch=3, total_steps=4
    )
    other = torch.optim.Adam([model[0].weight])
    with pytest.raises(ConfigError, match=r"sizes \[1\].*\[4\].*without the optimizer state"):
        state_from_torch(mapped, other.state_dict(), H.to_jax(dict(model.named_parameters())))


class StepLrs(L.Callback):
    """The lr each optimizer step runs with (Lightning calls this hook once per real step)."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, opt: Any) -> None:
        self.lrs.append(opt.param_groups[0]["lr"])


class Accumulating(Tiny):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = S.StepLR(opt, step_size=1, gamma=0.5)
        return [opt], [{"scheduler": sched, "interval": "step", "frequency": 2}]


def test_step_frequency_with_accumulation_matches_lightning() -> None:
    """5 batches per epoch, accumulate 2: steps end at batches 2, 4, 5; frequency 2 fires after
    the first two only (Lightning counts batches, and restarts every epoch)."""
    x, y = H.batches(1)[0]
    loader = DataLoader(TensorDataset(x[:15], y[:15]), batch_size=3)
    recorder = StepLrs()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        max_steps=6,
        accumulate_grad_batches=2,
        callbacks=[recorder],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Accumulating("sgd"), loader)
    twin = Accumulating("sgd")
    mapped = map_configure_optimizers(
        twin.configure_optimizers(),
        dict(twin.named_parameters()),
        steps_per_epoch=3,
        total_steps=6,
        accumulate_grad_batches=2,
        batches_per_epoch=5,
    )
    ours = [float(mapped.lrs(t)["lr-SGD"]) for t in range(6)]
    np.testing.assert_allclose(ours, recorder.lrs, rtol=1e-6)
    assert recorder.lrs == pytest.approx([0.1, 0.05, 0.025, 0.025, 0.0125, 0.00625])


def test_two_schedulers_on_one_optimizer() -> None:
    """A per-step warmup and a per-epoch decay, chained as Lightning steps them (steps first)."""
    model = H.net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    warmup = S.LinearLR(opt, start_factor=0.25, total_iters=4)
    decay = S.StepLR(opt, step_size=1, gamma=0.5)
    returned = (
        [opt],
        [
            {"scheduler": warmup, "interval": "step"},
            {"scheduler": decay, "interval": "epoch"},
        ],
    )
    params0 = H.to_jax(dict(model.named_parameters()))
    mapped = map_configure_optimizers(
        returned, dict(model.named_parameters()), steps_per_epoch=3, total_steps=H.N_STEPS
    )
    assert mapped.lr_names == ("lr-SGD", "lr-SGD-1")  # LearningRateMonitor's names
    assert mapped.description == "SGD + LinearLR per step + StepLR per epoch"
    used: list[float] = []

    def step(t: int) -> None:
        H.lightning_stepper([warmup])(t)
        H.lightning_stepper([decay], interval="epoch")(t)

    def record(t: int) -> None:
        step(t)
        used.append(opt.param_groups[0]["lr"])

    first = opt.param_groups[0]["lr"]
    grads, torch_params = H.torch_run(model, opt, record, H.batches())
    ours = [float(mapped.lrs(t)["lr-SGD-1"]) for t in range(H.N_STEPS)]
    np.testing.assert_allclose(ours, [first, *used[:-1]], rtol=1e-6)
    assert H.max_rel_err(torch_params, H.jax_replay(mapped.tx, params0, grads)) < 1e-5
