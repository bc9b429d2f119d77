"""What ``coreshell train`` prints: one config line, the param table, one progress bar, the
end summary. Numbers are rounded for people; the exact values are in MLflow."""

from __future__ import annotations

import math
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import RichProgressBar

from torchshell.adapters._logs import OWN
from torchshell.app import quiet

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


def _way_in(cfg: Config) -> str:
    """How the model comes in: ``Flax MLP``, ``traced torch MLP``, ``ported Lightning M``."""
    for kind, node in (
        ("ported Lightning", cfg.model.lightning_module),
        ("traced torch", cfg.model.torch),
        ("Flax", cfg.model.flax),
    ):
        if node:
            return f"{kind} {str(node.get('_target_', '?')).rsplit('.', 1)[-1]}"
    return "no model"


_PRESETS = {
    "dp": "dp (params replicated)",
    "fsdp": "fsdp (each param split over data)",
    "tp": "tp (Dense kernels split over model)",
    "fsdp_tp": "fsdp_tp (tp, then the rest split over data)",
}


def mesh_words(cfg: Config, devices: int, platform: str = "cpu") -> str:
    """The mesh as it will be built: each axis at its size (``-1`` resolved) and the
    sharding rules by name (``mesh.rules`` first, then the preset).

    Example:
        >>> from torchshell.app.config import compose_config, typed
        >>> mesh_words(typed(compose_config(["data=digits", "mesh=fsdp"])), 2)
        'mesh data=2 model=1 on 2 cpu devices, rules fsdp (each param split over data)'
    """
    axes = dict(cfg.mesh.axes)
    used = cfg.mesh.num_devices or devices
    fixed = math.prod(v for v in axes.values() if v != -1)
    if fixed > 0 and used % fixed == 0:  # (else make_mesh refuses it, naming the sizes)
        axes = {k: used // fixed if v == -1 else v for k, v in axes.items()}
    shape = " ".join(f"{k}={v}" for k, v in axes.items())
    rules = [f"mesh.rules {[str(r[0]) for r in cfg.mesh.rules]} then"] if cfg.mesh.rules else []
    rules.append(_PRESETS.get(cfg.mesh.preset, cfg.mesh.preset))
    of = f"{used} of {devices}" if used != devices else f"{devices}"
    return f"mesh {shape} on {of} {platform} device{'s' if devices != 1 else ''}, rules " + (
        " ".join(rules)
    )


def config_line(cfg: Config, run: Prepared, resume: str | None = None) -> None:
    """The one line that says what this run is (and the checkpoint a resumed run starts from).

    Example:
        >>> from torchshell.app.config import compose_config, typed
        >>> from torchshell.app.prepare import Prepared
        >>> cfg = typed(compose_config(["data=digits", "step.compile_cache_dir=null"]))
        >>> config_line(cfg, Prepared(cfg, True, 2))  # doctest: +NORMALIZE_WHITESPACE
        coreshell train: digits (DigitsDataModule, Flax MLP), batch 64, adamw lr 0.003,
        mesh data=2 model=1 on 2 cpu devices, rules dp (params replicated), max_steps 600,
        fp32, compile cache off
    """
    import jax

    data = str(cfg.data.get("_target_", "?")).rsplit(".", 1)[-1]
    recipe = cfg.model.recipe or cfg.data.get("recipe") or "custom"
    length = (
        f"max_epochs {cfg.trainer.max_epochs}"
        if cfg.trainer.max_epochs not in (None, -1)
        else f"max_steps {cfg.trainer.max_steps}"
    )
    cache = "compile cache on" if run.cache is not None else "compile cache off"
    resumed = f", resumes {resume}" if resume else ""
    print(
        f"coreshell train: {recipe} ({data}, {_way_in(cfg)}), batch "
        f"{cfg.data.get('batch_size')}, {cfg.optim.name} lr {human(cfg.optim.lr)}, "
        f"{mesh_words(cfg, run.devices, jax.devices()[0].platform)}, {length}, "
        f"{precision_name(cfg)}, {cache}{resumed}{sweep_job()}"
    )


def sweep_job() -> str:
    """``, sweep job #N in FOLDER`` in a job of a Hydra multirun (``-m``), else ``""``: Hydra's
    launcher lines (``Launching N jobs locally``, ``#N : every override``) are folded here.

    Example:
        >>> sweep_job()  # not in a multirun
        ''
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return ""
    hydra = HydraConfig.get()
    folder = os.path.relpath(hydra.runtime.output_dir)
    folder = folder if not folder.startswith("..") else hydra.runtime.output_dir
    return f", sweep job #{hydra.job.num} in {folder}"


def precision_name(cfg: Config) -> str:
    """``bf16`` or ``fp32``: the step's compute dtype."""
    return "bf16" if cfg.precision.compute_dtype == "bfloat16" else "fp32"


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

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The test split's bar goes when it is done: the console keeps one bar (the test
        metrics are in the end summary)."""
        if self.progress is not None and self.test_progress_bar_id is not None:
            self.progress.update(self.test_progress_bar_id, advance=0, visible=False)
            self.refresh()
        super().on_test_end(trainer, pl_module)

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
    the training loss; coreshell's telemetry (``system/coreshell.perf.*``,
    ``.bridge.*``, ``.compile.*``) stays in MLflow.
    """
    shown = ", ".join(
        f"{k}={human(v)}"
        for k, v in sorted(metrics.items())
        if not k.startswith(OWN) or k == f"{OWN}train.loss"
    )
    where = f"{cfg.tracking.uri} (experiment {cfg.tracking.experiment!r})"
    name = (
        f"{cfg.tracking.run_name!r} ({report.run_id})" if cfg.tracking.run_name else report.run_id
    )
    print(f"\nMLflow run {name} in {where}")
    stop = quiet.stopped()  # Lightning's own line, folded here in quiet mode
    if stop is not None:
        print(f"  stopped: {stop} reached")
    if not report.complete:
        print(f"  tracking: {report}")
    print(f"  metrics: {shown}")
    print(f"  torch weights: {result['export']} ({parity_words(result)})")
    if run.cache is not None:
        print(f"  {run.cache}")
    if cfg.tracking.uri.startswith("sqlite:"):
        print(f"  open it with: {mlflow_command()} ui --backend-store-uri {cfg.tracking.uri}")


