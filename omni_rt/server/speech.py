"""Speech input of one connection: the client's audio → 16 kHz mono → server VAD → user turns.

Audio arrives as WebRTC frames (aiortc's Opus decoder gives 48 kHz stereo s16) or as
`input_audio_buffer.append` events (24 kHz mono PCM16). Both are downmixed and resampled to 16 kHz
with the SDK's streaming resampler and fed to one `TurnSegmenter`, so the two paths find the same
turns. Everything here is numpy on 20 ms frames: cheap enough for the event loop, which must keep
reading the remote track.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omni_rt.audio.resample import StreamingResampler
from omni_rt.audio.semantic import SemanticVadConfig
from omni_rt.audio.vad import SpeechStarted, SpeechStopped, Turn, TurnSegmenter, VadConfig
from omni_rt.server.protocol import ProtocolError
from omni_rt.server.turns import ArrivalLog

SPEECH_RATE = 16_000  # what the VAD and the model's audio tower take
MIN_COMMIT_MS = 100  # a shorter turn is a mistake, not speech (OpenAI refuses it too)


@dataclass(frozen=True)
class TurnDetection:
    """`turn_detection` of type `server_vad` or `semantic_vad`: the detector's settings and what a turn
    triggers."""

    vad: VadConfig | SemanticVadConfig = field(default_factory=VadConfig)
    create_response: bool = True  # answer each turn when it ends
    interrupt_response: bool = True  # speech cancels the reply in progress (barge-in)
    # omni_rt's extension: a reply starts at a pause that may end the turn, held back until it does
    # (server/speculative.py); false: replies start when the turn has ended
    speculative_response: bool = True

    @classmethod
    def from_wire(cls, fields: Any) -> TurnDetection:
        """From a client's `turn_detection` object: missing fields take the defaults."""
        base = cls()
        semantic = getattr(fields, "type", "server_vad") == "semantic_vad"
        names = ("eagerness",) if semantic else ("threshold", "prefix_padding_ms", "silence_duration_ms")
        changes = {n: getattr(fields, n) for n in names if getattr(fields, n, None) is not None}
        return cls(
            # the event loop never waits for the end-of-turn model: it answers from a worker thread
            vad=SemanticVadConfig(offload=True, **changes) if semantic else VadConfig(**changes),
            create_response=base.create_response
            if fields.create_response is None
            else fields.create_response,
            interrupt_response=(
                base.interrupt_response if fields.interrupt_response is None else fields.interrupt_response
            ),
            speculative_response=(
                base.speculative_response
                if getattr(fields, "speculative_response", None) is None
                else fields.speculative_response
            ),
        )

    def to_wire(self) -> dict[str, Any]:
        if isinstance(self.vad, SemanticVadConfig):
            detector: dict[str, Any] = {"type": "semantic_vad", "eagerness": self.vad.eagerness}
        else:
            detector = {
                "type": "server_vad",
                "threshold": self.vad.threshold,
                "prefix_padding_ms": self.vad.prefix_padding_ms,
                "silence_duration_ms": self.vad.silence_duration_ms,
            }
        return {
            **detector,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
            "speculative_response": self.speculative_response,
        }


class InputRate:
    """How fast a connection's input audio may come: a burst of `burst_ms` (a recording sent at once),
    then `speed` times real time. Resampling and VAD run on the event loop that serves every
    connection, so audio sent at hundreds of times real time would take it over."""

    def __init__(self, burst_ms: float = 30_000, speed: float = 4.0, clock: Any = time.monotonic) -> None:
        self.burst_ms, self.speed, self._clock = burst_ms, speed, clock
        self._budget_ms = burst_ms
        self._t = clock()

    def take(self, ms: float) -> bool:
        """Whether `ms` of audio may come now (and if so, counts it)."""
        now = self._clock()
        self._budget_ms = min(self.burst_ms, self._budget_ms + (now - self._t) * 1000 * self.speed)
        self._t = now
        if ms > self._budget_ms:
            return False
        self._budget_ms -= ms
        return True


