"""Trained JAX params -> the torch twin: safetensors, ``torch.save`` or ONNX, verified.

The library side of export: from a trained module or param tree to files. The
``coreshell export`` command (a run directory or an MLflow run in, a file out) is
:mod:`torchshell.app.export_cli`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import bridge
from torchshell._errors import CheckpointError, ConfigError

PyTree = Any

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


# ----------------------------------------------------------------------------- writers


def _example_args(twin: torch.nn.Module, batch: int, *more: int) -> tuple[torch.Tensor, ...]:
    make = getattr(twin, "example_input", None)
    if not callable(make):
        raise ConfigError(
            f"The twin {type(twin).__name__} has no example_input(batch) method, so ONNX has "
            "no sample input. Fix: add `def example_input(self, batch=2)` returning a sample "
            "tensor (or tuple) to the twin class."
        )
    sample = make(batch, *more)
    return tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)


def dynamic_shapes(module: torch.nn.Module, args: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """``torch.export`` dynamic shapes of ``module``'s inputs: its ``dynamic_axes``, else batch.

    A module declares ``dynamic_axes`` as one ``{axis: name}`` dict per input (inputs sharing
    a name share the dimension) and optionally ``dim_min = {name: smallest size}``; without
    them only axis 0 of every input is dynamic. Every axis is declared explicitly:
    ``Dim.AUTO`` is dropped when the example has size 1 there (FACTS.md).

    Example:
        >>> from torchshell.twins.spoken_digits import SpokenDigitsEncoder
        >>> twin = SpokenDigitsEncoder(width=16, depth=1, heads=2)
        >>> [sorted(d) for d in dynamic_shapes(twin, twin.example_input())]
        [[0, 1], [0, 1]]
    """
    axes = getattr(module, "dynamic_axes", None) or tuple({0: "batch"} for _ in args)
    if len(axes) != len(args):
        raise ConfigError(
            f"{type(module).__name__}.dynamic_axes names {len(axes)} inputs, its example has "
            f"{len(args)}. Fix: one {{axis: name}} dict per input of forward()."
        )
    lowest = {"batch": 1, **getattr(module, "dim_min", {})}
    dims: dict[str, Any] = {}
    for spec in axes:
        for name in spec.values():
            dims.setdefault(name, torch.export.Dim(name, min=lowest.get(name, 2)))
    return tuple({axis: dims[name] for axis, name in spec.items()} for spec in axes)


def export_program(module: torch.nn.Module, args: Sequence[torch.Tensor]) -> Any:
    """``torch.export.export`` of ``module`` on ``args`` with its :func:`dynamic_shapes`.

    Non-strict export; torch's own notes on the symbolic shapes it reasons about (log lines
    at WARNING, none of them the user's) are kept below ERROR for the call only.

    Returns:
        The ``torch.export.ExportedProgram``; ``.module()`` runs any batch size and length.

    Example:
        >>> from torchshell.twins.spoken_digits import SpokenDigitsEncoder
        >>> twin = SpokenDigitsEncoder(width=16, depth=1, heads=2).eval()
        >>> program = export_program(twin, twin.example_input())
        >>> program.module()(*twin.example_input(1, 30)).shape
        torch.Size([1, 10])
    """
    import logging

    shapes = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes.level
    shapes.setLevel(logging.ERROR)
    try:
        return torch.export.export(module, tuple(args), dynamic_shapes=dynamic_shapes(module, args))
    finally:
        shapes.setLevel(level)


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
    """``torch.onnx.export`` of the twin with its dynamic axes, then onnxruntime parity.

    The axes are the twin's ``dynamic_axes`` (batch and time for the speech twin; the batch
    alone by default, see :func:`dynamic_shapes`). The check runs batch sizes 1 and
    ``batch + 3`` and, for a twin with ``check_lengths``, each of those lengths.

    Returns:
        The max abs difference between onnxruntime and torch on those fresh samples, or None
        when onnxruntime is not installed.
    """
    args = _example_args(twin, batch)
    big = sum(p.numel() * p.element_size() for p in twin.state_dict().values()) > 1 << 30
    # torch.export first (non-strict): the exporter's own dynamo trace specializes batch 1
    # away and refuses a dynamic batch for the spoken-digits twin.
    program = export_program(twin, args)
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
    lengths = tuple(getattr(twin, "check_lengths", ()))  # a dynamic time axis: 3 lengths
    extra: list[tuple[int, ...]] = [(n,) for n in lengths] or [()]
    cases = [(rows, *more) for rows in (1, batch + 3) for more in extra]
    for rows, *more in cases:  # other batch sizes (the axis must be dynamic, 1 included)
        check = _example_args(twin, rows, *more)
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
