"""Server-side voice activity detection with OpenAI Realtime `server_vad` semantics; numpy only.

    vad = ServerVad()                                   # threshold 0.5, prefix 300 ms, silence 500 ms
    for chunk in mic_16k_chunks:                        # float [-1, 1] or int16, any chunk length
        for ev in vad.push(chunk):
            ev.type        # "input_audio_buffer.speech_started": ev.audio_start_ms
                           # "input_audio_buffer.speech_stopped": ev.audio_end_ms
    seg = TurnSegmenter()                               # the same, plus each turn's audio
    for ev in seg.push(chunk): ...                      # ... SpeechStopped, then Turn(audio, start, end)

Times are milliseconds of audio pushed since the detector started (or was `reset`), as the Realtime API
counts them on its input buffer:
- `speech_started.audio_start_ms` is where the turn's audio begins: the first speech frame minus
  `prefix_padding_ms` (not before 0), so the audio sent to the model includes that lead-in.
- `speech_stopped.audio_end_ms` is where it ends: the end of the last speech frame plus
  `silence_duration_ms`, the moment the silence window completed; the turn is [start, end).
A pause shorter than the silence window keeps the turn going.

The detector works on 20 ms frames at 16 kHz. Its speech probability of a frame combines
- energy above an adaptive noise floor: p_e = sigmoid((level_dB - floor_dB - margin_dB) / slope_dB); the
  floor follows quiet frames at once and rises only slowly (3 dB/s), so a steady sound stops counting
  as speech within seconds, while speech, whose pauses pull the floor back down, keeps counting;
- the zero-crossing rate: noise-like frames (ZCR near 0.5, as in white noise or hiss) are scaled down
  toward `noise_zcr_weight`, voiced speech (a few hundred Hz, ZCR well below 0.2) keeps its weight;
and a frame is speech when p >= threshold. Speech starts after `min_speech_ms` of consecutive speech
frames (a click or a single loud frame is not a turn). Plain Python and numpy, deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = [
    "ServerVad",
    "SpeechStarted",
    "SpeechStopped",
    "Turn",
    "TurnSegmenter",
    "VadConfig",
    "frame_features",
    "pcm_float",
    "speech_probability",
]


@dataclass(frozen=True)
class VadConfig:
    """OpenAI Realtime `turn_detection` of type server_vad, plus the detector's own tuning."""

    threshold: float = 0.5  # on the speech probability in [0, 1]
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    sample_rate: int = 16000
    frame_ms: int = 20
    min_speech_ms: int = 60  # consecutive speech frames before a turn starts
    margin_db: float = 12.0  # p_e = 0.5 this far above the noise floor
    slope_db: float = 3.0
    floor_init_db: float = -60.0  # the floor before any audio: quiet room level
    floor_min_db: float = -80.0  # digital silence must not pull the floor to -inf
    floor_rise_db_per_s: float = 3.0  # how fast the floor creeps up under steady noise
    noise_zcr: tuple[float, float] = (0.25, 0.45)  # ZCR where the noise penalty starts / is full
    noise_zcr_weight: float = 0.3

    def __post_init__(self) -> None:
        from omni_rt.errors import ConfigError

        if not 0.0 < self.threshold < 1.0:
            raise ConfigError(f"VAD threshold must be in (0, 1), got {self.threshold}")
        for name in ("prefix_padding_ms", "silence_duration_ms", "min_speech_ms"):
            v = getattr(self, name)
            if v < 0 or v % self.frame_ms:
                raise ConfigError(
                    f"VAD {name} must be a non-negative multiple of {self.frame_ms} ms, got {v}"
                )
        if self.silence_duration_ms < self.frame_ms:
            # a zero window would end every turn on the frame that started it
            raise ConfigError(f"VAD silence_duration_ms must be at least {self.frame_ms} ms")
        if self.sample_rate * self.frame_ms % 1000:
            raise ConfigError(f"{self.frame_ms} ms is not a whole number of samples at {self.sample_rate} Hz")

    @property
    def frame_samples(self) -> int:
        return self.sample_rate * self.frame_ms // 1000


@dataclass(frozen=True)
class SpeechStarted:
    audio_start_ms: int
    type: Literal["input_audio_buffer.speech_started"] = "input_audio_buffer.speech_started"


@dataclass(frozen=True)
class SpeechStopped:
    audio_end_ms: int
    type: Literal["input_audio_buffer.speech_stopped"] = "input_audio_buffer.speech_stopped"


def frame_features(frame: np.ndarray) -> tuple[float, float]:
    """(level in dBFS of the frame's RMS, zero-crossing rate per sample in [0, 1]) of a float frame."""
    x = frame.astype(np.float64)
    x = x - x.mean()  # a DC offset is neither energy nor crossings
    rms = math.sqrt(float(np.mean(x * x)))
    level = 20.0 * math.log10(rms) if rms > 0 else -math.inf
    signs = np.signbit(x)
    zcr = float(np.count_nonzero(signs[1:] != signs[:-1])) / max(len(x) - 1, 1)
    return level, zcr


