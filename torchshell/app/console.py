"""What ``coreshell train`` prints: one config line, the param table, one progress bar, the
end summary. Numbers are rounded for people; the exact values are in MLflow."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import RichProgressBar

from torchshell.adapters._logs import OWN

if TYPE_CHECKING:
    import lightning as L

    from torchshell.app.config import Config
    from torchshell.app.prepare import Prepared
    from torchshell.tracking import TrackingReport


def human(x: float, digits: int = 3) -> str:
    """``x`` with ``digits`` significant digits, thousands separated, no exponent for people.

    Example:
        >>> human(0.0123456), human(1234.5), human(3.0), human(2.5e-7)
        ('0.0123', '1,234', '3', '2.5e-07')
    """
    if not math.isfinite(x):
        return str(x)
    if abs(x) >= 10 ** (digits - 1):
        return f"{round(x):,}"
    return f"{x:.{digits}g}"


def config_line(cfg: Config, run: Prepared) -> None:
    """The one line that says what this run is.

    Example:
        >>> from torchshell.app.config import compose_config, typed
        >>> from torchshell.app.prepare import Prepared
        >>> cfg = typed(compose_config(["data=digits", "step.compile_cache_dir=null"]))
        >>> config_line(cfg, Prepared(cfg, True, 2))  # doctest: +NORMALIZE_WHITESPACE
        coreshell train: digits (DigitsDataModule, MLP), batch 64, adamw lr 0.003,
        mesh {'data': -1, 'model': 1} on 2 cpu device(s), max_steps 600, fp32, compile cache off
    """
    data = str(cfg.data.get("_target_", "?")).rsplit(".", 1)[-1]
    model = cfg.model.lightning_module or cfg.model.torch or cfg.model.flax or {}
    model_name = str(model.get("_target_", "?")).rsplit(".", 1)[-1]
    recipe = cfg.model.recipe or cfg.data.get("recipe") or "custom"
    length = (
        f"max_epochs {cfg.trainer.max_epochs}"
        if cfg.trainer.max_epochs not in (None, -1)
        else f"max_steps {cfg.trainer.max_steps}"
    )
    cache = "compile cache on" if run.cache is not None else "compile cache off"
    precision = "bf16" if cfg.precision.compute_dtype == "bfloat16" else "fp32"
    print(
        f"coreshell train: {recipe} ({data}, {model_name}), batch {cfg.data.get('batch_size')}, "
        f"{cfg.optim.name} lr {human(cfg.optim.lr)}, mesh {dict(cfg.mesh.axes)} on "
        f"{run.devices} cpu device(s), {length}, {precision}, {cache}"
    )


class RunProgressBar(RichProgressBar):
    """Lightning's Rich bar with a total that is true: steps when only ``max_steps`` is set
    (one bar for the whole run, not one per epoch), else ``Epoch e/E`` counted from 1."""

    def _by_steps(self) -> bool:
        trainer = self.trainer
        return trainer.max_epochs in (None, -1) and trainer.max_steps > 0

    @property
    def total_train_batches(self) -> int | float:
        """The bar's total: the run's optimizer steps, or the batches of one epoch."""
        return self.trainer.max_steps if self._by_steps() else super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        if self._by_steps():
            return "train steps"
        total = self.trainer.max_epochs
        return f"Epoch {current_epoch + 1}" + (f"/{total}" if total not in (None, -1) else "")

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """The module's bar metrics (loss, samples/s, val), without Lightning's ``v_num``
        (the MLflow run id, printed at the end)."""
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return {k: human(v) if isinstance(v, float) else v for k, v in items.items()}

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """One bar for a step-counted run; Lightning's reset per epoch otherwise."""
        if self._by_steps() and self.train_progress_bar_id is not None:
            return
        super().on_train_epoch_start(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        """Advances by the optimizer steps done (``steps_per_call`` per batch)."""
        if not self._by_steps():
            super().on_train_batch_end(trainer, pl_module, *args)
            return
        if self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()


def progress_bar() -> RunProgressBar:
    """The run's progress bar (leaves no finished validation bars behind)."""
    return RunProgressBar(leave=False)


def end_summary(
    cfg: Config,
    run: Prepared,
    report: TrackingReport,
    metrics: dict[str, float],
    result: dict[str, Any],
) -> None:
    """The end of a run: where it is tracked, its metrics, the export and its parity.

    The metrics shown are the run's own (the model's, or the user's ``self.log`` names) and
    the training loss; coreshell's telemetry (``coreshell/perf/*``, ``coreshell/bridge/*``,
    ``coreshell/compile/*``) stays in MLflow.
    """
    shown = ", ".join(
        f"{k}={human(v)}"
        for k, v in sorted(metrics.items())
        if not k.startswith(OWN) or k == f"{OWN}train/loss"
    )
    where = f"{cfg.tracking.uri} (experiment {cfg.tracking.experiment!r})"
    name = (
        f"{cfg.tracking.run_name!r} ({report.run_id})" if cfg.tracking.run_name else report.run_id
    )
    print(f"\nMLflow run {name} in {where}")
    if not report.complete:
        print(f"  tracking: {report}")
    print(f"  metrics: {shown}")
    parity = result["parity_max_abs_diff"]
    checked = "no forward: not checked" if parity is None else f"parity max abs diff {parity:.1e}"
    print(f"  torch weights: {result['export']} ({checked})")
    if run.cache is not None:
        print(f"  {run.cache}")
    if cfg.tracking.uri.startswith("sqlite:"):
        print(f"  open it with: mlflow ui --backend-store-uri {cfg.tracking.uri}")
