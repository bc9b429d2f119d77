"""Manual optimization (``automatic_optimization = False``) inside one compiled step.

The user's ``training_step`` calls ``self.optimizers()``, ``self.manual_backward(loss)``,
``opt.step()``, ``opt.zero_grad()``, ``self.toggle_optimizer(opt)``, ``self.clip_gradients``,
``self.lr_schedulers()`` and ``sch.step()`` itself. While it is traced, those names are
stand-ins (:class:`ManualRun`) that do the same to JAX values, in the order the code runs
them, so a loss computed after ``opt_g.step()`` sees the updated generator.

Gradients: a ``manual_backward(loss)`` needs the gradient of a value the traced code is in
the middle of computing. :func:`manual_step` traces ``training_step`` once per backward
call, under :func:`jax.grad`, up to that call (its loss is what is differentiated, with
respect to a zero offset on every parameter, so the gradient is torch's ``.grad``: the sum
over every use of the parameter's current value), the earlier backward calls given their
gradients from the earlier traces; then once more, all gradients known, for the step's
results. XLA drops what a trace computes and no result uses and merges what several compute
alike, so the program does about what one torch step does. ``.detach()`` stops gradients as
in torch (:class:`_Detach`).

Differences from torch, documented in docs/porting.md: ``p.grad`` is not set on the module's
tensors (the stand-ins keep the gradients); a parameter that takes no part in a loss gets a
zero gradient from that backward (torch leaves ``None``), which only matters for an
optimizer stepped on it with no other gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import torch

import jaxcore
from jaxcore.guard import checked, checking
from torchshell._errors import ConfigError
from torchshell.adapters._clip import torch_clip
from torchshell.port._batch_idx import BatchIdx
from torchshell.port._host_reads import watching_trainer
from torchshell.port._manual_optim import ManualOptState, ManualPlan

__all__ = ["BatchIdx", "ManualRun", "manual_step"]

_MAX_BACKWARDS = 32  # manual_backward calls one training_step may make
# the module's own methods a manual training_step calls, replaced while it is traced
_PATCHED = (
    "optimizers",
    "lr_schedulers",
    "manual_backward",
    "toggle_optimizer",
    "untoggle_optimizer",
    "toggled_optimizer",
    "clip_gradients",
)


class _Reached(BaseException):  # (not an Exception: nothing on the way catches it)
    """The backward call being differentiated was reached: its loss."""

    def __init__(self, loss: jax.Array) -> None:
        super().__init__()
        self.loss = loss


class _Finished(BaseException):
    """``training_step`` returned before the backward call being looked for."""


class _Detach(torch.overrides.TorchFunctionMode):
    """``tensor.detach()`` stops gradients (torchax's own detach is the identity)."""

    def __init__(self, env: Any) -> None:
        super().__init__()
        self.env = env

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.Tensor.detach, torch.detach) and args:
            value = self.env.t2j_iso(args[0])
            return self.env.j2t_iso(jax.lax.stop_gradient(value))
        return func(*args, **(kwargs or {}))


class _Optimizer:
    """What ``self.optimizers()`` gives inside the traced step: one mapped optimizer."""

    def __init__(self, run: ManualRun, index: int) -> None:
        self._run, self.index = run, index
        self.names = run.plan.mapped[index].param_names

    @property
    def optimizer(self) -> _Optimizer:  # (LightningOptimizer.optimizer)
        return self

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Each group's hyperparameters now (the lr a scheduler reached: a traced value)."""
        state = self._run.states[self.index]
        groups = self._run.plan.mapped[self.index].groups
        return [
            {**g.at(state.sched), "lr": lr}
            for g, lr in zip(groups, self._run.plan.lrs(self.index, state), strict=True)
        ]

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """``opt.step()``: the mapped update on the gradients accumulated so far."""
        out = closure() if closure is not None else None
        self._run.step(self.index)
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``opt.zero_grad()``: forgets this optimizer's gradients."""
        self._run.zero_grad(self.names, set_to_none)

    def state_dict(self) -> Any:
        raise ConfigError(
            "optimizer.state_dict() inside training_step: the optimizer's state lives in the "
            "compiled step. Fix: read it from the checkpoint (trainer.save_checkpoint)."
        )


