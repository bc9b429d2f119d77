"""A held-out set of spoken digits made apart from the default set: a robustness check.

Voices in no split of the default set (:data:`HELD_OUT_VARIANTS`), each saying every digit
under each of :data:`CONDITIONS`: prosody past the training ranges (very fast or slow rate,
very high or low pitch), 15 dB noise (white or pink), long leading silence; every clip at
least 0.3 s (a recorder's margins). Built like the default set (one spawned eSpeak NG
process, seeded, checksummed, cached by its settings hash), then the noise and silence are
added with a seeded numpy generator.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import multiprocessing
import shutil
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

from torchshell.data._spoken_digits_build import (
    ACCENTS,
    DIGITS,
    HELD_OUT_VARIANTS,
    _synthesize,
    _verify,
    default_root,
)

HELDOUT_VERSION = 2
MIN_SECONDS = 0.3  # shorter clips (very fast speech) get silence around them, as recorded
# condition: (rate range, pitch range, SNR dB or None, leading silence range in seconds)
CONDITIONS: dict[str, tuple[tuple[int, int], tuple[int, int], float | None, tuple[float, float]]]
CONDITIONS = {
    "fast": ((330, 400), (30, 70), None, (0.0, 0.05)),
    "slow": ((80, 100), (30, 70), None, (0.0, 0.05)),
    "high_pitch": ((140, 220), (93, 100), None, (0.0, 0.05)),
    "low_pitch": ((140, 220), (0, 6), None, (0.0, 0.05)),
    "noise_15db": ((140, 220), (30, 70), 15.0, (0.0, 0.05)),
    "lead_silence": ((140, 220), (30, 70), None, (0.5, 1.5)),
}


def _plan(seed: int, voices: tuple[str, ...]) -> list[dict[str, Any]]:
    clips = []
    for v, voice in enumerate(voices):
        for label, word in enumerate(DIGITS):
            for c, (name, (rate, pitch, snr, lead)) in enumerate(CONDITIONS.items()):
                rng = np.random.default_rng([seed, 1000 + v, label, c])
                accent = ACCENTS[int(rng.integers(len(ACCENTS)))]
                clips.append(
                    {
                        "path": f"{name}/{voice}/{word}.wav",
                        "label": label,
                        "word": word,
                        "speaker": voice,
                        "condition": name,
                        "voice": f"{accent}+{voice}",
                        "rate": int(rng.integers(*rate)),
                        "pitch": int(rng.integers(*pitch)),
                        "range": int(rng.integers(20, 90)),
                        "rand_seed": int(rng.integers(2**31 - 1)),
                        "snr_db": snr,
                        "noise": ("white", "pink")[int(rng.integers(2))],
                        "lead_s": float(rng.uniform(*lead)),
                    }
                )
    return clips


def _degrade(path: Path, clip: dict[str, Any], rng: np.random.Generator) -> None:
    """Adds the clip's leading silence (0.3 s after it), the silence around a clip shorter
    than :data:`MIN_SECONDS`, and the noise, in place."""
    wave, rate = sf.read(path, dtype="float32")
    power = float(np.mean(wave**2)) if wave.size else 0.0
    wave = np.concatenate(
        [
            np.zeros(int(clip["lead_s"] * rate), np.float32),
            wave,
            np.zeros(int(0.3 * rate) if clip["lead_s"] > 0.1 else 0, np.float32),
        ]
    )
    short = max(0, int(MIN_SECONDS * rate) - wave.size)
    wave = np.pad(wave, (short // 2, short - short // 2))
    if clip["snr_db"] is not None:
        noise = rng.standard_normal(wave.size).astype(np.float32)
        if clip["noise"] == "pink":
            spectrum = np.fft.rfft(noise) / np.sqrt(np.maximum(np.arange(wave.size // 2 + 1), 1))
            noise = np.fft.irfft(spectrum, n=wave.size).astype(np.float32)
        noise /= np.sqrt(np.mean(noise**2))
        wave = wave + noise * np.sqrt(max(power, 1e-10) / 10 ** (clip["snr_db"] / 10))
    sf.write(path, np.clip(wave, -1.0, 1.0), rate, subtype="PCM_16")


def ensure_heldout(root: str | Path | None = None, *, seed: int = 7) -> Path:
    """Builds the held-out set under ``root`` (the default set's cache) unless it is there.

    Args:
        root: the cache folder; the default set's when ``None``.
        seed: decides every clip's accent, prosody and noise.

    Returns:
        The folder holding ``manifest.json`` (each clip with its ``condition``) and the WAVs.

    Example (the plan, without building: 8 voices x 10 digits x 6 conditions):
        >>> len(_plan(7, HELD_OUT_VARIANTS)), sorted(CONDITIONS)[:2]
        (480, ['fast', 'high_pitch'])
    """
    settings = {
        "heldout": HELDOUT_VERSION,
        "espeakng_loader": version("espeakng-loader"),
        "voices": list(HELD_OUT_VARIANTS),
        "conditions": {
            k: [list(v[0]), list(v[1]), v[2], list(v[3])] for k, v in CONDITIONS.items()
        },
        "min_seconds": MIN_SECONDS,
        "seed": seed,
    }
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    folder = Path(root if root is not None else default_root()).expanduser() / f"heldout-{key}"
    if _verify(folder) is not None:
        return folder
    clips = _plan(seed, HELD_OUT_VARIANTS)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        pool.submit(_synthesize, str(tmp), clips).result()
    rng = np.random.default_rng(seed)
    for clip in clips:
        path = tmp / clip["path"]
        _degrade(path, clip, rng)
        clip["num_samples"] = sf.info(path).frames
        clip["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        clip["split"] = "heldout"
    (tmp / "manifest.json").write_text(
        json.dumps({"settings": settings, "clips": clips}, indent=1, sort_keys=True)
    )
    shutil.rmtree(folder, ignore_errors=True)
    tmp.replace(folder)
    return folder
