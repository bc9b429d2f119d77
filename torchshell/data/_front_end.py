"""Where the spoken-digits features are computed: in the DataLoader workers or in the step.

``data.front_end``:

* ``host``: the workers compute torchaudio log-mel, trim, crop, warp and mask
  (:class:`~torchshell.data.spoken_digits.SpokenDigitsDataset`); batches are
  ``{"features", "frame_mask", "y"}``.
* ``device``: the workers only decode, augment the waveform and pad it into a few sample
  buckets (:class:`WaveCollate`); batches are ``{"waveform", "lengths", "y"}`` and the
  model (:class:`jaxcore.models.spoken_digits_waveform.SpokenDigitsWaveformEncoder`)
  computes the same features inside the jitted step (:mod:`jaxcore.features`).
* ``auto``: ``device`` when JAX's default backend is an accelerator, else ``host``
  (:func:`resolve_front_end`).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from importlib.metadata import entry_points

import torch

from torchshell.data._spoken_digits_build import SpokenDigitsDataError

__all__ = ["FRONT_ENDS", "WaveCollate", "accelerator_backend", "resolve_front_end"]

FRONT_ENDS = ("host", "device", "auto")


def accelerator_backend() -> bool:
    """Whether JAX's default backend is (or will be) an accelerator, without starting JAX.

    A started JAX answers itself (``jax.default_backend()``). Before it starts (the config is
    resolved before ``jax.distributed.initialize`` and the CPU device split): the first
    platform of ``JAX_PLATFORMS`` when set, else whether an accelerator plugin is installed
    (a ``jax_plugins`` module or entry point, as JAX discovers CUDA/ROCm, or ``libtpu``).

    Example:
        >>> isinstance(accelerator_backend(), bool)
        True
    """
    try:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            import jax

            return jax.default_backend() != "cpu"
    except (ImportError, AttributeError):  # a JAX without that helper: judge as not started
        pass
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() != "cpu"
    if list(entry_points(group="jax_plugins")) or importlib.util.find_spec("libtpu"):
        return True
    return importlib.util.find_spec("jax_plugins") is not None


def resolve_front_end(front_end: str) -> str:
    """``host`` or ``device``: ``auto`` resolved by :func:`accelerator_backend`.

    Example:
        >>> resolve_front_end("host"), resolve_front_end("device")
        ('host', 'device')
    """
    if front_end not in FRONT_ENDS:
        raise SpokenDigitsDataError(
            f"data.front_end={front_end!r}: expected one of {list(FRONT_ENDS)}. Fix: set "
            "data.front_end=host (torchaudio in the workers), device (log-mel in the jitted "
            "step) or auto (device on an accelerator)."
        )
    if front_end == "auto":
        return "device" if accelerator_backend() else "host"
    return front_end


class WaveCollate:
    """Pads waveforms to the smallest sample bucket that holds the longest, with lengths.

    A few buckets mean a few compiled shapes. A clip longer than the largest bucket pads its
    batch to a multiple of it (one more shape): cropping the waveform would change the frames
    that silence trimming keeps.

    Example:
        >>> items = [{"waveform": torch.ones(n), "y": torch.tensor(1, dtype=torch.int32)}
        ...          for n in (900, 3000)]
        >>> batch = WaveCollate((1000, 2000))(items)
        >>> batch["waveform"].shape, batch["lengths"].tolist()
        (torch.Size([2, 4000]), [900, 3000])
    """

    def __init__(self, buckets: Sequence[int] = (16_000, 24_000, 32_000)) -> None:
        if not buckets or sorted(buckets) != list(buckets) or min(buckets) < 1:
            raise SpokenDigitsDataError(
                f"wave_buckets={list(buckets)}: expected increasing positive sample counts. "
                "Fix: set data.wave_buckets, e.g. [16000, 24000, 32000]."
            )
        self.buckets = tuple(int(b) for b in buckets)

    def __call__(self, items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(int(item["waveform"].shape[0]) for item in items)
        bucket = next((b for b in self.buckets if b >= longest), None)
        if bucket is None:
            top = self.buckets[-1]
            bucket = -(-longest // top) * top
        waveform = torch.zeros(len(items), bucket)
        for row, item in enumerate(items):
            waveform[row, : item["waveform"].shape[0]] = item["waveform"]
        return {
            "waveform": waveform,
            "lengths": torch.tensor(
                [item["waveform"].shape[0] for item in items], dtype=torch.int32
            ),
            "y": torch.stack([item["y"] for item in items]),
        }
