"""Where a run's checkpoints go, and which one ``resume`` takes.

Each run owns its checkpoints: ``ckpt.root/RECIPE-MODEL/RUN/`` (``RUN`` from the run's
output folder), so ``ckpt.keep`` holds per run and runs of other recipes never mix.
``resume=last`` takes the newest intact checkpoint of the same recipe and model, and the
resumed run goes on writing into that run's folder. A checkpoint of another model is
refused before anything loads (its ``config.yaml`` names the model it holds). An explicit
``ckpt.dir`` is used as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchshell._errors import CheckpointError, ConfigError
from torchshell.checkpoint import latest_checkpoint, verify

#: The model keys that decide the params a checkpoint holds.
_SHAPES = ("flax", "torch", "lightning")


def recipe_key(cfg: Any) -> str:
    """``RECIPE-MODEL``: the folder of every run of one recipe and model.

    Example:
        >>> from torchshell.app.config import compose_config, typed
        >>> recipe_key(typed(compose_config(["data=digits"])))
        'digits-mlp'
    """
    from torchshell.app.overrides import model_name

    recipe = cfg.model.recipe or cfg.data.get("recipe") or "custom"
    return f"{recipe}-{model_name(cfg)}"


def run_folder(out_dir: Path) -> str:
    """The run's name from its output folder: ``outputs/2026-12-07/14-32-50`` ->
    ``2026-12-07_14-32-50``, a sweep's ``multirun/DAY/TIME/3`` -> ``DAY_TIME_3``.

    Example:
        >>> run_folder(Path("multirun/2026-12-07/14-32-50/3"))
        '2026-12-07_14-32-50_3'
    """
    parts = Path(out_dir).absolute().parts
    n = 3 if parts[-1].isdigit() else 2
    return "_".join(p for p in parts[-n:] if p not in ("/", ""))


def _model(resolved: dict[str, Any]) -> dict[str, Any]:
    model = resolved.get("model") or {}
    shapes = {k: model.get(k) for k in _SHAPES if model.get(k) not in (None, {"_target_": None})}
    return {"recipe": model.get("recipe") or (resolved.get("data") or {}).get("recipe"), **shapes}


def _describe(model: dict[str, Any], other: dict[str, Any]) -> str:
    """``digits MLP (features=[64])``: the recipe, the class and the arguments that differ."""
    parts = []
    for key in _SHAPES:
        node = model.get(key)
        if not isinstance(node, dict):
            continue
        target = str(node.get("_target_", "?")).rsplit(".", 1)[-1]
        found = other.get(key)
        theirs: dict[str, Any] = found if isinstance(found, dict) else {}
        args = [f"{k}={v}" for k, v in node.items() if k != "_target_" and theirs.get(k) != v]
        same = theirs.get("_target_") == node.get("_target_")  # else the class says it all
        parts.append(target + (f" ({', '.join(args)})" if args and same else ""))
    return f"{model.get('recipe') or 'custom'} {' '.join(parts) or 'model'}"


def _saved_config(checkpoint: Path) -> dict[str, Any] | None:
    path = Path(checkpoint) / "config.yaml"
    if not path.is_file():
        return None
    import yaml

    loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    return loaded if isinstance(loaded, dict) else None


def same_model(checkpoint: Path, resolved: dict[str, Any]) -> str | None:
    """``None`` when ``checkpoint`` holds this run's model (or says nothing), else the two
    models described (``"spoken_digits Encoder"``, ``"digits MLP"``) as one phrase."""
    saved = _saved_config(checkpoint)
    if saved is None:
        return None
    theirs, ours = _model(saved), _model(resolved)
    if theirs == ours:
        return None
    return f"holds {_describe(theirs, ours)}; this run trains {_describe(ours, theirs)}"


def _newest_of_model(folder: Path, resolved: dict[str, Any]) -> Path | None:
    """The newest intact checkpoint of this model among the runs under ``folder``."""
    if not folder.is_dir():
        return None
    found = []
    for run in folder.iterdir():
        if run.is_dir() and not run.name.startswith("."):
            path = latest_checkpoint(run)
            if path is not None and same_model(path, resolved) is None:
                found.append(path)
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def resume_path(resume: str | None, ckpt_dir: str) -> str | None:
    """The checkpoint to resume from: None (a new run), the newest intact one, or a path.

    Example:
        >>> resume_path(None, "checkpoints") is None
        True
    """
    if resume in (None, "", "null"):
        return None
    if resume == "last":
        found = latest_checkpoint(ckpt_dir)
        if found is None:
            print(
                f"coreshell: resume=last but no intact checkpoint in {ckpt_dir}: "
                "starting a new run."
            )
        return None if found is None else str(found)
    problem = verify(Path(resume))
    if problem is not None:
        raise CheckpointError(
            f"resume={resume} is not an intact checkpoint: {problem}. Fix: pass a "
            f"checkpoint directory, or resume=last to take the newest intact one in "
            f"ckpt.dir ({ckpt_dir})."
        )
    return str(resume)


def choose(
    cfg: Any, resolved: dict[str, Any], out_dir: Path, resume: str | None
) -> tuple[str, str | None]:
    """The run's checkpoint folder and the checkpoint to resume from (or ``None``).

    Raises:
        ConfigError: the checkpoint to resume holds another model (nothing was loaded).
    """
    explicit = cfg.ckpt.dir not in (None, "", "null")
    key = Path(cfg.ckpt.root) / recipe_key(cfg)
    own = str(cfg.ckpt.dir) if explicit else str(key / run_folder(out_dir))
    if resume == "last" and not explicit:
        found = _newest_of_model(key, resolved)
        if found is None:
            print(
                f"coreshell: resume=last but no intact checkpoint of this model in {key}: "
                "starting a new run."
            )
            return own, None
        return str(found.parent), str(found)
    path = resume_path(resume, own)
    if path is not None:
        other = same_model(Path(path), resolved)
        if other is not None:
            raise ConfigError(
                f"resume={resume}: the checkpoint {path} {other}. Nothing was loaded. Fix: "
                f"resume a checkpoint of this model (resume=last takes the newest in {key}), "
                "start a new run (drop resume), or resume it with the model it holds (its "
                f"settings are in {Path(path) / 'config.yaml'}; quote the path: resume='PATH')."
            )
    return own, path


def already_done(path: str | None, max_steps: int, max_epochs: int | None) -> int | None:
    """The checkpoint's step when it has reached ``max_steps`` already (nothing to train).

    Example:
        >>> already_done("ck/epoch=9-step=600.ckpt", 600, None), already_done(None, 600, None)
        (600, None)
    """
    import re

    if path is None or max_steps <= 0 or max_epochs not in (None, -1):
        return None
    match = re.search(r"step=(\d+)", Path(path).name)
    step = int(match.group(1)) if match else -1
    return step if step >= max_steps else None
