"""``coreshell doctor [OVERRIDES...]``: a pre-flight check of a config before any training.

Composes the same Hydra config ``coreshell train`` would, builds the data module, the
:class:`~torchshell.JaxModule` and the torch twin, takes one sample batch, and checks what
usually goes wrong in the first hour of a run, without running a step:

==============  ===========================================================================
versions        JAX, jaxlib, torch and CUDA versions; the devices JAX and torch see
workers         the DataLoader's start method against JAX's threads (``fork`` deadlocks)
sample batch    one batch from the configured data module: keys, shapes, dtypes
x64             64-bit fields while ``jax_enable_x64`` is off (narrowed or refused)
zero-copy       whether the sample batch crosses to JAX without a host copy
model           the model and loss traced on the sample batch (``jax.eval_shape``, no FLOPs)
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

import math
import multiprocessing
import os
import shutil
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Check", "compose_config", "doctor_command", "run_checks"]

OK, WARN, FAIL = "ok", "warn", "fail"
HEALTH_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Check:
    """One row of the doctor's table.

    Attributes:
        name: what was checked (``mesh``, ``tracking``, ...).
        status: ``"ok"``, ``"warn"`` or ``"fail"`` (blocking).
        detail: what was found and, for a problem, the fix.
    """

    name: str
    status: str
    detail: str


def compose_config(overrides: Sequence[str] = ()) -> Any:
    """The config ``coreshell train OVERRIDES`` would run with (Hydra's compose API).

    Example:
        >>> compose_config(["optim.lr=0.01"]).optim.lr
        0.01
    """
    from hydra import compose, initialize_config_dir

    from torchshell.cli import config_dir
    from torchshell.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _fmt(t: Any) -> str:
    dtype = str(getattr(t, "dtype", type(t).__name__)).removeprefix("torch.")
    return f"{dtype}{list(getattr(t, 'shape', ()))}"


def _rows(n: int, ways: int) -> int:
    return -(-n // ways) * ways


def _versions() -> Check:
    import jax
    import jaxlib
    import torch

    jax_devs = jax.devices()
    kinds = sorted({d.device_kind for d in jax_devs})
    cuda = torch.version.cuda or "none"
    torch_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    detail = (
        f"jax {jax.__version__} (jaxlib {jaxlib.__version__}): {len(jax_devs)} "
        f"{jax.default_backend()} device(s) {kinds}, {jax.process_count()} process(es); "
        f"torch {torch.__version__} (CUDA {cuda}): {torch_gpus} CUDA device(s)"
    )
    if torch_gpus and jax.default_backend() == "cpu":
        return Check(
            "versions",
            WARN,
            detail + ". torch sees GPUs but JAX runs on CPU. Fix: install jax[cuda12] "
            "matching the driver, so the step runs on the GPUs.",
        )
    return Check("versions", OK, detail)


def _mesh(cfg: Any) -> tuple[Check, Any]:
    import jax

    import jaxcore

    axes = dict(cfg.mesh.axes)
    try:
        mesh = jaxcore.make_mesh(axes, num_devices=cfg.mesh.num_devices)
    except jaxcore.MeshError as err:
        return Check("mesh", FAIL, f"mesh.axes={axes} on {len(jax.devices())} devices: {err}"), None
    return Check("mesh", OK, f"mesh.axes={axes} -> {dict(mesh.shape)}"), mesh


def _jax_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))  # OS threads, XLA's pools included
    except OSError:
        return threading.active_count()


def _workers(loader: Any) -> Check:
    workers = loader.num_workers
    ctx = loader.multiprocessing_context
    method = (
        ctx.get_start_method()
        if ctx is not None
        else multiprocessing.get_start_method(allow_none=True) or "fork (platform default)"
    )
    detail = f"num_workers={workers}, start method {method}; JAX runs {_jax_threads()} threads"
    if workers > 0 and method.startswith("fork"):
        return Check(
            "workers",
            FAIL,
            detail + ": forking a multithreaded JAX process can deadlock the workers. Fix: "
            "build the DataLoader with torchshell.data._loader.loader_kwargs (spawn, "
            "persistent_workers) or multiprocessing_context='spawn'.",
        )
    return Check("workers", OK, detail)


def _sample_checks(batch: dict[str, Any], module: Any, twin: Any, inputs: Sequence[str]) -> Check:
    fields = ", ".join(f"{k}: {_fmt(v)}" for k, v in batch.items())
    problems = []
    missing = [k for k in inputs if k not in batch]
    if missing:
        problems.append(
            f"the model reads {list(inputs)} but the batch has {sorted(batch)} (missing "
            f"{missing}). Fix: rename the fields in the Dataset/collate or set model.inputs"
        )
    make = getattr(twin, "example_input", None)
    if callable(make) and not missing:
        example = make()
        example = tuple(example) if isinstance(example, (tuple, list)) else (example,)
        for name, want in zip(inputs, example, strict=False):
            got = batch[name]
            same = (
                got.dtype == want.dtype
                and got.dim() == want.dim()
                and (got.dim() < 2 or got.shape[-1] == want.shape[-1])
            )
            if not same:
                problems.append(
                    f"field {name!r}: the torch twin expects {_fmt(want)} (batch dim first), "
                    f"the data gives {_fmt(got)}. Fix: make the Dataset produce that shape and "
                    "dtype, or change the model config to the data's"
                )
    if problems:
        return Check("sample batch", FAIL, f"{fields}; " + "; ".join(problems))
    return Check("sample batch", OK, fields)


def _x64(batch: dict[str, Any]) -> Check:
    import jax
    import torch

    wide = {torch.int64, torch.uint64, torch.float64, torch.complex128}
    found = {k: str(v.dtype).removeprefix("torch.") for k, v in batch.items() if v.dtype in wide}
    x64 = bool(jax.config.read("jax_enable_x64"))
    if not found:
        return Check("x64", OK, f"jax_enable_x64={x64}; no 64-bit fields")
    if x64:
        return Check("x64", OK, f"jax_enable_x64=True; 64-bit fields {found} cross as they are")
    return Check(
        "x64",
        WARN,
        f"64-bit fields {found} with jax_enable_x64=False: each is range-checked and copied "
        "to 32 bits on every step (values that do not fit raise). Fix: store them as "
        "int32/float32 in the Dataset.",
    )


def _transfer(batch: dict[str, Any], module: Any, rows: int) -> tuple[Check, Any]:
    import bridge

    stats = bridge.new_stats()
    try:
        out = bridge.to_jax(batch, module.batch_sharding, pad_to=rows, stats=stats)
    except bridge.TransferError as err:
        return Check("zero-copy", FAIL, str(err)), None
    detail = (
        f"{stats.zero_copy_bytes} B zero-copy, {stats.copied_bytes} B copied per batch"
        + "".join(f"; {name!r}: {why}" for (name, why), _ in stats.copies.items())
    )
    if stats.copied_bytes:
        return Check(
            "zero-copy",
            WARN,
            detail + ". Fix: see docs/bridge.md (int32/float32, contiguous, 64-byte aligned, "
            "batch a multiple of the data axis).",
        ), out
    return Check("zero-copy", OK, detail), out


def _abstract_state(module: Any, jbatch: dict[str, Any]) -> Any:
    import jax
    import jax.numpy as jnp

    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in jbatch.items()}

    def init(rng: Any) -> dict[str, Any]:
        batch = {k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items()}
        params, model_state = module.model_fns.init(rng, batch)
        return {
            "params": params,
            "opt_state": module.tx.init(params),
            "model_state": model_state,
        }

    return jax.eval_shape(init, jax.random.key(0))


def _model(module: Any, jbatch: dict[str, Any]) -> tuple[Check, Any]:
    import jax

    try:
        abstract = _abstract_state(module, jbatch)

        def forward(state: Any, batch: Any, key: Any) -> Any:
            out, _ = module.model_fns.apply(state["params"], state["model_state"], batch, key, True)
            return module.loss_fn(out, batch)

        loss, metrics = jax.eval_shape(forward, abstract, jbatch, jax.random.key(0))
    except Exception as err:  # any error here is the finding
        return Check(
            "model",
            FAIL,
            f"the model and loss do not run on the sample batch: {type(err).__name__}: "
            f"{err}. Fix: make the batch match the model (keys, shapes, dtypes; integer "
            "labels under 'y' for softmax_cross_entropy) or change the model config.",
        ), None
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract["params"]))
    return Check(
        "model", OK, f"{n:,} params; loss {_fmt(loss)}, metrics {sorted(metrics)}"
    ), abstract


def _sharding(cfg: Any, module: Any, abstract: Any) -> Check:
    from omegaconf import OmegaConf

    import jaxcore

    rules = jaxcore.sharding_rules(
        cfg.mesh.preset,
        list(OmegaConf.to_container(cfg.mesh.rules) or []),
        data_axis=cfg.mesh.data_axis,
        model_axis=cfg.mesh.model_axis,
    )
    try:  # the params first, so an error names a param rather than its optimizer moment
        plan = jaxcore.plan_shardings({"params": abstract["params"]}, module.mesh, rules)
        jaxcore.plan_shardings(abstract, module.mesh, rules, report_bytes=None)
    except jaxcore.ShardingError as err:
        return Check("sharding", FAIL, str(err))
    import jax

    leaves = jax.tree.leaves(
        plan.specs["params"], is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    sharded = sum(1 for spec in leaves if any(e is not None for e in spec))
    detail = f"preset {cfg.mesh.preset}: {sharded} of {len(leaves)} param leaves sharded"
    if plan.unmatched:
        names = ", ".join(f"{u.path} {list(u.shape)}" for u in plan.unmatched)
        return Check(
            "sharding",
            WARN,
            detail + f"; no rule shards {names} (replicated on every device). Fix: add a "
            "rule for them to mesh.rules.",
        )
    return Check("sharding", OK, detail)


def _shapes(n: int, batch: int, ways: int, drop_last: bool) -> set[int]:
    out = set()
    if n >= batch:
        out.add(_rows(batch, ways))
    if n % batch and not drop_last:
        out.add(_rows(n % batch, ways))
    return out


def _recompiles(data: Any, module: Any) -> list[Check]:
    ways = module.mesh.shape[module.data_axis]
    k = getattr(module, "steps_per_call", 1)
    buckets = len(getattr(getattr(data, "collate", None), "buckets", ()) or (1,))
    checks, parts, warn = [], [], []
    for split, make in (
        ("train", data.train_dataloader),
        ("val", data.val_dataloader),
        ("test", data.test_dataloader),
    ):
        loader = make()
        sampler = loader.batch_sampler
        size = getattr(sampler, "batch_size", None) or loader.batch_size
        drop = bool(getattr(sampler, "drop_last", loader.drop_last))
        n = len(loader.dataset)
        shapes = _shapes(n, size // k if split == "train" else size, ways, drop)
        if split == "train" and not shapes:
            checks.append(
                Check(
                    "data",
                    FAIL,
                    f"the training set has {n} rows, not one full batch of {size}: the "
                    "run would train no step. Fix: check the data path and split fractions, "
                    "or lower data.batch_size.",
                )
            )
        per_rows = size // k if split == "train" else size
        if split == "train" and per_rows % ways:
            warn.append(
                f"train batch {per_rows} is not a multiple of the data axis ({ways}): "
                f"padded to {_rows(per_rows, ways)} rows every step (wasted compute). "
                f"Fix: set data.batch_size to a multiple of {ways}"
            )
        count = len(shapes) * buckets
        parts.append(f"{split}: {n} rows / batch {per_rows} -> rows {sorted(shapes)}")
        if count > 1:
            warn.append(f"{split} compiles {count} shapes")
    detail = "; ".join(parts) + (f"; {buckets} length buckets" if buckets > 1 else "")
    if warn:
        detail += ". " + "; ".join(warn) + " (each extra shape is one more XLA compile)"
        checks.append(Check("recompiles", WARN, detail))
    else:
        checks.append(Check("recompiles", OK, detail + "; one compiled shape per step"))
    return checks


def _tracking(uri: str) -> Check:
    if uri.startswith(("http://", "https://")):
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=HEALTH_TIMEOUT_S) as reply:
                status = reply.status
        except (urllib.error.URLError, OSError, ValueError) as err:
            return Check(
                "tracking",
                FAIL,
                f"tracking.uri={uri}: GET {url} failed within {HEALTH_TIMEOUT_S:.0f} s "
                f"({getattr(err, 'reason', err)}). Fix: start the server (mlflow server "
                "--host 127.0.0.1 --port PORT --backend-store-uri sqlite:///mlflow.db) or set "
                "tracking.uri=sqlite:///mlflow.db.",
            )
        if status != 200:
            return Check("tracking", FAIL, f"GET {url} answered {status}, expected 200.")
        return Check("tracking", OK, f"tracking.uri={uri}: GET /health 200")
    if uri.startswith("sqlite:///"):
        parent = Path(uri.removeprefix("sqlite:///")).absolute().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            return Check(
                "tracking",
                FAIL,
                f"tracking.uri={uri}: the folder {parent} does not exist or is not writable. "
                "Fix: create it or point tracking.uri at a writable path.",
            )
        return Check("tracking", OK, f"tracking.uri={uri}: {parent} is writable")
    return Check("tracking", WARN, f"tracking.uri={uri}: this scheme is not checked")


def _checkpoints(cfg: Any, abstract: Any) -> Check:
    import jax

    if cfg.ckpt.every_n_steps <= 0:
        return Check("checkpoints", OK, "off (ckpt.every_n_steps=0)")
    where = Path(cfg.ckpt.dir).absolute()
    existing = next(p for p in (where, *where.parents) if p.exists())
    state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    need = (cfg.ckpt.keep + 1) * state * 1.2  # keep + the one being written, + export
    free = shutil.disk_usage(existing).free
    detail = (
        f"{cfg.ckpt.dir}: {state / 2**20:.1f} MiB of state per checkpoint, "
        f"{free / 2**30:.1f} GiB free on {existing}"
    )
    if not os.access(existing, os.W_OK):
        return Check("checkpoints", FAIL, f"{detail}; not writable. Fix: set ckpt.dir.")
    if free < need:
        return Check(
            "checkpoints",
            FAIL,
            f"{detail}; {cfg.ckpt.keep} checkpoints need ~{need / 2**20:.0f} MiB. Fix: free "
            "space, lower ckpt.keep or move ckpt.dir.",
        )
    return Check("checkpoints", OK, detail)


def run_checks(cfg: Any) -> list[Check]:
    """Every pre-flight check for a composed config (see the module doc).

    Args:
        cfg: a config from :func:`compose_config`.

    Returns:
        The checks in table order; any ``fail`` is blocking.

    Example:
        >>> checks = run_checks(compose_config(["tracking.uri=sqlite:///mlflow.db"]))
        >>> [c.name for c in checks][:2]
        ['versions', 'mesh']
    """
    from torchshell.cli import build

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
        batch = dict(next(iter(loader)))
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
    transfer, jbatch = _transfer(batch, module, _rows(n, mesh.shape[module.data_axis]))
    checks.append(transfer)
    if jbatch is None:
        return checks
    model, abstract = _model(module, jbatch)
    checks.append(model)
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
        unknown key, wrong type).

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

    try:
        cfg = compose_config(argv)
    except (HydraException, OmegaConfBaseException) as err:
        print(
            f"coreshell doctor: the config does not compose with {argv}: {err}\nFix: check "
            "the key names and types against conf/ (coreshell train --cfg job prints it).",
            file=sys.stderr,
        )
        return 2
    checks = run_checks(cfg)
    render(checks)
    return 1 if any(c.status == FAIL for c in checks) else 0
