"""Voice activity detection with OpenAI Realtime `server_vad` semantics, on Silero VAD.

    vad = ServerVad()                                   # threshold 0.5, prefix 300 ms, silence 500 ms
    for chunk in mic_16k_chunks:                        # float [-1, 1] or int16, any chunk length
        for ev in vad.push(chunk):
            ev.type        # "input_audio_buffer.speech_started": ev.audio_start_ms
                           # "input_audio_buffer.speech_stopped": ev.audio_end_ms, ev.speech_end_ms
    seg = TurnSegmenter()                               # the same, plus each turn's audio
    for ev in seg.push(chunk): ...                      # ... SpeechStopped, then Turn(audio, start, end)

The speech probability of each 32 ms frame (512 samples at 16 kHz) comes from Silero VAD, a small
trained model (MIT licence) whose ONNX file ships inside the `silero-vad` package; it runs on CPU through
onnxruntime (`omni_rt.audio.onnx`), one recurrent state per stream, about a tenth of a millisecond a frame.

Times are milliseconds of audio pushed since the detector started (or was `reset`), as the Realtime API
counts them on its input buffer, on the model's 32 ms frames:
- `speech_started.audio_start_ms` is where the turn's audio begins: the first speech frame minus
  `prefix_padding_ms` (not before 0), so the audio sent to the model includes that lead-in.
- `speech_stopped.audio_end_ms` is where it ends: the frame on which the silence after the last speech
  frame reached `silence_duration_ms` (rounded up to whole frames); the turn is [start, end).
  `speech_stopped.speech_end_ms` is where the speech itself ended (the last speech frame's end), what a
  latency figure counts from.
A pause shorter than the silence window keeps the turn going.

A frame is speech at probability >= `threshold`; a turn starts after `min_speech_ms` of such frames in a
row (one loud frame is not a turn) and then holds while frames stay above `threshold - release` (Silero's
own hysteresis: a soft syllable inside a word does not count as a pause). How a turn ends is the one
thing `semantic_vad` changes (`omni_rt.audio.semantic`): it subclasses `ServerVad` and overrides
`_turn_over` (and `_heard`, `_voiced`, `poll` for the audio and the answer it keeps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from omni_rt.audio.onnx import onnx_session, packaged_file

if TYPE_CHECKING:
    from omni_rt.audio.semantic import SemanticVadConfig

__all__ = [
    "ServerVad",
    "SileroVad",
    "SpeechStarted",
    "SpeechStopped",
    "Turn",
    "TurnSegmenter",
    "VadConfig",
    "pcm_float",
]

SAMPLE_RATE = 16000
FRAME_SAMPLES = 512  # what Silero VAD takes at 16 kHz
FRAME_MS = FRAME_SAMPLES * 1000 // SAMPLE_RATE  # 32


def _ms_to_frames(ms: int) -> int:
    return -(-ms // FRAME_MS)


@dataclass(frozen=True)
class VadConfig:
    """OpenAI Realtime `turn_detection` of type server_vad, plus the detector's own tuning."""

    threshold: float = 0.5  # on Silero's speech probability in [0, 1]
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    min_speech_ms: int = 64  # speech frames in a row before a turn starts
    release: float = 0.15  # during a turn a frame is silence below threshold - release

    sample_rate: ClassVar[int] = SAMPLE_RATE
    frame_ms: ClassVar[int] = FRAME_MS

    def __post_init__(self) -> None:
        from omni_rt.errors import ConfigError

        if not 0.0 < self.threshold < 1.0:
            raise ConfigError(f"VAD threshold must be in (0, 1), got {self.threshold}")
        for name in ("prefix_padding_ms", "silence_duration_ms", "min_speech_ms"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ConfigError(f"VAD {name} must be a non-negative whole number of ms, got {v!r}")
        if self.silence_duration_ms < 1:
            # a zero window would end every turn on the frame that started it
            raise ConfigError("VAD silence_duration_ms must be at least 1 ms")
        if not 0.0 <= self.release < self.threshold:
            raise ConfigError(f"VAD release must be in [0, threshold), got {self.release}")

    @property
    def frame_samples(self) -> int:
        return FRAME_SAMPLES

    def detector(self) -> ServerVad:
        """A fresh detector for one stream with these settings."""
        return ServerVad(self)


@dataclass(frozen=True)
class SpeechStarted:
    audio_start_ms: int
    type: Literal["input_audio_buffer.speech_started"] = "input_audio_buffer.speech_started"


@dataclass(frozen=True)
class SpeechStopped:
    audio_end_ms: int
    speech_end_ms: int | None = None  # where the voice ended, before the silence window (None: unknown)
    type: Literal["input_audio_buffer.speech_stopped"] = "input_audio_buffer.speech_stopped"


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
    a = a.astype(np.float32, copy=False)
    if not np.isfinite(a).all():
        raise InvalidRequestError("VAD input contains NaN or infinite samples")
    return a


class SileroVad:
    """Silero VAD on one stream: `prob = model(frame)` for consecutive 512-sample frames at 16 kHz.

    The model is recurrent: it carries a state from frame to frame and also sees the last 64 samples
    of the previous frame (the context its front end needs), so frames must come in order; `reset()`
    starts a new stream.
    """

    CONTEXT = 64

    def __init__(self) -> None:
        self._session = onnx_session(packaged_file("silero-vad", "silero_vad/data/silero_vad.onnx"))
        self._sr = np.array(SAMPLE_RATE, dtype=np.int64)
        self.reset()

    def reset(self) -> None:
        self._state = np.zeros((2, 1, 128), np.float32)
        self._context = np.zeros((1, self.CONTEXT), np.float32)

    def __call__(self, frame: np.ndarray) -> float:
        x = np.concatenate((self._context, frame.reshape(1, FRAME_SAMPLES)), axis=1)
        out, self._state = self._session.run(None, {"input": x, "state": self._state, "sr": self._sr})
        self._context = x[:, -self.CONTEXT :]
        return float(out[0, 0])


class ServerVad:
    """Streaming detector: push 16 kHz mono audio in any chunk sizes, get speech_started/stopped events."""

    def __init__(self, cfg: VadConfig | None = None) -> None:
        self.cfg = cfg or VadConfig()
        self._model: SileroVad | None = None  # loaded on first use (`load`): a detector made but never
        # fed (no turn detection) costs nothing
        self._min_frames = max(_ms_to_frames(self.cfg.min_speech_ms), 1)
        self._silence_frames = _ms_to_frames(self.cfg.silence_duration_ms)
        self.reset()

    def reset(self) -> None:
        """Forget everything: time restarts at 0 (a new input buffer)."""
        if self._model is not None:
            self._model.reset()
        self._pending = np.zeros(0, dtype=np.float32)  # samples of an incomplete frame
        self._frames = 0  # whole frames processed
        self._in_speech = False
        self._run = 0  # consecutive speech frames (before a start) / silent frames (during speech)
        self._speech_end_ms = 0  # end of the turn's last speech frame
        self.turn_start_ms = 0  # the open turn's first speech frame
        self.last_probability = 0.0

    def load(self) -> None:
        """Load the model now (a missing package is a `ConfigError` here, not at the first audio)."""
        if self._model is None:
            self._model = SileroVad()

    def reset_speech(self) -> None:
        """End any turn in progress without an event (a manual commit or clear); time and state stay."""
        self._in_speech = False
        self._run = 0

    @property
    def in_speech(self) -> bool:
        return self._in_speech

    @property
    def elapsed_ms(self) -> int:
        """Milliseconds of audio analysed (whole frames)."""
        return self._frames * FRAME_MS

    @property
    def speech_end_ms(self) -> int:
        """During a turn: where its voice last was (the end of its last speech frame)."""
        return self._speech_end_ms

    def push(self, audio: np.ndarray) -> list[SpeechStarted | SpeechStopped]:
        """Analyse `audio` (1-D float in [-1, 1], or int16) and return the events it completes, in order."""
        buf = np.concatenate((self._pending, pcm_float(audio)))
        whole = len(buf) // FRAME_SAMPLES
        events: list[SpeechStarted | SpeechStopped] = []
        for i in range(whole):
            ev = self._frame(buf[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES])
            if ev is not None:
                events.append(ev)
        self._pending = buf[whole * FRAME_SAMPLES :].copy()
        return events

    def _frame(self, frame: np.ndarray) -> SpeechStarted | SpeechStopped | None:
        cfg = self.cfg
        if self._model is None:
            self.load()
        assert self._model is not None
        p = self._model(frame)
        self.last_probability = p
        self._frames += 1
        self._heard(frame)
        now = self.elapsed_ms  # end of this frame
        if not self._in_speech:
            self._run = self._run + 1 if p >= cfg.threshold else 0
            if self._run >= self._min_frames:
                first = now - self._run * FRAME_MS
                self._in_speech, self._run, self._speech_end_ms = True, 0, now
                self.turn_start_ms = first
                return SpeechStarted(audio_start_ms=max(first - cfg.prefix_padding_ms, 0))
            return None
        if p >= cfg.threshold - cfg.release:
            self._run, self._speech_end_ms = 0, now
            self._voiced()
            return None
        self._run += 1
        return self._stop() if self._turn_over(self._run) else None

    def _stop(self) -> SpeechStopped:
        """End the turn now (the current frame's end)."""
        self._in_speech, self._run = False, 0
        return SpeechStopped(audio_end_ms=self.elapsed_ms, speech_end_ms=self._speech_end_ms)

    def poll(self) -> SpeechStopped | None:
        """An end of turn decided since the last frame, between frames (semantic_vad's model answering
        from a worker thread); server_vad decides on frames only."""
        return None

    @property
    def pending(self) -> Any:
        """A decision being made off this thread (a `concurrent.futures.Future`), or None."""
        return None

    def _voiced(self) -> None:
        """A voiced frame during a turn: any pause is over."""

    def _heard(self, frame: np.ndarray) -> None:
        """Every analysed frame, in order (a subclass that needs the audio keeps it)."""

    def _turn_over(self, silent_frames: int) -> bool:
        """Whether `silent_frames` of silence after speech end the turn: server_vad's fixed window."""
        return silent_frames >= self._silence_frames


@dataclass(frozen=True)
class Turn:
    """One user turn's audio: 16 kHz float32 samples of [audio_start_ms, audio_end_ms)."""

    audio: np.ndarray
    audio_start_ms: int
    audio_end_ms: int
    speech_end_ms: int | None = None  # where the voice ended (None: the turn was committed by hand)
    type: Literal["turn"] = "turn"


class TurnSegmenter:
    """A `ServerVad` that also keeps the audio: each speech_stopped is followed by the `Turn` it closed.

    Memory is bounded while idle (the last prefix_padding + min_speech + two frames of audio, what a
    speech_started can reach back to, and a frame not yet analysed); during a turn it holds the turn (the caller bounds turn length
    with `turn_ms`, as the Realtime API bounds its input buffer). `commit()` ends a turn early (a
    client's `input_audio_buffer.commit` while the user is still talking), `clear()` drops it.

    `detect=False` is the Realtime API's `turn_detection: null`: no detector runs, a turn is always
    open, and it holds everything pushed since the last commit or clear until `commit()` takes it.
    """

    def __init__(self, cfg: VadConfig | SemanticVadConfig | None = None, *, detect: bool = True) -> None:
        self.vad = (cfg or VadConfig()).detector()  # server_vad's detector, or semantic_vad's
        self.detect = detect
        if detect:
            self.vad.load()
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
    def pushed_ms(self) -> float:
        """Milliseconds of audio pushed in all (analysed or not)."""
        return self._pushed * 1000 / self.vad.cfg.sample_rate

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
                out.append(self._take(ev.audio_end_ms, ev.speech_end_ms))
        self._trim()
        return out

    @property
    def turn_start_ms(self) -> int | None:
        """Where the open turn's audio starts (None: no turn is open)."""
        return self._turn_start_ms

    def samples(self, lo: int, hi: int) -> np.ndarray:
        """Samples [lo, hi) of everything pushed (indices from the start), from what is still buffered:
        a caller following the open turn reads its newest audio without joining the whole turn."""
        out, end = [], self._pushed
        for c in reversed(self._chunks):
            start = end - len(c)
            if start < hi and end > lo:
                out.append(c[max(lo - start, 0) : min(hi, end) - start])
            if start <= lo:
                break
            end = start
        return np.concatenate(out[::-1]) if out else np.zeros(0, np.float32)

    def poll(self) -> list[SpeechStopped | Turn]:
        """A turn the detector ended between pushes (see `ServerVad.poll`): its SpeechStopped and Turn."""
        ev = self.vad.poll() if self.detect else None
        return [] if ev is None else [ev, self._take(ev.audio_end_ms, ev.speech_end_ms)]

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

    def _take(self, end_ms: int, speech_end_ms: int | None = None) -> Turn:
        start_ms = self._turn_start_ms if self._turn_start_ms is not None else end_ms
        buf = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)
        lo, hi = self._samples(start_ms) - self._start, self._samples(end_ms) - self._start
        self._turn_start_ms = None
        self._last_end_ms = end_ms
        audio = buf[max(lo, 0) : hi].copy()
        return Turn(audio=audio, audio_start_ms=start_ms, audio_end_ms=end_ms, speech_end_ms=speech_end_ms)

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
