"""eSpeak NG speech synthesis through ctypes over the ``espeakng-loader`` wheel (no system package).

The wheel ships ``libespeak-ng`` and its ``espeak-ng-data``; this module drives the C API in
synchronous mode and returns 16-bit PCM as a numpy array. The library keeps global state, so
one :class:`Espeak` per process (synthesis runs in worker processes for parallelism).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from types import TracebackType

import espeakng_loader
import numpy as np

# espeak_AUDIO_OUTPUT, espeak_PARAMETER and espeak_POSITION_TYPE of speak_lib.h.
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_PARAM_RATE, _PARAM_VOLUME, _PARAM_PITCH, _PARAM_RANGE = 1, 2, 3, 4
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_EE_OK = 0

_Callback = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)


class EspeakError(RuntimeError):
    """eSpeak NG refused a call (unknown voice, failed initialisation, synthesis error)."""


def variant_names() -> list[str]:
    """Voice variants shipped in the wheel (``espeak-ng-data/voices/!v``), sorted.

    Example:
        >>> "f3" in variant_names()
        True
    """
    root = Path(espeakng_loader.get_data_path()) / "voices" / "!v"
    return sorted(p.name for p in root.iterdir() if p.is_file())


class Espeak:
    """A synchronous eSpeak NG synthesiser.

    Args:
        data_path: the ``espeak-ng-data`` folder; the wheel's by default.

    Example:
        >>> with Espeak() as tts:
        ...     pcm = tts.synth("seven", voice="en+f3", rate=175, pitch=50)
        >>> tts.sample_rate, pcm.dtype, pcm.size > 5000
        (22050, dtype('int16'), True)
    """

    def __init__(self, data_path: str | None = None) -> None:
        self._lib = ctypes.CDLL(espeakng_loader.get_library_path())
        self._lib.espeak_Initialize.restype = ctypes.c_int
        self._lib.espeak_Initialize.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        self._lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        self._lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self._lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]
        self._lib.espeak_Synth.argtypes = [
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.c_uint,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        path = (data_path or espeakng_loader.get_data_path()).encode()
        rate = self._lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, path, 0)
        if rate <= 0:
            raise EspeakError(
                f"espeak_Initialize returned {rate} for data path {path.decode()!r}: expected a "
                "sample rate. Fix: reinstall espeakng-loader or pass its espeak-ng-data folder."
            )
        self.sample_rate = int(rate)
        self._chunks: list[np.ndarray] = []
        self._callback = _Callback(self._collect)  # kept alive as long as self
        self._lib.espeak_SetSynthCallback(self._callback)

    def _collect(self, wav: ctypes._Pointer, n: int, events: int) -> int:
        if n > 0 and wav:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        return 0

    def synth(
        self,
        text: str,
        *,
        voice: str = "en",
        rate: int = 175,
        pitch: int = 50,
        range_: int = 50,
        rand_seed: int = 0,
    ) -> np.ndarray:
        """Speaks ``text`` and returns mono int16 PCM at :attr:`sample_rate`.

        Args:
            text: what to say.
            voice: a voice name, optionally with a variant (``"en-us+m3"``).
            rate: words per minute (80-450).
            pitch: base pitch, 0-100.
            range_: pitch range, 0-100.
            rand_seed: seeds the library's noise and jitter generator for this utterance.

        Returns:
            ``int16[samples]``.
        """
        if self._lib.espeak_SetVoiceByName(voice.encode()) != _EE_OK:
            raise EspeakError(
                f"Unknown eSpeak voice {voice!r}: expected a voice such as 'en' or 'en-us+f3'. "
                "Fix: pick a language voice and a variant from variant_names()."
            )
        for param, value in ((_PARAM_RATE, rate), (_PARAM_PITCH, pitch), (_PARAM_RANGE, range_)):
            self._lib.espeak_SetParameter(param, int(value), 0)
        self._lib.espeak_ng_SetRandSeed(int(rand_seed))
        self._chunks = []
        data = text.encode() + b"\0"
        status = self._lib.espeak_Synth(
            data, len(data), 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None
        )
        self._lib.espeak_Synchronize()
        if status != _EE_OK:
            raise EspeakError(f"espeak_Synth failed with status {status} for {text!r}.")
        if not self._chunks:
            return np.zeros(0, np.int16)
        return np.concatenate(self._chunks).astype(np.int16, copy=False)

    def close(self) -> None:
        """Releases the library's buffers."""
        self._lib.espeak_Terminate()

    def __enter__(self) -> Espeak:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
