"""The turn being spoken, on its way to the model before it ends: its audio goes to the encoder as it
arrives (`Session.live_speech`), and a pause that may end it is offered for a speculative reply.

What the model hears of a turn the detector ended is its audio up to `TAIL_MS` after the voice ended
(`model_audio`), not the rest of the silence window or the end-of-turn model's wait. That is what
makes a reply started at the pause exact: when the silence has reached `TAIL_MS`, all of the audio the
model will hear if the turn ends there has arrived, so a reply started then (`LiveTurn.follow` gives
the clip) is the reply the end of the turn would start. The silence after carries nothing to answer.
`TAIL_MS` is semantic_vad's default `pause_ms`, where its end-of-turn model is asked, so both detectors
speculate at the same pause; a shorter pause (the gaps between words) would start and drop a reply
several times a sentence.

Audio is fed only as far as it is sure to be in the turn: up to the voice's end plus `TAIL_MS`, and
no further than the detector has analysed (a turn ends on a frame it analysed). Whatever happens
next, the turn's model audio starts with what was fed, so no fed sample is ever taken back.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from omni_rt.server.speech import SPEECH_RATE

TAIL_MS = 160


def model_audio(turn: Any) -> np.ndarray:
    """The samples of a turn the model hears (a turn committed by hand, or cut at the longest turn,
    has no detected end of speech: all of it)."""
    if turn.speech_end_ms is None:
        return turn.audio
    keep = (turn.speech_end_ms + TAIL_MS - turn.audio_start_ms) * SPEECH_RATE // 1000
    return turn.audio[: max(keep, 0)]


class LiveTurn:
    """One open turn's `LiveSpeech` (the session's) and the pause, if any, a reply was offered at."""

    def __init__(self, live: Any, start_ms: int) -> None:
        self.live = live
        self._start = start_ms * SPEECH_RATE // 1000  # the turn's first sample on the buffer's timeline
        self._paused_at: int | None = None  # speech_end_ms of the pause offered
        self._pause_clip: Any = None

    def follow(self, segmenter: Any) -> tuple[bool, bool]:
        """After a push, while the turn is open: feed what is sure to be in it. Returns (speech resumed
        after the pause offered, a new pause that may end the turn began: `pause_clip` is its clip)."""
        vad = segmenter.vad
        end, analysed = vad.speech_end_ms, vad.elapsed_ms
        resumed = self._paused_at is not None and end > self._paused_at
        if resumed:
            self._paused_at = self._pause_clip = None
        upto = (min(analysed, end + TAIL_MS) * SPEECH_RATE // 1000) - self._start
        if upto > self.live.samples:
            self.live.push(segmenter.samples(self._start + self.live.samples, self._start + upto))
        if self._paused_at is None and analysed - end >= TAIL_MS:
            self._paused_at = end
            return resumed, True
        return resumed, False

    def pause_clip(self) -> Any:
        """The turn as it stands at the pause (made when asked: only a speculative reply needs it)."""
        if self._pause_clip is None:
            self._pause_clip = self.live.clip()
        return self._pause_clip

    def finish(self, audio: np.ndarray) -> Any:
        """The clip of the turn's model audio: the pause's own when the turn ended there (the reply
        started at it answers exactly this), else the stream's, fed the rest. None: not encodable so."""
        if self._pause_clip is not None and self._pause_clip.same_audio(audio):
            return self._pause_clip
        if self.live.samples > len(audio):  # cannot happen (see the module doc): encode it whole
            return None
        self.live.push(audio[self.live.samples :])
        return self.live.clip()
