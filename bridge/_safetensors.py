"""``state_dict`` <-> safetensors files with coreshell metadata; loading never unpickles."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from importlib import metadata as _pkg
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from bridge._errors import SafetensorsError

_TENSORS_KEY = "coreshell.tensors"


def _version() -> str:
    try:
        return _pkg.version("coreshell")
    except _pkg.PackageNotFoundError:
        return "unknown"


def _for_saving(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host, contiguous, one buffer per tensor: copies only what safetensors cannot take."""
    out, storages = {}, set()
    for key, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise SafetensorsError(
                f"state_dict[{key!r}] is a {type(t).__name__}, expected a torch.Tensor. Fix: "
                "save only tensors (e.g. the output of bridge.export_state_dict)."
            )
        t = t.detach().cpu()
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr in storages or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)  # views of one stacked buffer
        elif ptr is not None:
            storages.add(ptr)
        out[key] = t
    return out


def save_safetensors(
    state_dict: Mapping[str, torch.Tensor],
    path: str | Path,
    *,
    sources: Mapping[str, Sequence[str]] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Writes a ``state_dict`` to a safetensors file, atomically, with metadata.

    The header records the coreshell version and, per tensor, its dtype and the Flax param
    path(s) it came from (``sources``, e.g. from :func:`bridge.state_dict_sources`).

    Args:
        state_dict: ``{key: tensor}``; views and device tensors are fine.
        path: the file to write (parents are created).
        sources: ``{key: [flax path, ...]}`` to record.
        metadata: extra ``{str: str}`` entries for the header.

    Returns:
        The written path.

    Example:
        >>> import torch, tempfile, os
        >>> p = save_safetensors({"w": torch.ones(2)}, os.path.join(tempfile.mkdtemp(), "m.st"))
        >>> load_safetensors(p)[1]["tensors"]["w"]["dtype"]
        'torch.float32'
    """
    tensors = _for_saving(state_dict)
    per_tensor = {
        k: {"dtype": str(t.dtype), "source": list((sources or {}).get(k, []))}
        for k, t in tensors.items()
    }
    header = {
        **{str(k): str(v) for k, v in (metadata or {}).items()},
        "format": "pt",
        "producer": "coreshell",
        "coreshell_version": _version(),
        _TENSORS_KEY: json.dumps(per_tensor, sort_keys=True),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=header)
    tmp.replace(path)  # never a half-written file under the final name
    return path


def load_safetensors(
    path: str | Path, *, device: str = "cpu"
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Reads a safetensors file: ``(state_dict, metadata)``; never unpickles.

    ``metadata["tensors"]`` holds the per-tensor records written by :func:`save_safetensors`
    (empty for files written by other tools); the other entries are the header's strings.

    Args:
        path: the ``.safetensors`` file.
        device: where the tensors go.

    Raises:
        SafetensorsError: the file is missing or not a safetensors file.

    Example:
        >>> import torch, tempfile, os
        >>> p = save_safetensors({"w": torch.ones(2)}, os.path.join(tempfile.mkdtemp(), "m.st"))
        >>> sd, meta = load_safetensors(p)
        >>> sd["w"].tolist(), meta["producer"]
        ([1.0, 1.0], 'coreshell')
    """
    path = Path(path)
    if not path.is_file():
        raise SafetensorsError(
            f"No safetensors file at {path}. Fix: pass the path of a file written by "
            "bridge.save_safetensors (e.g. <run dir>/export/model.safetensors)."
        )
    try:
        with safe_open(str(path), framework="pt", device=device) as f:
            header = dict(f.metadata() or {})
            state_dict = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, ValueError) as e:
        raise SafetensorsError(
            f"{path} is not a readable safetensors file ({e}). Fix: re-export it; pickled "
            "checkpoints (.pt/.bin) are not loaded here on purpose."
        ) from e
    meta: dict[str, Any] = {k: v for k, v in header.items() if k != _TENSORS_KEY}
    meta["tensors"] = json.loads(header[_TENSORS_KEY]) if _TENSORS_KEY in header else {}
    return state_dict, meta
