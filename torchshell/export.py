"""Trained JAX params -> the torch twin: safetensors, ``torch.save`` or ONNX, verified.

``coreshell export RUN_OR_CHECKPOINT --format safetensors|torch|onnx [--out PATH]`` reads a
run or checkpoint directory (``config.yaml`` + ``export/model.safetensors``) or an MLflow run
with those artifacts, rebuilds the twin from ``model.twin`` and writes its weights.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

import bridge
from torchshell._errors import CheckpointError, ConfigError, ShellError

PyTree = Any

FORMATS = {"safetensors": ".safetensors", "torch": ".pt", "onnx": ".onnx"}
ONNX_ATOL = 1e-4  # onnxruntime fuses and reorders fp32 ops; differences stay far below this


def export_twin(
    params: PyTree,
    twin: torch.nn.Module,
    path: str | Path,
    *,
    rules: Sequence[tuple[str, str, Any]] | None = None,
    stacked: Sequence[str] = (),
) -> Path:
    """Writes ``params`` as the twin's ``state_dict`` to a safetensors file and loads it.

    The conversion is strict (every twin key filled once, shapes and dtypes equal) and the
    twin ends up holding the trained weights, in eval mode. The file's metadata records the
    Flax path and dtype of every tensor and the coreshell version.

    Args:
        params: the trained Flax params, or the variables dict with ``batch_stats``.
        twin: the torch twin module.
        path: the ``.safetensors`` file to write.
        rules: extra ``(regex, rename, transform)`` rules (see ``bridge.export_state_dict``).
        stacked: path prefixes of scanned layers.

    Returns:
        The written path.

    Example:
        >>> import jax, jax.numpy as jnp, tempfile, os
        >>> from jaxcore.models.digits import MLP
        >>> from torchshell.twins.digits import MLP as Twin
        >>> p = MLP(features=(8,)).init(jax.random.key(0), jnp.ones((1, 64)))["params"]
        >>> out = export_twin(p, Twin(features=(8,)), os.path.join(tempfile.mkdtemp(), "m.st"))
        >>> out.exists()
        True
    """
    state_dict = bridge.export_state_dict(params, twin, rules, stacked=stacked)
    twin.load_state_dict(state_dict, strict=True)
    twin.eval()
    sources = bridge.state_dict_sources(params, rules, stacked=stacked, torch_module=twin)
    return bridge.save_safetensors(state_dict, path, sources=sources)


def export_module(module: Any, twin: torch.nn.Module, path: str | Path) -> Path:
    """Writes a trained :class:`~torchshell.JaxModule`'s weights as ``twin``'s safetensors.

    A Flax model goes through :func:`export_twin` with its whole variables dict (so
    ``batch_stats`` become running statistics); a torch module trained through torchax
    (:meth:`JaxModule.from_torch`) already holds ``state_dict`` names: export is the identity.
    Either way ``twin`` ends up holding the trained weights, in eval mode.
    """
    if module.state is None:
        raise ConfigError(
            "Nothing to export: the module has no trained state. Fix: train "
            "(trainer.fit) first, and check the data set is not empty."
        )
    if module.torch_module is None:
        variables = {"params": module.state.params, **module.state.model_state}
        return export_twin(variables, twin, path)
    state_dict = module.torch_state_dict()
    twin.load_state_dict(state_dict, strict=True)
    twin.eval()
    return bridge.save_safetensors(state_dict, path)


def max_abs_diff(jax_outputs: Any, torch_outputs: torch.Tensor) -> float:
    """Largest absolute difference between JAX and torch outputs of the same inputs."""
    return float(np.max(np.abs(np.asarray(jax_outputs) - torch_outputs.detach().numpy())))


# ----------------------------------------------------------------------------- sources


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


# ----------------------------------------------------------------------------- writers


def _example_args(twin: torch.nn.Module, batch: int) -> tuple[torch.Tensor, ...]:
    make = getattr(twin, "example_input", None)
    if not callable(make):
        raise ConfigError(
            f"The twin {type(twin).__name__} has no example_input(batch) method, so ONNX has "
            "no sample input. Fix: add `def example_input(self, batch=2)` returning a sample "
            "tensor (or tuple) to the twin class."
        )
    sample = make(batch)
    return tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)


def _flat_outputs(out: Any) -> list[np.ndarray]:
    if isinstance(out, torch.Tensor):
        return [out.detach().numpy()]
    if isinstance(out, Mapping):
        return [x for v in out.values() for x in _flat_outputs(v)]
    return [x for v in out for x in _flat_outputs(v)]


def write_torch(state_dict: Mapping[str, torch.Tensor], out: Path) -> Path:
    """``torch.save`` of a tensors-only state_dict, verified with ``weights_only=True``."""
    tmp = out.with_name(out.name + ".tmp")
    torch.save({k: v.detach().cpu().contiguous() for k, v in state_dict.items()}, tmp)
    back = torch.load(tmp, weights_only=True)
    if sorted(back) != sorted(state_dict) or not all(
        torch.equal(back[k], v.cpu()) for k, v in state_dict.items()
    ):
        raise CheckpointError(f"{tmp} does not read back equal; disk full? Fix: retry.")
    tmp.replace(out)
    return out


def write_onnx(twin: torch.nn.Module, out: Path, *, batch: int = 2) -> float | None:
    """``torch.onnx.export`` of the twin with a dynamic batch axis, then onnxruntime parity.

    Returns:
        The max abs difference between onnxruntime and torch on a fresh sample of another
        batch size, or None when onnxruntime is not installed.
    """
    args = _example_args(twin, batch)
    big = sum(p.numel() * p.element_size() for p in twin.state_dict().values()) > 1 << 30
    # torch.export first (non-strict): the exporter's own dynamo trace specializes batch 1
    # away and refuses a dynamic batch for the spoken-digits twin.
    program = torch.export.export(
        twin, args, dynamic_shapes=tuple({0: torch.export.Dim("batch")} for _ in args)
    )
    try:
        torch.onnx.export(
            program,
            args,
            str(out),
            dynamo=True,
            external_data=big,  # weights beside the graph only past 1 GiB
            verbose=False,
        )
    except ImportError as e:  # onnx / onnxscript are the optional `onnx` extra
        raise ConfigError(
            f"ONNX export needs onnx and onnxscript ({e}). Fix: pip install 'coreshell[onnx]'."
        ) from e
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    diff = 0.0
    for rows in (1, batch + 3):  # other batch sizes: the axis must be dynamic, 1 included
        check = _example_args(twin, rows)
        feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), check, strict=True)}
        got = session.run(None, feeds)
        with torch.no_grad():
            want = _flat_outputs(twin(*check))
        if len(got) != len(want) or any(
            g.shape != w.shape for g, w in zip(got, want, strict=False)
        ):
            raise bridge.ParityError(
                f"onnxruntime returned shapes {[g.shape for g in got]}, torch "
                f"{[w.shape for w in want]}. Fix: check the twin's forward for "
                "batch-size-dependent code."
            )
        pairs = zip(got, want, strict=True)
        diff = max(diff, *(float(np.max(np.abs(g - w), initial=0.0)) for g, w in pairs))
    if not diff <= ONNX_ATOL:
        raise bridge.ParityError(
            f"onnxruntime and torch differ by {diff:.3e} (> {ONNX_ATOL:g}) on {out}. Fix: look "
            "for ops the ONNX exporter translates approximately in the twin's forward."
        )
    return diff


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
    try:
        summary = export(
            args.source, args.format, args.out, tracking_uri=args.tracking_uri, batch=args.batch
        )
    except (ShellError, bridge.BridgeError) as e:
        print(f"coreshell export: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"wrote {summary['out']} ({summary['format']}, {summary['tensors']} tensors)")
    if summary["onnx_max_abs_diff"] is not None:
        print(f"  onnxruntime vs torch: max abs diff {summary['onnx_max_abs_diff']:.2e}")
