"""The user's transcript in pipecat: a spoken turn is transcribed by the Thinker after its reply's first audio
and goes upstream as `InterimTranscriptionFrame`s and a `TranscriptionFrame`, which pipecat's user context
aggregator writes into the context ahead of the reply; a transcription that cannot run is a non-fatal
`ErrorFrame` while the reply plays on. The tiny preset's random weights make the text noise: the mechanism
is the real one. Ordered by events (`pipecat_support`), never sleeps."""

from __future__ import annotations

import numpy as np
import pytest
from integrations_support import silence, spoken, tiny_engine
from pipecat.frames.frames import (
    ErrorFrame,
    Frame,
    InterimTranscriptionFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat_support import Await, run_pipeline
from test_integrations_pipecat import REPLY, Tap, audio_frames

from omni_rt.integrations.pipecat import OmniRtService

SHORT = dict(max_output_tokens=1, max_audio_frames=1, ignore_eos=True)  # over at its first audio


@pytest.fixture
def engine():
    return tiny_engine()


class Upstream(FrameProcessor):
    """Records the frames going upstream past it (a context aggregator in front consumes the transcript)."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[Frame] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == FrameDirection.UPSTREAM:
            self.frames.append(frame)
        await self.push_frame(frame, direction)


def watch(engine, service: OmniRtService, monkeypatch) -> list[int]:
    """Each transcription session the engine opens (one with no settings: the service's own has its voice)
    is recorded as how many audio frames the service had pushed by then."""
    pushed, opened = [0], []
    push_frame, session_of = service.push_frame, engine.session

    async def push(frame: Frame, direction: FrameDirection = FrameDirection.DOWNSTREAM) -> None:
        pushed[0] += isinstance(frame, TTSAudioRawFrame)
        await push_frame(frame, direction)

    def session(**kwargs):
        if not kwargs:
            opened.append(pushed[0])
        return session_of(**kwargs)

    monkeypatch.setattr(service, "push_frame", push)
    monkeypatch.setattr(engine, "session", session)
    return opened


@pytest.mark.parametrize("reply", [REPLY, SHORT], ids=["reply", "short-reply"])
async def test_a_spoken_turns_transcript_goes_upstream_into_the_context(engine, monkeypatch, reply) -> None:
    """omni_rt's VAD cuts the turn; after the reply's first audio the turn is transcribed: interim frames
    and one final `TranscriptionFrame` (the service's user_id, a timestamp) go upstream, and the user
    aggregator writes its text into the context as the user's message, ahead of the reply's (a reply
    that ends before its transcript does waits for it, or the aggregator would have nothing to write)."""
    hello, rate = spoken("Good morning to you")
    service = OmniRtService(engine, turn_detection="omni_rt", user_transcription=True, user_id="ada", **reply)
    opened = watch(engine, service, monkeypatch)
    context = LLMContext()
    pair = LLMContextAggregatorPair(context)
    up, tap = Upstream(), Tap()
    frames = [
        *audio_frames(np.concatenate([silence(0.3, rate), hello, silence(1.0, rate)]), rate),
        Await(tap.ended[0], "the reply's end"),
    ]
    async with engine:
        await run_pipeline(Pipeline([pair.user(), up, service, tap, pair.assistant()]), frames)
    finals = [f for f in up.frames if isinstance(f, TranscriptionFrame)]
    assert len(finals) == 1, up.frames
    final = finals[0]
    assert final.user_id == "ada" and final.timestamp and final.finalized
    assert final.result.error is None and final.result.text == final.text
    interim = [f for f in up.frames if isinstance(f, InterimTranscriptionFrame)]
    assert all(f.user_id == "ada" for f in interim)
    assert interim and interim[-1].text.strip() == final.text  # the text so far, then the whole
    assert not any(isinstance(f, ErrorFrame) for f in up.frames)
    # the transcription ran once, and only once the reply's audio had been pushed
    assert len(opened) == 1 and opened[0] > 0, opened
    roles = [(m["role"], m.get("content")) for m in context.get_messages()]
    assert roles[0] == ("user", final.text) and roles[1][0] == "assistant", roles


async def test_no_free_session_slot_is_a_non_fatal_error_and_the_reply_plays_on(engine, monkeypatch) -> None:
    """Every engine slot but the service's is taken: the turn's transcription cannot run. An `ErrorFrame`
    upstream (not fatal) names `session_limit`, after the reply's first audio; the reply plays to its end;
    no transcript is claimed."""
    hello, rate = spoken("Good morning to you")
    service = OmniRtService(engine, turn_detection="omni_rt", user_transcription=True, **REPLY)
    opened = watch(engine, service, monkeypatch)
    tap = Tap()
    frames = [
        *audio_frames(np.concatenate([silence(0.3, rate), hello, silence(1.0, rate)]), rate),
        Await(tap.ended[0], "the reply's end"),
    ]
    async with engine:
        taken = [engine.session(voice="ethan") for _ in range(engine.settings.max_sessions - 1)]
        try:
            down, up = await run_pipeline(Pipeline([service, tap]), frames)
        finally:
            for s in taken:
                await s.close()
    errors = [f for f in up if isinstance(f, ErrorFrame)]
    assert len(errors) == 1 and not errors[0].fatal, up
    assert "transcribe" in errors[0].error and "session_limit" in errors[0].error
    assert not any(isinstance(f, TranscriptionFrame | InterimTranscriptionFrame) for f in up)
    assert len(opened) == 1 and opened[0] > 0, opened
    assert not OmniRtService(engine).user_transcription  # off by default (the module doc says why)
    audio = sum(f.num_frames for f in down if isinstance(f, TTSAudioRawFrame))
    assert 31 * 1920 < audio <= 32 * 1920  # the whole reply
