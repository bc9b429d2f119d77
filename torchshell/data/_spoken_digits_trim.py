"""Silence trimming of the spoken-digits front end: the voiced span moved to frame 0.

One function, used by the data set on every item (training after the waveform
augmentation, validation, test) and by the serving module after its features, so the JAX
model (fed by the workers) and the served torch model see the same frames. It works on
padded, normalised log-mel features and their frame mask with static shapes: the voiced span
is found with reductions and moved with a gather (data-dependent index values, never a
data-dependent slice), so it exports with dynamic batch and time axes (``torch.export``,
ONNX).

A frame is voiced when its energy (its mean log mel power, in dB) is above a
threshold set per clip between its quietest frame (the noise floor) and its loudest:
``max(peak - margin_db, floor + floor_ratio * (peak - floor))``. Clean clips (a digital
silence floor) keep everything within ``margin_db`` of the peak; under noise the threshold
rises with the floor. ``pad`` frames are kept on each side of the span (weak onsets and
fricatives), and at least ``min_frames`` (or the whole clip when shorter): a clip of noise
alone keeps its loudest frames.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["trim_clips", "trim_silence"]

_FAR = 1 << 30  # pushes unvoiced frames out of the first/last reductions


def trim_silence(
    features: torch.Tensor,
    frame_mask: torch.Tensor,
    *,
    margin_db: float = 40.0,
    floor_ratio: float = 0.3,
    pad: int = 8,
    min_frames: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Moves each clip's voiced span to frame 0 and shortens its mask; shapes unchanged.

    Args:
        features: ``float[B, T, n_mels]`` normalised log-mel frames
            (:class:`~torchshell.data.spoken_digits.LogMel`: ``(log10(power) + 4) / 4``).
        frame_mask: ``bool[B, T]``, each clip's valid frames first.
        margin_db: frames this far below the clip's loudest are silence on a clean clip.
        floor_ratio: the threshold's share of the way from the quietest frame to the
            loudest (in dB), which matters under noise.
        pad: frames kept before and after the voiced span.
        min_frames: the fewest frames kept (a clip's own length when it is shorter).

    Returns:
        ``(features, frame_mask)``: the kept frames first, zeros after them.

    Example:
        >>> x = torch.zeros(1, 100, 40)
        >>> x[0, 60:80] = 1.0  # a loud word after 0.6 s of near-silence
        >>> feats, mask = trim_silence(x, torch.ones(1, 100, dtype=torch.bool))
        >>> int(mask.sum()), feats[0, :8, 0].sum().item(), feats[0, 8:28].min().item()
        (36, 0.0, 1.0)
    """
    mask = frame_mask.to(torch.bool)
    t = torch.arange(features.shape[1], device=features.device)
    # each frame's mean log mel power in dB (10 log10(power) = 40 * feature - 40): a mean of
    # logs, so one loud band (brown noise's drift in the lowest) cannot make a frame voiced
    energy = features.mean(dim=-1) * 40.0
    peak = energy.masked_fill(~mask, -math.inf).amax(dim=1, keepdim=True)
    floor = energy.masked_fill(~mask, math.inf).amin(dim=1, keepdim=True)
    threshold = torch.maximum(peak - margin_db, floor + floor_ratio * (peak - floor))
    off = (~((energy >= threshold) & mask)).to(torch.int64) * _FAR
    first = (t[None] + off).amin(dim=1)
    last = (t[None] - off).amax(dim=1)
    n = mask.to(torch.int64).sum(dim=1)
    start = (first - pad).clamp(min=0)
    end = torch.minimum(last + pad + 1, n)
    end = torch.maximum(end, torch.minimum(start + min_frames, n))
    start = torch.minimum(start, (end - min_frames).clamp(min=0))
    idx = torch.minimum(t[None] + start[:, None], (n - 1).clamp(min=0)[:, None])  # [B, T]
    kept = features.gather(1, idx[..., None].expand(features.shape))
    new_mask = t[None] < (end - start)[:, None]
    return kept * new_mask[..., None].to(kept.dtype), new_mask


def trim_clips(features: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`trim_silence` of unpadded clips ``[T_i, n_mels]``: each clip's kept frames.

    Row by row the same as :func:`trim_silence` on a padded batch (what the served model
    runs), so the data set's items are the served model's frames.

    Example:
        >>> x = torch.zeros(100, 40)
        >>> x[60:80] = 1.0
        >>> [f.shape[0] for f in trim_clips([x, torch.ones(5, 40)])]
        [36, 5]
    """
    lengths = [int(f.shape[0]) for f in features]
    padded = features[0].new_zeros(len(features), max(lengths), features[0].shape[1])
    for row, f in enumerate(features):
        padded[row, : f.shape[0]] = f
    mask = torch.arange(padded.shape[1])[None] < torch.tensor(lengths)[:, None]
    kept, new_mask = trim_silence(padded, mask)
    return [kept[row, : int(n)] for row, n in enumerate(new_mask.sum(dim=1))]
