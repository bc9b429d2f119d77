"""Everything before training that ``coreshell train`` and ``coreshell doctor`` both need.

:func:`prepare_run` is the one path: the cross-field checks, the CPU device split, JAX's
distributed runtime, the seeds and the persistent compile cache, in that order (the device
split must come before JAX starts). :func:`build` then makes the data module, the
:class:`~torchshell.JaxModule` and the torch twin from the checked config. Both commands call
both, so they plan the same mesh and refuse the same configs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchshell.app.config import LOSSES, Config, plain

log = logging.getLogger("coreshell")


@dataclass
class CacheCounter:
    """Hits and misses of JAX's persistent compilation cache, counted from JAX's events.

    Example:
        >>> c = CacheCounter(Path("/tmp/cache"))
        >>> c.on_event("/jax/compilation_cache/cache_hits"); c.hits, c.misses
        (1, 0)
        >>> str(c)
        'compile cache /tmp/cache: 1 hit, 0 misses'
    """

    directory: Path
    hits: int = 0
    misses: int = 0

    def on_event(self, event: str, **_: Any) -> None:
        """A ``jax.monitoring`` event listener."""
        if event == "/jax/compilation_cache/cache_hits":
            self.hits += 1
        elif event == "/jax/compilation_cache/cache_misses":
            self.misses += 1

    def __str__(self) -> str:
        hits = f"{self.hits} hit" + ("" if self.hits == 1 else "s")
        misses = f"{self.misses} miss" + ("" if self.misses == 1 else "es")
        return f"compile cache {self.directory}: {hits}, {misses}"


@dataclass
class Prepared:
    """What :func:`prepare_run` set up.

    Attributes:
        cfg: the checked config.
        main: whether this is process 0 (it logs, prints and writes shared files).
        devices: the JAX devices of the run (all processes).
        cache: the compile-cache counter, or None when the cache is off.
    """

    cfg: Config
    main: bool
    devices: int
    cache: CacheCounter | None = field(default=None)


_COUNTERS: dict[Path, CacheCounter] = {}


def _compile_cache(directory: str | None) -> CacheCounter | None:
    import jax

    import jaxcore

    if not directory:
        jaxcore.disable_compile_cache()
        return None
    path = jaxcore.enable_compile_cache(directory)
    counter = _COUNTERS.get(path)
    if counter is None:  # one listener per directory and process (a sweep prepares again)
        counter = _COUNTERS[path] = CacheCounter(path)
        jax.monitoring.register_event_listener(counter.on_event)
    counter.hits = counter.misses = 0
    return counter


def prepare_run(cfg: Config, *, compile_cache: bool = True) -> Prepared:
    """Checks the config and readies JAX for it; call it first thing, before JAX starts.

    Args:
        cfg: the typed config (:func:`torchshell.app.config.typed`).
        compile_cache: switch on the persistent compile cache of ``step.compile_cache_dir``
            (``coreshell doctor`` compiles nothing and leaves it alone).

    Returns:
        The :class:`Prepared` run.

    Raises:
        ConfigError: a cross-field problem, a bad ``mesh.cpu_devices`` or ``dist.*``.
        DistributedError: the distributed runtime could not start.

    Example:
        >>> from torchshell.app.config import compose_config, typed
        >>> run = prepare_run(typed(compose_config(["data=digits"])), compile_cache=False)
        >>> run.main, run.devices >= 1
        (True, True)
    """
    import jax
    import lightning as L

    import jaxcore
    from torchshell import distributed

    cfg.check()
    jaxcore.set_cpu_devices(cfg.mesh.cpu_devices)  # before JAX starts
    distributed.initialize(**plain(cfg.dist))
    # after initialize (JAX touches no device before); process 0 logs, prints and exports
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    cache = _compile_cache(cfg.step.compile_cache_dir) if compile_cache else None
    return Prepared(cfg, distributed.is_main(), jax.device_count(), cache)


def data_module_kwargs(fields: dict[str, Any], *, seed: int, batch_size: int) -> dict[str, Any]:
    """What the run adds to the data config's fields: ``batch_size``, and ``seed`` when the
    data module takes one. Refuses fields its ``__init__`` does not take, naming them.

    A user's module under ``data._target_=pkg.MyDataModule`` keeps the recipe's other fields
    (``root``, ``takes``, ...): Hydra's own message is a ``TypeError`` about one of them.

    Example:
        >>> fields = {"_target_": "torchshell.data.digits.DigitsDataModule", "num_workers": 0}
        >>> sorted(data_module_kwargs(fields, seed=1, batch_size=8))
        ['batch_size', 'seed']
    """
    import inspect

    from hydra.utils import get_object

    from torchshell._errors import ConfigError

    target = fields["_target_"]
    run = {"seed": seed, "batch_size": batch_size}
    try:
        params = inspect.signature(get_object(target)).parameters
    except (ImportError, ValueError, TypeError):  # not loadable: Hydra's instantiate says so
        return run
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return run
    given = [k for k in fields if not k.startswith("_")]
    unknown = [k for k in dict.fromkeys((*given, "batch_size")) if k not in params]
    if unknown:
        drop = " ".join(f"~data.{k}" for k in unknown if k != "batch_size")
        raise ConfigError(
            f"data._target_={target} does not take {unknown}: expected a data module whose "
            "__init__ takes every field of the data config, and batch_size (the run sets it: "
            "data.batch_size x step.steps_per_call, per process). Fix: give your "
            "module its own data config (conf/data/NAME.yaml, then data=NAME), or drop the "
            f"fields it does not take on the command line ({drop or 'none'}) and give it a "
            "batch_size argument."
        )
    return {k: v for k, v in run.items() if k in params}


def build(cfg: Config) -> tuple[Any, Any, Any]:
    """The data module, the :class:`~torchshell.JaxModule` and the torch model to export into.

    With ``steps_per_call=K`` the training DataLoader carries ``K * data.batch_size`` rows
    per batch (``JaxModule`` views them as K stacked batches). ``data.batch_size`` is the
    global batch: with several JAX processes each loader yields its share of the rows.

    Example:
        >>> from torchshell.app.config import compose_config, typed
        >>> data, module, twin = build(typed(compose_config(["data=digits"])))
        >>> type(module).__name__, type(twin).__name__
        ('JaxModule', 'MLP')
    """
    import torch
    from hydra.utils import instantiate

    import jaxcore
    from torchshell import distributed
    from torchshell.module import JaxModule

    k = cfg.step.steps_per_call
    rows = distributed.local_batch_size(cfg.data["batch_size"]) * k
    data_args = {key: v for key, v in cfg.data.items() if key != "recipe"}
    data = instantiate(data_args, **data_module_kwargs(data_args, seed=cfg.seed, batch_size=rows))
    mesh = jaxcore.make_mesh(dict(cfg.mesh.axes), num_devices=cfg.mesh.num_devices)
    options: dict[str, Any] = dict(
        mesh=mesh,
        inputs=list(cfg.model.inputs),
        seed=cfg.seed,
        sharding=cfg.mesh.preset,
        rules=list(cfg.mesh.rules),
        data_axis=cfg.mesh.data_axis,
        model_axis=cfg.mesh.model_axis,
        steps_per_call=k,
        accum_steps=cfg.step.accum_steps,
        compute_dtype=cfg.precision.compute_dtype,
        nan_policy=cfg.step.nan_policy,
        print_summary=cfg.trainer.enable_model_summary and distributed.is_main(),
    )
    if cfg.model.lightning_module is not None:  # its own loss, self.log and optimizers
        torch.manual_seed(cfg.seed)
        lit = instantiate(cfg.model.lightning_module, _convert_="all")
        options.pop("inputs")
        return data, JaxModule.from_lightning(lit, **options), lit
    loss = LOSSES[cfg.model.loss]
    tx = jaxcore.make_optimizer(**plain(cfg.optim))
    if cfg.model.torch is not None:
        torch.manual_seed(cfg.seed)  # the module's initial weights come from torch's RNG
        net = instantiate(cfg.model.torch, _convert_="all")
        return data, JaxModule.from_torch(net, loss, tx, **options), net
    flax_model = instantiate(cfg.model.flax, _convert_="all")
    twin = instantiate(cfg.model.twin, _convert_="all")
    return data, JaxModule(flax_model, loss, tx, **options), twin


__all__ = ["CacheCounter", "Prepared", "build", "prepare_run"]
