"""Builds the spoken-digits data set offline: eSpeak NG voices saying "zero" to "nine".

Every voice variant of the ``espeakng-loader`` wheel is one speaker (but the few in
:data:`HELD_OUT_VARIANTS`, kept for a held-out set made apart); speakers (not clips) are split
into train/val/test, so the test voices are unseen in training. Each clip gets one of the
wheel's English accents (:data:`ACCENTS`), a rate, pitch and pitch range drawn from its own
seeded generator (:data:`PROSODY`), is resampled to 16 kHz with torchaudio and written as
16-bit mono WAV. A ``manifest.json`` lists every clip
with its SHA-256; the set lives in a folder named by the hash of its settings, so building
again with the same settings is a no-op (after the checksums verify).

libespeak-ng carries noise and jitter state from one utterance to the next, so the synthesis
runs in a fresh child process, in manifest order, with ``espeak_ng_SetRandSeed`` before each
clip: the same settings give the same bytes.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import multiprocessing
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
ACCENTS = (
    "en",
    "en-us",
    "en-029",
    "en-gb-scotland",
    "en-gb-x-gbclan",
    "en-gb-x-gbcwmd",
    "en-gb-x-rp",
    "en-us-nyc",
)
SAMPLE_RATE = 16_000
FORMAT_VERSION = 3  # 3: voice families keep a member in training
# Variants in no split of the default set: the voices of a held-out set made apart from it.
HELD_OUT_VARIANTS = ("Alicia", "Lee", "edward2", "f5", "iven3", "klatt4", "m7", "robosoft6")
# Variants of one voice under two names (the rest: the name without its trailing digits).
FAMILY_ALIASES = {"whisperf": "whisper", "anikarobot": "anika", "anxiousandy": "andy"}
# Prosody ranges of the default set, [low, high): words per minute, pitch, pitch range (0-100).
PROSODY = {"rate": (110, 300), "pitch": (10, 90), "range": (10, 95)}


class SpokenDigitsDataError(ValueError):
    """Settings or files of the spoken-digits set that cannot be used."""


def default_root() -> Path:
    """``$XDG_CACHE_HOME/coreshell/spoken_digits`` (``~/.cache/...`` when unset).

    Example:
        >>> default_root().name
        'spoken_digits'
    """
    import os

    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "coreshell" / "spoken_digits"


def _settings(
    takes: int, speakers: int | None, val_fraction: float, test_fraction: float, seed: int
) -> dict[str, Any]:
    from torchshell.data._espeak import variant_names

    voices = [v for v in variant_names() if v not in HELD_OUT_VARIANTS]
    if speakers is not None:
        if speakers < 3:
            raise SpokenDigitsDataError(
                f"speakers={speakers}: expected at least 3 (one per split) or null for all "
                f"{len(voices)}. Fix: set data.speakers >= 3."
            )
        voices = voices[:speakers]
    if takes < 1 or not (0 < val_fraction < 1 and 0 < test_fraction < 1):
        raise SpokenDigitsDataError(
            f"takes={takes}, val_fraction={val_fraction}, test_fraction={test_fraction}: "
            "expected takes >= 1 and fractions in (0, 1). Fix: set data.takes / data.*_fraction."
        )
    return {
        "format": FORMAT_VERSION,
        "espeakng_loader": version("espeakng-loader"),
        "sample_rate": SAMPLE_RATE,
        "takes": takes,
        "voices": voices,
        "accents": list(ACCENTS),
        "prosody": {k: list(v) for k, v in PROSODY.items()},
        "val_fraction": val_fraction,
        "test_fraction": test_fraction,
        "seed": seed,
    }


def family(voice: str) -> str:
    """The voice family of an eSpeak NG variant: its name without trailing digits, lowercase.

    Example:
        >>> family("klatt4"), family("RicishayMax2"), family("whisperf")
        ('klatt', 'ricishaymax', 'whisper')
    """
    stem = voice.lower().rstrip("0123456789")
    return FAMILY_ALIASES.get(stem, stem)


def _split(settings: dict[str, Any]) -> dict[str, str]:
    """Each voice's split. Test and val voices are never trained on, but every family of
    several variants (whisper and whisperf, klatt..klatt6) keeps one member in training, so
    a test voice may be new without its whole kind of voice being new (a split that put both
    whisper variants in test scored them 21-42% while the rest scored 98.6%)."""
    voices = settings["voices"]
    order = [voices[i] for i in np.random.default_rng(settings["seed"]).permutation(len(voices))]
    members: dict[str, list[str]] = {}
    for v in order:
        members.setdefault(family(v), []).append(v)
    anchors = {m[-1] for m in members.values() if len(m) > 1}  # the last drawn stays in train
    n_test = max(1, round(len(voices) * settings["test_fraction"]))
    n_val = max(1, round(len(voices) * settings["val_fraction"]))
    pool = [v for v in order if v not in anchors] or order
    split_of = {v: "train" for v in voices}
    for rank, v in enumerate(pool[: n_test + n_val]):
        split_of[v] = "test" if rank < n_test else "val"
    return split_of


def _plan(settings: dict[str, Any]) -> list[dict[str, Any]]:
    """Every clip's words, voice, prosody and split: a pure function of the settings."""
    voices = settings["voices"]
    split_of = _split(settings)
    clips = []
    for s, speaker in enumerate(voices):
        slug = speaker.replace(" ", "_")
        for label, word in enumerate(DIGITS):
            for take in range(settings["takes"]):
                rng = np.random.default_rng([settings["seed"], s, label, take])
                accent = settings["accents"][int(rng.integers(len(settings["accents"])))]
                clips.append(
                    {
                        "path": f"{split_of[speaker]}/{slug}/{word}_{take}.wav",
                        "label": label,
                        "word": word,
                        "speaker": speaker,
                        "split": split_of[speaker],
                        "voice": f"{accent}+{speaker}",
                        "rate": int(rng.integers(*settings["prosody"]["rate"])),
                        "pitch": int(rng.integers(*settings["prosody"]["pitch"])),
                        "range": int(rng.integers(*settings["prosody"]["range"])),
                        "rand_seed": int(rng.integers(2**31 - 1)),
                    }
                )
    return clips


