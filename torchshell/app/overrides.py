"""The command line's overrides, read before Hydra: unknown keys refused in coreshell's own
voice, and the run's name from the recipe, the model and what the overrides changed.

Hydra's own refusal of ``optim.lrr=1`` advised ``+optim.lrr=1``, which then trained with the
key ignored; :func:`check_overrides` refuses both, listing the keys of the group with a
did-you-mean, as a :class:`ConfigError` (exit 2, no traceback).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from torchshell._errors import ConfigError

#: Overrides that say where a run goes, not what ran: never part of its name.
_NOT_NAMED = (
    "hydra.",
    "tracking.",
    "ckpt.",
    "dist.",
    "resume",
    "test_after_fit",
    "trainer.enable_",
    "step.compile_cache_dir",
    "step.dump_hlo",
)


def _parse(argv: Sequence[str]) -> list[Any]:
    """Hydra's parsed overrides among ``argv`` (flags such as ``-m``, ``--cfg job`` skipped)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    lines, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--info"):
            skip = arg not in ("--info",)
        elif not arg.startswith("-") and ("=" in arg or arg.startswith("~")):
            lines.append(arg)
    try:
        return list(OverridesParser.create().parse_overrides(lines))
    except Exception:  # Hydra reports a malformed override itself
        return []


def _groups() -> set[str]:
    from torchshell.app.config import config_dir

    return {p.name for p in config_dir().iterdir() if p.is_dir()}


def _default_choices() -> dict[str, Any]:
    """The group choices of ``config.yaml``'s defaults list (``mesh: dp``, ...)."""
    import yaml

    from torchshell.app.config import config_dir

    doc = yaml.safe_load((config_dir() / "config.yaml").read_text(encoding="utf-8"))
    return {k: v for d in doc.get("defaults", []) if isinstance(d, dict) for k, v in d.items()}


def base_config(argv: Sequence[str]) -> DictConfig | None:
    """The config the group choices of ``argv`` compose (a sweep's first choice), before any
    key override; ``None`` when Hydra would refuse them (it then says why itself)."""
    from torchshell.app.config import compose_config

    groups = _groups()
    choices = []
    for o in _parse(argv):
        if o.key_or_group in groups and o.package is None:
            value = o.value()
            first = next(iter(value.list), None) if o.is_sweep_override() else value
            if isinstance(first, str):
                choices.append(f"{o.get_key_element()}={first}")
    try:
        return compose_config(choices)
    except Exception:
        return None


def _schema_keys(node: Any) -> list[str] | None:
    """The keys a schema reads at ``node``; ``None`` where any key is taken (``data``,
    ``model.flax``: passed on to the class they name)."""
    kind = OmegaConf.get_type(node)
    if isinstance(node, DictConfig) and kind is not None and dataclasses.is_dataclass(kind):
        return sorted(f.name for f in dataclasses.fields(kind))
    return None


def _refuse(o: Any, parent: str, keys: list[str]) -> ConfigError:
    key, kind = o.key_or_group, o.type.name
    sign = {"ADD": "+", "FORCE_ADD": "++", "DEL": "~"}.get(kind, "")
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], keys, n=1)
    where = f"{parent}." if parent else ""
    group = parent or "the config"
    mean = f" Did you mean {where}{close[0]}?" if close else ""
    what = "no schema reads it" if sign in ("+", "++") else f"{group} has no such key"
    value = o.input_line.partition("=")[2] or "VALUE"
    fix = (
        f"Fix: {where}{close[0]}={value}."
        if close
        else "Fix: one of those keys (coreshell train --cfg job prints the whole config)."
    )
    return ConfigError(
        f"{sign}{key} is not a config key: {what}.{mean} The keys of {group}: "
        f"{', '.join(keys)}. {fix}"
    )


def check_overrides(argv: Sequence[str], base: DictConfig | None) -> None:
    """Refuses an override of a key that no schema has, and a ``+key`` that none reads.

    Example:
        >>> check_overrides(["optim.lrr=1"], base_config(["data=digits"]))
        Traceback (most recent call last):
        torchshell._errors.ConfigError: optim.lrr is not a config key: ...optim.lr? ...
    """
    if base is None:
        return
    groups = _groups()
    for o in _parse(argv):
        key = o.key_or_group
        if o.package is not None or key.startswith("hydra.") or key == "hydra":
            continue
        if key in groups and "." not in key:
            continue  # a group choice: Hydra names the options it has
        parts = key.split(".")
        node: Any = base
        for i, part in enumerate(parts):
            parent = ".".join(parts[:i])
            keys = _schema_keys(node)
            if not isinstance(node, DictConfig):
                break  # inside a plain value (a list, a string): Hydra checks it
            if part not in node:
                if keys is None and o.type.name in ("ADD", "FORCE_ADD"):
                    break  # `+data.foo=1`: handed to the class the node names
                raise _refuse(o, parent, keys if keys is not None else sorted(node))
            node = node[part] if OmegaConf.is_dict(node) else None
            if node is None:
                break


def model_name(cfg: Any) -> str:
    """The model's class name, as in ``digits-mlp``.

    Example:
        >>> from torchshell.app.config import compose_config, typed
        >>> model_name(typed(compose_config(["data=digits"])))
        'mlp'
    """
    model = cfg.model.lightning_module or cfg.model.torch or cfg.model.flax or {}
    return str(model.get("_target_", "model")).rsplit(".", 1)[-1].lower()


def run_name(cfg: Any, job: DictConfig, task: Sequence[str], base: DictConfig | None) -> str:
    """``RECIPE-MODEL`` and the overrides of ``task`` whose value in ``job`` (the composed
    config) differs from ``base``'s (the defaults of the same groups).

    Example:
        >>> from torchshell.app.config import compose_config, typed
        >>> task = ["data=digits", "mesh=fsdp", "optim.lr=0.01", "seed=0"]
        >>> job = compose_config(task)
        >>> run_name(typed(job), job, task, compose_config(["data=digits", "mesh=fsdp"]))
        'digits-mlp mesh=fsdp optim.lr=0.01'
    """
    recipe = cfg.model.recipe or cfg.data.get("recipe") or "custom"
    shown = []
    defaults = _default_choices()
    for o in _parse(task):
        key = o.key_or_group
        if key in _groups():  # a group other than the recipe's, when not its default
            default = str(defaults.get(key)).replace("${data}", str(recipe))
            named = key not in ("data", "model", "recipe", "tracking", "ckpt")
            if named and o.package is None and str(o.value()) != default:
                shown.append(f"{key}={o.value()}")
            continue
        if key.startswith(_NOT_NAMED) or key == "hydra":
            continue
        if base is not None and o.type.name == "CHANGE":
            before = OmegaConf.select(base, key, default=None, throw_on_resolution_failure=False)
            after = OmegaConf.select(job, key, default=None, throw_on_resolution_failure=False)
            if before == after:
                continue
        shown.append(o.input_line)
    return " ".join([f"{recipe}-{model_name(cfg)}", *shown])
