"""The open turn on its way to the encoder (omni_rt.server.live_turn), on a real server_vad segmenter:
what is fed is always the start of what the model will hear, the pause's clip is exactly the turn when
it ends there, and a voice after the pause is reported."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from server_fakes import speech_like  # noqa: E402

from omni_rt.audio.vad import SpeechStarted, Turn, TurnSegmenter  # noqa: E402
from omni_rt.server.live_turn import TAIL_MS, LiveTurn, model_audio  # noqa: E402

SR = 16000


class Recorder:
    """A LiveSpeech stand-in: keeps what is pushed; a clip is the samples so far."""

    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []

    @property
    def samples(self) -> int:
        return sum(map(len, self.chunks))

    def push(self, audio: np.ndarray) -> None:
        self.chunks.append(np.asarray(audio, np.float32))

    def clip(self):
        return Clip(np.concatenate(self.chunks))


class Clip:
    def __init__(self, audio):
        self.audio = audio

    def same_audio(self, audio) -> bool:
        return len(audio) == len(self.audio) and np.array_equal(audio, self.audio)


def follow(audio: np.ndarray, chunk: int = 320):
    """Feed `audio` as a microphone does; returns (turns, the LiveTurn of the last turn, resumes, pauses)."""
    seg = TurnSegmenter()
    live, turns, resumes, pauses = None, [], 0, []
    for i in range(0, len(audio), chunk):
        for ev in seg.push(audio[i : i + chunk]):
            if isinstance(ev, SpeechStarted):
                live = LiveTurn(Recorder(), ev.audio_start_ms)
            elif isinstance(ev, Turn):
                turns.append((ev, live))
        if live is not None and seg.in_speech:
            resumed, paused = live.follow(seg)
            resumes += resumed
            if paused:
                pauses.append(live.pause_clip())
                fed = live.live.samples
                assert fed == (seg.vad.speech_end_ms + TAIL_MS) * SR // 1000 - live._start
    return turns, resumes, pauses


def silence(s: float) -> np.ndarray:
    return np.zeros(int(s * SR), np.float32)


def test_a_turn_that_ends_at_its_pause_is_the_pause_clip():
    audio = np.concatenate([silence(0.5), speech_like(1.0, SR, seed=1), silence(1.0)])
    turns, resumes, pauses = follow(audio)
    ((turn, live),) = turns
    heard = model_audio(turn)
    assert len(heard) == (turn.speech_end_ms + TAIL_MS - turn.audio_start_ms) * SR // 1000 < len(turn.audio)
    assert resumes == 0 and len(pauses) == 1 and pauses[0].same_audio(heard)
    assert live.finish(heard) is pauses[0]  # the reply started at the pause answers this turn


def test_speech_after_the_pause_is_reported_and_the_turn_goes_on():
    audio = np.concatenate(
        [silence(0.5), speech_like(0.8, SR, seed=2), silence(0.3), speech_like(0.6, SR, seed=3), silence(1.0)]
    )
    turns, resumes, pauses = follow(audio)
    ((turn, live),) = turns  # one turn: the 300 ms pause is inside server_vad's window
    heard = model_audio(turn)
    assert resumes == 1 and len(pauses) == 2
    assert not pauses[0].same_audio(heard) and pauses[1].same_audio(heard)
    # what was fed is the start of what the model hears
    fed = np.concatenate(live.live.chunks)
    assert np.array_equal(fed, heard[: len(fed)])


def test_a_turn_committed_by_hand_is_heard_whole():
    turn = Turn(audio=np.ones(8000, np.float32), audio_start_ms=0, audio_end_ms=500)
    assert len(model_audio(turn)) == 8000
