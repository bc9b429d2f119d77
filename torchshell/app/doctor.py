"""``coreshell doctor [OVERRIDES...]``: a pre-flight check of a config before any training.

Composes the same Hydra config ``coreshell train`` would, builds the data module, the
:class:`~torchshell.JaxModule` and the torch twin, takes one sample batch, and checks what
usually goes wrong in the first hour of a run, without running a step:

==============  ===========================================================================
versions        JAX, jaxlib, torch and CUDA versions; the devices JAX and torch see
workers         the DataLoader's start method against JAX's threads (``fork`` deadlocks)
sample batch    one batch from the configured data module: keys, shapes, dtypes; the twin
                runs on it (the axes it declares dynamic, e.g. time, may differ from its example)
x64             64-bit fields while ``jax_enable_x64`` is off (narrowed or refused)
zero-copy       whether the sample batch crosses to JAX without a host copy
model           the model and loss traced on the sample batch (``jax.eval_shape``, no FLOPs)
buckets         every length bucket of the data: the JAX model (traced) and the torch twin
mesh            mesh axes against the device count; the batch against the data axis
sharding        the sharding plan of the whole state; params that no rule shards
recompiles      compiled shapes the loaders will produce (ragged last batches, buckets)
tracking        MLflow reachability (``GET /health`` for an http URI)
checkpoints     free space for ``ckpt.keep`` checkpoints in ``ckpt.dir``
==============  ===========================================================================

Each check is ``ok``, ``warn`` (works, but costs time or memory) or ``fail`` (the run would
stop or be wrong). The command exits 1 when any check fails, 2 on a config it cannot compose.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Sequence

from omegaconf import DictConfig

from bridge import round_up
from torchshell.app._doctor_checks import (
    FAIL,
    OK,
    WARN,
    Check,
    _checkpoints,
    _mesh,
    _model,
    _recompiles,
    _sharding,
    _tracking,
    _transfer,
    _versions,
    _workers,
    _x64,
)
from torchshell.app._doctor_shapes import _buckets, _sample_checks
from torchshell.app.config import Config, compose_config, typed
from torchshell.app.failures import BAD_INPUT, our_errors, report
from torchshell.app.prepare import build, prepare_run
from torchshell.data import stop_workers

__all__ = ["FAIL", "OK", "WARN", "Check", "compose_config", "doctor_command", "run_checks"]


def run_checks(cfg: Config | DictConfig) -> list[Check]:
    """Every pre-flight check for a config (see the module doc).

    The config goes through the same :func:`~torchshell.app.prepare.prepare_run` and
    :func:`~torchshell.app.prepare.build` as ``coreshell train``: the same devices and mesh,
    the same refusals (raised, as ``train`` raises them).

    Args:
        cfg: a config from :func:`compose_config` (typed here) or a typed :class:`Config`.

    Returns:
        The checks in table order; any ``fail`` is blocking.

    Raises:
        ConfigError: a config ``coreshell train`` refuses too (cross-field checks).

    Example:
        >>> checks = run_checks(compose_config(["data=digits", "tracking.uri=sqlite:///m.db"]))
        >>> [c.name for c in checks][:2]
        ['versions', 'mesh']
    """
    if isinstance(cfg, DictConfig):
        cfg = typed(cfg)
    prepare_run(cfg, compile_cache=False)  # doctor compiles nothing
    checks = [_versions()]
    mesh_check, mesh = _mesh(cfg)
    checks.append(mesh_check)
    checks.append(_tracking(str(cfg.tracking.uri)))
    if mesh is None:
        return checks
    try:
        data, module, twin = build(cfg)
        data.prepare_data()
        data.setup("fit")
        loader = data.train_dataloader()
    except Exception as err:  # any error here is the finding
        checks.append(Check("build", FAIL, f"{type(err).__name__}: {err}"))
        return checks
    checks.append(_workers(loader))
    checks.extend(_recompiles(data, module))
    if any(c.name in ("workers", "data") and c.status == FAIL for c in checks):
        return checks
    try:
        batches = iter(loader)
        batch = dict(next(batches))
        stop_workers(batches)  # one batch is all the checks need
    except StopIteration:
        checks.append(
            Check(
                "data",
                FAIL,
                "the training loader yields no batch. Fix: check "
                "the data path, split fractions and data.batch_size.",
            )
        )
        return checks
    k = getattr(module, "steps_per_call", 1)
    n = next(iter(batch.values())).shape[0] // k
    batch = {name: t[:n] for name, t in batch.items()}
    checks.append(_sample_checks(batch, module, twin, list(cfg.model.inputs)))
    checks.append(_x64(batch))
    transfer, jbatch = _transfer(batch, module, round_up(n, mesh.shape[module.data_axis]))
    checks.append(transfer)
    if jbatch is None:
        return checks
    model, abstract = _model(module, jbatch)
    checks.append(model)
    if abstract is not None:
        buckets = _buckets(data, batch, module, twin, list(cfg.model.inputs), jbatch)
        checks.extend([buckets] if buckets is not None else [])
    if abstract is not None:
        checks.append(_sharding(cfg, module, abstract))
        checks.append(_checkpoints(cfg, abstract))
    return checks


def render(checks: Sequence[Check], print_fn: Callable[..., None] | None = None) -> None:
    """Prints the checks as a rich table (and a one-line verdict)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, width=max(shutil.get_terminal_size().columns, 120))
    table = Table(title="coreshell doctor", show_lines=True)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail", overflow="fold")
    style = {OK: "green", WARN: "yellow", FAIL: "bold red"}
    for c in checks:
        table.add_row(c.name, f"[{style[c.status]}]{c.status}[/]", c.detail)
    (print_fn or console.print)(table)
    failed = [c.name for c in checks if c.status == FAIL]
    verdict = f"blocking: {', '.join(failed)}" if failed else "no blocking problem"
    (print_fn or console.print)(f"coreshell doctor: {verdict}")


def doctor_command(argv: list[str]) -> int:
    """``coreshell doctor [OVERRIDES...]``: prints the table; 0 when nothing blocks.

    Returns:
        0 (no blocking problem), 1 (a check failed) or 2 (the config does not compose:
        unknown key, wrong type; or ``coreshell train`` refuses it).

    Example:
        >>> doctor_command(["--help"])  # doctest: +ELLIPSIS
        usage: coreshell doctor ...
        0
    """
    if argv and argv[0] in ("-h", "--help"):
        print("usage: coreshell doctor [OVERRIDES...]  (the same overrides as coreshell train)")
        return 0
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from torchshell.app.overrides import base_config, check_overrides

    try:
        check_overrides(argv, base_config(argv))  # an unknown key, a +key none reads: as train
        cfg = compose_config(argv)
    except our_errors() as err:
        return report("doctor", err)
    except (HydraException, OmegaConfBaseException) as err:
        print(
            f"coreshell doctor: the config does not compose with {argv}: {err}\nFix: check "
            "the key names and types against conf/ (coreshell train --cfg job prints it).",
            file=sys.stderr,
        )
        return BAD_INPUT
    try:
        checks = run_checks(cfg)
    except our_errors() as err:  # refused before any check, as `coreshell train` refuses it
        return report("doctor", err)
    render(checks)
    return 1 if any(c.status == FAIL for c in checks) else 0