class _Scheduler:
    """What ``self.lr_schedulers()`` gives inside the traced step."""

    def __init__(self, run: ManualRun, opt_index: int) -> None:
        self._run, self.opt_index = run, opt_index

    def step(self, *args: Any, **kwargs: Any) -> None:
        """``sch.step()``: the optimizer's tables move one entry on."""
        if args or kwargs:
            raise ConfigError(
                "scheduler.step(value) inside training_step: from_lightning maps schedulers "
                "stepped without arguments. Fix: call sch.step() with none."
            )
        state = self._run.states[self.opt_index]
        self._run.states[self.opt_index] = state._replace(sched=state.sched + 1)

    def get_last_lr(self) -> list[jax.Array]:
        """Each param group's lr now (traced values: log them, do not branch on them)."""
        return self._run.plan.lrs(self.opt_index, self._run.states[self.opt_index])


@dataclasses.dataclass
class ManualRun:
    """One traced run of a manual ``training_step``: the stand-ins' shared state.

    Attributes:
        plan: the mapped optimizers.
        states: each optimizer's state, updated as the code steps it.
        known: the gradients of the backward calls before ``target`` (from earlier traces).
        target: the backward call to stop at (its loss is differentiated), or ``None``.
        delta: the zero offsets gradients are taken against (``None``: not differentiating).
    """

    plan: ManualPlan
    states: list[ManualOptState]
    known: list[dict[str, jax.Array]]
    target: int | None = None
    delta: Mapping[str, jax.Array] | None = None
    dry: bool = False  # a shape-only trace (init, host reads): zero gradients
    module: Any = None
    env: Any = None
    grads: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
    frozen: set[str] = dataclasses.field(default_factory=set)  # toggled off (requires_grad)
    losses: list[jax.Array] = dataclasses.field(default_factory=list)
    backwards: int = 0
    steps: int = 0
    _initial: list[ManualOptState] | None = None

    def restart(self) -> None:
        """The run from its start again: each path of a traced branch (``if
        self.global_step % N == 0:``) runs ``training_step`` anew."""
        if self._initial is None:
            self._initial = list(self.states)
        self.states, self.grads, self.frozen, self.losses = list(self._initial), {}, set(), []
        self.backwards = self.steps = 0

    def _params(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_parameters())

    def backward(self, loss: Any, *args: Any, **kwargs: Any) -> None:
        """``self.manual_backward(loss)``: the loss's gradient added to the accumulated ones."""
        value = jnp.asarray(self.env.t2j_iso(loss), jnp.float32)
        if value.size != 1:
            raise ConfigError(
                f"manual_backward got a tensor of shape {tuple(value.shape)}: from_lightning "
                "differentiates scalar losses. Fix: reduce it first (loss.mean())."
            )
        value = value.reshape(())
        index, self.backwards = self.backwards, self.backwards + 1
        if index >= _MAX_BACKWARDS:
            raise ConfigError(
                f"training_step called manual_backward more than {_MAX_BACKWARDS} times: each "
                "is traced separately. Fix: sum the losses and call it once."
            )
        if index == self.target:
            raise _Reached(value)
        if self.dry or index >= len(self.known):
            grads = {n: jnp.zeros(t.shape, jnp.float32) for n, t in self._params().items()}
        else:
            grads = self.known[index]
        self.losses.append(value)
        for name, grad in grads.items():
            if name in self.frozen:
                continue
            old = self.grads.get(name)
            self.grads[name] = grad if old is None else old + grad

    def step(self, index: int) -> None:
        """``opt.step()`` of optimizer ``index``: new values written into the module's tensors."""
        tensors = self._params()
        names = self.plan.mapped[index].param_names
        grads = {n: g for n, g in self.grads.items() if n in names}
        params = {n: self.env.t2j_iso(tensors[n]) for n in grads}
        new, self.states[index] = self.plan.apply(index, self.states[index], grads, params)
        for name, value in new.items():
            value = jax.lax.stop_gradient(value)  # (torch updates under no_grad)
            if self.delta is not None:
                value = value + self.delta[name]  # later uses are differentiated too
            tensor: Any = tensors[name]  # (a torchax tensor: its JAX value is _elem)
            tensor._elem = value.astype(tensor._elem.dtype)
        self.steps += 1

    def zero_grad(self, names: frozenset[str], set_to_none: bool) -> None:
        for name in names & set(self.grads):
            if set_to_none:
                del self.grads[name]
            else:
                self.grads[name] = jnp.zeros_like(self.grads[name])

    def toggle(self, opt: Any) -> None:
        """``self.toggle_optimizer(opt)``: only ``opt``'s parameters get gradients."""
        mine = getattr(opt, "optimizer", opt).names
        every = frozenset().union(*(m.param_names for m in self.plan.mapped))
        self.frozen = set(every - mine)

    def untoggle(self, opt: Any) -> None:
        self.frozen = set()

    @contextlib.contextmanager
    def toggled(self, opt: Any) -> Iterator[None]:
        self.toggle(opt)
        try:
            yield
        finally:
            self.untoggle(opt)

    def clip(
        self,
        opt: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """``self.clip_gradients(opt, ...)``: Lightning's clipping of ``opt``'s gradients."""
        names = getattr(opt, "optimizer", opt).names
        picked = {n: g for n, g in self.grads.items() if n in names}
        if picked:
            tx = torch_clip(gradient_clip_val, gradient_clip_algorithm)
            clipped, _ = tx.update(picked, tx.init(None))
            self.grads.update(clipped)

    @contextlib.contextmanager
    def installed(self, module: Any, env: Any) -> Iterator[None]:
        """The module's manual-optimization methods replaced by this run's stand-ins."""
        self.module, self.env = module, env
        if not self.states:  # a shape-only trace: fresh states for the weights given
            params = {n: env.t2j_iso(t) for n, t in module.named_parameters()}
            self.states = list(self.plan.tx().init(params))
        opts = [_Optimizer(self, i) for i in range(len(self.plan.mapped))]
        scheds = [_Scheduler(self, i) for i in self.plan.sched_opt]
        own = {
            "optimizers": lambda use_pl_optimizer=True: opts[0] if self.plan.single else opts,
            "lr_schedulers": lambda: (scheds[0] if len(scheds) == 1 else scheds) or None,
            "manual_backward": self.backward,
            "toggle_optimizer": self.toggle,
            "untoggle_optimizer": self.untoggle,
            "toggled_optimizer": self.toggled,
            "clip_gradients": self.clip,
        }
        module.__dict__.update(own)
        try:
            with _Detach(env):
                yield
        finally:
            for name in _PATCHED:
                module.__dict__.pop(name, None)

    def results(self) -> dict[str, Any]:
        """What the run leaves: the parameters' values, the optimizers' states, the losses."""
        tensors = self._params()
        return {
            "params": {n: self.env.t2j_iso(t) for n, t in tensors.items()},
            "opt": tuple(self.states),
            "losses": list(self.losses),
        }


def manual_step(
    port: Any, plan: ManualPlan, *, state_sharding: Any, nan_policy: str
) -> jaxcore.Step:
    """The compiled step of a manual ``training_step``: ``(state, batch) -> (state, metrics)``.

    ``state.opt_state`` holds one :class:`ManualOptState` per optimizer; the metrics hold
    ``loss`` (the returned loss, else the first backward call's), the logged values
    (``log/<name>``) and ``optimizer_steps`` (``opt.step()`` calls: ``global_step``'s count).
    """

    def step(state: Any, batch: Any) -> tuple[Any, dict[str, jax.Array]]:
        key = jax.random.fold_in(state.rng, state.step)
        known: list[dict[str, jax.Array]] = []
        zeros = jax.tree.map(jnp.zeros_like, state.params)
        while True:

            def loss_at(delta: Any, k: int = len(known)) -> jax.Array:
                run = ManualRun(plan, list(state.opt_state), list(known), target=k, delta=delta)
                params = jax.tree.map(jnp.add, state.params, delta)
                try:
                    _call(port, run, params, state.model_state, batch, key)
                except _Reached as reached:
                    if port.tracer.reads.d:  # (reached inside a lax.cond path: its value)
                        raise _branch_before_backward(port) from None
                    return reached.loss
                raise _Finished

            try:
                known.append(jax.grad(loss_at)(zeros))
            except _Finished:
                break
        run = ManualRun(plan, list(state.opt_state), known)
        with checking(batch) as checks:  # (an embedding's index range, as the automatic step)
            out, logs, model_state = _call(port, run, state.params, state.model_state, batch, key)
        found = checked(checks.result())
        returned, results = out
        port.manual_steps = run.steps  # (known once traced: global_step's count per batch)
        loss = port.manual_loss(returned, results["losses"])
        _, metrics = port.loss_fn({"loss": loss, "logs": logs}, batch)
        metrics = {"loss": loss, **metrics}
        new = dataclasses.replace(
            state,
            step=state.step + 1,
            params={n: results["params"][n].astype(v.dtype) for n, v in state.params.items()},
            opt_state=results["opt"],
            model_state=model_state,
        )
        if nan_policy == "none":
            return new, metrics
        ok = jnp.isfinite(loss) & jnp.all(
            jnp.asarray([jnp.all(jnp.isfinite(v)) for v in jax.tree.leaves(new.params)])
        )
        if nan_policy == "stop":
            ok = ok & (state.nonfinite == 0)
        ok = ok & (found[0] == -1)  # (refused; the shell raises the check's error under "stop")
        where = jnp.where((state.nonfinite_step < 0) & ~ok, found, state.nonfinite_input)
        kept = jax.tree.map(
            lambda a, b: jnp.where(ok, a, b),
            (new.params, new.opt_state, new.model_state),
            (state.params, state.opt_state, state.model_state),
        )
        bad = (~ok).astype(jnp.int32)
        first = jnp.where((state.nonfinite_step < 0) & ~ok, state.step, state.nonfinite_step)
        new = dataclasses.replace(
            new,
            params=kept[0],
            opt_state=kept[1],
            model_state=kept[2],
            nonfinite=state.nonfinite + bad,
            nonfinite_step=first,
            nonfinite_input=where,
        )
        return new, {**metrics, "nonfinite": bad.astype(jnp.float32)}

    return jaxcore.Step(
        step,
        name="train_step",
        in_shardings=(state_sharding, None),
        out_shardings=(state_sharding, None),
        donate_argnums=(0,),
    )


def _branch_before_backward(port: Any) -> ConfigError:
    return ConfigError(
        f"{type(port.module).__name__}.training_step (manual optimization) uses a traced "
        "value as a Python bool before manual_backward (e.g. `if self.global_step % N == 0:` "
        "or `min(1.0, self.global_step / N)`): each manual_backward is differentiated up to "
        "it, which a branch around it cannot be. Fix: write the choice with tensors before "
        "the backward (torch.where, torch.as_tensor((self.global_step + 1) / N).clamp(max=1)), "
        "or branch after the last manual_backward."
    )


def _call(port: Any, run: ManualRun, params: Any, model_state: Any, batch: Any, key: Any) -> Any:
    port.manual = run
    try:
        with watching_trainer(port.host_reads):
            return port.call("training_step", params, model_state, batch, key, True)
    finally:
        port.manual = None