class InputAudioBuffer:
    """The Realtime API's input audio buffer for one connection, with or without server VAD.

    `push()` returns what the audio completed: `SpeechStarted`, `SpeechStopped`, `Turn` (VAD on). A
    turn that reaches `max_turn_ms` is ended there, as if the speaker had paused (`SpeechStopped` at
    that point, then the `Turn`), so memory stays bounded. Without VAD the audio waits for `commit()`;
    past `max_turn_ms` a push is refused (`input_audio_buffer_full`).
    """

    def __init__(self, turn_detection: TurnDetection | None, max_turn_ms: int) -> None:
        self.turn_detection = turn_detection
        self.max_turn_ms = max_turn_ms
        vad = turn_detection.vad if turn_detection is not None else None
        self.segmenter = TurnSegmenter(vad, detect=turn_detection is not None)
        self._resamplers: dict[int, StreamingResampler] = {}  # one per input rate (one per source)
        self.arrivals = ArrivalLog()  # when the audio came: latency figures count from the end of speech

    @property
    def buffered_ms(self) -> int:
        """Audio a `commit()` would take now."""
        return self.segmenter.turn_ms

    def push(
        self, pcm: np.ndarray, rate: int, channels: int = 1
    ) -> list[SpeechStarted | SpeechStopped | Turn]:
        """Interleaved PCM (int16, or float in [-1, 1]) of `channels` channels at `rate` Hz."""
        audio = to_speech_rate(pcm, rate, channels, self._resamplers)
        if (
            self.turn_detection is None
            and self.segmenter.turn_ms + len(audio) * 1000 // SPEECH_RATE > self.max_turn_ms
        ):
            raise ProtocolError(
                "input_audio_buffer_full",
                f"the input audio buffer holds at most {self.max_turn_ms / 1000:g} s: commit or clear it",
            )
        self.arrivals.note(self.segmenter.pushed_ms + len(audio) * 1000 / SPEECH_RATE, time.monotonic())
        events: list[SpeechStarted | SpeechStopped | Turn] = []
        while True:
            room = len(audio)
            if self.segmenter.in_speech:  # a turn ends at max_turn_ms exactly, not a chunk later
                room = max((self.max_turn_ms - self.segmenter.turn_ms) * SPEECH_RATE // 1000, 0)
            part, audio = audio[:room], audio[room:]
            events += self.segmenter.push(part)
            if self.segmenter.in_speech and self.segmenter.turn_ms >= self.max_turn_ms:
                turn = self.segmenter.commit()
                assert turn is not None  # a turn is open while in speech
                events += [SpeechStopped(audio_end_ms=turn.audio_end_ms), turn]
            if not len(audio):
                return events

    @property
    def pending(self) -> Any:
        """semantic_vad's end-of-turn answer being computed on a worker thread (a Future), or None."""
        return self.segmenter.vad.pending if self.segmenter.detect else None

    def poll(self) -> list[SpeechStopped | Turn]:
        """The turn that answer ended, if it did (call once `pending` is done)."""
        return self.segmenter.poll()

    def commit(self) -> Turn:
        """The audio buffered for the open turn, as a turn; refused when there is (almost) none."""
        if self.buffered_ms < MIN_COMMIT_MS:
            raise ProtocolError(
                "input_audio_buffer_commit_empty",
                f"buffer too small: expected at least {MIN_COMMIT_MS} ms of audio, "
                f"but the buffer holds {self.buffered_ms} ms",
            )
        turn = self.segmenter.commit()
        assert turn is not None
        return turn

    def clear(self) -> None:
        self.segmenter.clear()


def to_speech_rate(
    pcm: np.ndarray, rate: int, channels: int, resamplers: dict[int, StreamingResampler]
) -> np.ndarray:
    """Interleaved PCM → 16 kHz mono float32, through the streaming resampler kept for `rate`."""
    x = np.asarray(pcm).reshape(-1)
    if x.dtype == np.int16:
        x = x.astype(np.float32) / 32768.0
    elif not np.issubdtype(x.dtype, np.floating):
        raise ProtocolError("invalid_value", f"audio must be PCM16 or float, not {x.dtype}", param="audio")
    if channels > 1:
        usable = len(x) - len(x) % channels
        x = x[:usable].reshape(-1, channels).mean(axis=1)  # downmix: the VAD and the model hear mono
    resampler = resamplers.get(rate)
    if resampler is None:
        resampler = resamplers[rate] = StreamingResampler(rate, SPEECH_RATE)
    return resampler.push(x)