def speech_probability(level_db: float, zcr: float, floor_db: float, cfg: VadConfig) -> float:
    """Speech probability of a frame from its level, its ZCR and the current noise floor."""
    z = (level_db - floor_db - cfg.margin_db) / cfg.slope_db
    p_energy = 1.0 / (1.0 + math.exp(-max(min(z, 60.0), -60.0)))
    lo, hi = cfg.noise_zcr
    noisiness = min(max((zcr - lo) / (hi - lo), 0.0), 1.0)
    return p_energy * (1.0 - (1.0 - cfg.noise_zcr_weight) * noisiness)


def pcm_float(audio: np.ndarray) -> np.ndarray:
    """Mono PCM as float32 in [-1, 1] (int16 is scaled); anything else is an `InvalidRequestError`."""
    from omni_rt.errors import InvalidRequestError

    a = np.asarray(audio)
    if a.ndim != 1:
        raise InvalidRequestError(f"VAD input must be mono [samples], got shape {a.shape}")
    if a.dtype == np.int16:
        return a.astype(np.float32) / 32768.0
    if not np.issubdtype(a.dtype, np.floating):
        raise InvalidRequestError(f"VAD input must be float or int16 PCM, got dtype {a.dtype}")
    return a.astype(np.float32, copy=False)


class ServerVad:
    """Streaming detector: push 16 kHz mono audio in any chunk sizes, get speech_started/stopped events."""

    def __init__(self, cfg: VadConfig | None = None) -> None:
        self.cfg = cfg or VadConfig()
        self.reset()

    def reset(self) -> None:
        """Forget everything: time restarts at 0 (a new input buffer)."""
        self._pending = np.zeros(0, dtype=np.float32)  # samples of an incomplete frame
        self._frames = 0  # whole frames processed
        self._floor = self.cfg.floor_init_db
        self._in_speech = False
        self._run = 0  # consecutive speech frames (before a start) / silent frames (during speech)
        self.last_probability = 0.0

    def reset_speech(self) -> None:
        """End any turn in progress without an event (a manual commit or clear); time and floor stay."""
        self._in_speech = False
        self._run = 0

    @property
    def in_speech(self) -> bool:
        return self._in_speech

    @property
    def elapsed_ms(self) -> int:
        """Milliseconds of audio analysed (whole frames)."""
        return self._frames * self.cfg.frame_ms

    def push(self, audio: np.ndarray) -> list[SpeechStarted | SpeechStopped]:
        """Analyse `audio` (1-D float in [-1, 1], or int16) and return the events it completes, in order."""
        buf = np.concatenate((self._pending, pcm_float(audio)))
        n = self.cfg.frame_samples
        whole = len(buf) // n
        events: list[SpeechStarted | SpeechStopped] = []
        for i in range(whole):
            ev = self._frame(buf[i * n : (i + 1) * n])
            if ev is not None:
                events.append(ev)
        self._pending = buf[whole * n :].copy()
        return events

    def _frame(self, frame: np.ndarray) -> SpeechStarted | SpeechStopped | None:
        cfg = self.cfg
        level, zcr = frame_features(frame)
        level = max(level, cfg.floor_min_db)
        p = speech_probability(level, zcr, self._floor, cfg)
        self.last_probability = p
        is_speech = p >= cfg.threshold
        self._frames += 1
        now = self.elapsed_ms  # end of this frame
        self._track_floor(level)
        if not self._in_speech:
            self._run = self._run + 1 if is_speech else 0
            if self._run * cfg.frame_ms >= max(cfg.min_speech_ms, cfg.frame_ms):
                self._in_speech, self._run = True, 0
                first = now - cfg.frame_ms * max(cfg.min_speech_ms // cfg.frame_ms, 1)
                return SpeechStarted(audio_start_ms=max(first - cfg.prefix_padding_ms, 0))
            return None
        self._run = 0 if is_speech else self._run + 1
        if self._run * cfg.frame_ms >= cfg.silence_duration_ms:
            self._in_speech, self._run = False, 0
            return SpeechStopped(audio_end_ms=now)  # last speech frame's end + silence_duration_ms
        return None

    def _track_floor(self, level: float) -> None:
        """Fast down, slow up. Speech has dips between syllables and words that pull the floor back down
        at once, so it stays near the background; a steady sound (a hum) has none, so the floor climbs
        to it and it stops counting as speech (and ends a turn it started) within seconds."""
        cfg = self.cfg
        if level < self._floor:
            self._floor = max(level, cfg.floor_min_db)
        else:
            self._floor = min(level, self._floor + cfg.floor_rise_db_per_s * cfg.frame_ms / 1000.0)


@dataclass(frozen=True)
class Turn:
    """One user turn's audio: 16 kHz float32 samples of [audio_start_ms, audio_end_ms)."""

    audio: np.ndarray
    audio_start_ms: int
    audio_end_ms: int
    type: Literal["turn"] = "turn"


class TurnSegmenter:
    """A `ServerVad` that also keeps the audio: each speech_stopped is followed by the `Turn` it closed.

    Memory is bounded while idle (the last prefix_padding + min_speech + one frame of audio, what a
    speech_started can reach back to); during a turn it holds the turn (the caller bounds turn length
    with `turn_ms`, as the Realtime API bounds its input buffer). `commit()` ends a turn early (a
    client's `input_audio_buffer.commit` while the user is still talking), `clear()` drops it.

    `detect=False` is the Realtime API's `turn_detection: null`: no detector runs, a turn is always
    open, and it holds everything pushed since the last commit or clear until `commit()` takes it.
    """

    def __init__(self, cfg: VadConfig | None = None, *, detect: bool = True) -> None:
        self.vad = ServerVad(cfg)
        self.detect = detect
        self._chunks: list[np.ndarray] = []
        self._start = 0  # sample index of the first buffered sample
        self._pushed = 0  # samples pushed in all
        self._turn_start_ms: int | None = None if detect else 0
        self._last_end_ms = 0  # where the previous turn ended: the next one's prefix stops there

    @property
    def in_speech(self) -> bool:
        return self.vad.in_speech

    @property
    def elapsed_ms(self) -> int:
        """Where the input buffer stands: whole frames analysed, or (no detection) all samples pushed."""
        return self.vad.elapsed_ms if self.detect else self._pushed * 1000 // self.vad.cfg.sample_rate

    @property
    def turn_ms(self) -> int:
        """Milliseconds of audio in the open turn (0 when none is open)."""
        return 0 if self._turn_start_ms is None else self.elapsed_ms - self._turn_start_ms

    def push(self, audio: np.ndarray) -> list[SpeechStarted | SpeechStopped | Turn]:
        a = pcm_float(audio)  # validates
        events = self.vad.push(a) if self.detect else []
        self._chunks.append(a.copy())
        self._pushed += len(a)
        out: list[SpeechStarted | SpeechStopped | Turn] = []
        for ev in events:
            if isinstance(ev, SpeechStarted):
                # After a commit mid-speech (or with a prefix longer than the silence window) the
                # prefix would reach into the previous turn: no audio belongs to two turns.
                ev = SpeechStarted(audio_start_ms=max(ev.audio_start_ms, self._last_end_ms))
                self._turn_start_ms = ev.audio_start_ms
            out.append(ev)
            if not isinstance(ev, SpeechStarted):
                out.append(self._take(ev.audio_end_ms))
        self._trim()
        return out

    def commit(self) -> Turn | None:
        """End the current turn now (whole frames analysed so far); None when no turn is open."""
        if self._turn_start_ms is None:
            return None
        end = self.elapsed_ms
        turn = self._take(end)
        self.vad.reset_speech()
        if not self.detect:
            self._turn_start_ms = end  # the next turn starts where this one ended
        return turn

    def clear(self) -> None:
        """Drop the current turn's audio and state (`input_audio_buffer.clear`); time keeps running."""
        self._turn_start_ms = None if self.detect else self.elapsed_ms
        self.vad.reset_speech()
        self._trim()

    def _samples(self, ms: int) -> int:
        return ms * self.vad.cfg.sample_rate // 1000

    def _take(self, end_ms: int) -> Turn:
        start_ms = self._turn_start_ms if self._turn_start_ms is not None else end_ms
        buf = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)
        lo, hi = self._samples(start_ms) - self._start, self._samples(end_ms) - self._start
        self._turn_start_ms = None
        self._last_end_ms = end_ms
        return Turn(audio=buf[max(lo, 0) : hi].copy(), audio_start_ms=start_ms, audio_end_ms=end_ms)

    def _trim(self) -> None:
        """Keep only what a turn can still need: from the open turn's start, or the look-back window."""
        cfg = self.vad.cfg
        if self._turn_start_ms is not None:
            keep_from = self._samples(self._turn_start_ms)
        else:
            back = cfg.prefix_padding_ms + cfg.min_speech_ms + 2 * cfg.frame_ms
            keep_from = max(self._samples(self.vad.elapsed_ms - back), 0)
        if keep_from <= self._start or not self._chunks:
            return
        buf = np.concatenate(self._chunks)
        cut = min(keep_from - self._start, len(buf))
        self._chunks = [buf[cut:]]
        self._start += cut
