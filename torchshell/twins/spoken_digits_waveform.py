"""Torch twin of :class:`jaxcore.models.spoken_digits_waveform.SpokenDigitsWaveformEncoder`.

The spoken-digits twin with the same ``state_dict`` (the front end holds no weights), fed
``(waveform[B, N], lengths[B])`` as the device front end's model is: each clip's
``SpokenDigitsServing`` features (torchaudio log-mel of the clip alone, silence trimmed),
cropped to ``eval_frames`` as the JAX model crops in evaluation. Its :meth:`serving` module is
the one the host path serves (``SpokenDigitsServing`` over a plain twin): the request format
and the exported program do not depend on where training computed its features.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from torchshell.twins.spoken_digits import SpokenDigitsEncoder, SpokenDigitsServing


class SpokenDigitsWaveformEncoder(SpokenDigitsEncoder):
    """:class:`~torchshell.twins.spoken_digits.SpokenDigitsEncoder` over raw waveforms.

    Args:
        n_mels: mel bands.
        width: model width.
        depth: transformer blocks.
        heads: attention heads.
        mlp_ratio: MLP hidden width over ``width``.
        num_classes: output logits.
        dropout: residual dropout in training.
        eval_frames: each clip keeps at most this many trimmed frames.

    Example:
        >>> twin = SpokenDigitsWaveformEncoder(width=32, depth=1, heads=2).eval()
        >>> twin(*twin.example_input()).shape
        torch.Size([2, 10])
        >>> type(twin.serving()).__name__, twin.serving().input_names
        ('SpokenDigitsServing', ('waveform', 'lengths'))
    """

    input_names = ("waveform", "lengths")
    dynamic_axes = ({0: "batch", 1: "samples"}, {0: "batch"})
    dim_min: ClassVar[dict[str, int]] = {"samples": 401}

    def __init__(
        self,
        n_mels: int = 40,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        mlp_ratio: int = 4,
        num_classes: int = 10,
        dropout: float = 0.1,
        eval_frames: int = 160,
    ) -> None:
        super().__init__(n_mels, width, depth, heads, mlp_ratio, num_classes, dropout)
        self.options: dict[str, Any] = {
            "n_mels": n_mels,
            "width": width,
            "depth": depth,
            "heads": heads,
            "mlp_ratio": mlp_ratio,
            "num_classes": num_classes,
            "dropout": dropout,
        }
        self.eval_frames = eval_frames
        # in a tuple, not registered: the front end's window and filterbank stay out of the
        # state_dict, which equals the plain twin's
        self._front = (SpokenDigitsServing(SpokenDigitsEncoder(n_mels, 8, 0, 1, 1, 1)),)

    def features(
        self, waveform: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features[B, T, n_mels], frame_mask[B, T])``: the served front end's, cropped."""
        features, mask = self._front[0].features(waveform, lengths)
        return features[:, : self.eval_frames], mask[:, : self.eval_frames]

    def forward(self, waveform: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # waveform: float32 [B, N] zero-padded, lengths: int [B] samples -> logits [B, C]
        return super().forward(*self.features(waveform, lengths))

    def plain(self) -> SpokenDigitsEncoder:
        """This twin's weights in the host path's twin (log-mel features in)."""
        twin = SpokenDigitsEncoder(**self.options)
        twin.load_state_dict(self.state_dict(), strict=True)
        return twin.train(self.training)

    def serving(self) -> SpokenDigitsServing:
        """The deployable module, the host path's: raw waveform in, digit logits out."""
        return SpokenDigitsServing(self.plain()).eval()

    def example_input(  # type: ignore[override]
        self, batch: int = 2, frames: int = 64
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sample ``(waveform[B, N], lengths[B])`` of ``frames`` frames, the rest shorter."""
        n = (frames - 1) * 160
        waveform = 0.1 * torch.randn(batch, n, generator=torch.Generator().manual_seed(0))
        lengths = torch.full((batch,), n, dtype=torch.int32)  # as WaveCollate gives them
        lengths[1:] = n // 2
        waveform[1:, n // 2 :] = 0.0
        return waveform, lengths
