"""The served model's fast core: the JAX front end and encoder as ``jax.export`` programs, and
the encoder in ONNX Runtime for small batches (issue #54: ``mlflow models serve`` ran the
``torch.export`` program, 1.8x slower than the JAX core at batch 64 and 3x ONNX Runtime at 1).

What is written here is read by :class:`torchshell.app.waveform_model.JaxCore` inside the
logged model, which needs jax, jaxlib, numpy and mlflow (and onnxruntime) to serve, not torch,
flax or coreshell. The weights are the torch serving module's, imported into the Flax encoder
(:mod:`jaxcore.models.spoken_digits`) with ``bridge.import_state_dict``; its front end is
:mod:`jaxcore.features` (the same log-mel and silence trimming as the torchaudio one). Both
are checked against the torch serving module when written.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

import bridge
from torchshell._errors import ConfigError

#: Batches of up to this many clips run the encoder in ONNX Runtime; larger ones the JAX
#: program. Measured per request (front end included, 0.64 s and 1 s clips, 2-core x86 CPU at
#: load 8-9, docs/serving.md): ONNX Runtime on one thread 0.94-0.95 ms against JAX 0.97-2.7
#: at batch 1, 1.3-3.4 against 1.9-7.4 at 2-4; mixed at 8-16; JAX 1.8x ahead at 64.
ONNX_MAX_BATCH = 4
#: Largest difference to the torch serving module accepted when the core is written.
ATOL = 1e-4


def _pins(*names: str) -> list[str]:
    return [f"{p}=={metadata.version(p).split('+')[0]}" for p in names]


def flax_encoder(twin: torch.nn.Module) -> tuple[Any, Any]:
    """The Flax encoder of a spoken-digits torch twin and its weights as Flax variables.

    Example:
        >>> from torchshell.twins.spoken_digits import SpokenDigitsEncoder
        >>> model, variables = flax_encoder(SpokenDigitsEncoder(width=16, depth=1, heads=2))
        >>> model.width, model.depth, model.heads, sorted(variables)
        (16, 1, 2, ['params'])
    """
    import jax

    from jaxcore.models.spoken_digits import SpokenDigitsEncoder

    blocks: Any = twin.blocks
    first = blocks[0] if len(blocks) else None
    width = int(twin.width)  # type: ignore[arg-type]
    model = SpokenDigitsEncoder(
        width=width,
        depth=len(blocks),
        heads=int(first.attn.heads) if first is not None else 1,
        mlp_ratio=int(first.fc1.out_features) // width if first is not None else 4,
        num_classes=int(twin.head.out_features),  # type: ignore[union-attr,arg-type]
        dropout=0.0,
    )
    make: Any = twin.example_input
    features, mask = (t.numpy() for t in make(2))
    template = jax.eval_shape(model.init, jax.random.key(0), features, mask)  # shapes only
    return model, bridge.import_state_dict(twin.state_dict(), template)


def _export(fn: Any, path: Path, max_samples: int) -> None:
    """``jax.export`` of ``fn(waveform[b, 320 k], lengths[b])`` for the CPU, written to path.

    ``k`` is bounded by the longest padded request (the model refuses longer clips): so the
    frame count is known to be short, and attention takes XLA on any backend (on a TPU its
    choice of the Pallas kernel from 640 frames would be undecidable for a free ``k``).
    """
    import jax
    import jax.numpy as jnp
    from jax import export

    from torchshell.app.waveform_model import SAMPLE_STEP, bucket

    most = bucket(-(-max_samples // SAMPLE_STEP))
    b, k = export.symbolic_shape("b, k", constraints=(f"k <= {most}",))
    args = (
        jax.ShapeDtypeStruct((b, SAMPLE_STEP * k), jnp.float32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
    )
    path.write_bytes(export.export(jax.jit(fn), platforms=("cpu",))(*args).serialize())


def write_jax_core(
    serving: torch.nn.Module, work: Path, max_samples: int
) -> tuple[dict[str, str], dict[str, Any]]:
    """Writes the ``"jax"`` core of a ``SpokenDigitsServing`` module into ``work``, checked.

    ``max_samples``: the longest clip the model takes (``serving.json``), which bounds the
    exported programs' sample axis.

    Returns:
        ``(artifacts, spec)``: the pyfunc's artifact paths (``core``, ``front``, ``encoder``
        when ONNX export is installed) and the ``serving.json`` entries of the core, with
        ``requirements``: the pinned packages the model needs to serve.

    Raises:
        ConfigError: a module this core cannot serve (not 16 kHz, not the recipe's encoder).
        bridge.ParityError: the core differs from the torch serving module on the example.
    """
    from jaxcore import features as fe
    from torchshell.data.spoken_digits import SAMPLE_RATE

    encoder: Any = getattr(serving, "encoder", None)
    rate = int(getattr(serving, "sample_rate", SAMPLE_RATE))
    if encoder is None or rate != SAMPLE_RATE or not hasattr(serving, "front_end"):
        raise ConfigError(
            f"The JAX serving core takes a SpokenDigitsServing module at {SAMPLE_RATE} Hz; got "
            f"{type(serving).__name__} at {rate} Hz. Fix: log it with core='pt2'."
        )
    front_end: Any = serving.front_end
    spectrogram = front_end.mel.spectrogram
    options = {
        "n_mels": int(encoder.n_mels),
        "n_fft": int(spectrogram.n_fft),
        "hop_length": int(spectrogram.hop_length),
    }
    model, variables = flax_encoder(encoder)

    def front(waveform: Any, lengths: Any) -> Any:
        return fe.trim_silence(*fe.log_mel(waveform, lengths, reflect="clip", **options))

    def core(waveform: Any, lengths: Any) -> Any:
        return model.apply(variables, *front(waveform, lengths))

    work.mkdir(parents=True, exist_ok=True)
    artifacts = {"core": str(work / "core.jax"), "front": str(work / "front.jax")}
    _export(core, work / "core.jax", max_samples)
    _export(front, work / "front.jax", max_samples)
    spec: dict[str, Any] = {"core": "jax", "onnx_max_batch": 0}
    requirements = ["jax", "jaxlib", "numpy", "mlflow"]
    if write_encoder_onnx(encoder, work / "encoder.onnx"):
        artifacts["encoder"] = str(work / "encoder.onnx")
        spec["onnx_max_batch"] = ONNX_MAX_BATCH
        requirements.append("onnxruntime")
    spec["requirements"] = _pins(*requirements)
    _check(serving, artifacts, spec)
    return artifacts, spec


def write_encoder_onnx(encoder: torch.nn.Module, path: Path) -> bool:
    """The encoder (``features[B, T, n_mels]``, ``frame_mask[B, T]`` -> logits) as ONNX with
    symbolic batch and frames, checked in ONNX Runtime against torch; False (nothing written)
    where onnx or onnxruntime is not installed (the ``onnx`` extra): the JAX core serves alone.

    Written by torch's TorchScript exporter: 3 s where the ``torch.export`` one
    (:func:`torchshell.export.write_onnx`, ``coreshell export --format onnx``) takes 15-45 s
    on a 2-core machine, at every training run's end. Its notes (the exporter's deprecation,
    the constant mask-picking kernel traced as a constant) are silenced for the call only.

    Raises:
        bridge.ParityError: ONNX Runtime differs from torch by more than :data:`ATOL`.
    """
    import importlib.util
    import warnings

    if not all(importlib.util.find_spec(m) for m in ("onnx", "onnxruntime")):
        return False
    import onnxruntime as ort

    make: Any = encoder.example_input
    names = ["features", "frame_mask"]
    axes = {name: {0: "batch", 1: "frames"} for name in names}
    with warnings.catch_warnings():
        for note in (
            r"You are using the legacy TorchScript-based ONNX export",
            r"The feature "
            r"will be removed",
            r"torch\.tensor results are registered as constants",
        ):
            warnings.filterwarnings("ignore", message=note)
        torch.onnx.export(
            encoder, make(2), str(path), dynamo=False, input_names=names,
            output_names=["logits"], dynamic_axes=axes, opset_version=17,
        )  # fmt: skip
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for rows, frames in [(1, 21), (5, 64), (2, 501)]:  # 0.2 s, 0.64 s, 5 s
        features, mask = make(rows, frames)
        with torch.no_grad():
            want = encoder(features, mask).numpy()
        got = session.run(None, {"features": features.numpy(), "frame_mask": mask.numpy()})[0]
        diff = float(np.max(np.abs(got - want)))
        if not diff <= ATOL:
            raise bridge.ParityError(
                f"ONNX Runtime differs from torch by {diff:.2e} (> {ATOL:g}) on the encoder at "
                f"batch {rows}, {frames} frames. Fix: look for ops the TorchScript exporter "
                "translates approximately in the twin's forward."
            )
    return True


def _check(serving: torch.nn.Module, artifacts: dict[str, str], spec: dict[str, Any]) -> None:
    """Both paths of the written core against the torch serving module on its example."""
    from torchshell.app.waveform_model import JaxCore

    core = JaxCore(artifacts, spec)
    make: Any = serving.example_input
    waveform, lengths = make()
    rows = spec["onnx_max_batch"] + 1  # the smallest batch the JAX program runs
    big = (waveform.repeat(-(-rows // len(waveform)), 1)[:rows], lengths.repeat(rows)[:rows])
    for w, n in [(waveform, lengths), big]:
        with torch.no_grad():
            want = serving(w, n).numpy()
        got = core.logits(w.numpy(), n.numpy())
        diff = float(np.max(np.abs(got - want)))
        if not diff <= ATOL:
            raise bridge.ParityError(
                f"The JAX serving core differs from the torch serving module by {diff:.2e} "
                f"(> {ATOL:g}) on a batch of {len(w)}. Fix: check jaxcore.features against "
                "the twin's front end (n_fft, hop, mel bands), or log the model with "
                "core='pt2'."
            )
