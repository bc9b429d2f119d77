"""Lightning ``Trainer`` flags, as a Lightning user means them, under a :class:`JaxModule`.

A ``JaxModule`` runs under manual optimization (the optimizer lives in the JAX step), where
Lightning itself refuses ``accumulate_grad_batches`` and ``gradient_clip_val`` and where
``precision`` would change nothing. So the module reads these flags when it is attached to
a Trainer, carries them out in the JAX step, and hands Lightning neutral values (restored
after the run):

- ``precision``: ``"bf16-mixed"`` / ``"bf16-true"`` -> the step computes in bfloat16 (params,
  gradients and optimizer state stay float32); ``"32-true"`` -> float32; others refused.
- ``accumulate_grad_batches=N`` -> N DataLoader batches accumulated in one jitted step.
- ``gradient_clip_val`` / ``gradient_clip_algorithm`` -> clipping inside the JAX update,
  with torch's ``clip_grad_norm_`` / ``clip_grad_value_`` math.
- several devices, processes or nodes -> refused: JAX's mesh places the step; several
  processes are JAX's distributed runtime (``coreshell launch``).
- callbacks that act on the torch weights or optimizer during fit (weight averaging,
  fine-tuning schedules, pruning, an accumulation schedule) -> refused, naming the fix.
- the console: Lightning's model summary (0 torch params) is left out for the run (the
  module prints its own table), and its Rich bar under ``max_steps`` alone reads ``Epoch 15``,
  not ``Epoch 15/-2``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torchshell._errors import ConfigError

__all__ = ["TrainerFlags", "adopt_flags", "attached", "restore_flags"]

_BF16 = ("bf16-mixed", "bf16-true", "bf16")
_FP32 = ("32-true", "32", 32)


@dataclasses.dataclass(frozen=True)
class TrainerFlags:
    """The Trainer flags a :class:`JaxModule` carries out in the JAX step.

    Attributes:
        compute_dtype: ``"bfloat16"`` for a bf16 precision, else ``None`` (float32).
        accumulate: DataLoader batches per optimizer step.
        clip_val: gradient clipping threshold, or ``None``.
        clip_algorithm: ``"norm"`` or ``"value"``.
    """

    compute_dtype: str | None = None
    accumulate: int = 1
    clip_val: float | None = None
    clip_algorithm: str = "norm"


def _refuse_devices(trainer: Any) -> None:
    from lightning.pytorch.strategies import SingleDeviceStrategy

    devices, nodes = trainer.num_devices, trainer.num_nodes
    if devices > 1 or nodes > 1 or not isinstance(trainer.strategy, SingleDeviceStrategy):
        raise ConfigError(
            f"A JaxModule runs as one Lightning process on one device; got Trainer(devices="
            f"{devices}, num_nodes={nodes}, strategy={type(trainer.strategy).__name__}). JAX "
            "places the step itself: the module's mesh (jaxcore.make_mesh({'data': -1})) "
            "already spreads it over every local JAX device. Fix: Trainer(accelerator='cpu', "
            "devices=1); for several processes or machines run `coreshell launch --nproc N -- "
            "train` (jax.distributed, see docs/scale_out.md)."
        )


def _refuse_callbacks(trainer: Any) -> None:
    """Callbacks that change the torch module's weights or optimizer during fit are refused.

    Under a ``JaxModule`` the weights and the optimizer live in the JAX state: these would
    act on objects the compiled step never reads (or crash deep inside Lightning).
    """
    from lightning.pytorch import callbacks as cb

    why = {
        cb.StochasticWeightAveraging: "averages the torch weights and swaps the lr scheduler",
        cb.WeightAveraging: "averages the torch weights (EMA)",
        cb.BaseFinetuning: "freezes and unfreezes torch parameters and adds param groups",
        cb.ModelPruning: "prunes the torch weights",
        cb.GradientAccumulationScheduler: "changes accumulate_grad_batches by epoch",
    }
    fixes = {
        cb.StochasticWeightAveraging: "average in the optimizer instead (an optax transform)",
        cb.WeightAveraging: "keep an EMA in the optimizer instead (an optax transform)",
        cb.BaseFinetuning: "set requires_grad=False on the frozen parameters before fit, "
        "and fine-tune in a second fit",
        cb.ModelPruning: "prune the torch module before fit, or after it",
        cb.GradientAccumulationScheduler: "use a fixed Trainer(accumulate_grad_batches=N)",
    }
    for callback in trainer.callbacks:
        for kind, what in why.items():
            if isinstance(callback, kind):
                raise ConfigError(
                    f"Trainer(callbacks=[{type(callback).__name__}(...)]) {what} during fit; "
                    "under a JaxModule the weights and the optimizer are the JAX step's, which "
                    f"it cannot reach. Fix: remove the callback and {fixes[kind]}."
                )


def _dtype(precision: Any) -> str | None:
    if precision in _BF16:
        return "bfloat16"
    if precision in _FP32:
        return None
    raise ConfigError(
        f"Trainer(precision={precision!r}) has no JAX counterpart here: expected '32-true', "
        "'bf16-mixed' or 'bf16-true' (the JAX step then computes in bfloat16 with float32 "
        "params and optimizer state). float16 needs loss scaling, which the JAX step does "
        "not do; 64-bit needs jax_enable_x64. Fix: use precision='bf16-mixed' or '32-true'."
    )


def adopt_flags(trainer: Any) -> tuple[TrainerFlags, dict[str, Any]]:
    """Reads the Trainer's flags and neutralises the ones Lightning refuses to run.

    Args:
        trainer: the ``lightning.Trainer`` the module is being attached to.

    Returns:
        ``(flags, originals)``: what the JAX step must do, and the Trainer attributes that
        were changed, to restore with :func:`restore_flags` after the run.

    Raises:
        ConfigError: several devices, processes or nodes, a precision with no JAX
            counterpart, or a callback that changes the torch weights or optimizer.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed",
        ...                     accumulate_grad_batches=2, logger=False)
        >>> flags, originals = adopt_flags(trainer)
        >>> flags.compute_dtype, flags.accumulate, trainer.accumulate_grad_batches
        ('bfloat16', 2, 1)
        >>> restore_flags(trainer, originals); trainer.accumulate_grad_batches
        2
    """
    _refuse_devices(trainer)
    _refuse_callbacks(trainer)
    accumulate = int(trainer.accumulate_grad_batches)
    clip = trainer.gradient_clip_val
    algorithm = str(getattr(trainer.gradient_clip_algorithm, "value", None) or "norm").lower()
    if algorithm not in ("norm", "value"):
        raise ConfigError(
            f"gradient_clip_algorithm={algorithm!r}: expected 'norm' or 'value'. Fix: use one."
        )
    flags = TrainerFlags(
        compute_dtype=_dtype(trainer.precision),
        accumulate=accumulate,
        clip_val=float(clip) if clip else None,
        clip_algorithm=algorithm,
    )
    originals = {
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "gradient_clip_val": trainer.gradient_clip_val,
        _SUMMARIES: _lightning_summaries(trainer),
        _BAR: _epoch_alone(trainer),
    }
    trainer.accumulate_grad_batches = 1
    trainer.gradient_clip_val = None
    trainer.callbacks = [c for c in trainer.callbacks if c not in originals[_SUMMARIES]]
    return flags, originals


_SUMMARIES = "(Lightning's model summaries)"


def _lightning_summaries(trainer: Any) -> list[Any]:
    """Lightning's model summary callbacks: they count torch parameters, and a JaxModule's
    are in the JAX state (a table of 0 params); the module prints its own (``print_summary``:
    counts, bytes and sharding of the JAX tree). Left out for the run, given back after."""
    from lightning.pytorch.callbacks import ModelSummary

    return [c for c in trainer.callbacks if isinstance(c, ModelSummary)]


_BAR = "(Lightning's Rich bar, its epoch alone)"


def _epoch_alone(trainer: Any) -> Any:
    """Under ``max_steps`` alone (``max_epochs=-1``), Lightning's Rich bar reads ``Epoch
    15/-2`` (its last epoch index, ``max_epochs - 1``); for the run it reads ``Epoch 15``, as
    Lightning's TQDM bar does. A bar whose class describes the epoch itself is left as it is.
    Returns the bar changed (its own description given back after), or None."""
    from lightning.pytorch.callbacks import RichProgressBar

    bar = trainer.progress_bar_callback
    lightnings = RichProgressBar._get_train_description
    if not isinstance(bar, RichProgressBar) or type(bar)._get_train_description is not lightnings:
        return None

    def epoch_alone(current_epoch: int) -> str:  # (fit sets max_epochs after the attach)
        if trainer.max_epochs is not None and trainer.max_epochs >= 0:
            return lightnings(bar, current_epoch)
        return f"{f'Epoch {current_epoch}':{len(bar.validation_description)}}"

    bar._get_train_description = epoch_alone  # type: ignore[method-assign]  # (this run only)
    return bar


def restore_flags(trainer: Any, originals: dict[str, Any]) -> None:
    """Puts back the Trainer attributes :func:`adopt_flags` changed."""
    for name, value in originals.items():
        if name == _SUMMARIES:  # (to the list as the run left it: it may have added some)
            trainer.callbacks = [*trainer.callbacks, *value]
        elif name == _BAR:
            if value is not None:
                vars(value).pop("_get_train_description", None)
        else:
            setattr(trainer, name, value)


def attached(module: Any, trainer: Any) -> None:
    """The module attached to ``trainer`` (once per run): its flags carried out by the JAX
    step (the compiled steps rebuilt when they change), the Trainer given neutral ones until
    the run's end (``module.run_scope``), then the adapter's hooks told.

    Raises:
        ConfigError: the Trainer's precision disagrees with the module's ``compute_dtype``,
            or ``gradient_clip_val`` changed after the optimizer state was built.
    """
    flags, module.run_scope.originals = adopt_flags(trainer)
    if flags.compute_dtype is not None and module.compute_dtype not in (
        None,
        flags.compute_dtype,
    ):
        raise ConfigError(
            f"Trainer(precision=...) asks for {flags.compute_dtype} compute but the "
            f"module was built with compute_dtype={module.compute_dtype!r}. Fix: set one "
            "of the two."
        )
    if flags != module.flags:
        module.compiled.drop()
        module.evaluation.step = module.evaluation.predict_step = None
    if module.flags.clip_val != flags.clip_val and module.state is not None:
        raise ConfigError(
            "gradient_clip_val changed after the optimizer state was built. Fix: use "
            "the same Trainer flags for every fit of one module."
        )
    module.flags = flags
    module.adapter.hooks.trainer_attached(module, trainer)  # (the val loader matched)