def _synthesize(out_dir: str, clips: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """Child-process body: speaks, resamples and writes every clip; ``(samples, sha256)``.

    Resampling runs in fixed batches of similar length (a batched torchaudio ``Resample`` is
    ~15x faster per clip than one clip at a time); zero padding at the end of a clip does not
    change its resampled samples, which are cropped to the clip's own length.
    """
    import soundfile as sf
    import torch
    import torchaudio

    from torchshell.data._espeak import Espeak

    with Espeak() as tts:
        pcms = [
            tts.synth(
                c["word"],
                voice=c["voice"],
                rate=c["rate"],
                pitch=c["pitch"],
                range_=c["range"],
                rand_seed=c["rand_seed"],
            )
            for c in clips
        ]
        source_rate = tts.sample_rate
    resample = torchaudio.transforms.Resample(source_rate, SAMPLE_RATE)
    order = sorted(range(len(clips)), key=lambda i: (len(pcms[i]), i))
    results: list[tuple[int, str]] = [(0, "")] * len(clips)
    for start in range(0, len(order), 64):
        rows = order[start : start + 64]
        batch = torch.zeros(len(rows), max(len(pcms[i]) for i in rows))
        for r, i in enumerate(rows):
            batch[r, : len(pcms[i])] = torch.from_numpy(pcms[i].astype(np.float32) / 32768.0)
        with torch.no_grad():
            waves = resample(batch).numpy()
        for r, i in enumerate(rows):
            n = -(-len(pcms[i]) * SAMPLE_RATE // source_rate)
            pcm16 = np.clip(np.round(waves[r, :n] * 32768.0), -32768, 32767).astype(np.int16)
            path = Path(out_dir) / clips[i]["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            sf.write(path, pcm16, SAMPLE_RATE, subtype="PCM_16")
            results[i] = (n, hashlib.sha256(path.read_bytes()).hexdigest())
    return results


def _verify(folder: Path) -> dict[str, Any] | None:
    """The manifest when every listed file exists with its checksum, else ``None``."""
    manifest_path = folder / "manifest.json"
    if not manifest_path.is_file():
        return None
    manifest: dict[str, Any] = json.loads(manifest_path.read_text())
    for clip in manifest["clips"]:
        path = folder / clip["path"]
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != clip["sha256"]:
            return None
    return manifest


def ensure_spoken_digits(
    root: str | Path | None = None,
    *,
    takes: int = 6,
    speakers: int | None = None,
    val_fraction: float = 0.08,
    test_fraction: float = 0.15,
    seed: int = 0,
) -> Path:
    """Builds the data set under ``root`` unless a verified copy is already there.

    Args:
        root: the cache folder; :func:`default_root` when ``None``.
        takes: clips per (speaker, digit), each with its own accent and prosody.
        speakers: use only the first N voice variants (small test sets); all when ``None``.
        val_fraction: share of speakers held out for validation.
        test_fraction: share of speakers held out for testing.
        seed: decides the speaker split and every clip's prosody.

    Returns:
        The folder holding ``manifest.json`` and the WAVs.

    Example:
        >>> import tempfile
        >>> folder = ensure_spoken_digits(tempfile.mkdtemp(), takes=1, speakers=3)
        >>> import json; len(json.loads((folder / "manifest.json").read_text())["clips"])
        30
    """
    settings = _settings(takes, speakers, val_fraction, test_fraction, seed)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    folder = (
        Path(root if root is not None else default_root()).expanduser() / f"v{FORMAT_VERSION}-{key}"
    )
    if _verify(folder) is not None:
        return folder
    clips = _plan(settings)
    # Several processes may build the same set at once (make bench's parallel jobs, a test
    # beside a run): each writes its own partial folder, and the first complete one wins.
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{folder.name}.partial-", dir=folder.parent))
    # A fresh process: libespeak-ng's state then depends only on the clips spoken, in order.
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        results = pool.submit(_synthesize, str(tmp), clips).result()
    for clip, (samples, digest) in zip(clips, results, strict=True):
        clip["num_samples"], clip["sha256"] = samples, digest
    manifest = {"settings": settings, "clips": clips}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    if _verify(folder) is None:  # not finished by another process meanwhile: a damaged one goes
        shutil.rmtree(folder, ignore_errors=True)
        try:
            tmp.replace(folder)
        except OSError:  # another process's complete folder landed first
            if _verify(folder) is None:
                raise
    shutil.rmtree(tmp, ignore_errors=True)
    return folder


def load_manifest(folder: str | Path) -> dict[str, Any]:
    """Reads ``manifest.json`` of a built set, with a clear error when it is missing."""
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        raise SpokenDigitsDataError(
            f"No manifest.json in {folder}: expected a folder made by ensure_spoken_digits. "
            "Fix: call ensure_spoken_digits(root) (the data module's prepare_data does)."
        )
    manifest: dict[str, Any] = json.loads(path.read_text())
    return manifest