def parity_words(result: dict[str, Any]) -> str:
    """The parity figure and its verdict at the precision the step computed in.

    Example:
        >>> parity_words({"parity_max_abs_diff": 9.1e-3, "parity_ok": True,
        ...               "parity_tolerance": 0.05, "precision": "bf16"})
        'parity max abs diff 9.1e-03: ok at bf16, tolerance 5e-02 + 5e-02 x |torch|'
    """
    parity = result.get("parity_max_abs_diff")
    if parity is None:
        return "no forward: not checked"
    if "parity_ok" not in result:
        return f"parity max abs diff {parity:.1e}"
    tol, precision = result["parity_tolerance"], result["precision"]
    verdict = f"ok at {precision}" if result["parity_ok"] else f"TOO FAR for {precision}"
    return f"parity max abs diff {parity:.1e}: {verdict}, tolerance {tol:.0e} + {tol:.0e} x |torch|"


def mlflow_command() -> str:
    """How to run this environment's ``mlflow`` from here: ``mlflow`` when the shell finds
    this interpreter's own, else its path (``.venv/bin/mlflow``: a venv used without being
    activated), else ``python -m mlflow``.

    Example:
        >>> mlflow_command().endswith("mlflow")
        True
    """
    beside = Path(sys.executable).parent / "mlflow"  # (not resolved: the venv's bin/)
    found = shutil.which("mlflow")
    if beside.is_file():
        if found is not None and Path(found).resolve() == beside.resolve():
            return "mlflow"
        relative = os.path.relpath(beside)
        return relative if not relative.startswith("..") else str(beside)
    return "mlflow" if found is not None else f"{sys.executable} -m mlflow"
