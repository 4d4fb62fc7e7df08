"""Input audio shared by the framework adapters: the frameworks' PCM16 frames (any rate, any channel count)
become mono float32 at 16 kHz, resampled once and streaming; turns cut by the framework's own turn
signals keep the onset that its VAD needed to confirm speech.

Plain numpy: nothing here knows a framework.
"""

from __future__ import annotations

import numpy as np

from omni_rt.audio.resample import StreamingResampler
from omni_rt.errors import InvalidRequestError

SPEECH_RATE = 16000  # what `Session.respond(audio=...)` encodes; other rates are resampled to it


class InputAudio:
    """Interleaved int16 PCM bytes at any rate -> mono float32 at 16 kHz, one streaming resampler per rate.

    A stream that changes rate mid-way (a transport renegotiating) gets the old resampler's tail and a new
    resampler: no samples are lost or resampled twice.
    """

    def __init__(self) -> None:
        self._rate: int | None = None
        self._resampler: StreamingResampler | None = None

    def push(self, data: bytes, sample_rate: int, num_channels: int) -> np.ndarray:
        if not isinstance(sample_rate, int) or sample_rate <= 0:
            raise InvalidRequestError(f"input audio sample rate must be a positive int, got {sample_rate!r}")
        if not isinstance(num_channels, int) or num_channels < 1:
            raise InvalidRequestError(f"input audio must have at least one channel, got {num_channels!r}")
        if len(data) % (2 * num_channels):
            raise InvalidRequestError(
                f"input audio of {len(data)} bytes is not whole int16 samples of {num_channels} channel(s)"
            )
        pcm = np.frombuffer(data, dtype="<i2").reshape(-1, num_channels).astype(np.float32) / 32768.0
        mono = pcm.mean(axis=1) if num_channels > 1 else pcm[:, 0]
        head = np.zeros(0, np.float32)
        if sample_rate != self._rate:
            if self._resampler is not None:
                head = self._resampler.flush()
            self._rate = sample_rate
            self._resampler = (
                None if sample_rate == SPEECH_RATE else StreamingResampler(sample_rate, SPEECH_RATE)
            )
        out = mono if self._resampler is None else self._resampler.push(mono)
        return np.concatenate([head, out]).astype(np.float32, copy=False) if len(head) else out


class TurnBuffer:
    """The audio of one user turn whose start and end someone else decides (the framework's VAD and turn
    analyzer, or `commit`/`clear` calls).

    While no turn is open it keeps only the last `preroll_ms` (a VAD confirms speech some 200 ms after it
    began, and a turn frame comes later still); an open turn keeps at most `max_turn_ms`, its newest audio,
    as the Realtime API bounds its input buffer.
    """

    def __init__(self, preroll_ms: int = 500, max_turn_ms: int = 30000, always_open: bool = False) -> None:
        if preroll_ms < 0 or max_turn_ms <= 0:
            raise InvalidRequestError("preroll_ms must be >= 0 and max_turn_ms > 0")
        self.preroll = preroll_ms * SPEECH_RATE // 1000
        self.max_turn = max_turn_ms * SPEECH_RATE // 1000
        self.always_open = always_open  # a push-to-talk buffer: everything since the last take or clear
        self._chunks: list[np.ndarray] = []
        self._n = 0
        self.open = always_open

    def push(self, pcm: np.ndarray) -> None:
        if len(pcm):
            self._chunks.append(pcm)
            self._n += len(pcm)
        self._trim(self.max_turn if self.open else self.preroll)

    def start(self) -> None:
        """A turn began: what is buffered now is its lead-in."""
        self.open = True

    def take(self) -> np.ndarray | None:
        """The turn's audio (None when nothing was buffered); the buffer starts over."""
        audio = np.concatenate(self._chunks) if self._chunks else None
        self.clear()
        return audio if audio is not None and len(audio) else None

    def clear(self) -> None:
        self._chunks, self._n = [], 0
        self.open = self.always_open

    @property
    def duration_ms(self) -> int:
        return self._n * 1000 // SPEECH_RATE

    def _trim(self, keep: int) -> None:
        if self._n <= keep:
            return
        buf = np.concatenate(self._chunks)[self._n - keep :] if keep else np.zeros(0, np.float32)
        self._chunks, self._n = ([buf] if len(buf) else []), len(buf)
