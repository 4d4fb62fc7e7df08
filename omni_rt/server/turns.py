"""Latency of a reply to a spoken turn, counted from where the user stopped talking.

    arrivals = ArrivalLog()
    arrivals.note(audio_ms_received_so_far, time.monotonic())   # on every piece of input audio
    clock = SpokenTurnClock.from_turn(turn, arrivals)          # when the detector closes a turn
    clock.audio_out(time.monotonic())                          # the reply's first audio goes out
    clock.metrics()   # {"end_of_speech_ms": ..., "voice_to_voice_ms": ...}

`end_of_speech_ms` is where the voice ended on the input audio buffer's timeline (what the detector
found, before its silence window or the end-of-turn model's decision), as `speech_stopped` times count.
`voice_to_voice_ms` is the time from then to the reply's first audio leaving the server: the end of
speech is dated by when the audio holding it arrived, so the figure includes the silence window (or the
semantic wait), the encoder and the model, and holds whether the client streams in real time or sends a
recording at once. The client's own figure adds the network and its playout.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

__all__ = ["ArrivalLog", "SpokenTurnClock", "when_answered"]


class ArrivalLog:
    """When each stretch of input audio arrived: (audio ms received so far, monotonic time) per push.

    Bounded: a turn never reaches back further than the longest turn, and pushes come every 10-100 ms.
    """

    def __init__(self, keep: int = 4096) -> None:
        self._log: collections.deque[tuple[float, float]] = collections.deque(maxlen=keep)

    def note(self, received_ms: float, now: float) -> None:
        self._log.append((received_ms, now))

    def when(self, audio_ms: float) -> float | None:
        """The arrival time of the audio at `audio_ms` on the timeline; None if it is no longer known."""
        for received, at in self._log:
            if received >= audio_ms:
                return at
        return None


@dataclass
class SpokenTurnClock:
    speech_end_ms: int
    speech_end_at: float  # monotonic time the end of speech arrived
    first_audio_at: float | None = None

    @classmethod
    def from_turn(cls, turn: Any, arrivals: ArrivalLog) -> SpokenTurnClock | None:
        """For a turn the detector closed; None for a committed one (no end of speech is known)."""
        end = getattr(turn, "speech_end_ms", None)
        at = None if end is None else arrivals.when(end)
        return None if at is None else cls(speech_end_ms=end, speech_end_at=at)

    def audio_out(self, now: float) -> None:
        if self.first_audio_at is None:
            self.first_audio_at = now

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"end_of_speech_ms": self.speech_end_ms}
        if self.first_audio_at is not None:
            out["voice_to_voice_ms"] = round(1000.0 * (self.first_audio_at - self.speech_end_at), 1)
        return out


def when_answered(answer: Any, loop: Any, callback: Any) -> None:
    """Run `callback()` on `loop` once `answer` (semantic_vad's end-of-turn model on its worker thread,
    a `concurrent.futures.Future`) is done: the turn may end then, with no more audio coming."""
    answer.add_done_callback(lambda _: loop.call_soon_threadsafe(callback))
