"""``coreshell export RUN_OR_CHECKPOINT --format safetensors|torch|onnx [--out PATH]``.

Reads a run or checkpoint directory (``config.yaml`` + ``export/model.safetensors``) or an
MLflow run with those artifacts, rebuilds the twin from ``model.twin`` and writes its weights
with the library's writers (:mod:`torchshell.export`).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

import bridge
from torchshell._errors import CheckpointError, ConfigError
from torchshell.export import write_onnx, write_torch

FORMATS = {"safetensors": ".safetensors", "torch": ".pt", "onnx": ".onnx"}


def _sqlite_file(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def resolve_source(source: str, tracking_uri: str, workdir: Path) -> tuple[Path, Path]:
    """``(config.yaml, model.safetensors)`` of a run/checkpoint directory or an MLflow run.

    Args:
        source: a directory holding ``config.yaml`` and ``export/model.safetensors``, or an
            MLflow run id whose artifacts are those two files.
        tracking_uri: the MLflow store to look the run id up in.
        workdir: where a run's artifacts are downloaded.

    Raises:
        ConfigError: the source is neither, or lacks one of the files.
    """
    path = Path(source)
    if path.is_dir():
        config, weights = path / "config.yaml", path / "export" / "model.safetensors"
        missing = [str(p) for p in (config, weights) if not p.is_file()]
        if missing:
            raise ConfigError(
                f"{path} is not a run or checkpoint directory: {missing} missing. Expected "
                "config.yaml and export/model.safetensors (what `coreshell train` writes into "
                "its output and checkpoint directories). Fix: pass such a directory."
            )
        return config, weights
    if path.exists():
        raise ConfigError(
            f"{path} is a file; expected a run/checkpoint directory or an MLflow run id. Fix: "
            "pass the directory that holds config.yaml and export/model.safetensors."
        )
    db = _sqlite_file(tracking_uri)
    if db is not None and not db.is_file():
        raise ConfigError(
            f"{source!r} is not a directory, and the tracking store {tracking_uri} does not "
            f"exist (no {db.resolve()}), so it cannot be a run id. Fix: pass a run directory, "
            "or --tracking-uri of the store that holds the run."
        )
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    try:
        client.get_run(source)
    except MlflowException as e:
        raise ConfigError(
            f"{source!r} is neither a directory nor a run in {tracking_uri} ({e.message}). Fix: "
            "pass a run directory, or a run id with the right --tracking-uri."
        ) from e
    try:
        config_file = client.download_artifacts(source, "config.yaml", str(workdir))
        weights_file = client.download_artifacts(source, "export/model.safetensors", str(workdir))
    except (MlflowException, OSError) as e:
        raise ConfigError(
            f"Run {source} in {tracking_uri} lacks config.yaml or export/model.safetensors "
            f"among its artifacts ({e}). Fix: export a run that finished `coreshell train`."
        ) from e
    return Path(config_file), Path(weights_file)


def load_twin(config: Path, weights: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Rebuilds the twin from ``model.twin`` of a saved config and loads the weights strictly.

    Returns:
        ``(twin in eval mode, safetensors metadata)``.
    """
    cfg = OmegaConf.load(config)
    if OmegaConf.select(cfg, "model.twin") is None:
        raise ConfigError(
            f"{config} has no model.twin entry; expected the resolved config of a coreshell "
            "run. Fix: pass the config.yaml a training run wrote."
        )
    twin = instantiate(cfg.model.twin, _convert_="all")
    state_dict, meta = bridge.load_safetensors(weights)
    try:
        twin.load_state_dict(state_dict, strict=True)
    except RuntimeError as e:
        raise CheckpointError(
            f"The weights in {weights} do not fit the twin {type(twin).__name__} built from "
            f"{config}: {e}. Fix: pass the config.yaml written by the same run."
        ) from e
    return twin.eval(), meta


def export(
    source: str,
    fmt: str,
    out: str | Path | None = None,
    *,
    tracking_uri: str = "sqlite:///mlflow.db",
    batch: int = 2,
) -> dict[str, Any]:
    """Writes the twin's weights of a run or checkpoint in ``fmt``; returns a summary.

    Args:
        source: a run/checkpoint directory or an MLflow run id (see :func:`resolve_source`).
        fmt: ``safetensors``, ``torch`` or ``onnx``.
        out: the file to write; default ``SOURCE/export/model.<ext>`` for a directory,
            ``./model.<ext>`` for a run id.
        tracking_uri: the MLflow store of a run id.
        batch: batch size of the ONNX sample input.

    Returns:
        ``{"format", "out", "tensors", "onnx_max_abs_diff"}``.

    Example:
        >>> export("outputs/2025-01-01/12-00-00", "onnx")  # doctest: +SKIP
    """
    if fmt not in FORMATS:
        raise ConfigError(f"Unknown format {fmt!r}; expected one of {list(FORMATS)}.")
    with tempfile.TemporaryDirectory() as work:
        config, weights = resolve_source(source, tracking_uri, Path(work))
        twin, meta = load_twin(config, weights)
    is_dir = Path(source).is_dir()
    default = (Path(source) / "export" if is_dir else Path.cwd()) / f"model{FORMATS[fmt]}"
    path = Path(out) if out is not None else default
    path.parent.mkdir(parents=True, exist_ok=True)
    state_dict = twin.state_dict()
    diff = None
    if fmt == "safetensors":
        sources = {k: v.get("source", []) for k, v in meta["tensors"].items()}
        bridge.save_safetensors(state_dict, path, sources=sources, metadata={"source": source})
    elif fmt == "torch":
        write_torch(state_dict, path)
    else:
        diff = write_onnx(twin, path, batch=batch)
    return {"format": fmt, "out": str(path), "tensors": len(state_dict), "onnx_max_abs_diff": diff}


def export_command(argv: list[str]) -> None:
    """``coreshell export RUN_OR_CHECKPOINT --format safetensors|torch|onnx [--out PATH]``."""
    parser = argparse.ArgumentParser(
        prog="coreshell export",
        description="Write the torch twin's weights of a run or checkpoint.",
    )
    parser.add_argument(
        "source",
        metavar="RUN_OR_CHECKPOINT",
        help="a run/checkpoint directory (config.yaml + export/model.safetensors) or an "
        "MLflow run id with those artifacts",
    )
    parser.add_argument("--format", required=True, choices=list(FORMATS))
    parser.add_argument(
        "--out", help="file to write (default: SOURCE/export/model.EXT, ./model.EXT for a run id)"
    )
    parser.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="MLflow store")
    parser.add_argument("--batch", type=int, default=2, help="ONNX sample batch size (>= 2)")
    args = parser.parse_args(argv)
    if args.batch < 2:
        parser.error(f"--batch must be >= 2 (a batch of 1 is specialised away), got {args.batch}")
    summary = export(
        args.source, args.format, args.out, tracking_uri=args.tracking_uri, batch=args.batch
    )
    print(f"wrote {summary['out']} ({summary['format']}, {summary['tensors']} tensors)")
    if summary["onnx_max_abs_diff"] is not None:
        print(f"  onnxruntime vs torch: max abs diff {summary['onnx_max_abs_diff']:.2e}")
