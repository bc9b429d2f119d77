"""The checks of ``coreshell doctor``, one function per row of its table."""

from __future__ import annotations

import math
import multiprocessing
import os
import shutil
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge import round_up

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


def _fmt(t: Any) -> str:
    dtype = str(getattr(t, "dtype", type(t).__name__)).removeprefix("torch.")
    return f"{dtype}{list(getattr(t, 'shape', ()))}"


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
        out = bridge.to_jax(batch, module.placement.batch, pad_to=rows, stats=stats)
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
    import jaxcore

    rules = jaxcore.sharding_rules(
        cfg.mesh.preset,
        list(cfg.mesh.rules or []),
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
        out.add(round_up(batch, ways))
    if n % batch and not drop_last:
        out.add(round_up(n % batch, ways))
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
                f"padded to {round_up(per_rows, ways)} rows every step (wasted compute). "
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
    where = Path(cfg.ckpt.dir or cfg.ckpt.root).absolute()
    existing = next(p for p in (where, *where.parents) if p.exists())
    state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    need = (cfg.ckpt.keep + 1) * state * 1.2  # keep + the one being written, + export
    free = shutil.disk_usage(existing).free
    detail = (
        f"{cfg.ckpt.dir or cfg.ckpt.root}: {state / 2**20:.1f} MiB of state per checkpoint, "
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
